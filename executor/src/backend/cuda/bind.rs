//! Weights on a CUDA stage: the upload of every device-placed tensor and resident expert to
//! its planned offset (Q8_0 rearranged to the split layout of `layout`), and the seam's
//! binding of a model's tensors by name — matrices where the plan placed them, norm vectors
//! and small tables (conv taps) read in place or converted to f32 into the planned `norms`
//! buffer, each layer's expert
//! table written into the planned `tables` buffer.
//! Invariant: a tensor is bound only where the plan placed it on this device, with the dims
//! the forward pass asks for; nothing here allocates device memory.

use super::forward::{mat_bytes, CExperts, CMat, CVec, Stacks};
use super::launch::kty;
use super::stage::{CudaStage, Span};
use super::{layout, CudaDevice, CudaError, DeviceArena};
use crate::backend::{Bind, WorkBuf};
use crate::load::{self, HostModel};
use std::collections::HashMap;
use std::sync::Arc;
use strata_schemas::ggml::GgmlType;
use strata_schemas::plan::{DevicePlan, Placement, Plan, RegionKind};

fn plan_err(detail: impl Into<String>) -> CudaError {
    CudaError::Shape {
        op: "bind",
        detail: detail.into(),
    }
}

/// What binding a stage's tensors needs, dropped once they are bound.
pub(crate) struct Binder {
    host: Arc<dyn HostModel>,
    /// Tensors placed on this device: name -> arena offset.
    placed: HashMap<String, u64>,
    /// Resident experts: (layer, expert) -> expert-cache slot.
    slot_of: HashMap<(u32, u32), u32>,
    /// The expert cache region and the bytes of one slot.
    cache: Option<(u64, u64)>,
    /// Next free bytes of the `tables` and `norms` buffers.
    tables: Span,
    norms: Span,
}

impl Binder {
    pub(crate) fn new(
        plan: &Plan,
        dp: &DevicePlan,
        host: Arc<dyn HostModel>,
        bufs: &HashMap<WorkBuf, Span>,
    ) -> Self {
        let placed = plan
            .tensors
            .iter()
            .filter_map(|t| match t.placement {
                Placement::Device { device, offset } if device == dp.index => {
                    Some((t.name.clone(), offset))
                }
                _ => None,
            })
            .collect();
        let slot_of = dp
            .resident_experts
            .iter()
            .map(|re| ((re.layer, re.expert), re.slot))
            .collect();
        let cache = dp
            .region(RegionKind::ExpertCache)
            .map(|r| (r.offset, dp.expert_slot_bytes));
        Self {
            host,
            placed,
            slot_of,
            cache,
            tables: bufs.get(&WorkBuf::Tables).copied().unwrap_or_default(),
            norms: bufs.get(&WorkBuf::Norms).copied().unwrap_or_default(),
        }
    }

    /// A binder for tensors placed at `placed` (name -> arena offset), no expert cache.
    pub(crate) fn of_placed(
        host: Arc<dyn HostModel>,
        placed: HashMap<String, u64>,
        bufs: &HashMap<WorkBuf, Span>,
    ) -> Self {
        Self {
            host,
            placed,
            slot_of: HashMap::new(),
            cache: None,
            tables: bufs.get(&WorkBuf::Tables).copied().unwrap_or_default(),
            norms: bufs.get(&WorkBuf::Norms).copied().unwrap_or_default(),
        }
    }

    fn take(span: &mut Span, bytes: u64, what: &str) -> Result<u64, CudaError> {
        let b = bytes.div_ceil(16) * 16;
        if b > span.bytes {
            return Err(plan_err(format!(
                "the plan's `{what}` buffer is {} bytes short: re-plan with this build's strata-plan",
                b - span.bytes
            )));
        }
        let at = span.off;
        span.off += b;
        span.bytes -= b;
        Ok(at)
    }
}

impl CudaStage {
    fn binder(&mut self) -> Result<&mut Binder, CudaError> {
        self.binder
            .as_mut()
            .ok_or_else(|| plan_err("the stage's weights are already bound"))
    }

    /// Drop what binding needed (the model's host view stays with the engine).
    pub(crate) fn finish_binding(&mut self) {
        self.binder = None;
    }

    fn htod<T: super::Pod>(&self, off: u64, data: &[T]) -> Result<(), CudaError> {
        let v = self.view(off, std::mem::size_of_val(data) as u64)?;
        self.dev.htod(data, v)
    }
}

impl Bind for CudaStage {
    fn matrix(&mut self, name: &str, rows: usize, cols: usize) -> Result<CMat, CudaError> {
        let b = self.binder()?;
        let off = *b.placed.get(name).ok_or_else(|| {
            let why = if b.host.inventory().tensor(name).is_some() {
                "is in the model but the plan places no copy of it on this device's stage"
            } else {
                "is not in the model"
            };
            plan_err(format!(
                "`{name}` {why}: re-plan with this build's strata-plan"
            ))
        })?;
        let info = b
            .host
            .inventory()
            .tensor(name)
            .ok_or_else(|| plan_err(format!("`{name}` is not in the model inventory")))?;
        let ty = info.ggml_type;
        if kty(ty).is_none() {
            return Err(plan_err(format!(
                "`{name}` is {ty}, which the CUDA kernels do not read (they read every type the CPU reference decodes): requantize with `strata-gguf quantize`"
            )));
        }
        if info.dims.len() != 2 || info.dims[0] != cols as u64 || info.dims[1] != rows as u64 {
            return Err(plan_err(format!(
                "`{name}` has dims {:?}, expected [{cols}, {rows}]",
                info.dims
            )));
        }
        if off % 16 != 0 {
            return Err(plan_err(format!(
                "`{name}` at offset {off} is not 16-byte aligned"
            )));
        }
        Ok(CMat {
            off,
            ty,
            rows,
            cols,
        })
    }

    fn vector(&mut self, name: &str, n: usize) -> Result<CVec, CudaError> {
        let b = self.binder()?;
        let host = b.host.clone();
        let ty = host
            .inventory()
            .tensor(name)
            .map(|t| t.ggml_type)
            .ok_or_else(|| plan_err(format!("`{name}` is not in the model inventory")))?;
        let data = host
            .tensor_bytes(name)
            .ok_or_else(|| plan_err(format!("`{name}` is missing from the model")))?;
        if ty == GgmlType::F32 && data.len() == n * 4 {
            if let Some(&off) = b.placed.get(name).filter(|o| **o % 16 == 0) {
                return Ok(CVec { off, n });
            }
        }
        let mut v = vec![0f32; n];
        crate::quant::dequantize_row(ty, data, &mut v)
            .map_err(|e| plan_err(format!("`{name}`: {e}")))?;
        let off = Binder::take(&mut b.norms, 4 * n as u64, "norms")?;
        self.htod(off, &v)?;
        Ok(CVec { off, n })
    }

    fn table(&mut self, name: &str, rows: usize, cols: usize) -> Result<CVec, CudaError> {
        let b = self.binder()?;
        let host = b.host.clone();
        let info = host
            .inventory()
            .tensor(name)
            .ok_or_else(|| plan_err(format!("`{name}` is not in the model inventory")))?;
        let ty = info.ggml_type;
        let dims_ok = match info.dims.as_slice() {
            [c, r] => *c == cols as u64 && *r == rows as u64,
            _ => false,
        };
        if !dims_ok {
            return Err(plan_err(format!(
                "`{name}` has dims {:?}, expected [{cols}, {rows}]",
                info.dims
            )));
        }
        let data = host
            .tensor_bytes(name)
            .ok_or_else(|| plan_err(format!("`{name}` is missing from the model")))?;
        let n = rows * cols;
        // An F32 table is row-major `rows x cols` as stored: read in place.
        if ty == GgmlType::F32 && data.len() == n * 4 {
            if let Some(&off) = b.placed.get(name).filter(|o| **o % 16 == 0) {
                return Ok(CVec { off, n });
            }
        }
        let rb =
            crate::quant::row_bytes(ty, cols).map_err(|e| plan_err(format!("`{name}`: {e}")))?;
        if data.len() < rb * rows {
            return Err(plan_err(format!(
                "`{name}` holds {} bytes, {rows} rows of {cols} {ty} need {}",
                data.len(),
                rb * rows
            )));
        }
        let mut v = vec![0f32; n];
        for (r, o) in v.chunks_exact_mut(cols.max(1)).enumerate() {
            crate::quant::dequantize_row(ty, &data[r * rb..(r + 1) * rb], o)
                .map_err(|e| plan_err(format!("`{name}` row {r}: {e}")))?;
        }
        let off = Binder::take(&mut b.norms, 4 * n as u64, "norms")?;
        self.htod(off, &v)?;
        Ok(CVec { off, n })
    }

    fn experts_of(&mut self, layer: u32) -> Result<CExperts, CudaError> {
        let (e, f, ne) = (self.d.e, self.d.f, self.d.n_expert);
        let base = self.arena.all().ptr();
        let host_tier = self.xcache.is_some();
        let b = self.binder()?;
        let inv = b.host.inventory();
        let n = |p: &str| format!("blk.{layer}.ffn_{p}_exps.weight");
        let ty_of = |s: &str| {
            inv.tensor(&n(s))
                .map(|t| t.ggml_type)
                .ok_or_else(|| plan_err(format!("`{}` is not in the model inventory", n(s))))
        };
        let (ty, ty_up, ty_down) = (ty_of("gate")?, ty_of("up")?, ty_of("down")?);
        if kty(ty).is_none() || kty(ty_up).is_none() || kty(ty_down).is_none() {
            return Err(plan_err(format!(
                "the experts of layer {layer} are {ty}/{ty_up}/{ty_down}, which the CUDA kernels do not read"
            )));
        }
        let per_gu = mat_bytes(ty, f, e)?;
        let per_up = mat_bytes(ty_up, f, e)?;
        let per_down = mat_bytes(ty_down, e, f)?;
        let stacks = [n("gate"), n("up"), n("down")];
        let whole: Option<[u64; 3]> = match (
            b.placed.get(&stacks[0]),
            b.placed.get(&stacks[1]),
            b.placed.get(&stacks[2]),
        ) {
            (Some(g), Some(u), Some(d)) => Some([*g, *u, *d]),
            _ => None,
        };
        // Offsets (in the arena) of every expert's gate, up and down matrices.
        let mut offs = vec![0u64; ne * 3];
        // A stage with an expert cache serves every layer whose stacks stay in host memory
        // through it (its slots are shared: a resident expert may be evicted by another
        // layer's miss); an expert in no slot points at a placeholder until fetched.
        let cached = host_tier && whole.is_none();
        for x in 0..ne {
            let at = match whole {
                Some([g, u, d]) => [
                    g + x as u64 * per_gu,
                    u + x as u64 * per_up,
                    d + x as u64 * per_down,
                ],
                None if cached && !b.slot_of.contains_key(&(layer, x as u32)) => {
                    let (region, _) = b.cache.unwrap_or_default();
                    super::expert_cache::placeholder(region, per_gu)
                }
                None => {
                    let (Some(s), Some((region, slot_bytes))) =
                        (b.slot_of.get(&(layer, x as u32)), b.cache)
                    else {
                        return Err(plan_err(format!(
                            "expert {x} of layer {layer} is not resident on this device: the CUDA engine in this build needs every expert in VRAM (the host-expert cache path runs with --backend cpu); re-plan with more VRAM or fewer layers per device"
                        )));
                    };
                    let so = region + *s as u64 * slot_bytes;
                    [so, so + per_gu, so + per_gu + per_up]
                }
            };
            offs[3 * x..3 * x + 3].copy_from_slice(&at);
        }
        // The grouped prefill products read gate and up with one kernel type (down may have
        // its own), every expert at a fixed stride.
        let stacks = (|| {
            if cached || ne < 2 || ty != ty_up {
                return None;
            }
            let gs = offs[3].checked_sub(offs[0])?;
            let ds = offs[5].checked_sub(offs[2])?;
            let uniform = (0..ne).all(|x| {
                offs[3 * x] == offs[0] + x as u64 * gs
                    && offs[3 * x + 1] == offs[1] + x as u64 * gs
                    && offs[3 * x + 2] == offs[2] + x as u64 * ds
            });
            (uniform && gs > 0 && gs % 16 == 0 && ds % 16 == 0).then_some(Stacks {
                gate: offs[0],
                up: offs[1],
                down: offs[2],
                gu_stride: gs,
                down_stride: ds,
            })
        })();
        let table: Vec<u64> = offs.iter().map(|o| base + o).collect();
        let table_off = Binder::take(&mut b.tables, (table.len() * 8) as u64, "tables")?;
        self.htod(table_off, &table)?;
        if let (true, Some(c)) = (cached, self.xcache.as_mut()) {
            c.register_layer(
                layer,
                table_off,
                table,
                [(ty, f, e), (ty_up, f, e), (ty_down, e, f)],
            )?;
        }
        Ok(CExperts {
            table_off,
            ty,
            ty_up,
            ty_down,
            stacks,
        })
    }

    fn has(&self, name: &str) -> bool {
        self.binder
            .as_ref()
            .is_some_and(|b| b.host.inventory().tensor(name).is_some())
    }
}

/// Shape of a tensor as (matrices, rows, cols) from its GGUF dims.
fn shape3(dims: &[u64]) -> (usize, usize, usize) {
    let cols = dims.first().copied().unwrap_or(1) as usize;
    let rows = dims.get(1).copied().unwrap_or(1) as usize;
    let mats = dims.iter().skip(2).product::<u64>().max(1) as usize;
    (mats, rows, cols)
}

/// Copy every device-placed tensor and every resident expert to its planned place (arena i
/// on `devs[i]`).
pub(crate) fn upload_weights(
    plan: &Plan,
    devs: &[&CudaDevice],
    arenas: &[DeviceArena],
    host: &dyn HostModel,
    progress: bool,
) -> Result<(), CudaError> {
    let inv = host.inventory();
    let total: u64 = plan
        .tensors
        .iter()
        .filter(|t| matches!(t.placement, Placement::Device { .. }))
        .map(|t| t.bytes)
        .sum::<u64>()
        + plan
            .devices
            .iter()
            .map(|d| d.resident_experts.len() as u64 * d.expert_slot_bytes)
            .sum::<u64>();
    let bar = load::progress_bar(progress, total, "loading to GPU");
    let arena_of = |dev_index: u32| -> Result<usize, CudaError> {
        plan.devices
            .iter()
            .position(|d| d.index == dev_index)
            .ok_or_else(|| {
                plan_err(format!(
                    "a tensor is placed on device {dev_index}, which the plan does not list"
                ))
            })
    };
    type Tensor<'b> = (GgmlType, (usize, usize, usize), &'b [u8]);
    let bytes_of = |name: &str| -> Result<Tensor<'_>, CudaError> {
        let info = inv
            .tensor(name)
            .ok_or_else(|| plan_err(format!("`{name}` is not in the model inventory")))?;
        let data = host.tensor_bytes(name).ok_or_else(|| {
            plan_err(format!(
                "`{name}` is missing from {}",
                host.path().display()
            ))
        })?;
        Ok((info.ggml_type, shape3(&info.dims), data))
    };
    let mut tmp: Vec<u8> = Vec::new();
    let mut put = |ai: usize, offset: u64, ty: GgmlType, src: &[u8], (mats, rows, cols)| {
        tmp.resize(src.len(), 0);
        layout::to_device(ty, src, mats, rows, cols, &mut tmp)
            .map_err(|e| plan_err(e.to_string()))?;
        let view = arenas[ai].view(offset, src.len() as u64)?;
        devs[ai].htod(&tmp[..], view)
    };
    for t in &plan.tensors {
        let Placement::Device { device, offset } = t.placement else {
            continue;
        };
        let (ty, shape, data) = bytes_of(&t.name)?;
        put(arena_of(device)?, offset, ty, data, shape)?;
        bar.inc(t.bytes);
    }
    // Resident experts: slot = gate, up, down matrices back to back.
    for (ai, dp) in plan.devices.iter().enumerate() {
        let Some(region) = dp.region(RegionKind::ExpertCache) else {
            continue;
        };
        for re in &dp.resident_experts {
            let mut off = region.offset + re.slot as u64 * dp.expert_slot_bytes;
            for p in ["gate", "up", "down"] {
                let name = format!("blk.{}.ffn_{p}_exps.weight", re.layer);
                let (ty, (mats, rows, cols), data) = bytes_of(&name)?;
                let per = data.len() / mats.max(1);
                let e = re.expert as usize;
                if e >= mats {
                    return Err(plan_err(format!(
                        "resident expert {e} of layer {} is beyond `{name}`'s {mats} experts",
                        re.layer
                    )));
                }
                put(ai, off, ty, &data[e * per..(e + 1) * per], (1, rows, cols))?;
                off += per as u64;
            }
            bar.inc(dp.expert_slot_bytes);
        }
    }
    bar.finish_and_clear();
    Ok(())
}

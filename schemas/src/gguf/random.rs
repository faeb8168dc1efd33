//! Deterministic random-weight models in llama.cpp's layout, for tests and benchmarks at real
//! shapes: values from a splitmix64 stream keyed by (seed, tensor name, row chunk), so any row
//! range can be regenerated without the rest, quantized per the recipe and streamed to disk.
//! Invariant: the same seed, architecture, hyperparameters and recipe give byte-identical
//! files; every value is finite and in a plausible range for its tensor's role.

use super::metadata::{arch_metadata, file_type, Vocab};
use super::write::{GgufStream, GgufWriteError, GgufWriter, ProgressFn, WriteSummary};
use super::GgufValue;
use crate::arch::{self, QuantRecipe};
use crate::ggml::GgmlType;
use crate::inventory::{HParams, TensorInfo};
use crate::quant::{self};
use std::path::Path;

/// splitmix64's output function.
fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// A splitmix64 generator: tiny, fast, deterministic across platforms.
#[derive(Debug, Clone)]
pub struct SplitMix64(u64);

impl SplitMix64 {
    pub fn new(seed: u64) -> Self {
        Self(seed)
    }
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        mix64(self.0)
    }
    /// Uniform in [0, 1).
    pub fn unit(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 24) as f32
    }
    /// Approximately standard normal: the sum of four 16-bit uniforms (Irwin-Hall),
    /// centred and scaled to unit variance; bounded by +-3.46, so never infinite.
    pub fn normalish(&mut self) -> f32 {
        let r = self.next_u64();
        let s = (r & 0xFFFF) + ((r >> 16) & 0xFFFF) + ((r >> 32) & 0xFFFF) + (r >> 48);
        // Mean 4 * 32767.5, variance 4 * (65536^2 - 1) / 12.
        const MEAN: f32 = 131_070.0;
        const INV_STD: f32 = 1.0 / 37_837.227;
        (s as f32 - MEAN) * INV_STD
    }
}

/// FNV-1a of a tensor name: the per-tensor seed, so a tensor's values do not depend on its
/// position or type.
fn name_hash(name: &str) -> u64 {
    let mut h = 0xCBF2_9CE4_8422_2325u64;
    for b in name.bytes() {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01B3);
    }
    h
}

/// How a tensor's random values are drawn, from its name.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Dist {
    Normal {
        mean: f32,
        std: f32,
    },
    /// Uniform in [lo, hi).
    Uniform {
        lo: f32,
        hi: f32,
    },
}

impl Dist {
    /// Root mean square of the distribution (the scale random quantized blocks are drawn at).
    fn rms(self) -> f32 {
        match self {
            Dist::Normal { mean, std } => (mean * mean + std * std).sqrt(),
            Dist::Uniform { lo, hi } => ((lo * lo + lo * hi + hi * hi) / 3.0).sqrt(),
        }
    }
}

fn dist_for(name: &str) -> Dist {
    let base = name.strip_suffix(".weight").unwrap_or(name);
    if base.ends_with("ssm_a") {
        // -exp(A_log) with A in [1, 16): always negative, as the converter stores it.
        Dist::Uniform {
            lo: -16.0,
            hi: -1.0,
        }
    } else if base.contains("norm") {
        Dist::Normal {
            mean: 1.0,
            std: 0.02,
        }
    } else if base.ends_with("ssm_dt.bias")
        || base.ends_with("ssm_dt")
        || base.ends_with("ssm_conv1d")
    {
        Dist::Normal {
            mean: 0.0,
            std: 0.1,
        }
    } else {
        Dist::Normal {
            mean: 0.0,
            std: 0.02,
        }
    }
}

/// Fill `out` with draws from `dist`, in order.
fn fill(dist: Dist, rng: &mut SplitMix64, out: &mut [f32]) {
    match dist {
        Dist::Normal { mean, std } => {
            for v in out.iter_mut() {
                *v = mean + std * rng.normalish();
            }
        }
        Dist::Uniform { lo, hi } => {
            for v in out.iter_mut() {
                *v = lo + (hi - lo) * rng.unit();
            }
        }
    }
}

/// Elements per generation chunk (rounded to whole rows): chunks are the unit of both
/// parallelism and seeding, so the bytes do not depend on the thread count.
const CHUNK_ELEMS: u64 = 1 << 20;

pub(crate) fn rows_per_chunk(ne0: u64) -> u64 {
    (CHUNK_ELEMS / ne0).max(1)
}

fn chunk_seed(seed: u64, name: &str, chunk: u64) -> u64 {
    mix64(seed ^ mix64(name_hash(name) ^ mix64(chunk.wrapping_add(0x5851_F42D_4C95_7F2D))))
}

/// The f32 values the random writer draws for a tensor named `name` with row length `ne0`,
/// rows `[row0, row0 + n_rows)` (before quantization). Same seed, same values, whatever the
/// tensor's type: an F32 file holds exactly these.
pub fn random_values(seed: u64, name: &str, ne0: u64, row0: u64, n_rows: u64) -> Vec<f32> {
    let per = rows_per_chunk(ne0);
    let dist = dist_for(name);
    let mut out = Vec::with_capacity((n_rows * ne0) as usize);
    let mut buf = Vec::new();
    let mut row = row0;
    while row < row0 + n_rows {
        let c = row / per;
        let c0 = c * per;
        let take = (c0 + per).min(row0 + n_rows) - row;
        buf.resize(((row - c0 + take) * ne0) as usize, 0.0);
        let mut rng = SplitMix64::new(chunk_seed(seed, name, c));
        fill(dist, &mut rng, &mut buf);
        out.extend_from_slice(&buf[((row - c0) * ne0) as usize..]);
        row += take;
    }
    out
}

/// How the router of a random model picks its experts.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub enum Routing {
    /// Every tensor ~N(0, 0.02): the router's picks are nearly the same for every token
    /// (random attention averages the positions, so all hidden states converge), which makes
    /// a tiny expert cache look perfect (hit rate 0.98 at a few slots per layer).
    #[default]
    Uniform,
    /// Expert popularity follows a Zipf-like law per layer (the expert of popularity rank `r`
    /// gets a router bias of `-skew x ln(1 + r)` in units of the logits' token-to-token
    /// spread) and each token's picks vary: token embeddings ~N(0, 1) so tokens differ, and
    /// the residual writers (`attn_output`, the down projections) are scaled by
    /// [`RESIDUAL_DAMP`] so the token keeps dominating the hidden state. The bias rides on a
    /// shared component: every embedding row holds `sqrt(n_embd)` in column 0 (the output
    /// head ignores that column), and the router's column 0 turns it into the bias.
    Skewed { skew: f32 },
}

/// Scale of the residual writers' weights in a [`Routing::Skewed`] model.
pub const RESIDUAL_DAMP: f32 = 0.1;

/// Block index of a `blk.N.` tensor name.
fn block_of(name: &str) -> u64 {
    name.strip_prefix("blk.")
        .and_then(|r| r.split('.').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or(0)
}

impl Routing {
    /// Whether this routing rewrites tensor `name`'s draws.
    pub fn touches(self, name: &str) -> bool {
        if self == Routing::Uniform {
            return false;
        }
        let base = name.strip_suffix(".weight").unwrap_or(name);
        base == "token_embd"
            || base == "output"
            || [
                ".attn_output",
                ".ffn_down_exps",
                ".ffn_down_shexp",
                ".ffn_down",
                ".ssm_out",
                ".ffn_gate_inp",
            ]
            .iter()
            .any(|s| base.ends_with(s))
    }

    /// Rewrite rows `[row0, row0 + rows)` of tensor `name` (row length `ne0`, `total_rows`
    /// rows in all) as this routing needs; `x` holds the uniform draws.
    fn adjust(self, seed: u64, name: &str, ne0: u64, total_rows: u64, row0: u64, x: &mut [f32]) {
        let Routing::Skewed { skew } = self else {
            return;
        };
        let base = name.strip_suffix(".weight").unwrap_or(name);
        let n = ne0 as usize;
        if base == "token_embd" {
            let anchor = (ne0 as f32).sqrt();
            for row in x.chunks_exact_mut(n) {
                for v in row.iter_mut() {
                    *v *= 50.0; // N(0, 0.02) -> N(0, 1)
                }
                row[0] = anchor;
            }
        } else if base == "output" {
            for row in x.chunks_exact_mut(n) {
                row[0] = 0.0;
            }
        } else if base.ends_with(".attn_output")
            || base.ends_with(".ffn_down_exps")
            || base.ends_with(".ffn_down_shexp")
            || base.ends_with(".ffn_down")
            || base.ends_with(".ssm_out")
        {
            for v in x.iter_mut() {
                *v *= RESIDUAL_DAMP;
            }
        } else if base.ends_with(".ffn_gate_inp") {
            // The normed hidden state's column 0 is about sqrt(n_embd / 2) (the anchor over an
            // rms of sqrt(2)); the logits' token-to-token spread about 0.02 x sqrt(n_embd / 2).
            let col0 = (ne0 as f32 / 2.0).sqrt();
            let spread = 0.02 * col0;
            let ranks = popularity_ranks(seed, block_of(name), total_rows);
            for (i, row) in x.chunks_exact_mut(n).enumerate() {
                let r = ranks[(row0 as usize + i).min(ranks.len() - 1)];
                row[0] = -skew * spread * (1.0 + r as f32).ln() / col0;
            }
        }
    }
}

/// The popularity rank of each of `n` experts of block `layer` (0 = hottest): a permutation
/// drawn from the seed, different in every block.
fn popularity_ranks(seed: u64, layer: u64, n: u64) -> Vec<u32> {
    let mut order: Vec<u32> = (0..n as u32).collect();
    order.sort_by_key(|&e| (mix64(seed ^ mix64(layer ^ mix64(u64::from(e)))), e));
    let mut ranks = vec![0u32; n as usize];
    for (r, &e) in order.iter().enumerate() {
        ranks[e as usize] = r as u32;
    }
    ranks
}

/// Options of [`write_random_model`].
pub struct RandomOptions {
    /// `general.name`.
    pub name: String,
    /// Generator threads (0: the machine's available parallelism minus one, for the writer).
    pub threads: usize,
    /// Tokenizer metadata to include.
    pub vocab: Option<Vocab>,
    /// Write all-zero blocks (scale 0: valid and finite) for types the CPU reference cannot
    /// decode at all (Q8_1, Q8_K, TQ1_0, TQ2_0, integer types) instead of failing. Every type
    /// of every preset is written with real blocks without it.
    pub zero_fill_unsupported: bool,
    /// `general.alignment` to write (None: the default 32, key omitted).
    pub alignment: Option<u32>,
    /// Write every quantized type (all but F32, F16 and BF16) as valid random blocks drawn in
    /// the quantized domain, as the types without a quantizer always are, instead of
    /// quantizing random draws: no quantizer search, so a 30B K-quant file is written as fast
    /// as a Q8_0 one. The values keep each tensor's scale; for speed benchmarks.
    pub random_blocks: bool,
    /// Progress callback (bytes written, total).
    pub progress: Option<ProgressFn>,
    /// How the router picks experts (uniform: every tensor drawn alike).
    pub routing: Routing,
}

impl Default for RandomOptions {
    fn default() -> Self {
        Self {
            name: "random".into(),
            threads: 0,
            vocab: None,
            zero_fill_unsupported: false,
            alignment: None,
            random_blocks: false,
            progress: None,
            routing: Routing::Uniform,
        }
    }
}

/// Write a random-weight `arch` model with `hp`, its tensors exactly
/// [`arch::expected_tensors`]`(arch, hp, recipe)` in that order, values deterministic from
/// `seed` (see [`random_values`]): matrices ~N(0, 0.02), norms ~1, `ssm_a` in [-16, -1),
/// quantized with the reference quantizers where one exists (`quant::QUANTIZABLE`), else
/// written as valid random blocks of the same scale (`quant::random`); scales always finite.
pub fn write_random_model(
    path: &Path,
    arch: &str,
    hp: &HParams,
    recipe: &QuantRecipe,
    seed: u64,
    opts: RandomOptions,
) -> Result<WriteSummary, GgufWriteError> {
    let file = path.display().to_string();
    let tensors =
        arch::expected_tensors(arch, hp, recipe).map_err(|source| GgufWriteError::Inventory {
            file: file.clone(),
            source,
        })?;
    let ftype = file_type(&recipe.preset, &tensors);
    write_random_tensors(path, arch, hp, &tensors, ftype, seed, opts)
}

/// [`write_random_model`] for a given tensor table (a descriptor's inventory): the table is
/// first checked against the architecture's layout.
pub fn write_random_tensors(
    path: &Path,
    arch: &str,
    hp: &HParams,
    tensors: &[TensorInfo],
    file_type: u32,
    seed: u64,
    mut opts: RandomOptions,
) -> Result<WriteSummary, GgufWriteError> {
    let file = path.display().to_string();
    arch::check_tensors(arch, hp, tensors).map_err(|source| GgufWriteError::Inventory {
        file: file.clone(),
        source,
    })?;
    for t in tensors {
        if opts.routing.touches(&t.name) && !quant::can_quantize(t.ggml_type) {
            return Err(GgufWriteError::Convert {
                file,
                problem: format!(
                    "skewed routing rewrites {} but its type {:?} has no quantizer here (its blocks would be drawn at random): pick a preset whose embedding, router, head and down projections are F32/F16/BF16/Q8_0/Q4_K-like (e.g. --preset Q8_0), or --routing uniform",
                    t.name, t.ggml_type
                ),
            });
        }
        if !quant::is_supported(t.ggml_type) && !opts.zero_fill_unsupported {
            return Err(GgufWriteError::Unsupported {
                file,
                name: t.name.clone(),
                ty: t.ggml_type,
            });
        }
    }
    let mut w = GgufWriter::new(path);
    let meta = arch_metadata(arch, &opts.name, hp).map_err(|p| GgufWriteError::Convert {
        file: file.clone(),
        problem: p,
    })?;
    for (k, v) in meta {
        w.kv(&k, v)?;
    }
    if let Some(a) = opts.alignment {
        w.kv("general.alignment", GgufValue::U32(a))?;
    }
    w.kv("general.file_type", GgufValue::U32(file_type))?;
    w.kv("general.quantization_version", GgufValue::U32(2))?;
    if let Some(v) = &opts.vocab {
        v.check(hp.n_vocab).map_err(|p| GgufWriteError::BadKey {
            file: file.clone(),
            key: "tokenizer.ggml.tokens".into(),
            problem: p,
        })?;
        for (k, val) in v.metadata() {
            w.kv(&k, val)?;
        }
    }
    for t in tensors {
        w.tensor_info(&t.name, &t.dims, t.ggml_type)?;
    }
    if let Some(p) = opts.progress.take() {
        w.on_progress(p);
    }
    let threads = match opts.threads {
        // One core is left to the thread that writes (and to the kernel's page-cache copy).
        0 => std::thread::available_parallelism().map_or(1, |n| n.get().saturating_sub(1).max(1)),
        n => n,
    };
    let mut s = w.begin()?;
    stream_random(
        &mut s,
        seed,
        threads,
        opts.random_blocks,
        &file,
        opts.routing,
    )?;
    s.finish()
}

/// One chunk of generation work: `rows` rows of tensor `t`, chunk index `chunk`.
#[derive(Clone, Copy)]
struct Job {
    t: usize,
    chunk: u64,
    rows: u64,
}

/// Generate, quantize and write every tensor: batches of `threads` chunks are computed in
/// parallel while the previous batch is written (double buffering), so memory stays at
/// about 2 x threads x one chunk.
fn stream_random(
    s: &mut GgufStream,
    seed: u64,
    threads: usize,
    random_blocks: bool,
    file: &str,
    routing: Routing,
) -> Result<(), GgufWriteError> {
    let planned = s.planned().to_vec();
    let mut jobs = Vec::new();
    for (i, t) in planned.iter().enumerate() {
        let ne0 = t.dims[0];
        let rows: u64 = t.dims[1..].iter().product();
        let per = rows_per_chunk(ne0);
        let mut r = 0;
        let mut c = 0;
        while r < rows {
            let n = per.min(rows - r);
            jobs.push(Job {
                t: i,
                chunk: c,
                rows: n,
            });
            r += n;
            c += 1;
        }
    }
    let threads = threads.max(1);
    let mut scratch: Vec<Vec<f32>> = vec![Vec::new(); threads];
    let mut cur: Vec<Vec<u8>> = vec![Vec::new(); threads];
    let mut next: Vec<Vec<u8>> = vec![Vec::new(); threads];
    let mut cur_n = 0usize;
    let run = |job: &Job, x: &mut Vec<f32>, out: &mut Vec<u8>| -> Result<(), GgufWriteError> {
        let t = &planned[job.t];
        let ne0 = t.dims[0] as usize;
        let n = job.rows as usize * ne0;
        let mut rng = SplitMix64::new(chunk_seed(seed, &t.name, job.chunk));
        let row_bytes = t.ggml_type.bytes_for(ne0 as u64).unwrap_or(0) as usize;
        out.clear();
        out.resize(row_bytes * job.rows as usize, 0);
        let quant_err = |source| GgufWriteError::Quant {
            file: file.to_string(),
            name: t.name.clone(),
            source,
        };
        let dist = dist_for(&t.name);
        let float = matches!(t.ggml_type, GgmlType::F32 | GgmlType::F16 | GgmlType::BF16);
        if quant::can_quantize(t.ggml_type) && (float || !random_blocks) {
            x.resize(n, 0.0);
            fill(dist, &mut rng, x);
            let total: u64 = t.dims[1..].iter().product();
            let row0 = job.chunk * rows_per_chunk(ne0 as u64);
            routing.adjust(seed, &t.name, ne0 as u64, total, row0, x);
            for (xr, or) in x.chunks_exact(ne0).zip(out.chunks_exact_mut(row_bytes)) {
                quant::quantize_row_into(t.ggml_type, xr, or).map_err(quant_err)?;
            }
        } else if quant::is_supported(t.ggml_type) {
            // No quantizer for this type (the i-quants, Q2_K, Q3_K), or random blocks asked
            // for: valid random blocks drawn in the quantized domain, at the tensor's
            // intended scale.
            let mut next = || rng.next_u64();
            quant::random::random_row(t.ggml_type, dist.rms(), &mut next, out)
                .map_err(quant_err)?;
        }
        Ok(())
    };
    let mut at = 0usize;
    loop {
        let batch = &jobs[at..(at + threads).min(jobs.len())];
        if batch.is_empty() && cur_n == 0 {
            break;
        }
        let (write_res, results) = std::thread::scope(|sc| {
            let mut handles = Vec::new();
            for ((job, x), out) in batch.iter().zip(scratch.iter_mut()).zip(next.iter_mut()) {
                let run = &run;
                handles.push(sc.spawn(move || run(job, x, out)));
            }
            let mut wr = Ok(());
            for b in &cur[..cur_n] {
                if let Err(e) = s.data(b) {
                    wr = Err(e);
                    break;
                }
            }
            let res: Vec<_> = handles
                .into_iter()
                .map(|h| {
                    h.join().unwrap_or_else(|_| {
                        Err(GgufWriteError::Convert {
                            file: file.to_string(),
                            problem: "a generator thread panicked".into(),
                        })
                    })
                })
                .collect();
            (wr, res)
        });
        write_res?;
        for r in results {
            r?;
        }
        std::mem::swap(&mut cur, &mut next);
        cur_n = batch.len();
        at += batch.len();
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ggml::GgmlType;
    use crate::gguf::read_gguf;
    use crate::gguf::testutil::{q4k_shapes, small_moe, small_next, tensor_f32, tmp};
    use crate::gguf::GgufArray;

    #[test]
    fn random_models_match_expected_tensors_tensor_for_tensor() {
        let d = tmp();
        for (arch, small) in [("qwen3moe", small_moe()), ("qwen3next", small_next())] {
            for preset in ["F32", "F16", "BF16", "Q8_0", "Q4_K"] {
                let hp = if preset == "Q4_K" {
                    q4k_shapes(small.clone())
                } else {
                    small.clone()
                };
                let mut recipe = QuantRecipe::preset(preset).unwrap();
                if preset == "Q4_K" {
                    // Routed experts Q8_0 (a custom mix): debug-build Q4_K is slow.
                    recipe.expert_gate_up = GgmlType::Q8_0;
                    recipe.expert_down = GgmlType::Q8_0;
                }
                let want = arch::expected_tensors(arch, &hp, &recipe).unwrap();
                let path = d.path().join(format!("{arch}-{preset}.gguf"));
                let opts = RandomOptions {
                    name: format!("{arch} {preset}"),
                    ..Default::default()
                };
                write_random_model(&path, arch, &hp, &recipe, 7, opts).unwrap();
                let f = read_gguf(&path).unwrap();
                assert_eq!(f.tensors.len(), want.len(), "{arch} {preset}");
                for (g, e) in f.tensors.iter().zip(&want) {
                    assert_eq!(
                        (&g.name, &g.dims, g.ggml_type, g.bytes),
                        (&e.name, &e.dims, e.ggml_type, e.bytes),
                        "{arch} {preset}"
                    );
                    assert_eq!(g.offset % f.alignment, 0);
                }
                if preset == "Q4_K" {
                    // The shapes were chosen so no Q4_K tensor falls back.
                    assert!(want
                        .iter()
                        .filter(|t| t.dims.len() > 1
                            && !t.name.contains("gate_inp")
                            && !t.name.contains("conv1d")
                            && !t.name.contains("_exps"))
                        .all(|t| t.ggml_type == GgmlType::Q4K));
                    // Every tensor decodes to finite values; a matrix is close to its draws.
                    for t in &f.tensors {
                        let v = tensor_f32(&path, &t.name);
                        assert!(v.iter().all(|x| x.is_finite()), "{}", t.name);
                    }
                    let name = "token_embd.weight";
                    let exact = random_values(7, name, 256, 0, hp.n_vocab);
                    let q4 = tensor_f32(&path, name);
                    let mse = exact
                        .iter()
                        .zip(&q4)
                        .map(|(x, y)| (x - y).powi(2))
                        .sum::<f32>()
                        / exact.len() as f32;
                    assert!(mse.sqrt() < 0.1 * 0.02, "Q4_K rms error {}", mse.sqrt());
                }
                // Metadata llama.cpp reads.
                let k = |s: &str| format!("{arch}.{s}");
                assert_eq!(f.get_str("general.architecture").unwrap(), Some(arch));
                assert_eq!(
                    f.get_u64(&k("block_count")).unwrap(),
                    Some(u64::from(hp.n_blocks_total()))
                );
                assert_eq!(f.get_u64(&k("embedding_length")).unwrap(), Some(hp.n_embd));
                assert_eq!(f.get_u64(&k("expert_count")).unwrap(), Some(hp.n_expert));
                assert_eq!(
                    f.get_u64(&k("attention.key_length")).unwrap(),
                    Some(hp.head_dim_k)
                );
                assert_eq!(f.get_u64("general.quantization_version").unwrap(), Some(2));
                assert_eq!(
                    f.get_f64(&k("attention.layer_norm_rms_epsilon")).unwrap(),
                    Some(1e-6f32 as f64)
                );
                let ftype = f.get_u64("general.file_type").unwrap().unwrap();
                let want_ftype = match preset {
                    "F32" => 0,
                    "F16" => 1,
                    "Q8_0" => 7,
                    "Q4_K" => 14,
                    _ => 32,
                };
                assert_eq!(ftype, want_ftype);
                if arch == "qwen3next" {
                    assert_eq!(
                        f.get_u64(&k("ssm.inner_size")).unwrap(),
                        hp.ssm.as_ref().map(|s| s.inner_size)
                    );
                    assert_eq!(f.get_u64(&k("ssm.group_count")).unwrap(), Some(2));
                    assert_eq!(f.get_u64(&k("full_attention_interval")).unwrap(), Some(2));
                    assert_eq!(
                        f.get_u64(&k("nextn_predict_layers")).unwrap(),
                        (hp.nextn_predict_layers > 0).then_some(1)
                    );
                    assert_eq!(f.get_u64(&k("rope.dimension_count")).unwrap(), hp.rope_dim);
                    assert_eq!(
                        f.get_u64(&k("expert_shared_feed_forward_length")).unwrap(),
                        Some(hp.n_ff_shexp)
                    );
                } else {
                    assert!(f.get("qwen3moe.ssm.inner_size").is_none());
                }
            }
        }
    }

    #[test]
    fn random_values_are_deterministic_plausible_and_finite() {
        let d = tmp();
        let hp = small_next();
        let write = |name: &str, preset: &str, seed: u64, threads: usize| {
            let p = d.path().join(name);
            let opts = RandomOptions {
                threads,
                ..Default::default()
            };
            write_random_model(
                &p,
                "qwen3next",
                &hp,
                &QuantRecipe::preset(preset).unwrap(),
                seed,
                opts,
            )
            .unwrap();
            p
        };
        let a = write("a.gguf", "Q8_0", 42, 1);
        let b = write("b.gguf", "Q8_0", 42, 3);
        let c = write("c.gguf", "Q8_0", 43, 2);
        let (ba, bb, bc) = (
            std::fs::read(&a).unwrap(),
            std::fs::read(&b).unwrap(),
            std::fs::read(&c).unwrap(),
        );
        assert_eq!(ba, bb, "same seed, any thread count: same bytes");
        assert_eq!(ba.len(), bc.len());
        assert_ne!(ba, bc, "another seed changes the weights");
        // F32 holds exactly random_values; Q8_0 is within its half step of them.
        let f = write("f.gguf", "F32", 42, 2);
        let name = "blk.0.ffn_up_exps.weight";
        let exact = random_values(42, name, 64, 0, 32 * 2);
        assert_eq!(tensor_f32(&f, name), exact);
        let q = tensor_f32(&a, name);
        for (x, y) in exact.iter().zip(&q) {
            assert!((x - y).abs() <= 0.07 / 127.0 + 1e-6, "{x} vs {y}");
        }
        let mean = exact.iter().sum::<f32>() / exact.len() as f32;
        let std =
            (exact.iter().map(|v| (v - mean).powi(2)).sum::<f32>() / exact.len() as f32).sqrt();
        assert!(
            mean.abs() < 0.002 && (0.018..0.022).contains(&std),
            "{mean} {std}"
        );
        // A slice from the middle agrees with the whole.
        assert_eq!(random_values(42, name, 64, 10, 7), exact[10 * 64..17 * 64]);
        // Across chunk boundaries too (rows of 2^19 elements: two rows per chunk).
        let wide = random_values(42, name, 1 << 19, 0, 4);
        assert_eq!(
            random_values(42, name, 1 << 19, 1, 2),
            wide[1 << 19..3 << 19]
        );
        assert_ne!(wide[..1 << 19], wide[2 << 19..3 << 19]);
        let ssm_a = tensor_f32(&f, "blk.0.ssm_a");
        assert!(ssm_a.iter().all(|v| (-16.0..-1.0).contains(v)), "{ssm_a:?}");
        let norm = tensor_f32(&f, "blk.1.attn_q_norm.weight");
        assert!(norm.iter().all(|v| (0.9..1.1).contains(v)));
    }

    #[test]
    fn random_blocks_keep_the_layout_and_scale_without_quantizing() {
        let d = tmp();
        let hp = q4k_shapes(small_moe());
        let recipe = QuantRecipe::preset("Q4_K_M").unwrap();
        let write = |name: &str, random_blocks: bool| {
            let p = d.path().join(name);
            let opts = RandomOptions {
                random_blocks,
                ..Default::default()
            };
            write_random_model(&p, "qwen3moe", &hp, &recipe, 5, opts).unwrap();
            p
        };
        let (q, r) = (write("q.gguf", false), write("r.gguf", true));
        let (fq, fr) = (read_gguf(&q).unwrap(), read_gguf(&r).unwrap());
        let types = |f: &crate::gguf::GgufFile| {
            f.tensors
                .iter()
                .map(|t| (t.name.clone(), t.ggml_type, t.dims.clone()))
                .collect::<Vec<_>>()
        };
        assert_eq!(types(&fq), types(&fr), "the same tensors, types and shapes");
        let name = "blk.0.ffn_up_exps.weight";
        let t = fr.tensor(name).unwrap();
        assert_eq!(t.ggml_type, GgmlType::Q4K);
        let (a, b) = (tensor_f32(&q, name), tensor_f32(&r, name));
        assert_ne!(
            a, b,
            "Q4_K drawn as blocks, not quantized from the same draws"
        );
        let rms = |v: &[f32]| (v.iter().map(|x| x * x).sum::<f32>() / v.len() as f32).sqrt();
        assert!(b.iter().all(|v| v.is_finite()));
        let (ra, rb) = (rms(&a), rms(&b));
        assert!((rb / ra - 1.0).abs() < 0.25, "scale kept: {ra} vs {rb}");
        // Float tensors are still the random draws themselves.
        let norm = "blk.0.attn_norm.weight";
        assert_eq!(tensor_f32(&q, norm), tensor_f32(&r, norm));
    }

    #[test]
    fn every_preset_writes_real_blocks_for_both_archs() {
        let d = tmp();
        for (arch, small) in [("qwen3moe", small_moe()), ("qwen3next", small_next())] {
            // Rows of 256 so no 256-block type falls back; two layers so early-block rules
            // and use_more_bits both pick something.
            let mut hp = q4k_shapes(small);
            hp.n_layer = 2 * hp.n_layer.max(1);
            for preset in arch::PRESETS {
                let recipe = QuantRecipe::preset(preset).unwrap();
                let want = arch::expected_tensors(arch, &hp, &recipe).unwrap();
                let path = d.path().join(format!("{arch}-{preset}.gguf"));
                write_random_model(&path, arch, &hp, &recipe, 3, RandomOptions::default())
                    .unwrap_or_else(|e| panic!("{arch} {preset}: {e}"));
                let f = read_gguf(&path).unwrap();
                assert_eq!(f.tensors.len(), want.len(), "{arch} {preset}");
                let mut types = std::collections::BTreeSet::new();
                for (g, e) in f.tensors.iter().zip(&want) {
                    assert_eq!((&g.name, g.ggml_type), (&e.name, e.ggml_type), "{preset}");
                    types.insert(g.ggml_type);
                    let v = tensor_f32(&path, &g.name);
                    assert!(v.iter().all(|x| x.is_finite()), "{preset} {}", g.name);
                    let nonzero = v.iter().filter(|x| **x != 0.0).count();
                    assert!(
                        nonzero * 2 > v.len(),
                        "{preset} {}: {nonzero} of {} values non-zero",
                        g.name,
                        v.len()
                    );
                    if g.dims.len() > 1
                        && !g.name.contains("gate_inp")
                        && !g.name.contains("conv1d")
                    {
                        // Matrices keep their intended scale (~N(0, 0.02)).
                        let rms = (v.iter().map(|x| x * x).sum::<f32>() / v.len() as f32).sqrt();
                        assert!(
                            (0.012..0.03).contains(&rms),
                            "{preset} {}: rms {rms}",
                            g.name
                        );
                    }
                }
                eprintln!("{arch} {preset}: {types:?}");
            }
        }
    }

    #[test]
    fn types_without_a_decoder_fail_or_zero_fill() {
        let d = tmp();
        let p = d.path().join("m.gguf");
        let hp = q4k_shapes(small_moe());
        let mut r = QuantRecipe::preset("Q4_K_M").unwrap();
        r.overrides.push(arch::TensorOverride {
            pattern: "output.weight".into(),
            ggml_type: GgmlType::Tq1_0,
        });
        let e =
            write_random_model(&p, "qwen3moe", &hp, &r, 1, RandomOptions::default()).unwrap_err();
        assert!(
            matches!(
                &e,
                GgufWriteError::Unsupported {
                    ty: GgmlType::Tq1_0,
                    ..
                }
            ),
            "{e}"
        );
        assert!(
            e.to_string().contains("IQ3_S"),
            "the message lists what works: {e}"
        );
        assert!(!p.exists());
        let opts = RandomOptions {
            zero_fill_unsupported: true,
            ..Default::default()
        };
        write_random_model(&p, "qwen3moe", &hp, &r, 1, opts).unwrap();
        let f = read_gguf(&p).unwrap();
        let head = f.tensor("output.weight").unwrap();
        assert_eq!(head.ggml_type, GgmlType::Tq1_0);
        let bytes = std::fs::read(&p).unwrap();
        let at = f.tensor_file_offset(head).unwrap() as usize;
        assert!(bytes[at..at + head.bytes as usize].iter().all(|b| *b == 0));
        assert_eq!(f.get_u64("general.file_type").unwrap(), Some(15));
        // Q6_K (Q4_K_M's head) is written with real blocks now.
        let q6 = f.tensor("blk.0.attn_v.weight").unwrap();
        assert_eq!(q6.ggml_type, GgmlType::Q6K);
        assert!(tensor_f32(&p, "blk.0.attn_v.weight")
            .iter()
            .any(|v| *v != 0.0));
    }

    #[test]
    fn vocabulary_and_bad_vocabulary() {
        let d = tmp();
        let p = d.path().join("v.gguf");
        let hp = small_moe();
        let mut vocab = Vocab {
            tokens: (0..32).map(|i| format!("t{i}")).collect(),
            token_type: vec![1; 32],
            merges: vec!["t 1".into()],
            pre: Some("qwen2".into()),
            bos: None,
            eos: Some(31),
            pad: None,
            chat_template: Some("{{ messages }}".into()),
        };
        let r = QuantRecipe::preset("F16").unwrap();
        let opts = |v: &Vocab| RandomOptions {
            vocab: Some(v.clone()),
            alignment: Some(128),
            ..Default::default()
        };
        write_random_model(&p, "qwen3moe", &hp, &r, 1, opts(&vocab)).unwrap();
        let f = read_gguf(&p).unwrap();
        assert_eq!(f.alignment, 128);
        assert_eq!(f.get_str("tokenizer.ggml.model").unwrap(), Some("gpt2"));
        match f.get_array("tokenizer.ggml.tokens").unwrap() {
            Some(GgufArray::Strings(t)) => assert_eq!(t, &vocab.tokens),
            other => panic!("{other:?}"),
        }
        assert_eq!(f.get_u64("tokenizer.ggml.eos_token_id").unwrap(), Some(31));
        assert_eq!(
            f.get_str("tokenizer.chat_template").unwrap(),
            Some("{{ messages }}")
        );
        vocab.tokens.pop();
        let e = write_random_model(&p, "qwen3moe", &hp, &r, 1, opts(&vocab)).unwrap_err();
        assert!(e.to_string().contains("n_vocab = 32"), "{e}");
    }

    /// Skewed routing: every embedding row carries the anchor, the head ignores it, each
    /// router's column 0 is the Zipf-like bias in a per-layer order, the residual writers are
    /// damped; a type without a quantizer among those tensors is refused.
    #[test]
    fn skewed_routing_writes_the_anchor_the_bias_and_the_damping() {
        let d = tmp();
        let hp = small_moe();
        let n = hp.n_embd as usize;
        let e = hp.n_expert as usize;
        let path = d.path().join("skewed.gguf");
        let opts = RandomOptions {
            threads: 2,
            routing: Routing::Skewed { skew: 1.5 },
            ..Default::default()
        };
        let recipe = QuantRecipe::preset("F32").unwrap();
        write_random_model(&path, "qwen3moe", &hp, &recipe, 5, opts).unwrap();
        let emb = tensor_f32(&path, "token_embd.weight");
        let anchor = (n as f32).sqrt();
        assert!(emb.chunks(n).all(|r| r[0] == anchor));
        let ms: f32 = emb
            .chunks(n)
            .flat_map(|r| r[1..].iter())
            .map(|v| v * v)
            .sum::<f32>()
            / (emb.len() - emb.len() / n) as f32;
        assert!((0.7..1.3).contains(&ms), "embedding variance {ms}");
        assert!(tensor_f32(&path, "output.weight")
            .chunks(n)
            .all(|r| r[0] == 0.0));
        let mut hottest = Vec::new();
        for l in 0..hp.n_layer {
            let router = tensor_f32(&path, &format!("blk.{l}.ffn_gate_inp.weight"));
            let mut col0: Vec<f32> = router.chunks(n).map(|r| r[0]).collect();
            hottest.push(
                col0.iter()
                    .enumerate()
                    .max_by(|a, b| a.1.total_cmp(b.1))
                    .unwrap()
                    .0,
            );
            col0.sort_by(|a, b| b.total_cmp(a));
            for (r, v) in col0.iter().enumerate() {
                let want = -1.5 * 0.02 * (1.0 + r as f32).ln();
                assert!((v - want).abs() < 1e-6, "layer {l} rank {r}: {v} vs {want}");
            }
            assert_eq!(col0.len(), e);
            let out = tensor_f32(&path, &format!("blk.{l}.attn_output.weight"));
            let rms = (out.iter().map(|v| v * v).sum::<f32>() / out.len() as f32).sqrt();
            assert!(
                (rms - 0.02 * RESIDUAL_DAMP).abs() < 0.2 * 0.02 * RESIDUAL_DAMP,
                "{rms}"
            );
        }
        assert_ne!(
            hottest[0], hottest[1],
            "each layer has its own popularity order"
        );
        // Uniform (the default) is untouched: the file holds the plain draws.
        let upath = d.path().join("uniform.gguf");
        write_random_model(
            &upath,
            "qwen3moe",
            &hp,
            &recipe,
            5,
            RandomOptions::default(),
        )
        .unwrap();
        let plain = random_values(5, "token_embd.weight", n as u64, 0, hp.n_vocab);
        assert_eq!(tensor_f32(&upath, "token_embd.weight"), plain);
        // A router type drawn at random (no quantizer) cannot carry the bias.
        let mut bad = recipe.clone();
        bad.router = GgmlType::Q8_1;
        let opts = RandomOptions {
            routing: Routing::Skewed { skew: 1.0 },
            ..Default::default()
        };
        let err = write_random_model(&d.path().join("bad.gguf"), "qwen3moe", &hp, &bad, 5, opts)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("ffn_gate_inp") && err.contains("--routing uniform"),
            "{err}"
        );
    }
}

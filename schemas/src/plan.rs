//! The plan: where every byte lives, as the planner decided and the executor obeys.
//! Invariant: sizes and offsets are u64; every region has an offset inside its device's
//! memory (arena regions from 0 up, the two reserves at the top), every tensor a placement.
//! Any change to this file changes the schema hash (see `planfile`), so old plans are refused.

use crate::ggml::GgmlType;
use crate::serve::{ExpertCache, KvType};
use rkyv::{Archive, Deserialize, Serialize};

/// Region kinds, named as in DESIGN.md's report contract.
#[derive(
    Archive, Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash,
)]
#[rkyv(derive(Debug, PartialEq, Eq, Clone, Copy))]
pub enum RegionKind {
    RuntimeReserve,
    UserReserve,
    DenseWeights,
    Embedding,
    Head,
    KvCache,
    LinearState,
    SlotSessions,
    Scratch,
    Staging,
    Mtp,
    Vision,
    ExpertCache,
    /// One copy per slot of the slot's linear-attention state (Qwen3-Next), saved at the end
    /// of each prompt so the prefix cache can rewind a slot to it.
    PrefixCheckpoint,
}

impl RegionKind {
    pub const ALL: [RegionKind; 14] = [
        RegionKind::RuntimeReserve,
        RegionKind::UserReserve,
        RegionKind::DenseWeights,
        RegionKind::Embedding,
        RegionKind::Head,
        RegionKind::KvCache,
        RegionKind::LinearState,
        RegionKind::SlotSessions,
        RegionKind::Scratch,
        RegionKind::Staging,
        RegionKind::Mtp,
        RegionKind::Vision,
        RegionKind::ExpertCache,
        RegionKind::PrefixCheckpoint,
    ];

    /// The report's key.
    pub fn as_str(self) -> &'static str {
        match self {
            RegionKind::RuntimeReserve => "runtime_reserve",
            RegionKind::UserReserve => "user_reserve",
            RegionKind::DenseWeights => "dense_weights",
            RegionKind::Embedding => "embedding",
            RegionKind::Head => "head",
            RegionKind::KvCache => "kv_cache",
            RegionKind::LinearState => "linear_state",
            RegionKind::SlotSessions => "slot_sessions",
            RegionKind::Scratch => "scratch",
            RegionKind::Staging => "staging",
            RegionKind::Mtp => "mtp",
            RegionKind::Vision => "vision",
            RegionKind::ExpertCache => "expert_cache",
            RegionKind::PrefixCheckpoint => "prefix_checkpoint",
        }
    }

    /// Whether the executor allocates it inside the device arena (the reserves are left to
    /// the runtime and the user).
    pub fn in_arena(self) -> bool {
        !matches!(self, RegionKind::RuntimeReserve | RegionKind::UserReserve)
    }
}

/// One contiguous region of a device's memory.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
#[rkyv(derive(Debug))]
pub struct Region {
    pub kind: RegionKind,
    /// Byte offset in the device's memory as planned: arena regions from 0, reserves at the top.
    pub offset: u64,
    pub bytes: u64,
}

/// A buffer of the forward graph's scratch, packed by lifetime inside the scratch region.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
#[rkyv(derive(Debug))]
pub struct ScratchBuffer {
    pub name: String,
    /// Offset inside the scratch region.
    pub offset: u64,
    pub bytes: u64,
    /// First and last op index (inclusive) that touch it.
    pub first_op: u32,
    pub last_op: u32,
}

/// The pass a device's working set (its `scratch` buffers) was sized for: the largest forward
/// pass the executor may run there. All zero when no backend of this build runs the model
/// (the scratch then holds the forward graph's estimate, and nothing binds it).
#[derive(Archive, Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq, Default)]
#[rkyv(derive(Debug))]
pub struct WorkPass {
    /// Tokens of the largest pass (a prefill chunk, or every slot's decode tokens).
    pub tokens: u32,
    /// Rows of logits the head computes per pass.
    pub logit_rows: u32,
    /// Decode-attention splits.
    pub att_splits: u32,
    /// Decode slots.
    pub slots: u32,
    /// Prefill through the tensor-core products (their buffers are planned).
    pub gemm: bool,
}

/// An expert resident in a cache slot at start-up.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq)]
#[rkyv(derive(Debug))]
pub struct ResidentExpert {
    pub layer: u32,
    pub expert: u32,
    pub slot: u32,
}

/// One planned device.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq)]
#[rkyv(derive(Debug))]
pub struct DevicePlan {
    /// Probe index.
    pub index: u32,
    pub name: String,
    pub vendor: String,
    pub arch: String,
    pub vram_bytes: u64,
    /// Free bytes assumed at start-up (probe value or vram minus runtime reserve).
    pub free_bytes: u64,
    /// Bytes the executor allocates: the one arena, `[0, arena_bytes)`.
    pub arena_bytes: u64,
    /// Layers `[layer_first, layer_end)` of the main blocks.
    pub layer_first: u32,
    pub layer_end: u32,
    pub holds_embedding: bool,
    pub holds_head: bool,
    pub holds_mtp: bool,
    pub holds_vision: bool,
    pub regions: Vec<Region>,
    /// Bytes of one expert-cache slot (gate + up + down of one expert).
    pub expert_slot_bytes: u64,
    pub expert_cache_slots: u64,
    pub resident_experts: Vec<ResidentExpert>,
    /// The named working buffers the executor binds (`workset::WorkBuf` names), packed in
    /// the scratch region; or the forward graph's buffers when no backend of this build runs
    /// the model here (`work_pass.tokens == 0`).
    pub scratch: Vec<ScratchBuffer>,
    pub work_pass: WorkPass,
    /// Full-attention layers whose KV lives here (MTP block included when it does).
    pub kv_layers: Vec<u32>,
    /// Linear-attention layers whose state lives here.
    pub linear_layers: Vec<u32>,
    /// Whether `free_bytes` was measured (the probe's `free_bytes`) rather than assumed
    /// (`vram_bytes` minus the runtime reserve, in a hand-written probe).
    pub free_bytes_probed: bool,
    /// This device's share of a forward step, as terms the prediction is evaluated from.
    pub cost: DeviceCost,
    /// How the hidden state arrives from the previous device of a layer split: "none" (the
    /// first device), "peer" (a device-to-device copy: both GPUs of one vendor and the probe
    /// lists the previous one among this one's `peers`) or "host" (through this device's
    /// pinned `staging` chunks).
    pub handoff_in: String,
}

impl DevicePlan {
    pub fn region(&self, kind: RegionKind) -> Option<&Region> {
        self.regions.iter().find(|r| r.kind == kind)
    }
    pub fn region_bytes(&self, kind: RegionKind) -> u64 {
        self.region(kind).map_or(0, |r| r.bytes)
    }
    /// Everything planned on the device, reserves included.
    pub fn planned_bytes(&self) -> u64 {
        self.regions.iter().map(|r| r.bytes).sum()
    }
}

/// Where a tensor lives.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
#[rkyv(derive(Debug))]
pub enum Placement {
    /// In a device arena at this offset (inside one of its weight regions).
    Device { device: u32, offset: u64 },
    /// A routed-expert stack: stays in host memory (mmapped from the model file) and is served
    /// through `device`'s expert cache.
    HostExperts { device: u32 },
    /// Left in host memory (not needed by any device in this plan, e.g. an unused MTP head).
    Host,
}

#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
#[rkyv(derive(Debug))]
pub struct TensorPlacement {
    pub name: String,
    pub bytes: u64,
    /// The tensor's element type (what a backend must decode to run it).
    pub ggml_type: GgmlType,
    pub placement: Placement,
}

/// The purpose of the pinned chunks that hold a GPU device's host expert tier: every expert
/// of the device's layers whose stacks are [`Placement::HostExperts`], in (layer, expert)
/// order, each in `expert_slot_bytes` bytes (gate, up and down in the backend's device
/// layout, as a cache slot holds them), packed whole into the device's chunks of this purpose
/// in plan order, every chunk but the last holding the same number of experts
/// ([`pinned_expert_at`]). A miss then copies one contiguous slot from pinned memory.
pub const PINNED_EXPERTS: &str = "experts";

/// Where expert number `index` (in the order of [`PINNED_EXPERTS`]) lies: (chunk among the
/// device's expert chunks, byte offset in it), given those chunks' sizes; None when they do
/// not hold it.
pub fn pinned_expert_at(chunks: &[u64], slot_bytes: u64, index: u64) -> Option<(usize, u64)> {
    let per = chunks.first()?.checked_div(slot_bytes)?;
    if per == 0 {
        return None;
    }
    let (c, at) = ((index / per) as usize, (index % per) * slot_bytes);
    (at + slot_bytes <= *chunks.get(c)?).then_some((c, at))
}

/// One pinned host allocation.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
#[rkyv(derive(Debug))]
pub struct PinnedChunk {
    /// "kv_spill", "staging" or [`PINNED_EXPERTS`].
    pub purpose: String,
    /// The device it serves.
    pub device: u32,
    pub bytes: u64,
}

#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq)]
#[rkyv(derive(Debug))]
pub struct HostPlan {
    pub ram_bytes: u64,
    pub ram_available_bytes: u64,
    pub memlock_limit_bytes: Option<u64>,
    pub pinned_chunks: Vec<PinnedChunk>,
    pub pinned_bytes: u64,
    pub pinned_chunk_max_bytes: u64,
    /// KV cells beyond `--kv-resident`, all slots, all devices.
    pub kv_host_bytes: u64,
    /// Expert bytes not resident in any cache (read from the mmapped model file).
    pub experts_host_bytes: u64,
    /// Pinned bytes plus mmapped expert bytes that must stay in RAM.
    pub ram_required_bytes: u64,
    /// True when RAM cannot hold the non-resident experts and they page from disk.
    pub experts_page_from_disk: bool,
}

/// A request the plan could not honour as asked.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
#[rkyv(derive(Debug))]
pub struct Degradation {
    pub what: String,
    pub requested: String,
    pub planned: String,
    pub reason: String,
}

/// Decode speed at one batch size and context length.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq)]
#[rkyv(derive(Debug))]
pub struct DecodePoint {
    /// Slots decoding together in each step.
    pub batch: u32,
    /// Cells of context every one of them holds.
    pub context: u64,
    /// Tokens per second one slot sees.
    pub per_slot_tok_s: f64,
    /// Tokens per second of all slots together (`batch x per_slot_tok_s`).
    pub aggregate_tok_s: f64,
}

/// What the plan predicts for its configuration.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq)]
#[rkyv(derive(Debug))]
pub struct Predicted {
    /// Decode tok/s one slot sees with every planned slot decoding, at empty context (the
    /// headline figure: `decode_empty.per_slot_tok_s`).
    pub decode_tok_s: f64,
    pub expert_hit_rate: f64,
    /// Where `expert_hit_rate` comes from: every expert resident, the expert profile's
    /// measured LRU reuse curve, or a guess (the profile's routing share, uniform routing).
    pub expert_hit_source: String,
    /// The planned batch at empty context.
    pub decode_empty: DecodePoint,
    /// The planned batch with every slot's context full (`max_context` cells).
    pub decode_full: DecodePoint,
    /// Prefill tok/s of one slot's prompt in passes of the planned ubatch.
    pub prefill_tok_s: f64,
    /// True when some device's cost coefficients are the documented defaults (a hand-written
    /// probe), not measured by `strata-exec probe`: the figures are guesses.
    pub guessed: bool,
    /// How the prediction was made, for the report.
    pub basis: String,
}

/// One device's share of a forward step, in seconds, as the cost model (planner `cost.rs`)
/// derived it from the probe's coefficients; [`Plan::decode_step_seconds`] and
/// [`Plan::prefill_seconds`] evaluate them at any batch and context, so `strata-exec bench`
/// can put the prediction beside what it measures.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq, Default)]
#[rkyv(derive(Debug))]
pub struct DeviceCost {
    /// Per decode step, whatever its batch: launch latencies, step overhead, hand-off in.
    pub step_s: f64,
    /// One read of the weights every token uses (dense layers here, the head if held).
    pub dense_read_s: f64,
    /// Rows one product launch serves per read of its weights (more rows read them again).
    pub rows_per_read: u32,
    /// Compute of one token through the layers here (2 flops per weight it uses).
    pub token_compute_s: f64,
    /// Compute of one row of logits (0 where the head is not).
    pub head_compute_s: f64,
    /// Layers here with routed experts, experts per layer, experts per token.
    pub expert_layers: u32,
    pub n_expert: u32,
    pub n_expert_used: u32,
    /// One routed expert (gate, up, down) read from device memory.
    pub expert_read_s: f64,
    /// One routed expert read by the decode products over a many-token group (a prefill
    /// pass through an expert cache).
    pub expert_pass_read_s: f64,
    /// Whether every (token, expert) use reads the expert again (the GPU decode kernels),
    /// or each distinct expert is read once per step (the CPU engine).
    pub expert_read_per_use: bool,
    /// Share of expert uses served from this device's cache.
    pub hit_rate: f64,
    /// Extra time of one expert missed by the cache (host-to-device copy, disk share).
    pub expert_miss_s: f64,
    /// One missed expert computed on the host CPU instead, for one token (its bytes over the
    /// host's expert matvec rate; overlaps the device's copies and products), and the round
    /// trip of a decode layer that computes any there (the rows read back with a stream
    /// synchronisation, the picks and the partial sum up, the cold thread pool, the combine
    /// launch: probe key `host_round_trip_us`), which the device waits for.
    pub host_expert_s: f64,
    pub host_layer_s: f64,
    /// The miss policy (the hybrid path): at most this many of a decode layer's misses per
    /// token are computed on the host CPU, in parallel with the device's products; the
    /// rest are streamed into the cache. 0: stream every miss; `n_expert_used` or more:
    /// compute every miss on the CPU. See [`DeviceCost::miss_policy`].
    pub cpu_misses_per_token: u32,
    /// One cell of one slot's KV read in device memory, and streamed from host memory.
    pub kv_cell_s: f64,
    pub kv_host_cell_s: f64,
    /// Cells per slot in device memory (cells beyond stream from host memory).
    pub kv_resident: u64,
    /// The KV host policy (`--kv-host`): one slot's cell past `kv_resident` attended on the
    /// host CPU instead of read by the device over PCIe (its bytes over the host's memory
    /// rate, `host_matvec_gbps`), and the round trips of a decode step that does so (per
    /// full-attention layer here: the query rows back with a stream synchronisation, the
    /// cold thread pool, the partials up, the merge; `kv_host_round_trip_us` each), which the
    /// device waits for.
    pub kv_cpu_cell_s: f64,
    pub kv_cpu_step_s: f64,
    /// Whether decode attention over the cells past `kv_resident` is computed on the host CPU
    /// (while the device attends its window; the partial softmaxes merged by the
    /// flash-decoding combine) rather than read by the device in place. See
    /// [`DeviceCost::kv_host_policy`].
    pub kv_host_cpu: bool,
    /// Extra seconds of a decode step launched kernel by kernel instead of as one captured
    /// graph (its launches x (`eager_launch_us` - `launch_us`)): a step with a host round
    /// trip (experts read through the cache, spilled KV attended on the host) cannot be one
    /// graph. See [`DeviceCost::eager`].
    pub eager_step_s: f64,
    /// Per row of a step: linear-attention state read and written, hand-off bytes.
    pub row_s: f64,
    /// Per prefill pass, whatever its tokens: launch latencies.
    pub pass_s: f64,
    /// Prefill products on tensor cores (weights read once a pass); else the decode
    /// products in `rows_per_read` chunks.
    pub prefill_gemm: bool,
    /// Prefill experts on the decode products, every use reading its expert at
    /// `expert_pass_read_s` (a GPU stage serving experts through its cache whose types have
    /// no grouped tensor-core products; with them a pass reads each distinct expert once).
    pub prefill_experts_per_use: bool,
    /// Per prefill token: activations read and written between launches.
    pub prefill_token_s: f64,
    /// Prefill attention per token per causal context cell.
    pub prefill_cell_s: f64,
    /// Of `row_s`: one slot's linear-attention state read and written. A decode step pays it
    /// per row; a prefill pass once, since its kernels hold the state over the whole run.
    pub state_row_s: f64,
    /// Per prefill token: the delta rule's serial chain through every linear layer here (a
    /// run's tokens go one after another through each state row).
    pub delta_token_s: f64,
    /// Of `token_compute_s`: the grouped expert products' useful flops at the probe's rate,
    /// which a tensor-core prefill pass scales by its tile padding against the probe's
    /// measured shape of `expert_gemm_ref_tpe` tokens an expert
    /// ([`crate::moe_tiles::slowdown`]).
    pub expert_gemm_s: f64,
    pub expert_gemm_ref_tpe: f64,
    /// Each expert's expected uses per token, busiest first, averaged over the expert layers
    /// here: the `--expert-profile`'s routing; empty for uniform routing
    /// (`n_expert_used / n_expert` each).
    pub expert_shares: Vec<f64>,
}

/// Expected distinct experts of one layer that `tokens` tokens route to, each picking
/// `k` of `e` uniformly: `e (1 - (1 - k/e)^tokens)`, by repeated multiplication so every
/// platform gets the same bits.
pub fn distinct_experts(e: u32, k: u32, tokens: u64) -> f64 {
    if e == 0 || k == 0 || tokens == 0 {
        return 0.0;
    }
    let miss = 1.0 - f64::from(k.min(e)) / f64::from(e);
    let mut p = 1.0f64;
    for _ in 0..tokens.min(4096) {
        p *= miss;
    }
    f64::from(e) * (1.0 - p)
}

/// How a device serves the experts its cache misses in a decode step (the plan's choice,
/// from the cost model; `strata-exec --miss-policy` may override it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MissPolicy {
    /// Every expert is in a cache slot: nothing misses.
    None,
    /// Every miss is copied into a cache slot and computed on the device.
    Stream,
    /// Every miss is computed on the host CPU from host memory.
    Cpu,
    /// Up to this many misses per token of a layer on the CPU, the rest streamed.
    Split(u32),
}

impl std::fmt::Display for MissPolicy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            MissPolicy::None => write!(f, "none"),
            MissPolicy::Stream => write!(f, "stream"),
            MissPolicy::Cpu => write!(f, "cpu"),
            MissPolicy::Split(n) => write!(f, "split {n}"),
        }
    }
}

/// Where a device's decode attention reads the KV cells past `--kv-resident` (the plan's
/// choice, from the cost model; `strata-exec --kv-host` may override it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KvHostPolicy {
    /// Every cell is in device memory.
    None,
    /// The device reads the host cells over PCIe in place.
    Stream,
    /// The host CPU attends the host cells while the device attends its window.
    Cpu,
}

impl std::fmt::Display for KvHostPolicy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            KvHostPolicy::None => "none",
            KvHostPolicy::Stream => "stream",
            KvHostPolicy::Cpu => "cpu",
        })
    }
}

impl DeviceCost {
    /// The KV host policy these terms record for a context of `ctx` cells.
    pub fn kv_host_policy(&self, ctx: u64) -> KvHostPolicy {
        if ctx <= self.kv_resident || self.kv_cell_s <= 0.0 {
            KvHostPolicy::None
        } else if self.kv_host_cpu {
            KvHostPolicy::Cpu
        } else {
            KvHostPolicy::Stream
        }
    }

    /// Seconds of a decode step's attention reads for `batch` slots at `context` cells each:
    /// the window in device memory, and the cells past it either read over PCIe after it or
    /// attended on the host CPU while the device attends the window.
    fn kv_seconds(&self, batch: u64, context: u64) -> f64 {
        let b = batch as f64;
        let in_vram = b * context.min(self.kv_resident) as f64 * self.kv_cell_s;
        let host = context.saturating_sub(self.kv_resident) as f64;
        if host == 0.0 {
            return in_vram;
        }
        if self.kv_host_cpu {
            // The round trips wait; the host's reads overlap the window's.
            self.kv_cpu_step_s + in_vram.max(b * host * self.kv_cpu_cell_s)
        } else {
            in_vram + b * host * self.kv_host_cell_s
        }
    }

    /// The miss policy these terms record.
    pub fn miss_policy(&self) -> MissPolicy {
        if self.expert_layers == 0 || self.hit_rate >= 1.0 {
            MissPolicy::None
        } else if self.cpu_misses_per_token == 0 {
            MissPolicy::Stream
        } else if self.cpu_misses_per_token >= self.n_expert_used {
            MissPolicy::Cpu
        } else {
            MissPolicy::Split(self.cpu_misses_per_token)
        }
    }

    /// Extra seconds of a decode step of `batch` rows from the misses (`misses`: the step's
    /// streamed cost if every miss were copied) beside the expert products (`exp`, every
    /// layer's): per layer, the streamed misses copy before the products, and the CPU's
    /// misses compute while the copies and products run, only what the CPU takes beyond
    /// them adding; a layer that sends any miss to the host pays its round trip
    /// (`host_layer_s`) on top, since the device waits for the rows back and the sum up.
    fn miss_seconds(&self, batch: u64, exp: f64, misses: f64) -> f64 {
        if self.expert_layers == 0 || misses <= 0.0 || self.expert_miss_s <= 0.0 {
            return misses;
        }
        let layers = f64::from(self.expert_layers);
        // Misses per layer of the step.
        let m = misses / layers / self.expert_miss_s;
        let cpu = m.min((u64::from(self.cpu_misses_per_token) * batch) as f64);
        let stream_s = (m - cpu) * self.expert_miss_s;
        let (trip_s, cpu_s) = if cpu > 0.0 {
            (self.host_layer_s, cpu * self.host_expert_s)
        } else {
            (0.0, 0.0)
        };
        layers * (trip_s + stream_s + (cpu_s - stream_s - exp / layers).max(0.0))
    }

    /// Expert-product and expert-miss seconds for `tokens` rows: (reads, misses).
    fn experts(&self, tokens: u64, per_use: bool) -> (f64, f64) {
        if self.expert_layers == 0 {
            return (0.0, 0.0);
        }
        let distinct = distinct_experts(self.n_expert, self.n_expert_used, tokens);
        let reads = if per_use {
            (tokens * u64::from(self.n_expert_used)) as f64
        } else {
            distinct
        };
        let layers = f64::from(self.expert_layers);
        (
            layers * reads * self.expert_read_s,
            layers * self.outside_touched(tokens) * self.expert_miss_s,
        )
    }

    /// Expected distinct experts of one layer outside the cache that `tokens` tokens pick
    /// (`moe_tiles::outside_touched` over the routing shares: the plan's profile, else
    /// uniform). A long prompt's pass streams each of them once (the cache treats it as a
    /// scan), so its misses follow the experts outside the cache, not the hit rate.
    pub fn outside_touched(&self, tokens: u64) -> f64 {
        if self.expert_layers == 0 || self.hit_rate >= 1.0 {
            return 0.0;
        }
        crate::moe_tiles::outside_touched(&self.routing_shares(), tokens, self.hit_rate)
    }

    /// Each expert's expected uses per token, busiest first: the plan's profile
    /// (`expert_shares`), else uniform routing.
    fn routing_shares(&self) -> std::borrow::Cow<'_, [f64]> {
        if self.expert_shares.is_empty() {
            crate::moe_tiles::uniform(self.n_expert, self.n_expert_used).into()
        } else {
            self.expert_shares.as_slice().into()
        }
    }

    /// Whether a decode step at `context` cells runs kernel by kernel (not one captured
    /// graph): the engine reads each MoE layer's picks back whenever experts come through
    /// the cache (any miss), and attends spilled cells on the host with `--kv-host cpu`.
    pub fn eager(&self, context: u64) -> bool {
        (self.expert_layers > 0 && self.hit_rate < 1.0)
            || (self.kv_host_cpu && context > self.kv_resident && self.kv_cell_s > 0.0)
    }

    /// Seconds of one decode step of `batch` slots, each holding `context` cells.
    pub fn decode_step_seconds(&self, batch: u32, context: u64) -> f64 {
        let b = u64::from(batch.max(1));
        let reads = b.div_ceil(u64::from(self.rows_per_read.max(1))) as f64;
        let (exp, miss) = self.experts(b, self.expert_read_per_use);
        let miss = self.miss_seconds(b, exp, miss);
        let memory = reads * self.dense_read_s + exp;
        let compute = b as f64 * (self.token_compute_s + self.head_compute_s);
        let kv = self.kv_seconds(b, context);
        let eager = if self.eager(context) {
            self.eager_step_s
        } else {
            0.0
        };
        self.step_s + eager + memory.max(compute) + miss + kv + b as f64 * self.row_s
    }

    /// Seconds of one prefill pass of `tokens` tokens after `context` cells of the same slot.
    pub fn prefill_pass_seconds(&self, tokens: u64, context: u64) -> f64 {
        if tokens == 0 {
            return 0.0;
        }
        let t = tokens as f64;
        let (memory, miss) = if self.prefill_experts_per_use {
            let (_, miss) = self.experts(tokens, false);
            let uses = (tokens * u64::from(self.n_expert_used)) as f64;
            let exp = f64::from(self.expert_layers) * uses * self.expert_pass_read_s;
            let dense = if self.prefill_gemm {
                1.0
            } else {
                tokens.div_ceil(u64::from(self.rows_per_read.max(1))) as f64
            };
            (dense * self.dense_read_s + exp, miss)
        } else if self.prefill_gemm {
            let (exp, miss) = self.experts(tokens, false);
            (self.dense_read_s + exp, miss)
        } else {
            let reads = tokens.div_ceil(u64::from(self.rows_per_read.max(1))) as f64;
            let (exp, miss) = self.experts(tokens, self.expert_read_per_use);
            (reads * self.dense_read_s + exp, miss)
        };
        let compute = t * self.token_compute_s
            + self.head_compute_s
            + t * self.expert_gemm_s * (self.tile_slowdown(tokens) - 1.0);
        // Causal attention: token i of the pass reads context + i + 1 cells.
        let cells = t * context as f64 + t * (t + 1.0) / 2.0;
        self.pass_s
            + memory.max(compute)
            + miss
            + cells * self.prefill_cell_s
            + t * (self.prefill_token_s + self.row_s - self.state_row_s + self.delta_token_s)
            + self.state_row_s
    }

    /// How many times longer per useful flop a prefill pass of `tokens` runs the grouped
    /// expert products than the probe measured them: the tile padding of this pass's
    /// routing against the probe's (1 where the pass does not run them: no tensor-core
    /// prefill, experts on the decode products, no experts).
    pub fn tile_slowdown(&self, tokens: u64) -> f64 {
        if !self.prefill_gemm
            || self.prefill_experts_per_use
            || self.expert_layers == 0
            || self.expert_gemm_s <= 0.0
        {
            return 1.0;
        }
        crate::moe_tiles::slowdown(&self.routing_shares(), tokens, self.expert_gemm_ref_tpe)
    }
}

/// The model as the plan knows it.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq)]
#[rkyv(derive(Debug))]
pub struct PlanModel {
    pub arch: String,
    pub name: String,
    /// `ModelInventory::fingerprint`.
    pub fingerprint: String,
    /// Where it came from (path as given).
    pub source: String,
    /// The MTP-only GGUF the MTP block loads from (`strata-plan --mtp-model`), when the main
    /// model has no MTP block of its own; `fingerprint` above then covers both files.
    pub mtp_file: Option<PlanMtpFile>,
    pub n_layer: u32,
    pub n_expert: u64,
    pub n_expert_used: u64,
    pub total_bytes: u64,
    /// Main layers whose FFN is dense (no routed experts).
    pub dense_ffn_layers: u32,
    /// The shapes kernels constrain (see `capability`).
    pub shape: ModelShape,
}

/// A second model file holding only the MTP block (llama.cpp's `convert_hf_to_gguf.py --mtp`
/// output), planned beside the main model.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq)]
#[rkyv(derive(Debug))]
pub struct PlanMtpFile {
    /// Path as given to `--mtp-model`.
    pub source: String,
    /// `ModelInventory::fingerprint` of that file alone (its hyperparameters and every
    /// tensor it holds), so a changed MTP file is named as such at start-up.
    pub fingerprint: String,
}

/// Model dimensions a backend's kernels may constrain.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq, Eq, Default)]
#[rkyv(derive(Debug))]
pub struct ModelShape {
    pub n_embd: u64,
    pub n_ff_exp: u64,
    pub n_head: u64,
    pub n_head_kv: u64,
    pub head_dim_k: u64,
    pub head_dim_v: u64,
}

/// Resolved serve settings (what was planned, not only what was asked).
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq)]
#[rkyv(derive(Debug))]
pub struct PlanServe {
    pub max_context: u64,
    pub requested_batch: u32,
    /// Slots planned.
    pub batch: u32,
    pub kv: KvType,
    pub requested_kv_resident: u64,
    /// Cells per slot planned in VRAM.
    pub kv_resident: u64,
    pub ubatch: u32,
    pub mtp: bool,
    pub spec: u32,
    /// Each device with linear-attention layers holds a `prefix_checkpoint` region (one copy
    /// of each slot's linear state); false for models without linear attention and with
    /// `--no-prefix-checkpoint`.
    pub prefix_checkpoint: bool,
    pub vision: bool,
    pub vram_reserve_bytes: u64,
    pub expert_cache: ExpertCache,
    /// Resolved boundaries (one fewer than `gpu`).
    pub layer_split: Vec<u32>,
    pub layer_split_requested: String,
    pub gpu: Vec<u32>,
    pub pinned_chunk_bytes: u64,
    /// YaRN rope scaling, when asked for.
    pub yarn: Option<PlanYarn>,
    pub expert_profile: String,
}

/// YaRN rope scaling as planned.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, Copy, PartialEq)]
#[rkyv(derive(Debug))]
pub struct PlanYarn {
    pub factor: f64,
    /// The original (trained) context the factor stretches.
    pub orig_ctx: u64,
}

/// The whole plan.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq)]
#[rkyv(derive(Debug))]
pub struct Plan {
    pub model: PlanModel,
    pub hardware_fingerprint: String,
    pub serve: PlanServe,
    pub devices: Vec<DevicePlan>,
    pub tensors: Vec<TensorPlacement>,
    pub host: HostPlan,
    pub degradations: Vec<Degradation>,
    pub suggestions: Vec<String>,
    pub predicted: Predicted,
}

impl Plan {
    pub fn device(&self, index: u32) -> Option<&DevicePlan> {
        self.devices.iter().find(|d| d.index == index)
    }

    /// Predicted seconds of one decode step of `batch` slots at `context` cells each: the
    /// devices of the pipeline one after another.
    pub fn decode_step_seconds(&self, batch: u32, context: u64) -> f64 {
        self.devices
            .iter()
            .map(|d| d.cost.decode_step_seconds(batch, context))
            .sum()
    }

    /// Predicted seconds to prefill `tokens` prompt tokens of one slot from empty, in passes
    /// of `ubatch` tokens.
    pub fn prefill_seconds(&self, tokens: u64, ubatch: u64) -> f64 {
        let ub = ubatch.max(1);
        let mut done = 0;
        let mut s = 0.0;
        while done < tokens {
            let n = ub.min(tokens - done);
            s += self
                .devices
                .iter()
                .map(|d| d.cost.prefill_pass_seconds(n, done))
                .sum::<f64>();
            done += n;
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pinned_experts_pack_whole_into_the_chunks() {
        // Chunks of 3, 3 and 1 experts of 10 bytes (the first has 2 spare bytes).
        let chunks = [32, 32, 10];
        assert_eq!(pinned_expert_at(&chunks, 10, 0), Some((0, 0)));
        assert_eq!(pinned_expert_at(&chunks, 10, 2), Some((0, 20)));
        assert_eq!(pinned_expert_at(&chunks, 10, 3), Some((1, 0)));
        assert_eq!(pinned_expert_at(&chunks, 10, 6), Some((2, 0)));
        assert_eq!(pinned_expert_at(&chunks, 10, 7), None);
        assert_eq!(pinned_expert_at(&[], 10, 0), None);
        assert_eq!(pinned_expert_at(&[5], 10, 0), None);
        assert_eq!(pinned_expert_at(&[5], 0, 0), None);
    }
}

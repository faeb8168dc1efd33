//! The plan: where every byte lives, as the planner decided and the executor obeys.
//! Invariant: sizes and offsets are u64; every region has an offset inside its device's
//! memory (arena regions from 0 up, the two reserves at the top), every tensor a placement.
//! Any change to this file changes the schema hash (see `planfile`), so old plans are refused.

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
}

impl RegionKind {
    pub const ALL: [RegionKind; 13] = [
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
    /// Predicted seconds this device spends per decoded token at batch 1.
    pub predicted_token_seconds: f64,
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
    pub placement: Placement,
}

/// One pinned host allocation.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
#[rkyv(derive(Debug))]
pub struct PinnedChunk {
    /// "kv_spill" or "staging".
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

#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq)]
#[rkyv(derive(Debug))]
pub struct Predicted {
    pub decode_tok_s: f64,
    pub expert_hit_rate: f64,
    /// Context length the decode prediction assumes.
    pub at_context: u64,
    /// How the prediction was made, for the report.
    pub basis: String,
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
    pub n_layer: u32,
    pub n_expert: u64,
    pub n_expert_used: u64,
    pub total_bytes: u64,
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
}

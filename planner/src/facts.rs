//! Per-model numbers the planner needs many times (per-layer dense, expert, KV and state
//! bytes, with prefix sums), computed once from the inventory.
//! Invariant: every figure here is derived from the inventory and hyperparameters alone;
//! nothing depends on the hardware or the serve settings except the KV element type.

use crate::account::align;
use strata_schemas::ggml::GgmlType;
use strata_schemas::inventory::{LayerKind, ModelInventory, TensorRole};
use strata_schemas::plan::RegionKind;

/// Bytes and weights (elements) of one weight type within a set of tensors.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TypeShare {
    pub ty: GgmlType,
    pub bytes: u64,
    pub params: u64,
}

/// The tensors `f` selects, summed by type (raw bytes and elements over `div`), in type order.
fn by_type(
    inv: &ModelInventory,
    div: u64,
    f: &dyn Fn(&strata_schemas::inventory::TensorInfo) -> bool,
) -> Vec<TypeShare> {
    let mut m = std::collections::BTreeMap::<GgmlType, (u64, u64)>::new();
    for t in inv.tensors.iter().filter(|t| f(t)) {
        let e = m.entry(t.ggml_type).or_default();
        e.0 += t.bytes / div;
        e.1 += t.elements() / div;
    }
    m.into_iter()
        .map(|(ty, (bytes, params))| TypeShare { ty, bytes, params })
        .collect()
}

/// Precomputed per-layer sizes of the main blocks and the MTP block(s).
#[derive(Debug, Clone)]
pub struct ModelFacts {
    pub n_layer: u32,
    pub n_expert: u64,
    pub n_expert_used: u64,
    /// Non-expert bytes of main block l.
    pub dense: Vec<u64>,
    /// Bytes of one expert (gate + up + down) of main block l; 0 when the block has none.
    pub expert: Vec<u64>,
    /// KV bytes per cell of main block l (0 for linear-attention blocks).
    pub kv_cell: Vec<u64>,
    /// Linear-attention state bytes per slot of main block l.
    pub linear_state: Vec<u64>,
    pub embedding_bytes: u64,
    /// Head plus output norm (the embedding table again when tied and the head is elsewhere).
    pub head_bytes: u64,
    pub tied_embeddings: bool,
    /// MTP blocks: dense + expert bytes (all resident in the `mtp` region) and KV per cell.
    pub mtp_weight_bytes: u64,
    pub mtp_expert_bytes_total: u64,
    pub mtp_dense_bytes: u64,
    pub mtp_kv_cell: u64,
    pub has_mtp: bool,
    /// Whether the MTP block has its own embedding (`blk.{n_layer}.nextn.embed_tokens`);
    /// without it the block embeds its input tokens with `token_embd.weight` (Qwen3-Next).
    pub mtp_own_embedding: bool,
    /// Weights (elements) of main block l every token uses: everything but its experts.
    pub dense_params: Vec<u64>,
    /// Weights of one expert of main block l (gate + up + down).
    pub expert_params: Vec<u64>,
    /// Weights of the head (the embedding table when tied).
    pub head_params: u64,
    /// Main blocks that run full attention (they read KV).
    pub attention: Vec<bool>,
    /// Bytes and weights of each weight type among main block l's non-expert tensors, among
    /// one of its experts (the stacks over `n_expert`), and in the head (the embedding table
    /// when tied): the cost model weighs each at its type's rate.
    pub dense_types: Vec<Vec<TypeShare>>,
    pub expert_types: Vec<Vec<TypeShare>>,
    pub head_types: Vec<TypeShare>,
    /// Hidden width.
    pub n_embd: u64,
    /// Attention flops of one token against one cached cell in one full-attention block
    /// (scores and the weighted sum over every query head).
    pub attn_cell_flops: u64,
    /// The delta rule's recurrent state of one linear-attention block and slot (value heads x
    /// value dim x key dim f32, the conv state apart), bytes; 0 without linear blocks.
    pub delta_state_bytes: u64,
    prefix_dense: Vec<u64>,
    prefix_expert_total: Vec<u64>,
    prefix_kv_cell: Vec<u64>,
    prefix_linear: Vec<u64>,
}

impl ModelFacts {
    pub fn new(inv: &ModelInventory, kv: GgmlType) -> Self {
        let hp = &inv.hparams;
        let n = hp.n_layer;
        let kv_layer = hp.kv_bytes_per_cell_layer(kv);
        let mut dense = Vec::with_capacity(n as usize);
        let mut expert = Vec::with_capacity(n as usize);
        let mut kv_cell = Vec::with_capacity(n as usize);
        let mut linear_state = Vec::with_capacity(n as usize);
        // Bytes a set of tensors takes when each is placed at an aligned offset.
        let placed = |f: &dyn Fn(&strata_schemas::inventory::TensorInfo) -> bool| -> u64 {
            inv.tensors
                .iter()
                .filter(|t| f(t))
                .map(|t| align(t.bytes))
                .sum()
        };
        let elems = |f: &dyn Fn(&strata_schemas::inventory::TensorInfo) -> bool| -> u64 {
            inv.tensors
                .iter()
                .filter(|t| f(t))
                .map(|t| t.elements())
                .sum()
        };
        let mut dense_params = Vec::with_capacity(n as usize);
        let mut expert_params = Vec::with_capacity(n as usize);
        let mut attention = Vec::with_capacity(n as usize);
        let mut dense_types = Vec::with_capacity(n as usize);
        let mut expert_types = Vec::with_capacity(n as usize);
        for l in 0..n {
            dense_types.push(by_type(inv, 1, &|t| {
                t.layer == Some(l) && t.role != TensorRole::ExpertStack
            }));
            expert_types.push(by_type(inv, hp.n_expert.max(1), &|t| {
                t.layer == Some(l) && t.role == TensorRole::ExpertStack
            }));
            dense_params.push(elems(&|t| {
                t.layer == Some(l) && t.role != TensorRole::ExpertStack
            }));
            expert_params.push(
                elems(&|t| t.layer == Some(l) && t.role == TensorRole::ExpertStack)
                    / hp.n_expert.max(1),
            );
            attention.push(hp.layer_kind(l) == LayerKind::FullAttention);
            dense.push(placed(&|t| {
                t.layer == Some(l) && t.role != TensorRole::ExpertStack
            }));
            expert.push(inv.expert_bytes(l));
            match hp.layer_kind(l) {
                LayerKind::FullAttention => {
                    kv_cell.push(kv_layer);
                    linear_state.push(0);
                }
                LayerKind::LinearAttention => {
                    kv_cell.push(0);
                    linear_state.push(hp.linear_state_bytes_per_layer());
                }
            }
        }
        let mtp_dense =
            placed(&|t| t.layer.is_some_and(|l| l >= n) && t.role != TensorRole::ExpertStack);
        let mtp_experts =
            placed(&|t| t.layer.is_some_and(|l| l >= n) && t.role == TensorRole::ExpertStack);
        let embedding_bytes = placed(&|t| t.role == TensorRole::Embedding && t.layer.is_none());
        let head_only = placed(&|t| t.role == TensorRole::Head && t.layer.is_none());
        let tied = hp.tied_embeddings || head_only == 0;
        let head_bytes =
            head_only + placed(&|t| t.role == TensorRole::OutputNorm && t.layer.is_none());
        let prefix = |v: &Vec<u64>| {
            let mut p = vec![0u64; v.len() + 1];
            for (i, x) in v.iter().enumerate() {
                p[i + 1] = p[i] + x;
            }
            p
        };
        let expert_total: Vec<u64> = expert.iter().map(|e| e * hp.n_expert).collect();
        let head_params = match elems(&|t| t.role == TensorRole::Head && t.layer.is_none()) {
            0 => elems(&|t| t.role == TensorRole::Embedding && t.layer.is_none()),
            h => h,
        };
        let mut head_types = by_type(inv, 1, &|t| t.role == TensorRole::Head && t.layer.is_none());
        if head_types.is_empty() {
            head_types = by_type(inv, 1, &|t| {
                t.role == TensorRole::Embedding && t.layer.is_none()
            });
        }
        Self {
            dense_types,
            expert_types,
            head_types,
            dense_params,
            expert_params,
            head_params,
            attention,
            n_embd: hp.n_embd,
            attn_cell_flops: 2 * hp.n_head * (hp.head_dim_k + hp.head_dim_v),
            delta_state_bytes: hp
                .ssm
                .as_ref()
                .map_or(0, |s| s.time_step_rank * s.head_v_dim() * s.state_size * 4),
            n_layer: n,
            n_expert: hp.n_expert,
            n_expert_used: hp.n_expert_used,
            prefix_dense: prefix(&dense),
            prefix_expert_total: prefix(&expert_total),
            prefix_kv_cell: prefix(&kv_cell),
            prefix_linear: prefix(&linear_state),
            dense,
            expert,
            kv_cell,
            linear_state,
            embedding_bytes,
            head_bytes,
            tied_embeddings: tied,
            mtp_weight_bytes: mtp_dense + mtp_experts,
            mtp_expert_bytes_total: mtp_experts,
            mtp_dense_bytes: mtp_dense,
            mtp_kv_cell: kv_layer * (hp.n_blocks_total() - n) as u64,
            has_mtp: hp.nextn_predict_layers > 0,
            mtp_own_embedding: inv.tensors.iter().any(|t| {
                t.layer.is_some_and(|l| l >= n) && t.name.ends_with(".nextn.embed_tokens.weight")
            }),
        }
    }

    /// Where the last stage keeps its own copy of `token_embd.weight` when it is not also the
    /// first stage (which holds the table in its `embedding` region): in the `head` region
    /// when the head is the embedding (tied), else in the `mtp` region when the MTP block
    /// (`mtp`: planned) embeds its tokens with it; `None` when the stage needs no copy. The
    /// head and the MTP block always sit on the last stage, so one copy serves both.
    pub fn embedding_copy(&self, first: bool, last: bool, mtp: bool) -> Option<RegionKind> {
        if first || !last {
            None
        } else if self.tied_embeddings {
            Some(RegionKind::Head)
        } else if mtp && !self.mtp_own_embedding {
            Some(RegionKind::Mtp)
        } else {
            None
        }
    }

    pub fn dense_range(&self, a: u32, b: u32) -> u64 {
        self.prefix_dense[b as usize] - self.prefix_dense[a as usize]
    }
    /// All experts of the blocks in range.
    pub fn experts_range(&self, a: u32, b: u32) -> u64 {
        self.prefix_expert_total[b as usize] - self.prefix_expert_total[a as usize]
    }
    pub fn kv_cell_range(&self, a: u32, b: u32) -> u64 {
        self.prefix_kv_cell[b as usize] - self.prefix_kv_cell[a as usize]
    }
    pub fn linear_range(&self, a: u32, b: u32) -> u64 {
        self.prefix_linear[b as usize] - self.prefix_linear[a as usize]
    }
    /// Largest single expert in range: the size of one cache slot there.
    pub fn slot_bytes(&self, a: u32, b: u32) -> u64 {
        self.expert[a as usize..b as usize]
            .iter()
            .copied()
            .max()
            .unwrap_or(0)
    }
    /// Blocks in range that have routed experts.
    pub fn expert_layers(&self, a: u32, b: u32) -> u64 {
        self.expert[a as usize..b as usize]
            .iter()
            .filter(|e| **e > 0)
            .count() as u64
    }
    /// KV bytes per cell of every full-attention block, MTP included when planned.
    pub fn kv_cell_all(&self, mtp: bool) -> u64 {
        self.kv_cell_range(0, self.n_layer) + if mtp { self.mtp_kv_cell } else { 0 }
    }
}

//! The model's tensor inventory and hyperparameters: what every model source (descriptor
//! TOML, GGUF header, safetensors header) is reduced to before planning.
//! Invariant: every tensor's `bytes` equals its type's block table applied to its dims, and
//! every tensor has exactly one role; the planner never looks at a model file directly.

use crate::ggml::GgmlType;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

/// What a tensor is for, which decides where the planner may put it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TensorRole {
    /// Token embedding table (`token_embd.weight`).
    Embedding,
    /// Output projection (`output.weight`); absent when embeddings are tied.
    Head,
    /// Final norm (`output_norm.weight`); travels with the head.
    OutputNorm,
    /// A per-layer tensor that every token reads (attention, norms, router, shared expert,
    /// linear-attention projections, dense FFN).
    Dense,
    /// A merged routed-expert stack: the last dim is the expert index
    /// (`blk.N.ffn_{gate,up,down}_exps.weight`). One expert is a `1/n_expert` slice.
    ExpertStack,
    /// A tensor only the MTP (next-n) draft block uses outside the ordinary layer
    /// (`blk.N.nextn.*`).
    MtpExtra,
}

/// Kind of sequence mixer in a layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LayerKind {
    FullAttention,
    LinearAttention,
}

/// One tensor as the planner sees it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TensorInfo {
    /// llama.cpp name, e.g. `blk.3.ffn_up_exps.weight`.
    pub name: String,
    /// Shape in GGUF order: `dims[0]` is the contiguous dimension.
    pub dims: Vec<u64>,
    pub ggml_type: GgmlType,
    /// Exact bytes from the block table.
    pub bytes: u64,
    pub role: TensorRole,
    /// Block index for per-layer tensors; the MTP block uses index `n_layer..`.
    pub layer: Option<u32>,
    /// Offset of the data inside its source file (relative to the data section), when the
    /// source is a real file; `None` for descriptors.
    pub file_offset: Option<u64>,
}

impl TensorInfo {
    /// Build a tensor, computing its bytes from the block table.
    pub fn new(
        name: impl Into<String>,
        dims: Vec<u64>,
        ggml_type: GgmlType,
        role: TensorRole,
        layer: Option<u32>,
    ) -> Result<Self, InventoryError> {
        let name = name.into();
        let bytes = ggml_type
            .tensor_bytes(&dims)
            .ok_or_else(|| InventoryError::BadShape {
                tensor: name.clone(),
                reason: format!(
                    "dims {:?} do not fit type {} (ne0 must be a multiple of {} and the size must fit in u64)",
                    dims,
                    ggml_type,
                    ggml_type.block_elems()
                ),
            })?;
        Ok(Self {
            name,
            dims,
            ggml_type,
            bytes,
            role,
            layer,
            file_offset: None,
        })
    }

    /// Number of elements.
    pub fn elements(&self) -> u64 {
        self.dims.iter().product()
    }
}

/// Linear-attention (gated delta net) shape, llama.cpp's `*.ssm.*` keys.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SsmParams {
    /// `ssm.conv_kernel`: depthwise conv width (4).
    pub conv_kernel: u64,
    /// `ssm.state_size`: key head dim (128).
    pub state_size: u64,
    /// `ssm.group_count`: number of key heads (16).
    pub group_count: u64,
    /// `ssm.time_step_rank`: number of value heads (32).
    pub time_step_rank: u64,
    /// `ssm.inner_size`: value heads x value head dim (4096).
    pub inner_size: u64,
}

impl SsmParams {
    /// Channels of the depthwise conv: q, k (group_count x state_size each) and v.
    pub fn conv_channels(&self) -> u64 {
        2 * self.group_count * self.state_size + self.inner_size
    }
    /// Value head dim.
    pub fn head_v_dim(&self) -> u64 {
        self.inner_size / self.time_step_rank.max(1)
    }
}

/// Hyperparameters the planner and executor need, named after llama.cpp's GGUF keys.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HParams {
    /// `block_count`: main blocks, not counting MTP blocks.
    pub n_layer: u32,
    /// `embedding_length`.
    pub n_embd: u64,
    /// Vocabulary size (rows of `token_embd`).
    pub n_vocab: u64,
    /// `context_length`: trained context.
    pub n_ctx_train: u64,
    /// `attention.head_count`.
    pub n_head: u64,
    /// `attention.head_count_kv`.
    pub n_head_kv: u64,
    /// `attention.key_length`.
    pub head_dim_k: u64,
    /// `attention.value_length`.
    pub head_dim_v: u64,
    /// `feed_forward_length` for dense FFN layers (0 when every layer is MoE).
    #[serde(default)]
    pub n_ff: u64,
    /// `expert_count`.
    pub n_expert: u64,
    /// `expert_used_count`.
    pub n_expert_used: u64,
    /// `expert_feed_forward_length`.
    pub n_ff_exp: u64,
    /// `expert_shared_feed_forward_length` (0 when there is no shared expert).
    #[serde(default)]
    pub n_ff_shexp: u64,
    /// Number of leading layers with a dense FFN instead of experts (deepseek2).
    #[serde(default)]
    pub n_leading_dense: u32,
    /// `full_attention_interval` (qwen3next: every 4th layer); `None` = all full attention.
    #[serde(default)]
    pub full_attention_interval: Option<u32>,
    /// Linear-attention parameters for hybrid models.
    #[serde(default)]
    pub ssm: Option<SsmParams>,
    /// `nextn_predict_layers`: MTP draft blocks after the main ones.
    #[serde(default)]
    pub nextn_predict_layers: u32,
    /// `rope.freq_base`.
    #[serde(default = "default_rope_theta")]
    pub rope_theta: f64,
    /// `rope.dimension_count` (rotated dims per head); `None` = the whole head.
    #[serde(default)]
    pub rope_dim: Option<u64>,
    /// `attention.layer_norm_rms_epsilon`.
    #[serde(default = "default_rms_eps")]
    pub rms_eps: f64,
    /// `expert_weights_norm` / HF `norm_topk_prob`.
    #[serde(default = "default_true")]
    pub norm_topk_prob: bool,
    /// Output head shares the embedding table.
    #[serde(default)]
    pub tied_embeddings: bool,
}

fn default_rope_theta() -> f64 {
    1_000_000.0
}
fn default_rms_eps() -> f64 {
    1e-6
}
fn default_true() -> bool {
    true
}

impl HParams {
    /// Sequence mixer of block `layer` (MTP blocks are full attention).
    pub fn layer_kind(&self, layer: u32) -> LayerKind {
        if layer >= self.n_layer {
            return LayerKind::FullAttention;
        }
        match (self.full_attention_interval, &self.ssm) {
            (Some(k), Some(_)) if k > 0 && (layer + 1) % k != 0 => LayerKind::LinearAttention,
            _ => LayerKind::FullAttention,
        }
    }

    /// Whether block `layer` has routed experts.
    pub fn layer_has_experts(&self, layer: u32) -> bool {
        self.n_expert > 0 && layer >= self.n_leading_dense
    }

    /// All blocks including MTP ones.
    pub fn n_blocks_total(&self) -> u32 {
        self.n_layer + self.nextn_predict_layers
    }

    /// Bytes of K plus V for one context cell of one full-attention layer at `kv` type.
    pub fn kv_bytes_per_cell_layer(&self, kv: GgmlType) -> u64 {
        let k = kv
            .bytes_for(self.n_head_kv * self.head_dim_k)
            .unwrap_or(self.n_head_kv * self.head_dim_k * 2);
        let v = kv
            .bytes_for(self.n_head_kv * self.head_dim_v)
            .unwrap_or(self.n_head_kv * self.head_dim_v * 2);
        k + v
    }

    /// Linear-attention state of one slot for one linear layer: recurrent (f32) + conv (f32).
    pub fn linear_state_bytes_per_layer(&self) -> u64 {
        match &self.ssm {
            Some(s) => {
                let recurrent = s.time_step_rank * s.head_v_dim() * s.state_size * 4;
                let conv = s.conv_kernel.saturating_sub(1) * s.conv_channels() * 4;
                recurrent + conv
            }
            None => 0,
        }
    }
}

/// The vision tower (an mmproj file or a descriptor `[vision]` section), as planning needs it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VisionSpec {
    /// Bytes of all vision-tower weights (projector included).
    pub weights_bytes: u64,
    /// Width of the vision encoder.
    pub n_embd: u64,
    /// Encoder blocks.
    pub n_layer: u32,
    /// Attention heads of the encoder.
    pub n_head: u64,
    /// Encoder FFN width.
    pub n_ff: u64,
    /// Patch tokens of the largest image the encoder takes in one pass.
    pub max_image_tokens: u64,
}

impl VisionSpec {
    /// Activation workspace for one image: two residual streams, the FFN hidden, QKV and the
    /// score rows of one head at a time (f32), rounded up to 1 MiB.
    pub fn workspace_bytes(&self) -> u64 {
        let t = self.max_image_tokens;
        let per_token = 2 * self.n_embd + 3 * self.n_embd + self.n_ff.max(self.n_embd);
        let bytes = t * per_token * 4 + t * t * 4;
        bytes.div_ceil(1 << 20) * (1 << 20)
    }
}

/// A model reduced to what planning needs.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelInventory {
    /// llama.cpp architecture name (`qwen3moe`, `qwen3next`, ...).
    pub arch: String,
    /// Human name (`general.name` or the descriptor's `name`).
    pub name: String,
    pub hparams: HParams,
    /// Every weight tensor, in source order.
    pub tensors: Vec<TensorInfo>,
    /// The vision tower, when the source describes one (a descriptor `[vision]` section).
    #[serde(default)]
    pub vision: Option<VisionSpec>,
}

impl ModelInventory {
    /// Stable fingerprint of architecture, hyperparameters and tensor table (names, dims,
    /// types): two sources with the same tensors fingerprint the same.
    pub fn fingerprint(&self) -> String {
        let mut h = Sha256::new();
        h.update(self.arch.as_bytes());
        h.update([0]);
        h.update(serde_json::to_vec(&self.hparams).expect("hparams serialize to JSON infallibly"));
        for t in &self.tensors {
            h.update(t.name.as_bytes());
            h.update([0]);
            for d in &t.dims {
                h.update(d.to_le_bytes());
            }
            h.update(t.ggml_type.id().to_le_bytes());
        }
        hex16(&h.finalize())
    }

    /// Sum of all tensor bytes.
    pub fn total_bytes(&self) -> u64 {
        self.tensors.iter().map(|t| t.bytes).sum()
    }

    /// Bytes of one routed expert (gate + up + down slices) of block `layer`; 0 if none.
    pub fn expert_bytes(&self, layer: u32) -> u64 {
        let n = self.hparams.n_expert.max(1);
        self.tensors
            .iter()
            .filter(|t| t.role == TensorRole::ExpertStack && t.layer == Some(layer))
            .map(|t| t.bytes / n)
            .sum()
    }

    /// Bytes of the tensors of block `layer` that are not expert stacks (MTP extras of an
    /// MTP block included).
    pub fn dense_bytes(&self, layer: u32) -> u64 {
        self.tensors
            .iter()
            .filter(|t| t.layer == Some(layer) && t.role != TensorRole::ExpertStack)
            .map(|t| t.bytes)
            .sum()
    }

    /// Bytes of tensors with `role` and no layer (embedding, head, output norm).
    pub fn global_bytes(&self, role: TensorRole) -> u64 {
        self.tensors
            .iter()
            .filter(|t| t.role == role && t.layer.is_none())
            .map(|t| t.bytes)
            .sum()
    }

    /// Find a tensor by name.
    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.tensors.iter().find(|t| t.name == name)
    }
}

/// Lower-case hex of the first 16 bytes of a digest.
pub fn hex16(bytes: &[u8]) -> String {
    bytes.iter().take(16).map(|b| format!("{b:02x}")).collect()
}

/// Errors building or checking an inventory.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum InventoryError {
    #[error("tensor `{tensor}`: {reason}")]
    BadShape { tensor: String, reason: String },
    #[error("tensor `{tensor}` is missing: architecture `{arch}` needs it")]
    Missing { arch: String, tensor: String },
    #[error("tensor `{tensor}` is not part of architecture `{arch}`")]
    Unexpected { arch: String, tensor: String },
    #[error("tensor `{tensor}` has shape {found:?}, architecture `{arch}` with these hyperparameters needs {expected:?}")]
    WrongShape {
        arch: String,
        tensor: String,
        found: Vec<u64>,
        expected: Vec<u64>,
    },
    #[error("unsupported architecture `{arch}`: supported for planning are {supported}")]
    UnsupportedArch { arch: String, supported: String },
    #[error("bad hyperparameter `{key}`: {reason}")]
    BadHParam { key: String, reason: String },
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::known::qwen3_next_80b_a3b as next_like;

    #[test]
    fn design_worked_kv_and_linear_state() {
        let hp = next_like();
        let full: Vec<u32> = (0..48)
            .filter(|l| hp.layer_kind(*l) == LayerKind::FullAttention)
            .collect();
        assert_eq!(full.len(), 12);
        assert_eq!(full[0], 3);
        // 12 layers x (K + V) x 2 heads x 256 x 34/32 = 13,056 B per cell.
        assert_eq!(12 * hp.kv_bytes_per_cell_layer(GgmlType::Q8_0), 13_056);
        // The MTP block's attention: 1,088 B.
        assert_eq!(hp.kv_bytes_per_cell_layer(GgmlType::Q8_0), 1_088);
        assert_eq!(hp.layer_kind(48), LayerKind::FullAttention);
        // 36 layers x 32 x 128 x 128 x 4 B ~ 75 MB, plus conv 3 x 8192 values per layer.
        let per_layer = hp.linear_state_bytes_per_layer();
        assert_eq!(per_layer, 32 * 128 * 128 * 4 + 3 * 8192 * 4);
        assert_eq!(36 * 32 * 128 * 128 * 4, 75_497_472); // "~75 MB" of recurrent state
        assert_eq!(36 * per_layer, 75_497_472 + 36 * 3 * 8192 * 4);
    }
}

//! The forward pass of whichever architecture a model file holds: one type a pipeline can be
//! generic over, dispatching each call to the architecture's own pass.
//! Invariant: adds no behaviour of its own; every call goes to exactly one architecture.

use super::qwen3moe::{self, Qwen3Moe, StageSpec};
use super::qwen3next::{self, Qwen3Next};
use super::{Forward, ModelError, MtpInput};
use crate::backend::{Bind, Ops};
use strata_schemas::dims::Dims;
use strata_schemas::inventory::HParams;

/// A stage of a Qwen3-MoE or a Qwen3-Next model.
pub enum AnyModel<B: Ops> {
    Qwen3Moe(Qwen3Moe<B>),
    Qwen3Next(Qwen3Next<B>),
}

/// The forward pass for `arch`, its dims checked, and the name its tensors are checked under;
/// an error naming the architecture when this build has none for it.
pub fn check_dims(arch: &str, hp: &HParams) -> Result<(Dims, &'static str), ModelError> {
    match arch {
        qwen3moe::ARCH => Ok((qwen3moe::check_dims(hp)?, qwen3moe::ARCH)),
        qwen3next::ARCH => Ok((qwen3next::check_dims(hp)?, qwen3next::ARCH)),
        other => Err(ModelError::HParam {
            key: "general.architecture",
            reason: format!("`{other}` has no forward pass in this build (qwen3moe, qwen3next)"),
        }),
    }
}

impl<B: Bind> AnyModel<B> {
    /// Bind `stage` of an `arch` model (see [`check_dims`]).
    pub fn bind(
        arch: &str,
        b: &mut B,
        d: &Dims,
        hp: &HParams,
        stage: StageSpec,
    ) -> Result<Self, B::Error> {
        if arch == qwen3next::ARCH {
            Ok(Self::Qwen3Next(Qwen3Next::bind(b, d, hp, stage)?))
        } else {
            Ok(Self::Qwen3Moe(Qwen3Moe::bind(b, d, hp, stage)?))
        }
    }
}

impl<B: Ops> Forward<B> for AnyModel<B> {
    fn forward(&self, b: &mut B, n: usize) -> Result<(), B::Error> {
        match self {
            Self::Qwen3Moe(m) => m.forward(b, n),
            Self::Qwen3Next(m) => m.forward(b, n),
        }
    }

    fn head(&self, b: &mut B, first: usize, rows: usize) -> Result<(), B::Error> {
        match self {
            Self::Qwen3Moe(m) => m.head(b, first, rows),
            Self::Qwen3Next(m) => m.head(b, first, rows),
        }
    }

    fn holds_head(&self) -> bool {
        match self {
            Self::Qwen3Moe(m) => m.holds_head(),
            Self::Qwen3Next(m) => m.holds_head(),
        }
    }
    fn recurrent(&self) -> bool {
        match self {
            Self::Qwen3Moe(m) => m.recurrent(),
            Self::Qwen3Next(m) => m.recurrent(),
        }
    }

    fn holds_mtp(&self) -> bool {
        match self {
            Self::Qwen3Moe(m) => m.holds_mtp(),
            Self::Qwen3Next(m) => m.holds_mtp(),
        }
    }

    fn mtp(
        &self,
        b: &mut B,
        n: usize,
        input: MtpInput,
        head: Option<(usize, usize)>,
    ) -> Result<(), B::Error> {
        match self {
            Self::Qwen3Moe(m) => m.mtp(b, n, input, head),
            Self::Qwen3Next(m) => m.mtp(b, n, input, head),
        }
    }
}

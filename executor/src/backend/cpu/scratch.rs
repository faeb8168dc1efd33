//! The CPU backend's working buffers: the plan's scratch region (or, without a plan, storage
//! of the same layout owned here) bound by [`WorkBuf`] name, handed to ops as disjoint typed
//! slices.
//! Invariant: every bound buffer lies inside the storage, 4-byte aligned, and no two bound
//! buffers share a byte (checked once at binding), so several may be borrowed mutably at once.

use strata_schemas::workset::WorkBuf;

/// A buffer's place in the storage.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Span {
    off: usize,
    len: usize,
}

#[derive(Debug)]
enum Storage<'a> {
    /// u64 words, so every 4-aligned offset is 4-aligned in memory.
    Owned(Vec<u64>),
    Region(&'a mut [u8]),
}

/// Why buffers could not be bound or borrowed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ScratchError {
    #[error("the plan's scratch has no `{0}` buffer: re-plan with this build's strata-plan")]
    Missing(&'static str),
    #[error("scratch buffer `{name}` at {off}+{len} lies outside the {size}-byte scratch region")]
    Outside {
        name: String,
        off: u64,
        len: u64,
        size: u64,
    },
    #[error("scratch buffers `{a}` and `{b}` overlap; the plan is inconsistent")]
    Overlap { a: &'static str, b: &'static str },
    #[error("scratch buffer `{0}` is not 4-byte aligned")]
    Misaligned(String),
    #[error("`{buf}` holds {have} elements but the op needs {need}")]
    TooSmall {
        buf: &'static str,
        have: usize,
        need: usize,
    },
    #[error("buffer `{0}` passed twice to one op")]
    Aliased(&'static str),
}

/// The bound working buffers of one stage.
#[derive(Debug)]
pub struct Scratch<'a> {
    storage: Storage<'a>,
    spans: Vec<Option<Span>>,
}

fn index(b: WorkBuf) -> usize {
    WorkBuf::ALL.iter().position(|x| *x == b).unwrap_or(0)
}

impl<'a> Scratch<'a> {
    /// Bind `bufs` (name, offset, bytes) inside `region`.
    pub fn bind(region: &'a mut [u8], bufs: &[(WorkBuf, u64, u64)]) -> Result<Self, ScratchError> {
        let size = region.len() as u64;
        if region.as_ptr() as usize % 4 != 0 {
            return Err(ScratchError::Misaligned("the scratch region".into()));
        }
        let spans = Self::spans(bufs, size)?;
        Ok(Self {
            storage: Storage::Region(region),
            spans,
        })
    }

    /// Storage of its own for `bufs` (name, bytes), carved back to back (tests and plan-less
    /// engines; a planned engine binds the plan's region instead).
    pub fn owned(bufs: &[(WorkBuf, u64)]) -> Result<Self, ScratchError> {
        let mut at = 0u64;
        let mut placed = Vec::with_capacity(bufs.len());
        for &(b, bytes) in bufs {
            placed.push((b, at, bytes));
            at += bytes.div_ceil(16) * 16;
        }
        let words = at.div_ceil(8) as usize;
        let spans = Self::spans(&placed, at)?;
        Ok(Self {
            storage: Storage::Owned(vec![0u64; words]),
            spans,
        })
    }

    fn spans(bufs: &[(WorkBuf, u64, u64)], size: u64) -> Result<Vec<Option<Span>>, ScratchError> {
        let mut spans = vec![None; WorkBuf::ALL.len()];
        for &(b, off, len) in bufs {
            if off.checked_add(len).is_none_or(|end| end > size) {
                return Err(ScratchError::Outside {
                    name: b.name().into(),
                    off,
                    len,
                    size,
                });
            }
            if off % 4 != 0 {
                return Err(ScratchError::Misaligned(b.name().into()));
            }
            spans[index(b)] = Some(Span {
                off: off as usize,
                len: len as usize,
            });
        }
        for (i, a) in spans.iter().enumerate() {
            for (j, b) in spans.iter().enumerate().skip(i + 1) {
                if let (Some(a), Some(b)) = (a, b) {
                    if a.len > 0 && b.len > 0 && a.off < b.off + b.len && b.off < a.off + a.len {
                        return Err(ScratchError::Overlap {
                            a: WorkBuf::ALL[i].name(),
                            b: WorkBuf::ALL[j].name(),
                        });
                    }
                }
            }
        }
        Ok(spans)
    }

    /// Whether `b` is bound.
    pub fn has(&self, b: WorkBuf) -> bool {
        self.spans[index(b)].is_some()
    }

    fn base(&mut self) -> (*mut u8, usize) {
        match &mut self.storage {
            Storage::Owned(v) => (v.as_mut_ptr() as *mut u8, v.len() * 8),
            Storage::Region(r) => (r.as_mut_ptr(), r.len()),
        }
    }

    /// The buffers `bufs` as 4-byte words (f32 or u32 by `T`), mutably and at once; each must
    /// hold at least `need[i]` elements.
    pub fn words<T: Word, const N: usize>(
        &mut self,
        bufs: [(WorkBuf, usize); N],
    ) -> Result<[&mut [T]; N], ScratchError> {
        let (f, []) = self.mixed::<T, f32, N, 0>(bufs, [])?;
        Ok(f)
    }

    /// Like [`Scratch::words`] for buffers of two word types at once (f32 values and u32
    /// indices, say).
    #[allow(clippy::type_complexity)]
    pub fn mixed<A: Word, B: Word, const N: usize, const M: usize>(
        &mut self,
        a: [(WorkBuf, usize); N],
        b: [(WorkBuf, usize); M],
    ) -> Result<([&mut [A]; N], [&mut [B]; M]), ScratchError> {
        let all = || a.iter().chain(b.iter()).map(|(x, _)| *x);
        for (i, x) in all().enumerate() {
            if all().take(i).any(|c| c == x) {
                return Err(ScratchError::Aliased(x.name()));
            }
        }
        let span = |this: &Self, (x, need): (WorkBuf, usize)| -> Result<Span, ScratchError> {
            let s = this.spans[index(x)].ok_or(ScratchError::Missing(x.name()))?;
            if s.len / 4 < need {
                return Err(ScratchError::TooSmall {
                    buf: x.name(),
                    have: s.len / 4,
                    need,
                });
            }
            Ok(s)
        };
        let mut sa = [Span { off: 0, len: 0 }; N];
        for (i, x) in a.iter().enumerate() {
            sa[i] = span(self, *x)?;
        }
        let mut sb = [Span { off: 0, len: 0 }; M];
        for (i, x) in b.iter().enumerate() {
            sb[i] = span(self, *x)?;
        }
        let (base, size) = self.base();
        let view = |s: Span| {
            debug_assert!(s.off + s.len <= size);
            (base, s)
        };
        // Every span lies inside the storage (checked at binding), is 4-aligned (the storage
        // base and every offset are), and no two spans of this call share a byte (bound spans
        // never overlap and no buffer is passed twice); the slices borrow `self` mutably for
        // their lifetime, so nothing else touches the storage meanwhile.
        let fa = sa.map(|s| {
            let (p, s) = view(s);
            // SAFETY: see above; A is a 4-byte plain word, valid for any bit pattern.
            unsafe { std::slice::from_raw_parts_mut(p.add(s.off) as *mut A, s.len / 4) }
        });
        let fb = sb.map(|s| {
            let (p, s) = view(s);
            // SAFETY: see above; B is a 4-byte plain word, valid for any bit pattern.
            unsafe { std::slice::from_raw_parts_mut(p.add(s.off) as *mut B, s.len / 4) }
        });
        Ok((fa, fb))
    }
}

/// A 4-byte plain value a buffer may be viewed as.
pub trait Word: Copy + 'static {}
impl Word for f32 {}
impl Word for u32 {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn disjoint_buffers_borrow_together_and_misuse_is_refused() {
        let mut s = Scratch::owned(&[(WorkBuf::X, 64), (WorkBuf::Xn, 32)]).unwrap();
        {
            let [x, xn]: [&mut [f32]; 2] = s.words([(WorkBuf::X, 16), (WorkBuf::Xn, 8)]).unwrap();
            x.fill(1.0);
            xn.fill(2.0);
        }
        let [x]: [&mut [f32]; 1] = s.words([(WorkBuf::X, 16)]).unwrap();
        assert!(x.iter().all(|v| *v == 1.0));
        assert_eq!(
            s.words::<f32, 1>([(WorkBuf::Xn, 9)]).unwrap_err(),
            ScratchError::TooSmall {
                buf: "xn",
                have: 8,
                need: 9
            }
        );
        assert!(matches!(
            s.words::<f32, 2>([(WorkBuf::X, 1), (WorkBuf::X, 1)]),
            Err(ScratchError::Aliased("x"))
        ));
        assert!(matches!(
            s.words::<f32, 1>([(WorkBuf::Q, 1)]),
            Err(ScratchError::Missing("q"))
        ));
        let mut region = vec![0u8; 128];
        let e =
            Scratch::bind(&mut region, &[(WorkBuf::X, 0, 64), (WorkBuf::Q, 32, 64)]).unwrap_err();
        assert!(matches!(e, ScratchError::Overlap { .. }), "{e}");
        let e = Scratch::bind(&mut region, &[(WorkBuf::X, 100, 64)]).unwrap_err();
        assert!(matches!(e, ScratchError::Outside { .. }), "{e}");
    }
}

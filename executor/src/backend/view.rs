//! Bounds-checked windows of a device allocation, vendor-neutral: an address and a length
//! tied by lifetime to the allocation that owns them. The HIP backend's arenas hand these
//! out; the CUDA backend has the same shape in `cuda::arena` (one type for both is what the
//! shared driver interface wants).
//! Invariant: a view never reaches past its allocation's end and never outlives it.

use std::marker::PhantomData;

/// What a view check refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ViewError {
    #[error("view {offset}+{len} lies outside {what} of {size} bytes")]
    OutOfBounds {
        what: String,
        offset: u64,
        len: u64,
        size: u64,
    },
    #[error("{op}: {detail}")]
    Shape { op: &'static str, detail: String },
}

/// A window `[ptr, ptr + len)` of device memory owned by an `O` (an arena) that outlives it.
/// Copyable: several ops may read one view; which op may write it is the plan's business.
#[derive(Debug)]
pub struct View<'a, O> {
    ptr: u64,
    len: u64,
    _owner: PhantomData<&'a O>,
}

impl<O> Clone for View<'_, O> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<O> Copy for View<'_, O> {}
impl<O> PartialEq for View<'_, O> {
    fn eq(&self, o: &Self) -> bool {
        (self.ptr, self.len) == (o.ptr, o.len)
    }
}
impl<O> Eq for View<'_, O> {}

impl<'a, O> View<'a, O> {
    /// The whole of an allocation at `ptr` of `len` bytes; only an owner makes one, and the
    /// lifetime ties the view to it.
    #[cfg_attr(not(feature = "hip"), allow(dead_code))]
    pub(crate) fn whole(_owner: &'a O, ptr: u64, len: u64) -> Self {
        Self {
            ptr,
            len,
            _owner: PhantomData,
        }
    }

    /// Device address of the first byte.
    pub fn ptr(&self) -> u64 {
        self.ptr
    }

    /// Length in bytes.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Whether the view holds no bytes.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The sub-window `[offset, offset + len)` of this view.
    pub fn sub(&self, offset: u64, len: u64) -> Result<View<'a, O>, ViewError> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len => Ok(View {
                ptr: self.ptr + offset,
                len,
                _owner: PhantomData,
            }),
            _ => Err(ViewError::OutOfBounds {
                what: "the view".into(),
                offset,
                len,
                size: self.len,
            }),
        }
    }

    /// Checks the view holds exactly `len` bytes.
    pub fn expect_len(&self, op: &'static str, len: u64) -> Result<(), ViewError> {
        if self.len != len {
            return Err(ViewError::Shape {
                op,
                detail: format!("view of {} bytes where {len} are needed", self.len),
            });
        }
        Ok(())
    }

    /// Checks the view holds at least `len` bytes and starts `align`-aligned.
    pub fn expect(
        &self,
        op: &'static str,
        what: &str,
        len: u64,
        align: u64,
    ) -> Result<(), ViewError> {
        let detail = if self.len < len {
            format!("{what}: view of {} bytes where {len} are needed", self.len)
        } else if align == 0 || self.ptr % align != 0 {
            format!(
                "{what}: view at {:#x} is not {align}-byte aligned",
                self.ptr
            )
        } else {
            return Ok(());
        };
        Err(ViewError::Shape { op, detail })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn views_stay_inside_their_allocation() {
        let owner = ();
        let v = View::whole(&owner, 0x1000, 256);
        let s = v.sub(16, 32).unwrap();
        assert_eq!((s.ptr(), s.len()), (0x1010, 32));
        assert_eq!(s.sub(0, 32).unwrap(), s);
        assert!(s.sub(1, 32).is_err());
        assert!(v.sub(u64::MAX, 2).is_err(), "overflow is refused");
        assert!(v.sub(256, 0).unwrap().is_empty());
        let e = v.sub(200, 100).unwrap_err().to_string();
        assert!(e.contains("200+100") && e.contains("256"), "{e}");
    }

    #[test]
    fn length_and_alignment_checks_name_the_operand() {
        let owner = ();
        let v = View::whole(&owner, 0x1004, 64);
        assert!(v.expect_len("htod", 64).is_ok());
        assert!(v
            .expect_len("htod", 63)
            .unwrap_err()
            .to_string()
            .contains("63"));
        assert!(v.expect("op", "x", 64, 4).is_ok());
        let e = v.expect("op", "x", 64, 16).unwrap_err().to_string();
        assert!(e.contains("x:") && e.contains("16-byte"), "{e}");
        let e = v.expect("op", "w", 65, 1).unwrap_err().to_string();
        assert!(e.contains("w:") && e.contains("65"), "{e}");
    }
}

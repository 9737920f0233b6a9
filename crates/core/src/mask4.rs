//! Element-wise masks that differ per batch entry and head: strided `[B, H, n_q, n_k]`
//! views whose strides may be 0 (broadcast), resolved per (batch, head) into the
//! `[n_q, n_k]` matrix views every engine's tile loop already reads.

use faer::MatRef;

use crate::{BoolMask, Error, Result};

/// A read-only strided view of a `[batch, heads, n_q, n_k]` mask (boolean or additive).
///
/// Any axis may broadcast, PyTorch-style: a stride of 0 repeats one slice along the axis,
/// and an axis of length 1 stands for any length. One of the two matrix axes must be
/// contiguous or broadcast (query or key stride 0 or 1), so that each (batch, head) is a
/// faer view without a copy; anything else is [`Error::Layout`].
///
/// ```
/// use attn_core::Mask4Ref;
/// // One [2, 3] mask per head of 2 heads, shared by every batch entry (batch stride 0).
/// let bias: Vec<f32> = (0..12).map(|x| x as f32).collect();
/// let m = Mask4Ref::new(&bias, [4, 2, 2, 3], [0, 6, 3, 1])?;
/// assert_eq!(m.head(3, 1, 2, 3)?[(1, 2)], 11.0); // head 1, query 1, key 2
/// // A key-padding style mask [B, 1, 1, n_k] broadcast over heads and queries.
/// let keys = [0.0f32, f32::NEG_INFINITY, 0.0];
/// let pad = Mask4Ref::contiguous(&keys, [1, 1, 1, 3])?;
/// assert_eq!(pad.head(0, 5, 4, 3)?[(3, 1)], f32::NEG_INFINITY);
/// # Ok::<(), attn_core::Error>(())
/// ```
#[derive(Debug)]
pub struct Mask4Ref<'a, T> {
    data: &'a [T],
    dims: [usize; 4],
    strides: [usize; 4],
}

// A view is a borrow: copyable whatever `T` is.
impl<T> Clone for Mask4Ref<'_, T> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<T> Copy for Mask4Ref<'_, T> {}

/// The stride an axis really steps by: an axis of one element never steps.
fn effective(dim: usize, stride: usize) -> usize {
    if dim <= 1 { 0 } else { stride }
}

impl<'a, T> Mask4Ref<'a, T> {
    /// A view with explicit element strides for (batch, head, query, key); 0 broadcasts.
    /// The view must fit `data`, and the query or the key axis must have stride 0 or 1.
    ///
    /// ```
    /// use attn_core::Mask4Ref;
    /// let data = [true; 16];
    /// assert!(Mask4Ref::new(&data, [1, 1, 4, 4], [0, 0, 4, 1]).is_ok()); // row-major
    /// assert!(Mask4Ref::new(&data, [1, 1, 4, 4], [0, 0, 1, 4]).is_ok()); // column-major
    /// assert!(Mask4Ref::new(&data, [1, 1, 4, 4], [0, 0, 5, 1]).is_err()); // past the end
    /// assert!(Mask4Ref::new(&data, [1, 1, 2, 2], [0, 0, 2, 3]).is_err()); // neither axis contiguous
    /// ```
    pub fn new(data: &'a [T], dims: [usize; 4], strides: [usize; 4]) -> Result<Self> {
        let what = "4-D mask";
        if !dims.contains(&0) {
            let last = (0..4).try_fold(0usize, |acc, a| {
                acc.checked_add((dims[a] - 1).checked_mul(strides[a])?)
            });
            match last {
                Some(last) if last < data.len() => {}
                Some(last) => {
                    return Err(Error::layout(
                        what,
                        format!(
                            "dims {dims:?} with strides {strides:?} need {} elements but the buffer has {}",
                            last + 1,
                            data.len()
                        ),
                    ));
                }
                None => {
                    return Err(Error::layout(
                        what,
                        format!("dims {dims:?} with strides {strides:?} overflow usize"),
                    ));
                }
            }
        }
        let (rs, cs) = (
            effective(dims[2], strides[2]),
            effective(dims[3], strides[3]),
        );
        if rs > 1 && cs > 1 {
            return Err(Error::layout(
                what,
                format!(
                    "strides {strides:?}: the query or the key axis must be contiguous (stride 1) or broadcast (stride 0)"
                ),
            ));
        }
        Ok(Self {
            data,
            dims,
            strides,
        })
    }

    /// A view of a contiguous row-major `[batch, heads, n_q, n_k]` buffer.
    pub fn contiguous(data: &'a [T], dims: [usize; 4]) -> Result<Self> {
        let [_, h, q, k] = dims;
        let strides = [
            h.saturating_mul(q).saturating_mul(k),
            q.saturating_mul(k),
            k,
            1,
        ];
        Self::new(data, dims, strides)
    }

    /// `[batch, heads, n_q, n_k]`; an axis of 1 broadcasts.
    ///
    /// ```
    /// use attn_core::Mask4Ref;
    /// let bits = [true; 6];
    /// let m = Mask4Ref::new(&bits, [4, 1, 2, 3], [0, 0, 3, 1])?; // shared by 4 entries
    /// assert_eq!((m.dims(), m.strides()), ([4, 1, 2, 3], [0, 0, 3, 1]));
    /// assert!(m.broadcasts_to([4, 8, 2, 3]) && !m.broadcasts_to([4, 8, 2, 4]));
    /// assert!(!m.varies_over_heads());
    /// # Ok::<(), attn_core::Error>(())
    /// ```
    pub fn dims(&self) -> [usize; 4] {
        self.dims
    }

    /// Element strides of (batch, head, query, key).
    pub fn strides(&self) -> [usize; 4] {
        self.strides
    }

    /// Whether the mask takes these dims `[batch, heads, n_q, n_k]`: each axis equal or 1.
    pub fn broadcasts_to(&self, dims: [usize; 4]) -> bool {
        self.dims.iter().zip(dims).all(|(&m, d)| m == d || m == 1)
    }

    /// The dims of the values the mask holds: its dims, with 1 along each axis it
    /// broadcasts on (length 1 or stride 0) — what the gradient of an additive mask is
    /// shaped like (the sum over the axes it broadcasts on).
    ///
    /// ```
    /// use attn_core::Mask4Ref;
    /// let bias = vec![0.0f32; 4 * 3 * 5];
    /// // One [3, 5] bias per head, shared by 2 batch entries through a stride of 0.
    /// let m = Mask4Ref::new(&bias, [2, 4, 3, 5], [0, 15, 5, 1])?;
    /// assert_eq!(m.own_dims(), [1, 4, 3, 5]);
    /// # Ok::<(), attn_core::Error>(())
    /// ```
    pub fn own_dims(&self) -> [usize; 4] {
        let mut dims = self.dims;
        for (d, &s) in dims.iter_mut().zip(&self.strides) {
            if effective(*d, s) == 0 {
                *d = 1;
            }
        }
        dims
    }

    /// Whether two query heads of one batch entry may see different masks.
    pub fn varies_over_heads(&self) -> bool {
        effective(self.dims[1], self.strides[1]) != 0
    }

    /// The `[n_q, n_k]` mask of batch entry `batch` and query head `head`, broadcast
    /// along the axes of length 1; [`Error::OutOfRange`] or [`Error::Layout`] when the
    /// view does not cover them.
    pub fn head(&self, batch: usize, head: usize, n_q: usize, n_k: usize) -> Result<MatRef<'a, T>> {
        let index = |what, i: usize, len: usize| match len {
            1 => Ok(0),
            _ if i < len => Ok(i),
            _ => Err(Error::out_of_range(what, i, len)),
        };
        let (b, h) = (
            index("mask batch", batch, self.dims[0])?,
            index("mask head", head, self.dims[1])?,
        );
        if !self.broadcasts_to([self.dims[0], self.dims[1], n_q, n_k]) {
            return Err(Error::layout(
                "4-D mask",
                format!(
                    "dims {:?} do not broadcast to a head of {n_q}×{n_k} (n_q × n_k)",
                    self.dims
                ),
            ));
        }
        if n_q == 0 || n_k == 0 || self.dims.contains(&0) {
            return Ok(MatRef::from_row_major_slice(&self.data[..0], n_q, n_k));
        }
        let rs = effective(self.dims[2], self.strides[2]);
        let cs = effective(self.dims[3], self.strides[3]);
        // In range: the view fits its buffer (checked when it was made).
        let slice = &self.data[b * self.strides[0] + h * self.strides[1]..];
        Ok(if cs == 1 {
            MatRef::from_row_major_slice_with_stride(slice, n_q, n_k, rs)
        } else if rs == 1 {
            MatRef::from_column_major_slice_with_stride(slice, n_q, n_k, cs)
        } else if cs == 0 {
            let col = MatRef::from_row_major_slice_with_stride(slice, n_q, 1, rs).col(0);
            MatRef::from_repeated_col(col, n_k)
        } else {
            // rs == 0 here (the constructor rejects rs > 1 with cs > 1).
            let row = MatRef::from_column_major_slice_with_stride(slice, 1, n_k, cs).row(0);
            MatRef::from_repeated_row(row, n_q)
        })
    }
}

/// A boolean mask per batch entry and head (`[B, H, n_q, n_k]`, broadcast allowed), with
/// its polarity in its name as [`BoolMask`]'s.
///
/// ```
/// use attn_core::{BoolMask4, Mask4Ref};
/// // Head 0 sees key 0 only, head 1 key 1 only; shared by every batch entry and query.
/// let bits = [true, false, false, true];
/// let m = BoolMask4::allow(Mask4Ref::new(&bits, [1, 2, 1, 2], [0, 2, 0, 1])?);
/// let head1 = m.head(7, 1, 3, 2)?;
/// assert!(head1.allows(2, 1) && !head1.allows(2, 0));
/// # Ok::<(), attn_core::Error>(())
/// ```
#[derive(Debug, Clone, Copy)]
pub enum BoolMask4<'a> {
    /// `true` means the query may attend the key.
    Allow(Mask4Ref<'a, bool>),
    /// `true` means the key is masked out.
    Block(Mask4Ref<'a, bool>),
}

impl<'a> BoolMask4<'a> {
    /// A mask where `true` means "may attend" (PyTorch SDPA's `attn_mask`).
    pub fn allow(mask: Mask4Ref<'a, bool>) -> Self {
        BoolMask4::Allow(mask)
    }

    /// A mask where `true` means "masked out".
    pub fn block(mask: Mask4Ref<'a, bool>) -> Self {
        BoolMask4::Block(mask)
    }

    /// The underlying view, whatever its polarity.
    ///
    /// ```
    /// use attn_core::{BoolMask4, Mask4Ref};
    /// let bits = [true, false];
    /// let m = BoolMask4::block(Mask4Ref::contiguous(&bits, [1, 1, 1, 2])?);
    /// assert_eq!(m.view().dims(), [1, 1, 1, 2]);
    /// assert!(!m.head(0, 0, 1, 2)?.allows(0, 0)); // block: true hides the key
    /// # Ok::<(), attn_core::Error>(())
    /// ```
    pub fn view(&self) -> Mask4Ref<'a, bool> {
        match *self {
            BoolMask4::Allow(m) | BoolMask4::Block(m) => m,
        }
    }

    /// The `[n_q, n_k]` mask of one (batch, head), with the same polarity
    /// ([`Mask4Ref::head`]).
    pub fn head(&self, batch: usize, head: usize, n_q: usize, n_k: usize) -> Result<BoolMask<'a>> {
        Ok(match *self {
            BoolMask4::Allow(m) => BoolMask::Allow(m.head(batch, head, n_q, n_k)?),
            BoolMask4::Block(m) => BoolMask::Block(m.head(batch, head, n_q, n_k)?),
        })
    }
}

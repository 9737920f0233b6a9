//! Strided 4-D views over `[batch, heads, seq, dim]` data.
//!
//! The feature axis must be contiguous; batch, head and sequence strides are free, so
//! PyTorch's `[B,H,S,D]` and FlashAttention's `[B,S,H,D]` layouts (and slices of a packed
//! QKV buffer) are viewed without a copy. Each (batch, head) is a faer matrix view with a
//! row stride.

use faer::{MatMut, MatRef};

use crate::{Error, Result};

/// The memory order of a contiguous 4-D buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Layout {
    /// `[batch, heads, seq, dim]`, PyTorch's default for attention.
    Bhsd,
    /// `[batch, seq, heads, dim]`, FlashAttention's and most checkpoints' layout.
    Bshd,
}

impl Layout {
    /// Element strides of (batch, head, seq) for logical dims `[b, h, s, d]`.
    ///
    /// A stride whose product overflows saturates to `usize::MAX`; a view of such dims
    /// reaches past any buffer, so the views' constructors reject it
    /// ([`Error::Layout`]).
    ///
    /// ```
    /// use attn_core::{Layout, Tensor4Ref};
    /// assert_eq!(Layout::Bshd.strides([2, 3, 4, 5]), [60, 5, 15]);
    /// let dims = [2, 1 << 32, 1 << 32, 1 << 32];
    /// assert_eq!(Layout::Bhsd.strides(dims), [usize::MAX, usize::MAX, 1 << 32]);
    /// assert!(Tensor4Ref::<f32>::from_layout(&[], dims, Layout::Bhsd).is_err());
    /// ```
    pub fn strides(self, [_, h, s, d]: [usize; 4]) -> [usize; 3] {
        match self {
            Layout::Bhsd => [
                h.saturating_mul(s).saturating_mul(d),
                s.saturating_mul(d),
                d,
            ],
            Layout::Bshd => [
                s.saturating_mul(h).saturating_mul(d),
                d,
                h.saturating_mul(d),
            ],
        }
    }
}

/// `b·h·s·d`, or `None` when it overflows; 0 whenever a dim is 0.
fn element_count(dims: [usize; 4]) -> Option<usize> {
    if dims.contains(&0) {
        return Some(0);
    }
    dims.iter().try_fold(1usize, |n, &d| n.checked_mul(d))
}

fn required_len(dims: [usize; 4], strides: [usize; 3]) -> Option<usize> {
    if dims.contains(&0) {
        return Some(0);
    }
    let mut last = dims[3] - 1;
    for axis in 0..3 {
        last = last.checked_add((dims[axis] - 1).checked_mul(strides[axis])?)?;
    }
    last.checked_add(1)
}

fn check_fits(
    operand: &'static str,
    len: usize,
    dims: [usize; 4],
    strides: [usize; 3],
) -> Result<()> {
    match required_len(dims, strides) {
        Some(need) if need <= len => Ok(()),
        Some(need) => Err(Error::layout(
            operand,
            format!(
                "dims {dims:?} with strides {strides:?} need {need} elements but the buffer has {len}"
            ),
        )),
        None => Err(Error::layout(
            operand,
            format!("dims {dims:?} with strides {strides:?} overflow usize"),
        )),
    }
}

/// A writable view must not reach one element twice: sorted by stride, each axis must
/// step past everything the faster axes span.
fn check_no_overlap(operand: &'static str, dims: [usize; 4], strides: [usize; 3]) -> Result<()> {
    if dims.contains(&0) {
        return Ok(());
    }
    let mut axes: Vec<(usize, usize)> = (0..3)
        .map(|a| (strides[a], dims[a]))
        .filter(|&(_, n)| n > 1)
        .collect();
    axes.sort_unstable();
    let mut span = dims[3];
    for (stride, n) in axes {
        if stride < span {
            return Err(Error::layout(
                operand,
                format!(
                    "strides {strides:?} make a writable view with dims {dims:?} overlap itself"
                ),
            ));
        }
        span += stride * (n - 1);
    }
    Ok(())
}

/// A read-only strided view of a `[batch, heads, seq, dim]` tensor.
///
/// ```
/// use attn_core::{Layout, Tensor4Ref};
/// // Two heads of three positions of width 2, stored [B,S,H,D].
/// let data: Vec<f32> = (0..12).map(|x| x as f32).collect();
/// let t = Tensor4Ref::from_layout(&data, [1, 2, 3, 2], Layout::Bshd).unwrap();
/// let head1 = t.head(0, 1).unwrap();
/// assert_eq!(head1[(1, 0)], 6.0); // position 1, head 1: offset 1·4 + 1·2
/// ```
#[derive(Debug)]
pub struct Tensor4Ref<'a, T> {
    data: &'a [T],
    dims: [usize; 4],
    strides: [usize; 3],
}

// A view is a borrow: copyable whatever `T` is (a derive would ask for `T: Copy`).
impl<T> Clone for Tensor4Ref<'_, T> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<T> Copy for Tensor4Ref<'_, T> {}

impl<'a, T> Tensor4Ref<'a, T> {
    /// A view with explicit element strides for (batch, head, seq); the feature axis is
    /// contiguous. Strides may be 0 (broadcast).
    pub fn new(data: &'a [T], dims: [usize; 4], strides: [usize; 3]) -> Result<Self> {
        check_fits("tensor", data.len(), dims, strides)?;
        Ok(Self {
            data,
            dims,
            strides,
        })
    }

    /// A view of a contiguous buffer in the given layout.
    pub fn from_layout(data: &'a [T], dims: [usize; 4], layout: Layout) -> Result<Self> {
        Self::new(data, dims, layout.strides(dims))
    }

    /// `[batch, heads, seq, dim]`.
    pub fn dims(&self) -> [usize; 4] {
        self.dims
    }

    /// Element strides of batch, head and seq.
    pub fn strides(&self) -> [usize; 3] {
        self.strides
    }

    /// The buffer the view reads (what its dims and strides address, and whatever else
    /// the caller's buffer holds).
    pub fn buffer(&self) -> &'a [T] {
        self.data
    }

    /// The `[seq, dim]` matrix of one (batch, head).
    pub fn head(&self, batch: usize, head: usize) -> Result<MatRef<'a, T>> {
        check_index("batch", batch, self.dims[0])?;
        check_index("head", head, self.dims[1])?;
        let [_, _, s, d] = self.dims;
        if s == 0 || d == 0 {
            return Ok(MatRef::from_row_major_slice_with_stride(
                &self.data[..0],
                s,
                d,
                self.strides[2],
            ));
        }
        // Every dim is positive, so the view's fit check bounds this offset.
        let offset = batch * self.strides[0] + head * self.strides[1];
        Ok(MatRef::from_row_major_slice_with_stride(
            &self.data[offset..],
            s,
            d,
            self.strides[2],
        ))
    }

    /// The `[heads, dim]` matrix of one position across a range of heads (one token's query
    /// heads, say): row `i` is head `heads.start + i`, rows `strides()[1]` apart.
    ///
    /// ```
    /// use attn_core::{Layout, Tensor4Ref};
    /// let data: Vec<f32> = (0..12).map(|x| x as f32).collect();
    /// // [B=1, H=3, S=2, D=2] in [B,H,S,D]: head h, position s starts at 4h + 2s.
    /// let t = Tensor4Ref::from_layout(&data, [1, 3, 2, 2], Layout::Bhsd).unwrap();
    /// let token1 = t.heads_at(0, 1..3, 1).unwrap();
    /// assert_eq!((token1.nrows(), token1[(0, 0)], token1[(1, 1)]), (2, 6.0, 11.0));
    /// ```
    pub fn heads_at(
        &self,
        batch: usize,
        heads: core::ops::Range<usize>,
        position: usize,
    ) -> Result<MatRef<'a, T>> {
        check_index("batch", batch, self.dims[0])?;
        check_index("position", position, self.dims[2])?;
        if heads.start > heads.end || heads.end > self.dims[1] {
            return Err(Error::out_of_range(
                "head range end",
                heads.end.max(heads.start),
                self.dims[1].saturating_add(1),
            ));
        }
        let d = self.dims[3];
        if heads.is_empty() || d == 0 {
            return Ok(MatRef::from_row_major_slice(
                &self.data[..0],
                heads.len(),
                d,
            ));
        }
        let offset =
            batch * self.strides[0] + heads.start * self.strides[1] + position * self.strides[2];
        Ok(MatRef::from_row_major_slice_with_stride(
            &self.data[offset..],
            heads.len(),
            d,
            self.strides[1],
        ))
    }
}

/// A writable strided view of a `[batch, heads, seq, dim]` tensor.
#[derive(Debug)]
pub struct Tensor4Mut<'a, T> {
    data: &'a mut [T],
    dims: [usize; 4],
    strides: [usize; 3],
}

impl<'a, T> Tensor4Mut<'a, T> {
    /// A writable view with explicit strides; it must fit its buffer and not overlap.
    ///
    /// ```
    /// use attn_core::Tensor4Mut;
    /// let mut data = vec![0.0f32; 8];
    /// // Heads and positions on top of each other: rejected.
    /// assert!(Tensor4Mut::new(&mut data, [1, 2, 2, 2], [8, 2, 1]).is_err());
    /// ```
    pub fn new(data: &'a mut [T], dims: [usize; 4], strides: [usize; 3]) -> Result<Self> {
        check_fits("output tensor", data.len(), dims, strides)?;
        check_no_overlap("output tensor", dims, strides)?;
        Ok(Self {
            data,
            dims,
            strides,
        })
    }

    /// A writable view of a contiguous buffer in the given layout.
    pub fn from_layout(data: &'a mut [T], dims: [usize; 4], layout: Layout) -> Result<Self> {
        Self::new(data, dims, layout.strides(dims))
    }

    /// `[batch, heads, seq, dim]`.
    pub fn dims(&self) -> [usize; 4] {
        self.dims
    }

    /// A read-only view of the same data (to read back what was written).
    ///
    /// ```
    /// use attn_core::{Layout, Tensor4Mut};
    /// let mut data = vec![0.0f32; 4];
    /// let mut t = Tensor4Mut::from_layout(&mut data, [1, 1, 2, 2], Layout::Bhsd).unwrap();
    /// t.head_mut(0, 0).unwrap()[(1, 0)] = 3.0;
    /// assert_eq!(t.rb().head(0, 0).unwrap()[(1, 0)], 3.0);
    /// ```
    pub fn rb(&self) -> Tensor4Ref<'_, T> {
        Tensor4Ref {
            data: self.data,
            dims: self.dims,
            strides: self.strides,
        }
    }

    /// The writable `[seq, dim]` matrix of one (batch, head).
    pub fn head_mut(&mut self, batch: usize, head: usize) -> Result<MatMut<'_, T>> {
        check_index("batch", batch, self.dims[0])?;
        check_index("head", head, self.dims[1])?;
        let [_, _, s, d] = self.dims;
        let data = if s == 0 || d == 0 {
            &mut self.data[..0]
        } else {
            // Every dim is positive, so the view's fit check bounds this offset.
            &mut self.data[batch * self.strides[0] + head * self.strides[1]..]
        };
        // faer 0.24's `from_row_major_slice_with_stride_mut` builds a column-major view, so
        // build the transpose column-major and flip it.
        Ok(
            MatMut::from_column_major_slice_with_stride_mut(data, d, s, self.strides[2].max(d))
                .transpose_mut(),
        )
    }
}

impl<'a, T> Tensor4Mut<'a, T> {
    /// Every row of every head as its own slice of `dim` elements, in (batch, head, seq)
    /// order: disjoint borrows of the view, so that the heads can be written in parallel
    /// whatever the layout (in `[B,S,H,D]` the heads' rows interleave in memory).
    ///
    /// ```
    /// use attn_core::{Layout, Tensor4Mut};
    /// let mut data = vec![0.0f32; 2 * 3 * 2]; // [B=1, S=3, H=2, D=2]
    /// let t = Tensor4Mut::from_layout(&mut data, [1, 2, 3, 2], Layout::Bshd).unwrap();
    /// let mut rows = t.into_rows()?;
    /// assert_eq!(rows.len(), 6);
    /// rows[1][0] = 7.0; // head 0, position 1
    /// rows[3][1] = 9.0; // head 1, position 0
    /// assert_eq!(data, [0.0, 0.0, 0.0, 9.0, 7.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]);
    /// # Ok::<(), attn_core::Error>(())
    /// ```
    ///
    /// A view of empty rows (`dim = 0`) may have more rows than any buffer could list:
    /// then [`Error::Allocation`], never an abort.
    pub fn into_rows(self) -> Result<Vec<&'a mut [T]>> {
        let [b, h, s, d] = self.dims;
        let [sb, sh, ss] = self.strides;
        let n = element_count([b, h, s, 1]);
        let list = |what| Error::allocation_of::<&mut [T]>(what, n);
        let n = n.ok_or_else(|| list("tensor rows"))?;
        let mut rows: Vec<Option<&'a mut [T]>> = Vec::new();
        rows.try_reserve_exact(n).map_err(|_| list("tensor rows"))?;
        rows.resize_with(n, || None);
        // Each row's offset, in row order (nested loops: no division per row).
        let mut offsets: Vec<usize> = Vec::new();
        // (No row at all, however many batch entries and heads: nothing to walk.)
        if d > 0 && n > 0 {
            offsets
                .try_reserve_exact(n)
                .map_err(|_| list("tensor row offsets"))?;
            for bi in 0..b {
                for hi in 0..h {
                    offsets.extend((0..s).map(|si| bi * sb + hi * sh + si * ss));
                }
            }
        }
        let sorted = offsets.windows(2).all(|w| w[0] < w[1]);
        let mut order: Vec<usize> = Vec::new();
        if !sorted {
            order
                .try_reserve_exact(n)
                .map_err(|_| list("tensor row order"))?;
            order.extend(0..n);
            order.sort_unstable_by_key(|&r| offsets[r]);
        }
        let by_address = (0..offsets.len()).map(|k| if sorted { k } else { order[k] });
        // Rows never overlap (checked when the view was made), so in address order each
        // starts at or after the end of the previous one.
        let (mut rest, mut at) = (self.data, 0);
        for r in by_address {
            let offset = offsets[r];
            let Some((_, tail)) = rest.split_at_mut_checked(offset - at) else {
                break;
            };
            let Some((row, tail)) = tail.split_at_mut_checked(d) else {
                break;
            };
            rows[r] = Some(row);
            at = offset + d;
            rest = tail;
        }
        // In place: `Option<&mut [T]>` and `&mut [T]` have the same layout, no new buffer.
        Ok(rows.into_iter().map(Option::unwrap_or_default).collect())
    }
}

/// An owned `[batch, heads, seq, dim]` tensor, stored in the `[B,H,S,D]` layout.
///
/// ```
/// use attn_core::Tensor4;
/// let mut t = Tensor4::<f32>::zeros([1, 2, 3, 4]);
/// t.as_mut().head_mut(0, 1).unwrap()[(2, 3)] = 1.0;
/// assert_eq!(t.as_ref().head(0, 1).unwrap()[(2, 3)], 1.0);
/// ```
#[derive(Debug, Clone, PartialEq)]
pub struct Tensor4<T> {
    data: Vec<T>,
    dims: [usize; 4],
}

impl<T: Clone + Default> Tensor4<T> {
    /// A tensor of default values (zeros for numbers).
    ///
    /// # Panics
    ///
    /// When the tensor cannot be allocated (see [`Tensor4::try_zeros`], which returns the
    /// error instead): for sizes a caller chooses, use `try_zeros`.
    #[track_caller]
    pub fn zeros(dims: [usize; 4]) -> Self {
        Self::try_zeros(dims).unwrap_or_else(|e| panic!("Tensor4::zeros({dims:?}): {e}"))
    }

    /// A tensor of default values, or [`Error::Allocation`] when its size overflows or the
    /// allocator refuses it (never an abort).
    ///
    /// ```
    /// use attn_core::{Error, Tensor4};
    /// assert_eq!(Tensor4::<f32>::try_zeros([2, 1, 3, 4])?.as_slice().len(), 24);
    /// assert!(matches!(
    ///     Tensor4::<f32>::try_zeros([1 << 20, 1 << 20, 1 << 20, 1 << 20]),
    ///     Err(Error::Allocation { what: "tensor", bytes: usize::MAX })
    /// ));
    /// # Ok::<(), Error>(())
    /// ```
    pub fn try_zeros(dims: [usize; 4]) -> Result<Self> {
        let n = element_count(dims);
        let fail = || Error::allocation_of::<T>("tensor", n);
        let n = n.ok_or_else(fail)?;
        let mut data = Vec::new();
        data.try_reserve_exact(n).map_err(|_| fail())?;
        data.resize(n, T::default());
        Ok(Self { data, dims })
    }
}

impl<T> Tensor4<T> {
    /// Wraps a `[B,H,S,D]`-ordered buffer of exactly `b·h·s·d` elements; dims whose
    /// product overflows `usize` are an [`Error::Layout`].
    ///
    /// ```
    /// use attn_core::Tensor4;
    /// assert!(Tensor4::from_vec(vec![0.0f32; 6], [1, 2, 3, 1]).is_ok());
    /// assert!(Tensor4::from_vec(vec![0.0f32; 6], [1, 2, 3, 2]).is_err());
    /// assert!(Tensor4::from_vec(Vec::<f32>::new(), [1 << 32, 1 << 32, 1, 1]).is_err());
    /// ```
    pub fn from_vec(data: Vec<T>, dims: [usize; 4]) -> Result<Self> {
        let Some(need) = element_count(dims) else {
            return Err(Error::layout(
                "tensor",
                format!("dims {dims:?} overflow usize"),
            ));
        };
        if data.len() != need {
            return Err(Error::layout(
                "tensor",
                format!(
                    "dims {dims:?} need {need} elements but the buffer has {}",
                    data.len()
                ),
            ));
        }
        Ok(Self { data, dims })
    }

    /// `[batch, heads, seq, dim]`.
    pub fn dims(&self) -> [usize; 4] {
        self.dims
    }

    /// The buffer, in `[B,H,S,D]` order.
    pub fn as_slice(&self) -> &[T] {
        &self.data
    }

    /// The buffer, in `[B,H,S,D]` order.
    pub fn into_vec(self) -> Vec<T> {
        self.data
    }

    /// A read-only view.
    pub fn as_ref(&self) -> Tensor4Ref<'_, T> {
        Tensor4Ref {
            data: &self.data,
            dims: self.dims,
            strides: Layout::Bhsd.strides(self.dims),
        }
    }

    /// A writable view.
    pub fn as_mut(&mut self) -> Tensor4Mut<'_, T> {
        let strides = Layout::Bhsd.strides(self.dims);
        Tensor4Mut {
            data: &mut self.data,
            dims: self.dims,
            strides,
        }
    }
}

fn check_index(what: &'static str, index: usize, len: usize) -> Result<()> {
    if index < len {
        Ok(())
    } else {
        Err(Error::out_of_range(what, index, len))
    }
}

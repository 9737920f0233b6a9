//! Packed batches of sequences of different lengths (FlashAttention's "varlen"): every
//! sequence's rows one after the other in one `[1, heads, total, dim]` view, and the
//! cumulative offsets `cu_seqlens` that say where each sequence starts.
//!
//! Sequence `s` has queries `cu_q[s] .. cu_q[s + 1]` and keys `cu_k[s] .. cu_k[s + 1]`
//! and attends only within itself: causal alignment and windows apply per sequence, as
//! if each were its own call. Element-wise masks and key padding have no meaning for a
//! packed batch and are rejected.

use core::ops::Range;

use crate::{BatchShape, Error, Options, Result, Tensor4Ref};

/// The validated cumulative offsets of a packed batch: `batch + 1` offsets each for the
/// queries and the keys, starting at 0, never decreasing.
///
/// ```
/// use attn_core::CuSeqlens;
/// // Three sequences of 2, 0 and 3 queries, with 4, 1 and 3 keys.
/// let seqs = CuSeqlens::new(&[0, 2, 2, 5], &[0, 4, 5, 8])?;
/// assert_eq!((seqs.batch(), seqs.total_q(), seqs.total_k()), (3, 5, 8));
/// assert_eq!((seqs.queries(2), seqs.keys(2)), (2..5, 5..8));
/// assert!(CuSeqlens::new(&[0, 3, 2], &[0, 1, 2]).is_err()); // decreasing
/// assert!(CuSeqlens::new(&[1, 3], &[0, 1]).is_err()); // does not start at 0
/// assert!(CuSeqlens::new(&[0, 3], &[0, 1, 2]).is_err()); // different batch sizes
/// # Ok::<(), attn_core::Error>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CuSeqlens<'a> {
    q: &'a [usize],
    k: &'a [usize],
}

pub(crate) fn check_offsets(operand: &'static str, cu: &[usize]) -> Result<()> {
    match cu.first() {
        None => Err(Error::layout(
            operand,
            "is empty: it needs batch + 1 offsets, starting at 0",
        )),
        Some(&first) if first != 0 => Err(Error::layout(
            operand,
            format!("starts at {first} but must start at 0"),
        )),
        Some(_) => match cu.windows(2).position(|w| w[1] < w[0]) {
            Some(i) => Err(Error::layout(
                operand,
                format!(
                    "decreases from {} to {} at entry {} (offsets must not decrease)",
                    cu[i],
                    cu[i + 1],
                    i + 1
                ),
            )),
            None => Ok(()),
        },
    }
}

impl<'a> CuSeqlens<'a> {
    /// Checks the offsets of the queries (`cu_seqlens_q`) and the keys (`cu_seqlens_k`):
    /// the same length `batch + 1 ≥ 1`, each starting at 0 and non-decreasing.
    pub fn new(cu_seqlens_q: &'a [usize], cu_seqlens_k: &'a [usize]) -> Result<Self> {
        check_offsets("cu_seqlens_q", cu_seqlens_q)?;
        check_offsets("cu_seqlens_k", cu_seqlens_k)?;
        crate::check_dim(
            "cu_seqlens_k",
            "entries",
            cu_seqlens_k.len(),
            "cu_seqlens_q",
            cu_seqlens_q.len(),
            "one offset per sequence boundary, batch + 1",
        )?;
        Ok(Self {
            q: cu_seqlens_q,
            k: cu_seqlens_k,
        })
    }

    /// Sequences in the batch.
    pub fn batch(&self) -> usize {
        self.q.len() - 1
    }

    /// Packed query rows (the last query offset).
    pub fn total_q(&self) -> usize {
        self.q[self.q.len() - 1]
    }

    /// Packed key rows (the last key offset).
    pub fn total_k(&self) -> usize {
        self.k[self.k.len() - 1]
    }

    /// The packed query rows of sequence `s < batch`.
    pub fn queries(&self, s: usize) -> Range<usize> {
        self.q[s]..self.q[s + 1]
    }

    /// The packed key rows of sequence `s < batch`.
    pub fn keys(&self, s: usize) -> Range<usize> {
        self.k[s]..self.k[s + 1]
    }

    /// The most queries of any sequence.
    ///
    /// ```
    /// use attn_core::CuSeqlens;
    /// let seqs = CuSeqlens::new(&[0, 2, 9], &[0, 5, 6])?;
    /// assert_eq!((seqs.max_q(), seqs.max_k()), (7, 5));
    /// # Ok::<(), attn_core::Error>(())
    /// ```
    pub fn max_q(&self) -> usize {
        (0..self.batch())
            .map(|s| self.queries(s).len())
            .max()
            .unwrap_or(0)
    }

    /// The most keys of any sequence.
    pub fn max_k(&self) -> usize {
        (0..self.batch())
            .map(|s| self.keys(s).len())
            .max()
            .unwrap_or(0)
    }
}

/// Checks a packed call: Q `[1, h_q, total_q, d_k]`, K and V `[1, h_kv, total_k, d]`
/// (any strides; FlashAttention's `[total, heads, dim]` is the `[B,S,H,D]` layout with
/// batch 1), the offsets against the totals, and the options (no element-wise mask, no
/// key padding). Returns the shape (`n_q = total_q`, `n_k = total_k`) and the scale.
///
/// ```
/// use attn_core::{validate_packed, CuSeqlens, Layout, Options, Tensor4Ref};
/// let q = vec![0.0f32; 5 * 2 * 8]; // 5 packed tokens, 2 heads, d = 8
/// let q = Tensor4Ref::from_layout(&q, [1, 2, 5, 8], Layout::Bshd)?;
/// let seqs = CuSeqlens::new(&[0, 2, 5], &[0, 2, 5])?;
/// let (shape, _) = validate_packed(q, q, q, &seqs, &Options::default())?;
/// assert_eq!(shape.head.n_q, 5);
/// let short = CuSeqlens::new(&[0, 2, 4], &[0, 2, 5])?;
/// let err = validate_packed(q, q, q, &short, &Options::default()).unwrap_err();
/// assert_eq!(err.to_string(), "cu_seqlens_q: ends at 4 but Q has 5 packed rows (the last offset must be the total)");
/// # Ok::<(), attn_core::Error>(())
/// ```
pub fn validate_packed<T>(
    q: Tensor4Ref<'_, T>,
    k: Tensor4Ref<'_, T>,
    v: Tensor4Ref<'_, T>,
    seqs: &CuSeqlens<'_>,
    options: &Options<'_>,
) -> Result<(BatchShape, f32)> {
    let shape = BatchShape::of(q, k, v)?;
    if shape.batch != 1 {
        return Err(Error::layout(
            "Q",
            format!(
                "a packed batch is one [1, heads, total, dim] view, but its batch axis has {} entries",
                shape.batch
            ),
        ));
    }
    for (operand, last, what, total) in [
        ("cu_seqlens_q", seqs.total_q(), "Q", shape.head.n_q),
        ("cu_seqlens_k", seqs.total_k(), "K", shape.head.n_k),
    ] {
        if last != total {
            return Err(Error::layout(
                operand,
                format!(
                    "ends at {last} but {what} has {total} packed rows (the last offset must be the total)"
                ),
            ));
        }
    }
    if options.has_elementwise_mask() || options.key_padding.is_some() {
        return Err(Error::unsupported(
            "packed options",
            "element-wise masks and key padding have no meaning for packed sequences (each sequence attends within itself; causal alignment and windows apply per sequence)",
        ));
    }
    options.check_modifiers(seqs.batch(), shape.h_q)?;
    if let Some(d) = options.dropout {
        d.check_positions(shape.head.n_q, shape.head.n_k)?;
    }
    let scale = options.scale_for(shape.head.d_k)?;
    Ok((shape, scale))
}

/// [`validate_packed`] for the backward pass: also `grad_out` and `out`
/// `[1, h_q, total_q, d_v]` and `lse_len = h_q · total_q` LSE values (`[heads][total_q]`).
///
/// ```
/// use attn_core::{validate_packed_backward, CuSeqlens, Options, Tensor4};
/// let x = Tensor4::<f32>::zeros([1, 2, 5, 4]); // 2 heads, 5 packed tokens
/// let seqs = CuSeqlens::new(&[0, 1, 5], &[0, 1, 5])?;
/// let (x, opts) = (x.as_ref(), Options::default());
/// assert!(validate_packed_backward(x, x, x, x, x, 10, &seqs, &opts).is_ok());
/// let err = validate_packed_backward(x, x, x, x, x, 5, &seqs, &opts).unwrap_err();
/// assert_eq!(err.to_string(), "LSE has 5 entries but Q has 10 (one LSE per query row)");
/// # Ok::<(), attn_core::Error>(())
/// ```
#[allow(clippy::too_many_arguments)]
pub fn validate_packed_backward<T, G>(
    q: Tensor4Ref<'_, T>,
    k: Tensor4Ref<'_, T>,
    v: Tensor4Ref<'_, T>,
    grad_out: Tensor4Ref<'_, G>,
    out: Tensor4Ref<'_, G>,
    lse_len: usize,
    seqs: &CuSeqlens<'_>,
    options: &Options<'_>,
) -> Result<(BatchShape, f32)> {
    // The modifiers are checked per sequence (lengths, values) by `validate_packed`.
    let (shape, scale) = validate_packed(q, k, v, seqs, options)?;
    shape.check_backward(grad_out.dims(), out.dims(), lse_len)?;
    Ok((shape, scale))
}

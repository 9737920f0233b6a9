//! What a forward pass hands to its backward pass, in both engines' call values: the output
//! and the natural-log LSE of its rows, paired by type so that neither can be swapped for
//! the upstream gradient, and the caller's gradient views of an `_into` backward.

use faer::{ColRef, Mat, MatRef};

use crate::{Error, Result, Tensor4, Tensor4Ref};

/// The result of a forward pass: the output (`Mat<T>` for one head, `Tensor4<T>`
/// `[batch, h_q, n_q, d_v]` for many) and the natural-log LSE of each of its rows, in row
/// order (`[n_q]`, or `[batch][h_q][n_q]` flattened; `-inf` for a row that sees no key).
/// A backward pass takes it whole ([`Forward::as_view`]), so the output cannot be passed
/// where the upstream gradient belongs, nor an LSE of other rows.
///
/// ```
/// use attn_core::Forward;
/// use faer::Mat;
/// let fwd = Forward::head(Mat::<f32>::zeros(2, 3), vec![0.0, 1.0])?;
/// assert_eq!(fwd.lse(), [0.0, 1.0]);
/// assert!(Forward::head(Mat::<f32>::zeros(2, 3), vec![0.0]).is_err()); // one LSE per row
/// # Ok::<(), attn_core::Error>(())
/// ```
#[derive(Debug, Clone, PartialEq)]
pub struct Forward<O> {
    output: O,
    lse: Vec<f32>,
}

impl<T> Forward<Mat<T>> {
    /// One head's output `[n_q, d_v]` and its `n_q` LSE entries.
    pub fn head(output: Mat<T>, lse: Vec<f32>) -> Result<Self> {
        if lse.len() != output.nrows() {
            return Err(Error::lse_length(lse.len(), output.nrows()));
        }
        Ok(Self { output, lse })
    }

    /// Borrowed views of both, for a backward pass.
    pub fn as_view(&self) -> ForwardRef<MatRef<'_, T>, ColRef<'_, f32>> {
        ForwardRef::new(self.output.as_ref(), ColRef::from_slice(&self.lse))
    }
}

impl<T> Forward<Tensor4<T>> {
    /// A batched output `[batch, h_q, n_q, d_v]` and its `batch · h_q · n_q` LSE entries.
    pub fn batch(output: Tensor4<T>, lse: Vec<f32>) -> Result<Self> {
        let rows = lse_rows(output.dims());
        if rows != Some(lse.len()) {
            return Err(Error::lse_length(lse.len(), rows.unwrap_or(usize::MAX)));
        }
        Ok(Self { output, lse })
    }

    /// Borrowed views of both, for a backward pass: the LSE as a `[batch, h_q, n_q, 1]` view.
    pub fn as_view(&self) -> ForwardRef<Tensor4Ref<'_, T>, Tensor4Ref<'_, f32>> {
        let [b, h, n, _] = self.output.dims();
        let lse = Tensor4Ref::new(&self.lse, [b, h, n, 1], [h * n, n, 1]);
        ForwardRef::new(
            self.output.as_ref(),
            lse.expect("one LSE per output row, checked when built"),
        )
    }
}

impl<O> Forward<O> {
    /// The output.
    pub fn output(&self) -> &O {
        &self.output
    }

    /// The natural-log LSE of each output row, in row order.
    pub fn lse(&self) -> &[f32] {
        &self.lse
    }

    /// The output alone.
    pub fn into_output(self) -> O {
        self.output
    }

    /// The output and the LSE.
    pub fn into_parts(self) -> (O, Vec<f32>) {
        (self.output, self.lse)
    }
}

/// A forward pass's output and LSE as views, for a backward pass: what
/// [`Forward::as_view`] gives, or what a caller builds from the buffers an `_into` forward
/// wrote (an LSE of any stride: a [`ColRef`] for one head, a `[batch, h_q, n_q, 1]`
/// [`Tensor4Ref`] for many). The backward checks both against its call.
///
/// ```
/// use attn_core::ForwardRef;
/// use faer::Mat;
/// let out = Mat::<f32>::zeros(2, 4);
/// // Row 0 of a column-major matrix: an LSE whose entries are a column stride apart.
/// let lse = Mat::<f32>::from_fn(3, 2, |i, j| if i == 0 { [0.5, 0.25][j] } else { 9.0 });
/// let fwd = ForwardRef::new(out.as_ref(), lse.row(0).transpose());
/// assert_eq!(fwd.lse[1], 0.25);
/// ```
#[derive(Debug, Clone, Copy)]
pub struct ForwardRef<V, L> {
    /// The forward's output.
    pub output: V,
    /// The natural-log LSE of each output row.
    pub lse: L,
}

impl<V, L> ForwardRef<V, L> {
    /// The views of an output and its LSE.
    pub fn new(output: V, lse: L) -> Self {
        Self { output, lse }
    }
}

impl<'f, T> ForwardRef<MatRef<'f, T>, ColRef<'f, f32>> {
    /// One head's output and its LSE kept as a slice (what [`Forward::into_parts`]
    /// returns); the backward checks the LSE's length against its call.
    ///
    /// ```
    /// use attn_core::ForwardRef;
    /// use faer::Mat;
    /// let out = Mat::<f32>::zeros(2, 4);
    /// let lse = vec![0.5, 0.25];
    /// assert_eq!(ForwardRef::head(out.as_ref(), &lse).lse[1], 0.25);
    /// ```
    pub fn head(output: MatRef<'f, T>, lse: &'f [f32]) -> Self {
        Self::new(output, ColRef::from_slice(lse))
    }
}

impl<'f, T> ForwardRef<Tensor4Ref<'f, T>, Tensor4Ref<'f, f32>> {
    /// A batch's output `[batch, h_q, n_q, d_v]` and its LSE kept as a compact
    /// `[batch][h_q][n_q]` slice (what [`Forward::into_parts`] returns), viewed as the
    /// `[batch, h_q, n_q, 1]` tensor the backward reads. An LSE whose length is not
    /// `batch · h_q · n_q` is an error.
    ///
    /// ```
    /// use attn_core::{ForwardRef, Tensor4Ref};
    /// let out = vec![0.0f32; 2 * 3 * 4];
    /// let out = Tensor4Ref::new(&out, [1, 2, 3, 4], [24, 12, 4])?;
    /// let lse: Vec<f32> = (0..6).map(|i| i as f32).collect();
    /// let fwd = ForwardRef::batch(out, &lse)?;
    /// assert_eq!(fwd.lse.dims(), [1, 2, 3, 1]);
    /// assert!(ForwardRef::batch(out, &lse[1..]).is_err());
    /// # Ok::<(), attn_core::Error>(())
    /// ```
    pub fn batch(output: Tensor4Ref<'f, T>, lse: &'f [f32]) -> Result<Self> {
        let [b, h, n, _] = output.dims();
        let rows = lse_rows(output.dims());
        if rows != Some(lse.len()) {
            // Either may be the wrong one: the message names both.
            return Err(Error::mismatch(
                "LSE",
                "entries",
                lse.len(),
                "the output",
                rows.unwrap_or(usize::MAX),
                "one LSE per output row",
            ));
        }
        let lse = Tensor4Ref::new(lse, [b, h, n, 1], [h.saturating_mul(n), n, 1])?;
        Ok(Self::new(output, lse))
    }
}

/// The LSE rows of a `[batch, h_q, n_q, _]` output: none when any axis is empty, however
/// large the others; `None` when the product overflows.
fn lse_rows([b, h, n, _]: [usize; 4]) -> Option<usize> {
    if b == 0 || h == 0 || n == 0 {
        Some(0)
    } else {
        b.checked_mul(h).and_then(|x| x.checked_mul(n))
    }
}

impl<'f, T> From<&'f Forward<Mat<T>>> for ForwardRef<MatRef<'f, T>, ColRef<'f, f32>> {
    fn from(fwd: &'f Forward<Mat<T>>) -> Self {
        fwd.as_view()
    }
}

impl<'f, T> From<&'f Forward<Tensor4<T>>> for ForwardRef<Tensor4Ref<'f, T>, Tensor4Ref<'f, f32>> {
    fn from(fwd: &'f Forward<Tensor4<T>>) -> Self {
        fwd.as_view()
    }
}

/// The caller's views an `_into` backward pass writes: `dq`, `dk` and `dv`, each shaped
/// like its operand (`MatMut` for one head, `Tensor4Mut` for many).
///
/// ```
/// use attn_core::GradientsMut;
/// use faer::Mat;
/// let (mut dq, mut dk, mut dv) = (Mat::<f32>::zeros(2, 4), Mat::zeros(3, 4), Mat::zeros(3, 5));
/// let views = GradientsMut { dq: dq.as_mut(), dk: dk.as_mut(), dv: dv.as_mut() };
/// assert_eq!(views.dv.ncols(), 5);
/// ```
#[derive(Debug)]
pub struct GradientsMut<V> {
    /// `∂loss/∂Q`.
    pub dq: V,
    /// `∂loss/∂K`.
    pub dk: V,
    /// `∂loss/∂V`.
    pub dv: V,
}

/// The kind of operands of a call that holds one head: `q : [n_q, d_k]`, `k : [n_k, d_k]`,
/// `v : [n_k, d_v]` as faer views; the output is a `Mat`, the gradients [`Gradients`].
/// Both engines' `Attention` take it as their third type parameter (the default).
///
/// [`Gradients`]: crate::Gradients
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OneHead {}

/// The kind of operands of a call over many heads: `[batch, heads, seq, dim]` views (a
/// batch, a packed batch of sequences, a KV cache's entries); the output is a
/// `[batch, h_q, n_q, d_v]` [`Tensor4`], the gradients [`BatchGradients`].
///
/// [`BatchGradients`]: crate::BatchGradients
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Batch {}

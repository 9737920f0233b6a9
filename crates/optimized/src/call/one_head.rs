//! [`Attention`] over one head: faer views in, `Mat` out.

use core::ops::Range;

use attn_core::{
    Error, Forward, ForwardRef, Gradients, GradientsMut, Options, PartialState, Result, check_shape,
};
use faer::reborrow::ReborrowMut;
use faer::{ColMut, ColRef, Mat, MatMut, MatRef, Par};

use super::{Attention, OneHead};
use crate::backward::{Backward, BiasGradient};
use crate::forward;
use crate::kernel::element::Element;
use crate::problem::{HeadInputs, Problem, filled, zeroed_mat};

/// The validated operands of a one-head call.
#[derive(Debug)]
pub struct HeadOperands<'a, T> {
    problem: Problem,
    /// Q, K and V (as the key source the passes read) and the head's mask and modifiers.
    inputs: HeadInputs<'a, T>,
    /// A shard of a longer sequence's keys ([`Attention::keys_of`]): no backward pass.
    shard: bool,
}

impl<'a, T: Element> Attention<'a, T, OneHead> {
    /// One head: `q : [n_q, d_k]`, `k : [n_k, d_k]`, `v : [n_k, d_v]`, any strides.
    /// Fails on mismatched shapes and options ([`Error`]).
    ///
    /// ```
    /// use attn_optimized::{Attention, Options};
    /// use faer::Mat;
    /// let q = Mat::<f32>::zeros(2, 4);
    /// let k = Mat::<f32>::zeros(3, 5);
    /// let err = Attention::head(q.as_ref(), k.as_ref(), k.as_ref(), &Options::default()).unwrap_err();
    /// assert_eq!(err.to_string(), "K has 5 columns but Q has 4 (d_k must match)");
    /// ```
    pub fn head(
        q: MatRef<'a, T>,
        k: MatRef<'a, T>,
        v: MatRef<'a, T>,
        options: &Options<'a>,
    ) -> Result<Self> {
        let (problem, inputs) = Problem::head(q, k, v, options)?;
        let ops = HeadOperands {
            problem,
            inputs,
            shard: false,
        };
        Ok(Self::from_operands(ops, options))
    }

    /// One head over a shard of its keys: `k` and `v` hold keys `keys.start .. keys.end`
    /// of a problem with `n_k_total` keys, in which the options (causal alignment, masks
    /// `[n_q, n_k_total]`, padding) are expressed. Its [`partial_state`] merges with the
    /// other shards' into full attention ([`PartialState::merge`]); sink logits are refused
    /// (each shard would count them: merge [`PartialState::sink`] once instead).
    ///
    /// ```
    /// use attn_optimized::{Attention, Causal, Options, Par};
    /// use faer::Mat;
    /// let k = Mat::<f32>::from_fn(10, 4, |i, j| ((i * 3 + j) % 5) as f32 * 0.3);
    /// let opts = Options::default().with_causal(Causal::BottomRight);
    /// let q = k.subrows(6, 4);
    /// let shard = |keys: core::ops::Range<usize>| {
    ///     let (kk, vv) = (k.subrows(keys.start, keys.len()), k.subrows(keys.start, keys.len()));
    ///     Attention::keys_of(q, kk, vv, keys, 10, &opts)?.partial_state(Par::rayon(0))
    /// };
    /// let merged = shard(0..6)?.merge(&shard(6..10)?)?;
    /// let full = Attention::head(q, k.as_ref(), k.as_ref(), &opts)?.forward(Par::rayon(0))?;
    /// assert!((merged.output()[(0, 0)] - full.output()[(0, 0)]).abs() < 1e-6);
    /// # Ok::<(), attn_optimized::Error>(())
    /// ```
    ///
    /// [`partial_state`]: Attention::partial_state
    pub fn keys_of(
        q: MatRef<'a, T>,
        k: MatRef<'a, T>,
        v: MatRef<'a, T>,
        keys: Range<usize>,
        n_k_total: usize,
        options: &Options<'a>,
    ) -> Result<Self> {
        if options.sinks.is_some() {
            // Each shard would count the sink once: merged, it would count P times.
            return Err(Error::unsupported(
                "a key range's attention",
                "sink logits: compute the shards without them and merge PartialState::sink once",
            ));
        }
        let (problem, inputs) = Problem::shard(q, k, v, &keys, n_k_total, options)?;
        let ops = HeadOperands {
            problem,
            inputs,
            shard: true,
        };
        Ok(Self::from_operands(ops, options))
    }

    /// `softmax(scale·QKᵀ + M) V` (`[n_q, d_v]`, the element type of the operands) and the
    /// natural-log LSE of each row (`-inf` for a row that sees no key).
    ///
    /// ```
    /// use attn_optimized::{Attention, Options, Par};
    /// use faer::Mat;
    /// let q = Mat::<f32>::zeros(1, 4);
    /// let k = Mat::<f32>::zeros(3, 4); // three equal scores of 0: LSE = ln 3
    /// let fwd = Attention::head(q.as_ref(), k.as_ref(), k.as_ref(), &Options::default())?.forward(Par::Seq)?;
    /// assert!((fwd.lse()[0] - 3f32.ln()).abs() < 1e-6);
    /// # Ok::<(), attn_optimized::Error>(())
    /// ```
    pub fn forward(&self, par: Par) -> Result<Forward<Mat<T>>> {
        let HeadOperands {
            problem, inputs, ..
        } = &self.ops;
        let mut out = zeroed_mat("attention output", problem.rows, problem.d_v)?;
        let mut lse = filled("LSE", Some(problem.rows), f32::NEG_INFINITY)?;
        forward::head(
            problem,
            *inputs,
            out.as_mut(),
            Some(&mut lse),
            self.split,
            par,
        )?;
        Forward::head(out, lse)
    }

    /// [`forward`](Attention::forward) written into a caller's `out : [n_q, d_v]` of any
    /// strides and element type, and the LSE into `lse` (`n_q` entries, any stride) when
    /// given.
    ///
    /// ```
    /// use attn_optimized::{Attention, Options, Par};
    /// use faer::Mat;
    /// use half::bf16;
    /// let x = Mat::<bf16>::from_fn(4, 8, |i, j| bf16::from_f32((i + j) as f32 * 0.1));
    /// let mut out = Mat::<f32>::zeros(4, 8); // bf16 operands, an f32 result
    /// // The LSE into row 0 of a column-major matrix: entries a column stride apart.
    /// let mut lse = Mat::<f32>::zeros(2, 4);
    /// let strided = lse.as_mut().row_mut(0).transpose_mut();
    /// Attention::head(x.as_ref(), x.as_ref(), x.as_ref(), &Options::default())?
    ///     .forward_into(out.as_mut(), Some(strided), Par::rayon(0))?;
    /// assert!(lse.row(0).iter().all(|l| l.is_finite() && *l != 0.0));
    /// assert!(lse.row(1).iter().all(|&l| l == 0.0)); // untouched
    /// # Ok::<(), attn_optimized::Error>(())
    /// ```
    pub fn forward_into<O: Element>(
        &self,
        out: MatMut<'_, O>,
        lse: Option<ColMut<'_, f32>>,
        par: Par,
    ) -> Result<()> {
        let HeadOperands {
            problem, inputs, ..
        } = &self.ops;
        let n_q = problem.rows;
        check_shape(
            "output",
            out.nrows(),
            out.ncols(),
            n_q,
            problem.d_v,
            "n_q × d_v",
        )?;
        match lse {
            None => forward::head(problem, *inputs, out, None, self.split, par),
            Some(mut view) => {
                if view.nrows() != n_q {
                    return Err(Error::lse_length(view.nrows(), n_q));
                }
                // Written in place when the view is one contiguous run, else gathered.
                let contiguous = view.row_stride() == 1 || n_q <= 1;
                match view.rb_mut().try_as_col_major_mut().filter(|_| contiguous) {
                    Some(col) => {
                        let slice = col.as_slice_mut();
                        forward::head(problem, *inputs, out, Some(slice), self.split, par)
                    }
                    None => {
                        let mut rows = filled("LSE", Some(n_q), f32::NEG_INFINITY)?;
                        forward::head(problem, *inputs, out, Some(&mut rows), self.split, par)?;
                        for (i, &x) in rows.iter().enumerate() {
                            view[i] = x;
                        }
                        Ok(())
                    }
                }
            }
        }
    }

    /// The call's result as a [`PartialState`] (f32 output and LSE, no sink): over a
    /// shard's keys ([`Attention::keys_of`]) what merges with the other shards'.
    pub fn partial_state(&self, par: Par) -> Result<PartialState> {
        if self.options.sinks.is_some() {
            return Err(Error::unsupported(
                "a partial state",
                "sink logits: compute the shards without them and merge PartialState::sink once",
            ));
        }
        let HeadOperands {
            problem, inputs, ..
        } = &self.ops;
        let mut out = zeroed_mat::<f32>("partial attention output", problem.rows, problem.d_v)?;
        let mut lse = filled("LSE", Some(problem.rows), f32::NEG_INFINITY)?;
        forward::head(
            problem,
            *inputs,
            out.as_mut(),
            Some(&mut lse),
            self.split,
            par,
        )?;
        PartialState::new(out, lse)
    }

    /// The backward pass: the gradients of a loss with respect to Q, K and V, given what
    /// [`forward`](Attention::forward) returned (or the views an `_into` forward wrote,
    /// [`ForwardRef::new`]) and the upstream gradient `d_out` (dO, `[n_q, d_v]`).
    ///
    /// With `P = exp(scale·QKᵀ + M − LSE)` recomputed tile by tile (never stored) and
    /// `D_i = Σ_t dO_it · O_it`: `dV = Pᵀ dO`, `dS = P ∘ (dO Vᵀ − D)`, `dQ = scale · dS K`,
    /// `dK = scale · dSᵀ Q`. A hidden key contributes nothing to any gradient; a row that
    /// sees no key has `dQ = 0` and adds nothing to dK and dV. With score modifiers the
    /// scores are modified as the forward modifies them and `dS` is multiplied by their
    /// derivative (soft-cap `1 − tanh²`, a user modifier's
    /// [`ScoreMod::derivative`](attn_core::ScoreMod::derivative)); a sink logit's gradient
    /// `dσ = −Σ_i exp(σ − LSE_i)·D_i` is returned in [`Gradients::dsinks`]. Accumulation
    /// is in f32, each gradient rounded to `T` once; memory is `O((n_q + n_k)·d)`; the bits
    /// do not depend on the thread count. A shard's call ([`Attention::keys_of`]) has no
    /// backward pass of its own.
    ///
    /// ```
    /// use attn_optimized::{Attention, Causal, Options, Par};
    /// use faer::Mat;
    /// let (n, d) = (200, 16);
    /// let x = Mat::<f32>::from_fn(n, d, |i, j| ((i * 5 + j * 3) % 11) as f32 / 11.0);
    /// let call = Attention::head(x.as_ref(), x.as_ref(), x.as_ref(), &Options::default().with_causal(Causal::TopLeft))?;
    /// let fwd = call.forward(Par::rayon(0))?;
    /// let d_out = Mat::<f32>::from_fn(n, d, |i, j| if (i + j) % 7 == 0 { 1.0 } else { 0.0 });
    /// let g = call.backward(&fwd, d_out.as_ref(), Par::rayon(0))?;
    /// // The first query sees only the first key: its dQ is 0 (its softmax is constant 1) ...
    /// assert!(g.dq.row(0).iter().all(|&x| x == 0.0));
    /// // ... and the last key is seen only by the last query, so dV's last row is that row's dO
    /// // times its weight P = exp(scale·q·k − LSE), recomputed from the LSE.
    /// let dot: f32 = (0..d).map(|c| x[(n - 1, c)] * x[(n - 1, c)]).sum();
    /// let p = (dot / (d as f32).sqrt() - fwd.lse()[n - 1]).exp();
    /// assert!((0..d).all(|c| (g.dv[(n - 1, c)] - p * d_out[(n - 1, c)]).abs() < 1e-6));
    /// # Ok::<(), attn_optimized::Error>(())
    /// ```
    pub fn backward<'f>(
        &self,
        fwd: impl Into<ForwardRef<MatRef<'f, T>, ColRef<'f, f32>>>,
        d_out: MatRef<'_, T>,
        par: Par,
    ) -> Result<Gradients<T>> {
        let (n_q, n_k, d_k, d_v) = self.dims();
        let mut dq = zeroed_mat("dQ", n_q, d_k)?;
        let mut dk = zeroed_mat("dK", n_k, d_k)?;
        let mut dv = zeroed_mat("dV", n_k, d_v)?;
        let grads = GradientsMut {
            dq: dq.as_mut(),
            dk: dk.as_mut(),
            dv: dv.as_mut(),
        };
        let bias = self.bias_gradient.then_some(None);
        let (dsinks, dbias) = self.run_backward(fwd, d_out, grads, par, bias)?;
        let dbias = match dbias {
            Some(t) => Some(t.as_ref().head(0, 0)?.to_owned()),
            None => None,
        };
        Ok(Gradients::new(dq, dk, dv)
            .with_dsinks(dsinks)
            .with_dbias(dbias))
    }

    /// [`backward`](Attention::backward) written into caller views of any strides and any
    /// element type `G` (half-precision operands with f32 gradients, say):
    /// `dq : [n_q, d_k]`, `dk : [n_k, d_k]`, `dv : [n_k, d_v]`. Returns the gradient of the
    /// sink logit (`Some(vec![dσ])`) when the options carry one, `None` otherwise.
    ///
    /// ```
    /// use attn_optimized::{Attention, GradientsMut, Options, Par};
    /// use faer::Mat;
    /// use half::bf16;
    /// let x = Mat::<bf16>::from_fn(6, 8, |i, j| bf16::from_f32((i + j) as f32 * 0.125));
    /// let call = Attention::head(x.as_ref(), x.as_ref(), x.as_ref(), &Options::default())?;
    /// let fwd = call.forward(Par::rayon(0))?;
    /// let (mut dq, mut dk, mut dv) = (Mat::<f32>::zeros(6, 8), Mat::<f32>::zeros(6, 8), Mat::<f32>::zeros(6, 8));
    /// let grads = GradientsMut { dq: dq.as_mut(), dk: dk.as_mut(), dv: dv.as_mut() };
    /// call.backward_into(&fwd, fwd.output().as_ref(), grads, Par::rayon(0))?;
    /// assert!(dv.col_iter().all(|c| c.iter().all(|x| x.is_finite())));
    /// # Ok::<(), attn_optimized::Error>(())
    /// ```
    pub fn backward_into<'f, G: Element>(
        &self,
        fwd: impl Into<ForwardRef<MatRef<'f, T>, ColRef<'f, f32>>>,
        d_out: MatRef<'_, T>,
        grads: GradientsMut<MatMut<'_, G>>,
        par: Par,
    ) -> Result<Option<Vec<f32>>> {
        if self.bias_gradient {
            return Err(super::bias_gradient_owned());
        }
        Ok(self.run_backward(fwd, d_out, grads, par, None)?.0)
    }

    /// The backward pass into `grads`; with `bias`, the additive mask's gradient too —
    /// returned (`Some(None)`) or written into the caller's buffer (`Some(Some(out))`).
    fn run_backward<'f, G: Element>(
        &self,
        fwd: impl Into<ForwardRef<MatRef<'f, T>, ColRef<'f, f32>>>,
        d_out: MatRef<'_, T>,
        grads: GradientsMut<MatMut<'_, G>>,
        par: Par,
        bias: Option<Option<&mut [f32]>>,
    ) -> Result<super::Extras> {
        let HeadOperands { inputs, shard, .. } = &self.ops;
        if *shard {
            return Err(Error::unsupported(
                "the backward pass of a key range",
                "compute the backward pass of the whole head",
            ));
        }
        let fwd = fwd.into();
        let n = fwd.lse.nrows();
        let contiguous = fwd.lse.row_stride() == 1 || n <= 1;
        let lse = match fwd.lse.try_as_col_major().filter(|_| contiguous) {
            Some(col) => std::borrow::Cow::Borrowed(col.as_slice()),
            None => {
                let mut rows = filled("LSE", Some(n), 0.0f32)?;
                for (i, x) in rows.iter_mut().enumerate() {
                    *x = fwd.lse[i];
                }
                std::borrow::Cow::Owned(rows)
            }
        };
        let (q, k, v) = (inputs.q, inputs.k.0, inputs.v.0);
        let mut call = Backward::head(d_out, q, k, v, fwd.output, &lse, &self.options)?;
        let s = call.shape();
        if let Some(out) = bias {
            call = call.with_bias_gradient(&self.options, [1, 1, s.n_q, s.n_k], out)?;
        }
        let GradientsMut { dq, dk, dv } = grads;
        check_shape("dQ", dq.nrows(), dq.ncols(), s.n_q, s.d_k, "n_q × d_k")?;
        check_shape("dK", dk.nrows(), dk.ncols(), s.n_k, s.d_k, "n_k × d_k")?;
        check_shape("dV", dv.nrows(), dv.ncols(), s.n_k, s.d_v, "n_k × d_v")?;
        let mut dq = forward::row_list(dq.row_iter_mut())?;
        let mut dk = forward::row_list(dk.row_iter_mut())?;
        let mut dv = forward::row_list(dv.row_iter_mut())?;
        let dsinks = call.run(&mut dq, &mut dk, &mut dv, par)?;
        let dbias = call
            .into_bias_gradient()
            .and_then(BiasGradient::into_tensor);
        Ok((dsinks, dbias.transpose()?))
    }

    /// `(n_q, n_k, d_k, d_v)` of the call (`n_k` the shard's keys for a shard).
    pub fn dims(&self) -> (usize, usize, usize, usize) {
        let HeadInputs { q, k, v, .. } = &self.ops.inputs;
        (q.nrows(), k.0.nrows(), q.ncols(), v.0.ncols())
    }
}

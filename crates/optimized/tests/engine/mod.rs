//! The streaming engine as an [`attn_oracle::Engine`], for each storage type: what the
//! oracle's suite (`tests/conformance.rs`) and the layer test (`tests/multi_head_layer.rs`)
//! check.

use core::marker::PhantomData;
use core::ops::Range;

use attn_core::{CuSeqlens, Options, Result, Tensor4, Tensor4Ref, validate_head};
use attn_optimized::{
    Attention, Element, ForwardRef, GradientsMut, KEY_TILE, Par, PartialState, QUERY_TILE,
    SPLIT_KEYS, TilePlan,
};
use attn_oracle::{BatchGradients, Compute, Dtype, Engine, ErrorModel, Gradients, MergePlan};
use faer::{Mat, MatRef};

/// `attn-optimized` with storage type `T` (`f32`, `half::f16` or `half::bf16`): inputs
/// are converted to `T` (exactly: the oracle has already rounded them), outputs widened
/// back to f32.
#[derive(Debug, Clone, Copy, Default)]
pub struct OptimizedEngine<T = f32>(PhantomData<T>);

impl<T> OptimizedEngine<T> {
    /// The engine for storage type `T`.
    pub fn new() -> Self {
        OptimizedEngine(PhantomData)
    }
}

fn dtype<T: Element>() -> Dtype {
    match T::NAME {
        "f16" => Dtype::F16,
        "bf16" => Dtype::Bf16,
        _ => Dtype::F32,
    }
}

fn narrow<T: Element>(m: MatRef<'_, f32>) -> Mat<T> {
    Mat::from_fn(m.nrows(), m.ncols(), |i, j| T::from_f32(m[(i, j)]))
}

fn widen<T: Element>(m: MatRef<'_, T>) -> Mat<f32> {
    Mat::from_fn(m.nrows(), m.ncols(), |i, j| m[(i, j)].to_f32())
}

/// The same dims and strides as `t`, in `T`; elements outside the view are NaN.
fn narrow_tensor<T: Element>(t: Tensor4Ref<'_, f32>) -> Result<Vec<T>> {
    let (dims, s) = (t.dims(), t.strides());
    let [b, h, n, d] = dims;
    let len = if dims.contains(&0) {
        0
    } else {
        (b - 1) * s[0] + (h - 1) * s[1] + (n - 1) * s[2] + d
    };
    let mut data = vec![T::from_f32(f32::NAN); len];
    for bi in 0..b {
        for hi in 0..h {
            let m = t.head(bi, hi)?;
            for i in 0..n {
                for c in 0..d {
                    data[bi * s[0] + hi * s[1] + i * s[2] + c] = T::from_f32(m[(i, c)]);
                }
            }
        }
    }
    Ok(data)
}

impl<T: Element> Engine for OptimizedEngine<T> {
    fn name(&self) -> String {
        format!("optimized-{}", T::NAME)
    }

    fn storage(&self) -> Dtype {
        dtype::<T>()
    }

    fn error_model(&self) -> ErrorModel {
        ErrorModel {
            // Cephes' degree-6 exp2 polynomial: ≤ 2 ulp (attn_optimized::exp).
            compute: Compute::F32 {
                exp_ulps: 2.0,
                split_keys: Some(SPLIT_KEYS),
            },
            output: dtype::<T>(),
        }
    }

    fn tile_lengths(&self) -> Vec<usize> {
        // Row kernels up to 4 queries, 8-row and 16-key tile granularity, 64-key row
        // blocks, the query and key tiles, and the split-KV chunk.
        vec![4, 8, 16, 64, QUERY_TILE, KEY_TILE, SPLIT_KEYS]
    }

    // The built-in soft-cap is `SoftCap::apply_f32` on the same scores a user's ScoreMod sees.
    fn user_score_mod_bits_match_builtins(&self) -> bool {
        true
    }

    // Only GEMM tiles compute a causal block as a user's mask does: a row tile (at most 4
    // queries, `DECODE_ROWS`) trims the diagonal's key block at the last visible key.
    fn user_mask_mod_bits_match_structural(&self, n_q: usize, n_k: usize) -> bool {
        let br = TilePlan::for_shape(n_q, n_k).br;
        n_q == 0 || n_q - (n_q.div_ceil(br) - 1) * br > 4
    }

    fn attention_with_lse(
        &self,
        q: MatRef<'_, f32>,
        k: MatRef<'_, f32>,
        v: MatRef<'_, f32>,
        options: &Options<'_>,
    ) -> Result<(Mat<f32>, Vec<f32>)> {
        if T::NAME == "f32" {
            return Attention::head(q, k, v, options)
                .and_then(|call| call.forward(Par::rayon(0)))
                .map(|f| f.into_parts());
        }
        let (qt, kt, vt) = (narrow::<T>(q), narrow::<T>(k), narrow::<T>(v));
        let (o, lse) = Attention::head(qt.as_ref(), kt.as_ref(), vt.as_ref(), options)
            .and_then(|call| call.forward(Par::rayon(0)))
            .map(|f| f.into_parts())?;
        Ok((widen(o.as_ref()), lse))
    }

    fn attention_batched(
        &self,
        q: Tensor4Ref<'_, f32>,
        k: Tensor4Ref<'_, f32>,
        v: Tensor4Ref<'_, f32>,
        options: &Options<'_>,
    ) -> Result<Tensor4<f32>> {
        if T::NAME == "f32" {
            return Attention::batched(q, k, v, options)
                .and_then(|call| call.forward(Par::rayon(0)))
                .map(|f| f.into_output());
        }
        let (qd, kd, vd) = (
            narrow_tensor::<T>(q)?,
            narrow_tensor::<T>(k)?,
            narrow_tensor::<T>(v)?,
        );
        let o = Attention::batched(
            Tensor4Ref::new(&qd, q.dims(), q.strides())?,
            Tensor4Ref::new(&kd, k.dims(), k.strides())?,
            Tensor4Ref::new(&vd, v.dims(), v.strides())?,
            options,
        )
        .and_then(|call| call.forward(Par::rayon(0)))
        .map(|f| f.into_output())?;
        let dims = o.dims();
        Tensor4::from_vec(o.into_vec().into_iter().map(|x| x.to_f32()).collect(), dims)
    }

    fn attention_split(
        &self,
        q: MatRef<'_, f32>,
        k: MatRef<'_, f32>,
        v: MatRef<'_, f32>,
        options: &Options<'_>,
        plan: &MergePlan,
    ) -> Option<Result<(Mat<f32>, Vec<f32>)>> {
        let run = || -> Result<(Mat<f32>, Vec<f32>)> {
            let shape = validate_head(q, k, v, options)?;
            let (qt, kt, vt) = (narrow::<T>(q), narrow::<T>(k), narrow::<T>(v));
            let state = plan.fold(
                &mut |r: Range<usize>| {
                    Attention::keys_of(
                        qt.as_ref(),
                        kt.as_ref().subrows(r.start, r.len()),
                        vt.as_ref().subrows(r.start, r.len()),
                        r,
                        shape.n_k,
                        options,
                    )
                    .and_then(|call| call.partial_state(Par::rayon(0)))
                },
                &mut || PartialState::empty(shape.n_q, shape.d_v),
                &mut |a: PartialState, b: PartialState| {
                    a.merge(&b)
                        .expect("states of the same head have the same shape")
                },
            )?;
            Ok(state.into_parts())
        };
        Some(run())
    }

    fn attention_backward(
        &self,
        q: MatRef<'_, f32>,
        k: MatRef<'_, f32>,
        v: MatRef<'_, f32>,
        grad_out: MatRef<'_, f32>,
        out: MatRef<'_, f32>,
        lse: &[f32],
        options: &Options<'_>,
    ) -> Option<Result<Gradients>> {
        // Operands in T; the gradients are written in f32 by the `_into` form (T's own
        // rounding is checked by the engine's tests: half gradients are the f32 ones
        // rounded once).
        let run = || -> Result<Gradients> {
            let t = |m: MatRef<'_, f32>| narrow::<T>(m);
            let (qt, kt, vt, dot, ot) = (t(q), t(k), t(v), t(grad_out), t(out));
            let mut dq = Mat::<f32>::zeros(q.nrows(), q.ncols());
            let mut dk = Mat::<f32>::zeros(k.nrows(), k.ncols());
            let mut dv = Mat::<f32>::zeros(v.nrows(), v.ncols());
            Attention::head(qt.as_ref(), kt.as_ref(), vt.as_ref(), options).and_then(|call| {
                call.backward_into(
                    ForwardRef::head(ot.as_ref(), lse),
                    dot.as_ref(),
                    GradientsMut {
                        dq: dq.as_mut(),
                        dk: dk.as_mut(),
                        dv: dv.as_mut(),
                    },
                    Par::rayon(0),
                )
            })?;
            Ok(Gradients::new(dq, dk, dv))
        };
        Some(run())
    }

    fn attention_backward_batched(
        &self,
        q: Tensor4Ref<'_, f32>,
        k: Tensor4Ref<'_, f32>,
        v: Tensor4Ref<'_, f32>,
        grad_out: Tensor4Ref<'_, f32>,
        out: Tensor4Ref<'_, f32>,
        lse: &[f32],
        options: &Options<'_>,
    ) -> Option<Result<BatchGradients>> {
        let run = || -> Result<BatchGradients> {
            let data = [q, k, v, grad_out, out].map(narrow_tensor::<T>);
            let [qd, kd, vd, dod, od] = data;
            let (qd, kd, vd, dod, od) = (qd?, kd?, vd?, dod?, od?);
            fn view<'a, T>(d: &'a [T], t: Tensor4Ref<'_, f32>) -> Result<Tensor4Ref<'a, T>> {
                Tensor4Ref::new(d, t.dims(), t.strides())
            }
            let g = Attention::batched(view(&qd, q)?, view(&kd, k)?, view(&vd, v)?, options)
                .and_then(|call| {
                    call.backward(
                        ForwardRef::batch(view(&od, out)?, lse)?,
                        view(&dod, grad_out)?,
                        Par::rayon(0),
                    )
                })?;
            let wide = |t: Tensor4<T>| {
                let dims = t.dims();
                Tensor4::from_vec(t.into_vec().into_iter().map(|x| x.to_f32()).collect(), dims)
            };
            Ok(BatchGradients::new(wide(g.dq)?, wide(g.dk)?, wide(g.dv)?))
        };
        Some(run())
    }

    fn attention_packed(
        &self,
        q: Tensor4Ref<'_, f32>,
        k: Tensor4Ref<'_, f32>,
        v: Tensor4Ref<'_, f32>,
        seqs: &CuSeqlens<'_>,
        options: &Options<'_>,
    ) -> Option<Result<(Tensor4<f32>, Vec<f32>)>> {
        let run = || -> Result<(Tensor4<f32>, Vec<f32>)> {
            let [qd, kd, vd] = [q, k, v].map(narrow_tensor::<T>);
            let (qd, kd, vd) = (qd?, kd?, vd?);
            let (o, lse) = Attention::packed(
                Tensor4Ref::new(&qd, q.dims(), q.strides())?,
                Tensor4Ref::new(&kd, k.dims(), k.strides())?,
                Tensor4Ref::new(&vd, v.dims(), v.strides())?,
                seqs,
                options,
            )
            .and_then(|call| call.forward(Par::rayon(0)))
            .map(|f| f.into_parts())?;
            let dims = o.dims();
            let o =
                Tensor4::from_vec(o.into_vec().into_iter().map(|x| x.to_f32()).collect(), dims)?;
            Ok((o, lse))
        };
        Some(run())
    }

    fn attention_backward_packed(
        &self,
        q: Tensor4Ref<'_, f32>,
        k: Tensor4Ref<'_, f32>,
        v: Tensor4Ref<'_, f32>,
        grad_out: Tensor4Ref<'_, f32>,
        out: Tensor4Ref<'_, f32>,
        lse: &[f32],
        seqs: &CuSeqlens<'_>,
        options: &Options<'_>,
    ) -> Option<Result<BatchGradients>> {
        let run = || -> Result<BatchGradients> {
            let [qd, kd, vd, dod, od] = [q, k, v, grad_out, out].map(narrow_tensor::<T>);
            let (qd, kd, vd, dod, od) = (qd?, kd?, vd?, dod?, od?);
            fn view<'a, T>(d: &'a [T], t: Tensor4Ref<'_, f32>) -> Result<Tensor4Ref<'a, T>> {
                Tensor4Ref::new(d, t.dims(), t.strides())
            }
            let g = Attention::packed(view(&qd, q)?, view(&kd, k)?, view(&vd, v)?, seqs, options)
                .and_then(|call| {
                call.backward(
                    ForwardRef::batch(view(&od, out)?, lse)?,
                    view(&dod, grad_out)?,
                    Par::rayon(0),
                )
            })?;
            let wide = |t: Tensor4<T>| {
                let dims = t.dims();
                Tensor4::from_vec(t.into_vec().into_iter().map(|x| x.to_f32()).collect(), dims)
            };
            Ok(BatchGradients::new(wide(g.dq)?, wide(g.dk)?, wide(g.dv)?))
        };
        Some(run())
    }
}

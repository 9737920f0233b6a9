//! The gradient of an additive mask (a learnable bias): an engine's `dbias` — the score
//! gradient summed over the axes the bias broadcasts on — within the derived bound of the
//! reference's (every head's `dS` bound, summed as the entries are, plus the f32
//! accumulation of the sum), and the same bits with 1, 2 and 3 threads.

use attn_core::{Mask4Ref, Tensor4, Tensor4Ref};
use attn_reference::Attention;
use proptest::prelude::*;
use proptest::sample::select;

use super::common::{Check, all_rows, compare_head, engine_err, fail, pools, scale_of};
use crate::bound::{SAFETY, U32, gamma, head_backward_bound};
use crate::case::{
    BatchCase, DropoutRecipe, Rng, Shapes, batch_case, batch_for_backward, dropout_recipe,
};
use crate::{Call, Engine};

/// Which axes of `[batch, head, query, key]` a bias broadcasts on, and how: by a length
/// of 1, or by a stride of 0 over the full length.
#[derive(Debug, Clone, PartialEq)]
pub struct BiasCase {
    /// The problem (its own masks replaced by the bias; key padding and a causal mask stay).
    pub batch: BatchCase,
    /// Along batch, head and query: broadcast or not.
    pub broadcast: [bool; 3],
    /// A broadcast axis has stride 0 (`true`) or length 1.
    pub zero_stride: bool,
    /// Share of `-inf` entries, in percent.
    pub neg_inf_percent: u8,
    /// Dropout on top, sometimes.
    pub dropout: Option<DropoutRecipe>,
    /// Seed of the bias and of `dO`.
    pub seed: u64,
}

pub(crate) fn bias_case(shapes: &Shapes) -> BoxedStrategy<BiasCase> {
    (
        batch_case(shapes),
        select(vec![
            [true, false, false],  // T5: one bias per head, shared by the batch
            [false, false, false], // one per (batch entry, head)
            [false, true, false],  // one per batch entry, shared by its heads
            [true, true, false],   // one [n_q, n_k] for all
            [false, true, true],   // a key bias per batch entry (padding-like)
            [true, false, true],   // a key bias per head
        ]),
        any::<bool>(),
        select(vec![0u8, 0, 10]),
        proptest::option::weighted(0.3, dropout_recipe()),
        any::<u64>(),
    )
        .prop_map(
            |(batch, broadcast, zero_stride, neg_inf_percent, dropout, seed)| {
                let mut batch = batch_for_backward(batch);
                let m = &mut batch.head.masks;
                (m.additive, m.bool_mask, m.window) = (None, None, None);
                m.modifiers.dropout = None;
                BiasCase {
                    batch,
                    broadcast,
                    zero_stride,
                    neg_inf_percent,
                    dropout,
                    seed,
                }
            },
        )
        .boxed()
}

/// The bias of a case: its values, dims and strides.
fn build_bias(case: &BiasCase, dims: [usize; 4]) -> (Vec<f32>, [usize; 4], [usize; 4]) {
    let own: [usize; 4] = core::array::from_fn(|a| {
        if a < 3 && case.broadcast[a] {
            1
        } else {
            dims[a]
        }
    });
    let mut rng = Rng::new(case.seed, 41);
    let n: usize = own.iter().product();
    let values = (0..n)
        .map(|_| {
            if rng.chance(case.neg_inf_percent) {
                f32::NEG_INFINITY
            } else {
                rng.normal() as f32
            }
        })
        .collect();
    let strides = [own[1] * own[2] * own[3], own[2] * own[3], own[3], 1];
    let (view_dims, view_strides) = if case.zero_stride {
        let d: [usize; 4] = core::array::from_fn(|a| dims[a]);
        let s: [usize; 4] = core::array::from_fn(|a| if own[a] == 1 { 0 } else { strides[a] });
        (d, s)
    } else {
        (own, strides)
    };
    (values, view_dims, view_strides)
}

/// The engine's bias gradient is the reference's within the bound, and its bits do not
/// depend on the thread count.
pub(crate) fn bias_gradient(engine: &dyn Engine, case: BiasCase) -> Check {
    let inputs = case.batch.build(engine.storage());
    let [batch, h_q, n_q, d_k] = inputs.q.dims;
    let n_k = inputs.k.dims[2];
    let (values, dims, strides) = build_bias(&case, [batch, h_q, n_q, n_k]);
    let bias = Mask4Ref::new(&values, dims, strides).map_err(|e| engine_err("the bias", e))?;
    let mut options = inputs.options().with_additive_mask_4d(bias);
    if let Some(d) = case.dropout {
        options = options.with_dropout(d.dropout());
    }
    let (q, k, v) = (inputs.q.view(), inputs.k.view(), inputs.v.view());
    let call = Call::batched(q, k, v, &options);
    let Some(forward) = call.forward_batch(engine) else {
        return Ok(());
    };
    let (out, lse) = forward.map_err(|e| engine_err("batched call", e))?;
    let mut rng = Rng::new(case.seed, 42);
    let d_out: Vec<f32> = (0..out.as_slice().len())
        // In the engine's storage type, as the engine reads dO.
        .map(|_| engine.storage().round(rng.normal() as f32))
        .collect();
    let d_out = Tensor4::from_vec(d_out, out.dims()).map_err(|e| engine_err("dO", e))?;
    let backward = || {
        call.with_bias_gradient()
            .backward_batch(engine, d_out.as_ref(), out.as_ref(), &lse)
            .map(|g| g.map_err(|e| engine_err("batched backward with the bias gradient", e)))
    };
    let Some(g) = backward() else {
        return Ok(()); // no backward pass
    };
    let Some(dbias) = g?.dbias else {
        eprintln!(
            "attn-oracle: engine `{}` returns no bias gradient",
            engine.name()
        );
        return Ok(());
    };

    let reference = Attention::batched(q, k, v, &options).expect("generated inputs are valid");
    let heads = reference
        .backward_materialized(d_out.as_ref())
        .expect("generated inputs are valid");
    let want = reference
        .bias_gradient(d_out.as_ref())
        .map_err(|e| fail(format!("the reference's bias gradient: {e}")))?;
    if dbias.dims() != want.dims() {
        return Err(fail(format!(
            "dbias has dims {:?}, the bias's values {:?}",
            dbias.dims(),
            want.dims()
        )));
    }
    // The bound: each head's dS bound summed as the entries are, plus the f32 sum of the
    // terms of each entry.
    let own = want.dims();
    let len = want.as_slice().len();
    let (mut bound, mut abs, mut terms) = (vec![0.0f64; len], vec![0.0f64; len], vec![0.0f64; len]);
    let scale = scale_of(&options, d_k);
    let group = h_q / inputs.k.dims[1];
    for (b, per_head) in heads.iter().enumerate() {
        for (h, r) in per_head.iter().enumerate() {
            fn at(m: Tensor4Ref<'_, f32>, b: usize, kv: usize) -> faer::MatRef<'_, f32> {
                m.head(b, kv).expect("in range")
            }
            let head_bias = bias.head(b, h, n_q, n_k).expect("in range");
            let gb = head_backward_bound(
                &engine.error_model(),
                at(q, b, h),
                at(k, b, h / group),
                at(v, b, h / group),
                at(d_out.as_ref(), b, h),
                scale,
                Some(head_bias),
                r,
            );
            let at_out = (b * h_q + h) * n_q;
            compare_head(
                &format!("batch entry {b}, head {h}: the forward given to the backward"),
                out.as_ref().head(b, h).expect("in range"),
                Some(&lse[at_out..at_out + n_q]),
                &r.forward,
                &gb.forward,
                &all_rows,
            )
            .map_err(fail)?;
            let (bb, hh) = (b.min(own[0] - 1), h.min(own[1] - 1));
            for i in 0..n_q {
                let ii = i.min(own[2] - 1);
                for j in 0..n_k {
                    let e = ((bb * own[1] + hh) * own[2] + ii) * own[3] + j;
                    bound[e] += gb.ds[(i, j)];
                    abs[e] += r.ds_modified[(i, j)].abs() + gb.ds[(i, j)];
                    terms[e] += 1.0;
                }
            }
        }
    }
    let got = dbias.as_slice();
    for (e, (&x, &y)) in got.iter().zip(want.as_slice()).enumerate() {
        let bd = bound[e] + SAFETY * gamma(terms[e] + 1.0, U32) * abs[e];
        let err = (f64::from(x) - y).abs();
        if err.is_nan() || err > bd {
            return Err(fail(format!(
                "dbias entry {e} of dims {own:?} is {x:e} but the reference says {y:e}: \
                 |error| = {err:.3e} exceeds the derived bound {bd:.3e}"
            )));
        }
    }
    // The same bits with 1, 2 and 3 threads.
    let bits = |t: &Tensor4<f32>| t.as_slice().iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    for pool in pools() {
        let again = pool.install(backward).expect("it ran once")?;
        let again = again.dbias.expect("it did once");
        if bits(&again) != bits(&dbias) {
            return Err(fail(format!(
                "dbias bits differ with {} threads",
                pool.current_num_threads()
            )));
        }
    }
    Ok(())
}

//! The properties of attention dropout: its cases, the keep mask an engine applies (the
//! contract's generator, at the rate `1 − p`), the mean of many dropped outputs (the
//! undropped output), and `p = 0` (no dropout, bit for bit). Equivalence with the
//! reference, forward and backward, and determinism run the forward, backward and
//! batched checks of the other modules on the cases made here (`properties/mod.rs`).

use core::fmt;

use attn_core::Dropout;
use faer::Mat;
use proptest::prelude::*;

use super::backward::{BatchGradCase, GradCase};
use super::common::{Check, engine_err, equivalent, fail, run_head, views};
use crate::Call;
use crate::Engine;
use crate::case::{
    BatchCase, DropoutRecipe, HeadCase, MaskRecipe, Rng, Shapes, dropout_recipe, head_case,
};
use crate::engine::required;

/// `cases` with a dropout drawn in the share `weight` of them, handed to `set`.
pub(crate) fn with_dropout<T: fmt::Debug + Clone + 'static>(
    cases: BoxedStrategy<T>,
    weight: f64,
    set: fn(&mut T, Option<DropoutRecipe>),
) -> BoxedStrategy<T> {
    let drawn = if weight < 1.0 {
        proptest::option::weighted(weight, dropout_recipe()).boxed()
    } else {
        dropout_recipe().prop_map(Some).boxed()
    };
    (cases, drawn)
        .prop_map(move |(mut case, dropout)| {
            set(&mut case, dropout);
            case
        })
        .boxed()
}

/// Sets the dropout of a single-head and a batched case.
pub(crate) fn set_forward(case: &mut (HeadCase, BatchCase), d: Option<DropoutRecipe>) {
    case.0.masks.modifiers.dropout = d;
    case.1.head.masks.modifiers.dropout = d;
}

/// Sets the dropout of a single-head and a batched backward case.
pub(crate) fn set_backward(case: &mut (GradCase, BatchGradCase), d: Option<DropoutRecipe>) {
    case.0.head.masks.modifiers.dropout = d;
    case.1.batch.head.masks.modifiers.dropout = d;
}

// ---------------------------------------------------------------------------------------
// The keep mask.

/// A head case with enough visible weights to measure a rate (`n_q·n_k` up to 16k), masks
/// that leave keys visible, and a dropout; V becomes the identity, so that the output is
/// the dropped weights.
pub(crate) fn keep_rate_case(shapes: &Shapes) -> BoxedStrategy<HeadCase> {
    let s = Shapes {
        max_q: shapes.max_q.clamp(16, 96),
        max_k: shapes.max_k.clamp(16, 171),
        ..shapes.clone()
    };
    (head_case(&s), dropout_recipe(), any::<bool>())
        .prop_map(|(mut c, d, causal)| {
            c.masks = MaskRecipe {
                scale: c.masks.scale,
                causal: causal.then_some(attn_core::Causal::BottomRight),
                ..MaskRecipe::NONE
            };
            c.masks.modifiers.dropout = Some(d);
            (c.n_q, c.n_k) = (c.n_q.max(16), c.n_k.max(16));
            c
        })
        .boxed()
}

/// The engine drops exactly the weights the contract's generator drops (the reference's
/// mask), keeps the others scaled by `1/(1 − p)` (within the bound of the reference), and
/// the share it keeps is within [`FALSE_ALARM`]'s Bernstein bound of `1 − p`.
pub(crate) fn keep_rate(engine: &dyn Engine, case: HeadCase) -> Check {
    let mut inputs = case.build(engine.storage());
    let n_k = inputs.k.nrows();
    inputs.v = Mat::from_fn(n_k, n_k, |i, j| if i == j { 1.0 } else { 0.0 });
    let (o, _, r, _) = equivalent(engine, &inputs, "dropped weights (V = I)")?;
    let p = f64::from(case.masks.modifiers.dropout.map_or(0.0, |d| d.p));
    let tiny = 1024.0 * engine.storage().smallest_normal();
    let (mut kept, mut visible) = (0u64, 0u64);
    for i in 0..o.nrows() {
        for j in 0..n_k {
            if r.scores[(i, j)] == f64::NEG_INFINITY {
                continue;
            }
            visible += 1;
            let keeps = r.dropout[(i, j)] != 0.0;
            kept += u64::from(keeps);
            // A weight far from the output type's underflow is 0 exactly when dropped.
            let weight = r.weights[(i, j)];
            if weight > tiny && (o[(i, j)] != 0.0) != keeps {
                return Err(fail(format!(
                    "weight [{i}, {j}] (reference {weight:e}) is {:e}: the contract {} it",
                    o[(i, j)],
                    if keeps { "keeps" } else { "drops" }
                )));
            }
        }
    }
    let n = visible as f64;
    // The normal approximation of the binomial count needs a few expected in each class.
    if n * p.min(1.0 - p) < 10.0 {
        return Ok(());
    }
    let rate = kept as f64 / n;
    // The threshold rounds p to 2⁻¹⁶: the rate's mean is 1 − p within 2⁻¹⁷.
    let allowed = bernstein(n, p * (1.0 - p)) + 2f64.powi(-17);
    if (rate - (1.0 - p)).abs() > allowed {
        return Err(fail(format!(
            "{kept} of {visible} weights kept: rate {rate:.4}, not within {allowed:.4} of 1 − p = {:.4}",
            1.0 - p
        )));
    }
    Ok(())
}

/// The chance a correct generator may fail one statistical check of a case. A 4σ check
/// fails a correct engine once in 16,000 cases, and the suite runs thousands of cases a
/// run (every property, element type and kernel path): it did, twice. At 10⁻⁹ no run
/// ever should, and a rate or mean off by a sizeable share of `p` is still caught.
const FALSE_ALARM: f64 = 1e-9;

/// `t` such that the mean of `n` independent variables in `[0, 1]` of variance `var`
/// strays from its expectation by `t` or more with probability at most [`FALSE_ALARM`]:
/// Bernstein's inequality, `2·exp(−n t² / (2 var + 2t/3)) = FALSE_ALARM`, solved for `t`.
fn bernstein(n: f64, var: f64) -> f64 {
    let l = (2.0 / FALSE_ALARM).ln();
    let b = 2.0 * l / 3.0;
    (b + (b * b + 8.0 * n * l * var).sqrt()) / (2.0 * n)
}

/// How many standard deviations a normal deviate may reach, the largest of `count` of
/// them, with probability at most [`FALSE_ALARM`] of exceeding it (a union bound on the
/// Gaussian tail `P(|Z| > k) ≤ exp(−k²/2)`).
fn union_sigmas(count: usize) -> f64 {
    (2.0 * (count.max(1) as f64 / FALSE_ALARM).ln()).sqrt()
}

// ---------------------------------------------------------------------------------------
// The mean of dropped outputs.

/// Runs per case.
const SEEDS: usize = 48;

/// A small head case and a dropout probability in `[0.05, 0.6]`.
pub(crate) fn mean_case(shapes: &Shapes) -> BoxedStrategy<(HeadCase, f32)> {
    let s = Shapes {
        max_q: shapes.max_q.min(24),
        max_k: shapes.max_k.min(80),
        ..shapes.clone()
    };
    (head_case(&s), 0.05f32..0.6)
        .prop_map(|(mut c, p)| {
            c.masks.modifiers.dropout = None;
            (c, p)
        })
        .boxed()
}

/// Dropout is unbiased: the mean of the engine's outputs over many seeds is the undropped
/// output, within [`union_sigmas`] standard deviations of the mean for the case's number
/// of outputs (`Var o_ic = Σ_j A_ij² v_jc² · p/(1 − p)`, from the reference's weights) plus
/// the bound of each output.
pub(crate) fn mean_is_undropped(engine: &dyn Engine, (case, p): (HeadCase, f32)) -> Check {
    let inputs = case.build(engine.storage());
    let (o, _, r, b) = equivalent(engine, &inputs, "undropped")?;
    let (n_q, d_v) = (o.nrows(), o.ncols());
    let mut sum = Mat::<f64>::zeros(n_q, d_v);
    let mut rng = Rng::new(case.seed, 31);
    for _ in 0..SEEDS {
        let seed = rng.next_u64();
        let mut dropped = inputs.clone();
        dropped.recipe.modifiers.dropout = Some(DropoutRecipe { p, seed });
        let (od, _) = run_head(engine, &dropped)?;
        for i in 0..n_q {
            for c in 0..d_v {
                sum[(i, c)] += f64::from(od[(i, c)]);
            }
        }
    }
    let p = f64::from(p);
    let spread = p / (1.0 - p);
    let (_, _, v) = views(&inputs);
    let scale = 1.0 / (1.0 - p);
    let sigmas = union_sigmas(n_q * d_v);
    for i in 0..n_q {
        for c in 0..d_v {
            let var: f64 = (0..v.nrows())
                .map(|j| (r.weights[(i, j)] * f64::from(v[(j, c)])).powi(2))
                .sum::<f64>()
                * spread;
            let mean = sum[(i, c)] / SEEDS as f64;
            let allowed = sigmas * (var / SEEDS as f64).sqrt() + (1.0 + scale) * b.output[(i, c)];
            let err = (mean - f64::from(o[(i, c)])).abs();
            if err.is_nan() || err > allowed {
                return Err(fail(format!(
                    "output [{i}, {c}]: the mean of {SEEDS} dropped outputs is {mean:e}, the \
                     undropped one {:e}: |difference| {err:.3e} > {allowed:.3e}",
                    o[(i, c)]
                )));
            }
        }
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------
// p = 0.

/// `Dropout::new(0, seed)` computes the bits of a call without dropout: batched forward,
/// and the batched backward where the engine has one.
pub(crate) fn zero_is_none(engine: &dyn Engine, (case, seed): (BatchCase, u64)) -> Check {
    let inputs = case.build(engine.storage());
    let plain = inputs.options();
    let zero = plain.with_dropout(Dropout::new(0.0, seed).expect("0 is a probability"));
    let (q, k, v) = (inputs.q.view(), inputs.k.view(), inputs.v.view());
    let forward = |opts| {
        required(Call::batched(q, k, v, opts).forward_batch(engine))
            .map_err(|e| engine_err("batched call", e))
    };
    let (a, la) = forward(&plain)?;
    let (z, lz) = forward(&zero)?;
    let bits = |s: &[f32]| s.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    if bits(a.as_slice()) != bits(z.as_slice()) || bits(&la) != bits(&lz) {
        return Err(fail("p = 0: the forward bits differ from no dropout"));
    }
    let mut rng = Rng::new(seed, 32);
    let values = (0..a.as_slice().len())
        .map(|_| rng.normal() as f32)
        .collect();
    let grad = attn_core::Tensor4::from_vec(values, a.dims()).expect("one entry per output");
    let backward = |opts| {
        Call::batched(q, k, v, opts)
            .backward_batch(engine, grad.as_ref(), a.as_ref(), &la)
            .map(|g| g.map_err(|e| engine_err("batched backward call", e)))
    };
    if let (Some(ga), Some(gz)) = (backward(&plain), backward(&zero)) {
        let (ga, gz) = (ga?, gz?);
        for (what, x, y) in [
            ("dQ", &ga.dq, &gz.dq),
            ("dK", &ga.dk, &gz.dk),
            ("dV", &ga.dv, &gz.dv),
        ] {
            if bits(x.as_slice()) != bits(y.as_slice()) {
                return Err(fail(format!(
                    "p = 0: the {what} bits differ from no dropout"
                )));
            }
        }
    }
    Ok(())
}

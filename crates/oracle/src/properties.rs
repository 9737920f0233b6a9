//! The property checks: one function per property, over built inputs.

use std::sync::OnceLock;

use attn_core::{
    BoolMask, Causal, HeadMask, KeyPadding, Options, SlidingWindow, Tensor4, Tensor4Ref,
};
use attn_reference::Materialized;
use faer::{Mat, MatRef};
use proptest::prelude::*;
use proptest::sample::select;
use proptest::test_runner::TestCaseError;

use crate::bound::{HeadBound, head_bound_merged};
use crate::case::{
    BatchCase, BatchInputs, Bias, HeadCase, HeadInputs, Rng, Shapes, batch_case, elementwise_masks,
    head_case, head_case_with, masks, ordinary_values,
};
use crate::suite::record_tightness;
use crate::{Engine, MergePlan};

type Check = Result<(), TestCaseError>;

fn fail(msg: impl Into<String>) -> TestCaseError {
    TestCaseError::fail(msg.into())
}

fn engine_err(what: &str, e: attn_core::Error) -> TestCaseError {
    fail(format!("the engine rejected a valid {what}: {e}"))
}

// ---------------------------------------------------------------------------------------
// Shapes.

pub(crate) fn shapes(engine: &dyn Engine) -> Shapes {
    let tiles = engine.tile_lengths();
    let max_tile = tiles.iter().copied().max().unwrap_or(64);
    Shapes {
        tiles,
        max_q: 257.min(max_tile + 1),
        max_k: max_tile + 1,
    }
}

pub(crate) fn batch_shapes(s: &Shapes) -> Shapes {
    Shapes {
        tiles: s.tiles.clone(),
        max_q: 129.min(s.max_q),
        max_k: 129.min(s.max_k),
    }
}

// ---------------------------------------------------------------------------------------
// Reference, bound, comparison.

fn reference(inputs: &HeadInputs) -> Materialized {
    attn_reference::attention_materialized(
        inputs.q.as_ref(),
        inputs.k.as_ref(),
        inputs.v.as_ref(),
        &inputs.options(),
    )
    .expect("generated inputs are valid")
}

fn scale_of(options: &Options<'_>, d_k: usize) -> f64 {
    options
        .scale_for_f64(d_k)
        .expect("generated scales are valid")
}

fn bound(engine: &dyn Engine, inputs: &HeadInputs, r: &Materialized, merges: usize) -> HeadBound {
    let opts = inputs.options();
    head_bound_merged(
        &engine.error_model(),
        inputs.q.as_ref(),
        inputs.k.as_ref(),
        inputs.v.as_ref(),
        scale_of(&opts, inputs.q.ncols()),
        opts.additive_mask,
        r,
        merges,
    )
}

/// Compares an engine's output (and LSE) with the reference, row by row where `rows`
/// says so: a row with no visible key must be exactly 0 with LSE `-inf`, every other
/// row finite and within the bound `b`. Returns a description of the first violation.
pub fn compare_head(
    what: &str,
    o: MatRef<'_, f32>,
    lse: Option<&[f32]>,
    r: &Materialized,
    b: &HeadBound,
    rows: &dyn Fn(usize) -> bool,
) -> Result<(), String> {
    let (n_q, d_v) = (r.output.nrows(), r.output.ncols());
    if (o.nrows(), o.ncols()) != (n_q, d_v) {
        return Err(format!(
            "{what}: output is {}×{} but must be {n_q}×{d_v}",
            o.nrows(),
            o.ncols()
        ));
    }
    if let Some(l) = lse
        && l.len() != n_q
    {
        return Err(format!("{what}: {} LSE values for {n_q} rows", l.len()));
    }
    for i in (0..n_q).filter(|&i| rows(i)) {
        if r.lse[i] == f64::NEG_INFINITY {
            if let Some(c) = (0..d_v).find(|&c| o[(i, c)] != 0.0) {
                return Err(format!(
                    "{what}: row {i} has no visible key, so its output must be exactly 0, \
                     but output[{i}, {c}] = {:e}",
                    o[(i, c)]
                ));
            }
            if let Some(l) = lse
                && l[i] != f32::NEG_INFINITY
            {
                return Err(format!(
                    "{what}: row {i} has no visible key, so its LSE must be -inf, not {:e}",
                    l[i]
                ));
            }
            continue;
        }
        for c in 0..d_v {
            let (e, x, bd) = (f64::from(o[(i, c)]), r.output[(i, c)], b.output[(i, c)]);
            if x.is_nan() {
                continue;
            }
            let err = (e - x).abs();
            record_tightness(err, bd);
            if !e.is_finite() || err > bd {
                return Err(format!(
                    "{what}: output[{i}, {c}] = {e:e} but the reference says {x:e}: \
                     |error| = {err:.3e} exceeds the derived bound {bd:.3e}"
                ));
            }
        }
        if let Some(l) = lse {
            let (e, x, bd) = (f64::from(l[i]), r.lse[i], b.lse[i]);
            if x.is_nan() {
                continue;
            }
            let err = (e - x).abs();
            record_tightness(err, bd);
            if !e.is_finite() || err > bd {
                return Err(format!(
                    "{what}: LSE[{i}] = {e:e} but the reference says {x:e}: \
                     |error| = {err:.3e} exceeds the derived bound {bd:.3e}"
                ));
            }
        }
    }
    Ok(())
}

fn all_rows(_: usize) -> bool {
    true
}

fn run_head(
    engine: &dyn Engine,
    inputs: &HeadInputs,
) -> Result<(Mat<f32>, Vec<f32>), TestCaseError> {
    engine
        .attention_with_lse(
            inputs.q.as_ref(),
            inputs.k.as_ref(),
            inputs.v.as_ref(),
            &inputs.options(),
        )
        .map_err(|e| engine_err("single-head call", e))
}

/// Runs one head and checks it against the reference; returns the engine's result.
fn equivalent(
    engine: &dyn Engine,
    inputs: &HeadInputs,
    what: &str,
) -> Result<(Mat<f32>, Vec<f32>, Materialized, HeadBound), TestCaseError> {
    let (o, lse) = run_head(engine, inputs)?;
    let r = reference(inputs);
    let b = bound(engine, inputs, &r, 0);
    compare_head(what, o.as_ref(), Some(&lse), &r, &b, &all_rows).map_err(fail)?;
    Ok((o, lse, r, b))
}

// ---------------------------------------------------------------------------------------
// 1, 2: weights through V = I.

/// A head case whose V is replaced by the identity, so that the output is the weights.
pub(crate) fn identity_v_case(shapes: &Shapes) -> BoxedStrategy<HeadCase> {
    let s = Shapes {
        max_k: shapes.max_k.min(513),
        ..shapes.clone()
    };
    head_case(&s)
}

fn with_identity_v(case: &HeadCase, engine: &dyn Engine) -> HeadInputs {
    let mut inputs = case.build(engine.storage());
    let n_k = inputs.k.nrows();
    inputs.v = Mat::from_fn(n_k, n_k, |i, j| if i == j { 1.0 } else { 0.0 });
    inputs
}

pub(crate) fn rows_sum_to_one(engine: &dyn Engine, case: HeadCase) -> Check {
    let inputs = with_identity_v(&case, engine);
    let (o, _, r, b) = equivalent(engine, &inputs, "weights (V = I)")?;
    for i in 0..o.nrows() {
        if r.lse[i] == f64::NEG_INFINITY {
            continue;
        }
        let mut sum = 0.0f64;
        for c in 0..o.ncols() {
            let w = o[(i, c)];
            if !(0.0..=1.0 + b.row_sum[i] as f32).contains(&w) {
                return Err(fail(format!(
                    "weight[{i}, {c}] = {w:e} lies outside [0, 1]"
                )));
            }
            sum += f64::from(w);
        }
        let err = (sum - 1.0).abs();
        record_tightness(err, b.row_sum[i]);
        if err > b.row_sum[i] {
            return Err(fail(format!(
                "row {i} of the weights sums to {sum:.9} (|error| = {err:.3e} > derived bound {:.3e})",
                b.row_sum[i]
            )));
        }
    }
    Ok(())
}

pub(crate) fn masked_weights_are_zero(engine: &dyn Engine, case: HeadCase) -> Check {
    let inputs = with_identity_v(&case, engine);
    let opts = inputs.options();
    let [n_q, n_k, _, _] = inputs.dims();
    let (o, _) = run_head(engine, &inputs)?;
    if (o.nrows(), o.ncols()) != (n_q, n_k) {
        return Err(fail(format!(
            "output is {}×{}, not {n_q}×{n_k}",
            o.nrows(),
            o.ncols()
        )));
    }
    let mask = HeadMask::new(&opts, n_q, n_k, opts.key_length(0));
    for i in 0..n_q {
        for j in 0..n_k {
            let hidden = !mask.allows(i, j) || mask.bias(i, j) == f32::NEG_INFINITY;
            if hidden && o[(i, j)] != 0.0 {
                return Err(fail(format!(
                    "key {j} is hidden from query {i} but its weight is {:e}",
                    o[(i, j)]
                )));
            }
        }
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------
// 2: poisoned hidden keys.

/// A head case and which key to poison (`true`: the last key, else a seeded one) with
/// which value (`NaN`, `+inf`, `-inf`); a seeded query row is poisoned too.
pub(crate) fn poison_case(shapes: &Shapes) -> BoxedStrategy<(HeadCase, bool, f32)> {
    (
        head_case(shapes),
        any::<bool>(),
        select(vec![f32::NAN, f32::INFINITY, f32::NEG_INFINITY]),
    )
        .boxed()
}

pub(crate) fn hidden_keys_never_leak(
    engine: &dyn Engine,
    (case, last, poison): (HeadCase, bool, f32),
) -> Check {
    let mut inputs = case.build(engine.storage());
    let [n_q, n_k, d_k, d_v] = inputs.dims();
    if n_k == 0 {
        return Ok(());
    }
    let j = if last {
        n_k - 1
    } else {
        Rng::new(case.seed, 99).below(n_k as u64) as usize
    };
    for t in 0..d_k {
        inputs.k[(j, t)] = poison;
    }
    for t in 0..d_v {
        inputs.v[(j, t)] = poison;
    }
    // A poisoned query row touches only its own row.
    let qi = (n_q > 1).then(|| Rng::new(case.seed, 98).below(n_q as u64) as usize);
    if let Some(qi) = qi {
        for t in 0..d_k {
            inputs.q[(qi, t)] = poison;
        }
    }
    let opts = inputs.options();
    let mask = HeadMask::new(&opts, n_q, n_k, opts.key_length(0));
    let (o, lse) = run_head(engine, &inputs)?;
    let r = reference(&inputs);
    let b = bound(engine, &inputs, &r, 0);
    let hidden = |i: usize| !mask.allows(i, j) && Some(i) != qi;
    compare_head(
        &format!("key {j} and query {qi:?} poisoned with {poison}, rows that see neither"),
        o.as_ref(),
        Some(&lse),
        &r,
        &b,
        &hidden,
    )
    .map_err(fail)
}

// ---------------------------------------------------------------------------------------
// 3: fully masked rows.

/// How a case is forced to have rows with no visible key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RowHider {
    /// `n_k = 0`.
    NoKeys,
    /// Key padding to length 0.
    KeyLengthZero,
    /// Bottom-right causal with more queries than keys: the first `n_q − n_k` rows see
    /// nothing.
    BottomRightShort,
    /// A window `(0, 0)` aligned bottom-right with more queries than keys: the first
    /// `n_q − n_k` rows are aligned before the first key.
    WindowPastTheKeys,
    /// Row 0 (and some others) hidden by the boolean mask.
    BoolRows,
    /// Row 0 (and some others) `-inf` everywhere in the additive mask.
    AdditiveRows,
}

pub(crate) fn masked_rows_case(shapes: &Shapes) -> BoxedStrategy<(HeadCase, RowHider)> {
    (
        head_case(shapes),
        select(vec![
            RowHider::NoKeys,
            RowHider::KeyLengthZero,
            RowHider::BottomRightShort,
            RowHider::WindowPastTheKeys,
            RowHider::BoolRows,
            RowHider::AdditiveRows,
        ]),
    )
        .prop_map(|(mut c, h)| {
            c.n_q = c.n_q.max(1);
            match h {
                RowHider::NoKeys => c.n_k = 0,
                RowHider::KeyLengthZero => c.masks.key_len_permille = Some(0),
                RowHider::BottomRightShort => {
                    c.n_q = c.n_q.max(c.n_k + 1);
                    c.masks.causal = Some(Causal::BottomRight);
                }
                RowHider::WindowPastTheKeys => {
                    c.n_q = c.n_q.max(c.n_k + 1);
                    c.masks.window =
                        Some(SlidingWindow::new(Some(0), Some(0), Causal::BottomRight));
                }
                RowHider::BoolRows => {
                    let mut b = c.masks.bool_mask.unwrap_or(crate::case::BoolRecipe {
                        allow: true,
                        visible_percent: 70,
                        hidden_rows_percent: 0,
                    });
                    b.hidden_rows_percent = b.hidden_rows_percent.max(30);
                    c.masks.bool_mask = Some(b);
                }
                RowHider::AdditiveRows => {
                    let mut a = c.masks.additive.unwrap_or(crate::case::AdditiveRecipe {
                        bias: Bias::Small,
                        neg_inf_percent: 0,
                        hidden_rows_percent: 0,
                    });
                    a.hidden_rows_percent = a.hidden_rows_percent.max(30);
                    c.masks.additive = Some(a);
                }
            }
            (c, h)
        })
        .boxed()
}

pub(crate) fn fully_masked_rows(engine: &dyn Engine, (case, hider): (HeadCase, RowHider)) -> Check {
    let mut inputs = case.build(engine.storage());
    let n_k = inputs.k.nrows();
    // Make sure row 0 is hidden by the element-wise masks that were asked to hide rows.
    match hider {
        RowHider::BoolRows => {
            if let Some((allow, m)) = inputs.masks.bool_mask.as_mut() {
                for j in 0..n_k {
                    m[(0, j)] = !*allow;
                }
            }
        }
        RowHider::AdditiveRows => {
            if let Some(m) = inputs.masks.additive.as_mut() {
                for j in 0..n_k {
                    m[(0, j)] = f32::NEG_INFINITY;
                }
            }
        }
        _ => {}
    }
    let (o, lse, r, _) = equivalent(engine, &inputs, "fully masked rows")?;
    if r.lse[0] != f64::NEG_INFINITY {
        return Err(fail(format!(
            "oracle bug: {hider:?} left row 0 with a visible key"
        )));
    }
    if o.col_iter().any(|c| c.iter().any(|x| !x.is_finite())) || lse.iter().any(|x| x.is_nan()) {
        return Err(fail("NaN or Inf in the output of a partly masked problem"));
    }
    // The same problem through the batched API: one batch entry, one head.
    let [n_q, _, d_k, d_v] = inputs.dims();
    let to_vec = |m: &Mat<f32>| -> Vec<f32> {
        (0..m.nrows())
            .flat_map(|i| (0..m.ncols()).map(move |j| (i, j)))
            .map(|(i, j)| m[(i, j)])
            .collect()
    };
    let (qd, kd, vd) = (to_vec(&inputs.q), to_vec(&inputs.k), to_vec(&inputs.v));
    let bhsd = attn_core::Layout::Bhsd;
    let q = Tensor4Ref::from_layout(&qd, [1, 1, n_q, d_k], bhsd).expect("fits");
    let k = Tensor4Ref::from_layout(&kd, [1, 1, n_k, d_k], bhsd).expect("fits");
    let v = Tensor4Ref::from_layout(&vd, [1, 1, n_k, d_v], bhsd).expect("fits");
    let t = engine
        .attention_batched(q, k, v, &inputs.options())
        .map_err(|e| engine_err("batched call", e))?;
    let head = t.as_ref().head(0, 0).map_err(|e| fail(e.to_string()))?;
    for i in (0..n_q).filter(|&i| r.lse[i] == f64::NEG_INFINITY) {
        if let Some(c) = (0..d_v).find(|&c| head[(i, c)] != 0.0) {
            return Err(fail(format!(
                "batched call: row {i} has no visible key but output[{i}, {c}] = {:e}",
                head[(i, c)]
            )));
        }
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------
// 5: equivalence.

pub(crate) fn equivalence(engine: &dyn Engine, case: HeadCase) -> Check {
    let inputs = case.build(engine.storage());
    equivalent(engine, &inputs, "single head").map(|_| ())
}

pub(crate) fn adversarial(engine: &dyn Engine, case: HeadCase) -> Check {
    let inputs = case.build(engine.storage());
    equivalent(engine, &inputs, "adversarial head").map(|_| ())
}

fn batch_reference(inputs: &BatchInputs) -> Vec<Vec<Materialized>> {
    attn_reference::attention_batched_materialized(
        inputs.q.view(),
        inputs.k.view(),
        inputs.v.view(),
        &inputs.options(),
    )
    .expect("generated inputs are valid")
}

fn batch_head_bound(
    engine: &dyn Engine,
    inputs: &BatchInputs,
    b: usize,
    h: usize,
    r: &Materialized,
) -> HeadBound {
    let opts = inputs.options();
    let [_, h_q, _, d_k] = inputs.q.dims;
    let h_kv = inputs.k.dims[1];
    let kv = h / (h_q / h_kv);
    head_bound_merged(
        &engine.error_model(),
        inputs.q.view().head(b, h).expect("in range"),
        inputs.k.view().head(b, kv).expect("in range"),
        inputs.v.view().head(b, kv).expect("in range"),
        scale_of(&opts, d_k),
        opts.additive_mask,
        r,
        0,
    )
}

fn check_batched_output(
    engine: &dyn Engine,
    inputs: &BatchInputs,
    out: &Tensor4<f32>,
    refs: &[Vec<Materialized>],
) -> Check {
    let [batch, h_q, n_q, _] = inputs.q.dims;
    let d_v = inputs.v.dims[3];
    if out.dims() != [batch, h_q, n_q, d_v] {
        return Err(fail(format!(
            "batched output has dims {:?}, not {:?}",
            out.dims(),
            [batch, h_q, n_q, d_v]
        )));
    }
    for (b, per_head) in refs.iter().enumerate() {
        for (h, r) in per_head.iter().enumerate() {
            let bd = batch_head_bound(engine, inputs, b, h, r);
            let o = out.as_ref().head(b, h).map_err(|e| fail(e.to_string()))?;
            compare_head(
                &format!("batch entry {b}, query head {h}"),
                o,
                None,
                r,
                &bd,
                &all_rows,
            )
            .map_err(fail)?;
        }
    }
    Ok(())
}

pub(crate) fn batched_equivalence(engine: &dyn Engine, case: BatchCase) -> Check {
    let inputs = case.build(engine.storage());
    let out = engine
        .attention_batched(
            inputs.q.view(),
            inputs.k.view(),
            inputs.v.view(),
            &inputs.options(),
        )
        .map_err(|e| engine_err("batched call", e))?;
    check_batched_output(engine, &inputs, &out, &batch_reference(&inputs))
}

// ---------------------------------------------------------------------------------------
// 6: invariances.

/// Two engine results that must agree: entry by entry within `bound(i, c)` (the sum of
/// their bounds against the same exact value), equal infinities allowed, NaN never.
fn close(
    what: &str,
    a: MatRef<'_, f32>,
    b: MatRef<'_, f32>,
    bound: &dyn Fn(usize, usize) -> f64,
) -> Check {
    for i in 0..a.nrows() {
        for c in 0..a.ncols() {
            let (x, y) = (f64::from(a[(i, c)]), f64::from(b[(i, c)]));
            let (err, bd) = ((x - y).abs(), bound(i, c));
            record_tightness(err, bd);
            let ok = x == y || err <= bd; // equal infinities too; NaN never ok
            if !ok {
                return Err(fail(format!(
                    "{what}: entry [{i}, {c}] is {x:e} one way and {y:e} the other: \
                     |difference| = {err:.3e} > {bd:.3e}"
                )));
            }
        }
    }
    Ok(())
}

/// A case with grid-valued additive biases (or none) and a seed for the row constants.
pub(crate) fn shift_case(shapes: &Shapes) -> BoxedStrategy<(HeadCase, u64)> {
    (
        head_case_with(
            shapes,
            ordinary_values(),
            ordinary_values(),
            masks(vec![0.5, 1.0, 2.0], vec![Bias::Grid]),
        ),
        any::<u64>(),
    )
        .boxed()
}

pub(crate) fn row_shift(engine: &dyn Engine, (case, seed): (HeadCase, u64)) -> Check {
    let base = case.build(engine.storage());
    let [n_q, n_k, _, _] = base.dims();
    // Constants c_i = k/1024 with |k| < 2^23 − 4096: b + c is exact in f32 for every grid
    // bias b (|b| ≤ 4), so both problems have exactly the same softmax.
    let mut rng = Rng::new(seed, 5);
    let span = (1u64 << 24) - 8194;
    let c: Vec<f32> = (0..n_q)
        .map(|_| (rng.below(span) as f64 - (span / 2) as f64) as f32 / 1024.0)
        .collect();
    let mut shifted = base.clone();
    let b0 = base
        .masks
        .additive
        .clone()
        .unwrap_or_else(|| Mat::zeros(n_q, n_k));
    shifted.masks.additive = Some(Mat::from_fn(n_q, n_k, |i, j| b0[(i, j)] + c[i]));
    let (o0, l0, _, bd0) = equivalent(engine, &base, "unshifted")?;
    let (o1, l1, _, bd1) = equivalent(engine, &shifted, "shifted")?;
    close(
        "adding a constant to each row of scores",
        o0.as_ref(),
        o1.as_ref(),
        &|i, j| bd0.output[(i, j)] + bd1.output[(i, j)],
    )?;
    for i in 0..n_q {
        if l0[i] == f32::NEG_INFINITY {
            continue;
        }
        let moved = f64::from(l1[i]) - f64::from(l0[i]);
        let (err, bd) = ((moved - f64::from(c[i])).abs(), bd0.lse[i] + bd1.lse[i]);
        if err.is_nan() || err > bd {
            return Err(fail(format!(
                "row {i}: adding {} moved the LSE by {moved} (|error| {err:.3e} > {bd:.3e})",
                c[i]
            )));
        }
    }
    Ok(())
}

/// A case with only element-wise masks and a permutation seed.
pub(crate) fn permutation_case(shapes: &Shapes) -> BoxedStrategy<(HeadCase, u64)> {
    (
        head_case_with(
            shapes,
            ordinary_values(),
            ordinary_values(),
            elementwise_masks(),
        ),
        any::<u64>(),
    )
        .boxed()
}

pub(crate) fn key_permutation(engine: &dyn Engine, (case, seed): (HeadCase, u64)) -> Check {
    let base = case.build(engine.storage());
    debug_assert!(base.recipe.is_permutation_invariant());
    let [n_q, n_k, d_k, d_v] = base.dims();
    let mut perm: Vec<usize> = (0..n_k).collect();
    let mut rng = Rng::new(seed, 6);
    for i in (1..n_k).rev() {
        perm.swap(i, rng.below(i as u64 + 1) as usize);
    }
    let mut p = base.clone();
    p.k = Mat::from_fn(n_k, d_k, |j, t| base.k[(perm[j], t)]);
    p.v = Mat::from_fn(n_k, d_v, |j, t| base.v[(perm[j], t)]);
    if let Some((allow, m)) = &base.masks.bool_mask {
        p.masks.bool_mask = Some((*allow, Mat::from_fn(n_q, n_k, |i, j| m[(i, perm[j])])));
    }
    if let Some(m) = &base.masks.additive {
        p.masks.additive = Some(Mat::from_fn(n_q, n_k, |i, j| m[(i, perm[j])]));
    }
    let (o0, l0, _, bd0) = equivalent(engine, &base, "original order")?;
    let (o1, l1, _, bd1) = equivalent(engine, &p, "permuted keys")?;
    close(
        "permuting keys and values",
        o0.as_ref(),
        o1.as_ref(),
        &|i, j| bd0.output[(i, j)] + bd1.output[(i, j)],
    )?;
    let l0m = Mat::from_fn(n_q, 1, |i, _| l0[i]);
    let l1m = Mat::from_fn(n_q, 1, |i, _| l1[i]);
    close(
        "the LSE under a key permutation",
        l0m.as_ref(),
        l1m.as_ref(),
        &|i, _| {
            if l0[i] == f32::NEG_INFINITY {
                0.0
            } else {
                bd0.lse[i] + bd1.lse[i]
            }
        },
    )
}

pub(crate) fn scaling_case(shapes: &Shapes) -> BoxedStrategy<(HeadCase, f32)> {
    (
        head_case(shapes),
        select(vec![-1.0f32, 0.25, 8.0, -3.3, 1e-3]),
    )
        .boxed()
}

pub(crate) fn value_scaling(engine: &dyn Engine, (case, alpha): (HeadCase, f32)) -> Check {
    let base = case.build(engine.storage());
    let mut scaled = base.clone();
    let dt = engine.storage();
    scaled.v = Mat::from_fn(base.v.nrows(), base.v.ncols(), |i, j| {
        dt.round(alpha * base.v[(i, j)])
    });
    let (o0, l0, _, bd0) = equivalent(engine, &base, "original V")?;
    let (o1, l1, _, bd1) = equivalent(engine, &scaled, "scaled V")?;
    if let Some(i) = (0..l0.len()).find(|&i| l0[i].to_bits() != l1[i].to_bits()) {
        return Err(fail(format!(
            "the LSE depends on V: row {i} is {:e} for V and {:e} for {alpha}·V",
            l0[i], l1[i]
        )));
    }
    if alpha == -1.0 {
        // Negation commutes with every IEEE rounding: exact.
        return close(
            "O(−V) = −O(V) exactly",
            o1.as_ref(),
            (-&o0).as_ref(),
            &|_, _| 0.0,
        );
    }
    let u_out = engine.error_model().output.unit_roundoff();
    // α·V rounded to f32 and to the storage type moves each value by at most u_s·|α v|,
    // so the exact output by at most u_s·|α|·max|v| (a convex combination).
    let us = dt.unit_roundoff();
    let vmax = (0..base.v.nrows())
        .flat_map(|i| (0..base.v.ncols()).map(move |j| (i, j)))
        .map(|(i, j)| f64::from(base.v[(i, j)]).abs())
        .fold(0.0, f64::max);
    let a = f64::from(alpha);
    let ao0 = Mat::from_fn(o0.nrows(), o0.ncols(), |i, j| alpha * o0[(i, j)]);
    close(
        &format!("O({alpha}·V) against {alpha}·O(V)"),
        o1.as_ref(),
        ao0.as_ref(),
        &|i, j| {
            bd1.output[(i, j)]
                + a.abs() * bd0.output[(i, j)]
                + 2.0 * u_out * (a * f64::from(o0[(i, j)])).abs()
                + 2.0 * us * a.abs() * vmax
        },
    )
}

pub(crate) fn heads_are_independent(engine: &dyn Engine, case: BatchCase) -> Check {
    let inputs = case.build(engine.storage());
    let opts = inputs.options();
    let out = engine
        .attention_batched(inputs.q.view(), inputs.k.view(), inputs.v.view(), &opts)
        .map_err(|e| engine_err("batched call", e))?;
    let refs = batch_reference(&inputs);
    check_batched_output(engine, &inputs, &out, &refs)?;
    let [batch, h_q, _, _] = inputs.q.dims;
    let h_kv = inputs.k.dims[1];
    for (b, per_head) in refs.iter().enumerate().take(batch) {
        let mut single = opts;
        single.key_padding = opts.key_length(b).map(KeyPadding::Uniform);
        for (h, r) in per_head.iter().enumerate().take(h_q) {
            let kv = h / (h_q / h_kv);
            let (q, k, v) = (
                inputs.q.view().head(b, h).expect("in range"),
                inputs.k.view().head(b, kv).expect("in range"),
                inputs.v.view().head(b, kv).expect("in range"),
            );
            let (o, lse) = engine
                .attention_with_lse(q, k, v, &single)
                .map_err(|e| engine_err("single-head call on a strided view", e))?;
            let bd = batch_head_bound(engine, &inputs, b, h, r);
            let what = format!("single-head call on batch entry {b}, query head {h}");
            compare_head(&what, o.as_ref(), Some(&lse), r, &bd, &all_rows).map_err(fail)?;
            let batched = out.as_ref().head(b, h).map_err(|e| fail(e.to_string()))?;
            close(&what, o.as_ref(), batched, &|i, c| 2.0 * bd.output[(i, c)])?;
        }
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------
// 7: partial states.

pub(crate) fn supports_split(engine: &dyn Engine) -> bool {
    let z = Mat::<f32>::zeros(1, 1);
    let opts = Options::default();
    engine
        .attention_split(
            z.as_ref(),
            z.as_ref(),
            z.as_ref(),
            &opts,
            &MergePlan::keys(0..1),
        )
        .is_some()
}

/// A head case and cut points in per-mille of `n_k`.
pub(crate) fn split_case(shapes: &Shapes) -> BoxedStrategy<(HeadCase, Vec<u16>)> {
    (
        head_case(shapes),
        proptest::collection::vec(0u16..=1000, 1..=4),
    )
        .boxed()
}

fn cuts(n_k: usize, permille: &[u16]) -> Vec<usize> {
    let mut c: Vec<usize> = permille
        .iter()
        .map(|&p| n_k * usize::from(p) / 1000)
        .collect();
    c.push(0);
    c.push(n_k);
    c.sort_unstable();
    c
}

fn split(
    engine: &dyn Engine,
    inputs: &HeadInputs,
    plan: &MergePlan,
) -> Result<(Mat<f32>, Vec<f32>), TestCaseError> {
    engine
        .attention_split(
            inputs.q.as_ref(),
            inputs.k.as_ref(),
            inputs.v.as_ref(),
            &inputs.options(),
            plan,
        )
        .ok_or_else(|| fail("the engine stopped supporting partial states"))?
        .map_err(|e| engine_err("split computation", e))
}

fn same_bits(
    what: &str,
    a: &(Mat<f32>, Vec<f32>),
    b: &(Mat<f32>, Vec<f32>),
    rows: &dyn Fn(usize) -> bool,
) -> Check {
    if (a.0.nrows(), a.0.ncols()) != (b.0.nrows(), b.0.ncols()) || a.1.len() != b.1.len() {
        return Err(fail(format!("{what}: shapes differ")));
    }
    for i in (0..a.0.nrows()).filter(|&i| rows(i)) {
        for c in 0..a.0.ncols() {
            if a.0[(i, c)].to_bits() != b.0[(i, c)].to_bits() {
                return Err(fail(format!(
                    "{what}: output[{i}, {c}] is {:e} (bits {:#010x}) instead of {:e} (bits {:#010x})",
                    a.0[(i, c)],
                    a.0[(i, c)].to_bits(),
                    b.0[(i, c)],
                    b.0[(i, c)].to_bits()
                )));
            }
        }
        if a.1[i].to_bits() != b.1[i].to_bits() {
            return Err(fail(format!(
                "{what}: LSE[{i}] is {:e} instead of {:e}",
                a.1[i], b.1[i]
            )));
        }
    }
    Ok(())
}

pub(crate) fn merge_identity(
    engine: &dyn Engine,
    (case, cut_points): (HeadCase, Vec<u16>),
) -> Check {
    let inputs = case.build(engine.storage());
    let n_k = inputs.k.nrows();
    let all = MergePlan::keys(0..n_k);
    let one = split(engine, &inputs, &all)?;
    let e = || MergePlan::Empty;
    for (name, plan) in [
        ("empty · all", MergePlan::merge(e(), all.clone())),
        ("all · empty", MergePlan::merge(all.clone(), e())),
        (
            "(empty · empty) · all",
            MergePlan::merge(MergePlan::merge(e(), e()), all.clone()),
        ),
        (
            "all · (no keys)",
            MergePlan::merge(all.clone(), MergePlan::keys(n_k..n_k)),
        ),
        (
            "(no keys) · all",
            MergePlan::merge(MergePlan::keys(0..0), all.clone()),
        ),
    ] {
        same_bits(name, &split(engine, &inputs, &plan)?, &one, &all_rows)?;
    }
    // A state whose keys are all hidden from a row is empty for that row: merging it
    // leaves the other state's row unchanged, bit for bit.
    let r = reference(&inputs);
    let s = cuts(n_k, &cut_points)[1];
    let left = MergePlan::keys(0..s);
    let right = MergePlan::keys(s..n_k);
    let merged = split(
        engine,
        &inputs,
        &MergePlan::merge(left.clone(), right.clone()),
    )?;
    let only_right = split(engine, &inputs, &right)?;
    let only_left = split(engine, &inputs, &left)?;
    let hidden = |i: usize, range: core::ops::Range<usize>| {
        range.clone().all(|j| r.scores[(i, j)] == f64::NEG_INFINITY)
    };
    same_bits(
        &format!("rows that see no key in 0..{s}: (0..{s}) · ({s}..{n_k}) against ({s}..{n_k})"),
        &merged,
        &only_right,
        &|i| hidden(i, 0..s),
    )?;
    same_bits(
        &format!("rows that see no key in {s}..{n_k}: (0..{s}) · ({s}..{n_k}) against (0..{s})"),
        &merged,
        &only_left,
        &|i| hidden(i, s..n_k),
    )
}

fn check_split_result(
    engine: &dyn Engine,
    inputs: &HeadInputs,
    r: &Materialized,
    plan: &MergePlan,
    what: &str,
    merges: usize,
) -> Check {
    let res = split(engine, inputs, plan)?;
    let b = bound(engine, inputs, r, merges);
    compare_head(what, res.0.as_ref(), Some(&res.1), r, &b, &all_rows).map_err(fail)
}

pub(crate) fn merge_associativity(
    engine: &dyn Engine,
    (case, cut_points): (HeadCase, Vec<u16>),
) -> Check {
    let inputs = case.build(engine.storage());
    let n_k = inputs.k.nrows();
    let mut c = cuts(n_k, &cut_points);
    // Two cuts make three parts a, b, c.
    while c.len() < 4 {
        c.insert(1, c[1]);
    }
    let (x, y) = (c[1], c[c.len() - 2]);
    let (a, b, cc) = (
        MergePlan::keys(0..x),
        MergePlan::keys(x..y),
        MergePlan::keys(y..n_k),
    );
    let r = reference(&inputs);
    let left = MergePlan::merge(MergePlan::merge(a.clone(), b.clone()), cc.clone());
    let right = MergePlan::merge(a, MergePlan::merge(b, cc));
    check_split_result(
        engine,
        &inputs,
        &r,
        &left,
        &format!("(0..{x} · {x}..{y}) · {y}..{n_k}"),
        2,
    )?;
    check_split_result(
        engine,
        &inputs,
        &r,
        &right,
        &format!("0..{x} · ({x}..{y} · {y}..{n_k})"),
        2,
    )
}

pub(crate) fn split_keys(engine: &dyn Engine, (case, cut_points): (HeadCase, Vec<u16>)) -> Check {
    let inputs = case.build(engine.storage());
    let n_k = inputs.k.nrows();
    let c = cuts(n_k, &cut_points);
    let leaves: Vec<MergePlan> = c.windows(2).map(|w| MergePlan::keys(w[0]..w[1])).collect();
    let merges = leaves.len();
    let left_fold = leaves
        .iter()
        .cloned()
        .reduce(MergePlan::merge)
        .unwrap_or(MergePlan::Empty);
    let right_fold = leaves
        .iter()
        .rev()
        .cloned()
        .reduce(|acc, l| MergePlan::merge(l, acc))
        .unwrap_or(MergePlan::Empty);
    fn tree(l: &[MergePlan]) -> MergePlan {
        match l {
            [] => MergePlan::Empty,
            [x] => x.clone(),
            _ => MergePlan::merge(tree(&l[..l.len() / 2]), tree(&l[l.len() / 2..])),
        }
    }
    let r = reference(&inputs);
    for (name, plan) in [
        ("left fold", left_fold),
        ("right fold", right_fold),
        ("balanced tree", tree(&leaves)),
    ] {
        check_split_result(
            engine,
            &inputs,
            &r,
            &plan,
            &format!("keys cut at {c:?}, {name}"),
            merges,
        )?;
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------
// 8: determinism.

fn pools() -> &'static [rayon::ThreadPool; 3] {
    static POOLS: OnceLock<[rayon::ThreadPool; 3]> = OnceLock::new();
    POOLS.get_or_init(|| {
        [1, 2, 3].map(|t| {
            rayon::ThreadPoolBuilder::new()
                .num_threads(t)
                .build()
                .expect("a thread pool")
        })
    })
}

/// Larger shapes than the other properties (the engine alone runs them): lengths up to
/// twice the largest tile, plus a batched case.
pub(crate) fn determinism_case(shapes: &Shapes) -> BoxedStrategy<(HeadCase, BatchCase)> {
    let mut tiles = shapes.tiles.clone();
    tiles.extend(shapes.tiles.iter().map(|t| 2 * t));
    let big = Shapes {
        tiles,
        max_q: 2 * shapes.max_q,
        max_k: 2 * shapes.max_k + 1,
    };
    (head_case(&big), batch_case(&batch_shapes(shapes))).boxed()
}

fn bits(m: MatRef<'_, f32>) -> Vec<u32> {
    (0..m.nrows())
        .flat_map(|i| (0..m.ncols()).map(move |j| (i, j)))
        .map(|(i, j)| m[(i, j)].to_bits())
        .collect()
}

pub(crate) fn determinism(engine: &dyn Engine, (case, batch): (HeadCase, BatchCase)) -> Check {
    let inputs = case.build(engine.storage());
    let runs: Vec<_> = pools()
        .iter()
        .map(|pool| pool.install(|| run_head(engine, &inputs)))
        .collect::<Result<_, _>>()?;
    for (t, (o, l)) in runs.iter().enumerate().skip(1) {
        let lb = |l: &[f32]| l.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        if bits(o.as_ref()) != bits(runs[0].0.as_ref()) || lb(l) != lb(&runs[0].1) {
            let first = (0..o.nrows())
                .flat_map(|i| (0..o.ncols()).map(move |j| (i, j)))
                .find(|&(i, j)| o[(i, j)].to_bits() != runs[0].0[(i, j)].to_bits());
            return Err(fail(format!(
                "single head: {} threads give different bits than 1 thread (first at {first:?})",
                t + 1
            )));
        }
    }
    let inputs = batch.build(engine.storage());
    let opts = inputs.options();
    let runs: Vec<Tensor4<f32>> = pools()
        .iter()
        .map(|pool| {
            pool.install(|| {
                engine.attention_batched(inputs.q.view(), inputs.k.view(), inputs.v.view(), &opts)
            })
        })
        .collect::<Result<_, _>>()
        .map_err(|e| engine_err("batched call", e))?;
    for (t, out) in runs.iter().enumerate().skip(1) {
        let same = out.dims() == runs[0].dims()
            && out
                .as_slice()
                .iter()
                .zip(runs[0].as_slice())
                .all(|(a, b)| a.to_bits() == b.to_bits());
        if !same {
            return Err(fail(format!(
                "batched: {} threads give different bits than 1 thread",
                t + 1
            )));
        }
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------
// Malformed input.

/// One defect in an otherwise valid call.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Defect {
    /// K has one column too many.
    KeyWidth,
    /// V has one row too many.
    ValueRows,
    /// `d_k = 0`.
    ZeroKeyWidth,
    /// A non-finite or non-positive scale.
    Scale(f32),
    /// The additive mask has one row too many.
    AdditiveShape,
    /// The boolean mask has one column too many.
    BoolShape,
    /// Key padding longer than `n_k`.
    KeyLength,
    /// Batched: `h_q` not a multiple of `h_kv`.
    HeadGrouping,
    /// Batched: K has another batch size than Q.
    BatchSize,
    /// Batched: one key length too few.
    KeyLengthCount,
}

pub(crate) fn malformed_case() -> BoxedStrategy<(Defect, usize, usize, usize, usize)> {
    (
        select(vec![
            Defect::KeyWidth,
            Defect::ValueRows,
            Defect::ZeroKeyWidth,
            Defect::Scale(0.0),
            Defect::Scale(-1.0),
            Defect::Scale(f32::NAN),
            Defect::Scale(f32::INFINITY),
            Defect::AdditiveShape,
            Defect::BoolShape,
            Defect::KeyLength,
            Defect::HeadGrouping,
            Defect::BatchSize,
            Defect::KeyLengthCount,
        ]),
        0..=5usize,
        0..=5usize,
        1..=5usize,
        0..=4usize,
    )
        .boxed()
}

pub(crate) fn malformed_input(
    engine: &dyn Engine,
    (defect, n_q, n_k, d_k, d_v): (Defect, usize, usize, usize, usize),
) -> Check {
    let z = |r: usize, c: usize| Mat::<f32>::from_fn(r, c, |i, j| (i + 2 * j) as f32 * 0.25);
    let (mut q, mut k, mut v) = (z(n_q, d_k), z(n_k, d_k), z(n_k, d_v));
    let add = z(n_q + 1, n_k);
    let bits = Mat::<bool>::from_fn(n_q, n_k + 1, |i, j| (i + j) % 2 == 0);
    let mut opts = Options::default();
    let batched = matches!(
        defect,
        Defect::HeadGrouping | Defect::BatchSize | Defect::KeyLengthCount
    );
    match defect {
        Defect::KeyWidth => k = z(n_k, d_k + 1),
        Defect::ValueRows => v = z(n_k + 1, d_v),
        Defect::ZeroKeyWidth => {
            q = z(n_q, 0);
            k = z(n_k, 0);
        }
        Defect::Scale(s) => opts = opts.with_scale(s),
        Defect::AdditiveShape => opts = opts.with_additive_mask(add.as_ref()),
        Defect::BoolShape => opts = opts.with_bool_mask(BoolMask::block(bits.as_ref())),
        Defect::KeyLength => opts = opts.with_key_length(n_k + 1),
        Defect::HeadGrouping | Defect::BatchSize | Defect::KeyLengthCount => {}
    }
    let report = |e: Result<(), attn_core::Error>, r: Result<(), attn_core::Error>| -> Check {
        match (e, r) {
            (Err(e), Err(r)) if e.to_string() == r.to_string() => Ok(()),
            (e, r) => Err(fail(format!(
                "{defect:?}: the engine says {e:?}, the reference says {r:?}"
            ))),
        }
    };
    if !batched {
        let e = engine.attention_with_lse(q.as_ref(), k.as_ref(), v.as_ref(), &opts);
        let r = attn_reference::attention(q.as_ref(), k.as_ref(), v.as_ref(), &opts);
        return report(e.map(|_| ()), r.map(|_| ()));
    }
    let (batch, h_q, h_kv, kv_batch) = match defect {
        Defect::HeadGrouping => (2, 3, 2, 2),
        Defect::BatchSize => (2, 2, 1, 3),
        _ => (2, 2, 2, 2),
    };
    let lens = [n_k];
    if defect == Defect::KeyLengthCount {
        opts = opts.with_key_lengths(&lens);
    }
    let qd = vec![0.5f32; batch * h_q * n_q * d_k];
    let kd = vec![0.25f32; kv_batch * h_kv * n_k * d_k];
    let vd = vec![1.0f32; kv_batch * h_kv * n_k * d_v];
    let l = attn_core::Layout::Bhsd;
    let qt = Tensor4Ref::from_layout(&qd, [batch, h_q, n_q, d_k], l).expect("fits");
    let kt = Tensor4Ref::from_layout(&kd, [kv_batch, h_kv, n_k, d_k], l).expect("fits");
    let vt = Tensor4Ref::from_layout(&vd, [kv_batch, h_kv, n_k, d_v], l).expect("fits");
    let e = engine.attention_batched(qt, kt, vt, &opts);
    let r = attn_reference::attention_batched(qt, kt, vt, &opts);
    report(e.map(|_| ()), r.map(|_| ()))
}

//! The properties of the forward pass on ordinary inputs: the weights (1, 2), equivalence
//! with the reference (5), the invariances (6), partial states and their merge (7), and
//! determinism across thread counts (8). The √d_k statistics (4) are in [`crate::stats`].

use attn_core::{HeadMask, KeyPadding, Options, Tensor4};
use attn_reference::{Attention, Materialized};
use faer::{Mat, MatRef};
use proptest::prelude::*;
use proptest::sample::select;
use proptest::test_runner::TestCaseError;

use super::common::{
    Check, all_rows, batch_shapes, batched_call, bound, compare_head, engine_err, equivalent, fail,
    matches_reference, pools, reference, run_head, scale_of, sees_nothing, views,
};
use crate::Call;
use crate::bound::{HeadBound, head_bound_with};
use crate::case::{
    BatchCase, BatchInputs, Bias, HeadCase, HeadInputs, HeadSlot, Rng, Shapes, batch_case,
    elementwise_masks, head_case, head_case_with, masks, ordinary_values,
};
use crate::engine::required;
use crate::suite::record_tightness;
use crate::{Engine, MergePlan};

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
    // A sink takes its share p_sink = exp(σ − LSE) of every row that sees a key.
    let sink = inputs.score_mods().sink;
    for i in 0..o.nrows() {
        if sees_nothing(&r, i) {
            continue; // exactly 0, checked by `equivalent`
        }
        let target = 1.0 - sink.map_or(0.0, |s| (s - r.lse[i]).exp());
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
        let err = (sum - target).abs();
        record_tightness(err, b.row_sum[i]);
        if err > b.row_sum[i] {
            return Err(fail(format!(
                "row {i} of the weights sums to {sum:.9}, not {target:.9} (|error| = {err:.3e} > derived bound {:.3e})",
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
// 5: equivalence.

pub(crate) fn equivalence(engine: &dyn Engine, case: HeadCase) -> Check {
    matches_reference(engine, &case, "single head")
}

fn batch_reference(inputs: &BatchInputs) -> Vec<Vec<Materialized>> {
    Attention::batched(
        inputs.q.view(),
        inputs.k.view(),
        inputs.v.view(),
        &inputs.options(),
    )
    .and_then(|call| call.materialized())
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
    head_bound_with(
        &engine.error_model(),
        inputs.q.view().head(b, h).expect("in range"),
        inputs.k.view().head(b, kv).expect("in range"),
        inputs.v.view().head(b, kv).expect("in range"),
        scale_of(&opts, d_k),
        opts.additive_mask,
        &inputs.score_mods(b, h),
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
    let (out, _) = batched_call(engine, &inputs)?;
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

/// Two problems with the same exact output: each within its bound of the reference, and
/// the two outputs within the sum of their bounds of each other. Returns each one's LSE
/// and bound.
fn same_output(
    engine: &dyn Engine,
    problems: [(&HeadInputs, &str); 2],
    what: &str,
) -> Result<[(Vec<f32>, HeadBound); 2], TestCaseError> {
    let [(a, what_a), (b, what_b)] = problems;
    let (o0, l0, _, bd0) = equivalent(engine, a, what_a)?;
    let (o1, l1, _, bd1) = equivalent(engine, b, what_b)?;
    close(what, o0.as_ref(), o1.as_ref(), &|i, j| {
        bd0.output[(i, j)] + bd1.output[(i, j)]
    })?;
    Ok([(l0, bd0), (l1, bd1)])
}

/// A case with grid-valued additive biases (or none) and a seed for the row constants; no
/// sinks (a sink does not move with the row).
pub(crate) fn shift_case(shapes: &Shapes) -> BoxedStrategy<(HeadCase, u64)> {
    (
        head_case_with(
            shapes,
            ordinary_values(),
            ordinary_values(),
            masks(vec![0.5, 1.0, 2.0], vec![Bias::Grid]),
        )
        .prop_map(without_sinks),
        any::<u64>(),
    )
        .boxed()
}

fn without_sinks(mut case: HeadCase) -> HeadCase {
    case.masks.modifiers.sinks = None;
    case
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
    let [(l0, bd0), (l1, bd1)] = same_output(
        engine,
        [(&base, "unshifted"), (&shifted, "shifted")],
        "adding a constant to each row of scores",
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
    let [(l0, bd0), (l1, bd1)] = same_output(
        engine,
        [(&base, "original order"), (&p, "permuted keys")],
        "permuting keys and values",
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
    let out = required(
        Call::batched(inputs.q.view(), inputs.k.view(), inputs.v.view(), &opts)
            .forward_batch(engine),
    )
    .map(|(t, _)| t)
    .map_err(|e| engine_err("batched call", e))?;
    let refs = batch_reference(&inputs);
    check_batched_output(engine, &inputs, &out, &refs)?;
    let [batch, h_q, _, _] = inputs.q.dims;
    let h_kv = inputs.k.dims[1];
    for (b, per_head) in refs.iter().enumerate().take(batch) {
        let mut base = opts;
        base.key_padding = opts.key_length(b).map(KeyPadding::Uniform);
        for (h, r) in per_head.iter().enumerate().take(h_q) {
            // The head's own slope and sink, the user's modifiers asked about (b, h).
            let slot = HeadSlot::new(&opts, b, h, h_q);
            let single = slot.apply(base);
            let kv = h / (h_q / h_kv);
            let (q, k, v) = (
                inputs.q.view().head(b, h).expect("in range"),
                inputs.k.view().head(b, kv).expect("in range"),
                inputs.v.view().head(b, kv).expect("in range"),
            );
            let (o, lse) = required(Call::head(q, k, v, &single).forward_head(engine))
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
    Call::head(z.as_ref(), z.as_ref(), z.as_ref(), &opts)
        .split(&MergePlan::keys(0..1))
        .forward_head(engine)
        .is_some()
}

/// A head case and cut points in per-mille of `n_k`.
type SplitCase = (HeadCase, Vec<u16>);

/// No sinks: a partial state over some keys has no sink (it joins the merged state once,
/// `PartialState::sink`), which the plans of [`MergePlan`] do not express.
pub(crate) fn split_case(shapes: &Shapes) -> BoxedStrategy<SplitCase> {
    (
        head_case(shapes).prop_map(without_sinks),
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
    let (q, k, v) = views(inputs);
    Call::head(q, k, v, &inputs.options())
        .split(plan)
        .forward_head(engine)
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

pub(crate) fn merge_identity(engine: &dyn Engine, (case, cut_points): SplitCase) -> Check {
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

pub(crate) fn merge_associativity(engine: &dyn Engine, (case, cut_points): SplitCase) -> Check {
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

pub(crate) fn split_keys(engine: &dyn Engine, (case, cut_points): SplitCase) -> Check {
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
                required(
                    Call::batched(inputs.q.view(), inputs.k.view(), inputs.v.view(), &opts)
                        .forward_batch(engine),
                )
                .map(|(t, _)| t)
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

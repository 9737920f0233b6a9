//! What every property module uses: the check result, the shapes an engine is tested on,
//! the reference and its bound for one head, the comparison of a head with them, the
//! cases whose rows see no key, and the thread pools of the thread-count properties.

use std::sync::OnceLock;

use attn_core::{Causal, Options, SlidingWindow, Tensor4};
use attn_reference::{Attention, Materialized};
use faer::{Mat, MatRef};
use proptest::prelude::*;
use proptest::sample::select;
use proptest::test_runner::TestCaseError;

use crate::Call;
use crate::bound::{BatchGradientBound, HeadBound, head_bound_with};
use crate::case::{
    AdditiveRecipe, BatchInputs, Bias, BoolRecipe, HeadCase, HeadInputs, Shapes, head_case,
};
use crate::engine::required;
use crate::suite::record_tightness;
use crate::{Dtype, Engine};

pub(crate) type Check = Result<(), TestCaseError>;

pub(crate) fn fail(msg: impl Into<String>) -> TestCaseError {
    TestCaseError::fail(msg.into())
}

pub(crate) fn engine_err(what: &str, e: attn_core::Error) -> TestCaseError {
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

/// The operands of a head as views: `(q, k, v)`.
pub(crate) fn views(inputs: &HeadInputs) -> (MatRef<'_, f32>, MatRef<'_, f32>, MatRef<'_, f32>) {
    (inputs.q.as_ref(), inputs.k.as_ref(), inputs.v.as_ref())
}

pub(crate) fn reference(inputs: &HeadInputs) -> Materialized {
    let (q, k, v) = views(inputs);
    Attention::head(q, k, v, &inputs.options())
        .and_then(|call| call.materialized())
        .expect("generated inputs are valid")
}

pub(crate) fn scale_of(options: &Options<'_>, d_k: usize) -> f64 {
    options
        .scale_for_f64(d_k)
        .expect("generated scales are valid")
}

pub(crate) fn bound(
    engine: &dyn Engine,
    inputs: &HeadInputs,
    r: &Materialized,
    merges: usize,
) -> HeadBound {
    let opts = inputs.options();
    let (q, k, v) = views(inputs);
    head_bound_with(
        &engine.error_model(),
        q,
        k,
        v,
        scale_of(&opts, q.ncols()),
        opts.additive_mask,
        &inputs.score_mods(),
        r,
        merges,
    )
}

/// Whether row `i` of the reference sees no key (its LSE is then `-inf`, or its sink's).
pub(crate) fn sees_nothing(r: &Materialized, i: usize) -> bool {
    (0..r.scores.ncols()).all(|j| r.scores[(i, j)] == f64::NEG_INFINITY)
}

/// Compares an engine's output (and LSE) with the reference, row by row where `rows`
/// says so: a row with no visible key must be exactly 0 with the reference's LSE exactly
/// (`-inf`, or the sink logit of its head), every other row finite and within the bound
/// `b`. Returns a description of the first violation.
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
        if sees_nothing(r, i) {
            if let Some(c) = (0..d_v).find(|&c| o[(i, c)] != 0.0) {
                return Err(format!(
                    "{what}: row {i} has no visible key, so its output must be exactly 0, \
                     but output[{i}, {c}] = {:e}",
                    o[(i, c)]
                ));
            }
            // -inf, or the head's sink logit (an f32, exactly).
            let want = r.lse[i] as f32;
            if let Some(l) = lse
                && l[i].to_bits() != want.to_bits()
            {
                return Err(format!(
                    "{what}: row {i} has no visible key, so its LSE must be {want:e} \
                     (-inf, or the sink logit), not {:e}",
                    l[i]
                ));
            }
            continue;
        }
        for c in 0..d_v {
            let (e, x, bd) = (f64::from(o[(i, c)]), r.output[(i, c)], b.output[(i, c)]);
            if let Some(err) = violation(e, x, bd) {
                return Err(format!(
                    "{what}: output[{i}, {c}] = {e:e} but the reference says {x:e}: \
                     |error| = {err:.3e} exceeds the derived bound {bd:.3e}"
                ));
            }
        }
        if let Some(l) = lse {
            let (e, x, bd) = (f64::from(l[i]), r.lse[i], b.lse[i]);
            if let Some(err) = violation(e, x, bd) {
                return Err(format!(
                    "{what}: LSE[{i}] = {e:e} but the reference says {x:e}: \
                     |error| = {err:.3e} exceeds the derived bound {bd:.3e}"
                ));
            }
        }
    }
    Ok(())
}

/// `|e − x|` if the engine's value `e` is not finite or further than `bd` from the
/// reference's `x`; `None` if it is within the bound or `x` itself is NaN (no claim).
fn violation(e: f64, x: f64, bd: f64) -> Option<f64> {
    if x.is_nan() {
        return None;
    }
    let err = (e - x).abs();
    record_tightness(err, bd);
    (!e.is_finite() || err > bd).then_some(err)
}

pub(crate) fn all_rows(_: usize) -> bool {
    true
}

pub(crate) fn run_head(
    engine: &dyn Engine,
    inputs: &HeadInputs,
) -> Result<(Mat<f32>, Vec<f32>), TestCaseError> {
    let (q, k, v) = views(inputs);
    required(Call::head(q, k, v, &inputs.options()).forward_head(engine))
        .map_err(|e| engine_err("single-head call", e))
}

/// The engine's batched call over `inputs` (output and LSE in `[batch][h_q][n_q]` order).
pub(crate) fn batched_call(
    engine: &dyn Engine,
    inputs: &BatchInputs,
) -> Result<(Tensor4<f32>, Vec<f32>), TestCaseError> {
    let (q, k, v) = (inputs.q.view(), inputs.k.view(), inputs.v.view());
    required(Call::batched(q, k, v, &inputs.options()).forward_batch(engine))
        .map_err(|e| engine_err("batched call", e))
}

/// Runs one head and checks it against the reference; returns the engine's result.
pub(crate) fn equivalent(
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

/// Builds `case` for the engine's storage type and checks the head against the reference
/// (properties 5 and 9, on different cases).
pub(crate) fn matches_reference(engine: &dyn Engine, case: &HeadCase, what: &str) -> Check {
    equivalent(engine, &case.build(engine.storage()), what).map(|_| ())
}

// ---------------------------------------------------------------------------------------
// Rows with no visible key (the forward's and the backward's property 3).

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
                    let mut b = c.masks.bool_mask.unwrap_or(BoolRecipe {
                        allow: true,
                        visible_percent: 70,
                        hidden_rows_percent: 0,
                    });
                    b.hidden_rows_percent = b.hidden_rows_percent.max(30);
                    c.masks.bool_mask = Some(b);
                }
                RowHider::AdditiveRows => {
                    let mut a = c.masks.additive.unwrap_or(AdditiveRecipe {
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

/// Builds a [`masked_rows_case`] for `dtype`, with row 0 hidden by the element-wise masks
/// that were asked to hide rows (the recipe's percentages may have missed it).
pub(crate) fn masked_rows_inputs(case: &HeadCase, hider: RowHider, dtype: Dtype) -> HeadInputs {
    let mut inputs = case.build(dtype);
    let n_k = inputs.k.nrows();
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
    inputs
}

// ---------------------------------------------------------------------------------------
// Thread counts (the forward's and the backward's property 8).

/// Rayon pools of 1, 2 and 3 threads, built once.
pub(crate) fn pools() -> &'static [rayon::ThreadPool; 3] {
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

// ---------------------------------------------------------------------------------------
// Gradients.

/// Compares one gradient with the reference entry by entry, on the rows `rows` selects:
/// an entry with bound 0 (a query that sees no key, a key no query sees) must be exactly
/// 0, every other entry finite and within its bound.
pub(crate) fn compare_matrix(
    what: &str,
    name: &str,
    e: MatRef<'_, f32>,
    x: MatRef<'_, f64>,
    bd: MatRef<'_, f64>,
    rows: &dyn Fn(usize) -> bool,
) -> Result<(), String> {
    if (e.nrows(), e.ncols()) != (x.nrows(), x.ncols()) {
        return Err(format!(
            "{what}: {name} is {}×{} but must be {}×{}",
            e.nrows(),
            e.ncols(),
            x.nrows(),
            x.ncols()
        ));
    }
    for i in (0..x.nrows()).filter(|&i| rows(i)) {
        for c in 0..x.ncols() {
            let (g, r, b) = (f64::from(e[(i, c)]), x[(i, c)], bd[(i, c)]);
            if b == 0.0 {
                if g != 0.0 {
                    return Err(format!(
                        "{what}: {name}[{i}, {c}] = {g:e} but must be exactly 0 (its row sees \
                         no key, or its key is seen by no query)"
                    ));
                }
                continue;
            }
            let err = (g - r).abs();
            record_tightness(err, b);
            if !g.is_finite() || err > b {
                return Err(format!(
                    "{what}: {name}[{i}, {c}] = {g:e} but the reference says {r:e}: \
                     |error| = {err:.3e} exceeds the derived bound {b:.3e}"
                ));
            }
        }
    }
    Ok(())
}

/// Every gradient of a batched result against the reference (dK, dV against its group's
/// sums, in f64), within the bound.
pub(crate) fn compare_batched_gradients(
    what: &str,
    g: &crate::BatchGradients,
    reference: &[Vec<attn_reference::MaterializedBackward>],
    bound: &BatchGradientBound,
    h_kv: usize,
) -> Check {
    fn head(t: &Tensor4<f32>, b: usize, h: usize) -> Result<MatRef<'_, f32>, TestCaseError> {
        t.as_ref().head(b, h).map_err(|e| fail(e.to_string()))
    }
    for (b, heads) in reference.iter().enumerate() {
        for (h, r) in heads.iter().enumerate() {
            let at = format!("{what}, batch entry {b}, query head {h}");
            compare_matrix(
                &at,
                "dQ",
                head(&g.dq, b, h)?,
                r.dq.as_ref(),
                bound.dq[b][h].as_ref(),
                &all_rows,
            )
            .map_err(fail)?;
        }
        let group = heads.len() / h_kv.max(1);
        for kv in 0..h_kv {
            let members = &heads[kv * group..(kv + 1) * group];
            let (mut dk, mut dv) = (members[0].dk.clone(), members[0].dv.clone());
            for r in &members[1..] {
                dk += &r.dk;
                dv += &r.dv;
            }
            let at = format!("{what}, batch entry {b}, kv head {kv}");
            let (gk, gv) = (head(&g.dk, b, kv)?, head(&g.dv, b, kv)?);
            compare_matrix(
                &at,
                "dK",
                gk,
                dk.as_ref(),
                bound.dk[b][kv].as_ref(),
                &all_rows,
            )
            .and_then(|()| {
                compare_matrix(
                    &at,
                    "dV",
                    gv,
                    dv.as_ref(),
                    bound.dv[b][kv].as_ref(),
                    &all_rows,
                )
            })
            .map_err(fail)?;
        }
    }
    Ok(())
}

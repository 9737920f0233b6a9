//! The properties of the score modifiers, forward pass: a soft-cap bounds the
//! scores; a zero ALiBi slope and a `-inf` sink are exactly nothing; a sink takes its share
//! `p_sink = exp(σ − LSE)` of every row, and a row that sees nothing has output 0 and LSE
//! `σ`; a user score modifier re-implementing the soft-cap and a user mask re-implementing
//! causal top-left are the built-ins (bit for bit where the engine says its tiles coincide,
//! within the bound otherwise), and the user mask's hidden blocks are skipped.
//!
//! The generated cases of every other forward property draw modifiers too (`case/strategy.rs`);
//! these check what only a targeted case can.

use core::ops::Range;
use std::sync::Mutex;

use attn_core::{Causal, MaskMod, Options, ScoreMod, SoftCap, Tensor4, TileCoverage};
use faer::{Mat, MatRef};
use proptest::prelude::*;
use proptest::sample::select;
use proptest::test_runner::TestCaseError;

use super::common::{
    Check, RowHider, all_rows, batch_shapes, bound, compare_head, engine_err, equivalent, fail,
    masked_rows_case, masked_rows_inputs, reference, run_head, sees_nothing, views,
};
use crate::Call;
use crate::Engine;
use crate::bound::{SAFETY, ScoreMods, U64, UserModBound, gamma, head_bound_with};
use crate::case::{
    AlibiRecipe, BatchCase, HeadCase, ModRecipe, Shapes, Sinks, Slopes, batch_case, head_case,
};
use crate::engine::required;
use crate::user_mods::TopLeftMask;
use crate::user_mods::UserSoftCap;

fn bits(m: MatRef<'_, f32>) -> Vec<u32> {
    (0..m.nrows())
        .flat_map(|i| (0..m.ncols()).map(move |c| m[(i, c)].to_bits()))
        .collect()
}

fn lse_bits(l: &[f32]) -> Vec<u32> {
    l.iter().map(|x| x.to_bits()).collect()
}

/// Two single-head results that must be the same bits.
fn same_head_bits(what: &str, a: &(Mat<f32>, Vec<f32>), b: &(Mat<f32>, Vec<f32>)) -> Check {
    let (oa, ob) = (bits(a.0.as_ref()), bits(b.0.as_ref()));
    if let Some(e) = oa.iter().zip(&ob).position(|(x, y)| x != y) {
        let c = a.0.ncols().max(1);
        return Err(fail(format!(
            "{what}: output[{}, {}] is {:e} one way and {:e} the other",
            e / c,
            e % c,
            f32::from_bits(oa[e]),
            f32::from_bits(ob[e])
        )));
    }
    if oa.len() != ob.len() || lse_bits(&a.1) != lse_bits(&b.1) {
        return Err(fail(format!("{what}: the LSE bits (or shapes) differ")));
    }
    Ok(())
}

fn same_tensor_bits(what: &str, a: &Tensor4<f32>, b: &Tensor4<f32>) -> Check {
    let same = a.dims() == b.dims()
        && a.as_slice()
            .iter()
            .zip(b.as_slice())
            .all(|(x, y)| x.to_bits() == y.to_bits());
    if same {
        Ok(())
    } else {
        Err(fail(format!("{what}: batched output bits differ")))
    }
}

fn run_batched(
    engine: &dyn Engine,
    case: &BatchCase,
    edit: impl Fn(&mut ModRecipe),
) -> Result<Tensor4<f32>, TestCaseError> {
    let mut c = case.clone();
    edit(&mut c.head.masks.modifiers);
    let x = c.build(engine.storage());
    required(Call::batched(x.q.view(), x.k.view(), x.v.view(), &x.options()).forward_batch(engine))
        .map(|(t, _)| t)
        .map_err(|e| engine_err("batched call", e))
}

fn run_single(
    engine: &dyn Engine,
    case: &HeadCase,
    edit: impl Fn(&mut ModRecipe),
) -> Result<(Mat<f32>, Vec<f32>), TestCaseError> {
    let mut c = *case;
    edit(&mut c.masks.modifiers);
    run_head(engine, &c.build(engine.storage()))
}

// ---------------------------------------------------------------------------------------
// Soft-cap.

/// A case with a soft-cap and nothing that moves a score after it (no ALiBi, user score
/// modifier or additive mask); V is replaced by the identity.
pub(crate) fn softcap_case(shapes: &Shapes) -> BoxedStrategy<(HeadCase, f32)> {
    let s = Shapes {
        max_k: shapes.max_k.min(513),
        ..shapes.clone()
    };
    (
        head_case(&s),
        prop_oneof![select(vec![0.5f32, 1.0, 4.0, 30.0]), 0.5f32..=50.0],
    )
        .prop_map(|(mut c, cap)| {
            let m = &mut c.masks.modifiers;
            m.softcap = Some(cap.max(0.5));
            m.alibi = None;
            m.score_mod = None;
            c.masks.additive = None;
            (c, cap.max(0.5))
        })
        .boxed()
}

pub(crate) fn softcap_bounds_scores(engine: &dyn Engine, (case, cap): (HeadCase, f32)) -> Check {
    let mut inputs = case.build(engine.storage());
    let n_k = inputs.k.nrows();
    inputs.v = Mat::from_fn(n_k, n_k, |i, j| if i == j { 1.0 } else { 0.0 });
    let (o, lse, r, b) = equivalent(engine, &inputs, "soft-capped weights (V = I)")?;
    let c = f64::from(cap);
    let sink = inputs.score_mods().sink;
    for i in 0..r.scores.nrows() {
        let visible: Vec<usize> = (0..n_k)
            .filter(|&j| r.scores[(i, j)] != f64::NEG_INFINITY)
            .collect();
        if let Some(&j) = visible.iter().find(|&&j| r.scores[(i, j)].abs() > c) {
            return Err(fail(format!(
                "the reference's soft-capped score [{i}, {j}] is {:e}, beyond the cap {c}",
                r.scores[(i, j)]
            )));
        }
        if visible.is_empty() {
            continue;
        }
        // The LSE of scores in [−c, c] (and the sink): within [ln(n·e^−c + e^σ), ln(n·e^c + e^σ)].
        let n = visible.len() as f64;
        let with_sink = |x: f64| sink.map_or(x, |s| x.max(s) + (-(x - s).abs()).exp().ln_1p());
        let (lo, hi) = (with_sink(n.ln() - c), with_sink(n.ln() + c));
        let l = f64::from(lse[i]);
        if !(lo - b.lse[i]..=hi + b.lse[i]).contains(&l) {
            return Err(fail(format!(
                "row {i}: LSE {l:e} outside [{lo:e}, {hi:e}] (± {:.1e}), the range of {n} scores capped at {c}",
                b.lse[i]
            )));
        }
        // Any two visible weights are within e^{2c} of each other, up to their bounds.
        let (jmax, wmax) = visible
            .iter()
            .map(|&j| (j, f64::from(o[(i, j)])))
            .fold((0, f64::NEG_INFINITY), |a, x| if x.1 > a.1 { x } else { a });
        let ratio = (-2.0 * c).exp();
        for &j in &visible {
            let floor = ratio * (wmax - b.output[(i, jmax)]) - b.output[(i, j)];
            if f64::from(o[(i, j)]) < floor {
                return Err(fail(format!(
                    "row {i}: weight {j} is {:e} but the largest ({jmax}) is {wmax:e}: scores \
                     capped at {c} cannot be {:.1} apart",
                    o[(i, j)],
                    (wmax / f64::from(o[(i, j)])).ln()
                )));
            }
        }
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------
// Identities: zero slopes, -inf sinks.

/// A single-head and a batched case, the ALiBi alignment and whether the slopes are per
/// (batch entry, head).
pub(crate) fn identity_case(shapes: &Shapes) -> BoxedStrategy<(HeadCase, BatchCase, Causal, bool)> {
    (
        head_case(shapes),
        batch_case(&batch_shapes(shapes)),
        select(vec![Causal::TopLeft, Causal::BottomRight]),
        any::<bool>(),
    )
        .boxed()
}

pub(crate) fn zero_slopes(
    engine: &dyn Engine,
    (case, batch, align, per_batch): (HeadCase, BatchCase, Causal, bool),
) -> Check {
    let zero = |m: &mut ModRecipe| {
        m.alibi = Some(AlibiRecipe {
            slopes: Slopes::Zero,
            per_batch,
            align,
        })
    };
    let none = |m: &mut ModRecipe| m.alibi = None;
    same_head_bits(
        "zero ALiBi slopes against none",
        &run_single(engine, &case, zero)?,
        &run_single(engine, &case, none)?,
    )?;
    same_tensor_bits(
        "zero ALiBi slopes against none",
        &run_batched(engine, &batch, zero)?,
        &run_batched(engine, &batch, none)?,
    )
}

pub(crate) fn neg_inf_sinks(
    engine: &dyn Engine,
    (case, batch, _, _): (HeadCase, BatchCase, Causal, bool),
) -> Check {
    let neg_inf = |m: &mut ModRecipe| m.sinks = Some(Sinks::None);
    let none = |m: &mut ModRecipe| m.sinks = None;
    same_head_bits(
        "-inf sinks against none",
        &run_single(engine, &case, neg_inf)?,
        &run_single(engine, &case, none)?,
    )?;
    same_tensor_bits(
        "-inf sinks against none",
        &run_batched(engine, &batch, neg_inf)?,
        &run_batched(engine, &batch, none)?,
    )
}

// ---------------------------------------------------------------------------------------
// The sink's share.

/// A case with a finite sink and rows that see no key.
pub(crate) fn sink_case(shapes: &Shapes) -> BoxedStrategy<((HeadCase, RowHider), bool)> {
    (masked_rows_case(shapes), any::<bool>())
        .prop_map(|((mut c, h), wide)| {
            c.masks.modifiers.sinks = Some(if wide { Sinks::Wide } else { Sinks::Small });
            ((c, h), wide)
        })
        .boxed()
}

pub(crate) fn sink_share(
    engine: &dyn Engine,
    ((case, hider), _): ((HeadCase, RowHider), bool),
) -> Check {
    let inputs = masked_rows_inputs(&case, hider, engine.storage());
    let sink = inputs
        .score_mods()
        .sink
        .ok_or_else(|| fail("oracle bug: no finite sink"))?;
    let (o, lse, r, _) = equivalent(engine, &inputs, "a head with a sink")?;
    let n_k = r.scores.ncols();
    for i in 0..r.scores.nrows() {
        if sees_nothing(&r, i) {
            // The sink alone: output 0, LSE σ exactly (in the reference and the engine).
            if r.lse[i] != sink || lse[i] as f64 != sink {
                return Err(fail(format!(
                    "row {i} sees no key: its LSE must be the sink {sink:e}, not {:e} \
                     (reference {:e})",
                    lse[i], r.lse[i]
                )));
            }
            if let Some(c) = (0..o.ncols()).find(|&c| o[(i, c)] != 0.0) {
                return Err(fail(format!(
                    "row {i} sees no key, so its output must be 0, not {:e} at column {c}",
                    o[(i, c)]
                )));
            }
            continue;
        }
        // The reference's weights sum to 1 − p_sink: each within a few f64 roundings (exp,
        // the shift by the maximum, the division), their sum n_k more; p_sink recomputed
        // here from the rounded LSE (u·|LSE|) and σ − LSE.
        let sum: f64 = (0..n_k).map(|j| r.weights[(i, j)]).sum();
        let p_sink = (sink - r.lse[i]).exp();
        let tol = SAFETY
            * (gamma(n_k as f64 + 4.0, U64)
                + 4.0 * U64 * (sink.abs() + r.lse[i].abs() + 1.0) * p_sink);
        if (sum - (1.0 - p_sink)).abs() > tol {
            return Err(fail(format!(
                "row {i}: the reference's weights sum to {sum:.17}, not 1 − p_sink = {:.17} \
                 (p_sink = {p_sink:e}, tolerance {tol:.1e})",
                1.0 - p_sink
            )));
        }
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------
// A user score modifier re-implementing the soft-cap.

/// A single-head and a batched case and a cap; without soft-cap, user score modifier and
/// ALiBi (which the built-in soft-cap precedes and a user's modifier follows).
pub(crate) fn user_cap_case(shapes: &Shapes) -> BoxedStrategy<(HeadCase, BatchCase, f32)> {
    (
        head_case(shapes),
        batch_case(&batch_shapes(shapes)),
        prop_oneof![select(vec![0.5f32, 2.0, 10.0, 50.0]), 0.5f32..=50.0],
    )
        .prop_map(|(mut c, mut b, cap)| {
            for m in [&mut c.masks.modifiers, &mut b.head.masks.modifiers] {
                m.softcap = None;
                m.score_mod = None;
                m.alibi = None;
            }
            (c, b, cap.max(0.5))
        })
        .boxed()
}

fn with_user<'a>(o: Options<'a>, m: &'a dyn ScoreMod) -> Options<'a> {
    o.with_score_mod(m)
}

pub(crate) fn user_softcap(
    engine: &dyn Engine,
    (case, batch, cap): (HeadCase, BatchCase, f32),
) -> Check {
    let c = SoftCap::new(cap).expect("a valid cap");
    let user = UserSoftCap(c);
    let inputs = case.build(engine.storage());
    let (q, k, v) = views(&inputs);
    let builtin_opts = inputs.options().with_softcap(c);
    let user_opts = with_user(inputs.options(), &user);
    let run = |o: &Options<'_>| {
        required(Call::head(q, k, v, o).forward_head(engine))
            .map_err(|e| engine_err("single-head call", e))
    };
    let (builtin, mine) = (run(&builtin_opts)?, run(&user_opts)?);
    // Both within the bound of the built-in's reference: the exact results agree, and the
    // user's modifier is held to its own (f32) error model.
    let r = attn_reference::Attention::head(q, k, v, &builtin_opts)
        .and_then(|call| call.materialized())
        .expect("generated inputs are valid");
    let mods = ScoreMods {
        user: Some(UserModBound {
            lipschitz: 1.0,
            offset: 0.0,
            roundings: 9.0,
            cap: Some(f64::from(cap)),
        }),
        softcap: None,
        ..inputs.score_mods()
    };
    let scale = super::common::scale_of(&builtin_opts, q.ncols());
    let b = head_bound_with(
        &engine.error_model(),
        q,
        k,
        v,
        scale,
        builtin_opts.additive_mask,
        &mods,
        &r,
        0,
    );
    compare_head(
        "a user soft-cap",
        mine.0.as_ref(),
        Some(&mine.1),
        &r,
        &b,
        &all_rows,
    )
    .map_err(fail)?;
    if !engine.user_score_mod_bits_match_builtins() {
        return Ok(());
    }
    same_head_bits("a user soft-cap against the built-in", &mine, &builtin)?;
    let x = batch.build(engine.storage());
    let run = |o: &Options<'_>| {
        required(Call::batched(x.q.view(), x.k.view(), x.v.view(), o).forward_batch(engine))
            .map(|(t, _)| t)
            .map_err(|e| engine_err("batched call", e))
    };
    same_tensor_bits(
        "a user soft-cap against the built-in",
        &run(&with_user(x.options(), &user))?,
        &run(&x.options().with_softcap(c))?,
    )
}

// ---------------------------------------------------------------------------------------
// A user mask re-implementing causal top-left.

/// [`TopLeftMask`] that records the blocks it answers `Hidden` for, and whether an entry
/// of one of them was asked about afterwards: a hidden block that was not skipped.
#[derive(Debug, Default)]
struct Watched {
    hidden: Mutex<Vec<(Range<usize>, Range<usize>)>>,
    unskipped: Mutex<Option<(usize, usize)>>,
}

impl MaskMod for Watched {
    fn visible(&self, b: usize, h: usize, i: usize, j: usize) -> bool {
        let hidden = self.hidden.lock().expect("not poisoned");
        if hidden.iter().any(|(q, k)| q.contains(&i) && k.contains(&j)) {
            self.unskipped
                .lock()
                .expect("not poisoned")
                .get_or_insert((i, j));
        }
        TopLeftMask.visible(b, h, i, j)
    }

    fn coverage(&self, b: usize, h: usize, q: Range<usize>, k: Range<usize>) -> TileCoverage {
        let c = TopLeftMask.coverage(b, h, q.clone(), k.clone());
        if c == TileCoverage::Hidden {
            self.hidden.lock().expect("not poisoned").push((q, k));
        }
        c
    }
}

/// A single-head case (its causal constraint and user mask replaced).
pub(crate) fn user_causal_case(shapes: &Shapes) -> BoxedStrategy<HeadCase> {
    head_case(shapes)
        .prop_map(|mut c| {
            c.masks.causal = None;
            c.masks.modifiers.mask_mod = None;
            c
        })
        .boxed()
}

pub(crate) fn user_causal(engine: &dyn Engine, case: HeadCase) -> Check {
    let inputs = case.build(engine.storage());
    let [n_q, n_k, _, _] = inputs.dims();
    let (q, k, v) = views(&inputs);
    let structural = inputs.options().with_causal(Causal::TopLeft);
    let watched = Watched::default();
    let user = inputs.options().with_mask_mod(&watched);
    let run = |o: &Options<'_>| {
        required(Call::head(q, k, v, o).forward_head(engine))
            .map_err(|e| engine_err("single-head call", e))
    };
    let (a, b) = (run(&structural)?, run(&user)?);
    if let Some((i, j)) = *watched.unskipped.lock().expect("not poisoned") {
        return Err(fail(format!(
            "the user's mask said a block holding (query {i}, key {j}) was hidden, and the \
             engine asked about that entry anyway: the block was not skipped"
        )));
    }
    if engine.user_mask_mod_bits_match_structural(n_q, n_k) {
        return same_head_bits("a user causal mask against Causal::TopLeft", &b, &a);
    }
    // Otherwise the same visible keys: both within the bound of one reference.
    let mut causal = inputs.clone();
    causal.recipe.causal = Some(Causal::TopLeft);
    let r = reference(&causal);
    let bd = bound(engine, &causal, &r, 0);
    compare_head(
        "a user causal mask",
        b.0.as_ref(),
        Some(&b.1),
        &r,
        &bd,
        &all_rows,
    )
    .map_err(fail)
}

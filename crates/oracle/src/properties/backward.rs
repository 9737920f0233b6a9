//! The properties of the backward pass, for engines whose
//! [`Engine::backward`] of a head call (and, for the batched ones, of a batched call)
//! returns `Some`: gradients within the derived bound of the f64 reference, the zero row
//! sums of the score gradient, hidden keys and empty rows exactly 0, grouped-query
//! gradients as sums over the group, exact scaling in the upstream gradient, and bits
//! independent of the thread count.
//!
//! Every check gives the engine's backward pass its own forward result (output and LSE
//! of a head call's [`Engine::forward`], per head for a batched call), as a training step
//! would, and first checks that forward against its bound: the backward bound rests on it.

use attn_core::{KeyPadding, Options, Tensor4, Tensor4Ref};
use attn_reference::{Attention, MaterializedBackward};
use faer::{Mat, MatRef};
use proptest::prelude::*;
use proptest::sample::select;
use proptest::test_runner::TestCaseError;

use super::common::{
    Check, RowHider, all_rows, batched_call, compare_head, compare_matrix, engine_err, fail,
    masked_rows_case, masked_rows_inputs, pools, run_head, scale_of, views,
};
use crate::Call;
use crate::bound::{
    BatchGradientBound, GradientBound, SAFETY, U64, batch_backward_bound, gamma,
    head_backward_bound,
};
use crate::case::{
    BatchCase, BatchInputs, Bias, HeadCase, HeadInputs, OwnedTensor, Rng, Shapes, TensorLayout,
    Values, batch_case, batch_for_backward, for_backward, head_case, head_case_with, masks,
    operand, ordinary_values,
};
use crate::engine::required;
use crate::suite::record_tightness;
use crate::{BatchGradients, Dtype, Engine, Gradients};

// ---------------------------------------------------------------------------------------
// Support, shapes, recipes.

/// Whether the engine has a single-head backward pass (asked on a 1×1 problem).
pub(crate) fn supports_backward(engine: &dyn Engine) -> bool {
    let z = Mat::<f32>::zeros(1, 1);
    let z = z.as_ref();
    Call::head(z, z, z, &Options::default())
        .backward_head(engine, z, z, &[0.0])
        .is_some()
}

/// Whether the engine has a batched backward pass (asked on a 1×1×1×1 problem).
pub(crate) fn supports_backward_batched(engine: &dyn Engine) -> bool {
    let z = Tensor4::<f32>::zeros([1, 1, 1, 1]);
    let z = z.as_ref();
    Call::batched(z, z, z, &Options::default())
        .backward_batch(engine, z, z, &[0.0])
        .is_some()
}

/// The reference backward is `O(n_q·n_k·(2d_k + d_v))` in f64 per head: lengths stay
/// around the engine's tiles up to 512 keys and 128 queries, most of them small.
pub(crate) fn backward_shapes(engine: &dyn Engine) -> Shapes {
    let tiles: Vec<usize> = engine
        .tile_lengths()
        .into_iter()
        .filter(|&t| t <= 512)
        .collect();
    let max_tile = tiles.iter().copied().max().unwrap_or(64);
    Shapes {
        max_q: 129.min(max_tile + 1),
        max_k: 513.min(max_tile + 1),
        tiles,
    }
}

/// Batched cases multiply the heads: lengths up to 65.
pub(crate) fn backward_batch_shapes(s: &Shapes) -> Shapes {
    Shapes {
        tiles: s.tiles.iter().copied().filter(|&t| t <= 64).collect(),
        max_q: 65.min(s.max_q),
        max_k: 65.min(s.max_k),
    }
}

/// A head case and the recipe of its upstream gradient `dO`.
#[derive(Debug, Clone, PartialEq)]
pub struct GradCase {
    /// The forward problem.
    pub head: HeadCase,
    /// Distribution of `dO`.
    pub grad: Values,
    /// Seed of `dO`.
    pub grad_seed: u64,
}

/// A batched case and the recipe of its upstream gradient `dO` (`[batch, h_q, n_q, d_v]`,
/// in the layout of Q).
#[derive(Debug, Clone, PartialEq)]
pub struct BatchGradCase {
    /// The forward problem.
    pub batch: BatchCase,
    /// Distribution of `dO`.
    pub grad: Values,
    /// Seed of `dO`.
    pub grad_seed: u64,
}

pub(crate) fn grad_case(shapes: &Shapes) -> BoxedStrategy<GradCase> {
    grad_case_from(head_case(shapes))
}

/// Self-attention (`n_q = n_k`) is the common training case, and the only one in which
/// some index mix-ups (a transposed `dS`) stay in range: a quarter of the cases are square.
fn square() -> impl Strategy<Value = bool> {
    proptest::bool::weighted(0.25)
}

fn grad_case_from(head: BoxedStrategy<HeadCase>) -> BoxedStrategy<GradCase> {
    (head, ordinary_values(), any::<u64>(), square())
        .prop_map(|(head, grad, grad_seed, square)| {
            let mut head = for_backward(head);
            if square {
                head.n_k = head.n_q;
            }
            GradCase {
                head,
                grad,
                grad_seed,
            }
        })
        .boxed()
}

/// A batched case with `group` query heads per kv head drawn from `groups`.
pub(crate) fn batch_grad_case(
    shapes: &Shapes,
    groups: core::ops::RangeInclusive<usize>,
) -> BoxedStrategy<BatchGradCase> {
    (
        batch_case(shapes),
        groups,
        ordinary_values(),
        any::<u64>(),
        square(),
    )
        .prop_map(|(batch, group, grad, grad_seed, square)| {
            let mut batch = batch_for_backward(batch);
            batch.group = group;
            if square {
                batch.head.n_k = batch.head.n_q;
            }
            BatchGradCase {
                batch,
                grad,
                grad_seed,
            }
        })
        .boxed()
}

fn grad_out(case: &GradCase, inputs: &HeadInputs, dtype: Dtype) -> Mat<f32> {
    let mut rng = Rng::new(case.grad_seed, 21);
    operand(
        inputs.q.nrows(),
        inputs.v.ncols(),
        case.grad,
        dtype,
        &mut rng,
    )
}

fn batch_grad_out(case: &BatchGradCase, inputs: &BatchInputs, dtype: Dtype) -> OwnedTensor {
    let [batch, h_q, n_q, _] = inputs.q.dims;
    let d_v = inputs.v.dims[3];
    let mut rng = Rng::new(case.grad_seed, 22);
    OwnedTensor::new(case.batch.layouts[0], [batch, h_q, n_q, d_v], || {
        case.grad.sample(&mut rng, dtype)
    })
}

// ---------------------------------------------------------------------------------------
// Running the engine, the reference and the bound.

fn backward(
    engine: &dyn Engine,
    inputs: &HeadInputs,
    grad_out: MatRef<'_, f32>,
    out: MatRef<'_, f32>,
    lse: &[f32],
) -> Result<Gradients, TestCaseError> {
    let (q, k, v) = views(inputs);
    Call::head(q, k, v, &inputs.options())
        .backward_head(engine, grad_out, out, lse)
        .ok_or_else(|| fail("the engine stopped supporting the backward pass"))?
        .map_err(|e| engine_err("backward call", e))
}

fn reference_backward(inputs: &HeadInputs, grad_out: MatRef<'_, f32>) -> MaterializedBackward {
    let (q, k, v) = views(inputs);
    Attention::head(q, k, v, &inputs.options())
        .and_then(|call| call.backward_materialized(grad_out))
        .expect("generated inputs are valid")
}

fn gradient_bound(
    engine: &dyn Engine,
    inputs: &HeadInputs,
    grad_out: MatRef<'_, f32>,
    r: &MaterializedBackward,
) -> GradientBound {
    let opts = inputs.options();
    let (q, k, v) = views(inputs);
    head_backward_bound(
        &engine.error_model(),
        q,
        k,
        v,
        grad_out,
        scale_of(&opts, q.ncols()),
        opts.additive_mask,
        r,
    )
}

/// Everything a single-head backward check needs: the inputs, `dO`, the engine's forward,
/// the reference and the bound (the forward already checked against its bound).
struct HeadRun {
    inputs: HeadInputs,
    grad_out: Mat<f32>,
    out: Mat<f32>,
    lse: Vec<f32>,
    reference: MaterializedBackward,
    bound: GradientBound,
}

impl HeadRun {
    fn new(
        engine: &dyn Engine,
        inputs: HeadInputs,
        grad_out: Mat<f32>,
        what: &str,
    ) -> Result<Self, TestCaseError> {
        let (out, lse) = run_head(engine, &inputs)?;
        let reference = reference_backward(&inputs, grad_out.as_ref());
        let bound = gradient_bound(engine, &inputs, grad_out.as_ref(), &reference);
        check_forward(what, out.as_ref(), &lse, &reference, &bound)?;
        Ok(HeadRun {
            inputs,
            grad_out,
            out,
            lse,
            reference,
            bound,
        })
    }

    fn of(engine: &dyn Engine, case: &GradCase, what: &str) -> Result<Self, TestCaseError> {
        let inputs = case.head.build(engine.storage());
        let grad_out = grad_out(case, &inputs, engine.storage());
        Self::new(engine, inputs, grad_out, what)
    }

    fn backward(&self, engine: &dyn Engine) -> Result<Gradients, TestCaseError> {
        backward(
            engine,
            &self.inputs,
            self.grad_out.as_ref(),
            self.out.as_ref(),
            &self.lse,
        )
    }
}

/// The backward bound assumes the output and LSE it is given are within the forward
/// bound: a forward outside it is reported as such.
fn check_forward(
    what: &str,
    out: MatRef<'_, f32>,
    lse: &[f32],
    r: &MaterializedBackward,
    b: &GradientBound,
) -> Check {
    compare_head(
        &format!("{what}: the forward result given to the backward pass"),
        out,
        Some(lse),
        &r.forward,
        &b.forward,
        &all_rows,
    )
    .map_err(fail)
}

/// Compares one head's gradients with the reference: dQ on the query rows `rows`
/// selects, dK and dV on the key rows `keys` selects.
fn compare_gradients(
    what: &str,
    g: &Gradients,
    r: &MaterializedBackward,
    b: &GradientBound,
    rows: &dyn Fn(usize) -> bool,
    keys: &dyn Fn(usize) -> bool,
) -> Check {
    compare_matrix(
        what,
        "dQ",
        g.dq.as_ref(),
        r.dq.as_ref(),
        b.dq.as_ref(),
        rows,
    )
    .and_then(|()| {
        compare_matrix(
            what,
            "dK",
            g.dk.as_ref(),
            r.dk.as_ref(),
            b.dk.as_ref(),
            keys,
        )
    })
    .and_then(|()| {
        compare_matrix(
            what,
            "dV",
            g.dv.as_ref(),
            r.dv.as_ref(),
            b.dv.as_ref(),
            keys,
        )
    })
    .map_err(fail)
}

/// A batched problem with its `dO`, the engine's forward (per head), the reference and the
/// bound (the forward already checked against its bound).
struct BatchRun {
    inputs: BatchInputs,
    grad_out: OwnedTensor,
    out: Tensor4<f32>,
    lse: Vec<f32>,
    reference: Vec<Vec<MaterializedBackward>>,
    bound: BatchGradientBound,
}

fn batch_bound(
    engine: &dyn Engine,
    inputs: &BatchInputs,
    k: Tensor4Ref<'_, f32>,
    v: Tensor4Ref<'_, f32>,
    grad_out: Tensor4Ref<'_, f32>,
    reference: &[Vec<MaterializedBackward>],
) -> BatchGradientBound {
    let opts = inputs.options();
    batch_backward_bound(
        &engine.error_model(),
        inputs.q.view(),
        k,
        v,
        grad_out,
        scale_of(&opts, inputs.q.dims[3]),
        opts.additive_mask,
        reference,
    )
}

impl BatchRun {
    fn of(engine: &dyn Engine, case: &BatchGradCase) -> Result<Self, TestCaseError> {
        let inputs = case.batch.build(engine.storage());
        let grad_out = batch_grad_out(case, &inputs, engine.storage());
        // Dropout keys its mask by (batch entry, head): a single-head call would draw
        // another, so a call with dropout runs batched.
        let (out, lse) = if inputs.options().dropout.is_some() {
            batched_call(engine, &inputs)?
        } else {
            batched_forward(engine, &inputs)?
        };
        let reference = Attention::batched(
            inputs.q.view(),
            inputs.k.view(),
            inputs.v.view(),
            &inputs.options(),
        )
        .and_then(|call| call.backward_materialized(grad_out.view()))
        .expect("generated inputs are valid");
        let bound = batch_bound(
            engine,
            &inputs,
            inputs.k.view(),
            inputs.v.view(),
            grad_out.view(),
            &reference,
        );
        for (b, heads) in reference.iter().enumerate() {
            for (h, r) in heads.iter().enumerate() {
                let n_q = inputs.q.dims[2];
                let at = (b * heads.len() + h) * n_q;
                compare_head(
                    &format!(
                        "batch entry {b}, query head {h}: the forward result given to the \
                         backward pass"
                    ),
                    out.as_ref().head(b, h).map_err(|e| fail(e.to_string()))?,
                    Some(&lse[at..at + n_q]),
                    &r.forward,
                    &bound.forward[b][h],
                    &all_rows,
                )
                .map_err(fail)?;
            }
        }
        Ok(BatchRun {
            inputs,
            grad_out,
            out,
            lse,
            reference,
            bound,
        })
    }

    fn backward(
        &self,
        engine: &dyn Engine,
        k: Tensor4Ref<'_, f32>,
        v: Tensor4Ref<'_, f32>,
    ) -> Result<BatchGradients, TestCaseError> {
        let g = Call::batched(self.inputs.q.view(), k, v, &self.inputs.options())
            .backward_batch(engine, self.grad_out.view(), self.out.as_ref(), &self.lse)
            .ok_or_else(|| fail("the engine stopped supporting the batched backward pass"))?
            .map_err(|e| engine_err("batched backward call", e))?;
        let [batch, h_q, n_q, d_k] = self.inputs.q.dims;
        let [_, h_kv, n_k, d_v] = [k.dims()[0], k.dims()[1], k.dims()[2], v.dims()[3]];
        let want = [
            [batch, h_q, n_q, d_k],
            [batch, h_kv, n_k, d_k],
            [batch, h_kv, n_k, d_v],
        ];
        let got = [g.dq.dims(), g.dk.dims(), g.dv.dims()];
        if got != want {
            return Err(fail(format!(
                "batched gradients have dims {got:?} (dQ, dK, dV), not {want:?}"
            )));
        }
        Ok(g)
    }
}

/// The engine's forward result for a batched problem, head by head through head calls
/// (the forward whose bound each head's backward bound rests on): the output
/// `[batch, h_q, n_q, d_v]` and the LSE in `[batch][h_q][n_q]` order.
fn batched_forward(
    engine: &dyn Engine,
    inputs: &BatchInputs,
) -> Result<(Tensor4<f32>, Vec<f32>), TestCaseError> {
    let opts = inputs.options();
    let [batch, h_q, n_q, _] = inputs.q.dims;
    let (h_kv, d_v) = (inputs.k.dims[1], inputs.v.dims[3]);
    let mut out = Tensor4::<f32>::zeros([batch, h_q, n_q, d_v]);
    let mut lse = Vec::with_capacity(batch * h_q * n_q);
    for b in 0..batch {
        let mut single = opts;
        single.key_padding = opts.key_length(b).map(KeyPadding::Uniform);
        for h in 0..h_q {
            let kv = h / (h_q / h_kv);
            let (o, l) = required(
                Call::head(
                    inputs.q.view().head(b, h).expect("in range"),
                    inputs.k.view().head(b, kv).expect("in range"),
                    inputs.v.view().head(b, kv).expect("in range"),
                    &single,
                )
                .forward_head(engine),
            )
            .map_err(|e| engine_err("single-head call on a strided view", e))?;
            let mut view = out.as_mut();
            view.head_mut(b, h)
                .map_err(|e| fail(e.to_string()))?
                .copy_from(&o);
            lse.extend(l);
        }
    }
    Ok((out, lse))
}

/// The reference dK, dV of each `[batch][kv head]`: the sums over the group, in f64.
fn group_sums(
    reference: &[Vec<MaterializedBackward>],
    h_kv: usize,
) -> Vec<Vec<(Mat<f64>, Mat<f64>)>> {
    reference
        .iter()
        .map(|heads| {
            let group = heads.len() / h_kv;
            (0..h_kv)
                .map(|kv| {
                    let mut it = heads[kv * group..(kv + 1) * group].iter();
                    let first = it.next().expect("a group has a head");
                    let (mut dk, mut dv) = (first.dk.clone(), first.dv.clone());
                    for r in it {
                        dk += &r.dk;
                        dv += &r.dv;
                    }
                    (dk, dv)
                })
                .collect()
        })
        .collect()
}

/// Head `(b, h)` of a result tensor.
fn head_of(t: &Tensor4<f32>, b: usize, h: usize) -> Result<MatRef<'_, f32>, TestCaseError> {
    t.as_ref().head(b, h).map_err(|e| fail(e.to_string()))
}

fn compare_batched(what: &str, run: &BatchRun, g: &BatchGradients) -> Check {
    let h_kv = run.inputs.k.dims[1];
    let sums = group_sums(&run.reference, h_kv);
    for (b, heads) in run.reference.iter().enumerate() {
        for (h, r) in heads.iter().enumerate() {
            let at = format!("{what}, batch entry {b}, query head {h}");
            compare_matrix(
                &at,
                "dQ",
                head_of(&g.dq, b, h)?,
                r.dq.as_ref(),
                run.bound.dq[b][h].as_ref(),
                &all_rows,
            )
            .map_err(fail)?;
        }
        for (kv, (dk, dv)) in sums[b].iter().enumerate() {
            let at = format!("{what}, batch entry {b}, kv head {kv}");
            let (gk, gv) = (head_of(&g.dk, b, kv)?, head_of(&g.dv, b, kv)?);
            compare_matrix(
                &at,
                "dK",
                gk,
                dk.as_ref(),
                run.bound.dk[b][kv].as_ref(),
                &all_rows,
            )
            .and_then(|()| {
                compare_matrix(
                    &at,
                    "dV",
                    gv,
                    dv.as_ref(),
                    run.bound.dv[b][kv].as_ref(),
                    &all_rows,
                )
            })
            .map_err(fail)?;
        }
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------
// Equivalence with the reference.

pub(crate) fn equivalence(engine: &dyn Engine, case: GradCase) -> Check {
    let run = HeadRun::of(engine, &case, "single head")?;
    let g = run.backward(engine)?;
    compare_gradients(
        "single-head gradients",
        &g,
        &run.reference,
        &run.bound,
        &all_rows,
        &all_rows,
    )
}

pub(crate) fn batched_equivalence(engine: &dyn Engine, case: BatchGradCase) -> Check {
    let run = BatchRun::of(engine, &case)?;
    let g = run.backward(engine, run.inputs.k.view(), run.inputs.v.view())?;
    compare_batched("batched gradients", &run, &g)
}

// ---------------------------------------------------------------------------------------
// Rows of dS sum to 0; so do the columns of dK.

pub(crate) fn score_gradient_rows_sum_to_zero(engine: &dyn Engine, case: GradCase) -> Check {
    let run = HeadRun::of(engine, &case, "single head")?;
    let (r, b) = (&run.reference, &run.bound);
    let [n_q, n_k, d_k, _] = run.inputs.dims();
    // The reference: Σ_j dS_ij = Σ_j P_ij dP_ij − D_i Σ_j P_ij = 0 for every row.
    for i in 0..n_q {
        let sum: f64 = (0..n_k).map(|j| r.ds[(i, j)]).sum();
        let bd = b.reference_ds_row_sum[i];
        record_tightness(sum.abs(), bd);
        let ok = if r.forward.lse[i] == f64::NEG_INFINITY {
            (0..n_k).all(|j| r.ds[(i, j)] == 0.0)
        } else {
            sum.abs() <= bd
        };
        if !ok {
            return Err(fail(format!(
                "reference: row {i} of dS sums to {sum:e}, but must be 0 (bound {bd:.3e})"
            )));
        }
    }
    // The engine: Σ_j dK_jc = scale·Σ_i (Σ_j dS_ij) q_ic = 0, within the sum of the
    // entries' bounds (plus the f64 sum that checks it).
    let g = run.backward(engine)?;
    if (g.dk.nrows(), g.dk.ncols()) != (n_k, d_k) {
        return Err(fail(format!(
            "dK is {}×{}, not {n_k}×{d_k}",
            g.dk.nrows(),
            g.dk.ncols()
        )));
    }
    for c in 0..d_k {
        let sum: f64 = (0..n_k).map(|j| f64::from(g.dk[(j, c)])).sum();
        let abs: f64 = (0..n_k).map(|j| f64::from(g.dk[(j, c)]).abs()).sum();
        let bd =
            (0..n_k).map(|j| b.dk[(j, c)]).sum::<f64>() + SAFETY * gamma(n_k as f64, U64) * abs;
        record_tightness(sum.abs(), bd);
        if !sum.is_finite() || sum.abs() > bd {
            return Err(fail(format!(
                "column {c} of dK sums to {sum:e} but must be 0: |sum| exceeds the derived \
                 bound {bd:.3e} (the sum of its entries' bounds)"
            )));
        }
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------
// Keys hidden from every query.

/// How a key is hidden from every query.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeyHider {
    /// Key padding ends at the key (and hides the ones after it).
    Padding,
    /// Its column of the boolean mask hides it.
    BoolColumn,
    /// Its column of the additive mask is `-inf`.
    AdditiveColumn,
}

/// A case, how a key is hidden from every query, a seed choosing the key and the
/// poisoned query row, and the poison.
type HiddenKeyCase = (GradCase, KeyHider, u64, f32);

pub(crate) fn hidden_key_case(shapes: &Shapes) -> BoxedStrategy<HiddenKeyCase> {
    (
        grad_case(shapes),
        select(vec![
            KeyHider::Padding,
            KeyHider::BoolColumn,
            KeyHider::AdditiveColumn,
        ]),
        any::<u64>(),
        select(vec![f32::NAN, f32::INFINITY, f32::NEG_INFINITY]),
    )
        .prop_map(|(mut c, h, s, p)| {
            c.head.n_q = c.head.n_q.max(1);
            c.head.n_k = c.head.n_k.max(1);
            (c, h, s, p)
        })
        .boxed()
}

/// Hides key `j` from every query of `inputs`.
fn hide_key(inputs: &mut HeadInputs, hider: KeyHider, j: usize) {
    let [n_q, n_k, _, _] = inputs.dims();
    match hider {
        KeyHider::Padding => inputs.key_len = Some(inputs.key_len.unwrap_or(n_k).min(j)),
        KeyHider::BoolColumn => {
            let (allow, m) = inputs
                .masks
                .bool_mask
                .get_or_insert_with(|| (true, Mat::from_fn(n_q, n_k, |_, _| true)));
            for i in 0..n_q {
                m[(i, j)] = !*allow;
            }
        }
        KeyHider::AdditiveColumn => {
            let m = inputs
                .masks
                .additive
                .get_or_insert_with(|| Mat::zeros(n_q, n_k));
            for i in 0..n_q {
                m[(i, j)] = f32::NEG_INFINITY;
            }
        }
    }
}

pub(crate) fn hidden_keys(
    engine: &dyn Engine,
    (case, hider, seed, poison): HiddenKeyCase,
) -> Check {
    let mut inputs = case.head.build(engine.storage());
    let [n_q, n_k, d_k, d_v] = inputs.dims();
    let mut rng = Rng::new(seed, 31);
    let j = rng.below(n_k as u64) as usize;
    let qi = rng.below(n_q as u64) as usize;
    hide_key(&mut inputs, hider, j);
    let grad_out = grad_out(&case, &inputs, engine.storage());
    // The reference and the bound on the clean inputs: the poison reaches none of the
    // entries compared below.
    let reference = reference_backward(&inputs, grad_out.as_ref());
    let bound = gradient_bound(engine, &inputs, grad_out.as_ref(), &reference);
    let mut poisoned = inputs.clone();
    let mut poisoned_grad = grad_out.clone();
    for t in 0..d_k {
        poisoned.k[(j, t)] = poison;
        poisoned.q[(qi, t)] = poison;
    }
    for t in 0..d_v {
        poisoned.v[(j, t)] = poison;
        poisoned_grad[(qi, t)] = poison;
    }
    let (out, lse) = run_head(engine, &poisoned)?;
    compare_head(
        &format!("the forward pass with key {j} ({hider:?}) and query {qi} poisoned with {poison}, rows other than {qi}"),
        out.as_ref(),
        Some(&lse),
        &reference.forward,
        &bound.forward,
        &|i| i != qi,
    )
    .map_err(fail)?;
    let g = backward(
        engine,
        &poisoned,
        poisoned_grad.as_ref(),
        out.as_ref(),
        &lse,
    )?;
    let scores = &reference.forward.scores;
    let seen_by = |i: usize, key: usize| scores[(i, key)] != f64::NEG_INFINITY;
    let what = format!(
        "key {j} hidden from every query ({hider:?}), its K and V rows and query {qi}'s Q and \
         dO rows poisoned with {poison}"
    );
    for key in (0..n_k).filter(|&key| !(0..n_q).any(|i| seen_by(i, key))) {
        for (name, m) in [("dK", &g.dk), ("dV", &g.dv)] {
            if let Some(c) = (0..m.ncols()).find(|&c| m[(key, c)] != 0.0) {
                return Err(fail(format!(
                    "{what}: no query sees key {key}, so {name}[{key}, {c}] must be exactly 0, \
                     not {:e}",
                    m[(key, c)]
                )));
            }
        }
    }
    // Query qi's poison may reach only its own dQ row and the keys it sees.
    compare_gradients(
        &format!("{what}, entries the poison cannot reach"),
        &g,
        &reference,
        &bound,
        &|i| i != qi,
        &|key| !seen_by(qi, key),
    )
}

// ---------------------------------------------------------------------------------------
// Rows that see no key.

pub(crate) fn masked_rows_grad_case(
    shapes: &Shapes,
) -> BoxedStrategy<((HeadCase, RowHider), Values, u64)> {
    (masked_rows_case(shapes), ordinary_values(), any::<u64>())
        .prop_map(|((c, h), grad, seed)| ((for_backward(c), h), grad, seed))
        .boxed()
}

pub(crate) fn fully_masked_rows(
    engine: &dyn Engine,
    ((head, hider), grad, grad_seed): ((HeadCase, RowHider), Values, u64),
) -> Check {
    let inputs = masked_rows_inputs(&head, hider, engine.storage());
    let case = GradCase {
        head,
        grad,
        grad_seed,
    };
    let grad_out = grad_out(&case, &inputs, engine.storage());
    let run = HeadRun::new(engine, inputs, grad_out, "fully masked rows")?;
    if run.reference.forward.lse[0] != f64::NEG_INFINITY {
        return Err(fail(format!(
            "oracle bug: {hider:?} left row 0 with a visible key"
        )));
    }
    let g = run.backward(engine)?;
    for (name, m) in [("dQ", &g.dq), ("dK", &g.dk), ("dV", &g.dv)] {
        if m.col_iter().any(|c| c.iter().any(|x| !x.is_finite())) {
            return Err(fail(format!(
                "NaN or Inf in {name} of a partly masked problem with finite inputs"
            )));
        }
    }
    let empty = |i: usize| run.reference.forward.lse[i] == f64::NEG_INFINITY;
    let check_dq = |what: &str, dq: MatRef<'_, f32>| -> Check {
        for i in (0..dq.nrows()).filter(|&i| empty(i)) {
            if let Some(c) = (0..dq.ncols()).find(|&c| dq[(i, c)] != 0.0) {
                return Err(fail(format!(
                    "{what}: row {i} sees no key, so dQ[{i}, {c}] must be exactly 0, not {:e}",
                    dq[(i, c)]
                )));
            }
        }
        Ok(())
    };
    check_dq("single head", g.dq.as_ref())?;
    compare_gradients(
        "fully masked rows",
        &g,
        &run.reference,
        &run.bound,
        &all_rows,
        &all_rows,
    )?;
    if !supports_backward_batched(engine) {
        return Ok(());
    }
    // The same problem through the batched API: one batch entry, one head.
    let [n_q, n_k, d_k, d_v] = run.inputs.dims();
    let tensor = |m: &Mat<f32>, rows: usize, cols: usize| {
        OwnedTensor::new(TensorLayout::Bhsd, [1, 1, rows, cols], {
            let mut at = 0;
            move || {
                let x = m[(at / cols, at % cols)];
                at += 1;
                x
            }
        })
    };
    let (q, k, v) = (
        tensor(&run.inputs.q, n_q, d_k),
        tensor(&run.inputs.k, n_k, d_k),
        tensor(&run.inputs.v, n_k, d_v),
    );
    let (dout, out) = (tensor(&run.grad_out, n_q, d_v), tensor(&run.out, n_q, d_v));
    let bg = Call::batched(q.view(), k.view(), v.view(), &run.inputs.options())
        .backward_batch(engine, dout.view(), out.view(), &run.lse)
        .ok_or_else(|| fail("the engine stopped supporting the batched backward pass"))?
        .map_err(|e| engine_err("batched backward call", e))?;
    let dq = bg.dq.as_ref().head(0, 0).map_err(|e| fail(e.to_string()))?;
    check_dq("batched call", dq)
}

// ---------------------------------------------------------------------------------------
// Grouped-query gradients are sums of per-head gradients.

pub(crate) fn gqa_sums(engine: &dyn Engine, case: BatchGradCase) -> Check {
    let run = BatchRun::of(engine, &case)?;
    let (k, v) = (&run.inputs.k, &run.inputs.v);
    let [batch, h_q, _, _] = run.inputs.q.dims;
    let h_kv = k.dims[1];
    let group = h_q / h_kv;
    // Multi-head attention with every kv head replicated for each of its query heads: the
    // same per-head problems.
    let replicate = |t: &OwnedTensor, layout: TensorLayout| {
        let [_, _, n, d] = t.dims;
        let view = t.view();
        let mut at = 0usize;
        OwnedTensor::new(layout, [batch, h_q, n, d], move || {
            let (bh, e) = (at / (n * d), at % (n * d));
            at += 1;
            let m = view.head(bh / h_q, (bh % h_q) / group).expect("in range");
            m[(e / d, e % d)]
        })
    };
    let (km, vm) = (
        replicate(k, case.batch.layouts[1]),
        replicate(v, case.batch.layouts[2]),
    );
    let mha_bound = batch_bound(
        engine,
        &run.inputs,
        km.view(),
        vm.view(),
        run.grad_out.view(),
        &run.reference,
    );
    let gqa = run.backward(engine, k.view(), v.view())?;
    let mha = run.backward(engine, km.view(), vm.view())?;
    let head = |t: &Tensor4<f32>, b: usize, h: usize| -> Result<Mat<f32>, TestCaseError> {
        Ok(head_of(t, b, h)?.to_owned())
    };
    for b in 0..batch {
        for h in 0..h_q {
            let (a, m) = (head(&gqa.dq, b, h)?, head(&mha.dq, b, h)?);
            for i in 0..a.nrows() {
                for c in 0..a.ncols() {
                    let (x, y) = (f64::from(a[(i, c)]), f64::from(m[(i, c)]));
                    let bd = run.bound.dq[b][h][(i, c)] + mha_bound.dq[b][h][(i, c)];
                    let err = (x - y).abs();
                    record_tightness(err, bd);
                    if !(x == y || err <= bd) {
                        return Err(fail(format!(
                            "batch entry {b}, query head {h}: dQ[{i}, {c}] is {x:e} with \
                             shared K/V and {y:e} with K/V replicated per head: \
                             |difference| = {err:.3e} > {bd:.3e}"
                        )));
                    }
                }
            }
        }
        for kv in 0..h_kv {
            let members = kv * group..(kv + 1) * group;
            for (name, shared, per_head, bgqa, bmha) in [
                ("dK", &gqa.dk, &mha.dk, &run.bound.dk, &mha_bound.dk),
                ("dV", &gqa.dv, &mha.dv, &run.bound.dv, &mha_bound.dv),
            ] {
                let s = head(shared, b, kv)?;
                let parts: Vec<Mat<f32>> = members
                    .clone()
                    .map(|h| head(per_head, b, h))
                    .collect::<Result<_, _>>()?;
                for j in 0..s.nrows() {
                    for c in 0..s.ncols() {
                        let sum: f64 = parts.iter().map(|p| f64::from(p[(j, c)])).sum();
                        let abs: f64 = parts.iter().map(|p| f64::from(p[(j, c)]).abs()).sum();
                        let bd = bgqa[b][kv][(j, c)]
                            + members.clone().map(|h| bmha[b][h][(j, c)]).sum::<f64>()
                            + SAFETY * gamma(group as f64, U64) * abs;
                        let x = f64::from(s[(j, c)]);
                        let err = (x - sum).abs();
                        record_tightness(err, bd);
                        if !(x == sum || err <= bd) {
                            return Err(fail(format!(
                                "batch entry {b}, kv head {kv}: {name}[{j}, {c}] is {x:e} but the \
                                 sum over query heads {members:?} of the per-head gradients is \
                                 {sum:e}: |difference| = {err:.3e} > {bd:.3e}"
                            )));
                        }
                    }
                }
            }
        }
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------
// dO ↦ 2^k·dO scales every gradient by 2^k.

/// The smallest weight of the scaling property's cases: products of weights with `dO`
/// stay far above the subnormals, so that every rounding is relative and commutes with
/// a power of two.
const SMALLEST_WEIGHT: f64 = 1.0 / (1u64 << 60) as f64;

/// The smallest nonzero `|dO|` of the scaling property (`2⁻⁸`): `2^k·dO` is exact in every
/// storage type for the exponents drawn.
const SMALLEST_GRAD: f32 = 1.0 / 256.0;

/// Scores that stay within a few tens of nats (so that every visible weight is above
/// [`SMALLEST_WEIGHT`] in nearly every case), and an exponent `k`.
pub(crate) fn grad_scaling_case(shapes: &Shapes) -> BoxedStrategy<(GradCase, i32)> {
    let head = head_case_with(
        shapes,
        select(vec![Values::Unit, Values::Ties]).boxed(),
        ordinary_values(),
        masks(vec![0.05, 0.5, 1.0], vec![Bias::Small, Bias::Zero]),
    );
    (grad_case_from(head), select(vec![-5, -1, 1, 3, 8])).boxed()
}

pub(crate) fn grad_out_scaling(engine: &dyn Engine, (case, k): (GradCase, i32)) -> Check {
    let dtype = engine.storage();
    let inputs = case.head.build(dtype);
    let mut grad = grad_out(&case, &inputs, dtype);
    for c in 0..grad.ncols() {
        for x in grad.col_mut(c).iter_mut() {
            if *x != 0.0 && x.abs() < SMALLEST_GRAD {
                *x = SMALLEST_GRAD.copysign(*x);
            }
        }
    }
    let factor = 2f32.powi(k);
    let scaled = Mat::from_fn(grad.nrows(), grad.ncols(), |i, c| factor * grad[(i, c)]);
    if (0..grad.nrows())
        .any(|i| (0..grad.ncols()).any(|c| dtype.round(scaled[(i, c)]) != scaled[(i, c)]))
    {
        return Err(fail(format!(
            "oracle bug: 2^{k}·dO is not exact in {dtype:?}"
        )));
    }
    let run = HeadRun::new(engine, inputs, grad, "single head")?;
    let w = &run.reference.forward.weights;
    let smallest = (0..w.nrows())
        .flat_map(|i| (0..w.ncols()).map(move |j| (i, j)))
        .filter(|&(i, j)| run.reference.forward.scores[(i, j)] != f64::NEG_INFINITY)
        .map(|(i, j)| w[(i, j)])
        .fold(f64::INFINITY, f64::min);
    if smallest < SMALLEST_WEIGHT {
        return Ok(()); // products near the subnormals round absolutely: no exact claim
    }
    let g0 = run.backward(engine)?;
    let g1 = backward(
        engine,
        &run.inputs,
        scaled.as_ref(),
        run.out.as_ref(),
        &run.lse,
    )?;
    let out = engine.error_model().output;
    let (normal, eta) = (out.smallest_normal(), out.underflow_error());
    let f = f64::from(factor);
    let regular = |x: f64| x == 0.0 || (x.is_finite() && x.abs() >= normal);
    for (name, a, b) in [
        ("dQ", &g0.dq, &g1.dq),
        ("dK", &g0.dk, &g1.dk),
        ("dV", &g0.dv, &g1.dv),
    ] {
        if (a.nrows(), a.ncols()) != (b.nrows(), b.ncols()) {
            return Err(fail(format!(
                "{name}: the shapes differ between dO and 2^{k}·dO"
            )));
        }
        for i in 0..a.nrows() {
            for c in 0..a.ncols() {
                let (x, y) = (f64::from(a[(i, c)]), f64::from(b[(i, c)]));
                let want = f * x;
                let exact = regular(x) && regular(want) && regular(y);
                let ok = if exact {
                    y.to_bits() == want.to_bits()
                } else {
                    // Both results round near the subnormals of the output type.
                    (y - want).abs() <= (1.0 + f) * eta
                };
                if !ok {
                    return Err(fail(format!(
                        "{name}[{i}, {c}] is {x:e} for dO and {y:e} for 2^{k}·dO, not \
                         2^{k}·{x:e} = {want:e}{}",
                        if exact {
                            " bit for bit"
                        } else {
                            " within the subnormal rounding"
                        }
                    )));
                }
            }
        }
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------
// Thread counts.

pub(crate) fn determinism_case(shapes: &Shapes) -> BoxedStrategy<(GradCase, BatchGradCase)> {
    // Groups of up to 4 query heads: summing a group in an order that depends on the
    // thread count changes bits only with three heads or more.
    (
        grad_case(shapes),
        batch_grad_case(&backward_batch_shapes(shapes), 1..=4),
    )
        .boxed()
}

fn same_bits(what: &str, name: &str, runs: &[Vec<u32>]) -> Check {
    for (t, r) in runs.iter().enumerate().skip(1) {
        if r != &runs[0] {
            let first = r.iter().zip(&runs[0]).position(|(a, b)| a != b);
            return Err(fail(format!(
                "{what}: {name} with {} threads differs from 1 thread (first at flat index \
                 {first:?}{})",
                t + 1,
                if r.len() != runs[0].len() {
                    ", lengths differ"
                } else {
                    ""
                }
            )));
        }
    }
    Ok(())
}

fn mat_bits(m: &Mat<f32>) -> Vec<u32> {
    (0..m.nrows())
        .flat_map(|i| (0..m.ncols()).map(move |j| (i, j)))
        .map(|(i, j)| m[(i, j)].to_bits())
        .collect()
}

fn tensor_bits(t: &Tensor4<f32>) -> Vec<u32> {
    t.as_slice().iter().map(|x| x.to_bits()).collect()
}

pub(crate) fn determinism(engine: &dyn Engine, (case, batch): (GradCase, BatchGradCase)) -> Check {
    let inputs = case.head.build(engine.storage());
    let dout = grad_out(&case, &inputs, engine.storage());
    let (out, lse) = run_head(engine, &inputs)?;
    let runs: Vec<Gradients> = pools()
        .iter()
        .map(|pool| pool.install(|| backward(engine, &inputs, dout.as_ref(), out.as_ref(), &lse)))
        .collect::<Result<_, _>>()?;
    for (name, pick) in [
        ("dQ", (|g: &Gradients| &g.dq) as fn(&Gradients) -> &Mat<f32>),
        ("dK", |g: &Gradients| &g.dk),
        ("dV", |g: &Gradients| &g.dv),
    ] {
        let bits: Vec<Vec<u32>> = runs.iter().map(|g| mat_bits(pick(g))).collect();
        same_bits("single head", name, &bits)?;
    }
    if !supports_backward_batched(engine) {
        return Ok(());
    }
    let inputs = batch.batch.build(engine.storage());
    let dout = batch_grad_out(&batch, &inputs, engine.storage());
    let (out, lse) = batched_forward(engine, &inputs)?;
    let opts = inputs.options();
    let runs: Vec<BatchGradients> = pools()
        .iter()
        .map(|pool| {
            pool.install(|| {
                Call::batched(inputs.q.view(), inputs.k.view(), inputs.v.view(), &opts)
                    .backward_batch(engine, dout.view(), out.as_ref(), &lse)
                    .ok_or_else(|| fail("the engine stopped supporting the batched backward pass"))?
                    .map_err(|e| engine_err("batched backward call", e))
            })
        })
        .collect::<Result<_, _>>()?;
    for (name, pick) in [
        (
            "dQ",
            (|g: &BatchGradients| &g.dq) as fn(&BatchGradients) -> &Tensor4<f32>,
        ),
        ("dK", |g: &BatchGradients| &g.dk),
        ("dV", |g: &BatchGradients| &g.dv),
    ] {
        let bits: Vec<Vec<u32>> = runs.iter().map(|g| tensor_bits(pick(g))).collect();
        same_bits("batched", name, &bits)?;
    }
    Ok(())
}

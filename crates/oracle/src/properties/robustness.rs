//! The properties of the forward pass at the edges of its input: non-finite values in
//! rows a query cannot see (2), rows that see no key at all (3), adversarial magnitudes
//! (9), and malformed calls, which must be the reference's error and never a panic.

use attn_core::{BoolMask, HeadMask, Options, Tensor4Ref};
use faer::Mat;
use proptest::prelude::*;
use proptest::sample::select;

use super::common::{
    Check, RowHider, bound, compare_head, engine_err, equivalent, fail, masked_rows_inputs,
    matches_reference, reference, run_head, sees_nothing,
};
use crate::Call;
use crate::Engine;
use crate::case::{HeadCase, Rng, Shapes, head_case};
use crate::engine::required;

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

pub(crate) fn fully_masked_rows(engine: &dyn Engine, (case, hider): (HeadCase, RowHider)) -> Check {
    let inputs = masked_rows_inputs(&case, hider, engine.storage());
    let n_k = inputs.k.nrows();
    let (o, lse, r, _) = equivalent(engine, &inputs, "fully masked rows")?;
    if !sees_nothing(&r, 0) {
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
    let t = required(Call::batched(q, k, v, &inputs.options()).forward_batch(engine))
        .map(|(t, _)| t)
        .map_err(|e| engine_err("batched call", e))?;
    let head = t.as_ref().head(0, 0).map_err(|e| fail(e.to_string()))?;
    for i in (0..n_q).filter(|&i| sees_nothing(&r, i)) {
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
// 9: adversarial values.

pub(crate) fn adversarial(engine: &dyn Engine, case: HeadCase) -> Check {
    matches_reference(engine, &case, "adversarial head")
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
    /// A scale whose `scale·log2 e` is not a finite f32.
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
    /// A NaN (or `+inf`) sink logit.
    Sink(f32),
    /// Two ALiBi slopes for a single head.
    SlopeCount,
}

pub(crate) fn malformed_case() -> BoxedStrategy<(Defect, usize, usize, usize, usize)> {
    (
        select(vec![
            Defect::KeyWidth,
            Defect::ValueRows,
            Defect::ZeroKeyWidth,
            Defect::Scale(f32::MAX),
            Defect::Scale(f32::MIN),
            Defect::Scale(f32::NAN),
            Defect::Scale(f32::INFINITY),
            Defect::AdditiveShape,
            Defect::BoolShape,
            Defect::KeyLength,
            Defect::HeadGrouping,
            Defect::BatchSize,
            Defect::KeyLengthCount,
            Defect::Sink(f32::NAN),
            Defect::Sink(f32::INFINITY),
            Defect::SlopeCount,
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
    let slopes = [0.5f32, 0.25];
    let sink = [match defect {
        Defect::Sink(s) => s,
        _ => 0.0,
    }];
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
        Defect::Sink(_) => opts = opts.with_sinks(&sink),
        Defect::SlopeCount => opts = opts.with_alibi(attn_core::Alibi::new(&slopes)),
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
        let e =
            required(Call::head(q.as_ref(), k.as_ref(), v.as_ref(), &opts).forward_head(engine));
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
    let e = required(Call::batched(qt, kt, vt, &opts).forward_batch(engine)).map(|(t, _)| t);
    let r = attn_reference::Attention::batched(qt, kt, vt, &opts)
        .and_then(|call| call.forward())
        .map(|f| f.into_output());
    report(e.map(|_| ()), r.map(|_| ()))
}

//! Property 6 at the layer level: a multi-head (grouped-query) attention layer is
//! `W_O · concat(head_1, …, head_h)` with each head computed on its column block of the
//! projections.
//!
//! Inputs and weights are dyadic (multiples of 1/4 with small numerators), so every
//! projection is exact in f32 and in f64: the heads of both layers see exactly the
//! operands of the per-head reference, and the only f32 errors of the optimized layer are
//! its heads' (bounded by [`head_bound`]) and the `W_O` product:
//! `|Ŷ − Y| ≤ B_C·|W_O| + γ_{h·d_v + 1}·(|C| + B_C)·|W_O|`.

use attn_core::{Causal, MultiHeadWeights, Options};
use attn_oracle::Engine;
use attn_oracle::bound::{SAFETY, U32, gamma, head_bound};
use faer::linalg::matmul::matmul;
use faer::{Accum, Mat, MatRef, Par};
use proptest::prelude::*;
use proptest::test_runner::FileFailurePersistence;

mod engine;
use engine::OptimizedEngine;

fn dyadic(rows: usize, cols: usize, seed: u64, span: i64) -> Mat<f32> {
    let mut s = seed | 1;
    Mat::from_fn(rows, cols, |_, _| {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        ((s % (2 * span as u64 + 1)) as i64 - span) as f32 / 4.0
    })
}

fn mul(a: MatRef<'_, f64>, b: MatRef<'_, f64>) -> Mat<f64> {
    let mut c = Mat::<f64>::zeros(a.nrows(), b.ncols());
    matmul(c.as_mut(), Accum::Replace, a, b, 1.0, Par::Seq);
    c
}

fn wide(m: &Mat<f32>) -> Mat<f64> {
    Mat::from_fn(m.nrows(), m.ncols(), |i, j| f64::from(m[(i, j)]))
}

fn abs(m: MatRef<'_, f64>) -> Mat<f64> {
    Mat::from_fn(m.nrows(), m.ncols(), |i, j| m[(i, j)].abs())
}

#[derive(Debug, Clone)]
struct Layer {
    n_q: usize,
    n_k: usize,
    d_model: usize,
    d_kv: usize,
    h_kv: usize,
    group: usize,
    d_k: usize,
    d_v: usize,
    causal: Option<Causal>,
    seed: u64,
}

fn layer() -> impl Strategy<Value = Layer> {
    (
        (0..=9usize, 0..=9usize, 1..=12usize, 1..=12usize),
        (1..=3usize, 1..=3usize, 1..=8usize, 1..=8usize),
        proptest::option::of(prop_oneof![
            Just(Causal::TopLeft),
            Just(Causal::BottomRight)
        ]),
        any::<u64>(),
    )
        .prop_map(
            |((n_q, n_k, d_model, d_kv), (h_kv, group, d_k, d_v), causal, seed)| Layer {
                n_q,
                n_k,
                d_model,
                d_kv,
                h_kv,
                group,
                d_k,
                d_v,
                causal,
                seed,
            },
        )
}

fn config() -> ProptestConfig {
    ProptestConfig {
        // PROPTEST_CASES (deep runs) replaces the default count.
        cases: std::env::var("PROPTEST_CASES")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(1024),
        failure_persistence: Some(Box::new(FileFailurePersistence::Direct(
            "proptest-regressions/multi_head.txt",
        ))),
        ..ProptestConfig::default()
    }
}

proptest! {
    #![proptest_config(config())]

    #[test]
    fn multi_head_layer_equals_concatenated_heads(l in layer()) {
        let h = l.h_kv * l.group;
        let x_q = dyadic(l.n_q, l.d_model, l.seed, 4);
        let x_kv = dyadic(l.n_k, l.d_kv, l.seed ^ 1, 4);
        let (w_q, w_k, w_v, w_o) = (
            dyadic(l.d_model, h * l.d_k, l.seed ^ 2, 2),
            dyadic(l.d_kv, l.h_kv * l.d_k, l.seed ^ 3, 2),
            dyadic(l.d_kv, l.h_kv * l.d_v, l.seed ^ 4, 2),
            dyadic(h * l.d_v, l.d_model, l.seed ^ 5, 2),
        );
        let weights = MultiHeadWeights::new(
            w_q.clone(), w_k.clone(), w_v.clone(), w_o.clone(), h, l.h_kv,
        ).unwrap();
        let opts = Options { causal: l.causal, ..Options::default() };

        // Exact projections, per-head reference, concatenation, W_O, all in f64.
        let q = mul(wide(&x_q).as_ref(), wide(&w_q).as_ref());
        let k = mul(wide(&x_kv).as_ref(), wide(&w_k).as_ref());
        let v = mul(wide(&x_kv).as_ref(), wide(&w_v).as_ref());
        let narrow = |m: MatRef<'_, f64>| Mat::from_fn(m.nrows(), m.ncols(), |i, j| m[(i, j)] as f32);
        let model = OptimizedEngine::<f32>::new().error_model();
        let mut concat = Mat::<f64>::zeros(l.n_q, h * l.d_v);
        let mut concat_bound = Mat::<f64>::zeros(l.n_q, h * l.d_v);
        for head in 0..h {
            let kv = head / l.group;
            let (qh, kh, vh) = (
                narrow(q.subcols(head * l.d_k, l.d_k)),
                narrow(k.subcols(kv * l.d_k, l.d_k)),
                narrow(v.subcols(kv * l.d_v, l.d_v)),
            );
            let r = attn_reference::attention_materialized(qh.as_ref(), kh.as_ref(), vh.as_ref(), &opts).unwrap();
            let scale = opts.scale_for_f64(l.d_k).unwrap();
            let b = head_bound(&model, qh.as_ref(), kh.as_ref(), vh.as_ref(), scale, None, &r);
            concat.subcols_mut(head * l.d_v, l.d_v).copy_from(&r.output);
            concat_bound.subcols_mut(head * l.d_v, l.d_v).copy_from(&b.output);
        }
        let y = mul(concat.as_ref(), wide(&w_o).as_ref());
        let w_o_abs = abs(wide(&w_o).as_ref());
        let propagated = mul(concat_bound.as_ref(), w_o_abs.as_ref());
        let magnitude = mul((&abs(concat.as_ref()) + &concat_bound).as_ref(), w_o_abs.as_ref());
        let g = gamma((h * l.d_v + 1) as f64, U32);

        let y_ref = attn_reference::MultiHeadAttention::new(weights.clone())
            .forward_cross(x_q.as_ref(), x_kv.as_ref(), &opts).unwrap();
        let y_opt = attn_optimized::MultiHeadAttention::new(weights)
            .forward_cross(x_q.as_ref(), x_kv.as_ref(), &opts).unwrap();
        for i in 0..l.n_q {
            for c in 0..l.d_model {
                let exact = y[(i, c)];
                // The reference layer: f64 throughout, one rounding to f32.
                let err = (f64::from(y_ref[(i, c)]) - exact).abs();
                let bd = SAFETY * (U32 * exact.abs() + 1e-12 * magnitude[(i, c)]);
                prop_assert!(err <= bd, "reference layer [{i}, {c}]: {} vs {exact}: {err:e} > {bd:e}", y_ref[(i, c)]);
                // The optimized layer: heads within their bound, W_O in f32.
                let err = (f64::from(y_opt[(i, c)]) - exact).abs();
                let bd = propagated[(i, c)] + SAFETY * (g * magnitude[(i, c)] + U32 * exact.abs());
                prop_assert!(err <= bd, "optimized layer [{i}, {c}]: {} vs {exact}: {err:e} > {bd:e}", y_opt[(i, c)]);
            }
        }
    }
}

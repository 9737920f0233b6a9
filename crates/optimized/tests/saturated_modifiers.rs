//! One saturation rule for a score modifier's outputs, in both passes of both engines:
//! a user `ScoreMod` that returns `-inf` (or `+inf`) for every score of a row
//! gives that row the uniform weights of scores saturated at `∓L` in the forward, and the
//! gradients of those weights in the backward — the streaming engine's against the
//! reference's and against finite differences of the reference's forward; a derivative of
//! `+inf` there saturates too (no NaN).

use attn_core::{Causal, Options, ScoreMod};
use attn_optimized::attention_backward;
use faer::{Mat, MatRef};

/// Every score becomes `value`; the derivative is `slope` everywhere.
#[derive(Debug)]
struct Constant {
    value: f32,
    slope: f32,
}

impl ScoreMod for Constant {
    fn score(&self, _s: f32, _b: usize, _h: usize, _i: usize, _j: usize) -> f32 {
        self.value
    }
    fn derivative(&self, _s: f32, _b: usize, _h: usize, _i: usize, _j: usize) -> f32 {
        self.slope
    }
}

fn mat(rows: usize, cols: usize, seed: u32, amp: f32) -> Mat<f32> {
    Mat::from_fn(rows, cols, |i, j| {
        let x = (i as u32 * 7919 + j as u32 * 104_729 + seed * 31).wrapping_mul(2_654_435_761);
        amp * ((x >> 8) as f32 / (1u32 << 24) as f32 * 2.0 - 1.0)
    })
}

struct Problem {
    q: Mat<f32>,
    k: Mat<f32>,
    v: Mat<f32>,
    d_out: Mat<f32>,
}

impl Problem {
    fn new(n_q: usize, n_k: usize, d: usize, amp: f32) -> Self {
        Self {
            q: mat(n_q, d, 1, 1.0),
            k: mat(n_k, d, 2, 1.0),
            v: mat(n_k, d, 3, amp),
            d_out: mat(n_q, d, 4, amp),
        }
    }
}

/// `max |a − b|` and `max |b|`.
fn diff(a: MatRef<'_, f32>, b: MatRef<'_, f64>) -> (f64, f64) {
    let mut worst = (0.0f64, 0.0f64);
    for i in 0..a.nrows() {
        for j in 0..a.ncols() {
            let (x, y) = (f64::from(a[(i, j)]), b[(i, j)]);
            assert!(!x.is_nan(), "NaN at ({i}, {j})");
            worst.0 = worst.0.max((x - y).abs());
            worst.1 = worst.1.max(y.abs());
        }
    }
    worst
}

/// The streaming engine's forward output and its backward pass's gradients.
fn streaming(x: &Problem, opts: &Options<'_>) -> (Mat<f32>, attn_core::Gradients<f32>) {
    let (out, lse) =
        attn_optimized::Attention::head(x.q.as_ref(), x.k.as_ref(), x.v.as_ref(), opts)
            .and_then(|call| call.forward(attn_optimized::Par::rayon(0)))
            .map(|f| f.into_parts())
            .unwrap();
    let g = attention_backward(
        x.d_out.as_ref(),
        x.q.as_ref(),
        x.k.as_ref(),
        x.v.as_ref(),
        out.as_ref(),
        &lse,
        opts,
    )
    .unwrap();
    (out, g)
}

/// The streaming engine's forward and backward against the reference's, for `m`.
fn against_reference(x: &Problem, opts: &Options<'_>, tol: f64) {
    let (out, g) = streaming(x, opts);
    let want = attn_reference::Attention::head(x.q.as_ref(), x.k.as_ref(), x.v.as_ref(), opts)
        .and_then(|call| call.backward_materialized(x.d_out.as_ref()))
        .unwrap();
    let (e, m) = diff(out.as_ref(), want.forward.output.as_ref());
    assert!(e <= tol * m.max(1e-30), "forward: error {e} of {m}");
    for (name, got, want) in [
        ("dQ", g.dq.as_ref(), want.dq.as_ref()),
        ("dK", g.dk.as_ref(), want.dk.as_ref()),
        ("dV", g.dv.as_ref(), want.dv.as_ref()),
    ] {
        let (e, m) = diff(got, want);
        assert!(e <= tol * m.max(1e-30), "{name}: error {e} of {m}");
    }
}

/// `-inf` for every score, derivative 0 (a constant's): the forward averages the values,
/// so dQ = dK = 0 and dV_j = Σ_i dO_i / n_k. Before the rule the streaming backward gave
/// dV = 0 (the saturated scores read as hidden keys) — or `n_k` times the truth once
/// saturated, its LSE `-L` not carrying `log2(n_k)`.
#[test]
fn a_modifier_that_returns_minus_infinity_everywhere_has_the_uniform_gradients() {
    let m = Constant {
        value: f32::NEG_INFINITY,
        slope: 0.0,
    };
    for (n_q, n_k) in [(5, 7), (130, 300)] {
        let x = Problem::new(n_q, n_k, 8, 1.0);
        for opts in [
            Options::default().with_score_mod(&m),
            Options::default()
                .with_score_mod(&m)
                .with_causal(Causal::BottomRight),
        ] {
            against_reference(&x, &opts, 1e-5);
        }
        // The truth, by hand: the uniform average (no causal mask).
        let opts = Options::default().with_score_mod(&m);
        let (_, g) = streaming(&x, &opts);
        for c in 0..8 {
            let want: f64 = (0..n_q).map(|i| f64::from(x.d_out[(i, c)])).sum::<f64>() / n_k as f64;
            for j in 0..n_k {
                let got = f64::from(g.dv[(j, c)]);
                assert!(
                    (got - want).abs() <= 1e-5 * (1.0 + want.abs()),
                    "dV ({j}, {c}): {got} vs {want}"
                );
            }
            for i in 0..n_q {
                assert_eq!(g.dq[(i, c)], 0.0);
            }
        }
    }
}

/// `+inf` everywhere saturates at `+L`: the same uniform weights, and their gradients.
#[test]
fn a_modifier_that_returns_plus_infinity_everywhere_has_the_uniform_gradients() {
    let m = Constant {
        value: f32::INFINITY,
        slope: 0.0,
    };
    let x = Problem::new(9, 11, 4, 1.0);
    against_reference(&x, &Options::default().with_score_mod(&m), 1e-5);
}

/// dV by central differences of the reference's f64 forward in V: the saturated rows'
/// weights, whatever the engine.
#[test]
fn the_value_gradient_matches_finite_differences() {
    let m = Constant {
        value: f32::NEG_INFINITY,
        slope: 0.0,
    };
    let x = Problem::new(6, 5, 3, 1.0);
    let opts = Options::default().with_score_mod(&m);
    let (_, g) = streaming(&x, &opts);
    let loss = |v: &Mat<f64>| -> f64 {
        let q = Mat::<f64>::from_fn(6, 3, |i, j| f64::from(x.q[(i, j)]));
        let k = Mat::<f64>::from_fn(5, 3, |i, j| f64::from(x.k[(i, j)]));
        let o = attn_reference::attention(q.as_ref(), k.as_ref(), v.as_ref(), &opts).unwrap();
        (0..6)
            .flat_map(|i| (0..3).map(move |c| (i, c)))
            .map(|(i, c)| o[(i, c)] * f64::from(x.d_out[(i, c)]))
            .sum()
    };
    let v = Mat::<f64>::from_fn(5, 3, |i, j| f64::from(x.v[(i, j)]));
    let h = 1e-4;
    for j in 0..5 {
        for c in 0..3 {
            let (mut up, mut down) = (v.clone(), v.clone());
            up[(j, c)] += h;
            down[(j, c)] -= h;
            let fd = (loss(&up) - loss(&down)) / (2.0 * h);
            let got = f64::from(g.dv[(j, c)]);
            assert!((got - fd).abs() <= 1e-5, "dV ({j}, {c}): {got} vs {fd}");
        }
    }
}

/// A derivative of `+inf` where the modifier returned `-inf`: it saturates at `f32::MAX`
/// in both engines (the reference gave NaN: `0 · inf`, and `inf − inf` in its sums).
#[test]
fn an_infinite_derivative_saturates_in_both_engines() {
    let m = Constant {
        value: f32::NEG_INFINITY,
        slope: f32::INFINITY,
    };
    // Small values keep the saturated gradients (about f32::MAX · 1e-3) inside f32.
    let x = Problem::new(4, 6, 4, 1e-3);
    let opts = Options::default().with_score_mod(&m);
    let want = attn_reference::Attention::head(x.q.as_ref(), x.k.as_ref(), x.v.as_ref(), &opts)
        .and_then(|call| call.backward_materialized(x.d_out.as_ref()))
        .unwrap();
    for (name, g) in [("dQ", &want.dq), ("dK", &want.dk), ("dV", &want.dv)] {
        assert!(
            g.col_iter()
                .flat_map(|c| c.iter().copied())
                .all(f64::is_finite),
            "reference {name} is not finite"
        );
    }
    against_reference(&x, &opts, 1e-4);
}

/// The identity, with a derivative of `slope`.
#[derive(Debug)]
struct Identity {
    slope: f32,
}

impl ScoreMod for Identity {
    fn score(&self, s: f32, _b: usize, _h: usize, _i: usize, _j: usize) -> f32 {
        s
    }
    fn derivative(&self, _s: f32, _b: usize, _h: usize, _i: usize, _j: usize) -> f32 {
        self.slope
    }
}

/// A saturated soft-cap chained with a user modifier whose derivative is `+inf`. In f64
/// `tanh(40)` is 1, the soft-cap's derivative exactly 0, and the chain rule's `0 · inf` was
/// NaN in the reference and in the streaming engine's exact paths (both take the f64
/// derivative); each factor now saturates at `±f32::MAX` first, so the chain is 0. The
/// engines' f32 `tanh` stops short of 1 (its derivative is about 2e-7 there), so their
/// tiles' chain is that times `f32::MAX`: large and finite, never NaN. The gradients of so
/// ill-conditioned a modifier are not compared, only their finiteness; the forward is.
#[test]
fn a_saturated_soft_cap_times_an_infinite_derivative_is_not_nan() {
    let m = Identity {
        slope: f32::INFINITY,
    };
    let cap = attn_core::SoftCap::new(1.0).unwrap();
    let (n_q, n_k, d) = (5, 7, 4);
    let mut x = Problem::new(n_q, n_k, d, 1.0);
    // Every q·k is 4 and the scale 10: s / cap = 40.
    x.q = Mat::from_fn(n_q, d, |_, _| 1.0);
    x.k = Mat::from_fn(n_k, d, |_, _| 1.0);
    let opts = Options::default()
        .with_scale(10.0)
        .with_softcap(cap)
        .with_score_mod(&m);
    let want = attn_reference::Attention::head(x.q.as_ref(), x.k.as_ref(), x.v.as_ref(), &opts)
        .and_then(|call| call.backward_materialized(x.d_out.as_ref()))
        .unwrap();
    let zero = |g: MatRef<'_, f64>| {
        g.col_iter()
            .flat_map(|c| c.iter().copied())
            .all(|x| x == 0.0)
    };
    assert!(
        zero(want.dq.as_ref()) && zero(want.dk.as_ref()),
        "reference dQ, dK"
    );
    let (out, g) = streaming(&x, &opts);
    let (e, top) = diff(out.as_ref(), want.forward.output.as_ref());
    assert!(e <= 1e-5 * top, "forward: error {e} of {top}");
    for (name, grad) in [("dQ", &g.dq), ("dK", &g.dk), ("dV", &g.dv)] {
        let finite = grad
            .col_iter()
            .flat_map(|c| c.iter().copied())
            .all(f32::is_finite);
        assert!(finite, "streaming {name} is not finite");
    }
}

/// Found by the same rule beyond the modifiers: a row biased entirely by `f32::MIN` (Hugging
/// Face's padding convention) is the average of its values, its LSE `-L`; its weights are
/// `1/n_k` in the backward too (they were 1 each, from `exp(s − LSE)`, before the saturated
/// rows were given their top keys' count).
#[test]
fn a_row_biased_by_f32_min_has_the_uniform_gradients() {
    let (n_q, n_k) = (6, 9);
    let x = Problem::new(n_q, n_k, 4, 1.0);
    let bias = Mat::from_fn(n_q, n_k, |i, j| {
        if i % 2 == 0 {
            f32::MIN
        } else {
            (j as f32) * 0.1
        }
    });
    against_reference(
        &x,
        &Options::default().with_additive_mask(bias.as_ref()),
        1e-5,
    );
    // And +inf on every key of a row: all of them at +L.
    let bias = Mat::from_fn(n_q, n_k, |i, _| if i == 1 { f32::INFINITY } else { 0.0 });
    against_reference(
        &x,
        &Options::default().with_additive_mask(bias.as_ref()),
        1e-5,
    );
}

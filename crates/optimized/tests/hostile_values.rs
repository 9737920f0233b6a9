//! The contract's rules for hostile values, in both engines: each
//! test failed before the rule was implemented.
//!
//! - a window bound near `usize::MAX` means "unbounded on that side";
//! - a structurally hidden key is hidden whatever its bias says;
//! - a scale whose `scale·log2(e)` overflows f32 is rejected;
//! - a finite bias stays finite (`f32::MIN` does not hide), and a visible score beyond
//!   f32 saturates at the contract's limit instead of becoming NaN or a hidden key;
//! - a `-inf` bias hides its key exactly as a boolean mask does (a NaN or ±inf K row there
//!   never reaches the row);
//! - the batched LSE with `d_v = 0` is the single-head one.

use attn_core::{BoolMask, Causal, Error, Layout, Options, SlidingWindow, Tensor4Ref};
use faer::{Mat, MatRef};
use half::f16;

fn data(n: usize, d: usize, seed: usize) -> Mat<f32> {
    Mat::from_fn(n, d, |i, j| {
        (((i * 31 + j * 7 + seed) % 17) as f32 - 8.0) / 8.0
    })
}

/// The optimized engine (f32 and f16 storage) and the reference on one head.
fn both(
    q: MatRef<'_, f32>,
    k: MatRef<'_, f32>,
    v: MatRef<'_, f32>,
    opts: &Options<'_>,
) -> Vec<(String, Mat<f32>, Vec<f32>)> {
    let (o, lse) = attn_optimized::Attention::head(q, k, v, opts)
        .and_then(|call| call.forward(attn_optimized::Par::rayon(0)))
        .map(|f| f.into_parts())
        .expect("optimized f32");
    let m = attn_reference::Attention::head(q, k, v, opts)
        .and_then(|call| call.materialized())
        .expect("reference");
    let r = Mat::from_fn(m.output.nrows(), m.output.ncols(), |i, j| {
        m.output[(i, j)] as f32
    });
    let rlse = m.lse.iter().map(|&l| l as f32).collect();
    let h =
        |m: MatRef<'_, f32>| Mat::from_fn(m.nrows(), m.ncols(), |i, j| f16::from_f32(m[(i, j)]));
    let (qh, kh, vh) = (h(q), h(k), h(v));
    let (oh, lseh) = attn_optimized::Attention::head(qh.as_ref(), kh.as_ref(), vh.as_ref(), opts)
        .and_then(|call| call.forward(attn_optimized::Par::rayon(0)))
        .map(|f| f.into_parts())
        .expect("optimized f16");
    let oh = Mat::from_fn(oh.nrows(), oh.ncols(), |i, j| oh[(i, j)].to_f32());
    vec![
        ("optimized f32".into(), o, lse),
        ("reference".into(), r, rlse),
        ("optimized f16".into(), oh, lseh),
    ]
}

fn assert_close(what: &str, a: MatRef<'_, f32>, b: MatRef<'_, f32>, tol: f32) {
    assert_eq!((a.nrows(), a.ncols()), (b.nrows(), b.ncols()), "{what}");
    for i in 0..a.nrows() {
        for j in 0..a.ncols() {
            let (x, y) = (a[(i, j)], b[(i, j)]);
            assert!(
                x.is_finite() && (x - y).abs() <= tol,
                "{what} ({i}, {j}): {x} vs {y}"
            );
        }
    }
}

#[test]
fn window_bounds_near_usize_max_mean_unbounded() {
    // Rows of the GEMM tiles (n_q = 9) and of the row tiles (n_q = 1 against 600 keys).
    for (n_q, n_k) in [(9, 9), (1, 600), (130, 700)] {
        let (q, k, v) = (data(n_q, 8, 1), data(n_k, 8, 2), data(n_k, 8, 3));
        for align in [Causal::TopLeft, Causal::BottomRight] {
            let cases = [
                // Everything before the diagonal and nothing after: plain causal.
                (
                    SlidingWindow::new(Some(usize::MAX), Some(0), align),
                    SlidingWindow::new(None, Some(0), align),
                ),
                (
                    SlidingWindow::new(Some(usize::MAX - 1), Some(usize::MAX), align),
                    SlidingWindow::new(None, None, align),
                ),
                (
                    SlidingWindow::new(Some(3), Some(usize::MAX / 2), align),
                    SlidingWindow::new(Some(3), None, align),
                ),
            ];
            for (huge, unbounded) in cases {
                let a = both(
                    q.as_ref(),
                    k.as_ref(),
                    v.as_ref(),
                    &Options::default().with_window(huge),
                );
                let b = both(
                    q.as_ref(),
                    k.as_ref(),
                    v.as_ref(),
                    &Options::default().with_window(unbounded),
                );
                for ((name, oa, la), (_, ob, lb)) in a.iter().zip(&b) {
                    let what = format!("{name} {huge:?} n_q={n_q}");
                    assert_eq!(oa, ob, "{what}");
                    assert_eq!(la, lb, "{what}");
                    assert!(
                        la.iter().all(|l| l.is_finite()),
                        "{what}: rows lost their keys"
                    );
                }
            }
        }
    }
}

#[test]
fn a_structurally_hidden_key_ignores_its_bias() {
    for (n_q, n_k) in [(20, 20), (1, 700), (140, 600)] {
        let (q, k, v) = (data(n_q, 16, 4), data(n_k, 16, 5), data(n_k, 16, 6));
        let len = n_k - 3;
        let off = n_k as i64 - n_q as i64;
        // NaN and +inf exactly where causal (bottom-right) or the key length hides the key.
        let poisoned = Mat::<f32>::from_fn(n_q, n_k, |i, j| {
            if j as i64 > i as i64 + off || j >= len {
                if (i + j) % 2 == 0 {
                    f32::NAN
                } else {
                    f32::INFINITY
                }
            } else {
                0.25
            }
        });
        let clean = Mat::<f32>::from_fn(n_q, n_k, |i, j| {
            if poisoned[(i, j)].is_finite() {
                0.25
            } else {
                0.0
            }
        });
        let opts = |m| {
            Options::default()
                .with_causal(Causal::BottomRight)
                .with_key_length(len)
                .with_additive_mask(m)
        };
        let a = both(q.as_ref(), k.as_ref(), v.as_ref(), &opts(poisoned.as_ref()));
        let b = both(q.as_ref(), k.as_ref(), v.as_ref(), &opts(clean.as_ref()));
        for ((name, oa, la), (_, ob, lb)) in a.iter().zip(&b) {
            assert_eq!(oa, ob, "{name} n_q={n_q}");
            assert_eq!(la, lb, "{name} n_q={n_q}");
        }
    }
}

#[test]
fn a_scale_whose_base_2_form_overflows_is_rejected() {
    let (q, k) = (data(3, 8, 1), data(4, 8, 2));
    for scale in [f32::MAX, 2.4e38, f32::INFINITY] {
        let opts = Options::default().with_scale(scale);
        let want = Err(Error::InvalidScale(scale));
        assert_eq!(
            attn_optimized::attention(q.as_ref(), k.as_ref(), k.as_ref(), &opts).map(|_| ()),
            want
        );
        assert_eq!(
            attn_reference::attention(q.as_ref(), k.as_ref(), k.as_ref(), &opts).map(|_| ()),
            want
        );
    }
    // The largest accepted scales still give numbers (zero dot products: a uniform average).
    let zeros = Mat::<f32>::zeros(3, 8);
    let v = data(4, 8, 3);
    for (name, o, lse) in both(
        zeros.as_ref(),
        k.as_ref(),
        v.as_ref(),
        &Options::default().with_scale(2.3e38),
    ) {
        let mean = Mat::<f32>::from_fn(3, 8, |_, c| (0..4).map(|j| v[(j, c)]).sum::<f32>() / 4.0);
        assert_close(&name, o.as_ref(), mean.as_ref(), 1e-6);
        assert!(
            lse.iter().all(|l| (l - 4f32.ln()).abs() < 1e-6),
            "{name}: {lse:?}"
        );
    }
}

#[test]
fn a_row_masked_with_f32_min_is_an_average_not_empty() {
    // The Hugging Face padding convention: every key of row 1 biased by f32::MIN.
    for (n_q, n_k) in [(6, 5), (1, 5), (1, 700), (130, 40)] {
        let (q, k, v) = (data(n_q, 8, 7), data(n_k, 8, 8), data(n_k, 8, 9));
        let bias = Mat::<f32>::from_fn(
            n_q,
            n_k,
            |i, j| if i == 0 || j % 3 == 0 { f32::MIN } else { 0.0 },
        );
        for (name, o, lse) in both(
            q.as_ref(),
            k.as_ref(),
            v.as_ref(),
            &Options::default().with_additive_mask(bias.as_ref()),
        ) {
            // Row 0: every score saturates at the same value, the weights are uniform.
            let mean = Mat::<f32>::from_fn(1, 8, |_, c| {
                (0..n_k).map(|j| v[(j, c)]).sum::<f32>() / n_k as f32
            });
            let tol = if name.contains("f16") { 2e-2 } else { 1e-5 };
            assert_close(
                &format!("{name} row 0"),
                o.as_ref().subrows(0, 1),
                mean.as_ref(),
                tol,
            );
            assert!(lse.iter().all(|l| l.is_finite()), "{name}: {lse:?}");
        }
    }
}

#[test]
fn visible_scores_beyond_f32_saturate() {
    // Key 0's dot product with every query overflows f32 (+inf); the rest are ordinary:
    // key 0 takes all the weight. Then every key overflows negatively: all saturate at the
    // same value, so the row is the uniform average — not NaN, not an empty row. (f32
    // storage only: 1e30 is beyond f16, and f16 inputs cannot overflow an f32 score.)
    let f32_engines = |runs: Vec<(String, Mat<f32>, Vec<f32>)>| {
        runs.into_iter().filter(|(name, ..)| !name.contains("f16"))
    };
    for (n_q, n_k) in [(6, 5), (1, 5), (1, 600), (130, 20)] {
        let q = Mat::<f32>::from_fn(n_q, 4, |_, _| 1e30);
        let v = data(n_k, 4, 10);
        let k = Mat::<f32>::from_fn(n_k, 4, |j, _| if j == 0 { 1e30 } else { 0.5 });
        for (name, o, lse) in f32_engines(both(
            q.as_ref(),
            k.as_ref(),
            v.as_ref(),
            &Options::default(),
        )) {
            let want = Mat::<f32>::from_fn(n_q, 4, |_, c| v[(0, c)]);
            assert_close(
                &format!("{name} +overflow n_q={n_q}"),
                o.as_ref(),
                want.as_ref(),
                1e-6,
            );
            assert!(lse.iter().all(|l| l.is_finite()), "{name}: {lse:?}");
        }
        let k = Mat::<f32>::from_fn(n_k, 4, |_, _| -1e30);
        for (name, o, lse) in both(q.as_ref(), k.as_ref(), v.as_ref(), &Options::default()) {
            let mean = Mat::<f32>::from_fn(n_q, 4, |_, c| {
                (0..n_k).map(|j| v[(j, c)]).sum::<f32>() / n_k as f32
            });
            let tol = if name.contains("f16") { 2e-2 } else { 1e-5 };
            assert_close(
                &format!("{name} -overflow n_q={n_q}"),
                o.as_ref(),
                mean.as_ref(),
                tol,
            );
            assert!(lse.iter().all(|l| l.is_finite()), "{name}: {lse:?}");
        }
    }
}

#[test]
fn a_score_overflowing_below_in_a_masked_block_saturates_instead_of_hiding() {
    // Causal: every block on the diagonal hides some keys. Every visible score overflows
    // to -inf in f32: each row is the average of the values it sees (all saturated at the
    // same -L), not an empty row — in the forward's GEMM and row tiles alike.
    for (n_q, n_k) in [(6, 6), (1, 5), (130, 130), (3, 600)] {
        let q = Mat::<f32>::from_fn(n_q, 4, |_, _| 1e30);
        let k = Mat::<f32>::from_fn(n_k, 4, |_, _| -1e30);
        let v = data(n_k, 4, 10);
        let opts = Options::default().with_causal(Causal::BottomRight);
        let off = n_k - n_q;
        let (o, lse) = attn_optimized::Attention::head(q.as_ref(), k.as_ref(), v.as_ref(), &opts)
            .and_then(|call| call.forward(attn_optimized::Par::rayon(0)))
            .map(|f| f.into_parts())
            .expect("optimized");
        let mean = Mat::<f32>::from_fn(n_q, 4, |i, c| {
            let seen = i + off + 1;
            (0..seen).map(|j| v[(j, c)]).sum::<f32>() / seen as f32
        });
        assert_close(
            &format!("n_q={n_q} n_k={n_k}"),
            o.as_ref(),
            mean.as_ref(),
            1e-5,
        );
        assert!(lse.iter().all(|l| l.is_finite()), "{lse:?}");
    }
}

#[test]
fn a_minus_inf_bias_hides_a_non_finite_key_like_a_boolean_mask() {
    for (n_q, n_k) in [(9, 9), (1, 9), (1, 700), (130, 600)] {
        let q = data(n_q, 8, 11);
        let v = data(n_k, 8, 12);
        let mut k = data(n_k, 8, 13);
        let hidden = [2, n_k / 2, n_k - 1];
        for (h, &j) in hidden.iter().enumerate() {
            k[(j, h % 8)] = [f32::NAN, f32::INFINITY, f32::NEG_INFINITY][h];
        }
        let additive = Mat::<f32>::from_fn(n_q, n_k, |_, j| {
            if hidden.contains(&j) {
                f32::NEG_INFINITY
            } else {
                0.0
            }
        });
        let boolean = Mat::<bool>::from_fn(n_q, n_k, |_, j| hidden.contains(&j));
        let a = both(
            q.as_ref(),
            k.as_ref(),
            v.as_ref(),
            &Options::default().with_additive_mask(additive.as_ref()),
        );
        let b = both(
            q.as_ref(),
            k.as_ref(),
            v.as_ref(),
            &Options::default().with_bool_mask(BoolMask::block(boolean.as_ref())),
        );
        for ((name, oa, la), (_, ob, lb)) in a.iter().zip(&b) {
            assert_close(&format!("{name} n_q={n_q}"), oa.as_ref(), ob.as_ref(), 1e-6);
            assert!(
                la.iter().zip(lb).all(|(x, y)| (x - y).abs() < 1e-5),
                "{name}: {la:?} vs {lb:?}"
            );
        }
    }
}

#[test]
fn batched_lse_with_zero_width_values_is_the_single_head_one() {
    let (b, h, n_q, n_k, d) = (2, 2, 3, 5, 4);
    let qd: Vec<f32> = (0..b * h * n_q * d).map(|x| (x % 7) as f32 * 0.1).collect();
    let kd: Vec<f32> = (0..b * h * n_k * d).map(|x| (x % 5) as f32 * 0.2).collect();
    let q = Tensor4Ref::from_layout(&qd, [b, h, n_q, d], Layout::Bhsd).unwrap();
    let k = Tensor4Ref::from_layout(&kd, [b, h, n_k, d], Layout::Bhsd).unwrap();
    let v = Tensor4Ref::from_layout(&[][..], [b, h, n_k, 0], Layout::Bhsd).unwrap();
    let (_, lse) = attn_optimized::Attention::batched(q, k, v, &Options::default())
        .and_then(|call| call.forward(attn_optimized::Par::rayon(0)))
        .map(|f| f.into_parts())
        .unwrap();
    for bi in 0..b {
        for hi in 0..h {
            let (_, want) = attn_optimized::Attention::head(
                q.head(bi, hi).unwrap(),
                k.head(bi, hi).unwrap(),
                v.head(bi, hi).unwrap(),
                &Options::default(),
            )
            .and_then(|call| call.forward(attn_optimized::Par::rayon(0)))
            .map(|f| f.into_parts())
            .unwrap();
            let got = &lse[(bi * h + hi) * n_q..(bi * h + hi + 1) * n_q];
            assert_eq!(got, &want[..], "batch {bi} head {hi}");
            assert!(got.iter().all(|l| l.is_finite()));
        }
    }
}

/// The largest `|x − y|` over two matrices, relative to the largest finite `|y|`. Where
/// `y` is infinite (an exact value beyond f32, rounded), `x` must be the same infinity;
/// anything else not finite is NaN.
fn relative_error(a: MatRef<'_, f32>, b: MatRef<'_, f32>) -> f32 {
    let mut scale = 0.0f32;
    let mut err = 0.0f32;
    for i in 0..a.nrows() {
        for j in 0..a.ncols() {
            let (x, y) = (a[(i, j)], b[(i, j)]);
            if y.is_infinite() && x == y {
                continue;
            }
            if !x.is_finite() || !y.is_finite() {
                return f32::NAN;
            }
            scale = scale.max(y.abs());
            err = err.max((x - y).abs());
        }
    }
    if scale == 0.0 { err } else { err / scale }
}

/// Queries `[x, x]` against keys `[c, −c]`: every product overflows f32 (`1e20 · 1e20`), the
/// dot products are exactly 0. Summed in f32 they are NaN (`inf − inf`); the engine must
/// recompute them and give the uniform average of the values, as the reference does — on
/// the GEMM tiles (6, 130 queries), the row tiles (1 query), split-KV (1 query, 3000 keys)
/// and with a scale that takes `q · scale·log2(e)` itself beyond f32.
#[test]
fn dot_products_that_overflow_and_cancel_are_recomputed_exactly() {
    for (n_q, n_k, x, scale) in [
        (6, 5, 1e20f32, None),
        (130, 20, 3e19, None),
        (1, 7, 1e20, None),
        (1, 3000, 2e20, None),
        (5, 9, 1e10, Some(1e30f32)),
        (1, 9, 1e10, Some(1e30)),
    ] {
        let q = Mat::<f32>::from_fn(n_q, 2, |i, _| x * (1.0 + i as f32 / 8.0));
        let k = Mat::<f32>::from_fn(n_k, 2, |j, c| {
            let c_j = 1e20 * (1.0 + (j % 5) as f32);
            if c == 0 { c_j } else { -c_j }
        });
        let v = data(n_k, 3, 4);
        let opts = scale.map_or(Options::default(), |s| Options::default().with_scale(s));
        let mean = Mat::<f32>::from_fn(n_q, 3, |_, c| {
            (0..n_k).map(|j| v[(j, c)]).sum::<f32>() / n_k as f32
        });
        let (o, lse) = attn_optimized::Attention::head(q.as_ref(), k.as_ref(), v.as_ref(), &opts)
            .and_then(|call| call.forward(attn_optimized::Par::rayon(0)))
            .map(|f| f.into_parts())
            .expect("optimized");
        assert_close(&format!("{n_q}×{n_k}"), o.as_ref(), mean.as_ref(), 1e-5);
        let uniform = (n_k as f32).ln();
        assert!(lse.iter().all(|l| (l - uniform).abs() < 1e-5), "{lse:?}");
        let r = attn_reference::attention(q.as_ref(), k.as_ref(), v.as_ref(), &opts)
            .expect("reference");
        assert_close(
            &format!("reference {n_q}×{n_k}"),
            r.as_ref(),
            mean.as_ref(),
            1e-5,
        );
    }
}

/// Values near `f32::MAX`: the unnormalised `Σ p·v` of the streaming engine overflows f32
/// while the output (a weighted average) does not. The row is recomputed exactly.
#[test]
fn values_near_f32_max_give_their_average() {
    for (n_q, n_k) in [(6, 40), (130, 300), (1, 9), (1, 3000)] {
        let q = data(n_q, 4, 1);
        let k = data(n_k, 4, 2);
        let v = Mat::<f32>::from_fn(n_k, 3, |j, c| {
            f32::MAX
                * (0.5 + 0.5 * ((j * 3 + c) % 7) as f32 / 7.0)
                * if c == 1 { -1.0 } else { 1.0 }
        });
        let opts = Options::default().with_causal(Causal::BottomRight);
        let (o, lse) = attn_optimized::Attention::head(q.as_ref(), k.as_ref(), v.as_ref(), &opts)
            .and_then(|call| call.forward(attn_optimized::Par::rayon(0)))
            .map(|f| f.into_parts())
            .expect("optimized");
        let m = attn_reference::Attention::head(q.as_ref(), k.as_ref(), v.as_ref(), &opts)
            .and_then(|call| call.materialized())
            .expect("reference");
        let want = Mat::<f32>::from_fn(n_q, 3, |i, c| m.output[(i, c)] as f32);
        let err = relative_error(o.as_ref(), want.as_ref());
        assert!(err < 1e-5, "{n_q}×{n_k}: relative error {err}");
        for (l, r) in lse.iter().zip(&m.lse) {
            assert!((f64::from(*l) - r).abs() < 1e-4, "{l} vs {r}");
        }
    }
}

/// The backward pass with the same hostile magnitudes: dot products that overflow and
/// cancel (recomputed in the score tiles), and values near `f32::MAX` whose `dP = dO Vᵀ`
/// overflows in f32 (`0.6·MAX + 0.6·MAX − 0.6·MAX`) while nothing exact does (those gradient
/// rows are recomputed). Gradients finite, and the reference's.
#[test]
fn backward_gradients_survive_products_that_overflow_f32() {
    let small = |n: usize, d: usize, seed: usize| {
        let m = data(n, d, seed);
        Mat::<f32>::from_fn(n, d, |i, j| 0.05 * m[(i, j)])
    };
    for (n_q, n_k, huge_v) in [(6, 5, false), (130, 20, false), (6, 40, true), (1, 9, true)] {
        let (q, k, v, d_out) = if huge_v {
            let v = Mat::<f32>::from_fn(n_k, 3, |j, c| {
                f32::MAX * (0.5 + 0.1 * ((j + c) % 3) as f32 / 2.0)
            });
            let d_out = Mat::<f32>::from_fn(n_q, 3, |i, c| {
                (1.0 + i as f32 / 64.0) * if c == 2 { -1.0 } else { 1.0 }
            });
            (small(n_q, 2, 1), small(n_k, 2, 2), v, d_out)
        } else {
            let q = Mat::<f32>::from_fn(n_q, 2, |i, _| 1e20 * (1.0 + i as f32 / 8.0));
            let k = Mat::<f32>::from_fn(n_k, 2, |j, c| {
                let c_j = 1e20 * (1.0 + (j % 5) as f32);
                if c == 0 { c_j } else { -c_j }
            });
            (q, k, data(n_k, 3, 4), data(n_q, 3, 7))
        };
        let opts = Options::default();
        let (o, lse) = attn_optimized::Attention::head(q.as_ref(), k.as_ref(), v.as_ref(), &opts)
            .and_then(|call| call.forward(attn_optimized::Par::rayon(0)))
            .map(|f| f.into_parts())
            .expect("forward");
        let args = (
            d_out.as_ref(),
            q.as_ref(),
            k.as_ref(),
            v.as_ref(),
            o.as_ref(),
        );
        let g =
            attn_optimized::attention_backward(args.0, args.1, args.2, args.3, args.4, &lse, &opts)
                .expect("backward");
        let r =
            attn_reference::attention_backward(args.0, args.1, args.2, args.3, args.4, &lse, &opts)
                .expect("reference backward");
        for (name, a, b) in [
            ("dQ", &g.dq, &r.dq),
            ("dK", &g.dk, &r.dk),
            ("dV", &g.dv, &r.dv),
        ] {
            let err = relative_error(a.as_ref(), b.as_ref());
            assert!(err < 1e-3, "{name} {n_q}×{n_k}: relative error {err}");
        }
    }
}

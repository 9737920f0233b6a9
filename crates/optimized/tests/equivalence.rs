//! The streaming engine against the f64 reference: every mask kind, shapes that straddle
//! the tiles, extreme logits, fully masked rows, determinism across thread counts.

use attn_optimized::{
    BoolMask, Causal, Layout, MultiHeadAttention, Options, PartialState, SlidingWindow, Tensor4,
    Tensor4Mut, Tensor4Ref, attention,
};
use faer::Mat;

mod common;
use common::{f32_bound as bound, in_pool, max_abs};

fn mat(rows: usize, cols: usize, seed: u64, amp: f32) -> Mat<f32> {
    common::mat(rows, cols, seed, amp)
}

fn check(q: &Mat<f32>, k: &Mat<f32>, v: &Mat<f32>, opts: &Options<'_>, what: &str) {
    let (o, lse) = attn_optimized::Attention::head(q.as_ref(), k.as_ref(), v.as_ref(), opts)
        .and_then(|call| call.forward(attn_optimized::Par::rayon(0)))
        .map(|f| f.into_parts())
        .unwrap();
    let r = attn_reference::Attention::head(q.as_ref(), k.as_ref(), v.as_ref(), opts)
        .and_then(|call| call.materialized())
        .unwrap();
    let scale = opts.scale_for(q.ncols()).unwrap();
    let tol = bound(q.as_ref(), k.as_ref(), v.as_ref(), scale);
    for i in 0..q.nrows() {
        if r.lse[i] == f64::NEG_INFINITY {
            assert_eq!(lse[i], f32::NEG_INFINITY, "{what}: row {i} LSE");
            assert!(
                (0..v.ncols()).all(|c| o[(i, c)] == 0.0),
                "{what}: fully masked row {i} must be 0"
            );
            continue;
        }
        let lse_tol = 1e-5 * (1.0 + r.lse[i].abs()) + f64::from(tol);
        assert!(
            (f64::from(lse[i]) - r.lse[i]).abs() <= lse_tol,
            "{what}: row {i} LSE {} vs {}",
            lse[i],
            r.lse[i]
        );
        for c in 0..v.ncols() {
            let err = (f64::from(o[(i, c)]) - r.output[(i, c)]).abs();
            assert!(
                err <= f64::from(tol),
                "{what}: ({i},{c}) {} vs {} (err {err:e} > {tol:e})",
                o[(i, c)],
                r.output[(i, c)]
            );
        }
    }
}

const SHAPES: &[(usize, usize, usize, usize)] = &[
    (1, 1, 1, 1),
    (1, 7, 3, 5),
    (3, 1, 4, 2),
    (4, 2000, 64, 64),
    (6, 700, 16, 0),
    (127, 129, 64, 64),
    (128, 512, 64, 32),
    (129, 513, 16, 16),
    (300, 1100, 8, 8),
    (5, 3000, 32, 48),
    (130, 600, 256, 200),
];

#[test]
fn matches_reference_without_masks() {
    for (t, &(n_q, n_k, d_k, d_v)) in SHAPES.iter().enumerate() {
        let (q, k, v) = (
            mat(n_q, d_k, t as u64, 1.0),
            mat(n_k, d_k, 100 + t as u64, 1.0),
            mat(n_k, d_v, 200 + t as u64, 1.0),
        );
        check(
            &q,
            &k,
            &v,
            &Options::default(),
            &format!("shape {:?}", SHAPES[t]),
        );
    }
}

#[test]
fn matches_reference_with_every_mask_kind() {
    for (t, &(n_q, n_k, d_k, d_v)) in SHAPES.iter().enumerate() {
        let (q, k, v) = (
            mat(n_q, d_k, t as u64, 2.0),
            mat(n_k, d_k, 100 + t as u64, 2.0),
            mat(n_k, d_v, 200 + t as u64, 1.0),
        );
        let allow = Mat::from_fn(n_q, n_k, |i, j| (i * 31 + j * 17) % 7 != 0);
        let additive = Mat::from_fn(n_q, n_k, |i, j| match (i + 3 * j) % 11 {
            0 => f32::NEG_INFINITY,
            r => r as f32 * 0.3 - 1.5,
        });
        let cases: Vec<(&str, Options<'_>)> = vec![
            (
                "causal top-left",
                Options::default().with_causal(Causal::TopLeft),
            ),
            (
                "causal bottom-right",
                Options::default().with_causal(Causal::BottomRight),
            ),
            (
                "window",
                Options::default().with_window(SlidingWindow::new(
                    Some(37),
                    Some(5),
                    Causal::BottomRight,
                )),
            ),
            (
                "left window only",
                Options::default().with_window(SlidingWindow::new(
                    Some(600),
                    None,
                    Causal::TopLeft,
                )),
            ),
            ("padding", Options::default().with_key_length(n_k - n_k / 3)),
            (
                "allow",
                Options::default().with_bool_mask(BoolMask::allow(allow.as_ref())),
            ),
            (
                "block",
                Options::default().with_bool_mask(BoolMask::block(allow.as_ref())),
            ),
            (
                "additive",
                Options::default().with_additive_mask(additive.as_ref()),
            ),
            (
                "all combined",
                Options::default()
                    .with_causal(Causal::BottomRight)
                    .with_window(SlidingWindow::new(Some(300), Some(0), Causal::BottomRight))
                    .with_key_length(n_k - n_k / 5)
                    .with_bool_mask(BoolMask::allow(allow.as_ref()))
                    .with_additive_mask(additive.as_ref()),
            ),
        ];
        for (name, opts) in &cases {
            check(&q, &k, &v, opts, &format!("{name} {:?}", SHAPES[t]));
        }
    }
}

#[test]
fn extreme_logits_stay_finite_and_exact() {
    let (q, k, v) = (
        mat(200, 64, 1, 1.0),
        mat(700, 64, 2, 1.0),
        mat(700, 64, 3, 1.0),
    );
    for scale in [300.0 / 8.0, 1000.0 / 8.0] {
        let opts = Options::default().with_scale(scale);
        check(&q, &k, &v, &opts, "scale x300");
        let causal = opts.with_causal(Causal::BottomRight);
        check(&q, &k, &v, &causal, "scale x300 causal");
    }
    // Logits of ±1e4 through the additive mask.
    let add = Mat::from_fn(200, 700, |i, j| if (i + j) % 3 == 0 { 1e4 } else { -1e4 });
    check(
        &q,
        &k,
        &v,
        &Options::default().with_additive_mask(add.as_ref()),
        "additive ±1e4",
    );
}

#[test]
fn fully_masked_rows_are_zero_with_lse_minus_inf() {
    // Bottom-right causal with n_q > n_k: the first n_q − n_k rows see nothing.
    let (q, k, v) = (
        mat(600, 16, 1, 1.0),
        mat(150, 16, 2, 1.0),
        mat(150, 8, 3, 1.0),
    );
    let opts = Options::default().with_causal(Causal::BottomRight);
    let (o, lse) = attn_optimized::Attention::head(q.as_ref(), k.as_ref(), v.as_ref(), &opts)
        .and_then(|call| call.forward(attn_optimized::Par::rayon(0)))
        .map(|f| f.into_parts())
        .unwrap();
    for i in 0..450 {
        assert_eq!(lse[i], f32::NEG_INFINITY);
        assert!((0..8).all(|c| o[(i, c)] == 0.0));
    }
    assert!(lse[450..].iter().all(|l| l.is_finite()));
    check(&q, &k, &v, &opts, "bottom-right n_q > n_k");
    // No keys at all.
    let (o, lse) = attn_optimized::Attention::head(
        q.as_ref(),
        k.subrows(0, 0),
        v.subrows(0, 0),
        &Options::default(),
    )
    .and_then(|call| call.forward(attn_optimized::Par::rayon(0)))
    .map(|f| f.into_parts())
    .unwrap();
    assert!(lse.iter().all(|&l| l == f32::NEG_INFINITY));
    assert_eq!(max_abs(o.as_ref()), 0.0);
    // No queries.
    let o = attention(q.subrows(0, 0), k.as_ref(), v.as_ref(), &Options::default()).unwrap();
    assert_eq!((o.nrows(), o.ncols()), (0, 8));
}

#[test]
fn nan_touches_only_its_rows() {
    let (mut q, k, v) = (
        mat(300, 16, 1, 1.0),
        mat(700, 16, 2, 1.0),
        mat(700, 8, 3, 1.0),
    );
    q[(130, 5)] = f32::NAN;
    let o = attention(q.as_ref(), k.as_ref(), v.as_ref(), &Options::default()).unwrap();
    for i in 0..300 {
        assert_eq!(o[(i, 0)].is_nan(), i == 130, "row {i}");
    }
}

#[test]
fn bits_do_not_depend_on_thread_count() {
    let (q, k, v) = (
        mat(700, 64, 1, 1.0),
        mat(900, 64, 2, 1.0),
        mat(900, 64, 3, 1.0),
    );
    let dec = mat(3, 64, 4, 1.0); // decode-shaped: split-KV path
    let opts = Options::default().with_causal(Causal::BottomRight);
    let run = || {
        (
            attn_optimized::Attention::head(q.as_ref(), k.as_ref(), v.as_ref(), &opts)
                .and_then(|call| call.forward(attn_optimized::Par::rayon(0)))
                .map(|f| f.into_parts())
                .unwrap(),
            attn_optimized::Attention::head(dec.as_ref(), k.as_ref(), v.as_ref(), &opts)
                .and_then(|call| call.forward(attn_optimized::Par::rayon(0)))
                .map(|f| f.into_parts())
                .unwrap(),
            attn_optimized::Attention::head(
                dec.as_ref(),
                mat(5000, 64, 5, 1.0).as_ref(),
                mat(5000, 64, 6, 1.0).as_ref(),
                &opts,
            )
            .and_then(|call| call.forward(attn_optimized::Par::rayon(0)))
            .map(|f| f.into_parts())
            .unwrap(),
        )
    };
    let one = in_pool(1, run);
    for t in [2, 3] {
        assert_eq!(in_pool(t, run), one, "{t} threads");
    }
}

#[test]
fn split_kv_path_matches_reference() {
    // 1 head, 1 query tile, 5000 keys: below the task threshold, so keys are split.
    let (q, k, v) = (
        mat(2, 32, 1, 1.0),
        mat(5000, 32, 2, 1.0),
        mat(5000, 16, 3, 1.0),
    );
    check(&q, &k, &v, &Options::default(), "split-KV");
    check(
        &q,
        &k,
        &v,
        &Options::default().with_key_length(2500),
        "split-KV padded",
    );
    check(
        &q,
        &k,
        &v,
        &Options::default().with_causal(Causal::TopLeft),
        "split-KV mostly hidden",
    );
}

#[test]
fn sharded_keys_merged_in_ring_order_equal_one_pass() {
    let (n_q, n_k) = (40, 333);
    let (q, k, v) = (
        mat(n_q, 16, 1, 1.0),
        mat(n_k, 16, 2, 1.0),
        mat(n_k, 8, 3, 1.0),
    );
    for causal in [None, Some(Causal::BottomRight)] {
        let opts = Options {
            causal,
            ..Options::default()
        };
        let (full, full_lse) =
            attn_optimized::Attention::head(q.as_ref(), k.as_ref(), v.as_ref(), &opts)
                .and_then(|call| call.forward(attn_optimized::Par::rayon(0)))
                .map(|f| f.into_parts())
                .unwrap();
        for ranks in 1..=5 {
            let bounds: Vec<usize> = (0..=ranks).map(|r| r * n_k / ranks).collect();
            let mut state = PartialState::empty(n_q, 8);
            for r in 0..ranks {
                let keys = bounds[r]..bounds[r + 1];
                let shard = attn_optimized::Attention::keys_of(
                    q.as_ref(),
                    k.subrows(keys.start, keys.len()),
                    v.subrows(keys.start, keys.len()),
                    keys,
                    n_k,
                    &opts,
                )
                .and_then(|call| call.partial_state(attn_optimized::Par::rayon(0)))
                .unwrap();
                state.merge_in_place(&shard).unwrap();
            }
            let tol = bound(q.as_ref(), k.as_ref(), v.as_ref(), 0.25);
            for i in 0..n_q {
                assert!((state.lse()[i] - full_lse[i]).abs() <= 1e-5 * (1.0 + full_lse[i].abs()));
                for c in 0..8 {
                    assert!(
                        (state.output()[(i, c)] - full[(i, c)]).abs() <= tol,
                        "P={ranks} ({i},{c})"
                    );
                }
            }
        }
    }
}

#[test]
fn merge_with_empty_is_identity_bit_for_bit() {
    let (q, k, v) = (mat(9, 8, 1, 3.0), mat(20, 8, 2, 3.0), mat(20, 4, 3, 3.0));
    let s = attn_optimized::Attention::keys_of(
        q.as_ref(),
        k.as_ref(),
        v.as_ref(),
        0..20,
        20,
        &Options::default(),
    )
    .and_then(|call| call.partial_state(attn_optimized::Par::rayon(0)))
    .unwrap();
    let e = PartialState::empty(9, 4);
    assert_eq!(s.merge(&e).unwrap(), s);
    assert_eq!(e.merge(&s).unwrap(), s);
    assert_eq!(e.merge(&e).unwrap(), e);
    assert!(s.merge(&PartialState::empty(8, 4)).is_err());
}

#[test]
fn batched_layouts_gqa_and_ragged_lengths_match_reference() {
    let (b, hq, hkv, n_q, n_k, d, dv) = (2, 6, 2, 130, 300, 32, 24);
    let qd: Vec<f32> = mat(1, b * hq * n_q * d, 1, 1.0)
        .row(0)
        .iter()
        .copied()
        .collect();
    let kd: Vec<f32> = mat(1, b * hkv * n_k * d, 2, 1.0)
        .row(0)
        .iter()
        .copied()
        .collect();
    let vd: Vec<f32> = mat(1, b * hkv * n_k * dv, 3, 1.0)
        .row(0)
        .iter()
        .copied()
        .collect();
    let lens = [300, 123];
    let opts = Options::default()
        .with_causal(Causal::BottomRight)
        .with_key_lengths(&lens);
    for layout in [Layout::Bhsd, Layout::Bshd] {
        let q = Tensor4Ref::from_layout(&qd, [b, hq, n_q, d], layout).unwrap();
        let k = Tensor4Ref::from_layout(&kd, [b, hkv, n_k, d], layout).unwrap();
        let v = Tensor4Ref::from_layout(&vd, [b, hkv, n_k, dv], layout).unwrap();
        let got = attn_optimized::Attention::batched(q, k, v, &opts)
            .and_then(|call| call.forward(attn_optimized::Par::rayon(0)))
            .map(|f| f.into_output())
            .unwrap();
        let want = attn_reference::Attention::batched(q, k, v, &opts)
            .and_then(|call| call.forward())
            .map(|f| f.into_output())
            .unwrap();
        for (g, w) in got.as_slice().iter().zip(want.as_slice()) {
            assert!((g - w).abs() < 2e-5, "{layout:?}: {g} vs {w}");
        }
        let mut buf = vec![0.0f32; b * hq * n_q * dv];
        let out = Tensor4Mut::from_layout(&mut buf, [b, hq, n_q, dv], Layout::Bshd).unwrap();
        attn_optimized::Attention::batched(q, k, v, &opts)
            .and_then(|call| call.forward_into(out, None, attn_optimized::Par::rayon(0)))
            .unwrap();
        let back = Tensor4Ref::from_layout(&buf, [b, hq, n_q, dv], Layout::Bshd).unwrap();
        assert_eq!(back.head(1, 5).unwrap(), got.as_ref().head(1, 5).unwrap());
    }
    let bad = Tensor4::<f32>::zeros([b, 5, n_q, d]);
    assert!(
        attn_optimized::Attention::batched(
            bad.as_ref(),
            Tensor4Ref::from_layout(&kd, [b, hkv, n_k, d], Layout::Bhsd).unwrap(),
            Tensor4Ref::from_layout(&vd, [b, hkv, n_k, dv], Layout::Bhsd).unwrap(),
            &Options::default()
        )
        .and_then(|call| call.forward(attn_optimized::Par::rayon(0)))
        .map(|f| f.into_output())
        .is_err()
    );
}

#[test]
fn multi_head_matches_reference_layer() {
    let (n_q, n_k, d_model, d_kv, h, hkv, dk, dv) = (70, 150, 48, 40, 4, 2, 12, 10);
    let w = attn_core::MultiHeadWeights::new(
        mat(d_model, h * dk, 1, 0.3),
        mat(d_kv, hkv * dk, 2, 0.3),
        mat(d_kv, hkv * dv, 3, 0.3),
        mat(h * dv, d_model, 4, 0.3),
        h,
        hkv,
    )
    .unwrap();
    let (xq, xkv) = (mat(n_q, d_model, 5, 1.0), mat(n_k, d_kv, 6, 1.0));
    let opts = Options::default().with_causal(Causal::BottomRight);
    let got = MultiHeadAttention::new(w.clone())
        .forward_cross(xq.as_ref(), xkv.as_ref(), &opts)
        .unwrap();
    let want = attn_reference::MultiHeadAttention::new(w)
        .forward_cross(xq.as_ref(), xkv.as_ref(), &opts)
        .unwrap();
    for i in 0..n_q {
        for j in 0..d_model {
            assert!((got[(i, j)] - want[(i, j)]).abs() < 1e-5, "({i},{j})");
        }
    }
}

#[test]
fn malformed_input_is_the_same_typed_error_as_the_reference() {
    let (q, k, v) = (mat(3, 4, 1, 1.0), mat(5, 4, 2, 1.0), mat(5, 2, 3, 1.0));
    let wrong_mask = Mat::<f32>::zeros(3, 4);
    type Case<'a> = (Mat<f32>, Mat<f32>, Mat<f32>, Options<'a>);
    let cases: Vec<Case<'_>> = vec![
        (q.clone(), mat(5, 3, 2, 1.0), v.clone(), Options::default()),
        (q.clone(), k.clone(), mat(4, 2, 3, 1.0), Options::default()),
        (
            mat(3, 0, 1, 1.0),
            mat(5, 0, 1, 1.0),
            v.clone(),
            Options::default(),
        ),
        (
            q.clone(),
            k.clone(),
            v.clone(),
            Options::default().with_scale(f32::NAN),
        ),
        (
            q.clone(),
            k.clone(),
            v.clone(),
            Options::default().with_scale(f32::MAX),
        ),
        (
            q.clone(),
            k.clone(),
            v.clone(),
            Options::default().with_additive_mask(wrong_mask.as_ref()),
        ),
        (
            q.clone(),
            k.clone(),
            v.clone(),
            Options::default().with_key_length(9),
        ),
    ];
    for (q, k, v, o) in &cases {
        let mine = attention(q.as_ref(), k.as_ref(), v.as_ref(), o).unwrap_err();
        let theirs = attn_reference::attention(q.as_ref(), k.as_ref(), v.as_ref(), o).unwrap_err();
        assert_eq!(mine.to_string(), theirs.to_string());
    }
    let mut small = Mat::<f32>::zeros(2, 2);
    assert!(
        attn_optimized::Attention::head(q.as_ref(), k.as_ref(), v.as_ref(), &Options::default())
            .and_then(|call| call.forward_into(small.as_mut(), None, attn_optimized::Par::rayon(0)))
            .is_err()
    );
}

#[test]
fn non_finite_values_at_hidden_keys_never_reach_the_output() {
    for n_q in [1, 3, 200] {
        let (q, k, mut v) = (
            mat(n_q, 8, 1, 1.0),
            mat(300, 8, 2, 1.0),
            mat(300, 4, 3, 1.0),
        );
        v[(250, 1)] = f32::NAN;
        v[(260, 2)] = f32::INFINITY;
        let allow = Mat::from_fn(n_q, 300, |_, j| j < 250);
        for opts in [
            Options::default().with_bool_mask(BoolMask::allow(allow.as_ref())),
            Options::default().with_key_length(250),
            Options::default().with_window(SlidingWindow::new(Some(10), Some(0), Causal::TopLeft)),
        ] {
            let o = attention(q.as_ref(), k.as_ref(), v.as_ref(), &opts).unwrap();
            let r = attn_reference::attention(q.as_ref(), k.as_ref(), v.as_ref(), &opts).unwrap();
            for i in 0..n_q {
                for c in 0..4 {
                    assert_eq!(
                        o[(i, c)].is_finite(),
                        r[(i, c)].is_finite(),
                        "n_q {n_q} row {i} col {c}"
                    );
                }
            }
        }
    }
}

/// Decoding with grouped-query heads stacks the query heads of a group into one tile. The
/// result must be what each head computes alone (bit for bit when neither splits its keys)
/// and what the reference computes, under every mask kind, for groups of 2 to 8.
#[test]
fn stacked_gqa_decoding_equals_one_head_at_a_time() {
    let (b, n_k, d) = (2, 700, 32);
    let allow = Mat::<bool>::from_fn(1, n_k, |_, j| j % 7 != 3);
    let bias = Mat::<f32>::from_fn(1, n_k, |_, j| {
        if j % 11 == 0 {
            f32::NEG_INFINITY
        } else {
            (j % 5) as f32 * 0.2
        }
    });
    let lens = [700, 411];
    let masks: Vec<(&str, Options<'_>)> = vec![
        ("none", Options::default()),
        (
            "causal bottom-right",
            Options::default().with_causal(Causal::BottomRight),
        ),
        (
            "causal top-left",
            Options::default().with_causal(Causal::TopLeft),
        ),
        (
            "window",
            Options::default().with_window(SlidingWindow::new(
                Some(50),
                Some(0),
                Causal::BottomRight,
            )),
        ),
        ("key lengths", Options::default().with_key_lengths(&lens)),
        (
            "boolean",
            Options::default().with_bool_mask(BoolMask::allow(allow.as_ref())),
        ),
        (
            "additive",
            Options::default().with_additive_mask(bias.as_ref()),
        ),
    ];
    for (hq, hkv) in [(4, 2), (6, 2), (8, 1), (9, 3), (16, 2)] {
        let qd: Vec<f32> = mat(1, b * hq * d, 1, 1.0).row(0).iter().copied().collect();
        let kd: Vec<f32> = mat(1, b * hkv * n_k * d, 2, 1.0)
            .row(0)
            .iter()
            .copied()
            .collect();
        let vd: Vec<f32> = mat(1, b * hkv * n_k * d, 3, 1.0)
            .row(0)
            .iter()
            .copied()
            .collect();
        for layout in [Layout::Bhsd, Layout::Bshd] {
            let q = Tensor4Ref::from_layout(&qd, [b, hq, 1, d], layout).unwrap();
            let k = Tensor4Ref::from_layout(&kd, [b, hkv, n_k, d], layout).unwrap();
            let v = Tensor4Ref::from_layout(&vd, [b, hkv, n_k, d], layout).unwrap();
            // The same problem with every query head given its own copy of its K/V head.
            let expand = |x: Tensor4Ref<'_, f32>| -> Vec<f32> {
                (0..b * hq)
                    .flat_map(|bh| {
                        let m = x.head(bh / hq, bh % hq / (hq / hkv)).unwrap();
                        (0..n_k * d).map(move |i| m[(i / d, i % d)])
                    })
                    .collect()
            };
            let (ke, ve) = (expand(k), expand(v));
            let k1 = Tensor4Ref::from_layout(&ke, [b, hq, n_k, d], Layout::Bhsd).unwrap();
            let v1 = Tensor4Ref::from_layout(&ve, [b, hq, n_k, d], Layout::Bhsd).unwrap();
            for (name, opts) in &masks {
                let what = format!("h_q={hq} h_kv={hkv} {layout:?} {name}");
                let never = attn_optimized::SplitKv::Never;
                let stacked = attn_optimized::Attention::batched(q, k, v, opts)
                    .and_then(|call| call.split_kv(never).forward(attn_optimized::Par::rayon(0)))
                    .map(|f| f.into_output())
                    .unwrap();
                let alone = attn_optimized::Attention::batched(q, k1, v1, opts)
                    .and_then(|call| call.split_kv(never).forward(attn_optimized::Par::rayon(0)))
                    .map(|f| f.into_output())
                    .unwrap();
                assert_eq!(stacked.as_slice(), alone.as_slice(), "{what}");
                let got = attn_optimized::Attention::batched(q, k, v, opts)
                    .and_then(|call| call.forward(attn_optimized::Par::rayon(0)))
                    .map(|f| f.into_output())
                    .unwrap();
                let want = attn_reference::Attention::batched(q, k, v, opts)
                    .and_then(|call| call.forward())
                    .map(|f| f.into_output())
                    .unwrap();
                for (g, w) in got.as_slice().iter().zip(want.as_slice()) {
                    assert!((g - w).abs() < 2e-5, "{what}: {g} vs {w}");
                }
            }
        }
    }
}

/// Stacked GQA decoding with half-precision storage and with the LSE requested: the same
/// numbers as one head at a time.
#[test]
fn stacked_gqa_decoding_in_half_precision_and_with_lse() {
    use half::f16;
    let (b, hq, hkv, n_k, d) = (2, 8, 2, 900, 64);
    let f = |x: &Mat<f32>| -> Vec<f16> { x.row(0).iter().map(|&v| f16::from_f32(v)).collect() };
    let (qd, kd, vd) = (
        f(&mat(1, b * hq * d, 4, 1.0)),
        f(&mat(1, b * hkv * n_k * d, 5, 1.0)),
        f(&mat(1, b * hkv * n_k * d, 6, 1.0)),
    );
    let q = Tensor4Ref::from_layout(&qd, [b, hq, 1, d], Layout::Bhsd).unwrap();
    let k = Tensor4Ref::from_layout(&kd, [b, hkv, n_k, d], Layout::Bhsd).unwrap();
    let v = Tensor4Ref::from_layout(&vd, [b, hkv, n_k, d], Layout::Bhsd).unwrap();
    let expand = |x: &[f16]| -> Vec<f16> {
        (0..b * hq)
            .flat_map(|bh| {
                let src = (bh / hq * hkv + bh % hq / (hq / hkv)) * n_k * d;
                x[src..src + n_k * d].to_vec()
            })
            .collect()
    };
    let (ke, ve) = (expand(&kd), expand(&vd));
    let k1 = Tensor4Ref::from_layout(&ke, [b, hq, n_k, d], Layout::Bhsd).unwrap();
    let v1 = Tensor4Ref::from_layout(&ve, [b, hq, n_k, d], Layout::Bhsd).unwrap();
    let opts = Options::default().with_causal(Causal::BottomRight);
    let never = attn_optimized::SplitKv::Never;
    let stacked = attn_optimized::Attention::batched(q, k, v, &opts)
        .and_then(|call| call.split_kv(never).forward(attn_optimized::Par::rayon(0)))
        .map(|f| f.into_output())
        .unwrap();
    let alone = attn_optimized::Attention::batched(q, k1, v1, &opts)
        .and_then(|call| call.split_kv(never).forward(attn_optimized::Par::rayon(0)))
        .map(|f| f.into_output())
        .unwrap();
    assert_eq!(stacked.as_slice(), alone.as_slice());
    let (o, lse) = attn_optimized::Attention::batched(q, k, v, &opts)
        .and_then(|call| call.forward(attn_optimized::Par::rayon(0)))
        .map(|f| f.into_parts())
        .unwrap();
    let (o1, lse1) = attn_optimized::Attention::batched(q, k1, v1, &opts)
        .and_then(|call| call.forward(attn_optimized::Par::rayon(0)))
        .map(|f| f.into_parts())
        .unwrap();
    assert_eq!(lse.len(), b * hq);
    for (x, y) in lse.iter().zip(&lse1) {
        assert!((x - y).abs() < 1e-5 * y.abs().max(1.0), "{x} vs {y}");
    }
    for (x, y) in o.as_slice().iter().zip(o1.as_slice()) {
        assert!((x.to_f32() - y.to_f32()).abs() < 2e-3, "{x} vs {y}");
    }
}

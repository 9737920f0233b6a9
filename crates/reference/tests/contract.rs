//! The reference honours every clause of the contract.

use attn_core::MultiHeadWeights;
use attn_reference::{
    Attention, BoolMask, Causal, Error, Layout, MultiHeadAttention, Options, SlidingWindow,
    Tensor4Ref, attention,
};
use faer::Mat;

/// Deterministic pseudo-random matrix (an LCG: no dependency, same on every machine).
fn mat(rows: usize, cols: usize, seed: u64) -> Mat<f32> {
    let mut s = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    Mat::from_fn(rows, cols, |_, _| {
        s = s
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    })
}

#[test]
fn rows_sum_to_one_and_masked_weights_are_zero() {
    let (q, k, v) = (mat(7, 5, 1), mat(9, 5, 2), mat(9, 3, 3));
    let opts = Options::default()
        .with_causal(Causal::BottomRight)
        .with_window(SlidingWindow::new(Some(3), Some(1), Causal::BottomRight))
        .with_key_length(8);
    let m = Attention::head(q.as_ref(), k.as_ref(), v.as_ref(), &opts)
        .and_then(|call| call.materialized())
        .unwrap();
    for i in 0..7 {
        let c = i as i64 + 2;
        let sum: f64 = (0..9).map(|j| m.weights[(i, j)]).sum();
        assert!((sum - 1.0).abs() < 1e-12);
        for j in 0..9 {
            let visible = (j as i64) <= c && (j as i64) >= c - 3 && j < 8;
            assert_eq!(m.weights[(i, j)] > 0.0, visible, "row {i} key {j}");
        }
    }
}

#[test]
fn fully_masked_row_is_zero_not_nan() {
    let (q, k, v) = (mat(4, 3, 4), mat(2, 3, 5), mat(2, 2, 6));
    // Top-left causal with n_q > n_k: rows 0..=1 see keys, and every row sees key 0...
    // so hide key 0 with a block mask to leave row 0 with nothing.
    let block = Mat::from_fn(4, 2, |i, j| i == 0 && j == 0);
    let opts = Options::default()
        .with_causal(Causal::TopLeft)
        .with_bool_mask(BoolMask::block(block.as_ref()));
    let m = Attention::head(q.as_ref(), k.as_ref(), v.as_ref(), &opts)
        .and_then(|call| call.materialized())
        .unwrap();
    assert_eq!(m.lse[0], f64::NEG_INFINITY);
    assert!((0..2).all(|j| m.weights[(0, j)] == 0.0 && m.output[(0, j)] == 0.0));
    assert!(
        m.output
            .as_ref()
            .col_iter()
            .flat_map(|c| c.iter().copied().collect::<Vec<_>>())
            .all(f64::is_finite)
    );
    // An additive -inf everywhere hides a row too.
    let add = Mat::from_fn(4, 2, |i, _| if i == 3 { f32::NEG_INFINITY } else { 0.0 });
    let o = attention(
        q.as_ref(),
        k.as_ref(),
        v.as_ref(),
        &Options::default().with_additive_mask(add.as_ref()),
    )
    .unwrap();
    assert_eq!((o[(3, 0)], o[(3, 1)]), (0.0, 0.0));
}

#[test]
fn empty_queries_and_empty_keys_are_defined() {
    let o = attention(
        mat(0, 4, 1).as_ref(),
        mat(3, 4, 2).as_ref(),
        mat(3, 2, 3).as_ref(),
        &Options::default(),
    )
    .unwrap();
    assert_eq!((o.nrows(), o.ncols()), (0, 2));
    let m = Attention::head(
        mat(2, 4, 1).as_ref(),
        mat(0, 4, 2).as_ref(),
        mat(0, 2, 3).as_ref(),
        &Options::default(),
    )
    .and_then(|call| call.materialized())
    .unwrap();
    assert_eq!(m.lse, vec![f64::NEG_INFINITY; 2]);
    assert!(m.output.col_iter().all(|c| c.iter().all(|&x| x == 0.0)));
}

#[test]
fn allow_and_block_are_opposite_polarities() {
    let (q, k, v) = (mat(3, 4, 7), mat(5, 4, 8), mat(5, 2, 9));
    let m = Mat::from_fn(3, 5, |i, j| (i + j) % 2 == 0);
    let inverse = Mat::from_fn(3, 5, |i, j| !m[(i, j)]);
    let a = attention(
        q.as_ref(),
        k.as_ref(),
        v.as_ref(),
        &Options::default().with_bool_mask(BoolMask::allow(m.as_ref())),
    )
    .unwrap();
    let b = attention(
        q.as_ref(),
        k.as_ref(),
        v.as_ref(),
        &Options::default().with_bool_mask(BoolMask::block(inverse.as_ref())),
    )
    .unwrap();
    assert_eq!(a, b);
}

#[test]
fn malformed_input_is_a_typed_error() {
    let (q, k, v) = (mat(3, 4, 1), mat(5, 4, 2), mat(5, 2, 3));
    let run = |q: &Mat<f32>, k: &Mat<f32>, v: &Mat<f32>, o: &Options<'_>| {
        attention(q.as_ref(), k.as_ref(), v.as_ref(), o).unwrap_err()
    };
    assert_eq!(
        run(&q, &k, &mat(4, 2, 3), &Options::default()).to_string(),
        "V has 4 rows but K has 5 (n_k must match)"
    );
    assert_eq!(
        run(&mat(3, 0, 1), &mat(5, 0, 2), &v, &Options::default()),
        Error::EmptyKeyWidth
    );
    for bad in [f32::MAX, f32::MIN, f32::NAN, f32::INFINITY] {
        assert!(matches!(
            run(&q, &k, &v, &Options::default().with_scale(bad)),
            Error::InvalidScale(_)
        ));
    }
    let wrong = Mat::<f32>::zeros(3, 4);
    assert_eq!(
        run(
            &q,
            &k,
            &v,
            &Options::default().with_additive_mask(wrong.as_ref())
        )
        .to_string(),
        "additive mask has shape 3×4 but must be 3×5 (n_q × n_k, the shape of the scores)"
    );
    assert!(matches!(
        run(&q, &k, &v, &Options::default().with_key_length(6)),
        Error::KeyLength { len: 6, .. }
    ));
}

#[test]
fn batched_layouts_and_gqa_match_single_heads() {
    let (b, hq, hkv, n_q, n_k, d, dv) = (2, 4, 2, 3, 6, 5, 3);
    let qd: Vec<f32> = (0..b * hq * n_q * d)
        .map(|x| ((x * 37 % 101) as f32 - 50.0) / 50.0)
        .collect();
    let kd: Vec<f32> = (0..b * hkv * n_k * d)
        .map(|x| ((x * 53 % 97) as f32 - 48.0) / 48.0)
        .collect();
    let vd: Vec<f32> = (0..b * hkv * n_k * dv)
        .map(|x| ((x * 29 % 89) as f32 - 44.0) / 44.0)
        .collect();
    let lens = [6, 4];
    let opts = Options::default()
        .with_causal(Causal::BottomRight)
        .with_key_lengths(&lens);
    for layout in [Layout::Bhsd, Layout::Bshd] {
        let q = Tensor4Ref::from_layout(&qd, [b, hq, n_q, d], layout).unwrap();
        let k = Tensor4Ref::from_layout(&kd, [b, hkv, n_k, d], layout).unwrap();
        let v = Tensor4Ref::from_layout(&vd, [b, hkv, n_k, dv], layout).unwrap();
        let out = Attention::batched(q, k, v, &opts)
            .and_then(|call| call.forward())
            .map(|f| f.into_output())
            .unwrap();
        for (bi, &len) in lens.iter().enumerate() {
            let single = Options::default()
                .with_causal(Causal::BottomRight)
                .with_key_length(len);
            for h in 0..hq {
                let want = attention(
                    q.head(bi, h).unwrap(),
                    k.head(bi, h / 2).unwrap(),
                    v.head(bi, h / 2).unwrap(),
                    &single,
                )
                .unwrap();
                assert_eq!(out.as_ref().head(bi, h).unwrap(), want.as_ref());
            }
        }
    }
}

#[test]
fn multi_head_is_projected_concatenation_of_heads() {
    let (n_q, n_k, d_model, d_kv, h, hkv, dk, dv) = (4, 6, 8, 5, 4, 2, 3, 2);
    let w = MultiHeadWeights::new(
        mat(d_model, h * dk, 1),
        mat(d_kv, hkv * dk, 2),
        mat(d_kv, hkv * dv, 3),
        mat(h * dv, d_model, 4),
        h,
        hkv,
    )
    .unwrap();
    let mha = MultiHeadAttention::new(w.clone());
    let (xq, xkv) = (mat(n_q, d_model, 5), mat(n_k, d_kv, 6));
    let y = mha
        .forward_cross(xq.as_ref(), xkv.as_ref(), &Options::default())
        .unwrap();
    // Rebuild by hand in f32 from single-head calls.
    let (q, k, v) = (&xq * w.w_q(), &xkv * w.w_k(), &xkv * w.w_v());
    let mut concat = Mat::<f32>::zeros(n_q, h * dv);
    for head in 0..h {
        let kv = head / 2;
        let o = attention(
            q.subcols(head * dk, dk),
            k.subcols(kv * dk, dk),
            v.subcols(kv * dv, dv),
            &Options::default(),
        )
        .unwrap();
        concat.subcols_mut(head * dv, dv).copy_from(&o);
    }
    let want = &concat * w.w_o();
    for i in 0..n_q {
        for j in 0..d_model {
            assert!((y[(i, j)] - want[(i, j)]).abs() < 1e-5);
        }
    }
    assert!(
        mha.forward(xq.as_ref(), &Options::default()).is_err(),
        "x has d_model columns, not d_kv"
    );
}

#[test]
fn nan_touches_only_its_rows() {
    let (mut q, k, v) = (mat(3, 4, 1), mat(5, 4, 2), mat(5, 2, 3));
    q[(1, 2)] = f32::NAN;
    let o = attention(q.as_ref(), k.as_ref(), v.as_ref(), &Options::default()).unwrap();
    assert!(o[(1, 0)].is_nan());
    assert!(o[(0, 0)].is_finite() && o[(2, 1)].is_finite());
}

//! The streaming backward pass against the f64 reference on shapes that cross the tiles,
//! and the properties of its schedule: bits independent of the thread count, gradients
//! written in place into any view and element type, typed errors for every operand.

mod common;

use attn_core::{
    BoolMask, Causal, Gradients, Layout, Options, SlidingWindow, Tensor4, Tensor4Mut, Tensor4Ref,
};
use attn_optimized::{Element, attention_backward};
use common::in_pool;
use faer::{Mat, MatRef};
use half::{bf16, f16};

fn pseudo(n: usize, d: usize, seed: u64) -> Mat<f32> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    Mat::from_fn(n, d, |_, _| {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        ((x >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    })
}

/// The call value's forward pass of one head: its output and LSE.
fn forward<T: Element>(
    q: &Mat<T>,
    k: &Mat<T>,
    v: &Mat<T>,
    opts: &Options<'_>,
) -> (Mat<T>, Vec<f32>) {
    attn_optimized::Attention::head(q.as_ref(), k.as_ref(), v.as_ref(), opts)
        .and_then(|call| call.forward(attn_optimized::Par::rayon(0)))
        .map(|f| f.into_parts())
        .unwrap()
}

/// The free `attention_backward` of one head, on a forward's output and LSE.
fn backward<T: Element>(
    d_out: &Mat<T>,
    [q, k, v]: [&Mat<T>; 3],
    out: &Mat<T>,
    lse: &[f32],
    opts: &Options<'_>,
) -> Gradients<T> {
    let (q, k, v) = (q.as_ref(), k.as_ref(), v.as_ref());
    attention_backward(d_out.as_ref(), q, k, v, out.as_ref(), lse, opts).unwrap()
}

/// The call value's backward pass of one head into f32 gradients (mixed precision for half
/// inputs): `[dq, dk, dv]`.
fn f32_gradients<T: Element>(
    d_out: &Mat<T>,
    [q, k, v]: [&Mat<T>; 3],
    (out, lse): (&Mat<T>, &[f32]),
    opts: &Options<'_>,
) -> [Mat<f32>; 3] {
    let (mut dq, mut dk, mut dv) = (
        Mat::<f32>::zeros(q.nrows(), q.ncols()),
        Mat::<f32>::zeros(k.nrows(), k.ncols()),
        Mat::<f32>::zeros(v.nrows(), v.ncols()),
    );
    attn_optimized::Attention::head(q.as_ref(), k.as_ref(), v.as_ref(), opts)
        .and_then(|call| {
            call.backward_into(
                attn_optimized::ForwardRef::head(out.as_ref(), lse),
                d_out.as_ref(),
                attn_optimized::GradientsMut {
                    dq: dq.as_mut(),
                    dk: dk.as_mut(),
                    dv: dv.as_mut(),
                },
                attn_optimized::Par::rayon(0),
            )
        })
        .unwrap();
    [dq, dk, dv]
}

fn max_rel(got: MatRef<'_, f32>, want: MatRef<'_, f32>) -> f32 {
    let scale = (0..want.nrows())
        .flat_map(|i| (0..want.ncols()).map(move |j| (i, j)))
        .map(|(i, j)| want[(i, j)].abs())
        .fold(1e-3f32, f32::max);
    (0..want.nrows())
        .flat_map(|i| (0..want.ncols()).map(move |j| (i, j)))
        .map(|(i, j)| (got[(i, j)] - want[(i, j)]).abs() / scale)
        .fold(0.0, f32::max)
}

fn check_head(n_q: usize, n_k: usize, d_k: usize, d_v: usize, options: &Options<'_>, tol: f32) {
    let (q, k, v) = (
        pseudo(n_q, d_k, 1),
        pseudo(n_k, d_k, 2),
        pseudo(n_k, d_v, 3),
    );
    let d_out = pseudo(n_q, d_v, 4);
    let (out, lse) = forward(&q, &k, &v, options);
    let got = backward(&d_out, [&q, &k, &v], &out, &lse, options);
    let want = attn_reference::attention_backward(
        d_out.as_ref(),
        q.as_ref(),
        k.as_ref(),
        v.as_ref(),
        out.as_ref(),
        &lse,
        options,
    )
    .unwrap();
    for (name, g, w) in [
        ("dq", &got.dq, &want.dq),
        ("dk", &got.dk, &want.dk),
        ("dv", &got.dv, &want.dv),
    ] {
        let e = max_rel(g.as_ref(), w.as_ref());
        assert!(
            e < tol,
            "{name}: {e} at n_q {n_q} n_k {n_k} d_k {d_k} d_v {d_v}"
        );
        assert!(
            g.col_iter().all(|c| c.iter().all(|x| x.is_finite())),
            "{name} not finite"
        );
    }
}

#[test]
fn one_head_matches_the_reference_across_tiles_and_masks() {
    let mask = Mat::from_fn(300, 260, |i, j| (i * 7 + j * 3) % 5 != 0);
    let bias = Mat::from_fn(300, 260, |i, j| ((i + 2 * j) % 9) as f32 * -0.3);
    let cases: Vec<(usize, usize, Options<'_>)> = vec![
        (1, 1, Options::default()),
        (7, 5, Options::default()),
        (129, 257, Options::default()),
        (300, 260, Options::default().with_causal(Causal::TopLeft)),
        (
            300,
            260,
            Options::default().with_causal(Causal::BottomRight),
        ),
        (
            300,
            260,
            Options::default().with_window(SlidingWindow::new(
                Some(40),
                Some(3),
                Causal::BottomRight,
            )),
        ),
        (
            300,
            260,
            Options::default().with_bool_mask(BoolMask::allow(mask.as_ref())),
        ),
        (
            300,
            260,
            Options::default().with_additive_mask(bias.as_ref()),
        ),
    ];
    for (n_q, n_k, opts) in &cases {
        check_head(*n_q, *n_k, 24, 40, opts, 2e-4);
    }
}

/// Pseudo-random data for a `[b, h, n, d]` tensor (any layout: it is a flat buffer).
fn tensor(dims: [usize; 4], seed: u64) -> Vec<f32> {
    let n = dims.iter().product::<usize>();
    pseudo(n, 1, seed).col(0).iter().copied().collect()
}

fn max_rel_tensor(got: Tensor4Ref<'_, f32>, want: Tensor4Ref<'_, f32>) -> f32 {
    let [b, h, _, _] = want.dims();
    let mut e = 0.0f32;
    for bi in 0..b {
        for hi in 0..h {
            e = e.max(max_rel(
                got.head(bi, hi).unwrap(),
                want.head(bi, hi).unwrap(),
            ));
        }
    }
    e
}

#[test]
fn batched_gqa_matches_the_reference_in_both_layouts() {
    let lens = [150, 97];
    for layout in [Layout::Bhsd, Layout::Bshd] {
        for (h_q, h_kv) in [(4, 2), (3, 1), (2, 2)] {
            let (b, n_q, n_k, d) = (2, 140, 150, 16);
            let qd = tensor([b, h_q, n_q, d], 11);
            let kd = tensor([b, h_kv, n_k, d], 12);
            let vd = tensor([b, h_kv, n_k, d], 13);
            let dod = tensor([b, h_q, n_q, d], 14);
            let q = Tensor4Ref::from_layout(&qd, [b, h_q, n_q, d], layout).unwrap();
            let k = Tensor4Ref::from_layout(&kd, [b, h_kv, n_k, d], layout).unwrap();
            let v = Tensor4Ref::from_layout(&vd, [b, h_kv, n_k, d], layout).unwrap();
            let d_out = Tensor4Ref::from_layout(&dod, [b, h_q, n_q, d], layout).unwrap();
            let opts = Options::default()
                .with_causal(Causal::BottomRight)
                .with_key_lengths(&lens);
            let (out, lse) = attn_optimized::Attention::batched(q, k, v, &opts)
                .and_then(|call| call.forward(attn_optimized::Par::rayon(0)))
                .map(|f| f.into_parts())
                .unwrap();
            let got = attn_optimized::Attention::batched(q, k, v, &opts)
                .and_then(|call| {
                    call.backward(
                        attn_optimized::ForwardRef::batch(out.as_ref(), &lse)?,
                        d_out,
                        attn_optimized::Par::rayon(0),
                    )
                })
                .unwrap();
            let want = attn_reference::Attention::batched(q, k, v, &opts)
                .and_then(|call| {
                    call.backward(
                        attn_reference::ForwardRef::batch(out.as_ref(), &lse)?,
                        d_out,
                    )
                })
                .unwrap();
            for (name, g, w) in [
                ("dq", &got.dq, &want.dq),
                ("dk", &got.dk, &want.dk),
                ("dv", &got.dv, &want.dv),
            ] {
                let e = max_rel_tensor(g.as_ref(), w.as_ref());
                assert!(e < 2e-4, "{name} {layout:?} {h_q}/{h_kv}: {e}");
            }
            // Keys beyond an entry's length are seen by nobody: exactly zero gradients.
            let dk1 = got.dk.as_ref().head(1, 0).unwrap();
            assert!((97..150).all(|j| dk1.row(j).iter().all(|&x| x == 0.0)));
        }
    }
}

#[test]
fn bits_do_not_depend_on_the_thread_count() {
    // One head and one group: the key blocks are dealt to several chunks whose dQ
    // partials are reduced in order; GQA sums its heads in order.
    let (b, h_q, h_kv, n, d) = (1, 4, 2, 700, 32);
    let qd = tensor([b, h_q, n, d], 21);
    let kd = tensor([b, h_kv, n, d], 22);
    let q = Tensor4Ref::from_layout(&qd, [b, h_q, n, d], Layout::Bhsd).unwrap();
    let k = Tensor4Ref::from_layout(&kd, [b, h_kv, n, d], Layout::Bhsd).unwrap();
    let opts = Options::default().with_causal(Causal::TopLeft);
    let (out, lse) = attn_optimized::Attention::batched(q, k, k, &opts)
        .and_then(|call| call.forward(attn_optimized::Par::rayon(0)))
        .map(|f| f.into_parts())
        .unwrap();
    let run = || {
        attn_optimized::Attention::batched(q, k, k, &opts)
            .and_then(|call| {
                call.backward(
                    attn_optimized::ForwardRef::batch(out.as_ref(), &lse)?,
                    out.as_ref(),
                    attn_optimized::Par::rayon(0),
                )
            })
            .unwrap()
    };
    let one = in_pool(1, run);
    for threads in [2, 3] {
        let other = in_pool(threads, run);
        assert_eq!(one, other, "{threads} threads");
    }
    let head = |t: usize| {
        in_pool(t, || {
            let (q, k) = (q.head(0, 0).unwrap(), k.head(0, 0).unwrap());
            let o = out.as_ref().head(0, 0).unwrap();
            attention_backward(o, q, k, k, o, &lse[..n], &opts).unwrap()
        })
    };
    assert_eq!(head(1), head(3));
}

#[test]
fn half_storage_and_mixed_precision_gradients() {
    let (n_q, n_k, d) = (150, 140, 32);
    let opts = Options::default().with_causal(Causal::BottomRight);
    let (q, k, v, d_out) = (
        pseudo(n_q, d, 31),
        pseudo(n_k, d, 32),
        pseudo(n_k, d, 33),
        pseudo(n_q, d, 34),
    );
    fn round<T: attn_optimized::Element>(m: &Mat<f32>) -> Mat<T> {
        Mat::from_fn(m.nrows(), m.ncols(), |i, j| T::from_f32(m[(i, j)]))
    }
    fn wide<T: attn_optimized::Element>(m: &Mat<T>) -> Mat<f32> {
        Mat::from_fn(m.nrows(), m.ncols(), |i, j| m[(i, j)].to_f32())
    }
    fn case<T: attn_optimized::Element>(
        q: &Mat<f32>,
        k: &Mat<f32>,
        v: &Mat<f32>,
        d_out: &Mat<f32>,
        opts: &Options<'_>,
        tol: f32,
    ) {
        let (q, k, v, d_out) = (
            round::<T>(q),
            round::<T>(k),
            round::<T>(v),
            round::<T>(d_out),
        );
        let (out, lse) = forward(&q, &k, &v, opts);
        let w = |m: &Mat<T>| wide(m);
        let want = attn_reference::attention_backward(
            w(&d_out).as_ref(),
            w(&q).as_ref(),
            w(&k).as_ref(),
            w(&v).as_ref(),
            w(&out).as_ref(),
            &lse,
            opts,
        )
        .unwrap();
        // Half storage, f32 gradients (mixed precision) ...
        let [dq, dk, dv] = f32_gradients(&d_out, [&q, &k, &v], (&out, &lse), opts);
        // ... and half gradients, which are the f32 ones rounded once.
        let g = backward(&d_out, [&q, &k, &v], &out, &lse, opts);
        for (name, f, h, w) in [
            ("dq", &dq, &g.dq, &want.dq),
            ("dk", &dk, &g.dk, &want.dk),
            ("dv", &dv, &g.dv, &want.dv),
        ] {
            assert_eq!(
                wide(&round::<T>(f)),
                wide(h),
                "{name}: half gradients are the f32 ones rounded"
            );
            let e = max_rel(f.as_ref(), w.as_ref());
            assert!(e < tol, "{} {name}: {e}", T::NAME);
        }
    }
    // D is computed from the half-rounded output: the error is of that order.
    case::<f16>(&q, &k, &v, &d_out, &opts, 4e-3);
    case::<bf16>(&q, &k, &v, &d_out, &opts, 3e-2);
}

/// bf16 at native precision multiplies every product of the backward in bf16 (AMX tiles or
/// AVX512_BF16 pairs, with P and dS rounded to bf16): its f32 gradients stay within a fraction of a percent
/// of f32 compute's, on a shape whose tasks each accumulate several key blocks into dQ.
#[test]
fn native_bf16_gradients_track_f32_compute_across_key_blocks() {
    use attn_optimized::Precision;
    let (n_q, n_k, d) = (200, 2100, 64);
    let round = |m: Mat<f32>| Mat::from_fn(m.nrows(), m.ncols(), |i, j| bf16::from_f32(m[(i, j)]));
    let (q, k, v, d_out) = (
        round(pseudo(n_q, d, 41)),
        round(pseudo(n_k, d, 42)),
        round(pseudo(n_k, d, 43)),
        round(pseudo(n_q, d, 44)),
    );
    let grads = |precision| {
        let opts = Options::default().with_precision(precision);
        let (out, lse) = forward(&q, &k, &v, &opts);
        f32_gradients(&d_out, [&q, &k, &v], (&out, &lse), &opts)
    };
    let (native, exact) = (grads(Precision::Native), grads(Precision::F32));
    for ((name, a), b) in ["dq", "dk", "dv"].iter().zip(&native).zip(&exact) {
        let e = max_rel(a.as_ref(), b.as_ref());
        assert!(e < 1e-2, "{name}: {e}");
    }
}

#[test]
fn non_finite_rows_reach_only_the_keys_they_see() {
    // Causal: query 0 sees key 0 only. A NaN in Q and dO row 0 may reach dK/dV of key 0,
    // never the others; an inf in K row 5 (hidden from queries 0..5) never reaches their dQ.
    let (n, d) = (40, 8);
    let (mut q, mut k, v, mut d_out) = (
        pseudo(n, d, 41),
        pseudo(n, d, 42),
        pseudo(n, d, 43),
        pseudo(n, d, 44),
    );
    let opts = Options::default().with_causal(Causal::TopLeft);
    let (out, lse) = forward(&q, &k, &v, &opts);
    q[(0, 3)] = f32::NAN;
    d_out[(0, 1)] = f32::NAN;
    k[(5, 2)] = f32::INFINITY;
    let g = backward(&d_out, [&q, &k, &v], &out, &lse, &opts);
    for j in 1..n {
        if j == 5 {
            continue;
        }
        assert!(
            g.dk.row(j)
                .iter()
                .chain(g.dv.row(j).iter())
                .all(|x| x.is_finite()),
            "key {j}"
        );
    }
    for i in 1..5 {
        assert!(g.dq.row(i).iter().all(|x| x.is_finite()), "query {i}");
    }
}

#[test]
fn empty_and_fully_masked_shapes_are_defined() {
    let opts = Options::default();
    for (n_q, n_k, d_v) in [(0, 5, 4), (5, 0, 4), (5, 6, 0), (0, 0, 0)] {
        let (q, k, v, d_out) = (
            pseudo(n_q, 8, 1),
            pseudo(n_k, 8, 2),
            pseudo(n_k, d_v, 3),
            pseudo(n_q, d_v, 4),
        );
        let (out, lse) = forward(&q, &k, &v, &opts);
        let g = backward(&d_out, [&q, &k, &v], &out, &lse, &opts);
        assert_eq!((g.dq.nrows(), g.dk.nrows(), g.dv.ncols()), (n_q, n_k, d_v));
        let all_zero = |m: &Mat<f32>| m.col_iter().all(|c| c.iter().all(|&x| x == 0.0));
        assert!(
            all_zero(&g.dq) && all_zero(&g.dk) && all_zero(&g.dv),
            "{n_q} {n_k} {d_v}"
        );
    }
    // A bottom-right causal mask with more queries than keys leaves the first rows empty.
    let opts = Options::default()
        .with_causal(Causal::BottomRight)
        .with_key_length(3);
    let (q, k, d_out) = (pseudo(9, 8, 5), pseudo(6, 8, 6), pseudo(9, 8, 7));
    let (out, lse) = forward(&q, &k, &k, &opts);
    let g = backward(&d_out, [&q, &k, &k], &out, &lse, &opts);
    for (i, &l) in lse.iter().enumerate() {
        assert!(g.dq.row(i).iter().all(|x| x.is_finite()));
        if l == f32::NEG_INFINITY {
            assert!(g.dq.row(i).iter().all(|&x| x == 0.0));
        }
    }

    assert!(lse.contains(&f32::NEG_INFINITY));
}

#[test]
fn every_operand_is_checked() {
    let opts = Options::default();
    let (q, k, v) = (pseudo(4, 8, 1), pseudo(5, 8, 2), pseudo(5, 6, 3));
    let (out, lse) = forward(&q, &k, &v, &opts);
    let bad = pseudo(4, 5, 4);
    let err = |r: attn_core::Result<attn_core::Gradients<f32>>| r.unwrap_err().to_string();
    assert_eq!(
        err(attention_backward(
            bad.as_ref(),
            q.as_ref(),
            k.as_ref(),
            v.as_ref(),
            out.as_ref(),
            &lse,
            &opts
        )),
        "grad_out has shape 4×5 but must be 4×6 (n_q × d_v)"
    );
    assert_eq!(
        err(attention_backward(
            out.as_ref(),
            q.as_ref(),
            k.as_ref(),
            v.as_ref(),
            bad.as_ref(),
            &lse,
            &opts
        )),
        "output has shape 4×5 but must be 4×6 (n_q × d_v)"
    );
    assert_eq!(
        err(attention_backward(
            out.as_ref(),
            q.as_ref(),
            k.as_ref(),
            v.as_ref(),
            out.as_ref(),
            &lse[..3],
            &opts
        )),
        "LSE has 3 entries but Q has 4 (one LSE per query row)"
    );
    let mut dq = Mat::<f32>::zeros(4, 7);
    let (mut dk, mut dv) = (Mat::<f32>::zeros(5, 8), Mat::<f32>::zeros(5, 6));
    let e = attn_optimized::Attention::head(q.as_ref(), k.as_ref(), v.as_ref(), &opts).and_then(
        |call| {
            call.backward_into(
                attn_optimized::ForwardRef::head(out.as_ref(), &lse),
                out.as_ref(),
                attn_optimized::GradientsMut {
                    dq: dq.as_mut(),
                    dk: dk.as_mut(),
                    dv: dv.as_mut(),
                },
                attn_optimized::Par::rayon(0),
            )
        },
    );
    assert_eq!(
        e.unwrap_err().to_string(),
        "dQ has shape 4×7 but must be 4×8 (n_q × d_k)"
    );

    let t = Tensor4::<f32>::zeros([1, 2, 3, 4]);
    let kv = Tensor4::<f32>::zeros([1, 1, 3, 4]);
    let mut wrong = vec![0.0f32; 2 * 3 * 4];
    let mut ok1 = vec![0.0f32; 12];
    let mut ok2 = vec![0.0f32; 12];
    let e = attn_optimized::Attention::batched(t.as_ref(), kv.as_ref(), kv.as_ref(), &opts)
        .and_then(|call| {
            call.backward_into(
                attn_optimized::ForwardRef::batch(t.as_ref(), &[0.0; 6])?,
                t.as_ref(),
                attn_optimized::GradientsMut {
                    dq: Tensor4Mut::from_layout(&mut wrong, [1, 1, 6, 4], Layout::Bhsd).unwrap(),
                    dk: Tensor4Mut::from_layout(&mut ok1, [1, 1, 3, 4], Layout::Bhsd).unwrap(),
                    dv: Tensor4Mut::from_layout(&mut ok2, [1, 1, 3, 4], Layout::Bhsd).unwrap(),
                },
                attn_optimized::Par::rayon(0),
            )
        });
    assert_eq!(
        e.unwrap_err().to_string(),
        "dQ tensor: dims [1, 1, 6, 4] but its operand is [1, 2, 3, 4]"
    );
    let e = attn_optimized::Attention::batched(t.as_ref(), kv.as_ref(), kv.as_ref(), &opts)
        .and_then(|call| {
            call.backward(
                attn_optimized::ForwardRef::batch(t.as_ref(), &[0.0; 5])?,
                t.as_ref(),
                attn_optimized::Par::rayon(0),
            )
        });
    // Refused where the compact LSE is viewed against the output's rows.
    assert_eq!(
        e.unwrap_err().to_string(),
        "LSE has 5 entries but the output has 6 (one LSE per output row)"
    );
}

#[test]
fn widths_that_no_row_backs_are_not_allocated() {
    // Zero queries and keys of an absurd width: empty gradients, not an overflow.
    let huge = 1usize << 60;
    let opts = Options::default();
    let empty: [f32; 0] = [];
    let view = |dims| Tensor4Ref::new(&empty, dims, [0, 0, 0]).unwrap();
    let (q, kv) = (view([1, 2, 0, huge]), view([1, 1, 0, huge]));
    let g = attn_optimized::Attention::batched(q, kv, kv, &opts)
        .and_then(|call| {
            call.backward(
                attn_optimized::ForwardRef::batch(view([1, 2, 0, huge]), &[])?,
                view([1, 2, 0, huge]),
                attn_optimized::Par::rayon(0),
            )
        })
        .unwrap();
    assert_eq!(
        (g.dq.dims(), g.dk.dims()),
        ([1, 2, 0, huge], [1, 1, 0, huge])
    );
}

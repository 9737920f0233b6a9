//! The streaming backward pass against the f64 reference on shapes that cross the tiles,
//! and the properties of its schedule: bits independent of the thread count, gradients
//! written in place into any view and element type, typed errors for every operand.

use attn_core::{
    BoolMask, Causal, KeyPadding, Layout, Options, SlidingWindow, Tensor4, Tensor4Mut, Tensor4Ref,
};
use attn_optimized::{
    attention_backward, attention_backward_batched, attention_backward_batched_into,
    attention_backward_into, attention_batched_with_lse, attention_with_lse,
};
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
    let (out, lse) = attention_with_lse(q.as_ref(), k.as_ref(), v.as_ref(), options).unwrap();
    let got = attention_backward(
        d_out.as_ref(),
        q.as_ref(),
        k.as_ref(),
        v.as_ref(),
        out.as_ref(),
        &lse,
        options,
    )
    .unwrap();
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

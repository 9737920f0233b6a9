//! The numbers quoted in the docs, asserted to 4 decimals.

use attn_reference::{Attention, Causal, Options, worked};

fn assert_close(got: f64, want: f64) {
    assert!((got - want).abs() < 5e-5, "got {got}, want {want}");
}

#[test]
fn two_tokens_weights_and_output() {
    let ex = worked::two_tokens();
    let m = Attention::head(
        ex.q.as_ref(),
        ex.k.as_ref(),
        ex.v.as_ref(),
        &Options::default(),
    )
    .and_then(|call| call.materialized())
    .unwrap();
    for (i, j, w) in [
        (0, 0, 0.6698),
        (0, 1, 0.3302),
        (1, 0, 0.3302),
        (1, 1, 0.6698),
    ] {
        assert_close(m.weights[(i, j)], w);
    }
    for (i, j, o) in [
        (0, 0, 1.3395),
        (0, 1, 1.3210),
        (1, 0, 0.6605),
        (1, 1, 2.6790),
    ] {
        assert_close(m.output[(i, j)], o);
    }
}

#[test]
fn two_tokens_causal_first_row_sees_only_itself() {
    let ex = worked::two_tokens();
    let opts = Options::default().with_causal(Causal::TopLeft);
    let m = Attention::head(ex.q.as_ref(), ex.k.as_ref(), ex.v.as_ref(), &opts)
        .and_then(|call| call.materialized())
        .unwrap();
    assert_eq!((m.weights[(0, 0)], m.weights[(0, 1)]), (1.0, 0.0));
    assert_eq!((m.output[(0, 0)], m.output[(0, 1)]), (2.0, 0.0));
    // The second row is unchanged by the mask.
    assert_close(m.weights[(1, 1)], 0.6698);
}

#[test]
fn three_positions_scores_2_0_1() {
    let ex = worked::three_positions();
    let m = Attention::head(
        ex.q.as_ref(),
        ex.k.as_ref(),
        ex.v.as_ref(),
        &Options::default(),
    )
    .and_then(|call| call.materialized())
    .unwrap();
    for (j, s) in [2.0, 0.0, 1.0].into_iter().enumerate() {
        assert_close(m.scores[(0, j)], s);
    }
    for (j, w) in [0.6652, 0.0900, 0.2447].into_iter().enumerate() {
        assert_close(m.weights[(0, j)], w);
    }
}

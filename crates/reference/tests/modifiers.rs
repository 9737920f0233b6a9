//! The score modifiers in the reference (forward): soft-capping, ALiBi and sink
//! logits, by their definitions.

use attn_core::{Alibi, Causal, Error, Layout, Options, SoftCap, Tensor4Ref};

use faer::Mat;

fn data(n: usize, d: usize, seed: usize) -> Mat<f32> {
    Mat::from_fn(n, d, |i, j| ((i * 7 + j * 3 + seed) % 11) as f32 - 5.0)
}

#[test]
fn soft_capped_scores_stay_within_the_cap_and_follow_tanh() {
    let (q, k) = (data(6, 4, 1), data(9, 4, 2));
    let plain =
        attn_reference::Attention::head(q.as_ref(), k.as_ref(), k.as_ref(), &Options::default())
            .and_then(|call| call.materialized())
            .unwrap();
    let cap = SoftCap::new(3.0).unwrap();
    let opts = Options::default().with_softcap(cap);
    let m = attn_reference::Attention::head(q.as_ref(), k.as_ref(), k.as_ref(), &opts)
        .and_then(|call| call.materialized())
        .unwrap();
    for i in 0..6 {
        for j in 0..9 {
            let (s, raw) = (m.scores[(i, j)], plain.scores[(i, j)]);
            assert!(s.abs() <= 3.0, "{s}");
            assert!((s - 3.0 * (raw / 3.0).tanh()).abs() < 1e-12);
        }
    }
}

#[test]
fn alibi_subtracts_the_slope_times_the_distance_and_zero_slopes_change_nothing() {
    let (q, k) = (data(4, 4, 3), data(7, 4, 5));
    let plain =
        attn_reference::Attention::head(q.as_ref(), k.as_ref(), k.as_ref(), &Options::default())
            .and_then(|call| call.materialized())
            .unwrap();
    let zero = [0.0f32];
    let same = attn_reference::Attention::head(
        q.as_ref(),
        k.as_ref(),
        k.as_ref(),
        &Options::default().with_alibi(Alibi::new(&zero)),
    )
    .and_then(|call| call.materialized())
    .unwrap();
    assert_eq!(same.output, plain.output);
    assert_eq!(same.lse, plain.lse);
    let slope = [0.5f32];
    for (align, off) in [(Causal::BottomRight, 3i64), (Causal::TopLeft, 0)] {
        let opts = Options::default().with_alibi(Alibi::new(&slope).with_align(align));
        let m = attn_reference::Attention::head(q.as_ref(), k.as_ref(), k.as_ref(), &opts)
            .and_then(|call| call.materialized())
            .unwrap();
        for i in 0..4 {
            for j in 0..7 {
                let d = (i as i64 + off - j as i64).abs() as f64;
                assert!((m.scores[(i, j)] - (plain.scores[(i, j)] - 0.5 * d)).abs() < 1e-12);
            }
        }
    }
}

#[test]
fn a_sink_takes_its_share_of_the_weight_and_minus_inf_is_no_sink() {
    let (q, k) = (data(5, 4, 7), data(6, 4, 1));
    let opts = Options::default()
        .with_causal(Causal::TopLeft)
        .with_key_length(4);
    let plain = attn_reference::Attention::head(q.as_ref(), k.as_ref(), k.as_ref(), &opts)
        .and_then(|call| call.materialized())
        .unwrap();
    let none = [f32::NEG_INFINITY];
    let same = attn_reference::Attention::head(
        q.as_ref(),
        k.as_ref(),
        k.as_ref(),
        &opts.with_sinks(&none),
    )
    .and_then(|call| call.materialized())
    .unwrap();
    assert_eq!(same.output, plain.output);
    assert_eq!(same.lse, plain.lse);
    let sink = [1.5f32];
    let m = attn_reference::Attention::head(
        q.as_ref(),
        k.as_ref(),
        k.as_ref(),
        &opts.with_sinks(&sink),
    )
    .and_then(|call| call.materialized())
    .unwrap();
    for i in 0..5 {
        let p_sink = (1.5 - m.lse[i]).exp();
        let total: f64 = (0..6).map(|j| m.weights[(i, j)]).sum();
        assert!(
            (total - (1.0 - p_sink)).abs() < 1e-12,
            "row {i}: {total} vs 1 − {p_sink}"
        );
        let want = plain.lse[i].max(1.5)
            + ((plain.lse[i] - plain.lse[i].max(1.5)).exp() + (1.5 - plain.lse[i].max(1.5)).exp())
                .ln();
        assert!((m.lse[i] - want).abs() < 1e-12);
    }
    // A row that sees no key: output 0 and LSE σ.
    let hide = Options::default().with_key_length(0).with_sinks(&sink);
    let e = attn_reference::Attention::head(q.as_ref(), k.as_ref(), k.as_ref(), &hide)
        .and_then(|call| call.materialized())
        .unwrap();
    assert!(e.output.col_iter().all(|c| c.iter().all(|&x| x == 0.0)));
    assert!(e.lse.iter().all(|&l| l == 1.5));
}

#[test]
fn per_head_slopes_and_sinks_are_checked_and_indexed_by_query_head() {
    let x: Vec<f32> = (0..2 * 3 * 4 * 8)
        .map(|i| ((i * 5) % 13) as f32 * 0.1)
        .collect();
    let q = Tensor4Ref::from_layout(&x, [2, 3, 4, 8], Layout::Bhsd).unwrap();
    let (slopes, sinks) = ([0.0f32, 0.25, 0.5], [f32::NEG_INFINITY, 0.0, 2.0]);
    let opts = Options::default()
        .with_alibi(Alibi::new(&slopes))
        .with_sinks(&sinks);
    let (_, lse) = attn_reference::Attention::batched(q, q, q, &opts)
        .and_then(|call| call.forward())
        .map(|f| f.into_parts())
        .unwrap();
    let (_, plain) = attn_reference::Attention::batched(q, q, q, &Options::default())
        .and_then(|call| call.forward())
        .map(|f| f.into_parts())
        .unwrap();
    // Head 0 has slope 0 and no sink: its LSE is the plain one, in both batch entries.
    for b in 0..2 {
        let head0 = (b * 3) * 4..(b * 3 + 1) * 4;
        assert_eq!(lse[head0.clone()], plain[head0]);
    }
    let two = [0.1f32, 0.2];
    assert!(matches!(
        attn_reference::Attention::batched(q, q, q, &Options::default().with_sinks(&two))
            .and_then(|call| call.forward())
            .map(|f| f.into_parts()),
        Err(Error::DimensionMismatch { .. }) | Err(Error::ShapeMismatch { .. })
    ));
    let nan = [0.1f32, f32::NAN, 0.3];
    assert!(matches!(
        attn_reference::Attention::batched(
            q,
            q,
            q,
            &Options::default().with_alibi(Alibi::new(&nan))
        )
        .and_then(|call| call.forward())
        .map(|f| f.into_parts()),
        Err(Error::InvalidValue { index: 1, .. })
    ));
}

#[test]
fn the_backward_pass_checks_modifiers_as_the_forward_does() {
    // Differentiated now (tests/modifiers_backward.rs); still validated like the forward.
    let x = data(4, 4, 1);
    let lse = vec![0.0f32; 4];
    let nan = [f32::NAN];
    let backward = |opts: &Options<'_>| {
        attn_reference::attention_backward(
            x.as_ref(),
            x.as_ref(),
            x.as_ref(),
            x.as_ref(),
            x.as_ref(),
            &lse,
            opts,
        )
    };
    let e = backward(&Options::default().with_sinks(&nan)).unwrap_err();
    assert!(matches!(e, Error::InvalidValue { .. }), "{e}");
    let sink = [0.5f32];
    let g = backward(&Options::default().with_sinks(&sink)).unwrap();
    assert_eq!(g.dsinks.map(|d| d.len()), Some(1));
}

//! The call value itself: what `Attention` promises beyond the numbers its passes compute
//! (those are the oracle's): the `_into` forms write what the owned forms return, in any
//! layout and LSE stride; the threads never change a bit; the pairing of output, LSE and
//! gradient is checked; a KV cache's queries are the newest positions.

use attn_optimized::{
    Attention, Causal, ColMut, ColRef, Error, ForwardRef, GradientsMut, KvCache, Layout, Mat,
    Options, Par, SlidingWindow, Tensor4Mut, Tensor4Ref, bf16,
};

fn mat(n: usize, d: usize, seed: usize) -> Mat<f32> {
    Mat::from_fn(n, d, |i, j| {
        (((i * 31 + j * 17 + seed * 7) % 23) as f32 - 11.0) / 8.0
    })
}

fn data(len: usize, seed: usize) -> Vec<f32> {
    (0..len)
        .map(|i| (((i * 13 + seed * 5) % 29) as f32 - 14.0) / 9.0)
        .collect()
}

fn bits(x: &[f32]) -> Vec<u32> {
    x.iter().map(|v| v.to_bits()).collect()
}

fn mat_bits(m: faer::MatRef<'_, f32>) -> Vec<u32> {
    (0..m.nrows())
        .flat_map(|i| (0..m.ncols()).map(move |j| m[(i, j)].to_bits()))
        .collect()
}

#[test]
fn one_head_into_a_strided_lse_equals_the_owned_forward_and_the_threads_change_no_bit() {
    let (q, k, v) = (mat(300, 32, 1), mat(700, 32, 2), mat(700, 24, 3));
    let opts = Options::default().with_causal(Causal::BottomRight);
    let call = Attention::head(q.as_ref(), k.as_ref(), v.as_ref(), &opts).unwrap();
    let all = call.forward(Par::rayon(0)).unwrap();
    let one = call.forward(Par::Seq).unwrap();
    assert_eq!(
        mat_bits(all.output().as_ref()),
        mat_bits(one.output().as_ref())
    );
    assert_eq!(bits(all.lse()), bits(one.lse()));

    // A transposed output and an LSE every third entry: row 0 of a column-major 3 × 300.
    let mut out_t = Mat::<f32>::zeros(24, 300);
    let mut lse3 = Mat::<f32>::from_fn(3, 300, |_, _| 7.0);
    let lse_view = lse3.as_mut().row_mut(0).transpose_mut();
    assert!(lse_view.row_stride() > 1); // faer pads the columns: a wide stride
    call.forward_into(
        out_t.as_mut().transpose_mut(),
        Some(lse_view),
        Par::rayon(2),
    )
    .unwrap();
    assert_eq!(mat_bits(out_t.transpose()), mat_bits(all.output().as_ref()));
    let strided: Vec<f32> = lse3.row(0).iter().copied().collect();
    assert_eq!(bits(&strided), bits(all.lse()));
    assert!((1..3).all(|r| lse3.row(r).iter().all(|&x| x == 7.0))); // untouched between

    // The backward from the strided views equals the backward from the owned result.
    let d_out = mat(300, 24, 4);
    let owned = call.backward(&all, d_out.as_ref(), Par::Seq).unwrap();
    let fwd = ForwardRef::new(out_t.transpose(), lse3.row(0).transpose());
    let (mut dq, mut dk, mut dv) = (
        Mat::<f32>::zeros(300, 32),
        Mat::<f32>::zeros(700, 32),
        Mat::<f32>::zeros(700, 24),
    );
    let grads = GradientsMut {
        dq: dq.as_mut(),
        dk: dk.as_mut(),
        dv: dv.as_mut(),
    };
    call.backward_into(fwd, d_out.as_ref(), grads, Par::rayon(0))
        .unwrap();
    assert_eq!(mat_bits(dq.as_ref()), mat_bits(owned.dq.as_ref()));
    assert_eq!(mat_bits(dk.as_ref()), mat_bits(owned.dk.as_ref()));
    assert_eq!(mat_bits(dv.as_ref()), mat_bits(owned.dv.as_ref()));
}

#[test]
fn a_batched_call_writes_torch_layouts_of_output_and_lse() {
    let (b, h_q, h_kv, n, d) = (2, 4, 2, 70, 16);
    let (qd, kd) = (data(b * h_q * n * d, 1), data(b * h_kv * n * d, 2));
    let q = Tensor4Ref::from_layout(&qd, [b, h_q, n, d], Layout::Bshd).unwrap();
    let kv = Tensor4Ref::from_layout(&kd, [b, h_kv, n, d], Layout::Bhsd).unwrap();
    let call =
        Attention::batched(q, kv, kv, &Options::default().with_causal(Causal::TopLeft)).unwrap();
    let fwd = call.forward(Par::Seq).unwrap();
    let mut out = vec![0.0f32; b * h_q * n * d];
    let mut lse = vec![0.0f32; b * h_q * n];
    call.forward_into(
        Tensor4Mut::from_layout(&mut out, [b, h_q, n, d], Layout::Bshd).unwrap(),
        Some(Tensor4Mut::from_layout(&mut lse, [b, h_q, n, 1], Layout::Bshd).unwrap()),
        Par::rayon(0),
    )
    .unwrap();
    let (out_t, lse_t) = (
        Tensor4Ref::from_layout(&out, [b, h_q, n, d], Layout::Bshd).unwrap(),
        Tensor4Ref::from_layout(&lse, [b, h_q, n, 1], Layout::Bshd).unwrap(),
    );
    for e in 0..b {
        for h in 0..h_q {
            let want = fwd.output().as_ref().head(e, h).unwrap();
            assert_eq!(mat_bits(out_t.head(e, h).unwrap()), mat_bits(want));
            let rows = &fwd.lse()[(e * h_q + h) * n..(e * h_q + h + 1) * n];
            assert_eq!(mat_bits(lse_t.head(e, h).unwrap()), bits(rows));
        }
    }
    // The backward reads the same strided LSE back.
    let owned = call
        .backward(&fwd, fwd.output().as_ref(), Par::Seq)
        .unwrap();
    let again = call
        .backward(
            ForwardRef::new(out_t, lse_t),
            fwd.output().as_ref(),
            Par::rayon(0),
        )
        .unwrap();
    assert_eq!(bits(owned.dq.as_slice()), bits(again.dq.as_slice()));
    assert_eq!(bits(owned.dk.as_slice()), bits(again.dk.as_slice()));
}

#[test]
fn mismatched_outputs_lse_and_gradients_are_errors() {
    let x = mat(5, 8, 1);
    let call = Attention::head(x.as_ref(), x.as_ref(), x.as_ref(), &Options::default()).unwrap();
    let mut out = Mat::<f32>::zeros(5, 8);
    let mut short = vec![0.0f32; 4];
    let err = call
        .forward_into(
            out.as_mut(),
            Some(ColMut::from_slice_mut(&mut short)),
            Par::Seq,
        )
        .unwrap_err();
    assert_eq!(err, Error::lse_length(4, 5));
    let mut wide = Mat::<f32>::zeros(5, 9);
    assert!(call.forward_into(wide.as_mut(), None, Par::Seq).is_err());

    let fwd = call.forward(Par::Seq).unwrap();
    // An LSE of another call's rows.
    let other = [0.0f32; 3];
    let bad = ForwardRef::new(fwd.output().as_ref(), ColRef::from_slice(&other));
    assert!(call.backward(bad, x.as_ref(), Par::Seq).is_err());
    // dK of the wrong shape.
    let (mut dq, mut dk, mut dv) = (
        Mat::<f32>::zeros(5, 8),
        Mat::<f32>::zeros(4, 8),
        Mat::<f32>::zeros(5, 8),
    );
    let grads = GradientsMut {
        dq: dq.as_mut(),
        dk: dk.as_mut(),
        dv: dv.as_mut(),
    };
    assert!(
        call.backward_into(&fwd, x.as_ref(), grads, Par::Seq)
            .is_err()
    );

    // A key range has no backward pass, and refuses sinks.
    let shard = Attention::keys_of(
        x.as_ref(),
        x.subrows(0, 3),
        x.subrows(0, 3),
        0..3,
        5,
        &Options::default(),
    )
    .unwrap();
    let partial = shard.forward(Par::Seq).unwrap();
    assert!(matches!(
        shard.backward(&partial, x.as_ref(), Par::Seq),
        Err(Error::Unsupported { .. })
    ));
    let sinks = [0.5f32];
    let with_sinks = Options::default().with_sinks(&sinks);
    assert!(matches!(
        Attention::keys_of(
            x.as_ref(),
            x.subrows(0, 3),
            x.subrows(0, 3),
            0..3,
            5,
            &with_sinks
        ),
        Err(Error::Unsupported { .. })
    ));
}

#[test]
fn a_cache_call_aligns_bottom_right_and_refuses_top_left_when_it_would_differ() {
    let (h, d) = (2, 8);
    let mut cache = KvCache::<bf16>::new(1, h, 16, d, d).unwrap();
    let prompt: Vec<bf16> = data(h * 5 * d, 3).into_iter().map(bf16::from_f32).collect();
    let prompt = Tensor4Ref::from_layout(&prompt, [1, h, 5, d], Layout::Bhsd).unwrap();
    cache.append(prompt, prompt).unwrap();
    // The prompt's own queries: both alignments agree, both are accepted, same bits.
    let tl = Options::default().with_causal(Causal::TopLeft);
    let br = Options::default().with_causal(Causal::BottomRight);
    let a = cache
        .attention(prompt, &tl)
        .unwrap()
        .forward(Par::Seq)
        .unwrap();
    let b = cache
        .attention(prompt, &br)
        .unwrap()
        .forward(Par::Seq)
        .unwrap();
    assert_eq!(a, b);

    let token: Vec<bf16> = data(h * d, 4).into_iter().map(bf16::from_f32).collect();
    let token = Tensor4Ref::from_layout(&token, [1, h, 1, d], Layout::Bhsd).unwrap();
    cache.append(token, token).unwrap();
    for opts in [
        tl,
        Options::default().with_window(SlidingWindow::new(Some(2), Some(0), Causal::TopLeft)),
    ] {
        assert!(matches!(
            cache.attention(token, &opts),
            Err(Error::Unsupported { .. })
        ));
    }
    // Bottom-right: the new token sees all six positions, as one causal pass's last row.
    let step = cache
        .attention(token, &br)
        .unwrap()
        .forward(Par::rayon(0))
        .unwrap();
    let keys = cache.keys();
    let values = cache.values();
    for head in 0..h {
        let k = keys.head(0, head).unwrap().subrows(0, 6);
        let v = values.head(0, head).unwrap().subrows(0, 6);
        let q = token.head(0, head).unwrap();
        let one = Attention::head(q, k, v, &br)
            .unwrap()
            .forward(Par::Seq)
            .unwrap();
        let got = step.output().as_ref().head(0, head).unwrap();
        assert_eq!(got.row(0), one.output().row(0));
    }
    // A cache's call has no backward pass.
    let call = cache.attention(token, &br).unwrap();
    let fwd = call.forward(Par::Seq).unwrap();
    assert!(matches!(
        call.backward(&fwd, fwd.output().as_ref(), Par::Seq),
        Err(Error::Unsupported { .. })
    ));
}

//! Ragged batches beyond the oracle's properties: masks per batch entry and head in the KV
//! cache, the typed errors of 4-D masks and packed calls, the `_into` forms of packed
//! calls in other layouts and types, and packed bits independent of the thread count.

use attn_optimized::{
    Attention, BoolMask, BoolMask4, Causal, CuSeqlens, Error, ForwardRef, GradientsMut, KvCache,
    Layout, Mask4Ref, Options, Par, Tensor4, Tensor4Mut, Tensor4Ref, attention,
};
use faer::Mat;
use half::f16;

fn values(n: usize, seed: usize) -> Vec<f32> {
    (0..n)
        .map(|i| (((i * 2_654_435_761 + seed * 97) % 1000) as f32 / 500.0) - 1.0)
        .collect()
}

#[test]
fn cache_attend_takes_per_head_masks_over_the_longest_entry() -> attn_optimized::Result<()> {
    let (d, h_q, lens) = (8, 4, [7usize, 3]);
    let mut cache = KvCache::<f32>::new(2, 2, 16, d, d)?;
    let (k, v) = (values(2 * 2 * 7 * d, 1), values(2 * 2 * 7 * d, 2));
    for (b, &len) in lens.iter().enumerate() {
        let at = b * 2 * 7 * d;
        let k = Tensor4Ref::from_layout(&k[at..at + 2 * len * d], [1, 2, len, d], Layout::Bhsd)?;
        let v = Tensor4Ref::from_layout(&v[at..at + 2 * len * d], [1, 2, len, d], Layout::Bhsd)?;
        cache.append_to(b, k, v)?;
    }
    let q = values(2 * h_q * 2 * d, 3);
    let q = Tensor4Ref::from_layout(&q, [2, h_q, 2, d], Layout::Bhsd)?;
    // A different mask per entry and head, over the longest entry's 7 keys.
    let bits: Vec<bool> = (0..2 * h_q * 2 * 7).map(|e| e % 3 != 1).collect();
    let mask = Mask4Ref::contiguous(&bits, [2, h_q, 2, 7])?;
    let opts = Options::default()
        .with_causal(Causal::BottomRight)
        .with_bool_mask_4d(BoolMask4::allow(mask));
    let out = cache
        .attention(q, &opts)
        .and_then(|call| call.forward(Par::rayon(0)))
        .map(|f| f.into_output())?;
    for (b, &len) in lens.iter().enumerate() {
        for h in 0..h_q {
            let allow = Mat::from_fn(2, len, |i, j| bits[((b * h_q + h) * 2 + i) * 7 + j]);
            let single = Options::default()
                .with_causal(Causal::BottomRight)
                .with_bool_mask(BoolMask::allow(allow.as_ref()));
            let kv = h / 2;
            let keys = cache.keys().head(b, kv)?.subrows(0, len);
            let vals = cache.values().head(b, kv)?.subrows(0, len);
            let want = attention(q.head(b, h)?, keys, vals, &single)?;
            let got = out.as_ref().head(b, h)?;
            for i in 0..2 {
                for c in 0..d {
                    assert!(
                        (got[(i, c)] - want[(i, c)]).abs() < 1e-6,
                        "entry {b}, head {h}, [{i}, {c}]: {} vs {}",
                        got[(i, c)],
                        want[(i, c)]
                    );
                }
            }
        }
    }
    Ok(())
}

/// Fails unless `err` names `operand`, as a layout error (`layout`) or an unsupported one.
fn assert_error(err: &Error, operand: &str, layout: bool) {
    let named = match err {
        Error::Layout { operand: o, .. } if layout => *o == operand,
        Error::Unsupported { operand: o, .. } if !layout => *o == operand,
        _ => false,
    };
    assert!(named, "{err}");
}

#[test]
fn four_d_mask_errors_name_the_operand() -> attn_optimized::Result<()> {
    let x = values(2 * 3 * 4, 1);
    let x = Tensor4Ref::from_layout(&x, [1, 2, 3, 4], Layout::Bhsd)?;
    let bits = vec![true; 2 * 3 * 3];
    // Three heads do not broadcast to two.
    let wrong = Mask4Ref::contiguous(&bits, [1, 3, 2, 3])?;
    let opts = Options::default().with_bool_mask_4d(BoolMask4::allow(wrong));
    let err = Attention::batched(x, x, x, &opts)
        .and_then(|call| call.forward(Par::rayon(0)))
        .map(|f| f.into_output())
        .unwrap_err();
    assert_error(&err, "boolean mask (4-D)", true);
    // Both a 2-D and a 4-D mask of the same kind.
    let right = Mask4Ref::contiguous(&bits, [1, 2, 3, 3])?;
    let m2 = Mat::<bool>::from_fn(3, 3, |_, _| true);
    let both = Options::default()
        .with_bool_mask(BoolMask::allow(m2.as_ref()))
        .with_bool_mask_4d(BoolMask4::allow(right));
    let err = Attention::batched(x, x, x, &both)
        .and_then(|call| call.forward(Par::rayon(0)))
        .map(|f| f.into_output())
        .unwrap_err();
    assert_error(&err, "boolean mask", false);
    // A 4-D mask on a single-head call.
    let q = x.head(0, 0)?;
    let single =
        Options::default().with_additive_mask_4d(Mask4Ref::contiguous(&[0.0f32; 9], [1, 1, 3, 3])?);
    let err = attention(q, q, q, &single).unwrap_err();
    assert_error(&err, "additive mask (4-D)", false);
    // Neither matrix axis contiguous or broadcast.
    let err = Mask4Ref::new(&bits, [1, 1, 2, 2], [0, 0, 2, 3]).unwrap_err();
    assert_error(&err, "4-D mask", true);
    // A view past its buffer.
    let err = Mask4Ref::new(&bits, [1, 2, 3, 3], [9, 10, 3, 1]).unwrap_err();
    assert_error(&err, "4-D mask", true);
    Ok(())
}

#[test]
fn packed_errors_are_typed() -> attn_optimized::Result<()> {
    let x = values(5 * 4, 1);
    let x = Tensor4Ref::from_layout(&x, [1, 1, 5, 4], Layout::Bshd)?;
    let opts = Options::default();
    let layout = |e: Error, operand: &str| match e {
        Error::Layout { operand: o, .. } => assert_eq!(o, operand),
        other => panic!("{other}"),
    };
    layout(CuSeqlens::new(&[], &[]).unwrap_err(), "cu_seqlens_q");
    layout(
        CuSeqlens::new(&[0, 5], &[2, 5]).unwrap_err(),
        "cu_seqlens_k",
    );
    layout(
        CuSeqlens::new(&[0, 4, 3, 5], &[0, 1, 2, 5]).unwrap_err(),
        "cu_seqlens_q",
    );
    assert!(matches!(
        CuSeqlens::new(&[0, 5], &[0, 2, 5]).unwrap_err(),
        Error::DimensionMismatch {
            operand: "cu_seqlens_k",
            ..
        }
    ));
    let short = CuSeqlens::new(&[0, 2, 5], &[0, 2, 4])?;
    layout(
        Attention::packed(x, x, x, &short, &opts)
            .and_then(|call| call.forward(Par::rayon(0)))
            .map(|f| f.into_output())
            .unwrap_err(),
        "cu_seqlens_k",
    );
    // Element-wise masks and key padding have no meaning in packed mode.
    let seqs = CuSeqlens::new(&[0, 2, 5], &[0, 2, 5])?;
    let m = Mat::<f32>::zeros(5, 5);
    for o in [
        opts.with_additive_mask(m.as_ref()),
        opts.with_key_length(2),
        opts.with_additive_mask_4d(Mask4Ref::contiguous(&[0.0f32; 25], [1, 1, 5, 5])?),
    ] {
        let err = Attention::packed(x, x, x, &seqs, &o)
            .and_then(|call| call.forward(Par::rayon(0)))
            .map(|f| f.into_output())
            .unwrap_err();
        assert_error(&err, "packed options", false);
    }
    // A packed batch is one view with a batch axis of 1.
    let two = values(2 * 5 * 4, 2);
    let two = Tensor4Ref::from_layout(&two, [2, 1, 5, 4], Layout::Bshd)?;
    layout(
        Attention::packed(two, two, two, &seqs, &opts)
            .and_then(|call| call.forward(Par::rayon(0)))
            .map(|f| f.into_output())
            .unwrap_err(),
        "Q",
    );
    // The caller's views are checked too.
    let mut out = vec![0.0f32; 4 * 4];
    let view = Tensor4Mut::from_layout(&mut out, [1, 1, 4, 4], Layout::Bshd)?;
    layout(
        Attention::packed(x, x, x, &seqs, &opts)
            .and_then(|call| call.forward_into(view, None, Par::rayon(0)))
            .unwrap_err(),
        "output tensor",
    );
    Ok(())
}

#[test]
fn packed_into_writes_other_layouts_and_types() -> attn_optimized::Result<()> {
    let (heads, total, d) = (2, 9, 8);
    let x: Vec<f16> = values(heads * total * d, 4)
        .into_iter()
        .map(f16::from_f32)
        .collect();
    let x = Tensor4Ref::from_layout(&x, [1, heads, total, d], Layout::Bshd)?;
    let seqs = CuSeqlens::new(&[0, 1, 1, 6, 9], &[0, 2, 2, 6, 9])?;
    let opts = Options::default().with_causal(Causal::BottomRight);
    let (owned, lse) = Attention::packed(x, x, x, &seqs, &opts)
        .and_then(|call| call.forward(Par::rayon(0)))
        .map(|f| f.into_parts())?;
    // f32 output in [B,H,S,D], written in place: the owned f16 result is it rounded.
    let mut wide = vec![f32::NAN; heads * total * d];
    let mut lse_into = vec![f32::NAN; heads * total];
    let view = Tensor4Mut::from_layout(&mut wide, [1, heads, total, d], Layout::Bhsd)?;
    let lse_view = Tensor4Mut::new(
        &mut lse_into,
        [1, heads, total, 1],
        [heads * total, total, 1],
    )?;
    Attention::packed(x, x, x, &seqs, &opts)?.forward_into(view, Some(lse_view), Par::rayon(0))?;
    let rounded: Vec<f16> = wide.iter().map(|&w| f16::from_f32(w)).collect();
    assert_eq!(rounded, owned.into_vec());
    assert_eq!(lse_into, lse);

    // The backward pass into f32 views in [B,S,H,D] equals the owned f16 one, rounded.
    let (out, lse) = Attention::packed(x, x, x, &seqs, &opts)
        .and_then(|call| call.forward(Par::rayon(0)))
        .map(|f| f.into_parts())?;
    let g = Attention::packed(x, x, x, &seqs, &opts).and_then(|call| {
        call.backward(
            ForwardRef::batch(out.as_ref(), &lse)?,
            out.as_ref(),
            Par::rayon(0),
        )
    })?;
    let n = heads * total * d;
    let (mut dq, mut dk, mut dv) = (vec![0.0f32; n], vec![0.0f32; n], vec![0.0f32; n]);
    let dims = [1, heads, total, d];
    Attention::packed(x, x, x, &seqs, &opts).and_then(|call| {
        call.backward_into(
            ForwardRef::batch(out.as_ref(), &lse)?,
            out.as_ref(),
            GradientsMut {
                dq: Tensor4Mut::from_layout(&mut dq, dims, Layout::Bshd)?,
                dk: Tensor4Mut::from_layout(&mut dk, dims, Layout::Bshd)?,
                dv: Tensor4Mut::from_layout(&mut dv, dims, Layout::Bshd)?,
            },
            Par::rayon(0),
        )
    })?;
    for (name, into, owned) in [("dQ", &dq, &g.dq), ("dK", &dk, &g.dk), ("dV", &dv, &g.dv)] {
        let into = Tensor4Ref::from_layout(into, dims, Layout::Bshd)?;
        for h in 0..heads {
            let (a, b) = (into.head(0, h)?, owned.as_ref().head(0, h)?);
            for i in 0..total {
                for c in 0..d {
                    assert_eq!(
                        f16::from_f32(a[(i, c)]),
                        b[(i, c)],
                        "{name} head {h} [{i}, {c}]"
                    );
                }
            }
        }
    }
    Ok(())
}

#[test]
fn packed_bits_do_not_depend_on_the_thread_count() -> attn_optimized::Result<()> {
    let (heads, d) = (4, 16);
    let cu = [0usize, 130, 131, 131, 400];
    let total = cu[cu.len() - 1];
    let x = values(heads * total * d, 5);
    let x = Tensor4Ref::from_layout(&x, [1, heads, total, d], Layout::Bshd)?;
    let seqs = CuSeqlens::new(&cu, &cu)?;
    let opts = Options::default().with_causal(Causal::TopLeft);
    let run = |threads: usize| -> attn_optimized::Result<(Tensor4<f32>, Vec<u32>)> {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .expect("a pool");
        pool.install(|| {
            let (o, lse) = Attention::packed(x, x, x, &seqs, &opts)
                .and_then(|call| call.forward(Par::rayon(0)))
                .map(|f| f.into_parts())?;
            let g = Attention::packed(x, x, x, &seqs, &opts).and_then(|call| {
                call.backward(
                    ForwardRef::batch(o.as_ref(), &lse)?,
                    o.as_ref(),
                    Par::rayon(0),
                )
            })?;
            let bits = [&g.dq, &g.dk, &g.dv]
                .iter()
                .flat_map(|t| t.as_slice().iter().map(|x| x.to_bits()))
                .collect();
            Ok((o, bits))
        })
    };
    let (o1, g1) = run(1)?;
    for threads in [2, 3] {
        let (o, g) = run(threads)?;
        assert_eq!(o, o1, "output with {threads} threads");
        assert!(g == g1, "gradient bits with {threads} threads");
    }
    Ok(())
}

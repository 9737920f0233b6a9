//! Decoding through the KV cache equals one causal pass; bad appends leave it unchanged.

mod common;

use attn_optimized::{
    Attention, Causal, Element, Error, Growth, KvCache, Layout, Options, Par, SplitKv, Tensor4,
    Tensor4Ref,
};
use common::data;
use half::f16;

/// Token `t` of a `[B,S,H,D]` buffer as its own `[B, H, 1, D]` view.
fn token<T>(buf: &[T], dims: [usize; 4], t: usize) -> Tensor4Ref<'_, T> {
    let [b, h, s, d] = dims;
    Tensor4Ref::new(&buf[t * h * d..], [b, h, 1, d], [s * h * d, d, h * d]).unwrap()
}

fn generate_matches_one_pass<T: Element>(h_q: usize, h_kv: usize, tol: f32) {
    let (b, n, d) = (2, 300, 32);
    let (qd, kd, vd) = (
        data::<T>(b * n * h_q * d, 1, 1.0),
        data::<T>(b * n * h_kv * d, 2, 1.0),
        data::<T>(b * n * h_kv * d, 3, 1.0),
    );
    let causal = Options::default().with_causal(Causal::BottomRight);
    let q = Tensor4Ref::from_layout(&qd, [b, h_q, n, d], Layout::Bshd).unwrap();
    let k = Tensor4Ref::from_layout(&kd, [b, h_kv, n, d], Layout::Bshd).unwrap();
    let v = Tensor4Ref::from_layout(&vd, [b, h_kv, n, d], Layout::Bshd).unwrap();
    let full = Attention::batched(q, k, v, &causal)
        .and_then(|call| call.forward(Par::rayon(0)))
        .map(|f| f.into_output())
        .unwrap();

    // Prefill 100 tokens in one chunk, then generate the rest one at a time.
    let mut cache = KvCache::<T>::new(b, h_kv, n, d, d).unwrap();
    let prefill = 100;
    let kp = Tensor4Ref::new(&kd, [b, h_kv, prefill, d], [n * h_kv * d, d, h_kv * d]).unwrap();
    let vp = Tensor4Ref::new(&vd, [b, h_kv, prefill, d], [n * h_kv * d, d, h_kv * d]).unwrap();
    cache.append(kp, vp).unwrap();
    let qp = Tensor4Ref::new(&qd, [b, h_q, prefill, d], [n * h_q * d, d, h_q * d]).unwrap();
    let first = cache
        .attention(qp, &causal)
        .and_then(|call| call.forward(Par::rayon(0)))
        .map(|f| f.into_output())
        .unwrap();
    let mut rows: Vec<Tensor4<T>> = vec![first];
    for t in prefill..n {
        cache
            .append(
                token(&kd, [b, h_kv, n, d], t),
                token(&vd, [b, h_kv, n, d], t),
            )
            .unwrap();
        rows.push(
            cache
                .attention(token(&qd, [b, h_q, n, d], t), &causal)
                .and_then(|call| call.forward(Par::rayon(0)))
                .map(|f| f.into_output())
                .unwrap(),
        );
    }
    for bi in 0..b {
        for h in 0..h_q {
            let want = full.as_ref().head(bi, h).unwrap();
            for t in 0..n {
                let (src, row) = if t < prefill {
                    (&rows[0], t)
                } else {
                    (&rows[t - prefill + 1], 0)
                };
                let got = src.as_ref().head(bi, h).unwrap();
                for c in 0..d {
                    let (g, w) = (got[(row, c)].to_f32(), want[(t, c)].to_f32());
                    assert!(
                        (g - w).abs() <= tol * (1.0 + w.abs()),
                        "b{bi} h{h} t{t} c{c}: {g} vs {w}"
                    );
                }
            }
        }
    }
}

#[test]
fn generating_token_by_token_equals_one_causal_pass_f32() {
    generate_matches_one_pass::<f32>(4, 2, 2e-6); // GQA
    generate_matches_one_pass::<f32>(3, 3, 2e-6); // MHA
    generate_matches_one_pass::<f32>(4, 1, 2e-6); // MQA
}

#[test]
fn generating_token_by_token_equals_one_causal_pass_half() {
    // Both sides round their outputs to the half type: one ulp apart at most.
    generate_matches_one_pass::<f16>(4, 2, 2f32.powi(-10));
    generate_matches_one_pass::<half::bf16>(2, 2, 2f32.powi(-7));
}

#[test]
fn ragged_batch_entries_attend_their_own_length() {
    let (h, d) = (2, 16);
    let kd = data::<f32>(40 * h * d, 5, 1.0);
    let mut cache = KvCache::<f32>::new(2, h, 64, d, d).unwrap();
    let k =
        |n: usize| Tensor4Ref::from_layout(&kd[..n * h * d], [1, h, n, d], Layout::Bshd).unwrap();
    cache.append_to(0, k(40), k(40)).unwrap();
    cache.append_to(1, k(7), k(7)).unwrap();
    assert_eq!(cache.lens(), &[40, 7]);
    let qd = data::<f32>(2 * h * d, 6, 1.0);
    let q = Tensor4Ref::from_layout(&qd, [2, h, 1, d], Layout::Bhsd).unwrap();
    let got = cache
        .attention(q, &Options::default().with_causal(Causal::BottomRight))
        .and_then(|call| call.forward(Par::rayon(0)))
        .map(|f| f.into_output())
        .unwrap();
    for (b, n) in [(0, 40), (1, 7)] {
        let qb = Tensor4Ref::new(&qd[b * h * d..], [1, h, 1, d], [0, d, d]).unwrap();
        let want = Attention::batched(qb, k(n), k(n), &Options::default())
            .and_then(|call| call.forward(Par::rayon(0)))
            .map(|f| f.into_output())
            .unwrap();
        for hh in 0..h {
            let (g, w) = (
                got.as_ref().head(b, hh).unwrap(),
                want.as_ref().head(0, hh).unwrap(),
            );
            for c in 0..d {
                assert!((g[(0, c)] - w[(0, c)]).abs() < 1e-6);
            }
        }
    }
}

#[test]
fn bad_appends_are_typed_errors_and_leave_the_cache_unchanged() {
    let (h, d) = (2, 8);
    let ok = data::<f32>(3 * h * d, 1, 1.0);
    fn kv(buf: &[f32], b: usize, hh: usize, n: usize, dd: usize) -> Tensor4Ref<'_, f32> {
        Tensor4Ref::from_layout(&buf[..b * hh * n * dd], [b, hh, n, dd], Layout::Bhsd).unwrap()
    }
    let mut cache = KvCache::<f32>::new(1, h, 4, d, d).unwrap();
    cache
        .append(kv(&ok, 1, h, 3, d), kv(&ok, 1, h, 3, d))
        .unwrap();
    let before = cache.clone();
    let wide = data::<f32>(3 * h * (d + 1), 2, 1.0);
    let cases = [
        cache
            .clone()
            .append(kv(&wide, 1, h, 1, d + 1), kv(&ok, 1, h, 1, d))
            .unwrap_err(),
        cache
            .clone()
            .append(kv(&ok, 1, 1, 1, d), kv(&ok, 1, 1, 1, d))
            .unwrap_err(),
        cache
            .clone()
            .append_to(3, kv(&ok, 1, h, 1, d), kv(&ok, 1, h, 1, d))
            .unwrap_err(),
        cache
            .clone()
            .append(kv(&ok, 1, h, 2, d), kv(&ok, 1, h, 2, d))
            .unwrap_err(),
    ];
    assert_eq!(
        cases[0].to_string(),
        "new K has 9 columns but the cache has 8 (d_k must match)"
    );
    assert!(matches!(
        cases[1],
        Error::DimensionMismatch { axis: "heads", .. }
    ));
    assert!(matches!(
        cases[2],
        Error::OutOfRange {
            what: "batch",
            index: 3,
            len: 1
        }
    ));
    assert!(matches!(
        cases[3],
        Error::Capacity {
            requested: 5,
            capacity: 4,
            ..
        }
    ));
    // Each failing call above ran on a clone; the failing append on the cache itself too:
    assert!(
        cache
            .append(kv(&ok, 1, h, 2, d), kv(&ok, 1, h, 2, d))
            .is_err()
    );
    assert_eq!(cache.lens(), before.lens());
    assert_eq!(
        cache.keys().head(0, 1).unwrap(),
        before.keys().head(0, 1).unwrap()
    );
    let q = data::<f32>(3 * h * d, 3, 1.0);
    assert!(matches!(
        cache
            .attention(
                Tensor4Ref::from_layout(&q, [1, 3, 1, d], Layout::Bhsd).unwrap(),
                &Options::default()
            )
            .and_then(|call| call.forward(Par::rayon(0)))
            .map(|f| f.into_output()),
        Err(Error::HeadGrouping { h_q: 3, h_kv: 2 })
    ));
}

#[test]
fn absurd_sizes_are_errors_not_aborts() {
    assert!(matches!(
        KvCache::<f32>::new(1 << 20, 1 << 20, 1 << 20, 1 << 20, 1),
        Err(Error::Allocation {
            what: "KV cache keys",
            bytes: usize::MAX
        })
    ));
    assert!(matches!(
        KvCache::<f16>::new(1, 1, usize::MAX / 4, 4, 4),
        Err(Error::Allocation {
            what: "KV cache keys",
            ..
        })
    ));
}

#[test]
fn doubling_growth_keeps_the_tokens() {
    let (h, d) = (1, 4);
    let buf = data::<f32>(10 * d, 9, 1.0);
    let mut cache = KvCache::<f32>::new(1, h, 2, d, d)
        .unwrap()
        .with_growth(Growth::Double);
    for t in 0..10 {
        let x =
            Tensor4Ref::from_layout(&buf[t * d..(t + 1) * d], [1, 1, 1, d], Layout::Bhsd).unwrap();
        cache.append(x, x).unwrap();
    }
    assert_eq!((cache.len(0), cache.capacity()), (10, 16));
    let keys = cache.keys();
    for t in 0..10 {
        assert_eq!(keys.head(0, 0).unwrap()[(t, 2)], buf[t * d + 2]);
    }
}

#[test]
fn split_kv_decode_is_deterministic_across_thread_counts() {
    let (h, n, d) = (2, 5000, 64);
    let kd = data::<f32>(h * n * d, 4, 1.0);
    let mut cache = KvCache::<f32>::new(1, h, n, d, d).unwrap();
    let kv = Tensor4Ref::from_layout(&kd, [1, h, n, d], Layout::Bhsd).unwrap();
    cache.append(kv, kv).unwrap();
    let qd = data::<f32>(h * d, 8, 1.0);
    let q = Tensor4Ref::from_layout(&qd, [1, h, 1, d], Layout::Bhsd).unwrap();
    let opts = Options::default().with_causal(Causal::BottomRight);
    let run = |t: usize| {
        rayon::ThreadPoolBuilder::new()
            .num_threads(t)
            .build()
            .unwrap()
            .install(|| {
                cache
                    .attention(q, &opts)
                    .and_then(|call| call.forward(Par::rayon(0)))
                    .map(|f| f.into_output())
                    .unwrap()
            })
    };
    let one = run(1);
    assert_eq!(run(2), one);
    assert_eq!(run(3), one);
    let unsplit = cache
        .attention(q, &opts)
        .and_then(|call| call.split_kv(SplitKv::Never).forward(Par::rayon(0)))
        .map(|f| f.into_output())
        .unwrap();
    for (a, b) in one.as_slice().iter().zip(unsplit.as_slice()) {
        assert!((a - b).abs() < 1e-6);
    }
}

/// The LSE of a cache step is that of attention over each entry's cached keys: ragged
/// lengths, grouped heads (stacked for one query), f32 and f16 storage.
fn lse_matches_attention_over_the_cached_keys<T: Element>() {
    let (b, h_q, h_kv, cap, d) = (2, 8, 2, 700, 64);
    let lens = [700, 333];
    let mut cache = KvCache::<T>::new(b, h_kv, cap, d, d).unwrap();
    let (kd, vd) = (
        data::<T>(h_kv * cap * d, 5, 1.0),
        data::<T>(h_kv * cap * d, 6, 1.0),
    );
    for (bi, &len) in lens.iter().enumerate() {
        let k = Tensor4Ref::from_layout(&kd[..h_kv * len * d], [1, h_kv, len, d], Layout::Bhsd);
        let v = Tensor4Ref::from_layout(&vd[..h_kv * len * d], [1, h_kv, len, d], Layout::Bhsd);
        cache.append_to(bi, k.unwrap(), v.unwrap()).unwrap();
    }
    let qd = data::<T>(b * h_q * d, 7, 1.0);
    let q = Tensor4Ref::from_layout(&qd, [b, h_q, 1, d], Layout::Bhsd).unwrap();
    let opts = Options::default().with_causal(Causal::BottomRight);
    let (out, lse) = cache
        .attention(q, &opts)
        .and_then(|call| call.forward(Par::rayon(0)))
        .map(|f| f.into_parts())
        .unwrap();
    let plain = cache
        .attention(q, &opts)
        .and_then(|call| call.forward(Par::rayon(0)))
        .map(|f| f.into_output())
        .unwrap();
    let bits = |t: &Tensor4<T>| {
        t.as_slice()
            .iter()
            .map(|x| x.to_f32().to_bits())
            .collect::<Vec<_>>()
    };
    assert_eq!(bits(&out), bits(&plain));
    assert_eq!(lse.len(), b * h_q);
    for (bi, &len) in lens.iter().enumerate() {
        for h in 0..h_q {
            let kv = h / (h_q / h_kv);
            let k = cache.keys().head(bi, kv).unwrap().subrows(0, len);
            let v = cache.values().head(bi, kv).unwrap().subrows(0, len);
            let qh = q.head(bi, h).unwrap();
            let (_, want) = Attention::head(qh, k, v, &opts)
                .and_then(|call| call.forward(Par::rayon(0)))
                .map(|f| f.into_parts())
                .unwrap();
            let got = lse[bi * h_q + h];
            assert!(
                (got - want[0]).abs() < 1e-5 * want[0].abs().max(1.0),
                "{got} vs {}",
                want[0]
            );
        }
    }
}

#[test]
fn attend_with_lse_matches_attention_over_the_cached_keys() {
    lse_matches_attention_over_the_cached_keys::<f32>();
    lse_matches_attention_over_the_cached_keys::<f16>();
}

/// `t` tokens of `h` heads of width `d` that are all the same `d` numbers (a broadcast view,
/// so any `t` costs nothing to build).
fn broadcast<T>(row: &[T], h: usize, t: usize) -> Tensor4Ref<'_, T> {
    Tensor4Ref::new(row, [1, h, t, row.len()], [0, 0, 0]).unwrap()
}

#[test]
fn a_doubling_cache_fed_2_pow_40_broadcast_tokens_fails_to_allocate_and_is_unchanged() {
    let d = 64;
    let row = vec![0.5f32; d];
    let mut cache = KvCache::<f32>::new(1, 1, 4, d, d)
        .unwrap()
        .with_growth(Growth::Double);
    cache
        .append(broadcast(&row, 1, 1), broadcast(&row, 1, 1))
        .unwrap();
    // 2^40 tokens · 64 floats = 2^48 bytes per tensor: more than any address space here.
    let huge = broadcast(&row, 1, 1 << 40);
    let err = cache.append(huge, huge).unwrap_err();
    assert!(matches!(err, Error::Allocation { .. }), "{err}");
    assert!(err.to_string().contains("KV cache"), "{err}");
    let err = cache.append_to(0, huge, huge).unwrap_err();
    assert!(matches!(err, Error::Allocation { .. }), "{err}");
    assert_eq!((cache.lens(), cache.capacity()), (&[1][..], 4));
    // Still usable.
    cache
        .append(broadcast(&row, 1, 7), broadcast(&row, 1, 7))
        .unwrap();
    assert_eq!((cache.lens(), cache.capacity()), (&[8][..], 8));
}

#[test]
fn appending_usize_max_tokens_is_a_capacity_error_not_an_overflow() {
    let row = [1.0f32; 4];
    let max = broadcast(&row, 1, usize::MAX);
    for growth in [Growth::Fixed, Growth::Double] {
        let mut cache = KvCache::<f32>::new(1, 1, 4, 4, 4)
            .unwrap()
            .with_growth(growth);
        cache
            .append(broadcast(&row, 1, 1), broadcast(&row, 1, 1))
            .unwrap();
        // 1 + usize::MAX tokens: the count itself overflows.
        for err in [
            cache.append(max, max).unwrap_err(),
            cache.append_to(0, max, max).unwrap_err(),
        ] {
            assert!(
                matches!(
                    err,
                    Error::Capacity {
                        requested: usize::MAX,
                        capacity: 4,
                        ..
                    }
                ),
                "{growth:?}: {err}"
            );
        }
        assert_eq!(cache.lens(), &[1]);
    }
    // From empty, usize::MAX tokens is a count that fits but a buffer that cannot.
    let mut cache = KvCache::<f32>::new(1, 1, 4, 4, 4)
        .unwrap()
        .with_growth(Growth::Double);
    let err = cache.append(max, max).unwrap_err();
    assert!(matches!(err, Error::Allocation { .. }), "{err}");
    assert!(cache.is_empty());
}

#[test]
fn a_doubling_cache_grows_from_zero_capacity_and_with_empty_values() {
    let row = [0.25f32; 4];
    for (capacity, d_v) in [(0, 4), (2, 0), (0, 0)] {
        let mut cache = KvCache::<f32>::new(1, 2, capacity, 4, d_v)
            .unwrap()
            .with_growth(Growth::Double);
        let v = Tensor4Ref::new(&row[..d_v], [1, 2, 3, d_v], [0, 0, 0]).unwrap();
        cache.append(broadcast(&row, 2, 3), v).unwrap();
        cache.append(broadcast(&row, 2, 3), v).unwrap();
        assert_eq!(cache.lens(), &[6], "capacity {capacity}, d_v {d_v}");
        assert!(cache.capacity() >= 6);
        let keys = cache.keys();
        assert_eq!(keys.head(0, 1).unwrap()[(5, 3)], 0.25);
    }
    // No batch entry: no element whatever the capacity and width, and growing copies none.
    let d = 1 << 40;
    let mut cache = KvCache::<f32>::new(0, 1, 1 << 40, d, 4)
        .unwrap()
        .with_growth(Growth::Double);
    let k = Tensor4Ref::<f32>::new(&[], [0, 1, 1 << 41, d], [0, 0, 0]).unwrap();
    let v = Tensor4Ref::<f32>::new(&[], [0, 1, 1 << 41, 4], [0, 0, 0]).unwrap();
    cache.append(k, v).unwrap();
    assert_eq!(cache.capacity(), 1 << 41);
}

#[test]
fn caches_whose_lengths_cannot_be_allocated_are_errors() {
    // No K/V element (no heads), but one length per batch entry: 2^53 bytes.
    let err = KvCache::<f32>::new(1 << 50, 0, 8, 4, 4).unwrap_err();
    assert!(matches!(err, Error::Allocation { .. }), "{err}");
    let err = KvCache::<f32>::new(usize::MAX, 0, 8, 4, 4).unwrap_err();
    assert!(matches!(err, Error::Allocation { .. }), "{err}");
}

#[test]
fn attending_a_query_whose_output_cannot_be_allocated_is_an_error() {
    // A broadcast query of 2^62 positions: its output's size overflows.
    let mut cache = KvCache::<f32>::new(1, 1, 4, 4, 4).unwrap();
    let row = [1.0f32; 4];
    cache
        .append(broadcast(&row, 1, 2), broadcast(&row, 1, 2))
        .unwrap();
    let q = broadcast(&row, 1, 1 << 62);
    let err = cache
        .attention(q, &Options::default())
        .and_then(|call| call.forward(Par::rayon(0)))
        .map(|f| f.into_output())
        .unwrap_err();
    assert!(matches!(err, Error::Allocation { .. }), "{err}");
    // 2^46 positions × 4 floats: 2^50 bytes, a size that fits usize but no address space.
    let q = broadcast(&row, 1, 1 << 46);
    let err = cache
        .attention(q, &Options::default())
        .and_then(|call| call.forward(Par::rayon(0)))
        .map(|f| f.into_parts())
        .unwrap_err();
    assert!(
        matches!(
            err,
            Error::Allocation {
                what: "attention output",
                bytes
            } if bytes == 1 << 50
        ),
        "{err}"
    );
    // Empty values (d_v = 0): the output is empty but its LSE is not.
    let mut cache = KvCache::<f32>::new(1, 1, 4, 4, 0).unwrap();
    let none = Tensor4Ref::<f32>::new(&[], [1, 1, 2, 0], [0, 0, 0]).unwrap();
    cache.append(broadcast(&row, 1, 2), none).unwrap();
    // 2^50 rows: 2^52 bytes of LSE.
    let q = broadcast(&row, 1, 1 << 50);
    let err = cache
        .attention(q, &Options::default())
        .and_then(|call| call.forward(Par::rayon(0)))
        .map(|f| f.into_parts())
        .unwrap_err();
    assert!(matches!(err, Error::Allocation { .. }), "{err}");
    assert!(err.to_string().contains("LSE"), "{err}");
}

//! Quantized cache pages: the engine against the reference on the same codes, and the
//! quantized cache against unquantized attention (the error each format costs).

use attn_optimized::{
    Causal, Element, Error, Growth, KeyChannels, KvCache, Layout, Options, PagedKvCache, Par,
    SeqId, SlidingWindow, Tensor4Ref, bf16, f16, quantize_row,
};

mod common;

use common::quantized::{
    FORMATS, Outliers, chunks, error_against_f32, filled_cache, max_row_error, normal, tokens,
};

/// Decode steps, a chunk of queries (GEMM tiles) and a mixed batch, against the reference
/// reading the same codes literally: every format, pages of 16 and of 7 tokens (runs cut
/// anywhere), grouped-query heads stacked, masks and windows; f32, bf16 and f16 queries.
fn engine_reads_the_codes_as_the_reference<T>(tol: f64)
where
    T: Element + attn_reference::Element + Default,
{
    let (h_q, h_kv, d) = (8, 2, 64);
    for format in FORMATS {
        for page in [16, 7] {
            let lens = [300, 41, 1, 133];
            let (cache, ids, _) =
                filled_cache::<T>(format, (&lens, 5), page, (h_kv, d), Outliers::Offset);
            let batch = cache.batch(&ids).unwrap();
            for (cu_q, opts) in [
                (vec![0, 1, 2, 3, 4], Options::default()),
                (
                    vec![0, 20, 21, 22, 152],
                    Options::default().with_causal(Causal::BottomRight),
                ),
                (
                    vec![0, 3, 4, 5, 6],
                    Options::default()
                        .with_causal(Causal::BottomRight)
                        .with_window(SlidingWindow::new(Some(50), Some(0), Causal::BottomRight)),
                ),
            ] {
                let total = cu_q[4];
                let q: Vec<T> = normal(h_q * total * d, d, 99, Outliers::None)
                    .into_iter()
                    .map(T::from_f32)
                    .collect();
                let q = Tensor4Ref::from_layout(&q, [1, h_q, total, d], Layout::Bshd).unwrap();
                let fast = batch
                    .attention(q, &cu_q, &opts)
                    .unwrap()
                    .forward(Par::rayon(2))
                    .unwrap();
                let kv = batch.quantized_kv().unwrap();
                let exact = attn_reference::Attention::quantized(q, &cu_q, kv, &opts)
                    .unwrap()
                    .forward()
                    .unwrap();
                let wide = |t: &attn_optimized::Tensor4<T>| -> Vec<f32> {
                    t.as_slice().iter().map(|x| x.to_f32()).collect()
                };
                let err = max_row_error(&wide(fast.output()), &wide(exact.output()), d);
                assert!(
                    err <= tol,
                    "{} {format:?}, pages of {page}, queries {cu_q:?}: {err:e}",
                    T::NAME
                );
            }
        }
    }
}

#[test]
fn f32_queries_read_the_codes_as_the_reference() {
    engine_reads_the_codes_as_the_reference::<f32>(2e-5);
}

#[test]
fn half_queries_read_the_codes_as_the_reference() {
    // Half outputs: both round the same f64-close value once.
    engine_reads_the_codes_as_the_reference::<bf16>(8e-3);
    engine_reads_the_codes_as_the_reference::<f16>(1e-3);
}

/// The error each format costs against unquantized f32 attention (decode, 8 heads of
/// 128, 4,096 keys; `docs/accuracy.md` publishes the figures of 32 heads and four query
/// draws, `cargo run --release -p attn-optimized --example quantized_error`): int8 per
/// token about 1e-2 on standard-normal keys; outlier channels of a large mean cost it
/// several times that and per-channel keys nothing (their offsets take the means out);
/// outlier channels of a large spread cost per-channel keys less than per-token ones.
#[test]
fn quantized_error_is_within_the_published_bounds() {
    let (h, d, n) = (8, 128, 4096);
    let [per_token, channels, fp8] = FORMATS;
    let err = |format, outliers| error_against_f32(format, (h, d, n), outliers, 7);
    let normal = err(per_token, Outliers::None);
    assert!(normal <= 1.5e-2, "int8: {normal:e}");
    let offset = err(channels, Outliers::Offset);
    assert!(
        offset <= 1.5e-2,
        "int8 key channels, offset outliers: {offset:e}"
    );
    assert!(err(per_token, Outliers::Offset) > 4.0 * offset);
    let spread = err(channels, Outliers::Spread);
    assert!(spread <= 8e-2 && err(per_token, Outliers::Spread) > 2.0 * spread);
    let fp8 = err(fp8, Outliers::None);
    assert!(fp8 <= 6e-2, "fp8: {fp8:e}");
}

/// A non-finite row has no code: the append is an error and the cache is as it was.
#[test]
fn non_finite_rows_are_refused_whole() {
    let mut cache = PagedKvCache::<f32>::quantized(4, 16, 1, 16, 16, FORMATS[0]).unwrap();
    let s = cache.add_sequence().unwrap();
    let mut k = vec![0.5f32; 3 * 16];
    k[40] = f32::INFINITY;
    let k = Tensor4Ref::from_layout(&k, [1, 1, 3, 16], Layout::Bshd).unwrap();
    let v = vec![0.5f32; 3 * 16];
    let v = Tensor4Ref::from_layout(&v, [1, 1, 3, 16], Layout::Bshd).unwrap();
    let err = cache.append(s, k, v).unwrap_err();
    assert!(matches!(err, Error::InvalidValue { .. }), "{err}");
    assert_eq!((cache.len(s).unwrap(), cache.free_pages()), (0, 4));
    // A cache of elements has no quantized view, nor the other way round.
    let batch = cache.batch(&[s]).unwrap();
    assert!(batch.kv().is_err() && batch.quantized_kv().is_ok());
}

/// A fork shares the full pages and copies the partial one with its scales: parent and
/// child attend alike, and the child's appends never reach the parent.
#[test]
fn forks_keep_their_codes_apart() {
    let (h, d) = (2, 32);
    for format in FORMATS {
        let (mut cache, ids, _) =
            filled_cache::<f32>(format, (&[37], 5), 16, (h, d), Outliers::Spread);
        let child = cache.fork(ids[0]).unwrap();
        let q = normal(h * d, d, 5, Outliers::None);
        let q = Tensor4Ref::from_layout(&q, [1, h, 1, d], Layout::Bshd).unwrap();
        let out = |cache: &PagedKvCache<f32>, s: SeqId| {
            let batch = cache.batch(&[s]).unwrap();
            let call = batch.attention(q, &[0, 1], &Options::default()).unwrap();
            call.forward(Par::Seq).unwrap().output().as_slice().to_vec()
        };
        let before = out(&cache, ids[0]);
        assert_eq!(out(&cache, child), before);
        let tok = normal(h * d, d, 11, Outliers::Offset);
        let tok = Tensor4Ref::from_layout(&tok, [1, h, 1, d], Layout::Bshd).unwrap();
        cache.append(child, tok, tok).unwrap();
        assert_eq!(out(&cache, ids[0]), before);
        assert_ne!(out(&cache, child), before);
    }
}

/// A contiguous quantized cache is the paged one with a page per sequence: the same bits
/// as pages of 16 tokens (decode steps and a chunk, grouped-query heads, queries in either
/// layout), growing as it fills, and the reference's result on its codes.
#[test]
fn contiguous_quantized_cache_is_a_paged_one() {
    let (h_q, h_kv, d, lens) = (8, 2, 64, [77usize, 130]);
    for format in FORMATS {
        let (paged, ids, rows) =
            filled_cache::<f32>(format, (&lens, 5), 16, (h_kv, d), Outliers::Offset);
        let mut cache = KvCache::<f32>::quantized(2, h_kv, 8, d, d, format)
            .unwrap()
            .with_growth(Growth::Double);
        // The same appends, entry by entry, in the same chunks (the key channels are set
        // by the first: entry 0's first five tokens).
        for (b, (k, v)) in rows.iter().enumerate() {
            for r in chunks(lens[b], 5) {
                let view = |x| tokens(x, r.clone(), (h_kv, d));
                cache.append_to(b, view(k), view(v)).unwrap();
            }
        }
        assert!(cache.capacity() >= 130);
        for (n_q, layout) in [(1, Layout::Bshd), (1, Layout::Bhsd), (3, Layout::Bhsd)] {
            let q = normal(2 * h_q * n_q * d, d, 3, Outliers::None);
            let qb = Tensor4Ref::from_layout(&q, [2, h_q, n_q, d], layout).unwrap();
            let opts = Options::default().with_causal(Causal::BottomRight);
            let out = cache
                .attention(qb, &opts)
                .unwrap()
                .forward(Par::rayon(2))
                .unwrap();
            assert_eq!(out.output().dims(), [2, h_q, n_q, d]);
            // The paged cache's packed call of the same queries: rows [h][b·n_q + i].
            let packed: Vec<f32> = (0..h_q)
                .flat_map(|h| (0..2).flat_map(move |b| (0..n_q).map(move |i| (b, h, i))))
                .flat_map(|(b, h, i)| {
                    let m = qb.head(b, h).unwrap();
                    (0..d).map(move |c| m[(i, c)])
                })
                .collect();
            let qp = Tensor4Ref::from_layout(&packed, [1, h_q, 2 * n_q, d], Layout::Bhsd).unwrap();
            let cu = [0, n_q, 2 * n_q];
            let batch = paged.batch(&ids).unwrap();
            let pout = batch
                .attention(qp, &cu, &opts)
                .unwrap()
                .forward(Par::rayon(2))
                .unwrap();
            for b in 0..2 {
                for h in 0..h_q {
                    for i in 0..n_q {
                        let a = out.output().as_ref().head(b, h).unwrap();
                        let p = pout.output().as_ref().head(0, h).unwrap();
                        for c in 0..d {
                            assert_eq!(
                                a[(i, c)].to_bits(),
                                p[(b * n_q + i, c)].to_bits(),
                                "{format:?} n_q {n_q} {layout:?} ({b}, {h}, {i}, {c})"
                            );
                        }
                    }
                }
            }
            let kv = cache.quantized_kv().unwrap();
            let reference = attn_reference::Attention::quantized(qp, &cu, kv, &opts)
                .unwrap()
                .forward()
                .unwrap();
            let err = max_row_error(pout.output().as_slice(), reference.output().as_slice(), d);
            assert!(err < 2e-5, "{format:?}: {err:e}");
        }
    }
}

/// Odd shapes and sizes are errors or work, never panics: empty batches, heads or widths,
/// a capacity of zero that grows, sizes no memory holds, queries beyond a sequence's tokens.
#[test]
fn odd_shapes_are_errors_or_work() {
    let int8 = FORMATS[1];
    assert!(KvCache::<f32>::quantized(1, 1, usize::MAX / 4, 64, 64, int8).is_err());
    assert!(PagedKvCache::<f32>::quantized(usize::MAX / 64, 16, 2, 64, 64, int8).is_err());
    assert!(PagedKvCache::<f32>::quantized(4, 0, 1, 8, 8, int8).is_err());
    for (b, h, cap, d_k, d_v) in [
        (0, 1, 4, 8, 8),
        (1, 0, 4, 8, 8),
        (1, 1, 0, 8, 8),
        (2, 2, 3, 1, 0),
        (1, 2, 5, 17, 3),
    ] {
        let mut cache = KvCache::<f32>::quantized(b, h, cap, d_k, d_v, int8)
            .unwrap()
            .with_growth(Growth::Double);
        let (k, v) = (
            vec![0.5f32; b * h * 2 * d_k],
            vec![-0.25f32; b * h * 2 * d_v],
        );
        let k = Tensor4Ref::from_layout(&k, [b, h, 2, d_k], Layout::Bshd).unwrap();
        let v = Tensor4Ref::from_layout(&v, [b, h, 2, d_v], Layout::Bshd).unwrap();
        let what = format!("({b}, {h}, {cap}, {d_k}, {d_v})");
        cache.append(k, v).unwrap_or_else(|e| panic!("{what}: {e}"));
        let q = vec![1.0f32; b * 2 * h.max(1) * 3 * d_k];
        for n_q in [1, 3] {
            let q = Tensor4Ref::from_layout(
                &q[..b * 2 * h.max(1) * n_q * d_k],
                [b, 2 * h.max(1), n_q, d_k],
                Layout::Bhsd,
            )
            .unwrap();
            // Three queries against two tokens: an error (the queries are the newest tokens).
            if let Ok(call) = cache.attention(q, &Options::default()) {
                let out = call.forward(Par::Seq).unwrap();
                assert!(out.output().as_slice().iter().all(|x| x.is_finite()));
                assert!(n_q <= 2 || b == 0);
            }
        }
    }
}

/// The quantized cache against the exact attention of the rows appended (not of what the
/// cache holds), within a bound derived from each row's scale (`docs/accuracy.md`): an
/// entry reads back within `e = f_c · (abs · a + rel · |y_c|)` (`KvCodes::rounding`, `a =
/// scale · max_code`), so a score moves by at most `Δ = scale_qk · Σ_c |q_c| · e^K_c`, every
/// weight by a factor within `e^{±2Δ}`, and an output entry by at most `(e^{2Δ} − 1) ·
/// max_j |v̂_jc| + max_j e^V_jc` (plus the engine's f32 rounding). A worst-case bound:
/// it catches a wrong scale or code, not a rounding a few times too coarse.
#[test]
fn quantized_caches_are_within_their_rounding_bound() {
    let (h, d, n) = (4, 64, 300);
    for format in FORMATS {
        for outliers in [Outliers::None, Outliers::Offset, Outliers::Spread] {
            let (cache, ids, rows) = filled_cache::<f32>(format, (&[n], 40), 16, (h, d), outliers);
            let (k, v) = &rows[0];
            let q = normal(h * d, d, 17, Outliers::None);
            let qv = Tensor4Ref::from_layout(&q, [1, h, 1, d], Layout::Bshd).unwrap();
            let batch = cache.batch(&ids).unwrap();
            let out = batch
                .attention(qv, &[0, 1], &Options::default())
                .unwrap()
                .forward(Par::Seq)
                .unwrap();
            let (abs, rel) = format.codes.rounding();
            let max_code = f64::from(format.codes.max_code());
            // The key channels as the cache set them: from the first 40 keys.
            let channels: Vec<(Vec<f32>, Vec<f32>)> = (0..h)
                .map(|hh| {
                    let first = faer::Mat::<f32>::from_fn(40, d, |t, c| k[(t * h + hh) * d + c]);
                    KeyChannels::calibrate(first.as_ref())
                })
                .collect();
            // Each entry's rounding, from its row's scale.
            let rounding = |x: &[f32], hh: usize, keys: bool| -> Vec<f64> {
                let mut e = vec![0.0f64; n * d];
                let mut codes = vec![0u8; d];
                for t in 0..n {
                    let row = &x[(t * h + hh) * d..(t * h + hh + 1) * d];
                    let ch = (keys && format.key_channels).then(|| KeyChannels {
                        offsets: &channels[hh].0,
                        factors: &channels[hh].1,
                    });
                    let s = quantize_row(format.codes, row, ch, &mut codes).unwrap();
                    let a = f64::from(s) * max_code;
                    for c in 0..d {
                        let (mu, f) = ch.map_or((0.0, 1.0), |ch| {
                            (f64::from(ch.offsets[c]), f64::from(ch.factors[c]))
                        });
                        let y = (f64::from(row[c]) - mu) / f;
                        // Plus the f32 roundings of reading back (a few units in the last place).
                        e[t * d + c] =
                            f * (abs * a + rel * y.abs()) + 4e-7 * f64::from(row[c]).abs();
                    }
                }
                e
            };
            let scale = 1.0 / (d as f64).sqrt();
            for hh in 0..h {
                let (ek, ev) = (rounding(k, hh, true), rounding(v, hh, false));
                let qh = &q[hh * d..(hh + 1) * d];
                let at = |x: &[f32], t: usize, c: usize| f64::from(x[(t * h + hh) * d + c]);
                let dot = |e: &dyn Fn(usize) -> f64| {
                    scale * (0..d).map(|c| f64::from(qh[c]) * e(c)).sum::<f64>()
                };
                let s: Vec<f64> = (0..n).map(|t| dot(&|c| at(k, t, c))).collect();
                let m = s.iter().copied().fold(f64::MIN, f64::max);
                let w: Vec<f64> = s.iter().map(|x| (x - m).exp()).collect();
                let total: f64 = w.iter().sum();
                let delta = (0..n)
                    .map(|t| {
                        let e = |c: usize| ek[t * d + c] * f64::from(qh[c]).signum();
                        dot(&e)
                    })
                    .fold(0.0, f64::max);
                let o = out.output().as_ref().head(0, hh).unwrap();
                for c in 0..d {
                    let want = (0..n).map(|t| w[t] * at(v, t, c)).sum::<f64>() / total;
                    let (vmax, evmax) = (0..n).fold((0.0f64, 0.0f64), |(a, b), t| {
                        let e = ev[t * d + c];
                        (a.max(at(v, t, c).abs() + e), b.max(e))
                    });
                    let bound = ((2.0 * delta).exp() - 1.0) * vmax + evmax + 1e-5 * vmax;
                    let err = (f64::from(o[(0, c)]) - want).abs();
                    assert!(
                        err <= bound,
                        "{format:?} {outliers:?} head {hh} column {c}: {err:e} > {bound:e}"
                    );
                }
            }
        }
    }
}

//! Quantized caches for the tests and the published error figures
//! (`examples/quantized_error.rs` includes this file): standard-normal rows with outlier
//! key channels, caches filled in chunks, and the error of a decode step against
//! unquantized attention.

use attn_optimized::{
    Attention, Batch, Element, KvCodes, KvQuantization, Layout, Options, PagedKvCache, Par, SeqId,
    Tensor4Ref,
};

/// The keys and values appended to one sequence, `[B,S,H,D]`.
pub type Rows<T> = (Vec<T>, Vec<T>);

/// Outlier channels of keys: every 29th channel (from the fourth) twenty times the
/// others' size.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Outliers {
    /// Standard-normal in every channel.
    None,
    /// Standard normal times 20 in the outlier channels (twenty times the spread).
    Spread,
    /// Standard normal plus ±20 in the outlier channels (a mean twenty times the others'
    /// spread, the sign the channel's: LLM keys' outlier channels are of this kind).
    Offset,
}

/// Standard-normal values (Box–Muller over a fixed-seed LCG), rows `d` wide, with the
/// `outliers` channels.
pub fn normal(n: usize, d: usize, seed: u64, outliers: Outliers) -> Vec<f32> {
    let mut state = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    let mut uniform = move || {
        state = state
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((state >> 11) as f64 + 0.5) / (1u64 << 53) as f64
    };
    (0..n)
        .map(|i| {
            let (u, v) = (uniform(), uniform());
            let z = ((-2.0 * u.ln()).sqrt() * (2.0 * core::f64::consts::PI * v).cos()) as f32;
            let c = i % d;
            match outliers {
                _ if c % 29 != 3 => z,
                Outliers::None => z,
                Outliers::Spread => 20.0 * z,
                Outliers::Offset => z + if c.is_multiple_of(2) { 20.0 } else { -20.0 },
            }
        })
        .collect()
}

pub const FORMATS: [KvQuantization; 3] = [
    KvQuantization::new(KvCodes::Int8),
    KvQuantization::new(KvCodes::Int8).with_key_channels(),
    KvQuantization::new(KvCodes::Fp8E4m3),
];

/// A quantized cache with sequences of `lens` tokens appended in chunks (so pages fill
/// across appends) — the first `first` tokens (the prompt, from which a format with key
/// channels takes them), then to half the length, then the rest —, `h_kv` heads of width
/// `d`; the rows appended, `[B,S,H,D]` per sequence.
pub fn filled_cache<T: Element>(
    format: KvQuantization,
    (lens, first): (&[usize], usize),
    page: usize,
    (h_kv, d): (usize, usize),
    outliers: Outliers,
) -> (PagedKvCache<T>, Vec<SeqId>, Vec<Rows<T>>) {
    let pages = lens.iter().map(|l| l.div_ceil(page) + 1).sum::<usize>() + 2;
    let mut cache = PagedKvCache::<T>::quantized(pages, page, h_kv, d, d, format).unwrap();
    let mut ids = Vec::new();
    let mut rows = Vec::new();
    for (s, &len) in lens.iter().enumerate() {
        let id = cache.add_sequence().unwrap();
        let to_t = |x: Vec<f32>| x.into_iter().map(T::from_f32).collect::<Vec<T>>();
        let k = to_t(normal(len * h_kv * d, d, 2 * s as u64 + 1, outliers));
        let v = to_t(normal(len * h_kv * d, d, 2 * s as u64 + 2, Outliers::None));
        for r in chunks(len, first) {
            let view = |x| tokens(x, r.clone(), (h_kv, d));
            cache.append(id, view(&k), view(&v)).unwrap();
        }
        assert_eq!(cache.len(id).unwrap(), len);
        ids.push(id);
        rows.push((k, v));
    }
    (cache, ids, rows)
}

/// The tokens [`filled_cache`] appends a sequence of `len` in: the first `first` (the
/// prompt), then to half the length, then the rest.
pub fn chunks(len: usize, first: usize) -> Vec<core::ops::Range<usize>> {
    let mut at = 0;
    let mut out = Vec::new();
    for end in [len.min(first), len / 2, len] {
        if end > at {
            out.push(at..end);
            at = end;
        }
    }
    out
}

/// Tokens `r` of rows `x` (`[t][h][d]`) as `[1, h, r.len(), d]`.
pub fn tokens<T>(x: &[T], r: core::ops::Range<usize>, (h, d): (usize, usize)) -> Tensor4Ref<'_, T> {
    let dims = [1, h, r.len(), d];
    Tensor4Ref::from_layout(&x[r.start * h * d..r.end * h * d], dims, Layout::Bshd).unwrap()
}

/// The largest relative row error `‖o − o_ref‖ / ‖o_ref‖` over the rows of two outputs
/// `[1, h, total, d]` (contiguous, as `forward` returns them).
pub fn max_row_error(o: &[f32], reference: &[f32], d: usize) -> f64 {
    o.chunks_exact(d)
        .zip(reference.chunks_exact(d))
        .map(|(a, b)| {
            let diff: f64 = a.iter().zip(b).map(|(x, y)| ((x - y) as f64).powi(2)).sum();
            let norm: f64 = b.iter().map(|&y| (y as f64).powi(2)).sum();
            (diff / norm.max(f64::MIN_POSITIVE)).sqrt()
        })
        .fold(0.0, f64::max)
}

/// The largest row error of a quantized cache's decode step against the same call over
/// an f32 cache of the same rows, for queries drawn with `seed`.
pub fn error_against_f32(
    format: KvQuantization,
    (h, d, n): (usize, usize, usize),
    outliers: Outliers,
    seed: u64,
) -> f64 {
    let (cache, ids, rows) = filled_cache::<f32>(format, (&[n], 512), 64, (h, d), outliers);
    let mut plain = PagedKvCache::<f32>::new(n / 64 + 1, 64, h, d, d).unwrap();
    let s = plain.add_sequence().unwrap();
    let (k, v) = &rows[0];
    let (k, v) = (
        Tensor4Ref::from_layout(k, [1, h, n, d], Layout::Bshd).unwrap(),
        Tensor4Ref::from_layout(v, [1, h, n, d], Layout::Bshd).unwrap(),
    );
    plain.append(s, k, v).unwrap();
    let q = normal(h * d, d, seed, Outliers::None);
    let q = Tensor4Ref::from_layout(&q, [1, h, 1, d], Layout::Bshd).unwrap();
    let opts = Options::default();
    let run = |o: attn_optimized::Result<Attention<'_, f32, Batch>>| {
        o.unwrap().forward(Par::rayon(2)).unwrap()
    };
    let (qb, pb) = (cache.batch(&ids).unwrap(), plain.batch(&[s]).unwrap());
    let quantized = run(qb.attention(q, &[0, 1], &opts));
    let exact = run(pb.attention(q, &[0, 1], &opts));
    max_row_error(quantized.output().as_slice(), exact.output().as_slice(), d)
}

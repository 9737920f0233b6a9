//! The paged cache's decoding target, 2 threads: one query per head against a long cache
//! held in pages (32 query and 32 K/V heads, batch 1, n_k = 32768, d = 128, f16), against
//! the same tokens in a contiguous [`KvCache`]. Pages of 16 tokens (the target's) and of
//! 128.
//!
//! Criterion times each; the ratio comes from a loop that interleaves the two round by
//! round and prints the median of the per-round ratios (memory bandwidth drifts by tens
//! of per cent within a run on these machines). Under `cargo test --benches` the shapes
//! shrink to a toy size.

mod common;

use std::time::Duration;

use attn_benches::protocol::median;
use attn_benches::roof::pool;
use attn_optimized::{
    Causal, KvCache, Layout, Options, PagedKvCache, Par, SeqId, Tensor4Ref, f16,
};
use criterion::{Criterion, Throughput};

/// The shape of the target, or a toy one in test mode.
struct Setup {
    heads: usize,
    n_k: usize,
    d: usize,
    rounds: usize,
}

/// Deterministic values in [-1, 1).
fn values(n: usize, seed: u64) -> Vec<f16> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            f16::from_f32((x % 2000) as f32 / 1000.0 - 1.0)
        })
        .collect()
}

/// The same tokens in a contiguous cache and in paged caches of `pages` tokens a page.
struct Caches {
    contiguous: KvCache<f16>,
    paged: Vec<(usize, PagedKvCache<f16>, SeqId)>,
    q: Vec<f16>,
}

impl Caches {
    fn new(s: &Setup, page_sizes: &[usize]) -> Self {
        let (h, n, d) = (s.heads, s.n_k, s.d);
        let mut contiguous = KvCache::<f16>::new(1, h, n, d, d).expect("a cache");
        let mut paged: Vec<_> = page_sizes
            .iter()
            .map(|&ps| {
                let mut cache =
                    PagedKvCache::<f16>::new(n.div_ceil(ps), ps, h, d, d).expect("a cache");
                let seq = cache.add_sequence().expect("a sequence");
                (ps, cache, seq)
            })
            .collect();
        // The prompt in chunks, appended to every cache alike.
        let chunk = 1024.min(n);
        for (i, start) in (0..n).step_by(chunk).enumerate() {
            let t = chunk.min(n - start);
            let (k, v) = (values(h * t * d, 2 * i as u64), values(h * t * d, 2 * i as u64 + 1));
            let k = Tensor4Ref::from_layout(&k, [1, h, t, d], Layout::Bshd).expect("a view");
            let v = Tensor4Ref::from_layout(&v, [1, h, t, d], Layout::Bshd).expect("a view");
            contiguous.append(k, v).expect("room");
            for (_, cache, seq) in &mut paged {
                cache.append(*seq, k, v).expect("pages");
            }
        }
        let q = values(h * d, 99);
        Self {
            contiguous,
            paged,
            q,
        }
    }

    fn q(&self, s: &Setup) -> Tensor4Ref<'_, f16> {
        Tensor4Ref::from_layout(&self.q, [1, s.heads, 1, s.d], Layout::Bshd).expect("a view")
    }

    fn step_contiguous(&self, s: &Setup) {
        let opts = Options::default().with_causal(Causal::BottomRight);
        self.contiguous
            .attention(self.q(s), &opts)
            .and_then(|c| c.forward(Par::rayon(0)))
            .map(drop)
            .expect("a decoding step");
    }

    fn step_paged(&self, s: &Setup, i: usize) {
        let opts = Options::default().with_causal(Causal::BottomRight);
        let (_, cache, seq) = &self.paged[i];
        let batch = cache.batch(&[*seq]).expect("a batch");
        batch
            .attention(self.q(s), &[0, 1], &opts)
            .and_then(|c| c.forward(Par::rayon(0)))
            .map(drop)
            .expect("a decoding step");
    }
}

fn main() {
    common::print_platform();
    let full = common::full_size();
    let s = if full {
        Setup {
            heads: 32,
            n_k: 32768,
            d: 128,
            rounds: 11,
        }
    } else {
        Setup {
            heads: 2,
            n_k: 300,
            d: 32,
            rounds: 1,
        }
    };
    let pool = pool(2);
    let caches = Caches::new(&s, &[16, 128]);
    let kv_bytes = 2 * s.heads * s.n_k * s.d * 2;

    let mut c = Criterion::default()
        .sample_size(10)
        .measurement_time(Duration::from_secs(if full { 4 } else { 1 }))
        .configure_from_args();
    {
        let (h, n, d) = (s.heads, s.n_k, s.d);
        let mut group = c.benchmark_group(format!("paged_decode_h{h}_nk{n}_d{d}_f16_t2"));
        group.throughput(Throughput::Bytes(kv_bytes as u64));
        group.bench_function("contiguous", |b| {
            pool.install(|| b.iter(|| caches.step_contiguous(&s)))
        });
        for (i, (ps, _, _)) in caches.paged.iter().enumerate() {
            group.bench_function(format!("pages_of_{ps}"), |b| {
                pool.install(|| b.iter(|| caches.step_paged(&s, i)))
            });
        }
        group.finish();
    }
    c.final_summary();
    if common::criterion_only() {
        return;
    }

    pool.install(|| {
        caches.step_contiguous(&s);
        (0..caches.paged.len()).for_each(|i| caches.step_paged(&s, i));
    });
    let mut ratios = vec![Vec::new(); caches.paged.len()];
    for _ in 0..s.rounds {
        let t = pool.install(|| common::seconds(|| caches.step_contiguous(&s)));
        for (i, r) in ratios.iter_mut().enumerate() {
            r.push(t / pool.install(|| common::seconds(|| caches.step_paged(&s, i))));
        }
    }
    println!(
        "\npaged decode: interleaved ratios, median of {} rounds (n_q=1, h={}, n_k={}, d={}, f16, 2 threads)",
        s.rounds, s.heads, s.n_k, s.d
    );
    for ((ps, _, _), r) in caches.paged.iter().zip(&ratios) {
        let (lo, hi) = common::range(r);
        let target = if *ps == 16 { "  (target ≥ 0.95)" } else { "" };
        println!(
            "  pages of {ps}: speed ÷ contiguous cache's = {:.3}  (range {lo:.2}–{hi:.2}){target}",
            median(r).unwrap_or(f64::NAN)
        );
    }
}

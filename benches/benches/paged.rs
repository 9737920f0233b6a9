//! The paged cache's decoding target, 2 threads: one query per head against a long cache
//! held in pages (32 query and 32 K/V heads, batch 1, n_k = 32768, d = 128, f16), against
//! the same tokens in a contiguous [`KvCache`]. Pages of 16 tokens (the target's) and of
//! 128, handed out in order (one sequence filling the cache) and interleaved with a second
//! sequence's (two sequences decoding side by side: every other page is the other's).
//!
//! Criterion times each; the ratio comes from a loop that interleaves the two round by
//! round and prints the median of the per-round ratios (memory bandwidth drifts by tens
//! of per cent within a run on these machines). Under `cargo test --benches` the shapes
//! shrink to a toy size.

mod common;

use std::time::Duration;

use attn_benches::inputs::random_vec;
use attn_benches::protocol::median;
use attn_benches::roof::pool;
use attn_optimized::{Causal, KvCache, Layout, Options, PagedKvCache, Par, SeqId, Tensor4Ref, f16};
use criterion::{Criterion, Throughput};

/// The shape of the target, or a toy one in test mode.
struct Setup {
    heads: usize,
    n_k: usize,
    d: usize,
    rounds: usize,
}

/// Deterministic values, rounded to f16.
fn values(n: usize, seed: u64) -> Vec<f16> {
    random_vec(n, seed).into_iter().map(f16::from_f32).collect()
}

/// The same tokens in a contiguous cache and in paged caches: `(page size, interleaved,
/// cache, the sequence measured)`.
struct Caches {
    contiguous: KvCache<f16>,
    paged: Vec<(usize, bool, PagedKvCache<f16>, SeqId)>,
    q: Vec<f16>,
}

impl Caches {
    fn new(s: &Setup, configs: &[(usize, bool)]) -> Self {
        let (h, n, d) = (s.heads, s.n_k, s.d);
        let mut contiguous = KvCache::<f16>::new(1, h, n, d, d).expect("a cache");
        let mut paged: Vec<_> = configs
            .iter()
            .map(|&(ps, interleaved)| {
                let pages = n.div_ceil(ps) * if interleaved { 2 } else { 1 };
                let mut cache = PagedKvCache::<f16>::new(pages, ps, h, d, d).expect("a cache");
                let seq = cache.add_sequence().expect("a sequence");
                (ps, interleaved, cache, seq)
            })
            .collect();
        let others: Vec<Option<SeqId>> = paged
            .iter_mut()
            .map(|(_, interleaved, cache, _)| {
                interleaved.then(|| cache.add_sequence().expect("a sequence"))
            })
            .collect();
        // The prompt in chunks, appended to every cache alike; an interleaved cache takes
        // a page of it at a time, each followed by a page for the other sequence.
        let chunk = 1024.min(n);
        for (i, start) in (0..n).step_by(chunk).enumerate() {
            let t = chunk.min(n - start);
            let (k, v) = (
                values(h * t * d, 2 * i as u64),
                values(h * t * d, 2 * i as u64 + 1),
            );
            fn view(
                x: &[f16],
                (h, d): (usize, usize),
                from: usize,
                len: usize,
            ) -> Tensor4Ref<'_, f16> {
                let x = &x[from * h * d..(from + len) * h * d];
                Tensor4Ref::from_layout(x, [1, h, len, d], Layout::Bshd).expect("a view")
            }
            contiguous
                .append(view(&k, (h, d), 0, t), view(&v, (h, d), 0, t))
                .expect("room");
            for ((ps, _, cache, seq), other) in paged.iter_mut().zip(&others) {
                let step = if other.is_some() { *ps } else { t };
                for from in (0..t).step_by(step) {
                    let len = step.min(t - from);
                    let (kc, vc) = (view(&k, (h, d), from, len), view(&v, (h, d), from, len));
                    cache.append(*seq, kc, vc).expect("pages");
                    if let Some(o) = other {
                        cache.append(*o, kc, vc).expect("pages");
                    }
                }
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
        let (_, _, cache, seq) = &self.paged[i];
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
    let caches = Caches::new(&s, &[(16, false), (16, true), (128, true)]);
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
        for (i, (ps, interleaved, _, _)) in caches.paged.iter().enumerate() {
            let order = if *interleaved {
                "interleaved"
            } else {
                "in_order"
            };
            group.bench_function(format!("pages_of_{ps}_{order}"), |b| {
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
    for ((ps, interleaved, _, _), r) in caches.paged.iter().zip(&ratios) {
        let (lo, hi) = common::range(r);
        let target = if *ps == 16 { "  (target ≥ 0.95)" } else { "" };
        let order = if *interleaved {
            "interleaved with another sequence's"
        } else {
            "in order"
        };
        println!(
            "  pages of {ps}, {order}: speed ÷ contiguous cache's = {:.3}  (range {lo:.2}–{hi:.2}){target}",
            median(r).unwrap_or(f64::NAN)
        );
    }
}

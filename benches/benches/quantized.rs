//! Quantized caches' decoding target, 2 threads: one query per head against a long cache
//! (32 query and 32 K/V heads, batch 1, n_k = 32768, d = 128, f16 queries and outputs) in
//! int8 (a scale per token and head; and with per-channel key offsets and factors) and in
//! fp8 e4m3, against the same tokens in an f16 [`KvCache`]; and the int8 cache in pages
//! of 16 tokens against the contiguous int8 cache. Decoding reads the whole cache once a
//! step, so its speed is the cache's bytes over the memory's bandwidth: one-byte codes
//! (plus a 4-byte scale a row of 128) read about 0.52 of an f16 cache's bytes.
//!
//! Criterion times each; the ratios come from a loop that interleaves every cache round
//! by round and prints the median of the per-round ratios (memory bandwidth drifts by
//! tens of per cent within a run on these machines). Under `cargo test --benches` the
//! shapes shrink to a toy size.

mod common;

use std::time::Duration;

use attn_benches::inputs::random_vec;
use attn_benches::protocol::median;
use attn_benches::roof::pool;
use attn_optimized::{
    Causal, KvCache, KvCodes, KvQuantization, Layout, Options, PagedKvCache, Par, SeqId,
    Tensor4Ref, f16,
};
use criterion::{Criterion, Throughput};

/// The caches measured: the f16 baseline, then each quantized one with its name and what
/// its ratio is taken against.
struct Caches {
    f16: KvCache<f16>,
    contiguous: Vec<(&'static str, KvCache<f16>)>,
    paged: (PagedKvCache<f16>, SeqId),
    q: Vec<f16>,
    shape: (usize, usize, usize),
}

const INT8: KvQuantization = KvQuantization::new(KvCodes::Int8);

impl Caches {
    fn new((h, n, d): (usize, usize, usize)) -> Self {
        let cache = |format| KvCache::<f16>::quantized(1, h, n, d, d, format).expect("a cache");
        let mut f16_cache = KvCache::<f16>::new(1, h, n, d, d).expect("a cache");
        let mut contiguous = vec![
            ("int8", cache(INT8)),
            ("int8, key channels", cache(INT8.with_key_channels())),
            ("fp8", cache(KvQuantization::new(KvCodes::Fp8E4m3))),
        ];
        let mut paged =
            PagedKvCache::<f16>::quantized(n.div_ceil(16), 16, h, d, d, INT8).expect("a cache");
        let seq = paged.add_sequence().expect("a sequence");
        // The prompt in chunks, appended to every cache alike.
        let chunk = 1024.min(n);
        for (i, start) in (0..n).step_by(chunk).enumerate() {
            let t = chunk.min(n - start);
            let values = |seed: u64| -> Vec<f16> {
                random_vec(h * t * d, seed)
                    .into_iter()
                    .map(f16::from_f32)
                    .collect()
            };
            let (k, v) = (values(2 * i as u64), values(2 * i as u64 + 1));
            let view = |x| Tensor4Ref::from_layout(x, [1, h, t, d], Layout::Bshd).expect("a view");
            let (k, v) = (view(&k), view(&v));
            f16_cache.append(k, v).expect("room");
            for (_, c) in &mut contiguous {
                c.append(k, v).expect("room");
            }
            paged.append(seq, k, v).expect("pages");
        }
        let q = random_vec(h * d, 99)
            .into_iter()
            .map(f16::from_f32)
            .collect();
        Self {
            f16: f16_cache,
            contiguous,
            paged: (paged, seq),
            q,
            shape: (h, n, d),
        }
    }

    fn q(&self) -> Tensor4Ref<'_, f16> {
        let (h, _, d) = self.shape;
        Tensor4Ref::from_layout(&self.q, [1, h, 1, d], Layout::Bshd).expect("a view")
    }

    /// One decoding step against the f16 cache (`None`), contiguous cache `Some(i)`, or
    /// (`Some(len)`) the paged one.
    fn step(&self, which: Option<usize>) {
        let opts = Options::default().with_causal(Causal::BottomRight);
        let out = match which {
            None => self.f16.attention(self.q(), &opts),
            Some(i) if i < self.contiguous.len() => self.contiguous[i].1.attention(self.q(), &opts),
            Some(_) => {
                let (cache, seq) = &self.paged;
                let batch = cache.batch(&[*seq]).expect("a batch");
                batch
                    .attention(self.q(), &[0, 1], &opts)
                    .and_then(|c| c.forward(Par::rayon(0)))
                    .map(drop)
                    .expect("a decoding step");
                return;
            }
        };
        out.and_then(|c| c.forward(Par::rayon(0)))
            .map(drop)
            .expect("a decoding step");
    }
}

fn main() {
    common::print_platform();
    let full = common::full_size();
    let n_k = std::env::var("ATTN_QUANTIZED_NK")
        .ok()
        .and_then(|n| n.parse().ok());
    let (shape, rounds) = if full {
        ((32, n_k.unwrap_or(32768), 128), 11)
    } else {
        ((2, 300, 32), 1)
    };
    let pool = pool(2);
    let mut c = Criterion::default()
        .sample_size(10)
        .measurement_time(Duration::from_secs(if full { 4 } else { 1 }))
        .configure_from_args();
    let caches = Caches::new(shape);
    let (h, n, d) = shape;
    let paged = caches.contiguous.len();
    {
        let mut group = c.benchmark_group(format!("quantized_decode_h{h}_nk{n}_d{d}_t2"));
        group.throughput(Throughput::Elements((2 * h * n * d) as u64));
        group.bench_function("f16", |b| pool.install(|| b.iter(|| caches.step(None))));
        for (i, (name, _)) in caches.contiguous.iter().enumerate() {
            let id = name.replace(", ", "_").replace(' ', "_");
            group.bench_function(id, |b| pool.install(|| b.iter(|| caches.step(Some(i)))));
        }
        group.bench_function("int8_pages_of_16", |b| {
            pool.install(|| b.iter(|| caches.step(Some(paged))))
        });
        group.finish();
    }
    if !common::criterion_only() {
        ratios(&caches, &pool, rounds);
    }
    c.final_summary();
}

/// Every cache's speed over the f16 cache's, and the paged int8 cache's over the
/// contiguous int8 cache's, interleaved round by round.
fn ratios(caches: &Caches, pool: &rayon::ThreadPool, rounds: usize) {
    let paged = caches.contiguous.len();
    let time = |which| pool.install(|| common::seconds(|| caches.step(which)));
    // Warm: every cache read once.
    time(None);
    for i in 0..=paged {
        time(Some(i));
    }
    let mut over_f16 = vec![Vec::new(); paged + 1];
    let mut paged_over_int8 = Vec::new();
    let mut f16_times = Vec::new();
    for _ in 0..rounds {
        let base = time(None);
        f16_times.push(base);
        let t: Vec<f64> = (0..=paged).map(|i| time(Some(i))).collect();
        for (r, ti) in over_f16.iter_mut().zip(&t) {
            r.push(base / ti);
        }
        paged_over_int8.push(t[0] / t[paged]);
    }
    let (h, n, d) = caches.shape;
    println!(
        "\nquantized decode: speed ÷ the f16 cache's, interleaved round by round, median of {rounds} rounds (n_q=1, h={h}, n_k={n}, d={d}, 2 threads)"
    );
    let f16_ms = 1e3 * median(&f16_times).unwrap_or(f64::NAN);
    let gb = (2 * h * n * d * 2) as f64 / 1e9;
    println!(
        "  the f16 cache: {f16_ms:.2} ms a step ({:.1} GB/s of K and V)",
        gb / f16_ms * 1e3
    );
    let names = caches.contiguous.iter().map(|(name, _)| *name);
    for (name, r) in names.chain(["int8, pages of 16"]).zip(&over_f16) {
        let (lo, hi) = common::range(r);
        let target = match name {
            "int8" | "fp8" => "  (target ≥ 1.8)",
            _ => "",
        };
        println!(
            "  {name}: {:.3}  (range {lo:.2}–{hi:.2}){target}",
            median(r).unwrap_or(f64::NAN)
        );
    }
    let (lo, hi) = common::range(&paged_over_int8);
    println!(
        "  int8 in pages of 16 ÷ contiguous int8 = {:.3}  (range {lo:.2}–{hi:.2})  (target ≥ 0.95)",
        median(&paged_over_int8).unwrap_or(f64::NAN)
    );
}

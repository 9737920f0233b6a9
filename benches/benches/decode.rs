//! The decoding targets (bandwidth, half precision, scaling), 2 threads: one query per head against a long cache.
//!
//! - bandwidth: 32 heads, n_k = 32768, d = 128, f32; the K + V bytes the engine reads per
//!   second over those of a plain parallel sum over a buffer of the same size (the roof);
//! - half: the same step with f16 and bf16 K/V, speed-up over f32 (half the bytes);
//! - split-KV: one head, n_k = 4096, f32; `SplitKv::Auto` over `SplitKv::Never`.
//!
//! Criterion times each kernel; the ratios come from a custom loop that interleaves the
//! kernels being compared round by round and prints the median of the per-round ratios
//! (rates drift by tens of per cent within a run on these machines, memory bandwidth most).
//! Under `cargo test --benches` the shapes shrink to a toy size.

mod common;

use std::time::Duration;

use attn_benches::catalog::Dtype;
use attn_benches::protocol::median;
use attn_benches::roof::{ReadBuffer, pool};
use attn_benches::runner::Buffers;
use attn_optimized::{Attention, Options, Par, SplitKv};
use criterion::{Criterion, Throughput};

/// The shapes of the targets, or toy ones in test mode.
struct Setup {
    heads: usize,
    n_k: usize,
    d: usize,
    split_n_k: usize,
    /// Calls per timing of the split comparison (one call is tens of microseconds).
    split_calls: usize,
    rounds: usize,
}

impl Setup {
    fn new(full: bool) -> Self {
        if full {
            Self {
                heads: 32,
                n_k: 32768,
                d: 128,
                split_n_k: 4096,
                split_calls: 50,
                rounds: 11,
            }
        } else {
            Self {
                heads: 2,
                n_k: 256,
                d: 32,
                split_n_k: 2048,
                split_calls: 1,
                rounds: 1,
            }
        }
    }
}

/// One decoding step over `inputs` (n_q = 1), default options.
fn step(inputs: &Buffers, split: SplitKv) {
    let options = Options::default();
    let out = match inputs {
        Buffers::F32(x) => Attention::batched(x.q(), x.k(), x.v(), &options)
            .and_then(|call| call.split_kv(split).forward(Par::rayon(0)))
            .map(|f| f.into_output())
            .map(drop),
        Buffers::F16(x) => Attention::batched(x.q(), x.k(), x.v(), &options)
            .and_then(|call| call.split_kv(split).forward(Par::rayon(0)))
            .map(|f| f.into_output())
            .map(drop),
        Buffers::Bf16(x) => Attention::batched(x.q(), x.k(), x.v(), &options)
            .and_then(|call| call.split_kv(split).forward(Par::rayon(0)))
            .map(|f| f.into_output())
            .map(drop),
    };
    out.expect("a valid decoding step");
}

fn main() {
    common::print_platform();
    let full = common::full_size();
    let s = Setup::new(full);
    let pool = pool(2);
    let cache = |dtype| Buffers::random(dtype, s.heads, 1, s.n_k, s.d, 7);
    let steps = [
        ("f32", cache(Dtype::F32)),
        ("f16", cache(Dtype::F16)),
        ("bf16", cache(Dtype::Bf16)),
    ];
    let kv_bytes = |bytes_per_element: usize| 2 * s.heads * s.n_k * s.d * bytes_per_element;
    let roof = pool.install(|| ReadBuffer::new(kv_bytes(4)));
    let short = Buffers::random(Dtype::F32, 1, 1, s.split_n_k, s.d, 11);

    let mut c = Criterion::default()
        .sample_size(10)
        .measurement_time(Duration::from_secs(if full { 4 } else { 1 }))
        .configure_from_args();
    {
        let (h, n, d) = (s.heads, s.n_k, s.d);
        let mut group = c.benchmark_group(format!("decode_h{h}_nk{n}_d{d}_t2"));
        for (label, inputs) in &steps {
            let size = if *label == "f32" { 4 } else { 2 };
            group.throughput(Throughput::Bytes(kv_bytes(size) as u64));
            group.bench_function(*label, |b| {
                pool.install(|| b.iter(|| step(inputs, SplitKv::Auto)))
            });
        }
        group.throughput(Throughput::Bytes(roof.bytes() as u64));
        group.bench_function("parallel_sum", |b| {
            pool.install(|| b.iter(|| std::hint::black_box(roof.sum())))
        });
        group.finish();
        let mut group = c.benchmark_group(format!("split_kv_h1_nk{}_d{d}_t2", s.split_n_k));
        for (label, split) in [("auto", SplitKv::Auto), ("never", SplitKv::Never)] {
            group.bench_function(label, |b| pool.install(|| b.iter(|| step(&short, split))));
        }
        group.finish();
    }
    c.final_summary();
    if common::criterion_only() {
        return;
    }

    // Interleaved ratios, everything warmed once first.
    pool.install(|| {
        roof.sum();
        for (_, inputs) in &steps {
            step(inputs, SplitKv::Auto);
        }
    });
    let (mut of_roof, mut f16_speedup, mut bf16_speedup, mut split) =
        (vec![], vec![], vec![], vec![]);
    let many = |split_kv| {
        pool.install(|| common::seconds(|| (0..s.split_calls).for_each(|_| step(&short, split_kv))))
    };
    for _ in 0..s.rounds {
        let t_roof = pool.install(|| roof.time());
        let times: Vec<f64> = steps
            .iter()
            .map(|(_, inputs)| pool.install(|| common::seconds(|| step(inputs, SplitKv::Auto))))
            .collect();
        // The roof reads as many bytes as the f32 step: the rate ratio is the time ratio.
        of_roof.push(t_roof / times[0]);
        f16_speedup.push(times[0] / times[1]);
        bf16_speedup.push(times[0] / times[2]);
        let never = many(SplitKv::Never);
        split.push(never / many(SplitKv::Auto));
    }
    let m = |x: &[f64]| median(x).unwrap_or(f64::NAN);
    let range = |x: &[f64]| {
        let (lo, hi) = common::range(x);
        format!("(range {lo:.2}–{hi:.2})")
    };
    println!(
        "\ndecode: interleaved ratios, median of {} rounds (n_q=1, h={}, n_k={}, d={}, 2 threads)",
        s.rounds, s.heads, s.n_k, s.d
    );
    println!(
        "  f32 K+V bytes/s ÷ parallel-sum bytes/s = {:.3}  {}  (target ≥ 0.85)",
        m(&of_roof),
        range(&of_roof)
    );
    println!(
        "  f16 speed-up over f32 = {:.2}×  {}  (target ≥ 1.8)",
        m(&f16_speedup),
        range(&f16_speedup)
    );
    println!(
        "  bf16 speed-up over f32 = {:.2}×  {}",
        m(&bf16_speedup),
        range(&bf16_speedup)
    );
    println!(
        "  split-KV speed-up, 1 head, n_k={}: {:.2}×  {}  (target ≥ 1.7)",
        s.split_n_k,
        m(&split),
        range(&split)
    );
}

//! The prefill targets (the GEMM's rate, half precision): 8 heads, n = 4096, d = 64, 2 threads. Times the
//! optimized engine (f32, f16, bf16; non-causal and top-left causal), the materialised
//! baseline and faer's 2048³ GEMM with criterion, then measures the ratios that the targets
//! are stated in:
//!
//! - roof fraction: the engine's GFLOP/s (`4·n²·d` per head, causal counts the visible
//!   half) over the GEMM's,
//! - speedup: baseline time over optimized time, and
//! - half precision: f16 and bf16 throughput over f32's (same mask).
//!
//! Rates drift by several per cent within a run on these machines, so the ratios are not
//! taken from criterion's separate means: a custom loop interleaves the pair being
//! compared (roof, kernel, roof, kernel, …) and prints the median of the per-round ratios.
//!
//! Under `cargo test --benches` (criterion's test mode) the shapes shrink to a toy size.

mod common;

use std::time::Duration;

use attn_benches::catalog::{Dtype, Engine, attention_flops};
use attn_benches::protocol::median;
use attn_benches::roof::{GemmRoof, pool};
use attn_benches::runner::{Buffers, case_options, run_engine};
use criterion::{Criterion, Throughput};

/// The prefill problem of the targets, or a toy one in test mode.
struct Setup {
    heads: usize,
    n: usize,
    d: usize,
    threads: usize,
    gemm_n: usize,
    rounds: usize,
}

impl Setup {
    fn new(full: bool) -> Self {
        if full {
            Self {
                heads: 8,
                n: 4096,
                d: 64,
                threads: 2,
                gemm_n: 2048,
                rounds: 9,
            }
        } else {
            Self {
                heads: 1,
                n: 64,
                d: 16,
                threads: 2,
                gemm_n: 64,
                rounds: 1,
            }
        }
    }
}

/// One timed kernel of the comparison.
struct Kernel {
    label: &'static str,
    engine: Engine,
    dtype: Dtype,
    causal: bool,
}

const fn kernel(label: &'static str, engine: Engine, dtype: Dtype, causal: bool) -> Kernel {
    Kernel {
        label,
        engine,
        dtype,
        causal,
    }
}

const KERNELS: [Kernel; 7] = [
    kernel("optimized", Engine::Optimized, Dtype::F32, false),
    kernel("baseline", Engine::Baseline, Dtype::F32, false),
    kernel("optimized_causal", Engine::Optimized, Dtype::F32, true),
    kernel("optimized_f16", Engine::Optimized, Dtype::F16, false),
    kernel("optimized_bf16", Engine::Optimized, Dtype::Bf16, false),
    kernel("optimized_f16_causal", Engine::Optimized, Dtype::F16, true),
    kernel(
        "optimized_bf16_causal",
        Engine::Optimized,
        Dtype::Bf16,
        true,
    ),
];

fn main() {
    common::print_platform();
    let full = common::full_size();
    let s = Setup::new(full);
    let pool = pool(s.threads);
    let inputs_of = |dtype| Buffers::random(dtype, s.heads, s.n, s.n, s.d, 1);
    let all_inputs = [
        (Dtype::F32, inputs_of(Dtype::F32)),
        (Dtype::F16, inputs_of(Dtype::F16)),
        (Dtype::Bf16, inputs_of(Dtype::Bf16)),
    ];
    let inputs = |k: &Kernel| {
        &all_inputs
            .iter()
            .find(|(d, _)| *d == k.dtype)
            .expect("inputs for every dtype")
            .1
    };
    let mut gemm = GemmRoof::new(s.gemm_n, s.threads);
    let available: Vec<&Kernel> = KERNELS
        .iter()
        .filter(|k| match common::supports_f32(k.engine) {
            Ok(()) => true,
            Err(why) => {
                eprintln!("forward: skipping {}: {why}", k.label);
                false
            }
        })
        .collect();

    let mut c = Criterion::default()
        .sample_size(10)
        .measurement_time(Duration::from_secs(if full { 12 } else { 1 }))
        .configure_from_args();
    {
        let (h, n, d, t) = (s.heads, s.n, s.d, s.threads);
        let mut group = c.benchmark_group(format!("forward_h{h}_n{n}_d{d}_t{t}"));
        for k in &available {
            let options = case_options(k.causal);
            group.throughput(Throughput::Elements(
                attention_flops(h, n, n, d, k.causal) as u64
            ));
            group.bench_function(k.label, |b| {
                pool.install(|| b.iter(|| run_engine(k.engine, inputs(k), &options).expect("runs")))
            });
        }
        group.throughput(Throughput::Elements(gemm.flops() as u64));
        group.bench_function(format!("gemm_{}", s.gemm_n), |b| {
            pool.install(|| b.iter(|| gemm.run()))
        });
        group.finish();
    }
    c.final_summary();
    if common::criterion_only() {
        return;
    }

    // Interleaved ratios. Warm everything once so first-touch costs stay out of round one.
    pool.install(|| {
        gemm.run();
        for k in &available {
            run_engine(k.engine, inputs(k), &case_options(k.causal)).expect("runs");
        }
    });
    let time_kernel = |k: &Kernel| {
        let options = case_options(k.causal);
        pool.install(|| {
            common::seconds(|| run_engine(k.engine, inputs(k), &options).expect("runs"))
        })
    };
    let mut roof_fraction: Vec<Vec<f64>> = vec![Vec::new(); available.len()];
    let mut speedup = Vec::new();
    let mut half_ratio: Vec<Vec<f64>> = vec![Vec::new(); available.len()];
    let baseline = available.iter().position(|k| k.engine == Engine::Baseline);
    for _ in 0..s.rounds {
        let mut times = Vec::with_capacity(available.len());
        for (i, k) in available.iter().enumerate() {
            let t_roof = pool.install(|| gemm.time());
            let t = time_kernel(k);
            let kernel_rate = attention_flops(s.heads, s.n, s.n, s.d, k.causal) / t;
            roof_fraction[i].push(kernel_rate / (gemm.flops() / t_roof));
            times.push(t);
        }
        // Optimized non-causal and baseline run back to back in each round (the same drift).
        if let (Some(b), Some(o)) = (
            baseline,
            available.iter().position(|k| k.label == "optimized"),
        ) {
            speedup.push(times[b] / times[o]);
        }
        // Half precision over f32 with the same mask, from the same round.
        for (i, k) in available.iter().enumerate() {
            let f32_twin = available.iter().position(|f| {
                f.engine == k.engine && f.causal == k.causal && f.dtype == Dtype::F32
            });
            if let Some(f) = f32_twin.filter(|_| k.dtype != Dtype::F32) {
                half_ratio[i].push(times[f] / times[i]);
            }
        }
    }

    println!(
        "\nforward: interleaved ratios, median of {} rounds (h={}, n={}, d={}, threads={}, GEMM {}³)",
        s.rounds, s.heads, s.n, s.d, s.threads, s.gemm_n
    );
    for (k, fractions) in available.iter().zip(&roof_fraction) {
        let (lo, hi) = common::range(fractions);
        println!(
            "  {:<22} GFLOP/s ÷ GEMM GFLOP/s = {:.3}  (range {lo:.3}–{hi:.3})",
            k.label,
            median(fractions).unwrap_or(f64::NAN)
        );
    }
    for (k, ratios) in available.iter().zip(&half_ratio) {
        if let Some(x) = median(ratios) {
            let (lo, _) = common::range(ratios);
            println!(
                "  {:<22} throughput ÷ f32's = {x:.3}  (min {lo:.3}, target ≥ 0.9)",
                k.label
            );
        }
    }
    match median(&speedup) {
        Some(x) => println!("  optimized ÷ baseline speedup = {x:.2}×"),
        None => {
            println!("  optimized ÷ baseline speedup: unavailable (optimized engine not landed)")
        }
    }
}

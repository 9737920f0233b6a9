//! The backward pass's targets: 8 heads, n = 4096, d = 64, 2 threads. Times the optimized
//! backward pass (f32, f16, bf16; non-causal and top-left causal), the forward (for its own
//! roof fraction, and forward + backward), and faer's 2048³ GEMM with criterion, then
//! measures the ratios the targets are stated in:
//!
//! - roof fraction: backward GFLOP/s (`2·n²·(3·d_k + 2·d_v)` per head, causal counts the
//!   visible half) over the GEMM's; the forward's the same way (`4·n²·d`);
//! - backward roof fraction over the forward's (the AVX2 target: ≥ 0.9);
//! - half precision: f16 and bf16 backward throughput over f32's (same mask).
//!
//! As in the `forward` bench, a custom loop interleaves the kernels round by round and
//! prints the median of the per-round ratios (rates drift within a run on these machines).
//! Under `cargo test --benches` the shapes shrink to a toy size.

mod common;

use std::time::Duration;

use attn_benches::catalog::{Dtype, Engine, attention_flops};
use attn_benches::protocol::median;
use attn_benches::roof::{GemmRoof, pool};
use attn_benches::runner::{Buffers, case_options, run_engine};
use attn_benches::training::{Steps, backward_flops};
use criterion::{Criterion, Throughput};

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
                rounds: 5,
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

/// What a timed kernel runs.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Pass {
    Forward,
    Backward,
    ForwardBackward,
}

struct Kernel {
    label: &'static str,
    pass: Pass,
    dtype: Dtype,
    causal: bool,
}

const fn kernel(label: &'static str, pass: Pass, dtype: Dtype, causal: bool) -> Kernel {
    Kernel {
        label,
        pass,
        dtype,
        causal,
    }
}

const KERNELS: [Kernel; 10] = [
    kernel("backward", Pass::Backward, Dtype::F32, false),
    kernel("backward_causal", Pass::Backward, Dtype::F32, true),
    kernel("forward", Pass::Forward, Dtype::F32, false),
    kernel("forward_causal", Pass::Forward, Dtype::F32, true),
    kernel("forward_backward", Pass::ForwardBackward, Dtype::F32, false),
    kernel(
        "forward_backward_causal",
        Pass::ForwardBackward,
        Dtype::F32,
        true,
    ),
    kernel("backward_f16", Pass::Backward, Dtype::F16, false),
    kernel("backward_bf16", Pass::Backward, Dtype::Bf16, false),
    kernel("backward_f16_causal", Pass::Backward, Dtype::F16, true),
    kernel("backward_bf16_causal", Pass::Backward, Dtype::Bf16, true),
];

fn main() {
    common::print_platform();
    let full = common::full_size();
    let s = Setup::new(full);
    let pool = pool(s.threads);
    let (h, n, d, t) = (s.heads, s.n, s.d, s.threads);
    // Inputs per (dtype, mask): the forward's output and LSE depend on the mask.
    let steps: Vec<((Dtype, bool), Steps)> = [Dtype::F32, Dtype::F16, Dtype::Bf16]
        .into_iter()
        .flat_map(|dtype| [false, true].map(|causal| (dtype, causal)))
        .map(|(dtype, causal)| {
            let step = pool
                .install(|| Steps::random(dtype, h, n, n, d, 1, &case_options(causal)))
                .expect("valid inputs");
            ((dtype, causal), step)
        })
        .collect();
    let forward_inputs = Buffers::random(Dtype::F32, h, n, n, d, 1);
    let step_of = |k: &Kernel| {
        &steps
            .iter()
            .find(|(key, _)| *key == (k.dtype, k.causal))
            .expect("inputs for every kernel")
            .1
    };
    let run = |k: &Kernel| {
        let options = case_options(k.causal);
        match k.pass {
            Pass::Forward => {
                run_engine(Engine::Optimized, &forward_inputs, &options).expect("the forward runs")
            }
            Pass::Backward => step_of(k).backward(&options).expect("the backward runs"),
            Pass::ForwardBackward => step_of(k)
                .forward_backward(&options)
                .expect("forward and backward run"),
        }
    };
    let flops = |k: &Kernel| match k.pass {
        Pass::Forward => attention_flops(h, n, n, d, k.causal),
        Pass::Backward => backward_flops(h, n, n, d, k.causal),
        Pass::ForwardBackward => {
            attention_flops(h, n, n, d, k.causal) + backward_flops(h, n, n, d, k.causal)
        }
    };
    let mut gemm = GemmRoof::new(s.gemm_n, t);

    let mut c = Criterion::default()
        .sample_size(10)
        .measurement_time(Duration::from_secs(if full { 10 } else { 1 }))
        .configure_from_args();
    {
        let mut group = c.benchmark_group(format!("backward_h{h}_n{n}_d{d}_t{t}"));
        for k in &KERNELS {
            group.throughput(Throughput::Elements(flops(k) as u64));
            group.bench_function(k.label, |b| pool.install(|| b.iter(|| run(k))));
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

    pool.install(|| {
        gemm.run();
        KERNELS.iter().for_each(run);
    });
    let mut fraction: Vec<Vec<f64>> = vec![Vec::new(); KERNELS.len()];
    let mut seconds: Vec<Vec<f64>> = vec![Vec::new(); KERNELS.len()];
    let mut over_forward: Vec<Vec<f64>> = vec![Vec::new(); KERNELS.len()];
    let mut half_ratio: Vec<Vec<f64>> = vec![Vec::new(); KERNELS.len()];
    for _ in 0..s.rounds {
        let mut times = Vec::with_capacity(KERNELS.len());
        for (i, k) in KERNELS.iter().enumerate() {
            let t_roof = pool.install(|| gemm.time());
            let t = pool.install(|| common::seconds(|| run(k)));
            fraction[i].push(flops(k) / t / (gemm.flops() / t_roof));
            seconds[i].push(t);
            times.push(t);
        }
        let position = |pass, dtype, causal| {
            KERNELS
                .iter()
                .position(|k| k.pass == pass && k.dtype == dtype && k.causal == causal)
        };
        for (i, k) in KERNELS.iter().enumerate() {
            if k.pass != Pass::Backward {
                continue;
            }
            if k.dtype == Dtype::F32
                && let Some(f) = position(Pass::Forward, Dtype::F32, k.causal)
            {
                let last = |v: &Vec<f64>| *v.last().expect("pushed this round");
                over_forward[i].push(last(&fraction[i]) / last(&fraction[f]));
            }
            if k.dtype != Dtype::F32
                && let Some(f) = position(Pass::Backward, Dtype::F32, k.causal)
            {
                half_ratio[i].push(times[f] / times[i]);
            }
        }
    }

    println!(
        "\nbackward: interleaved ratios, median of {} rounds (h={h}, n={n}, d={d}, threads={t}, GEMM {}³)",
        s.rounds, s.gemm_n
    );
    for (i, k) in KERNELS.iter().enumerate() {
        let (lo, hi) = common::range(&fraction[i]);
        println!(
            "  {:<24} {:>8.1} ms   GFLOP/s ÷ GEMM GFLOP/s = {:.3}  (range {lo:.3}–{hi:.3})",
            k.label,
            median(&seconds[i]).unwrap_or(f64::NAN) * 1e3,
            median(&fraction[i]).unwrap_or(f64::NAN),
        );
    }
    for (i, k) in KERNELS.iter().enumerate() {
        if let Some(x) = median(&over_forward[i]) {
            println!(
                "  {:<24} roof fraction ÷ the forward's = {x:.3}  (AVX2 target ≥ 0.9)",
                k.label
            );
        }
        if let Some(x) = median(&half_ratio[i]) {
            let (lo, _) = common::range(&half_ratio[i]);
            println!(
                "  {:<24} throughput ÷ f32's = {x:.3}  (min {lo:.3}, target ≥ 0.9)",
                k.label
            );
        }
    }
}

//! Training's targets: forward + backward with attention dropout `p = 0.1` over the same
//! step with `p = 0` (f32 and bf16; 8 heads, n = 4096, d = 64, 2 threads, causal and not;
//! target ≤ 1.15× in f32, ≤ 1.3× on a native bf16 path); and the backward pass with the
//! gradient of a per-head `[1, H, n, n]` bias over the same backward without it (f32;
//! target ≤ 1.3×).
//!
//! Criterion times each step; then a loop interleaves them round by round (the dropped
//! step right after the undropped one) and prints the median of the per-round ratios.
//! Under `cargo test --benches` the shapes shrink to a toy size.

mod common;

use std::time::Duration;

use attn_benches::catalog::Dtype;
use attn_benches::protocol::median;
use attn_benches::roof::pool;
use attn_benches::runner::case_options;
use attn_benches::training::Steps;
use attn_core::{Dropout, Mask4Ref, Options};
use criterion::Criterion;

/// The dropout probability of the target.
const P: f32 = 0.1;

struct Setup {
    heads: usize,
    n: usize,
    d: usize,
    threads: usize,
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
                rounds: 7,
            }
        } else {
            Self {
                heads: 1,
                n: 64,
                d: 16,
                threads: 2,
                rounds: 1,
            }
        }
    }
}

/// The options of a step: causal or not, with dropout `p` (none when `p = 0`).
fn options(causal: bool, p: f32) -> Options<'static> {
    let o = case_options(causal);
    if p == 0.0 {
        o
    } else {
        o.with_dropout(Dropout::new(p, 0x5eed).expect("a probability"))
    }
}

fn main() {
    common::print_platform();
    let full = common::full_size();
    let s = Setup::new(full);
    let pool = pool(s.threads);
    let (h, n, d, t) = (s.heads, s.n, s.d, s.threads);
    let cases: Vec<(Dtype, bool, Steps)> = [Dtype::F32, Dtype::Bf16]
        .into_iter()
        .flat_map(|dtype| [false, true].map(|causal| (dtype, causal)))
        .map(|(dtype, causal)| {
            let step = pool
                .install(|| Steps::random(dtype, h, n, n, d, 1, &options(causal, 0.0)))
                .expect("valid inputs");
            (dtype, causal, step)
        })
        .collect();
    let label = |dtype: Dtype, causal: bool, p: f32| {
        let mask = if causal { "_causal" } else { "" };
        format!("forward_backward_{dtype}{mask}_p{p}")
    };
    let run = |step: &Steps, causal: bool, p: f32| {
        step.forward_backward(&options(causal, p))
            .expect("forward and backward run");
    };

    let mut c = Criterion::default()
        .sample_size(10)
        .measurement_time(Duration::from_secs(if full { 10 } else { 1 }))
        .configure_from_args();
    {
        let mut group = c.benchmark_group(format!("dropout_h{h}_n{n}_d{d}_t{t}"));
        for (dtype, causal, step) in &cases {
            for p in [0.0, P] {
                group.bench_function(label(*dtype, *causal, p), |b| {
                    pool.install(|| b.iter(|| run(step, *causal, p)))
                });
            }
        }
        group.finish();
    }
    c.final_summary();
    if common::criterion_only() {
        return;
    }

    // The bias: one [n, n] plane per head, shared by the batch (T5's relative positions).
    let bias: Vec<f32> = (0..h * n * n)
        .map(|e| ((e % n) as f32 - (e / n % n) as f32).abs().ln_1p() * -0.25)
        .collect();
    let bias = Mask4Ref::contiguous(&bias, [1, h, n, n]).expect("sized");
    let biased = case_options(false).with_additive_mask_4d(bias);
    let bias_step = pool
        .install(|| Steps::random(Dtype::F32, h, n, n, d, 2, &biased))
        .expect("valid inputs");
    let mut bias_ratios = Vec::new();
    let mut into_ratios = Vec::new();
    // Buffers a training loop reuses: the gradients and the bias's.
    let mut grads = [0; 3].map(|_| vec![0.0f32; h * n * d]);
    let mut dbias = vec![0.0f32; h * n * n];

    let mut ratios: Vec<Vec<f64>> = vec![Vec::new(); cases.len()];
    let mut plain: Vec<Vec<f64>> = vec![Vec::new(); cases.len()];
    for _ in 0..s.rounds {
        for (i, (_, causal, step)) in cases.iter().enumerate() {
            let t0 = pool.install(|| common::seconds(|| run(step, *causal, 0.0)));
            let t1 = pool.install(|| common::seconds(|| run(step, *causal, P)));
            ratios[i].push(t1 / t0);
            plain[i].push(t0);
        }
        let t0 = pool.install(|| common::seconds(|| bias_step.backward(&biased).expect("runs")));
        let t1 = pool
            .install(|| common::seconds(|| bias_step.backward_with_bias(&biased).expect("runs")));
        bias_ratios.push((t1 / t0, t0));
        let t2 = pool.install(|| {
            common::seconds(|| {
                let [a, b, c] = &mut grads;
                bias_step
                    .backward_with_bias_into(&biased, [a, b, c], &mut dbias)
                    .expect("runs")
            })
        });
        into_ratios.push(t2 / t0);
    }
    println!(
        "\ndropout: forward + backward with p = {P} ÷ p = 0, interleaved, median of {} rounds (h={h}, n={n}, d={d}, threads={t})",
        s.rounds
    );
    for (i, (dtype, causal, _)) in cases.iter().enumerate() {
        let (lo, hi) = common::range(&ratios[i]);
        let target = if *dtype == Dtype::F32 { 1.15 } else { 1.3 };
        println!(
            "  {:<36} p = 0: {:>8.1} ms   ratio {:.3}  (range {lo:.3}–{hi:.3}, target ≤ {target})",
            label(*dtype, *causal, P),
            median(&plain[i]).unwrap_or(f64::NAN) * 1e3,
            median(&ratios[i]).unwrap_or(f64::NAN),
        );
    }
    let (r, t): (Vec<f64>, Vec<f64>) = bias_ratios.into_iter().unzip();
    let (lo, hi) = common::range(&r);
    let (lo2, hi2) = common::range(&into_ratios);
    println!(
        "\nbias gradient: backward with dbias of a [1, {h}, {n}, {n}] bias ÷ without, interleaved, median of {} rounds\n  backward_f32_bias              without: {:>8.1} ms   ratio {:.3}  (range {lo:.3}–{hi:.3}, target ≤ 1.3)\n  backward_f32_bias_into (buffers reused)           ratio {:.3}  (range {lo2:.3}–{hi2:.3}, target ≤ 1.3)",
        s.rounds,
        median(&t).unwrap_or(f64::NAN) * 1e3,
        median(&r).unwrap_or(f64::NAN),
        median(&into_ratios).unwrap_or(f64::NAN),
    );
}

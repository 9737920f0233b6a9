//! Quick roof check while tuning: faer's f32 GEMM rate against the engine, interleaved.
//!
//! `cargo run --release -p attn-optimized --example roof [n] [heads] [d]`

use std::time::Instant;

use attn_optimized::{Attention, Causal, Element, Layout, Options, Tensor4Ref};
use faer::linalg::matmul::matmul;
use faer::{Accum, Mat, Par};
use half::{bf16, f16};

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    let args: Vec<usize> = std::env::args()
        .skip(1)
        .filter_map(|a| a.parse().ok())
        .collect();
    let (n, heads, d) = (
        *args.first().unwrap_or(&4096),
        *args.get(1).unwrap_or(&8),
        *args.get(2).unwrap_or(&64),
    );
    let threads = rayon::current_num_threads();
    let g = 2048;
    let (a, b) = (
        Mat::<f32>::from_fn(g, g, |i, j| ((i + j) % 7) as f32),
        Mat::<f32>::from_fn(g, g, |i, j| ((i * j) % 5) as f32),
    );
    let mut c = Mat::<f32>::zeros(g, g);
    let mut gemm = || {
        let t = Instant::now();
        matmul(
            c.as_mut(),
            Accum::Replace,
            a.as_ref(),
            b.as_ref(),
            1.0,
            Par::rayon(threads),
        );
        2.0 * (g as f64).powi(3) / t.elapsed().as_secs_f64() / 1e9
    };
    let data: Vec<f32> = (0..heads * n * d)
        .map(|x| ((x * 2654435761usize) % 1000) as f32 / 500.0 - 1.0)
        .collect();
    let t4 = Tensor4Ref::from_layout(&data, [1, heads, n, d], Layout::Bhsd).unwrap();
    let flops = 4.0 * (n as f64).powi(2) * d as f64 * heads as f64;
    for causal in [false, true] {
        let opts = if causal {
            Options::default().with_causal(Causal::TopLeft)
        } else {
            Options::default()
        };
        let attn = || {
            let t = Instant::now();
            Attention::batched(t4, t4, t4, &opts)
                .and_then(|call| call.forward(attn_optimized::Par::rayon(0)))
                .map(|f| f.into_output())
                .unwrap();
            let f = if causal { flops / 2.0 } else { flops };
            f / t.elapsed().as_secs_f64() / 1e9
        };
        attn();
        gemm();
        let (mut ratios, mut rs, mut ks) = (vec![], vec![], vec![]);
        for _ in 0..5 {
            let r = gemm();
            let k = attn();
            ratios.push(k / r);
            rs.push(r);
            ks.push(k);
        }
        println!(
            "causal={causal} n={n} heads={heads} d={d} threads={threads}: roof {:.1} GFLOP/s, attention {:.1} GFLOP/s, ratio {:.3}",
            median(rs),
            median(ks),
            median(ratios)
        );
        // Half storage against f32, interleaved.
        let h16: Vec<f16> = data.iter().map(|&x| f16::from_f32(x)).collect();
        let hb16: Vec<bf16> = data.iter().map(|&x| bf16::from_f32(x)).collect();
        let t16 = Tensor4Ref::from_layout(&h16, [1, heads, n, d], Layout::Bhsd).unwrap();
        let tb16 = Tensor4Ref::from_layout(&hb16, [1, heads, n, d], Layout::Bhsd).unwrap();
        fn time<T: Element>(t: Tensor4Ref<'_, T>, opts: &Options<'_>) -> f64 {
            let s = Instant::now();
            Attention::batched(t, t, t, opts)
                .and_then(|call| call.forward(attn_optimized::Par::rayon(0)))
                .map(|f| f.into_output())
                .unwrap();
            s.elapsed().as_secs_f64()
        }
        let (mut r16, mut rb16) = (vec![], vec![]);
        for _ in 0..5 {
            let base = time(t4, &opts);
            r16.push(base / time(t16, &opts));
            rb16.push(base / time(tb16, &opts));
        }
        println!(
            "  throughput vs f32: f16 {:.3}, bf16 {:.3}",
            median(r16),
            median(rb16)
        );
    }
}

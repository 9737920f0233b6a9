//! Quick decode check while tuning: one query per head against a long cache, f32 and f16,
//! against a parallel sum over a buffer of the same size (the bandwidth roof).
//!
//! `cargo run --release -p attn-optimized --example decode [n_k] [heads] [d]`

use std::time::Instant;

use attn_optimized::{Attention, Element, Layout, Options, Par, SplitKv, Tensor4Ref};
use half::f16;
use rayon::prelude::*;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn time<T: Element>(q: Tensor4Ref<'_, T>, (k, v): (Tensor4Ref<'_, T>, Tensor4Ref<'_, T>)) -> f64 {
    let s = Instant::now();
    Attention::batched(q, k, v, &Options::default())
        .and_then(|call| call.forward(Par::rayon(0)))
        .map(|f| f.into_output())
        .unwrap();
    s.elapsed().as_secs_f64()
}

fn main() {
    let args: Vec<usize> = std::env::args()
        .skip(1)
        .filter_map(|a| a.parse().ok())
        .collect();
    let (n_k, heads, d) = (
        *args.first().unwrap_or(&32768),
        *args.get(1).unwrap_or(&32),
        *args.get(2).unwrap_or(&128),
    );
    let kv32: Vec<f32> = (0..heads * n_k * d)
        .map(|x| ((x * 2654435761usize) % 1000) as f32 / 500.0 - 1.0)
        .collect();
    let q32: Vec<f32> = kv32[..heads * d].to_vec();
    let v32: Vec<f32> = kv32.iter().map(|&x| x * 0.5 + 0.25).collect();
    let kv16: Vec<f16> = kv32.iter().map(|&x| f16::from_f32(x)).collect();
    let v16: Vec<f16> = v32.iter().map(|&x| f16::from_f32(x)).collect();
    let q16: Vec<f16> = q32.iter().map(|&x| f16::from_f32(x)).collect();
    let q32v = Tensor4Ref::from_layout(&q32, [1, heads, 1, d], Layout::Bhsd).unwrap();
    let kv32v = Tensor4Ref::from_layout(&kv32, [1, heads, n_k, d], Layout::Bhsd).unwrap();
    let q16v = Tensor4Ref::from_layout(&q16, [1, heads, 1, d], Layout::Bhsd).unwrap();
    let kv16v = Tensor4Ref::from_layout(&kv16, [1, heads, n_k, d], Layout::Bhsd).unwrap();
    let v32v = Tensor4Ref::from_layout(&v32, [1, heads, n_k, d], Layout::Bhsd).unwrap();
    let v16v = Tensor4Ref::from_layout(&v16, [1, heads, n_k, d], Layout::Bhsd).unwrap();
    let bytes32 = 2.0 * (kv32.len() * 4) as f64;
    let roof = || {
        let s = Instant::now();
        // Sixteen lanes of partial sums, so the sum vectorises and is bound by memory.
        let x: f32 = kv32
            .par_chunks(1 << 16)
            .chain(v32.par_chunks(1 << 16))
            .map(|c| {
                let lanes = c.chunks_exact(16).fold([0.0f32; 16], |mut a, x| {
                    for t in 0..16 {
                        a[t] += x[t];
                    }
                    a
                });
                lanes.iter().sum::<f32>()
            })
            .sum();
        std::hint::black_box(x);
        bytes32 / s.elapsed().as_secs_f64() / 1e9
    };
    time(q32v, (kv32v, v32v));
    time(q16v, (kv16v, v16v));
    if std::env::var_os("DECODE_PROFILE").is_some() {
        let f16 = std::env::var("DECODE_PROFILE").unwrap() == "f16";
        let t = Instant::now();
        let reps = (20 * 32768 / n_k).max(20);
        for _ in 0..reps {
            if f16 {
                time(q16v, (kv16v, v16v));
            } else {
                time(q32v, (kv32v, v32v));
            }
        }
        println!(
            "{:.2} ms per step on {} threads",
            t.elapsed().as_secs_f64() * 1e3 / reps as f64,
            rayon::current_num_threads()
        );
        return;
    }
    let (mut fr, mut sp, mut bw, mut t32, mut t16) = (vec![], vec![], vec![], vec![], vec![]);
    for _ in 0..7 {
        let r = roof();
        let a = time(q32v, (kv32v, v32v));
        let h = time(q16v, (kv16v, v16v));
        bw.push(r);
        fr.push(bytes32 / a / 1e9 / r);
        sp.push(a / h);
        t32.push(a * 1e3);
        t16.push(h * 1e3);
    }
    println!(
        "f32 {:.2} ms, f16 {:.2} ms per step",
        median(t32),
        median(t16)
    );
    println!(
        "decode n_k={n_k} heads={heads} d={d}: bandwidth roof {:.1} GB/s, f32 {:.3} of roof, f16 speed-up over f32 {:.2}x",
        median(bw),
        median(fr),
        median(sp)
    );
    // Split-KV against one task per head, for few heads at n_k = 4096.
    for h in [1, 2, 4] {
        let kv: Vec<f32> = (0..h * 4096 * d)
            .map(|x| ((x * 7919) % 1000) as f32 / 500.0 - 1.0)
            .collect();
        let q: Vec<f32> = kv[..h * d].to_vec();
        let kvv = Tensor4Ref::from_layout(&kv, [1, h, 4096, d], Layout::Bhsd).unwrap();
        let qv = Tensor4Ref::from_layout(&q, [1, h, 1, d], Layout::Bhsd).unwrap();
        let run = |split| {
            let s = Instant::now();
            for _ in 0..20 {
                Attention::batched(qv, kvv, kvv, &Options::default())
                    .and_then(|call| call.split_kv(split).forward(Par::rayon(0)))
                    .map(|f| f.into_output())
                    .unwrap();
            }
            s.elapsed().as_secs_f64()
        };
        run(SplitKv::Auto);
        let (mut never, mut auto) = (vec![], vec![]);
        for _ in 0..7 {
            never.push(run(SplitKv::Never) / 20.0 * 1e6);
            auto.push(run(SplitKv::Auto) / 20.0 * 1e6);
        }
        let ratios: Vec<f64> = never.iter().zip(&auto).map(|(n, a)| n / a).collect();
        println!(
            "split-KV speed-up, n_q = 1, n_k = 4096, {h} head(s): {:.2}x ({:.0} µs unsplit, {:.0} µs split)",
            median(ratios),
            median(never),
            median(auto)
        );
    }
}

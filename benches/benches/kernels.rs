//! The engine's building blocks, one at a time: the vectorised `2^x`, the widening of
//! half-precision tiles to f32, and one task's tile (128 queries against 512 keys on one
//! thread, the unit the parallel grid hands out).

mod common;

use attn_optimized::{Element, Options, attention};
use criterion::{BenchmarkId, Criterion, Throughput};
use faer::Mat;
use half::{bf16, f16};

fn exp2(c: &mut Criterion) {
    let n = if common::full_size() { 1 << 16 } else { 256 };
    let xs: Vec<f32> = (0..n).map(|i| -20.0 + 28.0 * i as f32 / n as f32).collect();
    let mut group = c.benchmark_group("exp2");
    group.throughput(Throughput::Elements(n as u64));
    group.bench_function(
        BenchmarkId::new("in_place", format!("{:?}", attn_optimized::exp::isa())),
        |b| {
            let mut buf = xs.clone();
            b.iter(|| {
                buf.copy_from_slice(&xs);
                attn_optimized::exp::exp2_in_place(&mut buf);
            })
        },
    );
    group.finish();
}

fn widen<T: Element>(
    group: &mut criterion::BenchmarkGroup<'_, criterion::measurement::WallTime>,
    n: usize,
) {
    let src: Vec<T> = (0..n)
        .map(|i| T::from_f32((i % 97) as f32 * 0.125))
        .collect();
    let mut dst = vec![0.0f32; n];
    group.bench_function(T::NAME, |b| b.iter(|| T::widen(&src, &mut dst)));
}

fn conversion(c: &mut Criterion) {
    // A K tile of 512 keys × 64 features: what one visit widens.
    let n = if common::full_size() { 512 * 64 } else { 64 };
    let mut group = c.benchmark_group("widen_to_f32");
    group.throughput(Throughput::Elements(n as u64));
    widen::<f16>(&mut group, n);
    widen::<bf16>(&mut group, n);
    group.finish();
}

fn tile(c: &mut Criterion) {
    let (n_q, n_k, d) = if common::full_size() {
        (128, 512, 64)
    } else {
        (8, 16, 8)
    };
    let q = Mat::<f32>::from_fn(n_q, d, |i, j| ((i * 7 + j) % 13) as f32 / 13.0 - 0.5);
    let k = Mat::<f32>::from_fn(n_k, d, |i, j| ((i * 5 + j) % 11) as f32 / 11.0 - 0.5);
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(1)
        .build()
        .expect("a one-thread pool");
    let mut group = c.benchmark_group("tile_f32");
    group.throughput(Throughput::Elements((4 * n_q * n_k * d) as u64));
    group.bench_function(format!("{n_q}x{n_k}_d{d}_one_thread"), |b| {
        pool.install(|| {
            b.iter(|| {
                attention(q.as_ref(), k.as_ref(), k.as_ref(), &Options::default())
                    .expect("valid shapes")
            })
        })
    });
    group.finish();
}

criterion::criterion_group!(benches, exp2, conversion, tile);
fn main() {
    common::criterion_main(benches);
}

//! The machine's roofs: faer's f32 GEMM rate (2048³ on all cores and on one) and the memory
//! read bandwidth (a parallel sum over 1 GiB).

mod common;

use attn_benches::roof::{GemmRoof, ReadBuffer, pool};
use criterion::{BenchmarkId, Criterion, Throughput};

fn gemm(c: &mut Criterion) {
    let n = if common::full_size() { 2048 } else { 64 };
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let mut group = c.benchmark_group("gemm_f32");
    group.sample_size(10);
    for threads in [1, cores] {
        let mut g = GemmRoof::new(n, threads);
        group.throughput(Throughput::Elements(g.flops() as u64));
        let pool = pool(threads);
        group.bench_function(BenchmarkId::new(format!("n{n}_threads"), threads), |b| {
            pool.install(|| b.iter(|| g.run()))
        });
    }
    group.finish();
}

fn bandwidth(c: &mut Criterion) {
    let bytes = if common::full_size() {
        1 << 30
    } else {
        1 << 20
    };
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let pool = pool(threads);
    let buf = pool.install(|| ReadBuffer::new(bytes));
    let mut group = c.benchmark_group("read_bandwidth");
    group.sample_size(10);
    group.throughput(Throughput::Bytes(buf.bytes() as u64));
    group.bench_function(
        BenchmarkId::new(format!("{}MiB_threads", bytes >> 20), threads),
        |b| pool.install(|| b.iter(|| buf.sum())),
    );
    group.finish();
}

criterion::criterion_group!(benches, gemm, bandwidth);
fn main() {
    common::criterion_main(benches);
}

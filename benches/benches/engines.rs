//! Every engine at fixed shapes, f32, on all cores: the tuning tool next to the report.
//!
//! Throughput is in FLOP/s (`4·n²·d` per head, criterion's "elem/s"). The reference is
//! measured at small n only: it is single-threaded f64 and keeps every matrix.

mod common;

use attn_benches::catalog::{Dtype, Engine, attention_flops};
use attn_benches::roof::pool;
use attn_benches::runner::{Buffers, case_options, run_engine};
use criterion::{BenchmarkId, Criterion, Throughput};

/// (heads, n, d) shapes per engine; the smaller set when criterion only tests the bench.
fn shapes(engine: Engine, full: bool) -> Vec<(usize, usize, usize)> {
    match (engine, full) {
        (Engine::Reference, true) => vec![(1, 128, 64), (1, 256, 64)],
        (_, true) => vec![(8, 1024, 64), (8, 2048, 64)],
        (_, false) => vec![(2, 32, 16)],
    }
}

fn engines(c: &mut Criterion) {
    let full = common::full_size();
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let pool = pool(threads);
    for engine in Engine::ALL {
        if let Err(why) = common::supports_f32(engine) {
            eprintln!("skipping {engine}: {why}");
            continue;
        }
        let mut group = c.benchmark_group(format!("{engine}_f32_t{threads}"));
        group.sample_size(10);
        for causal in [false, true] {
            for (heads, n, d) in shapes(engine, full) {
                let inputs = Buffers::random(Dtype::F32, heads, n, n, d, 1);
                let options = case_options(causal);
                let flops = attention_flops(heads, n, n, d, causal);
                group.throughput(Throughput::Elements(flops as u64));
                let mask = if causal { "causal" } else { "full" };
                let id = BenchmarkId::new(format!("{mask}_h{heads}_d{d}"), n);
                group.bench_with_input(id, &inputs, |b, inputs| {
                    pool.install(|| {
                        b.iter(|| run_engine(engine, inputs, &options).expect("engine runs"))
                    })
                });
            }
        }
        group.finish();
    }
}

criterion::criterion_group!(benches, engines);
fn main() {
    common::criterion_main(benches);
}

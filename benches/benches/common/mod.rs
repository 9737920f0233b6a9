//! What the criterion benches share.

// Each bench binary compiles this module on its own and not every one uses every helper.
#![allow(dead_code)]

use attn_benches::catalog::{Dtype, Engine};
use attn_benches::runner::{Buffers, RunError, case_options, run_engine};

/// Prints the CPU and the instruction sets of attn's kernels and faer's GEMM, first, so that
/// every figure below is read against the machine it was measured on.
pub fn print_platform() {
    println!("platform: {}", attn_benches::platform::Platform::detect());
}

/// The `main` of a bench written with `criterion_group!`: the platform line, the groups,
/// then criterion's summary (what `criterion_main!` does, after the platform line).
pub fn criterion_main(groups: fn()) {
    print_platform();
    groups();
    criterion::Criterion::default()
        .configure_from_args()
        .final_summary();
}

/// Whether this is a real benchmark run (`cargo bench`), not `cargo test --benches` or
/// `cargo bench -- --test`, where criterion runs every routine once and the shapes must
/// shrink so that the test stays fast. Mirrors criterion's own rule: `--bench` without
/// `--test`.
pub fn full_size() -> bool {
    let args: Vec<String> = std::env::args().collect();
    args.iter().any(|a| a == "--bench") && !args.iter().any(|a| a == "--test")
}

/// Whether `engine` runs f32 inputs, asked of the report's dispatch with a tiny call (an
/// engine that has not landed yet is skipped, not faked).
pub fn supports_f32(engine: Engine) -> Result<(), String> {
    let probe = Buffers::random(Dtype::F32, 1, 2, 2, 4, 0);
    match run_engine(engine, &probe, &case_options(false)) {
        Ok(()) => Ok(()),
        Err(e @ RunError::Unsupported(_)) => Err(e.to_string()),
        Err(e) => panic!("{engine} fails on a 2×2 probe: {e}"),
    }
}

/// Seconds that `f` takes, once.
pub fn seconds(f: impl FnOnce()) -> f64 {
    let start = std::time::Instant::now();
    f();
    start.elapsed().as_secs_f64()
}

/// The smallest and largest of `xs` (∞ and −∞ when empty).
pub fn range(xs: &[f64]) -> (f64, f64) {
    let lo = xs.iter().copied().fold(f64::INFINITY, f64::min);
    let hi = xs.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    (lo, hi)
}

/// Whether only criterion's timings are wanted (`ATTN_BENCH_CRITERION_ONLY=1`): the benches
/// with interleaved ratio rounds skip them, so that two builds' bench binaries can be run in
/// alternation and their criterion figures compared within a reasonable time.
pub fn criterion_only() -> bool {
    std::env::var_os("ATTN_BENCH_CRITERION_ONLY").is_some_and(|v| v == "1")
}

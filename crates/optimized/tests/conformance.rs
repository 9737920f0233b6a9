//! The oracle's whole suite (`attn_oracle::engine_suite!`, one test per property) against
//! the streaming engine for each storage type. Failing seeds persist under
//! `proptest-regressions/optimized-<type>/` and are replayed first.

mod engine;

use engine::OptimizedEngine;

mod optimized_f32 {
    attn_oracle::engine_suite!(super::OptimizedEngine::<f32>::new());
}

mod optimized_f16 {
    attn_oracle::engine_suite!(super::OptimizedEngine::<half::f16>::new());
}

mod optimized_bf16 {
    attn_oracle::engine_suite!(super::OptimizedEngine::<half::bf16>::new());
}

/// The suite above ran on one kernel path: the CPU's best, or the one `ATTN_ISA` forces.
/// This test runs the whole binary again, in a child process, on every other path the CPU
/// supports (`ATTN_ISA=avx2` and `baseline` on an AVX-512 machine, `baseline` on an AVX2
/// one), so that one `cargo test` proves every path this machine can run. In the children,
/// and whenever the caller chose a path, it has nothing to add and returns.
#[test]
fn the_suite_on_every_other_kernel_path() {
    use attn_core::{ISA_VARIABLE, Isa};
    if std::env::var_os(ISA_VARIABLE).is_some() {
        return;
    }
    let exe = std::env::current_exe().expect("a test binary knows its own path");
    let best = Isa::detected();
    for isa in Isa::supported().into_iter().filter(|isa| *isa != best) {
        println!("the conformance suite on the {} kernel path", isa.name());
        let status = std::process::Command::new(&exe)
            .env(ISA_VARIABLE, isa.name())
            .args(["--quiet", "--skip", "the_suite_on_every_other_kernel_path"])
            .status()
            .expect("the test binary runs again");
        assert!(
            status.success(),
            "the conformance suite failed on the {} kernel path ({status})",
            isa.name()
        );
    }
}

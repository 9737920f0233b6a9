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

//! Every property of the suite against every engine of the workspace.

mod reference {
    attn_oracle::engine_suite!(attn_oracle::ReferenceEngine);
}

mod optimized_f32 {
    attn_oracle::engine_suite!(attn_oracle::OptimizedEngine::<f32>::new());
}

mod optimized_f16 {
    attn_oracle::engine_suite!(attn_oracle::OptimizedEngine::<half::f16>::new());
}

mod optimized_bf16 {
    attn_oracle::engine_suite!(attn_oracle::OptimizedEngine::<half::bf16>::new());
}

//! Criterion micro-benchmarks of the attn engines live in `benches/`.

//! Every property of the suite against the reference, the oracle's own engine. The other
//! engines run the same suite from their own crates (attn-optimized: `tests/conformance.rs`).

mod reference {
    attn_oracle::engine_suite!(attn_oracle::ReferenceEngine);
}

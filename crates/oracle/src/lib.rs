//! Property-based conformance suite for attention engines.
#![forbid(unsafe_code)]

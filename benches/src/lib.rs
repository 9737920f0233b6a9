//! The measuring code of the attn workspace, shared by the criterion benches
//! (`cargo bench -p attn-benches`) and the scaling report (`cargo xtask bench`).
//!
//! - [`baseline`]: attention as a user writes it by hand with faer (GEMM, softmax, GEMM),
//!   the number the streaming engine has to beat.
//! - [`roof`]: the machine's limits, faer's f32 GEMM rate and the memory read bandwidth.
//! - [`inputs`]: deterministic, seeded operands.
//! - [`runner`]: one case of the report (memory of the first run, median of timed runs),
//!   and the dispatch from (engine, dtype) to code, for the forward and the backward.
//! - [`training`]: backward-pass inputs (the forward's output and LSE made once) and calls.
//! - [`platform`]: the CPU and the instruction sets of attn's kernels and faer's GEMM, which
//!   every benchmark output names.
//! - [`catalog`], [`protocol`]: the engine names and sweep caps, and the JSON spoken between
//!   `xtask` and the release-built `attn-bench-runner` child. They need no engine, so
//!   `xtask` builds this crate without the default `engines` feature.
//!
//! ```
//! use attn_benches::{baseline, inputs::Qkv};
//! use attn_core::Options;
//! let x = Qkv::random(2, 16, 16, 8, 42);
//! let ours = baseline::attention_batched(x.q(), x.k(), x.v(), &Options::default()).unwrap();
//! let truth = attn_reference::Attention::batched(x.q(), x.k(), x.v(), &Options::default()).and_then(|call| call.forward()).map(|f| f.into_output()).unwrap();
//! let worst = ours.as_slice().iter().zip(truth.as_slice())
//!     .map(|(a, b)| (a - b).abs())
//!     .fold(0.0f32, f32::max);
//! assert!(worst < 1e-5);
//! ```
#![forbid(unsafe_code)]

pub mod catalog;
pub mod memory;
pub mod platform;
pub mod protocol;

#[cfg(feature = "engines")]
pub mod baseline;
#[cfg(feature = "engines")]
pub mod inputs;
#[cfg(feature = "engines")]
pub mod roof;
#[cfg(feature = "engines")]
pub mod runner;
#[cfg(feature = "engines")]
pub mod training;

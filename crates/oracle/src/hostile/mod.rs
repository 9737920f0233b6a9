//! Hostile inputs and the contract every call must keep on them: generators of
//! shapes, strides, options and values at their extremes, and the checks of what a call
//! returns, for any engine.
//!
//! The rest of the oracle asks whether an engine computes the right numbers on ordinary
//! inputs; this module asks whether it keeps its promises on inputs built to break them:
//!
//! - **it returns**: no call panics ([`guarded`] runs it under `catch_unwind` and turns a
//!   panic into a failure naming the input), and none aborts ([`isolated`] runs a test in a
//!   child process, so that an abort or a hang is a reported failure instead of the end of
//!   the test binary);
//! - **an `Err` names the operand**: its message mentions what is wrong ([`Rejection`]), and
//!   is the variant the contract fixes where it fixes one (`InvalidScale`, `Allocation`);
//! - **an `Ok` obeys the contract** ([`expect_head`], [`check_head`]): a row that sees no
//!   key is exactly 0 with LSE `-inf`; a row whose visible inputs (its Q row, the K and V
//!   rows and the biases of the keys it sees) are all finite is finite, lies in the hull of
//!   the values it sees, and equals the f64 reference within the derived bound of
//!   [`crate::bound`]; a row that a non-finite input reaches is unconstrained — and nothing
//!   else is: a NaN at a hidden key (hidden by causal/window/padding, by an additive `-inf`
//!   or by a boolean mask) reaches no row.
//!
//! # The amended contract these checks hold engines to
//!
//! The contract is amended for hostile inputs (`docs/conventions.md`, "Hidden keys", "Scores beyond f32",
//! "Non-finite inputs", "Errors"); the checks follow the amendment:
//!
//! - a key hidden by structure (causal, window, key length) or by an additive `-inf` is
//!   hidden exactly as a boolean mask hides it: nothing about it (bias, K row, V row)
//!   reaches the row. The oracle computes visibility itself, in `i128`
//!   ([`structurally_visible`]), not through `attn_core::HeadMask`; a window bound may be
//!   any `usize` (beyond the sequence it is no bound). An engine may still reject a bound
//!   it cannot represent, with an error naming the window;
//! - a visible score beyond f32 saturates (at `±f32::MAX·ln 2`, its bias first), so a finite
//!   bias is never `-inf` (`f32::MIN` is not padding) and a `+inf` bias saturates: a row
//!   whose visible inputs are finite — `+inf` biases allowed — is finite. The oracle
//!   promises it for every finite input, extremes included, which is what the contract
//!   says; where the f32 arithmetic of an engine cannot deliver it (partial sums of `q·k`
//!   or of `Σ p·v` that overflow), a profile of its own ([`Profile::ExtremeQk`],
//!   [`Profile::ExtremeV`]) reports it;
//! - a NaN bias, or a non-finite Q, K or V entry, at a visible position reaches only the
//!   rows that see it ([`RowClass::Touched`]);
//! - a scale whose `scale·log2 e` overflows f32 is `Error::InvalidScale`
//!   ([`scale_is_valid`]), like a non-finite one (zero and negative scales are valid);
//! - a buffer whose size overflows or cannot be allocated is `Error::Allocation`, naming it.
//!
//! # Comparing with the reference
//!
//! The reference is run on a *sanitised* problem that states the contract's answer: every
//! hidden position is hidden by a boolean mask built from the oracle's own visibility, and
//! hidden biases are 0. The reference saturates scores as the engines do
//! (`attn_core::SCORE_LIMIT`). Where an exact score is beyond f32, the score error
//! term of the bound is at least `u·f32::MAX`, which makes the bound fall back to the hull
//! of the visible values, which every answer lies in. Where an f32 engine may saturate a
//! score whose exact value fits (a partial product or sum of `scale·log2 e · q·k` that can
//! overflow: the contract lets the engines disagree on which keys saturated), the row is
//! not compared with the reference at all ([`HeadExpectation::may_saturate`]); it is still
//! promised finite and inside its hull.
//!
//! # Sizes
//!
//! Huge shapes (up to `usize::MAX`, through zero-stride views) are generated only where an
//! error must come before any work: a buffer of at least [`UNALLOCATABLE`] elements (which
//! no allocator can provide under [`isolated`]'s memory limit, so that even a buggy engine
//! cannot allocate and then touch it), a size that overflows `usize`, or an invalid operand
//! or option. A valid problem is never larger than [`MAX_WORK`]: [`expect_head`] says
//! [`Expected::TooMuchWork`] rather than let a test compute for days.
//!
//! ```
//! use attn_core::Options;
//! use attn_oracle::hostile::{check_head, expect_head, guarded, Outputs};
//! use attn_oracle::{Call, Engine, ReferenceEngine};
//! use faer::Mat;
//!
//! let q = Mat::<f32>::from_fn(2, 3, |i, j| (i + j) as f32 * 0.5);
//! let mut kv = Mat::<f32>::from_fn(4, 3, |i, j| (i * j) as f32 * 0.25);
//! kv[(3, 1)] = f32::NAN; // key 3 ...
//! let opts = Options::default().with_key_length(3); // ... is hidden by padding
//! let want = expect_head(q.as_ref(), kv.as_ref(), kv.as_ref(), &opts,
//!     &ReferenceEngine.error_model(), Outputs::WITH_LSE, 0);
//! let call = Call::head(q.as_ref(), kv.as_ref(), kv.as_ref(), &opts);
//! let got = guarded(|| call.forward_head(&ReferenceEngine).expect("the reference runs a head"))
//!     .expect("no panic");
//! let got = got.as_ref().map(|(o, l)| (o.as_ref(), Some(l.as_slice())));
//! check_head(&want, got.map_err(Clone::clone)).unwrap();
//! ```

use std::cell::{Cell, RefCell};
use std::fmt;
use std::io::Read;
use std::panic::{self, AssertUnwindSafe};
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::Once;
use std::time::{Duration, Instant};

use attn_core::{BoolMask, Causal, Error, KeyPadding, Options, SlidingWindow, Tensor4Ref};
use attn_reference::{Attention, Materialized, MaterializedBackward};
use faer::{Mat, MatMut, MatRef, RowRef};
use proptest::prelude::*;
use proptest::sample::select;
use proptest::test_runner::{
    Config, FileFailurePersistence, RngSeed, TestCaseError, TestError, TestRunner,
};

use crate::bound::{
    GradientBound, HeadBound, SAFETY, U32, U64, gamma, head_backward_bound, head_bound_merged,
};
use crate::case::{BoolRecipe, Rng};
use crate::{Compute, Dtype, Engine, ErrorModel};

/// Elements from which a buffer counts as unallocatable: `2^40` elements need at least
/// 2 TiB in any storage type, far beyond the 8 GiB of address space [`isolated`] gives its
/// child (and beyond this machine's memory). Huge generated buffers are at least this
/// large, so that even an engine that allocates infallibly cannot get (and then touch)
/// them; run huge cases under [`isolated`], where the limit makes that true anywhere.
pub const UNALLOCATABLE: usize = 1 << 40;

/// The most work (`rows · n_k · (d_k + d_v)` multiply-adds) a generated valid problem may
/// ask for; beyond it [`expect_head`] answers [`Expected::TooMuchWork`].
pub const MAX_WORK: u128 = 1 << 26;

mod any_engine;
mod backward;
mod batched;
mod contract;
mod head;
mod huge;
mod options;
mod partial;
mod running;
mod values;
mod views;

pub use any_engine::*;
pub use backward::*;
pub use batched::*;
pub use contract::*;
pub use head::*;
pub use huge::*;
pub use options::*;
pub use partial::*;
pub use running::*;
pub use values::*;
pub use views::*;

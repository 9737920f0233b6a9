//! Hostile inputs and the contract every call must keep on them (issue 13): generators of
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
//! Issue 13 amends the contract (`docs/conventions.md`, "Hidden keys", "Scores beyond f32",
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
//!   ([`scale_is_valid`]), like a non-finite or non-positive one;
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
//! use attn_oracle::{Engine, ReferenceEngine};
//! use faer::Mat;
//!
//! let q = Mat::<f32>::from_fn(2, 3, |i, j| (i + j) as f32 * 0.5);
//! let mut kv = Mat::<f32>::from_fn(4, 3, |i, j| (i * j) as f32 * 0.25);
//! kv[(3, 1)] = f32::NAN; // key 3 ...
//! let opts = Options::default().with_key_length(3); // ... is hidden by padding
//! let want = expect_head(q.as_ref(), kv.as_ref(), kv.as_ref(), &opts,
//!     &ReferenceEngine.error_model(), Outputs::WITH_LSE, 0);
//! let got = guarded(|| ReferenceEngine.attention_with_lse(q.as_ref(), kv.as_ref(), kv.as_ref(), &opts))
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

// ---------------------------------------------------------------------------------------
// Values.

/// A single hostile value.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Special {
    /// NaN.
    Nan,
    /// `+inf`.
    PosInf,
    /// `-inf`.
    NegInf,
    /// `f32::MAX`.
    Max,
    /// `f32::MIN` (the Hugging Face padding bias).
    Min,
    /// `1e38`.
    Huge,
    /// `-1e38`.
    NegHuge,
    /// `f32::MIN_POSITIVE`, the smallest normal.
    MinPositive,
    /// The smallest positive subnormal.
    Subnormal,
    /// The smallest negative subnormal.
    NegSubnormal,
    /// `-0.0`.
    NegZero,
}

impl Special {
    /// The non-finite values.
    pub const NON_FINITE: [Special; 3] = [Special::Nan, Special::PosInf, Special::NegInf];

    /// Non-finite values and the largest finite ones (whose products overflow f32).
    pub const POISONS: [Special; 6] = [
        Special::Nan,
        Special::PosInf,
        Special::NegInf,
        Special::Max,
        Special::Min,
        Special::Huge,
    ];

    /// The finite extremes.
    pub const FINITE_EXTREMES: [Special; 8] = [
        Special::Max,
        Special::Min,
        Special::Huge,
        Special::NegHuge,
        Special::MinPositive,
        Special::Subnormal,
        Special::NegSubnormal,
        Special::NegZero,
    ];

    /// The value.
    ///
    /// ```
    /// use attn_oracle::hostile::Special;
    /// assert_eq!(Special::Min.value(), f32::MIN);
    /// assert!(Special::Subnormal.value() > 0.0 && !Special::Subnormal.value().is_normal());
    /// ```
    pub fn value(self) -> f32 {
        match self {
            Special::Nan => f32::NAN,
            Special::PosInf => f32::INFINITY,
            Special::NegInf => f32::NEG_INFINITY,
            Special::Max => f32::MAX,
            Special::Min => f32::MIN,
            Special::Huge => 1e38,
            Special::NegHuge => -1e38,
            Special::MinPositive => f32::MIN_POSITIVE,
            Special::Subnormal => f32::from_bits(1),
            Special::NegSubnormal => -f32::from_bits(1),
            Special::NegZero => -0.0,
        }
    }
}

/// How the entries of an operand are drawn (then rounded to the storage type, so that the
/// contract is judged on the values the engine actually stores).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Fill {
    /// Zeros.
    Zero,
    /// Uniform in `[-1, 1]`.
    Unit,
    /// Integers in `{-2, …, 2}`: ties.
    Ties,
    /// Uniform in `[-35, 35]`: large logits.
    Large,
    /// Subnormals of the storage type, zeros and `±1`.
    Subnormal,
    /// Half the entries a finite extreme of the storage type (its largest finite value,
    /// `±1e38`, the smallest normal, subnormals, `-0`), the others in `[-1, 1]`.
    Extreme,
    /// A quarter of the entries NaN or `±inf`, the others in `[-1, 1]`.
    NonFinite,
}

impl Fill {
    /// The fills whose values are finite and moderate.
    pub const MODERATE: [Fill; 5] = [
        Fill::Unit,
        Fill::Ties,
        Fill::Zero,
        Fill::Large,
        Fill::Subnormal,
    ];

    fn sample(self, rng: &mut Rng, dtype: Dtype) -> f32 {
        let unit = |rng: &mut Rng| (rng.unit() * 2.0 - 1.0) as f32;
        let x = match self {
            Fill::Zero => 0.0,
            Fill::Unit => unit(rng),
            Fill::Ties => rng.below(5) as f32 - 2.0,
            Fill::Large => ((rng.unit() * 2.0 - 1.0) * 35.0) as f32,
            Fill::Subnormal => match rng.below(4) {
                0 => 0.0,
                1 => sign(rng),
                _ => sign(rng) * subnormal(rng, dtype),
            },
            Fill::Extreme => {
                if rng.below(2) == 0 {
                    unit(rng)
                } else {
                    let max = dtype_max(dtype);
                    match rng.below(7) {
                        0 => max,
                        1 => -max,
                        2 => sign(rng) * 1e38f32.min(max),
                        3 => sign(rng) * dtype_min_positive(dtype),
                        4 => sign(rng) * subnormal(rng, dtype),
                        5 => -0.0,
                        _ => sign(rng) * max * 0.5,
                    }
                }
            }
            Fill::NonFinite => {
                if rng.below(4) == 0 {
                    Special::NON_FINITE[rng.below(3) as usize].value()
                } else {
                    unit(rng)
                }
            }
        };
        dtype.round(x)
    }
}

fn sign(rng: &mut Rng) -> f32 {
    if rng.next_u64() & 1 == 0 { 1.0 } else { -1.0 }
}

fn subnormal(rng: &mut Rng, dtype: Dtype) -> f32 {
    match dtype {
        Dtype::F16 => (1 + rng.below(1023)) as f32 * 2f32.powi(-24),
        Dtype::Bf16 => f32::from_bits(((1 + rng.below(127)) as u32) << 16),
        Dtype::F32 => f32::from_bits(1 + rng.below(0x7F_FFFE) as u32),
    }
}

/// The largest finite value of a storage type.
pub fn dtype_max(dtype: Dtype) -> f32 {
    match dtype {
        Dtype::F32 => f32::MAX,
        Dtype::F16 => half::f16::MAX.to_f32(),
        Dtype::Bf16 => half::bf16::MAX.to_f32(),
    }
}

fn dtype_min_positive(dtype: Dtype) -> f32 {
    match dtype {
        Dtype::F32 => f32::MIN_POSITIVE,
        Dtype::F16 => half::f16::MIN_POSITIVE.to_f32(),
        Dtype::Bf16 => half::bf16::MIN_POSITIVE.to_f32(),
    }
}

/// The finite values of an additive mask.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum BiasFill {
    /// Zeros.
    Zero,
    /// Normal with standard deviation 2.
    Small,
    /// Uniform in `[-1e4, 1e4]`.
    Large,
    /// Half the entries `f32::MIN` (the Hugging Face padding bias), the others small.
    Min,
    /// Half the rows `f32::MIN` everywhere (a row "masked" with a finite bias: the formula
    /// gives a near-uniform average of V), the others small.
    MinRows,
    /// A third of the entries one of `f32::MIN`, `f32::MAX`, `±1e38`, `±1e30`.
    Extreme,
    /// A quarter of the entries NaN or `+inf` (each makes its row NaN where visible).
    NonFinite,
}

impl BiasFill {
    fn sample(self, rng: &mut Rng, min_row: bool) -> f32 {
        let small = |rng: &mut Rng| (rng.normal() * 2.0) as f32;
        match self {
            BiasFill::Zero => 0.0,
            BiasFill::Small => small(rng),
            BiasFill::Large => ((rng.unit() * 2.0 - 1.0) * 1e4) as f32,
            BiasFill::Min => {
                if rng.below(2) == 0 {
                    f32::MIN
                } else {
                    small(rng)
                }
            }
            BiasFill::MinRows => {
                if min_row {
                    f32::MIN
                } else {
                    small(rng)
                }
            }
            BiasFill::Extreme => {
                if rng.below(3) == 0 {
                    [f32::MIN, f32::MAX, 1e38, -1e38, 1e30, -1e30][rng.below(6) as usize]
                } else {
                    small(rng)
                }
            }
            BiasFill::NonFinite => {
                if rng.below(4) == 0 {
                    [f32::NAN, f32::INFINITY][rng.below(2) as usize]
                } else {
                    small(rng)
                }
            }
        }
    }
}

/// An additive mask recipe.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct BiasRecipe {
    /// The values that are not `-inf`.
    pub fill: BiasFill,
    /// Percentage of `-inf` entries.
    pub neg_inf_percent: u8,
    /// Percentage of rows that are `-inf` everywhere.
    pub hidden_rows_percent: u8,
}

// ---------------------------------------------------------------------------------------
// Options.

/// A key-padding length, relative to the number of keys.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum KeyLen {
    /// `n_k · p / 1000` (valid).
    Permille(u16),
    /// `n_k + 1 + x` (invalid: longer than the keys).
    Beyond(u8),
    /// `usize::MAX` (invalid).
    Max,
}

impl KeyLen {
    /// The length for `n_k` keys.
    pub fn resolve(self, n_k: usize) -> usize {
        match self {
            KeyLen::Permille(p) => n_k * usize::from(p.min(1000)) / 1000,
            KeyLen::Beyond(x) => n_k.saturating_add(1 + usize::from(x)),
            KeyLen::Max => usize::MAX,
        }
    }
}

/// Whether the amended contract accepts `scale`: finite, positive, and `scale·log2 e`
/// finite in f32 (the streaming engines fold `log2 e` into the scale).
///
/// ```
/// use attn_oracle::hostile::scale_is_valid;
/// assert!(scale_is_valid(2.0e38) && scale_is_valid(1e-40));
/// assert!(!scale_is_valid(f32::MAX) && !scale_is_valid(0.0) && !scale_is_valid(f32::NAN));
/// ```
pub fn scale_is_valid(scale: f32) -> bool {
    scale.is_finite() && scale > 0.0 && (scale * core::f32::consts::LOG2_E).is_finite()
}

/// Explicit scales at the extremes, valid and invalid; none lies within a relative `1e-3`
/// of the overflow threshold of `scale·log2 e`, where engines may round either way.
pub fn extreme_scales() -> Vec<f32> {
    vec![
        f32::MAX,
        2.5e38,
        2.0e38,
        1e30,
        1.0,
        1e-30,
        f32::MIN_POSITIVE,
        1e-40,
        f32::from_bits(1),
        0.0,
        -0.0,
        -1.0,
        f32::MIN,
        f32::NAN,
        f32::INFINITY,
        f32::NEG_INFINITY,
    ]
}

/// One side of a sliding window at the extremes: small, around the sequence lengths, and
/// near `usize::MAX` (where a conversion to `i64` wraps).
pub fn extreme_window_side() -> BoxedStrategy<Option<usize>> {
    prop_oneof![
        1 => Just(None),
        3 => (0..=4usize).prop_map(Some),
        1 => (0..=600usize).prop_map(Some),
        3 => select(vec![
            usize::MAX,
            usize::MAX - 1,
            i64::MAX as usize,
            i64::MAX as usize + 1,
            i64::MAX as usize - 1,
            usize::MAX / 2 + 7,
            1usize << 62,
            u32::MAX as usize + 1,
        ])
        .prop_map(Some),
    ]
    .boxed()
}

fn moderate_window_side() -> BoxedStrategy<Option<usize>> {
    proptest::option::weighted(0.8, prop_oneof![2 => 0..=4usize, 1 => 0..=600usize]).boxed()
}

fn causal() -> BoxedStrategy<Causal> {
    prop_oneof![Just(Causal::TopLeft), Just(Causal::BottomRight)].boxed()
}

/// Whether a window bound is so large that the amendment lets an engine reject it.
fn huge_side(side: Option<usize>) -> bool {
    side.is_some_and(|s| s > u32::MAX as usize)
}

// ---------------------------------------------------------------------------------------
// Views.

/// How a single-head operand is laid out in memory: every stride sign faer allows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum View {
    /// Column-major (faer's own).
    ColMajor,
    /// Row-major (the transpose of a column-major matrix).
    RowMajor,
    /// Negative row stride (`reverse_rows`).
    ReversedRows,
    /// Negative column stride (`reverse_cols`).
    ReversedCols,
    /// Row-major with both strides negative.
    Reversed,
    /// A submatrix of a larger NaN-filled buffer (an engine that reads outside its view
    /// sees NaN).
    Padded,
    /// Zero row stride (`MatRef::from_repeated_row`) when every row is equal; `Padded`
    /// otherwise.
    Broadcast,
}

impl View {
    /// Every view.
    pub const ALL: [View; 7] = [
        View::ColMajor,
        View::RowMajor,
        View::ReversedRows,
        View::ReversedCols,
        View::Reversed,
        View::Padded,
        View::Broadcast,
    ];
}

/// An operand stored in a storage type `T` with the strides of a [`View`].
#[derive(Debug, Clone)]
pub struct StoredMat<T> {
    buf: Mat<T>,
    view: View,
    nrows: usize,
    ncols: usize,
}

fn rows_equal(m: MatRef<'_, f32>) -> bool {
    (1..m.nrows()).all(|i| (0..m.ncols()).all(|j| m[(i, j)].to_bits() == m[(0, j)].to_bits()))
}

impl<T: Copy> StoredMat<T> {
    /// Stores the logical matrix `m` (converted with `convert`) so that
    /// [`StoredMat::view`] shows exactly `m` through the strides of `view`.
    ///
    /// ```
    /// use attn_oracle::hostile::{StoredMat, View};
    /// use faer::Mat;
    /// let m = Mat::<f32>::from_fn(3, 2, |i, j| (i * 2 + j) as f32);
    /// for view in View::ALL {
    ///     let s = StoredMat::new(m.as_ref(), view, |x| x);
    ///     assert_eq!(s.view(), m.as_ref());
    /// }
    /// let r = StoredMat::new(m.as_ref(), View::ReversedRows, |x| x);
    /// assert!(r.view().row_stride() < 0);
    /// ```
    pub fn new(m: MatRef<'_, f32>, view: View, convert: impl Fn(f32) -> T) -> Self {
        let (n, d) = (m.nrows(), m.ncols());
        let c = |i: usize, j: usize| convert(m[(i, j)]);
        let view = if view == View::Broadcast && (n == 0 || !rows_equal(m)) {
            View::Padded
        } else {
            view
        };
        let buf = match view {
            View::ColMajor => Mat::from_fn(n, d, c),
            View::RowMajor => Mat::from_fn(d, n, |j, i| c(i, j)),
            View::ReversedRows => Mat::from_fn(n, d, |i, j| c(n - 1 - i, j)),
            View::ReversedCols => Mat::from_fn(n, d, |i, j| c(i, d - 1 - j)),
            View::Reversed => Mat::from_fn(d, n, |j, i| c(n - 1 - i, d - 1 - j)),
            View::Padded => Mat::from_fn(n + 3, d + 2, |i, j| {
                if (1..=n).contains(&i) && (1..=d).contains(&j) {
                    c(i - 1, j - 1)
                } else {
                    convert(f32::NAN)
                }
            }),
            View::Broadcast => Mat::from_fn(1, d, |_, j| c(0, j)),
        };
        Self {
            buf,
            view,
            nrows: n,
            ncols: d,
        }
    }

    /// The view (the logical matrix).
    pub fn view(&self) -> MatRef<'_, T> {
        let b = self.buf.as_ref();
        match self.view {
            View::ColMajor => b,
            View::RowMajor => b.transpose(),
            View::ReversedRows => b.reverse_rows(),
            View::ReversedCols => b.reverse_cols(),
            View::Reversed => b.transpose().reverse_rows_and_cols(),
            View::Padded => b.submatrix(1, 1, self.nrows, self.ncols),
            View::Broadcast => MatRef::from_repeated_row(b.row(0), self.nrows),
        }
    }

    /// The view actually used (`Broadcast` falls back to `Padded` for unequal rows).
    pub fn kind(&self) -> View {
        self.view
    }
}

/// A writable output `[n, d]` in storage type `O`, with the strides of a [`View`]
/// (`Broadcast` is not writable and means `Padded`), pre-filled with NaN so that an entry
/// the engine does not write shows up.
#[derive(Debug, Clone)]
pub struct StoredOut<O> {
    buf: Mat<O>,
    view: View,
    nrows: usize,
    ncols: usize,
}

impl<O: Copy> StoredOut<O> {
    /// An `n × d` output filled with `fill`.
    pub fn new(n: usize, d: usize, view: View, fill: O) -> Self {
        let view = if view == View::Broadcast {
            View::Padded
        } else {
            view
        };
        let buf = match view {
            View::RowMajor | View::Reversed => Mat::from_fn(d, n, |_, _| fill),
            View::Padded => Mat::from_fn(n + 3, d + 2, |_, _| fill),
            _ => Mat::from_fn(n, d, |_, _| fill),
        };
        Self {
            buf,
            view,
            nrows: n,
            ncols: d,
        }
    }

    /// The writable view.
    pub fn view_mut(&mut self) -> MatMut<'_, O> {
        let (n, d) = (self.nrows, self.ncols);
        let b = self.buf.as_mut();
        match self.view {
            View::RowMajor => b.transpose_mut(),
            View::ReversedRows => b.reverse_rows_mut(),
            View::ReversedCols => b.reverse_cols_mut(),
            View::Reversed => b.transpose_mut().reverse_rows_and_cols_mut(),
            View::Padded => b.submatrix_mut(1, 1, n, d),
            View::ColMajor | View::Broadcast => b,
        }
    }

    /// What was written, widened with `widen`.
    pub fn read(&mut self, widen: impl Fn(O) -> f32) -> Mat<f32> {
        let v = self.view_mut();
        Mat::from_fn(v.nrows(), v.ncols(), |i, j| widen(v[(i, j)]))
    }
}

/// A `nrows × row.len()` view whose rows are all `row` (row stride 0): any number of rows,
/// `usize::MAX` included, from one row of memory.
pub fn broadcast_rows<T>(row: &[T], nrows: usize) -> MatRef<'_, T> {
    MatRef::from_repeated_row(RowRef::from_slice(row), nrows)
}

// ---------------------------------------------------------------------------------------
// Single-head recipes.

/// How a key is hidden from a query row.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Hiding {
    /// By causal, window or key padding (key padding is added if nothing hides the key).
    Structural,
    /// By an additive `-inf`.
    NegInfBias,
    /// By a boolean mask (`allow` or `block`).
    BoolMask,
}

/// What a [`Plant`] poisons.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Target {
    /// The K row of the hidden key (all of it, or one entry).
    K,
    /// Its V row.
    V,
    /// Both.
    KAndV,
    /// The bias of the hidden position (for [`Hiding::NegInfBias`] the bias is the hider,
    /// so the K row is poisoned instead).
    Bias,
    /// The query row, after hiding every key from it: a row that sees nothing is 0 with
    /// LSE `-inf` whatever its query.
    QOfEmptyRow,
}

/// A poison planted at a position hidden from one query row.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Plant {
    /// How the position is hidden.
    pub hiding: Hiding,
    /// What is poisoned.
    pub target: Target,
    /// With what.
    pub value: Special,
    /// Picks the query row and the key.
    pub pick: u32,
    /// Poison the whole row of K/V (else one entry).
    pub whole_row: bool,
}

/// One head's hostile problem as a shrinkable recipe.
#[derive(Debug, Clone, PartialEq)]
pub struct HostileHead {
    /// Queries.
    pub n_q: usize,
    /// Keys.
    pub n_k: usize,
    /// Key width.
    pub d_k: usize,
    /// Value width.
    pub d_v: usize,
    /// Distribution of Q and K.
    pub qk: Fill,
    /// Distribution of V.
    pub v: Fill,
    /// Every K row (and every V row) equal, so that K and V can be broadcast views.
    pub identical_keys: bool,
    /// Explicit scale.
    pub scale: Option<f32>,
    /// Causal constraint.
    pub causal: Option<Causal>,
    /// Sliding window.
    pub window: Option<SlidingWindow>,
    /// Key padding.
    pub key_len: Option<KeyLen>,
    /// Boolean mask.
    pub bool_mask: Option<BoolRecipe>,
    /// Additive mask.
    pub additive: Option<BiasRecipe>,
    /// Poisons at hidden positions.
    pub plants: Vec<Plant>,
    /// Views of Q, K, V.
    pub views: [View; 3],
    /// Storage type.
    pub dtype: Dtype,
    /// Seed of every value.
    pub seed: u64,
}

/// The inputs of a [`HostileHead`], built: logical f32 operands already rounded to the
/// storage type, the masks, and the options' parts.
#[derive(Debug, Clone, PartialEq)]
pub struct HostileInputs {
    /// `[n_q, d_k]`.
    pub q: Mat<f32>,
    /// `[n_k, d_k]`.
    pub k: Mat<f32>,
    /// `[n_k, d_v]`.
    pub v: Mat<f32>,
    /// Explicit scale.
    pub scale: Option<f32>,
    /// Causal constraint.
    pub causal: Option<Causal>,
    /// Sliding window.
    pub window: Option<SlidingWindow>,
    /// Key padding length.
    pub key_len: Option<usize>,
    /// Boolean mask: polarity (`true` = allow) and bits.
    pub bool_mask: Option<(bool, Mat<bool>)>,
    /// Additive mask.
    pub additive: Option<Mat<f32>>,
    /// Views of Q, K, V.
    pub views: [View; 3],
    /// Storage type.
    pub dtype: Dtype,
    /// Where the plants put their poisons: the keys whose K or V row was poisoned, and the
    /// biases.
    pub planted: Planted,
}

/// Where a case's plants put their poisons.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Planted {
    /// Keys whose K or V row holds a poison.
    pub keys: Vec<usize>,
    /// Bias positions `(i, j)` that hold a poison.
    pub biases: Vec<(usize, usize)>,
    /// Query rows that hold a poison (rows hidden from every key, where the poison must
    /// not matter; a batched call's own key lengths may make them see keys again).
    pub queries: Vec<usize>,
}

fn options_of<'a>(
    scale: Option<f32>,
    causal: Option<Causal>,
    window: Option<SlidingWindow>,
    key_padding: Option<KeyPadding<'a>>,
    bool_mask: Option<&'a (bool, Mat<bool>)>,
    additive: Option<&'a Mat<f32>>,
) -> Options<'a> {
    let mut o = Options::default();
    if let Some(s) = scale {
        o = o.with_scale(s);
    }
    if let Some(c) = causal {
        o = o.with_causal(c);
    }
    if let Some(w) = window {
        o = o.with_window(w);
    }
    match key_padding {
        Some(KeyPadding::Uniform(l)) => o = o.with_key_length(l),
        Some(KeyPadding::PerBatch(ls)) => o = o.with_key_lengths(ls),
        None => {}
    }
    if let Some((allow, m)) = bool_mask {
        o = o.with_bool_mask(if *allow {
            BoolMask::allow(m.as_ref())
        } else {
            BoolMask::block(m.as_ref())
        });
    }
    if let Some(m) = additive {
        o = o.with_additive_mask(m.as_ref());
    }
    o
}

impl HostileInputs {
    /// The options of the call, borrowing the masks.
    pub fn options(&self) -> Options<'_> {
        options_of(
            self.scale,
            self.causal,
            self.window,
            self.key_len.map(KeyPadding::Uniform),
            self.bool_mask.as_ref(),
            self.additive.as_ref(),
        )
    }

    /// `[n_q, n_k, d_k, d_v]`.
    pub fn dims(&self) -> [usize; 4] {
        [
            self.q.nrows(),
            self.k.nrows(),
            self.q.ncols(),
            self.v.ncols(),
        ]
    }

    /// Q, K and V stored in `T` through their views.
    pub fn stored<T: Copy>(&self, convert: impl Fn(f32) -> T + Copy) -> [StoredMat<T>; 3] {
        [
            StoredMat::new(self.q.as_ref(), self.views[0], convert),
            StoredMat::new(self.k.as_ref(), self.views[1], convert),
            StoredMat::new(self.v.as_ref(), self.views[2], convert),
        ]
    }

    fn struct_visible(&self, i: usize, j: usize) -> bool {
        let [n_q, n_k, ..] = self.dims();
        structurally_visible(self.causal, self.window, self.key_len, n_q, n_k, i, j)
    }

    fn hide(&mut self, hiding: Hiding, i: usize, j: usize) -> bool {
        let [n_q, n_k, ..] = self.dims();
        match hiding {
            Hiding::Structural => !self.struct_visible(i, j),
            Hiding::NegInfBias => {
                let m = self.additive.get_or_insert_with(|| Mat::zeros(n_q, n_k));
                m[(i, j)] = f32::NEG_INFINITY;
                true
            }
            Hiding::BoolMask => {
                let (allow, m) = self.bool_mask.get_or_insert_with(|| {
                    (
                        j.is_multiple_of(2),
                        Mat::from_fn(n_q, n_k, |_, _| j.is_multiple_of(2)),
                    )
                });
                m[(i, j)] = !*allow;
                true
            }
        }
    }

    fn plant(&mut self, p: &Plant) {
        let [n_q, n_k, d_k, d_v] = self.dims();
        if n_q == 0 || n_k == 0 || self.key_len.is_some_and(|l| l > n_k) {
            return;
        }
        let i = p.pick as usize % n_q;
        // The engine stores the poison in its storage type (f32::MAX is +inf in f16).
        let value = self.dtype.round(p.value.value());
        if p.target == Target::QOfEmptyRow {
            match p.hiding {
                Hiding::Structural => {
                    if (0..n_k).any(|j| self.struct_visible(i, j)) {
                        if self.key_len.is_some() {
                            return;
                        }
                        self.key_len = Some(0);
                    }
                }
                _ => {
                    for j in 0..n_k {
                        self.hide(p.hiding, i, j);
                    }
                }
            }
            for t in 0..d_k {
                self.q[(i, t)] = value;
            }
            self.planted.queries.push(i);
            return;
        }
        let start = (p.pick as usize / n_q.max(1)) % n_k;
        let j = match p.hiding {
            Hiding::Structural => {
                match (0..n_k)
                    .map(|o| (start + o) % n_k)
                    .find(|&j| !self.struct_visible(i, j))
                {
                    Some(j) => j,
                    None if self.key_len.is_none() => {
                        self.key_len = Some(n_k - 1);
                        n_k - 1
                    }
                    None => return,
                }
            }
            h => {
                self.hide(h, i, start);
                start
            }
        };
        let poison = |m: &mut Mat<f32>, d: usize, whole: bool| {
            if d == 0 {
                return;
            }
            if whole {
                for t in 0..d {
                    m[(j, t)] = value;
                }
            } else {
                m[(j, p.pick as usize % d)] = value;
            }
        };
        match p.target {
            Target::Bias if p.hiding != Hiding::NegInfBias => self.planted.biases.push((i, j)),
            _ => self.planted.keys.push(j),
        }
        match p.target {
            Target::K => poison(&mut self.k, d_k, p.whole_row),
            Target::V => poison(&mut self.v, d_v, p.whole_row),
            Target::KAndV => {
                poison(&mut self.k, d_k, p.whole_row);
                poison(&mut self.v, d_v, p.whole_row);
            }
            Target::Bias if p.hiding != Hiding::NegInfBias => {
                let m = self.additive.get_or_insert_with(|| Mat::zeros(n_q, n_k));
                m[(i, j)] = p.value.value();
            }
            Target::Bias => poison(&mut self.k, d_k, p.whole_row),
            Target::QOfEmptyRow => unreachable!("handled above"),
        }
    }
}

fn operand(rows: usize, cols: usize, fill: Fill, dtype: Dtype, rng: &mut Rng) -> Mat<f32> {
    let data: Vec<f32> = (0..rows * cols).map(|_| fill.sample(rng, dtype)).collect();
    Mat::from_fn(rows, cols, |i, j| data[i * cols + j])
}

fn build_bool(b: &BoolRecipe, n_q: usize, n_k: usize, seed: u64) -> (bool, Mat<bool>) {
    let mut rng = Rng::new(seed, 11);
    let hidden: Vec<bool> = (0..n_q)
        .map(|_| rng.chance(b.hidden_rows_percent))
        .collect();
    let bits = Mat::from_fn(n_q, n_k, |i, _| {
        let visible = !hidden[i] && rng.chance(b.visible_percent);
        visible == b.allow
    });
    (b.allow, bits)
}

fn build_bias(a: &BiasRecipe, n_q: usize, n_k: usize, seed: u64) -> Mat<f32> {
    let mut rng = Rng::new(seed, 12);
    let rows: Vec<(bool, bool)> = (0..n_q)
        .map(|_| (rng.chance(a.hidden_rows_percent), rng.chance(50)))
        .collect();
    Mat::from_fn(n_q, n_k, |i, _| {
        if rows[i].0 || rng.chance(a.neg_inf_percent) {
            f32::NEG_INFINITY
        } else {
            a.fill.sample(&mut rng, rows[i].1)
        }
    })
}

impl HostileHead {
    /// Builds the inputs (deterministic in the recipe).
    ///
    /// ```
    /// use attn_oracle::hostile::{hostile_head, Profile};
    /// use proptest::strategy::{Strategy, ValueTree};
    /// use proptest::test_runner::TestRunner;
    /// let case = hostile_head(Profile::Anything).new_tree(&mut TestRunner::deterministic()).unwrap().current();
    /// // Deterministic (compared through Debug: a NaN is not equal to itself).
    /// assert_eq!(format!("{:?}", case.build()), format!("{:?}", case.build()));
    /// ```
    pub fn build(&self) -> HostileInputs {
        let mut rng = Rng::new(self.seed, 1);
        let q = operand(self.n_q, self.d_k, self.qk, self.dtype, &mut rng);
        let mut k = operand(self.n_k, self.d_k, self.qk, self.dtype, &mut rng);
        let mut v = operand(self.n_k, self.d_v, self.v, self.dtype, &mut rng);
        if self.identical_keys && self.n_k > 0 {
            k = Mat::from_fn(self.n_k, self.d_k, |_, t| k[(0, t)]);
            v = Mat::from_fn(self.n_k, self.d_v, |_, t| v[(0, t)]);
        }
        let mut inputs = HostileInputs {
            q,
            k,
            v,
            scale: self.scale,
            causal: self.causal,
            window: self.window,
            key_len: self.key_len.map(|l| l.resolve(self.n_k)),
            bool_mask: self
                .bool_mask
                .map(|b| build_bool(&b, self.n_q, self.n_k, self.seed)),
            additive: self
                .additive
                .map(|a| build_bias(&a, self.n_q, self.n_k, self.seed)),
            views: self.views,
            dtype: self.dtype,
            planted: Planted::default(),
        };
        for p in &self.plants {
            inputs.plant(p);
        }
        inputs
    }
}

/// What a generated case stresses. Each profile is its own property in a suite, so that
/// one class of failure cannot hide another behind proptest's shrinking.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Profile {
    /// Moderate finite values, every mask kind, every view and storage type: the reference
    /// comparison at its tightest.
    Moderate,
    /// Moderate values with NaN, `±inf` and overflowing values planted at positions
    /// hidden in this way.
    Poison(Hiding),
    /// Biases at the finite extremes (`f32::MIN` padding, `±f32::MAX`, `±1e38`).
    ExtremeBias,
    /// Q and K at the finite extremes of the storage type (scores that overflow).
    ExtremeQk,
    /// V at the finite extremes of the storage type.
    ExtremeV,
    /// Window bounds up to `usize::MAX`, key lengths beyond `n_k`, both alignments.
    Windows,
    /// Scales at the extremes, valid and invalid.
    Scales,
    /// Everything at once, non-finite values anywhere: the call returns and keeps the
    /// contract where it promises anything.
    Anything,
}

fn length(max: usize) -> BoxedStrategy<usize> {
    let edges: Vec<usize> = [
        15, 16, 17, 31, 33, 63, 64, 65, 127, 128, 129, 257, 511, 513, 1025,
    ]
    .into_iter()
    .filter(|&n| n <= max)
    .collect();
    prop_oneof![3 => 0..=9usize, 2 => select(edges)].boxed()
}

fn width(zero: bool) -> BoxedStrategy<usize> {
    let lo = usize::from(!zero);
    prop_oneof![
        6 => lo..=8usize,
        1 => select(vec![16usize, 32, 33, 64, 65]),
    ]
    .boxed()
}

fn views() -> BoxedStrategy<[View; 3]> {
    let v = || select(View::ALL.to_vec());
    [v(), v(), v()].boxed()
}

fn dtypes() -> BoxedStrategy<Dtype> {
    prop_oneof![2 => Just(Dtype::F32), 1 => Just(Dtype::F16), 1 => Just(Dtype::Bf16)].boxed()
}

fn bool_recipe() -> BoxedStrategy<BoolRecipe> {
    (
        any::<bool>(),
        0u8..=100,
        prop_oneof![3 => Just(0u8), 1 => 0u8..=60],
    )
        .prop_map(|(allow, visible_percent, hidden_rows_percent)| BoolRecipe {
            allow,
            visible_percent,
            hidden_rows_percent,
        })
        .boxed()
}

fn bias_recipe(fills: Vec<BiasFill>) -> BoxedStrategy<BiasRecipe> {
    (
        select(fills),
        prop_oneof![2 => Just(0u8), 1 => 0u8..=70],
        prop_oneof![3 => Just(0u8), 1 => 0u8..=60],
    )
        .prop_map(|(fill, neg_inf_percent, hidden_rows_percent)| BiasRecipe {
            fill,
            neg_inf_percent,
            hidden_rows_percent,
        })
        .boxed()
}

fn key_len(invalid: bool) -> BoxedStrategy<Option<KeyLen>> {
    let valid = (0u16..=1000).prop_map(KeyLen::Permille);
    if invalid {
        proptest::option::weighted(
            0.5,
            prop_oneof![
                3 => valid,
                1 => any::<u8>().prop_map(KeyLen::Beyond),
                1 => Just(KeyLen::Max),
            ],
        )
        .boxed()
    } else {
        proptest::option::weighted(0.25, valid).boxed()
    }
}

fn plant(hidings: Vec<Hiding>, values: Vec<Special>) -> BoxedStrategy<Plant> {
    (
        select(hidings),
        select(vec![
            Target::K,
            Target::V,
            Target::KAndV,
            Target::Bias,
            Target::QOfEmptyRow,
        ]),
        select(values),
        any::<u32>(),
        any::<bool>(),
    )
        .prop_map(|(hiding, target, value, pick, whole_row)| Plant {
            hiding,
            target,
            value,
            pick,
            whole_row,
        })
        .boxed()
}

/// The generator of single-head hostile cases for `profile`.
pub fn hostile_head(profile: Profile) -> BoxedStrategy<HostileHead> {
    let moderate = || select(Fill::MODERATE.to_vec()).boxed();
    let moderate_bias = vec![BiasFill::Small, BiasFill::Zero, BiasFill::Large];
    let moderate_scales = vec![0.05f32, 0.5, 1.0, 2.0];
    let (qk, v, biases, scales, windows_extreme, lens_invalid, plants, d_k_zero) = match profile {
        Profile::Moderate => (
            moderate(),
            moderate(),
            moderate_bias,
            moderate_scales,
            false,
            false,
            None,
            false,
        ),
        Profile::Poison(h) => (
            moderate(),
            moderate(),
            moderate_bias,
            moderate_scales,
            false,
            false,
            Some((vec![h], Special::POISONS.to_vec())),
            false,
        ),
        Profile::ExtremeBias => (
            moderate(),
            moderate(),
            vec![BiasFill::Min, BiasFill::MinRows, BiasFill::Extreme],
            moderate_scales,
            false,
            false,
            None,
            false,
        ),
        Profile::ExtremeQk => (
            Just(Fill::Extreme).boxed(),
            moderate(),
            moderate_bias,
            vec![1.0, 1e-30, 0.5],
            false,
            false,
            None,
            false,
        ),
        Profile::ExtremeV => (
            moderate(),
            Just(Fill::Extreme).boxed(),
            moderate_bias,
            moderate_scales,
            false,
            false,
            None,
            false,
        ),
        Profile::Windows => (
            moderate(),
            moderate(),
            moderate_bias,
            moderate_scales,
            true,
            true,
            None,
            false,
        ),
        Profile::Scales => (
            moderate(),
            moderate(),
            moderate_bias,
            extreme_scales(),
            false,
            false,
            None,
            false,
        ),
        Profile::Anything => (
            select(vec![
                Fill::Unit,
                Fill::Extreme,
                Fill::NonFinite,
                Fill::Subnormal,
                Fill::Large,
            ])
            .boxed(),
            select(vec![Fill::Unit, Fill::Extreme, Fill::NonFinite, Fill::Ties]).boxed(),
            vec![
                BiasFill::Small,
                BiasFill::Min,
                BiasFill::MinRows,
                BiasFill::Extreme,
                BiasFill::NonFinite,
            ],
            extreme_scales(),
            true,
            true,
            Some((
                vec![Hiding::Structural, Hiding::NegInfBias, Hiding::BoolMask],
                Special::POISONS.to_vec(),
            )),
            true,
        ),
    };
    let side = move || {
        if windows_extreme {
            extreme_window_side()
        } else {
            moderate_window_side()
        }
    };
    let window_weight = if windows_extreme { 0.8 } else { 0.25 };
    let plants = match plants {
        Some((h, vals)) => proptest::collection::vec(plant(h, vals), 1..=3).boxed(),
        None => Just(Vec::new()).boxed(),
    };
    let scale_weight = if matches!(profile, Profile::Scales | Profile::ExtremeQk) {
        0.9
    } else {
        0.3
    };
    (
        (length(257), length(1025), width(d_k_zero), width(true)),
        (qk, v, prop_oneof![5 => Just(false), 1 => Just(true)]),
        (
            proptest::option::weighted(scale_weight, select(scales)),
            proptest::option::weighted(0.4, causal()),
            proptest::option::weighted(
                window_weight,
                (side(), side(), causal()).prop_map(|(l, r, a)| SlidingWindow::new(l, r, a)),
            ),
            key_len(lens_invalid),
        ),
        (
            proptest::option::weighted(0.3, bool_recipe()),
            proptest::option::weighted(0.45, bias_recipe(biases)),
            plants,
        ),
        (views(), dtypes(), any::<u64>()),
    )
        .prop_map(
            |(
                (n_q, n_k, d_k, d_v),
                (qk, v, identical_keys),
                (scale, causal, window, key_len),
                (bool_mask, additive, plants),
                (views, dtype, seed),
            )| {
                // Keep the reference and the engine fast: long keys only with short queries.
                let n_k = if n_q * n_k * (d_k + d_v) > 4_000_000 {
                    n_k.min(129)
                } else {
                    n_k
                };
                HostileHead {
                    n_q,
                    n_k,
                    d_k,
                    d_v,
                    qk,
                    v,
                    identical_keys,
                    scale,
                    causal,
                    window,
                    key_len,
                    bool_mask,
                    additive,
                    plants,
                    views,
                    dtype,
                    seed,
                }
            },
        )
        .boxed()
}

// ---------------------------------------------------------------------------------------
// The contract.

/// Whether key `j` is visible to query `i` under the structural constraints alone, by the
/// contract's formulas in exact (`i128`) arithmetic: `j < len`, causal `j ≤ i + offset`,
/// window `c − left ≤ j ≤ c + right` with `c = i + offset(align)`.
///
/// ```
/// use attn_core::{Causal, SlidingWindow};
/// use attn_oracle::hostile::structurally_visible;
/// // An unbounded-looking left side acts as no bound: plain causal.
/// let w = SlidingWindow::new(Some(usize::MAX), Some(0), Causal::TopLeft);
/// assert!(structurally_visible(None, Some(w), None, 4, 4, 3, 0));
/// assert!(!structurally_visible(None, Some(w), None, 4, 4, 0, 1));
/// ```
pub fn structurally_visible(
    causal: Option<Causal>,
    window: Option<SlidingWindow>,
    key_len: Option<usize>,
    n_q: usize,
    n_k: usize,
    i: usize,
    j: usize,
) -> bool {
    if j >= key_len.unwrap_or(n_k).min(n_k) {
        return false;
    }
    let (i, j) = (i as i128, j as i128);
    let offset = |c: Causal| match c {
        Causal::TopLeft => 0,
        Causal::BottomRight => n_k as i128 - n_q as i128,
    };
    if let Some(c) = causal
        && j > i + offset(c)
    {
        return false;
    }
    if let Some(w) = window {
        let c = i + offset(w.align);
        if w.left.is_some_and(|l| j < c - l as i128) || w.right.is_some_and(|r| j > c + r as i128) {
            return false;
        }
    }
    true
}

/// A reason the contract rejects a call, and how to recognise the error that says so.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rejection {
    /// The rule the input breaks (for reports).
    pub rule: &'static str,
    /// The error's message must mention one of these: the operand it names.
    pub names: &'static [&'static str],
    /// The `Debug` name of the [`Error`] variant the contract fixes for it, if it does.
    pub variant: Option<&'static str>,
}

impl Rejection {
    /// A rejection recognised by the operand its message names.
    pub const fn named(rule: &'static str, names: &'static [&'static str]) -> Self {
        Self {
            rule,
            names,
            variant: None,
        }
    }

    /// An output (or LSE, or cache) that cannot be allocated, or whose size overflows:
    /// `Error::Allocation`, naming the buffer.
    pub const fn allocation(names: &'static [&'static str]) -> Self {
        Self {
            rule: "a buffer that cannot be allocated is Error::Allocation",
            names,
            variant: Some("Allocation"),
        }
    }

    /// Whether `e` is this rejection: its message is non-empty and names the operand, and
    /// it is the fixed variant if there is one.
    ///
    /// ```
    /// use attn_core::Error;
    /// use attn_oracle::hostile::Rejection;
    /// let r = Rejection::named("n_k must match", &["V"]);
    /// assert!(r.accepts(&Error::mismatch("V", "rows", 3, "K", 4, "n_k must match")));
    /// assert!(!r.accepts(&Error::InvalidScale(0.0)));
    /// ```
    pub fn accepts(&self, e: &Error) -> bool {
        let message = e.to_string();
        if let Some(v) = self.variant {
            let debug = format!("{e:?}");
            if !debug.starts_with(v) {
                return false;
            }
        }
        !message.trim().is_empty() && names_operand(&message, self.names)
    }
}

/// Whether `message` mentions one of `names`: short names (`K`, `V`, `LSE`) as whole
/// words, case-sensitively; longer ones as case-insensitive substrings.
pub fn names_operand(message: &str, names: &[&str]) -> bool {
    let lower = message.to_lowercase();
    names.iter().any(|n| {
        if n.len() <= 3 && n.chars().all(char::is_alphanumeric) {
            message
                .split(|c: char| !(c.is_alphanumeric() || c == '_'))
                .any(|w| w == *n)
        } else {
            lower.contains(&n.to_lowercase())
        }
    })
}

fn rejected_by<'r>(rules: &'r [Rejection], e: &Error) -> Option<&'r Rejection> {
    rules.iter().find(|r| r.accepts(e))
}

/// What the contract says about a row of a valid call.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RowClass {
    /// No visible key: output exactly 0, LSE `-inf`.
    Empty,
    /// A non-finite value reaches the row (its Q row, a K or V row of a key it sees, a NaN
    /// bias of a key it sees): the contract promises nothing about it.
    Touched,
    /// Every input the row sees is finite (biases may be `+inf`, which saturates): its
    /// output is finite, in the hull of the values it sees, within the derived bound of the
    /// reference; its LSE is finite.
    Finite,
}

/// Which buffers an entry point allocates (decides when a huge shape must be an
/// allocation error).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Outputs {
    /// It allocates the `[n_q, d_v]` output.
    pub output: bool,
    /// It allocates the `n_q` LSEs.
    pub lse: bool,
}

impl Outputs {
    /// `attention`: the output only.
    pub const OUTPUT: Outputs = Outputs {
        output: true,
        lse: false,
    };
    /// `attention_with_lse`, `partial_attention`: output and LSE.
    pub const WITH_LSE: Outputs = Outputs {
        output: true,
        lse: true,
    };
    /// `attention_into`: nothing (the caller's buffers).
    pub const NONE: Outputs = Outputs {
        output: false,
        lse: false,
    };
}

/// The contract's answer for one head of a valid call.
#[derive(Debug, Clone)]
pub struct HeadExpectation {
    /// `[n_q, n_k, d_v]`.
    pub dims: [usize; 3],
    /// What each row must be.
    pub rows: Vec<RowClass>,
    /// Visibility (structure, boolean mask, additive `-inf`), `[n_q, n_k]`.
    pub visible: Mat<bool>,
    /// The reference on the sanitised problem (`None` when `n_q = 0`).
    pub reference: Option<Materialized>,
    /// The derived bound against it.
    pub bound: Option<HeadBound>,
    /// V, for the hull of each row.
    v: Mat<f32>,
    /// Unit roundoff of the engine's accumulation and of its output type, and the
    /// output type's underflow error.
    rounding: (f64, f64, f64),
    /// Rows where an f32 engine may saturate a score whose exact value fits: some partial
    /// product or sum of `scale·log2 e · q·k` of a visible key can overflow f32 (the
    /// contract lets engines disagree on which keys saturated). Such a row is still
    /// promised finite and inside its hull, but is not compared with the reference.
    pub may_saturate: Vec<bool>,
}

impl HeadExpectation {
    /// Gives up the promises about rows that see a planted poison (a key of
    /// `planted.keys`, or a bias of `planted.biases`, visible to them): properties about
    /// hidden poisons then judge only the rows the poison must not reach, and leave the
    /// rows that see it (a finite extreme is a legitimate visible value) to the profiles
    /// about extreme values.
    pub fn release(&mut self, planted: &Planted) {
        let [n_q, ..] = self.dims;
        for i in 0..n_q {
            let sees = planted.queries.contains(&i)
                || planted.keys.iter().any(|&j| self.visible[(i, j)])
                || planted
                    .biases
                    .iter()
                    .any(|&(r, j)| r == i && self.visible[(r, j)]);
            if sees && self.rows[i] != RowClass::Empty {
                self.rows[i] = RowClass::Touched;
            }
        }
    }
}

/// What a call must do.
#[derive(Debug, Clone)]
pub enum Expected {
    /// Fail with an error that one of these recognises.
    Reject(Vec<Rejection>),
    /// Succeed and obey `head`; an error is accepted only if one of `may_reject`
    /// recognises it (options the amendment lets an engine honour or reject).
    Accept {
        /// The answer.
        head: Box<HeadExpectation>,
        /// Errors accepted instead.
        may_reject: Vec<Rejection>,
    },
    /// A valid problem larger than [`MAX_WORK`]: a generator must not produce it for this
    /// entry point (it would compute for too long). Tests skip such a call.
    TooMuchWork,
}

impl Expected {
    /// Whether the call must fail.
    pub fn is_reject(&self) -> bool {
        matches!(self, Expected::Reject(_))
    }

    /// [`HeadExpectation::release`] on an accepted call; nothing otherwise.
    pub fn release(&mut self, planted: &Planted) {
        if let Expected::Accept { head, .. } = self {
            head.release(planted);
        }
    }

    /// The row classes of an accepted call.
    pub fn rows(&self) -> Option<&[RowClass]> {
        match self {
            Expected::Accept { head, .. } => Some(&head.rows),
            _ => None,
        }
    }
}

fn accumulation_roundoff(model: &ErrorModel) -> f64 {
    match model.compute {
        Compute::RoundedOnce => U64,
        Compute::F32 { .. } => U32,
    }
}

fn shape_rejections(q: [usize; 2], k: [usize; 2], v: [usize; 2], out: &mut Vec<Rejection>) {
    if k[1] != q[1] {
        out.push(Rejection::named("d_k must match", &["K", "Q"]));
    }
    if v[0] != k[0] {
        out.push(Rejection::named("n_k must match", &["V", "K"]));
    }
    if q[1] == 0 || k[1] == 0 {
        out.push(Rejection::named(
            "d_k must be at least 1",
            &["Q", "K", "d_k"],
        ));
    }
}

fn option_rejections(
    options: &Options<'_>,
    batch: usize,
    n_q: usize,
    n_k: usize,
    out: &mut Vec<Rejection>,
    may: &mut Vec<Rejection>,
) {
    if let Some(s) = options.scale
        && !scale_is_valid(s)
    {
        out.push(Rejection {
            rule: "the scale must be finite and positive, and scale·log2 e finite",
            names: &["scale"],
            variant: Some("InvalidScale"),
        });
    }
    if let Some(m) = options.bool_mask {
        let m = m.matrix();
        if (m.nrows(), m.ncols()) != (n_q, n_k) {
            out.push(Rejection::named(
                "the boolean mask is n_q × n_k",
                &["boolean mask", "mask"],
            ));
        }
    }
    if let Some(m) = options.additive_mask
        && (m.nrows(), m.ncols()) != (n_q, n_k)
    {
        out.push(Rejection::named(
            "the additive mask is n_q × n_k",
            &["additive mask", "mask"],
        ));
    }
    match options.key_padding {
        None => {}
        Some(KeyPadding::Uniform(l)) if l > n_k => {
            out.push(Rejection::named("key lengths are at most n_k", &["key"]));
        }
        Some(KeyPadding::Uniform(_)) => {}
        Some(KeyPadding::PerBatch(ls)) => {
            if ls.len() != batch {
                out.push(Rejection::named(
                    "one key length per batch entry",
                    &["key lengths", "key"],
                ));
            }
            if ls.iter().any(|&l| l > n_k) {
                out.push(Rejection::named("key lengths are at most n_k", &["key"]));
            }
        }
    }
    if let Some(w) = options.window
        && (huge_side(w.left) || huge_side(w.right))
    {
        may.push(Rejection::named(
            "a window bound beyond what the engine represents may be rejected",
            &["window"],
        ));
    }
}

/// The work of a problem, counting every row even when it sees no key (an engine writes
/// it, and the oracle classifies it).
fn work(rows: usize, n_k: usize, d_k: usize, d_v: usize) -> u128 {
    (rows as u128)
        .saturating_mul(n_k as u128 + 1)
        .saturating_mul(d_k as u128 + d_v as u128 + 1)
}

/// The product of `dims`: 0 if any is 0 (whatever the others), `None` if it overflows.
///
/// ```
/// use attn_oracle::hostile::product;
/// assert_eq!(product(&[usize::MAX, 2, 0]), Some(0));
/// assert_eq!(product(&[usize::MAX, 2]), None);
/// ```
pub fn product(dims: &[usize]) -> Option<usize> {
    if dims.contains(&0) {
        return Some(0);
    }
    dims.iter().try_fold(1usize, |a, &x| a.checked_mul(x))
}

/// The contract's answer for one head: `q : [n_q, d_k]`, `k : [n_k, d_k]`,
/// `v : [n_k, d_v]` (the values the engine stores, widened to f32) under `options`, for an
/// entry point that allocates `outputs`, with `merges` merges of partial states done by
/// the caller on top of the engine's own (0 for a single call).
///
/// Validation is the oracle's own, not attn-core's: it reads the operands' shapes and the
/// options and lists every rule they break.
pub fn expect_head(
    q: MatRef<'_, f32>,
    k: MatRef<'_, f32>,
    v: MatRef<'_, f32>,
    options: &Options<'_>,
    model: &ErrorModel,
    outputs: Outputs,
    merges: usize,
) -> Expected {
    let (n_q, d_k, n_k, d_v) = (q.nrows(), q.ncols(), k.nrows(), v.ncols());
    let mut reject = Vec::new();
    let mut may_reject = Vec::new();
    shape_rejections(
        [n_q, d_k],
        [k.nrows(), k.ncols()],
        [v.nrows(), d_v],
        &mut reject,
    );
    option_rejections(options, 1, n_q, n_k, &mut reject, &mut may_reject);
    if outputs.output && n_q.checked_mul(d_v).is_none_or(|n| n >= UNALLOCATABLE) {
        reject.push(Rejection::allocation(&["output"]));
    }
    if outputs.lse && n_q >= UNALLOCATABLE {
        reject.push(Rejection::allocation(&["LSE", "output"]));
    }
    if !reject.is_empty() {
        return Expected::Reject(reject);
    }
    if n_q > 0 && work(n_q, n_k, d_k, d_v) > MAX_WORK {
        return Expected::TooMuchWork;
    }
    let key_len = options.key_length(0);
    let (causal, window) = (options.causal, options.window);
    let allows = |i: usize, j: usize| options.bool_mask.is_none_or(|b| b.allows(i, j));
    let bias = |i: usize, j: usize| options.additive_mask.map_or(0.0, |m| m[(i, j)]);
    let visible = if n_q == 0 {
        Mat::<bool>::from_fn(0, 0, |_, _| false)
    } else {
        Mat::from_fn(n_q, n_k, |i, j| {
            structurally_visible(causal, window, key_len, n_q, n_k, i, j)
                && allows(i, j)
                && bias(i, j) != f32::NEG_INFINITY
        })
    };
    let finite_row = |m: MatRef<'_, f32>, r: usize| (0..m.ncols()).all(|c| m[(r, c)].is_finite());
    let rows: Vec<RowClass> = (0..n_q)
        .map(|i| {
            let seen: Vec<usize> = (0..n_k).filter(|&j| visible[(i, j)]).collect();
            if seen.is_empty() {
                RowClass::Empty
            } else if finite_row(q, i)
                && seen
                    .iter()
                    .all(|&j| finite_row(k, j) && finite_row(v, j) && !bias(i, j).is_nan())
            {
                RowClass::Finite
            } else {
                RowClass::Touched
            }
        })
        .collect();
    // Partial products and sums of a dot product are bounded by Σ|q_t·k_t|, and an engine
    // that folds `scale·log2 e` into Q or K scales single entries first.
    let may_saturate: Vec<bool> = if n_q == 0 {
        Vec::new()
    } else {
        let s2 = options.scale_for_f64(d_k).unwrap_or(1.0) * core::f64::consts::LOG2_E;
        let limit = f64::from(f32::MAX) / 2.0;
        let largest = |m: MatRef<'_, f32>, r: usize| {
            (0..m.ncols()).fold(0.0f64, |a, c| a.max(f64::from(m[(r, c)]).abs()))
        };
        (0..n_q)
            .map(|i| {
                let qi = largest(q, i);
                (0..n_k).filter(|&j| visible[(i, j)]).any(|j| {
                    let dot: f64 = (0..d_k)
                        .map(|t| (f64::from(q[(i, t)]) * f64::from(k[(j, t)])).abs())
                        .sum();
                    s2 * dot.max(qi).max(largest(k, j)) >= limit
                })
            })
            .collect()
    };
    let (reference, bound) = if n_q == 0 {
        (None, None)
    } else {
        let additive = options.additive_mask.map(|_| {
            Mat::from_fn(
                n_q,
                n_k,
                |i, j| if visible[(i, j)] { bias(i, j) } else { 0.0 },
            )
        });
        let mut sanitised = Options::default().with_bool_mask(BoolMask::allow(visible.as_ref()));
        if let Some(s) = options.scale {
            sanitised = sanitised.with_scale(s);
        }
        if let Some(a) = additive.as_ref() {
            sanitised = sanitised.with_additive_mask(a.as_ref());
        }
        let r = Attention::head(q, k, v, &sanitised)
            .and_then(|call| call.materialized())
            .expect("the sanitised problem is valid");
        let scale = sanitised
            .scale_for_f64(d_k)
            .expect("the scale was validated");
        let b = head_bound_merged(
            model,
            q,
            k,
            v,
            scale,
            additive.as_ref().map(|a| a.as_ref()),
            &r,
            merges,
        );
        (Some(r), Some(b))
    };
    Expected::Accept {
        head: Box::new(HeadExpectation {
            dims: [n_q, n_k, d_v],
            rows,
            visible,
            reference,
            bound,
            v: if n_q == 0 {
                Mat::zeros(0, 0)
            } else {
                v.to_owned()
            },
            rounding: (
                accumulation_roundoff(model),
                model.output.unit_roundoff(),
                model.output.underflow_error(),
            ),
            may_saturate,
        }),
        may_reject,
    }
}

/// Checks an error against what was expected.
pub fn check_error(expected: &Expected, e: &Error) -> Result<(), String> {
    match expected {
        Expected::Reject(rules) => match rejected_by(rules, e) {
            Some(_) => Ok(()),
            None => Err(format!(
                "the error `{e}` ({e:?}) does not say what is wrong: expected one naming {}",
                describe_rules(rules)
            )),
        },
        Expected::Accept { may_reject, .. } => match rejected_by(may_reject, e) {
            Some(_) => Ok(()),
            None => Err(format!("a valid call was rejected: `{e}` ({e:?})")),
        },
        Expected::TooMuchWork => Ok(()),
    }
}

fn describe_rules(rules: &[Rejection]) -> String {
    rules
        .iter()
        .map(|r| {
            format!(
                "{:?}{} ({})",
                r.names,
                r.variant.map(|v| format!(" as {v}")).unwrap_or_default(),
                r.rule
            )
        })
        .collect::<Vec<_>>()
        .join(" or ")
}

/// Checks what a call returned against what the contract says: an output `[n_q, d_v]`
/// widened to f32 and, if the entry point returns one, the LSE of each row.
pub fn check_head(
    expected: &Expected,
    got: Result<(MatRef<'_, f32>, Option<&[f32]>), Error>,
) -> Result<(), String> {
    match (expected, got) {
        (Expected::TooMuchWork, _) => Ok(()),
        (_, Err(e)) => check_error(expected, &e),
        (Expected::Reject(rules), Ok(_)) => Err(format!(
            "an invalid call succeeded: it breaks {}",
            rules.iter().map(|r| r.rule).collect::<Vec<_>>().join(", ")
        )),
        (Expected::Accept { head, .. }, Ok((o, lse))) => check_rows(head, o, lse),
    }
}

fn check_rows(h: &HeadExpectation, o: MatRef<'_, f32>, lse: Option<&[f32]>) -> Result<(), String> {
    let [n_q, n_k, d_v] = h.dims;
    if (o.nrows(), o.ncols()) != (n_q, d_v) {
        return Err(format!(
            "the output is {}×{} but must be {n_q}×{d_v}",
            o.nrows(),
            o.ncols()
        ));
    }
    if let Some(l) = lse
        && l.len() != n_q
    {
        return Err(format!("{} LSE values for {n_q} rows", l.len()));
    }
    let (u_acc, u_out, eta_out) = h.rounding;
    for (i, class) in h.rows.iter().enumerate() {
        match class {
            RowClass::Touched => {}
            RowClass::Empty => {
                if let Some(c) = (0..d_v).find(|&c| o[(i, c)] != 0.0) {
                    return Err(format!(
                        "row {i} sees no key, so its output must be exactly 0, but output[{i}, {c}] = {:e}",
                        o[(i, c)]
                    ));
                }
                if let Some(l) = lse
                    && l[i] != f32::NEG_INFINITY
                {
                    return Err(format!(
                        "row {i} sees no key, so its LSE must be -inf, not {:e}",
                        l[i]
                    ));
                }
            }
            RowClass::Finite => {
                let seen: Vec<usize> = (0..n_k).filter(|&j| h.visible[(i, j)]).collect();
                let r = h.reference.as_ref().expect("rows have a reference");
                let b = h.bound.as_ref().expect("rows have a bound");
                for c in 0..d_v {
                    let e = o[(i, c)];
                    if !e.is_finite() {
                        return Err(format!(
                            "row {i} sees only finite inputs ({} keys), so its output must be finite, \
                             but output[{i}, {c}] = {e:e} (reference {:e})",
                            seen.len(),
                            r.output[(i, c)]
                        ));
                    }
                    let (lo, hi, m) = seen.iter().fold(
                        (f64::INFINITY, f64::NEG_INFINITY, 0.0f64),
                        |(lo, hi, m), &j| {
                            let x = f64::from(h.v[(j, c)]);
                            (lo.min(x), hi.max(x), m.max(x.abs()))
                        },
                    );
                    // Every f32 product and sum of the accumulation may also lose up to half
                    // the smallest subnormal, whatever the magnitudes (subnormal values).
                    let eta_acc = (2.0 * n_k as f64 + 3.0) * 2f64.powi(-150);
                    let tol = SAFETY
                        * ((3.0 * gamma(2.0 * n_k as f64 + 2.0, u_acc) + u_out) * m
                            + eta_out
                            + eta_acc);
                    let e = f64::from(e);
                    if e < lo - tol || e > hi + tol {
                        return Err(format!(
                            "output[{i}, {c}] = {e:e} lies outside the hull [{lo:e}, {hi:e}] of the \
                             values row {i} sees (tolerance {tol:.3e}); reference {:e}",
                            r.output[(i, c)]
                        ));
                    }
                    let (x, bd) = (r.output[(i, c)], b.output[(i, c)]);
                    if !h.may_saturate[i] && x.is_finite() && bd.is_finite() && (e - x).abs() > bd {
                        return Err(format!(
                            "output[{i}, {c}] = {e:e} but the reference says {x:e}: |error| = {:.3e} \
                             exceeds the derived bound {bd:.3e}",
                            (e - x).abs()
                        ));
                    }
                }
                if let Some(l) = lse {
                    let e = l[i];
                    if !e.is_finite() {
                        return Err(format!(
                            "row {i} sees only finite inputs ({} keys), so its LSE must be finite, \
                             not {e:e} (reference {:e})",
                            seen.len(),
                            r.lse[i]
                        ));
                    }
                    let (x, bd) = (r.lse[i], b.lse[i]);
                    let e = f64::from(e);
                    if !h.may_saturate[i] && x.is_finite() && bd.is_finite() && (e - x).abs() > bd {
                        return Err(format!(
                            "LSE[{i}] = {e:e} but the reference says {x:e}: |error| = {:.3e} exceeds \
                             the derived bound {bd:.3e}",
                            (e - x).abs()
                        ));
                    }
                }
            }
        }
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------
// Batched recipes.

/// How a batched operand is laid out.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TensorView {
    /// Contiguous `[B,H,S,D]`.
    Bhsd,
    /// Contiguous `[B,S,H,D]`.
    Bshd,
    /// `[B,S,H,D]` with NaN gaps after every row and batch entry.
    Padded,
    /// Zero batch and head strides: every (batch, head) is the same matrix (and a zero
    /// sequence stride too when its rows are equal).
    Broadcast,
}

/// A batched operand, owned: its buffer (f32, already rounded to the storage type) and how
/// to view it.
#[derive(Debug, Clone, PartialEq)]
pub struct HostileTensor {
    /// The buffer (gaps hold NaN).
    pub data: Vec<f32>,
    /// `[batch, heads, seq, dim]`.
    pub dims: [usize; 4],
    /// Element strides of batch, head, seq.
    pub strides: [usize; 3],
}

impl HostileTensor {
    /// A tensor whose (batch, head) matrix is `head(b, h)`; with [`TensorView::Broadcast`]
    /// only `head(0, 0)` is stored.
    pub fn new(
        view: TensorView,
        dims: [usize; 4],
        mut head: impl FnMut(usize, usize) -> Mat<f32>,
    ) -> Self {
        let [b, h, s, d] = dims;
        if dims.contains(&0) {
            return Self {
                data: Vec::new(),
                dims,
                strides: attn_core::Layout::Bhsd.strides(dims),
            };
        }
        let strides = match view {
            TensorView::Bhsd => attn_core::Layout::Bhsd.strides(dims),
            TensorView::Bshd => attn_core::Layout::Bshd.strides(dims),
            TensorView::Padded => [s * h * (d + 3) + 5, d + 3, h * (d + 3)],
            TensorView::Broadcast => {
                let m = head(0, 0);
                let same = rows_equal(m.as_ref());
                let rows = if same { 1 } else { s };
                let data = (0..rows)
                    .flat_map(|i| (0..d).map(move |c| (i, c)))
                    .map(|(i, c)| m[(i, c)])
                    .collect();
                return Self {
                    data,
                    dims,
                    strides: [0, 0, if same { 0 } else { d }],
                };
            }
        };
        let len = (b - 1) * strides[0] + (h - 1) * strides[1] + (s - 1) * strides[2] + d;
        let mut data = vec![f32::NAN; len];
        for bi in 0..b {
            for hi in 0..h {
                let m = head(bi, hi);
                for si in 0..s {
                    for di in 0..d {
                        data[bi * strides[0] + hi * strides[1] + si * strides[2] + di] =
                            m[(si, di)];
                    }
                }
            }
        }
        Self {
            data,
            dims,
            strides,
        }
    }

    /// The view.
    pub fn view(&self) -> Tensor4Ref<'_, f32> {
        Tensor4Ref::new(&self.data, self.dims, self.strides).expect("built to fit")
    }

    /// The buffer converted to a storage type (same dims and strides).
    pub fn convert<T>(&self, convert: impl Fn(f32) -> T) -> Vec<T> {
        self.data.iter().map(|&x| convert(x)).collect()
    }
}

/// A defect of a batched call's operands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum BatchDefect {
    /// K and V have one batch entry more than Q.
    KvBatch,
    /// V has one head more than K.
    VHeads,
    /// `h_q` is not a multiple of `h_kv` (one query head more).
    Grouping,
    /// One per-batch key length too many.
    LensCount,
}

/// A batched, grouped-query hostile problem.
#[derive(Debug, Clone, PartialEq)]
pub struct HostileBatch {
    /// Batch entries.
    pub batch: usize,
    /// Key/value heads.
    pub h_kv: usize,
    /// Query heads per kv head.
    pub group: usize,
    /// Per-head shape, values, options and plants (its key length applies to every entry
    /// unless `key_lens` is set).
    pub head: HostileHead,
    /// Layouts of Q, K, V.
    pub layouts: [TensorView; 3],
    /// Per-batch key lengths.
    pub key_lens: Option<Vec<KeyLen>>,
    /// A defect, if any.
    pub defect: Option<BatchDefect>,
}

/// The inputs of a [`HostileBatch`].
#[derive(Debug, Clone, PartialEq)]
pub struct HostileBatchInputs {
    /// `[batch, h_q, n_q, d_k]`.
    pub q: HostileTensor,
    /// `[batch, h_kv, n_k, d_k]`.
    pub k: HostileTensor,
    /// `[batch, h_kv, n_k, d_v]`.
    pub v: HostileTensor,
    /// The masks and scalar options (its `q`, `k`, `v` are head (0, 0)'s).
    pub head: HostileInputs,
    /// Per-batch key lengths.
    pub key_lens: Option<Vec<usize>>,
}

impl HostileBatchInputs {
    /// The options of the call.
    pub fn options(&self) -> Options<'_> {
        let h = &self.head;
        let padding = match &self.key_lens {
            Some(ls) => Some(KeyPadding::PerBatch(ls.as_slice())),
            None => h.key_len.map(KeyPadding::Uniform),
        };
        options_of(
            h.scale,
            h.causal,
            h.window,
            padding,
            h.bool_mask.as_ref(),
            h.additive.as_ref(),
        )
    }
}

impl HostileBatch {
    /// Builds the inputs: head `(b, h)` of Q and `(b, kv)` of K/V are built from the head
    /// recipe with their own seeds (the same for every head under a broadcast layout), and
    /// the head recipe's plants are applied to each.
    pub fn build(&self) -> HostileBatchInputs {
        let h = &self.head;
        let base = h.build();
        let h_q = self.h_kv * self.group + usize::from(self.defect == Some(BatchDefect::Grouping));
        let kv_batch = self.batch + usize::from(self.defect == Some(BatchDefect::KvBatch));
        let v_heads = self.h_kv + usize::from(self.defect == Some(BatchDefect::VHeads));
        let head_of = |layout: TensorView, b: usize, hh: usize| -> HostileInputs {
            let (b, hh) = if layout == TensorView::Broadcast {
                (0, 0)
            } else {
                (b, hh)
            };
            let mut r = h.clone();
            r.seed = h.seed ^ ((b as u64) << 32 | hh as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
            r.build()
        };
        let q = HostileTensor::new(self.layouts[0], [self.batch, h_q, h.n_q, h.d_k], |b, hh| {
            head_of(self.layouts[0], b, hh).q
        });
        let k = HostileTensor::new(
            self.layouts[1],
            [kv_batch, self.h_kv, h.n_k, h.d_k],
            |b, hh| head_of(self.layouts[1], b, hh).k,
        );
        let v = HostileTensor::new(
            self.layouts[2],
            [kv_batch, v_heads, h.n_k, h.d_v],
            |b, hh| head_of(self.layouts[2], b, hh).v,
        );
        let mut key_lens: Option<Vec<usize>> = self
            .key_lens
            .as_ref()
            .map(|ls| ls.iter().map(|l| l.resolve(h.n_k)).collect());
        if self.defect == Some(BatchDefect::LensCount) {
            key_lens
                .get_or_insert_with(|| vec![h.n_k; self.batch])
                .push(h.n_k);
        }
        HostileBatchInputs {
            q,
            k,
            v,
            head: base,
            key_lens,
        }
    }
}

/// The generator of batched hostile cases for `profile` (the head part as
/// [`hostile_head`], shorter).
pub fn hostile_batch(profile: Profile) -> BoxedStrategy<HostileBatch> {
    let layout = || {
        select(vec![
            TensorView::Bhsd,
            TensorView::Bshd,
            TensorView::Padded,
            TensorView::Broadcast,
        ])
    };
    let defects = profile == Profile::Anything;
    (
        0..=3usize,
        prop_oneof![6 => 1..=2usize, 1 => Just(0usize)],
        1..=3usize,
        hostile_head(profile).prop_map(|mut h| {
            h.n_q = h.n_q.min(65);
            h.n_k = h.n_k.min(129);
            h
        }),
        [layout(), layout(), layout()],
        proptest::option::weighted(
            0.35,
            proptest::collection::vec(
                prop_oneof![
                    6 => (0u16..=1000).prop_map(KeyLen::Permille),
                    1 => any::<u8>().prop_map(KeyLen::Beyond),
                ],
                3,
            ),
        ),
        if defects {
            proptest::option::weighted(
                0.3,
                select(vec![
                    BatchDefect::KvBatch,
                    BatchDefect::VHeads,
                    BatchDefect::Grouping,
                    BatchDefect::LensCount,
                ]),
            )
            .boxed()
        } else {
            Just(None).boxed()
        },
    )
        .prop_map(move |(batch, h_kv, group, head, layouts, lens, defect)| {
            let invalid_lens = defects || profile == Profile::Windows;
            HostileBatch {
                batch,
                h_kv,
                group,
                head,
                layouts,
                key_lens: lens.map(|mut l| {
                    l.truncate(batch);
                    if !invalid_lens {
                        for x in &mut l {
                            if let KeyLen::Beyond(_) = x {
                                *x = KeyLen::Permille(1000);
                            }
                        }
                    }
                    l
                }),
                defect,
            }
        })
        .boxed()
}

/// What a batched call must do: the errors it must fail with, or the checks of each head.
#[derive(Debug, Clone)]
pub enum BatchExpected {
    /// Fail with an error that one of these recognises.
    Reject(Vec<Rejection>),
    /// Succeed with `[batch, h_q, n_q, d_v]` (each head checked by [`check_batched`]); an
    /// error is accepted only if one of `may_reject` recognises it.
    Accept {
        /// `[batch, h_q, n_q, d_v]`.
        dims: [usize; 4],
        /// Errors accepted instead.
        may_reject: Vec<Rejection>,
    },
    /// A valid problem larger than [`MAX_WORK`]: not to be run.
    TooMuchWork,
}

/// Validates a batched call by the contract's rules (the oracle's own): `q : [batch, h_q,
/// n_q, d_k]`, `k : [batch, h_kv, n_k, d_k]`, `v : [batch, h_kv, n_k, d_v]`, for an entry
/// point that allocates `outputs`.
pub fn expect_batched(
    q: [usize; 4],
    k: [usize; 4],
    v: [usize; 4],
    options: &Options<'_>,
    outputs: Outputs,
) -> BatchExpected {
    let ([b, h_q, n_q, d_k], [bk, h_kv, n_k, dk], [bv, hv, nv, d_v]) = (q, k, v);
    let mut reject = Vec::new();
    let mut may_reject = Vec::new();
    if bk != b {
        reject.push(Rejection::named("batch must match", &["K"]));
    }
    if bv != b {
        reject.push(Rejection::named("batch must match", &["V"]));
    }
    if hv != h_kv {
        reject.push(Rejection::named("K and V share their heads", &["V", "K"]));
    }
    shape_rejections([n_q, d_k], [n_k, dk], [nv, d_v], &mut reject);
    if (h_kv == 0 && h_q != 0) || (h_kv != 0 && !h_q.is_multiple_of(h_kv)) {
        reject.push(Rejection::named(
            "h_q is a multiple of h_kv",
            &["heads", "head", "K/V"],
        ));
    }
    option_rejections(options, b, n_q, n_k, &mut reject, &mut may_reject);
    let rows = product(&[b, h_q, n_q]);
    let elems = product(&[b, h_q, n_q, d_v]);
    if outputs.output && elems.is_none_or(|e| e >= UNALLOCATABLE) {
        reject.push(Rejection::allocation(&["output", "tensor"]));
    }
    if outputs.lse && rows.is_none_or(|r| r >= UNALLOCATABLE) {
        reject.push(Rejection::allocation(&["LSE", "output"]));
    }
    let Some(rows) = rows else {
        reject.push(Rejection::allocation(&["output", "LSE", "rows"]));
        return BatchExpected::Reject(reject);
    };
    if !reject.is_empty() {
        return BatchExpected::Reject(reject);
    }
    if rows > 0 && work(rows, n_k, d_k, d_v) > MAX_WORK {
        return BatchExpected::TooMuchWork;
    }
    BatchExpected::Accept {
        dims: [b, h_q, n_q, d_v],
        may_reject,
    }
}

/// Checks a batched result: the output `[batch, h_q, n_q, d_v]` (widened to f32) and, if
/// returned, the LSE in `[batch][h_q][n_q]` order, head by head against [`expect_head`]
/// (query head `h` reads kv head `h / (h_q / h_kv)`, entry `b` its own key length).
pub fn check_batched(
    expected: &BatchExpected,
    inputs: [Tensor4Ref<'_, f32>; 3],
    options: &Options<'_>,
    model: &ErrorModel,
    got: Result<(Tensor4Ref<'_, f32>, Option<&[f32]>), Error>,
) -> Result<(), String> {
    check_batched_released(expected, inputs, options, model, &Planted::default(), got)
}

/// [`check_batched`] with the promises about rows that see `planted` given up in every
/// head ([`HeadExpectation::release`]).
pub fn check_batched_released(
    expected: &BatchExpected,
    inputs: [Tensor4Ref<'_, f32>; 3],
    options: &Options<'_>,
    model: &ErrorModel,
    planted: &Planted,
    got: Result<(Tensor4Ref<'_, f32>, Option<&[f32]>), Error>,
) -> Result<(), String> {
    let (dims, (out, lse)) = match (expected, got) {
        (BatchExpected::TooMuchWork, _) => return Ok(()),
        (BatchExpected::Reject(rules), Err(e)) => {
            return check_error(&Expected::Reject(rules.clone()), &e);
        }
        (BatchExpected::Reject(rules), Ok(_)) => {
            return Err(format!(
                "an invalid batched call succeeded: it breaks {}",
                rules.iter().map(|r| r.rule).collect::<Vec<_>>().join(", ")
            ));
        }
        (BatchExpected::Accept { may_reject, .. }, Err(e)) => {
            return match rejected_by(may_reject, &e) {
                Some(_) => Ok(()),
                None => Err(format!("a valid batched call was rejected: `{e}` ({e:?})")),
            };
        }
        (BatchExpected::Accept { dims, .. }, Ok(got)) => (*dims, got),
    };
    let [b, h_q, n_q, _] = dims;
    if out.dims() != dims {
        return Err(format!(
            "the output has dims {:?} but must be {dims:?}",
            out.dims()
        ));
    }
    let rows = product(&[b, h_q, n_q]).expect("accepted calls have a row count");
    if let Some(l) = lse
        && l.len() != rows
    {
        return Err(format!("{} LSE values for {rows} rows", l.len()));
    }
    if rows == 0 {
        return Ok(());
    }
    let [q, k, v] = inputs;
    let h_kv = k.dims()[1];
    let group = h_q / h_kv.max(1);
    for bi in 0..b {
        let mut opts = *options;
        opts.key_padding = options.key_length(bi).map(KeyPadding::Uniform);
        for h in 0..h_q {
            let kv = h / group.max(1);
            let (qh, kh, vh) = (head_of(q, bi, h), head_of(k, bi, kv), head_of(v, bi, kv));
            let mut want = expect_head(qh, kh, vh, &opts, model, Outputs::NONE, 0);
            want.release(planted);
            let o = out.head(bi, h).map_err(|e| e.to_string())?;
            let row = (bi * h_q + h) * n_q;
            let l = lse.map(|l| &l[row..row + n_q]);
            check_head(&want, Ok((o, l)))
                .map_err(|m| format!("batch entry {bi}, head {h}: {m}"))?;
        }
    }
    Ok(())
}

fn head_of<'a>(t: Tensor4Ref<'a, f32>, b: usize, h: usize) -> MatRef<'a, f32> {
    t.head(b, h).expect("validated dims")
}

// ---------------------------------------------------------------------------------------
// The backward pass.

/// What the contract says about one head's gradients in a valid backward call
/// (`docs/conventions.md`, "The backward pass").
///
/// A row of dQ depends on its own Q, dO, O and LSE rows and on the K and V rows (and
/// biases) of the keys it sees; a row of dK or dV on its own K and V rows and on the Q,
/// dO, O and LSE rows (and biases) of the queries that see it. Nothing else reaches it: a
/// poison at a hidden key, or in a row that sees nothing, reaches no gradient row.
#[derive(Debug, Clone)]
pub struct GradExpectation {
    /// `[n_q, n_k, d_k, d_v]`.
    pub dims: [usize; 4],
    /// What each row of dQ must be: [`RowClass::Empty`] (sees no key) exactly 0,
    /// [`RowClass::Finite`] finite (and within the bound where compared).
    pub dq_rows: Vec<RowClass>,
    /// What each row of dK and dV must be: [`RowClass::Empty`] (no query sees the key)
    /// exactly 0, [`RowClass::Finite`] finite (and within the bound where compared).
    pub key_rows: Vec<RowClass>,
    /// Visibility, `[n_q, n_k]`.
    pub visible: Mat<bool>,
    /// The reference's gradients on the sanitised problem (when the forward's own output
    /// and LSE were given and `n_q > 0`).
    pub reference: Option<MaterializedBackward>,
    /// The derived bound against it.
    pub bound: Option<GradientBound>,
    /// Rows of dQ compared with the reference (not where a score may saturate).
    pub compare_dq: Vec<bool>,
    /// Rows of dK, dV compared with the reference (no row that sees the key may saturate).
    pub compare_keys: Vec<bool>,
}

impl GradExpectation {
    /// Gives up the promises about gradient rows that a planted value may reach (a finite
    /// extreme is a legitimate visible value): dQ rows that see a planted key or bias,
    /// dK/dV rows of planted keys that a row sees, and of keys that such a row sees (its
    /// output and LSE carry the poison).
    pub fn release(&mut self, planted: &Planted) {
        let [n_q, n_k, ..] = self.dims;
        let mut touched_rows = vec![false; n_q];
        for (i, t) in touched_rows.iter_mut().enumerate() {
            *t = planted
                .keys
                .iter()
                .any(|&j| j < n_k && self.visible[(i, j)])
                || planted
                    .biases
                    .iter()
                    .any(|&(r, j)| r == i && j < n_k && self.visible[(r, j)]);
            if *t && self.dq_rows[i] != RowClass::Empty {
                self.dq_rows[i] = RowClass::Touched;
            }
        }
        for j in 0..n_k {
            let reached = (0..n_q).any(|i| {
                self.visible[(i, j)]
                    && (touched_rows[i]
                        || planted.keys.contains(&j)
                        || planted.queries.contains(&i))
            });
            if reached && self.key_rows[j] != RowClass::Empty {
                self.key_rows[j] = RowClass::Touched;
            }
        }
    }
}

/// What a backward call must do.
#[derive(Debug, Clone)]
pub enum GradExpected {
    /// Fail with an error that one of these recognises.
    Reject(Vec<Rejection>),
    /// Succeed and obey `grads`; an error is accepted only if one of `may_reject`
    /// recognises it.
    Accept {
        /// The answer.
        grads: Box<GradExpectation>,
        /// Errors accepted instead.
        may_reject: Vec<Rejection>,
    },
    /// A valid problem larger than [`MAX_WORK`]: not to be run.
    TooMuchWork,
}

impl GradExpected {
    /// [`GradExpectation::release`] on an accepted call; nothing otherwise.
    pub fn release(&mut self, planted: &Planted) {
        if let GradExpected::Accept { grads, .. } = self {
            grads.release(planted);
        }
    }

    /// The same call seen as a forward expectation, for [`check_error`].
    fn as_forward(&self) -> Expected {
        match self {
            GradExpected::Reject(r) => Expected::Reject(r.clone()),
            // An accepted call: any error is judged against `may_reject` only.
            GradExpected::Accept { may_reject, .. } => Expected::Reject(may_reject.clone()),
            GradExpected::TooMuchWork => Expected::TooMuchWork,
        }
    }
}

/// The rules of the backward's own operands: `grad_out` and `out` are `[n_q, d_v]`, one
/// LSE per query row.
fn backward_rejections(
    n_q: usize,
    d_v: usize,
    grad_out: [usize; 2],
    out: [usize; 2],
    lse_len: usize,
    reject: &mut Vec<Rejection>,
) {
    if grad_out != [n_q, d_v] {
        reject.push(Rejection::named("dO is n_q × d_v", &["grad_out"]));
    }
    if out != [n_q, d_v] {
        reject.push(Rejection::named("the output is n_q × d_v", &["output"]));
    }
    if lse_len != n_q {
        reject.push(Rejection::named("one LSE per query row", &["LSE"]));
    }
}

/// The gradient buffers an allocating backward entry point must refuse
/// (`Error::Allocation`): `[(name, rows, cols)]`, refused at [`UNALLOCATABLE`] elements or
/// when the size overflows.
fn gradient_allocations(
    bufs: &[(&'static [&'static str], Option<usize>)],
    out: &mut Vec<Rejection>,
) {
    for &(names, n) in bufs {
        if n.is_none_or(|n| n >= UNALLOCATABLE) {
            out.push(Rejection::allocation(names));
        }
    }
}

/// The contract's answer for one head's backward call: `q : [n_q, d_k]`, `k : [n_k, d_k]`,
/// `v : [n_k, d_v]`, the upstream gradient `grad_out`, the forward's `out` and `lse` as
/// given (all widened to f32), under `options`, for an entry point that allocates its
/// gradients or not (`allocates`).
///
/// `forward_given`: `out` and `lse` are the engine's own forward result on these inputs.
/// Then a gradient row whose inputs are finite is promised finite and compared with the
/// f64 reference within [`crate::bound::head_backward_bound`]; otherwise (arbitrary `out`
/// and `lse`) only the rows that see nothing are promised (exactly 0).
#[allow(clippy::too_many_arguments)]
pub fn expect_head_backward(
    q: MatRef<'_, f32>,
    k: MatRef<'_, f32>,
    v: MatRef<'_, f32>,
    grad_out: MatRef<'_, f32>,
    out: MatRef<'_, f32>,
    lse: &[f32],
    options: &Options<'_>,
    model: &ErrorModel,
    allocates: bool,
    forward_given: bool,
) -> GradExpected {
    let (n_q, d_k, n_k, d_v) = (q.nrows(), q.ncols(), k.nrows(), v.ncols());
    let mut reject = Vec::new();
    backward_rejections(
        n_q,
        d_v,
        [grad_out.nrows(), grad_out.ncols()],
        [out.nrows(), out.ncols()],
        lse.len(),
        &mut reject,
    );
    if allocates {
        gradient_allocations(
            &[
                (&["dQ"], n_q.checked_mul(d_k)),
                (&["dK"], k.nrows().checked_mul(k.ncols())),
                (&["dV"], v.nrows().checked_mul(d_v)),
            ],
            &mut reject,
        );
    }
    let (head, may_reject) = match expect_head(q, k, v, options, model, Outputs::NONE, 0) {
        Expected::Reject(r) => {
            reject.extend(r);
            return GradExpected::Reject(reject);
        }
        Expected::TooMuchWork if reject.is_empty() => return GradExpected::TooMuchWork,
        Expected::TooMuchWork => return GradExpected::Reject(reject),
        Expected::Accept { head, may_reject } => (head, may_reject),
    };
    if !reject.is_empty() {
        reject.extend(may_reject);
        return GradExpected::Reject(reject);
    }
    let visible = head.visible;
    let finite_row = |m: MatRef<'_, f32>, r: usize| (0..m.ncols()).all(|c| m[(r, c)].is_finite());
    let bias = |i: usize, j: usize| options.additive_mask.map_or(0.0, |m| m[(i, j)]);
    let row_ok: Vec<bool> = (0..n_q)
        .map(|i| {
            forward_given
                && finite_row(q, i)
                && finite_row(grad_out, i)
                && finite_row(out, i)
                && lse[i].is_finite()
        })
        .collect();
    let key_ok: Vec<bool> = (0..n_k)
        .map(|j| forward_given && finite_row(k, j) && finite_row(v, j))
        .collect();
    let dq_rows: Vec<RowClass> = (0..n_q)
        .map(|i| {
            let seen: Vec<usize> = (0..n_k).filter(|&j| visible[(i, j)]).collect();
            if seen.is_empty() {
                RowClass::Empty
            } else if row_ok[i] && seen.iter().all(|&j| key_ok[j] && !bias(i, j).is_nan()) {
                RowClass::Finite
            } else {
                RowClass::Touched
            }
        })
        .collect();
    let key_rows: Vec<RowClass> = (0..n_k)
        .map(|j| {
            let seers: Vec<usize> = (0..n_q).filter(|&i| visible[(i, j)]).collect();
            if seers.is_empty() {
                RowClass::Empty
            } else if key_ok[j] && seers.iter().all(|&i| row_ok[i] && !bias(i, j).is_nan()) {
                RowClass::Finite
            } else {
                RowClass::Touched
            }
        })
        .collect();
    let compare_dq = head.may_saturate.iter().map(|s| !s).collect();
    let compare_keys = (0..n_k)
        .map(|j| (0..n_q).all(|i| !visible[(i, j)] || !head.may_saturate[i]))
        .collect();
    let (reference, bound) = if forward_given && n_q > 0 {
        let additive = options.additive_mask.map(|_| {
            Mat::from_fn(
                n_q,
                n_k,
                |i, j| if visible[(i, j)] { bias(i, j) } else { 0.0 },
            )
        });
        let mut sanitised = Options::default().with_bool_mask(BoolMask::allow(visible.as_ref()));
        if let Some(s) = options.scale {
            sanitised = sanitised.with_scale(s);
        }
        if let Some(a) = additive.as_ref() {
            sanitised = sanitised.with_additive_mask(a.as_ref());
        }
        let r = Attention::head(q, k, v, &sanitised)
            .and_then(|call| call.backward_materialized(grad_out))
            .expect("the sanitised problem is valid");
        let scale = sanitised
            .scale_for_f64(d_k)
            .expect("the scale was validated");
        let b = head_backward_bound(
            model,
            q,
            k,
            v,
            grad_out,
            scale,
            additive.as_ref().map(|a| a.as_ref()),
            &r,
        );
        (Some(r), Some(b))
    } else {
        (None, None)
    };
    GradExpected::Accept {
        grads: Box::new(GradExpectation {
            dims: [n_q, n_k, d_k, d_v],
            dq_rows,
            key_rows,
            visible,
            reference,
            bound,
            compare_dq,
            compare_keys,
        }),
        may_reject,
    }
}

/// Checks one gradient, row by row: `Empty` rows exactly 0, `Finite` rows finite and, where
/// `x` and `bd` are given and `compare[r]`, within `bd` of `x`.
fn check_gradient(
    name: &str,
    e: MatRef<'_, f32>,
    rows: &[RowClass],
    shape: [usize; 2],
    reference: Option<(MatRef<'_, f64>, MatRef<'_, f64>)>,
    compare: &[bool],
) -> Result<(), String> {
    if [e.nrows(), e.ncols()] != shape {
        return Err(format!(
            "{name} is {}×{} but must be {}×{} (the shape of its operand)",
            e.nrows(),
            e.ncols(),
            shape[0],
            shape[1]
        ));
    }
    for (r, class) in rows.iter().enumerate() {
        for c in 0..shape[1] {
            let g = e[(r, c)];
            match class {
                RowClass::Touched => {}
                RowClass::Empty => {
                    if g != 0.0 {
                        return Err(format!(
                            "{name} row {r} is reached by nothing (no visible key/query), so it must be \
                             exactly 0, but {name}[{r}, {c}] = {g:e}"
                        ));
                    }
                }
                RowClass::Finite => {
                    if !g.is_finite() {
                        return Err(format!(
                            "{name} row {r} is reached only by finite inputs, so it must be finite, \
                             but {name}[{r}, {c}] = {g:e}{}",
                            reference.map_or(String::new(), |(x, _)| format!(
                                " (reference {:e})",
                                x[(r, c)]
                            ))
                        ));
                    }
                    if let Some((x, bd)) = reference
                        && compare[r]
                    {
                        let (x, bd) = (x[(r, c)], bd[(r, c)]);
                        let err = (f64::from(g) - x).abs();
                        if x.is_finite() && bd.is_finite() && err > bd {
                            return Err(format!(
                                "{name}[{r}, {c}] = {g:e} but the reference says {x:e}: |error| = \
                                 {err:.3e} exceeds the derived bound {bd:.3e}"
                            ));
                        }
                    }
                }
            }
        }
    }
    Ok(())
}

/// Checks what a single-head backward call returned (`dq`, `dk`, `dv` widened to f32)
/// against [`expect_head_backward`].
pub fn check_head_backward(
    expected: &GradExpected,
    got: Result<[MatRef<'_, f32>; 3], Error>,
) -> Result<(), String> {
    match (expected, got) {
        (GradExpected::TooMuchWork, _) => Ok(()),
        (_, Err(e)) => check_error(&expected.as_forward(), &e).map_err(|m| {
            if matches!(expected, GradExpected::Accept { .. }) {
                format!("a valid backward call was rejected: `{e}` ({e:?}) [{m}]")
            } else {
                m
            }
        }),
        (GradExpected::Reject(rules), Ok(_)) => Err(format!(
            "an invalid backward call succeeded: it breaks {}",
            rules.iter().map(|r| r.rule).collect::<Vec<_>>().join(", ")
        )),
        (GradExpected::Accept { grads, .. }, Ok([dq, dk, dv])) => {
            let g = grads;
            let [n_q, n_k, d_k, d_v] = g.dims;
            let r = g.reference.as_ref().zip(g.bound.as_ref());
            check_gradient(
                "dQ",
                dq,
                &g.dq_rows,
                [n_q, d_k],
                r.map(|(r, b)| (r.dq.as_ref(), b.dq.as_ref())),
                &g.compare_dq,
            )?;
            check_gradient(
                "dK",
                dk,
                &g.key_rows,
                [n_k, d_k],
                r.map(|(r, b)| (r.dk.as_ref(), b.dk.as_ref())),
                &g.compare_keys,
            )?;
            check_gradient(
                "dV",
                dv,
                &g.key_rows,
                [n_k, d_v],
                r.map(|(r, b)| (r.dv.as_ref(), b.dv.as_ref())),
                &g.compare_keys,
            )
        }
    }
}

/// Validates a batched backward call by the contract's rules: the forward's rules
/// ([`expect_batched`]), `grad_out` and `out` of dims `[batch, h_q, n_q, d_v]`,
/// `lse_len = batch·h_q·n_q`, and, for an entry point that allocates its gradients
/// (`allocates`), dQ, dK, dV of the operands' dims that fit.
#[allow(clippy::too_many_arguments)]
pub fn expect_batched_backward(
    q: [usize; 4],
    k: [usize; 4],
    v: [usize; 4],
    grad_out: [usize; 4],
    out: [usize; 4],
    lse_len: usize,
    options: &Options<'_>,
    allocates: bool,
) -> BatchExpected {
    let mut reject = Vec::new();
    let want = [q[0], q[1], q[2], v[3]];
    if grad_out != want {
        reject.push(Rejection::named("dO has the output's dims", &["grad_out"]));
    }
    if out != want {
        reject.push(Rejection::named(
            "the output has dims [batch, h_q, n_q, d_v]",
            &["output"],
        ));
    }
    if product(&q[..3]) != Some(lse_len) {
        reject.push(Rejection::named("one LSE per query row", &["LSE"]));
    }
    if allocates {
        gradient_allocations(
            &[
                (&["dQ"], product(&q)),
                (&["dK"], product(&k)),
                (&["dV"], product(&v)),
            ],
            &mut reject,
        );
    }
    match expect_batched(q, k, v, options, Outputs::NONE) {
        BatchExpected::Reject(r) => {
            reject.extend(r);
            BatchExpected::Reject(reject)
        }
        _ if !reject.is_empty() => BatchExpected::Reject(reject),
        e => e,
    }
}

/// Checks what a batched backward call returned (`dq`, `dk`, `dv` widened to f32) head by
/// head against [`expect_head_backward`] on the call's inputs (`[q, k, v, grad_out, out]`
/// widened to f32, `lse` in `[batch][h_q][n_q]` order): dQ per query head, dK and dV per kv
/// head as the sum over its group (`Empty` where no head's row sees the key, compared with
/// the sum of the references within the sum of the bounds and the rounding of the sum),
/// with the promises about what `planted` reaches given up.
#[allow(clippy::too_many_arguments)]
pub fn check_batched_backward(
    expected: &BatchExpected,
    inputs: [Tensor4Ref<'_, f32>; 5],
    lse: &[f32],
    options: &Options<'_>,
    model: &ErrorModel,
    forward_given: bool,
    planted: &Planted,
    got: Result<[Tensor4Ref<'_, f32>; 3], Error>,
) -> Result<(), String> {
    let [dq, dk, dv] = match (expected, got) {
        (BatchExpected::TooMuchWork, _) => return Ok(()),
        (BatchExpected::Reject(rules), Err(e)) => {
            return check_error(&Expected::Reject(rules.clone()), &e);
        }
        (BatchExpected::Reject(rules), Ok(_)) => {
            return Err(format!(
                "an invalid batched backward call succeeded: it breaks {}",
                rules.iter().map(|r| r.rule).collect::<Vec<_>>().join(", ")
            ));
        }
        (BatchExpected::Accept { may_reject, .. }, Err(e)) => {
            return match rejected_by(may_reject, &e) {
                Some(_) => Ok(()),
                None => Err(format!(
                    "a valid batched backward call was rejected: `{e}` ({e:?})"
                )),
            };
        }
        (BatchExpected::Accept { .. }, Ok(got)) => got,
    };
    let [q, k, v, grad_out, out] = inputs;
    for (name, got, want) in [
        ("dQ", dq.dims(), q.dims()),
        ("dK", dk.dims(), k.dims()),
        ("dV", dv.dims(), v.dims()),
    ] {
        if got != want {
            return Err(format!("{name} has dims {got:?} but its operand {want:?}"));
        }
    }
    let [b, h_q, n_q, _] = q.dims();
    let [_, h_kv, n_k, d_v] = v.dims();
    let d_k = q.dims()[3];
    if product(&[b, h_q, n_q, n_k]) == Some(0) && (n_q == 0 || h_q == 0 || b == 0) {
        // No query row: every gradient is 0 (dK and dV of keys no row sees).
        for (name, t) in [("dK", dk), ("dV", dv)] {
            let [tb, th, tn, td] = t.dims();
            for bi in 0..tb {
                for h in 0..th {
                    let m = head_of(t, bi, h);
                    if let Some((j, c)) = (0..tn)
                        .flat_map(|j| (0..td).map(move |c| (j, c)))
                        .find(|&(j, c)| m[(j, c)] != 0.0)
                    {
                        return Err(format!(
                            "no query row sees key {j}, so {name}[{bi}, {h}, {j}, {c}] must be 0, \
                             not {:e}",
                            m[(j, c)]
                        ));
                    }
                }
            }
        }
        return Ok(());
    }
    let group = h_q / h_kv.max(1);
    for bi in 0..b {
        let mut opts = *options;
        opts.key_padding = options.key_length(bi).map(KeyPadding::Uniform);
        for kv in 0..h_kv {
            let mut classes = vec![RowClass::Empty; n_k];
            // (Σ dK, Σ bound, Σ |dK|, Σ dV, Σ bound, Σ |dV|) over the group's heads.
            let mut sums: Option<[Mat<f64>; 6]> = forward_given.then(|| {
                let z = |c| Mat::<f64>::zeros(n_k, c);
                [z(d_k), z(d_k), z(d_k), z(d_v), z(d_v), z(d_v)]
            });
            let mut compare = vec![true; n_k];
            for h in kv * group..(kv + 1) * group {
                let row = (bi * h_q + h) * n_q;
                let (qh, kh, vh) = (head_of(q, bi, h), head_of(k, bi, kv), head_of(v, bi, kv));
                let (doh, oh) = (head_of(grad_out, bi, h), head_of(out, bi, h));
                let mut want = expect_head_backward(
                    qh,
                    kh,
                    vh,
                    doh,
                    oh,
                    &lse[row..row + n_q],
                    &opts,
                    model,
                    false,
                    forward_given,
                );
                want.release(planted);
                let GradExpected::Accept { grads: g, .. } = want else {
                    return Err(format!(
                        "batch entry {bi}, head {h}: an accepted batched call has a rejected head"
                    ));
                };
                let r = g.reference.as_ref().zip(g.bound.as_ref());
                check_gradient(
                    "dQ",
                    head_of(dq, bi, h),
                    &g.dq_rows,
                    [n_q, d_k],
                    r.map(|(r, b)| (r.dq.as_ref(), b.dq.as_ref())),
                    &g.compare_dq,
                )
                .map_err(|m| format!("batch entry {bi}, head {h}: {m}"))?;
                for j in 0..n_k {
                    classes[j] = match (classes[j], g.key_rows[j]) {
                        (RowClass::Touched, _) | (_, RowClass::Touched) => RowClass::Touched,
                        (RowClass::Finite, _) | (_, RowClass::Finite) => RowClass::Finite,
                        _ => RowClass::Empty,
                    };
                    compare[j] &= g.compare_keys[j];
                }
                if let (Some(s), Some((r, bd))) = (sums.as_mut(), r) {
                    for j in 0..n_k {
                        for c in 0..d_k {
                            s[0][(j, c)] += r.dk[(j, c)];
                            s[1][(j, c)] += bd.dk[(j, c)];
                            s[2][(j, c)] += r.dk[(j, c)].abs();
                        }
                        for c in 0..d_v {
                            s[3][(j, c)] += r.dv[(j, c)];
                            s[4][(j, c)] += bd.dv[(j, c)];
                            s[5][(j, c)] += r.dv[(j, c)].abs();
                        }
                    }
                }
            }
            // The f32 sum over the group's heads rounds too.
            let g = SAFETY * gamma(group as f64 + 1.0, U32);
            let refs = sums.map(|[rk, mut bk, ak, rv, mut bv, av]| {
                for j in 0..n_k {
                    for c in 0..d_k {
                        bk[(j, c)] += g * ak[(j, c)];
                    }
                    for c in 0..d_v {
                        bv[(j, c)] += g * av[(j, c)];
                    }
                }
                (rk, bk, rv, bv)
            });
            check_gradient(
                "dK",
                head_of(dk, bi, kv),
                &classes,
                [n_k, d_k],
                refs.as_ref().map(|r| (r.0.as_ref(), r.1.as_ref())),
                &compare,
            )
            .map_err(|m| format!("batch entry {bi}, kv head {kv}: {m}"))?;
            check_gradient(
                "dV",
                head_of(dv, bi, kv),
                &classes,
                [n_k, d_v],
                refs.as_ref().map(|r| (r.2.as_ref(), r.3.as_ref())),
                &compare,
            )
            .map_err(|m| format!("batch entry {bi}, kv head {kv}: {m}"))?;
        }
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------
// Huge shapes.

/// A length for a huge shape.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Len {
    /// A small length.
    Small(u8),
    /// `2^p` (`p` in 40..=63).
    Pow(u8),
    /// `usize::MAX − x`.
    NearMax(u8),
}

impl Len {
    /// The length.
    pub fn get(self) -> usize {
        match self {
            Len::Small(n) => usize::from(n),
            Len::Pow(p) => 1usize << p.clamp(40, 63),
            Len::NearMax(x) => usize::MAX - usize::from(x),
        }
    }

    /// Whether it is one of the huge lengths.
    pub fn is_huge(self) -> bool {
        !matches!(self, Len::Small(_))
    }
}

/// Small or huge lengths (huge ones at least `2^40`).
pub fn len(small_max: u8) -> BoxedStrategy<Len> {
    prop_oneof![
        2 => (0..=small_max).prop_map(Len::Small),
        2 => (40u8..=63).prop_map(Len::Pow),
        1 => (0u8..=3).prop_map(Len::NearMax),
    ]
    .boxed()
}

/// A defect that makes a huge call invalid whatever its size.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum HugeDefect {
    /// None: the call is valid, so it must fail for its size (or succeed with no work).
    None,
    /// An invalid scale.
    Scale(u8),
    /// A key length beyond `n_k` (`usize::MAX`, or `n_k + 1`).
    KeyLength,
    /// K one column wider than Q.
    KeyWidth,
    /// V one row longer than K (a row stride of 0 makes that free).
    ValueRows,
    /// An additive mask of the wrong shape.
    AdditiveShape,
}

/// A huge single-head case: every operand is one row of memory broadcast to its length.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct HugeHead {
    /// Queries.
    pub n_q: Len,
    /// Keys.
    pub n_k: Len,
    /// Key width (small).
    pub d_k: usize,
    /// Value width (small).
    pub d_v: usize,
    /// The defect.
    pub defect: HugeDefect,
    /// Storage type.
    pub dtype: Dtype,
}

/// Huge single-head cases.
pub fn huge_head() -> BoxedStrategy<HugeHead> {
    (
        len(5),
        len(5),
        1..=4usize,
        0..=3usize,
        prop_oneof![
            3 => Just(HugeDefect::None),
            1 => (0u8..4).prop_map(HugeDefect::Scale),
            1 => Just(HugeDefect::KeyLength),
            1 => Just(HugeDefect::KeyWidth),
            1 => Just(HugeDefect::ValueRows),
            1 => Just(HugeDefect::AdditiveShape),
        ],
        dtypes(),
    )
        .prop_map(|(n_q, n_k, d_k, d_v, defect, dtype)| HugeHead {
            n_q,
            n_k,
            d_k,
            d_v,
            defect,
            dtype,
        })
        .boxed()
}

/// The rows and options of a [`HugeHead`]: one row each of Q, K and V (to broadcast with
/// [`broadcast_rows`]), their lengths, and the mask and options.
#[derive(Debug, Clone, PartialEq)]
pub struct HugeHeadInputs {
    /// The row of Q.
    pub q_row: Vec<f32>,
    /// The row of K.
    pub k_row: Vec<f32>,
    /// The row of V.
    pub v_row: Vec<f32>,
    /// `[n_q, n_k, n_v]` (`n_v ≠ n_k` for [`HugeDefect::ValueRows`]).
    pub lens: [usize; 3],
    /// Explicit scale.
    pub scale: Option<f32>,
    /// Key length.
    pub key_len: Option<usize>,
    /// A (small, hence mis-shaped when `n_q` or `n_k` is huge) additive mask.
    pub additive: Option<Mat<f32>>,
}

impl HugeHead {
    /// Builds the rows and options.
    pub fn build(&self) -> HugeHeadInputs {
        let (n_q, n_k) = (self.n_q.get(), self.n_k.get());
        let row = |d: usize, x: f32| vec![self.dtype.round(x); d];
        let d_k_k = self.d_k + usize::from(self.defect == HugeDefect::KeyWidth);
        let n_v = if self.defect == HugeDefect::ValueRows {
            n_k.wrapping_add(1)
        } else {
            n_k
        };
        HugeHeadInputs {
            q_row: row(self.d_k, 0.5),
            k_row: row(d_k_k, 0.25),
            v_row: row(self.d_v, 1.0),
            lens: [n_q, n_k, n_v],
            scale: match self.defect {
                HugeDefect::Scale(s) => Some([f32::NAN, 0.0, -1.0, f32::MAX][usize::from(s) % 4]),
                _ => None,
            },
            key_len: (self.defect == HugeDefect::KeyLength).then(|| n_k.saturating_add(1)),
            additive: (self.defect == HugeDefect::AdditiveShape)
                .then(|| Mat::zeros(n_q.min(3), n_k.min(3) + 1)),
        }
    }
}

impl HugeHeadInputs {
    /// The options.
    pub fn options(&self) -> Options<'_> {
        options_of(
            self.scale,
            None,
            None,
            self.key_len.map(KeyPadding::Uniform),
            None,
            self.additive.as_ref(),
        )
    }

    /// Q, K and V as broadcast f32 views (for [`expect_head`]).
    pub fn views(&self) -> [MatRef<'_, f32>; 3] {
        let [n_q, n_k, n_v] = self.lens;
        [
            broadcast_rows(&self.q_row, n_q),
            broadcast_rows(&self.k_row, n_k),
            broadcast_rows(&self.v_row, n_v),
        ]
    }
}

/// A huge batched case: one row of memory per operand, zero strides, dims up to
/// `usize::MAX` on every axis.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct HugeBatch {
    /// Batch entries.
    pub batch: Len,
    /// Query heads.
    pub h_q: Len,
    /// Key/value heads (small, or equal to `h_q`).
    pub h_kv: Len,
    /// Queries.
    pub n_q: Len,
    /// Keys.
    pub n_k: Len,
    /// Key width (small).
    pub d_k: usize,
    /// Value width (small).
    pub d_v: usize,
    /// The defect.
    pub defect: HugeDefect,
    /// Storage type.
    pub dtype: Dtype,
}

/// Huge batched cases.
pub fn huge_batch() -> BoxedStrategy<HugeBatch> {
    (
        (
            len(3),
            len(3),
            prop_oneof![Just(None), len(2).prop_map(Some)],
        ),
        (len(3), len(3), 1..=4usize, 0..=3usize),
        prop_oneof![
            3 => Just(HugeDefect::None),
            1 => (0u8..4).prop_map(HugeDefect::Scale),
            1 => Just(HugeDefect::KeyLength),
            1 => Just(HugeDefect::KeyWidth),
            1 => Just(HugeDefect::ValueRows),
        ],
        dtypes(),
    )
        .prop_map(
            |((batch, h_q, h_kv), (n_q, n_k, d_k, d_v), defect, dtype)| HugeBatch {
                batch,
                h_q,
                h_kv: h_kv.unwrap_or(h_q),
                n_q,
                n_k,
                d_k,
                d_v,
                defect,
                dtype,
            },
        )
        .boxed()
}

impl HugeBatch {
    /// `[q, k, v]` dims.
    pub fn dims(&self) -> [[usize; 4]; 3] {
        let (b, h_q, h_kv) = (self.batch.get(), self.h_q.get(), self.h_kv.get());
        let (n_q, n_k) = (self.n_q.get(), self.n_k.get());
        let dk_k = self.d_k + usize::from(self.defect == HugeDefect::KeyWidth);
        let n_v = if self.defect == HugeDefect::ValueRows {
            n_k.wrapping_add(1)
        } else {
            n_k
        };
        [
            [b, h_q, n_q, self.d_k],
            [b, h_kv, n_k, dk_k],
            [b, h_kv, n_v, self.d_v],
        ]
    }

    /// The scale and key length of the defect.
    pub fn options(&self) -> Options<'static> {
        let mut o = Options::default();
        match self.defect {
            HugeDefect::Scale(s) => {
                o = o.with_scale([f32::NAN, 0.0, -1.0, f32::MAX][usize::from(s) % 4])
            }
            HugeDefect::KeyLength => o = o.with_key_length(usize::MAX),
            _ => {}
        }
        o
    }
}

/// A `[b, h, s, d]` view of `row` (`d` elements) with every stride 0.
pub fn broadcast_tensor<T>(row: &[T], dims: [usize; 4]) -> attn_core::Result<Tensor4Ref<'_, T>> {
    Tensor4Ref::new(row, dims, [0, 0, 0])
}

// ---------------------------------------------------------------------------------------
// Partial states.

/// A hostile partial state: output rows and LSEs from the values that can reach a merge
/// (finite, the empty row's `-inf`, and the `NaN`/`+inf` of rows a non-finite input
/// reached).
#[derive(Debug, Clone, PartialEq)]
pub struct HostileState {
    /// Normalised output `[n_q, d_v]`.
    pub output: Mat<f32>,
    /// LSE of each row (one too many for a malformed state).
    pub lse: Vec<f32>,
}

/// Recipe of a pair of states to merge.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct MergeCase {
    /// Rows.
    pub n_q: usize,
    /// Value width.
    pub d_v: usize,
    /// The other state's shape differs (`[n_q + dr, d_v + dc]`).
    pub mismatch: Option<(u8, u8)>,
    /// Output values at the finite extremes (else moderate).
    pub extreme: bool,
    /// Seed.
    pub seed: u64,
}

/// Merge cases; `extreme` chooses output values at the finite extremes.
pub fn merge_case(extreme: bool) -> BoxedStrategy<MergeCase> {
    (
        0..=6usize,
        0..=5usize,
        proptest::option::weighted(0.15, (0u8..=2, 0u8..=2)),
        any::<u64>(),
    )
        .prop_map(move |(n_q, d_v, mismatch, seed)| MergeCase {
            n_q,
            d_v,
            mismatch: mismatch.filter(|&(r, c)| r + c > 0),
            extreme,
            seed,
        })
        .boxed()
}

impl MergeCase {
    /// The two states.
    pub fn build(&self) -> (HostileState, HostileState) {
        let mut rng = Rng::new(self.seed, 21);
        let state = |n: usize, d: usize, rng: &mut Rng| {
            let lse: Vec<f32> = (0..n)
                .map(|_| match rng.below(8) {
                    0 => f32::NEG_INFINITY,
                    1 => f32::NAN,
                    2 => f32::INFINITY,
                    3 => [f32::MAX, f32::MIN, 88.0, -88.0, 1e30][rng.below(5) as usize],
                    _ => ((rng.unit() * 2.0 - 1.0) * 20.0) as f32,
                })
                .collect();
            let fill = if self.extreme {
                Fill::Extreme
            } else {
                Fill::Large
            };
            let mut output = operand(n, d, fill, Dtype::F32, rng);
            for (i, &l) in lse.iter().enumerate() {
                if l == f32::NEG_INFINITY {
                    for c in 0..d {
                        output[(i, c)] = 0.0;
                    }
                } else if l.is_nan() || l == f32::INFINITY {
                    for c in 0..d {
                        output[(i, c)] = f32::NAN;
                    }
                }
            }
            HostileState { output, lse }
        };
        let a = state(self.n_q, self.d_v, &mut rng);
        let (dr, dc) = self.mismatch.unwrap_or((0, 0));
        let b = state(
            self.n_q + usize::from(dr),
            self.d_v + usize::from(dc),
            &mut rng,
        );
        (a, b)
    }
}

/// Checks `merged = a.merge(b)` against the merge's contract: mismatched shapes are an
/// error naming the state; a row that only one side saw is that side's row bit for bit;
/// a row both saw with finite LSEs and finite outputs has a finite LSE in
/// `[max, max + ln 2]` (within rounding) and an output in the hull of the two (within
/// rounding), finite; a row a NaN or `+inf` reached is unconstrained.
pub fn check_merge(
    a: (MatRef<'_, f32>, &[f32]),
    b: (MatRef<'_, f32>, &[f32]),
    merged: Result<(MatRef<'_, f32>, &[f32]), Error>,
) -> Result<(), String> {
    let ((oa, la), (ob, lb)) = (a, b);
    let same = (oa.nrows(), oa.ncols()) == (ob.nrows(), ob.ncols());
    let (o, l) = match (same, merged) {
        (false, Err(e)) => {
            return check_error(
                &Expected::Reject(vec![Rejection::named(
                    "merged states cover the same rows and width",
                    &["state", "LSE", "output"],
                )]),
                &e,
            );
        }
        (false, Ok(_)) => return Err("states of different shapes were merged".into()),
        (true, Err(e)) => return Err(format!("a merge of same-shaped states failed: {e}")),
        (true, Ok(m)) => m,
    };
    let (n, d) = (oa.nrows(), oa.ncols());
    if (o.nrows(), o.ncols(), l.len()) != (n, d, n) {
        return Err(format!(
            "the merged state is {}×{} with {} LSEs, not {n}×{d} with {n}",
            o.nrows(),
            o.ncols(),
            l.len()
        ));
    }
    let bits =
        |m: MatRef<'_, f32>, i: usize| (0..d).map(|c| m[(i, c)].to_bits()).collect::<Vec<_>>();
    for i in 0..n {
        let (x, y) = (la[i], lb[i]);
        if y == f32::NEG_INFINITY || x == f32::NEG_INFINITY {
            let (so, sl) = if y == f32::NEG_INFINITY {
                (oa, x)
            } else {
                (ob, y)
            };
            if bits(o, i) != bits(so, i) || l[i].to_bits() != sl.to_bits() {
                return Err(format!(
                    "row {i}: one side saw nothing (LSEs {x:e}, {y:e}), so the merge must be the \
                     other side bit for bit"
                ));
            }
            continue;
        }
        let finite = x.is_finite()
            && y.is_finite()
            && (0..d).all(|c| oa[(i, c)].is_finite() && ob[(i, c)].is_finite());
        if !finite {
            continue;
        }
        let m = f64::from(x.max(y));
        let tol = 8.0 * U32 * (m.abs() + 1.0);
        let lv = f64::from(l[i]);
        if !l[i].is_finite() || lv < m - tol || lv > m + 2f64.ln() + tol {
            return Err(format!(
                "row {i}: merging finite LSEs {x:e} and {y:e} gave {:e}, outside [max, max + ln 2]",
                l[i]
            ));
        }
        for c in 0..d {
            let (p, r) = (f64::from(oa[(i, c)]), f64::from(ob[(i, c)]));
            let (lo, hi) = (p.min(r), p.max(r));
            let tol = 8.0 * U32 * lo.abs().max(hi.abs());
            let e = o[(i, c)];
            if !e.is_finite() || f64::from(e) < lo - tol || f64::from(e) > hi + tol {
                return Err(format!(
                    "row {i}: merging finite outputs {p:e} and {r:e} gave {e:e}, outside their hull"
                ));
            }
        }
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------
// Running: no panics, no aborts, persisted failures.

thread_local! {
    static GUARDED: Cell<bool> = const { Cell::new(false) };
    static LAST_PANIC: RefCell<Option<String>> = const { RefCell::new(None) };
}

static HOOK: Once = Once::new();

fn install_hook() {
    HOOK.call_once(|| {
        let previous = panic::take_hook();
        panic::set_hook(Box::new(move |info| {
            if GUARDED.with(Cell::get) {
                LAST_PANIC.with(|p| *p.borrow_mut() = Some(info.to_string()));
            } else {
                previous(info);
            }
        }));
    });
}

/// Runs `f` under `catch_unwind`: `Err` with the panic's message and location if it
/// panics (the panic is not printed). A panic on another thread (a rayon worker) that
/// `f` re-raises is reported with its message.
///
/// ```
/// use attn_oracle::hostile::guarded;
/// assert_eq!(guarded(|| 2 + 2), Ok(4));
/// let e = guarded(|| -> u8 { panic!("boom") }).unwrap_err();
/// assert!(e.contains("boom"));
/// ```
pub fn guarded<R>(f: impl FnOnce() -> R) -> Result<R, String> {
    install_hook();
    let was = GUARDED.with(|g| g.replace(true));
    LAST_PANIC.with(|p| p.borrow_mut().take());
    let r = panic::catch_unwind(AssertUnwindSafe(f));
    GUARDED.with(|g| g.set(was));
    r.map_err(|payload| {
        let recorded = LAST_PANIC.with(|p| p.borrow_mut().take());
        recorded.unwrap_or_else(|| {
            payload
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| payload.downcast_ref::<&str>().map(|s| (*s).to_string()))
                .unwrap_or_else(|| "a panic with a non-string payload".into())
        })
    })
}

/// Runs `f` under [`guarded`]; a panic becomes `Err("<what> panicked: …")`.
pub fn returns<R>(what: &str, f: impl FnOnce() -> R) -> Result<R, String> {
    if std::env::var_os("ATTN_HOSTILE_TRACE").is_some() {
        eprintln!("hostile call: {what}");
    }
    guarded(f).map_err(|m| format!("{what} panicked (the library never panics on input): {m}"))
}

/// How many cases a hostile property runs and where its failures persist.
#[derive(Debug, Clone)]
pub struct HostileConfig {
    /// Cases per property (`None`: `PROPTEST_CASES`, else the property's default).
    pub cases: Option<u32>,
    /// Directory of the persisted failures (`<dir>/<property>.txt`).
    pub regressions: Option<PathBuf>,
    /// Shrink iterations.
    pub max_shrink_iters: u32,
}

impl HostileConfig {
    /// Default counts (or `PROPTEST_CASES`), failures persisted under
    /// `<manifest_dir>/proptest-regressions/<group>/`.
    pub fn for_crate(manifest_dir: &str, group: &str) -> Self {
        Self {
            cases: None,
            regressions: Some(
                PathBuf::from(manifest_dir)
                    .join("proptest-regressions")
                    .join(group),
            ),
            max_shrink_iters: 512,
        }
    }

    /// `cases` per property, nothing persisted.
    pub fn quick(cases: u32) -> Self {
        Self {
            cases: Some(cases),
            regressions: None,
            max_shrink_iters: 64,
        }
    }

    fn cases(&self, default: u32) -> u32 {
        self.cases.unwrap_or_else(|| {
            std::env::var("PROPTEST_CASES")
                .ok()
                .and_then(|s| s.parse().ok())
                .unwrap_or(default)
        })
    }
}

/// Runs one hostile property with proptest: `test` returns `Err(description)` for a
/// violation; the result is the shrunk failure, with the minimal input. The random seed
/// is fixed per property (the same cases on every run) unless `PROPTEST_RNG_SEED` is set.
///
/// Each case's input is printed to stderr first when the environment variable
/// `ATTN_HOSTILE_TRACE` is set (as [`isolated`] sets it in its child), so that the input
/// of an abort or a hang is known.
pub fn run_property<S>(
    name: &str,
    config: &HostileConfig,
    default_cases: u32,
    strategy: S,
    test: impl Fn(&S::Value) -> Result<(), String>,
) -> Result<(), String>
where
    S: Strategy,
    S::Value: fmt::Debug,
{
    let mut pc = Config {
        cases: config.cases(default_cases),
        max_shrink_iters: config.max_shrink_iters,
        ..Config::default()
    };
    pc.source_file = None;
    // A fixed seed per property, so that `cargo test` (CI) checks the same cases on every
    // run; `PROPTEST_RNG_SEED` explores others (deep runs).
    if std::env::var_os("PROPTEST_RNG_SEED").is_none() {
        let seed = name.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
            (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
        });
        pc.rng_seed = RngSeed::Fixed(seed);
    }
    pc.failure_persistence = config.regressions.as_ref().map(|dir| {
        let path = dir.join(format!("{name}.txt"));
        let path: &'static str = Box::leak(path.to_string_lossy().into_owned().into_boxed_str());
        Box::new(FileFailurePersistence::Direct(path)) as _
    });
    let trace = std::env::var_os("ATTN_HOSTILE_TRACE").is_some();
    let mut runner = TestRunner::new(pc);
    let result = runner.run(&strategy, |value| {
        if trace {
            eprintln!("hostile case: {value:?}");
        }
        test(&value).map_err(TestCaseError::fail)
    });
    match result {
        Ok(()) => Ok(()),
        Err(TestError::Fail(reason, value)) => Err(format!(
            "property `{name}` fails: {reason}\nminimal failing input: {value:#?}"
        )),
        Err(TestError::Abort(reason)) => Err(format!("property `{name}` aborted: {reason}")),
    }
}

/// Runs a `#[test]` in a child process so that an abort (an infallible allocation that
/// fails, a stack overflow) or a hang is a reported failure and not the end of the test
/// binary: the parent re-runs the test binary on `test_path` (its full name as
/// `cargo test` prints it) with `--exact`, under a virtual-memory limit of 8 GiB where
/// `sh` can set one, and fails with the child's report — including the last case it
/// started — if the child does not pass within `timeout`. In the child, `body` runs.
pub fn isolated(test_path: &str, timeout: Duration, body: impl FnOnce()) {
    const CHILD: &str = "ATTN_HOSTILE_CHILD";
    if std::env::var(CHILD).is_ok_and(|t| t == test_path) {
        body();
        return;
    }
    let exe = std::env::current_exe().expect("the test binary's path");
    let args = [test_path, "--exact", "--nocapture", "--test-threads=1"];
    let mut cmd = if std::path::Path::new("/bin/sh").exists() {
        let mut c = Command::new("/bin/sh");
        c.arg("-c")
            .arg("ulimit -v 8388608 2>/dev/null; exec \"$0\" \"$@\"")
            .arg(&exe)
            .args(args);
        c
    } else {
        let mut c = Command::new(&exe);
        c.args(args);
        c
    };
    cmd.env(CHILD, test_path)
        .env("ATTN_HOSTILE_TRACE", "1")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut child = cmd.spawn().expect("spawn the test binary");
    let pipe = |r: Option<Box<dyn Read + Send>>| {
        std::thread::spawn(move || {
            let mut s = String::new();
            if let Some(mut r) = r {
                let mut bytes = Vec::new();
                let _ = r.read_to_end(&mut bytes);
                s = String::from_utf8_lossy(&bytes).into_owned();
            }
            s
        })
    };
    let out = pipe(child.stdout.take().map(|s| Box::new(s) as _));
    let err = pipe(child.stderr.take().map(|s| Box::new(s) as _));
    let start = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().expect("wait for the child") {
            break Some(s);
        }
        if start.elapsed() > timeout {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let (out, err) = (
        out.join().unwrap_or_default(),
        err.join().unwrap_or_default(),
    );
    let last_case = err
        .lines()
        .rev()
        .find(|l| l.starts_with("hostile case: "))
        .unwrap_or("(no case started)");
    let last_call = err
        .lines()
        .rev()
        .find(|l| l.starts_with("hostile call: "))
        .unwrap_or("(no call started)");
    let last_case = format!("{last_case}\nlast call started: {last_call}");
    let report: String = err
        .lines()
        .filter(|l| !l.starts_with("hostile case: ") && !l.starts_with("hostile call: "))
        .collect::<Vec<_>>()
        .join("\n");
    match status {
        None => panic!(
            "{test_path}: the child did not finish within {timeout:?} (a hang, or a valid huge \
             problem computed)\nlast case started: {last_case}\n{report}"
        ),
        Some(s) if s.success() && out.contains("1 passed") => {}
        Some(s) if s.success() => {
            panic!("{test_path}: the child ran no test (is the test path right?)\n{out}")
        }
        Some(s) => panic!(
            "{test_path}: the child failed ({}): {}\nlast case started: {last_case}\n{report}\n{out}",
            describe_status(&s),
            if report.contains("minimal failing input") {
                "a property failed"
            } else {
                "it aborted or crashed (a panic cannot do this: only an abort, a signal or an exit)"
            }
        ),
    }
}

fn describe_status(s: &std::process::ExitStatus) -> String {
    #[cfg(unix)]
    {
        use std::os::unix::process::ExitStatusExt;
        if let Some(sig) = s.signal() {
            return format!(
                "killed by signal {sig}{}",
                if sig == 6 { " (SIGABRT)" } else { "" }
            );
        }
    }
    format!("{s}")
}

// ---------------------------------------------------------------------------------------
// Any engine.

/// Runs the hostile properties that the [`Engine`] trait reaches — one head with LSE and
/// one batched call, for `profile` — against `engine`; returns the first failure, shrunk.
/// An engine's own suite drives its other entry points with the same generators and checks
/// (attn-optimized: `tests/robustness.rs`).
///
/// Inputs are rounded to the engine's [`Engine::storage`] (the recipe's own storage type
/// is ignored) and passed as f32 views with the recipe's strides.
///
/// ```
/// use attn_oracle::ReferenceEngine;
/// use attn_oracle::hostile::{check_engine_hostile, Hiding, HostileConfig, Profile};
/// for profile in [Profile::Poison(Hiding::NegInfBias), Profile::Windows, Profile::Scales] {
///     check_engine_hostile(&ReferenceEngine, profile, &HostileConfig::quick(8)).unwrap();
/// }
/// ```
pub fn check_engine_hostile(
    engine: &dyn Engine,
    profile: Profile,
    config: &HostileConfig,
) -> Result<(), String> {
    let model = engine.error_model();
    let storage = engine.storage();
    let name = format!("{}-{}", engine.name(), profile_name(profile));
    run_property(
        &format!("{name}-head"),
        config,
        64,
        hostile_head(profile),
        |case| {
            let mut case = case.clone();
            case.dtype = storage;
            let inputs = case.build();
            let [q, k, v] = inputs.stored(|x| x);
            let (q, k, v) = (q.view(), k.view(), v.view());
            let opts = inputs.options();
            let want = expect_head(q, k, v, &opts, &model, Outputs::WITH_LSE, 0);
            if matches!(want, Expected::TooMuchWork) {
                return Ok(());
            }
            let got = returns("attention_with_lse", || {
                engine.attention_with_lse(q, k, v, &opts)
            })?;
            let got = got.as_ref().map(|(o, l)| (o.as_ref(), Some(l.as_slice())));
            check_head(&want, got.map_err(Clone::clone))
        },
    )?;
    run_property(
        &format!("{name}-batched"),
        config,
        32,
        hostile_batch(profile),
        |case| {
            let mut case = case.clone();
            case.head.dtype = storage;
            let inputs = case.build();
            let (q, k, v) = (inputs.q.view(), inputs.k.view(), inputs.v.view());
            let opts = inputs.options();
            let want = expect_batched(q.dims(), k.dims(), v.dims(), &opts, Outputs::OUTPUT);
            if matches!(want, BatchExpected::TooMuchWork) {
                return Ok(());
            }
            let got = returns("attention_batched", || {
                engine.attention_batched(q, k, v, &opts)
            })?;
            let got = got.as_ref().map(|t| (t.as_ref(), None));
            check_batched(&want, [q, k, v], &opts, &model, got.map_err(Clone::clone))
        },
    )
}

/// A short name of a profile, for property and file names.
pub fn profile_name(profile: Profile) -> String {
    match profile {
        Profile::Moderate => "moderate".into(),
        Profile::Poison(h) => format!(
            "poison-{}",
            match h {
                Hiding::Structural => "structural",
                Hiding::NegInfBias => "neg-inf-bias",
                Hiding::BoolMask => "bool-mask",
            }
        ),
        Profile::ExtremeBias => "extreme-bias".into(),
        Profile::ExtremeQk => "extreme-qk".into(),
        Profile::ExtremeV => "extreme-v".into(),
        Profile::Windows => "windows".into(),
        Profile::Scales => "scales".into(),
        Profile::Anything => "anything".into(),
    }
}

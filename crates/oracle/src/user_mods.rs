//! The user modifiers the generated cases draw from: a small fixed set of [`ScoreMod`]s and
//! [`MaskMod`]s (statics, so that a case's [`Options`](attn_core::Options) can borrow them
//! for any lifetime), each score modifier with the error model the bound needs
//! ([`UserModBound`]), and wrappers that ask a modifier about a fixed (batch entry, head):
//! how a single-head call computes one head of a batched call.

use core::ops::Range;

use attn_core::{MaskMod, ScoreMod, SoftCap, TileCoverage};

use crate::bound::UserModBound;

/// A user score modifier of the generated cases.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum UserScore {
    /// The soft-cap at [`CAPPED_AT`] through [`SoftCap::apply_f32`], as a user would write it.
    Capped,
    /// `s + 0.125·h − 0.03125·|i − j|·(b + 1)`: depends on the batch entry, the head and
    /// the positions.
    Relative,
    /// `0.5·s + 1`: a Lipschitz constant below 1 and a shift.
    Halved,
}

/// The cap of [`UserScore::Capped`].
pub const CAPPED_AT: f32 = 8.0;

#[derive(Debug)]
struct Capped;
#[derive(Debug)]
struct Relative;
#[derive(Debug)]
struct Halved;

fn cap() -> SoftCap {
    SoftCap::new(CAPPED_AT).expect("a positive finite cap")
}

impl ScoreMod for Capped {
    #[inline(always)]
    fn score(&self, s: f32, b: usize, h: usize, i: usize, j: usize) -> f32 {
        UserSoftCap(cap()).score(s, b, h, i, j)
    }
    fn derivative(&self, s: f32, b: usize, h: usize, i: usize, j: usize) -> f32 {
        UserSoftCap(cap()).derivative(s, b, h, i, j)
    }
}

impl ScoreMod for Relative {
    #[inline(always)]
    fn score(&self, s: f32, b: usize, h: usize, i: usize, j: usize) -> f32 {
        s + 0.125 * h as f32 - 0.03125 * (i as f32 - j as f32).abs() * (b + 1) as f32
    }
    fn derivative(&self, _: f32, _: usize, _: usize, _: usize, _: usize) -> f32 {
        1.0
    }
}

impl ScoreMod for Halved {
    #[inline(always)]
    fn score(&self, s: f32, _: usize, _: usize, _: usize, _: usize) -> f32 {
        0.5 * s + 1.0
    }
    fn derivative(&self, _: f32, _: usize, _: usize, _: usize, _: usize) -> f32 {
        0.5
    }
}

impl UserScore {
    /// The modifier.
    pub fn modifier(self) -> &'static dyn ScoreMod {
        match self {
            UserScore::Capped => &Capped,
            UserScore::Relative => &Relative,
            UserScore::Halved => &Halved,
        }
    }

    /// Its error model for head `(b, h)` of a call with `n_q` queries and `n_k` keys.
    pub fn bound(self, b: usize, h: usize, n_q: usize, n_k: usize) -> UserModBound {
        match self {
            // x/c (propagated by a derivative ≤ 1: u·|x|), tanh (≤ 4e-7 relative), c·t:
            // at most 9 roundings relative to the larger of |x| and |out|.
            UserScore::Capped => UserModBound {
                lipschitz: 1.0,
                offset: 0.0,
                roundings: 9.0,
                cap: Some(f64::from(CAPPED_AT)),
            },
            // |i − j| and the indices exact below 2^24; two products and two sums.
            UserScore::Relative => UserModBound {
                lipschitz: 1.0,
                offset: 0.125 * h as f64 + 0.03125 * n_q.max(n_k) as f64 * (b + 1) as f64,
                roundings: 4.0,
                cap: None,
            },
            // 0.5·s is exact (unless it underflows); the sum rounds once.
            UserScore::Halved => UserModBound {
                lipschitz: 0.5,
                offset: 1.0,
                roundings: 1.0,
                cap: None,
            },
        }
    }
}

/// A user mask modifier of the generated cases.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum UserMask {
    /// Causal, aligned top-left (`j ≤ i`), with exact block answers.
    TopLeft,
    /// A band `|i − j| ≤ 40`, with exact block answers.
    Band,
    /// Hides every third key from odd heads and the first two keys from batch entry 1; no
    /// block answers (every entry asked).
    Stripes,
}

/// The soft-cap written as a user modifier with the built-in's arithmetic
/// ([`SoftCap::apply_f32`]): an engine must give it the built-in's bits (public: the
/// engines' own tests use it too).
#[derive(Debug)]
pub struct UserSoftCap(pub SoftCap);

impl ScoreMod for UserSoftCap {
    #[inline(always)]
    fn score(&self, s: f32, _: usize, _: usize, _: usize, _: usize) -> f32 {
        self.0.apply_f32(s).0
    }
    fn derivative(&self, s: f32, _: usize, _: usize, _: usize, _: usize) -> f32 {
        self.0.apply_f32(s).1
    }
}

/// The half-width of [`UserMask::Band`].
pub const BAND: usize = 40;

/// Causal top-left with exact block coverage (public: the modifier properties use it).
#[derive(Debug)]
pub struct TopLeftMask;
#[derive(Debug)]
struct BandMask;
#[derive(Debug)]
struct Stripes;

impl MaskMod for TopLeftMask {
    fn visible(&self, _: usize, _: usize, i: usize, j: usize) -> bool {
        j <= i
    }
    fn coverage(&self, _: usize, _: usize, q: Range<usize>, k: Range<usize>) -> TileCoverage {
        if k.start > q.end - 1 {
            TileCoverage::Hidden
        } else if k.end - 1 <= q.start {
            TileCoverage::Full
        } else {
            TileCoverage::Partial
        }
    }
}

impl MaskMod for BandMask {
    fn visible(&self, _: usize, _: usize, i: usize, j: usize) -> bool {
        i.abs_diff(j) <= BAND
    }
    fn coverage(&self, _: usize, _: usize, q: Range<usize>, k: Range<usize>) -> TileCoverage {
        let (q_last, k_last) = (q.end - 1, k.end - 1);
        if k.start > q_last + BAND || q.start > k_last + BAND {
            TileCoverage::Hidden
        } else if q_last.abs_diff(k.start) <= BAND && k_last.abs_diff(q.start) <= BAND {
            // The farthest pairs are the corners: both within the band.
            TileCoverage::Full
        } else {
            TileCoverage::Partial
        }
    }
}

impl MaskMod for Stripes {
    fn visible(&self, b: usize, h: usize, _: usize, j: usize) -> bool {
        let striped = h % 2 == 1 && j.is_multiple_of(3);
        !(striped || b == 1 && j < 2)
    }
}

impl UserMask {
    /// The modifier.
    pub fn modifier(self) -> &'static dyn MaskMod {
        match self {
            UserMask::TopLeft => &TopLeftMask,
            UserMask::Band => &BandMask,
            UserMask::Stripes => &Stripes,
        }
    }
}

/// A score modifier asked about a fixed batch entry and/or head (`None`: the call's),
/// whatever the call says: a single-head call (always `(0, 0)`) computing head `(b, h)` of
/// a batched call, or a packed call of one sequence computing sequence `s` of a batch.
#[derive(Debug, Clone, Copy)]
pub struct ScoreModAt<'a> {
    /// The modifier.
    pub inner: &'a dyn ScoreMod,
    /// The batch entry and head it is asked about.
    pub at: (Option<usize>, Option<usize>),
}

impl ScoreMod for ScoreModAt<'_> {
    fn score(&self, s: f32, b: usize, h: usize, i: usize, j: usize) -> f32 {
        let (b, h) = (self.at.0.unwrap_or(b), self.at.1.unwrap_or(h));
        self.inner.score(s, b, h, i, j)
    }
    fn derivative(&self, s: f32, b: usize, h: usize, i: usize, j: usize) -> f32 {
        let (b, h) = (self.at.0.unwrap_or(b), self.at.1.unwrap_or(h));
        self.inner.derivative(s, b, h, i, j)
    }
}

/// A mask modifier asked about a fixed batch entry and/or head (see [`ScoreModAt`]).
#[derive(Debug, Clone, Copy)]
pub struct MaskModAt<'a> {
    /// The modifier.
    pub inner: &'a dyn MaskMod,
    /// The batch entry and head it is asked about.
    pub at: (Option<usize>, Option<usize>),
}

impl MaskMod for MaskModAt<'_> {
    fn visible(&self, b: usize, h: usize, i: usize, j: usize) -> bool {
        let (b, h) = (self.at.0.unwrap_or(b), self.at.1.unwrap_or(h));
        self.inner.visible(b, h, i, j)
    }
    fn coverage(&self, b: usize, h: usize, q: Range<usize>, k: Range<usize>) -> TileCoverage {
        let (b, h) = (self.at.0.unwrap_or(b), self.at.1.unwrap_or(h));
        self.inner.coverage(b, h, q, k)
    }
}

//! User-defined modifiers: a score modifier (`score_mod`) changes each score before the
//! masks, a mask modifier (`mask_mod`) hides keys — FlexAttention's two hooks, for the CPU.
//!
//! An engine hands a modifier a whole [`ScoreTile`] at a time (one dynamic call per tile, or
//! per row of a decoding tile), and the tile's [`ScoreTile::map`] runs the modifier's
//! per-score function in a loop compiled for this CPU's vector instructions: the function
//! is monomorphised and inlined there, never called through a pointer per score. The
//! built-in soft-cap and ALiBi go through the same mechanism ([`crate::HeadModifiers`]).
//!
//! Scores are in natural units (`s = scale · q·k`, what the formula writes), whatever unit
//! an engine stores them in; positions are the call's own: batch entry `b` (a packed call's
//! sequence), query head `h`, query `i` and key `j` of that head (a KV cache's keys are its
//! positions, its queries the call's new rows).

use core::fmt::Debug;
use core::ops::Range;

use pulp::{Simd, WithSimd};

use crate::{Error, Isa, Result, TileCoverage};

/// A block of scores of one head: queries `queries` against keys `keys`, score `(i, j)` at
/// `scores[(i − queries.start)·query_stride + (j − keys.start)·key_stride]`.
#[derive(Debug)]
pub struct ScoreTile<'t> {
    scores: &'t mut [f32],
    strides: (usize, usize),
    queries: Range<usize>,
    keys: Range<usize>,
    batch: usize,
    head: usize,
    /// A stored score times `unit` is the natural score.
    unit: f32,
    inv_unit: f32,
    /// The instruction set the loops are compiled for.
    isa: Isa,
}

impl<'t> ScoreTile<'t> {
    /// A tile of natural-unit scores of batch entry `batch`, query head `head`, with
    /// `strides = (query_stride, key_stride)`; [`Error::Layout`] when `scores` does not
    /// hold it.
    ///
    /// ```
    /// use attn_core::ScoreTile;
    /// let mut s = [1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0]; // 2 queries × 3 keys, row-major
    /// let mut tile = ScoreTile::new(&mut s, (3, 1), 10..12, 0..3, 0, 1)?;
    /// tile.map(|s, i, j| s + (i * 100 + j) as f32);
    /// assert_eq!(s, [1001.0, 1003.0, 1005.0, 1104.0, 1106.0, 1108.0]);
    /// # Ok::<(), attn_core::Error>(())
    /// ```
    pub fn new(
        scores: &'t mut [f32],
        strides: (usize, usize),
        queries: Range<usize>,
        keys: Range<usize>,
        batch: usize,
        head: usize,
    ) -> Result<Self> {
        let last = |r: &Range<usize>, stride: usize| r.len().saturating_sub(1).checked_mul(stride);
        let end = last(&queries, strides.0)
            .zip(last(&keys, strides.1))
            .and_then(|(a, b)| a.checked_add(b));
        let empty = queries.is_empty() || keys.is_empty();
        if !empty && end.is_none_or(|e| e >= scores.len()) {
            return Err(Error::layout(
                "score tile",
                format!(
                    "{} queries × {} keys with strides {strides:?} do not fit in {} scores",
                    queries.len(),
                    keys.len(),
                    scores.len()
                ),
            ));
        }
        Ok(Self {
            scores,
            strides,
            queries,
            keys,
            batch,
            head,
            unit: 1.0,
            inv_unit: 1.0,
            isa: Isa::current(),
        })
    }

    /// The same tile holding `stored = natural / unit` (an engine's base-2 domain has
    /// `unit = ln 2`): [`ScoreTile::map`] converts on the way in and out.
    ///
    /// ```
    /// use attn_core::ScoreTile;
    /// let mut s = [2.0f32]; // stored in units of 0.5: the natural score is 1
    /// let tile = ScoreTile::new(&mut s, (1, 1), 0..1, 0..1, 0, 0)?;
    /// tile.with_unit(0.5).map(|x, _, _| { assert_eq!(x, 1.0); x + 1.0 });
    /// assert_eq!(s, [4.0]);
    /// # Ok::<(), attn_core::Error>(())
    /// ```
    pub fn with_unit(self, unit: f32) -> Self {
        Self {
            unit,
            inv_unit: 1.0 / unit,
            ..self
        }
    }

    /// The same tile with every query index moved by `offset` (a KV cache's new rows are
    /// the positions after the cached ones).
    ///
    /// ```
    /// use attn_core::ScoreTile;
    /// let mut s = [0.0f32; 2];
    /// let mut tile = ScoreTile::new(&mut s, (1, 2), 0..2, 0..1, 0, 0)?;
    /// tile.shifted(10).map(|_, i, _| i as f32);
    /// assert_eq!(s, [10.0, 11.0]);
    /// # Ok::<(), attn_core::Error>(())
    /// ```
    pub fn shifted(&mut self, offset: usize) -> ScoreTile<'_> {
        ScoreTile {
            scores: self.scores,
            strides: self.strides,
            queries: self.queries.start + offset..self.queries.end + offset,
            keys: self.keys.clone(),
            batch: self.batch,
            head: self.head,
            unit: self.unit,
            inv_unit: self.inv_unit,
            isa: self.isa,
        }
    }

    /// The same tile with its loops run on `isa` (an engine passes the path it chose;
    /// [`Isa::current`] by default). A path this CPU lacks runs the portable loop.
    ///
    /// ```
    /// use attn_core::{Isa, ScoreTile};
    /// let mut s = [1.0f32, 2.0];
    /// let tile = ScoreTile::new(&mut s, (1, 2), 0..2, 0..1, 0, 0)?;
    /// tile.with_isa(Isa::Baseline).map(|x, i, _| x * i as f32);
    /// assert_eq!(s, [0.0, 2.0]);
    /// # Ok::<(), attn_core::Error>(())
    /// ```
    pub fn with_isa(self, isa: Isa) -> Self {
        Self { isa, ..self }
    }

    /// The instruction set the tile's loops run on.
    pub fn isa(&self) -> Isa {
        self.isa
    }

    /// The batch entry (a packed call's sequence).
    pub fn batch(&self) -> usize {
        self.batch
    }

    /// The query head.
    pub fn head(&self) -> usize {
        self.head
    }

    /// The queries of the tile.
    pub fn queries(&self) -> Range<usize> {
        self.queries.clone()
    }

    /// The keys of the tile.
    pub fn keys(&self) -> Range<usize> {
        self.keys.clone()
    }

    /// Replaces every score `s` of query `i` and key `j` by `f(s, i, j)` (natural units),
    /// in memory order, in a loop compiled for the tile's instruction set ([`ScoreTile::with_isa`]).
    pub fn map(&mut self, mut f: impl FnMut(f32, usize, usize) -> f32) {
        let (unit, inv) = (self.unit, self.inv_unit);
        self.lines::<false, _>(&mut [], move |x, i, j| (f(x * unit, i, j) * inv, 1.0));
    }

    /// [`ScoreTile::map`] that also multiplies `derivative` (laid out like the scores) by
    /// the derivative of the change: `f(s, i, j)` returns the new score and `∂new/∂s`
    /// (chained, so modifiers applied one after another leave the derivative of all).
    /// [`Error::Layout`] when `derivative` is shorter than the scores.
    ///
    /// ```
    /// use attn_core::ScoreTile;
    /// let (mut s, mut d) = ([1.0f32, 2.0], [1.0f32; 2]);
    /// let mut tile = ScoreTile::new(&mut s, (1, 1), 0..1, 0..2, 0, 0)?;
    /// tile.map_chained(&mut d, |x, _, _| (x * x, 2.0 * x))?; // s², derivative 2s
    /// assert_eq!((s, d), ([1.0, 4.0], [2.0, 4.0]));
    /// # Ok::<(), attn_core::Error>(())
    /// ```
    pub fn map_chained(
        &mut self,
        derivative: &mut [f32],
        f: impl FnMut(f32, usize, usize) -> (f32, f32),
    ) -> Result<()> {
        if derivative.len() < self.scores.len() {
            return Err(Error::layout(
                "score derivative",
                format!(
                    "{} entries for a tile of {} scores",
                    derivative.len(),
                    self.scores.len()
                ),
            ));
        }
        let (unit, inv) = (self.unit, self.inv_unit);
        let mut f = f;
        self.lines::<true, _>(derivative, move |x, i, j| {
            let (s, ds) = f(x * unit, i, j);
            (s * inv, ds)
        });
        Ok(())
    }

    /// Sets every score whose key query `i` may not see (`visible(i, j)` false) to `-inf`,
    /// in the same vectorised loop as [`ScoreTile::map`].
    ///
    /// ```
    /// use attn_core::ScoreTile;
    /// let mut s = [1.0f32; 4]; // 2 × 2, column-major
    /// ScoreTile::new(&mut s, (1, 2), 0..2, 0..2, 0, 0)?.hide(|i, j| j <= i);
    /// assert_eq!(s, [1.0, 1.0, f32::NEG_INFINITY, 1.0]);
    /// # Ok::<(), attn_core::Error>(())
    /// ```
    pub fn hide(&mut self, mut visible: impl FnMut(usize, usize) -> bool) {
        let hide = |x: f32, i, j| {
            let keep = visible(i, j);
            (if keep { x } else { f32::NEG_INFINITY }, 1.0)
        };
        self.lines::<false, _>(&mut [], hide);
    }

    /// The shared loop of [`ScoreTile::map`], [`ScoreTile::map_chained`] and
    /// [`ScoreTile::hide`]: `f(stored, i, j)` gives the new stored score and the factor of
    /// `derivative` (ignored without one). One dispatch to the tile's instruction set,
    /// the tile's contiguous axis innermost as a slice, so that the loop vectorises.
    fn lines<const CHAIN: bool, F>(&mut self, derivative: &mut [f32], f: F)
    where
        F: FnMut(f32, usize, usize) -> (f32, f32),
    {
        struct Op<'a, const CHAIN: bool, F> {
            scores: &'a mut [f32],
            /// Laid out like `scores` when `CHAIN`, else empty.
            derivative: &'a mut [f32],
            /// (queries, keys) as (first, count, stride).
            axes: [(usize, usize, usize); 2],
            f: F,
        }
        impl<const CHAIN: bool, F> WithSimd for Op<'_, CHAIN, F>
        where
            F: FnMut(f32, usize, usize) -> (f32, f32),
        {
            type Output = ();
            #[inline(always)]
            fn with_simd<S: Simd>(self, _simd: S) {
                let Op {
                    scores,
                    derivative,
                    axes: [(q0, nq, qs), (k0, nk, ks)],
                    mut f,
                } = self;
                // The contiguous axis innermost: down a column of a column-major tile, along
                // a row of a row-major one.
                let queries_inner = qs == 1 || ks != 1;
                let (outer, inner, os, is) = if queries_inner {
                    (nk, nq, ks, qs)
                } else {
                    (nq, nk, qs, ks)
                };
                for o in 0..outer {
                    let base = o * os;
                    if is != 1 {
                        for n in 0..inner {
                            let at = base + n * is;
                            let (i, j) = if queries_inner {
                                (q0 + n, k0 + o)
                            } else {
                                (q0 + o, k0 + n)
                            };
                            let (x, dx) = f(scores[at], i, j);
                            scores[at] = x;
                            if CHAIN {
                                derivative[at] = chain(derivative[at], dx);
                            }
                        }
                        continue;
                    }
                    let line = &mut scores[base..base + inner];
                    let d = if CHAIN {
                        &mut derivative[base..base + inner]
                    } else {
                        &mut []
                    };
                    if queries_inner {
                        line_loop::<CHAIN, _>(line, d, |n| (q0 + n, k0 + o), &mut f);
                    } else {
                        line_loop::<CHAIN, _>(line, d, |n| (q0 + o, k0 + n), &mut f);
                    }
                }
            }
        }
        if self.queries.is_empty() || self.keys.is_empty() {
            return;
        }
        let axes = [
            (self.queries.start, self.queries.len(), self.strides.0),
            (self.keys.start, self.keys.len(), self.strides.1),
        ];
        let op = Op::<CHAIN, F> {
            scores: self.scores,
            derivative,
            axes,
            f,
        };
        #[cfg(target_arch = "x86_64")]
        {
            use pulp::x86::{V3, V4};
            if self.isa.includes(Isa::Avx512) {
                if let Some(simd) = V4::try_new() {
                    return Simd::vectorize(simd, op);
                }
            } else if self.isa.includes(Isa::Avx2)
                && let Some(simd) = V3::try_new()
            {
                return Simd::vectorize(simd, op);
            }
        }
        Simd::vectorize(pulp::Scalar::new(), op)
    }
}

/// The chain rule's product `d · g` under the contract's rule for a modifier's outputs:
/// each factor, and the product, saturates at `±f32::MAX` (NaN stays NaN), so a derivative
/// of 0 (a saturated soft-cap) times one of `±inf` (a user modifier's) is 0, not NaN.
/// Selects rather than `clamp`, so that the loops vectorise.
#[inline(always)]
fn chain(d: f32, g: f32) -> f32 {
    saturate(d * saturate(g))
}

/// `x` within `±f32::MAX`; NaN stays NaN.
#[inline(always)]
fn saturate(x: f32) -> f32 {
    let x = if x > f32::MAX { f32::MAX } else { x };
    if x < -f32::MAX { -f32::MAX } else { x }
}

/// One contiguous line of a tile: `f` on every score, the positions from `at(n)`. A
/// function of its own so that `line` and `derivative` are known not to alias whatever `f`
/// reads (argument attributes survive inlining; fields of a struct do not), which is what
/// lets the loop vectorise.
#[inline(always)]
fn line_loop<const CHAIN: bool, F: FnMut(f32, usize, usize) -> (f32, f32)>(
    line: &mut [f32],
    derivative: &mut [f32],
    at: impl Fn(usize) -> (usize, usize),
    f: &mut F,
) {
    if CHAIN {
        for (n, (x, dx)) in line.iter_mut().zip(derivative).enumerate() {
            let (i, j) = at(n);
            let (y, g) = f(*x, i, j);
            (*x, *dx) = (y, chain(*dx, g));
        }
    } else {
        for (n, x) in line.iter_mut().enumerate() {
            let (i, j) = at(n);
            *x = f(*x, i, j).0;
        }
    }
}

/// A user-defined score modifier: `score(s, b, h, i, j)` replaces the score `s` (natural
/// units) of query `i` and key `j` of head `h` of batch entry `b`, before the masks; the
/// backward pass multiplies the score gradient by `derivative` (`∂score/∂s`).
///
/// Set one with [`crate::Options::with_score_mod`]. The engines call [`ScoreMod::modify`]
/// once per tile; its default runs `score` through [`ScoreTile::map`], where it is inlined
/// into a vectorised loop — keep it branch-free arithmetic (no calls into libm) and it
/// vectorises. A NaN it returns poisons its row, as a NaN operand would.
///
/// ```
/// use attn_core::{ScoreMod, ScoreTile};
/// /// Favours keys near the query: `s − 0.1·|i − j|`.
/// #[derive(Debug)]
/// struct Near;
/// impl ScoreMod for Near {
///     fn score(&self, s: f32, _b: usize, _h: usize, i: usize, j: usize) -> f32 {
///         s - 0.1 * (i as f32 - j as f32).abs()
///     }
///     fn derivative(&self, _s: f32, _b: usize, _h: usize, _i: usize, _j: usize) -> f32 {
///         1.0
///     }
/// }
/// let mut s = [1.0f32; 3];
/// Near.modify(&mut ScoreTile::new(&mut s, (3, 1), 0..1, 0..3, 0, 0)?);
/// assert_eq!(s, [1.0, 0.9, 0.8]);
/// # Ok::<(), attn_core::Error>(())
/// ```
pub trait ScoreMod: Debug + Sync {
    /// The modified score of query `i` and key `j` of head `h` of batch entry `b`.
    fn score(&self, s: f32, b: usize, h: usize, i: usize, j: usize) -> f32;

    /// `∂score/∂s` at `s`, for the backward pass.
    fn derivative(&self, s: f32, b: usize, h: usize, i: usize, j: usize) -> f32;

    /// Modifies every score of `tile` (default: [`ScoreMod::score`] through
    /// [`ScoreTile::map`]).
    fn modify(&self, tile: &mut ScoreTile<'_>) {
        let (b, h) = (tile.batch(), tile.head());
        tile.map(|s, i, j| self.score(s, b, h, i, j));
    }

    /// Modifies every score of `tile` and multiplies `derivative` by `∂score/∂s` (default:
    /// both methods through [`ScoreTile::map_chained`]).
    fn modify_chained(&self, tile: &mut ScoreTile<'_>, derivative: &mut [f32]) -> Result<()> {
        let (b, h) = (tile.batch(), tile.head());
        tile.map_chained(derivative, |s, i, j| {
            (self.score(s, b, h, i, j), self.derivative(s, b, h, i, j))
        })
    }

    /// The backward pass hands a modifier with learnable parameters the gradient of the
    /// scores it produced, a tile at a time (default: nothing): `dS_ij = ∂loss/∂score_ij`
    /// ([`ScoreGradient`]), from which it accumulates `∂loss/∂θ = Σ dS_ij · ∂score_ij/∂θ`.
    /// Tiles arrive from the backward's tasks on any thread, in any order, each once: sum
    /// them with a commutative accumulator (in f64, the order's rounding is far below
    /// f32's), or keep them by position and sum in order afterwards.
    ///
    /// ```
    /// use std::sync::Mutex;
    /// use attn_core::{ScoreGradient, ScoreMod};
    /// /// ALiBi with a learnable slope per head: `s + m_h·(j − i)`.
    /// #[derive(Debug)]
    /// struct LearnedAlibi { slopes: Vec<f32>, grads: Mutex<Vec<f64>> }
    /// impl ScoreMod for LearnedAlibi {
    ///     fn score(&self, s: f32, _: usize, h: usize, i: usize, j: usize) -> f32 {
    ///         s + self.slopes[h] * (j as f32 - i as f32)
    ///     }
    ///     fn derivative(&self, _: f32, _: usize, _: usize, _: usize, _: usize) -> f32 { 1.0 }
    ///     fn score_gradient(&self, g: &ScoreGradient<'_>) {
    ///         // ∂score/∂m_h = j − i.
    ///         let mut sum = 0.0f64;
    ///         g.for_each(|ds, i, j| sum += f64::from(ds) * (j as f64 - i as f64));
    ///         self.grads.lock().unwrap()[g.head()] += sum;
    ///     }
    /// }
    /// let alibi = LearnedAlibi { slopes: vec![0.5], grads: Mutex::new(vec![0.0]) };
    /// let ds = [1.0f32, 2.0, 3.0, 4.0]; // 2 queries × 2 keys, column-major
    /// alibi.score_gradient(&ScoreGradient::new(&ds, 2, 0..2, 0..2, 0, 0)?);
    /// assert_eq!(alibi.grads.lock().unwrap()[0], 3.0 - 2.0); // (0,1)·1 + (1,0)·(−1)
    /// # Ok::<(), attn_core::Error>(())
    /// ```
    fn score_gradient(&self, gradient: &ScoreGradient<'_>) {
        let _ = gradient;
    }
}

/// A tile of score gradients for [`ScoreMod::score_gradient`]: queries `queries` against
/// keys `keys` of query head `head` of batch entry `batch`, column-major (`ld` floats
/// between keys), each `∂loss/∂score` of the modified score (0 where the key is hidden).
#[derive(Debug, Clone)]
pub struct ScoreGradient<'t> {
    ds: &'t [f32],
    ld: usize,
    queries: Range<usize>,
    keys: Range<usize>,
    batch: usize,
    head: usize,
}

impl<'t> ScoreGradient<'t> {
    /// The tile over `ds` (column-major, `ld` apart); [`Error::Layout`] when `ds` does not
    /// hold it.
    pub fn new(
        ds: &'t [f32],
        ld: usize,
        queries: Range<usize>,
        keys: Range<usize>,
        batch: usize,
        head: usize,
    ) -> Result<Self> {
        let fits = keys.is_empty()
            || queries.is_empty()
            || (ld >= queries.len()
                && (keys.len() - 1)
                    .checked_mul(ld)
                    .and_then(|x| x.checked_add(queries.len()))
                    .is_some_and(|end| end <= ds.len()));
        if !fits {
            return Err(Error::layout(
                "score gradient tile",
                "the buffer does not hold its queries × keys",
            ));
        }
        Ok(Self {
            ds,
            ld,
            queries,
            keys,
            batch,
            head,
        })
    }

    /// Calls `f(dS, i, j)` for every entry (query `i`, key `j`), key by key.
    pub fn for_each(&self, mut f: impl FnMut(f32, usize, usize)) {
        for (c, j) in self.keys.clone().enumerate() {
            let col = &self.ds[c * self.ld..c * self.ld + self.queries.len()];
            for (&x, i) in col.iter().zip(self.queries.clone()) {
                f(x, i, j);
            }
        }
    }

    /// The batch entry (a packed call's sequence).
    pub fn batch(&self) -> usize {
        self.batch
    }

    /// The query head.
    pub fn head(&self) -> usize {
        self.head
    }

    /// The queries.
    pub fn queries(&self) -> Range<usize> {
        self.queries.clone()
    }

    /// The keys.
    pub fn keys(&self) -> Range<usize> {
        self.keys.clone()
    }
}

/// A user-defined mask: `visible(b, h, i, j)` says whether query `i` of head `h` of batch
/// entry `b` may see key `j`, on top of every other mask. [`MaskMod::coverage`] answers for
/// a whole block, so that the engines skip blocks it hides entirely (as causal blocks are
/// skipped) and check no entry of blocks it leaves wholly visible; its default, `Partial`,
/// checks every entry. It must be right: `Full` only where every entry is visible, `Hidden`
/// only where none is.
///
/// ```
/// use attn_core::{MaskMod, TileCoverage};
/// use core::ops::Range;
/// /// Causal, aligned top-left.
/// #[derive(Debug)]
/// struct Causal;
/// impl MaskMod for Causal {
///     fn visible(&self, _b: usize, _h: usize, i: usize, j: usize) -> bool {
///         j <= i
///     }
///     fn coverage(&self, _b: usize, _h: usize, q: Range<usize>, k: Range<usize>) -> TileCoverage {
///         if k.start > q.end - 1 {
///             TileCoverage::Hidden
///         } else if k.end - 1 <= q.start {
///             TileCoverage::Full
///         } else {
///             TileCoverage::Partial
///         }
///     }
/// }
/// assert_eq!(Causal.coverage(0, 0, 0..64, 64..128), TileCoverage::Hidden);
/// assert_eq!(Causal.coverage(0, 0, 64..128, 0..64), TileCoverage::Full);
/// ```
pub trait MaskMod: Debug + Sync {
    /// Whether query `i` of head `h` of batch entry `b` may see key `j`.
    fn visible(&self, b: usize, h: usize, i: usize, j: usize) -> bool;

    /// What [`MaskMod::visible`] says of every entry of queries `queries` × keys `keys`
    /// (both non-empty): `Partial` when unsure.
    fn coverage(
        &self,
        b: usize,
        h: usize,
        queries: Range<usize>,
        keys: Range<usize>,
    ) -> TileCoverage {
        let _ = (b, h, queries, keys);
        TileCoverage::Partial
    }

    /// Sets the scores of `tile` that [`MaskMod::visible`] hides to `-inf`.
    fn hide(&self, tile: &mut ScoreTile<'_>) {
        let (b, h) = (tile.batch(), tile.head());
        tile.hide(|i, j| self.visible(b, h, i, j));
    }
}

/// `tanh(x)` in f32 as branch-free arithmetic that vectorises (the soft-cap's; libm's
/// `tanhf` is a call per score): a rational minimax approximation of degrees 13/6 on
/// `[−7.905, 7.905]` (Eigen's fast tanh), the argument clamped there (relative error below
/// 4e-7 everywhere, `|tanh(x)| < 1` always); NaN stays NaN.
///
/// ```
/// use attn_core::tanh;
/// for x in [-20.0f32, -1.0, -0.1, 0.0, 0.2, 0.3, 2.5, 9.5] {
///     assert!((tanh(x) as f64 - (x as f64).tanh()).abs() <= 4e-7 * (x as f64).tanh().abs());
/// }
/// assert!(tanh(30.0) <= 1.0 && tanh(30.0) > 0.9999998);
/// assert!(tanh(f32::NAN).is_nan());
/// ```
#[inline(always)]
pub fn tanh(x: f32) -> f32 {
    // Selects, not `clamp` (whose check of its bounds costs the loop its vectors); a NaN
    // passes both comparisons and stays NaN.
    const LIMIT: f32 = 7.905_311;
    let x = if x > LIMIT { LIMIT } else { x };
    let x = if x < -LIMIT { -LIMIT } else { x };
    let x2 = x * x;
    // Fused multiply-adds: one instruction each inside the engines' loops, which are
    // compiled for FMA (a CPU without it computes the same values, slowly, through libm).
    let mut p = -2.760_768_5e-16f32;
    p = p.mul_add(x2, 2.000_188e-13);
    p = p.mul_add(x2, -8.604_672e-11);
    p = p.mul_add(x2, 5.122_297e-8);
    p = p.mul_add(x2, 1.485_722_4e-5);
    p = p.mul_add(x2, 6.372_619e-4);
    p = p.mul_add(x2, 4.893_524_6e-3);
    let mut q = 1.198_258_4e-6f32;
    q = q.mul_add(x2, 1.185_347e-4);
    q = q.mul_add(x2, 2.268_434_6e-3);
    q = q.mul_add(x2, 4.893_525e-3);
    x * p / q
}

//! Which keys each query may see: the mask kinds of the contract and their combination.
//!
//! Structural constraints (causal, sliding window, key padding) always leave each query a
//! contiguous range of visible keys whose ends never decrease from one query to the next.
//! Engines use that to skip whole tiles and to mask only the tiles that straddle a
//! boundary. Element-wise masks (boolean and additive) are applied on top, entry by entry.

use core::ops::Range;

use faer::MatRef;

/// Alignment of the causal diagonal when `n_q ≠ n_k`. The contract never guesses it.
///
/// ```
/// use attn_core::Causal;
/// // 2 new queries against 5 cached keys: bottom-right lets the last query see every key.
/// assert_eq!(Causal::TopLeft.offset(2, 5), 0);
/// assert_eq!(Causal::BottomRight.offset(2, 5), 3);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Causal {
    /// Key `j` visible to query `i` when `j ≤ i` (PyTorch `is_causal`).
    TopLeft,
    /// Key `j` visible to query `i` when `j ≤ i + (n_k − n_q)` (FlashAttention ≥ 2.1,
    /// decoding with a cache: the last query is aligned with the last key).
    BottomRight,
}

impl Causal {
    /// The diagonal offset: query `i` is aligned with key `i + offset` (saturated at the
    /// ends of `i64` for lengths beyond it).
    pub fn offset(self, n_q: usize, n_k: usize) -> i64 {
        let wide = self.offset_wide(n_q, n_k);
        wide.clamp(i64::MIN.into(), i64::MAX.into()) as i64
    }

    /// [`Causal::offset`] without saturation: every `usize` difference fits an `i128`.
    fn offset_wide(self, n_q: usize, n_k: usize) -> i128 {
        match self {
            Causal::TopLeft => 0,
            Causal::BottomRight => n_k as i128 - n_q as i128,
        }
    }
}

/// A sliding window around the aligned diagonal `c = i + offset`: key `j` is visible when
/// `c − left ≤ j ≤ c + right`. `None` leaves that side unbounded.
///
/// ```
/// use attn_core::{Causal, SlidingWindow};
/// // Each query sees itself and the two keys before it (Mistral-style local attention).
/// let w = SlidingWindow::new(Some(2), Some(0), Causal::BottomRight);
/// assert_eq!(w.left, Some(2));
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct SlidingWindow {
    /// Keys visible before the diagonal.
    pub left: Option<usize>,
    /// Keys visible after the diagonal.
    pub right: Option<usize>,
    /// How the diagonal is aligned when `n_q ≠ n_k`.
    pub align: Causal,
}

impl SlidingWindow {
    /// A window of `left` keys before and `right` keys after the aligned diagonal.
    pub fn new(left: Option<usize>, right: Option<usize>, align: Causal) -> Self {
        Self { left, right, align }
    }
}

/// An explicit boolean mask of shape `[n_q, n_k]`, with its polarity in its name.
///
/// ```
/// use attn_core::BoolMask;
/// use faer::mat;
/// let m = mat![[true, false]];
/// // PyTorch SDPA convention: true = may attend.
/// assert!(BoolMask::allow(m.as_ref()).allows(0, 0));
/// // nn.MultiheadAttention / burn convention: true = masked out.
/// assert!(!BoolMask::block(m.as_ref()).allows(0, 0));
/// ```
#[derive(Debug, Clone, Copy)]
pub enum BoolMask<'a> {
    /// `true` means the query may attend the key.
    Allow(MatRef<'a, bool>),
    /// `true` means the key is masked out.
    Block(MatRef<'a, bool>),
}

impl<'a> BoolMask<'a> {
    /// A mask where `true` means "may attend" (PyTorch SDPA's `attn_mask`).
    pub fn allow(mask: MatRef<'a, bool>) -> Self {
        BoolMask::Allow(mask)
    }

    /// A mask where `true` means "masked out" (`key_padding_mask` of
    /// `nn.MultiheadAttention`, burn).
    pub fn block(mask: MatRef<'a, bool>) -> Self {
        BoolMask::Block(mask)
    }

    /// The underlying matrix, whatever its polarity.
    pub fn matrix(&self) -> MatRef<'a, bool> {
        match *self {
            BoolMask::Allow(m) | BoolMask::Block(m) => m,
        }
    }

    /// Whether query `i` may attend key `j` according to this mask alone.
    pub fn allows(&self, i: usize, j: usize) -> bool {
        match *self {
            BoolMask::Allow(m) => m[(i, j)],
            BoolMask::Block(m) => !m[(i, j)],
        }
    }
}

/// Key padding: only the first `len` keys are real.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeyPadding<'a> {
    /// One valid length for every batch entry.
    Uniform(usize),
    /// One valid length per batch entry (ragged batches).
    PerBatch(&'a [usize]),
}

/// How a rectangular tile of scores relates to the structural constraints.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TileCoverage {
    /// No entry is visible: the tile can be skipped.
    Hidden,
    /// Every entry is visible: no structural masking needed.
    Full,
    /// Some entries are visible: mask entry by entry.
    Partial,
}

/// The constraints of one head, resolved against its `n_q × n_k` shape.
///
/// ```
/// use attn_core::{Causal, HeadMask, Options};
/// let opts = Options::default().with_causal(Causal::BottomRight);
/// let mask = HeadMask::new(&opts, 2, 4, None);
/// assert_eq!(mask.key_range(0), 0..3);
/// assert_eq!(mask.key_range(1), 0..4);
/// ```
#[derive(Debug, Clone, Copy)]
pub struct HeadMask<'a> {
    // Offsets and bounds in i128, where no sum of `usize` lengths and bounds overflows:
    // a window bound near `usize::MAX` means "unbounded on that side", not a wrap-around.
    causal_offset: Option<i128>,
    window: Option<(i128, Option<usize>, Option<usize>)>,
    key_len: usize,
    boolean: Option<BoolMask<'a>>,
    additive: Option<MatRef<'a, f32>>,
    /// The user's mask and the (batch entry, query head) it is asked about.
    user: Option<&'a dyn crate::MaskMod>,
    position: (usize, usize),
    /// Added to a query's index before the user's mask sees it (a KV cache's new rows).
    query_offset: usize,
}

impl<'a> HeadMask<'a> {
    /// Resolves `options` for a head with `n_q` queries and `n_k` keys; `key_len` is the
    /// valid key length of this head's batch entry, if any (already validated ≤ `n_k`).
    pub fn new(
        options: &super::Options<'a>,
        n_q: usize,
        n_k: usize,
        key_len: Option<usize>,
    ) -> Self {
        Self {
            causal_offset: options.causal.map(|c| c.offset_wide(n_q, n_k)),
            window: options
                .window
                .map(|w| (w.align.offset_wide(n_q, n_k), w.left, w.right)),
            key_len: key_len.unwrap_or(n_k).min(n_k),
            boolean: options.bool_mask,
            additive: options.additive_mask,
            user: options.mask_mod,
            position: (0, 0),
            query_offset: 0,
        }
    }

    /// The same mask for head `head` of batch entry `batch` (a packed call's sequence): the
    /// position a user's [`crate::MaskMod`] is asked about.
    ///
    /// ```
    /// use attn_core::{HeadMask, MaskMod, Options};
    /// #[derive(Debug)]
    /// struct OddHeadsSeeNothing;
    /// impl MaskMod for OddHeadsSeeNothing {
    ///     fn visible(&self, _: usize, h: usize, _: usize, _: usize) -> bool { h % 2 == 0 }
    /// }
    /// let opts = Options::default().with_mask_mod(&OddHeadsSeeNothing);
    /// let mask = HeadMask::new(&opts, 1, 1, None);
    /// assert!(mask.at(0, 2).allows(0, 0) && !mask.at(0, 3).allows(0, 0));
    /// ```
    pub fn at(self, batch: usize, head: usize) -> Self {
        Self {
            position: (batch, head),
            ..self
        }
    }

    /// The same mask with query `i` shown to the user's mask as `i + offset`: a KV
    /// cache's new rows are the positions after the cached keys.
    ///
    /// ```
    /// use attn_core::{HeadMask, MaskMod, Options};
    /// #[derive(Debug)]
    /// struct Causal;
    /// impl MaskMod for Causal {
    ///     fn visible(&self, _: usize, _: usize, i: usize, j: usize) -> bool { j <= i }
    /// }
    /// let opts = Options::default().with_mask_mod(&Causal);
    /// let decode = HeadMask::new(&opts, 1, 8, None).with_query_offset(7); // the 8th token
    /// assert!(decode.allows(0, 7));
    /// ```
    pub fn with_query_offset(self, offset: usize) -> Self {
        Self {
            query_offset: offset,
            ..self
        }
    }

    /// The user's mask, if any, with the position it is asked about and the offset of
    /// query indices.
    pub fn user(&self) -> Option<(&'a dyn crate::MaskMod, (usize, usize), usize)> {
        self.user.map(|m| (m, self.position, self.query_offset))
    }

    /// What the user's mask says of the tile `rows × cols` (`Full` without one).
    ///
    /// ```
    /// use attn_core::{HeadMask, Options, TileCoverage};
    /// let mask = HeadMask::new(&Options::default(), 4, 4, None);
    /// assert_eq!(mask.user_coverage(0..4, 0..4), TileCoverage::Full);
    /// ```
    pub fn user_coverage(&self, rows: Range<usize>, cols: Range<usize>) -> TileCoverage {
        match self.user {
            Some(m) if !rows.is_empty() && !cols.is_empty() => {
                let off = self.query_offset;
                let rows = rows.start + off..rows.end + off;
                m.coverage(self.position.0, self.position.1, rows, cols)
            }
            Some(_) => TileCoverage::Hidden,
            None => TileCoverage::Full,
        }
    }

    /// [`HeadMask::new`] for query head `head` of batch entry `batch` of a batched call:
    /// the options' `[B, H, n_q, n_k]` masks, if any, resolved to this head's
    /// `[n_q, n_k]` views (the options validated against the call first, by
    /// [`crate::Options::validate_batched`]).
    ///
    /// ```
    /// use attn_core::{BoolMask4, HeadMask, Mask4Ref, Options};
    /// // Batch entry 1 hides key 0 from every head and query; entry 0 hides nothing.
    /// let bits = [false, false, true, false];
    /// let m = Mask4Ref::new(&bits, [2, 1, 1, 2], [2, 0, 0, 1])?;
    /// let opts = Options::default().with_bool_mask_4d(BoolMask4::block(m));
    /// assert!(HeadMask::for_head(&opts, 0, 3, 4, 2, None)?.allows(3, 0));
    /// assert!(!HeadMask::for_head(&opts, 1, 3, 4, 2, None)?.allows(3, 0));
    /// # Ok::<(), attn_core::Error>(())
    /// ```
    pub fn for_head(
        options: &super::Options<'a>,
        batch: usize,
        head: usize,
        n_q: usize,
        n_k: usize,
        key_len: Option<usize>,
    ) -> crate::Result<Self> {
        Self::for_cached_head(options, batch, head, n_q, n_k, n_k, key_len)
    }

    /// [`HeadMask::for_head`] for a head whose `n_k` keys are the first of the `mask_keys`
    /// along the 4-D masks' key axis (a KV cache entry shorter than the longest).
    ///
    /// ```
    /// use attn_core::{BoolMask4, HeadMask, Mask4Ref, Options};
    /// let bits = [true, true, false, true, true]; // over the longest entry's 5 keys
    /// let m = Mask4Ref::new(&bits, [2, 1, 1, 5], [0, 0, 0, 1])?;
    /// let opts = Options::default().with_bool_mask_4d(BoolMask4::allow(m));
    /// let short = HeadMask::for_cached_head(&opts, 1, 0, 1, 3, 5, None)?; // 3 cached keys
    /// assert!(short.allows(0, 1) && !short.allows(0, 2));
    /// assert_eq!(short.key_range(0), 0..3);
    /// # Ok::<(), attn_core::Error>(())
    /// ```
    pub fn for_cached_head(
        options: &super::Options<'a>,
        batch: usize,
        head: usize,
        n_q: usize,
        n_k: usize,
        mask_keys: usize,
        key_len: Option<usize>,
    ) -> crate::Result<Self> {
        let mut mask = Self::new(options, n_q, n_k, key_len).at(batch, head);
        let keys = n_k.min(mask_keys);
        if let Some(m) = options.bool_mask_4d {
            let m = m.head(batch, head, n_q, mask_keys)?;
            mask.boolean = Some(match m {
                BoolMask::Allow(m) => BoolMask::Allow(m.subcols(0, keys)),
                BoolMask::Block(m) => BoolMask::Block(m.subcols(0, keys)),
            });
        }
        if let Some(m) = options.additive_mask_4d {
            mask.additive = Some(m.head(batch, head, n_q, mask_keys)?.subcols(0, keys));
        }
        Ok(mask)
    }

    /// The keys that the structural constraints (causal, window, padding) leave visible to
    /// query `i`. Both ends are non-decreasing in `i`. Empty when nothing is visible.
    pub fn key_range(&self, i: usize) -> Range<usize> {
        let i = i as i128;
        let mut lo: i128 = 0;
        let mut hi: i128 = self.key_len as i128;
        if let Some(off) = self.causal_offset {
            hi = hi.min(i + off + 1);
        }
        if let Some((off, left, right)) = self.window {
            let c = i + off;
            if let Some(l) = left {
                lo = lo.max(c - l as i128);
            }
            if let Some(r) = right {
                hi = hi.min(c + r as i128 + 1);
            }
        }
        // 0 ≤ lo ≤ hi ≤ key_len, so both fit a usize.
        let hi = hi.max(0) as usize;
        let lo = (lo.max(0) as usize).min(hi);
        lo..hi
    }

    /// Whether any element-wise mask (boolean or additive) is present.
    pub fn has_elementwise(&self) -> bool {
        self.boolean.is_some() || self.additive.is_some()
    }

    /// The boolean mask, if any.
    pub fn boolean(&self) -> Option<BoolMask<'a>> {
        self.boolean
    }

    /// The additive mask, if any.
    pub fn additive(&self) -> Option<MatRef<'a, f32>> {
        self.additive
    }

    /// Whether query `i` may attend key `j` under every structural and boolean constraint.
    /// The additive mask is not consulted: a `-inf` entry hides the key through the sum.
    pub fn allows(&self, i: usize, j: usize) -> bool {
        self.key_range(i).contains(&j)
            && self.boolean.is_none_or(|b| b.allows(i, j))
            && self.user.is_none_or(|m| {
                m.visible(self.position.0, self.position.1, i + self.query_offset, j)
            })
    }

    /// Whether key `j` reaches query `i` at all: [`HeadMask::allows`] and no `-inf` in the
    /// additive mask. A key that does not must contribute nothing to the row, not `0·V_j`.
    pub fn sees(&self, i: usize, j: usize) -> bool {
        self.allows(i, j) && self.additive.is_none_or(|a| a[(i, j)] != f32::NEG_INFINITY)
    }

    /// The additive mask entry for `(i, j)`, `0` without an additive mask.
    pub fn bias(&self, i: usize, j: usize) -> f32 {
        self.additive.map_or(0.0, |m| m[(i, j)])
    }

    /// How the tile `rows × cols` relates to the structural constraints and the user's
    /// mask ([`HeadMask::user_coverage`]): `Hidden` also when the boolean mask hides every
    /// entry the structure leaves visible. Otherwise element-wise masks are not considered
    /// (see [`HeadMask::has_elementwise`]).
    pub fn tile_coverage(&self, rows: Range<usize>, cols: Range<usize>) -> TileCoverage {
        if rows.is_empty() || cols.is_empty() {
            return TileCoverage::Hidden;
        }
        // Both ends of key_range are monotone in the row, so the first and last rows bound
        // every row of the tile.
        let first = self.key_range(rows.start);
        let last = self.key_range(rows.end - 1);
        let any_row_sees = rows.clone().any(|i| {
            let r = self.key_range(i);
            r.start < cols.end && cols.start < r.end
        });
        if !any_row_sees {
            return TileCoverage::Hidden;
        }
        // A tile that the boolean mask hides entirely is skipped as a structural one is.
        if let Some(b) = self.boolean {
            let any_allowed = rows.clone().any(|i| {
                let r = self.key_range(i);
                (r.start.max(cols.start)..r.end.min(cols.end)).any(|j| b.allows(i, j))
            });
            if !any_allowed {
                return TileCoverage::Hidden;
            }
        }
        let user = self.user_coverage(rows.clone(), cols.clone());
        if user == TileCoverage::Hidden {
            return TileCoverage::Hidden;
        }
        let all_cover = user == TileCoverage::Full
            && first.start <= cols.start
            && cols.end <= first.end
            && last.start <= cols.start
            && cols.end <= last.end;
        if all_cover {
            TileCoverage::Full
        } else {
            TileCoverage::Partial
        }
    }
}

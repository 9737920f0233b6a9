//! Attention dropout: which weights a training call drops, as a pure function of their
//! position.
//!
//! After the softmax each weight `A_ij` is kept with probability `1 − p` and scaled by
//! `1/(1 − p)`, or set to 0 (torch's `dropout_p`); the LSE stays the undropped softmax's.
//! Whether `(batch entry, head, query, key)` is kept comes from a counter-based generator,
//! Philox4x32-10 (what PyTorch and FlashAttention use), keyed by the call's seed: the
//! backward pass regenerates the forward's mask, and any tiling or thread count gives the
//! same bits. One Philox call gives the random bits of eight consecutive keys of one query:
//!
//! - key `(seed_lo, seed_hi)`,
//! - counter `(query, key / 8, stream, offset)`, where `stream = batch · h_q + head`
//!   (a packed call's sequence is its batch entry; grouped-query heads count as query
//!   heads) and `offset` a second index the caller may advance between calls,
//! - of output word `(key % 8) / 2`, the low 16 bits for an even key, the high ones for an
//!   odd key; the weight is kept when they are at least `round(p · 2¹⁶)`. `p` is thereby
//!   rounded to a multiple of `2⁻¹⁶` (the keep rate is `1 − p` within `2⁻¹⁷`; the kept
//!   weights are scaled by the exact `1/(1 − p)`): sixteen bits a decision halve the
//!   generator's work, which is all of dropout's cost.
//!
//! Queries and keys are a sequence's own positions (0 for its first).

use crate::{Error, Result};

/// Philox4x32's multipliers (of the counter's words 0 and 2).
pub const PHILOX_MULTIPLIERS: [u32; 2] = [0xD251_1F53, 0xCD9E_8D57];
/// What Philox4x32 adds to its key words after each round (Weyl sequences).
pub const PHILOX_WEYL: [u32; 2] = [0x9E37_79B9, 0xBB67_AE85];
/// Philox4x32's rounds.
pub const PHILOX_ROUNDS: usize = 10;
const M0: u32 = PHILOX_MULTIPLIERS[0];
const M1: u32 = PHILOX_MULTIPLIERS[1];
const W0: u32 = PHILOX_WEYL[0];
const W1: u32 = PHILOX_WEYL[1];

/// One Philox4x32-10 block: four random words of `counter` under `key` (Salmon et al.,
/// "Parallel random numbers: as easy as 1, 2, 3", 2011).
///
/// ```
/// // The first known-answer vector of the Random123 distribution.
/// assert_eq!(
///     attn_core::philox([0; 4], [0; 2]),
///     [0x6627_e8d5, 0xe169_c58d, 0xbc57_ac4c, 0x9b00_dbd8]
/// );
/// ```
#[inline]
pub fn philox(counter: [u32; 4], key: [u32; 2]) -> [u32; 4] {
    let [mut c0, mut c1, mut c2, mut c3] = counter;
    let [mut k0, mut k1] = key;
    for _ in 0..PHILOX_ROUNDS {
        let p0 = u64::from(M0) * u64::from(c0);
        let p1 = u64::from(M1) * u64::from(c2);
        (c0, c1, c2, c3) = (
            (p1 >> 32) as u32 ^ c1 ^ k0,
            p1 as u32,
            (p0 >> 32) as u32 ^ c3 ^ k1,
            p0 as u32,
        );
        k0 = k0.wrapping_add(W0);
        k1 = k1.wrapping_add(W1);
    }
    [c0, c1, c2, c3]
}

/// Attention dropout for a training call: the probability `p` of dropping a weight and
/// the generator's seed and offset (the module documentation says how they key it).
///
/// ```
/// use attn_core::{Dropout, Options};
/// let dropout = Dropout::new(0.1, 42)?;
/// let opts = Options::default().with_dropout(dropout);
/// assert!(opts.validate(1, 4, 4, 8).is_ok());
/// let head = opts.head_dropout(0, 0, 1).unwrap();
/// let kept = (0..1000).filter(|&j| head.keeps(3, j)).count();
/// assert!((850..950).contains(&kept)); // about 90 %
/// assert!(Dropout::new(1.5, 0).is_err());
/// # Ok::<(), attn_core::Error>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Dropout {
    p: f32,
    seed: u64,
    offset: u32,
    /// Where this call's heads sit in a larger call ([`Dropout::within`]): its first batch
    /// entry and head, and the larger call's query heads.
    origin: Option<(usize, usize, usize)>,
}

impl Dropout {
    /// Drops each weight with probability `p` (`0 ≤ p ≤ 1`; `p = 0` drops nothing and
    /// computes exactly what a call without dropout does), keyed by `seed`.
    pub fn new(p: f32, seed: u64) -> Result<Self> {
        if !(0.0..=1.0).contains(&p) {
            return Err(Error::invalid_value(
                "dropout probability",
                0,
                p,
                "in [0, 1]",
            ));
        }
        Ok(Self {
            p,
            seed,
            offset: 0,
            origin: None,
        })
    }

    /// The same dropout at a different `offset` (the counter's last word): successive
    /// calls with one seed draw different masks at different offsets.
    pub fn with_offset(mut self, offset: u32) -> Self {
        self.offset = offset;
        self
    }

    /// The dropout of a call that computes part of a larger one: its batch entry (or
    /// packed sequence) `b` is the larger call's `batch + b`, its head `h` the larger call's
    /// `head + h` of `heads` query heads — so that each of its heads draws the mask the
    /// larger call would (a binding that splits a call into several keeps its bits).
    ///
    /// ```
    /// use attn_core::Dropout;
    /// let whole = Dropout::new(0.5, 3)?;
    /// let part = whole.within(1, 2, 4); // batch entry 1, heads 2.. of 4
    /// assert_eq!(part.for_head(0, 1, 2), whole.for_head(1, 3, 4));
    /// # Ok::<(), attn_core::Error>(())
    /// ```
    pub fn within(mut self, batch: usize, head: usize, heads: usize) -> Self {
        let (b0, h0, _) = self.origin.unwrap_or((0, 0, heads));
        // Nested: the larger call's origin shifts by this one's.
        self.origin = Some((b0 + batch, h0 + head, self.origin.map_or(heads, |o| o.2)));
        self
    }

    /// The probability of dropping a weight.
    pub fn p(&self) -> f32 {
        self.p
    }

    /// The generator's seed.
    pub fn seed(&self) -> u64 {
        self.seed
    }

    /// The generator's offset.
    pub fn offset(&self) -> u32 {
        self.offset
    }

    /// What head `h` of batch entry `b` (of `h_q` query heads) drops; `None` when `p = 0`.
    pub fn for_head(&self, b: usize, h: usize, h_q: usize) -> Option<HeadDropout> {
        if self.p == 0.0 {
            return None;
        }
        // Validated: the stream fits in a counter word (`check`).
        let stream = match self.origin {
            None => b * h_q + h,
            Some((b0, h0, heads)) => (b0 + b) * heads + h0 + h,
        } as u32;
        let threshold = (f64::from(self.p) * 65_536.0).round() as u32;
        Some(HeadDropout {
            threshold,
            scale: if self.p < 1.0 {
                1.0 / (1.0 - self.p)
            } else {
                0.0
            },
            key: [self.seed as u32, (self.seed >> 32) as u32],
            stream,
            offset: self.offset,
        })
    }

    /// Checks that every head of a call of `batch` entries of `h_q` query heads has its own
    /// stream (a counter word).
    pub fn check_streams(&self, batch: usize, h_q: usize) -> Result<()> {
        let (b0, h0, heads) = self.origin.unwrap_or((0, 0, h_q));
        let last = (b0 + batch)
            .checked_mul(heads.max(h_q))
            .and_then(|x| x.checked_add(h0 + h_q));
        let cap = 1usize << 32;
        match last {
            Some(n) if n <= cap => Ok(()),
            _ => Err(Error::capacity(
                "dropout streams (batch entries × query heads)",
                last.unwrap_or(usize::MAX),
                cap,
            )),
        }
    }

    /// Checks that every query and key of a sequence of `n_q` queries and `n_k` keys has
    /// its own counter.
    pub fn check_positions(&self, n_q: usize, n_k: usize) -> Result<()> {
        let cap = 1usize << 32;
        if n_q > cap {
            return Err(Error::capacity("dropout queries", n_q, cap));
        }
        if n_k > cap.saturating_mul(8) {
            return Err(Error::capacity("dropout keys", n_k, cap.saturating_mul(8)));
        }
        Ok(())
    }
}

/// What one head drops: [`Dropout`] resolved for its batch entry and query head.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct HeadDropout {
    /// A weight is kept when its 16 bits are at least this (`round(p · 2¹⁶)`, up to
    /// `2¹⁶`, which keeps nothing).
    pub threshold: u32,
    /// What a kept weight is multiplied by: `1/(1 − p)` in f32 (0 when `p = 1`).
    pub scale: f32,
    /// Philox's key: the seed's low and high words.
    pub key: [u32; 2],
    /// The counter's third word: `batch · h_q + head`.
    pub stream: u32,
    /// The counter's fourth word.
    pub offset: u32,
}

impl HeadDropout {
    /// The four words of query `i`'s keys `8·octet .. 8·octet + 8` (two keys a word).
    #[inline]
    pub fn words(&self, i: usize, octet: usize) -> [u32; 4] {
        philox([i as u32, octet as u32, self.stream, self.offset], self.key)
    }

    /// The 16 random bits of key `j` in the word that holds them.
    #[inline]
    pub fn bits(word: u32, j: usize) -> u32 {
        (word >> (16 * (j % 2))) & 0xFFFF
    }

    /// Whether the weight of query `i` and key `j` is kept.
    #[inline]
    pub fn keeps(&self, i: usize, j: usize) -> bool {
        Self::bits(self.words(i, j / 8)[j % 8 / 2], j) >= self.threshold
    }

    /// What the weight of query `i` and key `j` is multiplied by: `1/(1 − p)` or 0.
    #[inline]
    pub fn factor(&self, i: usize, j: usize) -> f32 {
        if self.keeps(i, j) { self.scale } else { 0.0 }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn philox_known_answers() {
        // Random123's kat_vectors for philox4x32_10.
        assert_eq!(
            philox([u32::MAX; 4], [u32::MAX; 2]),
            [0x408f_276d, 0x41c8_3b0e, 0xa20b_c7c6, 0x6d54_51fd]
        );
        assert_eq!(
            philox(
                [0x243f_6a88, 0x85a3_08d3, 0x1319_8a2e, 0x0370_7344],
                [0xa409_3822, 0x299f_31d0]
            ),
            [0xd16c_fe09, 0x94fd_cceb, 0x5001_e420, 0x2412_6ea1]
        );
    }

    #[test]
    fn p_zero_is_no_dropout_and_p_one_drops_everything() {
        assert!(Dropout::new(0.0, 7).unwrap().for_head(0, 0, 1).is_none());
        let all = Dropout::new(1.0, 7).unwrap().for_head(1, 2, 4).unwrap();
        assert!((0..64).all(|j| !all.keeps(j % 5, j)));
        assert_eq!(all.factor(0, 0), 0.0);
        assert!(Dropout::new(f32::NAN, 0).is_err());
        assert!(Dropout::new(-0.1, 0).is_err());
    }

    #[test]
    fn positions_streams_and_seeds_draw_different_masks() {
        let d = Dropout::new(0.5, 1).unwrap();
        let mask = |h: HeadDropout| {
            (0..256)
                .map(|j| h.keeps(j / 16, j % 16))
                .collect::<Vec<_>>()
        };
        let a = mask(d.for_head(0, 0, 2).unwrap());
        assert_ne!(a, mask(d.for_head(0, 1, 2).unwrap()));
        assert_ne!(a, mask(d.with_offset(1).for_head(0, 0, 2).unwrap()));
        assert_ne!(
            a,
            mask(Dropout::new(0.5, 2).unwrap().for_head(0, 0, 2).unwrap())
        );
        assert_eq!(a, mask(d.for_head(0, 0, 2).unwrap()));
    }
}

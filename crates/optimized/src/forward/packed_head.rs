//! K and V of a head packed once for the native products (the tiles of
//! [`Products::Tiles`](crate::kernel::Products::Tiles), which the pair products of
//! [`Products::Pairs`](crate::kernel::Products::Pairs) read as they are), for every
//! query tile of the head — and every query head of a grouped-query group — to read,
//! instead of each query tile packing each key block again.
//!
//! K is packed as rows (`k_ld` words each) and V as columns of row pairs (`v_ld` words
//! each) over the head's whole key range, so a block of keys is a slice: any block for K,
//! a block starting at an even key for V (its pairs must be the head's). The buffers run
//! on past the last key with zeros for a whole tile, so a block's last tile may read past
//! its end: K's rows there only make scores that are discarded, and V's pairs there meet
//! P's zero padding (V is packed only when every entry is finite, so `0·v` is 0).

use std::sync::OnceLock;

use crate::kernel::amx::{self, LineWords, Split, TileRows};
use crate::kernel::element::Element;
use crate::kernel::pair_dot::{self, SplitStage};
use crate::keys::{KeySource, PairOrder};

/// One head's packed K and V; either may be missing (an entry the tiles cannot multiply
/// exactly: that part is packed per block as before). Operands split in two bf16 parts
/// ([`Split`]) have their low parts beside, laid out alike (empty for one part).
#[derive(Debug)]
pub(super) struct PackedHead {
    k: Option<[LineWords; 2]>,
    k_ld: usize,
    v: Option<[LineWords; 2]>,
    v_ld: usize,
    d_v: usize,
    /// K holds an infinity or a NaN.
    k_non_finite: bool,
}

impl PackedHead {
    /// Packs `k` and `v` (the head's whole key range), split in two parts when `split`;
    /// `None` when neither can be packed (an entry too small for the tiles, inputs of
    /// another type, or no memory for the buffers).
    pub(super) fn new<T: Element, K: KeySource<T>>(k: &K, v: &K, split: bool) -> Option<Self> {
        let (n, d_k, d_v) = (k.len(), k.width(), v.width());
        let k_ld = pair_dot::pairs(d_k).next_multiple_of(amx::TILE);
        // A block's last tile reads up to a tile past the block.
        let rows = n.next_multiple_of(amx::TILE) + amx::TILE;
        let v_ld = pair_dot::pairs(n).next_multiple_of(amx::TILE) + amx::TILE;
        let mut stage = match split {
            true => Some(SplitStage::new(n.checked_mul(d_k.max(d_v))?)?),
            false => None,
        };
        let mut pack = |src: &K, order: PairOrder, len: usize| {
            let mut hi = zeroed(len)?;
            let mut lo = if split {
                zeroed(len)?
            } else {
                LineWords::default()
            };
            let report = match stage.as_mut() {
                Some(stage) => src.to_split_pairs(order, &mut hi, &mut lo, stage)?,
                None => src.to_pairs(order, &mut hi)?,
            };
            Some(([hi, lo], report))
        };
        let mut k_non_finite = false;
        let k = pack(k, PairOrder::Rows { ld: k_ld }, rows * k_ld).and_then(|(k, report)| {
            k_non_finite = report.non_finite;
            (!report.subnormal).then_some(k)
        });
        let v_len = d_v.next_multiple_of(amx::TILE) * v_ld;
        let v = pack(v, PairOrder::Columns { ld: v_ld }, v_len)
            .and_then(|(v, report)| report.exact().then_some(v));
        (k.is_some() || v.is_some()).then_some(Self {
            k,
            k_ld,
            v,
            v_ld,
            d_v,
            k_non_finite,
        })
    }

    /// Whether the packed K holds an infinity or a NaN.
    pub(super) fn keys_non_finite(&self) -> bool {
        self.k_non_finite
    }

    /// Keys `keys` (of the head's range) as the A operand of `Sᵀ = K·Qᵀ`.
    pub(super) fn keys(&self, keys: core::ops::Range<usize>) -> Option<Split<TileRows<'_>>> {
        let [hi, lo] = self.k.as_ref()?;
        let at = keys.start * self.k_ld;
        let rows = |words| TileRows {
            words,
            ld: self.k_ld,
            rows: keys.len(),
            pairs: self.k_ld,
        };
        Some(Split {
            hi: rows(&hi[at..]),
            lo: (!lo.is_empty()).then(|| rows(&lo[at..])),
        })
    }

    /// Values of keys `keys` as the A operand of `Oᵀ += Vᵀ·Pᵀ`, when their pairs are the
    /// head's (`keys` starts at an even key).
    pub(super) fn values(&self, keys: core::ops::Range<usize>) -> Option<Split<TileRows<'_>>> {
        let [hi, lo] = self.v.as_ref()?;
        let at = keys.start / 2;
        let rows = |words| TileRows {
            words,
            ld: self.v_ld,
            rows: self.d_v,
            pairs: pair_dot::pairs(keys.len()).next_multiple_of(amx::TILE),
        };
        keys.start.is_multiple_of(2).then(|| Split {
            hi: rows(&hi[at..]),
            lo: (!lo.is_empty()).then(|| rows(&lo[at..])),
        })
    }
}

/// A zeroed buffer of `n` words, or `None` when it cannot be allocated (the caller then
/// packs per block, as without this module).
fn zeroed(n: usize) -> Option<LineWords> {
    LineWords::zeroed("packed keys and values", Some(n)).ok()
}

/// The packed heads of one call: one slot per distinct K/V source, packed by the first
/// task that needs it.
#[derive(Debug, Default)]
pub(super) struct PackedHeads {
    slots: Vec<OnceLock<Option<PackedHead>>>,
}

impl PackedHeads {
    /// Slots for `sources` distinct K/V sources.
    pub(super) fn new(sources: usize) -> Self {
        Self {
            slots: (0..sources).map(|_| OnceLock::new()).collect(),
        }
    }

    /// Source `slot`'s packed head, packed now if it is the first to be asked.
    pub(super) fn get<T: Element, K: KeySource<T>>(
        &self,
        slot: usize,
        (k, v): (&K, &K),
        split: bool,
    ) -> Option<&PackedHead> {
        self.slots
            .get(slot)?
            .get_or_init(|| PackedHead::new(k, v, split))
            .as_ref()
    }
}

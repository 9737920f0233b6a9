//! K and V of a head packed once for the tile products
//! ([`Products::Tiles`](crate::kernel::Products::Tiles)), for every
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

use crate::kernel::amx::{self, TileRows};
use crate::kernel::element::Element;
use crate::kernel::pair_dot;
use crate::keys::{KeySource, PairOrder};

/// One head's packed K and V; either may be missing (an entry the tiles cannot multiply
/// exactly: that part is packed per block as before).
#[derive(Debug)]
pub(super) struct PackedHead {
    k: Option<Vec<u32>>,
    k_ld: usize,
    v: Option<Vec<u32>>,
    v_ld: usize,
    d_v: usize,
}

impl PackedHead {
    /// Packs `k` and `v` (the head's whole key range); `None` when neither can be packed
    /// (not bf16, an entry too small for the tiles, or no memory for the buffers).
    pub(super) fn new<T: Element, K: KeySource<T>>(k: &K, v: &K) -> Option<Self> {
        let (n, d_k, d_v) = (k.len(), k.width(), v.width());
        let k_ld = pair_dot::pairs(d_k).next_multiple_of(amx::TILE);
        // A block's last tile reads up to a tile past the block.
        let rows = n.next_multiple_of(amx::TILE) + amx::TILE;
        let v_ld = pair_dot::pairs(n).next_multiple_of(amx::TILE) + amx::TILE;
        let k = zeroed(rows * k_ld).and_then(|mut buf| {
            let report = k.to_pairs(PairOrder::Rows { ld: k_ld }, &mut buf)?;
            (!report.subnormal).then_some(buf)
        });
        let v = zeroed(d_v.next_multiple_of(amx::TILE) * v_ld).and_then(|mut buf| {
            let report = v.to_pairs(PairOrder::Columns { ld: v_ld }, &mut buf)?;
            report.exact().then_some(buf)
        });
        (k.is_some() || v.is_some()).then_some(Self {
            k,
            k_ld,
            v,
            v_ld,
            d_v,
        })
    }

    /// Keys `keys` (of the head's range) as the A operand of `Sᵀ = K·Qᵀ`.
    pub(super) fn keys(&self, keys: core::ops::Range<usize>) -> Option<TileRows<'_>> {
        let k = self.k.as_deref()?;
        Some(TileRows {
            words: &k[keys.start * self.k_ld..],
            ld: self.k_ld,
            rows: keys.len(),
            pairs: self.k_ld,
        })
    }

    /// Values of keys `keys` as the A operand of `Oᵀ += Vᵀ·Pᵀ`, when their pairs are the
    /// head's (`keys` starts at an even key).
    pub(super) fn values(&self, keys: core::ops::Range<usize>) -> Option<TileRows<'_>> {
        let v = self.v.as_deref()?;
        keys.start.is_multiple_of(2).then(|| TileRows {
            words: &v[keys.start / 2..],
            ld: self.v_ld,
            rows: self.d_v,
            pairs: pair_dot::pairs(keys.len()).next_multiple_of(amx::TILE),
        })
    }
}

/// A zeroed buffer of `n` words, or `None` when it cannot be allocated (the caller then
/// packs per block, as without this module).
fn zeroed(n: usize) -> Option<Vec<u32>> {
    attn_core::zeroed("packed keys and values", Some(n)).ok()
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
        k: &K,
        v: &K,
    ) -> Option<&PackedHead> {
        self.slots
            .get(slot)?
            .get_or_init(|| PackedHead::new(k, v))
            .as_ref()
    }
}

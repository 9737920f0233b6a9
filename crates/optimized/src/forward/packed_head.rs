//! K and V of a head packed once — in bf16 pairs for the tile products
//! ([`Products::Tiles`]), or widened to f32 for the f32 products of half inputs — for every
//! query tile of the head, and every query head of a grouped-query group, to read instead
//! of each query tile packing or widening each key block again.
//!
//! K is packed as rows (`k_ld` words each) and V as columns of row pairs (`v_ld` words
//! each) over the head's whole key range, so a block of keys is a slice: any block for K,
//! a block starting at an even key for V (its pairs must be the head's). The buffers run
//! on past the last key with zeros for a whole tile, so a block's last tile may read past
//! its end: K's rows there only make scores that are discarded, and V's pairs there meet
//! P's zero padding (V is packed only when every entry is finite, so `0·v` is 0).

use std::sync::OnceLock;

use faer::MatRef;

use crate::kernel::Products;
use crate::kernel::amx::{self, TileRows};
use crate::kernel::element::Element;
use crate::kernel::pair_dot;
use crate::keys::{KeySource, PairOrder};

/// One head's packed K and V; either may be missing (an entry the tiles cannot multiply
/// exactly: that part is packed per block as before).
#[derive(Debug, Default)]
pub(super) struct PackedHead {
    k: Option<Vec<u32>>,
    k_ld: usize,
    v: Option<Vec<u32>>,
    v_ld: usize,
    d_v: usize,
    /// K and V widened to f32, row-major.
    k_f32: Option<Vec<f32>>,
    v_f32: Option<Vec<f32>>,
    d_k: usize,
}

impl PackedHead {
    /// Packs `k` and `v` (the head's whole key range) for `products`; `None` when nothing
    /// is to be gained or nothing can be packed (an entry too small for the tiles, no
    /// memory for the buffers).
    pub(super) fn new<T: Element, K: KeySource<T>>(
        products: Products,
        k: &K,
        v: &K,
    ) -> Option<Self> {
        match products {
            Products::Tiles => Self::pairs(k, v),
            Products::F32 if T::DTYPE != attn_core::Dtype::F32 => Self::widened(k, v),
            _ => None,
        }
    }

    /// K and V widened to f32 once.
    fn widened<T: Element, K: KeySource<T>>(k: &K, v: &K) -> Option<Self> {
        let widen = |x: &K| {
            let mut buf = zeroed::<f32>(x.len() * x.width())?;
            x.to_f32(&mut buf);
            Some(buf)
        };
        Some(Self {
            k_f32: Some(widen(k)?),
            v_f32: Some(widen(v)?),
            d_k: k.width(),
            d_v: v.width(),
            ..Self::default()
        })
    }

    /// Keys `keys` (of the head's range) widened to f32.
    pub(super) fn keys_f32(&self, keys: core::ops::Range<usize>) -> Option<MatRef<'_, f32>> {
        let k = self.k_f32.as_deref()?;
        let rows = &k[keys.start * self.d_k..keys.end * self.d_k];
        Some(MatRef::from_row_major_slice(rows, keys.len(), self.d_k))
    }

    /// Values of keys `keys` widened to f32.
    pub(super) fn values_f32(&self, keys: core::ops::Range<usize>) -> Option<MatRef<'_, f32>> {
        let v = self.v_f32.as_deref()?;
        let rows = &v[keys.start * self.d_v..keys.end * self.d_v];
        Some(MatRef::from_row_major_slice(rows, keys.len(), self.d_v))
    }

    /// K and V in bf16 pairs for the tiles.
    fn pairs<T: Element, K: KeySource<T>>(k: &K, v: &K) -> Option<Self> {
        let (n, d_k, d_v) = (k.len(), k.width(), v.width());
        let k_ld = pair_dot::pairs(d_k).next_multiple_of(amx::TILE);
        // A block's last tile reads up to a tile past the block.
        let rows = n.next_multiple_of(amx::TILE) + amx::TILE;
        let v_ld = pair_dot::pairs(n).next_multiple_of(amx::TILE) + amx::TILE;
        let k = zeroed::<u32>(rows * k_ld).and_then(|mut buf| {
            let report = k.to_pairs(PairOrder::Rows { ld: k_ld }, &mut buf)?;
            (!report.subnormal).then_some(buf)
        });
        let v = zeroed::<u32>(d_v.next_multiple_of(amx::TILE) * v_ld).and_then(|mut buf| {
            let report = v.to_pairs(PairOrder::Columns { ld: v_ld }, &mut buf)?;
            report.exact().then_some(buf)
        });
        (k.is_some() || v.is_some()).then_some(Self {
            k,
            k_ld,
            v,
            v_ld,
            d_v,
            ..Self::default()
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

/// A zeroed buffer of `n` entries, or `None` when it cannot be allocated (the caller then
/// packs per block, as without this module).
fn zeroed<X: Clone + Default>(n: usize) -> Option<Vec<X>> {
    attn_core::zeroed("packed keys", Some(n)).ok()
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
        products: Products,
        (k, v): (&K, &K),
    ) -> Option<&PackedHead> {
        self.slots
            .get(slot)?
            .get_or_init(|| PackedHead::new(products, k, v))
            .as_ref()
    }
}

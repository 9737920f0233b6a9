//! The native bf16 products of the GEMM tiles ([`Products::Pairs`], [`Products::Tiles`]):
//! packing the operands into [`Pairs`] and multiplying them, for [`super::gemm_tile`].

use faer::MatRef;

use super::Pairs;
use crate::kernel::Products;
use crate::kernel::amx;
use crate::kernel::element::Element;
use crate::kernel::pair_dot::{self, Broadcast, Columns, Lanes};
use crate::keys::{KeySource, PairOrder};

impl Pairs {
    /// Packs the query tile `q` as it is (exact; the scale multiplies the sums): `false`
    /// when the inputs are not bf16 or an entry is subnormal (read as zero).
    pub(super) fn pack_queries<T: Element>(&mut self, q: MatRef<'_, T>) -> bool {
        let ld = self.ld;
        T::as_bf16(q).is_some_and(|q| pair_dot::pack_lanes(q, &mut self.q, ld))
    }

    /// Packs a block of keys: `false` when an entry is subnormal.
    pub(super) fn pack_keys<T: Element, K: KeySource<T>>(&mut self, k: &K) -> bool {
        let order = PairOrder::Rows { ld: self.k_ld };
        k.to_pairs(order, &mut self.k).is_some_and(|r| !r.subnormal)
    }

    /// Packs a block of values for `products`: `false` when an entry is subnormal (read
    /// as zero) or not finite (a hidden key must then contribute nothing, not `0·∞`).
    pub(super) fn pack_values<T: Element, K: KeySource<T>>(
        &mut self,
        products: Products,
        v: &K,
    ) -> bool {
        let order = match products {
            Products::Tiles => PairOrder::Columns { ld: self.v_ld },
            _ => PairOrder::RowPairs,
        };
        v.to_pairs(order, &mut self.v).is_some_and(|r| r.exact())
    }

    /// `s = alpha·Q·Kᵀ` for the packed `nr` queries and `nc` keys, `s` column-major
    /// (`ld_s` floats per key).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn scores(
        &self,
        products: Products,
        s: &mut [f32],
        ld_s: usize,
        nr: usize,
        nc: usize,
        d_k: usize,
        alpha: f32,
    ) {
        let q = Lanes {
            words: &self.q,
            rows: nr,
            ld: self.ld,
        };
        match products {
            Products::Tiles => {
                amx::product(&self.k, self.k_ld, nc, q, self.k_ld, s, ld_s, alpha, false)
            }
            _ => {
                let kp = pair_dot::pairs(d_k);
                let k = Broadcast {
                    words: &self.k,
                    pairs: kp,
                    cols: nc,
                    pair_stride: 1,
                    col_stride: self.k_ld,
                };
                let c = Columns {
                    data: s,
                    rows: nr,
                    cols: nc,
                    ld: ld_s,
                };
                pair_dot::product(q, k, c, alpha, false);
            }
        }
    }

    /// `acc += P·V` for the packed values, P the probabilities in `s` rounded to bf16;
    /// `acc` column-major (`ld` floats per value column), like `s`.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn add_weighted_values(
        &mut self,
        products: Products,
        s: &[f32],
        nr: usize,
        nc: usize,
        d_v: usize,
        acc: &mut [f32],
        ld: usize,
    ) {
        let lanes = self.ld;
        pair_dot::pack_probabilities(s, ld, nr, nc, &mut self.p, lanes);
        let pairs = pair_dot::pairs(nc);
        match products {
            Products::Tiles => {
                // Whole tiles of pairs: the padding pairs are zero.
                let padded = pairs.next_multiple_of(amx::TILE);
                self.p[pairs * lanes..padded * lanes].fill(0);
                let p = Lanes {
                    words: &self.p,
                    rows: nr,
                    ld: lanes,
                };
                amx::product(&self.v, self.v_ld, d_v, p, padded, acc, ld, 1.0, true);
            }
            _ => {
                let p = Lanes {
                    words: &self.p,
                    rows: nr,
                    ld: lanes,
                };
                let v = Broadcast {
                    words: &self.v,
                    pairs,
                    cols: d_v,
                    pair_stride: d_v,
                    col_stride: 1,
                };
                let c = Columns {
                    data: acc,
                    rows: nr,
                    cols: d_v,
                    ld,
                };
                pair_dot::product(p, v, c, 1.0, true);
            }
        }
    }
}

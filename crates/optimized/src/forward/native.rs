//! The native products of the GEMM tiles ([`Products::Pairs`], [`Products::Tiles`],
//! [`Products::SplitTiles`]):
//! packing the operands into [`Pairs`] and multiplying them, for [`super::gemm_tile`].

use faer::MatRef;

use super::Pairs;
use crate::kernel::Products;
use crate::kernel::amx::{self, Split, TileRows};
use crate::kernel::element::{Element, f32_rows};
use crate::kernel::finite::row_is_finite;
use crate::kernel::online_softmax::PairsOut;
use crate::kernel::pair_dot::{self, Broadcast, Columns, Lanes};
use crate::keys::{KeySource, PairOrder};

/// How a block of values was packed ([`Pairs::pack_values`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Values {
    /// As they are.
    Exact,
    /// With their non-finite rows as zeros.
    WithoutNonFinite,
    /// Not usable: the block is multiplied in f32.
    F32,
}

impl Pairs {
    /// Packs the query tile `q` as it is (exact; the scale multiplies the sums), split in
    /// two parts for split products: `false` when the inputs are neither bf16 nor split,
    /// or an entry is subnormal (read as zero).
    pub(super) fn pack_queries<T: Element>(&mut self, q: MatRef<'_, T>) -> bool {
        let ld = self.ld;
        match &mut self.low {
            Some(low) => {
                let (rows, cols) = (q.nrows(), q.ncols());
                low.q_non_finite = false;
                let split = low.stage.split(|buf| f32_rows(q, 0..rows, buf), rows, cols);
                let packed = split.is_some_and(|([hi, lo], finite)| {
                    low.q_non_finite = !finite;
                    pair_dot::pack_lanes(hi, &mut self.q, ld)
                        && pair_dot::pack_lanes(lo, &mut low.q, ld)
                });
                // Which rows, for `repair_split_scores` (found once per tile, not per block).
                for (i, bad) in low.q_rows_non_finite[..rows].iter_mut().enumerate() {
                    *bad = low.q_non_finite && !row_is_finite(q.row(i));
                }
                packed
            }
            None => T::as_bf16(q).is_some_and(|q| pair_dot::pack_lanes(q, &mut self.q, ld)),
        }
    }

    /// Packs a block of keys: `false` when an entry is subnormal.
    pub(super) fn pack_keys<T: Element, K: KeySource<T>>(&mut self, k: &K) -> bool {
        let order = PairOrder::Rows { ld: self.k_ld };
        let report = match &mut self.low {
            Some(low) => {
                let report = k.to_split_pairs(order, &mut self.k, &mut low.k, &mut low.stage);
                low.k_non_finite = report.is_some_and(|r| r.non_finite);
                report
            }
            None => k.to_pairs(order, &mut self.k),
        };
        report.is_some_and(|r| !r.subnormal)
    }

    /// After split products, the scores of a query row or key holding an infinity or a
    /// NaN as the f32 products give them, from the scaled (saturated) query tile
    /// `q_scaled` (column-major, `ld_s` floats a column): a split product adds `inf·lo`
    /// where the other operand's low part is zero, a NaN the f32 product does not have.
    /// Those scores are not finite either way, and which non-finite value a dot product
    /// gives does not depend on its order (up to finite terms that overflow).
    /// `k_non_finite`: whether the block of keys holds one (when packed elsewhere).
    pub(super) fn repair_split_scores<T: Element, K: KeySource<T>>(
        &self,
        s: &mut [f32],
        ld_s: usize,
        (q, q_scaled, k): (MatRef<'_, T>, &[f32], &K),
        k_non_finite: Option<bool>,
    ) {
        let Some(low) = &self.low else {
            return;
        };
        let k_non_finite = k_non_finite.unwrap_or(low.k_non_finite);
        if !low.q_non_finite && !k_non_finite {
            return;
        }
        let (nr, nc, d) = (q.nrows(), k.len(), q.ncols());
        let q_bad = &low.q_rows_non_finite[..nr];
        for j in 0..nc {
            let k_bad = k_non_finite && !k.row_finite(j);
            for i in (0..nr).filter(|&i| k_bad || q_bad[i]) {
                s[j * ld_s + i] = (0..d).map(|c| q_scaled[c * ld_s + i] * k.at(j, c)).sum();
            }
        }
    }

    /// Packs a block of values for `products`: [`Values::F32`] when an entry is so small
    /// that its products could be flushed; a non-finite row is
    /// packed as zeros ([`Values::WithoutNonFinite`]: a hidden key must contribute nothing,
    /// not `0·∞`, and the rows that see it add its terms alone).
    pub(super) fn pack_values<T: Element, K: KeySource<T>>(
        &mut self,
        products: Products,
        v: &K,
        d_v: usize,
    ) -> Values {
        let order = match products {
            Products::Tiles | Products::SplitTiles => PairOrder::Columns { ld: self.v_ld },
            _ => PairOrder::RowPairs,
        };
        let report = match &mut self.low {
            Some(low) => v.to_split_pairs(order, &mut self.v, &mut low.v, &mut low.stage),
            None => v.to_pairs(order, &mut self.v),
        };
        match report {
            Some(r) if r.exact() => Values::Exact,
            Some(r) if !r.tiny => {
                let low = self.low.as_mut().map(|low| &mut low.v);
                for words in core::iter::once(&mut self.v).chain(low) {
                    for j in (0..v.len()).filter(|&j| !v.row_finite(j)) {
                        // Row j is the low (even j) or high (odd j) half of pair j / 2.
                        let keep = if j % 2 == 0 { 0xffff_0000 } else { 0x0000_ffff };
                        for c in 0..d_v {
                            let at = match order {
                                PairOrder::Columns { ld } => c * ld + j / 2,
                                _ => (j / 2) * d_v + c,
                            };
                            words[at] &= keep;
                        }
                    }
                }
                Values::WithoutNonFinite
            }
            _ => Values::F32,
        }
    }

    /// `s = alpha·Q·Kᵀ` for the packed `nr` queries and `nc` keys, `s` column-major
    /// (`ld_s` floats per key); K packed here, or `k_tiles` (the tile products' K, packed
    /// elsewhere).
    pub(super) fn scores(
        &self,
        products: Products,
        s: &mut [f32],
        (ld_s, nr, nc, d_k): (usize, usize, usize, usize),
        k_tiles: Option<Split<TileRows<'_>>>,
        alpha: f32,
    ) {
        let lanes = |words| Lanes {
            words,
            rows: nr,
            ld: self.ld,
        };
        let q = lanes(&self.q);
        match products {
            Products::Tiles | Products::SplitTiles => {
                let rows = |words| TileRows {
                    words,
                    ld: self.k_ld,
                    rows: nc,
                    pairs: self.k_ld,
                };
                let k = k_tiles.unwrap_or(Split {
                    hi: rows(&self.k),
                    lo: self.low.as_ref().map(|low| rows(&low.k)),
                });
                let q = Split {
                    hi: q,
                    lo: self.low.as_ref().map(|low| lanes(&low.q)),
                };
                amx::split_product(k, q, s, ld_s, alpha, false)
            }
            _ => {
                // The head's K packed for the tiles is the same words: row `j`'s pairs
                // side by side, `ld` apart.
                let (words, col_stride) = match &k_tiles {
                    Some(k) => (k.hi.words, k.hi.ld),
                    None => (&self.k[..], self.k_ld),
                };
                let k = Broadcast {
                    words,
                    pairs: pair_dot::pairs(d_k),
                    cols: nc,
                    pair_stride: 1,
                    col_stride,
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

    /// Where the softmax writes P's pairs itself ([`softmax_update_pairs`]), its rounding
    /// added to `delta`; the scores still to be multiplied by `pending_scale` (see
    /// [`PairsOut::pending_scale`]).
    ///
    /// [`softmax_update_pairs`]: crate::kernel::online_softmax::softmax_update_pairs
    pub(super) fn probabilities<'a>(
        &'a mut self,
        delta: &'a mut [f32],
        pending_scale: f32,
    ) -> PairsOut<'a> {
        PairsOut {
            words: &mut self.p,
            ld: self.ld,
            delta,
            scratch: &mut self.settle,
            pending_scale,
            block_width: self.block_width,
        }
    }

    /// Rounds the probabilities in `s` (column-major, `ld_s` floats per key) into P's
    /// pairs (both parts, split), where the softmax did not write them itself; `delta[i]`
    /// gains what the rounding added to row `i`'s weights.
    pub(super) fn pack_probabilities(
        &mut self,
        s: &[f32],
        (ld_s, nr, nc): (usize, usize, usize),
        delta: &mut [f32],
    ) {
        let ld = self.ld;
        match &mut self.low {
            Some(low) => pair_dot::pack_probabilities_split(
                s,
                ld_s,
                (nr, nc),
                &mut self.p,
                &mut low.p,
                ld,
                delta,
            ),
            None => pair_dot::pack_probabilities(s, ld_s, nr, nc, &mut self.p, ld, delta),
        }
    }

    /// `acc += P·V` for the packed values and P's pairs ([`Pairs::probabilities`],
    /// [`Pairs::pack_probabilities`]); V packed here, or `v_tiles` (the tile products' V,
    /// packed elsewhere); `acc` column-major (`ld` floats per value column).
    pub(super) fn add_weighted_values(
        &mut self,
        products: Products,
        (nr, nc, d_v): (usize, usize, usize),
        v_tiles: Option<Split<TileRows<'_>>>,
        acc: &mut [f32],
        ld: usize,
    ) {
        let lanes = self.ld;
        let pairs = pair_dot::pairs(nc);
        match products {
            Products::Tiles | Products::SplitTiles => {
                // Whole tiles of pairs: the padding pairs are zero.
                let padded = pairs.next_multiple_of(amx::TILE);
                self.p[pairs * lanes..padded * lanes].fill(0);
                if let Some(low) = &mut self.low {
                    low.p[pairs * lanes..padded * lanes].fill(0);
                }
                let p_lanes = |words| Lanes {
                    words,
                    rows: nr,
                    ld: lanes,
                };
                let p = Split {
                    hi: p_lanes(&self.p),
                    lo: self.low.as_ref().map(|low| p_lanes(&low.p)),
                };
                let v_rows = |words| TileRows {
                    words,
                    ld: self.v_ld,
                    rows: d_v,
                    pairs: padded,
                };
                let v = v_tiles.unwrap_or(Split {
                    hi: v_rows(&self.v),
                    lo: self.low.as_ref().map(|low| v_rows(&low.v)),
                });
                amx::split_product(v, p, acc, ld, 1.0, true);
            }
            _ => {
                let p = Lanes {
                    words: &self.p,
                    rows: nr,
                    ld: lanes,
                };
                // The head's V packed for the tiles holds each column's pairs side by
                // side, `ld` apart; a block packed here, each pair's columns.
                let (words, pair_stride, col_stride) = match &v_tiles {
                    Some(v) => (v.hi.words, 1, v.hi.ld),
                    None => (&self.v[..], d_v, 1),
                };
                let v = Broadcast {
                    words,
                    pairs,
                    cols: d_v,
                    pair_stride,
                    col_stride,
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

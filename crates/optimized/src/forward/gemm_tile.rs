//! The GEMM tile loop of one task: a query tile stays in cache while key/value tiles
//! stream past; scores, softmax and `P·V` never leave the task's scratch.

use core::ops::Range;

use attn_core::TileCoverage;
use faer::linalg::matmul::matmul;
use faer::reborrow::ReborrowMut;
use faer::{Accum, MatMut, MatRef, Par};

use super::native::Values;
use super::packed_head::PackedHead;
use super::{Pairs, Scratch};
use crate::exact::rescore;
use crate::kernel::Products;
use crate::kernel::dropout::drop_weights;
use crate::kernel::element::{Element, f32_rows};
use crate::kernel::exp2::exp2_approx;
use crate::kernel::finite::tile_is_finite;
use crate::kernel::online_softmax::saturate;
use crate::kernel::online_softmax::{
    RowState, scale_rows, softmax_update, softmax_update_pairs, softmax_update_unmoved,
};
use crate::kernel::transpose::scale_transposed;
use crate::keys::KeySource;
use crate::mask::{
    add_non_finite_terms, key_blocks, mask_tile, scale_and_mask_tile, without_non_finite_rows,
    zero_weight_meets_non_finite,
};
use crate::modifiers::modify_scores;
use crate::problem::HeadInputs;
use crate::schedule::TilePlan;

impl Scratch {
    /// The query tile `rows` scaled (by `scale·log2 e`) into `self.q`, column-major: f32
    /// rows read in place, half rows widened first (vectorised, into the K block's
    /// buffer, free until a block's products) where it holds them.
    fn scale_queries<T: Element, K: KeySource<T>>(
        &mut self,
        head: &HeadInputs<'_, T, K>,
        rows: Range<usize>,
    ) {
        let (br, nr, d_k) = (self.plan.br, rows.len(), head.q.ncols());
        let fits = T::as_f32(head.q).is_some() || self.k_wide.len() >= nr * d_k;
        // Saturated: a query entry near f32::MAX times scale·log2(e) must not become inf
        // (inf · 0 = NaN where the score is 0); the row's scores are then recomputed exactly.
        if fits {
            let q_rows = f32_rows(head.q, rows.clone(), &mut self.k_wide);
            scale_transposed(q_rows, head.scale_log2, &mut self.q, br);
            return;
        }
        for c in 0..d_k {
            let col = &mut self.q[c * br..c * br + nr];
            for (i, x) in col.iter_mut().enumerate() {
                *x = saturate(head.q[(rows.start + i, c)].to_f32() * head.scale_log2);
            }
        }
    }

    /// [`Scratch::attend`] for a tile of more than [`crate::schedule::DECODE_ROWS`]
    /// queries: `S = Q Kᵀ` and `O += P V` as faer GEMMs on the tile — or, for bf16 at
    /// native precision, as bf16 products ([`Products`]) — the softmax
    /// between them one fused pass ([`softmax_update`]).
    pub(super) fn attend_gemm<T: Element, K: KeySource<T>>(
        &mut self,
        head: &HeadInputs<'_, T, K>,
        rows: Range<usize>,
        keys: Range<usize>,
        packed: Option<&PackedHead>,
    ) {
        let TilePlan { br, bc } = self.plan;
        let nr = rows.len();
        let (d_k, d_v) = (head.q.ncols(), head.v.width());
        let rescaled = self.mark_rescaled(head, rows.clone());
        // Native bf16 products: Q packed as it is, unless it cannot be (then f32).
        let products = self.shape.products;
        let native = products != Products::F32;
        let q_native = native && self.pairs.pack_queries(head.q.subrows(rows.start, nr));
        // The f32 Q tile is for f32 products (and the split products' repair): native
        // products scale it only for a block of keys they cannot multiply.
        let mut q_scaled = !q_native || products.split();
        if q_scaled {
            self.scale_queries(head, rows.clone());
        }
        self.l_delta[..nr].fill(0.0);
        self.acc.fill(0.0);
        self.m[..nr].fill(f32::NEG_INFINITY);
        self.l[..nr].fill(0.0);

        for (cols, coverage) in key_blocks(head, rows.clone(), keys, bc) {
            let nc = cols.len();
            let local = cols.start - head.key_base;
            let (kb, vb) = (
                head.k.block(local..local + nc),
                head.v.block(local..local + nc),
            );
            // K and V from the head packed once when they are there, else packed per block.
            let local_keys = local..local + nc;
            let k_tiles = packed.and_then(|p| p.keys(local_keys.clone()));
            let v_tiles = packed.and_then(|p| p.values(local_keys));
            let k_native = q_native && (k_tiles.is_some() || self.pairs.pack_keys(&kb));
            if !k_native && !q_scaled {
                self.scale_queries(head, rows.clone());
                q_scaled = true;
            }
            let q_tile = MatRef::from_column_major_slice_with_stride(&self.q, nr, d_k, br);
            // Native bf16 products: P rounded to bf16 (the scores and the sums stay f32),
            // unless V holds an entry too small for them (see `Pairs::pack_values`). V is
            // packed first: when it is exact, the softmax writes P's pairs itself.
            let values = match (native, v_tiles) {
                (false, _) => Values::F32,
                (true, Some(_)) => Values::Exact,
                (true, None) => self.pairs.pack_values(products, &vb, d_v),
            };
            // A tile with nothing hidden is checked for a non-finite score by the softmax's
            // own first pass (below); a masked one before the mask writes its -inf, and one
            // whose modifiers may make an overflow look finite (a soft-cap, a user's)
            // before the modifiers.
            let all_visible = coverage == TileCoverage::Full && !head.mask.has_elementwise();
            let modified = head.mods.modifies_scores();
            let scan = !all_visible || (modified && !head.mods.keeps_non_finite());
            let check = !scan && !rescaled;
            // The tiles' scores straight into the softmax's one pass (nothing to repair,
            // mask or modify, P written by the softmax): the softmax applies the scale as
            // it reads them, saving a pass over the tile. Values with a non-finite row take
            // the same softmax (a row's bits must not depend on a value it does not see).
            // Dropout takes P from the tile (it drops weights after the softmax).
            let dropout = head.mods.dropout;
            let in_pairs = matches!(values, Values::Exact | Values::WithoutNonFinite)
                && !products.split()
                && dropout.is_none();
            let scale_in_softmax =
                products == Products::Tiles && k_native && in_pairs && check && !modified;
            // A block that straddles a structural boundary with nothing else to apply: the
            // mask scales and hides in one pass, and finds the scores to repair.
            let mask_scales = coverage == TileCoverage::Partial
                && !head.mask.has_elementwise()
                && !modified
                && !rescaled
                && !products.split();
            let scores = |pairs: &Pairs, s: &mut [f32], k_wide: &mut Vec<f32>| {
                if k_native {
                    let scale = if scale_in_softmax || mask_scales {
                        1.0
                    } else {
                        head.scale_log2
                    };
                    return pairs.scores(products, s, (br, nr, nc, d_k), k_tiles, scale);
                }
                let s_tile = MatMut::from_column_major_slice_with_stride_mut(s, nr, nc, br);
                let k_tile = kb.to_f32(k_wide);
                tile_matmul(s_tile, Accum::Replace, q_tile, k_tile.transpose());
            };
            scores(&self.pairs, &mut self.s, &mut self.k_wide);
            let (q, k) = (head.q.subrows(rows.start, nr), &kb);
            if k_native && products.split() {
                let packed_keys = k_tiles.and(packed).map(PackedHead::keys_non_finite);
                let operands = (q, &self.q[..], k);
                self.pairs
                    .repair_split_scores(&mut self.s, br, operands, packed_keys);
            }
            let rescaled_rows = Some(&self.rescaled[..nr]);
            if rescaled || (scan && !mask_scales && !tile_is_finite(&self.s, br, nr, nc)) {
                rescore(&mut self.s, (1, br), q, k, head.scale_log2, rescaled_rows);
            }
            let at = (rows.clone(), cols.clone());
            modify_scores(&mut self.s, (1, br), head, at.clone(), None);
            // The f32 products' queries carry the scale already.
            let left = if k_native { head.scale_log2 } else { 1.0 };
            if !mask_scales || !scale_and_mask_tile(&mut self.s, br, head, at.clone(), left) {
                if mask_scales {
                    rescore(&mut self.s, (1, br), q, k, head.scale_log2, rescaled_rows);
                }
                mask_tile(&mut self.s, br, head, at, coverage);
            }
            let mut state = RowState {
                m: &mut self.m,
                l: &mut self.l,
                alpha: &mut self.alpha,
                m_safe: &mut self.m_safe,
            };
            let s = &mut self.s;
            // What the scores left in the tile are still to be multiplied by.
            let mut left_scale = 1.0;
            // Split products take P in two parts, which only the packer writes.
            let first = if in_pairs {
                let pending = if scale_in_softmax {
                    head.scale_log2
                } else {
                    1.0
                };
                let mut out = self.pairs.probabilities(&mut self.l_delta, pending);
                let first =
                    softmax_update_pairs(s, br, nr, nc, &mut state, all_visible, check, &mut out);
                left_scale = out.pending_scale;
                first.map(|rescale| (rescale, true))
            } else {
                // A block past the first of f32 tile products with nothing to mask or modify
                // rarely moves a row's maximum: one pass, else the scores again and two.
                let one_pass = values == Values::F32
                    && !k_native
                    && all_visible
                    && check
                    && !modified
                    && dropout.is_none();
                let tried = one_pass
                    .then(|| softmax_update_unmoved(s, br, nr, nc, &mut state, true, true))
                    .flatten();
                if tried == Some(true) {
                    Some((false, false))
                } else {
                    if tried == Some(false) {
                        scores(&self.pairs, s, &mut self.k_wide);
                    }
                    softmax_update(s, br, nr, nc, &mut state, all_visible, check)
                        .map(|rescale| (rescale, false))
                }
            };
            let (rescale, p_in_pairs) = match first {
                Some(first) => first,
                None => {
                    if modified {
                        // The tile was modified: start again from the raw scores.
                        scores(&self.pairs, &mut self.s, &mut self.k_wide);
                    }
                    rescore(&mut self.s, (1, br), q, k, head.scale_log2, rescaled_rows);
                    let at = (rows.clone(), cols.clone());
                    modify_scores(&mut self.s, (1, br), head, at, None);
                    // What is still not finite comes from the operands: no second check.
                    let again = softmax_update(&mut self.s, br, nr, nc, &mut state, true, false);
                    (again.unwrap_or(false), false)
                }
            };
            if let Some(d) = &dropout {
                drop_weights(&mut self.s, br, (rows.clone(), cols.clone()), d);
            }
            if rescale {
                scale_rows(&mut self.acc, br, nr, d_v, &self.alpha);
            }
            if rescale && native && !p_in_pairs {
                for (d, a) in self.l_delta[..nr].iter_mut().zip(&self.alpha) {
                    *d *= a;
                }
            }
            if values != Values::F32 {
                if !p_in_pairs {
                    let shape = (br, nr, nc);
                    self.pairs
                        .pack_probabilities(&self.s, shape, &mut self.l_delta);
                }
                let shape = (nr, nc, d_v);
                self.pairs
                    .add_weighted_values(products, shape, v_tiles, &mut self.acc, br);
                if values == Values::WithoutNonFinite {
                    // The non-finite rows' terms, for the rows that see them, with the
                    // weights the softmax gave (recomputed from the scores it left).
                    let v_tile = vb.to_f32(&mut self.v_wide);
                    let (s, acc, m) = (&self.s, &mut self.acc, &self.m_safe);
                    let at = (rows.clone(), cols.clone());
                    let p = |i: usize, jj: usize| {
                        let x = s[jj * br + i];
                        if p_in_pairs {
                            exp2_approx::<true>(x * left_scale - m[i])
                        } else {
                            x
                        }
                    };
                    add_non_finite_terms(head, at, v_tile, p, |i, c, x| acc[c * br + i] += x);
                }
                continue;
            }
            let p = MatRef::from_column_major_slice_with_stride(&self.s, nr, nc, br);
            let mut acc =
                MatMut::from_column_major_slice_with_stride_mut(&mut self.acc, nr, d_v, br);
            let v_tile = vb.to_f32(&mut self.v_wide);
            let masked = coverage == TileCoverage::Partial
                || head.mask.has_elementwise()
                || dropout.is_some();
            let zero_weight = |jj: usize| (0..nr).any(|i| self.s[jj * br + i] == 0.0);
            if masked && zero_weight_meets_non_finite(v_tile, zero_weight) {
                // A hidden key must contribute nothing, not 0·V_j (NaN for a non-finite V_j):
                // the product runs without the non-finite rows, whose terms the rows that
                // see them add alone, so the other rows get the bits they would get anyway.
                let mut buf = Vec::new();
                let clean = without_non_finite_rows(v_tile, &mut buf);
                tile_matmul(acc.rb_mut(), Accum::Add, p, clean);
                let at = (rows.clone(), cols.clone());
                add_non_finite_terms(
                    head,
                    at,
                    v_tile,
                    |i, jj| p[(i, jj)],
                    |i, c, x| {
                        acc[(i, c)] += x;
                    },
                );
            } else {
                tile_matmul(acc, Accum::Add, p, v_tile);
            }
        }
        if native && head.mods.dropout.is_none() {
            // The weights P·V multiplied are the rounded ones, whose sum is l + delta: the
            // row is rescaled to that sum, so the output stays a convex combination of the
            // values it sees (the LSE keeps the exact l). Dropped weights are no convex
            // combination: their rounding stays a relative error of each.
            for ((f, &l), &d) in self.alpha[..nr].iter_mut().zip(&self.l).zip(&self.l_delta) {
                let sum = l + d;
                *f = if d == 0.0 || sum == 0.0 || !sum.is_finite() {
                    1.0
                } else {
                    l / sum
                };
            }
            scale_rows(&mut self.acc, br, nr, d_v, &self.alpha);
        }
    }
}

/// Rows of a tile product per faer call: faer multiplies 128 rows with its 96-row
/// micro-kernel and a 32-row one that does a fifth less per row; two calls of 64 rows run
/// its 64-row kernel throughout (the n = 1024 f32 forward 1.02× on Zen 4). Each entry is
/// the same sum in the same order whichever kernel computes it: the bits do not change.
const PRODUCT_ROWS: usize = 64;

/// `dst (accum) lhs · rhs` for a tile, in slices of [`PRODUCT_ROWS`] rows.
fn tile_matmul(mut dst: MatMut<'_, f32>, accum: Accum, lhs: MatRef<'_, f32>, rhs: MatRef<'_, f32>) {
    let rows = dst.nrows();
    for r0 in (0..rows).step_by(PRODUCT_ROWS) {
        let n = PRODUCT_ROWS.min(rows - r0);
        let dst = dst.rb_mut().subrows_mut(r0, n);
        matmul(dst, accum, lhs.subrows(r0, n), rhs, 1.0, Par::Seq);
    }
}

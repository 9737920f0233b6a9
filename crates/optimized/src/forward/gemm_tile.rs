//! The GEMM tile loop of one task: a query tile stays in cache while key/value tiles
//! stream past; scores, softmax and `P·V` never leave the task's scratch.

use core::ops::Range;

use attn_core::TileCoverage;
use faer::linalg::matmul::matmul;
use faer::{Accum, MatMut, MatRef, Par};

use super::Scratch;
use crate::kernel::element::{Element, f32_rows};
use crate::kernel::online_softmax::saturate;
use crate::kernel::online_softmax::{RowState, scale_rows, softmax_update};
use crate::mask::{key_blocks, mask_tile, zero_weight_meets_non_finite};
use crate::problem::HeadInputs;
use crate::schedule::TilePlan;

impl Scratch {
    /// [`Scratch::attend`] for a tile of more than [`crate::schedule::DECODE_ROWS`]
    /// queries: `S = Q Kᵀ` and `O += P V` as faer GEMMs on the tile, the softmax between
    /// them one fused pass ([`softmax_update`]).
    pub(super) fn attend_gemm<T: Element>(
        &mut self,
        head: &HeadInputs<'_, T>,
        rows: Range<usize>,
        keys: Range<usize>,
    ) {
        let TilePlan { br, bc } = self.plan;
        let nr = rows.len();
        let (d_k, d_v) = (head.q.ncols(), head.v.ncols());
        // Q tile, scaled once, column-major.
        for c in 0..d_k {
            let col = &mut self.q[c * br..c * br + nr];
            for (i, x) in col.iter_mut().enumerate() {
                // Saturated: a query entry near f32::MAX times scale·log2(e) must not become
                // inf (inf · 0 = NaN where the score is 0).
                *x = saturate(head.q[(rows.start + i, c)].to_f32() * head.scale_log2);
            }
        }
        self.acc.fill(0.0);
        self.m[..nr].fill(f32::NEG_INFINITY);
        self.l[..nr].fill(0.0);
        let q_tile = MatRef::from_column_major_slice_with_stride(&self.q, nr, d_k, br);

        for (cols, coverage) in key_blocks(head, rows.clone(), keys, bc) {
            let nc = cols.len();
            let local = cols.start - head.key_base;
            {
                let s_tile =
                    MatMut::from_column_major_slice_with_stride_mut(&mut self.s, nr, nc, br);
                let k_tile = f32_rows(head.k, local..local + nc, &mut self.k_wide);
                matmul(
                    s_tile,
                    Accum::Replace,
                    q_tile,
                    k_tile.transpose(),
                    1.0,
                    Par::Seq,
                );
            }
            mask_tile(
                &mut self.s,
                br,
                head,
                (rows.clone(), cols.clone()),
                coverage,
            );
            let mut state = RowState {
                m: &mut self.m,
                l: &mut self.l,
                alpha: &mut self.alpha,
                m_safe: &mut self.m_safe,
            };
            let all_visible = coverage == TileCoverage::Full && !head.mask.has_elementwise();
            if softmax_update(&mut self.s, br, nr, nc, &mut state, all_visible) {
                scale_rows(&mut self.acc, br, nr, d_v, &self.alpha);
            }
            let p = MatRef::from_column_major_slice_with_stride(&self.s, nr, nc, br);
            let mut acc =
                MatMut::from_column_major_slice_with_stride_mut(&mut self.acc, nr, d_v, br);
            let v_tile = f32_rows(head.v, local..local + nc, &mut self.v_wide);
            let masked = coverage == TileCoverage::Partial || head.mask.has_elementwise();
            let zero_weight = |jj: usize| (0..nr).any(|i| self.s[jj * br + i] == 0.0);
            if masked && zero_weight_meets_non_finite(v_tile, zero_weight) {
                // A hidden key must contribute nothing, not 0·V_j (NaN for a non-finite V_j).
                for (i, row) in rows.clone().enumerate() {
                    for (jj, j) in cols.clone().enumerate() {
                        let pij = p[(i, jj)];
                        if pij != 0.0 || head.mask.sees(head.mask_row(row), j) {
                            for c in 0..d_v {
                                acc[(i, c)] += pij * v_tile[(jj, c)];
                            }
                        }
                    }
                }
            } else {
                matmul(acc, Accum::Add, p, v_tile, 1.0, Par::Seq);
            }
        }
    }
}

//! The tile loop of one task: a query tile stays in cache while key/value tiles stream
//! past; scores, softmax and `P·V` never leave the task's scratch.

use core::ops::Range;

use attn_core::{HeadMask, TileCoverage};
use faer::linalg::matmul::matmul;
use faer::{Accum, MatMut, MatRef, Par};

use crate::online_softmax::{RowState, scale_rows, softmax_update};

/// Query rows per task (at most): the Q tile, the score tile and the accumulator of this
/// many rows stay in L2 while the keys stream past.
pub const QUERY_TILE: usize = 128;
/// Keys per streamed tile: 512 amortises the per-block softmax bookkeeping and faer's
/// per-call cost (measured best on Zen 4, DESIGN.md §5).
pub const KEY_TILE: usize = 512;

/// Tile sizes for a problem; fixed by the shape alone, never by the thread count, so the
/// result bits do not depend on how many threads run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TilePlan {
    /// Query rows per tile.
    pub br: usize,
    /// Keys per tile.
    pub bc: usize,
}

impl TilePlan {
    /// The plan for `n_q` queries against `n_k` keys.
    pub fn for_shape(n_q: usize, n_k: usize) -> Self {
        let br = n_q.clamp(1, QUERY_TILE).next_multiple_of(8).min(QUERY_TILE);
        let bc = n_k.clamp(1, KEY_TILE).next_multiple_of(16).min(KEY_TILE);
        Self { br, bc }
    }

    /// Number of query tiles for `n_q` queries.
    pub fn query_tiles(&self, n_q: usize) -> usize {
        n_q.div_ceil(self.br)
    }
}

/// One head's operands, resolved: Q, and the K/V rows it may read.
#[derive(Debug, Clone, Copy)]
pub(crate) struct HeadInputs<'a> {
    pub q: MatRef<'a, f32>,
    /// Rows of K (and V) are keys `key_base ..` of the full problem.
    pub k: MatRef<'a, f32>,
    pub v: MatRef<'a, f32>,
    pub key_base: usize,
    pub mask: HeadMask<'a>,
    /// `scale · log2(e)`: scores come out in the log2 domain.
    pub scale_log2: f32,
}

/// Per-task working memory, allocated once per task and reused for every tile.
#[derive(Debug)]
pub(crate) struct Scratch {
    plan: TilePlan,
    q: Vec<f32>,
    s: Vec<f32>,
    acc: Vec<f32>,
    m: Vec<f32>,
    l: Vec<f32>,
    alpha: Vec<f32>,
    m_safe: Vec<f32>,
}

impl Scratch {
    pub fn new(plan: TilePlan, d_k: usize, d_v: usize) -> Self {
        let br = plan.br;
        Self {
            plan,
            q: vec![0.0; br * d_k],
            s: vec![0.0; br * plan.bc],
            acc: vec![0.0; br * d_v],
            m: vec![0.0; br],
            l: vec![0.0; br],
            alpha: vec![0.0; br],
            m_safe: vec![0.0; br],
        }
    }

    /// Runs the online softmax of query rows `rows` over the keys `keys` (global indices),
    /// leaving the unnormalised accumulator, maxima and sums in the scratch.
    pub fn attend(&mut self, head: &HeadInputs<'_>, rows: Range<usize>, keys: Range<usize>) {
        let TilePlan { br, bc } = self.plan;
        let nr = rows.len();
        let (d_k, d_v) = (head.q.ncols(), head.v.ncols());
        debug_assert!(nr <= br);

        // Q tile, scaled once, column-major.
        for c in 0..d_k {
            let col = &mut self.q[c * br..c * br + nr];
            for (i, x) in col.iter_mut().enumerate() {
                *x = head.q[(rows.start + i, c)] * head.scale_log2;
            }
        }
        self.acc.fill(0.0);
        self.m[..nr].fill(f32::NEG_INFINITY);
        self.l[..nr].fill(0.0);
        let q_tile = MatRef::from_column_major_slice_with_stride(&self.q, nr, d_k, br);

        // Only the keys some row of this tile can see: tiles start at the first such key
        // and the last one stops at the last such key (on the causal diagonal that halves
        // the work of the boundary tile). Both ends depend on the shape alone.
        let first = head.mask.key_range(rows.start).start.max(keys.start);
        let last = head.mask.key_range(rows.end - 1).end.min(keys.end);
        let mut j0 = first;
        while j0 < last {
            let cols = j0..(j0 + bc).min(last);
            j0 = cols.end;
            let coverage = head.mask.tile_coverage(rows.clone(), cols.clone());
            if coverage == TileCoverage::Hidden {
                continue;
            }
            let nc = cols.len();
            let local = cols.start - head.key_base;
            {
                let s_tile =
                    MatMut::from_column_major_slice_with_stride_mut(&mut self.s, nr, nc, br);
                matmul(
                    s_tile,
                    Accum::Replace,
                    q_tile,
                    head.k.subrows(local, nc).transpose(),
                    1.0,
                    Par::Seq,
                );
            }
            if coverage == TileCoverage::Partial {
                mask_structural(&mut self.s, br, head, rows.clone(), cols.clone());
            }
            if head.mask.has_elementwise() {
                mask_elementwise(&mut self.s, br, head, rows.clone(), cols.clone());
            }
            let mut state = RowState {
                m: &mut self.m,
                l: &mut self.l,
                alpha: &mut self.alpha,
                m_safe: &mut self.m_safe,
            };
            if softmax_update(&mut self.s, br, nr, nc, &mut state) {
                scale_rows(&mut self.acc, br, nr, d_v, &self.alpha);
            }
            let p = MatRef::from_column_major_slice_with_stride(&self.s, nr, nc, br);
            let acc = MatMut::from_column_major_slice_with_stride_mut(&mut self.acc, nr, d_v, br);
            matmul(acc, Accum::Add, p, head.v.subrows(local, nc), 1.0, Par::Seq);
        }
    }

    /// Writes `acc / l` for the tile's `rows` rows into `out`, and the natural-log LSE.
    pub fn write_normalised(&self, rows: usize, mut out: MatMut<'_, f32>, lse: Option<&mut [f32]>) {
        let br = self.plan.br;
        for c in 0..out.ncols() {
            let acc = &self.acc[c * br..c * br + rows];
            for (i, &a) in acc.iter().enumerate() {
                let l = self.l[i];
                // l = 0 only when nothing was visible (acc is 0 too); a NaN l stays NaN.
                out[(i, c)] = if l == 0.0 { 0.0 } else { a / l };
            }
        }
        if let Some(lse) = lse {
            for (i, x) in lse[..rows].iter_mut().enumerate() {
                *x = self.lse_row(i);
            }
        }
    }

    fn lse_row(&self, i: usize) -> f32 {
        let l = self.l[i];
        if l == 0.0 {
            f32::NEG_INFINITY
        } else {
            (self.m[i] + l.log2()) * core::f32::consts::LN_2
        }
    }
}

/// Hides the keys outside each row's structural range (diagonal and boundary tiles).
fn mask_structural(s: &mut [f32], br: usize, head: &HeadInputs<'_>, rows: Range<usize>, cols: Range<usize>) {
    for (i, row) in rows.enumerate() {
        let r = head.mask.key_range(row);
        let visible = r.start.clamp(cols.start, cols.end)..r.end.clamp(cols.start, cols.end);
        for j in (cols.start..visible.start).chain(visible.end.max(visible.start)..cols.end) {
            s[(j - cols.start) * br + i] = f32::NEG_INFINITY;
        }
    }
}

/// Applies boolean and additive masks entry by entry.
fn mask_elementwise(
    s: &mut [f32],
    br: usize,
    head: &HeadInputs<'_>,
    rows: Range<usize>,
    cols: Range<usize>,
) {
    let log2e = core::f32::consts::LOG2_E;
    for j in cols.clone() {
        let col = &mut s[(j - cols.start) * br..];
        for (i, row) in rows.clone().enumerate() {
            if let Some(b) = head.mask.boolean()
                && !b.allows(row, j)
            {
                col[i] = f32::NEG_INFINITY;
            } else if let Some(a) = head.mask.additive() {
                col[i] += a[(row, j)] * log2e;
            }
        }
    }
}

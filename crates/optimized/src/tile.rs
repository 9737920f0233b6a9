//! The tile loop of one task: a query tile stays in cache while key/value tiles stream
//! past; scores, softmax and `P·V` never leave the task's scratch.

use core::cell::RefCell;
use core::ops::Range;

use attn_core::{HeadMask, TileCoverage};
use faer::linalg::matmul::matmul;
use faer::{Accum, Mat, MatMut, MatRef, Par};

use crate::decode::{DECODE_ROWS, accumulate, best_streamer, scores, softmax_row};
use crate::element::{Element, f32_rows, row_slices};
use crate::merge::PartialState;
use crate::online_softmax::{RowState, scale_rows, softmax_update};

/// Query rows per task (at most): the Q tile, the score tile and the accumulator of this
/// many rows stay in L2 while the keys stream past.
pub const QUERY_TILE: usize = 128;
/// Keys per streamed tile: 512 amortises the per-block softmax bookkeeping and faer's
/// per-call cost (measured best on Zen 4, DESIGN.md §5).
pub const KEY_TILE: usize = 512;

/// Keys per block in the row kernels.
pub const ROW_BLOCK: usize = KEY_TILE;

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
pub(crate) struct HeadInputs<'a, T> {
    pub q: MatRef<'a, T>,
    /// Rows of K (and V) are keys `key_base ..` of the full problem.
    pub k: MatRef<'a, T>,
    pub v: MatRef<'a, T>,
    pub key_base: usize,
    pub mask: HeadMask<'a>,
    /// `scale · log2(e)`: scores come out in the log2 domain.
    pub scale_log2: f32,
    /// Each row is the single query of its own head (grouped-query decoding stacks the
    /// heads that share K and V): every row uses the mask of query 0.
    pub stacked: bool,
}

impl<T> HeadInputs<'_, T> {
    /// The mask's query index for row `row` of this job.
    fn mask_row(&self, row: usize) -> usize {
        if self.stacked { 0 } else { row }
    }

    /// The mask's query indices for rows `rows` of this job.
    fn mask_rows(&self, rows: Range<usize>) -> Range<usize> {
        if self.stacked { 0..1 } else { rows }
    }

    /// The keys query row `row` may see (structurally).
    pub fn key_range(&self, row: usize) -> Range<usize> {
        self.mask.key_range(self.mask_row(row))
    }
}

/// Per-task working memory, reused for every tile of the task (and by the next task of the
/// same shape on the same thread, see [`Scratch::with`]).
#[derive(Debug)]
pub(crate) struct Scratch {
    key: (TilePlan, usize, usize, bool),
    plan: TilePlan,
    q: Vec<f32>,
    s: Vec<f32>,
    acc: Vec<f32>,
    m: Vec<f32>,
    l: Vec<f32>,
    alpha: Vec<f32>,
    m_safe: Vec<f32>,
    /// K and V tiles widened to f32 (empty for f32 inputs, which are read in place,
    /// unless the tile is small enough for the row kernels, which always stream a copy).
    k_wide: Vec<f32>,
    v_wide: Vec<f32>,
    /// Row-major accumulators of the row kernels.
    acc_rows: Vec<f32>,
}

impl Scratch {
    pub fn new<T: Element>(plan: TilePlan, d_k: usize, d_v: usize) -> Self {
        let br = plan.br;
        let rows_kernel = br <= DECODE_ROWS.next_multiple_of(8);
        let wide = if T::WIDENS || rows_kernel { plan.bc } else { 0 };
        Self {
            key: (plan, d_k, d_v, T::WIDENS),
            plan,
            q: vec![0.0; br * d_k],
            s: vec![0.0; br * plan.bc],
            acc: vec![0.0; br * d_v],
            m: vec![0.0; br],
            l: vec![0.0; br],
            alpha: vec![0.0; br],
            m_safe: vec![0.0; br],
            k_wide: vec![0.0; wide * d_k],
            v_wide: vec![0.0; wide * d_v],
            acc_rows: vec![0.0; if rows_kernel { DECODE_ROWS * d_v } else { 0 }],
        }
    }

    /// Runs `f` with a scratch for these sizes: the one the previous task of the same
    /// shape left on this thread, or a new one. Fresh scratch costs page faults (hundreds
    /// of KiB per task), which matter when tasks are short (decoding); a thread keeps at
    /// most one scratch alive between calls.
    pub fn with<T: Element, R>(
        plan: TilePlan,
        d_k: usize,
        d_v: usize,
        f: impl FnOnce(&mut Scratch) -> R,
    ) -> R {
        thread_local! {
            static CACHE: RefCell<Option<Scratch>> = const { RefCell::new(None) };
        }
        let key = (plan, d_k, d_v, T::WIDENS);
        let cached = CACHE
            .with(|c| c.borrow_mut().take())
            .filter(|s| s.key == key);
        let mut scratch = cached.unwrap_or_else(|| Scratch::new::<T>(plan, d_k, d_v));
        let result = f(&mut scratch);
        CACHE.with(|c| *c.borrow_mut() = Some(scratch));
        result
    }

    /// Runs the online softmax of query rows `rows` over the keys `keys` (global indices),
    /// leaving the unnormalised accumulator, maxima and sums in the scratch.
    pub fn attend<T: Element>(
        &mut self,
        head: &HeadInputs<'_, T>,
        rows: Range<usize>,
        keys: Range<usize>,
    ) {
        let TilePlan { br, bc } = self.plan;
        let nr = rows.len();
        let (d_k, d_v) = (head.q.ncols(), head.v.ncols());
        debug_assert!(nr <= br);
        if nr <= DECODE_ROWS && !self.acc_rows.is_empty() {
            return self.attend_rows(head, rows, keys);
        }

        // Q tile, scaled once, column-major.
        for c in 0..d_k {
            let col = &mut self.q[c * br..c * br + nr];
            for (i, x) in col.iter_mut().enumerate() {
                *x = head.q[(rows.start + i, c)].to_f32() * head.scale_log2;
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

    /// [`Scratch::attend`] for a tile of at most [`DECODE_ROWS`] queries: a dot product per
    /// key instead of a GEMM, so the loop streams K and V at memory speed.
    fn attend_rows<T: Element>(
        &mut self,
        head: &HeadInputs<'_, T>,
        rows: Range<usize>,
        keys: Range<usize>,
    ) {
        let TilePlan { br, bc } = self.plan;
        let nr = rows.len();
        let (d_k, d_v) = (head.q.ncols(), head.v.ncols());
        for (i, q) in self.q.chunks_exact_mut(d_k).take(nr).enumerate() {
            for (c, x) in q.iter_mut().enumerate() {
                *x = head.q[(rows.start + i, c)].to_f32() * head.scale_log2;
            }
        }
        self.acc_rows.fill(0.0);
        self.m[..nr].fill(f32::NEG_INFINITY);
        self.l[..nr].fill(0.0);
        let best = best_streamer();
        for (cols, coverage) in key_blocks(head, rows.clone(), keys, ROW_BLOCK) {
            let (nc, local) = (cols.len(), cols.start - head.key_base);
            let (kb, vb) = (head.k.subrows(local, nc), head.v.subrows(local, nc));
            // Read in place where a streaming kernel exists, else copied block by block.
            let streamer = best.filter(|s| s.reads(kb) && s.reads(vb));
            // K pass, then V pass: each is one long sequential stream, which the prefetchers
            // follow at full bandwidth (interleaving K and V rows does not).
            let q_row = |i: usize| &self.q[i * d_k..(i + 1) * d_k];
            if let Some(streamer) = streamer {
                streamer.scores(&self.q[..nr * d_k], kb, vb, (&mut self.s, bc));
            } else {
                let mut k: [&[f32]; ROW_BLOCK] = [&[]; ROW_BLOCK];
                row_slices(head.k, local..local + nc, &mut self.k_wide, &mut k);
                for (i, s) in self.s.chunks_exact_mut(bc).take(nr).enumerate() {
                    scores(q_row(i), &k[..nc], &mut s[..nc]);
                }
            }
            for i in 0..nr {
                let s = &mut self.s[i * bc..i * bc + nc];
                let row = rows.start + i;
                if coverage == TileCoverage::Partial {
                    let r = head.key_range(row);
                    for (j, x) in cols.clone().zip(s.iter_mut()) {
                        if !r.contains(&j) {
                            *x = f32::NEG_INFINITY;
                        }
                    }
                }
                if head.mask.has_elementwise() {
                    for (j, x) in cols.clone().zip(s.iter_mut()) {
                        mask_entry(x, head, row, j);
                    }
                }
                self.alpha[i] = softmax_row(s, &mut self.m[i], &mut self.l[i]);
            }
            let masked = coverage == TileCoverage::Partial || head.mask.has_elementwise();
            let zero_weight = |jj: usize| (0..nr).any(|i| self.s[i * bc + jj] == 0.0);
            let careful = masked && zero_weight_meets_non_finite(vb, zero_weight);
            if let Some(streamer) = streamer.filter(|_| !careful) {
                let rest = head.k.nrows() - (local + nc);
                let next_k = head.k.subrows(local + nc, rest);
                let accs = (&mut self.acc_rows[..nr * d_v], &self.alpha[..nr]);
                streamer.accumulate(accs, (&self.s, bc), vb, next_k);
                continue;
            }
            let mut v: [&[f32]; ROW_BLOCK] = [&[]; ROW_BLOCK];
            row_slices(head.v, local..local + nc, &mut self.v_wide, &mut v);
            for i in 0..nr {
                let p = &self.s[i * bc..i * bc + nc];
                let acc = &mut self.acc_rows[i * d_v..(i + 1) * d_v];
                if careful {
                    // A hidden key must contribute nothing, not 0·V_j (see the GEMM path).
                    for a in acc.iter_mut() {
                        *a *= self.alpha[i];
                    }
                    for ((j, &pj), vj) in cols.clone().zip(p).zip(&v[..nc]) {
                        if pj != 0.0 || head.mask.sees(head.mask_row(rows.start + i), j) {
                            for (a, &x) in acc.iter_mut().zip(vj.iter()) {
                                *a += pj * x;
                            }
                        }
                    }
                } else {
                    accumulate(acc, self.alpha[i], p, &v[..nc]);
                }
            }
        }
        // Into the tile layout (column-major) that `write_normalised` reads.
        for i in 0..nr {
            for c in 0..d_v {
                self.acc[c * br + i] = self.acc_rows[i * d_v + c];
            }
        }
    }

    /// Writes `acc / l` for the tile's `rows` rows into `out`, and the natural-log LSE.
    pub fn write_normalised<O: Element>(
        &self,
        rows: usize,
        mut out: MatMut<'_, O>,
        lse: Option<&mut [f32]>,
    ) {
        for c in 0..out.ncols() {
            for i in 0..rows {
                out[(i, c)] = O::from_f32(self.normalised(i, c));
            }
        }
        if let Some(lse) = lse {
            for (i, x) in lse[..rows].iter_mut().enumerate() {
                *x = self.lse_row(i);
            }
        }
    }

    /// The tile's `rows` rows as a partial state (output and LSE), built in one pass.
    pub fn partial_state(&self, rows: usize) -> PartialState {
        let d_v = self.acc.len() / self.plan.br;
        let out = Mat::from_fn(rows, d_v, |i, c| self.normalised(i, c));
        let lse = (0..rows).map(|i| self.lse_row(i)).collect();
        PartialState::new(out, lse).expect("one LSE per row by construction")
    }

    /// Row `i`, column `c` of `acc / l`.
    fn normalised(&self, i: usize, c: usize) -> f32 {
        let (a, l) = (self.acc[c * self.plan.br + i], self.l[i]);
        // l = 0 only when nothing was visible (acc is 0 too); a NaN l stays NaN.
        if l == 0.0 { 0.0 } else { a / l }
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
/// The blocks of at most `block` keys of `keys` that query rows `rows` must visit, with
/// their coverage. Blocks start at the first key some row can see and the last one stops
/// at the last such key (on the causal diagonal that halves the work of the boundary
/// tile); fully hidden blocks are left out. Both ends depend on the shape alone.
fn key_blocks<'a, T>(
    head: &'a HeadInputs<'_, T>,
    rows: Range<usize>,
    keys: Range<usize>,
    block: usize,
) -> impl Iterator<Item = (Range<usize>, TileCoverage)> + 'a {
    let first = head.key_range(rows.start).start.max(keys.start);
    let last = head.key_range(rows.end - 1).end.min(keys.end);
    (first..last.max(first))
        .step_by(block.max(1))
        .filter_map(move |j0| {
            let cols = j0..(j0 + block).min(last);
            match head
                .mask
                .tile_coverage(head.mask_rows(rows.clone()), cols.clone())
            {
                TileCoverage::Hidden => None,
                coverage => Some((cols, coverage)),
            }
        })
}

fn mask_structural<T>(
    s: &mut [f32],
    br: usize,
    head: &HeadInputs<'_, T>,
    rows: Range<usize>,
    cols: Range<usize>,
) {
    for (i, row) in rows.enumerate() {
        let r = head.key_range(row);
        let visible = r.start.clamp(cols.start, cols.end)..r.end.clamp(cols.start, cols.end);
        for j in (cols.start..visible.start).chain(visible.end.max(visible.start)..cols.end) {
            s[(j - cols.start) * br + i] = f32::NEG_INFINITY;
        }
    }
}

/// Applies boolean and additive masks entry by entry.
fn mask_elementwise<T>(
    s: &mut [f32],
    br: usize,
    head: &HeadInputs<'_, T>,
    rows: Range<usize>,
    cols: Range<usize>,
) {
    for j in cols.clone() {
        let col = &mut s[(j - cols.start) * br..];
        for (i, row) in rows.clone().enumerate() {
            mask_entry(&mut col[i], head, row, j);
        }
    }
}

/// Whether a key that some row gives weight 0 (every hidden key, among others) has a
/// non-finite value: only then must hidden keys be skipped one by one. Scans only those
/// rows of V, so a masked block with finite values is not read twice.
fn zero_weight_meets_non_finite<T: Element>(
    v: MatRef<'_, T>,
    zero_weight: impl Fn(usize) -> bool,
) -> bool {
    (0..v.nrows()).any(|j| zero_weight(j) && v.row(j).iter().any(|x| !x.to_f32().is_finite()))
}

/// Applies the boolean and additive masks to the score of query `row` and key `j`.
fn mask_entry<T>(x: &mut f32, head: &HeadInputs<'_, T>, row: usize, j: usize) {
    let row = head.mask_row(row);
    if let Some(b) = head.mask.boolean()
        && !b.allows(row, j)
    {
        *x = f32::NEG_INFINITY;
    } else if let Some(a) = head.mask.additive() {
        *x += a[(row, j)] * core::f32::consts::LOG2_E;
    }
}

//! One key block of the backward pass: its dK and dV stay in the task's scratch while the
//! query tiles of every head of the group that see it stream past, five faer GEMMs per
//! (query tile, key block) pair and two element-wise passes between them. For bf16 at
//! native precision they are bf16 products instead — on AMX tiles, or in AVX512_BF16 pairs
//! reading the same packed operands ([`native_product`]): `S = Q·Kᵀ` and `dP = dO·Vᵀ` of
//! exact inputs, `dV += Pᵀ·dO`, `dK += dSᵀ·Q` and `dQ += dS·K` with `P` and `dS` rounded to
//! bf16 (as the forward rounds `P`).

use core::ops::Range;

use attn_core::{Error, HeadShape, Result, ScoreGradient, TileCoverage};
use faer::linalg::matmul::matmul;
use faer::reborrow::ReborrowMut;
use faer::{Accum, MatMut, MatRef, Par, RowMut};
use half::bf16;

use super::{BiasGradient, Group, QueryHead};
use crate::exact::{rescore, row_top};
use crate::kernel::Products;
use crate::kernel::amx::{self, CacheLines, LineWords, TileRows};
use crate::kernel::dropout::score_gradient_dropped;
use crate::kernel::element::{Element, f32_rows, narrow_row, widen_rows};
use crate::kernel::finite::{row_is_finite, tile_is_finite};
use crate::kernel::online_softmax::saturate;
use crate::kernel::pair_dot::{
    self, Broadcast, Columns, LANES, Lanes, pack_f32_rows, pack_lanes, pack_probabilities,
    pack_row_pairs_into, pairs,
};
use crate::kernel::softmax_grad::{probabilities, probabilities_checked, score_gradient};
use crate::kernel::transpose::transposed_times;
use crate::keys::{KeySource, PairOrder};
use crate::mask::{add_product_skipping_zeros, mask_tile};
use crate::modifiers::modify_scores;
use crate::problem::{HeadInputs, filled};
use crate::schedule::TilePlan;

/// What a row of the group contributes besides its operands, computed once per task.
#[derive(Debug)]
struct RowTerms {
    /// `D_i = Σ_t dO_it · O_it`.
    d: Vec<f32>,
    /// The forward's LSE in the log2 domain.
    lse2: Vec<f32>,
    /// Whether row `i` of Q (of dO) is finite: only a non-finite row needs the slow path
    /// where a weight of 0 meets it.
    q_finite: Vec<bool>,
    d_out_finite: Vec<bool>,
    /// The head's Q and dO widened to f32 once, row-major (empty for f32 operands, which
    /// are read in place): a query tile is visited once per key block, and widening it
    /// every time cost half precision several per cent.
    q: Vec<f32>,
    d_out: Vec<f32>,
    /// The rows whose LSE is at `±L` (every score they see saturated, as when a
    /// score modifier returns `±inf` for each): `(row, top, −log2(count))`, their top
    /// score and how many keys reach it. f32 cannot carry `top + log2(count)`, so `P` is
    /// not recovered from their LSE (it would be 1 for every top key): their top keys get
    /// `1/count`, the forward's weights, and their `lse2` is 0. Empty on ordinary input.
    saturated: Vec<(usize, f32, f32)>,
    /// Q and dO in bf16 pairs across the lanes for the tile products (`lanes_ld` words per
    /// pair), packed once; empty when the products are f32 or an entry is subnormal.
    q_lanes: LineWords,
    d_out_lanes: LineWords,
    lanes_ld: usize,
    /// Q and dO with their rows in pairs (`d_k`, `d_v` rounded up to whole vectors of
    /// words a pair), packed once for `dK += dSᵀ·Q` and `dV += Pᵀ·dO` and padded with a
    /// tile of zero pairs past the last row; empty when an entry is subnormal or not finite
    /// (a tile's padding pairs read the next tile's rows, times zero weights).
    q_pairs: LineWords,
    d_out_pairs: LineWords,
}

impl RowTerms {
    /// `D`, the LSE in the log2 domain and the finiteness of each row of `head`.
    fn compute<T: Element, K: KeySource<T>>(
        &mut self,
        head: &QueryHead<'_, T>,
        inputs: &HeadInputs<'_, T, K>,
        d_v: usize,
    ) {
        let finite = |m: MatRef<'_, T>, i: usize| row_is_finite(m.row(i));
        for i in 0..head.q.nrows() {
            self.d[i] = (0..d_v)
                .map(|t| head.d_out[(i, t)].to_f32() * head.out[(i, t)].to_f32())
                .sum();
            // Saturated like the scores (a finite LSE stays finite); -inf is a row that
            // sees nothing.
            let l = head.lse[i];
            self.lse2[i] = if l == f32::NEG_INFINITY {
                l
            } else {
                saturate(l * core::f32::consts::LOG2_E)
            };
            self.q_finite[i] = finite(head.q, i);
            self.d_out_finite[i] = finite(head.d_out, i);
            // An LSE at `±L` comes back from natural units a little inside `±f32::MAX`
            // (the limit rounded twice), hence the forward's threshold of overflow. Only rows
            // whose top score saturated: a sink near f32::MAX also makes a huge LSE, and
            // then the keys' weights are the 0 that `P` gives.
            if self.lse2[i].abs() >= f32::MAX / 2.0
                && let Some((top, count)) = row_top(inputs, i)
                && top.abs() == f64::from(f32::MAX)
            {
                self.saturated
                    .push((i, top as f32, -(count as f64).log2() as f32));
                self.lse2[i] = 0.0;
            }
        }
    }

    /// Rewrites the scores of this tile's saturated rows (`rows`, column-major, `ld`
    /// apart) so that `P = 2^(s − lse2)` gives them their forward weights: `−log2(count)`
    /// at the top, `-inf` (weight 0) elsewhere.
    fn saturated_rows(&self, s: &mut [f32], ld: usize, rows: &Range<usize>, cols: usize) {
        for &(row, top, shift) in self.saturated.iter().filter(|r| rows.contains(&r.0)) {
            let i = row - rows.start;
            for x in s.chunks_mut(ld).take(cols).map(|c| &mut c[i]) {
                *x = if *x == top { shift } else { f32::NEG_INFINITY };
            }
        }
    }
}

/// The operands of the tile products ([`amx`]) in bf16 pairs, each row padded to whole
/// tiles: the key block's K and V rows (once per block); per query tile, P and dS as rows
/// of the block's keys over the tile's queries, and the tile's dO and Q rows in pairs.
#[derive(Debug, Default)]
struct KeyRows {
    k: LineWords,
    v: LineWords,
    k_ld: usize,
    v_ld: usize,
    /// P (then dS) rounded to bf16: `bc` rows of `weights_ld` words.
    weights: LineWords,
    weights_ld: usize,
    /// dO and Q of the query tile, pairs of rows across `d_v` (`d_k`) lanes, padded.
    d_out_pairs: LineWords,
    q_pairs: LineWords,
    d_out_ld: usize,
    q_ld: usize,
    /// K's columns with the block's keys in pairs (`k_cols_ld` words each), for
    /// `dQᵀ = Kᵀ·dSᵀ`; empty when the block's K is not packed so.
    k_cols: LineWords,
    k_cols_ld: usize,
    /// dS rounded to bf16, the block's keys in pairs across the tile's query lanes
    /// (`lanes_ld` words a pair).
    ds_lanes: LineWords,
    lanes_ld: usize,
    /// What rounding dS added to each row (unused: dQ is not renormalised).
    ds_delta: Vec<f32>,
}

/// Which of the query tile's operands in pairs [`KeyRows::add_weighted`] multiplies.
#[derive(Debug, Clone, Copy)]
enum QueryRows {
    DOut,
    Q,
}

impl KeyRows {
    /// `acc += Wᵀ·X` on tiles: `W` the f32 tile `w` (`nc` keys of `nr` queries, `ld_w`
    /// apart) rounded to bf16, `X` the query tile's `which` rows in pairs (`width` wide):
    /// `packed` (the head's, from the tile's first pair on), else packed here; `acc`
    /// row-major (`nc` keys by `width`).
    fn add_weighted(
        &mut self,
        w: &[f32],
        (ld_w, nc, nr): (usize, usize, usize),
        (which, packed): (QueryRows, Option<&[u32]>),
        acc: &mut [f32],
        width: usize,
        products: Products,
    ) {
        let ld = self.weights_ld;
        pack_f32_rows(w, ld_w, nc, nr, &mut self.weights, ld);
        let (own, x_ld) = match which {
            QueryRows::DOut => (&self.d_out_pairs[..], self.d_out_ld),
            QueryRows::Q => (&self.q_pairs[..], self.q_ld),
        };
        let words = packed.unwrap_or(own);
        let x = Lanes {
            words,
            rows: width,
            ld: x_ld,
        };
        let weights = TileRows {
            words: &self.weights,
            ld,
            rows: nc,
            pairs: ld,
        };
        native_product(products, (weights, x, pairs(nr)), acc, width, 1.0, true);
    }

    /// `dq += dS·K` on tiles, computed as `dQᵀ += Kᵀ·dSᵀ` with dS (`nr` queries of `nc`
    /// keys, column-major, `ld_s` apart) rounded to bf16 and K packed by columns
    /// ([`KeyRows::k_cols`]); `dq_t` the query tile's dQ transposed (`d_k` rows of `nr`,
    /// see [`dq_row`]).
    fn add_score_gradient_times_keys(
        &mut self,
        ds: &[f32],
        (ld_s, nr, nc): (usize, usize, usize),
        dq_t: &mut [f32],
        d_k: usize,
        products: Products,
    ) {
        let ld = self.lanes_ld;
        let (pairs_nc, padded) = (pairs(nc), padded_pairs(nc));
        self.ds_delta[..nr].fill(0.0);
        pack_probabilities(ds, ld_s, nr, nc, &mut self.ds_lanes, ld, &mut self.ds_delta);
        // Whole tiles of pairs: the padding pairs are zero.
        self.ds_lanes[pairs_nc * ld..padded * ld].fill(0);
        let k = TileRows {
            words: &self.k_cols,
            ld: self.k_cols_ld,
            rows: d_k,
            pairs: padded,
        };
        let ds = Lanes {
            words: &self.ds_lanes,
            rows: nr,
            ld,
        };
        native_product(products, (k, ds, pairs_nc), dq_t, nr, 1.0, true);
    }
}

/// `c (+)= alpha·A·B` in bf16 on the unit `products` names (`Tiles` or `Pairs`): C has
/// `a.rows` rows of `b.rows` floats, `ld_c` apart, summed over the first `pairs` pairs
/// (`accumulate` adds, then `alpha` is 1). AMX multiplies A's rows of pairs as tiles
/// against B's lanes; AVX512_BF16 reads the same words the other way round, A's word
/// `(p, j)` (at `j·a.ld + p`) broadcast against B's lanes and C as its columns, so one
/// packing serves both units.
fn native_product(
    products: Products,
    (a, b, pairs): (TileRows<'_>, Lanes<'_>, usize),
    c: &mut [f32],
    ld_c: usize,
    alpha: f32,
    accumulate: bool,
) {
    if products == Products::Pairs {
        let broadcast = Broadcast {
            words: a.words,
            pairs,
            cols: a.rows,
            pair_stride: 1,
            col_stride: a.ld,
        };
        let columns = Columns {
            data: c,
            rows: b.rows,
            cols: a.rows,
            ld: ld_c,
        };
        pair_dot::product(b, broadcast, columns, alpha, accumulate);
    } else {
        amx::product(a, b, c, ld_c, alpha, accumulate);
    }
}

/// Where row `i` of a head's dQ partial (`n_q` rows of `d_k`) lies: the offset of its
/// first entry and the stride between its entries. Row-major, or, with the tile products
/// (`transposed`), each query tile of `br` rows stored as its transpose (`d_k` rows of the
/// tile's queries: what `dQᵀ += Kᵀ·dSᵀ` accumulates in place, instead of a transposed copy
/// per key block).
pub(super) fn dq_row(
    i: usize,
    (n_q, d_k, br): (usize, usize, usize),
    transposed: bool,
) -> (usize, usize) {
    if !transposed {
        return (i * d_k, 1);
    }
    let start = i / br * br;
    (start * d_k + (i - start), br.min(n_q - start))
}

/// Per-task working memory: fixed by the tile plan and the widths.
#[derive(Debug)]
pub(super) struct Scratch {
    plan: TilePlan,
    d_k: usize,
    d_v: usize,
    /// How the products multiply; `tiles` when in bf16 (on AMX or in pairs), with their
    /// packed operands.
    products: Products,
    tiles: bool,
    key_rows: KeyRows,
    /// One entry per head of the group.
    rows: Vec<RowTerms>,
    /// K and V blocks widened to f32 (unused for f32 inputs, read in place).
    k_wide: Vec<f32>,
    v_wide: Vec<f32>,
    /// Whether each key of the block has a finite K row.
    k_finite: Vec<bool>,
    /// Scores, then P; `br × bc` column-major.
    p: CacheLines<f32>,
    /// dP, then dS; `br × bc` column-major.
    ds: CacheLines<f32>,
    /// `∂modified/∂raw` of the tile's scores, `br × bc` column-major: allocated only when
    /// some head's modifiers have a derivative other than 1 ([`chains`]).
    dmod: Vec<f32>,
    /// The block's dK (unscaled) and dV accumulators, `bc` apart (column-major).
    dk: CacheLines<f32>,
    dv: CacheLines<f32>,
    /// The block's dK or dV rows gathered out of their accumulator (f32 products).
    rows_out: Vec<f32>,
}

impl Scratch {
    /// Scratch for tiles of `plan` and one group of `heads` query heads of `shape`, with
    /// each head's [`RowTerms`] computed; every buffer is allocated fallibly.
    pub fn new<T: Element, K: KeySource<T>>(
        plan: TilePlan,
        shape: &HeadShape,
        group: &Group<'_, T, K>,
        inputs: &[HeadInputs<'_, T, K>],
        products: Products,
    ) -> Result<Self> {
        let tiles = products != Products::F32;
        let TilePlan { br, bc } = plan;
        let HeadShape { n_q, d_k, d_v, .. } = *shape;
        let zeros = |what, rows: usize, cols: usize| filled(what, rows.checked_mul(cols), 0.0f32);
        let lines = |rows: usize, cols: usize| {
            CacheLines::zeroed("backward scratch", rows.checked_mul(cols))
        };
        let mut rows = Vec::new();
        rows.try_reserve_exact(group.heads.len()).map_err(|_| {
            Error::allocation_of::<RowTerms>("backward row terms", Some(group.heads.len()))
        })?;
        for (head, inputs) in group.heads.iter().zip(inputs) {
            let mut terms = RowTerms {
                d: filled("backward row terms", Some(n_q), 0.0)?,
                lse2: filled("backward row terms", Some(n_q), 0.0)?,
                q_finite: filled("backward row terms", Some(n_q), true)?,
                d_out_finite: filled("backward row terms", Some(n_q), true)?,
                q: Vec::new(),
                d_out: Vec::new(),
                saturated: Vec::new(),
                q_lanes: LineWords::default(),
                d_out_lanes: LineWords::default(),
                q_pairs: LineWords::default(),
                d_out_pairs: LineWords::default(),
                lanes_ld: n_q.next_multiple_of(LANES),
            };
            if tiles {
                let ld = terms.lanes_ld;
                let lanes = |m: MatRef<'_, T>, what| -> Result<LineWords> {
                    let mut buf = LineWords::zeroed(what, ld.checked_mul(padded_pairs(m.ncols())))?;
                    let packed = T::as_bf16(m).is_some_and(|m| pack_lanes(m, &mut buf, ld));
                    Ok(if packed { buf } else { LineWords::default() })
                };
                terms.q_lanes = lanes(head.q, "backward packed Q")?;
                terms.d_out_lanes = lanes(head.d_out, "backward packed dO")?;
            }
            if T::WIDENS {
                terms.q = zeros("backward widened Q", n_q, d_k)?;
                terms.d_out = zeros("backward widened dO", n_q, d_v)?;
                widen_rows(head.q, 0..n_q, &mut terms.q);
                widen_rows(head.d_out, 0..n_q, &mut terms.d_out);
            }
            terms.compute(head, inputs, d_v);
            if tiles {
                let row_pairs = |m: MatRef<'_, T>, finite: &[bool], what| -> Result<LineWords> {
                    let ld = m.ncols().next_multiple_of(LANES);
                    let n = padded_pairs(m.nrows()) + padded_pairs(br);
                    let (Some(m), true) = (T::as_bf16(m), finite.iter().all(|&f| f)) else {
                        return Ok(LineWords::default());
                    };
                    let mut buf = LineWords::zeroed(what, n.checked_mul(ld))?;
                    let usable = !pack_row_pairs_into(m, &mut buf, ld).subnormal;
                    Ok(if usable { buf } else { LineWords::default() })
                };
                terms.q_pairs = row_pairs(head.q, &terms.q_finite, "backward packed Q")?;
                let d_out_finite = &terms.d_out_finite;
                terms.d_out_pairs = row_pairs(head.d_out, d_out_finite, "backward packed dO")?;
            }
            rows.push(terms);
        }
        let dmod = if group.heads.iter().any(|h| chains(&h.mods)) {
            filled("backward scratch", br.checked_mul(bc), 1.0f32)?
        } else {
            Vec::new()
        };
        let key_rows = if tiles {
            let (k_ld, v_ld) = (padded_pairs(d_k), padded_pairs(d_v));
            let rows = bc.next_multiple_of(amx::TILE);
            let (weights_ld, query_pairs) = (padded_pairs(br), padded_pairs(br));
            let (d_out_ld, q_ld) = (d_v.next_multiple_of(LANES), d_k.next_multiple_of(LANES));
            let lanes_ld = br.next_multiple_of(LANES);
            KeyRows {
                k: LineWords::zeroed("backward packed K", rows.checked_mul(k_ld))?,
                v: LineWords::zeroed("backward packed V", rows.checked_mul(v_ld))?,
                k_ld,
                v_ld,
                weights: LineWords::zeroed("backward packed P", rows.checked_mul(weights_ld))?,
                weights_ld,
                d_out_pairs: LineWords::zeroed(
                    "backward packed dO",
                    query_pairs.checked_mul(d_out_ld),
                )?,
                q_pairs: LineWords::zeroed("backward packed Q", query_pairs.checked_mul(q_ld))?,
                d_out_ld,
                q_ld,
                k_cols: LineWords::zeroed(
                    "backward packed K",
                    d_k.next_multiple_of(amx::TILE)
                        .checked_mul(padded_pairs(bc)),
                )?,
                k_cols_ld: padded_pairs(bc),
                ds_lanes: LineWords::zeroed(
                    "backward packed dS",
                    padded_pairs(bc).checked_mul(lanes_ld),
                )?,
                lanes_ld,
                ds_delta: filled("backward scratch", Some(br), 0.0f32)?,
            }
        } else {
            KeyRows::default()
        };
        Ok(Self {
            plan,
            d_k,
            d_v,
            products,
            tiles,
            key_rows,
            rows,
            dmod,
            k_wide: zeros("backward scratch", bc, d_k)?,
            v_wide: zeros("backward scratch", bc, d_v)?,
            k_finite: filled("backward scratch", Some(bc), true)?,
            p: lines(br, bc)?,
            ds: lines(br, bc)?,
            dk: lines(bc, d_k)?,
            dv: lines(bc, d_v)?,
            rows_out: if tiles {
                Vec::new()
            } else {
                zeros("backward scratch", bc, d_k.max(d_v))?
            },
        })
    }

    /// Accumulates the block `cols` of the group's keys: its dK and dV over every query
    /// tile of every head that sees it, and its part of each head's dQ into `dq`
    /// (`[heads][n_q][d_k]` row-major, `head_len = n_q · d_k` apart).
    pub fn key_block<T: Element, K: KeySource<T>>(
        &mut self,
        group: &Group<'_, T, K>,
        heads: &[HeadInputs<'_, T, K>],
        cols: Range<usize>,
        dq: &mut [f32],
        head_len: usize,
        bias: Option<(&BiasGradient, &[(usize, bool)])>,
    ) {
        let TilePlan { br, bc } = self.plan;
        let (d_k, d_v, nc) = (self.d_k, self.d_v, cols.len());
        let Self {
            rows: terms,
            k_wide,
            v_wide,
            k_finite,
            p,
            ds,
            dmod,
            dk,
            dv,
            tiles,
            products,
            key_rows,
            ..
        } = self;
        let (k_src, v_src) = (group.k.block(cols.clone()), group.v.block(cols.clone()));
        // The block's K and V in pairs for the tile products, unless an entry is subnormal
        // (which the tiles would read as zero).
        let pack = |src: &K, ld: usize, buf: &mut [u32]| {
            *tiles
                && src
                    .to_pairs(PairOrder::Rows { ld }, buf)
                    .is_some_and(|r| !r.subnormal)
        };
        let k_tiles = pack(&k_src, key_rows.k_ld, &mut key_rows.k);
        // And by columns for dQ: its finite rows only (a block with another is multiplied
        // in f32, see below).
        let k_cols_ld = key_rows.k_cols_ld;
        let k_cols = *tiles
            && k_src
                .to_pairs(PairOrder::Columns { ld: k_cols_ld }, &mut key_rows.k_cols)
                .is_some_and(|r| r.exact() && !r.subnormal);
        let v_tiles = pack(&v_src, key_rows.v_ld, &mut key_rows.v);
        let k_blk = k_src.to_f32(k_wide);
        let v_blk = v_src.to_f32(v_wide);
        for (jj, f) in k_finite.iter_mut().enumerate().take(nc) {
            *f = k_blk.row(jj).iter().all(|x| x.is_finite());
        }
        let k_all_finite = k_finite[..nc].iter().all(|&f| f);
        dk.fill(0.0);
        dv.fill(0.0);
        let n_q = heads.first().map_or(0, |h| h.q.nrows());

        for (h, (head, terms)) in heads.iter().zip(terms.iter()).enumerate() {
            let dq_head = &mut dq[h * head_len..(h + 1) * head_len];
            // Whether this head's next tile is the first to reach its bias entries: every
            // tile of the first head of a plane, or its first one when the bias has one row
            // for every query.
            let plane = bias.map(|(_, heads)| heads[h]);
            let mut first_bias = plane.is_some_and(|(_, first)| first);
            let d_out = group.heads[h].d_out;
            for t in 0..n_q.div_ceil(br) {
                let rows = t * br..((t + 1) * br).min(n_q);
                let coverage = head.mask.tile_coverage(rows.clone(), cols.clone());
                if coverage == TileCoverage::Hidden {
                    continue;
                }
                let nr = rows.len();
                // S = scale·log2(e)·Q Kᵀ (the scale applied to each dot product, so Q is
                // read in place), masked, then P = 2^(S − LSE₂).
                let q_tile = tile(head.q, &terms.q, rows.clone());
                let scores = |p: &mut [f32]| {
                    if k_tiles && !terms.q_lanes.is_empty() {
                        let (ld, k_ld) = (terms.lanes_ld, key_rows.k_ld);
                        let q = Lanes {
                            words: &terms.q_lanes[rows.start..],
                            rows: nr,
                            ld,
                        };
                        let k = TileRows {
                            words: &key_rows.k,
                            ld: k_ld,
                            rows: nc,
                            pairs: k_ld,
                        };
                        let kp = pairs(d_k);
                        native_product(*products, (k, q, kp), p, br, head.scale_log2, false);
                    } else {
                        matmul(
                            MatMut::from_column_major_slice_with_stride_mut(p, nr, nc, br),
                            Accum::Replace,
                            q_tile,
                            k_blk.transpose(),
                            head.scale_log2,
                            Par::Seq,
                        );
                    }
                };
                scores(p);
                let lse2 = &terms.lse2[rows.clone()];
                // A tile with nothing to modify, mask or saturate takes P in the pass that
                // checks its scores (computed again in the rare tile that holds a
                // non-finite one, which the path below repairs first).
                let chain = chains(&head.mods);
                let plain = coverage == TileCoverage::Full
                    && !head.mask.has_elementwise()
                    && !head.mods.modifies_scores()
                    && !chain
                    && terms.saturated.is_empty();
                let done = plain && probabilities_checked(p, br, nr, nc, lse2);
                if plain && !done {
                    scores(p);
                }
                if !done {
                    if !tile_is_finite(p, br, nr, nc) {
                        // A dot product of finite rows that overflowed f32: exact, as in
                        // the forward pass (whose LSE counted the exact score).
                        let q = head.q.subrows(rows.start, nr);
                        rescore(p, (1, br), q, &k_src, head.scale_log2, None);
                    }
                    // The modifiers on the raw scores, before the masks, as in the
                    // forward; the derivative kept only where it is not 1 everywhere.
                    let derivative = if chain {
                        dmod[..nc * br].fill(1.0); // the tile's columns
                        Some(&mut dmod[..])
                    } else {
                        None
                    };
                    modify_scores(p, (1, br), head, (rows.clone(), cols.clone()), derivative);
                    mask_tile(p, br, head, (rows.clone(), cols.clone()), coverage);
                    if !terms.saturated.is_empty() {
                        terms.saturated_rows(p, br, &rows, nc);
                    }
                    probabilities(p, br, nr, nc, lse2);
                }

                // dP = dO Vᵀ, then dS = P ∘ (dP − D).
                let d_out_tile = tile(d_out, &terms.d_out, rows.clone());
                let mut dp = MatMut::from_column_major_slice_with_stride_mut(ds, nr, nc, br);
                if d_v == 0 {
                    dp.fill(0.0);
                } else if v_tiles && !terms.d_out_lanes.is_empty() {
                    let (ld, v_ld) = (terms.lanes_ld, key_rows.v_ld);
                    let d_o = Lanes {
                        words: &terms.d_out_lanes[rows.start..],
                        rows: nr,
                        ld,
                    };
                    let v = TileRows {
                        words: &key_rows.v,
                        ld: v_ld,
                        rows: nc,
                        pairs: v_ld,
                    };
                    native_product(*products, (v, d_o, pairs(d_v)), ds, br, 1.0, false);
                } else {
                    matmul(
                        dp.rb_mut(),
                        Accum::Replace,
                        d_out_tile,
                        v_blk.transpose(),
                        1.0,
                        Par::Seq,
                    );
                }
                match &head.mods.dropout {
                    // dS from the kept dP, and P dropped for dV (in one pass, one mask).
                    Some(dropout) => {
                        let terms = (&terms.d[rows.clone()], dropout);
                        score_gradient_dropped(ds, p, br, (rows.clone(), cols.clone()), terms);
                    }
                    None => score_gradient(ds, p, br, nr, nc, &terms.d[rows.clone()]),
                }
                // A user modifier with parameters gets the gradient of its scores (before
                // the chain rule, which takes it to the raw scores).
                if let Some(user) = head.mods.user {
                    let (b, hq) = head.mods.position;
                    if let Ok(g) = ScoreGradient::new(ds, br, rows.clone(), cols.clone(), b, hq) {
                        user.score_gradient(&g);
                    }
                }
                // The bias's gradient is that of the scores the softmax sees: before the
                // chain rule through the modifiers (the bias is added after them).
                if let (Some((bias, _)), Some((plane, _))) = (bias, plane) {
                    bias.add_tile(plane, ds, br, (rows.clone(), cols.clone()), first_bias);
                    first_bias &= !bias.one_row();
                }
                if chain {
                    chain_rule(ds, dmod, br, nr, nc);
                }

                let p_tile = MatRef::from_column_major_slice_with_stride(p, nr, nc, br);
                let ds_tile = MatRef::from_column_major_slice_with_stride(ds, nr, nc, br);
                let zero_in_row = |m: MatRef<'_, f32>, i: usize| (0..nc).any(|j| m[(i, j)] == 0.0);
                let zero_in_col = |m: MatRef<'_, f32>, j: usize| (0..nr).any(|i| m[(i, j)] == 0.0);

                // dV += Pᵀ dO: a zero weight must not meet a non-finite dO row.
                let careful =
                    (0..nr).any(|i| !terms.d_out_finite[rows.start + i] && zero_in_row(p_tile, i));
                let dv_acc = accumulator(dv, nc, d_v, bc, *tiles);
                let d_out_rows = T::as_bf16(d_out.subrows(rows.start, nr));
                let pairs_of = |m: Option<MatRef<'_, bf16>>, buf: &mut [u32], ld: usize| {
                    m.is_some_and(|m| {
                        let ok = !pack_row_pairs_into(m, buf, ld).subnormal;
                        buf[pairs(nr) * ld..].fill(0);
                        ok
                    })
                };
                // The tile's rows in pairs: the head's, else packed now.
                let d_out_pairs = tile_pairs(&terms.d_out_pairs, rows.start, key_rows.d_out_ld);
                if *tiles
                    && !careful
                    && (d_out_pairs.is_some()
                        || pairs_of(d_out_rows, &mut key_rows.d_out_pairs, key_rows.d_out_ld))
                {
                    // dV += Pᵀ·dO with P rounded to bf16.
                    let x = (QueryRows::DOut, d_out_pairs);
                    key_rows.add_weighted(p, (br, nc, nr), x, dv, d_v, *products);
                } else if careful {
                    add_product_skipping_zeros(dv_acc, p_tile.transpose(), d_out_tile);
                } else {
                    matmul(
                        dv_acc,
                        Accum::Add,
                        p_tile.transpose(),
                        d_out_tile,
                        1.0,
                        Par::Seq,
                    );
                }

                // dK += dSᵀ Q (unscaled Q; the scale comes once, at the end).
                let careful =
                    (0..nr).any(|i| !terms.q_finite[rows.start + i] && zero_in_row(ds_tile, i));
                let dk_acc = accumulator(dk, nc, d_k, bc, *tiles);
                let q_rows = T::as_bf16(head.q.subrows(rows.start, nr));
                let q_pairs = tile_pairs(&terms.q_pairs, rows.start, key_rows.q_ld);
                if *tiles
                    && !careful
                    && (q_pairs.is_some() || pairs_of(q_rows, &mut key_rows.q_pairs, key_rows.q_ld))
                {
                    // dK += dSᵀ·Q with dS rounded to bf16.
                    let x = (QueryRows::Q, q_pairs);
                    key_rows.add_weighted(ds, (br, nc, nr), x, dk, d_k, *products);
                } else if careful {
                    add_product_skipping_zeros(dk_acc, ds_tile.transpose(), q_tile);
                } else {
                    matmul(
                        dk_acc,
                        Accum::Add,
                        ds_tile.transpose(),
                        q_tile,
                        1.0,
                        Par::Seq,
                    );
                }

                // dQ += dS K, into this task's partial.
                let careful =
                    !k_all_finite && (0..nc).any(|j| !k_finite[j] && zero_in_col(ds_tile, j));
                // The tile's dQ, transposed with the tile products (see `dq_row`).
                let dq_rows = &mut dq_head[rows.start * d_k..rows.end * d_k];
                if *tiles && !careful && k_cols {
                    // dQ += dS·K with dS rounded to bf16.
                    let shape = (br, nr, nc);
                    key_rows.add_score_gradient_times_keys(ds, shape, dq_rows, d_k, *products);
                    continue;
                }
                let dq_tile = if *tiles {
                    MatMut::from_column_major_slice_mut(dq_rows, nr, d_k)
                } else {
                    MatMut::from_row_major_slice_mut(dq_rows, nr, d_k)
                };
                if careful {
                    add_product_skipping_zeros(dq_tile, ds_tile, k_blk);
                } else {
                    matmul(dq_tile, Accum::Add, ds_tile, k_blk, 1.0, Par::Seq);
                }
            }
        }
    }

    /// Writes the block's dK (times `scale`) and dV, rounded once: the column-major
    /// accumulators of the f32 products gathered into rows in 8 × 8 blocks first.
    pub fn write_block<'r, G: Element>(
        &mut self,
        scale: f32,
        dk: &mut [RowMut<'r, G>],
        dv: &mut [RowMut<'r, G>],
    ) {
        let (bc, d_k, d_v) = (self.plan.bc, self.d_k, self.d_v);
        let nc = dk.len();
        for (acc, rows, width, factor) in [(&self.dk, dk, d_k, scale), (&self.dv, dv, d_v, 1.0)] {
            let acc = accumulator_ref(acc, nc, width, bc, self.tiles);
            // `rows_out` holds `bc` rows of the wider of the two (f32 products only).
            if !self.tiles && width > 0 {
                transposed_times(acc.transpose(), factor, &mut self.rows_out, width);
                for (row, out) in rows.iter_mut().zip(self.rows_out.chunks_exact(width)) {
                    narrow_row(out, row.rb_mut());
                }
                continue;
            }
            for (jj, row) in rows.iter_mut().enumerate() {
                for (c, x) in row.rb_mut().iter_mut().enumerate() {
                    *x = G::from_f32(factor * acc[(jj, c)]);
                }
            }
        }
    }
}

/// The block's dK or dV accumulator (`rows` keys by `cols`): column-major, `bc` apart, for
/// faer's products; row-major for the tile products, whose C rows are keys.
fn accumulator(
    acc: &mut [f32],
    rows: usize,
    cols: usize,
    bc: usize,
    tiles: bool,
) -> MatMut<'_, f32> {
    if tiles {
        MatMut::from_row_major_slice_mut(&mut acc[..rows * cols], rows, cols)
    } else {
        MatMut::from_column_major_slice_with_stride_mut(acc, rows, cols, bc)
    }
}

/// [`accumulator`], read.
fn accumulator_ref(
    acc: &[f32],
    rows: usize,
    cols: usize,
    bc: usize,
    tiles: bool,
) -> MatRef<'_, f32> {
    if tiles {
        MatRef::from_row_major_slice(&acc[..rows * cols], rows, cols)
    } else {
        MatRef::from_column_major_slice_with_stride(acc, rows, cols, bc)
    }
}

/// The pairs of a query tile starting at row `start` (even) in a head's rows packed in
/// pairs (`ld` words a pair), when they were packed.
fn tile_pairs(words: &[u32], start: usize, ld: usize) -> Option<&[u32]> {
    (!words.is_empty()).then(|| &words[start / 2 * ld..])
}

/// Pairs of a row of `width` entries, padded to whole tiles.
fn padded_pairs(width: usize) -> usize {
    pairs(width).next_multiple_of(amx::TILE)
}

/// Whether `mods` change the scores by a function whose derivative may differ from 1: a
/// soft-cap or a user modifier (ALiBi adds a constant per entry).
fn chains(mods: &attn_core::HeadModifiers<'_>) -> bool {
    mods.softcap.is_some() || mods.user.is_some()
}

/// `dS ← dS ∘ f'` over a `rows × cols` column-major tile (`ld` apart), the gradient of the
/// raw scores from that of the modified ones. A zero stays zero: a hidden key's derivative
/// (taken at a score that was never visible), or an infinite one, must not turn its 0 into
/// NaN. The derivative saturates at `±f32::MAX` as the modified score does (the contract's
/// rule for a modifier's outputs; NaN stays NaN): a product that then overflows is an
/// overflow of finite values, which the exact repair of the gradients recomputes.
fn chain_rule(ds: &mut [f32], derivative: &[f32], ld: usize, rows: usize, cols: usize) {
    for (col, dcol) in ds.chunks_mut(ld).zip(derivative.chunks(ld)).take(cols) {
        for (x, &d) in col[..rows].iter_mut().zip(&dcol[..rows]) {
            *x = if *x == 0.0 { 0.0 } else { *x * saturate(d) };
        }
    }
}

/// Rows `rows` of `m` as f32: in place for f32 operands, else from `wide`, the whole of
/// `m` widened once (row-major).
fn tile<'a, T: Element>(m: MatRef<'a, T>, wide: &'a [f32], rows: Range<usize>) -> MatRef<'a, f32> {
    if T::WIDENS {
        let d = m.ncols();
        MatRef::from_row_major_slice(&wide[rows.start * d..rows.end * d], rows.len(), d)
    } else {
        f32_rows(m, rows, &mut [])
    }
}

//! The forward pass: `O = softmax(scale · Q Kᵀ + M) V` and its LSE, streamed tile by tile.
//!
//! [`run`] cuts every job of a [`Problem`] into (head, query tile) tasks, heaviest first,
//! and runs them on the calling thread and the rayon pool ([`for_each_index`]); each task
//! keeps one [`Scratch`] and runs one of two tile loops:
//!
//! - [`gemm_tile`]: more than [`DECODE_ROWS`] queries, faer GEMMs on the tile (prefill);
//! - [`row_tile`]: at most [`DECODE_ROWS`] queries, the row kernels (decoding).
//!
//! When the grid is too small to keep the cores busy, [`split_kv`] splits each head's keys
//! into fixed chunks as well and merges their partial states in chunk order.

mod gemm_tile;
mod native;
mod packed_head;
mod row_tile;
mod split_kv;

use core::cell::RefCell;
use core::ops::Range;
use std::sync::Mutex;

use attn_core::{Error, PartialState, Result, Tensor4Mut};
use faer::reborrow::ReborrowMut;
use faer::{Mat, MatMut, MatRef, Par, RowMut};

use self::packed_head::{PackedHead, PackedHeads};
use crate::exact;
use crate::kernel::amx::{CacheLines, LineWords};
use crate::kernel::element::{Element, narrow_row};
use crate::kernel::finite::tile_is_finite;
use crate::kernel::online_softmax::{log_sum_exp, normalise_rows, scale_rows};
use crate::kernel::transpose::transposed;
use crate::kernel::{Products, amx, pair_dot};
use crate::keys::KeySource;
use crate::modifiers::{sink_into_lse, with_sink};
use crate::problem::{Batched, HeadInputs, HeadJob, Packed, PagedBatch, Pages, Problem, filled};
use crate::schedule::{DECODE_ROWS, Order, SplitKv, TilePlan, for_each_index, splits};

/// One head into `out : [n_q, d_v]` (and its LSE), with the problem's shape already checked.
/// Fails only when the list of output rows cannot be allocated.
pub(crate) fn head<T: Element, O: Element>(
    problem: &Problem,
    inputs: HeadInputs<'_, T>,
    out: MatMut<'_, O>,
    lse: Option<&mut [f32]>,
    split: SplitKv,
    par: Par,
) -> Result<()> {
    let mut rows = row_list(out.row_iter_mut())?;
    let job = HeadJob {
        keys: inputs.key_base..inputs.key_base + inputs.k.len(),
        inputs,
        out: &mut rows,
        lse,
    };
    run(problem, vec![job], split, par);
    Ok(())
}

/// A batched call into `out : [batch, h_q, n_q, d_v]` (any layout, written in place) and,
/// if given, `lse : [batch][h_q][n_q]`; the output's dims already checked.
pub(crate) fn batched<T: Element, O: Element>(
    batch: &Batched<'_, T>,
    out: Tensor4Mut<'_, O>,
    lse: Option<&mut [f32]>,
    split: SplitKv,
    par: Par,
) -> Result<()> {
    let mut rows = row_list(out.into_rows()?.into_iter().map(RowMut::from_slice_mut))?;
    let lse = lse.unwrap_or_default();
    let jobs = batch.jobs(&mut rows, lse)?;
    run(&batch.problem, jobs, split, par);
    Ok(())
}

/// A packed call into `out : [1, h_q, total_q, d_v]` (any layout) and, if given,
/// `lse : [h_q][total_q]`; the output's dims already checked.
pub(crate) fn packed<T: Element, O: Element>(
    packed: &Packed<'_, T>,
    out: Tensor4Mut<'_, O>,
    lse: Option<&mut [f32]>,
    split: SplitKv,
    par: Par,
) -> Result<()> {
    let mut rows = row_list(out.into_rows()?.into_iter().map(RowMut::from_slice_mut))?;
    let jobs = packed.jobs(&mut rows, lse.unwrap_or_default())?;
    run(&packed.problem, jobs, split, par);
    Ok(())
}

/// A paged call into `out : [1, h_q, total_q, d_v]` (any layout) and, if given,
/// `lse : [h_q][total_q]`; the output's dims already checked.
pub(crate) fn paged<'a, T: Element, O: Element, P: Pages<'a, T>>(
    paged: &PagedBatch<'a, T, P>,
    out: Tensor4Mut<'_, O>,
    lse: Option<&mut [f32]>,
    split: SplitKv,
    par: Par,
) -> Result<()> {
    let rows = out.into_rows()?.into_iter().map(RowMut::from_slice_mut);
    let Some(order) = paged.row_order()? else {
        let mut rows = row_list(rows)?;
        let jobs = paged.jobs(&mut rows, lse.unwrap_or_default())?;
        run(&paged.problem, jobs, split, par);
        return Ok(());
    };
    // Stacked heads: the jobs take their rows (and LSE entries) in `order`.
    let mut rank = filled("paged row ranks", Some(order.len()), 0usize)?;
    for (j, &i) in order.iter().enumerate() {
        rank[i] = j;
    }
    let mut ranked = row_list(rows)?.into_iter().zip(rank).collect::<Vec<_>>();
    ranked.sort_unstable_by_key(|&(_, r)| r);
    let mut rows = row_list(ranked.into_iter().map(|(row, _)| row))?;
    let entries = if lse.is_some() { order.len() } else { 0 };
    let mut lse_jobs = filled("attention LSE", Some(entries), 0.0)?;
    let jobs = paged.jobs(&mut rows, &mut lse_jobs)?;
    run(&paged.problem, jobs, split, par);
    if let Some(lse) = lse {
        for (&i, &l) in order.iter().zip(&lse_jobs) {
            lse[i] = l;
        }
    }
    Ok(())
}

/// The output rows as a list the tasks split among themselves, allocated fallibly (a
/// caller's view may have more rows than any list can hold).
pub(crate) fn row_list<'o, O>(
    rows: impl ExactSizeIterator<Item = RowMut<'o, O>>,
) -> Result<Vec<RowMut<'o, O>>> {
    let n = rows.len();
    let mut list = Vec::new();
    list.try_reserve_exact(n)
        .map_err(|_| Error::allocation_of::<RowMut<'o, O>>("attention output rows", Some(n)))?;
    list.extend(rows);
    Ok(list)
}

/// One (head, query tile) task.
struct TileTask<'s, 'o, T, O, K> {
    inputs: HeadInputs<'s, T, K>,
    keys: Range<usize>,
    rows: Range<usize>,
    out: &'s mut [RowMut<'o, O>],
    lse: Option<&'s mut [f32]>,
    work: usize,
    /// The slot of its K/V source in the call's [`PackedHeads`], when it shares one.
    source: Option<usize>,
}

/// Splits the first `n` entries off `lse`.
fn split_lse<'a>(lse: &mut Option<&'a mut [f32]>, n: usize) -> Option<&'a mut [f32]> {
    let l = lse.take()?;
    let (a, b) = l.split_at_mut(n);
    *lse = Some(b);
    Some(a)
}

/// Runs every job of `problem`.
pub(crate) fn run<T: Element, O: Element, K: KeySource<T>>(
    problem: &Problem,
    jobs: Vec<HeadJob<'_, '_, T, O, K>>,
    split: SplitKv,
    par: Par,
) {
    let Problem { rows, plan, .. } = *problem;
    if jobs.is_empty() {
        return;
    }
    // Each job's query rows: the problem's, except in a packed batch, whose sequences
    // differ (the plan is the longest one's).
    let uniform = jobs.iter().all(|j| j.out.len() == rows);
    let tiles: usize = jobs.iter().map(|j| plan.query_tiles(j.out.len())).sum();
    if tiles == 0 {
        return; // no query: nothing to compute, however many keys
    }
    let n_k = jobs.iter().map(|j| j.keys.len()).max().unwrap_or(0);
    if uniform && splits(split, tiles, 1, n_k) {
        return split_kv::run(problem, jobs, par);
    }

    let mut tasks = Vec::with_capacity(tiles);
    // With native products, each K/V source that several query tiles read (a head's
    // tiles, a grouped-query group's heads: consecutive jobs) is packed once.
    let shared = Products::of::<T>(problem.precision) != Products::F32;
    let mut sources: Vec<(K, K, usize)> = Vec::new();
    for job in jobs {
        let HeadJob {
            inputs,
            keys,
            mut out,
            mut lse,
        } = job;
        let source = shared.then(|| match sources.last_mut() {
            Some((k, v, n)) if k.same_rows(&inputs.k) && v.same_rows(&inputs.v) => {
                *n += plan.query_tiles(out.len());
                sources.len() - 1
            }
            _ => {
                sources.push((inputs.k, inputs.v, plan.query_tiles(out.len())));
                sources.len() - 1
            }
        });
        let n_q = out.len();
        for t in 0..plan.query_tiles(n_q) {
            let rows = t * plan.br..((t + 1) * plan.br).min(n_q);
            let (tile, rest) = core::mem::take(&mut out).split_at_mut(rows.len());
            out = rest;
            let lse = split_lse(&mut lse, rows.len());
            let seen = inputs.key_range(rows.end - 1).end.min(keys.end);
            let work = seen.saturating_sub(inputs.key_range(rows.start).start.max(keys.start));
            tasks.push(TileTask {
                inputs,
                keys: keys.clone(),
                rows,
                out: tile,
                lse,
                work,
                source,
            });
        }
    }
    for task in &mut tasks {
        task.source = task.source.filter(|&i| sources[i].2 > 1);
    }
    let packed = PackedHeads::new(sources.len());
    // Heaviest first (causal: the last query tiles), so no core idles at the end.
    tasks.sort_by_key(|t| core::cmp::Reverse(t.work));
    let tasks: Vec<Mutex<Option<TileTask<'_, '_, T, O, K>>>> =
        tasks.into_iter().map(|t| Mutex::new(Some(t))).collect();
    for_each_index(tasks.len(), Order::Front, par, |i| {
        let Some(task) = tasks[i].lock().ok().and_then(|mut t| t.take()) else {
            return;
        };
        Scratch::with::<T, K, _>(problem, |scratch| {
            let (k, v) = (&task.inputs.k, &task.inputs.v);
            let split = scratch.shape.products.split();
            let head = task.source.and_then(|i| packed.get(i, (k, v), split));
            scratch.attend(&task.inputs, task.rows.clone(), task.keys.clone(), head);
            let (rows, out, mut lse) = (task.rows.clone(), task.out, task.lse);
            let sink = task.inputs.mods.sink;
            scratch.write_normalised(rows.len(), out, lse.as_deref_mut(), sink);
            if !scratch.accumulators_finite(rows.len()) {
                let bad = |i: usize| !scratch.row_finite(i);
                exact::repair_rows(&task.inputs, rows, task.keys, bad, |i, o, l| {
                    let (factor, l) = sink.map_or((1.0, l), |s| sink_into_lse(l, s));
                    for (x, &y) in out[i].rb_mut().iter_mut().zip(o) {
                        *x = O::from_f32((y * factor) as f32);
                    }
                    if let Some(lse) = lse.as_deref_mut() {
                        lse[i] = l;
                    }
                });
            }
        })
    });
}

/// An accumulator entry divided by its row's sum `l`. `l = 0` only when nothing was
/// visible (the accumulator is 0 too); a NaN `l` stays NaN.
#[inline(always)]
fn normalise(a: f32, l: f32) -> f32 {
    if l == 0.0 { 0.0 } else { a / l }
}

/// What a thread's cached [`Scratch`] was sized for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct ScratchShape {
    plan: TilePlan,
    d_k: usize,
    d_v: usize,
    widens: bool,
    /// How the GEMM tiles multiply (what [`Pairs`] holds).
    products: Products,
}

/// The operands of the native bf16 products, packed in pairs ([`pair_dot`], [`amx`]): Q
/// once per query tile, K, V and the rounded P once per block. Pair counts along a
/// contraction are padded with zero pairs to whole tiles ([`amx::TILE`]).
#[derive(Debug, Default)]
pub(crate) struct Pairs {
    /// Q's rows across the lanes, `ld` words per pair of columns.
    q: LineWords,
    /// K's rows, `k_ld` words each.
    k: LineWords,
    /// V: rows interleaved two by two, `d_v` words per pair of rows (pair products), or
    /// columns of `v_ld` words (tiles).
    v: LineWords,
    /// P rounded to bf16, its rows across the lanes.
    p: LineWords,
    /// The softmax's one pass ([`pair_dot::OnePass`]) and its first maxima: four floats a row.
    settle: Vec<f32>,
    /// Words between pairs of `q` and `p`: the query tile rounded up to whole vectors.
    ld: usize,
    /// Words of a row of `k`: `pairs(d_k)`, padded.
    k_ld: usize,
    /// Words of a column of `v` (tiles): `pairs(bc)`, padded.
    v_ld: usize,
    /// The plan's key-block width `bc`.
    block_width: usize,
    /// The low parts of operands split in two ([`Products::SplitTiles`]); `None` for
    /// operands of one part, or when their memory could not be had (then the tiles are
    /// multiplied in f32).
    low: Option<LowParts>,
}

/// The low bf16 parts of operands split in two ([`amx::Split`]), each laid out as its high
/// part in [`Pairs`], and the stage that splits them.
#[derive(Debug)]
pub(crate) struct LowParts {
    q: LineWords,
    k: LineWords,
    v: LineWords,
    p: LineWords,
    stage: pair_dot::SplitStage,
    /// Which rows of the query tile hold an infinity or a NaN (all false when none does:
    /// `q_non_finite`), and whether the block of keys packed here holds one.
    q_rows_non_finite: Vec<bool>,
    q_non_finite: bool,
    k_non_finite: bool,
}

impl Pairs {
    fn new(plan: TilePlan, d_k: usize, d_v: usize, split: bool) -> Self {
        let ld = plan.br.next_multiple_of(pair_dot::LANES);
        let k_ld = pair_dot::pairs(d_k).next_multiple_of(amx::TILE);
        let v_ld = pair_dot::pairs(plan.bc).next_multiple_of(amx::TILE);
        let rows = plan.bc.next_multiple_of(amx::TILE);
        let v_len = (pair_dot::pairs(plan.bc) * d_v).max(d_v.next_multiple_of(amx::TILE) * v_ld);
        let low = split
            .then(|| pair_dot::SplitStage::new(plan.br.max(plan.bc) * d_k.max(d_v)))
            .flatten()
            .map(|stage| LowParts {
                q: LineWords::new(k_ld * ld),
                k: LineWords::new(rows * k_ld),
                v: LineWords::new(v_len),
                p: LineWords::new(v_ld * ld),
                stage,
                q_rows_non_finite: vec![false; plan.br],
                q_non_finite: false,
                k_non_finite: false,
            });
        Self {
            q: LineWords::new(k_ld * ld),
            k: LineWords::new(rows * k_ld),
            v: LineWords::new(v_len),
            p: LineWords::new(v_ld * ld),
            settle: vec![0.0; 4 * ld],
            ld,
            k_ld,
            v_ld,
            block_width: plan.bc,
            low,
        }
    }
}

/// Per-task working memory, reused for every tile of the task (and by the next task of the
/// same shape on the same thread, see [`Scratch::with`]).
#[derive(Debug)]
pub(crate) struct Scratch {
    shape: ScratchShape,
    plan: TilePlan,
    q: Vec<f32>,
    s: CacheLines<f32>,
    /// Column-major accumulator of the GEMM tiles, `br` rows apart.
    acc: CacheLines<f32>,
    m: Vec<f32>,
    l: Vec<f32>,
    alpha: Vec<f32>,
    m_safe: Vec<f32>,
    /// Whether scaling row `i` of the query tile by `scale·log2(e)` left f32 (its scores
    /// are then recomputed exactly, see [`crate::exact`]).
    rescaled: Vec<bool>,
    /// K and V tiles widened to f32 (empty for f32 inputs, which are read in place,
    /// unless the tile is small enough for the row kernels, which may stream a copy).
    k_wide: Vec<f32>,
    v_wide: Vec<f32>,
    /// Row-major accumulators of the row tiles, `d_v` apart.
    acc_rows: Vec<f32>,
    /// Whether the last tile ran the row loop (its result is in `acc_rows`, not `acc`).
    row_tile: bool,
    /// The tile's output rows in f32 (row-major, `d_v` apart), before each is rounded to
    /// the output type in one pass.
    out_rows: Vec<f32>,
    /// Packed operands of the native bf16 products (empty for f32 products).
    pairs: Pairs,
    /// Per row, what rounding P to bf16 added to the weights `P·V` summed (rescaled with
    /// `l`): the output is normalised by their sum.
    l_delta: Vec<f32>,
}

impl Scratch {
    fn new(shape: ScratchShape) -> Self {
        let ScratchShape {
            plan,
            d_k,
            d_v,
            widens,
            products,
        } = shape;
        let br = plan.br;
        // Widened copies for tiles that need them; the row kernels of a plan for GEMM tiles
        // (a mixed batch's decoding steps, a prefill's last few rows) get theirs when
        // they first run ([`Scratch::attend_rows`]).
        let wide = if widens || br <= DECODE_ROWS.next_multiple_of(8) {
            plan.bc
        } else {
            0
        };
        Self {
            shape,
            plan,
            q: vec![0.0; br * d_k],
            s: CacheLines::new(br * plan.bc),
            acc: CacheLines::new(br * d_v),
            m: vec![0.0; br],
            l: vec![0.0; br],
            alpha: vec![0.0; br],
            m_safe: vec![0.0; br],
            rescaled: vec![false; br],
            k_wide: vec![0.0; wide * d_k],
            v_wide: vec![0.0; wide * d_v],
            acc_rows: vec![0.0; DECODE_ROWS * d_v],
            row_tile: false,
            out_rows: vec![0.0; br.max(DECODE_ROWS) * d_v],
            pairs: if products != Products::F32 {
                Pairs::new(plan, d_k, d_v, products.split())
            } else {
                Pairs::default()
            },
            l_delta: vec![0.0; br],
        }
    }

    /// Runs `f` with a scratch for these sizes: the one the previous task of the same
    /// shape left on this thread, or a new one. Fresh scratch costs page faults (hundreds
    /// of KiB per task), which matter when tasks are short (decoding); a thread keeps at
    /// most one scratch alive between calls.
    fn with<T: Element, K: KeySource<T>, R>(
        problem: &Problem,
        f: impl FnOnce(&mut Scratch) -> R,
    ) -> R {
        let Problem { plan, d_k, d_v, .. } = *problem;
        thread_local! {
            static CACHE: RefCell<Option<Scratch>> = const { RefCell::new(None) };
        }
        let shape = ScratchShape {
            plan,
            d_k,
            d_v,
            widens: T::WIDENS || K::GATHERS,
            products: Products::of::<T>(problem.precision),
        };
        let cached = CACHE
            .with(|c| c.borrow_mut().take())
            .filter(|s| s.shape == shape);
        let mut scratch = cached.unwrap_or_else(|| Scratch::new(shape));
        let result = f(&mut scratch);
        CACHE.with(|c| *c.borrow_mut() = Some(scratch));
        result
    }

    /// Runs the online softmax of query rows `rows` over the keys `keys` (global indices),
    /// leaving the unnormalised accumulator, maxima and sums in the scratch.
    fn attend<T: Element, K: KeySource<T>>(
        &mut self,
        head: &HeadInputs<'_, T, K>,
        rows: Range<usize>,
        keys: Range<usize>,
        packed: Option<&PackedHead>,
    ) {
        debug_assert!(rows.len() <= self.plan.br);
        // The row kernels stream K and V in place, run by run (quantized ones their codes):
        // a source that cannot lend its rows in place goes through the GEMM tiles, which
        // take them as f32 blocks.
        let lends = |src: &K| {
            src.in_place().is_some() || src.run_at(0).is_some() || src.quantized().is_some()
        };
        // A tile of few rows takes the row kernels whatever the plan: in a call that also
        // has long tiles (a continuous batch) its decoding steps stream as they do alone.
        // Dropout is applied to the GEMM tiles' weights only (training calls, not decoding).
        let few_rows = rows.len() <= DECODE_ROWS && head.mods.dropout.is_none();
        self.row_tile = few_rows && lends(&head.k) && lends(&head.v);
        if self.row_tile {
            self.attend_rows(head, rows, keys);
        } else {
            self.attend_gemm(head, rows, keys, packed);
        }
    }

    /// Marks in `rescaled` the query rows `rows` of `head` whose scaling by `scale·log2(e)`
    /// leaves f32 for some finite entry (their saturated copy is not their scores' source:
    /// those are recomputed exactly); returns whether there is any.
    fn mark_rescaled<T: Element, K>(
        &mut self,
        head: &HeadInputs<'_, T, K>,
        rows: Range<usize>,
    ) -> bool {
        let flags = &mut self.rescaled[..rows.len()];
        flags.fill(false);
        // Beyond `limit` a finite entry times scale·log2(e) overflows; with the usual scales
        // (below 1) `limit` is +inf and no row needs looking at.
        let limit = f32::MAX / head.scale_log2.abs();
        if limit.is_finite() {
            for (flag, i) in flags.iter_mut().zip(rows) {
                *flag = head.q.row(i).iter().any(|x| x.to_f32().abs() > limit);
            }
        }
        flags.contains(&true)
    }

    /// Writes `acc / l` for the tile's `rows` rows into `out`, and the natural-log LSE;
    /// with a sink logit, the sink joins each row's sum first (the weights then sum to
    /// `1 − p_sink`, and a row that sees nothing has LSE `sink`).
    fn write_normalised<O: Element>(
        &mut self,
        rows: usize,
        out: &mut [RowMut<'_, O>],
        lse: Option<&mut [f32]>,
        sink: Option<f32>,
    ) {
        let (d_v, br) = (self.shape.d_v, self.plan.br);
        if let Some(sink) = sink {
            self.fold_sink(rows, sink);
        }
        if !self.row_tile {
            // Divided in place a column at a time (vectorised across the rows), then the
            // rows gathered out of the column-major tile in 8 × 8 blocks.
            normalise_rows(&mut self.acc, br, rows, d_v, &self.l);
            let acc = MatRef::from_row_major_slice_with_stride(&self.acc, d_v, rows, br);
            transposed(acc, &mut self.out_rows, d_v);
        }
        for (i, row) in out.iter_mut().enumerate().take(rows) {
            // The row in f32, then rounded to `O` in one vectorised pass (a copy for f32;
            // element by element, half's rounding is a scalar call per entry).
            let buf = &mut self.out_rows[i * d_v..(i + 1) * d_v];
            if self.row_tile {
                let (acc, l) = (&self.acc_rows[i * d_v..(i + 1) * d_v], self.l[i]);
                buf.iter_mut()
                    .zip(acc)
                    .for_each(|(x, &a)| *x = normalise(a, l));
            }
            narrow_row(buf, row.rb_mut());
        }
        if let Some(lse) = lse {
            self.lse_rows(sink, &mut lse[..rows]);
        }
    }

    /// Folds the sink logit `sink` (natural units) into the state `(m, l)` and the
    /// accumulator of the first `rows` rows: the sink is one more term of each row's sum,
    /// without a value. A row that saw nothing keeps its state (`l = 0`, output 0), and its
    /// LSE is `sink` itself ([`Scratch::lse_rows`]).
    fn fold_sink(&mut self, rows: usize, sink: f32) {
        let sink2 = sink * core::f32::consts::LOG2_E;
        for i in 0..rows {
            if self.l[i] == 0.0 {
                self.alpha[i] = 1.0;
                continue;
            }
            let (m, factor, l) = with_sink(self.m[i], self.l[i], sink2);
            (self.m[i], self.alpha[i], self.l[i]) = (m, factor, l);
        }
        let (d_v, br) = (self.shape.d_v, self.plan.br);
        if self.row_tile {
            for (acc, &a) in self
                .acc_rows
                .chunks_exact_mut(d_v.max(1))
                .zip(&self.alpha[..rows])
            {
                acc.iter_mut().for_each(|x| *x *= a);
            }
        } else {
            scale_rows(&mut self.acc, br, rows, d_v, &self.alpha);
        }
    }

    /// The tile's `rows` rows as a partial state (output and LSE) over the keys `keys`,
    /// built in one pass; rows whose accumulator overflowed are recomputed exactly.
    fn partial_state<T: Element, K: KeySource<T>>(
        &self,
        head: &HeadInputs<'_, T, K>,
        rows: Range<usize>,
        keys: Range<usize>,
    ) -> PartialState {
        let (n, d_v) = (rows.len(), self.shape.d_v);
        // Filled column by column (faer's order), along the GEMM accumulator's storage.
        let mut out = Mat::from_fn(n, d_v, |i, c| self.normalised(i, c));
        // A partial state leaves the sink out: it is merged once, after every chunk.
        let mut lse = vec![0.0; n];
        self.lse_rows(None, &mut lse);
        if !self.accumulators_finite(n) {
            let bad = |i: usize| !self.row_finite(i);
            exact::repair_rows(head, rows, keys, bad, |i, o, l| {
                for (c, &y) in o.iter().enumerate() {
                    out[(i, c)] = y as f32;
                }
                lse[i] = l;
            });
        }
        PartialState::new(out, lse).expect("one LSE per row by construction")
    }

    /// Whether the accumulators and sums of the tile's first `rows` rows are all finite:
    /// the test in front of the exact repair of rows whose `Σ p·v` overflowed.
    fn accumulators_finite(&self, rows: usize) -> bool {
        let (d_v, br) = (self.shape.d_v, self.plan.br);
        let acc = if self.row_tile {
            tile_is_finite(&self.acc_rows, d_v, d_v, rows)
        } else {
            tile_is_finite(&self.acc, br, rows, d_v)
        };
        acc && tile_is_finite(&self.l, rows, rows, 1)
    }

    /// Whether row `i` of `acc / l` is finite.
    fn row_finite(&self, i: usize) -> bool {
        self.l[i].is_finite() && (0..self.shape.d_v).all(|c| self.normalised(i, c).is_finite())
    }

    /// Row `i`, column `c` of `acc / l`.
    fn normalised(&self, i: usize, c: usize) -> f32 {
        let a = if self.row_tile {
            self.acc_rows[i * self.shape.d_v + c]
        } else {
            self.acc[c * self.plan.br + i]
        };
        normalise(a, self.l[i])
    }

    /// The natural-log LSE of the first `lse.len()` rows; a row that saw nothing has the
    /// sink's logit itself (not a rounding of it), or `-inf` without one.
    fn lse_rows(&self, sink: Option<f32>, lse: &mut [f32]) {
        let n = lse.len();
        log_sum_exp(
            &self.m[..n],
            &self.l[..n],
            sink.unwrap_or(f32::NEG_INFINITY),
            lse,
        );
    }
}

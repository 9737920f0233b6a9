//! One call, validated once: the problem (dimensions every job shares, the tile plan, the
//! scale) and the jobs it resolves into, one per head or stack of heads.
//!
//! Every public entry point builds its problem here before it allocates anything; the
//! forward pass consumes the problem and its jobs and never re-derives a shape.

use core::ops::Range;

/// Every fallible buffer of the engine comes from attn-core's helper.
pub(crate) use attn_core::filled;
use attn_core::{
    BatchShape, CuSeqlens, Error, HeadMask, HeadModifiers, HeadShape, Options, PagedKv, Precision,
    QuantizedKv, Result, Tensor4Ref, validate_packed, validate_paged, validate_paged_batched,
};
use faer::{Mat, MatRef, RowMut, TryReserveError};

use crate::kernel::element::{Element, ZeroBits, zeroed_lazily};
use crate::keys::{Dense, KeySource, Paged, Quantized};
use crate::schedule::{TilePlan, heads_per_job};

/// What every job of one call shares.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Problem {
    /// Query rows of each job: `n_q`, or the stacked heads of grouped-query decoding.
    pub rows: usize,
    /// Key width.
    pub d_k: usize,
    /// Value width.
    pub d_v: usize,
    /// Tiles for `rows` queries against the longest job's keys.
    pub plan: TilePlan,
    /// `scale · log2(e)`: scores come out in the log2 domain.
    pub scale_log2: f32,
    /// How half-precision inputs are multiplied.
    pub precision: Precision,
}

impl Problem {
    fn new(
        rows: usize,
        n_k: usize,
        d_k: usize,
        d_v: usize,
        scale: f32,
        precision: Precision,
    ) -> Self {
        Self {
            rows,
            d_k,
            d_v,
            plan: TilePlan::for_shape(rows, n_k),
            scale_log2: scale * core::f32::consts::LOG2_E,
            precision,
        }
    }

    /// One head, `q : [n_q, d_k]` against `k : [n_k, d_k]`, `v : [n_k, d_v]`.
    pub fn head<'a, T>(
        q: MatRef<'a, T>,
        k: MatRef<'a, T>,
        v: MatRef<'a, T>,
        options: &Options<'a>,
    ) -> Result<(Self, HeadInputs<'a, T>)> {
        // A head is the shard of all its keys.
        let n_k = k.nrows();
        Self::shard(q, k, v, &(0..n_k), n_k, options)
    }

    /// One head over the shard `keys` of a problem with `n_k_total` keys, in which the
    /// options are expressed; `k` and `v` hold the shard's rows.
    pub fn shard<'a, T>(
        q: MatRef<'a, T>,
        k: MatRef<'a, T>,
        v: MatRef<'a, T>,
        keys: &Range<usize>,
        n_k_total: usize,
        options: &Options<'a>,
    ) -> Result<(Self, HeadInputs<'a, T>)> {
        let HeadShape { n_q, n_k, d_k, d_v } = HeadShape::of(q, k, v)?;
        if keys.end > n_k_total || keys.len() != n_k || keys.start > keys.end {
            return Err(Error::mismatch(
                "K shard",
                "rows",
                n_k,
                "the key range",
                keys.end.saturating_sub(keys.start),
                "a shard holds exactly its key range, inside n_k_total",
            ));
        }
        let scale = options.validate(1, n_q, n_k_total, d_k)?;
        check_row_handles(Some(n_q))?;
        let mask = HeadMask::new(options, n_q, n_k_total, options.key_length(0));
        let mods = options.head_modifiers(0, 0, 1, n_q, n_k_total);
        let problem = Self::new(n_q, n_k, d_k, d_v, scale, options.precision);
        Ok((problem, problem.inputs(q, k, v, keys.start, mask, mods)))
    }

    fn inputs<'a, T>(
        &self,
        q: MatRef<'a, T>,
        k: MatRef<'a, T>,
        v: MatRef<'a, T>,
        key_base: usize,
        mask: HeadMask<'a>,
        mods: HeadModifiers<'a>,
    ) -> HeadInputs<'a, T> {
        HeadInputs {
            q,
            k: Dense(k),
            v: Dense(v),
            key_base,
            mask,
            mods,
            scale_log2: self.scale_log2,
            stacked: false,
        }
    }
}

/// One head's operands, resolved: Q, and the sources of the K/V rows it may read
/// ([`KeySource`](crate::keys::KeySource): the passes ask them for blocks of rows).
#[derive(Debug, Clone, Copy)]
pub(crate) struct HeadInputs<'a, T, K = Dense<'a, T>> {
    pub q: MatRef<'a, T>,
    /// Rows of K (and V) are keys `key_base ..` of the full problem.
    pub k: K,
    pub v: K,
    pub key_base: usize,
    pub mask: HeadMask<'a>,
    /// The head's score modifiers ([`crate::modifiers`]).
    pub mods: HeadModifiers<'a>,
    /// `scale · log2(e)`.
    pub scale_log2: f32,
    /// Each row is the single query of its own head (grouped-query decoding stacks the
    /// heads that share K and V): every row uses the mask of query 0.
    pub stacked: bool,
}

impl<T, K> HeadInputs<'_, T, K> {
    /// The mask's query index for row `row` of this job.
    pub fn mask_row(&self, row: usize) -> usize {
        if self.stacked { 0 } else { row }
    }

    /// The mask's query indices for rows `rows` of this job.
    pub fn mask_rows(&self, rows: Range<usize>) -> Range<usize> {
        if self.stacked { 0..1 } else { rows }
    }

    /// The keys query row `row` may see (structurally).
    pub fn key_range(&self, row: usize) -> Range<usize> {
        self.mask.key_range(self.mask_row(row))
    }
}

/// One head (or stack of heads) to compute: its inputs, the keys it attends (global
/// indices; its K/V rows start at `keys.start`), and where its output rows (and LSE) go.
pub(crate) struct HeadJob<'s, 'o, T, O, K = Dense<'s, T>> {
    pub inputs: HeadInputs<'s, T, K>,
    pub keys: Range<usize>,
    pub out: &'s mut [RowMut<'o, O>],
    pub lse: Option<&'s mut [f32]>,
}

/// Where the keys of each batch entry come from.
#[derive(Debug, Clone, Copy)]
enum EntryKeys<'a> {
    /// All `n_k` rows, with the options' key padding as each entry's valid length.
    Padded,
    /// The first `lens[b]` rows of entry `b` (a KV cache), with nothing padded.
    Cached(&'a [usize]),
}

/// A batched call, validated: Q `[batch, h_q, n_q, d_k]` against K/V heads
/// `[batch, h_kv, n_k, d]`, query head `h` reading K/V head `h / (h_q / h_kv)`.
#[derive(Debug)]
pub(crate) struct Batched<'a, T> {
    pub problem: Problem,
    q: Tensor4Ref<'a, T>,
    k: Tensor4Ref<'a, T>,
    v: Tensor4Ref<'a, T>,
    options: Options<'a>,
    entry_keys: EntryKeys<'a>,
    /// `[batch, h_q, n_q, d_v]`.
    out_dims: [usize; 4],
    group: usize,
    /// Query heads per job ([`heads_per_job`]).
    stack: usize,
}

impl<'a, T> Batched<'a, T> {
    /// Batched attention: validates the operands and the options.
    pub fn new(
        q: Tensor4Ref<'a, T>,
        k: Tensor4Ref<'a, T>,
        v: Tensor4Ref<'a, T>,
        options: &Options<'a>,
    ) -> Result<Self> {
        let shape = BatchShape::of(q, k, v)?;
        let HeadShape { n_q, n_k, d_k, .. } = shape.head;
        let scale = options.validate_batched(shape.batch, shape.h_q, n_q, n_k, d_k)?;
        Self::build(shape, n_k, scale, q, k, v, options, EntryKeys::Padded)
    }

    /// Attention of `q` against the first `lens[b]` cached keys of each entry `b`. The
    /// cache has checked `q` against its own dims, the grouping and the options; `scale`
    /// is the options' scale for its `d_k`. Fails only when the output's rows cannot be
    /// held ([`check_row_handles`]).
    pub fn cached(
        q: Tensor4Ref<'a, T>,
        k: Tensor4Ref<'a, T>,
        v: Tensor4Ref<'a, T>,
        lens: &'a [usize],
        options: &Options<'a>,
        scale: f32,
    ) -> Result<Self> {
        let ([batch, h_q, n_q, d_k], [_, h_kv, _, d_v]) = (q.dims(), v.dims());
        let head = HeadShape {
            n_q,
            n_k: 0,
            d_k,
            d_v,
        };
        let shape = BatchShape {
            batch,
            h_q,
            h_kv,
            head,
        };
        let n_k = lens.iter().copied().max().unwrap_or(0);
        Self::build(shape, n_k, scale, q, k, v, options, EntryKeys::Cached(lens))
    }

    #[expect(clippy::too_many_arguments, reason = "the private constructor of both")]
    fn build(
        shape: BatchShape,
        n_k: usize,
        scale: f32,
        q: Tensor4Ref<'a, T>,
        k: Tensor4Ref<'a, T>,
        v: Tensor4Ref<'a, T>,
        options: &Options<'a>,
        entry_keys: EntryKeys<'a>,
    ) -> Result<Self> {
        let HeadShape { n_q, d_k, d_v, .. } = shape.head;
        // The output's row handles must fit in one allocation.
        check_row_handles(element_count(&[shape.batch, shape.h_q, n_q]))?;
        let group = shape.h_q / shape.h_kv.max(1);
        let stack = stacked_heads(options, n_q, group);
        Ok(Self {
            problem: Problem::new(stack * n_q, n_k, d_k, d_v, scale, options.precision),
            q,
            k,
            v,
            options: *options,
            entry_keys,
            out_dims: [shape.batch, shape.h_q, n_q, d_v],
            group,
            stack,
        })
    }

    /// `[batch, h_q, n_q, d_v]`.
    pub fn out_dims(&self) -> [usize; 4] {
        self.out_dims
    }

    /// The jobs writing `out` (the output's rows in (batch, head, query) order) and, if
    /// not empty, `lse` (one entry per row): one per head, or per stack of heads.
    pub fn jobs<'s, 'o, O>(
        &self,
        out: &'s mut [RowMut<'o, O>],
        lse: &'s mut [f32],
    ) -> Result<Vec<HeadJob<'s, 'o, T, O>>>
    where
        'a: 's,
    {
        let [_, h_q, n_q, _] = self.out_dims;
        let rows = self.problem.rows;
        let mut lse_chunks = lse.chunks_mut(rows.max(1));
        let mut jobs = Vec::with_capacity(out.len() / rows.max(1));
        for (idx, out) in out.chunks_mut(rows.max(1)).enumerate() {
            let first = idx * self.stack;
            let (b, h) = (first / h_q, first % h_q);
            let kv = h / self.group.max(1);
            let heads = h..h + self.stack;
            let q = if heads.len() == 1 {
                self.q.head(b, h)?
            } else {
                self.q.heads_at(b, heads, 0)?
            };
            let (k, v) = (self.k.head(b, kv)?, self.v.head(b, kv)?);
            let (n_k, key_len) = match self.entry_keys {
                EntryKeys::Padded => (k.nrows(), self.options.key_length(b)),
                EntryKeys::Cached(lens) => (lens.get(b).copied().unwrap_or(0), None),
            };
            let (k, v) = (k.subrows(0, n_k), v.subrows(0, n_k));
            // The 4-D masks' key axis spans the longest entry (all of K for padded calls).
            let mask_keys = match self.entry_keys {
                EntryKeys::Padded => n_k,
                EntryKeys::Cached(lens) => lens.iter().copied().max().unwrap_or(0),
            };
            let mut mask =
                HeadMask::for_cached_head(&self.options, b, h, n_q, n_k, mask_keys, key_len)?;
            let mut mods = self.options.head_modifiers(b, h, h_q, n_q, n_k);
            if let EntryKeys::Cached(_) = self.entry_keys {
                // The user's modifiers see a cache's new rows at their positions.
                let offset = n_k.saturating_sub(n_q);
                mask = mask.with_query_offset(offset);
                mods.query_offset = offset;
            }
            let mut inputs = self.problem.inputs(q, k, v, 0, mask, mods);
            inputs.stacked = self.stack > 1;
            jobs.push(HeadJob {
                inputs,
                keys: 0..n_k,
                out,
                lse: lse_chunks.next(),
            });
        }
        Ok(jobs)
    }
}

/// A packed call (sequences of different lengths one after the other), validated: Q
/// `[1, h_q, total_q, d_k]` against K/V `[1, h_kv, total_k, d]`, sequence `s` on its rows
/// of each. Each (sequence, query head) is one job over sub-views of the packed tensors;
/// the tile plan is the longest sequence's, so the bits do not depend on the thread count.
#[derive(Debug)]
pub(crate) struct Packed<'a, T> {
    pub problem: Problem,
    q: Tensor4Ref<'a, T>,
    k: Tensor4Ref<'a, T>,
    v: Tensor4Ref<'a, T>,
    options: Options<'a>,
    seqs: CuSeqlens<'a>,
    /// `[1, h_q, total_q, d_v]`.
    out_dims: [usize; 4],
    group: usize,
}

impl<'a, T> Packed<'a, T> {
    /// Validates the operands, the offsets and the options.
    pub fn new(
        q: Tensor4Ref<'a, T>,
        k: Tensor4Ref<'a, T>,
        v: Tensor4Ref<'a, T>,
        seqs: &CuSeqlens<'a>,
        options: &Options<'a>,
    ) -> Result<Self> {
        let (shape, scale) = validate_packed(q, k, v, seqs, options)?;
        let HeadShape { n_q, d_k, d_v, .. } = shape.head;
        check_row_handles(element_count(&[shape.h_q, n_q]))?;
        let problem = Problem::new(
            seqs.max_q(),
            seqs.max_k(),
            d_k,
            d_v,
            scale,
            options.precision,
        );
        Ok(Self {
            problem,
            q,
            k,
            v,
            options: *options,
            seqs: *seqs,
            out_dims: [1, shape.h_q, n_q, d_v],
            group: shape.h_q / shape.h_kv.max(1),
        })
    }

    /// `[1, h_q, total_q, d_v]` (packed queries) or `[batch, h_q, n_q, d_v]`.
    pub fn out_dims(&self) -> [usize; 4] {
        self.out_dims
    }

    /// The jobs writing `out` (rows in (head, packed row) order) and, if not empty, `lse`:
    /// one per (query head, sequence) with queries, each over its sequence's rows alone.
    pub fn jobs<'s, 'o, O>(
        &self,
        out: &'s mut [RowMut<'o, O>],
        lse: &'s mut [f32],
    ) -> Result<Vec<HeadJob<'s, 'o, T, O>>>
    where
        'a: 's,
    {
        let [_, h_q, _, _] = self.out_dims;
        let batch = self.seqs.batch();
        let n = h_q.checked_mul(batch);
        let mut jobs = Vec::new();
        jobs.try_reserve_exact(n.unwrap_or(usize::MAX))
            .map_err(|_| Error::allocation_of::<HeadJob<'s, 'o, T, O>>("packed jobs", n))?;
        let (mut out, mut lse) = (out, if lse.is_empty() { None } else { Some(lse) });
        for h in 0..h_q {
            let kv = h / self.group.max(1);
            let (qh, kh, vh) = (self.q.head(0, h)?, self.k.head(0, kv)?, self.v.head(0, kv)?);
            for s in 0..batch {
                let (rows, keys) = (self.seqs.queries(s), self.seqs.keys(s));
                let (rows_out, rows_lse) = take_rows(&mut out, &mut lse, rows.len());
                if rows.is_empty() {
                    continue;
                }
                let mask = HeadMask::new(&self.options, rows.len(), keys.len(), None).at(s, h);
                let mods = self
                    .options
                    .head_modifiers(s, h, h_q, rows.len(), keys.len());
                let inputs = self.problem.inputs(
                    qh.subrows(rows.start, rows.len()),
                    kh.subrows(keys.start, keys.len()),
                    vh.subrows(keys.start, keys.len()),
                    0,
                    mask,
                    mods,
                );
                jobs.push(HeadJob {
                    inputs,
                    keys: 0..keys.len(),
                    out: rows_out,
                    lse: rows_lse,
                });
            }
        }
        Ok(jobs)
    }
}

/// A paged call, validated: packed queries `[1, h_q, total_q, d_k]` against the pages of a
/// [`PagedKv`], sequence `s`'s queries (rows `cu_q[s]..cu_q[s + 1]`) its newest positions
/// — or batched ones, `[batch, h_q, n_q, d_k]`, `n_q` a sequence (a cache's call).
/// Each (query head, sequence) is one job whose K and V are [`Paged`] sources, as a packed
/// call's are sub-views; the tile plan is the longest sequence's, so the bits do not depend
/// on the thread count (nor on the page size: a block is the same keys in any pages).
#[derive(Debug)]
pub(crate) struct PagedBatch<'a, T, P = PagedKv<'a, T>> {
    pub problem: Problem,
    q: Tensor4Ref<'a, T>,
    kv: P,
    queries: QueryRows<'a>,
    options: Options<'a>,
    /// `[1, h_q, total_q, d_v]` (packed) or `[batch, h_q, n_q, d_v]`.
    out_dims: [usize; 4],
    group: usize,
    /// Query heads per job of a decoding sequence (one query): [`heads_per_job`].
    stack: usize,
}

/// Where a paged call's queries are: packed, sequence `s` on rows `cu_q[s]..cu_q[s + 1]`
/// of `[1, h_q, total_q, d]`, or batched, on rows `0..n_q` of batch entry `s`.
#[derive(Debug, Clone, Copy)]
enum QueryRows<'a> {
    Packed(&'a [usize]),
    Batched { n_q: usize },
}

impl QueryRows<'_> {
    /// Sequence `s`'s rows in its batch entry of Q and of the output.
    fn rows(&self, s: usize) -> Range<usize> {
        match *self {
            QueryRows::Packed(cu) => cu[s]..cu[s + 1],
            QueryRows::Batched { n_q } => 0..n_q,
        }
    }

    /// The batch entry of Q and of the output that holds sequence `s`'s rows.
    fn entry(&self, s: usize) -> usize {
        match self {
            QueryRows::Packed(_) => 0,
            QueryRows::Batched { .. } => s,
        }
    }
}

/// The pages a paged call reads: of elements ([`PagedKv`]) or quantized ([`QuantizedKv`]).
pub(crate) trait Pages<'a, T: Element>: Copy {
    /// One head of one sequence in them.
    type Source: KeySource<T> + 'a;
    /// What the pages hold: `T`, or code bytes.
    type Stored: 'a;

    /// The block table and lengths (of the codes, for quantized pages).
    fn table(&self) -> PagedKv<'a, Self::Stored>;

    /// The keys (`keys`) or values of head `head` of sequence `s`.
    fn source(&self, keys: bool, s: usize, head: usize) -> Self::Source;

    /// The products' precision for the options' choice: quantized blocks are dequantized
    /// to f32, which the f32 products take.
    fn precision(&self, chosen: Precision) -> Precision {
        chosen
    }
}

impl<'a, T: Element> Pages<'a, T> for PagedKv<'a, T> {
    type Source = Paged<'a, T>;
    type Stored = T;

    fn table(&self) -> PagedKv<'a, T> {
        *self
    }

    fn source(&self, keys: bool, s: usize, head: usize) -> Paged<'a, T> {
        let pool = if keys { self.keys() } else { self.values() };
        Paged::new(self, pool, s, head)
    }
}

impl<'a, T: Element> Pages<'a, T> for QuantizedKv<'a> {
    type Source = Quantized<'a>;
    type Stored = u8;

    fn table(&self) -> PagedKv<'a, u8> {
        self.codes()
    }

    fn source(&self, keys: bool, s: usize, head: usize) -> Quantized<'a> {
        Quantized::new(self, keys, s, head)
    }

    fn precision(&self, _: Precision) -> Precision {
        Precision::F32
    }
}

impl<'a, T: Element, P: Pages<'a, T>> PagedBatch<'a, T, P> {
    /// Validates the packed queries, their offsets and the options against the pages.
    pub fn new(
        q: Tensor4Ref<'a, T>,
        cu_q: &'a [usize],
        kv: P,
        options: &Options<'a>,
    ) -> Result<Self> {
        let (shape, scale) = validate_paged(q, cu_q, &kv.table(), options)?;
        Self::validated(q, QueryRows::Packed(cu_q), kv, (shape, scale), options)
    }

    /// Validates batched queries (`[batch, h_q, n_q, d_k]`, one batch entry a sequence)
    /// and the options against the pages.
    pub fn batched(q: Tensor4Ref<'a, T>, kv: P, options: &Options<'a>) -> Result<Self> {
        let (shape, scale) = validate_paged_batched(q, &kv.table(), options)?;
        let rows = QueryRows::Batched {
            n_q: shape.head.n_q,
        };
        Self::validated(q, rows, kv, (shape, scale), options)
    }

    fn validated(
        q: Tensor4Ref<'a, T>,
        queries: QueryRows<'a>,
        kv: P,
        (shape, scale): (BatchShape, f32),
        options: &Options<'a>,
    ) -> Result<Self> {
        let HeadShape { n_q, n_k, d_k, d_v } = shape.head;
        check_row_handles(element_count(&[shape.batch, shape.h_q, n_q]))?;
        let counts = (0..kv.table().batch()).map(|s| queries.rows(s).len());
        let max_q = counts.clone().max().unwrap_or(0);
        let group = shape.h_q / shape.h_kv.max(1);
        let stack = stacked_heads(options, 1, group);
        // The plan has room for a stack of heads: its tiles are the longest sequence's
        // whenever that has more rows (a tile holds at most QUERY_TILE rows either way).
        let decodes = counts.clone().any(|n| n == 1);
        let rows = if decodes { max_q.max(stack) } else { max_q };
        Ok(Self {
            problem: Problem::new(rows, n_k, d_k, d_v, scale, kv.precision(options.precision)),
            q,
            kv,
            queries,
            options: *options,
            out_dims: [shape.batch, shape.h_q, n_q, d_v],
            group,
            stack,
        })
    }

    /// The jobs in order, as (query heads, sequence), head by head: a decoding sequence's
    /// heads stacked [`heads_per_job`] at a time (the stack's heads share a K/V head), every
    /// other sequence's one head a job; sequences without queries have none.
    fn job_list(&self) -> Result<Vec<(Range<usize>, usize)>> {
        let [_, h_q, _, _] = self.out_dims;
        let batch = self.kv.table().batch();
        let n = h_q.checked_mul(batch);
        let mut jobs = Vec::new();
        jobs.try_reserve_exact(n.unwrap_or(usize::MAX))
            .map_err(|_| Error::allocation_of::<(Range<usize>, usize)>("paged jobs", n))?;
        let stack = self.stack.max(1);
        for h in 0..h_q {
            for s in 0..batch {
                match self.queries.rows(s).len() {
                    0 => {}
                    1 if stack > 1 => {
                        if h.is_multiple_of(stack) {
                            jobs.push((h..(h + stack).min(h_q), s));
                        }
                    }
                    _ => jobs.push((h..h + 1, s)),
                }
            }
        }
        Ok(jobs)
    }

    /// The output rows (indices into `[batch][h_q][n_q]`, `[1][h_q][total_q]` packed) in
    /// the order the jobs write them: `None` when that is the rows' own order (nothing
    /// stacked, queries packed). The forward pass hands the jobs their rows in this order.
    pub fn row_order(&self) -> Result<Option<Vec<usize>>> {
        let [_, h_q, n_q, _] = self.out_dims;
        let jobs = self.job_list()?;
        let n = element_count(&self.out_dims[..3]);
        let mut order = Vec::new();
        order
            .try_reserve_exact(n.unwrap_or(usize::MAX))
            .map_err(|_| Error::allocation_of::<usize>("paged row order", n))?;
        for (heads, s) in jobs {
            let (rows, entry) = (self.queries.rows(s), self.queries.entry(s));
            for h in heads {
                order.extend(rows.clone().map(|r| (entry * h_q + h) * n_q + r));
            }
        }
        let in_order = order.iter().enumerate().all(|(j, &i)| i == j);
        Ok((!in_order).then_some(order))
    }

    /// `[1, h_q, total_q, d_v]` (packed queries) or `[batch, h_q, n_q, d_v]`.
    pub fn out_dims(&self) -> [usize; 4] {
        self.out_dims
    }

    /// The jobs writing `out` and, if not empty, `lse`, their rows in [`Self::row_order`]:
    /// one per (query head, sequence) with queries, over the sequence's pages, or per stack
    /// of heads of a decoding sequence. Masks, windows and the user's modifiers see the
    /// queries at their positions in the sequence, as a [`crate::KvCache`]'s do.
    pub fn jobs<'s, 'o, O>(
        &self,
        out: &'s mut [RowMut<'o, O>],
        lse: &'s mut [f32],
    ) -> Result<Vec<HeadJob<'s, 'o, T, O, P::Source>>>
    where
        'a: 's,
    {
        let [_, h_q, _, _] = self.out_dims;
        let list = self.job_list()?;
        let mut jobs = Vec::new();
        jobs.try_reserve_exact(list.len()).map_err(|_| {
            Error::allocation_of::<HeadJob<'s, 'o, T, O>>("paged jobs", Some(list.len()))
        })?;
        let (mut out, mut lse) = (out, if lse.is_empty() { None } else { Some(lse) });
        for (heads, s) in list {
            let (h, kv) = (heads.start, heads.start / self.group.max(1));
            let (rows, n_k) = (self.queries.rows(s), self.kv.table().lens()[s]);
            let (n_q, entry) = (rows.len(), self.queries.entry(s));
            let (rows_out, rows_lse) = take_rows(&mut out, &mut lse, n_q * heads.len());
            let q = if heads.len() > 1 {
                self.q.heads_at(entry, heads.clone(), rows.start)?
            } else {
                self.q.head(entry, h)?.subrows(rows.start, n_q)
            };
            // The queries are the sequence's last `n_q` positions (validated: n_q ≤ n_k).
            let offset = n_k - n_q;
            let mask = HeadMask::new(&self.options, n_q, n_k, None)
                .at(s, h)
                .with_query_offset(offset);
            let mut mods = self.options.head_modifiers(s, h, h_q, n_q, n_k);
            mods.query_offset = offset;
            let inputs = HeadInputs {
                q,
                k: self.kv.source(true, s, kv),
                v: self.kv.source(false, s, kv),
                key_base: 0,
                mask,
                mods,
                scale_log2: self.problem.scale_log2,
                stacked: heads.len() > 1,
            };
            jobs.push(HeadJob {
                inputs,
                keys: 0..n_k,
                out: rows_out,
                lse: rows_lse,
            });
        }
        Ok(jobs)
    }
}

/// Query heads per job for `n_q` queries a head and `group` query heads a K/V head
/// ([`heads_per_job`]). Stacked heads share one mask and one set of modifiers: one head a
/// job when those differ between them.
fn stacked_heads(options: &Options<'_>, n_q: usize, group: usize) -> usize {
    if options.varies_over_heads() {
        1
    } else {
        heads_per_job(n_q, group)
    }
}

/// The next `n` output rows and LSE entries of a packed or paged call's jobs, taken off the
/// front of what is left.
fn take_rows<'s, 'o, O>(
    out: &mut &'s mut [RowMut<'o, O>],
    lse: &mut Option<&'s mut [f32]>,
    n: usize,
) -> (&'s mut [RowMut<'o, O>], Option<&'s mut [f32]>) {
    let (rows, rest) = core::mem::take(out).split_at_mut(n);
    *out = rest;
    let rows_lse = lse.take().map(|l| {
        let (a, b) = l.split_at_mut(n);
        *lse = Some(b);
        a
    });
    (rows, rows_lse)
}

// Every buffer whose size a caller chooses (outputs, LSE, the KV cache) is allocated here,
// fallibly: a size that overflows, exceeds `isize::MAX` bytes or is refused by the allocator
// is an `Error::Allocation` naming the buffer, never a panic or an abort.

/// The product of `dims`, `None` when it overflows `usize` (0 whenever a dim is 0, however
/// large the others).
pub(crate) fn element_count(dims: &[usize]) -> Option<usize> {
    if dims.contains(&0) {
        return Some(0);
    }
    dims.iter().try_fold(1usize, |n, &d| n.checked_mul(d))
}

/// A zeroed buffer of `dims.product()` elements, or [`Error::Allocation`]; its memory is
/// mapped as it is first written ([`zeroed_lazily`]).
pub(crate) fn zeroed<T: ZeroBits>(what: &'static str, dims: &[usize]) -> Result<Vec<T>> {
    zeroed_lazily(what, element_count(dims))
}

/// A zeroed `rows × cols` matrix, or [`Error::Allocation`]: faer's own fallible
/// reservation of the final buffer (faer pads each column and sizes its buffer by whole
/// columns, so even `cols = 0` needs `rows · size_of::<T>()` to fit `usize`).
pub(crate) fn zeroed_mat<T: Element>(
    what: &'static str,
    rows: usize,
    cols: usize,
) -> Result<Mat<T>> {
    let mut m = Mat::new();
    m.try_reserve(rows, cols).map_err(|e| match e {
        TryReserveError::AllocError { layout } => Error::allocation(what, layout.size()),
        TryReserveError::CapacityOverflow => {
            Error::allocation_of::<T>(what, rows.checked_mul(cols.max(1)))
        }
    })?;
    // Within the capacity just reserved: no further allocation.
    m.resize_with(rows, cols, |_, _| T::from_f32(0.0));
    Ok(m)
}

/// The forward pass holds one row handle per output row (whatever `d_v` is, even 0):
/// `rows` of them (`None`: a count that overflowed) must fit in one allocation, else
/// [`Error::Allocation`]. Returns `rows`.
fn check_row_handles(rows: Option<usize>) -> Result<usize> {
    let handle = size_of::<RowMut<'static, f32>>();
    match rows {
        Some(n)
            if n.checked_mul(handle)
                .is_some_and(|b| b <= isize::MAX as usize) =>
        {
            Ok(n)
        }
        _ => Err(Error::allocation_of::<RowMut<'static, f32>>(
            "attention output rows",
            rows,
        )),
    }
}

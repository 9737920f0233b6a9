//! The backward pass: dQ, dK and dV from the upstream gradient dO, the forward's output O
//! and its LSE, streamed tile by tile without ever holding `n_q × n_k`.
//!
//! Per head, with `D_i = Σ_t dO_it · O_it` and `P = 2^(scale·log2e·QKᵀ + M − LSE·log2e)`
//! recomputed (never stored): `dV = Pᵀ dO`, `dP = dO Vᵀ`, `dS = P ∘ (dP − D)`,
//! `dQ = scale · dS K`, `dK = scale · dSᵀ Q`.
//!
//! Score modifiers: the recomputed scores are modified as in the forward pass (before the
//! masks, [`crate::modifiers::modify_scores`]), so `P` is the forward's (its LSE counts the
//! sink), and `dS` is multiplied by `∂modified/∂raw` where that is not 1 (a soft-cap or a
//! user modifier; ALiBi alone needs no derivative). The sink logits' gradient
//! `dσ_h = −Σ_i p_sink,i · D_i` needs no tile: it is summed from the rows' LSE and `D` in
//! f64, in group order ([`Backward::sink_gradients`]).
//!
//! [`Backward::run`] cuts every (batch, kv head) *group* — a kv head and the query heads
//! that share it — into tasks that own key blocks ([`TilePlan::for_backward`]): a task
//! holds one block's dK and dV in f32 while every query tile of every head of the group
//! that sees it streams past ([`key_block`]), and writes them rounded once. Nothing is
//! recomputed (one pass over the tile pairs, FlashAttention-2's order). dQ sums over key
//! blocks: each task adds into its own f32 partial of its group's dQ, and the partials are
//! reduced in a fixed order at the end. With few groups the blocks of a group are dealt to
//! [`key_chunks`] tasks in turn (block `b` to chunk `b mod C`, which balances causal work);
//! `C` depends on the shape alone, so the bits never depend on the thread count, and there
//! are no atomics.

mod bias;
mod key_block;

use core::ops::Range;
use std::sync::Mutex;

use attn_core::{
    BatchShape, CuSeqlens, Error, HeadMask, HeadModifiers, HeadShape, Options, Precision, Result,
    Tensor4Ref, TileCoverage, validate_batch_backward, validate_head_backward,
    validate_packed_backward,
};
use faer::reborrow::{Reborrow, ReborrowMut};
use faer::{MatRef, Par, RowMut};

pub(crate) use self::bias::BiasGradient;
use self::key_block::dq_row;
use crate::exact;
use crate::kernel::Products;
use crate::kernel::amx::CacheLines;
use crate::kernel::element::{Element, narrow_row};
use crate::keys::{Dense, KeySource};
use crate::problem::{HeadInputs, element_count, filled};
use crate::schedule::{Order, TilePlan, for_each_index, key_chunks};

/// One query head of a group: its operands, its mask (4-D masks differ per head), its
/// score modifiers and the forward's results for it.
#[derive(Debug, Clone, Copy)]
struct QueryHead<'a, T> {
    q: MatRef<'a, T>,
    d_out: MatRef<'a, T>,
    out: MatRef<'a, T>,
    lse: &'a [f32],
    mask: HeadMask<'a>,
    mods: HeadModifiers<'a>,
    /// The query head of the call (the index of its sink logit's gradient).
    head: usize,
}

/// A kv head and the query heads that read it (one, without grouped-query attention).
/// Every head of a group has the same number of queries.
#[derive(Debug)]
struct Group<'a, T, K = Dense<'a, T>> {
    k: K,
    v: K,
    heads: Vec<QueryHead<'a, T>>,
    /// Its batch entry (a packed call's sequence) and kv head.
    at: (usize, usize),
}

impl<T, K> Group<'_, T, K> {
    /// Queries of each head.
    fn n_q(&self) -> usize {
        self.heads.first().map_or(0, |h| h.q.nrows())
    }
}

/// A backward call, validated: every group, and what they share.
#[derive(Debug)]
pub(crate) struct Backward<'a, T, K = Dense<'a, T>> {
    /// The widths, and the lengths of the whole call (a packed call's totals).
    shape: HeadShape,
    scale: f32,
    plan: TilePlan,
    groups: Vec<Group<'a, T, K>>,
    /// `Some(h_q)` when the call has sink logits: [`Backward::run`] returns their gradients.
    sinks: Option<usize>,
    /// How the tiles multiply: AMX tiles, AVX512_BF16 pairs or f32.
    products: Products,
    /// The gradient of the additive mask, when asked for ([`Backward::with_bias_gradient`]).
    bias: Option<BiasGradient<'a>>,
}

/// Where a task writes: the dK and dV rows of each of its key blocks.
struct BlockRows<'s, 'o, G> {
    block: usize,
    dk: &'s mut [RowMut<'o, G>],
    dv: &'s mut [RowMut<'o, G>],
}

/// One task: some key blocks of one group.
struct Task<'s, 'o, G> {
    group: usize,
    /// Which of the group's key chunks it holds.
    chunk: usize,
    blocks: Vec<BlockRows<'s, 'o, G>>,
    /// This task's f32 partial of the group's dQ, `[heads][n_q][d_k]` row-major.
    dq: &'s mut [f32],
    work: usize,
}

impl<'a, T: Element> Backward<'a, T> {
    /// One head: `grad_out` and `out` are `[n_q, d_v]`, `lse` has `n_q` entries.
    #[allow(clippy::too_many_arguments)]
    pub fn head(
        grad_out: MatRef<'a, T>,
        q: MatRef<'a, T>,
        k: MatRef<'a, T>,
        v: MatRef<'a, T>,
        out: MatRef<'a, T>,
        lse: &'a [f32],
        options: &Options<'a>,
    ) -> Result<Self> {
        let (shape, scale) = validate_head_backward(q, k, v, grad_out, out, lse.len(), options)?;
        let group = Group {
            k: Dense(k),
            v: Dense(v),
            heads: vec![QueryHead {
                q,
                d_out: grad_out,
                out,
                lse,
                mask: HeadMask::new(options, shape.n_q, shape.n_k, options.key_length(0)),
                mods: options.head_modifiers(0, 0, 1, shape.n_q, shape.n_k),
                head: 0,
            }],
            at: (0, 0),
        };
        let plan = TilePlan::for_backward(shape.n_q, shape.n_k);
        let sinks = options.sinks.map(|_| 1);
        Ok(Self::new(
            shape,
            scale,
            plan,
            vec![group],
            sinks,
            options.precision,
        ))
    }

    /// A batched, grouped-query call over `[batch, heads, seq, dim]` views: `grad_out`
    /// and `out` are `[batch, h_q, n_q, d_v]`, `lse` is `[batch][h_q][n_q]`.
    #[allow(clippy::too_many_arguments)]
    pub fn batched(
        grad_out: Tensor4Ref<'a, T>,
        q: Tensor4Ref<'a, T>,
        k: Tensor4Ref<'a, T>,
        v: Tensor4Ref<'a, T>,
        out: Tensor4Ref<'a, T>,
        lse: &'a [f32],
        options: &Options<'a>,
    ) -> Result<Self> {
        let (shape, scale) = validate_batch_backward(q, k, v, grad_out, out, lse.len(), options)?;
        let BatchShape {
            batch, h_q, h_kv, ..
        } = shape;
        let HeadShape { n_q, n_k, .. } = shape.head;
        let group = h_q / h_kv.max(1);
        let mut groups = Vec::new();
        groups.try_reserve_exact(batch * h_kv).map_err(|_| {
            Error::allocation_of::<Group<'a, T>>("backward groups", Some(batch * h_kv))
        })?;
        for b in 0..batch {
            for kv in 0..h_kv {
                let heads = (kv * group..(kv + 1) * group)
                    .map(|h| {
                        let first = (b * h_q + h) * n_q;
                        Ok(QueryHead {
                            q: q.head(b, h)?,
                            d_out: grad_out.head(b, h)?,
                            out: out.head(b, h)?,
                            lse: &lse[first..first + n_q],
                            mask: HeadMask::for_head(
                                options,
                                b,
                                h,
                                n_q,
                                n_k,
                                options.key_length(b),
                            )?,
                            mods: options.head_modifiers(b, h, h_q, n_q, n_k),
                            head: h,
                        })
                    })
                    .collect::<Result<Vec<_>>>()?;
                groups.push(Group {
                    k: Dense(k.head(b, kv)?),
                    v: Dense(v.head(b, kv)?),
                    heads,
                    at: (b, kv),
                });
            }
        }
        let plan = TilePlan::for_backward(n_q, n_k);
        let sinks = options.sinks.map(|_| h_q);
        Ok(Self::new(
            shape.head,
            scale,
            plan,
            groups,
            sinks,
            options.precision,
        ))
    }

    /// A packed call: `grad_out` and `out` are `[1, h_q, total_q, d_v]`, `lse` is
    /// `[h_q][total_q]`. One group per (sequence, kv head), in that order, over sub-views
    /// of the packed tensors; the tile plan is the longest sequence's. The rows given to
    /// [`Backward::run`] must follow the groups ([`Backward::packed_row_order`]).
    #[allow(clippy::too_many_arguments)]
    pub fn packed(
        grad_out: Tensor4Ref<'a, T>,
        q: Tensor4Ref<'a, T>,
        k: Tensor4Ref<'a, T>,
        v: Tensor4Ref<'a, T>,
        out: Tensor4Ref<'a, T>,
        lse: &'a [f32],
        seqs: &CuSeqlens<'a>,
        options: &Options<'a>,
    ) -> Result<Self> {
        let (shape, scale) =
            validate_packed_backward(q, k, v, grad_out, out, lse.len(), seqs, options)?;
        let BatchShape { h_q, h_kv, .. } = shape;
        let total_q = shape.head.n_q;
        let group = h_q / h_kv.max(1);
        let n_groups = seqs.batch().saturating_mul(h_kv);
        let mut groups = Vec::new();
        groups
            .try_reserve_exact(n_groups)
            .map_err(|_| Error::allocation_of::<Group<'a, T>>("backward groups", Some(n_groups)))?;
        for s in 0..seqs.batch() {
            let (rows, keys) = (seqs.queries(s), seqs.keys(s));
            let mask = HeadMask::new(options, rows.len(), keys.len(), None);
            let sub = |m: MatRef<'a, T>, r: &Range<usize>| m.subrows(r.start, r.len());
            for kv in 0..h_kv {
                let heads = (kv * group..(kv + 1) * group)
                    .map(|h| {
                        let first = h * total_q;
                        Ok(QueryHead {
                            q: sub(q.head(0, h)?, &rows),
                            d_out: sub(grad_out.head(0, h)?, &rows),
                            out: sub(out.head(0, h)?, &rows),
                            lse: &lse[first + rows.start..first + rows.end],
                            // The user's modifiers see the sequence as the batch entry.
                            mask: mask.at(s, h),
                            mods: options.head_modifiers(s, h, h_q, rows.len(), keys.len()),
                            head: h,
                        })
                    })
                    .collect::<Result<Vec<_>>>()?;
                groups.push(Group {
                    k: Dense(sub(k.head(0, kv)?, &keys)),
                    v: Dense(sub(v.head(0, kv)?, &keys)),
                    heads,
                    at: (s, kv),
                });
            }
        }
        let plan = TilePlan::for_backward(seqs.max_q(), seqs.max_k());
        let sinks = options.sinks.map(|_| h_q);
        Ok(Self::new(
            shape.head,
            scale,
            plan,
            groups,
            sinks,
            options.precision,
        ))
    }

    /// The order in which [`Backward::run`] takes the rows of a packed call's gradients:
    /// for dQ the indices into `(head, packed query)` order, for dK and dV into
    /// `(kv head, packed key)` order, listed group by group.
    pub fn packed_row_order(
        seqs: &CuSeqlens<'_>,
        h_q: usize,
        h_kv: usize,
    ) -> (Vec<usize>, Vec<usize>) {
        let group = h_q / h_kv.max(1);
        let (total_q, total_k) = (seqs.total_q(), seqs.total_k());
        let (mut dq, mut dk) = (Vec::new(), Vec::new());
        for s in 0..seqs.batch() {
            for kv in 0..h_kv {
                for h in kv * group..(kv + 1) * group {
                    dq.extend(seqs.queries(s).map(|r| h * total_q + r));
                }
                dk.extend(seqs.keys(s).map(|j| kv * total_k + j));
            }
        }
        (dq, dk)
    }
}

impl<'a, T: Element, K: KeySource<T>> Backward<'a, T, K> {
    fn new(
        shape: HeadShape,
        scale: f32,
        plan: TilePlan,
        groups: Vec<Group<'a, T, K>>,
        sinks: Option<usize>,
        precision: Precision,
    ) -> Self {
        // bf16 at native precision multiplies on AMX tiles or in AVX512_BF16 pairs
        // (`key_block`); f16's split products serve the forward only.
        let products = match Products::of::<T>(precision) {
            p @ (Products::Tiles | Products::Pairs) => p,
            _ => Products::F32,
        };
        Self {
            shape,
            scale,
            plan,
            groups,
            sinks,
            products,
            bias: None,
        }
    }

    /// The same call computing the gradient of its additive mask as well, for a call of
    /// dims `[batch, h_q, n_q, n_k]` ([`BiasGradient::new`] says which masks have one).
    pub fn with_bias_gradient(
        mut self,
        options: &Options<'_>,
        dims: [usize; 4],
        out: Option<&'a mut [f32]>,
    ) -> Result<Self> {
        let mut bias = match out {
            None => BiasGradient::new(options, dims)?,
            Some(out) => BiasGradient::into_caller(options, dims, out)?,
        };
        let heads = |g: &Group<'a, T, K>| (g.at.0, g.heads.iter().map(|h| h.head).collect());
        bias.assign(self.groups.iter().map(heads));
        self.bias = Some(bias);
        Ok(self)
    }

    /// The gradient of the additive mask, after [`Backward::run`].
    pub fn into_bias_gradient(self) -> Option<BiasGradient<'a>> {
        self.bias
    }

    /// The shape of each head.
    pub fn shape(&self) -> HeadShape {
        self.shape
    }

    /// Computes the gradients into the rows of dQ (`(group, head, query)` order, which is
    /// `(batch, h_q, n_q)`), dK and dV (`(group, key)` order: `(batch, h_kv, n_k)`), and
    /// returns those of the sink logits (`[h_q]`) when the call has them.
    pub fn run<'o, G: Element>(
        &self,
        dq: &mut [RowMut<'o, G>],
        dk: &mut [RowMut<'o, G>],
        dv: &mut [RowMut<'o, G>],
        par: Par,
    ) -> Result<Option<Vec<f32>>> {
        let dsinks = self.sink_gradients()?;
        let d_k = self.shape.d_k;
        let bc = self.plan.bc;
        // Per group: its key blocks, the chunks they are dealt to, the length of each
        // chunk's dQ partial and where the group's partials start. The same for every
        // group of a batched call; a packed call's sequences differ.
        let mut layout = Vec::with_capacity(self.groups.len());
        let mut total = Some(0usize);
        // The groups whose tasks run side by side: every group, or with a bias gradient
        // one per set of groups that share bias planes (their tasks run in turn).
        let parallel = match &self.bias {
            None => self.groups.len(),
            Some(bias) => {
                let mut keys: Vec<_> = self
                    .groups
                    .iter()
                    .map(|g| bias.bundle(g.at.0, g.at.1))
                    .collect();
                keys.sort_unstable();
                keys.dedup();
                keys.len()
            }
        };
        for g in &self.groups {
            let blocks = g.k.len().div_ceil(bc);
            let chunks = key_chunks(parallel, blocks);
            let per_task = element_count(&[g.heads.len(), g.n_q(), d_k]);
            let start = total.unwrap_or(usize::MAX);
            total = total
                .zip(per_task.and_then(|p| p.checked_mul(chunks)))
                .and_then(|(t, n)| t.checked_add(n));
            layout.push((blocks, chunks, per_task.unwrap_or(usize::MAX), start));
        }
        // On cache lines: the tile products accumulate into query tiles of them.
        let mut partials = CacheLines::<f32>::zeroed("dQ partials", total)?;
        let tasks_n: usize = layout.iter().map(|l| l.1).sum();

        // Deal each group's key blocks (and their output rows) to its chunks in turn.
        let mut tasks: Vec<Task<'_, '_, G>> = Vec::with_capacity(tasks_n);
        let mut parts_rest: &mut [f32] = &mut partials;
        let (mut dk_rest, mut dv_rest) = (&mut *dk, &mut *dv);
        for (g, &(blocks, chunks, per_task, _)) in layout.iter().enumerate() {
            let first = tasks.len();
            for chunk in 0..chunks {
                let (part, rest) = core::mem::take(&mut parts_rest).split_at_mut(per_task);
                parts_rest = rest;
                tasks.push(Task {
                    group: g,
                    chunk,
                    blocks: Vec::with_capacity(blocks.div_ceil(chunks)),
                    dq: part,
                    work: 0,
                });
            }
            let n_k = self.groups[g].k.len();
            let (dk_g, rest) = core::mem::take(&mut dk_rest).split_at_mut(n_k);
            dk_rest = rest;
            let (dv_g, rest) = core::mem::take(&mut dv_rest).split_at_mut(n_k);
            dv_rest = rest;
            let blocks_g = dk_g.chunks_mut(bc).zip(dv_g.chunks_mut(bc));
            for (b, (dk, dv)) in blocks_g.enumerate() {
                let task = &mut tasks[first + b % chunks];
                task.work += self.block_work(&self.groups[g], b * bc..b * bc + dk.len());
                task.blocks.push(BlockRows { block: b, dk, dv });
            }
        }
        // Bundles of tasks that run in turn, in group order: one task each, or with a bias
        // gradient those of one key chunk whose groups share bias planes.
        let bundle_of = |t: &Task<'_, '_, G>| {
            let g = &self.groups[t.group];
            let shared = self.bias.as_ref().map(|b| b.bundle(g.at.0, g.at.1));
            (shared, t.chunk, shared.is_none().then_some(t.group))
        };
        tasks.sort_by_key(|t| (bundle_of(t), t.group));
        let mut bundles: Vec<(usize, Vec<Task<'_, '_, G>>)> = Vec::new();
        for task in tasks {
            match bundles.last_mut() {
                Some((work, list)) if bundle_of(&list[0]) == bundle_of(&task) => {
                    *work += task.work;
                    list.push(task);
                }
                _ => bundles.push((task.work, vec![task])),
            }
        }
        // Heaviest first, so that no core idles at the end.
        bundles.sort_by_key(|b| core::cmp::Reverse(b.0));
        let bundles: Vec<Mutex<Option<Vec<Task<'_, '_, G>>>>> = bundles
            .into_iter()
            .map(|(_, b)| Mutex::new(Some(b)))
            .collect();
        let failure = Mutex::new(None);
        for_each_index(bundles.len(), Order::Front, par, |i| {
            let Some(bundle) = bundles[i].lock().ok().and_then(|mut t| t.take()) else {
                return;
            };
            for task in bundle {
                if let Err(e) = self.run_task(task)
                    && let Ok(mut f) = failure.lock()
                {
                    f.get_or_insert(e);
                }
            }
        });
        drop(bundles);
        if let Some(e) = failure.into_inner().ok().flatten() {
            return Err(e);
        }

        // dQ: the partials of each group summed in chunk order, scaled, rounded once; a
        // row at a time, its entries side by side (vectorised where the partials' rows
        // are contiguous, as they are for the f32 products).
        // Sized only where there are rows (a call without query rows may have any width).
        let mut sums = if dq.is_empty() {
            Vec::new()
        } else {
            filled("backward dQ row", Some(d_k), 0.0f32)?
        };
        let mut dq_rest = &mut *dq;
        for (g, &(_, chunks, per_task, start)) in layout.iter().enumerate() {
            let group = &self.groups[g];
            let (rows, rest) =
                core::mem::take(&mut dq_rest).split_at_mut(group.heads.len() * group.n_q());
            dq_rest = rest;
            let group_parts = &partials[start..start + chunks * per_task];
            let (n_q, tiles) = (group.n_q(), self.products != Products::F32);
            for (r, row) in rows.iter_mut().enumerate() {
                let (h, i) = (r / n_q.max(1), r % n_q.max(1));
                let (first, stride) = dq_row(i, (n_q, d_k, self.plan.br), tiles);
                let at = h * n_q * d_k + first;
                sums.fill(0.0);
                for part in group_parts.chunks_exact(per_task.max(1)) {
                    if stride == 1 {
                        for (sum, &x) in sums.iter_mut().zip(&part[at..at + d_k]) {
                            *sum += x;
                        }
                    } else {
                        for (c, sum) in sums.iter_mut().enumerate() {
                            *sum += part[at + c * stride];
                        }
                    }
                }
                for sum in &mut sums {
                    *sum *= self.scale;
                }
                narrow_row(&sums, row.rb_mut());
            }
        }
        self.repair_overflowed(dq, dk, dv);
        Ok(dsinks)
    }

    /// `dσ_h = −Σ_i p_sink,i · D_i` for each query head `h`, `p_sink,i = exp(σ_h − LSE_i)`
    /// (capped at 1, as `P` is), summed in f64 over the groups in order (batch entries or
    /// sequences) and their rows: the same bits whatever the thread count. A row whose
    /// output is 0 (it sees no key) adds nothing, whatever its dO (`D` is 0 there, not
    /// `0 · inf`). `None` without sink logits; 0 for a head whose sink is `-inf`.
    fn sink_gradients(&self) -> Result<Option<Vec<f32>>> {
        let Some(h_q) = self.sinks else {
            return Ok(None);
        };
        let mut sums = filled("sink gradients", Some(h_q), 0.0f64)?;
        for head in self.groups.iter().flat_map(|g| &g.heads) {
            let Some(sink) = head.mods.sink else {
                continue;
            };
            let (sink, d_v) = (f64::from(sink), head.out.ncols());
            let mut sum = 0.0f64;
            for (i, &lse) in head.lse.iter().enumerate() {
                let (d_out, out) = (head.d_out.row(i), head.out.row(i));
                if out.iter().all(|x| x.to_f32() == 0.0) {
                    continue;
                }
                let d: f64 = (0..d_v)
                    .map(|t| f64::from(d_out[t].to_f32()) * f64::from(out[t].to_f32()))
                    .sum();
                // Capped at 1 as P is; a NaN LSE stays NaN (`min` would drop it).
                let t = sink - f64::from(lse);
                sum += if t > 0.0 { 1.0 } else { t.exp() } * d;
            }
            if let Some(x) = sums.get_mut(head.head) {
                *x -= sum;
            }
        }
        Ok(Some(sums.into_iter().map(|x| x as f32).collect()))
    }

    /// Recomputes exactly ([`exact::repair_gradients`]) the gradient rows that left the
    /// finite range although everything they depend on is finite: f32 partial sums that
    /// overflowed (operands beyond about 1e19). Every other row keeps its bits.
    fn repair_overflowed<G: Element>(
        &self,
        dq: &mut [RowMut<'_, G>],
        dk: &mut [RowMut<'_, G>],
        dv: &mut [RowMut<'_, G>],
    ) {
        let finite = |r: &RowMut<'_, G>| r.rb().iter().all(|x| x.to_f32().is_finite());
        let write = |row: &mut RowMut<'_, G>, values: &[f64]| {
            for (x, &y) in row.rb_mut().iter_mut().zip(values) {
                *x = G::from_f32(y as f32);
            }
        };
        // Groups may differ in their lengths (a packed call's sequences): their rows
        // follow each other in group order.
        let (mut dq_rest, mut dk_rest, mut dv_rest) = (dq, dk, dv);
        for group in &self.groups {
            let (n_q, n_k) = (group.n_q(), group.k.len());
            let (dq_g, rest) = core::mem::take(&mut dq_rest).split_at_mut(group.heads.len() * n_q);
            dq_rest = rest;
            let (dk_g, rest) = core::mem::take(&mut dk_rest).split_at_mut(n_k);
            dk_rest = rest;
            let (dv_g, rest) = core::mem::take(&mut dv_rest).split_at_mut(n_k);
            dv_rest = rest;
            if dq_g.iter().all(finite) && dk_g.iter().all(finite) && dv_g.iter().all(finite) {
                continue;
            }
            let heads: Vec<exact::BackwardHead<'_, T, K>> = group
                .heads
                .iter()
                .zip(self.head_inputs(group))
                .map(|(h, inputs)| exact::BackwardHead {
                    inputs,
                    d_out: h.d_out,
                    out: h.out,
                    lse: h.lse,
                })
                .collect();
            let bad_dq: Vec<bool> = dq_g.iter().map(|r| !finite(r)).collect();
            let bad_key: Vec<bool> = (0..n_k)
                .map(|j| !finite(&dk_g[j]) || !finite(&dv_g[j]))
                .collect();
            let _ = exact::repair_gradients(
                &heads,
                self.scale,
                (|h, i| bad_dq[h * n_q + i], |j| bad_key[j]),
                |h, i, x| write(&mut dq_g[h * n_q + i], x),
                |j, k, v| {
                    write(&mut dk_g[j], k);
                    write(&mut dv_g[j], v);
                },
            );
        }
    }

    /// The [`HeadInputs`] of each query head of `group`, each with its own mask.
    fn head_inputs<'g>(&self, group: &'g Group<'a, T, K>) -> Vec<HeadInputs<'g, T, K>> {
        group
            .heads
            .iter()
            .map(|h| HeadInputs {
                q: h.q,
                k: group.k,
                v: group.v,
                key_base: 0,
                mask: h.mask,
                mods: h.mods,
                scale_log2: self.scale * core::f32::consts::LOG2_E,
                stacked: false,
            })
            .collect()
    }

    /// Query rows that see some key of `cols`, over the group's heads: the task's weight.
    fn block_work(&self, group: &Group<'a, T, K>, cols: Range<usize>) -> usize {
        let (br, n_q) = (self.plan.br, group.n_q());
        let seen: usize = group
            .heads
            .iter()
            .map(|h| {
                (0..n_q.div_ceil(br))
                    .filter(|t| {
                        let rows = t * br..((t + 1) * br).min(n_q);
                        h.mask.tile_coverage(rows, cols.clone()) != TileCoverage::Hidden
                    })
                    .count()
            })
            .sum();
        seen * br
    }

    fn run_task<G: Element>(&self, task: Task<'_, '_, G>) -> Result<()> {
        let group = &self.groups[task.group];
        let shape = HeadShape {
            n_q: group.n_q(),
            n_k: group.k.len(),
            ..self.shape
        };
        if shape.n_q == 0 {
            // No query sees any key: the blocks' gradients are 0, and no scratch is needed
            // (whose size an empty Q's width alone would set).
            for BlockRows { dk, dv, .. } in task.blocks {
                for row in dk.iter_mut().chain(dv.iter_mut()) {
                    row.rb_mut().iter_mut().for_each(|x| *x = G::from_f32(0.0));
                }
            }
            return Ok(());
        }
        if task.blocks.is_empty() {
            return Ok(()); // no key: the partial dQ stays 0
        }
        let heads = self.head_inputs(group);
        let products = self.products;
        let mut scratch = key_block::Scratch::new(self.plan, &shape, group, &heads, products)?;
        let HeadShape { n_q, d_k, .. } = shape;
        let bc = self.plan.bc;
        let bias = self.bias.as_ref().map(|b| (b, b.heads(task.group)));
        for BlockRows { block, dk, dv } in task.blocks {
            let cols = block * bc..block * bc + dk.len();
            scratch.key_block(group, &heads, cols, task.dq, n_q * d_k, bias);
            scratch.write_block(self.scale, dk, dv);
        }
        Ok(())
    }
}

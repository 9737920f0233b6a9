//! One step of the ring, without MPI: a block of K and V (one rank's shard, packed) folded
//! into this rank's queries, forward ([`fold_forward`]) and backward ([`fold_backward`]).
//! The ring and the in-process simulation both call these, so they compute the same bits.
//!
//! The work of a step is cut into calls of the streaming engine (a head and a chunk of
//! query rows forward, a head and a chunk of keys backward) whose size depends only on
//! the shapes; between two calls the caller's `poll` runs (the ring tests its outstanding
//! requests there, so that OpenMPI moves the next block while this one is computed).

use core::ops::Range;

use attn_core::{Causal, Error, Options, PartialState, Tensor4, Tensor4Ref};
use attn_optimized::{Attention, ColMut, Element, ForwardRef, GradientsMut, Par};
use faer::{Mat, MatRef};
use rayon::ThreadPool;

use crate::exchange::{Plan, Shape};
use crate::split::Segment;

/// Query rows per forward call: a sixteenth of the rank's longest run of rows, between 512
/// and 2048 rows (4 and 16 query tiles) — fixed by the shape. Long enough that the ends of
/// calls (where the pool's threads meet) cost little: 512-row calls measured 5–15 % slower
/// than one call per step on 2 threads; short enough to poll often (16 polls per step and
/// head at n/P = 32k, where one 16 MiB block moves in milliseconds).
pub(crate) fn query_chunk(longest_run: usize) -> usize {
    (longest_run / 16).next_multiple_of(128).clamp(512, 2048)
}
/// Keys per backward call.
pub(crate) const KEY_CHUNK: usize = 1024;

/// Where the engine's calls run: on the ring's pool (the calling thread waits, and alone
/// talks to MPI between calls), or on the current rayon pool.
pub(crate) struct Exec<'p> {
    pub pool: Option<&'p ThreadPool>,
}

impl Exec<'_> {
    fn run<R: Send>(&self, f: impl FnOnce() -> R + Send) -> R {
        match self.pool {
            Some(p) => p.install(f),
            None => f(),
        }
    }
}

/// A K/V block: one rank's K then V, each `[batch][h_kv][rows][d]`, contiguous.
pub(crate) struct KvBlock<'a, T> {
    pub data: &'a [T],
    pub rows: usize,
    pub segments: &'a [Segment],
}

impl<'a, T> KvBlock<'a, T> {
    fn head(&self, s: &Shape, b: usize, h: usize) -> (MatRef<'a, T>, MatRef<'a, T>) {
        let (k_len, _) = s.kv_len(self.rows);
        let i = b * s.h_kv + h;
        let (ks, vs) = (self.rows * s.d_k, self.rows * s.d_v);
        let k = &self.data[i * ks..(i + 1) * ks];
        let v = &self.data[k_len + i * vs..k_len + (i + 1) * vs];
        (
            MatRef::from_row_major_slice(k, self.rows, s.d_k),
            MatRef::from_row_major_slice(v, self.rows, s.d_v),
        )
    }
}

/// Packs a rank's K and V shards into a block buffer (resized to fit).
pub(crate) fn pack_kv<T: Copy + Default>(
    s: &Shape,
    k: Tensor4Ref<'_, T>,
    v: Tensor4Ref<'_, T>,
    rows: usize,
    dst: &mut Vec<T>,
) -> attn_core::Result<()> {
    let (k_len, v_len) = s.kv_len(rows);
    dst.clear();
    dst.try_reserve_exact(k_len + v_len)
        .map_err(|_| Error::allocation_of::<T>("K/V block", Some(k_len + v_len)))?;
    for (t, d) in [(k, s.d_k), (v, s.d_v)] {
        for b in 0..s.batch {
            for h in 0..s.h_kv {
                let m = t.head(b, h)?;
                for i in 0..rows {
                    dst.extend((0..d).map(|c| m[(i, c)]));
                }
            }
        }
    }
    Ok(())
}

/// A zeroed f32 buffer of `len` elements, allocation failure as an error.
pub(crate) fn zeros_f32(what: &'static str, len: usize) -> attn_core::Result<Vec<f32>> {
    filled(what, len, 0.0)
}

/// A buffer of `len` copies of `x`, allocation failure as an error.
fn filled(what: &'static str, len: usize, x: f32) -> attn_core::Result<Vec<f32>> {
    let mut v = Vec::new();
    v.try_reserve_exact(len)
        .map_err(|_| Error::allocation_of::<f32>(what, Some(len)))?;
    v.resize(len, x);
    Ok(v)
}

/// A zeroed `rows × cols` matrix, allocation failure as an error (faer's `Mat::zeros`
/// aborts the process when the allocator refuses).
pub(crate) fn zero_mat(
    what: &'static str,
    rows: usize,
    cols: usize,
) -> attn_core::Result<Mat<f32>> {
    let mut m = Mat::new();
    m.try_reserve(rows, cols)
        .map_err(|_| Error::allocation_of::<f32>(what, rows.checked_mul(cols)))?;
    m.resize_with(rows, cols, |_, _| 0.0);
    Ok(m)
}

/// How a run of queries sees a run of keys under the ring's mask.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Sight {
    /// No query sees any key: the call is skipped.
    Hidden,
    /// Every query sees every key: no mask.
    Full,
    /// The diagonal: queries `[g0, g1)` see keys `[k0, j]` for `j ≤ i`, with `k0 ≤ g0`;
    /// the keys past `g1 − 1` are cut off, and the rest is the bottom-right causal mask of
    /// the call (the last query aligned with the last key kept).
    Diagonal {
        /// Keys kept, counted from the start of the key run.
        keys: usize,
    },
}

/// `queries` and `keys` are global positions, each a run of consecutive ones.
pub(crate) fn sight(causal: bool, queries: &Range<usize>, keys: &Range<usize>) -> Sight {
    if !causal {
        return Sight::Full;
    }
    if queries.is_empty() || keys.is_empty() || keys.start >= queries.end {
        return Sight::Hidden;
    }
    if keys.end <= queries.start + 1 {
        return Sight::Full;
    }
    Sight::Diagonal {
        keys: keys.end.min(queries.end) - keys.start,
    }
}

fn options(scale: f32, causal: Option<Causal>) -> Options<'static> {
    let o = Options::default().with_scale(scale);
    match causal {
        Some(c) => o.with_causal(c),
        None => o,
    }
}

/// A chunk of query rows of the shard.
#[derive(Debug, Clone)]
struct QueryChunk {
    local: usize,
    global: Range<usize>,
}

/// This rank's forward state: one partial state per (batch, query head, query chunk).
pub(crate) struct ForwardAcc {
    chunks: Vec<QueryChunk>,
    states: Vec<PartialState>,
    /// The engine's output for one call, reused (as a partial state while it is merged).
    scratch: Option<(Mat<f32>, Vec<f32>)>,
}

impl ForwardAcc {
    /// Every state of the rank's rows, allocated fallibly: a rank that cannot hold them
    /// says so before the ring turns.
    pub fn new(plan: &Plan, rank: usize) -> attn_core::Result<Self> {
        let mut chunks = vec![];
        let longest = plan.segments[rank]
            .iter()
            .map(Segment::len)
            .max()
            .unwrap_or(0);
        let chunk_rows = query_chunk(longest);
        for seg in &plan.segments[rank] {
            let mut at = 0;
            while at < seg.len() {
                let len = chunk_rows.min(seg.len() - at);
                let g = seg.global.start + at;
                chunks.push(QueryChunk {
                    local: seg.local + at,
                    global: g..g + len,
                });
                at += len;
            }
        }
        let s = plan.shape;
        // The plan checked that the states' total size fits (`Shape::check_sizes`).
        let count = s.batch * s.h_q * chunks.len();
        let mut states = Vec::new();
        states
            .try_reserve_exact(count)
            .map_err(|_| Error::allocation_of::<PartialState>("ring states", Some(count)))?;
        for _ in 0..s.batch * s.h_q {
            for c in &chunks {
                let rows = c.global.len();
                let lse = filled("ring states", rows, f32::NEG_INFINITY)?;
                states.push(PartialState::new(
                    zero_mat("ring states", rows, s.d_v)?,
                    lse,
                )?);
            }
        }
        Ok(Self {
            chunks,
            states,
            scratch: None,
        })
    }

    fn take_scratch(&mut self, rows: usize, d_v: usize) -> attn_core::Result<(Mat<f32>, Vec<f32>)> {
        match self.scratch.take() {
            Some((o, l)) if o.nrows() == rows => Ok((o, l)),
            _ => Ok((
                zero_mat("ring scratch", rows, d_v)?,
                zeros_f32("ring scratch", rows)?,
            )),
        }
    }

    /// The output `[batch, h_q, rows, d_v]` in the `[B,H,S,D]` layout, rounded to `T` once,
    /// and the LSE `[batch][h_q][rows]`.
    pub fn finish<T: Element + Default>(
        &self,
        s: &Shape,
        rows: usize,
    ) -> attn_core::Result<(Tensor4<T>, Vec<f32>)> {
        let mut out = Tensor4::<T>::try_zeros([s.batch, s.h_q, rows, s.d_v])?;
        let mut lse = zeros_f32("LSE", s.batch * s.h_q * rows)?;
        let mut view = out.as_mut();
        let per_head = self.chunks.len();
        for b in 0..s.batch {
            for h in 0..s.h_q {
                let head = b * s.h_q + h;
                let mut dst = view.head_mut(b, h)?;
                for (c, chunk) in self.chunks.iter().enumerate() {
                    let st = &self.states[head * per_head + c];
                    let o = st.output();
                    for i in 0..chunk.global.len() {
                        for col in 0..s.d_v {
                            dst[(chunk.local + i, col)] = T::from_f32(o[(i, col)]);
                        }
                        lse[head * rows + chunk.local + i] = st.lse()[i];
                    }
                }
            }
        }
        Ok((out, lse))
    }
}

/// Folds one K/V block into this rank's query states; returns the engine calls made.
pub(crate) fn fold_forward<T: Element>(
    plan: &Plan,
    q: Tensor4Ref<'_, T>,
    acc: &mut ForwardAcc,
    block: &KvBlock<'_, T>,
    exec: &Exec<'_>,
    poll: &mut dyn FnMut(),
) -> attn_core::Result<usize> {
    let s = plan.shape;
    let per_head = acc.chunks.len();
    let mut calls = 0;
    for kseg in block.segments {
        for b in 0..s.batch {
            for h in 0..s.h_q {
                let (kh, vh) = block.head(&s, b, h / s.group());
                let qh = q.head(b, h)?;
                for c in 0..per_head {
                    let chunk = acc.chunks[c].clone();
                    let (keys, opts) = match sight(plan.causal, &chunk.global, &kseg.global) {
                        Sight::Hidden => continue,
                        Sight::Full => (kseg.len(), options(plan.scale, None)),
                        Sight::Diagonal { keys } => {
                            if kseg.global.start > chunk.global.start
                                || kseg.global.end < chunk.global.end
                            {
                                return Err(internal("a key run starts inside a query chunk"));
                            }
                            (keys, options(plan.scale, Some(Causal::BottomRight)))
                        }
                    };
                    let m = chunk.global.len();
                    let (mut o, mut l) = acc.take_scratch(m, s.d_v)?;
                    let (qc, kc, vc) = (
                        qh.subrows(chunk.local, m),
                        kh.subrows(kseg.local, keys),
                        vh.subrows(kseg.local, keys),
                    );
                    exec.run(|| {
                        Attention::head(qc, kc, vc, &opts).and_then(|call| {
                            call.forward_into(
                                o.as_mut(),
                                Some(ColMut::from_slice_mut(&mut l)),
                                Par::rayon(0),
                            )
                        })
                    })?;
                    let part = PartialState::new(o, l)?;
                    acc.states[(b * s.h_q + h) * per_head + c].merge_in_place(&part)?;
                    acc.scratch = Some(part.into_parts());
                    calls += 1;
                    poll();
                }
            }
        }
    }
    Ok(calls)
}

fn internal(what: &'static str) -> Error {
    Error::unsupported("ring step", what)
}

/// What this rank's backward pass reads: its shards of dO, Q and O, and the LSE of its rows.
#[derive(Clone, Copy)]
pub(crate) struct BackwardInputs<'a, T> {
    pub grad_out: Tensor4Ref<'a, T>,
    pub q: Tensor4Ref<'a, T>,
    pub out: Tensor4Ref<'a, T>,
    pub lse: &'a [f32],
}

/// This rank's dQ (f32, `[batch][h_q][rows][d_k]`) and the scratch of the engine's calls.
pub(crate) struct BackwardAcc {
    pub dq: Vec<f32>,
    dq_part: Mat<f32>,
    dk_part: Mat<f32>,
    dv_part: Mat<f32>,
}

impl BackwardAcc {
    pub fn new(plan: &Plan, rank: usize) -> attn_core::Result<Self> {
        let s = plan.shape;
        let rows = plan.rows[rank];
        let longest = plan.segments[rank]
            .iter()
            .map(Segment::len)
            .max()
            .unwrap_or(0);
        Ok(Self {
            // The plan checked that this product fits (`Shape::check_sizes`).
            dq: zeros_f32("dQ", s.batch * s.h_q * rows * s.d_k)?,
            dq_part: zero_mat("ring scratch", longest, s.d_k)?,
            dk_part: zero_mat("ring scratch", KEY_CHUNK, s.d_k)?,
            dv_part: zero_mat("ring scratch", KEY_CHUNK, s.d_v)?,
        })
    }
}

/// Folds one K/V block into this rank's dQ and adds this rank's share of the block's dK
/// and dV into `grads` (dK then dV, laid out as the block); returns the calls made.
#[allow(clippy::too_many_arguments)]
pub(crate) fn fold_backward<T: Element>(
    plan: &Plan,
    rank: usize,
    x: BackwardInputs<'_, T>,
    acc: &mut BackwardAcc,
    block: &KvBlock<'_, T>,
    grads: &mut [f32],
    exec: &Exec<'_>,
    poll: &mut dyn FnMut(),
) -> attn_core::Result<usize> {
    let s = plan.shape;
    let rows = plan.rows[rank];
    let (dk_len, _) = s.kv_len(block.rows);
    let (dk_all, dv_all) = grads.split_at_mut(dk_len);
    let mut calls = 0;
    for kseg in block.segments {
        for b in 0..s.batch {
            for h in 0..s.h_q {
                let kv = h / s.group();
                let (kh, vh) = block.head(&s, b, kv);
                let (qh, doh, oh) = (x.q.head(b, h)?, x.grad_out.head(b, h)?, x.out.head(b, h)?);
                let head = b * s.h_q + h;
                let kv_head = b * s.h_kv + kv;
                let mut c0 = 0;
                while c0 < kseg.len() {
                    let nk = KEY_CHUNK.min(kseg.len() - c0);
                    let g = kseg.global.start + c0;
                    let keys = g..g + nk;
                    for qseg in &plan.segments[rank] {
                        // The queries that see some of these keys, and the mask among them.
                        let (skip, opts) = match sight(plan.causal, &qseg.global, &keys) {
                            Sight::Hidden => continue,
                            Sight::Full => (0, options(plan.scale, None)),
                            Sight::Diagonal { .. } => {
                                if keys.start < qseg.global.start || keys.end > qseg.global.end {
                                    return Err(internal("a key chunk straddles a query run"));
                                }
                                // Queries before the chunk see none of it; the rest start
                                // with the chunk's first key: top-left.
                                let skip = keys.start - qseg.global.start;
                                (skip, options(plan.scale, Some(Causal::TopLeft)))
                            }
                        };
                        let nq = qseg.len() - skip;
                        let r0 = qseg.local + skip;
                        let lse = &x.lse[head * rows + r0..head * rows + r0 + nq];
                        let (dq, dk, dv) = (
                            acc.dq_part.as_mut().subrows_mut(0, nq),
                            acc.dk_part.as_mut().subrows_mut(0, nk),
                            acc.dv_part.as_mut().subrows_mut(0, nk),
                        );
                        let (doc, qc, oc) =
                            (doh.subrows(r0, nq), qh.subrows(r0, nq), oh.subrows(r0, nq));
                        let (kc, vc) = (
                            kh.subrows(kseg.local + c0, nk),
                            vh.subrows(kseg.local + c0, nk),
                        );
                        exec.run(|| {
                            Attention::head(qc, kc, vc, &opts).and_then(|call| {
                                call.backward_into(
                                    ForwardRef::head(oc, lse),
                                    doc,
                                    GradientsMut { dq, dk, dv },
                                    Par::rayon(0),
                                )
                            })
                        })?;
                        let dq_rows = &mut acc.dq[(head * rows + r0) * s.d_k..];
                        add_rows(dq_rows, acc.dq_part.as_ref().subrows(0, nq));
                        let k0 = (kv_head * block.rows + kseg.local + c0) * s.d_k;
                        add_rows(&mut dk_all[k0..], acc.dk_part.as_ref().subrows(0, nk));
                        let v0 = (kv_head * block.rows + kseg.local + c0) * s.d_v;
                        add_rows(&mut dv_all[v0..], acc.dv_part.as_ref().subrows(0, nk));
                        calls += 1;
                        poll();
                    }
                    c0 += nk;
                }
            }
        }
    }
    Ok(calls)
}

/// `dst[i·d + c] += m[(i, c)]` (row-major destination).
fn add_rows(dst: &mut [f32], m: MatRef<'_, f32>) {
    let d = m.ncols();
    for (i, row) in dst.chunks_exact_mut(d.max(1)).take(m.nrows()).enumerate() {
        for (c, x) in row.iter_mut().enumerate().take(d) {
            *x += m[(i, c)];
        }
    }
}

/// The gradients a block's owner ends with: `incoming` (the sum of the ranks before this
/// one) plus this rank's share, in that order; the first rank's share as it is.
pub(crate) fn combine(incoming: Option<&[f32]>, own: &mut [f32]) {
    if let Some(inc) = incoming {
        for (o, i) in own.iter_mut().zip(inc) {
            *o += *i; // IEEE addition commutes: the same bits as incoming + own
        }
    }
}

/// Rounds a `[batch][heads][rows][d]` f32 buffer to a `T` tensor in the `[B,H,S,D]` layout.
pub(crate) fn to_tensor<T: Element + Default>(
    data: &[f32],
    dims: [usize; 4],
) -> attn_core::Result<Tensor4<T>> {
    let mut v = Vec::new();
    v.try_reserve_exact(data.len())
        .map_err(|_| Error::allocation_of::<T>("gradient", Some(data.len())))?;
    v.extend(data.iter().map(|&x| T::from_f32(x)));
    Tensor4::from_vec(v, dims)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sight_of_runs_under_the_causal_mask() {
        assert_eq!(sight(false, &(0..4), &(10..20)), Sight::Full);
        assert_eq!(sight(true, &(0..4), &(10..20)), Sight::Hidden);
        assert_eq!(sight(true, &(10..20), &(0..10)), Sight::Full);
        assert_eq!(sight(true, &(10..20), &(0..11)), Sight::Full); // key 10 ≤ query 10
        assert_eq!(
            sight(true, &(10..20), &(10..20)),
            Sight::Diagonal { keys: 10 }
        );
        assert_eq!(
            sight(true, &(12..14), &(10..20)),
            Sight::Diagonal { keys: 4 }
        );
        assert_eq!(sight(true, &(3..3), &(0..2)), Sight::Hidden);
    }

    #[test]
    fn query_chunks_follow_the_shape() {
        assert_eq!(query_chunk(0), 512);
        assert_eq!(query_chunk(1300), 512);
        assert_eq!(query_chunk(16 * 1000), 1024);
        assert_eq!(query_chunk(32768), 2048);
        assert_eq!(query_chunk(1 << 20), 2048);
    }

    #[test]
    fn combine_adds_in_ring_order() {
        let mut own = vec![1.0, -0.0];
        combine(None, &mut own);
        assert_eq!(own[1].to_bits(), (-0.0f32).to_bits()); // the first share untouched
        combine(Some(&[2.0, 0.0]), &mut own);
        assert_eq!(own, [3.0, 0.0]);
    }
}

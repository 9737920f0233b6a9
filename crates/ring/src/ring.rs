//! The ring over MPI: [`Ring`], its forward and backward passes, and the messages.

use std::panic::AssertUnwindSafe;
use std::time::Instant;

use attn_core::Tensor4Ref;
use mpi::Rank;
use mpi::collective::SystemOperation;
use mpi::request::{LocalScope, Request};
use mpi::topology::SimpleCommunicator;
use mpi::traits::*;
use rayon::ThreadPool;

use crate::block::{
    BackwardAcc, BackwardInputs, Exec, ForwardAcc, KvBlock, combine, fold_backward, fold_forward,
    pack_kv, zeros_f32,
};
use crate::exchange::{DESC_LEN, Desc, Pass, Plan, agree, check_forward, describe};
use crate::fault::{Point, strike};
use crate::{RingBackward, RingElement, RingError, RingForward, RingOptions, RingStats};

/// The largest piece of a block sent as one message (MPI counts are `int`).
const PIECE: usize = 1 << 30;
/// Message tags: K/V blocks, and the dK/dV that travel with them.
const TAG_KV: i32 = 1;
const TAG_GRAD: i32 = 2;

/// A ring of the ranks of a communicator, with this rank's thread pool.
///
/// Built once (collectively: every rank of the communicator calls [`Ring::new`]) and used
/// for any number of passes; every pass is collective too. Rank `r` sends to `r + 1` and
/// receives from `r − 1` (mod P). Only the thread that calls the passes talks to MPI, so
/// MPI's [`Threading::Funneled`](mpi::Threading::Funneled) is enough ([`crate::initialize`]).
pub struct Ring {
    comm: SimpleCommunicator,
    rank: usize,
    size: usize,
    pool: ThreadPool,
}

impl Ring {
    /// A ring over `comm` (duplicated, so its messages never meet the caller's). Each rank
    /// gets a rayon pool of the machine's cores divided by the ranks on its node (found
    /// with `MPI_Comm_split_type(SHARED)`), at least one thread.
    pub fn new<C: Communicator>(comm: &C) -> Result<Self, RingError> {
        let node = comm.split_shared(comm.rank());
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        let threads = (cores / node.size().max(1) as usize).max(1);
        Self::with_threads(comm, threads)
    }

    /// A ring over `comm` whose rank computes on `threads` threads.
    pub fn with_threads<C: Communicator>(comm: &C, threads: usize) -> Result<Self, RingError> {
        let comm = comm.duplicate();
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads.max(1))
            .thread_name(|i| format!("attn-ring-{i}"))
            .build()
            .map_err(|e| RingError::Pool(e.to_string()))?;
        Ok(Self {
            rank: comm.rank() as usize,
            size: comm.size() as usize,
            comm,
            pool,
        })
    }

    /// This rank's index in the ring.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// The number of ranks, P.
    pub fn size(&self) -> usize {
        self.size
    }

    /// The threads this rank computes on.
    pub fn threads(&self) -> usize {
        self.pool.current_num_threads()
    }

    /// Every rank's descriptor, exchanged, and the plan they agree on.
    fn agree(
        &self,
        local: attn_core::Result<Desc>,
        options: &RingOptions,
    ) -> Result<Plan, RingError> {
        let (desc, own) = match local {
            Ok(d) => (d, None),
            Err(e) => ([0; DESC_LEN], Some(e)),
        };
        let mut all = vec![0u64; DESC_LEN * self.size];
        self.comm.all_gather_into(&desc[..], &mut all[..]);
        let all: Vec<Desc> = all
            .chunks_exact(DESC_LEN)
            .map(|c| c.try_into().unwrap_or([0; DESC_LEN]))
            .collect();
        agree(&all, self.rank, own, options)
    }

    /// Whether every rank can go on: a cheap collective (one `MPI_Allreduce` of a word)
    /// at the points where a rank may have failed alone — after allocating, before a step
    /// whose block it must receive, after computing. A rank that failed returns its own
    /// error; every other rank returns [`RingError::Failed`] naming the first rank that
    /// failed, instead of waiting for blocks that rank will never send.
    fn together<R>(&self, local: attn_core::Result<R>) -> Result<R, RingError> {
        let mine = match &local {
            Ok(_) => u64::MAX,
            Err(_) => self.rank as u64,
        };
        let mut first = u64::MAX;
        self.comm
            .all_reduce_into(&mine, &mut first, SystemOperation::min());
        match local {
            Err(e) => Err(RingError::Input(e)),
            Ok(_) if first != u64::MAX => Err(RingError::Failed {
                rank: first as usize,
            }),
            Ok(x) => Ok(x),
        }
    }

    /// The ring forward pass: this rank's rows of `softmax(scale·QKᵀ + M) V` over the whole
    /// sequence, and their LSE.
    ///
    /// `q : [batch, h_q, rows, d_k]`, `k : [batch, h_kv, rows, d_k]` and
    /// `v : [batch, h_kv, rows, d_v]` are this rank's shards (any strides; the same positions
    /// of Q, K and V, laid out as `options.split` says). Every rank must call it with the
    /// same batch, heads, widths, element type and options; a disagreement, or a shard that
    /// another rank rejects, is an error on every rank (checked in one allgather before any
    /// block moves). P steps: at step `s` the rank folds the block of rank `r − s` into its
    /// queries' partial states while that block goes on to `r + 1` and the next arrives
    /// from `r − 1`; fully hidden (query, key) runs are skipped.
    ///
    /// # Errors
    ///
    /// Every failure is an error on every rank. Input errors (shapes, options, split
    /// counts, sizes that do not fit, on any rank) are found before any block moves and
    /// returned by every rank. A failure on one rank after that (a buffer the allocator
    /// refuses, a computation that fails) is its own error there and
    /// [`RingError::Failed`] on every other rank: the ranks agree at each step, before any
    /// block of that step moves, whether every rank can go on.
    pub fn forward<T: RingElement>(
        &self,
        q: Tensor4Ref<'_, T>,
        k: Tensor4Ref<'_, T>,
        v: Tensor4Ref<'_, T>,
        options: &RingOptions,
    ) -> Result<RingForward<T>, RingError> {
        let start = Instant::now();
        let local = check_forward(q, k, v, options);
        let desc = local.map(|l| describe::<T>(Some(l), Pass::Forward, options));
        let plan = self.agree(desc, options)?;
        let (p, r) = (self.size, self.rank);
        let s = plan.shape;
        let mut stats = RingStats::new(p, self.threads());
        let mut cur = Vec::new();
        let mut next: Vec<T> = Vec::new();
        let set_up = ForwardAcc::new(&plan, r).and_then(|acc| {
            pack_kv(&s, k, v, plan.rows[r], &mut cur)?;
            strike(r, false, 0, Point::SetUp)?;
            Ok(acc)
        });
        let mut acc = self.together(set_up)?;
        let exec = Exec {
            pool: Some(&self.pool),
        };
        let (to, from) = (((r + 1) % p) as Rank, ((r + p - 1) % p) as Rank);
        // A failure of a step's computation, reported when the ranks next agree.
        let mut failed = None;
        for step in 0..p {
            let owner = (r + p - step) % p;
            let incoming = (r + 2 * p - step - 1) % p;
            let more = step + 1 < p;
            let ready = match failed.take() {
                Some(e) => Err(e),
                None if more => {
                    let (kl, vl) = s.kv_len(plan.rows[incoming]);
                    resize(&mut next, kl + vl).and_then(|()| strike(r, false, step, Point::Grow))
                }
                None => Ok(()),
            };
            self.together(ready)?;
            let block = KvBlock {
                data: &cur,
                rows: plan.rows[owner],
                segments: &plan.segments[owner],
            };
            let t0 = Instant::now();
            let result = mpi::request::scope(|scope| {
                let mut pending = Pending::default();
                if more {
                    let (out, into) = (
                        bytemuck::cast_slice(&cur[..]),
                        bytemuck::cast_slice_mut(&mut next[..]),
                    );
                    pending.pass_on(
                        &self.comm,
                        scope,
                        (to, from),
                        (out, into),
                        &mut stats.bytes_sent,
                    );
                }
                let calls = guarded(|| {
                    fold_forward(&plan, q, &mut acc, &block, &exec, &mut || pending.poll())
                });
                let t1 = Instant::now();
                // Completed whatever the computation did: no request outlives the scope.
                pending.wait();
                (calls, t1)
            });
            let (calls, t1) = result;
            stats.compute += t1 - t0;
            stats.wait += t1.elapsed();
            match calls.and_then(|c| strike(r, false, step, Point::Compute).map(|()| c)) {
                Ok(calls) => {
                    stats.calls += calls;
                    stats.steps_computed += usize::from(calls > 0);
                }
                Err(e) => failed = Some(e),
            }
            std::mem::swap(&mut cur, &mut next);
        }
        let finished = match failed {
            Some(e) => Err(e),
            None => acc
                .finish::<T>(&s, plan.rows[r])
                .and_then(|x| strike(r, false, p, Point::Finish).map(|()| x)),
        };
        let (out, lse) = self.together(finished)?;
        stats.total = start.elapsed();
        Ok(RingForward { out, lse, stats })
    }

    /// The ring backward pass: this rank's dQ, dK and dV, given its shards of the upstream
    /// gradient `grad_out` (dO) and of the forward's `out`, and `lse`, as
    /// [`Ring::forward`] returned them for the same shards and options.
    ///
    /// dQ stays on the rank; K and V travel around the ring again, and the dK and dV of each
    /// block travel with it, each rank adding its share: a block's gradients are the sum
    /// of the ranks' shares in ring order starting at its owner, which they reach after the
    /// last step. Accumulation is in f32, rounded to `T` once.
    ///
    /// # Errors
    ///
    /// As [`Ring::forward`]'s: every failure, on any rank, is an error on every rank.
    #[allow(clippy::too_many_arguments)]
    pub fn backward<T: RingElement>(
        &self,
        grad_out: Tensor4Ref<'_, T>,
        q: Tensor4Ref<'_, T>,
        k: Tensor4Ref<'_, T>,
        v: Tensor4Ref<'_, T>,
        out: Tensor4Ref<'_, T>,
        lse: &[f32],
        options: &RingOptions,
    ) -> Result<RingBackward<T>, RingError> {
        let start = Instant::now();
        let local = crate::check_backward(grad_out, q, k, v, out, lse, options);
        let desc = local.map(|l| describe::<T>(Some(l), Pass::Backward, options));
        let plan = self.agree(desc, options)?;
        let (p, r) = (self.size, self.rank);
        let s = plan.shape;
        let mut stats = RingStats::new(p, self.threads());
        let x = BackwardInputs {
            grad_out,
            q,
            out,
            lse,
        };
        let grad_len = |rank: usize| {
            let (a, b) = s.kv_len(plan.rows[rank]);
            a + b
        };
        let mut cur = Vec::new();
        let mut next: Vec<T> = Vec::new();
        // This rank's own block's gradients, received after the last step.
        let mut own = Vec::new();
        let set_up = BackwardAcc::new(&plan, r).and_then(|acc| {
            pack_kv(&s, k, v, plan.rows[r], &mut cur)?;
            if p > 1 {
                resize(&mut own, grad_len(r))?;
            }
            strike(r, true, 0, Point::SetUp)?;
            Ok(acc)
        });
        let mut acc = self.together(set_up)?;
        // This step's share, the sum arriving for this step's block, the sum leaving.
        let (mut arriving, mut leaving): (Vec<f32>, Vec<f32>) = (Vec::new(), Vec::new());
        let exec = Exec {
            pool: Some(&self.pool),
        };
        let (to, from) = (((r + 1) % p) as Rank, ((r + p - 1) % p) as Rank);
        let mut failed = None;
        for step in 0..p {
            let owner = (r + p - step) % p;
            let incoming = (r + 2 * p - step - 1) % p;
            let more = step + 1 < p;
            let mut share = Vec::new();
            let ready = match failed.take() {
                Some(e) => Err(e),
                None => (|| {
                    if more {
                        resize(&mut next, grad_len(incoming))?;
                        strike(r, true, step, Point::Grow)?;
                    }
                    share = zeros_f32("dK/dV share", grad_len(owner))?;
                    if step > 0 {
                        resize(&mut arriving, grad_len(owner))?;
                    }
                    Ok(())
                })(),
            };
            self.together(ready)?;
            let block = KvBlock {
                data: &cur,
                rows: plan.rows[owner],
                segments: &plan.segments[owner],
            };
            let t0 = Instant::now();
            let (calls, t1) = mpi::request::scope(|scope| {
                let mut pending = Pending::default();
                if more {
                    let (out, into) = (
                        bytemuck::cast_slice(&cur[..]),
                        bytemuck::cast_slice_mut(&mut next[..]),
                    );
                    pending.pass_on(
                        &self.comm,
                        scope,
                        (to, from),
                        (out, into),
                        &mut stats.bytes_sent,
                    );
                }
                if step > 0 {
                    // The previous block's sum goes on while this block is computed.
                    let out: &[u8] = bytemuck::cast_slice(&leaving[..]);
                    stats.bytes_sent += out.len() as u64;
                    pending.send(&self.comm, scope, to, TAG_GRAD, out);
                    pending.receive(
                        &self.comm,
                        scope,
                        from,
                        TAG_GRAD,
                        bytemuck::cast_slice_mut(&mut arriving[..]),
                    );
                }
                let calls = guarded(|| {
                    fold_backward(
                        &plan,
                        r,
                        x,
                        &mut acc,
                        &block,
                        &mut share,
                        &exec,
                        &mut || pending.poll(),
                    )
                });
                let t1 = Instant::now();
                pending.wait();
                (calls, t1)
            });
            stats.compute += t1 - t0;
            stats.wait += t1.elapsed();
            match calls.and_then(|c| strike(r, true, step, Point::Compute).map(|()| c)) {
                Ok(calls) => {
                    stats.calls += calls;
                    stats.steps_computed += usize::from(calls > 0);
                }
                Err(e) => failed = Some(e),
            }
            combine((step > 0).then_some(&arriving[..]), &mut share);
            std::mem::swap(&mut leaving, &mut share);
            std::mem::swap(&mut cur, &mut next);
        }
        // Every rank computed every step, or none sends the last sums.
        self.together(failed.map_or(Ok(()), Err))?;
        // The last block's sum goes to its owner, the next rank; ours comes from the last.
        if p > 1 {
            let t1 = Instant::now();
            mpi::request::scope(|scope| {
                let mut pending = Pending::default();
                let out: &[u8] = bytemuck::cast_slice(&leaving[..]);
                stats.bytes_sent += out.len() as u64;
                pending.send(&self.comm, scope, to, TAG_GRAD, out);
                pending.receive(
                    &self.comm,
                    scope,
                    from,
                    TAG_GRAD,
                    bytemuck::cast_slice_mut(&mut own[..]),
                );
                pending.wait();
            });
            stats.wait += t1.elapsed();
        } else {
            own = leaving;
        }
        let finished = crate::finish_backward::<T>(&plan, r, &acc, &own)
            .and_then(|x| strike(r, true, p, Point::Finish).map(|()| x));
        let result = self.together(finished)?;
        stats.total = start.elapsed();
        Ok(RingBackward { stats, ..result })
    }
}

/// Runs a step's computation, a panic caught as an error: inside a request scope a panic
/// would drop the outstanding requests, and rsmpi aborts the whole job then. Caught, the
/// rank completes its transfers and the others learn of the failure at the next agreement.
/// The library does not panic on input; this guards against its own bugs.
fn guarded<R>(f: impl FnOnce() -> attn_core::Result<R>) -> attn_core::Result<R> {
    std::panic::catch_unwind(AssertUnwindSafe(f)).unwrap_or_else(|_| {
        Err(attn_core::Error::unsupported(
            "ring step",
            "the engine panicked (a bug: its message was printed above)",
        ))
    })
}

/// Resizes a buffer, allocation failure as an error.
fn resize<T: Copy + Default>(buf: &mut Vec<T>, len: usize) -> attn_core::Result<()> {
    if len > buf.len() {
        buf.try_reserve_exact(len - buf.len())
            .map_err(|_| attn_core::Error::allocation_of::<T>("ring buffer", Some(len)))?;
    }
    buf.resize(len, T::default());
    Ok(())
}

/// The outstanding requests of a step.
#[derive(Default)]
struct Pending<'a, 's> {
    requests: Vec<Option<Request<'a, [u8], &'s LocalScope<'a>>>>,
}

impl<'a, 's> Pending<'a, 's> {
    fn send(
        &mut self,
        comm: &SimpleCommunicator,
        scope: &'s LocalScope<'a>,
        to: Rank,
        tag: i32,
        bytes: &'a [u8],
    ) {
        for piece in bytes.chunks(PIECE) {
            let req = comm
                .process_at_rank(to)
                .immediate_send_with_tag(scope, piece, tag);
            self.requests.push(Some(req));
        }
    }

    fn receive(
        &mut self,
        comm: &SimpleCommunicator,
        scope: &'s LocalScope<'a>,
        from: Rank,
        tag: i32,
        bytes: &'a mut [u8],
    ) {
        for piece in bytes.chunks_mut(PIECE) {
            let req = comm
                .process_at_rank(from)
                .immediate_receive_into_with_tag(scope, piece, tag);
            self.requests.push(Some(req));
        }
    }

    /// One hop of a K/V block around the ring: the send of `out` to `to` and the receive
    /// of the next block into `into` from `from`, counting the bytes sent.
    fn pass_on(
        &mut self,
        comm: &SimpleCommunicator,
        scope: &'s LocalScope<'a>,
        (to, from): (Rank, Rank),
        (out, into): (&'a [u8], &'a mut [u8]),
        bytes_sent: &mut u64,
    ) {
        *bytes_sent += out.len() as u64;
        self.send(comm, scope, to, TAG_KV, out);
        self.receive(comm, scope, from, TAG_KV, into);
    }

    /// Tests every outstanding request: this is where OpenMPI moves a large message.
    fn poll(&mut self) {
        for slot in &mut self.requests {
            if let Some(req) = slot.take() {
                *slot = req.test().err();
            }
        }
    }

    fn wait(&mut self) {
        for slot in &mut self.requests {
            if let Some(req) = slot.take() {
                req.wait_without_status();
            }
        }
    }
}

//! Ring attention over MPI: a sequence too long for one machine, split along its positions
//! across the ranks of an MPI communicator, with a result equal to one-process attention.
//!
//! # The ring
//!
//! Each of the P ranks holds a shard of Q, K and V — the same positions of all three,
//! `[batch, heads, rows, dim]` — and keeps a partial softmax state (normalised output and
//! LSE, [`attn_core::PartialState`]) for each of its query rows. At step `s = 0 .. P−1`
//! rank `r` holds the K/V block of rank `r − s` (its own at step 0), folds it into its
//! states with the streaming engine ([`attn_optimized::Attention::forward_into`] per head and chunk
//! of 512–2048 query rows, f32 output and LSE, merged with
//! [`PartialState::merge_in_place`](attn_core::PartialState::merge_in_place)),
//! and meanwhile sends that block on to rank `r + 1` and receives the next from `r − 1`.
//! After P steps each rank has its rows of the full attention. The partial states are
//! merged in a fixed order (step, then key run, head and query chunk), and the engine's
//! calls are fixed by the shapes: the output bits do not depend on timing or thread counts,
//! and are those of [`simulate_forward`], the same ring run in one process.
//!
//! # Overlap
//!
//! The block of step `s + 1` is posted (`MPI_Isend` / `MPI_Irecv`, in pieces of at most
//! 1 GiB) before step `s` computes. OpenMPI moves a large message only inside MPI calls, so
//! between two engine calls the rank tests its outstanding requests (`MPI_Test`): the
//! transfer progresses every few milliseconds of compute. The rank then waits for what is
//! left; that wait is [`RingStats::wait`], the part of the communication not hidden.
//! The engine's calls run on the ring's own rayon pool; the calling thread waits for each
//! and alone talks to MPI, so MPI's `FUNNELED` thread level is enough.
//!
//! # Causal attention and the zigzag
//!
//! With [`RingOptions::causal`] (query `i` sees keys `j ≤ i`, global positions), a run of
//! keys entirely after a run of queries is skipped, a run entirely before is computed
//! without a mask, and only a shard's own diagonal is masked. With the contiguous split
//! rank `P − 1` would do `2P − 1` times rank 0's work; with [`Split::Zigzag`] the sequence
//! is cut into `2P` chunks and rank `r` holds chunks `r` and `2P − 1 − r`, so every rank does
//! the same work. **Callers pass their zigzag rows**: the shard is the two chunks
//! [`zigzag_rows`] names, concatenated (the ring does not re-shard); [`shard`] gathers them
//! from a whole tensor, and the output comes back in the same rows.
//!
//! # Backward
//!
//! [`Ring::backward`] takes the global LSE and O (what [`Ring::forward`] returned), so a
//! block's contribution is computed per step ([`attn_optimized::Attention::backward_into`],
//! f32 gradients, per head and chunk of 1024 keys). dQ stays on its rank; K and V go
//! around the ring again and each block's dK and dV travel with it, one step behind,
//! every rank adding its share; after the last step they reach the block's owner.
//!
//! # Failures
//!
//! A pass that fails on one rank fails on every rank, with an error, never a hang.
//! Shapes, options, split counts and the sizes of every buffer any rank will hold (checked
//! products: heads broadcast to 2^62 by a zero stride are an error) are agreed in one
//! allgather before any block moves. After that a rank may still fail alone (an allocation
//! its allocator refuses, a failed or panicking engine call, whose transfers it completes
//! first): at the set-up, before each step's blocks move and after the last step the ranks
//! agree, with one `MPI_Allreduce` of a word, whether every rank can go on — the failed rank
//! returns its own error and the others [`RingError::Failed`] naming it, and the
//! communicator has no message left in flight. The test-only `fault-injection` feature
//! plants such failures (`tests/ring_faults.rs`).
//!
//! # Set-up
//!
//! The crate links the system MPI through `mpi` (rsmpi): on Debian,
//! `apt-get install libopenmpi-dev openmpi-bin libclang-dev` (`cargo xtask test` does it
//! when they are missing). Run with `mpirun -np P program` (add `--oversubscribe` for more
//! ranks than cores, `--allow-run-as-root` as root); a program started without `mpirun`
//! is a ring of one rank. Each rank computes on the machine's cores divided by the ranks on
//! its node ([`Ring::new`]).
//!
//! ```
//! use attn_core::{Layout, Tensor4Ref};
//! use attn_ring::{Ring, RingOptions, Split, shard, zigzag_rows};
//!
//! let universe = attn_ring::initialize()?; // FUNNELED; started without mpirun: one rank
//! let ring = Ring::new(&universe.world())?;
//! let (n, d) = (300, 16);
//! let x: Vec<f32> = (0..n * d).map(|i| ((i * 7) % 13) as f32 / 13.0).collect();
//! let x = Tensor4Ref::from_layout(&x, [1, 1, n, d], Layout::Bhsd)?;
//! // This rank's rows of the zigzag split, causal.
//! let mine = shard(x, &zigzag_rows(n, ring.size(), ring.rank()))?;
//! let opts = RingOptions::default().with_causal(true).with_split(Split::Zigzag);
//! let f = ring.forward(mine.as_ref(), mine.as_ref(), mine.as_ref(), &opts)?;
//! assert_eq!(f.out.dims(), [1, 1, mine.dims()[2], d]);
//! // The same ring simulated in one process, over every rank's shard: the same bits.
//! let shards = (0..ring.size())
//!     .map(|r| shard(x, &zigzag_rows(n, ring.size(), r)))
//!     .collect::<Result<Vec<_>, _>>()?;
//! let views: Vec<_> = shards.iter().map(|s| s.as_ref()).collect();
//! let sim = attn_ring::simulate_forward(&views, &views, &views, &opts)?;
//! assert_eq!(sim[ring.rank()].out.as_slice(), f.out.as_slice());
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

#![forbid(unsafe_code)]

mod block;
mod exchange;
mod fault;
mod ring;
mod split;

use std::time::Duration;

use attn_core::{Causal, Options, Tensor4, Tensor4Ref};
use attn_optimized::Element;

use block::{
    BackwardAcc, BackwardInputs, Exec, ForwardAcc, KvBlock, combine, fold_backward, fold_forward,
    pack_kv, to_tensor, zeros_f32,
};
use exchange::{Desc, Pass, Plan, Shape, agree, check_forward, describe};

/// Failures planted by tests (the test-only `fault-injection` feature): a chosen rank fails
/// at a chosen point of a chosen step of a pass.
#[cfg(feature = "fault-injection")]
pub mod faults {
    pub use crate::fault::{Fault, FaultPass, FaultPoint, plant};
}
pub use mpi;
pub use ring::Ring;
pub use split::{Split, contiguous_rows, shard, zigzag_chunk, zigzag_rows};

/// The storage types a ring moves: f32, f16 and bf16 (plain bits, sent as bytes).
pub trait RingElement: Element + bytemuck::Pod + Default {}

impl<T: Element + bytemuck::Pod + Default> RingElement for T {}

/// The options of a ring pass: the same on every rank.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct RingOptions {
    /// Multiplies `Q Kᵀ`; `None` means `1/√d_k`.
    pub scale: Option<f32>,
    /// Query `i` sees keys `j ≤ i` (global positions; top-left and bottom-right agree, as
    /// the sequence attends to itself).
    pub causal: bool,
    /// Which positions each rank's shard holds.
    pub split: Split,
}

impl RingOptions {
    /// Sets the score scale.
    pub fn with_scale(mut self, scale: f32) -> Self {
        self.scale = Some(scale);
        self
    }

    /// Sets the causal mask.
    pub fn with_causal(mut self, causal: bool) -> Self {
        self.causal = causal;
        self
    }

    /// Sets the split.
    pub fn with_split(mut self, split: Split) -> Self {
        self.split = split;
        self
    }

    /// The equivalent options of one-process attention over the whole sequence.
    pub fn options(&self) -> Options<'static> {
        let mut o = Options::default();
        if let Some(s) = self.scale {
            o = o.with_scale(s);
        }
        if self.causal {
            o = o.with_causal(Causal::TopLeft);
        }
        o
    }
}

/// Why a ring pass failed. A pass that fails on one rank fails on every rank: every
/// variant but [`RingError::Input`], [`RingError::Peer`], [`RingError::Failed`] and
/// [`RingError::Pool`] is reported identically by every rank; the rank whose inputs or
/// computation failed reports [`RingError::Input`] and the others name it
/// ([`RingError::Peer`] before any block moved, [`RingError::Failed`] after).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RingError {
    /// This rank's inputs were rejected (or a computation or an allocation on them failed).
    #[error(transparent)]
    Input(#[from] attn_core::Error),
    /// Another rank's inputs were rejected: its own error says why.
    #[error("rank {rank} rejected its inputs (its error says why)")]
    Peer {
        /// The first rank that rejected its inputs.
        rank: usize,
    },
    /// Another rank failed once the ring was turning (a buffer its allocator refused, a
    /// computation that failed): every rank stopped at the same step, none waits for it.
    #[error("rank {rank} failed during the ring pass (its error says why); every rank stopped")]
    Failed {
        /// The first rank that failed.
        rank: usize,
    },
    /// Ranks disagree on a shape or an option.
    #[error(
        "rank {rank} has {what} {found} but rank 0 has {expected} (every rank must pass the same shapes and options)"
    )]
    Mismatch {
        /// The first rank that disagrees with rank 0.
        rank: usize,
        /// The field (`d_k`, `query heads`, `element type`, …).
        what: &'static str,
        /// Its value there (the element type as 1 = f32, 2 = f16, 3 = bf16).
        found: u64,
        /// Rank 0's value.
        expected: u64,
    },
    /// A shard's row count is not the one the split gives its rank.
    #[error(
        "rank {rank} holds {rows} rows but the zigzag split of {n} positions over {ranks} ranks gives it {expected}"
    )]
    Split {
        /// The rank.
        rank: usize,
        /// Its rows.
        rows: usize,
        /// The rows [`zigzag_rows`] gives it.
        expected: usize,
        /// The sequence length (the sum of every rank's rows).
        n: usize,
        /// The number of ranks.
        ranks: usize,
    },
    /// MPI is already initialised, or provides a thread level below `FUNNELED`.
    #[error("MPI set-up: {0}")]
    Mpi(String),
    /// This rank's thread pool could not be built.
    #[error("cannot build the ring's thread pool: {0}")]
    Pool(String),
}

/// Initialises MPI at the `FUNNELED` thread level (only the thread that calls MPI — this
/// one — talks to it; the ring's pool threads only compute). MPI is finalised when the
/// returned universe is dropped, and can be initialised only once per process.
pub fn initialize() -> Result<mpi::environment::Universe, RingError> {
    let (universe, level) = mpi::initialize_with_threading(mpi::Threading::Funneled)
        .ok_or_else(|| RingError::Mpi("MPI is already initialised in this process".into()))?;
    if level < mpi::Threading::Funneled {
        return Err(RingError::Mpi(format!(
            "the MPI library provides thread level {level:?}, the ring needs Funneled"
        )));
    }
    Ok(universe)
}

/// What a rank did during a pass.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RingStats {
    /// Ranks in the ring.
    pub ranks: usize,
    /// Threads this rank computed on.
    pub threads: usize,
    /// Steps in which this rank computed something (fully hidden blocks are skipped).
    pub steps_computed: usize,
    /// Calls of the streaming engine.
    pub calls: usize,
    /// Bytes this rank sent.
    pub bytes_sent: u64,
    /// Time computing (with the polls between calls).
    pub compute: Duration,
    /// Time waiting for the ring after computing: communication not hidden.
    pub wait: Duration,
    /// The whole pass, the shape exchange and the final rounding included.
    pub total: Duration,
}

impl RingStats {
    fn new(ranks: usize, threads: usize) -> Self {
        Self {
            ranks,
            threads,
            ..Self::default()
        }
    }
}

/// A rank's result of [`Ring::forward`].
#[derive(Debug, Clone)]
pub struct RingForward<T> {
    /// This rank's rows of the output, `[batch, h_q, rows, d_v]` in the `[B,H,S,D]` layout.
    pub out: Tensor4<T>,
    /// Their natural-log LSE, `[batch][h_q][rows]`.
    pub lse: Vec<f32>,
    /// What the pass did.
    pub stats: RingStats,
}

/// A rank's result of [`Ring::backward`]: the gradients of its shards, each shaped like its
/// operand, in the `[B,H,S,D]` layout.
#[derive(Debug, Clone)]
pub struct RingBackward<T> {
    /// `[batch, h_q, rows, d_k]`.
    pub dq: Tensor4<T>,
    /// `[batch, h_kv, rows, d_k]` (summed over each group of query heads).
    pub dk: Tensor4<T>,
    /// `[batch, h_kv, rows, d_v]`.
    pub dv: Tensor4<T>,
    /// What the pass did.
    pub stats: RingStats,
}

/// The local checks of a backward call.
pub(crate) fn check_backward<T>(
    grad_out: Tensor4Ref<'_, T>,
    q: Tensor4Ref<'_, T>,
    k: Tensor4Ref<'_, T>,
    v: Tensor4Ref<'_, T>,
    out: Tensor4Ref<'_, T>,
    lse: &[f32],
    options: &RingOptions,
) -> attn_core::Result<(Shape, usize)> {
    let local = check_forward(q, k, v, options)?;
    attn_core::validate_batch_backward(q, k, v, grad_out, out, lse.len(), &options.options())?;
    Ok(local)
}

/// A rank's gradients from its dQ and its own block's final dK, dV.
pub(crate) fn finish_backward<T: RingElement>(
    plan: &Plan,
    rank: usize,
    acc: &BackwardAcc,
    own: &[f32],
) -> attn_core::Result<RingBackward<T>> {
    let s = plan.shape;
    let rows = plan.rows[rank];
    let (dk_len, _) = s.kv_len(rows);
    Ok(RingBackward {
        dq: to_tensor(&acc.dq, [s.batch, s.h_q, rows, s.d_k])?,
        dk: to_tensor(&own[..dk_len], [s.batch, s.h_kv, rows, s.d_k])?,
        dv: to_tensor(&own[dk_len..], [s.batch, s.h_kv, rows, s.d_v])?,
        stats: RingStats::default(),
    })
}

/// The plan of an in-process ring, checked as the ring checks it.
fn simulated_plan<T: Element>(
    locals: Vec<attn_core::Result<(Shape, usize)>>,
    pass: Pass,
    options: &RingOptions,
) -> Result<Plan, RingError> {
    let mut descs: Vec<Desc> = vec![];
    let mut first_err = None;
    for l in locals {
        match l {
            Ok(l) => descs.push(describe::<T>(Some(l), pass, options)),
            Err(e) => {
                descs.push(describe::<T>(None, pass, options));
                first_err.get_or_insert(e);
            }
        }
    }
    if descs.is_empty() {
        return Err(RingError::Mpi("a ring needs at least one rank".into()));
    }
    agree(&descs, 0, first_err, options)
}

/// The ring forward pass of P ranks simulated in one process: `q[r]`, `k[r]`, `v[r]` are
/// rank `r`'s shards, and the result is what [`Ring::forward`] returns on each rank, bit
/// for bit (the same steps, calls and merge order, on the current rayon pool).
///
/// ```
/// use attn_core::{Layout, Tensor4Ref};
/// use attn_ring::{RingOptions, shard, contiguous_rows, simulate_forward};
/// let x: Vec<f32> = (0..10 * 4).map(|i| (i % 7) as f32 * 0.25).collect();
/// let x = Tensor4Ref::from_layout(&x, [1, 1, 10, 4], Layout::Bhsd)?;
/// let shards: Vec<_> = (0..3).map(|r| shard(x, &[contiguous_rows(10, 3, r)])).collect::<Result<_, _>>()?;
/// let views: Vec<_> = shards.iter().map(|s| s.as_ref()).collect();
/// let ranks = simulate_forward(&views, &views, &views, &RingOptions::default())?;
/// let whole = attn_optimized::Attention::batched(x, x, x, &attn_core::Options::default())?
///     .forward(attn_optimized::Par::rayon(0))?
///     .into_output();
/// let got = ranks[1].out.as_slice()[0]; // rank 1's first row is position 4
/// assert!((got - whole.as_slice()[4 * 4]).abs() < 1e-6);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn simulate_forward<T: RingElement>(
    q: &[Tensor4Ref<'_, T>],
    k: &[Tensor4Ref<'_, T>],
    v: &[Tensor4Ref<'_, T>],
    options: &RingOptions,
) -> Result<Vec<RingForward<T>>, RingError> {
    let p = q.len();
    if k.len() != p || v.len() != p {
        return Err(attn_core::Error::mismatch(
            "K/V shards",
            "ranks",
            k.len().min(v.len()),
            "Q shards",
            p,
            "one shard of each per rank",
        )
        .into());
    }
    let locals = (0..p)
        .map(|r| check_forward(q[r], k[r], v[r], options))
        .collect();
    let plan = simulated_plan::<T>(locals, Pass::Forward, options)?;
    let s = plan.shape;
    let blocks = packed_blocks(&plan, k, v)?;
    let exec = Exec { pool: None };
    let mut results = Vec::with_capacity(p);
    for (r, &q) in q.iter().enumerate() {
        let mut acc = ForwardAcc::new(&plan, r)?;
        let mut stats = RingStats::new(p, rayon::current_num_threads());
        for step in 0..p {
            let owner = (r + p - step) % p;
            let block = KvBlock {
                data: &blocks[owner],
                rows: plan.rows[owner],
                segments: &plan.segments[owner],
            };
            let calls = fold_forward(&plan, q, &mut acc, &block, &exec, &mut || {})?;
            stats.calls += calls;
            stats.steps_computed += usize::from(calls > 0);
        }
        let (out, lse) = acc.finish::<T>(&s, plan.rows[r])?;
        results.push(RingForward { out, lse, stats });
    }
    Ok(results)
}

fn packed_blocks<T: RingElement>(
    plan: &Plan,
    k: &[Tensor4Ref<'_, T>],
    v: &[Tensor4Ref<'_, T>],
) -> attn_core::Result<Vec<Vec<T>>> {
    let mut blocks = Vec::with_capacity(k.len());
    for (r, (k, v)) in k.iter().zip(v).enumerate() {
        let mut b = Vec::new();
        pack_kv(&plan.shape, *k, *v, plan.rows[r], &mut b)?;
        blocks.push(b);
    }
    Ok(blocks)
}

/// The ring backward pass simulated in one process: per rank `r`, its shards of dO, Q,
/// K, V, O and its LSE; the result is what [`Ring::backward`] returns on each rank, bit
/// for bit (the same calls, the same order of every sum).
#[allow(clippy::too_many_arguments)]
pub fn simulate_backward<T: RingElement>(
    grad_out: &[Tensor4Ref<'_, T>],
    q: &[Tensor4Ref<'_, T>],
    k: &[Tensor4Ref<'_, T>],
    v: &[Tensor4Ref<'_, T>],
    out: &[Tensor4Ref<'_, T>],
    lse: &[&[f32]],
    options: &RingOptions,
) -> Result<Vec<RingBackward<T>>, RingError> {
    let p = q.len();
    if [grad_out.len(), k.len(), v.len(), out.len(), lse.len()]
        .iter()
        .any(|&l| l != p)
    {
        return Err(attn_core::Error::mismatch(
            "shards",
            "ranks",
            k.len(),
            "Q shards",
            p,
            "one shard of each operand per rank",
        )
        .into());
    }
    let locals = (0..p)
        .map(|r| check_backward(grad_out[r], q[r], k[r], v[r], out[r], lse[r], options))
        .collect();
    let plan = simulated_plan::<T>(locals, Pass::Backward, options)?;
    let s = plan.shape;
    let blocks = packed_blocks(&plan, k, v)?;
    let exec = Exec { pool: None };
    let grad_len = |rank: usize| {
        let (a, b) = s.kv_len(plan.rows[rank]);
        a + b
    };
    let mut accs = Vec::with_capacity(p);
    // The running sum of each block's dK, dV, as the ring passes it on.
    let mut sums: Vec<Option<Vec<f32>>> = vec![None; p];
    for r in 0..p {
        accs.push(BackwardAcc::new(&plan, r)?);
    }
    // Step by step, as the ring runs: at step s rank r adds its share to block r − s.
    for step in 0..p {
        for r in 0..p {
            let owner = (r + p - step) % p;
            let block = KvBlock {
                data: &blocks[owner],
                rows: plan.rows[owner],
                segments: &plan.segments[owner],
            };
            let x = BackwardInputs {
                grad_out: grad_out[r],
                q: q[r],
                out: out[r],
                lse: lse[r],
            };
            let mut share = zeros_f32("dK/dV share", grad_len(owner))?;
            fold_backward(
                &plan,
                r,
                x,
                &mut accs[r],
                &block,
                &mut share,
                &exec,
                &mut || {},
            )?;
            combine(sums[owner].as_deref(), &mut share);
            sums[owner] = Some(share);
        }
    }
    let mut results = Vec::with_capacity(p);
    for r in 0..p {
        let own = sums[r].take().unwrap_or_default();
        results.push(finish_backward::<T>(&plan, r, &accs[r], &own)?);
    }
    Ok(results)
}

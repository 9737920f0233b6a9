//! The schedule that the forward and backward passes share: the tile plan, the
//! order in which tasks are handed to threads, and the executor that runs them.
//!
//! Everything here depends on the shape alone, never on the thread count, so the result
//! bits do not depend on how many threads run: tiles and key chunks are fixed by the
//! shape, and partial states are reduced in a fixed order by their consumers.

use core::ops::Range;
use core::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use faer::Par;

use crate::kernel::rows::MAX_ROWS;

/// Query rows per task (at most): the Q tile, the score tile and the accumulator of this
/// many rows stay in L2 while the keys stream past.
pub const QUERY_TILE: usize = 128;
/// Keys per streamed tile: 512 amortises the per-block softmax bookkeeping and faer's
/// per-call cost (on Zen 4 at d = 64, 64-key tiles were 15–25 % slower).
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

    /// The plan of the backward pass for `n_q` queries against `n_k` keys: query tiles and
    /// key blocks of at most [`BACKWARD_TILE`]. A key block owns its rows of dK and dV
    /// while every query tile that sees it streams past, so its accumulators (and the
    /// score and probability-gradient tiles) stay in L2.
    pub fn for_backward(n_q: usize, n_k: usize) -> Self {
        let tile = |n: usize| {
            n.clamp(1, BACKWARD_TILE)
                .next_multiple_of(8)
                .min(BACKWARD_TILE)
        };
        Self {
            br: tile(n_q),
            bc: tile(n_k),
        }
    }

    /// Number of query tiles for `n_q` queries.
    pub fn query_tiles(&self, n_q: usize) -> usize {
        n_q.div_ceil(self.br)
    }
}

/// Query rows and keys per tile of the backward pass (at most): five GEMMs per tile pair
/// instead of the forward's two, on tiles that fit L2 together.
pub const BACKWARD_TILE: usize = 128;

/// Into how many chunks the backward pass splits each (batch, kv head)'s key blocks:
/// enough tasks for the cores when there are few heads, and one otherwise. Each chunk
/// keeps a partial dQ of its group's rows, reduced in chunk order: fewer than
/// `MIN_TASKS + groups` copies of a group's dQ in all, so the memory stays `O(n·d)`.
/// Depends on the shape alone.
pub(crate) fn key_chunks(groups: usize, blocks: usize) -> usize {
    MIN_TASKS.div_ceil(groups.max(1)).clamp(1, blocks.max(1))
}

/// Tiles with at most this many queries use the row kernels instead of GEMM tiles.
pub(crate) const DECODE_ROWS: usize = 4;
const _: () = assert!(DECODE_ROWS <= MAX_ROWS);

/// Below this many (head, query tile) tasks the keys are split into chunks as well.
const MIN_TASKS: usize = 8;
/// Keys per chunk when splitting; fixed, so the split depends on the shape alone.
pub const SPLIT_KEYS: usize = 1024;

/// Whether heads with few query tiles also split their keys across tasks (flash-decoding).
///
/// ```
/// assert_eq!(attn_optimized::SplitKv::default(), attn_optimized::SplitKv::Auto);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum SplitKv {
    /// Split when the grid has fewer than 8 (head, query tile) tasks and a head has more
    /// than 1024 keys: chunks of 1024 keys, merged in order. Depends on the shape only.
    #[default]
    Auto,
    /// Never split: one task per (head, query tile).
    Never,
}

/// Query heads stacked into the rows of one job. With one query per head (decoding), the
/// query heads of a grouped-query group share K and V: up to [`DECODE_ROWS`] of them (the
/// largest divisor of the group that fits) become the rows of one row tile, which reads
/// each block of K and V from memory once for all of them instead of once per head. A
/// group of [`GEMM_GROUP`] heads or more (multi-head latent attention's 16–128 heads on one
/// latent head) is compute-bound: up to [`QUERY_TILE`] of its heads become the rows of one
/// GEMM tile. Anything else is one head per job.
pub(crate) fn heads_per_job(n_q: usize, group: usize) -> usize {
    if n_q != 1 {
        return 1;
    }
    let most = if group >= GEMM_GROUP {
        QUERY_TILE
    } else {
        DECODE_ROWS
    };
    (1..=most.min(group))
        .rev()
        .find(|s| group.is_multiple_of(*s))
        .unwrap_or(1)
}

/// Decoding heads per K/V head from which a stack of them is multiplied as a GEMM tile:
/// then each key read from memory serves enough heads for the products to set the pace.
pub(crate) const GEMM_GROUP: usize = 16;

/// Whether a grid of `jobs` heads with `tiles_per_head` query tiles each, the longest
/// attending `n_k` keys, splits its keys into chunks (flash-decoding).
pub(crate) fn splits(split: SplitKv, jobs: usize, tiles_per_head: usize, n_k: usize) -> bool {
    split == SplitKv::Auto && jobs * tiles_per_head < MIN_TASKS && n_k > SPLIT_KEYS
}

/// `keys` in chunks of [`SPLIT_KEYS`].
pub(crate) fn chunked(keys: Range<usize>) -> Vec<Range<usize>> {
    keys.clone()
        .step_by(SPLIT_KEYS)
        .map(|s| s..(s + SPLIT_KEYS).min(keys.end))
        .collect()
}

/// Which end of the task list each thread takes from.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Order {
    /// Everyone takes the next task from the front (tasks sorted heaviest first).
    Front,
    /// The calling thread takes from the front, the pool's workers from the back: equal
    /// tasks land on the same threads call after call (a short decode step's K and V then
    /// stay in the cache of the core that read them last time), and still balance.
    BothEnds,
}

/// Runs `task(i)` for every `i < n`: on the calling thread and on as many workers of the
/// current rayon pool as help, each taking the next index as `order` says.
///
/// The calling thread works from the first moment instead of waiting for the pool, and at
/// the end spins (rather than sleeps, for up to [`SPIN_LIMIT`]) until the helpers that took
/// work are done: waking a sleeping thread can cost tens of microseconds on a virtual
/// machine, as long as a whole decode step of a short sequence (`docs/algorithm.md` §4). A helper that has not started by then finds no work
/// left; the rayon scope waits for it the ordinary way (a worker thread runs pending jobs
/// meanwhile, so nested calls cannot deadlock). The calling thread counts as one of the
/// pool's threads. `par` bounds the threads: [`Par::Seq`] runs every task on the calling
/// thread, [`Par::Rayon`]`(t)` on at most `t` threads of the pool (the bits are the same).
pub(crate) fn for_each_index(n: usize, order: Order, par: Par, task: impl Fn(usize) + Sync) {
    let left = Mutex::new(0..n);
    let take = |back: bool| {
        let mut left = left.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        if back { left.next_back() } else { left.next() }
    };
    let work = |back: bool| {
        while let Some(i) = take(back) {
            task(i);
        }
    };
    let (started, finished) = (AtomicUsize::new(0), AtomicUsize::new(0));
    let threads = match par {
        Par::Seq => 1,
        Par::Rayon(t) => t.get().min(rayon::current_num_threads()),
    };
    let helpers = threads.min(n).saturating_sub(1);
    rayon::in_place_scope(|scope| {
        for _ in 0..helpers {
            scope.spawn(|_| {
                started.fetch_add(1, Ordering::AcqRel);
                // Counted as finished even if a task panics (the scope re-raises it).
                let _done = Finished(&finished);
                work(order == Order::BothEnds);
            });
        }
        work(false);
        // Spin for at most a while: a helper still in a long task (prefill) is better
        // waited for by the scope, which lets a worker thread run other jobs meanwhile.
        let since = Instant::now();
        while finished.load(Ordering::Acquire) < started.load(Ordering::Acquire)
            && since.elapsed() < SPIN_LIMIT
        {
            core::hint::spin_loop();
        }
    });
}

/// How long the calling thread spins for helpers still at work before it waits the
/// ordinary way: several decode steps' worth, a small part of a prefill task.
const SPIN_LIMIT: Duration = Duration::from_micros(200);

/// Counts a helper as finished when dropped, on return or unwind alike.
struct Finished<'a>(&'a AtomicUsize);

impl Drop for Finished<'_> {
    fn drop(&mut self) {
        self.0.fetch_add(1, Ordering::Release);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn in_pool<R: Send>(threads: usize, f: impl FnOnce() -> R + Send) -> R {
        rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .expect("a pool")
            .install(f)
    }

    #[test]
    fn every_index_runs_exactly_once() {
        for threads in 1..=3 {
            for order in [Order::Front, Order::BothEnds] {
                for n in [0, 1, 2, 3, 7, 40] {
                    let runs: Vec<AtomicUsize> = (0..n).map(|_| AtomicUsize::new(0)).collect();
                    in_pool(threads, || {
                        for_each_index(n, order, Par::rayon(0), |i| {
                            runs[i].fetch_add(1, Ordering::Relaxed);
                        })
                    });
                    assert!(runs.iter().all(|r| r.load(Ordering::Relaxed) == 1));
                }
            }
        }
    }

    #[test]
    fn nested_calls_inside_a_busy_pool_finish() {
        // Every worker is inside an outer task that itself fans out: no one may wait on a
        // helper that cannot start.
        let total = AtomicUsize::new(0);
        in_pool(2, || {
            rayon::scope(|s| {
                for _ in 0..6 {
                    s.spawn(|_| {
                        for_each_index(5, Order::BothEnds, Par::rayon(0), |_| {
                            total.fetch_add(1, Ordering::Relaxed);
                        })
                    });
                }
            })
        });
        assert_eq!(total.load(Ordering::Relaxed), 30);
    }

    #[test]
    fn a_panicking_task_reaches_the_caller_instead_of_hanging() {
        let result = std::panic::catch_unwind(|| {
            in_pool(2, || {
                for_each_index(8, Order::BothEnds, Par::rayon(0), |i| {
                    if i == 5 {
                        panic!("task 5");
                    }
                    std::thread::sleep(Duration::from_millis(1));
                })
            })
        });
        assert!(result.is_err());
    }
}

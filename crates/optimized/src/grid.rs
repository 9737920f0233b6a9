//! The parallel grid: (head, query tile) tasks on rayon, or (head, query tile, key chunk)
//! tasks merged in order when the grid alone is too small to keep the cores busy.

use core::ops::Range;
use core::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use attn_core::Result;
use faer::MatMut;

use crate::decode::DECODE_ROWS;
use crate::element::Element;
use crate::merge::PartialState;
use crate::tile::{HeadInputs, Scratch, TilePlan};

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

/// One head to compute: its inputs, the keys it attends (global indices; its K/V rows
/// start at `keys.start`), and where its output (and LSE) go.
pub(crate) struct HeadJob<'a, T, O> {
    pub inputs: HeadInputs<'a, T>,
    pub keys: Range<usize>,
    pub out: MatMut<'a, O>,
    pub lse: Option<&'a mut [f32]>,
}

/// Query heads stacked into the rows of one job. With one query per head (decoding), the
/// query heads of a grouped-query group share K and V: up to [`DECODE_ROWS`] of them (the
/// largest divisor of the group that fits) become the rows of one tile, which reads each
/// block of K and V from memory once for all of them instead of once per head. Anything
/// else is one head per job.
pub(crate) fn heads_per_job(n_q: usize, group: usize) -> usize {
    if n_q != 1 {
        return 1;
    }
    (1..=DECODE_ROWS.min(group))
        .rev()
        .find(|s| group.is_multiple_of(*s))
        .unwrap_or(1)
}

/// The jobs of a batched call writing `out : [batch, h_q, n_q, d_v]` (contiguous) and, if
/// not empty, `lse : [batch, h_q, n_q]`; query head `h` reads K/V head `h / group`.
/// `head(b, kv, heads)` resolves one job's inputs and key range for the query heads
/// `heads` of batch entry `b` (several only when [`heads_per_job`] stacks them; Q is then
/// their one query each). Returns the jobs and the query rows of each.
pub(crate) fn batch_jobs<'a, T, O>(
    out: &'a mut [O],
    lse: &'a mut [f32],
    [h_q, n_q, d_v]: [usize; 3],
    group: usize,
    mut head: impl FnMut(usize, usize, Range<usize>) -> Result<(HeadInputs<'a, T>, Range<usize>)>,
) -> Result<(Vec<HeadJob<'a, T, O>>, usize)> {
    let stack = heads_per_job(n_q, group);
    let rows = stack * n_q;
    let mut lse_chunks = lse.chunks_mut(rows.max(1));
    let mut jobs = Vec::with_capacity(out.len() / (rows * d_v).max(1));
    for (idx, chunk) in out.chunks_mut((rows * d_v).max(1)).enumerate() {
        let first = idx * stack;
        let (b, h) = (first / h_q, first % h_q);
        let (mut inputs, keys) = head(b, h / group.max(1), h..h + stack)?;
        inputs.stacked = stack > 1;
        let out =
            MatMut::from_column_major_slice_with_stride_mut(chunk, d_v, rows, d_v).transpose_mut();
        jobs.push(HeadJob {
            inputs,
            keys,
            out,
            lse: lse_chunks.next(),
        });
    }
    Ok((jobs, rows))
}

struct TileTask<'a, T, O> {
    inputs: HeadInputs<'a, T>,
    keys: Range<usize>,
    rows: Range<usize>,
    out: MatMut<'a, O>,
    lse: Option<&'a mut [f32]>,
    work: usize,
}

fn chunked(keys: Range<usize>) -> Vec<Range<usize>> {
    keys.clone()
        .step_by(SPLIT_KEYS)
        .map(|s| s..(s + SPLIT_KEYS).min(keys.end))
        .collect()
}

fn split_lse<'a>(lse: &mut Option<&'a mut [f32]>, n: usize) -> Option<&'a mut [f32]> {
    let l = lse.take()?;
    let (a, b) = l.split_at_mut(n);
    *lse = Some(b);
    Some(a)
}

/// Runs every job; all jobs share `n_q`, `d_k` and `d_v` (their key counts may differ).
pub(crate) fn run<T: Element, O: Element>(
    jobs: Vec<HeadJob<'_, T, O>>,
    n_q: usize,
    split: SplitKv,
) {
    let Some(first) = jobs.first() else { return };
    let (d_k, d_v) = (first.inputs.q.ncols(), first.inputs.v.ncols());
    let n_k = jobs.iter().map(|j| j.keys.len()).max().unwrap_or(0);
    let plan = TilePlan::for_shape(n_q, n_k);
    let tiles_per_head = plan.query_tiles(n_q);
    let few = jobs.len() * tiles_per_head < MIN_TASKS;
    if split == SplitKv::Auto && few && jobs.iter().any(|j| j.keys.len() > SPLIT_KEYS) {
        return run_split(jobs, plan, n_q);
    }

    let mut tasks = Vec::with_capacity(jobs.len() * tiles_per_head);
    for job in jobs {
        let HeadJob {
            inputs,
            keys,
            mut out,
            mut lse,
        } = job;
        for t in 0..tiles_per_head {
            let rows = t * plan.br..((t + 1) * plan.br).min(n_q);
            let (tile, rest) = out.split_at_row_mut(rows.len());
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
            });
        }
    }
    // Heaviest first (causal: the last query tiles), so no core idles at the end.
    tasks.sort_by_key(|t| core::cmp::Reverse(t.work));
    let tasks: Vec<Mutex<Option<TileTask<'_, T, O>>>> =
        tasks.into_iter().map(|t| Mutex::new(Some(t))).collect();
    for_each_index(tasks.len(), Order::Front, |i| {
        let Some(task) = tasks[i].lock().ok().and_then(|mut t| t.take()) else {
            return;
        };
        Scratch::with::<T, _>(plan, d_k, d_v, |scratch| {
            scratch.attend(&task.inputs, task.rows.clone(), task.keys.clone());
            scratch.write_normalised(task.rows.len(), task.out, task.lse);
        })
    });
}

/// Which end of the task list each thread takes from.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Order {
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
/// work are done: waking a sleeping thread costs tens of microseconds on a virtual machine
/// (measured here: a `rayon::join` of two 10 µs halves takes 48 µs), as long as a whole
/// decode step of a short sequence. A helper that has not started by then finds no work
/// left; the rayon scope waits for it the ordinary way (a worker thread runs pending jobs
/// meanwhile, so nested calls cannot deadlock). The calling thread counts as one of the
/// pool's threads.
fn for_each_index(n: usize, order: Order, task: impl Fn(usize) + Sync) {
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
    let helpers = rayon::current_num_threads().min(n).saturating_sub(1);
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

/// Split-KV: every (head, query tile, key chunk) is a task producing a partial state; the
/// states of one tile are merged in chunk order, whatever thread computed them.
fn run_split<T: Element, O: Element>(jobs: Vec<HeadJob<'_, T, O>>, plan: TilePlan, n_q: usize) {
    let (d_k, d_v) = (jobs[0].inputs.q.ncols(), jobs[0].inputs.v.ncols());
    let tiles = plan.query_tiles(n_q);
    let chunks: Vec<Vec<Range<usize>>> = jobs.iter().map(|j| chunked(j.keys.clone())).collect();
    let mut index: Vec<(usize, usize, usize)> = Vec::new();
    for (j, job_chunks) in chunks.iter().enumerate() {
        for t in 0..tiles {
            index.extend((0..job_chunks.len().max(1)).map(|c| (j, t, c)));
        }
    }
    let states: Vec<OnceLock<PartialState>> = index.iter().map(|_| OnceLock::new()).collect();
    for_each_index(index.len(), Order::BothEnds, |i| {
        let (j, t, c) = index[i];
        let state = Scratch::with::<T, _>(plan, d_k, d_v, |scratch| {
            let rows = t * plan.br..((t + 1) * plan.br).min(n_q);
            let keys = chunks[j].get(c).cloned().unwrap_or(0..0);
            scratch.attend(&jobs[j].inputs, rows.clone(), keys);
            scratch.partial_state(rows.len())
        });
        // Each index is handed out once, so the slot is empty.
        let _ = states[i].set(state);
    });
    let mut states = states
        .into_iter()
        .map(|s| s.into_inner().expect("every task ran"));
    for (job, chunks) in jobs.into_iter().zip(&chunks) {
        let HeadJob {
            mut out, mut lse, ..
        } = job;
        for t in 0..tiles {
            let rows = t * plan.br..((t + 1) * plan.br).min(n_q);
            let mut merged = states.next().expect("one state per task");
            for _ in 1..chunks.len().max(1) {
                let next = states.next().expect("one state per task");
                merged
                    .merge_in_place(&next)
                    .expect("same tile shape by construction");
            }
            let mut dst = out.as_mut().subrows_mut(rows.start, rows.len());
            let src = merged.output();
            for c in 0..src.ncols() {
                for i in 0..src.nrows() {
                    dst[(i, c)] = O::from_f32(src[(i, c)]);
                }
            }
            if let Some(l) = lse.as_deref_mut() {
                l[rows].copy_from_slice(merged.lse());
            }
        }
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
                        for_each_index(n, order, |i| {
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
                        for_each_index(5, Order::BothEnds, |_| {
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
                for_each_index(8, Order::BothEnds, |i| {
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

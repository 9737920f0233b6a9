//! The parallel grid: (head, query tile) tasks on rayon, or (head, query tile, key chunk)
//! tasks merged in order when the grid alone is too small to keep the cores busy.

use core::ops::Range;

use faer::{Mat, MatMut};
use rayon::prelude::*;

use crate::element::Element;
use crate::merge::PartialState;
use crate::tile::{HeadInputs, Scratch, TilePlan};

/// Below this many (head, query tile) tasks the keys are split into chunks as well.
const MIN_TASKS: usize = 8;
/// Keys per chunk when splitting; fixed, so the split depends on the shape alone.
pub const SPLIT_KEYS: usize = 1024;

/// One head to compute: its inputs and where its output (and LSE) go.
pub(crate) struct HeadJob<'a, T, O> {
    pub inputs: HeadInputs<'a, T>,
    pub out: MatMut<'a, O>,
    pub lse: Option<&'a mut [f32]>,
}

struct TileTask<'a, T, O> {
    inputs: HeadInputs<'a, T>,
    rows: Range<usize>,
    out: MatMut<'a, O>,
    lse: Option<&'a mut [f32]>,
    work: usize,
}

/// The key range split into chunks when a grid of `tasks` tasks needs splitting, else
/// one chunk.
fn key_chunks(tasks: usize, keys: Range<usize>) -> Vec<Range<usize>> {
    if tasks >= MIN_TASKS || keys.len() <= SPLIT_KEYS {
        return vec![keys];
    }
    keys.clone()
        .step_by(SPLIT_KEYS)
        .map(|s| s..(s + SPLIT_KEYS).min(keys.end))
        .collect()
}

/// Runs every job over the keys `keys` (global indices; each job's K/V rows start at
/// `keys.start`); all jobs share the same shape.
pub(crate) fn run<T: Element, O: Element>(
    jobs: Vec<HeadJob<'_, T, O>>,
    n_q: usize,
    keys: Range<usize>,
) {
    let Some(first) = jobs.first() else { return };
    let (d_k, d_v) = (first.inputs.q.ncols(), first.inputs.v.ncols());
    let plan = TilePlan::for_shape(n_q, keys.len());
    let tiles_per_head = plan.query_tiles(n_q);
    let chunks = key_chunks(jobs.len() * tiles_per_head, keys.clone());
    if chunks.len() > 1 {
        return run_split(jobs, plan, &chunks);
    }

    let mut tasks = Vec::with_capacity(jobs.len() * tiles_per_head);
    for job in jobs {
        let HeadJob {
            inputs,
            mut out,
            mut lse,
        } = job;
        for t in 0..tiles_per_head {
            let rows = t * plan.br..((t + 1) * plan.br).min(n_q);
            let (tile, rest) = out.split_at_row_mut(rows.len());
            out = rest;
            let lse_tile = match lse.take() {
                Some(l) => {
                    let (a, b) = l.split_at_mut(rows.len());
                    lse = Some(b);
                    Some(a)
                }
                None => None,
            };
            let seen = inputs.mask.key_range(rows.end - 1).end;
            let work = seen.saturating_sub(inputs.mask.key_range(rows.start).start);
            tasks.push(TileTask {
                inputs,
                rows,
                out: tile,
                lse: lse_tile,
                work,
            });
        }
    }
    // Heaviest first (causal: the last query tiles), so no core idles at the end.
    tasks.sort_by_key(|t| core::cmp::Reverse(t.work));
    tasks.into_par_iter().for_each(|task| {
        Scratch::with::<T, _>(plan, d_k, d_v, |scratch| {
            scratch.attend(&task.inputs, task.rows.clone(), keys.clone());
            scratch.write_normalised(task.rows.len(), task.out, task.lse);
        })
    });
}

/// Split-KV: every (head, query tile, key chunk) is a task producing a partial state; the
/// states of one tile are merged in chunk order, whatever thread computed them.
fn run_split<T: Element, O: Element>(
    jobs: Vec<HeadJob<'_, T, O>>,
    plan: TilePlan,
    chunks: &[Range<usize>],
) {
    let first = &jobs[0].inputs;
    let (n_q, d_k, d_v) = (first.q.nrows(), first.q.ncols(), first.v.ncols());
    let tiles = plan.query_tiles(n_q);
    let index: Vec<(usize, usize, usize)> = (0..jobs.len())
        .flat_map(|j| (0..tiles).flat_map(move |t| (0..chunks.len()).map(move |c| (j, t, c))))
        .collect();
    let states: Vec<PartialState> = index
        .par_iter()
        .map(|&(j, t, c)| {
            Scratch::with::<T, _>(plan, d_k, d_v, |scratch| {
                let rows = t * plan.br..((t + 1) * plan.br).min(n_q);
                scratch.attend(&jobs[j].inputs, rows.clone(), chunks[c].clone());
                let mut out = Mat::<f32>::zeros(rows.len(), d_v);
                let mut lse = vec![0.0; rows.len()];
                scratch.write_normalised(rows.len(), out.as_mut(), Some(&mut lse));
                PartialState::new(out, lse).expect("one LSE per row by construction")
            })
        })
        .collect();
    let mut states = states.into_iter();
    for job in jobs {
        let HeadJob {
            mut out, mut lse, ..
        } = job;
        for t in 0..tiles {
            let rows = t * plan.br..((t + 1) * plan.br).min(n_q);
            let mut merged = states.next().expect("one state per task");
            for _ in 1..chunks.len() {
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

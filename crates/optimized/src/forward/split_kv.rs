//! Split-KV (flash-decoding): when the (head, query tile) grid is too small to keep the
//! cores busy, every (head, query tile, key chunk) is a task producing a partial state,
//! and the states of one tile are merged in chunk order, whatever thread computed them.
//! The chunks ([`SPLIT_KEYS`](crate::SPLIT_KEYS) keys) and the merge order depend on the shape alone.

use core::ops::Range;
use std::sync::OnceLock;

use attn_core::PartialState;
use faer::Par;

use super::Scratch;
use crate::kernel::element::Element;
use crate::keys::KeySource;
use crate::modifiers::sink_into_lse;
use crate::problem::{HeadJob, Problem};
use crate::schedule::{Order, chunked, for_each_index};

/// Runs `jobs` split into key chunks.
pub(super) fn run<T: Element, O: Element, K: KeySource<T>>(
    problem: &Problem,
    jobs: Vec<HeadJob<'_, '_, T, O, K>>,
    par: Par,
) {
    let (n_q, plan) = (problem.rows, problem.plan);
    let tiles = plan.query_tiles(n_q);
    let chunks: Vec<Vec<Range<usize>>> = jobs.iter().map(|j| chunked(j.keys.clone())).collect();
    let mut index: Vec<(usize, usize, usize)> = Vec::new();
    for (j, job_chunks) in chunks.iter().enumerate() {
        for t in 0..tiles {
            index.extend((0..job_chunks.len().max(1)).map(|c| (j, t, c)));
        }
    }
    let states: Vec<OnceLock<PartialState>> = index.iter().map(|_| OnceLock::new()).collect();
    for_each_index(index.len(), Order::BothEnds, par, |i| {
        let (j, t, c) = index[i];
        let state = Scratch::with::<T, K, _>(problem, |scratch| {
            let rows = t * plan.br..((t + 1) * plan.br).min(n_q);
            let keys = chunks[j].get(c).cloned().unwrap_or(0..0);
            scratch.attend(&jobs[j].inputs, rows.clone(), keys.clone(), None);
            scratch.partial_state(&jobs[j].inputs, rows, keys)
        });
        // Each index is handed out once, so the slot is empty.
        let _ = states[i].set(state);
    });
    let mut states = states
        .into_iter()
        .map(|s| s.into_inner().expect("every task ran"));
    for (job, chunks) in jobs.into_iter().zip(&chunks) {
        let HeadJob {
            out,
            mut lse,
            inputs,
            ..
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
            let (src, merged_lse) = (merged.output(), merged.lse());
            // The sink is one more partial state (output 0, LSE `sink`), merged in once,
            // after the chunks.
            let sink = |i: usize| {
                inputs
                    .mods
                    .sink
                    .map_or((1.0, merged_lse[i]), |s| sink_into_lse(merged_lse[i], s))
            };
            for (i, dst) in out[rows.clone()].iter_mut().enumerate() {
                let factor = sink(i).0;
                for c in 0..src.ncols() {
                    dst[c] = if inputs.mods.sink.is_some() {
                        O::from_f32((f64::from(src[(i, c)]) * factor) as f32)
                    } else {
                        O::from_f32(src[(i, c)])
                    };
                }
            }
            if let Some(l) = lse.as_deref_mut() {
                for (i, x) in l[rows].iter_mut().enumerate() {
                    *x = sink(i).1;
                }
            }
        }
    }
}

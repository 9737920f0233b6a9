//! The row-tile loop of one task: tiles of at most [`DECODE_ROWS`](crate::schedule::DECODE_ROWS) queries (decoding, one
//! new token per head) against a long stream of keys.
//!
//! With so few queries a GEMM degenerates into a matrix-vector product bound by reading K
//! and V from memory; this loop keeps the stream going: the row kernels' dot product per
//! key, the online softmax along each row, then `acc += p_j · v_j` over the value rows.
//! K and V are read in place by this CPU's kernels where the layout allows, else copied
//! (widened) block by block for the portable kernels.

use core::ops::Range;

use attn_core::TileCoverage;
use faer::MatRef;

use super::Scratch;
use crate::exact::rescore;
use crate::kernel::element::{Element, row_slices};
use crate::kernel::finite::tile_is_finite;
use crate::kernel::online_softmax::saturate;
use crate::kernel::online_softmax::softmax_row;
use crate::kernel::rows::{
    RUN_PREFETCH_BYTES, RowKernels, accumulate, code_unit, prefetch, scores,
};
use crate::keys::{KeySource, Quantized};
use crate::mask::{
    add_non_finite_terms, key_blocks, mask_row, without_non_finite_rows,
    zero_weight_meets_non_finite,
};
use crate::modifiers::modify_scores;
use crate::problem::HeadInputs;
use crate::schedule::{DECODE_ROWS, KEY_TILE, TilePlan};

/// The in-place row kernels this CPU has, if any (looked up once per task; each block
/// then asks [`RowKernels::reads`] of its K and V).
fn row_kernels() -> Option<RowKernels> {
    #[cfg(test)]
    if let Some(forced) = tests::forced() {
        return forced;
    }
    RowKernels::for_this_cpu()
}

impl Scratch {
    /// [`Scratch::attend`] for a tile of at most [`DECODE_ROWS`](crate::schedule::DECODE_ROWS) queries: a dot product per
    /// key instead of a GEMM, so the loop streams K and V at memory speed. The
    /// accumulators stay row-major (`acc_rows`), where [`Scratch::normalised`] reads them.
    /// K and V are read run by run where the source lends its rows in place
    /// ([`KeySource::run_at`]: one run a dense block; a page of a paged one, or pages that
    /// follow each other in its pool), each run's prefetches reaching into the next, and
    /// the runs of a scattered source asked into the caches [`RUN_PREFETCH_BYTES`] ahead.
    pub(super) fn attend_rows<T: Element, K: KeySource<T>>(
        &mut self,
        head: &HeadInputs<'_, T, K>,
        rows: Range<usize>,
        keys: Range<usize>,
    ) {
        let TilePlan { bc, .. } = self.plan;
        let nr = rows.len();
        let (d_k, d_v) = (head.q.ncols(), head.v.width());
        for (i, q) in self.q.chunks_exact_mut(d_k).take(nr).enumerate() {
            for (c, x) in q.iter_mut().enumerate() {
                // Saturated: a query entry near f32::MAX times scale·log2(e) must not become
                // inf (inf · 0 = NaN where the score is 0); the row's scores are then
                // recomputed exactly.
                *x = saturate(head.q[(rows.start + i, c)].to_f32() * head.scale_log2);
            }
        }
        let rescaled = self.mark_rescaled(head, rows.clone());
        let best = row_kernels();
        // Quantized K and V: the kernels read their codes in place when they can.
        let coded = best.filter(|s| reads_codes(s, &head.k) && reads_codes(s, &head.v));
        // q · (μ + f ∘ k̂) = q · μ + (q ∘ f) · k̂: the keys' channel offsets add one term to
        // a query's every score, their factors go to the query.
        let mut offset_terms = [0.0f32; DECODE_ROWS];
        if let Some(ch) = coded.and(head.k.quantized()).and_then(|k| k.channels) {
            for (q, term) in self.q.chunks_exact_mut(d_k).take(nr).zip(&mut offset_terms) {
                *term = q.iter().zip(ch.offsets).map(|(x, mu)| x * mu).sum();
                for (x, f) in q.iter_mut().zip(ch.factors) {
                    *x *= f;
                }
            }
        }
        // Sized once per scratch: a plan for GEMM tiles reads f32 in place and has none.
        for (wide, d) in [(&mut self.k_wide, d_k), (&mut self.v_wide, d_v)] {
            if wide.len() < bc * d {
                wide.resize(bc * d, 0.0);
            }
        }
        self.acc_rows.fill(0.0);
        self.m[..nr].fill(f32::NEG_INFINITY);
        self.l[..nr].fill(0.0);
        for (cols, coverage) in key_blocks(head, rows.clone(), keys, KEY_TILE) {
            let (nc, local) = (cols.len(), cols.start - head.key_base);
            let (kb, vb) = (
                head.k.block(local..local + nc),
                head.v.block(local..local + nc),
            );
            // Read in place where this CPU has in-place kernels for the layout, else copied
            // block by block. A source's runs share one layout (a dense view's strides, a
            // pool's), so its first run speaks for all.
            let readable = |s: &RowKernels, src: &K| src.run_at(0).is_some_and(|r| s.reads(r));
            let in_place = best.filter(|s| readable(s, &kb) && readable(s, &vb));
            // K pass, then V pass: each is one long sequential stream, which the prefetchers
            // follow at full bandwidth (interleaving K and V rows does not).
            let q_row = |i: usize| &self.q[i * d_k..(i + 1) * d_k];
            if let (Some(kernels), Some(kq)) = (coded, kb.quantized()) {
                let next_v = vb.quantized().and_then(|v| v.codes.run(0));
                self.scores_of_codes(kernels, kq, next_v, (nr, nc, d_k));
                if kq.channels.is_some() {
                    for (s, term) in self.s.chunks_exact_mut(bc).zip(&offset_terms[..nr]) {
                        for x in &mut s[..nc] {
                            *x += term;
                        }
                    }
                }
            } else if let Some(kernels) = in_place {
                let (q, s) = (&self.q[..nr * d_k], &mut self.s);
                let ahead = runs(&kb).skip(look_ahead(&kb));
                stream(runs(&kb), ahead, vb.run_at(0), |first, run, next| {
                    kernels.scores(q, run, next, (&mut s[first..], bc));
                });
            } else {
                let mut k: [&[f32]; KEY_TILE] = [&[]; KEY_TILE];
                f32_row_slices(&kb, &mut self.k_wide, &mut k);
                for (i, s) in self.s.chunks_exact_mut(bc).take(nr).enumerate() {
                    scores(q_row(i), &k[..nc], &mut s[..nc]);
                }
            }
            // Row-major scores: rows `bc` apart, so the tile is `nc × nr` column-major.
            if rescaled || !tile_is_finite(&self.s, bc, nc, nr) {
                let q = head.q.subrows(rows.start, nr);
                let rescaled = Some(&self.rescaled[..nr]);
                rescore(&mut self.s, (bc, 1), q, &kb, head.scale_log2, rescaled);
            }
            modify_scores(
                &mut self.s,
                (bc, 1),
                head,
                (rows.clone(), cols.clone()),
                None,
            );
            let masked = coverage == TileCoverage::Partial || head.mask.has_elementwise();
            for i in 0..nr {
                let s = &mut self.s[i * bc..i * bc + nc];
                let row = rows.start + i;
                mask_row(s, head, (row, cols.clone()), coverage);
                self.alpha[i] = softmax_row(s, &mut self.m[i], &mut self.l[i], !masked);
            }
            let zero_weight = |jj: usize| (0..nr).any(|i| self.s[i * bc + jj] == 0.0);
            // A hidden key must contribute nothing, not 0·V_j (NaN for a non-finite V_j):
            // the values are then read without the non-finite rows, whose terms the rows
            // that see them add alone, so the other rows get the bits they would anyway.
            let careful = masked
                && !vb.always_finite()
                && match vb.in_place() {
                    Some(v) => zero_weight_meets_non_finite(v, zero_weight),
                    None => zero_weight_meets_non_finite(vb.to_f32(&mut self.v_wide), zero_weight),
                };
            // The next block's first run (its own, not the rest of the keys': a run of many
            // pages is found by walking them).
            let next_block = head.k.block(local + nc..(local + 2 * nc).min(head.k.len()));
            let next_k = next_block.run_at(0);
            match in_place {
                _ if coded.is_some() && !careful => {
                    let next = next_block.quantized().and_then(|k| k.codes.run(0));
                    if let (Some(kernels), Some(vq)) = (coded, vb.quantized()) {
                        self.accumulate_codes(kernels, vq, next, (nr, nc, d_v));
                    }
                }
                Some(kernels) if !careful => {
                    // Each run rescales the accumulators by what the softmax asked of the
                    // block (the first) or by nothing (1, exactly).
                    let (acc, s) = (&mut self.acc_rows[..nr * d_v], &self.s);
                    let alphas = first_alphas(&self.alpha[..nr]);
                    let ahead = runs(&vb).skip(look_ahead(&vb));
                    stream(runs(&vb), ahead, next_k, |first, run, next| {
                        let accs = (&mut *acc, alphas(first));
                        kernels.accumulate(accs, (&s[first..], bc), run, next);
                    });
                }
                _ => match vb.in_place() {
                    Some(v) => {
                        let mut buf = Vec::new();
                        let values = if careful {
                            without_non_finite_rows(v, &mut buf)
                        } else {
                            v
                        };
                        self.accumulate_block(in_place, values, next_k, (nr, nc, d_v));
                    }
                    None => {
                        // Rows from several pages: the block's rows as f32.
                        let mut buf = Vec::new();
                        let wide = vb.to_f32(&mut self.v_wide);
                        let values = if careful {
                            without_non_finite_rows(wide, &mut buf)
                        } else {
                            wide
                        };
                        let mut v: [&[f32]; KEY_TILE] = [&[]; KEY_TILE];
                        for (slot, j) in v.iter_mut().zip(0..nc) {
                            *slot = values
                                .row(j)
                                .try_as_row_major()
                                .map_or(&[], |r| r.as_slice());
                        }
                        for i in 0..nr {
                            let p = &self.s[i * bc..i * bc + nc];
                            let acc = &mut self.acc_rows[i * d_v..(i + 1) * d_v];
                            accumulate(acc, self.alpha[i], p, &v[..nc]);
                        }
                    }
                },
            }
            if careful {
                let (s, acc) = (&self.s, &mut self.acc_rows);
                let at = (rows.clone(), cols.clone());
                let p = |i: usize, jj: usize| s[i * bc + jj];
                let add = |i: usize, c: usize, x: f32| acc[i * d_v + c] += x;
                match vb.in_place() {
                    Some(v) => add_non_finite_terms(head, at, v, p, add),
                    None => add_non_finite_terms(head, at, vb.to_f32(&mut self.v_wide), p, add),
                }
            }
        }
    }

    /// The K pass over a quantized block `kq`: `s_r[j] = scale_j · (q_r ∘ f) · value(code_j)`
    /// (the queries already carry the channel factors; the caller adds the offsets' term),
    /// the codes read in place run by run,
    /// prefetching on into `next_v`. The block's scales go through `k_wide` (nothing is
    /// widened on this path).
    fn scores_of_codes(
        &mut self,
        kernels: RowKernels,
        kq: Quantized<'_>,
        next_v: Option<MatRef<'_, u8>>,
        (nr, nc, d_k): (usize, usize, usize),
    ) {
        let bc = self.plan.bc;
        let (q, s) = (&self.q[..nr * d_k], &mut self.s);
        let ahead = kq.codes.runs().skip(look_ahead_rows(kq.codes.run(0)));
        stream(kq.codes.runs(), ahead, next_v, |first, run, next| {
            kernels.scores_of_codes(kq.kind, q, run, next, (&mut s[first..], bc));
        });
        let scales = &mut self.k_wide[..nc];
        kq.scales_into(0, scales);
        let unit = code_unit(kq.kind);
        for s in self.s.chunks_exact_mut(bc).take(nr) {
            for (x, &scale) in s[..nc].iter_mut().zip(&*scales) {
                *x *= scale * unit;
            }
        }
    }

    /// The V pass over a quantized block `vq`: `acc_r = alpha_r·acc_r + Σ_j (p_r[j] ·
    /// scale_j) · value(code_j)`, the weights times the rows' scales in `v_wide`, the codes
    /// read in place run by run, prefetching on into `next`.
    fn accumulate_codes(
        &mut self,
        kernels: RowKernels,
        vq: Quantized<'_>,
        next: Option<MatRef<'_, u8>>,
        (nr, nc, d_v): (usize, usize, usize),
    ) {
        let bc = self.plan.bc;
        let (scales, weights) = (&mut self.k_wide[..nc], &mut self.v_wide[..nr * bc]);
        vq.scales_into(0, scales);
        let unit = code_unit(vq.kind);
        for (w, p) in weights.chunks_exact_mut(bc).zip(self.s.chunks_exact(bc)) {
            for ((w, &p), &scale) in w[..nc].iter_mut().zip(&p[..nc]).zip(&*scales) {
                *w = p * (scale * unit);
            }
        }
        let acc = &mut self.acc_rows[..nr * d_v];
        let alphas = first_alphas(&self.alpha[..nr]);
        let ahead = vq.codes.runs().skip(look_ahead_rows(vq.codes.run(0)));
        stream(vq.codes.runs(), ahead, next, |first, run, next| {
            let accs = (&mut *acc, alphas(first));
            kernels.accumulate_codes(vq.kind, accs, (&weights[first..], bc), run, next);
        });
    }

    /// `acc_r = alpha_r·acc_r + Σ_j p_r[j]·v[j]` over the block's values `values` (in place
    /// when this CPU's kernels read them, prefetching `next`; else copied rows).
    fn accumulate_block<U: Element>(
        &mut self,
        kernels: Option<RowKernels>,
        values: MatRef<'_, U>,
        next: Option<MatRef<'_, U>>,
        (nr, nc, d_v): (usize, usize, usize),
    ) {
        let bc = self.plan.bc;
        if let Some(kernels) = kernels.filter(|k| k.reads(values)) {
            let accs = (&mut self.acc_rows[..nr * d_v], &self.alpha[..nr]);
            let next = next.unwrap_or(values.subrows(0, 0));
            kernels.accumulate(accs, (&self.s, bc), values, next);
            return;
        }
        let mut v: [&[f32]; KEY_TILE] = [&[]; KEY_TILE];
        row_slices(values, 0..nc, &mut self.v_wide, &mut v);
        for i in 0..nr {
            let p = &self.s[i * bc..i * bc + nc];
            let acc = &mut self.acc_rows[i * d_v..(i + 1) * d_v];
            accumulate(acc, self.alpha[i], p, &v[..nc]);
        }
    }
}

/// Every run of `src` ([`KeySource::run_at`]), `(first row, rows)`, in order; none when the
/// source cannot lend its rows in place.
fn runs<'s, T: Element, K: KeySource<T>>(
    src: &'s K,
) -> impl Iterator<Item = (usize, MatRef<'s, T>)> + 's {
    let mut j = 0;
    core::iter::from_fn(move || {
        let run = src.run_at(j)?;
        let first = j;
        j += run.nrows();
        Some((first, run))
    })
}

/// Streams a source's `runs` (`(first row, rows)`, in order) through `f(first, run, next)`,
/// `next` the run after it (`tail` after the last: what is read next), each run's
/// prefetches reaching into the next, and the runs of `ahead` (the same runs, some way on)
/// asked into the caches one a run.
fn stream<'r, U: 'r>(
    runs: impl Iterator<Item = (usize, MatRef<'r, U>)>,
    mut ahead: impl Iterator<Item = (usize, MatRef<'r, U>)>,
    tail: Option<MatRef<'r, U>>,
    mut f: impl FnMut(usize, MatRef<'r, U>, MatRef<'r, U>),
) {
    let mut runs = runs.peekable();
    while let Some((first, run)) = runs.next() {
        if let Some((_, far)) = ahead.next() {
            prefetch(far);
        }
        let next = runs.peek().map(|&(_, r)| r).or(tail);
        f(first, run, next.unwrap_or(run.subrows(0, 0)));
    }
}

/// The rescaling of the accumulators by a block's run starting at row `first`: what the
/// softmax asked of the block (`alpha`) for its first run, nothing (1, exactly) after.
fn first_alphas<'a>(alpha: &'a [f32]) -> impl Fn(usize) -> &'a [f32] + 'a {
    const ONES: [f32; DECODE_ROWS] = [1.0; DECODE_ROWS];
    move |first| {
        if first == 0 {
            alpha
        } else {
            &ONES[..alpha.len()]
        }
    }
}

/// How many runs ahead of the kernels to prefetch a source's runs: enough to be
/// [`RUN_PREFETCH_BYTES`] ahead, at least two (the kernels' own prefetches cover the next);
/// none for a source whose first run is the whole block.
fn look_ahead<T: Element, K: KeySource<T>>(src: &K) -> usize {
    look_ahead_rows(src.run_at(0))
}

/// [`look_ahead`] of a source whose first run is `first`.
fn look_ahead_rows<U>(first: Option<MatRef<'_, U>>) -> usize {
    first.map_or(usize::MAX, |run| {
        let bytes = run.nrows() * run.ncols() * core::mem::size_of::<U>();
        RUN_PREFETCH_BYTES.div_ceil(bytes.max(1)).max(2)
    })
}

/// Whether `kernels` read the codes of a quantized source in place (`false` for other
/// sources).
fn reads_codes<T: Element, K: KeySource<T>>(kernels: &RowKernels, src: &K) -> bool {
    // One row speaks for the layout (a run of the whole source would walk its pages).
    let first = src.block(0..src.len().min(1));
    first
        .quantized()
        .and_then(|q| q.codes.run(0))
        .is_some_and(|r| kernels.reads(r))
}

/// The rows of `src` as f32 slices for the portable kernels: in place for dense f32 rows
/// that are contiguous, else widened into `wide`.
fn f32_row_slices<'b, T: Element, K: KeySource<T>>(
    src: &'b K,
    wide: &'b mut [f32],
    out: &mut [&'b [f32]],
) {
    match src.in_place() {
        Some(m) => row_slices(m, 0..m.nrows(), wide, out),
        None => {
            let m = src.to_f32(wide);
            for (slot, j) in out.iter_mut().zip(0..m.nrows()) {
                *slot = m.row(j).try_as_row_major().map_or(&[], |r| r.as_slice());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;

    use super::*;

    /// The row kernels the engine uses instead of the best ones, while a test holds it (every
    /// choice computes the same attention, so other tests running meanwhile still pass).
    static FORCED: Mutex<Option<Option<RowKernels>>> = Mutex::new(None);

    pub(super) fn forced() -> Option<Option<RowKernels>> {
        *FORCED.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Whole decoding calls (masks, non-finite values at hidden keys, split-KV, stacked GQA
    /// heads, every storage type) through each kernels this CPU has and through the
    /// copying kernels: the same attention within f32 rounding.
    #[test]
    fn every_kernels_computes_the_same_attention() {
        use crate::{BoolMask, Causal, Layout, Options, Tensor4Ref};
        use half::{bf16, f16};
        fn run<T: Element>(choice: Option<RowKernels>) -> Vec<Vec<f32>> {
            let (b, hq, hkv, n_k) = (2, 4, 2, 2500);
            let mut out = Vec::new();
            for (n_q, d) in [(1, 64), (3, 128), (1, 40), (2, 48)] {
                let data = |len: usize, seed: usize| -> Vec<T> {
                    (0..len)
                        .map(|x| {
                            T::from_f32((((x * 7 + seed) * 2654435761) % 1000) as f32 / 500.0 - 1.0)
                        })
                        .collect()
                };
                let (qd, kd) = (data(b * hq * n_q * d, 1), data(b * hkv * n_k * d, 2));
                let mut vd = data(b * hkv * n_k * d, 3);
                vd[5 * d] = T::from_f32(f32::NAN); // key 5 of the first head (hidden by the bool mask)
                let q = Tensor4Ref::from_layout(&qd, [b, hq, n_q, d], Layout::Bshd).unwrap();
                let k = Tensor4Ref::from_layout(&kd, [b, hkv, n_k, d], Layout::Bhsd).unwrap();
                let v = Tensor4Ref::from_layout(&vd, [b, hkv, n_k, d], Layout::Bhsd).unwrap();
                let hide = faer::Mat::<bool>::from_fn(n_q, n_k, |_, j| j % 5 == 0);
                let lens = [n_k, 1700];
                let cases = [
                    Options::default(),
                    Options::default()
                        .with_causal(Causal::BottomRight)
                        .with_key_lengths(&lens),
                    Options::default().with_bool_mask(BoolMask::block(hide.as_ref())),
                ];
                for opts in &cases {
                    *FORCED.lock().unwrap_or_else(|e| e.into_inner()) = Some(choice);
                    let o = crate::Attention::batched(q, k, v, opts)
                        .and_then(|call| call.forward(crate::Par::rayon(0)))
                        .map(|f| f.into_output());
                    *FORCED.lock().unwrap_or_else(|e| e.into_inner()) = None;
                    out.push(o.unwrap().as_slice().iter().map(|x| x.to_f32()).collect());
                }
            }
            out
        }
        fn compare<T: Element>() {
            let copying = run::<T>(None);
            for (case, o) in copying.iter().enumerate() {
                // The NaN is seen without a mask and hidden by the boolean mask.
                let nan = o.iter().any(|x| x.is_nan());
                assert!(nan == (case % 3 == 0) || case % 3 == 1, "case {case}");
            }
            for kernels in RowKernels::all() {
                for (case, (a, b)) in run::<T>(Some(kernels)).iter().zip(&copying).enumerate() {
                    for (x, y) in a.iter().zip(b) {
                        // The NaN at key 5 reaches the rows that see key 5, in every kernel.
                        assert_eq!(x.is_nan(), y.is_nan(), "{kernels:?} case {case}");
                        if x.is_nan() {
                            continue;
                        }
                        let tol = if T::WIDENS { 1e-2 } else { 1e-5 };
                        assert!(
                            (x - y).abs() <= tol,
                            "{kernels:?} {} case {case}: {x} vs {y}",
                            T::NAME
                        );
                    }
                }
            }
        }
        compare::<f32>();
        compare::<f16>();
        compare::<bf16>();
    }
}

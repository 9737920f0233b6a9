//! Kernels for tiles of very few queries (decoding: one new token per head).
//!
//! With one query the score "tile" is a single row and a GEMM degenerates into a
//! matrix-vector product that is bound by reading K and V from memory. These kernels keep
//! that loop streaming: one dot product per key, the online softmax along the row
//! (vectorised across keys), and `acc += p_j · v_j` across the value width.

use faer::MatRef;
use pulp::{Arch, Simd, WithSimd};

use crate::element::Element;
use crate::exp::{exp2_approx, multiversion};
use crate::online_softmax::LAZY_RESCALE_LOG2;

#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx512;
#[cfg(target_arch = "x86_64")]
mod rows;

/// An instruction set with in-place row kernels: they read K and V where they live,
/// widening half types in registers. Without one (other CPUs), the row kernels copy each
/// block first ([`scores`], [`accumulate`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Streamer {
    /// AVX-512 (F, BW, VL, DQ) with AVX2 and FMA: 16 lanes.
    Avx512,
    /// AVX2 with FMA and F16C: 8 lanes.
    Avx2,
}

impl Streamer {
    /// The best one this CPU has.
    pub(crate) fn detect() -> Option<Self> {
        [Self::Avx512, Self::Avx2]
            .into_iter()
            .find(|s| s.on_this_cpu())
    }

    /// Every one this CPU has (for tests that compare them).
    #[cfg(test)]
    fn all() -> Vec<Self> {
        [Self::Avx512, Self::Avx2]
            .into_iter()
            .filter(|s| s.on_this_cpu())
            .collect()
    }

    /// Whether this CPU has the instructions the kernels are compiled with.
    fn on_this_cpu(self) -> bool {
        #[cfg(target_arch = "x86_64")]
        {
            use std::arch::is_x86_feature_detected as has;
            match self {
                Self::Avx512 => crate::exp::isa() == crate::exp::Isa::Avx512,
                Self::Avx2 => has!("avx2") && has!("fma") && has!("f16c"),
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        false
    }

    /// Whether the kernels read `m` in place: rows of unit column stride and a width of
    /// whole vectors.
    pub(crate) fn reads<T>(self, m: MatRef<'_, T>) -> bool {
        #[cfg(target_arch = "x86_64")]
        return rows::supports(
            m,
            match self {
                Self::Avx512 => 16,
                Self::Avx2 => 8,
            },
        );
        #[cfg(not(target_arch = "x86_64"))]
        {
            let _ = m;
            false
        }
    }

    /// `out[r·stride + j] = q_r · k[j]` straight from `k` (any element type) for the query
    /// rows `q_r`, consecutive `d_k`-float chunks of `qs` (at most [`DECODE_ROWS`]); each key
    /// is read from memory once for all of them. Prefetches on into `next`.
    ///
    /// # Panics
    /// Unless the CPU has the instructions, [`Streamer::reads`]`(k)`, and the lengths agree.
    pub(crate) fn scores<T: Element>(
        self,
        qs: &[f32],
        k: MatRef<'_, T>,
        next: MatRef<'_, T>,
        out: (&mut [f32], usize),
    ) {
        assert!(self.on_this_cpu() && self.reads(k));
        let q = (qs, qs.len() / k.ncols().max(1));
        match self {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: the CPU has AVX-512 F/BW/VL with AVX2 and FMA (checked above).
            Self::Avx512 => unsafe { avx512::scores(q, k, next, out) },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: the CPU has AVX2, FMA and F16C (checked above).
            Self::Avx2 => unsafe { avx2::scores(q, k, next, out) },
            #[cfg(not(target_arch = "x86_64"))]
            _ => unreachable!("no streamer exists off x86-64"),
        }
    }

    /// `acc_r = alpha_r·acc_r + Σ_j p_r[j] · v[j]` straight from `v` for the rows `acc_r`
    /// (consecutive `d_v`-float chunks of `accs`, one per entry of `alphas`, at most
    /// [`DECODE_ROWS`]) with `p_r` at `r·stride` of `ps`; each value row is read once for
    /// all of them. Prefetches on into `next`.
    ///
    /// # Panics
    /// Unless the CPU has the instructions, [`Streamer::reads`]`(v)`, and the lengths agree.
    pub(crate) fn accumulate<T: Element>(
        self,
        accs: (&mut [f32], &[f32]),
        ps: (&[f32], usize),
        v: MatRef<'_, T>,
        next: MatRef<'_, T>,
    ) {
        assert!(self.on_this_cpu() && self.reads(v));
        match self {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: the CPU has AVX-512 F/BW/VL with AVX2 and FMA (checked above).
            Self::Avx512 => unsafe { avx512::accumulate(accs, ps, v, next) },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: the CPU has AVX2, FMA and F16C (checked above).
            Self::Avx2 => unsafe { avx2::accumulate(accs, ps, v, next) },
            #[cfg(not(target_arch = "x86_64"))]
            _ => unreachable!("no streamer exists off x86-64"),
        }
    }
}

/// The streamer the row kernels use on this CPU, if any (looked up once per task; each
/// block then asks [`Streamer::reads`] of its K and V).
pub(crate) fn best_streamer() -> Option<Streamer> {
    #[cfg(test)]
    if let Some(forced) = tests::forced() {
        return forced;
    }
    Streamer::detect()
}

/// Tiles with at most this many queries use the row kernels instead of GEMM tiles.
pub const DECODE_ROWS: usize = 4;
#[cfg(target_arch = "x86_64")]
const _: () = assert!(DECODE_ROWS <= rows::MAX_ROWS);

const LANES: usize = 16;

/// Keys whose dot products run side by side: independent FMA chains hide the FMA
/// latency that a single running sum would wait on.
const KEYS_AT_ONCE: usize = 8;

struct Scores<'a> {
    q: &'a [f32],
    k: &'a [&'a [f32]],
    out: &'a mut [f32],
}

impl WithSimd for Scores<'_> {
    type Output = ();

    #[inline(always)]
    fn with_simd<S: Simd>(self, simd: S) {
        let d = self.q.len();
        let (qh, qt) = S::as_simd_f32s(self.q);
        let tail_dot = |row: &[f32]| -> f32 {
            qt.iter()
                .zip(&row[d - qt.len()..d])
                .map(|(x, y)| x * y)
                .sum()
        };
        let mut groups = self.k.chunks_exact(KEYS_AT_ONCE);
        let mut outs = self.out.chunks_exact_mut(KEYS_AT_ONCE);
        for (group, out) in (&mut groups).zip(&mut outs) {
            // A constant trip count keeps the eight accumulators in registers.
            let rows: [&[S::f32s]; KEYS_AT_ONCE] =
                core::array::from_fn(|r| S::as_simd_f32s(&group[r][..d]).0);
            let mut acc = [simd.splat_f32s(0.0); KEYS_AT_ONCE];
            for (c, &qc) in qh.iter().enumerate() {
                for r in 0..KEYS_AT_ONCE {
                    acc[r] = simd.mul_add_e_f32s(qc, rows[r][c], acc[r]);
                }
            }
            for r in 0..KEYS_AT_ONCE {
                out[r] = simd.reduce_sum_f32s(acc[r]) + tail_dot(group[r]);
            }
        }
        for (row, o) in groups.remainder().iter().zip(outs.into_remainder()) {
            let (rh, _) = S::as_simd_f32s(&row[..d]);
            let mut acc = simd.splat_f32s(0.0);
            for (&x, &y) in qh.iter().zip(rh) {
                acc = simd.mul_add_e_f32s(x, y, acc);
            }
            *o = simd.reduce_sum_f32s(acc) + tail_dot(row);
        }
    }
}

/// `out[j] = q · k[j]` for a block of key rows (read in place, wherever they live).
pub(crate) fn scores(q: &[f32], k: &[&[f32]], out: &mut [f32]) {
    Arch::new().dispatch(Scores { q, k, out });
}

#[inline(always)]
fn softmax_row_body<const FMA: bool>(s: &mut [f32], m: &mut f32, l: &mut f32) -> f32 {
    let mut block = [f32::NEG_INFINITY; LANES];
    let chunks = s.chunks_exact(LANES);
    for x in chunks.remainder() {
        block[0] = if *x > block[0] { *x } else { block[0] };
    }
    for c in chunks {
        for t in 0..LANES {
            block[t] = if c[t] > block[t] { c[t] } else { block[t] };
        }
    }
    let block = block
        .iter()
        .fold(f32::NEG_INFINITY, |a, &b| if b > a { b } else { a });
    let mut alpha = 1.0;
    if block > *m + LAZY_RESCALE_LOG2 {
        alpha = exp2_approx::<FMA>(*m - block);
        *m = block;
    }
    let m_safe = if *m == f32::NEG_INFINITY { 0.0 } else { *m };
    let mut sums = [0.0f32; LANES];
    let mut chunks = s.chunks_exact_mut(LANES);
    for c in &mut chunks {
        for t in 0..LANES {
            c[t] = exp2_approx::<FMA>(c[t] - m_safe);
            sums[t] += c[t];
        }
    }
    for (t, x) in chunks.into_remainder().iter_mut().enumerate() {
        *x = exp2_approx::<FMA>(*x - m_safe);
        sums[t] += *x;
    }
    *l = *l * alpha + sums.iter().sum::<f32>();
    alpha
}

multiversion! {
    /// The online-softmax step along one row of scores (log2 domain): updates the
    /// reference maximum `m` lazily and the sum `l`, replaces the scores by `2^(s − m)`,
    /// and returns the factor the row's accumulator must be scaled by.
    pub(crate) fn softmax_row(s: &mut [f32], m: &mut f32, l: &mut f32) -> f32 = softmax_row_body
}

/// Value vectors held in registers while the rows of a block stream past.
const VECTORS_AT_ONCE: usize = 8;

struct Accumulate<'a> {
    acc: &'a mut [f32],
    alpha: f32,
    p: &'a [f32],
    v: &'a [&'a [f32]],
}

impl WithSimd for Accumulate<'_> {
    type Output = ();

    #[inline(always)]
    fn with_simd<S: Simd>(self, simd: S) {
        let Accumulate { acc, alpha, p, v } = self;
        let d = acc.len();
        if alpha != 1.0 {
            for a in acc.iter_mut() {
                *a *= alpha;
            }
        }
        let (head, tail) = S::as_mut_simd_f32s(acc);
        let head_len = head.len();
        // Blocks of 8 vectors live in registers while every row adds into them, so rows
        // do not wait on each other through memory (a constant trip count keeps them there).
        let mut blocks = head.chunks_exact_mut(VECTORS_AT_ONCE);
        for (b, regs_mem) in (&mut blocks).enumerate() {
            let mut regs: [S::f32s; VECTORS_AT_ONCE] = core::array::from_fn(|u| regs_mem[u]);
            for (&pj, row) in p.iter().zip(v) {
                let pj = simd.splat_f32s(pj);
                let row =
                    &S::as_simd_f32s(&row[..d]).0[b * VECTORS_AT_ONCE..(b + 1) * VECTORS_AT_ONCE];
                for u in 0..VECTORS_AT_ONCE {
                    regs[u] = simd.mul_add_e_f32s(pj, row[u], regs[u]);
                }
            }
            regs_mem.copy_from_slice(&regs);
        }
        let rest = blocks.into_remainder();
        let done = head_len - rest.len();
        for (u, reg_mem) in rest.iter_mut().enumerate() {
            let mut reg = *reg_mem;
            for (&pj, row) in p.iter().zip(v) {
                reg = simd.mul_add_e_f32s(
                    simd.splat_f32s(pj),
                    S::as_simd_f32s(&row[..d]).0[done + u],
                    reg,
                );
            }
            *reg_mem = reg;
        }
        let start = d - tail.len();
        for (&pj, row) in p.iter().zip(v) {
            for (a, &x) in tail.iter_mut().zip(&row[start..d]) {
                *a += pj * x;
            }
        }
    }
}

/// `acc = alpha·acc + Σ_j p_j · v[j]` over a block of value rows.
pub(crate) fn accumulate(acc: &mut [f32], alpha: f32, p: &[f32], v: &[&[f32]]) {
    Arch::new().dispatch(Accumulate { acc, alpha, p, v });
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;

    use super::*;

    /// The streamer the engine uses instead of the best one, while a test holds it (every
    /// choice computes the same attention, so other tests running meanwhile still pass).
    static FORCED: Mutex<Option<Option<Streamer>>> = Mutex::new(None);

    pub(super) fn forced() -> Option<Option<Streamer>> {
        *FORCED.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Whole decoding calls (masks, non-finite values at hidden keys, split-KV, stacked GQA
    /// heads, every storage type) through each streamer this CPU has and through the
    /// copying kernels: the same attention within f32 rounding.
    #[test]
    fn every_streamer_computes_the_same_attention() {
        use crate::{BoolMask, Causal, Layout, Options, Tensor4Ref, attention_batched};
        use half::{bf16, f16};
        fn run<T: Element>(choice: Option<Streamer>) -> Vec<Vec<f32>> {
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
                    let o = attention_batched(q, k, v, opts);
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
            for streamer in Streamer::all() {
                for (case, (a, b)) in run::<T>(Some(streamer)).iter().zip(&copying).enumerate() {
                    for (x, y) in a.iter().zip(b) {
                        // The NaN at key 5 reaches the rows that see key 5, in every kernel.
                        assert_eq!(x.is_nan(), y.is_nan(), "{streamer:?} case {case}");
                        if x.is_nan() {
                            continue;
                        }
                        let tol = if T::WIDENS { 1e-2 } else { 1e-5 };
                        assert!(
                            (x - y).abs() <= tol,
                            "{streamer:?} {} case {case}: {x} vs {y}",
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

    #[test]
    fn scores_are_dot_products() {
        let d = 37;
        let q: Vec<f32> = (0..d).map(|i| i as f32 * 0.1).collect();
        let k: Vec<f32> = (0..3 * d).map(|i| (i % 7) as f32 - 3.0).collect();
        let mut out = [0.0f32; 3];
        let rows: Vec<&[f32]> = k.chunks_exact(d).collect();
        scores(&q, &rows, &mut out);
        for j in 0..3 {
            let want: f32 = (0..d).map(|c| q[c] * k[j * d + c]).sum();
            assert!((out[j] - want).abs() < 1e-4, "{} vs {want}", out[j]);
        }
    }

    #[test]
    fn row_softmax_in_two_blocks_matches_one_pass() {
        let s: Vec<f32> = (0..40)
            .map(|j| ((j * 13) % 17) as f32 * 0.9 - 4.0)
            .collect();
        let v: Vec<f32> = (0..40).map(|j| j as f32).collect();
        let (mut m, mut l, mut acc) = (f32::NEG_INFINITY, 0.0f32, [0.0f32]);
        for block in [0..21, 21..40] {
            let mut p = s[block.clone()].to_vec();
            let alpha = softmax_row(&mut p, &mut m, &mut l);
            let rows: Vec<&[f32]> = v[block].chunks_exact(1).collect();
            accumulate(&mut acc, alpha, &p, &rows);
        }
        let mx = s.iter().cloned().fold(f32::NEG_INFINITY, f32::max) as f64;
        let w: Vec<f64> = s.iter().map(|&x| (x as f64 - mx).exp2()).collect();
        let want =
            w.iter().zip(&v).map(|(w, v)| w * *v as f64).sum::<f64>() / w.iter().sum::<f64>();
        assert!((acc[0] as f64 / l as f64 - want).abs() < 1e-4);
    }

    /// The in-place kernels of every instruction set this CPU has against plain sums, for
    /// every storage type, widths of one to seventeen 16-lane vectors (and odd numbers of
    /// 8-lane ones), key counts off the group size, strided rows, one to four rows.
    fn streaming_matches_plain_sums<T: Element>() {
        // Without a streamer the copying kernels run (tested above).
        for streamer in Streamer::all() {
            streaming_matches_plain_sums_with::<T>(streamer);
        }
    }

    fn streaming_matches_plain_sums_with<T: Element>(streamer: Streamer) {
        let shapes = [
            (1, 16, 16),
            (13, 48, 48),
            (29, 128, 160),
            (8, 272, 272),
            (11, 40, 40),
        ];
        for (n, d, stride) in shapes {
            let data: Vec<T> = (0..n * stride + d)
                .map(|x| T::from_f32(((x * 37) % 23) as f32 / 8.0 - 1.4))
                .collect();
            let forward = MatRef::from_row_major_slice_with_stride(&data, n, d, stride);
            if !streamer.reads(forward) {
                continue;
            }
            let broadcast = MatRef::from_row_major_slice_with_stride(&data, n, d, 0);
            let next = MatRef::from_row_major_slice(&data[..d], 1, d);
            for (m, nr) in [forward, forward.reverse_rows(), broadcast]
                .into_iter()
                .flat_map(|m| (1..=DECODE_ROWS).map(move |nr| (m, nr)))
            {
                let wide = |j: usize, c: usize| m[(j, c)].to_f32() as f64;
                let what = format!(
                    "{streamer:?} {} d={d} rows={nr} row stride {}",
                    T::NAME,
                    m.row_stride()
                );
                let qs: Vec<f32> = (0..nr * d).map(|c| (c % 5) as f32 * 0.3 - 0.5).collect();
                let out_stride = n + 3;
                let mut out = vec![0.0f32; nr * out_stride];
                streamer.scores(&qs, m, next, (&mut out, out_stride));
                for r in 0..nr {
                    for j in 0..n {
                        let q = &qs[r * d..(r + 1) * d];
                        let want: f64 = (0..d).map(|c| q[c] as f64 * wide(j, c)).sum();
                        let got = out[r * out_stride + j] as f64;
                        assert!((got - want).abs() < 1e-4, "{what} r={r} j={j}");
                    }
                }
                let ps: Vec<f32> = (0..nr * out_stride)
                    .map(|j| (j % 3) as f32 * 0.25)
                    .collect();
                let mut accs: Vec<f32> = (0..nr * d).map(|c| c as f32).collect();
                let alphas: Vec<f32> = (0..nr).map(|r| 0.5 + r as f32).collect();
                streamer.accumulate((&mut accs, &alphas), (&ps, out_stride), m, next);
                for r in 0..nr {
                    for c in 0..d {
                        let p = |j: usize| ps[r * out_stride + j] as f64;
                        let want = alphas[r] as f64 * (r * d + c) as f64
                            + (0..n).map(|j| p(j) * wide(j, c)).sum::<f64>();
                        let got = accs[r * d + c] as f64;
                        assert!((got - want).abs() < 1e-3, "{what} r={r} c={c}");
                    }
                }
            }
        }
    }

    #[test]
    fn streaming_kernels_match_plain_sums() {
        streaming_matches_plain_sums::<f32>();
        streaming_matches_plain_sums::<half::f16>();
        streaming_matches_plain_sums::<half::bf16>();
    }

    #[test]
    fn hidden_row_stays_empty() {
        let mut p = vec![f32::NEG_INFINITY; 20];
        let (mut m, mut l) = (f32::NEG_INFINITY, 0.0);
        softmax_row(&mut p, &mut m, &mut l);
        assert_eq!(l, 0.0);
        assert!(p.iter().all(|&x| x == 0.0));
    }
}

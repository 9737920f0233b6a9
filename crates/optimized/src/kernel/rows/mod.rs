//! The row kernels: tiles of very few queries (decoding: one new token per head).
//!
//! With one query the score "tile" is a single row and a GEMM degenerates into a
//! matrix-vector product that is bound by reading K and V from memory. These kernels keep
//! that loop streaming: one dot product per key ([`RowKernels::scores`]), and
//! `acc += p_j · v_j` across the value width ([`RowKernels::accumulate`]); the softmax
//! along the row between them is [`super::online_softmax::softmax_row`].
//!
//! Two families: the in-place kernels of an instruction set ([`RowKernels`], written once
//! in [`kernels`] and compiled in `avx512.rs` and `avx2.rs`) read K and V where they live,
//! widening half types in registers; the portable copying kernels ([`scores`],
//! [`accumulate`]) read rows that the caller copied (or widened) into f32 first, for CPUs
//! and layouts the in-place ones do not take.

use attn_core::{Dtype, KvCodes};
use faer::MatRef;
use pulp::{Simd, WithSimd};

use super::Isa;
use super::element::Element;

/// How the in-place kernels widen what they read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum RowKind {
    F32,
    F16,
    Bf16,
    /// Signed bytes ([`KvCodes::Int8`]).
    Int8,
    /// fp8 e4m3 bytes ([`KvCodes::Fp8E4m3`]), read as `2⁻⁸` of their values.
    Fp8,
}

/// What the in-place row kernels read: the element types, and the codes of quantized pages.
pub(crate) trait RowElement: Copy + 'static {
    const KIND: RowKind;
    /// Whether the kernels prefetch every row ahead of the loads, not only where the
    /// stream jumps: codes take about three instructions a vector to widen, so the
    /// out-of-order window alone keeps too few of their (denser) cache lines in flight.
    const PREFETCHES: bool = false;
    /// Bytes of rows the kernels prefetch ahead of their loads.
    const AHEAD_BYTES: usize = kernels::PREFETCH_BYTES;
}

impl<T: Element> RowElement for T {
    const KIND: RowKind = match T::DTYPE {
        Dtype::F32 => RowKind::F32,
        Dtype::F16 => RowKind::F16,
        Dtype::Bf16 => RowKind::Bf16,
    };
}

/// A byte of an int8 page, for the kernels (the same bits as the `u8` stored).
#[derive(Debug, Clone, Copy)]
#[repr(transparent)]
pub(crate) struct Int8Code(#[allow(dead_code)] u8);

/// A byte of an fp8 e4m3 page, for the kernels.
#[derive(Debug, Clone, Copy)]
#[repr(transparent)]
pub(crate) struct Fp8Code(#[allow(dead_code)] u8);

impl RowElement for Int8Code {
    const KIND: RowKind = RowKind::Int8;
    const PREFETCHES: bool = true;
    const AHEAD_BYTES: usize = CODES_AHEAD_BYTES;
}

impl RowElement for Fp8Code {
    const KIND: RowKind = RowKind::Fp8;
    const PREFETCHES: bool = true;
    const AHEAD_BYTES: usize = CODES_AHEAD_BYTES;
}

/// How far ahead the kernels prefetch codes.
const CODES_AHEAD_BYTES: usize = 16384;

/// What the kernels' widened codes must be multiplied by to be the codes' values: fp8
/// codes are read `2⁻⁸` of their value ([`RowKind::Fp8`]).
pub(crate) fn code_unit(codes: KvCodes) -> f32 {
    match codes {
        KvCodes::Fp8E4m3 => 256.0,
        _ => 1.0,
    }
}

/// The bytes of a quantized page as the codes `C` the kernels read.
fn as_codes<C: RowElement>(m: MatRef<'_, u8>) -> MatRef<'_, C> {
    // SAFETY: `C` is a `repr(transparent)` wrapper of `u8` (same size, alignment and valid
    // bits), and the view keeps its dims and strides, so it reads exactly the same bytes.
    unsafe {
        MatRef::from_raw_parts(
            m.as_ptr().cast::<C>(),
            m.nrows(),
            m.ncols(),
            m.row_stride(),
            m.col_stride(),
        )
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx512;
#[cfg(target_arch = "x86_64")]
mod kernels;

/// Rows the multi-row kernels take at once.
pub(crate) const MAX_ROWS: usize = 4;

/// How far ahead of the kernels the row tile asks for the runs of a source that lies in
/// many places (pages): the kernels' own prefetches reach one run ahead, which for pages of
/// a few kilobytes is too short to hide the memory's latency.
pub(crate) const RUN_PREFETCH_BYTES: usize = 32 * 1024;

/// Asks the CPU to bring the rows of `m` into its second-level cache (the row tile's
/// look-ahead across runs); changes nothing else, and does nothing off x86-64.
pub(crate) fn prefetch<T>(m: MatRef<'_, T>) {
    #[cfg(target_arch = "x86_64")]
    {
        let bytes = m.ncols() * core::mem::size_of::<T>();
        let stride = m.row_stride() * core::mem::size_of::<T>() as isize;
        let base = m.as_ptr().cast::<i8>();
        for j in 0..m.nrows() {
            let row = base.wrapping_offset(j as isize * stride);
            for off in (0..bytes).step_by(64) {
                // SAFETY: a prefetch is a hint that never faults, and the address is
                // computed with wrapping arithmetic, never dereferenced.
                unsafe {
                    core::arch::x86_64::_mm_prefetch::<{ core::arch::x86_64::_MM_HINT_T1 }>(
                        row.wrapping_add(off),
                    )
                };
            }
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = m;
}

/// Keys whose dot products run side by side: independent FMA chains hide the FMA
/// latency that a single running sum would wait on (both families).
pub(crate) const KEYS_AT_ONCE: usize = 8;

/// The in-place row kernels of an instruction set: they read K and V where they live,
/// widening half types in registers. Without them (other CPUs), the row tiles copy each
/// block first and use the portable [`scores`] and [`accumulate`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum RowKernels {
    /// AVX-512 (F, BW, VL, DQ) with AVX2 and FMA: 16 lanes.
    Avx512,
    /// AVX2 with FMA and F16C: 8 lanes.
    Avx2,
}

impl RowKernels {
    /// The kernels of [`Isa::current`], if it has any.
    pub(crate) fn for_this_cpu() -> Option<Self> {
        Self::of(Isa::current())
    }

    fn of(isa: Isa) -> Option<Self> {
        match isa.vectors() {
            Isa::Avx512 => Some(Self::Avx512),
            Isa::Avx2 => Some(Self::Avx2),
            _ => None,
        }
    }

    /// Every kernel family this CPU can run (for tests that compare them).
    #[cfg(test)]
    pub(crate) fn all() -> Vec<Self> {
        Isa::supported()
            .into_iter()
            .filter(|isa| Isa::current().includes(*isa))
            .filter_map(Self::of)
            .fold(Vec::new(), |mut all, k| {
                if !all.contains(&k) {
                    all.push(k);
                }
                all
            })
    }

    /// Whether this CPU has the instructions the kernels are compiled with.
    fn on_this_cpu(self) -> bool {
        let needs = match self {
            Self::Avx512 => Isa::Avx512,
            Self::Avx2 => Isa::Avx2,
        };
        cfg!(target_arch = "x86_64") && Isa::current().includes(needs)
    }

    /// Whether the kernels read `m` in place: rows of unit column stride and a width of
    /// whole vectors.
    pub(crate) fn reads<T>(self, m: MatRef<'_, T>) -> bool {
        #[cfg(target_arch = "x86_64")]
        return kernels::supports(
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
    /// rows `q_r`, consecutive `d_k`-float chunks of `qs` (at most [`MAX_ROWS`]); each key
    /// is read from memory once for all of them. Prefetches on into `next`.
    ///
    /// # Panics
    /// Unless the CPU has the instructions, [`RowKernels::reads`]`(k)`, and the lengths agree.
    pub(crate) fn scores<T: RowElement>(
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
            _ => unreachable!("no in-place row kernels exist off x86-64"),
        }
    }

    /// `acc_r = alpha_r·acc_r + Σ_j p_r[j] · v[j]` straight from `v` for the rows `acc_r`
    /// (consecutive `d_v`-float chunks of `accs`, one per entry of `alphas`, at most
    /// [`MAX_ROWS`]) with `p_r` at `r·stride` of `ps`; each value row is read once for
    /// all of them. Prefetches on into `next`.
    ///
    /// # Panics
    /// Unless the CPU has the instructions, [`RowKernels::reads`]`(v)`, and the lengths agree.
    pub(crate) fn accumulate<T: RowElement>(
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
            _ => unreachable!("no in-place row kernels exist off x86-64"),
        }
    }

    /// [`RowKernels::scores`] of quantized rows: `out[r·stride + j] = q_r · value(k[j]) /`
    /// [`code_unit`] for the code bytes `k` of `codes` (their scales are the caller's).
    ///
    /// # Panics
    /// As [`RowKernels::scores`].
    pub(crate) fn scores_of_codes(
        self,
        codes: KvCodes,
        qs: &[f32],
        k: MatRef<'_, u8>,
        next: MatRef<'_, u8>,
        out: (&mut [f32], usize),
    ) {
        match codes {
            KvCodes::Fp8E4m3 => self.scores::<Fp8Code>(qs, as_codes(k), as_codes(next), out),
            _ => self.scores::<Int8Code>(qs, as_codes(k), as_codes(next), out),
        }
    }

    /// [`RowKernels::accumulate`] of quantized value rows: `Σ_j p_r[j] · value(v[j]) /`
    /// [`code_unit`] (the weights carry the rows' scales).
    ///
    /// # Panics
    /// As [`RowKernels::accumulate`].
    pub(crate) fn accumulate_codes(
        self,
        codes: KvCodes,
        accs: (&mut [f32], &[f32]),
        ps: (&[f32], usize),
        v: MatRef<'_, u8>,
        next: MatRef<'_, u8>,
    ) {
        match codes {
            KvCodes::Fp8E4m3 => self.accumulate::<Fp8Code>(accs, ps, as_codes(v), as_codes(next)),
            _ => self.accumulate::<Int8Code>(accs, ps, as_codes(v), as_codes(next)),
        }
    }
}

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
    super::vectorize(Scores { q, k, out });
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
    super::vectorize(Accumulate { acc, alpha, p, v });
}

#[cfg(test)]
mod tests {
    use super::super::online_softmax::softmax_row;
    use super::*;

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
            let alpha = softmax_row(&mut p, &mut m, &mut l, false);
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
        // Without in-place kernels the copying ones run (tested above).
        for kernels in RowKernels::all() {
            streaming_matches_plain_sums_with::<T>(kernels);
        }
    }

    fn streaming_matches_plain_sums_with<T: Element>(kernels: RowKernels) {
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
            if !kernels.reads(forward) {
                continue;
            }
            let broadcast = MatRef::from_row_major_slice_with_stride(&data, n, d, 0);
            let next = MatRef::from_row_major_slice(&data[..d], 1, d);
            for (m, nr) in [forward, forward.reverse_rows(), broadcast]
                .into_iter()
                .flat_map(|m| (1..=MAX_ROWS).map(move |nr| (m, nr)))
            {
                let wide = |j: usize, c: usize| m[(j, c)].to_f32() as f64;
                let what = format!(
                    "{kernels:?} {} d={d} rows={nr} row stride {}",
                    T::NAME,
                    m.row_stride()
                );
                let qs: Vec<f32> = (0..nr * d).map(|c| (c % 5) as f32 * 0.3 - 0.5).collect();
                let out_stride = n + 3;
                let mut out = vec![0.0f32; nr * out_stride];
                kernels.scores(&qs, m, next, (&mut out, out_stride));
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
                kernels.accumulate((&mut accs, &alphas), (&ps, out_stride), m, next);
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
}

#[cfg(test)]
mod code_tests {
    use super::*;

    /// Every code of every format through the kernels of every instruction set this CPU
    /// has: a row of the 256 codes against one-hot queries reads back each code's value
    /// (over [`code_unit`]), and accumulating it with a weight of one writes it. (fp8's two
    /// NaN codes, which no quantizer writes, read as ±480.)
    #[test]
    fn kernels_read_every_code() {
        let d = 256;
        let codes: Vec<u8> = (0..=255).collect();
        let k = MatRef::from_row_major_slice(&codes, 1, d);
        for kernels in RowKernels::all() {
            for kind in [KvCodes::Int8, KvCodes::Fp8E4m3] {
                let want = |c: usize| kind.value(codes[c]) / code_unit(kind);
                for c in (0..d).filter(|&c| kind.value(codes[c]).is_finite()) {
                    let mut q = vec![0.0f32; d];
                    q[c] = 1.0;
                    let mut out = [0.0f32; 1];
                    kernels.scores_of_codes(kind, &q, k, k.subrows(0, 0), (&mut out, 1));
                    assert_eq!(out[0], want(c), "{kernels:?} {kind:?} code {c:#x}");
                }
                let mut acc = vec![0.0f32; d];
                kernels.accumulate_codes(kind, (&mut acc, &[1.0]), (&[1.0], 1), k, k.subrows(0, 0));
                for (c, &a) in acc.iter().enumerate() {
                    let nan_code = if c >= 0x80 { -480.0 } else { 480.0 } / code_unit(kind);
                    let w = Some(want(c)).filter(|w| !w.is_nan()).unwrap_or(nan_code);
                    assert_eq!(a, w, "{kernels:?} {kind:?} {c:#x}");
                }
            }
        }
    }
}

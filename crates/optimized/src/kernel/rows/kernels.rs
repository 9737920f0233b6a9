//! The in-place row kernels, written once as `row_kernels!` and compiled per instruction
//! set (`avx512.rs`, `avx2.rs`): K and V are read straight from where they live (no copy),
//! widened in registers (f16 by `vcvtph2ps`, bf16 by a 16-bit shift).
//!
//! Their speed is how many cache misses they keep in flight, and that is bounded by how
//! far the out-of-order window reaches past the oldest miss: a count of instructions. So
//! the loops spend about one instruction per vector of elements read (Q in registers, fused
//! load-FMAs, one shuffle tree for eight sums), and the hardware prefetcher then follows
//! both passes by itself (software prefetches on every line cost more instructions than
//! they save; `docs/algorithm.md` §4 has the measurements). Software prefetches remain only where the stream jumps: the last rows of a block
//! prefetch the first rows read next (V after K, the next K after V), and a block starts
//! by prefetching its own first rows (a task's first block was read by nobody before).

use core::arch::x86_64::{_MM_HINT_T0, _mm_prefetch};

use faer::MatRef;

/// Bytes of rows prefetched ahead of the loads where the stream jumps.
pub(super) const PREFETCH_BYTES: usize = 4096;

/// Whether the kernels with `lanes` f32 lanes can read `m`: rows of unit column stride, a
/// width of whole vectors.
pub(super) fn supports<T>(m: MatRef<'_, T>, lanes: usize) -> bool {
    m.ncols() > 0 && m.ncols().is_multiple_of(lanes) && m.col_stride() == 1
}

/// Whether `rows` rows of `n` floats, `stride` apart, fit in `len` (without overflow).
pub(super) fn fits(len: usize, rows: usize, stride: usize, n: usize) -> bool {
    rows.checked_sub(1)
        .and_then(|r| r.checked_mul(stride))
        .and_then(|x| x.checked_add(n))
        .is_some_and(|end| end <= len)
}

/// Rows of a matrix as a base pointer and a stride, for loads and prefetches.
#[derive(Clone, Copy)]
pub(super) struct Rows<T> {
    pub(super) ptr: *const T,
    pub(super) stride: isize,
    pub(super) n: usize,
    pub(super) bytes: usize,
}

impl<T> Rows<T> {
    pub(super) fn of(m: MatRef<'_, T>) -> Self {
        Self {
            ptr: m.as_ptr(),
            stride: m.row_stride(),
            n: m.nrows(),
            bytes: m.ncols() * size_of::<T>(),
        }
    }

    /// Start of row `j` (computed with wrapping arithmetic: it is only dereferenced for
    /// `j < n`).
    #[inline(always)]
    pub(super) fn row(&self, j: usize) -> *const T {
        self.ptr.wrapping_offset(j as isize * self.stride)
    }
}

/// Prefetches row `j` of the stream `rows` then `next` into L1 (nothing past both).
#[inline(always)]
pub(super) fn prefetch_row<T>(rows: &Rows<T>, next: &Rows<T>, j: usize) {
    let (r, j) = if j < rows.n {
        (rows, j)
    } else if j - rows.n < next.n {
        (next, j - rows.n)
    } else {
        return;
    };
    let p = r.row(j).cast::<i8>();
    let mut off = 0;
    while off < r.bytes {
        // SAFETY: a prefetch is a hint that never faults, whatever the address.
        unsafe { _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(off)) };
        off += 64;
    }
}

/// What one pass of [`accumulate`] reads, and the first column it covers.
#[derive(Clone, Copy)]
pub(super) struct PassArgs<'a, T> {
    pub(super) alphas: &'a [f32],
    pub(super) ps: &'a [f32],
    pub(super) stride: usize,
    pub(super) v: MatRef<'a, T>,
    pub(super) next: MatRef<'a, T>,
    pub(super) c0: usize,
}

/// The arguments of [`scores`]: query rows and their count, K, the rows read next, and
/// the output rows with their stride.
pub(super) type ScoreArgs<'a, 'o, T> = (
    (&'a [f32], usize),
    MatRef<'a, T>,
    MatRef<'a, T>,
    (&'o mut [f32], usize),
);

/// Defines `scores` and `accumulate` (and their helpers) in the invoking module, compiled
/// with `features` for `lanes`-wide `vector`s: the intrinsics are passed in by name, so the
/// expansion is plain `#[target_feature]` code, as if written for that instruction set.
/// `load` widens `lanes` elements of any storage type, `sums_of_8` reduces eight vectors
/// to the 8 floats of a `__m256`.
macro_rules! row_kernels {
    (
        features: $features:literal,
        lanes: $lanes:literal,
        many_registers: $many_registers:literal,
        vector: $vector:ty,
        zero: $zero:ident,
        splat: $splat:ident,
        mul: $mul:ident,
        mul_add: $mul_add:ident,
        load_f32: $load_f32:ident,
        store_f32: $store_f32:ident,
        sum: $sum:ident,
        load: $load:ident,
        sums_of_8: $sums_of_8:ident $(,)?
    ) => {
        /// `out[r·stride + j] = q_r · k[j]` for the `nr` query rows `q_r` (consecutive `d`-float
        /// chunks of `qs`) and every row of `k`, prefetching on into `next`. Each group of eight
        /// keys is read from memory once, for the first query row; the others find it in L1.
        ///
        /// # Panics
        /// If `k` is not [`supports`]ed or the lengths disagree (the callers check both).
        #[target_feature(enable = $features)]
        pub(super) fn scores<T: RowElement>(
            (qs, nr): (&[f32], usize),
            k: MatRef<'_, T>,
            next: MatRef<'_, T>,
            (out, stride): (&mut [f32], usize),
        ) {
            let (n, d) = (k.nrows(), k.ncols());
            assert!(supports(k, $lanes) && nr > 0 && qs.len() == nr * d);
            assert!(n <= stride && fits(out.len(), nr, stride, n));
            // Q in registers (up to 16 vectors) keeps the loop at one fused load-FMA per vector
            // of K: the fewer instructions per byte, the further ahead of the oldest
            // cache miss the out-of-order window reaches, and the more misses are in flight.
            let args = ((qs, nr), k, next, (&mut *out, stride));
            match d / $lanes {
                1 => scores_q_in_registers::<T, 1>(args),
                2 => scores_q_in_registers::<T, 2>(args),
                3 => scores_q_in_registers::<T, 3>(args),
                4 => scores_q_in_registers::<T, 4>(args),
                5 => scores_q_in_registers::<T, 5>(args),
                6 => scores_q_in_registers::<T, 6>(args),
                7 => scores_q_in_registers::<T, 7>(args),
                8 => scores_q_in_registers::<T, 8>(args),
                9 => scores_q_in_registers::<T, 9>(args),
                10 => scores_q_in_registers::<T, 10>(args),
                11 => scores_q_in_registers::<T, 11>(args),
                12 => scores_q_in_registers::<T, 12>(args),
                13 => scores_q_in_registers::<T, 13>(args),
                14 => scores_q_in_registers::<T, 14>(args),
                15 => scores_q_in_registers::<T, 15>(args),
                16 => scores_q_in_registers::<T, 16>(args),
                _ => {
                    for (r, q) in qs.chunks_exact(d).enumerate() {
                        scores_any_width(q, k, next, &mut out[r * stride..r * stride + n]);
                    }
                }
            }
        }

        /// [`scores`] for a width of `NV` vectors, each query row held in registers in turn (and
        /// for the whole call when there is one).
        #[inline]
        #[target_feature(enable = $features)]
        fn scores_q_in_registers<T: RowElement, const NV: usize>(
            ((qs, nr), k, next, (out, stride)): ScoreArgs<'_, '_, T>,
        ) {
            let n = k.nrows();
            assert!(k.ncols() == $lanes * NV && qs.len() == nr * $lanes * NV);
            assert!(nr > 0 && n <= stride && fits(out.len(), nr, stride, n));
            let (rows, next) = (Rows::of(k), Rows::of(next));
            let ahead = T::AHEAD_BYTES.div_ceil(rows.bytes);
            let load_q = |r: usize| -> [$vector; NV] {
                let mut qv = [$zero(); NV];
                for (c, x) in qv.iter_mut().enumerate() {
                    // SAFETY: qs holds nr rows of N·NV floats and r < nr.
                    *x = unsafe { $load_f32(qs.as_ptr().add((r * NV + c) * $lanes)) };
                }
                qv
            };
            let mut qv = load_q(0);
            // The first rows too: a task's first block was prefetched by nobody (or by another
            // core); for later blocks the previous V pass did it and these are cheap hits.
            for r in 0..ahead {
                prefetch_row(&rows, &next, r);
            }
            let mut j = 0;
            while j + KEYS_AT_ONCE <= n {
                for r in 0..KEYS_AT_ONCE {
                    if T::PREFETCHES || j + ahead + r >= n {
                        prefetch_row(&rows, &next, j + ahead + r);
                    }
                }
                for r in 0..nr {
                    if nr > 1 {
                        qv = load_q(r);
                    }
                    // Key by key, so the loads walk the memory in address order.
                    let mut acc = [$zero(); KEYS_AT_ONCE];
                    for (key, a) in acc.iter_mut().enumerate() {
                        let row = rows.row(j + key);
                        for (c, &qc) in qv.iter().enumerate() {
                            // SAFETY: row j + key < n has N·NV readable elements at unit stride.
                            *a = $mul_add(qc, unsafe { $load(row.add($lanes * c)) }, *a);
                        }
                    }
                    let sums = $sums_of_8(acc);
                    // SAFETY: output row r has n ≥ j + 8 elements from r·stride.
                    unsafe { _mm256_storeu_ps(out.as_mut_ptr().add(r * stride + j), sums) };
                }
                j += KEYS_AT_ONCE;
            }
            // The last keys (fewer than eight) summed by the same tree as a group's, the
            // missing ones as zeros: a key's score does not depend on where a run cut the
            // keys into groups (pages of any size, a window's first key anywhere).
            if j < n {
                for r in 0..nr {
                    let qv = load_q(r);
                    let mut acc = [$zero(); KEYS_AT_ONCE];
                    for (key, a) in acc.iter_mut().enumerate().take(n - j) {
                        let row = rows.row(j + key);
                        for (c, &qc) in qv.iter().enumerate() {
                            // SAFETY: row j + key < n has N·NV readable elements at unit
                            // stride.
                            *a = $mul_add(qc, unsafe { $load(row.add($lanes * c)) }, *a);
                        }
                    }
                    let mut sums = [0.0f32; KEYS_AT_ONCE];
                    // SAFETY: `sums` holds the 8 floats of a __m256.
                    unsafe { _mm256_storeu_ps(sums.as_mut_ptr(), $sums_of_8(acc)) };
                    out[r * stride + j..r * stride + n].copy_from_slice(&sums[..n - j]);
                }
            }
        }

        /// [`scores`] for any width (Q read from L1 for each vector).
        #[inline]
        #[target_feature(enable = $features)]
        fn scores_any_width<T: RowElement>(
            q: &[f32],
            k: MatRef<'_, T>,
            next: MatRef<'_, T>,
            out: &mut [f32],
        ) {
            let (rows, next) = (Rows::of(k), Rows::of(next));
            let ahead = T::AHEAD_BYTES.div_ceil(rows.bytes);
            for (j, o) in out.iter_mut().enumerate().take(k.nrows()) {
                prefetch_row(&rows, &next, j + ahead);
                // SAFETY: row j < n has d = q.len() readable elements at unit stride (`supports`).
                *o = $sum(unsafe { dot(q, rows.row(j)) });
            }
        }

        /// The lane-wise partial sums of `q · row`.
        ///
        /// # Safety
        /// `q.len()` (a multiple of the lanes) elements must be readable at `row`.
        #[inline]
        #[target_feature(enable = $features)]
        unsafe fn dot<T: RowElement>(q: &[f32], row: *const T) -> $vector {
            let mut acc = $zero();
            for (c, qc) in q.chunks_exact($lanes).enumerate() {
                // SAFETY: columns N·c .. N·c + N of the row are readable (caller), qc has N.
                unsafe {
                    let x = $load(row.add($lanes * c));
                    acc = $mul_add($load_f32(qc.as_ptr()), x, acc);
                }
            }
            acc
        }

        /// `acc_r = alpha_r·acc_r + Σ_j p_r[j] · v[j]` for the `nr = alphas.len()` (1 to 4) rows:
        /// `acc_r` are consecutive `d`-float chunks of `accs`, `p_r` starts at `r·stride` of `ps`.
        /// Each value row is read once for all of them. Prefetches on into `next`.
        ///
        /// # Panics
        /// If `v` is not [`supports`]ed or the lengths disagree (the callers check both).
        #[target_feature(enable = $features)]
        pub(super) fn accumulate<T: RowElement>(
            (accs, alphas): (&mut [f32], &[f32]),
            (ps, stride): (&[f32], usize),
            v: MatRef<'_, T>,
            next: MatRef<'_, T>,
        ) {
            let (n, d, nr) = (v.nrows(), v.ncols(), alphas.len());
            assert!(supports(v, $lanes) && (1..=MAX_ROWS).contains(&nr) && accs.len() == nr * d);
            assert!(n <= stride && fits(ps.len(), nr, stride, n));
            let mut c0 = 0;
            while c0 < d {
                // Constant widths keep the accumulators in registers (rows × width ≤ 18 of 32, ≤ 8
                // of 16);
                // the first pass over the rows prefetches for all of them.
                let left = (d - c0) / $lanes;
                let pass = PassArgs {
                    alphas,
                    ps,
                    stride,
                    v,
                    next,
                    c0,
                };
                c0 += $lanes
                    * match (nr, left) {
                        (1, 1) => accumulate_pass::<T, 1, 1>(accs, pass),
                        (1, 2) => accumulate_pass::<T, 1, 2>(accs, pass),
                        (1, 3) => accumulate_pass::<T, 1, 3>(accs, pass),
                        (1, 4) => accumulate_pass::<T, 1, 4>(accs, pass),
                        (1, 5) => accumulate_pass::<T, 1, 5>(accs, pass),
                        (1, 6) => accumulate_pass::<T, 1, 6>(accs, pass),
                        (1, 7) => accumulate_pass::<T, 1, 7>(accs, pass),
                        (1, _) => accumulate_pass::<T, 1, 8>(accs, pass),
                        (2, 8..) if $many_registers => accumulate_pass::<T, 2, 8>(accs, pass),
                        (2, 4..) => accumulate_pass::<T, 2, 4>(accs, pass),
                        (2, 2..) => accumulate_pass::<T, 2, 2>(accs, pass),
                        (2, _) => accumulate_pass::<T, 2, 1>(accs, pass),
                        (3, 6..) if $many_registers => accumulate_pass::<T, 3, 6>(accs, pass),
                        (3, 4..) if $many_registers => accumulate_pass::<T, 3, 4>(accs, pass),
                        (3, 2..) => accumulate_pass::<T, 3, 2>(accs, pass),
                        (3, _) => accumulate_pass::<T, 3, 1>(accs, pass),
                        (_, 4..) if $many_registers => accumulate_pass::<T, 4, 4>(accs, pass),
                        (_, 2..) => accumulate_pass::<T, 4, 2>(accs, pass),
                        (_, _) => accumulate_pass::<T, 4, 1>(accs, pass),
                    };
            }
        }

        /// One pass of [`accumulate`] over columns `c0 .. c0 + N·W` of every value row, for `R`
        /// accumulator rows; returns `W`.
        #[inline]
        #[target_feature(enable = $features)]
        fn accumulate_pass<T: RowElement, const R: usize, const W: usize>(
            accs: &mut [f32],
            PassArgs {
                alphas,
                ps,
                stride,
                v,
                next,
                c0,
            }: PassArgs<'_, T>,
        ) -> usize {
            let (n, d) = (v.nrows(), v.ncols());
            assert!(alphas.len() == R && accs.len() == R * d && c0 + $lanes * W <= d);
            assert!(n <= stride && fits(ps.len(), R, stride, n));
            let (rows, next) = (Rows::of(v), Rows::of(next));
            let ahead = T::AHEAD_BYTES.div_ceil(rows.bytes);
            let mut regs = [[$zero(); W]; R];
            for (r, row_regs) in regs.iter_mut().enumerate() {
                let alpha = $splat(alphas[r]);
                for (u, x) in row_regs.iter_mut().enumerate() {
                    // SAFETY: accumulator row r holds d ≥ c0 + N·W floats from r·d.
                    *x = $mul(alpha, unsafe {
                        $load_f32(accs.as_ptr().add(r * d + c0 + $lanes * u))
                    });
                }
            }
            for j in 0..n {
                if c0 == 0 && (T::PREFETCHES || j + ahead >= n) {
                    prefetch_row(&rows, &next, j + ahead);
                }
                let mut p = [$zero(); R];
                for (r, x) in p.iter_mut().enumerate() {
                    *x = $splat(ps[r * stride + j]);
                }
                let row = rows.row(j);
                for u in 0..W {
                    // SAFETY: row j < n has columns c0 .. c0 + N·W readable at unit stride.
                    let x = unsafe { $load(row.add(c0 + $lanes * u)) };
                    for (row_regs, &pr) in regs.iter_mut().zip(&p) {
                        row_regs[u] = $mul_add(pr, x, row_regs[u]);
                    }
                }
            }
            for (r, row_regs) in regs.iter().enumerate() {
                for (u, x) in row_regs.iter().enumerate() {
                    // SAFETY: accumulator row r holds d ≥ c0 + N·W floats from r·d.
                    unsafe { $store_f32(accs.as_mut_ptr().add(r * d + c0 + $lanes * u), *x) };
                }
            }
            W
        }
    };
}
pub(super) use row_kernels;

//! The row kernels for AVX-512 CPUs: K and V are read straight from where they live (no
//! copy), widened in registers (f16 by `vcvtph2ps`, bf16 by a 16-bit shift).
//!
//! Their speed is how many cache misses they keep in flight, and that is bounded by how
//! far the out-of-order window reaches past the oldest miss: a count of instructions. So
//! the loops spend about one instruction per 16 elements read (Q in registers, fused
//! load-FMAs, one shuffle tree for eight sums), and the hardware prefetcher then follows
//! both passes by itself (measured on Zen 4, one thread, d = 128: 0.94 of a plain sum's
//! rate; software prefetches on every line cost more instructions than they saved, 0.86).
//! Software prefetches remain only where the stream jumps: the last rows of a block
//! prefetch the first rows read next (V after K, the next K after V), and a block starts
//! by prefetching its own first rows (a task's first block was read by nobody before).

use core::arch::x86_64::*;

use faer::MatRef;

use crate::element::Element;
use crate::element::sealed::Storage;

/// Bytes of rows prefetched ahead of the loads where the stream jumps.
const PREFETCH_BYTES: usize = 4096;

/// Keys whose dot products run side by side (independent FMA chains).
const KEYS_AT_ONCE: usize = 8;

/// Whether the kernels can read `m`: rows of unit column stride, a width of whole vectors.
pub(super) fn supports<T>(m: MatRef<'_, T>) -> bool {
    m.ncols() > 0 && m.ncols() % 16 == 0 && m.col_stride() == 1
}

/// Whether `rows` rows of `n` floats, `stride` apart, fit in `len` (without overflow).
fn fits(len: usize, rows: usize, stride: usize, n: usize) -> bool {
    rows.checked_sub(1)
        .and_then(|r| r.checked_mul(stride))
        .and_then(|x| x.checked_add(n))
        .is_some_and(|end| end <= len)
}

/// Rows of a matrix as a base pointer and a stride, for loads and prefetches.
#[derive(Clone, Copy)]
struct Rows<T> {
    ptr: *const T,
    stride: isize,
    n: usize,
    bytes: usize,
}

impl<T> Rows<T> {
    fn of(m: MatRef<'_, T>) -> Self {
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
    fn row(&self, j: usize) -> *const T {
        self.ptr.wrapping_offset(j as isize * self.stride)
    }
}

/// Prefetches row `j` of the stream `rows` then `next` into L1 (nothing past both).
#[inline(always)]
fn prefetch_row<T>(rows: &Rows<T>, next: &Rows<T>, j: usize) {
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

/// Sixteen elements at `p`, as f32.
///
/// # Safety
/// Sixteen elements of `T` must be readable at `p`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
unsafe fn load16<T: Element>(p: *const T) -> __m512 {
    // SAFETY: the caller guarantees 16 readable elements; the loads are unaligned, and the
    // storage kind says how the bits are laid out.
    unsafe {
        match T::STORAGE {
            Storage::F32 => _mm512_loadu_ps(p.cast()),
            Storage::F16 => _mm512_cvtph_ps(_mm256_loadu_si256(p.cast())),
            Storage::Bf16 => _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(
                _mm256_loadu_si256(p.cast()),
            ))),
        }
    }
}

/// `out[r·stride + j] = q_r · k[j]` for the `nr` query rows `q_r` (consecutive `d`-float
/// chunks of `qs`) and every row of `k`, prefetching on into `next`. Each group of eight
/// keys is read from memory once, for the first query row; the others find it in L1.
///
/// # Panics
/// If `k` is not [`supports`]ed or the lengths disagree (the callers check both).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
pub(super) fn scores<T: Element>(
    (qs, nr): (&[f32], usize),
    k: MatRef<'_, T>,
    next: MatRef<'_, T>,
    (out, stride): (&mut [f32], usize),
) {
    let (n, d) = (k.nrows(), k.ncols());
    assert!(supports(k) && nr > 0 && qs.len() == nr * d);
    assert!(n <= stride && fits(out.len(), nr, stride, n));
    // Q in registers (up to 16 vectors, d ≤ 256) keeps the loop at one fused load-FMA per
    // 16 elements of K: the fewer instructions per byte, the further ahead of the oldest
    // cache miss the out-of-order window reaches, and the more misses are in flight.
    let args = ((qs, nr), k, next, (&mut *out, stride));
    match d / 16 {
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

/// The arguments of [`scores`]: query rows and their count, K, the rows read next, and
/// the output rows with their stride.
type ScoreArgs<'a, 'o, T> = (
    (&'a [f32], usize),
    MatRef<'a, T>,
    MatRef<'a, T>,
    (&'o mut [f32], usize),
);

/// [`scores`] for a width of `NV` vectors, each query row held in registers in turn (and
/// for the whole call when there is one).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
fn scores_q_in_registers<T: Element, const NV: usize>(
    ((qs, nr), k, next, (out, stride)): ScoreArgs<'_, '_, T>,
) {
    let n = k.nrows();
    assert!(k.ncols() == 16 * NV && qs.len() == nr * 16 * NV);
    assert!(nr > 0 && n <= stride && fits(out.len(), nr, stride, n));
    let (rows, next) = (Rows::of(k), Rows::of(next));
    let ahead = PREFETCH_BYTES.div_ceil(rows.bytes);
    let load_q = |r: usize| -> [__m512; NV] {
        let mut qv = [_mm512_setzero_ps(); NV];
        for (c, x) in qv.iter_mut().enumerate() {
            // SAFETY: qs holds nr rows of 16·NV floats and r < nr.
            *x = unsafe { _mm512_loadu_ps(qs.as_ptr().add((r * NV + c) * 16)) };
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
            if j + ahead + r >= n {
                prefetch_row(&rows, &next, j + ahead + r);
            }
        }
        for r in 0..nr {
            if nr > 1 {
                qv = load_q(r);
            }
            // Key by key, so the loads walk the memory in address order.
            let mut acc = [_mm512_setzero_ps(); KEYS_AT_ONCE];
            for (key, a) in acc.iter_mut().enumerate() {
                let row = rows.row(j + key);
                for (c, &qc) in qv.iter().enumerate() {
                    // SAFETY: row j + key < n has 16·NV readable elements at unit stride.
                    *a = _mm512_fmadd_ps(qc, unsafe { load16(row.add(16 * c)) }, *a);
                }
            }
            let sums = sum_lanes_of_8(acc);
            // SAFETY: output row r has n ≥ j + 8 elements from r·stride.
            unsafe { _mm256_storeu_ps(out.as_mut_ptr().add(r * stride + j), sums) };
        }
        j += KEYS_AT_ONCE;
    }
    for r in 0..nr {
        let qv = load_q(r);
        for key in j..n {
            let row = rows.row(key);
            let mut a = _mm512_setzero_ps();
            for (c, &qc) in qv.iter().enumerate() {
                // SAFETY: row key < n has 16·NV readable elements at unit stride.
                a = _mm512_fmadd_ps(qc, unsafe { load16(row.add(16 * c)) }, a);
            }
            out[r * stride + key] = _mm512_reduce_add_ps(a);
        }
    }
}

/// The horizontal sums of eight vectors, as one vector of eight: a shuffle tree of 25
/// instructions instead of eight separate reductions (about 64).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
fn sum_lanes_of_8(a: [__m512; 8]) -> __m256 {
    // 128-bit lanes L0..L3. Halves: [x(L0+L2), x(L1+L3), y(L0+L2), y(L1+L3)].
    let halves = |x, y| {
        _mm512_add_ps(
            _mm512_shuffle_f32x4::<0b01_00_01_00>(x, y),
            _mm512_shuffle_f32x4::<0b11_10_11_10>(x, y),
        )
    };
    // Quarters: one 128-bit lane of four partial sums per input of the two halves.
    let quarters = |x, y| {
        _mm512_add_ps(
            _mm512_shuffle_f32x4::<0b10_00_10_00>(x, y),
            _mm512_shuffle_f32x4::<0b11_01_11_01>(x, y),
        )
    };
    let w0 = quarters(halves(a[0], a[1]), halves(a[2], a[3]));
    let w1 = quarters(halves(a[4], a[5]), halves(a[6], a[7]));
    // Within each 128-bit lane L: pairs, then the element sums of key L and key 4 + L.
    let z = _mm512_add_ps(
        _mm512_shuffle_ps::<0b10_00_10_00>(w0, w1),
        _mm512_shuffle_ps::<0b11_01_11_01>(w0, w1),
    );
    let s = _mm512_add_ps(
        _mm512_shuffle_ps::<0b10_00_10_00>(z, z),
        _mm512_shuffle_ps::<0b11_01_11_01>(z, z),
    );
    // Element 4L holds key L, element 4L + 1 key 4 + L.
    let order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 0, 0, 0, 0, 0, 0, 0, 0);
    _mm512_castps512_ps256(_mm512_permutexvar_ps(order, s))
}

/// [`scores`] for any width (Q read from L1 for each vector).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
fn scores_any_width<T: Element>(q: &[f32], k: MatRef<'_, T>, next: MatRef<'_, T>, out: &mut [f32]) {
    let (rows, next) = (Rows::of(k), Rows::of(next));
    let ahead = PREFETCH_BYTES.div_ceil(rows.bytes);
    for (j, o) in out.iter_mut().enumerate().take(k.nrows()) {
        prefetch_row(&rows, &next, j + ahead);
        // SAFETY: row j < n has d = q.len() readable elements at unit stride (`supports`).
        *o = _mm512_reduce_add_ps(unsafe { dot(q, rows.row(j)) });
    }
}

/// The 16 lane-wise partial sums of `q · row`.
///
/// # Safety
/// `q.len()` (a multiple of 16) elements must be readable at `row`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
unsafe fn dot<T: Element>(q: &[f32], row: *const T) -> __m512 {
    let mut acc = _mm512_setzero_ps();
    for (c, qc) in q.chunks_exact(16).enumerate() {
        // SAFETY: columns 16c .. 16c + 16 of the row are readable (caller), qc has 16.
        unsafe {
            let x = load16(row.add(16 * c));
            acc = _mm512_fmadd_ps(_mm512_loadu_ps(qc.as_ptr()), x, acc);
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
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
pub(super) fn accumulate<T: Element>(
    (accs, alphas): (&mut [f32], &[f32]),
    (ps, stride): (&[f32], usize),
    v: MatRef<'_, T>,
    next: MatRef<'_, T>,
) {
    let (n, d, nr) = (v.nrows(), v.ncols(), alphas.len());
    assert!(supports(v) && (1..=MAX_ROWS).contains(&nr) && accs.len() == nr * d);
    assert!(n <= stride && fits(ps.len(), nr, stride, n));
    let mut c0 = 0;
    while c0 < d {
        // Constant widths keep the accumulators in registers (rows × width ≤ 18 of the 32);
        // the first pass over the rows prefetches for all of them.
        let left = (d - c0) / 16;
        let pass = PassArgs {
            alphas,
            ps,
            stride,
            v,
            next,
            c0,
        };
        c0 += 16
            * match (nr, left) {
                (1, 1) => accumulate_pass::<T, 1, 1>(accs, pass),
                (1, 2) => accumulate_pass::<T, 1, 2>(accs, pass),
                (1, 3) => accumulate_pass::<T, 1, 3>(accs, pass),
                (1, 4) => accumulate_pass::<T, 1, 4>(accs, pass),
                (1, 5) => accumulate_pass::<T, 1, 5>(accs, pass),
                (1, 6) => accumulate_pass::<T, 1, 6>(accs, pass),
                (1, 7) => accumulate_pass::<T, 1, 7>(accs, pass),
                (1, _) => accumulate_pass::<T, 1, 8>(accs, pass),
                (2, 8..) => accumulate_pass::<T, 2, 8>(accs, pass),
                (2, 4..) => accumulate_pass::<T, 2, 4>(accs, pass),
                (2, 2..) => accumulate_pass::<T, 2, 2>(accs, pass),
                (2, _) => accumulate_pass::<T, 2, 1>(accs, pass),
                (3, 6..) => accumulate_pass::<T, 3, 6>(accs, pass),
                (3, 4..) => accumulate_pass::<T, 3, 4>(accs, pass),
                (3, 2..) => accumulate_pass::<T, 3, 2>(accs, pass),
                (3, _) => accumulate_pass::<T, 3, 1>(accs, pass),
                (_, 4..) => accumulate_pass::<T, 4, 4>(accs, pass),
                (_, 2..) => accumulate_pass::<T, 4, 2>(accs, pass),
                (_, _) => accumulate_pass::<T, 4, 1>(accs, pass),
            };
    }
}

/// Rows the multi-row kernels take at once.
pub(super) const MAX_ROWS: usize = 4;

/// What one pass of [`accumulate`] reads, and the first column it covers.
#[derive(Clone, Copy)]
struct PassArgs<'a, T> {
    alphas: &'a [f32],
    ps: &'a [f32],
    stride: usize,
    v: MatRef<'a, T>,
    next: MatRef<'a, T>,
    c0: usize,
}

/// One pass of [`accumulate`] over columns `c0 .. c0 + 16·W` of every value row, for `R`
/// accumulator rows; returns `W`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
fn accumulate_pass<T: Element, const R: usize, const W: usize>(
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
    assert!(alphas.len() == R && accs.len() == R * d && c0 + 16 * W <= d);
    assert!(n <= stride && fits(ps.len(), R, stride, n));
    let (rows, next) = (Rows::of(v), Rows::of(next));
    let ahead = PREFETCH_BYTES.div_ceil(rows.bytes);
    let mut regs = [[_mm512_setzero_ps(); W]; R];
    for (r, row_regs) in regs.iter_mut().enumerate() {
        let alpha = _mm512_set1_ps(alphas[r]);
        for (u, x) in row_regs.iter_mut().enumerate() {
            // SAFETY: accumulator row r holds d ≥ c0 + 16·W floats from r·d.
            *x = _mm512_mul_ps(alpha, unsafe {
                _mm512_loadu_ps(accs.as_ptr().add(r * d + c0 + 16 * u))
            });
        }
    }
    for j in 0..n {
        if c0 == 0 && j + ahead >= n {
            prefetch_row(&rows, &next, j + ahead);
        }
        let mut p = [_mm512_setzero_ps(); R];
        for (r, x) in p.iter_mut().enumerate() {
            *x = _mm512_set1_ps(ps[r * stride + j]);
        }
        let row = rows.row(j);
        for u in 0..W {
            // SAFETY: row j < n has columns c0 .. c0 + 16·W readable at unit stride.
            let x = unsafe { load16(row.add(c0 + 16 * u)) };
            for (row_regs, &pr) in regs.iter_mut().zip(&p) {
                row_regs[u] = _mm512_fmadd_ps(pr, x, row_regs[u]);
            }
        }
    }
    for (r, row_regs) in regs.iter().enumerate() {
        for (u, x) in row_regs.iter().enumerate() {
            // SAFETY: accumulator row r holds d ≥ c0 + 16·W floats from r·d.
            unsafe { _mm512_storeu_ps(accs.as_mut_ptr().add(r * d + c0 + 16 * u), *x) };
        }
    }
    W
}

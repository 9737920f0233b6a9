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

/// Value vectors (of 16 lanes) held in registers while the rows stream past.
const VECTORS_AT_ONCE: usize = 8;

/// Whether the kernels can read `m`: rows of unit column stride, a width of whole vectors.
pub(super) fn supports<T>(m: MatRef<'_, T>) -> bool {
    m.ncols() > 0 && m.ncols() % 16 == 0 && m.col_stride() == 1
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

/// `out[j] = q · k[j]` for every row of `k`, prefetching on into `next`.
///
/// # Panics
/// If `k` is not [`supports`]ed or the lengths disagree (the callers check both).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
pub(super) fn scores<T: Element>(
    q: &[f32],
    k: MatRef<'_, T>,
    next: MatRef<'_, T>,
    out: &mut [f32],
) {
    assert!(supports(k) && q.len() == k.ncols() && out.len() == k.nrows());
    // Q in registers (up to 16 vectors, d ≤ 256) keeps the loop at one fused load-FMA per
    // 16 elements of K: the fewer instructions per byte, the further ahead of the oldest
    // cache miss the out-of-order window reaches, and the more misses are in flight.
    match k.ncols() / 16 {
        1 => scores_q_in_registers::<T, 1>(q, k, next, out),
        2 => scores_q_in_registers::<T, 2>(q, k, next, out),
        3 => scores_q_in_registers::<T, 3>(q, k, next, out),
        4 => scores_q_in_registers::<T, 4>(q, k, next, out),
        5 => scores_q_in_registers::<T, 5>(q, k, next, out),
        6 => scores_q_in_registers::<T, 6>(q, k, next, out),
        7 => scores_q_in_registers::<T, 7>(q, k, next, out),
        8 => scores_q_in_registers::<T, 8>(q, k, next, out),
        9 => scores_q_in_registers::<T, 9>(q, k, next, out),
        10 => scores_q_in_registers::<T, 10>(q, k, next, out),
        11 => scores_q_in_registers::<T, 11>(q, k, next, out),
        12 => scores_q_in_registers::<T, 12>(q, k, next, out),
        13 => scores_q_in_registers::<T, 13>(q, k, next, out),
        14 => scores_q_in_registers::<T, 14>(q, k, next, out),
        15 => scores_q_in_registers::<T, 15>(q, k, next, out),
        16 => scores_q_in_registers::<T, 16>(q, k, next, out),
        _ => scores_any_width(q, k, next, out),
    }
}

/// [`scores`] for a width of `NV` vectors, Q held in registers.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
fn scores_q_in_registers<T: Element, const NV: usize>(
    q: &[f32],
    k: MatRef<'_, T>,
    next: MatRef<'_, T>,
    out: &mut [f32],
) {
    let n = k.nrows();
    assert!(k.ncols() == 16 * NV && q.len() == 16 * NV && out.len() == n);
    let (rows, next) = (Rows::of(k), Rows::of(next));
    let ahead = PREFETCH_BYTES.div_ceil(rows.bytes);
    let mut qv = [_mm512_setzero_ps(); NV];
    for (c, x) in qv.iter_mut().enumerate() {
        // SAFETY: q holds 16·NV floats.
        *x = unsafe { _mm512_loadu_ps(q.as_ptr().add(16 * c)) };
    }
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
        // Row by row, so the loads walk the memory in address order.
        let mut acc = [_mm512_setzero_ps(); KEYS_AT_ONCE];
        for (r, a) in acc.iter_mut().enumerate() {
            let row = rows.row(j + r);
            for (c, &qc) in qv.iter().enumerate() {
                // SAFETY: row j + r < n has 16·NV readable elements at unit stride.
                *a = _mm512_fmadd_ps(qc, unsafe { load16(row.add(16 * c)) }, *a);
            }
        }
        let sums = sum_lanes_of_8(acc);
        // SAFETY: out has n ≥ j + 8 elements.
        unsafe { _mm256_storeu_ps(out.as_mut_ptr().add(j), sums) };
        j += KEYS_AT_ONCE;
    }
    for (j, o) in out.iter_mut().enumerate().skip(j) {
        let row = rows.row(j);
        let mut a = _mm512_setzero_ps();
        for (c, &qc) in qv.iter().enumerate() {
            // SAFETY: row j < n has 16·NV readable elements at unit stride.
            a = _mm512_fmadd_ps(qc, unsafe { load16(row.add(16 * c)) }, a);
        }
        *o = _mm512_reduce_add_ps(a);
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

/// `acc = alpha·acc + Σ_j p_j · v[j]`, prefetching on into `next`.
///
/// # Panics
/// If `v` is not [`supports`]ed or the lengths disagree (the callers check both).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
pub(super) fn accumulate<T: Element>(
    acc: &mut [f32],
    alpha: f32,
    p: &[f32],
    v: MatRef<'_, T>,
    next: MatRef<'_, T>,
) {
    let d = v.ncols();
    assert!(supports(v) && acc.len() == d && p.len() == v.nrows());
    let mut c0 = 0;
    while c0 < d {
        // A constant width keeps the accumulators in registers; the first pass over the
        // rows prefetches for all of them.
        let w = ((d - c0) / 16).min(VECTORS_AT_ONCE);
        let block = &mut acc[c0..c0 + 16 * w];
        let args = (alpha, p, v, next, c0);
        match w {
            1 => accumulate_pass::<T, 1>(block, args),
            2 => accumulate_pass::<T, 2>(block, args),
            3 => accumulate_pass::<T, 3>(block, args),
            4 => accumulate_pass::<T, 4>(block, args),
            5 => accumulate_pass::<T, 5>(block, args),
            6 => accumulate_pass::<T, 6>(block, args),
            7 => accumulate_pass::<T, 7>(block, args),
            _ => accumulate_pass::<T, VECTORS_AT_ONCE>(block, args),
        }
        c0 += 16 * w;
    }
}

/// `alpha`, `p`, the value rows, the rows read next, and the first column of the pass.
type PassArgs<'a, T> = (f32, &'a [f32], MatRef<'a, T>, MatRef<'a, T>, usize);

/// One pass of [`accumulate`] over columns `c0 .. c0 + 16·W` of every row.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
fn accumulate_pass<T: Element, const W: usize>(
    acc: &mut [f32],
    (alpha, p, v, next, c0): PassArgs<'_, T>,
) {
    assert!(acc.len() == 16 * W && c0 + 16 * W <= v.ncols() && p.len() == v.nrows());
    let (rows, next) = (Rows::of(v), Rows::of(next));
    let ahead = PREFETCH_BYTES.div_ceil(rows.bytes);
    let alpha = _mm512_set1_ps(alpha);
    let mut regs = [_mm512_setzero_ps(); W];
    for (u, r) in regs.iter_mut().enumerate() {
        // SAFETY: acc holds 16·W floats.
        *r = _mm512_mul_ps(alpha, unsafe { _mm512_loadu_ps(acc.as_ptr().add(16 * u)) });
    }
    for (j, &pj) in p.iter().enumerate() {
        if c0 == 0 && j + ahead >= rows.n {
            prefetch_row(&rows, &next, j + ahead);
        }
        let pj = _mm512_set1_ps(pj);
        let row = rows.row(j);
        for (u, r) in regs.iter_mut().enumerate() {
            // SAFETY: row j < n has columns c0 .. c0 + 16·W readable at unit stride.
            let x = unsafe { load16(row.add(c0 + 16 * u)) };
            *r = _mm512_fmadd_ps(pj, x, *r);
        }
    }
    for (u, r) in regs.iter().enumerate() {
        // SAFETY: acc holds 16·W floats.
        unsafe { _mm512_storeu_ps(acc.as_mut_ptr().add(16 * u), *r) };
    }
}

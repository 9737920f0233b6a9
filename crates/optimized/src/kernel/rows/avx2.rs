//! The row kernels compiled for AVX2 with FMA and F16C (8 f32 lanes, 16 registers): the
//! in-place kernels on CPUs without AVX-512.

use core::arch::x86_64::*;

use faer::MatRef;

use super::kernels::{PassArgs, Rows, ScoreArgs, fits, prefetch_row, row_kernels, supports};
use super::{KEYS_AT_ONCE, MAX_ROWS};
use super::{RowElement, RowKind};

/// Eight elements at `p`, as f32.
///
/// # Safety
/// Eight elements of `T` must be readable at `p`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn load8<T: RowElement>(p: *const T) -> __m256 {
    // SAFETY: the caller guarantees 8 readable elements; the loads are unaligned, and the
    // storage kind says how the bits are laid out.
    unsafe {
        match T::KIND {
            RowKind::F32 => _mm256_loadu_ps(p.cast()),
            RowKind::F16 => _mm256_cvtph_ps(_mm_loadu_si128(p.cast())),
            RowKind::Bf16 => _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(
                _mm_loadu_si128(p.cast()),
            ))),
            RowKind::Int8 => _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(p.cast()))),
            RowKind::Fp8 => {
                _mm256_cvtph_ps(fp8_as_f16(_mm_cvtepi8_epi16(_mm_loadl_epi64(p.cast()))))
            }
        }
    }
}

/// Eight fp8 e4m3 codes, sign-extended to 16-bit lanes, as the f16 numbers `2⁻⁸` of
/// their values (the AVX-512 kernels' `fp8_as_f16`, 128 bits wide).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn fp8_as_f16(x: __m128i) -> __m128i {
    _mm_and_si128(_mm_slli_epi16::<7>(x), _mm_set1_epi16(0xBFFF_u16 as i16))
}

/// The sum of the eight lanes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn sum8(a: __m256) -> f32 {
    let x = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps::<1>(a));
    let x = _mm_add_ps(x, _mm_movehl_ps(x, x));
    _mm_cvtss_f32(_mm_add_ss(x, _mm_movehdup_ps(x)))
}

/// The horizontal sums of eight vectors, as one vector of eight: two rounds of pairwise
/// horizontal adds, then the two 128-bit halves added.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn sum_lanes_of_8(a: [__m256; 8]) -> __m256 {
    // hadd(x, y) = [x0+x1, x2+x3, y0+y1, y2+y3 | x4+x5, x6+x7, y4+y5, y6+y7].
    let t0 = _mm256_hadd_ps(a[0], a[1]);
    let t1 = _mm256_hadd_ps(a[2], a[3]);
    let t2 = _mm256_hadd_ps(a[4], a[5]);
    let t3 = _mm256_hadd_ps(a[6], a[7]);
    // [a0, a1, a2, a3 (low halves) | a0, a1, a2, a3 (high halves)], then a4..a7.
    let u0 = _mm256_hadd_ps(t0, t1);
    let u1 = _mm256_hadd_ps(t2, t3);
    let lo = _mm256_permute2f128_ps::<0x20>(u0, u1);
    let hi = _mm256_permute2f128_ps::<0x31>(u0, u1);
    _mm256_add_ps(lo, hi)
}

row_kernels! {
    features: "avx2,fma,f16c",
    lanes: 8,
    many_registers: false,
    vector: __m256,
    zero: _mm256_setzero_ps,
    splat: _mm256_set1_ps,
    mul: _mm256_mul_ps,
    mul_add: _mm256_fmadd_ps,
    load_f32: _mm256_loadu_ps,
    store_f32: _mm256_storeu_ps,
    sum: sum8,
    load: load8,
    sums_of_8: sum_lanes_of_8,
}

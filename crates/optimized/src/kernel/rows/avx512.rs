//! The row kernels compiled for AVX-512 (16 f32 lanes, 32 registers).

use core::arch::x86_64::*;

use faer::MatRef;

use super::kernels::{PassArgs, Rows, ScoreArgs, fits, prefetch_row, row_kernels, supports};
use super::{KEYS_AT_ONCE, MAX_ROWS};
use super::{RowElement, RowKind};

/// Sixteen elements at `p`, as f32.
///
/// # Safety
/// Sixteen elements of `T` must be readable at `p`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
unsafe fn load16<T: RowElement>(p: *const T) -> __m512 {
    // SAFETY: the caller guarantees 16 readable elements; the loads are unaligned, and the
    // storage kind says how the bits are laid out.
    unsafe {
        match T::KIND {
            RowKind::F32 => _mm512_loadu_ps(p.cast()),
            RowKind::F16 => _mm512_cvtph_ps(_mm256_loadu_si256(p.cast())),
            RowKind::Bf16 => _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(
                _mm256_loadu_si256(p.cast()),
            ))),
            RowKind::Int8 => _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(p.cast()))),
            RowKind::Fp8 => {
                _mm512_cvtph_ps(fp8_as_f16(_mm256_cvtepi8_epi16(_mm_loadu_si128(p.cast()))))
            }
        }
    }
}

/// Sixteen fp8 e4m3 codes, sign-extended to 16-bit lanes, as the f16 numbers `2⁻⁸` of
/// their values: exponent and mantissa one bit below where e4m3 has them (f16's exponent
/// bias is 8 more than e4m3's; subnormals map to subnormals alike). Shifted left by 7,
/// the sign extension fills bits 14 and 15 with the sign: bit 14 is cleared.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
fn fp8_as_f16(x: __m256i) -> __m256i {
    _mm256_and_si256(
        _mm256_slli_epi16::<7>(x),
        _mm256_set1_epi16(0xBFFF_u16 as i16),
    )
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

row_kernels! {
    features: "avx512f,avx512bw,avx512vl,avx2,fma",
    lanes: 16,
    many_registers: true,
    vector: __m512,
    zero: _mm512_setzero_ps,
    splat: _mm512_set1_ps,
    mul: _mm512_mul_ps,
    mul_add: _mm512_fmadd_ps,
    load_f32: _mm512_loadu_ps,
    store_f32: _mm512_storeu_ps,
    sum: _mm512_reduce_add_ps,
    load: load16,
    sums_of_8: sum_lanes_of_8,
}

//! Transposes between row-major operands and the column-major tiles of both passes: the
//! query tile in (scaled into the log2 domain and saturated), the output rows and the
//! backward's gradient rows out. Row-major rows go through 8 × 8 blocks transposed in AVX
//! registers where the CPU has them (the compiler does not vectorise a transpose); any
//! other layout element by element. Every path gives the same bits.

use faer::MatRef;

use super::Isa;
use super::online_softmax::saturate;

/// `dst` (column-major, `ld` floats between columns) = `src` (rows × cols) times `alpha`,
/// saturated ([`saturate`]): a query tile scaled into the log2 domain and transposed for
/// the score GEMM. Row-major `src` rows go through 8 × 8 blocks transposed in registers
/// (AVX shuffles where the CPU has them: the compiler does not vectorise a transpose);
/// any other layout element by element. Every path gives the same bits.
pub(crate) fn scale_transposed(src: MatRef<'_, f32>, alpha: f32, dst: &mut [f32], ld: usize) {
    transposed_with::<SATURATED>(src, alpha, dst, ld);
}

/// `dst` (column-major, `ld` floats between columns) = `src` (rows × cols), as
/// [`scale_transposed`] without the scale: an accumulator tile gathered into output rows.
pub(crate) fn transposed(src: MatRef<'_, f32>, dst: &mut [f32], ld: usize) {
    transposed_with::<COPIED>(src, 1.0, dst, ld);
}

/// `dst` (column-major, `ld` floats between columns) = `src` (rows × cols) times `alpha`,
/// as [`scale_transposed`] but not saturated (an overflow stays `±inf`, for the repairs
/// that look for it): a gradient accumulator gathered into its rows.
pub(crate) fn transposed_times(src: MatRef<'_, f32>, alpha: f32, dst: &mut [f32], ld: usize) {
    transposed_with::<SCALED>(src, alpha, dst, ld);
}

/// What [`transposed_with`] writes of an entry: the entry itself, …
const COPIED: u8 = 0;
/// … times the factor, …
const SCALED: u8 = 1;
/// … or times the factor and saturated ([`saturate`]).
const SATURATED: u8 = 2;

/// What [`transposed_with`] writes of an entry `x`.
#[inline(always)]
fn entry<const MODE: u8>(x: f32, alpha: f32) -> f32 {
    match MODE {
        COPIED => x,
        SCALED => x * alpha,
        _ => saturate(x * alpha),
    }
}

fn transposed_with<const MODE: u8>(src: MatRef<'_, f32>, alpha: f32, dst: &mut [f32], ld: usize) {
    #[cfg(target_arch = "x86_64")]
    if matches!(Isa::current().vectors(), Isa::Avx512 | Isa::Avx2) {
        // SAFETY: the AVX-512 and AVX2 paths both have AVX (checked when the path is chosen).
        unsafe { transposed_avx::<MODE>(src, alpha, dst, ld) };
        return;
    }
    transposed_by::<MODE>(src, alpha, dst, ld, transpose_block::<MODE>);
}

/// The edge of [`transposed_with`]'s blocks.
const TRANSPOSE_BLOCK: usize = 8;

/// `TRANSPOSE_BLOCK` contiguous rows of a tile.
type RowBlock<'a> = [&'a [f32]; TRANSPOSE_BLOCK];

/// Rows `i0..i0 + TRANSPOSE_BLOCK` of `src` as slices, when each is contiguous.
#[inline(always)]
fn row_block(src: MatRef<'_, f32>, i0: usize) -> Option<RowBlock<'_>> {
    let mut rows = [&[][..]; TRANSPOSE_BLOCK];
    for (ii, row) in rows.iter_mut().enumerate() {
        *row = src.row(i0 + ii).try_as_row_major()?.as_slice();
    }
    Some(rows)
}

/// [`transposed_with`] with each whole 8 × 8 block done by `block(rows, c0, alpha, dst,
/// ld)`, which writes column `c0 + cc` of the block to `dst[cc·ld..][..8]`; the edges
/// element by element.
#[inline(always)]
fn transposed_by<const MODE: u8>(
    src: MatRef<'_, f32>,
    alpha: f32,
    dst: &mut [f32],
    ld: usize,
    block: impl Fn(&RowBlock<'_>, usize, f32, &mut [f32], usize),
) {
    const B: usize = TRANSPOSE_BLOCK;
    let (rows, cols) = (src.nrows(), src.ncols());
    let whole = cols / B * B;
    let mut i0 = 0;
    while i0 + B <= rows {
        let Some(rows_here) = row_block(src, i0) else {
            break;
        };
        for c0 in (0..whole).step_by(B) {
            let at = c0 * ld + i0;
            block(
                &rows_here,
                c0,
                alpha,
                &mut dst[at..at + (B - 1) * ld + B],
                ld,
            );
        }
        for c in whole..cols {
            for (ii, row) in rows_here.iter().enumerate() {
                dst[c * ld + i0 + ii] = entry::<MODE>(row[c], alpha);
            }
        }
        i0 += B;
    }
    // The rows left (fewer than a block, or not contiguous).
    for c in 0..cols {
        for i in i0..rows {
            dst[c * ld + i] = entry::<MODE>(src[(i, c)], alpha);
        }
    }
}

/// One block of [`transposed_by`], portable.
#[inline(always)]
fn transpose_block<const MODE: u8>(
    rows: &RowBlock<'_>,
    c0: usize,
    alpha: f32,
    dst: &mut [f32],
    ld: usize,
) {
    const B: usize = TRANSPOSE_BLOCK;
    for (ii, row) in rows.iter().enumerate() {
        for (cc, &x) in row[c0..c0 + B].iter().enumerate() {
            dst[cc * ld + ii] = entry::<MODE>(x, alpha);
        }
    }
}

/// [`transposed_with`] with its blocks in AVX registers.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx")]
fn transposed_avx<const MODE: u8>(src: MatRef<'_, f32>, alpha: f32, dst: &mut [f32], ld: usize) {
    use core::arch::x86_64::{_MM_HINT_T0, _mm_prefetch};
    // The tile's rows are read once, from L3 or memory: every line is asked for first, so
    // that the misses overlap instead of stalling the transposes one block at a time.
    for i in 0..src.nrows() {
        if let Some(row) = src.row(i).try_as_row_major() {
            for line in row.as_slice().chunks(16) {
                _mm_prefetch::<_MM_HINT_T0>(line.as_ptr().cast());
            }
        }
    }
    // The closure has this function's features: no unsafe needed to call the block.
    transposed_by::<MODE>(src, alpha, dst, ld, |rows, c0, alpha, dst, ld| {
        transpose_block_avx::<MODE>(rows, c0, alpha, dst, ld)
    });
}

/// One block of [`transposed_by`]: eight rows loaded (scaled and saturated: `max` then
/// `min` with the value second, so NaN stays NaN as in [`saturate`]), then the classic
/// unpack / shuffle / lane-permute transpose.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx")]
fn transpose_block_avx<const MODE: u8>(
    rows: &RowBlock<'_>,
    c0: usize,
    alpha: f32,
    dst: &mut [f32],
    ld: usize,
) {
    use core::arch::x86_64::*;
    const B: usize = TRANSPOSE_BLOCK;
    let (a, lo, hi) = (
        _mm256_set1_ps(alpha),
        _mm256_set1_ps(-f32::MAX),
        _mm256_set1_ps(f32::MAX),
    );
    let r: [__m256; B] = core::array::from_fn(|i| {
        let row = &rows[i][c0..c0 + B];
        // SAFETY: `row` holds the 8 floats loaded.
        let x = unsafe { _mm256_loadu_ps(row.as_ptr()) };
        match MODE {
            COPIED => x,
            SCALED => _mm256_mul_ps(x, a),
            _ => _mm256_min_ps(hi, _mm256_max_ps(lo, _mm256_mul_ps(x, a))),
        }
    });
    let t = [
        _mm256_unpacklo_ps(r[0], r[1]),
        _mm256_unpackhi_ps(r[0], r[1]),
        _mm256_unpacklo_ps(r[2], r[3]),
        _mm256_unpackhi_ps(r[2], r[3]),
        _mm256_unpacklo_ps(r[4], r[5]),
        _mm256_unpackhi_ps(r[4], r[5]),
        _mm256_unpacklo_ps(r[6], r[7]),
        _mm256_unpackhi_ps(r[6], r[7]),
    ];
    // Columns c and c + 4 of rows 0..4 (then 4..8), lane by lane.
    let u = [
        _mm256_shuffle_ps::<0x44>(t[0], t[2]),
        _mm256_shuffle_ps::<0xEE>(t[0], t[2]),
        _mm256_shuffle_ps::<0x44>(t[1], t[3]),
        _mm256_shuffle_ps::<0xEE>(t[1], t[3]),
        _mm256_shuffle_ps::<0x44>(t[4], t[6]),
        _mm256_shuffle_ps::<0xEE>(t[4], t[6]),
        _mm256_shuffle_ps::<0x44>(t[5], t[7]),
        _mm256_shuffle_ps::<0xEE>(t[5], t[7]),
    ];
    for cc in 0..4 {
        let low = _mm256_permute2f128_ps::<0x20>(u[cc], u[cc + 4]);
        let high = _mm256_permute2f128_ps::<0x31>(u[cc], u[cc + 4]);
        for (c, col) in [(cc, low), (cc + 4, high)] {
            let out = &mut dst[c * ld..c * ld + B];
            // SAFETY: `out` has room for the 8 floats stored.
            unsafe { _mm256_storeu_ps(out.as_mut_ptr(), col) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scale_transposed_is_the_scaled_transpose_for_every_shape_and_layout() {
        let alpha = 0.37f32;
        for rows in [0, 1, 7, 8, 9, 16, 21] {
            for cols in [0, 1, 5, 8, 13, 64] {
                let value = |i: usize, c: usize| {
                    if (i, c) == (1, 2) {
                        f32::MAX // saturates after the scale-up below
                    } else {
                        (i * 31 + c * 7) as f32 * 0.25 - 9.0
                    }
                };
                let row_major: Vec<f32> = (0..rows * cols)
                    .map(|x| value(x / cols.max(1), x % cols.max(1)))
                    .collect();
                let col_major: Vec<f32> = (0..rows * cols)
                    .map(|x| value(x % rows.max(1), x / rows.max(1)))
                    .collect();
                let ld = rows + 3;
                for (layout, src) in [
                    (
                        "row-major",
                        MatRef::from_row_major_slice(&row_major, rows, cols),
                    ),
                    (
                        "column-major",
                        MatRef::from_column_major_slice(&col_major, rows, cols),
                    ),
                ] {
                    for scale in [alpha, 4.0] {
                        let mut dst = vec![f32::NAN; ld * cols];
                        scale_transposed(src, scale, &mut dst, ld);
                        for c in 0..cols {
                            for i in 0..rows {
                                let want = saturate(value(i, c) * scale);
                                assert_eq!(
                                    dst[c * ld + i].to_bits(),
                                    want.to_bits(),
                                    "{layout} {rows}x{cols} ({i}, {c})"
                                );
                            }
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn transposed_copies_every_entry_as_it_is() {
        for (rows, cols) in [(8, 8), (16, 64), (13, 21), (64, 9), (3, 3)] {
            let value = |i: usize, c: usize| match (i + 2 * c) % 11 {
                0 => f32::INFINITY,
                1 => f32::NAN,
                2 => f32::MAX,
                k => (i * 7 + c) as f32 * 0.5 - k as f32,
            };
            let src: Vec<f32> = (0..rows * cols)
                .map(|x| value(x / cols, x % cols))
                .collect();
            let ld = rows + 5;
            let mut dst = vec![0.0f32; ld * cols];
            transposed(MatRef::from_row_major_slice(&src, rows, cols), &mut dst, ld);
            for c in 0..cols {
                for i in 0..rows {
                    assert_eq!(dst[c * ld + i].to_bits(), value(i, c).to_bits());
                }
            }
        }
    }
}

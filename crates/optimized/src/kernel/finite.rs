//! The scans that tell whether a tile holds a non-finite value: the cheap tests in front of
//! the exact slow paths ([`crate::exact`]: dot products that overflowed f32) and of the
//! careful products of blocks where a hidden key's value is not finite ([`crate::mask`]).
//!
//! A finite `q·k` summed in f32 either stays finite or leaves the finite range for good
//! (`±inf` stays `±inf` or meets its opposite and becomes NaN), so a tile of raw scores
//! that is entirely finite needs no repair. The test compares the magnitude bits against
//! those of `+inf`: an integer maximum per element, no floating-point comparisons.

use faer::{MatRef, RowRef};

use super::element::Element;

use super::multiversion;

/// The bits of `+inf`: a float is non-finite exactly when its magnitude bits reach them.
pub(crate) const INF_BITS: u32 = 0x7f80_0000;

#[inline(always)]
fn tile_is_finite_body<const FMA: bool>(s: &[f32], ld: usize, rows: usize, cols: usize) -> bool {
    // An integer maximum is associative, so the compiler vectorises the reduction.
    let mut high = 0u32;
    for j in 0..cols {
        let col = &s[j * ld..j * ld + rows];
        high = magnitude_max(col, high);
    }
    high < INF_BITS
}

multiversion! {
    /// Whether every entry of a `rows × cols` tile stored column-major with leading
    /// dimension `ld` is finite (a row-major tile is the same call with rows and columns
    /// swapped).
    pub(crate) fn tile_is_finite(s: &[f32], ld: usize, rows: usize, cols: usize) -> bool = tile_is_finite_body
}

/// `high` raised to the largest magnitude bits of `x` (an integer maximum, vectorised); a
/// value is non-finite exactly when its magnitude bits reach [`INF_BITS`].
#[inline(always)]
pub(crate) fn magnitude_max(x: &[f32], high: u32) -> u32 {
    x.iter().fold(high, |h, x| h.max(x.to_bits() & !(1 << 31)))
}

#[inline(always)]
fn rows_are_finite_body<const FMA: bool>(m: MatRef<'_, f32>) -> bool {
    let mut high = 0u32;
    for i in 0..m.nrows() {
        let row = m.row(i);
        high = match row.try_as_row_major() {
            Some(row) => magnitude_max(row.as_slice(), high),
            None => row
                .iter()
                .fold(high, |h, x| h.max(x.to_bits() & !(1 << 31))),
        };
    }
    high < INF_BITS
}

/// Whether every entry of one row is finite (any storage type): the per-row test of the
/// slow paths, which already know that some row is not.
pub(crate) fn row_is_finite<T: Element>(row: RowRef<'_, T>) -> bool {
    row.iter().all(|x| Element::is_finite(*x))
}

multiversion! {
    /// Whether every entry of `m` is finite, row by row (a block of K or V rows).
    pub(crate) fn rows_are_finite(m: MatRef<'_, f32>) -> bool = rows_are_finite_body
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_every_non_finite_value_wherever_it_is() {
        let (ld, rows, cols) = (37, 35, 9);
        let clean: Vec<f32> = (0..ld * cols).map(|x| x as f32 * 1e36 - 1e38).collect();
        assert!(tile_is_finite(&clean, ld, rows, cols));
        for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY, -f32::NAN] {
            for j in 0..cols {
                for i in 0..rows {
                    let mut s = clean.clone();
                    s[j * ld + i] = bad;
                    assert!(!tile_is_finite(&s, ld, rows, cols), "{bad} at ({i}, {j})");
                }
            }
            // Outside the tile (the padding between columns, past the last column): unseen.
            let mut s = clean.clone();
            s[rows] = bad;
            s[ld * (cols - 1) + rows + 1] = bad;
            assert!(tile_is_finite(&s, ld, rows, cols));
        }
        let extremes = [f32::MAX, f32::MIN, f32::MIN_POSITIVE, 1e-45, -0.0];
        assert!(tile_is_finite(&extremes, 5, 5, 1));
        assert!(tile_is_finite(&[], 0, 0, 0));
    }

    #[test]
    fn finds_a_non_finite_row_entry_in_any_layout() {
        let m = faer::Mat::<f32>::from_fn(9, 21, |i, j| (i * 21 + j) as f32 * 1e36);
        assert!(rows_are_finite(m.as_ref()) && rows_are_finite(m.transpose()));
        for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
            for (i, j) in [(0, 0), (8, 20), (4, 13)] {
                let mut m = m.clone();
                m[(i, j)] = bad;
                assert!(!rows_are_finite(m.as_ref()), "{bad} at ({i}, {j})");
                assert!(!rows_are_finite(m.transpose()), "{bad} at ({j}, {i})");
                assert!(rows_are_finite(m.as_ref().subrows(0, i)));
            }
        }
    }
}

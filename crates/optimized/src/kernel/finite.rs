//! The scan that tells whether a score tile holds a non-finite value: the cheap test in
//! front of the exact slow path ([`crate::exact`]) for dot products that overflowed f32.
//!
//! A finite `q·k` summed in f32 either stays finite or leaves the finite range for good
//! (`±inf` stays `±inf` or meets its opposite and becomes NaN), so a tile of raw scores
//! that is entirely finite needs no repair. The test compares the magnitude bits against
//! those of `+inf`: integer lanes, one maximum per element, no floating-point exceptions.

use super::multiversion;

/// Lanes of the running maxima (one AVX-512 vector of `u32`).
const LANES: usize = 16;

/// The bits of `+inf`: a float is non-finite exactly when its magnitude bits reach them.
const INF_BITS: u32 = 0x7f80_0000;

#[inline(always)]
fn tile_is_finite_body<const FMA: bool>(s: &[f32], ld: usize, rows: usize, cols: usize) -> bool {
    let mut high = [0u32; LANES];
    for j in 0..cols {
        let col = &s[j * ld..j * ld + rows];
        let chunks = col.chunks_exact(LANES);
        for x in chunks.remainder() {
            high[0] = high[0].max(x.to_bits() & !(1 << 31));
        }
        for c in chunks {
            for t in 0..LANES {
                high[t] = high[t].max(c[t].to_bits() & !(1 << 31));
            }
        }
    }
    high.iter().all(|&h| h < INF_BITS)
}

multiversion! {
    /// Whether every entry of a `rows × cols` tile stored column-major with leading
    /// dimension `ld` is finite (a row-major tile is the same call with rows and columns
    /// swapped).
    pub(crate) fn tile_is_finite(s: &[f32], ld: usize, rows: usize, cols: usize) -> bool = tile_is_finite_body
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
}

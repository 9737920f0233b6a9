//! The element-wise passes of the backward pass over one tile: the probabilities
//! recomputed from the forward's LSE, and the gradient of the scores.
//!
//! Tiles are column-major (`ld` floats between columns) like the forward's score tiles,
//! so the loops run down a column and vectorise across queries.

use super::exp2::exp2_approx;
use super::finite::{INF_BITS, magnitude_max};
use super::multiversion;

#[inline(always)]
fn probabilities_body<const FMA: bool>(
    s: &mut [f32],
    ld: usize,
    rows: usize,
    cols: usize,
    lse2: &[f32],
) {
    probabilities_tracked::<FMA, false>(s, ld, rows, cols, lse2);
}

#[inline(always)]
fn probabilities_checked_body<const FMA: bool>(
    s: &mut [f32],
    ld: usize,
    rows: usize,
    cols: usize,
    lse2: &[f32],
) -> bool {
    probabilities_tracked::<FMA, true>(s, ld, rows, cols, lse2) < INF_BITS
}

/// [`probabilities`], returning with `TRACK` the largest magnitude bits of the scores it
/// read (see [`super::finite::magnitude_max`]).
#[inline(always)]
fn probabilities_tracked<const FMA: bool, const TRACK: bool>(
    s: &mut [f32],
    ld: usize,
    rows: usize,
    cols: usize,
    lse2: &[f32],
) -> u32 {
    let mut high = 0u32;
    for j in 0..cols {
        let col = &mut s[j * ld..j * ld + rows];
        if TRACK {
            high = magnitude_max(col, high);
        }
        for (x, &l) in col.iter_mut().zip(&lse2[..rows]) {
            // +inf saturates as in the forward. A score cannot exceed its row's LSE:
            // capping at 0 keeps P ≤ 1 where rounding (or an LSE from elsewhere) says
            // otherwise. NaN passes both tests and stays NaN.
            let hidden = *x == f32::NEG_INFINITY;
            let s = if *x > f32::MAX { f32::MAX } else { *x };
            let t = s - l;
            let p = exp2_approx::<FMA>(if t > 0.0 { 0.0 } else { t });
            // A hidden key has P = 0 whatever the LSE (a NaN row's LSE is NaN), and so has
            // every key of a row that sees none (LSE -inf), not 2^(s + inf).
            *x = if hidden || l == f32::NEG_INFINITY {
                0.0
            } else {
                p
            };
        }
    }
    high
}

multiversion! {
    /// Replaces the log2-domain scores of a `rows × cols` tile by the probabilities
    /// `P = 2^(s − lse2_i)`, `lse2` being each row's LSE in the log2 domain: 0 where the
    /// score is `-inf` and in rows whose LSE is `-inf`.
    pub(crate) fn probabilities(s: &mut [f32], ld: usize, rows: usize, cols: usize, lse2: &[f32]) = probabilities_body
}

multiversion! {
    /// [`probabilities`] of a tile straight from its product, which finds out in the same
    /// pass whether every score was finite: `false` when one was not, the tile then
    /// overwritten (the caller computes the scores again and repairs them first).
    pub(crate) fn probabilities_checked(s: &mut [f32], ld: usize, rows: usize, cols: usize, lse2: &[f32]) -> bool = probabilities_checked_body
}

#[inline(always)]
fn score_gradient_body<const FMA: bool>(
    dp: &mut [f32],
    p: &[f32],
    ld: usize,
    rows: usize,
    cols: usize,
    d: &[f32],
) {
    for j in 0..cols {
        let (dcol, pcol) = (&mut dp[j * ld..j * ld + rows], &p[j * ld..j * ld + rows]);
        for ((x, &pij), &di) in dcol.iter_mut().zip(pcol).zip(&d[..rows]) {
            let g = pij * (*x - di);
            // Weight 0 (a hidden key among them) has gradient 0, even where dP or D is not
            // finite: a non-finite V row of a hidden key must not reach dQ or dK.
            *x = if pij == 0.0 { 0.0 } else { g };
        }
    }
}

multiversion! {
    /// Replaces `dP` of a `rows × cols` tile by the score gradient `dS = P ∘ (dP − D_i)`
    /// (0 wherever `P` is 0).
    pub(crate) fn score_gradient(dp: &mut [f32], p: &[f32], ld: usize, rows: usize, cols: usize, d: &[f32]) = score_gradient_body
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn probabilities_follow_the_lse_and_hide_what_is_hidden() {
        // Column-major 2 × 3, ld 2: row 0 has LSE2 = 1, row 1 sees nothing.
        let mut s = [0.0, 5.0, 1.0, f32::INFINITY, f32::NEG_INFINITY, 3.0];
        let lse2 = [1.0, f32::NEG_INFINITY];
        probabilities(&mut s, 2, 2, 3, &lse2);
        assert_eq!(s, [0.5, 0.0, 1.0, 0.0, 0.0, 0.0]);
        let mut nan = [f32::NAN];
        probabilities(&mut nan, 1, 1, 1, &[0.0]);
        assert!(nan[0].is_nan());
        // A NaN row (its LSE NaN) still gives its hidden keys weight 0.
        let mut row = [1.0, f32::NEG_INFINITY];
        probabilities(&mut row, 1, 1, 2, &[f32::NAN]);
        assert!(row[0].is_nan() && row[1] == 0.0);
    }

    #[test]
    fn zero_weight_has_zero_gradient_whatever_dp_is() {
        let p = [0.5, 0.0, 0.25, 0.0];
        let mut dp = [3.0, f32::NAN, 1.0, f32::INFINITY];
        score_gradient(&mut dp, &p, 2, 2, 2, &[1.0, 2.0]);
        assert_eq!(dp, [1.0, 0.0, 0.0, 0.0]);
    }
}

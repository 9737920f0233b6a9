//! Attention dropout on column-major tiles: the keep mask of [`attn_core::HeadDropout`]
//! generated sixteen queries at a time (one Philox block per query and four keys, the
//! sixteen blocks side by side in vector lanes) and applied as it is generated — the mask
//! is never stored.

use core::ops::Range;

use attn_core::{HeadDropout, PHILOX_MULTIPLIERS, PHILOX_ROUNDS, PHILOX_WEYL};

use super::multiversion;

/// Queries per batch of Philox blocks.
const LANES: usize = 16;

/// The Philox words of queries `first .. first + LANES` (a tile's rows; the lanes past its
/// last row are computed and ignored) for keys `4·quad .. 4·quad + 4`: word `w` of lane
/// `l` is [`HeadDropout::words`]`(first + l, quad)[w]`.
#[inline(always)]
fn words(d: &HeadDropout, first: usize, quad: usize) -> [[u32; LANES]; 4] {
    let [m0, m1] = PHILOX_MULTIPLIERS.map(u64::from);
    let mut c0: [u32; LANES] = core::array::from_fn(|l| (first + l) as u32);
    let mut c1 = [quad as u32; LANES];
    let mut c2 = [d.stream; LANES];
    let mut c3 = [d.offset; LANES];
    let [mut k0, mut k1] = d.key;
    for _ in 0..PHILOX_ROUNDS {
        for l in 0..LANES {
            let p0 = m0 * u64::from(c0[l]);
            let p1 = m1 * u64::from(c2[l]);
            (c0[l], c1[l], c2[l], c3[l]) = (
                (p1 >> 32) as u32 ^ c1[l] ^ k0,
                p1 as u32,
                (p0 >> 32) as u32 ^ c3[l] ^ k1,
                p0 as u32,
            );
        }
        k0 = k0.wrapping_add(PHILOX_WEYL[0]);
        k1 = k1.wrapping_add(PHILOX_WEYL[1]);
    }
    [c0, c1, c2, c3]
}

/// Calls `f(col, first_row, rows, kept)` for every column of a tile over queries `rows`
/// and keys `cols` (global positions; tile row `r` is query `rows.start + r`, tile column
/// `c` key `cols.start + c`), sixteen rows at a time: `kept[l]` says whether the weight of
/// row `first_row + l` (`l < rows`) is kept.
#[inline(always)]
fn for_each_mask(
    d: &HeadDropout,
    (rows, cols): (Range<usize>, Range<usize>),
    mut f: impl FnMut(usize, usize, usize, &[bool; LANES]),
) {
    if cols.is_empty() {
        return;
    }
    // p = 1 (threshold 2³²) keeps nothing; below, the threshold fits a word.
    let none = d.threshold > u64::from(u32::MAX);
    let threshold = d.threshold as u32;
    for first in rows.clone().step_by(LANES) {
        let n = LANES.min(rows.end - first);
        for quad in cols.start / 4..=(cols.end - 1) / 4 {
            let w = words(d, first, quad);
            for (lane_word, word) in w.iter().enumerate() {
                let j = quad * 4 + lane_word;
                if !cols.contains(&j) {
                    continue;
                }
                let kept: [bool; LANES] = core::array::from_fn(|l| !none && word[l] >= threshold);
                f(j - cols.start, first - rows.start, n, &kept);
            }
        }
    }
}

#[inline(always)]
fn drop_weights_body<const FMA: bool>(
    p: &mut [f32],
    ld: usize,
    at: (Range<usize>, Range<usize>),
    d: &HeadDropout,
) {
    let scale = d.scale;
    for_each_mask(d, at, |c, r, n, kept| {
        let col = &mut p[c * ld + r..c * ld + r + n];
        for (x, &k) in col.iter_mut().zip(kept) {
            *x = if k { *x * scale } else { 0.0 };
        }
    });
}

multiversion! {
    /// Drops the weights of a column-major tile (`ld` apart) over queries and keys `at`
    /// (global positions): a kept weight times `1/(1 − p)`, a dropped one 0.
    pub(crate) fn drop_weights(p: &mut [f32], ld: usize, at: (Range<usize>, Range<usize>), d: &HeadDropout) = drop_weights_body
}

#[inline(always)]
fn score_gradient_body<const FMA: bool>(
    dp: &mut [f32],
    p: &mut [f32],
    ld: usize,
    at: (Range<usize>, Range<usize>),
    (d, dropout): (&[f32], &HeadDropout),
) {
    let scale = dropout.scale;
    for_each_mask(dropout, at, |c, r, n, kept| {
        let range = c * ld + r..c * ld + r + n;
        let (dcol, pcol) = (&mut dp[range.clone()], &mut p[range]);
        for (((x, pij), &k), &di) in dcol.iter_mut().zip(pcol).zip(kept).zip(&d[r..r + n]) {
            let dp = if k { *x * scale } else { 0.0 };
            let g = *pij * (dp - di);
            *x = if *pij == 0.0 { 0.0 } else { g };
            *pij = if k { *pij * scale } else { 0.0 };
        }
    });
}

multiversion! {
    /// The score gradient of a column-major tile through the dropout: with `dp` holding
    /// `dO·Vᵀ` and `p` the undropped weights, `dp` becomes `dS = P ∘ (dP ∘ Z·s − D_i)`
    /// (0 wherever `P` is 0) and `p` the dropped weights `P ∘ Z·s` that `dV` sums.
    pub(crate) fn score_gradient_dropped(dp: &mut [f32], p: &mut [f32], ld: usize, at: (Range<usize>, Range<usize>), terms: (&[f32], &HeadDropout)) = score_gradient_body
}

#[cfg(test)]
mod tests {
    use attn_core::Dropout;

    use super::*;

    #[test]
    fn tiles_drop_what_the_contract_drops() {
        let d = Dropout::new(0.3, 0x1234_5678_9abc_def0)
            .unwrap()
            .with_offset(5)
            .for_head(1, 2, 3)
            .unwrap();
        // Odd tile corners: rows and columns not on a multiple of the lanes or of four.
        let (rows, cols, ld) = (13..50, 6..31, 40);
        let mut p = vec![1.0f32; ld * cols.len()];
        drop_weights(&mut p, ld, (rows.clone(), cols.clone()), &d);
        for (c, j) in cols.clone().enumerate() {
            for (r, i) in rows.clone().enumerate() {
                assert_eq!(p[c * ld + r], d.factor(i, j), "query {i}, key {j}");
            }
            assert!(
                p[c * ld + rows.len()..(c + 1) * ld]
                    .iter()
                    .all(|&x| x == 1.0)
            );
        }
    }

    #[test]
    fn the_gradient_pass_drops_the_same_weights() {
        let d = Dropout::new(0.5, 9).unwrap().for_head(0, 0, 1).unwrap();
        let (rows, cols, ld) = (0..20, 3..12, 20);
        let n = ld * cols.len();
        let mut p: Vec<f32> = (0..n).map(|e| (e % 7) as f32 / 8.0).collect();
        let mut dp: Vec<f32> = (0..n).map(|e| (e % 5) as f32 - 2.0).collect();
        let terms: Vec<f32> = (0..ld).map(|i| i as f32 / 10.0).collect();
        let (p0, dp0) = (p.clone(), dp.clone());
        score_gradient_dropped(
            &mut dp,
            &mut p,
            ld,
            (rows.clone(), cols.clone()),
            (&terms, &d),
        );
        for (c, j) in cols.enumerate() {
            for i in rows.clone() {
                let e = c * ld + i;
                let z = d.factor(i, j);
                assert_eq!(p[e], p0[e] * z);
                let want = if p0[e] == 0.0 {
                    0.0
                } else {
                    p0[e] * (dp0[e] * z - terms[i])
                };
                assert_eq!(dp[e], want);
            }
        }
    }

    #[test]
    fn p_one_drops_every_weight() {
        let d = Dropout::new(1.0, 3).unwrap().for_head(0, 0, 1).unwrap();
        let mut p = vec![0.5f32; 32 * 8];
        drop_weights(&mut p, 32, (0..32, 0..8), &d);
        assert!(p.iter().all(|&x| x == 0.0));
    }
}

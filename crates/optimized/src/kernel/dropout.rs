//! Attention dropout on column-major tiles: the keep mask of [`attn_core::HeadDropout`]
//! generated sixteen queries at a time (one Philox block per query and eight keys, the
//! sixteen blocks side by side in vector lanes) and applied as it is generated — the mask
//! is never stored.

use core::ops::Range;

use attn_core::HeadDropout;

use super::multiversion;

/// Queries per batch of Philox blocks.
const LANES: usize = 16;

/// The Philox words of queries `first .. first + LANES` (a tile's rows; the lanes past its
/// last row are computed and ignored) for keys `8·octet .. 8·octet + 8`: word `w` of lane
/// `l` is [`HeadDropout::words`]`(first + l, octet)[w]`. In the vector registers of the
/// process's path: the ten rounds are all of dropout's cost.
#[inline(always)]
fn words(d: &HeadDropout, isa: super::Isa, first: usize, octet: usize) -> [[u32; LANES]; 4] {
    #[cfg(target_arch = "x86_64")]
    match isa {
        // SAFETY: the AVX-512 path runs only where the CPU has AVX-512F.
        super::Isa::Avx512 => return unsafe { x86::words_avx512(d, first, octet) },
        // SAFETY: the AVX2 path runs only where the CPU has AVX2.
        super::Isa::Avx2 => return unsafe { x86::words_avx2(d, first, octet) },
        _ => {}
    }
    let _ = isa;
    portable_words(d, first, octet)
}

/// [`words`] one lane at a time.
fn portable_words(d: &HeadDropout, first: usize, octet: usize) -> [[u32; LANES]; 4] {
    let mut out = [[0; LANES]; 4];
    for l in 0..LANES {
        let w = d.words(first + l, octet);
        for (o, x) in out.iter_mut().zip(w) {
            o[l] = x;
        }
    }
    out
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use core::arch::x86_64::*;

    use attn_core::{HeadDropout, PHILOX_MULTIPLIERS, PHILOX_ROUNDS, PHILOX_WEYL};

    use super::LANES;

    /// The high and low words of `a · m` lane by lane (`m` broadcast): the even lanes'
    /// products and the odd lanes' (shifted down) side by side, their halves blended.
    #[target_feature(enable = "avx512f")]
    #[inline]
    fn mulhilo512(a: __m512i, m: __m512i) -> (__m512i, __m512i) {
        let even = _mm512_mul_epu32(a, m);
        let odd = _mm512_mul_epu32(_mm512_srli_epi64::<32>(a), m);
        let hi = _mm512_mask_blend_epi32(0xAAAA, _mm512_srli_epi64::<32>(even), odd);
        let lo = _mm512_mask_blend_epi32(0xAAAA, even, _mm512_slli_epi64::<32>(odd));
        (hi, lo)
    }

    /// [`super::words`] in sixteen 32-bit lanes.
    #[target_feature(enable = "avx512f")]
    pub(super) fn words_avx512(d: &HeadDropout, first: usize, octet: usize) -> [[u32; LANES]; 4] {
        let lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
        let mut c0 = _mm512_add_epi32(_mm512_set1_epi32(first as i32), lanes);
        let mut c1 = _mm512_set1_epi32(octet as i32);
        let mut c2 = _mm512_set1_epi32(d.stream as i32);
        let mut c3 = _mm512_set1_epi32(d.offset as i32);
        let m0 = _mm512_set1_epi64(i64::from(PHILOX_MULTIPLIERS[0]));
        let m1 = _mm512_set1_epi64(i64::from(PHILOX_MULTIPLIERS[1]));
        let [mut k0, mut k1] = d.key;
        for _ in 0..PHILOX_ROUNDS {
            let (hi0, lo0) = mulhilo512(c0, m0);
            let (hi1, lo1) = mulhilo512(c2, m1);
            // 0x96: a ^ b ^ c.
            c0 = _mm512_ternarylogic_epi32::<0x96>(hi1, c1, _mm512_set1_epi32(k0 as i32));
            c2 = _mm512_ternarylogic_epi32::<0x96>(hi0, c3, _mm512_set1_epi32(k1 as i32));
            (c1, c3) = (lo1, lo0);
            k0 = k0.wrapping_add(PHILOX_WEYL[0]);
            k1 = k1.wrapping_add(PHILOX_WEYL[1]);
        }
        // SAFETY: a vector of sixteen 32-bit lanes is sixteen u32 (any bits are valid).
        [c0, c1, c2, c3].map(|v| unsafe { core::mem::transmute::<__m512i, [u32; LANES]>(v) })
    }

    /// [`mulhilo512`] in eight lanes.
    #[target_feature(enable = "avx2")]
    #[inline]
    fn mulhilo256(a: __m256i, m: __m256i) -> (__m256i, __m256i) {
        let even = _mm256_mul_epu32(a, m);
        let odd = _mm256_mul_epu32(_mm256_srli_epi64::<32>(a), m);
        let hi = _mm256_blend_epi32::<0xAA>(_mm256_srli_epi64::<32>(even), odd);
        let lo = _mm256_blend_epi32::<0xAA>(even, _mm256_slli_epi64::<32>(odd));
        (hi, lo)
    }

    /// [`super::words`] in two vectors of eight 32-bit lanes.
    #[target_feature(enable = "avx2")]
    pub(super) fn words_avx2(d: &HeadDropout, first: usize, octet: usize) -> [[u32; LANES]; 4] {
        let mut out = [[0u32; LANES]; 4];
        let m0 = _mm256_set1_epi64x(i64::from(PHILOX_MULTIPLIERS[0]));
        let m1 = _mm256_set1_epi64x(i64::from(PHILOX_MULTIPLIERS[1]));
        for half in 0..2 {
            let base = (first + 8 * half) as i32;
            let mut c0 = _mm256_add_epi32(
                _mm256_set1_epi32(base),
                _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
            );
            let mut c1 = _mm256_set1_epi32(octet as i32);
            let mut c2 = _mm256_set1_epi32(d.stream as i32);
            let mut c3 = _mm256_set1_epi32(d.offset as i32);
            let [mut k0, mut k1] = d.key;
            for _ in 0..PHILOX_ROUNDS {
                let (hi0, lo0) = mulhilo256(c0, m0);
                let (hi1, lo1) = mulhilo256(c2, m1);
                let x0 = _mm256_xor_si256(hi1, c1);
                let x2 = _mm256_xor_si256(hi0, c3);
                c0 = _mm256_xor_si256(x0, _mm256_set1_epi32(k0 as i32));
                c2 = _mm256_xor_si256(x2, _mm256_set1_epi32(k1 as i32));
                (c1, c3) = (lo1, lo0);
                k0 = k0.wrapping_add(PHILOX_WEYL[0]);
                k1 = k1.wrapping_add(PHILOX_WEYL[1]);
            }
            for (o, v) in out.iter_mut().zip([c0, c1, c2, c3]) {
                // SAFETY: a vector of eight 32-bit lanes is eight u32 (any bits are valid).
                let w = unsafe { core::mem::transmute::<__m256i, [u32; 8]>(v) };
                o[8 * half..8 * half + 8].copy_from_slice(&w);
            }
        }
        out
    }
}

/// All ones where the weight of key `j` is kept (its 16 bits in `word`,
/// [`HeadDropout::bits`]), else 0. A mask rather than a `bool`: the loops below AND it
/// into the bits (branch-free, so they vectorise).
#[inline(always)]
fn kept(word: u32, j: usize, threshold: u32) -> u32 {
    u32::from(HeadDropout::bits(word, j) >= threshold).wrapping_neg()
}

/// `x` where `mask` is all ones, +0 where it is 0.
#[inline(always)]
fn select(x: f32, mask: u32) -> f32 {
    f32::from_bits(x.to_bits() & mask)
}

/// Calls `f(col, first_row, words, j)` for every column of a tile over queries `rows` and
/// keys `cols` (global positions; tile row `r` is query `rows.start + r`, tile column `c`
/// key `j = cols.start + c`), sixteen rows at a time: key `j`'s 16 bits of `words[l]`
/// decide the weight of row `first_row + l` ([`kept`]); the last group of a tile may have
/// fewer than sixteen rows (the callers stop at the tile's last row).
#[inline(always)]
fn for_each_column(
    d: &HeadDropout,
    (rows, cols): (Range<usize>, Range<usize>),
    mut f: impl FnMut(usize, usize, &[u32; LANES], usize),
) {
    if cols.is_empty() {
        return;
    }
    let isa = super::Isa::current().vectors();
    for first in rows.clone().step_by(LANES) {
        for octet in cols.start / 8..=(cols.end - 1) / 8 {
            let w = words(d, isa, first, octet);
            for j in (octet * 8..octet * 8 + 8).filter(|j| cols.contains(j)) {
                f(j - cols.start, first - rows.start, &w[j % 8 / 2], j);
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
    let (scale, threshold, nr) = (d.scale, d.threshold, at.0.len());
    for_each_column(d, at, |c, r, words, j| {
        let n = LANES.min(nr - r);
        let col = &mut p[c * ld + r..c * ld + r + n];
        if let Ok(col) = <&mut [f32; LANES]>::try_from(&mut col[..]) {
            // A whole group: a fixed trip count, which vectorises to a compare and a blend.
            for (x, &w) in col.iter_mut().zip(words) {
                *x = select(*x * scale, kept(w, j, threshold));
            }
        } else {
            for (x, &w) in col.iter_mut().zip(words) {
                *x = select(*x * scale, kept(w, j, threshold));
            }
        }
    });
}

multiversion! {
    /// Drops the weights of a column-major tile (`ld` apart) over queries and keys `at`
    /// (global positions): a kept weight times `1/(1 − p)`, a dropped one 0.
    pub(crate) fn drop_weights(p: &mut [f32], ld: usize, at: (Range<usize>, Range<usize>), d: &HeadDropout) = drop_weights_body
}

/// One entry of [`score_gradient_dropped`]: `(dS, P ∘ Z·s)` from `dO·V_j`, `P` and `D_i`,
/// `kept` a [`kept`] mask.
#[inline(always)]
fn dropped_gradient(dp: f32, p: f32, di: f32, kept: u32, scale: f32) -> (f32, f32) {
    let g = p * (select(dp * scale, kept) - di);
    // Weight 0 (hidden) has gradient 0, even where dP or D is not finite.
    let nonzero = u32::from(p != 0.0).wrapping_neg();
    (select(g, nonzero), select(p * scale, kept))
}

#[inline(always)]
fn score_gradient_body<const FMA: bool>(
    dp: &mut [f32],
    p: &mut [f32],
    ld: usize,
    at: (Range<usize>, Range<usize>),
    (d, dropout): (&[f32], &HeadDropout),
) {
    let (scale, threshold, nr) = (dropout.scale, dropout.threshold, at.0.len());
    for_each_column(dropout, at, |c, r, words, j| {
        let n = LANES.min(nr - r);
        let range = c * ld + r..c * ld + r + n;
        let (dcol, pcol, d) = (&mut dp[range.clone()], &mut p[range], &d[r..r + n]);
        let whole = (
            <&mut [f32; LANES]>::try_from(&mut dcol[..]),
            <&mut [f32; LANES]>::try_from(&mut pcol[..]),
            <&[f32; LANES]>::try_from(d),
        );
        if let (Ok(dcol), Ok(pcol), Ok(d)) = whole {
            for l in 0..LANES {
                let kept = kept(words[l], j, threshold);
                (dcol[l], pcol[l]) = dropped_gradient(dcol[l], pcol[l], d[l], kept, scale);
            }
        } else {
            for l in 0..n {
                let kept = kept(words[l], j, threshold);
                (dcol[l], pcol[l]) = dropped_gradient(dcol[l], pcol[l], d[l], kept, scale);
            }
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
    fn every_path_draws_the_contracts_words() {
        let d = Dropout::new(0.5, 0xfeed_beef_0000_0001)
            .unwrap()
            .with_offset(3)
            .for_head(2, 1, 4)
            .unwrap();
        for (first, octet) in [(0, 0), (13, 7), (u32::MAX as usize - 20, 1 << 29)] {
            let want = portable_words(&d, first, octet);
            assert_eq!(
                words(&d, crate::kernel::Isa::current().vectors(), first, octet),
                want
            );
            for (w, lanes) in want.iter().enumerate() {
                for (l, &x) in lanes.iter().enumerate() {
                    let i = (first + l) as u32 as usize;
                    assert_eq!(x, d.words(i, octet)[w]);
                }
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

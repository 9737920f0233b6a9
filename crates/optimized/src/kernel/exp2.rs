//! A vectorisable `2^x`.
//!
//! The engine folds `log2(e)` into the query scale, so the softmax needs `2^x` instead of
//! `e^x`: range reduction `x = k + f` with `k = round(x)`, `|f| ≤ ½`, then `2^k` built in
//! the exponent bits and `2^f` by Cephes' degree-6 minimax polynomial (≤ 2 ulp). The code
//! is branch-free scalar Rust that LLVM turns into AVX-512 or AVX2 vectors inside the
//! `#[target_feature]` copies that [`multiversion!`](super::multiversion) generates.

use super::{mul_add, multiversion};

/// `2^x` to within 2 ulp for normal results; exactly 0 below −126 (and at −∞), +∞ from
/// 127.5 on (where `k` rounds to 128; [`exp2_in_place`] covers `[127.5, 128)` too), NaN
/// for NaN.
#[inline(always)]
pub(crate) fn exp2_approx<const FMA: bool>(x: f32) -> f32 {
    // Adding 1.5·2^23 rounds x to an integer k (ties to even) held in the low mantissa bits.
    const ROUND: f32 = 12_582_912.0;
    let t = x + ROUND;
    let k = t - ROUND;
    let f = x - k;
    // Cephes exp2f: 2^f = 1 + f·P(f) on [-½, ½].
    let mut p = 1.535_336_2e-4;
    p = mul_add::<FMA>(p, f, 1.339_887_4e-3);
    p = mul_add::<FMA>(p, f, 9.618_438e-3);
    p = mul_add::<FMA>(p, f, 5.550_332_5e-2);
    p = mul_add::<FMA>(p, f, 2.402_264_8e-1);
    p = mul_add::<FMA>(p, f, 6.931_472e-1);
    let p = mul_add::<FMA>(p, f, 1.0);
    let ki = (t.to_bits() as i32).wrapping_sub(0x4B40_0000);
    let two_k = f32::from_bits((ki.wrapping_add(127) as u32).wrapping_shl(23));
    let r = p * two_k;
    let r = if x >= 128.0 { f32::INFINITY } else { r };
    if x < -126.0 { 0.0 } else { r }
}

/// [`exp2_approx`] over the whole f32 range: on `[127.5, 128)` the range reduction rounds
/// `k` up to 128, whose `2^k` overflows although `2^x` does not, so there it is `2·2^(x−1)`.
/// (The softmax never gets there: its arguments are at most [`super::online_softmax::LAZY_RESCALE_LOG2`].)
#[inline(always)]
fn exp2_full_range<const FMA: bool>(x: f32) -> f32 {
    let top = x >= 127.5;
    let y = exp2_approx::<FMA>(if top { x - 1.0 } else { x });
    if top { y * 2.0 } else { y }
}

#[inline(always)]
fn exp2_in_place_body<const FMA: bool>(xs: &mut [f32]) {
    for x in xs {
        *x = exp2_full_range::<FMA>(*x);
    }
}

multiversion! {
    /// Replaces every `x` by `2^x` (within 2 ulp; 0 below −126 and at −∞, +∞ from 128 on,
    /// NaN stays NaN), vectorised for the CPU it runs on.
    ///
    /// ```
    /// let mut xs = [0.0f32, 1.0, -1.0, 10.5, f32::NEG_INFINITY, -1000.0];
    /// attn_optimized::exp::exp2_in_place(&mut xs);
    /// assert_eq!(&xs[..3], &[1.0, 2.0, 0.5]);
    /// assert!((xs[3] - 1448.1547).abs() < 1e-3);
    /// assert_eq!(&xs[4..], &[0.0, 0.0]);
    /// ```
    pub fn exp2_in_place(xs: &mut [f32]) = exp2_in_place_body
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ulp_error(got: f32, x: f32) -> f64 {
        let want = (x as f64).exp2();
        let ulp = f64::from(f32::from_bits((want as f32).to_bits() + 1) - want as f32);
        (f64::from(got) - want).abs() / ulp
    }

    #[test]
    fn exp2_within_two_ulp_over_the_normal_range() {
        let mut worst = 0.0f64;
        let mut x = -126.0f32;
        while x < 127.0 {
            for fma in [false, true] {
                let got = if fma {
                    exp2_approx::<true>(x)
                } else {
                    exp2_approx::<false>(x)
                };
                worst = worst.max(ulp_error(got, x));
            }
            x += 0.000_731;
        }
        assert!(worst <= 2.0, "worst error {worst} ulp");
    }

    #[test]
    fn exp2_edges_are_exact() {
        for fma in [false, true] {
            let e = |x: f32| {
                if fma {
                    exp2_approx::<true>(x)
                } else {
                    exp2_approx::<false>(x)
                }
            };
            assert_eq!(e(0.0), 1.0);
            assert_eq!(e(-0.0), 1.0);
            assert_eq!(e(f32::NEG_INFINITY), 0.0);
            assert_eq!(e(-1e30), 0.0);
            assert_eq!(e(-126.5), 0.0);
            assert_eq!(e(200.0), f32::INFINITY);
            assert_eq!(e(f32::INFINITY), f32::INFINITY);
            assert!(e(f32::NAN).is_nan());
            for k in -126..128 {
                assert_eq!(e(k as f32), (k as f64).exp2() as f32, "2^{k}");
            }
        }
    }

    #[test]
    fn dispatched_slice_matches_scalar() {
        let mut xs: Vec<f32> = (0..1000).map(|i| (i as f32 - 500.0) * 0.37).collect();
        let want: Vec<f32> = xs.iter().map(|&x| exp2_full_range::<true>(x)).collect();
        exp2_in_place(&mut xs);
        for (g, w) in xs.iter().zip(&want) {
            assert!(g == w || (g - w).abs() <= w.abs() * 2.4e-7, "{g} vs {w}");
        }
    }

    #[test]
    fn the_slice_version_is_finite_up_to_128() {
        let mut xs = [127.5f32, 127.75, 127.999_99, 128.0, 200.0];
        exp2_in_place(&mut xs);
        for (&got, x) in xs[..3].iter().zip([127.5f32, 127.75, 127.999_99]) {
            assert!(got.is_finite() && ulp_error(got, x) <= 2.0, "2^{x} = {got}");
        }
        assert_eq!(&xs[3..], &[f32::INFINITY, f32::INFINITY]);
    }
}

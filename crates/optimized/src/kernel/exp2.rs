//! A vectorisable `2^x`, and the `log2` that turns a softmax's sums into log-sum-exps.
//!
//! The engine folds `log2(e)` into the query scale, so the softmax needs `2^x` instead of
//! `e^x`: range reduction `x = k + f` with `k = round(x)`, `|f| ≤ ½`, then `2^k` built in
//! the exponent bits and `2^f` by a degree-5 minimax polynomial (relative error ≤ 3u). The code
//! is branch-free scalar Rust that LLVM turns into AVX-512 or AVX2 vectors inside the
//! `#[target_feature]` copies that [`multiversion!`](super::multiversion) generates.

use super::{mul_add, multiversion};

/// `1.5·2^23`: adding it rounds a float to an integer (ties to even) held in the low
/// mantissa bits.
pub(crate) const ROUND: f32 = 12_582_912.0;

/// A degree-5 minimax polynomial for `2^f = P(f)` on `[-½, ½]` in relative error (its
/// own error 1.5u, 2.8u after Horner's rule in f32 with fused multiply-adds, 3u without;
/// `u = 2⁻²⁴`), highest coefficient first: one step fewer than Cephes' degree 6 for a
/// quarter of the bound's `e_x = 4u` (the softmax's most frequent operation). The vector
/// copies in [`super::pair_dot`] use the same steps, so their bits are these.
// The linear coefficient is the minimax one, not `ln 2`.
#[allow(clippy::approx_constant)]
pub(crate) const EXP2_POLY: [f32; 6] = [
    1.326_470_9e-3,
    9.671_511e-3,
    5.550_734e-2,
    2.402_225e-1,
    6.931_47e-1,
    1.0,
];

/// `2^x` to within 3u (relative, `u = 2⁻²⁴`) for normal results; exactly 0 below −126 (and at −∞), +∞ from
/// 127.5 on (where `k` rounds to 128; [`exp2_in_place`] covers `[127.5, 128)` too), NaN
/// for NaN.
#[inline(always)]
pub(crate) fn exp2_approx<const FMA: bool>(x: f32) -> f32 {
    // k = round(x), in t's low mantissa bits.
    let t = x + ROUND;
    let k = t - ROUND;
    let f = x - k;
    let mut p = EXP2_POLY[0];
    for &c in &EXP2_POLY[1..] {
        p = mul_add::<FMA>(p, f, c);
    }
    let ki = (t.to_bits() as i32).wrapping_sub(0x4B40_0000);
    let two_k = f32::from_bits((ki.wrapping_add(127) as u32).wrapping_shl(23));
    let r = p * two_k;
    let r = if x >= 128.0 { f32::INFINITY } else { r };
    if x < -126.0 { 0.0 } else { r }
}

/// `log2(x)` to within 2 ulp (absolutely within 2⁻²³ near `x = 1`), branch-free so that a
/// loop over rows vectorises (libm's `log2f` is a call per row): `x = 2^e·m` with `m` in
/// `[√½, √2)`, then `ln m` by Cephes' `logf` polynomial. Subnormals are scaled up first;
/// `+∞`, NaN, 0 and negative inputs give what `f32::log2` gives.
#[inline(always)]
pub(crate) fn log2_approx<const FMA: bool>(x: f32) -> f32 {
    const SQRT_HALF: u32 = 0x3f35_04f3;
    let tiny = x < f32::MIN_POSITIVE;
    let (y, bias) = if tiny {
        (x * 8_388_608.0, -23.0)
    } else {
        (x, 0.0)
    };
    // Subtracting √½'s bits moves mantissas at or above √2 into the next binade, so the
    // exponent and the mantissa below come out already reduced to [√½, √2).
    let adj = y.to_bits().wrapping_sub(SQRT_HALF);
    let e = ((adj as i32) >> 23) as f32 + bias;
    let f = f32::from_bits((adj & 0x007f_ffff).wrapping_add(SQRT_HALF)) - 1.0;
    // ln(1 + f) = f − f²/2 + f³·P(f) (Cephes logf).
    let mut p = 7.037_683_6e-2;
    p = mul_add::<FMA>(p, f, -1.151_461e-1);
    p = mul_add::<FMA>(p, f, 1.167_699_9e-1);
    p = mul_add::<FMA>(p, f, -1.242_014_1e-1);
    p = mul_add::<FMA>(p, f, 1.424_932_3e-1);
    p = mul_add::<FMA>(p, f, -1.666_805_8e-1);
    p = mul_add::<FMA>(p, f, 2.000_071_4e-1);
    p = mul_add::<FMA>(p, f, -2.499_999_4e-1);
    p = mul_add::<FMA>(p, f, 3.333_333e-1);
    let z = f * f;
    let ln = mul_add::<FMA>(z * f, p, mul_add::<FMA>(-0.5, z, f));
    let r = mul_add::<FMA>(ln, core::f32::consts::LOG2_E, e);
    if x > 0.0 && x < f32::INFINITY {
        r
    } else if x == 0.0 {
        f32::NEG_INFINITY
    } else if x == f32::INFINITY {
        x
    } else {
        f32::NAN
    }
}

/// [`exp2_approx`] over the whole f32 range: on `[127.5, 128)` the range reduction rounds
/// `k` up to 128, whose `2^k` overflows although `2^x` does not, so there it is `2·2^(x−1)`.
/// (The softmax never gets there: its arguments are at most
/// [`super::online_softmax::LAZY_RESCALE_LOG2`] plus log2 of a block's keys.)
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
    /// Replaces every `x` by `2^x` (within 3u relative; 0 below −126 and at −∞, +∞ from 128 on,
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

    /// The relative error of `got` as `2^x`, in units of `u = 2⁻²⁴`.
    fn error_in_u(got: f32, x: f32) -> f64 {
        let want = (x as f64).exp2();
        (f64::from(got) - want).abs() / want / 2f64.powi(-24)
    }

    #[test]
    fn exp2_within_three_u_over_the_normal_range() {
        let mut worst = 0.0f64;
        let mut x = -126.0f32;
        while x < 127.0 {
            for fma in [false, true] {
                let got = if fma {
                    exp2_approx::<true>(x)
                } else {
                    exp2_approx::<false>(x)
                };
                worst = worst.max(error_in_u(got, x));
            }
            x += 0.000_731;
        }
        assert!(worst <= 3.0, "worst error {worst}u");
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
            assert!(
                got.is_finite() && error_in_u(got, x) <= 3.0,
                "2^{x} = {got}"
            );
        }
        assert_eq!(&xs[3..], &[f32::INFINITY, f32::INFINITY]);
    }

    #[test]
    fn log2_within_two_ulp_or_two_to_the_minus_23() {
        let mut worst = 0.0f64;
        let mut check = |x: f32| {
            for fma in [false, true] {
                let got = if fma {
                    log2_approx::<true>(x)
                } else {
                    log2_approx::<false>(x)
                };
                let want = (x as f64).log2();
                let ulp = f64::from(f32::from_bits((want.abs() as f32).to_bits() + 1))
                    - f64::from(want.abs() as f32);
                let err = (f64::from(got) - want).abs() / ulp.max(2f64.powi(-24));
                worst = worst.max(err);
            }
        };
        for bits in (1..0x7f80_0000u32).step_by(4099) {
            check(f32::from_bits(bits));
        }
        let mut x = 0.5f32;
        while x < 2.0 {
            check(x);
            x += 1.3e-6;
        }
        assert!(worst <= 2.0, "worst error {worst}");
    }

    #[test]
    fn log2_edges_are_libm_s() {
        for x in [
            1.0f32,
            2.0,
            0.5,
            1024.0,
            f32::MIN_POSITIVE,
            f32::MAX,
            f32::from_bits(1),
        ] {
            assert_eq!(log2_approx::<true>(x), x.log2(), "log2 {x}");
        }
        assert_eq!(log2_approx::<true>(0.0), f32::NEG_INFINITY);
        assert_eq!(log2_approx::<true>(f32::INFINITY), f32::INFINITY);
        assert!(log2_approx::<true>(f32::NAN).is_nan());
        assert!(log2_approx::<true>(-1.0).is_nan());
    }
}

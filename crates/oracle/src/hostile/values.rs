//! The hostile values: single values at the extremes and the fills of a matrix.

use super::*;

/// A single hostile value.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Special {
    /// NaN.
    Nan,
    /// `+inf`.
    PosInf,
    /// `-inf`.
    NegInf,
    /// `f32::MAX`.
    Max,
    /// `f32::MIN` (the Hugging Face padding bias).
    Min,
    /// `1e38`.
    Huge,
    /// `-1e38`.
    NegHuge,
    /// `f32::MIN_POSITIVE`, the smallest normal.
    MinPositive,
    /// The smallest positive subnormal.
    Subnormal,
    /// The smallest negative subnormal.
    NegSubnormal,
    /// `-0.0`.
    NegZero,
}

impl Special {
    /// The non-finite values.
    pub const NON_FINITE: [Special; 3] = [Special::Nan, Special::PosInf, Special::NegInf];

    /// Non-finite values and the largest finite ones (whose products overflow f32).
    pub const POISONS: [Special; 6] = [
        Special::Nan,
        Special::PosInf,
        Special::NegInf,
        Special::Max,
        Special::Min,
        Special::Huge,
    ];

    /// The finite extremes.
    pub const FINITE_EXTREMES: [Special; 8] = [
        Special::Max,
        Special::Min,
        Special::Huge,
        Special::NegHuge,
        Special::MinPositive,
        Special::Subnormal,
        Special::NegSubnormal,
        Special::NegZero,
    ];

    /// The value.
    ///
    /// ```
    /// use attn_oracle::hostile::Special;
    /// assert_eq!(Special::Min.value(), f32::MIN);
    /// assert!(Special::Subnormal.value() > 0.0 && !Special::Subnormal.value().is_normal());
    /// ```
    pub fn value(self) -> f32 {
        match self {
            Special::Nan => f32::NAN,
            Special::PosInf => f32::INFINITY,
            Special::NegInf => f32::NEG_INFINITY,
            Special::Max => f32::MAX,
            Special::Min => f32::MIN,
            Special::Huge => 1e38,
            Special::NegHuge => -1e38,
            Special::MinPositive => f32::MIN_POSITIVE,
            Special::Subnormal => f32::from_bits(1),
            Special::NegSubnormal => -f32::from_bits(1),
            Special::NegZero => -0.0,
        }
    }
}

/// How the entries of an operand are drawn (then rounded to the storage type, so that the
/// contract is judged on the values the engine actually stores).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Fill {
    /// Zeros.
    Zero,
    /// Uniform in `[-1, 1]`.
    Unit,
    /// Integers in `{-2, …, 2}`: ties.
    Ties,
    /// Uniform in `[-35, 35]`: large logits.
    Large,
    /// Subnormals of the storage type, zeros and `±1`.
    Subnormal,
    /// Half the entries a finite extreme of the storage type (its largest finite value,
    /// `±1e38`, the smallest normal, subnormals, `-0`), the others in `[-1, 1]`.
    Extreme,
    /// A quarter of the entries NaN or `±inf`, the others in `[-1, 1]`.
    NonFinite,
}

impl Fill {
    /// The fills whose values are finite and moderate.
    pub const MODERATE: [Fill; 5] = [
        Fill::Unit,
        Fill::Ties,
        Fill::Zero,
        Fill::Large,
        Fill::Subnormal,
    ];

    pub(super) fn sample(self, rng: &mut Rng, dtype: Dtype) -> f32 {
        let unit = |rng: &mut Rng| (rng.unit() * 2.0 - 1.0) as f32;
        let x = match self {
            Fill::Zero => 0.0,
            Fill::Unit => unit(rng),
            Fill::Ties => rng.below(5) as f32 - 2.0,
            Fill::Large => ((rng.unit() * 2.0 - 1.0) * 35.0) as f32,
            Fill::Subnormal => match rng.below(4) {
                0 => 0.0,
                1 => sign(rng),
                _ => sign(rng) * subnormal(rng, dtype),
            },
            Fill::Extreme => {
                if rng.below(2) == 0 {
                    unit(rng)
                } else {
                    let max = dtype.max();
                    match rng.below(7) {
                        0 => max,
                        1 => -max,
                        2 => sign(rng) * 1e38f32.min(max),
                        3 => sign(rng) * dtype.smallest_normal() as f32,
                        4 => sign(rng) * subnormal(rng, dtype),
                        5 => -0.0,
                        _ => sign(rng) * max * 0.5,
                    }
                }
            }
            Fill::NonFinite => {
                if rng.below(4) == 0 {
                    Special::NON_FINITE[rng.below(3) as usize].value()
                } else {
                    unit(rng)
                }
            }
        };
        dtype.round(x)
    }
}

pub(super) fn sign(rng: &mut Rng) -> f32 {
    if rng.next_u64() & 1 == 0 { 1.0 } else { -1.0 }
}

pub(super) fn subnormal(rng: &mut Rng, dtype: Dtype) -> f32 {
    match dtype {
        Dtype::F16 => (1 + rng.below(1023)) as f32 * 2f32.powi(-24),
        Dtype::Bf16 => f32::from_bits(((1 + rng.below(127)) as u32) << 16),
        Dtype::F32 => f32::from_bits(1 + rng.below(0x7F_FFFE) as u32),
    }
}

/// The finite values of an additive mask.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum BiasFill {
    /// Zeros.
    Zero,
    /// Normal with standard deviation 2.
    Small,
    /// Uniform in `[-1e4, 1e4]`.
    Large,
    /// Half the entries `f32::MIN` (the Hugging Face padding bias), the others small.
    Min,
    /// Half the rows `f32::MIN` everywhere (a row "masked" with a finite bias: the formula
    /// gives a near-uniform average of V), the others small.
    MinRows,
    /// A third of the entries one of `f32::MIN`, `f32::MAX`, `±1e38`, `±1e30`.
    Extreme,
    /// A quarter of the entries NaN or `+inf` (each makes its row NaN where visible).
    NonFinite,
}

impl BiasFill {
    pub(super) fn sample(self, rng: &mut Rng, min_row: bool) -> f32 {
        let small = |rng: &mut Rng| (rng.normal() * 2.0) as f32;
        match self {
            BiasFill::Zero => 0.0,
            BiasFill::Small => small(rng),
            BiasFill::Large => ((rng.unit() * 2.0 - 1.0) * 1e4) as f32,
            BiasFill::Min => {
                if rng.below(2) == 0 {
                    f32::MIN
                } else {
                    small(rng)
                }
            }
            BiasFill::MinRows => {
                if min_row {
                    f32::MIN
                } else {
                    small(rng)
                }
            }
            BiasFill::Extreme => {
                if rng.below(3) == 0 {
                    [f32::MIN, f32::MAX, 1e38, -1e38, 1e30, -1e30][rng.below(6) as usize]
                } else {
                    small(rng)
                }
            }
            BiasFill::NonFinite => {
                if rng.below(4) == 0 {
                    [f32::NAN, f32::INFINITY][rng.below(2) as usize]
                } else {
                    small(rng)
                }
            }
        }
    }
}

/// An additive mask recipe.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct BiasRecipe {
    /// The values that are not `-inf`.
    pub fill: BiasFill,
    /// Percentage of `-inf` entries.
    pub neg_inf_percent: u8,
    /// Percentage of rows that are `-inf` everywhere.
    pub hidden_rows_percent: u8,
}

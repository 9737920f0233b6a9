//! Options at their extremes: scales, windows, key lengths.

use super::*;

/// A key-padding length, relative to the number of keys.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum KeyLen {
    /// `n_k · p / 1000` (valid).
    Permille(u16),
    /// `n_k + 1 + x` (invalid: longer than the keys).
    Beyond(u8),
    /// `usize::MAX` (invalid).
    Max,
}

impl KeyLen {
    /// The length for `n_k` keys.
    pub fn resolve(self, n_k: usize) -> usize {
        match self {
            KeyLen::Permille(p) => n_k * usize::from(p.min(1000)) / 1000,
            KeyLen::Beyond(x) => n_k.saturating_add(1 + usize::from(x)),
            KeyLen::Max => usize::MAX,
        }
    }
}

/// Whether the amended contract accepts `scale`: any value (zero and negative ones too, as
/// torch) whose `scale·log2 e` is finite in f32 (the streaming engines fold `log2 e` into
/// the scale).
///
/// ```
/// use attn_oracle::hostile::scale_is_valid;
/// assert!(scale_is_valid(2.0e38) && scale_is_valid(1e-40) && scale_is_valid(0.0));
/// assert!(scale_is_valid(-1.0) && !scale_is_valid(f32::MIN));
/// assert!(!scale_is_valid(f32::MAX) && !scale_is_valid(f32::NAN));
/// ```
pub fn scale_is_valid(scale: f32) -> bool {
    (scale * core::f32::consts::LOG2_E).is_finite()
}

/// Explicit scales at the extremes, valid and invalid; none lies within a relative `1e-3`
/// of the overflow threshold of `scale·log2 e`, where engines may round either way.
pub fn extreme_scales() -> Vec<f32> {
    vec![
        f32::MAX,
        2.5e38,
        2.0e38,
        1e30,
        1.0,
        1e-30,
        f32::MIN_POSITIVE,
        1e-40,
        f32::from_bits(1),
        0.0,
        -0.0,
        -1.0,
        f32::MIN,
        f32::NAN,
        f32::INFINITY,
        f32::NEG_INFINITY,
    ]
}

/// One side of a sliding window at the extremes: small, around the sequence lengths, and
/// near `usize::MAX` (where a conversion to `i64` wraps).
pub fn extreme_window_side() -> BoxedStrategy<Option<usize>> {
    prop_oneof![
        1 => Just(None),
        3 => (0..=4usize).prop_map(Some),
        1 => (0..=600usize).prop_map(Some),
        3 => select(vec![
            usize::MAX,
            usize::MAX - 1,
            i64::MAX as usize,
            i64::MAX as usize + 1,
            i64::MAX as usize - 1,
            usize::MAX / 2 + 7,
            1usize << 62,
            u32::MAX as usize + 1,
        ])
        .prop_map(Some),
    ]
    .boxed()
}

pub(super) fn moderate_window_side() -> BoxedStrategy<Option<usize>> {
    proptest::option::weighted(0.8, prop_oneof![2 => 0..=4usize, 1 => 0..=600usize]).boxed()
}

pub(super) fn causal() -> BoxedStrategy<Causal> {
    prop_oneof![Just(Causal::TopLeft), Just(Causal::BottomRight)].boxed()
}

/// Whether a window bound is so large that the amendment lets an engine reject it.
pub(super) fn huge_side(side: Option<usize>) -> bool {
    side.is_some_and(|s| s > u32::MAX as usize)
}

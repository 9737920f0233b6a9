//! Element types the reference reads: everything widens to f64.

/// A storage type the reference accepts; it computes in f64 whatever the input.
///
/// ```
/// use attn_reference::Element;
/// assert_eq!(half::f16::from_f32(0.5).to_f64(), 0.5);
/// assert_eq!(<f32 as Element>::from_f64(0.1), 0.1f32);
/// ```
pub trait Element: Copy + Send + Sync + 'static {
    /// Exact widening to f64.
    fn to_f64(self) -> f64;
    /// Rounding to this type (round to nearest even).
    fn from_f64(x: f64) -> Self;
}

impl Element for f64 {
    fn to_f64(self) -> f64 {
        self
    }
    fn from_f64(x: f64) -> Self {
        x
    }
}

impl Element for f32 {
    fn to_f64(self) -> f64 {
        f64::from(self)
    }
    fn from_f64(x: f64) -> Self {
        x as f32
    }
}

impl Element for half::f16 {
    fn to_f64(self) -> f64 {
        half::f16::to_f64(self)
    }
    fn from_f64(x: f64) -> Self {
        half::f16::from_f64(x)
    }
}

impl Element for half::bf16 {
    fn to_f64(self) -> f64 {
        half::bf16::to_f64(self)
    }
    fn from_f64(x: f64) -> Self {
        half::bf16::from_f64(x)
    }
}

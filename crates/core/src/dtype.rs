//! The element types attn stores: one name for them across the engines, the bindings, the
//! oracle and the reports.

/// An element type attn reads and writes: f32, or a half-precision storage format whose
/// arithmetic is done in f32 (or wider).
///
/// ```
/// use attn_core::Dtype;
/// assert_eq!(Dtype::from_name("bf16"), Some(Dtype::Bf16));
/// assert_eq!(Dtype::F16.name(), "f16");
/// assert_eq!(Dtype::Bf16.bytes(), 2);
/// assert_eq!(Dtype::Bf16.round(1.0 + 1.0 / 1024.0), 1.0); // bf16 keeps 8 bits
/// assert_eq!(Dtype::F32.unit_roundoff(), 2f64.powi(-24));
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Dtype {
    /// IEEE binary32.
    F32,
    /// IEEE binary16 (`half::f16`).
    F16,
    /// bfloat16 (`half::bf16`).
    Bf16,
}

impl Dtype {
    /// Every element type, f32 first.
    pub const ALL: [Dtype; 3] = [Dtype::F32, Dtype::F16, Dtype::Bf16];

    /// The short name (`"f32"`, `"f16"`, `"bf16"`), as command lines and reports spell it.
    pub const fn name(self) -> &'static str {
        match self {
            Dtype::F32 => "f32",
            Dtype::F16 => "f16",
            Dtype::Bf16 => "bf16",
        }
    }

    /// The type [`Dtype::name`] spells, `None` for any other string.
    pub fn from_name(name: &str) -> Option<Dtype> {
        Dtype::ALL.into_iter().find(|d| d.name() == name)
    }

    /// Bytes per element.
    pub const fn bytes(self) -> usize {
        match self {
            Dtype::F32 => 4,
            Dtype::F16 | Dtype::Bf16 => 2,
        }
    }

    /// Rounds an f32 to this type (to nearest, ties to even) and widens it back, exactly.
    pub fn round(self, x: f32) -> f32 {
        match self {
            Dtype::F32 => x,
            Dtype::F16 => half::f16::from_f32(x).to_f32(),
            Dtype::Bf16 => half::bf16::from_f32(x).to_f32(),
        }
    }

    /// The unit roundoff `u = 2^-p` (half an ulp of 1).
    pub fn unit_roundoff(self) -> f64 {
        match self {
            Dtype::F32 => 2f64.powi(-24),
            Dtype::F16 => 2f64.powi(-11),
            Dtype::Bf16 => 2f64.powi(-8),
        }
    }

    /// Half the smallest positive subnormal: the absolute rounding error near zero.
    pub fn underflow_error(self) -> f64 {
        match self {
            Dtype::F32 => 2f64.powi(-150),
            Dtype::F16 => 2f64.powi(-25),
            Dtype::Bf16 => 2f64.powi(-134),
        }
    }

    /// The smallest positive normal number: below it, rounding is absolute
    /// ([`Dtype::underflow_error`]) rather than relative.
    ///
    /// ```
    /// use attn_core::Dtype;
    /// assert_eq!(Dtype::F16.smallest_normal(), 2f64.powi(-14));
    /// assert_eq!(Dtype::Bf16.smallest_normal(), f64::from(f32::MIN_POSITIVE));
    /// ```
    pub fn smallest_normal(self) -> f64 {
        match self {
            Dtype::F32 | Dtype::Bf16 => 2f64.powi(-126),
            Dtype::F16 => 2f64.powi(-14),
        }
    }

    /// The largest finite value.
    ///
    /// ```
    /// use attn_core::Dtype;
    /// assert_eq!(Dtype::F16.max(), 65504.0);
    /// ```
    pub fn max(self) -> f32 {
        match self {
            Dtype::F32 => f32::MAX,
            Dtype::F16 => half::f16::MAX.to_f32(),
            Dtype::Bf16 => half::bf16::MAX.to_f32(),
        }
    }
}

impl core::fmt::Display for Dtype {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.write_str(self.name())
    }
}

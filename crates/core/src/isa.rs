//! The instruction set the engines' kernels run with: detected once per process, or
//! chosen by the `ATTN_ISA` environment variable (tests and benchmarks force a path that
//! is not the CPU's best, to prove or time each path on one machine).

use std::sync::OnceLock;

/// A kernel path: the instructions a family of kernels is compiled for.
///
/// Paths are not ranked: a later CPU feature need not include an earlier one (AMX tiles
/// without AVX512_FP16, AVX512_BF16 without AMX), so there is no total order, only
/// [`Isa::includes`] — whether a CPU that runs one path can also run another's kernels.
/// New paths are added as CPUs gain them (`#[non_exhaustive]`: a `match` needs a `_` arm,
/// which should take the portable code).
///
/// ```
/// use attn_core::Isa;
/// let isa = Isa::current(); // ATTN_ISA when set (and supported), else the CPU's best
/// assert!(Isa::supported().contains(&isa));
/// assert!(isa.includes(Isa::Baseline));
/// assert_eq!(Isa::from_name(isa.name()), Some(isa));
/// ```
#[non_exhaustive]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Isa {
    /// Whatever the compilation target guarantees (SSE2 on x86-64).
    Baseline,
    /// AVX2 with FMA and F16C (x86-64-v3): 8 f32 lanes.
    Avx2,
    /// AVX-512 (F, VL, DQ, BW, CD) on top of AVX2: 16 f32 lanes.
    Avx512,
    /// AVX-512 with AVX512_BF16 (`vdpbf16ps`: pairs of bf16 products summed into f32
    /// lanes, twice the f32 FMA rate): bf16 inputs multiply natively (AMD Zen 4, Intel
    /// Xeon since Sapphire Rapids).
    Avx512Bf16,
    /// AVX512_BF16 with AMX (Intel Xeon since Sapphire Rapids): bf16 products as 16×16
    /// tile blocks (`tdpbf16ps`, about 16× the f32 FMA rate). The kernels ask Linux for
    /// the tile state once and fall back to f32 products if it is refused.
    Amx,
}

/// The environment variable that forces a path (`baseline`, `avx2`, `avx512`, `avx512bf16`, `amx`).
pub const ISA_VARIABLE: &str = "ATTN_ISA";

impl Isa {
    /// Every path, in no meaningful order.
    pub const ALL: [Isa; 5] = [
        Isa::Baseline,
        Isa::Avx2,
        Isa::Avx512,
        Isa::Avx512Bf16,
        Isa::Amx,
    ];

    /// The path the kernels run with in this process: the one `ATTN_ISA` names when this
    /// CPU supports it, otherwise [`Isa::detected`]. Read once; an `ATTN_ISA` that names
    /// no path, or one this CPU lacks, is reported once on stderr and not used (see
    /// [`Isa::requested`] for the error itself).
    pub fn current() -> Isa {
        static CURRENT: OnceLock<Isa> = OnceLock::new();
        *CURRENT.get_or_init(|| match Isa::requested() {
            Ok(Some(isa)) => isa,
            Ok(None) => Isa::detected(),
            Err(why) => {
                eprintln!("attn: {why}; running {}", Isa::detected().name());
                Isa::detected()
            }
        })
    }

    /// The path `ATTN_ISA` asks for: `None` when it is unset or empty, an error when it
    /// names no path or one this CPU cannot run.
    ///
    /// ```
    /// // Under `ATTN_ISA=avx512` on an AVX2-only CPU this is an error; unset, `None`.
    /// let asked = attn_core::Isa::requested();
    /// assert!(asked.is_err() || asked.unwrap().is_none_or(|i| i.is_supported()));
    /// ```
    pub fn requested() -> Result<Option<Isa>, String> {
        let Some(value) = std::env::var_os(ISA_VARIABLE) else {
            return Ok(None);
        };
        let value = value.to_string_lossy();
        if value.trim().is_empty() {
            return Ok(None);
        }
        let names: Vec<&str> = Isa::ALL.iter().map(|i| i.name()).collect();
        match Isa::from_name(value.trim()) {
            None => Err(format!(
                "{ISA_VARIABLE}={value} names no kernel path (one of {})",
                names.join(", ")
            )),
            Some(isa) if !isa.is_supported() => Err(format!(
                "{ISA_VARIABLE}={value}: this CPU cannot run the {} path",
                isa.name()
            )),
            Some(isa) => Ok(Some(isa)),
        }
    }

    /// The best path of this CPU (detected by `std`, which caches the answer).
    pub fn detected() -> Isa {
        if Isa::Amx.is_supported() {
            Isa::Amx
        } else if Isa::Avx512Bf16.is_supported() {
            Isa::Avx512Bf16
        } else if Isa::Avx512.is_supported() {
            Isa::Avx512
        } else if Isa::Avx2.is_supported() {
            Isa::Avx2
        } else {
            Isa::Baseline
        }
    }

    /// Whether this CPU has every instruction of the path.
    pub fn is_supported(self) -> bool {
        #[cfg(target_arch = "x86_64")]
        {
            use std::arch::is_x86_feature_detected as has;
            let v3 = || {
                has!("avx2")
                    && has!("fma")
                    && has!("f16c")
                    && has!("bmi1")
                    && has!("bmi2")
                    && has!("lzcnt")
            };
            let v4 = || {
                v3() && has!("avx512f")
                    && has!("avx512vl")
                    && has!("avx512dq")
                    && has!("avx512bw")
                    && has!("avx512cd")
            };
            match self {
                Isa::Baseline => true,
                Isa::Avx2 => v3(),
                Isa::Avx512 => v4(),
                Isa::Avx512Bf16 => v4() && has!("avx512bf16"),
                Isa::Amx => {
                    // CPUID leaf 7: EDX bit 22 AMX-BF16, bit 24 AMX-TILE (std's detection
                    // of AMX is not stable yet).
                    let edx = core::arch::x86_64::__cpuid_count(7, 0).edx;
                    v4() && has!("avx512bf16") && edx & (1 << 22) != 0 && edx & (1 << 24) != 0
                }
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            self == Isa::Baseline
        }
    }

    /// Every path this CPU can run, the detected best first (for tests that compare them
    /// and for running a suite once per path).
    pub fn supported() -> Vec<Isa> {
        let mut paths: Vec<Isa> = Isa::ALL.into_iter().filter(|i| i.is_supported()).collect();
        // A path that includes more of the others is the better one.
        paths.sort_by_key(|i| {
            core::cmp::Reverse(Isa::ALL.iter().filter(|o| i.includes(**o)).count())
        });
        paths
    }

    /// Whether a CPU that runs this path has the instructions of `other` too (AVX-512
    /// includes AVX2, every path includes the baseline).
    ///
    /// ```
    /// use attn_core::Isa;
    /// assert!(Isa::Avx512.includes(Isa::Avx2) && !Isa::Avx2.includes(Isa::Avx512));
    /// assert!(Isa::Avx512Bf16.includes(Isa::Avx512) && !Isa::Avx512.includes(Isa::Avx512Bf16));
    /// ```
    pub fn includes(self, other: Isa) -> bool {
        match other {
            Isa::Baseline => true,
            Isa::Avx2 => self != Isa::Baseline,
            Isa::Avx512 => matches!(self, Isa::Avx512 | Isa::Avx512Bf16 | Isa::Amx),
            Isa::Avx512Bf16 => matches!(self, Isa::Avx512Bf16 | Isa::Amx),
            Isa::Amx => self == Isa::Amx,
        }
    }

    /// The path whose vector instructions this one's kernels use for everything but its own
    /// additions (AVX512_BF16's and AMX's products aside, their kernels are AVX-512's).
    ///
    /// ```
    /// use attn_core::Isa;
    /// assert_eq!(Isa::Avx512Bf16.vectors(), Isa::Avx512);
    /// assert_eq!(Isa::Avx2.vectors(), Isa::Avx2);
    /// ```
    pub fn vectors(self) -> Isa {
        match self {
            Isa::Avx512Bf16 | Isa::Amx => Isa::Avx512,
            other => other,
        }
    }

    /// f32 lanes of the path's vectors.
    pub fn width(self) -> usize {
        match self {
            Isa::Baseline => 4,
            Isa::Avx2 => 8,
            Isa::Avx512 | Isa::Avx512Bf16 | Isa::Amx => 16,
        }
    }

    /// The name `ATTN_ISA` takes (`baseline`, `avx2`, `avx512`, `avx512bf16`, `amx`).
    pub fn name(self) -> &'static str {
        match self {
            Isa::Baseline => "baseline",
            Isa::Avx2 => "avx2",
            Isa::Avx512 => "avx512",
            Isa::Avx512Bf16 => "avx512bf16",
            Isa::Amx => "amx",
        }
    }

    /// The path of a name (case-insensitive), `None` for an unknown one.
    pub fn from_name(name: &str) -> Option<Isa> {
        Isa::ALL
            .into_iter()
            .find(|i| i.name().eq_ignore_ascii_case(name))
    }
}

//! What a figure was measured on: the CPU, the instruction set attn's kernels ran with and
//! the one faer's GEMM chose. Every benchmark output prints it, so that a rate is never read
//! against the wrong machine (the same "AMD EPYC" name covers a Zen 3 without AVX-512 and a
//! Zen 4 with it; the family and model numbers tell them apart).

use std::fmt;

use serde::{Deserialize, Serialize};

/// The CPU and the instruction sets in use.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Platform {
    /// `model name` of /proc/cpuinfo with its family and model numbers.
    pub cpu: String,
    /// The instruction set of attn-optimized's kernels (`Isa::current()`).
    pub kernels: String,
    /// The instruction set of faer's f32 GEMM.
    pub faer_gemm: String,
}

/// `model name (family F, model M)` from /proc/cpuinfo; "unknown" where it is not there.
pub fn cpu_model() -> String {
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let field = |name: &str| {
        cpuinfo
            .lines()
            .find(|l| l.split(':').next().is_some_and(|k| k.trim() == name))
            .and_then(|l| l.split_once(':'))
            .map(|(_, v)| v.trim().to_string())
    };
    let name = field("model name").unwrap_or_else(|| "unknown".into());
    match (field("cpu family"), field("model")) {
        (Some(family), Some(model)) => format!("{name} (family {family}, model {model})"),
        _ => name,
    }
}

#[cfg(feature = "engines")]
impl Platform {
    /// This process's platform.
    ///
    /// ```
    /// let p = attn_benches::platform::Platform::detect();
    /// assert!(!p.kernels.is_empty() && p.to_string().contains(&p.faer_gemm));
    /// ```
    pub fn detect() -> Self {
        Self {
            cpu: cpu_model(),
            kernels: match attn_optimized::Isa::current() {
                attn_optimized::Isa::Amx => "AVX-512+AVX512_BF16+AMX",
                attn_optimized::Isa::Avx512Bf16 => "AVX-512+AVX512_BF16",
                attn_optimized::Isa::Avx512 => "AVX-512",
                attn_optimized::Isa::Avx2 => "AVX2+FMA+F16C",
                _ => "baseline",
            }
            .into(),
            faer_gemm: faer_gemm_isa().into(),
        }
    }
}

/// The instruction set faer 0.24's f32 GEMM dispatches to (`linalg::matmul`): AVX-512 when
/// the CPU has `avx512f`, else AVX2 with FMA, else its portable kernels. (Products too small
/// for a packed GEMM take nano-gemm's kernels, on the same instruction set.)
#[cfg(feature = "engines")]
fn faer_gemm_isa() -> &'static str {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx512f") {
            return "AVX-512";
        }
        if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
        {
            return "AVX2+FMA";
        }
    }
    "portable"
}

impl fmt::Display for Platform {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} · attn kernels: {} · faer GEMM: {}",
            self.cpu, self.kernels, self.faer_gemm
        )
    }
}

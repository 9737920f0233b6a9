//! Everything that is `unsafe` or specific to an instruction set, and nothing else.
//!
//! One choice ([`Isa::current`]: the CPU's best path, or the one `ATTN_ISA` forces) decides which instructions the kernels use, and one
//! macro ([`multiversion!`]) compiles a body once per instruction set and picks the copy at
//! run time; the few bodies written with pulp's explicit vectors run on the token of the
//! same [`Isa`] ([`vectorize`]), and the hand-written row kernels ([`rows`]) are chosen by
//! it too. The rest of the crate is safe code (`#![deny(unsafe_code)]` at the crate root,
//! allowed only on this module).
//!
//! - [`exp2`]: the vectorisable `2^x` of the softmax.
//! - [`online_softmax`]: the fused softmax pass over a score tile (and along one row).
//! - [`element`]: the storage types and their widening to f32.
//! - [`finite`]: the scan that finds a non-finite score in a tile (an overflowed `q·k`).
//! - [`rows`]: the row kernels of tiles with very few queries (decoding).
//! - [`pair_dot`]: bf16 tile products on AVX512_BF16 (native precision) and the packing of
//!   operands in bf16 pairs.
//! - [`amx`]: bf16 tile products on AMX (native precision on Intel Xeons).
//! - [`dropout`]: the dropout mask, generated and applied on score tiles.

pub mod amx;
pub mod dropout;
pub mod element;
pub mod exp2;
pub mod finite;
pub mod online_softmax;
pub mod pair_dot;
pub mod rows;
pub mod softmax_grad;
pub mod transpose;

use pulp::{Scalar, Simd, WithSimd};

pub use attn_core::Isa;
use attn_core::{Dtype, Precision};

use element::Element;

/// How the GEMM tiles of both passes multiply: faer's f32 GEMM, or bf16 natively.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Products {
    /// f32 (half inputs widened exactly).
    F32,
    /// bf16 pairs on AVX512_BF16 ([`pair_dot`]; both passes).
    Pairs,
    /// bf16 tiles on AMX ([`amx`]).
    Tiles,
    /// f16 on AMX: each operand split exactly in two bf16 parts ([`amx::Split`]), three
    /// tile products per product (the forward pass).
    SplitTiles,
}

impl Products {
    /// The products of inputs `T` at `precision` on this process's path.
    pub(crate) fn of<T: Element>(precision: Precision) -> Self {
        match (T::DTYPE, precision) {
            (_, Precision::F32) => Products::F32,
            (Dtype::Bf16, _) if amx::available() => Products::Tiles,
            (Dtype::Bf16, _) if pair_dot::available() => Products::Pairs,
            (Dtype::F16, _) if amx::available() => Products::SplitTiles,
            _ => Products::F32,
        }
    }

    /// Whether the operands are split in two bf16 parts.
    pub(crate) fn split(self) -> bool {
        self == Products::SplitTiles
    }
}

/// Generates `$name`, which runs `$body::<FMA>` compiled for AVX-512, AVX2+FMA or baseline
/// x86-64 (or the target's baseline elsewhere), chosen by [`Isa::current`] at run time.
macro_rules! multiversion {
    ($(#[$meta:meta])* $vis:vis fn $name:ident($($arg:ident : $ty:ty),* $(,)?) $(-> $ret:ty)? = $body:ident) => {
        $(#[$meta])*
        $vis fn $name($($arg: $ty),*) $(-> $ret)? {
            #[cfg(target_arch = "x86_64")]
            {
                // The shims take what the function takes, however many arguments.
                #[allow(clippy::too_many_arguments)]
                #[target_feature(enable = "avx512f,avx512vl,avx512dq,avx512bw,avx2,fma,bmi1,bmi2,lzcnt")]
                fn v4($($arg: $ty),*) $(-> $ret)? {
                    $body::<true>($($arg),*)
                }
                #[allow(clippy::too_many_arguments)]
                #[target_feature(enable = "avx2,fma,bmi1,bmi2,lzcnt")]
                fn v3($($arg: $ty),*) $(-> $ret)? {
                    $body::<true>($($arg),*)
                }
                match $crate::kernel::Isa::current().vectors() {
                    // SAFETY: `Isa::current()` is a path this CPU supports (checked when chosen), and
                    // the AVX-512 path has every feature `v4` enables.
                    $crate::kernel::Isa::Avx512 => return unsafe { v4($($arg),*) },
                    // SAFETY: as above; the AVX2 path has every feature `v3` enables.
                    $crate::kernel::Isa::Avx2 => return unsafe { v3($($arg),*) },
                    _ => {}
                }
            }
            $body::<false>($($arg),*)
        }
    };
}
pub(crate) use multiversion;

/// Runs a body written with pulp's explicit vectors on the token of [`Isa::current`]
/// (16 lanes on AVX-512, 8 on AVX2, scalar otherwise).
#[inline]
pub(crate) fn vectorize<Op: WithSimd>(op: Op) -> Op::Output {
    #[cfg(target_arch = "x86_64")]
    {
        use pulp::x86::{V3, V4};
        match Isa::current().vectors() {
            Isa::Avx512 => {
                if let Some(simd) = V4::try_new() {
                    return Simd::vectorize(simd, op);
                }
            }
            Isa::Avx2 => {
                if let Some(simd) = V3::try_new() {
                    return Simd::vectorize(simd, op);
                }
            }
            _ => {}
        }
    }
    Simd::vectorize(Scalar::new(), op)
}

/// `a·b + c`, fused where the instruction set has FMA (a libm call otherwise would be slow).
#[inline(always)]
pub(crate) fn mul_add<const FMA: bool>(a: f32, b: f32, c: f32) -> f32 {
    if FMA { a.mul_add(b, c) } else { a * b + c }
}

//! Inputs shared by the integration tests.
#![allow(dead_code)]

pub mod quantized;

use attn_optimized::Element;
use faer::{Mat, MatRef};

/// Deterministic pseudo-random matrix in `[-amp, amp]`, rounded to `T`.
pub fn mat<T: Element>(rows: usize, cols: usize, seed: u64, amp: f32) -> Mat<T> {
    let mut s = seed
        .wrapping_mul(0x9E37_79B9_7F4A_7C15)
        .wrapping_add(0xD1B5_4A32_D192_ED03);
    Mat::from_fn(rows, cols, |_, _| {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        T::from_f32(((s >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * amp)
    })
}

/// Deterministic pseudo-random values in `[-amp, amp]` (xorshift), rounded to `T`.
pub fn data<T: Element>(len: usize, seed: u64, amp: f32) -> Vec<T> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            T::from_f32(((s >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * amp)
        })
        .collect()
}

/// `f` run in a rayon pool of `threads` threads.
pub fn in_pool<R: Send>(threads: usize, f: impl FnOnce() -> R + Send) -> R {
    rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .unwrap()
        .install(f)
}

/// The largest magnitude of `m`.
pub fn max_abs<T: Element>(m: MatRef<'_, T>) -> f32 {
    let mut x = 0.0f32;
    for j in 0..m.ncols() {
        for i in 0..m.nrows() {
            x = x.max(m[(i, j)].to_f32().abs());
        }
    }
    x
}

/// The f32 engine's bound in units of f32 rounding: score error (dot products of length
/// `d_k`, the folded scale and the ≤ 2-ulp `exp2`) times the largest value, plus the `P·V`
/// and row-sum accumulation over `n_k` keys.
pub fn f32_bound<T: Element>(
    q: MatRef<'_, T>,
    k: MatRef<'_, T>,
    v: MatRef<'_, T>,
    scale: f32,
) -> f32 {
    let u = f32::EPSILON / 2.0;
    let s_max = scale * max_abs(q) * max_abs(k) * q.ncols() as f32;
    max_abs(v) * u * (4.0 * (q.ncols() as f32 + 4.0) * s_max + 2.0 * k.nrows() as f32 + 64.0)
}

//! What the tests share: deterministic random tensors, the naive attention built from
//! candle ops (in f64, the ground truth), the visibility rules written out independently,
//! and the error bound of `docs/accuracy.md` evaluated per output element.

#![allow(dead_code)]

use attn_candle::candle_core::{D, DType, Device, Result, Tensor};
use attn_candle::{Causal, SlidingWindow};

pub const CPU: Device = Device::Cpu;

/// Uniform values in `[-amp, amp)` from a xorshift generator seeded by `seed`.
pub fn values(n: usize, seed: u64, amp: f32) -> Vec<f32> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (((x >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0) * amp
        })
        .collect()
}

/// A contiguous f32 tensor of the given dims with values in `[-amp, amp)`.
pub fn tensor(dims: &[usize], seed: u64, amp: f32) -> Tensor {
    let n = dims.iter().product();
    Tensor::from_vec(values(n, seed, amp), dims, &CPU).unwrap()
}

/// The structural constraints of one problem, as the tests' own implementation of
/// `docs/conventions.md`.
#[derive(Debug, Clone, Default)]
pub struct Structure {
    pub causal: Option<Causal>,
    pub window: Option<SlidingWindow>,
    /// Key length of every batch entry.
    pub lens: Option<Vec<usize>>,
    /// `[n_q][n_k]`, `true` = visible (after the polarity).
    pub allow: Option<Vec<Vec<bool>>>,
}

fn offset(align: Causal, n_q: usize, n_k: usize) -> i64 {
    match align {
        Causal::TopLeft => 0,
        Causal::BottomRight => n_k as i64 - n_q as i64,
    }
}

impl Structure {
    pub fn visible(&self, b: usize, i: usize, j: usize, n_q: usize, n_k: usize) -> bool {
        let (i_, j_) = (i as i64, j as i64);
        if let Some(c) = self.causal
            && j_ > i_ + offset(c, n_q, n_k)
        {
            return false;
        }
        if let Some(w) = self.window {
            let c = i_ + offset(w.align, n_q, n_k);
            if w.left.is_some_and(|l| j_ < c - l as i64)
                || w.right.is_some_and(|r| j_ > c + r as i64)
            {
                return false;
            }
        }
        if let Some(lens) = &self.lens
            && j >= lens[b]
        {
            return false;
        }
        if let Some(m) = &self.allow
            && !m[i][j]
        {
            return false;
        }
        true
    }
}

/// Flattened contiguous values of a tensor, widened to f64.
pub fn flat(t: &Tensor) -> Vec<f64> {
    t.to_dtype(DType::F64)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1::<f64>()
        .unwrap()
}

/// `[batch, h_kv, n, d]` → `[batch, h_q, n, d]`, each kv head repeated for its group.
pub fn repeat_kv(x: &Tensor, h_q: usize) -> Result<Tensor> {
    let (b, h_kv, n, d) = x.dims4()?;
    if h_kv == h_q {
        return Ok(x.clone());
    }
    x.unsqueeze(2)?
        .broadcast_as((b, h_kv, h_q / h_kv, n, d))?
        .reshape((b, h_q, n, d))
}

/// The naive formula in candle ops, in f64: `softmax(scale·QKᵀ + bias + hidden) V`, with
/// `hidden` = -inf where `structure` hides a key. Differentiable (the row maximum is a
/// constant shift, detached). `bias` is `[n_q, n_k]`.
pub fn naive(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    scale: f64,
    structure: &Structure,
    bias: Option<&Tensor>,
) -> Result<Tensor> {
    let (b, h_q, n_q, _) = q.dims4()?;
    let n_k = k.dims4()?.2;
    let q = q.to_dtype(DType::F64)?;
    let k = repeat_kv(&k.to_dtype(DType::F64)?, h_q)?;
    let v = repeat_kv(&v.to_dtype(DType::F64)?, h_q)?;
    let s = (q.matmul(&k.transpose(2, 3)?.contiguous()?)? * scale)?;
    let hidden: Vec<f64> = (0..b * n_q * n_k)
        .map(|x| {
            let (bi, i, j) = (x / (n_q * n_k), x / n_k % n_q, x % n_k);
            if structure.visible(bi, i, j, n_q, n_k) {
                0.0
            } else {
                f64::NEG_INFINITY
            }
        })
        .collect();
    let hidden = Tensor::from_vec(hidden, (b, 1, n_q, n_k), &CPU)?;
    let mut s = s.broadcast_add(&hidden)?;
    if let Some(bias) = bias {
        s = s.broadcast_add(&bias.to_dtype(DType::F64)?)?;
    }
    let m = s.max_keepdim(D::Minus1)?.detach();
    let e = s.broadcast_sub(&m)?.exp()?;
    let p = e.broadcast_div(&e.sum_keepdim(D::Minus1)?)?;
    p.matmul(&v.contiguous()?)
}

/// The per-element error bound of `docs/accuracy.md` (the derivation is the oracle's
/// `BOUND.md`) for an engine computing in f32 and rounding its output with unit roundoff
/// `u_out`, against the exact result `want` of the same (already rounded) inputs: for row
/// `(b, h, i)` and column `c`,
/// `2·[M_c·(2W/(1−W) + 3γ_{2n_k+2}) + (u + u_out)·|O_c|]` with `M_c = max_visible |v_jc|`,
/// `Δ = max_visible γ_{d_k+6}·scale·Σ_t |q_t k_jt| + 4u|b_j|`,
/// `W = e^{Δ+4u}·(1 + 2u·(ln n_k + 2Δ + 16)) − 1`. Valid for `n_k ≤ 1024` (no split-KV
/// merges). bf16 inputs on a CPU with bf16 units (native precision, the default) round
/// the weights to bf16 before `P·V`: `+ 2·2·2⁻⁸·M_c` (`docs/accuracy.md`). Returned in
/// `[b, h_q, n_q, d_v]` order.
#[allow(clippy::too_many_arguments)]
pub fn bound(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    want: &[f64],
    scale: f64,
    structure: &Structure,
    bias: Option<&Tensor>,
    u_out: f64,
) -> Vec<f64> {
    let (b, h_q, n_q, d_k) = q.dims4().unwrap();
    let (_, h_kv, n_k, d_v) = v.dims4().unwrap();
    assert!(n_k <= 1024, "the bound here has no merge term");
    let native =
        q.dtype() == DType::BF16 && attn_core::Isa::current().includes(attn_core::Isa::Avx512Bf16);
    let u_w = if native { 2.0 * 2f64.powi(-8) } else { 0.0 };
    let (q, k, v) = (flat(q), flat(k), flat(v));
    let bias = bias.map(flat);
    let u = 2f64.powi(-24);
    let gamma = |m: usize| m as f64 * u / (1.0 - m as f64 * u);
    let group = h_q / h_kv;
    let mut out = vec![0.0; b * h_q * n_q * d_v];
    for bi in 0..b {
        for h in 0..h_q {
            let kvh = h / group;
            for i in 0..n_q {
                let row = ((bi * h_q + h) * n_q + i) * d_v;
                let qi = &q[((bi * h_q + h) * n_q + i) * d_k..][..d_k];
                let mut delta = 0f64;
                let mut m = vec![0f64; d_v];
                for j in 0..n_k {
                    if !structure.visible(bi, i, j, n_q, n_k) {
                        continue;
                    }
                    let kj = &k[((bi * h_kv + kvh) * n_k + j) * d_k..][..d_k];
                    let dot: f64 = qi.iter().zip(kj).map(|(a, b)| (a * b).abs()).sum();
                    let bj = bias.as_ref().map_or(0.0, |bb| bb[i * n_k + j].abs());
                    delta = delta.max(gamma(d_k + 6) * scale * dot + 4.0 * u * bj);
                    let vj = &v[((bi * h_kv + kvh) * n_k + j) * d_v..][..d_v];
                    for c in 0..d_v {
                        m[c] = m[c].max(vj[c].abs());
                    }
                }
                let w = (delta + 4.0 * u).exp()
                    * (1.0 + 2.0 * u * ((n_k.max(1) as f64).ln() + 2.0 * delta + 16.0))
                    - 1.0;
                for c in 0..d_v {
                    out[row + c] = 2.0
                        * (m[c] * (2.0 * w / (1.0 - w) + 3.0 * gamma(2 * n_k + 2) + u_w)
                            + (u + u_out) * want[row + c].abs())
                        + 1e-30;
                }
            }
        }
    }
    out
}

/// Asserts `got` is within `bound` of `want`, element by element, and reports the
/// largest ratio of error to bound.
pub fn assert_within(name: &str, got: &[f64], want: &[f64], bound: &[f64]) -> f64 {
    assert_eq!(got.len(), want.len(), "{name}: lengths");
    let mut worst = 0f64;
    for (x, ((g, w), b)) in got.iter().zip(want).zip(bound).enumerate() {
        let e = (g - w).abs();
        assert!(
            e <= *b,
            "{name}: element {x}: got {g}, want {w}, error {e} > bound {b}"
        );
        worst = worst.max(e / b);
    }
    worst
}

/// `max |got − want| / max |want|` (1e-3 at least in the denominator).
pub fn max_rel(got: &Tensor, want: &Tensor) -> f64 {
    assert_eq!(got.dims(), want.dims());
    let (g, w) = (flat(got), flat(want));
    let scale = w.iter().fold(1e-3f64, |m, x| m.max(x.abs()));
    g.iter()
        .zip(&w)
        .map(|(a, b)| (a - b).abs() / scale)
        .fold(0.0, f64::max)
}

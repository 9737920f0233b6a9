//! What the ring's tests share: cases, synthetic inputs, and the check against the f64
//! reference within the oracle's derived bounds.

#![allow(dead_code)]

use std::ops::Range;

use attn_core::Tensor4;
use attn_optimized::SPLIT_KEYS;
use attn_oracle::bound::{batch_backward_bound, head_bound_merged};
use attn_oracle::{Compute, Dtype, ErrorModel};
use attn_ring::{RingElement, RingOptions, Split, contiguous_rows, zigzag_rows};

/// One problem: the whole sequence's shape and how it is split.
#[derive(Debug, Clone)]
pub struct Case {
    pub name: &'static str,
    pub n: usize,
    pub batch: usize,
    pub h_q: usize,
    pub h_kv: usize,
    pub d_k: usize,
    pub d_v: usize,
    pub causal: bool,
    pub split: Split,
    /// The last rank holds no rows (contiguous split only).
    pub last_empty: bool,
}

impl Case {
    pub fn new(name: &'static str, n: usize, heads: (usize, usize), d: (usize, usize)) -> Self {
        Self {
            name,
            n,
            batch: 1,
            h_q: heads.0,
            h_kv: heads.1,
            d_k: d.0,
            d_v: d.1,
            causal: false,
            split: Split::Contiguous,
            last_empty: false,
        }
    }

    pub fn causal(mut self, split: Split) -> Self {
        self.causal = true;
        self.split = split;
        self
    }

    pub fn batch(mut self, batch: usize) -> Self {
        self.batch = batch;
        self
    }

    pub fn options(&self) -> RingOptions {
        RingOptions::default()
            .with_causal(self.causal)
            .with_split(self.split)
    }

    /// The positions rank `r` of `p` holds.
    pub fn rows(&self, p: usize, r: usize) -> Vec<Range<usize>> {
        match self.split {
            Split::Zigzag => zigzag_rows(self.n, p, r).to_vec(),
            Split::Contiguous if self.last_empty && p > 1 => {
                if r + 1 == p {
                    std::iter::once(self.n..self.n).collect()
                } else {
                    std::iter::once(contiguous_rows(self.n, p - 1, r)).collect()
                }
            }
            Split::Contiguous => std::iter::once(contiguous_rows(self.n, p, r)).collect(),
        }
    }
}

/// A deterministic value in [-1, 1) for (seed, index): the same on every rank.
pub fn value(seed: u64, i: usize) -> f32 {
    let mut x = (i as u64 ^ (seed << 40)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    x ^= x >> 29;
    x = x.wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x ^= x >> 32;
    (x % 2000) as f32 / 1000.0 - 1.0
}

pub fn tensor<T: RingElement>(seed: u64, dims: [usize; 4], amp: f32) -> Tensor4<T> {
    let len = dims.iter().product();
    let data = (0..len)
        .map(|i| T::from_f32(amp * value(seed, i)))
        .collect();
    Tensor4::from_vec(data, dims).expect("dims match")
}

pub fn widen<T: RingElement>(t: &Tensor4<T>) -> Tensor4<f32> {
    Tensor4::from_vec(t.as_slice().iter().map(|x| x.to_f32()).collect(), t.dims()).unwrap()
}

pub fn dtype<T: RingElement>() -> Dtype {
    match T::DTYPE {
        attn_core::Dtype::F32 => Dtype::F32,
        attn_core::Dtype::F16 => Dtype::F16,
        attn_core::Dtype::Bf16 => Dtype::Bf16,
    }
}

/// The streaming engine's error model (as its conformance tests have it), output `T`.
pub fn model<T: RingElement>() -> ErrorModel {
    use attn_optimized::Isa;
    ErrorModel {
        compute: Compute::F32 {
            exp_ulps: 2.0,
            split_keys: Some(SPLIT_KEYS),
            weights: None,
            split_operands: T::DTYPE == attn_core::Dtype::F16 && Isa::current() == Isa::Amx,
        },
        output: dtype::<T>(),
    }
}

pub fn same_bits<T: RingElement>(a: &[T], b: &[T]) -> bool {
    a.len() == b.len()
        && a.iter()
            .zip(b)
            .all(|(x, y)| x.to_f32().to_bits() == y.to_f32().to_bits())
}

pub fn same_f32_bits(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
}

/// Tracks the worst `|error| / bound` and the first violation.
#[derive(Default)]
struct Check {
    worst: f64,
    failure: Option<String>,
}

impl Check {
    fn entry(&mut self, what: impl FnOnce() -> String, got: f32, want: f64, bound: f64) {
        let err = if got as f64 == want {
            0.0
        } else {
            (got as f64 - want).abs()
        };
        let ratio = if bound > 0.0 {
            err / bound
        } else if err == 0.0 {
            0.0
        } else {
            f64::INFINITY
        };
        self.worst = self.worst.max(ratio);
        // NaN fails too.
        let within = err <= bound;
        if !within && self.failure.is_none() {
            self.failure = Some(format!(
                "{}: got {got}, reference {want}, bound {bound:.3e}",
                what()
            ));
        }
    }
}

/// The global operands of a case.
#[derive(Clone, Copy)]
pub struct Inputs<'a, T> {
    pub q: &'a Tensor4<T>,
    pub k: &'a Tensor4<T>,
    pub v: &'a Tensor4<T>,
    pub d_out: &'a Tensor4<T>,
}

/// Checks a rank's forward (`out`, `lse`) and backward (`dq`, `dk`, `dv`) over the global
/// positions `mine` against the f64 reference on the whole sequence, within the oracle's
/// derived bounds (with the ring's merges, at most two per step and rank, counted);
/// returns the worst `|error| / bound` of each pass.
#[allow(clippy::needless_range_loop)] // (batch, head) index several parallel tables
pub fn check_reference<T: RingElement>(
    c: &Case,
    p: usize,
    mine: &[usize],
    x: Inputs<'_, T>,
    (out, lse): (&Tensor4<T>, &[f32]),
    (dq, dk, dv): (&Tensor4<T>, &Tensor4<T>, &Tensor4<T>),
) -> Result<(f64, f64), String> {
    let (qf, kf, vf, dof) = (widen(x.q), widen(x.k), widen(x.v), widen(x.d_out));
    let one = c.options().options();
    let scale = one.scale_for(c.d_k).unwrap() as f64;
    let group = c.h_q / c.h_kv;
    let merges = 2 * p + 2;
    let mut fwd = Check::default();
    let mut bwd = Check::default();
    if c.n == 0 {
        return Ok((0.0, 0.0));
    }
    for bi in 0..c.batch {
        for h in 0..c.h_q {
            // The reference on the same (rounded) inputs, widened exactly to f32.
            let (qh, kh, vh) = (
                qf.as_ref().head(bi, h).unwrap(),
                kf.as_ref().head(bi, h / group).unwrap(),
                vf.as_ref().head(bi, h / group).unwrap(),
            );
            let reference = attn_reference::Attention::head(qh, kh, vh, &one)
                .and_then(|call| call.materialized())
                .unwrap();
            let bound =
                head_bound_merged(&model::<T>(), qh, kh, vh, scale, None, &reference, merges);
            let got = out.as_ref().head(bi, h).unwrap();
            for (i, &g) in mine.iter().enumerate() {
                for col in 0..c.d_v {
                    let w = reference.output[(g, col)];
                    fwd.entry(
                        || format!("O[{bi},{h},{g},{col}]"),
                        got[(i, col)].to_f32(),
                        w,
                        bound.output[(g, col)],
                    );
                }
                let l = lse[(bi * c.h_q + h) * mine.len() + i];
                fwd.entry(
                    || format!("LSE[{bi},{h},{g}]"),
                    l,
                    reference.lse[g],
                    bound.lse[g],
                );
            }
        }
    }
    let refs = attn_reference::Attention::batched(qf.as_ref(), kf.as_ref(), vf.as_ref(), &one)
        .and_then(|call| call.backward_materialized(dof.as_ref()))
        .unwrap();
    let bound = batch_backward_bound(
        &model::<T>(),
        qf.as_ref(),
        kf.as_ref(),
        vf.as_ref(),
        dof.as_ref(),
        scale,
        None,
        &refs,
    );
    for bi in 0..c.batch {
        for h in 0..c.h_q {
            let got = dq.as_ref().head(bi, h).unwrap();
            for (i, &g) in mine.iter().enumerate() {
                for col in 0..c.d_k {
                    let (w, b) = (refs[bi][h].dq[(g, col)], bound.dq[bi][h][(g, col)]);
                    bwd.entry(
                        || format!("dQ[{bi},{h},{g},{col}]"),
                        got[(i, col)].to_f32(),
                        w,
                        b,
                    );
                }
            }
        }
        for h in 0..c.h_kv {
            // The reference dK, dV of a kv head: its group's sum.
            let members = h * group..(h + 1) * group;
            let (gk, gv) = (
                dk.as_ref().head(bi, h).unwrap(),
                dv.as_ref().head(bi, h).unwrap(),
            );
            for (i, &g) in mine.iter().enumerate() {
                for col in 0..c.d_k {
                    let w: f64 = members.clone().map(|m| refs[bi][m].dk[(g, col)]).sum();
                    let b = bound.dk[bi][h][(g, col)];
                    bwd.entry(
                        || format!("dK[{bi},{h},{g},{col}]"),
                        gk[(i, col)].to_f32(),
                        w,
                        b,
                    );
                }
                for col in 0..c.d_v {
                    let w: f64 = members.clone().map(|m| refs[bi][m].dv[(g, col)]).sum();
                    let b = bound.dv[bi][h][(g, col)];
                    bwd.entry(
                        || format!("dV[{bi},{h},{g},{col}]"),
                        gv[(i, col)].to_f32(),
                        w,
                        b,
                    );
                }
            }
        }
    }
    match fwd.failure.or(bwd.failure) {
        Some(m) => Err(m),
        None => Ok((fwd.worst, bwd.worst)),
    }
}

//! The streaming backward pass through the score modifiers (issue 16) against the f64
//! reference backward, and the identities that must hold bit for bit.
//!
//! The output and LSE the backward pass starts from are the reference forward's (rounded
//! to the storage type and f32): this file tests the backward alone.
//!
//! Each gradient entry is held to a first-order bound derived from the reference's
//! intermediates on the same (storage-rounded) inputs, in the steps of the oracle's
//! backward bound (`crates/oracle/src/bound.rs`, B1–B7), with the modifiers' terms added.
//! With `u = 2⁻²⁴`, `γ(n) = nu/(1 − nu)`, for row `i` and visible key `j`:
//!
//! - score (natural units): `Δ_ij = γ(d_k + 2)·scale·Σ_t|q_it||k_jt| + 4u·|s_ij|` (the f32
//!   dot product and the base-2 conversions), then the soft-cap's: its `tanh` has relative
//!   error below `4e-7`, `+ (4e-7 + 2u)·c` (`|f'| ≤ 1`, so `Δ` passes through), and ALiBi's
//!   `+ 3u·m·|i + off − j|`;
//! - `P = 2^(s₂ − LSE₂)` from the f32 LSE: relative `π_ij = Δ_ij + 3u·|LSE_i| + 2u + 2u`
//!   (the LSE's own rounding and its scaling, the exp's two ulps);
//! - `D_i` from the stored output: `ε_D = u_T·Σ|dO||O| + γ(d_v)·Σ|dO||O|`; `dP`:
//!   `ε_P = γ(d_v)·Σ_t|dO_it||V_jt|`;
//! - the derivative `f' = 1 − t²` of a soft-cap: `φ_ij = 2·(4e-7 + u) + 2Δ_ij/c`
//!   (`|∂f'/∂s| ≤ 2/c`), 0 without one;
//! - `dS`: `σ_ij = π_ij·P_ij|dP − D|·|f'| + P_ij(ε_P + ε_D)|f'| + P_ij|dP − D|·φ_ij
//!   + γ(3)·|dS_ij|`;
//! - `dQ_ic`: `scale·(Σ_j σ_ij|K_jc| + γ(n_k + 2)·Σ_j |dS_ij||K_jc|)` (the tiles' sums and the
//!   reduction of the partials), dK alike over the rows (and the group's heads), `dV_jc`:
//!   `Σ_i π_ij P_ij|dO_ic| + γ(n_q·heads + 2)·Σ_i P_ij|dO_ic|`;
//! - `dσ_h`: `Σ_i p_sink,i·(ε_D,i + |D_i|·(3u·|LSE_i| + 4u)) + γ(rows)·Σ_i p_sink,i|D_i|`.
//!
//! The bound is the sum times 2 (second-order terms dropped) plus `1e-30` (flushed
//! exponentials). The engine's gradients are written into f32 views (mixed precision), so
//! no final rounding to half enters.

use core::ops::Range;

use attn_core::{
    Alibi, Causal, CuSeqlens, Layout, MaskMod, Options, ScoreMod, SoftCap, Tensor4Mut, Tensor4Ref,
    TileCoverage,
};
use attn_optimized::{
    Element, attention_backward_batched, attention_backward_batched_into,
    attention_backward_into, attention_backward_packed, attention_backward_packed_into,
};
use attn_reference::MaterializedBackward;
use faer::{Mat, MatRef};
use half::{bf16, f16};

const U: f64 = 1.0 / 16_777_216.0;
const TANH: f64 = 4e-7;

fn gamma(n: f64) -> f64 {
    n * U / (1.0 - n * U)
}

/// xorshift values in `[−amp, amp]`.
fn values(n: usize, seed: u64, amp: f32) -> Vec<f32> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            amp * (((x >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0)
        })
        .collect()
}

/// The soft-cap as a user modifier, computed as the built-in computes it.
#[derive(Debug)]
struct UserCap(SoftCap);

impl ScoreMod for UserCap {
    fn score(&self, s: f32, _b: usize, _h: usize, _i: usize, _j: usize) -> f32 {
        self.0.apply_f32(s).0
    }
    fn derivative(&self, s: f32, _b: usize, _h: usize, _i: usize, _j: usize) -> f32 {
        self.0.apply_f32(s).1
    }
}

/// Causal, top-left, with exact coverage.
#[derive(Debug)]
struct TopLeft;

impl MaskMod for TopLeft {
    fn visible(&self, _b: usize, _h: usize, i: usize, j: usize) -> bool {
        j <= i
    }
    fn coverage(&self, _b: usize, _h: usize, q: Range<usize>, k: Range<usize>) -> TileCoverage {
        if k.start > q.end - 1 {
            TileCoverage::Hidden
        } else if k.end - 1 <= q.start {
            TileCoverage::Full
        } else {
            TileCoverage::Partial
        }
    }
}

/// Hides key `j` from query `i` of head `h` of entry `b` when `3i + j + b + 2h ≡ 0 mod 5`.
#[derive(Debug)]
struct Sparse {
    /// Added to the batch entry: a packed call's sequence `s` seen from a batch-1 call.
    shift: usize,
}

impl MaskMod for Sparse {
    fn visible(&self, b: usize, h: usize, i: usize, j: usize) -> bool {
        (3 * i + j + b + self.shift + 2 * h) % 5 != 0
    }
}

static SPARSE: Sparse = Sparse { shift: 0 };

/// The modifiers' numbers a bound needs.
#[derive(Clone, Copy, Default)]
struct Mods<'a> {
    cap: Option<f32>,
    /// Slopes and the alignment's offset.
    alibi: Option<(&'a [f32], i64)>,
}

/// One head's bound terms: the errors of its gradients' sums, the absolute values the
/// accumulation over rows multiplies (dK and dV: added per group), and dσ's error.
struct HeadBound {
    dq: Mat<f64>,
    dk: Mat<f64>,
    dk_abs: Mat<f64>,
    dv: Mat<f64>,
    dv_abs: Mat<f64>,
    dsink: f64,
}

#[allow(clippy::too_many_arguments)]
fn head_bound(
    x: [MatRef<'_, f64>; 4],
    r: &MaterializedBackward,
    scale: f64,
    cap: Option<f32>,
    slope: Option<(f64, i64)>,
    u_t: f64,
) -> HeadBound {
    let [q, k, v, d_out] = x;
    let (n_q, n_k, d_k, d_v) = (q.nrows(), k.nrows(), q.ncols(), v.ncols());
    let f = &r.forward;
    let mut sigma = Mat::<f64>::zeros(n_q, n_k);
    let mut ds_abs = Mat::<f64>::zeros(n_q, n_k);
    let mut pi = Mat::<f64>::zeros(n_q, n_k);
    let mut eps_d = vec![0.0; n_q];
    for i in 0..n_q {
        let od: f64 = (0..d_v)
            .map(|t| (d_out[(i, t)] * f.output[(i, t)]).abs())
            .sum();
        eps_d[i] = (u_t + gamma(d_v as f64)) * od;
        let lse = f.lse[i];
        if lse == f64::NEG_INFINITY {
            continue;
        }
        for j in 0..n_k {
            if f.scores[(i, j)] == f64::NEG_INFINITY {
                continue;
            }
            let qk: f64 = (0..d_k).map(|t| (q[(i, t)] * k[(j, t)]).abs()).sum();
            let raw: f64 = scale * (0..d_k).map(|t| q[(i, t)] * k[(j, t)]).sum::<f64>();
            let mut delta = gamma(d_k as f64 + 2.0) * scale * qk + 4.0 * U * raw.abs();
            let (mut phi, mut fp) = (0.0, 1.0);
            if let Some(c) = cap {
                let c = f64::from(c);
                delta += (TANH + 2.0 * U) * c;
                let t = (raw / c).tanh();
                fp = 1.0 - t * t;
                phi = 2.0 * (TANH + U) + 2.0 * delta / c;
            }
            if let Some((m, off)) = slope {
                delta += 3.0 * U * m.abs() * (i as i64 + off - j as i64).abs() as f64;
            }
            let p = f.weights[(i, j)];
            let pe = delta + 3.0 * U * lse.abs() + 4.0 * U;
            let g = (r.dp[(i, j)] - r.d[i]).abs();
            let eps_p = gamma(d_v as f64)
                * (0..d_v)
                    .map(|t| (d_out[(i, t)] * v[(j, t)]).abs())
                    .sum::<f64>();
            pi[(i, j)] = pe;
            sigma[(i, j)] = pe * p * g * fp
                + p * (eps_p + eps_d[i]) * fp
                + p * g * phi
                + gamma(3.0) * r.ds[(i, j)].abs();
            ds_abs[(i, j)] = r.ds[(i, j)].abs() + sigma[(i, j)];
        }
    }
    let acc_k = gamma(n_k as f64 + 2.0);
    let over_keys = |m: &Mat<f64>, i: usize, c: usize| {
        (0..n_k).map(|j| m[(i, j)] * k[(j, c)].abs()).sum::<f64>()
    };
    let over_rows = |w: &dyn Fn(usize, usize) -> f64, x: MatRef<'_, f64>, j: usize, c: usize| {
        (0..n_q).map(|i| w(i, j) * x[(i, c)].abs()).sum::<f64>()
    };
    let p = |i: usize, j: usize| f.weights[(i, j)];
    HeadBound {
        dq: Mat::from_fn(n_q, d_k, |i, c| {
            scale * (over_keys(&sigma, i, c) + acc_k * over_keys(&ds_abs, i, c))
        }),
        dk: Mat::from_fn(n_k, d_k, |j, c| {
            scale * over_rows(&|i, j| sigma[(i, j)], q, j, c)
        }),
        dk_abs: Mat::from_fn(n_k, d_k, |j, c| {
            scale * over_rows(&|i, j| ds_abs[(i, j)], q, j, c)
        }),
        dv: Mat::from_fn(n_k, d_v, |j, c| {
            over_rows(&|i, j| pi[(i, j)] * p(i, j), d_out, j, c)
        }),
        dv_abs: Mat::from_fn(n_k, d_v, |j, c| over_rows(&p, d_out, j, c)),
        dsink: (0..n_q)
            .filter(|&i| f.lse[i].is_finite())
            .map(|i| {
                let ps = r.p_sink[i];
                ps * (eps_d[i] + r.d[i].abs() * (3.0 * U * f.lse[i].abs() + 4.0 * U))
                    + gamma(n_q as f64 + 2.0) * ps * r.d[i].abs()
            })
            .sum(),
    }
}

fn widen<T: Element>(m: MatRef<'_, T>) -> Mat<f64> {
    Mat::from_fn(m.nrows(), m.ncols(), |i, j| f64::from(m[(i, j)].to_f32()))
}

/// A batched case: operands stored as `T` in `layout`, the options, and what a bound
/// needs of the modifiers.
struct Case<'a> {
    dims: [usize; 6], // batch, h_q, h_kv, n_q, n_k, d (d_k = d_v = d)
    layout: Layout,
    opts: Options<'a>,
    cap: Option<f32>,
    slopes: Option<(&'a [f32], Causal)>,
    seed: u64,
}

/// The unit roundoff of `T`.
fn unit<T: Element>() -> f64 {
    match T::NAME {
        "f16" => 1.0 / 2048.0,
        "bf16" => 1.0 / 256.0,
        _ => U,
    }
}

/// Runs a batched case through both engines and checks every gradient against the bound;
/// returns the largest ratio error / bound.
fn check_batched<T: Element + attn_reference::Element + Default>(c: &Case<'_>) -> f64 {
    let [b, h_q, h_kv, n_q, n_k, d] = c.dims;
    let (qd, kd) = ([b, h_q, n_q, d], [b, h_kv, n_k, d]);
    let store = |n: usize, seed: u64, amp: f32| -> Vec<T> {
        values(n, seed, amp).into_iter().map(T::from_f32).collect()
    };
    let (qb, kb, vb, gb) = (
        store(b * h_q * n_q * d, c.seed, 2.0),
        store(b * h_kv * n_k * d, c.seed + 1, 1.0),
        store(b * h_kv * n_k * d, c.seed + 2, 1.0),
        store(b * h_q * n_q * d, c.seed + 3, 1.0),
    );
    let l = c.layout;
    let (q, k, v, g) = (
        Tensor4Ref::from_layout(&qb, qd, l).unwrap(),
        Tensor4Ref::from_layout(&kb, kd, l).unwrap(),
        Tensor4Ref::from_layout(&vb, kd, l).unwrap(),
        Tensor4Ref::from_layout(&gb, qd, l).unwrap(),
    );
    let (out, lse) = attn_reference::attention_batched_with_lse(q, k, v, &c.opts).unwrap();
    let (mut dq, mut dk, mut dv) = (
        vec![0.0f32; qb.len()],
        vec![0.0f32; kb.len()],
        vec![0.0f32; vb.len()],
    );
    let dsinks = attention_backward_batched_into(
        Tensor4Mut::from_layout(&mut dq, qd, Layout::Bhsd).unwrap(),
        Tensor4Mut::from_layout(&mut dk, kd, Layout::Bhsd).unwrap(),
        Tensor4Mut::from_layout(&mut dv, kd, Layout::Bhsd).unwrap(),
        g,
        q,
        k,
        v,
        out.as_ref(),
        &lse,
        &c.opts,
    )
    .unwrap();
    // The owned call returns the same bits.
    let owned = attention_backward_batched(g, q, k, v, out.as_ref(), &lse, &c.opts).unwrap();
    assert_eq!(owned.dsinks, dsinks);
    if T::NAME == "f32" {
        let flat = |t: &attn_core::Tensor4<T>| -> Vec<f32> {
            t.as_slice().iter().map(|x| x.to_f32()).collect()
        };
        assert_eq!(flat(&owned.dq), dq);
        assert_eq!(flat(&owned.dk), dk);
    }
    let refs =
        attn_reference::attention_backward_batched_materialized(q, k, v, g, &c.opts).unwrap();
    let scale = 1.0 / (d as f64).sqrt();
    let group = h_q / h_kv;
    let mut worst = 0.0f64;
    let mut sink_want = vec![0.0f64; h_q];
    let mut sink_err = vec![0.0f64; h_q];
    let check = |what: &str, got: f32, want: f64, bound: f64, worst: &mut f64| {
        let err = (f64::from(got) - want).abs();
        let bound = 2.0 * bound + 1e-30;
        assert!(
            err <= bound,
            "{} {what}: {got} vs {want} (error {err:e} > bound {bound:e})",
            T::NAME
        );
        *worst = worst.max(err / bound);
    };
    for bi in 0..b {
        let mut kv_sums: Vec<[Mat<f64>; 6]> = Vec::new();
        for kv in 0..h_kv {
            let z = |r, c| Mat::<f64>::zeros(r, c);
            kv_sums.push([z(n_k, d), z(n_k, d), z(n_k, d), z(n_k, d), z(n_k, d), z(n_k, d)]);
            let _ = kv;
        }
        for h in 0..h_q {
            let kv = h / group;
            let r = &refs[bi][h];
            let x = [
                widen(q.head(bi, h).unwrap()),
                widen(k.head(bi, kv).unwrap()),
                widen(v.head(bi, kv).unwrap()),
                widen(g.head(bi, h).unwrap()),
            ];
            let slope = c.slopes.map(|(s, align)| {
                let m = if s.len() == h_q { s[h] } else { s[bi * h_q + h] };
                let off = match align {
                    Causal::TopLeft => 0,
                    Causal::BottomRight => n_k as i64 - n_q as i64,
                };
                (f64::from(m), off)
            });
            let hb = head_bound(
                [x[0].as_ref(), x[1].as_ref(), x[2].as_ref(), x[3].as_ref()],
                r,
                scale,
                c.cap,
                slope,
                unit::<T>(),
            );
            for i in 0..n_q {
                for col in 0..d {
                    let got = dq[((bi * h_q + h) * n_q + i) * d + col];
                    check("dQ", got, r.dq[(i, col)], hb.dq[(i, col)], &mut worst);
                }
            }
            let s = &mut kv_sums[kv];
            s[0] += &r.dk;
            s[1] += &hb.dk;
            s[2] += &hb.dk_abs;
            s[3] += &r.dv;
            s[4] += &hb.dv;
            s[5] += &hb.dv_abs;
            sink_want[h] += r.dsink;
            sink_err[h] += hb.dsink;
        }
        let acc = gamma((n_q * group) as f64 + 2.0);
        for (kv, s) in kv_sums.iter().enumerate() {
            for j in 0..n_k {
                for col in 0..d {
                    let at = ((bi * h_kv + kv) * n_k + j) * d + col;
                    let bk = s[1][(j, col)] + acc * s[2][(j, col)];
                    check("dK", dk[at], s[0][(j, col)], bk, &mut worst);
                    let bv = s[4][(j, col)] + acc * s[5][(j, col)];
                    check("dV", dv[at], s[3][(j, col)], bv, &mut worst);
                }
            }
        }
    }
    match (c.opts.sinks, dsinks) {
        (Some(_), Some(ds)) => {
            for h in 0..h_q {
                check("dσ", ds[h], sink_want[h], sink_err[h] + U * sink_want[h].abs(), &mut worst);
            }
        }
        (None, None) => {}
        (s, d) => panic!("sinks {s:?}, gradients {d:?}"),
    }
    worst
}

static SLOPES4: [f32; 4] = [0.5, 0.25, 0.125, 0.0625];
static SLOPES8: [f32; 8] = [0.5, 0.25, 0.125, 0.0625, 0.75, 0.375, 0.0, 1.0];
static SINKS4: [f32; 4] = [0.5, -1.0, 2.0, f32::NEG_INFINITY];

fn cap(c: f32) -> SoftCap {
    SoftCap::new(c).unwrap()
}

fn every_modifier<T: Element + attn_reference::Element + Default>(layout: Layout) {
    // Shapes across the 128-row tiles; GQA (4 query heads on 2 kv heads).
    let dims = [2, 4, 2, 150, 170, 16];
    let cases = [
        Case {
            dims,
            layout,
            opts: Options::default().with_softcap(cap(1.5)),
            cap: Some(1.5),
            slopes: None,
            seed: 1,
        },
        Case {
            dims,
            layout,
            opts: Options::default()
                .with_alibi(Alibi::new(&SLOPES8).with_align(Causal::TopLeft))
                .with_causal(Causal::TopLeft),
            cap: None,
            slopes: Some((&SLOPES8, Causal::TopLeft)),
            seed: 2,
        },
        Case {
            dims,
            layout,
            opts: Options::default()
                .with_softcap(cap(2.0))
                .with_alibi(Alibi::new(&SLOPES4))
                .with_sinks(&SINKS4)
                .with_causal(Causal::BottomRight)
                .with_mask_mod(&SPARSE),
            cap: Some(2.0),
            slopes: Some((&SLOPES4, Causal::BottomRight)),
            seed: 3,
        },
        Case {
            dims: [1, 4, 4, 70, 40, 8],
            layout,
            // n_q > n_k, bottom-right: the first rows see no key (output 0, LSE σ).
            opts: Options::default()
                .with_sinks(&SINKS4)
                .with_causal(Causal::BottomRight),
            cap: None,
            slopes: None,
            seed: 4,
        },
    ];
    for c in &cases {
        let worst = check_batched::<T>(c);
        eprintln!("{} {:?} seed {}: worst error/bound {worst:.3e}", T::NAME, c.layout, c.seed);
        assert!(worst.is_finite());
    }
}

#[test]
fn f32_gradients_are_within_the_bound_in_both_layouts() {
    every_modifier::<f32>(Layout::Bhsd);
    every_modifier::<f32>(Layout::Bshd);
}

#[test]
fn f16_gradients_are_within_the_bound() {
    every_modifier::<f16>(Layout::Bshd);
}

#[test]
fn bf16_gradients_are_within_the_bound() {
    every_modifier::<bf16>(Layout::Bhsd);
}

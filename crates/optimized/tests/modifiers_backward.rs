//! The streaming backward pass through the score modifiers against the f64
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

mod common;

use attn_oracle::user_mods::{TopLeftMask, UserSoftCap};
use core::ops::Range;

use attn_core::{
    Alibi, Causal, CuSeqlens, Layout, MaskMod, Options, SoftCap, Tensor4Mut, Tensor4Ref,
};
use attn_optimized::Element;
use attn_reference::MaterializedBackward;
use common::data;
use faer::{Mat, MatRef};
use half::{bf16, f16};

const U: f64 = 1.0 / 16_777_216.0;
const TANH: f64 = 4e-7;

fn gamma(n: f64) -> f64 {
    n * U / (1.0 - n * U)
}

/// Hides key `j` from query `i` of head `h` of entry `b` when `3i + j + b + 2h ≡ 0 mod 5`.
#[derive(Debug)]
struct Sparse {
    /// Added to the batch entry: a packed call's sequence `s` seen from a batch-1 call.
    shift: usize,
}

impl MaskMod for Sparse {
    fn visible(&self, b: usize, h: usize, i: usize, j: usize) -> bool {
        !(3 * i + j + b + self.shift + 2 * h).is_multiple_of(5)
    }
}

static SPARSE: Sparse = Sparse { shift: 0 };

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
    (u_t, rounded): (f64, f64),
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
    // With native products dQ multiplies dS rounded to the storage type.
    let acc_q = acc_k + rounded;
    let over_keys = |m: &Mat<f64>, i: usize, c: usize| {
        (0..n_k).map(|j| m[(i, j)] * k[(j, c)].abs()).sum::<f64>()
    };
    let over_rows = |w: &dyn Fn(usize, usize) -> f64, x: MatRef<'_, f64>, j: usize, c: usize| {
        (0..n_q).map(|i| w(i, j) * x[(i, c)].abs()).sum::<f64>()
    };
    let p = |i: usize, j: usize| f.weights[(i, j)];
    HeadBound {
        dq: Mat::from_fn(n_q, d_k, |i, c| {
            scale * (over_keys(&sigma, i, c) + acc_q * over_keys(&ds_abs, i, c))
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
    T::DTYPE.unit_roundoff()
}

/// Runs a batched case through both engines and checks every gradient against the bound;
/// returns the largest ratio error / bound.
fn check_batched<T: Element + attn_reference::Element + Default>(c: &Case<'_>) -> f64 {
    let [b, h_q, h_kv, n_q, n_k, d] = c.dims;
    let (qd, kd) = ([b, h_q, n_q, d], [b, h_kv, n_k, d]);
    let store = |n: usize, seed: u64, amp: f32| -> Vec<T> { data::<T>(n, seed, amp) };
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
    let (out, lse) = attn_reference::Attention::batched(q, k, v, &c.opts)
        .and_then(|call| call.forward())
        .map(|f| f.into_parts())
        .unwrap();
    let (mut dq, mut dk, mut dv) = (
        vec![0.0f32; qb.len()],
        vec![0.0f32; kb.len()],
        vec![0.0f32; vb.len()],
    );
    let dsinks = attn_optimized::Attention::batched(q, k, v, &c.opts)
        .and_then(|call| {
            call.backward_into(
                attn_optimized::ForwardRef::batch(out.as_ref(), &lse)?,
                g,
                attn_optimized::GradientsMut {
                    dq: Tensor4Mut::from_layout(&mut dq, qd, Layout::Bhsd).unwrap(),
                    dk: Tensor4Mut::from_layout(&mut dk, kd, Layout::Bhsd).unwrap(),
                    dv: Tensor4Mut::from_layout(&mut dv, kd, Layout::Bhsd).unwrap(),
                },
                attn_optimized::Par::rayon(0),
            )
        })
        .unwrap();
    // The owned call returns the same bits.
    let owned = attn_optimized::Attention::batched(q, k, v, &c.opts)
        .and_then(|call| {
            call.backward(
                attn_optimized::ForwardRef::batch(out.as_ref(), &lse)?,
                g,
                attn_optimized::Par::rayon(0),
            )
        })
        .unwrap();
    assert_eq!(owned.dsinks, dsinks);
    if T::DTYPE == attn_core::Dtype::F32 {
        let flat = |t: &attn_core::Tensor4<T>| -> Vec<f32> {
            t.as_slice().iter().map(|x| x.to_f32()).collect()
        };
        assert_eq!(flat(&owned.dq), dq);
        assert_eq!(flat(&owned.dk), dk);
    }
    let refs = attn_reference::Attention::batched(q, k, v, &c.opts)
        .and_then(|call| call.backward_materialized(g))
        .unwrap();
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
    // bf16 at native precision (AMX tiles or AVX512_BF16 pairs) rounds P and dS to bf16
    // before dV, dK and dQ.
    let native = T::DTYPE == attn_core::Dtype::Bf16
        && attn_optimized::Isa::current().includes(attn_optimized::Isa::Avx512Bf16);
    let rounded = if native { unit::<T>() } else { 0.0 };
    for bi in 0..b {
        let mut kv_sums: Vec<[Mat<f64>; 6]> = Vec::new();
        for kv in 0..h_kv {
            let z = |r, c| Mat::<f64>::zeros(r, c);
            kv_sums.push([
                z(n_k, d),
                z(n_k, d),
                z(n_k, d),
                z(n_k, d),
                z(n_k, d),
                z(n_k, d),
            ]);
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
                let m = if s.len() == h_q {
                    s[h]
                } else {
                    s[bi * h_q + h]
                };
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
                (unit::<T>(), rounded),
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
        let acc = gamma((n_q * group) as f64 + 2.0) + rounded;
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
                check(
                    "dσ",
                    ds[h],
                    sink_want[h],
                    sink_err[h] + U * sink_want[h].abs(),
                    &mut worst,
                );
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

/// The operands of an f32 call in `[B,S,H,D]`, the reference's forward under `opts`.
struct Call {
    qd: [usize; 4],
    kd: [usize; 4],
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    g: Vec<f32>,
}

impl Call {
    fn new([b, h_q, h_kv, n_q, n_k, d]: [usize; 6], seed: u64) -> Self {
        Self {
            qd: [b, h_q, n_q, d],
            kd: [b, h_kv, n_k, d],
            q: data::<f32>(b * h_q * n_q * d, seed, 2.0),
            k: data::<f32>(b * h_kv * n_k * d, seed + 1, 1.0),
            v: data::<f32>(b * h_kv * n_k * d, seed + 2, 1.0),
            g: data::<f32>(b * h_q * n_q * d, seed + 3, 1.0),
        }
    }

    fn views(&self) -> [Tensor4Ref<'_, f32>; 4] {
        let t = bshd;
        [
            t(&self.q, self.qd),
            t(&self.k, self.kd),
            t(&self.v, self.kd),
            t(&self.g, self.qd),
        ]
    }

    /// The engine's gradients under `opts`, from the reference forward under `forward`.
    fn gradients(
        &self,
        forward: &Options<'_>,
        opts: &Options<'_>,
    ) -> attn_core::BatchGradients<f32> {
        let [q, k, v, g] = self.views();
        let (out, lse) = attn_reference::Attention::batched(q, k, v, forward)
            .and_then(|call| call.forward())
            .map(|f| f.into_parts())
            .unwrap();
        attn_optimized::Attention::batched(q, k, v, opts)
            .and_then(|call| {
                call.backward(
                    attn_optimized::ForwardRef::batch(out.as_ref(), &lse)?,
                    g,
                    attn_optimized::Par::rayon(0),
                )
            })
            .unwrap()
    }
}

#[test]
fn a_user_soft_cap_gives_the_built_in_soft_caps_bits() {
    let call = Call::new([2, 4, 2, 150, 170, 16], 11);
    let user = UserSoftCap(cap(1.5));
    let built_in = Options::default()
        .with_softcap(cap(1.5))
        .with_causal(Causal::BottomRight);
    let mine = Options::default()
        .with_score_mod(&user)
        .with_causal(Causal::BottomRight);
    assert_eq!(
        call.gradients(&built_in, &built_in),
        call.gradients(&built_in, &mine)
    );
}

#[test]
fn zero_slopes_and_minus_infinity_sinks_change_no_bit() {
    let call = Call::new([2, 4, 2, 150, 170, 16], 12);
    let plain = Options::default().with_causal(Causal::TopLeft);
    let want = call.gradients(&plain, &plain);
    let zeros = [0.0f32; 4];
    let zero_slopes = plain.with_alibi(Alibi::new(&zeros));
    assert_eq!(call.gradients(&plain, &zero_slopes), want);
    let none = [f32::NEG_INFINITY; 4];
    let no_sinks = plain.with_sinks(&none);
    let got = call.gradients(&plain, &no_sinks);
    assert_eq!((&got.dq, &got.dk, &got.dv), (&want.dq, &want.dk, &want.dv));
    assert_eq!(got.dsinks, Some(vec![0.0; 4]));
}

#[test]
fn a_user_causal_mask_gives_the_bits_of_causal_top_left() {
    let call = Call::new([2, 4, 2, 150, 170, 16], 13);
    let causal = Options::default()
        .with_causal(Causal::TopLeft)
        .with_softcap(cap(2.0));
    let user = Options::default()
        .with_mask_mod(&TopLeftMask)
        .with_softcap(cap(2.0));
    assert_eq!(
        call.gradients(&causal, &causal),
        call.gradients(&causal, &user)
    );
}

#[test]
fn a_single_head_call_is_the_batched_call_of_one_head() {
    let call = Call::new([1, 1, 1, 140, 135, 16], 14);
    let sink = [0.75f32];
    let slope = [0.25f32];
    let opts = Options::default()
        .with_softcap(cap(1.5))
        .with_alibi(Alibi::new(&slope).with_align(Causal::TopLeft))
        .with_sinks(&sink);
    let batched = call.gradients(&opts, &opts);
    let [q, k, v, g] = call.views();
    let (q, k, v, g) = (
        q.head(0, 0).unwrap(),
        k.head(0, 0).unwrap(),
        v.head(0, 0).unwrap(),
        g.head(0, 0).unwrap(),
    );
    let (out, lse) = attn_reference::Attention::head(q, k, v, &opts)
        .and_then(|call| call.forward())
        .map(|f| f.into_parts())
        .unwrap();
    let (mut dq, mut dk, mut dv) = (
        Mat::<f32>::zeros(140, 16),
        Mat::<f32>::zeros(135, 16),
        Mat::<f32>::zeros(135, 16),
    );
    let dsinks = attn_optimized::Attention::head(q, k, v, &opts)
        .and_then(|call| {
            call.backward_into(
                attn_optimized::ForwardRef::head(out.as_ref(), &lse),
                g,
                attn_optimized::GradientsMut {
                    dq: dq.as_mut(),
                    dk: dk.as_mut(),
                    dv: dv.as_mut(),
                },
                attn_optimized::Par::rayon(0),
            )
        })
        .unwrap();
    assert_eq!(dsinks, batched.dsinks);
    assert!(dsinks.is_some_and(|d| d[0] != 0.0));
    let head = |t: &attn_core::Tensor4<f32>| widen(t.as_ref().head(0, 0).unwrap());
    assert_eq!(widen(dq.as_ref()), head(&batched.dq));
    assert_eq!(widen(dk.as_ref()), head(&batched.dk));
    assert_eq!(widen(dv.as_ref()), head(&batched.dv));
}

#[test]
fn packed_gradients_are_within_the_bound_of_each_sequence() {
    // Sequences of 100, 0, 130 and 1 queries over 90, 40, 130 and 0 keys (the last row
    // sees nothing: output 0, LSE σ, no share of dσ), 4 query heads on 2 kv heads,
    // [total, heads, dim]; every modifier and a user mask that sees the sequence index.
    let (h_q, h_kv, d) = (4, 2, 16);
    let (cu_q, cu_k) = ([0, 100, 100, 230, 231], [0, 90, 130, 260, 260]);
    let seqs = CuSeqlens::new(&cu_q, &cu_k).unwrap();
    let (tq, tk) = (231, 260);
    let q = data::<f32>(tq * h_q * d, 21, 2.0);
    let k = data::<f32>(tk * h_kv * d, 22, 1.0);
    let v = data::<f32>(tk * h_kv * d, 23, 1.0);
    let g = data::<f32>(tq * h_q * d, 24, 1.0);
    let t = bshd;
    let opts = |mask: &'static Sparse| {
        Options::default()
            .with_softcap(cap(2.0))
            .with_alibi(Alibi::new(&SLOPES4))
            .with_sinks(&SINKS4)
            .with_causal(Causal::BottomRight)
            .with_mask_mod(mask)
    };
    let all = opts(&SPARSE);
    let (qt, kt, vt, gt) = (
        t(&q, [1, h_q, tq, d]),
        t(&k, [1, h_kv, tk, d]),
        t(&v, [1, h_kv, tk, d]),
        t(&g, [1, h_q, tq, d]),
    );
    let (out, lse) = attn_reference::Attention::packed(qt, kt, vt, &seqs, &all)
        .and_then(|call| call.forward())
        .map(|f| f.into_parts())
        .unwrap();
    let (mut dq, mut dk, mut dv) = (
        vec![0.0f32; q.len()],
        vec![0.0f32; k.len()],
        vec![0.0f32; v.len()],
    );
    let dsinks = attn_optimized::Attention::packed(qt, kt, vt, &seqs, &all)
        .and_then(|call| {
            call.backward_into(
                attn_optimized::ForwardRef::batch(out.as_ref(), &lse)?,
                gt,
                attn_optimized::GradientsMut {
                    dq: Tensor4Mut::from_layout(&mut dq, [1, h_q, tq, d], Layout::Bhsd).unwrap(),
                    dk: Tensor4Mut::from_layout(&mut dk, [1, h_kv, tk, d], Layout::Bhsd).unwrap(),
                    dv: Tensor4Mut::from_layout(&mut dv, [1, h_kv, tk, d], Layout::Bhsd).unwrap(),
                },
                attn_optimized::Par::rayon(0),
            )
        })
        .unwrap()
        .unwrap();
    let owned = attn_optimized::Attention::packed(qt, kt, vt, &seqs, &all)
        .and_then(|call| {
            call.backward(
                attn_optimized::ForwardRef::batch(out.as_ref(), &lse)?,
                gt,
                attn_optimized::Par::rayon(0),
            )
        })
        .unwrap();
    assert_eq!(owned.dq.as_slice(), &dq[..]);
    assert_eq!(owned.dsinks.as_deref(), Some(&dsinks[..]));

    // Each sequence as its own batch-1 call, its mask shifted to see the sequence index.
    let shifted: Vec<&'static Sparse> = (0..4)
        .map(|s| &*Box::leak(Box::new(Sparse { shift: s })))
        .collect();
    let scale = 0.25;
    let group = h_q / h_kv;
    let (mut sink_want, mut sink_err) = (vec![0.0f64; h_q], vec![0.0f64; h_q]);
    let check = |what: &str, got: f32, want: f64, bound: f64| {
        let (err, bound) = ((f64::from(got) - want).abs(), 2.0 * bound + 1e-30);
        assert!(
            err <= bound,
            "{what}: {got} vs {want} (error {err:e} > bound {bound:e})"
        );
    };
    for s in 0..4 {
        let (rows, keys) = (cu_q[s]..cu_q[s + 1], cu_k[s]..cu_k[s + 1]);
        let (nq, nk) = (rows.len(), keys.len());
        fn sub<'x>(x: &'x [f32], r: &Range<usize>, h: usize, d: usize) -> Tensor4Ref<'x, f32> {
            bshd(&x[r.start * h * d..r.end * h * d], [1, h, r.len(), d])
        }
        let (qs, ks, vs, gs) = (
            sub(&q, &rows, h_q, d),
            sub(&k, &keys, h_kv, d),
            sub(&v, &keys, h_kv, d),
            sub(&g, &rows, h_q, d),
        );
        let o = opts(shifted[s]);
        let refs = attn_reference::Attention::batched(qs, ks, vs, &o)
            .and_then(|call| call.backward_materialized(gs))
            .unwrap();
        for kv in 0..h_kv {
            let z = || Mat::<f64>::zeros(nk, d);
            let mut sums = [z(), z(), z(), z(), z(), z()];
            for h in kv * group..(kv + 1) * group {
                let r = &refs[0][h];
                let x = [
                    widen(qs.head(0, h).unwrap()),
                    widen(ks.head(0, kv).unwrap()),
                    widen(vs.head(0, kv).unwrap()),
                    widen(gs.head(0, h).unwrap()),
                ];
                let off = nk as i64 - nq as i64;
                let hb = head_bound(
                    [x[0].as_ref(), x[1].as_ref(), x[2].as_ref(), x[3].as_ref()],
                    r,
                    scale,
                    Some(2.0),
                    Some((f64::from(SLOPES4[h]), off)),
                    (U, 0.0),
                );
                for (i, row) in rows.clone().enumerate() {
                    for c in 0..d {
                        check(
                            "dQ",
                            dq[(h * tq + row) * d + c],
                            r.dq[(i, c)],
                            hb.dq[(i, c)],
                        );
                    }
                }
                sums[0] += &r.dk;
                sums[1] += &hb.dk;
                sums[2] += &hb.dk_abs;
                sums[3] += &r.dv;
                sums[4] += &hb.dv;
                sums[5] += &hb.dv_abs;
                sink_want[h] += r.dsink;
                sink_err[h] += hb.dsink;
            }
            let acc = gamma((nq * group) as f64 + 2.0);
            for (j, key) in keys.clone().enumerate() {
                for c in 0..d {
                    let at = (kv * tk + key) * d + c;
                    check(
                        "dK",
                        dk[at],
                        sums[0][(j, c)],
                        sums[1][(j, c)] + acc * sums[2][(j, c)],
                    );
                    check(
                        "dV",
                        dv[at],
                        sums[3][(j, c)],
                        sums[4][(j, c)] + acc * sums[5][(j, c)],
                    );
                }
            }
        }
    }
    for h in 0..h_q {
        check(
            "dσ",
            dsinks[h],
            sink_want[h],
            sink_err[h] + U * sink_want[h].abs(),
        );
    }
    assert_eq!(dsinks[3], 0.0); // the -inf sink
}

#[test]
fn the_bound_catches_a_gradient_without_the_chain_rule() {
    // The teeth: the soft-cap's gradient differs from the one that leaves out f' by far
    // more than the bound, so a backward pass that forgot the chain rule fails above.
    let call = Call::new([1, 1, 1, 130, 140, 16], 31);
    let opts = Options::default().with_softcap(cap(1.0));
    let got = call.gradients(&opts, &opts);
    let [q, k, v, g] = call.views();
    let refs = attn_reference::Attention::batched(q, k, v, &opts)
        .and_then(|call| call.backward_materialized(g))
        .unwrap();
    let r = &refs[0][0];
    let x = [
        widen(q.head(0, 0).unwrap()),
        widen(k.head(0, 0).unwrap()),
        widen(v.head(0, 0).unwrap()),
        widen(g.head(0, 0).unwrap()),
    ];
    let hb = head_bound(
        [x[0].as_ref(), x[1].as_ref(), x[2].as_ref(), x[3].as_ref()],
        r,
        0.25,
        Some(1.0),
        None,
        (U, 0.0),
    );
    let dq = got.dq.as_ref().head(0, 0).unwrap();
    let mut caught = 0;
    for i in 0..130 {
        for c in 0..16 {
            let wrong: f64 = (0..140)
                .map(|j| 0.25 * r.ds_modified[(i, j)] * x[1][(j, c)])
                .sum();
            assert!((f64::from(dq[(i, c)]) - r.dq[(i, c)]).abs() <= 2.0 * hb.dq[(i, c)] + 1e-30);
            if (wrong - r.dq[(i, c)]).abs() > 2.0 * hb.dq[(i, c)] + 1e-30 {
                caught += 1;
            }
        }
    }
    assert!(
        caught > 130 * 16 * 9 / 10,
        "only {caught} entries would fail"
    );
}

/// A `[B,S,H,D]` view of `x`.
fn bshd(x: &[f32], dims: [usize; 4]) -> Tensor4Ref<'_, f32> {
    Tensor4Ref::from_layout(x, dims, Layout::Bshd).unwrap()
}

#[test]
fn the_bits_do_not_depend_on_the_thread_count() {
    // Few groups: the key blocks are dealt to chunks, and the sinks' sums run in order.
    let call = Call::new([1, 4, 1, 300, 420, 16], 41);
    let opts = Options::default()
        .with_softcap(cap(1.5))
        .with_alibi(Alibi::new(&SLOPES4))
        .with_sinks(&SINKS4)
        .with_mask_mod(&SPARSE);
    let in_pool = |threads| {
        rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap()
            .install(|| call.gradients(&opts, &opts))
    };
    let one = in_pool(1);
    for threads in [2, 3] {
        assert_eq!(in_pool(threads), one, "{threads} threads");
    }
}

#[test]
fn a_hidden_non_finite_key_reaches_no_gradient_through_the_modifiers() {
    // Causal top-left: key 5 is hidden from queries 0..5. A NaN in its K row and an
    // infinity in its V row make its raw scores and dP NaN there; the soft-cap and the
    // user modifier see them (they run before the masks), and the chain rule must still
    // leave those entries 0: the rows 0..5 get what they get when key 5 is finite (to
    // rounding: the products then skip zeros, in another order). The rows that see key 5
    // are NaN, and so is what they reach: the contract lets the poison through. (A NaN
    // that leaked into rows 0..5 would also be mended, by the exact repair of non-finite
    // gradient rows, at its cost: this checks the contract, not the fast path alone.)
    let finite = Call::new([1, 1, 1, 40, 40, 8], 51);
    let mut poisoned = Call::new([1, 1, 1, 40, 40, 8], 51);
    poisoned.k[5 * 8 + 2] = f32::NAN;
    poisoned.v[5 * 8 + 1] = f32::INFINITY;
    let user = UserSoftCap(cap(3.0));
    for opts in [
        Options::default()
            .with_causal(Causal::TopLeft)
            .with_softcap(cap(3.0)),
        Options::default()
            .with_causal(Causal::TopLeft)
            .with_score_mod(&user),
    ] {
        let (want, got) = (
            finite.gradients(&opts, &opts),
            poisoned.gradients(&opts, &opts),
        );
        let (want, got) = (
            want.dq.as_ref().head(0, 0).unwrap(),
            got.dq.as_ref().head(0, 0).unwrap(),
        );
        for i in 0..5 {
            for c in 0..8 {
                let (g, w) = (got[(i, c)], want[(i, c)]);
                assert!(
                    g.is_finite() && (g - w).abs() <= 1e-6 * (1.0 + w.abs()),
                    "dQ ({i}, {c}): {g} vs {w}"
                );
            }
        }
        assert!(got.row(5).iter().all(|x| x.is_nan()));
    }
}

/// Values near `f32::MAX` with a soft-cap and ALiBi: `dP = dO Vᵀ` overflows f32 while
/// nothing exact does, so the gradient rows are recomputed exactly (`exact.rs`), which must
/// modify the scores and apply the chain rule as the tiles do.
#[test]
fn gradient_rows_repaired_exactly_apply_the_modifiers() {
    for (n_q, n_k) in [(6, 40), (1, 9), (130, 20)] {
        let q = Mat::<f32>::from_fn(n_q, 4, |i, c| ((i * 5 + c * 3) % 7) as f32 * 0.3 - 0.9);
        let k = Mat::<f32>::from_fn(n_k, 4, |j, c| ((j * 3 + c) % 5) as f32 * 0.4 - 0.8);
        let v = Mat::<f32>::from_fn(n_k, 3, |j, c| {
            f32::MAX * (0.5 + 0.1 * ((j + c) % 3) as f32 / 2.0)
        });
        let d_out = Mat::<f32>::from_fn(n_q, 3, |i, c| {
            (1.0 + i as f32 / 64.0) * if c == 2 { -1.0 } else { 1.0 }
        });
        let slope = [0.25f32];
        let opts = Options::default()
            .with_softcap(cap(0.5))
            .with_alibi(Alibi::new(&slope));
        let (o, lse) = attn_reference::Attention::head(q.as_ref(), k.as_ref(), v.as_ref(), &opts)
            .and_then(|call| call.forward())
            .map(|f| f.into_parts())
            .unwrap();
        let args = (
            d_out.as_ref(),
            q.as_ref(),
            k.as_ref(),
            v.as_ref(),
            o.as_ref(),
        );
        let g =
            attn_optimized::attention_backward(args.0, args.1, args.2, args.3, args.4, &lse, &opts)
                .unwrap();
        let r =
            attn_reference::attention_backward(args.0, args.1, args.2, args.3, args.4, &lse, &opts)
                .unwrap();
        for (name, a, b) in [
            ("dQ", &g.dq, &r.dq),
            ("dK", &g.dk, &r.dk),
            ("dV", &g.dv, &r.dv),
        ] {
            let scale = (0..b.nrows())
                .flat_map(|i| (0..b.ncols()).map(move |c| (i, c)))
                .map(|ic| b[ic].abs())
                .fold(f32::MIN_POSITIVE, f32::max);
            for i in 0..b.nrows() {
                for c in 0..b.ncols() {
                    let (x, y) = (a[(i, c)], b[(i, c)]);
                    assert!(
                        x.is_finite() && (x - y).abs() <= 1e-3 * scale,
                        "{name} ({i}, {c}) {n_q}×{n_k}: {x} vs {y}"
                    );
                }
            }
        }
    }
}

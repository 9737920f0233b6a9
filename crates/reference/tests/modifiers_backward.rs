//! The reference's backward pass through the score modifiers against central
//! finite differences of its own f64 forward.
//!
//! For a fixed upstream gradient `dO`, `L = Σ dO·O` has `∂L/∂X = dX` for `X ∈ {Q, K, V}`
//! and `∂L/∂σ_h = dσ_h`. Each entry `x` (Q, K, V in f64, entries multiples of `2⁻²⁰`; sink
//! logits multiples of `2⁻¹⁰`) is moved by `±h` and `±h/2` (exact, `h = 2⁻⁸`, or `2⁻⁵` for a
//! user modifier) and the Richardson extrapolation `R = (4·D(h/2) − D(h))/3` of the two
//! central differences is compared with the gradient.
//!
//! The tolerance is not fitted but it is not derived entry by entry either (as
//! `backward_finite_differences.rs` does without modifiers): `R` is off by `O(h⁴·∂⁵L)`
//! (about `h⁴ ≈ 2e-10` times derivatives of order 1 for scores of order 1) plus about
//! `3·ε_L/h` of rounding (`ε_L ≈ 1e-15`: about `1e-12`); the largest error observed over
//! these cases is `5.5e-9` (the sink cases, whose sixth derivatives are larger), and
//! `TOL = 1e-7·(1 + |g|)` sits 18 times above it. A user modifier is an f32 function (the
//! reference rounds its input and output to f32): `L` then carries noise of about
//! `2⁻²⁴·Σ|s||dS|`, divided by `h = 2⁻⁵` in `R`; observed at most `5.5e-7`, and the
//! tolerance is `TOL_F32 = 1e-5·(1 + |g|)`. What the tests must catch is larger: the
//! gradient without the modifiers' derivative misses by more than `100·TOL` (checked
//! below, the teeth: `3.5e-2` for a soft-cap, `8.5e-3` for the cubic user modifier), a
//! wrong sign by `2|g|`.

mod common;

use attn_core::{
    Alibi, BatchGradients, Causal, CuSeqlens, Layout, MaskMod, Options, ScoreMod, SlidingWindow,
    SoftCap, Tensor4Ref, TileCoverage,
};
use attn_reference::{Attention, BoolMask, ForwardRef, attention_backward};
use common::Rng;
use core::ops::Range;
use faer::Mat;

const H: f64 = 1.0 / 256.0;
const H_F32: f64 = 1.0 / 32.0;
const TOL: f64 = 1e-7;
const TOL_F32: f64 = 1e-5;

/// One head's gradients for the upstream gradient `d_out`: the free `attention_backward` on
/// the call's own forward output and LSE.
fn forward_backward(
    [q, k, v]: [&Mat<f64>; 3],
    d_out: &Mat<f64>,
    opts: &Options<'_>,
) -> attn_core::Gradients<f64> {
    let (q, k, v) = (q.as_ref(), k.as_ref(), v.as_ref());
    let (out, lse) = Attention::head(q, k, v, opts)
        .and_then(|call| call.forward())
        .map(|f| f.into_parts())
        .unwrap();
    attention_backward(d_out.as_ref(), q, k, v, out.as_ref(), &lse, opts).unwrap()
}

/// `s + 0.05·s² − 0.01·s³`, a smooth user modifier with its exact derivative (f32).
#[derive(Debug)]
struct Cubic;

impl ScoreMod for Cubic {
    fn score(&self, s: f32, _b: usize, _h: usize, _i: usize, _j: usize) -> f32 {
        s + 0.05 * s * s - 0.01 * s * s * s
    }
    fn derivative(&self, s: f32, _b: usize, _h: usize, _i: usize, _j: usize) -> f32 {
        1.0 + 0.1 * s - 0.03 * s * s
    }
}

/// Hides key `j` from query `i` of head `h` of entry `b` when `3i + j + b + 2h ≡ 0 mod 4`:
/// depends on every position it is given, so a wrong position shows.
#[derive(Debug)]
struct Sparse;

impl MaskMod for Sparse {
    fn visible(&self, b: usize, h: usize, i: usize, j: usize) -> bool {
        !(3 * i + j + b + 2 * h).is_multiple_of(4)
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

static SLOPES4: [f32; 4] = [0.5, 0.25, 0.125, 0.0625];
static SLOPES8: [f32; 8] = [0.5, 0.25, 0.125, 0.0625, 0.75, 0.375, 0.0, 1.0];

/// The options of a case, given its sink logits (or none).
type Build = for<'s> fn(Option<&'s [f32]>) -> Options<'s>;

/// A batched (or packed: batch 1 and `seqs`) problem in f64, `[B,H,S,D]` contiguous.
struct Problem {
    q_dims: [usize; 4],
    k_dims: [usize; 4],
    v_dims: [usize; 4],
    o_dims: [usize; 4],
    q: Vec<f64>,
    k: Vec<f64>,
    v: Vec<f64>,
    d_out: Vec<f64>,
    sinks: Option<Vec<f32>>,
    seqs: Option<(Vec<usize>, Vec<usize>)>,
}

impl Problem {
    #[allow(clippy::too_many_arguments)]
    fn new(
        seed: u64,
        [b, h_q, h_kv]: [usize; 3],
        [n_q, n_k, d_k, d_v]: [usize; 4],
        q_amp: f64,
        sinks: bool,
    ) -> Self {
        let mut r = Rng(seed);
        let q = r.vec(b * h_q * n_q * d_k, q_amp);
        let k = r.vec(b * h_kv * n_k * d_k, 1.0);
        let v = r.vec(b * h_kv * n_k * d_v, 1.0);
        let d_out = r.vec(b * h_q * n_q * d_v, 1.0);
        let sinks = sinks.then(|| (0..h_q).map(|_| r.sink()).collect());
        Self {
            q_dims: [b, h_q, n_q, d_k],
            k_dims: [b, h_kv, n_k, d_k],
            v_dims: [b, h_kv, n_k, d_v],
            o_dims: [b, h_q, n_q, d_v],
            q,
            k,
            v,
            d_out,
            sinks,
            seqs: None,
        }
    }

    fn packed(mut self, cu_q: &[usize], cu_k: &[usize]) -> Self {
        self.seqs = Some((cu_q.to_vec(), cu_k.to_vec()));
        self
    }

    fn view<'a>(&self, x: &'a [f64], dims: [usize; 4]) -> Tensor4Ref<'a, f64> {
        Tensor4Ref::from_layout(x, dims, Layout::Bhsd).unwrap()
    }

    /// `L = Σ dO·O` at the given operands and sinks.
    fn loss(&self, [q, k, v]: [&[f64]; 3], sinks: Option<&[f32]>, build: Build) -> f64 {
        let opts = build(sinks);
        let (q, k, v) = (
            self.view(q, self.q_dims),
            self.view(k, self.k_dims),
            self.view(v, self.v_dims),
        );
        let out = match &self.seqs {
            None => {
                Attention::batched(q, k, v, &opts)
                    .and_then(|call| call.forward())
                    .map(|f| f.into_parts())
                    .unwrap()
                    .0
            }
            Some((cq, ck)) => {
                let seqs = CuSeqlens::new(cq, ck).unwrap();
                Attention::packed(q, k, v, &seqs, &opts)
                    .and_then(|call| call.forward())
                    .map(|f| f.into_parts())
                    .unwrap()
                    .0
            }
        };
        out.as_slice()
            .iter()
            .zip(&self.d_out)
            .map(|(o, g)| o * g)
            .sum()
    }

    fn gradients(&self, build: Build) -> BatchGradients<f64> {
        let opts = build(self.sinks.as_deref());
        let (q, k, v, g) = (
            self.view(&self.q, self.q_dims),
            self.view(&self.k, self.k_dims),
            self.view(&self.v, self.v_dims),
            self.view(&self.d_out, self.o_dims),
        );
        match &self.seqs {
            None => {
                let (out, lse) = Attention::batched(q, k, v, &opts)
                    .and_then(|call| call.forward())
                    .map(|f| f.into_parts())
                    .unwrap();
                Attention::batched(q, k, v, &opts)
                    .and_then(|call| call.backward(ForwardRef::batch(out.as_ref(), &lse)?, g))
                    .unwrap()
            }
            Some((cq, ck)) => {
                let seqs = CuSeqlens::new(cq, ck).unwrap();
                let (out, lse) = Attention::packed(q, k, v, &seqs, &opts)
                    .and_then(|call| call.forward())
                    .map(|f| f.into_parts())
                    .unwrap();
                Attention::packed(q, k, v, &seqs, &opts)
                    .and_then(|call| call.backward(ForwardRef::batch(out.as_ref(), &lse)?, g))
                    .unwrap()
            }
        }
    }

    /// Every gradient against the extrapolated finite differences; returns the largest
    /// `|g − R| / (1 + |g|)`.
    fn check(&self, build: Build, h: f64, tol: f64) -> f64 {
        let g = self.gradients(build);
        let ops = [&self.q, &self.k, &self.v];
        let grads = [g.dq.as_slice(), g.dk.as_slice(), g.dv.as_slice()];
        let mut worst = 0.0f64;
        let mut compare = |what: &str, at: usize, got: f64, r: f64| {
            let err = (got - r).abs() / (1.0 + got.abs());
            assert!(
                err <= tol,
                "{what}[{at}]: gradient {got:e}, finite differences {r:e} (error {err:e} > {tol:e})"
            );
            worst = worst.max(err);
        };
        for (x, (op, grad)) in ops.iter().zip(grads).enumerate() {
            for at in 0..op.len() {
                let moved = |step: f64| {
                    let mut ins = [self.q.clone(), self.k.clone(), self.v.clone()];
                    ins[x][at] += step;
                    self.loss([&ins[0], &ins[1], &ins[2]], self.sinks.as_deref(), build)
                };
                let r = richardson(moved, h);
                compare(["dQ", "dK", "dV"][x], at, grad[at], r);
            }
        }
        match (&self.sinks, &g.dsinks) {
            (Some(sinks), Some(ds)) => {
                assert_eq!(ds.len(), sinks.len());
                for h_ in 0..sinks.len() {
                    let moved = |step: f64| {
                        let mut s = sinks.clone();
                        s[h_] += step as f32; // exact: see Rng::sink
                        self.loss([&self.q, &self.k, &self.v], Some(&s), build)
                    };
                    compare("dσ", h_, f64::from(ds[h_]), richardson(moved, h));
                }
            }
            (None, None) => {}
            (s, d) => panic!("sinks {s:?} but their gradients {d:?}"),
        }
        worst
    }
}

/// `(4·D(h/2) − D(h)) / 3` of the central differences `D` of `f` around 0.
fn richardson(f: impl Fn(f64) -> f64, h: f64) -> f64 {
    let d1 = (f(h) - f(-h)) / (2.0 * h);
    let d2 = (f(h / 2.0) - f(-h / 2.0)) / h;
    (4.0 * d2 - d1) / 3.0
}

#[test]
fn soft_cap_gradients_match_finite_differences() {
    // Q in [−2, 2]: scores up to about 7, well into the cap of 1.5.
    let p = Problem::new(1, [1, 2, 2], [5, 7, 3, 2], 2.0, false);
    let build: Build = |s| with_sinks_opt(Options::default().with_softcap(cap(1.5)), s);
    p.check(build, H, TOL);
}

#[test]
fn alibi_gradients_match_finite_differences_in_both_alignments() {
    let p = Problem::new(2, [2, 4, 2], [5, 7, 3, 2], 1.0, false);
    let bottom: Build = |s| with_sinks_opt(Options::default().with_alibi(Alibi::new(&SLOPES4)), s);
    let top: Build = |s| {
        let a = Alibi::new(&SLOPES8).with_align(Causal::TopLeft); // per (entry, head)
        with_sinks_opt(Options::default().with_alibi(a), s)
    };
    p.check(bottom, H, TOL);
    p.check(top, H, TOL);
}

#[test]
fn sink_gradients_match_finite_differences() {
    let p = Problem::new(3, [2, 4, 2], [5, 7, 3, 2], 1.0, true);
    let plain: Build = |s| with_sinks_opt(Options::default(), s);
    p.check(plain, H, TOL);
    // With every modifier and a causal mask (bottom-right: n_q < n_k, no empty row).
    let all: Build = |s| {
        let o = Options::default()
            .with_softcap(cap(2.0))
            .with_alibi(Alibi::new(&SLOPES4))
            .with_causal(Causal::BottomRight);
        with_sinks_opt(o, s)
    };
    p.check(all, H, TOL);
}

#[test]
fn rows_that_see_nothing_add_nothing_to_the_sink_gradient() {
    // Entry 0 has no key (key length 0): its rows have output 0 and LSE σ, p_sink = 1,
    // but D = 0 — their finite differences are 0, and so must their share of dσ be.
    let p = Problem::new(4, [2, 2, 1], [4, 6, 3, 3], 1.0, true);
    let build: Build = |s| {
        let o = Options::default()
            .with_key_lengths(&[0, 5])
            .with_softcap(cap(3.0));
        with_sinks_opt(o, s)
    };
    p.check(build, H, TOL);
    let heads = materialized(&p, build);
    for m in &heads[0] {
        assert!(m.p_sink.iter().all(|&x| x == 1.0), "{:?}", m.p_sink);
        assert_eq!(m.dsink, 0.0);
        assert!(m.ds.col_iter().all(|c| c.iter().all(|&x| x == 0.0)));
    }
}

#[test]
fn a_user_score_modifier_is_differentiated_by_its_derivative() {
    let p = Problem::new(5, [2, 2, 1], [5, 7, 3, 2], 1.0, true);
    let build: Build = |s| with_sinks_opt(Options::default().with_score_mod(&Cubic), s);
    p.check(build, H_F32, TOL_F32);
    // Chained after the built-ins.
    let chained: Build = |s| {
        let o = Options::default()
            .with_softcap(cap(2.0))
            .with_alibi(Alibi::new(&SLOPES4[..2]))
            .with_score_mod(&Cubic);
        with_sinks_opt(o, s)
    };
    p.check(chained, H_F32, TOL_F32);
}

#[test]
fn user_masks_and_structural_masks_combine_with_the_modifiers() {
    let p = Problem::new(6, [2, 4, 2], [6, 6, 3, 2], 1.0, true);
    let user: Build = |s| {
        let o = Options::default()
            .with_mask_mod(&Sparse)
            .with_softcap(cap(1.0))
            .with_causal(Causal::TopLeft);
        with_sinks_opt(o, s)
    };
    p.check(user, H, TOL);
    let window: Build = |s| {
        let o = Options::default()
            .with_window(SlidingWindow::new(Some(2), Some(1), Causal::TopLeft))
            .with_alibi(Alibi::new(&SLOPES8).with_align(Causal::TopLeft));
        with_sinks_opt(o, s)
    };
    p.check(window, H, TOL);
}

#[test]
fn a_user_mask_reimplementing_causal_gives_the_same_bits() {
    let p = Problem::new(7, [1, 2, 1], [6, 6, 3, 2], 1.0, true);
    let causal: Build = |s| {
        with_sinks_opt(
            Options::default()
                .with_causal(Causal::TopLeft)
                .with_softcap(cap(1.0)),
            s,
        )
    };
    let user: Build = |s| {
        with_sinks_opt(
            Options::default()
                .with_mask_mod(&TopLeft)
                .with_softcap(cap(1.0)),
            s,
        )
    };
    assert_eq!(p.gradients(causal), p.gradients(user));
}

#[test]
fn packed_gradients_match_finite_differences() {
    // Sequences of 2, 2 and 2 queries over 3, 0 and 5 keys: the middle one sees nothing.
    let p =
        Problem::new(8, [1, 4, 2], [6, 8, 3, 2], 1.0, true).packed(&[0, 2, 4, 6], &[0, 3, 3, 8]);
    let build: Build = |s| {
        let o = Options::default()
            .with_softcap(cap(1.5))
            .with_alibi(Alibi::new(&SLOPES4))
            .with_mask_mod(&Sparse);
        with_sinks_opt(o, s)
    };
    p.check(build, H, TOL);
    let user: Build = |s| with_sinks_opt(Options::default().with_score_mod(&Cubic), s);
    p.check(user, H_F32, TOL_F32);
}

#[test]
fn a_single_head_call_is_the_batched_call_of_one_head() {
    let p = Problem::new(9, [1, 1, 1], [5, 7, 3, 2], 2.0, true);
    let build: Build = |s| {
        let o = Options::default()
            .with_softcap(cap(1.5))
            .with_alibi(Alibi::new(&SLOPES4[..1]));
        with_sinks_opt(o, s)
    };
    p.check(build, H, TOL);
    let mat = |x: &[f64], r: usize, c: usize| Mat::from_fn(r, c, |i, j| x[i * c + j]);
    let (q, k, v, g) = (
        mat(&p.q, 5, 3),
        mat(&p.k, 7, 3),
        mat(&p.v, 7, 2),
        mat(&p.d_out, 5, 2),
    );
    let opts = build(p.sinks.as_deref());
    let one = forward_backward([&q, &k, &v], &g, &opts);
    let batched = p.gradients(build);
    let flat = |m: &Mat<f64>| {
        (0..m.nrows())
            .flat_map(|i| (0..m.ncols()).map(move |j| (i, j)))
            .map(|ij| m[ij])
            .collect::<Vec<_>>()
    };
    assert_eq!(flat(&one.dq), batched.dq.as_slice());
    assert_eq!(flat(&one.dk), batched.dk.as_slice());
    assert_eq!(flat(&one.dv), batched.dv.as_slice());
    assert_eq!(one.dsinks, batched.dsinks);
}

#[test]
fn minus_infinity_sinks_and_zero_slopes_change_no_bit() {
    let p = Problem::new(10, [2, 2, 1], [5, 7, 3, 2], 1.0, false);
    let none: Build = |_| Options::default().with_softcap(cap(2.0));
    let minus_inf: Build = |_| {
        Options::default()
            .with_softcap(cap(2.0))
            .with_sinks(&[f32::NEG_INFINITY, f32::NEG_INFINITY])
    };
    let zero_slopes: Build = |_| {
        Options::default()
            .with_softcap(cap(2.0))
            .with_alibi(Alibi::new(&[0.0, 0.0]))
    };
    let (a, b, c) = (
        p.gradients(none),
        p.gradients(minus_inf),
        p.gradients(zero_slopes),
    );
    assert_eq!((&a.dq, &a.dk, &a.dv), (&b.dq, &b.dk, &b.dv));
    assert_eq!(b.dsinks, Some(vec![0.0, 0.0]));
    assert_eq!(a, c);
}

#[test]
fn each_row_of_the_modified_score_gradient_sums_to_p_sink_times_d() {
    let p = Problem::new(11, [2, 4, 2], [6, 9, 4, 3], 2.0, true);
    let build: Build = |s| {
        let o = Options::default()
            .with_softcap(cap(1.5))
            .with_alibi(Alibi::new(&SLOPES4))
            .with_causal(Causal::BottomRight)
            .with_mask_mod(&Sparse);
        with_sinks_opt(o, s)
    };
    for per_head in materialized(&p, build) {
        for m in per_head {
            for i in 0..m.ds_modified.nrows() {
                let row = m.ds_modified.row(i);
                let (sum, abs) = row
                    .iter()
                    .fold((0.0, 0.0), |(s, a): (f64, f64), &x| (s + x, a + x.abs()));
                let want = m.p_sink[i] * m.d[i];
                assert!(m.p_sink[i] > 0.0);
                assert!(
                    (sum - want).abs() <= 1e-13 * (abs + want.abs() + 1.0),
                    "row {i}: Σ dS_mod = {sum:e}, p_sink·D = {want:e}"
                );
            }
        }
    }
}

#[test]
fn the_finite_differences_catch_a_gradient_without_the_chain_rule() {
    // The teeth: dQ from dS_mod (the modifiers' derivative left out) misses the finite
    // differences by far more than the tolerance, for the soft-cap and a user modifier.
    let p = Problem::new(12, [1, 1, 1], [5, 7, 3, 2], 2.0, false);
    let mat = |x: &[f64], r: usize, c: usize| Mat::from_fn(r, c, |i, j| x[i * c + j]);
    let (q, k, v, g) = (
        mat(&p.q, 5, 3),
        mat(&p.k, 7, 3),
        mat(&p.v, 7, 2),
        mat(&p.d_out, 5, 2),
    );
    let cases: [(Build, f64, f64); 2] = [
        (|_| Options::default().with_softcap(cap(1.5)), H, TOL),
        (
            |_| Options::default().with_score_mod(&Cubic),
            H_F32,
            TOL_F32,
        ),
    ];
    for (build, h, tol) in cases {
        let opts = build(None);
        let m = Attention::head(q.as_ref(), k.as_ref(), v.as_ref(), &opts)
            .and_then(|call| call.backward_materialized(g.as_ref()))
            .unwrap();
        let scale = 1.0 / 3f64.sqrt();
        let mut worst = 0.0f64;
        for i in 0..5 {
            for c in 0..3 {
                let wrong: f64 = (0..7)
                    .map(|j| scale * m.ds_modified[(i, j)] * k[(j, c)])
                    .sum();
                let moved = |step: f64| {
                    let mut q = p.q.clone();
                    q[i * 3 + c] += step;
                    p.loss([&q, &p.k, &p.v], None, build)
                };
                let r = richardson(moved, h);
                worst = worst.max((wrong - r).abs() / (1.0 + wrong.abs()));
            }
        }
        assert!(worst > 100.0 * tol, "the planted bug is within {worst:e}");
    }
}

fn materialized(p: &Problem, build: Build) -> Vec<Vec<attn_reference::MaterializedBackward>> {
    let opts = build(p.sinks.as_deref());
    let (q, k, v, g) = (
        p.view(&p.q, p.q_dims),
        p.view(&p.k, p.k_dims),
        p.view(&p.v, p.v_dims),
        p.view(&p.d_out, p.o_dims),
    );
    Attention::batched(q, k, v, &opts)
        .and_then(|call| call.backward_materialized(g))
        .unwrap()
}

fn cap(c: f32) -> SoftCap {
    SoftCap::new(c).unwrap()
}

fn with_sinks_opt<'s>(o: Options<'s>, sinks: Option<&'s [f32]>) -> Options<'s> {
    match sinks {
        Some(s) => o.with_sinks(s),
        None => o,
    }
}

#[test]
fn the_boolean_mask_with_a_soft_cap_matches_finite_differences() {
    // A single head through the 2-D boolean mask (checked here, not in `Problem`).
    let mut r = Rng(13);
    let (n_q, n_k, d) = (4, 6, 3);
    let bits = Mat::from_fn(n_q, n_k, |i, j| (i + 2 * j) % 3 != 0);
    let q = Mat::from_fn(n_q, d, |_, _| r.entry(2.0));
    let k = Mat::from_fn(n_k, d, |_, _| r.entry(1.0));
    let v = Mat::from_fn(n_k, d, |_, _| r.entry(1.0));
    let g = Mat::from_fn(n_q, d, |_, _| r.entry(1.0));
    let sink = [0.25f32];
    fn build<'a>(bits: faer::MatRef<'a, bool>, sink: &'a [f32]) -> Options<'a> {
        Options::default()
            .with_bool_mask(BoolMask::allow(bits))
            .with_softcap(cap(1.5))
            .with_sinks(sink)
    }
    let opts = build(bits.as_ref(), &sink);
    let loss = |q: &Mat<f64>, k: &Mat<f64>, sink: &[f32]| {
        let o = build(bits.as_ref(), sink);
        let (out, _) = Attention::head(q.as_ref(), k.as_ref(), v.as_ref(), &o)
            .and_then(|call| call.forward())
            .map(|f| f.into_parts())
            .unwrap();
        (0..n_q)
            .flat_map(|i| (0..d).map(move |c| (i, c)))
            .map(|ic| out[ic] * g[ic])
            .sum::<f64>()
    };
    let grads = forward_backward([&q, &k, &v], &g, &opts);
    let ok = |got: f64, r: f64| assert!((got - r).abs() <= TOL * (1.0 + got.abs()), "{got} {r}");
    for i in 0..n_q {
        for c in 0..d {
            let r = richardson(
                |s| {
                    let mut q = q.clone();
                    q[(i, c)] += s;
                    loss(&q, &k, &sink)
                },
                H,
            );
            ok(grads.dq[(i, c)], r);
        }
    }
    for j in 0..n_k {
        for c in 0..d {
            let r = richardson(
                |s| {
                    let mut k = k.clone();
                    k[(j, c)] += s;
                    loss(&q, &k, &sink)
                },
                H,
            );
            ok(grads.dk[(j, c)], r);
        }
    }
    let r = richardson(|s| loss(&q, &k, &[sink[0] + s as f32]), H);
    ok(f64::from(grads.dsinks.unwrap()[0]), r);
}

//! The reference backward pass against central finite differences of the f64 forward.
//!
//! For a fixed random upstream gradient `dO`, the loss `L = Σ_ic dO_ic·O_ic` has
//! `∂L/∂X = dX` for `X ∈ {Q, K, V}`. Each entry `x` of Q, K and V is moved by `±h`,
//! `h = 2⁻¹⁶ ≈ 1.5e-5` (entries are multiples of `2⁻²⁰` in `[−1, 1]`, so `x ± h` is
//! exact), and `(L(x + h) − L(x − h)) / 2h` is compared with the reference's gradient
//! within a tolerance derived per entry from the step, not fitted:
//!
//! - **truncation** `h²/6 · T₃`, where `T₃` bounds `|∂³L/∂x³|` along the step. Moving
//!   `Q_it` shifts row `i`'s scores by `h·c_j`, `c_j = scale·K_jt`; with `a ∝ e^{h c}`,
//!   `d³/dh³ E_a[v] = E[ṽc̃³] − 3E[ṽc̃]E[c̃²]` (centred `ṽ`, `c̃`), at most
//!   `4·R_v·R_c³` for the ranges `R` of `v` and `c` over the visible keys, whatever `h`.
//!   Moving `K_jt` shifts score `j` of every row `i` that sees it by `h·scale·Q_it`
//!   (`R_c = scale·|Q_it|`). `L` is linear in `V`: no truncation.
//! - **rounding** `ε_L / h`, where `ε_L` bounds the f64 error of each evaluation of `L`:
//!   the forward's own error (the oracle's derivation in f64: scores within
//!   `Δ = γ_{d_k+6}·scale·max_j Σ_t |q_t||k_jt| + 4u·max|b|`, weights within `2W/(1−W)`
//!   with `W = e^{Δ+2u}(1 + 2u(ln n + 2Δ)) − 1`, accumulation `3γ_{2n_k+2}`) weighted by
//!   `|dO|`, plus the sum of `L` itself.
//! - **the reference's own error**: every relative error on a path of its gradients
//!   (weights, dot products, `D`, the products and sums) times the gradient's absolute
//!   counterpart, e.g. `scale·Σ_j P_ij(Σ_c|dO_ic||V_jc| + Σ_c|dO_ic|·max_j|V_jc|)|K_jc|`
//!   for dQ.
//!
//! All three are multiplied by 2 (terms of second order dropped). With entries of
//! magnitude 1 the tolerance is about `1e-8`, the gradients about `1e-2` to `1`: a
//! missing term, a wrong sign or a transposition misses by orders of magnitude.

mod common;

use attn_reference::{
    Attention, BoolMask, Causal, ForwardRef, Layout, Materialized, Options, SlidingWindow,
    Tensor4Ref,
};
use common::Rng;
use faer::{Mat, MatRef};

/// The step: `2⁻¹⁶`.
const H: f64 = 1.0 / 65536.0;
/// f64's unit roundoff.
const U: f64 = f64::EPSILON / 2.0;

fn gamma(n: f64) -> f64 {
    n * U / (1.0 - n * U)
}

/// `Σ_ic dO_ic·O_ic` in f64.
fn loss(out: MatRef<'_, f64>, grad_out: MatRef<'_, f64>) -> f64 {
    let mut l = 0.0;
    for i in 0..out.nrows() {
        for c in 0..out.ncols() {
            l += grad_out[(i, c)] * out[(i, c)];
        }
    }
    l
}

/// The tolerance terms of one head (see the module documentation).
struct HeadTerms {
    /// Bounds on `|∂³L/∂Q_it³|` and `|∂³L/∂K_jt³|` (V: 0).
    t3_q: Mat<f64>,
    t3_k: Mat<f64>,
    /// The error of this head's part of one evaluation of `L`.
    eps_l: f64,
    /// The reference gradients' own errors.
    eps_q: Mat<f64>,
    eps_k: Mat<f64>,
    eps_v: Mat<f64>,
}

#[allow(clippy::too_many_arguments)]
fn head_terms(
    q: MatRef<'_, f64>,
    k: MatRef<'_, f64>,
    v: MatRef<'_, f64>,
    grad_out: MatRef<'_, f64>,
    m: &Materialized,
    scale: f64,
    additive: Option<MatRef<'_, f32>>,
    loss_terms: f64,
) -> HeadTerms {
    let (n_q, n_k, d_k, d_v) = (q.nrows(), k.nrows(), q.ncols(), v.ncols());
    let mut t3_q = Mat::<f64>::zeros(n_q, d_k);
    let mut t3_k = Mat::<f64>::zeros(n_k, d_k);
    let (mut eps_q, mut eps_k, mut eps_v) = (
        Mat::<f64>::zeros(n_q, d_k),
        Mat::<f64>::zeros(n_k, d_k),
        Mat::<f64>::zeros(n_k, d_v),
    );
    let mut eps_l = 0.0;
    let range = |vals: &mut dyn Iterator<Item = f64>| {
        let (lo, hi) = vals.fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), x| {
            (lo.min(x), hi.max(x))
        });
        hi - lo
    };
    for i in 0..n_q {
        let vis: Vec<usize> = (0..n_k)
            .filter(|&j| m.scores[(i, j)] != f64::NEG_INFINITY)
            .collect();
        if vis.is_empty() {
            continue; // L does not depend on this row's inputs at all
        }
        let dabs: Vec<f64> = (0..d_v).map(|c| grad_out[(i, c)].abs()).collect();
        let r_v: Vec<f64> = (0..d_v)
            .map(|c| range(&mut vis.iter().map(|&j| v[(j, c)])))
            .collect();
        let m_v: Vec<f64> = (0..d_v)
            .map(|c| vis.iter().map(|&j| v[(j, c)].abs()).fold(0.0, f64::max))
            .collect();
        // |d³/dh³| ≤ Σ_c |dO_ic| · 4 R_v R_c³.
        let cubic = |r_c: f64| -> f64 {
            (0..d_v)
                .map(|c| dabs[c] * 4.0 * r_v[c] * r_c.powi(3))
                .sum::<f64>()
        };
        for t in 0..d_k {
            t3_q[(i, t)] = cubic(scale * range(&mut vis.iter().map(|&j| k[(j, t)])));
            for &j in &vis {
                t3_k[(j, t)] += cubic(scale * q[(i, t)].abs());
            }
        }
        // The forward's f64 error on this row.
        let delta = vis
            .iter()
            .map(|&j| {
                let p: f64 = (0..d_k).map(|t| (q[(i, t)] * k[(j, t)]).abs()).sum();
                let b = additive.map_or(0.0, |a| f64::from(a[(i, j)]).abs());
                gamma(d_k as f64 + 6.0) * scale * p + 4.0 * U * b
            })
            .fold(0.0, f64::max);
        let n = vis.len() as f64;
        let w = (delta + 2.0 * U).exp() * (1.0 + 2.0 * U * (n.ln() + 2.0 * delta)) - 1.0;
        let rel_o = 2.0 * w / (1.0 - w) + 3.0 * gamma(2.0 * n_k as f64 + 2.0);
        for c in 0..d_v {
            let o = m.output[(i, c)].abs();
            eps_l += dabs[c] * (m_v[c] * rel_o + U * o) + gamma(loss_terms) * dabs[c] * o;
        }
        // The reference's own gradient error: every relative error on a path.
        let ln_p = vis
            .iter()
            .map(|&j| m.weights[(i, j)].ln().abs())
            .fold(0.0, f64::max);
        let rho = 3.0 * (2.0 * w + delta)
            + U * ln_p
            + gamma((d_v + n_k + n_q + 10) as f64)
            + 3.0 * gamma(2.0 * n_k as f64 + 2.0);
        let d_abs: f64 = (0..d_v).map(|c| dabs[c] * m_v[c]).sum();
        for &j in &vis {
            let p = m.weights[(i, j)];
            let a: f64 = (0..d_v).map(|c| dabs[c] * v[(j, c)].abs()).sum();
            let s = p * (a + d_abs);
            for t in 0..d_k {
                eps_q[(i, t)] += rho * scale * s * k[(j, t)].abs();
                eps_k[(j, t)] += rho * scale * s * q[(i, t)].abs();
            }
            for c in 0..d_v {
                eps_v[(j, c)] += rho * p * dabs[c];
            }
        }
    }
    HeadTerms {
        t3_q,
        t3_k,
        eps_l,
        eps_q,
        eps_k,
        eps_v,
    }
}

/// The tolerance of one entry: truncation, rounding of `L`, the reference's own error.
fn tolerance(t3: f64, eps_l: f64, eps_g: f64) -> f64 {
    2.0 * (H * H / 6.0 * t3 + eps_l / H + eps_g)
}

fn check(what: &str, fd: f64, g: f64, tol: f64) {
    assert!(
        (fd - g).abs() <= tol,
        "{what}: finite difference {fd:e}, reference gradient {g:e}: |difference| = {:.3e} > \
         tolerance {tol:.3e}",
        (fd - g).abs()
    );
}

/// One head: every entry of Q, K and V against its central difference; prints the largest
/// `|difference| / tolerance` (shown with `--nocapture`).
fn check_head(name: &str, q: Mat<f64>, k: Mat<f64>, v: Mat<f64>, options: &Options<'_>, seed: u64) {
    let (n_q, d_v) = (q.nrows(), v.ncols());
    let grad_out = Rng(seed ^ 0xd0).mat(n_q, d_v);
    let m = Attention::head(q.as_ref(), k.as_ref(), v.as_ref(), options)
        .and_then(|call| call.materialized())
        .unwrap();
    let g = Attention::head(q.as_ref(), k.as_ref(), v.as_ref(), options)
        .and_then(|call| call.backward_materialized(grad_out.as_ref()))
        .unwrap();
    let scale = options.scale_for_f64(q.ncols()).unwrap();
    let terms = head_terms(
        q.as_ref(),
        k.as_ref(),
        v.as_ref(),
        grad_out.as_ref(),
        &m,
        scale,
        options.additive_mask,
        (n_q * d_v) as f64,
    );
    let eval = |q: &Mat<f64>, k: &Mat<f64>, v: &Mat<f64>| {
        let m = Attention::head(q.as_ref(), k.as_ref(), v.as_ref(), options)
            .and_then(|call| call.materialized())
            .unwrap();
        loss(m.output.as_ref(), grad_out.as_ref())
    };
    let mut worst = 0.0f64;
    let mut central = |what: String, f: &mut dyn FnMut(f64) -> f64, g: f64, tol: f64| {
        let fd = (f(H) - f(-H)) / (2.0 * H);
        worst = worst.max((fd - g).abs() / tol);
        check(&what, fd, g, tol);
    };
    for (op, rows, cols) in [
        ("Q", q.nrows(), q.ncols()),
        ("K", k.nrows(), k.ncols()),
        ("V", v.nrows(), v.ncols()),
    ] {
        for i in 0..rows {
            for c in 0..cols {
                let (grad, t3, eps_g) = match op {
                    "Q" => (g.dq[(i, c)], terms.t3_q[(i, c)], terms.eps_q[(i, c)]),
                    "K" => (g.dk[(i, c)], terms.t3_k[(i, c)], terms.eps_k[(i, c)]),
                    _ => (g.dv[(i, c)], 0.0, terms.eps_v[(i, c)]),
                };
                let tol = tolerance(t3, terms.eps_l, eps_g);
                let mut f = |step: f64| {
                    let (mut q, mut k, mut v) = (q.clone(), k.clone(), v.clone());
                    match op {
                        "Q" => q[(i, c)] += step,
                        "K" => k[(i, c)] += step,
                        _ => v[(i, c)] += step,
                    }
                    eval(&q, &k, &v)
                };
                central(format!("{name}: d{op}[{i}, {c}]"), &mut f, grad, tol);
            }
        }
    }
    eprintln!("{name}: largest |difference| / tolerance = {worst:.3e}");
}

fn operands(n_q: usize, n_k: usize, d_k: usize, d_v: usize, seed: u64) -> [Mat<f64>; 3] {
    let mut rng = Rng(seed);
    [rng.mat(n_q, d_k), rng.mat(n_k, d_k), rng.mat(n_k, d_v)]
}

fn check_case(name: &str, dims: [usize; 4], options: &Options<'_>, seed: u64) {
    let [q, k, v] = operands(dims[0], dims[1], dims[2], dims[3], seed);
    check_head(name, q, k, v, options, seed);
}

#[test]
fn no_mask() {
    check_case("no mask", [6, 6, 4, 4], &Options::default(), 1);
}

#[test]
fn causal_top_left_and_bottom_right() {
    let tl = Options::default().with_causal(Causal::TopLeft);
    let br = Options::default().with_causal(Causal::BottomRight);
    // n_q ≠ n_k so that the alignments differ; with more queries than keys the first rows
    // of bottom-right causal see nothing.
    check_case("causal top-left, n_q < n_k", [4, 7, 3, 2], &tl, 2);
    check_case("causal bottom-right, n_q < n_k", [4, 7, 3, 2], &br, 3);
    check_case("causal top-left, n_q > n_k", [7, 4, 3, 2], &tl, 4);
    check_case("causal bottom-right, n_q > n_k", [7, 4, 3, 2], &br, 5);
}

#[test]
fn sliding_window() {
    let w = Options::default().with_window(SlidingWindow::new(Some(1), Some(2), Causal::TopLeft));
    check_case("window (1, 2)", [6, 8, 3, 3], &w, 6);
    let w =
        Options::default().with_window(SlidingWindow::new(Some(2), Some(0), Causal::BottomRight));
    check_case("window (2, 0) bottom-right", [5, 8, 2, 3], &w, 7);
}

#[test]
fn key_padding_hides_keys_from_every_query() {
    let opts = Options::default().with_key_length(4);
    let [q, k, v] = operands(5, 7, 3, 2, 8);
    let grad_out = Rng(8 ^ 0xd0).mat(5, 2);
    let g = Attention::head(q.as_ref(), k.as_ref(), v.as_ref(), &opts)
        .and_then(|call| call.backward_materialized(grad_out.as_ref()))
        .unwrap();
    for j in 4..7 {
        assert!((0..3).all(|c| g.dk[(j, c)] == 0.0) && (0..2).all(|c| g.dv[(j, c)] == 0.0));
    }
    check_head("key padding 4 of 7", q, k, v, &opts, 8);
}

#[test]
fn boolean_mask() {
    let mut rng = Rng(9);
    let allow = Mat::from_fn(6, 7, |i, _| i != 2 && !rng.next().is_multiple_of(3));
    let opts = Options::default().with_bool_mask(BoolMask::allow(allow.as_ref()));
    check_case("boolean mask, row 2 hidden", [6, 7, 3, 4], &opts, 9);
}

#[test]
fn additive_mask() {
    let mut rng = Rng(10);
    let bias = Mat::from_fn(5, 6, |_, _| {
        if rng.next().is_multiple_of(5) {
            f32::NEG_INFINITY
        } else {
            (rng.entry(1.0) * 3.0) as f32
        }
    });
    let opts = Options::default().with_additive_mask(bias.as_ref());
    check_case("additive mask with -inf", [5, 6, 4, 3], &opts, 10);
    let opts = Options::default()
        .with_additive_mask(bias.as_ref())
        .with_scale(0.75);
    check_case("additive mask, explicit scale", [5, 6, 4, 3], &opts, 11);
}

#[test]
fn cross_attention_and_value_width() {
    check_case(
        "n_q = 3, n_k = 9, d_k = 2, d_v = 5",
        [3, 9, 2, 5],
        &Options::default(),
        12,
    );
    check_case(
        "n_q = 8, n_k = 2, d_k = 5, d_v = 1",
        [8, 2, 5, 1],
        &Options::default(),
        13,
    );
}

#[test]
fn fully_masked_row_has_zero_query_gradient() {
    let allow = Mat::from_fn(4, 5, |i, j| i != 1 && (i + j) % 4 != 0);
    let opts = Options::default().with_bool_mask(BoolMask::allow(allow.as_ref()));
    let [q, k, v] = operands(4, 5, 3, 2, 14);
    let grad_out = Rng(14 ^ 0xd0).mat(4, 2);
    let g = Attention::head(q.as_ref(), k.as_ref(), v.as_ref(), &opts)
        .and_then(|call| call.backward_materialized(grad_out.as_ref()))
        .unwrap();
    assert!(
        (0..3).all(|c| g.dq[(1, c)] == 0.0),
        "row 1 sees no key: dQ = 0 exactly"
    );
    assert!(g.dq.col_iter().all(|c| c.iter().all(|x| x.is_finite())));
    check_head("row 1 fully masked", q, k, v, &opts, 14);
}

fn view(data: &[f64], dims: [usize; 4]) -> Tensor4Ref<'_, f64> {
    Tensor4Ref::from_layout(data, dims, Layout::Bhsd).unwrap()
}

/// Batched GQA: every entry of Q, K, V of a `[batch, heads, seq, dim]` problem against the
/// central difference of the loss summed over all heads (a shared kv head's gradient is
/// the sum over its group); prints the largest `|difference| / tolerance`.
fn check_batched(
    name: &str,
    batch: usize,
    h_q: usize,
    h_kv: usize,
    dims: [usize; 4],
    lens: &[usize],
    seed: u64,
) {
    let [n_q, n_k, d_k, d_v] = dims;
    let mut rng = Rng(seed);
    let mut vec = |n: usize| (0..n).map(|_| rng.entry(1.0)).collect::<Vec<f64>>();
    let (q, k, v, dout) = (
        vec(batch * h_q * n_q * d_k),
        vec(batch * h_kv * n_k * d_k),
        vec(batch * h_kv * n_k * d_v),
        vec(batch * h_q * n_q * d_v),
    );
    let opts = Options::default().with_key_lengths(lens);
    let (qd, kd, vd, od) = (
        [batch, h_q, n_q, d_k],
        [batch, h_kv, n_k, d_k],
        [batch, h_kv, n_k, d_v],
        [batch, h_q, n_q, d_v],
    );
    let forward = |q: &[f64], k: &[f64], v: &[f64]| {
        Attention::batched(view(q, qd), view(k, kd), view(v, vd), &opts)
            .and_then(|call| call.materialized())
            .unwrap()
    };
    let total_loss = |heads: &[Vec<Materialized>]| {
        let mut l = 0.0;
        for (b, per_head) in heads.iter().enumerate() {
            for (h, m) in per_head.iter().enumerate() {
                l += loss(m.output.as_ref(), view(&dout, od).head(b, h).unwrap());
            }
        }
        l
    };
    // The gradients (f64 in, f64 out: "rounded once" to f64 is exact).
    let (out, lse) = {
        let heads = forward(&q, &k, &v);
        let out: Vec<f64> = heads
            .iter()
            .flatten()
            .flat_map(|m| (0..n_q).flat_map(move |i| (0..d_v).map(move |c| m.output[(i, c)])))
            .collect();
        let lse: Vec<f32> = heads
            .iter()
            .flatten()
            .flat_map(|m| m.lse.iter().map(|&l| l as f32))
            .collect();
        (out, lse)
    };
    let g = Attention::batched(view(&q, qd), view(&k, kd), view(&v, vd), &opts)
        .and_then(|call| call.backward(ForwardRef::batch(view(&out, od), &lse)?, view(&dout, od)))
        .unwrap();
    // Tolerance terms per head; a kv head's are its group's sums.
    let heads = forward(&q, &k, &v);
    let scale = opts.scale_for_f64(d_k).unwrap();
    let group = h_q / h_kv;
    let mut eps_l = 0.0;
    let mut terms = vec![];
    for (b, per_head) in heads.iter().enumerate() {
        for (h, m) in per_head.iter().enumerate() {
            let t = head_terms(
                view(&q, qd).head(b, h).unwrap(),
                view(&k, kd).head(b, h / group).unwrap(),
                view(&v, vd).head(b, h / group).unwrap(),
                view(&dout, od).head(b, h).unwrap(),
                m,
                scale,
                None,
                (batch * h_q * n_q * d_v) as f64,
            );
            eps_l += t.eps_l;
            terms.push(t);
        }
    }
    let head_terms_of = |b: usize, h: usize| &terms[b * h_q + h];
    let mut worst = 0.0f64;
    let at = |dims: [usize; 4], b: usize, h: usize, i: usize, c: usize| {
        ((b * dims[1] + h) * dims[2] + i) * dims[3] + c
    };
    for b in 0..batch {
        for h in 0..h_q {
            for i in 0..n_q {
                for c in 0..d_k {
                    let t = head_terms_of(b, h);
                    let tol = tolerance(t.t3_q[(i, c)], eps_l, t.eps_q[(i, c)]);
                    let e = at(qd, b, h, i, c);
                    let f = |s: f64| {
                        let mut q = q.clone();
                        q[e] += s;
                        total_loss(&forward(&q, &k, &v))
                    };
                    let fd = (f(H) - f(-H)) / (2.0 * H);
                    let grad = g.dq.as_slice()[e];
                    worst = worst.max((fd - grad).abs() / tol);
                    check(&format!("{name}: dQ[{b}, {h}, {i}, {c}]"), fd, grad, tol);
                }
            }
        }
        for kv in 0..h_kv {
            let members = kv * group..(kv + 1) * group;
            for j in 0..n_k {
                for (op, width) in [("K", d_k), ("V", d_v)] {
                    for c in 0..width {
                        let (t3, eps_g) = members.clone().fold((0.0, 0.0), |(t3, eg), h| {
                            let t = head_terms_of(b, h);
                            match op {
                                "K" => (t3 + t.t3_k[(j, c)], eg + t.eps_k[(j, c)]),
                                _ => (t3, eg + t.eps_v[(j, c)]),
                            }
                        });
                        let tol = tolerance(t3, eps_l, eps_g);
                        let dims = if op == "K" { kd } else { vd };
                        let e = at(dims, b, kv, j, c);
                        let f = |s: f64| {
                            let (mut k, mut v) = (k.clone(), v.clone());
                            if op == "K" {
                                k[e] += s
                            } else {
                                v[e] += s
                            }
                            total_loss(&forward(&q, &k, &v))
                        };
                        let fd = (f(H) - f(-H)) / (2.0 * H);
                        let grad = if op == "K" {
                            g.dk.as_slice()[e]
                        } else {
                            g.dv.as_slice()[e]
                        };
                        worst = worst.max((fd - grad).abs() / tol);
                        check(
                            &format!("{name}: d{op}[{b}, {kv}, {j}, {c}]"),
                            fd,
                            grad,
                            tol,
                        );
                    }
                }
            }
        }
    }
    eprintln!("{name}: largest |difference| / tolerance = {worst:.3e}");
}

#[test]
fn batched_gqa_sums_over_the_group() {
    // Two kv heads shared by two query heads each, per-batch key lengths (one entry
    // padded to 3 of 5 keys).
    check_batched(
        "GQA 4 query heads on 2 kv heads",
        2,
        4,
        2,
        [3, 5, 3, 2],
        &[5, 3],
        15,
    );
    // Multi-query: one kv head for three query heads.
    check_batched(
        "MQA 3 query heads on 1 kv head",
        1,
        3,
        1,
        [4, 4, 2, 3],
        &[4],
        16,
    );
}

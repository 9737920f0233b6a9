//! With attention dropout at a fixed seed (the keep mask a fixed function of the
//! positions) and a learnable additive bias, the reference's gradients of Q, K, V and of
//! the bias are central finite differences of its f64 forward: `L = Σ dO ∘ O` moved by
//! `±h` along each entry, `h = 2⁻¹⁶` (entries are multiples of `2⁻²⁰`: `x ± h` is exact).
//! With entries of magnitude 1 the truncation (`h²/6·|L'''|`) and the rounding of the two
//! evaluations (`≈ 1e-16·|L| / h`) are below `1e-8`; the tolerance `1e-7 + 1e-6·|g|` is
//! orders of magnitude below a missing factor `1/(1 − p)`, a mask drawn for the wrong head
//! or a dropped term.

mod common;

use attn_reference::{Attention, Dropout, Mask4Ref, Options, Tensor4};
use common::Rng;

const H: f32 = 1.0 / 65536.0;

#[test]
fn dropout_and_bias_gradients_are_finite_differences_at_a_fixed_seed() {
    let (b, h, n_q, n_k, d) = (1, 2, 5, 7, 4);
    let mut rng = Rng(11);
    let mut draw = |n| (0..n).map(|_| rng.entry(1.0) as f32).collect::<Vec<f32>>();
    let (q, k, v, g) = (
        draw(b * h * n_q * d),
        draw(b * h * n_k * d),
        draw(b * h * n_k * d),
        draw(b * h * n_q * d),
    );
    let bias = draw(h * n_q * n_k);
    let t = |x: &[f32], n| Tensor4::from_vec(x.to_vec(), [b, h, n, d]).expect("sized");
    let loss = |q: &[f32], k: &[f32], v: &[f32], bias: &[f32]| -> f64 {
        let m = Mask4Ref::contiguous(bias, [1, h, n_q, n_k]).expect("sized");
        let opts = Options::default()
            .with_additive_mask_4d(m)
            .with_dropout(Dropout::new(0.3, 42).expect("a probability"));
        let (q, k, v) = (t(q, n_q), t(k, n_k), t(v, n_k));
        let heads = Attention::batched(q.as_ref(), k.as_ref(), v.as_ref(), &opts)
            .and_then(|c| c.materialized())
            .expect("valid");
        let mut l = 0.0;
        for (hh, m) in heads[0].iter().enumerate() {
            for i in 0..n_q {
                for c in 0..d {
                    l += f64::from(g[(hh * n_q + i) * d + c]) * m.output[(i, c)];
                }
            }
        }
        l
    };
    let m = Mask4Ref::contiguous(&bias, [1, h, n_q, n_k]).expect("sized");
    let opts = Options::default()
        .with_additive_mask_4d(m)
        .with_dropout(Dropout::new(0.3, 42).expect("a probability"));
    let (qt, kt, vt, gt) = (t(&q, n_q), t(&k, n_k), t(&v, n_k), t(&g, n_q));
    let call = Attention::batched(qt.as_ref(), kt.as_ref(), vt.as_ref(), &opts).expect("valid");
    let heads = call.backward_materialized(gt.as_ref()).expect("runs");
    let dbias = call.bias_gradient(gt.as_ref()).expect("runs");
    // The dropout is not a no-op here: some weight of each head is dropped.
    assert!(
        heads[0]
            .iter()
            .all(|m| (0..n_q).any(|i| (0..n_k).any(|j| m.forward.dropout[(i, j)] == 0.0)))
    );

    let check = |what: &str, x: &[f32], at: usize, want: f64, f: &dyn Fn(&[f32]) -> f64| {
        let (mut up, mut down) = (x.to_vec(), x.to_vec());
        up[at] += H;
        down[at] -= H;
        let fd = (f(&up) - f(&down)) / (2.0 * f64::from(H));
        let tol = 1e-7 + 1e-6 * want.abs();
        assert!(
            (fd - want).abs() <= tol,
            "{what}[{at}]: finite difference {fd:e}, gradient {want:e}"
        );
    };
    for (hh, m) in heads[0].iter().enumerate() {
        for i in 0..n_q {
            for c in 0..d {
                let at = (hh * n_q + i) * d + c;
                check("dQ", &q, at, m.dq[(i, c)], &|x| loss(x, &k, &v, &bias));
            }
            for j in 0..n_k {
                let at = (hh * n_q + i) * n_k + j;
                let want = dbias.as_ref().head(0, hh).expect("in range")[(i, j)];
                check("dbias", &bias, at, want, &|x| loss(&q, &k, &v, x));
            }
        }
        for j in 0..n_k {
            for c in 0..d {
                let at = (hh * n_k + j) * d + c;
                check("dK", &k, at, m.dk[(j, c)], &|x| loss(&q, x, &v, &bias));
                check("dV", &v, at, m.dv[(j, c)], &|x| loss(&q, &k, x, &bias));
            }
        }
    }
}

//! f16 and bf16 storage, against the f64 reference on the same half-rounded inputs: with
//! f32 compute (`Precision::F32`), and at native precision (bf16 products with P rounded
//! to bf16 on AVX512_BF16, f32 elsewhere).

use attn_optimized::{
    BoolMask, Causal, Element, Layout, Options, Precision, SlidingWindow, Tensor4Ref, attention,
};
use faer::Mat;
use half::{bf16, f16};

mod common;
use common::{f32_bound, mat};

/// The f32 engine bound (see tests/equivalence.rs) plus the rounding of each output to
/// the storage type: `|fl(o) − o| ≤ u_T·|o|`; at native precision, plus the rounding of
/// the weights to bf16 (`u = 2⁻⁸` of the largest `|v|` of the column, twice).
fn check<T: Element + attn_reference::Element>(
    q: &Mat<T>,
    k: &Mat<T>,
    v: &Mat<T>,
    opts: &Options<'_>,
    unit: f64,
    what: &str,
) {
    let native = attention(q.as_ref(), k.as_ref(), v.as_ref(), opts).unwrap();
    let opts = &opts.with_precision(Precision::F32);
    let o = attention(q.as_ref(), k.as_ref(), v.as_ref(), opts).unwrap();
    let mut o32 = Mat::<f32>::zeros(q.nrows(), v.ncols());
    attn_optimized::Attention::head(q.as_ref(), k.as_ref(), v.as_ref(), opts)
        .and_then(|call| call.forward_into(o32.as_mut(), None, attn_optimized::Par::rayon(0)))
        .unwrap();
    let r = attn_reference::Attention::head(q.as_ref(), k.as_ref(), v.as_ref(), opts)
        .and_then(|call| call.materialized())
        .unwrap();
    let scale = opts.scale_for(q.ncols()).unwrap();
    let f32_tol = f64::from(f32_bound(q.as_ref(), k.as_ref(), v.as_ref(), scale));
    for i in 0..q.nrows() {
        for c in 0..v.ncols() {
            let want = r.output[(i, c)];
            let e32 = (f64::from(o32[(i, c)]) - want).abs();
            assert!(
                e32 <= f32_tol,
                "{what} f32 out ({i},{c}): {} vs {want} (err {e32:e} > {f32_tol:e})",
                o32[(i, c)]
            );
            let e = (f64::from(o[(i, c)].to_f32()) - want).abs();
            let tol = f32_tol + unit * want.abs();
            assert!(
                e <= tol,
                "{what} ({i},{c}): {} vs {want} (err {e:e} > {tol:e})",
                o[(i, c)].to_f32()
            );
            let vmax = (0..v.nrows())
                .map(|j| f64::from(v[(j, c)].to_f32()).abs())
                .fold(0.0, f64::max);
            let e = (f64::from(native[(i, c)].to_f32()) - want).abs();
            let tol = tol + 2.0 * 2f64.powi(-8) * vmax;
            assert!(
                e <= tol,
                "{what} native ({i},{c}): {} vs {want} (err {e:e} > {tol:e})",
                native[(i, c)].to_f32()
            );
        }
    }
}

fn every_mask_kind<T: Element + attn_reference::Element>(unit: f64, name: &str) {
    for (t, &(n_q, n_k, d_k, d_v)) in [
        (1, 1, 1, 1),
        (129, 513, 64, 64),
        (300, 1100, 8, 16),
        (3, 3000, 128, 128),
    ]
    .iter()
    .enumerate()
    {
        let (q, k, v) = (
            mat::<T>(n_q, d_k, t as u64, 2.0),
            mat::<T>(n_k, d_k, 10 + t as u64, 2.0),
            mat::<T>(n_k, d_v, 20 + t as u64, 1.0),
        );
        let allow = Mat::from_fn(n_q, n_k, |i, j| (i * 31 + j * 17) % 7 != 0);
        let add = Mat::from_fn(n_q, n_k, |i, j| {
            if (i + j) % 13 == 0 {
                f32::NEG_INFINITY
            } else {
                ((i + 2 * j) % 5) as f32 * 0.2
            }
        });
        let cases = [
            Options::default(),
            Options::default().with_causal(Causal::TopLeft),
            Options::default().with_causal(Causal::BottomRight),
            Options::default().with_window(SlidingWindow::new(
                Some(40),
                Some(3),
                Causal::BottomRight,
            )),
            Options::default().with_key_length(n_k - n_k / 4),
            Options::default().with_bool_mask(BoolMask::block(allow.as_ref())),
            Options::default()
                .with_additive_mask(add.as_ref())
                .with_causal(Causal::BottomRight),
        ];
        for (c, opts) in cases.iter().enumerate() {
            check(
                &q,
                &k,
                &v,
                opts,
                unit,
                &format!("{name} case {c} shape {t}"),
            );
        }
    }
}

#[test]
fn f16_matches_reference_on_rounded_inputs_for_every_mask() {
    every_mask_kind::<f16>(2f64.powi(-11), "f16");
}

#[test]
fn bf16_matches_reference_on_rounded_inputs_for_every_mask() {
    every_mask_kind::<bf16>(2f64.powi(-8), "bf16");
}

#[test]
fn f16_near_its_range_does_not_overflow_inside() {
    // |x| up to 6e4: the scores (≈ 1e11) only exist in f32, where they are finite. 40
    // queries take the GEMM tiles, 3 and 1 the row kernels (decoding).
    for n_q in [40, 3, 1] {
        let (q, k, v) = (
            mat::<f16>(n_q, 64, 1, 6.0e4),
            mat::<f16>(200, 64, 2, 6.0e4),
            mat::<f16>(200, 32, 3, 6.0e4),
        );
        let (o, lse) = attn_optimized::Attention::head(
            q.as_ref(),
            k.as_ref(),
            v.as_ref(),
            &Options::default(),
        )
        .and_then(|call| call.forward(attn_optimized::Par::rayon(0)))
        .map(|f| f.into_parts())
        .unwrap();
        assert!(lse.iter().all(|l| l.is_finite()));
        assert!((0..n_q).all(|i| (0..32).all(|c| o[(i, c)].is_finite())));
        let what = format!("f16 near range, {n_q} queries");
        check(&q, &k, &v, &Options::default(), 2f64.powi(-11), &what);
    }
}

fn nan_and_inf_touch_only_their_rows<T: Element>(nan: T, inf: T) {
    let (mut q, k, v) = (
        mat::<T>(200, 16, 1, 1.0),
        mat::<T>(300, 16, 2, 1.0),
        mat::<T>(300, 8, 3, 1.0),
    );
    q[(7, 3)] = nan;
    q[(150, 0)] = inf;
    let o = attention(q.as_ref(), k.as_ref(), v.as_ref(), &Options::default()).unwrap();
    for i in 0..200 {
        let finite = (0..8).all(|c| o[(i, c)].is_finite());
        // Row 7 is NaN; row 150's products with the keys are ±inf, which saturate
        // (docs/conventions.md), or NaN where a key's entry is 0: either is its own.
        if i != 150 {
            assert_eq!(finite, i != 7, "row {i}");
        }
    }
}

#[test]
fn half_nan_and_inf_touch_only_their_rows() {
    nan_and_inf_touch_only_their_rows(f16::NAN, f16::INFINITY);
    nan_and_inf_touch_only_their_rows(bf16::NAN, bf16::INFINITY);
}

/// On AVX512_BF16 the native path rounds the weights (its bits differ from f32 compute's);
/// elsewhere native is f32 compute, bit for bit. Both are within the bounds `check` states.
#[test]
fn native_bf16_is_the_pair_products_where_the_cpu_has_them() {
    let (q, k, v) = (
        mat::<bf16>(300, 64, 1, 2.0),
        mat::<bf16>(700, 64, 2, 2.0),
        mat::<bf16>(700, 64, 3, 1.0),
    );
    let opts = Options::default();
    let native = attention(q.as_ref(), k.as_ref(), v.as_ref(), &opts).unwrap();
    let exact = opts.with_precision(Precision::F32);
    let f32_compute = attention(q.as_ref(), k.as_ref(), v.as_ref(), &exact).unwrap();
    let differ = (0..300)
        .any(|i| (0..64).any(|c| native[(i, c)].to_bits() != f32_compute[(i, c)].to_bits()));
    let isa = attn_optimized::Isa::current();
    assert_eq!(
        differ,
        isa.includes(attn_optimized::Isa::Avx512Bf16),
        "{isa:?}"
    );
    check(&q, &k, &v, &opts, 2f64.powi(-8), "native");
}

/// On AMX the native f16 path splits each operand in two bf16 parts (its f32 outputs
/// differ from f32 compute's, by no more than the parts' 2⁻¹⁶ allow); elsewhere it is f32
/// compute, bit for bit.
#[test]
fn native_f16_is_split_tile_products_on_amx() {
    let (q, k, v) = (
        mat::<f16>(300, 64, 1, 2.0),
        mat::<f16>(700, 64, 2, 2.0),
        mat::<f16>(700, 64, 3, 1.0),
    );
    let f32_out = |precision| {
        let opts = Options::default().with_precision(precision);
        let mut o = Mat::<f32>::zeros(300, 64);
        attn_optimized::Attention::head(q.as_ref(), k.as_ref(), v.as_ref(), &opts)
            .and_then(|call| call.forward_into(o.as_mut(), None, attn_optimized::Par::Seq))
            .unwrap();
        o
    };
    let (native, f32_compute) = (f32_out(Precision::Native), f32_out(Precision::F32));
    let differ = (0..300)
        .any(|i| (0..64).any(|c| native[(i, c)].to_bits() != f32_compute[(i, c)].to_bits()));
    let isa = attn_optimized::Isa::current();
    assert_eq!(differ, isa == attn_optimized::Isa::Amx, "{isa:?}");
    let opts = Options::default();
    let r = attn_reference::Attention::head(q.as_ref(), k.as_ref(), v.as_ref(), &opts)
        .and_then(|call| call.materialized())
        .unwrap();
    let scale = opts.scale_for(64).unwrap();
    let f32_tol = f64::from(f32_bound(q.as_ref(), k.as_ref(), v.as_ref(), scale));
    for c in 0..64 {
        let vmax = (0..700)
            .map(|j| f64::from(v[(j, c)].to_f32()).abs())
            .fold(0.0, f64::max);
        // Scores off by 2⁻¹⁶ of scale·Σ|q||k| (≤ 2⁻¹⁶·64·4·scale here: normalised weights
        // off by e^twice that − 1), the weights and the products with V by 2⁻¹⁶ each.
        let scores = 2f64.powi(-16) * 256.0 * f64::from(scale);
        let tol = f32_tol + (3.0 * 2f64.powi(-16) + (2.0 * scores).exp_m1()) * vmax;
        for i in 0..300 {
            let e = (f64::from(native[(i, c)]) - r.output[(i, c)]).abs();
            assert!(e <= tol, "({i},{c}): err {e:e} > {tol:e}");
        }
    }
    check(&q, &k, &v, &opts, 2f64.powi(-11), "native");
}

#[test]
fn half_batched_gqa_both_layouts() {
    let (b, hq, hkv, n_q, n_k, d) = (2, 4, 2, 70, 150, 32);
    let data = |len: usize, seed: u64| -> Vec<bf16> {
        mat::<bf16>(1, len, seed, 1.0)
            .row(0)
            .iter()
            .copied()
            .collect()
    };
    let (qd, kd, vd) = (
        data(b * hq * n_q * d, 1),
        data(b * hkv * n_k * d, 2),
        data(b * hkv * n_k * d, 3),
    );
    let opts = Options::default()
        .with_causal(Causal::BottomRight)
        .with_precision(Precision::F32);
    for layout in [Layout::Bhsd, Layout::Bshd] {
        let q = Tensor4Ref::from_layout(&qd, [b, hq, n_q, d], layout).unwrap();
        let k = Tensor4Ref::from_layout(&kd, [b, hkv, n_k, d], layout).unwrap();
        let v = Tensor4Ref::from_layout(&vd, [b, hkv, n_k, d], layout).unwrap();
        let got = attn_optimized::Attention::batched(q, k, v, &opts)
            .and_then(|call| call.forward(attn_optimized::Par::rayon(0)))
            .map(|f| f.into_output())
            .unwrap();
        let want = attn_reference::Attention::batched(q, k, v, &opts)
            .and_then(|call| call.forward())
            .map(|f| f.into_output())
            .unwrap();
        for (g, w) in got.as_slice().iter().zip(want.as_slice()) {
            // Both sides are rounded to bf16: they may differ by one bf16 ulp (2^-7 relative).
            assert!(
                (g.to_f32() - w.to_f32()).abs() <= 2e-5 + w.to_f32().abs() * 2f32.powi(-7),
                "{layout:?}"
            );
        }
    }
}

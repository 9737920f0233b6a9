//! The op's forward pass against candle's own naive formula (candle ops in f64) on random
//! tensors: every mask kind, GQA, f32/f16/bf16, strided and transposed inputs, zero-length
//! sequences, and the errors for what the op does not take.

mod common;

use attn_candle::candle_core::{DType, Tensor};
use attn_candle::{AttentionOptions, Causal, Layout, SlidingWindow, scaled_dot_product_attention};
use common::{CPU, Structure, assert_within, bound, flat, naive, tensor, values};

/// One problem: shapes, options and the structure the naive formula applies.
struct Case {
    dims: [usize; 7], // b, h_q, h_kv, n_q, n_k, d_k, d_v
    opts: AttentionOptions,
    structure: Structure,
    bias: Option<Tensor>,
    scale: Option<f64>,
    /// The layout the options ask the output in.
    layout: Layout,
}

impl Case {
    fn new(dims: [usize; 7]) -> Self {
        Self {
            dims,
            opts: AttentionOptions::default(),
            structure: Structure::default(),
            bias: None,
            scale: None,
            layout: Layout::Bhsd,
        }
    }

    fn inputs(&self, seed: u64) -> (Tensor, Tensor, Tensor) {
        let [b, h_q, h_kv, n_q, n_k, d_k, d_v] = self.dims;
        (
            tensor(&[b, h_q, n_q, d_k], seed, 2.0),
            tensor(&[b, h_kv, n_k, d_k], seed + 1, 2.0),
            tensor(&[b, h_kv, n_k, d_v], seed + 2, 1.0),
        )
    }

    fn scale(&self) -> f64 {
        self.scale.unwrap_or(1.0 / (self.dims[5] as f64).sqrt())
    }

    /// Runs the op on `q, k, v` (any layout, any of the three dtypes) and checks it against
    /// the naive formula on the same values, within the derived bound for `u_out`.
    fn check_on(&self, name: &str, q: &Tensor, k: &Tensor, v: &Tensor, u_out: f64) -> f64 {
        let got = scaled_dot_product_attention(q, k, v, &self.opts).unwrap();
        assert_eq!(got.dtype(), q.dtype(), "{name}: dtype");
        let got = match self.layout {
            Layout::Bhsd => got,
            Layout::Bshd => got.transpose(1, 2).unwrap(),
        };
        let [b, h_q, _, n_q, _, _, d_v] = self.dims;
        assert_eq!(got.dims(), &[b, h_q, n_q, d_v], "{name}: dims");
        let want = naive(q, k, v, self.scale(), &self.structure, self.bias.as_ref()).unwrap();
        let want = flat(&want);
        let bound = bound(
            q,
            k,
            v,
            &want,
            self.scale(),
            &self.structure,
            self.bias.as_ref(),
            u_out,
        );
        assert_within(name, &flat(&got), &want, &bound)
    }

    fn check(&self, name: &str) -> f64 {
        let (q, k, v) = self.inputs(7);
        self.check_on(name, &q, &k, &v, 2f64.powi(-24))
    }
}

fn bits(n_q: usize, n_k: usize, seed: u64) -> Vec<Vec<bool>> {
    let v = values(n_q * n_k, seed, 1.0);
    (0..n_q)
        .map(|i| {
            (0..n_k)
                .map(|j| v[i * n_k + j] > -0.6 || j == i % n_k)
                .collect()
        })
        .collect()
}

fn u8_tensor(m: &[Vec<bool>], invert: bool) -> Tensor {
    let (r, c) = (m.len(), m[0].len());
    let data: Vec<u8> = m
        .iter()
        .flatten()
        .map(|&b| u8::from(b != invert) * 3)
        .collect();
    Tensor::from_vec(data, (r, c), &CPU).unwrap()
}

#[test]
fn no_mask_matches_the_naive_formula() {
    let mut worst = 0f64;
    for dims in [
        [1, 1, 1, 1, 1, 8, 8],
        [2, 3, 3, 7, 5, 16, 16],
        [1, 2, 2, 130, 200, 32, 24],
        [2, 2, 2, 300, 513, 64, 64],
    ] {
        worst = worst.max(Case::new(dims).check(&format!("{dims:?}")));
    }
    let mut c = Case::new([1, 2, 2, 33, 40, 16, 16]);
    c.opts = c.opts.with_scale(0.7);
    c.scale = Some(f64::from(0.7f32));
    worst = worst.max(c.check("scale"));
    println!("largest error / bound: {worst:.3}");
}

#[test]
fn grouped_and_multi_query_heads() {
    for dims in [[2, 8, 2, 40, 50, 16, 16], [1, 6, 1, 17, 130, 32, 8]] {
        Case::new(dims).check(&format!("gqa {dims:?}"));
    }
}

#[test]
fn causal_both_alignments_and_windows() {
    for (n_q, n_k) in [(50, 50), (30, 70), (70, 30)] {
        for align in [Causal::TopLeft, Causal::BottomRight] {
            let mut c = Case::new([2, 2, 1, n_q, n_k, 16, 16]);
            c.opts = c.opts.with_causal(align);
            c.structure.causal = Some(align);
            if n_q > n_k && align == Causal::BottomRight {
                // The first n_q − n_k queries see no key: checked below, with the zeros.
                continue;
            }
            c.check(&format!("causal {align:?} {n_q}×{n_k}"));
        }
        let w = SlidingWindow::new(Some(5), Some(2), Causal::BottomRight);
        let mut c = Case::new([1, 2, 2, n_q, n_k, 16, 16]);
        c.opts = c.opts.with_window(w);
        c.structure.window = Some(w);
        if n_q <= n_k + 2 {
            c.check(&format!("window {n_q}×{n_k}"));
        }
    }
}

#[test]
fn key_lengths_uniform_and_per_batch() {
    let mut c = Case::new([2, 2, 2, 20, 30, 16, 16]);
    c.opts = c.opts.with_key_length(17);
    c.structure.lens = Some(vec![17, 17]);
    c.check("uniform key length");
    let mut c = Case::new([3, 2, 1, 20, 30, 16, 16]);
    c.opts = c.opts.with_key_lengths(vec![30, 1, 12]);
    c.structure.lens = Some(vec![30, 1, 12]);
    c.check("per-batch key lengths");
}

#[test]
fn boolean_masks_allow_and_block_as_u8() {
    let (n_q, n_k) = (40, 60);
    let m = bits(n_q, n_k, 11);
    let mut c = Case::new([2, 2, 2, n_q, n_k, 16, 16]);
    c.structure.allow = Some(m.clone());
    c.opts = AttentionOptions::default().with_allow_mask(u8_tensor(&m, false));
    c.check("allow");
    c.opts = AttentionOptions::default().with_block_mask(u8_tensor(&m, true));
    c.check("block");
    // [1, 1, n_q, n_k], combined with causal.
    c.opts = AttentionOptions::default()
        .with_allow_mask(u8_tensor(&m, false).reshape((1, 1, n_q, n_k)).unwrap())
        .with_causal(Causal::BottomRight);
    c.structure.causal = Some(Causal::BottomRight);
    c.check("allow [1,1,L,S] + causal");
}

#[test]
fn additive_masks_in_every_float_dtype_and_broadcast() {
    let (n_q, n_k) = (30, 45);
    let mut c = Case::new([2, 4, 2, n_q, n_k, 16, 16]);
    let bias = Tensor::from_vec(values(n_q * n_k, 21, 3.0), (n_q, n_k), &CPU).unwrap();
    for dtype in [DType::F32, DType::F16, DType::BF16] {
        let b = bias.to_dtype(dtype).unwrap();
        c.opts = AttentionOptions::default().with_additive_mask(b.clone());
        c.bias = Some(b);
        c.check(&format!("additive {dtype:?}"));
    }
    // A key-padding bias [1, n_k] expanded over the queries (row stride 0, read in place),
    // with -inf entries, as [1, 1, n_q, n_k].
    let row: Vec<f32> = (0..n_k)
        .map(|j| {
            if j % 7 == 3 {
                f32::NEG_INFINITY
            } else {
                j as f32 * 0.05
            }
        })
        .collect();
    let b = Tensor::from_vec(row, (1, n_k), &CPU)
        .unwrap()
        .broadcast_as((1, 1, n_q, n_k))
        .unwrap();
    c.opts = AttentionOptions::default()
        .with_additive_mask(b.clone())
        .with_causal(Causal::BottomRight);
    c.structure.causal = Some(Causal::BottomRight);
    // The naive side: the -inf entries hide their keys, the others are the bias.
    c.structure.allow = Some(vec![(0..n_k).map(|j| j % 7 != 3).collect(); n_q]);
    let finite: Vec<f32> = (0..n_k)
        .map(|j| if j % 7 == 3 { 0.0 } else { j as f32 * 0.05 })
        .collect();
    c.bias = Some(
        Tensor::from_vec(finite, (1, n_k), &CPU)
            .unwrap()
            .broadcast_as((n_q, n_k))
            .unwrap(),
    );
    c.check("broadcast additive with -inf + causal");
}

#[test]
fn half_precision_on_half_rounded_inputs() {
    for (dtype, u_out) in [(DType::F16, 2f64.powi(-11)), (DType::BF16, 2f64.powi(-8))] {
        for causal in [None, Some(Causal::TopLeft)] {
            let mut c = Case::new([2, 4, 2, 70, 90, 32, 32]);
            if let Some(a) = causal {
                c.opts = c.opts.with_causal(a);
                c.structure.causal = Some(a);
            }
            let (q, k, v) = c.inputs(3);
            let (q, k, v) = (
                q.to_dtype(dtype).unwrap(),
                k.to_dtype(dtype).unwrap(),
                v.to_dtype(dtype).unwrap(),
            );
            let worst = c.check_on(&format!("{dtype:?} {causal:?}"), &q, &k, &v, u_out);
            println!("{dtype:?} {causal:?}: largest error / bound {worst:.3}");
        }
    }
}

#[test]
fn transposed_sliced_broadcast_and_strided_inputs() {
    let (b, h, n, d) = (2, 4, 37, 16);
    let c = Case::new([b, h, h, n, n, d, d]);
    // [B, S, H, D] viewed as [B, H, S, D] (no copy).
    let x = tensor(&[b, n, h, d], 5, 2.0);
    let xt = x.transpose(1, 2).unwrap();
    assert!(!xt.is_contiguous());
    c.check_on("bshd", &xt, &xt, &xt, 2f64.powi(-24));
    // Slices of a packed QKV projection [B, S, 3H, D]: start offsets and head strides.
    let qkv = tensor(&[b, n, 3 * h, d], 6, 2.0);
    let part = |i: usize| qkv.narrow(2, i * h, h).unwrap().transpose(1, 2).unwrap();
    c.check_on("packed qkv", &part(0), &part(1), &part(2), 2f64.powi(-24));
    // A kv head broadcast over the batch (batch stride 0).
    let kv = tensor(&[1, h, n, d], 8, 2.0)
        .broadcast_as((b, h, n, d))
        .unwrap();
    let q = tensor(&[b, h, n, d], 9, 2.0);
    c.check_on("broadcast batch", &q, &kv, &kv, 2f64.powi(-24));
    // A feature axis with stride ≠ 1 ([B, H, D, S].transpose(2, 3)): copied, then viewed.
    let y = tensor(&[b, h, d, n], 10, 2.0).transpose(2, 3).unwrap();
    c.check_on("strided features", &y, &y, &y, 2f64.powi(-24));
    // Half precision through the same views.
    let xh = xt.to_dtype(DType::BF16).unwrap().transpose(1, 2).unwrap();
    let xh = xh.contiguous().unwrap().transpose(1, 2).unwrap();
    c.check_on("bshd bf16", &xh, &xh, &xh, 2f64.powi(-8));
}

#[test]
fn output_in_the_bshd_layout() {
    let mut c = Case::new([2, 4, 2, 21, 30, 16, 8]);
    c.opts = c
        .opts
        .with_output_layout(Layout::Bshd)
        .with_causal(Causal::BottomRight);
    c.layout = Layout::Bshd;
    c.structure.causal = Some(Causal::BottomRight);
    c.check("bshd output");
    let (q, k, v) = c.inputs(1);
    let out = scaled_dot_product_attention(&q, &k, &v, &c.opts).unwrap();
    assert_eq!(out.dims(), &[2, 21, 4, 8]);
    assert!(out.is_contiguous());
}

#[test]
fn zero_length_sequences() {
    let opts = AttentionOptions::default();
    // No queries: an empty output.
    let (q, k) = (tensor(&[2, 2, 0, 8], 1, 1.0), tensor(&[2, 2, 5, 8], 2, 1.0));
    let out = scaled_dot_product_attention(&q, &k, &k, &opts).unwrap();
    assert_eq!(out.dims(), &[2, 2, 0, 8]);
    // No keys: every row sees nothing, output 0 (never NaN).
    let (q, k) = (tensor(&[2, 2, 3, 8], 1, 1.0), tensor(&[2, 2, 0, 8], 2, 1.0));
    let out = scaled_dot_product_attention(&q, &k, &k, &opts).unwrap();
    assert_eq!(out.dims(), &[2, 2, 3, 8]);
    assert!(flat(&out).iter().all(|&x| x == 0.0));
    // No batch entries.
    let q = tensor(&[0, 2, 3, 8], 1, 1.0);
    let out = scaled_dot_product_attention(&q, &q, &q, &opts).unwrap();
    assert_eq!(out.dims(), &[0, 2, 3, 8]);
}

#[test]
fn rows_without_a_visible_key_are_zero_not_nan() {
    // Bottom-right causal with n_q > n_k: the first n_q − n_k queries see nothing.
    let (n_q, n_k) = (12, 5);
    let mut c = Case::new([1, 2, 2, n_q, n_k, 8, 8]);
    c.opts = c.opts.with_causal(Causal::BottomRight);
    let (q, k, v) = c.inputs(4);
    let out = scaled_dot_product_attention(&q, &k, &v, &c.opts).unwrap();
    let o = flat(&out);
    for h in 0..2 {
        for i in 0..n_q {
            let row = &o[(h * n_q + i) * 8..][..8];
            if i < n_q - n_k {
                assert!(row.iter().all(|&x| x == 0.0), "head {h} row {i}: {row:?}");
            } else {
                assert!(row.iter().all(|x| x.is_finite() && *x != 0.0));
            }
        }
    }
    // A boolean mask that blocks every key of row 2.
    let mut m = vec![vec![true; n_k]; n_k];
    m[2] = vec![false; n_k];
    let opts = AttentionOptions::default().with_allow_mask(u8_tensor(&m, false));
    let q5 = q.narrow(2, 0, n_k).unwrap();
    let out = flat(&scaled_dot_product_attention(&q5, &k, &v, &opts).unwrap());
    assert!(out[2 * 8..3 * 8].iter().all(|&x| x == 0.0));
    assert!(out.iter().all(|x| x.is_finite()));
}

fn err(q: &Tensor, k: &Tensor, v: &Tensor, opts: &AttentionOptions) -> String {
    scaled_dot_product_attention(q, k, v, opts)
        .unwrap_err()
        .to_string()
}

#[test]
fn unsupported_inputs_are_errors_that_name_them() {
    let x = tensor(&[1, 2, 4, 8], 1, 1.0);
    let opts = AttentionOptions::default();
    let f64x = x.to_dtype(DType::F64).unwrap();
    let e = err(&f64x, &f64x, &f64x, &opts);
    assert!(e.contains("q has dtype f64"), "{e}");
    let u = x.to_dtype(DType::U32).unwrap();
    assert!(err(&x, &u, &x, &opts).contains("k has dtype u32"));
    let h = x.to_dtype(DType::F16).unwrap();
    let e = err(&x, &x, &h, &opts);
    assert!(e.contains("v has dtype f16 but q has f32"), "{e}");
    let e = err(&x.squeeze(0).unwrap(), &x, &x, &opts);
    assert!(e.contains("q has shape [2, 4, 8]"), "{e}");
    // attn's own errors, with attn's messages.
    let k = tensor(&[1, 2, 5, 7], 2, 1.0);
    let e = err(&x, &k, &k, &opts);
    assert!(e.contains("d_k must match"), "{e}");
    let q3 = tensor(&[1, 3, 4, 8], 3, 1.0);
    let e = err(&q3, &x, &x, &opts);
    assert!(e.contains("not a positive multiple of"), "{e}");
    let e = err(&x, &x, &x, &opts.clone().with_key_length(5));
    assert!(e.contains("5"), "{e}");
    let e = err(&x, &x, &x, &opts.clone().with_scale(f32::INFINITY));
    assert!(e.contains("scale"), "{e}");
    // Masks: the dtype, per-head shapes, the shape of the scores.
    let bad = Tensor::zeros((4, 4), DType::U32, &CPU).unwrap();
    let e = err(&x, &x, &x, &opts.clone().with_allow_mask(bad));
    assert!(e.contains("boolean mask has dtype u32"), "{e}");
    let bad = Tensor::zeros((4, 4), DType::F64, &CPU).unwrap();
    let e = err(&x, &x, &x, &opts.clone().with_additive_mask(bad));
    assert!(e.contains("additive mask has dtype f64"), "{e}");
    // A mask per head broadcasts; one for 3 heads of a 2-head call does not.
    let per_head = Tensor::zeros((1, 2, 4, 4), DType::F32, &CPU).unwrap();
    assert!(
        scaled_dot_product_attention(&x, &x, &x, &opts.clone().with_additive_mask(per_head))
            .is_ok()
    );
    let three = Tensor::zeros((1, 3, 4, 4), DType::F32, &CPU).unwrap();
    let e = err(&x, &x, &x, &opts.clone().with_additive_mask(three));
    assert!(e.contains("[1, 3, 4, 4] do not broadcast"), "{e}");
    let wrong = Tensor::zeros((4, 5), DType::U8, &CPU).unwrap();
    let e = err(&x, &x, &x, &opts.clone().with_block_mask(wrong));
    assert!(
        e.contains("boolean mask (4-D): dims [1, 1, 4, 5] do not broadcast to [batch, h_q, n_q, n_k] = [1, 2, 4, 4]"),
        "{e}"
    );
    let e = err(
        &x,
        &x,
        &x,
        &opts
            .clone()
            .with_allow_mask(Tensor::zeros(4, DType::U8, &CPU).unwrap()),
    );
    assert!(e.contains("boolean mask has shape [4]"), "{e}");
}

#[test]
fn outputs_too_large_to_allocate_are_errors_not_aborts() {
    // Broadcast views: 2^40 rows of one stored row. The output cannot exist.
    let x = tensor(&[1, 1, 1, 8], 1, 1.0)
        .broadcast_as((1 << 20, 1 << 20, 1, 8))
        .unwrap();
    for opts in [
        AttentionOptions::default(),
        AttentionOptions::default().with_output_layout(Layout::Bshd),
    ] {
        let e = err(&x, &x, &x, &opts);
        assert!(e.contains("alloc"), "{e}");
    }
}

//! Gradients through the op (attn's backward pass, driven by candle's autograd) against
//! candle's autograd of the naive formula in f64: every mask kind, GQA, transposed and
//! sliced inputs, half precision, zero-length sequences.

mod common;

use attn_candle::candle_core::{DType, Tensor, Var};
use attn_candle::{AttentionOptions, Causal, Layout, SlidingWindow, scaled_dot_product_attention};
use common::{CPU, Structure, flat, max_rel, naive, tensor, values};

/// f32 gradients: accumulated in f32 over at most a few hundred keys; the same bound as
/// attn-optimized's own backward tests against its f64 reference.
const F32_TOL: f64 = 2e-4;

/// One gradient check: `Σ (attention(q, k, v) ∘ w)` (so that the upstream gradient is `w`)
/// differentiated with respect to three leaf variables, through the op with `opts` (inputs
/// in `dtype`) and through the naive formula in f64 on the same values.
struct Check<'a> {
    name: &'a str,
    dims: [usize; 7], // b, h_q, h_kv, n_q, n_k, d_k, d_v
    opts: AttentionOptions,
    structure: Structure,
    bias: Option<Tensor>,
    dtype: DType,
    /// The leaves are `[B, S, H, D]` and the op sees their transposes.
    bshd_leaves: bool,
    /// The layout the options ask the output in.
    out: Layout,
    tol: f64,
}

impl<'a> Check<'a> {
    fn new(name: &'a str, dims: [usize; 7]) -> Self {
        Self {
            name,
            dims,
            opts: AttentionOptions::default(),
            structure: Structure::default(),
            bias: None,
            dtype: DType::F32,
            bshd_leaves: false,
            out: Layout::Bhsd,
            tol: F32_TOL,
        }
    }

    fn causal(mut self, align: Causal) -> Self {
        self.opts = self.opts.with_causal(align);
        self.structure.causal = Some(align);
        self
    }

    fn run(self) {
        let [b, h_q, h_kv, n_q, n_k, d_k, d_v] = self.dims;
        let dtype = self.dtype;
        let leaf = |d: [usize; 4], seed| tensor(&d, seed, 2.0).to_dtype(dtype).unwrap();
        let (q0, k0, v0) = (
            leaf([b, h_q, n_q, d_k], 1),
            leaf([b, h_kv, n_k, d_k], 2),
            leaf([b, h_kv, n_k, d_v], 3),
        );
        let w = tensor(&[b, h_q, n_q, d_v], 4, 1.0).to_dtype(dtype).unwrap();
        // [B, H, S, D] ↔ [B, S, H, D] for the transposed cases (a copy to make the leaves,
        // a view on the way into the op).
        let bshd = self.bshd_leaves;
        let flip = |t: &Tensor| {
            if bshd {
                t.transpose(1, 2).unwrap()
            } else {
                t.clone()
            }
        };
        let var = |t: &Tensor| Var::from_tensor(&flip(t).contiguous().unwrap()).unwrap();
        let (q, k, v) = (var(&q0), var(&k0), var(&v0));
        let out =
            scaled_dot_product_attention(&flip(&q), &flip(&k), &flip(&v), &self.opts).unwrap();
        let out = match self.out {
            Layout::Bhsd => out,
            Layout::Bshd => out.transpose(1, 2).unwrap(),
        };
        let grads = (out * &w).unwrap().sum_all().unwrap().backward().unwrap();
        let wide = |t: &Tensor| Var::from_tensor(&t.to_dtype(DType::F64).unwrap()).unwrap();
        let (qn, kn, vn) = (wide(&q0), wide(&k0), wide(&v0));
        let scale = 1.0 / (d_k as f64).sqrt();
        let want = naive(&qn, &kn, &vn, scale, &self.structure, self.bias.as_ref()).unwrap();
        let want_grads = (want * w.to_dtype(DType::F64).unwrap())
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .unwrap();
        let name = self.name;
        for (g, var, wvar) in [("dq", &q, &qn), ("dk", &k, &kn), ("dv", &v, &vn)] {
            let got = flip(grads.get(var).expect("a gradient"));
            assert_eq!(got.dtype(), dtype, "{name} {g}: dtype");
            let want = want_grads.get(wvar).expect("a naive gradient");
            assert!(
                flat(&got).iter().all(|x| x.is_finite()),
                "{name} {g}: not finite"
            );
            let e = max_rel(&got, want);
            assert!(
                e < self.tol,
                "{name} {g}: relative error {e} ≥ {}",
                self.tol
            );
        }
    }
}

#[test]
fn gradients_match_candle_autograd_of_the_naive_formula() {
    Check::new("plain", [2, 2, 2, 37, 45, 16, 16]).run();
    Check::new("d_v ≠ d_k", [1, 2, 2, 130, 140, 32, 8]).run();
    Check::new("gqa", [2, 6, 2, 20, 33, 16, 16]).run();
    Check::new("mqa", [1, 4, 1, 20, 33, 16, 16]).run();
    let mut c = Check::new("scale", [1, 2, 2, 20, 33, 16, 16]);
    c.opts = c.opts.with_scale(0.25); // = 1/√16, the naive side's scale
    c.run();
}

#[test]
fn gradients_under_every_mask_kind() {
    let dims = [2, 4, 2, 40, 60, 16, 16];
    let (n_q, n_k) = (dims[3], dims[4]);
    for align in [Causal::TopLeft, Causal::BottomRight] {
        Check::new(&format!("causal {align:?}"), dims)
            .causal(align)
            .run();
    }
    let w = SlidingWindow::new(Some(8), Some(3), Causal::BottomRight);
    let mut c = Check::new("window", dims);
    c.opts = c.opts.with_window(w);
    c.structure.window = Some(w);
    c.run();
    let mut c = Check::new("key lengths", dims);
    c.opts = c.opts.with_key_lengths(vec![60, 9]);
    c.structure.lens = Some(vec![60, 9]);
    c.run();
    let r = values(n_q * n_k, 5, 1.0);
    let m: Vec<Vec<bool>> = (0..n_q)
        .map(|i| (0..n_k).map(|j| r[i * n_k + j] > -0.5 || j == 0).collect())
        .collect();
    let u8s: Vec<u8> = m.iter().flatten().map(|&b| u8::from(!b)).collect();
    let mut c = Check::new("block mask", dims);
    c.opts = c
        .opts
        .with_block_mask(Tensor::from_vec(u8s, (n_q, n_k), &CPU).unwrap());
    c.structure.allow = Some(m);
    c.run();
    let bias = Tensor::from_vec(values(n_q * n_k, 6, 2.0), (n_q, n_k), &CPU).unwrap();
    let mut c = Check::new("additive + causal", dims).causal(Causal::BottomRight);
    c.opts = c.opts.with_additive_mask(bias.clone());
    c.bias = Some(bias);
    c.run();
}

#[test]
fn gradients_through_transposed_inputs_and_bshd_output() {
    // The leaves are [B, S, H, D]; the op sees their transposes (no copy), and candle
    // transposes the gradients back.
    let dims = [2, 4, 2, 30, 30, 16, 16];
    let mut c = Check::new("bshd inputs", dims).causal(Causal::TopLeft);
    c.bshd_leaves = true;
    c.run();
    let mut c = Check::new("bshd inputs and output", dims);
    c.bshd_leaves = true;
    c.opts = c.opts.with_output_layout(Layout::Bshd);
    c.out = Layout::Bshd;
    c.run();
}

#[test]
fn gradients_in_half_precision() {
    // D = rowsum(dO ∘ O) is computed from the half-rounded output, and each gradient is
    // rounded to half once: errors of the order of the half unit roundoff times the
    // gradients' magnitude (the tolerances of attn-optimized's half backward tests).
    let dims = [1, 4, 2, 50, 50, 32, 32];
    for (dtype, tol) in [(DType::F16, 4e-3), (DType::BF16, 3e-2)] {
        for causal in [false, true] {
            let name = format!("{dtype:?} causal {causal}");
            let mut c = Check::new(&name, dims);
            if causal {
                c = c.causal(Causal::TopLeft);
            }
            c.dtype = dtype;
            c.tol = tol;
            c.run();
        }
    }
}

#[test]
fn gradients_of_sliced_inputs_reach_the_packed_buffer() {
    // q, k, v are slices of one packed projection: their gradients land in its slices.
    let (b, n, h, d) = (1, 20, 2, 8);
    let qkv = Var::from_tensor(&tensor(&[b, n, 3 * h, d], 1, 2.0)).unwrap();
    let part = |i: usize| qkv.narrow(2, i * h, h).unwrap().transpose(1, 2).unwrap();
    let out =
        scaled_dot_product_attention(&part(0), &part(1), &part(2), &AttentionOptions::default())
            .unwrap();
    let grads = out.sqr().unwrap().sum_all().unwrap().backward().unwrap();
    let got = grads.get(&qkv).unwrap();
    // The same through the naive formula.
    let wide = Var::from_tensor(&qkv.to_dtype(DType::F64).unwrap()).unwrap();
    let wpart = |i: usize| wide.narrow(2, i * h, h).unwrap().transpose(1, 2).unwrap();
    let want = naive(
        &wpart(0),
        &wpart(1),
        &wpart(2),
        1.0 / (d as f64).sqrt(),
        &Structure::default(),
        None,
    )
    .unwrap();
    let want = want.sqr().unwrap().sum_all().unwrap().backward().unwrap();
    let e = max_rel(got, want.get(&wide).unwrap());
    assert!(e < F32_TOL, "packed qkv: {e}");
}

#[test]
fn backward_twice_and_with_some_inputs_constant() {
    // The kept LSE serves every backward of the graph; a constant q still gets gradients
    // for k and v.
    let q = tensor(&[1, 2, 10, 8], 1, 1.0);
    let k = Var::from_tensor(&tensor(&[1, 2, 12, 8], 2, 1.0)).unwrap();
    let v = Var::from_tensor(&tensor(&[1, 2, 12, 8], 3, 1.0)).unwrap();
    let out = scaled_dot_product_attention(&q, &k, &v, &AttentionOptions::default()).unwrap();
    let g1 = out.sum_all().unwrap().backward().unwrap();
    let g2 = out.sum_all().unwrap().backward().unwrap();
    let (a, b) = (flat(g1.get(&k).unwrap()), flat(g2.get(&k).unwrap()));
    assert_eq!(a, b);
    assert!(g1.get(&v).is_some());
    // The upstream gradient of sum_all is a broadcast (stride 0 everywhere): copied once.
    let dv = flat(g1.get(&v).unwrap());
    assert!(dv.iter().all(|x| x.is_finite()));
}

#[test]
fn gradients_of_zero_length_sequences_are_zero() {
    let q = Var::from_tensor(&tensor(&[1, 2, 3, 8], 1, 1.0)).unwrap();
    let k = Var::from_tensor(&tensor(&[1, 2, 0, 8], 2, 1.0)).unwrap();
    let out = scaled_dot_product_attention(&q, &k, &k, &AttentionOptions::default()).unwrap();
    let g = out.sum_all().unwrap().backward().unwrap();
    assert!(flat(g.get(&q).unwrap()).iter().all(|&x| x == 0.0));
    assert_eq!(g.get(&k).unwrap().dims(), &[1, 2, 0, 8]);
    let q0 = Var::from_tensor(&tensor(&[1, 2, 0, 8], 1, 1.0)).unwrap();
    let k = Var::from_tensor(&tensor(&[1, 2, 4, 8], 2, 1.0)).unwrap();
    let out = scaled_dot_product_attention(&q0, &k, &k, &AttentionOptions::default()).unwrap();
    let g = out.sum_all().unwrap().backward().unwrap();
    assert!(flat(g.get(&k).unwrap()).iter().all(|&x| x == 0.0));
}

/// A packed batch (`cu_seqlens`): the output and the gradients are those of each sequence
/// run through the op on its own (GQA, causal per sequence, a sequence without queries,
/// the output in both layouts), and the op's errors name the offsets.
#[test]
fn packed_batches_match_their_sequences_run_alone() {
    let (cu_q, cu_k) = (vec![0, 3, 3, 10], vec![0, 5, 7, 16]);
    let (h_q, h_kv, d) = (4, 2, 8);
    let q = Var::from_tensor(&tensor(&[1, h_q, 10, d], 1, 1.0)).unwrap();
    let k = Var::from_tensor(&tensor(&[1, h_kv, 16, d], 2, 1.0)).unwrap();
    let v = Var::from_tensor(&tensor(&[1, h_kv, 16, d], 3, 1.0)).unwrap();
    let w = tensor(&[1, h_q, 10, d], 4, 1.0);
    let causal = AttentionOptions::default().with_causal(Causal::BottomRight);
    for layout in [Layout::Bhsd, Layout::Bshd] {
        let opts = causal
            .clone()
            .with_cu_seqlens(cu_q.clone(), cu_k.clone())
            .with_output_layout(layout);
        let out = scaled_dot_product_attention(&q, &k, &v, &opts).unwrap();
        let out = match layout {
            Layout::Bhsd => out,
            Layout::Bshd => out.transpose(1, 2).unwrap(),
        };
        assert_eq!(out.dims(), &[1, h_q, 10, d]);
        let got = (&out * &w).unwrap().sum_all().unwrap().backward().unwrap();
        let mut loss = Tensor::zeros((), DType::F32, &CPU).unwrap();
        let mut alone = Vec::new();
        for s in 0..3 {
            let (q0, nq) = (cu_q[s], cu_q[s + 1] - cu_q[s]);
            let (k0, nk) = (cu_k[s], cu_k[s + 1] - cu_k[s]);
            let (qs, ks, vs) = (
                q.narrow(2, q0, nq).unwrap(),
                k.narrow(2, k0, nk).unwrap(),
                v.narrow(2, k0, nk).unwrap(),
            );
            let o = scaled_dot_product_attention(&qs, &ks, &vs, &causal).unwrap();
            let part = (&o * w.narrow(2, q0, nq).unwrap())
                .unwrap()
                .sum_all()
                .unwrap();
            loss = (loss + part).unwrap();
            alone.push(o);
        }
        let alone = Tensor::cat(&alone, 2).unwrap();
        assert!(max_rel(&out, &alone) < 1e-6, "{layout:?}: output");
        let want = loss.backward().unwrap();
        for (name, x) in [("dq", &q), ("dk", &k), ("dv", &v)] {
            let (g, wg) = (got.get(x).unwrap(), want.get(x).unwrap());
            assert!(max_rel(g, wg) < 1e-5, "{layout:?}: {name}");
        }
    }
    let bad = causal
        .clone()
        .with_cu_seqlens(vec![0, 3, 9], vec![0, 5, 16]);
    let err = scaled_dot_product_attention(&q, &k, &v, &bad).unwrap_err();
    assert!(err.to_string().contains("cu_seqlens_q"), "{err}");
    let masked = AttentionOptions::default()
        .with_cu_seqlens(cu_q, cu_k)
        .with_allow_mask(Tensor::ones((10, 16), DType::U8, &CPU).unwrap());
    assert!(scaled_dot_product_attention(&q, &k, &v, &masked).is_err());
}

/// Dropout through the op: its forward and gradients are the engine's own with the same
/// seed (the op's backward regenerates the forward's mask), another seed drops other
/// weights, and `p = 0` is no dropout, bit for bit.
#[test]
fn dropout_is_the_engines_with_the_same_seed() {
    use attn_candle::attn_optimized::{Attention, Dropout, Options, Par, Tensor4Ref};
    let (b, h, n, d) = (2, 3, 37, 16);
    let dims = [b, h, n, d];
    let leaf = |seed| Var::from_tensor(&tensor(&dims, seed, 2.0)).unwrap();
    let (q, k, v) = (leaf(1), leaf(2), leaf(3));
    let w = tensor(&dims, 4, 1.0);
    let run = |opts: &AttentionOptions| {
        let out = scaled_dot_product_attention(q.as_tensor(), k.as_tensor(), v.as_tensor(), opts)
            .unwrap();
        let grads = (&out * &w).unwrap().sum_all().unwrap().backward().unwrap();
        let g = |x: &Var| flat(grads.get(x.as_tensor()).unwrap());
        (flat(&out), [g(&q), g(&k), g(&v)])
    };
    let dropped = AttentionOptions::default()
        .with_causal(Causal::TopLeft)
        .with_dropout(0.3, 99)
        .unwrap();
    let (out, grads) = run(&dropped);

    // The engine on the same values and options.
    let f32s = |t: &Tensor| t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    let (qf, kf, vf, wf) = (
        f32s(q.as_tensor()),
        f32s(k.as_tensor()),
        f32s(v.as_tensor()),
        f32s(&w),
    );
    fn view(x: &[f32], dims: [usize; 4]) -> Tensor4Ref<'_, f32> {
        Tensor4Ref::from_layout(x, dims, Layout::Bhsd).unwrap()
    }
    let opts = Options::default()
        .with_causal(Causal::TopLeft)
        .with_dropout(Dropout::new(0.3, 99).unwrap());
    let call =
        Attention::batched(view(&qf, dims), view(&kf, dims), view(&vf, dims), &opts).unwrap();
    let fwd = call.forward(Par::rayon(0)).unwrap();
    let g = call.backward(&fwd, view(&wf, dims), Par::rayon(0)).unwrap();
    let wide = |x: &[f32]| x.iter().map(|&y| f64::from(y)).collect::<Vec<_>>();
    assert_eq!(out, wide(fwd.output().as_slice()));
    for (got, want) in grads.iter().zip([&g.dq, &g.dk, &g.dv]) {
        assert_eq!(got, &wide(want.as_slice()));
    }

    let (other, _) = run(&AttentionOptions::default()
        .with_causal(Causal::TopLeft)
        .with_dropout(0.3, 100)
        .unwrap());
    assert_ne!(out, other);
    let plain = AttentionOptions::default().with_causal(Causal::TopLeft);
    let zero = plain.clone().with_dropout(0.0, 5).unwrap();
    let (a, ga) = run(&plain);
    let (z, gz) = run(&zero);
    assert_eq!(a, z);
    assert_eq!(ga, gz);
}

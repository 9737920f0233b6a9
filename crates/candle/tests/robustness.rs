//! Hostile candle layouts, generated: operands that are transposed, narrowed out
//! of larger tensors, broadcast along any axis (the feature axis included), half precision
//! or the wrong dtype, with empty axes and mismatched shapes; masks of every kind (u8
//! allow/block, f32/f16/bf16 additive) in every rank, broadcast by length 1 or stride 0,
//! transposed, strided, mismatched. Every call must return (no panic, no abort); an input
//! the contract rejects must be an error, and every other call must succeed and equal
//! attn-reference's f64 formula on the same values — forward, and for f32 the gradients
//! too (the reference's gradients pulled back through the same layout by candle's
//! autograd in f64).
//!
//! `ATTN_CANDLE_CASES` sets the number of generated cases (default 300); a failure names
//! its seed, and `ATTN_CANDLE_SEED` replays one.

mod common;

use attn_candle::candle_core::{DType, Device, Result, Tensor, Var};
use attn_candle::{AttentionOptions, Causal, Layout, scaled_dot_product_attention};
use attn_core::{BoolMask4, Mask4Ref, Options, Tensor4Ref};

const CPU: Device = Device::Cpu;

/// A small deterministic generator (splitmix64).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
    fn chance(&mut self, percent: u64) -> bool {
        self.next() % 100 < percent
    }
    fn value(&mut self, amp: f32) -> f32 {
        ((self.next() >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * amp
    }
}

/// How an operand's logical `[b, h, s, d]` view is made from its base tensor.
#[derive(Debug, Clone, Copy)]
enum Form {
    /// The base itself, contiguous.
    Plain,
    /// `[b, s, h, d].transpose(1, 2)`.
    FromBshd,
    /// `[b, h, d, s].transpose(2, 3)`: the feature axis strided.
    FromBhds,
    /// A `narrow` of a base longer along `axis`, at an offset.
    Narrowed {
        axis: usize,
        before: usize,
        after: usize,
    },
    /// Axes (bit `a` for axis `a`) of length 1 in the base, broadcast by stride 0.
    Broadcast { axes: u8 },
}

impl Form {
    fn draw(rng: &mut Rng) -> Self {
        match rng.below(6) {
            0 | 1 => Form::Plain,
            2 => Form::FromBshd,
            3 => Form::FromBhds,
            4 => Form::Narrowed {
                axis: rng.below(4),
                before: rng.below(3),
                after: rng.below(3),
            },
            _ => Form::Broadcast {
                axes: rng.below(16) as u8,
            },
        }
    }

    /// The base's dims for a logical view of `dims`.
    fn base_dims(self, [b, h, s, d]: [usize; 4]) -> Vec<usize> {
        match self {
            Form::Plain => vec![b, h, s, d],
            Form::FromBshd => vec![b, s, h, d],
            Form::FromBhds => vec![b, h, d, s],
            Form::Narrowed {
                axis,
                before,
                after,
            } => {
                let mut x = vec![b, h, s, d];
                x[axis] += before + after;
                x
            }
            Form::Broadcast { axes } => (0..4)
                .map(|a| {
                    if axes >> a & 1 == 1 {
                        1
                    } else {
                        [b, h, s, d][a]
                    }
                })
                .collect(),
        }
    }

    /// The logical view of `base` (any dtype; autograd follows it).
    fn view(self, base: &Tensor, dims: [usize; 4]) -> Result<Tensor> {
        match self {
            Form::Plain => Ok(base.clone()),
            Form::FromBshd => base.transpose(1, 2),
            Form::FromBhds => base.transpose(2, 3),
            Form::Narrowed { axis, before, .. } => base.narrow(axis, before, dims[axis]),
            Form::Broadcast { .. } => base.broadcast_as(dims.to_vec()),
        }
    }
}

/// Values of `n` entries, each position a different value.
fn base(rng: &mut Rng, dims: &[usize], amp: f32) -> Tensor {
    let n: usize = dims.iter().product();
    let v: Vec<f32> = (0..n).map(|_| rng.value(amp)).collect();
    Tensor::from_vec(v, dims.to_vec(), &CPU).unwrap()
}

/// The mask's kind.
#[derive(Debug, Clone, Copy, PartialEq)]
enum MaskKind {
    Allow,
    Block,
    Additive(DType),
}

/// A generated mask: the tensor the op sees and whether its dims broadcast to the call's.
struct MaskCase {
    kind: MaskKind,
    tensor: Tensor,
    /// Its values broadcast to `[b, h_q, n_q, n_k]` (f32; booleans as 0/1) when they do.
    full: Option<Vec<f32>>,
    valid: bool,
}

/// A mask of `kind` against a call of `[b, h_q, n_q, n_k]`: a rank of 2 to 4, axes of
/// length 1 or broadcast by stride 0, transposed or strided, sometimes mismatched.
fn mask(rng: &mut Rng, kind: MaskKind, call: [usize; 4]) -> MaskCase {
    let rank = 2 + rng.below(3);
    let mut valid = true;
    // The logical dims, right-aligned against the call's.
    let mut dims: Vec<usize> = call[4 - rank..].to_vec();
    // Axes of length 1 (kept) or broadcast by stride 0 (expanded).
    let mut ones = vec![false; rank];
    let mut expand = vec![false; rank];
    for a in 0..rank {
        match rng.below(4) {
            0 => ones[a] = true,
            1 => expand[a] = true,
            _ => {}
        }
    }
    if rng.chance(8) {
        let a = rng.below(rank);
        // Neither the call's length nor 1: does not broadcast.
        dims[a] += if dims[a] == 0 { 2 } else { 1 + rng.below(2) };
        ones[a] = false;
        expand[a] = false;
        valid = false;
    }
    let base_dims: Vec<usize> = (0..rank)
        .map(|a| if ones[a] || expand[a] { 1 } else { dims[a] })
        .collect();
    let n: usize = base_dims.iter().product();
    let values: Vec<f32> = (0..n)
        .map(|_| match kind {
            MaskKind::Allow | MaskKind::Block => {
                if rng.chance(70) {
                    [1.0, 2.0, 255.0][rng.below(3)]
                } else {
                    0.0
                }
            }
            MaskKind::Additive(_) => {
                if rng.chance(15) {
                    f32::NEG_INFINITY
                } else {
                    rng.value(3.0)
                }
            }
        })
        .collect();
    let dtype = match kind {
        MaskKind::Allow | MaskKind::Block => DType::U8,
        MaskKind::Additive(d) => d,
    };
    let contiguous = Tensor::from_vec(values, base_dims.clone(), &CPU)
        .unwrap()
        .to_dtype(dtype)
        .unwrap();
    // The same values in another layout: transposed matrix axes, or strided by a
    // selection from a wider tensor (neither matrix axis contiguous).
    let last = rank - 1;
    // (candle's own copies panic on some layouts of empty tensors: those stay contiguous.)
    let empty = base_dims.contains(&0);
    let laid = match if empty { 2 } else { rng.below(3) } {
        0 => contiguous
            .transpose(last - 1, last)
            .unwrap()
            .contiguous()
            .unwrap()
            .transpose(last - 1, last)
            .unwrap(),
        1 => Tensor::stack(&[&contiguous, &contiguous], rank)
            .unwrap()
            .narrow(rank, 1, 1)
            .unwrap()
            .squeeze(rank)
            .unwrap(),
        _ => contiguous.clone(),
    };
    let expanded: Vec<usize> = (0..rank)
        .map(|a| if expand[a] { dims[a] } else { base_dims[a] })
        .collect();
    let tensor = laid.broadcast_as(expanded).unwrap();
    let full = valid.then(|| {
        let mut four = vec![1; 4 - rank];
        four.extend(tensor.dims());
        tensor
            .reshape(four)
            .unwrap()
            .broadcast_as(call.to_vec())
            .unwrap()
            .to_dtype(DType::F32)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap()
    });
    MaskCase {
        kind,
        tensor,
        full,
        valid,
    }
}

/// One generated case and what the contract says of it.
struct Case {
    q: Tensor,
    k: Tensor,
    v: Tensor,
    /// The bases, and the forms that view them, for the gradients.
    bases: [(Tensor, Form, [usize; 4]); 3],
    mask: Option<MaskCase>,
    causal: Option<Causal>,
    key_len: Option<usize>,
    scale: Option<f32>,
    out_layout: Layout,
    dtype: DType,
    valid: bool,
}

fn generate(seed: u64) -> Case {
    let mut rng = Rng(seed);
    let b = rng.below(3);
    let b = if rng.chance(90) { b.max(1) } else { b };
    let h_kv = 1 + rng.below(2);
    let h_q = h_kv * (1 + rng.below(2));
    let n_q = if rng.chance(8) { 0 } else { 1 + rng.below(6) };
    let n_k = if rng.chance(8) { 0 } else { 1 + rng.below(7) };
    let d_k = 1 + rng.below(5);
    let d_v = if rng.chance(8) { 0 } else { 1 + rng.below(5) };
    let mut valid = true;
    let dtype = match rng.below(10) {
        0 => DType::F16,
        1 => DType::BF16,
        2 if rng.chance(30) => {
            valid = false;
            DType::F64
        }
        _ => DType::F32,
    };
    let mut dims = [[b, h_q, n_q, d_k], [b, h_kv, n_k, d_k], [b, h_kv, n_k, d_v]];
    if rng.chance(5) {
        dims[1][3] += 1; // d_k differs
        valid = false;
    }
    if rng.chance(4) {
        dims[0][1] = h_kv * 2 + 1; // not a multiple of h_kv
        valid = valid && (h_kv * 2 + 1).is_multiple_of(h_kv);
    }
    let bases: Vec<(Tensor, Form, [usize; 4])> = dims
        .iter()
        .map(|&d| {
            let form = Form::draw(&mut rng);
            let t = base(&mut rng, &form.base_dims(d), 1.5);
            (t.to_dtype(dtype).unwrap(), form, d)
        })
        .collect();
    let view = |i: usize| bases[i].1.view(&bases[i].0, bases[i].2).unwrap();
    let (q, k, v) = (view(0), view(1), view(2));
    let call = [b, dims[0][1], n_q, n_k];
    let mask = match rng.below(6) {
        0 => Some(mask(&mut rng, MaskKind::Allow, call)),
        1 => Some(mask(&mut rng, MaskKind::Block, call)),
        2 => {
            let dtype = [DType::F32, DType::F16, DType::BF16][rng.below(3)];
            Some(mask(&mut rng, MaskKind::Additive(dtype), call))
        }
        _ => None,
    };
    if mask.as_ref().is_some_and(|m| !m.valid) {
        valid = false;
    }
    let causal = match rng.below(4) {
        0 => Some(Causal::TopLeft),
        1 => Some(Causal::BottomRight),
        _ => None,
    };
    let key_len = rng.chance(15).then(|| rng.below(n_k + 2));
    if key_len.is_some_and(|l| l > n_k) {
        valid = false;
    }
    let scale = rng.chance(20).then(|| 0.25 + rng.value(0.2));
    let out_layout = if rng.chance(20) {
        Layout::Bshd
    } else {
        Layout::Bhsd
    };
    let [bq, bk, bv]: [(Tensor, Form, [usize; 4]); 3] = bases.try_into().unwrap();
    Case {
        q,
        k,
        v,
        bases: [bq, bk, bv],
        mask,
        causal,
        key_len,
        scale,
        out_layout,
        dtype,
        valid,
    }
}

impl Case {
    fn options(&self) -> AttentionOptions {
        let mut o = AttentionOptions::default().with_output_layout(self.out_layout);
        if let Some(c) = self.causal {
            o = o.with_causal(c);
        }
        if let Some(l) = self.key_len {
            o = o.with_key_length(l);
        }
        if let Some(s) = self.scale {
            o = o.with_scale(s);
        }
        if let Some(m) = &self.mask {
            o = match m.kind {
                MaskKind::Allow => o.with_allow_mask(m.tensor.clone()),
                MaskKind::Block => o.with_block_mask(m.tensor.clone()),
                MaskKind::Additive(_) => o.with_additive_mask(m.tensor.clone()),
            };
        }
        o
    }

    /// attn-reference's output `[b, h_q, n_q, d_v]` and LSE on the same values, in f64,
    /// and the reference's gradients for the upstream gradient `w`.
    fn reference(&self, w: Option<&[f64]>) -> (Vec<f64>, Option<[Vec<f64>; 3]>) {
        let flat = |t: &Tensor| -> Vec<f64> {
            t.to_dtype(DType::F64)
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1::<f64>()
                .unwrap()
        };
        let (q, k, v) = (flat(&self.q), flat(&self.k), flat(&self.v));
        fn dims(t: &Tensor) -> [usize; 4] {
            t.dims().try_into().unwrap()
        }
        fn view<'a>(x: &'a [f64], t: &Tensor) -> Tensor4Ref<'a, f64> {
            Tensor4Ref::from_layout(x, dims(t), attn_core::Layout::Bhsd).unwrap()
        }
        let (qv, kv, vv) = (view(&q, &self.q), view(&k, &self.k), view(&v, &self.v));
        let [b, h_q, n_q, _] = dims(&self.q);
        let n_k = self.k.dims()[2];
        let call = [b, h_q, n_q, n_k];
        let mut opts = Options {
            scale: self.scale,
            causal: self.causal,
            ..Options::default()
        };
        if let Some(l) = self.key_len {
            opts = opts.with_key_length(l);
        }
        let bits: Vec<bool>;
        let bias: Vec<f32>;
        if let Some(m) = &self.mask {
            let full = m.full.as_ref().unwrap();
            match m.kind {
                MaskKind::Allow | MaskKind::Block => {
                    bits = full.iter().map(|&x| x != 0.0).collect();
                    let view = Mask4Ref::contiguous(&bits, call).unwrap();
                    opts = opts.with_bool_mask_4d(match m.kind {
                        MaskKind::Allow => BoolMask4::allow(view),
                        _ => BoolMask4::block(view),
                    });
                }
                MaskKind::Additive(_) => {
                    bias = full.clone();
                    opts = opts.with_additive_mask_4d(Mask4Ref::contiguous(&bias, call).unwrap());
                }
            }
        }
        let (out, lse) = attn_reference::Attention::batched(qv, kv, vv, &opts)
            .and_then(|call| call.forward())
            .map(|f| f.into_parts())
            .unwrap();
        let grads = w.map(|w| {
            let wv = Tensor4Ref::from_layout(w, out.dims(), attn_core::Layout::Bhsd).unwrap();
            let g = attn_reference::Attention::batched(qv, kv, vv, &opts)
                .and_then(|call| {
                    call.backward(attn_reference::ForwardRef::batch(out.as_ref(), &lse)?, wv)
                })
                .unwrap();
            [g.dq.into_vec(), g.dk.into_vec(), g.dv.into_vec()]
        });
        (out.into_vec(), grads)
    }
}

/// The output of the op as logical `[b, h_q, n_q, d_v]` f64 values.
fn logical(out: &Tensor, layout: Layout) -> Vec<f64> {
    let out = match layout {
        Layout::Bhsd => out.clone(),
        Layout::Bshd => out.transpose(1, 2).unwrap(),
    };
    out.to_dtype(DType::F64)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1::<f64>()
        .unwrap()
}

fn tolerance(dtype: DType) -> f64 {
    match dtype {
        DType::F16 => 4e-3,
        DType::BF16 => 3e-2,
        _ => 1e-4,
    }
}

fn compare(
    what: &str,
    seed: u64,
    got: &[f64],
    want: &[f64],
    tol: f64,
) -> std::result::Result<(), String> {
    if got.len() != want.len() {
        return Err(format!(
            "seed {seed}: {what} has {} values, the reference {}",
            got.len(),
            want.len()
        ));
    }
    let scale = want.iter().fold(1.0f64, |m, x| m.max(x.abs()));
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        if (g - w).is_nan() || (g - w).abs() > tol * scale {
            return Err(format!(
                "seed {seed}: {what}[{i}] = {g}, the reference {w} (tolerance {})",
                tol * scale
            ));
        }
    }
    Ok(())
}

/// What a case checked.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Checked {
    /// An invalid input, rejected.
    Rejected,
    /// The output against the reference.
    Output,
    /// The output and the gradients.
    Gradients,
}

/// Runs one case; `Err` says what broke the contract.
fn run(seed: u64) -> std::result::Result<Checked, String> {
    let c = generate(seed);
    let opts = c.options();
    let got = scaled_dot_product_attention(&c.q, &c.k, &c.v, &opts);
    let out = match (got, c.valid) {
        (Err(_), false) => return Ok(Checked::Rejected),
        (Ok(_), false) => return Err(format!("seed {seed}: an invalid input was accepted")),
        (Err(e), true) => return Err(format!("seed {seed}: a valid input was rejected: {e}")),
        (Ok(out), true) => out,
    };
    let (want, _) = c.reference(None);
    compare(
        "output",
        seed,
        &logical(&out, c.out_layout),
        &want,
        tolerance(c.dtype),
    )?;
    // (candle's own reductions panic on some views of empty tensors, which the pull-back
    // below would take: the gradients are checked where no axis is empty.)
    let empty = c.bases.iter().any(|(_, _, d)| d.contains(&0)) || out.elem_count() == 0;
    if c.dtype != DType::F32 || !seed.is_multiple_of(3) || empty {
        return Ok(Checked::Output);
    }
    // Gradients of Σ O ∘ W with respect to the bases, through the op, against the
    // reference's gradients pulled back through the same views in f64.
    let vars: Vec<Var> = c
        .bases
        .iter()
        .map(|(t, _, _)| Var::from_tensor(t).unwrap())
        .collect();
    let views: Vec<Tensor> = c
        .bases
        .iter()
        .zip(&vars)
        .map(|((_, form, dims), var)| form.view(var.as_tensor(), *dims).unwrap())
        .collect();
    let out = scaled_dot_product_attention(&views[0], &views[1], &views[2], &opts)
        .map_err(|e| format!("seed {seed}: the tracked call failed: {e}"))?;
    let out = match c.out_layout {
        Layout::Bhsd => out,
        Layout::Bshd => out.transpose(1, 2).unwrap(),
    };
    let mut rng = Rng(seed ^ 0xABCD);
    let n = out.elem_count();
    let w: Vec<f64> = (0..n).map(|_| f64::from(rng.value(1.0))).collect();
    let wt = Tensor::from_vec(
        w.iter().map(|&x| x as f32).collect::<Vec<_>>(),
        out.dims(),
        &CPU,
    )
    .unwrap();
    let grads = (out * wt).unwrap().sum_all().unwrap().backward().unwrap();
    let (_, ref_grads) = c.reference(Some(&w));
    let ref_grads = ref_grads.unwrap();
    for (i, name) in ["dQ", "dK", "dV"].iter().enumerate() {
        let (base, form, dims) = &c.bases[i];
        let got = grads
            .get(vars[i].as_tensor())
            .map(|g| {
                g.to_dtype(DType::F64)
                    .unwrap()
                    .flatten_all()
                    .unwrap()
                    .to_vec1::<f64>()
                    .unwrap()
            })
            .unwrap_or_else(|| vec![0.0; base.elem_count()]);
        // The pull-back: ∂/∂base of Σ view(base) ∘ G, by candle's autograd in f64.
        let base64 = Var::from_tensor(&base.to_dtype(DType::F64).unwrap()).unwrap();
        let view = form.view(base64.as_tensor(), *dims).unwrap();
        let g = Tensor::from_vec(ref_grads[i].clone(), dims.to_vec(), &CPU).unwrap();
        let pulled = (view * g).unwrap().sum_all().unwrap().backward().unwrap();
        let want = pulled
            .get(base64.as_tensor())
            .map(|g| g.flatten_all().unwrap().to_vec1::<f64>().unwrap())
            .unwrap_or_else(|| vec![0.0; base.elem_count()]);
        compare(name, seed, &got, &want, 2e-4)?;
    }
    Ok(Checked::Gradients)
}

#[test]
fn generated_hostile_layouts_hold_the_contract() {
    let cases: u64 = std::env::var("ATTN_CANDLE_CASES")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(300);
    let seeds: Vec<u64> = match std::env::var("ATTN_CANDLE_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
    {
        Some(seed) => vec![seed],
        None => (0..cases).collect(),
    };
    let n = seeds.len();
    let (mut failures, mut count) = (Vec::new(), [0usize; 3]);
    for s in seeds {
        match run(s) {
            Ok(c) => count[c as usize] += 1,
            Err(e) => failures.push(e),
        }
    }
    assert!(
        failures.is_empty(),
        "{} failures:\n{}",
        failures.len(),
        failures.join("\n")
    );
    // The generator must mostly make calls that succeed, and check gradients too.
    let [rejected, output, gradients] = count;
    println!(
        "{n} cases: {rejected} rejected, {output} outputs, {gradients} outputs and gradients compared"
    );
    if n >= 100 {
        assert!(
            output + gradients >= n / 2 && gradients >= n / 20,
            "{count:?}"
        );
    }
}

/// A `[1, n_k]` mask broadcast (stride 0) to `[2^22, 2^22]`, of every kind, against a small
/// call: attn's shape error — the op no longer materialises 2^44 entries first (which
/// aborted the process).
#[test]
fn a_mask_broadcast_to_2_pow_22_squared_is_an_error_not_an_abort() {
    let q = common::tensor(&[1, 1, 4, 8], 1, 1.0);
    let k = common::tensor(&[1, 1, 5, 8], 2, 1.0);
    let big = 1usize << 22;
    for (dtype, kind) in [
        (DType::U8, MaskKind::Allow),
        (DType::U8, MaskKind::Block),
        (DType::F32, MaskKind::Additive(DType::F32)),
        (DType::F16, MaskKind::Additive(DType::F16)),
        (DType::BF16, MaskKind::Additive(DType::BF16)),
    ] {
        let m = Tensor::zeros((1, big), dtype, &CPU)
            .unwrap()
            .broadcast_as((big, big))
            .unwrap();
        let opts = match kind {
            MaskKind::Allow => AttentionOptions::default().with_allow_mask(m),
            MaskKind::Block => AttentionOptions::default().with_block_mask(m),
            MaskKind::Additive(_) => AttentionOptions::default().with_additive_mask(m),
        };
        let err = scaled_dot_product_attention(&q, &k, &k, &opts).unwrap_err();
        assert!(
            err.to_string().contains("do not broadcast"),
            "{kind:?}: {err}"
        );
    }
}

/// The same mask broadcast from `[1, n_k]` to the call's `[n_q, n_k]`: read without a copy
/// of its broadcast rows, and equal to the reference.
#[test]
fn a_broadcast_mask_is_used_without_materialising_it() {
    let q = common::tensor(&[1, 2, 4, 8], 1, 1.0);
    let k = common::tensor(&[1, 2, 5, 8], 2, 1.0);
    let row = Tensor::new(&[[0.0f32, f32::NEG_INFINITY, 0.5, 0.0, -1.0]], &CPU).unwrap();
    let m = row.broadcast_as((4, 5)).unwrap();
    let got = scaled_dot_product_attention(
        &q,
        &k,
        &k,
        &AttentionOptions::default().with_additive_mask(m.to_dtype(DType::BF16).unwrap()),
    )
    .unwrap();
    let want = scaled_dot_product_attention(
        &q,
        &k,
        &k,
        &AttentionOptions::default().with_additive_mask(m.contiguous().unwrap()),
    )
    .unwrap();
    assert_eq!(
        got.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
        want.flatten_all().unwrap().to_vec1::<f32>().unwrap()
    );
}

/// Q and K broadcast along the feature axis to 2^40 entries (stride 0): the copy the op
/// makes to read rows contiguously cannot be allocated — an error, not candle's abort.
#[test]
fn an_operand_broadcast_to_2_pow_40_features_is_an_error_not_an_abort() {
    let big = 1usize << 40;
    let q = Tensor::ones((1, 1, 2, 1), DType::F32, &CPU)
        .unwrap()
        .broadcast_as((1, 1, 2, big))
        .unwrap();
    let v = common::tensor(&[1, 1, 2, 3], 3, 1.0);
    let err = scaled_dot_product_attention(&q, &q, &v, &AttentionOptions::default()).unwrap_err();
    assert!(err.to_string().contains("cannot allocate"), "{err}");
}

/// Per-head masks (4-D, broadcast over the batch and the queries) now reach the engine.
#[test]
fn a_mask_per_head_is_honoured() -> Result<()> {
    let q = common::tensor(&[2, 2, 3, 4], 5, 1.0);
    let k = common::tensor(&[2, 2, 4, 4], 6, 1.0);
    // Head 0 sees key 0 only, head 1 key 3 only: their outputs are those values.
    let bits =
        Tensor::new(&[[[[1u8, 0, 0, 0]], [[0, 0, 0, 1]]]], &CPU)?.broadcast_as((2, 2, 3, 4))?;
    let out = scaled_dot_product_attention(
        &q,
        &k,
        &k,
        &AttentionOptions::default().with_allow_mask(bits),
    )?;
    for b in 0..2 {
        for (h, key) in [(0, 0), (1, 3)] {
            let want = k.get(b)?.get(h)?.get(key)?.to_vec1::<f32>()?;
            for i in 0..3 {
                assert_eq!(out.get(b)?.get(h)?.get(i)?.to_vec1::<f32>()?, want);
            }
        }
    }
    Ok(())
}

//! The properties of masks that differ per batch entry and head: `[B, H, n_q,
//! n_k]` views broadcast along every subset of their axes (by a stride of 0 or a length
//! of 1, key- or query-contiguous) give each head the mask its explicit `[n_q, n_k]`
//! matrix gives a single-head reference call, forward and backward; a 4-D view broadcast
//! from a `[n_q, n_k]` mask computes the same bits as that mask.

use attn_core::{BoolMask, BoolMask4, KeyPadding, Mask4Ref, Options, Tensor4};
use attn_reference::{Attention, Materialized};
use faer::{Mat, MatRef};
use proptest::prelude::*;

use super::common::{
    Check, all_rows, compare_batched_gradients, compare_head, engine_err, fail, scale_of,
};
use crate::Call;
use crate::Engine;
use crate::bound::{
    BatchGradientBound, batch_backward_bound, head_backward_bound, head_bound_with,
};
use crate::case::{
    BACKWARD_MODIFIERS, BatchCase, BatchInputs, HeadSlot, OwnedTensor, Rng, Shapes, TensorLayout,
    batch_case, batch_for_backward,
};
use crate::engine::required;

/// How a case's `[B, H, n_q, n_k]` masks are laid out and filled.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Mask4Recipe {
    /// The axes (batch, head, query, key) along which the masks are constant.
    pub broadcast: [bool; 4],
    /// For each broadcast axis: a stride of 0 over the full length (`true`) or a length
    /// of 1 (`false`).
    pub zero_stride: [bool; 4],
    /// The key axis has stride 1 (`true`), or the query axis has.
    pub keys_contiguous: bool,
    /// A boolean mask (`allow` polarity) with this percentage of allowed entries.
    pub visible_percent: Option<u8>,
    /// An additive mask of small biases with this percentage of `-inf` entries.
    pub neg_inf_percent: Option<u8>,
    /// Seed of the mask entries.
    pub seed: u64,
}

/// A batched case (its own element-wise masks removed) with 4-D masks.
#[derive(Debug, Clone, PartialEq)]
pub struct Mask4Case {
    /// Shapes, values, structural options.
    pub batch: BatchCase,
    /// The 4-D masks.
    pub mask: Mask4Recipe,
}

fn mask4_recipe() -> impl Strategy<Value = Mask4Recipe> {
    (
        any::<[bool; 4]>(),
        any::<[bool; 4]>(),
        any::<bool>(),
        proptest::option::weighted(0.8, proptest::sample::select(vec![0u8, 30, 70, 100])),
        proptest::option::weighted(0.5, proptest::sample::select(vec![0u8, 10, 50])),
        any::<u64>(),
    )
        .prop_map(
            |(broadcast, zero_stride, keys_contiguous, visible, neg_inf, seed)| Mask4Recipe {
                broadcast,
                zero_stride,
                keys_contiguous,
                visible_percent: visible,
                neg_inf_percent: neg_inf,
                seed,
            },
        )
}

pub(crate) fn mask4_case(shapes: &Shapes) -> BoxedStrategy<Mask4Case> {
    (batch_case(shapes), mask4_recipe())
        .prop_map(|(mut batch, mask)| {
            batch.head.masks.bool_mask = None;
            batch.head.masks.additive = None;
            Mask4Case { batch, mask }
        })
        .boxed()
}

/// One 4-D mask buffer and its view: the entries of the axes that are not broadcast.
struct Broadcast4 {
    recipe: Mask4Recipe,
    /// `[batch, h_q, n_q, n_k]`.
    full: [usize; 4],
    /// Strides of the buffer's (non-broadcast) axes.
    buffer_strides: [usize; 4],
    buffer_len: usize,
}

impl Broadcast4 {
    fn new(recipe: Mask4Recipe, full: [usize; 4]) -> Self {
        let reduced: Vec<usize> = (0..4)
            .map(|a| if recipe.broadcast[a] { 1 } else { full[a] })
            .collect();
        let (rq, rk) = (reduced[2], reduced[3]);
        let (sq, sk) = if recipe.keys_contiguous {
            (rk, 1)
        } else {
            (1, rq)
        };
        let sh = rq * rk;
        let sb = reduced[1] * sh;
        Broadcast4 {
            recipe,
            full,
            buffer_strides: [sb, sh, sq, sk],
            buffer_len: reduced.iter().product(),
        }
    }

    /// The buffer index of logical entry `[b, h, i, j]`.
    fn at(&self, idx: [usize; 4]) -> usize {
        (0..4)
            .filter(|&a| !self.recipe.broadcast[a])
            .map(|a| idx[a] * self.buffer_strides[a])
            .sum()
    }

    fn view<'d, T>(&self, data: &'d [T]) -> Mask4Ref<'d, T> {
        let r = &self.recipe;
        let dims: [usize; 4] = core::array::from_fn(|a| {
            if r.broadcast[a] && !r.zero_stride[a] {
                1
            } else {
                self.full[a]
            }
        });
        let strides: [usize; 4] = core::array::from_fn(|a| {
            if r.broadcast[a] {
                0
            } else {
                self.buffer_strides[a]
            }
        });
        Mask4Ref::new(data, dims, strides).expect("built to fit")
    }
}

/// The case's inputs and 4-D mask buffers.
struct Built4 {
    inputs: BatchInputs,
    layout: Broadcast4,
    bits: Option<Vec<bool>>,
    bias: Option<Vec<f32>>,
}

impl Built4 {
    fn of(case: &Mask4Case, engine: &dyn Engine) -> Self {
        let inputs = case.batch.build(engine.storage());
        let [batch, h_q, n_q, _] = inputs.q.dims;
        let n_k = inputs.k.dims[2];
        let layout = Broadcast4::new(case.mask, [batch, h_q, n_q, n_k]);
        let mut rng = Rng::new(case.mask.seed, 41);
        let n = layout.buffer_len;
        let bits = case
            .mask
            .visible_percent
            .map(|p| (0..n).map(|_| rng.chance(p)).collect());
        let bias = case.mask.neg_inf_percent.map(|p| {
            (0..n)
                .map(|_| {
                    if rng.chance(p) {
                        f32::NEG_INFINITY
                    } else {
                        (rng.unit() * 4.0 - 2.0) as f32
                    }
                })
                .collect()
        });
        Built4 {
            inputs,
            layout,
            bits,
            bias,
        }
    }

    /// The batched options with the 4-D masks.
    fn options(&self) -> Options<'_> {
        let mut opts = self.inputs.options();
        if let Some(bits) = &self.bits {
            opts = opts.with_bool_mask_4d(BoolMask4::allow(self.layout.view(bits)));
        }
        if let Some(bias) = &self.bias {
            opts = opts.with_additive_mask_4d(self.layout.view(bias));
        }
        opts
    }

    /// Head `(b, h)`'s masks as explicit `[n_q, n_k]` matrices.
    fn head_masks(&self, b: usize, h: usize) -> (Option<Mat<bool>>, Option<Mat<f32>>) {
        let [_, _, n_q, n_k] = self.layout.full;
        let bits = self
            .bits
            .as_ref()
            .map(|m| Mat::from_fn(n_q, n_k, |i, j| m[self.layout.at([b, h, i, j])]));
        let bias = self
            .bias
            .as_ref()
            .map(|m| Mat::from_fn(n_q, n_k, |i, j| m[self.layout.at([b, h, i, j])]));
        (bits, bias)
    }
}

/// The single-head options of head `(b, h)` with its explicit masks.
fn head_options<'a>(
    batched: &Options<'a>,
    b: usize,
    bits: &'a Option<Mat<bool>>,
    bias: &'a Option<Mat<f32>>,
) -> Options<'a> {
    Options {
        key_padding: batched.key_length(b).map(KeyPadding::Uniform),
        bool_mask: bits.as_ref().map(|m| BoolMask::allow(m.as_ref())),
        additive_mask: bias.as_ref().map(|m| m.as_ref()),
        bool_mask_4d: None,
        additive_mask_4d: None,
        ..*batched
    }
}

fn heads(inputs: &BatchInputs, b: usize, h: usize) -> [MatRef<'_, f32>; 3] {
    let [_, h_q, _, _] = inputs.q.dims;
    let kv = h / (h_q / inputs.k.dims[1]);
    [
        inputs.q.view().head(b, h).expect("in range"),
        inputs.k.view().head(b, kv).expect("in range"),
        inputs.v.view().head(b, kv).expect("in range"),
    ]
}

fn reference_head(
    q: MatRef<'_, f32>,
    k: MatRef<'_, f32>,
    v: MatRef<'_, f32>,
    o: &Options<'_>,
) -> Materialized {
    Attention::head(q, k, v, o)
        .and_then(|call| call.materialized())
        .expect("generated inputs are valid")
}

/// Runs [`per_head_masks_once`] for the case's broadcast axes and three others (the
/// recipe's subset with the batch and query axes flipped, the head and key axes, and all
/// four): every subset of the four axes turns up in a few cases.
pub(crate) fn per_head_masks(engine: &dyn Engine, case: Mask4Case) -> Check {
    for flip in [
        [false; 4],
        [true, false, true, false],
        [false, true, false, true],
        [true; 4],
    ] {
        let mut c = case.clone();
        for (b, f) in c.mask.broadcast.iter_mut().zip(flip) {
            *b ^= f;
        }
        per_head_masks_once(engine, &c)?;
    }
    Ok(())
}

fn per_head_masks_once(engine: &dyn Engine, case: &Mask4Case) -> Check {
    let built = Built4::of(case, engine);
    let opts = built.options();
    let x = &built.inputs;
    let out =
        required(Call::batched(x.q.view(), x.k.view(), x.v.view(), &opts).forward_batch(engine))
            .map(|(t, _)| t)
            .map_err(|e| engine_err("batched call with 4-D masks", e))?;
    let [batch, h_q, _, _] = x.q.dims;
    for b in 0..batch {
        for h in 0..h_q {
            let (bits, bias) = built.head_masks(b, h);
            let slot = HeadSlot::new(&opts, b, h, h_q);
            let single = slot.apply(head_options(&opts, b, &bits, &bias));
            let [q, k, v] = heads(x, b, h);
            let r = reference_head(q, k, v, &single);
            let bd = head_bound_with(
                &engine.error_model(),
                q,
                k,
                v,
                scale_of(&single, q.ncols()),
                single.additive_mask,
                &x.score_mods(b, h),
                &r,
                0,
            );
            let o = out.as_ref().head(b, h).map_err(|e| fail(e.to_string()))?;
            compare_head(
                &format!("4-D masks, batch entry {b}, query head {h}"),
                o,
                None,
                &r,
                &bd,
                &all_rows,
            )
            .map_err(fail)?;
        }
    }
    Ok(())
}

fn bits_of(t: &Tensor4<f32>) -> Vec<u32> {
    t.as_slice().iter().map(|x| x.to_bits()).collect()
}

/// A batched case with its own `[n_q, n_k]` masks, and whether the 4-D view of them
/// broadcasts by strides of 0 (`true`) or by lengths of 1.
pub(crate) fn shared_case(shapes: &Shapes) -> BoxedStrategy<(BatchCase, bool)> {
    (batch_case(shapes), any::<bool>()).boxed()
}

pub(crate) fn broadcast_is_shared(
    engine: &dyn Engine,
    (case, zero_stride): (BatchCase, bool),
) -> Check {
    let x = case.build(engine.storage());
    let [batch, h_q, n_q, _] = x.q.dims;
    let n_k = x.k.dims[2];
    // The masks row-major, viewed both ways over the same buffer.
    let bits: Option<(bool, Vec<bool>)> = x.masks.bool_mask.as_ref().map(|(allow, m)| {
        (
            *allow,
            (0..n_q * n_k).map(|e| m[(e / n_k, e % n_k)]).collect(),
        )
    });
    let bias: Option<Vec<f32>> = x
        .masks
        .additive
        .as_ref()
        .map(|m| (0..n_q * n_k).map(|e| m[(e / n_k, e % n_k)]).collect());
    let dims = if zero_stride {
        [batch, h_q, n_q, n_k]
    } else {
        [1, 1, n_q, n_k]
    };
    fn view<T>(d: &[T], dims: [usize; 4], n_k: usize) -> Mask4Ref<'_, T> {
        Mask4Ref::new(d, dims, [0, 0, n_k, 1]).expect("fits")
    }
    let base = x.options();
    let mut two = base;
    let mut four = base;
    two.bool_mask = None;
    two.additive_mask = None;
    four.bool_mask = None;
    four.additive_mask = None;
    if let Some((allow, b)) = &bits {
        let m = MatRef::from_row_major_slice(b, n_q, n_k);
        two.bool_mask = Some(if *allow {
            BoolMask::allow(m)
        } else {
            BoolMask::block(m)
        });
        let v = view(b, dims, n_k);
        four.bool_mask_4d = Some(if *allow {
            BoolMask4::allow(v)
        } else {
            BoolMask4::block(v)
        });
    }
    if let Some(a) = &bias {
        two.additive_mask = Some(MatRef::from_row_major_slice(a, n_q, n_k));
        four.additive_mask_4d = Some(view(a, dims, n_k));
    }
    let run = |o: &Options<'_>| {
        required(Call::batched(x.q.view(), x.k.view(), x.v.view(), o).forward_batch(engine))
            .map(|(t, _)| t)
            .map_err(|e| engine_err("batched call", e))
    };
    let (o2, o4) = (run(&two)?, run(&four)?);
    if bits_of(&o2) != bits_of(&o4) {
        return Err(fail(
            "a [B, H, n_q, n_k] mask broadcast from [n_q, n_k] gave other output bits than the [n_q, n_k] mask",
        ));
    }
    if base.has_modifiers() && !BACKWARD_MODIFIERS {
        return Ok(()); // the backward passes reject modifiers for now
    }
    // The backward pass, on the reference's forward (any consistent O and LSE will do).
    let (out, lse) = Attention::batched(x.q.view(), x.k.view(), x.v.view(), &two)
        .and_then(|call| call.forward())
        .map(|f| f.into_parts())
        .expect("generated inputs are valid");
    let grads = |o: &Options<'_>| {
        Call::batched(x.q.view(), x.k.view(), x.v.view(), o)
            .backward_batch(engine, out.as_ref(), out.as_ref(), &lse)
            .map(|g| g.map_err(|e| engine_err("batched backward call", e)))
    };
    if let (Some(g2), Some(g4)) = (grads(&two), grads(&four)) {
        let (g2, g4) = (g2?, g4?);
        for (name, a, b) in [
            ("dQ", &g2.dq, &g4.dq),
            ("dK", &g2.dk, &g4.dk),
            ("dV", &g2.dv, &g4.dv),
        ] {
            if bits_of(a) != bits_of(b) {
                return Err(fail(format!(
                    "{name}: a [B, H, n_q, n_k] mask broadcast from [n_q, n_k] gave other gradient bits than the [n_q, n_k] mask"
                )));
            }
        }
    }
    Ok(())
}

/// Whether the case's additive mask (if any) is the same for every batch entry and head.
fn shared_additive(case: &Mask4Case) -> bool {
    case.mask.neg_inf_percent.is_none() || (case.mask.broadcast[0] && case.mask.broadcast[1])
}

/// A 4-D mask case for the backward pass, lengths up to the backward's batched shapes. An
/// additive mask that differs between heads comes without grouped-query heads: the bound
/// of a kv head's gradients over a group takes one additive mask, and with groups of one
/// each head's own bound ([`head_backward_bound`]) is the kv head's.
pub(crate) fn mask4_grad_case(shapes: &Shapes) -> BoxedStrategy<(Mask4Case, u64)> {
    (mask4_case(shapes), any::<u64>())
        .prop_map(|(mut c, seed)| {
            c.batch = batch_for_backward(c.batch);
            if !shared_additive(&c) {
                c.batch.group = 1;
            }
            (c, seed)
        })
        .boxed()
}

pub(crate) fn per_head_mask_gradients(
    engine: &dyn Engine,
    (case, seed): (Mask4Case, u64),
) -> Check {
    let built = Built4::of(&case, engine);
    let opts = built.options();
    let x = &built.inputs;
    let [batch, h_q, n_q, d_k] = x.q.dims;
    let (h_kv, d_v) = (x.k.dims[1], x.v.dims[3]);
    let mut rng = Rng::new(seed, 42);
    let dtype = engine.storage();
    let grad_out = OwnedTensor::new(TensorLayout::Bhsd, [batch, h_q, n_q, d_v], || {
        dtype.round((rng.unit() * 2.0 - 1.0) as f32)
    });
    // The engine's own forward, head by head with the explicit masks (the batched API
    // returns no LSE).
    let mut out = Tensor4::<f32>::zeros([batch, h_q, n_q, d_v]);
    let mut lse = Vec::with_capacity(batch * h_q * n_q);
    for b in 0..batch {
        for h in 0..h_q {
            let (bits, bias) = built.head_masks(b, h);
            let single = head_options(&opts, b, &bits, &bias);
            let [q, k, v] = heads(x, b, h);
            let (o, l) = required(Call::head(q, k, v, &single).forward_head(engine))
                .map_err(|e| engine_err("single-head call", e))?;
            out.as_mut()
                .head_mut(b, h)
                .map_err(|e| fail(e.to_string()))?
                .copy_from(&o);
            lse.extend(l);
        }
    }
    let reference = Attention::batched(x.q.view(), x.k.view(), x.v.view(), &opts)
        .and_then(|call| call.backward_materialized(grad_out.view()))
        .expect("generated inputs are valid");
    let scale = scale_of(&opts, d_k);
    let bound = if shared_additive(&case) {
        // Head (0, 0)'s additive mask is every head's.
        let (_, shared_bias) = built.head_masks(0, 0);
        batch_backward_bound(
            &engine.error_model(),
            x.q.view(),
            x.k.view(),
            x.v.view(),
            grad_out.view(),
            scale,
            shared_bias.as_ref().map(|m| m.as_ref()),
            &reference,
        )
    } else {
        // Groups of one (see `mask4_grad_case`): each head's own bound, with its own mask.
        let mut bound = BatchGradientBound {
            dq: vec![],
            dk: vec![],
            dv: vec![],
            forward: vec![],
        };
        for (b, per_head) in reference.iter().enumerate() {
            let (mut dq, mut dk, mut dv, mut fw) = (vec![], vec![], vec![], vec![]);
            for (h, r) in per_head.iter().enumerate() {
                let (_, bias) = built.head_masks(b, h);
                let [q, k, v] = heads(x, b, h);
                let go = grad_out
                    .view()
                    .head(b, h)
                    .map_err(|e| fail(e.to_string()))?;
                let bias = bias.as_ref().map(|m| m.as_ref());
                let g = head_backward_bound(&engine.error_model(), q, k, v, go, scale, bias, r);
                dq.push(g.dq);
                dk.push(g.dk);
                dv.push(g.dv);
                fw.push(g.forward);
            }
            bound.dq.push(dq);
            bound.dk.push(dk);
            bound.dv.push(dv);
            bound.forward.push(fw);
        }
        bound
    };
    let Some(g) = Call::batched(x.q.view(), x.k.view(), x.v.view(), &opts).backward_batch(
        engine,
        grad_out.view(),
        out.as_ref(),
        &lse,
    ) else {
        return Err(fail(
            "the engine stopped supporting the batched backward pass",
        ));
    };
    let g = g.map_err(|e| engine_err("batched backward call with 4-D masks", e))?;
    for (b, per_head) in reference.iter().enumerate() {
        for (h, r) in per_head.iter().enumerate() {
            let at = (b * h_q + h) * n_q;
            compare_head(
                &format!("4-D masks, batch entry {b}, query head {h}: the forward given to the backward pass"),
                out.as_ref().head(b, h).map_err(|e| fail(e.to_string()))?,
                Some(&lse[at..at + n_q]),
                &r.forward,
                &bound.forward[b][h],
                &all_rows,
            )
            .map_err(fail)?;
        }
    }
    compare_batched_gradients("4-D mask gradients", &g, &reference, &bound, h_kv)
}

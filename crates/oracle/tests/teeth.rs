//! The suite has teeth: a small streaming f32 engine (forward and backward) passes every
//! property, and each of the classic kernel bugs planted in it is caught by the properties
//! that should catch it. Run with `--nocapture` to see each failure and its shrunk input.

use attn_core::{
    Forward, HeadMask, HeadModifiers, Options, Result, ScoreTile, Tensor4, Tensor4Ref,
    validate_batch, validate_batch_backward, validate_head, validate_head_backward,
};
use attn_oracle::{
    BatchGradients, CacheShape, Call, Compute, Dtype, Engine, ErrorModel, Failure, Gradients,
    Grads, Operands, Output, PagedCache, Property, ReferenceEngine, Saved, SuiteConfig, View,
};
use faer::{Mat, MatRef};

/// A bug planted in the toy engine.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Bug {
    None,
    /// The online softmax forgets `α = exp(m_old − m_new)` when the maximum moves.
    SkipRescale,
    /// The causal diagonal is one key too far (`j ≤ i + offset + 1`).
    CausalOffByOne,
    /// The softmax normalises along the query axis.
    WrongAxis,
    /// A row with no visible key computes `0 / 0` and `-inf − -inf`.
    NoEmptyRowGuard,
    /// Hidden keys are multiplied by 0 instead of skipped.
    ZeroTimesHiddenV,
    /// The exponentials are not shifted by the running maximum.
    NoMaxSubtraction,
    /// Backward: `dS = P ∘ dP`, without the `− D` term.
    MissingD,
    /// Backward: dK computed from `dS` transposed (`dS_ji` for `dS_ij` where both exist).
    TransposedDs,
    /// Backward: dQ and dK not multiplied by the scale.
    ForgottenScale,
    /// Backward: `P` recomputed for every key, the causal, window, padding and boolean
    /// masks skipped (the forward and its LSE are right).
    MaskSkippedInRecompute,
    /// Backward: the dK and dV of a GQA group summed per thread in scheduling order (head
    /// `g` of the group into thread `g mod t`'s partial sum, partials then added), so
    /// that the bits depend on the thread count.
    GroupSumInThreadOrder,
    /// Batched: every query head reads the `[B, H, n_q, n_k]` masks of head 0.
    FirstHeadMask,
    /// The sink logit is left out of the softmax's denominator.
    IgnoreSink,
    /// ALiBi distances are always aligned top-left (`|i − j|`), whatever the alignment.
    AlibiTopLeft,
    /// The user's mask is asked about each block of 4 × 4 entries, and a block it calls
    /// hidden is computed anyway (asked entry by entry), not skipped.
    UnskippedUserBlocks,
    /// Dropout keeps weights without scaling them by `1/(1 − p)`.
    DropoutUnscaled,
    /// Dropout draws every head's mask as head 0's.
    DropoutFirstHead,
    /// The backward pass forgets the dropout (the forward applies it).
    DropoutForgottenInBackward,
}

/// Online softmax over key blocks of 4, in f32.
struct Toy(Bug);

/// The single-head options of head `(b, h)` of a batched call: its `[B, H, n_q, n_k]`
/// masks resolved to `[n_q, n_k]` views.
fn head_options<'a>(
    bug: Bug,
    options: &Options<'a>,
    (b, h): (usize, usize),
    n_q: usize,
    n_k: usize,
) -> Result<Options<'a>> {
    let h = if bug == Bug::FirstHeadMask { 0 } else { h };
    let mut single = *options;
    if let Some(m) = options.bool_mask_4d {
        single.bool_mask = Some(m.head(b, h, n_q, n_k)?);
        single.bool_mask_4d = None;
    }
    if let Some(m) = options.additive_mask_4d {
        single.additive_mask = Some(m.head(b, h, n_q, n_k)?);
        single.additive_mask_4d = None;
    }
    Ok(single)
}

const BLOCK: usize = 4;

impl Toy {
    fn visible(
        &self,
        options: &Options<'_>,
        n_q: usize,
        n_k: usize,
        key_len: Option<usize>,
    ) -> Mat<bool> {
        self.visible_at(options, n_q, n_k, key_len, (0, 0))
    }

    /// [`Toy::visible`] for head `at = (b, h)` of a batched call (what a user mask sees).
    fn visible_at(
        &self,
        options: &Options<'_>,
        n_q: usize,
        n_k: usize,
        key_len: Option<usize>,
        at: (usize, usize),
    ) -> Mat<bool> {
        let mask = HeadMask::new(options, n_q, n_k, key_len).at(at.0, at.1);
        if self.0 == Bug::UnskippedUserBlocks {
            for r in (0..n_q).step_by(BLOCK) {
                for c in (0..n_k).step_by(BLOCK) {
                    let _ = mask.user_coverage(r..(r + BLOCK).min(n_q), c..(c + BLOCK).min(n_k));
                }
            }
        }
        match (self.0, options.causal) {
            (Bug::CausalOffByOne, Some(c)) => {
                let relaxed = Options {
                    causal: None,
                    ..*options
                };
                let m = HeadMask::new(&relaxed, n_q, n_k, key_len).at(at.0, at.1);
                let off = c.offset(n_q, n_k);
                Mat::from_fn(n_q, n_k, |i, j| {
                    m.allows(i, j) && (j as i64) <= i as i64 + off + 1
                })
            }
            _ => Mat::from_fn(n_q, n_k, |i, j| mask.allows(i, j)),
        }
    }

    /// The modifiers of head `(b, h)` of `h_q`, as the toy (maybe wrongly) applies them.
    fn modifiers<'a>(
        &self,
        options: &Options<'a>,
        (b, h, h_q): (usize, usize, usize),
        n_q: usize,
        n_k: usize,
    ) -> HeadModifiers<'a> {
        let mut mods = options.head_modifiers(b, h, h_q, n_q, n_k);
        if self.0 == Bug::AlibiTopLeft {
            mods.alibi = mods.alibi.map(|(slope, _)| (slope, 0));
        }
        if self.0 == Bug::IgnoreSink {
            mods.sink = None;
        }
        if self.0 == Bug::DropoutFirstHead {
            mods.dropout = options.head_dropout(0, 0, h_q);
        }
        if let (Bug::DropoutUnscaled, Some(d)) = (self.0, &mut mods.dropout) {
            d.scale = 1.0;
        }
        mods
    }

    /// One head; `at = (b, h, h_q)` places it in a batched call (`(0, 0, 1)` alone).
    fn head(
        &self,
        q: MatRef<'_, f32>,
        k: MatRef<'_, f32>,
        v: MatRef<'_, f32>,
        options: &Options<'_>,
        key_len: Option<usize>,
        at: (usize, usize, usize),
    ) -> Result<(Mat<f32>, Vec<f32>)> {
        let (n_q, n_k, d_k, d_v) = (q.nrows(), k.nrows(), q.ncols(), v.ncols());
        let scale = options.scale_for(d_k)?;
        let visible = self.visible_at(options, n_q, n_k, key_len, (at.0, at.1));
        let mods = self.modifiers(options, at, n_q, n_k);
        let bias = |i: usize, j: usize| options.additive_mask.map_or(0.0, |m| m[(i, j)]);
        let score = |i: usize, j: usize| {
            if bias(i, j) == f32::NEG_INFINITY {
                return f32::NEG_INFINITY; // hidden: nothing about the key is computed
            }
            let dot: f32 = (0..d_k).map(|t| q[(i, t)] * k[(j, t)]).sum();
            // The modifiers in natural units, one score at a time, before the bias.
            let mut s = [scale * dot];
            if let Ok(mut tile) = ScoreTile::new(&mut s, (1, 1), i..i + 1, j..j + 1, at.0, at.1) {
                mods.modify(&mut tile);
            }
            s[0] + bias(i, j)
        };
        let mut out = Mat::<f32>::zeros(n_q, d_v);
        let mut lse = vec![f32::NEG_INFINITY; n_q];
        if self.0 == Bug::WrongAxis {
            // Softmax down each column (over queries) instead of along each row.
            let s = Mat::from_fn(n_q, n_k, |i, j| {
                if visible[(i, j)] {
                    score(i, j)
                } else {
                    f32::NEG_INFINITY
                }
            });
            for j in 0..n_k {
                let m = (0..n_q)
                    .map(|i| s[(i, j)])
                    .fold(f32::NEG_INFINITY, f32::max);
                if m == f32::NEG_INFINITY {
                    continue;
                }
                let l: f32 = (0..n_q).map(|i| (s[(i, j)] - m).exp()).sum();
                for i in 0..n_q {
                    let a = (s[(i, j)] - m).exp() / l;
                    if s[(i, j)] != f32::NEG_INFINITY {
                        for c in 0..d_v {
                            out[(i, c)] += a * v[(j, c)];
                        }
                    }
                }
            }
            return Ok((out, lse));
        }
        for i in 0..n_q {
            let (mut m, mut l) = (f32::NEG_INFINITY, 0.0f32);
            let mut acc = vec![0.0f32; d_v];
            for start in (0..n_k).step_by(BLOCK) {
                let keys = start..(start + BLOCK).min(n_k);
                let s: Vec<f32> = keys
                    .clone()
                    .map(|j| {
                        if visible[(i, j)] {
                            score(i, j)
                        } else {
                            f32::NEG_INFINITY
                        }
                    })
                    .collect();
                let m_new = s.iter().copied().fold(m, f32::max);
                if m_new == f32::NEG_INFINITY && self.0 != Bug::NoEmptyRowGuard {
                    continue; // nothing visible yet: no -inf − -inf
                }
                let alpha = if self.0 == Bug::SkipRescale {
                    1.0
                } else {
                    (m - m_new).exp()
                };
                let shift = if self.0 == Bug::NoMaxSubtraction {
                    0.0
                } else {
                    m_new
                };
                l *= alpha;
                acc.iter_mut().for_each(|a| *a *= alpha);
                for (j, &sj) in keys.zip(&s) {
                    if sj == f32::NEG_INFINITY && self.0 != Bug::ZeroTimesHiddenV {
                        continue; // a hidden key contributes nothing
                    }
                    let p = (sj - shift).exp();
                    l += p;
                    // Dropout after the softmax: the sum keeps the weight.
                    let z = mods.dropout.map_or(1.0, |d| d.factor(i, j));
                    if z == 0.0 {
                        continue;
                    }
                    for (c, a) in acc.iter_mut().enumerate() {
                        *a += p * z * v[(j, c)];
                    }
                }
                m = m_new;
            }
            if let Some(sink) = mods.sink {
                // The sink joins the denominator without a value; alone, it is the LSE.
                if l == 0.0 {
                    lse[i] = sink;
                    continue;
                }
                let top = m.max(sink);
                let alpha = (m - top).exp();
                l = l * alpha + (sink - top).exp();
                acc.iter_mut().for_each(|a| *a *= alpha);
                m = top;
            }
            if l == 0.0 && self.0 != Bug::NoEmptyRowGuard {
                continue;
            }
            let m_used = if self.0 == Bug::NoMaxSubtraction {
                0.0
            } else {
                m
            };
            lse[i] = m_used + l.ln();
            for (c, a) in acc.iter().enumerate() {
                out[(i, c)] = a / l;
            }
        }
        Ok((out, lse))
    }
}

impl Toy {
    /// The backward pass, literally: `P` recomputed from the LSE key block by key block,
    /// `D` from the stored output, `dS` materialised, then dQ and dK from it, in f32.
    #[allow(clippy::too_many_arguments)]
    fn head_backward(
        &self,
        grad_out: MatRef<'_, f32>,
        q: MatRef<'_, f32>,
        k: MatRef<'_, f32>,
        v: MatRef<'_, f32>,
        out: MatRef<'_, f32>,
        lse: &[f32],
        options: &Options<'_>,
        key_len: Option<usize>,
        at: (usize, usize, usize),
    ) -> Result<Gradients> {
        let (n_q, n_k, d_k, d_v) = (q.nrows(), k.nrows(), q.ncols(), v.ncols());
        let scale = options.scale_for(d_k)?;
        let dropout = self
            .modifiers(options, at, n_q, n_k)
            .dropout
            .filter(|_| self.0 != Bug::DropoutForgottenInBackward);
        let visible = if self.0 == Bug::MaskSkippedInRecompute {
            Mat::from_fn(n_q, n_k, |_, _| true)
        } else {
            self.visible(options, n_q, n_k, key_len)
        };
        let bias = |i: usize, j: usize| options.additive_mask.map_or(0.0, |m| m[(i, j)]);
        let d: Vec<f32> = (0..n_q)
            .map(|i| {
                if self.0 == Bug::MissingD {
                    0.0
                } else {
                    (0..d_v).map(|c| grad_out[(i, c)] * out[(i, c)]).sum()
                }
            })
            .collect();
        // dS_ij for the (i, j) computed; a hidden key is skipped, never multiplied by 0.
        let mut ds = Mat::<f32>::zeros(n_q, n_k);
        let mut seen = Mat::<bool>::from_fn(n_q, n_k, |_, _| false);
        let mut dv = Mat::<f32>::zeros(n_k, d_v);
        for i in 0..n_q {
            if lse[i] == f32::NEG_INFINITY {
                continue; // sees no key
            }
            for start in (0..n_k).step_by(BLOCK) {
                for j in start..(start + BLOCK).min(n_k) {
                    if !visible[(i, j)] || bias(i, j) == f32::NEG_INFINITY {
                        continue;
                    }
                    let dot: f32 = (0..d_k).map(|t| q[(i, t)] * k[(j, t)]).sum();
                    let p = (scale * dot + bias(i, j) - lse[i]).exp();
                    let z = dropout.map_or(1.0, |d| d.factor(i, j));
                    for c in (0..d_v).filter(|_| z != 0.0) {
                        dv[(j, c)] += p * z * grad_out[(i, c)];
                    }
                    let dp: f32 = (0..d_v).map(|c| grad_out[(i, c)] * v[(j, c)]).sum();
                    let dp = if z == 0.0 { 0.0 } else { z * dp };
                    ds[(i, j)] = p * (dp - d[i]);
                    seen[(i, j)] = true;
                }
            }
        }
        let s = if self.0 == Bug::ForgottenScale {
            1.0
        } else {
            scale
        };
        let mut dq = Mat::<f32>::zeros(n_q, d_k);
        let mut dk = Mat::<f32>::zeros(n_k, d_k);
        for i in 0..n_q {
            for j in (0..n_k).filter(|&j| seen[(i, j)]) {
                let ds_k = if self.0 == Bug::TransposedDs {
                    if j < n_q && i < n_k { ds[(j, i)] } else { 0.0 }
                } else {
                    ds[(i, j)]
                };
                for c in 0..d_k {
                    dq[(i, c)] += s * ds[(i, j)] * k[(j, c)];
                    dk[(j, c)] += s * ds_k * q[(i, c)];
                }
            }
        }
        Ok(Gradients::new(dq, dk, dv))
    }

    /// The sum over a group's heads of their dK (or dV), in head order, or, with
    /// [`Bug::GroupSumInThreadOrder`], per thread of the current rayon pool.
    fn group_sum(&self, parts: &[&Mat<f32>]) -> Mat<f32> {
        let (rows, cols) = (parts[0].nrows(), parts[0].ncols());
        let add = |acc: &mut Mat<f32>, m: &Mat<f32>| {
            for j in 0..rows {
                for c in 0..cols {
                    acc[(j, c)] += m[(j, c)];
                }
            }
        };
        let threads = if self.0 == Bug::GroupSumInThreadOrder {
            rayon::current_num_threads().max(1)
        } else {
            1
        };
        let mut partials = vec![Mat::<f32>::zeros(rows, cols); threads];
        for (g, m) in parts.iter().enumerate() {
            add(&mut partials[g % threads], m);
        }
        let mut sum = Mat::<f32>::zeros(rows, cols);
        for p in &partials {
            add(&mut sum, p);
        }
        sum
    }
}

impl Engine for Toy {
    fn name(&self) -> String {
        format!("toy-{:?}", self.0)
    }

    fn error_model(&self) -> ErrorModel {
        ErrorModel {
            compute: Compute::F32 {
                exp_ulps: 1.0,
                split_keys: None,
                weights: None,
                split_operands: false,
            },
            output: Dtype::F32,
        }
    }

    fn tile_lengths(&self) -> Vec<usize> {
        vec![BLOCK, 16, 64]
    }

    // Built-ins and user modifiers go through the same f32 functions, score by score, and
    // a user mask is asked about every entry, as the structural masks are.
    fn user_score_mod_bits_match_builtins(&self) -> bool {
        true
    }

    fn user_mask_mod_bits_match_structural(&self, _: usize, _: usize) -> bool {
        true
    }

    fn forward(&self, call: &Call<'_>) -> Option<Result<Output>> {
        let options = &call.options;
        match (call.operands, call.plan) {
            (Operands::Head([q, k, v]), None) => Some(self.forward_head(q, k, v, options)),
            (Operands::Batched([q, k, v]), _) => Some(self.forward_batched(q, k, v, options)),
            _ => None, // no partial states, no packed mode
        }
    }

    fn backward(&self, d_out: View<'_>, call: &Call<'_>, fwd: Saved<'_>) -> Option<Result<Grads>> {
        let (options, lse) = (&call.options, fwd.lse);
        match (call.operands, d_out, fwd.output) {
            (Operands::Head([q, k, v]), View::Head(grad_out), View::Head(out)) => {
                let run = || {
                    validate_head_backward(q, k, v, grad_out, out, lse.len(), options)?;
                    let key_length = options.key_length(0);
                    let at = (0, 0, 1);
                    self.head_backward(grad_out, q, k, v, out, lse, options, key_length, at)
                };
                Some(run().map(Grads::Head))
            }
            (Operands::Batched([q, k, v]), View::Batch(grad_out), View::Batch(out)) => Some(
                self.backward_batched(grad_out, q, k, v, out, lse, options)
                    .map(Grads::Batch),
            ),
            _ => None,
        }
    }
}

impl Toy {
    fn forward_head(
        &self,
        q: MatRef<'_, f32>,
        k: MatRef<'_, f32>,
        v: MatRef<'_, f32>,
        options: &Options<'_>,
    ) -> Result<Output> {
        validate_head(q, k, v, options)?;
        let (o, lse) = self.head(q, k, v, options, options.key_length(0), (0, 0, 1))?;
        Forward::head(o, lse).map(Output::Head)
    }

    fn forward_batched(
        &self,
        q: Tensor4Ref<'_, f32>,
        k: Tensor4Ref<'_, f32>,
        v: Tensor4Ref<'_, f32>,
        options: &Options<'_>,
    ) -> Result<Output> {
        let shape = validate_batch(q, k, v, options)?;
        let mut out = Tensor4::zeros([shape.batch, shape.h_q, shape.head.n_q, shape.head.d_v]);
        let mut lse = Vec::with_capacity(shape.batch * shape.h_q * shape.head.n_q);
        for b in 0..shape.batch {
            for h in 0..shape.h_q {
                let kv = shape.kv_head(h);
                let (n_q, n_k) = (shape.head.n_q, shape.head.n_k);
                let single = head_options(self.0, options, (b, h), n_q, n_k)?;
                let (o, l) = self.head(
                    q.head(b, h)?,
                    k.head(b, kv)?,
                    v.head(b, kv)?,
                    &single,
                    options.key_length(b),
                    (b, h, shape.h_q),
                )?;
                let mut view = out.as_mut();
                view.head_mut(b, h)?.copy_from(&o);
                lse.extend(l);
            }
        }
        Forward::batch(out, lse).map(Output::Batch)
    }

    #[allow(clippy::too_many_arguments)]
    fn backward_batched(
        &self,
        grad_out: Tensor4Ref<'_, f32>,
        q: Tensor4Ref<'_, f32>,
        k: Tensor4Ref<'_, f32>,
        v: Tensor4Ref<'_, f32>,
        out: Tensor4Ref<'_, f32>,
        lse: &[f32],
        options: &Options<'_>,
    ) -> Result<BatchGradients> {
        let (shape, _) = validate_batch_backward(q, k, v, grad_out, out, lse.len(), options)?;
        let (n_q, n_k) = (shape.head.n_q, shape.head.n_k);
        let (d_k, d_v) = (shape.head.d_k, shape.head.d_v);
        let mut dq = Tensor4::zeros([shape.batch, shape.h_q, n_q, d_k]);
        let mut dk = Tensor4::zeros([shape.batch, shape.h_kv, n_k, d_k]);
        let mut dv = Tensor4::zeros([shape.batch, shape.h_kv, n_k, d_v]);
        for b in 0..shape.batch {
            let mut heads = Vec::with_capacity(shape.h_q);
            for h in 0..shape.h_q {
                let kv = shape.kv_head(h);
                let at = (b * shape.h_q + h) * n_q;
                let single = head_options(self.0, options, (b, h), n_q, n_k)?;
                let g = self.head_backward(
                    grad_out.head(b, h)?,
                    q.head(b, h)?,
                    k.head(b, kv)?,
                    v.head(b, kv)?,
                    out.head(b, h)?,
                    &lse[at..at + n_q],
                    &single,
                    options.key_length(b),
                    (b, h, shape.h_q),
                )?;
                dq.as_mut().head_mut(b, h)?.copy_from(&g.dq);
                heads.push(g);
            }
            for kv in 0..shape.h_kv {
                let group: Vec<&Gradients> = (0..shape.h_q)
                    .filter(|&h| shape.kv_head(h) == kv)
                    .map(|h| &heads[h])
                    .collect();
                let sk = self.group_sum(&group.iter().map(|g| &g.dk).collect::<Vec<_>>());
                let sv = self.group_sum(&group.iter().map(|g| &g.dv).collect::<Vec<_>>());
                dk.as_mut().head_mut(b, kv)?.copy_from(&sk);
                dv.as_mut().head_mut(b, kv)?.copy_from(&sv);
            }
        }
        Ok(BatchGradients::new(dq, dk, dv))
    }
}

impl Bug {
    /// Whether the bug is in the backward pass (the forward is then right).
    fn in_backward(self) -> bool {
        matches!(
            self,
            Bug::MissingD
                | Bug::TransposedDs
                | Bug::ForgottenScale
                | Bug::MaskSkippedInRecompute
                | Bug::GroupSumInThreadOrder
                | Bug::DropoutFirstHead
                | Bug::DropoutForgottenInBackward
        )
    }
}

/// The properties against the toy with `bug` (96 cases each, 48 for the backward ones,
/// whose f64 reference is costlier; a forward bug is run against the forward properties
/// only); returns the failures.
fn failures(bug: Bug) -> Vec<Failure> {
    let (forward, backward) = (SuiteConfig::quick(96), SuiteConfig::quick(48));
    Property::ALL
        .iter()
        .filter(|p| bug == Bug::None || bug.in_backward() || !p.is_backward())
        .filter_map(|&p| {
            let config = if p.is_backward() { &backward } else { &forward };
            attn_oracle::check_property(&Toy(bug), p, config).err()
        })
        .collect()
}

/// Asserts that the planted `bug`'s failures `found` include every property `expected`.
fn caught(bug: &dyn std::fmt::Debug, found: &[Failure], expected: &[Property]) {
    for f in found {
        eprintln!("--- {f}\n");
    }
    let names: Vec<Property> = found.iter().map(|f| f.property).collect();
    eprintln!("{bug:?} is caught by {names:?}");
    for p in expected {
        assert!(
            names.contains(p),
            "{bug:?} should fail {p} but only fails {names:?}"
        );
    }
}

/// Asserts that an engine without a planted bug fails nothing.
fn none_failed(found: &[Failure]) {
    assert!(
        found.is_empty(),
        "{}",
        found
            .iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
            .join("\n")
    );
}

fn caught_by(bug: Bug, expected: &[Property]) {
    caught(&bug, &failures(bug), expected);
}

#[test]
fn toy_engine_without_bugs_passes_every_property() {
    none_failed(&failures(Bug::None));
}

/// One test per planted bug: it must fail at least the properties listed.
macro_rules! caught {
    ($($test:ident: $bug:ident => [$($property:ident),+];)*) => {
        $(
            #[test]
            fn $test() {
                caught_by(Bug::$bug, &[$(Property::$property),+]);
            }
        )*
    };
}

caught! {
    skipped_rescale_is_caught: SkipRescale => [Equivalence, BatchedEquivalence];
    causal_off_by_one_is_caught: CausalOffByOne => [MaskedWeightsAreZero, Equivalence];
    softmax_along_the_wrong_axis_is_caught: WrongAxis => [RowsSumToOne, Equivalence];
    missing_empty_row_guard_is_caught: NoEmptyRowGuard => [FullyMaskedRows];
    zero_times_hidden_value_is_caught: ZeroTimesHiddenV => [HiddenKeysNeverLeak];
    missing_max_subtraction_is_caught: NoMaxSubtraction => [Adversarial, RowShift];
    missing_d_term_is_caught: MissingD =>
        [BackwardEquivalence, BatchedBackwardEquivalence, ScoreGradientRowsSumToZero];
    transposed_score_gradient_is_caught: TransposedDs =>
        [BackwardEquivalence, BatchedBackwardEquivalence];
    forgotten_scale_in_the_backward_is_caught: ForgottenScale =>
        [BackwardEquivalence, BatchedBackwardEquivalence];
    mask_skipped_in_the_recompute_is_caught: MaskSkippedInRecompute =>
        [BackwardEquivalence, BackwardHiddenKeys];
    masks_of_the_wrong_head_are_caught: FirstHeadMask => [PerHeadMasks];
    an_ignored_sink_is_caught: IgnoreSink => [SinkTakesItsShare, Equivalence, RowsSumToOne];
    unskipped_hidden_user_blocks_are_caught: UnskippedUserBlocks => [UserCausalMaskIsTopLeft];
    group_sum_in_thread_order_is_caught: GroupSumInThreadOrder => [BackwardDeterminism];
    unscaled_dropout_is_caught: DropoutUnscaled =>
        [DropoutMatchesReference, DropoutMeanIsUndropped, DropoutKeepRate];
    dropout_of_the_wrong_head_is_caught: DropoutFirstHead =>
        [DropoutMatchesReference, DropoutGradientsMatchReference];
    dropout_forgotten_in_the_backward_is_caught: DropoutForgottenInBackward =>
        [DropoutGradientsMatchReference];
}

/// Fails unless at least one of `any` catches `bug`: for bugs that only cases of some
/// shapes reveal (ALiBi's alignment matters only where `n_q ≠ n_k`), which a property's
/// random cases may miss in one run while another property's catch it.
fn caught_by_any(bug: Bug, any: &[Property]) {
    let names: Vec<Property> = failures(bug).iter().map(|f| f.property).collect();
    eprintln!("{bug:?} is caught by {names:?}");
    assert!(
        any.iter().any(|p| names.contains(p)),
        "{bug:?} should fail one of {any:?} but only fails {names:?}"
    );
}

#[test]
fn alibi_aligned_top_left_is_caught() {
    caught_by_any(
        Bug::AlibiTopLeft,
        &[
            Property::Equivalence,
            Property::BatchedEquivalence,
            Property::HeadsAreIndependent,
            Property::RowShift,
        ],
    );
}

// ---------------------------------------------------------------------------------------
// Paged attention: the reference's paged calls and cache, with a bug planted around them.

/// A bug planted around the reference's paged call or cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum PagedBug {
    None,
    /// The first sequence's last page is read from the next page of the pool (another
    /// sequence's, or an unused one full of NaN).
    WrongPage,
    /// A decoding sequence's second query head is one ulp off: within every bound, but not
    /// what the packed call computes.
    UlpOffWhenDecoding,
    /// Element-wise masks and key padding are dropped instead of refused.
    IgnoresMasks,
    /// The cache attends a sequence with the tokens of the sequence made before it (when
    /// that one is live and long enough).
    ReadsTheNeighbour,
    /// Freeing a sequence kills its handle but returns none of its pages.
    FreeLeaksPages,
    /// An append that runs out of pages writes its first token before it fails.
    PartialAppend,
}

/// The reference engine with a [`PagedBug`]; its bound is an f32 engine's, so that a bug of
/// one ulp stays within it.
struct PagedToy(PagedBug);

impl Engine for PagedToy {
    fn name(&self) -> String {
        format!("paged-toy-{:?}", self.0)
    }

    fn error_model(&self) -> ErrorModel {
        ErrorModel::f32_streaming(2.0, None)
    }

    fn paged_bits_match_packed(&self, _: &Call<'_>) -> bool {
        true
    }

    fn paged_bits_ignore_placement(&self, _: usize, _: &Options<'_>) -> bool {
        true
    }

    fn forward(&self, call: &Call<'_>) -> Option<Result<Output>> {
        let Operands::Paged(q, cu_q, kv) = call.operands else {
            return ReferenceEngine.forward(call);
        };
        let mut options = call.options;
        if self.0 == PagedBug::IgnoresMasks {
            options.bool_mask = None;
            options.additive_mask = None;
            options.bool_mask_4d = None;
            options.additive_mask_4d = None;
            options.key_padding = None;
        }
        // The block table, a row per sequence, maybe with the wrong page.
        let width = (0..kv.batch())
            .map(|s| kv.pages(s).len())
            .max()
            .unwrap_or(0);
        let mut table = vec![0u32; kv.batch() * width];
        for s in 0..kv.batch() {
            table[s * width..][..kv.pages(s).len()].copy_from_slice(kv.pages(s));
        }
        let pool = kv.keys().dims()[0] as u32;
        if self.0 == PagedBug::WrongPage && !kv.pages(0).is_empty() && pool > 1 {
            let last = &mut table[kv.pages(0).len() - 1];
            *last = (*last + 1) % pool;
        }
        let run = || {
            let kv = attn_core::PagedKv::new(kv.keys(), kv.values(), &table, kv.lens())?;
            let call = Call::paged(q, cu_q, kv, &options).with_split(call.split);
            let (mut out, lse) = ReferenceEngine
                .forward(&call)
                .expect("it runs")?
                .into_batch()?;
            if self.0 == PagedBug::UlpOffWhenDecoding && out.dims()[1] > 1 {
                for s in 0..kv.batch() {
                    if cu_q[s + 1] - cu_q[s] == 1 && out.dims()[3] > 0 {
                        let mut all = out.as_mut();
                        let mut h1 = all.head_mut(0, 1)?;
                        let x = h1[(cu_q[s], 0)];
                        h1[(cu_q[s], 0)] = f32::from_bits(x.to_bits() ^ 1);
                    }
                }
            }
            Forward::batch(out, lse).map(Output::Batch)
        };
        Some(run())
    }

    fn paged_cache(&self, shape: CacheShape) -> Option<Result<Box<dyn PagedCache>>> {
        let inner = ReferenceEngine.paged_cache(shape)?;
        Some(inner.map(|inner| {
            Box::new(BuggyCache {
                bug: self.0,
                inner,
                dead: Vec::new(),
            }) as Box<dyn PagedCache>
        }))
    }
}

/// The reference's cache with a [`PagedBug`] around it.
struct BuggyCache {
    bug: PagedBug,
    inner: Box<dyn PagedCache>,
    /// Handles freed without their pages ([`PagedBug::FreeLeaksPages`]).
    dead: Vec<usize>,
}

impl BuggyCache {
    fn live(&self, seq: usize) -> Result<usize> {
        if self.dead.contains(&seq) {
            Err(attn_core::Error::out_of_range("live sequence", seq, 0))
        } else {
            Ok(seq)
        }
    }
}

impl PagedCache for BuggyCache {
    fn add_sequence(&mut self) -> Result<usize> {
        self.inner.add_sequence()
    }

    fn append(&mut self, seq: usize, k: Tensor4Ref<'_, f32>, v: Tensor4Ref<'_, f32>) -> Result<()> {
        let seq = self.live(seq)?;
        let r = self.inner.append(seq, k, v);
        if self.bug == PagedBug::PartialAppend && r.is_err() && k.dims()[2] > 1 {
            // The first token alone fits more often than all of them.
            let one = |t: Tensor4Ref<'_, f32>| -> Vec<f32> {
                let [_, h, _, d] = t.dims();
                (0..h)
                    .flat_map(|hh| {
                        let m = t.head(0, hh).expect("in range");
                        (0..d).map(move |c| m[(0, c)])
                    })
                    .collect()
            };
            let (k1, v1) = (one(k), one(v));
            let h = k.dims()[1];
            let view = |x: &[f32], d: usize| -> Tensor4<f32> {
                Tensor4::from_vec(x.to_vec(), [1, h, 1, d]).expect("fits")
            };
            let (k1, v1) = (view(&k1, k.dims()[3]), view(&v1, v.dims()[3]));
            let _ = self.inner.append(seq, k1.as_ref(), v1.as_ref());
        }
        r
    }

    fn fork(&mut self, seq: usize) -> Result<usize> {
        let seq = self.live(seq)?;
        self.inner.fork(seq)
    }

    fn free(&mut self, seq: usize) -> Result<()> {
        let seq = self.live(seq)?;
        if self.bug == PagedBug::FreeLeaksPages {
            self.inner.len(seq)?;
            self.dead.push(seq);
            return Ok(());
        }
        self.inner.free(seq)
    }

    fn len(&self, seq: usize) -> Result<usize> {
        self.inner.len(self.live(seq)?)
    }

    fn pages_of(&self, seq: usize) -> Result<Vec<u32>> {
        self.inner.pages_of(self.live(seq)?)
    }

    fn free_pages(&self) -> usize {
        self.inner.free_pages()
    }

    fn attention(
        &self,
        seqs: &[usize],
        q: Tensor4Ref<'_, f32>,
        cu_seqlens_q: &[usize],
        options: &Options<'_>,
    ) -> Result<(Tensor4<f32>, Vec<f32>)> {
        let mut seqs = seqs
            .iter()
            .map(|&s| self.live(s))
            .collect::<Result<Vec<_>>>()?;
        if self.bug == PagedBug::ReadsTheNeighbour {
            for (i, s) in seqs.iter_mut().enumerate() {
                let n_q = cu_seqlens_q[i + 1] - cu_seqlens_q[i];
                let neighbour = s.checked_sub(1).filter(|&p| {
                    self.live(p).is_ok() && self.inner.len(p).is_ok_and(|n| n >= n_q.max(1))
                });
                *s = neighbour.unwrap_or(*s);
            }
        }
        self.inner.attention(&seqs, q, cu_seqlens_q, options)
    }
}

const PAGED: [Property; 4] = [
    Property::PagedEquivalence,
    Property::PagedIsPacked,
    Property::PagedMalformed,
    Property::PagedCacheIsolation,
];

/// The paged properties against the paged toy with `bug`, 96 cases each: the failures.
fn paged_failures(bug: PagedBug) -> Vec<Failure> {
    PAGED
        .iter()
        .filter_map(|&p| {
            attn_oracle::check_property(&PagedToy(bug), p, &SuiteConfig::quick(96)).err()
        })
        .collect()
}

fn paged_caught_by(bug: PagedBug, expected: &[Property]) {
    caught(&bug, &paged_failures(bug), expected);
}

#[test]
fn paged_toy_without_bugs_passes_the_paged_properties() {
    none_failed(&paged_failures(PagedBug::None));
}

/// One test per planted paged bug: it must fail at least the properties listed.
macro_rules! paged_caught {
    ($($test:ident: $bug:ident => [$($property:ident),+];)*) => {
        $(
            #[test]
            fn $test() {
                paged_caught_by(PagedBug::$bug, &[$(Property::$property),+]);
            }
        )*
    };
}

paged_caught! {
    a_wrong_page_is_caught: WrongPage => [PagedEquivalence, PagedIsPacked];
    a_decode_one_ulp_off_is_caught: UlpOffWhenDecoding => [PagedIsPacked];
    ignored_masks_are_caught: IgnoresMasks => [PagedMalformed];
    reading_the_neighbour_is_caught: ReadsTheNeighbour => [PagedCacheIsolation];
    leaked_pages_are_caught: FreeLeaksPages => [PagedCacheIsolation];
    a_partial_append_is_caught: PartialAppend => [PagedCacheIsolation];
}

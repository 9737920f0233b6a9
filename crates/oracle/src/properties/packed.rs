//! The properties of packed batches of sequences of different lengths (varlen):
//! a packed call equals each sequence computed on its own — within the derived bound of
//! the reference always, and bit for bit when every sequence has the same shape (the
//! tiles of a packed call and of a call on one of its sequences then coincide) — for
//! random mixes of lengths with empty and one-token sequences, causal alignments and
//! windows per sequence, grouped-query heads and mixed layouts; forward and backward.

use core::ops::Range;

use attn_core::{Alibi, Causal, CuSeqlens, Options, SlidingWindow, Tensor4, Tensor4Ref};
use faer::MatRef;
use proptest::prelude::*;
use proptest::sample::select;
use proptest::test_runner::TestCaseError;

use super::common::{
    Check, all_rows, compare_batched_gradients, compare_head, engine_err, fail, scale_of,
};
use crate::Call;
use crate::bound::{ScoreMods, batch_backward_bound, head_bound_with};
use crate::case::{
    BACKWARD_MODIFIERS, HeadSlot, ModRecipe, OwnedTensor, Rng, TensorLayout, modifiers,
};
use crate::user_mods::{MaskModAt, ScoreModAt};
use crate::{BatchGradients, Engine};

/// Whether the engine has a packed mode (asked on one empty sequence).
pub(crate) fn supports_packed(engine: &dyn Engine) -> bool {
    let z = Tensor4::<f32>::zeros([1, 1, 0, 1]);
    let seqs = CuSeqlens::new(&[0], &[0]).expect("valid offsets");
    Call::packed(
        z.as_ref(),
        z.as_ref(),
        z.as_ref(),
        &seqs,
        &Options::default(),
    )
    .forward_batch(engine)
    .is_some()
}

/// Whether the engine has a packed backward pass.
pub(crate) fn supports_packed_backward(engine: &dyn Engine) -> bool {
    let z = Tensor4::<f32>::zeros([1, 1, 0, 1]);
    let z = z.as_ref();
    let seqs = CuSeqlens::new(&[0], &[0]).expect("valid offsets");
    Call::packed(z, z, z, &seqs, &Options::default())
        .backward_batch(engine, z, z, &[])
        .is_some()
}

/// A packed batch as a recipe.
#[derive(Debug, Clone, PartialEq)]
pub struct PackedCase {
    /// `(n_q, n_k)` of each sequence.
    pub seqs: Vec<(usize, usize)>,
    /// Key/value heads.
    pub h_kv: usize,
    /// Query heads per key/value head.
    pub group: usize,
    /// Key width.
    pub d_k: usize,
    /// Value width.
    pub d_v: usize,
    /// Causal constraint, per sequence.
    pub causal: Option<Causal>,
    /// Sliding window, per sequence.
    pub window: Option<SlidingWindow>,
    /// Layouts of Q, K, V (`Bshd` is FlashAttention's `[total, heads, dim]`).
    pub layouts: [TensorLayout; 3],
    /// Seed of the values.
    pub seed: u64,
    /// Score modifiers (ALiBi slopes per query head or per (sequence, query head); a user
    /// modifier sees the sequence as its batch entry).
    pub modifiers: ModRecipe,
}

impl PackedCase {
    /// Whether every sequence has the same shape.
    pub fn uniform(&self) -> bool {
        self.seqs.windows(2).all(|w| w[0] == w[1])
    }
}

fn seq_len(max: usize) -> impl Strategy<Value = usize> {
    prop_oneof![
        2 => select(vec![0usize, 1]),
        3 => 2..=max,
        1 => select(vec![63usize.min(max), 64.min(max), 65.min(max)]),
    ]
}

pub(crate) fn packed_case(max: usize) -> BoxedStrategy<PackedCase> {
    let layout = || {
        select(vec![
            TensorLayout::Bshd,
            TensorLayout::Bhsd,
            TensorLayout::Padded,
        ])
    };
    (
        proptest::collection::vec((seq_len(max), seq_len(max)), 1..=5),
        (any::<bool>(), any::<bool>()),
        (1..=2usize, 1..=3usize),
        (select(vec![1usize, 4, 8, 16]), select(vec![1usize, 4, 8])),
        proptest::option::of(select(vec![Causal::TopLeft, Causal::BottomRight])),
        proptest::option::weighted(0.3, (0..4usize, 0..4usize)),
        [layout(), layout(), layout()],
        (any::<u64>(), modifiers()),
    )
        .prop_map(
            |(
                mut seqs,
                (square, uniform),
                (h_kv, group),
                (d_k, d_v),
                causal,
                window,
                layouts,
                (seed, modifiers),
            )| {
                if square {
                    seqs.iter_mut().for_each(|s| s.1 = s.0);
                }
                if uniform {
                    let first = seqs[0];
                    seqs.iter_mut().for_each(|s| *s = first);
                }
                PackedCase {
                    seqs,
                    h_kv,
                    group,
                    d_k,
                    d_v,
                    causal,
                    window: window
                        .map(|(l, r)| SlidingWindow::new(Some(l), Some(r), Causal::BottomRight)),
                    layouts,
                    seed,
                    modifiers,
                }
            },
        )
        .boxed()
}

/// A packed case's operands and offsets.
struct PackedInputs {
    case: PackedCase,
    q: OwnedTensor,
    k: OwnedTensor,
    v: OwnedTensor,
    cu_q: Vec<usize>,
    cu_k: Vec<usize>,
    slopes: Option<Vec<f32>>,
    sinks: Option<Vec<f32>>,
}

impl PackedInputs {
    fn of(case: &PackedCase, engine: &dyn Engine) -> Self {
        let dtype = engine.storage();
        let mut rng = Rng::new(case.seed, 51);
        let mut value = || dtype.round((rng.unit() * 2.0 - 1.0) as f32);
        let cumulative = |f: fn(&(usize, usize)) -> usize| {
            let mut cu = vec![0];
            for s in &case.seqs {
                cu.push(cu[cu.len() - 1] + f(s));
            }
            cu
        };
        let (cu_q, cu_k) = (cumulative(|s| s.0), cumulative(|s| s.1));
        let (total_q, total_k) = (cu_q[cu_q.len() - 1], cu_k[cu_k.len() - 1]);
        let h_q = case.h_kv * case.group;
        let q = OwnedTensor::new(case.layouts[0], [1, h_q, total_q, case.d_k], &mut value);
        let k = OwnedTensor::new(
            case.layouts[1],
            [1, case.h_kv, total_k, case.d_k],
            &mut value,
        );
        let v = OwnedTensor::new(
            case.layouts[2],
            [1, case.h_kv, total_k, case.d_v],
            &mut value,
        );
        let (slopes, sinks) = case.modifiers.build(case.seqs.len(), h_q, case.seed);
        PackedInputs {
            case: case.clone(),
            q,
            k,
            v,
            cu_q,
            cu_k,
            slopes,
            sinks,
        }
    }

    fn seqs(&self) -> CuSeqlens<'_> {
        CuSeqlens::new(&self.cu_q, &self.cu_k).expect("built valid")
    }

    fn options(&self) -> Options<'_> {
        let masks = Options {
            causal: self.case.causal,
            window: self.case.window,
            ..Options::default()
        };
        self.case
            .modifiers
            .apply(masks, self.slopes.as_deref(), self.sinks.as_deref())
    }

    /// The bound's view of head `h` of sequence `s` (`single`: its single-head options).
    fn score_mods(&self, single: &Options<'_>, s: usize, h: usize, n: [usize; 2]) -> ScoreMods {
        let user = self
            .case
            .modifiers
            .score_mod
            .map(|u| u.bound(s, h, n[0], n[1]));
        ScoreMods::of(&single.head_modifiers(0, 0, 1, n[0], n[1]), user)
    }
}

/// What a packed call of sequence `s` alone needs to compute it as the whole batch does: its
/// slopes (when they are per sequence) and the user's modifiers asked about sequence `s`.
struct Alone<'a> {
    slopes: Option<&'a [f32]>,
    score_mod: Option<ScoreModAt<'a>>,
    mask_mod: Option<MaskModAt<'a>>,
}

impl<'a> Alone<'a> {
    fn new(opts: &Options<'a>, s: usize, h_q: usize) -> Self {
        Alone {
            slopes: opts.alibi.map(|a| {
                let sl = a.slopes();
                if sl.len() == h_q {
                    sl
                } else {
                    &sl[s * h_q..(s + 1) * h_q]
                }
            }),
            score_mod: opts.score_mod.map(|m| ScoreModAt {
                inner: m,
                at: (Some(s), None),
            }),
            mask_mod: opts.mask_mod.map(|m| MaskModAt {
                inner: m,
                at: (Some(s), None),
            }),
        }
    }

    fn apply<'s>(&'s self, opts: Options<'s>) -> Options<'s> {
        Options {
            alibi: opts
                .alibi
                .zip(self.slopes)
                .map(|(a, s)| Alibi::new(s).with_align(a.align())),
            score_mod: self.score_mod.as_ref().map(|m| m as _),
            mask_mod: self.mask_mod.as_ref().map(|m| m as _),
            ..opts
        }
    }
}

/// Rows `rows` of a packed `[1, heads, total, d]` view, as a view of their own.
fn rows_of<'a>(
    data: &'a [f32],
    t: Tensor4Ref<'a, f32>,
    rows: &Range<usize>,
) -> Tensor4Ref<'a, f32> {
    let [_, h, _, d] = t.dims();
    let s = t.strides();
    let start = rows.start.saturating_mul(s[2]).min(data.len());
    Tensor4Ref::new(&data[start..], [1, h, rows.len(), d], s).expect("a sub-view fits")
}

/// Head `h`'s rows `rows` of a result tensor `[1, heads, total, d]`.
fn head_rows<'a>(
    t: &'a Tensor4<f32>,
    h: usize,
    rows: &Range<usize>,
) -> Result<MatRef<'a, f32>, TestCaseError> {
    let m = t.as_ref().head(0, h).map_err(|e| fail(e.to_string()))?;
    Ok(m.subrows(rows.start, rows.len()))
}

/// The LSE entries of sequence rows `rows`, head by head (`[h_q][rows]`).
fn lse_rows(lse: &[f32], h_q: usize, total: usize, rows: &Range<usize>) -> Vec<f32> {
    (0..h_q)
        .flat_map(|h| {
            lse[h * total + rows.start..h * total + rows.end]
                .iter()
                .copied()
        })
        .collect()
}

fn bits(m: MatRef<'_, f32>) -> Vec<u32> {
    (0..m.nrows())
        .flat_map(|i| (0..m.ncols()).map(move |c| m[(i, c)].to_bits()))
        .collect()
}

fn packed_forward(
    engine: &dyn Engine,
    q: Tensor4Ref<'_, f32>,
    k: Tensor4Ref<'_, f32>,
    v: Tensor4Ref<'_, f32>,
    seqs: &CuSeqlens<'_>,
    opts: &Options<'_>,
) -> Result<(Tensor4<f32>, Vec<f32>), TestCaseError> {
    Call::packed(q, k, v, seqs, opts)
        .forward_batch(engine)
        .ok_or_else(|| fail("the engine stopped supporting packed calls"))?
        .map_err(|e| engine_err("packed call", e))
}

pub(crate) fn packed_sequences(engine: &dyn Engine, case: PackedCase) -> Check {
    let x = PackedInputs::of(&case, engine);
    let (seqs, opts) = (x.seqs(), x.options());
    let (qv, kv_, vv) = (x.q.view(), x.k.view(), x.v.view());
    let (out, lse) = packed_forward(engine, qv, kv_, vv, &seqs, &opts)?;
    let [_, h_q, total_q, _] = x.q.dims;
    let want = [1, h_q, total_q, case.d_v];
    if out.dims() != want || lse.len() != h_q * total_q {
        return Err(fail(format!(
            "packed output has dims {:?} and {} LSE values, not {want:?} and {}",
            out.dims(),
            lse.len(),
            h_q * total_q
        )));
    }
    for s in 0..seqs.batch() {
        let (rows, keys) = (seqs.queries(s), seqs.keys(s));
        let (qs, ks, vs) = (
            rows_of(&x.q.data, qv, &rows),
            rows_of(&x.k.data, kv_, &keys),
            rows_of(&x.v.data, vv, &keys),
        );
        for h in 0..h_q {
            let kv = h / case.group;
            let (qh, kh, vh) = (
                qs.head(0, h).expect("in range"),
                ks.head(0, kv).expect("in range"),
                vs.head(0, kv).expect("in range"),
            );
            let slot = HeadSlot::new(&opts, s, h, h_q);
            let single = slot.apply(opts);
            let r = attn_reference::Attention::head(qh, kh, vh, &single)
                .and_then(|call| call.materialized())
                .expect("generated inputs are valid");
            let bd = head_bound_with(
                &engine.error_model(),
                qh,
                kh,
                vh,
                scale_of(&opts, case.d_k),
                None,
                &x.score_mods(&single, s, h, [rows.len(), keys.len()]),
                &r,
                0,
            );
            let l: Vec<f32> = lse[h * total_q + rows.start..h * total_q + rows.end].to_vec();
            compare_head(
                &format!(
                    "packed sequence {s} ({}×{}), query head {h}",
                    rows.len(),
                    keys.len()
                ),
                head_rows(&out, h, &rows)?,
                Some(&l),
                &r,
                &bd,
                &all_rows,
            )
            .map_err(fail)?;
        }
        if case.uniform() {
            let (cu_q, cu_k) = ([0, rows.len()], [0, keys.len()]);
            let alone = CuSeqlens::new(&cu_q, &cu_k).expect("valid");
            let by_itself = Alone::new(&opts, s, h_q);
            let (o1, l1) = packed_forward(engine, qs, ks, vs, &alone, &by_itself.apply(opts))?;
            for h in 0..h_q {
                let whole = head_rows(&out, h, &rows)?;
                let single = head_rows(&o1, h, &(0..rows.len()))?;
                if bits(whole) != bits(single) {
                    return Err(fail(format!(
                        "sequence {s}, query head {h}: the packed batch (every sequence {}×{}) and the sequence alone differ in their output bits",
                        rows.len(),
                        keys.len()
                    )));
                }
            }
            let l0 = lse_rows(&lse, h_q, total_q, &rows);
            if l0
                .iter()
                .map(|x| x.to_bits())
                .ne(l1.iter().map(|x| x.to_bits()))
            {
                return Err(fail(format!(
                    "sequence {s}: the packed batch and the sequence alone differ in their LSE bits"
                )));
            }
        }
    }
    Ok(())
}

fn packed_backward(
    engine: &dyn Engine,
    [q, k, v, grad_out, out]: [Tensor4Ref<'_, f32>; 5],
    lse: &[f32],
    seqs: &CuSeqlens<'_>,
    opts: &Options<'_>,
) -> Result<BatchGradients, TestCaseError> {
    Call::packed(q, k, v, seqs, opts)
        .backward_batch(engine, grad_out, out, lse)
        .ok_or_else(|| fail("the engine stopped supporting the packed backward pass"))?
        .map_err(|e| engine_err("packed backward call", e))
}

/// [`packed_case`] for the backward pass: no modifiers unless [`BACKWARD_MODIFIERS`].
pub(crate) fn packed_grad_case(max: usize) -> BoxedStrategy<PackedCase> {
    packed_case(max)
        .prop_map(|mut c| {
            if !BACKWARD_MODIFIERS {
                c.modifiers = ModRecipe::NONE;
            }
            c
        })
        .boxed()
}

pub(crate) fn packed_gradients(engine: &dyn Engine, (case, seed): (PackedCase, u64)) -> Check {
    let x = PackedInputs::of(&case, engine);
    let (seqs, opts) = (x.seqs(), x.options());
    let (qv, kv_, vv) = (x.q.view(), x.k.view(), x.v.view());
    let (out, lse) = packed_forward(engine, qv, kv_, vv, &seqs, &opts)?;
    let [_, h_q, total_q, _] = x.q.dims;
    let dtype = engine.storage();
    let mut rng = Rng::new(seed, 52);
    let grad_out = OwnedTensor::new(TensorLayout::Bshd, [1, h_q, total_q, case.d_v], || {
        dtype.round((rng.unit() * 2.0 - 1.0) as f32)
    });
    let gv = grad_out.view();
    let g = packed_backward(engine, [qv, kv_, vv, gv, out.as_ref()], &lse, &seqs, &opts)?;
    let want = [x.q.dims, x.k.dims, x.v.dims];
    let got = [g.dq.dims(), g.dk.dims(), g.dv.dims()];
    if got != want {
        return Err(fail(format!(
            "packed gradients have dims {got:?} (dQ, dK, dV), not {want:?}"
        )));
    }
    for s in 0..seqs.batch() {
        let (rows, keys) = (seqs.queries(s), seqs.keys(s));
        let sub = [
            rows_of(&x.q.data, qv, &rows),
            rows_of(&x.k.data, kv_, &keys),
            rows_of(&x.v.data, vv, &keys),
            rows_of(&grad_out.data, gv, &rows),
        ];
        let reference = attn_reference::Attention::batched(sub[0], sub[1], sub[2], &opts)
            .and_then(|call| call.backward_materialized(sub[3]))
            .expect("generated inputs are valid");
        let bound = batch_backward_bound(
            &engine.error_model(),
            sub[0],
            sub[1],
            sub[2],
            sub[3],
            scale_of(&opts, case.d_k),
            None,
            &reference,
        );
        // The engine's packed gradients of this sequence, as a batch of one.
        let cut = |t: &Tensor4<f32>, r: &Range<usize>| -> Result<Tensor4<f32>, TestCaseError> {
            let [_, h, _, d] = t.dims();
            let mut c = Tensor4::<f32>::zeros([1, h, r.len(), d]);
            for head in 0..h {
                let src = head_rows(t, head, r)?;
                c.as_mut()
                    .head_mut(0, head)
                    .map_err(|e| fail(e.to_string()))?
                    .copy_from(src);
            }
            Ok(c)
        };
        let (o_s, l_s) = (cut(&out, &rows)?, lse_rows(&lse, h_q, total_q, &rows));
        for h in 0..h_q {
            compare_head(
                &format!(
                    "packed sequence {s}, query head {h}: the forward given to the backward pass"
                ),
                o_s.as_ref().head(0, h).map_err(|e| fail(e.to_string()))?,
                Some(&l_s[h * rows.len()..(h + 1) * rows.len()]),
                &reference[0][h].forward,
                &bound.forward[0][h],
                &all_rows,
            )
            .map_err(fail)?;
        }
        let mine = BatchGradients::new(cut(&g.dq, &rows)?, cut(&g.dk, &keys)?, cut(&g.dv, &keys)?);
        compare_batched_gradients(
            &format!(
                "packed sequence {s} ({}×{}) gradients",
                rows.len(),
                keys.len()
            ),
            &mine,
            &reference,
            &bound,
            case.h_kv,
        )?;
        if case.uniform() {
            let (cu_q, cu_k) = ([0, rows.len()], [0, keys.len()]);
            let alone = CuSeqlens::new(&cu_q, &cu_k).expect("valid");
            let g1 = packed_backward(
                engine,
                [sub[0], sub[1], sub[2], sub[3], o_s.as_ref()],
                &l_s,
                &alone,
                &opts,
            )?;
            for (name, a, b) in [
                ("dQ", &mine.dq, &g1.dq),
                ("dK", &mine.dk, &g1.dk),
                ("dV", &mine.dv, &g1.dv),
            ] {
                if a.as_slice()
                    .iter()
                    .map(|x| x.to_bits())
                    .ne(b.as_slice().iter().map(|x| x.to_bits()))
                {
                    return Err(fail(format!(
                        "sequence {s}: {name} of the packed batch and of the sequence alone differ in their bits"
                    )));
                }
            }
        }
    }
    Ok(())
}

//! What an engine must provide to be checked: the [`Engine`] trait, its storage type and
//! error model, and the reference engine as the first implementation.

use core::ops::Range;

use attn_core::{BoolMask, CuSeqlens, Options, Result, Tensor4, Tensor4Ref, validate_head};
use faer::{Mat, MatRef};

/// The storage type of an engine's operands.
///
/// The oracle generates f32 inputs and rounds them to this type before *both* the engine
/// and the reference see them, so that a half-precision engine is compared with the
/// reference run on the same half-rounded inputs: storage rounding is not an engine
/// error (see "Half-precision storage" in the [crate documentation](crate)).
///
/// ```
/// use attn_oracle::Dtype;
/// assert_eq!(Dtype::Bf16.round(1.0 + 1.0 / 1024.0), 1.0); // bf16 keeps 8 bits
/// assert_eq!(Dtype::F32.unit_roundoff(), 2f64.powi(-24));
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Dtype {
    /// IEEE binary32.
    F32,
    /// IEEE binary16 (`half::f16`).
    F16,
    /// bfloat16 (`half::bf16`).
    Bf16,
}

impl Dtype {
    /// Rounds an f32 to this type (round to nearest even) and widens it back, exactly.
    pub fn round(self, x: f32) -> f32 {
        match self {
            Dtype::F32 => x,
            Dtype::F16 => half::f16::from_f32(x).to_f32(),
            Dtype::Bf16 => half::bf16::from_f32(x).to_f32(),
        }
    }

    /// The unit roundoff `u = 2^-p` (half an ulp of 1).
    pub fn unit_roundoff(self) -> f64 {
        match self {
            Dtype::F32 => 2f64.powi(-24),
            Dtype::F16 => 2f64.powi(-11),
            Dtype::Bf16 => 2f64.powi(-8),
        }
    }

    /// Half the smallest positive subnormal: the absolute rounding error near zero.
    pub fn underflow_error(self) -> f64 {
        match self {
            Dtype::F32 => 2f64.powi(-150),
            Dtype::F16 => 2f64.powi(-25),
            Dtype::Bf16 => 2f64.powi(-134),
        }
    }

    /// The smallest positive normal number: below it, rounding is absolute
    /// ([`Dtype::underflow_error`]) rather than relative.
    ///
    /// ```
    /// use attn_oracle::Dtype;
    /// assert_eq!(Dtype::F16.smallest_normal(), 2f64.powi(-14));
    /// assert_eq!(Dtype::Bf16.smallest_normal(), f64::from(f32::MIN_POSITIVE));
    /// ```
    pub fn smallest_normal(self) -> f64 {
        match self {
            Dtype::F32 | Dtype::Bf16 => 2f64.powi(-126),
            Dtype::F16 => 2f64.powi(-14),
        }
    }

    /// The largest power of two that is safely inside this type's range for the
    /// adversarial "edge of range" inputs: `65504` for f16 (its largest finite value)
    /// and `2^50` otherwise (products of two such values stay far from f32 overflow).
    pub fn edge_magnitude(self) -> f32 {
        match self {
            Dtype::F16 => 65504.0,
            Dtype::F32 | Dtype::Bf16 => 2f32.powi(50),
        }
    }
}

/// How an engine computes, which decides the error bound it is held to
/// (see the crate documentation for the derivation).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Compute {
    /// The engine computes in f64 (or better) and rounds its result once: the reference.
    RoundedOnce,
    /// Scores, softmax state (running max, running sum, rescale factors) and the output
    /// accumulator are f32 (`u = 2⁻²⁴`), in any summation order, blocked or not, with
    /// lazy rescaling allowed (a stale maximum at most 16 nats below the true one).
    F32 {
        /// Relative error of the exponential (`exp` or `exp2`, and `ln`) in ulps of 1
        /// (`2⁻²³ = 2u`): 2 for a Cephes-style polynomial, 1 for a correctly rounded one.
        exp_ulps: f64,
        /// `Some(s)`: the engine may compute a row over key chunks of at least `s` keys
        /// and merge the normalised partial states `(O, LSE)` (split-KV). Each merge
        /// rounds the chunk LSEs to f32, which the bound accounts for.
        split_keys: Option<usize>,
    },
}

/// The accuracy contract an engine claims: how it computes and what type its output
/// is rounded to before being widened to the f32 the trait returns.
///
/// ```
/// use attn_oracle::{Compute, Dtype, ErrorModel};
/// let m = ErrorModel::f32_streaming(2.0, Some(1024));
/// assert_eq!(m.compute, Compute::F32 { exp_ulps: 2.0, split_keys: Some(1024) });
/// assert_eq!(m.output, Dtype::F32);
/// ```
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ErrorModel {
    /// How the engine computes.
    pub compute: Compute,
    /// The type of its output values.
    pub output: Dtype,
}

impl ErrorModel {
    /// An f32 streaming engine with f32 output whose exp is accurate to `exp_ulps` ulps
    /// and which may merge partial states over chunks of `split_keys` keys.
    pub fn f32_streaming(exp_ulps: f64, split_keys: Option<usize>) -> Self {
        Self {
            compute: Compute::F32 {
                exp_ulps,
                split_keys,
            },
            output: Dtype::F32,
        }
    }
}

/// A plan for computing attention by parts and merging partial softmax states
/// (split-KV, flash-decoding, sequence sharding).
///
/// `Keys(r)` is the partial state of every query over the keys `r` of the *whole* problem:
/// masks are evaluated at absolute key positions and keys outside `r` are ignored.
/// `Empty` is the empty state (`m = -inf`, `l = 0`, `O = 0`); `Merge(a, b)` merges two
/// states in that order.
///
/// ```
/// use attn_oracle::MergePlan;
/// let plan = MergePlan::merge(MergePlan::keys(0..3), MergePlan::keys(3..7));
/// // Evaluate it with any state type, here the list of ranges it visits.
/// let visited = plan.fold(
///     &mut |r| Ok::<_, ()>(vec![r]),
///     &mut || vec![],
///     &mut |mut a, b| { a.extend(b); a },
/// ).unwrap();
/// assert_eq!(visited, vec![0..3, 3..7]);
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MergePlan {
    /// The empty state.
    Empty,
    /// The state of the keys in this range.
    Keys(Range<usize>),
    /// The merge of two states, left then right.
    Merge(Box<MergePlan>, Box<MergePlan>),
}

impl MergePlan {
    /// `Keys(range)`.
    pub fn keys(range: Range<usize>) -> Self {
        MergePlan::Keys(range)
    }

    /// `Merge(a, b)`.
    pub fn merge(a: MergePlan, b: MergePlan) -> Self {
        MergePlan::Merge(Box::new(a), Box::new(b))
    }

    /// Evaluates the plan bottom-up with the engine's own state type: `leaf` computes
    /// the state of a key range, `empty` makes the empty state, `merge` merges two.
    pub fn fold<S, E>(
        &self,
        leaf: &mut impl FnMut(Range<usize>) -> Result<S, E>,
        empty: &mut impl FnMut() -> S,
        merge: &mut impl FnMut(S, S) -> S,
    ) -> Result<S, E> {
        match self {
            MergePlan::Empty => Ok(empty()),
            MergePlan::Keys(r) => leaf(r.clone()),
            MergePlan::Merge(a, b) => {
                let a = a.fold(leaf, empty, merge)?;
                let b = b.fold(leaf, empty, merge)?;
                Ok(merge(a, b))
            }
        }
    }
}

/// The gradients of one head with respect to its operands, each shaped like the operand
/// (dQ `[n_q, d_k]`, dK `[n_k, d_k]`, dV `[n_k, d_v]`) and widened to f32 as every result
/// of [`Engine`] is: what [`Engine::attention_backward`] returns. It is the contract's
/// [`attn_core::Gradients`] in f32 (build one with `Gradients::new(dq, dk, dv)`).
///
/// An engine without a backward pass keeps the trait's default, which returns `None`, and
/// the backward properties skip it; [`ReferenceEngine`] has one:
///
/// ```
/// use attn_core::{Options, Result, Tensor4, Tensor4Ref};
/// use attn_oracle::{Engine, ErrorModel, Gradients, ReferenceEngine};
/// use faer::{Mat, MatRef};
///
/// struct ForwardOnly;
/// impl Engine for ForwardOnly {
///     fn name(&self) -> String { "forward-only".into() }
///     fn error_model(&self) -> ErrorModel { ReferenceEngine.error_model() }
///     fn attention_with_lse(&self, q: MatRef<'_, f32>, k: MatRef<'_, f32>, v: MatRef<'_, f32>,
///                           o: &Options<'_>) -> Result<(Mat<f32>, Vec<f32>)> {
///         ReferenceEngine.attention_with_lse(q, k, v, o)
///     }
///     fn attention_batched(&self, q: Tensor4Ref<'_, f32>, k: Tensor4Ref<'_, f32>,
///                          v: Tensor4Ref<'_, f32>, o: &Options<'_>) -> Result<Tensor4<f32>> {
///         ReferenceEngine.attention_batched(q, k, v, o)
///     }
/// }
///
/// let opts = Options::default();
/// let x = Mat::<f32>::from_fn(3, 4, |i, j| (i + 2 * j) as f32 / 8.0);
/// let (out, lse) = ForwardOnly.attention_with_lse(x.as_ref(), x.as_ref(), x.as_ref(), &opts)?;
/// let grad_out = Mat::<f32>::from_fn(3, 4, |i, j| if i == j { 1.0 } else { 0.0 });
/// let grads = ForwardOnly.attention_backward(
///     x.as_ref(), x.as_ref(), x.as_ref(), grad_out.as_ref(), out.as_ref(), &lse, &opts,
/// );
/// assert!(grads.is_none()); // no backward pass: the backward properties do not apply
///
/// let g: Gradients = ReferenceEngine
///     .attention_backward(x.as_ref(), x.as_ref(), x.as_ref(), grad_out.as_ref(), out.as_ref(), &lse, &opts)
///     .expect("the reference has a backward pass")?;
/// assert_eq!((g.dq.nrows(), g.dk.nrows(), g.dv.ncols()), (3, 3, 4));
///
/// let t = Tensor4::<f32>::zeros([1, 2, 3, 4]);
/// let batched = ForwardOnly.attention_backward_batched(
///     t.as_ref(), t.as_ref(), t.as_ref(), t.as_ref(), t.as_ref(), &[0.0; 6], &opts,
/// );
/// assert!(batched.is_none());
/// # Ok::<(), attn_core::Error>(())
/// ```
pub type Gradients = attn_core::Gradients<f32>;

/// The gradients of a batched, grouped-query call, each shaped like its operand: dQ
/// `[batch, h_q, n_q, d_k]`, dK `[batch, h_kv, n_k, d_k]`, dV `[batch, h_kv, n_k, d_v]`
/// (the gradient of a kv head shared by a group of query heads is the sum over the
/// group); what [`Engine::attention_backward_batched`] returns: the contract's
/// [`attn_core::BatchGradients`] in f32. See [`Gradients`].
pub type BatchGradients = attn_core::BatchGradients<f32>;

/// An attention engine under test.
///
/// Inputs are f32 views already rounded to [`Engine::storage`]; an engine with another
/// storage type converts inside its implementation (exactly, since the values are
/// representable) and widens its output back to f32. Errors must be the contract's
/// [`attn_core::Error`] values.
///
/// ```
/// use attn_oracle::{Engine, ReferenceEngine};
/// use attn_core::Options;
/// use faer::Mat;
/// let q = Mat::<f32>::from_fn(2, 4, |i, j| (i + j) as f32);
/// let (o, lse) = ReferenceEngine.attention_with_lse(q.as_ref(), q.as_ref(), q.as_ref(), &Options::default()).unwrap();
/// assert_eq!((o.nrows(), lse.len()), (2, 2));
/// ```
pub trait Engine: Sync {
    /// A short name, used in failure reports and regression file names.
    fn name(&self) -> String;

    /// The storage type of the operands (default f32).
    fn storage(&self) -> Dtype {
        Dtype::F32
    }

    /// The accuracy this engine claims; the oracle derives its bound from it.
    fn error_model(&self) -> ErrorModel;

    /// Lengths around which this engine changes behaviour (tile sizes, split sizes);
    /// the oracle tests `t − 1`, `t` and `t + 1` for each, along both sequence axes.
    fn tile_lengths(&self) -> Vec<usize> {
        vec![64, 128, 256, 512]
    }

    /// Whether a user [`attn_core::ScoreMod`] computing a built-in modifier's own f32
    /// arithmetic ([`attn_core::SoftCap::apply_f32`]) gives the built-in's output bits: true
    /// for an engine that applies its built-ins through that function on the same f32
    /// scores. The default, false, holds the two to the bound only.
    fn user_score_mod_bits_match_builtins(&self) -> bool {
        false
    }

    /// Whether a user [`attn_core::MaskMod`] re-implementing `Causal::TopLeft` with exact
    /// block answers gives the causal mask's output bits for `n_q` queries and `n_k` keys:
    /// true where the engine computes the same tiles either way (an engine may trim a
    /// causal block at the diagonal, which a user's mask cannot tell). The default, false,
    /// holds the two to the bound only.
    fn user_mask_mod_bits_match_structural(&self, n_q: usize, n_k: usize) -> bool {
        let _ = (n_q, n_k);
        false
    }

    /// One head: the output `[n_q, d_v]` and the natural-log LSE of each row
    /// (`-inf` for a row with no visible key).
    fn attention_with_lse(
        &self,
        q: MatRef<'_, f32>,
        k: MatRef<'_, f32>,
        v: MatRef<'_, f32>,
        options: &Options<'_>,
    ) -> Result<(Mat<f32>, Vec<f32>)>;

    /// Batched, grouped-query attention over strided `[batch, heads, seq, dim]` views;
    /// returns `[batch, h_q, n_q, d_v]`.
    fn attention_batched(
        &self,
        q: Tensor4Ref<'_, f32>,
        k: Tensor4Ref<'_, f32>,
        v: Tensor4Ref<'_, f32>,
        options: &Options<'_>,
    ) -> Result<Tensor4<f32>>;

    /// One head computed by parts and merged as `plan` says, then finished to the output
    /// and LSE; `None` if the engine has no partial-state API (the merge properties are
    /// then skipped). Implement it with [`MergePlan::fold`] over the engine's own state.
    fn attention_split(
        &self,
        q: MatRef<'_, f32>,
        k: MatRef<'_, f32>,
        v: MatRef<'_, f32>,
        options: &Options<'_>,
        plan: &MergePlan,
    ) -> Option<Result<(Mat<f32>, Vec<f32>)>> {
        let _ = (q, k, v, options, plan);
        None
    }

    /// The backward pass of one head: the gradients of a loss with respect to Q, K and V,
    /// given the upstream gradient `grad_out` (dO, `[n_q, d_v]`) and what
    /// [`Engine::attention_with_lse`] returned for the same operands and options, the
    /// output `out` (`[n_q, d_v]`) and the natural-log LSE `lse` (`n_q` values).
    ///
    /// With `P = exp(scale·QKᵀ + M − LSE)` recomputed and `D_i = Σ_t dO_it·O_it`:
    /// `dV = Pᵀ dO`, `dS = P ∘ (dO Vᵀ − D)`, `dQ = scale·dS K`, `dK = scale·dSᵀ Q`.
    /// A hidden key has `P = 0` and contributes nothing to any gradient; a row that sees
    /// no key (LSE `-inf`) has `dQ = 0` and adds nothing to dK and dV, never NaN.
    /// Invalid operands are `Some(Err(_))` with the contract's [`attn_core::Error`].
    ///
    /// `None` (the default) if the engine has no backward pass: the backward properties
    /// skip such an engine, as the merge properties skip one without
    /// [`Engine::attention_split`]. The oracle passes the engine's own forward result
    /// (from [`Engine::attention_with_lse`]) as `out` and `lse`, and holds the gradients to
    /// the backward bound ([`crate::bound::head_backward_bound`]), which accounts for the
    /// forward's error in them.
    #[allow(clippy::too_many_arguments)]
    fn attention_backward(
        &self,
        q: MatRef<'_, f32>,
        k: MatRef<'_, f32>,
        v: MatRef<'_, f32>,
        grad_out: MatRef<'_, f32>,
        out: MatRef<'_, f32>,
        lse: &[f32],
        options: &Options<'_>,
    ) -> Option<Result<Gradients>> {
        let _ = (q, k, v, grad_out, out, lse, options);
        None
    }

    /// [`Engine::attention_backward`] over strided `[batch, heads, seq, dim]` views with
    /// grouped-query heads, as [`Engine::attention_batched`]: `grad_out` and `out` are
    /// `[batch, h_q, n_q, d_v]` and `lse` holds the `batch·h_q·n_q` LSE values in
    /// `[batch][h_q][n_q]` order. The gradients of a kv head shared by a group of query
    /// heads are summed over the group. `None` (the default) if the engine has no
    /// batched backward pass.
    #[allow(clippy::too_many_arguments)]
    fn attention_backward_batched(
        &self,
        q: Tensor4Ref<'_, f32>,
        k: Tensor4Ref<'_, f32>,
        v: Tensor4Ref<'_, f32>,
        grad_out: Tensor4Ref<'_, f32>,
        out: Tensor4Ref<'_, f32>,
        lse: &[f32],
        options: &Options<'_>,
    ) -> Option<Result<BatchGradients>> {
        let _ = (q, k, v, grad_out, out, lse, options);
        None
    }

    /// A packed batch of sequences of different lengths (varlen): Q `[1, h_q, total_q,
    /// d_k]`, K and V `[1, h_kv, total_k, d]` (strided views), sequence `s` on the rows
    /// `seqs.queries(s)` of Q and `seqs.keys(s)` of K and V, attending only within itself
    /// (causal alignment and windows per sequence). Returns the output
    /// `[1, h_q, total_q, d_v]` and the LSE in `[h_q][total_q]` order. `None` (the
    /// default) if the engine has no packed mode: the packed properties skip it.
    fn attention_packed(
        &self,
        q: Tensor4Ref<'_, f32>,
        k: Tensor4Ref<'_, f32>,
        v: Tensor4Ref<'_, f32>,
        seqs: &CuSeqlens<'_>,
        options: &Options<'_>,
    ) -> Option<Result<(Tensor4<f32>, Vec<f32>)>> {
        let _ = (q, k, v, seqs, options);
        None
    }

    /// The backward pass of [`Engine::attention_packed`]: `grad_out` and `out` are
    /// `[1, h_q, total_q, d_v]`, `lse` the `[h_q][total_q]` values; the gradients are
    /// packed like their operands (a kv head's summed over its query heads). `None` (the
    /// default) if the engine has no packed backward pass.
    #[allow(clippy::too_many_arguments)]
    fn attention_backward_packed(
        &self,
        q: Tensor4Ref<'_, f32>,
        k: Tensor4Ref<'_, f32>,
        v: Tensor4Ref<'_, f32>,
        grad_out: Tensor4Ref<'_, f32>,
        out: Tensor4Ref<'_, f32>,
        lse: &[f32],
        seqs: &CuSeqlens<'_>,
        options: &Options<'_>,
    ) -> Option<Result<BatchGradients>> {
        let _ = (q, k, v, grad_out, out, lse, seqs, options);
        None
    }
}

/// The f64 reference (`attn-reference`) as an engine: computes in f64, rounds once.
///
/// Its partial states are f64 `(O normalised, LSE)` pairs merged in f64, so the merge
/// properties check the oracle's own plumbing against the textbook. Its backward pass is
/// `attn_reference::attention_backward{,_batched}`: the f64 formula on its own exact
/// forward (the given `out` and `lse` are checked for shape, not used), rounded to f32
/// once, so the backward properties check the oracle's plumbing and the reference's
/// invariants.
///
/// ```
/// use attn_oracle::{check_engine, ReferenceEngine, SuiteConfig};
/// // Every property, a handful of cases each (doctest-sized).
/// check_engine(&ReferenceEngine, &SuiteConfig::quick(2)).unwrap();
/// ```
#[derive(Debug, Clone, Copy, Default)]
pub struct ReferenceEngine;

/// A partial state of the reference engine: normalised output and LSE, in f64.
#[derive(Clone)]
struct RefState {
    o: Mat<f64>,
    lse: Vec<f64>,
}

fn merge_ref(a: RefState, b: RefState) -> RefState {
    let mut out = a.clone();
    for i in 0..a.lse.len() {
        let (la, lb) = (a.lse[i], b.lse[i]);
        if lb == f64::NEG_INFINITY {
            continue; // b empty: keep a, bit for bit
        }
        if la == f64::NEG_INFINITY {
            out.lse[i] = lb;
            for c in 0..a.o.ncols() {
                out.o[(i, c)] = b.o[(i, c)];
            }
            continue;
        }
        let m = la.max(lb);
        let (wa, wb) = ((la - m).exp(), (lb - m).exp());
        let l = wa + wb;
        out.lse[i] = m + l.ln();
        for c in 0..a.o.ncols() {
            out.o[(i, c)] = (wa * a.o[(i, c)] + wb * b.o[(i, c)]) / l;
        }
    }
    out
}

impl Engine for ReferenceEngine {
    fn name(&self) -> String {
        "reference".into()
    }

    fn error_model(&self) -> ErrorModel {
        ErrorModel {
            compute: Compute::RoundedOnce,
            output: Dtype::F32,
        }
    }

    /// It asks a user's mask about every entry, as it asks the structural masks.
    fn user_mask_mod_bits_match_structural(&self, _: usize, _: usize) -> bool {
        true
    }

    fn attention_with_lse(
        &self,
        q: MatRef<'_, f32>,
        k: MatRef<'_, f32>,
        v: MatRef<'_, f32>,
        options: &Options<'_>,
    ) -> Result<(Mat<f32>, Vec<f32>)> {
        let m = attn_reference::Attention::head(q, k, v, options)
            .and_then(|call| call.materialized())?;
        let o = Mat::from_fn(m.output.nrows(), m.output.ncols(), |i, j| {
            m.output[(i, j)] as f32
        });
        Ok((o, m.lse.iter().map(|&x| x as f32).collect()))
    }

    fn attention_batched(
        &self,
        q: Tensor4Ref<'_, f32>,
        k: Tensor4Ref<'_, f32>,
        v: Tensor4Ref<'_, f32>,
        options: &Options<'_>,
    ) -> Result<Tensor4<f32>> {
        attn_reference::Attention::batched(q, k, v, options)
            .and_then(|call| call.forward())
            .map(|f| f.into_output())
    }

    fn attention_split(
        &self,
        q: MatRef<'_, f32>,
        k: MatRef<'_, f32>,
        v: MatRef<'_, f32>,
        options: &Options<'_>,
        plan: &MergePlan,
    ) -> Option<Result<(Mat<f32>, Vec<f32>)>> {
        let run = || -> Result<(Mat<f32>, Vec<f32>)> {
            let shape = validate_head(q, k, v, options)?;
            let (n_q, n_k, d_v) = (shape.n_q, shape.n_k, shape.d_v);
            let state = plan.fold(
                &mut |range: Range<usize>| {
                    let allow = Mat::from_fn(n_q, n_k, |i, j| {
                        range.contains(&j) && options.bool_mask.is_none_or(|b| b.allows(i, j))
                    });
                    let mut opts = *options;
                    opts.bool_mask = Some(BoolMask::allow(allow.as_ref()));
                    let m = attn_reference::Attention::head(q, k, v, &opts)
                        .and_then(|call| call.materialized())?;
                    Ok(RefState {
                        o: m.output,
                        lse: m.lse,
                    })
                },
                &mut || RefState {
                    o: Mat::zeros(n_q, d_v),
                    lse: vec![f64::NEG_INFINITY; n_q],
                },
                &mut merge_ref,
            )?;
            let o = Mat::from_fn(n_q, d_v, |i, j| state.o[(i, j)] as f32);
            Ok((o, state.lse.iter().map(|&x| x as f32).collect()))
        };
        Some(run())
    }

    fn attention_backward(
        &self,
        q: MatRef<'_, f32>,
        k: MatRef<'_, f32>,
        v: MatRef<'_, f32>,
        grad_out: MatRef<'_, f32>,
        out: MatRef<'_, f32>,
        lse: &[f32],
        options: &Options<'_>,
    ) -> Option<Result<Gradients>> {
        Some(attn_reference::attention_backward(
            grad_out, q, k, v, out, lse, options,
        ))
    }

    fn attention_backward_batched(
        &self,
        q: Tensor4Ref<'_, f32>,
        k: Tensor4Ref<'_, f32>,
        v: Tensor4Ref<'_, f32>,
        grad_out: Tensor4Ref<'_, f32>,
        out: Tensor4Ref<'_, f32>,
        lse: &[f32],
        options: &Options<'_>,
    ) -> Option<Result<BatchGradients>> {
        Some(
            attn_reference::Attention::batched(q, k, v, options).and_then(|call| {
                call.backward(attn_reference::ForwardRef::batch(out, lse)?, grad_out)
            }),
        )
    }

    fn attention_packed(
        &self,
        q: Tensor4Ref<'_, f32>,
        k: Tensor4Ref<'_, f32>,
        v: Tensor4Ref<'_, f32>,
        seqs: &CuSeqlens<'_>,
        options: &Options<'_>,
    ) -> Option<Result<(Tensor4<f32>, Vec<f32>)>> {
        Some(
            attn_reference::Attention::packed(q, k, v, seqs, options)
                .and_then(|call| call.forward())
                .map(|f| f.into_parts()),
        )
    }

    fn attention_backward_packed(
        &self,
        q: Tensor4Ref<'_, f32>,
        k: Tensor4Ref<'_, f32>,
        v: Tensor4Ref<'_, f32>,
        grad_out: Tensor4Ref<'_, f32>,
        out: Tensor4Ref<'_, f32>,
        lse: &[f32],
        seqs: &CuSeqlens<'_>,
        options: &Options<'_>,
    ) -> Option<Result<BatchGradients>> {
        Some(
            attn_reference::Attention::packed(q, k, v, seqs, options).and_then(|call| {
                call.backward(attn_reference::ForwardRef::batch(out, lse)?, grad_out)
            }),
        )
    }
}

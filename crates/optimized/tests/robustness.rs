//! The robustness suite: generated hostile inputs at every public entry point
//! of attn-optimized, held to the amended contract by `attn_oracle::hostile`.
//!
//! What it drives: the call value `Attention` — built by `head`, `keys_of`, `batched`
//! (`split_kv` either way) — through each of its methods (`forward`, `forward_into`,
//! `partial_state` + `PartialState::merge`, `backward`, `backward_into`, in the storage
//! type or into f32 views), the textbook `attention` and `attention_backward`,
//! `PartialState::merge` on its own, `KvCache::{new, append, append_to, clear}` and its
//! `attention` calls, and `MultiHeadAttention::{forward, forward_cross, forward_train,
//! backward}`, in f32, f16 and bf16.
//!
//! Every call runs under `catch_unwind` ([`returns`]): a panic fails the property with the
//! input. Huge shapes (up to `usize::MAX` through zero-stride views) run in a child process
//! ([`isolated`], under an 8 GiB address-space limit) so that an abort or a hang is a
//! reported failure and not the end of this binary. Each property is one class of input
//! (one [`Profile`], one entry-point family), so that one failure cannot hide another
//! behind shrinking.
//!
//! The checks: an `Err` names what is wrong (the variant too where the contract fixes it);
//! an `Ok` has rows that see no key exactly 0 with LSE `-inf`, rows whose visible inputs
//! are finite finite, in the hull of their values and within the derived bound of the f64
//! reference (run on the sanitised problem, see the oracle's `hostile` module); a poison at
//! a hidden key reaches no row. The multi-head layer is checked for errors, finiteness and
//! zero rows only: its derived comparison needs projections that are exact in f32, which
//! `tests/multi_head_layer.rs` arranges with dyadic inputs and hostile inputs cannot.
//!
//! | test | what it holds the engine to |
//! |---|---|
//! | `single_head_moderate_inputs_match_the_reference` | every view, mask, option and storage type on moderate values: the reference within the derived bound, zero rows exact |
//! | `nan_at_a_structurally_hidden_key_reaches_no_row` | NaN/±inf/overflowing K, V, bias at a key hidden by causal/window/padding reach no row (items 2, 5) |
//! | `nan_at_a_key_hidden_by_neg_inf_bias_reaches_no_row` | the same for keys hidden by an additive `-inf` (item 5) |
//! | `nan_at_a_key_hidden_by_a_boolean_mask_reaches_no_row` | the same for keys hidden by a boolean mask |
//! | `hidden_poison_changes_no_other_row_bit_for_bit` | a hidden poison changes no other row's bits (the contract's "bit for bit") |
//! | `extreme_finite_biases_stay_finite` | `f32::MIN` padding, `±f32::MAX`, `±1e38` biases: finite rows, never an empty row (item 4) |
//! | `extreme_finite_queries_and_keys_stay_finite` | Q, K at the storage type's finite extremes: scores saturate, rows stay finite |
//! | `extreme_finite_values_stay_finite` | V at the finite extremes: finite rows in the hull of their values |
//! | `large_queries_with_zero_scores_are_not_nan` | huge Q entries against zero keys, valid scales up to 2e38: plain average, not NaN (item 3) |
//! | `window_bounds_and_key_lengths_at_the_extremes` | window bounds up to `usize::MAX`, key lengths beyond `n_k` (item 1) |
//! | `unbounded_window_sides_act_as_no_bound` | a `usize::MAX`-like window side is no bound (item 1) |
//! | `scales_at_the_extremes_are_honoured_or_invalid_scale` | scales from subnormal to `f32::MAX`, 0, negative, NaN, ±inf: honoured, or `InvalidScale` (item 3) |
//! | `anything_at_all_returns_and_keeps_the_contract` | everything at once, non-finite values anywhere |
//! | `batched_moderate_inputs_match_the_reference` | batched, GQA, every layout incl. zero strides, per-entry lengths, every batched entry point |
//! | `batched_hidden_poison_reaches_no_row` | hidden poisons through the batched entry points |
//! | `batched_extreme_options_and_values` | batched windows/lengths at the extremes, extreme biases (item 6: LSE with `d_v = 0`) |
//! | `batched_anything_at_all_returns_and_keeps_the_contract` | batched, everything at once, malformed operands |
//! | `merging_hostile_partial_states` | `PartialState::{new, merge}` on NaN/±inf/`-inf` LSEs, mismatched shapes; the empty state is the identity bit for bit |
//! | `merging_partial_states_with_extreme_outputs_stays_finite` | merges of finite outputs at `±f32::MAX` stay finite, in their hull |
//! | `kv_cache_calls_keep_the_contract` | sequences of `new`/`append`/`append_to`/`clear`/`attend*` with malformed blocks, masks, scales, windows, non-finite tokens; the cache holds exactly what was appended |
//! | `kv_cache_extreme_tokens_stay_finite` | the same with tokens at the finite extremes |
//! | `multi_head_layer_keeps_the_contract` | `forward`/`forward_cross` with poisons at hidden inputs, wrong widths: errors, finite rows, zero rows |
//! | `huge_single_head_shapes_fail_before_any_work` | broadcast views up to `usize::MAX` rows: `Error::Allocation` or the operand's error, no abort (items 9, 11) |
//! | `huge_batched_shapes_fail_before_any_work` | the same for `[B, H, S, D]` dims up to `usize::MAX` on every axis (items 9–11) |
//! | `huge_kv_cache_sizes_are_errors` | huge caches, broadcast appends of 2^40..`usize::MAX` tokens, huge queries (item 8) |
//! | `huge_multi_head_inputs_are_errors` | a layer over 2^40.. broadcast rows (item 11) |
//! | `backward_moderate_inputs_match_the_reference` | single-head backward (owned and `_into`, f32 or storage-type gradients, every view) on the forward's own `(O, LSE)`: gradients shaped like their operands, dQ of rows that see nothing and dK/dV of keys no row sees exactly 0, finite rows within `head_backward_bound` of the reference; malformed `dO`/`O`/LSE/dK name the operand |
//! | `backward_poison_at_hidden_keys_and_empty_rows_reaches_no_gradient` | NaN/±inf/overflowing K, V, bias at keys hidden by structure, `-inf` or a boolean mask, and NaN Q/dO rows of rows that see nothing (plus a NaN/±inf in one dO entry): reach only the gradient rows the contract lets them |
//! | `backward_extreme_options_keep_the_contract` | the same checks with windows/key lengths at the extremes and `f32::MIN`/`±f32::MAX` biases |
//! | `backward_anything_with_arbitrary_forward_results_returns` | everything at once, with arbitrary (non-finite) `O` and LSE: returns, errors name the operand, zero rows stay exactly 0 |
//! | `batched_backward_moderate_and_poisoned_inputs_keep_the_contract` | batched/GQA backward (owned and `_into`, every layout incl. broadcast): per-head dQ, group-summed dK/dV against the summed references and bounds, hidden poisons |
//! | `batched_backward_anything_returns` | batched backward, everything at once, malformed operands and arbitrary `O`/LSE |
//! | `huge_backward_shapes_fail_before_any_work` | broadcast views up to `usize::MAX` rows through `attention_backward`: `Error::Allocation` (dQ/dK/dV) or the operand's error, no abort |
//! | `multi_head_backward_with_mismatched_activations_is_an_error` | `MultiHeadAttention::backward` with another layer's activations, other inputs, a `dY` of the wrong shape: typed errors naming the operand |
//!
//! Default case counts keep the whole file under ~30 s on 2 cores in the test profile;
//! `PROPTEST_CASES` replaces them for deep runs. Failures persist under
//! `proptest-regressions/robustness/<property>.txt` and are replayed first.

mod engine;

use std::time::Duration;

use attn_core::MultiHeadWeights;
use attn_optimized::{
    Attention, BoolMask, Causal, ColMut, Element, ForwardRef, GradientsMut, Growth, KvCache,
    MultiHeadAttention, Options, Par, PartialState, SlidingWindow, SplitKv, Tensor4Mut, Tensor4Ref,
    attention, attention_backward,
};
use attn_oracle::hostile::{
    BatchExpected, Expected, Fill, GradExpected, Hiding, HostileBatch, HostileConfig, HostileHead,
    HostileInputs, HostileTensor, HugeBatch, HugeHead, Len, Outputs, Profile, Rejection, RowClass,
    Special, StoredMat, StoredOut, TensorView, UNALLOCATABLE, View, broadcast_rows,
    broadcast_tensor, check_batched, check_batched_backward, check_batched_released, check_error,
    check_head, check_head_backward, check_merge, expect_batched, expect_batched_backward,
    expect_head, expect_head_backward, extreme_scales, extreme_window_side, hostile_batch,
    hostile_head, huge_batch, huge_head, isolated, len, merge_case, options_of, product, returns,
    run_property, scale_is_valid, structurally_visible,
};
use attn_oracle::{Dtype, Rng};
use engine::{model, tiles, widen};
use faer::{Mat, MatRef};
use proptest::prelude::*;
use proptest::sample::select;

// ---------------------------------------------------------------------------------------
// Set-up.

fn config() -> HostileConfig {
    HostileConfig::for_crate(env!("CARGO_MANIFEST_DIR"), "robustness")
}

fn assert_holds(result: Result<(), String>) {
    if let Err(m) = result {
        panic!("{m}");
    }
}

/// Runs `$body` with `$t` the storage type of `$dtype`.
macro_rules! with_dtype {
    ($dtype:expr, $t:ident => $body:expr) => {
        match $dtype {
            Dtype::F32 => {
                type $t = f32;
                $body
            }
            Dtype::F16 => {
                type $t = half::f16;
                $body
            }
            Dtype::Bf16 => {
                type $t = half::bf16;
                $body
            }
        }
    };
}

/// `expected` with the extra defects of the call itself (a caller's buffer of the wrong
/// shape): the call must then fail, with any error that names one of the defects.
fn with_defects(expected: Expected, extra: Vec<Rejection>) -> Expected {
    if extra.is_empty() {
        return expected;
    }
    match expected {
        Expected::Reject(mut r) => {
            r.extend(extra);
            Expected::Reject(r)
        }
        _ => Expected::Reject(extra),
    }
}

/// `Attention::head(..).forward`: the output and the LSE.
fn forward_head<T: Element>(
    q: MatRef<'_, T>,
    k: MatRef<'_, T>,
    v: MatRef<'_, T>,
    opts: &Options<'_>,
) -> Result<(Mat<T>, Vec<f32>), attn_core::Error> {
    Attention::head(q, k, v, opts)
        .and_then(|call| call.forward(Par::rayon(0)))
        .map(|f| f.into_parts())
}

/// `Attention::batched(..).forward`: the output and the LSE.
fn forward_batched<T: Element>(
    q: Tensor4Ref<'_, T>,
    k: Tensor4Ref<'_, T>,
    v: Tensor4Ref<'_, T>,
    opts: &Options<'_>,
) -> Result<(attn_core::Tensor4<T>, Vec<f32>), attn_core::Error> {
    Attention::batched(q, k, v, opts)
        .and_then(|call| call.forward(Par::rayon(0)))
        .map(|f| f.into_parts())
}

/// The values the tests make themselves, from the oracle's generator.
struct Gen(Rng);

impl Gen {
    fn new(seed: u64) -> Self {
        Gen(Rng::from_state(seed))
    }

    fn next(&mut self) -> u64 {
        self.0.next_u64()
    }

    fn fill(&mut self, fill: Fill, dtype: Dtype) -> f32 {
        let unit = (self.0.unit() * 2.0 - 1.0) as f32;
        let x = match fill {
            Fill::Zero => 0.0,
            Fill::Ties => (self.next() % 5) as f32 - 2.0,
            Fill::Large => unit * 35.0,
            Fill::Extreme if self.next().is_multiple_of(2) => {
                [f32::MAX, f32::MIN, 1e38, -1e30, f32::MIN_POSITIVE, -0.0]
                    [(self.next() % 6) as usize]
            }
            Fill::NonFinite if self.next().is_multiple_of(4) => {
                [f32::NAN, f32::INFINITY, f32::NEG_INFINITY][(self.next() % 3) as usize]
            }
            _ => unit,
        };
        dtype.round(x)
    }

    fn mat(&mut self, rows: usize, cols: usize, fill: Fill, dtype: Dtype) -> Mat<f32> {
        let data: Vec<f32> = (0..rows * cols).map(|_| self.fill(fill, dtype)).collect();
        Mat::from_fn(rows, cols, |i, j| data[i * cols + j])
    }
}

// ---------------------------------------------------------------------------------------
// Single head: the textbook `attention`, and `Attention::head`'s `forward`, `forward_into`;
// `Attention::keys_of`'s `partial_state` + `PartialState::merge`.

/// A defect of the caller's buffers in `forward_into`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum IntoDefect {
    OutRows,
    OutCols,
    LseLength,
}

/// A defect of the key range of `Attention::keys_of`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ShardDefect {
    /// The range ends past `n_k_total`.
    Beyond,
    /// The range is one key longer than the shard.
    Longer,
    /// `start > end`.
    Backwards,
}

/// How a single-head case is run: the textbook function, or a method of the call value.
#[derive(Debug, Clone, Copy, PartialEq)]
enum HeadCall {
    /// The free `attention` (output only).
    Textbook,
    /// `Attention::head(..).forward`: output and LSE.
    Forward,
    /// `Attention::head(..).forward_into` a caller's views.
    ForwardInto {
        out: View,
        lse: bool,
        f32_out: bool,
        defect: Option<IntoDefect>,
    },
    /// `Attention::keys_of(..).partial_state` of two shards, merged.
    PartialState {
        cut_permille: u16,
        reversed: bool,
        defect: Option<ShardDefect>,
    },
}

fn head_call() -> BoxedStrategy<HeadCall> {
    prop_oneof![
        Just(HeadCall::Textbook),
        Just(HeadCall::Forward),
        (
            select(View::ALL.to_vec()),
            any::<bool>(),
            any::<bool>(),
            proptest::option::weighted(
                0.15,
                select(vec![
                    IntoDefect::OutRows,
                    IntoDefect::OutCols,
                    IntoDefect::LseLength
                ])
            ),
        )
            .prop_map(|(out, lse, f32_out, defect)| HeadCall::ForwardInto {
                out,
                lse,
                f32_out,
                defect,
            }),
        (
            0u16..=1000,
            any::<bool>(),
            proptest::option::weighted(
                0.15,
                select(vec![
                    ShardDefect::Beyond,
                    ShardDefect::Longer,
                    ShardDefect::Backwards
                ])
            ),
        )
            .prop_map(|(cut_permille, reversed, defect)| HeadCall::PartialState {
                cut_permille,
                reversed,
                defect,
            }),
    ]
    .boxed()
}

fn run_head_case(case: &HostileHead, call: HeadCall) -> Result<(), String> {
    with_dtype!(case.dtype, T => run_head::<T>(case, call))
}

fn run_head<T: Element>(case: &HostileHead, call: HeadCall) -> Result<(), String> {
    let inputs = case.build();
    let [qs, ks, vs] = inputs.stored(T::from_f32);
    let (q, k, v) = (qs.view(), ks.view(), vs.view());
    let (qf, kf, vf) = (inputs.q.as_ref(), inputs.k.as_ref(), inputs.v.as_ref());
    let opts = inputs.options();
    let storage = T::DTYPE;
    let [n_q, n_k, _, d_v] = inputs.dims();
    match call {
        HeadCall::Textbook => {
            let mut want = expect_head(
                qf,
                kf,
                vf,
                &opts,
                &model(storage, storage),
                Outputs::OUTPUT,
                0,
            );
            want.release(&inputs.planted);
            if matches!(want, Expected::TooMuchWork) {
                return Ok(());
            }
            let got = returns("attention", || attention(q, k, v, &opts))?;
            let got = got.map(|o| widen(o.as_ref()));
            check_head(
                &want,
                got.as_ref()
                    .map(|o| (o.as_ref(), None))
                    .map_err(Clone::clone),
            )
            .map_err(|m| format!("attention: {m}"))
        }
        HeadCall::Forward => {
            let mut want = expect_head(
                qf,
                kf,
                vf,
                &opts,
                &model(storage, storage),
                Outputs::WITH_LSE,
                0,
            );
            want.release(&inputs.planted);
            if matches!(want, Expected::TooMuchWork) {
                return Ok(());
            }
            let got = returns("Attention::forward", || forward_head(q, k, v, &opts))?;
            let got = got.map(|(o, l)| (widen(o.as_ref()), l));
            check_head(
                &want,
                got.as_ref()
                    .map(|(o, l)| (o.as_ref(), Some(l.as_slice())))
                    .map_err(Clone::clone),
            )
            .map_err(|m| format!("Attention::forward: {m}"))
        }
        HeadCall::ForwardInto {
            out,
            lse,
            f32_out,
            defect,
        } => {
            let out_type = if f32_out { Dtype::F32 } else { storage };
            let mut want = expect_head(
                qf,
                kf,
                vf,
                &opts,
                &model(storage, out_type),
                Outputs::NONE,
                0,
            );
            want.release(&inputs.planted);
            if matches!(want, Expected::TooMuchWork) {
                return Ok(());
            }
            let (rows, cols, lse_len) = match defect {
                Some(IntoDefect::OutRows) => (n_q + 1, d_v, n_q),
                Some(IntoDefect::OutCols) => (n_q, d_v + 1, n_q),
                Some(IntoDefect::LseLength) => (n_q, d_v, n_q + 1),
                None => (n_q, d_v, n_q),
            };
            let mut extra = Vec::new();
            match defect {
                Some(IntoDefect::OutRows | IntoDefect::OutCols) => {
                    extra.push(Rejection::named("the output is n_q × d_v", &["output"]));
                }
                Some(IntoDefect::LseLength) if lse => {
                    extra.push(Rejection::named("one LSE per query row", &["LSE"]));
                }
                _ => {}
            }
            let want = with_defects(want, extra);
            let mut lse_buf = vec![f32::NAN; lse_len];
            let (written, result) = if f32_out {
                let mut o = StoredOut::new(rows, cols, out, f32::NAN);
                let r = returns("Attention::forward_into", || {
                    Attention::head(q, k, v, &opts).and_then(|call| {
                        call.forward_into(
                            o.view_mut(),
                            lse.then_some(lse_buf.as_mut_slice())
                                .map(ColMut::from_slice_mut),
                            Par::rayon(0),
                        )
                    })
                })?;
                (o.read(|x| x), r)
            } else {
                let mut o = StoredOut::new(rows, cols, out, T::from_f32(f32::NAN));
                let r = returns("Attention::forward_into", || {
                    Attention::head(q, k, v, &opts).and_then(|call| {
                        call.forward_into(
                            o.view_mut(),
                            lse.then_some(lse_buf.as_mut_slice())
                                .map(ColMut::from_slice_mut),
                            Par::rayon(0),
                        )
                    })
                })?;
                (o.read(T::to_f32), r)
            };
            let got = result.map(|()| (written.as_ref(), lse.then_some(lse_buf.as_slice())));
            check_head(&want, got).map_err(|m| format!("Attention::forward_into: {m}"))
        }
        HeadCall::PartialState {
            cut_permille,
            reversed,
            defect,
        } => {
            let mut want = expect_head(
                qf,
                kf,
                vf,
                &opts,
                &model(storage, Dtype::F32),
                Outputs::WITH_LSE,
                1,
            );
            want.release(&inputs.planted);
            if matches!(want, Expected::TooMuchWork) {
                return Ok(());
            }
            let cut = n_k * usize::from(cut_permille.min(1000)) / 1000;
            // The shard `rows` (start, count) of K and V as the keys `keys` of `n_k`.
            let shard = |rows: (usize, usize), keys: core::ops::Range<usize>| {
                returns("Attention::partial_state", || {
                    Attention::keys_of(
                        q,
                        k.subrows(rows.0, rows.1),
                        v.subrows(rows.0, rows.1),
                        keys,
                        n_k,
                        &opts,
                    )
                    .and_then(|call| call.partial_state(Par::rayon(0)))
                })
            };
            if let Some(d) = defect {
                let (rows, keys) = match d {
                    ShardDefect::Beyond => ((cut, n_k - cut), cut + 1..n_k + 1),
                    ShardDefect::Longer => ((0, cut), 0..cut + 1),
                    ShardDefect::Backwards => ((cut, 0), cut + 1..cut),
                };
                let want = with_defects(
                    want,
                    vec![Rejection::named(
                        "a shard holds exactly its key range, inside n_k_total",
                        &["shard", "key range"],
                    )],
                );
                return match shard(rows, keys)? {
                    Ok(_) => {
                        Err("Attention::keys_of accepted a shard that is not its key range".into())
                    }
                    Err(e) => {
                        check_error(&want, &e).map_err(|m| format!("Attention::partial_state: {m}"))
                    }
                };
            }
            let (a, b) = (shard((0, cut), 0..cut)?, shard((cut, n_k - cut), cut..n_k)?);
            let merged = match (a, b) {
                (Ok(a), Ok(b)) => {
                    let m = returns("PartialState::merge", || {
                        if reversed { b.merge(&a) } else { a.merge(&b) }
                    })?;
                    m.map_err(|e| format!("merging two shards of one head failed: {e}"))?
                }
                (Err(e), _) | (_, Err(e)) => {
                    return check_head(&want, Err(e))
                        .map_err(|m| format!("Attention::partial_state: {m}"));
                }
            };
            check_head(&want, Ok((merged.output(), Some(merged.lse()))))
                .map_err(|m| format!("Attention::partial_state + merge (cut at {cut}): {m}"))
        }
    }
}

/// One `#[test]` per profile: `$run(name, profile, cases)`.
macro_rules! profile_tests {
    (
        $run:ident:
        $($(#[$doc:meta])* $test:ident: $name:literal, $profile:expr, $cases:literal;)*
    ) => {
        $(
            $(#[$doc])*
            #[test]
            fn $test() {
                $run($name, $profile, $cases);
            }
        )*
    };
}

fn single_head_property(name: &str, profile: Profile, cases: u32) {
    assert_holds(run_property(
        name,
        &config(),
        cases,
        (hostile_head(profile, &tiles()), head_call()),
        |(case, call)| run_head_case(case, *call),
    ));
}

profile_tests! { single_head_property:
    single_head_moderate_inputs_match_the_reference:
        "single_head_moderate", Profile::Moderate, 1536;
    nan_at_a_structurally_hidden_key_reaches_no_row:
        "single_head_poison_structural", Profile::Poison(Hiding::Structural), 1536;
    nan_at_a_key_hidden_by_neg_inf_bias_reaches_no_row:
        "single_head_poison_neg_inf_bias", Profile::Poison(Hiding::NegInfBias), 1536;
    nan_at_a_key_hidden_by_a_boolean_mask_reaches_no_row:
        "single_head_poison_bool_mask", Profile::Poison(Hiding::BoolMask), 1536;
    extreme_finite_biases_stay_finite:
        "single_head_extreme_bias", Profile::ExtremeBias, 1024;
    extreme_finite_queries_and_keys_stay_finite:
        "single_head_extreme_qk", Profile::ExtremeQk, 1024;
    extreme_finite_values_stay_finite:
        "single_head_extreme_v", Profile::ExtremeV, 1024;
    window_bounds_and_key_lengths_at_the_extremes:
        "single_head_windows", Profile::Windows, 1536;
    scales_at_the_extremes_are_honoured_or_invalid_scale:
        "single_head_scales", Profile::Scales, 1024;
    anything_at_all_returns_and_keeps_the_contract:
        "single_head_anything", Profile::Anything, 1536;
}

/// Item 1 of the issue, named: a window bound of `usize::MAX` on one side is no bound, so
/// `(usize::MAX, 0)` is plain causal and `(0, usize::MAX)` plain anti-causal, on any shape.
#[test]
fn unbounded_window_sides_act_as_no_bound() {
    assert_holds(run_property(
        "window_side_max_is_no_bound",
        &config(),
        768,
        (
            1..=9usize,
            1..=9usize,
            1..=4usize,
            extreme_window_side(),
            select(vec![Causal::TopLeft, Causal::BottomRight]),
            any::<bool>(),
            any::<u64>(),
        ),
        |&(n_q, n_k, d, side, align, left, seed)| {
            let mut g = Gen::new(seed);
            let q = g.mat(n_q, d, Fill::Unit, Dtype::F32);
            let kv = g.mat(n_k, d, Fill::Unit, Dtype::F32);
            let w = if left {
                SlidingWindow::new(side, Some(0), align)
            } else {
                SlidingWindow::new(Some(0), side, align)
            };
            let opts = Options::default().with_window(w);
            let want = expect_head(
                q.as_ref(),
                kv.as_ref(),
                kv.as_ref(),
                &opts,
                &model(Dtype::F32, Dtype::F32),
                Outputs::WITH_LSE,
                0,
            );
            let got = returns("Attention::forward", || {
                forward_head(q.as_ref(), kv.as_ref(), kv.as_ref(), &opts)
            })?;
            check_head(
                &want,
                got.as_ref()
                    .map(|(o, l)| (o.as_ref(), Some(l.as_slice())))
                    .map_err(Clone::clone),
            )
            .map_err(|m| format!("window {w:?} on {n_q}×{n_k}: {m}"))
        },
    ));
}

/// The contract's last word on poisons: rows that do not see a poisoned position are
/// unaffected, bit for bit — the same call with `-0.0` where the poisons were gives the
/// same bits in every row the poison must not reach.
#[test]
fn hidden_poison_changes_no_other_row_bit_for_bit() {
    assert_holds(run_property(
        "poison_bit_for_bit",
        &config(),
        1536,
        prop_oneof![
            hostile_head(Profile::Poison(Hiding::Structural), &tiles()),
            hostile_head(Profile::Poison(Hiding::NegInfBias), &tiles()),
            hostile_head(Profile::Poison(Hiding::BoolMask), &tiles()),
        ],
        |case| with_dtype!(case.dtype, T => same_bits::<T>(case)),
    ));
}

fn same_bits<T: Element>(case: &HostileHead) -> Result<(), String> {
    // The same strides in both runs (a broadcast view falls back to a padded one when a
    // plant makes the rows differ, and the kernel may depend on the layout).
    let mut case = case.clone();
    for v in &mut case.views {
        if *v == View::Broadcast {
            *v = View::Padded;
        }
    }
    let mut clean_case = case.clone();
    for p in &mut clean_case.plants {
        p.value = Special::NegZero;
    }
    let (poisoned, clean) = (case.build(), clean_case.build());
    let run = |inputs: &HostileInputs| {
        let [qs, ks, vs] = inputs.stored(T::from_f32);
        let opts = inputs.options();
        returns("Attention::forward", || {
            forward_head(qs.view(), ks.view(), vs.view(), &opts)
        })
    };
    let (a, b) = (run(&poisoned)?, run(&clean)?);
    let ((oa, la), (ob, lb)) = match (a, b) {
        (Ok(a), Ok(b)) => (a, b),
        (Err(_), Err(_)) => return Ok(()),
        (Ok(_), Err(e)) | (Err(e), Ok(_)) => {
            return Err(format!("only one of the two calls failed: {e}"));
        }
    };
    let mut want = expect_head(
        poisoned.q.as_ref(),
        poisoned.k.as_ref(),
        poisoned.v.as_ref(),
        &poisoned.options(),
        &model(T::DTYPE, T::DTYPE),
        Outputs::WITH_LSE,
        0,
    );
    want.release(&poisoned.planted);
    let Some(rows) = want.rows() else {
        return Ok(());
    };
    for (i, class) in rows.iter().enumerate() {
        if *class == RowClass::Touched {
            continue;
        }
        let same = la[i].to_bits() == lb[i].to_bits()
            && (0..oa.ncols())
                .all(|c| oa[(i, c)].to_f32().to_bits() == ob[(i, c)].to_f32().to_bits());
        if !same {
            let c = (0..oa.ncols())
                .find(|&c| oa[(i, c)].to_f32().to_bits() != ob[(i, c)].to_f32().to_bits());
            return Err(format!(
                "row {i} does not see a poison ({:?}), but its result changed: LSE {:e} vs {:e}{}",
                poisoned.planted,
                la[i],
                lb[i],
                c.map(|c| format!(
                    ", output[{i}, {c}] {:e} vs {:e}",
                    oa[(i, c)].to_f32(),
                    ob[(i, c)].to_f32()
                ))
                .unwrap_or_default()
            ));
        }
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------
// Batched.

/// Which method of `Attention::batched`'s call, and how.
#[derive(Debug, Clone, Copy, PartialEq)]
enum BatchCall {
    /// `forward`, with this split-KV policy (`None`: the call's default); the LSE checked
    /// or not.
    Forward { split: Option<SplitKv>, lse: bool },
    /// `forward_into` a caller's view.
    ForwardInto {
        layout: TensorView,
        f32_out: bool,
        defect: bool,
    },
}

fn batch_call() -> BoxedStrategy<BatchCall> {
    prop_oneof![
        (
            select(vec![None, Some(SplitKv::Auto), Some(SplitKv::Never)]),
            any::<bool>(),
        )
            .prop_map(|(split, lse)| BatchCall::Forward { split, lse }),
        (
            select(vec![TensorView::Bhsd, TensorView::Bshd, TensorView::Padded]),
            any::<bool>(),
            proptest::bool::weighted(0.1),
        )
            .prop_map(|(layout, f32_out, defect)| BatchCall::ForwardInto {
                layout,
                f32_out,
                defect,
            }),
    ]
    .boxed()
}

fn run_batch_case(case: &HostileBatch, call: BatchCall) -> Result<(), String> {
    with_dtype!(case.head.dtype, T => run_batch::<T>(case, call))
}

/// Strides of an output view in `layout` (Padded: gaps after rows and batch entries).
fn out_strides(layout: TensorView, dims: [usize; 4]) -> [usize; 3] {
    let [_, h, s, d] = dims;
    match layout {
        TensorView::Bshd => attn_core::Layout::Bshd.strides(dims),
        TensorView::Padded => [s * h * (d + 3) + 5, d + 3, h * (d + 3)],
        _ => attn_core::Layout::Bhsd.strides(dims),
    }
}

fn buffer_len(dims: [usize; 4], s: [usize; 3]) -> usize {
    if dims.contains(&0) {
        0
    } else {
        (dims[0] - 1) * s[0] + (dims[1] - 1) * s[1] + (dims[2] - 1) * s[2] + dims[3]
    }
}

fn run_batch<T: Element>(case: &HostileBatch, call: BatchCall) -> Result<(), String> {
    let inputs = case.build();
    let opts = inputs.options();
    let (qf, kf, vf) = (inputs.q.view(), inputs.k.view(), inputs.v.view());
    let (qd, kd, vd) = (
        inputs.q.convert(T::from_f32),
        inputs.k.convert(T::from_f32),
        inputs.v.convert(T::from_f32),
    );
    let (q, k, v) = (
        tview(&qd, inputs.q.dims, inputs.q.strides),
        tview(&kd, inputs.k.dims, inputs.k.strides),
        tview(&vd, inputs.v.dims, inputs.v.strides),
    );
    let storage = T::DTYPE;
    let outputs = match call {
        BatchCall::Forward { lse: true, .. } => Outputs::WITH_LSE,
        BatchCall::Forward { lse: false, .. } => Outputs::OUTPUT,
        BatchCall::ForwardInto { .. } => Outputs::NONE,
    };
    let want = expect_batched(qf.dims(), kf.dims(), vf.dims(), &opts, outputs);
    if matches!(want, BatchExpected::TooMuchWork) {
        return Ok(());
    }
    let widen_t = |t: attn_core::Tensor4<T>| -> attn_core::Tensor4<f32> {
        let dims = t.dims();
        attn_core::Tensor4::from_vec(t.into_vec().into_iter().map(T::to_f32).collect(), dims)
            .expect("same dims")
    };
    let check =
        |name: &str,
         out_type: Dtype,
         got: Result<(attn_core::Tensor4<f32>, Option<Vec<f32>>), attn_core::Error>| {
            let got = got
                .as_ref()
                .map(|(t, l)| (t.as_ref(), l.as_deref()))
                .map_err(Clone::clone);
            check_batched_released(
                &want,
                [qf, kf, vf],
                &opts,
                &model(storage, out_type),
                &inputs.head.planted,
                got,
            )
            .map_err(|m| format!("{name}: {m}"))
        };
    match call {
        BatchCall::Forward { split, lse } => {
            let got = returns("Attention::forward", || {
                Attention::batched(q, k, v, &opts)
                    .map(|call| match split {
                        Some(split) => call.split_kv(split),
                        None => call,
                    })
                    .and_then(|call| call.forward(Par::rayon(0)))
                    .map(|f| f.into_parts())
            })?;
            check(
                &format!("Attention::forward (split {split:?})"),
                storage,
                got.map(|(t, l)| (widen_t(t), lse.then_some(l))),
            )
        }
        BatchCall::ForwardInto {
            layout,
            f32_out,
            defect,
        } => {
            let dims = match &want {
                BatchExpected::Accept { dims, .. } => *dims,
                _ => {
                    let [b, h, n, _] = qf.dims();
                    [b, h, n, vf.dims()[3]]
                }
            };
            let mut out_dims = dims;
            if defect {
                out_dims[2] += 1;
            }
            if out_dims
                .iter()
                .try_fold(1usize, |a, &x| a.checked_mul(x))
                .is_none_or(|n| n > 1 << 22)
            {
                return Ok(());
            }
            let strides = out_strides(layout, out_dims);
            let n = buffer_len(out_dims, strides);
            let want = if defect {
                match want {
                    BatchExpected::Reject(mut r) => {
                        r.push(Rejection::named("the output's dims", &["output"]));
                        BatchExpected::Reject(r)
                    }
                    _ => BatchExpected::Reject(vec![Rejection::named(
                        "the output's dims",
                        &["output"],
                    )]),
                }
            } else {
                want
            };
            let read = |buf: Vec<f32>| {
                let t = tview(&buf, out_dims, strides);
                let mut dense = Vec::with_capacity(out_dims.iter().product());
                for b in 0..out_dims[0] {
                    for h in 0..out_dims[1] {
                        let m = t.head(b, h).expect("in range");
                        for i in 0..out_dims[2] {
                            for c in 0..out_dims[3] {
                                dense.push(m[(i, c)]);
                            }
                        }
                    }
                }
                attn_core::Tensor4::from_vec(dense, out_dims).expect("dense")
            };
            let result = if f32_out {
                let mut buf = vec![f32::NAN; n];
                let r = returns("Attention::forward_into", || {
                    let out = Tensor4Mut::new(&mut buf, out_dims, strides)?;
                    Attention::batched(q, k, v, &opts)
                        .and_then(|call| call.forward_into(out, None, Par::rayon(0)))
                })?;
                r.map(|()| read(buf))
            } else {
                let mut buf = vec![T::from_f32(f32::NAN); n];
                let r = returns("Attention::forward_into", || {
                    let out = Tensor4Mut::new(&mut buf, out_dims, strides)?;
                    Attention::batched(q, k, v, &opts)
                        .and_then(|call| call.forward_into(out, None, Par::rayon(0)))
                })?;
                r.map(|()| read(buf.into_iter().map(T::to_f32).collect()))
            };
            let got = result
                .as_ref()
                .map(|t| (t.as_ref(), None))
                .map_err(Clone::clone);
            let out_type = if f32_out { Dtype::F32 } else { storage };
            check_batched_released(
                &want,
                [qf, kf, vf],
                &opts,
                &model(storage, out_type),
                &inputs.head.planted,
                got,
            )
            .map_err(|m| format!("Attention::batched().forward_into({layout:?}): {m}"))
        }
    }
}

/// `Tensor4Ref::new` for views the test built to fit.
fn tview<T>(data: &[T], dims: [usize; 4], strides: [usize; 3]) -> Tensor4Ref<'_, T> {
    Tensor4Ref::new(data, dims, strides).expect("the test built the buffer to fit")
}

/// A broadcast view of one row (every stride 0).
fn bview<T>(row: &[T], dims: [usize; 4]) -> Result<Tensor4Ref<'_, T>, String> {
    broadcast_tensor(row, dims).map_err(|e| format!("a broadcast view was rejected: {e}"))
}

fn batched_property(name: &str, profile: Profile, cases: u32) {
    assert_holds(run_property(
        name,
        &config(),
        cases,
        (hostile_batch(profile, &tiles()), batch_call()),
        |(case, call)| run_batch_case(case, *call),
    ));
}

profile_tests! { batched_property:
    batched_moderate_inputs_match_the_reference:
        "batched_moderate", Profile::Moderate, 768;
    batched_anything_at_all_returns_and_keeps_the_contract:
        "batched_anything", Profile::Anything, 768;
}

#[test]
fn batched_hidden_poison_reaches_no_row() {
    batched_property(
        "batched_poison_neg_inf_bias",
        Profile::Poison(Hiding::NegInfBias),
        512,
    );
    batched_property(
        "batched_poison_structural",
        Profile::Poison(Hiding::Structural),
        512,
    );
}

#[test]
fn batched_extreme_options_and_values() {
    batched_property("batched_windows", Profile::Windows, 512);
    batched_property("batched_extreme_bias", Profile::ExtremeBias, 384);
}

// ---------------------------------------------------------------------------------------
// PartialState::merge on its own.

fn merge_property(name: &str, extreme: bool) {
    assert_holds(run_property(
        name,
        &config(),
        1536,
        (merge_case(extreme), any::<bool>()),
        |&(case, short_lse)| {
            let (a, b) = case.build();
            // A state whose LSE count differs from its rows is rejected, naming the LSE.
            if short_lse {
                let mut lse = a.lse.clone();
                lse.push(0.0);
                let r = returns("PartialState::new", || {
                    PartialState::new(a.output.clone(), lse)
                })?;
                return match r {
                    Ok(_) => Err("PartialState::new accepted an LSE per row too many".into()),
                    Err(e) => check_error(
                        &Expected::Reject(vec![Rejection::named("one LSE per row", &["LSE"])]),
                        &e,
                    ),
                };
            }
            let sa = PartialState::new(a.output.clone(), a.lse.clone())
                .map_err(|e| format!("a well-formed state was rejected: {e}"))?;
            let sb = PartialState::new(b.output.clone(), b.lse.clone())
                .map_err(|e| format!("a well-formed state was rejected: {e}"))?;
            let merged = returns("PartialState::merge", || sa.merge(&sb))?;
            check_merge(
                (a.output.as_ref(), &a.lse),
                (b.output.as_ref(), &b.lse),
                merged
                    .as_ref()
                    .map(|m| (m.output(), m.lse()))
                    .map_err(Clone::clone),
            )?;
            // The empty state is the identity, bit for bit, on either side.
            let empty = PartialState::empty(a.output.nrows(), a.output.ncols());
            let left = returns("PartialState::merge", || empty.merge(&sa))?;
            let right = returns("PartialState::merge", || sa.merge(&empty))?;
            for (what, m) in [("empty·a", left), ("a·empty", right)] {
                let m = m.map_err(|e| format!("{what}: {e}"))?;
                let same = m
                    .lse()
                    .iter()
                    .zip(&a.lse)
                    .all(|(x, y)| x.to_bits() == y.to_bits())
                    && (0..a.output.nrows()).all(|i| {
                        (0..a.output.ncols())
                            .all(|c| m.output()[(i, c)].to_bits() == a.output[(i, c)].to_bits())
                    });
                if !same {
                    return Err(format!("{what} is not a, bit for bit"));
                }
            }
            Ok(())
        },
    ));
}

#[test]
fn merging_hostile_partial_states() {
    merge_property("merge_hostile_states", false);
}

#[test]
fn merging_partial_states_with_extreme_outputs_stays_finite() {
    merge_property("merge_extreme_states", true);
}

// ---------------------------------------------------------------------------------------
// KvCache.

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum AppendDefect {
    Batch,
    KHeads,
    VHeads,
    KWidth,
    VWidth,
    Tokens,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum AttendCall {
    Plain,
    WithLse,
    With(bool),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum AttendExtra {
    BoolMask,
    Additive,
    KeyLength,
    QBatch,
    QWidth,
    Heads,
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum CacheOp {
    Append {
        tokens: usize,
        layout: TensorView,
        defect: Option<AppendDefect>,
    },
    AppendTo {
        b: usize,
        tokens: usize,
        layout: TensorView,
        defect: Option<AppendDefect>,
    },
    Clear {
        b: usize,
    },
    Attend {
        n_q: usize,
        group: usize,
        call: AttendCall,
        scale: Option<f32>,
        causal: Option<Causal>,
        window: Option<SlidingWindow>,
        extra: Option<AttendExtra>,
    },
}

#[derive(Debug, Clone, PartialEq)]
struct CacheCase {
    batch: usize,
    kv_heads: usize,
    capacity: usize,
    d_k: usize,
    d_v: usize,
    double: bool,
    fill: Fill,
    dtype: Dtype,
    ops: Vec<CacheOp>,
    seed: u64,
}

fn layout() -> BoxedStrategy<TensorView> {
    select(vec![
        TensorView::Bhsd,
        TensorView::Bshd,
        TensorView::Padded,
        TensorView::Broadcast,
    ])
    .boxed()
}

fn append_defect() -> BoxedStrategy<Option<AppendDefect>> {
    proptest::option::weighted(
        0.15,
        select(vec![
            AppendDefect::Batch,
            AppendDefect::KHeads,
            AppendDefect::VHeads,
            AppendDefect::KWidth,
            AppendDefect::VWidth,
            AppendDefect::Tokens,
        ]),
    )
    .boxed()
}

fn cache_op() -> BoxedStrategy<CacheOp> {
    let mut scales = extreme_scales();
    scales.extend([0.5, 1.0, 0.125]);
    prop_oneof![
        3 => (0..=5usize, layout(), append_defect())
            .prop_map(|(tokens, layout, defect)| CacheOp::Append { tokens, layout, defect }),
        2 => (0..=3usize, 0..=5usize, layout(), append_defect()).prop_map(
            |(b, tokens, layout, defect)| CacheOp::AppendTo { b, tokens, layout, defect }
        ),
        1 => (0..=3usize).prop_map(|b| CacheOp::Clear { b }),
        4 => (
            (0..=3usize, 1..=3usize),
            prop_oneof![
                Just(AttendCall::Plain),
                Just(AttendCall::WithLse),
                any::<bool>().prop_map(AttendCall::With)
            ],
            proptest::option::weighted(0.4, select(scales)),
            proptest::option::weighted(
                0.6,
                select(vec![Causal::BottomRight, Causal::TopLeft])
            ),
            proptest::option::weighted(
                0.4,
                (
                    extreme_window_side(),
                    extreme_window_side(),
                    select(vec![Causal::BottomRight, Causal::TopLeft])
                )
                    .prop_map(|(l, r, a)| SlidingWindow::new(l, r, a))
            ),
            proptest::option::weighted(
                0.15,
                select(vec![
                    AttendExtra::BoolMask,
                    AttendExtra::Additive,
                    AttendExtra::KeyLength,
                    AttendExtra::QBatch,
                    AttendExtra::QWidth,
                    AttendExtra::Heads,
                ])
            ),
        )
            .prop_map(|((n_q, group), call, scale, causal, window, extra)| CacheOp::Attend {
                n_q,
                group,
                call,
                scale,
                causal,
                window,
                extra,
            }),
    ]
    .boxed()
}

/// Cache sequences whose tokens are drawn from `fills`.
fn cache_case(fills: Vec<Fill>) -> BoxedStrategy<CacheCase> {
    (
        (
            0..=3usize,
            prop_oneof![6 => 1..=2usize, 1 => Just(0usize)],
            0..=6usize,
        ),
        (0..=4usize, 0..=4usize, any::<bool>()),
        select(fills),
        select(vec![Dtype::F32, Dtype::F16, Dtype::Bf16]),
        proptest::collection::vec(cache_op(), 1..=8),
        any::<u64>(),
    )
        .prop_map(
            |((batch, kv_heads, capacity), (d_k, d_v, double), fill, dtype, ops, seed)| CacheCase {
                batch,
                kv_heads,
                capacity,
                d_k,
                d_v,
                double,
                fill,
                dtype,
                ops,
                seed,
            },
        )
        .boxed()
}

/// What the cache must hold: per batch entry and kv head, the K and V rows appended.
struct CacheModel {
    k: Vec<Vec<Vec<Vec<f32>>>>,
    v: Vec<Vec<Vec<Vec<f32>>>>,
    lens: Vec<usize>,
}

impl CacheModel {
    fn len(&self, b: usize) -> usize {
        self.lens[b]
    }
}

fn run_cache_case(case: &CacheCase) -> Result<(), String> {
    with_dtype!(case.dtype, T => run_cache::<T>(case))
}

fn cache_rejection(rule: &'static str) -> Rejection {
    Rejection::named(rule, &["cache", "KV", "tokens"])
}

fn run_cache<T: Element>(case: &CacheCase) -> Result<(), String> {
    let (batch, kvh, d_k, d_v) = (case.batch, case.kv_heads, case.d_k, case.d_v);
    let made = returns("KvCache::new", || {
        KvCache::<T>::new(batch, kvh, case.capacity, d_k, d_v)
    })?;
    let mut cache = match (made, d_k == 0) {
        (Err(e), true) => {
            return check_error(
                &Expected::Reject(vec![Rejection::named(
                    "d_k must be at least 1",
                    &["d_k", "K", "columns"],
                )]),
                &e,
            )
            .map_err(|m| format!("KvCache::new: {m}"));
        }
        (Ok(_), true) => return Err("KvCache::new accepted d_k = 0".into()),
        (Err(e), false) => return Err(format!("KvCache::new rejected a small cache: {e}")),
        (Ok(c), false) => c,
    };
    if case.double {
        cache = cache.with_growth(Growth::Double);
    }
    let mut model = CacheModel {
        k: vec![vec![Vec::new(); kvh]; batch],
        v: vec![vec![Vec::new(); kvh]; batch],
        lens: vec![0; batch],
    };
    let mut g = Gen::new(case.seed);
    let dt = case.dtype;
    for (step, op) in case.ops.iter().enumerate() {
        let at = |m: String| format!("op {step} ({op:?}): {m}");
        match *op {
            CacheOp::Append {
                tokens,
                layout,
                defect,
            }
            | CacheOp::AppendTo {
                tokens,
                layout,
                defect,
                ..
            } => {
                let to = match *op {
                    CacheOp::AppendTo { b, .. } => Some(b),
                    _ => None,
                };
                let entries = if to.is_some() { 1 } else { batch };
                let d = |x: AppendDefect, n: usize| n + usize::from(defect == Some(x));
                let k_dims = [
                    d(AppendDefect::Batch, entries),
                    d(AppendDefect::KHeads, kvh),
                    tokens,
                    d(AppendDefect::KWidth, d_k),
                ];
                let v_dims = [
                    entries,
                    d(AppendDefect::VHeads, kvh),
                    d(AppendDefect::Tokens, tokens),
                    d(AppendDefect::VWidth, d_v),
                ];
                let (kt, vt) = (
                    HostileTensor::new(layout, k_dims, |_, _| {
                        g_mat(&mut g, k_dims[2], k_dims[3], case.fill, dt)
                    }),
                    HostileTensor::new(layout, v_dims, |_, _| {
                        g_mat(&mut g, v_dims[2], v_dims[3], case.fill, dt)
                    }),
                );
                let (kd, vd) = (kt.convert(T::from_f32), vt.convert(T::from_f32));
                let k = tview(&kd, kt.dims, kt.strides);
                let v = tview(&vd, vt.dims, vt.strides);
                let before: Vec<usize> = cache.lens().to_vec();
                let cap = cache.capacity();
                let result = match to {
                    Some(b) => returns("KvCache::append_to", || cache.append_to(b, k, v))?,
                    None => returns("KvCache::append", || cache.append(k, v))?,
                };
                let mut rules = Vec::new();
                if let Some(b) = to
                    && b >= batch
                {
                    rules.push(Rejection::named("the batch entry exists", &["batch"]));
                }
                if defect.is_some() {
                    rules.push(Rejection::named(
                        "new tokens match the cache's dims",
                        &["new K", "new V", "K", "V"],
                    ));
                }
                let targets: Vec<usize> = match to {
                    Some(b) => vec![b],
                    None => (0..batch).collect(),
                };
                let need = targets
                    .iter()
                    .filter(|&&b| b < batch)
                    .map(|&b| model.len(b) + tokens)
                    .max()
                    .unwrap_or(0);
                if !case.double && need > cap {
                    rules.push(cache_rejection("a fixed cache does not grow"));
                }
                // With no batch entry, the contract does not say whether a block of tokens
                // longer than a fixed capacity is refused: either answer is accepted.
                let empty_refusal = to.is_none() && batch == 0 && !case.double && tokens > cap;
                match (result, rules.is_empty()) {
                    (Err(e), true) if empty_refusal && cache_rejection("").accepts(&e) => {}
                    (Ok(()), true) => {
                        let src = |t: &HostileTensor, e: usize, h: usize| {
                            t.view().head(e, h).expect("in range").to_owned()
                        };
                        for (e, &b) in targets.iter().enumerate() {
                            model.lens[b] += tokens;
                            for h in 0..kvh {
                                let (km, vm) = (src(&kt, e, h), src(&vt, e, h));
                                for i in 0..tokens {
                                    model.k[b][h].push((0..d_k).map(|c| km[(i, c)]).collect());
                                    model.v[b][h].push((0..d_v).map(|c| vm[(i, c)]).collect());
                                }
                            }
                        }
                    }
                    (Ok(()), false) => {
                        return Err(at(format!(
                            "an invalid append succeeded (it breaks {})",
                            rules.iter().map(|r| r.rule).collect::<Vec<_>>().join(", ")
                        )));
                    }
                    (Err(e), true) => return Err(at(format!("a valid append failed: {e}"))),
                    (Err(e), false) => {
                        check_error(&Expected::Reject(rules), &e).map_err(at)?;
                        if cache.lens() != before.as_slice() {
                            return Err(at("a failed append changed the lengths".into()));
                        }
                    }
                }
            }
            CacheOp::Clear { b } => {
                let r = returns("KvCache::clear", || cache.clear(b))?;
                match (r, b < batch) {
                    (Ok(()), true) => {
                        model.lens[b] = 0;
                        for h in 0..kvh {
                            model.k[b][h].clear();
                            model.v[b][h].clear();
                        }
                    }
                    (Err(e), false) => check_error(
                        &Expected::Reject(vec![Rejection::named(
                            "the batch entry exists",
                            &["batch"],
                        )]),
                        &e,
                    )
                    .map_err(at)?,
                    (Ok(()), false) => return Err(at("clear of a missing entry succeeded".into())),
                    (Err(e), true) => return Err(at(format!("clear failed: {e}"))),
                }
            }
            CacheOp::Attend {
                n_q,
                group,
                call,
                scale,
                causal,
                window,
                extra,
            } => {
                attend_step::<T>(
                    &cache,
                    &model,
                    case,
                    &mut g,
                    (n_q, group, call, scale, causal, window, extra),
                )
                .map_err(at)?;
            }
        }
        // The cache holds exactly what was appended.
        for b in 0..batch {
            if cache.len(b) != model.len(b) {
                return Err(at(format!(
                    "entry {b} holds {} tokens, not {}",
                    cache.len(b),
                    model.len(b)
                )));
            }
        }
        if cache.capacity() < (0..batch).map(|b| model.len(b)).max().unwrap_or(0) {
            return Err(at("the capacity is smaller than a length".into()));
        }
        let (keys, values) = (cache.keys(), cache.values());
        for b in 0..batch {
            for h in 0..kvh {
                let (kh, vh) = (
                    keys.head(b, h).map_err(|e| at(e.to_string()))?,
                    values.head(b, h).map_err(|e| at(e.to_string()))?,
                );
                for (i, (kr, vr)) in model.k[b][h].iter().zip(&model.v[b][h]).enumerate() {
                    let same = kr
                        .iter()
                        .enumerate()
                        .all(|(c, x)| kh[(i, c)].to_f32().to_bits() == x.to_bits())
                        && vr
                            .iter()
                            .enumerate()
                            .all(|(c, x)| vh[(i, c)].to_f32().to_bits() == x.to_bits());
                    if !same {
                        return Err(at(format!(
                            "token {i} of entry {b}, head {h} is not what was appended"
                        )));
                    }
                }
            }
        }
    }
    Ok(())
}

fn g_mat(g: &mut Gen, rows: usize, cols: usize, fill: Fill, dtype: Dtype) -> Mat<f32> {
    g.mat(rows, cols, fill, dtype)
}

type AttendArgs = (
    usize,
    usize,
    AttendCall,
    Option<f32>,
    Option<Causal>,
    Option<SlidingWindow>,
    Option<AttendExtra>,
);

fn attend_step<T: Element>(
    cache: &KvCache<T>,
    model: &CacheModel,
    case: &CacheCase,
    g: &mut Gen,
    (n_q, group, call, scale, causal, window, extra): AttendArgs,
) -> Result<(), String> {
    let (batch, kvh, d_k, d_v) = (case.batch, case.kv_heads, case.d_k, case.d_v);
    let h_q = kvh * group + usize::from(extra == Some(AttendExtra::Heads));
    let q_batch = batch + usize::from(extra == Some(AttendExtra::QBatch));
    let q_dk = d_k + usize::from(extra == Some(AttendExtra::QWidth));
    let dims = [q_batch, h_q, n_q, q_dk];
    let qt = HostileTensor::new(TensorView::Bshd, dims, |_, _| {
        g.mat(n_q, q_dk, case.fill, case.dtype)
    });
    let qd = qt.convert(T::from_f32);
    let q = tview(&qd, dims, qt.strides);
    let bits = Mat::<bool>::from_fn(1, 1, |_, _| true);
    let bias = Mat::<f32>::zeros(1, 1);
    let mut opts = options_of(scale, causal, window, None, None, None);
    match extra {
        Some(AttendExtra::BoolMask) => opts = opts.with_bool_mask(BoolMask::allow(bits.as_ref())),
        Some(AttendExtra::Additive) => opts = opts.with_additive_mask(bias.as_ref()),
        Some(AttendExtra::KeyLength) => opts = opts.with_key_length(0),
        _ => {}
    }
    let mut rules = Vec::new();
    if matches!(
        extra,
        Some(AttendExtra::BoolMask | AttendExtra::Additive | AttendExtra::KeyLength)
    ) {
        rules.push(Rejection::named(
            "the cache takes no masks or padding",
            &["cache", "KV", "mask", "padding"],
        ));
    }
    if q_batch != batch {
        rules.push(Rejection::named("batch must match", &["Q", "batch"]));
    }
    if q_dk != d_k {
        rules.push(Rejection::named("d_k must match", &["Q"]));
    }
    if kvh == 0 || !h_q.is_multiple_of(kvh) {
        rules.push(Rejection::named(
            "h_q is a multiple of the kv heads",
            &["heads", "head", "K/V"],
        ));
    }
    if let Some(s) = scale
        && !scale_is_valid(s)
    {
        rules.push(Rejection {
            rule: "scale·log2 e must be finite",
            names: &["scale"],
            variant: Some("InvalidScale"),
        });
    }
    // A cache's queries are its newest positions: a top-left alignment would make them
    // the oldest, and is refused unless every entry holds exactly the queries.
    let top_left =
        causal == Some(Causal::TopLeft) || window.is_some_and(|w| w.align == Causal::TopLeft);
    if top_left && (0..batch).any(|b| model.len(b) != n_q) {
        rules.push(Rejection::named(
            "the cache aligns its queries bottom-right",
            &["alignment", "bottom-right"],
        ));
    }
    let storage = T::DTYPE;
    let result = match call {
        AttendCall::Plain => returns("KvCache::attend", || {
            cache
                .attention(q, &opts)
                .and_then(|call| call.forward(Par::rayon(0)))
                .map(|f| f.into_output())
        })?
        .map(|t| (t, None)),
        AttendCall::WithLse => returns("KvCache::attend_with_lse", || {
            cache
                .attention(q, &opts)
                .and_then(|call| call.forward(Par::rayon(0)))
                .map(|f| f.into_parts())
        })?
        .map(|(t, l)| (t, Some(l))),
        AttendCall::With(never) => {
            let split = if never { SplitKv::Never } else { SplitKv::Auto };
            returns("KvCache::attend_with", || {
                cache
                    .attention(q, &opts)
                    .and_then(|call| call.split_kv(split).forward(Par::rayon(0)))
                    .map(|f| f.into_output())
            })?
            .map(|t| (t, None))
        }
    };
    let (out, lse) = match (result, rules.is_empty()) {
        (Err(e), false) => return check_error(&Expected::Reject(rules), &e),
        (Ok(_), false) => {
            return Err(format!(
                "an invalid attend succeeded (it breaks {})",
                rules.iter().map(|r| r.rule).collect::<Vec<_>>().join(", ")
            ));
        }
        (Err(e), true) => {
            // The amendment lets an engine reject window bounds it cannot represent.
            let huge = |s: Option<usize>| s.is_some_and(|s| s > u32::MAX as usize);
            if window.is_some_and(|w| huge(w.left) || huge(w.right))
                && Rejection::named("window", &["window"]).accepts(&e)
            {
                return Ok(());
            }
            return Err(format!("a valid attend failed: {e}"));
        }
        (Ok(r), true) => r,
    };
    if out.dims() != [batch, h_q, n_q, d_v] {
        return Err(format!("attend returned dims {:?}", out.dims()));
    }
    let head_opts = options_of(scale, causal, window, None, None, None);
    let qf = qt.view();
    let out = out.as_ref();
    for b in 0..batch {
        let len = model.len(b);
        for h in 0..h_q {
            let kv = h / (h_q / kvh.max(1)).max(1);
            let km = Mat::from_fn(len, d_k, |i, c| model.k[b][kv][i][c]);
            let vm = Mat::from_fn(len, d_v, |i, c| model.v[b][kv][i][c]);
            let qh = qf.head(b, h).expect("in range");
            let want = expect_head(
                qh,
                km.as_ref(),
                vm.as_ref(),
                &head_opts,
                &engine::model(storage, storage),
                Outputs::NONE,
                0,
            );
            let o = widen(out.head(b, h).expect("in range"));
            let row = (b * h_q + h) * n_q;
            let l = lse.as_ref().map(|l| &l[row..row + n_q]);
            check_head(&want, Ok((o.as_ref(), l)))
                .map_err(|m| format!("entry {b} ({len} tokens), head {h}: {m}"))?;
        }
    }
    Ok(())
}

#[test]
fn kv_cache_calls_keep_the_contract() {
    assert_holds(run_property(
        "kv_cache_sequences",
        &config(),
        1024,
        cache_case(vec![Fill::Unit, Fill::Ties, Fill::Large, Fill::NonFinite]),
        run_cache_case,
    ));
}

/// Cached tokens at the finite extremes (decoding's row kernels on scores and values
/// beyond f32): the rows stay finite.
#[test]
fn kv_cache_extreme_tokens_stay_finite() {
    assert_holds(run_property(
        "kv_cache_extreme_tokens",
        &config(),
        256,
        cache_case(vec![Fill::Extreme]),
        run_cache_case,
    ));
}

/// Item 3 of the issue, named: a query at the finite extremes against keys whose products
/// with it are exactly 0 (zero keys) has scores of exactly 0, whatever the (valid) scale:
/// the output is the plain average of V and the LSE `ln n_k`, never NaN.
#[test]
fn large_queries_with_zero_scores_are_not_nan() {
    assert_holds(run_property(
        "large_queries_zero_scores",
        &config(),
        256,
        (
            1..=6usize,
            1..=40usize,
            1..=8usize,
            1..=4usize,
            select(vec![f32::MAX, -f32::MAX, 1e38, 3e30, 1e20]),
            select(vec![None, Some(1.0f32), Some(2.0e38), Some(1e-30)]),
            select(vec![Dtype::F32, Dtype::Bf16]),
            any::<u64>(),
        ),
        |&(n_q, n_k, d_k, d_v, big, scale, dtype, seed)| {
            let mut g = Gen::new(seed);
            let q = Mat::<f32>::from_fn(n_q, d_k, |i, t| {
                if (i + t) % 2 == 0 {
                    dtype.round(big)
                } else {
                    0.5
                }
            });
            let k = Mat::<f32>::zeros(n_k, d_k);
            let v = g.mat(n_k, d_v, Fill::Unit, dtype);
            let mut opts = Options::default();
            if let Some(s) = scale {
                opts = opts.with_scale(s);
            }
            let want = expect_head(
                q.as_ref(),
                k.as_ref(),
                v.as_ref(),
                &opts,
                &model(dtype, dtype),
                Outputs::WITH_LSE,
                0,
            );
            with_dtype!(dtype, T => {
                let (qt, kt, vt) = (
                    StoredMat::new(q.as_ref(), View::ColMajor, T::from_f32),
                    StoredMat::new(k.as_ref(), View::ColMajor, T::from_f32),
                    StoredMat::new(v.as_ref(), View::ColMajor, T::from_f32),
                );
                let got = returns("Attention::forward", || {
                    forward_head(qt.view(), kt.view(), vt.view(), &opts)
                })?;
                let got = got.map(|(o, l)| (widen(o.as_ref()), l));
                check_head(
                    &want,
                    got.as_ref()
                        .map(|(o, l)| (o.as_ref(), Some(l.as_slice())))
                        .map_err(Clone::clone),
                )
                .map_err(|m| format!("Q entries {big:e}, zero keys, scale {scale:?}: {m}"))
            })
        },
    ));
}

// ---------------------------------------------------------------------------------------
// MultiHeadAttention.

#[derive(Debug, Clone, PartialEq)]
struct LayerCase {
    /// Masks, options, plants and inputs: `q` is `x_q` (`d_k` = d_model), `v` is `x_kv`
    /// (`d_v` = d_kv); K is unused.
    head: HostileHead,
    h_kv: usize,
    group: usize,
    d_k: usize,
    d_v: usize,
    weights: Fill,
    self_attention: bool,
    defect: Option<bool>,
}

fn layer_case() -> BoxedStrategy<LayerCase> {
    (
        prop_oneof![
            3 => hostile_head(Profile::Poison(Hiding::Structural), &tiles()),
            2 => hostile_head(Profile::Poison(Hiding::BoolMask), &tiles()),
            2 => hostile_head(Profile::Poison(Hiding::NegInfBias), &tiles()),
            2 => hostile_head(Profile::Anything, &tiles()),
        ]
        .prop_map(|mut h| {
            h.n_q = h.n_q.min(33);
            h.n_k = h.n_k.min(65);
            h.d_k = h.d_k.clamp(1, 16);
            h.d_v = h.d_v.clamp(1, 16);
            h.dtype = Dtype::F32;
            h
        }),
        (1..=2usize, 1..=3usize, 1..=6usize, 1..=6usize),
        prop_oneof![6 => Just(Fill::Unit), 1 => Just(Fill::Extreme), 1 => Just(Fill::NonFinite)],
        proptest::bool::weighted(0.3),
        proptest::option::weighted(0.1, any::<bool>()),
    )
        .prop_map(
            |(mut head, (h_kv, group, d_k, d_v), weights, self_attention, defect)| {
                if self_attention {
                    head.n_k = head.n_q;
                    head.d_v = head.d_k;
                }
                LayerCase {
                    head,
                    h_kv,
                    group,
                    d_k,
                    d_v,
                    weights,
                    self_attention,
                    defect,
                }
            },
        )
        .boxed()
}

fn run_layer(case: &LayerCase) -> Result<(), String> {
    let inputs = case.head.build();
    let h = case.h_kv * case.group;
    let (d_model, d_kv) = (inputs.q.ncols(), inputs.v.ncols());
    let mut g = Gen::new(case.head.seed ^ 0xABCD);
    let w = |g: &mut Gen, r: usize, c: usize| g.mat(r, c, case.weights, Dtype::F32);
    let (w_q, w_k, w_v, w_o) = (
        w(&mut g, d_model, h * case.d_k),
        w(&mut g, d_kv, case.h_kv * case.d_k),
        w(&mut g, d_kv, case.h_kv * case.d_v),
        w(&mut g, h * case.d_v, d_model),
    );
    let weights_finite = [&w_q, &w_k, &w_v, &w_o]
        .iter()
        .all(|m| (0..m.nrows()).all(|i| (0..m.ncols()).all(|j| m[(i, j)].is_finite())));
    let weights = MultiHeadWeights::new(w_q, w_k, w_v, w_o, h, case.h_kv)
        .map_err(|e| format!("valid weights were rejected: {e}"))?;
    let layer = MultiHeadAttention::new(weights);
    let opts = inputs.options();
    let x_kv_inputs = if case.self_attention {
        &inputs.q
    } else {
        &inputs.v
    };
    // Inputs of the wrong width.
    let (x_q, x_kv) = match case.defect {
        Some(true) => (
            Mat::<f32>::zeros(inputs.q.nrows(), d_model + 1),
            x_kv_inputs.clone(),
        ),
        Some(false) => (
            inputs.q.clone(),
            Mat::<f32>::zeros(x_kv_inputs.nrows(), d_kv + 1),
        ),
        None => (inputs.q.clone(), x_kv_inputs.clone()),
    };
    let xq_view = StoredMat::new(x_q.as_ref(), case.head.views[0], |x| x);
    let xkv_view = StoredMat::new(x_kv.as_ref(), case.head.views[2], |x| x);
    let got = if case.self_attention && case.defect.is_none() {
        returns("MultiHeadAttention::forward", || {
            layer.forward(xq_view.view(), &opts)
        })?
    } else {
        returns("MultiHeadAttention::forward_cross", || {
            layer.forward_cross(xq_view.view(), xkv_view.view(), &opts)
        })?
    };
    let (n_q, n_k) = (x_q.nrows(), x_kv.nrows());
    // The options' own rules, through a head of the same n_q × n_k (widths 1).
    let probe_q = Mat::<f32>::zeros(n_q, 1);
    let probe_kv = Mat::<f32>::zeros(n_k, 1);
    let mut rules = match expect_head(
        probe_q.as_ref(),
        probe_kv.as_ref(),
        probe_kv.as_ref(),
        &opts,
        &model(Dtype::F32, Dtype::F32),
        Outputs::NONE,
        0,
    ) {
        Expected::Reject(r) => r,
        _ => Vec::new(),
    };
    let may_reject = opts.window.is_some_and(|w| {
        [w.left, w.right]
            .iter()
            .any(|s| s.is_some_and(|s| s > u32::MAX as usize))
    });
    match case.defect {
        Some(true) => rules.push(Rejection::named("x_q is [n_q, d_model]", &["x_q"])),
        Some(false) => rules.push(Rejection::named("x_kv is [n_k, d_kv]", &["x_kv"])),
        None => {}
    }
    let y = match (got, rules.is_empty()) {
        (Err(e), false) => return check_error(&Expected::Reject(rules), &e),
        (Ok(_), false) => {
            return Err(format!(
                "an invalid layer call succeeded (it breaks {})",
                rules.iter().map(|r| r.rule).collect::<Vec<_>>().join(", ")
            ));
        }
        (Err(e), true) => {
            if may_reject && Rejection::named("window", &["window"]).accepts(&e) {
                return Ok(());
            }
            return Err(format!("a valid layer call failed: {e}"));
        }
        (Ok(y), true) => y,
    };
    if (y.nrows(), y.ncols()) != (n_q, d_model) {
        return Err(format!("the layer returned {}×{}", y.nrows(), y.ncols()));
    }
    // Row classes from the inputs: the same visibility for every head; a row is promised
    // finite when its x_q row, the x_kv rows it sees, their biases and every weight are
    // finite and moderate (the projections cannot overflow).
    let moderate = |m: &Mat<f32>, r: usize| {
        (0..m.ncols()).all(|c| m[(r, c)].is_finite() && m[(r, c)].abs() <= 1e4)
    };
    let weights_moderate = weights_finite && case.weights != Fill::Extreme;
    for i in 0..n_q {
        let seen: Vec<usize> = (0..n_k)
            .filter(|&j| {
                structurally_visible(inputs.causal, inputs.window, inputs.key_len, n_q, n_k, i, j)
                    && opts.bool_mask.is_none_or(|b| b.allows(i, j))
                    && opts
                        .additive_mask
                        .is_none_or(|a| a[(i, j)] != f32::NEG_INFINITY)
            })
            .collect();
        let class = if seen.is_empty() {
            RowClass::Empty
        } else if weights_moderate
            && moderate(&x_q, i)
            && seen.iter().all(|&j| {
                moderate(&x_kv, j)
                    && opts
                        .additive_mask
                        .is_none_or(|a| a[(i, j)].is_finite() && a[(i, j)].abs() <= 1e4)
            })
        {
            RowClass::Finite
        } else {
            RowClass::Touched
        };
        match class {
            RowClass::Empty if weights_finite => {
                if let Some(c) = (0..d_model).find(|&c| y[(i, c)] != 0.0) {
                    return Err(format!(
                        "row {i} sees no key, so the layer's output row is W_O·0 = 0, but y[{i}, {c}] = {:e}",
                        y[(i, c)]
                    ));
                }
            }
            RowClass::Finite => {
                if let Some(c) = (0..d_model).find(|&c| !y[(i, c)].is_finite()) {
                    return Err(format!(
                        "row {i} sees only finite, moderate inputs ({} keys), but y[{i}, {c}] = {:e}",
                        seen.len(),
                        y[(i, c)]
                    ));
                }
            }
            _ => {}
        }
    }
    Ok(())
}

#[test]
fn multi_head_layer_keeps_the_contract() {
    assert_holds(run_property(
        "multi_head_layer",
        &config(),
        1024,
        layer_case(),
        run_layer,
    ));
}

// ---------------------------------------------------------------------------------------
// Huge shapes, in a child process.

const CHILD_TIMEOUT: Duration = Duration::from_secs(180);

fn run_huge_head(case: &HugeHead) -> Result<(), String> {
    with_dtype!(case.dtype, T => huge_head_calls::<T>(case))
}

fn huge_head_calls<T: Element>(case: &HugeHead) -> Result<(), String> {
    let inputs = case.build();
    let [qf, kf, vf] = inputs.views();
    let rows = |r: &[f32]| r.iter().map(|&x| T::from_f32(x)).collect::<Vec<T>>();
    let (qr, kr, vr) = (
        rows(&inputs.q_row),
        rows(&inputs.k_row),
        rows(&inputs.v_row),
    );
    let [n_q, n_k, n_v] = inputs.lens;
    let (q, k, v) = (
        broadcast_rows(&qr, n_q),
        broadcast_rows(&kr, n_k),
        broadcast_rows(&vr, n_v),
    );
    let opts = inputs.options();
    let storage = T::DTYPE;
    // attention: the output.
    let want = expect_head(
        qf,
        kf,
        vf,
        &opts,
        &model(storage, storage),
        Outputs::OUTPUT,
        0,
    );
    if !matches!(want, Expected::TooMuchWork) {
        let got = returns("attention", || attention(q, k, v, &opts))?;
        let got = got.map(|o| widen(o.as_ref()));
        check_head(
            &want,
            got.as_ref()
                .map(|o| (o.as_ref(), None))
                .map_err(Clone::clone),
        )
        .map_err(|m| format!("attention: {m}"))?;
    }
    // attention_with_lse: the output and the LSE.
    let want = expect_head(
        qf,
        kf,
        vf,
        &opts,
        &model(storage, storage),
        Outputs::WITH_LSE,
        0,
    );
    if !matches!(want, Expected::TooMuchWork) {
        let got = returns("Attention::forward", || forward_head(q, k, v, &opts))?;
        let got = got.map(|(o, l)| (widen(o.as_ref()), l));
        check_head(
            &want,
            got.as_ref()
                .map(|(o, l)| (o.as_ref(), Some(l.as_slice())))
                .map_err(Clone::clone),
        )
        .map_err(|m| format!("attention_with_lse: {m}"))?;
    }
    // partial_attention over all the keys.
    let want = expect_head(
        qf,
        kf,
        vf,
        &opts,
        &model(storage, Dtype::F32),
        Outputs::WITH_LSE,
        0,
    );
    if !matches!(want, Expected::TooMuchWork) {
        let got = returns("Attention::partial_state", || {
            Attention::keys_of(q, k, v, 0..n_k, n_k, &opts)
                .and_then(|call| call.partial_state(Par::rayon(0)))
        })?;
        check_head(
            &want,
            got.as_ref()
                .map(|s| (s.output(), Some(s.lse())))
                .map_err(Clone::clone),
        )
        .map_err(|m| format!("partial_attention: {m}"))?;
    }
    // attention_into: a small output; wrong unless n_q is small.
    let want = expect_head(
        qf,
        kf,
        vf,
        &opts,
        &model(storage, storage),
        Outputs::NONE,
        0,
    );
    if !matches!(want, Expected::TooMuchWork) {
        let (rows, d_v) = (n_q.min(4), vf.ncols());
        let want = if rows != n_q {
            with_defects(
                want,
                vec![Rejection::named("the output is n_q × d_v", &["output"])],
            )
        } else {
            want
        };
        let mut o = StoredOut::new(rows, d_v, View::ColMajor, T::from_f32(f32::NAN));
        let r = returns("Attention::forward_into", || {
            Attention::head(q, k, v, &opts)
                .and_then(|call| call.forward_into(o.view_mut(), None, Par::rayon(0)))
        })?;
        let written = o.read(T::to_f32);
        check_head(&want, r.map(|()| (written.as_ref(), None)))
            .map_err(|m| format!("attention_into: {m}"))?;
    }
    Ok(())
}

#[test]
fn huge_single_head_shapes_fail_before_any_work() {
    isolated(
        "huge_single_head_shapes_fail_before_any_work",
        CHILD_TIMEOUT,
        || {
            assert_holds(run_property(
                "huge_single_head",
                &config(),
                256,
                huge_head(),
                run_huge_head,
            ));
        },
    );
}

fn run_huge_batch(case: &HugeBatch) -> Result<(), String> {
    with_dtype!(case.dtype, T => huge_batch_calls::<T>(case))
}

fn huge_batch_calls<T: Element>(case: &HugeBatch) -> Result<(), String> {
    let [qd, kd, vd] = case.dims();
    let row = |d: usize, x: f32| vec![T::from_f32(x); d];
    let (qr, kr, vr) = (row(qd[3], 0.5), row(kd[3], 0.25), row(vd[3], 1.0));
    let (qr32, kr32, vr32) = (
        vec![0.5f32; qd[3]],
        vec![0.25f32; kd[3]],
        vec![1.0f32; vd[3]],
    );
    let (q, k, v) = (bview(&qr, qd)?, bview(&kr, kd)?, bview(&vr, vd)?);
    let (qf, kf, vf) = (bview(&qr32, qd)?, bview(&kr32, kd)?, bview(&vr32, vd)?);
    let opts = case.options();
    let storage = T::DTYPE;
    let widen_t = |t: attn_core::Tensor4<T>| -> attn_core::Tensor4<f32> {
        let dims = t.dims();
        attn_core::Tensor4::from_vec(t.into_vec().into_iter().map(T::to_f32).collect(), dims)
            .expect("same dims")
    };
    let check =
        |name: &str,
         want: &BatchExpected,
         got: Result<(attn_core::Tensor4<f32>, Option<Vec<f32>>), attn_core::Error>| {
            let got = got
                .as_ref()
                .map(|(t, l)| (t.as_ref(), l.as_deref()))
                .map_err(Clone::clone);
            check_batched(want, [qf, kf, vf], &opts, &model(storage, storage), got)
                .map_err(|m| format!("{name}: {m}"))
        };
    let want = expect_batched(qd, kd, vd, &opts, Outputs::OUTPUT);
    if !matches!(want, BatchExpected::TooMuchWork) {
        let got = returns("Attention::forward", || {
            forward_batched(q, k, v, &opts).map(|(o, _)| o)
        })?;
        check("Attention::forward", &want, got.map(|t| (widen_t(t), None)))?;
        let got = returns("Attention::forward (split never)", || {
            Attention::batched(q, k, v, &opts)
                .and_then(|call| call.split_kv(SplitKv::Never).forward(Par::rayon(0)))
                .map(|f| f.into_output())
        })?;
        check(
            "Attention::forward (split never)",
            &want,
            got.map(|t| (widen_t(t), None)),
        )?;
    }
    let want = expect_batched(qd, kd, vd, &opts, Outputs::WITH_LSE);
    if !matches!(want, BatchExpected::TooMuchWork) {
        let got = returns("Attention::forward", || forward_batched(q, k, v, &opts))?;
        check(
            "Attention::forward",
            &want,
            got.map(|(t, l)| (widen_t(t), Some(l))),
        )?;
    }
    // attention_batched_into, into a small [1, 1, 1, d_v] output: wrong unless the result
    // has those dims, or none of its own (an empty output of any dims is free).
    let want = expect_batched(qd, kd, vd, &opts, Outputs::NONE);
    if !matches!(want, BatchExpected::TooMuchWork) {
        let dims = [qd[0], qd[1], qd[2], vd[3]];
        let free = dims.contains(&0);
        let out_dims = if free { dims } else { [1, 1, 1, vd[3]] };
        let want = match want {
            _ if out_dims == dims => want,
            BatchExpected::Reject(mut r) => {
                r.push(Rejection::named("the output's dims", &["output"]));
                BatchExpected::Reject(r)
            }
            _ => BatchExpected::Reject(vec![Rejection::named("the output's dims", &["output"])]),
        };
        let mut buf = vec![T::from_f32(f32::NAN); if free { 0 } else { vd[3] }];
        let r = returns("Attention::forward_into", || {
            let out = Tensor4Mut::new(
                &mut buf,
                out_dims,
                attn_core::Layout::Bhsd.strides(out_dims),
            )?;
            Attention::batched(q, k, v, &opts)
                .and_then(|call| call.forward_into(out, None, Par::rayon(0)))
        })?;
        let got = r.map(|()| {
            let f: Vec<f32> = buf.iter().map(|x| x.to_f32()).collect();
            (
                attn_core::Tensor4::from_vec(f, out_dims).expect("dense"),
                None,
            )
        });
        check("attention_batched_into", &want, got)?;
    }
    Ok(())
}

#[test]
fn huge_batched_shapes_fail_before_any_work() {
    isolated(
        "huge_batched_shapes_fail_before_any_work",
        CHILD_TIMEOUT,
        || {
            assert_holds(run_property(
                "huge_batched",
                &config(),
                256,
                huge_batch(),
                run_huge_batch,
            ));
        },
    );
}

/// A huge operation on a small cache.
#[derive(Debug, Clone, Copy, PartialEq)]
enum HugeCacheOp {
    /// `KvCache::new` with these dims.
    New([Len; 3]),
    /// Appends `t` broadcast tokens to every entry.
    Append(Len),
    /// Appends one token, then `t` broadcast tokens (`len + t` may overflow).
    AppendAfterOne(Len),
    /// Appends `t` broadcast tokens to entry 0.
    AppendTo(Len),
    /// Attends a broadcast Q of `n_q` queries.
    Attend(Len, bool),
}

#[derive(Debug, Clone, Copy, PartialEq)]
struct HugeCacheCase {
    batch: usize,
    kv_heads: usize,
    capacity: usize,
    d_k: usize,
    d_v: usize,
    double: bool,
    op: HugeCacheOp,
    dtype: Dtype,
}

fn huge_cache_case() -> BoxedStrategy<HugeCacheCase> {
    (
        (
            1..=2usize,
            1..=2usize,
            0..=4usize,
            1..=3usize,
            0..=2usize,
            any::<bool>(),
        ),
        prop_oneof![
            2 => [len(3), len(3), len(3)].prop_map(HugeCacheOp::New),
            2 => len(3).prop_map(HugeCacheOp::Append),
            1 => len(3).prop_map(HugeCacheOp::AppendAfterOne),
            1 => len(3).prop_map(HugeCacheOp::AppendTo),
            1 => (len(3), any::<bool>()).prop_map(|(n, l)| HugeCacheOp::Attend(n, l)),
        ],
        select(vec![Dtype::F32, Dtype::F16, Dtype::Bf16]),
    )
        .prop_map(
            |((batch, kv_heads, capacity, d_k, d_v, double), op, dtype)| HugeCacheCase {
                batch,
                kv_heads,
                capacity,
                d_k,
                d_v,
                double,
                op,
                dtype,
            },
        )
        .boxed()
}

fn run_huge_cache(case: &HugeCacheCase) -> Result<(), String> {
    with_dtype!(case.dtype, T => huge_cache_calls::<T>(case))
}

fn huge_cache_calls<T: Element>(case: &HugeCacheCase) -> Result<(), String> {
    let (batch, kvh, d_k, d_v) = (case.batch, case.kv_heads, case.d_k, case.d_v);
    if let HugeCacheOp::New([b, h, cap]) = case.op {
        let (b, h, cap) = (b.get(), h.get(), cap.get());
        let elems = |d: usize| product(&[b, h, cap, d]);
        // The cache also holds one length per batch entry.
        let huge = b >= UNALLOCATABLE
            || [d_k, d_v]
                .iter()
                .any(|&d| elems(d).is_none_or(|n| n >= UNALLOCATABLE));
        let r = returns("KvCache::new", || KvCache::<T>::new(b, h, cap, d_k, d_v))?;
        return match (r, huge) {
            (Err(e), true) => check_error(
                &Expected::Reject(vec![Rejection::allocation(&["cache", "KV"])]),
                &e,
            )
            .map_err(|m| format!("KvCache::new({b}, {h}, {cap}, {d_k}, {d_v}): {m}")),
            (Ok(_), true) => Err(format!(
                "KvCache::new({b}, {h}, {cap}, {d_k}, {d_v}) succeeded"
            )),
            (Err(e), false) => Err(format!("KvCache::new of a small cache failed: {e}")),
            (Ok(_), false) => Ok(()),
        };
    }
    let mut cache = KvCache::<T>::new(batch, kvh, case.capacity, d_k, d_v)
        .map_err(|e| format!("a small cache: {e}"))?;
    if case.double {
        cache = cache.with_growth(Growth::Double);
    }
    let (kr, vr) = (vec![T::from_f32(0.25); d_k], vec![T::from_f32(1.0); d_v]);
    let tokens = |entries: usize, t: usize| {
        (
            broadcast_tensor(&kr, [entries, kvh, t, d_k]).expect("broadcast"),
            broadcast_tensor(&vr, [entries, kvh, t, d_v]).expect("broadcast"),
        )
    };
    let grow_rule = || -> Rejection {
        if case.double {
            Rejection::allocation(&["cache", "KV"])
        } else {
            Rejection::named("a fixed cache does not grow", &["cache", "KV", "capacity"])
        }
    };
    // A fixed cache must refuse what does not fit; a doubling one must refuse only what
    // cannot be allocated (a small growth is not hostile and must succeed).
    let must_fail = |t: usize, len: usize, cap: usize| match len.checked_add(t) {
        None => true,
        Some(n) if case.double => n >= UNALLOCATABLE,
        Some(n) => n > cap,
    };
    let check_append = |r: attn_core::Result<()>, t: usize, len: usize, cap: usize, what: &str| {
        // A token count that overflows usize may be reported as a capacity (its
        // `requested` is then usize::MAX) or as an allocation.
        let overflow = len.checked_add(t).is_none();
        let rules = if overflow {
            vec![
                grow_rule(),
                Rejection::named("the token count overflows", &["cache", "KV", "capacity"]),
            ]
        } else {
            vec![grow_rule()]
        };
        match (r, must_fail(t, len, cap)) {
            (Err(e), true) => check_error(&Expected::Reject(rules), &e)
                .map_err(|m| format!("{what} of {t} tokens after {len}: {m}")),
            (Ok(()), true) => Err(format!("{what} of {t} tokens after {len} succeeded")),
            (Err(e), false) => Err(format!("{what} of {t} tokens after {len} failed: {e}")),
            (Ok(()), false) => Ok(()),
        }
    };
    match case.op {
        HugeCacheOp::New(_) => unreachable!("handled above"),
        HugeCacheOp::Append(t) | HugeCacheOp::AppendTo(t) => {
            let t = t.get();
            let to = matches!(case.op, HugeCacheOp::AppendTo(_));
            let (k, v) = tokens(if to { 1 } else { batch }, t);
            let r = if to {
                returns("KvCache::append_to", || cache.append_to(0, k, v))?
            } else {
                returns("KvCache::append", || cache.append(k, v))?
            };
            check_append(
                r,
                t,
                0,
                case.capacity,
                if to { "append_to" } else { "append" },
            )?;
        }
        HugeCacheOp::AppendAfterOne(t) => {
            let t = t.get();
            let (k1, v1) = tokens(batch, 1);
            let r = returns("KvCache::append", || cache.append(k1, v1))?;
            check_append(r, 1, 0, case.capacity, "append")?;
            if cache.len(0) != 1 {
                return Ok(());
            }
            let cap = cache.capacity();
            let (k, v) = tokens(batch, t);
            let r = returns("KvCache::append", || cache.append(k, v))?;
            let failed = r.is_err();
            check_append(r, t, 1, cap, "append")?;
            let want = if failed { 1 } else { 1 + t };
            if cache.len(0) != want {
                return Err(format!(
                    "the cache holds {} tokens, not {want}",
                    cache.len(0)
                ));
            }
        }
        HugeCacheOp::Attend(n_q, with_lse) => {
            let n_q = n_q.get();
            let qr = vec![T::from_f32(0.5); d_k];
            let q = broadcast_tensor(&qr, [batch, kvh, n_q, d_k]).expect("broadcast");
            let rows = (batch * kvh).checked_mul(n_q);
            let out_huge = rows
                .and_then(|r| r.checked_mul(d_v))
                .is_none_or(|n| n >= UNALLOCATABLE);
            let lse_huge = with_lse && rows.is_none_or(|r| r >= UNALLOCATABLE);
            if !out_huge && !lse_huge && n_q > 64 {
                return Ok(()); // a valid call that would compute: not generated
            }
            let opts = Options::default().with_causal(Causal::BottomRight);
            let r = if with_lse {
                returns("KvCache::attend_with_lse", || {
                    cache
                        .attention(q, &opts)
                        .and_then(|call| call.forward(Par::rayon(0)))
                        .map(|f| f.into_parts())
                })?
                .map(|_| ())
            } else {
                returns("KvCache::attend", || {
                    cache
                        .attention(q, &opts)
                        .and_then(|call| call.forward(Par::rayon(0)))
                        .map(|f| f.into_output())
                })?
                .map(|_| ())
            };
            match (r, out_huge || lse_huge) {
                (Err(e), true) => check_error(
                    &Expected::Reject(vec![Rejection::allocation(&["output", "LSE"])]),
                    &e,
                )
                .map_err(|m| format!("attend of {n_q} queries: {m}"))?,
                (Ok(()), true) => return Err(format!("attend of {n_q} queries succeeded")),
                (Err(e), false) => return Err(format!("a small attend failed: {e}")),
                (Ok(()), false) => {}
            }
        }
    }
    Ok(())
}

#[test]
fn huge_kv_cache_sizes_are_errors() {
    isolated("huge_kv_cache_sizes_are_errors", CHILD_TIMEOUT, || {
        assert_holds(run_property(
            "huge_kv_cache",
            &config(),
            256,
            huge_cache_case(),
            run_huge_cache,
        ));
    });
}

/// A layer fed a broadcast input of a huge number of rows: its projections cannot be
/// allocated, so the call must fail (an abort is caught by the child process).
#[test]
fn huge_multi_head_inputs_are_errors() {
    isolated("huge_multi_head_inputs_are_errors", CHILD_TIMEOUT, || {
        assert_holds(run_property(
            "huge_multi_head",
            &config(),
            64,
            (len(4), len(4), 1..=2usize, 1..=4usize),
            |&(n_q, n_k, h, d)| {
                let (n_q, n_k) = (n_q.get(), n_k.get());
                let w = |r: usize, c: usize| {
                    Mat::<f32>::from_fn(r, c, |i, j| ((i + j) % 3) as f32 * 0.25)
                };
                let d_model = 4;
                let weights = MultiHeadWeights::new(
                    w(d_model, h * d),
                    w(d_model, h * d),
                    w(d_model, h * d),
                    w(h * d, d_model),
                    h,
                    h,
                )
                .map_err(|e| e.to_string())?;
                let layer = MultiHeadAttention::new(weights);
                let (xq, xkv) = (vec![0.5f32; d_model], vec![0.25f32; d_model]);
                let huge = n_q.max(n_k) >= UNALLOCATABLE;
                if !huge && (n_q > 64 || n_k > 64) {
                    return Ok(());
                }
                let r = returns("MultiHeadAttention::forward_cross", || {
                    layer.forward_cross(
                        broadcast_rows(&xq, n_q),
                        broadcast_rows(&xkv, n_k),
                        &Options::default(),
                    )
                })?;
                match (r, huge) {
                    (Err(e), true) => check_error(
                        &Expected::Reject(vec![Rejection::allocation(&[
                            "output",
                            "projection",
                            "x_q",
                            "x_kv",
                            "Q",
                            "K",
                            "V",
                        ])]),
                        &e,
                    ),
                    (Ok(_), true) => Err(format!("a layer over {n_q} × {n_k} rows succeeded")),
                    (Err(e), false) => Err(format!("a small layer call failed: {e}")),
                    (Ok(_), false) => Ok(()),
                }
            },
        ));
    });
}

// ---------------------------------------------------------------------------------------
// The backward pass: attention_backward, attention_backward_into,
// attention_backward_batched, attention_backward_batched_into.

/// A defect of the backward's own operands (or of the caller's gradient buffers).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum GradDefect {
    GradOutRows,
    GradOutCols,
    OutRows,
    LseLength,
    /// `_into` only: dK one row short.
    DkRows,
}

/// Which backward entry point, with what forward result.
#[derive(Debug, Clone, Copy, PartialEq)]
struct GradCall {
    /// `_into` (else the allocating call), with f32 gradients or the storage type.
    into: Option<(View, bool)>,
    /// The forward's own `(out, lse)` (else arbitrary, non-finite values included).
    forward: bool,
    defect: Option<GradDefect>,
    /// A poison (and the row it goes in) planted in `dO`: it may reach that row's dQ and
    /// the dK, dV of the keys the row sees, nothing else.
    grad_poison: Option<(u32, Special)>,
}

fn grad_call(forward: bool) -> BoxedStrategy<GradCall> {
    (
        proptest::option::weighted(0.5, (select(View::ALL.to_vec()), any::<bool>())),
        Just(forward),
        proptest::option::weighted(
            0.1,
            select(vec![
                GradDefect::GradOutRows,
                GradDefect::GradOutCols,
                GradDefect::OutRows,
                GradDefect::LseLength,
                GradDefect::DkRows,
            ]),
        ),
        // Non-finite only: a finite extreme in dO is a legitimate (overflowing) value.
        proptest::option::weighted(
            0.3,
            (
                any::<u32>(),
                select(vec![Special::Nan, Special::PosInf, Special::NegInf]),
            ),
        ),
    )
        .prop_map(|(into, forward, defect, grad_poison)| GradCall {
            into,
            forward,
            defect,
            grad_poison,
        })
        .boxed()
}

/// Backward calls are ~2.5× the forward's work and the reference materialises `n_q × n_k`:
/// shorter heads.
fn backward_head(profile: Profile) -> BoxedStrategy<HostileHead> {
    hostile_head(profile, &tiles())
        .prop_map(|mut h| {
            h.n_q = h.n_q.min(129);
            h.n_k = h.n_k.min(257);
            h
        })
        .boxed()
}

fn run_grad_case(case: &HostileHead, call: GradCall) -> Result<(), String> {
    with_dtype!(case.dtype, T => run_grad::<T>(case, call))
}

fn run_grad<T: Element>(case: &HostileHead, call: GradCall) -> Result<(), String> {
    let inputs = case.build();
    let [qs, ks, vs] = inputs.stored(T::from_f32);
    let (q, k, v) = (qs.view(), ks.view(), vs.view());
    let (qf, kf, vf) = (inputs.q.as_ref(), inputs.k.as_ref(), inputs.v.as_ref());
    let opts = inputs.options();
    let storage = T::DTYPE;
    let [n_q, n_k, d_k, d_v] = inputs.dims();
    let mut g = Gen::new(case.seed ^ 0x0DD5_EED5);
    // The forward's own result where it succeeds, else (or on request) arbitrary values.
    let forward = if call.forward {
        match returns("Attention::forward", || forward_head(q, k, v, &opts))? {
            Ok((o, l)) => Some((widen(o.as_ref()), l)),
            Err(_) => None,
        }
    } else {
        None
    };
    let forward_given = forward.is_some();
    let (mut out, mut lse) = forward.unwrap_or_else(|| {
        let o = g.mat(n_q, d_v, Fill::NonFinite, storage);
        let l = (0..n_q)
            .map(|_| g.fill(Fill::NonFinite, Dtype::F32) * 10.0)
            .collect();
        (o, l)
    });
    let mut grad = g.mat(n_q, d_v, Fill::Unit, storage);
    // The rows that see nothing get a poisoned dO too (their Q already is, if planted).
    let poison = storage.round(f32::NAN);
    for &i in &inputs.planted.queries {
        for c in 0..d_v {
            grad[(i, c)] = poison;
        }
    }
    if let Some((pick, value)) = call.grad_poison
        && n_q > 0
        && d_v > 0
    {
        grad[(pick as usize % n_q, pick as usize / n_q % d_v)] = storage.round(value.value());
    }
    let resize = |m: &Mat<f32>, r: usize, c: usize| {
        Mat::from_fn(r, c, |i, j| {
            if i < m.nrows() && j < m.ncols() {
                m[(i, j)]
            } else {
                0.5
            }
        })
    };
    match call.defect {
        Some(GradDefect::GradOutRows) => grad = resize(&grad, n_q + 1, d_v),
        Some(GradDefect::GradOutCols) => grad = resize(&grad, n_q, d_v + 1),
        Some(GradDefect::OutRows) => out = resize(&out, n_q + 1, d_v),
        Some(GradDefect::LseLength) => lse.push(0.0),
        _ => {}
    }
    let view = case.views[0];
    let grad_s = StoredMat::new(grad.as_ref(), view, T::from_f32);
    let out_s = StoredMat::new(out.as_ref(), view, T::from_f32);
    let (grad_t, out_t) = (grad_s.view(), out_s.view());
    let (gf, of) = (grad.as_ref(), out.as_ref());
    let check = |name: &str,
                 out_type: Dtype,
                 allocates: bool,
                 extra: Option<Rejection>,
                 got: Result<[Mat<f32>; 3], attn_core::Error>| {
        let mut want = expect_head_backward(
            gf,
            qf,
            kf,
            vf,
            of,
            &lse,
            &opts,
            &model(storage, out_type),
            allocates,
            forward_given,
        );
        if let Some(r) = extra {
            want = match want {
                GradExpected::Reject(mut rs) => {
                    rs.push(r);
                    GradExpected::Reject(rs)
                }
                _ => GradExpected::Reject(vec![r]),
            };
        }
        want.release(&inputs.planted);
        let got = got
            .as_ref()
            .map(|[a, b, c]| [a.as_ref(), b.as_ref(), c.as_ref()])
            .map_err(Clone::clone);
        check_head_backward(&want, got).map_err(|m| format!("{name}: {m}"))
    };
    // A valid problem too large to run is skipped (the generators keep it rare).
    if matches!(
        expect_head_backward(
            gf,
            qf,
            kf,
            vf,
            of,
            &lse,
            &opts,
            &model(storage, storage),
            false,
            false
        ),
        GradExpected::TooMuchWork
    ) {
        return Ok(());
    }
    match call.into {
        None => {
            let got = returns("attention_backward", || {
                attention_backward(grad_t, q, k, v, out_t, &lse, &opts)
            })?;
            let got = got.map(|g| {
                [
                    widen(g.dq.as_ref()),
                    widen(g.dk.as_ref()),
                    widen(g.dv.as_ref()),
                ]
            });
            check("attention_backward", storage, true, None, got)
        }
        Some((gview, f32_grads)) => {
            let dk_rows = if call.defect == Some(GradDefect::DkRows) {
                n_k.saturating_sub(1).max(usize::from(n_k == 0))
            } else {
                n_k
            };
            let extra = (dk_rows != n_k).then(|| Rejection::named("dK is n_k × d_k", &["dK"]));
            #[allow(clippy::type_complexity)] // the call's arguments, passed through
            fn run_into<T: Element, G: Element>(
                shapes: [(usize, usize); 3],
                gview: View,
                args: (
                    MatRef<'_, T>,
                    MatRef<'_, T>,
                    MatRef<'_, T>,
                    MatRef<'_, T>,
                    MatRef<'_, T>,
                    &[f32],
                    &Options<'_>,
                ),
            ) -> Result<Result<[Mat<f32>; 3], attn_core::Error>, String> {
                let fill = G::from_f32(f32::NAN);
                let mut dq = StoredOut::new(shapes[0].0, shapes[0].1, gview, fill);
                let mut dk = StoredOut::new(shapes[1].0, shapes[1].1, gview, fill);
                let mut dv = StoredOut::new(shapes[2].0, shapes[2].1, gview, fill);
                let (grad, q, k, v, out, lse, opts) = args;
                let r = returns("Attention::backward_into", || {
                    Attention::head(q, k, v, opts).and_then(|call| {
                        call.backward_into(
                            ForwardRef::head(out, lse),
                            grad,
                            GradientsMut {
                                dq: dq.view_mut(),
                                dk: dk.view_mut(),
                                dv: dv.view_mut(),
                            },
                            Par::rayon(0),
                        )
                    })
                })?;
                Ok(r.map(|_dsinks| [dq.read(G::to_f32), dk.read(G::to_f32), dv.read(G::to_f32)]))
            }
            let shapes = [(n_q, d_k), (dk_rows, d_k), (n_k, d_v)];
            let args = (grad_t, q, k, v, out_t, lse.as_slice(), &opts);
            if f32_grads {
                let got = run_into::<T, f32>(shapes, gview, args)?;
                // The bound's output rounding is the storage type's: O was rounded to it.
                check(
                    "attention_backward_into (f32 gradients)",
                    storage,
                    false,
                    extra,
                    got,
                )
            } else {
                let got = run_into::<T, T>(shapes, gview, args)?;
                check("Attention::backward_into", storage, false, extra, got)
            }
        }
    }
}

fn backward_property(name: &str, heads: BoxedStrategy<HostileHead>, forward: bool, cases: u32) {
    assert_holds(run_property(
        name,
        &config(),
        cases,
        (heads, grad_call(forward)),
        |(case, call)| run_grad_case(case, *call),
    ));
}

#[test]
fn backward_moderate_inputs_match_the_reference() {
    backward_property(
        "backward_moderate",
        backward_head(Profile::Moderate),
        true,
        384,
    );
}

#[test]
fn backward_poison_at_hidden_keys_and_empty_rows_reaches_no_gradient() {
    backward_property(
        "backward_poison",
        prop_oneof![
            backward_head(Profile::Poison(Hiding::Structural)),
            backward_head(Profile::Poison(Hiding::NegInfBias)),
            backward_head(Profile::Poison(Hiding::BoolMask)),
        ]
        .boxed(),
        true,
        512,
    );
}

#[test]
fn backward_extreme_options_keep_the_contract() {
    backward_property(
        "backward_extreme_options",
        prop_oneof![
            backward_head(Profile::Windows),
            backward_head(Profile::ExtremeBias),
        ]
        .boxed(),
        true,
        384,
    );
}

#[test]
fn backward_anything_with_arbitrary_forward_results_returns() {
    backward_property(
        "backward_anything",
        prop_oneof![
            backward_head(Profile::Anything),
            backward_head(Profile::Poison(Hiding::Structural)),
        ]
        .boxed(),
        false,
        384,
    );
}

/// Batched backward: both entry points (the `_into` one in f32 or the storage type), the
/// forward's own `(out, lse)` or arbitrary ones, and malformed `grad_out`/`out`/`lse`.
#[derive(Debug, Clone, Copy, PartialEq)]
struct BatchGradCall {
    into: Option<bool>,
    forward: bool,
    defect: Option<GradDefect>,
}

fn batch_grad_call(forward: bool) -> BoxedStrategy<BatchGradCall> {
    (
        proptest::option::of(any::<bool>()),
        Just(forward),
        proptest::option::weighted(
            0.1,
            select(vec![
                GradDefect::GradOutRows,
                GradDefect::OutRows,
                GradDefect::LseLength,
            ]),
        ),
    )
        .prop_map(|(into, forward, defect)| BatchGradCall {
            into,
            forward,
            defect,
        })
        .boxed()
}

fn run_batch_grad<T: Element>(case: &HostileBatch, call: BatchGradCall) -> Result<(), String> {
    let inputs = case.build();
    let opts = inputs.options();
    let (qf, kf, vf) = (inputs.q.view(), inputs.k.view(), inputs.v.view());
    let (qd, kd, vd) = (
        inputs.q.convert(T::from_f32),
        inputs.k.convert(T::from_f32),
        inputs.v.convert(T::from_f32),
    );
    let (q, k, v) = (
        tview(&qd, inputs.q.dims, inputs.q.strides),
        tview(&kd, inputs.k.dims, inputs.k.strides),
        tview(&vd, inputs.v.dims, inputs.v.strides),
    );
    let storage = T::DTYPE;
    let [b, h_q, n_q, _] = qf.dims();
    let d_v = vf.dims()[3];
    let dims = [b, h_q, n_q, d_v];
    if matches!(
        expect_batched(qf.dims(), kf.dims(), vf.dims(), &opts, Outputs::NONE),
        BatchExpected::TooMuchWork
    ) {
        return Ok(());
    }
    let mut g = Gen::new(case.head.seed ^ 0xB0B0);
    let forward = if call.forward {
        returns("Attention::forward", || forward_batched(q, k, v, &opts))?
            .ok()
            .map(|(o, l)| {
                (
                    o.into_vec()
                        .into_iter()
                        .map(T::to_f32)
                        .collect::<Vec<f32>>(),
                    l,
                )
            })
    } else {
        None
    };
    let forward_given = forward.is_some();
    let rows = b * h_q * n_q;
    let (mut out, mut lse) = forward.unwrap_or_else(|| {
        let o = (0..rows * d_v)
            .map(|_| g.fill(Fill::NonFinite, storage))
            .collect();
        let l = (0..rows)
            .map(|_| g.fill(Fill::NonFinite, Dtype::F32) * 10.0)
            .collect();
        (o, l)
    });
    let mut grad: Vec<f32> = (0..rows * d_v)
        .map(|_| g.fill(Fill::Unit, storage))
        .collect();
    let (mut grad_dims, mut out_dims) = (dims, dims);
    match call.defect {
        Some(GradDefect::GradOutRows) => {
            grad_dims[2] += 1;
            grad = vec![0.5; grad_dims.iter().product()];
        }
        Some(GradDefect::OutRows) => {
            out_dims[2] += 1;
            out = vec![0.5; out_dims.iter().product()];
        }
        Some(GradDefect::LseLength) => lse.push(0.0),
        _ => {}
    }
    let bhsd = |d: [usize; 4]| attn_core::Layout::Bhsd.strides(d);
    let (grad_t, out_t): (Vec<T>, Vec<T>) = (
        grad.iter().map(|&x| T::from_f32(x)).collect(),
        out.iter().map(|&x| T::from_f32(x)).collect(),
    );
    let (gv, ov) = (
        tview(&grad_t, grad_dims, bhsd(grad_dims)),
        tview(&out_t, out_dims, bhsd(out_dims)),
    );
    let (gvf, ovf) = (
        tview(&grad, grad_dims, bhsd(grad_dims)),
        tview(&out, out_dims, bhsd(out_dims)),
    );
    let want = expect_batched_backward(
        grad_dims,
        qf.dims(),
        kf.dims(),
        vf.dims(),
        out_dims,
        lse.len(),
        &opts,
        call.into.is_none(),
    );
    let check = |name: &str, got: Result<[attn_core::Tensor4<f32>; 3], attn_core::Error>| {
        let got = got
            .as_ref()
            .map(|[a, b, c]| [a.as_ref(), b.as_ref(), c.as_ref()])
            .map_err(Clone::clone);
        check_batched_backward(
            &want,
            [qf, kf, vf, gvf, ovf],
            &lse,
            &opts,
            &model(storage, storage),
            forward_given,
            &inputs.head.planted,
            got,
        )
        .map_err(|m| format!("{name}: {m}"))
    };
    let widen_t = |t: attn_core::Tensor4<T>| -> attn_core::Tensor4<f32> {
        let dims = t.dims();
        attn_core::Tensor4::from_vec(t.into_vec().into_iter().map(T::to_f32).collect(), dims)
            .expect("same dims")
    };
    match call.into {
        None => {
            let got = returns("Attention::backward", || {
                Attention::batched(q, k, v, &opts)
                    .and_then(|call| call.backward(ForwardRef::batch(ov, &lse)?, gv, Par::rayon(0)))
            })?;
            check(
                "Attention::backward",
                got.map(|g| [widen_t(g.dq), widen_t(g.dk), widen_t(g.dv)]),
            )
        }
        Some(f32_grads) => {
            #[allow(clippy::type_complexity)] // the call's arguments, passed through
            fn into<T: Element, G: Element>(
                dims: [[usize; 4]; 3],
                args: (
                    Tensor4Ref<'_, T>,
                    [Tensor4Ref<'_, T>; 3],
                    Tensor4Ref<'_, T>,
                    &[f32],
                    &Options<'_>,
                ),
            ) -> Result<Result<[attn_core::Tensor4<f32>; 3], attn_core::Error>, String>
            {
                let mut bufs: Vec<Vec<G>> = dims
                    .iter()
                    .map(|d| vec![G::from_f32(f32::NAN); d.iter().product()])
                    .collect();
                let (grad, [q, k, v], out, lse, opts) = args;
                let [a, b, c] = &mut bufs[..] else {
                    unreachable!()
                };
                fn view<G>(buf: &mut [G], d: [usize; 4]) -> Tensor4Mut<'_, G> {
                    Tensor4Mut::new(buf, d, attn_core::Layout::Bshd.strides(d)).expect("fits")
                }
                let r = returns("Attention::backward_into", || {
                    Attention::batched(q, k, v, opts).and_then(|call| {
                        call.backward_into(
                            ForwardRef::batch(out, lse)?,
                            grad,
                            GradientsMut {
                                dq: view(a, dims[0]),
                                dk: view(b, dims[1]),
                                dv: view(c, dims[2]),
                            },
                            Par::rayon(0),
                        )
                    })
                })?;
                Ok(r.map(|_dsinks| {
                    let t = |buf: &[G], d: [usize; 4]| {
                        let s = attn_core::Layout::Bshd.strides(d);
                        let view = Tensor4Ref::new(buf, d, s).expect("fits");
                        let mut flat = Vec::with_capacity(buf.len());
                        for bi in 0..d[0] {
                            for h in 0..d[1] {
                                let m = view.head(bi, h).expect("in range");
                                for r in 0..d[2] {
                                    for c in 0..d[3] {
                                        flat.push(m[(r, c)].to_f32());
                                    }
                                }
                            }
                        }
                        attn_core::Tensor4::from_vec(flat, d).expect("same dims")
                    };
                    [t(a, dims[0]), t(b, dims[1]), t(c, dims[2])]
                }))
            }
            let dims = [qf.dims(), kf.dims(), vf.dims()];
            let args = (gv, [q, k, v], ov, lse.as_slice(), &opts);
            let got = if f32_grads {
                into::<T, f32>(dims, args)?
            } else {
                into::<T, T>(dims, args)?
            };
            check("Attention::backward_into", got)
        }
    }
}

fn batched_backward_property(
    name: &str,
    batches: BoxedStrategy<HostileBatch>,
    forward: bool,
    cases: u32,
) {
    assert_holds(run_property(
        name,
        &config(),
        cases,
        (batches, batch_grad_call(forward)),
        |(case, call)| with_dtype!(case.head.dtype, T => run_batch_grad::<T>(case, *call)),
    ));
}

fn backward_batch(profile: Profile) -> BoxedStrategy<HostileBatch> {
    hostile_batch(profile, &tiles())
        .prop_map(|mut c| {
            c.head.n_q = c.head.n_q.min(33);
            c.head.n_k = c.head.n_k.min(65);
            c
        })
        .boxed()
}

#[test]
fn batched_backward_moderate_and_poisoned_inputs_keep_the_contract() {
    batched_backward_property(
        "batched_backward",
        prop_oneof![
            backward_batch(Profile::Moderate),
            backward_batch(Profile::Poison(Hiding::Structural)),
            backward_batch(Profile::Poison(Hiding::NegInfBias)),
            backward_batch(Profile::Poison(Hiding::BoolMask)),
        ]
        .boxed(),
        true,
        256,
    );
}

#[test]
fn batched_backward_anything_returns() {
    batched_backward_property(
        "batched_backward_anything",
        backward_batch(Profile::Anything),
        false,
        256,
    );
}

fn huge_backward_calls<T: Element>(case: &HugeHead) -> Result<(), String> {
    let inputs = case.build();
    let [qf, kf, vf] = inputs.views();
    let rows = |r: &[f32]| r.iter().map(|&x| T::from_f32(x)).collect::<Vec<T>>();
    let (qr, kr, vr) = (
        rows(&inputs.q_row),
        rows(&inputs.k_row),
        rows(&inputs.v_row),
    );
    let [n_q, n_k, n_v] = inputs.lens;
    let (q, k, v) = (
        broadcast_rows(&qr, n_q),
        broadcast_rows(&kr, n_k),
        broadcast_rows(&vr, n_v),
    );
    let d_v = vf.ncols();
    // dO and O broadcast to [n_q, d_v]; an LSE of n_q entries only where n_q is small.
    let (zf, zt) = (vec![0.0f32; d_v], vec![T::from_f32(0.0); d_v]);
    let (of, ot) = (broadcast_rows(&zf, n_q), broadcast_rows(&zt, n_q));
    let lse = vec![0.0f32; n_q.min(8)];
    let opts = inputs.options();
    let want = expect_head_backward(
        of,
        qf,
        kf,
        vf,
        of,
        &lse,
        &opts,
        &model(T::DTYPE, T::DTYPE),
        true,
        false,
    );
    if matches!(want, GradExpected::TooMuchWork) {
        return Ok(());
    }
    let got = returns("attention_backward", || {
        attention_backward(ot, q, k, v, ot, &lse, &opts)
    })?;
    let got = got.map(|g| {
        [
            widen(g.dq.as_ref()),
            widen(g.dk.as_ref()),
            widen(g.dv.as_ref()),
        ]
    });
    let got = got
        .as_ref()
        .map(|[a, b, c]| [a.as_ref(), b.as_ref(), c.as_ref()])
        .map_err(Clone::clone);
    check_head_backward(&want, got).map_err(|m| format!("attention_backward: {m}"))
}

#[test]
fn huge_backward_shapes_fail_before_any_work() {
    isolated(
        "huge_backward_shapes_fail_before_any_work",
        CHILD_TIMEOUT,
        || {
            assert_holds(run_property(
                "huge_backward",
                &config(),
                128,
                huge_head(),
                |case| with_dtype!(case.dtype, T => huge_backward_calls::<T>(case)),
            ));
        },
    );
}

/// `MultiHeadAttention::backward` with activations of another layer or another input, and
/// `dY` of the wrong shape: typed errors naming the operand, no panic.
#[test]
fn multi_head_backward_with_mismatched_activations_is_an_error() {
    assert_holds(run_property(
        "multi_head_backward_mismatch",
        &config(),
        64,
        (
            1..=2usize,
            1..=2usize,
            1..=4usize,
            1..=5usize,
            0..4u8,
            any::<u64>(),
        ),
        |&(h_kv, group, d, n, defect, seed)| {
            let mut g = Gen::new(seed);
            let d_model = 4;
            let layer = |g: &mut Gen, d_k: usize| {
                let h = h_kv * group;
                MultiHeadWeights::new(
                    g.mat(d_model, h * d_k, Fill::Unit, Dtype::F32),
                    g.mat(d_model, h_kv * d_k, Fill::Unit, Dtype::F32),
                    g.mat(d_model, h_kv * d, Fill::Unit, Dtype::F32),
                    g.mat(h * d, d_model, Fill::Unit, Dtype::F32),
                    h,
                    h_kv,
                )
                .map(MultiHeadAttention::new)
                .map_err(|e| format!("valid weights rejected: {e}"))
            };
            let (a, other) = (layer(&mut g, d)?, layer(&mut g, d + 1)?);
            let x = g.mat(n, d_model, Fill::Unit, Dtype::F32);
            let opts = Options::default();
            let (y, act) = returns("forward_train", || a.forward_train(x.as_ref(), &opts))?
                .map_err(|e| format!("forward_train failed: {e}"))?;
            let (_, other_act) =
                returns("forward_train", || other.forward_train(x.as_ref(), &opts))?
                    .map_err(|e| format!("forward_train failed: {e}"))?;
            let x_long = g.mat(n + 1, d_model, Fill::Unit, Dtype::F32);
            let dy_bad = g.mat(n, d_model + 1, Fill::Unit, Dtype::F32);
            let (act, xq, dy, names): (_, _, _, &[&str]) = match defect {
                0 => (&other_act, x.as_ref(), y.as_ref(), &["activations"]),
                1 => (&act, x_long.as_ref(), y.as_ref(), &["x_q", "activations"]),
                2 => (&act, x.as_ref(), dy_bad.as_ref(), &["grad_y"]),
                _ => (&act, x.as_ref(), y.as_ref(), &[]),
            };
            let got = returns("MultiHeadAttention::backward", || {
                a.backward(act, xq, xq, dy, &opts)
            })?;
            match (got, names.is_empty()) {
                (Ok(_), true) => Ok(()),
                (Err(e), true) => Err(format!("a valid backward call failed: {e}")),
                (Ok(_), false) => Err(format!(
                    "defect {defect}: a mismatched backward call succeeded"
                )),
                (Err(e), false) => check_error(
                    &Expected::Reject(vec![Rejection::named(
                        "mismatched backward operands",
                        names,
                    )]),
                    &e,
                ),
            }
        },
    ));
}

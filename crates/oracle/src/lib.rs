//! Property-based conformance suite for attention engines.
//!
//! An engine implements [`Engine`]; [`check_engine`] (or one `#[test]` per property
//! through [`engine_suite!`]) runs every [`Property`] against it with proptest: random
//! cases, shrinking to a minimal failing recipe, failing seeds persisted under
//! `proptest-regressions/` and replayed first on the next run. The f64 reference
//! (`attn-reference`) is the ground truth; an engine's output must match it within a
//! bound *derived* from the engine's [`ErrorModel`], computed per case from the actual
//! inputs (below), never a tuned epsilon.
//!
//! The oracle depends on no engine but the reference, its ground truth: an engine runs
//! the suite from its own crate's tests (attn-optimized does so in
//! `crates/optimized/tests/conformance.rs`), so adding an engine never touches the oracle.
//!
//! ```
//! use attn_oracle::{check_property, Property, ReferenceEngine, SuiteConfig};
//! check_property(&ReferenceEngine, Property::Equivalence, &SuiteConfig::quick(4)).unwrap();
//! ```
//!
//! For your own kernel: implement [`Engine`] (here a stand-in that delegates to the
//! reference), then check it, one property or all of them; in a test file,
//! `attn_oracle::engine_suite!(MyKernel);` makes one `#[test]` per property.
//!
//! ```
//! use attn_core::Result;
//! use attn_oracle::{check_property, Call, Engine, ErrorModel, Output, Property, ReferenceEngine, SuiteConfig};
//!
//! struct MyKernel;
//! impl Engine for MyKernel {
//!     fn name(&self) -> String { "my-kernel".into() }
//!     // f32 scores and accumulators, an exp accurate to 2 ulp, no split-KV.
//!     fn error_model(&self) -> ErrorModel { ErrorModel::f32_streaming(2.0, None) }
//!     // Every call, forward: one head, a batch, packed, by parts (`None` for a call it
//!     // does not run). A backward pass is `Engine::backward`.
//!     fn forward(&self, call: &Call<'_>) -> Option<Result<Output>> {
//!         ReferenceEngine.forward(call)
//!     }
//! }
//! check_property(&MyKernel, Property::MaskedWeightsAreZero, &SuiteConfig::quick(8)).unwrap();
//! ```
//!
//! # The properties
//!
//! | test (= [`Property::name`]) | what it proves |
//! |---|---|
//! | `rows_sum_to_one_and_weights_lie_in_unit_interval` | with `V = I` the output is the weights: rows sum to 1 within the (tight) step-7 bound, weights in `[0, 1]` |
//! | `masked_weights_are_exactly_zero` | every key hidden by causal TL/BR, window, padding, boolean allow/block or additive `-inf` has weight exactly 0 |
//! | `hidden_keys_never_reach_the_output` | a NaN/±Inf K and V row does not reach the rows that cannot see it |
//! | `fully_masked_row_is_zero_not_nan` | rows with no visible key (and `n_k = 0`) are exactly 0 with LSE `-inf`, single-head and batched |
//! | `unscaled_softmax_entropy_collapses_scaled_does_not` (+ `tests/statistics.rs`) | the √d_k variance argument and its consequence (see [`stats`]) |
//! | `single_head_matches_reference_within_derived_bound`, `batched_gqa_any_layout_matches_reference` | equivalence on tile-straddling shapes, `n_q ≠ n_k`, `d_v ≠ d_k`, GQA, both layouts and padded strides, every mask |
//! | `adding_a_row_constant_changes_nothing`, `permuting_keys_and_values_changes_nothing`, `scaling_v_scales_the_output`, `batched_heads_equal_per_head_calls` (+ attn-optimized's `tests/multi_head_layer.rs`) | the invariances |
//! | `merging_an_empty_state_is_the_identity_bit_for_bit`, `merge_is_associative_within_bound`, `splitting_keys_anywhere_equals_one_pass` | partial states, through a [`Call`] with a split plan ([`Call::split`]) |
//! | `output_bits_do_not_depend_on_thread_count` | identical bits with 1, 2 and 3 rayon threads |
//! | `adversarial_values_stay_finite_and_within_bound` | logits to ±1e4, scale × 1000, subnormals, ties, identical keys, `-inf`/±1e4 biases, edge-of-range values |
//! | `malformed_input_is_the_reference_error` | the same [`attn_core::Error`] as the reference, never a panic |
//! | every forward property above | its cases draw soft-caps (`c ∈ [0.5, 50]`), ALiBi slopes (per head or per (batch, head), either alignment, zeros among them), sinks (`-inf` among them) and user score and mask modifiers ([`user_mods`]); backward cases do not yet ([`BACKWARD_MODIFIERS`]) |
//! | `softcapped_scores_never_exceed_the_cap` | the reference's capped scores lie in `[−c, c]`; the engine's LSE in the range they allow, its weights within `e^{2c}` of each other |
//! | `zero_alibi_slopes_are_no_alibi_bit_for_bit`, `neg_inf_sinks_are_no_sinks_bit_for_bit` | the identities, single head and batched |
//! | `a_sink_takes_its_share_and_fills_empty_rows` | the reference's weights sum to `1 − exp(σ − LSE)` (f64 rounding); a row that sees nothing has output 0 and LSE `σ` exactly |
//! | `a_user_softcap_is_the_builtin` | a user `ScoreMod` computing `SoftCap::apply_f32` is within the bound of the built-in's reference, and bit for bit the built-in where [`Engine::user_score_mod_bits_match_builtins`] |
//! | `a_user_causal_mask_is_causal_top_left` | a user `MaskMod` re-implementing causal top-left: bit for bit `Causal::TopLeft` where [`Engine::user_mask_mod_bits_match_structural`] (prefill), within the bound otherwise; no block it calls hidden is computed |
//! | `gradients_match_reference_within_derived_bound`, `batched_gqa_gradients_match_reference` | dQ, dK, dV within the derived backward bound of the f64 reference, given the engine's own forward output and LSE: every mask kind, `n_q ≠ n_k`, `d_v ≠ d_k`, GQA/MQA, both layouts and padded strides |
//! | `score_gradient_rows_sum_to_zero` | the reference's rows of `dS` sum to 0 (f64 bound); the engine's columns of dK sum to 0 within the sum of their bounds |
//! | `keys_no_query_sees_get_exactly_zero_gradient` | a key hidden from every query (padding, boolean column, `-inf` column) has dK = dV = 0 exactly with NaN/±Inf in its K, V rows and in a query's Q, dO rows, whose poison reaches nothing it cannot see |
//! | `fully_masked_rows_have_zero_query_gradient` | rows with no visible key have dQ = 0 exactly, no gradient is NaN, single-head and batched |
//! | `gqa_gradients_are_group_sums_of_mha` | grouped-query dK, dV ≡ the group sums of the multi-head gradients with K, V replicated, within the bounds |
//! | `scaling_grad_out_scales_gradients_bit_for_bit` | `dO ↦ 2^k·dO` scales every gradient by `2^k` exactly |
//! | `gradient_bits_do_not_depend_on_thread_count` | identical gradient bits with 1, 2 and 3 rayon threads, single-head and batched (groups up to 4 heads) |
//! | `paged_attention_matches_reference_within_derived_bound` | packed queries (decoding, chunks, whole prefills, none) against keys and values in pages of 1 token, of odd sizes and larger than any sequence, scattered through a pool whose unused pages and rows are NaN, grouped-query groups of 1 to 32 heads, every option a paged call takes: within the bound of the reference's paged call, which reads the pages literally and equals its packed call over the same tokens bit for bit |
//! | `paged_equals_packed_bit_for_bit_where_scheduled_alike` | the paged call and the engine's packed call over the same tokens, both key splits ([`KeySplit`]): bit for bit where [`Engine::paged_bits_match_packed`] says they are scheduled alike |
//! | `malformed_paged_calls_are_the_reference_error` | element-wise masks, key padding, top-left alignment of a sequence's newest queries, more queries than tokens: the reference's typed error |
//! | `paged_cache_fork_and_free_never_change_another_sequence` | random operations on a paged cache ([`Engine::paged_cache`], [`PagedCache`]: add, append chunks and tokens, fork, free, use a freed handle): pages accounted for, running out of pages a typed error that changes nothing, a sequence no operation touched keeps its bits, every sequence within the bound of the reference on its tokens and, where [`Engine::paged_bits_ignore_placement`], the bits of a fresh cache holding only them |
//! | `dropout_matches_reference_for_a_fixed_seed`, `dropout_gradients_match_reference_for_a_fixed_seed` | with attention dropout (`p` from 0.001 to 1, any seed), forward and gradients within the derived bounds of the reference, which materialises the same keep mask from the same Philox generator ([`attn_core::Dropout`]): single head and batched, every mask, GQA, both layouts |
//! | `dropout_keeps_the_contracts_weights_at_rate_one_minus_p` | with `V = I`, the engine's zero weights are exactly the ones the generator drops, and the share kept is within a 10⁻⁹ false-alarm (Bernstein) bound of `1 − p` |
//! | `mean_of_dropped_outputs_is_the_undropped_output` | the mean over 48 seeds is the undropped output within 5σ of the mean (`Var = Σ_j A_ij² v_jc² · p/(1 − p)`) |
//! | `zero_dropout_is_no_dropout_bit_for_bit` | `p = 0` computes the bits of a call without dropout, batched forward and backward; `output_bits_do_not_depend_on_thread_count` and its backward twin draw dropout in half their cases |
//! | `bias_gradient_matches_reference_and_ignores_thread_count` | the gradient of an additive mask (`Call::with_bias_gradient`; one bias per head shared by the batch as T5's, per (batch, head), per batch entry, one for all, key biases; broadcast by a length of 1 or a stride of 0; `-inf` entries; dropout on top sometimes) within the sum of each head's derived `dS` bound plus the f32 sum, against the reference's f64 sum of `dS`; the same bits with 1, 2 and 3 threads; skipped for an engine that returns none |
//!
//! The backward properties ([`Property::is_backward`]) run for an engine whose
//! [`Engine::backward`] returns `Some` for a head call (the batched ones for a batched
//! call); an engine without a backward pass keeps the default, which returns `None`, and
//! those properties are skipped with a note, as the merge properties are for an engine
//! whose [`Engine::forward`] returns `None` for a split plan, the packed and paged ones
//! for an engine without those calls, and the cache property for an engine without a
//! paged cache ([`Engine::paged_cache`] returns `None`).
//!
//! Hostile inputs have their own module, [`hostile`]: generators of shapes up to `usize::MAX`
//! (broadcast views), every stride sign, options and values at their extremes, and the checks
//! of what every call must return on them (the robustness suite; attn-optimized runs
//! them on all its entry points in `tests/robustness.rs`).
//!
//! # Case counts and deep runs
//!
//! Each property runs [`Property::default_cases`] cases (512 for most forward
//! properties, 128 for the thread-count and malformed-input properties; 96 for the
//! single-head backward properties and 32 for the batched and thread-count ones, whose
//! f64 reference materialises every intermediate). Measured on an AMD EPYC (Zen 4,
//! AVX-512) with two cores and nothing else running, test binaries already built, the 17
//! forward properties take about 17 s (30 s of CPU time) for the reference
//! (`cargo test -p attn-oracle --test engines`) and about 17 s (26 s of CPU time) for
//! attn-optimized's three storage types together
//! (`cargo test -p attn-optimized --test conformance`); the 8 backward properties add
//! about 3 s of CPU time for the reference and about 3.5 s for the three streaming engines
//! together.
//! The six modifier properties run 128 cases each (every other forward property's
//! cases draw modifiers too, at no extra count). With them, on a 2-core machine with other
//! work running, test binaries built, the reference's whole suite took 46 s and
//! attn-optimized's (three storage types, 108 tests) 60 s.
//! The four paged properties run 256 cases each (128 for the cache's, whose every case is
//! a dozen operations, each followed by a decoding step of every live sequence): about
//! 7 s for the reference and 10 s for attn-optimized's three storage types together on
//! the same machine, per kernel path.
//! For a deep run set `PROPTEST_CASES`, which replaces the default counts (explicit
//! counts, as in [`SuiteConfig::quick`], stay), e.g.
//! `PROPTEST_CASES=100000 cargo test -p attn-optimized --release --test conformance`.
//! Other `PROPTEST_*` variables (`PROPTEST_RNG_SEED`, `PROPTEST_MAX_SHRINK_ITERS`, …)
//! work as in proptest. `ATTN_ORACLE_TIGHTNESS=1` prints, per property, the largest
//! ratio of a measured error to its bound.
//!
//! # The derived bound
//!
#![doc = include_str!("../BOUND.md")]
#![forbid(unsafe_code)]

pub mod bound;
mod cache;
mod case;
mod engine;
pub mod hostile;
mod properties;
pub mod stats;
mod suite;
pub mod user_mods;

pub use cache::{CacheShape, PagedCache};
pub use case::{
    AdditiveRecipe, AlibiRecipe, BACKWARD_MODIFIERS, BatchCase, BatchInputs, Bias, BoolRecipe,
    BuiltMasks, HeadCase, HeadInputs, HeadSlot, KeyPattern, MaskRecipe, ModRecipe, OwnedTensor,
    Rng, Shapes, Sinks, Slopes, TensorLayout, Values, adversarial_case, batch_case, edge_lengths,
    head_case, head_case_with, length, masks, modifiers, width,
};
pub use engine::{
    BatchGradients, Call, Compute, Dtype, Engine, ErrorModel, Gradients, Grads, KeySplit,
    MergePlan, Operands, Output, ReferenceEngine, Saved, View, edge_magnitude,
};
pub use properties::{
    BatchGradCase, BiasCase, CacheCase, CacheOp, Defect, GradCase, KeyHider, Mask4Case,
    Mask4Recipe, PackedCase, PagedCase, PagedDefect, PoolLayout, RowHider, assert_property,
    check_engine, check_property, compare_head,
};
pub use suite::{Failure, Property, SuiteConfig};

/// Generates one `#[test]` per [`Property`] for an engine, named after the property
/// (e.g. `fully_masked_row_is_zero_not_nan`), with failures persisted under the calling
/// crate's `proptest-regressions/<engine name>/`.
///
/// Put it in a module per engine: `mod reference { attn_oracle::engine_suite!(attn_oracle::ReferenceEngine); }`.
#[macro_export]
macro_rules! engine_suite {
    ($engine:expr) => {
        $crate::engine_suite!(@tests $engine;
            rows_sum_to_one_and_weights_lie_in_unit_interval => RowsSumToOne,
            masked_weights_are_exactly_zero => MaskedWeightsAreZero,
            hidden_keys_never_reach_the_output => HiddenKeysNeverLeak,
            fully_masked_row_is_zero_not_nan => FullyMaskedRows,
            unscaled_softmax_entropy_collapses_scaled_does_not => EntropyCollapse,
            single_head_matches_reference_within_derived_bound => Equivalence,
            batched_gqa_any_layout_matches_reference => BatchedEquivalence,
            adding_a_row_constant_changes_nothing => RowShift,
            permuting_keys_and_values_changes_nothing => KeyPermutation,
            scaling_v_scales_the_output => ValueScaling,
            batched_heads_equal_per_head_calls => HeadsAreIndependent,
            merging_an_empty_state_is_the_identity_bit_for_bit => MergeIdentity,
            merge_is_associative_within_bound => MergeAssociativity,
            splitting_keys_anywhere_equals_one_pass => SplitKeys,
            output_bits_do_not_depend_on_thread_count => Determinism,
            adversarial_values_stay_finite_and_within_bound => Adversarial,
            malformed_input_is_the_reference_error => MalformedInput,
            gradients_match_reference_within_derived_bound => BackwardEquivalence,
            batched_gqa_gradients_match_reference => BatchedBackwardEquivalence,
            score_gradient_rows_sum_to_zero => ScoreGradientRowsSumToZero,
            keys_no_query_sees_get_exactly_zero_gradient => BackwardHiddenKeys,
            fully_masked_rows_have_zero_query_gradient => BackwardFullyMaskedRows,
            gqa_gradients_are_group_sums_of_mha => GqaGradientsAreGroupSums,
            scaling_grad_out_scales_gradients_bit_for_bit => GradOutScaling,
            gradient_bits_do_not_depend_on_thread_count => BackwardDeterminism,
            per_head_masks_broadcast_along_any_axes_match_reference => PerHeadMasks,
            a_4d_mask_broadcast_from_2d_is_that_mask_bit_for_bit => BroadcastMaskIsShared,
            per_head_mask_gradients_match_reference => PerHeadMaskGradients,
            packed_batch_equals_each_sequence_alone => PackedSequences,
            packed_gradients_equal_each_sequence_alone => PackedGradients,
            softcapped_scores_never_exceed_the_cap => SoftCapBoundsScores,
            zero_alibi_slopes_are_no_alibi_bit_for_bit => ZeroSlopesAreNoAlibi,
            neg_inf_sinks_are_no_sinks_bit_for_bit => NegInfSinksAreNoSinks,
            a_sink_takes_its_share_and_fills_empty_rows => SinkTakesItsShare,
            a_user_softcap_is_the_builtin => UserSoftCapIsTheBuiltin,
            a_user_causal_mask_is_causal_top_left => UserCausalMaskIsTopLeft,
            paged_attention_matches_reference_within_derived_bound => PagedEquivalence,
            paged_equals_packed_bit_for_bit_where_scheduled_alike => PagedIsPacked,
            malformed_paged_calls_are_the_reference_error => PagedMalformed,
            paged_cache_fork_and_free_never_change_another_sequence => PagedCacheIsolation,
            dropout_matches_reference_for_a_fixed_seed => DropoutMatchesReference,
            dropout_gradients_match_reference_for_a_fixed_seed => DropoutGradientsMatchReference,
            dropout_keeps_the_contracts_weights_at_rate_one_minus_p => DropoutKeepRate,
            mean_of_dropped_outputs_is_the_undropped_output => DropoutMeanIsUndropped,
            zero_dropout_is_no_dropout_bit_for_bit => ZeroDropoutIsNoDropout,
            bias_gradient_matches_reference_and_ignores_thread_count => BiasGradientMatchesReference,
        );
    };
    (@tests $engine:expr; $($name:ident => $prop:ident,)*) => {
        $(
            #[test]
            fn $name() {
                $crate::assert_property(
                    &$engine,
                    $crate::Property::$prop,
                    &$crate::SuiteConfig::for_crate(env!("CARGO_MANIFEST_DIR")),
                );
            }
        )*
    };
}

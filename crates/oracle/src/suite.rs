//! What the properties run on: the property list, the configuration, the proptest runner,
//! failures and the tightness report. The dispatch from a [`Property`] to its check is in
//! `properties`.

use std::cell::Cell;
use std::fmt;
use std::path::PathBuf;

use proptest::strategy::Strategy;
use proptest::test_runner::{Config, FileFailurePersistence, TestCaseError, TestError, TestRunner};

use crate::Engine;

/// One property of the suite. [`Property::name`] is the name of its test.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Property {
    /// 1. With `V = I` the output is the weight matrix: every row with a visible key
    ///    sums to 1 within the derived bound, every weight lies in `[0, 1]`.
    RowsSumToOne,
    /// 2. Every hidden weight is exactly 0, for every mask kind and combination.
    MaskedWeightsAreZero,
    /// 2. A NaN/Inf in the K and V rows of a key hidden from some queries does not reach
    ///    those queries' outputs; a NaN/Inf query row does not reach the other rows.
    HiddenKeysNeverLeak,
    /// 3. Rows with no visible key (and `n_k = 0`) are exactly 0 with LSE `-inf`.
    FullyMaskedRows,
    /// 4. Without scaling, softmax entropy collapses as `d_k` grows; with `1/√d_k` it
    ///    does not (deterministic, fixed seed).
    EntropyCollapse,
    /// 5. One head ≡ reference within the derived bound (output and LSE).
    Equivalence,
    /// 5. Batched, grouped-query, mixed layouts, per-batch padding ≡ reference.
    BatchedEquivalence,
    /// 6. Adding a constant to every score of a row (through the additive mask) changes
    ///    the output by no more than the bounds, and the LSE by the constant.
    RowShift,
    /// 6. Permuting keys and values (and the element-wise masks' columns) together
    ///    changes nothing beyond the bounds.
    KeyPermutation,
    /// 6. `O(αV) = α·O(V)`: exactly for `α = −1`, within the bound otherwise; the LSE
    ///    does not depend on `V` at all (bit for bit).
    ValueScaling,
    /// 6. A batched call ≡ one single-head call per (batch, head) on strided views.
    HeadsAreIndependent,
    /// 7. Merging with the empty state, or with a state whose keys are all hidden, is
    ///    the identity, bit for bit.
    MergeIdentity,
    /// 7. `(a·b)·c` and `a·(b·c)` both match the reference within the bound.
    MergeAssociativity,
    /// 7. Splitting the keys anywhere and merging (left fold, right fold, tree) ≡ one pass.
    SplitKeys,
    /// 8. Identical output bits with 1, 2 and 3 rayon threads.
    Determinism,
    /// 9. Adversarial values (large logits, scale × 1000, subnormals, ties, identical
    ///    keys, `-inf`/`±1e4` biases, edge-of-range values): finite, within the bound.
    Adversarial,
    /// Malformed input is the same [`attn_core::Error`] as the reference's, never a
    ///    panic.
    MalformedInput,
    /// 14. One head's gradients (dQ, dK, dV) ≡ reference within the derived backward
    ///     bound, on every mask kind, `n_q ≠ n_k`, `d_v ≠ d_k`, given the engine's own
    ///     forward output and LSE.
    BackwardEquivalence,
    /// 14. Batched, grouped-query (and multi-query) gradients, mixed layouts, per-batch
    ///     padding ≡ reference; a kv head's dK and dV are its group's sums.
    BatchedBackwardEquivalence,
    /// 14. The reference's score gradient has rows summing to 0 (softmax ignores a
    ///     constant added to a row), and the engine's dK has columns summing to 0 within
    ///     the bound.
    ScoreGradientRowsSumToZero,
    /// 14. A key hidden from every query has dK = dV = 0 exactly, with NaN/±Inf in its K
    ///     and V rows and in a query's Q and dO rows; that query's poison reaches only its
    ///     own dQ row and the keys it sees.
    BackwardHiddenKeys,
    /// 14. A row that sees no key has dQ = 0 exactly; no gradient is NaN (single-head
    ///     and batched).
    BackwardFullyMaskedRows,
    /// 14. Grouped-query dK, dV ≡ the per-group sums of multi-head gradients with K and V
    ///     replicated per query head; dQ ≡ the multi-head dQ.
    GqaGradientsAreGroupSums,
    /// 14. `dO ↦ 2^k·dO` scales every gradient by `2^k`, bit for bit.
    GradOutScaling,
    /// 14. Identical gradient bits with 1, 2 and 3 rayon threads (single head and
    ///     batched, groups of up to 4 query heads).
    BackwardDeterminism,
    /// 17. Masks per batch entry and head (`[B, H, n_q, n_k]`, broadcast along every
    ///     subset of the axes by strides of 0 or lengths of 1, key- or query-contiguous)
    ///     give each head what its explicit `[n_q, n_k]` mask gives the reference.
    PerHeadMasks,
    /// 17. A `[B, H, n_q, n_k]` mask broadcast from a `[n_q, n_k]` one computes the same
    ///     output bits (and gradient bits, with a batched backward pass) as that mask.
    BroadcastMaskIsShared,
    /// 17. Batched gradients with 4-D boolean and additive masks (per head, broadcast
    ///     along random axes) ≡ reference within the derived backward bound.
    PerHeadMaskGradients,
    /// 17. A packed batch of sequences of mixed lengths (empty and one-token ones among
    ///     them) ≡ each sequence on its own: within the bound of the reference, and bit
    ///     for bit when every sequence has the same shape.
    PackedSequences,
    /// 17. Packed gradients ≡ each sequence's on its own, as [`Property::PackedSequences`].
    PackedGradients,
    /// 16. Soft-capped scores lie in `[−c, c]` (the reference's materialised scores), so an
    ///     engine's LSE lies in the range they allow and its weights within `e^{2c}` of each
    ///     other.
    SoftCapBoundsScores,
    /// 16. ALiBi with every slope 0 is bit for bit no ALiBi (single head and batched).
    ZeroSlopesAreNoAlibi,
    /// 16. Sinks of `-inf` are bit for bit no sinks (single head and batched).
    NegInfSinksAreNoSinks,
    /// 16. With a finite sink σ, the reference's weights sum to `1 − exp(σ − LSE)` (f64
    ///     rounding) and a row that sees no key has output 0 and LSE σ exactly.
    SinkTakesItsShare,
    /// 16. A user score modifier computing `SoftCap::apply_f32` is the built-in soft-cap:
    ///     within the bound, and bit for bit where the engine says so.
    UserSoftCapIsTheBuiltin,
    /// 16. A user mask re-implementing causal top-left with exact block answers is
    ///     `Causal::TopLeft` (bit for bit where the engine says its tiles coincide, within
    ///     the bound otherwise), and no block it calls hidden is computed.
    UserCausalMaskIsTopLeft,
    /// 18. A paged call (packed queries, each sequence's newest tokens, against keys and
    ///     values in scattered pages of a pool whose unused pages and rows are NaN) ≡ the
    ///     reference's paged call within the derived bound; the reference's paged call,
    ///     which reads the same pages literally, ≡ its packed call over the same tokens,
    ///     bit for bit.
    PagedEquivalence,
    /// 18. A paged call ≡ the engine's packed call over the same tokens, bit for bit, for
    ///     each key split where the engine says the two are scheduled alike
    ///     ([`Engine::paged_bits_match_packed`](crate::Engine::paged_bits_match_packed)).
    PagedIsPacked,
    /// 18. A paged call with an element-wise mask or key padding, aligned top-left while its
    ///     queries are a sequence's newest tokens, or with more queries than tokens, is the
    ///     reference's typed error.
    PagedMalformed,
    /// 18. In a paged cache ([`Engine::paged_cache`](crate::Engine::paged_cache)), after
    ///     every operation of a random sequence (add, append a chunk or a token, fork, free,
    ///     use a freed handle): the pages are accounted for, running out of pages is a typed
    ///     error that changes nothing, a sequence no operation touched keeps its bits (fork
    ///     and free never change another sequence's results), every sequence is within the
    ///     bound of the reference on its tokens and, where the engine's bits ignore where
    ///     pages lie ([`Engine::paged_bits_ignore_placement`](crate::Engine::paged_bits_ignore_placement)),
    ///     those of a fresh cache holding only them.
    PagedCacheIsolation,
    /// 19. With attention dropout (any `p`, any seed), the forward pass ≡ the reference's,
    ///     which materialises the same mask from the same generator, within the derived
    ///     bound: single head and batched (every mask, GQA, both layouts).
    DropoutMatchesReference,
    /// 19. With attention dropout, the gradients ≡ the reference's within the derived
    ///     backward bound, single head and batched.
    DropoutGradientsMatchReference,
    /// 19. The engine drops exactly the weights the contract's generator drops (V = I),
    ///     and keeps a share within a 10⁻⁹ false-alarm bound of `1 − p`.
    DropoutKeepRate,
    /// 19. The mean of the outputs of many seeds is the undropped output (within 5σ of the
    ///     mean, from the reference's weights).
    DropoutMeanIsUndropped,
    /// 19. `p = 0` is no dropout, bit for bit: batched forward and backward.
    ZeroDropoutIsNoDropout,
    /// 20. The gradient of an additive mask (per head, per batch entry, shared, key biases;
    ///     by a length of 1 or a stride of 0; dropout on top sometimes) ≡ the reference's
    ///     sum of `dS` within the derived bound, the same bits with 1, 2 and 3 threads.
    BiasGradientMatchesReference,
}

impl Property {
    /// Every property, in the order of the issue.
    pub const ALL: [Property; 46] = [
        Property::RowsSumToOne,
        Property::MaskedWeightsAreZero,
        Property::HiddenKeysNeverLeak,
        Property::FullyMaskedRows,
        Property::EntropyCollapse,
        Property::Equivalence,
        Property::BatchedEquivalence,
        Property::RowShift,
        Property::KeyPermutation,
        Property::ValueScaling,
        Property::HeadsAreIndependent,
        Property::MergeIdentity,
        Property::MergeAssociativity,
        Property::SplitKeys,
        Property::Determinism,
        Property::Adversarial,
        Property::MalformedInput,
        Property::BackwardEquivalence,
        Property::BatchedBackwardEquivalence,
        Property::ScoreGradientRowsSumToZero,
        Property::BackwardHiddenKeys,
        Property::BackwardFullyMaskedRows,
        Property::GqaGradientsAreGroupSums,
        Property::GradOutScaling,
        Property::BackwardDeterminism,
        Property::PerHeadMasks,
        Property::BroadcastMaskIsShared,
        Property::PerHeadMaskGradients,
        Property::PackedSequences,
        Property::PackedGradients,
        Property::SoftCapBoundsScores,
        Property::ZeroSlopesAreNoAlibi,
        Property::NegInfSinksAreNoSinks,
        Property::SinkTakesItsShare,
        Property::UserSoftCapIsTheBuiltin,
        Property::UserCausalMaskIsTopLeft,
        Property::PagedEquivalence,
        Property::PagedIsPacked,
        Property::PagedMalformed,
        Property::PagedCacheIsolation,
        Property::DropoutMatchesReference,
        Property::DropoutGradientsMatchReference,
        Property::DropoutKeepRate,
        Property::DropoutMeanIsUndropped,
        Property::ZeroDropoutIsNoDropout,
        Property::BiasGradientMatchesReference,
    ];

    /// The test name: what the property proves.
    ///
    /// ```
    /// use attn_oracle::Property;
    /// assert_eq!(Property::FullyMaskedRows.name(), "fully_masked_row_is_zero_not_nan");
    /// ```
    pub fn name(self) -> &'static str {
        match self {
            Property::RowsSumToOne => "rows_sum_to_one_and_weights_lie_in_unit_interval",
            Property::MaskedWeightsAreZero => "masked_weights_are_exactly_zero",
            Property::HiddenKeysNeverLeak => "hidden_keys_never_reach_the_output",
            Property::FullyMaskedRows => "fully_masked_row_is_zero_not_nan",
            Property::EntropyCollapse => "unscaled_softmax_entropy_collapses_scaled_does_not",
            Property::Equivalence => "single_head_matches_reference_within_derived_bound",
            Property::BatchedEquivalence => "batched_gqa_any_layout_matches_reference",
            Property::RowShift => "adding_a_row_constant_changes_nothing",
            Property::KeyPermutation => "permuting_keys_and_values_changes_nothing",
            Property::ValueScaling => "scaling_v_scales_the_output",
            Property::HeadsAreIndependent => "batched_heads_equal_per_head_calls",
            Property::MergeIdentity => "merging_an_empty_state_is_the_identity_bit_for_bit",
            Property::MergeAssociativity => "merge_is_associative_within_bound",
            Property::SplitKeys => "splitting_keys_anywhere_equals_one_pass",
            Property::Determinism => "output_bits_do_not_depend_on_thread_count",
            Property::Adversarial => "adversarial_values_stay_finite_and_within_bound",
            Property::MalformedInput => "malformed_input_is_the_reference_error",
            Property::BackwardEquivalence => "gradients_match_reference_within_derived_bound",
            Property::BatchedBackwardEquivalence => "batched_gqa_gradients_match_reference",
            Property::ScoreGradientRowsSumToZero => "score_gradient_rows_sum_to_zero",
            Property::BackwardHiddenKeys => "keys_no_query_sees_get_exactly_zero_gradient",
            Property::BackwardFullyMaskedRows => "fully_masked_rows_have_zero_query_gradient",
            Property::GqaGradientsAreGroupSums => "gqa_gradients_are_group_sums_of_mha",
            Property::GradOutScaling => "scaling_grad_out_scales_gradients_bit_for_bit",
            Property::BackwardDeterminism => "gradient_bits_do_not_depend_on_thread_count",
            Property::PerHeadMasks => "per_head_masks_broadcast_along_any_axes_match_reference",
            Property::BroadcastMaskIsShared => {
                "a_4d_mask_broadcast_from_2d_is_that_mask_bit_for_bit"
            }
            Property::PerHeadMaskGradients => "per_head_mask_gradients_match_reference",
            Property::PackedSequences => "packed_batch_equals_each_sequence_alone",
            Property::PackedGradients => "packed_gradients_equal_each_sequence_alone",
            Property::SoftCapBoundsScores => "softcapped_scores_never_exceed_the_cap",
            Property::ZeroSlopesAreNoAlibi => "zero_alibi_slopes_are_no_alibi_bit_for_bit",
            Property::NegInfSinksAreNoSinks => "neg_inf_sinks_are_no_sinks_bit_for_bit",
            Property::SinkTakesItsShare => "a_sink_takes_its_share_and_fills_empty_rows",
            Property::UserSoftCapIsTheBuiltin => "a_user_softcap_is_the_builtin",
            Property::UserCausalMaskIsTopLeft => "a_user_causal_mask_is_causal_top_left",
            Property::PagedEquivalence => "paged_attention_matches_reference_within_derived_bound",
            Property::PagedIsPacked => "paged_equals_packed_bit_for_bit_where_scheduled_alike",
            Property::PagedMalformed => "malformed_paged_calls_are_the_reference_error",
            Property::PagedCacheIsolation => {
                "paged_cache_fork_and_free_never_change_another_sequence"
            }
            Property::DropoutMatchesReference => "dropout_matches_reference_for_a_fixed_seed",
            Property::DropoutGradientsMatchReference => {
                "dropout_gradients_match_reference_for_a_fixed_seed"
            }
            Property::DropoutKeepRate => "dropout_keeps_the_contracts_weights_at_rate_one_minus_p",
            Property::DropoutMeanIsUndropped => "mean_of_dropped_outputs_is_the_undropped_output",
            Property::ZeroDropoutIsNoDropout => "zero_dropout_is_no_dropout_bit_for_bit",
            Property::BiasGradientMatchesReference => {
                "bias_gradient_matches_reference_and_ignores_thread_count"
            }
        }
    }

    /// Cases run by default (the `PROPTEST_CASES` environment variable overrides it for
    /// configurations without an explicit count, such as [`engine_suite!`](crate::engine_suite)'s).
    pub fn default_cases(self) -> u32 {
        match self {
            Property::EntropyCollapse => 1,
            Property::Determinism => 128,
            Property::MalformedInput => 128,
            // The backward properties run the f64 reference backward, O(n_q·n_k·d) per
            // head with every intermediate materialised.
            Property::BatchedBackwardEquivalence
            | Property::GqaGradientsAreGroupSums
            | Property::BackwardDeterminism => 32,
            // Batched and packed cases of several heads each, kept few so that
            // the suite's runtime stays moderate.
            Property::PerHeadMasks
            | Property::BroadcastMaskIsShared
            | Property::PackedSequences => 64,
            Property::PerHeadMaskGradients | Property::PackedGradients => 24,
            // Paged cases are capped in the reference's work (a few sequences and heads,
            // long sequences decoding); a cache case decodes every live sequence after each
            // of its operations, in its cache, in a fresh one and in the reference.
            Property::PagedEquivalence | Property::PagedIsPacked | Property::PagedMalformed => 256,
            Property::PagedCacheIsolation => 128,
            // Each case runs dozens of seeds.
            Property::DropoutMeanIsUndropped => 24,
            Property::DropoutGradientsMatchReference | Property::BiasGradientMatchesReference => 32,
            Property::DropoutMatchesReference
            | Property::DropoutKeepRate
            | Property::ZeroDropoutIsNoDropout => 96,
            // Every other forward property draws modifiers too; these target
            // one identity each, two or four engine calls per case.
            Property::SoftCapBoundsScores
            | Property::ZeroSlopesAreNoAlibi
            | Property::NegInfSinksAreNoSinks
            | Property::SinkTakesItsShare
            | Property::UserSoftCapIsTheBuiltin
            | Property::UserCausalMaskIsTopLeft => 128,
            Property::BackwardEquivalence
            | Property::ScoreGradientRowsSumToZero
            | Property::BackwardHiddenKeys
            | Property::BackwardFullyMaskedRows
            | Property::GradOutScaling => 96,
            _ => 512,
        }
    }

    /// Whether the property checks the backward pass (and is skipped for an engine
    /// without one).
    ///
    /// ```
    /// use attn_oracle::Property;
    /// assert!(Property::GradOutScaling.is_backward());
    /// assert!(!Property::Equivalence.is_backward());
    /// ```
    pub fn is_backward(self) -> bool {
        matches!(
            self,
            Property::BackwardEquivalence
                | Property::BatchedBackwardEquivalence
                | Property::ScoreGradientRowsSumToZero
                | Property::BackwardHiddenKeys
                | Property::BackwardFullyMaskedRows
                | Property::GqaGradientsAreGroupSums
                | Property::GradOutScaling
                | Property::BackwardDeterminism
                | Property::PerHeadMaskGradients
                | Property::PackedGradients
                | Property::DropoutGradientsMatchReference
                | Property::BiasGradientMatchesReference
        )
    }
}

impl fmt::Display for Property {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// How many cases to run and where to persist failures.
///
/// ```
/// use attn_oracle::{Property, SuiteConfig};
/// let c = SuiteConfig::quick(3);
/// assert!(c.regressions.is_none());
/// assert_eq!(c.cases_for(Property::Equivalence), 3); // exact, whatever PROPTEST_CASES says
/// ```
#[derive(Debug, Clone, Default)]
pub struct SuiteConfig {
    /// Cases per property, exactly; `None` uses the environment variable
    /// `PROPTEST_CASES` when it is set, else [`Property::default_cases`].
    pub cases: Option<u32>,
    /// Directory of persisted failing seeds (`<dir>/<engine>/<property>.txt`), replayed
    /// first on every run; `None` persists nothing.
    pub regressions: Option<PathBuf>,
    /// Upper limit on shrinking steps (0: proptest's default).
    pub max_shrink_iters: u32,
}

impl SuiteConfig {
    /// `cases` per property, nothing persisted.
    pub fn quick(cases: u32) -> Self {
        SuiteConfig {
            cases: Some(cases),
            regressions: None,
            max_shrink_iters: 256,
        }
    }

    /// Default case counts, failures persisted under `<manifest_dir>/proptest-regressions`
    /// (what [`engine_suite!`](crate::engine_suite) uses).
    pub fn for_crate(manifest_dir: &str) -> Self {
        SuiteConfig {
            cases: None,
            regressions: Some(PathBuf::from(manifest_dir).join("proptest-regressions")),
            max_shrink_iters: 1024,
        }
    }

    /// The number of cases `property` runs with.
    pub fn cases_for(&self, property: Property) -> u32 {
        if property == Property::EntropyCollapse {
            return 1;
        }
        self.cases.unwrap_or_else(|| {
            std::env::var("PROPTEST_CASES")
                .ok()
                .and_then(|s| s.parse().ok())
                .unwrap_or(property.default_cases())
        })
    }
}

/// A property that does not hold, with the minimal (shrunk) input that shows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Failure {
    /// The engine's name.
    pub engine: String,
    /// The property.
    pub property: Property,
    /// What went wrong and the shrunk input.
    pub message: String,
}

impl fmt::Display for Failure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "engine `{}` fails `{}`: {}",
            self.engine, self.property, self.message
        )
    }
}

impl std::error::Error for Failure {}

thread_local! {
    /// The largest |error| / bound seen by the current property run on this thread.
    static TIGHTNESS: Cell<f64> = const { Cell::new(0.0) };
}

/// Records a measured error against its bound (for the tightness report).
pub(crate) fn record_tightness(err: f64, bound: f64) {
    if bound > 0.0 && bound.is_finite() && err.is_finite() {
        TIGHTNESS.with(|t| t.set(t.get().max(err / bound)));
    }
}

fn sanitize(name: &str) -> String {
    name.chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' || c == '_' {
                c
            } else {
                '_'
            }
        })
        .collect()
}

/// Runs `strategy` through `test` with proptest (shrinking, persisted failures).
pub(crate) fn run<S>(
    engine: &dyn Engine,
    property: Property,
    config: &SuiteConfig,
    strategy: S,
    test: impl Fn(&dyn Engine, S::Value) -> Result<(), TestCaseError>,
) -> Result<(), Failure>
where
    S: Strategy,
    S::Value: fmt::Debug,
{
    // Config::default() reads the PROPTEST_* environment variables.
    let mut pc = Config {
        cases: config.cases_for(property),
        ..Config::default()
    };
    if config.max_shrink_iters > 0 {
        pc.max_shrink_iters = config.max_shrink_iters;
    }
    pc.source_file = None;
    pc.failure_persistence = config.regressions.as_ref().map(|dir| {
        let path = dir
            .join(sanitize(&engine.name()))
            .join(format!("{}.txt", property.name()));
        // proptest wants a 'static path; one small leak per property run.
        let path: &'static str = Box::leak(path.to_string_lossy().into_owned().into_boxed_str());
        Box::new(FileFailurePersistence::Direct(path)) as _
    });
    TIGHTNESS.with(|t| t.set(0.0));
    let mut runner = TestRunner::new(pc);
    let result = runner.run(&strategy, |value| test(engine, value));
    if std::env::var_os("ATTN_ORACLE_TIGHTNESS").is_some() {
        eprintln!(
            "attn-oracle: {} / {}: largest |error| / bound = {:.3e}",
            engine.name(),
            property.name(),
            TIGHTNESS.with(Cell::get)
        );
    }
    match result {
        Ok(()) => Ok(()),
        Err(TestError::Fail(reason, value)) => Err(Failure {
            engine: engine.name(),
            property,
            message: format!("{reason}\nminimal failing input: {value:#?}"),
        }),
        Err(TestError::Abort(reason)) => Err(Failure {
            engine: engine.name(),
            property,
            message: format!("aborted: {reason}"),
        }),
    }
}

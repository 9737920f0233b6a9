//! The property checks, one function per property over built inputs, and the dispatch
//! from a [`Property`] to its strategy and check.
//!
//! The modules are split by what they check, and use each other in one direction only:
//! `common` (the reference and bound of a head, the comparison with them, the shapes) is
//! used by the property modules, which use nothing of each other; this module uses them
//! all and nothing uses it but the crate root.
//! - `forward`: the forward pass on ordinary inputs (weights, equivalence, invariances,
//!   partial states, determinism);
//! - `robustness`: the forward pass at the edges of its input (non-finite values in hidden
//!   rows, rows that see nothing, adversarial magnitudes, malformed calls);
//! - `backward`: the backward pass ([`Engine::backward`] of head and batched calls),
//!   skipped for engines whose backward pass returns `None`, as the merge properties are
//!   for engines that run no split plan;
//! - `per_head`: masks per batch entry and head (`[B, H, n_q, n_k]` views),
//!   forward and backward;
//! - `modifiers`: the score modifiers' own identities (every other forward
//!   property's cases draw modifiers too);
//! - `packed`: packed batches of sequences of different lengths
//!   ([`Engine::forward`] and [`Engine::backward`] of packed calls),
//!   skipped for engines without them;
//! - `bias`: the gradient of an additive mask (a learnable bias), batched;
//! - `dropout`: attention dropout's own cases and checks (the keep mask, the mean of many
//!   seeds, `p = 0`); its equivalence and determinism run the checks of `forward` and
//!   `backward` on cases with dropout, dispatched here;
//! - `paged`: packed queries against keys and values in pages ([`Engine::forward`] of
//!   paged calls) and paged caches ([`Engine::paged_cache`]), skipped for engines without
//!   them.

mod backward;
mod bias;
mod common;
mod dropout;
mod forward;
mod modifiers;
mod packed;
mod paged;
mod per_head;
mod robustness;

pub use backward::{BatchGradCase, GradCase, KeyHider};
pub use bias::BiasCase;
pub use common::{RowHider, compare_head};
pub use packed::PackedCase;
pub use paged::{CacheCase, CacheOp, PagedCase, PagedDefect, PoolLayout};
pub use per_head::{Mask4Case, Mask4Recipe};
pub use robustness::Defect;

use proptest::prelude::*;

use crate::case::{adversarial_case, batch_case, head_case};
use crate::suite::{Failure, Property, SuiteConfig, run};
use crate::{Engine, stats};
use common::{batch_shapes, shapes};

/// Checks one property against `engine`.
///
/// ```
/// use attn_oracle::{check_property, Property, ReferenceEngine, SuiteConfig};
/// check_property(&ReferenceEngine, Property::FullyMaskedRows, &SuiteConfig::quick(4)).unwrap();
/// ```
pub fn check_property(
    engine: &dyn Engine,
    property: Property,
    config: &SuiteConfig,
) -> Result<(), Failure> {
    let shapes = shapes(engine);
    if matches!(
        property,
        Property::PackedSequences | Property::PackedGradients
    ) {
        return check_packed(engine, property, config);
    }
    if matches!(
        property,
        Property::PagedEquivalence
            | Property::PagedIsPacked
            | Property::PagedMalformed
            | Property::PagedCacheIsolation
    ) {
        return check_paged(engine, property, config);
    }
    if property.is_backward() {
        return check_backward(engine, property, config);
    }
    match property {
        Property::RowsSumToOne => run(
            engine,
            property,
            config,
            forward::identity_v_case(&shapes),
            forward::rows_sum_to_one,
        ),
        Property::MaskedWeightsAreZero => run(
            engine,
            property,
            config,
            forward::identity_v_case(&shapes),
            forward::masked_weights_are_zero,
        ),
        Property::HiddenKeysNeverLeak => run(
            engine,
            property,
            config,
            robustness::poison_case(&shapes),
            robustness::hidden_keys_never_leak,
        ),
        Property::FullyMaskedRows => run(
            engine,
            property,
            config,
            common::masked_rows_case(&shapes),
            robustness::fully_masked_rows,
        ),
        Property::EntropyCollapse => stats::entropy_collapse(engine).map_err(|message| Failure {
            engine: engine.name(),
            property,
            message,
        }),
        Property::Equivalence => run(
            engine,
            property,
            config,
            head_case(&shapes),
            forward::equivalence,
        ),
        Property::BatchedEquivalence => run(
            engine,
            property,
            config,
            batch_case(&batch_shapes(&shapes)),
            forward::batched_equivalence,
        ),
        Property::RowShift => run(
            engine,
            property,
            config,
            forward::shift_case(&shapes),
            forward::row_shift,
        ),
        Property::KeyPermutation => run(
            engine,
            property,
            config,
            forward::permutation_case(&shapes),
            forward::key_permutation,
        ),
        Property::ValueScaling => run(
            engine,
            property,
            config,
            forward::scaling_case(&shapes),
            forward::value_scaling,
        ),
        Property::HeadsAreIndependent => run(
            engine,
            property,
            config,
            batch_case(&batch_shapes(&shapes)),
            forward::heads_are_independent,
        ),
        Property::MergeIdentity | Property::MergeAssociativity | Property::SplitKeys => {
            if !forward::supports_split(engine) {
                eprintln!(
                    "attn-oracle: engine `{}` has no partial-state API; `{}` skipped",
                    engine.name(),
                    property.name()
                );
                return Ok(());
            }
            let check = match property {
                Property::MergeIdentity => forward::merge_identity,
                Property::MergeAssociativity => forward::merge_associativity,
                _ => forward::split_keys,
            };
            run(
                engine,
                property,
                config,
                forward::split_case(&shapes),
                check,
            )
        }
        Property::Determinism => run(
            engine,
            property,
            config,
            dropout::with_dropout(
                forward::determinism_case(&shapes),
                0.5,
                dropout::set_forward,
            ),
            forward::determinism,
        ),
        Property::DropoutMatchesReference => run(
            engine,
            property,
            config,
            dropout::with_dropout(
                (head_case(&shapes), batch_case(&batch_shapes(&shapes))).boxed(),
                1.0,
                dropout::set_forward,
            ),
            |engine, (head, batch)| {
                forward::equivalence(engine, head)?;
                forward::batched_equivalence(engine, batch)
            },
        ),
        Property::DropoutKeepRate => run(
            engine,
            property,
            config,
            dropout::keep_rate_case(&shapes),
            dropout::keep_rate,
        ),
        Property::DropoutMeanIsUndropped => run(
            engine,
            property,
            config,
            dropout::mean_case(&shapes),
            dropout::mean_is_undropped,
        ),
        Property::ZeroDropoutIsNoDropout => run(
            engine,
            property,
            config,
            (batch_case(&batch_shapes(&shapes)), any::<u64>()),
            dropout::zero_is_none,
        ),
        Property::Adversarial => run(
            engine,
            property,
            config,
            adversarial_case(&shapes),
            robustness::adversarial,
        ),
        Property::MalformedInput => run(
            engine,
            property,
            config,
            robustness::malformed_case(),
            robustness::malformed_input,
        ),
        Property::PerHeadMasks => run(
            engine,
            property,
            config,
            per_head::mask4_case(&batch_shapes(&shapes)),
            per_head::per_head_masks,
        ),
        Property::BroadcastMaskIsShared => run(
            engine,
            property,
            config,
            per_head::shared_case(&batch_shapes(&shapes)),
            per_head::broadcast_is_shared,
        ),
        Property::SoftCapBoundsScores => run(
            engine,
            property,
            config,
            modifiers::softcap_case(&shapes),
            modifiers::softcap_bounds_scores,
        ),
        Property::ZeroSlopesAreNoAlibi => run(
            engine,
            property,
            config,
            modifiers::identity_case(&shapes),
            modifiers::zero_slopes,
        ),
        Property::NegInfSinksAreNoSinks => run(
            engine,
            property,
            config,
            modifiers::identity_case(&shapes),
            modifiers::neg_inf_sinks,
        ),
        Property::SinkTakesItsShare => run(
            engine,
            property,
            config,
            modifiers::sink_case(&shapes),
            modifiers::sink_share,
        ),
        Property::UserSoftCapIsTheBuiltin => run(
            engine,
            property,
            config,
            modifiers::user_cap_case(&shapes),
            modifiers::user_softcap,
        ),
        Property::UserCausalMaskIsTopLeft => run(
            engine,
            property,
            config,
            modifiers::user_causal_case(&shapes),
            modifiers::user_causal,
        ),
        _ => unreachable!("backward properties are dispatched by check_backward"),
    }
}

/// The backward properties: skipped (with a note) for an engine without the backward
/// pass they need.
fn check_backward(
    engine: &dyn Engine,
    property: Property,
    config: &SuiteConfig,
) -> Result<(), Failure> {
    let batched_only = matches!(
        property,
        Property::BatchedBackwardEquivalence
            | Property::GqaGradientsAreGroupSums
            | Property::PerHeadMaskGradients
    );
    let supported = if batched_only {
        backward::supports_backward_batched(engine)
    } else {
        backward::supports_backward(engine)
    };
    if !supported {
        eprintln!(
            "attn-oracle: engine `{}` has no {}backward pass; `{}` skipped",
            engine.name(),
            if batched_only { "batched " } else { "" },
            property.name()
        );
        return Ok(());
    }
    let shapes = backward::backward_shapes(engine);
    let batch_shapes = backward::backward_batch_shapes(&shapes);
    match property {
        Property::BackwardEquivalence => run(
            engine,
            property,
            config,
            backward::grad_case(&shapes),
            backward::equivalence,
        ),
        Property::BatchedBackwardEquivalence => run(
            engine,
            property,
            config,
            backward::batch_grad_case(&batch_shapes, 1..=3),
            backward::batched_equivalence,
        ),
        Property::ScoreGradientRowsSumToZero => run(
            engine,
            property,
            config,
            backward::grad_case(&shapes),
            backward::score_gradient_rows_sum_to_zero,
        ),
        Property::BackwardHiddenKeys => run(
            engine,
            property,
            config,
            backward::hidden_key_case(&shapes),
            backward::hidden_keys,
        ),
        Property::BackwardFullyMaskedRows => run(
            engine,
            property,
            config,
            backward::masked_rows_grad_case(&shapes),
            backward::fully_masked_rows,
        ),
        Property::GqaGradientsAreGroupSums => run(
            engine,
            property,
            config,
            backward::batch_grad_case(&batch_shapes, 2..=4),
            backward::gqa_sums,
        ),
        Property::GradOutScaling => run(
            engine,
            property,
            config,
            backward::grad_scaling_case(&shapes),
            backward::grad_out_scaling,
        ),
        Property::BackwardDeterminism => run(
            engine,
            property,
            config,
            dropout::with_dropout(
                backward::determinism_case(&shapes),
                0.5,
                dropout::set_backward,
            ),
            backward::determinism,
        ),
        Property::BiasGradientMatchesReference => run(
            engine,
            property,
            config,
            bias::bias_case(&batch_shapes),
            bias::bias_gradient,
        ),
        Property::DropoutGradientsMatchReference => run(
            engine,
            property,
            config,
            dropout::with_dropout(
                (
                    backward::grad_case(&shapes),
                    backward::batch_grad_case(&batch_shapes, 1..=3),
                )
                    .boxed(),
                1.0,
                dropout::set_backward,
            ),
            |engine, (head, batch)| {
                backward::equivalence(engine, head)?;
                backward::batched_equivalence(engine, batch)
            },
        ),
        Property::PerHeadMaskGradients => run(
            engine,
            property,
            config,
            per_head::mask4_grad_case(&batch_shapes),
            per_head::per_head_mask_gradients,
        ),
        _ => unreachable!("forward properties are dispatched by check_property"),
    }
}

/// The packed properties: skipped (with a note) for an engine without a packed mode.
fn check_packed(
    engine: &dyn Engine,
    property: Property,
    config: &SuiteConfig,
) -> Result<(), Failure> {
    let supported = if property == Property::PackedGradients {
        packed::supports_packed(engine) && packed::supports_packed_backward(engine)
    } else {
        packed::supports_packed(engine)
    };
    if !supported {
        eprintln!(
            "attn-oracle: engine `{}` has no packed {}; `{}` skipped",
            engine.name(),
            if property == Property::PackedGradients {
                "backward pass"
            } else {
                "mode"
            },
            property.name()
        );
        return Ok(());
    }
    // Sequences up to 65 tokens (the reference is O(n_q·n_k) per head), up to 5 of them.
    if property == Property::PackedGradients {
        run(
            engine,
            property,
            config,
            (
                packed::packed_grad_case(65),
                proptest::prelude::any::<u64>(),
            ),
            packed::packed_gradients,
        )
    } else {
        run(
            engine,
            property,
            config,
            packed::packed_case(129),
            packed::packed_sequences,
        )
    }
}

/// The paged properties: skipped (with a note) for an engine without paged calls, or,
/// for the cache property, without a paged cache.
fn check_paged(
    engine: &dyn Engine,
    property: Property,
    config: &SuiteConfig,
) -> Result<(), Failure> {
    let cache = property == Property::PagedCacheIsolation;
    let supported = if cache {
        paged::supports_paged_cache(engine)
    } else {
        paged::supports_paged(engine)
    };
    if !supported {
        eprintln!(
            "attn-oracle: engine `{}` has no {}; `{}` skipped",
            engine.name(),
            if cache { "paged cache" } else { "paged calls" },
            property.name()
        );
        return Ok(());
    }
    let tiles = engine.tile_lengths();
    match property {
        Property::PagedEquivalence => run(
            engine,
            property,
            config,
            paged::paged_case(&tiles),
            paged::paged_equivalence,
        ),
        Property::PagedIsPacked => run(
            engine,
            property,
            config,
            paged::paged_case(&tiles),
            paged::paged_is_packed,
        ),
        Property::PagedMalformed => run(
            engine,
            property,
            config,
            paged::malformed_case(&tiles),
            paged::malformed,
        ),
        _ => run(
            engine,
            property,
            config,
            paged::cache_case(),
            paged::cache_isolation,
        ),
    }
}

/// Checks every property against `engine`; returns the first failure.
///
/// ```
/// use attn_oracle::{check_engine, ReferenceEngine, SuiteConfig};
/// assert!(check_engine(&ReferenceEngine, &SuiteConfig::quick(1)).is_ok());
/// ```
pub fn check_engine(engine: &dyn Engine, config: &SuiteConfig) -> Result<(), Failure> {
    Property::ALL
        .iter()
        .try_for_each(|&p| check_property(engine, p, config))
}

/// Checks `property` and panics with the failure report: the body of each generated test.
pub fn assert_property(engine: &dyn Engine, property: Property, config: &SuiteConfig) {
    if let Err(f) = check_property(engine, property, config) {
        panic!("{f}");
    }
}

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
//!   rows, rows that see nothing, adversarial magnitudes, malformed calls).
//!
//! The properties of the backward pass ([`Engine::attention_backward`] and
//! [`Engine::attention_backward_batched`], issue 14) will go in a `backward` module beside
//! them, dispatched from here like the others and skipped for engines whose backward
//! methods return `None`, as the merge properties are without `attention_split`.

mod common;
mod forward;
mod robustness;

pub use common::compare_head;
pub use robustness::{Defect, RowHider};

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
            robustness::masked_rows_case(&shapes),
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
            forward::determinism_case(&shapes),
            forward::determinism,
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

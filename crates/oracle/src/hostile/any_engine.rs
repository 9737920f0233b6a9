//! Any engine: the hostile suite through the `Engine` trait.

use super::*;
use crate::Call;
use crate::engine::required;

/// Runs the hostile properties that the [`Engine`] trait reaches — one head with LSE and
/// one batched call, for `profile` — against `engine`; returns the first failure, shrunk.
/// An engine's own suite drives its other entry points with the same generators and checks
/// (attn-optimized: `tests/robustness.rs`).
///
/// Inputs are rounded to the engine's [`Engine::storage`] (the recipe's own storage type
/// is ignored) and passed as f32 views with the recipe's strides.
///
/// ```
/// use attn_oracle::ReferenceEngine;
/// use attn_oracle::hostile::{check_engine_hostile, Hiding, HostileConfig, Profile};
/// for profile in [Profile::Poison(Hiding::NegInfBias), Profile::Windows, Profile::Scales] {
///     check_engine_hostile(&ReferenceEngine, profile, &HostileConfig::quick(8)).unwrap();
/// }
/// ```
pub fn check_engine_hostile(
    engine: &dyn Engine,
    profile: Profile,
    config: &HostileConfig,
) -> Result<(), String> {
    let model = engine.error_model();
    let storage = engine.storage();
    let name = format!("{}-{}", engine.name(), profile_name(profile));
    run_property(
        &format!("{name}-head"),
        config,
        64,
        hostile_head(profile, &engine.tile_lengths()),
        |case| {
            let mut case = case.clone();
            case.dtype = storage;
            let inputs = case.build();
            let [q, k, v] = inputs.stored(|x| x);
            let (q, k, v) = (q.view(), k.view(), v.view());
            let opts = inputs.options();
            let want = expect_head(q, k, v, &opts, &model, Outputs::WITH_LSE, 0);
            if matches!(want, Expected::TooMuchWork) {
                return Ok(());
            }
            let got = returns("attention_with_lse", || {
                required(Call::head(q, k, v, &opts).forward_head(engine))
            })?;
            let got = got.as_ref().map(|(o, l)| (o.as_ref(), Some(l.as_slice())));
            check_head(&want, got.map_err(Clone::clone))
        },
    )?;
    run_property(
        &format!("{name}-batched"),
        config,
        32,
        hostile_batch(profile, &engine.tile_lengths()),
        |case| {
            let mut case = case.clone();
            case.head.dtype = storage;
            let inputs = case.build();
            let (q, k, v) = (inputs.q.view(), inputs.k.view(), inputs.v.view());
            let opts = inputs.options();
            let want = expect_batched(q.dims(), k.dims(), v.dims(), &opts, Outputs::OUTPUT);
            if matches!(want, BatchExpected::TooMuchWork) {
                return Ok(());
            }
            let got = returns("attention_batched", || {
                required(Call::batched(q, k, v, &opts).forward_batch(engine)).map(|(t, _)| t)
            })?;
            let got = got.as_ref().map(|t| (t.as_ref(), None));
            check_batched(&want, [q, k, v], &opts, &model, got.map_err(Clone::clone))
        },
    )
}

/// A short name of a profile, for property and file names.
pub fn profile_name(profile: Profile) -> String {
    match profile {
        Profile::Moderate => "moderate".into(),
        Profile::Poison(h) => format!(
            "poison-{}",
            match h {
                Hiding::Structural => "structural",
                Hiding::NegInfBias => "neg-inf-bias",
                Hiding::BoolMask => "bool-mask",
            }
        ),
        Profile::ExtremeBias => "extreme-bias".into(),
        Profile::ExtremeQk => "extreme-qk".into(),
        Profile::ExtremeV => "extreme-v".into(),
        Profile::Windows => "windows".into(),
        Profile::Scales => "scales".into(),
        Profile::Anything => "anything".into(),
    }
}

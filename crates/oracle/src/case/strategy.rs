//! The strategies that draw case recipes: lengths around the engine's tile edges, widths,
//! masks, modifiers, dropout, value distributions, head and batch cases.

use proptest::prelude::*;
use proptest::sample::select;

use super::*;

/// Lengths worth testing for an engine whose behaviour changes at `tiles`: `t − 1`, `t`,
/// `t + 1` for each, capped at `cap`, plus a few primes.
pub fn edge_lengths(tiles: &[usize], cap: usize) -> Vec<usize> {
    let mut v: Vec<usize> = tiles
        .iter()
        .flat_map(|&t| [t.saturating_sub(1), t, t + 1])
        .chain([13, 31, 97])
        .filter(|&n| n > 0 && n <= cap)
        .collect();
    v.sort_unstable();
    v.dedup();
    v
}

/// A sequence length: half the time small (`0..=9`), half the time at a tile edge: a
/// tile `t` (or a prime) picked uniformly, then `t − 1`, `t` or `t + 1`, so that the
/// largest tiles (where rescaling and split-KV happen) are as likely as the smallest.
pub fn length(tiles: &[usize], cap: usize) -> BoxedStrategy<usize> {
    weighted_length(tiles, cap, 1, 1)
}

/// [`length`] with the odds of a small length and of a tile edge given: `small` to `edge`.
pub(crate) fn weighted_length(
    tiles: &[usize],
    cap: usize,
    small: u32,
    edge: u32,
) -> BoxedStrategy<usize> {
    let mut groups: Vec<Vec<usize>> = tiles
        .iter()
        .chain(&[13, 31, 97])
        .map(|&t| {
            [t.saturating_sub(1), t, t + 1]
                .into_iter()
                .filter(|&n| n > 0 && n <= cap)
                .collect::<Vec<_>>()
        })
        .filter(|g| !g.is_empty())
        .collect();
    groups.sort_unstable();
    groups.dedup();
    let small_lengths = 0..=9usize.min(cap);
    if groups.is_empty() {
        small_lengths.boxed()
    } else {
        prop_oneof![
            small => small_lengths,
            edge => select(groups).prop_flat_map(select),
        ]
        .boxed()
    }
}

/// A feature width (`d_k` or `d_v`): small, or around the widths kernels specialise on.
pub fn width() -> BoxedStrategy<usize> {
    prop_oneof![
        3 => 1..=8usize,
        1 => select(vec![16usize, 31, 32, 33, 63, 64, 65, 80, 127, 128]),
    ]
    .boxed()
}

fn window_side() -> impl Strategy<Value = Option<usize>> {
    proptest::option::weighted(0.8, prop_oneof![2 => 0..=4usize, 1 => 0..=600usize])
}

fn causal() -> impl Strategy<Value = Causal> {
    prop_oneof![Just(Causal::TopLeft), Just(Causal::BottomRight)]
}

fn bool_recipe() -> impl Strategy<Value = BoolRecipe> {
    (
        any::<bool>(),
        0u8..=100,
        prop_oneof![3 => Just(0u8), 1 => 0u8..=50],
    )
        .prop_map(|(allow, visible_percent, hidden_rows_percent)| BoolRecipe {
            allow,
            visible_percent,
            hidden_rows_percent,
        })
}

fn additive_recipe(biases: Vec<Bias>) -> impl Strategy<Value = AdditiveRecipe> {
    (
        select(biases),
        prop_oneof![2 => Just(0u8), 1 => 0u8..=60],
        prop_oneof![3 => Just(0u8), 1 => 0u8..=50],
    )
        .prop_map(
            |(bias, neg_inf_percent, hidden_rows_percent)| AdditiveRecipe {
                bias,
                neg_inf_percent,
                hidden_rows_percent,
            },
        )
}

fn softcap() -> impl Strategy<Value = f32> {
    prop_oneof![
        select(vec![0.5f32, 1.0, 5.0, 20.0, 50.0]),
        (0.5f32..=50.0).prop_map(|c| c.max(0.5)),
    ]
}

fn alibi_recipe() -> impl Strategy<Value = AlibiRecipe> {
    (
        prop_oneof![
            2 => Just(Slopes::Geometric),
            2 => Just(Slopes::Random),
            1 => Just(Slopes::Zero),
        ],
        any::<bool>(),
        causal(),
    )
        .prop_map(|(slopes, per_batch, align)| AlibiRecipe {
            slopes,
            per_batch,
            align,
        })
}

fn sinks() -> impl Strategy<Value = Sinks> {
    prop_oneof![
        3 => Just(Sinks::Small),
        2 => Just(Sinks::Wide),
        2 => Just(Sinks::SomeNone),
        1 => Just(Sinks::None),
    ]
}

/// The score modifiers, each with a modest probability (a user score or mask modifier from
/// the fixed set of [`crate::user_mods`] more rarely).
pub fn modifiers() -> BoxedStrategy<ModRecipe> {
    use proptest::option::weighted;
    (
        weighted(0.15, softcap()),
        weighted(0.15, alibi_recipe()),
        weighted(0.15, sinks()),
        weighted(
            0.08,
            select(vec![
                UserScore::Capped,
                UserScore::Relative,
                UserScore::Halved,
            ]),
        ),
        weighted(
            0.08,
            select(vec![UserMask::TopLeft, UserMask::Band, UserMask::Stripes]),
        ),
    )
        .prop_map(|(softcap, alibi, sinks, score_mod, mask_mod)| ModRecipe {
            softcap,
            alibi,
            sinks,
            score_mod,
            mask_mod,
            dropout: None,
        })
        .boxed()
}

/// Attention dropout: the probabilities training uses, the edges (almost nothing, almost
/// everything, everything) and any in between; any seed.
pub fn dropout_recipe() -> BoxedStrategy<DropoutRecipe> {
    (
        prop_oneof![
            3 => select(vec![0.1f32, 0.2, 0.5]),
            1 => select(vec![0.001f32, 0.9, 0.999, 1.0]),
            2 => 0.0f32..1.0,
        ],
        any::<u64>(),
    )
        .prop_map(|(p, seed)| DropoutRecipe { p, seed })
        .boxed()
}

/// The modifiers that do not see positions (the soft-cap and sinks).
pub fn position_free_modifiers() -> BoxedStrategy<ModRecipe> {
    modifiers()
        .prop_map(|m| ModRecipe {
            softcap: m.softcap,
            sinks: m.sinks,
            ..ModRecipe::NONE
        })
        .boxed()
}

/// Every mask kind and their combinations, and the score modifiers; `scales` are the
/// explicit scales offered.
pub fn masks(scales: Vec<f32>, biases: Vec<Bias>) -> BoxedStrategy<MaskRecipe> {
    use proptest::option::weighted;
    (
        weighted(0.3, select(scales)),
        weighted(0.4, causal()),
        weighted(
            0.25,
            (window_side(), window_side(), causal())
                .prop_map(|(l, r, a)| SlidingWindow::new(l, r, a)),
        ),
        weighted(0.25, 0u16..=1000),
        weighted(0.25, bool_recipe()),
        weighted(0.4, additive_recipe(biases)),
        modifiers(),
    )
        .prop_map(
            |(scale, causal, window, key_len_permille, bool_mask, additive, modifiers)| {
                MaskRecipe {
                    scale,
                    causal,
                    window,
                    key_len_permille,
                    bool_mask,
                    additive,
                    modifiers,
                }
            },
        )
        .boxed()
}

/// Masks without any structural (position-dependent) constraint, and the modifiers that
/// do not see positions.
pub fn elementwise_masks() -> BoxedStrategy<MaskRecipe> {
    (
        proptest::option::weighted(0.3, bool_recipe()),
        proptest::option::weighted(
            0.5,
            additive_recipe(vec![Bias::Small, Bias::Zero, Bias::Ramp]),
        ),
        position_free_modifiers(),
    )
        .prop_map(|(bool_mask, additive, modifiers)| MaskRecipe {
            bool_mask,
            additive,
            modifiers,
            ..MaskRecipe::NONE
        })
        .boxed()
}

/// Value distributions of ordinary cases.
pub fn ordinary_values() -> BoxedStrategy<Values> {
    select(vec![Values::Unit, Values::Gaussian, Values::Ties]).boxed()
}

/// Value distributions of adversarial cases.
pub fn adversarial_values() -> BoxedStrategy<Values> {
    select(vec![
        Values::Large,
        Values::Subnormal,
        Values::Edge,
        Values::Ties,
        Values::Mixed,
        Values::Unit,
    ])
    .boxed()
}

/// Key patterns, independent most of the time.
pub fn key_pattern() -> BoxedStrategy<KeyPattern> {
    prop_oneof![
        4 => Just(KeyPattern::Independent),
        1 => Just(KeyPattern::Pairs),
        1 => Just(KeyPattern::AllIdentical),
    ]
    .boxed()
}

/// Shape bounds of generated cases.
#[derive(Debug, Clone)]
pub struct Shapes {
    /// Lengths at which the engine changes behaviour.
    pub tiles: Vec<usize>,
    /// Largest query count.
    pub max_q: usize,
    /// Largest key count.
    pub max_k: usize,
}

/// A single-head case with ordinary values and every mask kind.
pub fn head_case(shapes: &Shapes) -> BoxedStrategy<HeadCase> {
    head_case_with(
        shapes,
        ordinary_values(),
        ordinary_values(),
        masks(
            vec![0.05, 0.5, 1.0, 2.0],
            vec![Bias::Small, Bias::Zero, Bias::Ramp, Bias::Ramp],
        ),
    )
}

/// A single-head case from the given parts.
pub fn head_case_with(
    shapes: &Shapes,
    qk: BoxedStrategy<Values>,
    v: BoxedStrategy<Values>,
    masks: BoxedStrategy<MaskRecipe>,
) -> BoxedStrategy<HeadCase> {
    (
        length(&shapes.tiles, shapes.max_q),
        length(&shapes.tiles, shapes.max_k),
        width(),
        width(),
        qk,
        v,
        key_pattern(),
        masks,
        any::<u64>(),
    )
        .prop_map(|(n_q, n_k, d_k, d_v, qk, v, keys, masks, seed)| HeadCase {
            n_q,
            n_k,
            d_k,
            d_v,
            qk,
            v,
            keys,
            masks,
            seed,
        })
        .boxed()
}

/// An adversarial single-head case: large logits, scale × 1000, subnormals, ties,
/// identical keys, `-inf` and `±1e4` additive entries, values at the edge of the range.
pub fn adversarial_case(shapes: &Shapes) -> BoxedStrategy<HeadCase> {
    let scales = vec![1000.0f32, 0.001, 1.0, 30.0];
    let biases = vec![Bias::Large, Bias::Zero, Bias::Small, Bias::Ramp];
    head_case_with(
        shapes,
        adversarial_values(),
        adversarial_values(),
        masks(scales, biases),
    )
    .prop_map(|mut c| {
        // "scale × 1000" means relative to 1/√d_k.
        if let Some(s) = c.masks.scale.as_mut() {
            *s /= (c.d_k as f32).sqrt();
        }
        c
    })
    .boxed()
}

fn layout() -> impl Strategy<Value = TensorLayout> {
    prop_oneof![
        Just(TensorLayout::Bhsd),
        Just(TensorLayout::Bshd),
        Just(TensorLayout::Padded),
    ]
}

/// A batched, grouped-query case in mixed layouts with per-batch padding.
pub fn batch_case(shapes: &Shapes) -> BoxedStrategy<BatchCase> {
    (
        1..=3usize,
        1..=2usize,
        1..=3usize,
        head_case(shapes),
        [layout(), layout(), layout()],
        proptest::option::weighted(0.4, proptest::collection::vec(0u16..=1000, 3)),
    )
        .prop_map(|(batch, h_kv, group, head, layouts, lens)| BatchCase {
            batch,
            h_kv,
            group,
            head,
            layouts,
            key_lens_permille: lens.map(|mut l| {
                l.truncate(batch);
                l
            }),
        })
        .boxed()
}

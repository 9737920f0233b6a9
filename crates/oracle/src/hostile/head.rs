//! One head's hostile problem as a shrinkable recipe, and its generator.

use super::*;

/// How a key is hidden from a query row.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Hiding {
    /// By causal, window or key padding (key padding is added if nothing hides the key).
    Structural,
    /// By an additive `-inf`.
    NegInfBias,
    /// By a boolean mask (`allow` or `block`).
    BoolMask,
}

/// What a [`Plant`] poisons.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Target {
    /// The K row of the hidden key (all of it, or one entry).
    K,
    /// Its V row.
    V,
    /// Both.
    KAndV,
    /// The bias of the hidden position (for [`Hiding::NegInfBias`] the bias is the hider,
    /// so the K row is poisoned instead).
    Bias,
    /// The query row, after hiding every key from it: a row that sees nothing is 0 with
    /// LSE `-inf` whatever its query.
    QOfEmptyRow,
}

/// A poison planted at a position hidden from one query row.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Plant {
    /// How the position is hidden.
    pub hiding: Hiding,
    /// What is poisoned.
    pub target: Target,
    /// With what.
    pub value: Special,
    /// Picks the query row and the key.
    pub pick: u32,
    /// Poison the whole row of K/V (else one entry).
    pub whole_row: bool,
}

/// One head's hostile problem as a shrinkable recipe.
#[derive(Debug, Clone, PartialEq)]
pub struct HostileHead {
    /// Queries.
    pub n_q: usize,
    /// Keys.
    pub n_k: usize,
    /// Key width.
    pub d_k: usize,
    /// Value width.
    pub d_v: usize,
    /// Distribution of Q and K.
    pub qk: Fill,
    /// Distribution of V.
    pub v: Fill,
    /// Every K row (and every V row) equal, so that K and V can be broadcast views.
    pub identical_keys: bool,
    /// Explicit scale.
    pub scale: Option<f32>,
    /// Causal constraint.
    pub causal: Option<Causal>,
    /// Sliding window.
    pub window: Option<SlidingWindow>,
    /// Key padding.
    pub key_len: Option<KeyLen>,
    /// Boolean mask.
    pub bool_mask: Option<BoolRecipe>,
    /// Additive mask.
    pub additive: Option<BiasRecipe>,
    /// Poisons at hidden positions.
    pub plants: Vec<Plant>,
    /// Views of Q, K, V.
    pub views: [View; 3],
    /// Storage type.
    pub dtype: Dtype,
    /// Seed of every value.
    pub seed: u64,
}

/// The inputs of a [`HostileHead`], built: logical f32 operands already rounded to the
/// storage type, the masks, and the options' parts.
#[derive(Debug, Clone, PartialEq)]
pub struct HostileInputs {
    /// `[n_q, d_k]`.
    pub q: Mat<f32>,
    /// `[n_k, d_k]`.
    pub k: Mat<f32>,
    /// `[n_k, d_v]`.
    pub v: Mat<f32>,
    /// Explicit scale.
    pub scale: Option<f32>,
    /// Causal constraint.
    pub causal: Option<Causal>,
    /// Sliding window.
    pub window: Option<SlidingWindow>,
    /// Key padding length.
    pub key_len: Option<usize>,
    /// Boolean mask: polarity (`true` = allow) and bits.
    pub bool_mask: Option<(bool, Mat<bool>)>,
    /// Additive mask.
    pub additive: Option<Mat<f32>>,
    /// Views of Q, K, V.
    pub views: [View; 3],
    /// Storage type.
    pub dtype: Dtype,
    /// Where the plants put their poisons: the keys whose K or V row was poisoned, and the
    /// biases.
    pub planted: Planted,
}

/// Where a case's plants put their poisons.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Planted {
    /// Keys whose K or V row holds a poison.
    pub keys: Vec<usize>,
    /// Bias positions `(i, j)` that hold a poison.
    pub biases: Vec<(usize, usize)>,
    /// Query rows that hold a poison (rows hidden from every key, where the poison must
    /// not matter; a batched call's own key lengths may make them see keys again).
    pub queries: Vec<usize>,
}

/// The options of these parts (each `None` left at its default), a boolean mask given as
/// `(allow, mask)`.
pub fn options_of<'a>(
    scale: Option<f32>,
    causal: Option<Causal>,
    window: Option<SlidingWindow>,
    key_padding: Option<KeyPadding<'a>>,
    bool_mask: Option<&'a (bool, Mat<bool>)>,
    additive: Option<&'a Mat<f32>>,
) -> Options<'a> {
    let mut o = Options::default();
    if let Some(s) = scale {
        o = o.with_scale(s);
    }
    if let Some(c) = causal {
        o = o.with_causal(c);
    }
    if let Some(w) = window {
        o = o.with_window(w);
    }
    match key_padding {
        Some(KeyPadding::Uniform(l)) => o = o.with_key_length(l),
        Some(KeyPadding::PerBatch(ls)) => o = o.with_key_lengths(ls),
        None => {}
    }
    if let Some((allow, m)) = bool_mask {
        o = o.with_bool_mask(if *allow {
            BoolMask::allow(m.as_ref())
        } else {
            BoolMask::block(m.as_ref())
        });
    }
    if let Some(m) = additive {
        o = o.with_additive_mask(m.as_ref());
    }
    o
}

impl HostileInputs {
    /// The options of the call, borrowing the masks.
    pub fn options(&self) -> Options<'_> {
        options_of(
            self.scale,
            self.causal,
            self.window,
            self.key_len.map(KeyPadding::Uniform),
            self.bool_mask.as_ref(),
            self.additive.as_ref(),
        )
    }

    /// `[n_q, n_k, d_k, d_v]`.
    pub fn dims(&self) -> [usize; 4] {
        [
            self.q.nrows(),
            self.k.nrows(),
            self.q.ncols(),
            self.v.ncols(),
        ]
    }

    /// Q, K and V stored in `T` through their views.
    pub fn stored<T: Copy>(&self, convert: impl Fn(f32) -> T + Copy) -> [StoredMat<T>; 3] {
        [
            StoredMat::new(self.q.as_ref(), self.views[0], convert),
            StoredMat::new(self.k.as_ref(), self.views[1], convert),
            StoredMat::new(self.v.as_ref(), self.views[2], convert),
        ]
    }

    fn struct_visible(&self, i: usize, j: usize) -> bool {
        let [n_q, n_k, ..] = self.dims();
        structurally_visible(self.causal, self.window, self.key_len, n_q, n_k, i, j)
    }

    fn hide(&mut self, hiding: Hiding, i: usize, j: usize) -> bool {
        let [n_q, n_k, ..] = self.dims();
        match hiding {
            Hiding::Structural => !self.struct_visible(i, j),
            Hiding::NegInfBias => {
                let m = self.additive.get_or_insert_with(|| Mat::zeros(n_q, n_k));
                m[(i, j)] = f32::NEG_INFINITY;
                true
            }
            Hiding::BoolMask => {
                let (allow, m) = self.bool_mask.get_or_insert_with(|| {
                    (
                        j.is_multiple_of(2),
                        Mat::from_fn(n_q, n_k, |_, _| j.is_multiple_of(2)),
                    )
                });
                m[(i, j)] = !*allow;
                true
            }
        }
    }

    fn plant(&mut self, p: &Plant) {
        let [n_q, n_k, d_k, d_v] = self.dims();
        if n_q == 0 || n_k == 0 || self.key_len.is_some_and(|l| l > n_k) {
            return;
        }
        let i = p.pick as usize % n_q;
        // The engine stores the poison in its storage type (f32::MAX is +inf in f16).
        let value = self.dtype.round(p.value.value());
        if p.target == Target::QOfEmptyRow {
            match p.hiding {
                Hiding::Structural => {
                    if (0..n_k).any(|j| self.struct_visible(i, j)) {
                        if self.key_len.is_some() {
                            return;
                        }
                        self.key_len = Some(0);
                    }
                }
                _ => {
                    for j in 0..n_k {
                        self.hide(p.hiding, i, j);
                    }
                }
            }
            for t in 0..d_k {
                self.q[(i, t)] = value;
            }
            self.planted.queries.push(i);
            return;
        }
        let start = (p.pick as usize / n_q.max(1)) % n_k;
        let j = match p.hiding {
            Hiding::Structural => {
                match (0..n_k)
                    .map(|o| (start + o) % n_k)
                    .find(|&j| !self.struct_visible(i, j))
                {
                    Some(j) => j,
                    None if self.key_len.is_none() => {
                        self.key_len = Some(n_k - 1);
                        n_k - 1
                    }
                    None => return,
                }
            }
            h => {
                self.hide(h, i, start);
                start
            }
        };
        let poison = |m: &mut Mat<f32>, d: usize, whole: bool| {
            if d == 0 {
                return;
            }
            if whole {
                for t in 0..d {
                    m[(j, t)] = value;
                }
            } else {
                m[(j, p.pick as usize % d)] = value;
            }
        };
        match p.target {
            Target::Bias if p.hiding != Hiding::NegInfBias => self.planted.biases.push((i, j)),
            _ => self.planted.keys.push(j),
        }
        match p.target {
            Target::K => poison(&mut self.k, d_k, p.whole_row),
            Target::V => poison(&mut self.v, d_v, p.whole_row),
            Target::KAndV => {
                poison(&mut self.k, d_k, p.whole_row);
                poison(&mut self.v, d_v, p.whole_row);
            }
            Target::Bias if p.hiding != Hiding::NegInfBias => {
                let m = self.additive.get_or_insert_with(|| Mat::zeros(n_q, n_k));
                m[(i, j)] = p.value.value();
            }
            Target::Bias => poison(&mut self.k, d_k, p.whole_row),
            Target::QOfEmptyRow => unreachable!("handled above"),
        }
    }
}

pub(super) fn operand(
    rows: usize,
    cols: usize,
    fill: Fill,
    dtype: Dtype,
    rng: &mut Rng,
) -> Mat<f32> {
    let data: Vec<f32> = (0..rows * cols).map(|_| fill.sample(rng, dtype)).collect();
    Mat::from_fn(rows, cols, |i, j| data[i * cols + j])
}

pub(super) fn build_bool(b: &BoolRecipe, n_q: usize, n_k: usize, seed: u64) -> (bool, Mat<bool>) {
    let mut rng = Rng::new(seed, 11);
    let hidden: Vec<bool> = (0..n_q)
        .map(|_| rng.chance(b.hidden_rows_percent))
        .collect();
    let bits = Mat::from_fn(n_q, n_k, |i, _| {
        let visible = !hidden[i] && rng.chance(b.visible_percent);
        visible == b.allow
    });
    (b.allow, bits)
}

pub(super) fn build_bias(a: &BiasRecipe, n_q: usize, n_k: usize, seed: u64) -> Mat<f32> {
    let mut rng = Rng::new(seed, 12);
    let rows: Vec<(bool, bool)> = (0..n_q)
        .map(|_| (rng.chance(a.hidden_rows_percent), rng.chance(50)))
        .collect();
    Mat::from_fn(n_q, n_k, |i, _| {
        if rows[i].0 || rng.chance(a.neg_inf_percent) {
            f32::NEG_INFINITY
        } else {
            a.fill.sample(&mut rng, rows[i].1)
        }
    })
}

impl HostileHead {
    /// Builds the inputs (deterministic in the recipe).
    ///
    /// ```
    /// use attn_oracle::hostile::{hostile_head, Profile};
    /// use attn_oracle::{Engine, ReferenceEngine};
    /// use proptest::strategy::{Strategy, ValueTree};
    /// use proptest::test_runner::TestRunner;
    /// let tiles = ReferenceEngine.tile_lengths();
    /// let case = hostile_head(Profile::Anything, &tiles).new_tree(&mut TestRunner::deterministic()).unwrap().current();
    /// // Deterministic (compared through Debug: a NaN is not equal to itself).
    /// assert_eq!(format!("{:?}", case.build()), format!("{:?}", case.build()));
    /// ```
    pub fn build(&self) -> HostileInputs {
        let mut rng = Rng::new(self.seed, 1);
        let q = operand(self.n_q, self.d_k, self.qk, self.dtype, &mut rng);
        let mut k = operand(self.n_k, self.d_k, self.qk, self.dtype, &mut rng);
        let mut v = operand(self.n_k, self.d_v, self.v, self.dtype, &mut rng);
        if self.identical_keys && self.n_k > 0 {
            k = Mat::from_fn(self.n_k, self.d_k, |_, t| k[(0, t)]);
            v = Mat::from_fn(self.n_k, self.d_v, |_, t| v[(0, t)]);
        }
        let mut inputs = HostileInputs {
            q,
            k,
            v,
            scale: self.scale,
            causal: self.causal,
            window: self.window,
            key_len: self.key_len.map(|l| l.resolve(self.n_k)),
            bool_mask: self
                .bool_mask
                .map(|b| build_bool(&b, self.n_q, self.n_k, self.seed)),
            additive: self
                .additive
                .map(|a| build_bias(&a, self.n_q, self.n_k, self.seed)),
            views: self.views,
            dtype: self.dtype,
            planted: Planted::default(),
        };
        for p in &self.plants {
            inputs.plant(p);
        }
        inputs
    }
}

/// What a generated case stresses. Each profile is its own property in a suite, so that
/// one class of failure cannot hide another behind proptest's shrinking.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Profile {
    /// Moderate finite values, every mask kind, every view and storage type: the reference
    /// comparison at its tightest.
    Moderate,
    /// Moderate values with NaN, `±inf` and overflowing values planted at positions
    /// hidden in this way.
    Poison(Hiding),
    /// Biases at the finite extremes (`f32::MIN` padding, `±f32::MAX`, `±1e38`).
    ExtremeBias,
    /// Q and K at the finite extremes of the storage type (scores that overflow).
    ExtremeQk,
    /// V at the finite extremes of the storage type.
    ExtremeV,
    /// Window bounds up to `usize::MAX`, key lengths beyond `n_k`, both alignments.
    Windows,
    /// Scales at the extremes, valid and invalid.
    Scales,
    /// Everything at once, non-finite values anywhere: the call returns and keeps the
    /// contract where it promises anything.
    Anything,
}

/// A sequence length at most `max`: small, or at an edge of the engine's `tiles`
/// ([`crate::length`]'s edges, small lengths a little likelier).
pub(super) fn length(tiles: &[usize], max: usize) -> BoxedStrategy<usize> {
    crate::case::weighted_length(tiles, max, 3, 2)
}

pub(super) fn width(zero: bool) -> BoxedStrategy<usize> {
    let lo = usize::from(!zero);
    prop_oneof![
        6 => lo..=8usize,
        1 => select(vec![16usize, 32, 33, 64, 65]),
    ]
    .boxed()
}

pub(super) fn views() -> BoxedStrategy<[View; 3]> {
    let v = || select(View::ALL.to_vec());
    [v(), v(), v()].boxed()
}

pub(super) fn dtypes() -> BoxedStrategy<Dtype> {
    prop_oneof![2 => Just(Dtype::F32), 1 => Just(Dtype::F16), 1 => Just(Dtype::Bf16)].boxed()
}

pub(super) fn bool_recipe() -> BoxedStrategy<BoolRecipe> {
    (
        any::<bool>(),
        0u8..=100,
        prop_oneof![3 => Just(0u8), 1 => 0u8..=60],
    )
        .prop_map(|(allow, visible_percent, hidden_rows_percent)| BoolRecipe {
            allow,
            visible_percent,
            hidden_rows_percent,
        })
        .boxed()
}

pub(super) fn bias_recipe(fills: Vec<BiasFill>) -> BoxedStrategy<BiasRecipe> {
    (
        select(fills),
        prop_oneof![2 => Just(0u8), 1 => 0u8..=70],
        prop_oneof![3 => Just(0u8), 1 => 0u8..=60],
    )
        .prop_map(|(fill, neg_inf_percent, hidden_rows_percent)| BiasRecipe {
            fill,
            neg_inf_percent,
            hidden_rows_percent,
        })
        .boxed()
}

pub(super) fn key_len(invalid: bool) -> BoxedStrategy<Option<KeyLen>> {
    let valid = (0u16..=1000).prop_map(KeyLen::Permille);
    if invalid {
        proptest::option::weighted(
            0.5,
            prop_oneof![
                3 => valid,
                1 => any::<u8>().prop_map(KeyLen::Beyond),
                1 => Just(KeyLen::Max),
            ],
        )
        .boxed()
    } else {
        proptest::option::weighted(0.25, valid).boxed()
    }
}

pub(super) fn plant(hidings: Vec<Hiding>, values: Vec<Special>) -> BoxedStrategy<Plant> {
    (
        select(hidings),
        select(vec![
            Target::K,
            Target::V,
            Target::KAndV,
            Target::Bias,
            Target::QOfEmptyRow,
        ]),
        select(values),
        any::<u32>(),
        any::<bool>(),
    )
        .prop_map(|(hiding, target, value, pick, whole_row)| Plant {
            hiding,
            target,
            value,
            pick,
            whole_row,
        })
        .boxed()
}

/// The generator of single-head hostile cases for `profile`, its lengths around an
/// engine's `tiles` ([`Engine::tile_lengths`]).
pub fn hostile_head(profile: Profile, tiles: &[usize]) -> BoxedStrategy<HostileHead> {
    let moderate = || select(Fill::MODERATE.to_vec()).boxed();
    let moderate_bias = vec![BiasFill::Small, BiasFill::Zero, BiasFill::Large];
    let moderate_scales = vec![0.05f32, 0.5, 1.0, 2.0];
    let (qk, v, biases, scales, windows_extreme, lens_invalid, plants, d_k_zero) = match profile {
        Profile::Moderate => (
            moderate(),
            moderate(),
            moderate_bias,
            moderate_scales,
            false,
            false,
            None,
            false,
        ),
        Profile::Poison(h) => (
            moderate(),
            moderate(),
            moderate_bias,
            moderate_scales,
            false,
            false,
            Some((vec![h], Special::POISONS.to_vec())),
            false,
        ),
        Profile::ExtremeBias => (
            moderate(),
            moderate(),
            vec![BiasFill::Min, BiasFill::MinRows, BiasFill::Extreme],
            moderate_scales,
            false,
            false,
            None,
            false,
        ),
        Profile::ExtremeQk => (
            Just(Fill::Extreme).boxed(),
            moderate(),
            moderate_bias,
            vec![1.0, 1e-30, 0.5],
            false,
            false,
            None,
            false,
        ),
        Profile::ExtremeV => (
            moderate(),
            Just(Fill::Extreme).boxed(),
            moderate_bias,
            moderate_scales,
            false,
            false,
            None,
            false,
        ),
        Profile::Windows => (
            moderate(),
            moderate(),
            moderate_bias,
            moderate_scales,
            true,
            true,
            None,
            false,
        ),
        Profile::Scales => (
            moderate(),
            moderate(),
            moderate_bias,
            extreme_scales(),
            false,
            false,
            None,
            false,
        ),
        Profile::Anything => (
            select(vec![
                Fill::Unit,
                Fill::Extreme,
                Fill::NonFinite,
                Fill::Subnormal,
                Fill::Large,
            ])
            .boxed(),
            select(vec![Fill::Unit, Fill::Extreme, Fill::NonFinite, Fill::Ties]).boxed(),
            vec![
                BiasFill::Small,
                BiasFill::Min,
                BiasFill::MinRows,
                BiasFill::Extreme,
                BiasFill::NonFinite,
            ],
            extreme_scales(),
            true,
            true,
            Some((
                vec![Hiding::Structural, Hiding::NegInfBias, Hiding::BoolMask],
                Special::POISONS.to_vec(),
            )),
            true,
        ),
    };
    let side = move || {
        if windows_extreme {
            extreme_window_side()
        } else {
            moderate_window_side()
        }
    };
    let window_weight = if windows_extreme { 0.8 } else { 0.25 };
    let plants = match plants {
        Some((h, vals)) => proptest::collection::vec(plant(h, vals), 1..=3).boxed(),
        None => Just(Vec::new()).boxed(),
    };
    let scale_weight = if matches!(profile, Profile::Scales | Profile::ExtremeQk) {
        0.9
    } else {
        0.3
    };
    (
        (
            length(tiles, 257),
            length(tiles, 1025),
            width(d_k_zero),
            width(true),
        ),
        (qk, v, prop_oneof![5 => Just(false), 1 => Just(true)]),
        (
            proptest::option::weighted(scale_weight, select(scales)),
            proptest::option::weighted(0.4, causal()),
            proptest::option::weighted(
                window_weight,
                (side(), side(), causal()).prop_map(|(l, r, a)| SlidingWindow::new(l, r, a)),
            ),
            key_len(lens_invalid),
        ),
        (
            proptest::option::weighted(0.3, bool_recipe()),
            proptest::option::weighted(0.45, bias_recipe(biases)),
            plants,
        ),
        (views(), dtypes(), any::<u64>()),
    )
        .prop_map(
            |(
                (n_q, n_k, d_k, d_v),
                (qk, v, identical_keys),
                (scale, causal, window, key_len),
                (bool_mask, additive, plants),
                (views, dtype, seed),
            )| {
                // Keep the reference and the engine fast: long keys only with short queries.
                let n_k = if n_q * n_k * (d_k + d_v) > 4_000_000 {
                    n_k.min(129)
                } else {
                    n_k
                };
                HostileHead {
                    n_q,
                    n_k,
                    d_k,
                    d_v,
                    qk,
                    v,
                    identical_keys,
                    scale,
                    causal,
                    window,
                    key_len,
                    bool_mask,
                    additive,
                    plants,
                    views,
                    dtype,
                    seed,
                }
            },
        )
        .boxed()
}

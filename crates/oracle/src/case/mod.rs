//! Test cases: small, shrinkable *recipes* (shapes, value distributions, mask choices,
//! seeds) and the inputs they build deterministically.
//!
//! A recipe holds no matrix: proptest shrinks its fields (lengths toward 0, choices toward
//! the first alternative), and the shrunk recipe printed in a failure report rebuilds the
//! exact failing inputs with [`HeadCase::build`] or [`BatchCase::build`].

use attn_core::{
    Alibi, BoolMask, Causal, Dropout, KeyPadding, Layout, Options, SlidingWindow, SoftCap,
    Tensor4Ref,
};
use faer::Mat;

use crate::Dtype;
use crate::bound::ScoreMods;
use crate::user_mods::{MaskModAt, ScoreModAt, UserMask, UserScore};

/// A small deterministic generator (SplitMix64): the same values on every machine, for
/// the values a case builds from its seed.
///
/// ```
/// use attn_oracle::Rng;
/// let (mut a, mut b) = (Rng::new(7, 1), Rng::new(7, 1));
/// assert_eq!(a.next_u64(), b.next_u64());
/// assert!((0.0..1.0).contains(&Rng::from_state(3).unit()));
/// ```
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    /// The generator of stream `stream` of `seed` (one seed, independent streams).
    pub fn new(seed: u64, stream: u64) -> Self {
        let mut r = Rng(seed ^ stream.wrapping_mul(0x9E37_79B9_7F4A_7C15));
        r.next_u64();
        r
    }

    /// The generator whose state is `state`, unmixed.
    pub fn from_state(state: u64) -> Self {
        Rng(state)
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `[0, 1)`.
    pub fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Uniform in `0..n` (`n > 0`).
    pub fn below(&mut self, n: u64) -> u64 {
        ((self.next_u64() as u128 * n as u128) >> 64) as u64
    }

    /// True with probability `percent` %.
    pub fn chance(&mut self, percent: u8) -> bool {
        self.below(100) < u64::from(percent)
    }

    /// Standard normal (Box–Muller).
    pub fn normal(&mut self) -> f64 {
        let u1 = 1.0 - self.unit(); // (0, 1]
        let u2 = self.unit();
        (-2.0 * u1.ln()).sqrt() * (2.0 * core::f64::consts::PI * u2).cos()
    }

    fn sign(&mut self) -> f32 {
        if self.next_u64() & 1 == 0 { 1.0 } else { -1.0 }
    }
}

/// How the entries of an operand are drawn.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Values {
    /// Uniform in `[-1, 1]`.
    Unit,
    /// Integers in `{-2, …, 2}`: exact products and many tied scores.
    Ties,
    /// Standard normal.
    Gaussian,
    /// Uniform in `[-35, 35]`: at `d_k = 64` and the default scale, logits reach `±1e4`.
    Large,
    /// Subnormals of the storage type, both signs, mixed with zeros and `±1`.
    Subnormal,
    /// `±` the storage type's edge magnitude ([`edge_magnitude`](crate::edge_magnitude)) mixed with `±1`.
    Edge,
    /// Each entry from one of the kinds above.
    Mixed,
}

impl Values {
    pub(crate) fn sample(self, rng: &mut Rng, dtype: Dtype) -> f32 {
        let x = match self {
            Values::Unit => (rng.unit() * 2.0 - 1.0) as f32,
            Values::Ties => rng.below(5) as f32 - 2.0,
            Values::Gaussian => rng.normal() as f32,
            Values::Large => ((rng.unit() * 2.0 - 1.0) * 35.0) as f32,
            Values::Subnormal => match rng.below(4) {
                0 => 0.0,
                1 => rng.sign(),
                _ => {
                    let s = rng.sign();
                    s * match dtype {
                        // f16 subnormals: k · 2^-24, k < 1024.
                        Dtype::F16 => (1 + rng.below(1023)) as f32 * 2f32.powi(-24),
                        // bf16 subnormals are f32 subnormals with 7 mantissa bits.
                        Dtype::Bf16 => f32::from_bits(((1 + rng.below(127)) as u32) << 16),
                        Dtype::F32 => f32::from_bits(1 + rng.below(0x7F_FFFE) as u32),
                    }
                }
            },
            Values::Edge => {
                let s = rng.sign();
                if rng.below(2) == 0 {
                    s * crate::edge_magnitude(dtype)
                } else {
                    s
                }
            }
            Values::Mixed => {
                let kind = [
                    Values::Unit,
                    Values::Ties,
                    Values::Gaussian,
                    Values::Large,
                    Values::Subnormal,
                ][rng.below(5) as usize];
                return kind.sample(rng, dtype);
            }
        };
        dtype.round(x)
    }
}

/// How the key rows relate to each other.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum KeyPattern {
    /// Every key row drawn independently.
    Independent,
    /// Every key row (and value row) equal to the first: one score repeated in each row.
    AllIdentical,
    /// Keys come in identical pairs `(2m, 2m + 1)`: exact ties between neighbours.
    Pairs,
}

/// The kind of values in an additive mask.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Bias {
    /// Zeros (with `-inf` entries, if any).
    Zero,
    /// Normal with standard deviation 2.
    Small,
    /// Uniform in `[-1e4, 1e4]`.
    Large,
    /// Multiples of `2⁻¹⁰` in `[-4, 4]`: a grid on which shifts by grid constants are exact.
    Grid,
    /// `0.75·j` plus a small normal term for key `j`: the row maximum grows by more than
    /// the usual lazy-rescale threshold within every 8 keys, so every key tile rescales.
    Ramp,
}

impl Bias {
    fn sample(self, rng: &mut Rng, j: usize) -> f32 {
        match self {
            Bias::Ramp => (0.75 * j as f64 + rng.normal() * 0.5) as f32,
            Bias::Zero => 0.0,
            Bias::Small => (rng.normal() * 2.0) as f32,
            Bias::Large => ((rng.unit() * 2.0 - 1.0) * 1e4) as f32,
            Bias::Grid => (rng.below(8193) as f32 - 4096.0) / 1024.0,
        }
    }
}

/// A boolean mask recipe.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct BoolRecipe {
    /// `true`: built with [`BoolMask::allow`]; `false`: with [`BoolMask::block`] (the
    /// stored bits are then inverted so that both polarities hide the same keys).
    pub allow: bool,
    /// Percentage of visible entries.
    pub visible_percent: u8,
    /// Percentage of rows hidden entirely.
    pub hidden_rows_percent: u8,
}

/// An additive mask recipe.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct AdditiveRecipe {
    /// The finite values.
    pub bias: Bias,
    /// Percentage of `-inf` entries.
    pub neg_inf_percent: u8,
    /// Percentage of rows that are `-inf` everywhere.
    pub hidden_rows_percent: u8,
}

/// How the ALiBi slopes of a case are drawn.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Slopes {
    /// ALiBi's geometric slopes `2^(−8(h+1)/H)` (times `1 + b/2` per batch entry).
    Geometric,
    /// Uniform in `[−0.25, 1]`, about a quarter of them exactly 0.
    Random,
    /// Every slope 0: exactly no ALiBi.
    Zero,
}

/// An ALiBi recipe.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AlibiRecipe {
    /// The slopes.
    pub slopes: Slopes,
    /// One slope per (batch entry, query head) instead of per query head.
    pub per_batch: bool,
    /// The alignment of query and key positions.
    pub align: Causal,
}

/// How the sink logits of a case are drawn (one per query head).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Sinks {
    /// Normal with standard deviation 2.
    Small,
    /// Uniform in `[−12, 12]`: from negligible to most of the row's weight.
    Wide,
    /// Half of them `-inf` (no sink), the others small.
    SomeNone,
    /// Every one `-inf`: exactly no sink.
    None,
}

/// The score modifiers of a call.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ModRecipe {
    /// Soft-cap `c`.
    pub softcap: Option<f32>,
    /// ALiBi slopes.
    pub alibi: Option<AlibiRecipe>,
    /// Sink logits.
    pub sinks: Option<Sinks>,
    /// A user score modifier.
    pub score_mod: Option<UserScore>,
    /// A user mask modifier.
    pub mask_mod: Option<UserMask>,
    /// Attention dropout (drawn by the dropout properties only: a mask keyed by positions
    /// does not commute with the invariances the other properties check).
    pub dropout: Option<DropoutRecipe>,
}

/// Attention dropout: the probability of dropping a weight and the generator's seed.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DropoutRecipe {
    /// The probability of dropping a weight.
    pub p: f32,
    /// The generator's seed.
    pub seed: u64,
}

impl DropoutRecipe {
    /// The contract's [`Dropout`].
    pub fn dropout(&self) -> Dropout {
        Dropout::new(self.p, self.seed).expect("generated probabilities are valid")
    }
}

impl ModRecipe {
    /// `options` with these modifiers, over the built `slopes` and `sinks`.
    pub(crate) fn apply<'a>(
        &self,
        options: Options<'a>,
        slopes: Option<&'a [f32]>,
        sinks: Option<&'a [f32]>,
    ) -> Options<'a> {
        Options {
            softcap: self
                .softcap
                .map(|c| SoftCap::new(c).expect("generated caps are valid")),
            alibi: slopes
                .zip(self.alibi)
                .map(|(s, a)| Alibi::new(s).with_align(a.align)),
            sinks,
            score_mod: self.score_mod.map(UserScore::modifier),
            mask_mod: self.mask_mod.map(UserMask::modifier),
            dropout: self.dropout.as_ref().map(DropoutRecipe::dropout),
            ..options
        }
    }

    /// No modifier.
    pub const NONE: ModRecipe = ModRecipe {
        softcap: None,
        alibi: None,
        sinks: None,
        score_mod: None,
        mask_mod: None,
        dropout: None,
    };

    /// Whether no modifier is set.
    pub fn is_none(&self) -> bool {
        *self == ModRecipe::NONE
    }
}

/// Whether the backward properties' cases draw score modifiers. Off until their bound,
/// `bound::head_backward_bound`, carries the modifiers' derivatives (both engines compute
/// the backward with modifiers; `crates/*/tests/modifiers_backward.rs` check it against
/// finite differences and a bound of its own); turning this on is the one switch that makes
/// every backward property run with them.
pub const BACKWARD_MODIFIERS: bool = false;

/// `case` as the backward properties take it: without modifiers unless
/// [`BACKWARD_MODIFIERS`].
pub fn for_backward(mut case: HeadCase) -> HeadCase {
    if !BACKWARD_MODIFIERS {
        case.masks.modifiers = ModRecipe::NONE;
    }
    case
}

/// Every option of a call except the operands.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MaskRecipe {
    /// An explicit scale (else `1/√d_k`).
    pub scale: Option<f32>,
    /// Causal constraint.
    pub causal: Option<Causal>,
    /// Sliding window.
    pub window: Option<SlidingWindow>,
    /// Key padding as a fraction of `n_k` in per-mille (uniform over the batch).
    pub key_len_permille: Option<u16>,
    /// Boolean mask.
    pub bool_mask: Option<BoolRecipe>,
    /// Additive mask.
    pub additive: Option<AdditiveRecipe>,
    /// Score modifiers (soft-cap, ALiBi, sinks, the user's score and mask modifiers).
    pub modifiers: ModRecipe,
}

impl MaskRecipe {
    /// No constraint at all, default scale.
    pub const NONE: MaskRecipe = MaskRecipe {
        scale: None,
        causal: None,
        window: None,
        key_len_permille: None,
        bool_mask: None,
        additive: None,
        modifiers: ModRecipe::NONE,
    };

    /// Whether every constraint is invariant under permuting the keys (only element-wise
    /// masks, which are permuted with them, and the soft-cap and sinks, which do not see
    /// positions).
    pub fn is_permutation_invariant(&self) -> bool {
        let m = &self.modifiers;
        self.causal.is_none()
            && self.window.is_none()
            && self.key_len_permille.is_none()
            && m.alibi.is_none()
            && m.score_mod.is_none()
            && m.mask_mod.is_none()
    }
}

fn permille(n: usize, p: u16) -> usize {
    (n * usize::from(p.min(1000))) / 1000
}

/// The element-wise masks and per-head modifier parameters of a case, built.
#[derive(Debug, Clone, PartialEq)]
pub struct BuiltMasks {
    /// Boolean mask bits and polarity (`true` = allow).
    pub bool_mask: Option<(bool, Mat<bool>)>,
    /// Additive mask.
    pub additive: Option<Mat<f32>>,
    /// ALiBi slopes (`[h_q]` or `[batch·h_q]`).
    pub slopes: Option<Vec<f32>>,
    /// Sink logits (`[h_q]`).
    pub sinks: Option<Vec<f32>>,
}

impl BuiltMasks {
    /// The options of a call: the recipe's scale, causal flag and window, `key_padding`,
    /// these masks and the modifiers, borrowed.
    fn options<'a>(&'a self, r: &MaskRecipe, key_padding: Option<KeyPadding<'a>>) -> Options<'a> {
        let masks = Options {
            scale: r.scale,
            causal: r.causal,
            window: r.window,
            key_padding,
            bool_mask: self.bool_mask.as_ref().map(|(allow, m)| {
                if *allow {
                    BoolMask::allow(m.as_ref())
                } else {
                    BoolMask::block(m.as_ref())
                }
            }),
            additive_mask: self.additive.as_ref().map(|m| m.as_ref()),
            ..Options::default()
        };
        r.modifiers
            .apply(masks, self.slopes.as_deref(), self.sinks.as_deref())
    }
}

impl ModRecipe {
    /// The slopes and sinks of `batch` entries of `h_q` query heads.
    pub(crate) fn build(
        &self,
        batch: usize,
        h_q: usize,
        seed: u64,
    ) -> (Option<Vec<f32>>, Option<Vec<f32>>) {
        let mut rng = Rng::new(seed, 13);
        let slopes = self.alibi.map(|a| {
            let n = if a.per_batch { batch * h_q } else { h_q };
            (0..n)
                .map(|t| {
                    let (b, h) = (t / h_q, t % h_q);
                    match a.slopes {
                        Slopes::Zero => 0.0,
                        Slopes::Geometric => {
                            let g = 2f64.powf(-8.0 * (h + 1) as f64 / h_q as f64);
                            (g * (1.0 + 0.5 * b as f64)) as f32
                        }
                        Slopes::Random if rng.chance(25) => 0.0,
                        Slopes::Random => (rng.unit() * 1.25 - 0.25) as f32,
                    }
                })
                .collect()
        });
        let sinks = self.sinks.map(|k| {
            (0..h_q)
                .map(|_| match k {
                    Sinks::None => f32::NEG_INFINITY,
                    Sinks::SomeNone if rng.chance(50) => f32::NEG_INFINITY,
                    Sinks::Small | Sinks::SomeNone => (rng.normal() * 2.0) as f32,
                    Sinks::Wide => (rng.unit() * 24.0 - 12.0) as f32,
                })
                .collect()
        });
        (slopes, sinks)
    }
}

/// What a single-head call needs to compute head `(b, h)` of a batched call: the head's
/// ALiBi slope and sink, and the user's modifiers asked about `(b, h)` (a single-head call
/// asks about `(0, 0)`).
#[derive(Debug, Clone, Copy)]
pub struct HeadSlot<'a> {
    alibi: Option<([f32; 1], Causal)>,
    sink: Option<[f32; 1]>,
    score_mod: Option<ScoreModAt<'a>>,
    mask_mod: Option<MaskModAt<'a>>,
}

impl<'a> HeadSlot<'a> {
    /// Head `(b, h)` of a batched call with `h_q` query heads and options `batched`.
    pub fn new(batched: &Options<'a>, b: usize, h: usize, h_q: usize) -> Self {
        HeadSlot {
            alibi: batched.alibi.map(|a| {
                let s = a.slopes();
                (
                    [if s.len() == h_q { s[h] } else { s[b * h_q + h] }],
                    a.align(),
                )
            }),
            sink: batched.sinks.map(|s| [s[h]]),
            score_mod: batched.score_mod.map(|m| ScoreModAt {
                inner: m,
                at: (Some(b), Some(h)),
            }),
            mask_mod: batched.mask_mod.map(|m| MaskModAt {
                inner: m,
                at: (Some(b), Some(h)),
            }),
        }
    }

    /// `single` (the head's single-head options) with the head's modifiers.
    pub fn apply<'s>(&'s self, single: Options<'s>) -> Options<'s> {
        Options {
            alibi: self
                .alibi
                .as_ref()
                .map(|(s, a)| Alibi::new(s).with_align(*a)),
            sinks: self.sink.as_ref().map(|s| &s[..]),
            score_mod: self.score_mod.as_ref().map(|m| m as _),
            mask_mod: self.mask_mod.as_ref().map(|m| m as _),
            ..single
        }
    }
}

impl MaskRecipe {
    fn build(&self, n_q: usize, n_k: usize, batch: usize, h_q: usize, seed: u64) -> BuiltMasks {
        let bool_mask = self.bool_mask.map(|b| {
            let mut rng = Rng::new(seed, 11);
            let hidden_rows: Vec<bool> = (0..n_q)
                .map(|_| rng.chance(b.hidden_rows_percent))
                .collect();
            let visible = Mat::from_fn(n_q, n_k, |i, _| {
                !hidden_rows[i] && rng.chance(b.visible_percent)
            });
            let bits = Mat::from_fn(n_q, n_k, |i, j| visible[(i, j)] == b.allow);
            (b.allow, bits)
        });
        let additive = self.additive.map(|a| {
            let mut rng = Rng::new(seed, 12);
            let hidden_rows: Vec<bool> = (0..n_q)
                .map(|_| rng.chance(a.hidden_rows_percent))
                .collect();
            Mat::from_fn(n_q, n_k, |i, j| {
                if hidden_rows[i] || rng.chance(a.neg_inf_percent) {
                    f32::NEG_INFINITY
                } else {
                    a.bias.sample(&mut rng, j)
                }
            })
        });
        let (slopes, sinks) = self.modifiers.build(batch, h_q, seed);
        BuiltMasks {
            bool_mask,
            additive,
            slopes,
            sinks,
        }
    }

    /// The error model of head `(b, h)`'s modifiers, given its options.
    fn score_mods(&self, o: &Options<'_>, [b, h, h_q, n_q, n_k]: [usize; 5]) -> ScoreMods {
        let user = self.modifiers.score_mod.map(|u| u.bound(b, h, n_q, n_k));
        ScoreMods::of(&o.head_modifiers(b, h, h_q, n_q, n_k), user)
    }
}

/// One head's problem as a recipe.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct HeadCase {
    /// Queries.
    pub n_q: usize,
    /// Keys.
    pub n_k: usize,
    /// Key width.
    pub d_k: usize,
    /// Value width.
    pub d_v: usize,
    /// Distribution of Q and K.
    pub qk: Values,
    /// Distribution of V.
    pub v: Values,
    /// Relations between key rows.
    pub keys: KeyPattern,
    /// Options and masks.
    pub masks: MaskRecipe,
    /// Seed of every value.
    pub seed: u64,
}

/// The inputs of one head, built from a [`HeadCase`].
#[derive(Debug, Clone, PartialEq)]
pub struct HeadInputs {
    /// `[n_q, d_k]`.
    pub q: Mat<f32>,
    /// `[n_k, d_k]`.
    pub k: Mat<f32>,
    /// `[n_k, d_v]`.
    pub v: Mat<f32>,
    /// The mask recipe (scale, causal, window).
    pub recipe: MaskRecipe,
    /// Valid key length.
    pub key_len: Option<usize>,
    /// Element-wise masks.
    pub masks: BuiltMasks,
}

impl HeadInputs {
    /// The options of the call, borrowing the masks.
    pub fn options(&self) -> Options<'_> {
        self.masks
            .options(&self.recipe, self.key_len.map(KeyPadding::Uniform))
    }

    /// What the bound needs of the head's score modifiers.
    pub fn score_mods(&self) -> ScoreMods {
        let [n_q, n_k, _, _] = self.dims();
        self.recipe.score_mods(&self.options(), [0, 0, 1, n_q, n_k])
    }

    /// `n_q, n_k, d_k, d_v`.
    pub fn dims(&self) -> [usize; 4] {
        [
            self.q.nrows(),
            self.k.nrows(),
            self.q.ncols(),
            self.v.ncols(),
        ]
    }
}

pub(crate) fn operand(
    rows: usize,
    cols: usize,
    values: Values,
    dtype: Dtype,
    rng: &mut Rng,
) -> Mat<f32> {
    // Row-major fill so that a recipe means the same matrix whatever faer's storage order.
    let data: Vec<f32> = (0..rows * cols)
        .map(|_| values.sample(rng, dtype))
        .collect();
    Mat::from_fn(rows, cols, |i, j| data[i * cols + j])
}

fn pattern_row(pattern: KeyPattern, j: usize) -> usize {
    match pattern {
        KeyPattern::Independent => j,
        KeyPattern::AllIdentical => 0,
        KeyPattern::Pairs => j & !1,
    }
}

impl HeadCase {
    /// Builds the inputs, every operand rounded to `dtype`.
    ///
    /// ```
    /// use attn_oracle::{Dtype, HeadCase};
    /// let inputs = HeadCase::small(3, 5, 4, 2, 7).build(Dtype::F32);
    /// assert_eq!(inputs.dims(), [3, 5, 4, 2]);
    /// assert_eq!(inputs, HeadCase::small(3, 5, 4, 2, 7).build(Dtype::F32)); // deterministic
    /// ```
    pub fn build(&self, dtype: Dtype) -> HeadInputs {
        let mut rng = Rng::new(self.seed, 1);
        let q = operand(self.n_q, self.d_k, self.qk, dtype, &mut rng);
        let k0 = operand(self.n_k, self.d_k, self.qk, dtype, &mut rng);
        let v0 = operand(self.n_k, self.d_v, self.v, dtype, &mut rng);
        let k = Mat::from_fn(self.n_k, self.d_k, |j, t| {
            k0[(pattern_row(self.keys, j), t)]
        });
        let v = Mat::from_fn(self.n_k, self.d_v, |j, t| {
            v0[(pattern_row(self.keys, j), t)]
        });
        HeadInputs {
            q,
            k,
            v,
            recipe: self.masks,
            key_len: self.masks.key_len_permille.map(|p| permille(self.n_k, p)),
            masks: self.masks.build(self.n_q, self.n_k, 1, 1, self.seed),
        }
    }

    /// A plain case: uniform values, independent keys, no mask.
    pub fn small(n_q: usize, n_k: usize, d_k: usize, d_v: usize, seed: u64) -> Self {
        HeadCase {
            n_q,
            n_k,
            d_k,
            d_v,
            qk: Values::Unit,
            v: Values::Unit,
            keys: KeyPattern::Independent,
            masks: MaskRecipe::NONE,
            seed,
        }
    }
}

/// The memory layout of one batched operand.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TensorLayout {
    /// Contiguous `[B,H,S,D]`.
    Bhsd,
    /// Contiguous `[B,S,H,D]`.
    Bshd,
    /// `[B,S,H,D]` with a gap of 3 elements after every row and 5 after every batch
    /// entry; the gaps hold NaN, so an engine that reads outside its view is caught.
    Padded,
}

/// A batched, grouped-query problem as a recipe.
#[derive(Debug, Clone, PartialEq)]
pub struct BatchCase {
    /// Batch entries.
    pub batch: usize,
    /// Key/value heads.
    pub h_kv: usize,
    /// Query heads per key/value head (`h_q = h_kv · group`).
    pub group: usize,
    /// The per-head shape and values; its `masks.key_len_permille` is ignored in favour
    /// of `key_lens_permille`.
    pub head: HeadCase,
    /// Layouts of Q, K, V.
    pub layouts: [TensorLayout; 3],
    /// Per-batch key padding (per-mille of `n_k`), one entry per batch entry.
    pub key_lens_permille: Option<Vec<u16>>,
}

/// One batched operand, owned: its buffer and how to view it.
#[derive(Debug, Clone, PartialEq)]
pub struct OwnedTensor {
    /// The buffer (gaps hold NaN).
    pub data: Vec<f32>,
    /// `[batch, heads, seq, dim]`.
    pub dims: [usize; 4],
    /// Element strides of batch, head, seq.
    pub strides: [usize; 3],
}

impl OwnedTensor {
    pub(crate) fn new(
        layout: TensorLayout,
        dims: [usize; 4],
        mut value: impl FnMut() -> f32,
    ) -> Self {
        let [b, h, s, d] = dims;
        let strides = match layout {
            TensorLayout::Bhsd => Layout::Bhsd.strides(dims),
            TensorLayout::Bshd => Layout::Bshd.strides(dims),
            TensorLayout::Padded => [s * h * (d + 3) + 5, d + 3, h * (d + 3)],
        };
        let len = if dims.contains(&0) {
            0
        } else {
            (b - 1) * strides[0] + (h - 1) * strides[1] + (s - 1) * strides[2] + d
        };
        let mut data = vec![f32::NAN; len];
        // Logical [b][h][s][d] order, whatever the layout.
        for bi in 0..b {
            for hi in 0..h {
                for si in 0..s {
                    for di in 0..d {
                        data[bi * strides[0] + hi * strides[1] + si * strides[2] + di] = value();
                    }
                }
            }
        }
        OwnedTensor {
            data,
            dims,
            strides,
        }
    }

    /// The view.
    pub fn view(&self) -> Tensor4Ref<'_, f32> {
        Tensor4Ref::new(&self.data, self.dims, self.strides).expect("built to fit")
    }
}

/// The inputs of a batched problem, built from a [`BatchCase`].
#[derive(Debug, Clone, PartialEq)]
pub struct BatchInputs {
    /// `[batch, h_q, n_q, d_k]`.
    pub q: OwnedTensor,
    /// `[batch, h_kv, n_k, d_k]`.
    pub k: OwnedTensor,
    /// `[batch, h_kv, n_k, d_v]`.
    pub v: OwnedTensor,
    /// The mask recipe (scale, causal, window).
    pub recipe: MaskRecipe,
    /// Per-batch valid key lengths.
    pub key_lens: Option<Vec<usize>>,
    /// Element-wise masks, shared by every batch entry and head.
    pub masks: BuiltMasks,
}

impl BatchInputs {
    /// The options of the call, borrowing the masks.
    pub fn options(&self) -> Options<'_> {
        self.masks.options(
            &self.recipe,
            self.key_lens.as_deref().map(KeyPadding::PerBatch),
        )
    }

    /// What the bound needs of head `(b, h)`'s score modifiers.
    pub fn score_mods(&self, b: usize, h: usize) -> ScoreMods {
        let [_, h_q, n_q, _] = self.q.dims;
        let n_k = self.k.dims[2];
        self.recipe
            .score_mods(&self.options(), [b, h, h_q, n_q, n_k])
    }
}

/// `case` as the backward properties take it (see [`for_backward`]).
pub fn batch_for_backward(mut case: BatchCase) -> BatchCase {
    case.head = for_backward(case.head);
    case
}

impl BatchCase {
    /// Builds the inputs, every operand rounded to `dtype`.
    ///
    /// ```
    /// use attn_oracle::{BatchCase, Dtype, HeadCase, TensorLayout};
    /// let case = BatchCase {
    ///     batch: 2, h_kv: 1, group: 3,
    ///     head: HeadCase::small(4, 5, 8, 2, 1),
    ///     layouts: [TensorLayout::Bshd, TensorLayout::Padded, TensorLayout::Bhsd],
    ///     key_lens_permille: Some(vec![1000, 0]),
    /// };
    /// let inputs = case.build(Dtype::F32);
    /// assert_eq!(inputs.q.view().dims(), [2, 3, 4, 8]);
    /// assert_eq!(inputs.key_lens, Some(vec![5, 0]));
    /// ```
    pub fn build(&self, dtype: Dtype) -> BatchInputs {
        let h = &self.head;
        let h_q = self.h_kv * self.group;
        let mut rng = Rng::new(h.seed, 2);
        let q = OwnedTensor::new(self.layouts[0], [self.batch, h_q, h.n_q, h.d_k], || {
            h.qk.sample(&mut rng, dtype)
        });
        let k = OwnedTensor::new(
            self.layouts[1],
            [self.batch, self.h_kv, h.n_k, h.d_k],
            || h.qk.sample(&mut rng, dtype),
        );
        let v = OwnedTensor::new(
            self.layouts[2],
            [self.batch, self.h_kv, h.n_k, h.d_v],
            || h.v.sample(&mut rng, dtype),
        );
        let key_lens = self.key_lens_permille.as_ref().map(|ps| {
            (0..self.batch)
                .map(|b| permille(h.n_k, ps.get(b).copied().unwrap_or(1000)))
                .collect()
        });
        BatchInputs {
            q,
            k,
            v,
            recipe: h.masks,
            key_lens,
            masks: h.masks.build(h.n_q, h.n_k, self.batch, h_q, h.seed),
        }
    }
}

mod strategy;
pub use strategy::*;

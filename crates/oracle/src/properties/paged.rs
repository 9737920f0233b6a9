//! The properties of paged attention: queries packed as for a packed batch, each sequence's
//! its newest positions, against keys and values read out of the pages of a pool through
//! a block table (a paged KV cache). The reference's paged call reads the same pages
//! literally and equals its packed call over the same tokens bit for bit; an engine's paged
//! call is within the derived bound of it, and bit for bit the engine's own packed call
//! where the engine says their schedules coincide; options a paged call cannot mean are
//! the reference's typed errors; and in a paged cache, forking and freeing sequences never
//! change another sequence's results. Cases draw a few sequences of random lengths (empty
//! ones, and now and then several 512-key blocks), decoding, chunks and whole prefills,
//! pages of 1 token, of odd sizes and larger than any sequence, scattered through a pool
//! whose unused pages and rows are NaN, grouped-query groups of 1 to 32 heads, and the
//! options of a paged call (bottom-right causal masks, windows, ALiBi, soft-caps, sinks,
//! scales).

use std::collections::{BTreeMap, BTreeSet};

use attn_core::{
    BoolMask, BoolMask4, Causal, CuSeqlens, Error, KeyChannels, KvCodes, KvQuantization, Mask4Ref,
    Options, PagedKv, SlidingWindow, Tensor4, Tensor4Ref, quantize_row,
};
use attn_reference::Materialized;
use faer::{Mat, MatRef};
use proptest::prelude::*;
use proptest::sample::select;
use proptest::test_runner::TestCaseError;

use super::common::{Check, all_rows, compare_head, engine_err, fail, scale_of};
use crate::bound::{ScoreMods, head_bound_with};
use crate::case::{HeadSlot, ModRecipe, OwnedTensor, Rng, TensorLayout, edge_lengths, modifiers};
use crate::{CacheShape, Call, Dtype, Engine, KeySplit, PagedCache};

/// Whether the engine runs paged calls (asked on one empty sequence).
pub(crate) fn supports_paged(engine: &dyn Engine) -> bool {
    let q = Tensor4::<f32>::zeros([1, 1, 0, 1]);
    let pool = Tensor4::<f32>::zeros([1, 1, 1, 1]);
    let Ok(kv) = PagedKv::new(pool.as_ref(), pool.as_ref(), &[0], &[0]) else {
        return false;
    };
    Call::paged(q.as_ref(), &[0, 0], kv, &Options::default())
        .forward_batch(engine)
        .is_some()
}

/// Whether the engine has a paged cache.
pub(crate) fn supports_paged_cache(engine: &dyn Engine) -> bool {
    engine.paged_cache(shape_of(1, 1, 1, 1, 1)).is_some()
}

fn shape_of(pages: usize, page_size: usize, kv_heads: usize, d_k: usize, d_v: usize) -> CacheShape {
    CacheShape {
        pages,
        page_size,
        kv_heads,
        d_k,
        d_v,
        format: None,
    }
}

// ---------------------------------------------------------------------------------------
// Cases.

/// How a pool `[pages, h_kv, page_size, d]` lies in memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PoolLayout {
    /// Contiguous `[pages, h_kv, page_size, d]`.
    PageMajor,
    /// FlashAttention's and vLLM's `[pages, page_size, h_kv, d]`.
    TokenMajor,
    /// `[h_kv, pages, page_size, d]`: each head's pages in a region of their own
    /// (attn-optimized's `PagedKvCache`).
    HeadMajor,
    /// `[pages, page_size, h_kv, d]` with a gap of 3 elements after every row and 5 after
    /// every page, NaN.
    Padded,
}

impl PoolLayout {
    /// Element strides of page, head and row for rows `width` wide.
    fn strides(self, pages: usize, h: usize, ps: usize, width: usize) -> [usize; 3] {
        match self {
            PoolLayout::PageMajor => [h * ps * width, ps * width, width],
            PoolLayout::TokenMajor => [ps * h * width, width, h * width],
            PoolLayout::HeadMajor => [ps * width, pages * ps * width, width],
            PoolLayout::Padded => [ps * h * (width + 3) + 5, width + 3, h * (width + 3)],
        }
    }
}

/// A paged call as a recipe.
#[derive(Debug, Clone, PartialEq)]
pub struct PagedCase {
    /// `(tokens, queries)` of each sequence (`queries ≤ tokens`: its newest tokens).
    pub seqs: Vec<(usize, usize)>,
    /// Tokens a page.
    pub page_size: usize,
    /// Pages of the pool no sequence uses (NaN).
    pub spare_pages: usize,
    /// Entries of each block-table row past the pages of the longest sequence, pointing
    /// anywhere (outside the pool too): pages past a sequence's length are never read.
    pub spare_columns: usize,
    /// Key/value heads.
    pub h_kv: usize,
    /// Query heads per key/value head.
    pub group: usize,
    /// Key width.
    pub d_k: usize,
    /// Value width.
    pub d_v: usize,
    /// The values are the first `d_v` columns of the keys: one pool read as both (a latent
    /// cache, multi-head latent attention).
    pub latent: bool,
    /// How the pools lie in memory.
    pub pool: PoolLayout,
    /// The layout of the packed queries.
    pub q_layout: TensorLayout,
    /// An explicit scale.
    pub scale: Option<f32>,
    /// Causal constraint per sequence (top-left only when every sequence's queries are all
    /// its tokens, where it is bottom-right's).
    pub causal: Option<Causal>,
    /// Sliding window per sequence, aligned bottom-right.
    pub window: Option<SlidingWindow>,
    /// Soft-cap, ALiBi (per query head or per (sequence, query head), aligned bottom-right
    /// unless every sequence is a whole prefill) and sinks; no user modifier.
    pub modifiers: ModRecipe,
    /// The key split of the engine's paged call.
    pub split: KeySplit,
    /// Seed of the values and of the pages' places.
    pub seed: u64,
}

impl PagedCase {
    /// Query heads.
    pub fn h_q(&self) -> usize {
        self.h_kv * self.group
    }

    /// Whether every sequence's queries are all its tokens (then nothing is "newest").
    pub fn whole_prefill(&self) -> bool {
        self.seqs.iter().all(|&(n, q)| n == q)
    }

    /// What the reference spends on the case, about: `Σ n_q·n_k·h_q·(d_k + d_v)`.
    fn work(&self) -> usize {
        let per = self.h_q() * (self.d_k + self.d_v);
        self.seqs.iter().map(|&(n, q)| n * q.max(1) * per).sum()
    }
}

/// The most work ([`PagedCase::work`]) a case may ask of the reference: long sequences
/// decode or attend a few queries, large groups are short.
const WORK: usize = 1 << 21;

fn seq_len(tiles: &[usize]) -> BoxedStrategy<usize> {
    prop_oneof![
        2 => select(vec![0usize, 1]),
        6 => 2..=40usize,
        1 => 41..=160usize,
        1 => select(edge_lengths(tiles, 1300)),
        1 => 500..=1300usize,
    ]
    .boxed()
}

/// How many of a sequence's tokens are queries: `(kind, per-mille)` resolved against its
/// length by [`queries`].
fn query_kind() -> impl Strategy<Value = (u8, u16)> {
    (
        prop_oneof![3 => Just(1u8), 2 => Just(2u8), 2 => Just(3u8), 1 => Just(0u8)],
        0u16..=1000,
    )
}

/// 0: none; 1: decoding (one); 2: a chunk of the newest; 3: all of them.
fn queries(len: usize, (kind, permille): (u8, u16)) -> usize {
    match kind {
        0 => 0,
        1 => len.min(1),
        2 => (len * usize::from(permille) / 1000).clamp(len.min(1), len),
        _ => len,
    }
}

fn grouping() -> impl Strategy<Value = (usize, usize)> {
    prop_oneof![
        4 => (1..=3usize, select(vec![1usize, 2, 3, 4, 8])),
        1 => (1..=2usize, select(vec![16usize, 17, 32])),
    ]
}

fn page_size() -> impl Strategy<Value = usize> {
    prop_oneof![
        2 => Just(1usize),
        4 => select(vec![2usize, 3, 5, 7, 16]),
        1 => Just(64usize),
        1 => Just(4096usize), // larger than any sequence
    ]
}

fn window() -> impl Strategy<Value = Option<SlidingWindow>> {
    use proptest::option::weighted;
    weighted(
        0.25,
        (
            weighted(0.8, prop_oneof![2 => 0..=4usize, 1 => 0..=600usize]),
            weighted(0.5, 0..=4usize),
        ),
    )
    .prop_map(|w| w.map(|(l, r)| SlidingWindow::new(l, r, Causal::BottomRight)))
}

fn pool_layout() -> impl Strategy<Value = PoolLayout> {
    select(vec![
        PoolLayout::PageMajor,
        PoolLayout::TokenMajor,
        PoolLayout::HeadMajor,
        PoolLayout::Padded,
    ])
}

/// Random paged calls (see the module's documentation), capped at [`WORK`].
pub(crate) fn paged_case(tiles: &[usize]) -> BoxedStrategy<PagedCase> {
    use proptest::option::weighted;
    (
        proptest::collection::vec((seq_len(tiles), query_kind()), 1..=4),
        (any::<bool>(), page_size(), 0..=3usize, 0..=2usize),
        (grouping(), select(vec![1usize, 3, 8, 16, 32, 40, 64])),
        (select(vec![1usize, 4, 8, 16, 40]), weighted(0.15, Just(()))),
        (
            pool_layout(),
            select(vec![
                TensorLayout::Bshd,
                TensorLayout::Bhsd,
                TensorLayout::Padded,
            ]),
        ),
        (
            weighted(0.2, select(vec![0.05f32, 0.3, 1.0, 2.5])),
            weighted(0.5, any::<bool>()),
            window(),
        ),
        (modifiers(), any::<bool>(), any::<u64>()),
    )
        .prop_map(
            |(
                seqs,
                (all_decode, page_size, spare_pages, spare_columns),
                ((h_kv, group), d_k),
                (d_v, latent),
                (pool, q_layout),
                (scale, causal, window),
                (modifiers, whole, seed),
            )| {
                let seqs = seqs
                    .into_iter()
                    .map(|(n, k)| (n, if all_decode { n.min(1) } else { queries(n, k) }))
                    .collect();
                let latent = latent.is_some();
                let mut case = PagedCase {
                    seqs,
                    page_size,
                    spare_pages,
                    spare_columns,
                    h_kv,
                    group,
                    d_k,
                    d_v: if latent { d_v.min(d_k) } else { d_v },
                    latent,
                    pool,
                    q_layout,
                    scale,
                    causal: None,
                    window,
                    modifiers: ModRecipe {
                        score_mod: None,
                        mask_mod: None,
                        ..modifiers
                    },
                    split: if whole {
                        KeySplit::Never
                    } else {
                        KeySplit::Auto
                    },
                    seed,
                };
                cap_work(&mut case);
                // Top-left alignment is valid only where it is bottom-right's.
                let newest = !case.whole_prefill();
                case.causal = causal.map(|top_left| {
                    if top_left && !newest {
                        Causal::TopLeft
                    } else {
                        Causal::BottomRight
                    }
                });
                if let Some(a) = case.modifiers.alibi.as_mut()
                    && newest
                {
                    a.align = Causal::BottomRight;
                }
                case
            },
        )
        .boxed()
}

/// Fewer queries, then fewer tokens, until the case is within [`WORK`].
fn cap_work(case: &mut PagedCase) {
    while case.work() > WORK {
        let Some(s) = (0..case.seqs.len()).max_by_key(|&s| case.seqs[s].0 * case.seqs[s].1.max(1))
        else {
            return;
        };
        let (n, q) = case.seqs[s];
        case.seqs[s] = if q > 1 {
            (n, q / 4 + 1)
        } else {
            (n / 2, q.min(n / 2))
        };
    }
}

// ---------------------------------------------------------------------------------------
// Inputs.

/// A paged case's operands: the queries, the pools with the sequences' tokens scattered
/// through them, the block table and lengths, and the same tokens packed contiguously.
struct PagedInputs {
    case: PagedCase,
    q: OwnedTensor,
    /// `[1, h_kv, total_k, d_k]`, `[B,S,H,D]`.
    packed_k: OwnedTensor,
    /// `[1, h_kv, total_k, d_v]` (empty when latent: the values are the keys' columns).
    packed_v: OwnedTensor,
    pool_k: Vec<f32>,
    pool_v: Vec<f32>,
    pages: usize,
    table: Vec<u32>,
    lens: Vec<usize>,
    cu_q: Vec<usize>,
    cu_k: Vec<usize>,
    slopes: Option<Vec<f32>>,
    sinks: Option<Vec<f32>>,
}

fn cumulative(n: impl Iterator<Item = usize>) -> Vec<usize> {
    let mut cu = vec![0];
    for x in n {
        cu.push(cu[cu.len() - 1] + x);
    }
    cu
}

impl PagedInputs {
    fn of(case: &PagedCase, dtype: Dtype) -> Self {
        let mut rng = Rng::new(case.seed, 71);
        let mut value = || dtype.round((rng.unit() * 2.0 - 1.0) as f32);
        let (h_kv, h_q, ps) = (case.h_kv, case.h_q(), case.page_size);
        let lens: Vec<usize> = case.seqs.iter().map(|s| s.0).collect();
        let cu_q = cumulative(case.seqs.iter().map(|s| s.1));
        let cu_k = cumulative(lens.iter().copied());
        let (total_q, total_k) = (cu_q[cu_q.len() - 1], cu_k[cu_k.len() - 1]);
        let q = OwnedTensor::new(case.q_layout, [1, h_q, total_q, case.d_k], &mut value);
        let bshd = TensorLayout::Bshd;
        let packed_k = OwnedTensor::new(bshd, [1, h_kv, total_k, case.d_k], &mut value);
        let v_rows = if case.latent { 0 } else { total_k };
        let packed_v = OwnedTensor::new(bshd, [1, h_kv, v_rows, case.d_v], &mut value);

        // The pages, in a random order through the pool.
        let mut rng = Rng::new(case.seed, 72);
        let need: Vec<usize> = lens.iter().map(|n| n.div_ceil(ps)).collect();
        let used: usize = need.iter().sum();
        let pages = used + case.spare_pages;
        let mut order: Vec<u32> = (0..pages as u32).collect();
        for i in (1..order.len()).rev() {
            order.swap(i, rng.below(i as u64 + 1) as usize);
        }
        let width = need.iter().copied().max().unwrap_or(0) + case.spare_columns;
        let mut table = vec![0u32; lens.len() * width];
        let mut next = order.into_iter();
        for (s, &n) in need.iter().enumerate() {
            for (c, slot) in table[s * width..(s + 1) * width].iter_mut().enumerate() {
                *slot = if c < n {
                    next.next().expect("counted")
                } else {
                    match rng.below(3) {
                        0 => u32::MAX,
                        1 => pages as u32 + rng.below(4) as u32,
                        _ => rng.below(pages.max(1) as u64) as u32,
                    }
                };
            }
        }

        // The pools: NaN where no token lies.
        let fill = |packed: &OwnedTensor, d: usize, row: usize| -> Vec<f32> {
            let s = case.pool.strides(pages, h_kv, ps, row);
            let len = if pages == 0 || h_kv == 0 || d == 0 {
                0
            } else {
                (pages - 1) * s[0] + (h_kv - 1) * s[1] + (ps - 1) * s[2] + row
            };
            let mut pool = vec![f32::NAN; len];
            let view = packed.view();
            for (seq, &n) in lens.iter().enumerate() {
                for h in 0..h_kv {
                    let m = view.head(0, h).expect("in range");
                    for t in 0..n {
                        let page = table[seq * width + t / ps] as usize;
                        let at = page * s[0] + h * s[1] + (t % ps) * s[2];
                        for c in 0..d {
                            pool[at + c] = m[(cu_k[seq] + t, c)];
                        }
                    }
                }
            }
            pool
        };
        let pool_k = fill(&packed_k, case.d_k, case.d_k);
        let pool_v = if case.latent {
            Vec::new()
        } else {
            fill(&packed_v, case.d_v, case.d_v)
        };
        let (slopes, sinks) = case.modifiers.build(lens.len(), h_q, case.seed);
        PagedInputs {
            case: case.clone(),
            q,
            packed_k,
            packed_v,
            pool_k,
            pool_v,
            pages,
            table,
            lens,
            cu_q,
            cu_k,
            slopes,
            sinks,
        }
    }

    /// The pages as the engines read them.
    fn kv(&self) -> PagedKv<'_, f32> {
        self.kv_with_lens(&self.lens)
    }

    /// The pages with other lengths (at most the built ones).
    fn kv_with_lens<'a>(&'a self, lens: &'a [usize]) -> PagedKv<'a, f32> {
        let c = &self.case;
        let (pages, h, ps) = (self.pages, c.h_kv, c.page_size);
        let k_strides = c.pool.strides(pages, h, ps, c.d_k);
        let k = Tensor4Ref::new(&self.pool_k, [pages, h, ps, c.d_k], k_strides);
        let v = if c.latent {
            Tensor4Ref::new(&self.pool_k, [pages, h, ps, c.d_v], k_strides)
        } else {
            let v_strides = c.pool.strides(pages, h, ps, c.d_v);
            Tensor4Ref::new(&self.pool_v, [pages, h, ps, c.d_v], v_strides)
        };
        PagedKv::new(
            k.expect("built to fit"),
            v.expect("built to fit"),
            &self.table,
            lens,
        )
        .expect("built valid")
    }

    /// The same tokens packed: K and V `[1, h_kv, total_k, d]`.
    fn packed(&self) -> (Tensor4Ref<'_, f32>, Tensor4Ref<'_, f32>) {
        let k = self.packed_k.view();
        let v = if self.case.latent {
            let [b, h, n, _] = self.packed_k.dims;
            Tensor4Ref::new(
                &self.packed_k.data,
                [b, h, n, self.case.d_v],
                self.packed_k.strides,
            )
            .expect("a prefix of the keys")
        } else {
            self.packed_v.view()
        };
        (k, v)
    }

    fn seqs(&self) -> CuSeqlens<'_> {
        CuSeqlens::new(&self.cu_q, &self.cu_k).expect("built valid")
    }

    fn options(&self) -> Options<'_> {
        let c = &self.case;
        let masks = Options {
            scale: c.scale,
            causal: c.causal,
            window: c.window,
            ..Options::default()
        };
        c.modifiers
            .apply(masks, self.slopes.as_deref(), self.sinks.as_deref())
    }
}

fn forward(
    engine: &dyn Engine,
    call: Call<'_>,
    what: &str,
) -> Result<(Tensor4<f32>, Vec<f32>), TestCaseError> {
    call.forward_batch(engine)
        .ok_or_else(|| fail(format!("the engine stopped supporting {what}s")))?
        .map_err(|e| engine_err(what, e))
}

fn check_dims(what: &str, out: &Tensor4<f32>, lse: &[f32], want: [usize; 4]) -> Check {
    let rows = want[1] * want[2];
    if out.dims() != want || lse.len() != rows {
        return Err(fail(format!(
            "{what}: output dims {:?} and {} LSE values, not {want:?} and {rows}",
            out.dims(),
            lse.len(),
        )));
    }
    Ok(())
}

/// The first entry where two results differ in their bits: a description.
fn first_difference(
    (o1, l1): (&Tensor4<f32>, &[f32]),
    (o2, l2): (&Tensor4<f32>, &[f32]),
) -> Option<String> {
    let [_, _, n, d] = o1.dims();
    let (a, b) = (o1.as_slice(), o2.as_slice());
    if let Some(i) = (0..a.len()).find(|&i| a[i].to_bits() != b[i].to_bits()) {
        let (h, r, c) = (i / (n * d), i / d % n.max(1), i % d.max(1));
        return Some(format!(
            "output[head {h}, row {r}, column {c}] = {:e} vs {:e} ({} of {} entries differ)",
            a[i],
            b[i],
            (0..a.len())
                .filter(|&i| a[i].to_bits() != b[i].to_bits())
                .count(),
            a.len()
        ));
    }
    let i = (0..l1.len()).find(|&i| l1[i].to_bits() != l2[i].to_bits())?;
    Some(format!(
        "LSE[head {}, row {}] = {:e} vs {:e}",
        i / n.max(1),
        i % n.max(1),
        l1[i],
        l2[i]
    ))
}

// ---------------------------------------------------------------------------------------
// The properties of a paged call.

/// The reference's view of head `h` of a sequence: its materialised attention (f64) and
/// the engine's bound around it.
fn head_reference(
    engine: &dyn Engine,
    [q, k, v]: [MatRef<'_, f32>; 3],
    opts: &Options<'_>,
    slot: &HeadSlot<'_>,
    d_k: usize,
) -> (Materialized, crate::bound::HeadBound) {
    let single = slot.apply(*opts);
    let r = attn_reference::Attention::head(q, k, v, &single)
        .and_then(|call| call.materialized())
        .expect("generated inputs are valid");
    let mods = ScoreMods::of(&single.head_modifiers(0, 0, 1, q.nrows(), k.nrows()), None);
    let b = head_bound_with(
        &engine.error_model(),
        q,
        k,
        v,
        scale_of(opts, d_k),
        None,
        &mods,
        &r,
        0,
    );
    (r, b)
}

/// The engine's paged call within the derived bound of the reference, which reads the same
/// pages literally and equals the reference's packed call over the same tokens bit for bit.
pub(crate) fn paged_equivalence(engine: &dyn Engine, case: PagedCase) -> Check {
    let x = PagedInputs::of(&case, engine.storage());
    let (opts, kv, q) = (x.options(), x.kv(), x.q.view());
    let (pk, pv) = x.packed();
    let h_q = case.h_q();
    let total_q = x.cu_q[x.cu_q.len() - 1];
    let want = [1, h_q, total_q, case.d_v];
    let call = Call::paged(q, &x.cu_q, kv, &opts).with_split(case.split);
    let (out, lse) = forward(engine, call, "paged call")?;
    check_dims("paged call", &out, &lse, want)?;

    // The ground truth reads the pages themselves, and is the packed formula.
    let paged = attn_reference::Attention::paged(q, &x.cu_q, kv, &opts)
        .and_then(|c| c.forward())
        .expect("generated inputs are valid")
        .into_parts();
    let packed = attn_reference::Attention::packed(q, pk, pv, &x.seqs(), &opts)
        .and_then(|c| c.forward())
        .expect("generated inputs are valid")
        .into_parts();
    if let Some(d) = first_difference((&paged.0, &paged.1), (&packed.0, &packed.1)) {
        return Err(fail(format!(
            "the reference's paged call, reading the pages, and its packed call over the same \
             tokens differ: {d}"
        )));
    }

    for s in 0..x.lens.len() {
        let (rows, keys) = (x.cu_q[s]..x.cu_q[s + 1], x.cu_k[s]..x.cu_k[s + 1]);
        if rows.is_empty() {
            continue;
        }
        for h in 0..h_q {
            let kvh = h / case.group;
            let operands = [
                q.head(0, h)
                    .expect("in range")
                    .subrows(rows.start, rows.len()),
                pk.head(0, kvh)
                    .expect("in range")
                    .subrows(keys.start, keys.len()),
                pv.head(0, kvh)
                    .expect("in range")
                    .subrows(keys.start, keys.len()),
            ];
            let slot = HeadSlot::new(&opts, s, h, h_q);
            let (r, b) = head_reference(engine, operands, &opts, &slot, case.d_k);
            let o = out
                .as_ref()
                .head(0, h)
                .map_err(|e| fail(e.to_string()))?
                .subrows(rows.start, rows.len());
            let l = &lse[h * total_q + rows.start..h * total_q + rows.end];
            compare_head(
                &format!(
                    "paged sequence {s} ({} queries, {} tokens in pages of {}), query head {h}",
                    rows.len(),
                    keys.len(),
                    case.page_size
                ),
                o,
                Some(l),
                &r,
                &b,
                &all_rows,
            )
            .map_err(fail)?;
        }
    }
    Ok(())
}

/// The engine's paged call and its packed call over the same tokens, bit for bit, with each
/// key split where the engine says their schedules coincide.
pub(crate) fn paged_is_packed(engine: &dyn Engine, case: PagedCase) -> Check {
    let x = PagedInputs::of(&case, engine.storage());
    let (opts, kv, q) = (x.options(), x.kv(), x.q.view());
    let (pk, pv) = x.packed();
    let seqs = x.seqs();
    let want = [1, case.h_q(), x.cu_q[x.cu_q.len() - 1], case.d_v];
    for split in [KeySplit::Never, KeySplit::Auto] {
        let call = Call::paged(q, &x.cu_q, kv, &opts).with_split(split);
        if !engine.paged_bits_match_packed(&call) {
            continue;
        }
        let (o1, l1) = forward(engine, call, "paged call")?;
        check_dims("paged call", &o1, &l1, want)?;
        let packed = Call::packed(q, pk, pv, &seqs, &opts).with_split(split);
        let (o2, l2) = forward(engine, packed, "packed call")?;
        check_dims("packed call", &o2, &l2, want)?;
        if let Some(d) = first_difference((&o1, &l1), (&o2, &l2)) {
            return Err(fail(format!(
                "key split {split:?}: the paged call and the packed call over the same tokens \
                 differ in their bits, though the engine says they are scheduled alike: {d}"
            )));
        }
    }
    Ok(())
}

/// What makes a paged call malformed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PagedDefect {
    /// A boolean mask `[n_q, n_k]`.
    BoolMask,
    /// An additive mask `[n_q, n_k]`.
    AdditiveMask,
    /// A boolean mask per head, `[1, 1, 1, 1]` broadcast.
    BoolMask4,
    /// An additive mask per head, `[1, 1, 1, 1]` broadcast.
    AdditiveMask4,
    /// Key padding.
    KeyPadding,
    /// Causal top-left while a sequence's queries are not all its tokens.
    TopLeftCausal,
    /// A window aligned top-left, likewise.
    TopLeftWindow,
    /// ALiBi aligned top-left, likewise.
    TopLeftAlibi,
    /// A sequence with more queries than tokens.
    TooManyQueries,
}

pub(crate) fn malformed_case(tiles: &[usize]) -> BoxedStrategy<(PagedCase, PagedDefect)> {
    (
        paged_case(tiles),
        select(vec![
            PagedDefect::BoolMask,
            PagedDefect::AdditiveMask,
            PagedDefect::BoolMask4,
            PagedDefect::AdditiveMask4,
            PagedDefect::KeyPadding,
            PagedDefect::TopLeftCausal,
            PagedDefect::TopLeftWindow,
            PagedDefect::TopLeftAlibi,
            PagedDefect::TooManyQueries,
        ]),
    )
        .prop_map(|(mut case, defect)| {
            // A sequence with a query, one token short of a whole prefill: its queries are
            // its newest tokens, so everything else aligns bottom-right.
            let first = &mut case.seqs[0];
            *first = (first.0.max(2), first.1.clamp(1, first.0.max(2) - 1));
            case.causal = case.causal.map(|_| Causal::BottomRight);
            if let Some(a) = case.modifiers.alibi.as_mut() {
                a.align = Causal::BottomRight;
            }
            (case, defect)
        })
        .boxed()
}

/// A paged call with an element-wise mask or key padding, aligned top-left while it holds
/// a sequence's newest tokens, or with more queries than tokens: the reference's error
/// (a typed `Unsupported` or `Layout`), never a panic nor a result.
pub(crate) fn malformed(engine: &dyn Engine, (case, defect): (PagedCase, PagedDefect)) -> Check {
    let x = PagedInputs::of(&case, engine.storage());
    let q = x.q.view();
    let total_q = x.cu_q[x.cu_q.len() - 1];
    let n_k = x.lens.iter().copied().max().unwrap_or(0);
    let bits = Mat::<bool>::from_fn(total_q, n_k, |i, j| i >= j);
    let bias = Mat::<f32>::zeros(total_q, n_k);
    let (one_bit, one_bias) = ([true], [0.0f32]);
    fn m4<T>(d: &[T]) -> Mask4Ref<'_, T> {
        Mask4Ref::new(d, [1, 1, 1, 1], [0; 4]).expect("one element")
    }
    let mut lens = x.lens.clone();
    let mut opts = x.options();
    let slopes = vec![0.5f32; case.h_q()];
    match defect {
        PagedDefect::BoolMask => opts.bool_mask = Some(BoolMask::allow(bits.as_ref())),
        PagedDefect::AdditiveMask => opts.additive_mask = Some(bias.as_ref()),
        PagedDefect::BoolMask4 => opts.bool_mask_4d = Some(BoolMask4::allow(m4(&one_bit))),
        PagedDefect::AdditiveMask4 => opts.additive_mask_4d = Some(m4(&one_bias)),
        PagedDefect::KeyPadding => opts = opts.with_key_length(n_k),
        PagedDefect::TopLeftCausal => opts.causal = Some(Causal::TopLeft),
        PagedDefect::TopLeftWindow => {
            opts.window = Some(SlidingWindow::new(Some(3), Some(0), Causal::TopLeft));
        }
        PagedDefect::TopLeftAlibi => {
            opts.alibi = Some(attn_core::Alibi::new(&slopes).with_align(Causal::TopLeft));
        }
        PagedDefect::TooManyQueries => lens[0] = case.seqs[0].1 - 1,
    }
    let kv = x.kv_with_lens(&lens);
    let reference = attn_reference::Attention::paged(q, &x.cu_q, kv, &opts).map(|_| ());
    let Err(want) = reference else {
        return Err(fail(format!(
            "the reference accepts a paged call with {defect:?}"
        )));
    };
    let kind_ok = match defect {
        PagedDefect::TooManyQueries => matches!(want, Error::Layout { .. }),
        _ => matches!(want, Error::Unsupported { .. }),
    };
    if !kind_ok {
        return Err(fail(format!(
            "the reference's error for a paged call with {defect:?} is not the typed one: {want}"
        )));
    }
    let call = Call::paged(q, &x.cu_q, kv, &opts).with_split(case.split);
    match call.forward_batch(engine) {
        None => Err(fail("the engine stopped supporting paged calls")),
        Some(Ok(_)) => Err(fail(format!(
            "the engine ran a paged call with {defect:?}; the reference says: {want}"
        ))),
        Some(Err(e)) if e != want => Err(fail(format!(
            "a paged call with {defect:?}: the engine says `{e}`, the reference `{want}`"
        ))),
        Some(Err(_)) => Ok(()),
    }
}

// ---------------------------------------------------------------------------------------
// The paged cache.

/// One operation on a paged cache. `seq` picks among the live sequences (or, for `Stale`,
/// the freed ones) modulo their count; with none, the operation is skipped.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CacheOp {
    /// A new, empty sequence.
    Add,
    /// `tokens` new tokens for a sequence (1: a decoding step).
    Append {
        /// Which live sequence.
        seq: usize,
        /// How many tokens.
        tokens: usize,
    },
    /// A new sequence holding what a live one holds.
    Fork {
        /// Which live sequence.
        seq: usize,
    },
    /// A sequence freed.
    Free {
        /// Which live sequence.
        seq: usize,
    },
    /// Every method called with a freed sequence's handle: each an error, nothing changed.
    Stale {
        /// Which freed sequence.
        seq: usize,
    },
}

/// A paged cache and what is done to it, as a recipe.
#[derive(Debug, Clone, PartialEq)]
pub struct CacheCase {
    /// Pages in the pool.
    pub pages: usize,
    /// Tokens a page.
    pub page_size: usize,
    /// Key/value heads.
    pub h_kv: usize,
    /// Query heads per key/value head.
    pub group: usize,
    /// Key width.
    pub d_k: usize,
    /// Value width.
    pub d_v: usize,
    /// The operations, in order.
    pub ops: Vec<CacheOp>,
    /// Sliding window of the decoding calls, aligned bottom-right.
    pub window: Option<SlidingWindow>,
    /// Soft-cap, ALiBi (aligned bottom-right) and sinks of the decoding calls.
    pub modifiers: ModRecipe,
    /// Seed of the tokens and queries.
    pub seed: u64,
    /// How the cache stores keys and values (`None`: the engine's storage type).
    pub format: Option<KvQuantization>,
}

fn cache_op() -> impl Strategy<Value = CacheOp> {
    let tokens = prop_oneof![3 => Just(1usize), 2 => 2..=12usize, 1 => 13..=70usize];
    prop_oneof![
        2 => Just(CacheOp::Add),
        6 => (any::<usize>(), tokens).prop_map(|(seq, tokens)| CacheOp::Append { seq, tokens }),
        2 => any::<usize>().prop_map(|seq| CacheOp::Fork { seq }),
        2 => any::<usize>().prop_map(|seq| CacheOp::Free { seq }),
        1 => any::<usize>().prop_map(|seq| CacheOp::Stale { seq }),
    ]
}

pub(crate) fn cache_case() -> BoxedStrategy<CacheCase> {
    (
        (4..=160usize, select(vec![1usize, 2, 3, 4, 7, 16, 64])),
        prop_oneof![
            3 => (1..=2usize, select(vec![1usize, 2, 3, 4])),
            1 => (1..=1usize, select(vec![16usize, 17])),
        ],
        (select(vec![1usize, 4, 8, 16]), select(vec![1usize, 4, 8])),
        proptest::collection::vec(cache_op(), 1..=12),
        (window(), modifiers(), any::<u64>(), cache_format()),
    )
        .prop_map(
            |((tokens, page_size), (h_kv, group), (d_k, d_v), ops, (window, m, seed, format))| {
                CacheCase {
                    pages: tokens.div_ceil(page_size),
                    page_size,
                    h_kv,
                    group,
                    d_k,
                    d_v,
                    // The first operation adds a sequence.
                    ops: core::iter::once(CacheOp::Add).chain(ops).collect(),
                    window,
                    modifiers: ModRecipe {
                        score_mod: None,
                        mask_mod: None,
                        alibi: m.alibi.map(|mut a| {
                            a.align = Causal::BottomRight;
                            a
                        }),
                        ..m
                    },
                    seed,
                    format,
                }
            },
        )
        .boxed()
}

/// The cache's format: the storage type mostly, each quantized one now and then.
fn cache_format() -> impl Strategy<Value = Option<KvQuantization>> {
    let int8 = KvQuantization::new(KvCodes::Int8);
    prop_oneof![
        3 => Just(None),
        1 => Just(Some(int8)),
        1 => Just(Some(int8.with_key_channels())),
        1 => Just(Some(KvQuantization::new(KvCodes::Fp8E4m3))),
    ]
}

/// A sequence as the oracle knows it: its tokens, `[t][h_kv][d]` each, as appended and
/// as a quantized cache holds them (read back; the same for other caches).
#[derive(Debug, Clone, Default)]
struct Tokens {
    k: Vec<f32>,
    v: Vec<f32>,
    held_k: Vec<f32>,
    held_v: Vec<f32>,
    len: usize,
}

/// What a cache looked like: free pages, and each live sequence's length and pages.
#[derive(Debug, Clone, PartialEq)]
struct Snapshot {
    free: usize,
    seqs: BTreeMap<usize, (usize, Vec<u32>)>,
}

/// The cache property's state: the engine's cache, the oracle's record of it, and the
/// results of each live sequence's last decoding step.
struct CacheRun<'e> {
    engine: &'e dyn Engine,
    case: CacheCase,
    cache: Box<dyn PagedCache>,
    live: BTreeMap<usize, Tokens>,
    freed: Vec<usize>,
    /// `(len, bits)` of each live sequence's last results.
    seen: BTreeMap<usize, (usize, Vec<u32>)>,
    slopes: Option<Vec<f32>>,
    sinks: Option<Vec<f32>>,
    /// The keys' channels of a quantized cache with them, `(offsets, factors)`
    /// `[h_kv][d_k]`, once the first keys set them.
    channels: Option<(Vec<f32>, Vec<f32>)>,
}

fn tensor(data: &[f32], dims: [usize; 4]) -> Tensor4Ref<'_, f32> {
    // [1, h, t, d] in [B,S,H,D]: the tokens' own order.
    Tensor4Ref::from_layout(data, dims, attn_core::Layout::Bshd).expect("built to fit")
}

fn make_cache(
    engine: &dyn Engine,
    shape: CacheShape,
) -> Result<Box<dyn PagedCache>, TestCaseError> {
    engine
        .paged_cache(shape)
        .ok_or_else(|| fail("the engine stopped offering a paged cache"))?
        .map_err(|e| engine_err("paged cache", e))
}

impl CacheRun<'_> {
    fn h_q(&self) -> usize {
        self.case.h_kv * self.case.group
    }

    fn shape(&self, pages: usize) -> CacheShape {
        let c = &self.case;
        CacheShape {
            format: c.format,
            ..shape_of(pages, c.page_size, c.h_kv, c.d_k, c.d_v)
        }
    }

    /// Rows `[t][h_kv][d]` as a quantized cache holds them: each quantized and read back
    /// (`offset + factor · (scale · value)` in f32, the keys' channels set by the first
    /// keys the run appended); the rows themselves for other caches.
    fn held(&mut self, rows: &[f32], d: usize, keys: bool) -> Result<Vec<f32>, TestCaseError> {
        let Some(format) = self.case.format else {
            return Ok(rows.to_vec());
        };
        let h_kv = self.case.h_kv;
        let t = rows.len() / (h_kv * d).max(1);
        if keys && format.key_channels && self.channels.is_none() && t > 0 {
            let (mut offsets, mut factors) = (Vec::new(), Vec::new());
            for h in 0..h_kv {
                let m = Mat::<f32>::from_fn(t, d, |i, c| rows[(i * h_kv + h) * d + c]);
                let (mu, f) = KeyChannels::calibrate(m.as_ref());
                offsets.extend(mu);
                factors.extend(f);
            }
            self.channels = Some((offsets, factors));
        }
        let mut out = vec![0.0; rows.len()];
        let mut codes = vec![0u8; d];
        for (r, (row, held)) in rows
            .chunks(d.max(1))
            .zip(out.chunks_mut(d.max(1)))
            .enumerate()
        {
            let h = r % h_kv;
            let channels = self
                .channels
                .as_ref()
                .filter(|_| keys && format.key_channels);
            let ch = channels.map(|(mu, f)| KeyChannels {
                offsets: &mu[h * d..(h + 1) * d],
                factors: &f[h * d..(h + 1) * d],
            });
            let scale = quantize_row(format.codes, row, ch, &mut codes)
                .map_err(|e| fail(format!("quantizing a drawn row: {e}")))?;
            for (c, x) in held.iter_mut().enumerate() {
                let value = scale * format.codes.value(codes[c]);
                *x = match ch {
                    Some(ch) => ch.offsets[c] + ch.factors[c] * value,
                    None => value,
                };
            }
        }
        Ok(out)
    }

    fn options(&self) -> Options<'_> {
        let masks = Options {
            causal: Some(Causal::BottomRight),
            window: self.case.window,
            ..Options::default()
        };
        self.case
            .modifiers
            .apply(masks, self.slopes.as_deref(), self.sinks.as_deref())
    }

    fn snapshot(&self, what: &str) -> Result<Snapshot, TestCaseError> {
        let mut seqs = BTreeMap::new();
        for (&h, t) in &self.live {
            let len = self
                .cache
                .len(h)
                .map_err(|e| fail(format!("{what}: the length of live sequence {h}: {e}")))?;
            let pages = self
                .cache
                .pages_of(h)
                .map_err(|e| fail(format!("{what}: the pages of live sequence {h}: {e}")))?;
            if len != t.len {
                return Err(fail(format!(
                    "{what}: sequence {h} holds {len} tokens, not the {} appended to it",
                    t.len
                )));
            }
            seqs.insert(h, (len, pages));
        }
        Ok(Snapshot {
            free: self.cache.free_pages(),
            seqs,
        })
    }

    /// The page accounting: each sequence in `⌈len / page_size⌉` pages of the pool, the
    /// partial ones its own, the free pages the rest.
    fn check_pages(&self, now: &Snapshot, what: &str) -> Check {
        let (ps, pool) = (self.case.page_size, self.case.pages);
        let mut users: BTreeMap<u32, usize> = BTreeMap::new();
        for (h, (len, pages)) in &now.seqs {
            if pages.len() != len.div_ceil(ps) {
                return Err(fail(format!(
                    "{what}: sequence {h} of {len} tokens has {} pages of {ps}",
                    pages.len()
                )));
            }
            if let Some(p) = pages.iter().find(|&&p| p as usize >= pool) {
                return Err(fail(format!(
                    "{what}: sequence {h} uses page {p} of a pool of {pool}"
                )));
            }
            let distinct: BTreeSet<u32> = pages.iter().copied().collect();
            if distinct.len() != pages.len() {
                return Err(fail(format!(
                    "{what}: sequence {h} uses a page twice: {pages:?}"
                )));
            }
            for p in distinct {
                *users.entry(p).or_default() += 1;
            }
        }
        for (h, (len, pages)) in &now.seqs {
            if !len.is_multiple_of(ps) {
                let last = pages[pages.len() - 1];
                if users[&last] > 1 {
                    return Err(fail(format!(
                        "{what}: the partial last page {last} of sequence {h} ({len} tokens) is \
                         shared with another sequence, whose appends would reach it"
                    )));
                }
            }
        }
        if now.free + users.len() != pool {
            return Err(fail(format!(
                "{what}: {} pages free and {} in use by the live sequences, in a pool of {pool}",
                now.free,
                users.len()
            )));
        }
        Ok(())
    }

    /// The query of sequences of `len` tokens: `[1, h_q, 1, d_k]` (none for an empty one).
    fn query(&self, len: usize) -> Vec<f32> {
        let dtype = self.engine.storage();
        let mut rng = Rng::new(self.case.seed ^ (len as u64).wrapping_mul(0x51), 62);
        let n = self.h_q() * self.case.d_k * len.min(1);
        (0..n)
            .map(|_| dtype.round((rng.unit() * 2.0 - 1.0) as f32))
            .collect()
    }

    /// Output and LSE bits of `cache`'s decoding step for sequence `h` of `len` tokens.
    fn decode(
        &self,
        cache: &dyn PagedCache,
        h: usize,
        len: usize,
    ) -> Result<(Tensor4<f32>, Vec<f32>), TestCaseError> {
        let (h_q, d_k, n) = (self.h_q(), self.case.d_k, len.min(1));
        let qd = self.query(len);
        let opts = self.options();
        let (o, l) = cache
            .attention(&[h], tensor(&qd, [1, h_q, n, d_k]), &[0, n], &opts)
            .map_err(|e| engine_err("paged cache call", e))?;
        check_dims("paged cache call", &o, &l, [1, h_q, n, self.case.d_v])?;
        Ok((o, l))
    }

    /// After each operation: a sequence whose length did not change gives the bits it gave
    /// before; every other live sequence's decoding step is within the bound of the
    /// reference on its tokens and, where the engine says its bits ignore where the pages
    /// lie, gives the bits of a fresh cache holding only its tokens.
    fn check_results(&mut self, what: &str) -> Check {
        let mut seen = BTreeMap::new();
        for (&h, t) in &self.live {
            let (o, l) = self.decode(&*self.cache, h, t.len)?;
            let bits: Vec<u32> = o.as_slice().iter().chain(&l).map(|x| x.to_bits()).collect();
            if let Some((len, before)) = self.seen.get(&h)
                && *len == t.len
            {
                if *before != bits {
                    return Err(fail(format!(
                        "{what}: sequence {h} ({len} tokens, untouched) gives other bits than \
                         before"
                    )));
                }
                seen.insert(h, (t.len, bits));
                continue;
            }
            let ps = self.case.page_size;
            // A cache with key channels set them from the first keys it saw, which a
            // fresh cache of one sequence need not see first.
            let channels = self.case.format.is_some_and(|f| f.key_channels);
            if t.len > 0
                && !channels
                && self.engine.paged_bits_ignore_placement(ps, &self.options())
            {
                let mut fresh = make_cache(self.engine, self.shape(t.len.div_ceil(ps)))?;
                let (hk, dk, dv) = (self.case.h_kv, self.case.d_k, self.case.d_v);
                let id = fresh
                    .add_sequence()
                    .map_err(|e| engine_err("new sequence", e))?;
                fresh
                    .append(
                        id,
                        tensor(&t.k, [1, hk, t.len, dk]),
                        tensor(&t.v, [1, hk, t.len, dv]),
                    )
                    .map_err(|e| engine_err("append to a fresh cache", e))?;
                let (fo, fl) = self.decode(&*fresh, id, t.len)?;
                if let Some(d) = first_difference((&o, &l), (&fo, &fl)) {
                    return Err(fail(format!(
                        "{what}: sequence {h} ({} tokens) and a fresh cache holding only its \
                         tokens differ in their bits: {d}",
                        t.len
                    )));
                }
            }
            if t.len > 0 {
                self.against_reference(h, t, &o, &l, what)?;
            }
            seen.insert(h, (t.len, bits));
        }
        self.seen = seen;
        Ok(())
    }

    /// Sequence `h`'s decoding step within the bound of the reference on its tokens.
    fn against_reference(
        &self,
        h: usize,
        t: &Tokens,
        o: &Tensor4<f32>,
        l: &[f32],
        what: &str,
    ) -> Check {
        let c = &self.case;
        let (h_q, qd, opts) = (self.h_q(), self.query(t.len), self.options());
        for head in 0..h_q {
            let kvh = head / c.group;
            let rows = |data: &[f32], d: usize| {
                Mat::<f32>::from_fn(t.len, d, |i, j| data[(i * c.h_kv + kvh) * d + j])
            };
            let (k, v) = (rows(&t.held_k, c.d_k), rows(&t.held_v, c.d_v));
            let q = Mat::<f32>::from_fn(1, c.d_k, |_, j| qd[head * c.d_k + j]);
            let slot = HeadSlot::new(&opts, 0, head, h_q);
            let (r, b) = head_reference(
                self.engine,
                [q.as_ref(), k.as_ref(), v.as_ref()],
                &opts,
                &slot,
                c.d_k,
            );
            let out = o.as_ref().head(0, head).map_err(|e| fail(e.to_string()))?;
            compare_head(
                &format!("{what}: sequence {h} ({} tokens), query head {head}", t.len),
                out,
                Some(&l[head..head + 1]),
                &r,
                &b,
                &all_rows,
            )
            .map_err(fail)?;
        }
        Ok(())
    }

    /// New tokens for a sequence, `[t][h_kv][d]`, rounded to the storage type.
    fn tokens(&self, n: usize, stream: u64) -> (Vec<f32>, Vec<f32>) {
        let dtype = self.engine.storage();
        let mut rng = Rng::new(self.case.seed, 100 + stream);
        let c = &self.case;
        let mut draw = |d: usize| -> Vec<f32> {
            (0..n * c.h_kv * d)
                .map(|_| dtype.round((rng.unit() * 2.0 - 1.0) as f32))
                .collect()
        };
        let k = draw(c.d_k);
        (k, draw(c.d_v))
    }

    fn pick(&self, seq: usize) -> Option<usize> {
        let n = self.live.len();
        (n > 0).then(|| *self.live.keys().nth(seq % n).expect("in range"))
    }

    /// Runs operation `i`, checking its result against the page accounting; returns a
    /// description of it.
    fn apply(&mut self, i: usize, op: CacheOp) -> Result<String, TestCaseError> {
        let before = self.snapshot(&format!("before operation {i}"))?;
        let ps = self.case.page_size;
        let unchanged = |run: &Self, what: &str| -> Check {
            let now = run.snapshot(what)?;
            if now != before {
                return Err(fail(format!(
                    "{what}: the failed operation changed the cache: {before:?} became {now:?}"
                )));
            }
            Ok(())
        };
        let capacity = |e: &Error, what: &str, need: usize, free: usize| -> Check {
            if matches!(e, Error::Capacity { .. }) {
                Ok(())
            } else {
                Err(fail(format!(
                    "{what}: needing {need} pages of {free} free, the error is not \
                     Error::Capacity: {e}"
                )))
            }
        };
        match op {
            CacheOp::Add => {
                let h = self
                    .cache
                    .add_sequence()
                    .map_err(|e| engine_err("new sequence", e))?;
                let what = format!("operation {i}: add sequence {h}");
                if self.live.contains_key(&h) || self.freed.contains(&h) {
                    return Err(fail(format!("{what}: the handle is already taken")));
                }
                self.live.insert(h, Tokens::default());
                Ok(what)
            }
            CacheOp::Append { seq, tokens } => {
                let Some(h) = self.pick(seq) else {
                    return Ok(format!("operation {i}: nothing to append to"));
                };
                let what = format!("operation {i}: append {tokens} tokens to sequence {h}");
                let (k, v) = self.tokens(tokens, i as u64);
                let (len, pages) = before.seqs[&h].clone();
                let need = (len + tokens).div_ceil(ps) - pages.len();
                let c = &self.case;
                let r = self.cache.append(
                    h,
                    tensor(&k, [1, c.h_kv, tokens, c.d_k]),
                    tensor(&v, [1, c.h_kv, tokens, c.d_v]),
                );
                match r {
                    Ok(()) if need > before.free => Err(fail(format!(
                        "{what}: it needs {need} pages but only {} are free, yet it succeeded",
                        before.free
                    ))),
                    Ok(()) => {
                        let (d_k, d_v) = (self.case.d_k, self.case.d_v);
                        let held_k = self.held(&k, d_k, true)?;
                        let held_v = self.held(&v, d_v, false)?;
                        let t = self.live.get_mut(&h).expect("live");
                        t.k.extend(k);
                        t.v.extend(v);
                        t.held_k.extend(held_k);
                        t.held_v.extend(held_v);
                        t.len += tokens;
                        Ok(what)
                    }
                    Err(e) if need > before.free => {
                        capacity(&e, &what, need, before.free)?;
                        unchanged(self, &what)?;
                        Ok(format!("{what} (out of pages)"))
                    }
                    Err(e) => Err(engine_err(&what, e)),
                }
            }
            CacheOp::Fork { seq } => {
                let Some(h) = self.pick(seq) else {
                    return Ok(format!("operation {i}: nothing to fork"));
                };
                let what = format!("operation {i}: fork sequence {h}");
                let (len, pages) = before.seqs[&h].clone();
                let need = usize::from(!len.is_multiple_of(ps));
                match self.cache.fork(h) {
                    Ok(_) if need > before.free => Err(fail(format!(
                        "{what}: its partial page needs a copy and no page is free, yet it \
                         succeeded"
                    ))),
                    Ok(child) => {
                        if self.live.contains_key(&child) || self.freed.contains(&child) {
                            return Err(fail(format!(
                                "{what}: the child's handle {child} is already taken"
                            )));
                        }
                        let got = self
                            .cache
                            .pages_of(child)
                            .map_err(|e| engine_err("pages of the child", e))?;
                        let full = len / ps;
                        if got.len() != pages.len() || got[..full] != pages[..full] {
                            return Err(fail(format!(
                                "{what}: the child {child} uses pages {got:?}, not the parent's \
                                 {full} full ones {:?} and a copy of its partial one",
                                &pages[..full]
                            )));
                        }
                        let t = self.live[&h].clone();
                        self.live.insert(child, t);
                        let placement_free =
                            self.engine.paged_bits_ignore_placement(ps, &self.options());
                        if let Some(s) = self.seen.get(&h).cloned()
                            && placement_free
                        {
                            // The child's first results are the parent's (its partial page
                            // a copy elsewhere in the pool).
                            self.seen.insert(child, s);
                        }
                        Ok(format!("{what} into sequence {child}"))
                    }
                    Err(e) if need > before.free => {
                        capacity(&e, &what, need, before.free)?;
                        unchanged(self, &what)?;
                        Ok(format!("{what} (out of pages)"))
                    }
                    Err(e) => Err(engine_err(&what, e)),
                }
            }
            CacheOp::Free { seq } => {
                let Some(h) = self.pick(seq) else {
                    return Ok(format!("operation {i}: nothing to free"));
                };
                let what = format!("operation {i}: free sequence {h}");
                self.cache.free(h).map_err(|e| engine_err(&what, e))?;
                self.live.remove(&h);
                self.seen.remove(&h);
                self.freed.push(h);
                Ok(what)
            }
            CacheOp::Stale { seq } => {
                if self.freed.is_empty() {
                    return Ok(format!("operation {i}: no freed sequence"));
                }
                let h = self.freed[seq % self.freed.len()];
                let what = format!("operation {i}: every method on freed sequence {h}");
                let c = &self.case;
                let (k, v) = self.tokens(1, i as u64);
                let q = vec![0.0f32; self.h_q() * c.d_k];
                let opts = self.options();
                let results = [
                    ("len", self.cache.len(h).err()),
                    ("pages_of", self.cache.pages_of(h).err()),
                    (
                        "attention",
                        self.cache
                            .attention(&[h], tensor(&q, [1, self.h_q(), 1, c.d_k]), &[0, 1], &opts)
                            .err(),
                    ),
                    (
                        "append",
                        self.cache
                            .append(
                                h,
                                tensor(&k, [1, c.h_kv, 1, c.d_k]),
                                tensor(&v, [1, c.h_kv, 1, c.d_v]),
                            )
                            .err(),
                    ),
                    ("fork", self.cache.fork(h).err()),
                    ("free", self.cache.free(h).err()),
                ];
                if let Some((name, _)) = results.iter().find(|r| r.1.is_none()) {
                    return Err(fail(format!("{what}: `{name}` succeeded")));
                }
                unchanged(self, &what)?;
                Ok(what)
            }
        }
    }
}

/// Random sequences of operations on a paged cache (add, append a chunk or a token, fork,
/// free, use a freed handle): after each, the pages are accounted for, an operation that
/// ran out of pages is a typed error that changed nothing, and every live sequence's
/// decoding step is within the bound of the reference on its tokens and gives the bits it
/// gave before if its length did not change (fork and free never change another
/// sequence's results); where the engine says its bits ignore where the pages lie, they
/// are those of a fresh cache holding only its tokens.
pub(crate) fn cache_isolation(engine: &dyn Engine, case: CacheCase) -> Check {
    let shape = CacheShape {
        format: case.format,
        ..shape_of(case.pages, case.page_size, case.h_kv, case.d_k, case.d_v)
    };
    // An engine whose cache has no such format is not asked about it.
    if case.format.is_some() && engine.paged_cache(shape).is_none_or(|c| c.is_err()) {
        return Ok(());
    }
    let cache = make_cache(engine, shape)?;
    if cache.free_pages() != case.pages {
        return Err(fail(format!(
            "a new cache of {} pages has {} free",
            case.pages,
            cache.free_pages()
        )));
    }
    let (slopes, sinks) = case.modifiers.build(1, case.h_kv * case.group, case.seed);
    let mut run = CacheRun {
        engine,
        case: case.clone(),
        cache,
        live: BTreeMap::new(),
        freed: Vec::new(),
        seen: BTreeMap::new(),
        slopes,
        sinks,
        channels: None,
    };
    for (i, &op) in case.ops.iter().enumerate() {
        let what = run.apply(i, op)?;
        let now = run.snapshot(&what)?;
        run.check_pages(&now, &what)?;
        run.check_results(&what)?;
    }
    Ok(())
}

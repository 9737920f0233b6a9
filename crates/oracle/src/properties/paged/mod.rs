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

use attn_core::{
    BoolMask, BoolMask4, Causal, CuSeqlens, Error, Mask4Ref, Options, PagedKv, SlidingWindow,
    Tensor4, Tensor4Ref,
};
use attn_reference::Materialized;
use faer::{Mat, MatRef};
use proptest::prelude::*;
use proptest::sample::select;
use proptest::test_runner::TestCaseError;

use super::common::{Check, all_rows, compare_head, engine_err, fail, scale_of};
use crate::bound::{ScoreMods, head_bound_with};
use crate::case::{HeadSlot, ModRecipe, OwnedTensor, Rng, TensorLayout, edge_lengths, modifiers};
use crate::{CacheShape, Call, Dtype, Engine, KeySplit};

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

mod cache;
pub use cache::{CacheCase, CacheOp};
pub(crate) use cache::{cache_case, cache_isolation};

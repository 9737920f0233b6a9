//! The paged cache's property: random histories of adds, appends, forks and frees, in
//! every format the cache holds (the storage type, int8 with or without key channels,
//! fp8); each sequence's decoding step checked against the reference formula on what the
//! cache holds, and untouched sequences keeping their bits.

use std::collections::{BTreeMap, BTreeSet};

use attn_core::{KeyChannels, KvCodes, KvQuantization, quantize_row};

use super::*;
use crate::PagedCache;

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

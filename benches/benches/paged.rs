//! The paged cache's decoding target, 2 threads: one query per head against a long cache
//! held in pages (32 query and 32 K/V heads, batch 1, n_k = 32768, d = 128, f16), against
//! the same tokens in a contiguous [`KvCache`]. Pages of 16 tokens (the target's) and of
//! 128, as the cache hands them out to one sequence filling it, to two sequences growing
//! side by side (a page of each in turn), and from a fragmented pool (every other page in
//! use by others, which the sequence then gets, scattered: the worst case).
//!
//! Then the other two serving targets: a continuous batch (one chunk of 512 queries after
//! 3,584 cached tokens plus 31 decoding steps at 4,096 keys, 32/8 heads, d = 128, f16, pages
//! of 16) against the chunk alone plus the 31 steps alone; and multi-head latent attention
//! (128 query heads, one latent K/V head, d_k = 576, d_v = 512, n_k = 16384, pages of 64)
//! against separate K and V buffers and faer's f32 GEMM rate, in f32 and bf16.
//!
//! Last, memory: 64 sequences forked from one 4,096-token prompt (8 K/V heads, d = 128, f16,
//! pages of 16), each decoding 40 tokens of its own, against what the prompt's keys and
//! values take once (the resident set's growth, from `/proc/self/status`).
//!
//! Criterion times each; the ratio comes from a loop that interleaves the two round by
//! round and prints the median of the per-round ratios (memory bandwidth drifts by tens
//! of per cent within a run on these machines). Under `cargo test --benches` the shapes
//! shrink to a toy size.

mod common;

use std::time::Duration;

use attn_benches::inputs::random_vec;
use attn_benches::protocol::median;
use attn_benches::roof::{gemm_gflops, pool};
use attn_optimized::{
    Attention, Batch, Causal, Element, KvCache, Layout, Options, PagedKvCache, Par, Result, SeqId,
    Tensor4Ref, bf16, f16,
};
use criterion::{Criterion, Throughput};

/// The shape of the target, or a toy one in test mode.
struct Setup {
    heads: usize,
    n_k: usize,
    d: usize,
    rounds: usize,
}

/// Deterministic values, rounded to `T`.
fn values<T: Element>(n: usize, seed: u64) -> Vec<T> {
    random_vec(n, seed).into_iter().map(T::from_f32).collect()
}

/// `x` as `[1, h, len, d]` from token `from` on, for `x` token-major (`[tokens, h, d]`).
fn tokens<T>(x: &[T], (h, d): (usize, usize), from: usize, len: usize) -> Tensor4Ref<'_, T> {
    let x = &x[from * h * d..(from + len) * h * d];
    Tensor4Ref::from_layout(x, [1, h, len, d], Layout::Bshd).expect("a view")
}

/// One forward call, its result dropped.
fn step<T: Element>(call: Result<Attention<'_, T, Batch>>) {
    call.and_then(|c| c.forward(Par::rayon(0)))
        .map(drop)
        .expect("an attention call");
}

/// How the measured sequence's pages lie in the pool.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Pages {
    /// One sequence filling the cache.
    Alone,
    /// Two sequences growing a page of each in turn.
    SideBySide,
    /// Every other page of the pool held by other sequences: the sequence's pages are
    /// scattered, each apart from the next.
    Fragmented,
}

impl Pages {
    fn name(self) -> &'static str {
        match self {
            Self::Alone => "alone",
            Self::SideBySide => "side_by_side",
            Self::Fragmented => "fragmented",
        }
    }

    fn says(self) -> &'static str {
        match self {
            Self::Alone => "one sequence filling the cache",
            Self::SideBySide => "two sequences growing side by side",
            Self::Fragmented => "scattered through a fragmented pool",
        }
    }
}

/// Fills every page of `cache` with a one-token sequence, then frees those on odd pages:
/// what a sequence is handed next is every other page.
fn fragment(cache: &mut PagedKvCache<f16>, (h, d): (usize, usize)) {
    let token = values::<f16>(h * d, 5);
    let one = tokens(&token, (h, d), 0, 1);
    let mut seqs = Vec::new();
    while cache.free_pages() > 0 {
        let s = cache.add_sequence().expect("a sequence");
        cache.append(s, one, one).expect("a page");
        seqs.push(s);
    }
    for s in seqs {
        if cache.pages_of(s).expect("a sequence")[0] % 2 == 1 {
            cache.free(s).expect("a sequence");
        }
    }
}

/// The same tokens in a contiguous cache and in paged caches: `(page size, layout,
/// cache, the sequence measured)`.
struct Caches {
    contiguous: KvCache<f16>,
    paged: Vec<(usize, Pages, PagedKvCache<f16>, SeqId)>,
    q: Vec<f16>,
}

impl Caches {
    fn new(s: &Setup, configs: &[(usize, Pages)]) -> Self {
        let (h, n, d) = (s.heads, s.n_k, s.d);
        let mut contiguous = KvCache::<f16>::new(1, h, n, d, d).expect("a cache");
        let mut paged: Vec<_> = configs
            .iter()
            .map(|&(ps, layout)| {
                let pages = n.div_ceil(ps) * if layout == Pages::Alone { 1 } else { 2 };
                let mut cache = PagedKvCache::<f16>::new(pages, ps, h, d, d).expect("a cache");
                if layout == Pages::Fragmented {
                    fragment(&mut cache, (h, d));
                }
                let seq = cache.add_sequence().expect("a sequence");
                (ps, layout, cache, seq)
            })
            .collect();
        let others: Vec<Option<SeqId>> = paged
            .iter_mut()
            .map(|(_, layout, cache, _)| {
                (*layout == Pages::SideBySide).then(|| cache.add_sequence().expect("a sequence"))
            })
            .collect();
        // The prompt in chunks, appended to every cache alike; side by side, a page of it
        // at a time, each followed by a page for the other sequence.
        let chunk = 1024.min(n);
        for (i, start) in (0..n).step_by(chunk).enumerate() {
            let t = chunk.min(n - start);
            let (k, v) = (
                values::<f16>(h * t * d, 2 * i as u64),
                values::<f16>(h * t * d, 2 * i as u64 + 1),
            );
            contiguous
                .append(tokens(&k, (h, d), 0, t), tokens(&v, (h, d), 0, t))
                .expect("room");
            for ((ps, _, cache, seq), other) in paged.iter_mut().zip(&others) {
                let step = if other.is_some() { *ps } else { t };
                for from in (0..t).step_by(step) {
                    let len = step.min(t - from);
                    let (kc, vc) = (tokens(&k, (h, d), from, len), tokens(&v, (h, d), from, len));
                    cache.append(*seq, kc, vc).expect("pages");
                    if let Some(o) = other {
                        cache.append(*o, kc, vc).expect("pages");
                    }
                }
            }
        }
        let q = values::<f16>(h * d, 99);
        Self {
            contiguous,
            paged,
            q,
        }
    }

    fn q(&self, s: &Setup) -> Tensor4Ref<'_, f16> {
        Tensor4Ref::from_layout(&self.q, [1, s.heads, 1, s.d], Layout::Bshd).expect("a view")
    }

    fn step_contiguous(&self, s: &Setup) {
        let opts = Options::default().with_causal(Causal::BottomRight);
        self.contiguous
            .attention(self.q(s), &opts)
            .and_then(|c| c.forward(Par::rayon(0)))
            .map(drop)
            .expect("a decoding step");
    }

    fn step_paged(&self, s: &Setup, i: usize) {
        let opts = Options::default().with_causal(Causal::BottomRight);
        let (_, _, cache, seq) = &self.paged[i];
        let batch = cache.batch(&[*seq]).expect("a batch");
        batch
            .attention(self.q(s), &[0, 1], &opts)
            .and_then(|c| c.forward(Par::rayon(0)))
            .map(drop)
            .expect("a decoding step");
    }
}

fn main() {
    common::print_platform();
    let full = common::full_size();
    let only = std::env::var("ATTN_PAGED_ONLY").unwrap_or_default();
    let wanted = |section: &str| only.is_empty() || only.split(',').any(|s| s == section);
    let pool = pool(2);
    let mut c = Criterion::default()
        .sample_size(10)
        .measurement_time(Duration::from_secs(if full { 4 } else { 1 }))
        .configure_from_args();
    if wanted("decode") {
        decode(&mut c, &pool, full);
    }
    if wanted("continuous") {
        continuous(&mut c, &pool, full);
    }
    if wanted("latent") {
        latent::<f32>(&mut c, &pool, full);
        latent::<bf16>(&mut c, &pool, full);
    }
    if wanted("prefix") && !common::criterion_only() {
        shared_prefix(full);
    }
    c.final_summary();
}

/// The decoding target: a paged cache against the contiguous one.
fn decode(c: &mut Criterion, pool: &rayon::ThreadPool, full: bool) {
    let s = if full {
        Setup {
            heads: 32,
            n_k: 32768,
            d: 128,
            rounds: 11,
        }
    } else {
        Setup {
            heads: 2,
            n_k: 300,
            d: 32,
            rounds: 1,
        }
    };
    let caches = Caches::new(
        &s,
        &[
            (16, Pages::Alone),
            (16, Pages::SideBySide),
            (16, Pages::Fragmented),
            (128, Pages::Fragmented),
        ],
    );
    let kv_bytes = 2 * s.heads * s.n_k * s.d * 2;
    {
        let (h, n, d) = (s.heads, s.n_k, s.d);
        let mut group = c.benchmark_group(format!("paged_decode_h{h}_nk{n}_d{d}_f16_t2"));
        group.throughput(Throughput::Bytes(kv_bytes as u64));
        group.bench_function("contiguous", |b| {
            pool.install(|| b.iter(|| caches.step_contiguous(&s)))
        });
        for (i, (ps, layout, _, _)) in caches.paged.iter().enumerate() {
            group.bench_function(format!("pages_of_{ps}_{}", layout.name()), |b| {
                pool.install(|| b.iter(|| caches.step_paged(&s, i)))
            });
        }
        group.finish();
    }
    if common::criterion_only() {
        return;
    }

    pool.install(|| {
        caches.step_contiguous(&s);
        (0..caches.paged.len()).for_each(|i| caches.step_paged(&s, i));
    });
    let mut ratios = vec![Vec::new(); caches.paged.len()];
    for _ in 0..s.rounds {
        let t = pool.install(|| common::seconds(|| caches.step_contiguous(&s)));
        for (i, r) in ratios.iter_mut().enumerate() {
            r.push(t / pool.install(|| common::seconds(|| caches.step_paged(&s, i))));
        }
    }
    println!(
        "\npaged decode: ratios interleaved round by round, median of {} rounds (n_q=1, h={}, n_k={}, d={}, f16, 2 threads)",
        s.rounds, s.heads, s.n_k, s.d
    );
    for ((ps, layout, _, _), r) in caches.paged.iter().zip(&ratios) {
        let (lo, hi) = common::range(r);
        let target = if *ps == 16 && *layout != Pages::Fragmented {
            "  (target ≥ 0.95)"
        } else {
            ""
        };
        println!(
            "  pages of {ps}, {}: speed ÷ contiguous cache's = {:.3}  (range {lo:.2}–{hi:.2}){target}",
            layout.says(),
            median(r).unwrap_or(f64::NAN)
        );
    }
}

/// The continuous batch against its chunk alone plus its decoding steps alone.
fn continuous(c: &mut Criterion, pool: &rayon::ThreadPool, full: bool) {
    let (h_q, h_kv, d, n_k, chunk, decodes, rounds) = if full {
        (32, 8, 128, 4096, 512, 31, 9)
    } else {
        (4, 2, 32, 300, 40, 3, 1)
    };
    let batch = Continuous::new(h_q, h_kv, d, n_k, chunk, decodes);
    let mut group = c.benchmark_group(format!(
        "paged_continuous_h{h_q}_{h_kv}_nk{n_k}_chunk{chunk}_decodes{decodes}_d{d}_f16_t2"
    ));
    group.bench_function("mixed", |b| pool.install(|| b.iter(|| batch.mixed())));
    group.bench_function("chunk_alone", |b| {
        pool.install(|| b.iter(|| batch.chunk_alone()))
    });
    group.bench_function("decodes_alone", |b| {
        pool.install(|| b.iter(|| batch.decodes_alone()))
    });
    group.finish();
    if common::criterion_only() {
        return;
    }
    let mut ratios = Vec::new();
    for _ in 0..rounds {
        let mixed = pool.install(|| common::seconds(|| batch.mixed()));
        let apart = pool.install(|| {
            common::seconds(|| batch.chunk_alone()) + common::seconds(|| batch.decodes_alone())
        });
        ratios.push(mixed / apart);
    }
    let (lo, hi) = common::range(&ratios);
    println!(
        "\ncontinuous batch (a chunk of {chunk} after {} cached, {decodes} decodes at {n_k} keys, \
         h={h_q}/{h_kv}, d={d}, f16, pages of 16, 2 threads), median of {rounds} rounds:\n  \
         time ÷ (chunk alone + decodes alone) = {:.3}  (range {lo:.2}–{hi:.2})  (target ≤ 1.1)",
        n_k - chunk,
        median(&ratios).unwrap_or(f64::NAN)
    );
}

/// Multi-head latent attention's decoding step: its rate against faer's f32 GEMM rate, and
/// its time against separate K and V buffers.
fn latent<T: Element>(c: &mut Criterion, pool: &rayon::ThreadPool, full: bool) {
    let (h_q, n_k, d_k, d_v, rounds) = if full {
        (128, 16384, 576, 512, 9)
    } else {
        (16, 300, 72, 64, 1)
    };
    let mla = Latent::<T>::new(h_q, n_k, d_k, d_v);
    let flops = 2.0 * (h_q * n_k * (d_k + d_v)) as f64;
    let mut group = c.benchmark_group(format!(
        "latent_decode_h{h_q}_nk{n_k}_dk{d_k}_dv{d_v}_{}_t2",
        T::NAME
    ));
    group.throughput(Throughput::Elements(flops as u64));
    group.bench_function("latent_pages", |b| {
        pool.install(|| b.iter(|| mla.step_latent()))
    });
    group.bench_function("separate_kv", |b| {
        pool.install(|| b.iter(|| mla.step_separate()))
    });
    group.finish();
    if common::criterion_only() {
        return;
    }
    let (mut roof, mut ratios, mut speed) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..rounds {
        let g = gemm_gflops(if full { 2048 } else { 64 }, 2, 1)[0];
        let t = pool.install(|| common::seconds(|| mla.step_latent()));
        let apart = pool.install(|| common::seconds(|| mla.step_separate()));
        roof.push(flops / t / 1e9 / g);
        ratios.push(apart / t);
        speed.push(flops / t / 1e9);
    }
    let (lo, hi) = common::range(&roof);
    println!(
        "\nlatent decode ({h_q} query heads, one latent head, d_k={d_k}, d_v={d_v}, n_k={n_k}, {}, \
         pages of 64, 2 threads), median of {rounds} rounds: {:.0} GFLOP/s\n  \
         ÷ faer's f32 GEMM rate = {:.3}  (range {lo:.2}–{hi:.2})  (target ≥ 0.75)\n  \
         speed ÷ separate K and V buffers' = {:.3}  (target ≥ 1)",
        T::NAME,
        median(&speed).unwrap_or(f64::NAN),
        median(&roof).unwrap_or(f64::NAN),
        median(&ratios).unwrap_or(f64::NAN)
    );
}

/// The continuous batch: sequence 0 a chunk of `chunk` queries at the end of `n_k` tokens,
/// the others one decoding step each at `n_k` tokens, in one paged cache whose sequences
/// took their prompts a page-run of 1024 tokens at a time, round robin.
struct Continuous {
    cache: PagedKvCache<f16>,
    seqs: Vec<SeqId>,
    /// `[1, h_q, chunk + decodes, d]`, the chunk's rows first.
    q: Vec<f16>,
    chunk: usize,
    h_q: usize,
    d: usize,
}

impl Continuous {
    fn new(h_q: usize, h_kv: usize, d: usize, n_k: usize, chunk: usize, decodes: usize) -> Self {
        let seqs_n = decodes + 1;
        let ps = 16;
        let mut cache =
            PagedKvCache::<f16>::new(seqs_n * n_k.div_ceil(ps), ps, h_kv, d, d).expect("a cache");
        let seqs: Vec<SeqId> = (0..seqs_n)
            .map(|_| cache.add_sequence().expect("a sequence"))
            .collect();
        let run = 1024.min(n_k);
        for (r, from) in (0..n_k).step_by(run).enumerate() {
            let len = run.min(n_k - from);
            for (i, &seq) in seqs.iter().enumerate() {
                let seed = 1000 + 2 * (r * seqs_n + i) as u64;
                let (k, v) = (
                    values::<f16>(h_kv * len * d, seed),
                    values::<f16>(h_kv * len * d, seed + 1),
                );
                let (k, v) = (tokens(&k, (h_kv, d), 0, len), tokens(&v, (h_kv, d), 0, len));
                cache.append(seq, k, v).expect("pages");
            }
        }
        let q = values(h_q * (chunk + decodes) * d, 7);
        Self {
            cache,
            seqs,
            q,
            chunk,
            h_q,
            d,
        }
    }

    /// The call over sequences `seqs` whose queries are rows `rows` of the batch's.
    fn run(&self, seqs: &[SeqId], rows: core::ops::Range<usize>, cu_q: &[usize]) {
        let total = self.chunk + self.seqs.len() - 1;
        let q = Tensor4Ref::new(
            &self.q[rows.start * self.d..],
            [1, self.h_q, rows.len(), self.d],
            [self.h_q * total * self.d, total * self.d, self.d],
        )
        .expect("a view");
        let opts = Options::default().with_causal(Causal::BottomRight);
        let batch = self.cache.batch(seqs).expect("a batch");
        step(batch.attention(q, cu_q, &opts));
    }

    fn mixed(&self) {
        let total = self.chunk + self.seqs.len() - 1;
        let cu_q: Vec<usize> = core::iter::once(0).chain(self.chunk..=total).collect();
        self.run(&self.seqs, 0..total, &cu_q);
    }

    fn chunk_alone(&self) {
        self.run(&self.seqs[..1], 0..self.chunk, &[0, self.chunk]);
    }

    fn decodes_alone(&self) {
        let n = self.seqs.len() - 1;
        let cu_q: Vec<usize> = (0..=n).collect();
        self.run(&self.seqs[1..], self.chunk..self.chunk + n, &cu_q);
    }
}

/// Multi-head latent attention's decoding step: `h_q` query heads against one latent head
/// (the value a column prefix of the key) in pages of 64, and the same keys and values in
/// a contiguous cache holding K and V apart.
struct Latent<T> {
    latent: PagedKvCache<T>,
    seq: SeqId,
    separate: KvCache<T>,
    q: Vec<T>,
    h_q: usize,
    d_k: usize,
}

impl<T: Element> Latent<T> {
    fn new(h_q: usize, n_k: usize, d_k: usize, d_v: usize) -> Self {
        let ps = 64;
        let mut latent =
            PagedKvCache::<T>::latent(n_k.div_ceil(ps), ps, 1, d_k, d_v).expect("a latent cache");
        let seq = latent.add_sequence().expect("a sequence");
        let mut separate = KvCache::<T>::new(1, 1, n_k, d_k, d_v).expect("a cache");
        let rows = values::<T>(n_k * d_k, 21);
        let all = Tensor4Ref::from_layout(&rows, [1, 1, n_k, d_k], Layout::Bhsd).expect("a view");
        latent.append_latent(seq, all).expect("pages");
        let v =
            Tensor4Ref::new(&rows, [1, 1, n_k, d_v], [n_k * d_k, n_k * d_k, d_k]).expect("a view");
        separate.append(all, v).expect("room");
        Self {
            latent,
            seq,
            separate,
            q: values(h_q * d_k, 22),
            h_q,
            d_k,
        }
    }

    fn q(&self) -> Tensor4Ref<'_, T> {
        Tensor4Ref::from_layout(&self.q, [1, self.h_q, 1, self.d_k], Layout::Bhsd).expect("a view")
    }

    fn step_latent(&self) {
        let opts = Options::default().with_causal(Causal::BottomRight);
        let batch = self.latent.batch(&[self.seq]).expect("a batch");
        step(batch.attention(self.q(), &[0, 1], &opts));
    }

    fn step_separate(&self) {
        let opts = Options::default().with_causal(Causal::BottomRight);
        self.separate
            .attention(self.q(), &opts)
            .and_then(|c| c.forward(Par::rayon(0)))
            .map(drop)
            .expect("a decoding step");
    }
}
/// The resident memory of 64 sequences sharing one prompt's pages.
fn shared_prefix(full: bool) {
    use attn_benches::memory::residency;
    let (h_kv, d, prompt, own, seqs, ps): (usize, usize, usize, usize, usize, usize) = if full {
        (8, 128, 4096, 40, 64, 16)
    } else {
        (2, 16, 64, 3, 4, 16)
    };
    let mib = |b: u64| b as f64 / (1 << 20) as f64;
    let page_bytes = (2 * h_kv * ps * d * 2) as u64;
    let pages = prompt / ps * seqs + seqs * own.div_ceil(ps);
    let before = residency();
    let mut cache = PagedKvCache::<f16>::new(pages, ps, h_kv, d, d).expect("a cache");
    let reserved = residency();
    let root = cache.add_sequence().expect("a sequence");
    let (k, v) = (
        values::<f16>(h_kv * prompt * d, 1),
        values::<f16>(h_kv * prompt * d, 2),
    );
    let (k_prompt, v_prompt) = (
        tokens(&k, (h_kv, d), 0, prompt),
        tokens(&v, (h_kv, d), 0, prompt),
    );
    cache.append(root, k_prompt, v_prompt).expect("pages");
    drop((k, v));
    let mut all = vec![root];
    for _ in 1..seqs {
        all.push(cache.fork(root).expect("a fork"));
    }
    let token = values::<f16>(h_kv * d, 3);
    let one = tokens(&token, (h_kv, d), 0, 1);
    for &s in &all {
        for _ in 0..own {
            cache.append(s, one, one).expect("pages");
        }
    }
    let after = residency();
    let in_use = (pages - cache.free_pages()) as u64 * page_bytes;
    let prompt_bytes = (2 * h_kv * prompt * d * 2) as u64;
    println!(
        "\nshared prefix ({seqs} sequences forked from a {prompt}-token prompt, each then {own} \
         tokens of its own; {h_kv} K/V heads, d={d}, f16, pages of {ps}):\n  \
         pages in use {:.1} MiB = the prompt's K/V once ({:.1} MiB) + {seqs} × {} own pages \
         ({seqs} copies of the prompt would be {:.1} MiB)",
        mib(in_use),
        mib(prompt_bytes),
        own.div_ceil(ps),
        mib(prompt_bytes * seqs as u64),
    );
    match (before, reserved, after) {
        (Some(b), Some(r), Some(a)) => println!(
            "  resident memory: +{:.1} MiB once the pool of {:.1} MiB is reserved, +{:.1} MiB \
             after the prompt, the forks and the decoding",
            mib(r.rss_bytes.saturating_sub(b.rss_bytes)),
            mib(pages as u64 * page_bytes),
            mib(a.rss_bytes.saturating_sub(b.rss_bytes)),
        ),
        _ => println!("  resident memory: not readable on this system"),
    }
}

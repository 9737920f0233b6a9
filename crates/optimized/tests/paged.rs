//! Attention straight from pages: the same as the contiguous calls it stands for, bit for
//! bit, and a paged cache whose sequences never reach each other.

use attn_optimized::{
    Alibi, Attention, Causal, CuSeqlens, Element, Error, KvCache, Layout, Options, PagedKv,
    PagedKvCache, Par, ScoreMod, SeqId, SlidingWindow, SoftCap, SplitKv, Tensor4, Tensor4Ref, bf16,
    f16,
};

mod common;

/// Deterministic values in [-1, 1].
fn data<T: Element>(n: usize, seed: u64) -> Vec<T> {
    common::data(n, seed, 1.0)
}

/// Sequences laid out in pages in a shuffled order: the pool (FlashAttention's
/// `[pages, page_size, h_kv, d]`), the block table and the lengths; and the same tokens
/// packed contiguously (`[1, h_kv, total, d]`, `[B,S,H,D]`) with their offsets.
struct Paged<T> {
    pool_k: Vec<T>,
    pool_v: Vec<T>,
    pages: usize,
    page: usize,
    table: Vec<u32>,
    lens: Vec<usize>,
    packed_k: Vec<T>,
    packed_v: Vec<T>,
    cu_k: Vec<usize>,
}

fn paged<T: Element>(lens: &[usize], page: usize, h_kv: usize, d: usize, seed: u64) -> Paged<T> {
    let per_seq = lens
        .iter()
        .map(|l| l.div_ceil(page))
        .max()
        .unwrap_or(0)
        .max(1);
    let pages = lens.len() * per_seq + 3;
    // Pages handed out in a scrambled order, so no sequence's pages are in order.
    let mut order: Vec<u32> = (0..pages as u32).collect();
    for i in 0..order.len() {
        let j = (i * 7 + 3) % order.len();
        order.swap(i, j);
    }
    let mut table = vec![0u32; lens.len() * per_seq];
    let mut next = order.into_iter();
    for (s, &len) in lens.iter().enumerate() {
        for p in 0..len.div_ceil(page) {
            table[s * per_seq + p] = next.next().unwrap();
        }
    }
    let total: usize = lens.iter().sum();
    let (packed_k, packed_v) = (
        data::<T>(total * h_kv * d, seed),
        data::<T>(total * h_kv * d, seed + 1),
    );
    let mut pool_k = vec![T::from_f32(f32::NAN); pages * page * h_kv * d];
    let mut pool_v = pool_k.clone();
    let mut cu_k = vec![0];
    for (s, &len) in lens.iter().enumerate() {
        let start = *cu_k.last().unwrap();
        for t in 0..len {
            let p = table[s * per_seq + t / page] as usize;
            for h in 0..h_kv {
                for c in 0..d {
                    let at = ((p * page + t % page) * h_kv + h) * d + c;
                    let from = ((start + t) * h_kv + h) * d + c;
                    pool_k[at] = packed_k[from];
                    pool_v[at] = packed_v[from];
                }
            }
        }
        cu_k.push(start + len);
    }
    Paged {
        pool_k,
        pool_v,
        pages,
        page,
        table,
        lens: lens.to_vec(),
        packed_k,
        packed_v,
        cu_k,
    }
}

fn bits<T: Element>(t: &Tensor4<T>) -> Vec<u32> {
    t.as_slice().iter().map(|x| x.to_f32().to_bits()).collect()
}

/// A paged call against the packed call of the same tokens: the same bits, output and LSE.
fn same_as_packed<T: Element>(lens: &[usize], queries: &[usize], page: usize, opts: &Options<'_>) {
    let (h_q, h_kv, d) = (4, 2, 40);
    let p = paged::<T>(lens, page, h_kv, d, 11);
    let total_q: usize = queries.iter().sum();
    let qd = data::<T>(total_q * h_q * d, 5);
    let q = Tensor4Ref::from_layout(&qd, [1, h_q, total_q, d], Layout::Bshd).unwrap();
    let mut cu_q = vec![0];
    for &n in queries {
        cu_q.push(cu_q.last().unwrap() + n);
    }
    let pool = |v| Tensor4Ref::from_layout(v, [p.pages, h_kv, p.page, d], Layout::Bshd).unwrap();
    let kv = PagedKv::new(pool(&p.pool_k), pool(&p.pool_v), &p.table, &p.lens).unwrap();
    // Decoding stacks a group's heads into one job, which changes how many tasks there are
    // and so whether keys are split: both calls keep each head's keys whole.
    let got = Attention::paged(q, &cu_q, kv, opts)
        .and_then(|c| c.split_kv(SplitKv::Never).forward(Par::rayon(0)))
        .unwrap();
    let total_k = *p.cu_k.last().unwrap();
    let packed = |v| Tensor4Ref::from_layout(v, [1, h_kv, total_k, d], Layout::Bshd).unwrap();
    let seqs = CuSeqlens::new(&cu_q, &p.cu_k).unwrap();
    let want = Attention::packed(q, packed(&p.packed_k), packed(&p.packed_v), &seqs, opts)
        .and_then(|c| c.split_kv(SplitKv::Never).forward(Par::rayon(0)))
        .unwrap();
    let what = format!("{} lens {lens:?} queries {queries:?} page {page}", T::NAME);
    same_bits(&bits(got.output()), &bits(want.output()), &what);
    let lse = |l: &[f32]| l.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    same_bits(&lse(got.lse()), &lse(want.lse()), &format!("LSE {what}"));
}

/// Asserts equal bits, naming the first difference and how many there are.
fn same_bits(got: &[u32], want: &[u32], what: &str) {
    let differ: Vec<usize> = (0..got.len()).filter(|&i| got[i] != want[i]).collect();
    if let Some(&i) = differ.first() {
        panic!(
            "{what}: {} of {} differ, the first at {i}: {} vs {}",
            differ.len(),
            got.len(),
            f32::from_bits(got[i]),
            f32::from_bits(want[i])
        );
    }
}

/// Options whose meaning does not depend on where the queries sit (no user modifier):
/// the packed call aligns them bottom-right as the paged call does.
fn options() -> Vec<Options<'static>> {
    static SLOPES: [f32; 4] = [0.5, 0.25, 0.125, 0.0625];
    static SINKS: [f32; 4] = [0.3, -1.0, 2.0, 0.0];
    vec![
        Options::default(),
        Options::default().with_causal(Causal::BottomRight),
        Options::default().with_window(SlidingWindow::new(Some(17), Some(0), Causal::BottomRight)),
        Options::default()
            .with_causal(Causal::BottomRight)
            .with_alibi(Alibi::new(&SLOPES)),
        Options::default().with_softcap(SoftCap::new(5.0).unwrap()),
        Options::default().with_sinks(&SINKS),
    ]
}

#[test]
fn decode_chunked_prefill_and_a_mix_are_the_packed_call_bit_for_bit() {
    // Decode (a query each), chunks against a cached prefix, and a continuous batch of both
    // with an empty sequence; lengths across several key blocks; pages of 16, of an odd
    // size and larger than a sequence.
    let cases: [(&[usize], &[usize]); 4] = [
        (&[700, 33, 1300], &[1, 1, 1]),
        (&[90, 600], &[40, 9]),
        (&[1100, 5, 0, 260], &[1, 5, 0, 30]),
        (&[17], &[17]),
    ];
    for opts in &options() {
        for (lens, queries) in cases {
            for page in [16, 7, 2048] {
                same_as_packed::<f32>(lens, queries, page, opts);
            }
            for page in [2048, 16] {
                same_as_packed::<bf16>(lens, queries, page, opts);
                same_as_packed::<f16>(lens, queries, page, opts);
            }
        }
    }
    // bf16 with pages of an odd size: its blocks are multiplied in f32, still the same.
    same_as_packed::<bf16>(&[300, 520], &[1, 20], 7, &Options::default());
}

/// The user's modifiers see each query at its position in the sequence, as a KV cache's
/// call shows them: a paged cache and a contiguous one give the same bits.
#[test]
fn the_users_modifiers_see_the_same_positions_as_a_kv_cache() {
    #[derive(Debug)]
    struct Distance;
    impl ScoreMod for Distance {
        fn score(&self, s: f32, _b: usize, h: usize, q: usize, k: usize) -> f32 {
            s - 0.01 * (h + 1) as f32 * q.abs_diff(k) as f32
        }
        fn derivative(&self, _s: f32, _b: usize, _h: usize, _q: usize, _k: usize) -> f32 {
            1.0
        }
    }
    let (heads, d, prompt, steps) = (2, 16, 45, 3);
    let mut contiguous = KvCache::<f32>::new(1, heads, 64, d, d).unwrap();
    let mut pages = PagedKvCache::<f32>::new(8, 16, heads, d, d).unwrap();
    let seq = pages.add_sequence().unwrap();
    let opts = Options::default()
        .with_causal(Causal::BottomRight)
        .with_score_mod(&Distance);
    for (step, n) in [prompt]
        .into_iter()
        .chain([1; 3])
        .enumerate()
        .take(steps + 1)
    {
        let kv = data::<f32>(heads * n * d, 100 + step as u64);
        let kv = Tensor4Ref::from_layout(&kv, [1, heads, n, d], Layout::Bshd).unwrap();
        contiguous.append(kv, kv).unwrap();
        pages.append(seq, kv, kv).unwrap();
        let qd = data::<f32>(heads * n * d, 200 + step as u64);
        let q = Tensor4Ref::from_layout(&qd, [1, heads, n, d], Layout::Bshd).unwrap();
        let want = contiguous
            .attention(q, &opts)
            .and_then(|c| c.forward(Par::Seq))
            .unwrap();
        let batch = pages.batch(&[seq]).unwrap();
        let cu = [0, n];
        let got = batch
            .attention(q, &cu, &opts)
            .and_then(|c| c.forward(Par::Seq))
            .unwrap();
        same_bits(
            &bits(got.output()),
            &bits(want.output()),
            &format!("step {step}"),
        );
    }
}

/// One sequence of 1300 tokens in a contiguous cache and in pages of 16, and one query
/// per head: `(contiguous, pages, its sequence, q : [1, h_q, 1, 40])`.
fn one_decode<T: Element>(h_q: usize, h_kv: usize) -> (KvCache<T>, PagedKvCache<T>, SeqId, Vec<T>) {
    let (d, n) = (40, 1300);
    let mut contiguous = KvCache::<T>::new(1, h_kv, n, d, d).unwrap();
    let mut pages = PagedKvCache::<T>::new(n.div_ceil(16), 16, h_kv, d, d).unwrap();
    let seq = pages.add_sequence().unwrap();
    let (k, v) = (data::<T>(h_kv * n * d, 61), data::<T>(h_kv * n * d, 62));
    let (k, v) = (
        Tensor4Ref::from_layout(&k, [1, h_kv, n, d], Layout::Bshd).unwrap(),
        Tensor4Ref::from_layout(&v, [1, h_kv, n, d], Layout::Bshd).unwrap(),
    );
    contiguous.append(k, v).unwrap();
    pages.append(seq, k, v).unwrap();
    (contiguous, pages, seq, data::<T>(h_q * d, 63))
}

/// Decoding stacks the heads that share a K/V head into one job, as a contiguous cache's
/// call does (a few as rows of the row kernels, a large group as a GEMM tile: multi-head
/// latent attention's shape), keys split alike: the same bits.
fn stacks_as_a_kv_cache<T: Element>(h_q: usize, h_kv: usize, opts: &Options<'_>) {
    let (contiguous, pages, seq, qd) = one_decode::<T>(h_q, h_kv);
    let q = Tensor4Ref::from_layout(&qd, [1, h_q, 1, 40], Layout::Bshd).unwrap();
    let want = contiguous
        .attention(q, opts)
        .and_then(|c| c.forward(Par::rayon(0)))
        .unwrap();
    let batch = pages.batch(&[seq]).unwrap();
    let got = batch
        .attention(q, &[0, 1], opts)
        .and_then(|c| c.forward(Par::rayon(0)))
        .unwrap();
    let what = format!("{} {h_q}/{h_kv} heads", T::NAME);
    same_bits(&bits(got.output()), &bits(want.output()), &what);
    let lse = |l: &[f32]| l.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    same_bits(&lse(got.lse()), &lse(want.lse()), &format!("LSE {what}"));
}

/// A large stack (a GEMM tile of heads) within f32 rounding of the formula.
fn large_stack_is_the_formula(h_q: usize, h_kv: usize, opts: &Options<'_>) {
    let (_, pages, seq, qd) = one_decode::<f32>(h_q, h_kv);
    let q = Tensor4Ref::from_layout(&qd, [1, h_q, 1, 40], Layout::Bshd).unwrap();
    let batch = pages.batch(&[seq]).unwrap();
    let got = batch
        .attention(q, &[0, 1], opts)
        .and_then(|c| c.forward(Par::rayon(0)))
        .unwrap();
    let want = attn_reference::Attention::paged(q, &[0, 1], batch.kv().unwrap(), opts)
        .and_then(|c| c.forward())
        .unwrap();
    for (a, b) in got.output().as_slice().iter().zip(want.output().as_slice()) {
        assert!((a - b).abs() <= 2e-6, "{h_q}/{h_kv}: {a} vs {b} ({opts:?})");
    }
}

#[test]
fn decoding_stacks_a_groups_heads_as_a_kv_cache_does() {
    let opts = [
        Options::default().with_causal(Causal::BottomRight),
        Options::default()
            .with_window(SlidingWindow::new(Some(700), Some(0), Causal::BottomRight))
            .with_softcap(SoftCap::new(5.0).unwrap()),
    ];
    for opts in &opts {
        for (h_q, h_kv) in [(8, 2), (32, 1), (48, 2)] {
            stacks_as_a_kv_cache::<f32>(h_q, h_kv, opts);
            stacks_as_a_kv_cache::<bf16>(h_q, h_kv, opts);
            large_stack_is_the_formula(h_q, h_kv, opts);
        }
    }
}

/// The paged call within f32 rounding of the formula reading the same pages (the
/// reference engine), masks and modifiers included.
#[test]
fn the_reference_reads_the_same_pages() {
    let (h_q, h_kv, d) = (4, 2, 24);
    let (lens, queries) = ([300usize, 41, 77], [1usize, 41, 6]);
    let p = paged::<f32>(&lens, 16, h_kv, d, 31);
    let total_q: usize = queries.iter().sum();
    let qd = data::<f32>(total_q * h_q * d, 9);
    let q = Tensor4Ref::from_layout(&qd, [1, h_q, total_q, d], Layout::Bshd).unwrap();
    let cu_q = [0, 1, 42, 48];
    let pool = |v| Tensor4Ref::from_layout(v, [p.pages, h_kv, 16, d], Layout::Bshd).unwrap();
    let kv = PagedKv::new(pool(&p.pool_k), pool(&p.pool_v), &p.table, &p.lens).unwrap();
    for opts in &options() {
        let got = Attention::paged(q, &cu_q, kv, opts)
            .and_then(|c| c.forward(Par::rayon(0)))
            .unwrap();
        let want = attn_reference::Attention::paged(q, &cu_q, kv, opts)
            .and_then(|c| c.forward())
            .unwrap();
        for (a, b) in got.output().as_slice().iter().zip(want.output().as_slice()) {
            assert!((a - b).abs() <= 2e-6, "{a} vs {b} ({opts:?})");
        }
        for (a, b) in got.lse().iter().zip(want.lse()) {
            assert!((a - b).abs() <= 2e-5 * b.abs().max(1.0), "LSE {a} vs {b}");
        }
    }
}

/// One sequence's results, bits of output and LSE, decoding one query.
fn decode_bits(cache: &PagedKvCache<f32>, seq: attn_optimized::SeqId) -> Vec<u32> {
    let (heads, d) = (2, 8);
    let qd = data::<f32>(heads * d, 77);
    let q = Tensor4Ref::from_layout(&qd, [1, heads, 1, d], Layout::Bshd).unwrap();
    let batch = cache.batch(&[seq]).unwrap();
    let cu = [0, 1];
    let fwd = batch
        .attention(q, &cu, &Options::default().with_causal(Causal::BottomRight))
        .and_then(|c| c.forward(Par::Seq))
        .unwrap();
    let mut out = bits(fwd.output());
    out.extend(fwd.lse().iter().map(|x| x.to_bits()));
    out
}

fn tokens(n: usize, seed: u64) -> Vec<f32> {
    data::<f32>(2 * n * 8, seed)
}

fn append(
    cache: &mut PagedKvCache<f32>,
    seq: attn_optimized::SeqId,
    x: &[f32],
) -> Result<(), Error> {
    let n = x.len() / 16;
    let kv = Tensor4Ref::from_layout(x, [1, 2, n, 8], Layout::Bshd)?;
    cache.append(seq, kv, kv)
}

#[test]
fn forks_share_full_pages_and_never_reach_each_other() {
    let mut cache = PagedKvCache::<f32>::new(10, 4, 2, 8, 8).unwrap();
    let parent = cache.add_sequence().unwrap();
    append(&mut cache, parent, &tokens(10, 1)).unwrap(); // 3 pages, the last half full
    assert_eq!(cache.free_pages(), 7);
    let before = decode_bits(&cache, parent);
    let child = cache.fork(parent).unwrap();
    // Two full pages shared, the partial one copied.
    assert_eq!(cache.free_pages(), 6);
    let (pp, cp) = (
        cache.pages_of(parent).unwrap(),
        cache.pages_of(child).unwrap(),
    );
    assert_eq!(pp[..2], cp[..2]);
    assert_ne!(pp[2], cp[2]);
    assert_eq!(decode_bits(&cache, child), before);
    // The child grows past the shared prefix: the parent's results keep every bit.
    append(&mut cache, child, &tokens(7, 2)).unwrap();
    assert_eq!(decode_bits(&cache, parent), before);
    assert_eq!(cache.len(child).unwrap(), 17);
    // And the parent's growth leaves the child alone.
    let child_bits = decode_bits(&cache, child);
    append(&mut cache, parent, &tokens(3, 3)).unwrap();
    assert_eq!(decode_bits(&cache, child), child_bits);
    // The child, on its own, is the sequence its tokens make.
    let mut alone = PagedKvCache::<f32>::new(10, 4, 2, 8, 8).unwrap();
    let s = alone.add_sequence().unwrap();
    append(&mut alone, s, &tokens(10, 1)).unwrap();
    append(&mut alone, s, &tokens(7, 2)).unwrap();
    assert_eq!(decode_bits(&alone, s), child_bits);
    // Freeing the parent keeps the shared pages for the child.
    let free = cache.free_pages();
    cache.free(parent).unwrap();
    assert_eq!(cache.free_pages(), free + 2); // its own two pages, not the shared ones
    assert_eq!(decode_bits(&cache, child), child_bits);
    cache.free(child).unwrap();
    assert_eq!(cache.free_pages(), 10);
}

/// Forking a long sequence shares every full page and copies at most the partial one;
/// sequences forked from one prompt hold its pages once, however many there are.
#[test]
fn forks_copy_at_most_one_page_and_share_a_prefix_once() {
    let ps = 16;
    for n in [32768usize, 32768 + 5] {
        let pages = n.div_ceil(ps) + 1;
        let mut cache = PagedKvCache::<f32>::new(pages, ps, 2, 8, 8).unwrap();
        let parent = cache.add_sequence().unwrap();
        append(&mut cache, parent, &tokens(n, 4)).unwrap();
        let free = cache.free_pages();
        let child = cache.fork(parent).unwrap();
        let copied = free - cache.free_pages();
        assert_eq!(copied, usize::from(n % ps != 0), "{n} tokens");
        assert_eq!(cache.len(child).unwrap(), n);
        let shared = n / ps;
        assert_eq!(
            cache.pages_of(child).unwrap()[..shared],
            cache.pages_of(parent).unwrap()[..shared]
        );
    }
    // 64 sequences on one 4096-token prompt, each then decoding 40 tokens of its own.
    let (prompt, own, seqs): (usize, usize, usize) = (4096, 40, 64);
    let (prompt_pages, own_pages) = (prompt / ps, own.div_ceil(ps));
    let mut cache = PagedKvCache::<f32>::new(prompt_pages + seqs * own_pages, ps, 2, 8, 8).unwrap();
    let root = cache.add_sequence().unwrap();
    append(&mut cache, root, &tokens(prompt, 5)).unwrap();
    let mut all = vec![root];
    for _ in 1..seqs {
        all.push(cache.fork(root).unwrap());
    }
    assert_eq!(cache.free_pages(), seqs * own_pages);
    for (i, &s) in all.iter().enumerate() {
        for t in 0..own {
            append(&mut cache, s, &tokens(1, 1000 + (i * own + t) as u64)).unwrap();
        }
    }
    // Every page in use: the prompt's once, and each sequence's own.
    assert_eq!(cache.free_pages(), 0);
    let in_use: std::collections::BTreeSet<u32> = all
        .iter()
        .flat_map(|&s| cache.pages_of(s).unwrap().to_vec())
        .collect();
    assert_eq!(in_use.len(), prompt_pages + seqs * own_pages);
}

#[test]
fn running_out_of_pages_changes_nothing() {
    let mut cache = PagedKvCache::<f32>::new(3, 4, 2, 8, 8).unwrap();
    let a = cache.add_sequence().unwrap();
    append(&mut cache, a, &tokens(6, 1)).unwrap();
    let b = cache.add_sequence().unwrap();
    append(&mut cache, b, &tokens(2, 2)).unwrap();
    assert_eq!(cache.free_pages(), 0);
    let before = (decode_bits(&cache, a), decode_bits(&cache, b));
    let err = append(&mut cache, a, &tokens(3, 3)).unwrap_err();
    assert!(matches!(err, Error::Capacity { .. }), "{err}");
    let err = cache.fork(a).unwrap_err();
    assert!(matches!(err, Error::Capacity { .. }), "{err}");
    assert_eq!((cache.len(a).unwrap(), cache.len(b).unwrap()), (6, 2));
    assert_eq!((decode_bits(&cache, a), decode_bits(&cache, b)), before);
    // Two more tokens fit in a's partial page.
    append(&mut cache, a, &tokens(2, 4)).unwrap();
    assert_eq!(cache.len(a).unwrap(), 8);
    // A freed sequence is gone: every use of its handle is an error.
    cache.free(b).unwrap();
    assert!(matches!(cache.len(b), Err(Error::OutOfRange { .. })));
    assert!(cache.free(b).is_err() && cache.fork(b).is_err() && cache.batch(&[b]).is_err());
    assert!(append(&mut cache, b, &tokens(1, 5)).is_err());
}

#[test]
fn bad_pages_and_queries_are_typed_errors() {
    let pool = vec![0.0f32; 4 * 4 * 8];
    let pages = Tensor4Ref::from_layout(&pool, [4, 1, 4, 8], Layout::Bhsd).unwrap();
    // A page outside the pool, a length past its pages, a table not a row per sequence.
    assert!(matches!(
        PagedKv::new(pages, pages, &[0, 9], &[6]),
        Err(Error::OutOfRange { .. })
    ));
    assert!(matches!(
        PagedKv::new(pages, pages, &[0, 1], &[9]),
        Err(Error::Capacity { .. })
    ));
    assert!(matches!(
        PagedKv::new(pages, pages, &[0, 1, 2], &[4, 4]),
        Err(Error::Layout { .. })
    ));
    // Pages past a sequence's length are not looked at.
    let kv = PagedKv::new(pages, pages, &[1, 99], &[3]).unwrap();
    let q = vec![0.0f32; 4 * 8];
    let q = Tensor4Ref::from_layout(&q, [1, 1, 4, 8], Layout::Bhsd).unwrap();
    let call = |cu: &[usize], opts: &Options<'_>| Attention::paged(q, cu, kv, opts).map(|_| ());
    let plain = Options::default();
    // More queries than tokens, offsets that do not end at the total, too few offsets.
    assert!(matches!(call(&[0, 4], &plain), Err(Error::Layout { .. })));
    let q3 = Tensor4Ref::from_layout(&[0.0f32; 24], [1, 1, 3, 8], Layout::Bhsd).unwrap();
    assert!(Attention::paged(q3, &[0, 2], kv, &plain).is_err());
    assert!(Attention::paged(q3, &[0], kv, &plain).is_err());
    // Top-left alignment would make the newest tokens the oldest.
    let top_left = Options::default().with_causal(Causal::TopLeft);
    let one = Tensor4Ref::from_layout(&[0.0f32; 8], [1, 1, 1, 8], Layout::Bhsd).unwrap();
    assert!(matches!(
        Attention::paged(one, &[0, 1], kv, &top_left),
        Err(Error::Unsupported { .. })
    ));
    // No backward pass.
    let fwd = Attention::paged(one, &[0, 1], kv, &plain).and_then(|c| {
        let f = c.forward(Par::Seq)?;
        c.backward(&f, f.output().as_ref(), Par::Seq).map(|_| ())
    });
    assert!(matches!(fwd, Err(Error::Unsupported { .. })));
}

/// Multi-head latent attention: the values are the first columns of the keys, stored once
/// in a latent cache, and read as both: the packed call over the same rows, bit for bit.
fn latent_is_packed<T: Element>() {
    let (h_q, d_k, d_v, ps) = (8, 80, 64, 16);
    let (lens, queries) = ([40usize, 300], [1usize, 7]);
    let mut cache = PagedKvCache::<T>::latent(64, ps, 1, d_k, d_v).unwrap();
    let mut packed = Vec::new();
    let seqs: Vec<_> = lens
        .iter()
        .enumerate()
        .map(|(i, &n)| {
            let s = cache.add_sequence().unwrap();
            let rows = data::<T>(n * d_k, 40 + i as u64);
            let view = Tensor4Ref::from_layout(&rows, [1, 1, n, d_k], Layout::Bshd).unwrap();
            cache.append_latent(s, view).unwrap();
            packed.extend(rows);
            s
        })
        .collect();
    // Keys and values can only be appended together in a latent cache.
    let one = Tensor4Ref::from_layout(&packed[..d_k], [1, 1, 1, d_k], Layout::Bshd).unwrap();
    assert!(matches!(
        cache.append(seqs[0], one, one),
        Err(Error::Unsupported { .. })
    ));
    let total_q: usize = queries.iter().sum();
    let qd = data::<T>(total_q * h_q * d_k, 3);
    let q = Tensor4Ref::from_layout(&qd, [1, h_q, total_q, d_k], Layout::Bshd).unwrap();
    let cu_q = [0, 1, 8];
    let opts = Options::default().with_causal(Causal::BottomRight);
    let batch = cache.batch(&seqs).unwrap();
    let got = batch
        .attention(q, &cu_q, &opts)
        .and_then(|c| c.forward(Par::rayon(0)))
        .unwrap();
    let total_k: usize = lens.iter().sum();
    let k = Tensor4Ref::from_layout(&packed, [1, 1, total_k, d_k], Layout::Bshd).unwrap();
    let v = Tensor4Ref::new(&packed, [1, 1, total_k, d_v], [total_k * d_k, d_k, d_k]).unwrap();
    let cu_k = [0, 40, 340];
    let seqs = CuSeqlens::new(&cu_q, &cu_k).unwrap();
    let want = Attention::packed(q, k, v, &seqs, &opts)
        .and_then(|c| c.forward(Par::rayon(0)))
        .unwrap();
    assert_eq!(got.output().dims(), [1, h_q, total_q, d_v]);
    same_bits(&bits(got.output()), &bits(want.output()), T::NAME);
}

#[test]
fn a_latent_cache_reads_its_values_as_a_prefix_of_its_keys() {
    latent_is_packed::<f32>();
    latent_is_packed::<bf16>();
    assert!(PagedKvCache::<f32>::latent(4, 16, 1, 64, 80).is_err());
    // DeepSeek's shapes: each token once, 576 columns instead of 576 + 512.
    let (latent, apart) = (
        PagedKvCache::<bf16>::latent(64, 64, 1, 576, 512).unwrap(),
        PagedKvCache::<bf16>::new(64, 64, 1, 576, 512).unwrap(),
    );
    assert!(latent.pool_bytes() as f64 <= 0.55 * apart.pool_bytes() as f64);
}

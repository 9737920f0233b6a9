//! Keys and values in pages: the view of a paged KV cache that every engine reads, and
//! the checks of a call against it.
//!
//! Serving systems keep each sequence's K and V in fixed-size pages of a shared pool,
//! addressed by a block table (vLLM's PagedAttention, FlashAttention's
//! `flash_attn_with_kvcache`): sequence `s`'s token `t` lies in page
//! `block_table[s][t / page_size]`, row `t % page_size`. [`PagedKv`] is that view: the
//! pools of K and V as `[pages, h_kv, page_size, d]` tensors (any strides, so
//! FlashAttention's `[pages, page_size, h_kv, d]` is [`Layout::Bshd`](crate::Layout::Bshd)),
//! the block table and each sequence's length.

use core::ops::Range;

use faer::MatRef;

use crate::{BatchShape, Causal, Error, HeadShape, Options, Result, Tensor4Ref};

/// A batch of sequences whose keys and values lie in pages, read through a block table.
///
/// ```
/// use attn_core::{Layout, PagedKv, Tensor4Ref};
/// // A pool of 3 pages of 2 tokens, one head, d = 1: page p holds 10p and 10p + 1.
/// let pool: Vec<f32> = (0..3).flat_map(|p| [10.0 * p as f32, 10.0 * p as f32 + 1.0]).collect();
/// let pages = Tensor4Ref::from_layout(&pool, [3, 1, 2, 1], Layout::Bhsd)?;
/// // Sequence 0 holds 3 tokens in pages 2 then 0; sequence 1 one token in page 1.
/// let (table, lens) = ([2, 0, 1, 0], [3, 1]);
/// let kv = PagedKv::new(pages, pages, &table, &lens)?;
/// let rows: Vec<f32> = kv.segments(kv.keys(), 0, 0, 0..3).flat_map(|(_, m)| {
///     (0..m.nrows()).map(move |i| m[(i, 0)])
/// }).collect();
/// assert_eq!(rows, [20.0, 21.0, 0.0]);
/// # Ok::<(), attn_core::Error>(())
/// ```
#[derive(Debug, Clone, Copy)]
pub struct PagedKv<'a, T> {
    k: Tensor4Ref<'a, T>,
    v: Tensor4Ref<'a, T>,
    block_table: &'a [u32],
    pages_per_seq: usize,
    lens: &'a [usize],
}

impl<'a, T> PagedKv<'a, T> {
    /// Checks the view: K `[pages, h_kv, page_size, d_k]` and V `[pages, h_kv, page_size,
    /// d_v]` sharing pages, heads and page size (at least one token a page);
    /// `block_table` row-major `[batch, pages_per_seq]` with `batch = lens.len()`; each
    /// length within its row's pages, and every page a length reaches inside the pool.
    pub fn new(
        k: Tensor4Ref<'a, T>,
        v: Tensor4Ref<'a, T>,
        block_table: &'a [u32],
        lens: &'a [usize],
    ) -> Result<Self> {
        let ([pages, h_kv, page_size, _], vd) = (k.dims(), v.dims());
        for (axis, found, expected) in [
            ("pages", vd[0], pages),
            ("heads", vd[1], h_kv),
            ("page rows", vd[2], page_size),
        ] {
            crate::check_dim(
                "V pages",
                axis,
                found,
                "K pages",
                expected,
                "K and V share pages",
            )?;
        }
        if page_size == 0 {
            return Err(Error::layout(
                "K pages",
                "a page holds no token (page_size must be at least 1)",
            ));
        }
        let batch = lens.len();
        let pages_per_seq = match (batch, block_table.len()) {
            (0, 0) => 0,
            (0, n) => {
                return Err(Error::layout(
                    "block_table",
                    format!("has {n} entries but there is no sequence"),
                ));
            }
            (b, n) if n % b != 0 => {
                return Err(Error::layout(
                    "block_table",
                    format!("has {n} entries, not a whole row of pages for each of {b} sequences"),
                ));
            }
            (b, n) => n / b,
        };
        for (s, &len) in lens.iter().enumerate() {
            let room = pages_per_seq.saturating_mul(page_size);
            if len > room {
                return Err(Error::capacity("sequence length in its pages", len, room));
            }
            let row = &block_table[s * pages_per_seq..(s + 1) * pages_per_seq];
            for &p in &row[..len.div_ceil(page_size)] {
                if p as usize >= pages {
                    return Err(Error::out_of_range(
                        "page of the block table",
                        p as usize,
                        pages,
                    ));
                }
            }
        }
        Ok(Self {
            k,
            v,
            block_table,
            pages_per_seq,
            lens,
        })
    }

    /// Sequences.
    pub fn batch(&self) -> usize {
        self.lens.len()
    }

    /// Each sequence's length in tokens.
    pub fn lens(&self) -> &'a [usize] {
        self.lens
    }

    /// Tokens a page.
    pub fn page_size(&self) -> usize {
        self.k.dims()[2]
    }

    /// Key/value heads.
    pub fn kv_heads(&self) -> usize {
        self.k.dims()[1]
    }

    /// Key width.
    pub fn d_k(&self) -> usize {
        self.k.dims()[3]
    }

    /// Value width.
    pub fn d_v(&self) -> usize {
        self.v.dims()[3]
    }

    /// The pool of keys, `[pages, h_kv, page_size, d_k]`.
    pub fn keys(&self) -> Tensor4Ref<'a, T> {
        self.k
    }

    /// The pool of values, `[pages, h_kv, page_size, d_v]`.
    pub fn values(&self) -> Tensor4Ref<'a, T> {
        self.v
    }

    /// The pages sequence `s` uses, in order (its block table row, cut to its length).
    pub fn pages(&self, s: usize) -> &'a [u32] {
        let row = &self.block_table[s * self.pages_per_seq..(s + 1) * self.pages_per_seq];
        &row[..self.lens[s].div_ceil(self.page_size())]
    }

    /// The rows `rows` (within `lens[s]`) of head `head` of sequence `s` in `pool` (this
    /// view's [`keys`](PagedKv::keys) or [`values`](PagedKv::values)), as runs that each
    /// lie in one page: `(first row, its rows)`, in order. Empty where `rows` leaves the
    /// sequence or `head` the pool.
    pub fn segments(
        &self,
        pool: Tensor4Ref<'a, T>,
        s: usize,
        head: usize,
        rows: Range<usize>,
    ) -> impl Iterator<Item = (usize, MatRef<'a, T>)> + 'a {
        let ps = self.page_size();
        let inside = s < self.batch() && rows.end <= self.lens[s] && head < pool.dims()[1];
        let pages = if inside { self.pages(s) } else { &[] };
        let rows = if inside { rows } else { 0..0 };
        let mut at = rows.start;
        core::iter::from_fn(move || {
            if at >= rows.end {
                return None;
            }
            let (page, offset) = (at / ps, at % ps);
            let n = (ps - offset).min(rows.end - at);
            let m = pool.head(pages[page] as usize, head).ok()?;
            let first = at;
            at += n;
            Some((first, m.subrows(offset, n)))
        })
    }
}

/// Checks a call of packed queries against paged keys: Q `[1, h_q, total_q, d_k]` with
/// sequence `s` on rows `cu_seqlens_q[s]..cu_seqlens_q[s + 1]` (its newest positions: it
/// attends the first `lens[s]` tokens of its pages, the queries aligned with the last of
/// them, so at most `lens[s]` of them), `h_q` a multiple of the pages' heads, and the options: no element-wise mask or
/// key padding (as for packed calls), causal masks, windows and ALiBi aligned bottom-right
/// unless every sequence has as many queries as tokens. Returns the shape (`n_q =
/// total_q`, `n_k` the longest sequence) and the scale.
///
/// ```
/// use attn_core::{validate_paged, Causal, Layout, Options, PagedKv, Tensor4Ref};
/// let pool = vec![0.0f32; 4 * 2 * 16 * 8]; // 4 pages of 16 tokens, 2 heads, d = 8
/// let pages = Tensor4Ref::from_layout(&pool, [4, 2, 16, 8], Layout::Bshd)?;
/// let (table, lens) = ([0, 1, 2, 3], [20, 5]);
/// let kv = PagedKv::new(pages, pages, &table, &lens)?;
/// let q = vec![0.0f32; 2 * 3 * 8]; // one decode step for sequence 0, two for sequence 1
/// let q = Tensor4Ref::from_layout(&q, [1, 2, 3, 8], Layout::Bshd)?;
/// let causal = Options::default().with_causal(Causal::BottomRight);
/// let (shape, _) = validate_paged(q, &[0, 1, 3], &kv, &causal)?;
/// assert_eq!((shape.head.n_q, shape.head.n_k), (3, 20));
/// let top_left = Options::default().with_causal(Causal::TopLeft);
/// assert!(validate_paged(q, &[0, 1, 3], &kv, &top_left).is_err());
/// # Ok::<(), attn_core::Error>(())
/// ```
pub fn validate_paged<T, U>(
    q: Tensor4Ref<'_, T>,
    cu_seqlens_q: &[usize],
    kv: &PagedKv<'_, U>,
    options: &Options<'_>,
) -> Result<(BatchShape, f32)> {
    let [b, h_q, total_q, d_k] = q.dims();
    if b != 1 {
        return Err(Error::layout(
            "Q",
            format!(
                "paged queries are one packed [1, heads, total, dim] view, but its batch axis has {b} entries"
            ),
        ));
    }
    crate::check_dim(
        "cu_seqlens_q",
        "entries",
        cu_seqlens_q.len(),
        "the pages' sequences",
        kv.batch() + 1,
        "one offset per sequence boundary, batch + 1",
    )?;
    crate::packed::check_offsets("cu_seqlens_q", cu_seqlens_q)?;
    let last = cu_seqlens_q[cu_seqlens_q.len() - 1];
    if last != total_q {
        return Err(Error::layout(
            "cu_seqlens_q",
            format!(
                "ends at {last} but Q has {total_q} packed rows (the last offset must be the total)"
            ),
        ));
    }
    let counts = cu_seqlens_q.windows(2).map(|w| w[1] - w[0]);
    let (mut shape, scale) = check_paged_queries(("cu_seqlens_q", h_q, d_k), counts, kv, options)?;
    shape.head.n_q = total_q;
    Ok((shape, scale))
}

/// [`validate_paged`] for queries `[batch, h_q, n_q, d_k]`, `n_q` of each sequence of the
/// pages (`batch` of them), its newest positions: a cache's call with a batch axis. The
/// shape's `n_q` is the queries' `n_q`. `[B, H, n_q, n_k]` masks are taken (checked
/// against the longest sequence, as for a batched call), `[n_q, n_k]` ones and key padding
/// are not.
///
/// ```
/// use attn_core::{validate_paged_batched, Layout, Options, PagedKv, Tensor4Ref};
/// let pool = vec![0.0f32; 2 * 16 * 8]; // 2 pages of 16 tokens, 1 head, d = 8
/// let pages = Tensor4Ref::from_layout(&pool, [2, 1, 16, 8], Layout::Bshd)?;
/// let (table, lens) = ([0, 1], [16, 9]);
/// let kv = PagedKv::new(pages, pages, &table, &lens)?;
/// let q = vec![0.0f32; 2 * 2 * 8]; // two sequences, two heads, one query each
/// let q = Tensor4Ref::from_layout(&q, [2, 2, 1, 8], Layout::Bhsd)?;
/// let (shape, _) = validate_paged_batched(q, &kv, &Options::default())?;
/// assert_eq!((shape.batch, shape.head.n_q, shape.head.n_k), (2, 1, 16));
/// # Ok::<(), attn_core::Error>(())
/// ```
pub fn validate_paged_batched<T, U>(
    q: Tensor4Ref<'_, T>,
    kv: &PagedKv<'_, U>,
    options: &Options<'_>,
) -> Result<(BatchShape, f32)> {
    let [b, h_q, n_q, d_k] = q.dims();
    crate::check_dim(
        "Q",
        "batch entries",
        b,
        "the pages' sequences",
        kv.batch(),
        "one batch entry a sequence",
    )?;
    let (mut shape, scale) =
        check_paged_queries(("Q", h_q, d_k), (0..b).map(|_| n_q), kv, options)?;
    (shape.batch, shape.head.n_q) = (b, n_q);
    Ok((shape, scale))
}

/// The checks [`validate_paged`] and [`validate_paged_batched`] share: `h_q` heads of
/// queries `d_k` wide, `counts[s]` of them for sequence `s` (as `counts_of` says), against
/// the pages.
fn check_paged_queries<U>(
    (counts_of, h_q, d_k): (&'static str, usize, usize),
    counts: impl Iterator<Item = usize> + Clone,
    kv: &PagedKv<'_, U>,
    options: &Options<'_>,
) -> Result<(BatchShape, f32)> {
    crate::check_dim("Q", "columns", d_k, "K pages", kv.d_k(), "d_k must match")?;
    if kv.d_k() == 0 {
        return Err(Error::EmptyKeyWidth);
    }
    let h_kv = kv.kv_heads();
    if h_kv == 0 || !h_q.is_multiple_of(h_kv) {
        return Err(Error::head_grouping(h_q, h_kv));
    }
    for (s, (count, &n)) in counts.clone().zip(kv.lens()).enumerate() {
        if count > n {
            return Err(Error::layout(
                counts_of,
                format!(
                    "gives sequence {s} {count} queries but its pages hold {n} tokens (the queries are the sequence's newest tokens: append their keys and values first)"
                ),
            ));
        }
    }
    if options.has_elementwise_mask() || options.key_padding.is_some() {
        return Err(Error::unsupported(
            "paged options",
            "element-wise masks and key padding have no meaning for paged sequences (each sequence attends its own tokens; causal alignment and windows apply per sequence)",
        ));
    }
    let top_left = options.causal == Some(Causal::TopLeft)
        || options.window.is_some_and(|w| w.align == Causal::TopLeft)
        || options.alibi.is_some_and(|a| a.align() == Causal::TopLeft);
    let newest = counts.zip(kv.lens()).any(|(count, &n)| count != n);
    if top_left && newest {
        return Err(Error::unsupported(
            "paged alignment",
            "the queries are each sequence's newest positions: align causal masks, windows and ALiBi bottom-right (Causal::TopLeft would make them the oldest)",
        ));
    }
    options.check_modifiers(kv.batch(), h_q)?;
    options.reject_dropout("paged attention")?;
    let scale = options.scale_for(d_k)?;
    let n_k = kv.lens().iter().copied().max().unwrap_or(0);
    let head = HeadShape {
        n_q: 0,
        n_k,
        d_k,
        d_v: kv.d_v(),
    };
    let shape = BatchShape {
        batch: 1,
        h_q,
        h_kv,
        head,
    };
    Ok((shape, scale))
}

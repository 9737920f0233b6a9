//! A key/value cache for autoregressive decoding.
//!
//! Training attends every position in one causal pass; generation appends one token at a
//! time and attends its query against everything cached so far. The cache stores K and V
//! per layer as `[batch, kv_heads, capacity, d]` in the storage type `T` (f32, f16, bf16),
//! with a valid length per batch entry (ragged batches). [`KvCache::attention`] runs the
//! streaming engine on the cached prefix of each entry; with few heads the grid splits the
//! keys into fixed chunks (flash-decoding) and merges the partial states in order.

use attn_core::{
    Causal, Error, KvQuantization, Layout, Options, PagedKv, QuantizedKv, Result, Tensor4Ref,
};

use crate::call::{Attention, Batch};
use crate::code_pools::CodePools;
use crate::kernel::element::{Element, ZeroBits};
use crate::problem::{Batched, PagedBatch, filled, zeroed};

/// What happens when an append does not fit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Growth {
    /// Appending past the capacity is an [`Error::Capacity`]; the cache never reallocates.
    #[default]
    Fixed,
    /// The capacity doubles (at least to what the append needs): one reallocation and copy
    /// of the whole cache, amortised over the appends that fill it. A capacity that cannot
    /// be allocated is an [`Error::Allocation`] and leaves the cache as it was.
    Double,
}

/// Keys and values of one attention layer for a batch of sequences being generated.
///
/// ```
/// use attn_optimized::{Causal, KvCache, Layout, Options, Par, Tensor4Ref};
/// // Batch of 1, 2 kv heads, room for 8 tokens, d_k = d_v = 4.
/// let mut cache = KvCache::<f32>::new(1, 2, 8, 4, 4)?;
/// let prompt = vec![0.5f32; 2 * 3 * 4]; // 3 tokens, [B,S,H,D]
/// let kv = Tensor4Ref::from_layout(&prompt, [1, 2, 3, 4], Layout::Bshd)?;
/// cache.append(kv, kv)?;
/// assert_eq!(cache.len(0), 3);
/// let q = vec![1.0f32; 4 * 4]; // one new token, 4 query heads (GQA over 2 kv heads)
/// let q = Tensor4Ref::from_layout(&q, [1, 4, 1, 4], Layout::Bshd)?;
/// let opts = Options::default().with_causal(Causal::BottomRight);
/// let out = cache.attention(q, &opts)?.forward(Par::rayon(0))?.into_output();
/// assert_eq!(out.dims(), [1, 4, 1, 4]);
/// assert!(out.as_slice().iter().all(|&x| (x - 0.5).abs() < 1e-6));
/// # Ok::<(), attn_optimized::Error>(())
/// ```
#[derive(Debug, Clone)]
pub struct KvCache<T> {
    batch: usize,
    kv_heads: usize,
    capacity: usize,
    d_k: usize,
    d_v: usize,
    k: Vec<T>,
    v: Vec<T>,
    lens: Vec<usize>,
    growth: Growth,
    /// The pools of a quantized cache (whose `k` and `v` are then empty): rows
    /// `[batch, kv_heads, capacity]`.
    codes: Option<CodePools>,
    /// Batch entry `b` as page `b` of one `capacity`-token page (the quantized view).
    table: Vec<u32>,
}

impl<T: Element> KvCache<T> {
    /// An empty cache for `batch` sequences of `kv_heads` heads, room for `capacity`
    /// tokens each, keys of width `d_k` and values of width `d_v`; [`Error::Allocation`]
    /// when its buffers cannot be allocated.
    pub fn new(
        batch: usize,
        kv_heads: usize,
        capacity: usize,
        d_k: usize,
        d_v: usize,
    ) -> Result<Self> {
        if d_k == 0 {
            return Err(Error::EmptyKeyWidth);
        }
        Ok(Self {
            batch,
            kv_heads,
            capacity,
            d_k,
            d_v,
            k: zeroed("KV cache keys", &[batch, kv_heads, capacity, d_k])?,
            v: zeroed("KV cache values", &[batch, kv_heads, capacity, d_v])?,
            lens: filled("KV cache lengths", Some(batch), 0)?,
            growth: Growth::Fixed,
            codes: None,
            table: Vec::new(),
        })
    }

    /// An empty cache like [`KvCache::new`] that stores keys and values quantized
    /// ([`KvQuantization`]: one-byte codes and a scale per token and head, keys shifted and
    /// divided per channel first if the format says so), read in place by attention:
    /// decoding streams about half the bytes of an f16 cache. Appending a non-finite
    /// entry is an error (no code holds it); the queries of
    /// [`attention`](KvCache::attention) must be at most each entry's length.
    ///
    /// ```
    /// use attn_optimized::{KvCache, KvCodes, KvQuantization, Layout, Options, Par, Tensor4Ref};
    /// let fp8 = KvQuantization::new(KvCodes::Fp8E4m3);
    /// let mut cache = KvCache::<f32>::quantized(1, 2, 64, 16, 16, fp8)?;
    /// let kv: Vec<f32> = (0..2 * 10 * 16).map(|i| ((i * 5) % 9) as f32 * 0.25).collect();
    /// let kv = Tensor4Ref::from_layout(&kv, [1, 2, 10, 16], Layout::Bshd)?;
    /// cache.append(kv, kv)?;
    /// let q = vec![0.2f32; 4 * 16];
    /// let q = Tensor4Ref::from_layout(&q, [1, 4, 1, 16], Layout::Bshd)?;
    /// let out = cache.attention(q, &Options::default())?.forward(Par::rayon(0))?;
    /// assert_eq!(out.output().dims(), [1, 4, 1, 16]);
    /// # Ok::<(), attn_optimized::Error>(())
    /// ```
    pub fn quantized(
        batch: usize,
        kv_heads: usize,
        capacity: usize,
        d_k: usize,
        d_v: usize,
        format: KvQuantization,
    ) -> Result<Self> {
        let mut cache = Self::new(batch, kv_heads, 0, d_k, d_v)?;
        cache.capacity = capacity;
        let slots = [batch, kv_heads, capacity];
        cache.codes = Some(CodePools::new(format, &slots, kv_heads, (d_k, d_v))?);
        cache.table = (0..batch)
            .map(|b| {
                u32::try_from(b).map_err(|_| Error::capacity("batch entries", b, u32::MAX as usize))
            })
            .collect::<Result<_>>()?;
        Ok(cache)
    }

    /// How the cache stores keys and values: `None` as `T`, else quantized.
    pub fn quantization(&self) -> Option<KvQuantization> {
        self.codes.as_ref().map(|c| c.format)
    }

    /// Sets the growth policy (default [`Growth::Fixed`]).
    pub fn with_growth(mut self, growth: Growth) -> Self {
        self.growth = growth;
        self
    }

    /// Tokens cached for batch entry `b` (0 for an index out of range).
    pub fn len(&self, b: usize) -> usize {
        self.lens.get(b).copied().unwrap_or(0)
    }

    /// Whether no batch entry has any token.
    pub fn is_empty(&self) -> bool {
        self.lens.iter().all(|&l| l == 0)
    }

    /// Tokens cached per batch entry.
    pub fn lens(&self) -> &[usize] {
        &self.lens
    }

    /// Tokens each batch entry can hold without growing.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// `[batch, kv_heads, capacity, d_k]`.
    pub fn dims(&self) -> [usize; 4] {
        [self.batch, self.kv_heads, self.capacity, self.d_k]
    }

    /// Forgets the tokens of batch entry `b` (its storage is kept).
    pub fn clear(&mut self, b: usize) -> Result<()> {
        let len = self.batch;
        *self
            .lens
            .get_mut(b)
            .ok_or(Error::out_of_range("batch", b, len))? = 0;
        Ok(())
    }

    /// The cached keys as a `[batch, kv_heads, capacity, d_k]` view (rows past each
    /// entry's length are stale); of no rows for a quantized cache, whose rows are codes
    /// ([`KvCache::quantized_kv`]).
    pub fn keys(&self) -> Tensor4Ref<'_, T> {
        self.view(&self.k, self.d_k, self.element_rows())
    }

    /// The cached values as a `[batch, kv_heads, capacity, d_v]` view (of no rows for a
    /// quantized cache).
    pub fn values(&self) -> Tensor4Ref<'_, T> {
        self.view(&self.v, self.d_v, self.element_rows())
    }

    /// Rows of the element pools: none in a quantized cache.
    fn element_rows(&self) -> usize {
        if self.codes.is_some() {
            0
        } else {
            self.capacity
        }
    }

    /// A pool `data` as `[batch, kv_heads, rows, d]`.
    fn view<'s, U>(&self, data: &'s [U], d: usize, rows: usize) -> Tensor4Ref<'s, U> {
        Tensor4Ref::from_layout(data, [self.batch, self.kv_heads, rows, d], Layout::Bhsd)
            .expect("the cache's own buffer fits its dims")
    }

    /// A quantized cache's codes and scales as the view the engines read: entry `b` is
    /// page `b`, one page of `capacity` tokens. An error for a cache of elements.
    pub fn quantized_kv(&self) -> Result<QuantizedKv<'_>> {
        let Some(c) = &self.codes else {
            return Err(Error::unsupported(
                "quantized pages",
                "this cache stores its elements: KvCache::keys and KvCache::values",
            ));
        };
        let cap = self.capacity;
        let codes = PagedKv::new(
            self.view(&c.k, self.d_k, cap),
            self.view(&c.v, self.d_v, cap),
            &self.table,
            &self.lens,
        )?;
        let scales = PagedKv::new(
            self.view(&c.k_scales, 1, cap),
            self.view(&c.v_scales, 1, cap),
            &self.table,
            &self.lens,
        )?;
        QuantizedKv::new(codes, scales, c.channels(self.kv_heads, self.d_k), c.format)
    }

    /// Appends `t` tokens to every batch entry: `k : [batch, kv_heads, t, d_k]`,
    /// `v : [batch, kv_heads, t, d_v]` (any layout). On error nothing is appended: more
    /// tokens than fit is an [`Error::Capacity`] (with `requested: usize::MAX` when the
    /// count overflows `usize`), a growth that cannot be allocated an [`Error::Allocation`].
    pub fn append(&mut self, k: Tensor4Ref<'_, T>, v: Tensor4Ref<'_, T>) -> Result<()> {
        self.check_tokens(k, v, self.batch)?;
        let t = k.dims()[2];
        let longest = self.lens.iter().copied().max().unwrap_or(0);
        self.reserve(longest.checked_add(t))?;
        for b in 0..self.batch {
            self.write(b, b, k, v)?;
        }
        Ok(())
    }

    /// Appends `t` tokens to batch entry `b` only: `k : [1, kv_heads, t, d_k]`,
    /// `v : [1, kv_heads, t, d_v]`. On error nothing is appended.
    pub fn append_to(
        &mut self,
        b: usize,
        k: Tensor4Ref<'_, T>,
        v: Tensor4Ref<'_, T>,
    ) -> Result<()> {
        if b >= self.batch {
            return Err(Error::out_of_range("batch", b, self.batch));
        }
        self.check_tokens(k, v, 1)?;
        self.reserve(self.lens[b].checked_add(k.dims()[2]))?;
        self.write(b, 0, k, v)
    }

    fn check_tokens(&self, k: Tensor4Ref<'_, T>, v: Tensor4Ref<'_, T>, batch: usize) -> Result<()> {
        check_new_tokens(k, Some(v), [batch, self.kv_heads, self.d_k, self.d_v])?;
        if self.codes.is_some() {
            CodePools::check_finite(&[k, v])?;
        }
        Ok(())
    }

    /// Makes room for `need` tokens per entry (`None`: a count that overflowed), or fails
    /// without changing anything.
    fn reserve(&mut self, need: Option<usize>) -> Result<()> {
        let full = |need| Error::capacity("KV cache tokens per batch entry", need, self.capacity);
        let need = need.ok_or_else(|| full(usize::MAX))?;
        if need <= self.capacity {
            return Ok(());
        }
        if self.growth == Growth::Fixed {
            return Err(full(need));
        }
        let new_cap = need.max(self.capacity.saturating_mul(2));
        let blocks = [self.batch, self.kv_heads];
        let grow = |old_cap| (blocks, old_cap, new_cap);
        // Every new buffer is allocated before any replaces the old one.
        // A quantized cache keeps its rows in codes: its element pools stay empty.
        let quantized = self.codes.is_some();
        let (d_k, d_v) = if quantized {
            (0, 0)
        } else {
            (self.d_k, self.d_v)
        };
        let k = regrow("KV cache keys", &self.k, d_k, grow(self.capacity))?;
        let v = regrow("KV cache values", &self.v, d_v, grow(self.capacity))?;
        let codes = match &self.codes {
            Some(c) => Some(c.with_rows(
                (
                    regrow("KV cache key codes", &c.k, self.d_k, grow(self.capacity))?,
                    regrow("KV cache value codes", &c.v, self.d_v, grow(self.capacity))?,
                ),
                [
                    regrow("KV cache key scales", &c.k_scales, 1, grow(self.capacity))?,
                    regrow("KV cache value scales", &c.v_scales, 1, grow(self.capacity))?,
                ],
            )),
            None => None,
        };
        (self.k, self.v, self.capacity) = (k, v, new_cap);
        self.codes = codes;
        Ok(())
    }

    /// Copies the tokens of `src_b` in `k`/`v` after the cached ones of entry `b`.
    fn write(
        &mut self,
        b: usize,
        src_b: usize,
        k: Tensor4Ref<'_, T>,
        v: Tensor4Ref<'_, T>,
    ) -> Result<()> {
        let (t, start) = (k.dims()[2], self.lens[b]);
        if let Some(codes) = &mut self.codes {
            let (heads, cap) = (self.kv_heads, self.capacity);
            codes.write((k, Some(v)), src_b, |h, i| {
                (b * heads + h) * cap + start + i
            })?;
            self.lens[b] = start + t;
            return Ok(());
        }
        for h in 0..self.kv_heads {
            for (buf, src, d) in [(&mut self.k, k, self.d_k), (&mut self.v, v, self.d_v)] {
                let src = src.head(src_b, h)?;
                let base = ((b * self.kv_heads + h) * self.capacity + start) * d;
                for (i, row) in buf[base..base + t * d]
                    .chunks_exact_mut(d.max(1))
                    .enumerate()
                {
                    for (c, x) in row.iter_mut().enumerate() {
                        *x = src[(i, c)];
                    }
                }
            }
        }
        self.lens[b] = start + t;
        Ok(())
    }

    /// The call of new queries `q : [batch, h_q, n_q, d_k]` (`h_q` a multiple of the kv
    /// heads) against each entry's cached tokens, which must already include the new ones;
    /// run it with [`Attention::forward`](crate::Attention::forward) (or `_into`). The
    /// queries are the newest positions of each entry: query `i` is position
    /// `len − n_q + i`, and a causal mask, a window or ALiBi is aligned bottom-right
    /// (`Causal::BottomRight`: query `i` sees the keys up to position `len − n_q + i`).
    /// `Causal::TopLeft` would mean the oldest positions instead: it is an error
    /// ([`Error::Unsupported`]) unless every entry holds exactly `n_q` tokens, where both
    /// alignments agree.
    ///
    /// Scale, causal alignment, sliding window and score modifiers are honoured, and so are
    /// `[B, H, n_q, n_k]` masks ([`Options::with_bool_mask_4d`],
    /// [`Options::with_additive_mask_4d`]) whose key axis spans the longest entry (or
    /// broadcasts): entry `b` reads its first `len_b` columns. `[n_q, n_k]` masks and key
    /// padding are rejected (the cache's lengths are the padding). With few heads the keys
    /// are split into fixed chunks (flash-decoding, [`Attention::split_kv`](crate::Attention::split_kv)).
    ///
    /// ```
    /// use attn_optimized::{BoolMask4, KvCache, Layout, Mask4Ref, Options, Par, Tensor4Ref};
    /// let mut cache = KvCache::<f32>::new(1, 1, 4, 2, 2)?;
    /// let k = [0.0f32; 6];
    /// let v = [1.0f32, 1.0, 2.0, 2.0, 3.0, 3.0]; // three tokens with values 1, 2, 3
    /// let (k, v) = (Tensor4Ref::from_layout(&k, [1, 1, 3, 2], Layout::Bhsd)?, Tensor4Ref::from_layout(&v, [1, 1, 3, 2], Layout::Bhsd)?);
    /// cache.append(k, v)?;
    /// let q = [1.0f32; 4]; // one query for each of 2 heads
    /// let q = Tensor4Ref::from_layout(&q, [1, 2, 1, 2], Layout::Bhsd)?;
    /// // Head 0 sees only the first token, head 1 only the last one.
    /// let bits = [true, false, false, false, false, true];
    /// let mask = BoolMask4::allow(Mask4Ref::contiguous(&bits, [1, 2, 1, 3])?);
    /// let opts = Options::default().with_bool_mask_4d(mask);
    /// let fwd = cache.attention(q, &opts)?.forward(Par::rayon(0))?;
    /// assert_eq!(fwd.output().as_slice(), [1.0, 1.0, 3.0, 3.0]);
    /// # Ok::<(), attn_optimized::Error>(())
    /// ```
    ///
    /// One query against three cached tokens, aligned top-left, would see only the first:
    ///
    /// ```
    /// use attn_optimized::{Causal, Error, KvCache, Layout, Options, Tensor4Ref};
    /// let mut cache = KvCache::<f32>::new(1, 1, 4, 2, 2)?;
    /// let kv = vec![0.0f32; 3 * 2];
    /// let kv = Tensor4Ref::from_layout(&kv, [1, 1, 3, 2], Layout::Bhsd)?;
    /// cache.append(kv, kv)?;
    /// let q = vec![1.0f32, 1.0];
    /// let q = Tensor4Ref::from_layout(&q, [1, 1, 1, 2], Layout::Bhsd)?;
    /// let err = cache.attention(q, &Options::default().with_causal(Causal::TopLeft)).unwrap_err();
    /// assert!(matches!(err, Error::Unsupported { .. }));
    /// assert!(cache.attention(q, &Options::default().with_causal(Causal::BottomRight)).is_ok());
    /// # Ok::<(), attn_optimized::Error>(())
    /// ```
    pub fn attention<'a>(
        &'a self,
        q: Tensor4Ref<'a, T>,
        options: &Options<'a>,
    ) -> Result<Attention<'a, T, Batch>> {
        if options.bool_mask.is_some()
            || options.additive_mask.is_some()
            || options.key_padding.is_some()
        {
            return Err(Error::unsupported(
                "KV cache attend options",
                "[n_q, n_k] masks and key padding are not accepted; use [B, H, n_q, n_k] masks, causal alignment and windows (the cache lengths pad each entry)",
            ));
        }
        let [b, h_q, n_q, d_k] = q.dims();
        let mismatch = |operand, axis, found, expected, rule| {
            Error::mismatch(operand, axis, found, "the cache", expected, rule)
        };
        if b != self.batch {
            return Err(mismatch(
                "Q",
                "batch entries",
                b,
                self.batch,
                "batch must match",
            ));
        }
        if d_k != self.d_k {
            return Err(mismatch("Q", "columns", d_k, self.d_k, "d_k must match"));
        }
        if self.kv_heads == 0 || !h_q.is_multiple_of(self.kv_heads) {
            return Err(Error::head_grouping(h_q, self.kv_heads));
        }
        options.reject_dropout("KvCache")?;
        let top_left = options.causal == Some(Causal::TopLeft)
            || options.window.is_some_and(|w| w.align == Causal::TopLeft)
            || options.alibi.is_some_and(|a| a.align() == Causal::TopLeft);
        if top_left && self.lens.iter().any(|&len| len != n_q) {
            return Err(Error::unsupported(
                "KV cache alignment",
                "the queries are the newest positions: align causal masks, windows and ALiBi bottom-right (Causal::TopLeft would make them the oldest)",
            ));
        }
        if self.codes.is_some() {
            let call = PagedBatch::batched(q, self.quantized_kv()?, options)?;
            return Ok(Attention::cached_quantized(call, options));
        }
        let longest = self.lens.iter().copied().max().unwrap_or(0);
        let scale = options.validate_batched(b, h_q, n_q, longest, d_k)?;
        let (keys, values) = (self.keys(), self.values());
        let batch = Batched::cached(q, keys, values, &self.lens, options, scale)?;
        Ok(Attention::cached(batch, options))
    }
}

/// `old` (blocks `[batch, heads]` of `old_cap` rows of `d` entries) in blocks of `new_cap`
/// rows, or [`Error::Allocation`] naming `what`.
fn regrow<U: ZeroBits>(
    what: &'static str,
    old: &[U],
    d: usize,
    ([batch, heads], old_cap, new_cap): ([usize; 2], usize, usize),
) -> Result<Vec<U>> {
    let mut new = zeroed(what, &[batch, heads, new_cap, d])?;
    // Nothing to copy (and `old_cap · d` may not even fit usize when no entry or head
    // holds it) unless the old buffer has elements.
    if !old.is_empty() {
        // Each (entry, head) block of `old_cap` rows starts a block of `new_cap`.
        for (src, dst) in old.chunks(old_cap * d).zip(new.chunks_mut(new_cap * d)) {
            dst[..src.len()].copy_from_slice(src);
        }
    }
    Ok(new)
}

/// Checks new tokens against a cache of `batch` entries of `kv_heads` heads, keys `d_k`
/// and values `d_v` wide: `k : [batch, kv_heads, t, d_k]`, `v : [batch, kv_heads, t, d_v]`
/// (`None` for a latent cache's rows, whose values are their keys' first columns).
pub(crate) fn check_new_tokens<T>(
    k: Tensor4Ref<'_, T>,
    v: Option<Tensor4Ref<'_, T>>,
    [batch, kv_heads, d_k, d_v]: [usize; 4],
) -> Result<()> {
    let [bk, hk, tk, dk] = k.dims();
    let [bv, hv, tv, dv] = v.map_or([bk, hk, tk, d_v], |v| v.dims());
    let cache = |operand, axis, found, expected, rule| {
        attn_core::check_dim(operand, axis, found, "the cache", expected, rule)
    };
    let per_entry = "one block of tokens per batch entry";
    cache("new K", "batch entries", bk, batch, per_entry)?;
    cache("new V", "batch entries", bv, batch, per_entry)?;
    cache("new K", "heads", hk, kv_heads, "kv heads must match")?;
    cache("new V", "heads", hv, kv_heads, "kv heads must match")?;
    cache("new K", "columns", dk, d_k, "d_k must match")?;
    cache("new V", "columns", dv, d_v, "d_v must match")?;
    attn_core::check_dim(
        "new V",
        "tokens",
        tv,
        "new K",
        tk,
        "K and V carry the same tokens",
    )
}

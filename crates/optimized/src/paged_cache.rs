//! A paged key/value cache for serving: one pool of fixed-size pages per layer, a block
//! table per sequence, sequences created, extended, forked and freed while others decode.
//!
//! [`crate::KvCache`] gives each batch entry one contiguous buffer of a fixed capacity.
//! Serving many sequences of unknown lengths wants what vLLM's PagedAttention does: memory
//! that grows with the tokens in use, a prefix shared between sequences without copying,
//! and one call over a batch that mixes prefill chunks and decode steps. The pool holds
//! K and V as `[kv_heads, pages, page_size, d]`: each head's pages in a region of their
//! own, each page's rows contiguous, so that decoding streams one head's pages (pages
//! handed out in order are one stream). A page is shared by the sequences whose prefix it
//! holds and returns to the pool with its last user. The engines read the pages in
//! place through [`PagedKv`] ([`crate::Attention::paged`]).

use attn_core::{Error, KvQuantization, Options, PagedKv, QuantizedKv, Result, Tensor4Ref};

use crate::call::{Attention, Batch};
use crate::code_pools::CodePools;
use crate::kernel::element::Element;
use crate::kv_cache::check_new_tokens;
use crate::problem::zeroed;

/// A sequence of a [`PagedKvCache`]: a handle, valid until the sequence is freed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct SeqId(usize);

/// One sequence's pages and length.
#[derive(Debug, Clone, Default)]
struct Sequence {
    pages: Vec<u32>,
    len: usize,
}

/// Keys and values of one attention layer in pages, for sequences that come and go.
///
/// ```
/// use attn_optimized::{Causal, Layout, Options, PagedKvCache, Par, Tensor4Ref};
/// // 64 pages of 16 tokens, 2 kv heads, d = 8.
/// let mut cache = PagedKvCache::<f32>::new(64, 16, 2, 8, 8)?;
/// let a = cache.add_sequence()?;
/// let prompt = vec![0.5f32; 2 * 20 * 8]; // 20 tokens, [1, h_kv, t, d] in [B,S,H,D]
/// let kv = Tensor4Ref::from_layout(&prompt, [1, 2, 20, 8], Layout::Bshd)?;
/// cache.append(a, kv, kv)?;
/// let b = cache.fork(a)?; // shares the full page, copies the partial one
/// assert_eq!((cache.len(b)?, cache.free_pages()), (20, 64 - 3));
/// // One decode step for each: append the new token's K and V, then attend.
/// let token = vec![1.0f32; 2 * 8];
/// let token = Tensor4Ref::from_layout(&token, [1, 2, 1, 8], Layout::Bshd)?;
/// cache.append(a, token, token)?;
/// cache.append(b, token, token)?;
/// let q = vec![0.1f32; 2 * 4 * 8]; // two tokens (one a sequence), 4 query heads
/// let q = Tensor4Ref::from_layout(&q, [1, 4, 2, 8], Layout::Bshd)?;
/// let batch = cache.batch(&[a, b])?;
/// let opts = Options::default().with_causal(Causal::BottomRight);
/// let out = batch.attention(q, &[0, 1, 2], &opts)?.forward(Par::rayon(0))?;
/// assert_eq!(out.output().dims(), [1, 4, 2, 8]);
/// cache.free(b)?;
/// assert_eq!(cache.free_pages(), 64 - 2);
/// # Ok::<(), attn_optimized::Error>(())
/// ```
#[derive(Debug, Clone)]
pub struct PagedKvCache<T> {
    pages: usize,
    page_size: usize,
    kv_heads: usize,
    d_k: usize,
    d_v: usize,
    k: Vec<T>,
    /// Empty in a latent cache, whose values are the first `d_v` columns of its keys.
    v: Vec<T>,
    latent: bool,
    /// The pools of a quantized cache (whose `k` and `v` are then empty): rows
    /// `[kv_heads, pages, page_size]` as the element pools'.
    codes: Option<CodePools>,
    /// Users of each page (0: free).
    users: Vec<u32>,
    /// Pages with no user.
    free: usize,
    /// Which stretches of pages ([`map_stretch`]) have been written once.
    mapped: Vec<bool>,
    /// Slot per sequence handle; `None` once freed.
    seqs: Vec<Option<Sequence>>,
}

impl<T: Element> PagedKvCache<T> {
    /// An empty cache of `pages` pages of `page_size` tokens for `kv_heads` heads of keys
    /// `d_k` wide and values `d_v` wide, reserved now (fallibly: a pool that cannot be
    /// held is an [`Error::Allocation`]) from zeroed memory that is mapped 2 MiB of each
    /// head's pool at a time as pages are first handed out: the memory in use grows with
    /// the pages in use.
    pub fn new(
        pages: usize,
        page_size: usize,
        kv_heads: usize,
        d_k: usize,
        d_v: usize,
    ) -> Result<Self> {
        Self::with_pools(pages, page_size, kv_heads, (d_k, d_v), false)
    }

    /// An empty latent cache (DeepSeek's multi-head latent attention): one buffer per
    /// token and head, `d_k` wide, that is the key, and whose first `d_v ≤ d_k` columns are
    /// the value — stored once ([`PagedKvCache::append_latent`]), read as both.
    ///
    /// ```
    /// use attn_optimized::{Layout, Options, PagedKvCache, Par, Tensor4Ref};
    /// // 576-wide latent rows whose first 512 columns are the values, one K/V head.
    /// let mut cache = PagedKvCache::<f32>::latent(8, 16, 1, 576, 512)?;
    /// let s = cache.add_sequence()?;
    /// let latent = vec![0.25f32; 20 * 576];
    /// cache.append_latent(s, Tensor4Ref::from_layout(&latent, [1, 1, 20, 576], Layout::Bshd)?)?;
    /// let q = vec![0.1f32; 16 * 576]; // 16 query heads, one decode step
    /// let q = Tensor4Ref::from_layout(&q, [1, 16, 1, 576], Layout::Bshd)?;
    /// let batch = cache.batch(&[s])?;
    /// let out = batch.attention(q, &[0, 1], &Options::default())?.forward(Par::rayon(0))?;
    /// assert_eq!(out.output().dims(), [1, 16, 1, 512]);
    /// # Ok::<(), attn_optimized::Error>(())
    /// ```
    pub fn latent(
        pages: usize,
        page_size: usize,
        kv_heads: usize,
        d_k: usize,
        d_v: usize,
    ) -> Result<Self> {
        if d_v > d_k {
            return Err(Error::mismatch(
                "latent values",
                "columns",
                d_v,
                "the latent keys",
                d_k,
                "the values are a column prefix of the keys",
            ));
        }
        Self::with_pools(pages, page_size, kv_heads, (d_k, d_v), true)
    }

    /// An empty cache like [`PagedKvCache::new`] that stores keys and values quantized
    /// ([`KvQuantization`]): each appended row of a head as one-byte codes and an f32 scale
    /// (and keys shifted and divided per channel first, if the format has them: each
    /// channel's mean and spread in the first keys appended, per head). Appending a
    /// non-finite entry is an error (no code holds it). Attention reads the codes in place
    /// ([`Attention::quantized`]): decoding streams about half the bytes of an f16 cache.
    ///
    /// ```
    /// use attn_optimized::{KvCodes, KvQuantization, Layout, Options, PagedKvCache, Par, Tensor4Ref};
    /// let int8 = KvQuantization::new(KvCodes::Int8).with_key_channels();
    /// let mut cache = PagedKvCache::<f32>::quantized(64, 16, 2, 16, 16, int8)?;
    /// let s = cache.add_sequence()?;
    /// let kv: Vec<f32> = (0..2 * 40 * 16).map(|i| ((i * 7) % 11) as f32 - 5.0).collect();
    /// let kv = Tensor4Ref::from_layout(&kv, [1, 2, 40, 16], Layout::Bshd)?;
    /// cache.append(s, kv, kv)?;
    /// let q = vec![0.1f32; 4 * 16]; // one decode step, 4 query heads
    /// let q = Tensor4Ref::from_layout(&q, [1, 4, 1, 16], Layout::Bshd)?;
    /// let batch = cache.batch(&[s])?;
    /// let out = batch.attention(q, &[0, 1], &Options::default())?.forward(Par::rayon(0))?;
    /// assert_eq!(out.output().dims(), [1, 4, 1, 16]);
    /// // Codes and scales: about a quarter of the f32 pool.
    /// assert_eq!(cache.pool_bytes(), 64 * 16 * 2 * (2 * 16 + 2 * 4) + 2 * 2 * 16 * 4);
    /// # Ok::<(), attn_optimized::Error>(())
    /// ```
    pub fn quantized(
        pages: usize,
        page_size: usize,
        kv_heads: usize,
        d_k: usize,
        d_v: usize,
        format: KvQuantization,
    ) -> Result<Self> {
        let mut cache = Self::with_pools(pages, page_size, kv_heads, (0, 0), false)?;
        (cache.d_k, cache.d_v) = (d_k, d_v);
        let slots = [kv_heads, pages, page_size];
        cache.codes = Some(CodePools::new(format, &slots, kv_heads, (d_k, d_v))?);
        cache.mapped = attn_core::filled(
            "paged cache pages",
            Some(pages.div_ceil(cache.stretch())),
            false,
        )?;
        Ok(cache)
    }

    /// How the cache stores keys and values: `None` as `T`, else quantized.
    pub fn quantization(&self) -> Option<KvQuantization> {
        self.codes.as_ref().map(|c| c.format)
    }

    fn with_pools(
        pages: usize,
        page_size: usize,
        kv_heads: usize,
        (d_k, d_v): (usize, usize),
        latent: bool,
    ) -> Result<Self> {
        if page_size == 0 {
            return Err(Error::layout(
                "paged cache",
                "a page holds no token (page_size must be at least 1)",
            ));
        }
        if pages > u32::MAX as usize {
            return Err(Error::capacity(
                "pages of a paged cache",
                pages,
                u32::MAX as usize,
            ));
        }
        let k = zeroed("paged cache keys", &[kv_heads, pages, page_size, d_k])?;
        let v_pages = if latent { 0 } else { pages };
        let v = zeroed("paged cache values", &[kv_heads, v_pages, page_size, d_v])?;
        let users = attn_core::filled("paged cache pages", Some(pages), 0u32)?;
        let stretch = map_stretch(page_size * d_k * size_of::<T>());
        let mapped = attn_core::filled("paged cache pages", Some(pages.div_ceil(stretch)), false)?;
        Ok(Self {
            pages,
            page_size,
            kv_heads,
            d_k,
            d_v,
            k,
            v,
            latent,
            codes: None,
            users,
            free: pages,
            mapped,
            seqs: Vec::new(),
        })
    }

    /// Bytes of keys and values the pool holds room for (all its pages; memory is mapped
    /// as pages are first written). A latent cache stores one buffer per token.
    ///
    /// ```
    /// use attn_optimized::PagedKvCache;
    /// let (kv, latent) = (
    ///     PagedKvCache::<f32>::new(4, 16, 1, 576, 512)?,
    ///     PagedKvCache::<f32>::latent(4, 16, 1, 576, 512)?,
    /// );
    /// assert_eq!(kv.pool_bytes(), 4 * 16 * (576 + 512) * 4);
    /// assert_eq!(latent.pool_bytes(), 4 * 16 * 576 * 4);
    /// # Ok::<(), attn_optimized::Error>(())
    /// ```
    pub fn pool_bytes(&self) -> usize {
        let codes = self.codes.as_ref().map_or(0, CodePools::bytes);
        (self.k.len() + self.v.len()) * size_of::<T>() + codes
    }

    /// Pages in [`MAP_BYTES`] of one head's key pool.
    fn stretch(&self) -> usize {
        let unit = if self.codes.is_some() {
            1
        } else {
            size_of::<T>()
        };
        map_stretch(self.page_size * self.d_k * unit)
    }

    /// Tokens a page.
    pub fn page_size(&self) -> usize {
        self.page_size
    }

    /// Pages not used by any sequence.
    pub fn free_pages(&self) -> usize {
        self.free
    }

    /// A new, empty sequence.
    pub fn add_sequence(&mut self) -> Result<SeqId> {
        self.seqs
            .try_reserve(1)
            .map_err(|_| Error::allocation_of::<Sequence>("paged cache sequences", None))?;
        self.seqs.push(Some(Sequence::default()));
        Ok(SeqId(self.seqs.len() - 1))
    }

    fn seq(&self, id: SeqId) -> Result<&Sequence> {
        match self.seqs.get(id.0) {
            Some(Some(s)) => Ok(s),
            _ => Err(Error::out_of_range("live sequence", id.0, self.seqs.len())),
        }
    }

    /// The tokens sequence `id` holds.
    pub fn len(&self, id: SeqId) -> Result<usize> {
        self.seq(id).map(|s| s.len)
    }

    /// The pages sequence `id` uses, in order.
    pub fn pages_of(&self, id: SeqId) -> Result<&[u32]> {
        self.seq(id).map(|s| &s.pages[..])
    }

    /// Appends `t` tokens to sequence `id`: `k : [1, kv_heads, t, d_k]`,
    /// `v : [1, kv_heads, t, d_v]` (any layout). Takes pages from the pool as it fills
    /// them; running out is an [`Error::Capacity`] that leaves every sequence as it was.
    pub fn append(&mut self, id: SeqId, k: Tensor4Ref<'_, T>, v: Tensor4Ref<'_, T>) -> Result<()> {
        if self.latent {
            return Err(Error::unsupported(
                "values of a latent cache",
                "a latent cache stores one buffer, keys and values at once: append_latent",
            ));
        }
        self.check_tokens(k, Some(v))?;
        self.write(id, k, Some(v))
    }

    /// Appends `t` tokens to sequence `id` of a latent cache ([`PagedKvCache::latent`]):
    /// `latent : [1, kv_heads, t, d_k]`, keys and (their first `d_v` columns) values.
    pub fn append_latent(&mut self, id: SeqId, latent: Tensor4Ref<'_, T>) -> Result<()> {
        if !self.latent {
            return Err(Error::unsupported(
                "latent rows",
                "this cache stores keys and values apart: append",
            ));
        }
        self.check_tokens(latent, None)?;
        self.write(id, latent, None)
    }

    /// [`PagedKvCache::append`] of checked rows; `v` is `None` in a latent cache.
    fn write(
        &mut self,
        id: SeqId,
        k: Tensor4Ref<'_, T>,
        v: Option<Tensor4Ref<'_, T>>,
    ) -> Result<()> {
        let (t, ps) = (k.dims()[2], self.page_size);
        let seq = self.seq(id)?;
        let (len, have) = (seq.len, seq.pages.len());
        let new_len =
            len.checked_add(t)
                .ok_or(Error::capacity("tokens of a sequence", usize::MAX, len))?;
        let need = new_len.div_ceil(ps) - have;
        if need > self.free {
            return Err(Error::capacity("free pages", need, self.free));
        }
        let seq = self.seqs[id.0]
            .as_mut()
            .ok_or(Error::out_of_range("live sequence", id.0, 0))?;
        seq.pages
            .try_reserve(need)
            .map_err(|_| Error::allocation_of::<u32>("a sequence's pages", Some(need)))?;
        // Nothing can fail from here on (`need` pages are free, room for them reserved).
        let mut pages = core::mem::take(&mut seq.pages);
        for _ in 0..need {
            pages.extend(self.take_page(pages.last().copied()));
        }
        self.seqs[id.0] = Some(Sequence {
            pages,
            len: new_len,
        });
        // A page another sequence shares is full (forks copy the partial page), so the
        // rows written here are this sequence's own.
        let pages = self.seqs[id.0].as_ref().map_or(&[][..], |s| &s.pages[..]);
        if let Some(codes) = &mut self.codes {
            let all = self.pages;
            let slot = |h: usize, i: usize| {
                let tok = len + i;
                (h * all + pages[tok / ps] as usize) * ps + tok % ps
            };
            return codes.write((k, v), 0, slot);
        }
        let pools = [(Some(k), &mut self.k, self.d_k), (v, &mut self.v, self.d_v)];
        for (src, pool, d) in pools.into_iter().filter_map(|(s, p, d)| Some((s?, p, d))) {
            for h in 0..self.kv_heads {
                let rows = src.head(0, h)?;
                for i in 0..t {
                    let tok = len + i;
                    let page = pages[tok / ps] as usize;
                    let at = ((h * self.pages + page) * ps + tok % ps) * d;
                    for (c, x) in pool[at..at + d].iter_mut().enumerate() {
                        *x = rows[(i, c)];
                    }
                }
            }
        }
        Ok(())
    }

    /// Checks new rows against the cache (`v` is `None` for a latent cache's rows): their
    /// shapes, and for a quantized cache that every entry is finite.
    fn check_tokens(&self, k: Tensor4Ref<'_, T>, v: Option<Tensor4Ref<'_, T>>) -> Result<()> {
        check_new_tokens(k, v, [1, self.kv_heads, self.d_k, self.d_v])?;
        if self.codes.is_some() {
            CodePools::check_finite(&[Some(k), v].into_iter().flatten().collect::<Vec<_>>())?;
        }
        Ok(())
    }

    /// A new sequence holding what `id` holds: it shares `id`'s full pages and gets its
    /// own copy of the last, partial one (so neither's appends reach the other). Needs one
    /// free page when the length is not a whole number of pages.
    pub fn fork(&mut self, id: SeqId) -> Result<SeqId> {
        let parent = self.seq(id)?.clone();
        let partial = !parent.len.is_multiple_of(self.page_size);
        if partial && self.free == 0 {
            return Err(Error::capacity("free pages", 1, 0));
        }
        self.seqs
            .try_reserve(1)
            .map_err(|_| Error::allocation_of::<Sequence>("paged cache sequences", None))?;
        let mut pages = parent.pages;
        let copy = if partial { self.take_page(None) } else { None };
        if let (Some(last), Some(copy)) = (pages.last_mut(), copy) {
            let (from, to) = (*last as usize, copy as usize);
            let (heads, pool_pages, ps) = (self.kv_heads, self.pages, self.page_size);
            copy_page(&mut self.k, (heads, pool_pages, ps * self.d_k), (from, to));
            copy_page(&mut self.v, (heads, pool_pages, ps * self.d_v), (from, to));
            if let Some(codes) = &mut self.codes {
                copy_page(&mut codes.k, (heads, pool_pages, ps * self.d_k), (from, to));
                copy_page(&mut codes.v, (heads, pool_pages, ps * self.d_v), (from, to));
                copy_page(&mut codes.k_scales, (heads, pool_pages, ps), (from, to));
                copy_page(&mut codes.v_scales, (heads, pool_pages, ps), (from, to));
            }
            *last = copy;
        }
        let full = if partial {
            pages.len() - 1
        } else {
            pages.len()
        };
        for &p in &pages[..full] {
            self.users[p as usize] += 1;
        }
        self.seqs.push(Some(Sequence {
            pages,
            len: parent.len,
        }));
        Ok(SeqId(self.seqs.len() - 1))
    }

    /// Frees sequence `id`: each of its pages returns to the pool with its last user.
    pub fn free(&mut self, id: SeqId) -> Result<()> {
        self.seq(id)?;
        let Some(seq) = self.seqs[id.0].take() else {
            return Ok(());
        };
        for p in seq.pages {
            let users = &mut self.users[p as usize];
            *users -= 1;
            if *users == 0 {
                self.free += 1;
            }
        }
        Ok(())
    }

    /// Takes a free page for a sequence whose last page is `after` (`None`: a new run of
    /// pages): the page right after it when that one is free, so that a growing sequence's
    /// pages follow each other in the pool and attention streams them as one run (pages
    /// scattered through the pool read at about 0.5 of that speed); else a page in the
    /// largest free stretch of mapped memory, or of the pool when that has none — its start
    /// when nothing precedes it, else its middle, leaving the first half to the sequence
    /// whose page precedes it. Sequences growing side by side thus each get runs of their
    /// own. `None` when no page is free.
    fn take_page(&mut self, after: Option<u32>) -> Option<u32> {
        if self.free == 0 {
            return None;
        }
        let next = after
            .map(|p| p as usize + 1)
            .filter(|&p| self.users.get(p) == Some(&0));
        // A new run: in memory already mapped if it has a free page (so that many short
        // sequences do not map the whole pool), else anywhere. One pass over the pages per
        // try, only when a run cannot go on.
        let stretch = self.stretch();
        let new_run = |mapped_only: bool| {
            let (mut best, mut start) = ((0, 0), 0);
            for (p, &users) in self.users.iter().enumerate() {
                let usable = users == 0 && (!mapped_only || self.mapped[p / stretch]);
                if !usable {
                    start = p + 1;
                } else if p + 1 - start > best.1 {
                    best = (start, p + 1 - start);
                }
            }
            let (start, len) = best;
            (len > 0).then_some(if start == 0 { 0 } else { start + len / 2 })
        };
        let page = next.or_else(|| new_run(true)).or_else(|| new_run(false))?;
        self.users[page] = 1;
        self.free -= 1;
        self.map(page);
        // Pages number at most u32::MAX (checked when the pool was made).
        u32::try_from(page).ok()
    }

    /// Writes the stretch of pages around `page` (zeros, in every head's pools, in address
    /// order) the first time one of its pages is handed out: the system maps its memory
    /// then, in that order. Left to the appends, the pages of sequences growing side by side
    /// would be mapped one after the other's, alternating in physical memory, which
    /// decoding reads at about 0.7 of a contiguous cache's rate instead of 1.0 (Zen 4).
    fn map(&mut self, page: usize) {
        let stretch = self.stretch();
        let chunk = page / stretch;
        if self.mapped.get(chunk) != Some(&false) {
            return;
        }
        self.mapped[chunk] = true;
        let pages = chunk * stretch..((chunk + 1) * stretch).min(self.pages);
        let (heads, all, ps) = (self.kv_heads, self.pages, self.page_size);
        let zero = T::from_f32(0.0);
        zero_pages(
            &mut self.k,
            zero,
            (heads, all, ps * self.d_k),
            pages.clone(),
        );
        zero_pages(
            &mut self.v,
            zero,
            (heads, all, ps * self.d_v),
            pages.clone(),
        );
        if let Some(c) = &mut self.codes {
            zero_pages(&mut c.k, 0, (heads, all, ps * self.d_k), pages.clone());
            zero_pages(&mut c.v, 0, (heads, all, ps * self.d_v), pages.clone());
            zero_pages(&mut c.k_scales, 0.0, (heads, all, ps), pages.clone());
            zero_pages(&mut c.v_scales, 0.0, (heads, all, ps), pages);
        }
    }

    /// The sequences `ids` as one batch (their block table, built once), for
    /// [`PagedBatch::attention`].
    pub fn batch(&self, ids: &[SeqId]) -> Result<PagedBatch<'_, T>> {
        let mut lens = Vec::new();
        lens.try_reserve_exact(ids.len())
            .map_err(|_| Error::allocation_of::<usize>("paged batch lengths", Some(ids.len())))?;
        let mut widest = 0;
        for &id in ids {
            let s = self.seq(id)?;
            lens.push(s.len);
            widest = widest.max(s.pages.len());
        }
        let n = ids.len().checked_mul(widest);
        let mut table = attn_core::filled("paged batch block table", n, 0u32)?;
        for (row, &id) in table.chunks_exact_mut(widest.max(1)).zip(ids) {
            let pages = &self.seq(id)?.pages;
            row[..pages.len()].copy_from_slice(pages);
        }
        Ok(PagedBatch {
            cache: self,
            table,
            lens,
        })
    }

    /// The pools as `[pages, kv_heads, page_size, d]` views of their
    /// `[kv_heads, pages, page_size, d]` storage.
    fn pools(&self) -> Result<(Tensor4Ref<'_, T>, Tensor4Ref<'_, T>)> {
        if self.codes.is_some() {
            return Err(Error::unsupported(
                "pages of a quantized cache",
                "they hold codes and scales, not elements: PagedBatch::quantized_kv",
            ));
        }
        let view = |data, dims| self.view(data, dims);
        let k = view(&self.k, (self.d_k, self.d_k))?;
        // A latent cache's values: the keys' rows, their first `d_v` columns.
        let v = match self.latent {
            true => view(&self.k, (self.d_v, self.d_k))?,
            false => view(&self.v, (self.d_v, self.d_v))?,
        };
        Ok((k, v))
    }

    /// A pool `data` as a `[pages, kv_heads, page_size, d]` view of rows `row` apart.
    fn view<'s, U>(&self, data: &'s [U], (d, row): (usize, usize)) -> Result<Tensor4Ref<'s, U>> {
        let (pages, ps) = (self.pages, self.page_size);
        let dims = [pages, self.kv_heads, ps, d];
        Tensor4Ref::new(data, dims, [ps * row, pages * ps * row, row])
    }
}

/// Copies page `from` of every head's pool (of elements, codes or scales; `page_len`
/// entries a page) to page `to`.
fn copy_page<U: Copy>(
    pool: &mut [U],
    (heads, pages, page_len): (usize, usize, usize),
    (from, to): (usize, usize),
) {
    if pool.is_empty() {
        return;
    }
    for h in 0..heads {
        let head = h * pages;
        let from = (head + from) * page_len;
        pool.copy_within(from..from + page_len, (head + to) * page_len);
    }
}

/// Writes `zero` over pages `range` of every head's pool (`page_len` entries a page).
fn zero_pages<U: Copy>(
    pool: &mut [U],
    zero: U,
    (heads, pages, page_len): (usize, usize, usize),
    range: core::ops::Range<usize>,
) {
    for h in 0..heads {
        let at = (h * pages + range.start) * page_len;
        if let Some(rows) = pool.get_mut(at..at + range.len() * page_len) {
            rows.fill(zero);
        }
    }
}

/// Sequences of a [`PagedKvCache`] gathered into one batch: their block table and lengths.
#[derive(Debug)]
pub struct PagedBatch<'c, T> {
    cache: &'c PagedKvCache<T>,
    table: Vec<u32>,
    lens: Vec<usize>,
}

impl<'c, T: Element> PagedBatch<'c, T> {
    /// The batch's pages as the view the engines read (an error for a quantized cache:
    /// [`PagedBatch::quantized_kv`]).
    pub fn kv(&self) -> Result<PagedKv<'_, T>> {
        let (k, v) = self.cache.pools()?;
        PagedKv::new(k, v, &self.table, &self.lens)
    }

    /// The batch's quantized pages as the view the engines read (an error for a cache of
    /// elements: [`PagedBatch::kv`]).
    pub fn quantized_kv(&self) -> Result<QuantizedKv<'_>> {
        let cache = self.cache;
        let Some(c) = &cache.codes else {
            return Err(Error::unsupported(
                "quantized pages",
                "this cache stores its elements: PagedBatch::kv",
            ));
        };
        let codes = PagedKv::new(
            cache.view(&c.k, (cache.d_k, cache.d_k))?,
            cache.view(&c.v, (cache.d_v, cache.d_v))?,
            &self.table,
            &self.lens,
        )?;
        let (ks, vs) = (
            cache.view(&c.k_scales, (1, 1))?,
            cache.view(&c.v_scales, (1, 1))?,
        );
        let scales = PagedKv::new(ks, vs, &self.table, &self.lens)?;
        let channels = c.channels(cache.kv_heads, cache.d_k);
        QuantizedKv::new(codes, scales, channels, c.format)
    }

    /// The call of `q` (`[1, h_q, total_q, d_k]`, sequence `s` of the batch on its rows
    /// `cu_seqlens_q[s]..cu_seqlens_q[s + 1]`, its newest tokens) against the batch's
    /// pages: [`Attention::paged`].
    pub fn attention<'a>(
        &'a self,
        q: Tensor4Ref<'a, T>,
        cu_seqlens_q: &'a [usize],
        options: &Options<'a>,
    ) -> Result<Attention<'a, T, Batch>> {
        match self.cache.codes {
            Some(_) => Attention::quantized(q, cu_seqlens_q, self.quantized_kv()?, options),
            None => Attention::paged(q, cu_seqlens_q, self.kv()?, options),
        }
    }
}

/// Bytes of each head's pool that [`PagedKvCache`] maps at once: memory grows with the
/// pages in use by such stretches.
const MAP_BYTES: usize = 2 << 20;

/// Pages of `page_bytes` (of one head's key pool) in [`MAP_BYTES`] (at least one).
fn map_stretch(page_bytes: usize) -> usize {
    (MAP_BYTES / page_bytes.max(1)).max(1)
}

//! Paged KV caches as the oracle sees them: [`PagedCache`], what an engine's cache offers
//! the cache property (sequences added, appended to, forked, freed and attended), and
//! the reference's own, a literal pool of pages read by the reference's paged call.

use attn_core::{
    Error, KeyChannels, KvQuantization, Layout, Options, PagedKv, QuantizedKv, Result, Tensor4,
    Tensor4Ref, quantize_row,
};
use faer::MatRef;

/// The shape of a paged cache: `pages` pages of `page_size` tokens, each token `kv_heads`
/// rows of keys `d_k` wide and of values `d_v` wide.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CacheShape {
    /// Pages in the pool.
    pub pages: usize,
    /// Tokens a page.
    pub page_size: usize,
    /// Key/value heads.
    pub kv_heads: usize,
    /// Key width.
    pub d_k: usize,
    /// Value width.
    pub d_v: usize,
    /// How the pages store keys and values: `None` as the engine's storage type, else
    /// quantized (codes and scales written as rows are appended, by
    /// [`attn_core::quantize_row`], keys' channels set by the first keys the cache sees:
    /// [`KeyChannels::calibrate`]).
    pub format: Option<KvQuantization>,
}

/// A paged KV cache under test (vLLM's PagedAttention; attn-optimized's `PagedKvCache`):
/// sequences whose tokens lie in pages of one pool, addressed by handles the cache hands
/// out. Operands are f32, rounded to the engine's storage type already (convert them
/// exactly); results are widened to f32.
///
/// What the cache property ([`Property::PagedCacheIsolation`](crate::Property)) holds it
/// to, after every operation of a random sequence of them:
/// - a sequence of `len` tokens uses `⌈len / page_size⌉` pages of the pool
///   ([`PagedCache::pages_of`]); a page is shared between sequences only where it is full
///   (a fork shares the full pages and copies the partial one, so that neither's appends
///   reach the other), and returns to the pool with its last user:
///   [`PagedCache::free_pages`] is the pool less the distinct pages of the live sequences;
/// - [`PagedCache::append`] takes exactly the pages its tokens need, [`PagedCache::fork`]
///   one page when the length is not a whole number of pages; an operation that needs
///   more pages than are free is an [`Error::Capacity`] that changes nothing;
/// - a freed handle is an error for every method, and changes nothing;
/// - [`PagedCache::attention`] over one sequence is within the bound of the reference on
///   its tokens, and no operation on another sequence (appending, forking, freeing)
///   changes its bits; where the engine says its bits do not depend on where pages lie
///   ([`Engine::paged_bits_ignore_placement`](crate::Engine::paged_bits_ignore_placement)),
///   they are those of a fresh cache holding only that sequence's tokens (and a fork's
///   are its parent's).
pub trait PagedCache {
    /// A new, empty sequence: its handle.
    fn add_sequence(&mut self) -> Result<usize>;

    /// Appends `t` tokens to sequence `seq`: `k : [1, kv_heads, t, d_k]` and
    /// `v : [1, kv_heads, t, d_v]`.
    fn append(&mut self, seq: usize, k: Tensor4Ref<'_, f32>, v: Tensor4Ref<'_, f32>) -> Result<()>;

    /// A new sequence holding what `seq` holds: its handle.
    fn fork(&mut self, seq: usize) -> Result<usize>;

    /// Frees sequence `seq`; its handle is dead from then on.
    fn free(&mut self, seq: usize) -> Result<()>;

    /// The tokens sequence `seq` holds.
    fn len(&self, seq: usize) -> Result<usize>;

    /// The pages sequence `seq` uses, in order.
    fn pages_of(&self, seq: usize) -> Result<Vec<u32>>;

    /// Pages no sequence uses.
    fn free_pages(&self) -> usize;

    /// The paged call of `q` (`[1, h_q, total_q, d_k]`, sequence `seqs[s]` on the rows
    /// `cu_seqlens_q[s]..cu_seqlens_q[s + 1]`, its newest tokens) against the sequences
    /// `seqs`: the output `[1, h_q, total_q, d_v]` and the LSE `[h_q][total_q]`.
    fn attention(
        &self,
        seqs: &[usize],
        q: Tensor4Ref<'_, f32>,
        cu_seqlens_q: &[usize],
        options: &Options<'_>,
    ) -> Result<(Tensor4<f32>, Vec<f32>)>;
}

/// The reference engine's paged cache: pools `[pages, kv_heads, page_size, d]` in f32
/// (or, quantized, of codes with pools of scales), a count of users per page, a free list,
/// each sequence's pages and length; attended by `attn_reference::Attention::paged` (or
/// `quantized`) over a block table gathered per call.
#[derive(Debug, Clone)]
pub(crate) struct ReferenceCache {
    shape: CacheShape,
    k: Vec<f32>,
    v: Vec<f32>,
    codes: Option<Codes>,
    users: Vec<u32>,
    /// The free pages, the next to hand out last.
    free: Vec<u32>,
    /// `(pages, len)` per handle; `None` once freed.
    seqs: Vec<Option<(Vec<u32>, usize)>>,
}

/// A quantized reference cache's pools: codes laid out as the f32 pools, a scale a row,
/// and the keys' per-channel offsets and factors (`[kv_heads][d_k]`, set once).
#[derive(Debug, Clone)]
struct Codes {
    k: Vec<u8>,
    v: Vec<u8>,
    k_scales: Vec<f32>,
    v_scales: Vec<f32>,
    channels: Option<(Vec<f32>, Vec<f32>)>,
}

impl ReferenceCache {
    pub(crate) fn new(shape: CacheShape) -> Result<Self> {
        if shape.page_size == 0 {
            return Err(Error::layout(
                "paged cache",
                "a page holds no token (page_size must be at least 1)",
            ));
        }
        if shape.pages > u32::MAX as usize {
            return Err(Error::capacity(
                "pages of a paged cache",
                shape.pages,
                u32::MAX as usize,
            ));
        }
        let rows = shape.pages * shape.kv_heads * shape.page_size;
        let codes = shape.format.map(|_| Codes {
            k: vec![0; rows * shape.d_k],
            v: vec![0; rows * shape.d_v],
            k_scales: vec![0.0; rows],
            v_scales: vec![0.0; rows],
            channels: None,
        });
        Ok(Self {
            shape,
            k: vec![0.0; rows * shape.d_k],
            v: vec![0.0; rows * shape.d_v],
            codes,
            users: vec![0; shape.pages],
            free: (0..shape.pages as u32).rev().collect(),
            seqs: Vec::new(),
        })
    }

    fn seq(&self, id: usize) -> Result<&(Vec<u32>, usize)> {
        match self.seqs.get(id) {
            Some(Some(s)) => Ok(s),
            _ => Err(Error::out_of_range("live sequence", id, self.seqs.len())),
        }
    }

    /// Where row `row` of head `h` of page `page` starts in a pool of rows `d` wide.
    fn at(&self, page: u32, h: usize, row: usize, d: usize) -> usize {
        let s = self.shape;
        ((page as usize * s.kv_heads + h) * s.page_size + row) * d
    }

    fn pool<'a, U>(&self, data: &'a [U], d: usize) -> Result<Tensor4Ref<'a, U>> {
        let s = self.shape;
        Tensor4Ref::from_layout(data, [s.pages, s.kv_heads, s.page_size, d], Layout::Bhsd)
    }

    /// Writes `rows` (`[1, kv_heads, t, d]`) as the tokens `from..from + t` of a sequence
    /// whose pages are `pages`, into the key pool (`keys`) or the value pool.
    fn write_rows(
        &mut self,
        pages: &[u32],
        from: usize,
        rows: Tensor4Ref<'_, f32>,
        keys: bool,
    ) -> Result<()> {
        let ([_, heads, t, d], ps) = (rows.dims(), self.shape.page_size);
        if let (Some(format), Some(codes)) = (self.shape.format, &mut self.codes)
            && keys
            && format.key_channels
            && codes.channels.is_none()
            && t > 0
        {
            // The first keys set the channels, head by head.
            let (mut offsets, mut factors) = (Vec::new(), Vec::new());
            for h in 0..heads {
                let (mu, f) = KeyChannels::calibrate(rows.head(0, h)?);
                offsets.extend(mu);
                factors.extend(f);
            }
            codes.channels = Some((offsets, factors));
        }
        for h in 0..heads {
            let m = rows.head(0, h)?;
            for i in 0..t {
                let tok = from + i;
                let at = self.at(pages[tok / ps], h, tok % ps, d);
                let row: Vec<f32> = (0..d).map(|c| m[(i, c)]).collect();
                match (self.shape.format, &mut self.codes) {
                    (Some(format), Some(codes)) => {
                        let channels =
                            codes
                                .channels
                                .as_ref()
                                .filter(|_| keys)
                                .map(|(mu, f)| KeyChannels {
                                    offsets: &mu[h * d..(h + 1) * d],
                                    factors: &f[h * d..(h + 1) * d],
                                });
                        let (pool, scales) = match keys {
                            true => (&mut codes.k, &mut codes.k_scales),
                            false => (&mut codes.v, &mut codes.v_scales),
                        };
                        scales[at / d.max(1)] =
                            quantize_row(format.codes, &row, channels, &mut pool[at..at + d])?;
                    }
                    _ => {
                        let pool = if keys { &mut self.k } else { &mut self.v };
                        pool[at..at + d].copy_from_slice(&row);
                    }
                }
            }
        }
        Ok(())
    }
}

impl PagedCache for ReferenceCache {
    fn add_sequence(&mut self) -> Result<usize> {
        self.seqs.push(Some((Vec::new(), 0)));
        Ok(self.seqs.len() - 1)
    }

    fn append(&mut self, seq: usize, k: Tensor4Ref<'_, f32>, v: Tensor4Ref<'_, f32>) -> Result<()> {
        let s = self.shape;
        let t = k.dims()[2];
        let want = |d| [1, s.kv_heads, t, d];
        if k.dims() != want(s.d_k) || v.dims() != want(s.d_v) {
            return Err(Error::layout(
                "new tokens",
                format!(
                    "K is {:?} and V {:?}, not [1, {}, t, {}] and [1, {}, t, {}]",
                    k.dims(),
                    v.dims(),
                    s.kv_heads,
                    s.d_k,
                    s.kv_heads,
                    s.d_v
                ),
            ));
        }
        let (pages, len) = self.seq(seq)?.clone();
        if s.format.is_some() {
            let finite = |r: Tensor4Ref<'_, f32>| {
                (0..s.kv_heads).all(|h| {
                    r.head(0, h).is_ok_and(|m| {
                        (0..t).all(|i| (0..m.ncols()).all(|c| m[(i, c)].is_finite()))
                    })
                })
            };
            if !finite(k) || !finite(v) {
                return Err(Error::invalid_value(
                    "row appended to a quantized cache",
                    0,
                    f32::NAN,
                    "finite: a quantized cache has no code for inf or NaN",
                ));
            }
        }
        let need = (len + t).div_ceil(s.page_size) - pages.len();
        if need > self.free.len() {
            return Err(Error::capacity("free pages", need, self.free.len()));
        }
        let mut pages = pages;
        for _ in 0..need {
            let p = self.free.pop().expect("counted");
            self.users[p as usize] = 1;
            pages.push(p);
        }
        self.write_rows(&pages, len, k, true)?;
        self.write_rows(&pages, len, v, false)?;
        self.seqs[seq] = Some((pages, len + t));
        Ok(())
    }

    fn fork(&mut self, seq: usize) -> Result<usize> {
        let (mut pages, len) = self.seq(seq)?.clone();
        let ps = self.shape.page_size;
        let partial = !len.is_multiple_of(ps);
        if partial {
            let Some(copy) = self.free.pop() else {
                return Err(Error::capacity("free pages", 1, 0));
            };
            let last = pages.last_mut().expect("a partial page");
            for h in 0..self.shape.kv_heads {
                for (keys, d) in [(true, self.shape.d_k), (false, self.shape.d_v)] {
                    let (from, to) = (self.at(*last, h, 0, d), self.at(copy, h, 0, d));
                    let pool = if keys { &mut self.k } else { &mut self.v };
                    pool.copy_within(from..from + ps * d, to);
                    if let Some(c) = &mut self.codes {
                        let (codes, scales) = match keys {
                            true => (&mut c.k, &mut c.k_scales),
                            false => (&mut c.v, &mut c.v_scales),
                        };
                        codes.copy_within(from..from + ps * d, to);
                        let (from, to) = (from / d.max(1), to / d.max(1));
                        scales.copy_within(from..from + ps, to);
                    }
                }
            }
            self.users[copy as usize] = 1;
            *last = copy;
        }
        let full = pages.len() - usize::from(partial);
        for &p in &pages[..full] {
            self.users[p as usize] += 1;
        }
        self.seqs.push(Some((pages, len)));
        Ok(self.seqs.len() - 1)
    }

    fn free(&mut self, seq: usize) -> Result<()> {
        self.seq(seq)?;
        let (pages, _) = self.seqs[seq].take().expect("live");
        for p in pages {
            self.users[p as usize] -= 1;
            if self.users[p as usize] == 0 {
                self.free.push(p);
            }
        }
        Ok(())
    }

    fn len(&self, seq: usize) -> Result<usize> {
        self.seq(seq).map(|s| s.1)
    }

    fn pages_of(&self, seq: usize) -> Result<Vec<u32>> {
        self.seq(seq).map(|s| s.0.clone())
    }

    fn free_pages(&self) -> usize {
        self.free.len()
    }

    fn attention(
        &self,
        seqs: &[usize],
        q: Tensor4Ref<'_, f32>,
        cu_seqlens_q: &[usize],
        options: &Options<'_>,
    ) -> Result<(Tensor4<f32>, Vec<f32>)> {
        let rows: Vec<&(Vec<u32>, usize)> =
            seqs.iter().map(|&s| self.seq(s)).collect::<Result<_>>()?;
        let widest = rows.iter().map(|r| r.0.len()).max().unwrap_or(0);
        let mut table = vec![0u32; seqs.len() * widest];
        for (s, (pages, _)) in rows.iter().enumerate() {
            table[s * widest..s * widest + pages.len()].copy_from_slice(pages);
        }
        let lens: Vec<usize> = rows.iter().map(|r| r.1).collect();
        if let (Some(format), Some(c)) = (self.shape.format, &self.codes) {
            let s = self.shape;
            let codes = PagedKv::new(
                self.pool(&c.k, s.d_k)?,
                self.pool(&c.v, s.d_v)?,
                &table,
                &lens,
            )?;
            let scales = PagedKv::new(
                self.pool(&c.k_scales, 1)?,
                self.pool(&c.v_scales, 1)?,
                &table,
                &lens,
            )?;
            // Channels not set yet (no keys appended): identity ones.
            let identity = (vec![0.0; s.kv_heads * s.d_k], vec![1.0; s.kv_heads * s.d_k]);
            let (mu, f) = c.channels.as_ref().unwrap_or(&identity);
            let channels = format
                .key_channels
                .then(|| [mu, f].map(|m| MatRef::from_row_major_slice(&m[..], s.kv_heads, s.d_k)));
            let kv = QuantizedKv::new(codes, scales, channels, format)?;
            let fwd =
                attn_reference::Attention::quantized(q, cu_seqlens_q, kv, options)?.forward()?;
            return Ok(fwd.into_parts());
        }
        let (k, v) = (
            self.pool(&self.k, self.shape.d_k)?,
            self.pool(&self.v, self.shape.d_v)?,
        );
        let kv = PagedKv::new(k, v, &table, &lens)?;
        let fwd = attn_reference::Attention::paged(q, cu_seqlens_q, kv, options)?.forward()?;
        Ok(fwd.into_parts())
    }
}

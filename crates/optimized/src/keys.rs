//! Where a head's keys and values come from: a [`KeySource`]. The tile loops of both
//! passes and the exact slow paths ask it for blocks of rows — widened to f32 for the GEMM
//! tiles, or packed in bf16 pairs for the native products — and for single entries, and never index K or V themselves; the row kernels
//! (decoding) stream a source's rows in place, run by run, when it can lend them
//! ([`KeySource::run_at`]), and a source that cannot is computed with the GEMM tiles. The
//! sources are [`Dense`], a faer view, and [`Paged`], one head of a sequence in the pages
//! of a block table ([`PagedKv`]), and [`Quantized`], one head of a sequence in quantized
//! pages ([`QuantizedKv`]), whose codes the row kernels read in place
//! ([`KeySource::quantized`]) and whose blocks are dequantized for the GEMM tiles. The loops
//! are generic over the source and monomorphised: the dense case compiles to what
//! indexing the view did.

use core::ops::Range;

use std::sync::OnceLock;

use attn_core::{Dtype, KeyChannels, KvCodes, PagedKv, QuantizedKv, Tensor4Ref};
use faer::MatRef;
use half::bf16;

use crate::kernel::element::{Element, f32_rows, widen_rows};
use crate::kernel::finite::row_is_finite;
use crate::kernel::pair_dot::{self, PackReport, SplitStage};

/// Rows of keys (or values) of one head, `len()` of them, `width()` wide, of element `T`.
pub(crate) trait KeySource<T: Element>: Copy + Send + Sync {
    /// Whether a block's f32 rows are a copy even for f32 elements (the rows of a block are
    /// not one strided view): the passes then keep buffers for them.
    const GATHERS: bool = false;

    /// How many rows.
    fn len(&self) -> usize;

    /// The entries of each row.
    fn width(&self) -> usize;

    /// Rows `rows` as a source of their own.
    fn block(&self, rows: Range<usize>) -> Self;

    /// The rows in place, when the source holds them as one strided block of `T` (what the
    /// in-place row kernels and the exact paths read); `None` when they must be copied.
    fn in_place(&self) -> Option<MatRef<'_, T>>;

    /// Rows `j ..` in place up to the end of the strided block that holds row `j` (all
    /// the rest of a dense source, the rest of row `j`'s page of a paged one): the runs
    /// the row kernels stream one after the other, all with the same column count and
    /// strides. `None` when `j` is past the rows or the rows must be copied.
    fn run_at(&self, j: usize) -> Option<MatRef<'_, T>>;

    /// The rows as f32: in place for a dense f32 source, else widened (or dequantized)
    /// into `buf`, which holds at least `len() · width()` floats.
    fn to_f32<'s>(&'s self, buf: &'s mut [f32]) -> MatRef<'s, f32>;

    /// The rows packed in bf16 pairs for the native products ([`pair_dot`]) into `buf`, in
    /// the `order` the product wants, with what they hold; `None` when the source is not
    /// bf16.
    fn to_pairs(&self, order: PairOrder, buf: &mut [u32]) -> Option<PackReport>;

    /// The rows split exactly in two bf16 parts ([`crate::kernel::amx::Split`]) and packed
    /// like [`KeySource::to_pairs`] into `hi` and `lo`, through `stage`; `None` when the
    /// source is not f16 or `stage` is too small for it (the rows through
    /// [`KeySource::to_f32`], split, each part packed: any source's way).
    fn to_split_pairs(
        &self,
        order: PairOrder,
        hi: &mut [u32],
        lo: &mut [u32],
        stage: &mut SplitStage,
    ) -> Option<PackReport> {
        split_pairs(self, order, [hi, lo], stage)
    }

    /// Entry `c` of row `j`, as f32 (the exact slow paths, a few rows at a time).
    fn at(&self, j: usize, c: usize) -> f32;

    /// Whether row `j` is finite.
    fn row_finite(&self, j: usize) -> bool {
        (0..self.width()).all(|c| self.at(j, c).is_finite())
    }

    /// Whether `other` is this very source (the same rows in the same memory): query heads
    /// that share it can share what is packed from it.
    fn same_rows(&self, other: &Self) -> bool;

    /// The codes and scales of a quantized source, which the row kernels read in place
    /// (`None` for sources of elements).
    fn quantized(&self) -> Option<Quantized<'_>> {
        None
    }

    /// Whether every row is finite whatever the bits (quantized rows: a code and a scale
    /// are finite), so that no scan need look.
    fn always_finite(&self) -> bool {
        false
    }
}

/// How [`KeySource::to_pairs`] lays out the pairs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum PairOrder {
    /// The pairs of each row side by side, `ld` words per row (K: the scores contract
    /// over a row).
    Rows { ld: usize },
    /// Rows interleaved two by two (V for the pair products: `P·V` contracts over rows).
    RowPairs,
    /// Columns of rows in pairs, `ld` words per column (V for the tile products).
    Columns { ld: usize },
}

impl PairOrder {
    /// Packs `m` in this order into `buf` ([`pair_dot`]'s packers).
    fn pack(self, m: MatRef<'_, bf16>, buf: &mut [u32]) -> PackReport {
        match self {
            PairOrder::Rows { ld } => pair_dot::pack_rows(m, buf, ld),
            PairOrder::RowPairs => pair_dot::pack_row_pairs(m, buf),
            PairOrder::Columns { ld } => pair_dot::pack_columns(m, buf, ld),
        }
    }
}

/// A dense source: a faer view of the rows (any strides).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Dense<'a, T>(pub MatRef<'a, T>);

impl<T: Element> KeySource<T> for Dense<'_, T> {
    #[inline]
    fn len(&self) -> usize {
        self.0.nrows()
    }

    #[inline]
    fn width(&self) -> usize {
        self.0.ncols()
    }

    #[inline]
    fn block(&self, rows: Range<usize>) -> Self {
        Self(self.0.subrows(rows.start, rows.len()))
    }

    #[inline]
    fn in_place(&self) -> Option<MatRef<'_, T>> {
        Some(self.0)
    }

    #[inline]
    fn run_at(&self, j: usize) -> Option<MatRef<'_, T>> {
        (j < self.0.nrows()).then(|| self.0.subrows(j, self.0.nrows() - j))
    }

    #[inline]
    fn to_f32<'s>(&'s self, buf: &'s mut [f32]) -> MatRef<'s, f32> {
        f32_rows(self.0, 0..self.0.nrows(), buf)
    }

    #[inline]
    fn to_pairs(&self, order: PairOrder, buf: &mut [u32]) -> Option<PackReport> {
        T::as_bf16(self.0).map(|m| order.pack(m, buf))
    }

    #[inline]
    fn at(&self, j: usize, c: usize) -> f32 {
        self.0[(j, c)].to_f32()
    }

    #[inline]
    fn row_finite(&self, j: usize) -> bool {
        row_is_finite(self.0.row(j))
    }

    fn same_rows(&self, other: &Self) -> bool {
        let (a, b) = (self.0, other.0);
        core::ptr::eq(a.as_ptr(), b.as_ptr())
            && (a.nrows(), a.ncols()) == (b.nrows(), b.ncols())
            && (a.row_stride(), a.col_stride()) == (b.row_stride(), b.col_stride())
    }
}

/// [`KeySource::to_split_pairs`] of any source: its rows as f32 through `stage`, split
/// there, each part packed.
fn split_pairs<T: Element, K: KeySource<T>>(
    src: &K,
    order: PairOrder,
    [hi, lo]: [&mut [u32]; 2],
    stage: &mut SplitStage,
) -> Option<PackReport> {
    let (n, w) = (src.len(), src.width());
    let ([hi_m, lo_m], _) = (T::DTYPE == Dtype::F16)
        .then(|| stage.split(|buf| src.to_f32(buf), n, w))
        .flatten()?;
    let report = order.pack(hi_m, hi);
    let lo_report = order.pack(lo_m, lo);
    // An f16 entry's parts are never subnormal nor tiny in bf16; its infinities and
    // NaNs are in `hi` (and reported there).
    debug_assert!(lo_report.exact() && !lo_report.subnormal);
    Some(report)
}

/// A paged source: rows `start .. start + len` of one head of one sequence of a
/// [`PagedKv`], in its K or its V pool, read page by page through the sequence's pages
/// (nothing is gathered into a copy of the sequence: a block is widened or packed from
/// its pages as a dense block is from its view).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Paged<'a, T> {
    pool: Tensor4Ref<'a, T>,
    /// The pool as one sequence of pages, `[1, h_kv, pages · page_size, d]`, when each
    /// page's rows follow the previous page's at the row stride (then pages that follow
    /// each other in the pool make one run).
    flat: Option<Tensor4Ref<'a, T>>,
    pages: &'a [u32],
    head: usize,
    start: usize,
    len: usize,
}

impl<'a, T> Paged<'a, T> {
    /// Head `head` of sequence `s` of `kv`, in `pool` (its keys or its values).
    pub(crate) fn new(kv: &PagedKv<'a, T>, pool: Tensor4Ref<'a, T>, s: usize, head: usize) -> Self {
        let ([pages, heads, ps, d], [page_stride, head_stride, row]) =
            (pool.dims(), pool.strides());
        let flat = (page_stride == ps * row)
            .then(|| {
                Tensor4Ref::new(
                    pool.buffer(),
                    [1, heads, pages * ps, d],
                    [0, head_stride, row],
                )
                .ok()
            })
            .flatten();
        Self {
            pool,
            flat,
            pages: kv.pages(s),
            head,
            start: 0,
            len: kv.lens()[s],
        }
    }

    fn page_size(&self) -> usize {
        self.pool.dims()[2]
    }

    fn rows(&self) -> usize {
        self.len
    }

    fn cols(&self) -> usize {
        self.pool.dims()[3]
    }

    fn sub(&self, rows: Range<usize>) -> Self {
        Self {
            start: self.start + rows.start,
            len: rows.len(),
            ..*self
        }
    }

    fn same(&self, other: &Self) -> bool {
        let first = |p: &Self| p.pool.head(0, 0).map_or(core::ptr::null(), |m| m.as_ptr());
        core::ptr::eq(self.pages, other.pages)
            && core::ptr::eq(first(self), first(other))
            && (self.head, self.start, self.len) == (other.head, other.start, other.len)
    }

    /// The page holding row `j` (of this source) and the row's offset in it.
    fn page_of(&self, j: usize) -> Option<(MatRef<'a, T>, usize)> {
        if j >= self.len {
            return None;
        }
        let (t, ps) = (self.start + j, self.page_size());
        let page = *self.pages.get(t / ps)?;
        // The pages were checked against the pool when the view was made.
        let m = self.pool.head(page as usize, self.head).ok()?;
        Some((m, t % ps))
    }

    /// Rows `j ..` to the end of row `j`'s page (or of the source), and on through the
    /// pages after it that follow it in the pool.
    pub(crate) fn run(&self, j: usize) -> Option<MatRef<'a, T>> {
        if j >= self.len {
            return None;
        }
        let Some(flat) = self.flat else {
            let (m, offset) = self.page_of(j)?;
            let n = (self.page_size() - offset).min(self.len - j);
            return Some(m.subrows(offset, n));
        };
        let (t, ps) = (self.start + j, self.page_size());
        let (first, last_needed) = (t / ps, (self.start + self.len - 1) / ps);
        let mut last = first;
        while last < last_needed && self.pages.get(last + 1) == Some(&(self.pages[last] + 1)) {
            last += 1;
        }
        let n = ((last + 1) * ps - t).min(self.len - j);
        let at = *self.pages.get(first)? as usize * ps + t % ps;
        Some(flat.head(0, self.head).ok()?.subrows(at, n))
    }

    /// Every run of the source, `(first row, rows)`, in order.
    pub(crate) fn runs(&self) -> impl Iterator<Item = (usize, MatRef<'a, T>)> + '_ {
        let mut j = 0;
        core::iter::from_fn(move || {
            let run = self.run(j)?;
            let first = j;
            j += run.nrows();
            Some((first, run))
        })
    }

    /// Whether every run after the first starts on an even row, so that the rows pair up
    /// within the runs (pages of an even size, a source starting on an even token).
    fn pairs_within_runs(&self) -> bool {
        self.start.is_multiple_of(2) && self.page_size().is_multiple_of(2)
    }
}

impl<T: Element> KeySource<T> for Paged<'_, T> {
    const GATHERS: bool = true;

    #[inline]
    fn len(&self) -> usize {
        self.rows()
    }

    #[inline]
    fn width(&self) -> usize {
        self.cols()
    }

    #[inline]
    fn block(&self, rows: Range<usize>) -> Self {
        self.sub(rows)
    }

    fn in_place(&self) -> Option<MatRef<'_, T>> {
        self.run(0).filter(|run| run.nrows() == self.len)
    }

    #[inline]
    fn run_at(&self, j: usize) -> Option<MatRef<'_, T>> {
        self.run(j)
    }

    fn to_f32<'s>(&'s self, buf: &'s mut [f32]) -> MatRef<'s, f32> {
        // A block within one run (pages that follow each other) is a view: f32 in place.
        if let Some(m) = self.in_place() {
            return f32_rows(m, 0..m.nrows(), buf);
        }
        let w = self.width();
        for (first, run) in self.runs() {
            widen_rows(run, 0..run.nrows(), &mut buf[first * w..]);
        }
        MatRef::from_row_major_slice(&buf[..self.len * w], self.len, w)
    }

    fn to_pairs(&self, order: PairOrder, buf: &mut [u32]) -> Option<PackReport> {
        if T::DTYPE != Dtype::Bf16 {
            return None;
        }
        let w = self.width();
        let mut report = PackReport::CLEAN;
        if let PairOrder::Columns { ld } = order {
            // The runs fill their own pairs of each column: the padding once, here.
            for col in buf.chunks_exact_mut(ld.max(1)).take(w) {
                col[pair_dot::pairs(self.len)..].fill(0);
            }
        }
        if !self.pairs_within_runs() && !matches!(order, PairOrder::Rows { .. }) {
            // Pairs of rows that straddle two pages (a block starting on an odd token, or
            // pages of an odd size): word by word.
            for p in 0..pair_dot::pairs(self.len) {
                let row = |j: usize| {
                    let (m, i) = self.page_of(j)?;
                    T::as_bf16(m).map(|m| m.row(i))
                };
                let (lo, hi) = (row(2 * p)?, row(2 * p + 1));
                for c in 0..w {
                    let hi = hi.map_or(bf16::ZERO, |r| r[c]);
                    let at = match order {
                        PairOrder::Columns { ld } => c * ld + p,
                        _ => p * w + c,
                    };
                    buf[at] = pair_dot::word_of(lo[c], hi, &mut report);
                }
            }
            return Some(report);
        }
        for (first, run) in self.runs() {
            let run = T::as_bf16(run)?;
            let part = match order {
                PairOrder::Rows { ld } => pair_dot::pack_rows(run, &mut buf[first * ld..], ld),
                PairOrder::RowPairs => pair_dot::pack_row_pairs(run, &mut buf[first / 2 * w..]),
                PairOrder::Columns { ld } => {
                    pair_dot::pack_columns_unpadded(run, &mut buf[first / 2..], ld)
                }
            };
            report.merge(part);
        }
        Some(report)
    }

    fn at(&self, j: usize, c: usize) -> f32 {
        self.page_of(j)
            .map_or(f32::NAN, |(m, i)| m[(i, c)].to_f32())
    }

    fn row_finite(&self, j: usize) -> bool {
        self.page_of(j)
            .is_some_and(|(m, i)| row_is_finite(m.row(i)))
    }

    fn same_rows(&self, other: &Self) -> bool {
        self.same(other)
    }
}

/// A quantized source: rows of one head of one sequence in quantized pages
/// ([`QuantizedKv`]), `offset + factor · scale · value(code)` each entry. The row kernels read the
/// codes in place ([`KeySource::quantized`]) and apply the scales to the scores and the
/// weights; the GEMM tiles get blocks dequantized into their f32 buffers ([`KeySource::to_f32`]).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Quantized<'a> {
    /// The code bytes, page by page.
    pub codes: Paged<'a, u8>,
    /// One scale a row, in pages alike.
    scales: Paged<'a, f32>,
    /// The head's per-channel offsets and factors (keys of a format with them).
    pub channels: Option<KeyChannels<'a>>,
    /// What the codes mean.
    pub kind: KvCodes,
}

impl<'a> Quantized<'a> {
    /// The keys (`keys`) or values of head `head` of sequence `s` of `kv`.
    pub(crate) fn new(kv: &QuantizedKv<'a>, keys: bool, s: usize, head: usize) -> Self {
        let (codes, scales) = (kv.codes(), kv.scales());
        let (c, sc) = match keys {
            true => (codes.keys(), scales.keys()),
            false => (codes.values(), scales.values()),
        };
        Self {
            codes: Paged::new(&codes, c, s, head),
            scales: Paged::new(&scales, sc, s, head),
            channels: if keys { kv.key_channels(head) } else { None },
            kind: kv.format().codes,
        }
    }

    /// The scales of rows `first ..` into `out` (as many as it holds, within the rows).
    pub(crate) fn scales_into(&self, first: usize, out: &mut [f32]) {
        let mut j = first;
        let end = (first + out.len()).min(self.scales.rows());
        while j < end {
            let Some(run) = self.scales.run(j) else {
                break;
            };
            let n = run.nrows().min(end - j);
            let dst = &mut out[j - first..j - first + n];
            match run.col(0).try_as_col_major() {
                Some(col) => dst.copy_from_slice(&col.as_slice()[..n]),
                None => {
                    for (i, o) in dst.iter_mut().enumerate() {
                        *o = run[(i, 0)];
                    }
                }
            }
            j += n;
        }
    }

    fn scale(&self, j: usize) -> f32 {
        self.scales.page_of(j).map_or(f32::NAN, |(m, i)| m[(i, 0)])
    }
}

/// The values of the 256 codes of `kind`, computed once.
fn code_values(kind: KvCodes) -> &'static [f32; 256] {
    static INT8: OnceLock<[f32; 256]> = OnceLock::new();
    static FP8: OnceLock<[f32; 256]> = OnceLock::new();
    let table = match kind {
        KvCodes::Fp8E4m3 => &FP8,
        _ => &INT8,
    };
    table.get_or_init(|| core::array::from_fn(|b| kind.value(b as u8)))
}

impl<T: Element> KeySource<T> for Quantized<'_> {
    const GATHERS: bool = true;

    #[inline]
    fn len(&self) -> usize {
        self.codes.rows()
    }

    #[inline]
    fn width(&self) -> usize {
        self.codes.cols()
    }

    #[inline]
    fn block(&self, rows: Range<usize>) -> Self {
        Self {
            codes: self.codes.sub(rows.clone()),
            scales: self.scales.sub(rows),
            ..*self
        }
    }

    fn in_place(&self) -> Option<MatRef<'_, T>> {
        None
    }

    fn run_at(&self, _: usize) -> Option<MatRef<'_, T>> {
        None
    }

    fn to_f32<'s>(&'s self, buf: &'s mut [f32]) -> MatRef<'s, f32> {
        let (n, w) = (self.codes.rows(), self.codes.cols());
        let values = code_values(self.kind);
        for (first, run) in self.codes.runs() {
            for i in 0..run.nrows() {
                let scale = self.scale(first + i);
                let row = &mut buf[(first + i) * w..(first + i + 1) * w];
                for (c, x) in row.iter_mut().enumerate() {
                    *x = scale * values[usize::from(run[(i, c)])];
                }
                if let Some(ch) = self.channels {
                    for ((x, &mu), &f) in row.iter_mut().zip(ch.offsets).zip(ch.factors) {
                        *x = mu + f * *x;
                    }
                }
            }
        }
        MatRef::from_row_major_slice(&buf[..n * w], n, w)
    }

    fn to_pairs(&self, _: PairOrder, _: &mut [u32]) -> Option<PackReport> {
        None
    }

    fn to_split_pairs(
        &self,
        _: PairOrder,
        _: &mut [u32],
        _: &mut [u32],
        _: &mut SplitStage,
    ) -> Option<PackReport> {
        None
    }

    fn at(&self, j: usize, c: usize) -> f32 {
        let x = self.codes.page_of(j).map_or(f32::NAN, |(m, i)| {
            self.scale(j) * code_values(self.kind)[usize::from(m[(i, c)])]
        });
        self.channels
            .map_or(x, |ch| ch.offsets[c] + ch.factors[c] * x)
    }

    fn row_finite(&self, j: usize) -> bool {
        j < self.codes.rows()
    }

    fn same_rows(&self, other: &Self) -> bool {
        self.codes.same(&other.codes)
    }

    fn quantized(&self) -> Option<Quantized<'_>> {
        Some(*self)
    }

    fn always_finite(&self) -> bool {
        // `scale · value` stays finite (`quantize_row` keeps `scale · max_code` an f32);
        // `offset + factor · x` with key channels may not.
        self.channels.is_none()
    }
}

#[cfg(test)]
mod tests {
    use attn_core::Layout;

    use super::*;

    /// A sequence in pages answers every question as the same rows in one view would:
    /// blocks starting anywhere (pairs straddling pages included), in pages of an even and
    /// of an odd size, scattered or partly following each other in the pool (whose runs
    /// then span them).
    #[test]
    fn paged_rows_are_the_dense_rows() {
        let (n, d, heads) = (90usize, 40, 2);
        let scattered = |ps: usize, pages: usize| -> Vec<u32> {
            (0..n.div_ceil(ps))
                .map(|p| ((p * 5 + 3) % pages) as u32)
                .collect()
        };
        let cases: [(usize, Vec<u32>, Vec<usize>); 3] = [
            (16, scattered(16, 8), (0..n).step_by(16).collect()),
            (7, scattered(7, 15), (0..n).step_by(7).collect()),
            (16, vec![2, 3, 4, 0, 1, 5], vec![0, 48, 80]),
        ];
        for (ps, table, run_starts) in cases {
            let pages = n.div_ceil(ps) + 2;
            let data: Vec<bf16> = (0..pages * heads * ps * d)
                .map(|i| bf16::from_f32(((i * 7) % 23) as f32 - 11.0))
                .collect();
            let pool = Tensor4Ref::from_layout(&data, [pages, heads, ps, d], Layout::Bshd).unwrap();
            let lens = [n];
            let kv = PagedKv::new(pool, pool, &table, &lens).unwrap();
            let paged = Paged::new(&kv, pool, 0, 1);
            let rows: Vec<bf16> = (0..n)
                .flat_map(|t| {
                    let page = pool.head(table[t / ps] as usize, 1).unwrap();
                    (0..d).map(move |c| page[(t % ps, c)])
                })
                .collect();
            let dense = Dense(MatRef::from_row_major_slice(&rows, n, d));
            for r in [0..90, 33..90, 32..90, 33..89, 16..48, 17..18] {
                let (p, q) = (paged.block(r.clone()), dense.block(r.clone()));
                for order in [
                    PairOrder::Rows { ld: 24 },
                    PairOrder::RowPairs,
                    PairOrder::Columns { ld: 64 },
                ] {
                    let (mut a, mut b) = (vec![7u32; 64 * 64], vec![7u32; 64 * 64]);
                    assert_eq!(p.to_pairs(order, &mut a), q.to_pairs(order, &mut b));
                    assert!(a == b, "pages of {ps}, rows {r:?}, {order:?}");
                }
                let (mut a, mut b) = (vec![0.0f32; n * d], vec![0.0f32; n * d]);
                assert_eq!(p.to_f32(&mut a), q.to_f32(&mut b));
                assert_eq!(
                    (p.at(3.min(r.len() - 1), 5), p.row_finite(0)),
                    (q.at(3.min(r.len() - 1), 5), true)
                );
            }
            // Runs end where the pages stop following each other.
            let runs: Vec<usize> = paged.runs().map(|(first, _)| first).collect();
            assert_eq!(runs, run_starts);
        }
    }
}

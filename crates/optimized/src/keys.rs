//! Where a head's keys and values come from: a [`KeySource`]. The tile loops of both
//! passes and the exact slow paths ask it for blocks of rows — widened to f32 for the GEMM
//! tiles, or packed in bf16 pairs for the native products — and for single entries, and never index K or V themselves; the row kernels
//! (decoding) stream a source's rows in place when it can lend them
//! ([`KeySource::in_place`]), and a source that cannot is computed with the GEMM tiles. Today's one source is [`Dense`], a faer view;
//! pages of a block table and quantized blocks are sources to come, each answering the same
//! questions, so the loops above need not change (they are generic over the source and
//! monomorphised: the dense case compiles to what indexing the view did).

use core::ops::Range;

use attn_core::Dtype;
use faer::MatRef;
use half::bf16;

use crate::kernel::element::{Element, f32_rows};
use crate::kernel::finite::row_is_finite;
use crate::kernel::pair_dot::{self, PackReport, SplitStage};

/// Rows of keys (or values) of one head, `len()` of them, `width()` wide, of element `T`.
pub(crate) trait KeySource<T: Element>: Copy + Send + Sync {
    /// How many rows.
    fn len(&self) -> usize;

    /// The entries of each row.
    fn width(&self) -> usize;

    /// Rows `rows` as a source of their own.
    fn block(&self, rows: Range<usize>) -> Self;

    /// The rows in place, when the source holds them as one strided block of `T` (what the
    /// in-place row kernels and the exact paths read); `None` when they must be copied.
    fn in_place(&self) -> Option<MatRef<'_, T>>;

    /// The rows as f32: in place for a dense f32 source, else widened (or dequantized)
    /// into `buf`, which holds at least `len() · width()` floats.
    fn to_f32<'s>(&'s self, buf: &'s mut [f32]) -> MatRef<'s, f32>;

    /// The rows packed in bf16 pairs for the native products ([`pair_dot`]) into `buf`, in
    /// the `order` the product wants, with what they hold; `None` when the source is not
    /// bf16.
    fn to_pairs(&self, order: PairOrder, buf: &mut [u32]) -> Option<PackReport>;

    /// The rows split exactly in two bf16 parts ([`crate::kernel::amx::Split`]) and packed
    /// like [`KeySource::to_pairs`] into `hi` and `lo`, through `stage`; `None` when the
    /// source is not f16 or `stage` is too small for it.
    fn to_split_pairs(
        &self,
        order: PairOrder,
        hi: &mut [u32],
        lo: &mut [u32],
        stage: &mut SplitStage,
    ) -> Option<PackReport>;

    /// Entry `c` of row `j`, as f32 (the exact slow paths, a few rows at a time).
    fn at(&self, j: usize, c: usize) -> f32;

    /// Whether row `j` is finite.
    fn row_finite(&self, j: usize) -> bool {
        (0..self.width()).all(|c| self.at(j, c).is_finite())
    }

    /// Whether `other` is this very source (the same rows in the same memory): query heads
    /// that share it can share what is packed from it.
    fn same_rows(&self, other: &Self) -> bool;
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
    fn to_f32<'s>(&'s self, buf: &'s mut [f32]) -> MatRef<'s, f32> {
        f32_rows(self.0, 0..self.0.nrows(), buf)
    }

    #[inline]
    fn to_pairs(&self, order: PairOrder, buf: &mut [u32]) -> Option<PackReport> {
        T::as_bf16(self.0).map(|m| order.pack(m, buf))
    }

    fn to_split_pairs(
        &self,
        order: PairOrder,
        hi: &mut [u32],
        lo: &mut [u32],
        stage: &mut SplitStage,
    ) -> Option<PackReport> {
        let (n, w) = (self.len(), self.width());
        let ([hi_m, lo_m], _) = (T::DTYPE == Dtype::F16)
            .then(|| stage.split(|buf| self.to_f32(buf), n, w))
            .flatten()?;
        let report = order.pack(hi_m, hi);
        let lo_report = order.pack(lo_m, lo);
        // An f16 entry's parts are never subnormal nor tiny in bf16; its infinities and
        // NaNs are in `hi` (and reported there).
        debug_assert!(lo_report.exact() && !lo_report.subnormal);
        Some(report)
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

//! bf16 products on AVX512_BF16: `C (+)= α·A·B` with A and B in bf16 and C in f32, the
//! products of the native-precision tiles ([`attn_core::Precision::Native`]).
//!
//! `vdpbf16ps` multiplies sixteen pairs of bf16 per vector and adds each pair's two
//! products into one f32 lane: twice the f32 FMA's rate. The contraction index therefore
//! runs in pairs, and both operands are packed so that a pair is one 32-bit word (the even
//! index in its low half):
//!
//! - A (`m × k`, its rows across the lanes): word `(p, i)` at `p·ld + i` ([`Lanes`]) — Q for
//!   the scores, P for `P·V`, packed once per query tile and once per block;
//! - B (`k × n`, one word broadcast to every lane per product): word `(p, j)` at
//!   `p·pair_stride + j·col_stride` ([`Broadcast`]) — K's rows as they are (`[j][p]`, the
//!   pairs of a row side by side), V's rows interleaved two by two (`[p][c]`), each packed
//!   once per block visit by the key source.
//!
//! The instruction treats subnormal inputs as zero and flushes subnormal results, whatever
//! MXCSR says. The packers of exact inputs (Q, K, V) report a subnormal entry, and the caller
//! then computes that tile in f32; P is rounded here, and its flushed subnormals are
//! within the bound (`docs/accuracy.md`, "Native half precision").

use faer::MatRef;
use half::bf16;

use super::Isa;
use super::online_softmax::{HUGE, LAZY_RESCALE_LOG2};

/// Pairs of a row of `k` entries.
#[inline]
pub(crate) fn pairs(k: usize) -> usize {
    k.div_ceil(2)
}

/// Lanes of one vector: A's rows are padded to a multiple of this.
pub(crate) const LANES: usize = 16;

/// Whether this process multiplies bf16 in pairs: AVX512_BF16 is the chosen path. Not on
/// AMX machines, which have a faster product ([`super::amx`]); there (Sapphire Rapids,
/// measured) `vdpbf16ps` issues at a quarter of the f32 FMA's rate, half its FLOP rate.
#[inline]
pub(crate) fn available() -> bool {
    cfg!(target_arch = "x86_64") && Isa::current() == Isa::Avx512Bf16
}

/// Whether the CPU has the pair instructions (the rounding of P is shared with AMX).
#[inline]
fn has_instructions() -> bool {
    cfg!(target_arch = "x86_64") && Isa::current().includes(Isa::Avx512Bf16)
}

/// Packed A: `rows` rows across the lanes, `ld ≥ rows` (a multiple of [`LANES`]) words
/// between pairs.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Lanes<'a> {
    pub words: &'a [u32],
    pub rows: usize,
    pub ld: usize,
}

/// Packed B: `cols` columns of `pairs` words, word `(p, j)` at
/// `p·pair_stride + j·col_stride`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Broadcast<'a> {
    pub words: &'a [u32],
    pub pairs: usize,
    pub cols: usize,
    pub pair_stride: usize,
    pub col_stride: usize,
}

/// The f32 output: `cols` columns of `rows` floats, `ld` apart (column-major).
#[derive(Debug)]
pub(crate) struct Columns<'a> {
    pub data: &'a mut [f32],
    pub rows: usize,
    pub cols: usize,
    pub ld: usize,
}

/// Whether bf16 bits are a subnormal (`vdpbf16ps` would read them as zero).
#[inline(always)]
fn subnormal(bits: u16) -> bool {
    bits & 0x7f80 == 0 && bits & 0x007f != 0
}

/// Whether bf16 bits are an infinity or a NaN.
#[inline(always)]
fn non_finite(bits: u16) -> bool {
    bits & 0x7f80 == 0x7f80
}

/// One pair word: entry `lo` in the low half.
#[inline(always)]
fn word(lo: u16, hi: u16) -> u32 {
    u32::from(lo) | (u32::from(hi) << 16)
}

/// The word of entries `lo` and `hi`, scanned into `report`: for packers that assemble
/// pairs one word at a time (rows from different pages).
pub(crate) fn word_of(lo: bf16, hi: bf16, report: &mut PackReport) -> u32 {
    let (lo, hi) = (lo.to_bits(), hi.to_bits());
    scan([lo, hi].into_iter(), report);
    word(lo, hi)
}

/// Packs `a : [m, k]` (any strides) as A into `dst` (`ld` words per pair, `ld` a multiple
/// of [`LANES`], at least `m`; padding rows zero). Returns `false` (and packs nothing
/// usable) when an entry is subnormal.
pub(crate) fn pack_lanes(a: MatRef<'_, bf16>, dst: &mut [u32], ld: usize) -> bool {
    let (m, k) = (a.nrows(), a.ncols());
    let mut tiny = false;
    if k.is_multiple_of(2) && a.col_stride() == 1 {
        // Rows in memory order: each pair is one row's two neighbours, read row by row
        // (a transpose of words) instead of two strided reads per word.
        for out in dst.chunks_exact_mut(ld).take(pairs(k)) {
            out[m..].fill(0);
        }
        for i in 0..m {
            let row = a
                .row(i)
                .try_as_row_major()
                .map_or(&[][..], |r| r.as_slice());
            // An integer reduction (it vectorises), then the words.
            let sub = row
                .iter()
                .fold(0u16, |t, x| t | u16::from(subnormal(x.to_bits())));
            tiny |= sub != 0;
            for (p, two) in row.chunks_exact(2).enumerate() {
                dst[p * ld + i] = word(two[0].to_bits(), two[1].to_bits());
            }
        }
        return !tiny;
    }
    for (p, out) in dst.chunks_exact_mut(ld).take(pairs(k)).enumerate() {
        let (c0, c1) = (2 * p, 2 * p + 1);
        for (i, w) in out[..m].iter_mut().enumerate() {
            let lo = a[(i, c0)].to_bits();
            let hi = if c1 < k { a[(i, c1)].to_bits() } else { 0 };
            tiny |= subnormal(lo) | subnormal(hi);
            *w = word(lo, hi);
        }
        out[m..].fill(0);
    }
    !tiny
}

/// What a packed block of keys or values holds, for the caller's choice of path.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct PackReport {
    /// An entry is subnormal (the products would read it as zero).
    pub subnormal: bool,
    /// An entry is nonzero and below `2⁻¹⁰²` in magnitude: its products with weights
    /// above `2⁻²⁴` could be flushed to zero (a value's products, not a key's, matter).
    pub tiny: bool,
    /// An entry is infinite or NaN.
    pub non_finite: bool,
}

impl PackReport {
    /// Nothing to report.
    pub const CLEAN: PackReport = PackReport {
        subnormal: false,
        tiny: false,
        non_finite: false,
    };

    /// Adds what `other` (another part of the same block) holds.
    pub fn merge(&mut self, other: PackReport) {
        self.subnormal |= other.subnormal;
        self.tiny |= other.tiny;
        self.non_finite |= other.non_finite;
    }

    /// Whether the products compute this block of values as f32 would, up to rounding.
    pub fn exact(self) -> bool {
        !self.tiny && !self.non_finite
    }
}

/// The exponent field below which a bf16 value is [`PackReport::tiny`] (`2⁻¹⁰²`).
const TINY_EXPONENT: u16 = 127 - 102;

/// Scans bits for the report.
#[inline(always)]
fn scan(bits: impl Iterator<Item = u16>, report: &mut PackReport) {
    let (mut sub, mut tiny, mut wild) = (false, false, false);
    for b in bits {
        sub |= subnormal(b);
        tiny |= b & 0x7f80 < TINY_EXPONENT << 7 && b & 0x7fff != 0;
        wild |= non_finite(b);
    }
    report.subnormal |= sub;
    report.tiny |= tiny;
    report.non_finite |= wild;
}

/// Packs the rows of `m : [n, k]` with the pairs of a row side by side, `ld ≥ pairs(k)`
/// words per row (the padding zero): word `(p, j)` at `j·ld + p` (K for the scores: B = Kᵀ
/// of the pair products, A of the tile products).
pub(crate) fn pack_rows(m: MatRef<'_, bf16>, dst: &mut [u32], ld: usize) -> PackReport {
    let (n, k) = (m.nrows(), m.ncols());
    let kp = pairs(k);
    assert!(ld >= kp);
    let mut report = PackReport::CLEAN;
    for (j, row_out) in dst.chunks_exact_mut(ld.max(1)).take(n).enumerate() {
        let (out, pad) = row_out.split_at_mut(kp);
        pad.fill(0);
        match m.row(j).try_as_row_major() {
            Some(row) => {
                let row = row.as_slice();
                #[cfg(target_arch = "x86_64")]
                if Isa::current().vectors() == Isa::Avx512 {
                    // SAFETY: AVX-512 F and BW are part of the chosen path; the row holds
                    // `k` entries and `out` its `pairs(k)` words.
                    unsafe { x86::copy_row(row, out, &mut report) };
                    continue;
                }
                scan(row.iter().map(|x| x.to_bits()), &mut report);
                let (whole, rest) = row.split_at(k - k % 2);
                for (w, two) in out.iter_mut().zip(whole.chunks_exact(2)) {
                    *w = word(two[0].to_bits(), two[1].to_bits());
                }
                if let Some(last) = rest.first() {
                    out[kp - 1] = word(last.to_bits(), 0);
                }
            }
            None => {
                scan((0..k).map(|c| m[(j, c)].to_bits()), &mut report);
                for (p, w) in out.iter_mut().enumerate() {
                    let hi = if 2 * p + 1 < k {
                        m[(j, 2 * p + 1)].to_bits()
                    } else {
                        0
                    };
                    *w = word(m[(j, 2 * p)].to_bits(), hi);
                }
            }
        }
    }
    report
}

/// Packs `m : [n, w]` as B with its rows interleaved two by two: word `(p, c)` at
/// `p·w + c` holds rows `2p` and `2p + 1` of column `c` (V for `P·V`; an odd last row is
/// paired with zero).
pub(crate) fn pack_row_pairs(m: MatRef<'_, bf16>, dst: &mut [u32]) -> PackReport {
    pack_row_pairs_into(m, dst, m.ncols())
}

/// [`pack_row_pairs`] with `ld ≥ w` words per pair of rows (the padding zero).
pub(crate) fn pack_row_pairs_into(m: MatRef<'_, bf16>, dst: &mut [u32], ld: usize) -> PackReport {
    let (n, w) = (m.nrows(), m.ncols());
    assert!(ld >= w);
    let mut report = PackReport::CLEAN;
    let row = |r: usize| m.row(r).try_as_row_major().map(|row| row.as_slice());
    for (p, padded) in dst.chunks_exact_mut(ld.max(1)).take(pairs(n)).enumerate() {
        let (out, pad) = padded.split_at_mut(w);
        pad.fill(0);
        let (r0, r1) = (2 * p, 2 * p + 1);
        match (row(r0), (r1 < n).then(|| row(r1))) {
            (Some(a), Some(Some(b))) => {
                #[cfg(target_arch = "x86_64")]
                if Isa::current().vectors() == Isa::Avx512 {
                    // SAFETY: AVX-512 F and BW are part of the chosen path; both rows and
                    // `out` hold `w` entries.
                    unsafe { x86::pair_rows(a, b, out, &mut report) };
                    continue;
                }
                scan(a.iter().chain(b).map(|x| x.to_bits()), &mut report);
                for ((o, x), y) in out.iter_mut().zip(a).zip(b) {
                    *o = word(x.to_bits(), y.to_bits());
                }
            }
            (Some(a), None) => {
                scan(a.iter().map(|x| x.to_bits()), &mut report);
                for (o, x) in out.iter_mut().zip(a) {
                    *o = word(x.to_bits(), 0);
                }
            }
            _ => {
                for (c, o) in out.iter_mut().enumerate() {
                    let lo = m[(r0, c)].to_bits();
                    let hi = if r1 < n { m[(r1, c)].to_bits() } else { 0 };
                    scan([lo, hi].into_iter(), &mut report);
                    *o = word(lo, hi);
                }
            }
        }
    }
    report
}

/// Packs the f32 tile `s` (`rows` columns of `cols` floats, `ld_s` apart: column-major
/// with the roles swapped, each of its rows contiguous) as the rows of an A operand, each
/// entry rounded to bf16 (to nearest even; subnormals flushed): row `j` takes
/// `s[j·ld_s ..][..cols]` in pairs, `ld ≥ pairs(cols)` words apart (the padding zero).
/// Without AVX512_BF16, does nothing (the caller computes in f32 there).
pub(crate) fn pack_f32_rows(
    s: &[f32],
    ld_s: usize,
    rows: usize,
    cols: usize,
    dst: &mut [u32],
    ld: usize,
) {
    assert!(cols <= ld_s && ld >= pairs(cols) && dst.len() >= rows * ld);
    assert!(rows == 0 || s.len() >= (rows - 1) * ld_s + cols);
    #[cfg(target_arch = "x86_64")]
    if has_instructions() {
        // SAFETY: AVX512_BF16 (with AVX-512 F and BW) is part of the chosen path, and the
        // asserts above bound every access (loads are masked to `cols`).
        unsafe { x86::pack_f32_rows(s, ld_s, rows, cols, dst, ld) }
    }
}

/// Packs the columns of `m : [n, w]` with its rows in pairs, `ld ≥ pairs(n)` words per
/// column (the padding zero): word `(p, c)` at `c·ld + p` holds rows `2p` and `2p + 1` of
/// column `c` (V for `Oᵀ += Vᵀ·Pᵀ`: A of the tile products).
pub(crate) fn pack_columns(m: MatRef<'_, bf16>, dst: &mut [u32], ld: usize) -> PackReport {
    let (np, w) = (pairs(m.nrows()), m.ncols());
    assert!(ld >= np && dst.len() >= w * ld);
    for col in dst.chunks_exact_mut(ld).take(w) {
        col[np..].fill(0);
    }
    pack_columns_unpadded(m, dst, ld)
}

/// [`pack_columns`] without the padding: writes only words `(p, c)` for the pairs of `m`'s
/// rows, so that blocks of rows (pages) can fill one column each at its own first pair
/// (`dst` starting there; every block but the last of an even number of rows). `dst`
/// holds the last column's pairs at least.
pub(crate) fn pack_columns_unpadded(m: MatRef<'_, bf16>, dst: &mut [u32], ld: usize) -> PackReport {
    let (n, w) = (m.nrows(), m.ncols());
    let np = pairs(n);
    assert!(ld >= np && (w == 0 || dst.len() >= (w - 1) * ld + np));
    let mut report = PackReport::CLEAN;
    let row = |r: usize| m.row(r).try_as_row_major().map(|row| row.as_slice());
    // Whole blocks of 16 pairs × 16 columns transposed in registers, the rest one word at
    // a time.
    let mut done = 0;
    #[cfg(target_arch = "x86_64")]
    if Isa::current().vectors() == Isa::Avx512 {
        let rows: Option<Vec<&[bf16]>> = (0..n - n % 32).map(row).collect();
        if let Some(rows) = rows {
            // SAFETY: AVX-512 F and BW are part of the chosen path; every row holds `w`
            // entries, and `dst` the first `pairs(n) ≤ ld` words of each of `w` columns
            // `ld` apart (the assert above), all the kernel writes.
            done = unsafe { x86::pack_columns(&rows, w, dst, ld, &mut report) };
        }
    }
    let whole_cols = if done > 0 { w - w % LANES } else { 0 };
    for p in 0..np {
        let (r0, r1) = (2 * p, 2 * p + 1);
        let first = if p < done { whole_cols } else { 0 };
        match (row(r0), if r1 < n { row(r1) } else { None }) {
            (Some(a), Some(b)) => {
                scan(
                    a[first..].iter().chain(&b[first..]).map(|x| x.to_bits()),
                    &mut report,
                );
                for (c, (x, y)) in a.iter().zip(b).enumerate().skip(first) {
                    dst[c * ld + p] = word(x.to_bits(), y.to_bits());
                }
            }
            _ => {
                for c in first..w {
                    let lo = m[(r0, c)].to_bits();
                    let hi = if r1 < n { m[(r1, c)].to_bits() } else { 0 };
                    scan([lo, hi].into_iter(), &mut report);
                    dst[c * ld + p] = word(lo, hi);
                }
            }
        }
    }
    report
}

/// Packs the f32 probabilities `s` (`cols` columns of `rows`, `ld_s` apart) as A, each
/// rounded to bf16 (to nearest even; subnormals flushed): word `(p, i)` at `p·ld + i`;
/// adds to `delta[i]` what rounding added to row `i`'s sum. Without AVX512_BF16, does
/// nothing (the caller computes in f32 there).
#[allow(clippy::too_many_arguments)]
pub(crate) fn pack_probabilities(
    s: &[f32],
    ld_s: usize,
    rows: usize,
    cols: usize,
    dst: &mut [u32],
    ld: usize,
    delta: &mut [f32],
) {
    assert!(rows <= ld && rows <= ld_s && ld.is_multiple_of(LANES) && delta.len() >= rows);
    assert!(cols == 0 || s.len() >= (cols - 1) * ld_s + rows);
    assert!(dst.len() >= pairs(cols) * ld);
    #[cfg(target_arch = "x86_64")]
    if has_instructions() {
        // SAFETY: AVX512_BF16 (with AVX-512 F and BW) is part of the chosen path, and the
        // asserts above bound every access (loads are masked to `rows`).
        unsafe { x86::pack_probabilities(s, ld_s, rows, cols, dst, ld, delta) }
    }
}

/// [`pack_probabilities`] in two bf16 parts: `hi` each probability rounded, `lo` what is
/// left of it rounded again (`hi + lo` within `2⁻¹⁶` of it; the split operands of
/// [`super::amx::Split`]); `delta[i]` gains what the two added to row `i`'s sum.
#[allow(clippy::too_many_arguments)]
pub(crate) fn pack_probabilities_split(
    s: &[f32],
    ld_s: usize,
    (rows, cols): (usize, usize),
    hi: &mut [u32],
    lo: &mut [u32],
    ld: usize,
    delta: &mut [f32],
) {
    assert!(rows <= ld && rows <= ld_s && ld.is_multiple_of(LANES) && delta.len() >= rows);
    assert!(cols == 0 || s.len() >= (cols - 1) * ld_s + rows);
    assert!(hi.len() >= pairs(cols) * ld && lo.len() >= pairs(cols) * ld);
    #[cfg(target_arch = "x86_64")]
    if has_instructions() {
        // SAFETY: AVX512_BF16 (with AVX-512 F and BW) is part of the chosen path, and the
        // asserts above bound every access (loads are masked to `rows`).
        unsafe { x86::pack_probabilities_split(s, ld_s, rows, cols, hi, lo, ld, delta) }
    }
}

/// Working memory of an operand split in two bf16 parts ([`split_bf16`]): its f32 rows
/// and both parts, row-major (what the packers read fastest), for up to `capacity`
/// entries.
#[derive(Debug, Default)]
pub(crate) struct SplitStage {
    wide: Vec<f32>,
    hi: Vec<bf16>,
    lo: Vec<bf16>,
}

impl SplitStage {
    /// A stage for `capacity` entries, or `None` when the memory cannot be had.
    pub(crate) fn new(capacity: usize) -> Option<Self> {
        let what = "an f16 operand split in bf16 parts";
        Some(Self {
            wide: attn_core::zeroed(what, Some(capacity)).ok()?,
            hi: attn_core::zeroed(what, Some(capacity)).ok()?,
            lo: attn_core::zeroed(what, Some(capacity)).ok()?,
        })
    }

    /// The `rows × cols` operand that `widen` writes as f32 into the buffer it is given,
    /// split: `[hi, lo]` and whether every entry is finite; `None` when it does not fit.
    pub(crate) fn split<'s>(
        &'s mut self,
        widen: impl FnOnce(&'s mut [f32]) -> MatRef<'s, f32>,
        rows: usize,
        cols: usize,
    ) -> Option<([MatRef<'s, bf16>; 2], bool)> {
        let n = rows.checked_mul(cols).filter(|&n| n <= self.hi.len())?;
        let (hi, lo) = (&mut self.hi[..n], &mut self.lo[..n]);
        let finite = split_bf16(widen(&mut self.wide[..n]), hi, lo);
        let part = |p: &'s [bf16]| MatRef::from_row_major_slice(p, rows, cols);
        Some(([part(&self.hi[..n]), part(&self.lo[..n])], finite))
    }
}

/// `x` split in two bf16 parts: `hi` rounded to nearest even, `lo` what is left of it
/// rounded again (exact for an f16 value), and whether `x` is finite; an infinity or NaN
/// goes whole into `hi` (a NaN quiet). Branch-free, so that a row of them vectorises.
#[inline(always)]
fn split_one(x: f32) -> (u16, u16, bool) {
    let b = x.to_bits();
    let round = |b: u32| (b.wrapping_add(0x7fff + ((b >> 16) & 1)) >> 16) as u16;
    let finite = b & 0x7f80_0000 != 0x7f80_0000;
    let top = round(b);
    let rest = x - f32::from_bits(u32::from(top) << 16);
    // Not finite: the top half, with a NaN's quiet bit set (its payload may lie below).
    let nan_bit = if b & 0x007f_ffff != 0 { 0x0040 } else { 0 };
    let whole = (b >> 16) as u16 | nan_bit;
    if finite {
        (top, round(rest.to_bits()), true)
    } else {
        (whole, 0, false)
    }
}

/// A row of [`split_one`], branch-free so that it vectorises; whether all are finite.
#[inline(always)]
fn split_row(row: &[f32], hi: &mut [bf16], lo: &mut [bf16]) -> bool {
    let mut wild = 0u32;
    for ((&x, h), l) in row.iter().zip(hi.iter_mut()).zip(lo.iter_mut()) {
        let (top, rest, finite) = split_one(x);
        *h = bf16::from_bits(top);
        *l = bf16::from_bits(rest);
        wild |= u32::from(!finite);
    }
    wild == 0
}

#[inline(always)]
fn split_bf16_body<const FMA: bool>(m: MatRef<'_, f32>, hi: &mut [bf16], lo: &mut [bf16]) -> bool {
    let w = m.ncols();
    let rows = hi
        .chunks_exact_mut(w.max(1))
        .zip(lo.chunks_exact_mut(w.max(1)));
    let mut finite = true;
    let mut wide = [0.0f32; 64];
    for (i, (hi, lo)) in rows.take(m.nrows()).enumerate() {
        match m.row(i).try_as_row_major() {
            Some(row) => finite &= split_row(row.as_slice(), hi, lo),
            None => {
                for c0 in (0..w).step_by(wide.len()) {
                    let n = (w - c0).min(wide.len());
                    for (c, x) in wide[..n].iter_mut().enumerate() {
                        *x = m[(i, c0 + c)];
                    }
                    finite &= split_row(&wide[..n], &mut hi[c0..c0 + n], &mut lo[c0..c0 + n]);
                }
            }
        }
    }
    finite
}

super::multiversion! {
    /// Splits the entries of `m` into bf16 `hi + lo`, row-major, `m.ncols()` entries a
    /// row, into `hi` and `lo` (each at least `m.nrows()·m.ncols()` long): exact for an
    /// f16 value widened (11 significant bits: 8 in `hi`, the rest in `lo`), within `2⁻¹⁶`
    /// for any f32; an infinity or NaN goes whole into `hi`. Returns whether every entry
    /// is finite.
    pub(crate) fn split_bf16(m: MatRef<'_, f32>, hi: &mut [bf16], lo: &mut [bf16]) -> bool = split_bf16_body
}

/// The softmax's one pass over a block of scores whose rows all have a finite reference
/// maximum, read in spans of keys (the whole block at once, or a span as soon as its
/// scores are computed): each span is exponentiated at the reference maxima, rounded into
/// P's pair words and summed (and, in a block with nothing hidden, the scores' minima
/// kept); at the end [`OnePass::settle`] keeps the sums when no row's block weighs more
/// than `2^LAZY_RESCALE_LOG2` times the plan's block width (no score more than
/// `LAZY_RESCALE_LOG2 + log2(width)` above its reference: the lazy maximum's lag, without
/// a maximum kept per score), none overflowed and (when asked) none was not finite. The
/// width is the plan's, not the block's own count of keys, so that a row's choice does not
/// depend on how many hidden keys its block was cut to.
/// Otherwise nothing is kept, and the caller runs the two passes (the words are scratch).
/// Where the two passes would not move a maximum either, the sums are bit for bit theirs.
///
/// [`LAZY_RESCALE_LOG2`]: super::online_softmax::LAZY_RESCALE_LOG2
#[derive(Debug)]
pub(crate) struct OnePass<'a> {
    /// Three floats a row: the running sums, rounding terms and minima.
    running: &'a mut [f32],
    rows: usize,
    /// The plan's key-block width: the heaviness threshold's.
    width: usize,
    all_visible: bool,
}

impl<'a> OnePass<'a> {
    /// Starts the pass of `rows` rows from the sums `l` and rounding terms `delta` in
    /// `scratch` (at least `3·rows` floats), for blocks of at most `width` keys.
    /// `all_visible`: nothing in the block is hidden, so a `-inf` or huge negative score
    /// overflowed and fails the block.
    pub(crate) fn start(
        scratch: &'a mut [f32],
        l: &[f32],
        delta: &[f32],
        (all_visible, width): (bool, usize),
    ) -> Self {
        let rows = l.len();
        assert!(delta.len() == rows && scratch.len() >= 3 * rows);
        let running = &mut scratch[..3 * rows];
        let (sums, rest) = running.split_at_mut(rows);
        let (terms, minima) = rest.split_at_mut(rows);
        sums.copy_from_slice(l);
        terms.copy_from_slice(delta);
        minima.fill(f32::INFINITY);
        Self {
            running,
            rows,
            width,
            all_visible,
        }
    }

    /// The next span: `cols` columns of scores `s` (`rows` each, `ld_s` apart), times
    /// `scale`, exponentiated at the reference maxima `m` (finite, or NaN for a row the
    /// pass gives up), into the pair words of `dst`
    /// (`ld` apart; `cols` is even but for a block's last span). Returns `false` (and does
    /// nothing) without AVX512_BF16.
    pub(crate) fn exponentiate(
        &mut self,
        (s, ld_s, cols): (&[f32], usize, usize),
        m: &[f32],
        scale: f32,
        (dst, ld): (&mut [u32], usize),
    ) -> bool {
        let rows = self.rows;
        assert!(rows <= ld && rows <= ld_s && ld.is_multiple_of(LANES));
        assert!(m.len() >= rows && m[..rows].iter().all(|x| x.is_finite() || x.is_nan()));
        assert!(cols == 0 || s.len() >= (cols - 1) * ld_s + rows);
        assert!(dst.len() >= pairs(cols) * ld);
        #[cfg(target_arch = "x86_64")]
        if has_instructions() {
            let (sums, rest) = self.running.split_at_mut(rows);
            let (terms, minima) = rest.split_at_mut(rows);
            let running = x86::Running {
                sums: sums.as_mut_ptr(),
                terms: terms.as_mut_ptr(),
                minima: self.all_visible.then_some(minima.as_mut_ptr()),
            };
            // SAFETY: AVX512_BF16 (with AVX-512 F and BW) is part of the chosen path, and
            // the asserts above bound every access (loads and stores are masked to `rows`).
            unsafe { x86::exponentiate_span(s, ld_s, rows, cols, m, scale, running, dst, ld) };
            return true;
        }
        let _ = (s, ld_s, cols, scale, dst);
        false
    }

    /// Ends the pass: whether every row is settled (see [`OnePass`]; `check_finite`: a
    /// non-finite score fails the block), and then its sums and terms into `l` and `delta`
    /// (which hold the sums and terms the pass started from). Otherwise the reference of
    /// each row that did not settle becomes NaN in `m`: the others' are what the two
    /// passes are to keep.
    pub(crate) fn settle(
        self,
        m: &mut [f32],
        check_finite: bool,
        l: &mut [f32],
        delta: &mut [f32],
    ) -> bool {
        let rows = self.rows;
        let (sums, rest) = self.running.split_at(rows);
        let (terms, minima) = rest.split_at(rows);
        let heavy = LAZY_RESCALE_LOG2.exp2() * self.width as f32;
        let settles = |i: usize, m: f32| {
            // A score far above the reference (or +inf, or one that overflowed to a huge
            // positive value) makes the block heavy; one that overflowed to -inf or a huge
            // negative value where nothing is hidden is a minimum; a NaN makes its sum NaN.
            let moved = sums[i] - l[i] > heavy;
            let sunk = self.all_visible && minima[i] < -HUGE;
            !(m.is_nan() || moved || sunk || (check_finite && sums[i].is_nan()))
        };
        if (0..rows).all(|i| settles(i, m[i])) {
            l[..rows].copy_from_slice(sums);
            delta[..rows].copy_from_slice(terms);
            return true;
        }
        for (i, m) in m[..rows].iter_mut().enumerate() {
            if !settles(i, *m) {
                *m = f32::NAN;
            }
        }
        false
    }
}

/// Step 3 of the softmax for the native products, fused with [`pack_probabilities`] (the
/// second of the two passes, after the maxima): for the `cols` columns of scores `s`
/// (`rows` each, `ld_s` apart), `p = 2^(s − m_safe)` added to the row sums `l` in column
/// order, rounded into the pair words of `dst` (`ld` apart) and what rounding added
/// accumulated into `delta` — the words and sums bit for bit what the plain step and the
/// packer compute, `l + delta` within a rounding of theirs (the rounded weights are summed
/// as such, `delta` taken from that sum at the end), without writing the probabilities
/// anywhere else. Returns `false` (and does nothing)
/// without AVX512_BF16.
#[allow(clippy::too_many_arguments)]
pub(crate) fn exponentiate_pairs(
    s: &[f32],
    ld_s: usize,
    rows: usize,
    cols: usize,
    m_safe: &[f32],
    l: &mut [f32],
    (dst, ld): (&mut [u32], usize),
    delta: &mut [f32],
) -> bool {
    assert!(rows <= ld && rows <= ld_s && ld.is_multiple_of(LANES));
    assert!(m_safe.len() >= rows && l.len() >= rows && delta.len() >= rows);
    assert!(cols == 0 || s.len() >= (cols - 1) * ld_s + rows);
    assert!(dst.len() >= pairs(cols) * ld);
    #[cfg(target_arch = "x86_64")]
    if has_instructions() {
        let running = x86::Running {
            sums: l.as_mut_ptr(),
            terms: delta.as_mut_ptr(),
            minima: None,
        };
        // SAFETY: AVX512_BF16 (with AVX-512 F and BW) is part of the chosen path, and the
        // asserts above bound every access (loads and stores are masked to `rows`).
        unsafe { x86::exponentiate_span(s, ld_s, rows, cols, m_safe, 1.0, running, dst, ld) };
        return true;
    }
    false
}

/// `c (+)= alpha · A·B`: `accumulate` adds to `c`, otherwise overwrites it. Without
/// AVX512_BF16, does nothing (the caller computes in f32 there).
pub(crate) fn product(
    a: Lanes<'_>,
    b: Broadcast<'_>,
    c: Columns<'_>,
    alpha: f32,
    accumulate: bool,
) {
    let (m, n, kp) = (c.rows, c.cols, b.pairs);
    assert!(a.rows >= m && a.ld.is_multiple_of(LANES) && a.ld >= m.next_multiple_of(LANES));
    assert!(kp == 0 || a.words.len() >= (kp - 1) * a.ld + m.next_multiple_of(LANES));
    assert!(b.cols >= n && c.ld >= m);
    assert!(n == 0 || kp == 0 || b.words.len() > (kp - 1) * b.pair_stride + (n - 1) * b.col_stride);
    assert!(n == 0 || c.data.len() >= (n - 1) * c.ld + m);
    if m == 0 || n == 0 {
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if has_instructions() {
        // SAFETY: AVX512_BF16 (with AVX-512 F and BW) is part of the chosen path; the
        // asserts above bound every access (A's padded lanes are inside `a.words`, C's
        // are masked to `m`).
        unsafe { x86::product(a, b, c, alpha, accumulate, kp) }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (a, b, c, alpha, accumulate, kp);
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use core::arch::x86_64::*;

    use super::{Broadcast, Columns, LANES, Lanes};

    /// Rows (vectors of [`LANES`]) and columns of one register block: 4 × 6 accumulators.
    const MV: usize = 4;
    const NB: usize = 6;
    /// Pairs per pass over a block, so A's slice stays in L1 while the columns change.
    const KC: usize = 128;

    /// A view of the operands as raw pointers for the register blocks.
    #[derive(Clone, Copy)]
    struct Op {
        a: *const u32,
        a_ld: usize,
        b: *const u32,
        b_pair: usize,
        b_col: usize,
        c: *mut f32,
        ldc: usize,
        alpha: f32,
    }

    /// One register block: `mv` vectors of rows from `i0`, `N` columns from `j0`, pairs
    /// `p0 .. p0 + kc`; adds to `c` when `add`, and masks the last vector's lanes.
    ///
    /// # Safety
    /// AVX512_BF16, AVX-512 F; every word and float the block touches in bounds.
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    #[inline]
    unsafe fn block<const M: usize, const N: usize>(
        op: Op,
        i0: usize,
        j0: usize,
        p0: usize,
        kc: usize,
        add: bool,
        last: __mmask16,
    ) {
        // SAFETY: the caller's bounds (the whole body).
        unsafe {
            let mut acc = [[_mm512_setzero_ps(); N]; M];
            let mut a = op.a.add(p0 * op.a_ld + i0);
            let mut b: [*const u32; N] =
                core::array::from_fn(|n| op.b.add(p0 * op.b_pair + (j0 + n) * op.b_col));
            for _ in 0..kc {
                let av: [__m512bh; M] = core::array::from_fn(|v| {
                    core::mem::transmute::<__m512i, __m512bh>(_mm512_loadu_epi32(
                        a.add(v * LANES) as *const i32
                    ))
                });
                for n in 0..N {
                    let bv = core::mem::transmute::<__m512i, __m512bh>(_mm512_set1_epi32(
                        b[n].read_unaligned() as i32,
                    ));
                    for v in 0..M {
                        acc[v][n] = _mm512_dpbf16_ps(acc[v][n], av[v], bv);
                    }
                    b[n] = b[n].add(op.b_pair);
                }
                a = a.add(op.a_ld);
            }
            let alpha = _mm512_set1_ps(op.alpha);
            for (v, row) in acc.iter().enumerate() {
                let mask = if v == M - 1 { last } else { 0xffff };
                for (n, x) in row.iter().enumerate() {
                    let at = op.c.add((j0 + n) * op.ldc + i0 + v * LANES);
                    let y = if add {
                        _mm512_fmadd_ps(*x, alpha, _mm512_maskz_loadu_ps(mask, at))
                    } else {
                        _mm512_mul_ps(*x, alpha)
                    };
                    _mm512_mask_storeu_ps(at, mask, y);
                }
            }
        }
    }

    /// [`super::PackReport`]'s questions asked of 32 bf16 entries at a time (zero entries,
    /// as masked loads leave them, answer no to each).
    struct Scan {
        exponent: __m512i,
        mantissa: __m512i,
        magnitude: __m512i,
        small: __m512i,
        non_finite: u32,
        subnormal: u32,
        tiny: u32,
    }

    impl Scan {
        #[target_feature(enable = "avx512f,avx512bw")]
        fn new() -> Self {
            Self {
                exponent: _mm512_set1_epi16(0x7f80),
                mantissa: _mm512_set1_epi16(0x007f),
                magnitude: _mm512_set1_epi16(0x7fff),
                small: _mm512_set1_epi16((super::TINY_EXPONENT << 7) as i16),
                non_finite: 0,
                subnormal: 0,
                tiny: 0,
            }
        }

        #[target_feature(enable = "avx512f,avx512bw")]
        #[inline]
        fn add(&mut self, v: __m512i) {
            let e = _mm512_and_si512(v, self.exponent);
            self.non_finite |= _mm512_cmpeq_epi16_mask(e, self.exponent);
            self.subnormal |= _mm512_cmpeq_epi16_mask(e, _mm512_setzero_si512())
                & _mm512_test_epi16_mask(v, self.mantissa);
            self.tiny |=
                _mm512_cmplt_epu16_mask(e, self.small) & _mm512_test_epi16_mask(v, self.magnitude);
        }

        fn finish(self, report: &mut super::PackReport) {
            report.non_finite |= self.non_finite != 0;
            report.subnormal |= self.subnormal != 0;
            report.tiny |= self.tiny != 0;
        }
    }

    /// [`super::pack_columns`] for whole blocks of 16 pairs (32 rows) × 16 columns: each
    /// pair of rows becomes a vector of 16 words (one per column), and 16 such vectors are
    /// transposed so each column's 16 words are stored at once. Returns the pairs done
    /// (all of `rows`, whose count is a multiple of 32; none when `w < 16`).
    ///
    /// # Safety
    /// AVX-512 F and BW; every row has at least `w` entries; `dst` holds the first
    /// `rows.len() / 2 ≤ ld` words of each of `w` columns `ld` apart.
    #[target_feature(enable = "avx512f,avx512bw")]
    pub(super) unsafe fn pack_columns(
        rows: &[&[half::bf16]],
        w: usize,
        dst: &mut [u32],
        ld: usize,
        report: &mut super::PackReport,
    ) -> usize {
        if w < LANES {
            return 0;
        }
        let mut scan = Scan::new();
        let d = dst.as_mut_ptr();
        for p0 in (0..rows.len() / 2).step_by(LANES) {
            for c0 in (0..w - w % LANES).step_by(LANES) {
                let mut r = [_mm512_setzero_si512(); LANES];
                for (k, x) in r.iter_mut().enumerate() {
                    let (a, b) = (rows[2 * (p0 + k)], rows[2 * (p0 + k) + 1]);
                    // SAFETY: both rows hold columns `c0 .. c0 + 16`.
                    let (a, b) = unsafe {
                        (
                            _mm256_loadu_si256(a.as_ptr().add(c0) as *const __m256i),
                            _mm256_loadu_si256(b.as_ptr().add(c0) as *const __m256i),
                        )
                    };
                    *x = _mm512_or_si512(
                        _mm512_cvtepu16_epi32(a),
                        _mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(b)),
                    );
                    scan.add(*x);
                }
                let mut t = [_mm512_setzero_si512(); LANES];
                for k in 0..8 {
                    t[2 * k] = _mm512_unpacklo_epi32(r[2 * k], r[2 * k + 1]);
                    t[2 * k + 1] = _mm512_unpackhi_epi32(r[2 * k], r[2 * k + 1]);
                }
                for k in 0..4 {
                    r[4 * k] = _mm512_unpacklo_epi64(t[4 * k], t[4 * k + 2]);
                    r[4 * k + 1] = _mm512_unpackhi_epi64(t[4 * k], t[4 * k + 2]);
                    r[4 * k + 2] = _mm512_unpacklo_epi64(t[4 * k + 1], t[4 * k + 3]);
                    r[4 * k + 3] = _mm512_unpackhi_epi64(t[4 * k + 1], t[4 * k + 3]);
                }
                // r[4k + m], 128-bit lane L: rows 4k .. 4k + 4 of column 4L + m.
                for m in 0..4 {
                    let a = _mm512_shuffle_i32x4::<0x44>(r[m], r[4 + m]);
                    let b = _mm512_shuffle_i32x4::<0xee>(r[m], r[4 + m]);
                    let c = _mm512_shuffle_i32x4::<0x44>(r[8 + m], r[12 + m]);
                    let e = _mm512_shuffle_i32x4::<0xee>(r[8 + m], r[12 + m]);
                    let cols = [
                        (m, _mm512_shuffle_i32x4::<0x88>(a, c)),
                        (4 + m, _mm512_shuffle_i32x4::<0xdd>(a, c)),
                        (8 + m, _mm512_shuffle_i32x4::<0x88>(b, e)),
                        (12 + m, _mm512_shuffle_i32x4::<0xdd>(b, e)),
                    ];
                    for (col, v) in cols {
                        // SAFETY: column `c0 + col` has `ld ≥ p0 + 16` words.
                        unsafe { _mm512_storeu_epi32(d.add((c0 + col) * ld + p0) as *mut i32, v) };
                    }
                }
            }
        }
        scan.finish(report);
        rows.len() / 2
    }

    /// A row of `k` bf16 entries as its `pairs(k)` words (the bits as they are, an odd last
    /// entry paired with zero), with the report of its entries (see [`super::pack_rows`]).
    ///
    /// # Safety
    /// AVX-512 F and BW; `out` holds `row.len().div_ceil(2)` words.
    #[target_feature(enable = "avx512f,avx512bw")]
    pub(super) unsafe fn copy_row(
        row: &[half::bf16],
        out: &mut [u32],
        report: &mut super::PackReport,
    ) {
        let k = row.len();
        let mut scan = Scan::new();
        let (src, dst) = (row.as_ptr() as *const i16, out.as_mut_ptr() as *mut i16);
        let mut c = 0;
        while c < k {
            let left = k - c;
            let mask: __mmask32 = if left >= 32 {
                u32::MAX
            } else {
                (1u32 << left) - 1
            };
            // SAFETY: the load and the store are masked to the row's `k` entries, which
            // `out`'s words hold (an odd last entry's partner stays as written: zero below).
            unsafe {
                let v = _mm512_maskz_loadu_epi16(mask, src.add(c));
                scan.add(v);
                _mm512_mask_storeu_epi16(dst.add(c), mask, v);
            }
            c += 32;
        }
        if k % 2 == 1 {
            out[k / 2] &= 0x0000_ffff;
        }
        scan.finish(report);
    }

    /// Rows `a` and `b` (`w` entries each) as `w` pair words into `out`, with the report
    /// of their entries (see [`super::pack_row_pairs`]).
    ///
    /// # Safety
    /// AVX-512 F and BW; `a`, `b` and `out` hold at least `out.len()` entries.
    #[target_feature(enable = "avx512f,avx512bw")]
    pub(super) unsafe fn pair_rows(
        a: &[half::bf16],
        b: &[half::bf16],
        out: &mut [u32],
        report: &mut super::PackReport,
    ) {
        let w = out.len().min(a.len()).min(b.len());
        let mut scan = Scan::new();
        let mut c = 0;
        while c < w {
            let left = w - c;
            let mask: __mmask16 = if left >= LANES {
                0xffff
            } else {
                (1u16 << left) - 1
            };
            // SAFETY: loads and the store are masked to the `w` entries.
            unsafe {
                let x = _mm256_maskz_loadu_epi16(mask, a.as_ptr().add(c) as *const i16);
                let y = _mm256_maskz_loadu_epi16(mask, b.as_ptr().add(c) as *const i16);
                let v = _mm512_or_si512(
                    _mm512_cvtepu16_epi32(x),
                    _mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(y)),
                );
                scan.add(v);
                _mm512_mask_storeu_epi32(out.as_mut_ptr().add(c) as *mut i32, mask, v);
            }
            c += LANES;
        }
        scan.finish(report);
    }

    /// See [`super::pack_f32_rows`].
    ///
    /// # Safety
    /// AVX512_BF16, AVX-512 F and BW; the bounds [`super::pack_f32_rows`] asserts.
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    pub(super) unsafe fn pack_f32_rows(
        s: &[f32],
        ld_s: usize,
        rows: usize,
        cols: usize,
        dst: &mut [u32],
        ld: usize,
    ) {
        let (s, d) = (s.as_ptr(), dst.as_mut_ptr());
        let mask = |left: usize| -> __mmask16 {
            if left >= LANES {
                0xffff
            } else {
                (1u16 << left) - 1
            }
        };
        for j in 0..rows {
            let mut c = 0;
            while c < 2 * ld {
                // SAFETY: loads masked to the row's `cols` floats, stores inside its `ld`
                // words (`2·ld` entries; `2·ld` is a multiple of 32 or the row is padded
                // below).
                unsafe {
                    let (lo, hi) = (cols.saturating_sub(c), cols.saturating_sub(c + LANES));
                    let a = _mm512_maskz_loadu_ps(mask(lo), s.add(j * ld_s + c.min(cols)));
                    let b =
                        _mm512_maskz_loadu_ps(mask(hi), s.add(j * ld_s + (c + LANES).min(cols)));
                    let both = core::mem::transmute::<__m512bh, __m512i>(_mm512_cvtne2ps_pbh(b, a));
                    let words_left = ld - c / 2;
                    _mm512_mask_storeu_epi32(
                        d.add(j * ld + c / 2) as *mut i32,
                        mask(words_left),
                        both,
                    );
                }
                c += 2 * LANES;
            }
        }
    }

    /// Rounds f32 probabilities to bf16 pairs (see [`super::pack_probabilities`]).
    ///
    /// # Safety
    /// AVX512_BF16, AVX-512 F and BW; the bounds [`super::pack_probabilities`] asserts.
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    #[allow(clippy::too_many_arguments)]
    pub(super) unsafe fn pack_probabilities(
        s: &[f32],
        ld_s: usize,
        rows: usize,
        cols: usize,
        dst: &mut [u32],
        ld: usize,
        delta: &mut [f32],
    ) {
        let (s, d, dl) = (s.as_ptr(), dst.as_mut_ptr(), delta.as_mut_ptr());
        for p in 0..cols.div_ceil(2) {
            let (c0, c1) = (2 * p, 2 * p + 1);
            // SAFETY: column `c1` is read only when it exists; the caller's bounds.
            unsafe {
                let odd = (c1 < cols).then(|| s.add(c1 * ld_s));
                pack_pair(s.add(c0 * ld_s), odd, rows, (d.add(p * ld), None), dl);
            }
        }
    }

    /// See [`super::pack_probabilities_split`].
    ///
    /// # Safety
    /// As [`pack_probabilities`], for both `hi` and `lo`.
    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    pub(super) unsafe fn pack_probabilities_split(
        s: &[f32],
        ld_s: usize,
        rows: usize,
        cols: usize,
        hi: &mut [u32],
        lo: &mut [u32],
        ld: usize,
        delta: &mut [f32],
    ) {
        let (s, dl) = (s.as_ptr(), delta.as_mut_ptr());
        let (h, l) = (hi.as_mut_ptr(), lo.as_mut_ptr());
        for p in 0..cols.div_ceil(2) {
            let (c0, c1) = (2 * p, 2 * p + 1);
            // SAFETY: column `c1` is read only when it exists; the caller's bounds.
            unsafe {
                let odd = (c1 < cols).then(|| s.add(c1 * ld_s));
                let dst = (h.add(p * ld), Some(l.add(p * ld)));
                pack_pair(s.add(c0 * ld_s), odd, rows, dst, dl);
            }
        }
    }

    /// The mask of the first `rest` lanes of a vector (all sixteen from 16 on).
    #[inline]
    fn lanes_below(rest: usize) -> __mmask16 {
        if rest >= LANES {
            0xffff
        } else {
            (1u16 << rest) - 1
        }
    }

    /// Sixteen pairs of probabilities rounded to bf16 into their words (the even entry in
    /// the low half), and what rounding added to each lane's pair.
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    #[inline]
    fn round_pair(even: __m512, odd: __m512) -> (__m512i, __m512) {
        let (words, even_r, odd_r) = round_pair_values(even, odd);
        let added = _mm512_add_ps(_mm512_sub_ps(even_r, even), _mm512_sub_ps(odd_r, odd));
        (words, added)
    }

    /// One pair of columns rounded into its words, and the rounded values back in f32.
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    #[inline]
    fn round_pair_values(even: __m512, odd: __m512) -> (__m512i, __m512, __m512) {
        // Word i takes bf16 i of the even column and bf16 i of the odd one (which
        // `cvtne2ps` puts 16 places higher).
        let interleave = _mm512_set_epi16(
            31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6, 21, 5, 20,
            4, 19, 3, 18, 2, 17, 1, 16, 0,
        );
        // SAFETY: a vector of 32 bf16 is a vector of 512 bits.
        let both =
            unsafe { core::mem::transmute::<__m512bh, __m512i>(_mm512_cvtne2ps_pbh(odd, even)) };
        let words = _mm512_permutexvar_epi16(interleave, both);
        // The rounded values back in f32: a shift and a mask, lane for lane.
        let even_r = _mm512_castsi512_ps(_mm512_slli_epi32::<16>(words));
        let odd_r = _mm512_castsi512_ps(_mm512_and_si512(
            words,
            _mm512_set1_epi32(0xffff_0000_u32 as i32),
        ));
        (words, even_r, odd_r)
    }

    /// [`super::super::exp2::exp2_approx`] on the lanes of `keep` (zero elsewhere), with
    /// the same bits for every `x` below 128 and NaN: the same reduction `f = x − round(x)`
    /// and polynomial, `2^k` applied by `vscalefps` (which saturates to 0 and +∞ itself)
    /// instead of exponent bits and two range selects. `keep` must exclude `x < −126`
    /// (which the scalar version sends to 0); `+∞` gives NaN here, which callers never
    /// keep (its block overflowed).
    #[target_feature(enable = "avx512f")]
    #[inline]
    fn exp2(keep: __mmask16, x: __m512) -> __m512 {
        use super::super::exp2::EXP2_POLY;
        let k = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(x);
        let f = _mm512_sub_ps(x, k);
        let mut p = _mm512_set1_ps(EXP2_POLY[0]);
        for &c in &EXP2_POLY[1..] {
            p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(c));
        }
        _mm512_maskz_scalef_ps(keep, p, k)
    }

    /// Where a span's rows keep their running sums and rounding terms, and (for the one
    /// pass over a block with nothing hidden) their minima: `rows` floats at each.
    pub(super) struct Running {
        pub sums: *mut f32,
        pub terms: *mut f32,
        pub minima: Option<*mut f32>,
    }

    /// See [`super::OnePass::exponentiate`] and [`super::exponentiate_pairs`]; sixteen rows
    /// at a time, their running values in registers across the columns.
    ///
    /// # Safety
    /// AVX512_BF16, AVX-512 F and BW; the bounds those functions assert, `rows` floats at
    /// each pointer of `running`.
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    #[allow(clippy::too_many_arguments)]
    pub(super) unsafe fn exponentiate_span(
        s: &[f32],
        ld_s: usize,
        rows: usize,
        cols: usize,
        m_safe: &[f32],
        scale: f32,
        running: Running,
        dst: &mut [u32],
        ld: usize,
    ) {
        let (s, d) = (s.as_ptr(), dst.as_mut_ptr());
        let checked = running.minima.is_some();
        // Times 1 is exact (a NaN stays NaN).
        let scale = _mm512_set1_ps(scale);
        let lowest = _mm512_set1_ps(-126.0);
        let mut i = 0;
        while i < rows {
            let mask = lanes_below(rows - i);
            // SAFETY: lanes past `rows` are masked (and their words are zero pairs, inside
            // the vector that `ld` rounds up to); column `2p + 1` is read only when it
            // exists.
            unsafe {
                let m = _mm512_maskz_loadu_ps(mask, m_safe.as_ptr().add(i));
                let mut sum = _mm512_maskz_loadu_ps(mask, running.sums.add(i));
                // The sum of the rounded weights, `l + delta`, kept as such: two additions
                // a pair instead of four operations on the rounding terms.
                let entry = _mm512_maskz_loadu_ps(mask, running.terms.add(i));
                let mut rounded = _mm512_add_ps(sum, entry);
                let mut min = match running.minima {
                    Some(min) => _mm512_maskz_loadu_ps(mask, min.add(i)),
                    None => _mm512_setzero_ps(),
                };
                let mut p_of = |c: usize| {
                    let x = _mm512_mul_ps(_mm512_maskz_loadu_ps(mask, s.add(c * ld_s + i)), scale);
                    if checked {
                        // NaN is passed over (the second operand); the sums find it (a NaN
                        // score exponentiates to NaN).
                        min = _mm512_min_ps(x, min);
                    }
                    let x = _mm512_sub_ps(x, m);
                    // Not below −126 (NaN included): the scalar version's zero.
                    exp2(_mm512_mask_cmp_ps_mask::<_CMP_NLT_UQ>(mask, x, lowest), x)
                };
                for p in 0..cols.div_ceil(2) {
                    let even = p_of(2 * p);
                    sum = _mm512_add_ps(sum, even);
                    let odd = if 2 * p + 1 < cols {
                        let odd = p_of(2 * p + 1);
                        sum = _mm512_add_ps(sum, odd);
                        odd
                    } else {
                        _mm512_setzero_ps()
                    };
                    let (words, even_r, odd_r) = round_pair_values(even, odd);
                    _mm512_storeu_epi32(d.add(p * ld + i) as *mut i32, words);
                    rounded = _mm512_add_ps(_mm512_add_ps(rounded, even_r), odd_r);
                }
                _mm512_mask_storeu_ps(running.sums.add(i), mask, sum);
                let added = _mm512_sub_ps(rounded, sum);
                _mm512_mask_storeu_ps(running.terms.add(i), mask, added);
                if let Some(minima) = running.minima {
                    _mm512_mask_storeu_ps(minima.add(i), mask, min);
                }
            }
            i += LANES;
        }
    }

    /// One pair of columns of probabilities (`odd` zero when absent), `rows` of each, into
    /// the words at `dst` (whole vectors: lanes past `rows` get zero pairs); adds what
    /// rounding added to `delta`.
    ///
    /// # Safety
    /// AVX512_BF16, AVX-512 F and BW; `rows` floats at `even`, `odd` and `delta`, `rows`
    /// rounded up to [`LANES`] words at `dst` (both parts' words with a `lo` part: what
    /// rounding left, rounded in turn).
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    pub(super) unsafe fn pack_pair(
        even: *const f32,
        odd: Option<*const f32>,
        rows: usize,
        (dst, lo): (*mut u32, Option<*mut u32>),
        delta: *mut f32,
    ) {
        let mut i = 0;
        while i < rows {
            let mask = lanes_below(rows - i);
            // SAFETY: lanes past `rows` are masked; the caller's bounds.
            unsafe {
                let even_x = _mm512_maskz_loadu_ps(mask, even.add(i));
                let odd_x = match odd {
                    Some(odd) => _mm512_maskz_loadu_ps(mask, odd.add(i)),
                    None => _mm512_setzero_ps(),
                };
                let (words, mut added) = round_pair(even_x, odd_x);
                _mm512_storeu_epi32(dst.add(i) as *mut i32, words);
                if let Some(lo) = lo {
                    // What the first rounding left (exact: the rounded value is within a
                    // factor of two of the probability), rounded in turn; `added` is then
                    // what the second rounding added.
                    let even_r = _mm512_castsi512_ps(_mm512_slli_epi32::<16>(words));
                    let odd_r = _mm512_castsi512_ps(_mm512_and_si512(
                        words,
                        _mm512_set1_epi32(0xffff_0000_u32 as i32),
                    ));
                    let (lo_words, lo_added) =
                        round_pair(_mm512_sub_ps(even_x, even_r), _mm512_sub_ps(odd_x, odd_r));
                    _mm512_storeu_epi32(lo.add(i) as *mut i32, lo_words);
                    added = lo_added;
                }
                let sum = _mm512_add_ps(_mm512_maskz_loadu_ps(mask, delta.add(i)), added);
                _mm512_mask_storeu_ps(delta.add(i), mask, sum);
            }
            i += LANES;
        }
    }

    /// `c (+)= alpha · A·B` over register blocks (see [`super::product`]).
    ///
    /// # Safety
    /// AVX512_BF16, AVX-512 F and BW; the bounds [`super::product`] asserts.
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    pub(super) unsafe fn product(
        a: Lanes<'_>,
        b: Broadcast<'_>,
        c: Columns<'_>,
        alpha: f32,
        accumulate: bool,
        kp: usize,
    ) {
        let op = Op {
            a: a.words.as_ptr(),
            a_ld: a.ld,
            b: b.words.as_ptr(),
            b_pair: b.pair_stride,
            b_col: b.col_stride,
            c: c.data.as_mut_ptr(),
            ldc: c.ld,
            alpha,
        };
        let (m, n) = (c.rows, c.cols);
        let vectors = m.div_ceil(LANES);
        let tail = m - (vectors - 1) * LANES;
        let last_mask: __mmask16 = if tail == LANES {
            0xffff
        } else {
            (1u16 << tail) - 1
        };
        let mut p0 = 0;
        while p0 < kp.max(1) {
            let kc = (kp - p0).min(KC);
            let add = accumulate || p0 > 0;
            let mut j = 0;
            while j < n {
                let nb = (n - j).min(NB);
                let mut v = 0;
                while v < vectors {
                    let mv = (vectors - v).min(MV);
                    let last = if v + mv == vectors { last_mask } else { 0xffff };
                    let i0 = v * LANES;
                    // SAFETY: the block lies inside the asserted bounds.
                    unsafe {
                        macro_rules! dispatch {
                            ($($mm:literal),*) => {
                                match (mv, nb) {
                                    $(
                                        ($mm, 1) => block::<$mm, 1>(op, i0, j, p0, kc, add, last),
                                        ($mm, 2) => block::<$mm, 2>(op, i0, j, p0, kc, add, last),
                                        ($mm, 3) => block::<$mm, 3>(op, i0, j, p0, kc, add, last),
                                        ($mm, 4) => block::<$mm, 4>(op, i0, j, p0, kc, add, last),
                                        ($mm, 5) => block::<$mm, 5>(op, i0, j, p0, kc, add, last),
                                        ($mm, 6) => block::<$mm, 6>(op, i0, j, p0, kc, add, last),
                                    )*
                                    _ => unreachable!("register blocks are at most {MV} × {NB}"),
                                }
                            };
                        }
                        dispatch!(1, 2, 3, 4);
                    }
                    v += mv;
                }
                j += nb;
            }
            p0 += KC;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use faer::Mat;

    fn bf(x: f32) -> bf16 {
        bf16::from_f32(x)
    }

    /// `C = α·A·Bᵀ` through the packers and the product, against f64 on the same bf16
    /// inputs, for shapes that leave partial vectors, blocks and pairs.
    #[test]
    fn products_match_f64_on_ragged_shapes() {
        if !has_instructions() {
            return;
        }
        for &(m, n, k) in &[
            (1, 1, 1),
            (5, 3, 7),
            (17, 13, 9),
            (64, 6, 64),
            (128, 37, 65),
            (70, 64, 300),
        ] {
            let a = Mat::from_fn(m, k, |i, c| bf(((i * 7 + c * 3) % 11) as f32 / 4.0 - 1.2));
            let bt = Mat::from_fn(n, k, |j, c| bf(((j * 5 + c) % 13) as f32 / 8.0 - 0.7));
            let ld = m.next_multiple_of(LANES);
            let mut ap = vec![0u32; pairs(k) * ld];
            assert!(pack_lanes(a.as_ref(), &mut ap, ld));
            let mut bp = vec![0u32; n * pairs(k)];
            assert!(pack_rows(bt.as_ref(), &mut bp, pairs(k)).exact());
            let mut c = vec![f32::NAN; n * m];
            let cols = Columns {
                data: &mut c,
                rows: m,
                cols: n,
                ld: m,
            };
            let b = Broadcast {
                words: &bp,
                pairs: pairs(k),
                cols: n,
                pair_stride: 1,
                col_stride: pairs(k),
            };
            product(
                Lanes {
                    words: &ap,
                    rows: m,
                    ld,
                },
                b,
                cols,
                0.5,
                false,
            );
            for i in 0..m {
                for j in 0..n {
                    let exact: f64 = (0..k)
                        .map(|c| f64::from(a[(i, c)].to_f32()) * f64::from(bt[(j, c)].to_f32()))
                        .sum();
                    let got = f64::from(c[j * m + i]);
                    assert!(
                        (got - 0.5 * exact).abs() <= 1e-5 * (1.0 + exact.abs()),
                        "{m}x{n}x{k} ({i},{j}): {got} vs {}",
                        0.5 * exact
                    );
                }
            }
        }
    }

    /// Every f16 value splits exactly into its two bf16 parts, the low one at most 2⁻⁸ of
    /// it; infinities and NaNs go whole into the high part.
    #[test]
    fn every_f16_splits_exactly_in_two_bf16_parts() {
        let all: Vec<f32> = (0..=u16::MAX)
            .map(|b| half::f16::from_bits(b).to_f32())
            .collect();
        let m = MatRef::from_row_major_slice(&all, 256, 256);
        let (mut hi, mut lo) = (vec![bf16::ZERO; all.len()], vec![bf16::ZERO; all.len()]);
        assert!(!split_bf16(m, &mut hi, &mut lo));
        for ((&x, h), l) in all.iter().zip(&hi).zip(&lo) {
            let (h, l) = (h.to_f32(), l.to_f32());
            if x.is_finite() {
                assert_eq!(h + l, x, "{x}: {h} + {l}");
                assert!(l.abs() <= x.abs() / 256.0, "{x}: {l}");
                assert!(!subnormal(bf(h).to_bits()) && !subnormal(bf(l).to_bits()));
            } else {
                assert!(
                    l == 0.0 && (h == x || (h.is_nan() && x.is_nan())),
                    "{x}: {h}, {l}"
                );
            }
        }
    }

    /// P split in two parts: `hi` the rounded probability, `hi + lo` within 2⁻¹⁶ of it,
    /// and `delta` what the two added to each row.
    #[test]
    fn probabilities_split_in_two_parts_sum_within_2_16() {
        if !has_instructions() {
            return;
        }
        let (rows, cols, ld_s): (usize, usize, usize) = (21, 7, 24);
        let s: Vec<f32> = (0..cols * ld_s)
            .map(|i| ((i * 7919) % 1000) as f32 / 997.0 + 1e-3)
            .collect();
        let ld = rows.next_multiple_of(LANES);
        let (mut hi, mut lo) = (vec![0u32; pairs(cols) * ld], vec![0u32; pairs(cols) * ld]);
        let mut delta = vec![0.0f32; rows];
        pack_probabilities_split(&s, ld_s, (rows, cols), &mut hi, &mut lo, ld, &mut delta);
        let part = |w: &[u32], i: usize, c: usize| {
            let word = w[(c / 2) * ld + i];
            let bits = if c.is_multiple_of(2) {
                word & 0xffff
            } else {
                word >> 16
            };
            bf16::from_bits(bits as u16).to_f32()
        };
        for i in 0..rows {
            let mut added = 0.0f64;
            for c in 0..cols {
                let p = s[c * ld_s + i];
                let (h, l) = (part(&hi, i, c), part(&lo, i, c));
                assert_eq!(h, bf(p).to_f32());
                let sum = f64::from(h) + f64::from(l);
                assert!(
                    (sum - f64::from(p)).abs() <= f64::from(p) / 65536.0,
                    "{p}: {h} + {l}"
                );
                added += sum - f64::from(p);
            }
            assert!((f64::from(delta[i]) - added).abs() <= 1e-12, "row {i}");
        }
    }

    /// `acc += P·V` with P rounded from f32 and V interleaved by row pairs, against f64 on
    /// the rounded P.
    #[test]
    fn probabilities_times_values_accumulate() {
        if !has_instructions() {
            return;
        }
        for &(m, keys, w) in &[
            (3, 5, 4),
            (16, 16, 16),
            (40, 33, 64),
            (128, 512, 64),
            (9, 1, 3),
        ] {
            let s: Vec<f32> = (0..m * keys)
                .map(|x| ((x * 37) % 101) as f32 / 50.0)
                .collect();
            let v = Mat::from_fn(
                keys,
                w,
                |j, c| bf(((j * 3 + c * 5) % 17) as f32 / 4.0 - 2.0),
            );
            let ld = m.next_multiple_of(LANES);
            let mut pp = vec![0u32; pairs(keys) * ld];
            let mut delta = vec![0.0f32; m];
            pack_probabilities(&s, m, m, keys, &mut pp, ld, &mut delta);
            for (i, d) in delta.iter().enumerate() {
                let want: f32 = (0..keys)
                    .map(|j| bf(s[j * m + i]).to_f32() - s[j * m + i])
                    .sum();
                assert!((d - want).abs() <= 1e-5, "row {i}: {d} vs {want}");
            }
            let mut vp = vec![0u32; pairs(keys) * w];
            assert!(pack_row_pairs(v.as_ref(), &mut vp).exact());
            let mut acc = vec![1.0f32; w * m];
            let b = Broadcast {
                words: &vp,
                pairs: pairs(keys),
                cols: w,
                pair_stride: w,
                col_stride: 1,
            };
            product(
                Lanes {
                    words: &pp,
                    rows: m,
                    ld,
                },
                b,
                Columns {
                    data: &mut acc,
                    rows: m,
                    cols: w,
                    ld: m,
                },
                1.0,
                true,
            );
            for i in 0..m {
                for c in 0..w {
                    let exact: f64 = 1.0
                        + (0..keys)
                            .map(|j| {
                                f64::from(bf(s[j * m + i]).to_f32()) * f64::from(v[(j, c)].to_f32())
                            })
                            .sum::<f64>();
                    let got = f64::from(acc[c * m + i]);
                    assert!(
                        (got - exact).abs() <= 1e-5 * (1.0 + exact.abs()),
                        "{m}x{keys}x{w} ({i},{c})"
                    );
                }
            }
        }
    }

    /// The register transpose of whole blocks agrees with the word-by-word packing.
    #[test]
    fn columns_are_packed_alike_on_every_path() {
        for &(n, w) in &[(64, 64), (70, 33), (32, 16), (5, 20), (96, 130)] {
            let m = Mat::from_fn(n, w, |j, c| {
                bf16::from_bits((j * 131 + c * 7) as u16 & 0x3fff | 0x3c00)
            });
            let ld = pairs(n).next_multiple_of(16) + 16;
            let mut fast = vec![7u32; w * ld];
            let r = pack_columns(m.as_ref(), &mut fast, ld);
            assert!(r.exact());
            for c in 0..w {
                for p in 0..ld {
                    let lo = if 2 * p < n {
                        m[(2 * p, c)].to_bits()
                    } else {
                        0
                    };
                    let hi = if 2 * p + 1 < n {
                        m[(2 * p + 1, c)].to_bits()
                    } else {
                        0
                    };
                    assert_eq!(fast[c * ld + p], word(lo, hi), "{n}x{w} ({p},{c})");
                }
            }
            let mut bad = m.clone();
            bad[(n - 1, w - 1)] = bf16::NAN;
            assert!(pack_columns(bad.as_ref(), &mut fast, ld).non_finite);
            bad[(n - 1, w - 1)] = bf16::from_bits(3);
            assert!(pack_columns(bad.as_ref(), &mut fast, ld).subnormal);
            bad[(0, 0)] = bf16::INFINITY;
            bad[(n - 1, w - 1)] = bf16::ONE;
            assert!(pack_columns(bad.as_ref(), &mut fast, ld).non_finite);
        }
    }

    /// f32 rows rounded to bf16 pairs, padding zero.
    #[test]
    fn f32_rows_are_rounded_in_pairs() {
        if !has_instructions() {
            return;
        }
        for &(rows, cols, ld_s) in &[(3, 5, 8), (16, 32, 32), (7, 100, 128), (2, 1, 4)] {
            let s: Vec<f32> = (0..rows * ld_s)
                .map(|x| (x as f32 * 0.37).sin() * 3.0)
                .collect();
            let ld = pairs(cols).next_multiple_of(16);
            let mut dst = vec![7u32; rows * ld];
            pack_f32_rows(&s, ld_s, rows, cols, &mut dst, ld);
            for j in 0..rows {
                for p in 0..ld {
                    let at = |c: usize| {
                        if c < cols {
                            bf(s[j * ld_s + c]).to_bits()
                        } else {
                            0
                        }
                    };
                    assert_eq!(
                        dst[j * ld + p],
                        word(at(2 * p), at(2 * p + 1)),
                        "{rows}x{cols} ({j},{p})"
                    );
                }
            }
        }
    }

    #[test]
    fn packers_report_subnormal_and_non_finite_entries() {
        let tiny = bf16::from_bits(0x0001);
        let m = Mat::from_fn(3, 4, |i, c| if (i, c) == (2, 3) { tiny } else { bf(1.0) });
        let mut buf = vec![0u32; 64];
        assert!(pack_rows(m.as_ref(), &mut buf, 2).subnormal);
        assert!(pack_columns(m.as_ref(), &mut buf, 2).subnormal);
        assert!(pack_row_pairs(m.as_ref(), &mut buf).subnormal);
        assert!(!pack_lanes(m.as_ref(), &mut buf, 16));
        let m = Mat::from_fn(3, 4, |i, c| {
            if (i, c) == (1, 0) {
                bf16::INFINITY
            } else {
                bf(1.0)
            }
        });
        let r = pack_row_pairs(m.as_ref(), &mut buf);
        assert!(r.non_finite && !r.subnormal && !r.exact());
    }
}

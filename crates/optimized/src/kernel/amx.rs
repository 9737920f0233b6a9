//! bf16 tile products on AMX (`tdpbf16ps`): `C (+)= α·A·B` with A and B in bf16 and C
//! in f32, sixteen rows by sixteen columns per instruction — the native-precision tiles
//! ([`attn_core::Precision::Native`]) on Intel Xeons since Sapphire Rapids.
//!
//! The passes keep their column-major tiles (one key per column of the score tile, one
//! value column per column of the accumulator), so both products are computed transposed:
//! `Sᵀ = K·Qᵀ` and `Oᵀ += Vᵀ·Pᵀ`. A is then K's rows as they are, or V's columns
//! ([`super::pair_dot::pack_columns`]); B is the query-side operand in pairs across the
//! lanes, the [`Lanes`] layout the pair products use too (Q once per query tile, P rounded
//! once per block). Tiles are configured once per product call and released after it.
//!
//! Linux grants a process the tile state only on request
//! (`arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)`); it is asked once, and a refusal
//! makes [`available`] false (the passes then multiply in f32). Like `vdpbf16ps`, the tile
//! product reads subnormal inputs as zero and flushes subnormal results.

use std::sync::OnceLock;

use super::Isa;
use super::pair_dot::{LANES, Lanes};

/// Rows of a tile, and words (pairs of bf16) of a tile row.
pub(crate) const TILE: usize = 16;

/// Whether this process multiplies bf16 on AMX: the chosen path, and the tile state
/// granted by the kernel.
pub(crate) fn available() -> bool {
    static GRANTED: OnceLock<bool> = OnceLock::new();
    cfg!(target_arch = "x86_64")
        && Isa::current() == Isa::Amx
        && *GRANTED.get_or_init(|| {
            #[cfg(target_arch = "x86_64")]
            {
                x86::request_tile_state()
            }
            #[cfg(not(target_arch = "x86_64"))]
            false
        })
}

/// Zeroed values whose first lies on a cache line (64 bytes), for packed tile operands and
/// the tiles' outputs: a tile row (64 bytes) then spans one line, not two (the allocator
/// only promises 16 bytes; measured on the Intel Xeon, aligned operands made the bf16
/// forward 1.18× faster).
// Not `Clone`: a copy of the vector would keep `start` but not the alignment.
#[derive(Debug, Default)]
pub(crate) struct CacheLines<T> {
    buf: Vec<T>,
    start: usize,
    len: usize,
}

/// Packed tile operands: words of bf16 pairs.
pub(crate) type LineWords = CacheLines<u32>;

impl<T: Copy + Default> CacheLines<T> {
    /// Values of a line.
    const LINE: usize = 64 / core::mem::size_of::<T>();

    fn aligned(buf: Vec<T>, len: usize) -> Self {
        // The offset (in values) of the first line boundary at or after the start.
        let misaligned = (buf.as_ptr() as usize / core::mem::size_of::<T>()) % Self::LINE;
        let start = (Self::LINE - misaligned) % Self::LINE;
        Self { buf, start, len }
    }

    /// `len` zero values (`None`: too many to count), or the error of an allocation that
    /// failed, naming `what`.
    pub(crate) fn zeroed(what: &'static str, len: Option<usize>) -> attn_core::Result<Self> {
        let buf: Vec<T> = attn_core::zeroed(what, len.and_then(|n| n.checked_add(Self::LINE)))?;
        let len = buf.len() - Self::LINE;
        Ok(Self::aligned(buf, len))
    }

    /// [`CacheLines::zeroed`] for scratch sized by the tile plan, which a task cannot do
    /// without (an allocation failure aborts, as `vec!` does).
    pub(crate) fn new(len: usize) -> Self {
        Self::aligned(vec![T::default(); len + Self::LINE], len)
    }
}

impl<T> core::ops::Deref for CacheLines<T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        &self.buf[self.start..self.start + self.len]
    }
}

impl<T> core::ops::DerefMut for CacheLines<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        &mut self.buf[self.start..self.start + self.len]
    }
}

/// The A operand of a tile product: `rows` rows of `ld` words (pairs of bf16), of which the
/// first `pairs` (a multiple of [`TILE`], the padding zero) are multiplied; the buffer
/// holds `rows` rounded up to whole tiles.
#[derive(Debug, Clone, Copy)]
pub(crate) struct TileRows<'a> {
    pub words: &'a [u32],
    pub ld: usize,
    pub rows: usize,
    pub pairs: usize,
}

/// `c (+)= alpha · A·B`: C has `a.rows` rows of `b.rows` floats, `ld_c` apart; B is
/// `a.pairs` pairs across `b.rows` lanes (padded with zero pairs; `b.words` may start
/// inside a longer row of lanes). `accumulate` adds to `c` (then `alpha` must be 1). Lanes
/// past `b.rows` of a row of C may be overwritten up to `ld_c` (the tiles' scratch lanes);
/// nothing past a row's `ld_c` floats is. Does nothing without AMX.
pub(crate) fn product(
    a: TileRows<'_>,
    b: Lanes<'_>,
    c: &mut [f32],
    ld_c: usize,
    alpha: f32,
    accumulate: bool,
) {
    product_sum(&[(a, b)], c, ld_c, alpha, accumulate);
}

/// `c (+)= alpha · Σ A_t·B_t` over the `terms`, every term shaped as the first (see
/// [`product`]), the sum kept in the tiles: the three products of operands split exactly
/// in two bf16 parts ([`Split`]).
pub(crate) fn product_sum(
    terms: &[(TileRows<'_>, Lanes<'_>)],
    c: &mut [f32],
    ld_c: usize,
    alpha: f32,
    accumulate: bool,
) {
    let Some(&(first, first_b)) = terms.first() else {
        return;
    };
    let (rows, cols) = (first.rows, first_b.rows);
    assert!(!accumulate || alpha == 1.0);
    assert!(terms.len() <= MAX_TERMS);
    for &(a, b) in terms {
        let TileRows {
            ld: a_ld, pairs, ..
        } = a;
        assert!(a.rows == rows && b.rows == cols);
        assert!(
            pairs.is_multiple_of(TILE)
                && a_ld >= pairs
                && b.ld.is_multiple_of(LANES)
                && b.ld >= cols
        );
        // The last tile row reads its `pairs` words, not a whole `a_ld`.
        let last_row = rows.next_multiple_of(TILE).saturating_sub(1);
        assert!(rows == 0 || pairs == 0 || a.words.len() >= last_row * a_ld + pairs);
        let lanes = cols.next_multiple_of(TILE);
        assert!(pairs == 0 || b.words.len() >= (pairs - 1) * b.ld + lanes);
    }
    assert!(ld_c >= cols && c.len() >= rows * ld_c);
    if rows == 0 || cols == 0 {
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if available() {
        // SAFETY: AMX-BF16 and AMX-TILE are part of the chosen path and the tile state was
        // granted; the asserts above bound every tile load and store (edge tiles go through
        // a buffer of their own).
        unsafe { x86::product(terms, c, ld_c, alpha, accumulate) }
    }
}

/// The most terms [`product_sum`] takes.
pub(crate) const MAX_TERMS: usize = 3;

/// An operand split exactly into two bf16 parts, `hi + lo` (an f16 entry has 11
/// significant bits: `hi` is it rounded to bf16's 8, `lo` the rest, which bf16 holds
/// exactly), or one part (`lo` `None`: bf16 as it is). A product of two split operands is
/// `hi·hi + lo·hi + hi·lo`: the term left out, `lo·lo`, is below `2⁻¹⁶` of the product.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Split<T> {
    pub hi: T,
    pub lo: Option<T>,
}

/// `c (+)= alpha · A·B` for operands split in parts ([`Split`]): one tile product per pair
/// of parts whose product counts, summed in the tiles.
pub(crate) fn split_product(
    a: Split<TileRows<'_>>,
    b: Split<Lanes<'_>>,
    c: &mut [f32],
    ld_c: usize,
    alpha: f32,
    accumulate: bool,
) {
    let mut terms = [(a.hi, b.hi); MAX_TERMS];
    let mut n = 1;
    if let Some(lo) = a.lo {
        terms[n] = (lo, b.hi);
        n += 1;
    }
    if let Some(lo) = b.lo {
        terms[n] = (a.hi, lo);
        n += 1;
    }
    product_sum(&terms[..n], c, ld_c, alpha, accumulate);
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use core::arch::asm;

    use super::{Lanes, MAX_TERMS, TILE, TileRows};

    /// `arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)`: whether Linux grants this
    /// process the tile state.
    pub(super) fn request_tile_state() -> bool {
        #[cfg(target_os = "linux")]
        {
            const ARCH_PRCTL: i64 = 158;
            const ARCH_REQ_XCOMP_PERM: i64 = 0x1023;
            const XFEATURE_XTILEDATA: i64 = 18;
            let ret: i64;
            // SAFETY: the arch_prctl system call with these arguments only changes this
            // process's permissions; it reads and writes no memory of ours.
            unsafe {
                asm!(
                    "syscall",
                    inlateout("rax") ARCH_PRCTL => ret,
                    in("rdi") ARCH_REQ_XCOMP_PERM,
                    in("rsi") XFEATURE_XTILEDATA,
                    lateout("rcx") _,
                    lateout("r11") _,
                    options(nostack),
                );
            }
            ret == 0
        }
        #[cfg(not(target_os = "linux"))]
        false
    }

    /// Palette 1 with all eight tiles as 16 rows of 64 bytes.
    #[repr(C, align(64))]
    struct Config([u8; 64]);

    impl Config {
        fn full() -> Self {
            let mut cfg = [0u8; 64];
            cfg[0] = 1;
            for t in 0..8 {
                cfg[16 + 2 * t] = (4 * TILE) as u8;
                cfg[48 + t] = TILE as u8;
            }
            Self(cfg)
        }
    }

    /// Where one 16 × 16 block of C goes: `ptr`, rows `stride` bytes apart.
    #[derive(Clone, Copy)]
    struct Out {
        ptr: *mut f32,
        stride: usize,
    }

    /// One product of a block's sum: A's rows at `a` (`sa` bytes apart), B's lanes at `b`
    /// (`sb` bytes apart), `pairs` deep.
    #[derive(Clone, Copy)]
    struct Term {
        a: *const u32,
        sa: usize,
        b: *const u32,
        sb: usize,
        pairs: usize,
    }

    impl Term {
        /// The term `rows` rows of A and `lanes` lanes of B on.
        ///
        /// # Safety
        /// Both stay inside the operands.
        #[inline(always)]
        unsafe fn at(self, rows: usize, lanes: usize) -> Self {
            // SAFETY: the caller's bounds.
            unsafe {
                Self {
                    a: self.a.add(rows * (self.sa / 4)),
                    b: self.b.add(lanes),
                    ..self
                }
            }
        }
    }

    /// One 16 × 16 block of C through tile 0, the sum of the `terms`.
    ///
    /// # Safety
    /// Tiles configured; each term's A and B hold its `pairs` pairs; 16 × 16 floats at `c`
    /// readable and writable.
    #[inline(always)]
    unsafe fn block<const N: usize>(terms: &[Term; N], c: Out, add: bool) {
        // SAFETY: the caller's bounds.
        unsafe {
            if add {
                asm!("tileloadd tmm0, [{c} + {s}]", c = in(reg) c.ptr, s = in(reg) c.stride, options(nostack, readonly));
            } else {
                asm!("tilezero tmm0", options(nostack, nomem));
            }
            for &Term {
                a,
                sa,
                b,
                sb,
                pairs,
            } in terms
            {
                let mut p = 0;
                while p < pairs {
                    asm!(
                        "tileloadd tmm4, [{a} + {sa}]",
                        "tileloadd tmm6, [{b} + {sb}]",
                        "tdpbf16ps tmm0, tmm4, tmm6",
                        a = in(reg) a.add(p),
                        sa = in(reg) sa,
                        b = in(reg) b.add(p * (sb / 4)),
                        sb = in(reg) sb,
                        options(nostack, readonly),
                    );
                    p += TILE;
                }
            }
            asm!("tilestored [{c} + {s}], tmm0", c = in(reg) c.ptr, s = in(reg) c.stride, options(nostack));
        }
    }

    /// Two by two 16 × 16 blocks of C through tiles 0–3 (rows of A at each term's `a` and
    /// 16 rows on, lanes of B at its `b` and 16 lanes on), the sum of the `terms`: each A
    /// and B tile loaded once for two products.
    ///
    /// # Safety
    /// As [`block`], for 32 rows of A, 32 lanes of B and the four blocks of `c`.
    #[inline(always)]
    unsafe fn block_2x2<const N: usize>(terms: &[Term; N], c: [Out; 4], add: bool) {
        // SAFETY: the caller's bounds.
        unsafe {
            if add {
                asm!(
                    "tileloadd tmm0, [{c0} + {s0}]",
                    "tileloadd tmm1, [{c1} + {s1}]",
                    "tileloadd tmm2, [{c2} + {s2}]",
                    "tileloadd tmm3, [{c3} + {s3}]",
                    c0 = in(reg) c[0].ptr, s0 = in(reg) c[0].stride,
                    c1 = in(reg) c[1].ptr, s1 = in(reg) c[1].stride,
                    c2 = in(reg) c[2].ptr, s2 = in(reg) c[2].stride,
                    c3 = in(reg) c[3].ptr, s3 = in(reg) c[3].stride,
                    options(nostack, readonly),
                );
            } else {
                asm!(
                    "tilezero tmm0",
                    "tilezero tmm1",
                    "tilezero tmm2",
                    "tilezero tmm3",
                    options(nostack, nomem)
                );
            }
            for &Term {
                a,
                sa,
                b,
                sb,
                pairs,
            } in terms
            {
                let a16 = 16 * (sa / 4);
                let b16 = 16;
                let mut p = 0;
                while p < pairs {
                    asm!(
                        "tileloadd tmm4, [{a0} + {sa}]",
                        "tileloadd tmm6, [{b0} + {sb}]",
                        "tdpbf16ps tmm0, tmm4, tmm6",
                        "tileloadd tmm7, [{b1} + {sb}]",
                        "tdpbf16ps tmm1, tmm4, tmm7",
                        "tileloadd tmm5, [{a1} + {sa}]",
                        "tdpbf16ps tmm2, tmm5, tmm6",
                        "tdpbf16ps tmm3, tmm5, tmm7",
                        a0 = in(reg) a.add(p),
                        a1 = in(reg) a.add(a16 + p),
                        sa = in(reg) sa,
                        b0 = in(reg) b.add(p * (sb / 4)),
                        b1 = in(reg) b.add(p * (sb / 4) + b16),
                        sb = in(reg) sb,
                        options(nostack, readonly),
                    );
                    p += TILE;
                }
            }
            asm!(
                "tilestored [{c0} + {s0}], tmm0",
                "tilestored [{c1} + {s1}], tmm1",
                "tilestored [{c2} + {s2}], tmm2",
                "tilestored [{c3} + {s3}], tmm3",
                c0 = in(reg) c[0].ptr, s0 = in(reg) c[0].stride,
                c1 = in(reg) c[1].ptr, s1 = in(reg) c[1].stride,
                c2 = in(reg) c[2].ptr, s2 = in(reg) c[2].stride,
                c3 = in(reg) c[3].ptr, s3 = in(reg) c[3].stride,
                options(nostack),
            );
        }
    }

    /// See [`super::product_sum`].
    ///
    /// # Safety
    /// AMX-BF16 and AMX-TILE, the tile state granted; the bounds [`super::product_sum`]
    /// asserts (one to [`MAX_TERMS`] terms).
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn product(
        operands: &[(TileRows<'_>, Lanes<'_>)],
        c: &mut [f32],
        ld_c: usize,
        alpha: f32,
        accumulate: bool,
    ) {
        let (rows, cols) = (operands[0].0.rows, operands[0].1.rows);
        let term = |(a, b): &(TileRows<'_>, Lanes<'_>)| Term {
            a: a.words.as_ptr(),
            sa: 4 * a.ld,
            b: b.words.as_ptr(),
            sb: 4 * b.ld,
            pairs: a.pairs,
        };
        // The number of terms a constant, so that each block's loop over them unrolls.
        // SAFETY: the caller's bounds, for every term.
        unsafe {
            match operands {
                [x] => product_n([term(x)], (rows, cols), c, ld_c, alpha, accumulate),
                [x, y] => product_n([term(x), term(y)], (rows, cols), c, ld_c, alpha, accumulate),
                [x, y, z] => {
                    let terms = [term(x), term(y), term(z)];
                    product_n(terms, (rows, cols), c, ld_c, alpha, accumulate)
                }
                _ => unreachable!("between one and {MAX_TERMS} terms"),
            }
        }
    }

    /// [`product`] for `N` terms.
    ///
    /// # Safety
    /// As [`product`].
    #[target_feature(enable = "avx512f")]
    unsafe fn product_n<const N: usize>(
        whole_terms: [Term; N],
        (rows, cols): (usize, usize),
        c: &mut [f32],
        ld_c: usize,
        alpha: f32,
        accumulate: bool,
    ) {
        let cfg = Config::full();
        let (row_tiles, col_tiles) = (rows.div_ceil(TILE), cols.div_ceil(TILE));
        // Blocks that do not fit C (past its last row, or across a row's end) go through
        // buffers of their own.
        let mut edges = [[0.0f32; TILE * TILE]; 4];
        let whole = |r: usize, i: usize| (r + 1) * TILE <= rows && (i + 1) * TILE <= ld_c;
        // SAFETY: the configuration is valid for palette 1; every block below stays inside
        // the asserted bounds: whole blocks in place, the others through `edges`.
        unsafe {
            asm!("ldtilecfg [{}]", in(reg) cfg.0.as_ptr(), options(nostack, readonly));
            let mut r = 0;
            while r < row_tiles {
                let rt = (row_tiles - r).min(2);
                let mut i = 0;
                while i < col_tiles {
                    let it = (col_tiles - i).min(2);
                    let mut outs = [Out {
                        ptr: core::ptr::null_mut(),
                        stride: 0,
                    }; 4];
                    for (slot, out) in outs.iter_mut().enumerate().take(4) {
                        let (dr, di) = (slot / 2, slot % 2);
                        if dr >= rt || di >= it {
                            continue;
                        }
                        let (r0, i0) = ((r + dr) * TILE, (i + di) * TILE);
                        *out = if whole(r + dr, i + di) {
                            Out {
                                ptr: c.as_mut_ptr().add(r0 * ld_c + i0),
                                stride: 4 * ld_c,
                            }
                        } else {
                            let edge = &mut edges[slot];
                            let (nr, nc) = ((rows - r0).min(TILE), (cols.min(ld_c) - i0).min(TILE));
                            edge.fill(0.0);
                            if accumulate {
                                for rr in 0..nr {
                                    edge[rr * TILE..rr * TILE + nc]
                                        .copy_from_slice(&c[(r0 + rr) * ld_c + i0..][..nc]);
                                }
                            }
                            Out {
                                ptr: edge.as_mut_ptr(),
                                stride: 4 * TILE,
                            }
                        };
                    }
                    let terms = whole_terms.map(|w| w.at(r * TILE, i * TILE));
                    if rt == 2 && it == 2 {
                        block_2x2(&terms, outs, accumulate);
                    } else {
                        for (slot, out) in outs.iter().enumerate() {
                            let (dr, di) = (slot / 2, slot % 2);
                            if dr < rt && di < it {
                                let at = terms.map(|t| t.at(dr * TILE, di * TILE));
                                block(&at, *out, accumulate);
                            }
                        }
                    }
                    for (slot, out) in outs.iter().enumerate() {
                        let (dr, di) = (slot / 2, slot % 2);
                        if dr >= rt || di >= it {
                            continue;
                        }
                        let (r0, i0) = ((r + dr) * TILE, (i + di) * TILE);
                        if whole(r + dr, i + di) {
                            if alpha != 1.0 {
                                for rr in 0..TILE {
                                    for x in &mut c[(r0 + rr) * ld_c + i0..][..TILE] {
                                        *x *= alpha;
                                    }
                                }
                            }
                        } else {
                            let edge = &edges[slot];
                            let (nr, nc) = ((rows - r0).min(TILE), (cols.min(ld_c) - i0).min(TILE));
                            for rr in 0..nr {
                                for (x, &y) in c[(r0 + rr) * ld_c + i0..][..nc]
                                    .iter_mut()
                                    .zip(&edge[rr * TILE..])
                                {
                                    *x = y * alpha;
                                }
                            }
                            let _ = out;
                        }
                    }
                    i += it;
                }
                r += rt;
            }
            asm!("tilerelease", options(nostack, nomem));
        }
    }
}

#[cfg(test)]
mod tests {
    use faer::Mat;
    use half::bf16;

    use super::*;
    use crate::kernel::pair_dot::{pack_lanes, pack_rows, pairs};

    /// f16 operands split in two bf16 parts: `C = α·A·Bᵀ` from the three tile products
    /// within 2⁻¹⁶ of each term of the f64 product of the f16 inputs (plus f32 summation),
    /// far closer than one bf16 product of the rounded inputs.
    #[test]
    fn split_products_keep_f16_precision() {
        use crate::kernel::pair_dot::split_bf16;
        use half::f16;
        if !available() {
            return;
        }
        let (m, n, k) = (37, 45, 72);
        let a = Mat::from_fn(n, k, |j, c| {
            f16::from_f32(((j * 37 + c * 11) % 101) as f32 / 50.3 - 1.01).to_f32()
        });
        let bt = Mat::from_fn(m, k, |i, c| {
            f16::from_f32(((i * 13 + c * 29) % 97) as f32 / 31.7 - 1.5).to_f32()
        });
        let split = |x: &Mat<f32>| {
            let (mut hi, mut lo) = (
                vec![bf16::ZERO; x.nrows() * k],
                vec![bf16::ZERO; x.nrows() * k],
            );
            assert!(split_bf16(x.as_ref(), &mut hi, &mut lo));
            let part = |p: Vec<bf16>| Mat::from_fn(x.nrows(), k, |i, c| p[i * k + c]);
            (part(hi), part(lo))
        };
        let ((a_hi, a_lo), (b_hi, b_lo)) = (split(&a), split(&bt));
        let padded = pairs(k).next_multiple_of(TILE);
        let ld = m.next_multiple_of(LANES);
        let rows = |x: &Mat<bf16>| {
            let mut w = vec![0u32; n.next_multiple_of(TILE) * padded];
            assert!(pack_rows(x.as_ref(), &mut w, padded).exact());
            w
        };
        let lanes = |x: &Mat<bf16>| {
            let mut w = vec![0u32; padded * ld];
            assert!(pack_lanes(x.as_ref(), &mut w, ld));
            w
        };
        let (ah, al, bh, bl) = (rows(&a_hi), rows(&a_lo), lanes(&b_hi), lanes(&b_lo));
        let a_op = |words| TileRows {
            words,
            ld: padded,
            rows: n,
            pairs: padded,
        };
        let b_op = |words| Lanes { words, rows: m, ld };
        let mut c = vec![0.0f32; n * m];
        let a_split = Split {
            hi: a_op(&ah),
            lo: Some(a_op(&al)),
        };
        let b_split = Split {
            hi: b_op(&bh),
            lo: Some(b_op(&bl)),
        };
        split_product(a_split, b_split, &mut c, m, 0.25, false);
        let mut one_part = vec![0.0f32; n * m];
        product(a_op(&ah), b_op(&bh), &mut one_part, m, 0.25, false);
        let (mut worst, mut worst_one_part) = (0.0f64, 0.0f64);
        for j in 0..n {
            for i in 0..m {
                let terms = (0..k).map(|c| f64::from(a[(j, c)]) * f64::from(bt[(i, c)]));
                let exact = 0.25 * terms.clone().sum::<f64>();
                let magnitude = 0.25 * terms.map(f64::abs).sum::<f64>();
                let bound = magnitude * (2f64.powi(-16) + (k as f64 + 2.0) * 2f64.powi(-24));
                let err = (f64::from(c[j * m + i]) - exact).abs();
                assert!(err <= bound, "({j},{i}): {err:e} > {bound:e}");
                worst = worst.max(err / magnitude);
                let err = (f64::from(one_part[j * m + i]) - exact).abs();
                worst_one_part = worst_one_part.max(err / magnitude);
            }
        }
        assert!(
            worst * 16.0 < worst_one_part,
            "{worst:e} vs {worst_one_part:e}"
        );
    }

    /// `C (+)= α·A·Bᵀ` through the packers and the tiles against f64 on the same bf16
    /// inputs, for shapes that leave partial tiles, single tiles and blocks of four.
    #[test]
    fn tile_products_match_f64_on_ragged_shapes() {
        if !available() {
            return;
        }
        let shapes = [
            (1, 1, 1),
            (5, 3, 7),
            (17, 13, 40),
            (64, 64, 64),
            (128, 37, 65),
            (70, 100, 300),
        ];
        for &(m, n, k) in &shapes {
            for accumulate in [false, true] {
                let a = Mat::from_fn(n, k, |j, c| {
                    bf16::from_f32(((j * 5 + c) % 13) as f32 / 8.0 - 0.7)
                });
                let bt = Mat::from_fn(m, k, |i, c| {
                    bf16::from_f32(((i * 7 + c * 3) % 11) as f32 / 4.0 - 1.2)
                });
                let padded = pairs(k).next_multiple_of(TILE);
                let mut ap = vec![0u32; n.next_multiple_of(TILE) * padded];
                assert!(pack_rows(a.as_ref(), &mut ap, padded).exact());
                let ld = m.next_multiple_of(LANES);
                let mut bp = vec![0u32; padded * ld];
                assert!(pack_lanes(bt.as_ref(), &mut bp, ld));
                let ld_c = m + 3;
                let mut c = vec![1.0f32; n * ld_c];
                let alpha = if accumulate { 1.0 } else { 0.5 };
                let b = Lanes {
                    words: &bp,
                    rows: m,
                    ld,
                };
                let rows = TileRows {
                    words: &ap,
                    ld: padded,
                    rows: n,
                    pairs: padded,
                };
                product(rows, b, &mut c, ld_c, alpha, accumulate);
                for j in 0..n {
                    for i in 0..m {
                        let dot: f64 = (0..k)
                            .map(|c| f64::from(a[(j, c)].to_f32()) * f64::from(bt[(i, c)].to_f32()))
                            .sum();
                        let want = if accumulate { 1.0 + dot } else { 0.5 * dot };
                        let got = f64::from(c[j * ld_c + i]);
                        assert!(
                            (got - want).abs() <= 1e-5 * (1.0 + want.abs()),
                            "{m}x{n}x{k} ({j},{i}): {got} vs {want}"
                        );
                    }
                    // Past the lanes of a row (whole tiles here end before `ld_c`) nothing is
                    // written.
                    assert!(c[j * ld_c + m..(j + 1) * ld_c].iter().all(|&x| x == 1.0));
                }
            }
        }
    }
}

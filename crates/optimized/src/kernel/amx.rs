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

/// `c (+)= alpha · A·B`, C with `rows` rows of `b.rows` floats, `ld_c` apart: A is `rows`
/// rows (padded to a multiple of [`TILE`]) of `a_ld` words, `pairs` of them used (a
/// multiple of [`TILE`], the padding zero); B is `pairs` pairs across `b.rows` lanes
/// (padded with zero pairs). `accumulate` adds to `c` (then `alpha` must be 1). Does
/// nothing without AMX.
#[allow(clippy::too_many_arguments)]
pub(crate) fn product(
    a: &[u32],
    a_ld: usize,
    rows: usize,
    b: Lanes<'_>,
    pairs: usize,
    c: &mut [f32],
    ld_c: usize,
    alpha: f32,
    accumulate: bool,
) {
    let cols = b.rows;
    assert!(!accumulate || alpha == 1.0);
    assert!(pairs % TILE == 0 && a_ld >= pairs && b.ld % LANES == 0 && b.ld >= cols);
    assert!(a.len() >= rows.next_multiple_of(TILE) * a_ld);
    assert!(b.words.len() >= pairs * b.ld && ld_c >= cols && c.len() >= rows * ld_c);
    if rows == 0 || cols == 0 {
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if available() {
        // SAFETY: AMX-BF16 and AMX-TILE are part of the chosen path and the tile state was
        // granted; the asserts above bound every tile load and store (edge tiles go through
        // a buffer of their own).
        unsafe { x86::product(a, a_ld, rows, b, pairs, c, ld_c, alpha, accumulate) }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use core::arch::asm;

    use super::{Lanes, TILE};

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

    /// Palette 1 with tiles 0–2 as 16 rows of 64 bytes.
    #[repr(C, align(64))]
    struct Config([u8; 64]);

    impl Config {
        fn full() -> Self {
            let mut cfg = [0u8; 64];
            cfg[0] = 1;
            for t in 0..3 {
                cfg[16 + 2 * t] = (4 * TILE) as u8;
                cfg[48 + t] = TILE as u8;
            }
            Self(cfg)
        }
    }

    /// One 16 × 16 block of C: rows `r0..`, columns `i0..`, at `c` with `ld_c` floats
    /// between rows, through tile 0.
    ///
    /// # Safety
    /// Tiles configured; 16 × 16 floats at `c` (rows `ld_c` apart) readable and writable.
    #[allow(clippy::too_many_arguments)]
    #[inline(always)]
    unsafe fn block(
        a: *const u32,
        a_stride: usize,
        b: *const u32,
        b_stride: usize,
        pairs: usize,
        c: *mut f32,
        c_stride: usize,
        accumulate: bool,
    ) {
        // SAFETY: the caller's bounds; A and B hold `pairs` pairs.
        unsafe {
            if accumulate {
                asm!("tileloadd tmm0, [{c} + {s}]", c = in(reg) c, s = in(reg) c_stride, options(nostack, readonly));
            } else {
                asm!("tilezero tmm0", options(nostack, nomem));
            }
            let mut p = 0;
            while p < pairs {
                asm!(
                    "tileloadd tmm1, [{a} + {sa}]",
                    "tileloadd tmm2, [{b} + {sb}]",
                    "tdpbf16ps tmm0, tmm1, tmm2",
                    a = in(reg) a.add(p),
                    sa = in(reg) a_stride,
                    b = in(reg) b.add(p * (b_stride / 4)),
                    sb = in(reg) b_stride,
                    options(nostack, readonly),
                );
                p += TILE;
            }
            asm!("tilestored [{c} + {s}], tmm0", c = in(reg) c, s = in(reg) c_stride, options(nostack));
        }
    }

    /// See [`super::product`].
    ///
    /// # Safety
    /// AMX-BF16 and AMX-TILE, the tile state granted; the bounds [`super::product`] asserts.
    #[allow(clippy::too_many_arguments)]
    pub(super) unsafe fn product(
        a: &[u32],
        a_ld: usize,
        rows: usize,
        b: Lanes<'_>,
        pairs: usize,
        c: &mut [f32],
        ld_c: usize,
        alpha: f32,
        accumulate: bool,
    ) {
        let cols = b.rows;
        let cfg = Config::full();
        let mut edge = [0.0f32; TILE * TILE];
        // SAFETY: the configuration is valid for palette 1; every block below stays inside
        // the asserted bounds: whole blocks in place, edge blocks through `edge`.
        unsafe {
            asm!("ldtilecfg [{}]", in(reg) cfg.0.as_ptr(), options(nostack, readonly));
            for r0 in (0..rows).step_by(TILE) {
                let a_rows = a.as_ptr().add(r0 * a_ld);
                for i0 in (0..cols).step_by(TILE) {
                    let b_cols = b.words.as_ptr().add(i0);
                    let (nr, nc) = ((rows - r0).min(TILE), (cols - i0).min(TILE));
                    let whole = r0 + TILE <= rows && i0 + TILE <= ld_c;
                    if whole {
                        let at = c.as_mut_ptr().add(r0 * ld_c + i0);
                        block(
                            a_rows,
                            4 * a_ld,
                            b_cols,
                            4 * b.ld,
                            pairs,
                            at,
                            4 * ld_c,
                            accumulate,
                        );
                        if alpha != 1.0 {
                            for r in 0..TILE {
                                for x in &mut c[(r0 + r) * ld_c + i0..][..TILE] {
                                    *x *= alpha;
                                }
                            }
                        }
                    } else {
                        for r in 0..TILE {
                            for i in 0..TILE {
                                edge[r * TILE + i] = if accumulate && r < nr && i < nc {
                                    c[(r0 + r) * ld_c + i0 + i]
                                } else {
                                    0.0
                                };
                            }
                        }
                        let at = edge.as_mut_ptr();
                        block(
                            a_rows,
                            4 * a_ld,
                            b_cols,
                            4 * b.ld,
                            pairs,
                            at,
                            4 * TILE,
                            accumulate,
                        );
                        for r in 0..nr {
                            for i in 0..nc {
                                c[(r0 + r) * ld_c + i0 + i] = edge[r * TILE + i] * alpha;
                            }
                        }
                    }
                }
            }
            asm!("tilerelease", options(nostack, nomem));
        }
    }
}

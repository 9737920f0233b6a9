//! Storage types the engine reads and writes: f32, and f16/bf16 with f32 compute.
//!
//! Half-precision inputs are widened to f32 for the f32 GEMM tiles: each K/V tile once per
//! visit into the task's scratch (a vectorised conversion, F16C / AVX-512 for f16, a 16-bit
//! shift for bf16), Q once per query tile; scores, softmax state and accumulators are f32.
//! bf16 at native precision on AVX512_BF16 is packed for [`super::pair_dot`] instead.

use core::ops::Range;

use faer::reborrow::ReborrowMut;
use faer::{MatRef, RowMut};
use half::{bf16, f16};

use attn_core::Dtype;

use super::{Isa, multiversion};

/// `n` zeros of `T` (`None`: too many to count) from the allocator's zeroed memory, or
/// [`attn_core::Error::Allocation`] naming `what`. A large buffer comes from pages the
/// system maps only when they are first written, so a page pool's memory grows with the
/// pages it hands out instead of being written whole up front.
pub(crate) fn zeroed_lazily<T: ZeroBits>(
    what: &'static str,
    n: Option<usize>,
) -> attn_core::Result<Vec<T>> {
    let fail = || attn_core::Error::allocation_of::<T>(what, n);
    let n = n.ok_or_else(fail)?;
    let layout = std::alloc::Layout::array::<T>(n).map_err(|_| fail())?;
    if layout.size() == 0 {
        return Ok(Vec::new());
    }
    // SAFETY: the layout's size is not zero.
    let ptr = unsafe { std::alloc::alloc_zeroed(layout) }.cast::<T>();
    if ptr.is_null() {
        return Err(fail());
    }
    // SAFETY: `ptr` comes from the global allocator with the layout of `[T; n]` (capacity
    // `n`), and all-zero bits are a valid `T` (`ZeroBits`: +0.0 for each of the sealed f32,
    // f16, bf16; 0 for a code byte), so its `n` elements are initialised.
    Ok(unsafe { Vec::from_raw_parts(ptr, n, n) })
}

/// `n` words of zero, lazily mapped as [`zeroed_lazily`]'s, that tasks on several threads
/// may share: the buffer of a sum whose entries each task writes its own of (the bias
/// gradient). [`atomics_into_f32`] hands it back as f32 values without a copy.
pub(crate) fn zeroed_atomics(
    what: &'static str,
    n: Option<usize>,
) -> attn_core::Result<Vec<core::sync::atomic::AtomicU32>> {
    let words = core::mem::ManuallyDrop::new(zeroed_lazily::<f32>(what, n)?);
    let (ptr, len, cap) = (words.as_ptr().cast_mut(), words.len(), words.capacity());
    huge_pages(ptr.cast(), len * 4);
    // SAFETY: `AtomicU32` has the size, alignment and bit validity of `u32`, hence of the
    // f32 words allocated (all zero); the allocation moves from one vector to the other.
    Ok(unsafe { Vec::from_raw_parts(ptr.cast::<core::sync::atomic::AtomicU32>(), len, cap) })
}

/// Asks Linux to back the whole pages of `bytes` bytes at `ptr` with transparent huge
/// pages: a buffer of hundreds of MiB written once then takes a fault per 2 MiB instead of
/// per 4 KiB. Advice only: refused or elsewhere, nothing changes.
fn huge_pages(ptr: *mut u8, bytes: usize) {
    #[cfg(target_os = "linux")]
    {
        const PAGE: usize = 4096;
        let start = (ptr as usize).next_multiple_of(PAGE);
        let end = (ptr as usize + bytes) / PAGE * PAGE;
        if end > start + (2 << 20) {
            // SAFETY: the range lies within the caller's allocation, on page boundaries;
            // MADV_HUGEPAGE only advises the kernel (it never changes the contents).
            let _ = unsafe {
                libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_HUGEPAGE)
            };
        }
    }
    let _ = (ptr, bytes);
}

/// The caller's f32 buffer as words that tasks on several threads may share (as
/// [`zeroed_atomics`]'s), for as long as it is borrowed.
pub(crate) fn atomic_words(values: &mut [f32]) -> &[core::sync::atomic::AtomicU32] {
    let (ptr, len) = (values.as_mut_ptr(), values.len());
    // SAFETY: `AtomicU32` has the size, alignment and bit validity of `u32`, hence of an
    // f32; `values` is borrowed exclusively for the lifetime of the result, so nothing
    // else reads or writes it meanwhile.
    unsafe { core::slice::from_raw_parts(ptr.cast::<core::sync::atomic::AtomicU32>(), len) }
}

/// The f32 values whose bits `words` hold, in the same allocation.
pub(crate) fn atomics_into_f32(words: Vec<core::sync::atomic::AtomicU32>) -> Vec<f32> {
    let words = core::mem::ManuallyDrop::new(words);
    let (ptr, len, cap) = (words.as_ptr().cast_mut(), words.len(), words.capacity());
    // SAFETY: as in `zeroed_atomics`, the other way round: every bit pattern is an f32, and
    // the vector owned the allocation alone.
    unsafe { Vec::from_raw_parts(ptr.cast::<f32>(), len, cap) }
}

/// Adds `src` into the f32 values whose bits `dst` holds, entry by entry (as many as both
/// have), vectorised — or, with `store`, writes it there: the first sum into a page of a
/// [`zeroed_atomics`] buffer should not read it (a page read while still the zero page, then
/// written, is copied and flushed from every core's TLB: half the time of a bias gradient
/// went to those interrupts). For a buffer whose entries `dst` only the calling task
/// touches while it runs (the bias gradient's tasks write disjoint entries).
pub(crate) fn add_into_words(dst: &[core::sync::atomic::AtomicU32], src: &[f32], store: bool) {
    let n = dst.len().min(src.len());
    // SAFETY: `AtomicU32` is an `UnsafeCell<u32>` of u32's layout, so its words may be
    // written through a shared reference; no other thread reads or writes these `n`
    // entries while this task runs (its caller's contract), so the plain accesses race
    // with nothing, and every bit pattern is an f32.
    let dst = unsafe { core::slice::from_raw_parts_mut(dst.as_ptr().cast::<f32>().cast_mut(), n) };
    if store {
        dst.copy_from_slice(&src[..n]);
    } else {
        add_rows(dst, &src[..n]);
    }
}

#[inline(always)]
fn add_rows_body<const FMA: bool>(dst: &mut [f32], src: &[f32]) {
    for (d, &s) in dst.iter_mut().zip(src) {
        *d += s;
    }
}

super::multiversion! {
    fn add_rows(dst: &mut [f32], src: &[f32]) = add_rows_body
}

/// Types whose all-zero bits are a value (zero), which [`zeroed_lazily`] may hand out: the
/// elements, and the code bytes of quantized pages.
pub(crate) trait ZeroBits: Copy {}

impl<T: Element> ZeroBits for T {}

impl ZeroBits for u8 {}

pub(crate) mod sealed {
    /// Keeps [`super::Element`] closed to the three types the kernels know.
    pub trait Sealed {}
    impl Sealed for f32 {}
    impl Sealed for half::f16 {}
    impl Sealed for half::bf16 {}
}

/// An element type the engine takes as input or writes as output.
///
/// ```
/// use attn_optimized::Element;
/// let x = half::bf16::from_f32(1.5);
/// assert_eq!(x.to_f32(), 1.5);
/// let mut wide = [0.0f32; 3];
/// half::f16::widen(&[half::f16::ONE, half::f16::MAX, half::f16::NEG_INFINITY], &mut wide);
/// assert_eq!(wide, [1.0, 65504.0, f32::NEG_INFINITY]);
/// ```
///
/// The widening methods never panic on mismatched lengths, and treat them the same way for
/// every type: they convert what fits in both the source and the destination and leave
/// the rest of the destination as it was.
///
/// ```
/// use attn_optimized::Element;
/// use half::bf16;
/// let src = [bf16::ONE, bf16::from_f32(2.0), bf16::from_f32(3.0)];
/// let mut short = [0.0f32; 2];
/// assert_eq!(bf16::widen(&src, &mut short), 2); // the first two
/// assert_eq!(short, [1.0, 2.0]);
/// let mut long = [-1.0f32; 4];
/// assert_eq!(bf16::widen(&src, &mut long), 3); // all three; the fourth is untouched
/// assert_eq!(long, [1.0, 2.0, 3.0, -1.0]);
/// // Rows of width d = 2 into one chunk and a half: the first row is cut to 2, the second
/// // has no whole chunk and is skipped.
/// let mut rows = [-1.0f32; 3];
/// bf16::widen_rows(&[&src[..], &src[..]], 2, &mut rows);
/// assert_eq!(rows, [1.0, 2.0, -1.0]);
/// ```
pub trait Element: sealed::Sealed + Copy + Send + Sync + 'static {
    /// Which type this is, for code that chooses by type (kernels loading straight from
    /// memory, bindings, reports).
    const DTYPE: Dtype;
    /// Short name for reports (`"f32"`, `"f16"`, `"bf16"`): `DTYPE.name()`.
    const NAME: &'static str = Self::DTYPE.name();
    /// Whether tiles must be widened to f32 before the GEMMs (false for f32 itself).
    const WIDENS: bool = true;
    /// Widens to f32 (exact).
    fn to_f32(self) -> f32;
    /// Rounds an f32 to this type (to nearest, ties to even).
    fn from_f32(x: f32) -> Self;
    /// Widens the first `n = min(src.len(), dst.len())` elements of `src` into `dst[..n]`,
    /// vectorised, and returns `n`; the rest of `dst` is left as it was.
    fn widen(src: &[Self], dst: &mut [f32]) -> usize;
    /// Widens rows of length `d` into consecutive `d`-float chunks of `dst`, with one CPU
    /// dispatch for the whole block: row `i` goes to `dst[i·d .. (i+1)·d]`, as
    /// [`Element::widen`] would put it there (a longer row is cut to `d` elements, a shorter
    /// one fills the start of its chunk); rows past the last whole chunk are skipped, and
    /// `d = 0` writes nothing.
    fn widen_rows(src: &[&[Self]], d: usize, dst: &mut [f32]) {
        if d == 0 {
            return;
        }
        for (row, out) in src.iter().zip(dst.chunks_exact_mut(d)) {
            Self::widen(row, out);
        }
    }
    /// The same view as f32 when no conversion is needed (f32 itself).
    fn as_f32(m: MatRef<'_, Self>) -> Option<MatRef<'_, f32>>;
    /// The same view as bf16 when this is bf16 (what the native bf16 products read).
    ///
    /// ```
    /// use attn_optimized::Element;
    /// let m = faer::Mat::from_fn(2, 2, |_, _| half::bf16::ONE);
    /// assert!(half::bf16::as_bf16(m.as_ref()).is_some());
    /// assert!(half::f16::as_bf16(faer::Mat::from_fn(1, 1, |_, _| half::f16::ONE).as_ref()).is_none());
    /// ```
    fn as_bf16(m: MatRef<'_, Self>) -> Option<MatRef<'_, bf16>> {
        let _ = m;
        None
    }
    /// Rounds the first `n = min(src.len(), dst.len())` values of `src` into `dst[..n]`,
    /// each bit for bit as [`Element::from_f32`] rounds it but vectorised (F16C / AVX-512
    /// for f16), and returns `n`; the rest of `dst` is left as it was.
    ///
    /// ```
    /// use attn_optimized::Element;
    /// use half::f16;
    /// let src = [1.0f32, 65520.0, 1e-8, f32::NEG_INFINITY, 0.1, 3.0];
    /// let mut dst = [f16::ZERO; 6];
    /// assert_eq!(f16::narrow(&src, &mut dst), 6);
    /// assert!(dst.iter().zip(&src).all(|(d, &s)| d.to_bits() == f16::from_f32(s).to_bits()));
    /// ```
    fn narrow(src: &[f32], dst: &mut [Self]) -> usize;
    /// Whether the value is finite, read from its bits (no conversion).
    ///
    /// ```
    /// use attn_optimized::Element;
    /// assert!(half::f16::MAX.is_finite() && !half::bf16::NAN.is_finite());
    /// ```
    fn is_finite(self) -> bool;
}

impl Element for f32 {
    const DTYPE: Dtype = Dtype::F32;
    const WIDENS: bool = false;
    fn to_f32(self) -> f32 {
        self
    }
    fn from_f32(x: f32) -> Self {
        x
    }
    fn widen(src: &[Self], dst: &mut [f32]) -> usize {
        let n = src.len().min(dst.len());
        dst[..n].copy_from_slice(&src[..n]);
        n
    }
    fn as_f32(m: MatRef<'_, Self>) -> Option<MatRef<'_, f32>> {
        Some(m)
    }
    fn narrow(src: &[f32], dst: &mut [Self]) -> usize {
        Self::widen(src, dst)
    }
    fn is_finite(self) -> bool {
        f32::is_finite(self)
    }
}

/// The two half types differ only in their type tag and their conversion kernels.
macro_rules! half_element {
    ($t:ty, $dtype:ident, $widen:ident, $widen_rows:ident, $narrow:ident, $exponent:literal, $as_bf16:path) => {
        impl Element for $t {
            const DTYPE: Dtype = Dtype::$dtype;
            fn to_f32(self) -> f32 {
                <$t>::to_f32(self)
            }
            fn from_f32(x: f32) -> Self {
                <$t>::from_f32(x)
            }
            fn widen(src: &[Self], dst: &mut [f32]) -> usize {
                let n = src.len().min(dst.len());
                $widen(&src[..n], &mut dst[..n]);
                n
            }
            fn widen_rows(src: &[&[Self]], d: usize, dst: &mut [f32]) {
                // The kernels take `min(row, d)` of each row into whole `d`-float chunks.
                if d > 0 {
                    $widen_rows(src, d, dst);
                }
            }
            fn as_f32(_: MatRef<'_, Self>) -> Option<MatRef<'_, f32>> {
                None
            }
            fn as_bf16(m: MatRef<'_, Self>) -> Option<MatRef<'_, bf16>> {
                $as_bf16(m)
            }
            fn narrow(src: &[f32], dst: &mut [Self]) -> usize {
                let n = src.len().min(dst.len());
                $narrow(&src[..n], &mut dst[..n]);
                n
            }
            fn is_finite(self) -> bool {
                // All exponent bits set: an infinity or a NaN.
                self.to_bits() & $exponent != $exponent
            }
        }
    };
}

half_element!(
    f16,
    F16,
    widen_f16,
    widen_f16_rows,
    narrow_f16,
    0x7c00,
    not_bf16
);
half_element!(
    bf16,
    Bf16,
    widen_bf16,
    widen_bf16_rows,
    narrow_bf16,
    0x7f80,
    Some
);

fn not_bf16(_: MatRef<'_, f16>) -> Option<MatRef<'_, bf16>> {
    None
}

#[inline(always)]
fn narrow_bf16_body<const FMA: bool>(src: &[f32], dst: &mut [bf16]) {
    for (d, &s) in dst.iter_mut().zip(src) {
        *d = bf16::from_f32(s);
    }
}

multiversion! {
    /// f32 → bf16, `half`'s rounding (integer arithmetic on the bits, inlined) in a loop
    /// LLVM vectorises.
    fn narrow_bf16(src: &[f32], dst: &mut [bf16]) = narrow_bf16_body
}

/// f32 → f16 with `vcvtps2ph` (round to nearest even: what `half` itself runs on a CPU
/// with F16C) where the CPU has it, `half`'s conversion for the rest.
fn narrow_f16(src: &[f32], dst: &mut [f16]) {
    let n = src.len().min(dst.len());
    #[allow(unused_mut)]
    let mut done = 0;
    #[cfg(target_arch = "x86_64")]
    match Isa::current().vectors() {
        // SAFETY: AVX-512F is part of `Isa::Avx512`, detected on this CPU.
        Isa::Avx512 => done = unsafe { x86::narrow_f16_avx512(&src[..n], &mut dst[..n]) },
        // SAFETY: AVX and F16C are part of `Isa::Avx2`, detected on this CPU.
        Isa::Avx2 => done = unsafe { x86::narrow_f16_f16c(&src[..n], &mut dst[..n]) },
        _ => {}
    }
    for (d, &s) in dst[done..n].iter_mut().zip(&src[done..n]) {
        *d = f16::from_f32(s);
    }
}

#[inline(always)]
fn widen_bf16_body<const FMA: bool>(src: &[bf16], dst: &mut [f32]) {
    for (d, s) in dst.iter_mut().zip(src) {
        *d = f32::from_bits(u32::from(s.to_bits()) << 16);
    }
}

multiversion! {
    /// bf16 → f32 is the bf16 bits in the top half of the f32: a shift LLVM vectorises.
    fn widen_bf16(src: &[bf16], dst: &mut [f32]) = widen_bf16_body
}

#[inline(always)]
fn widen_bf16_rows_body<const FMA: bool>(src: &[&[bf16]], d: usize, dst: &mut [f32]) {
    for (row, out) in src.iter().zip(dst.chunks_exact_mut(d.max(1))) {
        widen_bf16_body::<FMA>(row, out);
    }
}

multiversion! {
    /// [`widen_bf16`] over a block of rows.
    fn widen_bf16_rows(src: &[&[bf16]], d: usize, dst: &mut [f32]) = widen_bf16_rows_body
}

/// f16 rows → f32 with one CPU dispatch for the block.
fn widen_f16_rows(src: &[&[f16]], d: usize, dst: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if Isa::current().vectors() == Isa::Avx512 {
        // SAFETY: AVX-512F is part of `Isa::Avx512`, detected on this CPU.
        return unsafe { x86::widen_f16_rows_avx512(src, d, dst) };
    }
    for (row, out) in src.iter().zip(dst.chunks_exact_mut(d.max(1))) {
        widen_f16(row, out);
    }
}

/// f16 → f32 with `vcvtph2ps` (AVX-512: 16 lanes, F16C: 8 lanes) where the CPU has it.
fn widen_f16(src: &[f16], dst: &mut [f32]) {
    let n = src.len().min(dst.len());
    #[allow(unused_mut)]
    let mut done = 0;
    #[cfg(target_arch = "x86_64")]
    match Isa::current().vectors() {
        // SAFETY: AVX-512F is part of `Isa::Avx512`, detected on this CPU.
        Isa::Avx512 => done = unsafe { x86::widen_f16_avx512(&src[..n], &mut dst[..n]) },
        // SAFETY: AVX and F16C are part of `Isa::Avx2`, detected on this CPU.
        Isa::Avx2 => done = unsafe { x86::widen_f16_f16c(&src[..n], &mut dst[..n]) },
        _ => {}
    }
    for (d, s) in dst[done..n].iter_mut().zip(&src[done..n]) {
        *d = s.to_f32();
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use core::arch::x86_64::*;

    use half::f16;

    /// Widens each row into its `d`-float chunk of `dst`.
    #[target_feature(enable = "avx512f")]
    pub(super) fn widen_f16_rows_avx512(src: &[&[f16]], d: usize, dst: &mut [f32]) {
        for (row, out) in src.iter().zip(dst.chunks_exact_mut(d.max(1))) {
            let n = row.len().min(out.len());
            let done = widen_f16_avx512(&row[..n], &mut out[..n]);
            for (o, h) in out[done..n].iter_mut().zip(&row[done..n]) {
                *o = h.to_f32();
            }
        }
    }

    /// Converts the first `16·⌊n/16⌋` elements; returns how many.
    #[target_feature(enable = "avx512f")]
    pub(super) fn widen_f16_avx512(src: &[f16], dst: &mut [f32]) -> usize {
        let blocks = src.len().min(dst.len()) / 16;
        for b in 0..blocks {
            // SAFETY: elements b·16 .. b·16+16 are in bounds of both slices (b < blocks),
            // f16 is a 16-bit `repr(transparent)` type, and unaligned loads/stores are used.
            unsafe {
                let h = _mm256_loadu_si256(src.as_ptr().add(b * 16).cast::<__m256i>());
                _mm512_storeu_ps(dst.as_mut_ptr().add(b * 16), _mm512_cvtph_ps(h));
            }
        }
        blocks * 16
    }

    /// Rounds the first `16·⌊n/16⌋` elements; returns how many.
    #[target_feature(enable = "avx512f")]
    pub(super) fn narrow_f16_avx512(src: &[f32], dst: &mut [f16]) -> usize {
        let blocks = src.len().min(dst.len()) / 16;
        for b in 0..blocks {
            // SAFETY: elements b·16 .. b·16+16 are in bounds of both slices (b < blocks),
            // f16 is a 16-bit `repr(transparent)` type, and unaligned loads/stores are used.
            unsafe {
                let x = _mm512_loadu_ps(src.as_ptr().add(b * 16));
                let h = _mm512_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(x);
                _mm256_storeu_si256(dst.as_mut_ptr().add(b * 16).cast::<__m256i>(), h);
            }
        }
        blocks * 16
    }

    /// Rounds the first `8·⌊n/8⌋` elements; returns how many.
    #[target_feature(enable = "avx,f16c")]
    pub(super) fn narrow_f16_f16c(src: &[f32], dst: &mut [f16]) -> usize {
        let blocks = src.len().min(dst.len()) / 8;
        for b in 0..blocks {
            // SAFETY: elements b·8 .. b·8+8 are in bounds of both slices (b < blocks), f16 is
            // a 16-bit `repr(transparent)` type, and unaligned loads/stores are used.
            unsafe {
                let x = _mm256_loadu_ps(src.as_ptr().add(b * 8));
                let h = _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(x);
                _mm_storeu_si128(dst.as_mut_ptr().add(b * 8).cast::<__m128i>(), h);
            }
        }
        blocks * 8
    }

    /// Converts the first `8·⌊n/8⌋` elements; returns how many.
    #[target_feature(enable = "avx,f16c")]
    pub(super) fn widen_f16_f16c(src: &[f16], dst: &mut [f32]) -> usize {
        let blocks = src.len().min(dst.len()) / 8;
        for b in 0..blocks {
            // SAFETY: elements b·8 .. b·8+8 are in bounds of both slices (b < blocks), f16 is
            // a 16-bit `repr(transparent)` type, and unaligned loads/stores are used.
            unsafe {
                let h = _mm_loadu_si128(src.as_ptr().add(b * 8).cast::<__m128i>());
                _mm256_storeu_ps(dst.as_mut_ptr().add(b * 8), _mm256_cvtph_ps(h));
            }
        }
        blocks * 8
    }
}

/// Rows `rows` of `m` as f32 slices into `buf`, widened (half) or copied (f32), for the
/// portable row kernels (which read f32 rows only) when this CPU has no in-place kernels
/// for the layout. `out` receives one slice per row.
pub(crate) fn row_slices<'a, T: Element>(
    m: MatRef<'_, T>,
    rows: Range<usize>,
    buf: &'a mut [f32],
    out: &mut [&'a [f32]],
) {
    let (n, d) = (rows.len(), m.ncols());
    let wide = widen_rows(m, rows, buf);
    for (slot, row) in out.iter_mut().zip(wide.chunks_exact(d.max(1)).take(n)) {
        *slot = &row[..d];
    }
}

/// Rows `rows` of `m` widened (or copied) into `buf` as a contiguous row-major block.
pub(crate) fn widen_rows<'a, T: Element>(
    m: MatRef<'_, T>,
    rows: Range<usize>,
    buf: &'a mut [f32],
) -> &'a [f32] {
    const GROUP: usize = 64;
    let (n, d) = (rows.len(), m.ncols());
    let contiguous = n == 0 || m.row(rows.start).try_as_row_major().is_some();
    for (g, dst) in (rows.start..rows.end)
        .step_by(GROUP)
        .zip(buf.chunks_mut(GROUP * d.max(1)))
    {
        let group = g..(g + GROUP).min(rows.end);
        if contiguous {
            let mut src: [&[T]; GROUP] = [&[]; GROUP];
            for (slot, r) in src.iter_mut().zip(group.clone()) {
                *slot = m
                    .row(r)
                    .try_as_row_major()
                    .map_or(&[][..], |row| row.as_slice());
            }
            T::widen_rows(&src[..group.len()], d, dst);
        } else {
            for (r, out) in group.zip(dst.chunks_exact_mut(d.max(1))) {
                for (c, x) in out.iter_mut().enumerate() {
                    *x = m[(r, c)].to_f32();
                }
            }
        }
    }
    &buf[..n * d]
}

/// An f32 view of rows `rows` of `m`: `m` itself for f32, else a row-major copy widened
/// into `buf` (which must hold `rows.len() · m.ncols()` floats).
pub(crate) fn f32_rows<'a, T: Element>(
    m: MatRef<'a, T>,
    rows: Range<usize>,
    buf: &'a mut [f32],
) -> MatRef<'a, f32> {
    let (n, d) = (rows.len(), m.ncols());
    if let Some(m) = T::as_f32(m) {
        return m.subrows(rows.start, n);
    }
    MatRef::from_row_major_slice(widen_rows(m, rows, buf), n, d)
}

/// Rounds an f32 row into an output row of any stride: vectorised when it is contiguous.
pub(crate) fn narrow_row<O: Element>(src: &[f32], mut dst: RowMut<'_, O>) {
    match dst.rb_mut().try_as_row_major_mut() {
        Some(contiguous) => {
            O::narrow(src, contiguous.as_slice_mut());
        }
        None => dst
            .iter_mut()
            .zip(src)
            .for_each(|(x, &a)| *x = O::from_f32(a)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn widening_is_exact_for_every_bit_pattern<T: Element>(from_bits: fn(u16) -> T) {
        let all: Vec<T> = (0..=u16::MAX).map(from_bits).collect();
        let mut wide = vec![0.0f32; all.len()];
        T::widen(&all, &mut wide);
        for (h, w) in all.iter().zip(&wide) {
            let want = h.to_f32();
            assert!(
                w.to_bits() == want.to_bits() || (w.is_nan() && want.is_nan()),
                "{want}"
            );
        }
    }

    #[test]
    fn f16_widening_is_exact_for_every_bit_pattern() {
        widening_is_exact_for_every_bit_pattern(f16::from_bits);
    }

    #[test]
    fn bf16_widening_is_exact_for_every_bit_pattern() {
        widening_is_exact_for_every_bit_pattern(bf16::from_bits);
    }

    /// Every f32 whose low 13 bits are one of the rounding cases (below, at and above a
    /// half-way point, odd and even), every exponent and sign, and the specials: the
    /// vectorised narrowing gives `from_f32`'s bits, at every offset of the vector body.
    fn narrowing_matches_from_f32<T: Element>(to_bits: fn(T) -> u16) {
        let mut src: Vec<f32> = Vec::new();
        for high in 0..=u32::from(u16::MAX) >> 3 {
            for low in [
                0u32, 1, 0xfff, 0x1000, 0x1001, 0x1fff, 0x7fff, 0x8000, 0x8001, 0xffff,
            ] {
                src.push(f32::from_bits(high << 19 | low & 0x7_ffff));
            }
        }
        src.extend([
            f32::NAN,
            -f32::NAN,
            f32::INFINITY,
            f32::MAX,
            65520.0,
            65519.99,
            -0.0,
        ]);
        for skip in [0, 3] {
            let src = &src[skip..];
            let mut got = vec![T::from_f32(7.0); src.len() + 1];
            assert_eq!(T::narrow(src, &mut got), src.len());
            for (x, g) in src.iter().zip(&got) {
                let (gb, wb) = (to_bits(*g), to_bits(T::from_f32(*x)));
                // A NaN stays a NaN (its payload is the conversion's).
                let nan = x.is_nan() && g.to_f32().is_nan();
                assert!(gb == wb || nan, "{x:e}: {gb:#x} vs {wb:#x}");
            }
            assert_eq!(to_bits(got[src.len()]), to_bits(T::from_f32(7.0)));
        }
    }

    #[test]
    fn f16_narrowing_is_from_f32_bit_for_bit() {
        narrowing_matches_from_f32::<f16>(f16::to_bits);
    }

    #[test]
    fn bf16_narrowing_is_from_f32_bit_for_bit() {
        narrowing_matches_from_f32::<bf16>(bf16::to_bits);
    }

    #[test]
    fn finiteness_is_read_from_the_bits() {
        for bits in 0..=u16::MAX {
            let (h, b) = (f16::from_bits(bits), bf16::from_bits(bits));
            assert_eq!(Element::is_finite(h), h.to_f32().is_finite(), "{bits:#x}");
            assert_eq!(Element::is_finite(b), b.to_f32().is_finite(), "{bits:#x}");
        }
    }

    #[test]
    fn strided_rows_are_widened_too() {
        let data: Vec<f16> = (0..24).map(|x| f16::from_f32(x as f32)).collect();
        // Column-major 4×6: rows are not contiguous.
        let m = MatRef::from_column_major_slice(&data, 4, 6);
        let mut buf = vec![0.0f32; 2 * 6];
        let v = f32_rows(m, 1..3, &mut buf);
        assert_eq!(v[(1, 5)], 22.0);
    }
}

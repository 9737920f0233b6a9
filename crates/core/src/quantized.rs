//! Quantized cache pages: keys and values stored as 8-bit codes with a scale per token
//! and head, read through the same block tables as [`PagedKv`].
//!
//! Decoding reads the whole cache once per token, so its speed is the cache's bytes over
//! the memory's bandwidth: codes of one byte halve the bytes of an f16 cache. A row `x` of
//! one token and head (`d` values) is stored as `d` codes and one f32 scale `s`, and reads
//! back as `x̂_c = s · value(code_c) · f_c`: [`KvCodes`] says what a code's value is (a
//! signed integer, or an fp8 e4m3 number) and `f_c` is 1, or for keys with per-channel
//! factors ([`KvQuantization::key_channels`]) a factor per channel of each head, fixed
//! when the cache first sees keys. Keys have outlier channels (a few channels twenty times
//! the others): a per-token scale spends its codes on them and rounds the rest coarsely;
//! dividing each channel by its factor first evens them out. The definitions here
//! ([`KvCodes::encode`], [`quantize_row`], [`QuantizedKv::key`]) are what every engine and
//! cache computes; the reference reads them literally.

use faer::MatRef;
use float8::F8E4M3;

use crate::{Error, PagedKv, Result, Tensor4Ref};

/// What a cache's one-byte codes mean.
///
/// ```
/// use attn_core::KvCodes;
/// assert_eq!(KvCodes::Int8.value(KvCodes::Int8.encode(-3.4)), -3.0);
/// assert_eq!(KvCodes::Fp8E4m3.value(KvCodes::Fp8E4m3.encode(448.0)), 448.0);
/// assert_eq!(KvCodes::Fp8E4m3.value(KvCodes::Fp8E4m3.encode(0.30)), 0.3125); // 3 mantissa bits
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum KvCodes {
    /// A signed integer in `-127 ..= 127` (two's complement bits), rounded to nearest.
    Int8,
    /// An fp8 e4m3 number (OCP's `E4M3FN`: 4 exponent bits, 3 mantissa bits, finite up to
    /// ±448), rounded to nearest even; a row's largest magnitude maps to 448.
    Fp8E4m3,
}

impl KvCodes {
    /// The largest magnitude a code holds: a row's largest entry is scaled to it.
    pub const fn max_code(self) -> f32 {
        match self {
            KvCodes::Int8 => 127.0,
            KvCodes::Fp8E4m3 => 448.0,
        }
    }

    /// The code of `x` (a value already divided by its row's scale, so `|x| ≤`
    /// [`max_code`](KvCodes::max_code)): rounded to nearest, saturated at the largest code.
    pub fn encode(self, x: f32) -> u8 {
        match self {
            KvCodes::Int8 => (x.round_ties_even().clamp(-127.0, 127.0) as i8).to_ne_bytes()[0],
            KvCodes::Fp8E4m3 => F8E4M3::from_f32(x.clamp(-448.0, 448.0)).to_bits(),
        }
    }

    /// The value of a code (exact in f32).
    pub fn value(self, code: u8) -> f32 {
        match self {
            KvCodes::Int8 => f32::from(code as i8),
            KvCodes::Fp8E4m3 => F8E4M3::from_bits(code).to_f32(),
        }
    }

    /// The rounding of a code relative to the row's largest magnitude `a` (the bound the
    /// oracle and `docs/accuracy.md` use): a dequantized entry `x̂` of a row whose entries
    /// are at most `a` (after the channel offsets and factors) is within `abs · a + rel ·
    /// |x|` of `x` (times the channel's factor).
    /// Int8 rounds to a grid of `a / 127`: `abs = 0.5 / 127`, `rel = 0`. fp8 keeps 3
    /// mantissa bits: `rel = 2⁻⁴`, and its subnormals (below `2⁻⁶` of 448) a grid of
    /// `2⁻⁹ / 448 · a`, half of it absolute.
    pub fn rounding(self) -> (f64, f64) {
        match self {
            KvCodes::Int8 => (0.5 / 127.0, 0.0),
            KvCodes::Fp8E4m3 => (0.5 * 2f64.powi(-9) / 448.0, 2f64.powi(-4)),
        }
    }

    /// Short name for reports (`"int8"`, `"fp8"`).
    pub const fn name(self) -> &'static str {
        match self {
            KvCodes::Int8 => "int8",
            KvCodes::Fp8E4m3 => "fp8",
        }
    }
}

/// How a quantized cache stores its keys and values: the codes, and whether keys are
/// divided by a factor per channel before their per-token scale.
///
/// ```
/// use attn_core::{KvCodes, KvQuantization};
/// let q = KvQuantization::new(KvCodes::Int8).with_key_channels();
/// assert!(q.key_channels && q.codes == KvCodes::Int8);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct KvQuantization {
    /// What the codes mean.
    pub codes: KvCodes,
    /// Keys less an offset and divided by a factor per (head, channel) before the
    /// per-token scale: each channel's mean and root mean square about it in the first
    /// keys the cache stores ([`KeyChannels::calibrate`]; keys' outliers live in
    /// channels). Values never have them.
    pub key_channels: bool,
}

impl KvQuantization {
    /// Codes `codes` with a scale per token and head.
    pub const fn new(codes: KvCodes) -> Self {
        Self {
            codes,
            key_channels: false,
        }
    }

    /// With per-channel key offsets and factors ([`KvQuantization::key_channels`]).
    pub const fn with_key_channels(self) -> Self {
        Self {
            key_channels: true,
            ..self
        }
    }
}

/// One head's per-channel key offsets `μ` and factors `f` (`d_k` each): a key row is
/// stored as `(k − μ) / f` quantized, and reads back as `μ + f · x̂`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct KeyChannels<'a> {
    /// `μ_c`, finite.
    pub offsets: &'a [f32],
    /// `f_c`, finite and positive.
    pub factors: &'a [f32],
}

impl KeyChannels<'_> {
    /// Offsets and factors of one head from its first keys `rows` (`n × d`): each
    /// channel's mean, and its root mean square about the mean raised to at least half the
    /// median channel's; factors of 1 for constant keys. A channel that looked narrow in
    /// the first keys (a few tokens estimate a spread within a factor of two or so) must
    /// not blow up later tokens' scales. Mean squares, not largest magnitudes: they are the
    /// steadier estimates.
    ///
    /// ```
    /// use attn_core::KeyChannels;
    /// let rows = faer::mat![[3.0f32, 60.0, 1.0], [-3.0, 20.0, 1.0]];
    /// let (offsets, factors) = KeyChannels::calibrate(rows.as_ref());
    /// assert_eq!(offsets, vec![0.0, 40.0, 1.0]);
    /// assert_eq!(factors, vec![3.0, 20.0, 1.5]); // the last raised to half the median
    /// ```
    pub fn calibrate(rows: MatRef<'_, f32>) -> (Vec<f32>, Vec<f32>) {
        let n = rows.nrows().max(1) as f64;
        let column = |c: usize| (0..rows.nrows()).map(move |i| f64::from(rows[(i, c)]));
        let offsets: Vec<f32> = (0..rows.ncols())
            .map(|c| (column(c).sum::<f64>() / n) as f32)
            .collect();
        let rms: Vec<f32> = (0..rows.ncols())
            .map(|c| {
                let mean = f64::from(offsets[c]);
                let sum: f64 = column(c).map(|x| (x - mean) * (x - mean)).sum();
                (sum / n).sqrt() as f32
            })
            .collect();
        let finite = offsets.iter().chain(&rms).all(|x| x.is_finite());
        let mut sorted = rms.clone();
        sorted.sort_by(f32::total_cmp);
        let median = sorted.get(sorted.len() / 2).copied().unwrap_or(0.0);
        let top = sorted.last().copied().unwrap_or(0.0);
        if !finite {
            return (vec![0.0; rows.ncols()], vec![1.0; rows.ncols()]);
        }
        if top == 0.0 {
            return (offsets, vec![1.0; rows.ncols()]);
        }
        let floor = if median > 0.0 {
            median / 2.0
        } else {
            top / 64.0
        };
        (offsets, rms.iter().map(|&r| r.max(floor)).collect())
    }
}

/// Quantizes one row `x` (entry `c` first shifted and divided, `(x_c − μ_c) / f_c`, when
/// `channels` are given) into `codes` and returns its scale: `s = max_c |y_c| / max_code`
/// (the smallest positive f32 when that underflows; 0 for a row of zeros), `codes[c] =
/// encode(y_c / s)`. A non-finite entry is an [`Error::InvalidValue`] (no code holds it)
/// and writes nothing.
///
/// ```
/// use attn_core::{KvCodes, quantize_row};
/// let mut codes = [0u8; 3];
/// let s = quantize_row(KvCodes::Int8, &[1.0, -2.54, 0.0], None, &mut codes)?;
/// assert_eq!(s, 2.54 / 127.0);
/// assert_eq!(codes.map(|c| KvCodes::Int8.value(c)), [50.0, -127.0, 0.0]);
/// assert!(quantize_row(KvCodes::Int8, &[f32::NAN], None, &mut codes[..1]).is_err());
/// # Ok::<(), attn_core::Error>(())
/// ```
pub fn quantize_row(
    codes: KvCodes,
    x: &[f32],
    channels: Option<KeyChannels<'_>>,
    out: &mut [u8],
) -> Result<f32> {
    let y = |c: usize, v: f32| match channels {
        Some(ch) => (v - ch.offsets[c]) / ch.factors[c],
        None => v,
    };
    let mut amax = 0.0f32;
    for (c, &v) in x.iter().enumerate() {
        if !v.is_finite() {
            return Err(Error::invalid_value(
                "quantized cache row",
                c,
                v,
                "finite: a quantized cache has no code for inf or NaN",
            ));
        }
        amax = amax.max(y(c, v).abs());
    }
    if amax == 0.0 {
        out[..x.len()].fill(0);
        return Ok(0.0);
    }
    // At most what keeps `scale · max_code` a finite f32: a row of f32::MAX reads back finite.
    let largest = f32::MAX / codes.max_code() * (1.0 - f32::EPSILON);
    let scale = (amax / codes.max_code()).clamp(f32::from_bits(1), largest);
    for (c, (&v, o)) in x.iter().zip(out.iter_mut()).enumerate() {
        // In f64: a subnormal scale's quotient must not overflow f32.
        *o = codes.encode((f64::from(y(c, v)) / f64::from(scale)) as f32);
    }
    Ok(scale)
}

/// A batch of sequences whose keys and values lie in quantized pages: the codes as a
/// [`PagedKv`] of bytes (`[pages, h_kv, page_size, d]`, their block table and lengths),
/// the scales as one of f32 (`[pages, h_kv, page_size, 1]`, the same table), and for keys
/// with per-channel scaling their offsets and factors, `[h_kv, d_k]` each.
///
/// ```
/// use attn_core::{KvCodes, KvQuantization, Layout, PagedKv, QuantizedKv, Tensor4Ref};
/// // One page of 2 tokens, one head, d = 2: codes, then a scale per token.
/// let codes = [10u8, 20, 30, 40];
/// let scales = [0.5f32, 0.25];
/// let c = Tensor4Ref::from_layout(&codes, [1, 1, 2, 2], Layout::Bhsd)?;
/// let s = Tensor4Ref::from_layout(&scales, [1, 1, 2, 1], Layout::Bhsd)?;
/// let (table, lens) = ([0], [2]);
/// let kv = QuantizedKv::new(
///     PagedKv::new(c, c, &table, &lens)?,
///     PagedKv::new(s, s, &table, &lens)?,
///     None,
///     KvQuantization::new(KvCodes::Int8),
/// )?;
/// assert_eq!((kv.key(0, 0, 1, 0), kv.value(0, 0, 0, 1)), (30.0 * 0.25, 20.0 * 0.5));
/// # Ok::<(), attn_core::Error>(())
/// ```
#[derive(Debug, Clone, Copy)]
pub struct QuantizedKv<'a> {
    codes: PagedKv<'a, u8>,
    scales: PagedKv<'a, f32>,
    /// Offsets and factors.
    key_channels: Option<[MatRef<'a, f32>; 2]>,
    format: KvQuantization,
}

impl<'a> QuantizedKv<'a> {
    /// Checks the view: the scales one per row of the codes' pages (same pages, heads,
    /// page size, block table and lengths, one column), finite where the lengths reach; the key channels' offsets and factors (`[h_kv, d_k]` each, rows of
    /// unit column stride; offsets finite, factors finite and positive) given exactly when
    /// `format.key_channels`. The codes are not scanned (that would read the cache once
    /// more a call): every int8 code is a value, and fp8's two NaN codes (`0x7F`, `0xFF`),
    /// which [`quantize_row`] never writes, must not appear — the reference reads them as
    /// NaN, the streaming engine's kernels as ±480.
    pub fn new(
        codes: PagedKv<'a, u8>,
        scales: PagedKv<'a, f32>,
        key_channels: Option<[MatRef<'a, f32>; 2]>,
        format: KvQuantization,
    ) -> Result<Self> {
        let ([pages, h_kv, ps, _], s_dims) = (codes.keys().dims(), scales.keys().dims());
        for (pool, dims) in [
            ("key scales", s_dims),
            ("value scales", scales.values().dims()),
        ] {
            for (axis, found, expected) in [
                ("pages", dims[0], pages),
                ("heads", dims[1], h_kv),
                ("page rows", dims[2], ps),
                ("columns", dims[3], 1),
            ] {
                crate::check_dim(
                    pool,
                    axis,
                    found,
                    "the code pages",
                    expected,
                    "a scale a row",
                )?;
            }
        }
        let same_table = scales.lens() == codes.lens()
            && (0..codes.batch()).all(|s| scales.pages(s) == codes.pages(s));
        if !same_table {
            return Err(Error::layout(
                "scales",
                "the scales are read through the codes' block table and lengths",
            ));
        }
        // Every call checks the scales it reads: a scan at memory speed (1/d of the codes'
        // bytes), over the whole pool at once where it is one dense block (a cache's), and
        // sequence by sequence where that finds a non-finite scale or the pool is strided.
        let dense_and_finite = |pool: Tensor4Ref<'_, f32>| {
            dense(pool).is_some_and(|all| all.iter().fold(true, |ok, x| ok & x.is_finite()))
        };
        let pools = [scales.keys(), scales.values()];
        for pool in pools.into_iter().filter(|&p| !dense_and_finite(p)) {
            for s in 0..scales.batch() {
                for h in 0..h_kv {
                    for (first, run) in scales.segments(pool, s, h, 0..scales.lens()[s]) {
                        let col = run.col(0);
                        let finite = match col.try_as_col_major() {
                            Some(c) => c.as_slice().iter().fold(true, |ok, x| ok & x.is_finite()),
                            None => col.iter().all(|x| x.is_finite()),
                        };
                        if !finite {
                            let (i, &x) = col
                                .iter()
                                .enumerate()
                                .find(|(_, x)| !x.is_finite())
                                .unwrap_or((0, &f32::NAN));
                            return Err(Error::invalid_value(
                                "scale of a quantized row",
                                first + i,
                                x,
                                "finite",
                            ));
                        }
                    }
                }
            }
        }
        match (key_channels, format.key_channels) {
            (Some(channels), true) => {
                let d_k = codes.d_k();
                for (m, what, positive) in [
                    (channels[0], "key channel offsets", false),
                    (channels[1], "key channel factors", true),
                ] {
                    crate::check_dim(what, "rows", m.nrows(), "heads", h_kv, "one a head")?;
                    crate::check_dim(what, "columns", m.ncols(), "d_k", d_k, "one a channel")?;
                    for h in 0..h_kv {
                        if m.row(h).try_as_row_major().is_none() && d_k > 1 {
                            return Err(Error::layout(what, "rows of unit column stride"));
                        }
                        for c in 0..d_k {
                            let x = m[(h, c)];
                            if !x.is_finite() || (positive && x <= 0.0) {
                                let rule = if positive {
                                    "finite and positive"
                                } else {
                                    "finite"
                                };
                                return Err(Error::invalid_value(what, h * d_k + c, x, rule));
                            }
                        }
                    }
                }
            }
            (None, false) => {}
            (Some(_), false) => {
                return Err(Error::unsupported(
                    "key channels",
                    "the format has no per-channel key scaling (KvQuantization::with_key_channels)",
                ));
            }
            (None, true) => {
                return Err(Error::unsupported(
                    "key channels",
                    "the format shifts and divides keys per channel: give the offsets and factors, [h_kv, d_k] each",
                ));
            }
        }
        Ok(Self {
            codes,
            scales,
            key_channels,
            format,
        })
    }

    /// The codes' pages (block table and lengths included).
    pub fn codes(&self) -> PagedKv<'a, u8> {
        self.codes
    }

    /// The scales' pages.
    pub fn scales(&self) -> PagedKv<'a, f32> {
        self.scales
    }

    /// The key channels' offsets and factors of head `h` (`None` without them).
    pub fn key_channels(&self, h: usize) -> Option<KeyChannels<'a>> {
        let [offsets, factors] = self.key_channels?;
        // Rows of unit column stride (checked when the view was made).
        let row = |m: MatRef<'a, f32>| m.row(h).try_as_row_major().map(|r| r.as_slice());
        Some(KeyChannels {
            offsets: row(offsets)?,
            factors: row(factors)?,
        })
    }

    /// The format.
    pub fn format(&self) -> KvQuantization {
        self.format
    }

    /// Entry `c` of key `t` of head `h` of sequence `s`, dequantized: `x = scale ·
    /// value(code)`, then `offset + factor · x` with key channels, each operation rounded
    /// to f32 (the definition: what a cache holds is these f32 values; `NaN` outside the
    /// view).
    pub fn key(&self, s: usize, h: usize, t: usize, c: usize) -> f32 {
        let x = self.entry(self.codes.keys(), self.scales.keys(), (s, h, t, c));
        match self.key_channels {
            Some([mu, f]) => mu[(h, c)] + f[(h, c)] * x,
            None => x,
        }
    }

    /// Entry `c` of value `t` of head `h` of sequence `s`, dequantized: `scale ·
    /// value(code)` rounded to f32.
    pub fn value(&self, s: usize, h: usize, t: usize, c: usize) -> f32 {
        self.entry(self.codes.values(), self.scales.values(), (s, h, t, c))
    }

    fn entry(
        &self,
        codes: Tensor4Ref<'a, u8>,
        scales: Tensor4Ref<'a, f32>,
        (s, h, t, c): (usize, usize, usize, usize),
    ) -> f32 {
        let ps = self.codes.page_size();
        let inside = s < self.codes.batch() && t < self.codes.lens()[s] && c < codes.dims()[3];
        let page = if inside {
            self.codes.pages(s)[t / ps] as usize
        } else {
            return f32::NAN;
        };
        let (Ok(m), Ok(sc)) = (codes.head(page, h), scales.head(page, h)) else {
            return f32::NAN;
        };
        sc[(t % ps, 0)] * self.format.codes.value(m[(t % ps, c)])
    }
}

/// The elements of `t` as one slice, when its dims and strides address exactly the first
/// `B·H·S·D` elements of its buffer (a dense block in any axis order).
fn dense<T>(t: Tensor4Ref<'_, T>) -> Option<&[T]> {
    let ([b, h, s, d], [sb, sh, ss]) = (t.dims(), t.strides());
    let mut axes = [(sb, b), (sh, h), (ss, s), (1, d)];
    axes.sort_unstable();
    let mut next = 1usize;
    for (stride, len) in axes {
        if len == 1 {
            continue;
        }
        if stride != next {
            return None;
        }
        next = next.checked_mul(len)?;
    }
    let n = [b, h, s, d].iter().product::<usize>();
    t.buffer().get(..n)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A non-finite scale the lengths reach is an error; one past them is not read.
    #[test]
    fn scales_are_checked_where_the_sequences_reach() {
        use crate::Layout;
        let codes = [0u8; 2 * 4 * 2];
        for (at, ok) in [(1, false), (3, true), (5, false)] {
            let mut scales = [1.0f32; 2 * 4];
            scales[at] = f32::NAN;
            for layout in [Layout::Bhsd, Layout::Bshd] {
                let c = Tensor4Ref::from_layout(&codes, [2, 1, 4, 2], layout).unwrap();
                let s = Tensor4Ref::from_layout(&scales, [2, 1, 4, 1], layout).unwrap();
                let (table, lens) = ([0, 1], [3, 2]);
                let kv = QuantizedKv::new(
                    PagedKv::new(c, c, &table[..1], &lens[..1]).unwrap(),
                    PagedKv::new(s, s, &table[..1], &lens[..1]).unwrap(),
                    None,
                    KvQuantization::new(KvCodes::Int8),
                );
                // One sequence of 3 tokens in page 0: scales 0..3 are read.
                assert_eq!(kv.is_ok(), at >= 3, "scale {at} of {layout:?}");
                let both = QuantizedKv::new(
                    PagedKv::new(c, c, &[0, 1], &lens).unwrap(),
                    PagedKv::new(s, s, &[0, 1], &lens).unwrap(),
                    None,
                    KvQuantization::new(KvCodes::Int8),
                );
                // Two sequences: page 1's first two tokens too.
                assert_eq!(both.is_ok(), ok, "scale {at} of {layout:?}");
            }
        }
    }

    #[test]
    fn fp8_codes_round_to_nearest_and_saturate() {
        let f = KvCodes::Fp8E4m3;
        assert_eq!(f.value(f.encode(1000.0)), 448.0);
        assert_eq!(f.value(f.encode(-460.0)), -448.0);
        assert_eq!(f.value(f.encode(2f32.powi(-9))), 2f32.powi(-9)); // smallest subnormal
        // Every code but NaN's reads back as itself.
        for b in 0..=255u8 {
            let x = f.value(b);
            if x.is_finite() {
                assert_eq!(f.value(f.encode(x)).to_bits(), x.to_bits(), "code {b:#x}");
            }
        }
    }

    #[test]
    fn quantized_rows_are_within_their_rounding() {
        let x: Vec<f32> = (0..64)
            .map(|i| ((i * 37) % 29) as f32 * 0.37 - 5.0)
            .collect();
        let factors: Vec<f32> = (0..64).map(|i| 1.0 + (i % 3) as f32).collect();
        let offsets: Vec<f32> = (0..64).map(|i| (i % 5) as f32 - 2.0).collect();
        let channels = KeyChannels {
            offsets: &offsets,
            factors: &factors,
        };
        for codes in [KvCodes::Int8, KvCodes::Fp8E4m3] {
            for ch in [None, Some(channels)] {
                let mut out = vec![0u8; 64];
                let s = quantize_row(codes, &x, ch, &mut out).unwrap();
                let y = |c: usize| match ch {
                    Some(ch) => {
                        (f64::from(x[c]) - f64::from(ch.offsets[c])) / f64::from(ch.factors[c])
                    }
                    None => f64::from(x[c]),
                };
                let a = (0..64).map(|c| y(c).abs()).fold(0.0, f64::max);
                let (abs, rel) = codes.rounding();
                for (c, &code) in out.iter().enumerate() {
                    let back = f64::from(s) * f64::from(codes.value(code));
                    let want = y(c);
                    let tol = abs * a + rel * want.abs() + 1e-6 * a;
                    assert!(
                        (back - want).abs() <= tol,
                        "{codes:?} {c}: {back} vs {want}"
                    );
                }
            }
        }
        // Tiny rows keep their codes (the scale does not underflow to 0), huge ones read back
        // finite.
        let mut out = [0u8; 2];
        let s = quantize_row(KvCodes::Int8, &[1e-44, -1e-44], None, &mut out).unwrap();
        assert!(s > 0.0 && out.iter().all(|&c| c != 0));
        for codes in [KvCodes::Int8, KvCodes::Fp8E4m3] {
            let s = quantize_row(codes, &[f32::MAX, -f32::MAX], None, &mut out).unwrap();
            assert!(
                out.iter().all(|&c| (s * codes.value(c)).is_finite()),
                "{codes:?}"
            );
        }
    }
}

//! The storage of a quantized cache ([`crate::KvCache::quantized`],
//! [`crate::PagedKvCache::quantized`]): one-byte codes and an f32 scale per row of keys and
//! of values, and the keys' per-channel offsets and factors, in slots the cache lays out
//! (`[batch, kv_heads, capacity]` or `[kv_heads, pages, page_size]` rows). Rows are
//! quantized as they are appended ([`quantize_row`]) and never widened back in memory:
//! attention reads the codes in place through a [`QuantizedKv`].

use attn_core::{Error, KeyChannels, KvQuantization, Result, Tensor4Ref, quantize_row};
use faer::MatRef;

use crate::kernel::element::Element;
use crate::kernel::finite::row_is_finite;
use crate::problem::{filled, zeroed};

/// Codes, scales and key channels of a cache's rows.
#[derive(Debug, Clone)]
pub(crate) struct CodePools {
    pub format: KvQuantization,
    /// `d_k` codes a row slot.
    pub k: Vec<u8>,
    /// `d_v` codes a row slot.
    pub v: Vec<u8>,
    /// One scale a row slot.
    pub k_scales: Vec<f32>,
    pub v_scales: Vec<f32>,
    /// Per-channel key offsets and factors, `[kv_heads, d_k]` each (zeros and ones until
    /// the first keys set them; empty without key channels).
    offsets: Vec<f32>,
    factors: Vec<f32>,
    calibrated: bool,
}

impl CodePools {
    /// Zeroed pools of `slots` rows (the dims whose product is the row count) of keys
    /// `d_k` wide and values `d_v` wide, for `kv_heads` heads.
    pub fn new(
        format: KvQuantization,
        slots: &[usize],
        kv_heads: usize,
        (d_k, d_v): (usize, usize),
    ) -> Result<Self> {
        let rows = |d: usize| [slots, &[d]].concat();
        let channels = if format.key_channels {
            kv_heads.checked_mul(d_k)
        } else {
            Some(0)
        };
        Ok(Self {
            format,
            k: zeroed("cache key codes", &rows(d_k))?,
            v: zeroed("cache value codes", &rows(d_v))?,
            k_scales: zeroed("cache key scales", slots)?,
            v_scales: zeroed("cache value scales", slots)?,
            offsets: filled("cache key offsets", channels, 0.0)?,
            factors: filled("cache key factors", channels, 1.0)?,
            calibrated: false,
        })
    }

    /// These pools' format and key channels over other rows (a grown cache's): codes `k`,
    /// `v` and scales `scales` (keys', values').
    pub fn with_rows(&self, (k, v): (Vec<u8>, Vec<u8>), scales: [Vec<f32>; 2]) -> Self {
        let [k_scales, v_scales] = scales;
        Self {
            format: self.format,
            k,
            v,
            k_scales,
            v_scales,
            offsets: self.offsets.clone(),
            factors: self.factors.clone(),
            calibrated: self.calibrated,
        }
    }

    /// Bytes held: codes, scales and channels.
    pub fn bytes(&self) -> usize {
        let floats = self.k_scales.len() + self.v_scales.len();
        self.k.len() + self.v.len() + (floats + self.offsets.len() + self.factors.len()) * 4
    }

    /// Checks that every entry of the rows to append is finite (no code holds inf or
    /// NaN), before anything is written.
    pub fn check_finite<T: Element>(rows: &[Tensor4Ref<'_, T>]) -> Result<()> {
        for t in rows {
            let [b, h, _, _] = t.dims();
            for (e, hh) in (0..b).flat_map(|e| (0..h).map(move |hh| (e, hh))) {
                let m = t.head(e, hh)?;
                let Some(i) = (0..m.nrows()).find(|&i| !row_is_finite(m.row(i))) else {
                    continue;
                };
                let row = m.row(i);
                let (c, x) = (0..row.ncols())
                    .map(|c| (c, row[c].to_f32()))
                    .find(|(_, x)| !x.is_finite())
                    .unwrap_or((0, f32::NAN));
                return Err(Error::invalid_value(
                    "row appended to a quantized cache",
                    c,
                    x,
                    "finite: a quantized cache has no code for inf or NaN",
                ));
            }
        }
        Ok(())
    }

    /// Quantizes the `t` rows of batch entry `src_b` of `k` (and `v`: `None` for keys
    /// only) into the slots `slot(h, i)` of row `i` of head `h`; the first keys the pools
    /// see set the key channels. The rows were checked ([`CodePools::check_finite`] and
    /// their shapes), so no row fails.
    pub fn write<T: Element>(
        &mut self,
        (k, v): (Tensor4Ref<'_, T>, Option<Tensor4Ref<'_, T>>),
        src_b: usize,
        slot: impl Fn(usize, usize) -> usize,
    ) -> Result<()> {
        let [_, heads, t, d_k] = k.dims();
        if self.format.key_channels && !self.calibrated && t > 0 {
            for h in 0..heads {
                let rows = k.head(src_b, h)?;
                let wide = faer::Mat::from_fn(t, d_k, |i, c| rows[(i, c)].to_f32());
                let (mu, f) = KeyChannels::calibrate(wide.as_ref());
                self.offsets[h * d_k..(h + 1) * d_k].copy_from_slice(&mu);
                self.factors[h * d_k..(h + 1) * d_k].copy_from_slice(&f);
            }
            self.calibrated = true;
        }
        let codes = self.format.codes;
        let pools = [
            (Some(k), &mut self.k, &mut self.k_scales, true),
            (v, &mut self.v, &mut self.v_scales, false),
        ];
        for (src, pool, scales, keys) in pools
            .into_iter()
            .filter_map(|(src, pool, scales, keys)| Some((src?, pool, scales, keys)))
        {
            let d = src.dims()[3];
            let mut row = vec![0.0f32; d];
            for h in 0..heads {
                let rows = src.head(src_b, h)?;
                let channels = (keys && self.format.key_channels).then(|| KeyChannels {
                    offsets: &self.offsets[h * d..(h + 1) * d],
                    factors: &self.factors[h * d..(h + 1) * d],
                });
                for i in 0..t {
                    for (c, x) in row.iter_mut().enumerate() {
                        *x = rows[(i, c)].to_f32();
                    }
                    let at = slot(h, i);
                    let out = &mut pool[at * d..(at + 1) * d];
                    scales[at] = quantize_row(codes, &row, channels, out)?;
                }
            }
        }
        Ok(())
    }

    /// The key channels' offsets and factors as `[kv_heads, d_k]` views (`None` without).
    pub fn channels(&self, kv_heads: usize, d_k: usize) -> Option<[MatRef<'_, f32>; 2]> {
        self.format.key_channels.then(|| {
            [&self.offsets, &self.factors].map(|m| MatRef::from_row_major_slice(m, kv_heads, d_k))
        })
    }
}

//! The gradient of an additive mask (a learnable bias): `dBias = dS`, the gradient of the
//! scores the softmax sees, summed over the axes the bias broadcasts on.
//!
//! The tasks of the backward pass add their score-gradient tiles into one f32 buffer shaped
//! like the bias's own values ([`attn_core::Mask4Ref::own_dims`]). Entries that several
//! (batch entry, head) pairs share are summed in a fixed order: the tasks that write the
//! same entries — same key chunk, groups that share bias planes — run one after the other,
//! in group order, as one *bundle* ([`BiasGradient::bundle`]); different bundles write
//! different entries. The buffer's words are atomics only so that tasks on different
//! threads may share it without `unsafe`: no two threads ever write one entry.

use core::ops::Range;
use core::sync::atomic::{AtomicU32, Ordering};

use attn_core::{Error, Options, Result, Tensor4};

/// Where a head's bias gradient goes, and the buffer it goes into.
#[derive(Debug)]
pub(crate) struct BiasGradient {
    /// The f32 bits of each entry, `dims` row-major.
    sums: Vec<AtomicU32>,
    /// The bias's own dims `[B', H', L', S']` (1 along each axis it broadcasts on).
    dims: [usize; 4],
}

impl BiasGradient {
    /// The buffer for the additive mask of `options` in a call of dims `[batch, h_q, n_q,
    /// n_k]` ([`Options::bias_gradient_dims`] says which masks have one).
    pub fn new(options: &Options<'_>, dims: [usize; 4]) -> Result<Self> {
        let own = options.bias_gradient_dims(dims)?;
        let n = crate::problem::element_count(&own)
            .ok_or_else(|| Error::allocation_of::<f32>("bias gradient", None))?;
        let mut sums = Vec::new();
        sums.try_reserve_exact(n)
            .map_err(|_| Error::allocation_of::<f32>("bias gradient", Some(n)))?;
        sums.extend((0..n).map(|_| AtomicU32::new(0)));
        Ok(Self { sums, dims: own })
    }

    /// The offset of the plane of batch entry `b`, query head `h`.
    pub fn plane(&self, b: usize, h: usize) -> usize {
        let [bb, hh, l, s] = self.dims;
        let (b, h) = (if bb == 1 { 0 } else { b }, if hh == 1 { 0 } else { h });
        (b * hh + h) * l * s
    }

    /// The bundle of a group of batch entry `b` and kv head `kv`: groups whose heads share
    /// bias planes have the same one (so their tasks run in order).
    pub fn bundle(&self, b: usize, kv: usize) -> (usize, usize) {
        let [bb, hh, ..] = self.dims;
        (if bb == 1 { 0 } else { b }, if hh == 1 { 0 } else { kv })
    }

    /// Adds a column-major tile of score gradients (`ld` apart) over queries `rows` and
    /// keys `cols` into the plane at `plane`: entry by entry, or summed down each column
    /// first when the bias is one row for every query.
    pub fn add_tile(
        &self,
        plane: usize,
        ds: &[f32],
        ld: usize,
        (rows, cols): (Range<usize>, Range<usize>),
    ) {
        let [_, _, l, s] = self.dims;
        let nr = rows.len();
        let add = |at: usize, x: f32| {
            let e = &self.sums[at];
            let sum = f32::from_bits(e.load(Ordering::Relaxed)) + x;
            e.store(sum.to_bits(), Ordering::Relaxed);
        };
        for (jj, j) in cols.enumerate() {
            let col = &ds[jj * ld..jj * ld + nr];
            if l == 1 {
                // In row order, as the other entries sum.
                let mut sum = f32::from_bits(self.sums[plane + j].load(Ordering::Relaxed));
                col.iter().for_each(|&x| sum += x);
                self.sums[plane + j].store(sum.to_bits(), Ordering::Relaxed);
            } else {
                for (ii, &x) in col.iter().enumerate() {
                    add(plane + (rows.start + ii) * s + j, x);
                }
            }
        }
    }

    /// The sums, shaped like the bias's values.
    pub fn into_tensor(self) -> Result<Tensor4<f32>> {
        let values = self
            .sums
            .into_iter()
            .map(|e| f32::from_bits(e.into_inner()))
            .collect();
        Tensor4::from_vec(values, self.dims)
    }
}

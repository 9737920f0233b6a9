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

use attn_core::{Options, Result, Tensor4};

use crate::kernel::element::{add_into_words, atomic_words, atomics_into_f32, zeroed_atomics};

/// Columns of the block [`BiasGradient::add_tile`] transposes at a time.
const MAX_COLS: usize = 128;

/// Where a head's bias gradient goes, and the buffer it goes into.
#[derive(Debug)]
pub(crate) struct BiasGradient<'b> {
    /// The f32 bits of each entry, `dims` row-major.
    sums: Words<'b>,
    /// The bias's own dims `[B', H', L', S']` (1 along each axis it broadcasts on).
    dims: [usize; 4],
    /// Per group of the call, per query head: the offset of its plane, and whether it is
    /// the first head to reach that plane ([`BiasGradient::assign`]).
    heads: Vec<Vec<(usize, bool)>>,
}

/// The buffer of the sums: the engine's, or the caller's.
#[derive(Debug)]
enum Words<'b> {
    Owned(Vec<AtomicU32>),
    Caller(&'b [AtomicU32]),
}

impl<'b> BiasGradient<'b> {
    /// The buffer for the additive mask of `options` in a call of dims `[batch, h_q, n_q,
    /// n_k]` ([`Options::bias_gradient_dims`] says which masks have one).
    pub fn new(options: &Options<'_>, dims: [usize; 4]) -> Result<Self> {
        let own = options.bias_gradient_dims(dims)?;
        let n = crate::problem::element_count(&own);
        let sums = Words::Owned(zeroed_atomics("bias gradient", n)?);
        Ok(Self {
            sums,
            dims: own,
            heads: Vec::new(),
        })
    }

    /// [`BiasGradient::new`] into the caller's `out` (row-major over the mask's own dims),
    /// set to 0 first.
    pub fn into_caller(
        options: &Options<'_>,
        dims: [usize; 4],
        out: &'b mut [f32],
    ) -> Result<Self> {
        let own = options.bias_gradient_dims(dims)?;
        let n = crate::problem::element_count(&own);
        if n != Some(out.len()) {
            return Err(attn_core::Error::layout(
                "bias gradient buffer",
                format!(
                    "{} entries but the mask's values are {own:?} (Options::bias_gradient_dims)",
                    out.len()
                ),
            ));
        }
        out.fill(0.0);
        Ok(Self {
            sums: Words::Caller(atomic_words(out)),
            dims: own,
            heads: Vec::new(),
        })
    }

    fn words(&self) -> &[AtomicU32] {
        match &self.sums {
            Words::Owned(v) => v,
            Words::Caller(s) => s,
        }
    }

    /// The offset of the plane of batch entry `b`, query head `h`.
    fn plane(&self, b: usize, h: usize) -> usize {
        let [bb, hh, l, s] = self.dims;
        let (b, h) = (if bb == 1 { 0 } else { b }, if hh == 1 { 0 } else { h });
        (b * hh + h) * l * s
    }

    /// Places the query heads of the call's groups (each given by its batch entry and its
    /// heads, in group order): each head's plane, and whether it is the first to reach it —
    /// groups and heads in order, the order in which the tasks of a bundle run.
    pub fn assign(&mut self, groups: impl Iterator<Item = (usize, Vec<usize>)>) {
        let mut seen = std::collections::BTreeSet::new();
        self.heads = groups
            .map(|(b, heads)| {
                let planes = heads.iter().map(|&h| self.plane(b, h));
                planes.map(|p| (p, seen.insert(p))).collect()
            })
            .collect();
    }

    /// The plane and first-ness of each query head of group `g` ([`BiasGradient::assign`]).
    pub fn heads(&self, g: usize) -> &[(usize, bool)] {
        self.heads.get(g).map_or(&[], |h| &h[..])
    }

    /// The bundle of a group of batch entry `b` and kv head `kv`: groups whose heads share
    /// bias planes have the same one (so their tasks run in order).
    pub fn bundle(&self, b: usize, kv: usize) -> (usize, usize) {
        let [bb, hh, ..] = self.dims;
        (if bb == 1 { 0 } else { b }, if hh == 1 { 0 } else { kv })
    }

    /// Adds a column-major tile of score gradients (`ld` apart) over queries `rows` and
    /// keys `cols` into the plane at `plane`: row by row along the plane's rows (the tile
    /// is small and cached; the plane is not), or summed down each column first when the
    /// bias is one row for every query.
    ///
    /// With `first`, the tile is the first to reach its entries (which hold 0): it writes
    /// them instead of adding (see [`add_into_words`]).
    pub fn add_tile(
        &self,
        plane: usize,
        ds: &[f32],
        ld: usize,
        (rows, cols): (Range<usize>, Range<usize>),
        first: bool,
    ) {
        let [_, _, l, s] = self.dims;
        let nc = cols.len();
        if l == 1 {
            let line = &self.words()[plane + cols.start..plane + cols.end];
            for (jj, e) in line.iter().enumerate() {
                // In row order, as the other entries sum.
                let mut sum = if first {
                    0.0
                } else {
                    f32::from_bits(e.load(Ordering::Relaxed))
                };
                ds[jj * ld..jj * ld + rows.len()]
                    .iter()
                    .for_each(|&x| sum += x);
                e.store(sum.to_bits(), Ordering::Relaxed);
            }
            return;
        }
        // Sixteen rows at a time, transposed into a row-major block first (the tile's
        // columns are cache lines, the plane's rows are sequential), then added row by row.
        const ROWS: usize = 16;
        let mut block = [0.0f32; ROWS * MAX_COLS];
        for cols_at in (0..nc).step_by(MAX_COLS) {
            let w = MAX_COLS.min(nc - cols_at);
            for top in rows.clone().step_by(ROWS) {
                let n = ROWS.min(rows.end - top);
                let r0 = top - rows.start;
                for jj in 0..w {
                    let c = (cols_at + jj) * ld + r0;
                    for (r, &x) in ds[c..c + n].iter().enumerate() {
                        block[r * w + jj] = x;
                    }
                }
                for r in 0..n {
                    let start = plane + (top + r) * s + cols.start + cols_at;
                    let (dst, src) = (&self.words()[start..start + w], &block[r * w..(r + 1) * w]);
                    add_into_words(dst, src, first);
                }
            }
        }
    }

    /// Whether the bias has one row for every query (its gradient sums over them).
    pub fn one_row(&self) -> bool {
        self.dims[2] == 1
    }

    /// The sums, shaped like the bias's values (`None` when they went to the caller's
    /// buffer).
    pub fn into_tensor(self) -> Option<Result<Tensor4<f32>>> {
        match self.sums {
            Words::Owned(v) => Some(Tensor4::from_vec(atomics_into_f32(v), self.dims)),
            Words::Caller(_) => None,
        }
    }
}

//! The score modifiers on score tiles, shared by the forward and backward passes: the
//! soft-cap, ALiBi and the user's [`attn_core::ScoreMod`] change a tile's raw scores after
//! they are known to be finite (or repaired) and before the masks; the user's
//! [`attn_core::MaskMod`] hides entries with the masks ([`crate::mask`]); the sink logit
//! joins each row's softmax when the row is normalised ([`with_sink`]).
//!
//! Tiles hold base-2 scores (`log2(e)` is folded into Q); the modifiers see natural units
//! through [`ScoreTile::with_unit`].

use core::ops::Range;

use attn_core::ScoreTile;

use crate::kernel::online_softmax::saturate;
use crate::problem::HeadInputs;

/// Applies `head`'s score modifiers to the base-2 scores of query rows `rows` (the job's
/// rows) and keys `cols` (global indices), entry `(i, j)` at `s[i·rs + j·cs]`; with
/// `derivative` (laid out alike, filled with 1 by the caller) multiplies it by
/// `∂modified/∂raw`. Does nothing without score modifiers.
///
/// The contract's rule for modified scores (`docs/conventions.md`, "Score modifiers"): an
/// output beyond f32 — `±inf` included — saturates at `±L` like any visible score. The
/// forward pass applies it where it applies it to every score (its masks, and the overflow
/// test of its softmax, which sees every row's maximum); the backward pass recomputes `P`
/// from the scores without that test, so here, with `derivative`, the modified scores
/// saturate before the masks hide anything: a row whose modifier returned `-inf` everywhere
/// gets the forward's uniform weights back, not weights 0.
pub(crate) fn modify_scores<T, K>(
    s: &mut [f32],
    strides: (usize, usize),
    head: &HeadInputs<'_, T, K>,
    (rows, cols): (Range<usize>, Range<usize>),
    derivative: Option<&mut [f32]>,
) {
    if !head.mods.modifies_scores() {
        return;
    }
    let (b, h) = head.mods.position;
    let queries = head.mask_rows(rows.clone());
    // A stacked job (grouped-query decoding) never carries modifiers that see positions
    // (they vary over heads, see `Options::varies_over_heads`): its rows are one query.
    let queries = if head.stacked {
        queries.start..queries.start + rows.len()
    } else {
        queries
    };
    let (nr, nc) = (rows.len(), cols.len());
    let Ok(tile) = ScoreTile::new(s, strides, queries, cols, b, h) else {
        debug_assert!(false, "score tile outside its scratch");
        return;
    };
    let mut tile = tile.with_unit(core::f32::consts::LN_2);
    match derivative {
        None => head.mods.modify(&mut tile),
        Some(d) => {
            let _ = head.mods.modify_chained(&mut tile, d);
            saturate_tile(s, strides, (nr, nc));
        }
    }
}

/// Saturates (`±inf` and beyond to `±f32::MAX`, the limit of the base-2 domain) the
/// `rows × cols` entries at `s[i·rs + j·cs]`, along the contiguous axis so that it
/// vectorises: one pass over a tile that its GEMMs have just written.
fn saturate_tile(s: &mut [f32], (rs, cs): (usize, usize), (rows, cols): (usize, usize)) {
    let (outer, inner, os, is) = if rs == 1 {
        (cols, rows, cs, rs)
    } else {
        (rows, cols, rs, cs)
    };
    if inner == 0 {
        return;
    }
    for o in 0..outer {
        let line = &mut s[o * os..];
        if is == 1 {
            line[..inner].iter_mut().for_each(|x| *x = saturate(*x));
        } else {
            (0..inner).for_each(|n| line[n * is] = saturate(line[n * is]));
        }
    }
}

/// Folds a sink logit `sink2` (base 2) into a row's online-softmax state `(m, l)`: the
/// new reference maximum, the factor the row's accumulator must be multiplied by, and the
/// new sum, for a row that saw some key (`l ≠ 0`; a row that saw none keeps its state). A
/// NaN row (`l` NaN, `m` maybe still `-inf`) stays NaN.
#[inline]
pub(crate) fn with_sink(m: f32, l: f32, sink2: f32) -> (f32, f32, f32) {
    let top = m.max(sink2);
    let factor = (m - top).exp2();
    (top, factor, l * factor + (sink2 - top).exp2())
}

/// Folds a sink logit `sink` (natural units) into a row's natural-log `lse` in f64: the
/// factor the row's output must be multiplied by, and the new LSE (`sink` itself for a row
/// that saw nothing, `lse = -inf`). For rows whose partial states were merged (split-KV) or
/// recomputed exactly.
pub(crate) fn sink_into_lse(lse: f32, sink: f32) -> (f64, f32) {
    if lse == f32::NEG_INFINITY {
        return (0.0, sink);
    }
    let (lse, sink) = (f64::from(lse), f64::from(sink));
    let top = lse.max(sink);
    let total = top + ((lse - top).exp() + (sink - top).exp()).ln();
    ((lse - total).exp(), total as f32)
}

//! The masks applied to score tiles: which key blocks a tile visits, and how the visible
//! scores of the blocks that straddle a boundary (or carry an element-wise mask) are hidden
//! or biased. Shared by the GEMM tiles and the row tiles of the forward pass and by the
//! backward pass.
//!
//! Hidden means `-inf` in the log2-domain score, so the softmax gives it weight exactly 0;
//! an additive bias is added in the log2 domain (`bias · log2(e)`).

use core::ops::Range;

use attn_core::{ScoreTile, TileCoverage};
use faer::{MatMut, MatRef};

use crate::kernel::element::Element;
use crate::kernel::finite::{row_is_finite, rows_are_finite};
use crate::kernel::online_softmax::{saturate, saturate_visible, scale_visible};
use crate::problem::HeadInputs;

/// The blocks of at most `block` keys of `keys` that query rows `rows` must visit, with
/// their coverage. Blocks start at the first key some row can see and the last one stops
/// at the last such key (on the causal diagonal that halves the work of the boundary
/// tile); fully hidden blocks are left out. Both ends depend on the shape alone.
pub(crate) fn key_blocks<'a, T, K>(
    head: &'a HeadInputs<'_, T, K>,
    rows: Range<usize>,
    keys: Range<usize>,
    block: usize,
) -> impl Iterator<Item = (Range<usize>, TileCoverage)> + 'a {
    let first = head.key_range(rows.start).start.max(keys.start);
    let last = head.key_range(rows.end - 1).end.min(keys.end);
    (first..last.max(first))
        .step_by(block.max(1))
        .filter_map(move |j0| {
            let cols = j0..(j0 + block).min(last);
            let queries = head.mask_rows(rows.clone());
            match head.mask.tile_coverage(queries.clone(), cols.clone()) {
                TileCoverage::Hidden => None,
                TileCoverage::Partial => {
                    Some((trim_for_user(head, queries, cols), TileCoverage::Partial))
                }
                coverage => Some((cols, coverage)),
            }
        })
}

/// Keys at the ends of a straddling block that the user's mask hides from every row, asked
/// [`TRIM_KEYS`] at a time, are left out of the block — as the structural bounds trim the
/// causal diagonal's block, so that a user's causal mask costs what `Causal` does.
fn trim_for_user<T, K>(
    head: &HeadInputs<'_, T, K>,
    queries: Range<usize>,
    mut cols: Range<usize>,
) -> Range<usize> {
    if head.mask.user().is_none() {
        return cols;
    }
    let hidden =
        |c: Range<usize>| head.mask.user_coverage(queries.clone(), c) == TileCoverage::Hidden;
    while cols.len() > TRIM_KEYS && hidden(cols.end - TRIM_KEYS..cols.end) {
        cols.end -= TRIM_KEYS;
    }
    while cols.len() > TRIM_KEYS && hidden(cols.start..cols.start + TRIM_KEYS) {
        cols.start += TRIM_KEYS;
    }
    cols
}

/// The granularity of [`trim_for_user`]: a vector's worth of keys.
const TRIM_KEYS: usize = 16;

/// Masks a column-major score tile (leading dimension `br`) of query rows `rows` and keys
/// `cols`. When the block straddles a structural boundary (`coverage` is `Partial`), the
/// keys outside each row's range are hidden (`-inf`) and only the visible ones see the
/// element-wise masks: a structurally hidden key is hidden whatever its bias says. Every
/// visible score of a masked block is saturated ([`saturate`]) before any key is hidden,
/// so `-inf` there means hidden; the softmax pass saturates overflowed scores of the
/// blocks with nothing hidden.
pub(crate) fn mask_tile<T, K>(
    s: &mut [f32],
    br: usize,
    head: &HeadInputs<'_, T, K>,
    (rows, cols): (Range<usize>, Range<usize>),
    coverage: TileCoverage,
) {
    if coverage == TileCoverage::Partial && !head.mask.has_elementwise() {
        // Saturate the visible scores, hide the rest: a visible score that overflowed to
        // -inf must not pass for a hidden key in the softmax.
        visible_bounds(head, (rows.clone(), cols.clone()), |at, bounds| {
            saturate_visible(&mut s[at..], br, cols.len(), bounds.0, bounds.1);
            true
        });
        hide_by_user(s, (1, br), head, (rows, cols));
    } else if coverage == TileCoverage::Partial {
        // The element-wise masks saturate the visible scores they touch themselves.
        for (i, row) in rows.clone().enumerate() {
            let r = head.key_range(row);
            let visible = r.start.clamp(cols.start, cols.end)..r.end.clamp(cols.start, cols.end);
            for j in (cols.start..visible.start).chain(visible.end.max(visible.start)..cols.end) {
                s[(j - cols.start) * br + i] = f32::NEG_INFINITY;
            }
            for j in visible {
                mask_entry(&mut s[(j - cols.start) * br + i], head, row, j);
            }
        }
        hide_by_user(s, (1, br), head, (rows, cols));
    } else if head.mask.has_elementwise() {
        for j in cols.clone() {
            let col = &mut s[(j - cols.start) * br..];
            for (i, row) in rows.clone().enumerate() {
                mask_entry(&mut col[i], head, row, j);
            }
        }
    }
}

/// [`mask_tile`] of a block that straddles a structural boundary and carries no
/// element-wise mask, for scores still to be multiplied by `scale` (which the tile products
/// then need not apply): the visible scores scaled, the rest hidden, in one pass. Returns
/// `false` when a visible score is not finite: the caller repairs the tile and masks it
/// again with [`mask_tile`] (a saturating mask would change nothing otherwise).
pub(crate) fn scale_and_mask_tile<T, K>(
    s: &mut [f32],
    br: usize,
    head: &HeadInputs<'_, T, K>,
    (rows, cols): (Range<usize>, Range<usize>),
    scale: f32,
) -> bool {
    debug_assert!(!head.mask.has_elementwise());
    let finite = visible_bounds(head, (rows.clone(), cols.clone()), |at, bounds| {
        scale_visible(&mut s[at..], br, cols.len(), bounds, scale)
    });
    hide_by_user(s, (1, br), head, (rows, cols));
    finite
}

/// Calls `f(at, (from, to))` for chunks of `rows` whose visible keys, local to the block
/// `cols`, fit on the stack (`at`: the chunk's first row in the tile); whether every call
/// returned `true`.
fn visible_bounds<T, K>(
    head: &HeadInputs<'_, T, K>,
    (rows, cols): (Range<usize>, Range<usize>),
    mut f: impl FnMut(usize, (&[u32], &[u32])) -> bool,
) -> bool {
    const CHUNK: usize = 128;
    let (mut from, mut to) = ([0u32; CHUNK], [0u32; CHUNK]);
    let local = |j: usize| (j.clamp(cols.start, cols.end) - cols.start) as u32;
    let mut all = true;
    for first in rows.clone().step_by(CHUNK) {
        let chunk = first..(first + CHUNK).min(rows.end);
        let n = chunk.len();
        for (i, row) in chunk.enumerate() {
            let r = head.key_range(row);
            (from[i], to[i]) = (local(r.start), local(r.end));
        }
        all &= f(first - rows.start, (&from[..n], &to[..n]));
    }
    all
}

/// Whether a key that some row gives weight 0 (every hidden key, among others) has a
/// non-finite value: only then must hidden keys be skipped one by one. Scans only those
/// rows of V, so a masked block with finite values is not read twice.
pub(crate) fn zero_weight_meets_non_finite<T: Element>(
    v: MatRef<'_, T>,
    zero_weight: impl Fn(usize) -> bool,
) -> bool {
    // Finite values (the common case) are told by one vectorised scan.
    if T::as_f32(v).is_some_and(rows_are_finite) {
        return false;
    }
    (0..v.nrows()).any(|j| zero_weight(j) && !row_is_finite(v.row(j)))
}

/// `v` copied into `buf` in `v`'s own layout with its non-finite rows set to 0: the values
/// of a block in which some row gives weight 0 to a key whose value is not finite. A product
/// over the copy gives every row that does not see such a key the bits that any finite value
/// there would (its weight is 0); the rows that see one add its term separately
/// ([`add_non_finite_terms`]).
pub(crate) fn without_non_finite_rows<'b, T: Element>(
    v: MatRef<'_, T>,
    buf: &'b mut Vec<T>,
) -> MatRef<'b, T> {
    let (n, d) = (v.nrows(), v.ncols());
    let col_major = v.row_stride() == 1 && v.col_stride() != 1;
    // At most one block of values, on the rare path of a hidden non-finite value.
    buf.clear();
    buf.resize(n * d, T::from_f32(0.0));
    for j in (0..n).filter(|&j| row_is_finite(v.row(j))) {
        for c in 0..d {
            buf[if col_major { c * n + j } else { j * d + c }] = v[(j, c)];
        }
    }
    if col_major {
        MatRef::from_column_major_slice(buf, n, d)
    } else {
        MatRef::from_row_major_slice(buf, n, d)
    }
}

/// The terms [`without_non_finite_rows`] left out, for the rows that see them: for each key
/// `cols.start + jj` with a non-finite value row `v[jj]` and each query row `i` that gives
/// it a weight `p(i, jj)` or sees it, `add(i, c, p(i, jj) · v[jj][c])` for every column.
pub(crate) fn add_non_finite_terms<T, K, V: Element>(
    head: &HeadInputs<'_, T, K>,
    (rows, cols): (Range<usize>, Range<usize>),
    v: MatRef<'_, V>,
    p: impl Fn(usize, usize) -> f32,
    mut add: impl FnMut(usize, usize, f32),
) {
    for jj in (0..v.nrows()).filter(|&jj| !row_is_finite(v.row(jj))) {
        let j = cols.start + jj;
        for (i, row) in rows.clone().enumerate() {
            let pij = p(i, jj);
            if pij != 0.0 || head.mask.sees(head.mask_row(row), j) {
                for (c, x) in v.row(jj).iter().enumerate() {
                    add(i, c, pij * x.to_f32());
                }
            }
        }
    }
}

/// The score of query `row` and key `j`, which the structural constraints leave visible,
/// under the element-wise masks: `-inf` where the boolean mask blocks it or its bias is
/// `-inf` (assigned, so a non-finite score of a hidden key never reaches the row), else
/// the score plus the bias (in the log2 domain), saturated into the finite range.
fn mask_entry<T, K>(x: &mut f32, head: &HeadInputs<'_, T, K>, row: usize, j: usize) {
    let row = head.mask_row(row);
    if let Some(b) = head.mask.boolean()
        && !b.allows(row, j)
    {
        *x = f32::NEG_INFINITY;
    } else if let Some(a) = head.mask.additive() {
        let bias = a[(row, j)];
        *x = if bias == f32::NEG_INFINITY {
            f32::NEG_INFINITY
        } else {
            // A finite bias stays finite: f32::MIN · log2(e) saturates, it does not hide.
            saturate(*x + saturate(bias * core::f32::consts::LOG2_E))
        };
    } else {
        *x = saturate(*x);
    }
}

/// [`mask_tile`] for one row of scores: query row `row`, keys `cols`.
pub(crate) fn mask_row<T, K>(
    s: &mut [f32],
    head: &HeadInputs<'_, T, K>,
    (row, cols): (usize, Range<usize>),
    coverage: TileCoverage,
) {
    let partial = coverage == TileCoverage::Partial;
    if !partial && !head.mask.has_elementwise() {
        return;
    }
    let (r, elementwise) = (head.key_range(row), head.mask.has_elementwise());
    for (j, x) in cols.clone().zip(s.iter_mut()) {
        if partial && !r.contains(&j) {
            *x = f32::NEG_INFINITY;
        } else if elementwise {
            mask_entry(x, head, row, j);
        } else {
            *x = saturate(*x); // visible: an overflow to -inf is not a hidden key
        }
    }
    if partial {
        hide_by_user(s, (cols.len(), 1), head, (row..row + 1, cols));
    }
}

/// Hides (`-inf`) the entries of a tile that the user's mask hides, where its answer for
/// the tile is `Partial`; entry `(i, j)` at `s[i·rs + j·cs]`. Runs after every other mask,
/// whose saturation of the visible scores must not turn these `-inf` back into scores.
fn hide_by_user<T, K>(
    s: &mut [f32],
    strides: (usize, usize),
    head: &HeadInputs<'_, T, K>,
    (rows, cols): (Range<usize>, Range<usize>),
) {
    let Some((user, (b, h), off)) = head.mask.user() else {
        return;
    };
    let queries = head.mask_rows(rows);
    // A row (or tile) the user's mask hides entirely can sit in a tile whose coverage is
    // Partial (a row tile's first rows against a key block past them): hide all of it.
    let coverage = head.mask.user_coverage(queries.clone(), cols.clone());
    if coverage == TileCoverage::Full {
        return;
    }
    let queries = queries.start + off..queries.end + off;
    match ScoreTile::new(s, strides, queries, cols, b, h) {
        Ok(mut tile) if coverage == TileCoverage::Hidden => tile.hide(|_, _| false),
        Ok(mut tile) => user.hide(&mut tile),
        Err(_) => debug_assert!(false, "score tile outside its scratch"),
    }
}

/// `acc += a · b` term by term, skipping the terms whose weight `a_ik` is 0: the slow
/// path of a tile product in which a weight of 0 (a hidden key among them) meets a
/// non-finite entry of `b`, where `0 · inf` would otherwise put NaN into `acc`.
pub(crate) fn add_product_skipping_zeros(
    mut acc: MatMut<'_, f32>,
    a: MatRef<'_, f32>,
    b: MatRef<'_, f32>,
) {
    for i in 0..acc.nrows() {
        for k in 0..a.ncols() {
            let w = a[(i, k)];
            if w != 0.0 {
                for c in 0..acc.ncols() {
                    acc[(i, c)] += w * b[(k, c)];
                }
            }
        }
    }
}

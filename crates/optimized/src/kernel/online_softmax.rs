//! The fused softmax pass over one score tile: running max, `2^(s − m)`, row sums and the
//! rescale factors of the online softmax.
//!
//! The tile is column-major (`ld` floats between columns), so each column holds one key's
//! scores for all the tile's queries: the loops run down a column and vectorise across
//! queries, keeping one running maximum and one sum per query.
//!
//! Scores arrive in the log2 domain (`log2(e)·scale` is folded into Q). Rescaling is lazy:
//! a row's reference maximum `m` moves only when a block's maximum exceeds it by more than
//! [`LAZY_RESCALE_LOG2`], so most blocks leave the accumulator alone. Probabilities are then
//! at most `2^LAZY_RESCALE_LOG2` (`2^LAZY_RESCALE_LOG2` times a block's keys in the one pass
//! of the bf16 pairs, [`pair_dot::OnePass`]), far from overflow, and the final division by
//! `l` makes the result independent of when `m` moved.

use super::exp2::{exp2_approx, log2_approx};
use super::finite::{INF_BITS, magnitude_max};
use super::{multiversion, pair_dot};

/// Rows whose block maxima (and magnitudes) the maxima pass keeps in registers across the
/// columns, and whose sums the exponentials keep there: four AVX-512 vectors, so that a
/// strip's part of a column is four whole cache lines (one-vector strips walk the tile in
/// strides that the caches serve worse; a row at a time keeps the sums in memory).
const BLOCK_ROWS: usize = 64;

/// How far (in log2 units) a block maximum may exceed the reference maximum before the
/// accumulator is rescaled.
pub const LAZY_RESCALE_LOG2: f32 = 8.0;

/// `x` clamped into `[−f32::MAX, f32::MAX]`; NaN stays NaN. A visible score that
/// overflows f32 (a huge `q·k`, a bias near `f32::MAX` added) saturates, so the row's
/// softmax stays defined: the contract's [`attn_core::SCORE_LIMIT`] in the base-2 domain.
#[inline(always)]
pub(crate) fn saturate(x: f32) -> f32 {
    x.clamp(-f32::MAX, f32::MAX)
}

/// A block maximum beyond this (or `±inf`) means some score overflowed: the block's row is
/// saturated before the softmax (a rare, slow path).
pub(crate) const HUGE: f32 = f32::MAX / 2.0;

/// Whether a block maximum says that a score of its row overflowed: `+inf` or huge, or,
/// when nothing in the block is hidden (`all_visible`), `-inf` or hugely negative too.
#[inline(always)]
fn overflowed(block_max: f32, all_visible: bool) -> bool {
    block_max.abs() > HUGE && (block_max > 0.0 || all_visible)
}

/// Saturates the scores `s[i]` for `i` in `at` (one row) at `f32::MAX` — and at
/// `-f32::MAX` below when `all_visible`, elsewhere `-inf` is a hidden key and stays — and
/// returns their new maximum. The rare path after [`overflowed`].
#[inline(always)]
fn saturate_row(at: impl Iterator<Item = usize>, s: &mut [f32], all_visible: bool) -> f32 {
    let low = if all_visible {
        -f32::MAX
    } else {
        f32::NEG_INFINITY
    };
    let mut max = f32::NEG_INFINITY;
    for i in at {
        s[i] = s[i].clamp(low, f32::MAX);
        max = if s[i] > max { s[i] } else { max };
    }
    max
}

/// Per-row state of the online softmax for one query tile.
#[derive(Debug)]
pub(crate) struct RowState<'a> {
    /// Reference maximum per row (log2 domain); `-inf` while nothing was visible.
    pub m: &'a mut [f32],
    /// Running sum of `2^(s − m)` per row.
    pub l: &'a mut [f32],
    /// Factor the accumulator row must be multiplied by before this block's `P·V` is added.
    pub alpha: &'a mut [f32],
    /// `m` with `-inf` replaced by 0, so that `s − m` never computes `-inf − -inf`.
    pub m_safe: &'a mut [f32],
}

/// Where [`softmax_update_pairs`] puts the probabilities: rounded to bf16 in pairs of
/// columns ([`pair_dot::pack_probabilities`]'s layout, `ld` words between pairs), with
/// what rounding added to each row's weights in `delta`.
#[derive(Debug)]
pub(crate) struct PairsOut<'a> {
    pub words: &'a mut [u32],
    pub ld: usize,
    pub delta: &'a mut [f32],
    /// `4·rows` floats of scratch.
    pub scratch: &'a mut [f32],
    /// What the scores are still to be multiplied by (1 when their product applied the
    /// scale): the one-pass check multiplies them as it reads them, and a block that
    /// takes the two passes is scaled in place first (the same bits either way).
    pub pending_scale: f32,
    /// The plan's key-block width (the one-pass check's, [`pair_dot::OnePass`]).
    pub block_width: usize,
}

#[inline(always)]
fn update_body<const FMA: bool>(
    s: &mut [f32],
    ld: usize,
    rows: usize,
    cols: usize,
    state: &mut RowState<'_>,
    all_visible: bool,
    check_finite: bool,
) -> Option<bool> {
    let checks = (all_visible, check_finite);
    let rescale = maxima_body::<FMA>(s, ld, rows, cols, state, checks, None)?;
    // 3. P = 2^(s − m) in place, and the row sums: strips of rows whose sums stay in
    //    registers across the columns (summed in column order, as one row at a time would),
    //    each strip's part of a column a few whole cache lines; then the rows left.
    let (m_safe, l) = (&state.m_safe[..rows], &mut state.l[..rows]);
    let whole = rows - rows % BLOCK_ROWS;
    for i in (0..whole).step_by(BLOCK_ROWS) {
        let strip = exponentiate_strip::<FMA, false>(s, ld, i, cols, m_safe, l);
        l[i..i + BLOCK_ROWS].copy_from_slice(&strip.sums);
    }
    for j in 0..cols {
        let col = &mut s[j * ld + whole..j * ld + rows];
        for ((x, &mi), li) in col.iter_mut().zip(&m_safe[whole..]).zip(&mut l[whole..]) {
            let p = exp2_approx::<FMA>(*x - mi);
            *x = p;
            *li += p;
        }
    }
    Some(rescale)
}

/// What [`exponentiate_strip`] found in its strip of rows.
struct Strip {
    /// The rows' sums `l + Σ_j 2^(s_j − m)`, in column order.
    sums: [f32; BLOCK_ROWS],
    /// The rows' block maxima (NaN passed over), when tracked.
    max: [f32; BLOCK_ROWS],
    /// The rows' largest magnitude bits (sign cleared), when tracked.
    high: [u32; BLOCK_ROWS],
}

/// `2^(s − m)` in place over rows `i..i + BLOCK_ROWS` of the tile, each row's sum in a
/// register across the columns (summed in column order, as one row at a time would); with
/// `TRACK`, the rows' maxima and magnitudes found in the same pass.
#[inline(always)]
fn exponentiate_strip<const FMA: bool, const TRACK: bool>(
    s: &mut [f32],
    ld: usize,
    i: usize,
    cols: usize,
    m: &[f32],
    l: &[f32],
) -> Strip {
    let mi: [f32; BLOCK_ROWS] = core::array::from_fn(|t| m[i + t]);
    let mut out = Strip {
        sums: core::array::from_fn(|t| l[i + t]),
        max: [f32::NEG_INFINITY; BLOCK_ROWS],
        high: [0; BLOCK_ROWS],
    };
    for j in 0..cols {
        let col = &mut s[j * ld + i..][..BLOCK_ROWS];
        for t in 0..BLOCK_ROWS {
            let x = col[t];
            if TRACK {
                out.max[t] = if x > out.max[t] { x } else { out.max[t] };
                out.high[t] = out.high[t].max(x.to_bits() & !(1 << 31));
            }
            let p = exp2_approx::<FMA>(x - mi[t]);
            col[t] = p;
            out.sums[t] += p;
        }
    }
    out
}

/// [`softmax_update`] in one pass over the tile, for a block that moves no row's reference
/// maximum: `2^(s − m)` at the maxima as they are, while the same pass finds each row's
/// block maximum (and a non-finite score, when asked). When no row moves, overflows or
/// holds a non-finite score, the tile, the sums and the state are bit for bit what
/// [`softmax_update`] leaves (every factor 1): `Some(true)`; otherwise `Some(false)`, with
/// the tile overwritten and the state as it was, and the caller computes the scores again.
/// `None` (nothing touched) where it does not try: a row has seen nothing yet (or its
/// maximum is near overflow), or the rows are not whole strips.
#[inline(always)]
fn unmoved_body<const FMA: bool>(
    s: &mut [f32],
    ld: usize,
    rows: usize,
    cols: usize,
    state: &mut RowState<'_>,
    all_visible: bool,
    check_finite: bool,
) -> Option<bool> {
    let (m, l) = (&state.m[..rows], &mut state.l[..rows]);
    // New sums go to `alpha` (scratch until the end) so that a failed pass leaves `l`.
    let sums_out = &mut state.alpha[..rows];
    let far_from_overflow = |x: f32| x.is_finite() && x.abs() < HUGE / 2.0;
    if !rows.is_multiple_of(BLOCK_ROWS) || !m.iter().all(|&x| far_from_overflow(x)) {
        return None;
    }
    for i in (0..rows).step_by(BLOCK_ROWS) {
        let Strip { sums, max, high } = exponentiate_strip::<FMA, true>(s, ld, i, cols, m, l);
        for t in 0..BLOCK_ROWS {
            let (block, m) = (max[t], m[i + t]);
            let moves = block > m + LAZY_RESCALE_LOG2 || overflowed(block, all_visible);
            if moves || (check_finite && high[t] >= INF_BITS) {
                return Some(false);
            }
        }
        sums_out[i..i + BLOCK_ROWS].copy_from_slice(&sums);
    }
    l.copy_from_slice(sums_out);
    sums_out.fill(1.0);
    Some(true)
}

#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn update_pairs_body<const FMA: bool>(
    s: &mut [f32],
    ld: usize,
    rows: usize,
    cols: usize,
    state: &mut RowState<'_>,
    all_visible: bool,
    check_finite: bool,
    out: &mut PairsOut<'_>,
) -> Option<bool> {
    // Most blocks move no row's maximum: then one pass exponentiates at the reference
    // maxima as they are and finds that out. A row that has seen nothing yet starts from
    // the maximum of the block's first keys instead.
    let (scratch, reference) = out.scratch.split_at_mut(3 * rows);
    let reference = &mut reference[..rows];
    let mut kept = None;
    if reference_maxima::<FMA>(s, ld, cols, &state.m[..rows], out.pending_scale, reference) {
        let (l, delta) = (&mut state.l[..rows], &mut out.delta[..rows]);
        let block = (all_visible, out.block_width.max(cols));
        let mut pass = pair_dot::OnePass::start(scratch, l, delta, block);
        let span = (&s[..], ld, cols);
        if pass.exponentiate(
            span,
            reference,
            out.pending_scale,
            (&mut *out.words, out.ld),
        ) {
            if pass.settle(reference, check_finite, l, delta) {
                state.m[..rows].copy_from_slice(reference);
                state.m_safe[..rows].copy_from_slice(reference);
                // A row that saw nothing before has a zero accumulator: 1 scales it too.
                state.alpha[..rows].fill(1.0);
                return Some(false);
            }
            // The rows the pass kept keep their reference in the two passes too (and so
            // their bits), whatever the other rows do.
            kept = Some(&*reference);
        }
    }
    if out.pending_scale != 1.0 {
        for j in 0..cols {
            for x in &mut s[j * ld..j * ld + rows] {
                *x *= out.pending_scale;
            }
        }
        out.pending_scale = 1.0;
    }
    let checks = (all_visible, check_finite);
    let rescale = maxima_body::<FMA>(s, ld, rows, cols, state, checks, kept)?;
    let (m_safe, l) = (&state.m_safe[..rows], &mut state.l[..rows]);
    let delta = &mut out.delta[..rows];
    if rescale {
        for (d, &a) in delta.iter_mut().zip(&state.alpha[..rows]) {
            *d *= a;
        }
    }
    // 3. P = 2^(s − m), the row sums, and P rounded into its pairs in one pass over the
    //    tile, which is read once and not written.
    let words = (&mut *out.words, out.ld);
    pair_dot::exponentiate_pairs(s, ld, rows, cols, m_safe, l, words, delta);
    Some(rescale)
}

/// Keys whose maximum starts the one pass of a row that has seen nothing yet: a few
/// vectors' worth, a small part of the maxima pass they save.
const ESTIMATE_KEYS: usize = 32;

/// The reference maxima for the one pass over a block, into `guess` (as long as `m`):
/// `m`, with each row that has seen nothing yet (`-inf`) given the maximum of the block's
/// first [`ESTIMATE_KEYS`] scores (times `scale`), and NaN for a row that sees none of
/// them (the pass gives it up). Whether any row has one.
#[inline(always)]
fn reference_maxima<const FMA: bool>(
    s: &[f32],
    ld: usize,
    cols: usize,
    m: &[f32],
    scale: f32,
    guess: &mut [f32],
) -> bool {
    let rows = m.len();
    guess.copy_from_slice(m);
    if m.iter().all(|x| x.is_finite()) {
        return true;
    }
    guess.fill(f32::NEG_INFINITY);
    for j in 0..cols.min(ESTIMATE_KEYS) {
        for (g, &x) in guess.iter_mut().zip(&s[j * ld..j * ld + rows]) {
            let x = x * scale;
            *g = if x > *g { x } else { *g };
        }
    }
    for (g, &m) in guess.iter_mut().zip(m) {
        *g = match (m.is_finite(), g.is_finite()) {
            (true, _) => m,
            (false, true) => *g,
            (false, false) => f32::NAN,
        };
    }
    guess.iter().any(|g| g.is_finite())
}

/// Steps 1 and 2 of the softmax update: the block maxima, the saturation of overflowed
/// rows, and the lazy move of the reference maxima (`state.alpha`, `state.m_safe`, `l`
/// rescaled); `None` when `check_finite` finds a non-finite score (nothing changed). A
/// finite `kept[i]` is the reference the one pass kept for row `i`: it stays (NaN: the
/// row moves by the lazy threshold as any).
#[inline(always)]
fn maxima_body<const FMA: bool>(
    s: &mut [f32],
    ld: usize,
    rows: usize,
    cols: usize,
    state: &mut RowState<'_>,
    (all_visible, check_finite): (bool, bool),
    kept: Option<&[f32]>,
) -> Option<bool> {
    let m = &mut state.m[..rows];
    let l = &mut state.l[..rows];
    let alpha = &mut state.alpha[..rows];
    let m_safe = &mut state.m_safe[..rows];

    // 1. Block maxima (in `alpha`, used as scratch). NaN scores are passed over here; they
    //    still poison their own row through the exponential below. When asked, the same
    //    pass finds a non-finite score (the magnitude bits, see `finite`), and the update
    //    stops before it has changed any state.
    //    A strip of rows at a time, their maxima (and magnitudes) in registers across
    //    the columns; then the rows past the last strip.
    alpha.fill(f32::NEG_INFINITY);
    let whole = rows - rows % BLOCK_ROWS;
    let mut high = 0;
    for i in (0..whole).step_by(BLOCK_ROWS) {
        let mut max = [f32::NEG_INFINITY; BLOCK_ROWS];
        let mut highs = [0u32; BLOCK_ROWS];
        for j in 0..cols {
            let col = &s[j * ld + i..][..BLOCK_ROWS];
            for t in 0..BLOCK_ROWS {
                max[t] = if col[t] > max[t] { col[t] } else { max[t] };
                if check_finite {
                    highs[t] = highs[t].max(col[t].to_bits() & !(1 << 31));
                }
            }
        }
        alpha[i..i + BLOCK_ROWS].copy_from_slice(&max);
        high = highs.into_iter().fold(high, u32::max);
    }
    for j in 0..cols {
        let col = &s[j * ld + whole..j * ld + rows];
        for (b, &x) in alpha[whole..].iter_mut().zip(col) {
            *b = if x > *b { x } else { *b };
        }
        if check_finite {
            high = magnitude_max(col, high);
        }
    }
    if high >= INF_BITS {
        return None;
    }
    //    A +inf or huge maximum means a score overflowed: saturate that row, so that it
    //    counts as f32::MAX, not as a NaN. In a block with nothing hidden a -inf or huge
    //    negative maximum means the same (or every score is NaN), and the row saturates
    //    below too; elsewhere -inf is a hidden key and stays.
    for (i, b) in alpha.iter_mut().enumerate() {
        if overflowed(*b, all_visible) {
            *b = saturate_row((0..cols).map(|j| j * ld + i), s, all_visible);
        }
    }

    // 2. Move the reference maximum where the block exceeds it by more than the lazy
    //    threshold (or to what the one pass kept); alpha = 2^(m_old − m_new) there (0
    //    when m_old was -inf), 1 elsewhere.
    let mut rescale = false;
    for i in 0..rows {
        let (old, block) = (m[i], alpha[i]);
        let new = match kept.map(|k| k[i]) {
            Some(k) if !k.is_nan() => k,
            _ if block > old + LAZY_RESCALE_LOG2 => block,
            _ => old,
        };
        if new != old {
            alpha[i] = exp2_approx::<FMA>(old - new);
            m[i] = new;
            rescale = true;
        } else {
            alpha[i] = 1.0;
        }
        m_safe[i] = if m[i] == f32::NEG_INFINITY { 0.0 } else { m[i] };
        l[i] *= alpha[i];
    }
    Some(rescale)
}

multiversion! {
    /// Runs the online-softmax step on a `rows × cols` score tile stored column-major with
    /// leading dimension `ld`: afterwards the tile holds the unnormalised probabilities,
    /// `state` the updated maxima and sums, and `state.alpha` the factor each accumulator
    /// row must be scaled by. Returns whether any factor differs from 1. Overflowed scores
    /// saturate at `±f32::MAX`: `+inf` always, `-inf` when `all_visible` says that no
    /// score of the tile is hidden (elsewhere `-inf` is a hidden key). With `check_finite`
    /// (a tile with nothing hidden, straight from its GEMM) a non-finite score returns
    /// `None` with the tile and the state untouched, for the caller to repair first.
    pub(crate) fn softmax_update(
        s: &mut [f32],
        ld: usize,
        rows: usize,
        cols: usize,
        state: &mut RowState<'_>,
        all_visible: bool,
        check_finite: bool,
    ) -> Option<bool> = update_body
}

multiversion! {
    /// [`softmax_update`] in one pass for a block that moves no row's maximum (see
    /// [`unmoved_body`]): `Some(true)` when it did, `Some(false)` with the tile overwritten,
    /// `None` untouched where it does not try.
    pub(crate) fn softmax_update_unmoved(
        s: &mut [f32],
        ld: usize,
        rows: usize,
        cols: usize,
        state: &mut RowState<'_>,
        all_visible: bool,
        check_finite: bool,
    ) -> Option<bool> = unmoved_body
}

multiversion! {
    /// [`softmax_update`] for the native bf16 products: the probabilities go into `out` as
    /// bf16 pairs (and `out.delta`, first rescaled like the sums, gains what rounding
    /// added) instead of into the tile, which keeps its scores. The words, the sums and
    /// the state are bit for bit those of [`softmax_update`] followed by
    /// [`pair_dot::pack_probabilities`], `l + delta` within a rounding of theirs. Without
    /// AVX512_BF16 the words are not written.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn softmax_update_pairs(
        s: &mut [f32],
        ld: usize,
        rows: usize,
        cols: usize,
        state: &mut RowState<'_>,
        all_visible: bool,
        check_finite: bool,
        out: &mut PairsOut<'_>,
    ) -> Option<bool> = update_pairs_body
}

#[inline(always)]
fn scale_rows_body<const FMA: bool>(
    acc: &mut [f32],
    ld: usize,
    rows: usize,
    cols: usize,
    alpha: &[f32],
) {
    for j in 0..cols {
        for (x, &a) in acc[j * ld..j * ld + rows].iter_mut().zip(&alpha[..rows]) {
            *x *= a;
        }
    }
}

#[inline(always)]
fn normalise_rows_body<const FMA: bool>(
    acc: &mut [f32],
    ld: usize,
    rows: usize,
    cols: usize,
    l: &[f32],
) {
    for j in 0..cols {
        for (x, &l) in acc[j * ld..j * ld + rows].iter_mut().zip(&l[..rows]) {
            *x = if l == 0.0 { 0.0 } else { *x / l };
        }
    }
}

multiversion! {
    /// Divides row `i` of a column-major `rows × cols` matrix by its sum `l[i]` (a row
    /// that saw nothing, `l[i] = 0`, becomes zeros): a division per entry, as the scalar
    /// `a / l` gives it, but sixteen rows at a time.
    pub(crate) fn normalise_rows(acc: &mut [f32], ld: usize, rows: usize, cols: usize, l: &[f32]) = normalise_rows_body
}

#[inline(always)]
fn saturate_visible_body<const FMA: bool>(
    s: &mut [f32],
    ld: usize,
    cols: usize,
    from: &[u32],
    to: &[u32],
) {
    let rows = from.len().min(to.len());
    for j in 0..cols {
        let key = j as u32;
        let col = &mut s[j * ld..j * ld + rows];
        for ((x, &a), &b) in col.iter_mut().zip(&from[..rows]).zip(&to[..rows]) {
            let visible = a <= key && key < b;
            *x = if visible {
                saturate(*x)
            } else {
                f32::NEG_INFINITY
            };
        }
    }
}

#[inline(always)]
fn scale_visible_body<const FMA: bool>(
    s: &mut [f32],
    ld: usize,
    cols: usize,
    (from, to): (&[u32], &[u32]),
    scale: f32,
) -> bool {
    let rows = from.len().min(to.len());
    // The largest magnitude bits of a visible score: an integer maximum vectorises where a
    // flag would not.
    let mut high = 0u32;
    for j in 0..cols {
        let key = j as u32;
        let col = &mut s[j * ld..j * ld + rows];
        for ((x, &a), &b) in col.iter_mut().zip(&from[..rows]).zip(&to[..rows]) {
            let visible = a <= key && key < b;
            let y = *x * scale;
            high = high.max(if visible { y.to_bits() & !(1 << 31) } else { 0 });
            *x = if visible { y } else { f32::NEG_INFINITY };
        }
    }
    high < INF_BITS
}

multiversion! {
    /// [`saturate_visible`] for scores still to be multiplied by `scale`: row `i` keeps
    /// its keys `from[i]..to[i]` times `scale` and hides the rest, in one pass. Returns
    /// whether every visible score is finite: then saturating would change nothing;
    /// otherwise the caller repairs them and masks again.
    pub(crate) fn scale_visible(s: &mut [f32], ld: usize, cols: usize, bounds: (&[u32], &[u32]), scale: f32) -> bool = scale_visible_body
}

multiversion! {
    /// Row `i` of a column-major `rows × cols` score tile keeps its keys `from[i]..to[i]`
    /// (block-local), saturated ([`saturate`]), and hides the rest (`-inf`): the masking of
    /// a block that straddles a structural boundary in one pass down the columns, sixteen
    /// rows at a time, instead of a saturating pass and a strided pass per row.
    pub(crate) fn saturate_visible(s: &mut [f32], ld: usize, cols: usize, from: &[u32], to: &[u32]) = saturate_visible_body
}

multiversion! {
    /// Multiplies row `i` of a column-major `rows × cols` matrix by `alpha[i]`.
    pub(crate) fn scale_rows(acc: &mut [f32], ld: usize, rows: usize, cols: usize, alpha: &[f32]) = scale_rows_body
}

#[inline(always)]
fn log_sum_exp_body<const FMA: bool>(m: &[f32], l: &[f32], empty: f32, lse: &mut [f32]) {
    for ((x, &m), &l) in lse.iter_mut().zip(m).zip(l) {
        let y = (m + log2_approx::<FMA>(l)) * core::f32::consts::LN_2;
        *x = if l == 0.0 { empty } else { y };
    }
}

multiversion! {
    /// The natural-log LSE `ln 2 · (m + log2 l)` of each row from its online-softmax state
    /// (log2 domain), vectorised; a row with `l = 0` (it saw nothing) gets `empty`.
    pub(crate) fn log_sum_exp(m: &[f32], l: &[f32], empty: f32, lse: &mut [f32]) = log_sum_exp_body
}

/// Lanes of the row pass's running maxima and sums (one AVX-512 vector).
const LANES: usize = 16;

#[inline(always)]
fn softmax_row_body<const FMA: bool>(
    s: &mut [f32],
    m: &mut f32,
    l: &mut f32,
    all_visible: bool,
) -> f32 {
    let mut block = [f32::NEG_INFINITY; LANES];
    let chunks = s.chunks_exact(LANES);
    for x in chunks.remainder() {
        block[0] = if *x > block[0] { *x } else { block[0] };
    }
    for c in chunks {
        for t in 0..LANES {
            block[t] = if c[t] > block[t] { c[t] } else { block[t] };
        }
    }
    let mut block = block
        .iter()
        .fold(f32::NEG_INFINITY, |a, &b| if b > a { b } else { a });
    // As in `softmax_update`: an overflowed score saturates (below too when nothing in
    // the row is hidden).
    if overflowed(block, all_visible) {
        block = saturate_row(0..s.len(), s, all_visible);
    }
    let mut alpha = 1.0;
    if block > *m + LAZY_RESCALE_LOG2 {
        alpha = exp2_approx::<FMA>(*m - block);
        *m = block;
    }
    let m_safe = if *m == f32::NEG_INFINITY { 0.0 } else { *m };
    let mut sums = [0.0f32; LANES];
    let mut chunks = s.chunks_exact_mut(LANES);
    for c in &mut chunks {
        for t in 0..LANES {
            c[t] = exp2_approx::<FMA>(c[t] - m_safe);
            sums[t] += c[t];
        }
    }
    for (t, x) in chunks.into_remainder().iter_mut().enumerate() {
        *x = exp2_approx::<FMA>(*x - m_safe);
        sums[t] += *x;
    }
    *l = *l * alpha + sums.iter().sum::<f32>();
    alpha
}

multiversion! {
    /// The online-softmax step along one row of scores (log2 domain), for the row kernels:
    /// updates the reference maximum `m` lazily and the sum `l`, replaces the scores by
    /// `2^(s − m)`, and returns the factor the row's accumulator must be scaled by
    /// (`all_visible` as for [`softmax_update`]).
    pub(crate) fn softmax_row(s: &mut [f32], m: &mut f32, l: &mut f32, all_visible: bool) -> f32 = softmax_row_body
}

#[cfg(test)]
mod tests {
    use core::f32::consts::LOG2_E;

    use super::*;

    fn state_vecs(rows: usize) -> [Vec<f32>; 4] {
        [
            vec![f32::NEG_INFINITY; rows],
            vec![0.0; rows],
            vec![0.0; rows],
            vec![0.0; rows],
        ]
    }

    /// [`softmax_update`] on a tile with the state held in `[m, l, alpha, m_safe]`.
    fn update(
        s: &mut [f32],
        ld: usize,
        rows: usize,
        cols: usize,
        state: &mut [Vec<f32>; 4],
    ) -> bool {
        let [m, l, alpha, m_safe] = state;
        let mut st = RowState {
            m,
            l,
            alpha,
            m_safe,
        };
        softmax_update(s, ld, rows, cols, &mut st, false, false).expect("not checked")
    }

    /// A state after a first block, for [`softmax_update_unmoved`]'s tests.
    fn after_first_block(rows: usize, cols: usize) -> [Vec<f32>; 4] {
        let mut state = state_vecs(rows);
        let mut s: Vec<f32> = (0..rows * cols)
            .map(|x| ((x * 37) % 101) as f32 * 0.07 - 3.0)
            .collect();
        update(&mut s, rows, rows, cols, &mut state);
        state
    }

    fn unmoved(s: &mut [f32], rows: usize, cols: usize, state: &mut [Vec<f32>; 4]) -> Option<bool> {
        let [m, l, alpha, m_safe] = state;
        let mut st = RowState {
            m,
            l,
            alpha,
            m_safe,
        };
        softmax_update_unmoved(s, rows, rows, cols, &mut st, true, true)
    }

    #[test]
    fn the_one_pass_is_the_two_passes_bit_for_bit_or_declines() {
        let (rows, cols) = (2 * BLOCK_ROWS, 45);
        let block: Vec<f32> = (0..rows * cols)
            .map(|x| ((x * 53) % 97) as f32 * 0.09 - 4.0)
            .collect();
        // No row moves: the tile, the sums and the state as the two passes leave them.
        let (mut two, mut one) = (after_first_block(rows, cols), after_first_block(rows, cols));
        let (mut s_two, mut s_one) = (block.clone(), block.clone());
        let rescale = update(&mut s_two, rows, rows, cols, &mut two);
        assert!(!rescale);
        assert_eq!(unmoved(&mut s_one, rows, cols, &mut one), Some(true));
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&s_one), bits(&s_two));
        for (a, b) in one.iter().zip(&two) {
            assert_eq!(bits(a), bits(b));
        }
        // A row that moves, a non-finite score: declined, the state untouched.
        for (at, x) in [(5 * rows + 70, 40.0), (3 * rows + 1, f32::NEG_INFINITY)] {
            let mut state = after_first_block(rows, cols);
            let before = state.clone();
            let mut s = block.clone();
            s[at] = x;
            assert_eq!(unmoved(&mut s, rows, cols, &mut state), Some(false));
            assert_eq!(bits(&state[0]), bits(&before[0]));
            assert_eq!(bits(&state[1]), bits(&before[1]));
        }
        // A row that has seen nothing, or rows that are no whole strips: not tried.
        for (rows, cols) in [(rows, cols), (BLOCK_ROWS + 8, cols)] {
            let mut state = state_vecs(rows);
            let mut s = vec![1.0f32; rows * cols];
            if rows % BLOCK_ROWS != 0 {
                state = after_first_block(rows, cols);
            }
            assert_eq!(unmoved(&mut s, rows, cols, &mut state), None);
            assert!(s.iter().all(|&x| x == 1.0));
        }
    }

    #[test]
    fn two_blocks_equal_one_softmax() {
        // Row 0 grows its maximum a lot in block 2 (forces a rescale); row 1 does not.
        let rows = 2;
        let blocks = [vec![1.0f32, 0.0, 2.0, 0.5], vec![30.0f32, 1.0, -1.0, 0.25]];
        let mut state = state_vecs(rows);
        let mut acc_weight = [0.0f64; 2]; // Σ p·(value = column index) to check alpha use
        let mut col0 = 0;
        for block in &blocks {
            let mut s = block.clone();
            update(&mut s, rows, rows, 2, &mut state);
            for i in 0..rows {
                acc_weight[i] *= f64::from(state[2][i]);
                for j in 0..2 {
                    acc_weight[i] += f64::from(s[j * rows + i]) * (col0 + j) as f64;
                }
            }
            col0 += 2;
        }
        for i in 0..rows {
            let scores: Vec<f64> = (0..4)
                .map(|j| f64::from(blocks[j / 2][(j % 2) * rows + i]))
                .collect();
            let mx = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let w: Vec<f64> = scores.iter().map(|s| (s - mx).exp2()).collect();
            let sum: f64 = w.iter().sum();
            let want: f64 = w.iter().enumerate().map(|(j, w)| w * j as f64).sum::<f64>() / sum;
            let got = acc_weight[i] / f64::from(state[1][i]);
            assert!((got - want).abs() < 1e-6, "row {i}: {got} vs {want}");
        }
    }

    #[test]
    fn nothing_visible_leaves_zero_sum_and_no_nan() {
        let mut s = vec![f32::NEG_INFINITY; 8];
        let mut state = state_vecs(4);
        update(&mut s, 4, 4, 2, &mut state);
        assert!(s.iter().all(|&p| p == 0.0));
        assert!(state[1].iter().all(|&x| x == 0.0));
        assert!(state[0].iter().all(|&x| x == f32::NEG_INFINITY));
    }

    #[test]
    fn small_growth_does_not_rescale() {
        let mut s = vec![1.0f32, 2.0];
        let mut state = state_vecs(1);
        assert!(
            update(&mut s, 1, 1, 2, &mut state),
            "first block moves m from -inf"
        );
        let mut s2 = vec![5.0f32];
        assert!(
            !update(&mut s2, 1, 1, 1, &mut state),
            "growth of 3 < threshold"
        );
        assert_eq!(s2[0], 8.0); // 2^(5 − 2): probabilities may exceed 1 under lazy rescale
    }

    #[test]
    fn hidden_row_stays_empty() {
        let mut p = vec![f32::NEG_INFINITY; 20];
        let (mut m, mut l) = (f32::NEG_INFINITY, 0.0);
        softmax_row(&mut p, &mut m, &mut l, false);
        assert_eq!(l, 0.0);
        assert!(p.iter().all(|&x| x == 0.0));
    }

    /// A row that has seen nothing starts the one pass at the maximum of the block's first
    /// keys: kept when the rest of the block stays within the allowance, with the same
    /// weights up to the reference (`l·2^m` within rounding); a row far above it takes the
    /// two passes, bit for bit the plain update's, and the other rows keep what they kept.
    #[test]
    fn a_fresh_row_starts_at_its_first_keys() {
        if !pair_dot::available() && !crate::kernel::amx::available() {
            return;
        }
        let (rows, cols) = (20usize, 100usize);
        let ld = rows.next_multiple_of(pair_dot::LANES);
        // Key 60 lies 5 above the first keys (kept), or 40 above them (two passes): in
        // every row, in none, or in all but the first.
        let lifts: [fn(usize) -> f32; 3] = [|_| 5.0, |_| 40.0, |i| if i == 0 { 40.0 } else { 5.0 }];
        for lift in lifts {
            let tile: Vec<f32> = (0..cols * rows)
                .map(|x| {
                    if x / rows == 60 {
                        lift(x % rows)
                    } else {
                        (x % 7) as f32 * 0.1
                    }
                })
                .collect();
            let mut plain = state_vecs(rows);
            let mut fused = state_vecs(rows);
            update(&mut tile.clone(), rows, rows, cols, &mut plain);
            let mut words = vec![0u32; pair_dot::pairs(cols) * ld];
            let mut delta = vec![0.0f32; rows];
            let mut scratch = vec![0.0; 4 * rows];
            let [m, l, alpha, m_safe] = &mut fused;
            let mut st = RowState {
                m,
                l,
                alpha,
                m_safe,
            };
            let mut out = PairsOut {
                words: &mut words,
                ld,
                delta: &mut delta,
                scratch: &mut scratch,
                pending_scale: 1.0,
                block_width: cols,
            };
            let r = softmax_update_pairs(
                &mut tile.clone(),
                rows,
                rows,
                cols,
                &mut st,
                true,
                true,
                &mut out,
            );
            // The two passes move the fresh rows' maxima from -inf (a rescale by 0).
            let all_kept = (0..rows).all(|i| lift(i) == 5.0);
            assert_eq!(r, Some(!all_kept));
            for i in 0..rows {
                let first = (0..32).map(|j| tile[j * rows + i]).fold(f32::MIN, f32::max);
                let (m, l) = (fused[0][i], fused[1][i]);
                if lift(i) == 5.0 {
                    assert_eq!(m, first, "row {i}");
                    let (a, b) = (l * m.exp2(), plain[1][i] * plain[0][i].exp2());
                    assert!((a - b).abs() <= 1e-6 * b, "row {i}: {a} vs {b}");
                } else {
                    assert_eq!((m, l), (plain[0][i], plain[1][i]), "row {i}");
                }
            }
        }
    }

    /// The fused update writes what the plain update and the packer write, bit for bit:
    /// the same words, sums and maxima, and the sums of the rounded weights within a
    /// rounding, over blocks that rescale and ragged shapes (an odd column count, rows past
    /// a vector).
    #[test]
    fn pairs_update_is_the_update_then_the_packer() {
        if !pair_dot::available() && !crate::kernel::amx::available() {
            return;
        }
        // From rows that have seen keys (reference maximum 0, sum 1; a row that has seen
        // none starts the one pass at its first keys' maximum, see below): a block that
        // moves no maximum (one pass), one that moves them past the one pass's allowance
        // (`LAZY_RESCALE_LOG2 + log2(cols)`: a rescale), then blocks that do not.
        const OFFSETS: [f32; 4] = [-4.0, 30.0, 32.0, 31.0];
        let seeded = |rows: usize| {
            let mut state = state_vecs(rows);
            state[0].fill(0.0);
            state[1].fill(1.0);
            state[3].fill(0.0);
            state
        };
        let shapes = [(1usize, 1usize), (5, 7), (16, 32), (37, 64), (128, 33)];
        // Scores already scaled, or scaled as the fused pass reads them.
        for ((rows, cols), pending) in shapes.into_iter().flat_map(|x| [(x, 1.0), (x, LOG2_E)]) {
            let ld = rows.next_multiple_of(pair_dot::LANES);
            let mut plain = seeded(rows);
            let mut fused = seeded(rows);
            let (mut delta_plain, mut delta_fused) = (vec![0.25f32; rows], vec![0.25f32; rows]);
            for (block, offset) in OFFSETS.into_iter().enumerate() {
                let raw: Vec<f32> = (0..cols * rows)
                    .map(|x| ((x * 7 + block * 13) % 23) as f32 * 0.37 + offset)
                    .collect();
                let tile: Vec<f32> = raw.iter().map(|x| x * pending).collect();
                let (mut s1, mut s2) = (tile.clone(), raw.clone());
                let mut words_plain = vec![0u32; pair_dot::pairs(cols) * ld];
                let mut words_fused = words_plain.clone();
                let rescale = update(&mut s1, rows, rows, cols, &mut plain);
                if rescale {
                    for (d, a) in delta_plain.iter_mut().zip(&plain[2]) {
                        *d *= a;
                    }
                }
                pair_dot::pack_probabilities(
                    &s1,
                    rows,
                    rows,
                    cols,
                    &mut words_plain,
                    ld,
                    &mut delta_plain,
                );
                let mut scratch = vec![0.0; 4 * rows + 5]; // longer than needed, as in the engine
                let [m, l, alpha, m_safe] = &mut fused;
                let mut st = RowState {
                    m,
                    l,
                    alpha,
                    m_safe,
                };
                let mut out = PairsOut {
                    words: &mut words_fused,
                    ld,
                    delta: &mut delta_fused,
                    scratch: &mut scratch,
                    pending_scale: pending,
                    block_width: cols,
                };
                let r = softmax_update_pairs(
                    &mut s2, rows, rows, cols, &mut st, false, false, &mut out,
                );
                assert_eq!(r, Some(rescale));
                assert!(s2 == raw || s2 == tile, "the tile keeps its scores");
                assert_eq!(words_fused, words_plain, "{rows}x{cols} block {block}");
                for (a, b) in plain.iter().zip(&fused) {
                    assert_eq!(a, b);
                }
                for ((l, a), b) in plain[1].iter().zip(&delta_fused).zip(&delta_plain) {
                    let (fused, plain) = (l + a, l + b);
                    assert!(
                        (fused - plain).abs() <= 4.0 * f32::EPSILON * plain,
                        "{fused} {plain}"
                    );
                }
            }
        }
    }
}

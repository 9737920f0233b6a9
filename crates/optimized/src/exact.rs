//! The exact slow paths for magnitudes that f32 cannot carry, shared by the forward and
//! backward passes. Each runs only where a cheap test says it must, so ordinary inputs never
//! pay for it:
//!
//! - scores ([`rescore`]): a dot product of finite rows whose f32 partial sums overflowed
//!   (`1e38·10 + 1e38·(−10)` is NaN in f32, 0 exactly) is recomputed in f64 — the product
//!   of two f32 values is exact there and no sum of them over any width overflows — and
//!   saturated like every score; so is every score of a query row whose scaling by
//!   `scale·log2(e)` left f32. The test in front is [`tile_is_finite`] on the raw tile: an
//!   f32 sum that overflowed never comes back into the finite range.
//! - rows ([`repair_rows`]): a forward row whose f32 accumulator `Σ p·v` overflowed (values
//!   near `f32::MAX`: the accumulator is unnormalised) is recomputed in f64 from its scores,
//!   provided everything the row sees is finite — otherwise a NaN or infinity in its inputs
//!   is the reason, and the contract lets it through.
//!
//! Both compute what the reference computes, in the base-2 domain the engine works in.
//!
//! [`tile_is_finite`]: crate::kernel::finite::tile_is_finite

use core::ops::Range;

use faer::{MatRef, RowRef};

use crate::kernel::element::Element;
use crate::kernel::finite::row_is_finite;
use crate::keys::KeySource;
use crate::problem::HeadInputs;

/// The contract's score limit in the base-2 domain (`SCORE_LIMIT · log2(e)`).
const LIMIT: f64 = f32::MAX as f64;

fn saturate(x: f64) -> f64 {
    x.clamp(-LIMIT, LIMIT)
}

/// `scale·log2(e) · q·k_j` in f64, saturated: the exact log2-domain score of query row `q`
/// and row `j` of the keys `k`.
fn exact_score<T: Element, K: KeySource<T>>(
    q: RowRef<'_, T>,
    k: &K,
    j: usize,
    scale_log2: f32,
) -> f64 {
    let dot: f64 = q
        .iter()
        .enumerate()
        .map(|(c, a)| f64::from(a.to_f32()) * f64::from(k.at(j, c)))
        .sum();
    saturate(dot * f64::from(scale_log2))
}

/// The exact log2-domain score of query `row` and key `j` of `head` with the additive bias
/// saturated in as the masks add it; `None` where the key is hidden from the row (by the
/// structure, the boolean mask or a `-inf` bias). A NaN bias gives a NaN score.
fn visible_score<T: Element, K: KeySource<T>>(
    head: &HeadInputs<'_, T, K>,
    row: usize,
    j: usize,
) -> Option<f64> {
    let mrow = head.mask_row(row);
    let bias = head.mask.bias(mrow, j);
    if !head.key_range(row).contains(&j) || !head.mask.allows(mrow, j) || bias == f32::NEG_INFINITY
    {
        return None;
    }
    let mut s = exact_score(head.q.row(row), &head.k, j - head.key_base, head.scale_log2);
    if head.mods.modifies_scores() {
        // The modifiers' own definition (f64 built-ins), in natural units.
        let natural = head.mods.score(s * core::f64::consts::LN_2, mrow, j);
        s = saturate(natural * core::f64::consts::LOG2_E);
    }
    Some(if head.mask.additive().is_some() {
        saturate(s + saturate(f64::from(bias) * core::f64::consts::LOG2_E))
    } else {
        s
    })
}

/// The top visible score of row `row` of `head` (log2 domain, modified, biased and
/// saturated, as the tiles hold it) and how many keys reach it; `None` for a row that sees
/// no key or a NaN score. For the backward pass's rows whose LSE saturated, where f32 cannot
/// carry `top + log2(count)`: their weights are `1/count` at the top, 0 elsewhere.
pub(crate) fn row_top<T: Element, K: KeySource<T>>(
    head: &HeadInputs<'_, T, K>,
    row: usize,
) -> Option<(f64, usize)> {
    let (mut top, mut count) = (f64::NEG_INFINITY, 0usize);
    for j in head.key_range(row) {
        let Some(s) = visible_score(head, row, j) else {
            continue;
        };
        if s.is_nan() {
            return None;
        }
        if s > top {
            (top, count) = (s, 1);
        } else if s == top {
            count += 1;
        }
    }
    (count > 0).then_some((top, count))
}

/// Recomputes, exactly, the raw log2-domain scores of a tile that f32 could not carry:
/// query rows `q` against key rows `k`, entry `(i, j)` at `s[i·rs + j·cs]`. An entry is
/// recomputed when its query and key rows are finite and it is not finite, or its query row
/// was scaled out of f32 (`rescaled[i]`, when given); the other non-finite entries (a NaN or
/// infinity in the operands) keep what f32 gave them.
pub(crate) fn rescore<T: Element, K: KeySource<T>>(
    s: &mut [f32],
    (rs, cs): (usize, usize),
    q: MatRef<'_, T>,
    k: &K,
    scale_log2: f32,
    rescaled: Option<&[bool]>,
) {
    // Allocated on this rare path only; at most one tile's keys.
    let k_finite: Vec<bool> = (0..k.len()).map(|j| k.row_finite(j)).collect();
    for i in 0..q.nrows() {
        if !row_is_finite(q.row(i)) {
            continue;
        }
        let all = rescaled.is_some_and(|r| r[i]);
        for (j, &k_ok) in k_finite.iter().enumerate() {
            let x = &mut s[i * rs + j * cs];
            if k_ok && (all || !x.is_finite()) {
                *x = exact_score(q.row(i), k, j, scale_log2) as f32;
            }
        }
    }
}

/// Whether each key of `keys` has finite K and V rows, computed when a row first needs it.
struct FiniteKeys {
    start: usize,
    ok: Vec<bool>,
}

impl FiniteKeys {
    /// `None` when the list cannot be allocated (then no row is repaired).
    fn of<T: Element, K: KeySource<T>>(
        head: &HeadInputs<'_, T, K>,
        keys: Range<usize>,
    ) -> Option<Self> {
        let mut ok = Vec::new();
        ok.try_reserve_exact(keys.len()).ok()?;
        let local = |j: usize| j - head.key_base;
        ok.extend(
            keys.clone()
                .map(|j| head.k.row_finite(local(j)) && head.v.row_finite(local(j))),
        );
        Some(Self {
            start: keys.start,
            ok,
        })
    }
}

/// Row `row` of `head` over the keys `keys` in f64, written into `out` (`d_v` entries), and
/// its natural-log LSE; `None` when the row sees a NaN or an infinity (in its query, a key,
/// a value or a bias), which is then what made its f32 result non-finite.
fn exact_row<T: Element, K: KeySource<T>>(
    head: &HeadInputs<'_, T, K>,
    row: usize,
    keys: &FiniteKeys,
    out: &mut [f64],
) -> Option<f32> {
    if !row_is_finite(head.q.row(row)) {
        return None;
    }
    let range = head.key_range(row);
    let visible = range.start.max(keys.start)..range.end.min(keys.start + keys.ok.len());
    out.fill(0.0);
    let (mut m, mut l) = (f64::NEG_INFINITY, 0.0f64);
    for j in visible {
        let Some(s) = visible_score(head, row, j) else {
            continue;
        };
        if s.is_nan() || !keys.ok[j - keys.start] {
            return None;
        }
        let local = j - head.key_base;
        // Online softmax in f64: rescale when the maximum moves.
        if s > m {
            let alpha = (m - s).exp2();
            out.iter_mut().for_each(|o| *o *= alpha);
            l *= alpha;
            m = s;
        }
        let p = (s - m).exp2();
        l += p;
        // Dropout drops the weight after the softmax: the sum keeps it.
        let z = head
            .mods
            .dropout
            .map_or(1.0, |d| f64::from(d.factor(row, j)));
        for (c, o) in out.iter_mut().enumerate().filter(|_| z != 0.0) {
            *o += p * z * f64::from(head.v.at(local, c));
        }
    }
    if l == 0.0 {
        return Some(f32::NEG_INFINITY);
    }
    out.iter_mut().for_each(|o| *o /= l);
    Some(((m + l.log2()) * core::f64::consts::LN_2) as f32)
}

/// Recomputes exactly the rows `rows` of `head` (over the keys `keys`) for which `bad` says
/// the f32 result is not finite and whose inputs are all finite, handing each to
/// `write(i, output, lse)` (`i` counted from `rows.start`).
pub(crate) fn repair_rows<T: Element, K: KeySource<T>>(
    head: &HeadInputs<'_, T, K>,
    rows: Range<usize>,
    keys: Range<usize>,
    bad: impl Fn(usize) -> bool,
    mut write: impl FnMut(usize, &[f64], f32),
) {
    let mut finite_keys = None;
    let mut out = vec![0.0f64; head.v.width()];
    for (i, row) in rows.enumerate() {
        if !bad(i) {
            continue;
        }
        if finite_keys.is_none() {
            finite_keys = FiniteKeys::of(head, keys.clone());
        }
        let Some(keys) = finite_keys.as_ref() else {
            return;
        };
        if let Some(lse) = exact_row(head, row, keys, &mut out) {
            write(i, &out, lse);
        }
    }
}

/// One query head of a backward group, for [`group_gradients`]: its inputs (Q, K, V, mask,
/// scale) and the upstream gradient, the forward's output and its natural-log LSE.
pub(crate) struct BackwardHead<'a, T, K> {
    pub inputs: HeadInputs<'a, T, K>,
    pub d_out: MatRef<'a, T>,
    pub out: MatRef<'a, T>,
    pub lse: &'a [f32],
}

fn flags(n: usize, f: impl Fn(usize) -> bool) -> Option<Vec<bool>> {
    let mut v = Vec::new();
    v.try_reserve_exact(n).ok()?;
    v.extend((0..n).map(f));
    Some(v)
}

/// A backward group prepared for exact repairs: which rows and keys are finite, and `D`.
struct BackwardGroup<'h, 'a, T, K> {
    heads: &'h [BackwardHead<'a, T, K>],
    v: K,
    scale: f64,
    /// Per head: whether row `i`'s Q, dO, O, biases are finite and its LSE is not NaN.
    row_ok: Vec<Vec<bool>>,
    /// Per head: `D_i = Σ_t dO_it · O_it` in f64.
    d: Vec<Vec<f64>>,
    /// Whether key `j`'s K and V rows are finite.
    key_ok: Vec<bool>,
}

impl<T: Element, K: KeySource<T>> BackwardGroup<'_, '_, T, K> {
    /// `(P, dS)` of row `i` of head `h` and key `j`, exactly; `None` where the key is hidden
    /// from the row or its weight is 0 (then it contributes nothing).
    fn pair(&self, h: usize, i: usize, j: usize) -> Option<(f64, f64)> {
        let head = &self.heads[h];
        let lse = head.lse[i];
        if lse == f32::NEG_INFINITY {
            return None;
        }
        let s = visible_score(&head.inputs, i, j)?;
        let lse2 = saturate(f64::from(lse) * core::f64::consts::LOG2_E);
        let p = (s - lse2).min(0.0).exp2();
        if p == 0.0 {
            return None;
        }
        let d_out = head.d_out.row(i);
        // Through the dropout: dP and the weight dV sums are the kept ones, times 1/(1 − p).
        let z = head
            .inputs
            .mods
            .dropout
            .map_or(1.0, |d| f64::from(d.factor(i, j)));
        let dp: f64 = (0..self.v.width())
            .filter(|_| z != 0.0)
            .map(|t| f64::from(d_out[t].to_f32()) * f64::from(self.v.at(j, t)))
            .sum();
        let ds = p * (z * dp - self.d[h][i]);
        // As the streaming pass's chain rule: 0 stays 0 whatever the derivative.
        Some((
            p * z,
            if ds == 0.0 {
                0.0
            } else {
                ds * self.derivative(h, i, j)
            },
        ))
    }

    /// `∂modified/∂raw` of the score of row `i` of head `h` and key `j` (1 without
    /// modifiers), at the exact raw score in natural units: the chain rule of the
    /// streaming pass ([`crate::backward`]) in f64.
    fn derivative(&self, h: usize, i: usize, j: usize) -> f64 {
        let x = &self.heads[h].inputs;
        if x.mods.softcap.is_none() && x.mods.user.is_none() {
            return 1.0;
        }
        let raw = exact_score(x.q.row(i), &x.k, j - x.key_base, x.scale_log2);
        // Saturated at ±f32::MAX, as the streaming pass saturates it.
        let d = x.mods.derivative(raw * core::f64::consts::LN_2, i, j);
        d.clamp(-f64::from(f32::MAX), f64::from(f32::MAX))
    }

    /// Whether row `i` of head `h` and every key it sees are finite.
    fn row_repairable(&self, h: usize, i: usize) -> bool {
        let x = &self.heads[h].inputs;
        let visible = x.key_range(i);
        self.row_ok[h][i]
            && visible
                .clone()
                .all(|j| self.key_ok[j] || !x.mask.sees(x.mask_row(i), j))
    }

    /// Whether key `j` and every row that sees it are finite.
    fn key_repairable(&self, j: usize) -> bool {
        self.key_ok[j]
            && self.heads.iter().enumerate().all(|(h, head)| {
                let x = &head.inputs;
                (0..x.q.nrows()).all(|i| {
                    self.row_ok[h][i]
                        || !x.key_range(i).contains(&j)
                        || !x.mask.sees(x.mask_row(i), j)
                })
            })
    }
}

/// Recomputes exactly the gradient rows of a backward group (a kv head and its query heads)
/// that left the finite range although everything they depend on is finite: f32 partial
/// sums that overflowed (operands beyond about 1e19). `bad_dq(h, i)` and `bad_key(j)` say
/// which rows of dQ and of dK/dV are not finite; each repaired one goes to `write_dq(h, i,
/// dq)` or `write_key(j, dk, dv)`. The same formulas as the streaming pass (P from the LSE
/// given, capped at 1; dS = 0 where P = 0; dS times the modifiers' derivative), in f64 with
/// exact scores (modified by [`visible_score`]). A row that depends on
/// a NaN or an infinity keeps its f32 value: the contract lets the poison through there.
pub(crate) fn repair_gradients<T: Element, K: KeySource<T>>(
    heads: &[BackwardHead<'_, T, K>],
    scale: f32,
    (bad_dq, bad_key): (impl Fn(usize, usize) -> bool, impl Fn(usize) -> bool),
    mut write_dq: impl FnMut(usize, usize, &[f64]),
    mut write_key: impl FnMut(usize, &[f64], &[f64]),
) -> Option<()> {
    let first = heads.first()?;
    let (k, v) = (first.inputs.k, first.inputs.v);
    let (n_q, n_k, d_k, d_v) = (first.inputs.q.nrows(), k.len(), k.width(), v.width());
    let mut row_ok = Vec::new();
    let mut d = Vec::new();
    for head in heads {
        let x = &head.inputs;
        let bias_ok = |i: usize| {
            x.mask
                .additive()
                .is_none_or(|a| a.row(x.mask_row(i)).iter().all(|b| !b.is_nan()))
        };
        row_ok.push(flags(n_q, |i| {
            row_is_finite(x.q.row(i))
                && row_is_finite(head.d_out.row(i))
                && row_is_finite(head.out.row(i))
                && !head.lse[i].is_nan()
                && bias_ok(i)
        })?);
        let mut di = Vec::new();
        di.try_reserve_exact(n_q).ok()?;
        di.extend((0..n_q).map(|i| {
            (0..d_v)
                .map(|t| {
                    f64::from(head.d_out[(i, t)].to_f32()) * f64::from(head.out[(i, t)].to_f32())
                })
                .sum::<f64>()
        }));
        d.push(di);
    }
    let key_ok = flags(n_k, |j| k.row_finite(j) && v.row_finite(j))?;
    let g = BackwardGroup {
        heads,
        v,
        scale: f64::from(scale),
        row_ok,
        d,
        key_ok,
    };
    let mut dq = vec![0.0f64; d_k];
    for (h, head) in heads.iter().enumerate() {
        for i in (0..n_q).filter(|&i| bad_dq(h, i) && g.row_repairable(h, i)) {
            dq.fill(0.0);
            for j in head.inputs.key_range(i) {
                if let Some((_, ds)) = g.pair(h, i, j) {
                    for (c, x) in dq.iter_mut().enumerate() {
                        *x += g.scale * ds * f64::from(k.at(j, c));
                    }
                }
            }
            write_dq(h, i, &dq);
        }
    }
    let (mut dk, mut dv) = (vec![0.0f64; d_k], vec![0.0f64; d_v]);
    for j in (0..n_k).filter(|&j| bad_key(j) && g.key_repairable(j)) {
        dk.fill(0.0);
        dv.fill(0.0);
        for (h, head) in heads.iter().enumerate() {
            for i in 0..n_q {
                if let Some((p, ds)) = g.pair(h, i, j) {
                    let (q, d_out) = (head.inputs.q.row(i), head.d_out.row(i));
                    for (c, x) in dk.iter_mut().enumerate() {
                        *x += g.scale * ds * f64::from(q[c].to_f32());
                    }
                    for (t, x) in dv.iter_mut().enumerate() {
                        *x += p * f64::from(d_out[t].to_f32());
                    }
                }
            }
        }
        write_key(j, &dk, &dv);
    }
    Some(())
}

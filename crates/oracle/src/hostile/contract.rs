//! The contract on one head: what a call must return, and the check of what it did.

use super::*;

/// Whether key `j` is visible to query `i` under the structural constraints alone, by the
/// contract's formulas in exact (`i128`) arithmetic: `j < len`, causal `j ≤ i + offset`,
/// window `c − left ≤ j ≤ c + right` with `c = i + offset(align)`.
///
/// ```
/// use attn_core::{Causal, SlidingWindow};
/// use attn_oracle::hostile::structurally_visible;
/// // An unbounded-looking left side acts as no bound: plain causal.
/// let w = SlidingWindow::new(Some(usize::MAX), Some(0), Causal::TopLeft);
/// assert!(structurally_visible(None, Some(w), None, 4, 4, 3, 0));
/// assert!(!structurally_visible(None, Some(w), None, 4, 4, 0, 1));
/// ```
pub fn structurally_visible(
    causal: Option<Causal>,
    window: Option<SlidingWindow>,
    key_len: Option<usize>,
    n_q: usize,
    n_k: usize,
    i: usize,
    j: usize,
) -> bool {
    if j >= key_len.unwrap_or(n_k).min(n_k) {
        return false;
    }
    let (i, j) = (i as i128, j as i128);
    let offset = |c: Causal| match c {
        Causal::TopLeft => 0,
        Causal::BottomRight => n_k as i128 - n_q as i128,
    };
    if let Some(c) = causal
        && j > i + offset(c)
    {
        return false;
    }
    if let Some(w) = window {
        let c = i + offset(w.align);
        if w.left.is_some_and(|l| j < c - l as i128) || w.right.is_some_and(|r| j > c + r as i128) {
            return false;
        }
    }
    true
}

/// A reason the contract rejects a call, and how to recognise the error that says so.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rejection {
    /// The rule the input breaks (for reports).
    pub rule: &'static str,
    /// The error's message must mention one of these: the operand it names.
    pub names: &'static [&'static str],
    /// The `Debug` name of the [`Error`] variant the contract fixes for it, if it does.
    pub variant: Option<&'static str>,
}

impl Rejection {
    /// A rejection recognised by the operand its message names.
    pub const fn named(rule: &'static str, names: &'static [&'static str]) -> Self {
        Self {
            rule,
            names,
            variant: None,
        }
    }

    /// An output (or LSE, or cache) that cannot be allocated, or whose size overflows:
    /// `Error::Allocation`, naming the buffer.
    pub const fn allocation(names: &'static [&'static str]) -> Self {
        Self {
            rule: "a buffer that cannot be allocated is Error::Allocation",
            names,
            variant: Some("Allocation"),
        }
    }

    /// Whether `e` is this rejection: its message is non-empty and names the operand, and
    /// it is the fixed variant if there is one.
    ///
    /// ```
    /// use attn_core::Error;
    /// use attn_oracle::hostile::Rejection;
    /// let r = Rejection::named("n_k must match", &["V"]);
    /// assert!(r.accepts(&Error::mismatch("V", "rows", 3, "K", 4, "n_k must match")));
    /// assert!(!r.accepts(&Error::InvalidScale(0.0)));
    /// ```
    pub fn accepts(&self, e: &Error) -> bool {
        let message = e.to_string();
        if let Some(v) = self.variant {
            let debug = format!("{e:?}");
            if !debug.starts_with(v) {
                return false;
            }
        }
        !message.trim().is_empty() && names_operand(&message, self.names)
    }
}

/// Whether `message` mentions one of `names`: short names (`K`, `V`, `LSE`) as whole
/// words, case-sensitively; longer ones as case-insensitive substrings.
pub fn names_operand(message: &str, names: &[&str]) -> bool {
    let lower = message.to_lowercase();
    names.iter().any(|n| {
        if n.len() <= 3 && n.chars().all(char::is_alphanumeric) {
            message
                .split(|c: char| !(c.is_alphanumeric() || c == '_'))
                .any(|w| w == *n)
        } else {
            lower.contains(&n.to_lowercase())
        }
    })
}

pub(super) fn rejected_by<'r>(rules: &'r [Rejection], e: &Error) -> Option<&'r Rejection> {
    rules.iter().find(|r| r.accepts(e))
}

/// What the contract says about a row of a valid call.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RowClass {
    /// No visible key: output exactly 0, LSE `-inf`.
    Empty,
    /// A non-finite value reaches the row (its Q row, a K or V row of a key it sees, a NaN
    /// bias of a key it sees): the contract promises nothing about it.
    Touched,
    /// Every input the row sees is finite (biases may be `+inf`, which saturates): its
    /// output is finite, in the hull of the values it sees, within the derived bound of the
    /// reference; its LSE is finite.
    Finite,
}

/// Which buffers an entry point allocates (decides when a huge shape must be an
/// allocation error).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Outputs {
    /// It allocates the `[n_q, d_v]` output.
    pub output: bool,
    /// It allocates the `n_q` LSEs.
    pub lse: bool,
}

impl Outputs {
    /// `attention`: the output only.
    pub const OUTPUT: Outputs = Outputs {
        output: true,
        lse: false,
    };
    /// `attention_with_lse`, `partial_attention`: output and LSE.
    pub const WITH_LSE: Outputs = Outputs {
        output: true,
        lse: true,
    };
    /// `attention_into`: nothing (the caller's buffers).
    pub const NONE: Outputs = Outputs {
        output: false,
        lse: false,
    };
}

/// The contract's answer for one head of a valid call.
#[derive(Debug, Clone)]
pub struct HeadExpectation {
    /// `[n_q, n_k, d_v]`.
    pub dims: [usize; 3],
    /// What each row must be.
    pub rows: Vec<RowClass>,
    /// Visibility (structure, boolean mask, additive `-inf`), `[n_q, n_k]`.
    pub visible: Mat<bool>,
    /// The reference on the sanitised problem (`None` when `n_q = 0`).
    pub reference: Option<Materialized>,
    /// The derived bound against it.
    pub bound: Option<HeadBound>,
    /// V, for the hull of each row.
    v: Mat<f32>,
    /// Unit roundoff of the engine's accumulation and of its output type, and the
    /// output type's underflow error.
    rounding: (f64, f64, f64),
    /// Rows where an f32 engine may saturate a score whose exact value fits: some partial
    /// product or sum of `scale·log2 e · q·k` of a visible key can overflow f32 (the
    /// contract lets engines disagree on which keys saturated). Such a row is still
    /// promised finite and inside its hull, but is not compared with the reference.
    pub may_saturate: Vec<bool>,
}

impl HeadExpectation {
    /// Gives up the promises about rows that see a planted poison (a key of
    /// `planted.keys`, or a bias of `planted.biases`, visible to them): properties about
    /// hidden poisons then judge only the rows the poison must not reach, and leave the
    /// rows that see it (a finite extreme is a legitimate visible value) to the profiles
    /// about extreme values.
    pub fn release(&mut self, planted: &Planted) {
        let [n_q, ..] = self.dims;
        for i in 0..n_q {
            let sees = planted.queries.contains(&i)
                || planted.keys.iter().any(|&j| self.visible[(i, j)])
                || planted
                    .biases
                    .iter()
                    .any(|&(r, j)| r == i && self.visible[(r, j)]);
            if sees && self.rows[i] != RowClass::Empty {
                self.rows[i] = RowClass::Touched;
            }
        }
    }
}

/// What a call must do.
#[derive(Debug, Clone)]
pub enum Expected {
    /// Fail with an error that one of these recognises.
    Reject(Vec<Rejection>),
    /// Succeed and obey `head`; an error is accepted only if one of `may_reject`
    /// recognises it (options the amendment lets an engine honour or reject).
    Accept {
        /// The answer.
        head: Box<HeadExpectation>,
        /// Errors accepted instead.
        may_reject: Vec<Rejection>,
    },
    /// A valid problem larger than [`MAX_WORK`]: a generator must not produce it for this
    /// entry point (it would compute for too long). Tests skip such a call.
    TooMuchWork,
}

impl Expected {
    /// Whether the call must fail.
    pub fn is_reject(&self) -> bool {
        matches!(self, Expected::Reject(_))
    }

    /// [`HeadExpectation::release`] on an accepted call; nothing otherwise.
    pub fn release(&mut self, planted: &Planted) {
        if let Expected::Accept { head, .. } = self {
            head.release(planted);
        }
    }

    /// The row classes of an accepted call.
    pub fn rows(&self) -> Option<&[RowClass]> {
        match self {
            Expected::Accept { head, .. } => Some(&head.rows),
            _ => None,
        }
    }
}

pub(super) fn accumulation_roundoff(model: &ErrorModel) -> f64 {
    match model.compute {
        Compute::RoundedOnce => U64,
        Compute::F32 { .. } => U32,
    }
}

pub(super) fn shape_rejections(
    q: [usize; 2],
    k: [usize; 2],
    v: [usize; 2],
    out: &mut Vec<Rejection>,
) {
    if k[1] != q[1] {
        out.push(Rejection::named("d_k must match", &["K", "Q"]));
    }
    if v[0] != k[0] {
        out.push(Rejection::named("n_k must match", &["V", "K"]));
    }
    if q[1] == 0 || k[1] == 0 {
        out.push(Rejection::named(
            "d_k must be at least 1",
            &["Q", "K", "d_k"],
        ));
    }
}

pub(super) fn option_rejections(
    options: &Options<'_>,
    batch: usize,
    n_q: usize,
    n_k: usize,
    out: &mut Vec<Rejection>,
    may: &mut Vec<Rejection>,
) {
    if let Some(s) = options.scale
        && !scale_is_valid(s)
    {
        out.push(Rejection {
            rule: "scale·log2 e must be finite",
            names: &["scale"],
            variant: Some("InvalidScale"),
        });
    }
    if let Some(m) = options.bool_mask {
        let m = m.matrix();
        if (m.nrows(), m.ncols()) != (n_q, n_k) {
            out.push(Rejection::named(
                "the boolean mask is n_q × n_k",
                &["boolean mask", "mask"],
            ));
        }
    }
    if let Some(m) = options.additive_mask
        && (m.nrows(), m.ncols()) != (n_q, n_k)
    {
        out.push(Rejection::named(
            "the additive mask is n_q × n_k",
            &["additive mask", "mask"],
        ));
    }
    match options.key_padding {
        None => {}
        Some(KeyPadding::Uniform(l)) if l > n_k => {
            out.push(Rejection::named("key lengths are at most n_k", &["key"]));
        }
        Some(KeyPadding::Uniform(_)) => {}
        Some(KeyPadding::PerBatch(ls)) => {
            if ls.len() != batch {
                out.push(Rejection::named(
                    "one key length per batch entry",
                    &["key lengths", "key"],
                ));
            }
            if ls.iter().any(|&l| l > n_k) {
                out.push(Rejection::named("key lengths are at most n_k", &["key"]));
            }
        }
    }
    if let Some(w) = options.window
        && (huge_side(w.left) || huge_side(w.right))
    {
        may.push(Rejection::named(
            "a window bound beyond what the engine represents may be rejected",
            &["window"],
        ));
    }
}

/// The work of a problem, counting every row even when it sees no key (an engine writes
/// it, and the oracle classifies it).
pub(super) fn work(rows: usize, n_k: usize, d_k: usize, d_v: usize) -> u128 {
    (rows as u128)
        .saturating_mul(n_k as u128 + 1)
        .saturating_mul(d_k as u128 + d_v as u128 + 1)
}

/// The product of `dims`: 0 if any is 0 (whatever the others), `None` if it overflows.
///
/// ```
/// use attn_oracle::hostile::product;
/// assert_eq!(product(&[usize::MAX, 2, 0]), Some(0));
/// assert_eq!(product(&[usize::MAX, 2]), None);
/// ```
pub fn product(dims: &[usize]) -> Option<usize> {
    if dims.contains(&0) {
        return Some(0);
    }
    dims.iter().try_fold(1usize, |a, &x| a.checked_mul(x))
}

/// The contract's answer for one head: `q : [n_q, d_k]`, `k : [n_k, d_k]`,
/// `v : [n_k, d_v]` (the values the engine stores, widened to f32) under `options`, for an
/// entry point that allocates `outputs`, with `merges` merges of partial states done by
/// the caller on top of the engine's own (0 for a single call).
///
/// Validation is the oracle's own, not attn-core's: it reads the operands' shapes and the
/// options and lists every rule they break.
pub fn expect_head(
    q: MatRef<'_, f32>,
    k: MatRef<'_, f32>,
    v: MatRef<'_, f32>,
    options: &Options<'_>,
    model: &ErrorModel,
    outputs: Outputs,
    merges: usize,
) -> Expected {
    let (n_q, d_k, n_k, d_v) = (q.nrows(), q.ncols(), k.nrows(), v.ncols());
    let mut reject = Vec::new();
    let mut may_reject = Vec::new();
    shape_rejections(
        [n_q, d_k],
        [k.nrows(), k.ncols()],
        [v.nrows(), d_v],
        &mut reject,
    );
    option_rejections(options, 1, n_q, n_k, &mut reject, &mut may_reject);
    if outputs.output && n_q.checked_mul(d_v).is_none_or(|n| n >= UNALLOCATABLE) {
        reject.push(Rejection::allocation(&["output"]));
    }
    if outputs.lse && n_q >= UNALLOCATABLE {
        reject.push(Rejection::allocation(&["LSE", "output"]));
    }
    if !reject.is_empty() {
        return Expected::Reject(reject);
    }
    if n_q > 0 && work(n_q, n_k, d_k, d_v) > MAX_WORK {
        return Expected::TooMuchWork;
    }
    let key_len = options.key_length(0);
    let (causal, window) = (options.causal, options.window);
    let allows = |i: usize, j: usize| options.bool_mask.is_none_or(|b| b.allows(i, j));
    let bias = |i: usize, j: usize| options.additive_mask.map_or(0.0, |m| m[(i, j)]);
    let visible = if n_q == 0 {
        Mat::<bool>::from_fn(0, 0, |_, _| false)
    } else {
        Mat::from_fn(n_q, n_k, |i, j| {
            structurally_visible(causal, window, key_len, n_q, n_k, i, j)
                && allows(i, j)
                && bias(i, j) != f32::NEG_INFINITY
        })
    };
    let finite_row = |m: MatRef<'_, f32>, r: usize| (0..m.ncols()).all(|c| m[(r, c)].is_finite());
    let rows: Vec<RowClass> = (0..n_q)
        .map(|i| {
            let seen: Vec<usize> = (0..n_k).filter(|&j| visible[(i, j)]).collect();
            if seen.is_empty() {
                RowClass::Empty
            } else if finite_row(q, i)
                && seen
                    .iter()
                    .all(|&j| finite_row(k, j) && finite_row(v, j) && !bias(i, j).is_nan())
            {
                RowClass::Finite
            } else {
                RowClass::Touched
            }
        })
        .collect();
    // Partial products and sums of a dot product are bounded by Σ|q_t·k_t|, and an engine
    // that folds `scale·log2 e` into Q or K scales single entries first.
    let may_saturate: Vec<bool> = if n_q == 0 {
        Vec::new()
    } else {
        let s2 = options.scale_for_f64(d_k).unwrap_or(1.0) * core::f64::consts::LOG2_E;
        let limit = f64::from(f32::MAX) / 2.0;
        let largest = |m: MatRef<'_, f32>, r: usize| {
            (0..m.ncols()).fold(0.0f64, |a, c| a.max(f64::from(m[(r, c)]).abs()))
        };
        (0..n_q)
            .map(|i| {
                let qi = largest(q, i);
                (0..n_k).filter(|&j| visible[(i, j)]).any(|j| {
                    let dot: f64 = (0..d_k)
                        .map(|t| (f64::from(q[(i, t)]) * f64::from(k[(j, t)])).abs())
                        .sum();
                    s2 * dot.max(qi).max(largest(k, j)) >= limit
                })
            })
            .collect()
    };
    let (reference, bound) = if n_q == 0 {
        (None, None)
    } else {
        let additive = options.additive_mask.map(|_| {
            Mat::from_fn(
                n_q,
                n_k,
                |i, j| if visible[(i, j)] { bias(i, j) } else { 0.0 },
            )
        });
        let mut sanitised = Options::default().with_bool_mask(BoolMask::allow(visible.as_ref()));
        if let Some(s) = options.scale {
            sanitised = sanitised.with_scale(s);
        }
        if let Some(a) = additive.as_ref() {
            sanitised = sanitised.with_additive_mask(a.as_ref());
        }
        let r = Attention::head(q, k, v, &sanitised)
            .and_then(|call| call.materialized())
            .expect("the sanitised problem is valid");
        let scale = sanitised
            .scale_for_f64(d_k)
            .expect("the scale was validated");
        let b = head_bound_merged(
            model,
            q,
            k,
            v,
            scale,
            additive.as_ref().map(|a| a.as_ref()),
            &r,
            merges,
        );
        (Some(r), Some(b))
    };
    Expected::Accept {
        head: Box::new(HeadExpectation {
            dims: [n_q, n_k, d_v],
            rows,
            visible,
            reference,
            bound,
            v: if n_q == 0 {
                Mat::zeros(0, 0)
            } else {
                v.to_owned()
            },
            rounding: (
                accumulation_roundoff(model),
                model.output.unit_roundoff(),
                model.output.underflow_error(),
            ),
            may_saturate,
        }),
        may_reject,
    }
}

/// Checks an error against what was expected.
pub fn check_error(expected: &Expected, e: &Error) -> Result<(), String> {
    match expected {
        Expected::Reject(rules) => match rejected_by(rules, e) {
            Some(_) => Ok(()),
            None => Err(format!(
                "the error `{e}` ({e:?}) does not say what is wrong: expected one naming {}",
                describe_rules(rules)
            )),
        },
        Expected::Accept { may_reject, .. } => match rejected_by(may_reject, e) {
            Some(_) => Ok(()),
            None => Err(format!("a valid call was rejected: `{e}` ({e:?})")),
        },
        Expected::TooMuchWork => Ok(()),
    }
}

pub(super) fn describe_rules(rules: &[Rejection]) -> String {
    rules
        .iter()
        .map(|r| {
            format!(
                "{:?}{} ({})",
                r.names,
                r.variant.map(|v| format!(" as {v}")).unwrap_or_default(),
                r.rule
            )
        })
        .collect::<Vec<_>>()
        .join(" or ")
}

/// Checks what a call returned against what the contract says: an output `[n_q, d_v]`
/// widened to f32 and, if the entry point returns one, the LSE of each row.
pub fn check_head(
    expected: &Expected,
    got: Result<(MatRef<'_, f32>, Option<&[f32]>), Error>,
) -> Result<(), String> {
    match (expected, got) {
        (Expected::TooMuchWork, _) => Ok(()),
        (_, Err(e)) => check_error(expected, &e),
        (Expected::Reject(rules), Ok(_)) => Err(format!(
            "an invalid call succeeded: it breaks {}",
            rules.iter().map(|r| r.rule).collect::<Vec<_>>().join(", ")
        )),
        (Expected::Accept { head, .. }, Ok((o, lse))) => check_rows(head, o, lse),
    }
}

pub(super) fn check_rows(
    h: &HeadExpectation,
    o: MatRef<'_, f32>,
    lse: Option<&[f32]>,
) -> Result<(), String> {
    let [n_q, n_k, d_v] = h.dims;
    if (o.nrows(), o.ncols()) != (n_q, d_v) {
        return Err(format!(
            "the output is {}×{} but must be {n_q}×{d_v}",
            o.nrows(),
            o.ncols()
        ));
    }
    if let Some(l) = lse
        && l.len() != n_q
    {
        return Err(format!("{} LSE values for {n_q} rows", l.len()));
    }
    let (u_acc, u_out, eta_out) = h.rounding;
    for (i, class) in h.rows.iter().enumerate() {
        match class {
            RowClass::Touched => {}
            RowClass::Empty => {
                if let Some(c) = (0..d_v).find(|&c| o[(i, c)] != 0.0) {
                    return Err(format!(
                        "row {i} sees no key, so its output must be exactly 0, but output[{i}, {c}] = {:e}",
                        o[(i, c)]
                    ));
                }
                if let Some(l) = lse
                    && l[i] != f32::NEG_INFINITY
                {
                    return Err(format!(
                        "row {i} sees no key, so its LSE must be -inf, not {:e}",
                        l[i]
                    ));
                }
            }
            RowClass::Finite => {
                let seen: Vec<usize> = (0..n_k).filter(|&j| h.visible[(i, j)]).collect();
                let r = h.reference.as_ref().expect("rows have a reference");
                let b = h.bound.as_ref().expect("rows have a bound");
                for c in 0..d_v {
                    let e = o[(i, c)];
                    if !e.is_finite() {
                        return Err(format!(
                            "row {i} sees only finite inputs ({} keys), so its output must be finite, \
                             but output[{i}, {c}] = {e:e} (reference {:e})",
                            seen.len(),
                            r.output[(i, c)]
                        ));
                    }
                    let (lo, hi, m) = seen.iter().fold(
                        (f64::INFINITY, f64::NEG_INFINITY, 0.0f64),
                        |(lo, hi, m), &j| {
                            let x = f64::from(h.v[(j, c)]);
                            (lo.min(x), hi.max(x), m.max(x.abs()))
                        },
                    );
                    // Every f32 product and sum of the accumulation may also lose up to half
                    // the smallest subnormal, whatever the magnitudes (subnormal values).
                    let eta_acc = (2.0 * n_k as f64 + 3.0) * 2f64.powi(-150);
                    let tol = SAFETY
                        * ((3.0 * gamma(2.0 * n_k as f64 + 2.0, u_acc) + u_out) * m
                            + eta_out
                            + eta_acc);
                    let e = f64::from(e);
                    if e < lo - tol || e > hi + tol {
                        return Err(format!(
                            "output[{i}, {c}] = {e:e} lies outside the hull [{lo:e}, {hi:e}] of the \
                             values row {i} sees (tolerance {tol:.3e}); reference {:e}",
                            r.output[(i, c)]
                        ));
                    }
                    let (x, bd) = (r.output[(i, c)], b.output[(i, c)]);
                    if !h.may_saturate[i] && x.is_finite() && bd.is_finite() && (e - x).abs() > bd {
                        return Err(format!(
                            "output[{i}, {c}] = {e:e} but the reference says {x:e}: |error| = {:.3e} \
                             exceeds the derived bound {bd:.3e}",
                            (e - x).abs()
                        ));
                    }
                }
                if let Some(l) = lse {
                    let e = l[i];
                    if !e.is_finite() {
                        return Err(format!(
                            "row {i} sees only finite inputs ({} keys), so its LSE must be finite, \
                             not {e:e} (reference {:e})",
                            seen.len(),
                            r.lse[i]
                        ));
                    }
                    let (x, bd) = (r.lse[i], b.lse[i]);
                    let e = f64::from(e);
                    if !h.may_saturate[i] && x.is_finite() && bd.is_finite() && (e - x).abs() > bd {
                        return Err(format!(
                            "LSE[{i}] = {e:e} but the reference says {x:e}: |error| = {:.3e} exceeds \
                             the derived bound {bd:.3e}",
                            (e - x).abs()
                        ));
                    }
                }
            }
        }
    }
    Ok(())
}

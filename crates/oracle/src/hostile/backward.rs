//! The backward pass on hostile inputs: what it must return, and the checks.

use super::*;

/// What the contract says about one head's gradients in a valid backward call
/// (`docs/conventions.md`, "The backward pass").
///
/// A row of dQ depends on its own Q, dO, O and LSE rows and on the K and V rows (and
/// biases) of the keys it sees; a row of dK or dV on its own K and V rows and on the Q,
/// dO, O and LSE rows (and biases) of the queries that see it. Nothing else reaches it: a
/// poison at a hidden key, or in a row that sees nothing, reaches no gradient row.
#[derive(Debug, Clone)]
pub struct GradExpectation {
    /// `[n_q, n_k, d_k, d_v]`.
    pub dims: [usize; 4],
    /// What each row of dQ must be: [`RowClass::Empty`] (sees no key) exactly 0,
    /// [`RowClass::Finite`] finite (and within the bound where compared).
    pub dq_rows: Vec<RowClass>,
    /// What each row of dK and dV must be: [`RowClass::Empty`] (no query sees the key)
    /// exactly 0, [`RowClass::Finite`] finite (and within the bound where compared).
    pub key_rows: Vec<RowClass>,
    /// Visibility, `[n_q, n_k]`.
    pub visible: Mat<bool>,
    /// The reference's gradients on the sanitised problem (when the forward's own output
    /// and LSE were given and `n_q > 0`).
    pub reference: Option<MaterializedBackward>,
    /// The derived bound against it.
    pub bound: Option<GradientBound>,
    /// Rows of dQ compared with the reference (not where a score may saturate).
    pub compare_dq: Vec<bool>,
    /// Rows of dK, dV compared with the reference (no row that sees the key may saturate).
    pub compare_keys: Vec<bool>,
}

impl GradExpectation {
    /// Gives up the promises about gradient rows that a planted value may reach (a finite
    /// extreme is a legitimate visible value): dQ rows that see a planted key or bias,
    /// dK/dV rows of planted keys that a row sees, and of keys that such a row sees (its
    /// output and LSE carry the poison).
    pub fn release(&mut self, planted: &Planted) {
        let [n_q, n_k, ..] = self.dims;
        let mut touched_rows = vec![false; n_q];
        for (i, t) in touched_rows.iter_mut().enumerate() {
            *t = planted
                .keys
                .iter()
                .any(|&j| j < n_k && self.visible[(i, j)])
                || planted
                    .biases
                    .iter()
                    .any(|&(r, j)| r == i && j < n_k && self.visible[(r, j)]);
            if *t && self.dq_rows[i] != RowClass::Empty {
                self.dq_rows[i] = RowClass::Touched;
            }
        }
        for j in 0..n_k {
            let reached = (0..n_q).any(|i| {
                self.visible[(i, j)]
                    && (touched_rows[i]
                        || planted.keys.contains(&j)
                        || planted.queries.contains(&i))
            });
            if reached && self.key_rows[j] != RowClass::Empty {
                self.key_rows[j] = RowClass::Touched;
            }
        }
    }
}

/// What a backward call must do.
#[derive(Debug, Clone)]
pub enum GradExpected {
    /// Fail with an error that one of these recognises.
    Reject(Vec<Rejection>),
    /// Succeed and obey `grads`; an error is accepted only if one of `may_reject`
    /// recognises it.
    Accept {
        /// The answer.
        grads: Box<GradExpectation>,
        /// Errors accepted instead.
        may_reject: Vec<Rejection>,
    },
    /// A valid problem larger than [`MAX_WORK`]: not to be run.
    TooMuchWork,
}

impl GradExpected {
    /// [`GradExpectation::release`] on an accepted call; nothing otherwise.
    pub fn release(&mut self, planted: &Planted) {
        if let GradExpected::Accept { grads, .. } = self {
            grads.release(planted);
        }
    }

    /// The same call seen as a forward expectation, for [`check_error`].
    fn as_forward(&self) -> Expected {
        match self {
            GradExpected::Reject(r) => Expected::Reject(r.clone()),
            // An accepted call: any error is judged against `may_reject` only.
            GradExpected::Accept { may_reject, .. } => Expected::Reject(may_reject.clone()),
            GradExpected::TooMuchWork => Expected::TooMuchWork,
        }
    }
}

/// The rules of the backward's own operands: `grad_out` and `out` are `[n_q, d_v]`, one
/// LSE per query row.
pub(super) fn backward_rejections(
    n_q: usize,
    d_v: usize,
    grad_out: [usize; 2],
    out: [usize; 2],
    lse_len: usize,
    reject: &mut Vec<Rejection>,
) {
    if grad_out != [n_q, d_v] {
        reject.push(Rejection::named("dO is n_q × d_v", &["grad_out"]));
    }
    if out != [n_q, d_v] {
        reject.push(Rejection::named("the output is n_q × d_v", &["output"]));
    }
    if lse_len != n_q {
        reject.push(Rejection::named("one LSE per query row", &["LSE"]));
    }
}

/// The gradient buffers an allocating backward entry point must refuse
/// (`Error::Allocation`): `[(name, rows, cols)]`, refused at [`UNALLOCATABLE`] elements or
/// when the size overflows.
pub(super) fn gradient_allocations(
    bufs: &[(&'static [&'static str], Option<usize>)],
    out: &mut Vec<Rejection>,
) {
    for &(names, n) in bufs {
        if n.is_none_or(|n| n >= UNALLOCATABLE) {
            out.push(Rejection::allocation(names));
        }
    }
}

/// The contract's answer for one head's backward call, its arguments in the engines'
/// order: the upstream gradient `grad_out`, `q : [n_q, d_k]`, `k : [n_k, d_k]`,
/// `v : [n_k, d_v]`, the forward's `out` and `lse` as given (all widened to f32), under `options`, for an entry point that allocates its
/// gradients or not (`allocates`).
///
/// `forward_given`: `out` and `lse` are the engine's own forward result on these inputs.
/// Then a gradient row whose inputs are finite is promised finite and compared with the
/// f64 reference within [`crate::bound::head_backward_bound`]; otherwise (arbitrary `out`
/// and `lse`) only the rows that see nothing are promised (exactly 0).
#[allow(clippy::too_many_arguments)]
pub fn expect_head_backward(
    grad_out: MatRef<'_, f32>,
    q: MatRef<'_, f32>,
    k: MatRef<'_, f32>,
    v: MatRef<'_, f32>,
    out: MatRef<'_, f32>,
    lse: &[f32],
    options: &Options<'_>,
    model: &ErrorModel,
    allocates: bool,
    forward_given: bool,
) -> GradExpected {
    let (n_q, d_k, n_k, d_v) = (q.nrows(), q.ncols(), k.nrows(), v.ncols());
    let mut reject = Vec::new();
    backward_rejections(
        n_q,
        d_v,
        [grad_out.nrows(), grad_out.ncols()],
        [out.nrows(), out.ncols()],
        lse.len(),
        &mut reject,
    );
    if allocates {
        gradient_allocations(
            &[
                (&["dQ"], n_q.checked_mul(d_k)),
                (&["dK"], k.nrows().checked_mul(k.ncols())),
                (&["dV"], v.nrows().checked_mul(d_v)),
            ],
            &mut reject,
        );
    }
    let (head, may_reject) = match expect_head(q, k, v, options, model, Outputs::NONE, 0) {
        Expected::Reject(r) => {
            reject.extend(r);
            return GradExpected::Reject(reject);
        }
        Expected::TooMuchWork if reject.is_empty() => return GradExpected::TooMuchWork,
        Expected::TooMuchWork => return GradExpected::Reject(reject),
        Expected::Accept { head, may_reject } => (head, may_reject),
    };
    if !reject.is_empty() {
        reject.extend(may_reject);
        return GradExpected::Reject(reject);
    }
    let visible = head.visible;
    let finite_row = |m: MatRef<'_, f32>, r: usize| (0..m.ncols()).all(|c| m[(r, c)].is_finite());
    let bias = |i: usize, j: usize| options.additive_mask.map_or(0.0, |m| m[(i, j)]);
    let row_ok: Vec<bool> = (0..n_q)
        .map(|i| {
            forward_given
                && finite_row(q, i)
                && finite_row(grad_out, i)
                && finite_row(out, i)
                && lse[i].is_finite()
        })
        .collect();
    let key_ok: Vec<bool> = (0..n_k)
        .map(|j| forward_given && finite_row(k, j) && finite_row(v, j))
        .collect();
    let dq_rows: Vec<RowClass> = (0..n_q)
        .map(|i| {
            let seen: Vec<usize> = (0..n_k).filter(|&j| visible[(i, j)]).collect();
            if seen.is_empty() {
                RowClass::Empty
            } else if row_ok[i] && seen.iter().all(|&j| key_ok[j] && !bias(i, j).is_nan()) {
                RowClass::Finite
            } else {
                RowClass::Touched
            }
        })
        .collect();
    let key_rows: Vec<RowClass> = (0..n_k)
        .map(|j| {
            let seers: Vec<usize> = (0..n_q).filter(|&i| visible[(i, j)]).collect();
            if seers.is_empty() {
                RowClass::Empty
            } else if key_ok[j] && seers.iter().all(|&i| row_ok[i] && !bias(i, j).is_nan()) {
                RowClass::Finite
            } else {
                RowClass::Touched
            }
        })
        .collect();
    let compare_dq = head.may_saturate.iter().map(|s| !s).collect();
    let compare_keys = (0..n_k)
        .map(|j| (0..n_q).all(|i| !visible[(i, j)] || !head.may_saturate[i]))
        .collect();
    let (reference, bound) = if forward_given && n_q > 0 {
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
            .and_then(|call| call.backward_materialized(grad_out))
            .expect("the sanitised problem is valid");
        let scale = sanitised
            .scale_for_f64(d_k)
            .expect("the scale was validated");
        let b = head_backward_bound(
            model,
            q,
            k,
            v,
            grad_out,
            scale,
            additive.as_ref().map(|a| a.as_ref()),
            &r,
        );
        (Some(r), Some(b))
    } else {
        (None, None)
    };
    GradExpected::Accept {
        grads: Box::new(GradExpectation {
            dims: [n_q, n_k, d_k, d_v],
            dq_rows,
            key_rows,
            visible,
            reference,
            bound,
            compare_dq,
            compare_keys,
        }),
        may_reject,
    }
}

/// Checks one gradient, row by row: `Empty` rows exactly 0, `Finite` rows finite and, where
/// `x` and `bd` are given and `compare[r]`, within `bd` of `x`.
pub(super) fn check_gradient(
    name: &str,
    e: MatRef<'_, f32>,
    rows: &[RowClass],
    shape: [usize; 2],
    reference: Option<(MatRef<'_, f64>, MatRef<'_, f64>)>,
    compare: &[bool],
) -> Result<(), String> {
    if [e.nrows(), e.ncols()] != shape {
        return Err(format!(
            "{name} is {}×{} but must be {}×{} (the shape of its operand)",
            e.nrows(),
            e.ncols(),
            shape[0],
            shape[1]
        ));
    }
    for (r, class) in rows.iter().enumerate() {
        for c in 0..shape[1] {
            let g = e[(r, c)];
            match class {
                RowClass::Touched => {}
                RowClass::Empty => {
                    if g != 0.0 {
                        return Err(format!(
                            "{name} row {r} is reached by nothing (no visible key/query), so it must be \
                             exactly 0, but {name}[{r}, {c}] = {g:e}"
                        ));
                    }
                }
                RowClass::Finite => {
                    if !g.is_finite() {
                        return Err(format!(
                            "{name} row {r} is reached only by finite inputs, so it must be finite, \
                             but {name}[{r}, {c}] = {g:e}{}",
                            reference.map_or(String::new(), |(x, _)| format!(
                                " (reference {:e})",
                                x[(r, c)]
                            ))
                        ));
                    }
                    if let Some((x, bd)) = reference
                        && compare[r]
                    {
                        let (x, bd) = (x[(r, c)], bd[(r, c)]);
                        let err = (f64::from(g) - x).abs();
                        if x.is_finite() && bd.is_finite() && err > bd {
                            return Err(format!(
                                "{name}[{r}, {c}] = {g:e} but the reference says {x:e}: |error| = \
                                 {err:.3e} exceeds the derived bound {bd:.3e}"
                            ));
                        }
                    }
                }
            }
        }
    }
    Ok(())
}

/// Checks what a single-head backward call returned (`dq`, `dk`, `dv` widened to f32)
/// against [`expect_head_backward`].
pub fn check_head_backward(
    expected: &GradExpected,
    got: Result<[MatRef<'_, f32>; 3], Error>,
) -> Result<(), String> {
    match (expected, got) {
        (GradExpected::TooMuchWork, _) => Ok(()),
        (_, Err(e)) => check_error(&expected.as_forward(), &e).map_err(|m| {
            if matches!(expected, GradExpected::Accept { .. }) {
                format!("a valid backward call was rejected: `{e}` ({e:?}) [{m}]")
            } else {
                m
            }
        }),
        (GradExpected::Reject(rules), Ok(_)) => Err(format!(
            "an invalid backward call succeeded: it breaks {}",
            rules.iter().map(|r| r.rule).collect::<Vec<_>>().join(", ")
        )),
        (GradExpected::Accept { grads, .. }, Ok([dq, dk, dv])) => {
            let g = grads;
            let [n_q, n_k, d_k, d_v] = g.dims;
            let r = g.reference.as_ref().zip(g.bound.as_ref());
            check_gradient(
                "dQ",
                dq,
                &g.dq_rows,
                [n_q, d_k],
                r.map(|(r, b)| (r.dq.as_ref(), b.dq.as_ref())),
                &g.compare_dq,
            )?;
            check_gradient(
                "dK",
                dk,
                &g.key_rows,
                [n_k, d_k],
                r.map(|(r, b)| (r.dk.as_ref(), b.dk.as_ref())),
                &g.compare_keys,
            )?;
            check_gradient(
                "dV",
                dv,
                &g.key_rows,
                [n_k, d_v],
                r.map(|(r, b)| (r.dv.as_ref(), b.dv.as_ref())),
                &g.compare_keys,
            )
        }
    }
}

/// Validates a batched backward call by the contract's rules (its dims in the engines'
/// argument order: `grad_out`, Q, K, V, `out`): the forward's rules
/// ([`expect_batched`]), `grad_out` and `out` of dims `[batch, h_q, n_q, d_v]`,
/// `lse_len = batch·h_q·n_q`, and, for an entry point that allocates its gradients
/// (`allocates`), dQ, dK, dV of the operands' dims that fit.
#[allow(clippy::too_many_arguments)]
pub fn expect_batched_backward(
    grad_out: [usize; 4],
    q: [usize; 4],
    k: [usize; 4],
    v: [usize; 4],
    out: [usize; 4],
    lse_len: usize,
    options: &Options<'_>,
    allocates: bool,
) -> BatchExpected {
    let mut reject = Vec::new();
    let want = [q[0], q[1], q[2], v[3]];
    if grad_out != want {
        reject.push(Rejection::named("dO has the output's dims", &["grad_out"]));
    }
    if out != want {
        reject.push(Rejection::named(
            "the output has dims [batch, h_q, n_q, d_v]",
            &["output"],
        ));
    }
    if product(&q[..3]) != Some(lse_len) {
        reject.push(Rejection::named("one LSE per query row", &["LSE"]));
    }
    if allocates {
        gradient_allocations(
            &[
                (&["dQ"], product(&q)),
                (&["dK"], product(&k)),
                (&["dV"], product(&v)),
            ],
            &mut reject,
        );
    }
    match expect_batched(q, k, v, options, Outputs::NONE) {
        BatchExpected::Reject(r) => {
            reject.extend(r);
            BatchExpected::Reject(reject)
        }
        _ if !reject.is_empty() => BatchExpected::Reject(reject),
        e => e,
    }
}

/// Checks what a batched backward call returned (`dq`, `dk`, `dv` widened to f32) head by
/// head against [`expect_head_backward`] on the call's inputs (`[q, k, v, grad_out, out]`
/// widened to f32, `lse` in `[batch][h_q][n_q]` order): dQ per query head, dK and dV per kv
/// head as the sum over its group (`Empty` where no head's row sees the key, compared with
/// the sum of the references within the sum of the bounds and the rounding of the sum),
/// with the promises about what `planted` reaches given up.
#[allow(clippy::too_many_arguments)]
pub fn check_batched_backward(
    expected: &BatchExpected,
    inputs: [Tensor4Ref<'_, f32>; 5],
    lse: &[f32],
    options: &Options<'_>,
    model: &ErrorModel,
    forward_given: bool,
    planted: &Planted,
    got: Result<[Tensor4Ref<'_, f32>; 3], Error>,
) -> Result<(), String> {
    let [dq, dk, dv] = match (expected, got) {
        (BatchExpected::TooMuchWork, _) => return Ok(()),
        (BatchExpected::Reject(rules), Err(e)) => {
            return check_error(&Expected::Reject(rules.clone()), &e);
        }
        (BatchExpected::Reject(rules), Ok(_)) => {
            return Err(format!(
                "an invalid batched backward call succeeded: it breaks {}",
                rules.iter().map(|r| r.rule).collect::<Vec<_>>().join(", ")
            ));
        }
        (BatchExpected::Accept { may_reject, .. }, Err(e)) => {
            return match rejected_by(may_reject, &e) {
                Some(_) => Ok(()),
                None => Err(format!(
                    "a valid batched backward call was rejected: `{e}` ({e:?})"
                )),
            };
        }
        (BatchExpected::Accept { .. }, Ok(got)) => got,
    };
    let [q, k, v, grad_out, out] = inputs;
    for (name, got, want) in [
        ("dQ", dq.dims(), q.dims()),
        ("dK", dk.dims(), k.dims()),
        ("dV", dv.dims(), v.dims()),
    ] {
        if got != want {
            return Err(format!("{name} has dims {got:?} but its operand {want:?}"));
        }
    }
    let [b, h_q, n_q, _] = q.dims();
    let [_, h_kv, n_k, d_v] = v.dims();
    let d_k = q.dims()[3];
    if product(&[b, h_q, n_q, n_k]) == Some(0) && (n_q == 0 || h_q == 0 || b == 0) {
        // No query row: every gradient is 0 (dK and dV of keys no row sees).
        for (name, t) in [("dK", dk), ("dV", dv)] {
            let [tb, th, tn, td] = t.dims();
            for bi in 0..tb {
                for h in 0..th {
                    let m = head_of(t, bi, h);
                    if let Some((j, c)) = (0..tn)
                        .flat_map(|j| (0..td).map(move |c| (j, c)))
                        .find(|&(j, c)| m[(j, c)] != 0.0)
                    {
                        return Err(format!(
                            "no query row sees key {j}, so {name}[{bi}, {h}, {j}, {c}] must be 0, \
                             not {:e}",
                            m[(j, c)]
                        ));
                    }
                }
            }
        }
        return Ok(());
    }
    let group = h_q / h_kv.max(1);
    for bi in 0..b {
        let mut opts = *options;
        opts.key_padding = options.key_length(bi).map(KeyPadding::Uniform);
        for kv in 0..h_kv {
            let mut classes = vec![RowClass::Empty; n_k];
            // (Σ dK, Σ bound, Σ |dK|, Σ dV, Σ bound, Σ |dV|) over the group's heads.
            let mut sums: Option<[Mat<f64>; 6]> = forward_given.then(|| {
                let z = |c| Mat::<f64>::zeros(n_k, c);
                [z(d_k), z(d_k), z(d_k), z(d_v), z(d_v), z(d_v)]
            });
            let mut compare = vec![true; n_k];
            for h in kv * group..(kv + 1) * group {
                let row = (bi * h_q + h) * n_q;
                let (qh, kh, vh) = (head_of(q, bi, h), head_of(k, bi, kv), head_of(v, bi, kv));
                let (doh, oh) = (head_of(grad_out, bi, h), head_of(out, bi, h));
                let mut want = expect_head_backward(
                    doh,
                    qh,
                    kh,
                    vh,
                    oh,
                    &lse[row..row + n_q],
                    &opts,
                    model,
                    false,
                    forward_given,
                );
                want.release(planted);
                let GradExpected::Accept { grads: g, .. } = want else {
                    return Err(format!(
                        "batch entry {bi}, head {h}: an accepted batched call has a rejected head"
                    ));
                };
                let r = g.reference.as_ref().zip(g.bound.as_ref());
                check_gradient(
                    "dQ",
                    head_of(dq, bi, h),
                    &g.dq_rows,
                    [n_q, d_k],
                    r.map(|(r, b)| (r.dq.as_ref(), b.dq.as_ref())),
                    &g.compare_dq,
                )
                .map_err(|m| format!("batch entry {bi}, head {h}: {m}"))?;
                for j in 0..n_k {
                    classes[j] = match (classes[j], g.key_rows[j]) {
                        (RowClass::Touched, _) | (_, RowClass::Touched) => RowClass::Touched,
                        (RowClass::Finite, _) | (_, RowClass::Finite) => RowClass::Finite,
                        _ => RowClass::Empty,
                    };
                    compare[j] &= g.compare_keys[j];
                }
                if let (Some(s), Some((r, bd))) = (sums.as_mut(), r) {
                    for j in 0..n_k {
                        for c in 0..d_k {
                            s[0][(j, c)] += r.dk[(j, c)];
                            s[1][(j, c)] += bd.dk[(j, c)];
                            s[2][(j, c)] += r.dk[(j, c)].abs();
                        }
                        for c in 0..d_v {
                            s[3][(j, c)] += r.dv[(j, c)];
                            s[4][(j, c)] += bd.dv[(j, c)];
                            s[5][(j, c)] += r.dv[(j, c)].abs();
                        }
                    }
                }
            }
            // The f32 sum over the group's heads rounds too.
            let g = SAFETY * gamma(group as f64 + 1.0, U32);
            let refs = sums.map(|[rk, mut bk, ak, rv, mut bv, av]| {
                for j in 0..n_k {
                    for c in 0..d_k {
                        bk[(j, c)] += g * ak[(j, c)];
                    }
                    for c in 0..d_v {
                        bv[(j, c)] += g * av[(j, c)];
                    }
                }
                (rk, bk, rv, bv)
            });
            check_gradient(
                "dK",
                head_of(dk, bi, kv),
                &classes,
                [n_k, d_k],
                refs.as_ref().map(|r| (r.0.as_ref(), r.1.as_ref())),
                &compare,
            )
            .map_err(|m| format!("batch entry {bi}, kv head {kv}: {m}"))?;
            check_gradient(
                "dV",
                head_of(dv, bi, kv),
                &classes,
                [n_k, d_v],
                refs.as_ref().map(|r| (r.2.as_ref(), r.3.as_ref())),
                &compare,
            )
            .map_err(|m| format!("batch entry {bi}, kv head {kv}: {m}"))?;
        }
    }
    Ok(())
}

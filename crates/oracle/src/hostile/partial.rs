//! Partial states on hostile inputs.

use super::*;

/// A hostile partial state: output rows and LSEs from the values that can reach a merge
/// (finite, the empty row's `-inf`, and the `NaN`/`+inf` of rows a non-finite input
/// reached).
#[derive(Debug, Clone, PartialEq)]
pub struct HostileState {
    /// Normalised output `[n_q, d_v]`.
    pub output: Mat<f32>,
    /// LSE of each row (one too many for a malformed state).
    pub lse: Vec<f32>,
}

/// Recipe of a pair of states to merge.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct MergeCase {
    /// Rows.
    pub n_q: usize,
    /// Value width.
    pub d_v: usize,
    /// The other state's shape differs (`[n_q + dr, d_v + dc]`).
    pub mismatch: Option<(u8, u8)>,
    /// Output values at the finite extremes (else moderate).
    pub extreme: bool,
    /// Seed.
    pub seed: u64,
}

/// Merge cases; `extreme` chooses output values at the finite extremes.
pub fn merge_case(extreme: bool) -> BoxedStrategy<MergeCase> {
    (
        0..=6usize,
        0..=5usize,
        proptest::option::weighted(0.15, (0u8..=2, 0u8..=2)),
        any::<u64>(),
    )
        .prop_map(move |(n_q, d_v, mismatch, seed)| MergeCase {
            n_q,
            d_v,
            mismatch: mismatch.filter(|&(r, c)| r + c > 0),
            extreme,
            seed,
        })
        .boxed()
}

impl MergeCase {
    /// The two states.
    pub fn build(&self) -> (HostileState, HostileState) {
        let mut rng = Rng::new(self.seed, 21);
        let state = |n: usize, d: usize, rng: &mut Rng| {
            let lse: Vec<f32> = (0..n)
                .map(|_| match rng.below(8) {
                    0 => f32::NEG_INFINITY,
                    1 => f32::NAN,
                    2 => f32::INFINITY,
                    3 => [f32::MAX, f32::MIN, 88.0, -88.0, 1e30][rng.below(5) as usize],
                    _ => ((rng.unit() * 2.0 - 1.0) * 20.0) as f32,
                })
                .collect();
            let fill = if self.extreme {
                Fill::Extreme
            } else {
                Fill::Large
            };
            let mut output = operand(n, d, fill, Dtype::F32, rng);
            for (i, &l) in lse.iter().enumerate() {
                if l == f32::NEG_INFINITY {
                    for c in 0..d {
                        output[(i, c)] = 0.0;
                    }
                } else if l.is_nan() || l == f32::INFINITY {
                    for c in 0..d {
                        output[(i, c)] = f32::NAN;
                    }
                }
            }
            HostileState { output, lse }
        };
        let a = state(self.n_q, self.d_v, &mut rng);
        let (dr, dc) = self.mismatch.unwrap_or((0, 0));
        let b = state(
            self.n_q + usize::from(dr),
            self.d_v + usize::from(dc),
            &mut rng,
        );
        (a, b)
    }
}

/// Checks `merged = a.merge(b)` against the merge's contract: mismatched shapes are an
/// error naming the state; a row that only one side saw is that side's row bit for bit;
/// a row both saw with finite LSEs and finite outputs has a finite LSE in
/// `[max, max + ln 2]` (within rounding) and an output in the hull of the two (within
/// rounding), finite; a row a NaN or `+inf` reached is unconstrained.
pub fn check_merge(
    a: (MatRef<'_, f32>, &[f32]),
    b: (MatRef<'_, f32>, &[f32]),
    merged: Result<(MatRef<'_, f32>, &[f32]), Error>,
) -> Result<(), String> {
    let ((oa, la), (ob, lb)) = (a, b);
    let same = (oa.nrows(), oa.ncols()) == (ob.nrows(), ob.ncols());
    let (o, l) = match (same, merged) {
        (false, Err(e)) => {
            return check_error(
                &Expected::Reject(vec![Rejection::named(
                    "merged states cover the same rows and width",
                    &["state", "LSE", "output"],
                )]),
                &e,
            );
        }
        (false, Ok(_)) => return Err("states of different shapes were merged".into()),
        (true, Err(e)) => return Err(format!("a merge of same-shaped states failed: {e}")),
        (true, Ok(m)) => m,
    };
    let (n, d) = (oa.nrows(), oa.ncols());
    if (o.nrows(), o.ncols(), l.len()) != (n, d, n) {
        return Err(format!(
            "the merged state is {}×{} with {} LSEs, not {n}×{d} with {n}",
            o.nrows(),
            o.ncols(),
            l.len()
        ));
    }
    let bits =
        |m: MatRef<'_, f32>, i: usize| (0..d).map(|c| m[(i, c)].to_bits()).collect::<Vec<_>>();
    for i in 0..n {
        let (x, y) = (la[i], lb[i]);
        if y == f32::NEG_INFINITY || x == f32::NEG_INFINITY {
            let (so, sl) = if y == f32::NEG_INFINITY {
                (oa, x)
            } else {
                (ob, y)
            };
            if bits(o, i) != bits(so, i) || l[i].to_bits() != sl.to_bits() {
                return Err(format!(
                    "row {i}: one side saw nothing (LSEs {x:e}, {y:e}), so the merge must be the \
                     other side bit for bit"
                ));
            }
            continue;
        }
        let finite = x.is_finite()
            && y.is_finite()
            && (0..d).all(|c| oa[(i, c)].is_finite() && ob[(i, c)].is_finite());
        if !finite {
            continue;
        }
        let m = f64::from(x.max(y));
        let tol = 8.0 * U32 * (m.abs() + 1.0);
        let lv = f64::from(l[i]);
        if !l[i].is_finite() || lv < m - tol || lv > m + 2f64.ln() + tol {
            return Err(format!(
                "row {i}: merging finite LSEs {x:e} and {y:e} gave {:e}, outside [max, max + ln 2]",
                l[i]
            ));
        }
        for c in 0..d {
            let (p, r) = (f64::from(oa[(i, c)]), f64::from(ob[(i, c)]));
            let (lo, hi) = (p.min(r), p.max(r));
            let tol = 8.0 * U32 * lo.abs().max(hi.abs());
            let e = o[(i, c)];
            if !e.is_finite() || f64::from(e) < lo - tol || f64::from(e) > hi + tol {
                return Err(format!(
                    "row {i}: merging finite outputs {p:e} and {r:e} gave {e:e}, outside their hull"
                ));
            }
        }
    }
    Ok(())
}

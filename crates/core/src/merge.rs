//! Partial softmax states over subsets of the keys, and their merge.
//!
//! Attention over a union of disjoint key sets is the merge of the attentions over each
//! set: with `(O_a, LSE_a)` and `(O_b, LSE_b)` per query row,
//! `LSE = ln(e^LSE_a + e^LSE_b)` and `O = e^(LSE_a − LSE) O_a + e^(LSE_b − LSE) O_b`.
//! This is what split-KV (flash-decoding) and sequence sharding (ring attention) are made
//! of: each shard computes its state and the states are merged in a fixed order.

use crate::{Error, Result, check_shape};
use faer::{Mat, MatRef};

/// Normalised attention output and log-sum-exp of each query row over a subset of keys.
///
/// A row that saw no visible key has output 0 and LSE `-inf`: the empty state, which is
/// the identity of [`PartialState::merge`], bit for bit.
///
/// ```
/// use attn_core::PartialState;
/// use faer::mat;
/// let a = PartialState::new(mat![[1.0f32, 2.0]], vec![0.0]).unwrap();
/// let b = PartialState::new(mat![[3.0f32, 4.0]], vec![0.0]).unwrap();
/// let ab = a.merge(&b).unwrap(); // equal weights: the mean, LSE ln 2
/// assert_eq!(ab.output()[(0, 0)], 2.0);
/// assert!((ab.lse()[0] - 2f32.ln()).abs() < 1e-7);
/// let empty = PartialState::empty(1, 2);
/// assert_eq!(a.merge(&empty).unwrap(), a);
/// ```
#[derive(Debug, Clone, PartialEq)]
pub struct PartialState {
    output: Mat<f32>,
    lse: Vec<f32>,
}

impl PartialState {
    /// The state of `n_q` rows of width `d_v` that have seen no key.
    pub fn empty(n_q: usize, d_v: usize) -> Self {
        Self {
            output: Mat::zeros(n_q, d_v),
            lse: vec![f32::NEG_INFINITY; n_q],
        }
    }

    /// The state of a sink logit `sink` for `n_q` rows of width `d_v`: output 0, LSE
    /// `sink` — one more state to merge, exactly once, into the states of a head's key
    /// shards when the head has a sink (a shard's own state leaves it out).
    ///
    /// ```
    /// use attn_core::PartialState;
    /// use faer::mat;
    /// let a = PartialState::new(mat![[2.0f32]], vec![0.0]).unwrap();
    /// let m = a.merge(&PartialState::sink(1, 1, 0.0)).unwrap(); // sink weight ½
    /// assert!((m.output()[(0, 0)] - 1.0).abs() < 1e-6);
    /// assert!((m.lse()[0] - 2f32.ln()).abs() < 1e-6);
    /// ```
    pub fn sink(n_q: usize, d_v: usize, sink: f32) -> Self {
        Self {
            output: Mat::zeros(n_q, d_v),
            lse: vec![sink; n_q],
        }
    }

    /// A state from a normalised output `[n_q, d_v]` and its `n_q` natural-log LSEs.
    pub fn new(output: Mat<f32>, lse: Vec<f32>) -> Result<Self> {
        if lse.len() != output.nrows() {
            return Err(Error::mismatch(
                "LSE",
                "rows",
                lse.len(),
                "output",
                output.nrows(),
                "one LSE per query row",
            ));
        }
        Ok(Self { output, lse })
    }

    /// The normalised output `[n_q, d_v]` over the keys seen so far.
    pub fn output(&self) -> MatRef<'_, f32> {
        self.output.as_ref()
    }

    /// The natural-log LSE of each row over the keys seen so far.
    pub fn lse(&self) -> &[f32] {
        &self.lse
    }

    /// The output and the LSEs.
    pub fn into_parts(self) -> (Mat<f32>, Vec<f32>) {
        (self.output, self.lse)
    }

    /// The state over the union of both key sets (which must be disjoint).
    pub fn merge(&self, other: &PartialState) -> Result<PartialState> {
        let mut out = self.clone();
        out.merge_in_place(other)?;
        Ok(out)
    }

    /// Merges `other` into `self`.
    pub fn merge_in_place(&mut self, other: &PartialState) -> Result<()> {
        let (n, d) = (self.output.nrows(), self.output.ncols());
        check_shape(
            "merged state",
            other.output.nrows(),
            other.output.ncols(),
            n,
            d,
            "both states cover the same queries and value width",
        )?;
        // Per row, what the other side brings: nothing (it saw nothing: this row is kept
        // bit for bit), everything (this side saw nothing), or a weighted mean. The outputs
        // are then combined a column at a time, along their storage.
        let mut weights = Vec::with_capacity(n);
        for i in 0..n {
            let (a, b) = (self.lse[i], other.lse[i]);
            weights.push(if b == f32::NEG_INFINITY {
                None
            } else if a == f32::NEG_INFINITY {
                self.lse[i] = b;
                Some((0.0, 1.0, false))
            } else {
                let m = a.max(b);
                let (wa, wb) = ((a - m).exp(), (b - m).exp());
                let sum = wa + wb;
                self.lse[i] = m + sum.ln();
                Some((wa / sum, wb / sum, true))
            });
        }
        for c in 0..d {
            for (i, w) in weights.iter().enumerate() {
                let Some((wa, wb, mix)) = *w else {
                    continue;
                };
                let (x, y) = (self.output[(i, c)], other.output[(i, c)]);
                self.output[(i, c)] = if !mix {
                    y
                } else if x.is_finite() && y.is_finite() {
                    // A weighted mean of two finite outputs is finite: rounding must not
                    // push it past f32::MAX (wa + wb may round above 1).
                    (wa * x + wb * y).clamp(-f32::MAX, f32::MAX)
                } else {
                    wa * x + wb * y
                };
            }
        }
        Ok(())
    }
}

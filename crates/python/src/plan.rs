//! torch's shape semantics, turned into calls of attn's batched engine.
//!
//! `query (..., L, E)`, `key (..., S, E)`, `value (..., S, Ev)` and `attn_mask`
//! (broadcastable to `(..., L, S)`) have leading axes that broadcast as in NumPy. The last
//! leading axis is the head axis (torch's dim −3): with `enable_gqa`, key and value may have
//! fewer heads than the query, query head `i` reading kv head `i / (Hq / Hkv)`.
//!
//! An engine call covers `[B, H, L, E]`: `B` is the second-to-last leading axis and `H` the
//! head axis; the axes before `B` are looped over, one call per index. The mask of a call is
//! its `[B, H, L, S]` view (attn-core's 4-D masks), whatever it differs along. Broadcast axes
//! are stride-0 views: nothing is copied to broadcast.

use attn_core::Options;
use pyo3::PyResult;
use pyo3::exceptions::{PyMemoryError, PyValueError};

use crate::array::{Array, product, shape_str};

/// Strides of an operand over the output's leading axes (0 where it broadcasts), and along
/// its sequence axis.
#[derive(Debug, Clone)]
pub(crate) struct Strides {
    pub lead: Vec<isize>,
    pub seq: isize,
}

/// The mask of a plan: its strides over the leading axes and over `(L, S)`.
#[derive(Debug, Clone)]
pub(crate) struct MaskPlan {
    pub lead: Vec<isize>,
    pub row: isize,
    pub col: isize,
}

/// One engine call: the index of its first position along the leading axes, and its
/// linear index in the compact output and kv arrays.
#[derive(Debug, Clone)]
pub(crate) struct Call {
    /// Index over `lead` (0 on the axes the call spans).
    pub index: Vec<usize>,
    /// Linear index over the output's leading shape `lead`.
    pub lin: usize,
    /// Linear index over `kv_lead` (the leading shape with `kv_heads` heads).
    pub lin_kv: usize,
}

/// A validated call of `scaled_dot_product_attention`, as engine calls.
#[derive(Debug, Clone)]
pub(crate) struct Plan {
    /// The output's leading shape (broadcast of the operands').
    pub lead: Vec<usize>,
    /// `lead` with the kv heads on the head axis: the shape of dK, dV before reduction.
    pub kv_lead: Vec<usize>,
    pub l: usize,
    pub s: usize,
    pub e: usize,
    pub ev: usize,
    /// Query heads (the head axis of `lead`; 1 without one).
    pub heads: usize,
    /// K/V heads the engine sees: a divisor of `heads`.
    pub kv_heads: usize,
    head_axis: Option<usize>,
    batch_axis: Option<usize>,
    pub q: Strides,
    pub k: Strides,
    pub v: Strides,
    pub mask: Option<MaskPlan>,
    /// The options every call shares (scale, causal mask); each call adds its mask.
    pub options: Options<'static>,
}

fn err<T>(msg: String) -> PyResult<T> {
    Err(PyValueError::new_err(msg))
}

/// `shape` right-aligned to `rank` axes (leading 1s).
fn aligned(shape: &[usize], rank: usize) -> Vec<usize> {
    let mut out = vec![1; rank - shape.len()];
    out.extend_from_slice(shape);
    out
}

fn aligned_strides(strides: &[isize], rank: usize) -> Vec<isize> {
    let mut out = vec![0; rank - strides.len()];
    out.extend_from_slice(strides);
    out
}

/// The broadcast of axis lengths, NumPy's rule: every length other than 1 must be the same
/// (0 included: 1 broadcasts to 0); `None` when they differ.
fn broadcast(dims: &[usize]) -> Option<usize> {
    let n = dims.iter().copied().find(|&d| d != 1).unwrap_or(1);
    dims.iter().all(|&d| d == 1 || d == n).then_some(n)
}

/// The stride of an operand along an axis of the output: its own, or 0 where it has one
/// entry (broadcast).
fn stride_on(dim: usize, stride: isize) -> isize {
    if dim == 1 { 0 } else { stride }
}

impl Plan {
    /// Checks `query`, `key`, `value` and the mask against each other as torch does and
    /// plans the engine calls. The operands' dtypes are checked by the caller.
    pub(crate) fn new(
        q: &Array<'_>,
        k: &Array<'_>,
        v: &Array<'_>,
        mask: Option<&Array<'_>>,
        enable_gqa: bool,
        options: Options<'static>,
    ) -> PyResult<Self> {
        if q.ndim() < 2 || k.ndim() < 2 || v.ndim() < 2 {
            return err(format!(
                "Expected query, key, and value to all be at least 2 dimensional, but got query.dim: {} key.dim: {} and value.dim: {} instead.",
                q.ndim(),
                k.ndim(),
                v.ndim()
            ));
        }
        let (qn, kn, vn) = (q.ndim(), k.ndim(), v.ndim());
        let (l, e) = (q.shape[qn - 2], q.shape[qn - 1]);
        let (s, ek) = (k.shape[kn - 2], k.shape[kn - 1]);
        let (sv, ev) = (v.shape[vn - 2], v.shape[vn - 1]);
        if ek != e {
            return err(format!(
                "key of shape {} has {ek} features but query of shape {} has {e} (the last axes, E, must match)",
                k.shape_str(),
                q.shape_str()
            ));
        }
        if sv != s {
            return err(format!(
                "value of shape {} has {sv} positions but key of shape {} has {s} (the second-to-last axes, S, must match)",
                v.shape_str(),
                k.shape_str()
            ));
        }
        if e == 0 {
            return err(format!(
                "query of shape {} has 0 features: attn needs E ≥ 1",
                q.shape_str()
            ));
        }
        let r = (qn - 2).max(kn - 2).max(vn - 2);
        let ql = aligned(&q.shape[..qn - 2], r);
        let kl = aligned(&k.shape[..kn - 2], r);
        let vl = aligned(&v.shape[..vn - 2], r);
        let lead_of = |a: &Array<'_>| shape_str(&a.shape[..a.ndim() - 2]);
        let mismatch = |what: &str| {
            format!(
                "query, key and value have leading shapes {}, {} and {} whose {what} do not broadcast",
                lead_of(q),
                lead_of(k),
                lead_of(v)
            )
        };
        let mut lead = vec![0; r];
        for a in 0..r.saturating_sub(1) {
            let Some(n) = broadcast(&[ql[a], kl[a], vl[a]]) else {
                return err(mismatch(&format!("axes {a}")));
            };
            lead[a] = n;
        }
        let (heads, kv_heads) = if r == 0 {
            (1, 1)
        } else {
            let (hq, hk, hv) = (ql[r - 1], kl[r - 1], vl[r - 1]);
            if enable_gqa && !(hq == hk && hk == hv) {
                if hk == 0 || hv == 0 || hq % hk != 0 || hq % hv != 0 {
                    return err(format!(
                        "Number of heads in key and value must divide the number of heads in query: query has {hq} heads, key {hk} and value {hv} (enable_gqa=True)"
                    ));
                }
                let kv = match (hk, hv) {
                    _ if hk == hv => hk,
                    (1, _) => hv,
                    (_, 1) => hk,
                    _ => {
                        return err(format!(
                            "key has {hk} heads but value has {hv}: attn's grouped-query attention needs key and value to have the same number of heads (or one of them 1)"
                        ));
                    }
                };
                (hq, kv)
            } else {
                let Some(kv) = broadcast(&[hk, hv]) else {
                    return err(mismatch("head axes (dim -3)"));
                };
                let Some(n) = broadcast(&[hq, kv]) else {
                    let hint = if kv != 0 && hq % kv == 0 {
                        format!(
                            " (query has {hq} heads and key/value {kv}: pass enable_gqa=True for grouped-query attention)"
                        )
                    } else {
                        String::new()
                    };
                    return err(format!("{}{hint}", mismatch("head axes (dim -3)")));
                };
                (n, kv)
            }
        };
        if r > 0 {
            lead[r - 1] = heads;
        }
        // Every count over the leading axes below (calls, offsets, results) is at most this
        // product, so it is checked once here, before anything is walked or allocated.
        if !lead.contains(&0) && product(&lead).is_none() {
            return Err(PyMemoryError::new_err(format!(
                "the leading shapes of query {}, key {} and value {} broadcast to {}, more positions than this machine can address",
                lead_of(q),
                lead_of(k),
                lead_of(v),
                shape_str(&lead)
            )));
        }
        let mut kv_lead = lead.clone();
        if r > 0 {
            kv_lead[r - 1] = kv_heads;
        }
        let strides_of = |a: &Array<'_>, dims: &[usize]| {
            let n = a.ndim();
            let st = aligned_strides(&a.strides[..n - 2], r);
            Strides {
                lead: dims
                    .iter()
                    .zip(&st)
                    .map(|(&d, &s)| stride_on(d, s))
                    .collect(),
                seq: a.strides[n - 2],
            }
        };
        let (qs, ks, vs) = (strides_of(q, &ql), strides_of(k, &kl), strides_of(v, &vl));

        let (head_axis, batch_axis) = match r {
            0 => (None, None),
            1 => (Some(0), None),
            _ => (Some(r - 1), Some(r - 2)),
        };
        let mut plan = Plan {
            lead,
            kv_lead,
            l,
            s,
            e,
            ev,
            heads,
            kv_heads,
            head_axis,
            batch_axis,
            q: qs,
            k: ks,
            v: vs,
            mask: None,
            options,
        };
        if let Some(m) = mask {
            plan.set_mask(m)?;
        }
        Ok(plan)
    }

    /// Checks that the mask broadcasts to `lead + (L, S)` and records its strides (again
    /// when the mask has been replaced by a copy of another layout).
    pub(crate) fn set_mask(&mut self, m: &Array<'_>) -> PyResult<()> {
        let r = self.lead.len();
        let mut full = self.lead.clone();
        full.extend([self.l, self.s]);
        let bad = || {
            err(format!(
                "attn_mask of shape {} does not broadcast to the shape of the attention weights {} (..., L, S)",
                m.shape_str(),
                shape_str(&full)
            ))
        };
        if m.ndim() > r + 2 {
            return bad();
        }
        let dims = aligned(&m.shape, r + 2);
        let strides = aligned_strides(&m.strides, r + 2);
        if dims.iter().zip(&full).any(|(&d, &n)| d != 1 && d != n) {
            return bad();
        }
        let lead: Vec<isize> = (0..r).map(|a| stride_on(dims[a], strides[a])).collect();
        self.mask = Some(MaskPlan {
            lead,
            row: stride_on(dims[r], strides[r]),
            col: stride_on(dims[r + 1], strides[r + 1]),
        });
        Ok(())
    }

    /// The leading axes a call spans: its batch axis and its head axis (each if any).
    pub(crate) fn call_axes(&self) -> (Option<usize>, Option<usize>) {
        (self.batch_axis, self.head_axis)
    }

    /// Batch entries per call.
    pub(crate) fn call_batch(&self) -> usize {
        self.batch_axis.map_or(1, |b| self.lead[b])
    }

    /// The (batch, head) strides of an operand in a call.
    pub(crate) fn call_strides(&self, s: &Strides) -> [isize; 3] {
        let at = |axis: Option<usize>| axis.map_or(0, |a| s.lead[a]);
        [at(self.batch_axis), at(self.head_axis), s.seq]
    }

    /// The mask's strides over a call's `[B, H, L, S]`.
    pub(crate) fn mask_strides(&self) -> Option<[isize; 4]> {
        self.mask.as_ref().map(|m| {
            let at = |axis: Option<usize>| axis.map_or(0, |a| m.lead[a]);
            [at(self.batch_axis), at(self.head_axis), m.row, m.col]
        })
    }

    /// Whether attn-core's 4-D mask view can take the mask as it is: strides that step
    /// forward, and a row or column axis that is contiguous or broadcast. Otherwise the
    /// mask is copied once (compacted) before the calls.
    pub(crate) fn mask_viewable(&self) -> bool {
        self.mask_strides().is_none_or(|[b, h, row, col]| {
            [b, h, row, col].iter().all(|&x| x >= 0) && (row <= 1 || col <= 1)
        })
    }

    /// Whether there is any engine call: an output position with a query.
    pub(crate) fn has_calls(&self) -> bool {
        !self.lead.contains(&0) && self.l > 0
    }

    /// Every engine call, in order (generated one by one: a broadcast axis may make many).
    pub(crate) fn calls(&self) -> impl Iterator<Item = Call> + '_ {
        let r = self.lead.len();
        let looped: Vec<usize> = (0..r)
            .filter(|&a| Some(a) != self.batch_axis && Some(a) != self.head_axis)
            .collect();
        // No output position (or no query): nothing to compute, and dK, dV stay 0. Otherwise
        // the count divides the product of `lead`, checked by `new`.
        let count: usize = if self.has_calls() {
            looped.iter().map(|&a| self.lead[a]).product()
        } else {
            0
        };
        let group = (self.heads / self.kv_heads.max(1)).max(1);
        let mut index = vec![0usize; r];
        (0..count).map(move |_| {
            let (mut lin, mut lin_kv) = (0usize, 0usize);
            for (a, &i) in index.iter().enumerate() {
                let kv_i = if Some(a) == self.head_axis {
                    i / group
                } else {
                    i
                };
                lin = lin * self.lead[a] + i;
                lin_kv = lin_kv * self.kv_lead[a] + kv_i;
            }
            let call = Call {
                index: index.clone(),
                lin,
                lin_kv,
            };
            for &a in looped.iter().rev() {
                index[a] += 1;
                if index[a] < self.lead[a] {
                    break;
                }
                index[a] = 0;
            }
            call
        })
    }

    /// The element offset of leading position `index` in an operand with leading strides
    /// `lead` (`kv`: the head index is the kv head that query head reads).
    pub(crate) fn offset(&self, lead: &[isize], index: &[usize], kv: bool) -> isize {
        let group = (self.heads / self.kv_heads.max(1)).max(1);
        index
            .iter()
            .zip(lead)
            .enumerate()
            .map(|(a, (&i, &s))| {
                let i = if kv && Some(a) == self.head_axis {
                    i / group
                } else {
                    i
                };
                i as isize * s
            })
            .sum()
    }

    /// Linear-index strides of a call's (batch, head) in the compact output (`kv`: in the
    /// compact dK/dV).
    pub(crate) fn lin_strides(&self, kv: bool) -> [usize; 2] {
        let heads = if kv { self.kv_heads } else { self.heads };
        match (self.batch_axis, self.head_axis) {
            (Some(_), Some(_)) => [heads, 1],
            (None, Some(_)) => [0, 1],
            _ => [0, 0],
        }
    }

    /// The output's shape, `lead + (L, Ev)`.
    pub(crate) fn out_shape(&self) -> Vec<usize> {
        let mut s = self.lead.clone();
        s.extend([self.l, self.ev]);
        s
    }

    /// The LSE's shape, `lead + (L,)`.
    pub(crate) fn lse_shape(&self) -> Vec<usize> {
        let mut s = self.lead.clone();
        s.push(self.l);
        s
    }
}

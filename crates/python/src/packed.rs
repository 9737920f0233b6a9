//! Packed batches: sequences of different lengths stored one after the other, in
//! flash-attn's varlen layout, as one engine call ([`attn_optimized::Attention::packed`]).
//!
//! `query (total_q, Hq, E)`, `key (total_k, Hkv, E)`, `value (total_k, Hkv, Ev)`; sequence
//! `i` holds the rows `cu_seqlens_q[i]..cu_seqlens_q[i + 1]` of the query and
//! `cu_seqlens_k[i]..cu_seqlens_k[i + 1]` of key and value, and attends only within itself
//! (the causal mask aligned per sequence). The output is `(total_q, Hq, Ev)`, the LSE
//! `(Hq, total_q)` (flash-attn's `softmax_lse`), the gradients shaped like their operands.

use attn_core::{CuSeqlens, ForwardRef, GradientsMut};
use attn_optimized::{Attention, Par};
use half::{bf16, f16};
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyTuple;

use crate::array::{Array, Dtype, Float};
use crate::output::{SendPtr, Storage, finish};
use crate::sdpa::{Flags, view, view_mut};
use crate::to_py_err;

/// The validated offsets of a packed call, owned (the engine's [`CuSeqlens`] borrows them).
#[derive(Debug, Clone)]
pub(crate) struct Seqlens {
    q: Vec<usize>,
    k: Vec<usize>,
}

impl Seqlens {
    /// Reads `cu_seqlens_q` and `cu_seqlens_k` (both or neither): 1-D integer sequences
    /// of `batch + 1` offsets (NumPy arrays, torch tensors, lists), checked by attn-core.
    pub(crate) fn read(
        q: Option<&Bound<'_, PyAny>>,
        k: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Option<Self>> {
        let (q, k) = match (q, k) {
            (None, None) => return Ok(None),
            (Some(q), Some(k)) => (offsets("cu_seqlens_q", q)?, offsets("cu_seqlens_k", k)?),
            _ => {
                return Err(PyValueError::new_err(
                    "cu_seqlens_q and cu_seqlens_k go together: pass both for a packed batch, or neither",
                ));
            }
        };
        CuSeqlens::new(&q, &k).map_err(to_py_err)?;
        Ok(Some(Self { q, k }))
    }

    fn get(&self) -> attn_core::Result<CuSeqlens<'_>> {
        CuSeqlens::new(&self.q, &self.k)
    }

    /// The query offsets (`batch + 1`, from 0).
    pub(crate) fn q(&self) -> &[usize] {
        &self.q
    }

    /// The key offsets (`batch + 1`, from 0).
    pub(crate) fn k(&self) -> &[usize] {
        &self.k
    }
}

/// A 1-D sequence of non-negative integers (a NumPy array, a torch tensor, a list), named
/// `name` in errors: offsets, sequence ids.
pub(crate) fn offsets(name: &str, obj: &Bound<'_, PyAny>) -> PyResult<Vec<usize>> {
    let list = if obj.hasattr("tolist")? {
        obj.call_method0("tolist")?
    } else {
        obj.clone()
    };
    let values: Vec<i64> = list.extract().map_err(|_| {
        PyTypeError::new_err(format!(
            "{name} must be a 1-D sequence of integer offsets (a NumPy array, a torch tensor or a list)"
        ))
    })?;
    values
        .into_iter()
        .map(|x| {
            usize::try_from(x).map_err(|_| {
                PyValueError::new_err(format!("{name} holds {x}: offsets are not negative"))
            })
        })
        .collect()
}

/// `(total, heads, features)` of a packed operand.
fn dims3(a: &Array<'_>) -> PyResult<[usize; 3]> {
    match a.shape[..] {
        [t, h, d] => Ok([t, h, d]),
        _ => Err(PyValueError::new_err(format!(
            "{} of shape {} must have 3 axes (total, heads, features) in a packed batch (cu_seqlens)",
            a.name,
            a.shape_str()
        ))),
    }
}

/// The operands' shapes against each other, torch's way for the heads.
fn check_shapes(q: &Array<'_>, k: &Array<'_>, v: &Array<'_>, f: &Flags) -> PyResult<()> {
    let ([_, hq, e], [tk, hk, ek], [tv, hv, _]) = (dims3(q)?, dims3(k)?, dims3(v)?);
    if ek != e || tv != tk || hv != hk {
        return Err(PyValueError::new_err(format!(
            "query {}, key {} and value {} do not fit a packed batch: key must have the query's features, value the key's tokens and heads",
            q.shape_str(),
            k.shape_str(),
            v.shape_str()
        )));
    }
    if hq != hk && !f.enable_gqa {
        return Err(PyValueError::new_err(format!(
            "query has {hq} heads and key/value {hk}: pass enable_gqa=True for grouped-query attention"
        )));
    }
    Ok(())
}

/// The engine's `[1, heads, total, d]` view of a `(total, heads, d)` operand.
///
/// # Safety
/// `a` must be an input of element type `T` whose buffer outlives the view, unwritten.
pub(crate) unsafe fn operand<'a, T>(
    a: &Array<'_>,
) -> attn_core::Result<attn_core::Tensor4Ref<'a, T>> {
    let [t, h, d] = [a.shape[0], a.shape[1], a.shape[2]];
    // SAFETY: the caller's guarantee; the strides are the array's own (non-negative:
    // `forward_strides` copied any other).
    unsafe {
        view(
            SendPtr(a.ptr()),
            0,
            [1, h, t, d],
            [0, a.strides[1], a.strides[0]],
        )
    }
}

/// The output and, when asked, the LSE of a packed call.
pub(crate) fn forward<'py>(
    py: Python<'py>,
    q: &Array<'py>,
    k: &Array<'py>,
    v: &Array<'py>,
    f: &Flags,
    seqs: &Seqlens,
    with_lse: bool,
) -> PyResult<(Bound<'py, PyAny>, Option<Bound<'py, PyAny>>)> {
    check_shapes(q, k, v, f)?;
    match q.dtype {
        Dtype::F32 => forward_typed::<f32>(py, q, k, v, f, seqs, with_lse),
        Dtype::F16 => forward_typed::<f16>(py, q, k, v, f, seqs, with_lse),
        _ => forward_typed::<bf16>(py, q, k, v, f, seqs, with_lse),
    }
}

fn forward_typed<'py, T: Storage>(
    py: Python<'py>,
    q: &Array<'py>,
    k: &Array<'py>,
    v: &Array<'py>,
    f: &Flags,
    seqs: &Seqlens,
    with_lse: bool,
) -> PyResult<(Bound<'py, PyAny>, Option<Bound<'py, PyAny>>)> {
    let seqs = seqs.get().map_err(to_py_err)?;
    // SAFETY: the operands were read as `T` (the query's dtype, checked for all three) and
    // live (borrowed) until we return.
    let (qv, kv, vv) = unsafe { (operand::<T>(q), operand::<T>(k), operand::<T>(v)) };
    let (qv, kv, vv) = (
        qv.map_err(to_py_err)?,
        kv.map_err(to_py_err)?,
        vv.map_err(to_py_err)?,
    );
    let call = Attention::packed(qv, kv, vv, &seqs, &f.options).map_err(to_py_err)?;
    let [_, h, t, ev] = call.out_dims();
    let (out, out_ptr) = T::zeros(py, &[t, h, ev])?;
    let lse = with_lse.then(|| f32::zeros(py, &[h, t])).transpose()?;
    let lse_ptr = lse.as_ref().map(|(_, p)| *p);
    py.detach(|| {
        // SAFETY: our own compact results, just allocated: the output `(t, h, ev)` and the
        // LSE `(h, t)`, touched by nothing else during the call.
        let (o, l) = unsafe {
            let o = view_mut(out_ptr, 0, [1, h, t, ev], [0, ev, h * ev])?;
            let l = match lse_ptr {
                None => None,
                Some(p) => Some(view_mut(p, 0, [1, h, t, 1], [0, t, 1])?),
            };
            (o, l)
        };
        call.forward_into(o, l, Par::rayon(0))
    })
    .map_err(to_py_err)?;
    let out = finish(out, q.kind, T::DTYPE)?;
    let lse = lse
        .map(|(a, _)| finish(a, q.kind, Float::F32))
        .transpose()?;
    Ok((out, lse))
}

/// The gradients of a packed call, shaped like the operands.
#[allow(clippy::too_many_arguments)]
pub(crate) fn backward<'py>(
    py: Python<'py>,
    go: &Array<'py>,
    q: &Array<'py>,
    k: &Array<'py>,
    v: &Array<'py>,
    o: &Array<'py>,
    lse: &Array<'py>,
    f: &Flags,
    seqs: &Seqlens,
) -> PyResult<Bound<'py, PyTuple>> {
    check_shapes(q, k, v, f)?;
    let ([t, h, _], [_, _, ev]) = (dims3(q)?, dims3(v)?);
    for (a, want) in [(go, vec![t, h, ev]), (o, vec![t, h, ev]), (lse, vec![h, t])] {
        if a.shape != want {
            return Err(PyValueError::new_err(format!(
                "{} has shape {} but the packed call's is {}",
                a.name,
                a.shape_str(),
                crate::array::shape_str(&want)
            )));
        }
    }
    match q.dtype {
        Dtype::F32 => backward_typed::<f32>(py, go, q, k, v, o, lse, f, seqs),
        Dtype::F16 => backward_typed::<f16>(py, go, q, k, v, o, lse, f, seqs),
        _ => backward_typed::<bf16>(py, go, q, k, v, o, lse, f, seqs),
    }
}

#[allow(clippy::too_many_arguments)]
fn backward_typed<'py, T: Storage>(
    py: Python<'py>,
    go: &Array<'py>,
    q: &Array<'py>,
    k: &Array<'py>,
    v: &Array<'py>,
    o: &Array<'py>,
    lse: &Array<'py>,
    f: &Flags,
    seqs: &Seqlens,
) -> PyResult<Bound<'py, PyTuple>> {
    let seqs = seqs.get().map_err(to_py_err)?;
    // SAFETY: every operand was read as `T` (dO and O too; the LSE as f32) and lives
    // (borrowed) until we return.
    let views = unsafe {
        (
            operand::<T>(q),
            operand::<T>(k),
            operand::<T>(v),
            operand::<T>(go),
            operand::<T>(o),
        )
    };
    let [h, t] = [lse.shape[0], lse.shape[1]];
    // SAFETY: the LSE `(h, t)` was read as f32 and lives until we return.
    let lse_view = unsafe {
        view(
            SendPtr(lse.ptr::<f32>()),
            0,
            [1, h, t, 1],
            [0, lse.strides[0], lse.strides[1]],
        )
    };
    let (qv, kv, vv, gv, ov) = views;
    let (qv, kv, vv) = (
        qv.map_err(to_py_err)?,
        kv.map_err(to_py_err)?,
        vv.map_err(to_py_err)?,
    );
    let (gv, ov, lse_view) = (
        gv.map_err(to_py_err)?,
        ov.map_err(to_py_err)?,
        lse_view.map_err(to_py_err)?,
    );
    let call = Attention::packed(qv, kv, vv, &seqs, &f.options).map_err(to_py_err)?;
    let mut arrays = Vec::with_capacity(3);
    for a in [q, k, v] {
        arrays.push(T::zeros(py, &a.shape)?);
    }
    let dims: Vec<[usize; 3]> = [q, k, v]
        .iter()
        .map(|a| [a.shape[0], a.shape[1], a.shape[2]])
        .collect();
    let ptrs: Vec<SendPtr<T>> = arrays.iter().map(|(_, p)| *p).collect();
    py.detach(|| {
        let grad = |i: usize| {
            let [t, h, d] = dims[i];
            // SAFETY: our own compact gradient `(total, heads, d)`, just allocated with
            // its operand's shape, touched by nothing else during the call.
            unsafe { view_mut(ptrs[i], 0, [1, h, t, d], [0, d, h * d]) }
        };
        let grads = GradientsMut {
            dq: grad(0)?,
            dk: grad(1)?,
            dv: grad(2)?,
        };
        call.backward_into(ForwardRef::new(ov, lse_view), gv, grads, Par::rayon(0))
    })
    .map_err(to_py_err)?;
    let mut results = Vec::with_capacity(3);
    for (arr, _) in arrays {
        results.push(finish(arr, q.kind, T::DTYPE)?);
    }
    PyTuple::new(py, results)
}

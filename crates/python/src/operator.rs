//! The kernels of `attn.torch`'s `torch.library` operators (`attn::sdpa_forward`,
//! `attn::sdpa_backward`, `attn::sdpa_backward_mask`), registered as the operators' CPU
//! kernels themselves (the mask's operator through `functools.partial`, `mask_grad=True`):
//! torch's dispatcher calls them with the schema's arguments in the schema's order, all
//! positional.
//!
//! They are the module's functions minus what the operators do elsewhere: no route to
//! autograd (the operator's autograd kernel is above them: the one Python layer of a call),
//! no seed drawn (the operators take it as an input, a 0-d int64 tensor, so that the
//! backward pass can regenerate the forward's dropout mask and a compiled graph can draw it
//! as a node). The backward kernel takes a `grad_out` of any strides (an upstream gradient
//! is often a view), copying it compact when its rows are not.

use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::PyTuple;

use crate::sdpa::{ForwardCall, Route, attention_backward, require_seed};

/// `x` as it is when its last axis is contiguous (or it is not a torch tensor: the
/// module's own error names it), else `x.contiguous()`.
fn compact_rows<'py>(x: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyAny>> {
    let py = x.py();
    if !crate::array::is_torch_tensor(x)? {
        return Ok(x.clone());
    }
    let strides: Vec<isize> = x.call_method0(intern!(py, "stride"))?.extract()?;
    if strides.last().is_none_or(|&s| s == 1) {
        return Ok(x.clone());
    }
    x.call_method0(intern!(py, "contiguous"))
}

/// `attn::sdpa_forward`'s CPU kernel: `(out, lse)`.
#[pyfunction]
#[pyo3(signature = (query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, causal_alignment, seed=None, cu_seqlens_q=None, cu_seqlens_k=None))]
#[allow(clippy::too_many_arguments)]
pub(crate) fn sdpa_forward_kernel<'py>(
    query: &Bound<'py, PyAny>,
    key: &Bound<'py, PyAny>,
    value: &Bound<'py, PyAny>,
    attn_mask: Option<&Bound<'py, PyAny>>,
    dropout_p: f64,
    is_causal: bool,
    scale: Option<f64>,
    enable_gqa: bool,
    causal_alignment: &str,
    seed: Option<&Bound<'py, PyAny>>,
    cu_seqlens_q: Option<&Bound<'py, PyAny>>,
    cu_seqlens_k: Option<&Bound<'py, PyAny>>,
) -> PyResult<Bound<'py, PyTuple>> {
    ForwardCall {
        query,
        key,
        value,
        attn_mask,
        dropout_p,
        is_causal,
        scale,
        enable_gqa,
        causal_alignment,
        seed,
        cu_seqlens: (cu_seqlens_q, cu_seqlens_k),
    }
    .run(Route::Kernel)?
    .cast_into::<PyTuple>()
    .map_err(Into::into)
}

/// `attn::sdpa_backward`'s CPU kernel: `(dq, dk, dv)`; with `mask_grad=True` (a keyword the
/// schema does not have: `attn.torch` binds it), `attn::sdpa_backward_mask`'s, `(dq, dk,
/// dv, dmask)`.
#[pyfunction]
#[pyo3(signature = (grad_out, query, key, value, out, lse, attn_mask, is_causal, scale, enable_gqa, causal_alignment, dropout_p=0.0, seed=None, cu_seqlens_q=None, cu_seqlens_k=None, *, mask_grad=false))]
#[allow(clippy::too_many_arguments)]
pub(crate) fn sdpa_backward_kernel<'py>(
    grad_out: &Bound<'py, PyAny>,
    query: &Bound<'py, PyAny>,
    key: &Bound<'py, PyAny>,
    value: &Bound<'py, PyAny>,
    out: &Bound<'py, PyAny>,
    lse: &Bound<'py, PyAny>,
    attn_mask: Option<&Bound<'py, PyAny>>,
    is_causal: bool,
    scale: Option<f64>,
    enable_gqa: bool,
    causal_alignment: &str,
    dropout_p: f64,
    seed: Option<&Bound<'py, PyAny>>,
    cu_seqlens_q: Option<&Bound<'py, PyAny>>,
    cu_seqlens_k: Option<&Bound<'py, PyAny>>,
    mask_grad: bool,
) -> PyResult<Bound<'py, PyTuple>> {
    let py = query.py();
    crate::errors::torch_like(py, || {
        require_seed(dropout_p, seed)?;
        let grad_out = &compact_rows(grad_out)?;
        attention_backward(
            grad_out,
            query,
            key,
            value,
            out,
            lse,
            attn_mask,
            is_causal,
            scale,
            enable_gqa,
            causal_alignment,
            dropout_p,
            seed,
            cu_seqlens_q,
            cu_seqlens_k,
            mask_grad,
        )
    })
}

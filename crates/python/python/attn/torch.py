"""attn for torch: ``scaled_dot_product_attention`` as ``torch.library`` custom operators.

Importing this module needs torch (``import attn`` alone does not). It registers two
operators, with fake (meta) implementations that compute shapes only and the autograd
formula between them, so that ``torch.compile`` (``fullgraph=True``), ``torch.export`` and
meta or fake tensors see attn as one opaque node::

    torch.ops.attn.sdpa_forward(query, key, value, attn_mask, dropout_p, is_causal, scale,
                                enable_gqa, causal_alignment) -> (out, lse)
    torch.ops.attn.sdpa_backward(grad_out, query, key, value, out, lse, attn_mask,
                                 is_causal, scale, enable_gqa, causal_alignment)
        -> (grad_query, grad_key, grad_value)

The forward pass is attn's, recording the output and the log-sum-exp; the backward pass is
attn's too (dQ, dK, dV recomputed from the LSE, accumulated in float32 and rounded once), so
``loss.backward()`` works::

    import torch, attn.torch
    q = torch.randn(2, 8, 128, 64, requires_grad=True)
    out = attn.torch.scaled_dot_product_attention(q, q, q, is_causal=True)
    out.sum().backward()

``attn.scaled_dot_product_attention`` sends torch tensors that require grad here by itself.
Meta and fake tensors given to ``attn.scaled_dot_product_attention`` come here too.
Differences from torch's function: those of ``attn.scaled_dot_product_attention``, and the
gradient of ``attn_mask`` is not computed (a mask that requires grad is a ValueError).
``dropout_p`` must be 0.0 (a ValueError otherwise, from the operator too).
"""

import contextlib
import warnings
from typing import Optional

import torch

from . import _attn

__all__ = [
    "ScaledDotProductAttention",
    "scaled_dot_product_attention",
    "attention_with_lse",
    "sdpa_forward",
    "sdpa_backward",
    "routing",
]

Tensor = torch.Tensor


def _kind(x):
    if isinstance(x, torch.Tensor):
        return "a torch.Tensor"
    return "a NumPy array" if type(x).__module__ == "numpy" else f"a {type(x).__name__}"


def _check_tensors(query, key, value, attn_mask):
    """The plain path's TypeError for operands that are not all torch tensors (the operators
    read tensors only)."""
    operands = (("key", key), ("value", value), ("attn_mask", attn_mask))
    for name, x in operands:
        if x is not None and isinstance(x, torch.Tensor) != isinstance(query, torch.Tensor):
            raise TypeError(
                f"query is {_kind(query)} but {name} is {_kind(x)}: pass torch tensors together, "
                "or NumPy arrays together"
            )
    if not isinstance(query, torch.Tensor):
        raise TypeError(f"attn.torch computes on torch tensors: query is {_kind(query)}")


def _check_dropout(dropout_p):
    if dropout_p != 0.0:
        raise ValueError(
            f"dropout_p={dropout_p}: attn does not implement attention dropout; pass dropout_p=0.0"
        )


def _check_mask(attn_mask):
    if attn_mask is not None and attn_mask.requires_grad:
        raise ValueError(
            "attn_mask requires grad: attn does not compute the gradient of the mask "
            "(pass attn_mask.detach())"
        )


# ---------------------------------------------------------------------------------------
# The operators.


@torch.library.custom_op("attn::sdpa_forward", mutates_args=())
def sdpa_forward(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Optional[Tensor],
    dropout_p: float,
    is_causal: bool,
    scale: Optional[float],
    enable_gqa: bool,
    causal_alignment: str,
) -> tuple[Tensor, Tensor]:
    """attn's forward pass: ``(out, lse)``, ``lse`` float32 ``(..., L)``."""
    _check_dropout(dropout_p)
    return _attn.attention_with_lse(
        query.detach(),
        key.detach(),
        value.detach(),
        None if attn_mask is None else attn_mask.detach(),
        0.0,
        is_causal,
        scale=scale,
        enable_gqa=enable_gqa,
        causal_alignment=causal_alignment,
    )


def _batch_shape(query, key, value, enable_gqa):
    """The output's leading axes: the operands' broadcast, a key/value head count that
    divides the query's standing for it under ``enable_gqa``."""
    shapes = [tuple(query.shape[:-2])]
    for x in (key, value):
        lead = list(x.shape[:-2])
        if enable_gqa and len(lead) >= 1 and query.dim() >= 3 and lead[-1] != query.shape[-3]:
            lead[-1] = 1
        shapes.append(tuple(lead))
    return torch.broadcast_shapes(*shapes)


@sdpa_forward.register_fake
def _sdpa_forward_fake(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, causal_alignment):
    _check_dropout(dropout_p)
    lead = _batch_shape(query, key, value, enable_gqa)
    n_q = query.shape[-2]
    out = query.new_empty((*lead, n_q, value.shape[-1]))
    lse = query.new_empty((*lead, n_q), dtype=torch.float32)
    return out, lse


@torch.library.custom_op("attn::sdpa_backward", mutates_args=())
def sdpa_backward(
    grad_out: Tensor,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    out: Tensor,
    lse: Tensor,
    attn_mask: Optional[Tensor],
    is_causal: bool,
    scale: Optional[float],
    enable_gqa: bool,
    causal_alignment: str,
) -> tuple[Tensor, Tensor, Tensor]:
    """attn's backward pass: ``(dq, dk, dv)``, shaped and typed like the operands."""
    return _attn.attention_backward(
        grad_out.detach().contiguous(),
        query.detach(),
        key.detach(),
        value.detach(),
        out.detach(),
        lse.detach(),
        None if attn_mask is None else attn_mask.detach(),
        is_causal,
        scale=scale,
        enable_gqa=enable_gqa,
        causal_alignment=causal_alignment,
    )


@sdpa_backward.register_fake
def _sdpa_backward_fake(grad_out, query, key, value, out, lse, attn_mask, is_causal, scale, enable_gqa, causal_alignment):
    return (
        query.new_empty(query.shape),
        key.new_empty(key.shape),
        value.new_empty(value.shape),
    )


def _setup_context(ctx, inputs, output):
    query, key, value, attn_mask, _dropout_p, is_causal, scale, enable_gqa, causal_alignment = inputs
    out, lse = output
    ctx.save_for_backward(query, key, value, out, lse, attn_mask)
    ctx.options = (is_causal, scale, enable_gqa, causal_alignment)
    ctx.mark_non_differentiable(lse)


def _backward(ctx, grad_out, _grad_lse):
    query, key, value, out, lse, attn_mask = ctx.saved_tensors
    needs = ctx.needs_input_grad[:3]
    if not any(needs):
        return None, None, None, None, None, None, None, None, None
    dq, dk, dv = sdpa_backward(grad_out, query, key, value, out, lse, attn_mask, *ctx.options)
    return (
        dq if needs[0] else None,
        dk if needs[1] else None,
        dv if needs[2] else None,
        None,
        None,
        None,
        None,
        None,
        None,
    )


sdpa_forward.register_autograd(_backward, setup_context=_setup_context)


# ---------------------------------------------------------------------------------------
# The calls.


def _attention(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, causal_alignment):
    _check_tensors(query, key, value, attn_mask)
    _check_dropout(dropout_p)
    _check_mask(attn_mask)
    if scale is not None:
        scale = float(scale)
    return sdpa_forward(
        query, key, value, attn_mask, 0.0, bool(is_causal), scale, bool(enable_gqa), causal_alignment
    )


class ScaledDotProductAttention:
    """The former ``torch.autograd.Function``, kept for its callers: ``apply(query, key,
    value, attn_mask, is_causal, scale, enable_gqa, causal_alignment)`` returns
    ``(out, lse)`` through the operator ``attn::sdpa_forward``; ``lse`` is not
    differentiable."""

    @staticmethod
    def apply(query, key, value, attn_mask, is_causal, scale, enable_gqa, causal_alignment):
        return _attention(query, key, value, attn_mask, 0.0, is_causal, scale, enable_gqa, causal_alignment)


def _autograd_attention(query, key, value, attn_mask, is_causal, scale, enable_gqa, causal_alignment, with_lse):
    """The route of ``attn.scaled_dot_product_attention`` for torch tensors that require
    grad, and for those the plain path cannot read in place (meta tensors, tensor
    subclasses such as fake tensors)."""
    out, lse = _attention(query, key, value, attn_mask, 0.0, is_causal, scale, enable_gqa, causal_alignment)
    return (out, lse) if with_lse else out


def scaled_dot_product_attention(
    query,
    key,
    value,
    attn_mask=None,
    dropout_p=0.0,
    is_causal=False,
    *,
    scale=None,
    enable_gqa=False,
    causal_alignment="top_left",
):
    """``torch.nn.functional.scaled_dot_product_attention``, differentiable, by attn, through
    the operator ``attn::sdpa_forward`` (so ``torch.compile`` and ``torch.export`` take it
    whole).

    The arguments and the differences from torch are those of
    ``attn.scaled_dot_product_attention``; the gradient of ``attn_mask`` is not computed.
    """
    out, _ = _attention(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, causal_alignment)
    return out


def attention_with_lse(
    query,
    key,
    value,
    attn_mask=None,
    dropout_p=0.0,
    is_causal=False,
    *,
    scale=None,
    enable_gqa=False,
    causal_alignment="top_left",
):
    """``(out, lse)`` as ``attn.attention_with_lse``, with ``out`` differentiable."""
    return _attention(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, causal_alignment)


# ---------------------------------------------------------------------------------------
# torch.compile of the plain entry points: dynamo cannot trace into the extension's
# functions, so it is given these in their place (same signatures), which call the operator.


def _no_packed(cu_seqlens_q, cu_seqlens_k):
    if cu_seqlens_q is not None or cu_seqlens_k is not None:
        raise ValueError(
            "cu_seqlens under torch.compile: packed batches have no torch operator yet; call "
            "attn outside the compiled region"
        )


@torch._dynamo.substitute_in_graph(_attn.scaled_dot_product_attention)
def _compiled_sdpa(
    query,
    key,
    value,
    attn_mask=None,
    dropout_p=0.0,
    is_causal=False,
    *,
    scale=None,
    enable_gqa=False,
    causal_alignment="top_left",
    cu_seqlens_q=None,
    cu_seqlens_k=None,
):
    _no_packed(cu_seqlens_q, cu_seqlens_k)
    out, _ = _attention(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, causal_alignment)
    return out


@torch._dynamo.substitute_in_graph(_attn.attention_with_lse)
def _compiled_attention_with_lse(
    query,
    key,
    value,
    attn_mask=None,
    dropout_p=0.0,
    is_causal=False,
    *,
    scale=None,
    enable_gqa=False,
    causal_alignment="top_left",
    cu_seqlens_q=None,
    cu_seqlens_k=None,
):
    _no_packed(cu_seqlens_q, cu_seqlens_k)
    return _attention(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, causal_alignment)


# ---------------------------------------------------------------------------------------
# Routing torch's own function to attn.

_TAKEN_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _fallback_reason(query, key, value, attn_mask, dropout_p):
    """Why attn does not take a call (``None`` when it does)."""
    for x in (query, key, value):
        if not isinstance(x, torch.Tensor):
            return f"operands of type {type(x).__name__}"
        if x.device.type not in ("cpu", "meta"):
            return f"tensors on {x.device.type}"
        if x.dtype not in _TAKEN_DTYPES:
            return f"dtype {x.dtype}"
    if dropout_p != 0.0:
        return "dropout (dropout_p != 0)"
    if attn_mask is not None and isinstance(attn_mask, torch.Tensor) and attn_mask.requires_grad:
        return "a mask that requires grad"
    return None


@contextlib.contextmanager
def routing():
    """Within the block, ``torch.nn.functional.scaled_dot_product_attention`` is attn's
    (through the operator ``attn::sdpa_forward``: autograd, ``torch.compile``): code that
    calls torch's function — transformers' ``"sdpa"`` models, say — computes with attn
    unchanged::

        with attn.torch.routing():
            logits = model(input_ids).logits

    What attn does not take goes to torch's function, with one warning per reason and block:
    tensors not on the CPU, dtypes other than float32, float16 and bfloat16, ``dropout_p``
    other than 0, a mask that requires grad. attn's semantics hold for the rest (a fully
    masked row is 0, not NaN). The function is restored on leaving the block; blocks nest.
    The module attribute is swapped, so the routing holds for every thread meanwhile.
    """
    functional = torch.nn.functional
    original = functional.scaled_dot_product_attention
    warned = set()

    def routed(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        reason = _fallback_reason(query, key, value, attn_mask, dropout_p)
        if reason is not None:
            if reason not in warned:
                warned.add(reason)
                warnings.warn(
                    f"attn.torch.routing: attn does not take {reason}; torch's "
                    "scaled_dot_product_attention computes such calls",
                    stacklevel=2,
                )
            return original(
                query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                scale=scale, enable_gqa=enable_gqa,
            )
        return scaled_dot_product_attention(
            query, key, value, attn_mask, 0.0, is_causal, scale=scale, enable_gqa=enable_gqa
        )

    functional.scaled_dot_product_attention = routed
    try:
        yield
    finally:
        functional.scaled_dot_product_attention = original

"""attn for torch: ``scaled_dot_product_attention`` as a ``torch.autograd.Function``.

Importing this module needs torch (``import attn`` alone does not). The forward pass is
attn's, recording the output and the log-sum-exp; the backward pass is attn's too (dQ, dK,
dV recomputed from the LSE, accumulated in float32 and rounded once), so ``loss.backward()``
works::

    import torch, attn.torch
    q = torch.randn(2, 8, 128, 64, requires_grad=True)
    out = attn.torch.scaled_dot_product_attention(q, q, q, is_causal=True)
    out.sum().backward()

``attn.scaled_dot_product_attention`` sends torch tensors that require grad here by itself.
Differences from torch's function: those of ``attn.scaled_dot_product_attention``, and the
gradient of ``attn_mask`` is not computed (a mask that requires grad is a ValueError).
"""

import torch
from torch.autograd.function import once_differentiable

from . import _attn

__all__ = ["ScaledDotProductAttention", "scaled_dot_product_attention", "attention_with_lse"]


class ScaledDotProductAttention(torch.autograd.Function):
    """attn's attention as an autograd function.

    ``apply(query, key, value, attn_mask, is_causal, scale, enable_gqa, causal_alignment)``
    returns ``(out, lse)``; ``lse`` is not differentiable.
    """

    @staticmethod
    def forward(ctx, query, key, value, attn_mask, is_causal, scale, enable_gqa, causal_alignment):
        _check_tensors(query, key, value, attn_mask)
        if attn_mask is not None and attn_mask.requires_grad:
            raise ValueError(
                "attn_mask requires grad: attn does not compute the gradient of the mask "
                "(pass attn_mask.detach())"
            )
        mask = None if attn_mask is None else attn_mask.detach()
        out, lse = _attn.attention_with_lse(
            query.detach(),
            key.detach(),
            value.detach(),
            mask,
            0.0,
            is_causal,
            scale=scale,
            enable_gqa=enable_gqa,
            causal_alignment=causal_alignment,
        )
        ctx.save_for_backward(query, key, value, out, lse)
        ctx.mask = mask
        ctx.options = (is_causal, scale, enable_gqa, causal_alignment)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out, _grad_lse):
        query, key, value, out, lse = ctx.saved_tensors
        is_causal, scale, enable_gqa, causal_alignment = ctx.options
        dq, dk, dv = _attn.attention_backward(
            grad_out.detach().contiguous(),
            query.detach(),
            key.detach(),
            value.detach(),
            out.detach(),
            lse.detach(),
            ctx.mask,
            is_causal,
            scale=scale,
            enable_gqa=enable_gqa,
            causal_alignment=causal_alignment,
        )
        return dq, dk, dv, None, None, None, None, None


def _kind(x):
    if isinstance(x, torch.Tensor):
        return "a torch.Tensor"
    return "a NumPy array" if type(x).__module__ == "numpy" else f"a {type(x).__name__}"


def _check_tensors(query, key, value, attn_mask):
    """The plain path's TypeError for operands that are not all torch tensors (this
    function reads tensors only)."""
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


def _autograd_attention(query, key, value, attn_mask, is_causal, scale, enable_gqa, causal_alignment, with_lse):
    """The route of ``attn.scaled_dot_product_attention`` for tensors that require grad."""
    out, lse = ScaledDotProductAttention.apply(
        query, key, value, attn_mask, is_causal, scale, enable_gqa, causal_alignment
    )
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
    """``torch.nn.functional.scaled_dot_product_attention``, differentiable, by attn.

    The arguments and the differences from torch are those of
    ``attn.scaled_dot_product_attention``; the gradient of ``attn_mask`` is not computed.
    """
    _check_dropout(dropout_p)
    out, _ = ScaledDotProductAttention.apply(
        query, key, value, attn_mask, is_causal, scale, enable_gqa, causal_alignment
    )
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
    _check_dropout(dropout_p)
    return ScaledDotProductAttention.apply(
        query, key, value, attn_mask, is_causal, scale, enable_gqa, causal_alignment
    )

"""attn for torch: ``scaled_dot_product_attention`` as ``torch.library`` custom operators.

Importing this module needs torch (``import attn`` alone does not). It registers two
operators, with fake (meta) implementations that compute shapes only and the autograd
formula between them, so that ``torch.compile`` (``fullgraph=True``), ``torch.export`` and
meta or fake tensors see attn as one opaque node::

    torch.ops.attn.sdpa_forward(query, key, value, attn_mask, dropout_p, is_causal, scale,
                                enable_gqa, causal_alignment, seed=None) -> (out, lse)
    torch.ops.attn.sdpa_backward(grad_out, query, key, value, out, lse, attn_mask,
                                 is_causal, scale, enable_gqa, causal_alignment,
                                 dropout_p=0.0, seed=None)
        -> (grad_query, grad_key, grad_value)
    torch.ops.attn.sdpa_backward_mask(...)   # the same arguments, attn_mask required
        -> (grad_query, grad_key, grad_value, grad_mask)

The forward pass is attn's, recording the output and the log-sum-exp; the backward pass is
attn's too (dQ, dK, dV recomputed from the LSE, accumulated in float32 and rounded once), so
``loss.backward()`` works::

    import torch, attn.torch
    q = torch.randn(2, 8, 128, 64, requires_grad=True)
    out = attn.torch.scaled_dot_product_attention(q, q, q, is_causal=True)
    out.sum().backward()

``attn.scaled_dot_product_attention`` sends torch tensors that require grad here by itself.
Meta and fake tensors given to ``attn.scaled_dot_product_attention`` come here too.
Differences from torch's function: those of ``attn.scaled_dot_product_attention``.

An additive (float) ``attn_mask`` that requires grad gets its gradient, as in torch (a
learnable bias: T5's relative positions, a key-padding bias): the autograd formula calls
``sdpa_backward_mask``, whose ``grad_mask`` is ``dS`` (the gradient of the scores the softmax
sees, after the mask; 0 at hidden entries: ``-inf``, causal, or a row that sees no key)
summed over the axes along which the mask broadcasts, shaped and typed like the mask as
passed. A view that repeats values (an ``expand``, stride 0) gets each position's own
gradient (torch's autograd then sums them into the base); a mask constant along the key
axis (``(..., L, 1)``) is differentiated as broadcast to the keys and summed back. Sums run
in a fixed order: the bits do not depend on the thread count. A boolean mask has none.

Dropout (``dropout_p > 0``) is torch's: each weight after the softmax kept with probability
``1 - p`` and scaled by ``1/(1 - p)``. Its mask is a pure function of a 64-bit seed (and of
the batch entry, head, query and key), so the backward operator regenerates the forward's:
``seed`` is a 0-d int64 tensor (its bits the seed), which the operators take as an input
and the autograd formula hands from the forward to the backward. The functions here draw it
from torch's default CPU generator (``torch.randint``, one draw per call: ``torch.manual_seed``
reproduces a run, successive calls differ; under ``torch.compile`` the draw is a node of the
graph) unless ``seed=`` is given (an int or an integer tensor). The operators themselves
draw nothing: ``dropout_p > 0`` without a seed is a ValueError there.
"""

import contextlib
import operator
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
    """torch's check (and message) of a dropout probability."""
    if not 0.0 <= dropout_p <= 1.0:
        raise ValueError(f"dropout probability has to be between 0 and 1, but got {float(dropout_p)!r}")


def _check_seed(dropout_p, seed):
    _check_dropout(dropout_p)
    if dropout_p > 0.0 and seed is None:
        raise ValueError(
            f"dropout_p={dropout_p} without a seed: the operators take the seed as a 0-d int64 tensor "
            "(attn.torch's functions draw one)"
        )


_SEED_LOW, _SEED_HIGH = -(2**63), 2**63 - 1


def _draw_seed():
    """One 64-bit seed from torch's default CPU generator: a 0-d int64 tensor (its bits the
    seed). ``attn.scaled_dot_product_attention`` draws the same way for torch tensors."""
    return torch.randint(_SEED_LOW, _SEED_HIGH, (), dtype=torch.int64)


def _seed_tensor(seed):
    """The caller's seed as the operators take it: a 0-d int64 tensor on the CPU."""
    if isinstance(seed, torch.Tensor):
        if seed.numel() != 1 or seed.dtype.is_floating_point or seed.dtype.is_complex or seed.dtype == torch.bool:
            raise TypeError(f"seed must be an integer or a one-element integer tensor, not a {seed.dtype} tensor of shape {tuple(seed.shape)}")
        return seed.reshape(()).to(device="cpu", dtype=torch.int64)
    try:
        value = operator.index(seed)
    except TypeError:
        raise TypeError(f"seed must be an integer, not {type(seed).__name__}") from None
    if not -(2**63) <= value < 2**64:
        raise ValueError(f"seed={value}: a 64-bit seed is an integer from -2**63 to 2**64 - 1")
    if value >= 2**63:
        value -= 2**64  # the same bits as an int64
    return torch.tensor(value, dtype=torch.int64)


def _seed_int(seed):
    return None if seed is None else int(seed)


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
    seed: Optional[Tensor] = None,
) -> tuple[Tensor, Tensor]:
    """attn's forward pass: ``(out, lse)``, ``lse`` float32 ``(..., L)`` (the undropped
    softmax's). With ``dropout_p > 0``, ``seed`` (a 0-d int64 tensor) keys the mask."""
    _check_seed(dropout_p, seed)
    return _attn.attention_with_lse(
        query.detach(),
        key.detach(),
        value.detach(),
        None if attn_mask is None else attn_mask.detach(),
        dropout_p,
        is_causal,
        scale=scale,
        enable_gqa=enable_gqa,
        causal_alignment=causal_alignment,
        seed=_seed_int(seed),
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
def _sdpa_forward_fake(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, causal_alignment, seed=None):
    _check_seed(dropout_p, seed)
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
    dropout_p: float = 0.0,
    seed: Optional[Tensor] = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """attn's backward pass: ``(dq, dk, dv)``, shaped and typed like the operands. With
    ``dropout_p > 0``, ``seed`` must be the forward's: the mask is regenerated from it."""
    _check_seed(dropout_p, seed)
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
        dropout_p=dropout_p,
        seed=_seed_int(seed),
    )


@sdpa_backward.register_fake
def _sdpa_backward_fake(
    grad_out, query, key, value, out, lse, attn_mask, is_causal, scale, enable_gqa, causal_alignment,
    dropout_p=0.0, seed=None,
):
    _check_seed(dropout_p, seed)
    return (
        query.new_empty(query.shape),
        key.new_empty(key.shape),
        value.new_empty(value.shape),
    )


@torch.library.custom_op("attn::sdpa_backward_mask", mutates_args=())
def sdpa_backward_mask(
    grad_out: Tensor,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    out: Tensor,
    lse: Tensor,
    attn_mask: Tensor,
    is_causal: bool,
    scale: Optional[float],
    enable_gqa: bool,
    causal_alignment: str,
    dropout_p: float = 0.0,
    seed: Optional[Tensor] = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``sdpa_backward`` with the gradient of the additive float mask too: ``(dq, dk, dv,
    dmask)``, ``dmask`` shaped and typed like ``attn_mask`` as passed (summed over the axes
    it broadcasts along; each position of a view that repeats values, stride 0, its own)."""
    _check_seed(dropout_p, seed)
    return _attn.attention_backward(
        grad_out.detach().contiguous(),
        query.detach(),
        key.detach(),
        value.detach(),
        out.detach(),
        lse.detach(),
        attn_mask.detach(),
        is_causal,
        scale=scale,
        enable_gqa=enable_gqa,
        causal_alignment=causal_alignment,
        dropout_p=dropout_p,
        seed=_seed_int(seed),
        mask_grad=True,
    )


@sdpa_backward_mask.register_fake
def _sdpa_backward_mask_fake(
    grad_out, query, key, value, out, lse, attn_mask, is_causal, scale, enable_gqa, causal_alignment,
    dropout_p=0.0, seed=None,
):
    _check_seed(dropout_p, seed)
    if attn_mask.dtype == torch.bool:
        raise ValueError("sdpa_backward_mask with a boolean attn_mask: only an additive float mask has a gradient")
    return (
        query.new_empty(query.shape),
        key.new_empty(key.shape),
        value.new_empty(value.shape),
        attn_mask.new_empty(attn_mask.shape),
    )


def _setup_context(ctx, inputs, output):
    query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, causal_alignment = inputs[:9]
    seed = inputs[9] if len(inputs) > 9 else None
    out, lse = output
    # The seed goes to the backward pass: it regenerates the forward's dropout mask.
    ctx.save_for_backward(query, key, value, out, lse, attn_mask, seed)
    ctx.options = (is_causal, scale, enable_gqa, causal_alignment, dropout_p)
    ctx.mark_non_differentiable(lse)


_NO_GRADS = (None,) * 6  # dropout_p, is_causal, scale, enable_gqa, causal_alignment, seed


def _backward(ctx, grad_out, _grad_lse):
    query, key, value, out, lse, attn_mask, seed = ctx.saved_tensors
    needs = ctx.needs_input_grad[:4]
    if not any(needs):
        return (None, None, None, None, *_NO_GRADS)
    if needs[3]:
        # The additive mask requires grad: the backward operator that returns its gradient.
        dq, dk, dv, dmask = sdpa_backward_mask(
            grad_out, query, key, value, out, lse, attn_mask, *ctx.options, seed
        )
    else:
        dq, dk, dv = sdpa_backward(grad_out, query, key, value, out, lse, attn_mask, *ctx.options, seed)
        dmask = None
    return (
        dq if needs[0] else None,
        dk if needs[1] else None,
        dv if needs[2] else None,
        dmask,
        *_NO_GRADS,
    )


sdpa_forward.register_autograd(_backward, setup_context=_setup_context)


# ---------------------------------------------------------------------------------------
# The calls.


def _attention(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, causal_alignment, seed=None):
    _check_tensors(query, key, value, attn_mask)
    dropout_p = float(dropout_p)
    _check_dropout(dropout_p)
    if scale is not None:
        scale = float(scale)
    # One seed per call with dropout: the caller's, or a draw from torch's default generator.
    seed = None if dropout_p == 0.0 else _draw_seed() if seed is None else _seed_tensor(seed)
    return sdpa_forward(
        query, key, value, attn_mask, dropout_p, bool(is_causal), scale, bool(enable_gqa), causal_alignment, seed
    )


class ScaledDotProductAttention:
    """The former ``torch.autograd.Function``, kept for its callers: ``apply(query, key,
    value, attn_mask, is_causal, scale, enable_gqa, causal_alignment)`` returns
    ``(out, lse)`` through the operator ``attn::sdpa_forward``; ``lse`` is not
    differentiable."""

    @staticmethod
    def apply(query, key, value, attn_mask, is_causal, scale, enable_gqa, causal_alignment):
        return _attention(query, key, value, attn_mask, 0.0, is_causal, scale, enable_gqa, causal_alignment)


def _autograd_attention(
    query, key, value, attn_mask, is_causal, scale, enable_gqa, causal_alignment, with_lse, dropout_p=0.0, seed=None
):
    """The route of ``attn.scaled_dot_product_attention`` for torch tensors that require
    grad, and for those the plain path cannot read in place (meta tensors, tensor
    subclasses such as fake tensors)."""
    out, lse = _attention(
        query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, causal_alignment, seed
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
    seed=None,
):
    """``torch.nn.functional.scaled_dot_product_attention``, differentiable, by attn, through
    the operator ``attn::sdpa_forward`` (so ``torch.compile`` and ``torch.export`` take it
    whole).

    The arguments and the differences from torch are those of
    ``attn.scaled_dot_product_attention``; an additive ``attn_mask`` that requires grad gets
    its gradient (see the module's docstring).
    ``dropout_p > 0`` drops weights as torch does, keyed by ``seed`` (an int, or drawn from
    torch's default generator: see the module's docstring); the backward pass drops the same.
    """
    out, _ = _attention(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, causal_alignment, seed)
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
    seed=None,
):
    """``(out, lse)`` as ``attn.attention_with_lse``, with ``out`` differentiable."""
    return _attention(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, causal_alignment, seed)


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
    seed=None,
    cu_seqlens_q=None,
    cu_seqlens_k=None,
):
    _no_packed(cu_seqlens_q, cu_seqlens_k)
    out, _ = _attention(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, causal_alignment, seed)
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
    seed=None,
    cu_seqlens_q=None,
    cu_seqlens_k=None,
):
    _no_packed(cu_seqlens_q, cu_seqlens_k)
    return _attention(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, causal_alignment, seed)


# ---------------------------------------------------------------------------------------
# Routing torch's own function to attn.

_TAKEN_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _fallback_reason(query, key, value, attn_mask):
    """Why attn does not take a call (``None`` when it does)."""
    for x in (query, key, value):
        if not isinstance(x, torch.Tensor):
            return f"operands of type {type(x).__name__}"
        if x.device.type not in ("cpu", "meta"):
            return f"tensors on {x.device.type}"
        if x.dtype not in _TAKEN_DTYPES:
            return f"dtype {x.dtype}"
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
    tensors not on the CPU, dtypes other than float32, float16 and bfloat16 (a mask that
    requires grad is attn's: its gradient is computed). attn's semantics hold for the rest (a fully masked row is 0, not NaN;
    ``dropout_p > 0`` is attn's dropout, its seed drawn from torch's default generator, so a
    model in ``train()`` mode keeps its attention dropout). The function is restored on
    leaving the block; blocks nest.
    The module attribute is swapped, so the routing holds for every thread meanwhile.
    """
    functional = torch.nn.functional
    original = functional.scaled_dot_product_attention
    warned = set()

    def routed(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        reason = _fallback_reason(query, key, value, attn_mask)
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
            query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa
        )

    functional.scaled_dot_product_attention = routed
    try:
        yield
    finally:
        functional.scaled_dot_product_attention = original

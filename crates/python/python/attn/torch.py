"""attn for torch: ``scaled_dot_product_attention`` as ``torch.library`` operators.

Importing this module needs torch (``import attn`` alone does not). It registers three
operators, with fake (meta) implementations that compute shapes only and the autograd
formula between them, so that ``torch.compile`` (``fullgraph=True``), ``torch.export`` and
meta or fake tensors see attn as one opaque node::

    torch.ops.attn.sdpa_forward(query, key, value, attn_mask, dropout_p, is_causal, scale,
                                enable_gqa, causal_alignment, seed=None,
                                cu_seqlens_q=None, cu_seqlens_k=None) -> (out, lse)
    torch.ops.attn.sdpa_backward(grad_out, query, key, value, out, lse, attn_mask,
                                 is_causal, scale, enable_gqa, causal_alignment,
                                 dropout_p=0.0, seed=None,
                                 cu_seqlens_q=None, cu_seqlens_k=None)
        -> (grad_query, grad_key, grad_value)
    torch.ops.attn.sdpa_backward_mask(...)   # no cu_seqlens, attn_mask required
        -> (grad_query, grad_key, grad_value, grad_mask)

Their CPU kernels are the extension's functions themselves, and their autograd kernel calls
the CPU kernel directly when nothing needs a graph: an operator call costs the dispatcher's
one Python call over the plain function's (``bench/op_overhead.py`` measures it). A packed
batch (``cu_seqlens_q``, ``cu_seqlens_k``: flash-attn's varlen layout, ``query
(total_q, Hq, E)``, ``lse (Hq, total_q)``) is the same operators with the offsets as
integer tensors, so packed calls train and compile too. attn has no second derivative: a
double backward through the backward operators is a RuntimeError.

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
import functools
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
            raise _attn.InputTypeError(
                f"query is {_kind(query)} but {name} is {_kind(x)}: pass torch tensors together, "
                "or NumPy arrays together"
            )
    if not isinstance(query, torch.Tensor):
        raise _attn.InputTypeError(f"attn.torch computes on torch tensors: query is {_kind(query)}")


def _check_dropout(dropout_p):
    """torch's check (and message) of a dropout probability."""
    if not 0.0 <= dropout_p <= 1.0:
        raise _attn.InputError(f"dropout probability has to be between 0 and 1, but got {float(dropout_p)!r}")


def _check_seed(dropout_p, seed):
    _check_dropout(dropout_p)
    if dropout_p > 0.0 and seed is None:
        raise _attn.InputError(
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
            raise _attn.InputTypeError(
                f"seed must be an integer or a one-element integer tensor, not a {seed.dtype} tensor of shape {tuple(seed.shape)}"
            )
        return seed.reshape(()).to(device="cpu", dtype=torch.int64)
    try:
        value = operator.index(seed)
    except TypeError:
        raise _attn.InputTypeError(f"seed must be an integer, not {type(seed).__name__}") from None
    if not -(2**63) <= value < 2**64:
        raise _attn.InputError(f"seed={value}: a 64-bit seed is an integer from -2**63 to 2**64 - 1")
    if value >= 2**63:
        value -= 2**64  # the same bits as an int64
    return torch.tensor(value, dtype=torch.int64)


def _seed_int(seed):
    return None if seed is None else int(seed)


# ---------------------------------------------------------------------------------------
# The operators.
#
# Defined through torch.library's Library directly rather than the custom_op decorator:
# the decorator's kernels are Python layers around the function (a backend wrapper that
# checks aliasing, an autograd kernel that redispatches), each costing microseconds a call.
# Here the CPU kernels are the extension's own functions (`_attn.sdpa_*_kernel`, called by
# the dispatcher with the schema's arguments), and the autograd kernel, the one Python
# layer, calls the CPU kernel itself when nothing needs a graph and no mode or tracer is
# below it.

_lib = torch.library.Library("attn", "DEF")
_PT2 = (torch.Tag.pt2_compliant_tag,)
_lib.define(
    "sdpa_forward(Tensor query, Tensor key, Tensor value, Tensor? attn_mask, float dropout_p, "
    "bool is_causal, float? scale, bool enable_gqa, str causal_alignment, Tensor? seed=None, "
    "Tensor? cu_seqlens_q=None, Tensor? cu_seqlens_k=None) -> (Tensor, Tensor)",
    tags=_PT2,
)
_lib.define(
    "sdpa_backward(Tensor grad_out, Tensor query, Tensor key, Tensor value, Tensor out, Tensor lse, "
    "Tensor? attn_mask, bool is_causal, float? scale, bool enable_gqa, str causal_alignment, "
    "float dropout_p=0.0, Tensor? seed=None, Tensor? cu_seqlens_q=None, Tensor? cu_seqlens_k=None) "
    "-> (Tensor, Tensor, Tensor)",
    tags=_PT2,
)
_lib.define(
    "sdpa_backward_mask(Tensor grad_out, Tensor query, Tensor key, Tensor value, Tensor out, "
    "Tensor lse, Tensor attn_mask, bool is_causal, float? scale, bool enable_gqa, "
    "str causal_alignment, float dropout_p=0.0, Tensor? seed=None) -> (Tensor, Tensor, Tensor, Tensor)",
    tags=_PT2,
)

#: ``attn::sdpa_forward``: ``(out, lse)``, ``lse`` float32 ``(..., L)`` (the undropped
#: softmax's; ``(Hq, total_q)`` for a packed call). With ``dropout_p > 0``, ``seed`` (a 0-d
#: int64 tensor) keys the mask.
sdpa_forward = torch.ops.attn.sdpa_forward.default
#: ``attn::sdpa_backward``: ``(dq, dk, dv)``, shaped and typed like the operands. With
#: ``dropout_p > 0``, ``seed`` must be the forward's: the mask is regenerated from it.
sdpa_backward = torch.ops.attn.sdpa_backward.default
#: ``attn::sdpa_backward_mask``: ``sdpa_backward`` with the gradient of the additive float
#: mask too, ``(dq, dk, dv, dmask)``, ``dmask`` shaped and typed like ``attn_mask`` as passed
#: (summed over the axes it broadcasts along; each position of a view that repeats values,
#: stride 0, its own).
sdpa_backward_mask = torch.ops.attn.sdpa_backward_mask.default

_BELOW_AUTOGRAD = torch._C._after_autograd_keyset
_CPU = torch._C.DispatchKey.CPU


def _below_autograd(op, kernel, keyset, args):
    """The call below autograd: the CPU kernel itself when it is next (eager CPU tensors, no
    mode), else a redispatch (meta and fake tensors, functionalization, tracing)."""
    below = keyset & _BELOW_AUTOGRAD
    if below.highestPriorityTypeId() == _CPU:
        return kernel(*args)
    with torch._C._AutoDispatchBelowAutograd():
        return op.redispatch(below, *args)


class _Forward(torch.autograd.Function):
    """The forward operator's autograd formula: saves what the backward operator reads (the
    seed among it: the backward pass regenerates the forward's dropout mask)."""

    @staticmethod
    def forward(ctx, keyset, *args):
        with torch._C._AutoDispatchBelowAutograd():
            out, lse = sdpa_forward.redispatch(keyset & _BELOW_AUTOGRAD, *args)
        query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, causal_alignment = args[:9]
        seed, cu_seqlens_q, cu_seqlens_k = (*args[9:], None, None, None)[:3]
        ctx.save_for_backward(query, key, value, out, lse, attn_mask, seed, cu_seqlens_q, cu_seqlens_k)
        ctx.options = (is_causal, scale, enable_gqa, causal_alignment, dropout_p)
        ctx.arity = len(args)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, _grad_lse):
        query, key, value, out, lse, attn_mask, seed, cu_seqlens_q, cu_seqlens_k = ctx.saved_tensors
        needs = ctx.needs_input_grad[1:5]  # query, key, value, attn_mask
        grads = [None] * (1 + ctx.arity)  # the keyset first, then the operator's arguments
        if not any(needs):
            return tuple(grads)
        if needs[3]:
            # The additive mask requires grad: the backward operator that returns its gradient.
            dq, dk, dv, grads[4] = sdpa_backward_mask(
                grad_out, query, key, value, out, lse, attn_mask, *ctx.options, seed
            )
        else:
            dq, dk, dv = sdpa_backward(
                grad_out, query, key, value, out, lse, attn_mask, *ctx.options, seed, cu_seqlens_q, cu_seqlens_k
            )
        for i, (g, need) in enumerate(zip((dq, dk, dv), needs)):
            grads[1 + i] = g if need else None
        return tuple(grads)


class _NotTwice(torch.autograd.Function):
    """The backward operators' autograd: their results carry a node that refuses a second
    derivative (attn has no double backward), instead of silently having none."""

    @staticmethod
    def forward(ctx, op, keyset, *args):
        with torch._C._AutoDispatchBelowAutograd():
            return op.redispatch(keyset & _BELOW_AUTOGRAD, *args)

    @staticmethod
    def backward(ctx, *grads):
        raise RuntimeError(
            "attn's backward operators have no derivative of their own: a second derivative "
            "(double backward) of attention is not supported"
        )


def _autograd_kernel(op, kernel, with_graph):
    """``op``'s autograd kernel: ``with_graph(keyset, *args)`` (an autograd function's
    ``apply``) when an input requires grad under grad mode, else the call below autograd."""

    def autograd_kernel(keyset, *args):
        if torch.is_grad_enabled() and torch._C._any_requires_grad(*args):
            return with_graph(keyset, *args)
        return _below_autograd(op, kernel, keyset, args)

    return autograd_kernel


def _not_twice(op):
    return lambda keyset, *args: _NotTwice.apply(op, keyset, *args)


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


def _check_packed(query, key, value, attn_mask, cu_seqlens_q, cu_seqlens_k, enable_gqa):
    """What the CPU kernel refuses in a packed call, refused by shapes alone (so that a traced
    graph fails where eager would)."""
    if cu_seqlens_q is None or cu_seqlens_k is None:
        raise _attn.InputError("cu_seqlens_q and cu_seqlens_k go together: pass both or neither")
    if attn_mask is not None:
        raise _attn.InputError("a packed call (cu_seqlens) takes no element-wise mask: attn_mask must be None")
    for name, x in (("query", query), ("key", key), ("value", value)):
        if x.dim() != 3:
            raise _attn.InputError(f"{name} of a packed call has {x.dim()} axes: (total, heads, features) has 3")
    for name, x in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if x.dim() != 1 or x.shape[0] < 1:
            raise _attn.InputError(f"{name} must be 1-D with batch + 1 offsets, not of shape {tuple(x.shape)}")
    if cu_seqlens_q.shape[0] != cu_seqlens_k.shape[0]:
        raise _attn.InputError("cu_seqlens_q and cu_seqlens_k must hold as many offsets (batch + 1 each)")
    hq, hk = query.shape[1], key.shape[1]
    if value.shape[1] != hk or key.shape[0] != value.shape[0] or query.shape[2] != key.shape[2]:
        raise _attn.InputError(
            f"packed key {tuple(key.shape)} and value {tuple(value.shape)} do not match each other or "
            f"query {tuple(query.shape)}"
        )
    if hq != hk and (not enable_gqa or hk == 0 or hq % hk != 0):
        raise _attn.InputError(
            f"query has {hq} heads and key {hk}: pass enable_gqa=True with a count that divides the query's"
        )


def _sdpa_forward_fake(
    query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, causal_alignment,
    seed=None, cu_seqlens_q=None, cu_seqlens_k=None,
):
    _check_seed(dropout_p, seed)
    if cu_seqlens_q is not None or cu_seqlens_k is not None:
        _check_packed(query, key, value, attn_mask, cu_seqlens_q, cu_seqlens_k, enable_gqa)
        # A packed call: query (total_q, Hq, E), value (total_k, Hkv, Ev).
        total_q, heads = query.shape[0], query.shape[1]
        return query.new_empty((total_q, heads, value.shape[-1])), query.new_empty(
            (heads, total_q), dtype=torch.float32
        )
    lead = _batch_shape(query, key, value, enable_gqa)
    n_q = query.shape[-2]
    out = query.new_empty((*lead, n_q, value.shape[-1]))
    lse = query.new_empty((*lead, n_q), dtype=torch.float32)
    return out, lse


def _sdpa_backward_fake(
    grad_out, query, key, value, out, lse, attn_mask, is_causal, scale, enable_gqa, causal_alignment,
    dropout_p=0.0, seed=None, cu_seqlens_q=None, cu_seqlens_k=None,
):
    _check_seed(dropout_p, seed)
    return (
        query.new_empty(query.shape),
        key.new_empty(key.shape),
        value.new_empty(value.shape),
    )


def _sdpa_backward_mask_fake(
    grad_out, query, key, value, out, lse, attn_mask, is_causal, scale, enable_gqa, causal_alignment,
    dropout_p=0.0, seed=None,
):
    _check_seed(dropout_p, seed)
    if attn_mask.dtype == torch.bool:
        raise _attn.InputError("sdpa_backward_mask with a boolean attn_mask: only an additive float mask has a gradient")
    return (
        query.new_empty(query.shape),
        key.new_empty(key.shape),
        value.new_empty(value.shape),
        attn_mask.new_empty(attn_mask.shape),
    )


def _register(lib, op, kernel, fake, with_graph):
    """Registers ``op``'s kernels in ``lib``: ``kernel`` for CPU tensors, ``fake`` for meta and
    fake tensors, and the autograd kernel (``with_graph`` when a graph is needed)."""
    name = op._schema.name.split("::")[1]
    lib.impl(name, kernel, "CPU")
    lib.impl(name, _autograd_kernel(op, kernel, with_graph), "Autograd", with_keyset=True)
    torch.library.register_fake(op._schema.name, fake, lib=lib)


_register(_lib, sdpa_forward, _attn.sdpa_forward_kernel, _sdpa_forward_fake, _Forward.apply)
_register(_lib, sdpa_backward, _attn.sdpa_backward_kernel, _sdpa_backward_fake, _not_twice(sdpa_backward))
_register(
    _lib,
    sdpa_backward_mask,
    functools.partial(_attn.sdpa_backward_kernel, mask_grad=True),
    _sdpa_backward_mask_fake,
    _not_twice(sdpa_backward_mask),
)


# ---------------------------------------------------------------------------------------
# The calls.


def _offsets(cu_seqlens):
    """A packed call's offsets as the operator takes them: an integer tensor."""
    if cu_seqlens is None or isinstance(cu_seqlens, torch.Tensor):
        return cu_seqlens
    return torch.as_tensor(cu_seqlens, dtype=torch.int64)


def _attention(
    query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, causal_alignment, seed=None,
    cu_seqlens_q=None, cu_seqlens_k=None,
):
    _check_tensors(query, key, value, attn_mask)
    dropout_p = float(dropout_p)
    _check_dropout(dropout_p)
    if scale is not None:
        scale = float(scale)
    # One seed per call with dropout: the caller's, or a draw from torch's default generator.
    seed = None if dropout_p == 0.0 else _draw_seed() if seed is None else _seed_tensor(seed)
    if cu_seqlens_q is None and cu_seqlens_k is None:
        return sdpa_forward(
            query, key, value, attn_mask, dropout_p, bool(is_causal), scale, bool(enable_gqa), causal_alignment, seed
        )
    return sdpa_forward(
        query, key, value, attn_mask, dropout_p, bool(is_causal), scale, bool(enable_gqa), causal_alignment, seed,
        _offsets(cu_seqlens_q), _offsets(cu_seqlens_k),
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
    query, key, value, attn_mask, is_causal, scale, enable_gqa, causal_alignment, with_lse, dropout_p=0.0, seed=None,
    cu_seqlens_q=None, cu_seqlens_k=None,
):
    """The route of ``attn.scaled_dot_product_attention`` for torch tensors that require
    grad, and for those the plain path cannot read in place (meta tensors, tensor
    subclasses such as fake tensors)."""
    out, lse = _attention(
        query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, causal_alignment, seed,
        cu_seqlens_q, cu_seqlens_k,
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
    cu_seqlens_q=None,
    cu_seqlens_k=None,
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
    out, _ = _attention(
        query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, causal_alignment, seed,
        cu_seqlens_q, cu_seqlens_k,
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
    seed=None,
    cu_seqlens_q=None,
    cu_seqlens_k=None,
):
    """``(out, lse)`` as ``attn.attention_with_lse``, with ``out`` differentiable."""
    return _attention(
        query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, causal_alignment, seed,
        cu_seqlens_q, cu_seqlens_k,
    )


# ---------------------------------------------------------------------------------------
# torch.compile of the plain entry points: dynamo cannot trace into the extension's
# functions, so it is given these in their place (same signatures), which call the operator.


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
    out, _ = _attention(
        query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, causal_alignment, seed,
        cu_seqlens_q, cu_seqlens_k,
    )
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
    return _attention(
        query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, causal_alignment, seed,
        cu_seqlens_q, cu_seqlens_k,
    )


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

"""The float64 NumPy formula the tests compare attn with, and the cases they share.

``sdpa`` is torch's ``scaled_dot_product_attention`` written out (its documented reference
implementation) with attn's rule for rows that see no key: output 0 and LSE ``-inf``
instead of NaN. ``sdpa_backward`` is its gradient. ``CASES`` are the calls that the NumPy
tests (test_sdpa.py) and the torch tests (test_torch.py) both run.
"""

import math

import numpy as np


def _expand_heads(x, heads, enable_gqa):
    """torch's ``repeat_interleave`` of key/value heads under ``enable_gqa``."""
    if x.ndim < 3 or not enable_gqa or x.shape[-3] == heads:
        return x
    return np.repeat(x, heads // x.shape[-3], axis=-3)


def visible(l, s, is_causal, alignment, mask):
    """The boolean ``(…, L, S)`` visibility and the float bias of a call."""
    allow = np.ones((l, s), dtype=bool)
    if is_causal:
        offset = 0 if alignment == "top_left" else s - l
        allow = np.tril(allow, k=offset)
    bias = np.zeros((l, s))
    if mask is not None:
        if mask.dtype == np.bool_:
            allow = allow & mask
        else:
            bias = bias + mask.astype(np.float64)
    return allow, bias


def sdpa(q, k, v, mask=None, is_causal=False, scale=None, enable_gqa=False, alignment="top_left"):
    """``(out, lse)`` in float64."""
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    if q.ndim >= 3:
        k = _expand_heads(k, q.shape[-3], enable_gqa)
        v = _expand_heads(v, q.shape[-3], enable_gqa)
    l, s = q.shape[-2], k.shape[-2]
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = np.matmul(q, np.swapaxes(k, -1, -2)) * scale
    allow, bias = visible(l, s, is_causal, alignment, mask)
    scores = scores + bias
    allow = np.broadcast_to(allow, scores.shape) & (scores != -np.inf)
    scores = np.where(allow, scores, -np.inf)
    with np.errstate(invalid="ignore"):
        top = np.max(scores, axis=-1, keepdims=True) if s > 0 else np.full(scores.shape[:-1] + (1,), -np.inf)
        empty = ~np.isfinite(top)
        weights = np.where(allow, np.exp(scores - np.where(empty, 0.0, top)), 0.0)
        total = weights.sum(axis=-1, keepdims=True)
        p = np.where(empty, 0.0, weights / np.where(empty, 1.0, total))
        lse = np.where(empty, -np.inf, top + np.log(np.where(empty, 1.0, total)))[..., 0]
    out = np.matmul(p, v) if s > 0 else np.zeros(p.shape[:-1] + (v.shape[-1],))
    return out, lse


def _sum_to(x, shape):
    """Sums a broadcast gradient down to an operand's shape."""
    while x.ndim > len(shape):
        x = x.sum(axis=0)
    for a, n in enumerate(shape):
        if n == 1 and x.shape[a] != 1:
            x = x.sum(axis=a, keepdims=True)
    return x


def _sum_groups(g, kv, heads):
    """The gradient of ``repeat_interleave``: each kv head sums its group of query heads."""
    if kv in (1, heads):
        return g
    return g.reshape(g.shape[:-3] + (kv, heads // kv) + g.shape[-2:]).sum(axis=-3)


def sdpa_backward(grad_out, q, k, v, mask=None, is_causal=False, scale=None, enable_gqa=False, alignment="top_left"):
    """``(dq, dk, dv)`` in float64, shaped like the operands."""
    q0, k0, v0 = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    q, k, v = q0, k0, v0
    heads = q.shape[-3] if q.ndim >= 3 else 1
    if q.ndim >= 3:
        k = _expand_heads(k, heads, enable_gqa)
        v = _expand_heads(v, heads, enable_gqa)
    l, s = q.shape[-2], k.shape[-2]
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    out, lse = sdpa(q0, k0, v0, mask, is_causal, scale, enable_gqa, alignment)
    do = np.asarray(grad_out, dtype=np.float64)
    allow, bias = visible(l, s, is_causal, alignment, mask)
    scores = np.matmul(q, np.swapaxes(k, -1, -2)) * scale + bias
    allow = np.broadcast_to(allow, scores.shape) & (scores != -np.inf)
    with np.errstate(invalid="ignore", over="ignore"):
        p = np.where(allow & np.isfinite(lse)[..., None], np.exp(scores - lse[..., None]), 0.0)
    dv = np.matmul(np.swapaxes(p, -1, -2), do)
    dp = np.matmul(do, np.swapaxes(v, -1, -2))
    d = (do * out).sum(axis=-1, keepdims=True)
    ds = p * (dp - d)
    dq = scale * np.matmul(ds, k)
    dk = scale * np.matmul(np.swapaxes(ds, -1, -2), q)
    if enable_gqa and q.ndim >= 3:
        # An operand without a head axis broadcast as one head.
        dk = _sum_groups(dk, k0.shape[-3] if k0.ndim >= 3 else 1, heads)
        dv = _sum_groups(dv, v0.shape[-3] if v0.ndim >= 3 else 1, heads)
    return _sum_to(dq, q0.shape), _sum_to(dk, k0.shape), _sum_to(dv, v0.shape)


def randn(rng, shape, dtype=np.float32):
    return rng.standard_normal(shape).astype(dtype)


def _case(name, q, k, v, mask=None, **kw):
    return {"name": name, "q": q, "k": k, "v": v, "mask": mask, **kw}


def cases():
    """The shared calls: ``name``, operand shapes and options, mask recipe."""
    return [
        _case("bhsd", (2, 3, 17, 16), (2, 3, 19, 16), (2, 3, 19, 8)),
        _case("2d", (5, 8), (7, 8), (7, 4)),
        _case("3d", (3, 6, 8), (3, 9, 8), (3, 9, 8)),
        _case("5d", (2, 2, 2, 5, 8), (2, 2, 2, 6, 8), (2, 2, 2, 6, 8)),
        _case("causal_square", (1, 2, 33, 16), (1, 2, 33, 16), (1, 2, 33, 16), is_causal=True),
        _case("causal_wide", (1, 2, 5, 16), (1, 2, 12, 16), (1, 2, 12, 16), is_causal=True),
        _case("causal_tall", (1, 2, 12, 16), (1, 2, 5, 16), (1, 2, 5, 16), is_causal=True),
        _case("scale", (1, 2, 7, 16), (1, 2, 9, 16), (1, 2, 9, 16), scale=0.3),
        _case("bool_shared", (2, 2, 9, 8), (2, 2, 11, 8), (2, 2, 11, 8), mask=("bool", (9, 11))),
        _case("bool_per_batch", (2, 2, 9, 8), (2, 2, 11, 8), (2, 2, 11, 8), mask=("bool", (2, 1, 9, 11))),
        _case("bool_per_head", (2, 3, 9, 8), (2, 3, 11, 8), (2, 3, 11, 8), mask=("bool", (1, 3, 9, 11))),
        _case("bool_full", (2, 3, 9, 8), (2, 3, 11, 8), (2, 3, 11, 8), mask=("bool", (2, 3, 9, 11))),
        _case("bool_keys", (2, 3, 9, 8), (2, 3, 11, 8), (2, 3, 11, 8), mask=("bool", (11,))),
        _case("bool_padding", (2, 3, 9, 8), (2, 3, 11, 8), (2, 3, 11, 8), mask=("bool", (2, 1, 1, 11))),
        _case("bool_rows", (2, 3, 9, 8), (2, 3, 11, 8), (2, 3, 11, 8), mask=("bool", (9, 1))),
        _case("bool_empty_rows", (1, 2, 6, 8), (1, 2, 7, 8), (1, 2, 7, 8), mask=("bool_empty_rows", (6, 7))),
        _case("float_shared", (2, 2, 9, 8), (2, 2, 11, 8), (2, 2, 11, 8), mask=("float", (9, 11))),
        _case("float_per_head", (2, 3, 9, 8), (2, 3, 11, 8), (2, 3, 11, 8), mask=("float", (3, 9, 11))),
        _case("float_full", (2, 3, 9, 8), (2, 3, 11, 8), (2, 3, 11, 8), mask=("float", (2, 3, 9, 11))),
        _case("float_neg_inf", (1, 2, 9, 8), (1, 2, 11, 8), (1, 2, 11, 8), mask=("float_inf", (9, 11))),
        _case("gqa", (2, 8, 7, 16), (2, 2, 9, 16), (2, 2, 9, 16), enable_gqa=True),
        _case("gqa_causal", (1, 6, 10, 16), (1, 3, 10, 16), (1, 3, 10, 16), enable_gqa=True, is_causal=True),
        _case("gqa_mask_per_head", (1, 4, 5, 8), (1, 2, 6, 8), (1, 2, 6, 8), enable_gqa=True, mask=("float", (4, 5, 6))),
        _case("mqa_broadcast", (2, 4, 5, 8), (2, 1, 6, 8), (2, 1, 6, 8)),
        _case("kv_heads_mixed", (1, 4, 5, 8), (1, 1, 6, 8), (1, 4, 6, 8)),
        _case("gqa_key_one_head", (1, 4, 5, 8), (1, 1, 6, 8), (1, 2, 6, 8), enable_gqa=True),
        _case("query_head_broadcast", (2, 1, 5, 8), (2, 3, 6, 8), (2, 3, 6, 8)),
        _case("5d_mask_outer", (2, 2, 2, 5, 8), (2, 2, 2, 6, 8), (2, 2, 2, 6, 4), mask=("bool", (2, 1, 1, 5, 6))),
        _case("5d_mask_batch_head", (2, 2, 2, 5, 8), (1, 2, 2, 6, 8), (2, 1, 2, 6, 8), mask=("float", (2, 2, 5, 6))),
        _case("batch_broadcast", (3, 2, 5, 8), (1, 2, 6, 8), (3, 2, 6, 8)),
        _case("rank_broadcast", (3, 2, 5, 8), (2, 6, 8), (2, 6, 8)),
        _case("decode", (1, 32, 1, 128), (1, 32, 16, 128), (1, 32, 16, 128)),
        _case("long", (1, 2, 300, 32), (1, 2, 700, 32), (1, 2, 700, 32), is_causal=True),
    ]


def make_mask(rng, recipe):
    if recipe is None:
        return None
    kind, shape = recipe
    if kind == "bool":
        m = rng.random(shape) < 0.7
        return m
    if kind == "bool_empty_rows":
        m = rng.random(shape) < 0.6
        m[1] = False
        m[4] = False
        return m
    if kind == "float":
        return rng.standard_normal(shape).astype(np.float32)
    if kind == "float_inf":
        m = rng.standard_normal(shape).astype(np.float32)
        m[rng.random(shape) < 0.3] = -np.inf
        m[2] = -np.inf
        return m
    raise ValueError(kind)


def inputs(case, seed=0, dtype=np.float32):
    rng = np.random.default_rng(seed)
    q = randn(rng, case["q"], dtype)
    k = randn(rng, case["k"], dtype)
    v = randn(rng, case["v"], dtype)
    return q, k, v, make_mask(rng, case["mask"])


def options(case):
    return {
        name: case[name]
        for name in ("is_causal", "scale", "enable_gqa")
        if name in case
    }

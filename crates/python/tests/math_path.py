"""torch's math path for ``scaled_dot_product_attention`` (its documented reference
implementation) with attn's dropout: the tests hand it attn's keep mask
(``attn.dropout_mask``) to check attn's dropout against it. Imports torch."""

import math

import torch

import attn
import attn.torch


def keep_mask(seed, dropout_p, lead, n_q, n_k, offset=0):
    """attn's keep mask of a call whose output has leading axes ``lead``: the head axis is
    the last, the axes before it flattened into batch entries (as attn's calls number
    them)."""
    lead = tuple(lead)
    heads = lead[-1] if lead else 1
    batch = math.prod(lead[:-1]) if lead else 1
    mask = attn.dropout_mask(seed, offset, (batch, heads, n_q, n_k), dropout_p)
    return torch.from_numpy(mask.reshape(lead + (n_q, n_k)))


def math_sdpa(
    query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False,
    *, keep=None, alignment="top_left",
):
    """``softmax(scale · Q Kᵀ + M) * keep / (1 − p) @ V`` in the operands' dtype, a row that
    sees no key 0 (attn's rule; torch's softmax gives NaN). With ``dropout_p > 0`` and no
    ``keep``, the seed is drawn as attn draws it for torch tensors (``attn.torch._draw_seed``,
    one ``torch.randint`` from the default generator) and ``keep`` is its mask."""
    if enable_gqa and query.dim() >= 3 and key.shape[-3] != query.shape[-3]:
        key = key.repeat_interleave(query.shape[-3] // key.shape[-3], dim=-3)
        value = value.repeat_interleave(query.shape[-3] // value.shape[-3], dim=-3)
    n_q, n_k = query.shape[-2], key.shape[-2]
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
    scores = query @ key.transpose(-1, -2) * scale
    allowed = torch.ones(n_q, n_k, dtype=torch.bool)
    if is_causal:
        allowed = allowed.tril(0 if alignment == "top_left" else n_k - n_q)
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            allowed = allowed & attn_mask
        else:
            scores = scores + attn_mask.to(scores.dtype)
    allowed = allowed & (scores != -math.inf)
    sees = allowed.any(dim=-1, keepdim=True)
    scores = torch.where(allowed, scores, -math.inf).where(sees, 0.0)
    weights = torch.softmax(scores, dim=-1) * sees
    if dropout_p > 0:
        if keep is None:
            seed = int(attn.torch._draw_seed())
            keep = keep_mask(seed, dropout_p, weights.shape[:-2], n_q, n_k)
        weights = weights * keep.to(weights.dtype) / (1 - dropout_p)
    return weights @ value

"""attn for Hugging Face ``transformers``: ``attn_implementation="attn"``.

Importing this module (it needs torch and transformers; ``import attn`` imports neither)
registers attn with transformers' ``AttentionInterface`` under the name ``"attn"``, and
transformers' SDPA mask builder for it with ``AttentionMaskInterface``, so that::

    import attn.transformers
    model = AutoModelForCausalLM.from_config(config, attn_implementation="attn")

computes every attention layer with ``attn.torch.scaled_dot_product_attention`` (the
``torch.library`` operator: forward, backward, ``torch.compile``), with transformers' own
caches for ``generate()``. ``attention_forward`` follows the contract of transformers'
``sdpa_attention_forward``: ``(module, query, key, value, attention_mask, dropout,
scaling, is_causal, position_bias, **kwargs)`` → ``(attn_output (batch, q_len, heads,
head_dim), None)``; ``is_causal`` is inferred the same way (the module's flag, only for
more than one query and no mask), grouped-query heads go to attn as they are
(``enable_gqa``: no ``repeat_kv`` copy), a ``position_bias`` is folded into the mask.
``dropout`` (the model's attention dropout in ``train()`` mode, 0 in ``eval()``) is attn's
torch-semantics dropout, its seed drawn per call from torch's default generator
(``torch.manual_seed`` replays a training step); ``softcap`` is a ValueError as in ``sdpa``.
Tensors attn does not take (not on the CPU, float64) go to transformers' ``sdpa`` with one
warning.
"""

import warnings

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import create_position_bias_mask, sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from . import torch as attn_torch

__all__ = ["NAME", "attention_forward", "register"]

NAME = "attn"

_TAKEN_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_warned = set()


def _fallback_reason(query):
    if query.device.type not in ("cpu", "meta"):
        return f"tensors on {query.device.type}"
    if query.dtype not in _TAKEN_DTYPES:
        return f"dtype {query.dtype}"
    return None


def attention_forward(
    module,
    query,
    key,
    value,
    attention_mask,
    dropout=0.0,
    scaling=None,
    is_causal=None,
    position_bias=None,
    **kwargs,
):
    """transformers' attention function, computed by attn (see the module's docstring)."""
    reason = _fallback_reason(query)
    if reason is not None:
        if reason not in _warned:
            _warned.add(reason)
            warnings.warn(f"attn does not take {reason}: transformers' sdpa computes them", stacklevel=2)
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
            is_causal=is_causal, position_bias=position_bias, **kwargs,
        )
    if kwargs.get("softcap") is not None:
        raise ValueError("`attn` attention (like `sdpa`) does not support `softcap`")
    if kwargs.get("output_attentions", False):
        warnings.warn("`attn` attention does not return attention weights (output_attentions=True)", stacklevel=2)
    q_length = query.shape[2]
    enable_gqa = getattr(module, "num_key_value_groups", 1) > 1 or key.shape[1] != query.shape[1]
    is_causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    is_causal = q_length > 1 and attention_mask is None and is_causal
    if position_bias is not None:
        attention_mask = create_position_bias_mask(position_bias, attention_mask, is_causal, query, key)
        is_causal = False
    out = attn_torch.scaled_dot_product_attention(
        query,
        key,
        value,
        attn_mask=attention_mask,
        dropout_p=dropout,
        is_causal=bool(is_causal),
        scale=scaling,
        enable_gqa=enable_gqa,
    )
    return out.transpose(1, 2).contiguous(), None


def register(name=NAME):
    """Registers attn under ``name`` (done once at import under ``"attn"``)."""
    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, sdpa_mask)


register()

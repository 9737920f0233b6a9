"""attn: CPU attention with torch's ``scaled_dot_product_attention`` semantics.

``attn.scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0,
is_causal=False, *, scale=None, enable_gqa=False, seed=None)`` takes the arguments of
``torch.nn.functional.scaled_dot_product_attention`` and computes with attn's streaming
(FlashAttention-2 style) engine in Rust: NumPy arrays (float32, float16) in, NumPy arrays
out; torch CPU tensors (float32, float16, bfloat16) in, torch tensors out, read in place
through DLPack. torch is optional: this module imports and works without it.

Also here: ``attention_with_lse`` (the output and the log-sum-exp of each row),
``attention_backward`` (dQ, dK, dV), ``KVCache`` (decoding), ``PagedKVCache`` (serving: a
pool of pages shared by sequences that come and go), ``flash_attn_with_kvcache``
(flash-attn's call over paged or per-sequence caches, updated in place), ``dropout_mask``
(attn's dropout keep mask, to hand to another implementation), ``isa()`` and
``num_threads()``. ``attn.torch`` (when torch is installed) registers attn as
``torch.library`` operators (``torch.ops.attn.sdpa_forward``, ``sdpa_backward``: autograd,
``torch.compile``, ``torch.export``, meta tensors) and holds ``routing()``; the plain call
routes tensors that require grad through them, so ``loss.backward()`` works.
``attn.transformers`` registers ``attn_implementation="attn"`` with transformers.

Where attn differs from torch (each function's docstring says more):

- a key hidden by a mask contributes nothing: a NaN at a masked position never reaches the
  output;
- a fully masked row is 0, not NaN;
- the log-sum-exp is available (``attention_with_lse``);
- ``scale`` may be any finite float, as in torch (NaN and infinities are errors);
- the last axis of query, key and value must be contiguous;
- results do not depend on the number of threads.

Malformed input raises ``attn.InputError`` (a shape, an option: a ``ValueError``) or
``attn.InputTypeError`` (a dtype, a kind of array: a ``TypeError``); both are
``RuntimeError``s too, as torch's errors for the same input are, so code written against
either library catches them. The caches' methods raise plain ``ValueError`` and
``TypeError``.

Dropout (``dropout_p`` in ``[0, 1]``, a ValueError otherwise) is torch's: after the softmax
each weight is kept with probability ``1 - p`` and scaled by ``1/(1 - p)``, or set to 0; the
LSE of ``attention_with_lse`` is the undropped softmax's, and ``p = 0`` computes exactly what
a call without dropout does. ``p`` is rounded to a multiple of ``2**-16``. The mask is a pure
function of a 64-bit seed and of (batch entry, query head, query, key), Philox4x32-10, so
``attention_backward`` (given ``dropout_p`` and the same ``seed``) and the autograd route
regenerate the forward's mask. The seed: ``seed=`` (an int), or one drawn per call — from
torch's default CPU generator for torch tensors (``torch.randint``: ``torch.manual_seed``
reproduces a run, successive calls differ), from NumPy's legacy global generator otherwise
(``numpy.random.randint``: ``numpy.random.seed`` reproduces a run). Masks differ from
torch's own (another generator); ``dropout_mask(seed, 0, (B, H, L, S), dropout_p)`` returns
attn's, True where kept, so a reference computes ``softmax(S) * mask / (1 - p) @ V``. The
KV caches have no dropout (inference).
"""

from ._attn import (
    InputError,
    InputTypeError,
    KVCache,
    PagedKVCache,
    __version__,
    attention_backward,
    attention_with_lse,
    dropout_mask,
    flash_attn_with_kvcache,
    isa,
    num_threads,
    scaled_dot_product_attention,
)

__all__ = [
    "InputError",
    "InputTypeError",
    "KVCache",
    "PagedKVCache",
    "__version__",
    "attention_backward",
    "attention_with_lse",
    "dropout_mask",
    "flash_attn_with_kvcache",
    "isa",
    "num_threads",
    "scaled_dot_product_attention",
]


def __getattr__(name):
    # `attn.torch` and `attn.transformers` are imported on first use, so that `import attn`
    # never imports torch.
    if name in ("torch", "transformers"):
        import importlib

        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# With torch already imported, `attn.torch` is imported now: its operators and the
# `torch.compile` substitutes for the functions above are then in place before any
# compiled function calls attn. Without torch, nothing of torch is imported.
import sys as _sys  # noqa: E402

if _sys.modules.get("torch") is not None:
    try:
        from . import torch as _torch  # noqa: F401
    except Exception:  # a torch too old for attn.torch: `import attn` works all the same,
        pass  # and `attn.torch` raises the error when used

"""attn with torch tensors: the shared cases against torch's own
``scaled_dot_product_attention``, bfloat16, DLPack exchange and autograd.

``cargo xtask test`` installs torch and runs them all (a skip fails there, see
``strict.py``); run by hand without torch, they are skipped with the reason shown (``-rs``).
"""

import numpy as np
import pytest

import reference as ref
from strict import optional_import

torch = optional_import(
    "torch",
    "torch is not installed: the torch tests are skipped (cargo xtask test installs it, "
    "from crates/python/requirements-test.txt)",
)
import torch.nn.functional as F  # noqa: E402

import attn  # noqa: E402
import attn.torch as attn_torch  # noqa: E402

# Tiny tensors: one thread is fastest for torch's own ops here (a pool's wake-ups cost more
# than they save), as in test_models.py; attn's threads are its own (RAYON_NUM_THREADS).
torch.set_num_threads(1)

CASES = ref.cases()


def tensor(x):
    return torch.from_numpy(np.ascontiguousarray(x))


def torch_sdpa(q, k, v, mask, **opts):
    """torch's function, or a skip where this torch version cannot run the call (a failure
    under ``cargo xtask test``, whose pinned torch runs every case).

    A 1-D mask ``(S,)`` is broadcast to ``(L, S)`` first: torch documents the mask as
    broadcastable to ``(..., L, S)``, which ``(S,)`` is, but its implementation indexes the
    mask's axis -2 and raises IndexError (torch 2.15); attn follows the documented rule."""
    if mask is not None and mask.dim() < 2:
        mask = mask.expand(q.shape[-2], k.shape[-2])
    try:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, **opts)
    # enable_gqa before torch 2.5, broadcasts some backends refuse (a 1-d mask in torch 2.15)
    except (TypeError, RuntimeError, IndexError) as e:
        pytest.skip(f"this torch cannot run the case: {e}")


def compare_with_torch(got, want, atol):
    """Equal where torch's row is finite; where torch gives NaN (a fully masked row, in
    some torch versions) attn gives 0."""
    got, want = got.double(), want.double()
    nan_rows = torch.isnan(want).any(dim=-1, keepdim=True).expand_as(want)
    torch.testing.assert_close(got[~nan_rows], want[~nan_rows], atol=atol, rtol=atol)
    assert bool((got[nan_rows] == 0).all())


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_matches_torch(case):
    q, k, v, mask = ref.inputs(case)
    opts = ref.options(case)
    tq, tk, tv = tensor(q), tensor(k), tensor(v)
    tm = None if mask is None else tensor(mask)
    out = attn.scaled_dot_product_attention(tq, tk, tv, tm, **opts)
    assert isinstance(out, torch.Tensor) and out.dtype == torch.float32
    np.testing.assert_allclose(out.numpy(), ref.sdpa(q, k, v, mask, **opts)[0], rtol=2e-5, atol=2e-5)
    compare_with_torch(out, torch_sdpa(tq, tk, tv, tm, **opts), 2e-5)


@pytest.mark.parametrize("dtype,atol", [(torch.float16, 4e-3), (torch.bfloat16, 3e-2)], ids=["float16", "bfloat16"])
@pytest.mark.parametrize("case", [c for c in CASES if c["name"] in ("bhsd", "causal_wide", "gqa", "bool_per_head", "float_full", "decode")], ids=lambda c: c["name"])
def test_half_precision(case, dtype, atol):
    q, k, v, mask = ref.inputs(case)
    opts = ref.options(case)
    tq, tk, tv = (tensor(x).to(dtype) for x in (q, k, v))
    tm = None if mask is None else (tensor(mask) if mask.dtype == np.bool_ else tensor(mask).to(dtype))
    out = attn.scaled_dot_product_attention(tq, tk, tv, tm, **opts)
    assert out.dtype == dtype
    want = ref.sdpa(tq.float().numpy(), tk.float().numpy(), tv.float().numpy(), None if tm is None else tm.float().numpy() if tm.dtype != torch.bool else tm.numpy(), **opts)[0]
    np.testing.assert_allclose(out.float().numpy(), want, rtol=atol, atol=atol)
    compare_with_torch(out, torch_sdpa(tq, tk, tv, tm, **opts).to(dtype), 2 * atol)


def test_strided_and_expanded_tensors():
    g = torch.Generator().manual_seed(0)
    bshd = torch.randn(2, 20, 4, 16, generator=g)
    q = bshd.transpose(1, 2)  # (B, H, S, D), not contiguous: read in place
    k = torch.randn(1, 4, 20, 16, generator=g).expand(2, 4, 20, 16)  # stride 0
    v = torch.randn(2, 4, 40, 16, generator=g)[:, :, ::2]
    out = attn.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, is_causal=True), atol=2e-5, rtol=2e-5)
    with pytest.raises(ValueError, match=r"has stride 2 on its last axis.*query.contiguous\(\)"):
        attn.scaled_dot_product_attention(torch.randn(2, 4, 32)[..., ::2], k[0, 0, :, :16], v[0, 0])


def test_results_share_no_memory_with_inputs():
    q = torch.randn(1, 2, 5, 8)
    out = attn.scaled_dot_product_attention(q, q, q)
    assert out.data_ptr() != q.data_ptr()
    out.add_(1)  # a plain, writable tensor
    assert out.is_contiguous()


def test_mixing_numpy_and_torch_is_an_error():
    q = torch.randn(2, 4, 8)
    with pytest.raises(TypeError, match="query is a torch.Tensor but key is a NumPy array"):
        attn.scaled_dot_product_attention(q, q.numpy(), q)
    with pytest.raises(TypeError, match="query is a NumPy array but attn_mask is a torch.Tensor"):
        attn.scaled_dot_product_attention(q.numpy(), q.numpy(), q.numpy(), torch.ones(4, 4, dtype=torch.bool))


def test_float64_is_a_type_error():
    q = torch.randn(2, 4, 8, dtype=torch.float64)
    with pytest.raises(TypeError, match="query has dtype float64"):
        attn.scaled_dot_product_attention(q, q, q)


# ---------------------------------------------------------------------------------------
# Autograd.


GRAD_CASES = [c for c in CASES if c["name"] in ("bhsd", "causal_square", "gqa", "gqa_mask_per_head", "bool_per_batch", "float_full", "batch_broadcast", "mqa_broadcast", "3d")]


@pytest.mark.parametrize("entry", ["plain", "attn.torch"])
@pytest.mark.parametrize("case", GRAD_CASES, ids=lambda c: c["name"])
def test_gradients_match_torch(case, entry):
    q, k, v, mask = ref.inputs(case, seed=1)
    opts = ref.options(case)
    tm = None if mask is None else tensor(mask)
    ours = [tensor(x).requires_grad_() for x in (q, k, v)]
    theirs = [tensor(x).requires_grad_() for x in (q, k, v)]
    fn = attn.scaled_dot_product_attention if entry == "plain" else attn_torch.scaled_dot_product_attention
    out = fn(*ours, tm, **opts)
    assert out.requires_grad and out.grad_fn is not None
    weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(2))
    (out * weight).sum().backward()
    want = torch_sdpa(*theirs, tm, **opts)
    (want * weight).sum().backward()
    for a, b in zip(ours, theirs):
        assert a.grad.shape == a.shape and a.grad.dtype == a.dtype
        torch.testing.assert_close(a.grad, b.grad, atol=1e-4, rtol=1e-4)
    want_np = ref.sdpa_backward(weight.numpy(), q, k, v, mask, **opts)
    for a, w in zip(ours, want_np):
        np.testing.assert_allclose(a.grad.numpy(), w, rtol=1e-4, atol=1e-4)


def test_gradient_of_lse_path_and_half():
    q = torch.randn(1, 4, 9, 16, dtype=torch.bfloat16, requires_grad=True)
    out, lse = attn.attention_with_lse(q, q, q, is_causal=True)
    assert out.requires_grad and not lse.requires_grad and lse.dtype == torch.float32
    out.float().sum().backward()
    assert q.grad.dtype == torch.bfloat16 and bool(torch.isfinite(q.grad.float()).all())


def test_no_grad_mode_takes_the_plain_path():
    q = torch.randn(1, 2, 5, 8, requires_grad=True)
    with torch.no_grad():
        out = attn.scaled_dot_product_attention(q, q, q)
    assert not out.requires_grad
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q.detach(), q.detach(), q.detach()), atol=2e-5, rtol=2e-5)


def test_mask_that_requires_grad_gets_its_gradient():
    # tests/test_mask_grad.py checks it against torch for every shape.
    q = torch.randn(1, 2, 5, 8, requires_grad=True)
    bias = torch.randn(5, 5, requires_grad=True)
    attn.scaled_dot_product_attention(q, q, q, bias).square().sum().backward()
    bias2 = bias.detach().clone().requires_grad_()
    F.scaled_dot_product_attention(q.detach(), q.detach(), q.detach(), bias2).square().sum().backward()
    torch.testing.assert_close(bias.grad, bias2.grad, atol=1e-5, rtol=1e-4)


def test_a_dropout_probability_outside_0_1_is_rejected_on_the_autograd_path():
    q = torch.randn(1, 2, 5, 8, requires_grad=True)
    with pytest.raises(ValueError, match="dropout probability has to be between 0 and 1, but got 1.5"):
        attn.scaled_dot_product_attention(q, q, q, dropout_p=1.5)
    with pytest.raises(ValueError, match="dropout probability has to be between 0 and 1, but got -0.5"):
        attn_torch.scaled_dot_product_attention(q, q, q, dropout_p=-0.5)


def test_kv_cache_with_tensors():
    cache = attn.KVCache(1, 2, 8, 16, dtype=torch.bfloat16)
    k = torch.randn(1, 2, 5, 16).to(torch.bfloat16)
    cache.append(k, k)
    q = torch.randn(1, 4, 1, 16).to(torch.bfloat16)
    out = cache.attend(q)
    assert isinstance(out, torch.Tensor) and out.dtype == torch.bfloat16 and out.shape == (1, 4, 1, 16)
    want = F.scaled_dot_product_attention(q.float(), k.float().repeat_interleave(2, 1), k.float().repeat_interleave(2, 1))
    torch.testing.assert_close(out.float(), want, atol=3e-2, rtol=3e-2)

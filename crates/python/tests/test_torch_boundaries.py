"""The torch boundary examples ("the boundaries hold"): tensors whose negative or
conjugate bit is set are read with their sign, and mixing a tensor that requires grad with
NumPy operands is the TypeError of the plain path."""

import numpy as np
import pytest

torch = pytest.importorskip(
    "torch",
    reason="torch is not installed: the torch tests are skipped (pip install torch into "
    "target/python-venv to run them)",
)
import torch.nn.functional as F  # noqa: E402

import attn  # noqa: E402
import attn.torch as attn_torch  # noqa: E402


def randn(*shape, seed=0, **kw):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), **kw)


def test_negative_views_are_read_with_their_sign():
    q, k, v = randn(1, 2, 5, 8, seed=1), randn(1, 2, 6, 8, seed=2), randn(1, 2, 6, 4, seed=3)
    nq = torch._neg_view(q)
    assert nq.is_neg() and nq.data_ptr() == q.data_ptr()  # the memory holds +q
    out = attn.scaled_dot_product_attention(nq, k, v)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(-q, k, v), atol=2e-5, rtol=2e-5)
    bias = randn(5, 6, seed=4)
    out = attn.scaled_dot_product_attention(q, k, torch._neg_view(v), torch._neg_view(bias))
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, -v, -bias), atol=2e-5, rtol=2e-5)


def test_imaginary_part_of_a_conjugate_is_read_with_its_sign():
    z = torch.complex(randn(1, 2, 6, 8, seed=5), randn(1, 2, 6, 8, seed=6))
    im = z.conj().imag  # a view of z's imaginary parts, with the negative bit
    assert im.is_neg()
    q = randn(1, 2, 5, 8, seed=7)
    out = attn.scaled_dot_product_attention(q, im, im)
    want = F.scaled_dot_product_attention(q, -z.imag, -z.imag)
    torch.testing.assert_close(out, want, atol=2e-5, rtol=2e-5)


def test_conjugate_complex_tensors_are_type_errors():
    z = torch.complex(randn(1, 2, 5, 8), randn(1, 2, 5, 8, seed=1)).conj()
    assert z.is_conj()
    with pytest.raises(TypeError, match="query has dtype complex64"):
        attn.scaled_dot_product_attention(z, z, z)


def test_negative_views_through_autograd():
    q = randn(1, 2, 5, 8, seed=8).requires_grad_()
    k = randn(1, 2, 6, 8, seed=9)
    nq = torch._neg_view(q)
    out = attn.scaled_dot_product_attention(nq, k, k)
    out.sum().backward()
    q2 = q.detach().clone().requires_grad_()
    F.scaled_dot_product_attention(-q2, k, k).sum().backward()
    torch.testing.assert_close(q.grad, q2.grad, atol=1e-4, rtol=1e-4)


def test_a_tensor_that_requires_grad_with_numpy_operands_is_a_type_error():
    q = randn(1, 2, 5, 8, requires_grad=True)
    k = randn(1, 2, 6, 8, seed=1)
    with pytest.raises(TypeError, match="query is a torch.Tensor but key is a NumPy array"):
        attn.scaled_dot_product_attention(q, k.numpy(), k)
    with pytest.raises(TypeError, match="query is a torch.Tensor but attn_mask is a NumPy array"):
        attn.scaled_dot_product_attention(q, k, k, np.ones((5, 6), bool))
    with pytest.raises(TypeError, match="query is a NumPy array but key is a torch.Tensor"):
        attn.attention_with_lse(q.detach().numpy(), k.requires_grad_(), k.detach().numpy())
    with pytest.raises(TypeError, match="value must be a NumPy array or a CPU tensor"):
        attn.scaled_dot_product_attention(q, k, [[1.0]])
    # The same errors from attn.torch's function, which reads tensors only.
    with pytest.raises(TypeError, match="query is a torch.Tensor but value is a NumPy array"):
        attn_torch.scaled_dot_product_attention(q, k, k.detach().numpy())


def _q(*shape, **kw):
    return randn(*shape, seed=11, **kw)


# Malformed calls torch answers with a RuntimeError.
MALFORMED = {
    "head dims differ": lambda: (_q(1, 2, 4, 8), _q(1, 2, 4, 6), _q(1, 2, 4, 8)),
    "dtypes differ": lambda: (_q(1, 2, 4, 8), _q(1, 2, 4, 8).half(), _q(1, 2, 4, 8)),
    "integer operands": lambda: (_q(1, 2, 4, 8).int(), _q(1, 2, 4, 8).int(), _q(1, 2, 4, 8).int()),
    "causal with a mask": lambda: (_q(1, 2, 4, 8), _q(1, 2, 4, 8), _q(1, 2, 4, 8), dict(attn_mask=torch.zeros(4, 4), is_causal=True)),
    "dropout 1.5": lambda: (_q(1, 2, 4, 8), _q(1, 2, 4, 8), _q(1, 2, 4, 8), dict(dropout_p=1.5)),
    "mask shape": lambda: (_q(1, 2, 4, 8), _q(1, 2, 4, 8), _q(1, 2, 4, 8), dict(attn_mask=torch.zeros(3, 4))),
    "integer mask": lambda: (_q(1, 2, 4, 8), _q(1, 2, 4, 8), _q(1, 2, 4, 8), dict(attn_mask=torch.zeros(4, 4, dtype=torch.int32))),
    "one axis": lambda: (_q(8), _q(8), _q(8)),
    "heads not a multiple": lambda: (_q(1, 3, 4, 8), _q(1, 2, 4, 8), _q(1, 2, 4, 8), dict(enable_gqa=True)),
    "heads differ without gqa": lambda: (_q(1, 4, 4, 8), _q(1, 2, 4, 8), _q(1, 2, 4, 8)),
}


@pytest.mark.parametrize("entry", ["attn", "attn.torch", "attn.torch requires grad"])
@pytest.mark.parametrize("case", list(MALFORMED))
def test_malformed_input_raises_what_torch_raises(case, entry):
    """torch raises RuntimeError for malformed tensors; attn raises its InputError or
    InputTypeError, which are RuntimeErrors too (and ValueError or TypeError, as attn
    documents)."""
    call = MALFORMED[case]()
    operands, kw = (call[:3], call[3]) if len(call) == 4 else (call, {})
    with pytest.raises(RuntimeError):
        F.scaled_dot_product_attention(*operands, **kw)
    if entry == "attn.torch requires grad" and operands[0].is_floating_point():
        operands[0].requires_grad_(True)
    sdpa = attn.scaled_dot_product_attention if entry == "attn" else attn_torch.scaled_dot_product_attention
    with pytest.raises(RuntimeError) as raised:
        sdpa(*operands, **kw)
    assert isinstance(raised.value, (attn.InputError, attn.InputTypeError)), raised.value
    assert isinstance(raised.value, (ValueError, TypeError))


def test_the_error_classes():
    assert issubclass(attn.InputError, ValueError) and issubclass(attn.InputError, RuntimeError)
    assert issubclass(attn.InputTypeError, TypeError) and issubclass(attn.InputTypeError, RuntimeError)
    q = np.zeros((1, 2, 4, 8), np.float32)
    with pytest.raises(attn.InputError, match="key of shape .1, 2, 4, 6. has 6 features"):
        attn.scaled_dot_product_attention(q, q[..., :6], q)

"""Packed batches (``cu_seqlens_q``, ``cu_seqlens_k``: flash-attn's varlen layout) on NumPy
arrays and torch tensors, against the float64 formula of reference.py applied to each
sequence on its own."""

import numpy as np
import pytest

import attn
import reference as ref

TOL = {np.float32: 2e-5, np.float16: 4e-3}


def close(got, want, dtype=np.float32):
    tol = TOL[dtype]
    np.testing.assert_allclose(np.asarray(got, dtype=np.float64), want, rtol=tol, atol=tol)


def packed_inputs(lens_q, lens_k, hq, hkv, e, ev, seed=0, dtype=np.float32):
    rng = np.random.default_rng(seed)
    tq, tk = sum(lens_q), sum(lens_k)
    q = ref.randn(rng, (tq, hq, e), dtype)
    k = ref.randn(rng, (tk, hkv, e), dtype)
    v = ref.randn(rng, (tk, hkv, ev), dtype)
    go = ref.randn(rng, (tq, hq, ev), dtype)
    cu_q = np.concatenate([[0], np.cumsum(lens_q)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(lens_k)]).astype(np.int64)
    return q, k, v, go, cu_q, cu_k


def per_sequence(q, k, v, go, cu_q, cu_k, **kw):
    """The formula on each sequence, as (heads, L, E) arrays, packed back."""
    hq, ev = q.shape[1], v.shape[2]
    out = np.zeros((q.shape[0], hq, ev))
    lse = np.zeros((hq, q.shape[0]))
    dq, dk, dv = np.zeros(q.shape), np.zeros(k.shape), np.zeros(v.shape)
    for i in range(len(cu_q) - 1):
        rq, rk = slice(cu_q[i], cu_q[i + 1]), slice(cu_k[i], cu_k[i + 1])
        qs, ks, vs, gs = (np.swapaxes(x, 0, 1) for x in (q[rq], k[rk], v[rk], go[rq]))
        o, l = ref.sdpa(qs, ks, vs, **kw)
        out[rq], lse[:, rq] = np.swapaxes(o, 0, 1), l
        if qs.shape[1] > 0:
            g = ref.sdpa_backward(gs, qs, ks, vs, **kw)
            dq[rq], dk[rk], dv[rk] = (np.swapaxes(x, 0, 1) for x in g)
    return out, lse, (dq, dk, dv)


SHAPES = [
    # lens_q, lens_k, hq, hkv
    ([3, 0, 5], [3, 2, 5], 2, 2),
    ([1, 7, 4], [6, 7, 9], 4, 2),  # GQA, more keys than queries
    ([9], [9], 3, 1),  # one sequence, MQA
    ([2, 3], [0, 4], 2, 2),  # a sequence without keys: rows of 0
]


@pytest.mark.parametrize("shape", SHAPES, ids=[str(s[0]) for s in SHAPES])
@pytest.mark.parametrize("causal", [False, "top_left", "bottom_right"])
def test_packed_matches_the_formula_per_sequence(shape, causal):
    lens_q, lens_k, hq, hkv = shape
    q, k, v, go, cu_q, cu_k = packed_inputs(lens_q, lens_k, hq, hkv, 8, 6)
    kw = dict(is_causal=bool(causal), enable_gqa=hq != hkv)
    if causal:
        kw["causal_alignment"] = causal
    seqs = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    out, lse = attn.attention_with_lse(q, k, v, **kw, **seqs)
    assert out.shape == (q.shape[0], hq, 6) and lse.shape == (hq, q.shape[0])
    ref_kw = dict(is_causal=bool(causal), enable_gqa=hq != hkv)
    if causal:
        ref_kw["alignment"] = causal
    want, want_lse, want_grads = per_sequence(q, k, v, go, cu_q, cu_k, **ref_kw)
    close(out, want)
    finite = np.isfinite(want_lse)
    close(lse[finite], want_lse[finite])
    assert np.all(lse[~finite] == -np.inf)
    np.testing.assert_array_equal(attn.scaled_dot_product_attention(q, k, v, **kw, **seqs), out)
    grads = attn.attention_backward(go, q, k, v, out, lse, **kw, **seqs)
    for got, want_g, operand in zip(grads, want_grads, (q, k, v)):
        assert got.shape == operand.shape and got.dtype == operand.dtype
        close(got, want_g)


def test_packed_float16_and_lists_of_offsets():
    q, k, v, go, cu_q, cu_k = packed_inputs([4, 5], [4, 5], 2, 2, 8, 8, dtype=np.float16)
    out, lse = attn.attention_with_lse(q, k, v, cu_seqlens_q=[0, 4, 9], cu_seqlens_k=[0, 4, 9])
    assert out.dtype == np.float16
    want, _, _ = per_sequence(q, k, v, go, cu_q, cu_k)
    close(out, want, np.float16)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(cu_seqlens_q=[0, 4, 9]), "go together"),
        (dict(cu_seqlens_q=[0, 4, 8], cu_seqlens_k=[0, 4, 9]), "ends at 8"),
        (dict(cu_seqlens_q=[0, 5, 4, 9], cu_seqlens_k=[0, 4, 4, 9]), "decreases"),
        (dict(cu_seqlens_q=[0, -1, 9], cu_seqlens_k=[0, 4, 9]), "not negative"),
        (dict(cu_seqlens_q=[1, 9], cu_seqlens_k=[0, 9]), "start at 0"),
        (dict(cu_seqlens_q=[0, 9], cu_seqlens_k=[0, 4, 9]), "cu_seqlens_k"),
    ],
)
def test_packed_offset_errors(kwargs, message):
    q, k, v, _, _, _ = packed_inputs([4, 5], [4, 5], 2, 2, 8, 8)
    with pytest.raises(ValueError, match=message):
        attn.scaled_dot_product_attention(q, k, v, **kwargs)


def test_packed_shape_and_option_errors():
    q, k, v, go, cu_q, cu_k = packed_inputs([4, 5], [4, 5], 4, 2, 8, 8)
    seqs = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    with pytest.raises(ValueError, match="enable_gqa=True"):
        attn.scaled_dot_product_attention(q, k, v, **seqs)
    with pytest.raises(ValueError, match="3 axes"):
        attn.scaled_dot_product_attention(q[None], k[None], v[None], enable_gqa=True, **seqs)
    with pytest.raises(ValueError, match="no element-wise mask"):
        mask = np.ones((9, 9), dtype=bool)
        attn.scaled_dot_product_attention(q, k, v, mask, enable_gqa=True, **seqs)
    with pytest.raises(TypeError, match="integer offsets"):
        attn.scaled_dot_product_attention(q, k, v, enable_gqa=True, cu_seqlens_q="x", cu_seqlens_k=cu_k)
    out, lse = attn.attention_with_lse(q, k, v, enable_gqa=True, **seqs)
    with pytest.raises(ValueError, match="lse has shape"):
        attn.attention_backward(go, q, k, v, out, lse.T.copy(), enable_gqa=True, **seqs)


def test_packed_torch_tensors_bfloat16():
    torch = pytest.importorskip("torch")
    q, k, v, go, cu_q, cu_k = packed_inputs([3, 6], [5, 6], 4, 2, 16, 16)
    tq, tk, tv, tgo = (torch.from_numpy(x).to(torch.bfloat16) for x in (q, k, v, go))
    cu = dict(cu_seqlens_q=torch.from_numpy(cu_q), cu_seqlens_k=torch.from_numpy(cu_k))
    out, lse = attn.attention_with_lse(tq, tk, tv, is_causal=True, enable_gqa=True, **cu)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    rq, rk, rv = (x.float().numpy() for x in (tq, tk, tv))
    want, _, want_grads = per_sequence(rq, rk, rv, tgo.float().numpy(), cu_q, cu_k, is_causal=True, enable_gqa=True)
    np.testing.assert_allclose(out.float().numpy(), want, rtol=2e-2, atol=2e-2)
    grads = attn.attention_backward(tgo, tq, tk, tv, out, lse, is_causal=True, enable_gqa=True, **cu)
    for got, want_g in zip(grads, want_grads):
        assert got.dtype == torch.bfloat16
        np.testing.assert_allclose(got.float().numpy(), want_g, rtol=5e-2, atol=5e-2)


@pytest.mark.parametrize("entry", ["attn", "attn.torch"])
@pytest.mark.parametrize("dropout_p", [0.0, 0.25])
def test_packed_autograd_is_the_backward_pass(entry, dropout_p):
    """Packed torch tensors that require grad go through the operator: ``loss.backward()``
    gives what ``attention_backward`` gives for the same call (the same dropout mask)."""
    torch = pytest.importorskip("torch")
    import attn.torch as attn_torch

    sdpa = attn.scaled_dot_product_attention if entry == "attn" else attn_torch.scaled_dot_product_attention
    q, k, v, go, cu_q, cu_k = packed_inputs([3, 0, 6], [5, 2, 6], 4, 2, 16, 8)
    tq, tk, tv, tgo = (torch.from_numpy(x) for x in (q, k, v, go))
    cu = dict(cu_seqlens_q=torch.from_numpy(cu_q), cu_seqlens_k=cu_k.tolist())
    leaves = [x.clone().requires_grad_(True) for x in (tq, tk, tv)]
    out = sdpa(*leaves, dropout_p=dropout_p, is_causal=True, enable_gqa=True, seed=7, **cu)
    out.backward(tgo)
    want_out, lse = attn.attention_with_lse(tq, tk, tv, dropout_p=dropout_p, is_causal=True, enable_gqa=True, seed=7, **cu)
    assert torch.equal(out.detach(), want_out)
    want = attn.attention_backward(
        tgo, tq, tk, tv, want_out, lse, is_causal=True, enable_gqa=True, dropout_p=dropout_p, seed=7, **cu
    )
    for leaf, w in zip(leaves, want):
        assert torch.equal(leaf.grad, w)


def test_packed_calls_compile_whole():
    """A packed call under ``torch.compile(fullgraph=True)`` is one operator node, forward
    and backward equal to eager; meta tensors get the packed shapes."""
    torch = pytest.importorskip("torch")
    import attn.torch as attn_torch

    q, k, v, go, cu_q, cu_k = packed_inputs([4, 5], [6, 5], 4, 2, 8, 8)
    cu_q, cu_k = torch.from_numpy(cu_q), torch.from_numpy(cu_k)

    def f(q, k, v):
        out = attn.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
        return (out * out).sum()

    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True)
    eager_leaves = [torch.from_numpy(x).requires_grad_(True) for x in (q, k, v)]
    compiled_leaves = [torch.from_numpy(x).requires_grad_(True) for x in (q, k, v)]
    want, got = f(*eager_leaves), compiled(*compiled_leaves)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    want.backward()
    got.backward()
    for a, b in zip(compiled_leaves, eager_leaves):
        torch.testing.assert_close(a.grad, b.grad, atol=1e-5, rtol=1e-5)
    meta = [torch.empty(x.shape, device="meta") for x in (q, k, v)]
    out, lse = attn_torch.attention_with_lse(*meta, enable_gqa=True, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    assert out.shape == (9, 4, 8) and lse.shape == (4, 9) and lse.dtype == torch.float32

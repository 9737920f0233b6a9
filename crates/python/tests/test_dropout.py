"""Attention dropout (``dropout_p``): attn's calls against torch's math path given attn's
keep mask (``attn.dropout_mask``), forward and backward, in float64.

What torch's math path computes with a mask ``keep`` handed to it:
``softmax(scale · Q Kᵀ + M) * keep / (1 − p) @ V``. attn's mask is its own (Philox4x32-10
keyed by the seed, batch entry, query head, query and key), so the comparison is exact up to
rounding; the mask's statistics (its keep rate) are tested apart, and so are the seeds:
``seed=`` reproduces a call, ``torch.manual_seed`` (torch tensors) and ``numpy.random.seed``
(NumPy arrays) reproduce a run, successive calls differ, ``p = 0`` is bit for bit a call
without dropout.
"""

import math

import numpy as np
import pytest

import attn
from strict import optional_import

torch = optional_import(
    "torch",
    "torch is not installed: the dropout tests are skipped (cargo xtask test installs it)",
)
import attn.torch as attn_torch  # noqa: E402
from math_path import keep_mask, math_sdpa  # noqa: E402

torch.set_num_threads(1)


def randn(*shape, seed=0, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def keep_of(seed, p, lead, n_q, n_k, offset=0):
    keep = keep_mask(seed, p, lead, n_q, n_k, offset)
    assert keep.dtype == torch.bool and keep.shape == tuple(lead) + (n_q, n_k)
    return keep


def math_path(q, k, v, keep, p, attn_mask=None, is_causal=False, scale=None, enable_gqa=False, alignment="top_left"):
    """torch's math path given attn's mask ``keep``, in the operands' dtype (float64 here)."""
    return math_sdpa(q, k, v, attn_mask, p, is_causal, scale, enable_gqa, keep=keep, alignment=alignment)


def assert_near(got, want, rel=1e-5):
    """Within ``rel`` of the largest magnitude of ``want`` (float32 against float64)."""
    got, want = got.detach().double(), want.detach().double()
    assert got.shape == want.shape
    if want.numel() == 0:
        return
    size = want.abs().max().item()
    err = (got - want).abs().max().item() if want.numel() else 0.0
    assert err <= rel * max(size, 1e-30), f"off by {err:.3g} (largest {size:.3g}, {err / max(size, 1e-30):.3g} relative)"


# The calls: operand shapes and options. Leading axes of every kind: 4-D, 2-D, 3-D, 5-D (one
# engine call per index of the first axis: the dropout of each is `within` the whole call),
# broadcast operands, masks that differ per batch entry and head, GQA.
CASES = {
    "bhsd": dict(q=(2, 3, 17, 16), k=(2, 3, 19, 16), v=(2, 3, 19, 8)),
    "2d": dict(q=(5, 8), k=(7, 8), v=(7, 4)),
    "3d": dict(q=(3, 6, 8), k=(3, 9, 8), v=(3, 9, 8)),
    "5d": dict(q=(3, 2, 2, 5, 8), k=(3, 2, 2, 6, 8), v=(3, 2, 2, 6, 8)),
    "5d_broadcast_kv": dict(q=(2, 3, 2, 5, 8), k=(1, 1, 2, 6, 8), v=(1, 1, 2, 6, 8)),
    "causal": dict(q=(1, 2, 33, 16), k=(1, 2, 33, 16), v=(1, 2, 33, 16), is_causal=True),
    "causal_bottom_right": dict(q=(2, 2, 5, 16), k=(2, 2, 12, 16), v=(2, 2, 12, 16), is_causal=True, alignment="bottom_right"),
    "scale": dict(q=(1, 2, 7, 16), k=(1, 2, 9, 16), v=(1, 2, 9, 16), scale=0.3),
    "bool_per_batch_and_head": dict(q=(2, 3, 9, 8), k=(2, 3, 11, 8), v=(2, 3, 11, 8), mask=("bool", (2, 3, 9, 11))),
    "bool_padding": dict(q=(2, 3, 9, 8), k=(2, 3, 11, 8), v=(2, 3, 11, 8), mask=("bool", (2, 1, 1, 11))),
    "float_per_head": dict(q=(2, 3, 9, 8), k=(2, 3, 11, 8), v=(2, 3, 11, 8), mask=("float", (3, 9, 11))),
    "float_5d_per_entry": dict(q=(2, 2, 3, 4, 8), k=(2, 2, 3, 6, 8), v=(2, 2, 3, 6, 8), mask=("float", (2, 2, 1, 4, 6))),
    "gqa": dict(q=(2, 8, 7, 16), k=(2, 2, 9, 16), v=(2, 2, 9, 16), enable_gqa=True),
    "gqa_causal": dict(q=(1, 6, 10, 16), k=(1, 3, 10, 16), v=(1, 3, 10, 16), enable_gqa=True, is_causal=True),
    "gqa_mask_per_head": dict(q=(2, 4, 5, 8), k=(2, 2, 6, 8), v=(2, 2, 6, 8), enable_gqa=True, mask=("bool", (2, 4, 5, 6))),
    "long_rows": dict(q=(1, 2, 70, 32), k=(1, 2, 300, 32), v=(1, 2, 300, 32)),
}


def operands(case, dtype=torch.float32):
    q, k, v = (randn(*case[n], seed=i, dtype=dtype) for i, n in enumerate("qkv"))
    mask = None
    if "mask" in case:
        kind, shape = case["mask"]
        if kind == "bool":
            mask = randn(*shape, seed=7) > -0.8
            mask[..., 0] = True  # every row sees a key: torch's softmax of no key is NaN
        else:
            mask = randn(*shape, seed=7)
    return q, k, v, mask


def options(case):
    return dict(
        is_causal=case.get("is_causal", False),
        scale=case.get("scale"),
        enable_gqa=case.get("enable_gqa", False),
    )


def lead_of(case):
    q, k, v = (case[n] for n in "qkv")
    lead = torch.broadcast_shapes(q[:-2], k[:-2][:-1] + q[-3:-2] if case.get("enable_gqa") else k[:-2], v[:-2][:-1] + q[-3:-2] if case.get("enable_gqa") else v[:-2])
    return tuple(lead)


def call(fn, q, k, v, mask, p, case, **extra):
    align = case.get("alignment", "top_left")
    kw = options(case)
    if align != "top_left":
        kw["causal_alignment"] = align
    return fn(q, k, v, mask, p, **kw, **extra)


def want_of(q, k, v, mask, keep, p, case):
    return math_path(q, k, v, keep, p, mask, **options(case), alignment=case.get("alignment", "top_left"))


@pytest.mark.parametrize("p", [0.1, 0.5])
@pytest.mark.parametrize("name", CASES)
def test_forward_is_the_math_path_with_attns_mask(name, p):
    case = CASES[name]
    q, k, v, mask = operands(case)
    seed = 1000 + len(name)
    out = call(attn.scaled_dot_product_attention, q, k, v, mask, p, case, seed=seed)
    keep = keep_of(seed, p, lead_of(case), q.shape[-2], k.shape[-2])
    want = want_of(q.double(), k.double(), v.double(), mask, keep, p, case)
    assert_near(out, want)
    # The LSE is the undropped softmax's (to rounding: the engine may take another path
    # with dropout).
    out2, lse = call(attn.attention_with_lse, q, k, v, mask, p, case, seed=seed)
    _, lse0 = call(attn.attention_with_lse, q, k, v, mask, 0.0, case)
    assert torch.equal(out2, out)
    torch.testing.assert_close(lse, lse0, rtol=2e-6, atol=2e-6)
    # The mask matters: another seed, another result.
    other = call(attn.scaled_dot_product_attention, q, k, v, mask, p, case, seed=seed + 1)
    assert not torch.equal(other, out)


@pytest.mark.parametrize("entry", ["attn", "attn.torch"])
@pytest.mark.parametrize("p", [0.1, 0.5])
@pytest.mark.parametrize("name", CASES)
def test_gradients_are_the_math_paths_with_attns_mask(name, p, entry):
    case = CASES[name]
    q, k, v, mask = operands(case)
    fn = attn.scaled_dot_product_attention if entry == "attn" else attn_torch.scaled_dot_product_attention
    seed = 77 + len(name)
    ours = [x.clone().requires_grad_() for x in (q, k, v)]
    theirs = [x.double().requires_grad_() for x in (q, k, v)]
    out = call(fn, *ours, mask, p, case, seed=seed)
    keep = keep_of(seed, p, lead_of(case), q.shape[-2], k.shape[-2])
    want = want_of(*theirs, mask, keep, p, case)
    assert_near(out, want)
    w = randn(*out.shape, seed=9)
    (out * w).sum().backward()
    (want * w.double()).sum().backward()
    for name_, a, b in zip("qkv", ours, theirs):
        assert_near(a.grad, b.grad, rel=2e-5), name_
    # The plain call (no grad) drops the same weights as the autograd route.
    assert torch.equal(out.detach(), call(attn.scaled_dot_product_attention, q, k, v, mask, p, case, seed=seed))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_with_dropout(dtype):
    case = CASES["gqa_causal"]
    q, k, v, mask = operands(case, dtype)
    ours = [x.clone().requires_grad_() for x in (q, k, v)]
    theirs = [x.double().requires_grad_() for x in (q, k, v)]
    out = call(attn.scaled_dot_product_attention, *ours, mask, 0.2, case, seed=5)
    assert out.dtype == dtype
    want = want_of(*theirs, mask, keep_of(5, 0.2, lead_of(case), 10, 10), 0.2, case)
    rel = 1e-2 if dtype == torch.float16 else 4e-2
    assert_near(out, want, rel=rel)
    out.float().sum().backward()
    want.sum().backward()
    for a, b in zip(ours, theirs):
        assert_near(a.grad, b.grad, rel=2 * rel)


def test_numpy_arrays_with_seed_forward_and_backward():
    case = CASES["gqa_mask_per_head"]
    q, k, v, mask = operands(case)
    qn, kn, vn, mn = (x.numpy() for x in (q, k, v, mask))
    p, seed = 0.3, 2**64 - 5
    opts = options(case)
    out, lse = attn.attention_with_lse(qn, kn, vn, mn, p, seed=seed, **opts)
    assert isinstance(out, np.ndarray)
    theirs = [x.double().requires_grad_() for x in (q, k, v)]
    want = want_of(*theirs, mask, keep_of(seed, p, lead_of(case), 5, 6), p, case)
    assert_near(torch.from_numpy(out), want)
    go = randn(*out.shape, seed=11)
    dq, dk, dv = attn.attention_backward(go.numpy(), qn, kn, vn, out, lse, mn, dropout_p=p, seed=seed, **opts)
    (want * go.double()).sum().backward()
    for got, t in zip((dq, dk, dv), theirs):
        assert_near(torch.from_numpy(got), t.grad, rel=2e-5)
    # The seed's bits: -5 as an int64 is 2**64 - 5.
    assert np.array_equal(attn.scaled_dot_product_attention(qn, kn, vn, mn, p, seed=-5, **opts), out)
    with pytest.raises(ValueError, match="needs seed="):
        attn.attention_backward(go.numpy(), qn, kn, vn, out, lse, mn, dropout_p=p, **opts)


def test_numpy_seeds_come_from_numpys_global_generator():
    q = np.random.default_rng(0).standard_normal((2, 2, 8, 16)).astype(np.float32)
    np.random.seed(123)
    first = attn.scaled_dot_product_attention(q, q, q, dropout_p=0.5)
    second = attn.scaled_dot_product_attention(q, q, q, dropout_p=0.5)
    np.random.seed(123)
    replay = attn.scaled_dot_product_attention(q, q, q, dropout_p=0.5)
    assert np.array_equal(first, replay)
    assert not np.array_equal(first, second)
    # The draw is one numpy.random.randint of a uint64: with that seed, the same call.
    np.random.seed(123)
    seed = int(np.random.randint(0, 2**64, dtype=np.uint64))
    assert np.array_equal(attn.scaled_dot_product_attention(q, q, q, dropout_p=0.5, seed=seed), first)
    # seed= draws nothing.
    np.random.seed(5)
    attn.scaled_dot_product_attention(q, q, q, dropout_p=0.5, seed=1)
    assert np.random.randint(0, 1000) == np.random.RandomState(5).randint(0, 1000)


@pytest.mark.parametrize("grad", [False, True], ids=["plain", "autograd"])
def test_torch_seeds_come_from_torchs_default_generator(grad):
    q = randn(2, 2, 8, 16).requires_grad_(grad)
    torch.manual_seed(0)
    first = attn.scaled_dot_product_attention(q, q, q, dropout_p=0.5)
    second = attn.scaled_dot_product_attention(q, q, q, dropout_p=0.5)
    torch.manual_seed(0)
    replay = attn.scaled_dot_product_attention(q, q, q, dropout_p=0.5)
    assert torch.equal(first, replay)
    assert not torch.equal(first, second)
    # One torch.randint of an int64 a call: its bits are the seed.
    torch.manual_seed(0)
    seed = int(torch.randint(-(2**63), 2**63 - 1, (), dtype=torch.int64))
    assert torch.equal(attn.scaled_dot_product_attention(q, q, q, dropout_p=0.5, seed=seed), first)
    # The plain route, the autograd route and attn.torch draw alike.
    torch.manual_seed(0)
    via_torch = attn_torch.scaled_dot_product_attention(q.detach().requires_grad_(), q, q, dropout_p=0.5)
    assert torch.equal(via_torch, first)
    # seed= draws nothing, and neither does p = 0.
    state = torch.get_rng_state()
    attn.scaled_dot_product_attention(q, q, q, dropout_p=0.5, seed=3)
    attn.scaled_dot_product_attention(q, q, q, dropout_p=0.0)
    assert torch.equal(torch.get_rng_state(), state)


@pytest.mark.parametrize("grad", [False, True], ids=["plain", "autograd"])
def test_p_zero_is_no_dropout_bit_for_bit(grad):
    case = CASES["gqa_mask_per_head"]
    q, k, v, mask = operands(case)
    qs = [x.clone().requires_grad_(grad) for x in (q, k, v)]
    without = call(attn.scaled_dot_product_attention, *qs, mask, 0.0, case)
    with_seed = call(attn.scaled_dot_product_attention, *qs, mask, 0.0, case, seed=99)
    assert torch.equal(without, with_seed)
    qn = [x.numpy() for x in (q, k, v)]
    a = attn.attention_with_lse(*qn, mask.numpy(), **options(case))
    b = attn.attention_with_lse(*qn, mask.numpy(), 0.0, seed=4, **options(case))
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    out, lse = a
    go = np.ones_like(out)
    g0 = attn.attention_backward(go, *qn, out, lse, mask.numpy(), **options(case))
    g1 = attn.attention_backward(go, *qn, out, lse, mask.numpy(), dropout_p=0.0, seed=4, **options(case))
    assert all(np.array_equal(x, y) for x, y in zip(g0, g1))


def test_p_one_drops_everything():
    q = randn(1, 2, 6, 8).requires_grad_()
    out = attn.scaled_dot_product_attention(q, q, q, dropout_p=1.0)
    assert torch.equal(out, torch.zeros_like(out))
    out.sum().backward()
    assert torch.equal(q.grad, torch.zeros_like(q))


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_the_keep_rate_is_one_minus_p(p):
    shape = (4, 8, 256, 256)
    keep = attn.dropout_mask(31, 0, shape, p)
    n = keep.size
    rate = keep.mean()
    sigma = math.sqrt(p * (1 - p) / n)
    # p is rounded to a multiple of 2**-16 (within 2**-17).
    assert abs(rate - (1 - p)) <= 4 * sigma + 2**-17, (rate, 1 - p, sigma)
    # Every head and query has its own bits: no two rows alike.
    rows = keep.reshape(-1, shape[-1])
    assert len({r.tobytes() for r in rows[:4096]}) == 4096


def test_the_engines_mask_is_dropout_mask_on_a_large_call():
    # value = identity: the output is the dropped weights themselves, nonzero where kept.
    b, h, n_q, n_k = 2, 3, 40, 136
    q, k = randn(b, h, n_q, 16, seed=1), randn(b, h, n_k, 16, seed=2)
    v = torch.eye(n_k).expand(b, h, n_k, n_k)
    out = attn.scaled_dot_product_attention(q, k, v, dropout_p=0.3, seed=8)
    assert torch.equal(out != 0, keep_of(8, 0.3, (b, h), n_q, n_k))


def test_the_offset_keys_the_mask():
    a = attn.dropout_mask(5, 0, (1, 2, 16, 16), 0.5)
    b = attn.dropout_mask(5, 1, (1, 2, 16, 16), 0.5)
    assert not np.array_equal(a, b)
    assert np.array_equal(attn.dropout_mask(5, 0, (1, 2, 16, 16), 0.0), np.ones((1, 2, 16, 16), bool))


# ---------------------------------------------------------------------------------------
# Packed batches: the sequence index is the batch entry, positions are the sequence's own.


def test_packed_calls_drop_per_sequence():
    lens_q, lens_k, hq, hkv, e = [3, 0, 7, 5], [4, 2, 9, 5], 4, 2, 16
    cu_q = np.concatenate([[0], np.cumsum(lens_q)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(lens_k)]).astype(np.int64)
    tq, tk = int(cu_q[-1]), int(cu_k[-1])
    q, k, v = randn(tq, hq, e, seed=1), randn(tk, hkv, e, seed=2), randn(tk, hkv, e, seed=3)
    go = randn(tq, hq, e, seed=4)
    p, seed = 0.4, 1234
    kw = dict(is_causal=True, causal_alignment="bottom_right", enable_gqa=True, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    out, lse = attn.attention_with_lse(q.numpy(), k.numpy(), v.numpy(), None, p, seed=seed, **kw)
    grads = attn.attention_backward(go.numpy(), q.numpy(), k.numpy(), v.numpy(), out, lse, dropout_p=p, seed=seed, **kw)
    block = attn.dropout_mask(seed, 0, (hq, tq, tk), p, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    dense = attn.dropout_mask(seed, 0, (len(lens_q), hq, max(lens_q), max(lens_k)), p)
    assert block.shape == (hq, tq, tk)
    theirs = [x.double().requires_grad_() for x in (q, k, v)]
    total = 0.0
    for i in range(len(lens_q)):
        rq, rk = slice(cu_q[i], cu_q[i + 1]), slice(cu_k[i], cu_k[i + 1])
        keep = block[:, rq, rk]
        # The packed mask is the dense one's at each sequence's own positions, and False
        # outside the sequences' blocks.
        assert np.array_equal(keep, dense[i, :, : lens_q[i], : lens_k[i]])
        assert not block[:, rq, : cu_k[i]].any() and not block[:, rq, cu_k[i + 1] :].any()
        qs, ks, vs = (x.transpose(0, 1) for x in (theirs[0][rq], theirs[1][rk], theirs[2][rk]))
        o = math_path(qs, ks, vs, torch.from_numpy(keep), p, is_causal=True, enable_gqa=True, alignment="bottom_right")
        assert_near(torch.from_numpy(out[rq]), o.transpose(0, 1))
        total = total + (o.transpose(0, 1) * go[rq].double()).sum()
    total.backward()
    for got, t in zip(grads, theirs):
        assert_near(torch.from_numpy(got), t.grad, rel=2e-5)


# ---------------------------------------------------------------------------------------
# Errors: torch's for the probability; seeds; the hook's arguments; the caches take none.


@pytest.mark.parametrize("p", [1.5, -0.1, float("nan"), float("inf")])
def test_a_probability_outside_0_1_is_torchs_value_error(p):
    q = randn(1, 2, 5, 8)
    message = f"dropout probability has to be between 0 and 1, but got {p!r}"
    import re

    for fn in (
        lambda: attn.scaled_dot_product_attention(q, q, q, dropout_p=p),
        lambda: attn.scaled_dot_product_attention(q.numpy(), q.numpy(), q.numpy(), dropout_p=p),
        lambda: attn.attention_with_lse(q.clone().requires_grad_(), q, q, dropout_p=p),
        lambda: attn_torch.scaled_dot_product_attention(q, q, q, dropout_p=p),
        lambda: attn.attention_backward(q, q, q, q, q, q[..., 0], dropout_p=p, seed=1),
        lambda: attn.dropout_mask(0, 0, (1, 1, 2, 2), p),
    ):
        with pytest.raises(ValueError, match=re.escape(message)):
            fn()
    if p > 1:
        with pytest.raises(RuntimeError, match=re.escape(message)):  # torch's own words
            torch.nn.functional.scaled_dot_product_attention(q, q, q, dropout_p=p)


def test_bad_seeds_are_refused():
    q = randn(1, 2, 5, 8)
    with pytest.raises(ValueError, match="64-bit seed"):
        attn.scaled_dot_product_attention(q, q, q, dropout_p=0.1, seed=2**64)
    with pytest.raises(ValueError, match="64-bit seed"):
        attn.scaled_dot_product_attention(q.numpy(), q.numpy(), q.numpy(), dropout_p=0.1, seed=-(2**63) - 1)
    with pytest.raises(TypeError, match="seed must be an integer"):
        attn.scaled_dot_product_attention(q, q, q, dropout_p=0.1, seed=1.5)
    with pytest.raises(TypeError, match="seed must be an integer"):
        attn_torch.scaled_dot_product_attention(q.requires_grad_(), q, q, dropout_p=0.1, seed="x")
    # An integer tensor is a seed.
    a = attn.scaled_dot_product_attention(q.detach(), q.detach(), q.detach(), dropout_p=0.1, seed=torch.tensor(7))
    assert torch.equal(a, attn.scaled_dot_product_attention(q.detach(), q.detach(), q.detach(), dropout_p=0.1, seed=7))


def test_dropout_mask_arguments_are_checked():
    with pytest.raises(ValueError, match=r"\(batch, heads, L, S\)"):
        attn.dropout_mask(0, 0, (2, 3, 4), 0.1)
    with pytest.raises(ValueError, match="offset"):
        attn.dropout_mask(0, -1, (1, 1, 2, 2), 0.1)
    with pytest.raises(ValueError, match="offset"):
        attn.dropout_mask(0, 2**32, (1, 1, 2, 2), 0.1)
    with pytest.raises(ValueError, match="total_q"):
        attn.dropout_mask(0, 0, (1, 4, 4), 0.1, cu_seqlens_q=[0, 3], cu_seqlens_k=[0, 4])
    with pytest.raises(ValueError, match="go together"):
        attn.dropout_mask(0, 0, (1, 4, 4), 0.1, cu_seqlens_q=[0, 4])
    with pytest.raises(ValueError, match="dropout streams"):
        attn.dropout_mask(0, 0, (2**40, 2**40, 2, 2), 0.1)
    with pytest.raises(MemoryError):
        attn.dropout_mask(0, 0, (1, 1, 2**32, 2**35), 0.1)
    assert attn.dropout_mask(0, 0, (0, 3, 4, 5), 0.5).shape == (0, 3, 4, 5)


def test_kv_caches_take_no_dropout():
    cache = attn.KVCache(1, 2, 8, 16)
    k = np.random.default_rng(0).standard_normal((1, 2, 3, 16)).astype(np.float32)
    cache.append(k, k)
    with pytest.raises(TypeError, match="dropout_p"):
        cache.attend(k[:, :, :1], dropout_p=0.1)

"""attn.scaled_dot_product_attention, attention_with_lse and attention_backward on NumPy
arrays, against the float64 formula of reference.py."""

import threading

import numpy as np
import pytest

import attn
import reference as ref

CASES = ref.cases()


def close(got, want, dtype=np.float32):
    tol = {np.float32: 2e-5, np.float16: 4e-3}[dtype]
    np.testing.assert_allclose(np.asarray(got, dtype=np.float64), want, rtol=tol, atol=tol)


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_matches_the_formula(case):
    q, k, v, mask = ref.inputs(case)
    opts = ref.options(case)
    out = attn.scaled_dot_product_attention(q, k, v, mask, **opts)
    want, want_lse = ref.sdpa(q, k, v, mask, **opts)
    assert isinstance(out, np.ndarray) and out.dtype == np.float32
    assert out.shape == want.shape
    close(out, want)
    out2, lse = attn.attention_with_lse(q, k, v, mask, **opts)
    assert lse.dtype == np.float32 and lse.shape == want_lse.shape
    np.testing.assert_array_equal(out2, out)
    finite = np.isfinite(want_lse)
    close(lse[finite], want_lse[finite])
    assert np.all(lse[~finite] == -np.inf)


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_float16(case):
    q, k, v, mask = ref.inputs(case, dtype=np.float16)
    if mask is not None and mask.dtype == np.float32:
        mask = mask.astype(np.float16)  # a float mask may come in the query's dtype
    opts = ref.options(case)
    out = attn.scaled_dot_product_attention(q, k, v, mask, **opts)
    assert out.dtype == np.float16
    want, _ = ref.sdpa(q, k, v, mask, **opts)
    close(out, want, np.float16)


def test_float32_mask_with_float16_query():
    rng = np.random.default_rng(1)
    q, k, v = (ref.randn(rng, (1, 2, 5, 8), np.float16) for _ in range(3))
    mask = ref.randn(rng, (5, 5))
    close(attn.scaled_dot_product_attention(q, k, v, mask), ref.sdpa(q, k, v, mask)[0], np.float16)


@pytest.mark.parametrize("case", [c for c in CASES if c["name"] != "long"], ids=lambda c: c["name"])
def test_backward_matches_the_formula(case):
    q, k, v, mask = ref.inputs(case, seed=3)
    opts = ref.options(case)
    out, lse = attn.attention_with_lse(q, k, v, mask, **opts)
    grad_out = ref.randn(np.random.default_rng(4), out.shape)
    dq, dk, dv = attn.attention_backward(grad_out, q, k, v, out, lse, mask, **opts)
    want = ref.sdpa_backward(grad_out, q, k, v, mask, **opts)
    for got, w, x in zip((dq, dk, dv), want, (q, k, v)):
        assert got.shape == x.shape and got.dtype == x.dtype
        np.testing.assert_allclose(got, w, rtol=1e-4, atol=1e-4)


def test_backward_float16():
    rng = np.random.default_rng(5)
    q, k, v = (ref.randn(rng, (1, 4, 9, 16), np.float16) for _ in range(3))
    out, lse = attn.attention_with_lse(q, k, v, is_causal=True)
    go = ref.randn(rng, out.shape, np.float16)
    grads = attn.attention_backward(go, q, k, v, out, lse, is_causal=True)
    want = ref.sdpa_backward(go, q, k, v, is_causal=True)
    for g, w in zip(grads, want):
        assert g.dtype == np.float16
        np.testing.assert_allclose(g.astype(np.float64), w, rtol=2e-2, atol=2e-2)


def test_bottom_right_causal():
    rng = np.random.default_rng(2)
    q = ref.randn(rng, (1, 2, 3, 8))
    k, v = ref.randn(rng, (1, 2, 10, 8)), ref.randn(rng, (1, 2, 10, 8))
    out = attn.scaled_dot_product_attention(q, k, v, is_causal=True, causal_alignment="bottom_right")
    close(out, ref.sdpa(q, k, v, is_causal=True, alignment="bottom_right")[0])
    # Top-left with fewer queries than keys differs.
    top = attn.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert not np.allclose(top, out)


# ---------------------------------------------------------------------------------------
# Layouts: strided, transposed, broadcast, negative strides, DLPack.


def test_transposed_and_sliced_inputs_are_read_in_place():
    rng = np.random.default_rng(6)
    bshd = ref.randn(rng, (2, 20, 4, 16))  # FlashAttention's layout
    q = bshd.transpose(0, 2, 1, 3)  # (B, H, S, D) view, not contiguous
    packed = ref.randn(rng, (2, 4, 40, 48))
    k, v = packed[:, :, ::2, :16], packed[:, :, 1::2, 16:40]  # strided sequence, sliced features
    assert not q.flags.c_contiguous and not k.flags.c_contiguous
    out = attn.scaled_dot_product_attention(q, k, v)
    close(out, ref.sdpa(q, k, v)[0])


def test_broadcast_views_with_zero_strides():
    rng = np.random.default_rng(7)
    q = ref.randn(rng, (1, 1, 6, 8))
    k = np.broadcast_to(ref.randn(rng, (1, 1, 7, 8)), (3, 4, 7, 8))
    v = np.broadcast_to(ref.randn(rng, (7, 8)), (3, 4, 7, 8))
    out = attn.scaled_dot_product_attention(np.broadcast_to(q, (3, 4, 6, 8)), k, v)
    close(out, ref.sdpa(np.broadcast_to(q, (3, 4, 6, 8)), k, v)[0])


def test_negative_strides_are_copied():
    rng = np.random.default_rng(8)
    q, k, v = (ref.randn(rng, (2, 3, 9, 8)) for _ in range(3))
    flipped = (q[::-1, ::-1, ::-1], k[:, ::-1], v[::-1])
    out = attn.scaled_dot_product_attention(*flipped, is_causal=True)
    close(out, ref.sdpa(*flipped, is_causal=True)[0])
    mask = (rng.random((9, 9)) < 0.5)[::-1, ::-1]
    close(attn.scaled_dot_product_attention(q, k, v, mask), ref.sdpa(q, k, v, mask)[0])


def test_unaligned_and_odd_strides_are_copied():
    rng = np.random.default_rng(9)
    x = ref.randn(rng, (2, 5, 8))
    raw = np.zeros(x.nbytes + 1, dtype=np.uint8)
    unaligned = np.frombuffer(raw.data, dtype=np.float32, count=x.size, offset=1).reshape(x.shape)
    unaligned[...] = x
    assert not unaligned.flags.aligned
    close(attn.scaled_dot_product_attention(unaligned, x, x), ref.sdpa(x, x, x)[0])
    rec = np.zeros((2, 5), dtype=[("pad", "u1"), ("x", "<f4", (8,))])  # 33-byte rows
    rec["x"] = x
    close(attn.scaled_dot_product_attention(x, rec["x"], x), ref.sdpa(x, x, x)[0])


def test_bool_mask_bytes_other_than_0_and_1_count_as_true():
    rng = np.random.default_rng(20)
    q, k, v = (ref.randn(rng, (1, 2, 5, 8)) for _ in range(3))
    raw = (rng.random((5, 5)) < 0.6).astype(np.uint8) * rng.integers(1, 255, (5, 5), dtype=np.uint8)
    mask = raw.view(np.bool_)  # bytes such as 7 or 200: NumPy reads them as True
    close(attn.scaled_dot_product_attention(q, k, v, mask), ref.sdpa(q, k, v, raw != 0)[0])
    ks, vs = k[..., ::2, :], v[..., ::2, :]
    close(attn.scaled_dot_product_attention(q, ks, vs, mask[:, ::2]), ref.sdpa(q, ks, vs, raw[:, ::2] != 0)[0])


def test_readonly_arrays():
    rng = np.random.default_rng(10)
    q = ref.randn(rng, (2, 5, 8))
    q.flags.writeable = False
    close(attn.scaled_dot_product_attention(q, q, q), ref.sdpa(q, q, q)[0])


class DLPackOnly:
    """A producer that only speaks DLPack (NumPy's own ``__dlpack__`` underneath)."""

    def __init__(self, array, legacy=False):
        self.array = array
        self.legacy = legacy
        self.exports = 0

    def __dlpack__(self, **kwargs):
        self.exports += 1
        if self.legacy and "max_version" in kwargs:
            raise TypeError("__dlpack__() got an unexpected keyword argument 'max_version'")
        return self.array.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return self.array.__dlpack_device__()


@pytest.mark.parametrize("legacy", [False, True], ids=["versioned", "legacy"])
def test_dlpack_inputs(legacy):
    rng = np.random.default_rng(11)
    q = ref.randn(rng, (2, 3, 6, 8))
    k = ref.randn(rng, (2, 3, 7, 8)).transpose(0, 1, 2, 3)
    v = ref.randn(rng, (2, 7, 3, 4)).transpose(0, 2, 1, 3)  # strided through DLPack
    mask = rng.random((2, 1, 6, 7)) < 0.8
    wrapped = [DLPackOnly(x, legacy) for x in (q, k, v, mask)]
    out = attn.scaled_dot_product_attention(*wrapped)
    assert all(w.exports >= 1 for w in wrapped)
    assert isinstance(out, np.ndarray)
    close(out, ref.sdpa(q, k, v, mask)[0])
    h = rng.standard_normal((1, 2, 5, 8)).astype(np.float16)
    close(attn.scaled_dot_product_attention(DLPackOnly(h, legacy), h, h), ref.sdpa(h, h, h)[0], np.float16)


def test_dlpack_readonly_through_versioned_capsules():
    q = np.ones((1, 2, 3, 4), dtype=np.float32)
    q.flags.writeable = False
    try:
        q.__dlpack__(max_version=(1, 0))
    except TypeError:
        pytest.skip(f"NumPy {np.__version__} exports no versioned DLPack capsule (2.1 does), and legacy ones cannot be read-only")
    out = attn.scaled_dot_product_attention(DLPackOnly(q), DLPackOnly(q), DLPackOnly(q))
    close(out, ref.sdpa(q, q, q)[0])


def test_dlpack_unsupported_dtype():
    x = np.zeros((2, 3), dtype=np.int32)
    with pytest.raises(TypeError, match="query has dtype int32"):
        attn.scaled_dot_product_attention(DLPackOnly(x), DLPackOnly(x), DLPackOnly(x))


# ---------------------------------------------------------------------------------------
# Zero-length axes.


@pytest.mark.parametrize(
    "q,k,v",
    [
        ((2, 3, 0, 8), (2, 3, 5, 8), (2, 3, 5, 4)),  # no query
        ((2, 3, 4, 8), (2, 3, 0, 8), (2, 3, 0, 4)),  # no key: rows 0, LSE -inf
        ((0, 3, 4, 8), (0, 3, 5, 8), (0, 3, 5, 4)),  # no batch entry
        ((2, 3, 4, 8), (2, 3, 5, 8), (2, 3, 5, 0)),  # no value feature
        ((2, 0, 4, 8), (2, 0, 5, 8), (2, 0, 5, 4)),  # no head
    ],
)
def test_zero_length_axes(q, k, v):
    rng = np.random.default_rng(12)
    q, k, v = ref.randn(rng, q), ref.randn(rng, k), ref.randn(rng, v)
    out, lse = attn.attention_with_lse(q, k, v)
    want, want_lse = ref.sdpa(q, k, v)
    assert out.shape == want.shape and lse.shape == want_lse.shape
    assert np.all(out == 0) or out.size == 0 or k.shape[-2] > 0
    close(out, want)
    if k.shape[-2] == 0:
        assert np.all(lse == -np.inf) and np.all(out == 0)
    go = np.ones_like(out)
    dq, dk, dv = attn.attention_backward(go, q, k, v, out, lse)
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)
    assert np.all(np.isfinite(dq)) and np.all(np.isfinite(dk)) and np.all(np.isfinite(dv))


# ---------------------------------------------------------------------------------------
# What attn does differently: hidden positions never leak, empty rows are 0.


def test_nan_at_masked_positions_never_reaches_the_output():
    rng = np.random.default_rng(13)
    q, k, v = (ref.randn(rng, (1, 2, 6, 8)) for _ in range(3))
    k[..., 5, :] = np.nan
    v[..., 5, :] = np.inf
    mask = np.ones((6, 6), dtype=bool)
    mask[:, 5] = False
    out = attn.scaled_dot_product_attention(q, k, v, mask)
    assert np.all(np.isfinite(out))
    close(out, ref.sdpa(q[..., :, :], k[..., :5, :], v[..., :5, :])[0])
    bias = np.zeros((6, 6), dtype=np.float32)
    bias[:, 5] = -np.inf
    np.testing.assert_array_equal(attn.scaled_dot_product_attention(q, k, v, bias), out)
    causal = attn.scaled_dot_product_attention(q[..., :5, :], k, v, is_causal=True)
    assert np.all(np.isfinite(causal))


def test_fully_masked_rows_are_zero():
    rng = np.random.default_rng(14)
    q, k, v = (ref.randn(rng, (2, 2, 4, 8)) for _ in range(3))
    mask = np.ones((4, 4), dtype=bool)
    mask[1] = False
    out, lse = attn.attention_with_lse(q, k, v, mask)
    assert np.all(out[:, :, 1] == 0) and np.all(lse[:, :, 1] == -np.inf)
    assert np.all(np.isfinite(out))


def test_deterministic():
    rng = np.random.default_rng(15)
    q, k, v = (ref.randn(rng, (1, 4, 300, 64)) for _ in range(3))
    a = attn.scaled_dot_product_attention(q, k, v, is_causal=True)
    b = attn.scaled_dot_product_attention(q, k, v, is_causal=True)
    np.testing.assert_array_equal(a, b)


def test_gil_is_released():
    rng = np.random.default_rng(16)
    q = ref.randn(rng, (1, 8, 2048, 64))
    inside = [False]
    done = threading.Event()

    def work():
        for _ in range(2):
            inside[0] = True
            attn.scaled_dot_product_attention(q, q, q)
            inside[0] = False
        done.set()

    spins_inside = 0
    t = threading.Thread(target=work)
    t.start()
    while not done.is_set():
        if inside[0]:
            spins_inside += 1
    t.join()
    # With the GIL held through a call, this thread could run while the other is in one
    # only for a switch interval (5 ms, some 25 000 spins) before the call starts; with the
    # GIL released it runs throughout (about 10^6 spins here).
    assert spins_inside > 200_000, spins_inside


# ---------------------------------------------------------------------------------------
# Bad input: the documented errors.


def arrays(*shapes, dtype=np.float32):
    rng = np.random.default_rng(17)
    return [ref.randn(rng, s, dtype) for s in shapes]


def test_a_dropout_probability_outside_0_1_is_rejected():
    q, = arrays((2, 3, 4))
    with pytest.raises(ValueError, match="dropout probability has to be between 0 and 1, but got 1.1"):
        attn.scaled_dot_product_attention(q, q, q, dropout_p=1.1)
    # A probability drops (test_dropout.py holds its semantics); p = 0 is no dropout.
    assert not np.array_equal(attn.scaled_dot_product_attention(q, q, q, dropout_p=0.5, seed=1),
                              attn.scaled_dot_product_attention(q, q, q))


def test_mask_with_is_causal_is_rejected():
    q, = arrays((2, 3, 4))
    with pytest.raises(ValueError, match="Explicit attn_mask should not be set when is_causal=True"):
        attn.scaled_dot_product_attention(q, q, q, np.ones((3, 3), bool), is_causal=True)


def test_keyword_only_arguments():
    q, = arrays((2, 3, 4))
    with pytest.raises(TypeError):
        attn.scaled_dot_product_attention(q, q, q, None, 0.0, False, 0.5)


@pytest.mark.parametrize(
    "shapes,kwargs,message",
    [
        (((2, 4, 8), (2, 5, 7), (2, 5, 8)), {}, r"key of shape \(2, 5, 7\) has 7 features but query of shape \(2, 4, 8\) has 8"),
        (((2, 4, 8), (2, 5, 8), (2, 6, 8)), {}, r"value of shape \(2, 6, 8\) has 6 positions but key of shape \(2, 5, 8\) has 5"),
        (((8,), (5, 8), (5, 8)), {}, "at least 2 dimensional"),
        (((2, 8, 4, 8), (2, 2, 5, 8), (2, 2, 5, 8)), {}, "pass enable_gqa=True"),
        (((2, 8, 4, 8), (2, 3, 5, 8), (2, 3, 5, 8)), {"enable_gqa": True}, "must divide the number of heads in query"),
        (((2, 8, 4, 8), (2, 2, 5, 8), (2, 4, 5, 8)), {"enable_gqa": True}, "key has 2 heads but value has 4"),
        (((3, 2, 4, 8), (2, 2, 5, 8), (2, 2, 5, 8)), {}, "do not broadcast"),
        (((2, 4, 0), (2, 5, 0), (2, 5, 3)), {}, "0 features"),
        (((2, 4, 8), (2, 5, 8), (2, 5, 8)), {"scale": float("nan")}, "scale NaN is invalid"),
        (((2, 4, 8), (2, 5, 8), (2, 5, 8)), {"causal_alignment": "bottom"}, "causal_alignment='bottom'"),
        (((2, 4, 8), (2, 5, 8), (2, 5, 8)), {"causal_alignment": "bottom_right"}, "pass is_causal=True"),
    ],
)
def test_shape_and_option_errors(shapes, kwargs, message):
    q, k, v = arrays(*shapes)
    with pytest.raises(ValueError, match=message):
        attn.scaled_dot_product_attention(q, k, v, **kwargs)


@pytest.mark.parametrize("shape", [(4, 6), (3, 1, 5, 5), (3, 5, 5), (1, 1, 1, 2, 5, 5), (5, 1, 5)])
def test_mask_shape_errors(shape):
    q, = arrays((2, 2, 5, 8))
    with pytest.raises(ValueError, match=r"attn_mask of shape .* does not broadcast to the shape of the attention weights \(2, 2, 5, 5\)"):
        attn.scaled_dot_product_attention(q, q, q, np.ones(shape, bool))


def test_dtype_errors():
    q, = arrays((2, 4, 8))
    with pytest.raises(TypeError, match="query has dtype float64"):
        attn.scaled_dot_product_attention(q.astype(np.float64), q, q)
    with pytest.raises(TypeError, match="Expected query, key, and value to have the same dtype, but got query.dtype: float32 key.dtype: float16"):
        attn.scaled_dot_product_attention(q, q.astype(np.float16), q)
    with pytest.raises(TypeError, match="Expected attn_mask dtype to be bool or float or to match query dtype"):
        attn.scaled_dot_product_attention(q, q, q, np.zeros((4, 4), dtype=np.int64))
    with pytest.raises(TypeError, match="Expected attn_mask dtype"):
        attn.scaled_dot_product_attention(q, q, q, np.zeros((4, 4), dtype=np.float64))
    with pytest.raises(TypeError, match="must be a NumPy array or a CPU tensor"):
        attn.scaled_dot_product_attention(q.tolist(), q, q)
    with pytest.raises(TypeError, match="non-native byte order"):
        attn.scaled_dot_product_attention(q.astype(">f4"), q, q)


def test_non_contiguous_innermost_axis():
    q, = arrays((2, 4, 16))
    with pytest.raises(ValueError, match=r"query of shape \(2, 4, 8\) has stride 2 on its last axis.*numpy.ascontiguousarray\(query\)"):
        attn.scaled_dot_product_attention(q[..., ::2], q[..., :8], q)
    with pytest.raises(ValueError, match="value of shape .* has stride 4 on its last axis"):
        attn.scaled_dot_product_attention(q, q, q[..., ::4])


def test_backward_errors():
    q, = arrays((2, 4, 8))
    out, lse = attn.attention_with_lse(q, q, q)
    with pytest.raises(ValueError, match=r"grad_out has shape \(2, 4, 7\) but the attention output's is \(2, 4, 8\)"):
        attn.attention_backward(out[..., :7], q, q, q, out, lse)
    with pytest.raises(ValueError, match="lse has shape"):
        attn.attention_backward(out, q, q, q, out, lse[:, :3])
    with pytest.raises(TypeError, match="lse has dtype float16"):
        attn.attention_backward(out, q, q, q, out, lse.astype(np.float16))


# ---------------------------------------------------------------------------------------
# KVCache.


def test_kv_cache_decoding_matches_attention_over_the_prefix():
    rng = np.random.default_rng(18)
    b, hkv, hq, d = 2, 2, 4, 16
    cache = attn.KVCache(b, hkv, 4, d, growth="double")
    k_all, v_all = ref.randn(rng, (b, hkv, 9, d)), ref.randn(rng, (b, hkv, 9, d))
    cache.append(k_all[:, :, :6], v_all[:, :, :6])  # the prompt (grows past 4)
    assert cache.lens == [6, 6] and cache.capacity >= 6
    q = ref.randn(rng, (b, hq, 2, d))
    out = cache.attend(q)  # the last two prompt positions, bottom-right causal
    want, _ = ref.sdpa(q, k_all[:, :, :6], v_all[:, :, :6], is_causal=True, enable_gqa=True, alignment="bottom_right")
    close(out, want)
    for t in range(6, 9):
        cache.append(k_all[:, :, t : t + 1], v_all[:, :, t : t + 1])
        q1 = ref.randn(rng, (b, hq, 1, d))
        out, lse = cache.attend_with_lse(q1)
        want, want_lse = ref.sdpa(q1, k_all[:, :, : t + 1], v_all[:, :, : t + 1], enable_gqa=True)
        close(out, want)
        close(lse, want_lse)
    assert "KVCache(batch=2" in repr(cache)


def test_kv_cache_ragged_entries_and_errors():
    rng = np.random.default_rng(19)
    cache = attn.KVCache(2, 1, 4, 8, value_dim=4, dtype=np.float16)
    assert cache.dtype == "float16" and cache.shape == (2, 1, 4, 8) and cache.value_dim == 4
    k, v = ref.randn(rng, (1, 1, 3, 8), np.float16), ref.randn(rng, (1, 1, 3, 4), np.float16)
    cache.append_to(1, k, v)
    assert cache.lens == [0, 3]
    q = ref.randn(rng, (2, 2, 1, 8), np.float16)
    out = cache.attend(q)
    assert out.dtype == np.float16 and out.shape == (2, 2, 1, 4)
    assert np.all(out[0] == 0)  # an entry with no token: rows of 0, not NaN
    close(out[1:], ref.sdpa(q[1:], k, v, enable_gqa=True)[0], np.float16)
    with pytest.raises(ValueError, match="exceeds the capacity of 4"):
        cache.append_to(1, k, v)  # 3 + 3 tokens in room for 4 (growth="fixed")
    assert cache.lens == [0, 3]
    with pytest.raises(TypeError, match="key has dtype float32 but the cache holds float16"):
        cache.append(k.astype(np.float32), v.astype(np.float32))
    with pytest.raises(ValueError, match="must have 4 axes"):
        cache.attend(q[0])
    cache.clear()
    assert cache.lens == [0, 0]
    with pytest.raises(TypeError, match="attn caches float32, float16 or bfloat16"):
        attn.KVCache(1, 1, 1, 8, dtype="int8")
    with pytest.raises(ValueError, match="growth="):
        attn.KVCache(1, 1, 1, 8, growth="triple")


def test_module_surface():
    assert attn.isa() in {"amx", "avx512bf16", "avx512", "avx2", "baseline"}
    assert attn.num_threads() >= 1
    doc = attn.scaled_dot_product_attention.__doc__
    for difference in ("never reaches the output", "is 0, never NaN", "Dropout, torch's", "attention_with_lse"):
        assert difference in doc
    import inspect

    params = inspect.signature(attn.scaled_dot_product_attention).parameters
    assert list(params)[:6] == ["query", "key", "value", "attn_mask", "dropout_p", "is_causal"]
    assert params["scale"].kind is inspect.Parameter.KEYWORD_ONLY
    assert params["enable_gqa"].kind is inspect.Parameter.KEYWORD_ONLY
    assert params["seed"].kind is inspect.Parameter.KEYWORD_ONLY


def test_import_does_not_import_torch():
    import subprocess
    import sys

    code = "import sys, attn; assert 'torch' not in sys.modules, 'import attn imported torch'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_attn_torch_needs_torch():
    # In a fresh interpreter where torch cannot be imported (a None entry in sys.modules
    # makes `import torch` raise ImportError), whether or not torch is installed here.
    import subprocess
    import sys

    code = (
        "import sys; sys.modules['torch'] = None; import attn\n"
        "try:\n    attn.torch\nexcept ImportError:\n    sys.exit(0)\n"
        "sys.exit('attn.torch imported without torch')"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_results_too_large_are_memory_errors_not_crashes():
    q = np.broadcast_to(np.ones((1, 1, 1, 64), np.float32), (1 << 20, 1 << 20, 1, 64))
    with pytest.raises(MemoryError):
        attn.scaled_dot_product_attention(q, q, q)
    with pytest.raises(MemoryError):
        attn.KVCache(1 << 20, 1 << 10, 1 << 20, 128)

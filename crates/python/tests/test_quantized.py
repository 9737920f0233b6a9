"""Quantized caches from Python: ``KVCache(..., format=...)`` and
``PagedKVCache(..., format=...)`` store keys and values as one-byte codes (int8, or fp8
e4m3) with a scale per token and head; attention reads the codes in place. Results are
those of the unquantized cache within the formats' rounding, errors are ValueErrors."""

import numpy as np
import pytest

import attn
import reference as ref

from test_paged import formula

FORMATS = ["int8", "int8-channels", "fp8"]
# The largest relative row error each format showed against unquantized attention on
# standard-normal rows (``docs/accuracy.md`` publishes the figures), with a margin.
TOLERANCE = {"int8": 3e-2, "int8-channels": 3e-2, "fp8": 1e-1}


def row_error(got, want):
    """max over rows of ||got - want|| / ||want||, rows along the last axis."""
    got, want = (np.asarray(x, np.float64).reshape(-1, np.shape(x)[-1]) for x in (got, want))
    return float(np.max(np.linalg.norm(got - want, axis=1) / np.linalg.norm(want, axis=1)))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_kv_cache_formats_decode_as_the_unquantized_cache(fmt, dtype):
    rng = np.random.default_rng(20)
    b, hq, hkv, n, d = 2, 8, 2, 200, 64
    quantized = attn.KVCache(b, hkv, 16, d, dtype=dtype, growth="double", format=fmt)
    plain = attn.KVCache(b, hkv, n, d, dtype=dtype)
    assert (quantized.format, plain.format) == (fmt, None)
    for chunk in (150, 50):
        k = ref.randn(rng, (b, hkv, chunk, d)).astype(dtype)
        v = ref.randn(rng, (b, hkv, chunk, d)).astype(dtype)
        quantized.append(k, v)
        plain.append(k, v)
    assert quantized.lens == plain.lens == [n, n] and quantized.capacity >= n
    q = ref.randn(rng, (b, hq, 1, d)).astype(dtype)
    out, lse = quantized.attend_with_lse(q)
    want, want_lse = plain.attend_with_lse(q)
    assert out.dtype == np.dtype(dtype) and out.shape == want.shape == (b, hq, 1, d)
    assert row_error(out, want) < TOLERANCE[fmt]
    np.testing.assert_allclose(lse, want_lse, atol=0.1)


@pytest.mark.parametrize("fmt", FORMATS)
def test_paged_cache_formats_match_the_formula_on_what_they_hold(fmt):
    rng = np.random.default_rng(21)
    hq, hkv, d, page = 4, 2, 32, 8
    cache = attn.PagedKVCache(40, page, hkv, d, format=fmt)
    plain = attn.PagedKVCache(40, page, hkv, d)
    assert cache.format == fmt
    seqs, plain_seqs, keys, values = [], [], [], []
    for n in (37, 9):
        s, p = cache.add_sequence(), plain.add_sequence()
        k, v = ref.randn(rng, (n, hkv, d)), ref.randn(rng, (n, hkv, d))
        cache.append(s, k, v)
        plain.append(p, k, v)
        seqs.append(s)
        plain_seqs.append(p)
        keys.append(k)
        values.append(v)
    child = cache.fork(seqs[0])
    q = ref.randn(rng, (3, 1, hq, d))
    out = cache.attend(q, [seqs[0], seqs[1], child])
    want = plain.attend(q, [plain_seqs[0], plain_seqs[1], plain_seqs[0]])
    assert row_error(out, want) < TOLERANCE[fmt]
    # A chunk of queries (the GEMM tiles, blocks dequantized as they are read).
    qp = ref.randn(rng, (6, hq, d))
    out = cache.attend(qp, [seqs[0]], cu_seqlens_q=np.array([0, 6]))
    want, _ = formula(qp, keys[0], values[0], causal=True)
    assert row_error(out, want) < TOLERANCE[fmt]


def test_bad_formats_and_rows_raise():
    with pytest.raises(ValueError, match="format"):
        attn.KVCache(1, 1, 4, 8, format="int4")
    with pytest.raises(ValueError, match="format"):
        attn.PagedKVCache(4, 4, 1, 8, format="e5m2")
    cache = attn.PagedKVCache(4, 4, 1, 8, format="int8")
    s = cache.add_sequence()
    k = np.ones((2, 1, 8), np.float32)
    k[1, 0, 3] = np.inf
    # No code holds inf: an error, and nothing appended.
    with pytest.raises(ValueError, match="finite"):
        cache.append(s, k, np.ones((2, 1, 8), np.float32))
    assert cache.seq_len(s) == 0 and cache.free_pages == 4
    kv = attn.KVCache(1, 1, 4, 8, format="fp8")
    with pytest.raises(ValueError, match="finite"):
        kv.append(k[None].transpose(0, 2, 1, 3), k[None].transpose(0, 2, 1, 3))
    assert kv.lens == [0]

"""Paged KV caches: ``flash_attn_with_kvcache`` (flash-attn's call over caches the caller
owns, new keys and values written into them in place) and ``PagedKVCache`` (attn's pool of
pages), on NumPy arrays and torch tensors, against a float64 NumPy formula applied to each
sequence's keys gathered out of its pages — and, with torch, against torch's own
``scaled_dot_product_attention`` on the same gathered keys."""

import inspect
import math

import numpy as np
import pytest

import attn
import reference as ref
from strict import optional_import


@pytest.fixture
def torch():
    return optional_import("torch", "torch is not installed: the torch tests of paged caches are skipped")


def close(got, want, tol=2e-5):
    np.testing.assert_allclose(np.asarray(got, dtype=np.float64), want, rtol=tol, atol=tol)


def close_lse(got, want, tol=2e-5):
    got = np.asarray(got, dtype=np.float64)
    finite = np.isfinite(want)
    assert np.all(got[~finite] == -np.inf)
    np.testing.assert_allclose(got[finite], want[finite], rtol=tol, atol=tol)


def formula(q, k, v, scale=None, causal=False, window=(-1, -1), softcap=0.0, slopes=None):
    """One sequence in float64: ``q (n, H, D)``, its keys ``k (L, Hk, D)`` and values
    ``v (L, Hk, Dv)``, the queries its newest positions (query ``i`` at ``i + L - n``).
    Returns ``out (n, H, Dv)`` and ``lse (H, n)`` (0 and ``-inf`` for a row without keys)."""
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    n, heads, d = q.shape
    length, kv_heads = k.shape[:2]
    k = np.repeat(k, heads // kv_heads, axis=1)
    v = np.repeat(v, heads // kv_heads, axis=1)
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    s = np.einsum("ihd,jhd->hij", q, k) * scale
    if softcap > 0:
        s = softcap * np.tanh(s / softcap)
    i = np.arange(n)[:, None] + length - n
    j = np.arange(length)[None, :]
    if slopes is not None:
        s = s - np.asarray(slopes, dtype=np.float64)[:, None, None] * np.abs(i - j)
    allow = np.ones((n, length), dtype=bool)
    if causal:
        allow &= j <= i
    left, right = window
    if left >= 0:
        allow &= j >= i - left
    if right >= 0:
        allow &= j <= i + right
    s = np.where(allow, s, -np.inf)
    out = np.zeros((heads, n, v.shape[-1]))
    lse = np.full((heads, n), -np.inf)
    for h in range(heads):
        for r in range(n):
            row = s[h, r]
            if not np.isfinite(row).any():
                continue
            top = row.max()
            w = np.exp(row - top)
            total = w.sum()
            out[h, r] = (w / total) @ v[:, h]
            lse[h, r] = top + np.log(total)
    return np.swapaxes(out, 0, 1), lse


def gather(cache, table_row, length):
    """The first ``length`` positions of a sequence out of its pages: ``(length, Hk, D)``."""
    ps = cache.shape[1]
    pages = [cache[p] for p in table_row[: -(-length // ps)]]
    if not pages:
        return cache[:0, 0]
    return np.concatenate(pages, axis=0)[:length]


def paged_case(rng, batch, page_size, seqlens, new, max_pages, kv_heads, d, dv, num_blocks=None, dtype=np.float32):
    """Caches of scattered pages (a random permutation of the pool), their block table, and
    new tokens."""
    num_blocks = num_blocks or batch * max_pages + 3
    kc = ref.randn(rng, (num_blocks, page_size, kv_heads, d), dtype)
    vc = ref.randn(rng, (num_blocks, page_size, kv_heads, dv), dtype)
    table = rng.permutation(num_blocks)[: batch * max_pages].reshape(batch, max_pages).astype(np.int32)
    k = ref.randn(rng, (batch, new, kv_heads, d), dtype)
    v = ref.randn(rng, (batch, new, kv_heads, dv), dtype)
    return kc, vc, table, np.array(seqlens, dtype=np.int32), k, v


def expected_caches(kc, vc, table, seqlens, k, v):
    """The caches after the new tokens are written at ``seqlens..``."""
    kc, vc = kc.copy(), vc.copy()
    ps = kc.shape[1]
    for b in range(k.shape[0]):
        for i in range(k.shape[1]):
            pos = seqlens[b] + i
            kc[table[b][pos // ps], pos % ps] = k[b, i]
            vc[table[b][pos // ps], pos % ps] = v[b, i]
    return kc, vc


# ---------------------------------------------------------------------------------------
# flash_attn_with_kvcache on NumPy arrays.


@pytest.mark.parametrize("page_size", [16, 5, 1])
@pytest.mark.parametrize("causal", [True, False])
def test_decode_appends_in_place_and_matches_the_formula(page_size, causal):
    rng = np.random.default_rng(1)
    batch, hq, hkv, d = 3, 8, 2, 16
    seqlens = [0, 17, 2 * page_size + 3]
    max_pages = -(-(max(seqlens) + 1) // page_size) + 1
    kc, vc, table, sl, k, v = paged_case(rng, batch, page_size, seqlens, 1, max_pages, hkv, d, d)
    q = ref.randn(rng, (batch, 1, hq, d))
    want_kc, want_vc = expected_caches(kc, vc, table, sl, k, v)
    out, lse = attn.flash_attn_with_kvcache(
        q, kc, vc, k, v, cache_seqlens=sl, block_table=table, causal=causal, return_softmax_lse=True
    )
    # The caches changed exactly at the new tokens' slots.
    np.testing.assert_array_equal(kc, want_kc)
    np.testing.assert_array_equal(vc, want_vc)
    assert out.shape == (batch, 1, hq, d) and out.dtype == np.float32
    assert lse.shape == (batch, hq, 1) and lse.dtype == np.float32
    lens = sl + 1
    for b in range(batch):
        want, want_lse = formula(q[b], gather(kc, table[b], lens[b]), gather(vc, table[b], lens[b]), causal=causal)
        close(out[b], want)
        close_lse(lse[b], want_lse)


@pytest.mark.parametrize("page_size", [16, 7])
def test_chunked_prefill_mixed_lengths(page_size):
    # Each sequence appends a chunk of 6 tokens and its 6 queries attend, bottom-right
    # causal, to everything cached: a prompt from scratch, and two continued ones.
    rng = np.random.default_rng(2)
    batch, hq, hkv, d, dv, chunk = 3, 4, 4, 32, 8, 6
    seqlens = [0, 9, 40]
    max_pages = -(-(max(seqlens) + chunk) // page_size)
    kc, vc, table, sl, k, v = paged_case(rng, batch, page_size, seqlens, chunk, max_pages, hkv, d, dv)
    q = ref.randn(rng, (batch, chunk, hq, d))
    want_kc, want_vc = expected_caches(kc, vc, table, sl, k, v)
    out, lse = attn.flash_attn_with_kvcache(
        q, kc, vc, k=k, v=v, cache_seqlens=sl, block_table=table, causal=True, return_softmax_lse=True
    )
    np.testing.assert_array_equal(kc, want_kc)
    np.testing.assert_array_equal(vc, want_vc)
    assert out.shape == (batch, chunk, hq, dv) and lse.shape == (batch, hq, chunk)
    for b in range(batch):
        length = seqlens[b] + chunk
        want, want_lse = formula(q[b], gather(kc, table[b], length), gather(vc, table[b], length), causal=True)
        close(out[b], want)
        close_lse(lse[b], want_lse)


def test_without_new_tokens_and_shared_pages():
    # Two sequences share their first page (a common prefix); nothing is written.
    rng = np.random.default_rng(3)
    kc, vc, table, _, _, _ = paged_case(rng, 2, 8, [0, 0], 0, 3, 1, 16, 16, num_blocks=9)
    table[1, 0] = table[0, 0]
    sl = np.array([20, 11], dtype=np.int32)
    q = ref.randn(rng, (2, 2, 2, 16))
    before = kc.copy(), vc.copy()
    out = attn.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=sl, block_table=table, causal=True)
    np.testing.assert_array_equal(kc, before[0])
    np.testing.assert_array_equal(vc, before[1])
    for b in range(2):
        want, _ = formula(q[b], gather(kc, table[b], sl[b]), gather(vc, table[b], sl[b]), causal=True)
        close(out[b], want)
    # An int for cache_seqlens is every sequence's length; without it, sequences fill their pages.
    out = attn.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=11, block_table=table)
    for b in range(2):
        close(out[b], formula(q[b], gather(kc, table[b], 11), gather(vc, table[b], 11))[0])
    out = attn.flash_attn_with_kvcache(q, kc, vc, block_table=table)
    for b in range(2):
        close(out[b], formula(q[b], gather(kc, table[b], 24), gather(vc, table[b], 24))[0])


def test_contiguous_caches_without_a_block_table():
    rng = np.random.default_rng(4)
    batch, cap, hq, hkv, d = 3, 12, 6, 3, 16
    kc = ref.randn(rng, (batch, cap, hkv, d))
    vc = ref.randn(rng, (batch, cap, hkv, d))
    k, v = ref.randn(rng, (batch, 2, hkv, d)), ref.randn(rng, (batch, 2, hkv, d))
    sl = np.array([0, 5, 10], dtype=np.int32)
    q = ref.randn(rng, (batch, 2, hq, d))
    want_kc, want_vc = kc.copy(), vc.copy()
    for b in range(batch):
        want_kc[b, sl[b] : sl[b] + 2] = k[b]
        want_vc[b, sl[b] : sl[b] + 2] = v[b]
    out, lse = attn.flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=sl, causal=True, return_softmax_lse=True)
    np.testing.assert_array_equal(kc, want_kc)
    np.testing.assert_array_equal(vc, want_vc)
    for b in range(batch):
        want, want_lse = formula(q[b], kc[b, : sl[b] + 2], vc[b, : sl[b] + 2], causal=True)
        close(out[b], want)
        close_lse(lse[b], want_lse)
    # cache_batch_idx: sequence b reads and writes row idx[b] of a larger cache.
    big_k, big_v = ref.randn(rng, (5, cap, hkv, d)), ref.randn(rng, (5, cap, hkv, d))
    idx = np.array([4, 0, 2], dtype=np.int32)
    want_k = big_k.copy()
    for b in range(batch):
        want_k[idx[b], sl[b] : sl[b] + 2] = k[b]
    out = attn.flash_attn_with_kvcache(q, big_k, big_v, k, v, cache_seqlens=sl, cache_batch_idx=idx, causal=True)
    np.testing.assert_array_equal(big_k, want_k)
    for b in range(batch):
        want, _ = formula(q[b], big_k[idx[b], : sl[b] + 2], big_v[idx[b], : sl[b] + 2], causal=True)
        close(out[b], want)


@pytest.mark.parametrize(
    "options",
    [
        dict(window_size=(4, 0)),
        dict(window_size=(3, 2), causal=False),
        dict(window_size=(-1, 1), causal=False),
        dict(softcap=2.0),
        dict(softmax_scale=0.3),
        dict(alibi="heads"),
        dict(alibi="batch_heads", window_size=(6, 0)),
    ],
    ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()),
)
def test_score_options(options):
    rng = np.random.default_rng(5)
    batch, hq, hkv, d, ps, chunk = 2, 4, 2, 16, 6, 3
    seqlens = [4, 13]
    kc, vc, table, sl, k, v = paged_case(rng, batch, ps, seqlens, chunk, 3, hkv, d, d)
    q = ref.randn(rng, (batch, chunk, hq, d))
    options = dict(options)
    causal = options.pop("causal", True)
    kw = {}
    slopes = None
    alibi = options.pop("alibi", None)
    if alibi == "heads":
        slopes = rng.uniform(0.05, 0.5, hq).astype(np.float32)
        kw["alibi_slopes"] = slopes
    elif alibi == "batch_heads":
        slopes = rng.uniform(0.05, 0.5, (batch, hq)).astype(np.float32)
        kw["alibi_slopes"] = slopes
    out, lse = attn.flash_attn_with_kvcache(
        q, kc, vc, k, v, cache_seqlens=sl, block_table=table, causal=causal, return_softmax_lse=True, **options, **kw
    )
    for b in range(batch):
        length = seqlens[b] + chunk
        s = None if slopes is None else (slopes if slopes.ndim == 1 else slopes[b])
        want, want_lse = formula(
            q[b],
            gather(kc, table[b], length),
            gather(vc, table[b], length),
            scale=options.get("softmax_scale"),
            causal=causal,
            window=options.get("window_size", (-1, -1)),
            softcap=options.get("softcap", 0.0),
            slopes=s,
        )
        close(out[b], want, 1e-4)
        close_lse(lse[b], want_lse, 1e-4)


def test_float16_and_strided_queries():
    rng = np.random.default_rng(6)
    kc, vc, table, sl, k, v = paged_case(rng, 2, 5, [3, 11], 2, 4, 2, 8, 8, dtype=np.float16)
    # Queries whose batch and sequence axes do not merge (a transposed view): copied once.
    q = np.swapaxes(ref.randn(rng, (2, 2, 4, 8), np.float16), 0, 1)
    out = attn.flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=sl, block_table=table, causal=True)
    assert out.dtype == np.float16 and out.shape == (2, 2, 4, 8)
    for b in range(2):
        want, _ = formula(q[b], gather(kc, table[b], sl[b] + 2), gather(vc, table[b], sl[b] + 2), causal=True)
        close(out[b], want, 4e-3)
    # Caches seen through negative strides are read (copied) when nothing is written to them.
    table_rev = (kc.shape[0] - 1 - table).astype(np.int32)
    out2 = attn.flash_attn_with_kvcache(q, kc[::-1], vc[::-1], cache_seqlens=sl + 2, block_table=table_rev, causal=True)
    close(out2, out.astype(np.float64), 1e-3)


def test_signature_is_flash_attns():
    params = list(inspect.signature(attn.flash_attn_with_kvcache).parameters)
    assert params == [
        "q", "k_cache", "v_cache", "k", "v", "rotary_cos", "rotary_sin", "cache_seqlens",
        "cache_batch_idx", "cache_leftpad", "block_table", "softmax_scale", "causal",
        "window_size", "softcap", "rotary_interleaved", "alibi_slopes", "num_splits",
        "return_softmax_lse",
    ]  # fmt: skip


# ---------------------------------------------------------------------------------------
# Errors: each a ValueError or TypeError, raised before anything is written.


def _error_case():
    rng = np.random.default_rng(7)
    kc, vc, table, sl, k, v = paged_case(rng, 2, 4, [3, 6], 2, 3, 2, 8, 8, num_blocks=8)
    q = ref.randn(rng, (2, 1, 4, 8))
    return q, kc, vc, table, sl, k, v


def _unaligned(shape):
    buf = np.zeros(int(np.prod(shape)) * 4 + 1, dtype=np.uint8)
    return buf[1:].view(np.float32).reshape(shape)


BAD = [
    ("q int", lambda c: dict(q=c["q"].astype(np.int32)), TypeError, "q has dtype int32"),
    ("k_cache f16", lambda c: dict(k_cache=c["k_cache"].astype(np.float16)), TypeError, "k_cache has dtype float16 but q has float32"),
    ("v f64", lambda c: dict(v=c["v"].astype(np.float64)), TypeError, "v has dtype float64"),
    ("q 3 axes", lambda c: dict(q=c["q"][0]), ValueError, "must have 4 axes"),
    ("q width", lambda c: dict(q=c["q"][..., :4].copy()), ValueError, "features"),
    ("heads", lambda c: dict(q=np.zeros((2, 1, 3, 8), np.float32)), ValueError, "multiple"),
    ("v_cache pages", lambda c: dict(v_cache=c["v_cache"][:5].copy()), ValueError, "v_cache"),
    ("k alone", lambda c: dict(v=None), ValueError, "k and v go together"),
    ("k shape", lambda c: dict(k=c["k"][:, :, :1].copy()), ValueError, "must be"),
    ("no seqlens", lambda c: dict(cache_seqlens=None), ValueError, "without cache_seqlens"),
    ("table int64", lambda c: dict(block_table=c["block_table"].astype(np.int64)), TypeError, "block_table has dtype int64"),
    ("table list", lambda c: dict(block_table=[[0, 1, 2], [3, 4, 5]]), TypeError, "block_table must be"),
    ("table shape", lambda c: dict(block_table=c["block_table"][:1].copy()), ValueError, "block_table of shape"),
    ("page outside", lambda c: dict(block_table=np.array([[0, 1, 2], [3, 9, 5]], np.int32)), ValueError, r"block_table\[1, 1\] = 9"),
    ("page negative", lambda c: dict(block_table=np.array([[0, -1, 2], [3, 4, 5]], np.int32)), ValueError, r"block_table\[0, 1\] = -1"),
    ("seqlens int64", lambda c: dict(cache_seqlens=c["cache_seqlens"].astype(np.int64)), TypeError, "cache_seqlens has dtype int64"),
    ("seqlens negative", lambda c: dict(cache_seqlens=np.array([-1, 2], np.int32)), ValueError, "not negative"),
    ("seqlens length", lambda c: dict(cache_seqlens=np.array([1, 2, 3], np.int32)), ValueError, "cache_seqlens of shape"),
    ("beyond pages", lambda c: dict(cache_seqlens=np.array([3, 11], np.int32)), ValueError, "sequence 1 needs"),
    ("seqlen_q", lambda c: dict(q=np.zeros((2, 6, 4, 8), np.float32), cache_seqlens=np.array([3, 0], np.int32)), ValueError, "seqlen_q = 6"),
    ("same slot", lambda c: dict(block_table=np.array([[0, 1, 2], [0, 1, 2]], np.int32), cache_seqlens=np.array([3, 3], np.int32)), ValueError, "both write"),
    ("read-only", lambda c: dict(k_cache=_readonly(c["k_cache"])), ValueError, "not writeable"),
    ("overlap", lambda c: dict(v_cache=np.lib.stride_tricks.as_strided(c["v_cache"], strides=(32, 64, 32, 4), writeable=True)), ValueError, "share elements"),
    ("reversed", lambda c: dict(k_cache=c["k_cache"][::-1]), ValueError, "step backwards"),
    ("unaligned", lambda c: dict(k_cache=_copy_into(_unaligned(c["k_cache"].shape), c["k_cache"])), ValueError, "not aligned"),
    ("rotary", lambda c: dict(rotary_cos=np.zeros((8, 4), np.float32)), ValueError, "rotary"),
    ("leftpad", lambda c: dict(cache_leftpad=np.zeros(2, np.int32)), ValueError, "cache_leftpad"),
    ("window", lambda c: dict(window_size=(-2, 0)), ValueError, "window_size"),
    ("softcap", lambda c: dict(softcap=-1.0), ValueError, "softcap"),
    ("scale", lambda c: dict(softmax_scale=float("nan")), ValueError, "scale"),
    ("alibi shape", lambda c: dict(alibi_slopes=np.zeros(3, np.float32)), ValueError, "alibi_slopes of shape"),
    ("alibi dtype", lambda c: dict(alibi_slopes=np.zeros(4, np.float64)), TypeError, "alibi_slopes has dtype"),
    ("batch idx", lambda c: dict(cache_batch_idx=np.zeros(2, np.int32)), ValueError, "cache_batch_idx with block_table"),
]


def _readonly(a):
    a = a.copy()
    a.setflags(write=False)
    return a


def _copy_into(dst, src):
    dst[...] = src
    return dst


@pytest.mark.parametrize("name, change, error, message", BAD, ids=[b[0] for b in BAD])
def test_bad_inputs_raise_and_write_nothing(name, change, error, message):
    q, kc, vc, table, sl, k, v = _error_case()
    args = dict(q=q, k_cache=kc, v_cache=vc, k=k, v=v, cache_seqlens=sl, block_table=table, causal=True)
    args.update(change(args))
    caches = [args["k_cache"], args["v_cache"]]
    before = [np.array(c, copy=True) for c in caches]
    with pytest.raises(error, match=message):
        attn.flash_attn_with_kvcache(**args)
    for c, b in zip(caches, before):
        np.testing.assert_array_equal(c, b)


def test_dense_errors():
    rng = np.random.default_rng(8)
    kc, vc = ref.randn(rng, (2, 6, 1, 8)), ref.randn(rng, (2, 6, 1, 8))
    q = ref.randn(rng, (3, 1, 1, 8))
    with pytest.raises(ValueError, match="k_cache has 2 rows but q has 3"):
        attn.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=1)
    with pytest.raises(ValueError, match=r"cache_batch_idx\[1\] = 2"):
        attn.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=1, cache_batch_idx=np.array([0, 2, 1], np.int32))
    k = ref.randn(rng, (3, 1, 1, 8))
    with pytest.raises(ValueError, match="both write"):
        idx = np.array([0, 1, 0], np.int32)
        attn.flash_attn_with_kvcache(q, kc, vc, k, k, cache_seqlens=2, cache_batch_idx=idx)
    with pytest.raises(ValueError, match="a cache row of 6 tokens"):
        attn.flash_attn_with_kvcache(q[:2], kc, vc, k[:2], k[:2], cache_seqlens=6)


# ---------------------------------------------------------------------------------------
# flash_attn_with_kvcache on torch tensors.


def _torch_reference(torch, q, k, v, causal):
    """torch's SDPA on one sequence's gathered keys: q (n, H, D), k, v (L, Hk, D)."""
    import torch.nn.functional as F

    n, heads = q.shape[:2]
    length, kv_heads = k.shape[:2]
    qt = q.float().transpose(0, 1)[None]
    kt = k.float().transpose(0, 1).repeat_interleave(heads // kv_heads, 0)[None]
    vt = v.float().transpose(0, 1).repeat_interleave(heads // kv_heads, 0)[None]
    mask = None
    if causal:
        mask = torch.ones(n, length, dtype=torch.bool).tril(length - n)
    return F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask)[0].transpose(0, 1)


@pytest.mark.parametrize("dtype_name, tol", [("float32", 2e-5), ("float16", 4e-3), ("bfloat16", 3e-2)])
@pytest.mark.parametrize("page_size", [16, 3])
def test_torch_tensors_in_place_and_against_torch_sdpa(torch, dtype_name, tol, page_size):
    dtype = getattr(torch, dtype_name)
    g = torch.Generator().manual_seed(9)
    batch, hq, hkv, d, chunk = 3, 8, 2, 32, 2
    seqlens = torch.tensor([0, 7, 21], dtype=torch.int32)
    max_pages = -(-(21 + chunk) // page_size)
    num_blocks = batch * max_pages + 2
    kc = torch.randn(num_blocks, page_size, hkv, d, generator=g).to(dtype)
    vc = torch.randn(num_blocks, page_size, hkv, d, generator=g).to(dtype)
    table = torch.randperm(num_blocks, generator=g)[: batch * max_pages].reshape(batch, max_pages).to(torch.int32)
    k = torch.randn(batch, chunk, hkv, d, generator=g).to(dtype)
    v = torch.randn(batch, chunk, hkv, d, generator=g).to(dtype)
    q = torch.randn(batch, chunk, hq, d, generator=g).to(dtype)
    want_kc, want_vc = kc.clone(), vc.clone()
    for b in range(batch):
        for i in range(chunk):
            pos = int(seqlens[b]) + i
            want_kc[table[b, pos // page_size], pos % page_size] = k[b, i]
            want_vc[table[b, pos // page_size], pos % page_size] = v[b, i]
    out, lse = attn.flash_attn_with_kvcache(
        q, kc, vc, k, v, cache_seqlens=seqlens, block_table=table, causal=True, return_softmax_lse=True
    )
    assert isinstance(out, torch.Tensor) and out.dtype == dtype and out.shape == (batch, chunk, hq, d)
    assert lse.dtype == torch.float32 and lse.shape == (batch, hq, chunk)
    assert torch.equal(kc, want_kc) and torch.equal(vc, want_vc)
    for b in range(batch):
        length = int(seqlens[b]) + chunk
        pages = table[b, : -(-length // page_size)].long()
        keys = kc[pages].reshape(-1, hkv, d)[:length]
        values = vc[pages].reshape(-1, hkv, d)[:length]
        want = _torch_reference(torch, q[b], keys, values, causal=True)
        torch.testing.assert_close(out[b].float(), want, atol=tol, rtol=tol)
        want64, want_lse = formula(q[b].float().numpy(), keys.float().numpy(), values.float().numpy(), causal=True)
        close(out[b].float().numpy(), want64, max(tol, 2e-5))
        close_lse(lse[b].numpy(), want_lse, 1e-4)


def test_torch_errors(torch):
    q = torch.randn(1, 1, 2, 8)
    kc = torch.zeros(4, 4, 2, 8)
    table = torch.arange(4, dtype=torch.int32).reshape(1, 4)
    k = torch.randn(1, 1, 2, 8)
    with pytest.raises(TypeError, match="block_table has dtype int64"):
        attn.flash_attn_with_kvcache(q, kc, kc.clone(), cache_seqlens=1, block_table=table.long())
    with pytest.raises(TypeError, match="NumPy"):
        attn.flash_attn_with_kvcache(q, kc.numpy(), kc.numpy(), cache_seqlens=1, block_table=table)
    # A broadcast (expanded) cache cannot take writes: its pages share memory.
    broadcast = torch.zeros(1, 4, 2, 8).expand(4, 4, 2, 8)
    with pytest.raises(ValueError, match="share elements"):
        attn.flash_attn_with_kvcache(q, broadcast, kc, k, k, cache_seqlens=1, block_table=table)
    # A lazily negated view lives in a copy once resolved: writes would not reach it.
    neg = torch._neg_view(kc)
    with pytest.raises(ValueError, match="lazily negated"):
        attn.flash_attn_with_kvcache(q, neg, kc, k, k, cache_seqlens=1, block_table=table)
    assert torch.count_nonzero(kc) == 0
    # Read-only uses of those are fine.
    out = attn.flash_attn_with_kvcache(q, broadcast, kc, cache_seqlens=3, block_table=table)
    assert out.shape == (1, 1, 2, 8) and torch.count_nonzero(out) == 0


# ---------------------------------------------------------------------------------------
# PagedKVCache.


def _append_all(cache, seq, k, v, chunks):
    """Appends (t, Hk, D) tokens in chunks of the given sizes."""
    at = 0
    for n in chunks:
        cache.append(seq, k[at : at + n], v[at : at + n])
        at += n


@pytest.mark.parametrize("page_size", [16, 5])
def test_paged_cache_decode_batch_matches_the_formula(page_size):
    rng = np.random.default_rng(10)
    hq, hkv, d, dv = 8, 2, 16, 8
    cache = attn.PagedKVCache(64, page_size, hkv, d, dv)
    assert (cache.num_pages, cache.page_size, cache.kv_heads, cache.head_dim, cache.value_dim) == (64, page_size, hkv, d, dv)
    lengths = [1, 23, 40, 0]
    seqs, keys, values = [], [], []
    for n in lengths:
        s = cache.add_sequence()
        k, v = ref.randn(rng, (n, hkv, d)), ref.randn(rng, (n, hkv, dv))
        _append_all(cache, s, k, v, [n // 2, n - n // 2])
        seqs.append(s)
        keys.append(k)
        values.append(v)
        assert cache.seq_len(s) == n and len(cache.pages(s)) == -(-n // page_size)
    assert cache.free_pages == 64 - sum(-(-n // page_size) for n in lengths)
    # Interleaved appends scatter the pages: sequences' pages are not in order in the pool.
    order = [2, 0, 1]  # any order, any subset
    q = ref.randn(rng, (3, 1, hq, d))
    out, lse = cache.attend_with_lse(q, [seqs[i] for i in order])
    assert out.shape == (3, 1, hq, dv) and lse.shape == (3, hq, 1)
    for b, i in enumerate(order):
        want, want_lse = formula(q[b], keys[i], values[i], causal=True)
        close(out[b], want)
        close_lse(lse[b], want_lse)
    # Packed queries: none for the first sequence, a chunk of 3 for the second, one query for
    # the third, none for the empty one (a sequence has at most as many queries as tokens).
    qp = ref.randn(rng, (4, hq, d))
    cu = np.array([0, 0, 3, 4, 4])
    out, lse = cache.attend_with_lse(qp, seqs, cu_seqlens_q=cu)
    assert out.shape == (4, hq, dv) and lse.shape == (hq, 4)
    for i, (lo, hi) in enumerate(zip(cu[:-1], cu[1:])):
        if hi > lo:
            want, want_lse = formula(qp[lo:hi], keys[i], values[i], causal=True)
            close(out[lo:hi], want)
            close_lse(lse[:, lo:hi], want_lse)
    # Without cu_seqlens_q, a packed query has one row a sequence.
    out = cache.attend(qp[:3], seqs[:3], is_causal=False)
    for i in range(3):
        close(out[i : i + 1], formula(qp[i : i + 1], keys[i], values[i])[0])


def test_paged_cache_options():
    rng = np.random.default_rng(11)
    cache = attn.PagedKVCache(16, 4, 1, 8)
    s = cache.add_sequence()
    k, v = ref.randn(rng, (13, 1, 8)), ref.randn(rng, (13, 1, 8))
    cache.append(s, k, v)
    q = ref.randn(rng, (1, 3, 2, 8))
    slopes = np.array([0.25, 0.5], np.float32)
    out = cache.attend(q, [s], window_size=(4, 0), softcap=3.0, alibi_slopes=slopes, scale=0.5)
    want, _ = formula(q[0], k, v, scale=0.5, causal=True, window=(4, 0), softcap=3.0, slopes=slopes)
    close(out[0], want, 1e-4)


def test_fork_shares_and_free_returns_pages():
    rng = np.random.default_rng(12)
    ps, hkv, d = 8, 2, 16
    cache = attn.PagedKVCache(10, ps, hkv, d)
    a = cache.add_sequence()
    k, v = ref.randn(rng, (20, hkv, d)), ref.randn(rng, (20, hkv, d))
    cache.append(a, k, v)  # 2 full pages and a partial one
    assert cache.free_pages == 7
    b = cache.fork(a)
    # The full pages are shared, the partial one copied.
    assert cache.seq_len(b) == 20 and cache.pages(b)[:2] == cache.pages(a)[:2]
    assert cache.pages(b)[2] != cache.pages(a)[2] and cache.free_pages == 6
    assert cache.sequences == [a, b]
    q = ref.randn(rng, (2, 1, 4, d))
    qa = np.concatenate([q[:1], q[:1]])
    out = cache.attend(qa, [a, b])
    np.testing.assert_allclose(out[0], out[1], rtol=1e-6, atol=1e-6)  # a fork's results are its parent's
    close(out[0], formula(qa[0], k, v, causal=True)[0])
    parent = cache.attend(q[:1], [a])
    # Growing the fork leaves the parent's results as they were, and the other way round.
    kb, vb = ref.randn(rng, (7, hkv, d)), ref.randn(rng, (7, hkv, d))
    cache.append(b, kb, vb)
    np.testing.assert_array_equal(cache.attend(q[:1], [a]), parent)
    close(cache.attend(q[1:], [b])[0], formula(q[1], np.concatenate([k, kb]), np.concatenate([v, vb]), causal=True)[0])
    forked = cache.attend(q[1:], [b])
    ka, va = ref.randn(rng, (5, hkv, d)), ref.randn(rng, (5, hkv, d))
    cache.append(a, ka, va)
    np.testing.assert_array_equal(cache.attend(q[1:], [b]), forked)
    close(cache.attend(q[:1], [a])[0], formula(q[0], np.concatenate([k, ka]), np.concatenate([v, va]), causal=True)[0])
    # Freeing the parent keeps the shared pages for the fork; freeing both empties the pool.
    cache.free(a)
    np.testing.assert_array_equal(cache.attend(q[1:], [b]), forked)
    assert cache.sequences == [b]
    with pytest.raises(ValueError, match="sequence 0 was freed"):
        cache.attend(q[:1], [a])
    with pytest.raises(ValueError, match="was freed"):
        cache.append(a, ka, va)
    cache.free(b)
    assert cache.free_pages == 10 and cache.sequences == []


def test_running_out_of_pages_changes_nothing():
    rng = np.random.default_rng(13)
    cache = attn.PagedKVCache(3, 4, 1, 8)
    s = cache.add_sequence()
    k = ref.randn(rng, (10, 1, 8))
    cache.append(s, k, k)
    q = ref.randn(rng, (1, 1, 1, 8))
    before = cache.attend(q, [s])
    with pytest.raises(ValueError, match="free pages"):
        cache.append(s, k[:3], k[:3])  # 13 tokens in 3 pages of 4
    assert cache.seq_len(s) == 10 and cache.free_pages == 0
    np.testing.assert_array_equal(cache.attend(q, [s]), before)
    with pytest.raises(ValueError, match="free pages"):
        cache.fork(s)  # the partial last page needs a copy
    assert cache.sequences == [s]
    cache.append(s, k[:2], k[:2])  # what fits still does
    assert cache.seq_len(s) == 12
    f = cache.fork(s)  # whole pages: shared, no page needed
    assert cache.pages(f) == cache.pages(s)
    with pytest.raises(ValueError, match="free pages"):
        cache.append(f, k[:1], k[:1])
    assert cache.seq_len(f) == 12


def test_latent_cache():
    rng = np.random.default_rng(14)
    cache = attn.PagedKVCache.latent(8, 4, 1, 24, 16)
    assert cache.is_latent and cache.value_dim == 16 and "latent" in repr(cache)
    s = cache.add_sequence()
    rows = ref.randn(rng, (11, 1, 24))
    cache.append_latent(s, rows[:6])
    cache.append_latent(s, rows[6:])
    q = ref.randn(rng, (1, 2, 4, 24))
    out = cache.attend(q, [s])
    assert out.shape == (1, 2, 4, 16)
    close(out[0], formula(q[0], rows, rows[..., :16], causal=True)[0])
    with pytest.raises(ValueError, match="append_latent"):
        cache.append(s, rows, rows[..., :16])
    plain = attn.PagedKVCache(8, 4, 1, 24)
    with pytest.raises(ValueError, match="apart"):
        plain.append_latent(plain.add_sequence(), rows)
    with pytest.raises(ValueError, match="prefix|columns"):
        attn.PagedKVCache.latent(8, 4, 1, 16, 24)


def test_paged_cache_errors():
    rng = np.random.default_rng(15)
    cache = attn.PagedKVCache(8, 4, 2, 8, dtype=np.float16)
    assert cache.dtype == "float16"
    s = cache.add_sequence()
    k = ref.randn(rng, (5, 2, 8), np.float16)
    with pytest.raises(TypeError, match="key has dtype float32 but the cache holds float16"):
        cache.append(s, k.astype(np.float32), k.astype(np.float32))
    with pytest.raises(ValueError, match=r"must be \(tokens, 2, 8\)"):
        cache.append(s, k[None], k[None])  # KVCache's (1, heads, t, d) is not this layout
    with pytest.raises(ValueError, match="different numbers of tokens"):
        cache.append(s, k, k[:4])
    cache.append(s, k, k)
    q = ref.randn(rng, (1, 1, 4, 8), np.float16)
    out = cache.attend(q, [s])
    assert out.dtype == np.float16
    close(out[0], formula(q[0], k, k, causal=True)[0], 4e-3)
    with pytest.raises(ValueError, match="not a sequence of this cache"):
        cache.attend(q, [7])
    with pytest.raises(ValueError, match="not a sequence of this cache"):
        cache.seq_len(-1)
    with pytest.raises(TypeError, match="seqs must be a sequence"):
        cache.attend(q, s)
    with pytest.raises(ValueError, match="names 2"):
        cache.attend(q, [s, s])
    with pytest.raises(ValueError, match="pass cu_seqlens_q"):
        cache.attend(q[0, :, :, :].repeat(2, axis=0), [s])
    with pytest.raises(ValueError, match="cu_seqlens_q goes with a packed query"):
        cache.attend(q, [s], cu_seqlens_q=[0, 1])
    with pytest.raises(ValueError, match="queries"):
        cache.attend(np.zeros((1, 6, 4, 8), np.float16), [s])  # 6 queries, 5 tokens
    with pytest.raises(TypeError, match="query has dtype float32"):
        cache.attend(q.astype(np.float32), [s])
    with pytest.raises(ValueError, match="3 axes"):
        cache.attend(q[0, 0, 0], [s])
    with pytest.raises(ValueError, match="multiple|grouping|heads"):
        cache.attend(np.zeros((1, 1, 3, 8), np.float16), [s])
    with pytest.raises(TypeError, match="attn caches float32, float16 or bfloat16"):
        attn.PagedKVCache(8, 4, 1, 8, dtype="int8")
    with pytest.raises(ValueError, match="page"):
        attn.PagedKVCache(8, 0, 1, 8)
    with pytest.raises(MemoryError):
        attn.PagedKVCache(1 << 30, 1 << 10, 1 << 10, 128)


def test_paged_cache_torch(torch):
    g = torch.Generator().manual_seed(16)
    cache = attn.PagedKVCache(32, 16, 2, 32, dtype=torch.bfloat16)
    a, b = cache.add_sequence(), cache.add_sequence()
    ka = torch.randn(21, 2, 32, generator=g).to(torch.bfloat16)
    kb = torch.randn(9, 2, 32, generator=g).to(torch.bfloat16)
    cache.append(a, ka, ka)
    cache.append(b, kb, kb)
    q = torch.randn(2, 1, 4, 32, generator=g).to(torch.bfloat16)
    out, lse = cache.attend_with_lse(q, torch.tensor([a, b]))
    assert isinstance(out, torch.Tensor) and out.dtype == torch.bfloat16 and out.shape == (2, 1, 4, 32)
    assert lse.dtype == torch.float32 and lse.shape == (2, 4, 1)
    for i, k in enumerate([ka, kb]):
        want = _torch_reference(torch, q[i], k, k, causal=True)
        torch.testing.assert_close(out[i].float(), want, atol=3e-2, rtol=3e-2)
    with pytest.raises(TypeError, match="query has dtype float16 but the cache holds bfloat16"):
        cache.attend(np.zeros((1, 1, 4, 32), np.float16), [a])
    with pytest.raises(TypeError, match="must both be torch tensors"):
        cache.append(a, ka, ka.float().numpy())


# ---------------------------------------------------------------------------------------
# Generated calls, valid and not: each returns the formula's result or raises ValueError or
# TypeError having written nothing — never a panic (PanicException is no Exception).


def _random_call(rng):
    batch = int(rng.integers(0, 4))
    ps = int(rng.integers(1, 6))
    kv_heads = int(rng.integers(1, 3))
    heads = kv_heads * int(rng.integers(1, 3))
    d, dv = int(rng.integers(0, 5)), int(rng.integers(0, 4))
    paged = bool(rng.integers(0, 2))
    new = int(rng.integers(0, 3))
    if paged:
        blocks = int(rng.integers(0, 9))
        max_pages = int(rng.integers(0, 5))
        table = rng.integers(-1, blocks + 1, (batch, max_pages)).astype(np.int32)
        capacity = max_pages * ps
    else:
        blocks = batch if rng.random() < 0.9 else int(rng.integers(0, 4))
        table = None
        capacity = ps
    kc = ref.randn(rng, (blocks, ps, kv_heads, d))
    vc = ref.randn(rng, (blocks, ps, kv_heads, dv))
    seqlens = rng.integers(-1, capacity + 2, batch).astype(np.int32)
    k = ref.randn(rng, (batch, new, kv_heads, d)) if new else None
    v = ref.randn(rng, (batch, new, kv_heads, dv)) if new else None
    q = ref.randn(rng, (batch, int(rng.integers(0, 4)), heads, d))
    windows = [(-1, -1), (0, 0), (1, -1), (2, 1), (-1, 0)]
    options = dict(
        causal=bool(rng.integers(0, 2)),
        window_size=windows[int(rng.integers(0, len(windows)))],
        softcap=[0.0, 1.5][int(rng.integers(0, 2))],
    )
    return dict(q=q, k_cache=kc, v_cache=vc, k=k, v=v, cache_seqlens=seqlens, block_table=table, **options)


@pytest.mark.parametrize("seed", range(8))
def test_generated_calls_compute_or_raise_cleanly(seed):
    rng = np.random.default_rng(100 + seed)
    outcomes = {"ok": 0, "error": 0}
    for _ in range(60):
        args = _random_call(rng)
        kc, vc = args["k_cache"], args["v_cache"]
        before = kc.copy(), vc.copy()
        try:
            out, lse = attn.flash_attn_with_kvcache(**args, return_softmax_lse=True)
        except (ValueError, TypeError):
            outcomes["error"] += 1
            np.testing.assert_array_equal(kc, before[0])
            np.testing.assert_array_equal(vc, before[1])
            continue
        outcomes["ok"] += 1
        q, table, sl, k = args["q"], args["block_table"], args["cache_seqlens"], args["k"]
        new = 0 if k is None else k.shape[1]
        if k is not None:
            tab = table if table is not None else np.arange(q.shape[0], dtype=np.int32)[:, None]
            want_kc, want_vc = expected_caches(before[0], before[1], tab, sl, k, args["v"])
            np.testing.assert_array_equal(kc, want_kc)
            np.testing.assert_array_equal(vc, want_vc)
        for b in range(q.shape[0]):
            length = sl[b] + new
            if table is None:
                keys, values = kc[b, :length], vc[b, :length]
            else:
                keys, values = gather(kc, table[b], length), gather(vc, table[b], length)
            want, want_lse = formula(
                q[b], keys, values, causal=args["causal"], window=args["window_size"], softcap=args["softcap"]
            )
            close(out[b], want, 1e-4)
            close_lse(lse[b], want_lse, 1e-4)
    assert outcomes["ok"] > 0 and outcomes["error"] > 0, outcomes


@pytest.mark.parametrize("seed", range(4))
def test_generated_cache_histories_match_a_model(seed):
    # Random adds, appends, forks and frees on a small pool, against a model that keeps each
    # sequence's tokens; running out of pages must change nothing.
    rng = np.random.default_rng(200 + seed)
    ps, pages, hkv, hq, d = int(rng.integers(1, 6)), 12, 2, 4, 8
    cache = attn.PagedKVCache(pages, ps, hkv, d)
    model = {}
    for _ in range(80):
        op = rng.random()
        if op < 0.15 or not model:
            model[cache.add_sequence()] = (np.zeros((0, hkv, d), np.float32),) * 2
        elif op < 0.55:
            s = list(model)[int(rng.integers(0, len(model)))]
            t = int(rng.integers(0, 2 * ps + 1))
            k, v = ref.randn(rng, (t, hkv, d)), ref.randn(rng, (t, hkv, d))
            free = cache.free_pages
            try:
                cache.append(s, k, v)
            except ValueError as e:
                assert "free pages" in str(e)
                assert cache.free_pages == free and cache.seq_len(s) == len(model[s][0])
                continue
            model[s] = (np.concatenate([model[s][0], k]), np.concatenate([model[s][1], v]))
        elif op < 0.7:
            s = list(model)[int(rng.integers(0, len(model)))]
            try:
                f = cache.fork(s)
            except ValueError as e:
                assert "free pages" in str(e) and cache.free_pages == 0
                continue
            model[f] = model[s]
        elif op < 0.85:
            s = list(model)[int(rng.integers(0, len(model)))]
            cache.free(s)
            del model[s]
        else:
            seqs = [s for s in model if len(model[s][0]) > 0]
            if not seqs:
                continue
            q = ref.randn(rng, (len(seqs), 1, hq, d))
            out = cache.attend(q, seqs)
            for b, s in enumerate(seqs):
                close(out[b], formula(q[b], *model[s], causal=True)[0])
        assert cache.sequences == sorted(model)
        for s, (k, _) in model.items():
            assert cache.seq_len(s) == len(k) and len(cache.pages(s)) == -(-len(k) // ps)
    for s in list(model):
        cache.free(s)
    assert cache.free_pages == pages

"""The boundary examples ("the boundaries hold") for the Python door, each a typed error
or a correct result. Each runs in a child process with a time limit: before the fixes, some
crashed the interpreter, aborted or hung, which must fail the test rather than the run.
The torch examples are in test_torch_boundaries.py."""

import os
import pathlib
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import attn
import reference as ref

HERE = pathlib.Path(__file__).resolve().parent


def isolated(code, timeout=60):
    """Runs ``code`` in a fresh interpreter (with attn, NumPy and these tests' helpers
    importable); fails on a crash, an abort, a hang past ``timeout`` seconds, or an
    exception, and returns what the code printed."""
    env = dict(os.environ, PYTHONPATH=str(HERE) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    prelude = "import numpy as np, attn, reference as ref, robustness as rb\n"
    try:
        r = subprocess.run([sys.executable, "-c", prelude + textwrap.dedent(code)], capture_output=True, text=True,
                           timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        pytest.fail(f"hang: no answer within {timeout} s")
    assert r.returncode == 0, f"exit status {r.returncode} (a negative one is a signal: a crash)\n{r.stderr[-2000:]}"
    return r.stdout


# ---------------------------------------------------------------------------------------
# DLPack: a descriptor is checked before anything is read through it.


def test_dlpack_null_shape_is_a_value_error():
    out = isolated("""
        x = np.ones((2, 3, 4), np.float32)
        cap = rb.Capsule(x, x.ctypes.data, 0, [2, 3, 4], [12, 4, 1], (2, 32, 1), null_shape=True)
        try:
            attn.scaled_dot_product_attention(cap, x, x)
        except ValueError as e:
            print(e)
    """)
    assert "invalid DLPack tensor: ndim 3 with a NULL shape pointer" in out


def test_dlpack_null_data_is_a_value_error_unless_empty():
    out = isolated("""
        x = np.ones((2, 3, 4), np.float32)
        cap = rb.Capsule(x, 0, 0, [2, 3, 4], [12, 4, 1], (2, 32, 1))
        try:
            attn.scaled_dot_product_attention(x, cap, x)
        except ValueError as e:
            print(e)
        # Empty: NULL data is allowed, nothing is read.
        e = np.ones((2, 0, 4), np.float32)
        empty = rb.Capsule(e, 0, 0, [2, 0, 4], None, (2, 32, 1))
        print(attn.scaled_dot_product_attention(empty, x, x).shape)
    """)
    assert "key: invalid DLPack tensor: data is NULL but shape [2, 3, 4] is not empty" in out
    assert "(2, 0, 4)" in out


@pytest.mark.parametrize(
    "fields,message",
    [
        ({"ndim": -1}, "ndim -1 is not in 0..=64"),
        ({"ndim": 2**31 - 1}, "ndim 2147483647 is not in 0..=64"),
        ({"shape": [2, -3, 4]}, "has a negative size"),
        ({"shape": [1, 2**63 - 1, 1], "strides": [0, -(2**63), 1]}, "overflow"),
        ({"shape": [2, 2**40, 4], "strides": [12, 2**30, 1]}, "reaches beyond the address space"),
        ({"byte_offset": 2**64 - 4}, "reaches beyond the address space"),
        ({"shape": [2**62, 2**62, 4], "strides": [0, 0, 1]}, "more than isize::MAX elements"),
    ],
)
def test_dlpack_inconsistent_descriptors_are_value_errors(fields, message):
    spec = {"shape": [2, 3, 4], "strides": [12, 4, 1], "byte_offset": 0, "ndim": None, **fields}
    out = isolated(f"""
        x = np.ones((2, 3, 4), np.float32)
        spec = {spec!r}
        cap = rb.Capsule(x, x.ctypes.data, spec["byte_offset"], spec["shape"], spec["strides"], (2, 32, 1), ndim=spec["ndim"])
        try:
            attn.scaled_dot_product_attention(cap, x, x)
            print("accepted")
        except ValueError as e:
            print(e)
    """)
    assert message in out


def test_dlpack_descriptor_fields_that_attn_does_not_read_are_type_and_value_errors():
    out = isolated("""
        x = np.ones((2, 3, 4), np.float32)
        for kw in ({"device": 2}, {"version": (2, 0)}, {"name": b"used_dltensor"}, {"dtype": (2, 32, 4)}):
            kw = dict({"dtype": (2, 32, 1)}, **kw)
            cap = rb.Capsule(x, x.ctypes.data, 0, [2, 3, 4], [12, 4, 1], **kw)
            try:
                attn.scaled_dot_product_attention(cap, x, x)
            except (TypeError, ValueError) as e:
                print("ValueError" if isinstance(e, ValueError) else "TypeError", e)
    """)
    assert "ValueError query is on device cuda:0" in out
    assert "TypeError query: DLPack version 2.0 is not supported" in out
    assert "TypeError query.__dlpack__() returned a capsule that is not an unconsumed DLPack tensor" in out
    assert "TypeError query has dtype floatx4" in out or "TypeError query has dtype float32x4" in out


def test_dlpack_honest_layouts_compute():
    # Negative strides, misaligned data, NULL strides for compact data, a CUDA-host device:
    # read as described, and equal to the formula.
    rng = np.random.default_rng(27)
    q, k, v = (ref.randn(rng, (2, 3, 5, 8)) for _ in range(3))
    for seed in range(20):
        r = np.random.default_rng(seed)
        caps = [rb_capsule(r, x, compact=seed % 4 == 0, legacy=seed % 3 == 0) for x in (q, k, v)]
        out = attn.scaled_dot_product_attention(*[c for c, _ in caps])
        np.testing.assert_allclose(out, ref.sdpa(*[s for _, s in caps])[0], rtol=1e-4, atol=1e-4)


def rb_capsule(rng, x, **kw):
    import robustness

    return robustness.honest_capsule(rng, x, **kw)


# ---------------------------------------------------------------------------------------
# Sizes: checked before walking or allocating.


def test_query_broadcast_to_2_40_with_empty_values():
    out = isolated("""
        base = np.ones((1, 1, 1, 4, 8), np.float32)
        q = np.lib.stride_tricks.as_strided(base, (2**40, 1, 1, 4, 8), (0,) + base.strides[1:])
        k = np.ones((1, 1, 1, 5, 8), np.float32)
        v = np.ones((1, 1, 1, 5, 0), np.float32)
        o = attn.scaled_dot_product_attention(q, k, v)
        print(o.shape, o.size)
        try:
            attn.attention_with_lse(q, k, v)
        except MemoryError as e:
            print("MemoryError")
    """)
    assert f"({2**40}, 1, 1, 4, 0) 0" in out
    assert "MemoryError" in out


def test_masks_are_checked_before_they_are_walked():
    out = isolated("""
        q = np.ones((2, 3, 4, 8), np.float32)
        k = np.ones((2, 3, 5, 8), np.float32)
        for shape in [(2**20, 2**20, 4, 5), (2**40, 4, 5), (2**20, 2**20, 7, 7)]:
            m = np.broadcast_to(np.ones(shape[-2:], bool), shape)
            try:
                attn.scaled_dot_product_attention(q, k, k, m)
            except ValueError as e:
                print("ValueError", "does not broadcast" in str(e))
        # A mask as large as a query broadcast just as far: the output cannot be made.
        big = np.broadcast_to(q[:1, :1], (2**20, 2**20, 4, 8))
        m = np.broadcast_to(np.ones((4, 5), bool), (2**20, 2**20, 4, 5))
        try:
            attn.scaled_dot_product_attention(big, k[:1, :1], k[:1, :1], m)
        except MemoryError:
            print("MemoryError")
    """, timeout=30)
    assert out.count("ValueError True") == 3
    assert "MemoryError" in out


def test_a_broadcast_mask_with_odd_bytes_is_not_materialised():
    # Bytes other than 0/1 are normalised in a copy of the distinct bytes only: a mask
    # broadcast over 2^40 positions is copied as its one (4, 5) matrix (and the output,
    # 2^47 bytes, is refused).
    out = isolated("""
        rng = np.random.default_rng(3)
        q = ref.randn(rng, (1, 1, 4, 8))
        k = ref.randn(rng, (1, 1, 5, 8))
        raw = rng.integers(0, 3, (4, 5), dtype=np.uint8) * 100
        m = np.broadcast_to(raw.view(np.bool_), (2**20, 2**20, 4, 5))
        qb, kb = np.broadcast_to(q, (2**20, 2**20, 4, 8)), np.broadcast_to(k, (2**20, 2**20, 5, 8))
        try:
            attn.scaled_dot_product_attention(qb, kb, kb, m)
        except MemoryError:
            print("MemoryError")
        out = attn.scaled_dot_product_attention(q, k, k, m[:1, :1])
        print(np.abs(out - ref.sdpa(q, k, k, raw != 0)[0]).max() < 1e-5)
    """, timeout=30)
    assert out.split() == ["MemoryError", "True"]


@pytest.mark.parametrize("scale", [float("nan"), float("inf"), float("-inf"), 1e300, -1e300])
def test_hostile_scales_are_value_errors(scale):
    q = np.ones((1, 2, 3, 4), np.float32)
    with pytest.raises(ValueError, match="is invalid"):
        attn.scaled_dot_product_attention(q, q, q, scale=scale)


@pytest.mark.parametrize("scale", [0.0, -0.0, -1.0, -1e-45])
def test_zero_and_negative_scales_are_torchs(scale):
    """torch takes any float scale: 0 makes every score 0 (uniform weights over the visible
    keys), a negative one reverses the scores; forward and backward, NumPy arrays."""
    rng = np.random.default_rng(3)
    q, k, v = (rng.standard_normal(s).astype(np.float32) for s in ((1, 2, 3, 4), (1, 2, 5, 4), (1, 2, 5, 4)))
    out, lse = attn.attention_with_lse(q, k, v, scale=scale)
    want, want_lse = ref.sdpa(q, k, v, None, scale=scale)
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-5, atol=1e-5)
    g = rng.standard_normal(out.shape).astype(np.float32)
    got = attn.attention_backward(g, q, k, v, out, lse, scale=scale)
    for a, w in zip(got, ref.sdpa_backward(g, q, k, v, None, scale=scale)):
        np.testing.assert_allclose(a, w, rtol=1e-4, atol=1e-5)


# ---------------------------------------------------------------------------------------
# Threads: every input is held for the whole call.


def test_resize_during_a_call_raises_instead_of_freeing_the_buffer():
    # In a child: had the resize freed the buffer, the call would read freed memory.
    out = isolated("""
        import sys, threading, time
        rng = np.random.default_rng(5)
        q = ref.randn(rng, (1, 8, 2048, 64))
        for _ in range(5):
            k = ref.randn(np.random.default_rng(6), (1, 8, 2048, 64))
            start = time.perf_counter()
            want = attn.scaled_dot_product_attention(q, k, k)
            duration = time.perf_counter() - start
            result = []
            base = sys.getrefcount(k)
            t = threading.Thread(target=lambda: result.append(attn.scaled_dot_product_attention(q, k, k)))
            t.start()
            while sys.getrefcount(k) <= base and not result:
                time.sleep(0)  # until the call holds the key
            time.sleep(duration / 4)  # well inside it
            try:
                k.resize((8,))  # with NumPy's reference check
            except ValueError as e:
                t.join()
                print("refused:", e)
                print("same result:", np.array_equal(result[0], want))  # read the key it was given
                break
            t.join()
            if not result:
                print("freed")
                break
            # The call had ended before the resize (a starved thread): not a test; again.
        else:
            print("never overlapped")
    """, timeout=300)
    if "never overlapped" in out:
        pytest.skip("the call never overlapped the resize (the machine is too loaded)")
    assert "refused: cannot resize" in out and "same result: True" in out, out

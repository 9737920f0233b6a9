"""Hostile inputs for the Python door, generated from a seed, and the child process that
runs them.

Each case is rebuilt from ``(suite, seed, index)`` alone, so the parent (test_robustness.py)
sends the child only those numbers and a crash, an abort or a hang is pinned to one case.
The suites:

- ``dlpack``: a consistent attention problem whose operands are DLPack capsules built here
  with ctypes, honest (any strides, negative and zero included, offsets, misaligned data,
  legacy or versioned capsules, NULL strides for compact data, empty tensors with NULL data)
  or with one field corrupted (NULL shape or data, ``ndim`` out of range, negative sizes,
  extents or offsets that overflow, unknown dtypes, devices, versions, capsule names);
- ``numpy``: NumPy arrays laid out every way NumPy allows (transposed, negative and zero
  strides, broadcast to 2^40 positions, non-contiguous, read-only, unaligned, zero-length
  axes, wrong dtypes and byte orders) with hostile options (scale NaN, ±inf, 0, denormal;
  a dropout probability outside [0, 1]; masks that do not broadcast or broadcast to
  enormous shapes).

What the contract allows for each case: a correct result (equal to the float64 formula of
reference.py), or a typed error (``ValueError``, ``TypeError``, ``OverflowError``,
``MemoryError``). A case also says which of the two it must be when that is known (an
honest capsule must compute; a corrupt one must be refused). Anything else — another
exception, a wrong or NaN result, a crash, a hang — is a failure.

Run as a script, this is the child: it reads ``suite seed index`` lines on stdin and prints
one JSON line per case.
"""

import ctypes
import json
import math
import sys

import numpy as np

import reference as ref

TYPED = (ValueError, TypeError, OverflowError, MemoryError)

# ---------------------------------------------------------------------------------------
# DLPack structures (dlpack.h), and capsules made from them.


class DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


class DLManagedTensor(ctypes.Structure):
    _fields_ = [("dl_tensor", DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", ctypes.c_void_p)]


class DLPackVersion(ctypes.Structure):
    _fields_ = [("major", ctypes.c_uint32), ("minor", ctypes.c_uint32)]


class DLManagedTensorVersioned(ctypes.Structure):
    _fields_ = [
        ("version", DLPackVersion),
        ("manager_ctx", ctypes.c_void_p),
        ("deleter", ctypes.c_void_p),
        ("flags", ctypes.c_uint64),
        ("dl_tensor", DLTensor),
    ]


_capsule_new = ctypes.pythonapi.PyCapsule_New
_capsule_new.restype = ctypes.py_object
_capsule_new.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]

DTYPES = {np.dtype(np.float32): (2, 32, 1), np.dtype(np.float16): (2, 16, 1), np.dtype(np.bool_): (6, 8, 1)}


class Capsule:
    """A DLPack producer over memory it owns (``buf``), described by fields the generator
    sets freely: ``__dlpack__`` returns a new capsule (no destructor: the producer keeps the
    structures and the memory alive, as the caller holds it through the call)."""

    def __init__(self, buf, data, byte_offset, shape, strides, dtype, ndim=None, device=1, version=(1, 0), flags=0,
                 legacy=False, name=None, null_shape=False, result=None):
        self.buf = buf
        n = len(shape) if ndim is None else ndim
        self.shape_arr = (ctypes.c_int64 * max(len(shape), 1))(*shape)
        self.strides_arr = None if strides is None else (ctypes.c_int64 * max(len(strides), 1))(*strides)
        t = DLTensor()
        t.data = data
        t.device = DLDevice(device, 0)
        t.ndim = n
        t.dtype = DLDataType(*dtype)
        t.shape = ctypes.cast(None if null_shape else self.shape_arr, ctypes.POINTER(ctypes.c_int64))
        t.strides = ctypes.cast(self.strides_arr, ctypes.POINTER(ctypes.c_int64))
        t.byte_offset = byte_offset
        if legacy:
            self.managed = DLManagedTensor(t, None, None)
        else:
            self.managed = DLManagedTensorVersioned(DLPackVersion(*version), None, None, flags, t)
        self.name = name if name is not None else (b"dltensor" if legacy else b"dltensor_versioned")
        self.result = result

    def __dlpack__(self, **kwargs):
        if self.result is not None:
            return self.result
        return _capsule_new(ctypes.addressof(self.managed), self.name, None)

    def __dlpack_device__(self):
        return (self.managed.dl_tensor.device.device_type, 0)


def honest_layout(rng, shape, itemsize, compact=False, misalign=False, rows=True):
    """A buffer and a strided layout of ``shape`` inside it: ``(buf, first, strides)`` with
    ``first`` the byte offset of element ``[0, …]`` and ``strides`` in elements (any order,
    padding, sign; 0 on some axes, which then repeat one value). ``rows``: the last axis
    has stride 1, as attn requires of query, key and value."""
    nd = len(shape)
    strides = [0] * nd
    step = 1
    if compact:
        order = list(range(nd))[::-1]
    elif rows and nd:
        order = [nd - 1] + list(rng.permutation(nd - 1))
    else:
        order = list(rng.permutation(nd))
    for a in order:
        fixed = compact or (rows and a == nd - 1)
        if not fixed and rng.random() < 0.15:
            strides[a] = 0
            continue
        strides[a] = step
        step *= max(shape[a], 1) * (1 if fixed or rng.random() < 0.6 else int(rng.integers(2, 4)))
    if not compact:
        strides = [-s if rng.random() < 0.25 and not (rows and a == nd - 1) else s for a, s in enumerate(strides)]
    empty = 0 in shape
    back = 0 if empty else sum((n - 1) * -s for n, s in zip(shape, strides) if s < 0)
    ahead = 0 if empty else sum((n - 1) * s for n, s in zip(shape, strides) if s > 0)
    skew = int(rng.integers(1, itemsize)) if misalign and itemsize > 1 else 0
    pad = int(rng.integers(0, 3)) * itemsize
    first = pad + skew + back * itemsize
    buf = np.zeros(first + (ahead + 1) * itemsize + 16, dtype=np.uint8)
    return buf, first, strides


def strided_view(buf, first, shape, strides, dtype):
    """The NumPy view of a layout (the same memory the capsule describes)."""
    dtype = np.dtype(dtype)
    byte = [s * dtype.itemsize for s in strides]
    if 0 in shape:
        return np.zeros(shape, dtype)
    return np.ndarray(shape, dtype, buffer=buf, offset=first, strides=byte)


def honest_capsule(rng, values, compact=False, legacy=False):
    """A capsule holding ``values`` (float32, float16 or bool) in a random honest layout, and
    the values as the consumer must read them (zero strides repeat one entry)."""
    dtype = values.dtype
    shape = list(values.shape)
    misalign = rng.random() < 0.2
    rows = dtype != np.bool_
    buf, first, strides = honest_layout(rng, shape, dtype.itemsize, compact=compact, misalign=misalign, rows=rows)
    if dtype == np.bool_:
        raw = strided_view(buf, first, shape, strides, np.uint8)
        if raw.size:
            # Bytes other than 0 and 1 count as True, as in NumPy.
            raw[...] = np.where(values, rng.integers(1, 256, values.shape), 0).astype(np.uint8)
        seen = np.array(raw) != 0
    else:
        view = strided_view(buf, first, shape, strides, dtype)
        if view.size:
            view[...] = values
        seen = np.array(view)
    addr = buf.ctypes.data
    split = int(rng.integers(0, first + 1)) if rng.random() < 0.5 else first
    data, offset = addr + split, first - split
    if 0 in shape and rng.random() < 0.5:
        data, offset = 0, 0  # an empty tensor may have no data
    cap = Capsule(buf, data, offset, shape, None if compact and rng.random() < 0.5 else strides,
                  DTYPES[dtype], legacy=legacy, flags=int(rng.integers(0, 8)) if not legacy else 0,
                  version=(1, int(rng.integers(0, 4))), device=1 if rng.random() < 0.9 else 3)
    return cap, seen


# Corruptions of one capsule; each must be refused with a typed error.
def _null_shape(rng, cap):
    if cap.managed.dl_tensor.ndim == 0:
        return False
    cap.managed.dl_tensor.shape = ctypes.cast(None, ctypes.POINTER(ctypes.c_int64))
    return True


def _empty(cap):
    return 0 in list(cap.shape_arr)[: cap.managed.dl_tensor.ndim]


# An empty tensor is read nowhere: its data and extent are not checked (NULL data is
# allowed), so the corruptions of those apply to non-empty tensors.
def _null_data(rng, cap):
    if _empty(cap):
        return False
    cap.managed.dl_tensor.data = None
    cap.managed.dl_tensor.byte_offset = 0
    return True


def _ndim(rng, cap):
    cap.managed.dl_tensor.ndim = int(rng.choice([-1, -(2**31), 65, 1000, 2**31 - 1]))
    return True


def _negative_size(rng, cap):
    n = cap.managed.dl_tensor.ndim
    if n == 0:
        return False
    cap.shape_arr[int(rng.integers(0, n))] = -int(rng.choice([1, 2**40, 2**63]))
    return True


def _extent_overflow(rng, cap):
    n = cap.managed.dl_tensor.ndim
    if n == 0 or _empty(cap):
        return False
    a = int(rng.integers(0, n))
    cap.shape_arr[a] = int(rng.choice([2**31, 2**40, 2**62, 2**63 - 1]))
    if cap.strides_arr is None:
        cap.strides_arr = (ctypes.c_int64 * n)(*([1] * n))
        cap.managed.dl_tensor.strides = ctypes.cast(cap.strides_arr, ctypes.POINTER(ctypes.c_int64))
    cap.strides_arr[a] = int(rng.choice([2**31, 2**40, 2**62, -(2**62), 2**63 - 1, -(2**63)]))
    return True


def _offset_overflow(rng, cap):
    # Past the address space (an offset inside it, 2^62 say, is a lie no consumer can see).
    if _empty(cap):
        return False
    cap.managed.dl_tensor.byte_offset = int(rng.choice([2**63, 2**64 - 1, 2**64 - 8]))
    return True


def _dtype(rng, cap):
    known = set(DTYPES.values()) | {(4, 16, 1)}  # bfloat16 is supported with torch
    while True:
        d = (int(rng.integers(0, 9)), int(rng.choice([0, 1, 4, 8, 16, 32, 64, 128, 255])), int(rng.choice([0, 1, 2, 4, 65535])))
        if d not in known:
            break
    cap.managed.dl_tensor.dtype = DLDataType(*d)
    return True


def _device(rng, cap):
    cap.managed.dl_tensor.device = DLDevice(int(rng.choice([0, 2, 4, 7, 8, 10, 13, 14, 17, 99, -1])), int(rng.integers(0, 4)))
    return True


def _version(rng, cap):
    if isinstance(cap.managed, DLManagedTensor):
        return False
    cap.managed.version = DLPackVersion(int(rng.choice([0, 2, 3, 2**32 - 1])), int(rng.integers(0, 9)))
    return True


def _name(rng, cap):
    cap.name = bytes(rng.choice([b"used_dltensor", b"used_dltensor_versioned", b"tensor", b"dltensor_v"]))
    return True


def _not_a_capsule(rng, cap):
    cap.result = [42, "dltensor", b"x", ()][int(rng.integers(0, 4))]
    return True


CORRUPTIONS = [_null_shape, _null_data, _ndim, _negative_size, _extent_overflow, _offset_overflow, _dtype, _device,
               _version, _name, _not_a_capsule]


# ---------------------------------------------------------------------------------------
# Problems.


def _problem(rng, dtype, allow_empty=True):
    """A consistent call: leading shapes (with broadcasting), sizes, a mask, options."""
    rank = int(rng.integers(0, 4))
    lead = [int(rng.integers(1, 4)) for _ in range(rank)]
    if allow_empty and rank and rng.random() < 0.1:
        lead[int(rng.integers(0, rank))] = 0
    sizes = {k: int(rng.integers(0 if allow_empty and rng.random() < 0.08 else 1, 9)) for k in ("L", "S", "Ev")}
    e = int(rng.integers(1, 9))
    gqa = bool(rank and rng.random() < 0.2 and lead[-1] in (2, 3))
    heads = lead[-1] if rank else 1
    kv_lead = list(lead)
    if gqa:
        kv_lead[-1] = 1

    def operand_lead(base):
        # Leading axes that broadcast: some dropped (rank broadcast), some 1.
        out = [1 if rng.random() < 0.2 else n for n in base]
        drop = int(rng.integers(0, len(out) + 1)) if rng.random() < 0.2 else 0
        return out[drop:]

    ql, kvl = operand_lead(lead), operand_lead(kv_lead)
    q_shape = tuple(ql) + (sizes["L"], e)
    k_shape = tuple(kvl) + (sizes["S"], e)
    v_shape = tuple(kvl) + (sizes["S"], sizes["Ev"])
    # The output's leading shape: the broadcast, grouped kv heads counted as the query's.
    kv_seen = list(kvl)
    if gqa and kv_seen and len(ql) >= len(kv_seen):
        kv_seen[-1] = ql[-1]
    out_lead = list(np.broadcast_shapes(tuple(ql), tuple(kv_seen)))
    mask = None
    kind = rng.choice(["none", "bool", "float", "half"], p=[0.4, 0.3, 0.2, 0.1])
    if kind != "none":
        full = out_lead + [sizes["L"], sizes["S"]]
        m_shape = [1 if rng.random() < 0.4 else n for n in full]
        m_shape = m_shape[int(rng.integers(0, len(m_shape) + 1)) if rng.random() < 0.3 else 0:]
        if kind == "bool":
            mask = np.asarray(rng.random(m_shape) < 0.7)
        elif kind == "float" or dtype != np.float16:
            mask = np.asarray(rng.standard_normal(m_shape), dtype=np.float32)
        else:
            mask = np.asarray(rng.standard_normal(m_shape), dtype=np.float16)
    opts = {}
    if gqa:
        opts["enable_gqa"] = True
    if mask is None and rng.random() < 0.3:
        opts["is_causal"] = True
    if rng.random() < 0.3:
        opts["scale"] = float(rng.uniform(0.05, 2.0))
    q = ref.randn(rng, q_shape, dtype)
    k = ref.randn(rng, k_shape, dtype)
    v = ref.randn(rng, v_shape, dtype)
    return q, k, v, mask, opts


def _entry(rng):
    return rng.choice(["sdpa", "lse", "backward"], p=[0.5, 0.25, 0.25])


def dlpack_case(seed, index):
    """A call whose operands are capsules (some honest, maybe one corrupted)."""
    rng = np.random.default_rng([seed, index])
    dtype = np.float16 if rng.random() < 0.25 else np.float32
    q, k, v, mask, opts = _problem(rng, dtype)
    operands = {"query": q, "key": k, "value": v}
    if mask is not None:
        operands["attn_mask"] = mask
    passed, seen = {}, {}
    for name, x in operands.items():
        if rng.random() < 0.7:
            compact = rng.random() < 0.2
            passed[name], seen[name] = honest_capsule(rng, x, compact=compact, legacy=rng.random() < 0.25)
        else:
            passed[name], seen[name] = x, x
    expect = "ok"
    what = "honest"
    caps = [n for n, x in passed.items() if isinstance(x, Capsule)]
    if caps and rng.random() < 0.5:
        target = caps[int(rng.integers(0, len(caps)))]
        for _ in range(8):
            corrupt = CORRUPTIONS[int(rng.integers(0, len(CORRUPTIONS)))]
            if corrupt(rng, passed[target]):
                expect, what = "error", f"{target}: {corrupt.__name__[1:]}"
                break
    if expect == "ok" and caps and rng.random() < 0.1:
        # A zero-stride axis broadcast to 2^40 (or 2^62) positions: correct or refused.
        target = caps[int(rng.integers(0, len(caps)))]
        cap = passed[target]
        n = cap.managed.dl_tensor.ndim
        if n > 2 and cap.strides_arr is not None:
            a = int(rng.integers(0, n - 2))
            cap.shape_arr[a] = int(rng.choice([2**40, 2**62]))
            cap.strides_arr[a] = 0
            expect, what = "any", f"{target}: broadcast to {cap.shape_arr[a]}"
    return {"entry": _entry(rng), "passed": passed, "seen": seen, "opts": opts, "expect": expect, "what": what}


def _numpy_layout(rng, x, name):
    """``x`` in a layout NumPy allows, and what it is; or a hostile variant with its
    expectation."""
    r = rng.random()
    if r < 0.15 and x.ndim >= 2:
        perm = list(rng.permutation(x.ndim - 1)) + [x.ndim - 1]
        base = np.ascontiguousarray(x.transpose(np.argsort(perm)))
        return base.transpose(perm), "transposed", "ok"
    if r < 0.3 and x.size:
        axes = tuple(a for a in range(x.ndim) if rng.random() < 0.5)
        flipped = np.ascontiguousarray(np.flip(x, axes))
        # A reversed feature axis is not contiguous: refused, as any stride but 1 there.
        last = x.ndim - 1 in axes and x.shape[-1] > 1 and name != "attn_mask"
        return np.flip(flipped, axes), "negative strides", "error" if last else "ok"
    if r < 0.4 and x.ndim >= 1:
        y = x.copy()
        y.flags.writeable = False
        return y, "read-only", "ok"
    if r < 0.5 and x.ndim >= 2 and x.dtype != np.bool_:
        raw = np.zeros(x.nbytes + 1, np.uint8)
        y = np.frombuffer(raw.data, dtype=x.dtype, count=x.size, offset=1).reshape(x.shape)
        y[...] = x
        return y, "unaligned", "ok"
    if r < 0.58 and x.ndim >= 2:
        padded = np.zeros(x.shape[:-2] + (x.shape[-2] * 2 + 1, x.shape[-1]), x.dtype)
        padded[..., 1::2, :] = x
        return padded[..., 1::2, :], "strided rows", "ok"
    if r < 0.64 and x.ndim >= 3 and x.shape[0] == 1:
        n = int(rng.choice([3, 2**40]))
        y = np.lib.stride_tricks.as_strided(x, (n,) + x.shape[1:], (0,) + x.strides[1:])
        return y, f"axis 0 broadcast to {n}", "any"
    if r < 0.68 and x.size and x.shape[-1] > 1 and name != "attn_mask":
        wide = np.repeat(x, 2, axis=-1)
        return wide[..., ::2], "last axis stride 2", "error"
    if r < 0.74 and name != "attn_mask":
        bad = rng.choice(["float64", "int32", "complex64", ">f4", "bool", "uint8", "object"])
        return x.astype(bad), f"dtype {bad}", "error" if x.dtype != np.dtype(bad) else "ok"
    if r < 0.78:
        return x.reshape(x.shape), "0-d or plain", "ok"
    return x, "plain", "ok"


def _numpy_mask(rng, mask, q_shape, l, s):
    r = rng.random()
    if mask is None:
        return None, "no mask", "ok"
    if r < 0.1:
        big = (2**20, 2**20, l, s) if rng.random() < 0.5 else (2**40, l, s)
        base = mask[(0,) * (mask.ndim - 2)] if mask.ndim > 2 else mask
        return np.broadcast_to(base, big), "mask broadcast to an enormous shape", "any"
    if r < 0.18:
        shape = tuple(int(rng.integers(2, 7)) for _ in range(int(rng.integers(1, 5))))
        return np.ones(shape, bool), "mask of another shape", "any"
    if r < 0.24 and mask.dtype == np.float32:
        return mask.astype(np.float64), "float64 mask", "error"
    if r < 0.3 and mask.dtype == np.bool_:
        raw = (mask.astype(np.uint8) * np.random.default_rng(1).integers(1, 255, mask.shape, dtype=np.uint8))
        return raw.view(np.bool_), "mask bytes beyond 0/1", "ok"
    return mask, "mask", "ok"


SCALES = [None, 0.5, 0.0, -1.0, float("nan"), float("inf"), float("-inf"), 1e-45, 1e-300, 1e300]


def numpy_case(seed, index):
    """A call on NumPy arrays in hostile layouts, with hostile options."""
    rng = np.random.default_rng([seed, index, 1])
    dtype = np.float16 if rng.random() < 0.25 else np.float32
    q, k, v, mask, opts = _problem(rng, dtype)
    expect, whats = "ok", []

    def worse(e):
        nonlocal expect
        order = {"ok": 0, "any": 1, "error": 2}
        # "error" wins over everything; "any" over "ok".
        if order[e] > order[expect]:
            expect = e

    passed, seen = {}, {}
    for name, x in (("query", q), ("key", k), ("value", v)):
        y, what, e = _numpy_layout(rng, x, name)
        passed[name], seen[name] = y, y
        whats.append(f"{name}: {what}")
        worse(e)
    if mask is not None:
        m, what, e = _numpy_mask(rng, mask, q.shape, q.shape[-2], k.shape[-2])
        passed["attn_mask"] = m
        seen["attn_mask"] = m if what != "mask bytes beyond 0/1" else (m.view(np.uint8) != 0)
        whats.append(what)
        worse(e)
    if rng.random() < 0.3:
        opts["scale"] = SCALES[int(rng.integers(0, len(SCALES)))]
        sc = opts["scale"]
        # torch's rule, any finite scale, within attn's: scale·log2(e) a finite f32 (a
        # scale below f32's range rounds to 0, which is valid).
        with np.errstate(over="ignore"):
            in_f32 = np.float32(sc if sc is not None and math.isfinite(sc) else np.inf) * np.float32(math.log2(math.e))
        if sc is not None and not (math.isfinite(sc) and math.isfinite(in_f32)):
            worse("error")
        whats.append(f"scale {sc}")
    if rng.random() < 0.05:
        # Not a probability (torch's ValueError); valid dropout has its own tests
        # (test_dropout.py), against the mask attn.dropout_mask returns.
        opts["dropout_p"] = float(rng.choice([1.5, float("nan"), -1e-9]))
        worse("error")
    if rng.random() < 0.05 and mask is not None:
        opts["is_causal"] = True
        worse("error")
    return {"entry": _entry(rng), "passed": passed, "seen": seen, "opts": opts, "expect": expect, "what": "; ".join(whats)}


def cache_case(seed, index):
    """A KVCache made with hostile sizes or fed hostile arrays and options; attended queries
    compared with the formula over the tokens appended."""
    rng = np.random.default_rng([seed, index, 2])
    dtype = np.float16 if rng.random() < 0.25 else np.float32
    b, h, d, dv = (int(rng.integers(1, 3)), int(rng.integers(1, 3)), int(rng.integers(1, 9)), int(rng.integers(0, 6)))
    group = int(rng.integers(1, 3))
    cap = int(rng.integers(0, 6))
    sizes = [b, h, cap, d, dv]
    expect, what = "ok", []
    if rng.random() < 0.3:
        a = int(rng.integers(0, 5))
        # Sizes no machine holds (a legitimate cache of gigabytes would only be slow).
        sizes[a] = int(rng.choice([0, 2**40, 2**62, 2**64 - 1, -1]))
        expect = "any"
        what.append(f"size {a} = {sizes[a]}")
    growth = "double" if rng.random() < 0.6 else "fixed"
    steps = []
    for _ in range(int(rng.integers(1, 4))):
        t = int(rng.integers(0, 4))
        k = ref.randn(rng, (b, h, t, d), dtype)
        v = ref.randn(rng, (b, h, t, dv), dtype)
        k2, wk, ek = _numpy_layout(rng, k, "key")
        v2, wv, ev = _numpy_layout(rng, v, "value")
        steps.append((k2, v2, k, v))
        what.append(f"append {wk} / {wv}")
        if "error" in (ek, ev) or "any" in (ek, ev):
            expect = "any"
    n = int(rng.integers(1, 4))
    q = ref.randn(rng, (b, h * group, n, d), dtype)
    opts = {}
    if rng.random() < 0.2:
        opts["scale"] = SCALES[int(rng.integers(0, len(SCALES)))]
        expect = "any"
        what.append(f"scale {opts['scale']}")
    if rng.random() < 0.3:
        opts["is_causal"] = False
    return {"entry": "cache", "sizes": sizes, "dtype": dtype, "growth": growth, "steps": steps, "query": q,
            "opts": opts, "expect": expect, "what": "; ".join(what) or "plain"}


def run_cache_case(attn, case):
    """``run_case`` for the cache suite: every step's outcome, the last attend compared."""
    b, h, cap, d, dv = case["sizes"]
    cached_k, cached_v = [], []
    try:
        cache = attn.KVCache(b, h, cap, d, dv, dtype=case["dtype"], growth=case["growth"])
        for k2, v2, k, v in case["steps"]:
            try:
                cache.append(k2, v2)
            except TYPED as e:
                # Nothing is appended on error; the cache stays usable.
                if case["expect"] == "ok" and "exceeds the capacity" not in str(e):
                    return "bad", f"refused an append that must work: {type(e).__name__}: {e}"
                continue
            cached_k.append(k)
            cached_v.append(v)
        out, lse = cache.attend_with_lse(case["query"], **case["opts"])
    except TYPED as e:
        if case["expect"] == "ok":
            return "bad", f"refused an input that must compute: {type(e).__name__}: {e}"
        return "typed", f"{type(e).__name__}: {e}"
    except BaseException as e:  # noqa: BLE001 - a panic is a BaseException
        return "bad", f"untyped {type(e).__module__}.{type(e).__name__}: {e}"
    if list(cache.lens) != [sum(k.shape[2] for k in cached_k)] * b:
        return "bad", f"lens {cache.lens} after appending {[k.shape[2] for k in cached_k]}"
    k = np.concatenate(cached_k, axis=2) if cached_k else np.zeros((b, h, 0, d), case["dtype"])
    v = np.concatenate(cached_v, axis=2) if cached_v else np.zeros((b, h, 0, dv), case["dtype"])
    q = case["query"]
    causal = case["opts"].get("is_causal", True) and q.shape[2] <= k.shape[2]
    ref_opts = {"scale": case["opts"].get("scale"), "enable_gqa": True}
    if causal:
        ref_opts.update(is_causal=True, alignment="bottom_right")
    if case["opts"].get("is_causal", True) and not causal:
        return "ok", "more queries than cached tokens (the causal alignment is the engine's)"
    want, want_lse = ref.sdpa(q, k, v, **ref_opts)
    tol = _tol(q) * max(1, d)
    if out.shape != want.shape or not np.allclose(out.astype(np.float64), want, rtol=tol, atol=tol):
        return "bad", "wrong result"
    fin = np.isfinite(want_lse)
    if not np.allclose(lse[fin], want_lse[fin], rtol=tol, atol=tol) or not np.all(lse[~fin] == -np.inf):
        return "bad", "wrong LSE"
    return "ok", "correct"


def torch_case(seed, index):
    """A call on torch tensors in the layouts torch makes: transposed, strided, expanded,
    lazily negated (``_neg_view``, ``conj().imag``), half precision, requiring grad; now and
    then a NumPy operand mixed in."""
    import torch

    rng = np.random.default_rng([seed, index, 3])
    q, k, v, mask, opts = _problem(rng, np.float32)
    dtype = [torch.float32, torch.float16, torch.bfloat16][int(rng.choice(3, p=[0.6, 0.2, 0.2]))]
    grad = rng.random() < 0.3
    expect, whats, passed, seen, leaves = "ok", [], {}, {}, {}
    operands = {"query": q, "key": k, "value": v}
    if mask is not None:
        operands["attn_mask"] = mask
    for name, x in operands.items():
        t = torch.from_numpy(np.ascontiguousarray(x))
        if x.dtype != np.bool_:
            t = t.to(dtype) if name != "attn_mask" or x.dtype != np.float32 else t
        r = rng.random()
        if r < 0.2 and t.ndim >= 2 and t.dtype != torch.bool:
            made, what = torch._neg_view((-t).contiguous()), "neg view"
        elif r < 0.3 and t.dtype == torch.float32:
            made, what = torch.complex(torch.zeros_like(t), -t).conj().imag, "conj().imag"
        elif r < 0.45 and t.ndim >= 3:
            perm = list(rng.permutation(t.ndim - 1)) + [t.ndim - 1]
            made, what = t.permute(*map(int, np.argsort(perm))).contiguous().permute(*map(int, perm)), "transposed"
        elif r < 0.55 and t.ndim >= 2:
            wide = torch.zeros(t.shape[:-2] + (2 * t.shape[-2], t.shape[-1]), dtype=t.dtype)
            wide[..., ::2, :] = t
            made, what = wide[..., ::2, :], "strided rows"
        elif r < 0.6 and t.ndim >= 2 and max(t.shape[:-1]) > 1:
            # One entry repeated by a stride of 0 (not along the feature axis, which attn
            # reads contiguous).
            a = int(np.argmax(t.shape[:-1]))
            made, what = t.narrow(a, 0, 1).expand(t.shape), f"expanded along axis {a}"
        else:
            made, what = t.clone(), "plain"
        if grad and name != "attn_mask" and t.dtype != torch.bool:
            made = made.detach().requires_grad_()
            leaves[name] = made
        passed[name] = made
        seen[name] = made.detach().resolve_neg().float().numpy() if made.dtype != torch.bool else made.numpy()
        whats.append(f"{name}: {what}")
    if rng.random() < 0.08:
        name = ["key", "value", "attn_mask"][int(rng.integers(0, 3))]
        if name in passed:
            passed[name] = np.asarray(seen[name]).astype(np.float32) if seen[name].dtype != np.bool_ else seen[name]
            expect = "error"
            whats.append(f"{name} as a NumPy array")
    entry = "lse" if rng.random() < 0.3 else "sdpa"
    return {"entry": entry, "passed": passed, "seen": seen, "opts": opts, "expect": expect,
            "what": "; ".join(whats) + (" (grad)" if grad else ""), "leaves": leaves, "dtype": str(dtype)}


def run_torch_case(attn, case):
    """``run_case`` for torch tensors; with leaves that require grad, their gradients too."""
    import torch

    p, s, opts = case["passed"], case["seen"], case["opts"]
    args = (p["query"], p["key"], p["value"], p.get("attn_mask"))
    ref_opts = {k: v for k, v in opts.items() if k in ("is_causal", "scale", "enable_gqa")}
    try:
        if case["entry"] == "sdpa":
            out = attn.scaled_dot_product_attention(*args, **opts)
            lse = None
        else:
            out, lse = attn.attention_with_lse(*args, **opts)
        if case["leaves"]:
            out.float().sum().backward()
    except TYPED as e:
        if case["expect"] == "ok":
            return "bad", f"refused an input that must compute: {type(e).__name__}: {e}"
        return "typed", f"{type(e).__name__}: {e}"
    except BaseException as e:  # noqa: BLE001 - a panic is a BaseException
        return "bad", f"untyped {type(e).__module__}.{type(e).__name__}: {e}"
    if case["expect"] == "error":
        return "bad", "accepted an input that must be refused"
    seen = (s["query"], s["key"], s["value"], s.get("attn_mask"))
    try:
        want, want_lse = _formula("lse", seen, ref_opts)
        grads = _formula("backward", seen, ref_opts) if case["leaves"] else None
    except Exception as e:  # noqa: BLE001
        return "bad", f"the float64 formula failed (a harness bug): {type(e).__name__}: {e}"
    half = case["dtype"] != "torch.float32"
    tol = (3e-2 if half else 1e-4) * max(1, s["query"].shape[-1])
    pairs = [(out, want)] + ([(lse, want_lse)] if lse is not None else [])
    if grads is not None:
        pairs += [(case["leaves"][n].grad, g) for n, g in zip(("query", "key", "value"), grads) if n in case["leaves"]]
    for got, w in pairs:
        if got is None:
            return "bad", "no gradient"
        g = got.detach().float().numpy().astype(np.float64)
        if g.shape != w.shape:
            return "bad", f"shape {g.shape}, want {w.shape}"
        fin = np.isfinite(w)
        if not np.allclose(g[fin], w[fin], rtol=tol, atol=tol) or not np.array_equal(g[~fin], w[~fin]):
            return "bad", f"wrong result (max error {np.max(np.abs(g[fin] - w[fin])) if fin.any() else 'non-finite'})"
    return "ok", "correct"


SUITES = {"dlpack": dlpack_case, "numpy": numpy_case, "cache": cache_case, "torch": torch_case}
RUNNERS = {"cache": run_cache_case, "torch": run_torch_case}


# ---------------------------------------------------------------------------------------
# The child.


def _finite(*xs):
    return all(x is None or x.dtype == np.bool_ or bool(np.all(np.isfinite(np.asarray(x, dtype=np.float64)))) for x in xs)


def _tol(x):
    return 6e-3 if x.dtype == np.float16 else 1e-4


def _formula(entry, seen, ref_opts):
    """What the call must return, by the float64 formula of reference.py."""
    q, k, v, m = seen
    with np.errstate(all="ignore"):
        if entry == "backward":
            out, _ = ref.sdpa(q, k, v, m, **ref_opts)
            return ref.sdpa_backward(np.ones_like(out), q, k, v, m, **ref_opts)
        out, lse = ref.sdpa(q, k, v, m, **ref_opts)
        # The LSE has the output's leading shape (value's broadcast axes included).
        return (out, np.broadcast_to(lse, out.shape[:-1])) if entry == "lse" else (out,)


def run_case(attn, case):
    """The outcome of one case: ``(status, detail)``; status ``ok``, ``typed`` or ``bad``."""
    p, s, opts = case["passed"], case["seen"], case["opts"]
    args = (p["query"], p["key"], p["value"], p.get("attn_mask"))
    seen = (s["query"], s["key"], s["value"], s.get("attn_mask"))
    ref_opts = {k: v for k, v in opts.items() if k in ("is_causal", "scale", "enable_gqa")}
    try:
        if case["entry"] == "sdpa":
            got = (attn.scaled_dot_product_attention(*args, **opts),)
        elif case["entry"] == "lse":
            got = attn.attention_with_lse(*args, **opts)
        else:
            out, lse = attn.attention_with_lse(*args, **opts)
            go = np.ones_like(np.asarray(out))
            got = attn.attention_backward(go, *args[:3], out, lse, args[3], **opts)
    except TYPED as e:
        if case["expect"] == "ok":
            return "bad", f"refused an input that must compute: {type(e).__name__}: {e}"
        return "typed", f"{type(e).__name__}: {e}"
    except BaseException as e:  # noqa: BLE001 - a panic is a BaseException
        return "bad", f"untyped {type(e).__module__}.{type(e).__name__}: {e}"
    if case["expect"] == "error":
        return "bad", "accepted an input that must be refused"
    q, k, v, m = seen
    if any(x is not None and x.size > 1 << 20 for x in seen):
        # Inputs broadcast beyond what the formula can compute here: only an empty result
        # can have been computed.
        if all(np.asarray(g).size == 0 for g in got):
            return "ok", "empty result of huge operands"
        return "bad", "a non-empty result of operands broadcast beyond any memory"
    try:
        want = _formula(case["entry"], seen, ref_opts)
    except Exception as e:  # noqa: BLE001 - the harness's own failure, told apart
        return "bad", f"the float64 formula failed (a harness bug): {type(e).__name__}: {e}"
    for g, w in zip(got, want):
        g = np.asarray(g)
        if g.shape != w.shape:
            return "bad", f"shape {g.shape}, want {w.shape}"
        if _finite(q, k, v, m) and not np.all(np.isfinite(g[np.isfinite(w)])):
            return "bad", "NaN or inf where the formula is finite"
        tol = _tol(np.asarray(q)) * (10 if case["entry"] == "backward" else 1) * max(1, q.shape[-1] if q.ndim else 1)
        g64 = g.astype(np.float64)
        both = np.isfinite(w)
        if not np.allclose(g64[both], w[both], rtol=tol, atol=tol) or not np.array_equal(g64[~both], w[~both]):
            err = np.max(np.abs(g64[both] - w[both])) if both.any() else "non-finite"
            return "bad", f"wrong result (max error {err})"
    return "ok", "correct"


def main():
    import attn

    for line in sys.stdin:
        suite, seed, index = line.split()
        seed, index = int(seed), int(index)
        if suite == "torch":
            import torch  # noqa: F401 - its first import (seconds) is not a case's time
        print(json.dumps({"start": index}), flush=True)
        case = SUITES[suite](seed, index)
        status, detail = RUNNERS.get(suite, run_case)(attn, case)
        print(json.dumps({"index": index, "status": status, "detail": detail, "what": case["what"],
                          "entry": case["entry"], "expect": case["expect"]}), flush=True)


if __name__ == "__main__":
    main()

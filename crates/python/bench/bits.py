"""The output bits of the Python calls, for bit-for-bit comparisons of two commits.

    $CARGO_TARGET_DIR/python-venv/bin/python crates/python/bench/bits.py OUT

(after ``maturin develop --release`` in ``crates/python``) writes, for a fixed set of
cases, every result of ``scaled_dot_product_attention``, ``attention_with_lse``,
``attention_backward``, the autograd function and ``KVCache`` to OUT in the format of
``cargo xtask bits`` (``benches/src/bin/bits.rs``): per case a header line
``name count fnv64`` and the elements' bits as little-endian ``u32``s. Run it in a
worktree of each commit, on the same CPU, and ``cmp`` the files. The cases cover forward
and backward, shared and per-(batch, head) masks (boolean and additive), grouped-query
heads, float32/float16/bfloat16, both layouts ((B, H, S, D) and the transposed
(B, S, H, D) views), extra leading axes and the KV cache. Cases that need an API a commit
lacks (packed batches) are written only when the call exists, after every other case.
"""

import os
import sys

os.environ.setdefault("RAYON_NUM_THREADS", "2")

import numpy as np  # noqa: E402
import torch  # noqa: E402

import attn  # noqa: E402


class Gen:
    """splitmix64, values in [-2, 2): the generator of benches/src/bin/bits.rs."""

    M = (1 << 64) - 1

    def __init__(self, seed):
        self.s = seed

    def next(self):
        self.s = (self.s + 0x9E3779B97F4A7C15) & self.M
        z = self.s
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & self.M
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & self.M
        z ^= z >> 31
        return (z >> 40) / float(1 << 24) * 4.0 - 2.0

    def array(self, shape):
        n = int(np.prod(shape))
        return np.array([self.next() for _ in range(n)], dtype=np.float32).reshape(shape)


def bits_of(x):
    if isinstance(x, torch.Tensor):
        x = x.detach().contiguous()
        if x.dtype == torch.bfloat16:
            return x.view(torch.int16).numpy().astype(np.uint16).astype(np.uint32).ravel()
        x = x.numpy()
    x = np.ascontiguousarray(x)
    if x.dtype == np.float32:
        return x.view(np.uint32).ravel()
    if x.dtype == np.float16:
        return x.view(np.uint16).astype(np.uint32).ravel()
    raise TypeError(x.dtype)


def fnv(words):
    h = 0xCBF29CE484222325
    for b in words.astype("<u4").tobytes():
        h = ((h ^ b) * 0x100000001B3) & ((1 << 64) - 1)
    return h


class Out:
    def __init__(self):
        self.cases = []

    def push(self, name, *results):
        words = np.concatenate([bits_of(r) for r in results]) if results else np.zeros(0, np.uint32)
        self.cases.append((name, words.astype(np.uint32)))

    def write(self, path):
        with open(path, "wb") as f:
            for name, words in self.cases:
                f.write(f"{name} {len(words)} {fnv(words):016x}\n".encode())
                f.write(words.astype("<u4").tobytes())


DTYPES = {
    "f32": (np.float32, torch.float32),
    "f16": (np.float16, torch.float16),
    "bf16": (None, torch.bfloat16),
}


def torch_of(a, dt):
    return torch.from_numpy(a).to(DTYPES[dt][1])


def main(path):
    g = Gen(7)
    out = Out()
    b, h, hkv, l, s, d = 2, 4, 2, 9, 13, 16
    q = g.array((b, h, l, d))
    k = g.array((b, hkv, s, d))
    v = g.array((b, hkv, s, d))
    k_full = g.array((b, h, s, d))
    v_full = g.array((b, h, s, d))
    go = g.array((b, h, l, d))
    shared_bool = g.array((l, s)) > -1.0
    per_head_bool = g.array((b, h, l, s)) > -1.0
    per_head_bool[0, 1, 3, :] = False  # a row that sees no key
    per_batch_bool = g.array((b, 1, l, s)) > -0.5
    per_head_add = (g.array((1, h, l, s)) * 0.5).astype(np.float32)
    per_head_add[0, 2, :, 5] = -np.inf

    for dt in ["f32", "f16", "bf16"]:
        tq, tk, tv = torch_of(q, dt), torch_of(k, dt), torch_of(v, dt)
        tkf, tvf, tgo = torch_of(k_full, dt), torch_of(v_full, dt), torch_of(go, dt)
        masks = [
            ("none", None),
            ("bool", torch.from_numpy(shared_bool)),
            ("bool_bh", torch.from_numpy(per_head_bool)),
            ("bool_b", torch.from_numpy(per_batch_bool)),
            ("add_h", torch.from_numpy(per_head_add)),
            ("add_h_typed", torch.from_numpy(per_head_add).to(DTYPES[dt][1])),
        ]
        for mname, m in masks:
            for gqa in [False, True]:
                kk, vv = (tk, tv) if gqa else (tkf, tvf)
                causal_opts = [False] if m is not None else [False, True]
                for causal in causal_opts:
                    tag = f"{dt}/{mname}/{'gqa' if gqa else 'mha'}/{'causal' if causal else 'full'}"
                    kw = dict(attn_mask=m, is_causal=causal, enable_gqa=gqa)
                    o = attn.scaled_dot_product_attention(tq, kk, vv, **kw)
                    out.push(f"py/sdpa/{tag}", o)
                    o, lse = attn.attention_with_lse(tq, kk, vv, **kw)
                    out.push(f"py/with_lse/{tag}", o, lse)
                    grads = attn.attention_backward(tgo, tq, kk, vv, o, lse, **kw)
                    out.push(f"py/backward/{tag}", *grads)
            # The (B, S, H, D) layout: transposed views in, and the autograd route.
            tqs = tq.transpose(1, 2).contiguous().transpose(1, 2)
            tks = tk.transpose(1, 2).contiguous().transpose(1, 2)
            tvs = tv.transpose(1, 2).contiguous().transpose(1, 2)
            o, lse = attn.attention_with_lse(tqs, tks, tvs, attn_mask=m, enable_gqa=True)
            out.push(f"py/bshd/{dt}/{mname}", o, lse)
            xq, xk, xv = (t.clone().requires_grad_(True) for t in (tqs, tks, tvs))
            o = attn.scaled_dot_product_attention(xq, xk, xv, attn_mask=m, enable_gqa=True)
            (o.float() * tgo.float()).sum().backward()
            out.push(f"py/autograd/{dt}/{mname}", o, xq.grad, xk.grad, xv.grad)
        # Extra leading axes, one broadcast: (2, B, H, L, E) against (B, H, S, E).
        q5 = torch_of(np.stack([q, q[:, :, ::-1, :].copy()]), dt)
        o, lse = attn.attention_with_lse(q5, tkf, tvf, attn_mask=torch.from_numpy(per_head_bool))
        out.push(f"py/lead5/{dt}", o, lse)
        grads = attn.attention_backward(
            torch_of(np.stack([go, go]), dt), q5, tkf, tvf, o, lse, attn_mask=torch.from_numpy(per_head_bool)
        )
        out.push(f"py/lead5_backward/{dt}", *grads)
        # NumPy in, NumPy out (float32, float16).
        if DTYPES[dt][0] is not None:
            nq, nk, nv = (a.astype(DTYPES[dt][0]) for a in (q, k_full, v_full))
            o, lse = attn.attention_with_lse(nq, nk, nv, attn_mask=per_head_bool)
            out.push(f"py/numpy/{dt}", o, lse)
            grads = attn.attention_backward(go.astype(DTYPES[dt][0]), nq, nk, nv, o, lse, attn_mask=per_head_bool)
            out.push(f"py/numpy_backward/{dt}", *grads)
        # The KV cache: prefill, then a decoding step; grouped-query heads.
        name = {"f32": "float32", "f16": "float16", "bf16": "bfloat16"}[dt]
        cache = attn.KVCache(b, hkv, 32, d, dtype=name)
        cache.append(tk, tv)
        o, lse = cache.attend_with_lse(tq)
        out.push(f"py/cache/prefill/{dt}", o, lse)
        cache.append(tk[:, :, :1], tv[:, :, :1])
        o = cache.attend(tq[:, :, :1])
        out.push(f"py/cache/decode/{dt}", o)
        o, lse = cache.attend_with_lse(tq[:, :, :2], is_causal=False)
        out.push(f"py/cache/full/{dt}", o, lse)

    # Packed batches (cu_seqlens), when the call has them.
    if "cu_seqlens_q" in attn.attention_with_lse.__text_signature__:
        total, cu = 13, np.array([0, 4, 4, 13], dtype=np.int64)
        pq, pk, pv = g.array((total, h, d)), g.array((total, hkv, d)), g.array((total, hkv, d))
        pgo = g.array((total, h, d))
        for dt in ["f32", "f16", "bf16"]:
            tq, tk, tv, tgo = (torch_of(a, dt) for a in (pq, pk, pv, pgo))
            for causal in [False, True]:
                kw = dict(is_causal=causal, enable_gqa=True, cu_seqlens_q=cu, cu_seqlens_k=cu)
                o, lse = attn.attention_with_lse(tq, tk, tv, **kw)
                out.push(f"py/packed/{dt}/{causal}", o, lse)
                grads = attn.attention_backward(tgo, tq, tk, tv, o, lse, **kw)
                out.push(f"py/packed_backward/{dt}/{causal}", *grads)
    out.write(path)
    print(f"{len(out.cases)} cases written to {path}")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: bits.py OUT")
    main(sys.argv[1])

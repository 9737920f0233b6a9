"""The gradient of an additive ``attn_mask`` that requires grad (a learnable bias: T5's
relative positions, ALiBi-like biases, key-padding biases), against torch's math path in
float64: every mask shape torch broadcasts (2-D to 5-D, size-1 axes, expanded views with
stride 0, a mask constant along the key axis), GQA, split calls (5-D operands: one engine
call per index of the first axis), dropout given attn's keep mask, ``-inf`` entries, half
precision, NumPy's ``attention_backward(..., mask_grad=True)``, the operator
``attn::sdpa_backward_mask`` (opcheck, ``torch.compile(fullgraph=True)``, export), and a
T5-style relative-position bias trained through attn (and transformers' T5 with
``attn_implementation="attn"``).
"""

import math

import numpy as np
import pytest

import attn
from strict import optional_import

torch = optional_import(
    "torch",
    "torch is not installed: the mask-gradient tests are skipped (cargo xtask test installs it)",
)
import torch.nn.functional as F  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

import attn.torch as attn_torch  # noqa: E402
from math_path import keep_mask, math_sdpa  # noqa: E402

torch.set_num_threads(1)


def randn(*shape, seed=0, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def assert_near(got, want, rel=2e-5, what="", floor=None):
    """Within ``rel`` of the largest magnitude of ``want`` (float32 against float64), or of
    ``floor`` when larger: the mask's gradient is a sum of entries of dS that may cancel (a
    mask constant along the keys has the row sums of dS, 0 up to rounding without
    dropout), so its error is measured against the entries' scale, 0.1 here."""
    if floor is None:
        floor = 0.1 if what == "dmask" else 1e-30
    assert got is not None, f"{what}: no gradient"
    got, want = got.detach().double(), want.detach().double()
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)}, want {tuple(want.shape)}"
    if want.numel() == 0:
        return
    size = want.abs().max().item()
    err = (got - want).abs().max().item()
    assert err <= rel * max(size, floor), f"{what}: off by {err:.3g} (largest {size:.3g})"


# Operand shapes (query, key, value), the mask: its shape, or ("expand", base, shape) for an
# expanded view (stride 0) of a base tensor, and options.
BHSD = dict(q=(2, 3, 5, 8), k=(2, 3, 7, 8), v=(2, 3, 7, 4))
CASES = {
    "2d": dict(BHSD, mask=(5, 7)),
    "1d_key_bias": dict(BHSD, mask=(7,)),
    "3d_per_head": dict(BHSD, mask=(3, 5, 7)),
    "4d_per_head": dict(BHSD, mask=(1, 3, 5, 7)),
    "4d_per_batch": dict(BHSD, mask=(2, 1, 5, 7)),
    "4d_full": dict(BHSD, mask=(2, 3, 5, 7)),
    "key_padding_bias": dict(BHSD, mask=(2, 1, 1, 7)),
    "row_bias": dict(BHSD, mask=(1, 1, 1, 7)),
    "key_constant": dict(BHSD, mask=(2, 3, 5, 1)),
    "key_constant_2d": dict(BHSD, mask=(5, 1)),
    "scalar": dict(BHSD, mask=(1, 1)),
    "expanded_batch": dict(BHSD, mask=("expand", (1, 3, 5, 7), (2, 3, 5, 7))),
    "expanded_heads": dict(BHSD, mask=("expand", (2, 1, 5, 7), (2, 3, 5, 7))),
    "expanded_keys": dict(BHSD, mask=("expand", (5, 1), (5, 7))),
    "expanded_rows": dict(BHSD, mask=("expand", (2, 1, 1, 7), (2, 3, 5, 7))),
    "transposed": dict(BHSD, mask=("transpose", (3, 7, 5), (3, 5, 7))),
    "2d_operands": dict(q=(5, 8), k=(7, 8), v=(7, 4), mask=(5, 7)),
    "3d_operands": dict(q=(3, 6, 8), k=(3, 9, 8), v=(3, 9, 8), mask=(3, 6, 9)),
    "5d_split_per_entry": dict(q=(2, 2, 3, 4, 8), k=(2, 2, 3, 6, 8), v=(2, 2, 3, 6, 8), mask=(2, 1, 1, 4, 6)),
    "5d_split_shared": dict(q=(2, 2, 3, 4, 8), k=(2, 2, 3, 6, 8), v=(2, 2, 3, 6, 8), mask=(1, 2, 3, 4, 6)),
    "5d_split_2d_mask": dict(q=(3, 2, 2, 4, 8), k=(3, 2, 2, 6, 8), v=(3, 2, 2, 6, 8), mask=(4, 6)),
    "gqa_per_head": dict(q=(2, 4, 5, 8), k=(2, 2, 7, 8), v=(2, 2, 7, 8), mask=(1, 4, 5, 7), enable_gqa=True),
    "gqa_per_batch": dict(q=(2, 4, 5, 8), k=(2, 2, 7, 8), v=(2, 2, 7, 8), mask=(2, 1, 5, 7), enable_gqa=True),
    "gqa_full": dict(q=(2, 6, 5, 8), k=(2, 3, 7, 8), v=(2, 3, 7, 8), mask=(2, 6, 5, 7), enable_gqa=True),
    "scale": dict(BHSD, mask=(1, 3, 5, 7), scale=0.3),
    "long_rows": dict(q=(1, 2, 70, 32), k=(1, 2, 300, 32), v=(1, 2, 300, 32), mask=(1, 2, 70, 300)),
}


def make_mask(spec, seed=7, dtype=torch.float32):
    """``(leaf, mask)``: the tensor that requires grad and the mask handed to attention (the
    leaf itself, or a view of it)."""
    if spec[0] == "expand":
        leaf = randn(*spec[1], seed=seed, dtype=dtype).requires_grad_()
        return leaf, leaf.expand(*spec[2])
    if spec[0] == "transpose":
        leaf = randn(*spec[1], seed=seed, dtype=dtype).requires_grad_()
        return leaf, leaf.transpose(-1, -2)
    leaf = randn(*spec, seed=seed, dtype=dtype).requires_grad_()
    return leaf, leaf


def options(case):
    return dict(scale=case.get("scale"), enable_gqa=case.get("enable_gqa", False))


def operands(case, dtype=torch.float32):
    return [randn(*case[n], seed=i, dtype=dtype) for i, n in enumerate("qkv")]


def lead_of(case):
    q, k = case["q"], case["k"]
    k_lead = k[:-3] + q[-3:-2] if case.get("enable_gqa") else k[:-2]
    return tuple(torch.broadcast_shapes(q[:-2], k_lead))


def reference(q, k, v, mask, case, p=0.0, keep=None):
    """torch's math path in float64: torch's own function (its math backend) without
    dropout (where torch takes the mask's shape), the documented formula otherwise."""
    if p == 0.0 and mask.dim() >= 2:
        with sdpa_kernel(SDPBackend.MATH):
            return F.scaled_dot_product_attention(q, k, v, mask, **options(case))
    return math_sdpa(q, k, v, mask, p, **options(case), keep=keep)


def run_case(case, fn, p=0.0, seed=None, dtype=torch.float32, mask_seed=7):
    """Forward and backward through ``fn`` and through the float64 reference; returns the
    pairs (name, ours, theirs) of the output and the gradients."""
    q, k, v = operands(case, dtype)
    leaf, mask = make_mask(case["mask"], mask_seed, torch.float32 if dtype == torch.float32 else dtype)
    ours = [x.clone().requires_grad_() for x in (q, k, v)]
    theirs = [x.double().requires_grad_() for x in (q, k, v)]
    leaf64, mask64 = make_mask(case["mask"], mask_seed, torch.float32 if dtype == torch.float32 else dtype)
    leaf64 = leaf64.detach().double().requires_grad_()
    mask64 = leaf64.expand(mask.shape) if case["mask"][0] == "expand" else (
        leaf64.transpose(-1, -2) if case["mask"][0] == "transpose" else leaf64
    )
    kw = dict(options(case))
    if p > 0:
        kw["seed"] = seed
    out = fn(*ours, mask, p, **kw)
    keep = keep_mask(seed, p, lead_of(case), q.shape[-2], k.shape[-2]) if p > 0 else None
    want = reference(*theirs, mask64, case, p, keep)
    w = randn(*out.shape, seed=9)
    (out.float() * w).sum().backward()
    (want * w.double()).sum().backward()
    pairs = [("out", out, want)]
    pairs += [(f"d{n}", a.grad, b.grad) for n, a, b in zip("qkv", ours, theirs)]
    pairs.append(("dmask", leaf.grad, leaf64.grad))
    return pairs


@pytest.mark.parametrize("entry", ["attn.torch", "attn"])
@pytest.mark.parametrize("name", CASES)
def test_mask_gradient_is_torchs(name, entry):
    fn = attn.scaled_dot_product_attention if entry == "attn" else attn_torch.scaled_dot_product_attention
    for what, got, want in run_case(CASES[name], fn):
        assert_near(got, want, what=what)


@pytest.mark.parametrize("p", [0.1, 0.5])
@pytest.mark.parametrize("name", ["2d", "4d_per_head", "4d_full", "key_padding_bias", "key_constant", "expanded_batch", "5d_split_shared", "gqa_per_batch"])
def test_mask_gradient_with_dropout(name, p):
    pairs = run_case(CASES[name], attn_torch.scaled_dot_product_attention, p=p, seed=123 + len(name))
    for what, got, want in pairs:
        assert_near(got, want, what=what)


@pytest.mark.parametrize("name", ["4d_full", "key_padding_bias", "2d"])
def test_minus_infinity_entries_get_no_gradient(name):
    case = CASES[name]
    q, k, v = operands(case)
    base = randn(*case["mask"], seed=7)
    hidden = randn(*case["mask"], seed=8) > 0.7
    hidden[..., 0] = False  # every row sees a key
    base = base.masked_fill(hidden, -math.inf)
    leaf = base.clone().requires_grad_()
    leaf64 = base.double().requires_grad_()
    ours = [x.clone().requires_grad_() for x in (q, k, v)]
    theirs = [x.double().requires_grad_() for x in (q, k, v)]
    out = attn_torch.scaled_dot_product_attention(*ours, leaf)
    want = math_sdpa(*theirs, leaf64)
    w = randn(*out.shape, seed=9)
    (out * w).sum().backward()
    (want * w.double()).sum().backward()
    assert_near(out, want)
    assert torch.all(leaf.grad[hidden] == 0)
    assert torch.isfinite(leaf.grad).all()
    assert_near(leaf.grad, leaf64.grad)
    for a, b in zip(ours, theirs):
        assert_near(a.grad, b.grad)


def test_a_row_that_sees_no_key_gives_no_gradient():
    q, k, v = operands(BHSD)
    base = randn(1, 1, 5, 7, seed=3)
    base[..., 2, :] = -math.inf  # query 2 sees nothing: its output is 0 (attn's rule)
    leaf = base.clone().requires_grad_()
    out = attn_torch.scaled_dot_product_attention(q, k, v, leaf)
    out.sum().backward()
    assert torch.all(out[..., 2, :] == 0)
    assert torch.all(leaf.grad[..., 2, :] == 0) and torch.isfinite(leaf.grad).all()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("name", ["4d_per_head", "key_padding_bias", "gqa_per_batch"])
def test_half_precision(name, dtype):
    rel = 1e-2 if dtype == torch.float16 else 4e-2
    for what, got, want in run_case(CASES[name], attn_torch.scaled_dot_product_attention, dtype=dtype):
        if what == "dmask":
            assert got.dtype == dtype
        assert_near(got, want, rel=rel if what == "out" else 2 * rel, what=what)


def test_float32_mask_with_half_operands():
    q, k, v = operands(BHSD, torch.bfloat16)
    leaf = randn(1, 3, 5, 7, seed=7).requires_grad_()
    out = attn_torch.scaled_dot_product_attention(q, k, v, leaf)
    out.float().sum().backward()
    assert leaf.grad.dtype == torch.float32 and leaf.grad.shape == (1, 3, 5, 7)
    leaf64 = leaf.detach().double().requires_grad_()
    math_sdpa(q.double(), k.double(), v.double(), leaf64).sum().backward()
    assert_near(leaf.grad, leaf64.grad, rel=8e-2)


def test_only_the_mask_requires_grad():
    q, k, v = operands(BHSD)
    leaf = randn(2, 1, 5, 7, seed=7).requires_grad_()
    out = attn.scaled_dot_product_attention(q, k, v, leaf)
    assert out.requires_grad
    out.square().sum().backward()
    leaf64 = leaf.detach().double().requires_grad_()
    math_sdpa(q.double(), k.double(), v.double(), leaf64).square().sum().backward()
    assert_near(leaf.grad, leaf64.grad)


def test_the_gradient_is_deterministic():
    case = CASES["5d_split_shared"]
    grads = []
    for _ in range(2):
        pairs = run_case(case, attn_torch.scaled_dot_product_attention, p=0.3, seed=11)
        grads.append(dict((w, a) for w, a, _ in pairs)["dmask"])
    assert torch.equal(grads[0], grads[1])


def test_numpy_attention_backward_with_mask_grad():
    case = CASES["gqa_per_batch"]
    q, k, v = operands(case)
    mask = randn(2, 1, 5, 7, seed=7)
    opts = options(case)
    qn, kn, vn, mn = (x.numpy() for x in (q, k, v, mask))
    out, lse = attn.attention_with_lse(qn, kn, vn, mn, 0.2, seed=5, **opts)
    go = randn(*out.shape, seed=11).numpy()
    dq, dk, dv, dm = attn.attention_backward(go, qn, kn, vn, out, lse, mn, dropout_p=0.2, seed=5, mask_grad=True, **opts)
    assert isinstance(dm, np.ndarray) and dm.dtype == np.float32 and dm.shape == mn.shape
    theirs = [x.double().requires_grad_() for x in (q, k, v, mask)]
    keep = keep_mask(5, 0.2, lead_of(case), 5, 7)
    want = math_sdpa(*theirs, 0.2, **opts, keep=keep)
    (want * torch.from_numpy(go).double()).sum().backward()
    for got, t in zip((dq, dk, dv, dm), theirs):
        assert_near(torch.from_numpy(got), t.grad)
    # dQ, dK, dV as without mask_grad.
    plain = attn.attention_backward(go, qn, kn, vn, out, lse, mn, dropout_p=0.2, seed=5, **opts)
    for a, b in zip(plain, (dq, dk, dv)):
        assert_near(torch.from_numpy(a), torch.from_numpy(b), rel=1e-6)
    # A broadcast NumPy view: each position its own gradient.
    wide = np.broadcast_to(mn, (2, 4, 5, 7))
    *_, dw = attn.attention_backward(go, qn, kn, vn, out, lse, wide, dropout_p=0.2, seed=5, mask_grad=True, **opts)
    assert dw.shape == (2, 4, 5, 7)
    np.testing.assert_allclose(dw.sum(axis=1, keepdims=True), dm, rtol=1e-5, atol=1e-6)


def test_mask_grad_errors():
    q = randn(1, 2, 4, 8)
    out, lse = attn.attention_with_lse(q, q, q)
    with pytest.raises(ValueError, match="no mask to differentiate"):
        attn.attention_backward(out, q, q, q, out, lse, mask_grad=True)
    allow = torch.ones(4, 4, dtype=torch.bool)
    with pytest.raises(ValueError, match="only an additive float mask"):
        attn.attention_backward(out, q, q, q, out, lse, allow, mask_grad=True)
    # A boolean mask never requires grad: its call differentiates q, k, v alone.
    qg = q.clone().requires_grad_()
    attn_torch.scaled_dot_product_attention(qg, q, q, allow).sum().backward()
    assert qg.grad is not None


# ---------------------------------------------------------------------------------------
# The operator.


def test_opcheck_of_the_mask_operator():
    q = randn(2, 4, 5, 8, seed=1)
    k = randn(2, 2, 7, 8, seed=2)
    v = randn(2, 2, 7, 8, seed=3)
    for mask, p, seed in [
        (randn(5, 7, seed=4), 0.0, None),
        (randn(2, 1, 1, 7, seed=4), 0.0, None),
        (randn(1, 4, 5, 1, seed=4), 0.3, torch.tensor(42)),
    ]:
        opts = (False, None, True, "top_left")
        out, lse = torch.ops.attn.sdpa_forward(q, k, v, mask, p, *opts, seed)
        args = (randn(*out.shape, seed=5), q, k, v, out, lse, mask, *opts, p, seed)
        torch.library.opcheck(torch.ops.attn.sdpa_backward_mask.default, args)
        grads = torch.ops.attn.sdpa_backward_mask(*args)
        assert [g.shape for g in grads] == [q.shape, k.shape, v.shape, mask.shape]
    meta = [torch.empty(s, device="meta") for s in ((2, 4, 5, 8), (2, 2, 7, 8), (2, 2, 7, 8), (2, 4, 5, 8), (2, 4, 5))]
    grads = torch.ops.attn.sdpa_backward_mask(
        meta[3], meta[0], meta[1], meta[2], meta[3], meta[4], torch.empty(1, 4, 5, 7, device="meta"),
        False, None, True, "top_left",
    )
    assert [g.shape for g in grads] == [(2, 4, 5, 8), (2, 2, 7, 8), (2, 2, 7, 8), (1, 4, 5, 7)]


class RelativePositionBias(torch.nn.Module):
    """T5's relative-position bias: a bucket per (query, key) offset, an embedding of the
    buckets to one bias per head, ``[1, H, L, S]``."""

    def __init__(self, heads, buckets=8, max_distance=16):
        super().__init__()
        self.buckets, self.max_distance = buckets, max_distance
        self.embedding = torch.nn.Embedding(buckets, heads)
        with torch.no_grad():
            self.embedding.weight.copy_(randn(buckets, heads, seed=21))

    def bucket(self, relative):
        # T5's bidirectional bucketing: half the buckets for each sign, exact for small
        # offsets, logarithmic beyond.
        n = self.buckets // 2
        ret = (relative > 0).long() * n
        relative = relative.abs()
        exact = n // 2
        large = exact + (
            torch.log(relative.float().clamp(min=1) / exact) / math.log(self.max_distance / exact) * (n - exact)
        ).long()
        large = large.clamp(max=n - 1)
        return ret + torch.where(relative < exact, relative, large)

    def forward(self, n_q, n_k):
        relative = torch.arange(n_k)[None, :] - torch.arange(n_q)[:, None]
        values = self.embedding(self.bucket(relative))  # [L, S, H]
        return values.permute(2, 0, 1).unsqueeze(0)  # [1, H, L, S]


class TinyT5Attention(torch.nn.Module):
    def __init__(self, dim=32, heads=4, dtype=torch.float32, sdpa=None):
        super().__init__()
        self.heads = heads
        self.qkv = torch.nn.Linear(dim, 3 * dim, bias=False)
        self.proj = torch.nn.Linear(dim, dim, bias=False)
        self.bias = RelativePositionBias(heads)
        with torch.no_grad():
            self.qkv.weight.copy_(randn(3 * dim, dim, seed=22) / math.sqrt(dim))
            self.proj.weight.copy_(randn(dim, dim, seed=23) / math.sqrt(dim))
        self.to(dtype)
        self.sdpa = sdpa

    def forward(self, x):
        b, n, d = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        bias = self.bias(n, n)
        # T5 does not scale the scores.
        out = self.sdpa(q, k, v, attn_mask=bias, scale=1.0)
        return self.proj(out.transpose(1, 2).reshape(b, n, d))


def _math_sdpa(q, k, v, attn_mask=None, scale=None):
    with sdpa_kernel(SDPBackend.MATH):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, scale=scale)


def test_t5_relative_position_bias_trains_as_with_torch():
    ours = TinyT5Attention(sdpa=attn_torch.scaled_dot_product_attention)
    theirs = TinyT5Attention(dtype=torch.float64, sdpa=_math_sdpa)
    opt_ours = torch.optim.SGD(ours.parameters(), lr=0.1)
    opt_theirs = torch.optim.SGD(theirs.parameters(), lr=0.1)
    for step in range(3):
        x = randn(2, 12, 32, seed=30 + step)
        target = randn(2, 12, 32, seed=40 + step)
        loss = (ours(x) - target).square().mean()
        loss64 = (theirs(x.double()) - target.double()).square().mean()
        opt_ours.zero_grad()
        opt_theirs.zero_grad()
        loss.backward()
        loss64.backward()
        g, g64 = ours.bias.embedding.weight.grad, theirs.bias.embedding.weight.grad
        assert g64.abs().max() > 0
        assert_near(g, g64, rel=1e-4, what=f"embedding gradient, step {step}")
        for (name, p), p64 in zip(ours.named_parameters(), theirs.parameters()):
            assert_near(p.grad, p64.grad, rel=1e-4, what=f"{name}, step {step}")
        opt_ours.step()
        opt_theirs.step()
    assert_near(ours.bias.embedding.weight, theirs.bias.embedding.weight, rel=1e-5)


def test_t5_bias_through_the_plain_call_and_routing():
    x = randn(2, 10, 32, seed=50)
    want_model = TinyT5Attention(dtype=torch.float64, sdpa=_math_sdpa)
    want_model(x.double()).sum().backward()
    want = want_model.bias.embedding.weight.grad

    def routed(*args, **kw):
        return F.scaled_dot_product_attention(*args, **kw)

    for sdpa in (attn.scaled_dot_product_attention, routed):
        model = TinyT5Attention(sdpa=sdpa)
        with attn_torch.routing():
            model(x).sum().backward()
        assert_near(model.bias.embedding.weight.grad, want, rel=1e-4)


def test_t5_bias_compiles_whole_and_exports():
    torch._dynamo.reset()
    model = TinyT5Attention(sdpa=attn_torch.scaled_dot_product_attention)
    eager = TinyT5Attention(sdpa=attn_torch.scaled_dot_product_attention)
    compiled = torch.compile(model, fullgraph=True)
    x = randn(2, 12, 32, seed=60)
    compiled(x).sum().backward()
    eager(x).sum().backward()
    assert_near(model.bias.embedding.weight.grad, eager.bias.embedding.weight.grad, rel=1e-5)
    for p, p2 in zip(model.parameters(), eager.parameters()):
        assert_near(p.grad, p2.grad, rel=1e-5)
    exported = torch.export.export(eager, (x,))
    assert_near(exported.module()(x), eager(x), rel=1e-6)


def test_t5_through_transformers_trains_its_relative_position_bias(monkeypatch):
    transformers = optional_import("transformers", "transformers is not installed (cargo xtask test installs it)")
    import attn.transformers  # noqa: F401

    calls = []
    original = attn_torch.sdpa_backward_mask

    def counted(*args):
        calls.append(args[6].shape)
        return original(*args)

    monkeypatch.setattr(attn_torch, "sdpa_backward_mask", counted)
    cfg = transformers.T5Config(
        vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4,
        relative_attention_num_buckets=8, relative_attention_max_distance=16, dropout_rate=0.0,
        decoder_start_token_id=0,
    )
    torch.manual_seed(0)
    ref = transformers.T5ForConditionalGeneration(cfg).double()
    model = transformers.T5ForConditionalGeneration._from_config(cfg, attn_implementation="attn")
    model.load_state_dict({k: v.float() for k, v in ref.state_dict().items()})
    assert model.config._attn_implementation == "attn"
    ids = torch.randint(1, 64, (2, 10), generator=torch.Generator().manual_seed(1))
    labels = torch.randint(1, 64, (2, 7), generator=torch.Generator().manual_seed(2))
    padding = torch.ones(2, 10, dtype=torch.long)
    padding[1, 7:] = 0
    model.train()
    ref.train()
    model(input_ids=ids, attention_mask=padding, labels=labels).loss.backward()
    ref(input_ids=ids, attention_mask=padding, labels=labels).loss.backward()
    assert calls, "attn's backward of the mask was not called"
    params = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        if "relative_attention_bias" in name:
            assert_near(p.grad, params[name].grad, rel=1e-5, what=name)
        elif p.grad is not None:
            assert_near(p.grad, params[name].grad, rel=1e-4, what=name)

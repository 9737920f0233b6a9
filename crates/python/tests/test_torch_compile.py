"""attn as torch operators: ``torch.compile`` (``fullgraph=True``, inductor on the CPU) and
``torch.export`` of a small Llama-style block whose attention is attn's, meta and fake
tensors, ``torch.library.opcheck`` of ``attn::sdpa_forward`` and ``attn::sdpa_backward``
(with dropout too: its seed a tensor input of both), attention dropout compiled, exported
and routed, and torch's scale semantics (any finite scale, 0 and negative included) against
torch's own function, forward and backward.

Inductor compiles C++ (a compiler and Python's headers: ``cargo xtask test`` installs them
when missing)."""

import warnings

import pytest

from strict import optional_import

torch = optional_import(
    "torch",
    "torch is not installed: the torch tests are skipped (cargo xtask test installs it)",
)
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

import attn  # noqa: E402
import attn.torch as attn_torch  # noqa: E402

torch.set_num_threads(1)

ORIGINAL_SDPA = F.scaled_dot_product_attention


def randn(*shape, seed=0, **kw):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), **kw)


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rope(x, positions, base=10000.0):
    """Rotary embedding of ``x`` ``(B, H, S, D)``, the half-split form of Llama."""
    d = x.shape[-1]
    inv = 1.0 / base ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    angles = positions[:, None].float() * inv[None, :]
    cos = torch.cat([angles.cos(), angles.cos()], -1)
    sin = torch.cat([angles.sin(), angles.sin()], -1)
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return x * cos + torch.cat([-x2, x1], -1) * sin


class Block(nn.Module):
    """One Llama decoder layer: RMSNorm, q/k/v projections (grouped-query: fewer K/V heads),
    RoPE, causal attention, o-projection, RMSNorm and a SwiGLU MLP, both residual."""

    def __init__(self, sdpa, dim=32, heads=4, kv_heads=2, hidden=64, use_rope=True, dropout_p=0.0):
        super().__init__()
        self.sdpa, self.heads, self.kv_heads, self.use_rope = sdpa, heads, kv_heads, use_rope
        self.dropout_p = dropout_p
        self.head_dim = dim // heads
        self.norm1, self.norm2 = RMSNorm(dim), RMSNorm(dim)
        self.q = nn.Linear(dim, heads * self.head_dim, bias=False)
        self.k = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.v = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.o = nn.Linear(heads * self.head_dim, dim, bias=False)
        self.gate = nn.Linear(dim, hidden, bias=False)
        self.up = nn.Linear(dim, hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        b, s, _ = x.shape
        h = self.norm1(x)
        q = self.q(h).view(b, s, self.heads, self.head_dim).transpose(1, 2)
        k = self.k(h).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v(h).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        if self.use_rope:
            pos = torch.arange(s)
            q, k = rope(q, pos), rope(k, pos)
        if self.dropout_p:
            a = self.sdpa(q, k, v, dropout_p=self.dropout_p, is_causal=True, enable_gqa=True)
        else:
            a = self.sdpa(q, k, v, is_causal=True, enable_gqa=True)
        x = x + self.o(a.transpose(1, 2).reshape(b, s, -1))
        h = self.norm2(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


def block(sdpa=attn_torch.scaled_dot_product_attention, use_rope=True, dropout_p=0.0):
    torch.manual_seed(0)
    return Block(sdpa, use_rope=use_rope, dropout_p=dropout_p)


@pytest.mark.parametrize("entry", ["attn.torch", "attn"])
@pytest.mark.parametrize("use_rope", [True, False], ids=["rope", "no_rope"])
def test_compiled_block_has_no_graph_break_and_matches_eager(use_rope, entry):
    torch._dynamo.reset()
    sdpa = attn_torch.scaled_dot_product_attention if entry == "attn.torch" else attn.scaled_dot_product_attention
    model = block(sdpa, use_rope)
    x = randn(2, 12, 32, seed=1)
    explained = torch._dynamo.explain(model)(x)
    assert explained.graph_break_count == 0 and explained.graph_count == 1, explained.break_reasons
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True)
    with torch.no_grad():
        want = model(x)
        got = compiled(x)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    # And against torch's own attention in the same block.
    model.sdpa = F.scaled_dot_product_attention
    with torch.no_grad():
        torch.testing.assert_close(want, model(x), atol=1e-4, rtol=1e-4)


def test_the_plain_entries_compile_to_the_operator():
    torch._dynamo.reset()

    def f(q, k, v):
        out, lse = attn.attention_with_lse(q, k, v, is_causal=True)
        return attn.scaled_dot_product_attention(out, k, v, scale=-0.25) * lse.unsqueeze(-1)

    q, k, v = randn(1, 2, 5, 8, seed=1), randn(1, 2, 5, 8, seed=2), randn(1, 2, 5, 8, seed=3)
    torch.testing.assert_close(torch.compile(f, fullgraph=True)(q, k, v), f(q, k, v), atol=1e-5, rtol=1e-5)


def test_the_compiled_graph_calls_the_operator():
    torch._dynamo.reset()
    graphs = []

    def backend(gm, _inputs):
        graphs.append(gm)
        return gm.forward

    model = block()
    with torch.no_grad():
        torch.compile(model, backend=backend, fullgraph=True)(randn(1, 6, 32))
    targets = [n.target for g in graphs for n in g.graph.nodes if n.op == "call_function"]
    assert any("sdpa_forward" in str(t) for t in targets), targets


def test_gradients_through_the_compiled_block_match_eager():
    torch._dynamo.reset()
    eager = block()
    compiled_model = block()
    compiled = torch.compile(compiled_model, fullgraph=True)
    x = randn(2, 10, 32, seed=2)
    xe, xc = x.clone().requires_grad_(), x.clone().requires_grad_()
    w = randn(2, 10, 32, seed=3)
    (eager(xe) * w).sum().backward()
    (compiled(xc) * w).sum().backward()
    torch.testing.assert_close(xc.grad, xe.grad, atol=1e-4, rtol=1e-4)
    for (name, pe), pc in zip(eager.named_parameters(), compiled_model.parameters()):
        torch.testing.assert_close(pc.grad, pe.grad, atol=1e-4, rtol=1e-4, msg=name)
    # The same gradients as torch's attention.
    torch_model = block(F.scaled_dot_product_attention)
    xt = x.clone().requires_grad_()
    (torch_model(xt) * w).sum().backward()
    torch.testing.assert_close(xe.grad, xt.grad, atol=1e-4, rtol=1e-4)


def test_export_of_the_block():
    model = block()
    x = randn(2, 12, 32, seed=4)
    exported = torch.export.export(model, (x,))
    assert any("sdpa_forward" in str(n.target) for n in exported.graph.nodes)
    with torch.no_grad():
        torch.testing.assert_close(exported.module()(x), model(x), atol=1e-6, rtol=1e-6)
        y = randn(2, 12, 32, seed=5)
        torch.testing.assert_close(exported.module()(y), model(y), atol=1e-6, rtol=1e-6)


def test_meta_and_fake_tensors_get_shapes_only():
    q = torch.empty(2, 4, 5, 8, device="meta")
    k = torch.empty(2, 2, 7, 8, device="meta")
    v = torch.empty(2, 2, 7, 16, device="meta", dtype=torch.float32)
    out, lse = attn_torch.attention_with_lse(q, k, v, enable_gqa=True)
    assert out.device.type == "meta" and out.shape == (2, 4, 5, 16) and out.dtype == torch.float32
    assert lse.device.type == "meta" and lse.shape == (2, 4, 5) and lse.dtype == torch.float32
    # The plain entry sends meta tensors to the operator too.
    assert attn.scaled_dot_product_attention(q, k, v, enable_gqa=True).shape == (2, 4, 5, 16)
    half = torch.empty(3, 2, 5, 8, device="meta", dtype=torch.bfloat16)
    out = attn_torch.scaled_dot_product_attention(half, half[:1, :, :4], half[:1, :, :4])
    assert out.shape == (3, 2, 5, 8) and out.dtype == torch.bfloat16
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q = torch.empty(3, 2, 5, 8)
        out = attn_torch.scaled_dot_product_attention(q, torch.empty(1, 2, 6, 8), torch.empty(3, 2, 6, 4))
        assert out.shape == (3, 2, 5, 4)
    grads = torch.ops.attn.sdpa_backward(
        torch.empty(2, 4, 5, 16, device="meta"), *(torch.empty(2, 4, 5, 8, device="meta"),) * 1,
        k, v, torch.empty(2, 4, 5, 16, device="meta"), torch.empty(2, 4, 5, device="meta"),
        None, False, None, True, "top_left",
    )
    assert [g.shape for g in grads] == [(2, 4, 5, 8), (2, 2, 7, 8), (2, 2, 7, 16)]


OPCHECK_CALLS = [
    dict(is_causal=False, scale=None, enable_gqa=False, causal_alignment="top_left", mask=None),
    dict(is_causal=True, scale=None, enable_gqa=True, causal_alignment="top_left", mask=None),
    dict(is_causal=True, scale=-0.5, enable_gqa=False, causal_alignment="bottom_right", mask=None),
    dict(is_causal=False, scale=0.0, enable_gqa=False, causal_alignment="top_left", mask="float"),
    dict(is_causal=False, scale=2.0, enable_gqa=False, causal_alignment="top_left", mask="bool"),
    dict(is_causal=True, scale=None, enable_gqa=True, causal_alignment="top_left", mask=None, dropout_p=0.3),
    dict(is_causal=False, scale=None, enable_gqa=False, causal_alignment="top_left", mask="bool", dropout_p=0.5),
]


def _opcheck_id(c):
    return f"causal{c['is_causal']}-scale{c['scale']}-gqa{c['enable_gqa']}-{c['mask']}-p{c.get('dropout_p', 0.0)}"


@pytest.mark.parametrize("call", OPCHECK_CALLS, ids=_opcheck_id)
def test_opcheck(call):
    kv_heads = 2 if call["enable_gqa"] else 4
    q = randn(2, 4, 5, 8, seed=1, requires_grad=True)
    k = randn(2, kv_heads, 7, 8, seed=2, requires_grad=True)
    v = randn(2, kv_heads, 7, 8, seed=3, requires_grad=True)
    mask = {None: None, "float": randn(5, 7, seed=4), "bool": randn(5, 7, seed=4) > -1}[call["mask"]]
    opts = (call["is_causal"], call["scale"], call["enable_gqa"], call["causal_alignment"])
    p = call.get("dropout_p", 0.0)
    if p == 0.0:
        torch.library.opcheck(torch.ops.attn.sdpa_forward.default, (q, k, v, mask, 0.0, *opts))
        out, lse = torch.ops.attn.sdpa_forward(q, k, v, mask, 0.0, *opts)
        args = (randn(*out.shape, seed=5), q.detach(), k.detach(), v.detach(), out.detach(), lse, mask, *opts)
        torch.library.opcheck(torch.ops.attn.sdpa_backward.default, args)
        return
    seed = torch.tensor(-1234567890123, dtype=torch.int64)  # a seed's bits, as an int64
    torch.library.opcheck(torch.ops.attn.sdpa_forward.default, (q, k, v, mask, p, *opts, seed))
    out, lse = torch.ops.attn.sdpa_forward(q, k, v, mask, p, *opts, seed)
    args = (randn(*out.shape, seed=5), q.detach(), k.detach(), v.detach(), out.detach(), lse, mask, *opts, p, seed)
    torch.library.opcheck(torch.ops.attn.sdpa_backward.default, args)


def test_the_operators_take_a_probability_and_a_seed_with_dropout():
    q = randn(1, 2, 5, 8)
    with pytest.raises(ValueError, match="dropout_p=0.1 without a seed"):
        torch.ops.attn.sdpa_forward(q, q, q, None, 0.1, False, None, False, "top_left")
    with pytest.raises(ValueError, match="between 0 and 1, but got 1.5"):
        torch.ops.attn.sdpa_forward(q, q, q, None, 1.5, False, None, False, "top_left", torch.tensor(1))
    out, lse = torch.ops.attn.sdpa_forward(q, q, q, None, 0.1, False, None, False, "top_left", torch.tensor(1))
    with pytest.raises(ValueError, match="dropout_p=0.1 without a seed"):
        torch.ops.attn.sdpa_backward(out, q, q, q, out, lse, None, False, None, False, "top_left", 0.1)
    # The seed's bits are the seed: 2**64 - 1 and the int64 -1 are one seed.
    want = attn.scaled_dot_product_attention(q, q, q, dropout_p=0.1, seed=2**64 - 1)
    got, _ = torch.ops.attn.sdpa_forward(q, q, q, None, 0.1, False, None, False, "top_left", torch.tensor(-1))
    assert torch.equal(got, want)


# ---------------------------------------------------------------------------------------
# Dropout through the compiler and export.


@pytest.mark.parametrize("entry", ["attn.torch", "attn"])
def test_a_block_with_dropout_compiles_whole(entry):
    torch._dynamo.reset()
    sdpa = attn_torch.scaled_dot_product_attention if entry == "attn.torch" else attn.scaled_dot_product_attention
    model = block(sdpa, dropout_p=0.25)
    x = randn(2, 12, 32, seed=1)
    explained = torch._dynamo.explain(model)(x)
    assert explained.graph_break_count == 0 and explained.graph_count == 1, explained.break_reasons
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True)
    with torch.no_grad():
        torch.manual_seed(3)
        first = compiled(x)
        again = compiled(x)
        torch.manual_seed(3)
        replay = compiled(x)
        undropped = block(sdpa)(x)
    # The seed is drawn in the graph from torch's default generator: torch.manual_seed
    # replays a run, successive calls differ. (Inductor draws with its own generator
    # seeded from torch's, so a compiled run's seeds are not eager's.)
    assert torch.equal(first, replay)
    assert not torch.equal(first, again)
    assert not torch.equal(first, undropped)


def test_gradients_with_dropout_through_the_compiled_block_match_eager():
    torch._dynamo.reset()

    def sdpa(q, k, v, **kw):  # a fixed seed: eager and compiled drop the same weights
        return attn_torch.scaled_dot_product_attention(q, k, v, seed=2024, **kw)

    eager, compiled_model = block(sdpa, dropout_p=0.3), block(sdpa, dropout_p=0.3)
    compiled = torch.compile(compiled_model, fullgraph=True)
    x = randn(2, 10, 32, seed=2)
    xe, xc = x.clone().requires_grad_(), x.clone().requires_grad_()
    w = randn(2, 10, 32, seed=3)
    (eager(xe) * w).sum().backward()
    (compiled(xc) * w).sum().backward()
    torch.testing.assert_close(xc.grad, xe.grad, atol=1e-4, rtol=1e-4)
    for (name, pe), pc in zip(eager.named_parameters(), compiled_model.parameters()):
        torch.testing.assert_close(pc.grad, pe.grad, atol=1e-4, rtol=1e-4, msg=name)
    undropped = block()
    xu = x.clone().requires_grad_()
    (undropped(xu) * w).sum().backward()
    assert not torch.allclose(xu.grad, xe.grad, atol=1e-3)


def test_export_of_a_block_with_dropout():
    model = block(dropout_p=0.2)
    x = randn(2, 12, 32, seed=4)
    exported = torch.export.export(model, (x,))
    targets = [str(n.target) for n in exported.graph.nodes]
    assert any("sdpa_forward" in t for t in targets) and any("randint" in t for t in targets), targets
    with torch.no_grad():
        # The exported graph draws its seed as eager attn does: one torch.randint.
        torch.manual_seed(9)
        got = exported.module()(x)
        torch.manual_seed(9)
        want = model(x)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)


def test_meta_tensors_with_dropout():
    q = torch.empty(2, 4, 5, 8, device="meta")
    out, lse = attn_torch.attention_with_lse(q, q, q, dropout_p=0.5)
    assert out.shape == (2, 4, 5, 8) and lse.shape == (2, 4, 5) and out.device.type == "meta"
    assert attn.scaled_dot_product_attention(q, q, q, dropout_p=0.5, seed=1).shape == (2, 4, 5, 8)


# ---------------------------------------------------------------------------------------
# torch's scale: any finite float.


@pytest.mark.parametrize("entry", ["attn.torch", "attn"])
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("scale", [0.0, -0.5, 2.0, -0.0])
def test_any_finite_scale_matches_torch(scale, is_causal, entry):
    fn = attn_torch.scaled_dot_product_attention if entry == "attn.torch" else attn.scaled_dot_product_attention
    q, k, v = randn(2, 3, 7, 16, seed=1), randn(2, 3, 9, 16, seed=2), randn(2, 3, 9, 8, seed=3)
    ours = [x.clone().requires_grad_() for x in (q, k, v)]
    theirs = [x.clone().requires_grad_() for x in (q, k, v)]
    out = fn(*ours, is_causal=is_causal, scale=scale)
    want = F.scaled_dot_product_attention(*theirs, is_causal=is_causal, scale=scale)
    torch.testing.assert_close(out, want, atol=2e-5, rtol=2e-5)
    w = randn(*out.shape, seed=4)
    (out * w).sum().backward()
    (want * w).sum().backward()
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a.grad, b.grad, atol=1e-4, rtol=1e-4)
    # Without grad, the plain call computes the same.
    with torch.no_grad():
        torch.testing.assert_close(fn(q, k, v, is_causal=is_causal, scale=scale), out.detach(), atol=0, rtol=0)


def test_zero_scale_is_uniform_weights_over_visible_keys():
    q, v = randn(1, 1, 4, 8, seed=1), randn(1, 1, 4, 8, seed=2)
    out = attn_torch.scaled_dot_product_attention(q, q * 100, v, is_causal=True, scale=0.0)
    want = v.cumsum(-2) / torch.arange(1, 5).view(4, 1)
    torch.testing.assert_close(out, want, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("scale", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_scales_are_errors(scale):
    q = randn(1, 2, 5, 8)
    with pytest.raises(ValueError, match="scale"):
        attn_torch.scaled_dot_product_attention(q, q, q, scale=scale)
    with pytest.raises(ValueError, match="scale"):
        attn.scaled_dot_product_attention(q, q, q, scale=scale)


# ---------------------------------------------------------------------------------------
# attn.torch.routing(): torch's own function routed to attn within a block.


def masked_nan_call(fn):
    """A NaN in a value row that the mask hides: attn never lets it reach the output
    (a hidden key contributes nothing), torch computes ``0 · NaN``."""
    q = randn(1, 2, 3, 8)
    v = q.clone()
    v[..., 2, :] = float("nan")
    mask = torch.ones(3, 3, dtype=torch.bool)
    mask[:, 2] = False
    return fn(q, q, v, attn_mask=mask)


def test_routing_sends_torchs_function_to_attn_and_restores_it():
    original = F.scaled_dot_product_attention
    assert torch.isnan(masked_nan_call(F.scaled_dot_product_attention)).any()
    with attn_torch.routing():
        assert F.scaled_dot_product_attention is not original
        assert torch.isfinite(masked_nan_call(torch.nn.functional.scaled_dot_product_attention)).all()
        q, k = randn(1, 4, 6, 8, seed=1, requires_grad=True), randn(1, 2, 6, 8, seed=2)
        got = F.scaled_dot_product_attention(q, k, k, is_causal=True, enable_gqa=True)
        got.sum().backward()
    assert F.scaled_dot_product_attention is original
    q2 = q.detach().clone().requires_grad_()
    want = F.scaled_dot_product_attention(q2, k, k, is_causal=True, enable_gqa=True)
    want.sum().backward()
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(q.grad, q2.grad, atol=1e-4, rtol=1e-4)


def test_routing_falls_back_to_torch_with_one_warning():
    q = randn(1, 2, 4, 8, dtype=torch.float64)
    want = F.scaled_dot_product_attention(q, q, q)
    with attn_torch.routing():
        with pytest.warns(UserWarning, match="attn does not take dtype torch.float64") as record:
            out = F.scaled_dot_product_attention(q, q, q)
            F.scaled_dot_product_attention(q, q, q)
        assert len(record) == 1
        torch.testing.assert_close(out, want, atol=0, rtol=0)  # torch's own, in float64
        # A mask that requires grad is attn's (its gradient computed): no warning.
        bias = torch.zeros(4, 4, requires_grad=True)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            F.scaled_dot_product_attention(q.float(), q.float(), q.float(), bias).sum().backward()
        assert bias.grad.shape == (4, 4)
    with pytest.raises(RuntimeError):  # the block was left by an exception: restored all the same
        with attn_torch.routing():
            raise RuntimeError
    assert F.scaled_dot_product_attention is ORIGINAL_SDPA


def test_routing_keeps_dropout():
    q, k, v = randn(1, 2, 6, 8, seed=1), randn(1, 2, 6, 8, seed=2), randn(1, 2, 6, 8, seed=3)
    with attn_torch.routing():
        torch.manual_seed(5)
        routed = F.scaled_dot_product_attention(q, k, v, dropout_p=0.5)
    torch.manual_seed(5)
    want = attn.scaled_dot_product_attention(q, k, v, dropout_p=0.5)
    assert torch.equal(routed, want)
    assert not torch.equal(routed, attn.scaled_dot_product_attention(q, k, v))


def test_routing_a_transformers_sdpa_model():
    transformers = optional_import("transformers", "transformers is not installed (cargo xtask test installs it)")
    cfg = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
        initializer_range=0.1,
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").eval()
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(1))
    calls = []
    real = attn_torch.sdpa_forward

    with torch.no_grad():
        want = model(input_ids=ids).logits
        with attn_torch.routing():
            attn_torch.sdpa_forward = lambda *a: calls.append(1) or real(*a)
            try:
                got = model(input_ids=ids).logits
            finally:
                attn_torch.sdpa_forward = real
    assert len(calls) == 1
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_a_second_derivative_is_refused():
    """attn has no double backward: the gradient's own graph refuses it with a clear error
    instead of silently lacking a term."""
    q = randn(1, 2, 5, 8, seed=1, requires_grad=True)
    k = randn(1, 2, 5, 8, seed=2, requires_grad=True)
    out = attn_torch.scaled_dot_product_attention(q, k, k, is_causal=True)
    (dq,) = torch.autograd.grad(out.pow(2).sum(), q, create_graph=True)
    with pytest.raises(RuntimeError, match="double backward"):
        dq.sum().backward()


def test_the_backward_operator_takes_a_grad_out_of_any_strides():
    q, k, v = randn(1, 2, 5, 8, seed=1), randn(1, 2, 5, 8, seed=2), randn(1, 2, 5, 8, seed=3)
    out, lse = torch.ops.attn.sdpa_forward(q, k, v, None, 0.0, True, None, False, "top_left")
    go = randn(1, 2, 8, 5, seed=4).transpose(-1, -2)  # last axis of stride 5
    assert go.stride()[-1] != 1
    want = torch.ops.attn.sdpa_backward(go.contiguous(), q, k, v, out, lse, None, True, None, False, "top_left")
    got = torch.ops.attn.sdpa_backward(go, q, k, v, out, lse, None, True, None, False, "top_left")
    for a, b in zip(got, want):
        assert torch.equal(a, b)


@pytest.mark.parametrize(
    "case, message",
    [
        ("one offset", "go together"),
        ("a mask", "no element-wise mask"),
        ("4-D query", "3"),
        ("heads without gqa", "enable_gqa=True"),
    ],
)
def test_the_packed_fake_refuses_what_the_kernel_refuses(case, message):
    """Shapes alone (meta tensors, tracing) give the error eager gives."""
    cu = torch.tensor([0, 4, 9])
    for device in ("cpu", "meta"):
        q = torch.zeros(9, 4, 8, device=device)
        kv = torch.zeros(9, 2 if case == "heads without gqa" else 4, 8, device=device)
        args = dict(cu_seqlens_q=cu, cu_seqlens_k=cu)
        mask = None
        if case == "one offset":
            args["cu_seqlens_k"] = None
        elif case == "a mask":
            mask = torch.zeros(9, 9, device=device)
        elif case == "4-D query":
            q = q[None]
        with pytest.raises(attn.InputError, match=message):
            attn_torch.attention_with_lse(q, kv, kv, mask, **args)


def test_converted_errors_keep_their_traceback():
    q = randn(1, 2, 5, 8, seed=1, requires_grad=True)
    with pytest.raises(attn.InputTypeError) as raised:
        attn.scaled_dot_product_attention(q, q, q, dropout_p=0.1, seed=2.5)
    frames = [f.name for f in __import__("traceback").extract_tb(raised.value.__traceback__)]
    assert "_seed_tensor" in frames, frames

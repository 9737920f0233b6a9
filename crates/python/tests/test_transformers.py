"""``attn_implementation="attn"``: ``import attn.transformers`` registers attn with
transformers' ``AttentionInterface``; tiny random-weight Llama models (grouped-query heads,
left padding) built with it against the same models with ``"sdpa"``: logits, gradients of a
training step, and ``generate()`` with transformers' own cache; a training step with the
configured attention dropout (grouped-query heads handed to attn as they are): replayed by
``torch.manual_seed``, and equal to the ``"sdpa"`` model whose attention is torch's math path
given attn's keep masks."""

import os

import pytest

from strict import optional_import

os.environ.setdefault("HF_HUB_OFFLINE", "1")

torch = optional_import(
    "torch",
    "torch is not installed: the transformers tests are skipped (cargo xtask test installs it)",
)
transformers = optional_import(
    "transformers",
    "transformers is not installed: the transformers tests are skipped (cargo xtask test installs it)",
)

import attn  # noqa: E402
import attn.transformers as attn_transformers  # noqa: E402
from math_path import math_sdpa  # noqa: E402

torch.set_num_threads(1)

VOCAB = 96


def config(**extra):
    cfg = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        attention_dropout=0.0,
        initializer_range=0.1,
    )
    cfg.update(extra)
    return transformers.LlamaConfig(**cfg)


def pair(**extra):
    """The same random weights under ``"attn"`` and ``"sdpa"``."""
    torch.manual_seed(0)
    ours = transformers.AutoModelForCausalLM.from_config(config(**extra), attn_implementation="attn")
    theirs = transformers.AutoModelForCausalLM.from_config(config(**extra), attn_implementation="sdpa")
    theirs.load_state_dict(ours.state_dict())
    assert ours.config._attn_implementation == "attn"
    return ours, theirs


def inputs(left_padding=3):
    ids = torch.randint(4, VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, :left_padding] = 0
    return ids, mask


class Calls:
    """Counts the calls of attn's operator during a block."""

    def __enter__(self):
        self.count = 0
        self._orig = attn_transformers.attn_torch.scaled_dot_product_attention

        def counted(*a, **kw):
            self.count += 1
            return self._orig(*a, **kw)

        attn_transformers.attn_torch.scaled_dot_product_attention = counted
        return self

    def __exit__(self, *exc):
        attn_transformers.attn_torch.scaled_dot_product_attention = self._orig


def test_registered():
    from transformers import AttentionInterface

    assert AttentionInterface._global_mapping["attn"] is attn_transformers.attention_forward


@pytest.mark.parametrize("padding", [0, 3], ids=["no_padding", "left_padding"])
def test_forward_matches_sdpa(padding):
    ours, theirs = pair()
    ours.eval(), theirs.eval()
    ids, mask = inputs(padding)
    with torch.no_grad(), Calls() as calls:
        got = ours(input_ids=ids, attention_mask=mask).logits
    assert calls.count == 2
    with torch.no_grad():
        want = theirs(input_ids=ids, attention_mask=mask).logits
    keep = mask.bool()  # padded positions' logits are not compared (attn gives 0 rows, torch NaN or garbage)
    torch.testing.assert_close(got[keep], want[keep], atol=1e-4, rtol=1e-4)


def test_training_step_gradients_match_sdpa():
    ours, theirs = pair()
    ours.train(), theirs.train()
    ids, mask = inputs(3)
    labels = ids.clone()
    labels[1, :3] = -100
    ours(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
    theirs(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
    for (name, a), b in zip(ours.named_parameters(), theirs.parameters()):
        torch.testing.assert_close(a.grad, b.grad, atol=1e-4, rtol=1e-3, msg=name)


def _dropout_step(model, seed, route=None):
    ids, mask = inputs(3)
    labels = ids.clone()
    labels[1, :3] = -100
    model.train()
    model.zero_grad(set_to_none=True)
    original = torch.nn.functional.scaled_dot_product_attention
    if route is not None:
        torch.nn.functional.scaled_dot_product_attention = route
    try:
        torch.manual_seed(seed)
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
    finally:
        torch.nn.functional.scaled_dot_product_attention = original
    return {"loss": loss.detach(), **{n: p.grad.clone() for n, p in model.named_parameters()}}


def test_training_with_attention_dropout():
    ours, theirs = pair(attention_dropout=0.1)
    with Calls() as calls:
        first = _dropout_step(ours, 7)
    assert calls.count == 2
    assert all(torch.isfinite(t).all() for t in first.values())
    replay = _dropout_step(ours, 7)
    assert all(torch.equal(replay[n], t) for n, t in first.items())
    assert not torch.equal(_dropout_step(ours, 8)["loss"], first["loss"])
    undropped, _ = pair()
    assert not torch.equal(_dropout_step(undropped, 7)["loss"], first["loss"])
    # The "sdpa" model with torch's math path given attn's masks: the seeds drawn alike.
    want = _dropout_step(theirs, 7, route=math_sdpa)
    for name, t in want.items():
        torch.testing.assert_close(first[name], t, atol=1e-5, rtol=1e-4, msg=name)
    # In eval mode nothing is dropped.
    ours.eval(), undropped.eval()
    ids, mask = inputs(0)
    with torch.no_grad():
        assert torch.equal(ours(input_ids=ids).logits, undropped(input_ids=ids).logits)


def test_generate_with_transformers_cache():
    ours, theirs = pair()
    ours.eval(), theirs.eval()
    ids, mask = inputs(3)
    kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0, return_dict_in_generate=True, output_logits=True)
    with torch.no_grad(), Calls() as calls:
        got = ours.generate(input_ids=ids, attention_mask=mask, **kw)
    assert calls.count == 2 * 6  # prefill and 5 decode steps, 2 layers
    with torch.no_grad():
        want = theirs.generate(input_ids=ids, attention_mask=mask, **kw)
    # Greedy tokens of random weights may flip on near-ties: compare the first step's logits
    # and then the tokens as long as they agree.
    torch.testing.assert_close(got.logits[0], want.logits[0], atol=1e-4, rtol=1e-4)
    for step, (a, b) in enumerate(zip(got.logits, want.logits)):
        if not torch.equal(got.sequences[:, : 12 + step], want.sequences[:, : 12 + step]):
            break
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    assert got.sequences.shape == (2, 18)


def test_compiled_model_has_no_graph_break():
    ours, theirs = pair()
    ours.eval(), theirs.eval()
    ids, _ = inputs(0)
    torch._dynamo.reset()
    compiled = torch.compile(ours, fullgraph=True)
    with torch.no_grad():
        got = compiled(input_ids=ids).logits
        want = theirs(input_ids=ids).logits
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_import_attn_stays_torch_free():
    import subprocess
    import sys

    code = "import sys, attn; assert 'torch' not in sys.modules and 'transformers' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def _mask_functions():
    mu = transformers.masking_utils
    packed = torch.tensor([[1, 1, 1, 2, 2, 2, 2, 3, 3, 3], [1, 1, 1, 1, 1, 2, 2, 2, 2, 2]])
    return {
        "causal": mu.causal_mask_function,
        "bidirectional": mu.bidirectional_mask_function,
        "sliding window 3": mu.sliding_window_causal_mask_function(3),
        "chunked 4": mu.chunked_causal_mask_function(4, torch.tensor([0, 2])),
        "packed sequences": mu.and_masks(mu.causal_mask_function, mu.packed_sequence_mask_function(packed)),
    }


@pytest.mark.parametrize("builder", ["sdpa_mask", "eager_mask"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("padding", [False, True], ids=["no_padding", "left_padding"])
@pytest.mark.parametrize("kind", ["causal", "bidirectional", "sliding window 3", "chunked 4", "packed sequences"])
@pytest.mark.parametrize("q_length", [10, 3], ids=["prefill", "chunk"])
def test_the_masks_transformers_builds_match_torch(builder, dtype, padding, kind, q_length):
    """Every mask transformers' mask builders make for sdpa and eager attention — boolean
    or additive (``finfo.min``), broadcast over heads, of the model's dtype — gives torch's
    result; rows that see no key are 0 in attn where torch's boolean path gives NaN."""
    mu = transformers.masking_utils
    kv_length = 10
    q_offset = kv_length - q_length  # a chunk of queries at the end, as in generation
    attention_mask = None
    if padding:
        attention_mask = torch.ones(2, kv_length, dtype=torch.bool)
        attention_mask[1, :4] = False
    args = dict(
        batch_size=2, q_length=q_length, kv_length=kv_length, q_offset=q_offset,
        mask_function=_mask_functions()[kind], attention_mask=attention_mask,
    )
    if builder == "sdpa_mask":
        mask = mu.sdpa_mask(**args, allow_is_causal_skip=False)
    else:
        mask = mu.eager_mask(**args, dtype=dtype)
    assert mask is not None and mask.shape == (2, 1, q_length, kv_length)
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(2, 4, q_length, 16, generator=gen).to(dtype)
    k = torch.randn(2, 2, kv_length, 16, generator=gen).to(dtype)
    v = torch.randn(2, 2, kv_length, 16, generator=gen).to(dtype)
    got = attn.scaled_dot_product_attention(q, k, v, mask, enable_gqa=True)
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, mask, enable_gqa=True)
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    if mask.dtype == torch.bool:
        sees = mask.any(-1, keepdim=True).expand_as(got[..., :1])
        assert torch.equal(got[~sees.expand_as(got)], torch.zeros_like(got[~sees.expand_as(got)]))
        got, want = got[sees.expand_as(got)], want[sees.expand_as(want)]
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)

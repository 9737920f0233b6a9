"""attn inside real models: tiny random-weight ``transformers`` models whose attention goes
through attn, against the same models with torch's own ``scaled_dot_product_attention``.

The models are built from configs alone (random weights, nothing downloaded) with
``attn_implementation="sdpa"`` for torch's runs (the float64 truth patches torch's function
to check each call); attn's runs switch the same model to ``attn_implementation="attn"``
(``import attn.transformers``: transformers' ``AttentionInterface`` and its mask builder),
nothing of torch patched, each call attn.transformers makes checked on its way: GPT-2 with left padding, Llama with grouped-query attention, Mistral with a sliding
window, Qwen2 with one K/V head, BERT with padding, BART and Whisper with cross-attention.
For each: the logits in eval mode, every parameter's gradient after one backward pass in
train mode (the hidden dropout layers seeded alike, attention dropout 0 so that torch's and
attn's runs compare), and for the decoders the logits of each step of a teacher-forced
generation with a KV cache (greedy tokens of random weights flip on near-ties, so the
tokens are fixed and the logits compared).

Training with attention dropout (GPT-2, BERT, BART, Whisper with their attention dropout at
0.1, in ``train()`` mode, through attn): the loss and every gradient finite,
``torch.manual_seed`` replaying a training step bit for bit, another seed another step; and
each model's loss and gradients equal to the same model in float64 whose attention is
torch's math path given attn's keep masks (``attn.dropout_mask`` of the seeds attn draws:
one ``torch.randint`` a call from torch's default generator, which the float64 run draws
alike, interleaved with the hidden dropout layers' draws).

The bound (docs/accuracy.md, "Inside models"): every attention call is checked against the
same call in float64 within attn's derived f32 bound; the model's outputs are compared
with torch's within ``K · (‖X_torch − X_f64‖ + u‖X_f64‖)``, where ``K`` is twice the largest
relative bound, in units of ``u = 2⁻²⁴``, of the calls the model made. Each test also
checks that attn was called, and ``test_a_wrong_attention_fails`` that deliberately broken
attentions fall outside the bound.
"""

import copy
import math
import os

import pytest

from strict import optional_import

# Nothing is downloaded: the models are built from configs. Offline mode makes an
# accidental fetch from the hub an immediate error rather than a wait on the network.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

torch = optional_import(
    "torch",
    "torch is not installed: the model tests are skipped (cargo xtask test installs it)",
)
transformers = optional_import(
    "transformers",
    "transformers is not installed: the model tests are skipped (cargo xtask test installs it)",
)

import attn  # noqa: E402
import attn.torch as attn_torch  # noqa: E402
import attn.transformers  # noqa: E402, F401  (registers attn_implementation="attn")
from math_path import math_sdpa  # noqa: E402

# Tiny tensors: one thread is fastest for torch's own ops, and keeps the runs' rounding
# independent of the machine's core count (attn's results never depend on it).
torch.set_num_threads(1)

# torch's function, taken before any test patches the module attribute.
TORCH_SDPA = torch.nn.functional.scaled_dot_product_attention
ATTN_TORCH_SDPA = attn_torch.scaled_dot_product_attention

U = 2.0**-24  # f32 unit roundoff


def gamma(m):
    return m * U / (1 - m * U)


# ---------------------------------------------------------------------------------------
# One attention call: the exact result in float64 and attn's f32 bound for it.


def exact_and_bound(query, key, value, attn_mask, is_causal, scale, enable_gqa):
    """The call's output in float64 and the bound of docs/accuracy.md on an f32 engine's
    error, element by element: ``2·[M_c·(2W/(1−W) + 3γ_{2n_k+2} + 2μ) + 2u·|O_c|]`` (one
    merge of partial states allowed for, the output rounded to f32), with ``W`` from the
    score errors ``δ_j = γ_{d_k+6}·scale·Σ_t|q_t||k_jt| + 4u·|b_j|`` of the visible keys.
    Returns ``(exact, bound, rel)``: ``rel`` is the largest ``bound / (u·M_c)``, the bound in
    units of the rounding of the largest visible value."""
    q, k, v = (x.detach().double() for x in (query, key, value))
    if enable_gqa and k.shape[-3] != q.shape[-3]:
        k = k.repeat_interleave(q.shape[-3] // k.shape[-3], dim=-3)
        v = v.repeat_interleave(q.shape[-3] // v.shape[-3], dim=-3)
    n_q, n_k, d = q.shape[-2], k.shape[-2], q.shape[-1]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    visible = torch.ones(n_q, n_k, dtype=torch.bool)
    if is_causal:
        visible = visible.tril()
    bias = torch.zeros(())
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            visible = visible & attn_mask
        else:
            bias = attn_mask.detach().double()
            visible = visible & (bias != -math.inf)
    visible = visible.expand(*torch.broadcast_shapes(visible.shape, q.shape[:-2] + (n_q, n_k)))
    bias = torch.where(visible, bias, 0.0)
    scores = scale * q @ k.transpose(-1, -2) + bias
    scores = scores.masked_fill(~visible, -math.inf)
    lse = torch.logsumexp(scores, dim=-1, keepdim=True)
    weights = torch.exp(scores - lse).nan_to_num(0.0)  # a row that sees nothing is 0
    exact = weights @ v
    delta = gamma(d + 6) * scale * (q.abs() @ k.abs().transpose(-1, -2)) + 4 * U * bias.abs()
    big_delta = torch.where(visible, delta, 0.0).amax(dim=-1, keepdim=True)
    log_n = math.log(n_k)
    w = torch.exp(big_delta + 4 * U) * (1 + 2 * U * (log_n + 2 * big_delta + 16)) - 1
    mu = 4 * U * (lse.abs().nan_to_num(0.0) + log_n + big_delta + 16) + 16 * U
    # M_c: the largest |v_jc| over the keys row i sees.
    m = (visible.unsqueeze(-1) * v.abs().unsqueeze(-3)).amax(dim=-2)
    bound = 2 * (m * (2 * w / (1 - w) + 3 * gamma(2 * n_k + 2) + 2 * mu) + 2 * U * exact.abs())
    rel = (bound / (U * m)).nan_to_num(0.0, posinf=0.0).amax().item()
    return exact, bound, rel


class Route:
    """The attention calls of a model inside a ``with`` block, computed by ``impl``. Counts
    the calls; each f32 call is checked against the same call in float64 within
    ``exact_and_bound``'s bound (with ``check``), and the largest relative bound of the calls
    is kept in ``rel``.

    Without ``model``, torch's ``scaled_dot_product_attention`` is replaced by the route (an
    ``"sdpa"`` model calls it). With ``model``, attn is reached as users reach it: the model
    is switched to ``attn_implementation="attn"`` for the block (transformers'
    ``AttentionInterface``, attn.transformers' mask builder), torch's function is left
    alone, and the calls attn.transformers makes to ``attn.torch``'s function go through the
    route."""

    def __init__(self, impl, check=True, model=None):
        self.impl, self.check, self.model = impl, check, model
        self.calls, self.rel = 0, 0.0

    def __call__(self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        self.calls += 1
        out = self.impl(
            query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa
        )
        if self.check and query.dtype == torch.float32:
            exact, bound, rel = exact_and_bound(query, key, value, attn_mask, is_causal, scale, enable_gqa)
            err = (out.detach().double() - exact).abs()
            worst = (err - bound).max().item()
            assert worst <= 0, (
                f"attention call {self.calls} ({tuple(query.shape)} × {tuple(key.shape)}, mask "
                f"{None if attn_mask is None else (tuple(attn_mask.shape), attn_mask.dtype)}, "
                f"causal={is_causal}) is off by {err.max().item():.3g}, beyond its bound"
            )
            self.rel = max(self.rel, rel)
        return out

    def __enter__(self):
        if self.model is None:
            torch.nn.functional.scaled_dot_product_attention = self
        else:
            self.previous = self.model.config._attn_implementation
            self.model.set_attn_implementation(attn.transformers.NAME)
            attn_torch.scaled_dot_product_attention = self
        return self

    def __exit__(self, *exc):
        if self.model is None:
            torch.nn.functional.scaled_dot_product_attention = TORCH_SDPA
        else:
            attn_torch.scaled_dot_product_attention = ATTN_TORCH_SDPA
            self.model.set_attn_implementation(self.previous)
        return False


def attn_interface(query, key, value, **kw):
    """What ``attn_implementation="attn"`` calls: attn.torch's function."""
    return ATTN_TORCH_SDPA(query, key, value, **kw)


def attn_sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    # attn's call takes the same arguments; tensors that require grad go through attn.torch.
    return attn.scaled_dot_product_attention(
        query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa
    )


def torch_sdpa(query, key, value, **kw):
    return TORCH_SDPA(query, key, value, **kw)


# ---------------------------------------------------------------------------------------
# The models: tiny configs, random weights (seeded), inputs that exercise their masks.

VOCAB, BATCH, LEN = 96, 2, 12
# Weights of a larger spread than the configs' default (0.02): with it, the random models'
# scores are near 0 and every softmax row near uniform, so that a wrong scale or a shifted
# mask would hardly move the logits. At 0.1 the scores spread over a few units.
INIT = 0.1
SMALL = dict(vocab_size=VOCAB)


def ids(*shape, seed):
    return torch.randint(4, VOCAB, shape, generator=torch.Generator().manual_seed(seed))


def decoder_only(config_cls, left_padding=0, **cfg):
    def build():
        config = config_cls(**SMALL, **cfg)
        model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
        tokens = ids(BATCH, LEN, seed=1)
        inputs, labels = {"input_ids": tokens}, tokens.clone()
        if left_padding:
            # Batched generation's layout: the shorter prompt padded on the left.
            mask = torch.ones(BATCH, LEN, dtype=torch.long)
            mask[1, :left_padding] = 0
            inputs["attention_mask"] = mask
            labels[1, :left_padding] = -100
        return model, inputs, labels

    return build


def llama_like(config_cls, **extra):
    return decoder_only(
        config_cls,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=64,
        attention_dropout=0.0,
        initializer_range=INIT,
        **extra,
    )


def bert(attention_dropout=0.0):
    config = transformers.BertConfig(
        **SMALL,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        max_position_embeddings=64,
        attention_probs_dropout_prob=attention_dropout,
        hidden_dropout_prob=0.1,
        initializer_range=INIT,
    )
    model = transformers.BertForMaskedLM._from_config(config, attn_implementation="sdpa")
    mask = torch.ones(BATCH, LEN, dtype=torch.long)
    mask[1, 8:] = 0  # the second sequence is 8 tokens and 4 of padding
    labels = ids(BATCH, LEN, seed=2).masked_fill(mask == 0, -100)
    return model, {"input_ids": ids(BATCH, LEN, seed=1), "attention_mask": mask}, labels


def bart(attention_dropout=0.0):
    config = transformers.BartConfig(
        **SMALL,
        d_model=64,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=128,
        decoder_ffn_dim=128,
        max_position_embeddings=64,
        attention_dropout=attention_dropout,
        dropout=0.1,
        init_std=INIT,
    )
    model = transformers.BartForConditionalGeneration._from_config(config, attn_implementation="sdpa")
    mask = torch.ones(BATCH, LEN, dtype=torch.long)
    mask[1, 9:] = 0  # a padded source sentence: the encoder's and the cross-attention's mask
    decoder = ids(BATCH, 8, seed=3)
    inputs = {"input_ids": ids(BATCH, LEN, seed=1), "attention_mask": mask, "decoder_input_ids": decoder}
    return model, inputs, ids(BATCH, 8, seed=2)


def whisper(attention_dropout=0.0):
    config = transformers.WhisperConfig(
        **SMALL,
        d_model=64,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=128,
        decoder_ffn_dim=128,
        num_mel_bins=8,
        max_source_positions=16,
        max_target_positions=32,
        attention_dropout=attention_dropout,
        dropout=0.1,
        init_std=INIT,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        decoder_start_token_id=1,
    )
    model = transformers.WhisperForConditionalGeneration._from_config(config, attn_implementation="sdpa")
    features = torch.randn(BATCH, 8, 32, generator=torch.Generator().manual_seed(1))
    inputs = {"input_features": features, "decoder_input_ids": ids(BATCH, 8, seed=3)}
    return model, inputs, ids(BATCH, 8, seed=2)


def gpt2(attention_dropout=0.0):
    return decoder_only(
        transformers.GPT2Config,
        left_padding=3,
        n_embd=64,
        n_layer=2,
        n_head=4,
        n_positions=64,
        attn_pdrop=attention_dropout,
        resid_pdrop=0.1,
        embd_pdrop=0.1,
        initializer_range=INIT,
        bos_token_id=1,
        eos_token_id=2,
    )()


MODELS = {
    "gpt2_left_padding": gpt2,
    "llama_gqa": llama_like(transformers.LlamaConfig, num_key_value_heads=2),
    "mistral_sliding_window": llama_like(transformers.MistralConfig, num_key_value_heads=2, sliding_window=4),
    "qwen2_one_kv_head": llama_like(transformers.Qwen2Config, num_key_value_heads=1),
    "bert_padding": bert,
    "bart_cross_attention": bart,
    "whisper_cross_attention": whisper,
}
DECODERS = [name for name in MODELS if name != "bert_padding"]


def build(name, **kw):
    """The model in f32 and in f64 with the same weights, its inputs and labels."""
    torch.manual_seed(0)
    model, inputs, labels = MODELS[name](**kw)
    assert model.config._attn_implementation == "sdpa"
    return model, copy.deepcopy(model).double(), inputs, labels


def as_dtype(inputs, model):
    """Float inputs (Whisper's features) in the model's dtype."""
    dtype = next(model.parameters()).dtype
    return {k: v.to(dtype) if v.is_floating_point() else v for k, v in inputs.items()}


# ---------------------------------------------------------------------------------------
# What is compared: each a dict of tensors.


def eval_logits(model, inputs, labels):
    model.eval()
    with torch.no_grad():
        return {"logits": model(**as_dtype(inputs, model)).logits}


def train_gradients(model, inputs, labels):
    model.train()
    model.zero_grad(set_to_none=True)
    torch.manual_seed(7)  # the hidden dropout masks: the same in every run, f32 or f64
    loss = model(**as_dtype(inputs, model), labels=labels).loss
    loss.backward()
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}
    return {"loss": loss.detach(), **grads}


PROMPT, STEPS = 5, 6


def teacher_forced(model, inputs, labels):
    """Prefill the first PROMPT tokens with a KV cache, then feed the next tokens one per
    step: the logits of each step, and those of the whole sequence in one call."""
    model.eval()
    inputs = as_dtype(inputs, model)
    key = "decoder_input_ids" if "decoder_input_ids" in inputs else "input_ids"
    tokens = torch.cat([inputs[key], ids(BATCH, STEPS, seed=4)], dim=1)
    out = {}
    with torch.no_grad():
        if model.config.is_encoder_decoder:
            # The encoder once; its padding mask is the cross-attention's at every step.
            source = {k: v for k, v in inputs.items() if k != key}
            fixed = {"encoder_outputs": model.get_encoder()(**source), "attention_mask": source.get("attention_mask")}

            def mask(n):
                return {}
        else:
            fixed = {}
            padding = inputs.get("attention_mask")
            grown = None if padding is None else torch.cat([padding, torch.ones_like(tokens[:, LEN:])], dim=1)

            def mask(n):  # the padding mask of the first n tokens
                return {} if grown is None else {"attention_mask": grown[:, :n]}

        step = model(**{key: tokens[:, :PROMPT]}, **fixed, **mask(PROMPT), use_cache=True)
        out["prefill"] = step.logits
        for t in range(PROMPT, PROMPT + STEPS):
            step = model(**{key: tokens[:, t : t + 1]}, **fixed, **mask(t + 1), cache=step.cache, use_cache=True)
            out[f"step{t - PROMPT}"] = step.logits
        # The same tokens in one call, without a cache: what each step must reproduce.
        n = PROMPT + STEPS
        out["full"] = model(**{key: tokens[:, :n]}, **fixed, **mask(n)).logits
    return out


# ---------------------------------------------------------------------------------------
# The comparison.


def run(what, model, inputs, labels, impl, check=True, interface=False):
    """``what`` of ``model`` with its attention computed by ``impl``: in place of torch's
    function, or, with ``interface``, through ``attn_implementation="attn"``."""
    route = Route(impl, check, model if interface else None)
    with route:
        result = what(model, inputs, labels)
    return result, route


def excess(got, want, truth, k):
    """Per tensor: ``‖got − want‖_∞ / (K·(‖want − truth‖_∞ + u·‖truth‖_∞))``, the share of the
    bound used (above 1: outside)."""
    shares = {}
    for name, t in truth.items():
        t = t.double()
        noise = (want[name].double() - t).abs().max().item() + U * t.abs().max().item()
        diff = (got[name].double() - want[name].double()).abs().max().item()
        shares[name] = diff / (k * noise) if noise > 0 else (0.0 if diff == 0 else math.inf)
    return shares


def compare(name, what):
    model, model64, inputs, labels = build(name)
    truth, _ = run(what, model64, inputs, labels, torch_sdpa)
    theirs, torch_route = run(what, model, inputs, labels, torch_sdpa)
    ours, attn_route = run(what, model, inputs, labels, attn_interface, interface=True)
    assert attn_route.calls > 0 and attn_route.calls == torch_route.calls, "attn was not called"
    # Both engines are within the same f32 bound of the exact call (checked per call), so
    # they may differ by twice it.
    k = 2 * max(attn_route.rel, torch_route.rel)
    shares = excess(ours, theirs, truth, k)
    worst = max(shares, key=shares.get)
    assert shares[worst] <= 1, f"{worst}: {shares[worst]:.3g} × the bound (K = {k:.0f})"
    return shares, k, (model, inputs, labels, truth, theirs, ours)


@pytest.mark.parametrize("name", MODELS)
def test_eval_logits(name):
    compare(name, eval_logits)


@pytest.mark.parametrize("name", MODELS)
def test_parameter_gradients(name):
    shares, _, _ = compare(name, train_gradients)
    assert len(shares) > 10  # every parameter that took part has a gradient compared


@pytest.mark.parametrize("name", DECODERS)
def test_teacher_forced_generation(name):
    shares, k, (_, _, _, truth, _, ours) = compare(name, teacher_forced)
    assert len(shares) == 2 + STEPS
    # The cache is really used: with attn, each step's logits are those of the whole
    # sequence at that position, within the same bound (a step that forgot the cache
    # would see one token).
    for t in range(STEPS):
        at = slice(PROMPT + t, PROMPT + t + 1)
        share = excess({"s": ours[f"step{t}"]}, {"s": ours["full"][:, at]}, {"s": truth["full"][:, at]}, k)["s"]
        assert share <= 1, f"step {t} differs from the full sequence: {share:.3g} × the bound"


# ---------------------------------------------------------------------------------------
# Teeth: the comparison must fail for a wrong attention.


def without_masks(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """A bug: the mask and the causal flag dropped."""
    return attn_sdpa(query, key, value, None, dropout_p, False, scale=scale, enable_gqa=enable_gqa)


def scale_off_by_a_percent(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """A bug: the softmax's scale 1 % too large."""
    scale = (1.0 / math.sqrt(query.shape[-1]) if scale is None else scale) * 1.01
    return attn_sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)


@pytest.mark.parametrize("bug", [without_masks, scale_off_by_a_percent], ids=lambda f: f.__name__)
@pytest.mark.parametrize("name", MODELS)
def test_a_wrong_attention_fails(name, bug):
    shares, k, (model, inputs, labels, truth, theirs, _) = compare(name, eval_logits)
    broken, route = run(eval_logits, model, inputs, labels, bug, check=False, interface=True)
    assert route.calls > 0
    share = excess(broken, theirs, truth, k)["logits"]
    assert share > 1, f"a wrong attention ({bug.__name__}) passes: {share:.3g} × the bound"


# ---------------------------------------------------------------------------------------
# Training with attention dropout: the models keep their configured attention dropout.

ATTENTION_DROPOUT = 0.1
DROPOUT_MODELS = ["gpt2_left_padding", "bert_padding", "bart_cross_attention", "whisper_cross_attention"]


def dropout_step(model, inputs, labels, impl, seed=7, interface=False):
    """One training step of ``model`` (train mode) with attention computed by ``impl`` (in
    place of torch's function, or through ``attn_implementation="attn"`` with
    ``interface``): the loss and every parameter's gradient, and the dropout probabilities
    it was called with."""
    ps = []

    def traced(query, key, value, attn_mask=None, dropout_p=0.0, **kw):
        ps.append(dropout_p)
        return impl(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, **kw)

    model.train()
    model.zero_grad(set_to_none=True)
    with Route(traced, check=False, model=model if interface else None):
        torch.manual_seed(seed)  # hidden dropout and attention seeds: one stream
        loss = model(**as_dtype(inputs, model), labels=labels).loss
        loss.backward()
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}
    return {"loss": loss.detach(), **grads}, ps


@pytest.mark.parametrize("name", DROPOUT_MODELS)
def test_training_with_attention_dropout(name):
    model, _, inputs, labels = build(name, attention_dropout=ATTENTION_DROPOUT)
    step, ps = dropout_step(model, inputs, labels, attn_interface, interface=True)
    assert ps and all(p == ATTENTION_DROPOUT for p in ps), ps  # every attention drops
    for key, t in step.items():
        assert torch.isfinite(t).all(), f"{key} is not finite"
    assert len(step) > 10
    replay, _ = dropout_step(model, inputs, labels, attn_interface, interface=True)
    for key, t in step.items():
        assert torch.equal(replay[key], t), f"torch.manual_seed does not replay {key}"
    other, _ = dropout_step(model, inputs, labels, attn_interface, seed=8, interface=True)
    assert not torch.equal(other["loss"], step["loss"])


@pytest.mark.parametrize("name", DROPOUT_MODELS)
def test_training_with_attention_dropout_is_the_math_path_with_attns_masks(name):
    model, model64, inputs, labels = build(name, attention_dropout=ATTENTION_DROPOUT)
    ours, _ = dropout_step(model, inputs, labels, attn_interface, interface=True)
    truth, _ = dropout_step(model64, inputs, labels, math_sdpa)
    # torch's math path in float32 with the same masks: the rounding of an f32 model.
    theirs, _ = dropout_step(model, inputs, labels, math_sdpa)
    for key, t in truth.items():
        size = t.abs().max().item()
        err = (ours[key].double() - t).abs().max().item()
        noise = (theirs[key].double() - t).abs().max().item()
        # Within f32 rounding of the float64 run: 1e-5 of the tensor's largest entry, or
        # a few times what torch's f32 math path is off by.
        assert err <= max(1e-5 * size, 8 * noise), f"{key}: off by {err:.3g} (largest {size:.3g}, torch's f32 {noise:.3g})"
    # Without the masks the models part: the comparison has teeth.
    undropped, _ = dropout_step(model64, inputs, labels, lambda q, k, v, dropout_p=0.0, **kw: math_sdpa(q, k, v, **kw))
    assert (undropped["loss"] - truth["loss"]).abs().item() > 1e-4

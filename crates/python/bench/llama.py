"""A 2-layer Llama-style model through transformers with ``attn_implementation="attn"``
against ``"sdpa"`` (torch's own attention), and compiled against eager, in the same run.

    target/python-venv/bin/python crates/python/bench/llama.py      # after `cargo xtask test`

The model: hidden 1024, 16 query heads and 4 key/value heads of 128, an MLP of 2816, 2
layers (transformers' ``LlamaModel``: no language-model head, whose GEMM would dwarf the
attention), random weights, one sequence of ``--n`` tokens (2048), causal. Both sides on
the same threads (2 by default: torch's intra-op pool and attn's). For each dtype (float32,
bfloat16), interleaved rounds (A B A B …, the order alternating) of:

- forward (under ``torch.no_grad()``): ``"attn"`` eager, ``"sdpa"`` eager, and ``"attn"``
  compiled with ``torch.compile(fullgraph=True)`` (inductor);
- forward + backward (a mean-square loss of the last hidden state): ``"attn"`` and
  ``"sdpa"`` eager.

Medians and same-run ratios are printed; targets: the compiled forward at most 1.05× the
eager attn forward's time, and the compiled output equal to eager attn's (within rounding
of inductor's fused elementwise code).
"""

import argparse
import os
import platform
import statistics
import sys
import time


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=2, help="threads of torch and attn")
    p.add_argument("--rounds", type=int, default=7, help="interleaved rounds")
    p.add_argument("--n", type=int, default=2048, help="sequence length")
    p.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated torch dtypes")
    p.add_argument("--strict", action="store_true", help="exit 1 when a target is missed")
    return p.parse_args()


args = parse_args()
os.environ["RAYON_NUM_THREADS"] = str(args.threads)
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
import transformers  # noqa: E402

import attn  # noqa: E402
import attn.transformers  # noqa: E402, F401  (registers attn_implementation="attn")
import machine  # noqa: E402

torch.set_num_threads(args.threads)


def config():
    return transformers.LlamaConfig(
        vocab_size=1024,
        hidden_size=1024,
        intermediate_size=2816,
        num_hidden_layers=2,
        num_attention_heads=16,
        num_key_value_heads=4,
        max_position_embeddings=args.n,
        attention_dropout=0.0,
    )


def models(dtype):
    """The same random weights under ``"attn"`` and ``"sdpa"``."""
    torch.manual_seed(0)
    ours = transformers.AutoModel.from_config(config(), attn_implementation="attn", dtype=dtype)
    theirs = transformers.AutoModel.from_config(config(), attn_implementation="sdpa", dtype=dtype)
    theirs.load_state_dict(ours.state_dict())
    return ours, theirs


def forward(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).last_hidden_state


def training_step(model, ids):
    model.zero_grad(set_to_none=True)
    hidden = model(input_ids=ids).last_hidden_state
    loss = hidden.float().pow(2).mean()
    loss.backward()
    return loss


def timed(f, *a):
    start = time.perf_counter()
    f(*a)
    return time.perf_counter() - start


def interleaved(cases, rounds):
    """Medians of ``rounds`` interleaved rounds; the order alternates each round."""
    times = {name: [] for name in cases}
    names = list(cases)
    for r in range(rounds):
        for name in names if r % 2 == 0 else reversed(names):
            times[name].append(timed(*cases[name]))
    return {name: statistics.median(t) for name, t in times.items()}


def main():
    print(
        f"CPU: {machine.describe()}; attn kernels: {attn.isa()}; "
        f"threads: torch {torch.get_num_threads()}, attn {attn.num_threads()}; "
        f"torch {torch.__version__}, transformers {transformers.__version__}, Python {platform.python_version()}"
    )
    print(
        f"model: LlamaModel, 2 layers, hidden 1024, 16 heads / 4 K/V heads of 128, MLP 2816; "
        f"batch 1, n = {args.n}, causal; {args.rounds} interleaved rounds, medians"
    )
    missed = []
    ids = torch.randint(0, 1024, (1, args.n), generator=torch.Generator().manual_seed(1))
    for name in args.dtypes.split(","):
        dtype = getattr(torch, name)
        ours, theirs = models(dtype)
        ours.eval()
        theirs.eval()
        torch._dynamo.reset()
        compiled = torch.compile(ours, fullgraph=True)
        eager_out = forward(ours, ids)
        compiled_out = forward(compiled, ids)  # compiles
        tol = 1e-4 if dtype == torch.float32 else 2e-2
        worst = (compiled_out.float() - eager_out.float()).abs().max().item()
        scale = eager_out.float().abs().max().item()
        equal = worst <= tol * max(scale, 1.0)
        sdpa_out = forward(theirs, ids)
        vs_sdpa = (sdpa_out.float() - eager_out.float()).abs().max().item()
        for model in (ours, theirs):  # warm-up of the training step
            training_step(model, ids)

        fwd = interleaved(
            {
                "attn": (forward, ours, ids),
                "sdpa": (forward, theirs, ids),
                "attn compiled": (forward, compiled, ids),
            },
            args.rounds,
        )
        train = interleaved(
            {"attn": (training_step, ours, ids), "sdpa": (training_step, theirs, ids)}, args.rounds
        )
        print(f"\n{name}:")
        print(
            f"  forward:            attn {fwd['attn'] * 1e3:8.1f} ms, sdpa {fwd['sdpa'] * 1e3:8.1f} ms: "
            f"sdpa / attn = {fwd['sdpa'] / fwd['attn']:.3f}"
        )
        print(
            f"  forward + backward: attn {train['attn'] * 1e3:8.1f} ms, sdpa {train['sdpa'] * 1e3:8.1f} ms: "
            f"sdpa / attn = {train['sdpa'] / train['attn']:.3f}"
        )
        ratio = fwd["attn compiled"] / fwd["attn"]
        print(
            f"  compiled forward:   {fwd['attn compiled'] * 1e3:8.1f} ms = {ratio:.3f} x eager attn "
            f"(target <= 1.05); max |compiled - eager| = {worst:.2e} (output max {scale:.2e}); "
            f"max |sdpa - attn| = {vs_sdpa:.2e}"
        )
        if ratio > 1.05:
            missed.append(f"{name} compiled forward {ratio:.3f} x eager")
        if not equal:
            missed.append(f"{name} compiled output differs from eager by {worst:.2e}")
    print("\ntargets: " + ("met" if not missed else "MISSED: " + "; ".join(missed)))
    if missed and args.strict:
        sys.exit(1)


if __name__ == "__main__":
    main()

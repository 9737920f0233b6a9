"""What calling attn through its ``torch.library`` operator costs over calling it plainly,
against what the same registration costs an operator that does nothing, in the same run.

    target/python-venv/bin/python crates/python/bench/op_overhead.py   # after `cargo xtask test`

Tiny shapes (``(1, 2, 8, 16)`` float32 query, key and value, by default), where the compute
is negligible; blocks of calls, the median call of each block, medians over the blocks, the
cases interleaved block by block:

- plain: ``attn.attention_with_lse(q, k, v)`` (the extension's function: what the operator
  computes, ``(out, lse)``, without torch's dispatcher);
- operator: ``torch.ops.attn.sdpa_forward.default(q, k, v, None, 0.0, False, None, False,
  "top_left")``;
- no-op operator: an operator of the same schema registered the same way (``attn.torch``'s
  registration: a CPU kernel, a fake kernel, the autograd kernel), whose CPU kernel returns
  two empty tensors of the output's shapes; and that kernel called directly;
- for reference: ``attn.torch.scaled_dot_product_attention`` (the operator behind torch's
  argument handling), ``attn.scaled_dot_product_attention`` and torch's own function.

The operator's overhead is ``operator - plain``; the no-op's is ``no-op operator - its
kernel``: each the median over rounds of the difference within a round (the order of the
cases alternating), so that the machine's drift between rounds cancels. Targets: the operator's overhead at most 15 µs and at most 1.2× the no-op's.
``--strict`` exits 1 when a target is missed.
"""

import argparse
import os
import platform
import statistics
import sys


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=1, help="threads of torch and attn")
    p.add_argument("--blocks", type=int, default=30, help="interleaved blocks per case")
    p.add_argument("--calls", type=int, default=2000, help="calls per block")
    p.add_argument("--shape", default="1,2,8,16", help="query, key and value shape")
    p.add_argument("--strict", action="store_true", help="exit 1 when a target is missed")
    return p.parse_args()


args = parse_args()
os.environ["RAYON_NUM_THREADS"] = str(args.threads)

import torch  # noqa: E402

import attn  # noqa: E402
import attn.torch as attn_torch  # noqa: E402
import machine  # noqa: E402

torch.set_num_threads(args.threads)


# The no-op operator, registered as attn.torch registers its own.
_lib = torch.library.Library("attn_bench", "DEF")
_lib.define(
    "noop(Tensor query, Tensor key, Tensor value, Tensor? attn_mask, float dropout_p, "
    "bool is_causal, float? scale, bool enable_gqa, str causal_alignment, Tensor? seed=None, "
    "Tensor? cu_seqlens_q=None, Tensor? cu_seqlens_k=None) -> (Tensor, Tensor)",
    tags=(torch.Tag.pt2_compliant_tag,),
)
noop_op = torch.ops.attn_bench.noop.default


def noop_kernel(
    query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, causal_alignment,
    seed=None, cu_seqlens_q=None, cu_seqlens_k=None,
):
    return query.new_empty((*query.shape[:-1], value.shape[-1])), query.new_empty(query.shape[:-1])


def _no_graph(keyset, *args):
    raise RuntimeError("the benchmark's no-op operator has no autograd formula")


attn_torch._register(_lib, noop_op, noop_kernel, noop_kernel, _no_graph)


def main():
    print(
        f"CPU: {machine.describe()}; attn kernels: {attn.isa()}; "
        f"threads: {args.threads}; torch {torch.__version__}, Python {platform.python_version()}"
    )
    shape = tuple(int(x) for x in args.shape.split(","))
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(shape, generator=gen) for _ in range(3))
    op_args = (q, k, v, None, 0.0, False, None, False, "top_left")
    cases = {
        "plain": lambda: attn.attention_with_lse(q, k, v),
        "operator": lambda: attn_torch.sdpa_forward(*op_args),
        "no-op kernel": lambda: noop_kernel(*op_args),
        "no-op operator": lambda: noop_op(*op_args),
        "attn.torch.scaled_dot_product_attention": lambda: attn_torch.scaled_dot_product_attention(q, k, v),
        "attn.scaled_dot_product_attention": lambda: attn.scaled_dot_product_attention(q, k, v),
        "torch's scaled_dot_product_attention": lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v),
    }
    torch.testing.assert_close(cases["operator"]()[0], cases["plain"]()[0], rtol=0, atol=0)
    for f in cases.values():
        for _ in range(500):
            f()
    per_block = {name: [] for name in cases}
    names = list(cases)
    for r in range(args.blocks):
        for name in names if r % 2 == 0 else reversed(names):
            per_block[name].append(machine.block_median(cases[name], args.calls))
    us = {name: statistics.median(t) / 1e3 for name, t in per_block.items()}
    print(f"{shape} float32, {args.blocks} interleaved rounds of one block of {args.calls} calls per case (medians):")
    for name, t in us.items():
        print(f"  {name:42s} {t:7.2f} µs")

    def paired(a, b):
        """The median over rounds of case a's block minus case b's in the same round: the
        machine's drift between rounds cancels."""
        return statistics.median(x - y for x, y in zip(per_block[a], per_block[b])) / 1e3

    overhead = paired("operator", "plain")
    noop = paired("no-op operator", "no-op kernel")
    ratio = overhead / noop
    print(
        f"operator overhead {overhead:.2f} µs (target <= 15); no-op operator's {noop:.2f} µs; "
        f"ratio {ratio:.2f} (target <= 1.2) (medians of same-round differences)"
    )
    missed = []
    if overhead > 15:
        missed.append("overhead > 15 µs")
    if ratio > 1.2:
        missed.append("overhead > 1.2 x the no-op's")
    print("targets: " + ("met" if not missed else "MISSED: " + ", ".join(missed)))
    if missed and args.strict:
        sys.exit(1)


if __name__ == "__main__":
    main()

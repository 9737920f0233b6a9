"""What calling attn through Python costs over calling it from Rust, in the same run.

    python crates/python/bench/overhead.py            # after `maturin develop --release`
    target/python-venv/bin/python crates/python/bench/overhead.py   # after `cargo xtask test`

Two measurements, each interleaving Python calls with the same calls made by a Rust process
(crates/python/examples/rust_side.rs, built here in release), both on the same number of
threads (2 by default):

- big: ``scaled_dot_product_attention`` on ``[1, 8, 4096, 64]`` float32 query, key and value,
  one Python call then one Rust call per round (the order alternating), medians over the
  rounds. Target: Python at most 3 % slower.
- tiny: one ``[1, 32, 1, 128]`` query against ``[1, 32, 16, 128]`` keys and values, where the
  compute is negligible: blocks of calls, the median call of each block, medians over the
  blocks. Target: the fixed cost Python adds to a call at most 20 µs.

``--strict`` exits 1 when a target is missed.
"""

import argparse
import os
import pathlib
import platform
import statistics
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[3]


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=2, help="threads of both sides (RAYON_NUM_THREADS)")
    p.add_argument("--rounds", type=int, default=15, help="interleaved rounds of the big call")
    p.add_argument("--blocks", type=int, default=30, help="interleaved blocks of tiny calls")
    p.add_argument("--calls", type=int, default=2000, help="tiny calls per block")
    p.add_argument("--rust-bin", help="the rust_side example, already built (default: build it)")
    p.add_argument("--strict", action="store_true", help="exit 1 when a target is missed")
    return p.parse_args()


args = parse_args()
# attn's thread pool starts on the first call: choose its size before.
os.environ["RAYON_NUM_THREADS"] = str(args.threads)

import numpy as np  # noqa: E402

import attn  # noqa: E402
import machine  # noqa: E402


def rust_binary():
    if args.rust_bin:
        return args.rust_bin
    cargo = os.environ.get("CARGO", "cargo")
    out = subprocess.run(
        [cargo, "build", "--release", "-p", "attn-python", "--example", "rust_side", "--message-format=json-render-diagnostics"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
        check=True,
    ).stdout
    import json

    for line in out.splitlines():
        try:
            m = json.loads(line)
        except ValueError:
            continue
        if m.get("reason") == "compiler-artifact" and m["target"]["name"] == "rust_side" and m.get("executable"):
            return m["executable"]
    sys.exit("cargo built rust_side but did not name its executable")


class Rust:
    def __init__(self, path):
        env = dict(os.environ, RAYON_NUM_THREADS=str(args.threads))
        self.proc = subprocess.Popen([path], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)

    def run(self, case, n):
        self.proc.stdin.write(f"{case} {n}\n")
        self.proc.stdin.flush()
        return [int(x) for x in self.proc.stdout.readline().split()]

    def close(self):
        self.proc.stdin.write("quit\n")
        self.proc.stdin.close()
        self.proc.wait()


def timed(f, *a):
    start = time.perf_counter_ns()
    f(*a)
    return time.perf_counter_ns() - start


def main():
    print(f"CPU: {machine.describe()}; attn kernels: {attn.isa()}; "
          f"threads: {attn.num_threads()} (Python) and {args.threads} (Rust); Python {platform.python_version()}, NumPy {np.__version__}")
    rust = Rust(rust_binary())
    rng = np.random.default_rng(0)
    sdpa = attn.scaled_dot_product_attention

    big = [rng.standard_normal((1, 8, 4096, 64)).astype(np.float32) for _ in range(3)]
    sdpa(*big)  # warm-up (thread pool, pages)
    rust.run("big", 1)
    py_big, rs_big = [], []
    for r in range(args.rounds):
        if r % 2 == 0:
            py_big.append(timed(sdpa, *big))
            rs_big += rust.run("big", 1)
        else:
            rs_big += rust.run("big", 1)
            py_big.append(timed(sdpa, *big))
    py_m, rs_m = statistics.median(py_big), statistics.median(rs_big)
    big_overhead = py_m / rs_m - 1
    paired = statistics.median(p / r for p, r in zip(py_big, rs_big)) - 1
    print(f"big  [1, 8, 4096, 64] f32, {args.rounds} interleaved rounds: Python {py_m / 1e6:.2f} ms, "
          f"Rust {rs_m / 1e6:.2f} ms (medians): Python {big_overhead * 100:+.2f} % "
          f"(median of paired ratios {paired * 100:+.2f} %); target <= +3 %")

    tiny = (
        rng.standard_normal((1, 32, 1, 128)).astype(np.float32),
        rng.standard_normal((1, 32, 16, 128)).astype(np.float32),
        rng.standard_normal((1, 32, 16, 128)).astype(np.float32),
    )
    for _ in range(1000):
        sdpa(*tiny)
    py_tiny, rs_tiny = [], []
    for _ in range(args.blocks):
        py_tiny.append(statistics.median(timed(sdpa, *tiny) for _ in range(args.calls)))
        rs_tiny.append(statistics.median(rust.run("tiny", args.calls)))
    rust.close()
    py_t, rs_t = statistics.median(py_tiny), statistics.median(rs_tiny)
    fixed = (py_t - rs_t) / 1e3
    print(f"tiny [1, 32, 1, 128] x [1, 32, 16, 128] f32, {args.blocks} blocks of {args.calls}: "
          f"Python {py_t / 1e3:.1f} µs, Rust {rs_t / 1e3:.1f} µs per call (medians): "
          f"Python adds {fixed:.1f} µs; target <= 20 µs")
    missed = []
    if big_overhead > 0.03:
        missed.append("big call overhead > 3 %")
    if fixed > 20:
        missed.append("fixed cost > 20 µs")
    print("targets: " + ("met" if not missed else "MISSED: " + ", ".join(missed)))
    if missed and args.strict:
        sys.exit(1)


if __name__ == "__main__":
    main()

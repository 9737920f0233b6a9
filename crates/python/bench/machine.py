"""What the benchmark scripts of this folder say about the machine and how they time."""

import pathlib
import statistics
import subprocess
import time

_FLAGS = ("avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16")


def cpu():
    """``(model, flags)``: lscpu's model name and the AVX-512 / AMX flags of /proc/cpuinfo
    that decide attn's kernels."""
    model = "unknown"
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        model = next((l.split(":", 1)[1].strip() for l in out.splitlines() if l.startswith("Model name")), model)
    except (OSError, subprocess.CalledProcessError):
        pass
    try:
        present = set(pathlib.Path("/proc/cpuinfo").read_text().split())
    except OSError:
        present = set()
    return model, [f for f in _FLAGS if f in present]


def describe():
    """One line naming the CPU and its flags."""
    model, flags = cpu()
    return f"{model} ({' '.join(flags) or 'no AVX-512'})"


def block_median(f, calls):
    """The median time of ``calls`` calls of ``f()``, in nanoseconds."""
    times = []
    for _ in range(calls):
        start = time.perf_counter_ns()
        f()
        times.append(time.perf_counter_ns() - start)
    return statistics.median(times)

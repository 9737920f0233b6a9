"""The generated robustness suite of the Python door: hostile DLPack capsules and NumPy
arrays (robustness.py) run in child processes, so that a crash or an abort is counted
against its case and a hang is caught by a time limit per case.

Deterministic: the cases come from fixed seeds (``ATTN_ROBUSTNESS_SEED`` and
``ATTN_ROBUSTNESS_CASES`` explore further). Every case must give a correct result or a
typed error (see robustness.py); the failures are listed with what each case was.
"""

import json
import os
import pathlib
import select
import subprocess
import sys
import tempfile
import time

import pytest

HERE = pathlib.Path(__file__).resolve().parent
SEED = int(os.environ.get("ATTN_ROBUSTNESS_SEED", "27"))
CASES = int(os.environ.get("ATTN_ROBUSTNESS_CASES", "400"))
# A case computes in milliseconds; the limit leaves room for a loaded CI machine.
LIMIT = float(os.environ.get("ATTN_ROBUSTNESS_LIMIT", "20"))


class Child:
    """A worker process (robustness.py) fed case numbers on stdin."""

    def __init__(self):
        env = dict(os.environ, RAYON_NUM_THREADS="2", PYTHONPATH=str(HERE) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        # stderr to a file: a pipe nobody reads could fill and stall the child.
        self.err = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen(
            [sys.executable, str(HERE / "robustness.py")],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.err,
            env=env,
            text=True,
            bufsize=1,
        )
        self.buffer = ""

    def line(self, deadline):
        """The next line of output; "" at the end of output (the child died), None past the
        deadline."""
        fd = self.proc.stdout.fileno()
        while "\n" not in self.buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return None
            chunk = os.read(fd, 65536).decode()
            if not chunk:
                return ""
            self.buffer += chunk
        line, self.buffer = self.buffer.split("\n", 1)
        return line

    def kill(self):
        self.proc.kill()
        self.proc.wait()
        self.err.seek(0)
        return self.err.read()

    def close(self):
        self.proc.stdin.close()
        self.proc.wait(timeout=30)


def run_suite(suite, seed, count, limit=LIMIT):
    """Every case's outcome: ``{index: (status, detail, what)}``."""
    outcomes = {}
    child = Child()
    index = 0
    while index < count:
        child.proc.stdin.write(f"{suite} {seed} {index}\n")
        child.proc.stdin.flush()
        started = child.line(time.monotonic() + 60)  # the child's start-up (imports)
        result = child.line(time.monotonic() + limit) if started else started
        if not result:
            err = child.kill()
            tail = err.strip().splitlines()[-3:] if err else []
            if result == "":
                status = f"crash (exit status {child.proc.returncode})"
            else:
                status = f"hang (no result within {limit:.0f} s)"
            outcomes[index] = ("bad", f"{status}: {' | '.join(tail)}", "?")
            child = Child()
        else:
            r = json.loads(result)
            outcomes[index] = (r["status"], r["detail"], f"{r['entry']} [{r['expect']}] {r['what']}")
        index += 1
    child.close()
    return outcomes


def describe(suite, seed, outcomes):
    """The failures, one line each, with how to rerun one."""
    bad = [(i, o) for i, o in sorted(outcomes.items()) if o[0] == "bad"]
    lines = [f"{len(bad)} of {len(outcomes)} {suite} cases (seed {seed}) break the contract:"]
    lines += [f"  case {i}: {detail} — {what}" for i, (_, detail, what) in bad[:40]]
    lines.append(f"  (rerun one: echo '{suite} {seed} N' | python crates/python/tests/robustness.py)")
    return "\n".join(lines)


@pytest.mark.parametrize("suite", ["dlpack", "numpy", "cache", "torch"])
def test_generated_hostile_inputs(suite):
    if suite == "torch":
        pytest.importorskip("torch", reason="torch is not installed: the torch suite is skipped")
    count = {"dlpack": CASES, "numpy": CASES, "cache": CASES // 2, "torch": CASES // 4}[suite]
    outcomes = run_suite(suite, SEED, count)
    assert all(o[0] != "bad" for o in outcomes.values()), describe(suite, SEED, outcomes)
    # The suite exercises both outcomes: results compared with the formula, and refusals.
    statuses = [o[0] for o in outcomes.values()]
    assert statuses.count("ok") >= count // 5 and statuses.count("typed") >= count // 50, statuses


def test_the_harness_counts_crashes_and_hangs(tmp_path):
    # The suite's teeth: a child that aborts or hangs is a failure of its case, not of the
    # run. Planted through a module that shadows robustness.py's `attn`.
    fake = tmp_path / "attn"
    fake.mkdir()
    (fake / "__init__.py").write_text(
        "import os, time\n"
        "calls = [0]\n"
        f"marker = {str(tmp_path / 'aborted')!r}\n"
        "def _call(*a, **k):\n"
        "    calls[0] += 1\n"
        "    if calls[0] == 2 and not os.path.exists(marker):\n"
        "        open(marker, 'w').close()\n"
        "        os.abort()\n"
        "    if calls[0] == 2:\n"
        "        time.sleep(3600)\n"
        "    raise ValueError('refused')\n"
        "scaled_dot_product_attention = attention_with_lse = attention_backward = _call\n"
    )
    saved = os.environ.get("PYTHONPATH", "")
    os.environ["PYTHONPATH"] = str(tmp_path) + os.pathsep + saved
    try:
        outcomes = run_suite("dlpack", SEED, 6, limit=2)
    finally:
        os.environ["PYTHONPATH"] = saved
    bad = {i: o[1] for i, o in outcomes.items() if o[0] == "bad"}
    assert any("crash" in d for d in bad.values()), outcomes
    assert any("hang" in d for d in bad.values()), outcomes

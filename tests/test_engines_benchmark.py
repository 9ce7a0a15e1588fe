"""benchmarks/engines.py's generation figures at `--quick --no-jobs` (the quickstart's policy, 16 new tokens): a
row for each engine, transformers and vLLM, with positive start-up seconds and generated tokens/s, and the vLLM
row's ratio. Each engine starts in a process of its own; the whole jobs of the trained samples/s column are left to
the benchmark's own runs (two more `rlp run` jobs would double the test's minute)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("vllm")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_engines_benchmark_measures_both_engines(tmp_path):
    out = tmp_path / "engines.md"
    done = subprocess.run([sys.executable, os.path.join(REPO, "benchmarks", "engines.py"), "--quick",
                           "--no-jobs", "--out", str(out)], cwd=REPO, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = {}
    for line in out.read_text().splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if line.startswith("| quickstart "):
            rows[cells[3]] = cells
    assert sorted(rows) == ["transformers", "vllm"], out.read_text()
    for engine, cells in rows.items():
        startup, tokens_per_s = (float(cell) for cell in cells[4:6])  # "failed" does not parse
        assert startup > 0 and tokens_per_s > 0 and cells[6] == "-", cells  # no job was run
    assert float(rows["vllm"][7]) > 0  # vLLM / transformers tokens/s

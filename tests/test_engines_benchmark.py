"""benchmarks/engines.py end to end at `--quick` (the quickstart's policy, 16 new tokens, 2 RL steps): a row for
each engine, transformers and vLLM, with positive start-up seconds, generated tokens/s and trained samples/s, and
the vLLM row's ratios. Minutes, not seconds: four processes, two of them whole `rlp run` jobs."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("vllm")
pytestmark = pytest.mark.slow

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_engines_benchmark_measures_both_engines(tmp_path):
    out = tmp_path / "engines.md"
    done = subprocess.run([sys.executable, os.path.join(REPO, "benchmarks", "engines.py"), "--quick",
                           "--out", str(out)], cwd=REPO, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = {}
    for line in out.read_text().splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if line.startswith("| quickstart "):
            rows[cells[3]] = cells
    assert sorted(rows) == ["transformers", "vllm"], out.read_text()
    for engine, cells in rows.items():
        startup, tokens_per_s, samples_per_s = (float(cell) for cell in cells[4:7])  # "failed" does not parse
        assert startup > 0 and tokens_per_s > 0 and samples_per_s > 0, cells
    assert float(rows["vllm"][7]) > 0 and float(rows["vllm"][8]) > 0  # vLLM / transformers, both figures

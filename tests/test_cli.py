"""The installed `rlp` console script, run as a subprocess: `validate` accepts the quickstart,
and a bad config makes `validate` and `run` exit 2 with one stderr line naming key and file."""

from __future__ import annotations

import json
import os
import socket
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def rlp_executable() -> str:
    beside_python = Path(sys.executable).parent / "rlp"
    if beside_python.exists():
        return str(beside_python)
    found = shutil.which("rlp")
    if not found:
        pytest.fail("the `rlp` console script is not installed (pip install -e .)")
    return found


def rlp(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, WANDB_MODE="disabled", RAY_ADDRESS="")
    return subprocess.run([rlp_executable(), *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=60)


def stderr_lines(result: subprocess.CompletedProcess) -> list:
    return [line for line in result.stderr.splitlines() if line.strip()]


def test_validate_quickstart_exits_zero():
    result = rlp("validate", "configs/quickstart.yaml", cwd=REPO)
    assert result.returncode == 0, result.stderr
    assert "configs/quickstart.yaml: ok" in result.stdout
    assert "quickstart" in result.stdout
    assert stderr_lines(result) == []


@pytest.mark.parametrize("command", ["validate", "run"])
def test_unknown_key_exits_2_with_one_line(tmp_path, command):
    config = tmp_path / "bad.yaml"
    config.write_text("name: bad\nrl:\n  max_stepz: 3\n")
    result = rlp(command, str(config), cwd=tmp_path)
    assert result.returncode == 2, (result.stdout, result.stderr)
    lines = stderr_lines(result)
    assert len(lines) == 1, result.stderr
    assert "rl.max_stepz" in lines[0] and str(config) in lines[0]
    assert result.stdout == ""
    # `run` must fail before anything starts: no run directory is created
    assert not (tmp_path / "runs").exists()


def test_unknown_reward_exits_2_naming_it(tmp_path):
    config = tmp_path / "reward.yaml"
    config.write_text("rewards:\n  - name: nope\n")
    result = rlp("validate", str(config), cwd=tmp_path)
    assert result.returncode == 2, (result.stdout, result.stderr)
    lines = stderr_lines(result)
    assert len(lines) == 1, result.stderr
    assert "'nope'" in lines[0] and str(config) in lines[0]
    assert "exact_match" in lines[0]  # the known names are listed


def test_bad_override_exits_2(tmp_path):
    result = rlp("validate", str(REPO / "configs" / "quickstart.yaml"), "rl.max_steps", cwd=tmp_path)
    assert result.returncode == 2
    lines = stderr_lines(result)
    assert len(lines) == 1 and "rl.max_steps" in lines[0]


def test_unreachable_redis_fails_fast_with_one_line_and_a_failed_summary(tmp_path):
    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    result = rlp("run", str(REPO / "configs" / "quickstart.yaml"), f"redis.url=redis://127.0.0.1:{port}/0",
                 f"output_dir={tmp_path}", "name=noredis", cwd=tmp_path)
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"rlp: cannot reach Redis at redis://127.0.0.1:{port}/0")
    summary = json.loads((tmp_path / "noredis" / "summary.json").read_text())
    assert summary["status"] == "failed" and "cannot reach Redis" in summary["error"]

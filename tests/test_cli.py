"""The installed `rlp` console script, run as a subprocess: `validate` accepts the quickstart,
and a bad config, data file, model folder or Ray address makes `validate` and `run` exit 2
with one stderr line naming the key or file, before any service starts."""

from __future__ import annotations

import json
import os
import signal
import socket
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.processes import session

REPO = Path(__file__).resolve().parents[1]


def rlp_executable() -> str:
    beside_python = Path(sys.executable).parent / "rlp"
    if beside_python.exists():
        return str(beside_python)
    found = shutil.which("rlp")
    if not found:
        pytest.fail("the `rlp` console script is not installed (pip install -e .)")
    return found


def rlp(*args: str, cwd: Path, ray_address: str = "") -> subprocess.CompletedProcess:
    """`rlp *args` to its end, in a session of its own (`.pid`: its pid, the session's id)."""
    env = dict(os.environ, WANDB_MODE="disabled", RAY_ADDRESS=ray_address)
    with subprocess.Popen([rlp_executable(), *args], cwd=cwd, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True, start_new_session=True) as process:
        try:
            out, err = process.communicate(timeout=180)  # generous: `run` imports Ray and torch before failing
        finally:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
    completed = subprocess.CompletedProcess(process.args, process.returncode, out, err)
    completed.pid = process.pid
    return completed


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
    result = rlp("run", str(REPO / "configs" / "quickstart.yaml"), f"redis.url=redis://:s3cret@127.0.0.1:{port}/0",
                 f"output_dir={tmp_path}", "name=noredis", cwd=tmp_path)
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"rlp: cannot reach Redis at redis://:***@127.0.0.1:{port}/0")
    summary = json.loads((tmp_path / "noredis" / "summary.json").read_text())
    assert summary["status"] == "failed" and "cannot reach Redis" in summary["error"]
    recorded = (tmp_path / "noredis" / "config.yaml").read_text()  # world-readable: the password is hidden
    assert f"url: redis://:***@127.0.0.1:{port}/0" in recorded and "s3cret" not in recorded + result.stderr
    misplaced = rlp("run", f"redis.url=redis://:s3cret@127.0.0.1:{port}/0", cwd=tmp_path)  # an override as the config
    assert misplaced.returncode == 2 and "s3cret" not in misplaced.stderr and ":***@" in misplaced.stderr


def closed_port() -> int:
    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def assert_stopped_before_start(result: subprocess.CompletedProcess, tmp_path: Path, *expected: str) -> None:
    assert result.returncode == 2, (result.stdout, result.stderr)
    lines = stderr_lines(result)
    assert len(lines) == 1 and lines[0].startswith("rlp: config error: "), result.stderr
    assert all(text in lines[0] for text in expected), lines[0]
    assert not (tmp_path / "runs").exists()  # nothing started: no run directory, so no Redis in it


LAUGHS = "a0: &a0 [lol, lol, lol, lol, lol, lol, lol, lol, lol]\n" + "".join(
    f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]\n" for i in range(1, 9))  # 9**9 values from 486 bytes
BAD_CONFIGS = {
    "not finite": (b"rl:\n  lr: .nan\n", "'rl.lr' is nan; it must be a finite number"),
    "billion laughs": (LAUGHS.encode(), "its aliases expand it to over 486 values"),
    "recursive alias": (b"rl: &r {max_steps: *r}\n", "'rl.max_steps' is a recursive alias"),
    "not UTF-8": (b"name: caf\xe9\n", "not UTF-8 text (byte 9"),
    "key given twice": (b"rl:\n  lr: 1.0e-4\n  lr: 1.0e-3\n", "key 'rl.lr' is given twice"),
    "too many heads": (b"model:\n  num_heads: 3\n", "'model.num_heads' is 3; it must divide 'model.hidden_size'"),
    "a key the kind does not read": (b"model:\n  path: /models/x\n", "'model.path' is '/models/x' but 'model.kind' "
                                                                    "is demo, which does not read it"),
}


@pytest.mark.parametrize("command", ["validate", "run"])
@pytest.mark.parametrize("case", sorted(BAD_CONFIGS))
def test_bad_config_values_stop_before_start_in_one_line(tmp_path, case, command):
    content, expected = BAD_CONFIGS[case]
    config = tmp_path / "bad.yaml"
    config.write_bytes(content)
    result = rlp(command, str(config), f"output_dir={tmp_path / 'runs'}", cwd=tmp_path)
    assert_stopped_before_start(result, tmp_path, str(config), expected)


@pytest.mark.parametrize("override, expected", [
    ("name=../../x", "'name' is '../../x'"),
    ("redis.url=notaurl", "'redis.url' is 'notaurl'"),
])
def test_bad_name_or_redis_url_stops_before_start(tmp_path, override, expected):
    result = rlp("run", str(REPO / "configs" / "quickstart.yaml"), override, f"output_dir={tmp_path / 'runs'}",
                 cwd=tmp_path)
    assert_stopped_before_start(result, tmp_path, expected)


@pytest.mark.parametrize("command", ["validate", "run"])
def test_a_bad_jsonl_line_is_named_by_file_and_line(tmp_path, command):
    train = tmp_path / "train.jsonl"
    train.write_text('{"prompt": "1+1=", "answer": "2"}\n{"prompt": "2+2=", "answer": \n')
    test = tmp_path / "test.jsonl"
    test.write_text('{"prompt": "1+2=", "answer": "3"}\n')
    result = rlp(command, str(REPO / "configs" / "quickstart.yaml"), "data.kind=jsonl", f"data.train_path={train}",
                 f"data.test_path={test}", f"output_dir={tmp_path / 'runs'}", cwd=tmp_path)
    assert_stopped_before_start(result, tmp_path, f"{train}:2: not valid JSON", "data.train_path")


@pytest.mark.parametrize("command", ["validate", "run"])
def test_an_unreachable_ray_address_fails_in_seconds(tmp_path, command):
    address = f"127.0.0.1:{closed_port()}"
    start = time.monotonic()
    result = rlp(command, str(REPO / "configs" / "quickstart.yaml"), f"ray.address={address}",
                 f"output_dir={tmp_path / 'runs'}", cwd=tmp_path)
    assert time.monotonic() - start < 30  # the CLI's own start-up included; the probe itself waits at most 5 s
    assert_stopped_before_start(result, tmp_path, f"'ray.address' is '{address}'", "no Ray cluster answers")


def test_an_unreachable_ray_address_environment_variable_is_named(tmp_path):
    address = f"127.0.0.1:{closed_port()}"
    result = rlp("validate", str(REPO / "configs" / "quickstart.yaml"), f"output_dir={tmp_path / 'runs'}",
                 cwd=tmp_path, ray_address=address)
    assert_stopped_before_start(result, tmp_path, f"'RAY_ADDRESS' is '{address}'")


@pytest.mark.parametrize("broken, expected", [
    ("no config.json", "which has no config.json"),
    ("unknown model_type", "the config at"),
    ("no tokenizer", "which has no tokenizer"),
    ("corrupt tokenizer.json", "the tokenizer at"),
])
def test_a_model_folder_that_cannot_load_is_named(tmp_path, tiny_policy, broken, expected):
    model = tmp_path / "model"
    shutil.copytree(tiny_policy, model)
    if broken == "no config.json":
        (model / "config.json").unlink()
    elif broken == "unknown model_type":
        (model / "config.json").write_text(json.dumps({"model_type": "no-such-model"}))
    elif broken == "no tokenizer":
        (model / "tokenizer.json").unlink()
    else:
        (model / "tokenizer.json").write_text('{"version": "1.0", "model": ')
    result = rlp("validate", str(REPO / "configs" / "quickstart.yaml"), "model.kind=pretrained",
                 f"model.path={model}", f"output_dir={tmp_path / 'runs'}", cwd=tmp_path)
    assert_stopped_before_start(result, tmp_path, "'model.path'", expected)


def test_run_checks_the_model_folder_while_ray_starts_and_stops_before_the_job(tmp_path, tiny_policy):
    """`rlp run` loads the model config on another thread while Ray starts; a folder that does not load
    still ends it with exit 2 and the config error last, before any run directory."""
    model = tmp_path / "model"
    shutil.copytree(tiny_policy, model)
    (model / "config.json").write_text(json.dumps({"model_type": "no-such-model"}))
    result = rlp("run", str(REPO / "configs" / "quickstart.yaml"), "model.kind=pretrained", f"model.path={model}",
                 f"output_dir={tmp_path / 'runs'}", cwd=tmp_path)
    assert result.returncode == 2, (result.stdout, result.stderr)
    last = stderr_lines(result)[-1]
    assert last.startswith("rlp: config error: ") and "'model.path'" in last and "the config at" in last, last
    assert "Traceback" not in result.stderr and not (tmp_path / "runs").exists()
    # the Ray it started is gone with it, its raylet's agents too (left to themselves they outlive it by a minute)
    deadline = time.monotonic() + 10
    while session(result.pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert session(result.pid) == []


def test_a_job_failure_is_one_line_without_a_traceback(monkeypatch, capsys):
    from rlplatform import cli
    from rlplatform.transport.deadlines import JobFailed

    def fail(args):
        raise JobFailed("learner rank 1 died; resume with: rlp run --resume runs/x")

    monkeypatch.setattr(cli, "_status", fail)
    assert cli.main(["status", "--redis", "redis://127.0.0.1:1", "--job", "x"]) == 1
    assert capsys.readouterr().err == "rlp: learner rank 1 died; resume with: rlp run --resume runs/x\n"


BAD_ROWS = {  # (file content, data.kind, what the one line says)
    "missing prompt": (b'{"prompt": "1+1=", "answer": "2"}\n{"answer": "3"}\n', "jsonl",
                       "row 2 has neither 'prompt' nor 'messages'"),
    "prompt not text": (b'{"prompt": 12, "answer": "2"}\n', "jsonl", "row 1: 'prompt' must be non-empty text, got int"),
    "unknown role": (b'{"messages": [{"role": "wizard", "content": "hi"}]}\n', "jsonl",
                     "row 1: 'messages' has role 'wizard'"),
    "not UTF-8, jsonl": (b'{"prompt": "caf\xe9"}\n', "jsonl", "not UTF-8 text"),
    "not UTF-8, hf": (b'{"prompt": "caf\xe9"}\n', "hf", "rows.jsonl"),
    "no answer for the reward": (b'{"prompt": "1+1=", "answer": "2"}\n{"prompt": "2+2="}\n', "jsonl",
                                 "row 2 has no 'answer', which rewards[0] (exact_match) reads"),
}


@pytest.mark.parametrize("case", sorted(BAD_ROWS))
def test_bad_rows_fail_validate_in_one_line(tmp_path, case):
    content, kind, said = BAD_ROWS[case]
    rows = tmp_path / "rows.jsonl"
    rows.write_bytes(content)
    result = rlp("validate", str(REPO / "configs" / "quickstart.yaml"), f"data.kind={kind}",
                 f"data.train_path={rows}", f"data.test_path={rows}", cwd=tmp_path)
    assert result.returncode == 2, (result.stdout, result.stderr)
    lines = stderr_lines(result)
    assert len(lines) == 1 and said in lines[0] and str(rows) in lines[0], result.stderr


def test_a_model_path_that_is_a_file_says_so(tmp_path):
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"")
    result = rlp("validate", str(REPO / "configs" / "quickstart.yaml"), "model.kind=pretrained",
                 f"model.path={weights}", cwd=tmp_path)
    assert result.returncode == 2
    assert "is a file, not a directory" in stderr_lines(result)[0]

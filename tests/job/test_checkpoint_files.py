"""Checkpoints that can be trusted: each carries a manifest of its files' sizes and SHA-256; a resume takes the
newest one that matches it, setting newer ones aside (renamed, never deleted), and stops in one line where none
does; a write that runs out of disk space removes its temp directory and says in one line which checkpoint is
intact, and a job stopped onto a full disk records that error in summary.json.

Real files throughout, and a disk that is full for real: /dev/full (every write fails with ENOSPC, as Python's
own writes report it) everywhere, and where mounting one is allowed (root), a small tmpfs filled to the brim,
onto which torch.save fails as it does on a full disk (a RuntimeError without an errno); skipped elsewhere."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
from pathlib import Path

import pytest
import torch

from rlplatform.config import ConfigError, load_config
from rlplatform.job.checkpoint import (MANIFEST, CheckpointState, DiskFull, checkpoints_dir, intact_checkpoint,
                                       latest_checkpoint, learner_dir, remove_partial, verify, write_checkpoint)
from rlplatform.job.controller import run_job

WEIGHTS = os.path.join("policy", "learner", "global_step1", "mp_rank_00_model_states.pt")
LATEST = os.path.join("policy", "learner", "latest")


def save_learner(values: int = 4096):
    """A `save_learners` writing what a learner rank writes: its weights with torch.save, and a small text file."""
    def save(directory: str) -> None:
        folder = learner_dir(directory, "policy")
        os.makedirs(os.path.join(folder, "global_step1"))
        torch.save({"module": torch.arange(values, dtype=torch.float32)}, os.path.join(directory, WEIGHTS))
        Path(directory, LATEST).write_text("global_step1")
    return save


STATE = CheckpointState(results={}, wandb_run_id=None, attempt=0, policies={})


def checkpoint(run_dir, step: int, values: int = 4096) -> str:
    return write_checkpoint(str(run_dir), step, STATE, save_learner(values), keep_last=5)


def truncate_to_half(path: Path) -> None:
    os.truncate(path, path.stat().st_size // 2)


def flip_bytes(path: Path) -> None:
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle:middle + 4] = bytes(b ^ 0xFF for b in data[middle:middle + 4])
    path.write_bytes(bytes(data))


CORRUPTIONS = {  # what is done to a checkpoint, and what verify says of it
    "weights truncated to half": (lambda c: truncate_to_half(c / WEIGHTS), f"{WEIGHTS} has "),
    "weights with flipped bytes": (lambda c: flip_bytes(c / WEIGHTS), f"{WEIGHTS} does not match its checksum"),
    "a file deleted": (lambda c: (c / LATEST).unlink(), f"{LATEST} is missing"),
    "the manifest deleted": (lambda c: (c / MANIFEST).unlink(), "no manifest.json"),
    "state.json truncated": (lambda c: truncate_to_half(c / "state.json"), "state.json has "),
    "the manifest cut short": (lambda c: truncate_to_half(c / MANIFEST), "manifest.json unreadable"),
}


def test_a_checkpoint_lists_every_file_with_its_size_and_sha256_and_verifies(tmp_path):
    path = Path(checkpoint(tmp_path, 2))
    files = json.loads((path / MANIFEST).read_text())["files"]
    assert sorted(files) == sorted([WEIGHTS, LATEST, "state.json"])  # everything but the manifest itself
    for name, listed in files.items():
        content = (path / name).read_bytes()
        assert listed == {"size": len(content), "sha256": hashlib.sha256(content).hexdigest()}
    assert verify(str(path)) is None


@pytest.mark.parametrize("corruption", sorted(CORRUPTIONS))
def test_a_damaged_checkpoint_fails_verification_saying_why(tmp_path, corruption):
    damage, said = CORRUPTIONS[corruption]
    path = Path(checkpoint(tmp_path, 2))
    damage(path)
    assert verify(str(path)).startswith(said)


def test_a_resume_takes_the_newest_intact_checkpoint_and_sets_newer_ones_aside(tmp_path):
    for step in (2, 4, 6):
        checkpoint(tmp_path, step)
    root = Path(checkpoints_dir(str(tmp_path)))
    truncate_to_half(root / "step-000006" / WEIGHTS)
    (root / "step-000004" / MANIFEST).unlink()
    size = (root / "step-000002" / WEIGHTS).stat().st_size  # as step 6's were written
    lines = []
    assert intact_checkpoint(str(tmp_path), lines.append) == str(root / "step-000002")
    assert lines == [f"checkpoint {root / 'step-000006'} is corrupt ({WEIGHTS} has {size // 2} bytes, not {size}): "
                     f"set aside as {root / 'corrupt-step-000006'}",
                     f"checkpoint {root / 'step-000004'} is corrupt (no manifest.json): set aside as "
                     f"{root / 'corrupt-step-000004'}"]
    assert sorted(os.listdir(root)) == ["corrupt-step-000004", "corrupt-step-000006", "step-000002"]
    assert (root / "corrupt-step-000004" / WEIGHTS).is_file()  # kept for a look, not deleted
    assert latest_checkpoint(str(tmp_path)) == str(root / "step-000002")


def test_where_no_checkpoint_is_intact_a_resume_stops_in_one_line_naming_those_set_aside(tmp_path):
    """Before Redis or Ray: the start removes a killed writer's temp directory, then finds nothing to resume."""
    config = load_config(None, [f"output_dir={tmp_path}", "name=broken", "resume=always"])
    root = Path(checkpoints_dir(config.run_dir))
    for step in (2, 4):
        flip_bytes(Path(checkpoint(config.run_dir, step)) / WEIGHTS)
    os.makedirs(root / "corrupt-step-000004")  # set aside by an earlier resume
    os.makedirs(root / ".tmp-step-000006" / "policy")
    with pytest.raises(ConfigError) as refused:
        run_job(config)
    message = str(refused.value)
    assert "\n" not in message and message.startswith(f"resume: no checkpoint under {root} is intact (")
    assert f"set aside as {root / 'corrupt-step-000004-2'}; checkpoint {root / 'step-000002'} is corrupt" in message
    assert message.endswith("start the job afresh with `rlp run --fresh <job yaml>`, which moves this run aside")
    assert sorted(os.listdir(root)) == ["corrupt-step-000002", "corrupt-step-000004", "corrupt-step-000004-2"]


def test_temp_directories_are_removed_at_a_start_and_after_a_failed_write(tmp_path):
    root = Path(checkpoints_dir(str(tmp_path)))
    (root / ".tmp-step-000008" / "policy").mkdir(parents=True)  # a writer killed mid-checkpoint
    remove_partial(str(tmp_path))
    assert os.listdir(root) == []

    def fails(directory: str) -> None:
        save_learner()(directory)
        raise ValueError("a learner rank failed")
    with pytest.raises(ValueError, match="a learner rank failed"):  # not a full disk: the error as it was
        write_checkpoint(str(tmp_path), 2, STATE, fails, keep_last=2)
    assert os.listdir(root) == []


def writes_to_dev_full(directory: str) -> None:
    """A learner whose text file lands on /dev/full: the kernel answers ENOSPC."""
    save_learner()(directory)
    os.remove(os.path.join(directory, LATEST))
    os.symlink("/dev/full", os.path.join(directory, LATEST))
    with open(os.path.join(directory, LATEST), "w", buffering=1) as f:
        f.write("global_step1\n")


def test_enospc_while_writing_says_which_checkpoint_is_intact_and_removes_the_temp_directory(tmp_path):
    checkpoint(tmp_path, 2)
    root = Path(checkpoints_dir(str(tmp_path)))
    with pytest.raises(DiskFull) as full:
        write_checkpoint(str(tmp_path), 4, STATE, writes_to_dev_full, keep_last=2)
    assert str(full.value) == f"no space left on {root} writing checkpoint step 4; step 2 is intact; free space " \
                              f"and `rlp run --resume {tmp_path}`"
    assert isinstance(full.value.__cause__, OSError) and full.value.__cause__.errno == errno.ENOSPC
    assert os.listdir(root) == ["step-000002"]


def test_a_full_disk_is_one_line_from_rlp(tmp_path, monkeypatch, capsys):
    from rlplatform import cli

    monkeypatch.setattr(cli, "_status", lambda args: write_checkpoint(str(tmp_path), 1, {}, writes_to_dev_full, 1))
    assert cli.main(["status", "--redis", "redis://127.0.0.1:1", "--job", "x"]) == 1
    assert capsys.readouterr().err == f"rlp: no space left on {tmp_path}/checkpoints writing checkpoint step 1; " \
                                      f"no checkpoint is intact; free space and run the job again\n"


@pytest.fixture
def tmpfs():
    """`tmpfs(path, size)`: a tmpfs of `size` mounted at `path` (made if missing), unmounted at the end; the test
    is skipped where mounting is not allowed (it needs root)."""
    mounted = []

    def mount(path: Path, size: str) -> Path:
        path.mkdir(parents=True, exist_ok=True)
        if shutil.which("mount") is None:
            pytest.skip("no mount command to make a small filesystem that fills up")
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                              capture_output=True, text=True)
        if done.returncode:
            pytest.skip(f"a small tmpfs cannot be mounted here (it needs root): {done.stderr.strip()}")
        mounted.append(path)
        return path
    yield mount
    for path in mounted:  # lazily: torch may still hold the file its failed write left open
        subprocess.run(["umount", "--lazy", str(path)], check=True)


def fill(directory: Path) -> None:
    """Write into `directory` until its filesystem has no byte left."""
    with open(directory / "filler", "wb", buffering=0) as f:
        try:
            while True:
                f.write(bytes(1 << 20))
        except OSError as err:
            assert err.errno == errno.ENOSPC


def test_torch_save_onto_a_full_filesystem_is_reported_as_disk_full(tmp_path, tmpfs):
    run_dir = tmpfs(tmp_path / "run", "4m")
    checkpoint(run_dir, 2)
    root = Path(checkpoints_dir(str(run_dir)))
    with pytest.raises(DiskFull, match=re.escape(f"no space left on {root} writing checkpoint step 4; step 2 is "
                                                 f"intact; free space and `rlp run --resume {run_dir}`")) as full:
        checkpoint(run_dir, 4, values=2 << 20)  # 8 MiB of weights
    assert isinstance(full.value.__cause__, RuntimeError)  # torch.save's own error, with no errno
    assert os.listdir(root) == ["step-000002"] and verify(str(root / "step-000002")) is None
    with pytest.raises(DiskFull, match="writing checkpoint step 2; no checkpoint is intact; free space and run "
                                       "the job again"):
        checkpoint(tmpfs(tmp_path / "other", "1m"), 2, values=2 << 20)


def test_a_job_stopped_onto_a_full_disk_fails_with_that_error_in_its_summary(ray_session, tiny_job, run_files,
                                                                             tmpfs):
    # none pruned: deleting an older checkpoint after the fill would free the space the next one needs
    config = tiny_job("disk-full", "rl.max_steps=200", "checkpoint.every_steps=2", "checkpoint.keep_last=1000")
    root = tmpfs(Path(checkpoints_dir(config.run_dir)), "64m")

    def fill_then_stop():  # the disk fills up after the first checkpoint, then the job is asked to stop
        run_files.wait_for(lambda: latest_checkpoint(config.run_dir) is not None)
        fill(root)
        saved = int(latest_checkpoint(config.run_dir).rsplit("-", 1)[1])
        # with a step since that checkpoint, the stop has one to write (the next periodic one may come first: it
        # fails the same way, and the job has ended)
        ended = Path(config.run_dir, "summary.json")
        run_files.wait_for(lambda: run_files.trained_steps(config.run_dir) > saved or ended.exists())
        if not ended.exists():
            os.kill(os.getpid(), signal.SIGTERM)
    with pytest.raises(DiskFull) as full:
        run_files.run_job_while(config, fill_then_stop)
    said = str(full.value)
    named = re.fullmatch(rf"no space left on {re.escape(str(root))} writing checkpoint step (\d+); step (\d+) is "
                         rf"intact; free space and `rlp run --resume {re.escape(config.run_dir)}`", said)
    assert named and int(named[1]) > int(named[2]), said
    intact = str(root / f"step-{int(named[2]):06d}")  # the newest there, nothing of the failed one left
    assert latest_checkpoint(config.run_dir) == intact and verify(intact) is None
    assert not [name for name in os.listdir(root) if name.startswith(".tmp-")]
    summary = json.loads(Path(config.run_dir, "summary.json").read_text())
    assert summary["status"] == "failed" and summary["error"] == f"DiskFull: {said}" and "exit_code" not in summary


"""Job checkpoints on disk: `<run_dir>/checkpoints/step-<n>/`, complete or absent, checked before use.

Each holds `state.json` (per policy: version, RL counters, prompt ledger and data position, the
stage results so far; the W&B run id; the resume attempt), per policy `<policy>/learner` (DeepSpeed
weights, optimizer moments, RNG states; with `model.lora` the adapters and their moments only), and
`manifest.json`, written last: every other file's relative path, size and SHA-256. It is written into
a hidden temp directory, fsynced and renamed into place; only the newest `keep_last` are kept. A
write that runs out of disk space removes its temp directory and raises `DiskFull`, one line naming
the newest intact checkpoint.

A resume takes `intact_checkpoint`: the newest one whose files all match its manifest. Each newer
one that does not (a file missing, truncated, altered or unreadable; no manifest) is renamed to
`corrupt-step-<n>` (kept for a look, never deleted) and named in one line. A job's start
removes the temp directories a killed writer left (`remove_partial`).
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import shutil
from dataclasses import asdict, dataclass
from typing import Any, Callable, Dict, List, Optional

STATE = "state.json"
MANIFEST = "manifest.json"
_NAME = re.compile(r"^step-(\d+)$")
_TEMP = ".tmp-"
_FULL_BELOW = 1 << 20  # bytes still free where a failed write counts as the disk being full
_CHUNK = 1 << 20


class DiskFull(RuntimeError):
    """A checkpoint's write ran out of disk space; the one-line message says what is intact and what to do."""


@dataclass(frozen=True)
class PolicyState:
    """What a checkpoint keeps of one policy's RL stage (`rl_loop.PolicyRun.state`)."""
    version: int
    counters: Dict[str, Any]  # `RLCounters.state`, samples_generated_before counting every attempt so far
    ledger: Dict[str, Any]  # `PromptLedger.state`
    eval_history: List[Dict[str, float]]  # held-out accuracy by version
    rewards: Dict[str, Any]  # `RLMonitor.reward_state`


@dataclass(frozen=True)
class CheckpointState:
    """A checkpoint's state.json: every policy's results so far (`PolicyResults.state`), the W&B run to continue,
    the resume attempt that wrote it and each policy's RL stage."""
    results: Dict[str, Dict[str, Any]]
    wandb_run_id: Optional[str]
    attempt: int
    policies: Dict[str, PolicyState]

    def to_json(self) -> Dict[str, Any]:
        return {"results": self.results, "wandb_run_id": self.wandb_run_id, "attempt": self.attempt,
                "policies": {name: asdict(policy) for name, policy in self.policies.items()}}

    @classmethod
    def from_json(cls, state: Dict[str, Any]) -> "CheckpointState":
        return cls(state["results"], state["wandb_run_id"], state["attempt"],
                   {name: PolicyState(**policy) for name, policy in state["policies"].items()})


def checkpoints_dir(run_dir: str) -> str:
    return os.path.join(run_dir, "checkpoints")


def latest_checkpoint(run_dir: str) -> Optional[str]:
    """The newest complete checkpoint of a run directory (renamed into place, not verified), or None."""
    root = checkpoints_dir(run_dir)
    steps = sorted(_steps(root))
    return _path(root, steps[-1]) if steps else None


def learner_dir(checkpoint: str, policy: str) -> str:
    return os.path.join(checkpoint, policy, "learner")


def write_checkpoint(run_dir: str, step: int, state: CheckpointState, save_learners: Callable[[str], None],
                     keep_last: int) -> str:
    """Write checkpoint `step`: `save_learners(dir)` fills each policy's `learner_dir`, then the state and the
    manifest; returns its path. A checkpoint of this step already there is kept as it is. Any failure removes
    the temp directory; one for want of disk space raises `DiskFull`."""
    root = checkpoints_dir(run_dir)
    final = _path(root, step)
    if os.path.isdir(final):
        return final
    temp = os.path.join(root, f"{_TEMP}step-{step:06d}")
    shutil.rmtree(temp, ignore_errors=True)
    try:
        os.makedirs(temp)
        save_learners(temp)
        with open(os.path.join(temp, STATE), "w") as f:
            json.dump(state.to_json(), f, indent=1)
        write_manifest(temp)
        _fsync_tree(temp)
        os.rename(temp, final)
    except BaseException as err:
        # asked before the temp dir frees what it took; a signal's exception stays what it is
        full = isinstance(err, Exception) and _out_of_space(err, root if os.path.isdir(root) else run_dir)
        shutil.rmtree(temp, ignore_errors=True)
        if full:
            raise DiskFull(_disk_full_message(run_dir, step)) from err
        raise
    _fsync_dir(root)
    _prune(root, keep_last)
    return final


def _disk_full_message(run_dir: str, step: int) -> str:
    """The line for a checkpoint write that ran out of space: what is intact, and how to go on."""
    root = checkpoints_dir(run_dir)
    intact = next((s for s in sorted(_steps(root), reverse=True) if verify(_path(root, s)) is None), None)
    if intact is None:
        return f"no space left on {root} writing checkpoint step {step}; no checkpoint is intact; " \
               f"free space and run the job again"
    return f"no space left on {root} writing checkpoint step {step}; step {intact} is intact; " \
           f"free space and `rlp run --resume {run_dir}`"


def read_state(checkpoint: str) -> CheckpointState:
    with open(os.path.join(checkpoint, STATE)) as f:
        return CheckpointState.from_json(json.load(f))


def write_manifest(directory: str) -> None:
    """`manifest.json` in `directory`: every file under it (relative path) with its size and SHA-256."""
    files = {}
    for folder, _, names in os.walk(directory):
        for name in names:
            path = os.path.join(folder, name)
            files[os.path.relpath(path, directory)] = {"size": os.path.getsize(path), "sha256": _sha256(path)}
    with open(os.path.join(directory, MANIFEST), "w") as f:
        json.dump({"files": dict(sorted(files.items()))}, f, indent=1)


def verify(checkpoint: str) -> Optional[str]:
    """Why `checkpoint` cannot be trusted, in a few words; None when every file its manifest lists (state.json
    among them) is there with its size and checksum."""
    try:
        with open(os.path.join(checkpoint, MANIFEST)) as f:
            files = {name: (int(entry["size"]), str(entry["sha256"])) for name, entry in json.load(f)["files"].items()}
    except FileNotFoundError:
        return f"no {MANIFEST}"
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        return f"{MANIFEST} unreadable ({type(err).__name__})"
    if STATE not in files:
        return f"{MANIFEST} does not list {STATE}"
    for name, (size, sha256) in files.items():
        problem = _check_file(os.path.join(checkpoint, name), name, size, sha256)
        if problem:
            return problem
    return None


def _check_file(path: str, name: str, size: int, sha256: str) -> Optional[str]:
    """Why the file at `path` (`name` in its manifest) is not the one listed, or None."""
    if not os.path.isfile(path):
        return f"{name} is missing"
    try:
        if os.path.getsize(path) != size:
            return f"{name} has {os.path.getsize(path)} bytes, not {size}"
        if _sha256(path) != sha256:
            return f"{name} does not match its checksum"
    except OSError as err:
        return f"{name} unreadable ({err.strerror})"
    return None


def intact_checkpoint(run_dir: str, set_aside: Callable[[str], None]) -> Optional[str]:
    """The newest checkpoint that `verify` trusts, or None. Each newer one is renamed to `corrupt-step-<n>` and
    named in one line to `set_aside`."""
    root = checkpoints_dir(run_dir)
    for step in sorted(_steps(root), reverse=True):
        path = _path(root, step)
        problem = verify(path)
        if problem is None:
            return path
        moved = _corrupt_name(root, step)
        os.rename(path, moved)
        set_aside(f"checkpoint {path} is corrupt ({problem}): set aside as {moved}")
    return None


def remove_partial(run_dir: str) -> None:
    """Remove the temp directories a writer killed mid-checkpoint left."""
    _remove_temp(checkpoints_dir(run_dir))


def _path(root: str, step: int) -> str:
    return os.path.join(root, f"step-{step:06d}")


def _corrupt_name(root: str, step: int) -> str:
    """`corrupt-step-<n>`, or `corrupt-step-<n>-2` and on where an earlier one of that step is kept."""
    moved = base = os.path.join(root, f"corrupt-step-{step:06d}")
    count = 1
    while os.path.exists(moved):
        count += 1
        moved = f"{base}-{count}"
    return moved


def _steps(root: str):
    if not os.path.isdir(root):
        return []
    return [int(m.group(1)) for m in map(_NAME.match, os.listdir(root)) if m]


def _prune(root: str, keep_last: int) -> None:
    """Delete all but the newest `keep_last` checkpoints, and temp directories a killed writer left."""
    for step in sorted(_steps(root))[:-keep_last]:
        shutil.rmtree(_path(root, step), ignore_errors=True)
    _remove_temp(root)


def _remove_temp(root: str) -> None:
    for name in os.listdir(root) if os.path.isdir(root) else []:
        if name.startswith(_TEMP):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)


def _out_of_space(err: BaseException, path: str) -> bool:
    """Whether a failed write ran out of disk space: ENOSPC anywhere in its chain of causes (a Ray task's error
    keeps the worker's own as `cause`), or, since torch.save reports a full disk without an errno, under
    `_FULL_BELOW` bytes still free where it wrote."""
    seen, chain = set(), [err]
    while chain:
        error = chain.pop()
        if error is None or id(error) in seen:
            continue
        seen.add(id(error))
        if getattr(error, "errno", None) == errno.ENOSPC:
            return True
        chain += [getattr(error, "cause", None), error.__cause__, error.__context__]
    stats = os.statvfs(path)
    return stats.f_bavail * stats.f_frsize < _FULL_BELOW


def _sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _fsync_tree(path: str) -> None:
    for folder, _, files in os.walk(path):
        for name in files:
            descriptor = os.open(os.path.join(folder, name), os.O_RDONLY)
            try:
                os.fsync(descriptor)
            finally:
                os.close(descriptor)
        _fsync_dir(folder)


def _fsync_dir(path: str) -> None:
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)

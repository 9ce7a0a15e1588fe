"""Job checkpoints on disk: `<run_dir>/checkpoints/step-<n>/`, complete or absent.

Each holds `state.json` (per policy: version, RL counters, prompt ledger and data position, the
stage results so far; the W&B run id; the resume attempt) and, per policy, `<policy>/learner`
(DeepSpeed weights, optimizer moments, RNG states; with `model.lora` the adapters and their moments only). It is written into a hidden temp directory,
fsynced and renamed into place; only the newest `keep_last` are kept.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from typing import Callable, Dict, Optional

STATE = "state.json"
_NAME = re.compile(r"^step-(\d+)$")


def checkpoints_dir(run_dir: str) -> str:
    return os.path.join(run_dir, "checkpoints")


def latest_checkpoint(run_dir: str) -> Optional[str]:
    """The newest complete checkpoint of a run directory, or None."""
    root = checkpoints_dir(run_dir)
    steps = sorted(_steps(root))
    return os.path.join(root, f"step-{steps[-1]:06d}") if steps else None


def learner_dir(checkpoint: str, policy: str) -> str:
    return os.path.join(checkpoint, policy, "learner")


def write_checkpoint(run_dir: str, step: int, state: Dict, save_learners: Callable[[str], None],
                     keep_last: int) -> str:
    """Write checkpoint `step`: `save_learners(dir)` fills each policy's `learner_dir`, then the
    state; returns its path. A checkpoint of this step already there is kept as it is."""
    root = checkpoints_dir(run_dir)
    final = os.path.join(root, f"step-{step:06d}")
    if os.path.isdir(final):
        return final
    temp = os.path.join(root, f".tmp-step-{step:06d}")
    shutil.rmtree(temp, ignore_errors=True)
    os.makedirs(temp)
    save_learners(temp)
    with open(os.path.join(temp, STATE), "w") as f:
        json.dump(state, f, indent=1)
    _fsync_tree(temp)
    os.rename(temp, final)
    _fsync_dir(root)
    _prune(root, keep_last)
    return final


def read_state(checkpoint: str) -> Dict:
    with open(os.path.join(checkpoint, STATE)) as f:
        return json.load(f)


def _steps(root: str):
    if not os.path.isdir(root):
        return []
    return [int(m.group(1)) for m in map(_NAME.match, os.listdir(root)) if m]


def _prune(root: str, keep_last: int) -> None:
    """Delete all but the newest `keep_last` checkpoints, and temp directories a killed writer left."""
    for step in sorted(_steps(root))[:-keep_last]:
        shutil.rmtree(os.path.join(root, f"step-{step:06d}"), ignore_errors=True)
    for name in os.listdir(root):
        if name.startswith(".tmp-"):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)


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

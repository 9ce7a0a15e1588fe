"""A tiny job for reliability tests, and waiting on its progress from a second thread."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Callable, Dict, Tuple

import pytest

from rlplatform.config import JobConfig, load_config
from rlplatform.job.run_dir import RUN_ID
from rlplatform.transport.keys import run_scope

TINY = ["model.hidden_size=64", "model.num_layers=2", "model.intermediate_size=128", "sft.enabled=false",
        "data.train_size=300", "data.test_size=8", "eval.batch_size=8", "rl.batch_prompts=2", "rl.group_size=4",
        "rl.max_new_tokens=4", "rollout.prompts_per_batch=4", "rollout.num_cpus=0.5", "learner.num_cpus=0.5",
        "reward_workers.num_cpus=0.25", "wandb.mode=disabled", "eval.enabled=false"]
# a TINY job's held-out evaluation, for the tests that read its figures (TINY runs none: an evaluator's process
# is a third of a tiny job's CPU time)
EVAL = ["eval.enabled=true"]

# each rollout engine, as the overrides that pick it for a TINY job: vLLM's CPU attention needs a head size of 32
ENGINES = {"transformers": ["rollout.engine=transformers"], "vllm": ["rollout.engine=vllm", "model.num_heads=2"]}


@pytest.fixture
def tiny_job(tmp_path):
    """`tiny_job(name, *overrides)`: a JobConfig of a tiny RL-only job writing under tmp_path."""
    def make(name: str, *overrides: str) -> JobConfig:
        return load_config(None, [f"output_dir={tmp_path}", f"name={name}", *TINY, *overrides])
    return make


class RunFiles:
    """What a running job's directory says about its progress (read from another thread)."""

    @staticmethod
    def trained_steps(run_dir: str) -> int:
        path = Path(run_dir) / "trained.jsonl"
        return len(path.read_text().splitlines()) if path.exists() else 0

    @staticmethod
    def wait_for(condition, timeout_s: float = 240.0, poll_s: float = 0.2) -> None:
        deadline = time.monotonic() + timeout_s
        while not condition():
            if time.monotonic() > deadline:
                raise TimeoutError("condition not met in time")
            time.sleep(poll_s)

    @staticmethod
    def trained_ids(run_dir: str) -> list:
        path = Path(run_dir) / "trained.jsonl"
        return [i for line in path.read_text().splitlines() for i in json.loads(line)["sample_ids"]]

    def redis_url(self, run_dir: str) -> str:
        self.wait_for(lambda: os.path.exists(os.path.join(run_dir, "redis.url")))
        return Path(run_dir, "redis.url").read_text().strip()

    @staticmethod
    def redis_server(run_dir) -> Tuple[int, str]:
        """(pid, data folder) of the embedded redis-server serving the job, found by its port."""
        port = Path(run_dir, "redis.url").read_text().strip().rsplit(":", 1)[1].split("/")[0]
        for entry in Path("/proc").iterdir():
            try:
                argv = (entry / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"redis-server" in argv[0] and argv[0].strip().endswith(f":{port}".encode()):  # its process title
                return int(entry.name), os.readlink(entry / "cwd")  # it runs in its --dir
        raise AssertionError(f"no redis-server on port {port}")

    @staticmethod
    def run_job_while(config: JobConfig, action: Callable[[], None]) -> Dict:
        """`run_job(config)` with `action` on a thread beside it (it waits on the run's files, then acts on the
        job), the thread joined however the job ends."""
        from rlplatform.job.controller import run_job

        thread = threading.Thread(target=action, daemon=True)
        thread.start()
        try:
            return run_job(config)
        finally:
            thread.join()

    def run(self, config: JobConfig) -> str:
        """The `run_scope` of the job's run: what its Redis keys are named by."""
        self.wait_for(lambda: os.path.exists(os.path.join(config.run_dir, RUN_ID)))
        return run_scope(config.name, Path(config.run_dir, RUN_ID).read_text().strip())


def actor_pid(name: str, timeout_s: float = 120.0) -> int:
    """The pid of the live Ray actor `name`, from the GCS's actor table."""
    from ray._private.state import state as ray_state

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for actor in ray_state.actor_table(None).values():
            if actor.get("Name") == name and actor.get("State") == "ALIVE" and actor.get("Pid"):
                return actor["Pid"]
        time.sleep(0.2)
    raise TimeoutError(f"actor {name} is not alive")


@pytest.fixture
def run_files() -> RunFiles:
    return RunFiles()

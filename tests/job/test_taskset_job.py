"""A job whose rollout workers play a verifiers taskset themselves (`env.kind: verifiers`): every trained
group is a task the prompt ledger issued, its samples the task's token-exact episodes scored by the task's
reward; stopped and resumed, it goes on from the trained tasks with none trained twice. On vLLM: the workers
play their tasks through their own OpenAI bridges, so this is also the bridge's test on vLLM. (The ledger and the
resume do not depend on the engine; the transformers engine plays a taskset in tests/test_learning.py.)"""

from __future__ import annotations

import json
import os
import signal
import threading

import pytest

from rlplatform.job.controller import run_job
from rlplatform.scheduling.ledger import balanced
from tests.job.conftest import ENGINES, EVAL

pytest.importorskip("verifiers.v1")

TASKSET = ["env.kind=verifiers", "env.taskset=tests/envs/digit_sums.py", "env.test_tasks=4",
           "rewards=[{name: verifiers_reward}, {name: verifiers_components, weight: 0}]",
           "eval.pass_reward=verifiers_reward"]


def test_a_taskset_job_on_vllm_trains_ledger_issued_tasks_and_resumes_without_training_one_twice(
        ray_session, tiny_job, run_files):
    config = tiny_job("taskset", *TASKSET, "rl.max_steps=6", "checkpoint.every_steps=2", "resume=auto",
                      *ENGINES["vllm"])  # no evaluator until the resume: its vLLM engine starts once

    def stop_after_three_steps():
        run_files.wait_for(lambda: run_files.trained_steps(config.run_dir) >= 3)
        os.kill(os.getpid(), signal.SIGTERM)
    thread = threading.Thread(target=stop_after_three_steps, daemon=True)
    thread.start()
    first = run_job(config)
    thread.join()
    assert first["status"] == "interrupted" and 3 <= first["rl"]["steps"] < 6
    watchdog = threading.Timer(240.0, os.kill, (os.getpid(), signal.SIGTERM))  # a job that stalls fails
    watchdog.start()
    try:
        second = run_job(tiny_job("taskset", *TASKSET, "rl.max_steps=6", "checkpoint.every_steps=2", "resume=auto",
                                  *ENGINES["vllm"], *EVAL))
    finally:
        watchdog.cancel()
    assert second["status"] == "completed" and second["rl"]["steps"] == 6
    rl = second["rl"]
    assert rl["ledger"]["admitted"] == 0 and rl["ledger"]["trained"] == 6 * 2 and balanced(rl["ledger"])
    lines = [json.loads(line) for line in open(os.path.join(config.run_dir, "trained.jsonl"))]
    positions = [p for line in lines for p in line["prompts"]]
    ids = [i for line in lines for i in line["sample_ids"]]
    assert None not in positions and len(positions) == len(set(positions)) == 6 * 2  # ledger tasks, none twice
    assert len(ids) == len(set(ids)) == 6 * 2 * 4
    assert second["eval"]["after_rl"]["rows"] == 4  # the held-out tasks, played and scored by their reward
    components = second["eval"]["after_rl"]["components"]  # the task's reward function by name, beside the total
    assert set(components) == {"verifiers_reward", "verifiers_components/correct"}
    assert components["verifiers_components/correct"] == components["verifiers_reward"]  # its one function

"""End to end: a shortened quickstart runs SFT then asynchronous RL and writes a valid summary.json; its
offline W&B run, read back with W&B's own reader, holds every metric family of the dashboard and the
samples table. A synchronous job is scored by a standalone reward worker, and a job whose learner is slower
than generation gets its next step queued."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import uuid

import pytest
import yaml

from rlplatform.config import load_config, to_yaml
from rlplatform.job.controller import run_job
from rlplatform.monitoring.dashboard import dashboard_layout
from rlplatform.scheduling.ledger import balanced
from tests.processes import RLP

QUICKSTART = os.path.join(os.path.dirname(__file__), "..", "configs", "quickstart.yaml")


@pytest.mark.slow
def test_short_quickstart_writes_a_valid_summary_and_logs_every_dashboard_key(ray_session, tmp_path, greedy_accuracy):
    config = load_config(QUICKSTART, [f"output_dir={tmp_path}", "name=e2e", "sft.steps=30", "rl.max_steps=12",
                                      "rl.max_staleness=1", "sft.log_every=10",
                                      "data.test_size=100",  # evaluations, and their check row by row, on 100 rows
                                      "rl.batch_prompts=4", "rollout.prompts_per_batch=4",
                                      "monitoring.samples_every=3", "eval.every_steps=6", "wandb.mode=offline"])
    began = time.time()
    run_job(config)
    ended = time.time()
    run_dir = tmp_path / "e2e"
    summary = json.loads((run_dir / "summary.json").read_text())
    startup = summary["startup_s"]  # each start-up milestone after the one before it, on the wall clock (the
    # learner's clock too): wall_s is the monotonic clock's, which a paused machine stops and the wall clock does not
    assert 0 < startup["job_started_s"] <= startup["services_ready_s"] <= startup["learners_ready_s"] \
        <= startup["workers_ready_s"] <= startup["to_first_sft_step_s"] <= startup["to_first_rl_step_s"] \
        < ended - began
    assert summary["status"] == "completed" and summary["name"] == "e2e"
    assert summary["stages"]["sft"]["steps"] == 30 and summary["stages"]["rl"]["steps"] == 12
    # the evaluator scored the weights that were saved: plain HF generate on model/ agrees
    assert summary["eval"]["after_rl"]["accuracy"] == greedy_accuracy(str(run_dir / "model"), config)
    rl = summary["rl"]
    assert rl["policy_versions"] == 13
    assert rl["samples_trained"] == 12 * 4 * 8
    # staleness bound: nothing older than max_staleness=1 version was trained on
    assert rl["max_staleness_trained"] <= 1
    assert all(int(gap) <= 1 for gap in rl["staleness_histogram"])
    assert sum(rl["staleness_histogram"].values()) == rl["samples_trained"]
    # every generated sample is accounted for, each bucket counted where its samples were left (usually some are
    # left at the end; none when generation was the bottleneck, as on 2 cores shared with the other test worker)
    assert rl["samples_unused_at_end"] == sum(rl["samples_unused_where"].values())
    assert rl["samples_generated"] == (rl["samples_trained"] + rl["samples_dropped_stale"]
                                       + rl["samples_dropped_error"] + rl["samples_dropped_zero_advantage"]
                                       + rl["samples_dropped_invalid"] + rl["samples_unused_at_end"])
    assert rl["samples_per_s"] > 0 and summary["wall_s"] > 0
    # where the stage's time went, per component: each ran, none for longer than the stage
    times = rl["time_breakdown"]
    assert set(times) == {"generation_s", "queue_submit_s", "reward_busy_s", "reward_latency_s_mean",
                          "learner_step_s", "weight_publish_s", "weight_sync_s"}
    assert all(0 < times[k] <= rl["wall_s"] for k in ("generation_s", "queue_submit_s", "reward_busy_s",
                                                      "learner_step_s", "weight_publish_s", "weight_sync_s"))
    assert 0 < times["reward_latency_s_mean"] < rl["wall_s"]
    # config.yaml is the config as given, never changed in place (its `auto`s stay); plan.yaml holds what the job
    # resolved them to on this cluster
    assert (run_dir / "config.yaml").read_text() == to_yaml(config)
    assert config.model.dtype == config.weights.transport == config.learner.bf16_mode == "auto"
    plan = yaml.safe_load((run_dir / "plan.yaml").read_text())["policies"]["policy"]
    assert plan["model.dtype"] == "float32" and plan["weights.transport"] == "object_store"
    assert plan["learner"] == {"num_ranks": 1, "num_gpus": 0.0, "zero_stage": 0, "precision": "float32 weights"}
    assert plan["rollout"]["generating_actors"] == 2 and plan["rollout"]["num_gpus"] == 0.0
    assert (run_dir / "model" / "model.safetensors").exists() and (run_dir / "model" / "config.json").exists()
    assert (run_dir / "checkpoint" / "latest").exists()
    # RL's end is checkpointed too, and every prompt issued ended one way or is still open
    assert (run_dir / "checkpoints" / "step-000012" / "state.json").exists()
    assert rl["restarts"] == {"rollout": 0, "reward": 0, "evaluator": 0}
    ledger = rl["ledger"]
    assert ledger["trained"] == 12 * 4 and balanced(ledger)
    assert rl["groups_expired"] == 0 and rl["samples_dropped_expired"] == 0
    assert os.path.isdir(rl["wandb_dir"]) and os.listdir(rl["wandb_dir"])
    assert_dashboard_logged(summary)


def test_synchronous_mode_trains_only_on_fresh_samples_scored_by_a_standalone_reward_worker(ray_session,
                                                                                               redis_server, tmp_path):
    """A job with no reward workers of its own, on a Redis a standalone `rlp reward-worker` serves: the worker
    scores every sample the job trains, and ends with it."""
    job = f"sync-{uuid.uuid4().hex[:6]}"
    worker = subprocess.Popen([RLP, "reward-worker", "--redis", redis_server, "--job", job],
                              stderr=subprocess.PIPE, text=True)
    config = load_config(QUICKSTART, [f"output_dir={tmp_path}", f"name={job}", "sft.enabled=false",
                                      "rl.max_steps=4", "rl.max_staleness=0", "wandb.mode=disabled",
                                      "eval.enabled=false", "rl.batch_prompts=4", "rollout.prompts_per_batch=4",
                                      f"redis.url={redis_server}", "reward_workers.num_workers=0"])
    summary = run_job(config)
    _, stderr = worker.communicate(timeout=60)
    assert worker.returncode == 0, stderr
    assert summary["status"] == "completed" and summary["rl"]["samples_trained"] == 4 * 4 * 8
    assert int(stderr.split("scored ")[1].split(" samples")[0]) >= summary["rl"]["samples_trained"]
    assert summary["rl"]["staleness_histogram"] == {"0": 4 * 4 * 8}
    assert summary["rl"]["samples_dropped_stale"] == 0
    assert summary["rl"]["learner_steps_queued"] == 0  # a step's samples come from the weights the one before made


def test_a_learner_slower_than_generation_gets_its_next_step_queued_within_the_staleness_bound(ray_session,
                                                                                              tmp_path):
    """Four passes over each batch make the learner the bottleneck: the loop sends each next step while the one
    before still runs, so the learner starts it the moment it is free, and no sample is staler than the bound."""
    config = load_config(QUICKSTART, [f"output_dir={tmp_path}", "name=queued", "sft.enabled=false",
                                      "rl.max_steps=6", "rl.max_staleness=1", "rl.ppo_epochs=4", "rl.minibatches=2",
                                      "wandb.mode=disabled", "eval.enabled=false", "rl.batch_prompts=4",
                                      "rollout.prompts_per_batch=4"])
    rl = run_job(config)["rl"]
    assert rl["learner_steps_queued"] >= 3
    assert rl["samples_trained"] == 6 * 4 * 8 and rl["max_staleness_trained"] <= 1


def assert_dashboard_logged(summary: dict) -> None:
    """Every key of the dashboard's panels, the samples table and the last in-run evaluation reached W&B."""
    logged = read_back(summary["wandb_dir"])
    assert logged["state"] == "finished" and logged["config"]["rl"]["max_steps"] == 12
    keys = set(logged["summary"])
    for section, x_key, panels in dashboard_layout("policy"):
        assert x_key in keys, section
        for panel in panels:
            for key in panel.metrics:
                pattern = re.compile(key if ".*" in key else re.escape(key) + "$")
                assert any(pattern.match(k) for k in keys), f"{section}: {key} was never logged"
    table = logged["summary"]["policy/samples/table"]
    assert table["_type"] == "table-file" and table["nrows"] == 16
    last = summary["rl"]["eval_history"][-1]  # with its own value and version
    # the last record: step 12's, or an in-run evaluation that finished after it (dated by its version)
    assert logged["summary"]["policy/learner_step"] in (12, last["version"])
    # exact_match is the job's one reward, at weight 1: its component mean is the step's mean reward
    assert logged["summary"]["policy/rewards/component/exact_match"] == logged["summary"]["policy/rewards/total"]
    assert logged["summary"]["policy/eval/accuracy"] == last["accuracy"]
    assert logged["summary"]["policy/eval/policy_version"] == last["version"]


def read_back(wandb_dir: str) -> dict:
    """The run's summary as W&B's own reader prints it (run as a module: a wandb installed outside
    the virtual environment has no script beside its python)."""
    out = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", "--summary", "--json", wandb_dir],
                         capture_output=True, text=True, timeout=120, check=True)
    return json.loads(out.stdout)

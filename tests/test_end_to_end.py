"""End to end: a shortened quickstart runs SFT then asynchronous RL and writes a valid summary.json."""

from __future__ import annotations

import json
import os

from rlplatform.config import load_config
from rlplatform.job.controller import run_job
from rlplatform.transport.ledger import balanced

QUICKSTART = os.path.join(os.path.dirname(__file__), "..", "configs", "quickstart.yaml")


def test_short_quickstart_writes_a_valid_summary(ray_session, tmp_path, greedy_accuracy):
    config = load_config(QUICKSTART, [f"output_dir={tmp_path}", "name=e2e", "sft.steps=30", "rl.max_steps=12",
                                      "rl.max_staleness=1", "sft.log_every=10",
                                      "data.test_size=100",  # evaluations, and their check row by row, on 100 rows
                                      "rl.batch_prompts=4", "rollout.prompts_per_batch=4"])
    run_job(config)
    run_dir = tmp_path / "e2e"
    summary = json.loads((run_dir / "summary.json").read_text())
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
    # every generated sample is accounted for, each bucket counted where its samples were left
    assert rl["samples_unused_at_end"] == sum(rl["samples_unused_where"].values()) > 0
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
    assert (run_dir / "config.yaml").exists()
    assert (run_dir / "model" / "model.safetensors").exists() and (run_dir / "model" / "config.json").exists()
    assert (run_dir / "checkpoint" / "latest").exists()
    # RL's end is checkpointed too, and every prompt issued ended one way or is still open
    assert (run_dir / "checkpoints" / "step-000012" / "state.json").exists()
    assert rl["restarts"] == {"rollout": 0, "reward": 0, "evaluator": 0}
    ledger = rl["ledger"]
    assert ledger["trained"] == 12 * 4 and balanced(ledger)
    assert rl["groups_expired"] == 0 and rl["samples_dropped_expired"] == 0
    assert os.path.isdir(rl["wandb_dir"]) and os.listdir(rl["wandb_dir"])


def test_synchronous_mode_trains_only_on_fresh_samples(ray_session, tmp_path):
    config = load_config(QUICKSTART, [f"output_dir={tmp_path}", "name=sync", "sft.enabled=false",
                                      "rl.max_steps=4", "rl.max_staleness=0", "wandb.mode=disabled",
                                      "data.test_size=100", "rl.batch_prompts=4", "rollout.prompts_per_batch=4"])
    summary = run_job(config)
    assert summary["rl"]["staleness_histogram"] == {"0": 4 * 4 * 8}
    assert summary["rl"]["samples_dropped_stale"] == 0

"""A tool job end to end (real Ray, Redis, DeepSpeed; tiny model): the demo config's episodes call the
calculator through the job's tool workers, the learner trains on them, and the summary reports them;
resumed from its final checkpoint on the other engine (vLLM) for two more steps, it trains no episode twice."""

from __future__ import annotations

import json
import os

from rlplatform.config import load_config
from rlplatform.job.controller import run_job
from tests.job.conftest import ENGINES

TOOL_CALC = os.path.join(os.path.dirname(__file__), "..", "..", "configs", "tool_calc.yaml")


def assert_tool_episodes(rl: dict) -> None:
    """Two RL steps' episodes (2 prompts x 2 completions each), each with one calculator call."""
    tools = rl["tools"]
    assert tools["episodes"] >= 8 and tools["tool_calls_per_episode"] == 1.0 and tools["turns_per_episode"] == 2.0
    # each episode is shown one result, "<result>{product}</result>": 17 characters around a 3- or 4-digit product
    assert 20 <= tools["observation_tokens_per_episode"] <= 21 and tools["truncated_fraction"] == 0.0
    assert tools["calculator/calls"] >= 8 and tools["calculator/error_fraction"] == 0.0
    assert tools["malformed_calls"] == tools["unknown_tool_calls"] == 0  # the environment writes the calls
    # every episode waited on its call: the wait was seen, as decode steps of other rows or as idle time
    assert tools["decode_steps_while_waiting"] > 0 or tools["idle_s_while_waiting"] > 0
    if tools["decode_steps_while_waiting"]:  # each such step decoded at least one row, at most the batch's slots
        assert tools["decode_occupancy_while_waiting"] >= 1 and tools["decode_slots_used_while_waiting"] <= 1


def test_tool_job_trains_on_episodes_whose_calls_ran_on_tool_workers_and_resumes_on_vllm(ray_session, tmp_path):
    overrides = [
        f"output_dir={tmp_path}", "name=tools", "env.fn=tests.envs.tools_for_tests:CalculateThePrompt",
        "model.hidden_size=64", "model.num_layers=2", "model.num_heads=2",  # vLLM's CPU attention: head size 32
        "model.intermediate_size=128", "sft.steps=2", "sft.stop_at_accuracy=0", "rl.max_steps=2",
        "rl.batch_prompts=2", "rl.group_size=2", "rl.max_new_tokens=4", "env.max_tokens=40", "eval.max_rows=2",
        "eval.every_steps=0", "eval.max_new_tokens=4", "data.train_size=64", "data.test_size=8", "wandb.mode=disabled"]
    summary = run_job(load_config(TOOL_CALC, [*overrides, *ENGINES["transformers"]]))
    assert summary["status"] == "completed"
    assert summary["rl"]["samples_trained"] == 2 * 2 * 2
    assert summary["eval"]["after_rl"]["rows"] == 2  # an evaluation's episodes call the tools too
    assert_tool_episodes(summary["rl"])
    trained = [json.loads(line) for line in open(os.path.join(tmp_path, "tools", "trained.jsonl"))]
    assert len(trained) == 2

    # on vLLM one engine, the rollout worker's, is built
    resumed = run_job(load_config(TOOL_CALC, [*overrides, *ENGINES["vllm"], "eval.enabled=false", "rl.max_steps=4",
                                              "resume=always"]))
    assert resumed["status"] == "completed" and resumed["rl"]["steps"] == 4
    assert_tool_episodes(resumed["rl"])
    ids = [i for line in open(os.path.join(tmp_path, "tools", "trained.jsonl")) for i in json.loads(line)["sample_ids"]]
    assert len(ids) == len(set(ids)) == 4 * 2 * 2

"""A mixture-of-experts policy (`model.num_experts`) through a whole job on the transformers engine: SFT, RL with
routing replay (the samples carry their experts; summary.json has parity with and without replay), its checkpoint
and final model as a Qwen3-MoE; then a resume on vLLM's CPU build (routing replay off: it records no routing) that
goes on from the checkpoint training nothing twice, the engine's log-probs the learner's after each update."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlplatform.job.controller import run_job
from rlplatform.scheduling.ledger import balanced
from tests.job.conftest import ENGINES

pytestmark = pytest.mark.slow

MOE = ["model.num_experts=4", "model.experts_per_token=2", "model.expert_size=32", "model.num_heads=2",
       "sft.enabled=true", "sft.steps=3", "sft.batch_size=16", "checkpoint.every_steps=2", "resume=auto"]


def test_a_mixture_of_experts_trains_sft_and_rl_checkpoints_and_resumes(ray_session, tiny_job, run_files):
    first = run_job(tiny_job("moe", *MOE, "rl.max_steps=4"))
    assert first["status"] == "completed" and first["stages"]["sft"]["steps"] == 3 and first["rl"]["steps"] == 4
    # the same weights sampled and scored: replayed, the learner's log-probs are the engine's to float rounding
    parity = first["rl"]["parity"]
    assert parity["replayed_abs_mean"] == pytest.approx(parity["abs_mean"]) and parity["abs_mean"] < 1e-4, parity
    assert "unreplayed_abs_mean" in parity and 0 < parity["router_agreement"] <= 1
    assert parity["routed_expert_bytes_per_step"] > 2 * 4 * 2 * 2  # a step's 8 samples, 2 layers x top-2, a byte each
    config = tiny_job("moe", *MOE, "rl.max_steps=6", *ENGINES["vllm"], "rl.routing_replay=false")
    saved = json.loads(Path(config.run_dir, "model", "config.json").read_text())
    assert saved["model_type"] == "qwen3_moe" and saved["num_local_experts"] == 4
    resumed = run_job(config)  # from step 4's checkpoint, to step 6, on vLLM
    assert resumed["status"] == "completed" and resumed["rl"]["steps"] == 6
    # vLLM computes the MoE as the learner does at each version it loaded (its experts repacked after each update)
    assert resumed["rl"]["parity"]["abs_mean"] < 1e-4, resumed["rl"]["parity"]
    trained = run_files.trained_ids(config.run_dir)
    assert len(trained) == len(set(trained)) == 6 * 2 * 4 and balanced(resumed["rl"]["ledger"])

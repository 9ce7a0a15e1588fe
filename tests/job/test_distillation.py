"""On-policy distillation between the policies of one job (configs/device_and_server.yaml, shortened): the device
policy's samples go through its teacher queue, where a teacher worker scores every token with the server's newest
weights and names the server's top tokens at each position (the demo's `forward_kl` mode), then on to the rewards;
its learner adds the forward KL over those tokens to its loss and the job reports both KLs, the teacher's version
lag and its scoring time. The server here is frozen after its
SFT (`rl.enabled: false`): its teacher worker serves version 0 throughout (the demo's server trains by RL
meanwhile; tests/job/test_moe_job.py runs a mixture of experts with routing replay)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import yaml

from rlplatform.config import load_config
from rlplatform.job.controller import run_job
from rlplatform.scheduling.ledger import balanced

pytestmark = pytest.mark.slow

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "device_and_server.yaml"


def tiny_pair(path: Path) -> str:
    """The demo's server and device policies alone (not the control), both tiny dense models."""
    config = yaml.safe_load(CONFIG.read_text())
    server, device = config["policies"][:2]
    server["model"] = {"hidden_size": 64, "num_layers": 2, "intermediate_size": 128}
    device["model"].update(hidden_size=64, num_layers=2, intermediate_size=128)
    for policy in (server, device):
        policy["sft"] = {"steps": 3}
    config["policies"] = [server, device]
    path.write_text(yaml.safe_dump(config))
    return str(path)


def test_a_device_policy_distils_from_a_server_policy_of_the_same_job(ray_session, tmp_path, run_files):
    config = load_config(tiny_pair(tmp_path / "pair.yaml"), [
        f"output_dir={tmp_path}", "name=pair", "rl.max_steps=6", "rl.batch_prompts=2", "rl.group_size=4",
        "rl.max_new_tokens=4", "rollout.prompts_per_batch=4", "data.train_size=300", "data.test_size=8",
        "eval.enabled=false", "wandb.mode=disabled", "reward_workers.num_cpus=0.25", "policies[0].rl.enabled=false"])
    summary = run_job(config)
    assert summary["status"] == "completed" and "rl" not in summary["policies"]["server"]
    device = summary["policies"]["device"]["rl"]
    assert device["steps"] == 6 and device["samples_trained"] == 6 * 2 * 4 and balanced(device["ledger"])
    distill = device["distill"]  # every step's samples scored by the teacher (a learner refuses one that was not)
    assert distill["steps"] == 6 and distill["teacher_lag"] == 0 and distill["teacher_score_s_per_sample"] > 0
    assert all(math.isfinite(distill[k]) for k in ("kl", "kl_first", "kl_last", "forward_kl"))
    assert len(run_files.trained_ids(str(tmp_path / "pair" / "device"))) == 6 * 2 * 4

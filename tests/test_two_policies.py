"""Several policies in one job: configs/two_policies.yaml, shortened, trains two differently
sized policies at once, each with its own learner, rollout workers, metrics and checkpoints, one of them
generating on vLLM and training LoRA adapters, beside the other on the transformers engine (two policies on the
transformers engine alone, one of them frozen after SFT: tests/job/test_distillation.py's job)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from rlplatform.cli import _result_line
from rlplatform.config import load_config
from rlplatform.job.controller import run_job

CONFIG = str(Path(__file__).resolve().parents[1] / "configs" / "two_policies.yaml")


def on_vllm_with_lora(path: Path) -> str:
    """configs/two_policies.yaml with its small policy on vLLM, serving LoRA adapters (its CPU attention takes a
    head size of 32: 64 / 2), beside the large one on the transformers engine; the merged models are saved for
    plain generate to check the evaluations on."""
    config = yaml.safe_load(Path(CONFIG).read_text())
    small = config["policies"][0]
    small["model"].update(num_heads=2, lora={"enabled": True})
    small["rollout"] = {"engine": "vllm"}
    config["checkpoint"] = {"export_merged": True}
    path.write_text(yaml.safe_dump(config))
    return str(path)


# vLLM's kernels may break a near-tie of greedy decoding the other way, and the merged weights round apart from the
# adapters: the small policy's evaluation may sit a row of the 50 apart from plain generate's
ROWS_APART = {"small": 1, "large": 0}


def test_two_policies_train_side_by_side(ray_session, tmp_path, greedy_accuracy):
    config = load_config(on_vllm_with_lora(tmp_path / "pair.yaml"), [f"output_dir={tmp_path}", "name=pair", "sft.steps=10", "rl.max_steps=4",
                               "eval.every_steps=0", "wandb.mode=disabled", "learner.num_cpus=0.5",
                               "rollout.num_cpus=0.5",  # 6.5 Ray CPUs would not fit the 4-CPU test cluster
                               "data.test_size=50",  # each evaluation, and its check row by row, on 50 rows
                               "rl.batch_prompts=4", "rollout.prompts_per_batch=4"])
    assert [(p.name, p.model.hidden_size, p.sft.stop_at_accuracy, p.rl.lr, p.rl.max_steps)
            for p in config.policy_list()] == [("small", 64, 0.8, 2e-4, 4), ("large", 128, 0.3, 3e-4, 4)]
    # entries override the shared sections, key by key
    summary = run_job(config)
    assert summary["status"] == "completed" and set(summary["policies"]) == {"small", "large"}
    for name in ("small", "large"):
        policy = summary["policies"][name]
        assert policy["stages"]["sft"]["steps"] == 10 and policy["rl"]["steps"] == 4
        assert policy["rl"]["samples_trained"] == 4 * 4 * 8  # each learner got only its own samples
        assert policy["rl"]["max_staleness_trained"] <= 1
        model_dir = tmp_path / "pair" / name / "model"
        # each policy's evaluation scored its own saved weights, not the other policy's
        assert policy["eval"]["after_rl"]["accuracy"] == pytest.approx(greedy_accuracy(str(model_dir), config),
                                                                       abs=ROWS_APART[name] / 50 + 1e-9)
        assert json.loads((model_dir / "config.json").read_text())["hidden_size"] == (64 if name == "small" else 128)
        assert (tmp_path / "pair" / name / "checkpoint" / "latest").exists()
    assert summary["rl"] == summary["policies"]["small"]["rl"]  # the first policy's figures at the top level
    line = _result_line(summary)  # the console's last line names every policy's figures
    for name, policy in summary["policies"].items():
        assert (f"{name}: accuracy after sft {policy['eval']['after_sft']['accuracy']:.3f}, "
                f"accuracy after rl {policy['eval']['after_rl']['accuracy']:.3f}") in line


def test_a_job_larger_than_the_ray_cluster_fails_with_a_clear_message(ray_session, tmp_path):
    config = load_config(CONFIG, [f"output_dir={tmp_path}", "name=big", "wandb.mode=disabled"])
    with pytest.raises(RuntimeError, match="the Ray cluster has 4 CPUs but the job's actors reserve 6.5"):
        run_job(config)
    assert json.loads((tmp_path / "big" / "summary.json").read_text())["status"] == "failed"

"""Learning on the demo addition task (1-digit operands, so a test runs in seconds): the SFT stage
stops at the first held-out check that reaches `sft.stop_at_accuracy`; from that checkpoint,
asynchronous GRPO and asynchronous RLOO each raise held-out greedy accuracy by at least 3
points, and GRPO training LoRA adapters alone (streaming under 5% of the model's bytes per sync) by
at least 5; a staleness-2 run keeps its bound and accounts for every sample. Played as a verifiers taskset
by the rollout workers themselves (`env.kind: verifiers`), the same sums train on episodes whose tokens are
the ones the tasks' reward scored. (A held-out gain on the taskset was asserted here before: from this
checkpoint, 40 steps gained 0.02-0.06 pass@1 in three runs and 60 steps 0.13, about 5 minutes on 2 cores, so
chance decided it; the verifiers demo's gain is measured over seeds in docs/tools-and-environments.md.)"""

from __future__ import annotations

import os

import pytest

from rlplatform.config import load_config
from rlplatform.job.controller import run_job
from rlplatform.policy import load_policy
from rlplatform.transport.weights import to_snapshot

pytestmark = pytest.mark.slow

QUICKSTART = os.path.join(os.path.dirname(__file__), "..", "configs", "quickstart.yaml")
# the SFT stage at a constant rate: the quickstart's 100-step warm-up is for its 1500 steps on 2-digit sums, and
# over this stage's 60 it left a checkpoint (0.34) from which RLOO gained 0.05 and 0.12, GRPO 0.10 and 0.145; at a
# constant rate (0.365, as before the warm-up existed) GRPO gained 0.09, 0.14 and 0.16, RLOO 0.10 and 0.11 (2026-11-28)
TASK = ["data.digits=1", "data.test_size=200", "wandb.mode=disabled", "rl.track_reference_kl=false",
        "rl.lr=2e-4", "sft.warmup_steps=0", "sft.lr_schedule=constant"]
SFT_STEPS = 60
# checked every 10 steps, the stage stops near 0.3 (every 20, one more window of training took it to 0.47, where 40
# RL steps gained under 0.10), so the RL tests below start from partial accuracy whatever the float rounding
SFT_CHECK_EVERY = 10
SFT_STOP = ["sft.stop_at_accuracy=0.3", f"sft.eval_every={SFT_CHECK_EVERY}"]
RL_STEPS = 40
# 40 RL steps from the SFT checkpoint (0.325) gained 0.09-0.225 held-out accuracy, 0.15 on average, over 12 runs of
# the test below (GRPO and RLOO, alone, in pairs side by side and in the full suite); from 0.365, GRPO 0.09-0.16 and
# RLOO 0.10-0.11, but RLOO 0.045 in a full suite run whose other tests held the cores (staler samples, 2026-11-28);
# weights that do not learn keep their greedy accuracy (lr 0 keeps it exactly)
MIN_GAIN = 0.03
LORA = ["model.lora.enabled=true", "model.lora.rank=3", "model.lora.alpha=6", "rl.lr=4e-3"]
LORA_STEPS = 60
# the one-digit sums as verifiers tasks, each listed 4 times, played by 2 rollout workers
TASKSET = ["env.kind=verifiers", "env.taskset=tests/envs/digit_sums.py", "env.taskset_args.copies=4",
           "env.test_tasks=16", "rewards=[{name: verifiers_reward}, {name: exact_match, weight: 0}, "
           "{fn: 'tests.job.rewards_for_tests:agrees_with_verifiers', weight: 0}]",
           "eval.pass_reward=verifiers_reward", "rollout.num_workers=2", "rollout.num_cpus=0.5"]

@pytest.fixture(scope="module")
def sft_checkpoint(ray_session, tmp_path_factory):
    """The SFT stage alone, stopped at partial accuracy; yields (model directory, its accuracy)."""
    out = tmp_path_factory.mktemp("learning")
    summary = run_job(load_config(QUICKSTART, TASK + SFT_STOP + [f"output_dir={out}", "name=sft",
                                                                 f"sft.steps={SFT_STEPS}", "rl.enabled=false"]))
    accuracy = summary["eval"]["after_sft"]["accuracy"]
    assert 0.2 <= accuracy <= 0.8, f"the SFT checkpoint should be partly right, got {accuracy}"
    # a job that trains by SFT alone generates only to evaluate: its evaluator (index rollout.num_workers) started,
    # no rollout worker
    started = {actor["Name"] for actor in ray_session._private.state.actors().values()}
    assert "sft-policy-rollout-1" in started and "sft-policy-rollout-0" not in started
    return str(out / "sft" / "model"), accuracy, summary["stages"]["sft"]


def test_sft_stops_at_the_first_check_that_reaches_the_threshold(sft_checkpoint):
    _, accuracy, sft = sft_checkpoint
    checks = sft["accuracy_checks"]
    assert [c["step"] for c in checks] == list(range(SFT_CHECK_EVERY, sft["steps"] + 1, SFT_CHECK_EVERY))
    assert all(c["accuracy"] < 0.3 for c in checks[:-1])  # no earlier check reached it
    if checks[-1]["accuracy"] >= 0.3:  # stopped there, not at the step cap
        assert sft["steps"] == checks[-1]["step"]
    else:
        assert sft["steps"] == SFT_STEPS
    assert accuracy == checks[-1]["accuracy"]  # the published version 0 is the weights last checked


def rl_from(checkpoint, tmp_path, *overrides: str):
    model_path = checkpoint[0]
    return run_job(load_config(QUICKSTART, TASK + [
        f"output_dir={tmp_path}", "name=rl", "sft.enabled=false", "model.kind=pretrained", f"model.path={model_path}",
        f"rl.max_steps={RL_STEPS}", "eval.every_steps=20",  # one in-run evaluation of the 200 rows, at step 20
        "eval.priority=normal",  # its in-run evaluations within 40 steps, beside the other tests on 2 cores
        *overrides]))


@pytest.mark.parametrize("algorithm", ["grpo", "rloo"])
def test_async_rl_raises_held_out_accuracy(sft_checkpoint, tmp_path, algorithm):
    summary = rl_from(sft_checkpoint, tmp_path, f"rl.algorithm={algorithm}", "rl.max_staleness=1")
    start, end = summary["eval"]["before_rl"]["accuracy"], summary["eval"]["after_rl"]["accuracy"]
    assert start == sft_checkpoint[1]  # the run starts from the checkpoint's weights
    assert end - start >= MIN_GAIN, f"{algorithm}: held-out accuracy {start:.3f} -> {end:.3f}"
    assert summary["rl"]["max_staleness_trained"] == 1  # it did train asynchronously
    history = summary["rl"]["eval_history"]
    assert history and [h["version"] for h in history] == sorted(h["version"] for h in history)
    assert all(0 < h["wall_s"] <= summary["rl"]["wall_s"] for h in history)


def test_staleness_two_keeps_its_bound_and_loses_no_sample(sft_checkpoint, tmp_path):
    summary = rl_from(sft_checkpoint, tmp_path, "rl.max_staleness=2", "rl.max_steps=8", "rl.batch_prompts=4",
                      "rollout.num_workers=2", "rollout.num_cpus=0.5", "eval.enabled=false")
    rl = summary["rl"]
    assert rl["max_staleness_trained"] <= 2
    assert sum(rl["staleness_histogram"].values()) == rl["samples_trained"] == 8 * 4 * 8
    assert max(int(gap) for gap in rl["staleness_histogram"]) == rl["max_staleness_trained"] >= 1
    # each bucket is counted where its samples were left, so the balance can fail
    assert rl["samples_unused_at_end"] == sum(rl["samples_unused_where"].values())
    assert rl["samples_generated"] == (rl["samples_trained"] + rl["samples_dropped_stale"]
                                       + rl["samples_dropped_error"] + rl["samples_dropped_zero_advantage"]
                                       + rl["samples_dropped_invalid"] + rl["samples_unused_at_end"])


def test_lora_rl_raises_held_out_accuracy_streaming_adapters_only(sft_checkpoint, tmp_path, greedy_accuracy):
    summary = rl_from(sft_checkpoint, tmp_path, *LORA, f"rl.max_steps={LORA_STEPS}", "eval.every_steps=30",
                      "rl.max_staleness=0", "checkpoint.export_merged=true")
    start, end = summary["eval"]["before_rl"]["accuracy"], summary["eval"]["after_rl"]["accuracy"]
    # synchronous (rl.max_staleness 0): what is trained does not depend on the cores' load. From 0.365: +13.0 alone
    # and +13.0 beside two busy processes; at staleness 1 it gained +14.0 to +21.5 alone but +9.0 and +4.5 in full
    # suite runs (staler samples). At lr 1e-9 nothing changes (+0: checked)
    assert end - start >= 0.05, f"LoRA: held-out accuracy {start:.3f} -> {end:.3f}"
    rl = summary["rl"]
    model, _ = load_policy(sft_checkpoint[0])
    full_bytes = sum(array.nbytes for array in to_snapshot(model.state_dict()).values())
    assert rl["weight_syncs"] >= LORA_STEPS and 0 < rl["weight_bytes_per_sync"] < 0.05 * full_bytes
    # the merged export is the policy the evaluator scored: plain HF generate on model/ agrees
    config = load_config(os.path.join(summary["run_dir"], "config.yaml"))
    assert greedy_accuracy(os.path.join(summary["run_dir"], "model"), config) == pytest.approx(end, abs=0.011)


def test_a_taskset_trains_on_the_episodes_its_reward_scored(sft_checkpoint, tmp_path):
    """From the partly right checkpoint, the taskset's reward (computed by verifiers from each rollout's trace)
    is, on every trained sample, the exact match of the sample's own completion with its task's answer (a
    weight-0 reward checks each sample); some are right. An episode's tokens paired with another episode's
    reward fail it; the learning itself is the tests' above."""
    pytest.importorskip("verifiers.v1")
    summary = rl_from(sft_checkpoint, tmp_path, *TASKSET, "rl.max_steps=3", "rl.batch_prompts=8", "eval.enabled=false")
    rl = summary["rl"]
    assert rl["ledger"]["admitted"] == 0 and rl["samples_trained"] == 3 * 8 * 8  # every group a task the ledger issued
    components = rl["rewards"]["components"]
    assert components["agrees_with_verifiers"] == 1.0 and components["exact_match"] > 0.1

"""Devices: what the controller reserves from Ray (a whole GPU per actor, or shares where the cluster has
fewer), where `auto` resolves inside an actor, the config checks and the cluster check; on a GPU machine,
learner ranks and engines on the GPU Ray assigned."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import ray
import torch

from rlplatform.actors.engine import TransformersEngine
from rlplatform.config import ConfigError, JobConfig, LearnerConfig, WeightsConfig, load_config
from rlplatform.devices import (assigned_gpu, gpu_shares, gpus_per_actor, resolve_device, resolve_dtype,
                                share_kv_heads_on_cpu, vllm_memory_fraction)
from rlplatform.job.placement import PolicyPlan, check_fits, gpus_needed, plan_job
from rlplatform.learners.group import LearnerGroup
from rlplatform.tokenization import encode_prompts
from rlplatform.transport.weight_transports import ObjectStoreTransport, resolved_transport, weight_transport
from rlplatform.transport.weights import from_snapshot, to_snapshot

QUICKSTART = os.path.join(os.path.dirname(__file__), "..", "configs", "quickstart.yaml")
ROWS = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a, b in [(1, 2), (13, 7), (40, 45), (9, 9)]]


@ray.remote
class Probe:
    """An actor reporting how `device` resolves where Ray placed it."""

    def where(self, device: str) -> tuple:
        return str(resolve_device(device)), assigned_gpu()


def test_gpus_per_actor_defaults_follow_the_device_and_the_cluster():
    assert gpus_per_actor("cuda", None, 0) == 1 and gpus_per_actor("cpu", None, 8) == 0
    assert gpus_per_actor("auto", None, 8) == 1 and gpus_per_actor("auto", None, 0) == 0
    assert gpus_per_actor("auto", 0.25, 8) == 0.25 and gpus_per_actor("cuda", 0, 8) == 0


def plan(config: JobConfig, cluster_gpus: float, cuda_here: bool = False) -> PolicyPlan:
    """The one policy's plan on a cluster of `cluster_gpus` GPUs (and 64 CPUs)."""
    return plan_job(config, {"CPU": 64.0, "GPU": cluster_gpus}, cuda_here).of("policy")


def test_model_dtype_auto_is_bfloat16_where_the_learner_computes_on_a_gpu():
    assert JobConfig().model.dtype == "auto"  # the default
    assert resolve_dtype("auto", 0) == "float32" and resolve_dtype("auto", 0.5) == "bfloat16"
    assert resolve_dtype("float32", 1) == "float32" and resolve_dtype("bfloat16", 0) == "bfloat16"
    for cluster_gpus, device, expected in ((0, "auto", "float32"), (8, "auto", "bfloat16"), (8, "cpu", "float32"),
                                           (8, "cuda", "bfloat16")):
        config = load_config(overrides=[f"learner.device={device}"])
        assert plan(config, cluster_gpus).policy.model.dtype == expected, (cluster_gpus, device)
        assert config.model.dtype == "auto"  # the loaded config is left as given
    assert plan(load_config(overrides=["model.dtype=float32"]), 8).policy.model.dtype == "float32"  # set: kept


def test_the_plan_resolves_bfloat16s_training_mode_and_zero_stage_as_the_learner_would():
    config = JobConfig()
    on_gpu = plan(config, 8).policy.learner
    assert (on_gpu.bf16_mode, on_gpu.zero_stage) == ("master_weights", 1)  # bfloat16 over float32 masters
    autocast = plan(load_config(overrides=["learner.zero_stage=0"]), 8).policy.learner
    assert (autocast.bf16_mode, autocast.zero_stage) == ("autocast", 0)
    on_cpu = plan(JobConfig(), 0).policy.learner
    assert (on_cpu.bf16_mode, on_cpu.zero_stage) == ("auto", 0)  # float32: the mode does not apply
    for learner, dtype in ((on_gpu, "bfloat16"), (autocast, "bfloat16"), (on_cpu, "float32")):
        # the rank's own rule on the resolved values decides alike
        assert learner.master_weights(dtype) == (dtype == "bfloat16" and learner.bf16_mode == "master_weights")
        assert learner.effective_zero_stage(dtype) == learner.zero_stage
    assert (config.learner.bf16_mode, config.learner.zero_stage) == ("auto", None)  # left as given


def test_gpus_needed_counts_ranks_rollout_workers_and_the_evaluator():
    config = load_config(overrides=["learner.num_ranks=2", "rollout.num_workers=3"])
    assert gpus_needed(plan_job(config, {"GPU": 0.0}, False)) == 0  # auto on a CPU cluster
    assert gpus_needed(plan_job(config, {"GPU": 8.0}, False)) == 2 + 4  # one each; the evaluator generates too
    config = load_config(overrides=["learner.num_ranks=2", "rollout.num_workers=3", "rollout.num_gpus=0.25"])
    assert gpus_needed(plan_job(config, {"GPU": 8.0}, False)) == 2 + 1


def test_gpu_shares_give_whole_gpus_where_they_fit_and_split_them_where_not():
    # (cluster GPUs, reserved by settings, unset ranks, unset rollout workers + evaluators, ranks may share)
    assert gpu_shares(8, 0, 1, 2, True) == (1.0, 1.0)  # one each fits
    assert gpu_shares(1, 0, 1, 2, True) == (0.5, 0.25)  # the quickstart on one GPU
    assert gpu_shares(1, 0, 1, 3, True) == (0.5, 0.1666)  # rounded down to Ray's steps: at most the whole GPU
    assert gpu_shares(2, 0, 1, 2, True) == (1.0, 0.5)  # the rank keeps a GPU, the rollout side shares the other
    assert gpu_shares(8, 0, 4, 5, True) == (1.0, 0.5)  # 5 on the 4 GPUs left: two to a GPU
    assert gpu_shares(1, 0, 2, 2, True) == (0.25, 0.25)  # two one-rank policies and their rollout workers
    assert gpu_shares(1, 0.5, 0, 2, True) == (1.0, 0.25)  # the learner set at 0.5: the rest of the GPU
    assert gpu_shares(1, 0.5, 1, 0, True) == (0.5, 1.0)
    assert gpu_shares(1, 0, 2, 2, False) == (1.0, 1.0)  # two ranks of one learner need two GPUs: nothing fits
    assert gpu_shares(2, 1.5, 0, 2, True) == (1.0, 1.0)  # half of some GPU is free, but which one is not known


def test_the_plan_shares_one_gpu_among_the_default_job_and_keeps_set_shares():
    def shares(config: JobConfig, cluster_gpus: float):
        planned = plan_job(config, {"GPU": float(cluster_gpus)}, False)
        policy = planned.of("policy")
        return planned.sharing, policy.learner_gpus, policy.rollout_gpus

    config = JobConfig()
    assert shares(config, 0) == (None, 0.0, 0.0)  # CPU: nothing shared
    assert shares(config, 8) == (None, 1.0, 1.0)  # a GPU each fits
    assert shares(config, 1) == ("sharing 1 GPU: learner.num_gpus 0.5 per rank, rollout.num_gpus 0.25 per rollout "
                                 "worker and evaluator (set them to choose)", 0.5, 0.25)
    assert config.learner.num_gpus is None and config.rollout.num_gpus is None  # the config is left as given
    assert gpus_needed(plan_job(config, {"GPU": 1.0}, False)) == 1
    note, learner, rollout = shares(load_config(None, ["learner.num_gpus=0.4", "rollout.num_workers=2"]), 1)
    assert note.startswith("sharing 1 GPU: rollout.num_gpus 0.2 per rollout worker") and (learner, rollout) == (0.4, 0.2)
    assert shares(load_config(None, ["learner.num_ranks=2"]), 1) == (None, 1.0, 1.0)  # the check says why
    note, learner, rollout = shares(load_config(None, ["learner.device=cpu"]), 1)
    assert note is not None and (learner, rollout) == (0.0, 0.5)  # the rollout worker and the evaluator share it


def test_weights_travel_by_cuda_ipc_where_learner_and_rollout_workers_share_one_gpu():
    def resolved(one_gpu: bool, lora: bool = False, **weights) -> str:
        return resolved_transport(WeightsConfig(**weights), one_gpu, lora)

    assert WeightsConfig().transport == "auto"  # the default
    assert resolved(one_gpu=True) == "cuda_ipc" and resolved(one_gpu=False) == "object_store"
    assert resolved(one_gpu=True, lora=True) == "object_store"  # the adapters alone travel: few bytes
    assert resolved(one_gpu=True, delta=True) == "object_store"  # deltas travel between devices
    assert resolved(one_gpu=True, transport="broadcast") == "broadcast"  # set: kept
    with pytest.raises(ValueError, match="weights.transport is auto: resolve it"):
        weight_transport(WeightsConfig())
    assert plan(JobConfig(), 1, cuda_here=True).transport.name == "cuda_ipc"
    assert plan(JobConfig(), 1, cuda_here=False).transport.name == "object_store"  # a GPU Ray declares, not one seen
    assert plan(JobConfig(), 2, cuda_here=True).transport.name == "object_store"  # the learner's GPU is its own
    elastic = load_config(None, ["rollout.max_workers=2"])
    assert plan(elastic, 1, cuda_here=True).transport.name == "object_store"  # workers that come and go
    assert JobConfig().weights.transport == "auto"


def test_vllm_takes_its_share_of_the_gpu_memory_unless_set():
    assert vllm_memory_fraction(None, None) == 0.9 and vllm_memory_fraction(None, 1) == 0.9
    assert vllm_memory_fraction(None, 0.25) == 0.225
    assert vllm_memory_fraction(0.3, 0.25) == 0.3


def test_the_default_job_runs_on_a_one_gpu_cluster_by_sharing_it(tmp_path):
    """A Ray cluster declaring one GPU (on a CPU machine the actors' `auto` devices resolve to the CPU, where
    the GPU they reserved is not seen): the default job starts and completes, its actors on shares of it."""
    script = f"""
import json, ray
from rlplatform.config import load_config
from rlplatform.job.controller import run_job
from rlplatform.warm_start import local_workers_forked
with local_workers_forked():
    ray.init(num_cpus=4, num_gpus=1, include_dashboard=False, log_to_driver=False)
summary = run_job(load_config({QUICKSTART!r}, ["output_dir={tmp_path}", "name=one-gpu", "sft.enabled=false",
                              "rl.max_steps=2", "rl.batch_prompts=4", "rollout.prompts_per_batch=4",
                              "model.hidden_size=64", "model.num_layers=2", "model.intermediate_size=128",
                              "data.test_size=8", "wandb.mode=disabled"]))
print(json.dumps({{"status": summary["status"], "steps": summary["stages"]["rl"]["steps"]}}))
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "sharing 1 GPU: learner.num_gpus 0.5 per rank, rollout.num_gpus 0.25 per rollout worker" in done.stdout
    assert done.stdout.strip().splitlines()[-1] == '{"status": "completed", "steps": 2}'


def check(config: JobConfig) -> None:
    """The cluster check of `config` planned for the test session's Ray cluster."""
    cluster = ray.cluster_resources()
    check_fits(config, plan_job(config, cluster, False), cluster, cpus=1)


def test_cluster_check_names_the_gpu_shortfall_and_the_keys(ray_session):
    check(load_config(None, ["learner.device=cpu", "rollout.device=cpu"]))
    gpus = ray.cluster_resources().get("GPU", 0.0)
    with pytest.raises(RuntimeError, match=r"has \d+ GPUs but the job's actors reserve .*learner.num_gpus"):
        check(load_config(None, ["learner.device=cuda", "rollout.device=cuda",
                                 f"rollout.num_gpus={gpus + 1}"]))  # more than the cluster holds


def test_cluster_check_names_a_missing_custom_resource_and_the_keys(ray_session):
    config = load_config(None, ["learner.device=cpu", "rollout.device=cpu", "rollout.num_workers=2",
                                "learner.num_ranks=2", "learner.resources={node: 0.25}",
                                "rollout.resources={node: 1}", "reward_workers.resources={node: 0.5}"])
    with pytest.raises(RuntimeError, match=r"0 of resource 'node' but the job's actors reserve 4 "
                                           r"\(learner.resources, rollout.resources, reward_workers.resources\)"):
        check(config)  # 2 ranks at 0.25, 2 rollout workers and the evaluator at 1, a reward worker at 0.5
    with pytest.raises(ConfigError, match=r"'rollout.resources.rollout_node' is 0.0; give custom resources"):
        load_config(None, ["rollout.resources={rollout_node: 0}"])
    with pytest.raises(ConfigError, match=r"'reward_workers.resources.CPU' is 1.0; .*CPUs and GPUs have their own"):
        load_config(None, ["reward_workers.resources={CPU: 1}"])


def test_config_rejects_unknown_devices_cpu_float16_and_shared_gpus_across_ranks():
    assert load_config(None, ["model.dtype=bfloat16", "learner.device=cpu"]).model.dtype == "bfloat16"
    with pytest.raises(ConfigError, match="'rollout.device' is 'gpu'; expected one of"):
        load_config(None, ["rollout.device=gpu"])
    with pytest.raises(ConfigError, match="'model.dtype' is float16 but 'learner.device' is cpu"):
        load_config(None, ["model.dtype=float16", "learner.device=cpu"])
    with pytest.raises(ConfigError, match="'learner.num_gpus' is 0.5 with 2 ranks"):
        load_config(None, ["learner.num_ranks=2", "learner.num_gpus=0.5"])
    with pytest.raises(ConfigError, match="'learner.num_gpus' is -1"):
        load_config(None, ["learner.num_gpus=-1"])


def test_cpu_and_auto_resolve_to_cpu_in_an_actor_without_a_gpu(ray_session):
    probe = Probe.options(num_gpus=0).remote()
    try:
        assert ray.get(probe.where.remote("cpu")) == ("cpu", None)
        assert ray.get(probe.where.remote("auto")) == ("cpu", None)
    finally:
        ray.kill(probe)


def test_grouped_kv_heads_are_read_in_place_on_cpu_with_the_same_scores(tiny_policy, monkeypatch):
    """CPU attention reads each key/value head for its group of query heads in place (no `repeat_kv`
    copy), masked passes included, with the same log-probs and gradients; CUDA keeps transformers' rule."""
    from transformers.integrations import sdpa_attention

    from rlplatform.learners.batching import completion_logprobs
    from rlplatform.policy import load_policy

    model, _ = load_policy(tiny_policy)
    assert model.config.num_attention_heads > model.config.num_key_value_heads  # grouped-query attention
    prompts = [[5, 6, 7, 8, 9] * 8] * 3 + [[6, 7] * 10] * 3  # shared prompts of two lengths: a masked pass
    completions = [[10], [11, 12], [13, 5, 5], [7], [8, 8], [9, 10, 11]]
    copies, repeat_kv = [], sdpa_attention.repeat_kv
    monkeypatch.setattr(sdpa_attention, "repeat_kv", lambda *args: copies.append(1) or repeat_kv(*args))

    def scored():
        copies.clear()
        model.zero_grad()
        scores = completion_logprobs(model, prompts, completions, pad_id=0)
        (scores.logprobs * scores.mask).sum().backward()
        return scores.logprobs.detach(), torch.cat([p.grad.flatten() for p in model.parameters()]), len(copies)

    from transformers import AttentionInterface

    monkeypatch.setitem(AttentionInterface._global_mapping, "sdpa", sdpa_attention.sdpa_attention_forward)
    share_kv_heads_on_cpu(torch.device("cuda", 0))
    copied, copied_grad, copy_calls = scored()
    share_kv_heads_on_cpu(torch.device("cpu"))
    in_place, in_place_grad, in_place_calls = scored()
    assert copy_calls > 0 and in_place_calls == 0
    torch.testing.assert_close(in_place, copied, atol=1e-6, rtol=0)
    torch.testing.assert_close(in_place_grad, copied_grad, atol=1e-6, rtol=1e-5)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_cuda_without_a_gpu_says_what_to_change():
    with pytest.raises(RuntimeError, match="device 'cuda' was asked for but this process sees no CUDA device"):
        resolve_device("cuda")


@pytest.mark.gpu
def test_auto_follows_the_gpu_ray_assigned(ray_session):
    with_gpu, without = Probe.options(num_gpus=1).remote(), Probe.options(num_gpus=0).remote()
    try:
        assert ray.get(with_gpu.where.remote("auto")) == ("cuda:0", 0)  # Ray narrowed CUDA_VISIBLE_DEVICES to it
        assert ray.get(without.where.remote("auto")) == ("cpu", None)
    finally:
        ray.kill(with_gpu)
        ray.kill(without)


@pytest.mark.gpu
@pytest.mark.parametrize("bf16_mode,zero_stage,weights,mode", [
    ("autocast", 2, "float32", "bf16"),  # bfloat16 autocast, float32 weights
    ("master_weights", None, "bfloat16", "bf16_master"),  # bfloat16 weights over float32 masters, ZeRO-1
])
def test_learner_rank_trains_on_its_ray_assigned_gpu_with_nccl(ray_session, tiny_policy, bf16_mode, zero_stage,
                                                                weights, mode):
    learner = LearnerGroup(LearnerConfig(device="cuda", zero_stage=zero_stage, bf16_mode=bf16_mode), tiny_policy, 0,
                           dtype="bfloat16", transport=ObjectStoreTransport())
    try:
        (placement,) = learner.placements()
        assert placement["device"] == "cuda:0" and placement["local_rank"] == 0
        assert placement["backend"] == "nccl" and len(placement["ray_gpu_ids"]) == 1
        assert (placement["dtype"], placement["mode"]) == (weights, mode)
        learner.start_stage(lr=1e-2)
        first = learner.sft_step(ROWS)
        assert learner.sft_step(ROWS).loss < first.loss
    finally:
        learner.shutdown()


@pytest.mark.gpu
def test_engine_generates_on_cuda_in_bfloat16_and_loads_streamed_weights(tiny_policy):
    engine = TransformersEngine(tiny_policy, "cuda", "bfloat16")
    assert {(p.device.type, p.dtype) for p in engine.model.parameters()} == {("cuda", torch.bfloat16)}
    engine.load_weights(from_snapshot(to_snapshot(engine.model.state_dict())), 3)
    (prompt,) = encode_prompts(engine.tokenizer, [{"prompt": "12+34="}], "auto")
    (group,) = engine.generate([prompt.ids], 4, 5, 1.0)
    assert all(c.versions == [3] * len(c.completion_ids) and all(lp <= 0 for lp in c.logprobs) for c in group)

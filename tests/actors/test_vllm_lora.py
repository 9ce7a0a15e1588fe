"""The vLLM engine under LoRA: each streamed version becomes a peft adapter directory that peft loads
and that holds exactly the streamed tensors (CPU); on a GPU (`gpu` marker), vLLM's LoRA requests give
the learner's log-probs, and requests in flight move to each new version's adapters."""

from __future__ import annotations

import json
import os

import pytest
import torch
from peft import PeftModel
from safetensors.torch import load_file

from rlplatform.actors.vllm_engine import AdapterVersions, max_lora_rank
from rlplatform.config import LoraConfig, ModelConfig
from rlplatform.learners.batching import completion_logprobs
from rlplatform.lora import adapter_parameters, with_adapters
from rlplatform.policy import load_policy
from rlplatform.transport.adapters import AdapterSnapshot
from rlplatform.transport.weights import from_snapshot

LORA = LoraConfig(enabled=True, rank=2, alpha=4.0, target_modules=["q_proj", "v_proj", "down_proj"])


def trained(policy_path: str, seed: int):
    """(the wrapped policy, its adapters as streamed: peft names) with adapters set to random values."""
    wrapped = with_adapters(load_policy(policy_path)[0], LORA)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in adapter_parameters(wrapped).values():
            param.copy_(0.3 * torch.randn(param.shape, generator=generator))
    state = {name: p.detach() for name, p in adapter_parameters(wrapped).items()}
    return wrapped, from_snapshot(AdapterSnapshot.of(wrapped, state))


def test_each_version_is_a_peft_directory_of_exactly_the_streamed_tensors(tiny_policy):
    versions = AdapterVersions(LORA)
    learner, streamed = trained(tiny_policy, seed=0)
    name, lora_id, directory = versions.write(streamed, version=3)
    written = load_file(os.path.join(directory, "adapter_model.safetensors"))
    assert sorted(written) == sorted(streamed)
    assert all(torch.equal(written[k], streamed[k]) for k in streamed)
    with open(os.path.join(directory, "adapter_config.json")) as f:
        config = json.load(f)
    assert (config["r"], config["lora_alpha"], sorted(config["target_modules"])) == (2, 4.0, ["down_proj", "q_proj", "v_proj"])
    loaded = PeftModel.from_pretrained(load_policy(tiny_policy)[0], directory)
    expected = adapter_parameters(learner)
    assert sorted(adapter_parameters(loaded)) == sorted(expected)
    assert all(torch.equal(p, expected[k]) for k, p in adapter_parameters(loaded).items())
    _, second = trained(tiny_policy, seed=1)
    next_name, next_id, next_directory = versions.write(second, version=4)
    assert next_name != name and next_id > lora_id > 0 and next_directory != directory


def test_max_lora_rank_is_the_smallest_vllm_rank_that_fits():
    assert [max_lora_rank(r) for r in (1, 2, 8, 9, 320)] == [1, 8, 8, 16, 320]
    with pytest.raises(ValueError, match="model.lora.rank 600"):
        max_lora_rank(600)


@pytest.fixture(scope="module")
def vllm_policy(tmp_path_factory):
    """A random policy whose head size (64) vLLM's attention and LoRA kernels take."""
    from rlplatform.policy import save_initial_policy

    path = tmp_path_factory.mktemp("vllm_lora_policy")
    return save_initial_policy(ModelConfig(hidden_size=128, num_layers=2, num_heads=2, num_kv_heads=2,
                                           intermediate_size=256), 0, str(path))


def _scores(model, completions, temperature: float):
    with torch.no_grad():
        scores = completion_logprobs(model, [c.prompt_ids for c in completions],
                                     [c.completion_ids for c in completions], pad_id=0, temperature=temperature)
    return [row[mask.bool()].cpu() for row, mask in zip(scores.logprobs, scores.mask)]


@pytest.mark.gpu
def test_streamed_adapters_give_vllm_the_learners_logprobs_in_flight_too(vllm_policy):
    pytest.importorskip("vllm")
    from rlplatform.actors.vllm_engine import VLLMEngine

    engine = VLLMEngine(vllm_policy, "float32", gpu_memory_utilization=0.3, seed=0, lora=LORA)
    first, first_state = trained(vllm_policy, seed=0)
    second, second_state = trained(vllm_policy, seed=1)
    prompts = [engine.tokenizer(p)["input_ids"] for p in ["12+34=", "5+5=", "7="]]
    engine.load_weights(first_state, version=1)
    done = [c for group in engine.generate(prompts, 2, 8, temperature=0.7) for c in group]
    assert all(c.versions == [1] * len(c.completion_ids) for c in done)
    for c, learner in zip(done, _scores(first.cuda(), done, 0.7)):
        torch.testing.assert_close(torch.tensor(c.logprobs), learner, atol=2e-3, rtol=0)
    batch = engine.decode_batch(max_new_tokens=10, temperature=1.0)
    batch.add(prompts, keys=[0, 1, 2])
    for _ in range(3):
        assert batch.step() == []
    engine.load_weights(second_state, version=2)
    finished = {}
    while batch:
        finished.update(batch.step())
    assert sorted(finished) == [0, 1, 2]  # nothing dropped
    moved = list(finished.values())
    assert all(c.versions[:3] == [1, 1, 1] and set(c.versions[3:]) <= {2} for c in moved)
    second = second.cuda()
    for c, learner in zip(moved, _scores(second, moved, 1.0)):  # the tokens after the update are the new adapters'
        torch.testing.assert_close(torch.tensor(c.logprobs[3:]), learner[3:], atol=2e-3, rtol=0)


def test_a_lora_rank_vllm_cannot_serve_is_refused_before_the_job_starts():
    from rlplatform.config import ConfigError, load_config
    from rlplatform.preflight import check_engines

    overrides = ["rollout.engine=vllm", "model.lora.enabled=true", "model.lora.rank=1024"]
    with pytest.raises(ConfigError) as err:
        check_engines(load_config(overrides=overrides), "job.yaml")
    assert str(err.value).startswith("job.yaml: 'model.lora.rank' is 1024 but 'rollout.engine' is vllm")
    assert "\n" not in str(err.value)

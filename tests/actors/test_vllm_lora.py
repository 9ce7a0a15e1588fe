"""The vLLM engine under LoRA: each streamed version rewrites the peft adapter directory vLLM loads, which
holds exactly the streamed tensors; vLLM's LoRA requests give the learner's log-probs, and each new version
replaces the adapters in place while requests run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

import pytest
import torch
from peft import PeftModel
from safetensors.torch import load_file

from rlplatform.actors.vllm_engine import AdapterDirectory, max_lora_rank
from rlplatform.config import LoraConfig, ModelConfig
from rlplatform.learners.batching import completion_logprobs
from rlplatform.lora import adapter_parameters, with_adapters
from rlplatform.policy import load_policy
from rlplatform.transport.adapters import AdapterSnapshot
from rlplatform.transport.weights import from_snapshot

LORA = LoraConfig(enabled=True, rank=2, alpha=4.0, target_modules=["q_proj", "v_proj", "down_proj"])


def trained(policy_path: str, seed: int, dtype: str = "float32"):
    """(the wrapped policy, its adapters as streamed: peft names) with adapters set to random values."""
    wrapped = with_adapters(load_policy(policy_path, dtype)[0], LORA)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in adapter_parameters(wrapped).values():
            param.copy_(0.3 * torch.randn(param.shape, generator=generator))
    state = {name: p.detach() for name, p in adapter_parameters(wrapped).items()}
    return wrapped, from_snapshot(AdapterSnapshot.of(wrapped, state))


def test_each_version_is_a_peft_directory_of_exactly_the_streamed_tensors(tiny_policy):
    adapters = AdapterDirectory(LORA)
    learner, streamed = trained(tiny_policy, seed=0)
    directory = adapters.write(streamed)
    written = load_file(os.path.join(directory, "adapter_model.safetensors"))
    assert sorted(written) == sorted(streamed)
    assert all(torch.equal(written[k], streamed[k]) for k in streamed)
    with open(os.path.join(directory, "adapter_config.json")) as f:
        config = json.load(f)
    assert (config["r"], config["lora_alpha"]) == (2, 4.0)
    assert sorted(config["target_modules"]) == ["down_proj", "q_proj", "v_proj"]
    loaded = PeftModel.from_pretrained(load_policy(tiny_policy)[0], directory)
    expected = adapter_parameters(learner)
    assert sorted(adapter_parameters(loaded)) == sorted(expected)
    assert all(torch.equal(p, expected[k]) for k, p in adapter_parameters(loaded).items())
    _, second = trained(tiny_policy, seed=1)  # the next version replaces the files, in the same directory
    assert adapters.write(second) == directory
    rewritten = load_file(os.path.join(directory, "adapter_model.safetensors"))
    assert all(torch.equal(rewritten[k], second[k]) for k in second)


def test_an_engine_killed_before_its_exit_has_its_adapter_folder_removed_by_the_next_one():
    ended = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    orphan = tempfile.mkdtemp(prefix=f"rlp-adapters-{ended.stdout.strip()}-")  # as a killed engine leaves it
    running = AdapterDirectory(LORA)
    assert not os.path.exists(orphan)
    AdapterDirectory(LORA)  # a second engine keeps the first's folder while its process runs
    assert os.path.isdir(running.folder.name)


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


def _gaps(completions, model, temperature: float, start: int = 0) -> float:
    """Mean |behaviour log-prob - `model`'s log-prob| over the completions' tokens from `start` on."""
    with torch.no_grad():
        scores = completion_logprobs(model, [c.prompt_ids for c in completions],
                                     [c.completion_ids for c in completions], pad_id=0, temperature=temperature)
    gaps = [(torch.tensor(c.logprobs[start:]) - row[mask.bool()].float().cpu()[start:]).abs()
            for c, row, mask in zip(completions, scores.logprobs, scores.mask)]
    return torch.cat(gaps).mean().item()


def test_streamed_adapters_give_vllm_the_learners_logprobs_and_replace_in_flight(vllm_policy):
    """vLLM's log-probs sit near the learner's under the same adapters, far from the base model's and from
    the other version's (on CPU in float32; vLLM's CUDA LoRA kernels take bfloat16). A new
    version replaces the adapters in place: running requests go on under their own ids, their tokens labelled
    with the version that produced each, and requests after it get the new adapters' log-probs."""
    from rlplatform.actors.vllm_engine import VLLMEngine

    dtype = "bfloat16" if torch.cuda.is_available() else "float32"
    engine = VLLMEngine(vllm_policy, dtype, None, seed=0, lora=LORA)
    first, first_state = trained(vllm_policy, seed=0, dtype=dtype)
    second, second_state = trained(vllm_policy, seed=1, dtype=dtype)
    first, second = first.to(engine.device), second.to(engine.device)
    prompts = [engine.tokenizer(p)["input_ids"] for p in ["12+34=", "5+5=", "7="]]
    engine.load_weights(first_state, version=1)
    done = [c for group in engine.generate(prompts, 2, 8, temperature=0.7) for c in group]
    assert all(c.versions == [1] * len(c.completion_ids) for c in done)
    with first.disable_adapter():
        base = _gaps(done, first, 0.7)
    assert _gaps(done, first, 0.7) < min(0.02, 0.2 * base)
    batch = engine.decode_batch(max_new_tokens=10, temperature=1.0)
    batch.add(prompts, keys=[0, 1, 2])
    finished = {}
    for _ in range(3):
        finished.update(batch.step())
    running = dict(batch.rows)
    engine.load_weights(second_state, version=2)
    assert batch.rows == running  # the same requests, under the same ids, still running
    while batch:
        finished.update(batch.step())
    assert sorted(finished) == [0, 1, 2]  # nothing dropped
    went_on = [finished[row.key] for row in running.values()]
    assert went_on and all(c.versions == [1, 1, 1] + [2] * (len(c.versions) - 3) for c in went_on)
    after = [c for group in engine.generate(prompts, 2, 8, temperature=0.7) for c in group]
    assert _gaps(after, second, 0.7) < min(0.02, 0.2 * _gaps(after, first, 0.7))


@pytest.mark.parametrize("overrides, message", [
    (["model.lora.rank=1024", "model.dtype=bfloat16"], "'model.lora.rank' is 1024 but 'rollout.engine' is vllm"),
    (["model.dtype=float32", "ray.address=10.0.0.7:6379"],  # a cluster elsewhere: its engines may be on GPUs
     "'model.dtype' is float32 with 'model.lora' but 'rollout.engine' is vllm"),
])
def test_lora_that_vllm_cannot_serve_is_refused_before_the_job_starts(overrides, message):
    from rlplatform.config import ConfigError, load_config
    from rlplatform.preflight import check_engines

    base = ["rollout.engine=vllm", "model.lora.enabled=true"]
    with pytest.raises(ConfigError) as err:
        check_engines(load_config(overrides=base + overrides), "job.yaml")
    assert str(err.value).startswith(f"job.yaml: {message}") and "\n" not in str(err.value)


def test_float32_lora_is_served_by_vllm_on_this_cpu():
    from rlplatform.config import load_config
    from rlplatform.preflight import check_engines

    if torch.cuda.is_available():
        pytest.skip("vLLM runs on this machine's GPU")
    check_engines(load_config(overrides=["rollout.engine=vllm", "model.lora.enabled=true", "model.dtype=float32"]),
                  "job.yaml")

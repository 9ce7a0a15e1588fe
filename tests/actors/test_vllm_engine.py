"""The vLLM rollout engine, run for real (vLLM's CPU build here, its CUDA build on a GPU machine): its
log-probs against the learner's, stopping on every EOS id, in-flight weight updates that keep running
requests, the prefix cache across versions, the parity canary's scores while a batch decodes, weight deltas,
and the preflight checks of a job that asks for it."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from rlplatform.config import ConfigError, ModelConfig, load_config
from rlplatform.preflight import check_engines

pytest.importorskip("vllm")


@pytest.fixture(scope="module")
def vllm_policy(tmp_path_factory):
    """A random policy whose head size (64) vLLM's attention kernels take, on CPU and GPU, with weights large
    enough that greedy decoding has no near-ties (a fresh initialisation repeats one token)."""
    from rlplatform.policy import save_initial_policy

    path = str(tmp_path_factory.mktemp("vllm_policy"))
    save_initial_policy(ModelConfig(hidden_size=128, num_layers=2, num_heads=2, num_kv_heads=2,
                                    intermediate_size=256), 0, path)
    _model(path, scale=0.3, seed=0).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def engine(vllm_policy):
    """One vLLM engine for the module (its start is the slow part), holding the policy as version 0;
    vLLM replaces `torch.set_num_threads` in the process it runs in, which is given back after."""
    from rlplatform.actors.vllm_engine import VLLMEngine
    from rlplatform.policy import load_policy

    set_num_threads, threads = torch.set_num_threads, torch.get_num_threads()
    engine = VLLMEngine(vllm_policy, "float32", None, seed=0)
    engine.load_weights(load_policy(vllm_policy)[0].state_dict(), version=0)
    yield engine
    torch.set_num_threads = set_num_threads
    torch.set_num_threads(threads)


def _ids(engine, prompts):
    return [engine.tokenizer(p)["input_ids"] for p in prompts]


def _model(path: str, scale: float = 0.0, device: torch.device = torch.device("cpu"), seed: int = 1):
    """The policy at `path`, moved by `scale` times fixed noise (another version of it)."""
    from rlplatform.policy import load_policy

    model = load_policy(path)[0].to(device)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(scale * torch.randn(param.shape, generator=generator).to(device))
    return model


def _greedy(model, prompt_ids, max_new_tokens: int = 10):
    output = model.generate(torch.tensor([prompt_ids], device=model.device), max_new_tokens=max_new_tokens,
                            do_sample=False)
    return output[0, len(prompt_ids):].tolist()


def test_vllm_logprobs_are_the_learners_at_the_sampling_temperature(engine, vllm_policy):
    from rlplatform.learners.batching import completion_logprobs

    groups = engine.generate(_ids(engine, ["12+34=", "5+5=", "7="]), 2, 8, temperature=0.7)
    completions = [c for group in groups for c in group]
    assert all(c.versions == [0] * len(c.completion_ids) for c in completions)
    scores = completion_logprobs(_model(vllm_policy, device=engine.device), [c.prompt_ids for c in completions],
                                 [c.completion_ids for c in completions], pad_id=0, temperature=0.7)
    for c, row, mask in zip(completions, scores.logprobs, scores.mask):
        torch.testing.assert_close(torch.tensor(c.logprobs), row[mask.bool()].cpu(), atol=2e-3, rtol=0)


def test_vllm_stops_on_every_eos_id_and_keeps_it(engine):
    free = engine.generate(_ids(engine, ["1+2="]), 1, 10, temperature=0.0)[0][0]
    position = next(i for i, t in enumerate(free.completion_ids) if t not in free.completion_ids[:i] and i > 0)
    stop_ids = engine.stop_ids
    engine.stop_ids = sorted(set(stop_ids) | {free.completion_ids[position]})  # a second EOS id
    try:
        stopped = engine.generate(_ids(engine, ["1+2="]), 1, 10, temperature=0.0)[0][0]
    finally:
        engine.stop_ids = stop_ids
    assert stopped.completion_ids == free.completion_ids[:position + 1]


def test_an_update_lands_while_requests_run_and_none_is_aborted(engine, vllm_policy):
    """The requests running when a version lands go on under their own request ids (none aborted and
    resubmitted), each token labelled with the version that produced it; the tokens after the update are the
    new weights' continuation of the same KV; and a new request reads no KV cached under the old version."""
    from rlplatform.policy import load_policy

    long = "1234+5678=6912 " * 3  # 45 tokens: whole blocks of the prefix cache
    prompts = _ids(engine, [long, "12+34=", "5+5=", "123+4="])
    batch = engine.decode_batch(max_new_tokens=10, temperature=0.0)
    finished = {}
    try:
        batch.add(prompts, keys=[0, 1, 2, 3])
        for _ in range(3):
            finished.update(batch.step())
        running = dict(batch.rows)  # request id -> row
        aborted = []
        abort = engine.llm.llm_engine.abort_request
        engine.llm.llm_engine.abort_request = lambda ids, *a, **k: (aborted.extend(ids), abort(ids, *a, **k))
        engine.load_weights(_model(vllm_policy, scale=0.2).state_dict(), version=1)
        assert batch.rows == running  # the same requests, under the same ids, still running
        while batch:
            finished.update(batch.step())
        engine.llm.llm_engine.abort_request = abort
        after = engine.generate(prompts[:1], 1, 10, temperature=0.0)[0][0]
    finally:
        engine.load_weights(load_policy(vllm_policy)[0].state_dict(), version=0)
    assert aborted == [] and sorted(finished) == [0, 1, 2, 3]  # nothing dropped
    went_on = [finished[row.key] for row in running.values()]
    assert went_on and all(c.versions == [0, 0, 0] + [1] * (len(c.versions) - 3) for c in went_on)
    assert 0 in {row.key for row in running.values()}
    # a prompt seen under version 0 (its blocks in the prefix cache) decodes after the update as the new model does
    assert after.completion_ids == _greedy(_model(vllm_policy, scale=0.2), after.prompt_ids)


def test_rows_keep_their_own_length_limit_and_temperature(engine, vllm_policy):
    """What the OpenAI bridge asks of a batch: per-request `max_tokens` and `temperature`."""
    from rlplatform.learners.batching import completion_logprobs

    prompt = _ids(engine, ["12+34="])
    batch = engine.decode_batch(max_new_tokens=8, temperature=0.0)
    batch.add(prompt, keys=["short"], max_new_tokens=2)
    batch.add(prompt, keys=["greedy"])
    batch.add(prompt * 2, keys=["hot0", "hot1"], temperature=1.7)
    finished = {}
    while batch:
        finished.update(batch.step())
    short, greedy = finished["short"].completion_ids, finished["greedy"].completion_ids
    assert len(short) <= 2 and short == greedy[:len(short)] and len(greedy) > 2
    hot = [finished["hot0"], finished["hot1"]]
    scores = completion_logprobs(_model(vllm_policy), [c.prompt_ids for c in hot], [c.completion_ids for c in hot],
                                 pad_id=0, temperature=1.7)
    for c, row, mask in zip(hot, scores.logprobs, scores.mask):
        torch.testing.assert_close(torch.tensor(c.logprobs), row[mask.bool()].cpu(), atol=2e-3, rtol=0)


def test_canary_scores_are_the_learners_and_leave_running_requests_whole(engine, vllm_policy):
    """`score` (the parity canary) while a batch decodes: the learner's teacher-forced log-probs, and every
    request of the batch still finishes, as greedy decoding without the interruption does."""
    from rlplatform.learners.batching import completion_logprobs

    prompts = _ids(engine, ["12+34=", "5+5="])
    alone = engine.generate(prompts, 1, 8, temperature=0.0)
    batch = engine.decode_batch(max_new_tokens=8, temperature=0.0)
    batch.add(prompts, keys=[0, 1])
    assert batch.step() == []
    first, scored = [ids[:1] for ids in prompts], [ids[1:] for ids in prompts]
    scores = engine.score(first, scored)
    finished = {}
    while batch:
        finished.update(batch.step())
    assert [finished[k].completion_ids for k in (0, 1)] == [group[0].completion_ids for group in alone]
    expected = completion_logprobs(_model(vllm_policy), first, scored, pad_id=0)
    for got, row, mask in zip(scores, expected.logprobs, expected.mask):
        torch.testing.assert_close(torch.tensor(got), row[mask.bool()].cpu(), atol=2e-3, rtol=0)


def test_weight_deltas_load_into_vllm_as_the_full_weights_do(engine, vllm_policy):
    """With deltas on, a delta update loads the weights it changes; generation then matches a full load."""
    from rlplatform.policy import load_policy
    from rlplatform.transport.weight_deltas import DeltaEncoder

    encoder = DeltaEncoder(full_every=100)
    engine.served = {}  # what `deltas=True` sets up: one vLLM instance per module, so this one is reused
    try:
        engine.load_weights(encoder.encode(_model(vllm_policy).state_dict(), 0), version=0)
        engine.load_weights(encoder.encode(_model(vllm_policy, scale=0.2).state_dict(), 1), version=1)
        prompt = _ids(engine, ["12+34="])
        got = engine.generate(prompt, 1, 10, temperature=0.0)[0][0]
    finally:
        engine.served = None
        engine.load_weights(load_policy(vllm_policy)[0].state_dict(), version=0)
    assert got.completion_ids == _greedy(_model(vllm_policy, scale=0.2), prompt[0])


def test_a_head_size_vllms_cpu_attention_cannot_take_is_refused_in_one_line():
    if torch.cuda.is_available():
        pytest.skip("vLLM's CUDA kernels take this head size")
    overrides = ["rollout.engine=vllm", "model.hidden_size=64", "model.num_heads=4"]  # head size 16
    with pytest.raises(ConfigError) as err:
        check_engines(load_config(overrides=overrides), "job.yaml")
    assert str(err.value).startswith("job.yaml: 'rollout.engine' is vllm on the CPU, whose attention takes head "
                                     "sizes [32, 64") and "the model's is 16" in str(err.value)
    assert "\n" not in str(err.value)
    check_engines(load_config(overrides=["rollout.engine=vllm"]), "job.yaml")  # the quickstart's: head size 32


def test_a_temperature_vllm_cannot_sample_at_is_refused_in_one_line():
    with pytest.raises(ConfigError) as err:
        check_engines(load_config(overrides=["rollout.engine=vllm", "rl.temperature=2.5"]), "job.yaml")
    assert str(err.value) == ("job.yaml: 'rl.temperature' is 2.5 but 'rollout.engine' is vllm, which samples at "
                              "temperatures up to 2; lower it or use rollout.engine: transformers")


@pytest.fixture(scope="module")
def moe_policy(tmp_path_factory):
    """A mixture of 4 experts a layer, top 2, head size 32."""
    from rlplatform.policy import save_initial_policy

    return save_initial_policy(ModelConfig(hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=2,
                                           intermediate_size=128, num_experts=4, expert_size=32), 0,
                               str(tmp_path_factory.mktemp("moe_policy")))


def test_updates_reach_vllm_in_the_checkpoints_form_a_mixture_of_experts_fused_in_memory(moe_policy):
    """Transformers holds each layer's experts as two fused tensors; vLLM loads them under the per-expert names
    of the checkpoint files, and passes over names it does not know."""
    from safetensors import safe_open

    from rlplatform.actors.vllm_engine import CheckpointForm
    from rlplatform.policy import load_policy

    state = load_policy(moe_policy)[0].state_dict()
    assert "model.layers.0.mlp.experts.gate_up_proj" in state
    form = CheckpointForm(moe_policy).of(state)
    with safe_open(f"{moe_policy}/model.safetensors", "pt") as saved:
        assert set(form) == set(saved.keys()) | {"lm_head.weight"}  # the tied head under its alias too
        for name in saved.keys():
            torch.testing.assert_close(form[name], saved.get_tensor(name), atol=0, rtol=0)


MOE_SCORES = """
import json, sys, torch
from rlplatform.actors.vllm_engine import VLLMEngine
from rlplatform.learners.batching import completion_logprobs
from rlplatform.policy import load_policy
engine = VLLMEngine(sys.argv[1], "float32", None, seed=0)
prompts, completions = [engine.tokenizer("12+34=")["input_ids"]], [[5, 6, 7, 8]]
model = load_policy(sys.argv[1])[0]
def learner():
    scored = completion_logprobs(model, prompts, completions, pad_id=0)
    return scored.logprobs[scored.mask.bool()].tolist()
found = {"learner": learner(), "served": engine.score(prompts, completions)[0]}
engine.load_weights(model.state_dict(), version=1)  # the same weights again
found["same_again"] = engine.score(prompts, completions)[0]
torch.manual_seed(0)
with torch.no_grad():  # every weight moved, the experts' too
    for param in model.parameters():
        param.add_(torch.randn_like(param) * 0.05)
engine.load_weights(model.state_dict(), version=2)
found["learner_moved"], found["served_moved"] = learner(), engine.score(prompts, completions)[0]
print(json.dumps(found))
"""


def test_vllms_cpu_build_serves_a_mixture_of_experts_as_the_learner_scores_it_after_each_update(moe_policy):
    """vLLM's CPU build scores an MoE as the learner does: as it started, after an update with the same weights, and
    after one that moved every weight. (vLLM 0.32 reloads the experts in the checkpoint's layout into tensors its
    CPU kernel reads packed: `vllm_weights.repack_cpu_experts` packs them again; without it the scores move by 0.015
    on the same weights.) Its own process: vLLM sets up its parallel groups once per process, for the first model's
    kind. A job asks routing replay off, as that build records no routing."""
    if torch.cuda.is_available():
        pytest.skip("vLLM's CPU build")
    run = subprocess.run([sys.executable, "-c", MOE_SCORES, moe_policy], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    found = json.loads(run.stdout.splitlines()[-1])
    assert found["served"] == pytest.approx(found["learner"], abs=1e-4)
    assert found["same_again"] == pytest.approx(found["learner"], abs=1e-4)
    assert found["learner_moved"] != pytest.approx(found["learner"], abs=1e-2)  # the update changed the scores
    assert found["served_moved"] == pytest.approx(found["learner_moved"], abs=1e-4)
    moe = ["rollout.engine=vllm", "model.num_heads=2", "model.num_experts=4"]
    with pytest.raises(ConfigError) as err:
        check_engines(load_config(overrides=moe), "job.yaml")
    assert str(err.value).startswith("job.yaml: 'rl.routing_replay' is true but 'rollout.engine' is vllm on the CPU, "
                                     "whose build cannot return the experts") and "\n" not in str(err.value)
    check_engines(load_config(overrides=[*moe, "rl.routing_replay=false"]), "job.yaml")


MOE_ROUTING = """
import json, sys, torch
from rlplatform.actors.vllm_engine import VLLMEngine
from rlplatform.policy import load_policy, routers
from rlplatform.transport.routed_experts import decode_routing
engine = VLLMEngine(sys.argv[1], "bfloat16", 0.3, seed=0)
model = load_policy(sys.argv[1])[0].cuda()
chosen = []
hooks = [router.register_forward_hook(lambda m, a, o: chosen.append(o[2])) for router in routers(model)]
agreed = total = 0
for c in [c for group in engine.generate([engine.tokenizer("12+34=")["input_ids"]], 4, 8, 1.0) for c in group]:
    sequence = c.prompt_ids + c.completion_ids
    recorded = decode_routing(c.routed_experts, 2, 2, 4)
    assert len(recorded) == len(sequence) - 1, (len(recorded), len(sequence))
    chosen.clear()
    with torch.no_grad():
        model(torch.tensor([sequence[:-1]], device="cuda"))
    own = torch.stack(chosen, dim=1).cpu()
    agreed += int((own.sort(-1).values == recorded.sort(-1).values).all(-1).sum())
    total += own.shape[0] * own.shape[1]
print(json.dumps(agreed / total))
"""


@pytest.mark.gpu
def test_vllm_returns_the_experts_of_every_token_it_computed(moe_policy):
    """On a GPU, vLLM (its V2 model runner) returns each request's routed experts: one (layers, k) row per token
    it computed, mostly the experts the learner's routers choose for the same tokens (bfloat16 kernels may part at
    near-ties; that gap is what routing replay closes)."""
    run = subprocess.run([sys.executable, "-c", MOE_ROUTING, moe_policy], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert json.loads(run.stdout.splitlines()[-1]) > 0.8

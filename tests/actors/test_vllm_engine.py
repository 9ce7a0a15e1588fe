"""The vLLM rollout engine: on CPU machines, the one-line refusal; on a GPU (`gpu` marker), the
engine's log-probs against the learner's, stopping on every EOS id, in-flight weight updates, the parity
canary's scores while a batch decodes, and weight deltas."""

from __future__ import annotations

import pytest
import torch

from rlplatform.actors.engine import build_engine
from rlplatform.config import ConfigError, ModelConfig, RolloutConfig, load_config
from rlplatform.preflight import check_engines


def test_vllm_engine_where_it_cannot_run_is_refused_in_one_line(tiny_policy):
    if torch.cuda.is_available():
        pytest.skip("this machine can run vLLM's requirements check past CUDA")
    with pytest.raises(RuntimeError) as err:
        build_engine(RolloutConfig(engine="vllm"), tiny_policy, "float32", seed=0)
    assert "rollout.engine: vllm needs a CUDA GPU" in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(ConfigError) as err:
        check_engines(load_config(overrides=["rollout.engine=vllm"]), "job.yaml")
    assert str(err.value).startswith("job.yaml: 'rollout.engine' is vllm") and "\n" not in str(err.value)
    check_engines(load_config(), "job.yaml")  # the transformers engine needs neither


@pytest.fixture(scope="module")
def vllm_policy(tmp_path_factory):
    """A random policy whose head size (64) vLLM's attention kernels take."""
    from rlplatform.policy import save_initial_policy

    path = tmp_path_factory.mktemp("vllm_policy")
    return save_initial_policy(ModelConfig(hidden_size=128, num_layers=2, num_heads=2, num_kv_heads=2,
                                           intermediate_size=256), 0, str(path))


@pytest.fixture(scope="module")
def engine(vllm_policy):
    pytest.importorskip("vllm")
    from rlplatform.actors.vllm_engine import VLLMEngine
    from rlplatform.policy import load_policy

    engine = VLLMEngine(vllm_policy, "float32", gpu_memory_utilization=0.3, seed=0)
    engine.load_weights(load_policy(vllm_policy)[0].state_dict(), version=0)
    return engine


def _ids(engine, prompts):
    return [engine.tokenizer(p)["input_ids"] for p in prompts]


def _model(path: str, scale: float = 0.0):
    from rlplatform.policy import load_policy

    model = load_policy(path)[0].cuda()
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(scale * torch.randn(param.shape, generator=generator).cuda())
    return model


@pytest.mark.gpu
def test_vllm_logprobs_are_the_learners_at_the_sampling_temperature(engine, vllm_policy):
    from rlplatform.learners.batching import completion_logprobs

    groups = engine.generate(_ids(engine, ["12+34=", "5+5=", "7="]), 2, 8, temperature=0.7)
    completions = [c for group in groups for c in group]
    assert all(c.versions == [0] * len(c.completion_ids) for c in completions)
    scores = completion_logprobs(_model(vllm_policy), [c.prompt_ids for c in completions],
                                 [c.completion_ids for c in completions], pad_id=0, temperature=0.7)
    for c, row, mask in zip(completions, scores.logprobs, scores.mask):
        torch.testing.assert_close(torch.tensor(c.logprobs), row[mask.bool()].cpu(), atol=2e-3, rtol=0)


@pytest.mark.gpu
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


@pytest.mark.gpu
def test_in_flight_update_keeps_running_requests_and_labels_each_token(engine, vllm_policy):
    from rlplatform.policy import load_policy

    batch = engine.decode_batch(max_new_tokens=10, temperature=0.0)
    try:
        batch.add(_ids(engine, ["12+34=", "5+5=", "7=", "123+4="]), keys=[0, 1, 2, 3])
        for _ in range(3):
            assert batch.step() == []
        new_weights = _model(vllm_policy, scale=0.05).state_dict()
        engine.load_weights(new_weights, version=1)
        finished = {}
        while batch:
            finished.update(batch.step())
        after = engine.generate(_ids(engine, ["12+34="]), 1, 10, temperature=0.0)[0][0]
    finally:
        engine.load_weights(load_policy(vllm_policy)[0].state_dict(), version=0)
    assert sorted(finished) == [0, 1, 2, 3]  # nothing dropped
    for completion in finished.values():
        assert completion.versions[:3] == [0, 0, 0] and all(v == 1 for v in completion.versions[3:])
    assert any(len(c.versions) > 3 for c in finished.values())
    # a new request after the update reads no KV cached under the old weights: it decodes as the new model does
    reference = _model(vllm_policy, scale=0.05).generate(torch.tensor([after.prompt_ids]).cuda(), max_new_tokens=10,
                                                         do_sample=False)
    assert after.completion_ids == reference[0, len(after.prompt_ids):].tolist()


@pytest.mark.gpu
def test_rows_keep_their_own_length_limit_and_temperature(engine, vllm_policy):
    """What the OpenAI bridge asks of a batch: per-request `max_tokens` and `temperature`."""
    from rlplatform.learners.batching import completion_logprobs

    prompt = _ids(engine, ["12+34="])
    batch = engine.decode_batch(max_new_tokens=8, temperature=0.0)
    batch.add(prompt, keys=["short"], max_new_tokens=2)
    batch.add(prompt, keys=["greedy"])
    batch.add(prompt * 2, keys=["hot0", "hot1"], temperature=3.0)
    finished = {}
    while batch:
        finished.update(batch.step())
    short, greedy = finished["short"].completion_ids, finished["greedy"].completion_ids
    assert len(short) <= 2 and short == greedy[:len(short)] and len(greedy) > 2
    hot = [finished["hot0"], finished["hot1"]]
    scores = completion_logprobs(_model(vllm_policy), [c.prompt_ids for c in hot], [c.completion_ids for c in hot],
                                 pad_id=0, temperature=3.0)
    for c, row, mask in zip(hot, scores.logprobs, scores.mask):
        torch.testing.assert_close(torch.tensor(c.logprobs), row[mask.bool()].cpu(), atol=2e-3, rtol=0)


@pytest.mark.gpu
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


@pytest.mark.gpu
def test_weight_deltas_load_into_vllm_as_the_full_weights_do(engine, vllm_policy):
    """With deltas on, a delta update loads the weights it changes; generation then matches a full load."""
    from rlplatform.policy import load_policy
    from rlplatform.transport.weight_deltas import DeltaEncoder

    encoder = DeltaEncoder(full_every=100)
    engine.served = {}  # what `deltas=True` sets up: one vLLM instance per process, so the module's is reused
    try:
        engine.load_weights(encoder.encode(_model(vllm_policy).state_dict(), 0), version=0)
        engine.load_weights(encoder.encode(_model(vllm_policy, scale=0.05).state_dict(), 1), version=1)
        prompt = _ids(engine, ["12+34="])
        got = engine.generate(prompt, 1, 10, temperature=0.0)[0][0]
    finally:
        engine.served = None
        engine.load_weights(load_policy(vllm_policy)[0].state_dict(), version=0)
    reference = _model(vllm_policy, scale=0.05).generate(torch.tensor(prompt).cuda(), max_new_tokens=10,
                                                         do_sample=False)
    assert got.completion_ids == reference[0, len(prompt[0]):].tolist()

"""Weight streaming: a rollout worker that receives version v+1 generates with the new weights."""

from __future__ import annotations

import threading
import time

import pytest
import ray
import torch

from rlplatform.actors.engine import TransformersEngine
from rlplatform.actors import rollout as rollout_module
from rlplatform.actors.rollout import RolloutActor, RolloutWorker
from rlplatform.actors.rollout_spec import RolloutSpec
from rlplatform.config import RLConfig, RolloutConfig
from rlplatform.learners.batching import completion_logprobs
from rlplatform.policy import load_policy, load_tokenizer
from rlplatform.tokenization import encode_prompts, save_prompts
from rlplatform.transport.keys import PolicyKeys
from rlplatform.transport.reward_queue import RewardQueue
from rlplatform.transport.rollout_counters import RolloutCounterHash
from rlplatform.transport.samples import decode_sample
from rlplatform.transport.weight_store import WeightStoreActor
from rlplatform.transport.versions import publish_version
from rlplatform.transport.weight_transports import ObjectStoreTransport
from rlplatform.transport.weights import to_snapshot

ROWS = [{"prompt": "12+34=", "answer": "46"}, {"prompt": "5+5=", "answer": "10"}]


def logprobs_under(model, samples) -> list:
    """Log-probs of each sample's completion tokens under `model`, recomputed from scratch."""
    with torch.no_grad():
        scores = completion_logprobs(model, [s.prompt_ids for s in samples],
                                     [s.completion_ids for s in samples], pad_id=0)
    return [row[m.bool()].tolist() for row, m in zip(scores.logprobs, scores.mask)]


def perturbed(policy_path: str, seed: int):
    model, _ = load_policy(policy_path)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.05 * torch.randn(param.shape, generator=generator))
    return model


def collect(queue: RewardQueue, n: int, timeout_s: float = 60.0) -> list:
    """The next `n` samples the rollout worker submits."""
    samples, deadline = [], time.time() + timeout_s
    while len(samples) < n and time.time() < deadline:
        samples += [decode_sample(raw) for _, raw in queue.fetch("test", n - len(samples), block_ms=200)]
    return samples


def test_worker_generates_with_each_new_version(ray_session, redis_server, redis_client, tiny_policy, tmp_path,
                                               capfd):
    job = f"stream-test-{time.time_ns()}"
    queue = RewardQueue(redis_client, job)
    queue.create_group()
    store = WeightStoreActor.options(name=f"{job}-weights").remote()
    rl = RLConfig(group_size=2, max_new_tokens=4, batch_prompts=2, max_staleness=0)
    prompts = save_prompts(encode_prompts(load_tokenizer(tiny_policy), ROWS, "auto"), str(tmp_path / "prompts.jsonl"))
    worker = RolloutActor.options(max_restarts=1).remote(RolloutSpec(
        0, "policy", job, tiny_policy, prompts, redis_url=redis_server, rl=rl,
        rollout=RolloutConfig(prompts_per_batch=2, weight_swap="finish_then_swap"), weight_store=f"{job}-weights",
            dtype="float32", transport=ObjectStoreTransport()))
    running = worker.run.remote()
    try:
        # synchronous gate: version 1 may start (1 + 1) * 2 groups in all, version 2 two more
        for version, seed, groups in ((1, 1, 4), (2, 2, 2)):
            model = perturbed(tiny_policy, seed)
            ray.get(store.publish.remote(version, [ray.put(to_snapshot(model.state_dict()))]))
            redis_client.set(PolicyKeys(job, "policy").version, version)
            samples = collect(queue, 2 * groups)
            assert len(samples) == 2 * groups
            assert all(s.token_versions == [version] * len(s.completion_ids) for s in samples)
            expected = logprobs_under(model, samples)
            stale = logprobs_under(load_policy(tiny_policy)[0], samples)
            for sample, new, old in zip(samples, expected, stale):
                assert torch.allclose(torch.tensor(sample.behaviour_logprobs), torch.tensor(new), atol=1e-4)
                assert not torch.allclose(torch.tensor(sample.behaviour_logprobs), torch.tensor(old), atol=1e-3)
        assert collect(queue, 1, timeout_s=1.0) == []  # and nothing past the gate
    finally:
        queue.request_stop()
        ray.get(running, timeout=30)
        ray.kill(worker)
        ray.kill(store)
    counters = RolloutCounterHash(queue.client, PolicyKeys(job, "policy").rollout_stats).read()
    assert counters.samples == 12 and counters.weight_syncs == 2
    # restartable, and nothing a restart could lose: no constructor argument in the object store
    assert "constructor arguments in the object store" not in capfd.readouterr().err


def test_an_idle_worker_loads_new_weights_as_they_are_published(ray_session, redis_server, redis_client, tiny_policy,
                                                               tmp_path, monkeypatch):
    monkeypatch.setattr(rollout_module, "IDLE_WAIT_S", 120.0)  # were it polling while idle, it would find them after this
    job = f"idle-test-{time.time_ns()}"
    queue, keys = RewardQueue(redis_client, job), PolicyKeys(job, "policy")
    queue.create_group()
    store = WeightStoreActor.options(name=f"{job}-weights").remote()
    rl = RLConfig(group_size=2, max_new_tokens=4, batch_prompts=1, max_staleness=0)
    prompts = save_prompts(encode_prompts(load_tokenizer(tiny_policy), ROWS, "auto"), str(tmp_path / "prompts.jsonl"))
    worker = RolloutWorker(RolloutSpec(0, "policy", job, tiny_policy, prompts, redis_url=redis_server, rl=rl,
                                       rollout=RolloutConfig(prompts_per_batch=1), weight_store=f"{job}-weights",
                                       dtype="float32", transport=ObjectStoreTransport()))
    loop = threading.Thread(target=worker.run, daemon=True)
    waiting = threading.Event()  # set while the worker, with nothing to decode, waits for new weights
    await_weights = worker._await_weights

    def awaiting(timeout_s: float) -> None:
        waiting.set()
        try:
            await_weights(timeout_s)
        finally:
            waiting.clear()

    worker._await_weights = awaiting

    def publish(version: int) -> None:
        ray.get(store.publish.remote(version, [ray.put(to_snapshot(perturbed(tiny_policy, version).state_dict()))]))
        publish_version(redis_client, keys, version)

    loop.start()
    try:
        publish(1)
        assert len(collect(queue, 4)) == 4  # the 2 groups the synchronous gate allows version 1, then it waits
        deadline = time.monotonic() + 30
        while not waiting.is_set():
            assert time.monotonic() < deadline, "the worker never went idle"
            time.sleep(0.01)
        publish(2)
        deadline = time.monotonic() + 30
        while worker.version != 2:
            assert time.monotonic() < deadline, "the idle worker did not load the weights published"
            time.sleep(0.05)
        assert {tuple(s.token_versions) for s in collect(queue, 2)} == {(2,) * 4}
    finally:
        queue.request_stop()
        publish_version(redis_client, keys, 3)  # wakes it to see the stop
        loop.join(timeout=60)
        ray.kill(store)
    assert not loop.is_alive()


def test_in_flight_swap_changes_version_mid_sequence_without_dropping_any(tiny_policy):
    engine = TransformersEngine(tiny_policy)
    original = {k: v.clone() for k, v in engine.model.state_dict().items()}
    engine.load_weights(original, version=0)
    new_weights = perturbed(tiny_policy, seed=3).state_dict()
    steps = []

    def swap_after_two_steps():
        steps.append(len(steps))
        if len(steps) == 2:
            engine.load_weights(new_weights, version=1)

    torch.manual_seed(0)
    prompts = engine.tokenizer(["12+34=", "5+5="])["input_ids"]
    groups = engine.generate(prompts, 4, 5, 0.0, between_steps=swap_after_two_steps)
    completions = [c for g in groups for c in g]
    assert len(completions) == 8  # every sequence in progress finished
    for c in completions:
        # greedy, no EOS from an untrained model: tokens 1-2 come from version 0, the rest from version 1
        assert c.versions == [0, 0, 1, 1, 1][:len(c.completion_ids)]
    # the tokens before the swap score exactly as the original weights score them from scratch
    old_model = load_policy(tiny_policy)[0]
    samples = [type("S", (), {"prompt_ids": c.prompt_ids, "completion_ids": c.completion_ids}) for c in completions]
    for c, old in zip(completions, logprobs_under(old_model, samples)):
        assert torch.allclose(torch.tensor(c.logprobs[:2]), torch.tensor(old[:2]), atol=1e-4)


def test_finish_then_swap_keeps_one_version_per_batch(tiny_policy):
    engine = TransformersEngine(tiny_policy)
    engine.load_weights({k: v.clone() for k, v in engine.model.state_dict().items()}, version=7)
    groups = engine.generate(engine.tokenizer(["12+34="])["input_ids"], 3, 4, 1.0)
    assert all(c.versions == [7] * len(c.completion_ids) for c in groups[0])


def test_snapshot_holds_tied_weights_once_and_loading_restores_them(tiny_policy):
    from rlplatform.transport.weights import from_snapshot, load_weights

    trained = perturbed(tiny_policy, seed=4)
    assert trained.lm_head.weight is trained.model.embed_tokens.weight  # the demo policy ties its head
    snapshot = to_snapshot(trained.state_dict())
    assert "lm_head.weight" not in snapshot and "model.embed_tokens.weight" in snapshot
    engine = TransformersEngine(tiny_policy)
    engine.load_weights(from_snapshot(snapshot), version=1)
    for name, tensor in trained.state_dict().items():
        assert torch.equal(engine.model.state_dict()[name], tensor), name
    incomplete = {k: v for k, v in from_snapshot(snapshot).items() if k != "model.norm.weight"}
    with pytest.raises(ValueError, match="model.norm.weight"):
        load_weights(engine.model, incomplete)

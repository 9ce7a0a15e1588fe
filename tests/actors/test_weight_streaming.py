"""Weight streaming: a rollout worker that receives version v+1 generates with the new weights."""

from __future__ import annotations

import ray
import torch

from rlplatform.actors.rollout import RolloutActor
from rlplatform.config import RLConfig, RolloutConfig
from rlplatform.learners.batching import completion_logprobs
from rlplatform.policy import load_policy
from rlplatform.reward_queue import RewardQueue
from rlplatform.weights import WeightStore, to_snapshot

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


def test_worker_generates_with_each_new_version(ray_session, redis_server, redis_client, tiny_policy):
    store = WeightStore.remote()
    worker = RolloutActor.remote(0, "policy", tiny_policy, ROWS, RLConfig(group_size=2, max_new_tokens=4),
                                 RolloutConfig(), redis_server, "stream-test", store, 0)
    queue = RewardQueue(redis_client, "stream-test")
    try:
        for version, seed in ((1, 1), (2, 2)):
            model = perturbed(tiny_policy, seed)
            ray.get(store.publish.remote(version, [ray.put(to_snapshot(model.state_dict()))]))
            redis_client.set(queue.keys.version, version)
            assert ray.get(worker.sync_weights.remote()) == version
            samples = ray.get(worker.generate_groups.remote(ROWS, f"v{version}"))
            assert all(s.token_versions == [version] * len(s.completion_ids) for s in samples)
            expected = logprobs_under(model, samples)
            stale = logprobs_under(load_policy(tiny_policy)[0], samples)
            for sample, new, old in zip(samples, expected, stale):
                assert torch.allclose(torch.tensor(sample.behaviour_logprobs), torch.tensor(new), atol=1e-4)
                assert not torch.allclose(torch.tensor(sample.behaviour_logprobs), torch.tensor(old), atol=1e-3)
    finally:
        ray.kill(worker)
        ray.kill(store)

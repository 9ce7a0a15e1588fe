"""Weight broadcast on CPU (gloo): the same code that runs on NCCL between a GPU learner and vLLM
engines. Real Ray actors: a DeepSpeed learner rank sends, a rollout worker and a probe receive; with
`model.lora` what flows is the adapters alone, under peft names, which the worker's engine loads."""

from __future__ import annotations

import time

import numpy as np
import pytest
import ray
import torch

from rlplatform.config import LearnerConfig, LoraConfig, RLConfig, RolloutConfig
from rlplatform.learners.group import LearnerGroup
from rlplatform.tokenization import save_prompts
from rlplatform.transport.broadcast import ALIGN, inbox, plan_buckets
from rlplatform.transport.keys import PolicyKeys
from rlplatform.transport.weight_transports import BroadcastTransport

TRANSPORT = BroadcastTransport(bucket_mb=0.02)  # about 20 KB: the tiny policy's weights need several buckets
LORA = LoraConfig(enabled=True, rank=2, alpha=4.0, target_modules=["q_proj", "v_proj"])


def test_buckets_hold_every_weight_aligned_and_within_the_bound():
    state = {"a": torch.zeros(3, dtype=torch.bfloat16), "b": torch.zeros(100), "c": torch.zeros(5000),
             "d": torch.zeros(7, dtype=torch.int64), "e": torch.zeros(2, 2)}
    entries = plan_buckets(state, bucket_bytes=1024)
    assert [e.name for e in entries] == list(state)
    assert all(e.offset % ALIGN == 0 and e.nbytes == state[e.name].numel() * state[e.name].element_size()
               for e in entries)
    for bucket in {e.bucket for e in entries}:
        members = sorted((e for e in entries if e.bucket == bucket), key=lambda e: e.offset)
        assert all(a.offset + a.nbytes <= b.offset for a, b in zip(members, members[1:]))  # no overlap
        assert len(members) == 1 or members[-1].offset + members[-1].nbytes <= 1024  # only a lone weight exceeds
    assert [e.bucket for e in entries] == [0, 0, 1, 2, 2]  # c (20 KB) alone, in order


@ray.remote(num_cpus=0)
class Probe:
    """A bare receiving end of the group, reporting what it holds."""

    def join_weights(self, *args, **kwargs):
        self.receiver = TRANSPORT.receiver(None, torch.device("cpu"))
        self.receiver.join(*args, **kwargs)

    def take(self):
        return self.receiver.receiver.take()


@pytest.mark.parametrize("lora", [None, LORA], ids=["full", "lora"])
def test_learner_broadcasts_each_version_to_every_worker_exactly(ray_session, redis_server, redis_client,
                                                                  tiny_policy, tmp_path, lora):
    from rlplatform.actors.rollout import RolloutActor
    from rlplatform.actors.rollout_spec import RolloutSpec

    job = f"broadcast-test-{time.time_ns()}"
    keys = PolicyKeys(job, "policy")
    worker = RolloutActor.options(num_cpus=0).remote(RolloutSpec(  # starts while the learner does
        0, "policy", job, tiny_policy, save_prompts([], str(tmp_path / "prompts.jsonl")), redis_url=redis_server,
        rl=RLConfig(),
        rollout=RolloutConfig(num_cpus=0), transport=TRANSPORT, lora=lora, dtype="float32"))
    learner = LearnerGroup(LearnerConfig(num_cpus=0), tiny_policy, seed=0, transport=TRANSPORT, lora=lora,
                           dtype="float32")
    probe = Probe.remote()
    try:
        TRANSPORT.connect(learner.ranks[0], [worker, probe], redis_server, keys.version, 120)
        learner.start_stage(lr=1e-2)
        expected = {}
        for version in (0, 1):
            assert learner.stream_weights(version) == version  # broadcast: the version comes back, no ref
            expected[version] = ray.get(learner.snapshot_weights())  # the same weights through the object store
            redis_client.set(keys.version, version)
            received = _wait_for(probe, version)
            assert sorted(received) == sorted(expected[version])  # every weight once (the tied head left out)
            assert all(np.array_equal(received[k].numpy(), a) for k, a in expected[version].items())
            assert lora is None or all(".lora_" in k for k in received)
            assert _wait_for_worker(worker, version) == version
            assert [redis_client.llen(inbox(keys.version, rank)) for rank in (1, 2)] == [0, 0]  # announcements taken
            if version == 0:
                _train_one_step(learner)
        assert any(not np.array_equal(expected[0][k], expected[1][k]) for k in expected[0])
    finally:
        for actor in (worker, probe):
            ray.kill(actor)
        learner.shutdown()


def _wait_for(probe, version: int, timeout_s: float = 30.0):
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        latest = ray.get(probe.take.remote())
        if latest is not None and latest[0] == version:
            return latest[1]
        time.sleep(0.05)
    raise AssertionError(f"version {version} never reached the probe")


def _wait_for_worker(worker, version: int, timeout_s: float = 30.0) -> int:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        held = ray.get(worker.sync_weights.remote())
        if held == version:
            return held
        time.sleep(0.05)
    return held


def _train_one_step(learner: LearnerGroup) -> None:
    rows = [{"prompt": "1+1=", "answer": "2"}, {"prompt": "2+3=", "answer": "5"}]
    learner.sft_step(rows)

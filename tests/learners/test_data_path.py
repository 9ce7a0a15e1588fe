"""The RL data path: the controller reads only results' metadata (no token ids) and hands the
learner sample ids with advantages; each learner rank fetches exactly its own shard from Redis
(seen with MONITOR on a real redis-server, per client connection)."""

from __future__ import annotations

import threading
import uuid
from collections import defaultdict
from dataclasses import asdict

from rlplatform.config import LearnerConfig, RLConfig
from rlplatform.learners.group import LearnerGroup, TrainItem, shard_minibatches
from rlplatform.transport.redis_server import RECONNECT_S, connect
from rlplatform.transport.reward_queue import RewardQueue
from rlplatform.transport.run_keys import start_run
from rlplatform.transport.samples import ScoredSample, decode_sample
from tests.learners.test_learner import rl_batch
from rlplatform.transport.weight_transports import ObjectStoreTransport


def store_scored(queue: RewardQueue, samples, advantages) -> None:
    """Submit the samples and store each as a reward worker does (reward = its advantage)."""
    queue.submit(samples)
    held = queue.fetch("reward-0", count=len(samples), block_ms=100)
    by_id = {s.sample_id: s for s in samples}
    scored = {s.sample_id: ScoredSample(s, a, {"given": a}) for s, a in zip(samples, advantages)}
    assert queue.store_results([(msg_id, scored[decode_sample(raw).sample_id]) for msg_id, raw in held]) == len(by_id)


def gets_by_connection(redis_url: str, run) -> dict:
    """Run `run()` while MONITOR records every GET; returns {client address: set of keys read}."""
    gets, stop = defaultdict(set), f"stop-{uuid.uuid4().hex}"
    client = connect(redis_url)
    monitor = client.monitor()
    monitor.__enter__()

    def record() -> None:
        for command in monitor.listen():
            if stop in command["command"]:
                return
            name, *args = command["command"].split(" ")
            if name.upper() == "GET":
                gets[f"{command['client_address']}:{command['client_port']}"].add(args[0])

    thread = threading.Thread(target=record)
    thread.start()
    try:
        run()
    finally:
        client.echo(stop)
        thread.join(timeout=30)
        monitor.__exit__()
    return gets


def test_ranks_fetch_their_own_shard_and_the_controller_reads_no_tokens(ray_session, redis_server, redis_client,
                                                                        tiny_policy):
    job = f"path-{uuid.uuid4().hex[:6]}"
    queue = RewardQueue(redis_client, job)
    start_run(queue.client, queue.keys.run, queue.bound())
    queue.create_group()
    samples, advantages = rl_batch(tiny_policy)
    store_scored(queue, samples, advantages)

    metas = queue.read_results(block_ms=100)  # what the controller reads
    assert sorted(m.sample_id for m in metas) == sorted(s.sample_id for s in samples)
    assert not any(isinstance(v, list) for m in metas for v in asdict(m).values())  # no token lists
    assert all(m.completion_tokens == len(s.completion_ids) for m, s in zip(metas, samples))
    batch = [TrainItem(m.sample_id, m.reward, m.tokens) for m in metas]

    learner = LearnerGroup(LearnerConfig(num_ranks=2, num_cpus=0.5), tiny_policy, seed=0,
                           dtype="float32", transport=ObjectStoreTransport())
    try:
        learner.start_stage(lr=1e-3)
        learner.connect_results(redis_server, job, RECONNECT_S, "policy-a")
        steps = []
        gets = gets_by_connection(redis_server, lambda: steps.append(
            LearnerGroup.gather(learner.rl_step_async(batch, RLConfig(), step=0))[0]))
    finally:
        learner.shutdown()

    shares = shard_minibatches(batch, 2, RLConfig().minibatches, [item.tokens for item in batch])
    assert all(shares)  # both ranks hold part of the batch
    expected = sorted(sorted(queue.results.key(item.sample_id) for item in share) for share in shares)
    assert sorted(sorted(keys) for keys in gets.values()) == expected  # one connection per rank, its shard only
    assert steps[0].tokens_total == sum(len(s.completion_ids) for s in samples)
    # rank 0 alone announced the step's end, which wakes the RL loop (`RewardQueue.await_results`)
    announced = [fields for _, fields in redis_client.xrange(queue.keys.learner_steps)]
    assert announced == [{b"policy": b"policy-a", b"step": b"0"}]


def test_minibatch_blocks_go_to_the_rank_holding_the_fewest_tokens():
    tokens = [40, 8, 8, 8, 8, 8, 8, 8]  # one long sample, then short ones
    shares = shard_minibatches(list(range(8)), ranks=2, minibatches=1, weights=tokens)
    assert shares == [[0, 6], [1, 2, 3, 4, 5, 7]]
    assert [sum(tokens[i] for i in share) for share in shares] == [48, 48]
    shares = shard_minibatches(list(range(8)), ranks=2, minibatches=2, weights=tokens)
    for j in range(2):  # blocks of 2: rank r's items j::2 together are still the batch's minibatch j
        assert sorted(shares[0][j::2] + shares[1][j::2]) == list(range(8))[j::2]

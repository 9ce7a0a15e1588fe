"""The Redis reward queue with an in-process RewardWorker (no Ray): scoring round trip,
dead letters, idempotent result storage, failing rewards, acknowledged requests, and the
producer bound every producer of a job honours."""

from __future__ import annotations

import threading
import time
import uuid

import msgpack
import pytest

from rlplatform.config import RewardSpec, RewardWorkersConfig
from rlplatform.rewards import REWARDS, register
from rlplatform.rewards.worker import RewardWorker
from rlplatform.transport.keys import PolicyKeys
from rlplatform.transport.redis_server import connect
from rlplatform.transport.reward_queue import GROUP, RewardQueue, announce_step_end
from rlplatform.transport.rollout_counters import RolloutCounterHash, RolloutCounters
from rlplatform.transport.run_keys import end_run, start_run
from rlplatform.transport.samples import Sample, ScoredSample, decode_sample
from tests.transport.queue_events import scripts_run, wait_for_refusals, wait_until


def make_sample(index: int, completion: str, answer: str = "85", group: str = "g0") -> Sample:
    return Sample(
        sample_id=f"{group}/{index}", group_id=group, policy="policy-a", prompt="37+48=",
        completion=completion, prompt_ids=[3, 7, 11, 4, 8, 12],
        completion_ids=[8 + index, 5], behaviour_logprobs=[-0.25 - index, -1.5], token_versions=[2, 3],
        row={"prompt": "37+48=", "answer": answer, "source": "addition"},
    )


@pytest.fixture
def job():
    return f"test-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def queue(redis_client, job):
    q = RewardQueue(redis_client, job)
    q.create_group()
    return q


def worker_for(redis_server, job, rewards=None, batch_size=64) -> RewardWorker:
    return RewardWorker("worker-0", rewards or [RewardSpec("exact_match")], redis_server, job,
                        RewardWorkersConfig(batch_size=batch_size))


def drain(worker: RewardWorker, rounds: int = 5) -> int:
    handled = 0
    for _ in range(rounds):
        n = worker.step(block_ms=50)
        handled += n
        if n == 0:
            break
    return handled


def read_all(queue: RewardQueue) -> list:
    results = []
    while True:
        batch = queue.read_results(block_ms=50)
        if not batch:
            return results
        results += batch


@pytest.fixture
def test_reward():
    """Registers rewards for one test and removes them afterwards."""
    added = []

    def add(name, fn):
        added.append(name)
        register(name, fn)

    yield add
    for name in added:
        REWARDS.pop(name, None)


def test_submitted_samples_come_back_scored(redis_server, redis_client, job, queue):
    right, wrong = make_sample(0, " 85 "), make_sample(1, "84")
    queue.submit([right, wrong])
    assert queue.pending() == 2

    worker = worker_for(redis_server, job)
    assert drain(worker) == 2
    assert worker.stats.scored == 2 and worker.stats.errors == 0 and worker.stats.dead_letters == 0

    # the controller reads the results' metadata through its own connection; the samples stay on Redis
    reader = RewardQueue(connect(redis_server), job)
    results = read_all(reader)
    by_id = {r.sample_id: r for r in results}
    assert sorted(by_id) == ["g0/0", "g0/1"]
    assert reader.results.fetch(["g0/0", "g0/1"]) == [right, wrong]  # every field intact, row included
    assert by_id["g0/0"].completion_tokens == len(right.completion_ids) and by_id["g0/0"].group_id == "g0"
    assert by_id["g0/0"].reward == 1.0 and by_id["g0/0"].components == {"exact_match": 1.0}
    assert by_id["g0/1"].reward == 0.0 and by_id["g0/1"].components == {"exact_match": 0.0}
    assert all(r.error is None for r in results)

    # acknowledged and deleted: nothing left on the requests stream, nothing pending in the group
    assert redis_client.xlen(queue.keys.requests) == 0
    assert queue.pending() == 0
    assert redis_client.xpending(queue.keys.requests, GROUP)["pending"] == 0


def test_results_are_read_once_in_order(redis_server, job, queue):
    worker = worker_for(redis_server, job, batch_size=2)
    samples = [make_sample(i, "85" if i % 2 == 0 else "0") for i in range(5)]
    queue.submit(samples)
    assert drain(worker) == 5
    reader = RewardQueue(connect(redis_server), job)
    first = reader.read_results(count=3, block_ms=50)
    rest = read_all(reader)
    assert [r.sample_id for r in first + rest] == [s.sample_id for s in samples]
    assert [r.reward for r in first + rest] == [1.0, 0.0, 1.0, 0.0, 1.0]
    assert reader.read_results(block_ms=10) == []


def test_what_a_stage_left_is_read_whole_while_a_worker_still_stores(redis_server, job, queue):
    """A reward worker the job does not wait for keeps moving samples from the requests to the results while the
    stage's end counts what it left: every sample is counted once, as a result or as unscored, at every read."""
    total = 300
    queue.submit([make_sample(i, "85", group=f"g{i}") for i in range(total)])
    worker = worker_for(redis_server, job, batch_size=1)
    mover = threading.Thread(target=drain, args=(worker, total + 5))
    mover.start()
    results_read, reads = 0, 0
    while mover.is_alive() or reads == 0:
        results, unscored = queue.left_at_end()
        results_read += len(results)
        reads += 1
        assert results_read + unscored["policy-a"] == total, reads
    mover.join()
    results, unscored = queue.left_at_end()
    assert (results_read + len(results), unscored["policy-a"], reads > 10) == (total, 0, True)


def test_awaiting_results_wakes_on_results_or_a_learner_steps_end(redis_server, redis_client, job, queue):
    reader = RewardQueue(connect(redis_server), job)
    assert reader.await_results(block_ms=10) == ([], set())  # neither came: back after the wait
    threading.Timer(0.2, announce_step_end, (redis_client, job, "policy-b", 7)).start()
    started = time.monotonic()
    results, stepped = reader.await_results(block_ms=30_000)
    assert (results, stepped) == ([], {"policy-b"}) and time.monotonic() - started < 15  # woken, not timed out
    queue.submit([make_sample(0, "85")])
    drain(worker_for(redis_server, job))
    announce_step_end(redis_client, job, "policy-a", 8)
    results, stepped = reader.await_results(block_ms=1000)  # both at once
    assert [r.sample_id for r in results] == ["g0/0"] and stepped == {"policy-a"}
    assert reader.await_results(block_ms=10) == ([], set())  # each read once


def test_a_learner_step_end_that_is_not_one_goes_to_the_dead_letters_and_the_others_still_wake(
        redis_server, redis_client, job, queue):
    reader = RewardQueue(connect(redis_server), job)
    redis_client.xadd(reader.keys.learner_steps, {"policy": "policy-a", "step": "eight"})
    announce_step_end(redis_client, job, "policy-b", 9)
    assert reader.await_results(block_ms=1000) == ([], {"policy-b"})
    (_, dead), = redis_client.xrange(reader.keys.dead)
    assert dead[b"policy"] == b"policy-a" and b"'step' is not an integer: 'eight'" in dead[b"reason"]


def test_rollout_counters_refuse_a_name_that_is_not_one_of_theirs(redis_client, job):
    counters = RolloutCounterHash(redis_client, PolicyKeys(job, "p").rollout_stats)
    counters.add(samples=2, busy_s=0.5)
    with pytest.raises(ValueError, match="not rollout counters: sampels"):
        counters.add(sampels=1)
    assert counters.read() == RolloutCounters(samples=2.0, busy_s=0.5)  # nothing of the refused call was added


def test_weighted_sum_of_rewards(redis_server, job, queue, test_reward):
    test_reward("test_constant_quarter", lambda sample: 0.25)
    specs = [RewardSpec("exact_match", weight=2.0), RewardSpec("test_constant_quarter", weight=-4.0)]
    queue.submit([make_sample(0, "85")])
    drain(worker_for(redis_server, job, specs))
    (result,) = read_all(queue)
    # 2.0 * 1.0 + (-4.0) * 0.25 = 1.0
    assert result.reward == pytest.approx(1.0)
    assert result.components == {"exact_match": 1.0, "test_constant_quarter": 0.25}


def test_malformed_message_goes_to_dead_letters(redis_server, redis_client, job, queue):
    redis_client.xadd(queue.keys.requests, {"data": b"\xc1 this is not msgpack"})
    redis_client.xadd(queue.keys.requests, {"data": msgpack.packb({"v": 99, "sample": {}})})
    redis_client.xadd(queue.keys.requests, {"other": b"no data field"})
    queue.submit([make_sample(0, "85")])

    worker = worker_for(redis_server, job)
    assert drain(worker) == 4  # the worker keeps going past the bad messages
    assert worker.stats.dead_letters == 3 and worker.stats.scored == 1

    dead = redis_client.xrange(queue.keys.dead)
    assert queue.dead_letters() == 3 and len(dead) == 3
    reasons = [fields[b"reason"].decode() for _, fields in dead]
    assert "not a msgpack record" in reasons[0]
    assert "schema version 99" in reasons[1]
    assert reasons[2]  # empty payload: still a reason
    assert dead[0][1][b"data"] == b"\xc1 this is not msgpack"
    assert all(fields[b"message_id"] for _, fields in dead)

    (result,) = read_all(queue)
    assert result.sample_id == "g0/0" and result.reward == 1.0
    assert redis_client.xlen(queue.keys.requests) == 0
    assert redis_client.xpending(queue.keys.requests, GROUP)["pending"] == 0

    # the worker still serves new requests afterwards
    queue.submit([make_sample(1, "7")])
    assert drain(worker) == 1
    (later,) = read_all(queue)
    assert later.sample_id == "g0/1" and later.reward == 0.0


def test_storing_the_same_result_twice_appends_once(redis_client, queue):
    sample = make_sample(0, "85")
    queue.submit([sample])
    ((msg_id, raw),) = queue.fetch("consumer-a", count=10, block_ms=50)
    scored = ScoredSample(decode_sample(raw), 1.0, {"exact_match": 1.0})
    assert queue.store_results([(msg_id, scored)]) == 1
    assert queue.store_results([(msg_id, scored)]) == 0
    assert redis_client.xlen(queue.keys.results) == 1

    # the same sample delivered again as a new message (producer retry) is stored once too
    queue.submit([sample])
    ((msg_id2, raw2),) = queue.fetch("consumer-b", count=10, block_ms=50)
    assert msg_id2 != msg_id
    assert queue.store_results([(msg_id2, ScoredSample(decode_sample(raw2), 1.0, {"exact_match": 1.0}))]) == 0
    assert redis_client.xlen(queue.keys.results) == 1
    assert redis_client.xlen(queue.keys.requests) == 0  # both requests acknowledged and deleted

    results = read_all(queue)
    assert len(results) == 1 and queue.results.fetch([results[0].sample_id]) == [sample]


def test_duplicate_requests_through_the_worker_give_one_result(redis_server, job, queue):
    sample = make_sample(0, "85")
    queue.submit([sample, sample])
    worker = worker_for(redis_server, job)
    assert drain(worker) == 2
    results = read_all(queue)
    assert [r.sample_id for r in results] == ["g0/0"]
    assert queue.pending() == 0


def test_raising_reward_yields_error_result(redis_server, job, queue, test_reward):
    def explode(sample):
        if sample.completion == "boom":
            raise RuntimeError("verifier crashed")
        return 0.5

    test_reward("test_explode", explode)
    specs = [RewardSpec("exact_match"), RewardSpec("test_explode")]
    queue.submit([make_sample(0, "boom"), make_sample(1, "85")])
    worker = worker_for(redis_server, job, specs)
    assert drain(worker) == 2
    assert worker.stats.errors == 1 and worker.stats.scored == 2

    by_id = {r.sample_id: r for r in read_all(queue)}
    failed, ok = by_id["g0/0"], by_id["g0/1"]
    assert failed.error is not None
    assert "test_explode" in failed.error and "RuntimeError" in failed.error and "verifier crashed" in failed.error
    assert failed.reward == 0.0
    assert queue.results.fetch(["g0/0"]) == [make_sample(0, "boom")]
    assert ok.error is None and ok.reward == pytest.approx(1.5)  # 1.0 * 1.0 + 1.0 * 0.5
    assert ok.components == {"exact_match": 1.0, "test_explode": 0.5}
    assert queue.pending() == 0


def test_stop_flag(redis_server, job, queue):
    worker = worker_for(redis_server, job)
    assert not queue.stop_requested()
    queue.request_stop()
    assert queue.stop_requested()
    stats = worker.run()  # returns at once: the stop flag is already set
    assert stats.scored == 0
    end_run(queue.client, job)  # the end of a job: standalone workers must still see the flag
    assert queue.stop_requested()
    start_run(queue.client, job, queue.bound())  # the run resumed
    assert not queue.stop_requested()


def test_producers_built_without_a_bound_wait_at_the_jobs_bound_until_a_consumer_acks(redis_server, job):
    controller = RewardQueue(connect(redis_server), job, max_pending=4)  # the job's redis.max_stream_len
    start_run(controller.client, job, controller.bound())  # records the bound on Redis
    controller.create_group()
    producer = RewardQueue(connect(redis_server), job)  # as a rollout worker builds it, no bound given
    producer.submit([make_sample(i, "85", group="a") for i in range(4)])
    blocked = threading.Thread(target=producer.submit, args=([make_sample(i, "85", group="b") for i in range(3)],))
    since = scripts_run(controller.client)
    blocked.start()
    wait_for_refusals(controller.client, blocked, since)
    assert blocked.is_alive() and controller.pending() == 4  # waiting at the bound, not growing past it
    worker = worker_for(redis_server, job, batch_size=2)
    assert worker.step(block_ms=50) == 2
    wait_for_refusals(controller.client, blocked, scripts_run(controller.client))
    assert blocked.is_alive() and controller.pending() == 2  # 2 + 3 would pass the bound: still waiting
    assert worker.step(block_ms=50) == 2
    blocked.join(timeout=5)
    assert not blocked.is_alive() and controller.pending() == 3
    scored = drain(worker) + 4
    assert scored == 7 and len(read_all(controller)) == 7


def test_submit_counts_samples_and_tokens_as_the_stream_takes_each_part(redis_server, job):
    queue = RewardQueue(connect(redis_server), job, max_pending=3)
    start_run(queue.client, job, queue.bound())
    queue.create_group()
    counters = RolloutCounterHash(queue.client, PolicyKeys(job, "p").rollout_stats)
    claims = f"{job}:claims"  # a ledger's claims: released with the last part, not before
    queue.client.hset(claims, mapping={"g0": 0, "g1": 0, "g9": 0})
    done = threading.Thread(target=queue.submit, args=([make_sample(i, "85") for i in range(5)], counters.key),
                            kwargs={"claims": (claims, ["g0", "g1"])})
    done.start()  # parts of 3 and 2: the second waits at the bound
    wait_until(lambda: counters.read().samples, "the first part counted")
    wait_for_refusals(queue.client, done, scripts_run(queue.client))  # the second part tried and refused: not counted
    assert counters.read() == RolloutCounters(samples=3.0, tokens=6.0)  # only what the stream holds
    assert queue.client.hlen(claims) == 3
    worker_for(redis_server, job, batch_size=3).step(block_ms=50)
    done.join(timeout=5)
    assert counters.read() == RolloutCounters(samples=5.0, tokens=10.0) and queue.pending() == 2
    assert queue.client.hkeys(claims) == [b"g9"]

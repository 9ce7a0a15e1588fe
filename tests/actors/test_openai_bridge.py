"""The OpenAI-compatible bridge, driven by the real `openai` client against a rollout worker's loop:
replies record the tokens, log-probs and versions sampled; an episode's turns are one trajectory whose
earlier replies are never re-tokenised, and its sample is counted with the worker's generated ones;
concurrent requests share the worker's decode batch."""

from __future__ import annotations

import json
import shutil
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
import torch

from rlplatform.actors.decode_batch import DecodeBatch
from rlplatform.actors.openai_bridge import OpenAIBridge
from rlplatform.actors.rollout import RolloutWorker
from rlplatform.actors.rollout_spec import RolloutSpec
from rlplatform.config import BRIDGE_KEY_ENV, MonitoringConfig, OpenAIBridgeConfig, RLConfig, RolloutConfig
from rlplatform.learners.batching import completion_logprobs
from rlplatform.policy import load_tokenizer
from rlplatform.tokenization import encode_prompts, save_prompts
from rlplatform.transport.reward_queue import RewardQueue
from rlplatform.transport.samples import decode_sample
from rlplatform.transport.weight_transports import ObjectStoreTransport

# a ChatML-like template in the demo tokenizer's characters: "u:" / "a:" open a turn, EOS ends it
TEMPLATE = ("{% for m in messages %}{{ m['role'][0] + ':' + m['content'] + eos_token }}{% endfor %}"
            "{% if add_generation_prompt %}a:{% endif %}")
VERSION = 3
KEY = "test-bridge-key"
AUTHORISED = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def chat_policy(tiny_policy, tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("chat") / "policy")
    shutil.copytree(tiny_policy, path)
    tokenizer = load_tokenizer(path)
    tokenizer.chat_template = TEMPLATE
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture
def served(chat_policy, redis_server, redis_client, tmp_path, monkeypatch, request):
    """(worker, endpoint URL, reward queue) of a rollout worker running its loop with the bridge on, asking
    for KEY and refusing prompts over 200 tokens, max_tokens over 16, n over 4, bodies over 64 KiB and more
    than 6 requests at once; its hang rule is the `MonitoringConfig` a test passes (indirectly), else the default."""
    job = f"bridge-{time.time_ns()}"
    queue = RewardQueue(redis_client, job)
    queue.create_group()
    monkeypatch.setenv(BRIDGE_KEY_ENV, KEY)
    rl = RLConfig(group_size=2, batch_prompts=1, max_staleness=0, max_new_tokens=4)
    limits = OpenAIBridgeConfig(enabled=True, port=0, max_prompt_tokens=200, max_tokens=16, max_n=4,
                                max_body_bytes=65536, max_requests=6)
    rollout = RolloutConfig(prompts_per_batch=2, openai_bridge=limits, source="bridge")  # it serves agents alone
    prompts = save_prompts(encode_prompts(load_tokenizer(chat_policy), [{"prompt": "1+1=", "answer": "2"}], "auto"),
                           str(tmp_path / "prompts.jsonl"))
    worker = RolloutWorker(RolloutSpec(0, "policy", job, chat_policy, prompts, redis_url=redis_server, rl=rl,
                                       rollout=rollout, dtype="float32", transport=ObjectStoreTransport(),
                                       monitoring=getattr(request, "param", MonitoringConfig())))
    worker.engine.load_weights({k: v.clone() for k, v in worker.engine.model.state_dict().items()}, VERSION)
    loop = threading.Thread(target=worker.run, daemon=True)
    loop.start()
    deadline = time.time() + 30
    while (url := redis_client.hget(queue.keys.status, "openai_bridge/policy/0")) is None:
        assert time.time() < deadline, "the endpoint never appeared in the job status"
        time.sleep(0.05)
    yield worker, url.decode(), queue
    queue.request_stop()
    loop.join(timeout=30)
    assert redis_client.hget(queue.keys.status, "openai_bridge/policy/0") is None  # gone once stopped


def client(url: str, episode: str = "") -> openai.OpenAI:
    headers = {"X-Episode-Id": episode} if episode else None
    return openai.OpenAI(base_url=url, api_key=KEY, max_retries=0, timeout=60, default_headers=headers)


def scores(worker, prompt_ids, completion_ids, temperature: float) -> torch.Tensor:
    """The completion tokens' log-probs under the worker's weights, recomputed from scratch."""
    with torch.no_grad():
        scored = completion_logprobs(worker.engine.model, [prompt_ids], [completion_ids], pad_id=0,
                                     temperature=temperature)
    return scored.logprobs[0][scored.mask[0].bool()]


def template_ids(tokenizer, messages) -> list:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def test_a_reply_records_the_tokens_logprobs_and_versions_it_sampled(served):
    worker, url, _ = served
    tokenizer = worker.engine.tokenizer
    api = client(url)
    assert [m.id for m in api.models.list().data] == ["policy"]
    messages = [{"role": "user", "content": "12+34="}]
    reply = api.chat.completions.create(model="policy", messages=messages, temperature=0.7, max_tokens=5,
                                        logprobs=True)
    choice = reply.choices[0]
    assert reply.prompt_token_ids == template_ids(tokenizer, messages)
    assert tokenizer.decode(choice.token_ids, skip_special_tokens=True) == choice.message.content
    assert choice.token_versions == [VERSION] * len(choice.token_ids)
    assert reply.usage.completion_tokens == len(choice.token_ids) <= 5
    recorded = torch.tensor([entry.logprob for entry in choice.logprobs.content])
    torch.testing.assert_close(recorded, scores(worker, reply.prompt_token_ids, choice.token_ids, 0.7),
                               atol=1e-4, rtol=0)
    # the temperature is applied: the same tokens score differently at 1.0
    assert not torch.allclose(recorded, scores(worker, reply.prompt_token_ids, choice.token_ids, 1.0), atol=1e-3)
    with pytest.raises(openai.NotFoundError, match="serves 'policy'"):
        api.chat.completions.create(model="other", messages=messages)
    with pytest.raises(openai.BadRequestError, match="'top_p' is not supported"):
        api.chat.completions.create(model="policy", messages=messages, top_p=0.5)
    with pytest.raises(openai.BadRequestError, match="positive integers"):
        api.chat.completions.create(model="policy", messages=messages, n=0)


def test_a_two_turn_episode_is_one_trajectory_with_exact_tokens_and_mask(served):
    worker, url, queue = served
    tokenizer = worker.engine.tokenizer
    api = client(url, episode="ep-1")
    turn1 = [{"role": "user", "content": "12+34="}]
    first = api.chat.completions.create(model="policy", messages=turn1)
    turn2 = turn1 + [{"role": "assistant", "content": first.choices[0].message.content},
                     {"role": "user", "content": "and 5+5="}]
    second = api.chat.completions.create(model="policy", messages=turn2)
    with pytest.raises(openai.BadRequestError, match="do not continue this episode"):
        api.chat.completions.create(model="policy", messages=turn1 + [{"role": "assistant", "content": "x"}])
    with pytest.raises(openai.BadRequestError, match="rl.temperature"):  # the learner scores at the job's
        api.chat.completions.create(model="policy", messages=turn2, temperature=0.5)
    request = urllib.request.Request(f"{url}/episodes/ep-1/finish", method="POST", headers=AUTHORISED,
                                     data=json.dumps({"group": "task-7", "row": {"answer": "10"}}).encode())
    # the group's admission claims staleness capacity: while none is left, the finish is refused and the
    # episode kept; once a group in play ends, the same finish goes through
    in_play = [group for group, _ in worker.schedule.issue(9, 100, version=VERSION)]  # (3 + 0 + 1) x 1
    assert len(in_play) == 4
    with pytest.raises(urllib.error.HTTPError, match="429") as refused:
        urllib.request.urlopen(request, timeout=30)
    assert json.loads(refused.value.read())["error"]["code"] == "groups_full"
    assert worker.schedule.expired(in_play[0])
    finished = json.loads(urllib.request.urlopen(request, timeout=30).read())
    assert worker.schedule.ledger.position("task-7") is not None and worker.schedule.ledger.counts()["admitted"] == 1
    assert finished["sample_id"] == "task-7/ep-1"
    sample = next_sample(queue, "task-7")
    assert sample.prompt_position == -1  # an agent's own group: no data position
    # an episode finished into a group the ledger issued (a taskset's) carries the group's prompt position
    issued, position = in_play[1], worker.schedule.ledger.position(in_play[1])
    client(url, episode="ep-2").chat.completions.create(model="policy", messages=turn1)
    assert finish(url, "ep-2", issued)[0] == 200
    assert position == 1 and next_sample(queue, issued).prompt_position == position

    reply1, reply2 = first.choices[0].token_ids, second.choices[0].token_ids
    # the template writes each turn's end itself: the reply's own EOS, where it sampled one, is not repeated
    said = tokenizer.decode(reply1, skip_special_tokens=False)
    turn_end = "" if said == first.choices[0].message.content + tokenizer.eos_token else tokenizer.eos_token
    observation = tokenizer(turn_end + "u:and 5+5=" + tokenizer.eos_token + "a:", add_special_tokens=False)["input_ids"]
    assert sample.prompt_ids == first.prompt_token_ids == template_ids(tokenizer, turn1)
    assert sample.completion_ids == reply1 + observation + reply2  # the first reply's sampled ids, not re-tokenised
    assert second.prompt_token_ids == sample.prompt_ids + reply1 + observation  # what the second reply continued
    assert sample.completion_mask == [1] * len(reply1) + [0] * len(observation) + [1] * len(reply2)
    assert sample.token_versions == [VERSION] * len(sample.completion_ids)
    assert sample.row == {"answer": "10"} and sample.group_id == "task-7" and sample.policy == "policy"
    # counted with the worker's generated samples: the rollout counters match what the reward queue received
    received, counted = queue.client.pipeline(transaction=True).xlen(queue.requests).hget(
        worker.keys.rollout_stats, "samples").execute()
    assert int(counted) == received
    # the model's tokens carry the log-probs the learner recomputes on the one sequence; observations 0.0
    behaviour = torch.tensor(sample.behaviour_logprobs)
    mask = torch.tensor(sample.completion_mask).bool()
    torch.testing.assert_close(behaviour[mask], scores(worker, sample.prompt_ids, sample.completion_ids, 1.0)[mask],
                               atol=1e-4, rtol=0)
    assert behaviour[~mask].eq(0.0).all()
    with pytest.raises(urllib.error.HTTPError, match="404"):
        urllib.request.urlopen(request, timeout=30)  # finished once


def test_concurrent_requests_are_served_from_one_batch(served, monkeypatch):
    worker, url, _ = served
    api = client(url)
    # the worker loop admits requests only once all six wait, and the rows of every step are counted
    admit, step, rows_per_step = OpenAIBridge.admit, DecodeBatch.step, []
    monkeypatch.setattr(OpenAIBridge, "admit", lambda self, batch: admit(self, batch)
                        if self._pending.qsize() >= 6 else None)
    monkeypatch.setattr(DecodeBatch, "step", lambda self: rows_per_step.append(len(self)) or step(self))

    def ask(i: int):
        return api.chat.completions.create(model="policy", messages=[{"role": "user", "content": f"{i}+{i}="}],
                                           n=2, max_tokens=i + 1, temperature=0.0 if i % 2 else 1.0)

    with ThreadPoolExecutor(6) as pool:
        replies = list(pool.map(ask, range(6)))
    # all twelve choices joined at one step (rows decoding and rows joining it are counted)
    assert max(rows_per_step) == 12
    for i, reply in enumerate(replies):
        assert len(reply.choices) == 2
        for choice in reply.choices:  # each request its own length limit
            assert len(choice.token_ids) == i + 1 or (choice.finish_reason == "stop" and len(choice.token_ids) <= i)
        if i % 2:  # and its own temperature: greedy choices alike
            assert reply.choices[0].token_ids == reply.choices[1].token_ids


def next_sample(queue: RewardQueue, group_id: str, timeout_s: float = 30.0):
    """The first sample of `group_id` the reward queue receives."""
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        for _, raw in queue.fetch("test", 10, block_ms=200):
            sample = decode_sample(raw)
            if sample.group_id == group_id:
                return sample
    raise AssertionError(f"no sample of group {group_id} reached the reward queue")


def test_requests_without_the_key_or_over_the_limits_are_refused_and_the_worker_serves_on(served):
    worker, url, _ = served
    messages = [{"role": "user", "content": "1+1="}]
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        request = urllib.request.Request(f"{url}/models", headers=headers)
        with pytest.raises(urllib.error.HTTPError, match="401"):
            urllib.request.urlopen(request, timeout=30)
    with pytest.raises(openai.AuthenticationError, match="missing or wrong API key"):
        openai.OpenAI(base_url=url, api_key="wrong", max_retries=0).chat.completions.create(
            model="policy", messages=messages)
    api = client(url)
    with pytest.raises(openai.BadRequestError, match="more than this endpoint takes"):  # 60,000 characters
        api.chat.completions.create(model="policy", messages=[{"role": "user", "content": "7" * 60000}], max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="'n' is at most 4"):
        api.chat.completions.create(model="policy", messages=messages, n=50000)
    with pytest.raises(openai.BadRequestError, match="'max_tokens' at most 16"):
        api.chat.completions.create(model="policy", messages=messages, max_tokens=17)
    for temperature in ("NaN", "Infinity", "true"):  # JSON numbers Python's parser takes, and a boolean
        body = '{"model": "policy", "messages": [{"role": "user", "content": "1+1="}], "temperature": %s}' % temperature
        request = urllib.request.Request(f"{url}/chat/completions", data=body.encode(), method="POST",
                                         headers={**AUTHORISED, "Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError, match="400"):
            urllib.request.urlopen(request, timeout=30)
    body = json.dumps({"model": "policy", "messages": [{"role": "user", "content": "7" * 70000}]}).encode()
    request = urllib.request.Request(f"{url}/chat/completions", data=body, method="POST",
                                     headers={**AUTHORISED, "Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError, match="413") as refused:
        urllib.request.urlopen(request, timeout=30)
    assert json.loads(refused.value.read())["error"]["code"] == "request_too_large"
    reply = api.chat.completions.create(model="policy", messages=messages, n=4, max_tokens=16)
    assert len(reply.choices) == 4 and all(c.token_versions == [VERSION] * len(c.token_ids) for c in reply.choices)


def test_requests_past_the_bound_in_progress_are_refused_until_some_end(served, monkeypatch):
    _, url, _ = served
    held, bridges = threading.Event(), []
    held.set()
    admit = OpenAIBridge.admit

    def admit_when_released(self, batch):
        bridges[:] = [self]
        if not held.is_set():
            admit(self, batch)

    monkeypatch.setattr(OpenAIBridge, "admit", admit_when_released)
    api = client(url)

    def ask(i: int):
        return api.chat.completions.create(model="policy", messages=[{"role": "user", "content": f"{i}+1="}],
                                           max_tokens=2)

    with ThreadPoolExecutor(6) as pool:
        waiting = [pool.submit(ask, i) for i in range(6)]
        deadline = time.time() + 30
        while not bridges or bridges[0]._in_progress < 6:
            assert time.time() < deadline, "six requests never were in progress at once"
            time.sleep(0.05)
        with pytest.raises(openai.RateLimitError, match="6 requests are in progress"):
            ask(6)
        held.clear()
        assert all(len(f.result(timeout=60).choices) == 1 for f in waiting)
    assert len(ask(7).choices) == 1


def test_a_bridge_reachable_from_other_machines_needs_its_key(monkeypatch, tmp_path):
    from rlplatform.config import ConfigError, load_config
    from rlplatform.preflight import check_bridges

    config = load_config(None, [f"output_dir={tmp_path}", "rollout.openai_bridge.enabled=true",
                                "rollout.openai_bridge.host=0.0.0.0"])
    monkeypatch.delenv(BRIDGE_KEY_ENV, raising=False)
    with pytest.raises(ConfigError, match=f"'rollout.openai_bridge.host' is 0.0.0.0.*\\${BRIDGE_KEY_ENV} is not set"):
        check_bridges(config, "job.yaml")
    monkeypatch.setenv(BRIDGE_KEY_ENV, KEY)
    check_bridges(config, "job.yaml")
    check_bridges(load_config(None, [f"output_dir={tmp_path}", "rollout.openai_bridge.enabled=true"]), "job.yaml")


def finish(url: str, episode: str, group: str):
    """POST an episode's finish into `group`: (status, body)."""
    request = urllib.request.Request(f"{url}/episodes/{episode}/finish", method="POST", headers=AUTHORISED,
                                     data=json.dumps({"group": group, "row": {"answer": "2"}}).encode())
    try:
        with urllib.request.urlopen(request, timeout=30) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as refused:
        return refused.code, json.loads(refused.read())


@pytest.mark.parametrize("served", [MonitoringConfig(hang_factor=2, hang_floor_s=1)], indirect=True)
def test_an_episode_whose_agent_goes_silent_is_dropped_named_and_refused_after(served):
    """The idle deadline is the hang rule on the longest an agent took to send an episode's next request (here
    2 x about 0.8 s, at least 1 s): an episode held past it is dropped, counted and pushed for the job's alert, and
    the agent's late requests for it are answered 410; so is a finish into an agent's group that has ended."""
    worker, url, queue = served
    api = client(url, episode="slow")
    turn1 = [{"role": "user", "content": "1+1="}]
    first = api.chat.completions.create(model="policy", messages=turn1)
    time.sleep(0.8)  # the agent thinks: the longest wait so far
    api.chat.completions.create(model="policy", messages=turn1 + [
        {"role": "assistant", "content": first.choices[0].message.content}, {"role": "user", "content": "2+2="}])
    assert finish(url, "slow", "g")[0] == 200  # group g admitted
    client(url, episode="gone").chat.completions.create(model="policy", messages=turn1)
    started = time.monotonic()
    while not (dropped := queue.client.lrange(worker.keys.agent_episodes_expired, 0, -1)):
        assert time.monotonic() - started < 10, "the silent agent's episode was never dropped"
        time.sleep(0.1)
    [entry] = [json.loads(e) for e in dropped]
    assert entry["episode"] == "gone" and entry["client"] == "127.0.0.1"
    assert 1.6 <= entry["deadline_s"] < 3 and entry["idle_s"] > entry["deadline_s"]
    assert entry["worker"] == "rollout worker 0 of policy 'policy'"
    assert time.monotonic() - started < entry["deadline_s"] + 2.5  # found within a sweep of the deadline
    assert worker.counters.read().agent_episodes_expired == 1
    with pytest.raises(openai.APIStatusError, match="was dropped") as late:
        client(url, episode="gone").chat.completions.create(model="policy", messages=turn1)
    assert late.value.status_code == 410
    status, body = finish(url, "gone", "g2")
    assert status == 410 and body["error"]["code"] == "episode_expired"
    # group g expires (its second episode never came): a finish into it is refused, the episode kept for another
    assert worker.schedule.expired("g")
    client(url, episode="after").chat.completions.create(model="policy", messages=turn1)
    status, body = finish(url, "after", "g")
    assert status == 410 and body["error"]["code"] == "group_ended"
    assert finish(url, "after", "g3")[0] == 200
    assert worker.schedule.ledger.counts()["admitted"] == 2  # g and g3; g was not opened again

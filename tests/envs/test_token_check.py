"""Exact tokens, checked while running: each finished chat-template episode is compared with its
conversation rendered whole by the template. An episode grown turn by turn under a prefix-stable
template is its conversation; tool results appended one at a time where the template renders
consecutive tool messages as one block are caught; on a real decode batch exactly the episodes whose
model wrote a special token inside a turn (which the conversation's text loses) are counted, and by
`env.on_token_mismatch` not trained (drop) or stop the worker (fail)."""

from __future__ import annotations

import pytest
import torch

from rlplatform.actors.engine import TransformersEngine
from rlplatform.actors.episodes import MultiTurn, TokenMismatch, run_episodes
from rlplatform.config import EnvConfig
from rlplatform.envs.rendering import Renderer
from rlplatform.policy import demo_tokenizer
from rlplatform.tokenization import Prompt
from rlplatform.transport.tool_queue import ToolQueue

STABLE = ("{% for m in messages %}{{ m['role'][0] + ':' + m['content'] + eos_token }}{% endfor %}"
          "{% if add_generation_prompt %}a:{% endif %}")
# consecutive tool messages render as one block: "t:" before the first, "|" between, one end of turn after the last
GROUPED_TOOLS = ("{% for m in messages %}{% set prev = messages[loop.index0 - 1].role if loop.index0 else '' %}"
                 "{% set next = messages[loop.index0 + 1].role if not loop.last else '' %}"
                 "{% if m.role == 'tool' %}{{ ('|' if prev == 'tool' else 't:') + m.content }}"
                 "{% if next != 'tool' %}{{ eos_token }}{% endif %}"
                 "{% else %}{{ m.role[0] + ':' + m.content + eos_token }}{% endif %}{% endfor %}"
                 "{% if add_generation_prompt %}a:{% endif %}")


def _ids(tokenizer, text: str):
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def test_an_episode_grown_turn_by_turn_with_a_prefix_stable_template_is_its_conversation():
    tokenizer = demo_tokenizer()
    tokenizer.chat_template = STABLE
    renderer = Renderer(tokenizer, "auto")
    messages = [{"role": "user", "content": "1+1="}]
    ids = renderer.prompt_ids(messages)
    for turn, observation in (("call", [{"role": "tool", "content": "2"}, {"role": "tool", "content": "3"}]),
                              ("done", None)):
        turn_ids = _ids(tokenizer, turn) + [tokenizer.eos_token_id]
        messages.append({"role": "assistant", "content": turn})
        ids += turn_ids
        if observation:
            ids += renderer.observation_ids(messages, turn_ids, observation)
            messages += observation
    assert renderer.first_mismatch(messages, 1, ids) is None
    assert renderer.first_mismatch(messages, 1, ids[:-3]) is None  # a prefix: a turn cut short by its budget
    broken = ids[:5] + [ids[5] + 1] + ids[6:]
    assert renderer.first_mismatch(messages, 1, broken) == 5


def test_tool_results_appended_one_at_a_time_where_the_template_groups_them_are_caught():
    tokenizer = demo_tokenizer("|")
    tokenizer.chat_template = GROUPED_TOOLS
    renderer = Renderer(tokenizer, "auto")
    messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "call"},
                {"role": "tool", "content": "2"}, {"role": "tool", "content": "3"},
                {"role": "assistant", "content": "ok"}]
    eos = [tokenizer.eos_token_id]
    # what a rollout that renders each tool message on its own records: two blocks, two ends of turn
    one_at_a_time = (_ids(tokenizer, "u:q") + eos + _ids(tokenizer, "a:call") + eos + _ids(tokenizer, "t:2") + eos
                     + _ids(tokenizer, "t:3") + eos + _ids(tokenizer, "a:ok") + eos)
    grouped = (_ids(tokenizer, "u:q") + eos + _ids(tokenizer, "a:call") + eos + _ids(tokenizer, "t:2|3") + eos
               + _ids(tokenizer, "a:ok") + eos)
    assert renderer.first_mismatch(messages, 1, grouped) is None
    position = renderer.first_mismatch(messages, 1, one_at_a_time)
    assert position == len(_ids(tokenizer, "u:q") + eos + _ids(tokenizer, "a:call") + eos + _ids(tokenizer, "t:2"))
    plain = Renderer(demo_tokenizer(), "auto")  # no chat template: nothing to compare
    assert plain.first_mismatch(messages, 1, one_at_a_time) is None


@pytest.fixture(scope="module")
def engine(tiny_policy):
    engine = TransformersEngine(tiny_policy)
    engine.tokenizer.chat_template = STABLE
    engine.version = 1
    return engine


def _play(engine, redis_client, on_mismatch: str, episodes: int = 16):
    """`episodes` two-turn episodes of the random tiny policy, sampled from a fixed seed; and the counts."""
    queue = ToolQueue(redis_client, "token-check")
    runner = MultiTurn(EnvConfig(fn="tests.envs.tools_for_tests:TalkTwice", max_turns=2, max_tokens=60,
                                 on_token_mismatch=on_mismatch), 6, Renderer(engine.tokenizer, "auto"), queue,
                       queue.tool_keys.results("policy-0"))
    renderer = Renderer(engine.tokenizer, "auto")
    prompt = Prompt({"prompt": "1+1="}, renderer.prompt_ids([{"role": "user", "content": "1+1="}]), "1+1=")
    torch.manual_seed(0)
    (group,) = run_episodes(runner, engine.decode_batch(6, 1.0), [prompt], episodes)
    return group, runner.take_counts()


def _writes_special_text_loses(engine, completion) -> bool:
    """Whether the model wrote a special token inside a turn (not the end of turn that closes it; the
    observations here hold none): the conversation keeps the turn as text, which drops it."""
    return bool({engine.tokenizer.pad_token_id, engine.tokenizer.bos_token_id} & set(completion.completion_ids))


@pytest.mark.parametrize("on_mismatch", ["count", "drop"])
def test_on_a_real_batch_exactly_the_episodes_whose_tokens_the_conversation_loses_are_caught(
        engine, redis_client, on_mismatch):
    group, counts = _play(engine, redis_client, on_mismatch)
    lost = [_writes_special_text_loses(engine, c) for c in group]
    assert 0 < sum(lost) < len(group)  # the seed samples both kinds
    assert [c.episode.get("token_mismatch", False) for c in group] == lost
    assert counts["token_checks"] == len(group) and counts["token_mismatches"] == sum(lost)
    trained = [sum(c.completion_mask) > 0 for c in group]
    assert trained == ([not x for x in lost] if on_mismatch == "drop" else [True] * len(group))


def test_fail_stops_at_the_first_episode_that_departs_naming_where(engine, redis_client):
    with pytest.raises(TokenMismatch, match=r"env.on_token_mismatch: fail: an episode's token \d+ is"):
        _play(engine, redis_client, "fail")

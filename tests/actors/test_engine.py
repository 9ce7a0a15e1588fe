"""Continuous batching: sequences that join a running batch, or leave it early, decode as if alone."""

from __future__ import annotations

import pytest
import torch

from rlplatform.actors.engine import TransformersEngine
from rlplatform.learners.batching import completion_logprobs


def ids(engine: TransformersEngine, prompts):
    return engine.tokenizer(prompts)["input_ids"]


def alone(engine: TransformersEngine, prompt: str, max_new_tokens: int):
    return engine.generate(ids(engine, [prompt]), 1, max_new_tokens, 0.0)[0][0]


def test_rows_joining_and_leaving_decode_exactly_as_alone(tiny_policy):
    engine = TransformersEngine(tiny_policy)
    engine.load_weights({k: v.clone() for k, v in engine.model.state_dict().items()}, version=0)
    batch = engine.decode_batch(max_new_tokens=6, temperature=0.0)
    batch.add(ids(engine, ["12+34=", "5+5="]), keys=["a", "b"])
    finished = {}
    for _ in range(3):
        finished.update(batch.step())
    # one prompt shorter than the batch's columns, one longer: each side gets left-padded
    batch.add(ids(engine, ["7=", "123+456+789+1000="]), keys=["c", "d"])
    widths = []
    while batch:
        finished.update(batch.step())
        widths.append(batch.attention.shape[1])
    assert sorted(finished) == ["a", "b", "c", "d"]
    prompts = {"a": "12+34=", "b": "5+5=", "c": "7=", "d": "123+456+789+1000="}
    for key, prompt in prompts.items():
        reference = alone(engine, prompt, 6)
        assert finished[key].completion_ids == reference.completion_ids
        assert finished[key].prompt_ids == reference.prompt_ids
        torch.testing.assert_close(torch.tensor(finished[key].logprobs), torch.tensor(reference.logprobs),
                                   atol=1e-4, rtol=0)
    # and the recorded log-probs are the model's, scored from scratch
    scores = completion_logprobs(engine.model, [finished[k].prompt_ids for k in prompts],
                                 [finished[k].completion_ids for k in prompts], pad_id=0)
    for key, row, mask in zip(prompts, scores.logprobs, scores.mask):
        torch.testing.assert_close(torch.tensor(finished[key].logprobs), row[mask.bool()], atol=1e-4, rtol=0)
    # once the first rows leave, the columns only they used are cut: the batch never outgrows its longest row
    assert max(widths[3:-1]) <= len(finished["d"].prompt_ids) + 6


@pytest.mark.parametrize("kv_cache,forwards", [
    ("dynamic", [1, 2]),  # the running row's decode step, then one prefill row per distinct prompt
    ("static", [2]),  # the decode step runs in the slot decoder, not through the model's forward
])
def test_a_group_of_one_prompt_is_prefilled_once_and_each_row_decodes_as_alone(tiny_policy, kv_cache, forwards):
    engine = TransformersEngine(tiny_policy, kv_cache=kv_cache)
    engine.load_weights({k: v.clone() for k, v in engine.model.state_dict().items()}, version=0)
    batch = engine.decode_batch(max_new_tokens=5, temperature=0.0)
    batch.add(ids(engine, ["12+34="]), keys=["running"])
    finished = dict(batch.step())
    fed = []
    hook = engine.model.register_forward_hook(lambda module, args, kwargs, out: fed.append(kwargs["input_ids"].shape),
                                              with_kwargs=True)
    prompts = {**{f"group/{i}": "5+5=" for i in range(4)}, **{f"other/{i}": "123+4=" for i in range(3)}}
    batch.add(ids(engine, list(prompts.values())), keys=list(prompts))
    finished.update(batch.step())
    hook.remove()
    assert [shape[0] for shape in fed] == forwards
    while batch:
        finished.update(batch.step())
    for key, prompt in {"running": "12+34=", **prompts}.items():
        reference = alone(engine, prompt, 5)
        assert finished[key].prompt_ids == reference.prompt_ids
        assert finished[key].completion_ids == reference.completion_ids
        torch.testing.assert_close(torch.tensor(finished[key].logprobs), torch.tensor(reference.logprobs),
                                   atol=1e-4, rtol=0)


def test_a_finished_row_leaves_at_once_and_its_slot_can_be_refilled(tiny_policy):
    engine = TransformersEngine(tiny_policy)
    engine.load_weights({k: v.clone() for k, v in engine.model.state_dict().items()}, version=3)
    short = engine.decode_batch(max_new_tokens=2, temperature=0.0)  # greedy: no EOS from this model
    short.add(ids(engine, ["1+1=", "2+2=", "3+3="]), keys=[0, 1, 2])
    assert short.step() == [] and len(short) == 3
    done = short.step()
    assert sorted(k for k, _ in done) == [0, 1, 2] and len(short) == 0
    assert all(c.versions == [3] * len(c.completion_ids) for _, c in done)
    short.add(ids(engine, ["4+4="]), keys=[3])
    short.step()
    (key, completion), = short.step()
    assert key == 3 and len(completion.completion_ids) == 2 and len(short) == 0


def test_rows_with_their_own_temperature_and_limit_share_steps(tiny_policy):
    engine = TransformersEngine(tiny_policy)
    engine.load_weights({k: v.clone() for k, v in engine.model.state_dict().items()}, version=0)
    batch = engine.decode_batch(max_new_tokens=6, temperature=1.0)
    batch.add(ids(engine, ["12+34="]), keys=["t=1"])
    batch.add(ids(engine, ["5+5="]), keys=["t=0.5"], temperature=0.5)
    batch.add(ids(engine, ["7+8="]), keys=["greedy"], max_new_tokens=3, temperature=0.0)
    finished = {}
    while batch:
        finished.update(batch.step())
    # the greedy row decodes as it would alone, and stops at its own limit
    assert finished["greedy"].completion_ids == alone(engine, "7+8=", 3).completion_ids
    # each sampled row records its tokens' log-probs at its own temperature
    for key, temperature, other in (("t=1", 1.0, 0.5), ("t=0.5", 0.5, 1.0)):
        recorded = torch.tensor(finished[key].logprobs)
        at = {t: completion_logprobs(engine.model, [finished[key].prompt_ids], [finished[key].completion_ids],
                                     pad_id=0, temperature=t) for t in (temperature, other)}
        assert torch.allclose(recorded, at[temperature].logprobs[0][at[temperature].mask[0].bool()], atol=1e-4)
        assert not torch.allclose(recorded, at[other].logprobs[0][at[other].mask[0].bool()], atol=1e-3)


def test_prefill_runs_in_chunks_of_the_token_budget_and_decodes_as_in_one(tiny_policy):
    whole = TransformersEngine(tiny_policy)
    chunked = TransformersEngine(tiny_policy, prefill_tokens=12)
    prompts = ["12+34=", "5+5=", "123+456+789+1000=", "7=", "40+2=", "9+9+9="]
    fed = []
    hook = chunked.model.register_forward_hook(
        lambda module, args, kwargs, out: fed.append((tuple(kwargs["input_ids"].shape), out.logits.shape[1])),
        with_kwargs=True)
    got = chunked.generate(ids(chunked, prompts), 2, 5, 0.0)
    hook.remove()
    prefills = [(shape, kept) for shape, kept in fed if shape[1] > 1]
    # each chunk holds at most 12 padded tokens (the 17-token prompt alone), and projects one position per row
    assert len(prefills) > 1 and all(rows * width <= 12 or rows == 1 for (rows, width), _ in prefills)
    assert all(kept == 1 for _, kept in prefills)
    assert sum(rows for (rows, _), _ in prefills) == len(prompts)
    for a, b in zip(got, whole.generate(ids(whole, prompts), 2, 5, 0.0)):
        for x, y in zip(a, b):
            assert x.prompt_ids == y.prompt_ids and x.completion_ids == y.completion_ids
            torch.testing.assert_close(torch.tensor(x.logprobs), torch.tensor(y.logprobs), atol=1e-4, rtol=0)


def test_the_auto_engine_is_vllm_only_where_it_can_run_the_policy():
    from rlplatform.actors.engine import choose_engine, engine_kind
    from rlplatform.config import LoraConfig, RolloutConfig

    assert choose_engine(cuda=True, vllm_installed=True, adapters_fit=True) == "vllm"
    for cuda, installed, fit in [(False, True, True), (True, False, True), (True, True, False), (False, False, False)]:
        assert choose_engine(cuda, installed, fit) == "transformers"
    assert RolloutConfig().engine == "auto"
    assert engine_kind(RolloutConfig(), None, "float32") == "transformers"  # this machine: no CUDA GPU
    assert engine_kind(RolloutConfig(engine="vllm"), LoraConfig(enabled=True), "float32") == "vllm"  # as asked
    assert engine_kind(RolloutConfig(engine="transformers", device="cuda"), None, "bfloat16") == "transformers"

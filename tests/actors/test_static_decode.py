"""The slot decoder (static KV cache, CUDA graphs on a GPU) decodes token for token as the dynamic loop does."""

from __future__ import annotations

import pytest
import torch

from rlplatform.actors.engine import TransformersEngine
from rlplatform.actors.static_decode import StaticDecodeBatch, static_decoding
from rlplatform.config import LoraConfig

PROMPTS = {"a": "12+34=", "b": "5+5=", "c": "7=", "d": "123+456+789+1000=", "e": "40+2=", "f": "9+9+9="}


def scripted(engine: TransformersEngine, updated: dict):
    """One continuous batch through joins, early leaves, refilled slots, more rows than the first cache held
    and a weight update mid-way; every finished completion by key."""
    ids = lambda texts: engine.tokenizer(texts)["input_ids"]  # noqa: E731
    batch = engine.decode_batch(max_new_tokens=7, temperature=0.0)
    batch.add(ids([PROMPTS["a"], PROMPTS["b"]]), keys=["a", "b"])
    batch.add(ids([PROMPTS["c"]]), keys=["c"], max_new_tokens=2)
    finished, steps = {}, 0
    while batch:
        finished.update(batch.step())
        steps += 1
        if steps == 3:  # c has left: its slot is refilled, and a group of one prompt outgrows the first cache
            batch.add(ids([PROMPTS["d"]] * 9), keys=[f"d/{i}" for i in range(9)], max_new_tokens=5)
        if steps == 4:
            engine.load_weights(updated, version=1)
            batch.add(ids([PROMPTS["e"], PROMPTS["f"]]), keys=["e", "f"])
    return finished


def same_start(*engines: TransformersEngine) -> dict:
    """Every engine loads the first one's weights as version 0; returns the weights `scripted` updates them to."""
    start = {k: v.clone() for k, v in engines[0].model.state_dict().items()}
    for engine in engines:
        engine.load_weights(start, version=0)
    torch.manual_seed(1)
    return {k: v + 0.05 * torch.randn_like(v) for k, v in start.items()}


def test_the_slot_decoder_decodes_as_the_dynamic_loop_through_joins_leaves_growth_and_updates(tiny_policy):
    dynamic = TransformersEngine(tiny_policy, kv_cache="dynamic")
    static = TransformersEngine(tiny_policy, kv_cache="static")
    assert static.slot_decoder is not None and dynamic.slot_decoder is None
    assert isinstance(static.decode_batch(4, 0.0), StaticDecodeBatch)
    updated = same_start(dynamic, static)
    expected, got = scripted(dynamic, updated), scripted(static, updated)
    assert sorted(got) == sorted(expected) and len(got) == 14
    for key, completion in expected.items():
        assert got[key].prompt_ids == completion.prompt_ids
        assert got[key].completion_ids == completion.completion_ids, key
        assert got[key].versions == completion.versions
        torch.testing.assert_close(torch.tensor(got[key].logprobs), torch.tensor(completion.logprobs),
                                   atol=1e-4, rtol=0)
    # the update landed mid-sequence, so some rows hold tokens of both versions
    assert any(set(c.versions) == {0, 1} for c in got.values())
    assert static.slot_decoder.slots >= 11  # grew past the first 8 slots, keeping the rows it held
    assert len(static.slot_decoder.free) == static.slot_decoder.slots  # every slot handed back


def test_generate_through_the_slot_decoder_matches_the_dynamic_loop(tiny_policy):
    dynamic = TransformersEngine(tiny_policy, kv_cache="dynamic")
    static = TransformersEngine(tiny_policy, kv_cache="static")
    prompts = dynamic.tokenizer(list(PROMPTS.values()))["input_ids"]
    for a, b in zip(dynamic.generate(prompts, 3, 6, 0.0), static.generate(prompts, 3, 6, 0.0)):
        assert [c.completion_ids for c in a] == [c.completion_ids for c in b]


def test_kv_cache_auto_is_static_where_the_slot_decoder_runs_and_static_refuses_what_it_cannot_run(tiny_policy):
    engine = TransformersEngine(tiny_policy)  # auto, on this CPU machine
    assert engine.slot_decoder is not None and not engine.slot_decoder.graphs  # eager steps on a CPU
    assert static_decoding("auto", engine.model, adapters=False)
    assert not static_decoding("auto", engine.model, adapters=True)
    assert not static_decoding("dynamic", engine.model, adapters=False)
    with pytest.raises(ValueError, match="LoRA"):
        TransformersEngine(tiny_policy, "cpu", lora=LoraConfig(enabled=True, rank=4), kv_cache="static")
    engine.model.config.model_type = "gpt2"
    with pytest.raises(ValueError, match="'gpt2' is not one of qwen2, llama"):
        static_decoding("static", engine.model, adapters=False)


@pytest.mark.gpu
def test_captured_decode_steps_on_cuda_match_the_dynamic_loop(tiny_policy):
    dynamic = TransformersEngine(tiny_policy, "cuda", kv_cache="dynamic")
    captured = TransformersEngine(tiny_policy, "cuda")  # auto: the slot decoder, each step a CUDA graph
    assert captured.slot_decoder is not None and captured.slot_decoder.graphs
    updated = same_start(dynamic, captured)
    expected, got = scripted(dynamic, updated), scripted(captured, updated)
    assert captured.slot_decoder.captured  # the steps replayed graphs
    for key, completion in expected.items():
        assert got[key].completion_ids == completion.completion_ids, key
        torch.testing.assert_close(torch.tensor(got[key].logprobs), torch.tensor(completion.logprobs),
                                   atol=1e-3, rtol=0)

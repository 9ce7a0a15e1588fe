"""One encoding everywhere: SFT, rollout and learner see the same prompt ids (a BOS-adding tokenizer
included), chat-template rows train on assistant turns only, and generation stops on every EOS id."""

from __future__ import annotations

import shutil

import pytest
import torch
from tokenizers import processors
from transformers import GenerationConfig

from rlplatform.actors.engine import TransformersEngine
from rlplatform.config import LearnerConfig
from rlplatform.learners.rank import LearnerRank, SFTPart
from rlplatform.policy import load_policy, load_tokenizer
from rlplatform.tokenization import encode_prompts, encode_sft, stop_token_ids, within_limit
from rlplatform.transport.weight_transports import ObjectStoreTransport

# a ChatML-like template in the demo tokenizer's characters: "u:" / "a:" open a turn, EOS ends it
TEMPLATE = ("{% for m in messages %}{{ m['role'][0] + ':' + m['content'] + eos_token }}{% endfor %}"
            "{% if add_generation_prompt %}a:{% endif %}")


def policy_copy(tiny_policy: str, tmp_path, bos: bool = False, template: bool = False) -> str:
    """The tiny policy saved again with a tokenizer that adds BOS and/or has a chat template."""
    path = str(tmp_path / "policy")
    shutil.copytree(tiny_policy, path)
    tokenizer = load_tokenizer(path)
    if bos:
        tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(
            single="<s> $A", special_tokens=[("<s>", tokenizer.bos_token_id)])
    if template:
        tokenizer.chat_template = TEMPLATE
    tokenizer.save_pretrained(path)
    return path


def learner_on(path: str, chat_template: str = "auto") -> LearnerRank:
    """A learner rank's SFT scoring on the plain model (no DeepSpeed needed to encode and score)."""
    rank = LearnerRank(0, 1, path, LearnerConfig(), seed=0, chat_template=chat_template,
                       dtype="float32", transport=ObjectStoreTransport())
    rank.engine, rank.tokenizer = load_policy(path)
    return rank


def test_bos_tokenizer_gives_sft_rollout_and_learner_the_same_prompt_ids(tiny_policy, tmp_path):
    path = policy_copy(tiny_policy, tmp_path, bos=True)
    tokenizer = load_tokenizer(path)
    row = {"prompt": "12+34=", "answer": "46"}
    prompt = encode_prompts(tokenizer, [row], "auto")[0]
    bos = tokenizer.bos_token_id
    assert prompt.ids[0] == bos and len(prompt.ids) == 1 + len("12+34=")
    sft_prompt, target, mask = encode_sft(tokenizer, row, "auto")
    assert sft_prompt == prompt.ids  # SFT trains on the prompt rollouts decode from
    assert target == tokenizer("46", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    assert bos not in target and mask == [1, 1, 1]
    engine = TransformersEngine(path)
    completion = engine.generate([prompt.ids], 1, 3, 0.0)[0][0]
    assert completion.prompt_ids == prompt.ids  # the engine decodes from these ids, not re-tokenised text
    scores = learner_on(path)._sft_scores(SFTPart.of([(sft_prompt, target, mask)]))
    # the learner's loss covers exactly the target, placed after the BOS-prefixed prompt
    assert scores.mask.shape[1] == len(prompt.ids) + len(target) - 1
    assert scores.mask[0].nonzero().squeeze(-1).tolist() == list(range(len(prompt.ids) - 1, scores.mask.shape[1]))


def test_chat_rows_train_on_every_assistant_turn_only(tiny_policy, tmp_path):
    path = policy_copy(tiny_policy, tmp_path, template=True)
    tokenizer = load_tokenizer(path)
    messages = [{"role": "user", "content": "1+1"}, {"role": "assistant", "content": "2"},
                {"role": "user", "content": "2+2"}, {"role": "assistant", "content": "4"}]
    prompt_ids, target, mask = encode_sft(tokenizer, {"messages": messages}, "auto")
    assert tokenizer.decode(prompt_ids) == "u:1+1</s>a:"
    assert tokenizer.decode(target) == "2</s>u:2+2</s>a:4</s>"
    trained = [t for t, m in zip(target, mask) if m]
    assert tokenizer.decode(trained) == "2</s>4</s>"  # both replies with their end of turn, no user turn
    # rollouts of the same row decode from the same prompt: the conversation before its last reply
    rollout = encode_prompts(tokenizer, [{"messages": messages}], "auto")[0]
    assert tokenizer.decode(rollout.ids) == "u:1+1</s>a:2</s>u:2+2</s>a:"
    assert rollout.text == tokenizer.decode(rollout.ids)
    # a prompt row becomes a user turn answered by its answer
    prompt_ids, target, mask = encode_sft(tokenizer, {"prompt": "3+4", "answer": "7"}, "auto")
    assert tokenizer.decode(prompt_ids) == "u:3+4</s>a:" and tokenizer.decode(target) == "7</s>" and all(mask)
    # the learner's loss mask is the completion mask times the assistant-token mask
    full_prompt, full_target, full_mask = encode_sft(tokenizer, {"messages": messages}, "auto")
    scores = learner_on(path)._sft_scores(SFTPart.of([(full_prompt, full_target, full_mask)]))
    expected = torch.zeros(len(full_prompt) + len(full_target) - 1)
    expected[len(full_prompt) - 1:] = torch.tensor(full_mask, dtype=torch.float32)
    assert torch.equal(scores.mask[0], expected)


def test_chat_template_none_encodes_plain_text_and_refuses_conversations(tiny_policy, tmp_path):
    path = policy_copy(tiny_policy, tmp_path, template=True)
    tokenizer = load_tokenizer(path)
    plain = encode_prompts(tokenizer, [{"prompt": "3+4="}], "none")[0]
    assert tokenizer.decode(plain.ids) == "3+4="
    with pytest.raises(ValueError, match="data.chat_template is none"):
        encode_prompts(tokenizer, [{"messages": [{"role": "user", "content": "1"}]}], "none")


def test_generation_stops_on_every_eos_id_of_the_generation_config(tiny_policy, tmp_path):
    path = policy_copy(tiny_policy, tmp_path)
    prompt = load_tokenizer(path)("12+34=")["input_ids"]
    free = TransformersEngine(path).generate([prompt], 1, 5, 0.0)[0][0]
    assert len(free.completion_ids) == 5  # an untrained model never emits the tokenizer's EOS here
    first = free.completion_ids[0]
    GenerationConfig(eos_token_id=[first, 3]).save_pretrained(path)  # a list, as Qwen and Llama ship it
    engine = TransformersEngine(path)
    assert engine.stop_ids == sorted({first, 3, engine.tokenizer.eos_token_id})
    stopped = engine.generate([prompt], 1, 5, 0.0)[0][0]
    assert stopped.completion_ids == [first]
    eos = engine.tokenizer.eos_token_id
    assert stop_token_ids(engine.tokenizer, GenerationConfig(eos_token_id=7)) == sorted({7, eos})


def test_prompts_over_the_limit_are_skipped_and_counted(tiny_policy):
    tokenizer = load_tokenizer(tiny_policy)
    prompts = encode_prompts(tokenizer, [{"prompt": "1+1="}, {"prompt": "100+200="}, {"prompt": "12+3="}], "auto")
    kept, skipped = within_limit(prompts, 5)
    assert [p.text for p in kept] == ["1+1=", "12+3="] and skipped == 1
    assert within_limit(prompts, 0) == (prompts, 0)

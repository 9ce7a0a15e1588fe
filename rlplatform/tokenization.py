"""Rows to token ids, one way for SFT, rollout workers, evaluation and the learner.

`encode_prompts` turns rows into the prompt ids the engine decodes from (and the learner scores
RL samples on); `encode_sft` gives the same prompt ids plus the trained target and its loss mask.
Special tokens follow one rule everywhere: with a chat template (`data.chat_template: auto` and
the tokenizer has one) the rendered template decides them; otherwise the prompt text is encoded
with the tokenizer's own special tokens (a BOS where it adds one) and the answer ends with EOS.
Encoded prompts are saved as JSON lines (`save_prompts`) for rollout workers to load themselves.
What an environment or an agent says is text, never control: `encode_marked` encodes rendered text
whose stand-ins (`CONTENT_MARK`) hold such contents with the special tokens' text split into plain tokens.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass
from typing import Dict, List, Sequence, Tuple

Row = Dict
CONTENT_MARK = "\u27e6content {}\u27e7"  # stands in for a content while a template renders around it


@dataclass
class Prompt:
    """A data row ready to generate from."""
    row: Row
    ids: List[int]  # prompt token ids, as the engine decodes from them
    text: str  # the prompt as the model sees it (the rendered template for conversations)


def save_prompts(prompts: Sequence[Prompt], path: str) -> str:
    """Write `prompts` as JSON lines to `path`; returns `path`."""
    with open(path, "w") as f:
        f.writelines(json.dumps(asdict(prompt)) + "\n" for prompt in prompts)
    return path


def load_prompts(path: str) -> List[Prompt]:
    """The prompts `save_prompts` wrote to `path`."""
    with open(path) as f:
        return [Prompt(**json.loads(line)) for line in f]


def uses_chat_template(tokenizer, chat_template: str) -> bool:
    return chat_template == "auto" and bool(getattr(tokenizer, "chat_template", None))


def conversation(row: Row) -> List[Dict[str, str]]:
    """The row as messages: its `messages`, or its `prompt` as one user turn."""
    return list(row["messages"]) if "messages" in row else [{"role": "user", "content": row["prompt"]}]


def prompt_messages(row: Row) -> List[Dict[str, str]]:
    """The conversation up to the reply the model is asked for: trailing assistant turns removed."""
    messages = conversation(row)
    while messages and messages[-1]["role"] == "assistant":
        messages.pop()
    return messages


def encode_prompts(tokenizer, rows: Sequence[Row], chat_template: str) -> List[Prompt]:
    """Each row's prompt as token ids (the generation prompt appended when a template is used)."""
    if uses_chat_template(tokenizer, chat_template):
        texts = [_render(tokenizer, prompt_messages(row), generation_prompt=True) for row in rows]
        ids = tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []
    else:
        for row in rows:
            _require_plain(row, tokenizer)
        texts = [row["prompt"] for row in rows]
        ids = tokenizer(texts)["input_ids"] if texts else []
    return [Prompt(row, list(i), text) for row, i, text in zip(rows, ids, texts)]


def encode_sft(tokenizer, row: Row, chat_template: str) -> Tuple[List[int], List[int], List[int]]:
    """(prompt ids, target ids, target loss mask) of a row; the prompt ids are `encode_prompts`'.

    Plain rows train on the answer and EOS. With a chat template the target is the rest of the
    rendered conversation from the first assistant turn on, trained on its assistant turns only
    (each with its end-of-turn tokens); a `prompt` row becomes a user turn answered by `answer`.
    """
    if not uses_chat_template(tokenizer, chat_template):
        prompt = encode_prompts(tokenizer, [row], chat_template)[0].ids
        target = tokenizer(str(row["answer"]), add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        return prompt, target, [1] * len(target)
    messages = conversation(row) if "messages" in row else \
        conversation(row) + [{"role": "assistant", "content": str(row["answer"])}]
    full = _template_ids(tokenizer, messages, generation_prompt=False)
    spans = [_assistant_span(tokenizer, messages, k, full) for k, m in enumerate(messages) if m["role"] == "assistant"]
    if not spans:
        raise ValueError(f"an SFT row has no assistant turn to train on: {messages[:2]}...")
    first = spans[0][0]
    mask = [0] * (len(full) - first)
    for begin, end in spans:
        mask[begin - first:end - first] = [1] * (end - begin)
    return full[:first], full[first:], mask


def stop_token_ids(tokenizer, generation_config) -> List[int]:
    """Every id that ends a completion: the generation config's `eos_token_id` (an id or a list)
    and the tokenizer's EOS."""
    configured = getattr(generation_config, "eos_token_id", None) if generation_config is not None else None
    ids = configured if isinstance(configured, (list, tuple)) else [configured]
    return sorted({int(i) for i in list(ids) + [tokenizer.eos_token_id] if i is not None})


def _assistant_span(tokenizer, messages: List[Dict[str, str]], k: int, full: List[int]) -> Tuple[int, int]:
    """[begin, end) of assistant turn `k` in the rendered conversation `full`."""
    before = _template_ids(tokenizer, messages[:k], generation_prompt=True)
    through = _template_ids(tokenizer, messages[:k + 1], generation_prompt=False)
    if through[:len(before)] != before or full[:len(through)] != through:
        raise ValueError("the tokenizer's chat template renders a conversation differently from its beginning "
                         "(earlier turns change as turns are added), so assistant turns cannot be located for "
                         "the SFT loss mask; give rows a single final assistant turn or set data.chat_template: none")
    return len(before), len(through)


def _template_ids(tokenizer, messages: List[Dict[str, str]], generation_prompt: bool) -> List[int]:
    text = _render(tokenizer, messages, generation_prompt) if messages else ""
    return tokenizer(text, add_special_tokens=False)["input_ids"] if text else []


def _render(tokenizer, messages: List[Dict[str, str]], generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)


def _require_plain(row: Row, tokenizer) -> None:
    if "prompt" not in row:
        why = "the tokenizer has no chat template" if not getattr(tokenizer, "chat_template", None) \
            else "data.chat_template is none"
        raise ValueError(f"a row holds 'messages' but {why}: use a tokenizer with a chat template "
                         f"(data.chat_template: auto) or give rows a 'prompt'")


def within_limit(prompts: List[Prompt], max_prompt_tokens: int) -> Tuple[List[Prompt], int]:
    """(the prompts of at most `max_prompt_tokens` tokens, how many were longer); 0 keeps all."""
    if not max_prompt_tokens:
        return prompts, 0
    kept = [p for p in prompts if len(p.ids) <= max_prompt_tokens]
    return kept, len(prompts) - len(kept)


def holds_control_text(tokenizer, text: str) -> bool:
    """Whether `text` holds the text of one of the tokenizer's special tokens."""
    return any(token in text for token in tokenizer.all_special_tokens)


def encode_marked(tokenizer, text: str, contents: Sequence[str]) -> List[int]:
    """Ids of `text` (no special tokens added), where `CONTENT_MARK.format(k)` stands for `contents[k]`: the
    text around the stand-ins keeps its special tokens, the contents are encoded as plain text."""
    pieces = re.split(CONTENT_MARK.format(r"(\d+)"), text)  # text, then a content's index, in turns
    ids = _text_ids(tokenizer, pieces[0], as_text=False)
    for index, after in zip(pieces[1::2], pieces[2::2]):
        ids += _text_ids(tokenizer, contents[int(index)], as_text=True) + _text_ids(tokenizer, after, as_text=False)
    return ids


def _text_ids(tokenizer, text: str, as_text: bool) -> List[int]:
    """`text`'s ids; with `as_text`, the text of a special token in it becomes plain tokens."""
    if not text:
        return []
    return list(tokenizer(text, add_special_tokens=False, split_special_tokens=as_text)["input_ids"])

"""Prompt data: the rows rollout workers draw prompts from, SFT trains on and evaluation scores.

`load_rows` gives a job's (train, test) rows, each a dict holding `prompt` (text) or `messages`
(a conversation: a list of {role, content}), usually `answer`, and any other fields the rewards
read (`tests`, ...). Rows come from the generated addition or tool_calc tasks, jsonl files, or a Hugging Face
dataset (`kind: hf`); the `data.*_key` fields map a dataset's own field names onto these.
Rollout workers draw training prompts in seeded epochs without replacement through the prompt
ledger (`rlplatform.scheduling.ledger`).
"""

from __future__ import annotations

import random
from typing import Dict, List, Tuple

from rlplatform.config import DataConfig
from rlplatform.data.addition import addition_rows, pair
from rlplatform.data.files import read_hf, read_jsonl
from rlplatform.data.tool_calc import tool_calc_rows

Row = Dict
ROLES = {"system", "user", "assistant", "tool"}  # the roles chat templates render

__all__ = ["Row", "addition_rows", "canonical_rows", "load_rows", "read_jsonl"]


def load_rows(config: DataConfig, seed: int) -> Tuple[List[Row], List[Row]]:
    """(train rows, held-out test rows) for a job, with `prompt`/`messages`/`answer` under those names."""
    if config.kind == "addition":
        return _addition(config, seed)
    if config.kind == "tool_calc":
        rng = random.Random(seed)
        return tool_calc_rows(config.train_size, rng), tool_calc_rows(config.test_size, rng)
    if config.kind == "jsonl":
        train, test = read_jsonl(config.train_path), read_jsonl(config.test_path)
        sources = (config.train_path, config.test_path)
    else:
        (train, test), sources = read_hf(config), (config.train_path or config.path, config.test_path or config.path)
    return canonical_rows(train, config, sources[0]), canonical_rows(test, config, sources[1])


def _addition(config: DataConfig, seed: int) -> Tuple[List[Row], List[Row]]:
    rng = random.Random(seed)
    if not config.disjoint_test:
        train = addition_rows(config.train_size, rng, config.digits)
        return train, addition_rows(config.test_size, rng, config.digits)
    test = addition_rows(config.test_size, rng, config.digits, distinct=True)
    train = addition_rows(config.train_size, rng, config.digits, exclude=frozenset(map(pair, test)))
    return train, test


def canonical_rows(rows: List[Row], config: DataConfig, source: str) -> List[Row]:
    """Rows with the mapped keys renamed to `prompt`, `messages` and `answer`, other fields kept; a row
    without a usable prompt is a ValueError naming its file and row (counted from 1, as lines are)."""
    renames = {config.prompt_key: "prompt", config.messages_key: "messages", config.answer_key: "answer"}
    out = []
    for i, row in enumerate(rows, 1):
        row = {renames.get(key, key): value for key, value in row.items()}
        if "prompt" not in row and "messages" not in row:
            raise ValueError(f"{source}: row {i} has neither '{config.prompt_key}' nor '{config.messages_key}' "
                             f"(fields: {sorted(rows[i - 1])}); set data.prompt_key or data.messages_key")
        if "messages" in row:
            _check_messages(row["messages"], source, i)
        elif not isinstance(row["prompt"], str) or not row["prompt"]:
            raise ValueError(f"{source}: row {i}: '{config.prompt_key}' must be non-empty text, "
                             f"got {type(row['prompt']).__name__} {str(row['prompt'])[:40]!r}")
        out.append(row)
    return out


def _check_messages(messages, source: str, index: int) -> None:
    if not isinstance(messages, list) or not messages or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages):
        raise ValueError(f"{source}: row {index}: 'messages' must be a non-empty list of "
                         f"{{'role': str, 'content': str}}")
    unknown = sorted({m["role"] for m in messages} - ROLES)
    if unknown:
        raise ValueError(f"{source}: row {index}: 'messages' has role {unknown[0]!r}; roles are {sorted(ROLES)}")

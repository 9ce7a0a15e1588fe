"""Prompt data: generated addition rows (correct, reproducible, with `disjoint_test` a held-out split
never trained on), Hugging Face datasets with mapped field names, conversation rows, and the seeded
epochs rollout workers draw prompts in."""

from __future__ import annotations

import json

import pytest

from rlplatform.config import ConfigError, DataConfig, load_config
from rlplatform.data import load_rows
from rlplatform.scheduling.ledger import prompt_row


def test_addition_rows_are_correct_and_reproducible():
    train, test = load_rows(DataConfig(train_size=300, test_size=50), seed=3)
    assert (train, test) == load_rows(DataConfig(train_size=300, test_size=50), seed=3)
    for row in train + test:
        a, b = row["prompt"].rstrip("=").split("+")
        assert row["answer"] == str(int(a) + int(b)) and 0 <= int(a) <= 99 and 0 <= int(b) <= 99


def test_test_rows_are_independent_draws_by_default():
    train, test = load_rows(DataConfig(digits=1, train_size=2000, test_size=40), seed=0)
    assert len({row["prompt"] for row in train}) == 100  # the whole 1-digit problem space is trained on


def test_held_out_problems_are_distinct_and_never_in_training():
    train, test = load_rows(DataConfig(digits=1, train_size=2000, test_size=40, disjoint_test=True), seed=0)
    test_prompts = [row["prompt"] for row in test]
    assert len(set(test_prompts)) == 40
    train_prompts = {row["prompt"] for row in train}
    assert not train_prompts & set(test_prompts)
    assert len(train_prompts) == 100 - 40  # every other 1-digit problem is trained on


def test_holding_out_more_than_half_the_problems_is_a_config_error():
    with pytest.raises(ConfigError, match="'data.test_size' is 60; at most 50"):
        load_config(None, ["data.digits=1", "data.test_size=60", "data.disjoint_test=true"])


ROWS = [{"question": f"{a}+{a}", "solution": f"{2 * a} in all", "tests": "assert True"} for a in range(6)]


def hf_config(**fields) -> DataConfig:
    return DataConfig(kind="hf", prompt_key="question", answer_key="solution", **fields)


def expected(rows):
    return [{"prompt": r["question"], "answer": r["solution"], "tests": r["tests"]} for r in rows]


@pytest.mark.parametrize("suffix", [".jsonl", ".json", ".parquet", ".csv"])
def test_hf_files_of_each_format_load_with_mapped_keys(tmp_path, suffix):
    from datasets import Dataset

    train_path, test_path = str(tmp_path / f"train{suffix}"), str(tmp_path / f"test{suffix}")
    for rows, path in ((ROWS[:4], train_path), (ROWS[4:], test_path)):
        dataset = Dataset.from_list(rows)
        {".jsonl": dataset.to_json, ".json": dataset.to_json, ".parquet": dataset.to_parquet,
         ".csv": dataset.to_csv}[suffix](path, **({"index": False} if suffix == ".csv" else {}))
    train, test = load_rows(hf_config(train_path=train_path, test_path=test_path), seed=0)
    assert train == expected(ROWS[:4]) and test == expected(ROWS[4:])


def test_hf_save_to_disk_splits_and_datasets(tmp_path):
    from datasets import Dataset, DatasetDict

    DatasetDict({"fit": Dataset.from_list(ROWS[:4]), "held": Dataset.from_list(ROWS[4:])}).save_to_disk(
        str(tmp_path / "dict"))
    train, test = load_rows(hf_config(path=str(tmp_path / "dict"), split="fit", test_split="held"), seed=0)
    assert train == expected(ROWS[:4]) and test == expected(ROWS[4:])
    with pytest.raises(ValueError, match="must name two of its splits"):
        load_rows(hf_config(path=str(tmp_path / "dict")), seed=0)
    Dataset.from_list(ROWS[:3]).save_to_disk(str(tmp_path / "one"))
    train, _ = load_rows(hf_config(train_path=str(tmp_path / "one"), test_path=str(tmp_path / "one")), seed=0)
    assert train == expected(ROWS[:3])


def test_conversation_rows_and_rows_without_a_prompt(tmp_path):
    path = tmp_path / "chat.jsonl"
    chat = {"dialog": [{"role": "user", "content": "1+1"}, {"role": "assistant", "content": "2"}], "answer": "2"}
    path.write_text(json.dumps(chat) + "\n")
    train, _ = load_rows(DataConfig(kind="jsonl", train_path=str(path), test_path=str(path),
                                    messages_key="dialog"), seed=0)
    assert train == [{"messages": chat["dialog"], "answer": "2"}]
    with pytest.raises(ValueError, match="row 1 has neither 'prompt' nor 'messages'"):
        load_rows(DataConfig(kind="jsonl", train_path=str(path), test_path=str(path)), seed=0)


def test_hf_config_needs_its_paths():
    with pytest.raises(ConfigError, match="set 'data.path'"):
        load_config(None, ["data.kind=hf"])


def test_epochs_draw_every_prompt_once_in_a_fresh_seeded_order():
    count = 11
    first = [prompt_row(p, count, seed=5) for p in range(count)]
    second = [prompt_row(p, count, seed=5) for p in range(count, 2 * count)]
    assert sorted(first) == sorted(second) == list(range(count))  # no prompt twice within an epoch
    assert first != second  # each epoch is shuffled anew
    assert first == [prompt_row(p, count, seed=5) for p in range(count)]  # the job's seed fixes the order
    assert first != [prompt_row(p, count, seed=6) for p in range(count)]

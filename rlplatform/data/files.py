"""Rows read from files: jsonl (`kind: jsonl`) and Hugging Face datasets (`kind: hf`).

`kind: hf` loads through the `datasets` library, offline: json/jsonl/parquet/csv files (the
format by extension) or directories written by `save_to_disk` (one Dataset per path, or a
DatasetDict at `data.path` split by `data.split`/`data.test_split`). Rows come back as dicts.
"""

from __future__ import annotations

import json
import os
from typing import Dict, List, Tuple

from rlplatform.config import DataConfig

FILE_FORMATS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}


def read_jsonl(path: str) -> List[Dict]:
    """The JSON object on each non-blank line; a ValueError naming the file and line otherwise."""
    rows = []
    with open(path, "rb") as f:
        for line_no, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                raise ValueError(f"{path}:{line_no}: not UTF-8 text (byte {err.start}: {err.reason})") from None
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{line_no}: not valid JSON: {err.msg} (column {err.colno})") from None
            if not isinstance(row, dict):
                raise ValueError(f"{path}:{line_no}: each line must be a JSON object")
            rows.append(row)
    return rows


def read_hf(config: DataConfig) -> Tuple[List[Dict], List[Dict]]:
    """(train rows, test rows) of a `kind: hf` data section."""
    if config.path:
        splits = _load_from_disk(config.path)
        missing = [s for s in (config.split, config.test_split) if s not in splits]
        if missing or not hasattr(splits, "keys"):
            found = sorted(splits.keys()) if hasattr(splits, "keys") else "a single Dataset"
            raise ValueError(f"data.path {config.path!r} holds {found}; data.split/data.test_split "
                             f"{config.split!r}/{config.test_split!r} must name two of its splits")
        return splits[config.split].to_list(), splits[config.test_split].to_list()
    return _read_one(config.train_path), _read_one(config.test_path)


def _read_one(path: str) -> List[Dict]:
    """The rows of one data file or one save_to_disk Dataset directory."""
    if os.path.isdir(path):
        dataset = _load_from_disk(path)
        if hasattr(dataset, "keys"):
            raise ValueError(f"{path!r} holds a DatasetDict with splits {sorted(dataset.keys())}; "
                             f"set data.path to it with data.split/data.test_split instead")
        return dataset.to_list()
    builder = FILE_FORMATS.get(os.path.splitext(path)[1].lower())
    if builder is None:
        raise ValueError(f"{path!r}: unknown data file type; expected one of {sorted(FILE_FORMATS)} "
                         f"or a save_to_disk directory")
    from datasets import load_dataset

    return load_dataset(builder, data_files=path, split="train").to_list()


def _load_from_disk(path: str):
    from datasets import load_from_disk

    try:
        return load_from_disk(path)
    except FileNotFoundError as err:
        raise ValueError(f"{path!r} is not a directory written by save_to_disk: {err}") from None

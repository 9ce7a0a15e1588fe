"""Fixtures for the built-in reward tests: samples with a given completion and row, and tiny
sequence classifiers built from config (demo character tokenizer, nothing downloaded)."""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Optional

import pytest
import torch

from rlplatform.transport.samples import Sample


@pytest.fixture
def make_sample() -> Callable[..., Sample]:
    def make(completion: str, prompt: str = "", **row) -> Sample:
        completion_ids = list(range(len(completion)))  # one token per character, like the demo tokenizer
        return Sample("g0/0", "g0", "policy", prompt, completion, prompt_ids=[], completion_ids=completion_ids,
                      behaviour_logprobs=[0.0] * len(completion_ids), token_versions=[0] * len(completion_ids), row=row)
    return make


@pytest.fixture(scope="session")
def tiny_classifier(tmp_path_factory) -> Callable[..., str]:
    """Saves a 2-layer Qwen2 sequence classifier and its tokenizer; returns the directory.

    Weights are random (seed 0) unless `make_head(model, tokenizer)` returns the score head's weight.
    """
    from transformers import Qwen2Config, Qwen2ForSequenceClassification

    from rlplatform.policy import demo_tokenizer

    def build(num_labels: int, make_head: Optional[Callable] = None) -> str:
        tokenizer = demo_tokenizer()
        torch.manual_seed(0)
        config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, num_labels=num_labels,
                             initializer_range=0.2, pad_token_id=tokenizer.pad_token_id)
        model = Qwen2ForSequenceClassification(config)
        if make_head is not None:
            model.score.weight.data = make_head(model, tokenizer)
        path = Path(tmp_path_factory.mktemp(f"classifier{num_labels}"))
        model.save_pretrained(path)
        tokenizer.save_pretrained(path)
        return str(path)
    return build

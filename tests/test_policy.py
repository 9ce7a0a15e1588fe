"""The policy helpers that track transformers' renames: a KV cache handed over under
`kv_cache_keyword` is the one the model fills (a name it ignored would leave the cache empty and
recompute every step), bare and inside peft, and neither it nor activation checkpointing goes
through a deprecated name of the installed transformers."""

from __future__ import annotations

import warnings

import pytest
import torch
from transformers import DynamicCache

from rlplatform.config import LoraConfig
from rlplatform.lora import with_adapters
from rlplatform.policy import enable_activation_checkpointing, kv_cache_keyword, load_policy


@pytest.mark.parametrize("adapters", [False, True])
def test_the_cache_passed_under_the_keyword_is_filled_without_deprecation(tiny_policy, adapters):
    model, tokenizer = load_policy(tiny_policy)
    if adapters:
        model = with_adapters(model, LoraConfig(enabled=True, rank=1, alpha=2.0))
    ids = torch.tensor([tokenizer("12+34=")["input_ids"]])
    cache = DynamicCache()
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        with torch.no_grad():
            model(input_ids=ids, use_cache=True, **{kv_cache_keyword(model): cache})
    assert cache.get_seq_length() == ids.shape[1]


def test_activation_checkpointing_is_on_without_deprecation(tiny_policy):
    model, _ = load_policy(tiny_policy)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        enable_activation_checkpointing(model)
    assert any(getattr(m, "gradient_checkpointing", False) for m in model.modules())

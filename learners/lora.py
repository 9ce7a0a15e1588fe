"""The learner's side of LoRA training: the KL reference without a second copy, and adapter snapshots.

With `model.lora` the rank's DeepSpeed engine wraps a peft model whose base weights are frozen. The
reference policy is that same engine with its adapters switched off (`AdaptersOff`), and what rank
0 publishes and saves is the adapters alone (`adapter_state`, gathered from their ZeRO-3 shards);
`save_adapters` writes the final ones as a peft directory and, on request, the merged model;
`copy_head_weight_per_call` lets ZeRO-3 recompute the frozen output head.
"""

from __future__ import annotations

import os
from typing import Dict, Optional

import torch

from rlplatform.config import LoraConfig
from rlplatform.lora import adapter_parameters, merged_policy
from rlplatform.transport.adapters import AdapterSnapshot
from rlplatform.transport.weights import from_snapshot


class AdaptersOff:
    """The learner's engine scored with its adapters disabled: the frozen base model, as a reference
    policy that `completion_logprobs` takes in place of a model and that holds no weights of its own."""

    def __init__(self, engine) -> None:
        self.engine, self.module = engine, engine.module

    def parameters(self):
        return self.engine.parameters()

    def __call__(self, **inputs):
        with self.module.disable_adapter():
            return self.engine(**inputs)


def adapter_state(engine, zero_stage: int, wanted: bool, dtype: torch.dtype) -> Optional[Dict[str, torch.Tensor]]:
    """Copies of the engine's adapter tensors in `dtype` (by their names in its state dict) when `wanted`;
    every rank must call under ZeRO-3, where each holds a shard."""
    params = adapter_parameters(engine.module)
    if zero_stage != 3:
        return {name: p.detach().to(dtype, copy=True) for name, p in params.items()} if wanted else None
    import deepspeed

    with deepspeed.zero.GatheredParameters(list(params.values())):
        return {name: p.detach().to(dtype, copy=True) for name, p in params.items()} if wanted else None


def save_adapters(snapshot: AdapterSnapshot, adapter_dir: str, merged_dir: Optional[str], tokenizer, base_path: str,
                  *, dtype: str, config: LoraConfig) -> None:
    """The final adapters as a peft directory on top of the base at `base_path` (with the tokenizer), and,
    when `merged_dir` is given, the base with them merged in as a plain Hugging Face model."""
    snapshot.config["base_model_name_or_path"] = os.path.abspath(base_path)
    snapshot.save(adapter_dir)
    tokenizer.save_pretrained(adapter_dir)
    if merged_dir is not None:
        model, _ = merged_policy(base_path, dtype, config, from_snapshot(snapshot))
        model.save_pretrained(merged_dir)
        tokenizer.save_pretrained(merged_dir)


def copy_head_weight_per_call(model: torch.nn.Module) -> None:
    """Let the frozen output head be recomputed under ZeRO-3. `completion_logprobs` recomputes the head chunk
    by chunk in backward; torch keeps a live reference to a frozen weight it saved, and ZeRO-3 frees that
    weight in place once the head's forward returns, so the recompute would find it empty. Each call of
    the head here multiplies by a copy of its (just gathered) weight instead."""
    head = model.get_output_embeddings()
    head.forward = lambda hidden: torch.nn.functional.linear(hidden, head.weight.clone(), head.bias)

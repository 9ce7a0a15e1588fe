"""LoRA weight snapshots: what the learner streams to rollout engines when only adapters train.

An `AdapterSnapshot` is a weight snapshot (a dict of arrays, read by `from_snapshot` like any
other) holding only the adapter tensors, under peft's names (those of `adapter_model.safetensors`),
plus the peft adapter config: enough for an engine that serves LoRA requests, which can `save`
it as a peft adapter directory. It is a small fraction of the model's bytes. An engine holding the
adapters as tensors writes them with `save_adapter_dir` directly: tensors stay tensors until a file is
needed.
"""

from __future__ import annotations

import json
import os
from typing import Dict

import torch
from safetensors.torch import save_file

from rlplatform.transport.weights import from_snapshot, to_snapshot


class AdapterSnapshot(dict):
    """Adapter arrays by peft name; `config` is the contents of peft's adapter_config.json."""

    def __init__(self, arrays: Dict, config: Dict) -> None:
        super().__init__(arrays)
        self.config = config

    @classmethod
    def of(cls, model, state: Dict[str, torch.Tensor]) -> "AdapterSnapshot":
        """The snapshot of a peft model's adapter `state` (tensors by their names in `model`'s state dict)."""
        from peft import get_peft_model_state_dict  # imported on first use, as in `rlplatform.lora`

        adapters = get_peft_model_state_dict(model, state_dict=state)
        return cls(to_snapshot(adapters), model.peft_config["default"].to_dict())

    def save(self, directory: str) -> None:
        """A peft adapter directory: adapter_model.safetensors and adapter_config.json."""
        save_adapter_dir(from_snapshot(self), self.config, directory)


def save_adapter_dir(tensors: Dict[str, torch.Tensor], config: Dict, directory: str) -> None:
    """A peft adapter directory of adapter tensors (peft names) and peft's adapter config."""
    os.makedirs(directory, exist_ok=True)
    save_file({name: tensor.contiguous() for name, tensor in tensors.items()},
              os.path.join(directory, "adapter_model.safetensors"))
    config = {key: sorted(value) if isinstance(value, set) else value for key, value in config.items()}
    with open(os.path.join(directory, "adapter_config.json"), "w") as f:
        json.dump(config, f, indent=1)

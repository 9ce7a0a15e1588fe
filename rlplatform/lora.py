"""LoRA adapters on a policy (peft): the learner trains them, rollout engines apply them.

`with_adapters` wraps a loaded Hugging Face policy with the adapters `model.lora` describes (in the
weights' own dtype in engines, in float32 in the learner); `adapter_parameters` names the trainable
tensors; `load_adapters` writes a streamed adapter state into a wrapped copy; `merged_policy` folds
saved adapters into a fresh copy of the base, giving a plain Hugging Face model. peft is imported
on first use: a job without LoRA never loads it (its import takes seconds in every process).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Dict, Optional

import torch

from rlplatform.config import LoraConfig
from rlplatform.policy import load_policy

if TYPE_CHECKING:
    from peft import LoraConfig as PeftLoraConfig
    from peft import PeftModel


def peft_config(config: LoraConfig) -> PeftLoraConfig:
    from peft import LoraConfig as PeftLoraConfig

    return PeftLoraConfig(r=config.rank, lora_alpha=config.alpha, lora_dropout=config.dropout,
                          target_modules=list(config.target_modules), task_type="CAUSAL_LM")


def with_adapters(model: torch.nn.Module, config: LoraConfig, adapter_dtype: Optional[torch.dtype] = None) -> PeftModel:
    """`model` frozen, with fresh adapters on `config.target_modules` (B = 0: the model's outputs are
    unchanged until they train) in `adapter_dtype` (None: the weights' own); only the adapters require gradients."""
    from peft import get_peft_model

    try:
        wrapped = get_peft_model(model, peft_config(config), autocast_adapter_dtype=False)
    except ValueError as err:
        raise ValueError(f"model.lora.target_modules {list(config.target_modules)} do not fit the model: {err}; "
                         f"name modules it has (e.g. q_proj, v_proj for Llama/Qwen-style models)") from None
    if adapter_dtype is not None:
        for param in adapter_parameters(wrapped).values():
            param.data = param.data.to(adapter_dtype)
    return wrapped


def adapter_parameters(model: torch.nn.Module) -> Dict[str, torch.nn.Parameter]:
    """The adapter tensors of a wrapped policy, by their names in its state dict."""
    return {name: param for name, param in model.named_parameters() if ".lora_" in name}


def load_adapters(model: PeftModel, state: Dict[str, torch.Tensor]) -> None:
    """Copy an adapter state (peft names, as `AdapterSnapshot` holds them) into a wrapped policy;
    every adapter tensor of the model must be in it."""
    from peft import set_peft_model_state_dict

    result = set_peft_model_state_dict(model, state)
    missing = [name for name in result.missing_keys if ".lora_" in name]
    if missing or result.unexpected_keys:
        raise ValueError(f"adapters do not fit the model: missing {missing[:4]}, unexpected "
                         f"{list(result.unexpected_keys)[:4]}; the rollout and learner model.lora settings differ")


def merged_policy(base_path: str, dtype: str, config: LoraConfig, state: Dict[str, torch.Tensor]):
    """(model, tokenizer): the base policy at `base_path` with the adapters `state` merged into its weights."""
    model, tokenizer = load_policy(base_path, dtype)
    wrapped = with_adapters(model, config)
    load_adapters(wrapped, state)
    return wrapped.merge_and_unload(), tokenizer

"""Policy models: the demo policy built from config, and loading any saved policy.

The demo policy is a small Qwen2 causal LM (with `model.num_experts`, a Qwen3-MoE: every layer's MLP a
mixture of experts) with a character-level tokenizer, built offline from `ModelConfig`; the controller saves the initial policy once in Hugging Face format, in
`model.dtype`, and every learner rank and rollout worker loads it from that directory in that dtype.
The engine and the learner call a model's forward and its activation checkpointing through the
names the installed transformers uses (`kv_cache_keyword`, `enable_activation_checkpointing`).
"""

from __future__ import annotations

import functools
import inspect
import os
from typing import List, Tuple

import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import (AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerFast, Qwen2Config,
                          Qwen2ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM)

from rlplatform.config import ModelConfig
from rlplatform.devices import resolve_dtype, torch_dtype

transformers.logging.set_verbosity_error()
transformers.logging.disable_progress_bar()

DEMO_CHARS = list("0123456789+-*=() abcdefghijklmnopqrstuvwxyz.,:?!")
DEMO_SPECIALS = ["<pad>", "<s>", "</s>"]


def demo_tokenizer(extra_chars: str = "") -> PreTrainedTokenizerFast:
    """One token per character (the default alphabet, then `extra_chars`); left padding for batched generation."""
    chars = DEMO_CHARS + [c for c in dict.fromkeys(extra_chars) if c not in DEMO_CHARS]
    vocab = {token: i for i, token in enumerate(DEMO_SPECIALS + chars)}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", bos_token="<s>",
                                   eos_token="</s>", padding_side="left")


def build_demo_policy(config: ModelConfig, seed: int) -> Tuple[PreTrainedModel, PreTrainedTokenizerFast]:
    tokenizer = demo_tokenizer(config.extra_chars)
    torch.manual_seed(seed)
    shape = dict(vocab_size=len(tokenizer), hidden_size=config.hidden_size,
                 intermediate_size=config.intermediate_size, num_hidden_layers=config.num_layers,
                 num_attention_heads=config.num_heads, num_key_value_heads=config.num_kv_heads,
                 max_position_embeddings=config.max_positions, tie_word_embeddings=True,
                 bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                 pad_token_id=tokenizer.pad_token_id)
    if not config.num_experts:
        return Qwen2ForCausalLM(Qwen2Config(**shape)), tokenizer
    moe = Qwen3MoeConfig(**shape, num_experts=config.num_experts, num_experts_per_tok=config.experts_per_token,
                         moe_intermediate_size=config.expert_size, norm_topk_prob=True,
                         router_aux_loss_coef=config.router_aux_loss_coef)
    return Qwen3MoeForCausalLM(moe), tokenizer


def save_initial_policy(config: ModelConfig, seed: int, out_dir: str) -> str:
    """Write the job's starting policy, in `config.dtype`, to `out_dir` and return the directory to load from
    (a job resolves `auto` by its learner's device first; here it is bfloat16 when this process sees a GPU)."""
    dtype = resolve_dtype(config.dtype, torch.cuda.device_count())
    if config.kind == "pretrained":
        model, tokenizer = load_policy(config.path, dtype)
    else:
        model, tokenizer = build_demo_policy(config, seed)
        model.to(torch_dtype(dtype))
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def load_tokenizer(path: str):
    """The directory's tokenizer.json exactly as saved, else whatever AutoTokenizer picks.

    AutoTokenizer chooses the class from the model type: transformers 5 gives every qwen2 model
    Qwen2Tokenizer whatever the directory declares, which would drop the demo tokenizer's spaces.
    """
    if os.path.isfile(os.path.join(path, "tokenizer.json")):
        return PreTrainedTokenizerFast.from_pretrained(path)
    return AutoTokenizer.from_pretrained(path)


def load_policy(path: str, dtype: str = "float32") -> Tuple[PreTrainedModel, PreTrainedTokenizerFast]:
    """The model in `dtype` (a `model.dtype` name) and its tokenizer, left-padding."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype(dtype))
    tokenizer = load_tokenizer(path)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer


def routers(model: torch.nn.Module) -> List[torch.nn.Module]:
    """A mixture-of-experts model's routers, first layer first (none in a dense model). A router maps a layer's
    token states to (router logits, the chosen experts' weights, the chosen experts' ids), one row per token, as
    a Qwen3-MoE layer's `mlp.gate` does; it carries `num_experts` and `top_k`."""
    return [module for module in model.modules()
            if hasattr(module, "top_k") and hasattr(module, "num_experts")
            and isinstance(getattr(module, "weight", None), torch.nn.Parameter)]


def experts_of(path: str) -> int:
    """The experts a layer of the saved model at `path` holds (0: a dense model)."""
    config = AutoConfig.from_pretrained(path)
    return int(getattr(config, "num_experts", 0) or getattr(config, "num_local_experts", 0) or 0)


def kv_cache_keyword(model: torch.nn.Module) -> str:
    """The keyword the causal LM in `model` (bare, or inside DeepSpeed or peft) takes its KV cache by:
    `cache` from transformers 5.24, `past_key_values` before it and in models that kept that name."""
    language_model = next(m for m in model.modules() if isinstance(m, PreTrainedModel))
    return _cache_keyword(type(language_model))


@functools.lru_cache(maxsize=None)
def _cache_keyword(model_class: type) -> str:
    """(Read once per model class: the learner asks at every scoring pass.)"""
    return "cache" if "cache" in inspect.signature(model_class.forward).parameters else "past_key_values"


def enable_activation_checkpointing(model: PreTrainedModel) -> None:
    """Recompute each layer's activations in the backward pass (non-reentrant checkpointing); the call was
    renamed in transformers 5.24 (`gradient_checkpointing_enable` before)."""
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})

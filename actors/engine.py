"""Generation engines: turn prompts into sampled completions with per-token behaviour log-probs.

`GenerationEngine` is the contract a rollout worker drives (`generate`, `load_weights`): prompts
come in as token ids (`rlplatform.tokenization` encodes them) and a completion ends at any of the
model's stop ids. `TransformersEngine` is the transformers engine (CPU or one GPU, in the policy's
dtype, log-probs in float32): a KV-cached continuous decode batch over a Hugging Face causal LM
(`DecodeBatch`, or `StaticDecodeBatch` with its slot cache and CUDA graphs where `rollout.kv_cache` picks it)
that records, for every token, its log-prob and the weight version that produced it (and a mixture-of-experts
policy's routing: `RoutingRecorder`). Between
decode steps it calls `between_steps`, which may load newer weights: sequences in progress
continue with them (in-flight weight update). With `model.lora` it holds the base model wrapped
with peft adapters, as the learner does, and each update loads the adapters alone. The vLLM engine
(`rlplatform.actors.vllm_engine`) is a second class; `build_engine` makes the one `rollout.engine` names.
"""

from __future__ import annotations

import importlib.util
from typing import Callable, Dict, Hashable, List, Optional, Protocol, Tuple

import torch

from rlplatform.actors.completions import Completion
from rlplatform.actors.decode_batch import DecodeBatch
from rlplatform.actors.routing_record import RoutingRecorder
from rlplatform.actors.static_decode import SlotDecoder, StaticDecodeBatch, static_decoding
from rlplatform.config import LoraConfig, RolloutConfig
from rlplatform.devices import resolve_device, share_kv_heads_on_cpu, vllm_memory_fraction
from rlplatform.learners.batching import completion_logprobs
from rlplatform.learners.token_distributions import completion_log_softmax, top_tokens
from rlplatform.lora import load_adapters, with_adapters
from rlplatform.policy import kv_cache_keyword, load_policy
from rlplatform.tokenization import stop_token_ids
from rlplatform.transport.weight_deltas import delta_of, load_delta
from rlplatform.transport.weights import load_weights


class ContinuousBatch(Protocol):
    """Sequences decoded together: prompts join with `add`, each `step` returns the ones that finished."""

    def __len__(self) -> int: ...

    def add(self, prompts: List[List[int]], keys: List[Hashable]) -> None: ...

    def step(self) -> List[Tuple[Hashable, Completion]]: ...


class GenerationEngine(Protocol):
    version: int  # version of the weights loaded now
    device: torch.device  # where the weights live (weight transports deliver them there)

    def decode_batch(self, max_new_tokens: int, temperature: float) -> ContinuousBatch: ...

    def generate(self, prompts: List[List[int]], samples_per_prompt: int, max_new_tokens: int, temperature: float,
                 between_steps: Optional[Callable[[], None]] = None) -> List[List[Completion]]: ...

    def load_weights(self, state_dict: Dict[str, torch.Tensor], version: int) -> None: ...

    def score(self, prompts: List[List[int]], completions: List[List[int]]) -> List[List[float]]: ...


def build_engine(rollout: RolloutConfig, model_path: str, dtype: str, seed: int,
                 lora: Optional[LoraConfig] = None, *, deltas: bool = False) -> GenerationEngine:
    """The engine `rollout.engine` names (`engine_kind`); vLLM is imported only when it is the one.
    `deltas`: weight updates may be deltas (`weights.delta`)."""
    if engine_kind(rollout, lora, dtype) == "vllm":
        from rlplatform.actors.vllm_engine import VLLMEngine

        share = (vllm_memory_fraction(rollout.gpu_memory_utilization, rollout.num_gpus) if torch.cuda.is_available()
                 else rollout.gpu_memory_utilization)
        return VLLMEngine(model_path, dtype, share, seed, lora, deltas=deltas)
    return TransformersEngine(model_path, rollout.device, dtype, lora, rollout.prefill_tokens,
                              kv_cache=rollout.kv_cache)


def engine_kind(rollout: RolloutConfig, lora: Optional[LoraConfig], dtype: str) -> str:
    """`rollout.engine` made concrete in this process: `auto` is vllm where the vllm package is installed, this
    process sees a CUDA GPU that `rollout.device` does not rule out, and vLLM's LoRA layers take the adapters
    (if any); transformers otherwise."""
    if rollout.engine != "auto":
        return rollout.engine
    from rlplatform.actors.vllm_engine import MAX_LORA_RANKS

    adapters_fit = lora is None or not lora.enabled or (lora.rank <= MAX_LORA_RANKS[-1] and dtype != "float32")
    return choose_engine(torch.cuda.is_available() and rollout.device != "cpu",
                         importlib.util.find_spec("vllm") is not None, adapters_fit)


def choose_engine(cuda: bool, vllm_installed: bool, adapters_fit: bool) -> str:
    """`rollout.engine: auto`'s rule: vllm where it can run the policy, transformers otherwise."""
    return "vllm" if cuda and vllm_installed and adapters_fit else "transformers"


class BatchGenerate:
    """`generate` for an engine with `decode_batch`: all completions of a list of prompts."""

    @torch.no_grad()
    def generate(self, prompts: List[List[int]], samples_per_prompt: int, max_new_tokens: int, temperature: float,
                 between_steps: Optional[Callable[[], None]] = None) -> List[List[Completion]]:
        """For each prompt (token ids), `samples_per_prompt` completions (one list per prompt)."""
        batch = self.decode_batch(max_new_tokens, temperature)
        rows = [p for p in prompts for _ in range(samples_per_prompt)]
        batch.add(rows, keys=list(range(len(rows))))
        completions: Dict[int, Completion] = {}
        while True:
            completions.update(batch.step())
            if not batch:
                break
            if between_steps is not None:
                between_steps()
        ordered = [completions[i] for i in range(len(completions))]
        return [ordered[i:i + samples_per_prompt] for i in range(0, len(ordered), samples_per_prompt)]


class TransformersEngine(BatchGenerate):
    """Batched sampling with `transformers` on `device` (auto, cpu or cuda: `resolve_device`) in
    `dtype` (a `model.dtype` name); temperature 0 means greedy. With `lora` enabled the model carries
    adapters (unmerged, computed as in the learner, so log-probs match) and weight updates are adapter states."""

    def __init__(self, model_path: str, device: str = "auto", dtype: str = "float32",
                 lora: Optional[LoraConfig] = None, prefill_tokens: int = RolloutConfig.prefill_tokens,
                 *, kv_cache: str = RolloutConfig.kv_cache) -> None:
        self.device = resolve_device(device)
        share_kv_heads_on_cpu(self.device)
        self.prefill_tokens = prefill_tokens  # padded prompt tokens one prefill forward runs at most
        self.model, self.tokenizer = load_policy(model_path, dtype)
        self.stop_ids = stop_token_ids(self.tokenizer, self.model.generation_config)
        self.adapters = lora is not None and lora.enabled
        if self.adapters:
            self.model = with_adapters(self.model, lora)
        self.model.to(self.device).eval()
        self.cache_keyword = kv_cache_keyword(self.model)
        self.recorder = RoutingRecorder.of(self.model)  # each generated token's experts (a mixture-of-experts policy)
        static = static_decoding(kv_cache, self.model, self.adapters)
        self.slot_decoder = SlotDecoder(self.model, self.device) if static else None
        self.version = -1

    def load_weights(self, state_dict: Dict[str, torch.Tensor], version: int) -> None:
        """Full weights, a delta from the version held (written in place), or with LoRA the adapters (peft
        names, as `AdapterSnapshot` holds them)."""
        if delta_of(state_dict) is not None:
            load_delta(self.model.state_dict(), state_dict, self.version)
        else:
            (load_adapters if self.adapters else load_weights)(self.model, state_dict)
        self.version = version

    def decode_batch(self, max_new_tokens: int, temperature: float) -> DecodeBatch:
        """An empty continuous batch on this engine's model: in the slot decoder's static cache where
        `rollout.kv_cache` chose it, else in a dynamic cache."""
        return (StaticDecodeBatch if self.slot_decoder else DecodeBatch)(self, max_new_tokens, temperature)

    def score(self, prompts: List[List[int]], completions: List[List[int]]) -> List[List[float]]:
        """Log-probs of each completion's tokens after its prompt, teacher-forced: the whole batch in one of the
        learner's scoring layouts (`completion_logprobs`), so the scores are the learner's computation."""
        with torch.no_grad():
            scores = completion_logprobs(self.model, prompts, completions, self.tokenizer.pad_token_id)
        return [row[mask.bool()].tolist() for row, mask in zip(scores.logprobs.float(), scores.mask)]

    def top_logprobs(self, prompts: List[List[int]], completions: List[List[int]], k: int,
                     temperature: float = 1.0) -> List[Tuple[List[float], List[List[int]], List[List[float]]]]:
        """Per completion, per token, teacher-forced after the prompt and the tokens before it: its log-prob, and
        the k ids this model found most likely at its position with theirs (`token_distributions.top_tokens`), from
        one pass of this model's logits / `temperature`."""
        with torch.no_grad():
            log_softmax = completion_log_softmax(self.model, prompts, completions, self.tokenizer.pad_token_id,
                                                 temperature)
        return top_tokens(log_softmax, prompts, completions, k)



"""Generation engines: turn prompts into sampled completions with per-token behaviour log-probs.

`GenerationEngine` is the contract a rollout worker drives (`generate`, `load_weights`): prompts
come in as token ids (`rlplatform.tokenization` encodes them) and a completion ends at any of the
model's stop ids. `TransformersEngine` is the transformers engine (CPU or one GPU, in the policy's
dtype, log-probs in float32): a KV-cached decode loop over a Hugging Face causal LM
that records, for every token, its log-prob and the weight version that produced it. Between
decode steps it calls `between_steps`, which may load newer weights: sequences in progress
continue with them (in-flight weight update). With `model.lora` it holds the base model wrapped
with peft adapters, as the learner does, and each update loads the adapters alone. The vLLM engine
(`rlplatform.actors.vllm_engine`) is a second class; `build_engine` makes the one `rollout.engine` names.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Hashable, List, Optional, Protocol, Sequence, Tuple

import torch
from transformers import DynamicCache

from rlplatform.config import LoraConfig, RolloutConfig
from rlplatform.devices import resolve_device
from rlplatform.lora import load_adapters, with_adapters
from rlplatform.policy import kv_cache_keyword, load_policy
from rlplatform.token_budget import micro_batches
from rlplatform.tokenization import stop_token_ids
from rlplatform.transport.weight_deltas import delta_of, load_delta
from rlplatform.transport.weights import load_weights


@dataclass
class Completion:
    prompt_ids: List[int]
    completion_ids: List[int]  # up to and including EOS when the model stopped
    text: str  # decoded completion, special tokens removed
    logprobs: List[float]  # behaviour log-prob of each completion token
    versions: List[int]  # weight version that generated each completion token
    completion_mask: List[int] = field(default_factory=list)  # multi-turn: 1 model token, 0 observation (Sample's)
    episode: Dict[str, Any] = field(default_factory=dict)  # multi-turn: per-episode fields for the sample's row


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
                 lora: Optional[LoraConfig] = None, deltas: bool = False) -> GenerationEngine:
    """The engine `rollout.engine` names (`engine_kind`); vLLM is imported only when it is the one.
    `deltas`: weight updates may be deltas (`weights.delta`)."""
    if engine_kind(rollout, lora, dtype) == "vllm":
        from rlplatform.actors.vllm_engine import VLLMEngine

        return VLLMEngine(model_path, dtype, rollout.gpu_memory_utilization, seed, lora, deltas)
    return TransformersEngine(model_path, rollout.device, dtype, lora, rollout.prefill_tokens)


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
                 lora: Optional[LoraConfig] = None, prefill_tokens: int = RolloutConfig.prefill_tokens) -> None:
        self.device = resolve_device(device)
        self.prefill_tokens = prefill_tokens  # padded prompt tokens one prefill forward runs at most
        self.model, self.tokenizer = load_policy(model_path, dtype)
        self.stop_ids = stop_token_ids(self.tokenizer, self.model.generation_config)
        self.adapters = lora is not None and lora.enabled
        if self.adapters:
            self.model = with_adapters(self.model, lora)
        self.model.to(self.device).eval()
        self.cache_keyword = kv_cache_keyword(self.model)
        self.version = -1

    def load_weights(self, state_dict: Dict[str, torch.Tensor], version: int) -> None:
        """Full weights, a delta from the version held (written in place), or with LoRA the adapters (peft
        names, as `AdapterSnapshot` holds them)."""
        if delta_of(state_dict) is not None:
            load_delta(self.model.state_dict(), state_dict, self.version)
        else:
            (load_adapters if self.adapters else load_weights)(self.model, state_dict)
        self.version = version

    def decode_batch(self, max_new_tokens: int, temperature: float) -> "DecodeBatch":
        """An empty continuous batch on this engine's model."""
        return DecodeBatch(self, max_new_tokens, temperature)

    def score(self, prompts: List[List[int]], completions: List[List[int]]) -> List[List[float]]:
        """Log-probs of each completion's tokens after its prompt, teacher-forced, one sequence at a time."""
        scores = []
        with torch.no_grad():
            for prompt, completion in zip(prompts, completions):
                ids = torch.tensor([prompt + completion], device=self.device)
                logits = self.model(input_ids=ids).logits[0, len(prompt) - 1:-1].float()
                targets = ids[0, len(prompt):].unsqueeze(1)
                scores.append(logits.log_softmax(-1).gather(1, targets).squeeze(1).tolist())
        return scores


@dataclass
class _Row:
    key: Hashable  # the caller's tag for this sequence
    prompt_ids: List[int]
    max_new_tokens: int
    temperature: float
    tokens: List[int] = field(default_factory=list)
    logprobs: List[float] = field(default_factory=list)
    versions: List[int] = field(default_factory=list)


class DecodeBatch:
    """Sequences decoded together, one token each per `step` (continuous batching).

    New prompts may join before any step; a sequence leaves the batch the step it emits a stop id or
    reaches `max_new_tokens`, so short completions free their slot for new work instead of
    waiting for the longest one. The rows stay left-padded: joining rows are padded to the
    batch's length (or the batch to theirs), and columns no row attends to any more are cut.
    Each step's logits come from the weights loaded at that step, which are the version its
    tokens record: weights may change between steps.
    """

    def __init__(self, engine: TransformersEngine, max_new_tokens: int, temperature: float) -> None:
        self.model, self.engine = engine.model, engine
        self.stop_ids = torch.tensor(engine.stop_ids, dtype=torch.long, device=engine.device)
        self.pad_id = engine.tokenizer.pad_token_id
        self.max_new_tokens, self.temperature = max_new_tokens, temperature
        self.rows: List[_Row] = []
        self.waiting: List[Tuple[List[int], Hashable, int, float]] = []  # (prompt ids, key, limit, temperature)
        self.cache: Optional[DynamicCache] = None
        self.device = engine.device
        # (rows, cache length + 1 when rows have a token to feed)
        self.attention = torch.zeros(0, 0, dtype=torch.long, device=self.device)
        self.positions = torch.zeros(0, 1, dtype=torch.long, device=self.device)  # each row's next token position
        self.last_tokens = torch.zeros(0, dtype=torch.long, device=self.device)  # newest tokens, not yet in the cache

    def __len__(self) -> int:
        return len(self.rows) + len(self.waiting)

    def add(self, prompts: List[List[int]], keys: List[Hashable], max_new_tokens: Optional[int] = None,
            temperature: Optional[float] = None) -> None:
        """Queue prompts (token ids) to join at the next step; each finished completion comes back with its key.
        `max_new_tokens` and `temperature` apply to these rows only (unset: the batch's)."""
        limit = self.max_new_tokens if max_new_tokens is None else max_new_tokens
        temperature = self.temperature if temperature is None else temperature
        self.waiting.extend((prompt, key, limit, temperature) for prompt, key in zip(prompts, keys))

    @torch.no_grad()
    def step(self) -> List[Tuple[Hashable, Completion]]:
        """Sample one token for every sequence; returns the sequences that finished, with their keys."""
        logits = []
        if self.rows:
            out = self.model(input_ids=self.last_tokens[:, None], attention_mask=self.attention,
                             position_ids=self.positions, use_cache=True, **{self.engine.cache_keyword: self.cache})
            logits.append(out.logits[:, -1])
        if self.waiting:
            logits.append(self._prefill_waiting())
        if not logits:
            return []
        temperatures = [r.temperature for r in self.rows]
        token, logprob = _sample(torch.cat(logits).float(), torch.tensor(temperatures, device=self.device),
                                 any(t > 0 for t in temperatures))
        stopped = torch.isin(token, self.stop_ids)
        # one transfer from the device per step: each row's token, its log-prob and whether it is a stop id
        tokens, logprobs, stops = torch.stack([token.double(), logprob.double(), stopped.double()]).tolist()
        finished = []
        for row, t, lp, stop in zip(self.rows, tokens, logprobs, stops):
            row.tokens.append(int(t))
            row.logprobs.append(lp)
            row.versions.append(self.engine.version)
            finished.append(bool(stop) or len(row.tokens) >= row.max_new_tokens)
        done = [(row.key, self._completion(row)) for row, f in zip(self.rows, finished) if f]
        self._keep(finished, token)
        return done

    def _prefill_waiting(self) -> torch.Tensor:
        """Run the waiting prompts through the model and merge them into the batch; their last logits.
        Each distinct prompt runs once: rows of the same prompt (a group's completions) share its cache."""
        prompts, keys, limits, temperatures = zip(*self.waiting)
        self.waiting = []
        distinct: Dict[Tuple[int, ...], int] = {}
        owner = torch.tensor([distinct.setdefault(tuple(p), len(distinct)) for p in prompts], device=self.device)
        cache, attention, logits = self._prefill([list(p) for p in distinct])
        positions = (attention.cumsum(-1) - 1).clamp(min=0)
        if len(distinct) < len(prompts):
            cache = DynamicCache(ddp_cache_data=[(layer.keys[owner], layer.values[owner]) for layer in cache.layers])
            attention, positions, logits = attention[owner], positions[owner], logits[owner]
        new_rows = [_Row(key, list(prompt), limit, temperature)
                    for key, prompt, limit, temperature in zip(keys, prompts, limits, temperatures)]
        if self.rows:
            # the old rows' newest tokens are in their cache now; both parts are `width` columns long, left-padded
            width = max(attention.shape[1], self.attention.shape[1])
            cache = _merge_caches([self.cache, cache], width)
            attention = torch.cat([_pad_left(self.attention, width), _pad_left(attention, width)])
            positions = torch.cat([self.positions, positions[:, -1:]])
        else:
            positions = positions[:, -1:]
        self.cache, self.attention, self.positions = cache, attention, positions
        self.rows += new_rows
        return logits

    def _prefill(self, prompts: List[List[int]]) -> Tuple[DynamicCache, torch.Tensor, torch.Tensor]:
        """(KV cache, attention mask, last-position logits) of prompts left-padded to the longest, computed
        in chunks of consecutive prompts of at most the engine's `prefill_tokens` padded tokens each (a longer
        prompt alone), so no forward holds more; only the last position goes through the output head."""
        chunks = micro_batches([len(p) for p in prompts], self.engine.prefill_tokens, padded=True)
        caches, masks, logits = [], [], []
        for chunk in chunks:
            ids, attention = _left_padded([prompts[i] for i in chunk], self.pad_id, self.device)
            cache = DynamicCache()
            logits.append(self.model(input_ids=ids, attention_mask=attention, use_cache=True, logits_to_keep=1,
                                     position_ids=(attention.cumsum(-1) - 1).clamp(min=0),
                                     **{self.engine.cache_keyword: cache}).logits[:, -1])
            caches.append(cache)
            masks.append(attention)
        if len(chunks) == 1:
            return caches[0], masks[0], logits[0]
        width = max(mask.shape[1] for mask in masks)
        return (_merge_caches(caches, width), torch.cat([_pad_left(mask, width) for mask in masks]),
                torch.cat(logits))

    def _keep(self, finished: List[bool], token: torch.Tensor) -> None:
        """Drop finished rows, and columns no remaining row attends to; the rest get their new token.
        A step where no row finished touches neither the cache nor the host."""
        if not any(finished):
            self.attention = torch.cat([self.attention, torch.ones_like(self.attention[:, :1])], dim=1)
            self.positions = self.positions + 1
            self.last_tokens = token
            return
        self.rows = [row for row, f in zip(self.rows, finished) if not f]
        if not self.rows:
            self.cache, self.attention = None, self.attention[:0]
            return
        index = torch.tensor([i for i, f in enumerate(finished) if not f], device=self.device)
        attention = self.attention[index]
        first = int(attention.any(0).float().argmax())
        for layer in self.cache.layers:
            layer.keys = layer.keys[index, :, first:]
            layer.values = layer.values[index, :, first:]
        self.attention = torch.cat([attention[:, first:], torch.ones_like(attention[:, :1])], dim=1)
        self.positions = self.positions[index] + 1
        self.last_tokens = token[index]

    def _completion(self, row: _Row) -> Completion:
        return Completion(prompt_ids=row.prompt_ids, completion_ids=row.tokens,
                          text=self.engine.tokenizer.decode(row.tokens, skip_special_tokens=True),
                          logprobs=row.logprobs, versions=row.versions)


def _left_padded(prompts: Sequence[List[int]], pad_id: int, device: torch.device
                 ) -> Tuple[torch.Tensor, torch.Tensor]:
    """(ids, attention mask) of token-id prompts, left-padded to the longest."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, prompt in enumerate(prompts):
        ids[i, width - len(prompt):] = torch.tensor(prompt, dtype=torch.long)
        attention[i, width - len(prompt):] = 1
    return ids.to(device), attention.to(device)


def _pad_left(tensor: torch.Tensor, width: int) -> torch.Tensor:
    """Zero columns on the left of a (rows, length) mask up to `width`."""
    return torch.nn.functional.pad(tensor, (width - tensor.shape[1], 0))


def _merge_caches(caches: List[DynamicCache], width: int) -> DynamicCache:
    """One cache holding each cache's rows in turn, each left-padded with zeros to `width` positions."""
    pad = lambda t: torch.nn.functional.pad(t, (0, 0, width - t.shape[2], 0))  # noqa: E731
    return DynamicCache(ddp_cache_data=[(torch.cat([pad(layer.keys) for layer in layers]),
                                         torch.cat([pad(layer.values) for layer in layers]))
                                        for layers in zip(*(cache.layers for cache in caches))])


def _sample(logits: torch.Tensor, temperatures: torch.Tensor, any_sampled: bool):
    """(token, its log-prob) per row: multinomial at the row's temperature, argmax where it is 0.
    `any_sampled`: whether some temperature is above 0 (known on the host, so the device is not asked)."""
    sampled = temperatures > 0
    logprobs = torch.log_softmax(logits / torch.where(sampled, temperatures, 1.0)[:, None], dim=-1)
    token = logprobs.argmax(-1)
    if any_sampled:
        token = torch.where(sampled, torch.multinomial(logprobs.exp(), 1).squeeze(-1), token)
    return token, logprobs.gather(-1, token[:, None]).squeeze(-1)

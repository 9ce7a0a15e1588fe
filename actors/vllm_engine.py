"""The vLLM generation engine (`rollout.engine: vllm`): a rollout worker's GPU engine, driven like
`TransformersEngine` through a continuous batch that yields finished completions step by step.

vLLM runs in the worker's process (no engine-core subprocess, synchronous scheduling) and advances one
engine step per `step` call, with its own continuous batching and prefix caching. Each token's log-prob
is vLLM's processed log-prob, after temperature: the distribution the learner recomputes. New weights load
between two steps through `LLM.apply_model` into the model's own `load_weights`; then the prefix cache is
reset, preempting running requests so they continue (recomputed, never dropped) under the new weights.
Every token therefore records the version that produced it.

With `model.lora` vLLM serves LoRA requests: each version's streamed adapters (peft names) are written as a
peft adapter directory (`AdapterVersions`) and every request added afterwards carries a `LoRARequest` with
a new id. Requests in flight follow the same rule as for full weights: they are re-added with their tokens
so far as prompt under the new adapters (recomputed, never dropped).
"""

from __future__ import annotations

import importlib.util
import itertools
import os
import shutil
import tempfile
from typing import Dict, Hashable, List, Optional, Tuple

import torch
from transformers import GenerationConfig

from rlplatform.actors.completions import Completion, Row
from rlplatform.actors.engine import BatchGenerate
from rlplatform.config import LoraConfig
from rlplatform.lora import peft_config
from rlplatform.policy import load_tokenizer
from rlplatform.tokenization import stop_token_ids
from rlplatform.transport.adapters import save_adapter_dir
from rlplatform.transport.weight_deltas import changed_names, delta_of, load_delta

MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # the values vLLM's LoRAConfig.max_lora_rank takes


def require_vllm() -> None:
    """A one-line error when this process cannot run vLLM: no CUDA device, or no vllm package."""
    if not torch.cuda.is_available():
        raise RuntimeError(f"rollout.engine: vllm needs a CUDA GPU, but this process sees none (torch "
                           f"{torch.__version__}); use rollout.engine: transformers on CPU machines")
    if importlib.util.find_spec("vllm") is None:
        raise RuntimeError("rollout.engine: vllm needs the vllm package: pip install -e '.[vllm]', or use "
                           "rollout.engine: transformers")


class AdapterVersions:
    """Each version's adapters (peft names) as a peft adapter directory under a private temporary folder,
    the form vLLM loads a `LoRARequest` from, with a fresh positive id per write."""

    def __init__(self, lora: LoraConfig) -> None:
        self.config = peft_config(lora).to_dict()
        self.root = tempfile.mkdtemp(prefix="rlp-adapters-")
        self.ids = itertools.count(1)

    def write(self, state: Dict[str, torch.Tensor], version: int) -> Tuple[str, int, str]:
        """(name, id, directory) of adapters `state` loaded as `version`; names are unique, as vLLM needs."""
        lora_id = next(self.ids)
        name = f"v{version}-{lora_id}"
        directory = os.path.join(self.root, name)
        save_adapter_dir(state, self.config, directory)
        return name, lora_id, directory


def max_lora_rank(rank: int) -> int:
    """The smallest rank vLLM accepts as `max_lora_rank` that holds adapters of `rank`."""
    fitting = [r for r in MAX_LORA_RANKS if r >= rank]
    if not fitting:
        raise ValueError(f"model.lora.rank {rank} is above vLLM's largest LoRA rank {MAX_LORA_RANKS[-1]}")
    return fitting[0]


class VLLMEngine(BatchGenerate):
    """vLLM on this process's GPU in `dtype`; `gpu_memory_utilization` is the share of GPU memory it takes.
    With `lora` enabled, weight updates are adapter states served as LoRA requests. With `deltas`, the
    engine keeps a copy of the weights under Hugging Face names (vLLM fuses and shards them, so a
    delta's flat positions only make sense there) and reloads each weight a delta changes."""

    def __init__(self, model_path: str, dtype: str, gpu_memory_utilization: float, seed: int,
                 lora: Optional[LoraConfig] = None, deltas: bool = False) -> None:
        require_vllm()
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core steps in this process, when told to
        from vllm import LLM

        self.adapters = AdapterVersions(lora) if lora is not None and lora.enabled else None
        lora_args = {}
        if self.adapters is not None:  # one adapter at a time: requests in flight move to each new version
            lora_args = dict(enable_lora=True, max_lora_rank=max_lora_rank(lora.rank), max_loras=1)
        self.llm = LLM(model=model_path, dtype=dtype, seed=seed, gpu_memory_utilization=gpu_memory_utilization,
                       enable_prefix_caching=True, async_scheduling=False, logprobs_mode="processed_logprobs",
                       **lora_args)
        self.lora_request = None  # the LoRARequest of the adapters loaded now (with LoRA, after the first update)
        self.tokenizer = load_tokenizer(model_path)
        self.stop_ids = stop_token_ids(self.tokenizer, _generation_config(model_path))
        self.device = torch.device("cuda", torch.cuda.current_device())
        self.version = -1
        self.served: Optional[Dict[str, torch.Tensor]] = {} if deltas else None  # with deltas: the weights held
        self.request_ids = itertools.count()
        self._batch = None  # the one batch whose requests the engine runs

    def load_weights(self, state_dict: Dict[str, torch.Tensor], version: int) -> None:
        """Weights (Hugging Face names; on any device) into the model between steps, then a fresh prefix cache;
        with LoRA, the adapters (peft names) as the LoRA request of every request from now on."""
        if self.adapters is not None:
            self._load_adapters(state_dict, version)
        elif delta_of(state_dict) is not None:
            load_delta(self.served, state_dict, self.version)
            self._load_full({name: self.served[name] for name in changed_names(state_dict)})
        else:
            if self.served is not None:
                self.served = {name: t.to(self.device).clone() for name, t in state_dict.items()}
            self._load_full(state_dict)
        self.version = version

    def _load_adapters(self, state: Dict[str, torch.Tensor], version: int) -> None:
        from vllm.lora.request import LoRARequest

        previous = self.lora_request
        name, lora_id, directory = self.adapters.write(state, version)
        self.lora_request = LoRARequest(lora_name=name, lora_int_id=lora_id, lora_path=directory)
        if self._batch is not None:
            self._batch.follow_adapters()
        if previous is not None:
            self.llm.llm_engine.remove_lora(previous.lora_int_id)
            shutil.rmtree(previous.lora_path, ignore_errors=True)

    def _load_full(self, state_dict: Dict[str, torch.Tensor]) -> None:
        weights = [(name, tensor.to(self.device, non_blocking=True)) for name, tensor in state_dict.items()]
        self.llm.apply_model(lambda model: model.load_weights(weights=weights))
        torch.cuda.synchronize(self.device)
        if not self.llm.reset_prefix_cache(reset_running_requests=True):
            raise RuntimeError("vLLM did not reset its prefix cache after a weight update")

    def score(self, prompts: List[List[int]], completions: List[List[int]]) -> List[List[float]]:
        """Log-probs of each completion's tokens after its prompt, teacher-forced (vLLM's prompt log-probs,
        under the adapters loaded now); the batch's requests are set aside meanwhile and re-added after
        (recomputed, never dropped), since the engine steps every request it holds."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        rows = self._batch.set_aside() if self._batch is not None else []
        try:
            outputs = self.llm.generate([TokensPrompt(prompt_token_ids=p + c) for p, c in zip(prompts, completions)],
                                        SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False),
                                        lora_request=self.lora_request, use_tqdm=False)
        finally:
            if rows:
                self._batch.resume(rows)
        return [[output.prompt_logprobs[len(p) + i][token].logprob for i, token in enumerate(c)]
                for output, p, c in zip(outputs, prompts, completions)]

    def decode_batch(self, max_new_tokens: int, temperature: float) -> "VLLMBatch":
        """An empty continuous batch; requests of an earlier batch still running are aborted."""
        if self._batch is not None and self._batch.rows:
            self.llm.llm_engine.abort_request(list(self._batch.rows))
        self._batch = VLLMBatch(self, max_new_tokens, temperature)
        return self._batch


class VLLMBatch:
    """Requests decoded together by vLLM: prompts join with `add`, each `step` is one engine step and
    returns the completions that finished in it, with their keys."""

    def __init__(self, engine: VLLMEngine, max_new_tokens: int, temperature: float) -> None:
        self.engine = engine
        self.max_new_tokens, self.temperature = max_new_tokens, temperature
        self.rows: Dict[str, Row] = {}  # request id -> its sequence so far

    def __len__(self) -> int:
        return len(self.rows)

    def add(self, prompts: List[List[int]], keys: List[Hashable], max_new_tokens: Optional[int] = None,
            temperature: Optional[float] = None) -> None:
        """Requests for prompts (token ids); `max_new_tokens` and `temperature` apply to these rows only
        (unset: the batch's)."""
        limit = self.max_new_tokens if max_new_tokens is None else max_new_tokens
        temperature = self.temperature if temperature is None else temperature
        for prompt, key in zip(prompts, keys):
            self._submit(Row(key, list(prompt), limit, temperature))

    def follow_adapters(self) -> None:
        """Re-add every request under the engine's current LoRA request, its tokens so far as prompt and
        the rest of its length to go: recomputed, never dropped."""
        self.resume(self.set_aside())

    def set_aside(self) -> List[Row]:
        """Abort every request, keeping its sequence so far for `resume`."""
        if not self.rows:
            return []
        self.engine.llm.llm_engine.abort_request(list(self.rows))
        rows, self.rows = list(self.rows.values()), {}
        return rows

    def resume(self, rows: List[Row]) -> None:
        """Re-add `rows` (from `set_aside`), each with its tokens so far as prompt."""
        for row in rows:
            self._submit(row)

    def _submit(self, row: Row) -> None:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        params = SamplingParams(temperature=row.temperature, max_tokens=row.max_new_tokens - len(row.tokens),
                                logprobs=0, stop_token_ids=self.engine.stop_ids, detokenize=False,
                                output_kind=RequestOutputKind.DELTA)
        request_id = str(next(self.engine.request_ids))
        self.rows[request_id] = row
        prompt = TokensPrompt(prompt_token_ids=row.prompt_ids + row.tokens)
        self.engine.llm.llm_engine.add_request(request_id, prompt, params, lora_request=self.engine.lora_request)

    def step(self) -> List[Tuple[Hashable, Completion]]:
        """One engine step: every running request's new token, recorded with the version loaded now."""
        if not self.rows:
            return []
        done = []
        for output in self.engine.llm.llm_engine.step():
            row = self.rows.get(output.request_id)
            if row is None:
                continue
            new = output.outputs[0]
            row.tokens += new.token_ids
            row.logprobs += [float(step[token].logprob) for token, step in zip(new.token_ids, new.logprobs)]
            row.versions += [self.engine.version] * len(new.token_ids)
            if output.finished:
                done.append((row.key, self._completion(self.rows.pop(output.request_id))))
        return done

    def _completion(self, row: Row) -> Completion:
        return Completion(prompt_ids=row.prompt_ids, completion_ids=row.tokens,
                          text=self.engine.tokenizer.decode(row.tokens, skip_special_tokens=True),
                          logprobs=row.logprobs, versions=row.versions)


def _generation_config(model_path: str):
    """The model's generation config (its EOS ids), or None when the folder has none."""
    try:
        return GenerationConfig.from_pretrained(model_path)
    except OSError:
        return None

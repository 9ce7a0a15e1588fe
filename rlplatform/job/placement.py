"""The job's plan: each policy's `auto` settings resolved once, for the Ray cluster the job runs on.

`plan_job` reads the loaded config and the cluster's resources once, at start-up, and decides for every
policy: the GPUs each learner rank and each generating actor (rollout worker, evaluator) reserves (`gpu_shares`
where a whole GPU each does not fit), `model.dtype`, how bfloat16 trains (`learner.bf16_mode`) and the ZeRO stage,
and the weight transport. A `PolicyPlan` holds the policy's config with those values filled in (a copy: the
loaded config is never changed, so `runs/<name>/config.yaml` is what the user gave) and the transport strategy
built from it; the controller hands both to the learner, the rollout actors, the weight store and the
evaluator. The job prints the plan in one block at start and writes it to `runs/<name>/plan.yaml` and W&B's
config.

Two `auto`s stay with the actor, which alone can see them: `rollout.engine` (vllm where the actor's process
sees a CUDA GPU and vLLM is installed there) and `rollout.kv_cache` (the slot decoder where it runs the model),
as does the micro-batch budget the learner device's free memory allows.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import Any, Dict, List, Optional, Union

from omegaconf import OmegaConf

from rlplatform.config import JobConfig, LearnerConfig, PolicyConfig
from rlplatform.devices import gpu_shares, gpus_per_actor, resolve_dtype
from rlplatform.transport.weight_transports import WeightTransport, resolved_transport, weight_transport

PLAN_FILE = "plan.yaml"


@dataclass(frozen=True)
class PolicyPlan:
    """One policy as it runs on this cluster: `policy` is its config with every cluster-dependent `auto`
    resolved (dtype, GPU shares, bf16 mode, ZeRO stage, weight transport)."""
    policy: PolicyConfig
    transport: WeightTransport  # `weights.transport`'s strategy, built once
    generating_actors: int  # rollout workers and, where the job evaluates, its evaluator

    @property
    def name(self) -> str:
        return self.policy.name

    @property
    def learner_gpus(self) -> float:
        """GPUs each learner rank reserves."""
        return self.policy.learner.num_gpus

    @property
    def rollout_gpus(self) -> float:
        """GPUs each rollout worker, evaluator and elastic worker reserves."""
        return self.policy.rollout.num_gpus

    def described(self) -> Dict[str, Any]:
        """What was decided, as plain data: plan.yaml's entry for the policy."""
        learner, rollout = self.policy.learner, self.policy.rollout
        dtype = self.policy.model.dtype
        workers = rollout.num_workers if self.policy.rl.enabled else 0  # SFT alone starts none
        return {"model.dtype": dtype,
                "learner": {"num_ranks": learner.num_ranks, "num_gpus": learner.num_gpus,
                            "zero_stage": learner.zero_stage,
                            "precision": _precision(learner, dtype)},
                "rollout": {"num_workers": workers, "max_workers": (rollout.max_workers or workers) if workers else 0,
                            "generating_actors": self.generating_actors,
                            "num_gpus": rollout.num_gpus, "engine": rollout.engine, "kv_cache": rollout.kv_cache},
                "weights.transport": self.transport.name}


@dataclass(frozen=True)
class JobPlan:
    """Every policy's plan, and how the cluster's GPUs are shared among them."""
    policies: Dict[str, PolicyPlan]
    cluster_gpus: float
    sharing: Optional[str]  # a line saying which GPU shares were set for the user; None: none

    def of(self, policy: Union[str, PolicyConfig]) -> PolicyPlan:
        return self.policies[policy if isinstance(policy, str) else policy.name]

    def described(self) -> Dict[str, Any]:
        return {"cluster_gpus": self.cluster_gpus, "policies": {name: plan.described()
                                                                for name, plan in self.policies.items()}}

    def write(self, run_dir: str) -> None:
        with open(os.path.join(run_dir, PLAN_FILE), "w") as f:
            f.write(OmegaConf.to_yaml(OmegaConf.create(self.described())))

    def lines(self) -> List[str]:
        """The block the job prints at start: one line per policy."""
        lines = []
        for name, plan in self.policies.items():
            about = plan.described()
            learner, rollout = about["learner"], about["rollout"]
            workers = f"{rollout['num_workers']}" + (f"-{rollout['max_workers']}"
                                                     if rollout["max_workers"] > rollout["num_workers"] else "")
            lines.append(f"plan {name}: {about['model.dtype']}, {learner['precision']}, learner {learner['num_ranks']} "
                         f"rank(s) x {learner['num_gpus']:g} GPU (ZeRO-{learner['zero_stage']}), rollout {workers} "
                         f"worker(s) + {rollout['generating_actors'] - rollout['num_workers']} evaluator x "
                         f"{rollout['num_gpus']:g} GPU (engine {rollout['engine']}, kv_cache {rollout['kv_cache']}), "
                         f"weights by {about['weights.transport']}")
        return lines + ([self.sharing] if self.sharing else [])


def plan_job(config: JobConfig, cluster: Dict[str, float], cuda_here: bool) -> JobPlan:
    """Each policy of `config` planned for a Ray cluster of `cluster` resources (`ray.cluster_resources()`);
    `cuda_here`: whether this process sees a CUDA GPU (the one GPU Ray declares may not be one)."""
    cluster_gpus = cluster.get("GPU", 0.0)
    policies = config.policy_list()
    learner_gpus, rollout_gpus, sharing = _gpu_plan(config, policies, cluster_gpus)
    plans = {}
    for policy in policies:
        dtype = resolve_dtype(policy.model.dtype, learner_gpus[policy.name])
        learner = replace(policy.learner, num_gpus=learner_gpus[policy.name],
                          bf16_mode=_bf16_mode(policy.learner, dtype),
                          zero_stage=policy.learner.effective_zero_stage(dtype))
        rollout = replace(policy.rollout, num_gpus=rollout_gpus[policy.name])
        fixed = (rollout.max_workers or 0) <= rollout.num_workers  # elastic workers come and go: not on one GPU
        one_gpu = cluster_gpus == 1 and cuda_here and fixed and learner.num_ranks == 1 \
            and learner.num_gpus > 0 and rollout.num_gpus > 0
        weights = replace(policy.weights, transport=resolved_transport(policy.weights, one_gpu,
                                                                       policy.model.lora.enabled))
        resolved = replace(policy, model=replace(policy.model, dtype=dtype), learner=learner, rollout=rollout,
                           weights=weights)
        plans[policy.name] = PolicyPlan(resolved, weight_transport(weights), config.generating_actors(policy))
    return JobPlan(plans, cluster_gpus, sharing)


def check_fits(config: JobConfig, plan: JobPlan, cluster: Dict[str, float], cpus: float) -> None:
    """The Ray cluster holds the `cpus`, the GPUs and the custom resources the planned actors reserve, else a
    message saying what to change."""
    have_cpus, have_gpus = cluster.get("CPU", 0.0), cluster.get("GPU", 0.0)
    if have_cpus < cpus:
        raise RuntimeError(f"the Ray cluster has {have_cpus:g} CPUs but the job's actors reserve {cpus:g} "
                           f"(learner.num_cpus, rollout.num_cpus, reward_workers.num_cpus); "
                           f"lower them or give the cluster more CPUs")
    for name, amount in custom_resources_needed(config).items():
        if cluster.get(name, 0.0) < amount:
            raise RuntimeError(f"the Ray cluster has {cluster.get(name, 0.0):g} of resource '{name}' but the job's "
                               f"actors reserve {amount:g} (learner.resources, rollout.resources, "
                               f"reward_workers.resources); start nodes "
                               f"with `ray start --resources '{{\"{name}\": {amount:g}}}'` or change those keys")
    gpus = gpus_needed(plan)
    if have_gpus < gpus:
        raise RuntimeError(f"the Ray cluster has {have_gpus:g} GPUs but the job's actors reserve {gpus:g} "
                           f"(learner.num_gpus per rank, rollout.num_gpus per rollout worker and evaluator; unset, "
                           f"they share what the cluster has, but several learner ranks need a whole GPU each); "
                           f"lower them, use fewer learner ranks or device: cpu, or give the cluster more GPUs")


def gpus_needed(plan: JobPlan) -> float:
    """Ray GPUs the planned actors reserve: per policy its ranks, rollout workers and evaluator."""
    return sum(p.policy.learner.num_ranks * p.learner_gpus + p.generating_actors * p.rollout_gpus
               for p in plan.policies.values())


def custom_resources_needed(config: JobConfig) -> Dict[str, float]:
    """Custom Ray resources the job's actors reserve: per reward worker, and per policy per rank, rollout
    worker and evaluator."""
    needed: Dict[str, float] = {}
    holders = [(config.reward_workers.num_workers, config.reward_workers.resources)]
    for p in config.policy_list():
        holders += [(p.learner.num_ranks, p.learner.resources), (config.generating_actors(p), p.rollout.resources)]
    for count, resources in holders:
        for name, amount in resources.items():
            needed[name] = needed.get(name, 0.0) + count * amount
    return needed


def _gpu_plan(config: JobConfig, policies: List[PolicyConfig], cluster_gpus: float):
    """({policy: GPUs per learner rank}, {policy: GPUs per generating actor}, the sharing line or None). Set
    `num_gpus` are kept; unset ones are a whole GPU on a GPU device, none on the CPU, except where a whole GPU
    per rank, rollout worker and evaluator does not fit the cluster: then the unset ones of GPU actors become
    shares (`gpu_shares`)."""
    learner_gpus = {p.name: gpus_per_actor(p.learner.device, p.learner.num_gpus, cluster_gpus) for p in policies}
    rollout_gpus = {p.name: gpus_per_actor(p.rollout.device, p.rollout.num_gpus, cluster_gpus) for p in policies}
    learners = [p for p in policies if p.learner.num_gpus is None and learner_gpus[p.name] > 0]
    rollouts = [p for p in policies if p.rollout.num_gpus is None and rollout_gpus[p.name] > 0]
    reserved = sum(p.learner.num_ranks * (p.learner.num_gpus or 0)
                   + config.generating_actors(p) * (p.rollout.num_gpus or 0) for p in policies)
    per_rank, per_actor = gpu_shares(cluster_gpus, reserved, sum(p.learner.num_ranks for p in learners),
                                     sum(config.generating_actors(p) for p in rollouts),
                                     all(p.learner.num_ranks == 1 for p in learners))
    if per_rank == per_actor == 1.0:
        return learner_gpus, rollout_gpus, None
    learner_gpus.update({p.name: per_rank for p in learners})
    rollout_gpus.update({p.name: per_actor for p in rollouts})
    parts = ([f"learner.num_gpus {per_rank:g} per rank"] if learners else []) + \
        ([f"rollout.num_gpus {per_actor:g} per rollout worker and evaluator"] if rollouts else [])
    s = "s" if cluster_gpus != 1 else ""
    return learner_gpus, rollout_gpus, f"sharing {cluster_gpus:g} GPU{s}: {', '.join(parts)} (set them to choose)"


def _bf16_mode(learner: LearnerConfig, dtype: str) -> str:
    """`learner.bf16_mode` made concrete for bfloat16 weights (as `LearnerConfig.master_weights` decides); kept
    as set for any other dtype, which it does not concern."""
    if dtype != "bfloat16":
        return learner.bf16_mode
    return "master_weights" if learner.master_weights(dtype) else "autocast"


def _precision(learner: LearnerConfig, dtype: str) -> str:
    if learner.master_weights(dtype):
        return f"{dtype} weights over float32 masters"
    return "float32 weights under bfloat16 autocast" if dtype == "bfloat16" else f"{dtype} weights"

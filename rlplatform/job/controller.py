"""The job controller: starts a job's services and workers, runs its stages, writes its results.

`run_job` is what `rlp run` calls. It starts (or joins) Ray and Redis, saves the initial
policy, runs SFT then asynchronous RL with evaluations after each, saves the checkpoint and
the final Hugging Face model, and always writes `summary.json`, also when the job fails.
"""

from __future__ import annotations

import json
import math
import os
import time
from contextlib import ExitStack
from typing import Dict, List, Optional

import ray

from rlplatform.config import JobConfig, PolicyConfig, to_yaml
from rlplatform.data import load_rows
from rlplatform.job.rl_loop import run_rl
from rlplatform.job.sft import run_sft
from rlplatform.job.workers import Evaluator, PolicyWorkers, publish
from rlplatform.learners.group import LearnerGroup
from rlplatform.monitoring.job_status import JobStatus
from rlplatform.monitoring.metrics import Metrics
from rlplatform.policy import save_initial_policy
from rlplatform.transport.redis_server import EmbeddedRedis, connect
from rlplatform.transport.reward_queue import PolicyKeys, RewardQueue
from rlplatform.transport.staleness import RolloutGate
from rlplatform.transport.weights import WeightStore


def run_job(config: JobConfig, started_at: Optional[float] = None) -> Dict:
    """Run the whole job; returns the summary that is also written to summary.json. `started_at`
    (wall clock, default now) is when start-up began: `rlp run` passes its process's start."""
    started_at = started_at or time.time()
    run_dir = config.run_dir
    os.makedirs(run_dir, exist_ok=True)
    with open(os.path.join(run_dir, "config.yaml"), "w") as f:
        f.write(to_yaml(config))
    start = time.perf_counter()
    summary: Dict = {"status": "running", "name": config.name, "run_dir": os.path.abspath(run_dir)}
    metrics: Optional[Metrics] = None
    try:
        with ExitStack() as resources:
            redis_url = _start_services(config, resources)
            summary["startup_s"] = {"services_ready_s": round(time.time() - started_at, 2)}  # Redis and Ray up
            _record_redis_url(redis_url, run_dir)
            metrics = Metrics(config, run_dir)
            metrics.console.note(f"job status from anywhere: rlp status --redis \"$(cat {run_dir}/redis.url)\" "
                                 f"--job {config.name}")
            metrics.status = JobStatus(connect(redis_url), config.name)
            summary["wandb_dir"] = metrics.wandb_dir
            try:
                _run_stages(config, redis_url, metrics, summary, started_at)
                summary["status"] = "completed"
            finally:
                final = summary["status"] if summary["status"] == "completed" else "failed"
                metrics.status.write({"stage": final, "wall_s": round(time.perf_counter() - start, 2)})
    except BaseException as err:
        summary.update(status="failed", error=f"{type(err).__name__}: {err}")
        raise
    finally:
        summary["wall_s"] = round(time.perf_counter() - start, 2)
        if metrics is not None:
            metrics.summary(_flat(summary))
            metrics.finish(failed=summary["status"] != "completed")
        with open(os.path.join(run_dir, "summary.json"), "w") as f:
            json.dump(summary, f, indent=2)
    return summary


def _record_redis_url(url: str, run_dir: str) -> None:
    """The job's Redis URL (with its password) for `rlp status`, readable by the owner only."""
    path = os.path.join(run_dir, "redis.url")
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(descriptor, "w") as f:
        f.write(url + "\n")


def _start_services(config: JobConfig, resources: ExitStack) -> str:
    """Reach or start Redis; join or start Ray; returns the Redis URL. Stopped on exit."""
    if config.redis.url:
        connect(config.redis.url)  # fails early with a clear message if unreachable
        redis_url = config.redis.url
    else:
        redis_url = resources.enter_context(EmbeddedRedis()).url
    needed = _cpus_needed(config)
    if not ray.is_initialized():
        if config.ray.address or os.environ.get("RAY_ADDRESS"):
            ray.init(address=config.ray.address, include_dashboard=False)
        else:
            ray.init(num_cpus=max(os.cpu_count() or 1, math.ceil(needed)), include_dashboard=False)
        resources.callback(ray.shutdown)
    available = ray.cluster_resources().get("CPU", 0.0)
    if available < needed:
        raise RuntimeError(f"the Ray cluster has {available:g} CPUs but the job's actors reserve {needed:g} "
                           f"(learner.num_cpus, rollout.num_cpus, reward_workers.num_cpus); "
                           f"lower them or give the cluster more CPUs")
    return redis_url


def _cpus_needed(config: JobConfig) -> float:
    """Ray CPUs the job's actors reserve: reward workers, and per policy its ranks, rollout workers and evaluator."""
    return config.reward_workers.num_workers * config.reward_workers.num_cpus + sum(
        p.learner.num_ranks * p.learner.num_cpus + (p.rollout.num_workers + 1) * p.rollout.num_cpus
        for p in config.policy_list())


def _run_stages(config: JobConfig, redis_url: str, metrics: Metrics, summary: Dict, started_at: float) -> None:
    train_rows, test_rows = load_rows(config.data, config.seed)
    client = connect(redis_url)
    queue = _open_queue(config, client)
    policies: List[PolicyWorkers] = []
    reward_actors: List = []
    try:
        reward_actors = _start_reward_workers(config, redis_url)
        for policy in config.policy_list():
            policies.append(_start_policy(config, policy, train_rows, test_rows, redis_url, client))
        summary["startup_s"]["workers_ready_s"] = round(time.time() - started_at, 2)  # every actor constructed
        results = {p.name: {"stages": {}, "eval": {}} for p in policies}
        for workers in policies:
            _supervised_stage(config, workers, train_rows, metrics, client, results[workers.name])
        if any(p.config.rl.enabled for p in policies):
            _rl_stage(config, [p for p in policies if p.config.rl.enabled], queue, reward_actors, metrics,
                      train_rows, results)
        for workers in policies:
            policy_dir = os.path.abspath(config.policy_dir(workers.name))
            workers.learner.save(os.path.join(policy_dir, "checkpoint"), os.path.join(policy_dir, "model"))
        summary["startup_s"].update(_startup(results, started_at))
        summary.update(results[policies[0].name])  # a one-policy job's figures sit at the top level
        if config.policies:
            summary["policies"] = results
    finally:
        queue.request_stop()
        queue.clear()
        _stop(policies, reward_actors)


def _open_queue(config: JobConfig, client) -> RewardQueue:
    from rlplatform.rewards.worker import job_rewards_json

    queue = RewardQueue(client, config.name, config.redis.max_stream_len)
    queue.reset()
    queue.create_group()
    queue.publish_rewards(job_rewards_json(config.rewards, config.imports))
    return queue


def _start_reward_workers(config: JobConfig, redis_url: str) -> List:
    from rlplatform.rewards.worker import RewardActor

    return [RewardActor.options(num_cpus=config.reward_workers.num_cpus).remote(
        f"{config.name}-reward-{i}", config.rewards, redis_url, config.name, config.reward_workers, config.imports)
        for i in range(config.reward_workers.num_workers)]


def _start_policy(config: JobConfig, policy: PolicyConfig, train_rows, test_rows, redis_url: str,
                  client) -> PolicyWorkers:
    """A policy's initial weights on disk, its learner ranks, rollout workers and evaluator."""
    from rlplatform.actors.rollout import RolloutActor

    model_path = save_initial_policy(policy.model, config.seed,
                                     os.path.join(config.policy_dir(policy.name), "initial_policy"))
    store = WeightStore.remote()
    rollout = [RolloutActor.options(num_cpus=policy.rollout.num_cpus).remote(
        i, policy.name, model_path, train_rows, policy.rl, policy.rollout, redis_url, config.name, store, config.seed)
        for i in range(policy.rollout.num_workers + 1)]
    learner = LearnerGroup(policy.learner, model_path, config.seed)
    gate = RolloutGate(client, config.name, policy.rl.max_staleness, policy.rl.batch_prompts, policy.name)
    evaluator = Evaluator(rollout.pop(), test_rows, config.eval)
    return PolicyWorkers(policy, learner, rollout, store, gate, evaluator, PolicyKeys(config.name, policy.name))


def _supervised_stage(config: JobConfig, workers: PolicyWorkers, train_rows, metrics: Metrics, client,
                      result: Dict) -> None:
    """SFT (when enabled), then version 0 published and evaluated."""
    if workers.config.sft.enabled:
        stage = "sft" if not config.policies else f"{workers.name}/sft"
        result["stages"]["sft"] = run_sft(workers.config.sft, workers.learner, train_rows, metrics, config.seed,
                                          stage, lambda: workers.evaluator.score(workers.learner.publish_weights()))
    publish(workers, client, 0)
    result["eval"]["after_sft"] = _evaluate(workers, metrics, "after_sft")


def _rl_stage(config: JobConfig, policies: List[PolicyWorkers], queue: RewardQueue, reward_actors: List,
              metrics: Metrics, train_rows, results: Dict) -> None:
    figures = run_rl(config, policies, queue, reward_actors, metrics, train_rows)
    for workers in policies:
        rl = figures[workers.name]
        results[workers.name]["stages"]["rl"] = {"steps": rl["steps"], "wall_s": rl["wall_s"]}
        results[workers.name]["rl"] = {**rl, "wandb_dir": metrics.wandb_dir}
        results[workers.name]["eval"]["after_rl"] = _evaluate(workers, metrics, "after_rl")


def _stop(policies: List[PolicyWorkers], reward_actors: List) -> None:
    for actor in reward_actors:
        ray.kill(actor)
    for workers in policies:
        for actor in workers.rollout + [workers.evaluator.actor, workers.weight_store]:
            ray.kill(actor)
        workers.learner.shutdown()


def _evaluate(workers: PolicyWorkers, metrics: Metrics, label: str) -> Dict:
    """Greedy accuracy of the policy's newest published weights on the held-out rows."""
    version, accuracy = workers.evaluator.run_now()
    metrics.console.note(f"eval {workers.name} {label}: greedy accuracy {accuracy:.3f} on "
                         f"{len(workers.evaluator.rows)} held-out rows (policy version {version})")
    return {"accuracy": accuracy, "policy_version": version}


def _startup(results: Dict, started_at: float) -> Dict[str, Optional[float]]:
    """Seconds from start-up to the first SFT and the first RL learner step (of any policy);
    moves each stage's `first_step_at` clock reading out of the per-policy figures."""
    firsts: Dict[str, List[float]] = {"sft": [], "rl": []}
    for result in results.values():
        for stage, figures in (("sft", result["stages"].get("sft", {})), ("rl", result.get("rl", {}))):
            at = figures.pop("first_step_at", None)
            if at is not None:
                firsts[stage].append(at)
    return {f"to_first_{stage}_step_s": round(min(times) - started_at, 2) if times else None
            for stage, times in firsts.items()}


def _flat(summary: Dict, prefix: str = "") -> Dict:
    flat = {}
    for key, value in summary.items():
        if isinstance(value, dict):
            flat.update(_flat(value, f"{prefix}{key}/"))
        else:
            flat[f"{prefix}{key}"] = value
    return flat

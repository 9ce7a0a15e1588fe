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
from typing import Dict, Optional

import ray

from rlplatform.config import JobConfig, to_yaml
from rlplatform.data import load_rows
from rlplatform.learners.group import LearnerGroup
from rlplatform.job_status import JobStatus
from rlplatform.metrics import Metrics
from rlplatform.policy import save_initial_policy
from rlplatform.redis_server import EmbeddedRedis, connect
from rlplatform.reward_queue import RewardQueue
from rlplatform.rl_loop import Evaluator, RLWorkers, publish, run_rl
from rlplatform.sft import run_sft
from rlplatform.staleness import RolloutGate
from rlplatform.weights import WeightStore

POLICY = "policy"


def run_job(config: JobConfig) -> Dict:
    """Run the whole job; returns the summary that is also written to summary.json."""
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
            _record_redis_url(redis_url, run_dir)
            metrics = Metrics(config, run_dir)
            metrics.console.note(f"job status from anywhere: rlp status --redis \"$(cat {run_dir}/redis.url)\" "
                                 f"--job {config.name}")
            metrics.status = JobStatus(connect(redis_url), config.name)
            summary["wandb_dir"] = metrics.wandb_dir
            try:
                _run_stages(config, redis_url, metrics, summary)
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
    if not ray.is_initialized():
        needed = (config.learner.num_ranks * config.learner.num_cpus
                  + (config.rollout.num_workers + 1) * config.rollout.num_cpus
                  + config.reward_workers.num_workers * config.reward_workers.num_cpus)
        if config.ray.address or os.environ.get("RAY_ADDRESS"):
            ray.init(address=config.ray.address, include_dashboard=False)
        else:
            ray.init(num_cpus=max(os.cpu_count() or 1, math.ceil(needed)), include_dashboard=False)
        resources.callback(ray.shutdown)
    return redis_url


def _run_stages(config: JobConfig, redis_url: str, metrics: Metrics, summary: Dict) -> None:
    run_dir = config.run_dir
    model_path = save_initial_policy(config.model, config.seed, os.path.join(run_dir, "initial_policy"))
    train_rows, test_rows = load_rows(config.data, config.seed)
    workers = _start_workers(config, model_path, train_rows, test_rows, redis_url)
    try:
        summary["stages"] = {}
        if config.sft.enabled:
            summary["stages"]["sft"] = run_sft(config.sft, workers.learner, train_rows, metrics, config.seed)
        publish(workers, 0)
        summary["eval"] = {"after_sft": _evaluate(workers, metrics, "after_sft")}
        if config.rl.enabled:
            rl = run_rl(config, workers, metrics, POLICY, train_rows)
            summary["stages"]["rl"] = {"steps": rl["steps"], "wall_s": rl["wall_s"]}
            summary["rl"] = {**rl, "wandb_dir": metrics.wandb_dir}
            summary["eval"]["after_rl"] = _evaluate(workers, metrics, "after_rl")
        workers.learner.save(os.path.abspath(os.path.join(run_dir, "checkpoint")),
                             os.path.abspath(os.path.join(run_dir, "model")))
    finally:
        workers.queue.request_stop()
        workers.queue.clear()
        for actor in workers.rollout + workers.reward + [workers.evaluator.actor, workers.weight_store]:
            ray.kill(actor)
        workers.learner.shutdown()


def _start_workers(config: JobConfig, model_path: str, train_rows, test_rows, redis_url: str) -> RLWorkers:
    from rlplatform.actors.rollout import RolloutActor
    from rlplatform.rewards.worker import RewardActor, job_rewards_json

    client = connect(redis_url)
    queue = RewardQueue(client, config.name, config.redis.max_stream_len)
    queue.reset()
    queue.create_group()
    queue.publish_rewards(job_rewards_json(config.rewards, config.imports))
    store = WeightStore.remote()
    rollout = [RolloutActor.options(num_cpus=config.rollout.num_cpus).remote(
        i, POLICY, model_path, train_rows, config.rl, config.rollout, redis_url, config.name, store, config.seed)
        for i in range(config.rollout.num_workers + 1)]
    reward = [RewardActor.options(num_cpus=config.reward_workers.num_cpus).remote(
        f"{config.name}-reward-{i}", config.rewards, redis_url, config.name, config.reward_workers, config.imports)
        for i in range(config.reward_workers.num_workers)]
    learner = LearnerGroup(config.learner, model_path, config.seed)
    gate = RolloutGate(client, config.name, config.rl.max_staleness, config.rl.batch_prompts)
    evaluator = Evaluator(rollout.pop(), test_rows, config.eval)
    return RLWorkers(learner, rollout, reward, store, queue, gate, evaluator)


def _evaluate(workers: RLWorkers, metrics: Metrics, label: str) -> Dict:
    """Greedy accuracy of the newest published weights on the held-out rows."""
    version, accuracy = workers.evaluator.run_now()
    metrics.log("eval", version, {"accuracy": accuracy, f"accuracy_{label}": accuracy})
    metrics.console.note(f"eval {label}: greedy accuracy {accuracy:.3f} on {len(workers.evaluator.rows)} "
                         f"held-out rows (policy version {version})")
    return {"accuracy": accuracy, "policy_version": version}


def _flat(summary: Dict, prefix: str = "") -> Dict:
    flat = {}
    for key, value in summary.items():
        if isinstance(value, dict):
            flat.update(_flat(value, f"{prefix}{key}/"))
        else:
            flat[f"{prefix}{key}"] = value
    return flat

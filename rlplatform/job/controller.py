"""The job controller: starts a job's services and workers, runs its stages, writes its results.

`run_job` is what `rlp run` calls. It starts (or joins) Ray and Redis, saves the initial
policy, runs SFT then asynchronous RL with evaluations after each (or continues RL from the
run's newest intact checkpoint, setting corrupt ones aside), saves the checkpoint and the final
Hugging Face model, and always writes `summary.json`, also when the job fails or a signal stops it
(status `interrupted`; `failed` where the stop's checkpoint found the disk full).
"""

from __future__ import annotations

import json
import os
import signal
import time
from contextlib import ExitStack
from dataclasses import replace
from functools import partial
from typing import Callable, Dict, List, Optional, Tuple

import ray
import torch

from rlplatform.config import ConfigError, JobConfig, PolicyConfig, to_yaml
from rlplatform.data import load_rows
from rlplatform.job.checkpoint import (DiskFull, checkpoints_dir, intact_checkpoint, latest_checkpoint, read_state,
                                       remove_partial)
from rlplatform.job.cluster import cpus_needed, shutdown_ray as stop_ray, start_ray
from rlplatform.job.placement import JobPlan, PolicyPlan, check_fits, plan_job
from rlplatform.job.run_dir import RunLock, check_fresh_start, move_aside, run_id
from rlplatform.job.rl_loop import STOP_GRACE_S, Resume, StageFailed, run_rl
from rlplatform.job.sft import run_sft
from rlplatform.job.signals import Interrupted, StopSignals
from rlplatform.job.summaries import (JobSummary, PolicyResults, RLSummary, SFTSummary, StartupTimes,
                                     first_eval_label, plain_text)
from rlplatform.job.supervision import MAX_RESTARTS, RestartDeadline, ServiceWatch
from rlplatform.job.workers import Evaluator, PolicyWorkers, publish
from rlplatform.learners.group import LearnerGroup
from rlplatform.monitoring.job_status import JobStatus, StatusLine
from rlplatform.monitoring.metrics import Metrics
from rlplatform.monitoring.watchdog import (deadline_rule, dump_path, dump_process_state, hang_rule, rank_processes,
                                            watched_call)
from rlplatform.policy import load_tokenizer, save_initial_policy
from rlplatform.tokenization import encode_prompts, save_prompts, within_limit
from rlplatform.transport.deadlines import LEARNER_TIMEOUT_S, Heartbeats, JobFailed, LearnerDied, LearnerHung
from rlplatform.transport.job_lease import JobLease
from rlplatform.transport.redis_server import EmbeddedRedis, RedisUnavailable, connect
from rlplatform.transport.keys import PolicyKeys, run_scope
from rlplatform.transport.reward_queue import RewardQueue
from rlplatform.transport.run_keys import end_run, start_run
from rlplatform.transport.weight_store import WeightStoreActor


class JobEnded(JobFailed):
    """The job failed after its stages began; `results` are its policies' results as they stood; `redis_lost`: the
    job's Redis went away."""

    def __init__(self, message: str, results: Dict[str, PolicyResults], exit_code: int = 1,
                 redis_lost: bool = False) -> None:
        super().__init__(message)
        self.results, self.exit_code, self.redis_lost = results, exit_code, redis_lost


def run_job(config: JobConfig, started_at: Optional[float] = None, shutdown_ray: Optional[bool] = None,
            fresh: bool = False) -> Dict:
    """Run the whole job; returns the summary that is also written to summary.json. `started_at`
    (wall clock, default now) is when start-up began: `rlp run` passes its process's start.
    `shutdown_ray`: whether the job disconnects from Ray at its very end, while its signal handlers still
    hold (default: when Ray was not initialized before, so the job starts or joins it itself).
    The job holds its run directory's lock throughout; `fresh`: first move what an earlier run left there
    aside (else a run directory holding checkpoints, not resumed, stops the job before it starts)."""
    with RunLock(config.run_dir):
        if fresh:
            move_aside(config.run_dir)
        check_fresh_start(config)
        return _run_locked(config, started_at or time.time(), shutdown_ray)


def _run_locked(config: JobConfig, started_at: float, shutdown_ray: Optional[bool]) -> Dict:
    run_dir = config.run_dir
    with open(os.path.join(run_dir, "config.yaml"), "w") as f:
        f.write(to_yaml(config))
    start = time.perf_counter()
    startup = StartupTimes(started_at)
    startup.mark("job_started_s")  # interpreter, config, imports
    metrics: Optional[Metrics] = None
    remove_partial(run_dir)  # what a writer killed mid-checkpoint left
    resume = find_resume(config)
    summary = JobSummary(config.name, os.path.abspath(run_dir), run_id(run_dir, resuming=resume is not None),
                         startup, several_policies=bool(config.policies))  # a resumed run keeps its keys
    run = run_scope(config.name, summary.run_id)
    stop = StopSignals()
    if shutdown_ray is None:
        shutdown_ray = not ray.is_initialized()
    try:
        stop.install()  # kept until the summary is out and Ray is left
        with ExitStack() as resources:
            redis_url, embedded, plan = _start_services(config, summary.run_id, resources)
            startup.mark("services_ready_s")  # Redis and Ray up
            record_redis_url(redis_url, run_dir)
            plan.write(run_dir)
            learners = {name: _start_learner(config, p) for name, p in plan.policies.items()}  # set up in _start_policy
            metrics = Metrics(config, run_dir, run_id=resume.state.wandb_run_id if resume else None,
                              plan=plan.described())
            for line in resume.set_aside if resume else []:
                metrics.event("checkpoint_set_aside", line)
            metrics.console.note(f"job status: rlp status {run_dir}")
            for line in plan.lines():
                metrics.console.note(line)
            if embedded is not None:
                embedded.keep_alive(lambda text: metrics.event("redis_restart", text))
            metrics.status = JobStatus(connect(redis_url, config.redis.reconnect_s), run)
            summary.wandb_dir = metrics.wandb_dir
            try:
                summary.results = _run_stages(config, plan, run, redis_url, learners, metrics=metrics,
                                              startup=startup, stop=stop, resume=resume)
                summary.status = "interrupted" if stop.requested else "completed"
            except JobEnded as ended:
                summary.results = ended.results
                if ended.redis_lost and embedded is not None:  # the one line also says what became of the server
                    state = dump_process_state(embedded.pid, dump_path(run_dir, "redis-server", embedded.pid))
                    raise JobEnded(f"{ended}; {state}", ended.results, ended.exit_code, True) from None
                raise
            finally:
                final = summary.status if summary.status != "running" else "failed"
                try:
                    metrics.status.write(StatusLine(final, wall_s=round(time.perf_counter() - start, 2)))
                except RedisUnavailable:  # the job's error says so
                    pass
    except Interrupted as err:
        failing = err.__context__  # a first signal while a failure was ending the job: the failure stands
        if not isinstance(failing, (JobFailed, DiskFull)):
            summary.status, summary.error = "interrupted", str(err)
        else:
            summary.status, summary.error = "failed", plain_text(f"{type(failing).__name__}: {failing}")
            summary.exit_code = getattr(failing, "exit_code", None)
            raise failing from None
    except BaseException as err:
        if not stop.requested or isinstance(err, DiskFull):  # the stop's own checkpoint could not be written
            summary.status, summary.error = "failed", plain_text(f"{type(err).__name__}: {err}")
            summary.exit_code = getattr(err, "exit_code", None)
            raise
        # a signal's Interrupted raised inside library code can surface as another error
        summary.status, summary.error = "interrupted", f"stopped by {signal.Signals(stop.signum).name}"
    finally:
        summary.wall_s = round(time.perf_counter() - start, 2)
        if stop.requested and summary.status != "failed":
            summary.exit_code = stop.exit_code
        shown = summary.to_json()
        try:
            with open(os.path.join(run_dir, "summary.json"), "w") as f:  # first: a further signal cannot lose it
                json.dump(shown, f, indent=2)
            if metrics is not None:
                metrics.summary(_flat(shown))
                metrics.finish(failed=summary.status != "completed")
        finally:
            if shutdown_ray and ray.is_initialized():
                stop_ray()  # last: Ray's shutdown resets SIGTERM to the default beneath Python's handler
            stop.restore()  # and this sets the handlers the job found back
    return shown


def find_resume(config: JobConfig) -> Optional[Resume]:
    """The checkpoint this run continues from, as `resume` asks: never, auto (if any), always; the newest intact
    one, any newer set aside (`intact_checkpoint`). Where checkpoints lie but none is intact, the job stops."""
    if config.resume == "never":
        return None
    set_aside: List[str] = []
    checkpoint = intact_checkpoint(config.run_dir, set_aside.append)
    if checkpoint is None:
        if set_aside:
            raise ConfigError(f"resume: no checkpoint under {checkpoints_dir(config.run_dir)} is intact "
                              f"({'; '.join(set_aside)}); start the job afresh with `rlp run --fresh <job yaml>`, "
                              f"which moves this run aside")
        if config.resume == "always":
            raise ConfigError(f"resume: no checkpoint under {config.run_dir}/checkpoints to resume from; "
                              f"run without --resume to start the job afresh")
        return None
    return Resume(checkpoint, read_state(checkpoint), set_aside)


def record_redis_url(url: str, run_dir: str) -> None:
    """The job's Redis URL (with its password) for `rlp status` and workers started beside the job, readable by
    the owner only. Written whole under another name and then renamed: a reader that finds `redis.url` reads the
    whole URL, never an empty or half-written file."""
    path = os.path.join(run_dir, "redis.url")
    partial = f"{path}.{os.getpid()}.partial"
    descriptor = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(descriptor, 0o600)  # also when an earlier attempt left the file with wider permissions
    with os.fdopen(descriptor, "w") as f:
        f.write(url + "\n")
    os.replace(partial, path)


def _start_services(config: JobConfig, run_id: str,
                    resources: ExitStack) -> Tuple[str, Optional[EmbeddedRedis], JobPlan]:
    """Reach or start Redis and take the job's name there for run `run_id` (a lease held to the end); join or
    start Ray and plan the job for it (`plan_job`), checking that the cluster holds what the plan reserves;
    returns the Redis URL, the embedded server (None when `redis.url` names one) and the plan. Redis stops on
    exit; `run_job` leaves Ray last."""
    embedded = None
    if config.redis.url:
        redis_url = config.redis.url
    else:
        embedded = resources.enter_context(EmbeddedRedis(os.path.join(config.run_dir, "redis")))
        redis_url = embedded.url
    # connect: a clear error when unreachable
    resources.enter_context(JobLease(connect(redis_url, config.redis.reconnect_s), config.name, run_id,
                                     config.run_dir))
    if not ray.is_initialized():  # else `rlp run` started it (rlplatform.job.cluster), or the caller did
        start_ray(config)
    cluster = ray.cluster_resources()
    plan = plan_job(config, cluster, torch.cuda.is_available())
    check_fits(config, plan, cluster, cpus_needed(config))
    return redis_url, embedded, plan


def _run_stages(config: JobConfig, plan: JobPlan, run: str, redis_url: str, learners: Dict[str, LearnerGroup],
                *, metrics: Metrics, startup: StartupTimes, stop: StopSignals,
                resume: Optional[Resume]) -> Dict[str, PolicyResults]:
    """Every policy's stages, from its workers' start to its final model; returns each policy's results.
    `run`: the run's `run_scope`, which names every Redis key its workers share; `startup` is marked as the
    workers become ready and the first steps end."""
    train_rows, test_rows = load_rows(config.data, config.seed)
    client = connect(redis_url, config.redis.reconnect_s)
    queue = _open_queue(config, run, client)
    policies: List[PolicyWorkers] = []
    reward_actors: List = []
    tool_actors: List = []
    restart = RestartDeadline(deadline_rule(config.monitoring))
    services = ServiceWatch(hang_rule(config.monitoring), config.run_dir, Heartbeats(client, run),
                            partial(metrics.event, "hang"))  # watched by the evaluations the job waits for
    try:
        for name, policy in plan.policies.items():
            policies.append(_start_policy(config, policy, learners[name], train_rows, test_rows,
                                          redis_url=redis_url, run=run, alert=metrics.event, restart=restart,
                                          services=services))
        for workers in policies:  # once every policy's initial weights and weight store exist
            workers.teachers = _start_teacher_workers(config, plan, workers.config, run, redis_url)
        reward_actors = _start_reward_workers(config, run, redis_url)  # needed from RL on
        tool_actors = _start_tool_workers(config, run, redis_url, client)
        services.actors = tool_actors
        startup.mark("learners_ready_s", at=max(p.learner.ready_at for p in policies))
        startup.mark("workers_ready_s")  # every actor constructed
        restart.start_s = startup.seconds["workers_ready_s"]  # the job's own start, imports and actors included
        results = {name: PolicyResults.from_state(state) for name, state in resume.state.results.items()} \
            if resume else {p.name: PolicyResults(p.data) for p in policies}
        resumed = resume.state.policies if resume else {}
        for workers in policies:
            if workers.name not in resumed:
                try:
                    results[workers.name].sft = _supervised_stage(config, workers, train_rows, metrics, client,
                                                                  record_eval=results[workers.name].record_eval)
                except LearnerHung as hung:  # in an SFT step: nothing to checkpoint from it
                    metrics.event("hang", str(hung))
                    raise JobEnded(str(hung), results, hung.exit_code) from None
        if any(p.config.rl.enabled for p in policies):
            job_state = partial(_job_state, results, metrics.run.id if metrics.run else None)
            try:
                summaries = _rl_stage(config, [p for p in policies if p.config.rl.enabled], queue, reward_actors,
                                      metrics, train_rows=train_rows, results=results, stop=stop, job_state=job_state,
                                      resume=resume, tool_actors=tool_actors, restart=restart)
            except StageFailed as failed:
                for name, rl in failed.summaries.items():
                    results[name].rl = rl
                raise JobEnded(str(failed), results, failed.exit_code, failed.redis_lost) from None
            for name, rl in summaries.items():
                results[name].rl = rl
        if not stop.requested:
            try:
                _save_final(config, policies)
            except LearnerHung as hung:  # the stages' figures stand
                metrics.event("hang", str(hung))
                raise JobEnded(str(hung), results, hung.exit_code) from None
        startup.mark_first_steps(results)
        return results
    except LearnerDied as err:
        raise JobFailed(_resume_hint(config, str(err))) from None
    finally:
        try:
            queue.request_stop()
            # a standalone worker sees the flag, not a Redis gone with the job (an embedded one) or emptied
            Heartbeats(client, run).await_outside_workers(STOP_GRACE_S if stop.requested else None)
            end_run(client, run)
        except RedisUnavailable:  # gone with what it held; the job ends on that error
            pass
        _stop(policies, reward_actors + tool_actors)


def _job_state(results: Dict[str, PolicyResults], wandb_run_id: Optional[str]) -> Dict:
    """The job's part of a checkpoint's state: every policy's results so far and the W&B run to continue."""
    return {"results": {name: result.state() for name, result in results.items()}, "wandb_run_id": wandb_run_id}


def _resume_hint(config: JobConfig, what: str) -> str:
    checkpoint = latest_checkpoint(config.run_dir)
    where = f"newest checkpoint {checkpoint}" if checkpoint else "no checkpoint yet: it starts over"
    return f"{what}; resume with `rlp run --resume {config.run_dir}` ({where})"


def _save_final(config: JobConfig, policies: List[PolicyWorkers]) -> None:
    """Each policy's final DeepSpeed checkpoint and Hugging Face model; with LoRA its adapters (a peft
    directory on `initial_policy`) and, when `checkpoint.export_merged`, the merged model. With the watchdog on,
    a learner that writes nothing for `monitoring.hang_factor` x `monitoring.hang_floor_s` hangs (`LearnerHung`)."""
    for workers in policies:
        policy_dir = os.path.abspath(config.policy_dir(workers.name))
        checkpoint, model = os.path.join(policy_dir, "checkpoint"), os.path.join(policy_dir, "model")
        merged = model if workers.config.model.lora.enabled and config.checkpoint.export_merged else None
        saves = dict(model_dir=os.path.join(policy_dir, "adapter"), merged_dir=merged) \
            if workers.config.model.lora.enabled else dict(model_dir=model)
        watched_call(hang_rule(config.monitoring), config.run_dir,
                     partial(rank_processes, workers.name, workers.learner.processes), "writing the final model",
                     0.0, checkpoint=latest_checkpoint(config.run_dir),
                     call=lambda deadline_s: workers.learner.save(checkpoint, **saves, timeout_s=deadline_s))


def _open_queue(config: JobConfig, run: str, client) -> RewardQueue:
    from rlplatform.rewards.worker import job_rewards_json

    start_run(client, run, config.redis.max_stream_len)
    queue = RewardQueue(client, run, config.redis.max_stream_len)
    queue.create_group()
    queue.publish_rewards(job_rewards_json(config.rewards, config.imports))
    return queue


def _start_reward_workers(config: JobConfig, run: str, redis_url: str) -> List:
    from rlplatform.rewards.worker import RewardActor

    return [RewardActor.options(num_cpus=config.reward_workers.num_cpus, resources=config.reward_workers.resources,
                                max_restarts=MAX_RESTARTS, name=f"{config.name}-reward-{i}").remote(
        f"{config.name}-reward-{i}", config.rewards, redis_url, run, config.reward_workers, imports=config.imports)
        for i in range(config.reward_workers.num_workers)]


def _start_tool_workers(config: JobConfig, run: str, redis_url: str, client) -> List:
    """The job's tool workers, serving from now on (SFT's evaluations run episodes too); none without tools."""
    if not (config.env.multi_turn and config.env.tools):
        return []
    from rlplatform.envs.tool_worker import ToolActor, job_tools_json
    from rlplatform.transport.keys import ToolKeys
    from rlplatform.transport.tool_queue import ToolQueue

    ToolQueue(client, run).create_group()
    client.set(ToolKeys(run).specs, job_tools_json(config.env.tools, config.imports))
    workers = config.env.tool_workers
    return [ToolActor.options(num_cpus=workers.num_cpus, max_restarts=MAX_RESTARTS, name=f"{config.name}-tool-{i}"
                              ).remote(f"{config.name}-tool-{i}", config.env.tools, redis_url, run, workers,
                                       imports=config.imports) for i in range(workers.num_workers)]


def _start_policy(config: JobConfig, plan: PolicyPlan, learner: LearnerGroup, train_rows, test_rows,
                  *, redis_url: str, run: str, alert: Callable[[str, str], None],
                  restart: RestartDeadline, services: ServiceWatch) -> PolicyWorkers:
    """A policy's initial weights on disk, its learner ranks, rollout workers and evaluator (the last
    rollout actor, started last: `Evaluator`). Actors are named `<job>-<policy>-rollout-<i>`,
    `<job>-<policy>-learner-<rank>` and `<job>-<policy>-weights`; rollout workers find the weight store
    and their prompts file by name, so no restartable actor's constructor arguments sit in the object store.

    `learner`'s ranks started with the services (`_start_learner`): their processes import torch and
    DeepSpeed while W&B starts, the policy is written and the prompts encoded. With SFT first, the
    learner is set up before the rollout actors start: SFT needs only the learner, and the rollout
    actors' start-up (their imports and model load) would otherwise share the CPUs with it; they start
    during the first SFT steps instead. Without SFT all start at once."""
    policy = plan.policy
    model_path = save_initial_policy(policy.model, config.seed, _initial_dir(config, policy))
    train, test, data = _encode_prompts(config, model_path, train_rows, test_rows)
    prompts_path = save_prompts(train, os.path.join(config.policy_dir(policy.name), "train_prompts.jsonl"))
    store_name = f"{config.name}-{policy.name}-weights"
    store = WeightStoreActor.options(name=store_name).remote(plan.transport.delta_full_every)
    start_rollout = partial(_start_rollout_actor, config, plan, run, model_path, prompts_path, redis_url=redis_url,
                            store_name=store_name)
    rollout_workers = policy.rollout.num_workers if policy.rl.enabled else 0  # SFT alone generates only to evaluate
    if policy.sft.enabled:
        learner.set_up()
        rollout = [start_rollout(index=i) for i in range(rollout_workers)]
    else:
        rollout = [start_rollout(index=i) for i in range(rollout_workers)]
        learner.set_up()
    keys = PolicyKeys(run, policy.name)
    # the evaluator starts after the learner's set-up (`Evaluator`)
    evaluator = Evaluator(start_rollout(index=policy.rollout.num_workers), test, config.eval, config.rewards,
                          config.imports, on_restart=partial(alert, "worker_restart"), restart=restart,
                          while_waiting=services.check, hang_rule=hang_rule(config.monitoring),
                          on_hang=partial(alert, "hang"), run_dir=config.run_dir, redis_url=redis_url,
                          process_key=keys.evaluator_process) if config.eval.enabled else None
    learner.connect_results(redis_url, run, config.redis.reconnect_s, policy.name)
    if config.monitoring.parity_every:
        learner.watch_parity([p.ids for p in train], keys.canary_reference, config.monitoring.parity_every)
    workers = PolicyWorkers(plan, learner, rollout, store, evaluator, keys=keys, sft_rows=[p.row for p in train],
                            data=data,
                            add_rollout=partial(start_rollout, restarts=0))
    plan.transport.connect(learner.ranks[0], workers.generating, redis_url, keys.version, LEARNER_TIMEOUT_S)
    return workers


def _start_teacher_workers(config: JobConfig, plan: JobPlan, student: PolicyConfig, run: str,
                           redis_url: str) -> List:
    """A distilling policy's teacher scoring workers (`distill.workers`), each holding the teacher's engine and
    pulling its published versions from the teacher's weight store; none for a policy that does not distil."""
    if student.distill.teacher is None:
        return []
    from rlplatform.actors.rollout_spec import RolloutSpec
    from rlplatform.actors.teacher import TeacherActor

    teacher_plan = plan.of(student.distill.teacher)
    teacher = teacher_plan.policy
    if not teacher_plan.transport.snapshots_in_store:
        raise ConfigError(f"policy {student.name!r} distils from {teacher.name!r}, whose weights.transport is not the "
                          f"object store: its teacher workers pull each version from the teacher's weight store")
    distill = student.distill
    actors = []
    for i in range(distill.workers):
        spec = RolloutSpec(10_000 + i, teacher.name, run, _initial_dir(config, teacher),
                           os.path.join(config.policy_dir(teacher.name), "train_prompts.jsonl"), redis_url=redis_url,
                           rl=teacher.rl, rollout=teacher.rollout, dtype=teacher.model.dtype, transport=teacher_plan.transport,
                           seed=config.seed, weight_store=f"{config.name}-{teacher.name}-weights",
                           lora=teacher.model.lora, chat_template=config.data.chat_template, env=config.env,
                           priority=teacher.rollout.priority)
        actors.append(TeacherActor.options(num_cpus=distill.num_cpus, num_gpus=teacher_plan.rollout_gpus,
                                           max_restarts=MAX_RESTARTS,
                                           name=f"{config.name}-{student.name}-teacher-{i}"
                                           ).remote(spec, student.name, i, config.reward_workers,
                                                    top_k=distill.top_k if distill.mode == "forward_kl" else 0,
                                                    temperature=distill.temperature))
    return actors


def _initial_dir(config: JobConfig, policy: PolicyConfig) -> str:
    return os.path.join(config.policy_dir(policy.name), "initial_policy")


def _start_learner(config: JobConfig, plan: PolicyPlan) -> LearnerGroup:
    """The policy's learner ranks, started but not yet set up in DeepSpeed (`LearnerGroup.set_up`
    loads the initial policy, which `_start_policy` writes first)."""
    policy = plan.policy
    return LearnerGroup(policy.learner, _initial_dir(config, policy), config.seed, dtype=policy.model.dtype,
                        transport=plan.transport, chat_template=config.data.chat_template,
                        name=f"{config.name}-{policy.name}-learner", lora=policy.model.lora, set_up=False)


def _start_rollout_actor(config: JobConfig, plan: PolicyPlan, run: str, model_path: str, prompts_path: str,
                         *, redis_url: str, store_name: str, index: int, restarts: int = MAX_RESTARTS,
                         node_id: Optional[str] = None):
    """Rollout actor `index` of the policy, or its evaluator at index `rollout.num_workers` (an
    `EvaluatorActor`, at `eval.priority` from its first import): it reads its prompts from `prompts_path`
    and finds the weight store by `store_name`. Ray restarts it up to `restarts` times (0: a worker added
    while the stage runs, which leaves when it dies: `rlplatform.job.elastic`). With `node_id` (a worker
    attached by `rlp rollout-worker`) it runs on that node, asking for its CPUs and GPUs there but not for
    `rollout.resources`, the labels that choose nodes for the others."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from rlplatform.actors.evaluator import EvaluatorActor
    from rlplatform.actors.rollout import RolloutActor
    from rlplatform.actors.rollout_spec import RolloutSpec

    policy = plan.policy
    options = dict(num_cpus=policy.rollout.num_cpus, num_gpus=plan.rollout_gpus, resources=policy.rollout.resources,
                   max_restarts=restarts, name=f"{config.name}-{policy.name}-rollout-{index}")
    if node_id is not None:
        options.update(resources={}, scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False))
    evaluator = index == policy.rollout.num_workers
    spec = RolloutSpec(index, policy.name, run, model_path, prompts_path, redis_url=redis_url, rl=policy.rl,
                       rollout=policy.rollout,
                       dtype=policy.model.dtype, transport=plan.transport, seed=config.seed, weight_store=store_name,
                       lora=policy.model.lora, chat_template=config.data.chat_template, env=config.env,
                       priority=config.eval.priority if evaluator else policy.rollout.priority,
                       parity_every=0 if evaluator else config.monitoring.parity_every,
                       distilled=policy.distill.teacher is not None, monitoring=config.monitoring)
    return (EvaluatorActor if evaluator else RolloutActor).options(**options).remote(spec)


def _encode_prompts(config: JobConfig, model_path: str, train_rows, test_rows):
    """(train prompts, held-out prompts, their counts) as the policy's tokenizer encodes them; prompts
    over `data.max_prompt_tokens` (unset: the model's context length) are skipped and counted, then at
    most `eval.max_rows` are held out."""
    tokenizer = load_tokenizer(model_path)
    limit = config.data.max_prompt_tokens or _context_length(model_path)
    train, train_skipped = within_limit(encode_prompts(tokenizer, train_rows, config.data.chat_template), limit)
    test, test_skipped = within_limit(encode_prompts(tokenizer, test_rows, config.data.chat_template), limit)
    test = test[:config.eval.max_rows or None]
    return train, test, {"train_rows": len(train), "test_rows": len(test), "train_skipped_long_prompt":
                         train_skipped, "test_skipped_long_prompt": test_skipped}


def _context_length(model_path: str) -> int:
    """The positions the model was built for (0 where its config does not say)."""
    from transformers import AutoConfig

    return getattr(AutoConfig.from_pretrained(model_path), "max_position_embeddings", None) or 0


def _supervised_stage(config: JobConfig, workers: PolicyWorkers, train_rows, metrics: Metrics, client,
                      *, record_eval: Callable[[str, Dict], None]) -> Optional[SFTSummary]:
    """SFT (when enabled), then version 0 published and evaluated (in the background when RL follows);
    returns the SFT summary (None without SFT) and hands the evaluation to `record_eval` (labelled "after_sft",
    or "before_rl" without SFT), if the job evaluates."""
    sft = None
    if workers.config.sft.enabled:
        stage = "sft" if not config.policies else f"{workers.name}/sft"
        sft = run_sft(workers.config.sft, workers.learner, workers.sft_rows, metrics, config.seed, stage=stage,
                      accuracy=lambda: workers.evaluator.score(workers.learner.snapshot_weights()),
                      watched=partial(watched_call, hang_rule(config.monitoring), config.run_dir,
                                      partial(rank_processes, workers.name, workers.learner.processes)))
    streamed = workers.learner.stream_weights(0)
    publish(workers, client, 0, streamed)
    if workers.evaluator is None:  # `eval.enabled: false`
        return sft
    if workers.config.rl.enabled and not workers.config.sft.enabled:  # the evaluator is still starting: it
        # evaluates version 0 while RL runs, and the RL stage waits for the figures at its end
        workers.evaluator.start_baseline(_baseline_snapshot(workers, streamed), lambda figures: record_eval(
            "before_rl", _report(workers, metrics, "before_rl", 0, figures)))
    else:
        label = first_eval_label(workers.config.sft.enabled)
        record_eval(label, _evaluate(workers, metrics, label))
    return sft


def _baseline_snapshot(workers: PolicyWorkers, streamed) -> ray.ObjectRef:
    """A snapshot of version 0 for the background evaluation: the one the object store already holds
    when version 0 went there as full weights, else a snapshot of the learner's weights."""
    if workers.plan.transport.snapshots_in_store and not workers.config.model.lora.enabled:
        return streamed
    return workers.learner.snapshot_weights()


def _rl_stage(config: JobConfig, policies: List[PolicyWorkers], queue: RewardQueue, reward_actors: List,
              metrics: Metrics, *, train_rows, results: Dict[str, PolicyResults], stop: StopSignals,
              job_state: Callable[[], Dict], resume: Optional[Resume], tool_actors: List,
              restart: RestartDeadline) -> Dict[str, RLSummary]:
    """RL for `policies`, then each one's final evaluation (recorded in `results` as "after_rl"); returns each
    policy's RL summary."""
    summaries = run_rl(config, policies, queue, reward_actors, metrics, train_rows=train_rows, stop=stop,
                       job_state=job_state, resume=resume, tool_actors=tool_actors, restart=restart)
    for workers in policies:
        if not stop.requested and workers.evaluator is not None:
            workers.evaluator.finish_baseline()
            results[workers.name].record_eval("after_rl", _evaluate(workers, metrics, "after_rl"))
    # the evaluator's restarts as of its last answer: a restart is seen when the restarted process answers,
    # which may be the final evaluation
    return {w.name: replace(summaries[w.name], restarts={**summaries[w.name].restarts,
                                                          "evaluator": w.evaluator_restarts}) for w in policies}


def _stop(policies: List[PolicyWorkers], reward_actors: List) -> None:
    for actor in reward_actors:
        ray.kill(actor)
    for workers in policies:
        for actor in workers.generating + [workers.weight_store] + workers.teachers:
            ray.kill(actor)
        workers.learner.shutdown()


def _evaluate(workers: PolicyWorkers, metrics: Metrics, label: str) -> Dict:
    """The policy's newest published weights on the held-out prompts, scored by the job's rewards."""
    return _report(workers, metrics, label, *workers.evaluator.run_now())


def _report(workers: PolicyWorkers, metrics: Metrics, label: str, version: int, figures: Dict) -> Dict:
    """An evaluation's console line; its figures with the version evaluated."""
    config = workers.evaluator.config
    how = "greedy" if config.greedy else f"{config.samples_per_prompt} sampled per prompt"
    metrics.console.note(f"eval {workers.name} {label}: pass@1 {figures['pass_at_1']:.3f}, reward "
                         f"{figures['reward_mean']:.3f} on {figures['rows']} held-out rows ({how}, "
                         f"policy version {version})")
    return {**figures, "policy_version": version}


def _flat(summary: Dict, prefix: str = "") -> Dict:
    flat = {}
    for key, value in summary.items():
        if isinstance(value, dict):
            flat.update(_flat(value, f"{prefix}{key}/"))
        else:
            flat[f"{prefix}{key}"] = value
    return flat

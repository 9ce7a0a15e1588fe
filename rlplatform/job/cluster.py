"""The job's Ray: joined, or started on this machine, with what the job's actors reserve.

`rlp run` starts a local Ray here while another thread loads torch, transformers and the job's
modules and checks its model folders (`start_local_ray_while`): Ray's processes start on the other
cores meanwhile instead of after the imports. `run_job` joins a cluster, or starts Ray itself when run from Python.
This module imports neither torch nor the job's modules.
"""

from __future__ import annotations

import math
import os
import signal
import threading
from contextlib import contextmanager, nullcontext, suppress
from typing import Callable, Iterator, List, Optional

import psutil
import ray

from rlplatform.config import JobConfig
from rlplatform.job.signals import sigterm_held
from rlplatform.priority import ray_workers_at_our_niceness
from rlplatform.transport.redis_server import RedisUnavailable, connect
from rlplatform.warm_start import local_workers_forked, runtime_env, vllm_modules, wanted


def joins_cluster(config: JobConfig) -> bool:
    """Whether the job joins a running Ray cluster (`ray.address` or RAY_ADDRESS) rather than starting one."""
    return bool(config.ray.address or os.environ.get("RAY_ADDRESS"))


def start_ray(config: JobConfig) -> None:
    """Join the job's Ray cluster, or start a local one holding at least the CPUs its actors reserve.
    A local Ray's processes ignore a SIGTERM to the group (the job stops them after its checkpoint)
    and start their workers at this process's niceness (rlplatform.priority). The SIGTERM handler
    stays the caller's (`ray.init` would put in one that exits with status 15). The job's actors start forked
    from a warm interpreter as `ray.warm_start` says (rlplatform.warm_start)."""
    joining = joins_cluster(config)
    forked = wanted(config.ray.warm_start, joining)
    if joining:
        with _sigterm_handler_kept():
            ray.init(address=config.ray.address, include_dashboard=False, runtime_env=runtime_env() if forked else None)
        return
    with _sigterm_handler_kept(), sigterm_held(), ray_workers_at_our_niceness(), \
            local_workers_forked(vllm_modules([p.rollout.engine for p in config.policy_list()])) if forked \
            else nullcontext():
        ray.init(num_cpus=max(os.cpu_count() or 1, math.ceil(cpus_needed(config))), include_dashboard=False)


def start_local_ray_while(config: JobConfig, work: Callable[[], None]) -> None:
    """Run `work` on another thread while starting a local Ray here. No Ray starts when one runs in this
    process already, the job joins a cluster or its `redis.url` does not answer: `run_job` then joins the
    cluster, or fails on Redis before any Ray starts, and reports either in its summary. When `work` raises,
    the Ray started here is shut down and its error raised here."""
    failed: List[BaseException] = []

    def run() -> None:
        try:
            work()
        except BaseException as err:
            failed.append(err)

    working = threading.Thread(target=run, daemon=True)
    working.start()
    started = not joins_cluster(config) and not ray.is_initialized() and _redis_answers(config.redis.url)
    if started:
        start_ray(config)
    working.join()
    if failed:
        if started:
            shutdown_ray()
        raise failed[0]


def shutdown_ray() -> None:
    """Shut down the Ray this process started or joined, keeping the SIGTERM handler it has. The processes of a
    local Ray started here block SIGTERM (`start_ray`), so Ray's own stop, a SIGTERM to each and up to a second's
    wait before its SIGKILL, would only wait (5 s for a head's processes): they are killed outright instead, the
    end that wait comes to, and with them what their raylet started (its agents would outlive it by a minute,
    waiting on a GCS that is gone). Joining a cluster, nothing is killed."""
    node = getattr(ray._private.worker, "_global_node", None)  # Ray's handle on the processes ray.init started
    started: List[psutil.Process] = []
    if node is not None:
        kill = node.kill_all_processes
        node.kill_all_processes = lambda **how: kill(**{**how, "allow_graceful": False})
        for raylet in node.all_processes.get("raylet", []):
            with suppress(psutil.NoSuchProcess):
                started += psutil.Process(raylet.process.pid).children(recursive=True)
    with _sigterm_handler_kept():
        ray.shutdown()
    for process in started:
        with suppress(psutil.NoSuchProcess):
            process.kill()


@contextmanager
def _sigterm_handler_kept() -> Iterator[None]:
    """The SIGTERM handler found on entry is set back on exit (handlers belong to the main thread)."""
    main = threading.current_thread() is threading.main_thread()
    previous = signal.getsignal(signal.SIGTERM) if main else None
    try:
        yield
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _redis_answers(url: Optional[str]) -> bool:
    """Whether the job's Redis answers (an embedded one, `url` unset, is started by the job)."""
    if not url:
        return True
    try:
        connect(url)
        return True
    except RedisUnavailable:
        return False


def cpus_needed(config: JobConfig) -> float:
    """Ray CPUs the job's actors reserve: reward and tool workers, and per policy its ranks, rollout
    workers, evaluator and (distilling) teacher workers."""
    tools = config.env.tool_workers.num_workers * config.env.tool_workers.num_cpus if config.env.tools else 0.0
    return tools + config.reward_workers.num_workers * config.reward_workers.num_cpus + sum(
        p.learner.num_ranks * p.learner.num_cpus + config.generating_actors(p) * p.rollout.num_cpus
        + (p.distill.workers * p.distill.num_cpus if p.distill.teacher else 0.0) for p in config.policy_list())

"""Fault injection: small real jobs (a tiny Qwen2 built from config; real Ray, Redis and DeepSpeed)
with faults injected at seeded random learner steps: SIGKILL of rollout workers, reward workers
and the evaluator, SIGKILL of the job's embedded redis-server, a SIGSTOP of it (the job checkpoints from
the learner's memory, stops, and is resumed) and an operator's restart of an external one, a learner rank's SIGKILL, a SIGTERM and a SIGKILL of the job's whole process group
each followed by `rlp run --resume`, malformed messages written into the reward queue's streams, a
flood of oversized and malformed requests on the OpenAI bridge, a same-name job started beside the
live one (same run directory, and another directory on its Redis), a SIGTERM while the job's reward is
slow on one sample in ten (then `--resume`), and the only reward worker stopped with SIGSTOP. Two hit its checkpoints: the newest one truncated after a SIGKILL of the job's
process group (the resume sets it aside and goes on from the one before), and the disk the checkpoints
go to (a small tmpfs; root only) filled until the job fails at its next checkpoint, then freed for the
resume.

For each scenario it reports whether the job completed, samples lost, samples and prompts trained
twice, prompts skipped, the recovery time of each fault (seconds from the fault until a learner
step next ends), processes of a job run as a command left alive after it, and the alerts the job
raised, counted from what the run left: trained.jsonl (the sample ids and prompt positions of
every step), the final checkpoint's prompt ledger, events.jsonl and summary.json, each checked
against the others; a fault whose injection saw something wrong (a refused start that was not
refused, a bridge that answered a bad request or stopped serving) adds an accounting check.

Usage: python benchmarks/faults.py [--steps 20] [--seed 0] [--only NAME ...] [--out benchmarks/results/faults.md]
"""

from __future__ import annotations

import argparse
import errno
import glob
import json
import os
import urllib.error
import urllib.request
import platform
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime, timezone
from contextlib import contextmanager, nullcontext, suppress
from typing import Callable, Dict, Iterator, List, Optional

import psutil
import ray
from ray._private.state import state as ray_state  # the GCS actor table: names, pids, states

from rlplatform.config import REDIS_URL_ENV, JobConfig, load_config, to_yaml
from rlplatform.job.checkpoint import DiskFull, checkpoints_dir, latest_checkpoint, read_state
from rlplatform.job.controller import run_job
from rlplatform.job.run_dir import RUN_ID
from rlplatform.job.summaries import samples_unaccounted
from rlplatform.transport.deadlines import JobFailed
from rlplatform.transport.redis_server import EmbeddedRedis, connect
from rlplatform.transport.keys import JobKeys, run_scope

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RLP = os.path.join(os.path.dirname(sys.executable), "rlp")
TINY = ["model.hidden_size=64", "model.num_layers=2", "model.intermediate_size=128", "sft.enabled=false",
        "data.train_size=300", "data.test_size=8", "eval.batch_size=8", "rl.batch_prompts=2", "rl.group_size=4",
        "rl.max_new_tokens=4", "rollout.prompts_per_batch=4", "rollout.num_cpus=0.5", "learner.num_cpus=0.5",
        "reward_workers.num_cpus=0.25", "wandb.mode=disabled", "rl.group_timeout_s=60"]
# vLLM's CPU attention takes TINY's width in heads of 32; the rollout worker's the one engine (the evaluator's
# would be a second vLLM start, and the scenarios fault the rollout worker)
VLLM = ["rollout.engine=vllm", "model.num_heads=2", "eval.enabled=false"]
WATCHDOG = ["monitoring.hang_floor_s=5"]  # deadlines a tiny job reaches: 10x its longest round or step, at least 5 s
TOOL_CALC = os.path.join(REPO, "configs", "tool_calc.yaml")
AGENT = os.path.join(REPO, "examples", "bridge_agent.py")
BRIDGE = ["rollout.openai_bridge.enabled=true", "rollout.openai_bridge.port=0"]
AGENTS = [*BRIDGE, "rollout.source=bridge", "rl.group_timeout_s=null", "rl.idle_timeout_s=120"]
TOOLS = ["env.fn=tests.envs.tools_for_tests:CalculateThePrompt",  # every episode calls the calculator once
         "env.max_tokens=40", "env.tools[0].timeout_s=0.3", "env.tool_workers.num_cpus=0.25"]
MALFORMED = [b"\x00not msgpack", b"\x93\x01\x02\x03", b"\x82\xa1v\x07\xa6sample\xc0",  # garbage, a list, schema 7
             b"\x82\xa1v\x01\xa6sample\x81\xa9sample_id\xa1x"]  # schema 1 with a sample missing its fields


@dataclass
class Running:
    """The job a fault lands on: its run directory, the pid of the process running it and the external Redis it
    uses (None: its own, embedded)."""
    run_dir: str
    pid: int
    external_redis: Optional[EmbeddedRedis] = None


@dataclass
class Fault:
    """One injection: `inject(fault, job)` once the job has trained `at_step` steps; it returns the time the
    fault struck, and notes in `fault.wrong` what it saw go wrong."""
    what: str
    at_step: int
    inject: Callable[[Fault, Running], float]
    at: Optional[float] = None  # wall-clock time it was injected
    landed_step: Optional[int] = None  # steps trained when it was injected (at_step or later)
    recovery_s: Optional[float] = None  # until a learner step next ended
    wrong: List[str] = field(default_factory=list)  # what the injection saw go wrong (none: as it should)
    after: Optional[Callable[[str], List[str]]] = None  # once the job ended: its own checks on the run directory


class Progress(threading.Thread):
    """Polls a run's trained.jsonl; `ends` holds the times its step count went up."""

    def __init__(self, run_dir: str) -> None:
        super().__init__(daemon=True)
        self.path = os.path.join(run_dir, "trained.jsonl")
        self.ends: List[float] = []
        self.steps = 0
        self._done = threading.Event()

    def run(self) -> None:
        while not self._done.wait(0.1):
            steps = _lines(self.path)
            if steps > self.steps:
                self.ends.append(time.time())
            self.steps = steps

    def stop(self) -> None:
        self._done.set()
        self.join()

    def wait_for(self, steps: int, timeout_s: float = 600.0) -> None:
        deadline = time.monotonic() + timeout_s
        while self.steps < steps:
            if time.monotonic() > deadline or not self.is_alive():
                raise TimeoutError(f"the job did not reach step {steps}")
            time.sleep(0.1)

    def recovery(self, at: float) -> Optional[float]:
        later = [t for t in self.ends if t > at]
        return round(later[0] - at, 1) if later else None


def _lines(path: str) -> int:
    try:
        with open(path) as f:
            return sum(1 for _ in f)
    except FileNotFoundError:
        return 0


# injections
def actor_pid(name: str, not_pid: Optional[int] = None, timeout_s: float = 120.0) -> int:
    """The pid of the live Ray actor `name` (waiting out a restart: a pid other than `not_pid`)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for actor in ray_state.actor_table(None).values():
            if actor.get("Name") == name and actor.get("State") == "ALIVE" and actor.get("Pid") not in (0, not_pid):
                return actor["Pid"]
        time.sleep(0.2)
    raise TimeoutError(f"actor {name} is not alive")


def kill_actor(name: str, settle_s: float = 0.0) -> Callable[[Fault, Running], float]:
    """SIGKILL the live actor `name` (a restarted one, after a first kill) once it has been alive `settle_s`."""
    killed: List[int] = []

    def inject(fault: Fault, job: Running) -> float:
        while True:
            pid = actor_pid(name, killed[-1] if killed else None)
            time.sleep(settle_s)
            try:
                os.kill(pid, signal.SIGKILL)
                break
            except ProcessLookupError:  # gone while it settled (Ray replaced its process): aim at the next one
                continue
        killed.append(pid)
        return time.time()
    return inject


def job_redis_url(run_dir: str) -> str:
    with open(os.path.join(run_dir, "redis.url")) as f:
        return f.read().strip()


def job_keys(run_dir: str) -> JobKeys:
    """The Redis keys of the run in `run_dir` (named by the job's name and the run id kept there)."""
    with open(os.path.join(run_dir, RUN_ID)) as f:
        return JobKeys(run_scope(os.path.basename(run_dir), f.read().strip()))


def kill_embedded_redis(fault: Fault, job: Running) -> float:
    """SIGKILL the redis-server listening on the port of the job's Redis URL."""
    _embedded_redis(job).kill()
    return time.time()


def _embedded_redis(job: Running, timeout_s: float = 30.0) -> psutil.Process:
    """The redis-server listening on the port of the job's Redis URL (its own, or an external one on this
    machine), waiting out a restart of it (the job's, after an earlier kill) for up to `timeout_s`."""
    port = int(job_redis_url(job.run_dir).rsplit(":", 1)[1].split("/")[0])
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for process in psutil.process_iter(["name"]):
            if process.info["name"] == "redis-server":
                try:
                    if any(c.laddr.port == port and c.status == psutil.CONN_LISTEN
                           for c in process.net_connections()):
                        return process
                except (psutil.NoSuchProcess, psutil.AccessDenied):
                    continue
        time.sleep(0.1)
    raise RuntimeError(f"no redis-server listened on port {port} within {timeout_s:g} s")


def stall_embedded_redis(fault: Fault, job: Running) -> float:
    """SIGSTOP the job's redis-server: alive, holding its connections, answering nothing (the job stops it)."""
    os.kill(_embedded_redis(job).pid, signal.SIGSTOP)
    return time.time()


def restart_external_redis(down_s: float = 3.0) -> Callable[[Fault, Running], float]:
    """An operator's restart of the job's external Redis: the server is killed, and started again `down_s` later
    on its port."""
    def inject(fault: Fault, job: Running) -> float:
        os.kill(job.external_redis.pid, signal.SIGKILL)
        struck = time.time()
        time.sleep(down_s)
        job.external_redis.start()
        return struck
    return inject


def pause_redis(stopped_s: float) -> Callable[[Fault, Running], float]:
    """SIGSTOP the job's redis-server (embedded or external) for `stopped_s`, then SIGCONT."""
    def inject(fault: Fault, job: Running) -> float:
        server = _embedded_redis(job)
        server.suspend()
        struck = time.time()
        time.sleep(stopped_s)
        with suppress(psutil.NoSuchProcess):
            server.resume()
        return struck
    return inject


def stall_external_redis_for_good(fault: Fault, job: Running) -> float:
    """SIGSTOP the job's external redis-server, never continued; once the job has given up on it and ended, the
    operator replaces it: the stopped server is killed and started again on its port (for the resume)."""
    os.kill(job.external_redis.pid, signal.SIGSTOP)
    struck = time.time()
    deadline = time.monotonic() + 300
    while _pid_alive(job.pid):
        if time.monotonic() > deadline:
            fault.wrong.append("the job did not end within 300 s of its Redis stalling for good")
            break
        time.sleep(0.5)
    os.kill(job.external_redis.pid, signal.SIGKILL)
    job.external_redis.start()
    return struck


def write_malformed(fault: Fault, job: Running) -> float:
    """Malformed records into the requests stream (reward workers read them) and the results stream
    (the job reads them)."""
    struck = time.time()
    client, keys = connect(job_redis_url(job.run_dir)), job_keys(job.run_dir)
    for payload in MALFORMED:
        client.xadd(keys.requests, {"data": payload})
        client.xadd(keys.results, {"data": payload})
    client.xadd(keys.requests, {"other": b"no data field"})
    client.close()
    return struck


def flood_bridge(requests: int = 240) -> Callable[[Fault, Running], float]:
    """Oversized and malformed requests on rollout worker 0's OpenAI bridge, eight at a time; then a
    well-formed one must be answered. A bad request answered 200 or 5xx, or not answered, is wrong."""
    too_big = json.dumps({"model": "policy", "messages": [{"role": "user", "content": "7" * (2 << 20)}]}).encode()
    bodies = [too_big, json.dumps({"messages": [{"role": "user", "content": "7" * 60000}], "max_tokens": 2}).encode(),
              json.dumps({"messages": [{"role": "user", "content": "1+1="}], "n": 50000}).encode(),
              b'{"messages": [{"role": "user", "content": "1+1="}], "temperature": NaN}',
              b'{"messages": [{"role": "user", "content": "1+1="}], "max_tokens": 10000000}',
              b"not json", b"[1, 2, 3]", b'{"messages": "hello"}', b'{"model": "other", "messages": []}']

    def inject(fault: Fault, job: Running) -> float:
        url = _bridge_url(job)
        struck = time.time()
        with ThreadPoolExecutor(8) as pool:
            statuses = Counter(pool.map(lambda i: _post(url, bodies[i % len(bodies)]), range(requests)))
        fault.what += f" ({', '.join(f'{n} x {status}' for status, n in sorted(statuses.items()))}, " \
                      f"{time.time() - struck:.1f} s)"
        if any(status == 200 or status >= 500 or status == 0 for status in statuses):
            fault.wrong.append(f"the bridge answered bad requests {dict(statuses)}")
        good = _post(url, json.dumps({"messages": [{"role": "user", "content": "1+1="}], "max_tokens": 2}).encode())
        if good != 200:
            fault.wrong.append(f"after the flood a good request got {good}")
        return struck
    return inject


def _bridge_url(job: Running) -> str:
    deadline = time.monotonic() + 60
    while not os.path.exists(os.path.join(job.run_dir, "redis.url")) or not os.path.exists(
            os.path.join(job.run_dir, RUN_ID)):  # a fault at step 0 may come before the job has its Redis
        if time.monotonic() > deadline:
            raise TimeoutError("the job never wrote its redis.url")
        time.sleep(0.2)
    client = connect(job_redis_url(job.run_dir))
    while (url := client.hget(job_keys(job.run_dir).status, "openai_bridge/policy/0")) is None:
        if time.monotonic() > deadline:
            raise TimeoutError("rollout worker 0's bridge never appeared in the job status")
        time.sleep(0.2)
    return url.decode()


class BridgeAgents:
    """`count` agents (examples/bridge_agent.py, each with its own seed and log) playing groups of episodes through
    rollout worker 0's bridge, started by one fault; the first of them is stopped by another. Once the job ended
    (`check`) they are killed and their logs checked against what the job trained."""

    def __init__(self, group_size: int, count: int) -> None:
        self.group_size, self.count = group_size, count
        self.processes: List[subprocess.Popen] = []
        self.logs: List[str] = []

    def start(self, fault: Fault, job: Running) -> float:
        url = _bridge_url(job)
        self.logs = [f"{job.run_dir}-agent-{k}.jsonl" for k in range(self.count)]
        self.processes = [subprocess.Popen([sys.executable, AGENT, url, "--group-size", str(self.group_size),
                                            "--log", log, "--seed", str(k)]) for k, log in enumerate(self.logs)]
        fault.after = lambda run_dir: self.check(fault, run_dir)
        return time.time()

    def stop(self, stopped_s: Optional[float]) -> Callable[[Fault, Running], float]:
        """SIGSTOP the first agent once it has finished an episode of a group it has not finished (it holds a group
        open, and its next episode on the bridge), for `stopped_s` (None: for good)."""
        def inject(fault: Fault, job: Running) -> float:
            deadline = time.monotonic() + 120
            while not self._mid_group(self.logs[0]):
                if time.monotonic() > deadline:
                    fault.wrong.append("the agent never finished an episode")
                    return time.time()
                time.sleep(0.02)
            os.kill(self.processes[0].pid, signal.SIGSTOP)
            struck = time.time()
            if stopped_s is not None:
                time.sleep(stopped_s)
                os.kill(self.processes[0].pid, signal.SIGCONT)
            return struck
        return inject

    def _mid_group(self, log: str) -> bool:
        entries = _entries(log)
        finished = Counter(entry["group"] for entry in entries if entry["outcome"] == "finished")
        return bool(entries) and 0 < finished[entries[-1]["group"]] < self.group_size

    def check(self, fault: Fault, run_dir: str) -> List[str]:
        """Every agent sample trained was an episode the bridge accepted, in a group that did not end before its
        agent was done with it; the row's fault text gets what the agents did."""
        for process in self.processes:
            process.kill()
            process.wait()
        entries = [entry for log in self.logs for entry in _entries(log)]
        accepted = {f"{e['group']}/{e['episode']}" for e in entries if e["outcome"] == "finished"}
        refused = sum(e["outcome"] in ("turn_refused_expired", "episode_expired") for e in entries)
        ended = {e["group"] for e in entries if e["outcome"] == "group_ended"}
        trained = [i for line in map(json.loads, open(os.path.join(run_dir, "trained.jsonl")))
                   for i in line["sample_ids"] if i.startswith("agent-")]
        wrong = [f"{len(set(trained) - accepted)} agent samples trained that the bridge never accepted"] \
            if set(trained) - accepted else []
        if {i.rsplit("/", 1)[0] for i in trained} & ended:
            wrong.append("a group the bridge refused as ended was trained")
        fault.what += (f" ({self.count} agent{'s' if self.count > 1 else ''}: {len(accepted)} episodes accepted, "
                       f"{len(trained)} trained; {refused} requests of expired episodes and {len(ended)} finishes "
                       "into ended groups refused 410)")
        return wrong


def _entries(log: str) -> List[Dict]:
    return [json.loads(line) for line in open(log)] if os.path.exists(log) else []


def _post(url: str, body: bytes) -> int:
    request = urllib.request.Request(f"{url}/chat/completions", data=body, method="POST",
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as reply:
            return reply.status
    except urllib.error.HTTPError as err:
        return err.code
    except (urllib.error.URLError, ConnectionError):  # no answer at all
        return 0


def start_beside(fault: Fault, job: Running) -> float:
    """`rlp run` of the live job's config (written beside its run directory) twice: in its run directory, and
    from another directory against its Redis. Each must refuse in one line (exit 2) and leave the live job's
    files alone."""
    config_path = f"{job.run_dir}.yaml"
    struck = time.time()
    recorded = os.path.join(job.run_dir, "config.yaml")
    before = open(recorded).read()
    elsewhere = os.path.join(os.path.dirname(job.run_dir), "elsewhere")
    for where, extra in (("same directory", []), ("same Redis", [f"output_dir={elsewhere}",
                                                                 f"redis.url={job_redis_url(job.run_dir)}"])):
        second = subprocess.run([RLP, "run", config_path, *extra], cwd=REPO, env=_command_env(),
                                capture_output=True, text=True, timeout=300)
        said = second.stderr.strip()
        if second.returncode != 2 or "\n" in said or not ("in use by a running job" in said or
                                                           "is running on this Redis" in said):
            fault.wrong.append(f"{where}: exit {second.returncode}: {said[-200:]}")
    if open(recorded).read() != before:
        fault.wrong.append("the live job's config.yaml was overwritten")
    return struck


def refuse_resume(run_dir: str, override: str) -> List[str]:
    """`rlp run --resume run_dir override` must refuse in one line naming the key (exit 2) and leave the run's
    files as they were; what went otherwise."""
    before = _files(run_dir)
    attempt = subprocess.run([RLP, "run", "--resume", run_dir, override], cwd=REPO, env=_command_env(),
                             capture_output=True, text=True, timeout=300)
    said, key = attempt.stderr.strip(), override.split("=")[0]
    wrong = [] if attempt.returncode == 2 and "\n" not in said and f"'{key}'" in said else \
        [f"--resume {override}: exit {attempt.returncode}: {said[-200:]}"]
    if _files(run_dir) != before:
        wrong.append(f"--resume {override} changed the run's files")
    return wrong


def _files(run_dir: str) -> Dict[str, float]:
    """Each file under `run_dir` and when it was last written."""
    return {os.path.join(root, name): os.stat(os.path.join(root, name)).st_mtime
            for root, _, names in os.walk(run_dir) for name in names}


def stop_for_good(name: str) -> Callable[[Fault, Running], float]:
    """SIGSTOP the live actor `name`, never continued: the watchdog has to find it hung and recover."""
    def inject(fault: Fault, job: Running) -> float:
        os.kill(actor_pid(name), signal.SIGSTOP)
        return time.time()
    return inject


def stop_then_continue(name: str, stopped_s: float) -> Callable[[Fault, Running], float]:
    """SIGSTOP the live actor `name` for `stopped_s`, then SIGCONT (a process the watchdog had restarted meanwhile
    is gone, and continues nothing)."""
    def inject(fault: Fault, job: Running) -> float:
        pid = actor_pid(name)
        os.kill(pid, signal.SIGSTOP)
        struck = time.time()
        time.sleep(stopped_s)
        with suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)
        return struck
    return inject


def kill_process_group(fault: Fault, job: Running) -> float:
    """SIGKILL every process of the job's process group (`rlp run` started in its own session)."""
    os.killpg(job.pid, signal.SIGKILL)
    return time.time()


def kill_and_corrupt(fault: Fault, job: Running) -> float:
    """SIGKILL the job's process group, then truncate the weights of its newest checkpoint to half."""
    os.killpg(job.pid, signal.SIGKILL)
    struck = time.time()
    root = checkpoints_dir(job.run_dir)
    kept = sorted(name for name in os.listdir(root) if name.startswith("step-"))
    if len(kept) < 2:
        fault.wrong.append(f"{len(kept)} checkpoints when it struck: none older to go on from")
    for weights in glob.glob(os.path.join(root, kept[-1], "*", "learner", "global_step*", "*model_states.pt")):
        os.truncate(weights, os.path.getsize(weights) // 2)
    fault.what += f" ({kept[-1]} truncated)"
    return struck


def fill_disk(fault: Fault, job: Running) -> float:
    """Fill the filesystem the checkpoints go to; once the job has ended (at its next checkpoint), free it again,
    as its operator would before `rlp run --resume`. A job that did not end on the disk-full line is wrong."""
    filler = os.path.join(checkpoints_dir(job.run_dir), "filler")
    with open(filler, "wb", buffering=0) as f:
        try:
            while True:
                f.write(bytes(1 << 20))
        except OSError as err:
            if err.errno != errno.ENOSPC:
                raise
    struck = time.time()
    summary = os.path.join(job.run_dir, "summary.json")
    deadline = time.monotonic() + 600
    while not os.path.exists(summary) and time.monotonic() < deadline:
        time.sleep(0.2)
    os.remove(filler)
    error = json.load(open(summary)).get("error", "") if os.path.exists(summary) else "no summary.json"
    if not error.startswith("DiskFull: no space left on "):
        fault.wrong.append(f"the job did not end on the full disk: {error[:200]}")
    return struck


@contextmanager
def checkpoint_disk(run_dir: str, size: str) -> Iterator[None]:
    """A tmpfs of `size` mounted where the job in `run_dir` writes its checkpoints, unmounted after."""
    where = checkpoints_dir(run_dir)
    os.makedirs(where, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", where], check=True)
    try:
        yield
    finally:
        subprocess.run(["umount", "--lazy", where], check=True)


class ProcessTree(threading.Thread):
    """`argv` run in its own session (so its process group is the job's), and every process it started
    (its descendants, found every 0.5 s while it runs); `left` names those alive after it ended."""

    def __init__(self, argv: List[str]) -> None:
        super().__init__(daemon=True)
        self.process = subprocess.Popen(argv, cwd=REPO, env=_command_env(), stdout=subprocess.DEVNULL,
                                        stderr=subprocess.DEVNULL, start_new_session=True)
        self.pid = self.process.pid
        self.seen: Dict[int, psutil.Process] = {}
        self.start()

    def run(self) -> None:
        root = psutil.Process(self.pid)
        while self.process.poll() is None:
            try:
                for child in root.children(recursive=True):
                    self.seen.setdefault(child.pid, child)
            except psutil.NoSuchProcess:
                return
            time.sleep(0.5)

    def left(self, timeout_s: float = 900.0, grace_s: float = 10.0) -> List[str]:
        """Once the command ended: its descendants still alive `grace_s` later (psutil tells a reused pid apart)."""
        self.process.wait(timeout=timeout_s)
        self.join()
        deadline = time.monotonic() + grace_s
        while (alive := [p for p in self.seen.values() if _alive(p)]) and time.monotonic() < deadline:
            time.sleep(0.5)
        return [f"{p.pid} {' '.join(p.cmdline()[:2])}" for p in alive if _alive(p)]


def _alive(process: psutil.Process) -> bool:
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _pid_alive(pid: int) -> bool:
    try:
        return _alive(psutil.Process(pid))
    except psutil.NoSuchProcess:  # ended and reaped
        return False


# running a scenario
@dataclass
class Scenario:
    name: str
    overrides: List[str]
    faults: Callable[[str, random.Random, int], List[Fault]]  # (job name, rng, steps) -> faults
    resume: bool = False  # the job ends at the fault; `rlp run --resume` continues it
    in_process: bool = True  # else `rlp run` in its own process and session (a SIGTERM or SIGKILL goes to it)
    external_redis: bool = False
    alert: Optional[str] = None  # the event kind the job must raise for the fault (events.jsonl)
    alert_follows: int = 0  # the index of the fault (among those that landed) the alert is timed from
    steps: Optional[int] = None  # RL steps of its job, where a fault takes longer than --steps leave it
    restarts: Optional[str] = None  # the restart kind (summary's rl.restarts) each landed fault must add
    disk: Optional[str] = None  # the size of a tmpfs mounted for its checkpoints (only root can mount one)
    refused: List[str] = field(default_factory=list)  # overrides each of which a `--resume` must refuse first
    config: Optional[str] = None  # the YAML its job starts from, under TINY and `overrides` (None: the defaults)


@dataclass
class Outcome:
    scenario: str
    completed: bool
    steps: int
    faults: List[Fault]
    counts: Dict[str, int] = field(default_factory=dict)
    checks: List[str] = field(default_factory=list)  # accounting mismatches found
    restarts: Dict[str, int] = field(default_factory=dict)
    wall_s: float = 0.0
    orphans: Optional[List[str]] = None  # processes of `rlp run` alive after it (None: run in this process)
    alerts: Dict[str, int] = field(default_factory=dict)  # events.jsonl's alert kinds and counts
    alerted_after: str = ""  # the scenario's own alert and its seconds after the first fault ("hang 5.7 s")


def fault_steps(rng: random.Random, steps: int, count: int) -> List[int]:
    """`count` distinct learner steps in [1, steps - 2] at which to inject, in order."""
    return sorted(rng.sample(range(1, steps - 1), min(count, steps - 2)))


def run_scenario(scenario: Scenario, out_dir: str, steps: int, seed: int) -> Outcome:
    with checkpoint_disk(os.path.join(out_dir, scenario.name), scenario.disk) if scenario.disk else nullcontext():
        return _run_scenario(scenario, out_dir, steps, seed)


def _run_scenario(scenario: Scenario, out_dir: str, steps: int, seed: int) -> Outcome:
    name, steps = scenario.name, scenario.steps or steps
    server = EmbeddedRedis(os.path.join(out_dir, f"{name}-external-redis")).start() \
        if scenario.external_redis else None
    overrides = [f"output_dir={out_dir}", f"name={name}", *TINY, f"rl.max_steps={steps}", f"seed={seed}",
                 *scenario.overrides, *([f"redis.url={server.url}"] if server else [])]
    config = load_config(scenario.config, overrides)
    rng = random.Random(f"{seed}-{name}")
    faults = scenario.faults(name, rng, steps)
    progress = Progress(config.run_dir)
    progress.start()
    start, orphans = time.time(), None
    if server:  # what `rlp run` reads for a Redis URL its config file saved without the password
        os.environ[REDIS_URL_ENV] = server.url
    try:
        if scenario.in_process:
            _run_in_process(config, faults, progress, server)
        else:
            orphans = _run_as_command(config, faults, progress, out_dir, server)
        if scenario.resume:
            refusals = [wrong for override in scenario.refused for wrong in refuse_resume(config.run_dir, override)]
            orphans = (orphans or []) + ProcessTree([RLP, "run", "--resume", config.run_dir]).left()
    finally:
        progress.stop()
        if server:
            server.stop()
            os.environ.pop(REDIS_URL_ENV, None)
    for fault in faults:
        fault.recovery_s = progress.recovery(fault.at) if fault.at else None
        if fault.after is not None:
            fault.wrong += fault.after(config.run_dir)
    outcome = account(config, faults)
    outcome.wall_s = round(time.time() - start, 1)
    outcome.orphans, outcome.alerts = orphans, _alerts(config.run_dir)
    struck = [fault.at for fault in faults if fault.at]
    after_s = _first_alert_after(config.run_dir, scenario.alert, struck[scenario.alert_follows]) \
        if scenario.alert and len(struck) > scenario.alert_follows else None
    if after_s is not None:
        outcome.alerted_after = f"{scenario.alert} {after_s:g} s"
    outcome.checks += [wrong for fault in faults for wrong in fault.wrong]
    if scenario.resume:
        outcome.checks += refusals
    if orphans:
        outcome.checks.append(f"{len(orphans)} processes outlived the job: {'; '.join(orphans)[:300]}")
    if scenario.alert and not outcome.alerts.get(scenario.alert):
        outcome.checks.append(f"no {scenario.alert} alert")
    landed = sum(fault.at is not None for fault in faults)
    if landed < len(faults):
        outcome.checks.append(f"{len(faults) - landed} of {len(faults)} planned faults did not land before the job "
                              f"ended")
    if scenario.restarts and outcome.restarts.get(scenario.restarts, 0) != landed:
        outcome.checks.append(f"{landed} faults landed but the job counted "
                              f"{outcome.restarts.get(scenario.restarts, 0)} {scenario.restarts} restarts")
    return outcome


def _first_alert_after(run_dir: str, kind: str, since: float) -> Optional[float]:
    """Seconds from `since` to the first `kind` event the job logged after it (None: none)."""
    path = os.path.join(run_dir, "events.jsonl")
    times = [event["time"] for event in map(json.loads, open(path)) if event["kind"] == kind and event["time"] >= since] \
        if os.path.exists(path) else []
    return round(min(times) - since, 1) if times else None


def _alerts(run_dir: str) -> Dict[str, int]:
    path = os.path.join(run_dir, "events.jsonl")
    if not os.path.exists(path):
        return {}
    return dict(Counter(json.loads(line)["kind"] for line in open(path)))


def _inject_all(faults: List[Fault], job: Running, progress: Progress, errors: List[BaseException],
                ended: Optional[threading.Event] = None) -> None:
    """Each fault once the job reaches its step; a failure after the job `ended` is a fault that did not land."""
    try:
        for fault in faults:
            progress.wait_for(fault.at_step)
            fault.landed_step = progress.steps
            fault.at = fault.inject(fault, job)
    except BaseException as err:  # reported with the scenario
        if ended is None or not ended.is_set():
            errors.append(err)


def _run_in_process(config: JobConfig, faults: List[Fault], progress: Progress,
                    server: Optional[EmbeddedRedis]) -> None:
    errors: List[BaseException] = []
    ended = threading.Event()
    injector = threading.Thread(target=_inject_all, args=(faults, Running(config.run_dir, os.getpid(), server),
                                                          progress, errors, ended), daemon=True)
    injector.start()
    try:
        run_job(config)
    except (JobFailed, DiskFull):
        pass  # a learner rank's death, a full disk: the summary says failed, and the scenario resumes
    finally:
        ended.set()
    injector.join(timeout=120)  # an injection still under way when the job ended (it reports what it saw)
    if errors:
        raise RuntimeError(f"injection failed: {errors[0]}")


def _run_as_command(config: JobConfig, faults: List[Fault], progress: Progress, out_dir: str,
                    server: Optional[EmbeddedRedis]) -> List[str]:
    """`rlp run` of `config` in its own session while `faults` strike it; returns its processes left alive."""
    path = config_file(config, out_dir)
    job = ProcessTree([RLP, "run", path])
    errors: List[BaseException] = []
    _inject_all(faults, Running(config.run_dir, job.pid, server), progress, errors)
    left = job.left()
    if errors:
        raise RuntimeError(f"injection failed: {errors[0]}")
    return left


def config_file(config: JobConfig, out_dir: str) -> str:
    path = os.path.join(out_dir, f"{config.name}.yaml")
    with open(path, "w") as f:
        f.write(to_yaml(config))
    return path


def _command_env() -> Dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # its own local Ray cluster
    env["WANDB_MODE"] = "disabled"
    return env


# counting
def account(config: JobConfig, faults: List[Fault]) -> Outcome:
    """Lost, duplicated and skipped, from trained.jsonl, the final checkpoint's ledger and summary.json."""
    run_dir, group_size = config.run_dir, config.rl.group_size
    with open(os.path.join(run_dir, "summary.json")) as f:
        summary = json.load(f)
    rl = summary.get("rl", {})
    lines = [json.loads(line) for line in open(os.path.join(run_dir, "trained.jsonl"))]
    ids = [i for line in lines for i in line["sample_ids"]]
    prompts = [p for line in lines for p in line["prompts"]]
    checkpoint = latest_checkpoint(run_dir)
    ledger = read_state(checkpoint).policies["policy"].ledger if checkpoint else \
        {"cursor": 0, "counts": Counter(), "in_flight_prompts": [], "open": 0}
    counts, cursor = ledger["counts"], ledger["cursor"]
    known = [p for p in prompts if p is not None]
    ended_otherwise = sum(counts.get(k, 0) for k in ("dropped_stale", "dropped_error", "dropped_zero_advantage"))
    seen = {p for p in set(known) | set(ledger["in_flight_prompts"]) if p < cursor}
    figures = {
        "samples_trained": len(ids),
        "samples_lost": rl.get("samples_dropped_expired", 0) + rl.get("samples_dropped_error", 0)
        + rl.get("samples_dropped_invalid", 0),
        "groups_expired": counts.get("expired", 0),
        "samples_trained_twice": len(ids) - len(set(ids)),
        # a repeat, or a group the ledger had closed (an agent's group, here named agent-..., has no prompt)
        "prompts_trained_twice": len(prompts) - len(set(known)) - len({i.rsplit("/", 1)[0] for i in ids
                                                                        if i.startswith("agent-")}),
        # (a job whose groups are all agents' issues no data prompt, and skips none)
        "prompts_skipped": cursor - len(seen) - ended_otherwise if cursor else 0,
        "dropped_stale": counts.get("dropped_stale", 0) * group_size,
    }
    groups = Counter(i.rsplit("/", 1)[0] for i in ids)
    checks = [f"{summary['status']}: {summary.get('error')}"] if summary["status"] != "completed" else []
    if rl and rl.get("samples_trained") != len(ids):
        checks.append(f"summary says {rl.get('samples_trained')} samples trained, trained.jsonl lists {len(ids)}")
    if counts.get("trained", 0) != len(groups):
        checks.append(f"ledger closed {counts.get('trained', 0)} groups as trained, trained.jsonl has {len(groups)}")
    if any(n != group_size for n in groups.values()):
        checks.append("a trained group did not have group_size samples")
    if rl and samples_unaccounted(rl):
        checks.append(f"summary counts {rl['samples_generated']} samples generated, {samples_unaccounted(rl)} of them "
                      f"not trained, dropped, abandoned at a resume or unused: a restarted worker's counts went missing")
    if sum(counts.get(k, 0) for k in counts if k not in ("issued", "reissued", "admitted")) + ledger["open"] \
            != counts["issued"]:
        checks.append("the checkpoint's ledger does not balance")
    return Outcome(config.name, summary.get("status") == "completed" and rl.get("steps") == config.rl.max_steps,
                   rl.get("steps", 0), faults, figures, checks, rl.get("restarts", {}))


# the scenarios
def _kills(kind: str, actors: Callable[[str], List[str]], first_steps: Optional[int] = None, settle_s: float = 0.0):
    """A SIGKILL of each of `actors(job)` in a seeded order (a restart takes long enough on a busy
    machine that killing one actor again would often land after the job's last step), planned within the
    job's steps or its `first_steps`, each `settle_s` after its actor is alive."""
    def faults(job: str, rng: random.Random, steps: int) -> List[Fault]:
        names = actors(job)
        rng.shuffle(names)
        planned = fault_steps(rng, first_steps or steps, len(names))
        return [Fault(f"SIGKILL {kind}", s, kill_actor(name, settle_s)) for s, name in zip(planned, names)]
    return faults


def _agent_stopped(stopped_s: Optional[float], agents: int):
    """`agents` started before the first step, the first SIGSTOPped mid-group for `stopped_s` (past its episode's
    idle deadline, 5 s here) or for good."""
    def faults(job: str, rng: random.Random, steps: int) -> List[Fault]:
        players = BridgeAgents(group_size=4, count=agents)  # TINY's rl.group_size
        what = f"SIGSTOP an agent for {stopped_s:g} s, then SIGCONT" if stopped_s else "SIGSTOP an agent for good"
        return [Fault("agents playing groups through the bridge", 0, players.start),
                Fault(what, fault_steps(rng, steps, 1)[0], players.stop(stopped_s))]
    return faults


def _sigterm(job: str, rng: random.Random, steps: int) -> List[Fault]:
    return [Fault("SIGTERM to `rlp run`, then `rlp run --resume`", fault_steps(rng, steps, 1)[0],
                  _terminate)]


def _terminate(fault: Fault, job: Running) -> float:
    os.kill(job.pid, signal.SIGTERM)
    return time.time()


SCENARIOS = [
    Scenario("rollout-kill", ["rollout.num_workers=3"],
             _kills("rollout worker", lambda job: [f"{job}-policy-rollout-{i}" for i in range(3)]),
             alert="worker_restart"),
    Scenario("rollout-kill-vllm", VLLM,  # its restart builds a vLLM engine again
             _kills("rollout worker on vLLM", lambda job: [f"{job}-policy-rollout-0"]), alert="worker_restart",
             restarts="rollout"),
    Scenario("reward-kill", ["reward_workers.num_workers=3"],
             _kills("reward worker", lambda job: [f"{job}-reward-{i}" for i in range(3)]), alert="worker_restart"),
    Scenario("evaluator-kill", ["eval.every_steps=1", "eval.priority=normal"],  # it evaluates all along
             _kills("evaluator", lambda job: [f"{job}-policy-rollout-1"], first_steps=60, settle_s=5.0),
             steps=1200, restarts="evaluator", alert="worker_restart"),  # its start-up outlasts a short job's
    # RL: the kill waits until it is alive, then 5 s more (300 steps, 9 s at 255 samples/s, ended first)
    Scenario("embedded-redis-kill", [], lambda job, rng, steps: [
        Fault("SIGKILL embedded redis-server", s, kill_embedded_redis) for s in fault_steps(rng, steps, 2)]),
    Scenario("embedded-redis-stall-resume", ["redis.reconnect_s=5"], lambda job, rng, steps: [
        Fault("SIGSTOP embedded redis-server, then `rlp run --resume`", fault_steps(rng, 20, 1)[0],
              stall_embedded_redis)], resume=True, steps=200),  # early in a job long enough to be running
    # when its Redis is found gone: it checkpoints from the learner's memory and stops
    Scenario("external-redis-restart", [], lambda job, rng, steps: [
        Fault("external Redis restarted", s, restart_external_redis()) for s in fault_steps(rng, steps, 2)],
             external_redis=True),
    # twice redis.reconnect_s: the job checkpoints from the learner and stops at 5 s (its own server with it), and
    # the resume goes on from the checkpoint
    Scenario("embedded-redis-pause-resume", ["redis.reconnect_s=5"], lambda job, rng, steps: [
        Fault("SIGSTOP embedded redis-server for 10 s (twice redis.reconnect_s), then SIGCONT, then `rlp run "
              "--resume`", fault_steps(rng, 20, 1)[0], pause_redis(10.0))], resume=True, steps=200),
    # for good: the job checkpoints from the learner and stops at 5 s; the operator then replaces the server
    # (killed, started again on its port) and the resume goes on
    Scenario("external-redis-stall-resume", ["redis.reconnect_s=5"], lambda job, rng, steps: [
        Fault("SIGSTOP the external redis-server for good; once the job ended, the server replaced, then `rlp run "
              "--resume`", fault_steps(rng, 20, 1)[0], stall_external_redis_for_good)], external_redis=True,
             resume=True, in_process=False, steps=200),
    # twice redis.reconnect_s: the job checkpoints from the learner and stops at 5 s, the operator's server answers
    # again at 10 s, and the resume goes on
    Scenario("external-redis-pause-resume", ["redis.reconnect_s=5"], lambda job, rng, steps: [
        Fault("SIGSTOP the external redis-server for 10 s (twice redis.reconnect_s), then SIGCONT, then `rlp run "
              "--resume`", fault_steps(rng, 20, 1)[0], pause_redis(10.0))], external_redis=True, resume=True,
             in_process=False, steps=200),  # as `rlp run`: the name's lease it could not give back, its process gone
    Scenario("malformed-messages", [], lambda job, rng, steps: [
        Fault(f"{2 * len(MALFORMED) + 1} malformed stream entries", s, write_malformed)
        for s in fault_steps(rng, steps, 2)]),
    Scenario("learner-kill-resume", ["checkpoint.every_steps=3"],
             _kills("learner rank, then `rlp run --resume`", lambda job: [f"{job}-policy-learner-0"]),
             resume=True),
    Scenario("sigterm-resume", ["checkpoint.every_steps=3"], _sigterm, resume=True, in_process=False),
    Scenario("process-group-kill-resume", ["checkpoint.every_steps=3"], lambda job, rng, steps: [
        Fault("SIGKILL of `rlp run`'s process group, then `rlp run --resume`", fault_steps(rng, steps, 1)[0],
              kill_process_group)], resume=True, in_process=False),
    Scenario("bridge-flood", BRIDGE,
             lambda job, rng, steps: [Fault("240 oversized and malformed bridge requests", s, flood_bridge())
                                      for s in fault_steps(rng, 60, 2)], steps=300),  # the job outlives both
    Scenario("same-name-beside", [], lambda job, rng, steps: [
        Fault("`rlp run` of the same name: same run directory, then same Redis", s, start_beside)
        for s in fault_steps(rng, 16, 1)], in_process=False, steps=100),  # live through both refused starts
    Scenario("slow-reward-sigterm-resume",  # one sample in 10 takes 10 s to score: the stop does not wait for it
             ["imports=[benchmarks.bench_rewards]", "rewards=[{fn: 'benchmarks.bench_rewards:sometimes_slow_exact_match'}]"],
             _sigterm, resume=True, in_process=False),
    Scenario("nan-config-resume", ["checkpoint.every_steps=3"], lambda job, rng, steps: [
        Fault("SIGTERM to `rlp run`, `rlp run --resume` refused with rl.lr=.nan and with rewards[0].weight=.inf, "
              "then `rlp run --resume`", fault_steps(rng, steps, 1)[0], _terminate)],
             resume=True, in_process=False, refused=["rl.lr=.nan", "rewards[0].weight=.inf"]),
    Scenario("rollout-hang", WATCHDOG, lambda job, rng, steps: [
        Fault("SIGSTOP rollout worker for good", s, stop_for_good(f"{job}-policy-rollout-0"))
        for s in fault_steps(rng, steps, 1)], alert="hang", restarts="rollout"),
    Scenario("rollout-hang-vllm", [*WATCHDOG, *VLLM], lambda job, rng, steps: [
        Fault("SIGSTOP rollout worker on vLLM for good", s, stop_for_good(f"{job}-policy-rollout-0"))
        for s in fault_steps(rng, steps, 1)], alert="hang", restarts="rollout"),
    Scenario("reward-hang", [*WATCHDOG, "reward_workers.num_workers=1", "rewards=[{name: exact_match, timeout_s: 1}]"],
             lambda job, rng, steps: [Fault("SIGSTOP the only reward worker for good", s,
                                            stop_for_good(f"{job}-reward-0")) for s in fault_steps(rng, steps, 1)],
             alert="hang", restarts="reward"),
    Scenario("learner-hang-resume", [*WATCHDOG, "checkpoint.every_steps=3"], lambda job, rng, steps: [
        Fault("SIGSTOP learner rank for good, then `rlp run --resume`", s, stop_for_good(f"{job}-policy-learner-0"))
        for s in fault_steps(rng, 16, 1)], resume=True, alert="hang", steps=60),  # lands while RL runs
    # twice the deadline, then continued: the watchdog acts at the deadline, as for a process stopped for good
    Scenario("rollout-pause", WATCHDOG, lambda job, rng, steps: [
        Fault("SIGSTOP rollout worker for 10 s (twice its deadline), then SIGCONT", s,
              stop_then_continue(f"{job}-policy-rollout-0", 10.0)) for s in fault_steps(rng, steps, 1)],
             alert="hang", restarts="rollout"),
    Scenario("rollout-pause-vllm", [*WATCHDOG, *VLLM], lambda job, rng, steps: [
        Fault("SIGSTOP rollout worker on vLLM for 10 s (twice its deadline), then SIGCONT", s,
              stop_then_continue(f"{job}-policy-rollout-0", 10.0)) for s in fault_steps(rng, 16, 1)],
             alert="hang", restarts="rollout", steps=60),  # a job that outlives the deadline after a late fault
    Scenario("reward-pause", [*WATCHDOG, "reward_workers.num_workers=1", "rewards=[{name: exact_match, timeout_s: 1}]"],
             lambda job, rng, steps: [Fault("SIGSTOP the only reward worker for 20 s (twice its deadline), then "
                                            "SIGCONT", s, stop_then_continue(f"{job}-reward-0", 20.0))
                                      for s in fault_steps(rng, steps, 1)], alert="hang", restarts="reward"),
    Scenario("evaluator-hang", [*WATCHDOG, "eval.every_steps=1", "eval.priority=normal"], lambda job, rng, steps: [
        Fault("SIGSTOP the evaluator for good", s, stop_for_good(f"{job}-policy-rollout-1"))
        for s in fault_steps(rng, 60, 1)], alert="hang", restarts="evaluator", steps=300),
    Scenario("learner-pause-resume", [*WATCHDOG, "checkpoint.every_steps=3"], lambda job, rng, steps: [
        Fault("SIGSTOP learner rank for 10 s (twice its deadline), then SIGCONT, then `rlp run --resume`", s,
              stop_then_continue(f"{job}-policy-learner-0", 10.0)) for s in fault_steps(rng, 16, 1)],
             resume=True, alert="hang", steps=60),
    Scenario("tool-hang", [*WATCHDOG, *TOOLS], lambda job, rng, steps: [
        Fault("SIGSTOP the only tool worker for good", s, stop_for_good(f"{job}-tool-0"))
        for s in fault_steps(rng, steps, 1)], alert="hang", config=TOOL_CALC),
    Scenario("tool-pause", [*WATCHDOG, *TOOLS], lambda job, rng, steps: [
        Fault("SIGSTOP the only tool worker for 10 s (twice its deadline), then SIGCONT", s,
              stop_then_continue(f"{job}-tool-0", 10.0)) for s in fault_steps(rng, steps, 1)], alert="hang",
             config=TOOL_CALC),
    # during RL nothing waits on the evaluator (its evaluations run beside the steps): no alert is due
    Scenario("evaluator-pause", [*WATCHDOG, "eval.every_steps=1", "eval.priority=normal"], lambda job, rng, steps: [
        Fault("SIGSTOP the evaluator for 20 s, then SIGCONT", s, stop_then_continue(f"{job}-policy-rollout-1", 20.0))
        for s in fault_steps(rng, 60, 1)], steps=300),
    # agents outside the job, its only source (rollout.source: bridge), playing groups through the bridge; the
    # deadlines derived (rl.group_timeout_s unset): an agent silent past its episode's idle deadline loses that
    # episode (played again once it is back); one stopped for good leaves its group to expire
    Scenario("agent-pause", [*WATCHDOG, *AGENTS], _agent_stopped(12.0, agents=1), alert="agent_episodes_expired",
             alert_follows=1),
    Scenario("agent-hang", [*WATCHDOG, *AGENTS], _agent_stopped(None, agents=2), alert="agent_episodes_expired",
             alert_follows=1, steps=300),  # the job outlives the stopped agent's group deadline
    Scenario("reward-sigstop", ["reward_workers.num_workers=1", "monitoring.scoring_stall_s=10"],
             lambda job, rng, steps: [Fault("SIGSTOP the only reward worker for 20 s", s,
                                            stop_then_continue(f"{job}-reward-0", 20.0))
                                      for s in fault_steps(rng, steps, 1)], alert="scoring_stalled"),
    Scenario("corrupt-checkpoint-resume", ["checkpoint.every_steps=3"], lambda job, rng, steps: [  # after 2
        Fault("SIGKILL of `rlp run`'s process group, its newest checkpoint truncated, then `rlp run --resume`",
              rng.randint(7, steps - 2), kill_and_corrupt)], resume=True, in_process=False,
             alert="checkpoint_set_aside"),
    Scenario("full-disk-resume", ["checkpoint.every_steps=3"], lambda job, rng, steps: [  # after the first
        Fault("the checkpoints' disk filled, freed once the job failed, then `rlp run --resume`",
              rng.randint(4, steps - 2), fill_disk)], resume=True, disk="64m"),
]


# the report
def table(outcomes: List[Outcome]) -> List[str]:
    rows = ["| scenario | faults injected (at step) | completed | steps | samples trained | lost | trained twice "
            "(samples / prompts) | prompts skipped | recovery s per fault | restarts | processes left | alerts | "
            "accounting checks |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for o in outcomes:
        injected = "; ".join(f"{f.what} ({f.landed_step})" for f in o.faults if f.at is not None) or "none landed"
        recovery = ", ".join("no later step" if f.recovery_s is None else f"{f.recovery_s:g}"
                             for f in o.faults if f.at)
        restarts = ", ".join(f"{k} {v}" for k, v in o.restarts.items() if v) or "0"
        c = o.counts
        left = "- (in process)" if o.orphans is None else str(len(o.orphans))
        alerts = ", ".join(f"{kind} {n}" for kind, n in sorted(o.alerts.items())) or "none"
        if o.alerted_after:
            alerts += f" ({o.alerted_after} after the fault)"
        rows.append(f"| {o.scenario} | {injected} | {'yes' if o.completed else 'NO'} | {o.steps} | "
                    f"{c['samples_trained']} | {c['samples_lost']} | {c['samples_trained_twice']} / "
                    f"{c['prompts_trained_twice']} | {c['prompts_skipped']} | {recovery} | {restarts} | {left} | "
                    f"{alerts} | {'; '.join(o.checks) or 'agree'} |")
    return rows


def write_report(outcomes: List[Outcome], path: str, command: str, wall_s: float) -> None:
    lines = ["# Fault injection", "",
             f"{datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC, {platform.node()}: {os.cpu_count()} CPUs "
             f"(shared with other work), Python {sys.version.split()[0]}, `{command}`, {wall_s:.0f} s in all.", "",
             "Tiny Qwen2 policies built from config (2 layers, hidden 64), RL only, 2 prompts x 4 completions a "
             "step; real Ray, redis-server and DeepSpeed (gloo). Faults are planned at seeded random steps; the "
             "step in brackets is how many steps were trained when each struck. Counted from what each run left: "
             "`trained.jsonl` (sample ids and prompt positions of every step), the final checkpoint's prompt "
             "ledger and `summary.json`. Lost: samples discarded (arrived for an expired group, reward errors); "
             "trained twice: repeated sample ids, and prompt positions trained again (or trained after the ledger "
             "had closed their group); skipped: ledger positions issued but neither trained, dropped by a rule "
             "nor still in flight (open or queued for re-issue) at the end; recovery: seconds from the fault "
             "until a learner step next ended (for a resume, including the new process's start-up); restarts: "
             "worker restarts the job counted (a restarted Redis is a `redis_restart` event instead); processes "
             "left: processes `rlp run` started (its descendants) still alive 10 s after it ended, for jobs run as a "
             "command; alerts: the events the job logged (events.jsonl) by kind, over all its attempts, and how "
             "soon after the fault came the alert the scenario expects; a fault's "
             "own check (a start that should have refused, a bridge answering a bad request with 200 or 5xx, or "
             "not answering a good one after the flood) is listed with the accounting checks.", "",
             *table(outcomes), ""]
    with open(path, "w") as f:
        f.write("\n".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20, help="RL steps of each job")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--only", nargs="*", help="scenario names to run (default: all)")
    parser.add_argument("--out", default=os.path.join(REPO, "benchmarks", "results", "faults.md"))
    args = parser.parse_args()
    os.environ.setdefault("WANDB_MODE", "disabled")
    ray.init(num_cpus=max(os.cpu_count() or 1, 8), include_dashboard=False, log_to_driver=False)
    start, outcomes = time.time(), []
    with tempfile.TemporaryDirectory(prefix="rlp-faults-") as out_dir:
        for scenario in SCENARIOS:
            if args.only and scenario.name not in args.only:
                continue
            if scenario.disk and os.geteuid() != 0:
                print(f"{scenario.name}: not run (its small disk is a tmpfs, which only root can mount)", flush=True)
                continue
            outcome = run_scenario(scenario, out_dir, args.steps, args.seed)
            print("\n".join(table([outcome])[2:]), flush=True)
            outcomes.append(outcome)
    command = "python benchmarks/faults.py " + " ".join(sys.argv[1:])
    write_report(outcomes, args.out, command.strip(), time.time() - start)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

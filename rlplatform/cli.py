"""The `rlp` command: run or validate a job from its YAML.

The config is parsed and validated before torch, Ray or DeepSpeed are imported, so a bad
config fails in a second with one line naming the file and key, and exit code 2.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from typing import List, Optional, Tuple

from rlplatform import preflight
from rlplatform.config import REDIS_URL_ENV, ConfigError, JobConfig, load_config, redact_url, redact_urls_in
from rlplatform.job.summaries import EVAL_LABELS


def _load(args) -> JobConfig:
    config = load_config(args.config, args.overrides)
    _resolve_rewards(config, args.config)
    _resolve_environment(config, args.config)
    return config


def _resolve_environment(config: JobConfig, source: str) -> None:
    """The job's environment class and tools exist (after `imports`, which may register tools); a taskset is
    checked with the data (`preflight.check_taskset`)."""
    from rlplatform.envs.environment import environment_factory
    from rlplatform.envs.tools import ToolSpecError, resolve_tools

    try:
        resolve_tools(config.env.tools)
        if not config.env.plays_taskset:
            environment_factory(config.env)
    except (ToolSpecError, ValueError) as err:
        raise ConfigError(f"{source}: {err}") from None


def _resolve_rewards(config: JobConfig, source: str):
    from rlplatform.rewards import RewardSpecError, resolve
    from rlplatform.user_code import import_modules

    try:
        import_modules(config.imports)
    except ImportError as err:
        raise ConfigError(f"{source}: 'imports': {err}") from None
    try:
        return resolve(config.rewards)
    except RewardSpecError as err:
        raise ConfigError(f"{source}: {err}") from None


def _run(args) -> int:
    if args.seeds is not None:
        return _run_seeds(args)
    return _run_once(args)


def _run_seeds(args) -> int:
    """`rlp run CONFIG --seeds N`: the job once per seed, each run as `rlp run` runs it (`seeds.run_seeds`)."""
    from rlplatform.job.seeds import run_seeds

    if args.resume:
        raise ConfigError("rlp run: --seeds starts new runs and cannot --resume; resume one seed's run with "
                          "`rlp run --resume runs/<name>/<name>-seed-<seed>`")
    if args.config is None:
        raise ConfigError("rlp run --seeds: give a job YAML")
    config = load_config(args.config, args.overrides)
    import ray

    from rlplatform.job.cluster import shutdown_ray

    ours = not ray.is_initialized()  # the first seed starts a local Ray, which the later seeds run on

    def run_seed(overrides: List[str], started_at: Optional[float]) -> int:
        return _run_once(argparse.Namespace(**{**vars(args), "overrides": [*args.overrides, *overrides]}),
                         started_at, keep_ray=True)

    try:
        return run_seeds(config, args.seeds, run_seed)
    finally:
        if ours and ray.is_initialized():
            shutdown_ray()


def _run_once(args, started_at: Optional[float] = None, keep_ray: bool = False) -> int:
    """One job, to its result line; `started_at` (wall clock): when its start-up began, default the process's
    start. The job shuts down the Ray it started or joined, unless `keep_ray` (the caller's to shut down)."""
    if args.resume:
        if args.config and "=" in args.config:  # `rlp run --resume runs/x key=value`: no config given
            args.config, args.overrides = None, [args.config, *args.overrides]
        args.overrides = _resume_overrides(args)
        args.config = args.config or os.path.join(args.resume, "config.yaml")
    elif args.config is None:
        raise ConfigError("rlp run: give a job YAML, or --resume runs/<name>")
    config = _load(args)
    preflight.check_without_models(config, args.config)
    _check_run_dir(config, args.fresh)
    import psutil

    from rlplatform.job.cluster import start_local_ray_while

    def load() -> None:  # what imports torch and transformers, on another thread while Ray starts
        preflight.check_models(config, args.config)
        importlib.import_module("rlplatform.job.controller")

    import ray

    ours = not ray.is_initialized()  # else the caller's (`--seeds` after its first seed, or a program's)
    start_local_ray_while(config, load)
    from rlplatform.job.controller import run_job

    # the job shuts down the Ray started (or joined) here too: before it sets back the signal handlers it found,
    # which are Ray's own (a SIGTERM there would exit 15 without a word)
    summary = run_job(config, started_at=started_at or psutil.Process().create_time(),
                      shutdown_ray=ours and not keep_ray, fresh=args.fresh)
    print(_result_line(summary))
    return summary.get("exit_code", 0)


def _check_run_dir(config, fresh: bool) -> None:
    """Before Ray starts: the run directory and the job's name on a shared Redis are no live job's, and the
    directory holds no earlier run's checkpoints unless the run resumes them or `--fresh` moves them aside
    (`run_job` holds the directory's lock and the name's lease from then on)."""
    from rlplatform.job.run_dir import RunLock, check_fresh_start

    if config.redis.url:
        from rlplatform.transport.job_lease import live_job_message
        from rlplatform.transport.redis_server import RedisUnavailable, connect

        try:
            refusal = live_job_message(connect(config.redis.url), config.name)
        except RedisUnavailable:  # the job says so itself, with its summary
            refusal = None
        if refusal:
            raise ConfigError(refusal)
    if not os.path.isdir(config.run_dir):  # no earlier run; the job makes the directory (and takes its lock)
        return
    with RunLock(config.run_dir):
        if not fresh:
            check_fresh_start(config)


def _resume_overrides(args) -> List[str]:
    """`--resume runs/<name>`: that run's config (unless one is given), its directory, resume required."""
    run_dir = os.path.normpath(args.resume)
    if not os.path.isdir(run_dir):
        raise ConfigError(f"--resume {args.resume}: no such run directory")
    return [*args.overrides, f"output_dir={os.path.dirname(run_dir) or '.'}", f"name={os.path.basename(run_dir)}",
            "resume=always"]


def _validate(args) -> int:
    config = _load(args)
    preflight.check(config, args.config)
    print(f"{args.config}: ok (job '{config.name}', output {config.run_dir})")
    return 0


def _result_line(summary: dict) -> str:
    """The job's last console line: outcome, wall time, and every policy's accuracy and throughput."""
    parts = [f"{summary['name']}: {summary['status']} in {summary['wall_s']:.0f}s"]
    if "policies" in summary:
        parts.append("; ".join(f"{name}: {_policy_figures(result)}" for name, result in summary["policies"].items()))
    elif _policy_figures(summary):
        parts.append(_policy_figures(summary))
    parts.append(f"results in {summary['run_dir']}")
    return ", ".join(parts)


def _policy_figures(result: dict) -> str:
    evals = result.get("eval", {})
    figures = [f"accuracy {label.replace('_', ' ')} {evals[label]['accuracy']:.3f}"
               for label in EVAL_LABELS if label in evals]
    if "rl" in result:
        figures.append(f"{result['rl']['samples_per_s']:.0f} samples/s")
    return ", ".join(figures)


def _rewards_list(args) -> int:
    from rlplatform.rewards import all_rewards

    print(f"{'name':<20} {'source':<12} {'kind':<18} parameters")
    for found in all_rewards():
        print(found.describe())
    return 0


def _rewards_test(args) -> int:
    """Score `completion` fields of jsonl rows with the config's rewards; one JSON line per row."""
    import json

    from rlplatform.data import read_jsonl
    from rlplatform.rewards.scoring import Scorer
    from rlplatform.transport.samples import Sample

    config = load_config(args.config, args.overrides)
    scorer = Scorer(_resolve_rewards(config, args.config), config.reward_workers.concurrency)
    rows = read_jsonl(args.input)
    samples = [Sample(f"row-{i}", f"row-{i}", "test", str(r.get("prompt", "")), str(r.get("completion", "")),
                      prompt_ids=[], completion_ids=[], behaviour_logprobs=[], token_versions=[],
                      row={k: v for k, v in r.items() if k not in ("prompt", "completion")})
               for i, r in enumerate(rows)]
    results = scorer.score(samples)
    for scored in results:
        print(json.dumps({"row": scored.sample.sample_id, "reward": scored.reward, "components": scored.components,
                          "filtered": scored.filtered, "drop": scored.drop, "error": scored.error,
                          "reasons": scored.reasons}))
    errors = sum(s.error is not None for s in results)
    mean = sum(s.reward for s in results) / max(len(results), 1)
    print(f"{len(results)} rows scored, mean reward {mean:.4f}, {errors} errors", file=sys.stderr)
    return 0


def _reward_worker(args) -> int:
    """A standalone reward worker serving job `args.job`'s newest run until that run stops."""
    from rlplatform.config import RewardWorkersConfig
    from rlplatform.rewards.worker import RewardWorker, default_worker_name, job_rewards_from_json
    from rlplatform.transport.redis_server import connect
    from rlplatform.transport.keys import JobKeys

    client = connect(_redis(args))
    run, specs = _published(lambda: _newest_run_with(client, args.job, lambda run: JobKeys(run).rewards),
                            f"job '{args.job}' to start")
    rewards, imports = job_rewards_from_json(specs.decode())
    config = RewardWorkersConfig(concurrency=args.concurrency, batch_size=args.batch_size)
    worker = RewardWorker(args.name or default_worker_name(args.job), rewards, _redis(args), run, config,
                          imports=imports)
    print(f"rlp: reward worker {worker.name} serving job '{args.job}' (run {run})", file=sys.stderr)
    stats = worker.run()
    print(f"rlp: job '{args.job}' stopped; scored {stats.scored} samples, {stats.errors} errors, "
          f"{stats.dead_letters} dead letters", file=sys.stderr)
    return 0


def _rollout_worker(args) -> int:
    """Rollout workers on this node of job `args.job`'s Ray cluster, attached to its newest run for as long as
    this command runs (`rlplatform.transport.worker_attach`); they leave once it ends (Ctrl-C, SIGTERM)."""
    import signal
    import time

    from rlplatform.transport.job_lease import newest_run
    from rlplatform.transport.keys import JobKeys, NameKeys
    from rlplatform.transport.redis_server import connect
    from rlplatform.transport.worker_attach import LEASE_S, AttachLease

    client = connect(_redis(args))
    run = _published(lambda: newest_run(client, args.job) if client.exists(NameKeys(args.job).owner) else None,
                     f"job '{args.job}' to start")
    keys = JobKeys(run)
    node_ip = "" if args.node_id else _node_ip()
    lease = AttachLease.ask(client, keys, policy=args.policy or "", node_id=args.node_id or "", node_ip=node_ip,
                            workers=args.workers)
    where = f"node {args.node_id}" if args.node_id else f"the node at {node_ip}"
    print(f"rlp: asked job '{args.job}' (run {run}) for {args.workers} rollout worker(s) on {where}", file=sys.stderr)
    stopping: List[int] = []
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stopping.append(1))
    answered, asked_at = None, time.monotonic()
    try:
        while not stopping:
            if client.exists(keys.stop) or not client.exists(NameKeys(args.job).owner) or \
                    newest_run(client, args.job) != run:
                print(f"rlp: job '{args.job}' ended; its rollout workers here ended with it", file=sys.stderr)
                return 0
            if not lease.renew():
                print(f"rlp: this command's lease lapsed (not renewed for {LEASE_S:g} s): job '{args.job}' stopped its "
                      f"rollout workers here", file=sys.stderr)
                return 1
            if answered is None and (answered := lease.answer()) is not None:
                if answered.refused:
                    print(f"rlp: job '{args.job}' refused: {answered.refused}", file=sys.stderr)
                    return 1
                print(f"rlp: attached {', '.join(answered.workers)}; they generate for job '{args.job}' until this "
                      f"command ends (Ctrl-C)", file=sys.stderr)
            elif answered is None and time.monotonic() - asked_at > 30:
                print(f"rlp: waiting for job '{args.job}' to take the request (it does during its RL stage)",
                      file=sys.stderr)
                asked_at = time.monotonic()
            time.sleep(LEASE_S / 5)
    finally:
        lease.release()
    print(f"rlp: detached: job '{args.job}' stops the workers and issues the groups they had not submitted again",
          file=sys.stderr)
    return 0


def _node_ip() -> str:
    """This machine's address as Ray's nodes report theirs."""
    import ray.util

    return ray.util.get_node_ip_address()


def _newest_run_with(client, job: str, key):
    """(the `run_scope` of job `job`'s newest run, the value it keeps under `key(run)`) once it keeps one, else
    None: read afresh each time, so a worker started before the job, or beside an ended run, finds the new run."""
    from rlplatform.transport.job_lease import newest_run

    run = newest_run(client, job)
    value = client.get(key(run)) if run is not None else None
    return (run, value) if value is not None else None


def _published(read, what: str):
    """What `read()` returns once the job has published it (not None), saying every 2 s what is awaited."""
    import time

    while (value := read()) is None:
        print(f"rlp: waiting for {what}", file=sys.stderr)
        time.sleep(2)
    return value


def _tool_worker(args) -> int:
    """A standalone tool worker serving the tool calls of job `args.job`'s newest run until that run stops."""
    from rlplatform.config import RewardWorkersConfig
    from rlplatform.envs.tool_worker import ToolWorker, default_tool_worker_name, job_tools_from_json
    from rlplatform.transport.keys import ToolKeys
    from rlplatform.transport.redis_server import connect

    client = connect(_redis(args))
    run, specs = _published(lambda: _newest_run_with(client, args.job, lambda run: ToolKeys(run).specs),
                            f"job '{args.job}' to start (with env.tools)")
    tools, imports = job_tools_from_json(specs.decode())
    config = RewardWorkersConfig(concurrency=args.concurrency, batch_size=args.batch_size)
    worker = ToolWorker(args.name or default_tool_worker_name(args.job), tools, _redis(args), run, config,
                        imports=imports)
    print(f"rlp: tool worker {worker.name} serving job '{args.job}' (run {run})", file=sys.stderr)
    stats = worker.run()
    print(f"rlp: job '{args.job}' stopped; {stats.calls} tool calls, {stats.errors} errors, "
          f"{stats.dead_letters} dead letters", file=sys.stderr)
    return 0


def _verifiers(args) -> int:
    """Play a verifiers taskset's tasks through a running job's OpenAI bridge(s), as trainable episodes."""
    import asyncio

    from rlplatform.envs.verifiers_rollouts import play

    print(f"rlp: playing '{args.taskset}' through {', '.join(args.url)}: {args.group_size} rollouts per task",
          file=sys.stderr)
    try:
        stats = asyncio.run(play(args.taskset, args.url, args.group_size, args.num_tasks, args.epochs,
                                 concurrency=args.concurrency))
    except (ImportError, ValueError, TypeError) as err:  # verifiers missing, a taskset that does not load
        print(f"rlp: {err}", file=sys.stderr)
        return 2
    print(f"rlp: {stats.groups} tasks played, {stats.finished} episodes sent to the job (mean verifiers reward "
          f"{stats.mean_reward:.3f}), {stats.failed} rollouts failed, {stats.discarded} bridge episodes discarded",
          file=sys.stderr)
    for error in stats.errors:
        print(f"rlp: failed: {error}", file=sys.stderr)
    return 0 if stats.finished or not stats.failed else 1


def _status(args) -> int:
    import time

    from rlplatform.monitoring.job_status import JobStatus, format_beats, format_status
    from rlplatform.transport.deadlines import Heartbeats
    from rlplatform.transport.job_lease import newest_run
    from rlplatform.transport.redis_server import connect
    from rlplatform.transport.samples import WireFormatError

    if args.run_dir:  # that run: its name, id and Redis from its directory
        job, run = _run_in(args.run_dir)
        client = connect(_redis(args, os.path.join(args.run_dir, "redis.url")))
    elif args.job:
        job = args.job
        client = connect(_redis(args))
        run = newest_run(client, job)  # the name's newest run: the live one, while one is
    else:
        raise ConfigError("rlp status: give a run directory (rlp status runs/<name>) or --job NAME")
    try:
        status = JobStatus(client, run).read() if run is not None else None
    except WireFormatError as err:  # written by another version of the platform, or by hand
        print(f"rlp: job '{job}' has a status this rlp cannot read: {err}", file=sys.stderr)
        return 1
    if status is None:
        print(f"rlp: no status for job '{job}' on this Redis (not started, or expired)", file=sys.stderr)
        return 1
    print(f"{job}: {format_status(status, time.time())}")
    for line in format_beats(Heartbeats(client, run).beats(), time.time()):
        print(f"  {line}")
    return 0


def _run_in(run_dir: str) -> Tuple[str, str]:
    """(job name, `run_scope`) of the run whose directory is `run_dir`: its config's name and its run id."""
    from omegaconf import OmegaConf

    from rlplatform.job.run_dir import kept_run_id
    from rlplatform.transport.keys import run_scope

    config = os.path.join(run_dir, "config.yaml")
    name = OmegaConf.load(config).get("name") if os.path.isfile(config) else None
    run_id = kept_run_id(run_dir) if os.path.isdir(run_dir) else None
    if name is None or run_id is None:
        raise ConfigError(f"rlp status: {run_dir} is not a run directory (it needs the config.yaml and run_id "
                          f"a job writes there)")
    return name, run_scope(name, run_id)


def _dashboard(args) -> int:
    from rlplatform.monitoring.dashboard import build_workspace, render_layout

    policies = args.policy or ["policy"]
    if args.dry_run:
        print("\n".join(render_layout(p) for p in policies))
        return 0
    workspace = build_workspace(args.entity, args.project, policies, args.name)
    workspace.save()
    print(f"created workspace '{args.name}': {workspace.url}")
    return 0


REDIS_HELP = (f"the job's Redis URL, or @FILE to read it from a file (runs/<name>/redis.url for an embedded one); "
              f"unset: ${REDIS_URL_ENV}. A URL given here is visible to other users in `ps`")


def _redis(args, url_file: Optional[str] = None) -> str:
    """The Redis URL of `--redis` (read from the file `@FILE` names), else the one `url_file` holds where it
    exists (a run directory's redis.url), else $RLP_REDIS_URL."""
    kept = f"@{url_file}" if url_file and os.path.isfile(url_file) else None
    value = args.redis or kept or os.environ.get(REDIS_URL_ENV)
    if not value:
        raise ConfigError(f"rlp {args.command}: give --redis URL, --redis @runs/<name>/redis.url, "
                          f"or set {REDIS_URL_ENV}")
    if value.startswith("@"):
        try:
            with open(value[1:]) as f:
                return f.read().strip()
        except OSError as err:
            raise ConfigError(f"rlp {args.command}: --redis {value}: {err.strerror}") from None
    return value


def _redact_argv(argv: List[str]) -> List[str]:
    """The command line with every Redis URL's password hidden: what the process records of itself (the W&B
    run's metadata reads sys.argv)."""
    redacted = []
    for arg in argv:
        key, sep, value = arg.partition("=") if "=" in arg.split("://")[0] else ("", "", arg)  # key=value, or a value
        redacted.append(key + sep + (redact_url(value) if "://" in value else value))
    return redacted


def _positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seeds (1 or more)")
    return int(text)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rlp", description="Asynchronous RL post-training for language models.")
    commands = parser.add_subparsers(dest="command", required=True)
    for name, handler, text in (("run", _run, "run a job"), ("validate", _validate, "check a job config")):
        sub = commands.add_parser(name, help=text)
        sub.add_argument("config", nargs="?" if name == "run" else None,
                         help="job YAML, e.g. configs/quickstart.yaml")
        sub.add_argument("overrides", nargs="*", help="key=value overrides, e.g. rl.max_steps=5")
        sub.set_defaults(handler=handler)
    run = commands.choices["run"]
    run.add_argument("--resume", metavar="RUN_DIR", help="continue runs/<name> from its newest checkpoint "
                     "(its config.yaml unless a config is given)")
    run.add_argument("--seeds", type=_positive, metavar="N", help="run the job once per seed, seed, seed+1, ... "
                     "seed+N-1, in runs/<name>/<name>-seed-<s>/, one after another, then write the figures' mean, "
                     "min, max and spread over the seeds to runs/<name>/seeds.json and the console")
    run.add_argument("--fresh", action="store_true", help="start afresh where an earlier run of this name left "
                     "checkpoints, moving that run to runs/<name>.moved-<time> (nothing is deleted)")
    rewards = commands.add_parser("rewards", help="list rewards, or score rows with a config's rewards")
    reward_actions = rewards.add_subparsers(dest="action", required=True)
    reward_actions.add_parser("list", help="every reward that can be found, with its parameters"
                              ).set_defaults(handler=_rewards_list)
    test = reward_actions.add_parser("test", help="score jsonl rows (prompt, completion, fields) without training")
    test.add_argument("config")
    test.add_argument("overrides", nargs="*")
    test.add_argument("--input", required=True, help="jsonl rows with prompt, completion and the data fields")
    test.set_defaults(handler=_rewards_test)
    worker = commands.add_parser("reward-worker", help="serve a running job's reward queue from this machine")
    worker.add_argument("--redis", help=REDIS_HELP)
    worker.add_argument("--job", required=True, help="the job's name")
    worker.add_argument("--concurrency", type=int, default=8, help="samples scored at once")
    worker.add_argument("--batch-size", type=int, default=64, help="queue messages read per call")
    worker.add_argument("--name", help="consumer name (default: <job>-reward-<host>-<pid>)")
    worker.set_defaults(handler=_reward_worker)
    rollout = commands.add_parser("rollout-worker", help="attach rollout workers on this node of a running job's Ray "
                                  "cluster, for as long as this command runs")
    rollout.add_argument("--redis", help=REDIS_HELP)
    rollout.add_argument("--job", required=True, help="the job's name")
    rollout.add_argument("--policy", help="the policy they generate for (default: the job's only one)")
    rollout.add_argument("--workers", type=_positive, default=1, help="rollout workers to start here")
    rollout.add_argument("--node-id", help="the Ray node to start them on (default: the node at this machine's "
                         "address; needed where one machine runs several nodes)")
    rollout.set_defaults(handler=_rollout_worker)
    tools = commands.add_parser("tool-worker", help="serve a running job's tool calls from this machine")
    tools.add_argument("--redis", help=REDIS_HELP)
    tools.add_argument("--job", required=True, help="the job's name")
    tools.add_argument("--concurrency", type=int, default=8, help="tool calls run at once")
    tools.add_argument("--batch-size", type=int, default=64, help="queue messages read per call")
    tools.add_argument("--name", help="consumer name (default: <job>-tool-<host>-<pid>)")
    tools.set_defaults(handler=_tool_worker)
    verifiers = commands.add_parser("verifiers", help="play a verifiers taskset's tasks through a job's OpenAI "
                                    "bridge as trainable episodes (the verifiers extra)")
    verifiers.add_argument("taskset", help="an importable module exporting a verifiers Taskset (and optionally an Env)")
    verifiers.add_argument("--url", action="append", required=True,
                           help="a rollout worker's bridge URL, http://HOST:PORT/v1 (repeat for several)")
    verifiers.add_argument("--group-size", type=int, required=True, help="rollouts per task: the job's rl.group_size")
    verifiers.add_argument("--num-tasks", type=int, help="play the first N tasks (default: all; needed if infinite)")
    verifiers.add_argument("--epochs", type=int, default=1, help="passes over the tasks")
    verifiers.add_argument("--concurrency", type=int, default=8, help="rollouts in flight at once")
    verifiers.set_defaults(handler=_verifiers)
    status = commands.add_parser("status", help="progress of a job running anywhere, read from its Redis")
    status.add_argument("run_dir", nargs="?", help="a run's directory (runs/<name>): that run, its Redis URL read "
                        "from its redis.url file")
    status.add_argument("--redis", help=REDIS_HELP)
    status.add_argument("--job", help="the job's name (its newest run), where no run directory is given")
    status.set_defaults(handler=_status)
    dashboard = commands.add_parser("dashboard", help="W&B dashboards")
    actions = dashboard.add_subparsers(dest="action", required=True)
    create = actions.add_parser("create", help="create a W&B workspace laid out for rlplatform runs")
    create.add_argument("--entity", required=True)
    create.add_argument("--project", required=True)
    create.add_argument("--name", default="rlplatform", help="workspace name")
    create.add_argument("--policy", action="append", help="policy name (repeat for several; default 'policy')")
    create.add_argument("--dry-run", action="store_true", help="print the layout instead of creating it")
    create.set_defaults(handler=_dashboard)
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    sys.argv[:] = _redact_argv(sys.argv)
    try:
        return args.handler(args)
    except ConfigError as err:
        print(f"rlp: config error: {redact_urls_in(str(err))}", file=sys.stderr)
        return 2
    except Exception as err:
        from rlplatform.job.checkpoint import DiskFull
        from rlplatform.transport.deadlines import JobFailed

        cause = getattr(err, "cause", err)  # a failed Ray task keeps the worker's own error as `cause`
        if isinstance(err, (JobFailed, DiskFull)) or isinstance(cause, ConnectionError):  # one line, no traceback
            print(f"rlp: {redact_urls_in(str(cause))}", file=sys.stderr)
            return getattr(err, "exit_code", 1)
        raise
    except KeyboardInterrupt:
        print("rlp: interrupted", file=sys.stderr)
        return 130
    except BaseException as err:
        from rlplatform.job.signals import Interrupted

        if isinstance(err, Interrupted):  # a further signal while the job wrote its summary and closed W&B
            print(f"rlp: {err}", file=sys.stderr)
            return 128 + err.signum
        raise


if __name__ == "__main__":
    sys.exit(main())

"""The `rlp` command: run or validate a job from its YAML.

The config is parsed and validated before torch, Ray or DeepSpeed are imported, so a bad
config fails in a second with one line naming the file and key, and exit code 2.
"""

from __future__ import annotations

import argparse
import sys
from typing import List, Optional

from rlplatform.config import ConfigError, JobConfig, load_config


def _load(args) -> JobConfig:
    config = load_config(args.config, args.overrides)
    from rlplatform.rewards import UnknownReward, resolve

    try:
        resolve(config.rewards)
    except UnknownReward as err:
        raise ConfigError(f"{args.config}: {err}") from None
    return config


def _run(args) -> int:
    config = _load(args)
    from rlplatform.controller import run_job

    summary = run_job(config)
    print(_result_line(summary))
    return 0


def _validate(args) -> int:
    config = _load(args)
    print(f"{args.config}: ok (job '{config.name}', output {config.run_dir})")
    return 0


def _result_line(summary: dict) -> str:
    evals = summary.get("eval", {})
    parts = [f"{summary['name']}: {summary['status']} in {summary['wall_s']:.0f}s"]
    for label in ("after_sft", "after_rl"):
        if label in evals:
            parts.append(f"accuracy {label.replace('_', ' ')} {evals[label]['accuracy']:.3f}")
    if "rl" in summary:
        parts.append(f"{summary['rl']['samples_per_s']:.0f} samples/s")
    parts.append(f"results in {summary['run_dir']}")
    return ", ".join(parts)


def _status(args) -> int:
    import time

    from rlplatform.job_status import JobStatus, format_status
    from rlplatform.redis_server import connect

    fields = JobStatus(connect(args.redis), args.job).read()
    if not fields:
        print(f"rlp: no status for job '{args.job}' on this Redis (not started, or expired)", file=sys.stderr)
        return 1
    print(f"{args.job}: {format_status(fields, time.time())}")
    return 0


def _dashboard(args) -> int:
    from rlplatform.dashboard import build_workspace, render_layout

    policies = args.policy or ["policy"]
    if args.dry_run:
        print("\n".join(render_layout(p) for p in policies))
        return 0
    workspace = build_workspace(args.entity, args.project, policies, args.name)
    workspace.save()
    print(f"created workspace '{args.name}': {workspace.url}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rlp", description="Asynchronous RL post-training for language models.")
    commands = parser.add_subparsers(dest="command", required=True)
    for name, handler, text in (("run", _run, "run a job"), ("validate", _validate, "check a job config")):
        sub = commands.add_parser(name, help=text)
        sub.add_argument("config", help="job YAML, e.g. configs/quickstart.yaml")
        sub.add_argument("overrides", nargs="*", help="key=value overrides, e.g. rl.max_steps=5")
        sub.set_defaults(handler=handler)
    status = commands.add_parser("status", help="progress of a job running anywhere, read from its Redis")
    status.add_argument("--redis", required=True, help="the job's Redis URL (runs/<name>/redis.url for embedded)")
    status.add_argument("--job", required=True, help="the job's name")
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
    try:
        return args.handler(args)
    except ConfigError as err:
        print(f"rlp: config error: {err}", file=sys.stderr)
        return 2
    except ConnectionError as err:  # Redis or Ray unreachable: say where, without a traceback
        print(f"rlp: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("rlp: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())

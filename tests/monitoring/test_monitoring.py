"""Monitoring: an alert fires on a forced reward collapse; the progress line and trailing rates; `rlp status`
reads a job's progress from Redis; the dashboard's layout. (That an offline W&B run holds every metric
family of the dashboard and the samples table is checked on the end-to-end test's job.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rlplatform.config import load_config
from rlplatform.job.rl_loop import RLCounters
from rlplatform.learners.step_result import StepResult
from rlplatform.monitoring.dashboard import build_workspace, render_layout
from rlplatform.monitoring.job_status import JobStatus, StatusLine
from rlplatform.monitoring.metrics import Metrics
from rlplatform.monitoring.rl_monitor import PROGRESS_EVERY_S, RLMonitor, TrailingRate
from rlplatform.scheduling.buffer import Batch
from rlplatform.transport.bridge_protocol import bridge_status_field
from rlplatform.transport.keys import NameKeys, PolicyKeys, run_scope
from rlplatform.transport.reward_queue import RewardQueue
from rlplatform.transport.samples import ResultMeta, Sample, ScoredSample

REPO = Path(__file__).resolve().parents[2]
QUICKSTART = str(REPO / "configs" / "quickstart.yaml")
LEARNER_STEP = StepResult(loss=0.1, compute_s=0.0, model_tokens_per_s=0.0, mfu=0.0, tokens_total=0.0,
                          figures={"grad_norm": 1.0, "lr": 3e-4})


def scored_group(group: str, reward: float, version: int) -> list:
    return [ResultMeta.of(ScoredSample(Sample(f"{group}/{i}", group, "policy", "1+1=", "2", prompt_ids=[4],
                                              completion_ids=[5, 2], behaviour_logprobs=[-0.1, -0.2],
                                              token_versions=[version, version], row={"answer": "2"}),
                                       reward, {"exact_match": reward}))
            for i in range(4)]


def test_alert_fires_once_on_a_forced_reward_collapse(redis_client, tmp_path, capsys):
    config = load_config(QUICKSTART, [f"output_dir={tmp_path}", "name=collapse", "wandb.mode=disabled",
                                                "monitoring.samples_every=0"])
    metrics = Metrics(config, str(tmp_path))
    monitor = RLMonitor(config, config.rl, metrics, RewardQueue(redis_client, "collapse"), "policy",
                        keys=PolicyKeys("collapse", "policy"), rollout_workers=1)
    counters = RLCounters()
    learner = LEARNER_STEP
    for version in range(1, 61):  # reward 1.0 for 30 steps, then it collapses to 0
        reward = 1.0 if version <= 30 else 0.0
        batch = Batch(groups=[scored_group(f"g{version}", reward, version - 1)])
        counters.samples_scored += 4
        monitor.step(version, learner, batch, [1] * 4, counters, publish_s=0.01)
    events = [json.loads(line) for line in open(tmp_path / "events.jsonl")]
    assert [e["kind"] for e in events] == ["reward_collapse"]
    assert monitor.reward_totals() == {"samples": 240, "mean": 0.5, "components": {"exact_match": 0.5}}
    # window 20, threshold 0.5 x best 1.0: the 20-step mean first drops below 0.5 at step 41
    assert events[0]["step"] == 41
    assert "WARNING [reward_collapse] rl step 41" in capsys.readouterr().out


def test_events_without_a_step_are_dated_by_the_latest_figures(tmp_path):
    config = load_config(QUICKSTART, [f"output_dir={tmp_path}", "name=dated", "wandb.mode=disabled"])
    metrics = Metrics(config, str(tmp_path))
    metrics.event("redis_restart", "before any figure")
    metrics.log("sft", 300, {"loss": 0.5})
    metrics.event("worker_restart", "during SFT")
    metrics.begin("rl")
    metrics.event("worker_restart", "before RL's first figures")
    metrics.log_rl("policy", {}, {"learner_step": 17, "samples_seen": 2176, "wall_time_s": 9.0})
    metrics.event("worker_restart", "during RL")
    events = [json.loads(line) for line in open(tmp_path / "events.jsonl")]
    assert [(e["stage"], e["step"]) for e in events] == [("start", 0), ("sft", 300), ("rl", 0), ("rl", 17)]


def test_trailing_rate_spans_intervals_in_which_nothing_finished():
    rate = TrailingRate(window_s=10.0, now=0.0, total=0.0)
    assert rate.update(20.0, 2000.0) == 100.0
    assert rate.update(25.0, 2000.0) == 80.0  # no group finished in (20, 25]: 2000 samples over 25 s, not 0
    assert rate.update(31.0, 2600.0) == pytest.approx(600 / 11)  # readings older than 10 s are forgotten


def test_progress_line_shows_throughput_between_steps_that_saw_no_new_samples(redis_client, tmp_path, capsys):
    config = load_config(QUICKSTART, [f"output_dir={tmp_path}", "name=rate", "wandb.mode=disabled",
                                      "rl.log_every=1"])
    queue, keys = RewardQueue(redis_client, "rate"), PolicyKeys("rate", "policy")
    now = [100.0]
    monitor = RLMonitor(config, config.rl, Metrics(config, str(tmp_path)), queue, "policy", keys=keys,
                        rollout_workers=1, clock=lambda: now[0])
    counters, learner = RLCounters(), LEARNER_STEP
    queue.add_counters(keys.rollout_stats, samples=64, tokens=128, busy_s=0.1)
    for version in (1, 2):  # both steps land before another group finishes, 2 s apart
        now[0] += 2.0
        monitor.step(version, learner, Batch(groups=[scored_group(f"g{version}", 1.0, 0)]), [0] * 4, counters,
                     publish_s=0.01)
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("stage rl")]
    rates = [float(line.split("samples/s ")[1].split()[0]) for line in lines]
    assert rates == [64 / 2.0, 64 / 4.0], lines  # the 64 samples over the 2 s, then the 4 s, since the stage began


def test_the_rl_stage_shows_a_line_at_its_start_and_by_time_while_no_step_ends(redis_client, tmp_path, capsys):
    config = load_config(QUICKSTART, [f"output_dir={tmp_path}", "name=rare", "wandb.mode=disabled",
                                      "rl.log_every=1000"])
    queue, keys = RewardQueue(redis_client, "rare"), PolicyKeys("rare", "policy")
    now = [100.0]
    monitor = RLMonitor(config, config.rl, Metrics(config, str(tmp_path)), queue, "policy", keys=keys,
                        rollout_workers=1, clock=lambda: now[0])
    monitor.started(0)
    queue.add_counters(keys.rollout_stats, samples=640, tokens=1280, busy_s=1.0)
    now[0] += PROGRESS_EVERY_S - 1
    monitor.idle(0)  # too soon for another line
    now[0] += 1
    monitor.idle(0)
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("stage rl")]
    assert len(lines) == 2 and all(f"step 0/{config.rl.max_steps}  eta_s -  reward -" in line for line in lines)
    # the workers' rate, with no step yet: 640 samples over the 30 s since the stage began
    assert float(lines[1].split("samples/s ")[1].split()[0]) == pytest.approx(640 / PROGRESS_EVERY_S, abs=1e-3)


def test_rlp_status_prints_a_jobs_progress_from_redis(redis_server, redis_client, tmp_path):
    redis_client.set(NameKeys("elsewhere").newest_run, "r1")  # as the job's lease names its run
    status = JobStatus(redis_client, run_scope("elsewhere", "r1"))
    status.write(StatusLine("sft", "500/1500", loss=0.62))
    status.show_silent_workers("reward worker 1")
    bridge = bridge_status_field("policy", 0)
    redis_client.hset(status.key, bridge, "http://127.0.0.1:8000/v1")  # as a rollout worker announces its bridge
    status.write(StatusLine("rl", "12/400", reward=0.5, samples_per_s=840.0))  # SFT's loss is gone
    assert status.read().line.loss is None and status.read().silent_workers == "reward worker 1"
    assert status.read().bridges == {("policy", 0): "http://127.0.0.1:8000/v1"}  # shown while the bridge serves
    status.show_silent_workers("")
    redis_client.hdel(status.key, bridge)
    rlp = str(Path(sys.executable).parent / "rlp")
    env = dict(os.environ, RAY_ADDRESS="")
    shown = subprocess.run([rlp, "status", "--redis", redis_server, "--job", "elsewhere"],
                           capture_output=True, text=True, timeout=60, env=env)
    assert shown.returncode == 0
    assert shown.stdout.startswith("elsewhere: stage rl  step 12/400  reward 0.500  samples/s 840  (updated")
    missing = subprocess.run([rlp, "status", "--redis", redis_server, "--job", "nope"],
                             capture_output=True, text=True, timeout=60, env=env)
    assert missing.returncode == 1 and "no status for job 'nope'" in missing.stderr
    # the URL, password included, kept off the command line: read from a file, or from $RLP_REDIS_URL
    url_file = tmp_path / "redis.url"
    url_file.write_text(redis_server + "\n")
    for args, environment in ((["--redis", f"@{url_file}"], env), ([], dict(env, RLP_REDIS_URL=redis_server))):
        shown = subprocess.run([rlp, "status", *args, "--job", "elsewhere"], capture_output=True, text=True,
                               timeout=60, env=environment)
        assert shown.returncode == 0 and shown.stdout.startswith("elsewhere: stage rl"), shown.stderr
    unset = subprocess.run([rlp, "status", "--job", "elsewhere"], capture_output=True, text=True, timeout=60,
                           env={k: v for k, v in env.items() if k != "RLP_REDIS_URL"})
    assert unset.returncode == 2 and "set RLP_REDIS_URL" in unset.stderr


def test_rlp_status_of_a_run_directory_reads_that_runs_redis_and_status(redis_server, redis_client, tmp_path):
    run_dir = tmp_path / "runs" / "mine"
    run_dir.mkdir(parents=True)
    (run_dir / "config.yaml").write_text("name: mine\n")
    (run_dir / "run_id").write_text("first\n")
    (run_dir / "redis.url").write_text(redis_server + "\n")
    JobStatus(redis_client, run_scope("mine", "first")).write(StatusLine("rl", "3/10"))
    JobStatus(redis_client, run_scope("mine", "later")).write(StatusLine("sft", "1/5"))
    redis_client.set(NameKeys("mine").newest_run, "later")  # a later run of the name: the directory's run is still shown
    rlp = str(Path(sys.executable).parent / "rlp")
    env = {k: v for k, v in os.environ.items() if k != "RLP_REDIS_URL"}
    shown = subprocess.run([rlp, "status", str(run_dir)], capture_output=True, text=True, timeout=60, env=env)
    assert shown.returncode == 0 and shown.stdout.startswith("mine: stage rl  step 3/10"), shown.stderr
    newest = subprocess.run([rlp, "status", "--redis", f"@{run_dir}/redis.url", "--job", "mine"],
                            capture_output=True, text=True, timeout=60, env=env)
    assert newest.stdout.startswith("mine: stage sft  step 1/5"), newest.stderr
    neither = subprocess.run([rlp, "status"], capture_output=True, text=True, timeout=60, env=env)
    assert neither.returncode == 2 and "rlp status runs/<name>" in neither.stderr


def test_dashboard_dry_run_renders_every_section():
    text = render_layout("policy")
    for section in ("Learning", "Rewards", "Asynchrony", "Evaluation", "Samples"):
        assert f"[policy: {section}]" in text

    workspace = build_workspace("team", "proj", ["small", "large"], "rl")
    assert [s.name for s in workspace.sections][:2] == ["small: Learning", "small: Rewards"]
    assert len(workspace.sections) == 10


def test_tool_figures_per_episode_and_per_tool():
    from rlplatform.monitoring.tool_metrics import tool_figures
    from rlplatform.transport.rollout_counters import RolloutCounters

    rollout = RolloutCounters(episodes=4, turns=10, tool_calls=6, observation_tokens=48, episodes_truncated=1,
                              malformed_calls=3, unknown_tool_calls=1, decode_steps_while_waiting=10,
                              sequences_while_waiting=40, idle_s_while_waiting=1.5, samples=4, tokens=90)
    tools = {"calls/calculator": 5, "errors/calculator": 1, "latency_s/calculator": 0.5, "calls/python": 1,
             "latency_s/python": 2.0}
    figures = tool_figures(rollout, tools, decode_slots=16)
    assert figures == {"episodes": 4, "turns_per_episode": 2.5, "tool_calls_per_episode": 1.5,
                       "observation_tokens_per_episode": 12.0, "truncated_fraction": 0.25, "episodes_truncated": 1,
                       "malformed_calls": 3, "unknown_tool_calls": 1, "token_checks": 0.0, "token_mismatches": 0.0,
                       "decode_steps_while_waiting": 10,
                       "decode_occupancy_while_waiting": 4.0, "decode_slots_used_while_waiting": 0.25,
                       "idle_s_while_waiting": 1.5,
                       "calculator/calls": 5, "calculator/error_fraction": 0.2, "calculator/latency_s": 0.1,
                       "python/calls": 1, "python/error_fraction": 0.0, "python/latency_s": 2.0}

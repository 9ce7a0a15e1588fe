"""A bridge-only job (`rollout.source: bridge`): its rollout workers generate nothing of their own. With
no agent calling, the stage ends by `rl.idle_timeout_s` with counts that balance; with an agent, it
trains on the agent's episodes alone, each group admitted through the prompt ledger, then ends when
the agent stops, its counts balancing; the episode the agent left mid-way is dropped by its worker's bridge
and named in an alert."""

from __future__ import annotations

import json
import os
import signal
import threading
import urllib.request

from rlplatform.job.controller import run_job
from rlplatform.scheduling.ledger import balanced
from rlplatform.transport.bridge_protocol import bridge_status_field
from rlplatform.transport.redis_server import connect
from rlplatform.transport.keys import JobKeys

BRIDGE_ONLY = ["rl.max_steps=100000", "rollout.source=bridge", "rl.idle_timeout_s=5",
               "rollout.openai_bridge.enabled=true", "rollout.openai_bridge.port=0"]


def run_watched(config) -> dict:
    watchdog = threading.Timer(150.0, os.kill, (os.getpid(), signal.SIGTERM))  # were it never idle
    watchdog.start()
    try:
        return run_job(config)
    finally:
        watchdog.cancel()


def test_a_bridge_only_job_generates_nothing_itself_and_ends_when_idle(ray_session, tiny_job):
    summary = run_watched(tiny_job("bridge-only", *BRIDGE_ONLY))
    rl = summary["rl"]
    assert summary["status"] == "completed" and rl["ended_by"] == "idle_timeout"
    assert rl["samples_generated"] == 0 and rl["steps"] == 0 and rl["ledger"]["issued"] == 0
    assert rl["wall_s"] < 60


def play(url: str, group: str, episode: str, finish: bool = True) -> None:
    """One single-turn episode of an agent, finished into `group` (or left open)."""
    def post(path: str, body: dict, headers: dict) -> None:
        request = urllib.request.Request(url + path, data=json.dumps(body).encode(), method="POST",
                                         headers={"Content-Type": "application/json", **headers})
        urllib.request.urlopen(request, timeout=60).read()
    post("/chat/completions", {"model": "policy", "messages": [{"role": "user", "content": "12+3="}]},
         {"X-Episode-Id": episode})
    if finish:
        post(f"/episodes/{episode}/finish", {"group": group, "row": {"answer": "15"}}, {})


def test_a_bridge_only_job_trains_on_an_agents_groups_through_the_ledger(ray_session, tiny_job, run_files):
    # the bridge's idle deadline: 2 x the longest the agent took to send an episode's next request, at least 2 s (the
    # watchdog off: no worker is restarted on so short a rule); the stage idles out 8 s after the last scored sample,
    # time for the drop (a sweep a second) and the job's alert (a check every 2 s); the left group may not expire
    # first (its deadline derived from the job's start-up would be as short as 6 s on a fast machine)
    config = tiny_job("bridge-agent", *BRIDGE_ONLY, "rl.batch_prompts=2", "rl.group_size=4", "monitoring.watchdog=false",
                      "monitoring.hang_factor=2", "monitoring.hang_floor_s=2", "rl.idle_timeout_s=8", "rl.group_timeout_s=60")
    groups = [f"task-{k}" for k in range(4)]

    def agent():
        client = connect(run_files.redis_url(config.run_dir))
        status = JobKeys(run_files.run(config)).status
        run_files.wait_for(lambda: client.hget(status, bridge_status_field("policy", 0)) is not None)
        url = client.hget(status, bridge_status_field("policy", 0)).decode()
        for group in groups:
            for i in range(config.rl.group_size):
                play(url, group, f"{group}-e{i}")
        play(url, "task-left", "task-left-e0")  # a fifth group begun, then the agent goes silent mid-episode
        play(url, "task-left", "task-left-e1", finish=False)
    thread = threading.Thread(target=agent, daemon=True)
    thread.start()
    summary = run_watched(config)
    thread.join(timeout=30)
    rl = summary["rl"]
    assert summary["status"] == "completed" and rl["ended_by"] == "idle_timeout" and rl["steps"] == 2
    assert rl["ledger"]["admitted"] == rl["ledger"]["issued"] == 5 and rl["ledger"]["trained"] == 4
    assert balanced(rl["ledger"]) and rl["samples_generated"] == 17 and rl["samples_trained"] == 16
    assert rl["samples_unused_at_end"] == 1  # the left group's finished episode
    trained = run_files.trained_ids(config.run_dir)
    assert sorted({sample_id.split("/")[0] for sample_id in trained}) == groups  # the agent's, and only those
    assert rl["agent_episodes_expired"] == 1
    events = [json.loads(line) for line in open(os.path.join(config.run_dir, "events.jsonl"))]
    [alert] = [event["message"] for event in events if event["kind"] == "agent_episodes_expired"]
    assert alert.startswith("1 agent episode(s) on rollout worker 0 of policy 'policy' made no request for ")
    assert "task-left-e1 from 127.0.0.1" in alert

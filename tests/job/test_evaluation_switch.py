"""`eval.enabled: false`: a job that evaluates nothing starts no evaluator actor, and its summary holds no
accuracy figures (and no evaluator restarts)."""

from __future__ import annotations

import pytest

from rlplatform.job.controller import run_job

pytestmark = pytest.mark.slow


def test_a_job_without_evaluation_starts_no_evaluator_and_reports_no_accuracy(ray_session, tiny_job):
    from ray._private.state import state as ray_state

    summary = run_job(tiny_job("no-eval", "rl.max_steps=2", "eval.enabled=false"))
    assert summary["status"] == "completed" and summary["rl"]["steps"] == 2
    assert summary["eval"] == {} and summary["rl"]["restarts"]["evaluator"] == 0
    names = {actor.get("Name") for actor in ray_state.actor_table(None).values()}
    assert "no-eval-policy-rollout-0" in names  # the rollout worker; the evaluator would be rollout-1
    assert "no-eval-policy-rollout-1" not in names

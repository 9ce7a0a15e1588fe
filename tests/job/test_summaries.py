"""Stage summaries: frozen `SFTSummary` and `RLSummary`, and a policy's `PolicyResults`, give summary.json and
state.json the dicts (keys, order and values) those files have always held, and a checkpoint's results read
back unchanged."""

from __future__ import annotations

import dataclasses
import json

import pytest

from rlplatform.job.controller import _job_state
from rlplatform.job.summaries import (JobSummary, PolicyResults, RLFigures, RLSummary, SFTSummary, StartupTimes,
                                      samples_unaccounted)

# one policy's results in a checkpoint's state.json, as the controller wrote them before the summaries were typed
OLD_STATE_RESULTS = """{"data": {"train_rows": 90, "test_rows": 10, "train_skipped_long_prompt": 0,
 "test_skipped_long_prompt": 0}, "stages": {"sft": {"steps": 30, "wall_s": 12.5, "final_loss": 0.25,
 "accuracy_checks": [{"step": 10, "accuracy": 0.5}], "first_step_at": 1700000010.5,
 "learner_model_tokens_per_s": 812.4, "learner_mfu": 0.00012}}, "eval": {"after_sft": {"pass_at_1": 0.5,
 "policy_version": 0}}}"""


def rl_figures(**changes) -> RLFigures:
    """A stage's figures: 64 samples trained of 64, 3 wrong answers, the rest 0."""
    counts = {f.name: 0 for f in dataclasses.fields(RLFigures) if f.default is dataclasses.MISSING}
    return RLFigures(**{**counts, "samples_generated": 64, "samples_trained": 64, "samples_unused_where": {},
                        "reward_reasons": {"exact_match/wrong": 3}, "staleness_histogram": {"0": 64}, **changes})


def rl_summary(**changes) -> RLSummary:
    fields = dict(steps=4, wall_s=9.5, figures=rl_figures(),
                  time_breakdown={"generation_s": 3.0}, eval_history=[{"version": 2, "accuracy": 0.5}],
                  parity={"checks": 0}, rewards={"exact_match": 0.5}, ledger={"issued": 8},
                  first_step_at=1700000020.0, ended_by="max_steps", tools=None,
                  restarts={"rollout": 0, "reward": 0, "evaluator": 0}, checkpoint="runs/x/checkpoints/step-000004",
                  results_held_at_end=0, controller_cpu_s=1.25, wandb_dir=None)
    return RLSummary(**{**fields, **changes})


def test_a_checkpoint_written_before_the_summaries_were_typed_reads_back_unchanged():
    old = json.loads(OLD_STATE_RESULTS)
    results = PolicyResults.from_state(old)
    assert results.sft.steps == 30 and results.sft.first_step_at == 1700000010.5 and results.rl is None
    assert json.dumps(results.state()) == json.dumps(old)  # keys, their order and values
    shown = json.loads(OLD_STATE_RESULTS)
    del shown["stages"]["sft"]["first_step_at"]  # summary.json turns it into startup_s
    assert json.dumps(results.to_json()) == json.dumps(shown)


def test_the_job_state_reads_evaluations_that_finish_after_the_stage_began():
    results = {"main": PolicyResults({"train_rows": 4})}
    results["main"].record_eval("after_sft", {"pass_at_1": 0.25, "policy_version": 0})  # the background evaluation
    assert _job_state(results, "abc") == {"results": {"main": {"data": {"train_rows": 4}, "stages": {},
                                                                "eval": {"after_sft": {"pass_at_1": 0.25,
                                                                                       "policy_version": 0}}}},
                                          "wandb_run_id": "abc"}


def test_the_rl_summary_shows_its_figures_in_the_order_summary_json_holds_them():
    shown = rl_summary().to_json()
    counts = [f.name for f in dataclasses.fields(RLFigures)][:-3]  # the elastic three only where workers come and go
    assert list(shown) == ["steps", "wall_s", *counts, "time_breakdown", "eval_history", "parity", "rewards",
                           "ledger", "ended_by", "restarts", "checkpoint", "results_held_at_end", "controller_cpu_s",
                           "wandb_dir"]
    assert shown["eval_history"] == [{"version": 2, "accuracy": 0.5}] and shown["controller_cpu_s"] == 1.25
    assert shown["reward_reasons"] == {"exact_match/wrong": 3} and json.loads(json.dumps(shown)) == shown
    with_tools = rl_summary(tools={"calculator/calls": 3.0}).to_json()
    assert list(with_tools)[len(counts) + 7:len(counts) + 9] == ["ended_by", "tools"]
    assert with_tools["tools"] == {"calculator/calls": 3.0}
    elastic = rl_summary(figures=rl_figures(rollout_workers_joined=2, rollout_workers_left=1,
                                            rollout_groups_reissued=3)).to_json()
    assert list(elastic)[2 + len(counts):5 + len(counts)] == ["rollout_workers_joined", "rollout_workers_left",
                                                              "rollout_groups_reissued"]


def test_every_generated_sample_is_accounted_for_by_one_outcome():
    """64 generated: 40 trained, 8 dropped stale, 8 of an expired group, 4 abandoned at a resume, 4 unused."""
    figures = vars(rl_figures(samples_trained=40, samples_dropped_stale=8, samples_dropped_expired=8,
                              samples_abandoned_at_resume=4, samples_unused_at_end=4))
    assert samples_unaccounted(figures) == 0
    assert samples_unaccounted({**figures, "samples_generated": 65}) == 1  # a sample no outcome counts


def test_summaries_are_not_changed_once_returned():
    history = [{"version": 2, "accuracy": 0.5}]
    summary = rl_summary(eval_history=history)
    history.append({"version": 4, "accuracy": 0.75})  # the monitor's own list goes on
    assert len(summary.eval_history) == 1
    with pytest.raises(dataclasses.FrozenInstanceError):
        summary.steps = 5
    with pytest.raises(dataclasses.FrozenInstanceError):
        summary.figures.samples_trained = 0
    with pytest.raises(TypeError):
        summary.figures.reward_reasons["exact_match/wrong"] = 0
    with pytest.raises(dataclasses.FrozenInstanceError):
        SFTSummary.from_state(json.loads(OLD_STATE_RESULTS)["stages"]["sft"]).final_loss = 0.0


def test_both_stages_appear_under_stages_and_their_first_steps_give_the_startup_times():
    results = PolicyResults.from_state(json.loads(OLD_STATE_RESULTS))
    results.rl = rl_summary()
    shown = results.to_json()
    assert list(shown) == ["data", "stages", "eval", "rl"]
    assert shown["stages"]["rl"] == {"steps": 4, "wall_s": 9.5} and shown["rl"] == results.rl.to_json()
    before = results.to_json()
    startup = StartupTimes(started_at=1700000000.0)
    startup.mark("learners_ready_s", at=1700000004.25)
    startup.mark_first_steps({"main": results})
    assert startup.seconds == {"learners_ready_s": 4.25, "to_first_sft_step_s": 10.5, "to_first_rl_step_s": 20.0}
    assert results.to_json() == before and results.sft.first_step_at == 1700000010.5  # read, not moved out


def test_the_job_summary_shows_a_one_policy_job_at_the_top_level_and_every_policy_of_several():
    startup = StartupTimes(started_at=1700000000.0)
    startup.mark_first_steps({})
    running = JobSummary("job", "/runs/job", "r1", startup, several_policies=False)
    assert running.to_json() == {"status": "running", "name": "job", "run_dir": "/runs/job",
                                 "startup_s": {"to_first_sft_step_s": None, "to_first_rl_step_s": None},
                                 "run_id": "r1", "wandb_dir": None}  # a job that failed before its stages ended
    one = PolicyResults.from_state(json.loads(OLD_STATE_RESULTS))
    done = JobSummary("job", "/runs/job", "r1", startup, several_policies=False, status="completed",
                      results={"main": one}, wall_s=30.0)
    assert done.to_json() == {**running.to_json(), "status": "completed", **one.to_json(), "wall_s": 30.0}
    two = PolicyResults({"train_rows": 4})
    both = JobSummary("job", "/runs/job", "r1", startup, several_policies=True, status="interrupted",
                      results={"a": one, "b": two}, wall_s=30.0, exit_code=130, error="stopped by SIGINT")
    shown = both.to_json()
    assert shown["policies"] == {"a": one.to_json(), "b": two.to_json()} and shown["stages"] == one.to_json()["stages"]
    assert (shown["exit_code"], shown["error"]) == (130, "stopped by SIGINT")

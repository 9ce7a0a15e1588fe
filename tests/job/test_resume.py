"""Checkpoints and resume: a job stopped by SIGTERM after a few steps writes a checkpoint and an
`interrupted` summary; resumed, it reaches the same final step, re-issues the prompts that were
in flight, trains no sample twice, and its prompt ledger and sample counts balance over both attempts. Periodic checkpoints land at the
multiples of `checkpoint.every_steps`, also after a resume from a step between them. A newest checkpoint
found truncated is set aside, named in one line, and the job resumes from the one before it."""

from __future__ import annotations

import json
import os
import signal
import threading
from pathlib import Path

from rlplatform.job.checkpoint import latest_checkpoint, learner_dir, read_state
from rlplatform.job.controller import run_job
from rlplatform.job.summaries import samples_unaccounted
from rlplatform.scheduling.ledger import balanced


STEPS = 30  # a tiny job's steps take milliseconds: room for the stop after step 5 to land before the last


def test_stopped_job_resumes_to_the_same_final_step_training_nothing_twice(ray_session, tiny_job, run_files, capsys):
    """Its newest checkpoint is truncated before the resume: the job goes on from the one before."""
    config = tiny_job("resumed", f"rl.max_steps={STEPS}", "checkpoint.every_steps=2", "checkpoint.keep_last=2",
                      "resume=auto")

    def stop_after_five_steps():  # periodic checkpoints at 2 and 4 before it
        run_files.wait_for(lambda: run_files.trained_steps(config.run_dir) >= 5, poll_s=0.01)
        os.kill(os.getpid(), signal.SIGTERM)
    thread = threading.Thread(target=stop_after_five_steps, daemon=True)
    thread.start()
    first = run_job(config)
    thread.join()
    assert first["status"] == "interrupted" and first["exit_code"] == 143
    stopped_at = first["rl"]["steps"]
    assert 5 <= stopped_at < STEPS
    checkpoint = latest_checkpoint(config.run_dir)
    assert checkpoint.endswith(f"step-{stopped_at:06d}") and first["rl"]["checkpoint"] == checkpoint
    kept = sorted(os.listdir(os.path.dirname(checkpoint)))
    assert len(kept) == 2 and not any(name.startswith(".tmp") for name in kept)  # keep_last, nothing half-written
    state = read_state(checkpoint).policies["policy"]
    assert state.version == stopped_at and state.counters["samples_trained"] == stopped_at * 2 * 4
    older = os.path.join(os.path.dirname(checkpoint), kept[0])
    in_flight = len(read_state(older).policies["policy"].ledger["in_flight_prompts"])
    (weights,) = Path(learner_dir(checkpoint, "policy")).glob("global_step*/mp_rank_00_model_states.pt")
    os.truncate(weights, weights.stat().st_size // 2)  # the newest checkpoint damaged on disk

    capsys.readouterr()
    second = run_job(config)
    printed = capsys.readouterr().out
    corrupt = os.path.join(os.path.dirname(checkpoint), f"corrupt-step-{stopped_at:06d}")
    assert printed.count(f"checkpoint {checkpoint} is corrupt ({os.path.relpath(weights, checkpoint)} has ") == 1
    assert f"set aside as {corrupt}\n" in printed and os.path.isfile(os.path.join(corrupt, "state.json"))
    assert printed.count(f"checkpoint {second['rl']['checkpoint']}\n") == 1  # the periodic one at the last step, once
    assert second["status"] == "completed" and second["rl"]["steps"] == STEPS
    ids = run_files.trained_ids(config.run_dir)
    assert len(ids) == len(set(ids)) == STEPS * 2 * 4
    ledger = second["rl"]["ledger"]
    assert ledger["trained"] == STEPS * 2 and balanced(ledger)
    assert ledger["reissued"] >= in_flight  # what was in flight at the checkpoint was issued again
    assert second["rl"]["samples_trained"] == STEPS * 2 * 4
    assert second["rl"]["rewards"]["samples"] == STEPS * 2 * 4  # the reward totals count both attempts' samples too
    # counts run over both attempts and balance; the samples in flight at the checkpoint were abandoned
    for rl in (first["rl"], second["rl"]):
        assert samples_unaccounted(rl) == 0, rl
    assert second["rl"]["trained_per_s"] <= second["rl"]["samples_per_s"]  # rates of the second attempt alone
    with open(os.path.join(config.run_dir, "summary.json")) as f:
        assert json.load(f)["status"] == "completed"
    # after the resume the periodic checkpoints fell on multiples of 2 again (keep_last holds the newest two)
    kept = [int(name.split("-")[1]) for name in sorted(os.listdir(os.path.dirname(checkpoint)))
            if name.startswith("step-")]
    assert kept[-1] == STEPS and all(step % 2 == 0 for step in kept if step > stopped_at), kept

"""A learner step's result: the ranks' metrics merged into a frozen `StepResult`; a stage's `LearnerTotals`
and the summary figures they give; the RL counters keep the totals in a checkpoint under the keys
checkpoints have always held them."""

from __future__ import annotations

import dataclasses

import pytest

from rlplatform.job.rl_loop import RLCounters
from rlplatform.learners.group import merge_rank_metrics
from rlplatform.learners.step_result import LearnerTotals, StepResult


def rank_metrics(loss: float, seconds: float, tokens: float, mfu: float, clip_max: float) -> dict:
    return {"loss": loss, "compute_s": seconds, "model_tokens_per_s": 100.0 / seconds, "mfu": mfu,
            "tokens": tokens, "grad_norm": 2 * loss, "importance_weight_max": clip_max}


def test_merged_ranks_give_a_frozen_result():
    result = merge_rank_metrics([rank_metrics(1.0, 2.0, 30.0, 0.1, 1.5), rank_metrics(3.0, 4.0, 10.0, 0.3, 1.2)])
    assert (result.loss, result.compute_s, result.mfu) == (2.0, 3.0, pytest.approx(0.2))  # the ranks' means
    assert result.model_tokens_per_s == 50.0 + 25.0  # rates add up: 100 tokens in 2 s and in 4 s
    assert result.tokens_total == 40.0  # every rank's trained tokens
    assert result.figures == {"tokens": 20.0, "grad_norm": 4.0, "importance_weight_max": 1.5}  # maxima stay maxima
    assert result.metrics() == {"loss": 2.0, "compute_s": 3.0, "model_tokens_per_s": 75.0, "mfu": result.mfu,
                                "tokens_total": 40.0, **result.figures}
    with pytest.raises(dataclasses.FrozenInstanceError):
        result.loss = 0.0
    with pytest.raises(TypeError):
        result.figures["grad_norm"] = 0.0


def test_totals_weight_each_step_by_its_compute_seconds():
    totals = LearnerTotals()
    totals.add(StepResult(loss=1.0, compute_s=1.0, model_tokens_per_s=300.0, mfu=0.1, tokens_total=0.0, figures={}))
    totals.add(StepResult(loss=1.0, compute_s=3.0, model_tokens_per_s=100.0, mfu=0.5, tokens_total=0.0, figures={}))
    # 300 + 300 tokens over 4 s; MFU (0.1 x 1 s + 0.5 x 3 s) / 4 s
    assert totals == LearnerTotals(compute_s=4.0, model_tokens=600.0, mfu_s=1.6)
    assert totals.figures() == {"learner_model_tokens_per_s": 150.0, "learner_mfu": 0.4}
    assert LearnerTotals().figures() == {"learner_model_tokens_per_s": 0.0, "learner_mfu": 0.0}


def test_rl_counters_keep_the_totals_under_the_checkpoint_keys():
    state = {**RLCounters().state(), "learner_compute_s": 4.0, "learner_model_tokens": 600.0, "learner_mfu_s": 1.6}
    restored = RLCounters.from_state(state)
    assert restored.learner == LearnerTotals(compute_s=4.0, model_tokens=600.0, mfu_s=1.6)
    assert restored.state() == state
    older = {k: v for k, v in state.items() if not k.startswith("learner_") or k == "learner_busy_s"}
    assert RLCounters.from_state(older).learner == LearnerTotals()  # a checkpoint written before the totals


def test_a_result_built_directly_holds_a_read_only_copy_of_its_figures():
    figures = {"grad_norm": 1.0}
    result = StepResult(loss=0.1, compute_s=0.0, model_tokens_per_s=0.0, mfu=0.0, tokens_total=0.0, figures=figures)
    figures["grad_norm"] = 2.0
    assert result.figures == {"grad_norm": 1.0}
    with pytest.raises(TypeError):
        result.figures["lr"] = 0.0

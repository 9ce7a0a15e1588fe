"""Engine-learner parity: on tokens the rollout engine sampled with the weights the learner scores them with,
the learner reports mean and max |Δ log-prob| and the k3 KL, apart from staleness (and from samples a weight
swap in flight split, whose later tokens read a KV cache the older weights wrote). An engine one of whose
layers did not load the published weights raises the `parity` alert at its first step; an engine holding
exactly the learner's weights stays far under the limit (measured on the tiny policy in float32: 1e-7 against
0.22, the limit 0.05)."""

from __future__ import annotations

import pytest
import torch

from rlplatform.actors.engine import TransformersEngine
from rlplatform.config import LearnerConfig, RLConfig, _default_alerts
from rlplatform.learners.group import LearnerGroup
from rlplatform.monitoring.alerts import AlertRules, StepFigures
from rlplatform.transport.samples import Sample
from tests.learners.steps import rl_step
from rlplatform.transport.weight_transports import ObjectStoreTransport


def sampled(engine: TransformersEngine, version: int):
    """Two groups of four completions sampled by `engine`, every token marked with `version`."""
    groups = engine.generate(engine.tokenizer(["1+2=", "40+45="])["input_ids"], 4, 6, 1.0)
    samples = [Sample(f"{g}/{i}", str(g), "policy", "", c.text, prompt_ids=c.prompt_ids,
                      completion_ids=c.completion_ids, behaviour_logprobs=c.logprobs,
                      token_versions=[version] * len(c.completion_ids))
               for g, group in enumerate(groups) for i, c in enumerate(group)]
    return samples, [1.0 if s.group_id == "0" else -1.0 for s in samples]


def first_step_alerts(parity: dict) -> list:
    return AlertRules(_default_alerts()).check(StepFigures(0, 0.5, 0.0, 0, 0.0, parity=parity))


def test_a_layer_the_engine_did_not_load_raises_the_parity_alert(ray_session, tiny_policy):
    learner = LearnerGroup(LearnerConfig(zero_stage=1), tiny_policy, seed=0,
                           dtype="float32", transport=ObjectStoreTransport())
    try:
        learner.start_stage(lr=1e-6)
        engine = TransformersEngine(tiny_policy)
        samples, advantages = sampled(engine, version=0)
        fresh = rl_step(learner, samples, advantages, RLConfig(), step=0).figures
        stale = rl_step(learner, samples, advantages, RLConfig(), step=1).figures  # every token a version behind
        for sample in samples:  # a swap in flight: the last token by version 1, on a cache version 0 wrote (a
            # one-token completion cannot be split: it stays version 0's, stale at step 1, not a current sample)
            if len(sample.token_versions) > 1:
                sample.token_versions = [0] * (len(sample.token_versions) - 1) + [1]
        swapped = rl_step(learner, samples, advantages, RLConfig(), step=1).figures
        with torch.no_grad():  # a tensor of the first layer left as other values: a sync that skipped it
            torch.manual_seed(0)
            engine.model.model.layers[0].mlp.down_proj.weight.normal_(0.0, 1.0)
        broken = rl_step(learner, *sampled(engine, version=2), RLConfig(), step=2).figures
    finally:
        learner.shutdown()
    print({k: v for k, v in fresh.items() if k.startswith("parity")},
          {k: v for k, v in broken.items() if k.startswith("parity")})
    assert fresh["parity_tokens"] == sum(len(s.completion_ids) for s in samples)
    assert fresh["parity_abs_mean"] < 1e-4 and fresh["parity_abs_max"] < 1e-3 and abs(fresh["parity_k3"]) < 1e-6
    assert "parity_abs_mean" not in stale  # staleness is not parity: nothing measured
    assert "parity_abs_mean" not in swapped  # nor are samples a weight swap split
    assert broken["parity_abs_mean"] > 0.2 and broken["parity_k3"] > 0
    fresh_parity = {k[len("parity_"):]: v for k, v in fresh.items() if k.startswith("parity_")}
    broken_parity = {k[len("parity_"):]: v for k, v in broken.items() if k.startswith("parity_")}
    assert not first_step_alerts(fresh_parity)
    alerts = first_step_alerts(broken_parity)
    assert [a.kind for a in alerts] == ["parity"] and "did not load every tensor" in alerts[0].message


def test_parity_figures_by_hand():
    from rlplatform.learners.algorithms import parity_figures, parity_sums

    learner = torch.tensor([[-1.0, -2.0, -3.0]])
    engine = torch.tensor([[-1.5, -2.0, -9.0]])
    sums = parity_sums(learner, engine, torch.tensor([[1.0, 1.0, 0.0]]))  # the third token not the same weights
    figures = parity_figures({k: float(v) for k, v in sums.items()})
    d = 0.5  # learner - engine on the first token
    assert figures["parity_tokens"] == 2 and figures["parity_abs_mean"] == pytest.approx(0.25)
    assert figures["parity_abs_max"] == pytest.approx(0.5)
    assert figures["parity_k3"] == pytest.approx((torch.expm1(torch.tensor(d)).item() - d) / 2)

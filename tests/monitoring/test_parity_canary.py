"""The parity canary: the learner scores fixed prompts with every `monitoring.parity_every`-th version it
streams, and a rollout engine checks each of those versions it loads. An engine that left one layer at older
weights raises the `parity` alert at its first check after the bad sync; checks of exact syncs stay far
under the limit (measured on the tiny policy in float32: under 1e-6 against 0.19, the limit 0.05)."""

from __future__ import annotations

import json
import os
import time

import ray

from rlplatform.actors.engine import TransformersEngine
from rlplatform.config import LearnerConfig, load_config
from rlplatform.learners.group import LearnerGroup
from rlplatform.learners.step_result import StepResult
from rlplatform.monitoring.metrics import Metrics
from rlplatform.monitoring.parity_canary import CANARY_PROMPTS, CanaryCheck
from rlplatform.monitoring.rl_monitor import RLMonitor
from rlplatform.job.rl_loop import RLCounters
from rlplatform.scheduling.buffer import Batch
from rlplatform.transport.redis_server import RECONNECT_S
from rlplatform.transport.keys import PolicyKeys
from rlplatform.transport.reward_queue import RewardQueue
from rlplatform.transport.samples import ResultMeta, Sample, ScoredSample
from rlplatform.transport.weight_transports import ObjectStoreTransport
from rlplatform.transport.weights import from_snapshot

QUICKSTART = os.path.join(os.path.dirname(__file__), "..", "..", "configs", "quickstart.yaml")
PROMPTS = ["1+2=", "40+45=", "7+7=", "12+30=", "99+1="]
LAYER = "model.layers.0."  # the layer the broken syncs leave behind
ROWS = [{"prompt": "1+1=", "answer": "2"}, {"prompt": "2+3=", "answer": "5"}]
LEARNER_STEP = StepResult(loss=0.1, compute_s=0.0, model_tokens_per_s=0.0, mfu=0.0, tokens_total=0.0, figures={})


def one_group(version: int) -> Batch:
    sample = Sample(f"g{version}/0", f"g{version}", "policy", "1+1=", "2", prompt_ids=[4], completion_ids=[5, 2],
                    behaviour_logprobs=[-0.1, -0.2],
                    token_versions=[version, version], row={"answer": "2"})
    return Batch(groups=[[ResultMeta.of(ScoredSample(sample, 1.0, {"exact_match": 1.0}))]])


def test_an_engine_that_left_a_layer_behind_raises_the_parity_alert_at_its_next_canary_check(
        ray_session, redis_server, redis_client, tiny_policy, tmp_path):
    job = f"canary-{time.time_ns()}"
    keys = PolicyKeys(job, "policy")
    config = load_config(QUICKSTART, [f"output_dir={tmp_path}", f"name={job}", "wandb.mode=disabled",
                                      "monitoring.samples_every=0"])
    monitor = RLMonitor(config, config.rl, Metrics(config, str(tmp_path)), RewardQueue(redis_client, job), "policy",
                        keys=keys, rollout_workers=1)
    engine = TransformersEngine(tiny_policy)
    check = CanaryCheck(redis_client, keys.canary_reference, keys.canary_checks, every=2, worker=0)
    learner = LearnerGroup(LearnerConfig(zero_stage=1), tiny_policy, seed=0,
                           dtype="float32", transport=ObjectStoreTransport())
    figures, prompt_ids = {}, engine.tokenizer(PROMPTS)["input_ids"]
    try:
        learner.connect_results(redis_server, job, RECONNECT_S)
        learner.watch_parity(prompt_ids, keys.canary_reference, every=2)
        learner.start_stage(lr=5e-2)  # steps that move the weights far, so a layer left behind shows
        for version in range(5):
            if version:
                learner.sft_step(ROWS)
            weights = from_snapshot(ray.get(learner.stream_weights(version)))
            # the learner scores only the versions engines check: version 3 leaves version 2's reference
            assert json.loads(redis_client.get(keys.canary_reference))["version"] == version - version % 2
            if version >= 3:  # from version 3 on, the sync leaves the first layer at the engine's older values
                held = engine.model.state_dict()
                weights.update({name: held[name].clone() for name in weights if name.startswith(LAYER)})
            engine.load_weights(weights, version)
            if check.due(version):
                figures[version] = check.run(version, engine.score)
            if version:
                monitor.step(version, LEARNER_STEP, one_group(version), [0], RLCounters(), publish_s=0.01)
    finally:
        learner.shutdown()
    assert sorted(figures) == [0, 2, 4]  # every second version loaded
    scored = sum(len(ids) - 1 for ids in prompt_ids[:CANARY_PROMPTS])  # each prompt's tokens after its first
    assert all(figures[v]["abs_mean"] < 1e-6 and figures[v]["tokens"] == scored for v in (0, 2))
    assert figures[4]["abs_mean"] > 0.1
    events = [json.loads(line) for line in open(tmp_path / "events.jsonl")]
    assert [(e["kind"], e["step"]) for e in events] == [("parity", 4)]
    assert "parity canary at version 4" in events[0]["message"]
    totals = monitor.parity_totals()["canary"]
    assert totals["checks"] == 3 and totals["abs_mean_max"] == figures[4]["abs_mean"]

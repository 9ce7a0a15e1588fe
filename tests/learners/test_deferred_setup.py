"""A learner group started before its policy is written (`set_up=False`, as the job starts its
ranks to overlap their imports with writing the policy) loads the policy only in `set_up`, and
then trains it."""

from __future__ import annotations

import shutil

from rlplatform.config import LearnerConfig
from rlplatform.learners.group import LearnerGroup
from rlplatform.transport.weight_transports import ObjectStoreTransport

ROWS = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a, b in [(1, 2), (13, 7), (40, 45), (9, 9)] * 2]


def test_ranks_started_before_the_policy_exists_load_it_at_set_up(ray_session, tiny_policy, tmp_path):
    model_path = str(tmp_path / "initial_policy")
    group = LearnerGroup(LearnerConfig(zero_stage=1), model_path, seed=0, set_up=False,
                         dtype="float32", transport=ObjectStoreTransport())
    try:
        ray_session.get(group.ranks[0].address.remote())  # the rank's constructor has run, with no policy on disk
        shutil.copytree(tiny_policy, model_path)
        group.set_up()
        group.start_stage(lr=1e-2)
        first, second = group.sft_step(ROWS), group.sft_step(ROWS)
        assert second.loss < first.loss
    finally:
        group.shutdown()

"""Delta weight sync (`weights.delta`): after a full version each update carries only the changed
elements, and an engine that applies them, or folds several it took at once, or starts late from the
store's full version and replays the deltas since, holds the learner's weights bit for bit. End to
end with a DeepSpeed learner in bfloat16 through the object store and through the broadcast group."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest
import ray
import torch

from rlplatform.config import ConfigError, LearnerConfig, WeightsConfig, load_config
from rlplatform.learners.group import LearnerGroup
from rlplatform.preflight import check_weights
from rlplatform.transport.keys import PolicyKeys
from rlplatform.transport.weight_deltas import DELTA_OF, IDX, MASK, DeltaEncoder, combine, delta_of, load_delta, \
    update_bytes
from rlplatform.transport.weight_store import WeightStoreActor
from rlplatform.transport.weight_transports import BroadcastTransport, ObjectStoreTransport, weight_transport
from rlplatform.transport.weights import from_snapshot

QUICKSTART = os.path.join(os.path.dirname(__file__), "..", "..", "configs", "quickstart.yaml")
FULL_EVERY = 4
ROWS = [{"prompt": "1+1=", "answer": "2"}, {"prompt": "2+3=", "answer": "5"}]


def _weights(seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    embed = torch.randn(50, 8, generator=generator).to(torch.bfloat16)
    return {"embed": embed, "layer": torch.randn(8, 8, generator=generator).to(torch.bfloat16),
            "mlp": torch.randn(8, 8, generator=generator).to(torch.bfloat16),
            "norm": torch.ones(8, dtype=torch.bfloat16), "head": embed}  # the head tied to the embedding


def _step(weights, version: int) -> None:
    """Change a few elements of the embedding (so of the tied head), a third of `mlp`'s (overlapping the
    last version's) and every element of `layer`."""
    weights["embed"].view(-1)[version * 7 % 400: version * 7 % 400 + 3] += 1
    weights["mlp"].view(-1)[version % 2::3] += 1
    weights["layer"].add_(1)


def test_engines_applying_deltas_one_by_one_folded_or_late_hold_the_senders_bits():
    sender, encoder = _weights(), DeltaEncoder(FULL_EVERY)
    one_by_one, at_zero, folded, late = None, None, None, None
    for version in range(7):
        if version:
            _step(sender, version)
        update = encoder.encode(sender, version)
        assert "head" not in update  # a tied weight travels once, as its embedding
        if version % FULL_EVERY == 0:
            assert delta_of(update) is None and update_bytes(update) == 2 * (400 + 64 + 64 + 8)
            one_by_one = {name: t.clone() for name, t in update.items()}
            at_zero = at_zero or {name: t.clone() for name, t in update.items()}
        else:
            assert delta_of(update) == version - 1
            assert update["embed" + IDX].tolist() == list(range(version * 7 % 400, version * 7 % 400 + 3))
            assert "layer" in update  # every element changed: whole is fewer bytes than positions and values
            assert "mlp" + MASK in update and "mlp" + IDX not in update  # a third changed: one bit per element
            assert not any(key.startswith("norm") for key in update)
            mlp_changed = len(range(version % 2, 64, 3))
            assert update_bytes(update) == 8 + 3 * (4 + 2) + (8 + 2 * mlp_changed) + 64 * 2
            load_delta(one_by_one, update, version - 1)
        if 1 <= version <= 3:  # taken at once by an engine holding version 0
            folded = combine(folded, update)
        if version == 3:
            load_delta(at_zero, folded, 0)
            assert _same_bits(at_zero, sender)
        late = combine(late, update) if version >= FULL_EVERY else None  # an engine joining at the full version 4
    assert delta_of(late) is None  # the full version 4 and deltas 5-6: one full update
    assert _same_bits(one_by_one, sender) and _same_bits(late, sender)
    assert not _same_bits(at_zero, sender)


def _same_bits(held, sender) -> bool:
    return held.keys() == sender.keys() - {"head"} and all(
        torch.equal(held[name].view(torch.int16), sender[name].view(torch.int16)) for name in held)


def test_folded_deltas_keep_the_newest_value_of_an_element_changed_twice():
    base = {"w": torch.zeros(6)}
    first = {DELTA_OF: torch.tensor([3]), "w@idx": torch.tensor([1, 4], dtype=torch.int32),
             "w@val": torch.tensor([1.0, 4.0])}
    second = {DELTA_OF: torch.tensor([4]), "w@idx": torch.tensor([0, 4], dtype=torch.int32),
              "w@val": torch.tensor([7.0, 9.0])}
    folded = combine(first, second)
    assert delta_of(folded) == 3 and sorted(folded["w@idx"].tolist()) == [0, 1, 4]  # each position once
    load_delta(base, folded, 3)
    assert base["w"].tolist() == [7.0, 1.0, 0.0, 0.0, 9.0, 0.0]


def test_a_delta_from_a_version_the_engine_does_not_hold_is_refused():
    held = {"w": torch.zeros(3)}
    with pytest.raises(RuntimeError, match="from version 4 reached an engine holding version 2"):
        load_delta(held, {DELTA_OF: torch.tensor([4]), "w@idx": torch.tensor([0]), "w@val": torch.tensor([1.0])}, 2)
    assert held["w"].tolist() == [0.0, 0.0, 0.0]


def test_delta_sync_is_a_setting_of_the_transports_that_move_bytes():
    assert weight_transport(WeightsConfig(transport="object_store", delta=True, delta_full_every=9)) == \
        ObjectStoreTransport(delta_full_every=9)
    assert weight_transport(WeightsConfig(transport="object_store", delta=False)).delta_full_every == 0
    check_weights(load_config(QUICKSTART, ["weights.delta=true"]), "job.yaml")
    for override, why in (("weights.transport=cuda_ipc", "weights.transport cuda_ipc moves no bytes"),
                          ("model.lora.enabled=true", "LoRA streams the adapters alone")):
        with pytest.raises(ConfigError, match=f"job.yaml: 'weights.delta' is true, but {why}"):
            check_weights(load_config(QUICKSTART, ["weights.delta=true", override]), "job.yaml")


@ray.remote(num_cpus=0)
class Engine:
    """A transformers engine behind a transport's receiving end, as a rollout worker holds one."""

    def __init__(self, policy: str, transport, store) -> None:
        from rlplatform.actors.engine import TransformersEngine

        self.engine = TransformersEngine(policy, "cpu", "bfloat16")
        self.receiver = transport.receiver(store, self.engine.device)

    def join_weights(self, *args, **kwargs) -> None:
        self.receiver.join(*args, **kwargs)

    def sync(self):
        """(version held, bytes of the update loaded)."""
        newer = self.receiver.newer(self.engine.version)
        if newer is None:
            return self.engine.version, 0
        self.engine.load_weights(newer[1], newer[0])
        return self.engine.version, update_bytes(newer[1])

    def weights(self):
        return {name: t.view(torch.int16).numpy().copy() for name, t in self.engine.model.state_dict().items()}


@pytest.mark.parametrize("transport", [ObjectStoreTransport(delta_full_every=FULL_EVERY),
                                       BroadcastTransport(bucket_mb=0.02, delta_full_every=FULL_EVERY)],
                         ids=["object_store", "broadcast"])
def test_an_engine_syncing_now_and_then_holds_the_bfloat16_learners_weights_bit_for_bit(
        ray_session, redis_server, redis_client, tiny_policy, transport):
    keys = PolicyKeys(f"delta-test-{time.time_ns()}", "policy")
    store = WeightStoreActor.remote(FULL_EVERY)
    engine = Engine.remote(tiny_policy, transport, store)
    learner = LearnerGroup(LearnerConfig(num_cpus=0), tiny_policy, seed=0, dtype="bfloat16", transport=transport)
    try:
        transport.connect(learner.ranks[0], [engine], redis_server, keys.version, 120)
        learner.start_stage(lr=1e-5)  # a fine-tuning rate: most bfloat16 values stay put
        loaded = {}
        for version in range(7):
            if version:
                learner.sft_step(ROWS)
            sent = learner.stream_weights(version)
            if isinstance(sent, ray.ObjectRef):
                ray.get(store.publish.remote(version, [sent]))
            if version in (0, 1, 3, 6):  # 2 missed; 4 (full) and 5 missed: replayed from the store, or folded
                loaded[version] = _sync_to(engine, version)
                full = from_snapshot(ray.get(learner.snapshot_weights()))
                held = ray.get(engine.weights.remote())
                assert all(np.array_equal(held[name], t.view(torch.int16).numpy()) for name, t in full.items())
        full_bytes = loaded[0]
        assert 0 < loaded[1] < full_bytes / 2  # in bfloat16 a small step changes a fraction of the elements
        assert loaded[6] >= full_bytes  # the full version 4 and a delta, folded into one full update
    finally:
        ray.kill(engine)
        learner.shutdown()


def _sync_to(engine, version: int, timeout_s: float = 30.0) -> int:
    """Bytes of the updates the engine loaded to reach `version`."""
    deadline, loaded = time.time() + timeout_s, 0
    while time.time() < deadline:
        held, received = ray.get(engine.sync.remote())
        loaded += received
        if held == version:
            return loaded
        time.sleep(0.05)
    raise AssertionError(f"the engine never reached version {version}")

"""Delta weight sync against full syncs: bytes and seconds per version, on the same training steps.

One DeepSpeed learner rank (in this process, `model.dtype` bfloat16) trains SFT steps on random rows;
after each step the same weights go out twice through the object store transport: as a full version
to one engine and as `weights.delta`'s update to another (each a transformers engine in its own
process, as a rollout worker holds one). A sync's seconds run from the learner's call to the engine
holding the version; its bytes are what the learner sent. The delta engine's weights are compared
with the learner's bit for bit at the end. Sizes: `quickstart` (the demo policy of
configs/quickstart.yaml) and `0.5b` (Qwen2-0.5B's shapes, random weights; meant for a GPU).

Usage: python benchmarks/delta_sync.py [--size quickstart|0.5b] [--lrs 3e-4 1e-6] [--versions 6]
           [--out benchmarks/results/delta_sync.md]
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import sys
import tempfile
import time
from datetime import date
from typing import Dict, List

import numpy as np
import ray
import torch

from gpu import SIZES, _free_port, _synchronize, build_policy  # benchmarks/gpu.py, beside this script
from rlplatform.actors.engine import TransformersEngine
from rlplatform.config import LearnerConfig, load_config
from rlplatform.learners.rank import LearnerRank
from rlplatform.policy import save_initial_policy
from rlplatform.transport.weight_deltas import DeltaEncoder, update_bytes
from rlplatform.transport.weight_store import WeightStoreActor
from rlplatform.transport.weight_transports import ObjectStoreTransport
from rlplatform.transport.weights import from_snapshot

QUICKSTART = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "configs", "quickstart.yaml")
FULL_EVERY = 1000  # no full version within the run but the first
DTYPE = "bfloat16"


@ray.remote(num_cpus=0)
class Engine:
    """An engine in another process taking each version from the weight store."""

    def __init__(self, model_dir: str, device: str, transport: ObjectStoreTransport, store) -> None:
        self.engine = TransformersEngine(model_dir, device, DTYPE)
        self.receiver = transport.receiver(store, self.engine.device)

    def load(self, version: int) -> int:
        """Bytes of the update that brought the engine to `version`."""
        newer = self.receiver.newer(self.engine.version)
        assert newer is not None and newer[0] == version, f"version {version} is not in the store"
        self.engine.load_weights(newer[1], newer[0])
        _synchronize()
        return update_bytes(newer[1])

    def bits(self) -> Dict[str, np.ndarray]:
        return {name: t.view(torch.int16).cpu().numpy() for name, t in self.engine.model.state_dict().items()}


def build(size: str, out: str) -> str:
    if size == "quickstart":
        return save_initial_policy(load_config(QUICKSTART, [f"model.dtype={DTYPE}"]).model, 0, out)
    return build_policy(size, out)


def random_rows(size: str, n: int, rng: random.Random) -> List[Dict]:
    if size == "quickstart":
        pairs = [(rng.randrange(100), rng.randrange(100)) for _ in range(n)]
        return [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a, b in pairs]
    vocab = SIZES[size]["vocab_size"]
    return [{"prompt": " ".join(f"t{rng.randrange(3, vocab)}" for _ in range(32)),
             "answer": " ".join(f"t{rng.randrange(3, vocab)}" for _ in range(32))} for _ in range(n)]


def measure(size: str, model_dir: str, device: str, lr: float, versions: int) -> Dict:
    """Full and delta syncs after the same SFT steps at `lr`: bytes and seconds per version."""
    learner = LearnerRank(0, 1, model_dir, LearnerConfig(num_threads=torch.get_num_threads()), seed=0,
                          dtype=DTYPE, transport=ObjectStoreTransport())
    learner.setup("127.0.0.1", _free_port())
    learner.start_stage(lr)
    full_store, delta_store = WeightStoreActor.remote(), WeightStoreActor.remote(FULL_EVERY)
    transport = ObjectStoreTransport(delta_full_every=FULL_EVERY)
    full_engine = Engine.remote(model_dir, device, transport, full_store)
    delta_engine = Engine.remote(model_dir, device, transport, delta_store)
    encoder, rng = DeltaEncoder(FULL_EVERY), random.Random(0)
    figures = {"full_s": [], "delta_s": [], "full_bytes": [], "delta_bytes": []}
    try:
        for version in range(versions + 1):  # version 0: the first full version of both
            if version:
                learner.sft_step(random_rows(size, 16, rng))
            for mode, store, engine, updates in (("full", full_store, full_engine, None),
                                                 ("delta", delta_store, delta_engine, encoder)):
                learner.updates = updates
                _synchronize()
                start = time.perf_counter()
                ray.get(store.publish.remote(version, learner.stream_weights(version)))
                loaded = ray.get(engine.load.remote(version))
                if version:
                    figures[f"{mode}_s"].append(time.perf_counter() - start)
                    figures[f"{mode}_bytes"].append(loaded)
        learner.updates = None
        expected = from_snapshot(ray.get(learner.snapshot_weights()[0]))
        held = ray.get(delta_engine.bits.remote())
        figures["bit_exact"] = all(np.array_equal(held[name], t.view(torch.int16).numpy()) for name, t in expected.items())
    finally:
        for actor in (full_engine, delta_engine, full_store, delta_store):
            ray.kill(actor)
    return figures


def median(values: List[float]) -> float:
    return sorted(values)[len(values) // 2]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--size", choices=["quickstart", *sorted(SIZES)], default="quickstart")
    parser.add_argument("--lrs", type=float, nargs="+", default=[3e-4, 1e-6],
                        help="SFT learning rates (3e-4: the quickstart's rl.lr; 1e-6: a 0.5B model's fine-tuning rate)")
    parser.add_argument("--versions", type=int, default=6)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                                      "delta_sync.md"))
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model_dir = build(args.size, tempfile.mkdtemp())
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    rows = []
    for lr in args.lrs:
        f = measure(args.size, model_dir, device, lr, args.versions)
        full_mb, delta_mb = median(f["full_bytes"]) / 2 ** 20, median(f["delta_bytes"]) / 2 ** 20
        rows.append(f"| {args.size} | {lr:g} | {full_mb:.2f} | {delta_mb:.2f} ({delta_mb / full_mb:.0%}) | "
                    f"{median(f['full_s']):.3f} | {median(f['delta_s']):.3f} | {'yes' if f['bit_exact'] else 'NO'} |")
        print(rows[-1], flush=True)
    device_name = torch.cuda.get_device_name() if device == "cuda" else f"{platform.processor() or 'cpu'}, " \
                                                                        f"{os.cpu_count()} cores"
    report = "\n".join([
        f"# Delta weight sync vs full syncs ({date.today()}, {device_name})", "",
        f"Command: `python {' '.join(sys.argv)}`. {DTYPE} weights, object store transport, one SFT step of 16 rows "
        f"between versions, median of {args.versions} versions (the first full version not counted). Bytes are what "
        "the learner sent per version; seconds run from the learner's call to the engine holding the version.", "",
        "| model | lr | full MB per sync | delta MB per sync | full s per sync | delta s per sync | delta bit-exact |",
        "|---|---|---|---|---|---|---|", *rows, ""])
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as out:
        out.write(report)
    print(report)


if __name__ == "__main__":
    main()

"""A learner step makes the host wait for the device a fixed number of times, however many micro-batches it
runs: no read-back (`.item()`, a Python bool of a tensor), no selection whose size only the device knows
(a boolean mask, `nonzero`, `masked_select`) and, on a GPU, no copy from pageable host memory, which first
waits for all queued work. A rank in its own process trains RL steps in each scoring layout (grouped rows,
packed rows, shared prompts) with a budget that holds the batch in one micro-batch and one that splits it in
several. On CPU every operation that would make a GPU's host wait is counted as PyTorch dispatches it; on a
GPU, CUDA's own synchronisation debug mode counts what did. A lone rank under ZeRO-0 (the default for one
rank) also all-reduces nothing: DeepSpeed would flatten its gradients, reduce them over one rank and copy
them back."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

SYNCS = r"""
import collections, json, socket, sys, warnings
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from rlplatform.config import LearnerConfig, RLConfig
from rlplatform.learners.batching import choose_layout
from rlplatform.learners.rank import LearnerRank
from rlplatform.transport.samples import Sample
from rlplatform.transport.weight_transports import ObjectStoreTransport

WAITING = ("_local_scalar_dense", "nonzero", "masked_select", "masked_scatter", "_unique", "repeat_interleave")


def waits(func, args) -> bool:
    # an operation whose result the host needs, or whose output size only the device knows
    name = str(func)
    if any(part in name for part in WAITING):
        return True
    indices = [i for a in args if isinstance(a, (list, tuple)) for i in a]
    return name.startswith("aten.index") and any(isinstance(i, torch.Tensor) and i.dtype == torch.bool
                                                 for i in indices)


class Waits(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += waits(func, args)
        return func(*args, **(kwargs or {}))


def counted(step) -> int:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("warn")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            step()
        torch.cuda.set_sync_debug_mode("default")
        return sum("synchroniz" in str(w.message) for w in caught)
    with Waits() as mode:
        step()
    return mode.count


def batch(prompts, completions):
    samples = [Sample(str(i), str(p), "policy", "", "", prompt_ids=p, completion_ids=c,
                      behaviour_logprobs=[-1.0] * len(c), token_versions=[0] * len(c))
               for i, (p, c) in enumerate(zip(prompts, completions))]
    return samples, [1.0, -1.0] * (len(samples) // 2)


BATCHES = {  # layout: (prompts, completions) of 16 samples that choose_layout scores that way
    "grouped": ([[3, 4, 5]] * 8 + [[6, 7, 8]] * 8, [[5, 6, 7], [7, 8]] * 8),
    "packed": ([[3 + (i * 7 + k) % 20 for k in range(5)] for i in range(16)], [[4, 5, 6, 7]] * 16),
    "shared_prompt": ([[3 + k % 9 for k in range(40)]] * 8 + [[4 + k % 7 for k in range(40)]] * 8,
                      [[5 + k % 4 for k in range(30)]] * 16),
}
device = "cuda" if torch.cuda.is_available() else "cpu"
rank = LearnerRank(0, 1, sys.argv[1], LearnerConfig(device=device, compile=False, zero_stage=1), seed=0,
                   dtype="bfloat16" if device == "cuda" else "float32", transport=ObjectStoreTransport())
with socket.socket() as sock:
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
rank.setup("127.0.0.1", port)
rank.start_stage(lr=1e-3, keep_reference=True)
rl = RLConfig(max_new_tokens=30, kl_coef=0.1, entropy_coef=0.01)
result = {}
for layout, (prompts, completions) in BATCHES.items():
    assert choose_layout(rank.engine, prompts, completions) == layout, layout
    samples, advantages = batch(prompts, completions)
    tokens = max(len(p) + len(c) for p, c in zip(prompts, completions))
    for name, budget in (("one", 10 ** 6), ("several", 3 * tokens)):
        rank.micro_batch_tokens = budget
        rank.rl_step(samples, advantages, rl)  # first: whatever a first step sets up
        result[f"{layout} {name}"] = counted(lambda: rank.rl_step(samples, advantages, rl, step=1))
print(json.dumps(result))
"""


def host_waits(policy: str) -> dict:
    run = subprocess.run([sys.executable, "-c", SYNCS, policy], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_an_rl_step_waits_for_the_device_as_often_in_several_micro_batches_as_in_one(tiny_policy):
    waits = host_waits(tiny_policy)
    for layout in ("grouped", "packed", "shared_prompt"):
        assert waits[f"{layout} several"] == waits[f"{layout} one"], waits
        # per step, all in the optimizer step: DeepSpeed's two checks of the gradient norm, and reading it
        assert waits[f"{layout} one"] <= 3, waits


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_a_gpu_an_rl_step_synchronises_as_often_in_several_micro_batches_as_in_one(tiny_policy):
    waits = host_waits(tiny_policy)  # CUDA's sync debug mode: read-backs and blocking copies alike
    for layout in ("grouped", "packed", "shared_prompt"):
        assert waits[f"{layout} several"] == waits[f"{layout} one"], waits


LONE_RANK = r"""
import socket, sys, torch
from rlplatform.config import LearnerConfig
from rlplatform.learners.rank import LearnerRank
from rlplatform.transport.weight_transports import ObjectStoreTransport
rank = LearnerRank(0, 1, sys.argv[1], LearnerConfig(), seed=0, dtype="float32", transport=ObjectStoreTransport())
with socket.socket() as sock:
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
rank.setup("127.0.0.1", port)
rank.start_stage(lr=1e-3)
reduced = []
all_reduce = torch.distributed.all_reduce
torch.distributed.all_reduce = lambda tensor, *args, **kwargs: reduced.append(tensor.numel()) or all_reduce(
    tensor, *args, **kwargs)
rows = [{"prompt": "1+2=", "answer": "3"}, {"prompt": "40+45=", "answer": "85"}]
losses = [rank.sft_step(rows)["loss"] for _ in range(2)]
print(rank.zero_stage, max(reduced, default=0), losses[1] < losses[0])
"""


def test_a_lone_zero_0_rank_all_reduces_no_gradients(tiny_policy):
    run = subprocess.run([sys.executable, "-c", LONE_RANK, tiny_policy], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    stage, largest, learned = run.stdout.split()[-3:]
    # DeepSpeed's clipping still sums a scalar norm over the group; no gradient goes through a reduction
    assert (stage, learned) == ("0", "True") and int(largest) <= 1, run.stdout[-500:]

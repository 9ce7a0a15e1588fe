"""`learner.compile`: decoder layers under torch.compile score and train as the eager ones do, in every
scoring layout and in a real DeepSpeed rank; where compiling fails they run eagerly; and the setting's
default is on for a CUDA learner only."""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest
import torch

from rlplatform.config import ConfigError, LearnerConfig, LoraConfig, load_config
from rlplatform.learners import compile_guard
from rlplatform.learners.batching import choose_layout, completion_logprobs
from rlplatform.learners.compiled_layers import compile_layers, decoder_layers, has_compiled_layers, layers_compiled
from rlplatform.learners.group import LearnerGroup
from rlplatform.lora import with_adapters
from rlplatform.policy import enable_activation_checkpointing, load_policy
from rlplatform.transport.weight_transports import ObjectStoreTransport
from tests.learners.layouts import LAYOUT_EXAMPLES

ROWS = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a, b in [(1, 2), (13, 7), (40, 45), (9, 9)]]


def scores_and_gradient(model, layout: str):
    """Log-probs, entropies and the parameter gradient of a fixed objective over them, for `layout`'s example
    (scored by a model with compiled layers in packed rows where an eager one shares the prompt's KV cache)."""
    prompts, completions = LAYOUT_EXAMPLES[layout]
    compiled = has_compiled_layers(model)
    expected = "packed" if compiled and layout == "shared_prompt" else layout
    assert choose_layout(model, prompts, completions) == expected
    scores = completion_logprobs(model, prompts, completions, pad_id=0, temperature=0.7, entropy_grad=True)
    mask = scores.mask.bool()
    weights = torch.randn(int(mask.sum()), generator=torch.Generator().manual_seed(0)).to(mask.device)
    model.zero_grad()
    ((scores.logprobs[mask] * weights).sum() + (scores.entropy[mask] * weights.flip(0)).sum()).backward()
    gradient = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
    return scores.logprobs[mask].detach(), scores.entropy[mask].detach(), gradient


def test_compiled_layers_score_and_train_as_eager_ones_in_every_layout(tiny_policy):
    eager, _ = load_policy(tiny_policy)
    compiled, _ = load_policy(tiny_policy)
    assert compile_layers(compiled) == len(decoder_layers(compiled)) == 2
    assert has_compiled_layers(compiled) and not has_compiled_layers(eager)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    for layout in sorted(LAYOUT_EXAMPLES):
        for got, want in zip(scores_and_gradient(compiled, layout), scores_and_gradient(eager, layout)):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
    # the compiled code ran, not the eager fallback: graphs were made for the layers' calls
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > graphs and not compile_guard.compiling_failed()


def test_compiled_layers_under_activation_checkpointing_train_as_eager_ones(tiny_policy):
    """Checkpointing calls each compiled layer again in backward, with gradients, to recompute it."""
    models = [load_policy(tiny_policy)[0] for _ in range(2)]
    for model in models:
        enable_activation_checkpointing(model)
        model.train()
    compile_layers(models[1])
    for got, want in zip(scores_and_gradient(models[1], "grouped"), scores_and_gradient(models[0], "grouped")):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
    assert not compile_guard.compiling_failed()


@pytest.mark.gpu
def test_compiled_layers_on_cuda_under_bfloat16_autocast_track_eager_ones(tiny_policy):
    eager, compiled = (load_policy(tiny_policy)[0].cuda() for _ in range(2))
    compile_layers(compiled)
    for layout in sorted(LAYOUT_EXAMPLES):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            pairs = zip(scores_and_gradient(compiled, layout), scores_and_gradient(eager, layout))
        for got, want in pairs:  # fused kernels round bfloat16 intermediates differently: a few elements of a
            # gradient (2 of 77,568 on an H200) stray further than any tolerance per element, so the whole is compared
            assert (got - want).norm() <= 2e-2 * want.norm(), (layout, (got - want).norm() / want.norm())
    assert not compile_guard.compiling_failed()


def test_layers_are_found_through_a_lora_wrapper(tiny_policy):
    model, _ = load_policy(tiny_policy)
    layers = decoder_layers(model)
    wrapped = with_adapters(model, LoraConfig(enabled=True, rank=4, alpha=8))
    assert decoder_layers(wrapped) == layers and len(layers) == 2


def test_a_failed_compile_runs_the_layers_eagerly(tiny_policy, monkeypatch, caplog):
    monkeypatch.setattr(compile_guard, "_FAILED", [])  # this test's failure stays out of the process's record
    torch._dynamo.reset()
    eager, _ = load_policy(tiny_policy)
    compiled, _ = load_policy(tiny_policy)
    compile_layers(compiled)
    # a C++ compiler that always fails, and no compiled graph from an earlier run; torch's own patch restores both
    # (monkeypatch's undo deletes them from the config module, which then hides them from every later compile)
    with caplog.at_level(logging.WARNING, logger=compile_guard.__name__), \
            torch._inductor.config.patch({"cpp.cxx": ("/bin/false",), "fx_graph_cache": False}):
        got = scores_and_gradient(compiled, "packed")
    assert compile_guard.compiling_failed()
    assert "the decoder layers runs uncompiled: torch.compile failed" in caplog.text
    for got_part, want in zip(got, scores_and_gradient(eager, "packed")):
        torch.testing.assert_close(got_part, want, atol=1e-6, rtol=0)
    torch._dynamo.reset()


def test_the_default_compiles_on_cuda_only_and_never_under_zero_3():
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert layers_compiled(None, cuda, 1) and not layers_compiled(None, cuda, 3)
    assert not layers_compiled(None, cpu, 1) and layers_compiled(True, cpu, 1) and not layers_compiled(False, cuda, 1)
    assert load_config("configs/quickstart.yaml", []).learner.compile is None
    with pytest.raises(ConfigError, match="'learner.compile' is true under ZeRO-3"):
        load_config("configs/quickstart.yaml", ["learner.compile=true", "learner.zero_stage=3"])


@pytest.mark.slow
def test_a_compiled_rank_trains_as_an_eager_one(ray_session, tiny_policy, dtype="float32", tolerance=1e-5):
    """A real DeepSpeed rank in float32: compiled, its losses over three steps are the eager rank's. bfloat16 under
    autocast, the GPU's precision, is checked against eager layers on CUDA above."""
    losses = {}
    for compiled in (None, True):  # the default (eager on CPU), then compiled
        learner = LearnerGroup(LearnerConfig(num_cpus=0.5, compile=compiled), tiny_policy, seed=0,
                               dtype=dtype, transport=ObjectStoreTransport())
        try:
            (placement,) = learner.placements()
            assert placement["compiled_layers"] == (2 if compiled else 0)
            learner.start_stage(lr=1e-2)
            losses[compiled] = [learner.sft_step(ROWS).loss for _ in range(3)]  # the later ones after updates
        finally:
            learner.shutdown()
    assert abs(losses[None][0] - losses[None][2]) > 0.1  # the steps changed the weights
    assert losses[True] == pytest.approx(losses[None], abs=tolerance)


AHEAD = """
import socket, sys, torch
from rlplatform.config import LearnerConfig, RLConfig
from rlplatform.learners.batching import choose_layout
from rlplatform.learners.compiled_layers import WARM_UP_BATCHES
from rlplatform.learners.rank import LearnerRank
from rlplatform.transport.samples import Sample
from rlplatform.transport.weight_transports import ObjectStoreTransport
rank = LearnerRank(0, 1, sys.argv[1], LearnerConfig(compile=True), seed=0,
                   dtype="float32", transport=ObjectStoreTransport())
with socket.socket() as sock:
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
rank.setup("127.0.0.1", port)
rank.start_stage(lr=1e-3)
graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
for (prompts, completions), layout in zip(WARM_UP_BATCHES, ["grouped", "packed"]):  # other sizes, more rows
    prompts = [p + [9] for p in prompts] + [p + [10] for p in prompts]
    completions = [c + [11, 12] for c in completions] * 2
    assert choose_layout(rank.engine, prompts, completions) == layout
    samples = [Sample(str(i), str(p), "policy", "", "", prompt_ids=p, completion_ids=c,
                      behaviour_logprobs=[-1.0] * len(c), token_versions=[0] * len(c))
               for i, (p, c) in enumerate(zip(prompts, completions))]
    rank.rl_step(samples, [1.0, -1.0] * (len(samples) // 2), RLConfig(max_new_tokens=20))
print(graphs, torch._dynamo.utils.counters["stats"]["unique_graphs"])
"""


def test_a_compiled_rank_compiles_as_it_starts_not_in_its_steps(tiny_policy):
    """RL steps in both layouts, at sizes the start-up's passes did not have, compile nothing more (both call the
    layers with a mask, so one graph can serve them)."""
    run = subprocess.run([sys.executable, "-c", AHEAD, tiny_policy], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    after_setup, after_steps = map(int, run.stdout.split()[-2:])
    assert after_setup >= 1 and after_steps == after_setup

"""Routing replay: the transformers engine records the experts every token it fed went to; the learner, given a
routing, sends each recorded token to exactly those experts in every scoring layout; and on an MoE whose routers
moved since the engine sampled, the learner's log-probs with replay stay far closer to the engine's than without
it, the job's step figures saying both and the routers' agreement."""

from __future__ import annotations

import pytest
import torch

from rlplatform.actors.engine import TransformersEngine
from rlplatform.config import LearnerConfig, ModelConfig, RLConfig
from rlplatform.learners import batching
from rlplatform.learners.batching import choose_layout, completion_logprobs
from rlplatform.learners.group import LearnerGroup
from rlplatform.learners.routing_replay import RoutingReplay, Routes
from rlplatform.policy import load_policy, routers, save_initial_policy
from rlplatform.transport.routed_experts import bytes_per_token, decode_routing
from rlplatform.transport.samples import Sample, decode_sample, encode_sample
from tests.learners.layouts import LAYOUT_EXAMPLES
from tests.learners.steps import rl_step
from rlplatform.transport.weight_transports import ObjectStoreTransport

MOE = ModelConfig(hidden_size=64, num_layers=2, intermediate_size=128, num_experts=4, experts_per_token=2,
                  expert_size=32)
LAYERS, TOP_K, EXPERTS = 2, 2, 4


@pytest.fixture(scope="module")
def moe_policy(tmp_path_factory) -> str:
    return save_initial_policy(MOE, 0, str(tmp_path_factory.mktemp("moe")))


def _own_routing(model: torch.nn.Module, sequence: list) -> torch.Tensor:
    """(positions, layers, k): the experts the model's routers choose for each token of `sequence`, run alone."""
    chosen = []
    hooks = [router.register_forward_hook(lambda module, args, output: chosen.append(output[2]))
             for router in routers(model)]
    with torch.no_grad():
        model(torch.tensor([sequence]))
    for hook in hooks:
        hook.remove()
    return torch.stack(chosen, dim=1)


def test_the_engine_records_the_experts_of_every_token_it_fed(moe_policy):
    engine = TransformersEngine(moe_policy)
    prompts = engine.tokenizer(["1+2=", "13+7=", "40+45="])["input_ids"]
    completions = [c for group in engine.generate(prompts, 3, 8, 1.0) for c in group]
    for c in completions:
        sequence = c.prompt_ids + c.completion_ids
        assert len(c.routed_experts) == (len(sequence) - 1) * bytes_per_token(LAYERS, TOP_K, EXPERTS)
        recorded = decode_routing(c.routed_experts, LAYERS, TOP_K, EXPERTS)
        # the last token is never fed: its hidden state predicts nothing the learner scores
        assert torch.equal(recorded, _own_routing(engine.model, sequence[:-1]).long())
    sample = Sample("g/0", "g", "p", "", "", prompt_ids=c.prompt_ids, completion_ids=c.completion_ids,
                    behaviour_logprobs=c.logprobs, token_versions=c.versions,
                    routed_experts=c.routed_experts)
    assert decode_sample(encode_sample(sample)).routed_experts == c.routed_experts
    with pytest.raises(ValueError, match="not whole tokens of 2 layers x top-2"):
        decode_routing(c.routed_experts[:-1], LAYERS, TOP_K, EXPERTS)


def _hand_made(sequence: list) -> torch.Tensor:
    """A routing no router would choose by itself: token t of every layer l to experts (t + l) % E and
    (t + l + 1) % E, for every token but the last."""
    t = torch.arange(len(sequence) - 1)[:, None, None] + torch.arange(LAYERS)[None, :, None]
    return (t + torch.arange(TOP_K)) % EXPERTS


def test_replay_sends_each_recorded_token_to_its_recorded_experts_in_every_layout(moe_policy, monkeypatch):
    model, _ = load_policy(moe_policy)
    model.eval()
    # alone, a sequence's tokens reach the experts the hand-made routing names (the padding of its row its own)
    prompt, completion = [5, 6, 7, 8], [9, 10, 11]
    given = _hand_made(prompt + completion)
    reached = []
    hooks = [layer.mlp.experts.register_forward_pre_hook(lambda module, args: reached.append(args[1]))
             for layer in model.model.layers]
    with RoutingReplay(routers(model)) as replay, torch.no_grad():
        completion_logprobs(model, [prompt], [completion], 0, routes=Routes(replay, [given]))
    for hook in hooks:
        hook.remove()
    assert torch.equal(torch.stack(reached, dim=1)[:len(given)], given)
    # every layout routes every sequence of a batch as it routes the sequence alone
    for layout, (prompts, completions) in LAYOUT_EXAMPLES.items():
        assert choose_layout(model, prompts, completions) == layout
        given = [_hand_made(p + c) for p, c in zip(prompts, completions)]
        with RoutingReplay(routers(model)) as replay, torch.no_grad():
            batched = completion_logprobs(model, prompts, completions, 0, routes=Routes(replay, given))
            monkeypatch.setattr(batching, "choose_layout", lambda *args: "packed")
            alone = [completion_logprobs(model, [p], [c], 0, routes=Routes(replay, [g])).logprobs[0]
                     for p, c, g in zip(prompts, completions, given)]
            monkeypatch.undo()
        with torch.no_grad():
            unreplayed = completion_logprobs(model, prompts, completions, 0)
        for i, (p, c) in enumerate(zip(prompts, completions)):
            columns = slice(len(p) - 1, len(p) + len(c) - 1)
            assert torch.allclose(batched.logprobs[i, columns], alone[i][columns], atol=1e-5), layout
        assert (batched.logprobs - unreplayed.logprobs).abs().max() > 1e-3, layout  # the routing mattered


def _moved_routers(policy: str, out_dir: str) -> str:
    """The policy saved again with noise of 0.3 times each router's own spread added to its weights: about a
    fifth of the (token, layer) pairs then route elsewhere."""
    model, tokenizer = load_policy(policy)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for router in routers(model):
            router.weight.add_(torch.randn(router.weight.shape, generator=generator) * 0.3 * router.weight.std())
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def test_replay_keeps_parity_on_routers_that_moved_since_sampling(moe_policy, ray_session, tmp_path):
    engine = TransformersEngine(moe_policy)
    groups = engine.generate(engine.tokenizer(["1+2=", "13+7=", "40+45=", "9+9="])["input_ids"], 4, 8, 1.0)
    samples = [Sample(f"{g}/{i}", str(g), "p", "", c.text, prompt_ids=c.prompt_ids, completion_ids=c.completion_ids,
                      behaviour_logprobs=c.logprobs,
                      token_versions=[0] * len(c.completion_ids), routed_experts=c.routed_experts)
               for g, group in enumerate(groups) for i, c in enumerate(group)]
    advantages = [1.0 if i % 2 else -1.0 for i in range(len(samples))]
    learner = LearnerGroup(LearnerConfig(num_cpus=0.5), _moved_routers(moe_policy, str(tmp_path / "moved")), seed=0,
                           dtype="float32", transport=ObjectStoreTransport())
    try:
        learner.start_stage(lr=1e-3)
        figures = rl_step(learner, samples, advantages, RLConfig(max_new_tokens=8)).figures
    finally:
        learner.shutdown()
    # measured: with replay 0.0002 mean |Δ log-prob| against 0.0018 without; agreement 0.80
    assert figures["parity_abs_mean"] == pytest.approx(figures["parity_replayed_abs_mean"])
    assert figures["parity_abs_mean"] < 0.3 * figures["parity_unreplayed_abs_mean"], figures
    assert 0.5 < figures["router_agreement"] < 0.95
    assert figures["routed_expert_bytes"] == sum(len(s.routed_experts) for s in samples)

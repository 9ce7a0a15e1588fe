"""Mixture-of-experts policies: `model.num_experts` builds a Qwen3-MoE demo; the routers' load-balancing loss is 1
for even routing and E/k when every token goes to the same k experts; a learner rank adds it to its SFT and RL
losses, reports it, and at a large weight trains the routers toward even load; the transformers engine generates
from the MoE."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from rlplatform.actors.engine import TransformersEngine
from rlplatform.config import ConfigError, LearnerConfig, ModelConfig, RLConfig, load_config
from rlplatform.learners.group import LearnerGroup
from rlplatform.learners.moe import RouterLoad, aux_loss_coef, load_balancing_loss
from rlplatform.policy import load_policy, routers, save_initial_policy
from rlplatform.preflight import check
from rlplatform.transport.samples import Sample
from tests.learners.steps import rl_step
from rlplatform.transport.weight_transports import ObjectStoreTransport

MOE = ModelConfig(hidden_size=64, num_layers=2, intermediate_size=128, num_experts=4, experts_per_token=2,
                  expert_size=32)
ROWS = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a, b in [(1, 2), (13, 7), (40, 45), (9, 9), (3, 30)]]


@pytest.fixture(scope="module")
def moe_policy(tmp_path_factory) -> str:
    return save_initial_policy(MOE, 0, str(tmp_path_factory.mktemp("moe")))


def test_the_demo_builds_a_mixture_of_experts_of_the_configured_shape(moe_policy, tiny_policy):
    model, _ = load_policy(moe_policy)
    assert model.config.model_type == "qwen3_moe" and model.config.moe_intermediate_size == 32
    found = routers(model)
    assert len(found) == 2 and all(r.top_k == 2 and r.num_experts == 4 for r in found)
    assert aux_loss_coef(model) == 0.01 and aux_loss_coef(load_policy(tiny_policy)[0]) == 0.0
    with pytest.raises(ConfigError, match="'model.experts_per_token' is 5; a token can be routed to at most the "
                                          "layer's 4 experts"):
        load_config(None, ["model.num_experts=4", "model.experts_per_token=5"])
    with pytest.raises(ConfigError, match="'model.num_experts' is 4 but 'model.kind' is pretrained"):
        load_config(None, ["model.kind=pretrained", f"model.path={moe_policy}", "model.num_experts=4"])


@pytest.mark.parametrize("model", [["model.num_experts=4"], ["model.kind=pretrained", "model.path={moe_policy}"]])
def test_lora_on_a_mixture_of_experts_is_refused_in_one_line(model, moe_policy):
    """Its experts are fused 3-D tensors (`gate_up_proj`, `down_proj`) that LoRA's linear adapters do not reach:
    `rlp validate` and `rlp run` refuse adapters on a demo MoE and on a pretrained one."""
    config = load_config(None, [key.format(moe_policy=moe_policy) for key in model] + ["model.lora.enabled=true"])
    with pytest.raises(ConfigError) as err:
        check(config, "job.yaml")
    assert str(err.value) == ("job.yaml: 'model.lora.enabled' is true but the model is a mixture of 4 experts a "
                              "layer, whose experts are fused 3-D tensors that LoRA's adapters do not reach; train "
                              "all its weights (model.lora.enabled: false)")
    check(load_config(None, [key.format(moe_policy=moe_policy) for key in model]), "job.yaml")  # without adapters


def test_the_load_balancing_loss_is_one_for_even_routing_and_e_over_k_when_it_collapses():
    tokens = torch.arange(8)
    even = torch.zeros(8, 4)
    even[tokens, tokens % 4] = even[tokens, (tokens + 1) % 4] = 20.0  # each expert gets a quarter of the picks
    collapsed = torch.zeros(8, 4)
    collapsed[:, :2] = 20.0  # every token picks experts 0 and 1
    assert load_balancing_loss([even, even], top_k=2).item() == pytest.approx(1.0, abs=1e-4)
    assert load_balancing_loss([collapsed], top_k=2).item() == pytest.approx(4 / 2, abs=1e-4)


def test_router_load_records_the_passes_that_train_and_its_loss_reaches_every_router(moe_policy):
    model, tokenizer = load_policy(moe_policy)
    ids = torch.tensor([tokenizer("12+34=46")["input_ids"]])
    with RouterLoad(routers(model)) as routing:
        with torch.no_grad():
            model(torch.cat([ids, ids], dim=1))  # not recorded: a pass without a gradient
        logits = model(ids).logits
    loss = routing.loss()
    assert loss.item() > 0 and logits.shape[1] == ids.shape[1]
    loss.backward()
    assert all(router.weight.grad is not None and router.weight.grad.abs().sum() > 0 for router in routers(model))
    model.zero_grad()
    model(ids)  # after the exit: nothing more is recorded
    assert routing.loss().item() == pytest.approx(loss.item())


def _engine_samples(policy: str):
    engine = TransformersEngine(policy)
    groups = engine.generate(engine.tokenizer(["1+2=", "40+45="])["input_ids"], 4, 4, 1.0)
    samples = [Sample(f"{g}/{i}", str(g), "policy", "", c.text, prompt_ids=c.prompt_ids,
                      completion_ids=c.completion_ids, behaviour_logprobs=c.logprobs,
                      token_versions=[0] * len(c.completion_ids))
               for g, group in enumerate(groups) for i, c in enumerate(group)]
    return samples, [1.0 if s.sample_id.startswith("0/") else -1.0 for s in samples]


def _balance_over_sft(policy: str, steps: int):
    """The load-balancing loss each of `steps` SFT steps reports, and the learner (still running)."""
    learner = LearnerGroup(LearnerConfig(num_cpus=0.5), policy, seed=0,
                           dtype="float32", transport=ObjectStoreTransport())
    learner.start_stage(lr=3e-2)
    return [learner.sft_step(ROWS).figures["router_aux_loss"] for _ in range(steps)], learner


@pytest.mark.slow
def test_a_rank_adds_the_load_balancing_loss_reports_it_and_evens_the_load(ray_session, tmp_path):
    # the same MoE, its routers' loss weighted 1 and 0 in the learner's loss: the same SFT steps leave the first
    # more evenly routed (SFT alone at this rate skews the routing: the loss climbs from about 1.0 to 1.3-2.0).
    # Over the last 4 of 8 steps the weighted run's losses summed 0.87 and 2.05 less (demo seeds 0 and 1); the bar
    # is 0.1
    policies = {coef: save_initial_policy(dataclasses.replace(MOE, router_aux_loss_coef=coef), 0,
                                          str(tmp_path / f"moe-{coef}")) for coef in (1.0, 0.0)}
    balance = {}
    for coef, policy in policies.items():
        balance[coef], learner = _balance_over_sft(policy, 8)
        try:
            if coef:  # RL steps on samples the transformers engine generated from the MoE report it too
                samples, advantages = _engine_samples(policy)
                assert rl_step(learner, samples, advantages, RLConfig(max_new_tokens=4)).figures["router_aux_loss"] > 0
        finally:
            learner.shutdown()
    assert balance[1.0][0] == pytest.approx(balance[0.0][0])  # the same weights, the same routing
    assert sum(balance[1.0][-4:]) < sum(balance[0.0][-4:]) - 0.1, balance

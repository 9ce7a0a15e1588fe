"""On-policy distillation in the learner: RL steps whose only signal is the teacher's per-token one (the task's
advantages all 0) take the student's reverse KL to the teacher down, computed exactly over the vocabulary
(`reverse_kl`); steps on the forward KL over the teacher's top tokens alone (`forward_kl`, checked against a hand
computation) move the student's probability onto the token the teacher would choose."""

from __future__ import annotations

import math

import pytest
import ray
import torch

from rlplatform.actors.engine import TransformersEngine
from rlplatform.config import LearnerConfig, ModelConfig, RLConfig
from rlplatform.learners.group import LearnerGroup
from rlplatform.learners.token_distributions import align_top, forward_kl_on_top
from rlplatform.policy import save_initial_policy
from rlplatform.transport.samples import Sample
from rlplatform.transport.weight_transports import ObjectStoreTransport
from rlplatform.transport.weights import from_snapshot
from tests.learners.steps import rl_step

TINY = ModelConfig(hidden_size=64, num_layers=2, intermediate_size=128)


def _reverse_kl(student: torch.nn.Module, teacher: torch.nn.Module, prompts) -> float:
    """KL(student || teacher) of the next token after each prompt, over the whole vocabulary, averaged."""
    total = 0.0
    with torch.no_grad():
        for prompt in prompts:
            s, t = (torch.log_softmax(m(torch.tensor([prompt])).logits[0, -1].float(), -1) for m in (student, teacher))
            total += float((s.exp() * (s - t)).sum())
    return total / len(prompts)


def test_steps_on_the_teachers_signal_alone_take_the_reverse_kl_down(ray_session, tmp_path):
    student = TransformersEngine(save_initial_policy(TINY, 0, str(tmp_path / "student")))
    teacher = TransformersEngine(save_initial_policy(TINY, 1, str(tmp_path / "teacher")))
    with torch.no_grad():
        teacher.model.lm_head.weight.mul_(8.0)  # a sharp teacher, far from the student (KL about 6.5 nats)
    prompts = student.tokenizer([f"{a}+{b}=" for a, b in [(1, 2), (13, 7), (40, 45), (9, 9)]])["input_ids"]
    learner = LearnerGroup(LearnerConfig(num_cpus=0.5), str(tmp_path / "student"), seed=0,
                           dtype="float32", transport=ObjectStoreTransport())
    try:
        learner.start_stage(lr=1e-3, distill_coef=1.0)
        kls = [_reverse_kl(student.model, teacher.model, prompts)]
        for step in range(4):  # one-token completions, 64 a prompt: the exact KL is the next token's
            completions = [c for group in student.generate(prompts, 64, 1, 1.0) for c in group]
            scores = teacher.score([c.prompt_ids for c in completions], [c.completion_ids for c in completions])
            samples = [Sample(f"{step}/{i}", str(i // 64), "p", "", c.text, prompt_ids=c.prompt_ids,
                              completion_ids=c.completion_ids, behaviour_logprobs=c.logprobs, token_versions=[step],
                              teacher_logprobs=s, teacher_version=0)
                       for i, (c, s) in enumerate(zip(completions, scores))]
            figures = rl_step(learner, samples, [0.0] * len(samples), RLConfig(max_new_tokens=1), step=step).figures
            assert figures["distill_kl"] > 0
            student.load_weights(from_snapshot(ray.get(learner.snapshot_weights())), step + 1)
            kls.append(_reverse_kl(student.model, teacher.model, prompts))
        # a step with distillation paused (its teacher's reward collapsed: `TeacherGuard`) leaves the signal out
        paused = rl_step(learner, samples, [0.0] * len(samples), RLConfig(max_new_tokens=1), step=4, distill=False)
        assert "distill_kl" not in paused.figures and paused.figures["pg_loss"] == 0.0
    finally:
        learner.shutdown()
    # measured: 6.555, 6.496, 6.459, 6.418, 6.375; with the signal's sign flipped it climbs
    assert all(after < before for before, after in zip(kls, kls[1:])), kls
    assert kls[0] - kls[-1] > 0.1, kls


def test_the_forward_kl_over_the_teachers_top_tokens_matches_a_hand_computation():
    """A vocabulary of 4: at the first completion position the teacher gives tokens 2 and 0 probabilities 0.7 and
    0.2 (its top 2); the student's log-softmax is uniform there. Per position sum_k p_t (log p_t - log p_s)."""
    student = torch.full((1, 3, 4), torch.log(torch.tensor(0.25)).item())
    top_ids, top_logprobs = align_top([[[2, 0], [1, 3]]], [[[math.log(0.7), math.log(0.2)], [0.0, -50.0]]],
                                      prompts=[[9, 9]], width=3)  # prompt of 2: the completion starts at position 1
    assert top_ids[0, 1].tolist() == [2, 0] and top_logprobs[0, 0].tolist() == [-math.inf, -math.inf]
    kl = forward_kl_on_top(student, top_ids, top_logprobs)
    expected = 0.7 * math.log(0.7 / 0.25) + 0.2 * math.log(0.2 / 0.25)
    assert kl[0, 0].item() == 0.0 and kl[0, 1].item() == pytest.approx(expected, abs=1e-6)
    assert kl[0, 2].item() == pytest.approx(math.log(1 / 0.25), abs=1e-6)  # a sure teacher: -log p_s(its token)


def test_a_teacher_below_temperature_1_names_its_top_tokens_at_that_temperature(tmp_path):
    """`distill.temperature`: the teacher's top tokens and their log-probs come from its logits / temperature,
    checked against a hand computation; at 0.5 its most likely token holds more of its mass than at 1."""
    teacher = TransformersEngine(save_initial_policy(TINY, 1, str(tmp_path / "teacher")))
    prompt, completion = teacher.tokenizer(["13+7="])["input_ids"], [[teacher.tokenizer("2")["input_ids"][0]]]
    with torch.no_grad():
        logits = teacher.model(torch.tensor([prompt[0] + completion[0]])).logits[0, len(prompt[0]) - 1].float()
    (warm_sampled, warm_ids, warm_top), = teacher.top_logprobs(prompt, completion, 4)
    (sampled, ids, top), = teacher.top_logprobs(prompt, completion, 4, temperature=0.5)
    by_hand = torch.log_softmax(logits / 0.5, -1)
    assert ids[0] == by_hand.topk(4).indices.tolist() == warm_ids[0]
    assert top[0] == pytest.approx(by_hand.topk(4).values.tolist(), abs=1e-5)
    assert sampled[0] == pytest.approx(by_hand[completion[0][0]].item(), abs=1e-5)
    assert warm_top[0] == pytest.approx(torch.log_softmax(logits, -1).topk(4).values.tolist(), abs=1e-5)
    assert top[0][0] > warm_top[0][0]


def test_steps_on_the_forward_kl_alone_move_the_student_onto_the_teachers_top_tokens(ray_session, tmp_path):
    """The teacher's top 4 tokens after each prompt (task advantages all 0): the student's probability of the
    teacher's most likely next token rises step by step (with the term's sign flipped it falls)."""
    student = TransformersEngine(save_initial_policy(TINY, 0, str(tmp_path / "student")))
    teacher = TransformersEngine(save_initial_policy(TINY, 1, str(tmp_path / "teacher")))
    with torch.no_grad():
        teacher.model.lm_head.weight.mul_(8.0)
    prompts = student.tokenizer([f"{a}+{b}=" for a, b in [(1, 2), (13, 7), (40, 45), (9, 9)]])["input_ids"]
    with torch.no_grad():
        favourite = [int(teacher.model(torch.tensor([p])).logits[0, -1].argmax()) for p in prompts]

    def mass_on_favourite() -> float:
        with torch.no_grad():
            return sum(float(torch.softmax(student.model(torch.tensor([p])).logits[0, -1], -1)[f])
                       for p, f in zip(prompts, favourite)) / len(prompts)

    learner = LearnerGroup(LearnerConfig(num_cpus=0.5), str(tmp_path / "student"), seed=0,
                           dtype="float32", transport=ObjectStoreTransport())
    try:
        learner.start_stage(lr=1e-3, distill_coef=1.0)
        masses = [mass_on_favourite()]
        for step in range(3):
            completions = [c for group in student.generate(prompts, 8, 1, 1.0) for c in group]
            prompt_ids, completion_ids = [c.prompt_ids for c in completions], [c.completion_ids for c in completions]
            tops = teacher.top_logprobs(prompt_ids, completion_ids, 4)
            assert all(ids[0][0] == favourite[i // 8] for i, (_, ids, _) in enumerate(tops))
            # the sampled token's log-prob from the same pass is the one `score` gives
            scores = teacher.score(prompt_ids, completion_ids)
            assert [x for s, _, _ in tops for x in s] == pytest.approx([x for s in scores for x in s], abs=1e-5)
            samples = [Sample(f"{step}/{i}", str(i // 8), "p", "", c.text, prompt_ids=c.prompt_ids,
                              completion_ids=c.completion_ids, behaviour_logprobs=c.logprobs, token_versions=[step],
                              teacher_logprobs=s, teacher_version=0, teacher_top_ids=ids, teacher_top_logprobs=lps)
                       for i, (c, (s, ids, lps)) in enumerate(zip(completions, tops))]
            figures = rl_step(learner, samples, [0.0] * len(samples), RLConfig(max_new_tokens=1), step=step).figures
            assert figures["distill_forward_kl"] > 0
            student.load_weights(from_snapshot(ray.get(learner.snapshot_weights())), step + 1)
            masses.append(mass_on_favourite())
    finally:
        learner.shutdown()
    assert all(after > before for before, after in zip(masses, masses[1:])), masses

"""TeacherGuard: a student stops taking its teacher's signal while the teacher's reward_collapse rule fires,
takes it again once the rule clears, says so once each way and counts the steps paused."""

from __future__ import annotations

from rlplatform.config import AlertRule
from rlplatform.monitoring.alerts import AlertRules, StepFigures
from rlplatform.monitoring.teacher_guard import TeacherGuard


def test_distillation_pauses_while_the_teachers_reward_has_collapsed_and_resumes_after():
    teacher = AlertRules([AlertRule("reward_collapse", 0.5, 2)])  # a mean over 2 steps below half the best
    said = []
    guard = TeacherGuard("device", "server", lambda: teacher.firing["reward_collapse"],
                         lambda kind, message: said.append((kind, message)))
    taken = []
    for step, reward in enumerate([0.6, 0.8, 0.8, 0.2, 0.1, 0.1, 0.9, 0.8, 0.8]):  # the teacher's step rewards
        teacher.check(StepFigures(step, reward, 0.0, 0, 0.0))
        taken.append(guard.distilling())  # the student's next step
    assert taken == [True, True, True, True, False, False, True, True, True]
    assert [kind for kind, _ in said] == ["distill_paused", "distill_resumed"]
    assert said[0][1].startswith("policy 'device' stops distilling from 'server', whose reward collapsed")
    assert guard.steps_paused == 2

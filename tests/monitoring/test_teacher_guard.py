"""TeacherGuard: a student stops taking its teacher's signal once the teacher's reward_collapse rule fires, and
takes it again only when the teacher's reward is back to RECOVERED of its best (not when the rule, hovering at its
threshold, clears); it says so once each way and counts the steps paused."""

from __future__ import annotations

from rlplatform.config import AlertRule
from rlplatform.monitoring.alerts import AlertRules, StepFigures
from rlplatform.monitoring.teacher_guard import TeacherGuard


def test_distillation_pauses_while_the_teachers_reward_is_down_and_resumes_once_it_recovers():
    teacher = AlertRules([AlertRule("reward_collapse", 0.5, 2)])  # a mean over 2 steps below half the best
    said = []
    guard = TeacherGuard("device", "server", teacher, lambda kind, message: said.append((kind, message)))
    taken = []
    # the teacher's step rewards: best window 0.8; down; at the rule's threshold (it clears: 0.45 >= 0.4), still far
    # below the best; back up
    for step, reward in enumerate([0.6, 0.8, 0.8, 0.2, 0.1, 0.1, 0.4, 0.5, 0.4, 0.7, 0.8, 0.8]):
        teacher.check(StepFigures(step, reward, 0.0, 0, 0.0))
        taken.append(guard.distilling())  # the student's next step
    assert not teacher.firing["reward_collapse"]
    assert taken == [True] * 4 + [False] * 6 + [True] * 2
    assert [kind for kind, _ in said] == ["distill_paused", "distill_resumed"]
    assert said[0][1].startswith("policy 'device' stops distilling from 'server', whose reward collapsed")
    assert guard.steps_paused == 6

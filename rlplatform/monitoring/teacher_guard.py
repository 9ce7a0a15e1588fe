"""Distillation paused while the teacher's reward has collapsed.

A policy that distils from another policy of the job (`distill.teacher`) trains on that teacher's per-token
signal. When the teacher trains RL itself and its reward collapses (its `reward_collapse` alert rule firing: the
mean reward over the rule's window below the threshold times its best), what it would teach is what it has
unlearned: the student's learner steps leave the teacher's signal out and train on the task reward alone until the
teacher's reward is back to `RECOVERED` of its best (a rule hovering at its threshold would otherwise pause and
resume the student over and over while the teacher stays down). Each change is alerted once (`distill_paused`,
`distill_resumed`); the steps taken without the teacher are counted (`steps_paused` in the student's distillation
figures).
"""

from __future__ import annotations

from typing import Callable, Optional

from rlplatform.monitoring.alerts import AlertRules

RECOVERED = 0.8  # the teacher's reward, as a fraction of its best, at which distillation resumes


class TeacherGuard:
    def __init__(self, student: str, teacher: str, teacher_alerts: AlertRules,
                 alert: Callable[[str, str], None]) -> None:
        """`teacher_alerts`: the teacher's alert rules as its RL monitor keeps them; `alert(kind, message)`."""
        self.student, self.teacher, self.teacher_alerts, self.alert = student, teacher, teacher_alerts, alert
        self.paused = False
        self.steps_paused = 0

    def distilling(self) -> bool:
        """Whether the student's next learner step takes the teacher's signal (told once each time it changes)."""
        if not self.paused and self.teacher_alerts.firing.get("reward_collapse", False):
            self.paused = True
            self.alert("distill_paused", f"policy '{self.student}' stops distilling from '{self.teacher}', whose "
                                         "reward collapsed: its steps train on the task reward alone until the "
                                         f"teacher's reward is back to {RECOVERED:g} of its best")
        elif self.paused and (self._level() or 0.0) >= RECOVERED:
            self.paused = False
            self.alert("distill_resumed", f"policy '{self.student}' distils from '{self.teacher}' again: the teacher's "
                                          f"reward is back to {self._level():.2f} of its best")
        self.steps_paused += self.paused
        return not self.paused

    def _level(self) -> Optional[float]:
        return self.teacher_alerts.reward_of_best()

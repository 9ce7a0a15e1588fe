"""Distillation paused while the teacher's reward has collapsed.

A policy that distils from another policy of the job (`distill.teacher`) trains on that teacher's per-token
signal. When the teacher trains RL itself and its reward collapses (its `reward_collapse` alert rule firing: the
mean reward over the rule's window below the threshold times its best), what it would teach is what it has
unlearned: the student's learner steps leave the teacher's signal out and train on the task reward alone until the
rule stops firing. Each change is alerted once (`distill_paused`, `distill_resumed`); the steps taken without the
teacher are counted (`steps_paused` in the student's distillation figures).
"""

from __future__ import annotations

from typing import Callable


class TeacherGuard:
    def __init__(self, student: str, teacher: str, collapsed: Callable[[], bool],
                 alert: Callable[[str, str], None]) -> None:
        """`collapsed()`: whether the teacher's reward_collapse rule fires now; `alert(kind, message)`."""
        self.student, self.teacher, self.collapsed, self.alert = student, teacher, collapsed, alert
        self.paused = False
        self.steps_paused = 0

    def distilling(self) -> bool:
        """Whether the student's next learner step takes the teacher's signal (told once each time it changes)."""
        collapsed = self.collapsed()
        if collapsed != self.paused:
            self.paused = collapsed
            self.alert(*(("distill_paused", f"policy '{self.student}' stops distilling from '{self.teacher}', whose "
                          "reward collapsed: its steps train on the task reward alone until the teacher's reward "
                          "recovers") if collapsed else
                         ("distill_resumed", f"policy '{self.student}' distils from '{self.teacher}' again: the "
                          "teacher's reward recovered")))
        self.steps_paused += self.paused
        return not self.paused

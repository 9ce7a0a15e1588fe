"""The scored-group buffer between the reward queue and the learner.

Scored samples' metadata (`ResultMeta`: ids, version, reward, token counts) arrive one by one,
in any order; the buffer assembles them into groups (all completions of one prompt) and chooses
the learner's batches of complete groups, oldest policy version first. Groups over the staleness bound (for a
distilling policy, also the teacher version that scored them), and groups left with fewer than two
samples once reward errors and filter drops are removed, are dropped and counted, never
trained on; so are groups expired before they completed (a sample lost to dead letters).
`forgotten` lists the samples of expired groups, whose stored results can be deleted; `completed` the
groups that completed since the RL loop last took it, an expired one's late completion included (its
deadline is measured on them).
"""

from __future__ import annotations

from dataclasses import KW_ONLY, dataclass, field
from typing import Dict, List, Optional, Set, Tuple

from rlplatform.scheduling.staleness import StalenessRule
from rlplatform.transport.samples import ResultMeta

Group = List[ResultMeta]


@dataclass
class Batch:
    groups: List[Group]
    dropped_stale: List[Group] = field(default_factory=list)
    dropped_errors: List[Group] = field(default_factory=list)
    dropped_zero_advantage: List[Group] = field(default_factory=list)  # all rewards equal: nothing to learn
    dropped_invalid: List[ResultMeta] = field(default_factory=list)  # error or drop-flagged samples of trained groups
    _: KW_ONLY
    signal_drops: int = 0  # zero-advantage groups dynamic sampling dropped while this batch filled (set by the RL loop)

    @property
    def samples(self) -> List[ResultMeta]:
        return [s for group in self.groups for s in group]

    def group_ids(self) -> List[str]:
        """The trained groups' ids, in order."""
        return [group[0].group_id for group in self.groups]

    def group_positions(self) -> List[Tuple[str, int]]:
        """The trained groups' (id, prompt position), in order."""
        return [(group[0].group_id, group[0].prompt_position) for group in self.groups]

    def dropped_ids(self) -> List[str]:
        """Every sample this take dropped: never trained, their stored results can go."""
        groups = self.dropped_stale + self.dropped_errors + self.dropped_zero_advantage
        return [s.sample_id for s in [*(s for g in groups for s in g), *self.dropped_invalid]]


def _trainable(scored: ResultMeta) -> bool:
    return scored.error is None and not scored.drop


def has_signal(group: Group) -> bool:
    """Whether the group's rewards differ: a group whose rewards are all equal has no advantage to learn from."""
    return len({s.reward for s in group}) > 1


def group_version(group: Group) -> int:
    return min(s.version for s in group)


class GroupBuffer:
    def __init__(self, group_size: int) -> None:
        self.group_size = group_size
        self._partial: Dict[str, Group] = {}
        self._complete: List[Group] = []
        self._completed_ids: Set[str] = set()  # groups already complete: later redeliveries are ignored
        self._expired: Dict[str, Set[str]] = {}  # groups given up on, with their samples' ids: dropped as they come
        self.samples_expired = 0  # samples of expired groups, dropped
        self.forgotten: List[str] = []  # sample ids of expired groups dropped here, not yet deleted
        self.completed: List[str] = []  # groups completed since the RL loop last took them, late ones included

    def add(self, scored: ResultMeta) -> None:
        group_id = scored.group_id
        if group_id in self._expired:
            self._add_expired(scored)
            return
        if group_id in self._completed_ids:
            return  # a redelivered result of a group already complete
        group = self._partial.setdefault(group_id, [])
        if any(s.sample_id == scored.sample_id for s in group):
            return  # a redelivered result: already counted
        group.append(scored)
        if len(group) == self.group_size:
            self._completed_ids.add(group_id)
            self._complete.append(self._partial.pop(group_id))
            self.completed.append(group_id)

    def _add_expired(self, scored: ResultMeta) -> None:
        seen = self._expired[scored.group_id]
        if scored.sample_id in seen:
            return  # a redelivered result: dropped already
        seen.add(scored.sample_id)
        self.samples_expired += 1
        self.forgotten.append(scored.sample_id)
        if len(seen) == self.group_size:
            self.completed.append(scored.group_id)

    def is_complete(self, group_id: str) -> bool:
        return group_id in self._completed_ids

    def expire(self, group_id: str) -> None:
        """Give up on an incomplete group: drop what arrived of it and whatever arrives later."""
        if group_id in self._expired:
            return
        dropped = self._partial.pop(group_id, [])
        self._expired[group_id] = {s.sample_id for s in dropped}
        self.samples_expired += len(dropped)
        self.forgotten += [s.sample_id for s in dropped]

    def held_samples(self) -> int:
        """Samples waiting here: in complete groups not yet taken and in groups still filling."""
        return sum(len(g) for g in self._complete) + sum(len(g) for g in self._partial.values())

    def take(self, learner_version: int, rule: StalenessRule, filter_zero_advantage: bool = False,
             teacher_version: Optional[int] = None) -> Batch:
        """Drop what the staleness rule no longer lets the learner at `learner_version` train on, or is
        unusable (and, if asked, groups whose rewards are all equal); return the rule's `batch_prompts`
        groups if that many are left. With `teacher_version` (on-policy distillation: the teacher's newest), the
        same rule holds for the teacher version that scored each sample."""
        batch_prompts, oldest_allowed = rule.batch_prompts, rule.oldest_trainable(learner_version)
        oldest_teacher = None if teacher_version is None else rule.oldest_trainable(teacher_version)
        batch = Batch(groups=[])
        usable = []
        for group in self._complete:
            valid = [s for s in group if _trainable(s)]
            if group_version(group) < oldest_allowed or \
                    (oldest_teacher is not None and min(s.teacher_version for s in group) < oldest_teacher):
                batch.dropped_stale.append(group)
            elif len(valid) < 2:
                batch.dropped_errors.append(group)
            elif filter_zero_advantage and not has_signal(valid):
                batch.dropped_zero_advantage.append(group)
            else:
                usable.append(group)
        usable.sort(key=group_version)
        if len(usable) >= batch_prompts:
            batch.groups, usable = usable[:batch_prompts], usable[batch_prompts:]
            batch.dropped_invalid = [s for group in batch.groups for s in group if not _trainable(s)]
            batch.groups = [[s for s in group if _trainable(s)] for group in batch.groups]
        self._complete = usable
        return batch

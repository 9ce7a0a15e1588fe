"""Teacher scoring workers: on-policy distillation between two policies of a job (`distill.teacher`).

A distilling policy's rollout workers submit their samples to its teacher queue (`teacher_queue`). A teacher
worker is a Ray actor holding the teacher policy's engine, kept at the teacher's newest published version as its
rollout workers keep theirs; it takes the samples as a reward worker takes its own (`QueueWorker`: at-least-once,
reclaimed from a dead worker, dead-lettered when malformed), scores each completion token's log-prob under the
teacher (and in `forward_kl` mode the teacher's top tokens at each position), records the teacher version that
scored it, and passes the sample on to the reward queue in the step that acknowledges it. Its counters (samples scored, scoring seconds) go to the student's `teacher_stats` hash.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import List

from rlplatform.actor_classes import LazyActorClass
from rlplatform.actors.rollout_spec import RolloutSpec
from rlplatform.config import RewardWorkersConfig
from rlplatform.transport.deadlines import Heartbeats
from rlplatform.transport.queue_worker import QueueStats, QueueWorker
from rlplatform.transport.redis_server import RECONNECT_S, connect
from rlplatform.transport.keys import PolicyKeys
from rlplatform.transport.reward_queue import RewardQueue
from rlplatform.transport.samples import Sample, decode_sample
from rlplatform.transport.teacher_queue import TeacherQueue

WEIGHTS_WAIT_S = 0.05  # between looks for the teacher's first published weights


@dataclass
class TeacherStats(QueueStats):
    scored: int = 0


class TeacherWorker(QueueWorker):
    """Teacher worker `index` of `student`: scores its samples under the teacher `spec` describes (the teacher's
    rollout worker spec: its model, weight store and run); with `top_k`, also the teacher's top_k tokens at each
    completion token (`distill.mode: forward_kl`), all at `temperature` (`distill.temperature`)."""

    def __init__(self, spec: RolloutSpec, student: str, index: int, config: RewardWorkersConfig, *,
                 top_k: int = 0, temperature: float = 1.0) -> None:
        from rlplatform.actors.engine import TransformersEngine
        from rlplatform.actors.rollout import RolloutWorker

        self.teacher = RolloutWorker(spec)  # the teacher's engine, and its weight sync
        self.top_k, self.temperature = top_k, temperature
        if top_k and not isinstance(self.teacher.engine, TransformersEngine):
            raise RuntimeError(f"policy '{student}' distils in forward_kl mode, which reads its teacher's top tokens "
                               f"from the transformers engine: set the teacher's rollout.engine: transformers")
        client = connect(spec.redis_url, wait_s=RECONNECT_S)
        self.stats_key = PolicyKeys(spec.run, student).teacher_stats
        label = f"teacher worker {index} of policy '{student}'"
        super().__init__(f"{student}-teacher-{index}", TeacherQueue(client, spec.run, student),
                         RewardQueue(client, spec.run), config, TeacherStats(),
                         heartbeats=Heartbeats(client, spec.run), label=label)

    def decode(self, raw: bytes) -> Sample:
        return decode_sample(raw)

    def handle(self, samples: List[Sample]) -> List[Sample]:
        """Each sample with its tokens' log-probs under the teacher's newest weights and their version."""
        start = time.perf_counter()
        version = self._newest_weights()
        prompts, completions = [s.prompt_ids for s in samples], [s.completion_ids for s in samples]
        if self.top_k:  # the sampled tokens' log-probs and the top tokens from one pass
            for sample, (sampled, ids, logprobs) in zip(samples, self.teacher.engine.top_logprobs(
                    prompts, completions, self.top_k, self.temperature)):
                sample.teacher_logprobs, sample.teacher_top_ids, sample.teacher_top_logprobs = sampled, ids, logprobs
        else:
            for sample, logprobs in zip(samples, self.teacher.engine.score(prompts, completions)):
                sample.teacher_logprobs = [float(x) for x in logprobs]
        for sample in samples:
            sample.teacher_version = version
        self.stats.scored += len(samples)
        self.run_queue.add_counters(self.stats_key, scored=len(samples), busy_s=time.perf_counter() - start)
        return samples

    def _newest_weights(self) -> int:
        """The teacher's newest published version, loaded (waiting for its first, beating meanwhile)."""
        while self.teacher.sync_weights() < 0 and not self.run_queue.stop_requested():
            self.heartbeats.beat(self.label, "waiting for the teacher's weights")
            time.sleep(WEIGHTS_WAIT_S)
        return self.teacher.version

    def store(self, msg_ids: List[str], results: List[Sample]) -> None:
        """The scored samples on to the reward queue, once per sample id, their requests acknowledged."""
        self.queue.pass_on(list(zip(msg_ids, results)))


TeacherActor = LazyActorClass(TeacherWorker)

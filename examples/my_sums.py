"""A verifiers taskset for `configs/verifiers_sums.yaml`: tasks "<a>+<b>=" of two-digit numbers (4000 of the
8100 pairs, a fixed seeded draw; with 400 of them, seed 0's held-out pass@1 sat between 0.30 and 0.47 over 400 RL
steps) whose reward is 1 when the reply is the sum. The job's rollout workers play it themselves (`env.kind:
verifiers`, `env.taskset: examples/my_sums.py`); an agent outside can play it through a running job's OpenAI
bridge from this folder: `cd examples && rlp verifiers my_sums --url http://127.0.0.1:8000/v1 --group-size 8`."""

import random

import verifiers.v1 as vf

TASKS = 4000


class SumData(vf.TaskData):
    answer: str


class SumTask(vf.Task[SumData]):
    @vf.reward(weight=1.0)
    async def correct(self, trace: vf.Trace) -> float:
        return float(trace.last_reply.strip() == self.data.answer)


class SumTaskset(vf.Taskset[SumTask, vf.TasksetConfig]):
    def load(self):
        pairs = random.Random(0).sample([(a, b) for a in range(10, 100) for b in range(10, 100)], TASKS)
        for a, b in pairs:
            yield SumTask(SumData(prompt=f"{a}+{b}=", answer=str(a + b)), self.config.task)


__all__ = ["SumTaskset"]

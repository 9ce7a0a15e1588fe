"""A verifiers taskset for the tests: every sum of two digits, "<a>+<b>=", rewarded 1 when the reply is the sum,
each listed twice (two tasks of one problem): most held-out tasks then share their problem with a training
task, as the one-digit data's held-out rows share theirs with training rows, so a test of learning checks
that the job learns from the groups it plays rather than that a 0.8M-parameter model generalises to sums
it never met."""

import verifiers.v1 as vf


class SumData(vf.TaskData):
    answer: str


class SumTask(vf.Task[SumData]):
    @vf.reward(weight=1.0)
    async def correct(self, trace: vf.Trace) -> float:
        return float(trace.last_reply.strip() == self.data.answer)


class DigitSums(vf.Taskset[SumTask, vf.TasksetConfig]):
    def load(self):
        for _ in range(2):
            for a in range(10):
                for b in range(10):
                    yield SumTask(SumData(prompt=f"{a}+{b}=", answer=str(a + b)), self.config.task)


__all__ = ["DigitSums"]

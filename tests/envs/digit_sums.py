"""A verifiers taskset for the tests: every sum of two digits, "<a>+<b>=", rewarded 1 when the reply is the sum."""

import verifiers.v1 as vf


class SumData(vf.TaskData):
    answer: str


class SumTask(vf.Task[SumData]):
    @vf.reward(weight=1.0)
    async def correct(self, trace: vf.Trace) -> float:
        return float(trace.last_reply.strip() == self.data.answer)


class DigitSums(vf.Taskset[SumTask, vf.TasksetConfig]):
    def load(self):
        for a in range(10):
            for b in range(10):
                yield SumTask(SumData(prompt=f"{a}+{b}=", answer=str(a + b)), self.config.task)


__all__ = ["DigitSums"]

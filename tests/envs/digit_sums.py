"""A verifiers taskset for the tests: every sum of two digits, "<a>+<b>=", rewarded 1 when the reply is the sum.
`copies` (a taskset config field, `env.taskset_args.copies`) lists each sum that many times, as distinct tasks:
held-out tasks then ask sums that training tasks ask too, as the held-out rows of the one-digit addition data do."""

import verifiers.v1 as vf


class SumData(vf.TaskData):
    answer: str


class SumTask(vf.Task[SumData]):
    @vf.reward(weight=1.0)
    async def correct(self, trace: vf.Trace) -> float:
        return float(trace.last_reply.strip() == self.data.answer)


class DigitSumsConfig(vf.TasksetConfig):
    copies: int = 1


class DigitSums(vf.Taskset[SumTask, DigitSumsConfig]):
    def load(self):
        for _ in range(self.config.copies):
            for a in range(10):
                for b in range(10):
                    yield SumTask(SumData(prompt=f"{a}+{b}=", answer=str(a + b)), self.config.task)


__all__ = ["DigitSums"]

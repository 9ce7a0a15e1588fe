"""A verifiers taskset for `configs/verifiers_sums.yaml`: tasks "<a>+<a>=" whose reward is 1 when the
reply is the sum. The job's rollout workers play it themselves (`env.kind: verifiers`,
`env.taskset: examples/my_sums.py`); an agent outside can play it through a running job's OpenAI
bridge from this folder: `cd examples && rlp verifiers my_sums --url http://127.0.0.1:8000/v1 --group-size 8`."""

import verifiers.v1 as vf


class SumData(vf.TaskData):
    answer: str


class SumTask(vf.Task[SumData]):
    @vf.reward(weight=1.0)
    async def correct(self, trace: vf.Trace) -> float:
        return float(trace.last_reply.strip() == self.data.answer)


class SumTaskset(vf.Taskset[SumTask, vf.TasksetConfig]):
    def load(self):
        for a in range(10, 60):
            yield SumTask(SumData(prompt=f"{a}+{a}=", answer=str(2 * a)), self.config.task)


__all__ = ["SumTaskset"]

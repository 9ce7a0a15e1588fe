"""Every Redis key of the platform, named in one place.

A job's name owns two keys: its lease `rlp:<name>:owner` and `rlp:<name>:run`, its newest run's id
(`NameKeys`). Everything else belongs to one run, scoped by `<name>:<run id>` (`run_scope`): the keys all its
policies share (`JobKeys`), each policy's own (`PolicyKeys`: weight versions, counters, the prompt ledger,
a distilling policy's teacher queue) and the tool queue's (`ToolKeys`). A run's keys all match
`JobKeys.pattern`, so a run can clear its own keys and touch no other run's. No other module formats a key.
"""

from __future__ import annotations


def run_scope(job: str, run_id: str) -> str:
    """What one run's Redis keys are scoped by: `<job name>:<run id>` (`rlplatform.job.run_dir.run_id`)."""
    return f"{job}:{run_id}"


class NameKeys:
    """The keys of a job's name, shared by its runs."""

    def __init__(self, job: str) -> None:
        self.owner = f"rlp:{job}:owner"  # the lease of the live job holding the name (`job_lease`)
        self.newest_run = f"rlp:{job}:run"  # the id of the name's newest run


class QueueKeys:
    """The keys of one at-least-once work queue (`stream_queue.StreamQueue`)."""

    def __init__(self, prefix: str, done_ids: str = "done-ids") -> None:
        self.requests = f"{prefix}:requests"
        self.done_ids = f"{prefix}:{done_ids}"  # the ids of the results stored, each once
        self.dead = f"{prefix}:dead"  # dead letters: undecodable or undeliverable requests, with the reason


class JobKeys:
    """Names of one run's Redis keys shared by all its policies; `run` is its `run_scope`."""

    def __init__(self, run: str) -> None:
        self.run = run
        prefix = f"rlp:{run}"
        self.pattern = f"{prefix}:*"  # every key of the run
        self.rewards_queue = QueueKeys(prefix, done_ids="scored-ids")  # the reward queue's requests
        self.requests, self.scored_ids, self.dead = (self.rewards_queue.requests, self.rewards_queue.done_ids,
                                                     self.rewards_queue.dead)
        self.results = f"{prefix}:results"  # the metadata of each new result
        self._result = f"{prefix}:result:"  # + sample id: the whole result, until trained or dropped
        self.stop = f"{prefix}:stop"
        self.reward_stats = f"{prefix}:reward-stats"  # counters summed over reward workers
        self.status = f"{prefix}:status"  # the job's live progress, read by `rlp status`
        self.rewards = f"{prefix}:rewards"  # the job's reward list, read by standalone reward workers
        self.max_pending = f"{prefix}:max-pending"  # the job's producer bound (redis.max_stream_len)
        self.heartbeats = f"{prefix}:heartbeats"  # worker label -> time its loop last went round
        self.learner_steps = f"{prefix}:learner-steps"  # a stream: the policy of each learner step as it ends
        self.attach_requests = f"{prefix}:attach-requests"  # a stream: workers asked for by `rlp rollout-worker`
        self._attach = f"{prefix}:attach:"  # + request id: its lease and the job's answer

    def attach_lease(self, request: str) -> str:
        """Held by the `rlp rollout-worker` command that made attach request `request`, while it runs."""
        return f"{self._attach}{request}:lease"

    def attach_answer(self, request: str) -> str:
        """The job's answer to attach request `request`: the workers it started, or why none."""
        return f"{self._attach}{request}:answer"

    def result(self, sample_id: str) -> str:
        """Where the whole scored result of sample `sample_id` waits until it is trained or dropped."""
        return self._result + sample_id


class LedgerKeys:
    """One policy's prompt ledger (`scheduling.ledger.PromptLedger`)."""

    def __init__(self, prefix: str) -> None:
        prefix = f"{prefix}:ledger"
        self.open, self.claimed, self.counts = f"{prefix}:open", f"{prefix}:claimed", f"{prefix}:counts"
        self.reissue, self.cursor, self.seq = f"{prefix}:reissue", f"{prefix}:cursor", f"{prefix}:seq"
        self.attempt = f"{prefix}:attempt"
        self.agents_ended = f"{prefix}:agents-ended"  # agents' groups that ended: never opened again


class PolicyKeys:
    """Names of one policy's Redis keys within its run (`run`: the run's `run_scope`)."""

    def __init__(self, run: str, policy: str) -> None:
        prefix = f"rlp:{run}:policy:{policy}"
        self.version = f"{prefix}:version"  # newest published weight version
        self.versions = f"{prefix}:versions"  # a stream announcing each published version (`versions`)
        self.groups_started = f"{prefix}:groups-started"
        self.groups_dropped = f"{prefix}:groups-dropped"
        self.agent_episodes_expired = f"{prefix}:agent-episodes-expired"  # the bridges' dropped episodes, for the alert
        self.rollout_stats = f"{prefix}:rollout-stats"  # the policy's rollout counters (the one record of them)
        self.canary_reference = f"{prefix}:canary-reference"  # the learner's parity canary scores (`parity_canary`)
        self.canary_checks = f"{prefix}:canary-checks"  # the engines' canary checks, a stream
        self.evaluator_process = f"{prefix}:evaluator-process"  # `this_process()` of the evaluator's newest process
        self.teacher_queue = QueueKeys(f"{prefix}:teacher")  # a distilling policy's teacher queue (`teacher_queue`)
        self.teacher_stats = f"{prefix}:teacher-stats"  # its teacher scoring workers' counters
        self.ledger = LedgerKeys(prefix)


class ToolKeys:
    """Names of one run's tool-queue keys (`run`: its `run_scope`)."""

    def __init__(self, run: str) -> None:
        prefix = f"rlp:{run}:tools"
        self.queue = QueueKeys(prefix)
        self.requests, self.done_ids, self.dead = self.queue.requests, self.queue.done_ids, self.queue.dead
        self.specs = f"{prefix}:specs"  # the job's tool list, read by standalone tool workers
        self.stats = f"{prefix}:stats"  # counters summed over tool workers: calls/<tool>, errors/<tool>, latency_s/<tool>
        self._results = f"{prefix}:results"

    def results(self, worker: str) -> str:
        """The result stream of the rollout worker named `worker`."""
        return f"{self._results}:{worker}"

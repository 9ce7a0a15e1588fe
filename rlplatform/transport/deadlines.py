"""Deadlines on remote waits, and the failures a job cannot go on from.

`deadline_get` is `ray.get` with a deadline and a message naming what did not answer; a learner
rank's death becomes `LearnerDied`. The controller, the learner group and the evaluator use it so
that no wait on another process is unbounded.
"""

from __future__ import annotations

import ray
from ray.exceptions import GetTimeoutError, RayActorError

LEARNER_TIMEOUT_S = 3600.0  # one learner call (a step, a checkpoint) on the largest models
WEIGHTS_TIMEOUT_S = 600.0  # publishing one weight snapshot
EVAL_TIMEOUT_S = 3600.0  # one held-out evaluation


class JobFailed(RuntimeError):
    """The job cannot go on; the one-line message says why and how to resume."""


class LearnerDied(JobFailed):
    """A learner rank's process died: its state is gone and the job must resume from a checkpoint."""


class WorkerHung(JobFailed):
    """A remote call passed its deadline; the message names the worker."""


def deadline_get(refs, what: str, timeout_s: float):
    """`ray.get(refs)`, failing after `timeout_s` with a message naming `what` did not answer."""
    try:
        return ray.get(refs, timeout=timeout_s)
    except RayActorError as err:
        if getattr(err, "actor_id", None) and "LearnerRank" in str(err):
            raise LearnerDied(f"a learner rank died ({what}: {type(err).__name__})") from None
        raise
    except GetTimeoutError:
        raise WorkerHung(f"{what} did not answer within {timeout_s:.0f}s; it hangs or its node is lost "
                         f"(see the Ray logs under /tmp/ray/session_latest/logs)") from None

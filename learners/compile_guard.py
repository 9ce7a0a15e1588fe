"""Compiled code that falls back to its eager code: the learner's compiled pieces (the output head's
arithmetic, the decoder layers) run through `guarded`. Where torch.compile fails in a process (no
Triton, no C++ compiler, an inductor error), that call and every guarded call after it in the process
run eagerly, and the failure is logged once."""

from __future__ import annotations

import logging
from typing import Callable, List, Optional

import torch

logger = logging.getLogger(__name__)

_FAILED: List[BaseException] = []  # the error that made this process give up compiling, once there is one


def compiling_failed() -> bool:
    """Whether torch.compile has failed in this process (guarded calls run eagerly from then on)."""
    return bool(_FAILED)


def guarded(compiled: Callable, eager: Callable, what: str,
            prepare: Optional[Callable[[tuple, dict], None]] = None) -> Callable:
    """`compiled` (`eager` under torch.compile), called as `eager` once compiling has failed in this process;
    `what` names it in the warning; `prepare(args, kwargs)` runs before each compiled call (marking dynamic
    sizes)."""
    def call(*args, **kwargs):
        if _FAILED:
            return eager(*args, **kwargs)
        if prepare is not None:
            prepare(args, kwargs)
        try:
            return compiled(*args, **kwargs)
        except torch.OutOfMemoryError:
            raise
        except (RuntimeError, torch._dynamo.exc.TorchDynamoException) as error:
            logger.warning("%s runs uncompiled: torch.compile failed: %s", what, error)
            _FAILED.append(error)
            return eager(*args, **kwargs)
    return call

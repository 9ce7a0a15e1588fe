"""Rewards used by the benchmarks (`vs_trl.py`), each an exact match behind a fixed cost per
completion: `slow_exact_match` waits (I/O-bound, a remote judge: only the waiting overlaps) and
`cpu_exact_match` computes (CPU-bound, a local verifier: gains come only from running it beside
generation and learning and from spreading it over processes). `sometimes_slow_exact_match`, slow on one sample
in ten, is the fault suite's slow reward (`faults.py`)."""

from __future__ import annotations

import asyncio
import hashlib
import time

_BLOCK = bytes(1 << 16)  # hashed over and over; hashlib releases the GIL on blocks this large


def _exact(completion: str, answer) -> float:
    return 1.0 if completion.strip() == str(answer).strip() else 0.0


async def slow_exact_match(sample, delay_ms: float = 30.0) -> float:
    """1.0 when the completion is the answer, after waiting `delay_ms` as a remote judge would."""
    await asyncio.sleep(delay_ms / 1000)
    return _exact(sample.completion, sample.answer)


def burn_cpu(work_ms: float) -> None:
    """Hash until this thread has used `work_ms` of CPU time (real work, slower when cores are shared)."""
    until = time.thread_time() + work_ms / 1000
    while time.thread_time() < until:
        hashlib.sha256(_BLOCK).digest()


def cpu_exact_match(sample, work_ms: float = 30.0) -> float:
    """1.0 when the completion is the answer, after `work_ms` of CPU time spent hashing."""
    burn_cpu(work_ms)
    return _exact(sample.completion, sample.answer)


def sometimes_slow_exact_match(sample, slow_s: float = 10.0, one_in: int = 10) -> float:
    """Exact match, after `slow_s` on one sample in `one_in` (by a hash of its id: the same ones on every run), as
    a judge that is usually quick and now and then slow; within the reward's timeout, so no call fails."""
    if int(hashlib.sha256(sample.sample_id.encode()).hexdigest(), 16) % one_in == 0:
        time.sleep(slow_s)
    return _exact(sample.completion, sample.answer)

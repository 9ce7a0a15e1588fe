"""Rewards used by the benchmarks: exact match behind a fixed per-sample latency, standing for a
remote judge or a code sandbox (the slow-rewards scenario of `vs_trl.py`)."""

from __future__ import annotations

import asyncio


async def slow_exact_match(sample, delay_ms: float = 30.0) -> float:
    """1.0 when the completion is the answer, after waiting `delay_ms` as a remote judge would."""
    await asyncio.sleep(delay_ms / 1000)
    return 1.0 if sample.completion.strip() == str(sample.answer).strip() else 0.0

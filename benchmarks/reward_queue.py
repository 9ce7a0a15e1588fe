"""Reward-queue throughput and latency: scored samples/s through Redis with the exact-match
reward for 1 and 2 reward-worker processes, and the round-trip latency one group of samples
adds (submit -> scored result read back) on an idle queue.

Usage: python benchmarks/reward_queue.py [--samples 20000] [--workers 1 2] [--out benchmarks/results/reward_queue.md]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import platform
import statistics
import sys
import time
from datetime import date

from rlplatform.config import RewardSpec, RewardWorkersConfig
from rlplatform.rewards.worker import RewardWorker
from rlplatform.transport.redis_server import EmbeddedRedis, connect
from rlplatform.transport.reward_queue import RewardQueue
from rlplatform.transport.run_keys import end_run
from rlplatform.transport.samples import Sample


def make_samples(count: int, prefix: str):
    """Quickstart-shaped samples: 6-char prompts, 3-token completions with log-probs and versions."""
    return [Sample(f"{prefix}-{i // 8}/{i % 8}", f"{prefix}-{i // 8}", "policy", "37+48=", "85",
                   prompt_ids=[6, 10, 13, 7, 11, 16], completion_ids=[11, 8, 2],
                   behaviour_logprobs=[-0.1, -0.2, -0.05], token_versions=[3, 3, 3], row={"answer": "85"},
                   created_at=time.time()) for i in range(count)]


def serve(url: str, job: str, name: str) -> None:
    worker = RewardWorker(name, [RewardSpec(name="exact_match")], url, job, RewardWorkersConfig(batch_size=256))
    worker.run()


def throughput(url: str, workers: int, count: int) -> float:
    job = f"bench-{workers}-{time.time_ns()}"
    queue = RewardQueue(connect(url), job, max_pending=10 ** 7)
    queue.create_group()
    samples = make_samples(count, "t")
    for i in range(0, count, 1024):  # queued up front: the workers' rate alone is measured
        queue.submit(samples[i:i + 1024])
    procs = [mp.Process(target=serve, args=(url, job, f"w{i}")) for i in range(workers)]
    start = time.perf_counter()
    for p in procs:
        p.start()
    received = 0
    while received < count:
        received += len(queue.read_results(count=4096, block_ms=100))
    elapsed = time.perf_counter() - start
    queue.request_stop()
    for p in procs:
        p.join()
    end_run(queue.client, queue.keys.run)
    return count / elapsed


def latency(url: str, rounds: int) -> list:
    job = f"lat-{time.time_ns()}"
    queue = RewardQueue(connect(url), job)
    queue.create_group()
    proc = mp.Process(target=serve, args=(url, job, "w0"))
    proc.start()
    time.sleep(2.0)  # the worker is up and blocked on the stream
    times = []
    for r in range(rounds):
        start = time.perf_counter()
        queue.submit(make_samples(8, f"l{r}"))
        got = 0
        while got < 8:
            got += len(queue.read_results(block_ms=100))
        times.append((time.perf_counter() - start) * 1000)
    queue.request_stop()
    proc.join()
    return times


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--samples", type=int, default=20000)
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "reward_queue.md"))
    args = parser.parse_args()
    rows = []
    with EmbeddedRedis() as redis_server:
        for workers in args.workers:
            rate = throughput(redis_server.url, workers, args.samples)
            rows.append(f"| {workers} | {args.samples} | {rate:,.0f} |")
            print(f"{workers} worker(s): {rate:,.0f} scored samples/s", flush=True)
        times = latency(redis_server.url, args.rounds)
    p50, p90 = statistics.median(times), statistics.quantiles(times, n=10)[-1]
    print(f"round trip of one group of 8: p50 {p50:.2f} ms, p90 {p90:.2f} ms ({p50 / 8:.3f} ms per sample)")
    report = "\n".join([
        "# Reward queue throughput and latency", "",
        f"{date.today()}, {platform.node()}: {os.cpu_count()} CPUs, Python {sys.version.split()[0]}, "
        f"`python benchmarks/reward_queue.py --samples {args.samples}`", "",
        "Exact-match reward; quickstart-shaped samples (msgpack); results stored idempotently with XACK.", "",
        "| reward worker processes | samples | scored samples/s |", "|---|---|---|", *rows, "",
        f"Round trip of one group of 8 samples on an idle queue (submit -> scored result read back), "
        f"{args.rounds} rounds: p50 {p50:.2f} ms, p90 {p90:.2f} ms, i.e. {p50 / 8:.3f} ms per sample.", ""])
    with open(args.out, "w") as f:
        f.write(report)


if __name__ == "__main__":
    main()

"""A Ray cluster of nodes started with `ray start` on this machine: a head and further nodes, each on ports of its
own under one temp dir, optionally each on CPUs of its own (its processes pinned to them, so that a node that
joins brings cores the others do not use). For trying a multi-node job on one machine: the multi-node test and
the elastic benchmark use it. `stop` ends only the processes its commands started."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import psutil

RAY = [sys.executable, "-m", "ray.scripts.scripts"]
# Ray heads started with `ray start` require the token; a driver joins by its `ray.address`, not RAY_ADDRESS
ENV = dict(os.environ, RAY_AUTH_MODE="token", RAY_ADDRESS="", WANDB_MODE="disabled")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class LocalNodes:
    """`start_head` then `add_node` for each further node; each node is its `ray start --block` process."""

    def __init__(self) -> None:
        self.temp_dir = tempfile.mkdtemp(prefix="rlp-ray-", dir="/tmp")  # short: Ray's socket paths live under it
        self.address = f"127.0.0.1:{free_port()}"
        self.nodes: List[subprocess.Popen] = []

    def start_head(self, cpus: int, resources: Optional[Dict[str, float]] = None,
                   on_cpus: Optional[Sequence[int]] = None) -> subprocess.Popen:
        port = self.address.rsplit(":", 1)[1]
        return self._start("--head", f"--port={port}", f"--num-cpus={cpus}", "--include-dashboard=false",
                           f"--dashboard-port={free_port()}", f"--ray-client-server-port={free_port()}",
                           "--resources", json.dumps(resources or {}), on_cpus=on_cpus)

    def add_node(self, cpus: int, resources: Dict[str, float],
                 on_cpus: Optional[Sequence[int]] = None) -> subprocess.Popen:
        """A node joining the cluster, declaring `cpus` and `resources`, its processes pinned to `on_cpus` (None:
        any of this machine's); its `ray start` process (`remove_node` ends it)."""
        return self._start(f"--address={self.address}", f"--num-cpus={cpus}", "--resources", json.dumps(resources),
                           on_cpus=on_cpus)

    def remove_node(self, node: subprocess.Popen) -> None:
        """The node goes away: its `ray start` ends, and with it the node's raylet and the workers on it."""
        node.send_signal(signal.SIGTERM)
        node.wait(timeout=60)
        self.nodes.remove(node)

    def _start(self, *args: str, on_cpus: Optional[Sequence[int]], attempts: int = 2) -> subprocess.Popen:
        """One `ray start --block`, returning once its node runs (the command says so, then blocks).
        A node that timed out registering (an overloaded machine) is started once more."""
        pin = (lambda: os.sched_setaffinity(0, on_cpus)) if on_cpus is not None else None
        for attempt in range(attempts):
            log = Path(self.temp_dir, f"ray-start-{len(self.nodes)}-{attempt}.log")
            node = subprocess.Popen(
                [*RAY, "start", "--block", *args, f"--temp-dir={self.temp_dir}", "--object-store-memory=100000000",
                 f"--dashboard-agent-listen-port={free_port()}", "--disable-usage-stats"],
                env=ENV, stdout=log.open("w"), stderr=subprocess.STDOUT, preexec_fn=pin)
            while "block forever" not in log.read_text() and node.poll() is None:
                time.sleep(0.2)
            if node.poll() is None:
                self.nodes.append(node)
                return node
        raise RuntimeError(f"`ray start {' '.join(args)}` failed:\n{log.read_text()}")

    def stop(self) -> None:
        for node in reversed(self.nodes):
            node.send_signal(signal.SIGTERM)  # `ray start --block` stops its node's processes on SIGTERM
        for node in reversed(self.nodes):
            try:
                node.wait(timeout=60)
            except subprocess.TimeoutExpired:
                node.kill()
        for process in psutil.process_iter(["cmdline"]):  # anything of theirs still alive (by our temp dir)
            if any(self.temp_dir in part for part in process.info["cmdline"] or []):
                process.kill()
        shutil.rmtree(self.temp_dir, ignore_errors=True)

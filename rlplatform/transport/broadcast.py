"""Weight broadcast: learner rank 0 streams each new version to every rollout worker over one
torch.distributed group set up once for the policy (gloo on CPU, nccl on GPU; the same code runs both).

A round is announced on Redis first: the version and its plan (each weight's name, dtype, shape and
place in a bucket) go to every receiver's inbox list. The weights then follow as raw bytes packed in
buckets of at most `bucket_mb`, one broadcast each. Receivers wait on their inbox on a background
thread, take part in the round, and hold the newest weights until the decode loop takes them.
"""

from __future__ import annotations

import json
import threading
from dataclasses import KW_ONLY, asdict, dataclass
from datetime import timedelta
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from rlplatform.transport.weight_deltas import combine
from rlplatform.transport.weights import unique_weights

GROUP_TIMEOUT = timedelta(minutes=10)  # a round (or the set-up) that takes longer fails instead of hanging
INBOX_WAIT_S = 1  # how long a receiver blocks on its inbox before checking whether it should stop
ALIGN = 16  # each weight starts at a multiple of this many bytes in its bucket, so it views as its own dtype


@dataclass
class Entry:
    """Where one weight travels: bytes [offset, offset + nbytes) of bucket `bucket`."""
    name: str
    dtype: str  # torch dtype name, e.g. "bfloat16"
    shape: List[int]
    bucket: int
    offset: int
    _: KW_ONLY
    nbytes: int


def open_group(host: str, port: int, rank: int, world_size: int, backend: str) -> dist.ProcessGroup:
    """A process group of its own (not the default one, which DeepSpeed or vLLM may hold): rank 0,
    learner rank 0, hosts the rendezvous store at host:port."""
    store = dist.TCPStore(host, port, world_size, is_master=rank == 0, timeout=GROUP_TIMEOUT)
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = GROUP_TIMEOUT
        return dist.ProcessGroupNCCL(store, rank, world_size, options)
    return dist.ProcessGroupGloo(store, rank, world_size, GROUP_TIMEOUT)


def inbox(version_key: str, rank: int) -> str:
    """The Redis list where receiver `rank` finds each round's announcement."""
    return f"{version_key}:inbox:{rank}"


def plan_buckets(state_dict: Dict[str, torch.Tensor], bucket_bytes: int) -> List[Entry]:
    """Weights in order, packed into buckets of at most `bucket_bytes` (a larger weight gets its own)."""
    entries, bucket, offset = [], 0, 0
    for name, tensor in state_dict.items():
        nbytes = tensor.numel() * tensor.element_size()
        offset = -(-offset // ALIGN) * ALIGN
        if offset and offset + nbytes > bucket_bytes:
            bucket, offset = bucket + 1, 0
        entries.append(Entry(name, str(tensor.dtype).removeprefix("torch."), list(tensor.shape), bucket, offset,
                             nbytes=nbytes))
        offset += nbytes
    return entries


def pack(weights: Dict[str, torch.Tensor], entries: List[Entry], bucket: int) -> torch.Tensor:
    """The bytes of bucket `bucket`: each of its weights at its offset."""
    members = [e for e in entries if e.bucket == bucket]
    buffer = torch.empty(members[-1].offset + members[-1].nbytes, dtype=torch.uint8,
                         device=weights[members[0].name].device)
    for e in members:
        buffer[e.offset:e.offset + e.nbytes].copy_(weights[e.name].reshape(-1).view(torch.uint8))
    return buffer


def unpack(buffer: torch.Tensor, entries: List[Entry], bucket: int) -> Dict[str, torch.Tensor]:
    """The weights of bucket `bucket`, viewing `buffer` (no copy)."""
    return {e.name: buffer[e.offset:e.offset + e.nbytes].view(getattr(torch, e.dtype)).reshape(e.shape)
            for e in entries if e.bucket == bucket}


def _bucket_sizes(entries: List[Entry]) -> List[int]:
    sizes: Dict[int, int] = {}
    for e in entries:
        sizes[e.bucket] = max(sizes.get(e.bucket, 0), e.offset + e.nbytes)
    return [sizes[b] for b in sorted(sizes)]


class BroadcastSender:
    """Learner rank 0's end: announces each version on Redis, then broadcasts its buckets."""

    def __init__(self, group: dist.ProcessGroup, client, version_key: str, bucket_bytes: int) -> None:
        self.group, self.client, self.bucket_bytes = group, client, bucket_bytes
        self.inboxes = [inbox(version_key, rank) for rank in range(1, group.size())]

    def send(self, state_dict: Dict[str, torch.Tensor], version: int) -> None:
        weights = {name: t.detach().contiguous() for name, t in unique_weights(state_dict).items()}
        entries = plan_buckets(weights, self.bucket_bytes)
        message = json.dumps({"version": version, "entries": [asdict(e) for e in entries]})
        pipe = self.client.pipeline()
        for key in self.inboxes:
            pipe.rpush(key, message)
        pipe.execute()
        device = next(iter(weights.values())).device
        for bucket in range(len(_bucket_sizes(entries))):
            self.group.broadcast([pack(weights, entries, bucket)], _root()).wait()
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # the buffers stay alive until every bucket is sent


class BroadcastReceiver:
    """A rollout worker's end: receives every round on a daemon thread and keeps the newest weights (the
    rounds since the last `take`, folded into one)."""

    def __init__(self, group: dist.ProcessGroup, client, version_key: str, device: torch.device) -> None:
        self.group, self.client, self.device = group, client, device
        self.inbox = inbox(version_key, group.rank())
        self.error: Optional[BaseException] = None  # what stopped the thread, raised by `take`
        self._latest: Optional[Tuple[int, Dict[str, torch.Tensor]]] = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="weight-broadcast-receiver", daemon=True)
        self._thread.start()

    def take(self) -> Optional[Tuple[int, Dict[str, torch.Tensor]]]:
        """(version, weights) of the newest round received since the last `take`, else None; the
        receiver lets go of them, so only the engine holds a copy once they are loaded."""
        if self.error is not None:
            raise RuntimeError(f"the weight broadcast receiver stopped: {self.error}") from self.error
        with self._lock:
            latest, self._latest = self._latest, None
            return latest

    def close(self) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        try:
            while not self._stop.is_set():
                popped = self.client.blpop([self.inbox], timeout=INBOX_WAIT_S)
                if popped is not None:
                    version, weights = self._receive(json.loads(popped[1]))
                    with self._lock:  # folded into a round not taken yet (a delta carries only its changes)
                        self._latest = version, combine(self._latest and self._latest[1], weights)
        except BaseException as err:  # noqa: BLE001 - kept for the decode loop to raise
            self.error = err

    def _receive(self, message: Dict) -> Tuple[int, Dict[str, torch.Tensor]]:
        entries = [Entry(**e) for e in message["entries"]]
        weights = {}
        for bucket, size in enumerate(_bucket_sizes(entries)):
            buffer = torch.empty(size, dtype=torch.uint8, device=self.device)
            self.group.broadcast([buffer], _root()).wait()
            weights.update(unpack(buffer, entries, bucket))
        if self.device.type == "cuda":
            torch.cuda.current_stream().synchronize()
        return message["version"], weights


def _root() -> dist.BroadcastOptions:
    options = dist.BroadcastOptions()
    options.rootRank = 0
    return options

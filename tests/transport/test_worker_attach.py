"""Attach requests on a real redis-server: what `rlp rollout-worker` asks and holds, and what the job reads, answers
and watches. The job attaching the workers on a real cluster is tests/job/test_multinode.py's."""

from __future__ import annotations

import time
import uuid

import pytest

from rlplatform.transport.keys import JobKeys
from rlplatform.transport.samples import WireFormatError
from rlplatform.transport.side_channels import AttachAnswer, AttachRequest
from rlplatform.transport import worker_attach
from rlplatform.transport.worker_attach import AttachLease, AttachRequests


def test_a_request_is_read_once_answered_and_held_until_released(redis_client):
    keys = JobKeys(f"attach-{uuid.uuid4().hex[:8]}")
    requests = AttachRequests(redis_client, keys)
    assert requests.new() == ([], [])
    lease = AttachLease.ask(redis_client, keys, policy="", node_id="", node_ip="10.0.0.7", workers=2)
    [request], malformed = requests.new()
    assert request == lease.request and request.node_ip == "10.0.0.7" and request.workers == 2 and not malformed
    assert requests.new() == ([], [])  # each request is read once
    assert lease.answer() is None and requests.held(request) and lease.renew()
    requests.answer(request, AttachAnswer(("job-policy-rollout-3", "job-policy-rollout-4")))
    assert lease.answer() == AttachAnswer(("job-policy-rollout-3", "job-policy-rollout-4"), "")
    lease.release()
    assert not requests.held(request)


def test_a_lease_lapses_when_its_command_stops_renewing_it(redis_client, monkeypatch):
    monkeypatch.setattr(worker_attach, "LEASE_S", 0.2)
    keys = JobKeys(f"attach-{uuid.uuid4().hex[:8]}")
    lease = AttachLease.ask(redis_client, keys, policy="p", node_id="abc", node_ip="", workers=1)
    requests = AttachRequests(redis_client, keys)
    [request], _ = requests.new()
    assert requests.held(request)
    deadline = time.monotonic() + 10
    while requests.held(request) and time.monotonic() < deadline:  # the command's machine went away: no renewal
        time.sleep(0.05)
    assert not requests.held(request)
    assert not lease.renew() and not requests.held(request)  # the command learns it; the lease is not taken back


def test_an_entry_that_is_not_a_request_is_named_and_passed_over(redis_client):
    keys = JobKeys(f"attach-{uuid.uuid4().hex[:8]}")
    redis_client.xadd(keys.attach_requests, {"request": "r1", "policy": "", "node_id": "", "node_ip": "",
                                             "workers": "two"})
    AttachLease.ask(redis_client, keys, policy="", node_id="n", node_ip="", workers=1)
    [request], [line] = AttachRequests(redis_client, keys).new()
    assert request.node_id == "n"
    assert line.startswith("attach request ") and "'workers' is not an integer: 'two'" in line


def test_a_refusal_travels_with_its_reason():
    answer = AttachAnswer((), "the job has no policy 'x' (its policies: policy)")
    assert AttachAnswer.of({k.encode(): str(v).encode() for k, v in answer.fields().items()}) == answer
    with pytest.raises(WireFormatError, match="'refused'"):
        AttachAnswer.of({b"workers": b""})
    with pytest.raises(WireFormatError, match="'node_ip'"):
        AttachRequest.of({b"request": b"r", b"policy": b"", b"node_id": b"", b"workers": b"1"})

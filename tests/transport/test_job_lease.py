"""A job's name on a shared Redis belongs to one live job: a second job of the name refuses before it touches
a key (the live job's queue and status stay), the lease survives the job's own reset, and a job killed
outright frees its name within the lease's TTL, at once to a job on its machine. Each run's keys are its own: a later run of the name
resets its own keys only, and is the run the name leads to."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from rlplatform.config import ConfigError
from rlplatform.transport.job_lease import JobLease, live_job_message, newest_run
from rlplatform.transport.keys import JobKeys, NameKeys, run_scope
from rlplatform.transport.reward_queue import RewardQueue
from rlplatform.transport.run_keys import end_run, start_run

HOLD = ("import sys, time\nfrom rlplatform.transport.job_lease import JobLease\n"
        "from rlplatform.transport.redis_server import connect\n"
        "JobLease(connect(sys.argv[1]), 'shared', 'a1', '/runs/a', ttl_s=1.0).__enter__()\nprint('held', flush=True)\n"
        "time.sleep(120)\n")


def test_a_second_job_of_a_live_name_refuses_and_leaves_its_keys_alone(redis_client, tmp_path):
    live = RewardQueue(redis_client, run_scope("shared", "a1"))
    with JobLease(redis_client, "shared", "a1", str(tmp_path / "a")):
        start_run(redis_client, live.keys.run, live.bound())  # the live job's own start keeps its lease
        live.create_group()
        live.client.xadd(live.keys.requests, {"sample": b"in flight"})
        live.client.hset(live.keys.status, "stage", "rl")
        assert f"{tmp_path / 'a'}" in live_job_message(redis_client, "shared")
        with pytest.raises(ConfigError, match=f"a job named 'shared' is running on this Redis .*{tmp_path / 'a'}"):
            with JobLease(redis_client, "shared", "b1", str(tmp_path / "b")):
                pass
        assert newest_run(redis_client, "shared") == live.keys.run  # the refused run did not take the name
        assert redis_client.xlen(live.keys.requests) == 1 and redis_client.hget(live.keys.status, "stage") == b"rl"
        end_run(redis_client, live.keys.run)  # its end keeps the lease until the job gives it back
        assert live_job_message(redis_client, "shared") is not None
    assert live_job_message(redis_client, "shared") is None  # given back at the end
    with JobLease(redis_client, "shared", "b1", str(tmp_path / "b")):
        assert live_job_message(redis_client, "other") is None  # names are leased one by one


def test_a_job_killed_outright_frees_its_name_within_the_ttl(redis_server, redis_client, tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", HOLD, redis_server], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        renewals, left_ms, deadline = 0, redis_client.pttl(NameKeys("shared").owner), time.monotonic() + 30
        while renewals < 3:  # a third of the TTL each: together the lease outlived its first TTL
            assert time.monotonic() < deadline, "the holder's thread does not renew its lease"
            now_ms = redis_client.pttl(NameKeys("shared").owner)
            renewals += now_ms > left_ms
            left_ms = now_ms
            time.sleep(0.02)
        assert "/runs/a" in live_job_message(redis_client, "shared")
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    deadline = time.time() + 5
    while live_job_message(redis_client, "shared") is not None:
        assert time.time() < deadline, "a killed job's lease never expired"
        time.sleep(0.1)
    with JobLease(redis_client, "shared", "b1", str(tmp_path / "b")):
        pass


def test_a_holder_on_this_machine_whose_process_is_gone_gives_way_at_once(redis_client, tmp_path):
    """As a job leaves its lease whose Redis did not answer as it ended: the next job of the name on the machine
    takes it without waiting out the TTL; a holder still alive, or on another machine, keeps it."""
    ended = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    owner = NameKeys("shared").owner
    for holder, taken in ((f"{socket.gethostname()} pid {ended.stdout.strip()}, /runs/a [1]", True),
                          (f"{socket.gethostname()} pid {os.getpid()}, /runs/a [2]", False),
                          (f"elsewhere pid {ended.stdout.strip()}, /runs/a [3]", False)):
        redis_client.set(owner, holder, px=60_000)
        assert (live_job_message(redis_client, "shared") is None) == taken  # what `rlp run` checks before it starts
        if taken:
            with JobLease(redis_client, "shared", "b1", str(tmp_path / "b")):
                assert str(tmp_path / "b") in live_job_message(redis_client, "shared")
            assert newest_run(redis_client, "shared") == run_scope("shared", "b1")
        else:
            with pytest.raises(ConfigError, match="is running on this Redis"):
                JobLease(redis_client, "shared", "b1", str(tmp_path / "b")).__enter__()
            assert redis_client.get(owner).decode() == holder


def test_a_later_run_of_the_name_resets_its_own_keys_only_and_the_name_leads_to_it(redis_client, tmp_path):
    earlier = RewardQueue(redis_client, run_scope("shared", "a1"))
    with JobLease(redis_client, "shared", "a1", str(tmp_path / "a")):
        start_run(redis_client, earlier.keys.run, earlier.bound())
        earlier.create_group()
        earlier.client.xadd(earlier.keys.requests, {"sample": b"in flight"})  # killed outright: its keys stay
        earlier.client.hset(earlier.keys.status, "stage", "rl")
    keys_before = sorted(redis_client.scan_iter(match=JobKeys(run_scope("shared", "a1")).pattern))
    assert newest_run(redis_client, "shared") == "shared:a1"
    later = RewardQueue(redis_client, run_scope("shared", "b2"))
    with JobLease(redis_client, "shared", "b2", str(tmp_path / "b")):
        assert newest_run(redis_client, "shared") == "shared:b2"  # standalone workers and `rlp status` find it
        start_run(redis_client, later.keys.run, later.bound())
        later.create_group()
        later.client.xadd(later.keys.requests, {"sample": b"the later run's"})
        later.request_stop()
        end_run(redis_client, later.keys.run)
    assert sorted(redis_client.scan_iter(match=JobKeys(run_scope("shared", "a1")).pattern)) == keys_before
    assert redis_client.xlen(earlier.keys.requests) == 1 and redis_client.hget(earlier.keys.status, "stage") == b"rl"
    assert not earlier.stop_requested()  # the later run's stop flag is its own
    assert newest_run(redis_client, "shared") == "shared:b2" and newest_run(redis_client, "other") is None

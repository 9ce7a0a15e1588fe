"""Published weight versions on a real redis-server: the key the generation loop polls, and the announcements an
idle rollout worker blocks on."""

from __future__ import annotations

import threading
import time
import uuid

from rlplatform.transport.redis_server import connect
from rlplatform.transport.keys import PolicyKeys
from rlplatform.transport.versions import ANNOUNCEMENTS_KEPT, VersionAnnouncements, publish_version


def test_a_publish_sets_the_newest_version_and_wakes_a_waiting_reader(redis_server, redis_client):
    keys = PolicyKeys(f"versions-{uuid.uuid4().hex[:8]}", "policy")
    reader = VersionAnnouncements(connect(redis_server), keys)
    assert reader.wait(0.01) is None  # nothing published yet
    for version in (1, 2, 3):
        publish_version(redis_client, keys, version)
    assert int(redis_client.get(keys.version)) == 3
    assert reader.wait(0.01) == 3  # those made before the wait: the newest
    assert reader.wait(0.01) is None  # each announcement is heard once
    threading.Timer(0.2, publish_version, (redis_client, keys, 4)).start()
    started = time.monotonic()
    assert reader.wait(30.0) == 4 and time.monotonic() - started < 15  # woken by the publish, not timed out


def test_an_announcement_that_is_not_one_is_passed_over(redis_client):
    keys = PolicyKeys(f"versions-{uuid.uuid4().hex[:8]}", "policy")
    reader = VersionAnnouncements(redis_client, keys)
    redis_client.xadd(keys.versions, {"version": "latest"})
    assert reader.wait(0.01) is None
    publish_version(redis_client, keys, 5)
    redis_client.xadd(keys.versions, {"versoin": 6})
    assert reader.wait(0.01) == 5


def test_announcements_stay_few_however_many_versions_are_published(redis_client):
    keys = PolicyKeys(f"versions-{uuid.uuid4().hex[:8]}", "policy")
    for version in range(1, 500):
        publish_version(redis_client, keys, version)
    assert redis_client.xlen(keys.versions) < 2 * ANNOUNCEMENTS_KEPT + 100  # trimmed approximately, as Redis does
    assert VersionAnnouncements(redis_client, keys).wait(0.01) == 499

"""Published weight versions on Redis: where the controller says a new version is ready and rollout workers hear it.

The newest version is a plain key (`PolicyKeys.version`), which the generation loop reads with its stop flag.
Each publish is also announced on a short stream (`PolicyKeys.versions`): a worker with nothing to decode
blocks on it, so it starts on the new weights the moment they are published instead of on its next poll.
"""

from __future__ import annotations

from typing import Dict, Optional

import redis

from rlplatform.transport.keys import PolicyKeys
from rlplatform.transport.samples import WireFormatError
from rlplatform.transport.side_channels import VersionAnnounced

ANNOUNCEMENTS_KEPT = 16  # stream entries kept (approximately): a reader only ever needs the newest


def publish_version(client: redis.Redis, keys: PolicyKeys, version: int) -> None:
    """Make `version` the policy's newest and announce it, in one round trip."""
    client.pipeline(transaction=False).set(keys.version, version) \
        .xadd(keys.versions, VersionAnnounced(version).fields(), maxlen=ANNOUNCEMENTS_KEPT, approximate=True).execute()


class VersionAnnouncements:
    """One reader's view of the announcements: each call returns those it has not seen."""

    def __init__(self, client: redis.Redis, keys: PolicyKeys) -> None:
        self.client, self.stream = client, keys.versions
        self._seen = "0-0"  # the newest entry read; the first wait returns the announcements already there

    def wait(self, timeout_s: float) -> Optional[int]:
        """The newest version announced since the last call, waiting up to `timeout_s` for one; None if none came."""
        reply = self.client.xread({self.stream: self._seen}, block=max(1, round(timeout_s * 1000)))
        if not reply:
            return None
        entries = reply[0][1]
        self._seen = entries[-1][0]
        versions = [announced.version for announced in map(_announced, (fields for _, fields in entries)) if announced]
        return max(versions, default=None)


def _announced(fields: Dict[bytes, bytes]) -> Optional[VersionAnnounced]:
    """The announcement, or None for an entry that is not one: it carries nothing the version key does not."""
    try:
        return VersionAnnounced.of(fields)
    except WireFormatError:
        return None

"""Rules with one owner, checked on the source: Redis key names are formatted in `transport/keys.py` alone, and a
weight transport is built from the config only by the job's plan (and the transport package)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("rlplatform", "actors", "learners", "rewards")


def sources():
    return [path for package in PACKAGES for path in (ROOT / package).rglob("*.py")]


@pytest.mark.parametrize("rule, pattern, owners", [
    ("a Redis key is formatted", r"""["']rlp:\S""", {"rlplatform/transport/keys.py"}),
    ("a weight transport is built from the config", r"\bweight_transport\(",
     {"rlplatform/job/placement.py", "rlplatform/transport/weight_transports.py"}),
])
def test_only_the_owner_does_it(rule, pattern, owners):
    found = {str(path.relative_to(ROOT)) for path in sources() if re.search(pattern, path.read_text())}
    assert found <= owners, f"{rule} outside {sorted(owners)}: {sorted(found - owners)}"
    assert found, f"the owner no longer matches {pattern!r}: the rule checks nothing"

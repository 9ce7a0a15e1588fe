"""Rules checked on the source: Redis key names are formatted in `transport/keys.py` alone, a weight transport is
built from the config only by the job's plan (and the transport package), and definitions of more than five
parameters take the rest by keyword."""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import List

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


# signatures set from outside: transformers' attention interface, autograd's forward, verifiers' Harness.launch
# (called positionally) and the sandbox child's command line
SET_FROM_OUTSIDE = {("rlplatform/devices.py", "sdpa_sharing_kv_heads_on_cpu"), ("learners/head_scores.py", "forward"),
                    ("rlplatform/envs/verifiers_harness.py", "launch"), ("rewards/sandbox/child.py", "main")}


def positional_past_five(path: Path) -> List[str]:
    """The functions and dataclasses in `path` that take more than five parameters by position."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names = [a.arg for a in node.args.posonlyargs + node.args.args if a.arg not in ("self", "cls")]
            if len(names) > 5:
                found.append(node.name)
        elif isinstance(node, ast.ClassDef) and any("dataclass" in ast.unparse(d) for d in node.decorator_list):
            fields = []
            for statement in node.body:
                if isinstance(statement, ast.AnnAssign):
                    if "KW_ONLY" in ast.unparse(statement.annotation):
                        break
                    if "ClassVar" not in ast.unparse(statement.annotation):
                        fields.append(statement)
            if len(fields) > 5 and not any("kw_only=True" in ast.unparse(d) for d in node.decorator_list):
                found.append(node.name)
    return found


def test_more_than_five_parameters_are_taken_by_keyword():
    found = {(str(path.relative_to(ROOT)), name) for path in sources() for name in positional_past_five(path)}
    assert found <= SET_FROM_OUTSIDE, f"more than five parameters by position: {sorted(found - SET_FROM_OUTSIDE)}"
    assert found == SET_FROM_OUTSIDE, f"no longer set from outside: {sorted(SET_FROM_OUTSIDE - found)}"

"""Where a job's own code comes in: the modules its `imports` list (which register rewards and
tools), `package.module:attribute` paths (rewards, tools, environments) and installed plugins'
entry points. Each import finds modules in the working directory, as `python -m` does.
"""

from __future__ import annotations

import importlib
import os
import sys
from importlib.metadata import entry_points
from typing import Any, Callable, Dict, List


def importable_from_cwd() -> None:
    """Like `python -m`: modules in the working directory import (the `rlp` script's own
    directory is what Python puts on sys.path otherwise)."""
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())


def import_modules(modules: List[str]) -> None:
    """Import the job's `imports`, so the rewards and tools they register exist in this process."""
    importable_from_cwd()
    for module in modules:
        importlib.import_module(module)


def import_callable(path: str, kind: str, error: type) -> Callable:
    """The callable a `package.module:attribute` path names, else `error` saying why (`kind`: what it is
    for, as the message names it)."""
    module_name, _, attribute = path.partition(":")
    importable_from_cwd()
    try:
        fn = getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError) as err:
        raise error(f"cannot import {kind} '{path}': {err}") from None
    if not callable(fn):
        raise error(f"'{path}' is not a function")
    return fn


def entry_points_of(group: str) -> Dict[str, Any]:
    """Installed plugins' entry points of `group`, by name."""
    return {ep.name: ep for ep in entry_points(group=group)}

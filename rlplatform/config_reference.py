"""The configuration reference (docs/config-reference.md), made from the schema itself: every key a job YAML may
set, from `JobConfig` down, with its default, the values it takes and the comment beside its field in
rlplatform/config.py. `python -m rlplatform.config_reference` prints the page; tests/test_docs.py checks that the
page in docs/ is the one the schema makes.
"""

from __future__ import annotations

import dataclasses
import inspect
import io
import tokenize
import typing
from typing import Any, Dict, Iterator, List, Tuple

from rlplatform import config as schema

HEADER = """# Configuration reference

Every key a job YAML (or a `key=value` override) may set, with its default and what it sets: the schema of
`rlplatform/config.py`, made into this page by `python -m rlplatform.config_reference > docs/config-reference.md`
(`tests/test_docs.py` checks that the page is the schema's). `rewards[]`, `env.tools[]`, `monitoring.alerts[]` and
`policies[]` are lists of entries with the keys shown; a `policies[]` entry's sections start from the top-level
ones. The walk-through of a job is [Jobs and configuration](jobs-and-config.md).
"""


def field_comments(cls: type) -> Dict[str, str]:
    """Each field of dataclass `cls` by name -> the comment on its line, or else the comment lines just above it."""
    source = inspect.getsource(cls)
    comments: Dict[str, str] = {}
    above: List[str] = []
    line_field: Dict[int, str] = {}
    tokens = list(tokenize.generate_tokens(io.StringIO(source).readline))
    for i, token in enumerate(tokens):
        if token.type == tokenize.NAME and token.start[1] == 4 and i + 1 < len(tokens) \
                and tokens[i + 1].string == ":" and token.start[0] not in line_field:
            line_field[token.start[0]] = token.string
            if above:
                comments[token.string] = " ".join(above)
            above = []
        elif token.type == tokenize.COMMENT:
            text = token.string.lstrip("#").strip()
            if token.start[0] in line_field:
                comments[line_field[token.start[0]]] = text
            elif token.start[1] == 4:
                above.append(text)
        elif token.type == tokenize.NEWLINE and token.start[0] not in line_field:
            above = []
    return comments


def _entry_class(annotation: Any) -> Any:
    """The dataclass a `List[...]` field holds entries of, else None."""
    if typing.get_origin(annotation) in (list, List):
        (entry,) = typing.get_args(annotation)
        return entry if dataclasses.is_dataclass(entry) else None
    return None


def keys(cls: type, prefix: str = "", skip: Tuple[str, ...] = ()) -> Iterator[Tuple[str, Any, str]]:
    """(key, its field, its comment) for every key under dataclass `cls` but those in `skip`, sections and list
    entries walked into."""
    comments, hints = field_comments(cls), typing.get_type_hints(cls)
    for f in (f for f in dataclasses.fields(cls) if f.name not in skip):
        name = prefix + f.name
        value = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        entry = _entry_class(hints[f.name])
        if dataclasses.is_dataclass(value):
            yield from keys(type(value), name + ".")
        elif entry is not None:
            yield name, f, comments.get(f.name, "")
            # a policy entry's sections are the top level's; its own keys (name, distill) are listed
            yield from keys(entry, name + "[].", schema.POLICY_SECTIONS if entry is schema.PolicyConfig else ())
        else:
            yield name, f, comments.get(f.name, "")


def _default(f: dataclasses.Field) -> str:
    value = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
    if isinstance(value, list) and value and dataclasses.is_dataclass(value[0]):
        return "`[" + ", ".join(_entry(v) for v in value) + "]`"
    if value is None:
        return "unset"
    if isinstance(value, str):
        return f"`{value}`" if value else "`''`"
    return f"`{value!r}`"


def _entry(entry: Any) -> str:
    """A list entry as YAML writes it inline, with the keys whose value is not their default."""
    given = [(f.name, getattr(entry, f.name)) for f in dataclasses.fields(entry)
             if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
             or getattr(entry, f.name) != (f.default if f.default is not dataclasses.MISSING else f.default_factory())]
    return "{" + ", ".join(f"{name}: {value}" for name, value in given) + "}"


def _values(f: dataclasses.Field) -> str:
    if "choices" in f.metadata:
        return ", ".join(f"`{choice}`" for choice in f.metadata["choices"])
    if "at_least" in f.metadata:
        return f">= {f.metadata['at_least']:g}"
    if "above" in f.metadata:
        return f"> {f.metadata['above']:g}"
    return ""


def reference_page() -> str:
    """The page: one table per top-level section (the job's own keys first)."""
    rows: Dict[str, List[str]] = {}
    for name, f, comment in keys(schema.JobConfig):
        section = name.split(".")[0].split("[")[0] if "." in name or "[" in name else ""
        cell = comment.replace("|", "\\|")
        rows.setdefault(section, []).append(f"| `{name}` | {_default(f)} | {_values(f)} | {cell} |")
    parts = [HEADER]
    for section, lines in rows.items():
        parts.append(f"## {f'`{section}`' if section else 'The job'}\n\n| key | default | takes | what it sets |\n"
                     f"|---|---|---|---|\n" + "\n".join(lines) + "\n")
    return "\n".join(parts)


if __name__ == "__main__":
    print(reference_page(), end="")

"""The docs: README.md and docs/*.md. The pages build with `mkdocs build --strict` (no broken link or
anchor), every page is in mkdocs.yml's nav and in the README's table, and every command their shell
blocks show is real: each `rlp` command parses with the CLI's own parser, every `configs/*.yaml` and
`examples/*` path a shell line names exists, and every config an `rlp` command names passes
`rlp validate`."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Tuple

import pytest
import yaml

from rlplatform.cli import build_parser

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
DOCS = REPO / "docs"
PAGES = [README, *sorted(DOCS.glob("*.md"))]
SHELL_LANGUAGES = {"bash", "sh", "shell", "console"}
FENCE = re.compile(r"^\s*```(\S*)\s*$")
REPO_PATH = re.compile(r"(?<![\w./-])(?:\./)?((?:configs/[\w./-]+\.yaml)|(?:examples/[\w./-]*[\w-]))")
COMMAND_SEPARATORS = {"&&", "||", ";", "|", "&"}
ENV_ASSIGNMENT = re.compile(r"[A-Za-z_]\w*=")
CONFIG_FILE = re.compile(r"[\w./-]+\.ya?ml")  # a job config an `rlp` command names (not a key=value)
# Configs whose files a command in the docs writes first: that command as documented, and the arguments
# that make it small here. It runs in a scratch directory, where the config's relative paths then find
# its output, and the config is validated from there.
PREPARED_BY: Dict[str, Tuple[str, List[str]]] = {
    "configs/chat_math.yaml": ("python examples/make_chat_model.py runs/chat_model",
                               ["--pretrain-steps", "1", "--train-rows", "200", "--test-rows", "20"]),
}
# argv: a config, then a script and its arguments; runs the script as `python SCRIPT ARGUMENTS` would,
# then `rlp validate CONFIG`
VALIDATE_EACH = """
import contextlib, io, json, sys, traceback
from rlplatform.cli import main
results = {}
for config in sys.argv[1:]:
    said = io.StringIO()
    with contextlib.redirect_stdout(said), contextlib.redirect_stderr(said):
        try:
            code = main(["validate", config])
        except BaseException:
            code, _ = 1, traceback.print_exc()
    results[config] = [code, said.getvalue()]
print(json.dumps(results))
"""
PREPARE_THEN_VALIDATE = """
import runpy, sys
from rlplatform.cli import main
config, *command = sys.argv[1:]
sys.argv = command
runpy.run_path(command[0], run_name="__main__")
sys.exit(main(["validate", config]))
"""


def shell_lines(page: Path) -> List[Tuple[str, str]]:
    """(`page:line`, text) of every line inside the page's fenced shell blocks."""
    found, language = [], None
    for number, line in enumerate(page.read_text().splitlines(), start=1):
        fence = FENCE.match(line)
        if fence:
            language = None if language is not None else fence.group(1)
        elif language in SHELL_LANGUAGES:
            found.append((f"{page.relative_to(REPO)}:{number}", line.strip()))
    return found


def commands_of(line: str) -> List[List[str]]:
    """The words of each command on a shell line (split at `&&`, `;`, `|`), without its comment and
    without the `NAME=value` environment assignments before the command's name."""
    lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    commands: List[List[str]] = [[]]
    for word in lexer:
        if word in COMMAND_SEPARATORS:
            commands.append([])
        elif commands[-1] or not ENV_ASSIGNMENT.match(word):
            commands[-1].append(word)
    return [words for words in commands if words]


def all_shell_lines() -> List[Tuple[str, str]]:
    """`shell_lines` of every page."""
    return [found for page in PAGES for found in shell_lines(page)]


def rlp_commands() -> List[Tuple[str, List[str]]]:
    """(`page:line`, arguments after `rlp`) of every `rlp` command in the pages' shell blocks."""
    return [(where, words[1:]) for where, line in all_shell_lines() for words in commands_of(line)
            if words[0] == "rlp"]


def nav_pages(nav: list) -> List[str]:
    """Every page file a mkdocs nav lists, in sections too."""
    pages = []
    for entry in nav:
        value = next(iter(entry.values())) if isinstance(entry, dict) else entry
        pages += nav_pages(value) if isinstance(value, list) else [value]
    return pages


def validate_in_one_process(configs: List[str]) -> Dict[str, Tuple[int, str]]:
    """`rlp validate` of each config from the repository, all in one process (torch and Ray import once):
    config -> (exit code, what it printed)."""
    done = subprocess.run([sys.executable, "-c", VALIDATE_EACH, *configs], cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    return {config: tuple(result) for config, result in json.loads(done.stdout.splitlines()[-1]).items()}


def validate_prepared(config: str, scratch: Path) -> subprocess.CompletedProcess:
    """`rlp validate config` for a config in PREPARED_BY: from a scratch directory, in the process that first
    ran its documented command there (torch and transformers load once)."""
    documented, small = PREPARED_BY[config]
    _, script, *arguments = shlex.split(documented)  # `python SCRIPT ARGUMENTS`
    workdir = scratch / Path(config).stem
    workdir.mkdir()
    return subprocess.run([sys.executable, "-c", PREPARE_THEN_VALIDATE, str(REPO / config), str(REPO / script),
                           *arguments, *small], cwd=workdir, capture_output=True, text=True)


def test_site_builds_strict(tmp_path: Path) -> None:
    build = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file",
                            str(REPO / "mkdocs.yml"), "--site-dir", str(tmp_path / "site")],
                           cwd=REPO, capture_output=True, text=True)
    assert build.returncode == 0, build.stdout + build.stderr
    assert (tmp_path / "site" / "index.html").is_file()


def test_the_configuration_reference_is_the_schemas() -> None:
    """docs/config-reference.md lists every key of the schema, as `python -m rlplatform.config_reference` makes it
    (regenerate it after a change to rlplatform/config.py)."""
    from rlplatform.config import JobConfig
    from rlplatform.config_reference import keys, reference_page

    page = (DOCS / "config-reference.md").read_text()
    assert page == reference_page(), "docs/config-reference.md is stale: python -m rlplatform.config_reference > docs/config-reference.md"
    listed = [name for name, _, _ in keys(JobConfig)]
    assert {"model.num_experts", "learner.grad_clip", "env.tools[].timeout_s", "monitoring.alerts[].kind"} <= set(listed)
    assert all(f"| `{name}` |" in page for name in listed) and all(comment for _, _, comment in keys(JobConfig))


def test_every_page_is_in_the_nav_and_the_readme() -> None:
    config = yaml.safe_load((REPO / "mkdocs.yml").read_text())
    assert config["docs_dir"] == "docs"
    listed = nav_pages(config["nav"])
    pages = sorted(page.name for page in DOCS.glob("*.md"))
    assert sorted(listed) == pages, "mkdocs.yml's nav must list every page in docs/ once"
    linked = set(re.findall(r"\]\(docs/([\w-]+\.md)\)", README.read_text()))
    assert linked == set(pages), f"README.md's table misses {sorted(set(pages) - linked)}"


def test_readme_links_resolve() -> None:
    for target in re.findall(r"\]\(([^)#\s]+)", README.read_text()):
        if "://" not in target:
            assert (REPO / target).exists(), f"README.md links to {target}, which does not exist"


def test_readme_opens_with_install_test_and_quickstart_and_ci_runs_the_first_two() -> None:
    first_lines = [line for _, line in shell_lines(README)[:3]]
    commands = [commands_of(line) for line in first_lines]
    assert commands == [[["bash", "install.sh"]], [["pytest"]], [["rlp", "run", "configs/quickstart.yaml"]]]
    ci_lines = [line.strip() for line in (REPO / ".ci" / "run").read_text().splitlines()]
    assert ci_lines[-2:] == [" ".join(command) for [command] in commands[:2]]


def test_every_rlp_command_parses_with_the_cli() -> None:
    commands = rlp_commands()
    assert len(commands) > 20, "the pages' shell blocks hold the rlp commands they document"
    for where, argv in commands:
        try:
            build_parser().parse_args(argv)
        except SystemExit:
            pytest.fail(f"{where}: `rlp {' '.join(argv)}` does not parse with the rlp CLI (see above)")


def test_every_repository_path_in_a_shell_block_exists() -> None:
    named = [(where, path) for where, line in all_shell_lines() for path in REPO_PATH.findall(line)]
    assert any(path == "examples/rows.jsonl" for _, path in named)
    for where, path in named:
        assert (REPO / path).exists(), f"{where} names {path}, which does not exist"


def test_every_config_an_rlp_command_names_validates(tmp_path: Path) -> None:
    configs = sorted({word for _, argv in rlp_commands() for word in argv if CONFIG_FILE.fullmatch(word)})
    assert "configs/quickstart.yaml" in configs
    documented = {line for _, line in all_shell_lines()}
    for config, (command, _) in PREPARED_BY.items():
        assert config in configs and any(line.startswith(command) for line in documented), \
            f"PREPARED_BY lists {config}, made by `{command}`: the docs no longer show both"
    results = validate_in_one_process([config for config in configs if config not in PREPARED_BY])
    for config in PREPARED_BY:
        prepared = validate_prepared(config, tmp_path)
        results[config] = (prepared.returncode, prepared.stdout + prepared.stderr)
    failed = {config: said for config, (code, said) in results.items() if code}
    assert not failed, failed

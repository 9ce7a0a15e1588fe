"""The deployment specs under infra/: every YAML loads, every `rlp` command they run parses with the
CLI and loads its job config, every repository path they name exists, and the production Redis
config (run by a real redis-server, TLS aside) gives a job's ACL user its own keys and no others."""

from __future__ import annotations

import hashlib
import json
import re
import shlex
import socket
import subprocess
import time
from pathlib import Path

import pytest
import redis
import yaml

from rlplatform.cli import build_parser
from rlplatform.config import load_config
from rlplatform.transport.redis_server import redis_binary
from rlplatform.transport.reward_queue import RewardQueue
from rlplatform.transport.samples import Sample, ScoredSample, decode_sample

REPO = Path(__file__).resolve().parents[1]
INFRA = REPO / "infra"
SPECS = sorted(p for p in INFRA.rglob("*") if p.is_file() and p.suffix in (".yaml", ".yml"))
SCRIPTS = sorted(p for p in INFRA.rglob("*") if p.is_file() and (p.suffix == ".sbatch" or p.name == "Dockerfile"))
# what the specs' shell variables hold at run time, for parsing their commands here
VARIABLES = {"REDIS_URL": "rediss://job-cluster:secret@redis.example.org:6380/0", "head_ip": "10.0.0.5",
             "port": "26379"}
REPO_PATH = re.compile(r"\b((?:configs|infra|examples|rlplatform|actors|learners|rewards)/[\w./-]*\w)")


def strings(node) -> list:
    """Every string value in a loaded YAML document."""
    if isinstance(node, dict):
        return [s for value in node.values() for s in strings(value)]
    if isinstance(node, list):
        return [s for value in node for s in strings(value)]
    return [node] if isinstance(node, str) else []


def shell_lines(path: Path) -> list:
    """The non-comment lines of a shell script or Dockerfile."""
    return [line for line in path.read_text().splitlines() if line.strip() and not line.lstrip().startswith("#")]


def rlp_commands() -> list:
    """(file, argv after `rlp`) of every `rlp` command the specs and scripts run."""
    found = []
    texts = [(p, s) for p in SPECS for doc in yaml.safe_load_all(p.read_text()) for s in strings(doc)]
    texts += [(p, line) for p in SCRIPTS for line in shell_lines(p)]
    for path, text in texts:
        exec_form = re.match(r"(?:CMD|ENTRYPOINT|RUN)\s+(\[.*\])$", text.strip())  # a Dockerfile's JSON array
        for command in [text] if exec_form else re.split(r"&&|;|\|", text):
            words = json.loads(exec_form.group(1)) if exec_form else shlex.split(command) if "rlp" in command else []
            if "rlp" in words:
                argv = [_expand(word) for word in words[words.index("rlp") + 1:]]
                found.append((path.relative_to(REPO), argv))
    return found


def _expand(word: str) -> str:
    def value(match):
        name = match.group(1) or match.group(2)
        assert name in VARIABLES, f"the specs use ${name}; add an example value for it to VARIABLES"
        return VARIABLES[name]
    return re.sub(r"\$\{(\w+)\}|\$(\w+)", value, word)


def test_every_spec_loads_as_yaml():
    assert {p.relative_to(INFRA).as_posix() for p in SPECS} >= {"ray/cluster.yaml", "k8s/rayjob.yaml"}
    for path in SPECS:
        assert all(doc is not None for doc in yaml.safe_load_all(path.read_text())), path


def test_rlp_commands_parse_and_their_job_configs_load():
    commands = rlp_commands()
    assert {str(path) for path, _ in commands} >= {"infra/k8s/rayjob.yaml", "infra/slurm/rlplatform.sbatch",
                                                   "infra/Dockerfile"}
    for path, argv in commands:
        try:
            args = build_parser().parse_args(argv)
        except SystemExit:
            pytest.fail(f"{path}: `rlp {' '.join(argv)}` does not parse with the rlp CLI")
        if args.command in ("run", "validate"):
            assert (REPO / args.config).is_file(), f"{path}: {args.config} does not exist"
            load_config(str(REPO / args.config), args.overrides)  # override keys and values are valid


def test_every_repository_path_the_specs_name_exists():
    for path in SPECS + SCRIPTS:
        for named in REPO_PATH.findall(path.read_text()):
            assert (REPO / named).exists(), f"{path.relative_to(REPO)} names {named}, which does not exist"
    copied = [line.split()[1] for line in shell_lines(INFRA / "Dockerfile") if line.startswith("COPY ")]
    assert copied and all((REPO / source).exists() for source in copied)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture
def production_redis(tmp_path):
    """infra/redis/redis.conf run by redis-server on a plain local port (this binary may lack TLS),
    its job-quickstart user given a known password; yields (port, password)."""
    config = (INFRA / "redis" / "redis.conf").read_text()
    assert re.search(r"^port 0$", config, re.M) and re.search(r"^tls-port \d+$", config, re.M)  # TLS only
    password = "test-password"
    acl = (INFRA / "redis" / "users.acl").read_text()
    acl = re.sub(r"(user job-quickstart on #)\w+", rf"\g<1>{hashlib.sha256(password.encode()).hexdigest()}", acl)
    (tmp_path / "users.acl").write_text(acl)
    port = free_port()
    local = {"port": str(port), "bind": "127.0.0.1", "dir": str(tmp_path), "aclfile": str(tmp_path / "users.acl"),
             "maxmemory": "100mb"}
    lines = [line for line in config.splitlines() if not line.startswith(("tls-", *[f"{key} " for key in local]))]
    (tmp_path / "redis.conf").write_text("\n".join(lines + [f"{key} {value}" for key, value in local.items()]))
    server = subprocess.Popen([redis_binary(), str(tmp_path / "redis.conf")], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 30
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            assert server.poll() is None, server.stdout.read()
            assert time.monotonic() < deadline, "redis-server did not start"
            time.sleep(0.1)
    yield port, password
    server.terminate()
    server.wait(timeout=10)


def test_production_redis_gives_a_job_user_its_own_keys_only(production_redis, tmp_path):
    port, password = production_redis
    client = redis.Redis(port=port, username="job-quickstart", password=password)
    queue = RewardQueue(client, "quickstart")
    queue.create_group()
    sample = Sample("s/0", "s", "policy", "1+1=", "2", prompt_ids=[4], completion_ids=[5], behaviour_logprobs=[-0.1],
                    token_versions=[0], row={"answer": "2"})
    queue.submit([sample])
    (entry, raw), = queue.fetch("worker", count=1, block_ms=100)
    queue.store_results([(entry, ScoredSample(decode_sample(raw), 1.0, {"exact_match": 1.0}))])
    assert [r.sample_id for r in queue.read_results(block_ms=100)] == ["s/0"]
    with pytest.raises(redis.exceptions.NoPermissionError):
        client.set("rlp:cluster:status", "x")  # another job's keys
    with pytest.raises(redis.exceptions.NoPermissionError):
        client.flushall()
    with pytest.raises(redis.exceptions.AuthenticationError):
        redis.Redis(port=port).ping()  # the default user is off
    assert (tmp_path / "appendonly.aof").stat().st_size > 0  # acknowledged writes are on disk

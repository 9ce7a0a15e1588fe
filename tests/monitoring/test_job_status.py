"""The job status hash on a real Redis: a line, the silent workers and the bridges' URLs read back as the
records written; the console shows the line the status holds; a malformed field is refused by name, and
`rlp status` says so in one line."""

from __future__ import annotations

import io
import time
from pathlib import Path

import pytest

from rlplatform import cli
from rlplatform.config import load_config
from rlplatform.monitoring.job_status import NOT_YET, JobStatus, StatusLine, format_status
from rlplatform.monitoring.metrics import Metrics, ProgressLine
from rlplatform.transport.bridge_protocol import bridge_status_field
from rlplatform.transport.keys import NameKeys, run_scope
from rlplatform.transport.samples import WireFormatError

QUICKSTART = str(Path(__file__).resolve().parents[2] / "configs" / "quickstart.yaml")
URL = "http://127.0.0.1:8000/v1"


def test_a_status_reads_back_as_the_records_written(redis_client):
    status = JobStatus(redis_client, run_scope("job", "r1"))
    status.write(StatusLine("sft", "500/1500", eta_s=12.5, loss=0.62, accuracy=NOT_YET))
    status.show_silent_workers("reward worker 1 (130s)")
    redis_client.hset(status.key, bridge_status_field("policy", 3), URL)  # as a rollout worker announces its bridge
    rl = StatusLine("rl policy", "12/400", eta_s=37, reward=0.5, accuracy=0.25, samples_per_s=840.0, queue=5,
                    staleness=NOT_YET)
    status.write(rl)
    read = status.read()
    assert read.line == rl and read.line.loss is None  # SFT's loss went with its line
    assert read.line.queue == 5 and read.line.staleness == NOT_YET and read.line.eta_s == 37
    assert read.silent_workers == "reward worker 1 (130s)" and read.bridges == {("policy", 3): URL}
    assert time.time() - 5 < read.updated_at <= time.time()
    # rlp status: the line as the console showed it, then what stays beside it
    assert format_status(read, read.updated_at + 7) == (
        "stage rl policy  step 12/400  eta_s 37  reward 0.500  accuracy 0.250  samples/s 840  queue 5  staleness -  "
        f"silent_workers reward worker 1 (130s)  openai_bridge/policy/3 {URL}  (updated 7s ago)")
    status.show_silent_workers("")
    status.write(StatusLine("completed", wall_s=123.45))
    read = status.read()
    assert read.line == StatusLine("completed", wall_s=123.45) and read.silent_workers == ""
    assert format_status(read, read.updated_at).startswith("stage completed  wall_s 123.45  openai_bridge/policy/3")
    assert JobStatus(redis_client, run_scope("job", "never")).read() is None


def test_the_console_shows_the_line_the_status_holds(redis_client, tmp_path):
    config = load_config(QUICKSTART, [f"output_dir={tmp_path}", "wandb.mode=disabled"])
    metrics = Metrics(config, str(tmp_path))
    metrics.console = ProgressLine(io.StringIO())
    metrics.status = JobStatus(redis_client, run_scope("job", "r1"))
    metrics.progress(StatusLine("sft", "3/10", eta_s=4.25, loss=1.5, accuracy=0.5))
    assert metrics.console.stream.getvalue() == "stage sft  step 3/10  eta_s 4.250  loss 1.500  accuracy 0.500\n"
    assert metrics.status.read().line == StatusLine("sft", "3/10", eta_s=4.25, loss=1.5, accuracy=0.5)


@pytest.mark.parametrize("field, text, said", [
    ("reward", "high", "job status field 'reward' is not a number: 'high'"),
    ("queue", "2.5", "job status field 'queue' is not a whole number: '2.5'"),
    ("loss", NOT_YET, "job status field 'loss' is not a number: '-'"),
    ("speed", "3", "job status fields not of the progress line: speed"),
    ("updated_at", "soon", "job status field 'updated_at' is not a number: 'soon'"),
    ("openai_bridge/policy", URL, "job status field 'openai_bridge/policy' is not a bridge's URL field"),
])
def test_a_malformed_status_field_is_refused_by_name(redis_client, redis_server, capsys, field, text, said):
    status = JobStatus(redis_client, run_scope("job", "r1"))
    status.write(StatusLine("rl", "1/10"))
    redis_client.hset(status.key, field, text)
    with pytest.raises(WireFormatError) as refused:
        status.read()
    assert str(refused.value).startswith(said)
    redis_client.set(NameKeys("job").newest_run, "r1")
    assert cli.main(["status", "--redis", redis_server, "--job", "job"]) == 1
    assert capsys.readouterr().err == f"rlp: job 'job' has a status this rlp cannot read: {refused.value}\n"


def test_a_status_line_without_its_stage_is_refused(redis_client):
    status = JobStatus(redis_client, run_scope("job", "r1"))
    redis_client.hset(status.key, mapping={"step": "1/10", "updated_at": "1.0"})
    with pytest.raises(WireFormatError, match="job status line without its 'stage' field"):
        status.read()

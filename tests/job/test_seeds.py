"""`rlp run --seeds N`: a tiny job run for two seeds leaves two ordinary run directories under one parent,
and seeds.json and the console table hold each seed's figures with their mean, min, max and spread; the
figures and statistics of hand-made summaries; the sweep stops at the first seed that fails and still
writes what ran; `--seeds` with `--resume` is refused in one line; the seeds' runs share a W&B group."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import yaml

from rlplatform import cli
from rlplatform.config import ConfigError, load_config
from rlplatform.job.seeds import format_table, run_seeds, seed_figures, seed_overrides, statistics
from tests.job.conftest import TINY

QUICKSTART = str(Path(__file__).resolve().parents[2] / "configs" / "quickstart.yaml")


def summary(status: str, after_sft: float, after_rl: float, trained_per_s: float, wall_s: float) -> dict:
    """The part of a one-policy job's summary.json the seeds read."""
    return {"status": status, "wall_s": wall_s, "rl": {"trained_per_s": trained_per_s, "samples_per_s": 999.0},
            "eval": {"after_sft": {"accuracy": after_sft}, "after_rl": {"accuracy": after_rl}}}


def row(seed: int, result: dict) -> dict:
    return {"seed": seed, "run_dir": f"runs/x/x-seed-{seed}", "status": result["status"],
            "figures": seed_figures(result)}


def test_statistics_of_hand_made_summaries_leave_out_seeds_that_did_not_complete():
    rows = [row(0, summary("completed", 0.30, 0.50, 100.0, 60.0)), row(1, summary("completed", 0.40, 0.80, 80.0, 90.0)),
            row(2, summary("completed", 0.20, 0.65, 120.0, 75.0)), row(3, summary("failed", 0.0, 0.0, 1.0, 5.0))]
    assert rows[1]["figures"] == {"accuracy_after_sft": 0.40, "accuracy_after_rl": 0.80, "gain": 0.40,
                                  "trained_per_s": 80.0, "wall_s": 90.0}
    stats = statistics(rows)
    assert stats["accuracy_after_rl"] == {"n": 3, "mean": pytest.approx(0.65), "min": 0.50, "max": 0.80,
                                          "spread": pytest.approx(0.30)}
    assert stats["gain"] == {"n": 3, "mean": pytest.approx(0.35), "min": 0.20, "max": 0.45,
                             "spread": pytest.approx(0.25)}
    assert stats["trained_per_s"] == {"n": 3, "mean": 100.0, "min": 80.0, "max": 120.0, "spread": 40.0}
    assert stats["wall_s"]["mean"] == 75.0 and stats["accuracy_after_sft"]["mean"] == pytest.approx(0.30)


def test_several_policies_have_figures_each_and_only_figures_that_exist_are_shown():
    both = {"status": "completed", "wall_s": 50.0, "policies": {
        "small": {"eval": {"after_sft": {"accuracy": 0.25}, "after_rl": {"accuracy": 0.5}},
                  "rl": {"trained_per_s": 10.0}},
        "large": {"eval": {"after_rl": {"accuracy": 0.75}}},
        "no_sft": {"eval": {"before_rl": {"accuracy": 0.5}, "after_rl": {"accuracy": 0.625}}}}}
    assert seed_figures(both) == {"small/accuracy_after_sft": 0.25, "small/accuracy_after_rl": 0.5, "small/gain": 0.25,
                                  "small/trained_per_s": 10.0, "large/accuracy_after_rl": 0.75,
                                  "no_sft/accuracy_before_rl": 0.5, "no_sft/accuracy_after_rl": 0.625,
                                  "no_sft/gain": 0.125, "wall_s": 50.0}
    failed = {"status": "failed", "wall_s": 3.0}  # stopped before any evaluation
    rows = [{"seed": 0, "run_dir": "a", "status": "completed", "figures": seed_figures(both)},
            {"seed": 1, "run_dir": "b", "status": "failed", "figures": seed_figures(failed)}]
    lines = format_table({"seeds": rows, "statistics": statistics(rows)}).splitlines()
    assert lines[0].split() == ["seed", "status", "small", "after", "SFT", "small", "after", "RL", "small", "gain",
                                "small", "trained/s", "large", "after", "RL", "no_sft", "before", "RL", "no_sft",
                                "after", "RL", "no_sft", "gain", "wall", "s"]
    assert lines[1].split() == ["0", "completed", "0.250", "0.500", "0.250", "10.0", "0.750", "0.500", "0.625",
                                "0.125", "50"]
    assert lines[2].split() == ["1", "failed", "-", "-", "-", "-", "-", "-", "-", "-", "3"]
    assert lines[3].split() == ["mean", "0.250", "0.500", "0.250", "10.0", "0.750", "0.500", "0.625", "0.125",
                                "50"]  # seed 0's alone
    assert [line.split()[0] for line in lines[3:]] == ["mean", "min", "max", "spread"]


def fake_runs(codes: dict, raises: int = -1, refuses: int = -1):
    """A `run` for `run_seeds` that writes each seed's summary.json as a job would and exits with `codes[seed]`
    (0 unless given), or raises at seed `raises`, or refuses seed `refuses` before it writes anything; returns
    it and the seeds it ran."""
    ran = []

    def run(overrides, started_at):
        config = load_config(None, overrides)
        ran.append(config.seed)
        assert (started_at is None) == (len(ran) == 1)  # the first seed's start-up counts from the process's start
        if config.seed == refuses:
            raise ConfigError(f"{config.run_dir} holds checkpoints of an earlier run")
        os.makedirs(config.run_dir)
        status = "completed" if codes.get(config.seed, 0) == 0 else "failed"
        Path(config.run_dir, "summary.json").write_text(json.dumps(summary(status, 0.1, 0.1 * config.seed, 1.0, 2.0)))
        if config.seed == raises:
            raise RuntimeError("the learner died")
        return codes.get(config.seed, 0)

    return run, ran


def test_the_seeds_stop_at_the_first_that_fails_and_seeds_json_keeps_those_that_ran(tmp_path, capsys):
    config = load_config(None, [f"output_dir={tmp_path}", "name=sweep", "seed=5"])
    run, ran = fake_runs({6: 3})
    assert run_seeds(config, 4, run) == 3
    assert ran == [5, 6]
    written = json.loads(Path(tmp_path, "sweep", "seeds.json").read_text())
    assert [(r["seed"], r["status"]) for r in written["seeds"]] == [(5, "completed"), (6, "failed")]
    assert written["statistics"]["accuracy_after_rl"] == {"n": 1, "mean": 0.5, "min": 0.5, "max": 0.5, "spread": 0.0}
    assert "sweep: 1 of 4 seeds completed" in capsys.readouterr().out

    config = load_config(None, [f"output_dir={tmp_path}", "name=raised"])
    run, ran = fake_runs({}, raises=1)
    with pytest.raises(RuntimeError, match="the learner died"):  # `rlp` reports it and exits as for one run
        run_seeds(config, 3, run)
    assert ran == [0, 1]
    assert [r["seed"] for r in json.loads(Path(tmp_path, "raised", "seeds.json").read_text())["seeds"]] == [0, 1]

    config = load_config(None, [f"output_dir={tmp_path}", "name=refused"])
    earlier = Path(tmp_path, "refused", "refused-seed-1")
    earlier.mkdir(parents=True)
    (earlier / "summary.json").write_text(json.dumps(summary("completed", 0.9, 0.9, 1.0, 2.0)))
    run, ran = fake_runs({}, refuses=1)
    with pytest.raises(ConfigError):
        run_seeds(config, 3, run)
    written = json.loads(Path(tmp_path, "refused", "seeds.json").read_text())
    assert [r["seed"] for r in written["seeds"]] == [0]  # not the summary an earlier run left in seed 1's directory


def test_seeds_with_resume_is_refused_in_one_line(tmp_path, capsys):
    assert cli.main(["run", "--seeds", "2", "--resume", str(tmp_path), QUICKSTART]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--seeds" in err and "--resume" in err
    assert os.listdir(tmp_path) == []


def test_the_seeds_runs_are_one_wandb_group(tmp_path, monkeypatch):
    from rlplatform.monitoring import metrics

    given = {}
    monkeypatch.setattr(metrics.wandb, "init", lambda **kwargs: given.update(kwargs))
    config = load_config(None, ["name=sweep"])
    metrics.Metrics(load_config(None, seed_overrides(config, 4)), str(tmp_path))
    assert given["group"] == "sweep" and given["name"] == "sweep-seed-4"


def test_two_seeds_of_a_tiny_job_through_rlp_run(ray_session, tmp_path, capsys):
    code = cli.main(["run", "--seeds", "2", QUICKSTART, f"output_dir={tmp_path}", "name=pair", "seed=3", *TINY,
                     "rl.max_steps=2"])  # no evaluator: the accuracy columns' statistics are checked above
    result = capsys.readouterr()
    assert code == 0, result.err[-3000:]
    parent = tmp_path / "pair"
    assert sorted(os.listdir(parent)) == ["pair-seed-3", "pair-seed-4", "seeds.json"]
    summaries = []
    for seed in (3, 4):
        run_dir = parent / f"pair-seed-{seed}"
        config = yaml.safe_load((run_dir / "config.yaml").read_text())
        assert (config["seed"], config["name"], config["wandb"]["group"]) == (seed, f"pair-seed-{seed}", "pair")
        summaries.append(json.loads((run_dir / "summary.json").read_text()))
        assert summaries[-1]["status"] == "completed" and summaries[-1]["rl"]["steps"] == 2
        assert (run_dir / "model" / "config.json").exists()  # an ordinary run's output
    written = json.loads((parent / "seeds.json").read_text())
    assert [(r["seed"], r["status"], r["run_dir"]) for r in written["seeds"]] == [
        (3, "completed", str(parent / "pair-seed-3")), (4, "completed", str(parent / "pair-seed-4"))]
    rates = [s["rl"]["trained_per_s"] for s in summaries]
    walls = [s["wall_s"] for s in summaries]
    assert [r["figures"]["trained_per_s"] for r in written["seeds"]] == rates
    assert written["statistics"]["trained_per_s"] == {"n": 2, "mean": pytest.approx(sum(rates) / 2),
                                                      "min": min(rates), "max": max(rates),
                                                      "spread": pytest.approx(max(rates) - min(rates))}
    assert written["statistics"]["wall_s"]["mean"] == pytest.approx(sum(walls) / 2)

    table = result.out.splitlines()
    start = next(i for i, line in enumerate(table) if line.startswith("seed "))
    assert table[start].split() == ["seed", "status", "trained/s", "wall", "s"]  # the figures the runs have
    assert [line.split()[:2] for line in table[start + 1:start + 3]] == [["3", "completed"], ["4", "completed"]]
    mean = table[start + 3].split()
    assert mean[0] == "mean" and mean[1] == f"{written['statistics']['trained_per_s']['mean']:.1f}"
    assert [line.split()[0] for line in table[start + 3:start + 7]] == ["mean", "min", "max", "spread"]
    assert table[start + 7] == f"pair: 2 of 2 seeds completed, figures in {parent / 'seeds.json'}"

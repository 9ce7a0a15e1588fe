"""What the RL stage reports after each learner step: W&B metric families, the live progress
line and job status, the samples table, and alerts.

Families (logged as `<policy>/<family>/<name>`): `learning` (losses, KL, entropy, clipping,
importance weights, grad norm, lr, response length), `rewards` (total, each component, error,
timeout and filter fractions, zero-advantage groups, samples scored so far per reward reason), `async` (version, staleness, drops,
weight sync, busy fractions, queue depth, reward latency, throughput), `eval` (held-out pass@1
as accuracy, reward mean and components), `parity` (engine against learner on the tokens sampled by
the weights the learner scored them with: mean and max |Δ log-prob|, k3 KL, tokens; a numerical gap,
apart from staleness), `samples` (a table of completions every `monitoring.samples_every` steps)
and, with a multi-turn `env`, `tools` (`tool_metrics`).
"""

from __future__ import annotations

import time
from collections import deque
from typing import Callable, Deque, Dict, List, NamedTuple, Optional, Tuple

import wandb

from rlplatform.config import JobConfig, RLConfig
from rlplatform.learners.step_result import StepResult
from rlplatform.monitoring.alerts import AlertRules, StepFigures
from rlplatform.monitoring.job_status import NOT_YET, Figure, StatusLine
from rlplatform.monitoring.metrics import Metrics
from rlplatform.monitoring.parity_canary import checks_since
from rlplatform.monitoring.tool_metrics import tool_figures
from rlplatform.scheduling.buffer import Batch, has_signal
from rlplatform.transport.keys import PolicyKeys, ToolKeys
from rlplatform.transport.reward_queue import RewardQueue
from rlplatform.transport.rollout_counters import RolloutCounterHash, RolloutCounters

LEARNING_KEYS = ("loss", "pg_loss", "kl_to_reference", "entropy", "clip_fraction", "importance_weight_mean",
                 "importance_weight_max", "logprob_mismatch_abs", "grad_norm", "lr", "router_aux_loss",
                 "router_agreement", "routed_expert_bytes")
STALL_CHECK_S = 5.0
PROGRESS_EVERY_S = 30.0  # a progress line at least this often, also while no learner step ends
RATE_WINDOW_S = 10.0  # throughput is averaged over at least this much of the recent past


class TrailingRate:
    """A counter's rate over the trailing `window_s` seconds. Rollout workers report samples
    when whole groups finish, so between two close learner steps often none did: a rate over
    that interval alone would read 0 in a healthy run."""

    def __init__(self, window_s: float, now: float, total: float) -> None:
        self.window_s = window_s
        self._points: Deque[Tuple[float, float]] = deque([(now, total)])

    def update(self, now: float, total: float) -> float:
        """Record the counter's `total` at `now`; its rate since the oldest reading in the window."""
        self._points.append((now, total))
        while len(self._points) > 2 and now - self._points[1][0] >= self.window_s:
            self._points.popleft()
        since, before = self._points[0]
        return (total - before) / (now - since) if now > since else 0.0


class WorkerCounts(NamedTuple):
    """The rollout and reward workers' counters as read from Redis at `time` (the monitor's clock)."""
    time: float
    rollout: RolloutCounters  # the policy's rollout workers'
    reward: Dict[str, float]  # the job's reward workers' (busy_s, latency_s, scored, ...)


class RLMonitor:
    def __init__(self, config: JobConfig, rl: RLConfig, metrics: Metrics, queue: RewardQueue, policy: str,
                 *, keys: PolicyKeys, rollout_workers: int, clock: Callable[[], float] = time.perf_counter):
        """`clock`: seconds, for the stage's wall time, rates and when lines are due (tests pass their own)."""
        self.config, self.rl, self.metrics, self.queue, self.policy = config, rl, metrics, queue, policy
        self.keys, self.clock = keys, clock
        self.rollout_counters = RolloutCounterHash(queue.client, keys.rollout_stats)
        self.rollout_workers = rollout_workers
        self.alerts = AlertRules(config.monitoring.alerts)
        self.start = self.last_step = self.last_stall_check = self.last_line = clock()
        self.samples_seen = 0
        self.last_accuracy = None
        self.eval_history: List[Dict[str, float]] = []  # held-out accuracy by version, for the summary
        self._published: Dict[int, Tuple[float, int]] = {0: (0.0, 0)}  # version -> (stage seconds, samples seen)
        self._previous = self._worker_counters()
        self._sample_rate = TrailingRate(RATE_WINDOW_S, self._previous.time, self._previous.rollout.samples)
        self._token_rate = TrailingRate(RATE_WINDOW_S, self._previous.time, self._previous.rollout.tokens)
        self._scored = (0, 0, 0, 0)  # scored, errors, timeouts, filtered at the previous step
        self._step_scored = (0, 0)  # samples scored and reward errors since the step before
        self._tool_counters = self._episode_counters()  # at the previous step
        rollout = next(p.rollout for p in config.policy_list() if p.name == policy)
        self.decode_slots = rollout.prompts_per_batch * rl.group_size  # a worker's decode batch at its fullest
        self._learner_busy_s = 0.0
        self._first_version = 0  # the version the stage started from (a resumed one's)
        self._parity: List[Dict[str, float]] = []  # each step's parity figures, where it measured any
        self._routing: List[Dict[str, float]] = []  # a mixture-of-experts policy's router agreement and expert bytes
        teacher = config.teacher_of(next(p for p in config.policy_list() if p.name == policy))
        # on-policy distillation: the teacher's version key, and its workers' counters at the previous step
        self._teacher_version_key = PolicyKeys(queue.keys.run, teacher.name).version if teacher else None
        self._teacher_counters = self.queue.counters(keys.teacher_stats) if teacher else {}
        self._distill: List[Dict[str, float]] = []  # each step's distillation figures
        self._canary: List[Dict] = []  # the engines' parity canary checks (`parity_canary`)
        self._canary_id: Optional[str] = None  # the newest check read
        self._reward_sum = 0.0  # the trained samples' rewards, summed
        self._component_sums: Dict[str, float] = {}  # and each reward component's scores
        self._rewarded = 0  # the trained samples those sums cover

    def _worker_counters(self) -> WorkerCounts:
        return WorkerCounts(self.clock(), self.rollout_counters.read(),
                            self.queue.counters(self.queue.keys.reward_stats))

    def step(self, version: int, learner: StepResult, batch: Batch, gaps: List[int], counters,
             *, publish_s: float) -> None:
        """Report learner step `version` (just published), `learner`'s result, trained on `batch`, whose
        samples were `gaps` versions behind the weights that trained them."""
        self.samples_seen += len(batch.samples)
        self._published[version] = (self.clock() - self.start, self.samples_seen)
        families = {"learning": self._learning(learner, batch),
                    "rewards": self._rewards(batch, counters),
                    "async": self._async(version, gaps, counters, publish_s)}
        step_s = counters.learner_busy_s - self._learner_busy_s
        self._learner_busy_s = counters.learner_busy_s
        families["async"]["learner_tokens_per_s"] = learner.tokens_total / max(step_s, 1e-9)
        families["async"]["learner_model_tokens_per_s"] = learner.model_tokens_per_s  # the ranks' own time
        families["async"]["learner_mfu"] = learner.mfu
        if self.config.env.multi_turn:
            families["tools"] = self._tools()
        distill = self._distillation(learner, batch)
        if distill:
            families["distill"] = distill
        parity = {k[len("parity_"):]: v for k, v in learner.figures.items() if k.startswith("parity_")}
        if parity:
            families["parity"] = parity
            self._parity.append(parity)
        if "router_agreement" in learner.figures:
            self._routing.append({k: learner.figures[k] for k in ("router_agreement", "routed_expert_bytes")})
        canary = self._canary_checks()
        if canary:
            families["canary"] = canary
        if self.config.monitoring.samples_every and version % self.config.monitoring.samples_every == 0:
            families["samples"] = {"table": self._samples_table(version, batch)}
        self.metrics.log_rl(self.policy, families, self._axes(version))
        self.last_step = self.clock()
        scored, errors = self._step_scored
        figures = StepFigures(version, families["rewards"]["total"], families["rewards"]["error_fraction"],
                              families["async"]["queue_depth"], 0.0, parity=parity or None, canary=canary,
                              scored=scored, errors=errors)
        for alert in self.alerts.check(figures):
            self.metrics.event(alert.kind, alert.message, alert.step)
        if version % self.rl.log_every == 0 or version == self.rl.max_steps or self._line_due(self.last_step):
            self._progress(version, families)

    def started(self, version: int) -> None:
        """The stage's first progress line, at its start (fresh or resumed), before any step ends."""
        self._first_version = version
        self._waiting_line(version, self.clock())

    def idle(self, version: int) -> None:
        """Between steps: check the no-progress rule every few seconds, and show a progress line when none
        was shown for PROGRESS_EVERY_S."""
        now = self.clock()
        if self._line_due(now):
            self._waiting_line(version, now)
        if now - self.last_stall_check >= STALL_CHECK_S:
            self.last_stall_check = now
            for alert in self.alerts.check_stall(version, now - self.last_step):
                self.metrics.event(alert.kind, alert.message, alert.step)

    def evaluation(self, version: int, figures: Dict) -> None:
        """Record a finished evaluation of `version` (`monitoring.eval_figures` figures), dated when that
        version was published."""
        self.last_accuracy = figures["accuracy"]
        published_s, samples_seen = self._published[version]
        self.eval_history.append({"version": version, "wall_s": round(published_s, 2), "samples_seen": samples_seen,
                                  "accuracy": figures["accuracy"], "reward_mean": figures["reward_mean"]})
        logged = {k: v for k, v in figures.items() if isinstance(v, float)}
        logged.update({f"component/{k}": v for k, v in figures["components"].items()})
        self.metrics.log_rl(self.policy, {"eval": {**logged, "policy_version": version}}, self._axes(version))

    def parity_totals(self) -> Dict:
        """The stage's parity: the mean of its steps' mean |Δ log-prob| and k3, the largest |Δ|, steps measured
        (a mixture-of-experts policy: also the mean |Δ| with and without routing replay, the mean router agreement
        and expert-id bytes a step); and its canary checks: how many, the largest mean |Δ| of one and the largest
        |Δ|."""
        canary = {"checks": len(self._canary)}
        if self._canary:
            canary.update(abs_mean_max=max(c["abs_mean"] for c in self._canary),
                          abs_max=max(c["abs_max"] for c in self._canary))
        if not self._parity:
            return {"steps_measured": 0, "canary": canary}
        steps = len(self._parity)
        totals = {"abs_mean": sum(p["abs_mean"] for p in self._parity) / steps,
                  "abs_max": max(p["abs_max"] for p in self._parity),
                  "k3": sum(p["k3"] for p in self._parity) / steps, "steps_measured": steps, "canary": canary}
        for kind in ("replayed", "unreplayed"):  # a mixture-of-experts policy's routing check (docs/async-rl.md)
            measured = [p[f"{kind}_abs_mean"] for p in self._parity if f"{kind}_abs_mean" in p]
            if measured:
                totals[f"{kind}_abs_mean"] = sum(measured) / len(measured)
        if self._routing:
            steps = len(self._routing)
            totals["router_agreement"] = sum(r["router_agreement"] for r in self._routing) / steps
            totals["routed_expert_bytes_per_step"] = sum(r["routed_expert_bytes"] for r in self._routing) / steps
        return totals

    def _distillation(self, learner: StepResult, batch: Batch) -> Dict[str, float]:
        """A distilling policy's step figures (W&B `<policy>/distill/...`): the learner's mean per-token reverse KL
        to the teacher (sampled minus teacher log-prob; in forward_kl mode also `forward_kl`, the KL(teacher ||
        student) over the teacher's top tokens the loss minimises), how many versions the teacher had moved on from
        the version that scored the batch's samples, and the teacher workers' scoring seconds per sample since the
        step before."""
        if self._teacher_version_key is None or "distill_kl" not in learner.figures:
            return {}
        published = self.queue.client.get(self._teacher_version_key)
        teacher = int(published) if published is not None else 0
        now = self.queue.counters(self.keys.teacher_stats)
        scored = now.get("scored", 0.0) - self._teacher_counters.get("scored", 0.0)
        busy = now.get("busy_s", 0.0) - self._teacher_counters.get("busy_s", 0.0)
        self._teacher_counters = now
        figures = {"kl": learner.figures["distill_kl"],
                   "teacher_lag": sum(teacher - s.teacher_version for s in batch.samples) / len(batch.samples),
                   "teacher_score_s_per_sample": busy / scored if scored else 0.0}
        if "distill_forward_kl" in learner.figures:
            figures["forward_kl"] = learner.figures["distill_forward_kl"]
        self._distill.append(figures)
        return figures

    def distill_totals(self) -> Dict[str, float]:
        """The stage's distillation figures: the mean of its steps' reverse KL, teacher lag and scoring seconds per
        sample, and the KL of its first and last steps (empty for a policy that does not distil)."""
        if not self._distill:
            return {}
        steps = len(self._distill)
        return {**{k: sum(d[k] for d in self._distill) / steps for k in self._distill[0]},
                "kl_first": self._distill[0]["kl"], "kl_last": self._distill[-1]["kl"], "steps": steps}

    def reward_totals(self) -> Dict:
        """The stage's trained samples: how many, their mean reward and each component's mean."""
        count = max(self._rewarded, 1)
        return {"samples": self._rewarded, "mean": self._reward_sum / count,
                "components": {name: total / count for name, total in self._component_sums.items()}}

    def worker_counters(self) -> WorkerCounts:
        """The rollout and the reward workers' counters as last read from Redis (at each step and the stage's start)."""
        return self._previous

    def reward_state(self) -> Dict:
        """The sums behind `reward_totals`, for a checkpoint: a resumed stage's totals cover every attempt."""
        return {"samples": self._rewarded, "sum": self._reward_sum, "component_sums": dict(self._component_sums)}

    def restore_rewards(self, state: Dict) -> None:
        self._rewarded, self._reward_sum = state["samples"], state["sum"]
        self._component_sums = dict(state["component_sums"])

    def _canary_checks(self) -> Optional[Dict[str, float]]:
        """The parity canary checks engines recorded since the last step: the worst one's figures (W&B `canary/…`)."""
        checks, self._canary_id = checks_since(self.queue.client, self.keys.canary_checks, self._canary_id)
        if not checks:
            return None
        self._canary += checks
        worst = max(checks, key=lambda c: c["abs_mean"])
        return {"abs_mean": worst["abs_mean"], "abs_max": worst["abs_max"], "tokens": worst["tokens"],
                "version": float(worst["version"]), "worker": float(worst["worker"]), "checks": float(len(checks))}

    def _axes(self, version: int) -> Dict[str, float]:
        return {"learner_step": version, "samples_seen": self.samples_seen,
                "wall_time_s": self.clock() - self.start}

    def _learning(self, learner: StepResult, batch: Batch) -> Dict[str, float]:
        lengths = [s.completion_tokens for s in batch.samples]
        learner_metrics = learner.metrics()
        values = {k: learner_metrics[k] for k in LEARNING_KEYS if k in learner_metrics}
        return {**values, "response_length_mean": sum(lengths) / len(lengths), "response_length_max": max(lengths)}

    def _rewards(self, batch: Batch, counters) -> Dict[str, float]:
        samples = batch.samples
        now = (counters.samples_scored, counters.reward_errors, counters.reward_timeouts, counters.samples_filtered)
        scored, errors, timeouts, filtered = (a - b for a, b in zip(now, self._scored))
        self._scored, self._step_scored = now, (scored, errors)
        components = {name: sum(s.components.get(name, 0.0) for s in samples) for name in samples[0].components}
        reward = sum(s.reward for s in samples)
        self._rewarded += len(samples)
        self._reward_sum += reward
        for name, total in components.items():
            self._component_sums[name] = self._component_sums.get(name, 0.0) + total
        values = {"total": reward / len(samples),
                  "error_fraction": errors / max(scored, 1), "timeout_fraction": timeouts / max(scored, 1),
                  "filtered_fraction": filtered / max(scored, 1),
                  "zero_advantage_group_fraction": sum(not has_signal(g) for g in batch.groups)
                  / len(batch.groups), "groups_dropped_no_signal": float(batch.signal_drops)}
        values.update({f"component/{name}": total / len(samples) for name, total in components.items()})
        values.update({f"reason/{name}": float(count) for name, count in counters.reward_reasons.items()})
        return values

    def _async(self, version: int, gaps: List[int], counters, publish_s: float) -> Dict[str, object]:
        current, previous = self._worker_counters(), self._previous
        self._previous = current
        elapsed = max(current.time - previous.time, 1e-9)
        rollout = current.rollout.minus(previous.rollout)
        reward = {k: v - previous.reward.get(k, 0.0) for k, v in current.reward.items()}
        wall = self.clock() - self.start
        return {
            "policy_version": version, "staleness": wandb.Histogram(gaps), "staleness_max": max(gaps),
            "samples_dropped_stale": counters.samples_dropped_stale,
            "samples_dropped_zero_advantage": counters.samples_dropped_zero_advantage, "weight_sync_s": publish_s,
            "rollout_busy_fraction": rollout.busy_s / elapsed / self.rollout_workers,
            "learner_busy_fraction": counters.learner_busy_s / wall,
            "reward_busy_fraction": reward.get("busy_s", 0.0) / elapsed,
            "queue_depth": self.queue.pending(),
            "reward_latency_s": reward.get("latency_s", 0.0) / max(reward.get("scored", 0.0), 1.0),
            "samples_per_s": self._sample_rate.update(current.time, current.rollout.samples),
            "tokens_per_s": self._token_rate.update(current.time, current.rollout.tokens),
            "trained_samples_per_s": counters.samples_trained / wall,
            "weight_bytes_per_sync": rollout.weight_sync_bytes / max(rollout.weight_syncs, 1.0),  # 0: none synced
        }

    def _episode_counters(self) -> Tuple[RolloutCounters, Dict[str, float]]:
        """(the policy's rollout counters, the job's tool counters) as they stand."""
        return self.rollout_counters.read(), self.queue.counters(ToolKeys(self.queue.keys.run).stats)

    def _tools(self) -> Dict[str, float]:
        """Episodes and tool calls since the previous step."""
        (rollout, tools), (rollout_before, tools_before) = self._episode_counters(), self._tool_counters
        self._tool_counters = rollout, tools
        return tool_figures(rollout.minus(rollout_before), {k: v - tools_before.get(k, 0.0) for k, v in tools.items()},
                            self.decode_slots)

    def tool_totals(self) -> Dict[str, float]:
        """The stage's episode and tool figures (for the summary)."""
        return tool_figures(*self._episode_counters(), self.decode_slots)

    def _samples_table(self, version: int, batch: Batch) -> wandb.Table:
        rows = batch.samples[:self.config.monitoring.samples_rows]
        names = sorted(rows[0].components)
        table = wandb.Table(columns=["step", "policy", "version", "prompt", "completion", "reward", *names, "error"])
        texts = self.queue.results.fetch([s.sample_id for s in rows])  # the few shown, read from Redis
        for s, text in zip(rows, texts):
            table.add_data(version, s.policy, s.version, text.prompt, text.completion,
                           s.reward, *[s.components.get(n) for n in names], s.error or "")
        return table

    def _line_due(self, now: float) -> bool:
        return now - self.last_line >= PROGRESS_EVERY_S

    def _progress(self, version: int, families: Dict[str, Dict]) -> None:
        self._line(version, self.clock(), families["rewards"]["total"], families["async"]["samples_per_s"],
                   families["async"]["queue_depth"], staleness=families["async"]["staleness_max"])

    def _waiting_line(self, version: int, now: float) -> None:
        """A progress line while no step ends: the rollout workers' rate and the queue, no step figures."""
        current = self._worker_counters()
        rate = self._sample_rate.update(current.time, current.rollout.samples)
        self._line(version, now, NOT_YET, rate, self.queue.pending(), staleness=NOT_YET)

    def _line(self, version: int, now: float, reward: Figure, samples_per_s: float, queue: int, *,
              staleness: Figure) -> None:
        elapsed, total = now - self.start, self.rl.max_steps
        done = version - self._first_version
        self.last_line = now
        self.metrics.progress(StatusLine(
            f"rl {self.policy}" if self.config.policies else "rl", f"{version}/{total}",
            eta_s=round(elapsed / done * (total - version)) if done > 0 else NOT_YET, reward=reward,
            accuracy=NOT_YET if self.last_accuracy is None else self.last_accuracy,
            samples_per_s=samples_per_s, queue=queue, staleness=staleness))

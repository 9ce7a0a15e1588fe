"""The learner group: the job's DeepSpeed ranks, driven as one learner.

Splits each batch across ranks (its samples in memory, or during RL stages their ids: each rank
then fetches its own shard from Redis), runs their steps in parallel and averages their metrics;
rank 0 provides weight snapshots. The controller only talks to this class.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple, TypeVar

import ray

from rlplatform.config import LearnerConfig, LoraConfig, RLConfig
from rlplatform.devices import gpus_per_actor
from rlplatform.learners.rank import LearnerActor
from rlplatform.learners.step_result import StepResult
from rlplatform.transport.deadlines import LEARNER_TIMEOUT_S, deadline_get
from rlplatform.transport.weight_transports import WeightTransport

T = TypeVar("T")


@dataclass
class TrainItem:
    """One sample of an RL batch as the controller hands it over: its id on Redis, its advantage and
    its token count (prompt + completion, for balancing the ranks' shares)."""
    sample_id: str
    advantage: float
    tokens: int


def shard(items: Sequence[T], parts: int) -> List[List[T]]:
    return [list(items[i::parts]) for i in range(parts)]


def shard_minibatches(items: Sequence[T], ranks: int, minibatches: int,
                      weights: Optional[Sequence[int]] = None) -> List[List[T]]:
    """Each rank's share such that its items j::m (m = min(minibatches, len(items))) are its part of
    the batch's minibatch j, items[j::m]: blocks of m consecutive items, each dealt to the rank with
    the least weight (e.g. tokens) so far (the first such rank; without weights: in turn), a block
    short of m items last. Minibatches are then the same whatever the number of ranks."""
    m = max(1, min(minibatches, len(items)))
    weights = weights if weights is not None else [1] * len(items)
    shares: List[List[T]] = [[] for _ in range(ranks)]
    loads = [0] * ranks
    for start in range(0, len(items), m):
        rank = loads.index(min(loads))
        shares[rank] += items[start:start + m]
        loads[rank] += sum(weights[start:start + m])
    return shares


class LearnerGroup:
    def __init__(self, config: LearnerConfig, model_path: str, seed: int, *, dtype: str, transport: WeightTransport,
                 chat_template: str = "auto", name: Optional[str] = None, lora: Optional[LoraConfig] = None,
                 set_up: bool = True) -> None:
        """`dtype`: a resolved `model.dtype`; `transport`: `weights.transport`'s strategy (both from the job's plan);
        `name`: the ranks become Ray actors named `<name>-<rank>`; `lora`: train adapters only; `set_up` False:
        return once the ranks' actors are created (their processes start and import torch and DeepSpeed meanwhile)
        and call `set_up` once `model_path` is written."""
        n = config.num_ranks
        gpus = config.num_gpus if config.num_gpus is not None else gpus_per_actor(  # the plan sets it
            config.device, None, ray.cluster_resources().get("GPU", 0.0))
        self.ranks = [LearnerActor.options(num_cpus=config.num_cpus, num_gpus=gpus, resources=config.resources,
                                          name=name and f"{name}-{r}")
                      .remote(r, n, model_path, config, seed, dtype=dtype, transport=transport,
                              chat_template=chat_template, lora=lora) for r in range(n)]
        if set_up:
            self.set_up()

    def set_up(self) -> None:
        """Rendezvous the ranks and wrap the policy at `model_path` in DeepSpeed on each; waits for them."""
        host, port = deadline_get(self.ranks[0].address.remote(), "learner rank 0", LEARNER_TIMEOUT_S)
        started = time.time()
        deadline_get([rank.setup.remote(host, port) for rank in self.ranks], "a learner rank's setup",
                     LEARNER_TIMEOUT_S)
        self.ready_at = time.time()  # wall clock when every rank was set up
        self.set_up_s = self.ready_at - started
        self.processes = ray.get([rank.process.remote() for rank in self.ranks])  # `this_process()` of each rank

    def placements(self) -> List[Dict]:
        """Each rank's `LearnerRank.placement`: device, LOCAL_RANK, backend, Ray GPU ids, dtype, precision mode."""
        return ray.get([rank.placement.remote() for rank in self.ranks])

    def start_stage(self, lr: float, keep_reference: bool = False, distill_coef: float = 0.0) -> None:
        """`LearnerRank.start_stage` on every rank."""
        deadline_get([rank.start_stage.remote(lr, keep_reference, distill_coef) for rank in self.ranks],
                     "a learner rank", LEARNER_TIMEOUT_S)

    def sft_step(self, rows: List[Dict], lr_fraction: float = 1.0, timeout_s: float = LEARNER_TIMEOUT_S) -> StepResult:
        """One SFT step on `rows`, shared out over the ranks; `WorkerHung` once it takes over `timeout_s`."""
        parts = shard(rows, len(self.ranks))
        return merge_rank_metrics(deadline_get([rank.sft_step.remote(p, lr_fraction)
                                                for rank, p in zip(self.ranks, parts)],
                                               "a learner rank's SFT step", timeout_s))

    def connect_results(self, redis_url: str, run: str, reconnect_s: float, policy: Optional[str] = None) -> None:
        """Let every rank fetch the run's scored samples from Redis (`rl_step_async`; `run`: its `run_scope`); with
        `policy`, each step's end is announced there for the RL loop (`LearnerRank.connect_results`). A Redis
        that went away is reconnected to for `reconnect_s`."""
        deadline_get([rank.connect_results.remote(redis_url, run, reconnect_s, policy) for rank in self.ranks],
                     "a learner rank", LEARNER_TIMEOUT_S)

    def watch_parity(self, prompt_ids: List[List[int]], reference_key: str, every: int) -> None:
        """Score the parity canary with every `every`-th version streamed (`LearnerRank.watch_parity`)."""
        deadline_get([rank.watch_parity.remote(prompt_ids, reference_key, every) for rank in self.ranks],
                     "a learner rank", LEARNER_TIMEOUT_S)

    def rl_step_async(self, batch: List[TrainItem], rl: RLConfig, sft_rows: Optional[List[Dict]] = None,
                      step: int = 0, max_tokens: Optional[int] = None, *,
                      distill: bool = True) -> List[ray.ObjectRef]:
        """Start RL step `step` on every rank with its token-balanced share of the batch's ids and
        advantages (each rank fetches its samples from Redis: `connect_results`), each publishing its
        new weights as it ends; `gather` the refs. `distill`: False leaves a distilling policy's teacher signal
        out of this step."""
        shares = shard_minibatches(batch, len(self.ranks), rl.minibatches, [item.tokens for item in batch])
        return [rank.rl_step_and_stream.remote([i.sample_id for i in share], [i.advantage for i in share], rl,
                                                rows, step, max_tokens=max_tokens, distill=distill)
                for rank, share, rows in zip(self.ranks, shares, self._sft_parts(sft_rows))]

    def _sft_parts(self, sft_rows: Optional[List[Dict]]) -> List[Optional[List[Dict]]]:
        return shard(sft_rows, len(self.ranks)) if sft_rows else [None] * len(self.ranks)

    @staticmethod
    def gather(refs: List[ray.ObjectRef]) -> Tuple[StepResult, Optional[ray.ObjectRef]]:
        """(the ranks' merged metrics, what rank 0 streamed the new weights as) of a step started by `rl_step_async`;
        nothing was streamed (None) when the job's Redis went away after the step was applied."""
        results = deadline_get(refs, "a learner rank's RL step", LEARNER_TIMEOUT_S)
        streamed = results[0][1]
        return merge_rank_metrics([metrics for metrics, _ in results]), streamed[0] if streamed else None

    def snapshot_weights(self) -> ray.ObjectRef:
        refs = deadline_get([rank.snapshot_weights.remote() for rank in self.ranks], "a learner rank's weights",
                            LEARNER_TIMEOUT_S)
        return refs[0][0]

    def stream_weights(self, version: int):
        """Stream the current weights as `version` (`LearnerRank.stream_weights`); rank 0's result."""
        return deadline_get([rank.stream_weights.remote(version) for rank in self.ranks], "a learner rank's weights",
                            LEARNER_TIMEOUT_S)[0][0]

    def save(self, checkpoint_dir: str, model_dir: Optional[str] = None, client_state: Optional[Dict] = None,
             merged_dir: Optional[str] = None, timeout_s: float = LEARNER_TIMEOUT_S) -> None:
        """Every rank's checkpoint under `checkpoint_dir` (and the Hugging Face model, or with LoRA the
        adapters, in `model_dir`; with LoRA the merged model in `merged_dir`), in at most `timeout_s`."""
        deadline_get([rank.save.remote(checkpoint_dir, model_dir, client_state, merged_dir) for rank in self.ranks],
                     f"a learner rank saving to {checkpoint_dir}", timeout_s)

    def load_checkpoint(self, checkpoint_dir: str) -> Dict:
        """Restore every rank from `save`'s `checkpoint_dir`; returns its client state."""
        return deadline_get([rank.load_checkpoint.remote(checkpoint_dir) for rank in self.ranks],
                            f"a learner rank loading {checkpoint_dir}", LEARNER_TIMEOUT_S)[0]

    def shutdown(self) -> None:
        for rank in self.ranks:
            ray.kill(rank)


def merge_rank_metrics(per_rank: List[Dict[str, float]]) -> StepResult:
    """Rank-averaged metrics; maxima stay maxima; rates (`_per_s`) add up; `tokens_total` sums every rank's tokens."""
    merged = {k: (max if k.endswith("_max") else sum if k.endswith("_per_s") else _average)([m[k] for m in per_rank])
              for k in per_rank[0]}
    merged["tokens_total"] = sum(m.get("tokens", 0.0) for m in per_rank)
    return StepResult.of(merged)


def _average(values: List[float]) -> float:
    return sum(values) / len(values)


"""What a rollout worker (or the job's evaluator, a rollout worker that scores held-out prompts) is
built from, as one frozen value the controller hands to the Ray actor.

It names the worker's inputs, not its state: everything here can be sent again when Ray restarts the
actor. This module imports nothing heavy, so the evaluator's process can take its CPU priority
before torch loads.
"""

from __future__ import annotations

from dataclasses import KW_ONLY, dataclass, field
from typing import Optional

from rlplatform.config import EnvConfig, LoraConfig, MonitoringConfig, RLConfig, RolloutConfig
from rlplatform.transport.weight_transports import WeightTransport


@dataclass(frozen=True)
class RolloutSpec:
    index: int  # the worker's index among the policy's rollout workers (the evaluator: rollout.num_workers)
    policy: str  # the policy's name
    run: str  # the run's `run_scope`, which names its Redis keys
    model_path: str  # the initial policy's Hugging Face directory
    prompts_path: str  # the policy's encoded prompts file
    _: KW_ONLY
    redis_url: str
    rl: RLConfig
    rollout: RolloutConfig
    dtype: str  # a resolved `model.dtype` (the job's plan)
    transport: WeightTransport  # `weights.transport`'s strategy (the job's plan)
    seed: int = 0
    weight_store: Optional[str] = None  # the weight store actor's name (None: evaluation only)
    lora: Optional[LoraConfig] = None
    chat_template: str = "auto"
    env: EnvConfig = field(default_factory=EnvConfig)
    priority: str = "normal"  # the process's CPU priority: `rollout.priority`, or the evaluator's `eval.priority`
    parity_every: int = 0  # `monitoring.parity_every`: versions between parity canary checks (0: none)
    distilled: bool = False  # the policy distils (`distill.teacher`): samples go to its teacher queue, not the reward queue
    monitoring: MonitoringConfig = field(default_factory=MonitoringConfig)  # its hang rule drops idle agent episodes

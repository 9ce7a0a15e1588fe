"""The job configuration: one dataclass schema, YAML merged onto it, `key=value` overrides on top.

`load_config(path, overrides)` is the only way a job's settings enter the platform. It fails
before anything starts, with a `ConfigError` naming the file and the key, on unknown keys,
wrong types, bad YAML (not UTF-8, a key given twice, aliases that recurse or multiply the
document) and missing files, on values that cannot work (not finite, sizes that do not fit
each other, the model or this machine's memory) and on keys the chosen kind never reads.
Everything past `load_config` sees plain dataclasses.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import re
import typing
from dataclasses import KW_ONLY, dataclass, field
from typing import Any, Dict, Iterable, List, Optional, Set
from urllib.parse import urlsplit, urlunsplit

import psutil
import yaml
from omegaconf import OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException


class ConfigError(ValueError):
    """A job configuration that cannot run; the message names the file and the key."""


def one_of(*choices: Any, default: Any = None) -> Any:
    """A field that takes one of `choices`; its default is `default`, or the first choice."""
    return field(default=choices[0] if default is None else default, metadata={"choices": choices})


def at_least(default: Any, low: float) -> Any:
    """A field whose value must be >= `low` (None, where allowed, means unset)."""
    return field(default=default, metadata={"at_least": low})


def above(default: Any, low: float) -> Any:
    """A field whose value must be > `low`."""
    return field(default=default, metadata={"above": low})



LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@dataclass
class LoraConfig:
    enabled: bool = False  # train low-rank adapters on the frozen model instead of all its weights
    rank: int = at_least(8, 1)  # adapter rank r
    alpha: float = above(16.0, 0)  # adapter updates are scaled by alpha / rank
    dropout: float = at_least(0.0, 0)  # dropout on the adapters' inputs in learner passes (< 1)
    target_modules: List[str] = field(default_factory=lambda: list(LORA_TARGETS))  # module names that get adapters


@dataclass
class ModelConfig:
    kind: str = one_of("demo", "pretrained")  # demo: a small Qwen2 (or Qwen3-MoE) built from the fields below; pretrained: load `path`
    path: Optional[str] = None  # Hugging Face model directory (kind=pretrained)
    hidden_size: int = at_least(128, 1)  # demo model width
    num_layers: int = at_least(4, 1)  # demo model depth
    num_heads: int = at_least(4, 1)  # demo attention heads
    _: KW_ONLY
    num_kv_heads: int = at_least(2, 1)  # demo key/value heads (grouped-query attention)
    intermediate_size: int = at_least(384, 1)  # demo MLP width
    num_experts: int = at_least(0, 0)  # demo: 0 builds a dense Qwen2; more builds a Qwen3-MoE of this many experts a layer
    experts_per_token: int = at_least(2, 1)  # demo MoE: the experts each token is routed to (top-k)
    expert_size: int = at_least(128, 1)  # demo MoE: each expert's MLP width
    router_aux_loss_coef: float = at_least(0.01, 0.0)  # demo MoE: weight of the routers' load-balancing loss in the learner's loss
    max_positions: int = at_least(64, 1)  # demo context length
    extra_chars: str = ""  # characters the demo tokenizer knows beyond its default alphabet (e.g. "<>/" for tool tags)
    dtype: str = one_of("auto", "float32", "bfloat16", "float16")  # precision: auto is bfloat16 when the learner computes on a GPU, else float32; bfloat16 trains float32 weights under bfloat16 autocast and serves bfloat16 to rollout workers and the saved model
    lora: LoraConfig = field(default_factory=LoraConfig)  # train adapters only; weight syncs and checkpoints carry them alone


@dataclass
class DataConfig:
    kind: str = one_of("addition", "jsonl", "hf", "tool_calc")  # addition: generated "37+48=" -> "85" rows; jsonl, hf: read files; tool_calc: "123*4=" rows answered with a calculator trace
    # kind=jsonl: jsonl files; kind=hf: json/jsonl/parquet/csv files (format by extension) or save_to_disk directories
    train_path: Optional[str] = None  # training rows
    test_path: Optional[str] = None  # held-out rows for evaluation
    path: Optional[str] = None  # kind=hf, instead of the two paths: a save_to_disk directory of a DatasetDict
    split: str = "train"  # training split of `path`
    _: KW_ONLY
    test_split: str = "test"  # held-out split of `path`
    prompt_key: str = "prompt"  # row field holding the prompt text
    messages_key: str = "messages"  # row field holding a conversation: a list of {role, content}
    answer_key: str = "answer"  # row field holding the reference answer (optional)
    chat_template: str = one_of("auto", "none")  # auto: the tokenizer's chat template when it has one; none: plain text
    max_prompt_tokens: int = at_least(0, 0)  # longer prompts (in tokens) are skipped and counted (0: the model's context length, max_position_embeddings)
    digits: int = at_least(2, 1)  # operand digits (kind=addition)
    train_size: int = at_least(20000, 1)  # generated training rows (kind=addition)
    test_size: int = at_least(500, 1)  # generated held-out rows (kind=addition)
    # kind=addition: true holds out distinct problems no training row repeats (generalisation to unseen
    # problems); false draws test rows from the same problem space as training (task accuracy)
    disjoint_test: bool = False


@dataclass
class SFTConfig:
    enabled: bool = True  # run the supervised stage before RL
    steps: int = at_least(600, 1)  # optimizer steps
    batch_size: int = at_least(128, 1)  # rows per step
    lr: float = above(3e-3, 0)  # AdamW learning rate
    log_every: int = at_least(25, 1)  # console/W&B interval in steps
    _: KW_ONLY
    stop_at_accuracy: float = at_least(0.0, 0.0)  # end SFT once held-out greedy accuracy reaches this (0: never)
    eval_every: int = at_least(50, 1)  # SFT steps between held-out checks, when stop_at_accuracy is set
    warmup_steps: int = at_least(0, 0)  # the learning rate rises linearly from 0 over these first steps
    lr_schedule: str = one_of("constant", "cosine")  # after warm-up: constant, or cosine decay to 10% at `steps`


@dataclass
class RLConfig:
    enabled: bool = True  # run the asynchronous RL stage
    algorithm: str = one_of("grpo", "rloo", "reinforce_pp")  # advantage estimator: grpo (group-normalised), rloo (leave-one-out), reinforce_pp
    correction: str = one_of("truncated_is", "decoupled_ppo", "on_policy")  # off-policy correction: truncated_is, decoupled_ppo or on_policy
    loss_aggregation: str = one_of("token_mean", "sequence_mean", "fixed_length")  # token_mean, sequence_mean (per completion) or fixed_length (Dr. GRPO)
    ppo_epochs: int = at_least(1, 1)  # passes over each batch (PPO-clip against the weights at the batch's start)
    _: KW_ONLY
    minibatches: int = at_least(1, 1)  # optimizer steps per pass
    entropy_coef: float = at_least(0.0, 0)  # weight of the entropy bonus
    sft_coef: float = at_least(0.0, 0)  # weight of an SFT loss on data rows mixed into every RL step
    max_steps: int = at_least(60, 1)  # learner steps
    batch_prompts: int = at_least(16, 1)  # complete groups per learner step
    group_size: int = at_least(8, 2)  # completions sampled per prompt
    lr: float = above(2e-4, 0)  # AdamW learning rate
    lr_schedule: str = one_of("linear", "constant")  # linear: decays to 0 at max_steps (as TRL does), or constant
    warmup_steps: int = at_least(0, 0)  # the learning rate rises linearly over these first steps (then follows lr_schedule): Adam's first steps move every weight by about lr whatever its gradient
    max_staleness: int = at_least(1, 0)  # samples more than this many versions behind the learner are dropped
    max_new_tokens: int = at_least(6, 1)  # completion length limit
    temperature: float = above(1.0, 0)  # sampling temperature of the rollout workers
    clip_eps: float = above(0.2, 0)  # PPO-style clip on the policy ratio
    is_cap: float = above(2.0, 0)  # truncation of the behaviour importance weight
    std_normalize: bool = True  # divide group advantages by the group reward std
    dynamic_sampling: bool = False  # drop (and count) groups whose rewards are all equal and train on replacements: every batch holds rl.batch_prompts groups with signal
    dynamic_sampling_limit: int = at_least(4, 1)  # with dynamic_sampling, after this many batches' worth of groups dropped since the last step, the next batch takes groups as they come (counted)
    overlong_buffer: int = at_least(0, 0)  # DAPO's soft overlong penalty: 0 down to -1 over the last this many completion tokens before the limit (rl.max_new_tokens, or env's episode budget); 0: off
    kl_coef: float = at_least(0.0, 0)  # weight of the KL-to-reference penalty in the loss
    track_reference_kl: bool = True  # keep the RL-start policy frozen and log KL to it
    routing_replay: bool = True  # a mixture-of-experts policy: the learner routes each token to the experts the engine chose for it (rollout routing replay; docs/async-rl.md)
    reference_kl_every: int = at_least(10, 1)  # with kl_coef 0, the KL to the reference is measured every this many steps (a forward pass each time); with kl_coef > 0, every step
    idle_timeout_s: float = at_least(0.0, 0)  # the stage ends after this many seconds without a scored sample, once no step is in flight (0: never); a bridge-only job's end when its agents stop
    group_timeout_s: Optional[float] = above(None, 0)  # a group not complete this long after its claim expires and frees its capacity; unset: monitoring.hang_factor x the longest a group took, at least hang_floor_s
    log_every: int = at_least(5, 1)  # console/W&B interval in steps


REDIS_URL_ENV = "RLP_REDIS_URL"  # a job's Redis URL, password included, where configs and command lines leave it out
BRIDGE_KEY_ENV = "RLP_BRIDGE_KEY"  # where the OpenAI bridge's key is read by default (`rlp verifiers` sends it)


@dataclass
class OpenAIBridgeConfig:
    enabled: bool = False  # each rollout worker serves an OpenAI-compatible /v1/chat/completions from its engine
    host: str = "127.0.0.1"  # interface it listens on (0.0.0.0: reachable from other machines)
    port: int = at_least(8000, 0)  # rollout worker i listens on port + i (0: any free port); give each policy its own range
    api_key_env: str = BRIDGE_KEY_ENV  # environment variable holding the key requests must send (Authorization: Bearer); required when host is not a loopback address
    max_prompt_tokens: int = at_least(8192, 1)  # a request (an episode: its whole sequence) whose prompt is longer is refused (400)
    _: KW_ONLY
    max_tokens: int = at_least(4096, 1)  # max_tokens / max_completion_tokens above this are refused (400)
    max_n: int = at_least(64, 1)  # n above this is refused (400)
    max_body_bytes: int = at_least(1 << 20, 1024)  # a request body larger than this is refused (413) before it is read
    max_requests: int = at_least(256, 1)  # chat requests in progress at once per worker; more are refused (429)


@dataclass
class RolloutConfig:
    num_workers: int = at_least(1, 1)  # rollout worker actors
    max_workers: Optional[int] = at_least(None, 1)  # elastic: with more than num_workers, one more worker joins whenever the cluster has room for it (a node joined), up to this many; such a worker leaves with its node, its unsubmitted groups issued again (unset: num_workers, a fixed pool)
    prompts_per_batch: int = at_least(16, 1)  # groups a worker decodes at once (group_size sequences each, continuously refilled)
    weight_swap: str = one_of("in_flight", "finish_then_swap")  # in_flight: new weights load between decode steps; finish_then_swap: once drained
    num_threads: int = at_least(1, 1)  # torch threads per worker
    _: KW_ONLY
    num_cpus: float = at_least(1.0, 0)  # Ray CPUs reserved per worker
    priority: str = one_of("low", "normal", "idle")  # CPU priority beside the learner's (docs/devices.md: CPU priorities): low lets the learner step go first
    device: str = one_of("auto", "cpu", "cuda")  # auto: the GPU Ray assigns the worker when the cluster has GPUs, else CPU
    num_gpus: Optional[float] = at_least(None, 0)  # Ray GPUs per worker and the evaluator (fractions share one); unset: 1 on a GPU device where one each fits the cluster, else a share (docs/devices.md), 0 on CPU
    resources: Dict[str, float] = field(default_factory=dict)  # custom Ray resources per worker (and the evaluator), e.g. {rollout_node: 1} places them on nodes started with that resource
    engine: str = one_of("auto", "transformers", "vllm")  # auto: vllm where it is installed and the worker has a CUDA GPU, else transformers (on CPU the faster at the quickstart's size and within 10% from 10M parameters up: benchmarks/engines.py); transformers: CPU or GPU; vllm: vLLM 0.32, its CUDA build on the worker's GPU or its CPU build (install.sh)
    kv_cache: str = one_of("auto", "static", "dynamic")  # transformers engine: auto is static for qwen2/llama policies without LoRA (on CUDA each decode step a replayed CUDA graph), dynamic elsewhere; static: the slot cache, insisting; dynamic: Hugging Face's growing cache (docs/devices.md)
    prefill_tokens: int = at_least(8192, 1)  # transformers engine: padded prompt tokens per prefill forward; more waiting prompts prefill in chunks
    gpu_memory_utilization: Optional[float] = above(None, 0)  # vllm on a GPU: fraction of its memory vLLM takes for weights and KV cache; unset: 0.9 of the worker's share of the GPU (num_gpus); on CPU: the largest share of the machine's memory its KV cache takes (unset: 0.25; it takes what 256 requests at the model's full context need)
    openai_bridge: OpenAIBridgeConfig = field(default_factory=OpenAIBridgeConfig)  # agents sample trainable episodes over HTTP
    source: str = one_of("dataset", "bridge")  # dataset: workers draw prompts from the data; bridge: they generate only what agents ask through the OpenAI bridge


@dataclass
class WeightsConfig:
    transport: str = one_of("auto", "object_store", "broadcast", "cuda_ipc")  # how learner rank 0 hands versions to rollout workers (docs/devices.md: Weight transports); auto: cuda_ipc where the learner (one rank) and the rollout workers share a one-GPU cluster and full weights travel, else object_store
    bucket_mb: float = above(256.0, 0)  # broadcast: weights go in buckets of at most this many MB
    delta: bool = False  # after a full version, send only the elements that changed (docs/devices.md: Weight transports)
    delta_full_every: int = at_least(50, 1)  # delta: every this many versions a full one, so a late engine replays few


@dataclass
class RewardSpec:
    name: Optional[str] = None  # a built-in, registered or entry-point reward name
    fn: Optional[str] = None  # or an import path "package.module:function"
    weight: float = 1.0  # weight in the summed reward (role=reward)
    params: Dict[str, Any] = field(default_factory=dict)  # keyword arguments for the function
    role: str = one_of("reward", "filter")  # reward: adds weight * score; filter: gates the sample when it flags it
    _: KW_ONLY
    on_flag: str = one_of("veto", "penalty", "drop")  # filter action: veto (reward 0), penalty (minus `penalty`), drop (not trained on)
    penalty: float = at_least(1.0, 0)  # subtracted from the reward when a penalty filter flags a sample
    timeout_s: float = above(30.0, 0)  # a call running longer is an error result for its samples

    @property
    def label(self) -> str:
        """The name its scores are reported under."""
        return self.name or (self.fn or "").rsplit(":", 1)[-1]


@dataclass
class RewardWorkersConfig:
    num_workers: int = at_least(1, 0)  # reward worker actors started for the job (0: only standalone workers)
    batch_size: int = at_least(64, 1)  # queue messages read per call
    concurrency: int = at_least(8, 1)  # samples scored at once per worker (threads for sync rewards, tasks for async)
    claim_idle_s: float = above(30.0, 0)  # a request unacknowledged this long is reclaimed from its (dead) worker
    max_deliveries: int = at_least(3, 1)  # a request delivered this often without a result goes to dead letters
    _: KW_ONLY
    num_cpus: float = at_least(0.5, 0)  # Ray CPUs reserved per worker
    priority: str = one_of("low", "normal", "idle")  # CPU priority beside the learner's (docs/devices.md: CPU priorities): low lets the learner step go first
    resources: Dict[str, float] = field(default_factory=dict)  # custom Ray resources per worker, e.g. {reward_node: 1} places them on nodes started with that resource


@dataclass
class ToolSpec:
    name: Optional[str] = None  # a built-in (calculator, python), registered or entry-point tool name
    fn: Optional[str] = None  # or an import path "package.module:function"
    params: Dict[str, Any] = field(default_factory=dict)  # keyword arguments for the function (the model cannot set them)
    timeout_s: float = above(10.0, 0)  # a call running longer is an error observation

    @property
    def label(self) -> str:
        """The name the model calls it by."""
        return self.name or (self.fn or "").rsplit(":", 1)[-1]


@dataclass
class EnvConfig:
    kind: str = one_of("single_turn", "tools", "verifiers")  # single_turn: one completion per prompt; tools: the model may call `tools`; verifiers: the rollout workers play `taskset`'s tasks
    fn: Optional[str] = None  # instead of kind: a custom environment class "package.module:Class" (rlplatform.envs)
    taskset: Optional[str] = None  # kind=verifiers: the taskset, a top-level module (or a .py file's path) exporting a verifiers Taskset (and optionally an Env)
    taskset_args: Dict[str, Any] = field(default_factory=dict)  # kind=verifiers: the taskset's config fields
    test_tasks: int = at_least(16, 0)  # kind=verifiers: tasks held out for evaluation (pass@1 by their rewards), a fixed seeded draw
    _: KW_ONLY
    max_turns: int = at_least(1, 1)  # model turns per episode
    max_tokens: int = at_least(0, 0)  # completion tokens per episode, model and observation (0: max_turns x rl.max_new_tokens)
    on_token_mismatch: str = one_of("count", "drop", "fail")  # an episode whose tokens differ from its conversation rendered whole by the chat template: count it; also train none of its tokens; or stop the job (docs/tools-and-environments.md)
    tools: List[ToolSpec] = field(default_factory=list)  # the tools the model may call (kind=tools)
    tool_workers: RewardWorkersConfig = field(default_factory=RewardWorkersConfig)  # tool workers started for the job

    @property
    def multi_turn(self) -> bool:
        """Episodes of the job's own environment classes (`rlplatform.envs`), on the worker's decode batch."""
        return self.kind == "tools" or self.fn is not None

    @property
    def plays_taskset(self) -> bool:
        return self.kind == "verifiers"

    def completion_tokens(self, max_new_tokens: int) -> int:
        """The most completion tokens an episode holds: `max_tokens`, else `max_turns` x `max_new_tokens`
        (one turn's `max_new_tokens` without a multi-turn environment)."""
        if not self.multi_turn:
            return max_new_tokens
        return self.max_tokens or self.max_turns * max_new_tokens


@dataclass
class LearnerConfig:
    num_ranks: int = at_least(1, 1)  # DeepSpeed data-parallel ranks (Ray actors)
    # DeepSpeed ZeRO stage 0-3; unset: 0 with one rank (there is nothing to partition, and ZeRO-1's flat copies of the
    # weights and gradients cost memory and, on the demo policy, about 2% of an RL step), 1 with several or where
    # bfloat16 trains with master weights
    zero_stage: Optional[int] = field(default=None, metadata={"choices": (0, 1, 2, 3)})
    # how a bfloat16 model.dtype trains: master_weights (bfloat16 weights and activations, DeepSpeed's bf16 mode: a
    # float32 master copy of the weights and float32 gradient accumulation in its optimizer; needs ZeRO 1-3) or
    # autocast (float32 weights, bfloat16 matmuls; the residual stream, norms, gradients and AdamW in float32);
    # auto: master_weights, or autocast where zero_stage is set to 0
    bf16_mode: str = one_of("auto", "master_weights", "autocast")
    grad_clip: float = above(1.0, 0)  # gradient norm clip
    num_threads: int = at_least(1, 1)  # torch threads per rank
    _: KW_ONLY
    num_cpus: float = at_least(1.0, 0)  # Ray CPUs reserved per rank
    device: str = one_of("auto", "cpu", "cuda")  # auto: the GPU Ray assigns the rank when the cluster has GPUs, else CPU
    num_gpus: Optional[float] = at_least(None, 0)  # Ray GPUs per rank (a fraction shares one); unset: 1 on a GPU device, or half of one shared with the rollout workers where a GPU each does not fit the cluster (docs/devices.md), 0 on CPU
    resources: Dict[str, float] = field(default_factory=dict)  # custom Ray resources per rank, e.g. {learner_node: 1} places ranks on nodes started with that resource
    micro_batch_tokens: Optional[int] = at_least(None, 1)  # prompt+completion tokens per forward/backward (every pass: update, proximal, reference, SFT); a larger minibatch accumulates over several; unset: from the device's free memory (learners/budget.py)
    # recompute each layer's activations in backward: less memory, about a third more compute; unset: on where the
    # device's free memory holds fewer tokens' activations without it than a micro-batch needs (micro_batch_tokens,
    # else 8192; learners/budget.py)
    activation_checkpointing: Optional[bool] = None
    compile: Optional[bool] = None  # torch.compile each decoder layer (fuses the elementwise work between matmuls; each way the layers are called compiles once, when first met); unset: on for a CUDA learner under ZeRO 0-2

    def master_weights(self, dtype: str) -> bool:
        """Whether weights of `dtype` (a concrete model.dtype) train in that dtype over float32 master weights
        in DeepSpeed's optimizer: float16 always, bfloat16 as `bf16_mode` says."""
        if dtype == "bfloat16":
            return self.bf16_mode == "master_weights" or (self.bf16_mode == "auto" and self.zero_stage != 0)
        return dtype == "float16"

    def effective_zero_stage(self, dtype: str) -> int:
        """`zero_stage`, or unset: 0 for one rank, 1 for several or for bfloat16 weights over float32 masters."""
        if self.zero_stage is not None:
            return self.zero_stage
        return 0 if self.num_ranks == 1 and not (dtype == "bfloat16" and self.master_weights(dtype)) else 1


@dataclass
class RedisConfig:
    url: Optional[str] = None  # redis://, rediss:// or unix:// URL; unset: $RLP_REDIS_URL when set (the way to keep a password out of configs), else an embedded server for the job
    max_stream_len: int = at_least(10000, 1)  # unscored reward requests at most; producers wait at this bound
    reconnect_s: float = above(30.0, 0)  # how long the controller and learner keep reconnecting to a Redis that went away; then the job checkpoints from the learner's memory and stops


@dataclass
class RayConfig:
    address: Optional[str] = None  # existing cluster; unset: RAY_ADDRESS or a local cluster
    # actor processes forked from a warm interpreter per node (rlplatform.warm_start) on machines without a GPU;
    # unset: when the job starts its own Ray; true: also on a cluster it joins (each node then needs this Python
    # and rlplatform at the same paths, as in one image); false: each actor imports torch and transformers itself
    warm_start: Optional[bool] = None


@dataclass
class WandbConfig:
    mode: str = one_of("auto", "online", "offline", "disabled")  # auto: online with an API key, else offline; online; offline; disabled
    project: str = "rlplatform"  # W&B project
    entity: Optional[str] = None  # W&B entity (team or user)
    group: Optional[str] = None  # W&B run group (`rlp run --seeds` sets the job's name: its seeds' runs side by side)


@dataclass
class EvalConfig:
    enabled: bool = True  # held-out evaluation by an evaluator actor per policy; false: none (no accuracy figures)
    every_steps: int = at_least(0, 0)  # RL steps between held-out evaluations during RL (0: after each stage only)
    max_new_tokens: int = at_least(6, 1)  # completion length limit on the held-out set
    batch_size: int = at_least(256, 1)  # prompts per generate call
    max_rows: int = at_least(0, 0)  # held-out rows evaluated, the first ones (0: all)
    _: KW_ONLY
    greedy: bool = True  # greedy decoding; false samples at `temperature`
    temperature: float = above(1.0, 0)  # sampling temperature when greedy is false
    samples_per_prompt: int = at_least(1, 1)  # completions per prompt (pass@k for k = this; needs greedy: false when > 1)
    priority: str = one_of("idle", "low", "normal")  # the evaluator's CPU priority: idle (niceness 19) evaluates on CPU time training leaves
    # a completion passes when every role=reward entry scores 1, or only this reward entry (its name or fn label)
    pass_reward: Optional[str] = None


@dataclass
class CheckpointConfig:
    every_steps: int = at_least(0, 0)  # RL steps between checkpoints (0: only when the job ends or is interrupted)
    keep_last: int = at_least(2, 1)  # newest checkpoints kept; older ones are deleted
    export_merged: bool = False  # with model.lora: also write the final model, adapters merged in, to <run>/model


@dataclass
class AlertRule:
    kind: str = one_of("reward_collapse", "no_progress", "reward_errors", "queue_backlog", "parity")  # what the rule watches
    threshold: float = at_least(0.5, 0)  # collapse: fraction of the best reward; no_progress: minutes; errors: fraction; backlog: requests; parity: mean |Δ log-prob|
    window: int = at_least(20, 1)  # learner steps the rule averages over


PARITY_LIMIT = 0.05  # mean |Δ log-prob| between engine and learner on same-weights tokens (docs/monitoring.md)


def _default_alerts() -> List[AlertRule]:
    return [AlertRule("reward_collapse", 0.5, 20), AlertRule("no_progress", 10.0, 1),
            AlertRule("reward_errors", 0.1, 20), AlertRule("queue_backlog", 5000.0, 20),
            AlertRule("parity", PARITY_LIMIT, 1)]


@dataclass
class MonitoringConfig:
    samples_every: int = at_least(50, 0)  # learner steps between W&B tables of sample completions (0: never)
    samples_rows: int = at_least(16, 1)  # completions per table
    alerts: List[AlertRule] = field(default_factory=_default_alerts)  # the alert rules the RL stage watches (docs/monitoring.md)
    max_error_fraction: float = at_least(0.9, 0)  # the job stops (checkpointed, exit 1) when reward errors pass this fraction of the samples scored over an error window (1: never)
    error_window: int = at_least(20, 1)  # learner steps in the step error window
    _: KW_ONLY
    error_window_s: float = above(120.0, 0)  # seconds in the time error window (it needs one batch's samples; an alert at half)
    worker_silent_s: float = above(120.0, 0)  # a rollout or reward worker whose loop has not gone round this long is named (console, alert, rlp status)
    parity_every: int = at_least(10, 0)  # versions between each rollout engine's parity canary checks against the learner (0: never; docs/monitoring.md)
    scoring_stall_s: float = above(30.0, 0)  # samples waiting for rewards and none scored this long: an alert naming the reward workers' last beats
    watchdog: bool = True  # hung components are alerted, their stacks dumped to <run>/hangs/, and recovered (docs/failures-and-resume.md)
    hang_factor: float = above(10.0, 1)  # a component is hung after this many times its longest round or learner step so far without progress
    hang_floor_s: float = above(60.0, 0)  # ... and at least this long


POLICY_SECTIONS = ("model", "sft", "rl", "rollout", "learner", "weights")


@dataclass
class DistillConfig:
    teacher: Optional[str] = None  # another policy of the job that scores this policy's samples token by token (on-policy distillation, docs/async-rl.md); unset: none
    coef: float = above(1.0, 0)  # weight of the teacher's signal: reverse_kl's per-token teacher log-prob minus the sampled log-prob in each token's advantage; forward_kl's loss term
    mode: str = one_of("reverse_kl", "forward_kl")  # on the student's own samples, per token: reverse_kl, the sampled token's reverse KL(student || teacher) minimised through the advantage; forward_kl, the KL(teacher || student) over the teacher's top_k tokens minimised as a loss term (the teacher names the tokens it would have chosen)
    top_k: int = at_least(8, 1)  # forward_kl: the teacher's most likely tokens at each position that the student is trained towards
    task_reward: bool = True  # train on the task rewards' advantage with the teacher's signal; false: on the teacher's signal alone (rewards are still scored and reported)
    _: KW_ONLY
    temperature: float = above(1.0, 0)  # forward_kl: the teacher's next-token distribution at this temperature (logits / temperature); below 1 it is sharper, its mass moved onto the tokens it would most likely choose
    workers: int = at_least(1, 1)  # teacher scoring workers (Ray actors holding the teacher's newest weights)
    num_cpus: float = at_least(1.0, 0)  # Ray CPUs reserved per teacher scoring worker


@dataclass
class PolicyConfig:
    """One policy of a job: its own model, schedule, rollout workers and learner."""
    name: str = "policy"  # metrics, checkpoints and samples are kept under this name
    model: ModelConfig = field(default_factory=ModelConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    rl: RLConfig = field(default_factory=RLConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    _: KW_ONLY
    learner: LearnerConfig = field(default_factory=LearnerConfig)
    weights: WeightsConfig = field(default_factory=WeightsConfig)
    distill: DistillConfig = field(default_factory=DistillConfig)  # learn from another policy of the job as it trains


@dataclass
class JobConfig:
    name: str = "quickstart"  # run name; output goes to <output_dir>/<name>
    output_dir: str = "runs"  # parent directory of run directories
    seed: int = 0  # seeds model init, data generation and sampling
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    _: KW_ONLY
    sft: SFTConfig = field(default_factory=SFTConfig)
    rl: RLConfig = field(default_factory=RLConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    rewards: List[RewardSpec] = field(default_factory=lambda: [RewardSpec(name="exact_match")])  # the rewards summed into each sample's reward, and the filters and monitors beside them
    imports: List[str] = field(default_factory=list)  # modules imported before rewards resolve (@rlplatform.reward files)
    env: EnvConfig = field(default_factory=EnvConfig)  # episodes: single-turn, or multi-turn with tools (rlplatform.envs)
    reward_workers: RewardWorkersConfig = field(default_factory=RewardWorkersConfig)
    learner: LearnerConfig = field(default_factory=LearnerConfig)
    weights: WeightsConfig = field(default_factory=WeightsConfig)
    redis: RedisConfig = field(default_factory=RedisConfig)
    ray: RayConfig = field(default_factory=RayConfig)
    wandb: WandbConfig = field(default_factory=WandbConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    monitoring: MonitoringConfig = field(default_factory=MonitoringConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    resume: str = one_of("never", "auto", "always")  # auto: resume when the run directory holds a checkpoint; always: require one
    # several policies trained at once, sharing rewards and data; each entry's sections start
    # from the top-level ones above. Empty: one policy named "policy" made of the top-level sections.
    policies: List[PolicyConfig] = field(default_factory=list)

    @property
    def run_dir(self) -> str:
        return os.path.join(self.output_dir, self.name)

    def policy_list(self) -> List[PolicyConfig]:
        if self.policies:
            return self.policies
        return [PolicyConfig("policy", self.model, self.sft, self.rl, self.rollout, learner=self.learner,
                             weights=self.weights)]

    def teacher_of(self, policy: PolicyConfig) -> Optional[PolicyConfig]:
        """The policy `policy` distils from (`distill.teacher`), or None."""
        return next((p for p in self.policy_list() if p.name == policy.distill.teacher), None)

    def generating_actors(self, policy: PolicyConfig) -> int:
        """A policy's actors that generate: its rollout workers (none for a policy trained by SFT alone, which
        generates only to evaluate) and, where the job evaluates, its evaluator."""
        return (policy.rollout.num_workers if policy.rl.enabled else 0) + int(self.eval.enabled)

    def policy_dir(self, policy: str) -> str:
        """Where a policy's checkpoint and models go: the run directory itself for a one-policy job."""
        return os.path.join(self.run_dir, policy) if self.policies else self.run_dir


def load_config(path: Optional[str] = None, overrides: Optional[List[str]] = None) -> JobConfig:
    """Merge the YAML at `path` and `key=value` overrides onto the schema and validate."""
    merged = OmegaConf.structured(JobConfig)
    source = path or "<defaults>"
    policy_entries: list = []
    given = OmegaConf.create()  # the keys the YAML and the overrides give, without the schema's defaults
    if path is not None:
        raw = _read_yaml(path)
        _check_keys(OmegaConf.to_container(raw), JobConfig, "", source)
        merged = _merge(merged, raw, source)
        policy_entries = list(raw.get("policies") or [])
        given = raw
    if overrides:
        _check_override_syntax(overrides)
        entries = [OmegaConf.to_container(entry) if OmegaConf.is_config(entry) else entry for entry in policy_entries]
        current = {**OmegaConf.to_container(merged), "policies": entries}
        dotlist = OmegaConf.create(_indexed_into_lists(OmegaConf.to_container(OmegaConf.from_dotlist(list(overrides))),
                                                       current, ""))
        _check_keys(OmegaConf.to_container(dotlist), JobConfig, "", "command-line override")
        merged = _merge(merged, dotlist, "command-line override")
        policy_entries = list(dotlist.get("policies") or policy_entries)
        given = OmegaConf.merge(given, dotlist)
    if policy_entries:
        merged.policies = _expand_policies(merged, policy_entries, source)
    config: JobConfig = OmegaConf.to_object(merged)
    config.redis.url = redis_url_with_secret(config.redis.url, source)
    source = source if not overrides else f"{source} with overrides {' '.join(overrides)}"
    _check_values(config, source)
    _check_unread_keys(config, OmegaConf.to_container(given), source)
    return config


def redis_url_with_secret(url: Optional[str], source: str) -> Optional[str]:
    """The job's Redis URL: `redis.url`, or `$RLP_REDIS_URL` where `redis.url` is unset or was saved with
    its password hidden (a run directory's config.yaml), so the password never sits in a config."""
    hidden = url is not None and "***" in url and url == redact_url(url)
    if url is None or hidden:
        from_env = os.environ.get(REDIS_URL_ENV)
        if from_env:
            return from_env
        if hidden:
            raise ConfigError(f"{source}: 'redis.url' was saved with its password hidden ({url}); export "
                              f"{REDIS_URL_ENV} with the URL and its password, then run the command again")
    return url


def to_yaml(config: JobConfig) -> str:
    """The resolved config as YAML (what a run directory records), passwords hidden."""
    return OmegaConf.to_yaml(OmegaConf.create(to_dict(config)))


def to_dict(config: JobConfig) -> dict:
    """The resolved config as plain data (the W&B run config), passwords hidden."""
    values = OmegaConf.to_container(OmegaConf.structured(config))
    if values["redis"]["url"]:
        values["redis"]["url"] = redact_url(values["redis"]["url"])
    return values


def redact_urls_in(text: str) -> str:
    """`text` with the password of every URL in it hidden (`redact_url`)."""
    return re.sub(r"[a-z][a-z0-9+.-]*://[^\s'\"]+", lambda found: redact_url(found.group(0)), text)


def redact_url(url: str) -> str:
    """`url` with its password hidden: in the user part (`user:PASS@`, `:PASS@`, `PASS@`) and
    in any `...password=` query parameter."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "***"
    netloc = parts.netloc
    if "@" in netloc:
        userinfo, host = netloc.rsplit("@", 1)
        netloc = f"{userinfo.split(':', 1)[0] if ':' in userinfo else ''}:***@{host}"
    query = re.sub(r"((?:^|&)[^=&]*password=)[^&]*", r"\1***", parts.query, flags=re.IGNORECASE)
    return urlunsplit(parts._replace(netloc=netloc, query=query))


def _read_yaml(path: str):
    if not os.path.isfile(path):
        raise ConfigError(f"{path}: no such config file")
    with open(path, "rb") as f:
        data = f.read()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ConfigError(f"{path}: not UTF-8 text (byte {err.start}: {err.reason})") from None
    try:
        raw = _load_yaml(text)
        if raw is None:
            raw = {}
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}: the top level must be a mapping of keys, got {type(raw).__name__}")
        return OmegaConf.create(raw)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" (line {mark.line + 1})" if mark else ""
        raise ConfigError(f"{path}{where}: {_yaml_problem(err)}") from None
    except OmegaConfBaseException as err:
        raise ConfigError(f"{path}: {str(err).splitlines()[0]}") from None
    except RecursionError:
        raise ConfigError(f"{path}: not valid YAML: nested too deeply") from None


def _load_yaml(text: str) -> Any:
    """`yaml.safe_load(text)`, once `_check_nodes` has walked the composed document."""
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        # written without aliases, every value takes at least a character: aliases that expand the document
        # beyond the file's length multiply it (a "billion laughs") rather than save repeating a section
        _check_nodes(loader, node, "", {}, set(), limit=len(text))
        return loader.construct_document(node)
    finally:
        loader.dispose()


class _DocumentError(yaml.MarkedYAMLError):
    """A document PyYAML composes but a job config refuses; `problem` is the whole message."""


def _yaml_problem(err: yaml.YAMLError) -> str:
    if isinstance(err, _DocumentError):
        return err.problem
    return f"not valid YAML: {getattr(err, 'problem', None) or str(err).splitlines()[0]}"


MERGE_TAG = "tag:yaml.org,2002:merge"


def _check_nodes(loader: yaml.SafeLoader, node: yaml.Node, key: str, sizes: Dict[int, int], open_nodes: Set[int],
                 *, limit: int) -> int:
    """The number of values in `node` with its aliases expanded (`sizes` keeps each node's, so a node shared
    by aliases is counted without walking it again). Raises `_DocumentError` on a key given twice in one
    mapping (PyYAML keeps the last silently), an alias inside its own anchor (`open_nodes`: the nodes being
    walked) and an expansion beyond `limit` values."""
    if id(node) in sizes:
        return sizes[id(node)]
    if id(node) in open_nodes:
        raise _DocumentError(problem=f"'{key}' is a recursive alias: an alias inside its own anchor",
                             problem_mark=node.start_mark)
    open_nodes.add(id(node))
    size = 1
    if isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            size += _check_nodes(loader, item, f"{key}[{i}]", sizes, open_nodes, limit=limit)
    elif isinstance(node, yaml.MappingNode):
        seen = set()
        for key_node, value in node.value:
            named = isinstance(key_node, yaml.ScalarNode) and key_node.tag != MERGE_TAG
            name = loader.construct_object(key_node) if named else "?"
            child = f"{key}.{name}" if key else str(name)
            if named and name in seen:
                raise _DocumentError(problem=f"key '{child}' is given twice", problem_mark=key_node.start_mark)
            seen.add(name)
            size += _check_nodes(loader, key_node, child, sizes, open_nodes, limit=limit)
            size += _check_nodes(loader, value, child, sizes, open_nodes, limit=limit)
    if size > limit:
        raise _DocumentError(problem=f"not valid YAML: its aliases expand it to over {limit} values, more than "
                                     f"its {limit} characters hold written out", problem_mark=node.start_mark)
    open_nodes.discard(id(node))
    sizes[id(node)] = size
    return size


def _check_override_syntax(overrides: List[str]) -> None:
    for item in overrides:
        if "=" not in item or item.startswith("="):
            raise ConfigError(f"override '{item}': expected key=value, e.g. rl.max_steps=5")


def _indexed_into_lists(given: dict, current: dict, prefix: str) -> dict:
    """`rewards[0].weight=2` reaches here as {'rewards': {'0': {'weight': 2}}}: each indexed entry is merged onto
    a copy of the list it indexes (the YAML's, or the default), so an override changes one entry of a list."""
    out = {}
    for key, value in given.items():
        here = current.get(key) if isinstance(current, dict) else None
        if isinstance(here, list) and isinstance(value, dict) and value and all(str(k).isdigit() for k in value):
            items = list(here)
            for index, entry in value.items():
                if int(index) >= len(items):
                    raise ConfigError(f"command-line override: '{prefix}{key}[{index}]': '{prefix}{key}' has "
                                      f"{len(items)} entries (indices 0-{len(items) - 1})")
                both = isinstance(entry, dict) and isinstance(items[int(index)], dict)
                items[int(index)] = OmegaConf.to_container(OmegaConf.merge(items[int(index)], entry)) if both else entry
            out[key] = items
        elif isinstance(value, dict) and isinstance(here, dict):
            out[key] = _indexed_into_lists(value, here, f"{prefix}{key}.")
        else:
            out[key] = value
    return out


def _expand_policies(merged, entries: list, source: str) -> list:
    """Each policy entry merged onto the job's top-level sections: they are the shared defaults."""
    shared = {section: merged[section] for section in POLICY_SECTIONS}
    return [_merge(_merge(OmegaConf.structured(PolicyConfig), shared, source), entry, source) for entry in entries]


def _check_keys(raw: Any, schema: type, prefix: str, source: str) -> None:
    """Name the full path of the first unknown key or misplaced value in `raw`."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: '{prefix.rstrip('.')}' must be a mapping of keys, got {raw!r}")
    fields = {f.name: f for f in dataclasses.fields(schema)}
    hints = typing.get_type_hints(schema)
    for key, value in raw.items():
        if key not in fields:
            close = difflib.get_close_matches(str(key), fields, n=1)
            hint = f"; did you mean '{prefix}{close[0]}'?" if close else ""
            raise ConfigError(f"{source}: unknown key '{prefix}{key}'{hint}")
        kind = hints[key]
        if dataclasses.is_dataclass(kind):
            _check_keys(value, kind, f"{prefix}{key}.", source)
        elif typing.get_origin(kind) in (list, List) and dataclasses.is_dataclass(typing.get_args(kind)[0]):
            if not isinstance(value, list):
                raise ConfigError(f"{source}: '{prefix}{key}' must be a list, got {value!r}")
            for i, item in enumerate(value):
                _check_keys(item, typing.get_args(kind)[0], f"{prefix}{key}[{i}].", source)


def _merge(base, update, source: str):
    try:
        return OmegaConf.merge(base, update)
    except ConfigKeyError as err:
        raise ConfigError(f"{source}: unknown key '{err.full_key}'") from None
    except OmegaConfBaseException as err:
        key = getattr(err, "full_key", None) or "?"
        reason = str(err).splitlines()[0]
        raise ConfigError(f"{source}: bad value for '{key}': {reason}") from None


def _check_values(config: JobConfig, source: str) -> None:
    _check_fields(config, "", source)
    _check_name(config.name, "name", source)
    if config.redis.url is not None:
        _check_redis_url(config.redis.url, source)
    names = [p.name for p in config.policies]
    if len(set(names)) != len(names):
        raise ConfigError(f"{source}: 'policies' names must be unique, got {names}")
    for i, policy in enumerate(config.policies):
        _check_name(policy.name, f"policies[{i}].name", source)
        _check_policy(policy, f"policies[{i}].", source)
        _check_distill(config, policy, f"policies[{i}].distill.", source)
    _check_policy(config, "", source)
    _check_resources(config.reward_workers.resources, "reward_workers.resources", source)
    for i, spec in enumerate(config.rewards):
        _check_reward_spec(spec, f"rewards[{i}]", source)
    if not config.rewards:
        raise ConfigError(f"{source}: 'rewards' is empty; name at least one reward")
    problems = (10 ** config.data.digits) ** 2
    if config.data.kind == "addition" and config.data.disjoint_test and config.data.test_size > problems // 2:
        raise ConfigError(f"{source}: 'data.test_size' is {config.data.test_size}; at most {problems // 2} "
                          f"(half of the {problems} distinct {config.data.digits}-digit additions) can be held out")
    _check_data(config.data, source)
    _check_eval(config, source)
    _check_env(config.env, source)
    for i, policy in enumerate(config.policy_list()):
        prefix = f"policies[{i}]." if config.policies else ""
        limit = config.env.completion_tokens(policy.rl.max_new_tokens)
        if policy.rl.overlong_buffer >= limit:
            raise ConfigError(f"{source}: '{prefix}rl.overlong_buffer' is {policy.rl.overlong_buffer}; it must be below "
                              f"the completion limit it ends at ({limit} tokens)")
        _check_sizes(config, policy, prefix, source)


def _check_distill(config: JobConfig, policy: PolicyConfig, prefix: str, source: str) -> None:
    """A student's teacher is another policy of the job, itself no student, that reads the student's token ids as
    the student does, and the student's samples are single turns it generates itself."""
    distill = policy.distill
    if distill.teacher is None:
        return
    names = [p.name for p in config.policies]
    teacher = config.teacher_of(policy)
    if teacher is None or teacher.name == policy.name:
        raise ConfigError(f"{source}: '{prefix}teacher' is {distill.teacher!r}; it must name another policy of the "
                          f"job: {', '.join(n for n in names if n != policy.name)}")
    if teacher.distill.teacher is not None:
        raise ConfigError(f"{source}: '{prefix}teacher' is {teacher.name!r}, which distils from "
                          f"{teacher.distill.teacher!r} itself; a teacher learns from rewards alone")
    if (policy.model.kind, teacher.model.kind) == ("demo", "demo") and \
            policy.model.extra_chars != teacher.model.extra_chars:
        raise ConfigError(f"{source}: '{prefix}teacher' {teacher.name!r} has another tokenizer (model.extra_chars "
                          f"{teacher.model.extra_chars!r}, the student's {policy.model.extra_chars!r}); the teacher "
                          f"scores the student's token ids")
    if config.env.multi_turn or policy.rollout.source != "dataset":
        raise ConfigError(f"{source}: '{prefix}teacher' is set; distillation scores single-turn samples a rollout "
                          f"worker generates from the data (env.kind single_turn, rollout.source dataset)")
    if not distill.task_reward and policy.rl.dynamic_sampling:
        raise ConfigError(f"{source}: '{prefix}task_reward' is false with rl.dynamic_sampling, which drops groups "
                          f"for their rewards; the distillation signal alone does not read them")
    if distill.mode == "reverse_kl":
        default = DistillConfig()
        for key, value in (("top_k", distill.top_k), ("temperature", distill.temperature)):
            if value != getattr(default, key):
                raise ConfigError(f"{source}: '{prefix}{key}' is {value!r} but '{prefix}mode' is reverse_kl, which "
                                  f"does not read it (only forward_kl does)")
    if distill.mode == "forward_kl" and (policy.model.num_experts or teacher.rollout.engine == "vllm"):
        raise ConfigError(f"{source}: '{prefix}mode' is forward_kl, which needs a dense student (its extra pass does "
                          f"not replay routing) and a teacher on the transformers engine (its top tokens); use "
                          f"reverse_kl")


def _check_sizes(config: JobConfig, policy: PolicyConfig, prefix: str, source: str) -> None:
    """One policy's sizes against each other, its model and this machine's memory."""
    rl = policy.rl
    if rl.max_staleness > rl.max_steps:
        raise ConfigError(f"{source}: '{prefix}rl.max_staleness' is {rl.max_staleness}; it must be <= {rl.max_steps} "
                          f"({prefix}rl.max_steps): no sample can fall more versions behind than the job has steps")
    if policy.model.kind == "demo":
        completion = max(config.env.completion_tokens(rl.max_new_tokens), config.eval.max_new_tokens)
        _check_demo_shape(policy.model, completion, f"{prefix}model.", source)
    _check_memory(config, policy, prefix, source)


def _check_demo_shape(model: ModelConfig, completion: int, prefix: str, source: str) -> None:
    """The demo model's widths fit together (the heads split the width, the key/value heads the heads, and
    rotary position embeddings rotate pairs of a head's dimensions) and its context holds a prompt of at least
    one token and the longest `completion`."""
    if model.hidden_size % model.num_heads:
        raise ConfigError(f"{source}: '{prefix}num_heads' is {model.num_heads}; it must divide '{prefix}hidden_size' "
                          f"({model.hidden_size})")
    if model.num_heads % model.num_kv_heads:
        raise ConfigError(f"{source}: '{prefix}num_kv_heads' is {model.num_kv_heads}; it must divide "
                          f"'{prefix}num_heads' ({model.num_heads})")
    head_size = model.hidden_size // model.num_heads
    if head_size % 2:
        raise ConfigError(f"{source}: '{prefix}num_heads' is {model.num_heads}; the head size, '{prefix}hidden_size' "
                          f"({model.hidden_size}) / num_heads = {head_size}, must be even (rotary position "
                          f"embeddings rotate pairs)")
    if model.num_experts and model.experts_per_token > model.num_experts:
        raise ConfigError(f"{source}: '{prefix}experts_per_token' is {model.experts_per_token}; a token can be routed "
                          f"to at most the layer's {model.num_experts} experts ('{prefix}num_experts')")
    if model.max_positions <= completion:
        raise ConfigError(f"{source}: '{prefix}max_positions' is {model.max_positions}; it must be >= {completion + 1}: "
                          f"a prompt token and the longest completion ({completion} tokens: rl.max_new_tokens, "
                          f"env's episode budget or eval.max_new_tokens)")


def _check_memory(config: JobConfig, policy: PolicyConfig, prefix: str, source: str) -> None:
    """What a policy's limits make it hold at once fits this machine's memory: a learner step's token ids and,
    for the demo model (whose shape the config gives), a rollout worker's KV cache."""
    rl, model, memory = policy.rl, policy.model, _machine_memory()
    rows, tokens = rl.batch_prompts * rl.group_size, 1 + config.env.completion_tokens(rl.max_new_tokens)
    # each row at least one prompt token and a completion at its limit; its ids alone are int64 (8 bytes) on the learner
    step = rows * tokens * 8
    if step > memory:
        raise ConfigError(f"{source}: '{prefix}rl.batch_prompts' x '{prefix}rl.group_size' is {rl.batch_prompts} x "
                          f"{rl.group_size} = {rows} rows a learner step; their token ids alone ({tokens} a row: a "
                          f"prompt token and the completion limit) take {_gib(step)}, more than this machine's "
                          f"{_gib(memory)} of memory")
    if model.kind != "demo":
        return
    # a rollout worker decodes prompts_per_batch groups at once; each sequence keeps keys and values (2 x
    # num_kv_heads x head size elements a layer, 2 bytes each, 4 in float32) for the context it may fill
    sequences = policy.rollout.prompts_per_batch * rl.group_size
    element = 4 if model.dtype == "float32" else 2
    per_position = model.num_layers * 2 * model.num_kv_heads * (model.hidden_size // model.num_heads) * element
    cache = sequences * model.max_positions * per_position
    if cache > memory:
        raise ConfigError(f"{source}: '{prefix}rollout.prompts_per_batch' x '{prefix}rl.group_size' is "
                          f"{policy.rollout.prompts_per_batch} x {rl.group_size} = {sequences} sequences a rollout "
                          f"worker decodes at once; their keys and values over the model's {model.max_positions} "
                          f"positions take {_gib(cache)}, more than this machine's {_gib(memory)} of memory")


def _machine_memory() -> int:
    """This machine's memory in bytes."""
    return psutil.virtual_memory().total


def _gib(size: int) -> str:
    return f"{size / (1 << 30):.1f} GiB"


DEMO_SHAPE = ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size", "max_positions",
              "extra_chars", "num_experts", "experts_per_token", "expert_size", "router_aux_loss_coef")
# the kinds that read a key only some kinds read: given to a section of another kind, it would do nothing
MODEL_READERS = {"path": ("pretrained",), **dict.fromkeys(DEMO_SHAPE, ("demo",))}
DATA_READERS = {"train_path": ("jsonl", "hf"), "test_path": ("jsonl", "hf"), "path": ("hf",)}


def _check_unread_keys(config: JobConfig, given: dict, source: str) -> None:
    """Refuse a key that the YAML or an override (`given`) sets, to a value other than the one it has anyway,
    where its section's kind never reads it."""
    kind = config.data.kind
    _refuse_unread(given.get("data") or {}, DATA_READERS, config.data, DataConfig(), [kind], prefix="data.",
                   where=f"'data.kind' is {kind}", source=source)
    if not config.policies:
        kind = config.model.kind
        _refuse_unread(given.get("model") or {}, MODEL_READERS, config.model, ModelConfig(), [kind], prefix="model.",
                       where=f"'model.kind' is {kind}", source=source)
        return
    entries = [entry.get("model") or {} for entry in given.get("policies") or []]
    for i, (policy, entry) in enumerate(zip(config.policies, entries)):
        kind = policy.model.kind  # an entry's own value counts where it differs from the shared one it replaces
        _refuse_unread(entry, MODEL_READERS, policy.model, config.model, [kind],
                       prefix=f"policies[{i}].model.", where=f"'policies[{i}].model.kind' is {kind}", source=source)
    for key in given.get("model") or {}:  # a shared key reaches the policies whose entry gives no value of its own
        kinds = [policy.model.kind for policy, entry in zip(config.policies, entries) if key not in entry]
        _refuse_unread([key], MODEL_READERS, config.model, ModelConfig(), kinds, prefix="model.",
                       where=f"the policies taking it have model.kind {'/'.join(sorted(set(kinds)))}", source=source)


def _refuse_unread(keys: Iterable[str], readers: Dict[str, tuple], section: Any, baseline: Any, kinds: List[str],
                   *, prefix: str, where: str, source: str) -> None:
    """The first of `keys` with a value in `section` other than `baseline`'s that none of `kinds` reads."""
    for key in keys:
        if key not in readers or not kinds or set(kinds) & set(readers[key]):
            continue
        value = getattr(section, key)
        if value != getattr(baseline, key):
            raise ConfigError(f"{source}: '{prefix}{key}' is {value!r} but {where}, which does not read it (only "
                              f"{' or '.join(readers[key])} does)")


def _check_env(env: EnvConfig, source: str) -> None:
    for i, spec in enumerate(env.tools):
        if bool(spec.name) == bool(spec.fn):
            raise ConfigError(f"{source}: 'env.tools[{i}]' needs exactly one of 'name' or 'fn'")
    if env.kind == "tools" and not env.fn and not env.tools:
        raise ConfigError(f"{source}: 'env.kind' is tools but 'env.tools' is empty; list the tools the model may "
                          f"call, e.g. tools: [{{name: calculator}}]")
    if env.fn and ":" not in env.fn:
        raise ConfigError(f"{source}: 'env.fn' is {env.fn!r}; expected 'package.module:Class'")
    if env.kind == "verifiers" and (not env.taskset or env.fn):
        raise ConfigError(f"{source}: 'env.kind' is verifiers: set 'env.taskset' to the taskset's module (e.g. "
                          f"my_sums), and no 'env.fn'")


def _check_data(data: DataConfig, source: str) -> None:
    if data.kind == "jsonl":
        _require_path(data.train_path, "data.train_path", source)
        _require_path(data.test_path, "data.test_path", source)
    if data.kind != "hf":
        return
    if data.path:
        _require_path(data.path, "data.path", source, directory=True)
        return
    for key in ("train_path", "test_path"):
        path = getattr(data, key)
        if not path:
            raise ConfigError(f"{source}: 'data.kind' is hf: set 'data.path' (a save_to_disk directory) "
                              f"or both 'data.train_path' and 'data.test_path'")
        if not os.path.exists(path):
            raise ConfigError(f"{source}: 'data.{key}' points at {path!r}, which does not exist")


def _check_eval(config: JobConfig, source: str) -> None:
    stopping = [f"{f'policies[{i}].' if config.policies else ''}sft.stop_at_accuracy"
                for i, policy in enumerate(config.policy_list()) if policy.sft.enabled and policy.sft.stop_at_accuracy]
    if not config.eval.enabled and stopping:
        raise ConfigError(f"{source}: '{stopping[0]}' is set but 'eval.enabled' is false: SFT stops on held-out "
                          f"accuracy, which only the evaluator measures; enable eval or unset {stopping[0]}")
    if config.eval.greedy and config.eval.samples_per_prompt > 1:
        raise ConfigError(f"{source}: 'eval.samples_per_prompt' is {config.eval.samples_per_prompt}; greedy "
                          f"completions are all alike: set 'eval.greedy: false' to sample several")
    labels = [spec.label for spec in config.rewards if spec.role == "reward"]
    if config.eval.pass_reward is not None and config.eval.pass_reward not in labels:
        raise ConfigError(f"{source}: 'eval.pass_reward' is {config.eval.pass_reward!r}; expected one of the "
                          f"role=reward entries {labels}")


def _check_fields(value: Any, prefix: str, source: str) -> None:
    """Every field's declared constraint (`one_of`, `at_least`, `above`), through nested sections and lists."""
    for spec in dataclasses.fields(value):
        key, current = f"{prefix}{spec.name}", getattr(value, spec.name)
        if dataclasses.is_dataclass(current):
            _check_fields(current, f"{key}.", source)
        elif isinstance(current, list):
            for i, item in enumerate(current):
                if dataclasses.is_dataclass(item):
                    _check_fields(item, f"{key}[{i}].", source)
        elif current is not None:
            _check_number(current, key, source)
            _check_constraint(spec.metadata, current, key, source)


INT64 = 2 ** 63  # integers past ±this overflow the int64 tensors, numpy arrays and Redis counters they end up in


def _check_number(value: Any, key: str, source: str) -> None:
    """A float that is a number (nan passes every bound: each comparison with it is false) and an int within
    int64."""
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{source}: '{key}' is {value!r}; it must be a finite number")
    if isinstance(value, int) and not -INT64 <= value < INT64:
        raise ConfigError(f"{source}: '{key}' is {value!r}; it must fit a signed 64-bit integer "
                          f"({-INT64} to {INT64 - 1})")


def _check_constraint(metadata, value: Any, key: str, source: str) -> None:
    if "choices" in metadata and value not in metadata["choices"]:
        raise ConfigError(f"{source}: '{key}' is {value!r}; expected one of {list(metadata['choices'])}")
    if "at_least" in metadata and value < metadata["at_least"]:
        raise ConfigError(f"{source}: '{key}' is {value!r}; it must be >= {metadata['at_least']}")
    if "above" in metadata and value <= metadata["above"]:
        raise ConfigError(f"{source}: '{key}' is {value!r}; it must be > {metadata['above']}")


NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")


def _check_name(name: str, key: str, source: str) -> None:
    """A name that is one folder inside the run directory: no '/', no '..', not absolute."""
    if not NAME.fullmatch(name):
        raise ConfigError(f"{source}: '{key}' is {name!r}; use 1-100 letters, digits, '.', '_' or '-', "
                          f"starting with a letter or digit (it names a folder under output_dir)")


def _check_redis_url(url: str, source: str) -> None:
    """A URL redis-py can open: redis://host[:port][/db], rediss://... (TLS) or unix:///path."""
    try:
        parts = urlsplit(url)
        has_target = parts.path not in ("", "/") if parts.scheme == "unix" else bool(parts.hostname) and parts.port != 0
    except ValueError as err:  # a port that is not a number in 1-65535
        raise ConfigError(f"{source}: 'redis.url' {redact_url(url)!r} is not a valid URL: {err}") from None
    if parts.scheme not in ("redis", "rediss", "unix") or not has_target:
        raise ConfigError(f"{source}: 'redis.url' is {redact_url(url)!r}; expected "
                          f"redis://[:password@]host[:port][/db], rediss://... or unix:///path/to/redis.sock")


def _check_policy(config, prefix: str, source: str) -> None:
    """What one policy's sections need beyond their fields' own constraints."""
    if config.model.kind == "pretrained":
        _require_path(config.model.path, f"{prefix}model.path", source, directory=True)
    if config.model.dtype == "float16" and config.learner.device == "cpu":
        raise ConfigError(f"{source}: '{prefix}model.dtype' is float16 but '{prefix}learner.device' is cpu: DeepSpeed "
                          f"trains float16 on GPUs only; use bfloat16 (or float32) on CPU")
    _check_resources(config.rollout.resources, f"{prefix}rollout.resources", source)
    rollout = config.rollout
    if rollout.max_workers is not None and rollout.max_workers < rollout.num_workers:
        raise ConfigError(f"{source}: '{prefix}rollout.max_workers' is {rollout.max_workers}, below "
                          f"'{prefix}rollout.num_workers' ({rollout.num_workers}): the workers range from num_workers "
                          f"up to max_workers")
    if (rollout.max_workers or 0) > rollout.num_workers and config.weights.transport in ("broadcast", "cuda_ipc"):
        raise ConfigError(f"{source}: '{prefix}rollout.max_workers' lets rollout workers join while the job runs, but "
                          f"'{prefix}weights.transport' is {config.weights.transport}, whose receivers are fixed when "
                          f"the job starts; use weights.transport object_store (or auto)")
    _check_resources(config.learner.resources, f"{prefix}learner.resources", source)
    if config.rollout.source == "bridge" and not config.rollout.openai_bridge.enabled:
        raise ConfigError(f"{source}: '{prefix}rollout.source' is bridge but '{prefix}rollout.openai_bridge.enabled' is "
                          f"false: nothing would generate; enable the bridge, or use rollout.source: dataset")
    lora = config.model.lora
    if lora.enabled and (lora.dropout >= 1 or not lora.target_modules):
        raise ConfigError(f"{source}: '{prefix}model.lora' needs a dropout below 1 and at least one target module, "
                          f"got dropout {lora.dropout} and target_modules {lora.target_modules}")
    learner = config.learner
    if learner.num_ranks > 1 and learner.num_gpus is not None and 0 < learner.num_gpus < 1:
        raise ConfigError(f"{source}: '{prefix}learner.num_gpus' is {learner.num_gpus} with {learner.num_ranks} ranks: "
                          f"NCCL needs a whole GPU per rank; set it to 1 or use one rank")
    if learner.bf16_mode == "master_weights" and learner.zero_stage == 0:
        raise ConfigError(f"{source}: '{prefix}learner.bf16_mode' is master_weights under ZeRO-0, where DeepSpeed keeps "
                          f"no float32 master weights; use learner.zero_stage 1-3 (or leave it unset: 1), or "
                          f"bf16_mode autocast")
    if learner.compile and learner.zero_stage == 3:
        raise ConfigError(f"{source}: '{prefix}learner.compile' is true under ZeRO-3, which gathers each layer's "
                          f"weights in hooks torch.compile cannot trace; use learner.zero_stage 0-2 or leave compile unset")


def _check_resources(resources: Dict[str, float], key: str, source: str) -> None:
    """Custom Ray resources: positive amounts of names Ray does not reserve itself."""
    for name, amount in resources.items():
        if name in ("CPU", "GPU", "memory", "object_store_memory") or not 0 < amount < math.inf:
            raise ConfigError(f"{source}: '{key}.{name}' is {amount!r}; give custom resources (a name the nodes "
                              f"declare with `ray start --resources`) a positive, finite amount; CPUs and GPUs have "
                              f"their own keys")


def _check_reward_spec(spec: RewardSpec, key: str, source: str) -> None:
    if bool(spec.name) == bool(spec.fn):
        raise ConfigError(f"{source}: '{key}' needs exactly one of 'name' or 'fn'")
    if spec.fn and ":" not in spec.fn:
        raise ConfigError(f"{source}: '{key}.fn' is {spec.fn!r}; expected 'package.module:function'")


def _require_path(path: Optional[str], key: str, source: str, directory: bool = False) -> None:
    if not path:
        raise ConfigError(f"{source}: '{key}' is required")
    exists = os.path.isdir(path) if directory else os.path.isfile(path)
    if not exists:
        other = "a file" if os.path.isfile(path) else "a directory" if os.path.isdir(path) else None
        wanted = "a directory" if directory else "a file"
        raise ConfigError(f"{source}: '{key}' points at {path!r}, which " +
                          (f"is {other}, not {wanted}" if other else "does not exist"))

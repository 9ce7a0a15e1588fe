"""Checks a job's files and cluster address before any service starts.

`check(config, source)` runs after `load_config` and before Redis, Ray or any worker starts:
every JSONL row parses, every pretrained model folder loads its config and tokenizer, a verifiers
taskset (`env.kind: verifiers`) loads with tasks to train on beyond those held out, an OpenAI
bridge reachable from other machines has its key in the environment, a vLLM
rollout engine can run here, and the Ray cluster to join answers on its port. A failure is a
`ConfigError` naming the file (and line) or the key, so `rlp run` and `rlp validate` stop with one
line and exit code 2.
"""

from __future__ import annotations

import importlib.util
import ipaddress
import os
import socket
from typing import Optional, Tuple

from rlplatform.config import ConfigError, JobConfig, ModelConfig

CONNECT_TIMEOUT_S = 5.0  # how long the Ray address may take to accept a connection
VLLM_MAX_TEMPERATURE = 2.0  # vLLM's SamplingParams refuse a higher one
SLOW_TOKENIZER_FILES = ("tokenizer.model", "vocab.json", "vocab.txt")  # what a folder without tokenizer.json needs


def check(config: JobConfig, source: str) -> None:
    """Every pre-start check; raises `ConfigError` on the first problem."""
    check_without_models(config, source)
    check_models(config, source)


def check_without_models(config: JobConfig, source: str) -> None:
    """The checks that load no model config, so import neither torch nor transformers (but for vLLM)."""
    check_data(config, source)
    check_taskset(config, source)
    check_engines(config, source)
    check_weights(config, source)
    check_bridges(config, source)
    check_ray_address(config, source)


def check_taskset(config: JobConfig, source: str) -> None:
    """`env.kind: verifiers`: the taskset loads (the verifiers extra installed), ends, and holds more tasks than
    `env.test_tasks`."""
    env = config.env
    if not env.plays_taskset:
        return
    from rlplatform.envs.taskset_source import split_tasks
    from rlplatform.envs.verifiers_rollouts import load_env

    try:
        split_tasks(load_env(env.taskset, env.taskset_args), env.test_tasks)
    except (ImportError, ValueError, TypeError) as err:
        raise ConfigError(f"{source}: 'env.taskset' is {env.taskset!r}: {err}") from None


def check_models(config: JobConfig, source: str) -> None:
    """Each pretrained policy's folder (`check_model`), and adapters on a dense model only (`check_adapters`);
    imports transformers, and so torch."""
    for i, policy in enumerate(config.policy_list()):
        prefix = f"policies[{i}]." if config.policies else ""
        if policy.model.kind == "pretrained":
            check_model(policy.model.path, f"{prefix}model.path", source)
        check_adapters(policy.model, prefix, source)
        if policy.model.kind == "pretrained" and policy.rollout.engine == "vllm" and _vllm_on_cpu(config):
            from transformers import AutoConfig

            hf = AutoConfig.from_pretrained(policy.model.path)
            head_size = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
            check_vllm_cpu_head_size(head_size, f"{prefix}rollout.engine", source)


def check_adapters(model: ModelConfig, prefix: str, source: str) -> None:
    """`model.lora` on a dense model only: a mixture of experts holds each layer's experts in fused 3-D tensors
    (Qwen3-MoE's `gate_up_proj`, `down_proj`), which LoRA's linear adapters do not reach."""
    experts = _experts(model) if model.lora.enabled else 0
    if experts:
        raise ConfigError(f"{source}: '{prefix}model.lora.enabled' is true but the model is a mixture of "
                          f"{experts} experts a layer, whose experts are fused 3-D tensors that LoRA's "
                          f"adapters do not reach; train all its weights (model.lora.enabled: false)")


def check_bridges(config: JobConfig, source: str) -> None:
    """An OpenAI bridge that listens beyond the loopback interface has its key in the environment."""
    for i, policy in enumerate(config.policy_list()):
        bridge = policy.rollout.openai_bridge
        if bridge.enabled and not is_loopback(bridge.host) and not os.environ.get(bridge.api_key_env):
            prefix = f"policies[{i}]." if config.policies else ""
            raise ConfigError(f"{source}: '{prefix}rollout.openai_bridge.host' is {bridge.host}, reachable from other "
                              f"machines, but ${bridge.api_key_env} is not set: export it (a secret key agents send "
                              "as 'Authorization: Bearer <key>'), or listen on 127.0.0.1")


def is_loopback(host: str) -> bool:
    """Whether `host` is reachable from this machine only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_engines(config: JobConfig, source: str) -> None:
    """`rollout.engine: vllm` has the vllm package and, on a local cluster without a CUDA GPU (vLLM's CPU
    build), a model whose head size vLLM's CPU attention takes and, for a mixture of experts, routing replay off (that
    build records no routing); with `model.lora`, a rank and dtype vLLM's LoRA layers take."""
    for i, policy in enumerate(config.policy_list()):
        if policy.rollout.engine != "vllm":
            continue
        prefix = f"policies[{i}]." if config.policies else ""
        key = f"{prefix}rollout.engine"
        if policy.model.lora.enabled:
            _check_vllm_lora(policy.model, prefix, source, _vllm_on_cpu(config))
        if importlib.util.find_spec("vllm") is None:
            raise ConfigError(f"{source}: '{key}' is vllm but the vllm package is not installed; run install.sh "
                              f"(vLLM's CUDA or CPU build, as the machine has), or use rollout.engine: transformers")
        sampled = [("rl.temperature", policy.rl.temperature)] + ([] if config.eval.greedy else
                                                                 [("eval.temperature", config.eval.temperature)])
        for name, temperature in sampled:
            if temperature > VLLM_MAX_TEMPERATURE:
                raise ConfigError(f"{source}: '{prefix}{name}' is {temperature:g} but '{key}' is vllm, which samples at "
                                  f"temperatures up to {VLLM_MAX_TEMPERATURE:g}; lower it or use rollout.engine: "
                                  f"transformers")
        if _vllm_on_cpu(config) and _experts(policy.model) and policy.rl.routing_replay:
            raise ConfigError(f"{source}: '{prefix}rl.routing_replay' is true but '{key}' is vllm on the CPU, whose "
                              f"build cannot return the experts it routed each token to (its V2 model runner needs "
                              f"a GPU); set rl.routing_replay: false (the learner routes each token itself) or use "
                              f"rollout.engine: transformers")
        if policy.model.kind == "demo" and _vllm_on_cpu(config):
            check_vllm_cpu_head_size(policy.model.hidden_size // policy.model.num_heads, key, source)


def _experts(model) -> int:
    """The experts a layer of the policy's model holds (0: a dense model)."""
    if model.kind == "demo":
        return model.num_experts
    from rlplatform.policy import experts_of

    return experts_of(model.path)


def _vllm_on_cpu(config: JobConfig) -> bool:
    """Whether vLLM engines run on this machine's CPU: a local cluster on a machine without a CUDA GPU."""
    import torch

    return not (config.ray.address or os.environ.get("RAY_ADDRESS")) and not torch.cuda.is_available()


def check_vllm_cpu_head_size(head_size: int, key: str, source: str) -> None:
    """vLLM's CPU attention takes only some head sizes."""
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    sizes = CPUAttentionBackend.get_supported_head_sizes()
    if head_size not in sizes:
        raise ConfigError(f"{source}: '{key}' is vllm on the CPU, whose attention takes head sizes {sizes}, but the "
                          f"model's is {head_size}; change model.hidden_size / model.num_heads or use "
                          f"rollout.engine: transformers")


def check_weights(config: JobConfig, source: str) -> None:
    """`weights.delta` only where it saves bytes: full weights (LoRA streams the adapters alone) through a
    transport that moves them between devices."""
    from rlplatform.transport.weight_transports import moves_bytes, resolved_transport

    for i, policy in enumerate(config.policy_list()):
        if not policy.weights.delta:
            continue
        if policy.model.lora.enabled:
            why = "LoRA streams the adapters alone"
        elif not moves_bytes(resolved_transport(policy.weights, one_gpu=True, lora=False)):  # (with deltas, auto
            # is object_store on any cluster)
            why = f"weights.transport {policy.weights.transport} moves no bytes between devices"
        else:
            continue
        prefix = f"policies[{i}]." if config.policies else ""
        raise ConfigError(f"{source}: '{prefix}weights.delta' is true, but {why}; turn it off (it saves bytes sent "
                          f"over object_store or broadcast)")


def _check_vllm_lora(model, prefix: str, source: str, on_cpu: bool) -> None:
    """What vLLM's LoRA layers take: a rank up to its largest, and on a GPU weights in bfloat16 or float16 (its
    CUDA kernels' only dtypes)."""
    from rlplatform.actors.vllm_engine import MAX_LORA_RANKS

    engine = f"'{prefix}rollout.engine' is vllm"
    if model.lora.rank > MAX_LORA_RANKS[-1]:
        raise ConfigError(f"{source}: '{prefix}model.lora.rank' is {model.lora.rank} but {engine}, whose LoRA "
                          f"ranks go up to {MAX_LORA_RANKS[-1]}; lower the rank or use rollout.engine: transformers")
    if model.dtype == "float32" and not on_cpu:
        raise ConfigError(f"{source}: '{prefix}model.dtype' is float32 with '{prefix}model.lora' but {engine}, whose "
                          f"CUDA LoRA kernels take bfloat16 or float16; set model.dtype: bfloat16 or use "
                          f"rollout.engine: transformers")


def check_data(config: JobConfig, source: str) -> None:
    """Each data file reads (a JSONL file line by line into JSON objects), holds rows, and every row has a
    usable prompt (text under `prompt`, or `messages` of known roles with text content) and the fields the
    configured built-in rewards read (`answer`, `tests`, ...)."""
    data = config.data
    if data.kind not in ("jsonl", "hf"):
        return
    from rlplatform.data import canonical_rows, load_rows, read_jsonl

    keys, paths = ("data.train_path", "data.test_path"), (data.train_path or data.path, data.test_path or data.path)
    if data.kind == "jsonl":
        splits = []
        for key, path in zip(keys, paths):
            try:
                splits.append(canonical_rows(read_jsonl(path), data, path))
            except ValueError as err:  # naming the file and line or row
                raise ConfigError(f"{err} ('{key}' in {source})") from None
    else:
        from datasets import disable_progress_bars

        disable_progress_bars()  # the check's output is its one line
        try:
            splits = load_rows(data, config.seed)
        except UnicodeDecodeError as err:  # from the datasets library's reader, which does not name the file
            raise ConfigError(f"{paths[0]}: not UTF-8 text (byte {err.start}: {err.reason}) "
                              f"(data in {source})") from None
        except ValueError as err:  # the row check's, naming the file and row
            raise ConfigError(f"{err} (data in {source})") from None
        except Exception as err:  # the datasets library's own errors (a file it cannot parse)
            raise ConfigError(f"{paths[0]}: cannot be read as data: {type(err).__name__}: "
                              f"{str(err).splitlines()[0][:200]} (data in {source})") from None
    for key, path, rows in zip(keys, paths, splits):
        if not rows:
            raise ConfigError(f"{path}: no rows ('{key}' in {source}); each row needs 'prompt' or 'messages'")
        _check_reward_fields(config, rows, path, source)


def _check_reward_fields(config: JobConfig, rows, path: str, source: str) -> None:
    """Every row holds the fields the job's built-in rewards read (a missing one would score 0 or fail late)."""
    from rlplatform.rewards.builtins import ROW_FIELDS

    needed = [(field, f"rewards[{i}] ({spec.name})") for i, spec in enumerate(config.rewards)
              if spec.name in ROW_FIELDS for field in ROW_FIELDS[spec.name](spec.params)]
    for row_number, row in enumerate(rows, 1):
        for field, reward in needed:
            if field not in row:
                raise ConfigError(f"{path}: row {row_number} has no '{field}', which {reward} reads (fields: "
                                  f"{sorted(row)}); add it, map it with data.answer_key, or change the reward "
                                  f"(in {source})")


def check_model(path: str, key: str, source: str) -> None:
    """The folder holds a Hugging Face config that loads and a tokenizer (no weights are read)."""
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ConfigError(f"{source}: '{key}' points at {path!r}, which has no config.json; "
                          f"give a Hugging Face model folder (save_pretrained output)")
    fast = os.path.join(path, "tokenizer.json")
    if os.path.isfile(fast):
        from tokenizers import Tokenizer

        _load_or_fail(Tokenizer.from_file, fast, "tokenizer", key, source)
    elif not any(os.path.isfile(os.path.join(path, name)) for name in SLOW_TOKENIZER_FILES):
        raise ConfigError(f"{source}: '{key}' points at {path!r}, which has no tokenizer "
                          f"(tokenizer.json, or one of {', '.join(SLOW_TOKENIZER_FILES)})")
    from transformers import AutoConfig  # last: it imports torch

    _load_or_fail(AutoConfig.from_pretrained, path, "config", key, source)


def _load_or_fail(load, target: str, part: str, key: str, source: str) -> None:
    try:
        load(target)
    except Exception as err:  # transformers and tokenizers raise many kinds; all mean it cannot be used
        reason = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise ConfigError(f"{source}: '{key}': the {part} at {target!r} does not load: {reason}") from None


def check_ray_address(config: JobConfig, source: str) -> None:
    """The Ray cluster the job joins (`ray.address`, else RAY_ADDRESS) accepts a connection."""
    key, address = ("ray.address", config.ray.address) if config.ray.address else (
        "RAY_ADDRESS", os.environ.get("RAY_ADDRESS") or None)
    target = _host_port(address, key, source)
    if target is None:
        return
    try:
        socket.create_connection(target, timeout=CONNECT_TIMEOUT_S).close()
    except OSError as err:
        reason = err.strerror or str(err) or type(err).__name__
        raise ConfigError(f"{source}: '{key}' is {address!r} but no Ray cluster answers at {target[0]}:{target[1]} "
                          f"({reason}); start it (ray start --head) or fix the address") from None


def _host_port(address: Optional[str], key: str, source: str) -> Optional[Tuple[str, int]]:
    """(host, port) to probe; None for a local cluster ('local', unset) or one Ray finds itself ('auto')."""
    if address in (None, "local", "auto"):
        return None
    host, _, port = address.removeprefix("ray://").rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"{source}: '{key}' is {address!r}; expected host:port (the head's GCS port, "
                          f"e.g. 10.0.0.5:6379), ray://host:port, 'auto' or 'local'")
    return host.strip("[]"), int(port)

"""Accelerator figures for a small real-architecture policy: generation tokens/s (rlplatform's
transformers engine as configured by default, i.e. its slot decoder with CUDA graphs on a GPU, and its dynamic
loop beside it; its vLLM engine when vllm is installed and CUDA is present), seconds per weight
sync for each `weights.transport` (learner rank 0's weights loaded into an engine in another process:
object_store, broadcast, cuda_ipc), and learner tokens/s and MFU (one DeepSpeed learner rank, in this
process, running the RL step the jobs run; then the same steps with eager layers where the default compiled
them, and in bfloat16 with `learner.bf16_mode: autocast`), and the whole job beside its peer: `rlp run`
on the same policy and prompts (one learner rank and two rollout workers: on one GPU the defaults share it and
sync weights by CUDA IPC)
in trained samples/s, and TRL's GRPOTrainer on the same device, policy, prompts, group size and completion
limit (benchmarks/gpu_job.py). Everything runs in `model.dtype: auto` (bfloat16 on CUDA,
float32 on CPU) with the default memory settings: the learner's micro-batch budget comes from the
device's free memory, nothing is set by hand.

The policy is a Qwen2-architecture model built from config with random weights (`--size 0.5b`:
Qwen2-0.5B's shapes, 151,936-token vocabulary) and a word-level tokenizer over the same ids, so
nothing is downloaded. Without CUDA every figure but vLLM's and CUDA IPC's is measured on CPU (the
broadcast over gloo), which is how the test suite checks this script at `--size tiny`. On GPU the
broadcast runs over NCCL, which needs a second GPU for the engine (NCCL takes one GPU per rank).

Usage: python benchmarks/gpu.py [--size 0.5b|tiny] [--prompts 64] [--group 8] [--new-tokens 128]
           [--learner-steps 3] [--job-steps 8] [--profile] [--out benchmarks/results/gpu.md]
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import os
import platform
import random
import socket
import sys
import tempfile
import time
from datetime import date
from typing import Dict, List

import ray
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

from gpu_job import job_figures, trl_figures  # benchmarks/gpu_job.py, beside this script
from rlplatform.actors.engine import TransformersEngine
from rlplatform.config import LearnerConfig, RLConfig
from rlplatform.devices import resolve_dtype
from rlplatform.learners.algorithms import grpo_advantages
from rlplatform.learners.batching import choose_layout
from rlplatform.learners.rank import LearnerRank
from rlplatform.transport.redis_server import EmbeddedRedis
from rlplatform.transport.samples import Sample
from rlplatform.transport.weight_store import WeightStoreActor
from rlplatform.transport.weight_transports import BroadcastTransport, CudaIpcTransport, ObjectStoreTransport, WeightTransport

SIZES = {  # Qwen2Config fields
    "tiny": dict(vocab_size=512, hidden_size=128, intermediate_size=384, num_hidden_layers=4,
                 num_attention_heads=4, num_key_value_heads=2),
    "0.5b": dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                 num_attention_heads=14, num_key_value_heads=2),
}
PROMPT_TOKENS = 32
TRANSPORTS = (ObjectStoreTransport(), BroadcastTransport(), CudaIpcTransport())  # broadcast in 256 MB buckets


def build_policy(size: str, out: str) -> str:
    """Save a random-weight Qwen2 of `size` and a word-level tokenizer covering its vocabulary."""
    fields = SIZES[size]
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{f"t{i}": i for i in range(3, fields["vocab_size"])}}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                   padding_side="left")
    torch.manual_seed(0)
    config = Qwen2Config(**fields, max_position_embeddings=2048, tie_word_embeddings=True, bos_token_id=1,
                         eos_token_id=2, pad_token_id=0)
    Qwen2ForCausalLM(config).save_pretrained(out)
    fast.save_pretrained(out)
    return out


def random_prompts(n: int, vocab_size: int, seed: int = 0) -> List[str]:
    rng = random.Random(seed)
    return [" ".join(f"t{rng.randrange(3, vocab_size)}" for _ in range(PROMPT_TOKENS)) for _ in range(n)]


def engine_generation(engine: TransformersEngine, prompts: List[str], group: int, new_tokens: int) -> Dict:
    """Tokens/s of one `generate` of every prompt, after a warm-up: with the slot decoder a run of the same
    shapes, which sizes its cache and captures its graphs (its seconds kept as `first_seconds`), else a short one."""
    prompts = engine.tokenizer(prompts)["input_ids"]
    first = None
    if engine.slot_decoder:
        first = _timed(lambda: engine.generate(prompts, group, new_tokens, 1.0))[0]
    else:
        engine.generate(prompts[:2], 1, 4, 1.0)
    seconds, groups = _timed(lambda: engine.generate(prompts, group, new_tokens, 1.0))
    tokens = sum(len(c.completion_ids) for g in groups for c in g)
    return {"tokens": tokens, "seconds": seconds, "first_seconds": first, "groups": groups}


def _timed(run) -> tuple:
    """(seconds, result) of `run()`, the device synchronised on both sides."""
    _synchronize()
    start = time.perf_counter()
    result = run()
    _synchronize()
    return time.perf_counter() - start, result


@ray.remote(num_cpus=0)
class VLLMGeneration:
    """rlplatform's vLLM engine in its own process (its GPU memory is freed when the actor goes)."""

    def run(self, model_dir: str, dtype: str, prompts: List[List[int]], group: int, new_tokens: int) -> Dict:
        from rlplatform.actors.vllm_engine import VLLMEngine

        engine = VLLMEngine(model_dir, dtype, 0.4, seed=0)  # 0.4 of the GPU's memory
        engine.version = 0
        engine.generate(prompts[:2], 1, 4, 1.0)  # warm-up
        start = time.perf_counter()
        groups = engine.generate(prompts, group, new_tokens, 1.0)
        seconds = time.perf_counter() - start
        return {"tokens": sum(len(c.completion_ids) for g in groups for c in g), "seconds": seconds}


def vllm_generation(model_dir: str, dtype: str, prompts: List[List[int]], group: int, new_tokens: int) -> Dict:
    """The vLLM engine on the same weights and prompts (a random model's EOS is rare); needs CUDA."""
    actor = VLLMGeneration.options(num_gpus=0.5).remote()
    try:
        return ray.get(actor.run.remote(model_dir, dtype, prompts, group, new_tokens))
    finally:
        ray.kill(actor)


@ray.remote(num_cpus=0)
class SyncTarget:
    """An engine in another process that takes each version through one transport, as a rollout worker does."""

    def __init__(self, model_dir: str, device: str, dtype: str, transport: WeightTransport, store) -> None:
        self.engine = TransformersEngine(model_dir, device, dtype)
        self.receiver = transport.receiver(store, self.engine.device)

    def join_weights(self, *args, **kwargs) -> None:
        self.receiver.join(*args, **kwargs)

    def load(self, version: int) -> int:
        while (newer := self.receiver.newer(version - 1)) is None:
            time.sleep(0.0005)
        self.engine.load_weights(newer[1], newer[0])
        _synchronize()
        return newer[0]


def weight_sync(learner: LearnerRank, model_dir: str, transport: WeightTransport, redis_url: str,
                repeats: int = 5) -> Dict:
    """Seconds from learner rank 0's weights to an engine in another process holding them, per transport."""
    store = WeightStoreActor.remote()
    target = _sync_target(model_dir, learner.dtype, transport, store)
    learner.transport, learner.weights_out = transport, transport.sender(learner.device)
    if isinstance(transport, BroadcastTransport):
        key = f"bench-{transport.name}:version"
        host, port = learner.address()
        backend = learner.placement()["backend"]  # gloo on the CPU, nccl on a GPU
        joined = target.join_weights.remote(host, port, 1, 2, backend, redis_url=redis_url, version_key=key)
        learner.join_weights(host, port, 0, 2, backend, redis_url=redis_url, version_key=key)
        ray.get(joined)
    seconds = []
    try:
        for version in range(repeats + 1):  # the first is a warm-up
            _synchronize()
            start = time.perf_counter()
            sent = learner.stream_weights(version)[0]
            if isinstance(sent, ray.ObjectRef):
                ray.get(store.publish.remote(version, [sent]))
            ray.get(target.load.remote(version))
            seconds.append(time.perf_counter() - start)
    finally:
        ray.kill(target)
        ray.kill(store)
    seconds = sorted(seconds[1:])
    return {"best_s": seconds[0], "median_s": seconds[len(seconds) // 2]}


def _sync_target(model_dir: str, dtype: str, transport: WeightTransport, store):
    """The receiving engine: on the learner's GPU for cuda_ipc, on another GPU for broadcast (NCCL)."""
    if not torch.cuda.is_available():
        return SyncTarget.remote(model_dir, "cpu", dtype, transport, store)
    gpu = str(torch.cuda.device_count() - 1) if isinstance(transport, BroadcastTransport) else "0"
    env = {"RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1", "CUDA_VISIBLE_DEVICES": gpu}
    return SyncTarget.options(runtime_env={"env_vars": env}).remote(model_dir, "cuda", dtype, transport, store)


def sync_row(learner: LearnerRank, model_dir: str, transport: WeightTransport, redis_url: str, megabytes: float):
    """(figure, how) for one transport, or why it was not measured here."""
    gpu = torch.cuda.is_available()
    if isinstance(transport, CudaIpcTransport) and not gpu:
        return "not measured: needs CUDA", "learner and engine on one GPU"
    if isinstance(transport, BroadcastTransport) and gpu and torch.cuda.device_count() < 2:
        return "not measured: NCCL needs a second GPU", "learner rank 0 -> engine, one GPU each"
    sync = weight_sync(learner, model_dir, transport, redis_url)
    how = {"object_store": "snapshot -> Ray object store -> engine",
           "broadcast": f"{'nccl' if gpu else 'gloo'} broadcast in {TRANSPORTS[1].bucket_mb:.0f} MB buckets -> engine",
           "cuda_ipc": "one IPC handle of a packed GPU copy -> engine"}[transport.name]
    return f"{sync['best_s']:.3f} s per sync", f"{megabytes:.1f} MB, {how}, best of 5 (median {sync['median_s']:.3f} s)"


def learner_steps(learner: LearnerRank, groups, steps: int, profile: bool = False) -> Dict:
    """RL steps on the generated groups with random rewards; tokens are prompt + completion tokens fed. On a
    GPU, `step_gib` is the most memory the timed steps allocated above what was held before them (activations,
    the head's chunks, gradients in flight). With `profile`, one more step runs under torch.profiler and its
    table is printed."""
    rng = random.Random(0)
    samples = [Sample(sample_id=f"g{g}/{i}", group_id=f"g{g}", policy="policy", prompt="", completion=c.text,
                      prompt_ids=c.prompt_ids, completion_ids=c.completion_ids, behaviour_logprobs=c.logprobs,
                      token_versions=c.versions, row={})
               for g, group in enumerate(groups) for i, c in enumerate(group)]
    rewards = [[float(rng.random() < 0.5) for _ in group] for group in groups]
    advantages = [a for group in grpo_advantages(rewards) for a in group]
    rl = RLConfig(lr_schedule="constant", max_new_tokens=max(len(s.completion_ids) for s in samples))
    learner.rl_step(samples, advantages, rl)  # warm-up (and the optimizer's state)
    _synchronize()
    held = _allocated_after_reset()
    start = time.perf_counter()
    mfu = [learner.rl_step(samples, advantages, rl, step=step)["mfu"] for step in range(steps)]
    _synchronize()
    seconds = time.perf_counter() - start
    step_gib = (torch.cuda.max_memory_allocated() - held) / 2 ** 30 if torch.cuda.is_available() else None
    tokens = steps * sum(len(s.prompt_ids) + len(s.completion_ids) for s in samples)
    if profile:
        _profile_step(learner, samples, advantages, rl)
    layout = choose_layout(learner.engine.module, [s.prompt_ids for s in samples], [s.completion_ids for s in samples])
    return {"tokens": tokens, "seconds": seconds, "mfu": sum(mfu) / len(mfu), "layout": layout, "step_gib": step_gib}


def _allocated_after_reset() -> int:
    """GPU memory allocated now, with the peak counter restarted from it (0 without CUDA)."""
    if not torch.cuda.is_available():
        return 0
    torch.cuda.reset_peak_memory_stats()
    return torch.cuda.memory_allocated()


def _step_memory(trained: Dict) -> str:
    return f"; the steps allocated up to {trained['step_gib']:.1f} GiB above what was held" \
        if trained["step_gib"] is not None else ""


def variant_row(model_dir: str, dtype: str, learner: LearnerRank, groups, steps: int, name: str, change: str,
                **options) -> tuple:
    """The learner row again for a rank whose config differs from the default by `options`, run on the same
    groups in the default rank's micro-batches (its own budget would come from the memory the first left free)."""
    config = LearnerConfig(num_threads=torch.get_num_threads(), micro_batch_tokens=learner.micro_batch_tokens,
                           activation_checkpointing=learner.activation_checkpointing, **options)
    trained = learner_steps(learner_rank(model_dir, dtype, config), groups, steps)
    _release_memory()
    figure = f"{trained['tokens'] / trained['seconds']:.0f} tokens/s, MFU {trained['mfu']:.1%}"
    print(f"learner, {name}: {figure}", flush=True)
    how = f"the same steps in the same micro-batches, {change}; {trained['layout']} scoring rows{_step_memory(trained)}"
    return f"learner, {name}", figure, how


def _release_memory() -> None:
    """The device memory of ranks no longer referenced, back to the device for the next one."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _profile_step(learner: LearnerRank, samples, advantages, rl: RLConfig) -> None:
    _profiled("one learner RL step", lambda: learner.rl_step(samples, advantages, rl, step=-1))


def _profile_generation(engine: TransformersEngine, prompts: List[List[int]], group: int) -> None:
    _profiled(f"the engine: {len(prompts)} prompts x {group}, 16 new tokens",
              lambda: engine.generate(prompts, group, 16, 1.0))


def _profiled(what: str, run) -> None:
    """torch.profiler's table of `run()` (CUDA time where there is a GPU)."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as profiler:
        run()
        _synchronize()
    sort = "cuda_time_total" if torch.cuda.is_available() else "cpu_time_total"
    print(f"profile of {what}:\n{profiler.key_averages().table(sort_by=sort, row_limit=25)}", flush=True)


def whole_job_rows(model_dir: str, prompts: List[str], args: argparse.Namespace) -> List[tuple]:
    """The whole job and TRL's GRPOTrainer on the same policy, prompts and group size (gpu_job.py); a row
    says why where one failed, so the other figures still come out."""
    work_dir = tempfile.mkdtemp()
    gpu = torch.cuda.is_available()
    try:
        job = job_figures(model_dir, prompts, args.group, args.new_tokens, args.job_steps, work_dir, 300)
        job_figure = f"{job['trained_per_s']:.0f} trained samples/s"
        job_how = (f"`rlp run`: {job['steps']} RL steps, {job['trained']} trained; learner busy "
                   f"{job['learner_busy']:.0%}, MFU {job['mfu']:.1%}, {job['sync_s']:.3f} s per weight sync; actors "
                   f"ready {job['actors_ready_s']:.1f} s and the first step trained {job['first_step_s']:.1f} s after "
                   f"the job began; one rank ({'bf16 weights over fp32 masters' if gpu else 'fp32'}) and 2 rollout "
                   f"workers, {job['shares'] or 'no GPU shared'}; no evaluation (nor in TRL's)")
    except Exception as error:  # noqa: BLE001 (reported in the table)
        job, job_figure, job_how = None, f"failed: {type(error).__name__}", str(error)[:200]
    print(f"whole job: {job_figure} ({job_how})", flush=True)
    print("\n".join(job["progress"] if job else []), flush=True)  # when each step ended, for the log
    if importlib.util.find_spec("trl") is None:
        return [("whole job, rlplatform", job_figure, job_how),
                ("whole job, TRL GRPOTrainer (peer)", "not measured: trl is not installed", "the bench extra has it")]
    try:
        trl = trl_figures(model_dir, prompts, args.group, args.new_tokens, args.job_steps, work_dir, 300)
        trl_figure = f"{trl['trained_per_s']:.0f} trained samples/s"
        ratio = f"; rlplatform {job['trained_per_s'] / trl['trained_per_s']:.2f}x" if job else ""
        trl_how = (f"GRPOTrainer {trl['steps']} steps of {args.prompts} prompts x {args.group} in {trl['wall_s']} s "
                   f"(Hugging Face generation; {'bf16 autocast over fp32 weights' if gpu else 'fp32'}){ratio}")
    except Exception as error:  # noqa: BLE001 (reported in the table)
        trl, trl_figure, trl_how = None, f"failed: {type(error).__name__}", str(error)[:200]
    print(f"TRL: {trl_figure} ({trl_how})", flush=True)
    rows = [("whole job, rlplatform", job_figure, job_how), ("whole job, TRL GRPOTrainer (peer)", trl_figure, trl_how)]
    if job and trl and job["after_first_per_s"] and trl["after_first_per_s"]:
        rows.append(("whole job after its first step, rlplatform vs TRL",
                     f"{job['after_first_per_s']:.0f} vs {trl['after_first_per_s']:.0f} trained samples/s",
                     f"from the end of step 1 to the end of the last (rlplatform: `rlp run`'s progress lines; TRL: a "
                     f"callback at each optimizer step's end): start-up, first generation and compiles left out on both "
                     f"sides; rlplatform {job['after_first_per_s'] / trl['after_first_per_s']:.2f}x"))
    return rows


def _synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def learner_rank(model_dir: str, dtype: str, config: LearnerConfig) -> LearnerRank:
    """A learner rank of `config` in this process (one rank, no Ray), set up and in a stage."""
    learner = LearnerRank(0, 1, model_dir, config, seed=0, dtype=dtype, transport=ObjectStoreTransport())
    learner.setup("127.0.0.1", _free_port())
    learner.start_stage(lr=1e-6)
    return learner


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--size", choices=sorted(SIZES), default="0.5b")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--learner-steps", type=int, default=3)
    parser.add_argument("--job-steps", type=int, default=8,
                        help="RL steps of each whole-job row, rlplatform's and TRL's alike (0: no job rows)")
    parser.add_argument("--profile", action="store_true",
                        help="print torch.profiler's tables of one learner step and of a short generation")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "gpu.md"))
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = resolve_dtype("auto", torch.cuda.device_count())
    model_dir = build_policy(args.size, tempfile.mkdtemp())
    prompts = random_prompts(args.prompts, SIZES[args.size]["vocab_size"])
    job_rows = whole_job_rows(model_dir, prompts, args) if args.job_steps else []  # first: the whole device is free
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    engine = TransformersEngine(model_dir, device, dtype)  # rollout.kv_cache: auto
    engine.version = 0
    generated = engine_generation(engine, prompts, args.group, args.new_tokens)
    print(f"generation: {generated['tokens']} tokens in {generated['seconds']:.2f} s", flush=True)
    dynamic = None
    if engine.slot_decoder:  # the dynamic loop beside it, on the same weights
        dynamic_engine = TransformersEngine(model_dir, device, dtype, kv_cache="dynamic")
        dynamic_engine.version = 0
        dynamic = engine_generation(dynamic_engine, prompts, args.group, args.new_tokens)
        del dynamic_engine
        torch.cuda.empty_cache()
        print(f"generation, dynamic loop: {dynamic['tokens']} tokens in {dynamic['seconds']:.2f} s", flush=True)
    if args.profile:
        _profile_generation(engine, engine.tokenizer(prompts)["input_ids"], args.group)
    vllm, vllm_note = None, "not measured: on CPU, see engines.py" if device != "cuda" else "not measured: vllm is not installed"
    if device == "cuda" and importlib.util.find_spec("vllm") is not None:
        vllm = vllm_generation(model_dir, dtype, engine.tokenizer(prompts)["input_ids"], args.group, args.new_tokens)
    learner = learner_rank(model_dir, dtype, LearnerConfig(num_threads=torch.get_num_threads()))
    megabytes = sum(p.numel() * p.element_size() for p in engine.model.parameters()) / 1e6  # as served
    with EmbeddedRedis() as redis:
        syncs = {t.name: sync_row(learner, model_dir, t, redis.url, megabytes) for t in TRANSPORTS}
    print(f"weight syncs: {syncs}", flush=True)
    trained = learner_steps(learner, generated["groups"], args.learner_steps, args.profile)
    print(f"learner: {trained['tokens'] / trained['seconds']:.0f} tokens/s, MFU {trained['mfu']:.1%}", flush=True)
    variant_rows = []
    if learner.compiled_layers:  # the same steps, in the same micro-batches, with the layers uncompiled
        variant_rows.append(variant_row(model_dir, dtype, learner, generated["groups"], args.learner_steps,
                                        "eager layers (`learner.compile: false`)", "the decoder layers uncompiled",
                                        compile=False))
    if dtype == "bfloat16":  # autocast over float32 weights instead of bfloat16 weights over float32 masters
        variant_rows.append(variant_row(model_dir, dtype, learner, generated["groups"], args.learner_steps,
                                        "`learner.bf16_mode: autocast`",
                                        "float32 weights with bfloat16 matmuls (autocast; ZeRO-0)",
                                        bf16_mode="autocast"))
    checkpointing = ", activation checkpointing (memory asked for it)" if learner.activation_checkpointing else ""
    params = sum(p.numel() for p in engine.model.parameters())
    name = torch.cuda.get_device_name() if device == "cuda" else f"CPU ({os.cpu_count()} cores)"
    loop = ("slot decoder, CUDA graphs" if engine.slot_decoder.graphs else "slot decoder") if engine.slot_decoder \
        else "dynamic cache"
    sizing = "sizes the cache and captures the graphs" if engine.slot_decoder and engine.slot_decoder.graphs \
        else "sizes the cache"
    captured = (f"; the first run of these shapes, which {sizing}, took {generated['first_seconds']:.2f} s"
                if engine.slot_decoder else "")
    rows = [(f"generation, rlplatform transformers engine ({dtype}, {loop}: the default)",
             f"{generated['tokens'] / generated['seconds']:.0f} tokens/s",
             f"{args.prompts} prompts x {args.group}, up to {args.new_tokens} new tokens{captured}"),
            *([(f"generation, rlplatform transformers engine ({dtype}, `rollout.kv_cache: dynamic`)",
                f"{dynamic['tokens'] / dynamic['seconds']:.0f} tokens/s",
                "the same prompts through Hugging Face's growing cache, one forward per step")] if dynamic else []),
            (f"generation, vLLM ({dtype})", f"{vllm['tokens'] / vllm['seconds']:.0f} tokens/s" if vllm else vllm_note,
             "rlplatform's vLLM engine, same prompts (continuous batching, log-probs and versions recorded)"),
            *[(f"weight sync, {name}", *row) for name, row in syncs.items()],
            (f"learner (DeepSpeed ZeRO-{learner.zero_stage}, one rank, {dtype}"
             f"{' weights over float32 masters' if dtype == 'bfloat16' else ''})",
             f"{trained['tokens'] / trained['seconds']:.0f} tokens/s",
             f"{args.learner_steps} RL steps on the generated groups; micro-batches of {learner.micro_batch_tokens} "
             f"tokens (the default: from free memory){checkpointing}; {trained['layout']} scoring rows"
             f"{_step_memory(trained)}; "
             + (f"{learner.compiled_layers} decoder layers compiled" if learner.compiled_layers else "eager layers")
             + " (`learner.compile` unset)"),
            ("learner MFU", f"{trained['mfu']:.1%}",
             f"6 x {params / 1e6:.1f}M parameters x tokens/s over the device's peak ({learner.peak.flops / 1e12:.1f} "
             f"TFLOP/s{'' if device == 'cuda' else ', a measured matmul peak'})"),
            *variant_rows,
            *job_rows]
    report = "\n".join([
        "# Accelerator figures", "",
        f"{date.today()}, {platform.node()}: {name}, torch {torch.__version__}, "
        f"`{' '.join(['python benchmarks/gpu.py', *sys.argv[1:]])}`", "",
        f"Policy: Qwen2 architecture, {args.size} shapes, {params / 1e6:.1f}M parameters, random weights.", "",
        "| measure | figure | how |", "|---|---|---|", *[f"| {a} | {b} | {c} |" for a, b, c in rows], ""])
    print(report)
    with open(args.out, "w") as f:
        f.write(report)


if __name__ == "__main__":
    main()

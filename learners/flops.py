"""Model FLOPs utilisation of a learner step: 6 x parameters x tokens trained per second (forward and
backward through every parameter, the usual count that leaves attention's own products out) over the
device's peak. GPU peaks come from the vendors' data sheets (dense, no sparsity); an unknown GPU and
the CPU get a measured matrix-multiply peak instead, measured again the first time a step outruns it."""

from __future__ import annotations

import time
from typing import Optional

import torch

# dense peak TFLOP/s: (bfloat16/float16 tensor cores, float32 without TF32); the first name the GPU's contains wins
PEAK_TFLOPS = {"H100 PCIe": (756.0, 51.0), "H200": (989.0, 67.0), "H100": (989.0, 67.0), "A100": (312.0, 19.5),
               "L40S": (362.0, 91.6)}


def table_peak_flops(gpu_name: str, dtype: torch.dtype) -> Optional[float]:
    """The data-sheet peak FLOP/s of a GPU (by `torch.cuda.get_device_name`) in `dtype`; None if not listed."""
    for key, (half, single) in PEAK_TFLOPS.items():
        if key in gpu_name:
            return (single if dtype == torch.float32 else half) * 1e12
    return None


class DevicePeak:
    """The peak FLOP/s a device computes `dtype` matmuls at: its data sheet's, else the fastest measurement so
    far. A measurement taken while other work shares the device reads low; 6 x parameters x tokens counts fewer
    FLOPs than a step computes, so a step that beats the measured peak proves it low. The first such step has it
    measured again (the larger reading kept); a step that beats that too sets the peak to its own rate (MFU 1).
    Measuring once more would not help there: on a CPU without bfloat16 matmuls a 512-square one is emulated
    and reads below the small products of a small model's step every time, at 2-3 s a measurement."""

    def __init__(self, device: torch.device, dtype: torch.dtype):
        self.device, self.dtype = device, dtype
        listed = table_peak_flops(torch.cuda.get_device_name(device), dtype) if device.type == "cuda" else None
        self.measured = listed is None
        self.measured_again = False
        self.flops = listed if listed is not None else measured_matmul_flops(device, dtype)

    def mfu(self, params: int, tokens: float, seconds: float) -> float:
        """The fraction of the peak that training `tokens` through `params` parameters in `seconds` used."""
        rate = step_flops(params, tokens, seconds)
        if self.measured and rate > self.flops:
            if not self.measured_again:
                self.flops = max(self.flops, measured_matmul_flops(self.device, self.dtype))
                self.measured_again = True
            self.flops = max(self.flops, rate)
        return rate / self.flops


def measured_matmul_flops(device: torch.device, dtype: torch.dtype, size: int = 512, reps: int = 8) -> float:
    """FLOP/s of the fastest of `reps` `size`-square matmuls in `dtype` on `device` (with the process's torch
    threads): a peak, so a rep slowed by other work on a shared machine does not lower it."""
    generator = torch.Generator(device).manual_seed(0)  # the training's random stream stays untouched
    a, b = (torch.randn(size, size, device=device, generator=generator).to(dtype) for _ in range(2))
    a @ b  # warm-up: kernel choice, thread pool
    fastest = float("inf")
    for _ in range(reps):
        _synchronize(device)
        start = time.perf_counter()
        a @ b
        _synchronize(device)
        fastest = min(fastest, time.perf_counter() - start)
    return 2 * size ** 3 / fastest


def mfu(params: int, tokens: float, seconds: float, peak: float) -> float:
    """The fraction of `peak` FLOP/s that training `tokens` through `params` parameters in `seconds` used."""
    return step_flops(params, tokens, seconds) / peak


def step_flops(params: int, tokens: float, seconds: float) -> float:
    """FLOP/s of training `tokens` through `params` parameters in `seconds`: 6 x parameters x tokens per second."""
    return 6 * params * tokens / max(seconds, 1e-9)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)

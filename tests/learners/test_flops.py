"""MFU arithmetic: 6 x parameters x tokens per second over the device's peak, against hand counts."""

from __future__ import annotations

import pytest
import torch

from rlplatform.learners import flops
from rlplatform.learners.flops import DevicePeak, measured_matmul_flops, mfu, table_peak_flops


def test_data_sheet_peaks_by_gpu_name_and_dtype():
    assert table_peak_flops("NVIDIA H200", torch.bfloat16) == 989e12
    assert table_peak_flops("NVIDIA H100 80GB HBM3", torch.bfloat16) == 989e12
    assert table_peak_flops("NVIDIA H100 PCIe", torch.bfloat16) == 756e12  # not the SXM part's
    assert table_peak_flops("NVIDIA A100-SXM4-80GB", torch.float32) == 19.5e12
    assert table_peak_flops("NVIDIA L40S", torch.float16) == 362e12
    assert table_peak_flops("Tesla T4", torch.bfloat16) is None  # unlisted: measured instead


def test_mfu_of_the_first_gpu_learner_run_by_hand():
    # 494M parameters at 13,325 tokens/s: 6 x 494e6 x 13,325 = 3.9495e13 FLOP/s, 3.99% of an H200's 989 TFLOP/s
    assert mfu(494_000_000, 13_325, 1.0, 989e12) == pytest.approx(0.039934, rel=1e-4)
    assert mfu(494_000_000, 26_650, 2.0, 989e12) == pytest.approx(0.039934, rel=1e-4)


def test_a_cpu_peak_is_measured():
    flops = measured_matmul_flops(torch.device("cpu"), torch.float32)
    assert 1e8 < flops < 1e13  # between a slow core and far more than two cores reach


def test_a_measured_peak_that_a_step_outruns_is_measured_again():
    peak = DevicePeak(torch.device("cpu"), torch.float32)
    assert peak.measured and 1e8 < peak.flops < 1e13
    peak.flops = 1e6  # as if measured while other work held the cores
    assert peak.mfu(1_000_000, 1_000, 1.0) < 1  # 6e9 FLOP/s beats 1e6: measured again, far above both
    assert peak.flops > 6e9
    kept = peak.flops
    assert peak.mfu(1, 1, 1.0) == pytest.approx(6 / kept)  # a slower step keeps the peak
    assert peak.flops == kept


def test_a_step_that_outruns_the_peak_measured_again_sets_it_without_a_third_measurement(monkeypatch):
    peak = DevicePeak(torch.device("cpu"), torch.float32)
    measure, measurements = flops.measured_matmul_flops, []
    monkeypatch.setattr(flops, "measured_matmul_flops", lambda *args: measurements.append(args) or measure(*args))
    # 6e15 FLOP/s, far beyond two cores: it beats the reading taken again too, and its own rate is the peak
    assert peak.mfu(1_000_000, 1e9, 1.0) == 1.0
    assert peak.flops == 6e15 and len(measurements) == 1
    assert peak.mfu(1_000_000, 2e9, 1.0) == 1.0  # a faster step still: its rate, and nothing measured
    assert peak.flops == 12e15 and len(measurements) == 1
    assert peak.mfu(1_000_000, 1e9, 1.0) == pytest.approx(0.5)

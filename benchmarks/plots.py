"""Figures beside the benchmark tables: held-out accuracy against time, one panel per scenario
(`vs_trl.py`) or per staleness setting (`async_vs_sync.py`), a line per run."""

from __future__ import annotations

import textwrap
from typing import Dict, List, Optional, Tuple

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402

Curve = List[Tuple[float, float]]  # (seconds, held-out accuracy)


def accuracy_panels(panels: Dict[str, Tuple[Dict[str, Curve], Optional[float]]], path: str, x_label: str) -> None:
    """One panel per title: each (label -> curve) as a line, the target (if any) as a dashed line."""
    fig, axes = plt.subplots(1, len(panels), figsize=(4.5 * len(panels), 3.6), squeeze=False)
    for ax, (title, (curves, target)) in zip(axes[0], panels.items()):
        for label, curve in curves.items():
            ax.plot([x for x, _ in curve], [y for _, y in curve], marker=".", label=label)
        if target is not None:
            ax.axhline(target, color="grey", linestyle="--", linewidth=1, label=f"target {target:.2f}")
        ax.set_title("\n".join(textwrap.wrap(title, 45)), fontsize=9)
        ax.set_xlabel(x_label)
        ax.set_ylabel("held-out greedy accuracy")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)

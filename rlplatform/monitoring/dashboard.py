"""The W&B dashboard layout of a job: sections of panels over the keys the RL monitor logs.

`dashboard_layout(policy)` is the layout as data (sections -> panels -> metric keys and the
x axis each plots against); `build_workspace` turns it into a W&B workspace with the
`wandb-workspaces` API, and `render_layout` into text for the terminal and docs/monitoring.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Tuple

from rlplatform.monitoring.metrics import RL_AXES


@dataclass
class Panel:
    title: str
    metrics: List[str]  # names within the family, e.g. "loss"
    kind: str = "line"  # line | histogram | table


SECTIONS: List[Tuple[str, str, List[Panel]]] = [
    ("learning", "Learning", [
        Panel("Loss", ["loss", "pg_loss"]), Panel("KL to reference", ["kl_to_reference"]),
        Panel("Entropy", ["entropy"]), Panel("Clip fraction", ["clip_fraction"]),
        Panel("Importance weights", ["importance_weight_mean", "importance_weight_max"]),
        Panel("Grad norm", ["grad_norm"]), Panel("Learning rate", ["lr"]),
        Panel("Response length", ["response_length_mean", "response_length_max"])]),
    ("rewards", "Rewards", [
        Panel("Total reward", ["total"]), Panel("Reward components", ["component/.*"]),
        Panel("Errors, timeouts, filtered", ["error_fraction", "timeout_fraction", "filtered_fraction"]),
        Panel("Zero-advantage groups", ["zero_advantage_group_fraction"])]),
    ("async", "Asynchrony", [
        Panel("Policy version", ["policy_version"]), Panel("Staleness of trained samples", ["staleness"], "histogram"),
        Panel("Dropped as stale", ["samples_dropped_stale"]), Panel("Weight sync (s)", ["weight_sync_s"]),
        Panel("Weight bytes per sync", ["weight_bytes_per_sync"]),
        Panel("Busy fractions", ["rollout_busy_fraction", "learner_busy_fraction", "reward_busy_fraction"]),
        Panel("Reward queue depth", ["queue_depth"]), Panel("Reward latency (s)", ["reward_latency_s"]),
        Panel("Throughput", ["samples_per_s", "trained_samples_per_s"]), Panel("Tokens/s", ["tokens_per_s", "learner_tokens_per_s"])]),
    ("eval", "Evaluation", [Panel("Held-out pass@1", ["accuracy"]), Panel("Held-out reward", ["reward_mean"]),
                            Panel("Held-out reward components", ["component/.*"])]),
    ("samples", "Samples", [Panel("Completions", ["table"], "table")]),
]


def dashboard_layout(policy: str) -> List[Tuple[str, str, List[Panel]]]:
    """[(section title, x-axis key, panels with full metric keys)] for one policy."""
    layout = []
    for family, title, panels in SECTIONS:
        axis = RL_AXES[family]
        x_key = axis if axis == "wall_time_s" else f"{policy}/{axis}"
        full = [Panel(p.title, [f"{policy}/{family}/{m}" for m in p.metrics], p.kind) for p in panels]
        layout.append((f"{policy}: {title}", x_key, full))
    return layout


def render_layout(policy: str) -> str:
    lines = []
    for section, x_key, panels in dashboard_layout(policy):
        lines.append(f"[{section}]  x: {x_key}")
        for panel in panels:
            lines.append(f"  - {panel.title} ({panel.kind}): {', '.join(panel.metrics)}")
    return "\n".join(lines)


def build_workspace(entity: str, project: str, policies: List[str], name: str):
    """A `wandb_workspaces` Workspace laid out in the sections above (call `.save()` to create it)."""
    import wandb_workspaces.reports.v2 as wr
    import wandb_workspaces.workspaces as ws

    sections = []
    for policy in policies:
        for section, x_key, panels in dashboard_layout(policy):
            sections.append(ws.Section(name=section, is_open=True, panels=[_panel(wr, p, x_key) for p in panels]))
    return ws.Workspace(entity=entity, project=project, name=name, sections=sections)


def _panel(wr, panel: Panel, x_key: str):
    if panel.kind == "table":
        return wr.WeavePanelSummaryTable(table_name=panel.metrics[0])
    if any(".*" in m for m in panel.metrics):
        return wr.LinePlot(title=panel.title, x=x_key, metric_regex=panel.metrics[0])
    return wr.LinePlot(title=panel.title, x=x_key, y=panel.metrics)

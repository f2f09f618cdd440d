"""A fleet run's replicas over time, GPU-hours and cost (run.json's "scaling" section,
written by `rt simulate` for every fleet run: a fixed fleet has one entry per pool).

    scaling_block    the console's lines: policy, per pool the replica range, GPU-hours,
                     cost; the fleet's GPU-hours and cost
    replica_figure   replicas serving and provisioned per pool over time (steps), under the
                     request arrival rate
    show_fleet       what `rt simulate` shows of a fleet run: the routing and scaling
                     blocks, the replica figure when autoscaled
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from analysis.fleet import fleet_block
from analysis.output import save_figures
from analysis.rundir import Run


def scaling_block(scaling: dict[str, Any]) -> str:
    policy = scaling.get("policy") or "none (fixed fleet)"
    lines = ["{s:{c}^50}".format(s=" Scaling ", c="="),
             f"{'Autoscaling policy:':<40} {policy}"]
    if scaling.get("interval_s"):
        lines.append(f"{'Decision interval (s):':<40} {scaling['interval_s']:.0f}")
    # a pool without a price (no `--gpu-cost-per-hour`, no `cost_per_hour` of its own)
    # costs "-", and the fleet's cost says which are left out: 0.00 would read as free
    unpriced = [pool["name"] for pool in scaling["pools"]
                if not pool.get("cost_per_hour", 0.0) > 0.0]
    lines.append(f"{'pool':>12}{'min':>6}{'max':>6}{'GPU-h':>10}{'cost':>12}")
    for pool in scaling["pools"]:
        cost = "-" if pool["name"] in unpriced else f"{pool['cost']:.2f}"
        lines.append(f"{pool['name'][:12]:>12}{min(pool['serving']):>6}"
                     f"{max(pool['provisioned']):>6}{pool['gpu_hours']:>10.3f}{cost:>12}")
    if len(unpriced) == len(scaling["pools"]):
        total = "not priced (--gpu-cost-per-hour, or a pool's cost_per_hour)"
    else:
        total = f"{scaling['cost']:.2f}"
        if unpriced:
            total += f" (not priced: {', '.join(unpriced)})"
    lines += [f"{'Duration (s, to the last finish):':<40} {scaling['end_s']:.1f}",
              f"{'GPU-hours:':<40} {scaling['gpu_hours']:.3f}",
              f"{'Cost:':<40} {total}", "=" * 50]
    return "\n".join(lines)


def replica_figure(scaling: dict[str, Any], requests: pd.DataFrame,
                   bin_s: float | None = None) -> Figure:
    """Top: arrivals per second (bins of `bin_s`, default the decision interval or 10 s).
    Bottom: per pool, replicas serving (solid) and provisioned (dashed: starting and
    draining included), as steps up to the run's end."""
    end = float(scaling["end_s"])
    fig = Figure(figsize=(8.0, 5.0), layout="constrained")
    top, bottom = fig.subplots(2, 1, sharex=True, height_ratios=(1, 2))
    width = bin_s or scaling.get("interval_s") or 10.0
    arrivals = requests["arrival_s"].to_numpy(dtype=np.float64)
    edges = np.arange(0.0, max(end, width) + width, width)
    counts, _ = np.histogram(arrivals, edges)
    top.stairs(counts / width, edges, color="grey")
    top.set_ylabel("arrivals / s")
    for k, pool in enumerate(scaling["pools"]):
        color = f"C{k}"
        times = [*pool["times_s"], end]
        bottom.step(times, [*pool["serving"], pool["serving"][-1]], where="post",
                    color=color, label=f"{pool['name']} serving")
        bottom.step(times, [*pool["provisioned"], pool["provisioned"][-1]], where="post",
                    color=color, linestyle="--", label=f"{pool['name']} provisioned")
    bottom.set_xlabel("time (s)")
    bottom.set_ylabel("replicas")
    bottom.set_ylim(bottom=0)
    bottom.legend(loc="upper right", fontsize=8)
    policy = scaling.get("policy") or "fixed"
    top.set_title(f"replicas over time ({policy}): {scaling['gpu_hours']:.3f} GPU-h, "
                  f"cost {scaling['cost']:.2f}")
    return fig


def show_fleet(run: Run, autoscaled: bool, echo: Callable[[str], None],
               log: Callable[[str], None]) -> None:
    """A fleet run's blocks (routing, scaling) to `echo`; when autoscaled, the replica
    figure into the run's plots/ (`log` says so)."""
    scaling = run.info["scaling"]
    echo(f"{fleet_block(run.requests, run.steps)}\n{scaling_block(scaling)}")
    if autoscaled:
        save_figures({"replicas": replica_figure(scaling, run.requests)}, run.path / "plots",
                     log)

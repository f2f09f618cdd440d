"""`rt plan`'s outputs: what binds a shape, the ranked table, the Pareto plot.

Records are the result dicts (`report.result_dict`) of the simulated shapes, with the shape's
own keys (`shape`, `gpu`, `model`, `tp`, `replicas`, `gpus`, `cost_per_hour`, `meets_slo`,
`binds`) added by the caller.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pandas as pd

from analysis.attribution import attribution_summary
from analysis.metrics import PARTS
from analysis.output import save_figures

EXECUTION = ("prefill_ms", "decode_ms")

PLAN_TABLE = "plan.csv"  # the plan's summary table, in its result directory


def what_binds(requests: pd.DataFrame) -> str:
    """The largest waiting part of the slowest 1% of requests by TTFT (execution excluded):
    what a bigger or differently shaped fleet would have to remove; "-" when nothing waits."""
    row = attribution_summary(requests).set_index("group").loc["slowest 1% by TTFT"]
    waits = {c: float(row[c]) for c in row.index if c.endswith("_ms")
             and c not in ("ttft", "e2el", *EXECUTION)}
    column, value = max(waits.items(), key=lambda kv: kv[1], default=("", 0.0))
    if value <= 0:
        return "-"
    labels = {c.removesuffix("_s") + "_ms": label for c, label in PARTS.items()}
    return labels.get(column, column.removesuffix("_ms"))


def tightest(record: dict[str, Any], slos: dict[str, float]) -> str:
    """The SLO closest to (or furthest past) its bound, as "key NN%" of the bound."""
    ratios = {k: float(record.get(k) or 0.0) / bound for k, bound in slos.items() if bound > 0}
    key, ratio = max(ratios.items(), key=lambda kv: kv[1], default=("-", 0.0))
    return f"{key} {ratio:.0%}"


def plan_table(records: Sequence[dict[str, Any]], slos: dict[str, float]) -> pd.DataFrame:
    """One row per simulated shape, passing shapes first, cheapest first; `tightest` is the
    SLO nearest its bound, `binds` the largest wait behind the slowest TTFTs."""
    columns = ["shape", "replicas", "gpus", "cost_per_hour", *slos, "failed", "meets_slo",
               "tightest", "binds"]
    rows = [{**{c: r.get(c) for c in columns}, "tightest": tightest(r, slos)} for r in records]
    table = pd.DataFrame(rows, columns=columns)
    return table.sort_values(["meets_slo", "cost_per_hour", "gpus", "shape"],
                             ascending=[False, True, True, True], kind="stable")


def render_plan(table: pd.DataFrame) -> str:
    lines = []
    for row in table.to_dict("records"):
        metrics = "  ".join(f"{k}={row[k]:.1f}" for k in row if k.endswith("_ms"))
        verdict = "meets" if row["meets_slo"] else "misses"
        lines.append(f"{verdict:<7}${row['cost_per_hour']:>8.2f}/h {row['gpus']:>4} GPUs  "
                     f"{row['shape']:<48} {metrics}  tightest: {row['tightest']}  "
                     f"TTFT waits on: {row['binds']}")
    return "\n".join(lines)


def pareto_figure(records: Sequence[dict[str, Any]]) -> Any:
    """Output tokens/s per GPU against tokens/s per user (1000 / mean TPOT), one point per
    simulated shape, passing shapes filled."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, ax = plt.subplots(figsize=(6.4, 4.4))
    for passing, marker in ((True, "o"), (False, "x")):
        points = [r for r in records if bool(r.get("meets_slo")) == passing
                  and r.get("mean_tpot_ms")]
        ax.scatter([1000.0 / r["mean_tpot_ms"] for r in points],
                   [r["output_throughput"] / r["gpus"] for r in points], marker=marker,
                   label="meets the SLOs" if passing else "misses")
    ax.set_xlabel("tokens/s per user (1000 / mean TPOT)")
    ax.set_ylabel("output tokens/s per GPU")
    ax.set_title("rt plan: simulated shapes")
    ax.legend()
    figure.tight_layout()
    return figure


def write_plan(records: Sequence[dict[str, Any]], slos: dict[str, float], root: Path
               ) -> tuple[str, str, dict[str, Any]]:
    """`rt plan`'s outputs: writes root/plan.csv; returns the table as text, the closest
    shape (the table's first; "none simulated") and the Pareto figure by file stem."""
    table = plan_table(records, slos)
    table.to_csv(root / PLAN_TABLE, index=False)
    closest = str(table.iloc[0]["shape"]) if len(table) else "none simulated"
    return render_plan(table), closest, {"pareto": pareto_figure(records)}


def report_plan(records: Sequence[dict[str, Any]], slos: dict[str, float], root: Path,
                ranked: Sequence[Any], pruned: int, echo: Callable[[str], None],
                log: Callable[[str], None]) -> str | None:
    """`write_plan`'s table to `echo`, its figure under `root`, the counts (shapes simulated,
    `pruned` candidates) to `log`; then the cheapest of the `ranked` shapes (`sim.plan`'s,
    cheapest first: `fleet_toml()`, `summary()`) as root/fleet.toml. Returns None, or with
    no shape ranked the closest one."""
    root.mkdir(parents=True, exist_ok=True)  # nothing simulated: no shape's run made it
    text, closest, figures = write_plan(records, slos, root)
    echo(text)
    save_figures(figures, root, log)
    shapes = "shape" if len(records) == 1 else "shapes"
    candidates = "candidate" if pruned == 1 else "candidates"
    log(f"{len(records)} {shapes} simulated, {pruned} {candidates} pruned")
    if not ranked:
        return closest
    (root / "fleet.toml").write_text(ranked[0].fleet_toml())
    echo(f"cheapest: {ranked[0].summary()} -> {root / 'fleet.toml'}")
    return None

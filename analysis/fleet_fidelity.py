"""`rt fidelity --fleet`'s comparison: a real fleet run against the simulated fleet.

Both runs have a `replica` column (the real one from the router's `x-rt-replica` header) and
per-request cached tokens (the real one as the servers reported them), so both are read the
same way (`analysis.fleet`). Side by side:

* per replica: request share (fractions; difference in points, sim - real), also as sorted
  shares: a prefix-aware policy breaking a tie by a draw may put the same groups of
  conversations on other replica indexes, a relabelling that changes nothing else;
* the fleet prefix hit rate (cached / prompt tokens; difference in points);
* p50/p90/p99 of TTFT and ITL (ms; relative error (sim - real) / real);
* failed requests;
* the router's measured overheads (`backends.route.overheads.RouterOverheads` as a dict) and
  what the simulation assumed of them (its routing latency; its scrape staleness: a tick
  every refresh, refresh / 2 on average; `sim.fleet_twin.fleet_twin` sets both from the
  measured ones);
* the serving stack's own time: what the twin modelled (fitted on a calibration replay,
  `sim.serving_stack`), and the mean TTFT split into its parts, real (the replicas'
  histograms, `backends.route.stack_probe`) and simulated.

`GOALS` are the issue's: shares within 5 points, hit rate within 3, p50/p90 TTFT within 10%.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from analysis.fidelity import metric_errors
from analysis.fleet import fleet_summary, replica_table
from analysis.rundir import Run, load_run

LATENCY_KEYS = tuple(f"p{q}_{m}_ms" for m in ("ttft", "itl") for q in (50, 90, 99))
GOALS = {"share_points": 5.0, "hit_rate_points": 3.0, "p50_ttft_ms": 0.10,
         "p90_ttft_ms": 0.10}


def _failed(run: Run) -> int:
    return int((run.requests["status"] == "FINISHED_ABORTED").sum())


def compare_fleets(real: Run, sim: Run, overheads: Mapping[str, Any]) -> dict[str, Any]:
    """The side-by-side figures (JSON-ready; NaN as null)."""
    fleet = sim.info.get("fleet") or {}
    n = int(fleet.get("replicas") or 1)
    tables = {name: replica_table(run.requests, run.steps, n)
              for name, run in (("real", real), ("sim", sim))}
    shares = {name: [float(x) for x in t["share"]] for name, t in tables.items()}
    diff = [100 * (s - r) for r, s in zip(shares["real"], shares["sim"], strict=True)]
    sorted_diff = [100 * (s - r) for r, s in zip(sorted(shares["real"]),
                                                 sorted(shares["sim"]), strict=True)]
    hits = {name: fleet_summary(t)["prefix_hit_rate"] for name, t in tables.items()}
    latency = metric_errors([real], [sim]).loc[list(LATENCY_KEYS)]
    refresh_ms = float(fleet.get("router_refresh_ms", math.nan))
    out: dict[str, Any] = {
        "replicas": n, "router": fleet.get("router"), "router_args": fleet.get("router_args"),
        "share": {**shares, "points": diff, "max_points": max(map(abs, diff), default=0.0),
                  "sorted_max_points": max(map(abs, sorted_diff), default=0.0)},
        "replica_hit_rate": {name: [float(x) for x in t["prefix_hit_rate"]]
                             for name, t in tables.items()},
        "prefix_hit_rate": {**hits, "points": 100 * (hits["sim"] - hits["real"])},
        "latency": {key: {col: float(row[col]) for col in ("real", "sim", "error")}
                    for key, row in latency.iterrows()},
        "failed": {"real": _failed(real), "sim": _failed(sim)},
        "router_overheads": {"real": dict(overheads),
                             "not_measured": (real.info.get("router") or {}).get(
                                 "overheads_not_measured"),
                             "sim": {"routing_latency_s": fleet.get("routing_latency_ms",
                                                                    0.0) / 1e3,
                                     "scrape_age_mean_s": refresh_ms / 2e3,
                                     "refresh_s": refresh_ms / 1e3,
                                     "refresh_flag_s": float(fleet.get(
                                         "router_refresh_ms_flag", refresh_ms)) / 1e3}},
        "cached_tokens_reported": real.info.get("cached_tokens_reported"),
        "serving_stack": serving_stack(real, sim),
    }
    out["goals"] = _goals(out)
    return out


def _sim_split(sim: Run) -> dict[str, float]:
    """The simulated mean TTFT (ms) as routing + serving stack (the records' API-server
    time: a fitted stack's delay, or the profile's API-server stage) + engine (the rest:
    step boundary, queue, prefill)."""
    r = sim.requests
    ttft = (r["first_token_s"] - r["arrival_s"]).mean() * 1e3
    routing = r["routing_s"].mean() * 1e3 if "routing_s" in r else 0.0
    stack = r["api_server_s"].mean() * 1e3
    return {"ttft_mean_ms": float(ttft), "routing_mean_ms": float(routing),
            "serving_stack_mean_ms": float(stack),
            "engine_mean_ms": float(ttft - routing - stack)}


def serving_stack(real: Run, sim: Run) -> dict[str, Any]:
    """The serving stack's time: what the twin assumed (`fitted`: fitted on a calibration
    replay, `sim.serving_stack`; else the profile's API-server cost), the real TTFT's split
    from the replicas' histograms (`backends.route.stack_probe`; absent in older runs) and
    the simulated one's (`_sim_split`)."""
    return {"model": (sim.info.get("fleet") or {}).get("serving_stack") or {},
            "real_split": (real.info.get("router") or {}).get("ttft_split") or {},
            "sim_split": _sim_split(sim)}


def stack_lines(s: Mapping[str, Any]) -> list[str]:
    """The console lines of `serving_stack`'s section."""
    model, real, sim = s["model"], s["real_split"], s["sim_split"]
    if model.get("fitted"):
        clamped = f"; clamped at 0: {', '.join(model['clamped'])}" if model["clamped"] else ""
        cold = model.get("cold_left_out", 0)
        lines = [f"serving stack (fitted on {_windows(model.get('windows', 1))} of "
                 f"{model['requests']} other requests{_cold(cold)}): "
                 f"{model['per_request_ms']:.2f} ms per request + "
                 f"{model['per_prompt_token_us']:.2f} us per prompt token before the engine; "
                 f"real - twin TTFT p50 {model['gap_p50_ms']:.2f} / p90 "
                 f"{model['gap_p90_ms']:.2f} ms, after the fit (in-sample, the calibration "
                 f"{'windows' if model.get('windows', 1) > 1 else 'replay'}) p50 "
                 f"{model['residual_p50_ms']:+.2f} / p90 {model['residual_p90_ms']:+.2f} ms"
                 f"{clamped}"]
        lines += _spread_lines(model) + _floor_lines(model.get("noise_floor"))
    else:
        api = model.get("api_server") or {}
        why = f"{model['not_fitted']}; " if "not_fitted" in model else ""
        lines = [f"serving stack: not fitted ({why}the profile's API-server cost, "
                 f"{_ms(api.get('per_request_s'))} per request)"]
    if real:  # a part not measured (the router's or a replica's /metrics unread): n/a
        lines.append(f"real TTFT mean {_num(real['client_ttft_mean_ms'])} ms = routing "
                     f"{_num(real['routing_mean_ms'])} + HTTP hops and client "
                     f"{_num(real['hops_mean_ms'])} + API server and IPC "
                     f"{_num(real['api_ipc_mean_ms'])} + engine "
                     f"{_num(real['engine_mean_ms'])} (the replicas' histograms)")
    lines.append(f"sim TTFT mean {sim['ttft_mean_ms']:.2f} ms = routing "
                 f"{sim['routing_mean_ms']:.2f} + serving stack "
                 f"{sim['serving_stack_mean_ms']:.2f} + engine {sim['engine_mean_ms']:.2f}")
    return lines


def _windows(count: int) -> str:
    """What the stack's line calls the calibration replays it was fitted on."""
    return ("a calibration replay" if count == 1 else
            f"{count} calibration windows (before and after the measured replay, pooled)")


def _floor_lines(floor: Mapping[str, Any] | None) -> list[str]:
    """The console lines of the noise floor (`sim.fleet_twin._noise_floor`): each calibration
    window's fit predicting the other's p50/p90 TTFT; none in older runs."""
    if not floor:
        return []
    if not floor["measured"]:
        return [f"  noise floor: not measured ({floor['why']})"]
    lines = [f"  noise floor (real against real: one calibration window's fit predicting "
             f"the other's TTFT): p50 {floor['p50_ttft']:.1%} / p90 "
             f"{floor['p90_ttft']:.1%}"]
    for w in floor["windows"]:
        e = w["predicts_other"]
        lines.append(f"    {w['window']:<6} window: {w['requests']} requests, "
                     f"{w['per_request_ms']:.2f} ms + {w['per_prompt_token_us']:.2f} us per "
                     f"token, real - twin p50 {w['gap_p50_ms']:.2f} / p90 "
                     f"{w['gap_p90_ms']:.2f} ms; predicts the other p50 "
                     f"{e['p50_ttft']:+.1%} / p90 {e['p90_ttft']:+.1%}")
    same = floor.get("same_requests")
    if same:  # since fid15d: both windows replay the same requests
        lines.append(f"    the same {same['requests']} requests after against before: real TTFT "
                     f"{same['after_minus_before_p50_ms']:+.2f} ms (median, each against "
                     f"itself), slower after in {same['slower_after']}")
    return lines


def _cold(left_out: int) -> str:
    """What the stack's line says of the calibration requests left out as cold."""
    return (f", {left_out} arriving before the first one's first token left out (cold)"
            if left_out else "")


def _spread_lines(model: Mapping[str, Any]) -> list[str]:
    """The console lines of a fitted stack's spread (the residuals each request draws
    from, `sim.serving_stack.Spread`) and of the delays drawn; none in older runs."""
    spread, drawn = model.get("spread"), model.get("drawn")
    if not spread:
        return []
    q = " / ".join(f"{k} {v:+.2f}" for k, v in spread["quantiles_ms"].items())
    lines = [f"  spread around the line ({spread['residuals']} residuals, one drawn per "
             f"request): {q} ms"]
    if drawn and drawn.get("requests"):
        lines.append(f"  delays drawn for the trace: p50 {drawn['p50_ms']:.2f} / p90 "
                     f"{drawn['p90_ms']:.2f} / p99 {drawn['p99_ms']:.2f} ms "
                     f"({drawn['at_zero']} at 0), after the routing decision")
    return lines


def _goals(c: Mapping[str, Any]) -> dict[str, bool]:
    """Each goal met? (shares: as sorted shares, indexes may be relabelled)."""
    return {"share_within_5_points": c["share"]["sorted_max_points"] <= GOALS["share_points"],
            "hit_rate_within_3_points": abs(c["prefix_hit_rate"]["points"])
            <= GOALS["hit_rate_points"],
            "p50_ttft_within_10pct": abs(c["latency"]["p50_ttft_ms"]["error"])
            <= GOALS["p50_ttft_ms"],
            "p90_ttft_within_10pct": abs(c["latency"]["p90_ttft_ms"]["error"])
            <= GOALS["p90_ttft_ms"]}


def render(c: Mapping[str, Any]) -> str:
    """Fixed-width text of `compare_fleets`' figures."""
    lines = [f"fleet of {c['replicas']} behind {c['router']}: real (rt serve --simulate "
             f"behind rt route) vs simulated",
             f"{'replica':<10}{'real share':>12}{'sim share':>12}{'points':>8}"
             f"{'real hits':>11}{'sim hits':>10}"]
    share, hits = c["share"], c["replica_hit_rate"]
    for r in range(c["replicas"]):
        lines.append(f"{r:<10}{share['real'][r]:>12.1%}{share['sim'][r]:>12.1%}"
                     f"{share['points'][r]:>+8.1f}{hits['real'][r]:>11.1%}"
                     f"{hits['sim'][r]:>10.1%}")
    lines.append(f"share: max |difference| {share['max_points']:.1f} points by index, "
                 f"{share['sorted_max_points']:.1f} as sorted shares")
    p = c["prefix_hit_rate"]
    lines.append(f"fleet prefix hit rate: real {p['real']:.1%}, sim {p['sim']:.1%} "
                 f"({p['points']:+.1f} points)")
    lines.append(f"{'latency':<16}{'real':>10}{'sim':>10}{'error':>9}")
    for key, row in c["latency"].items():
        lines.append(f"{key:<16}{row['real']:>10.2f}{row['sim']:>10.2f}{row['error']:>+9.1%}")
    lines.append(f"failed requests: real {c['failed']['real']}, sim {c['failed']['sim']}")
    o, s = c["router_overheads"]["real"], c["router_overheads"]["sim"]
    unread = c["router_overheads"].get("not_measured")
    lines.append(f"router (measured): unavailable ({unread})" if unread else
                 f"router (measured): routing latency mean {_ms(o['routing_latency_mean_s'])}, "
                 f"p50 {_ms(o['routing_latency_p50_s'])}, p99 "
                 f"{_ms(o['routing_latency_p99_s'])}; scrape age at decisions mean "
                 f"{_ms(o['scrape_age_mean_s'])} (scrape period "
                 f"{_ms(o.get('scrape_period_s', math.nan))}); retries {o['retries']:g}, "
                 f"backend errors {o['backend_errors']:g}")
    lines.append(f"router (simulated): routing latency {_ms(s['routing_latency_s'])}, "
                 f"refresh {_ms(s['refresh_s'])}, scrape age mean "
                 f"{_ms(s['scrape_age_mean_s'])} (refresh / 2)")
    period = o.get("scrape_period_s", math.nan)
    if math.isfinite(period) and not math.isclose(period, s["refresh_flag_s"]):
        lines.append("  (the real router scrapes at another period than the refresh: the "
                     "policy reads no gauge, its scrapes are liveness checks only)")
    lines += stack_lines(c["serving_stack"])
    met = c["goals"]
    lines.append("goals: " + ", ".join(f"{k} {'met' if v else 'NOT met'}"
                                       for k, v in met.items()))
    floor = c["serving_stack"]["model"].get("noise_floor") or {}
    if floor.get("measured"):
        lines.append("TTFT error against the noise floor: " + ", ".join(
            f"p{q} {c['latency'][f'p{q}_ttft_ms']['error']:+.1%} (floor "
            f"{floor[f'p{q}_ttft']:.1%})" for q in (50, 90)))
    return "\n".join(lines)


def _num(value: float | None) -> str:
    """`value` to 2 decimals, or "n/a" when unknown (run.json's null, or NaN)."""
    return "n/a" if value is None or not math.isfinite(value) else f"{value:.2f}"


def _ms(seconds: float | None) -> str:
    """Seconds as milliseconds ("1.25 ms"), or "n/a" when unknown."""
    return "n/a" if seconds is None or not math.isfinite(seconds) else f"{seconds * 1e3:.2f} ms"


def _clean(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_clean(v) for v in value]
    return value


def write_fleet_fidelity(real_dir: Path, sim_dir: Path, overheads: Mapping[str, Any],
                         root: Path) -> str:
    """Compare the two run directories; writes root/fleet_fidelity.json; returns the text."""
    comparison = compare_fleets(load_run(real_dir), load_run(sim_dir), overheads)
    (root / "fleet_fidelity.json").write_text(json.dumps(_clean(comparison), indent=2) + "\n")
    return render(comparison)

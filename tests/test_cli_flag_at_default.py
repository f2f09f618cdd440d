"""A flag of another mode is refused when typed, at its default value too (leftovers24).

The refusals (`cli.not_with` and the libraries' "needs ..." checks) once compared each flag
with its default, so `rt simulate --pd-threshold 16` (16: the default) without P/D ran and
ignored the flag while `--pd-threshold 17` was refused. Each case below types the flag at its
default value: one line naming it and the mode, exit 2, nothing written. Flags at their
default in their own mode stay accepted. In-process (typer's CliRunner); no model, no server.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

import cli
from tests.cli_runs import simulated_run

_ENDPOINT = "--endpoint (the server runs the model)"
_STEPS = "--from-steps (no model runs here)"
_FLEET = ": --replicas N or --fleet FILE"
_PD = " (--pd-decider always or prefix-threshold on a fleet, or pools with roles)"
_POOL = '[[pool]]\nname = "p"\ncount = 2\ngpu = "h200"\nmodel = "llama-3.1-8b"\n'


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A 4-request trace, a simulated run of it (for --from-steps) and a one-pool fleet."""
    root = tmp_path_factory.mktemp("at_default")
    trace, run = simulated_run(root)
    fleet = root / "fleet.toml"
    fleet.write_text(_POOL)
    return {"t": trace, "run": run, "fleet": fleet}


@pytest.mark.parametrize(("args", "line"), [
    # cli.not_with: the real engine's flags with --endpoint, --from-steps, --fleet
    (["replay", "{t}", "--endpoint", "http://127.0.0.1:9", "--device", "cpu"],
     f"--device 'cpu' does not apply with {_ENDPOINT}"),
    (["replay", "{t}", "--endpoint", "http://127.0.0.1:9", "--block-size", "16"],
     f"--block-size 16 does not apply with {_ENDPOINT}"),
    (["replay", "{t}", "--endpoint", "http://127.0.0.1:9", "--enable-prefix-caching"],
     f"--enable-prefix-caching does not apply with {_ENDPOINT}"),
    (["calibrate", "-o", "{o}", "--from-steps", "{run}", "--dtype", "auto"],
     f"--dtype 'auto' does not apply with {_STEPS}"),
    (["calibrate", "-o", "{o}", "--from-steps", "{run}", "--policy", "fcfs"],
     f"--policy 'fcfs' does not apply with {_STEPS}"),
    (["fidelity", "{t}", "--fleet", "--device", "cpu"],
     "--device 'cpu' does not apply with --fleet (rt serve --simulate replicas)"),
    (["fidelity", "{t}", "--endpoint", "http://127.0.0.1:9", "--dtype", "auto"],
     f"--dtype 'auto' does not apply with {_ENDPOINT}"),
    # rt serve / rt fleet up: the other engine's flags
    (["serve", "--port", "0", "--simulate", "--device", "cpu"],
     "--device 'cpu' is the real engine's: not with --simulate"),
    (["serve", "--port", "0", "--gpu", "h200"],
     "--gpu 'h200' is the simulated engine's: it needs --simulate"),
    (["serve", "--port", "0", "-tp", "1"],
     "--tensor-parallel-size 1 needs --simulate (the real engine runs on one device)"),
    (["fleet", "up", "--port", "0", "--replicas", "1", "--tensor-parallel-size", "1"],
     "--tensor-parallel-size 1 needs --simulate (the real engine runs on one device)"),
    # rt simulate: --fleet FILE sets these per pool
    (["simulate", "--trace", "{t}", "--fleet", "{fleet}", "--gpu", "h200"],
     "--fleet sets each pool's gpu: --gpu 'h200' would be ignored (set gpu in its [[pool]] "
     "table)"),
    (["simulate", "--trace", "{t}", "--fleet", "{fleet}", "--block-size", "16"],
     "--fleet sets each pool's engine flags: --block-size 16 would be ignored (set "
     "block_size in its [pool.engine] table)"),
    # rt simulate: a fleet's, P/D's and autoscaling's flags where they cannot apply
    (["simulate", "--trace", "{t}", "--router", "round-robin"],
     "--router 'round-robin' needs a fleet" + _FLEET),
    (["simulate", "--trace", "{t}", "--gpu-cost-per-hour", "0"],
     "--gpu-cost-per-hour 0.0 needs a fleet" + _FLEET),
    (["simulate", "--trace", "{t}", "--pd-threshold", "16"], "--pd-threshold 16 needs P/D" + _PD),
    (["simulate", "--trace", "{t}", "--replicas", "2", "--pd-transfer-gbps", "25"],
     "--pd-transfer-gbps 25.0 needs P/D" + _PD),
    (["simulate", "--trace", "{t}", "--replicas", "2", "--pd-decider", "always",
      "--pd-threshold", "16"], "--pd-threshold 16 needs --pd-decider prefix-threshold"),
    (["simulate", "--trace", "{t}", "--min-replicas", "1"],
     "--min-replicas 1 needs --autoscale"),
    # rt sweep: the search's own flags without --find-max-rate
    (["sweep", "--trace", "{t}", "--max-num-seqs", "8,16", "--rate-tolerance", "0.05"],
     "--rate-tolerance 0.05 needs --find-max-rate"),
])
def test_a_flag_of_another_mode_at_its_default_is_refused(
        files: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        args: list[str], line: str) -> None:
    _nothing_starts(monkeypatch)
    out = tmp_path / "out"
    argv = [a.format(o=out, **files) for a in args]
    if argv[0] in ("replay", "fidelity", "simulate", "sweep"):
        argv += ["--result-dir", str(out)]
    result = CliRunner().invoke(cli.app, argv)
    assert (result.exit_code, result.stderr) == (2, f"rt: error: {line}\n"), result.output
    assert not out.exists()


def _nothing_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    """A server, a fleet or an endpoint's client that would start fails the case at once
    (a flag accepted here once ran them: a server until stopped)."""
    from backends.route import fleet
    from backends.serve import api_server

    def started(*_: object, **__: object) -> None:
        raise AssertionError("the run started")

    for owner, name in ((api_server, "run_server"), (fleet, "run_fleet"),
                        (cli, "run_endpoint"), (cli, "_fidelity_fleet")):
        monkeypatch.setattr(owner, name, started)


def test_flags_at_their_default_in_their_own_mode_are_accepted(
        files: dict[str, Path], tmp_path: Path) -> None:
    """A P/D fleet given the P/D, fleet and autoscaling flags it reads at their defaults."""
    out = tmp_path / "ok"
    result = CliRunner().invoke(cli.app, [
        "simulate", "--trace", str(files["t"]), "--replicas", "2", "--router", "round-robin",
        "--pd-decider", "prefix-threshold", "--pd-threshold", "16", "--pd-transfer-gbps",
        "25", "--gpu-cost-per-hour", "0", "--result-dir", str(out)])
    assert result.exit_code == 0, result.output
    assert (out / "run.json").is_file()


def test_fleet_up_takes_tp_at_its_default_with_simulate(monkeypatch: pytest.MonkeyPatch) -> None:
    from backends.route import fleet

    plans: list[fleet.FleetPlan] = []
    monkeypatch.setattr(fleet, "run_fleet", lambda plan, *_: plans.append(plan))
    result = CliRunner().invoke(cli.app, ["fleet", "up", "--simulate", "--replicas", "1",
                                          "--port", "0", "-tp", "1"])
    assert result.exit_code == 0, result.output
    assert len(plans) == 1

"""Bad input through the whole CLI (the audit in docs/results.md, "Bad input audit
(2026-12-02)"): each case below once ended in a traceback, a hang, a misleading error after
the work was done, silent acceptance, or the loss of a user's files. Each now exits 2 with
one line on stderr that names the field (and the value where it is the value's fault),
before any work starts. In-process (typer's CliRunner); no server, no model is loaded."""

from __future__ import annotations

import contextlib
import json
import math
import shutil
import signal
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

import cli
from tests.cli_runs import simulated_run

HUGE = "99999999999999999999"  # > 2**63: once an OverflowError or a hang


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A 4-request trace, a run of it, and broken copies of that run."""
    root = tmp_path_factory.mktemp("bad")
    trace, run = simulated_run(root)
    listed = root / "listed"
    shutil.copytree(run, listed)
    (listed / "run.json").write_text("[1]\n")
    interrupted = root / "interrupted"
    shutil.copytree(run, interrupted)
    (interrupted / "INTERRUPTED").write_text("x\n")
    fleet = root / "fleet.toml"
    fleet.write_text("pool = [1, 2]\n")
    nan_run = _edited(run, root / "nan_run", "requests", arrival_s=math.nan)
    str_run = _edited(run, root / "str_run", "requests", arrival_s="0.5")
    null_steps = _edited(run, root / "null_steps", "steps", start_s=None)
    _as_replay(null_steps)  # rt calibrate reads a replay's steps (a simulation's: refused)
    deep = root / "deep.jsonl"
    deep.write_text('{"format": "rt-trace", "version": 1, "name": "d", "requests": 1}\n'
                    + "[" * 5000 + "]" * 5000 + "\n")
    return {"trace": trace, "run": run, "listed": listed, "interrupted": interrupted,
            "fleet": fleet, "root": root, "nan_run": nan_run, "str_run": str_run,
            "null_steps": null_steps, "deep": deep}


def _as_replay(run: Path) -> None:
    """`run`'s run.json says a replay wrote it (kind "replay")."""
    info = json.loads((run / "run.json").read_text())
    (run / "run.json").write_text(json.dumps({**info, "kind": "replay"}))


def _edited(run: Path, path: Path, table: str, **columns: object) -> Path:
    """A copy of `run` whose `table`.parquet has `columns` set to one value each."""
    import pandas as pd

    shutil.copytree(run, path)
    frame = pd.read_parquet(path / f"{table}.parquet")
    for name, value in columns.items():
        frame[name] = pd.Series([value] * len(frame), dtype=object if value is None else None)
    frame.to_parquet(path / f"{table}.parquet")
    return path


def _cases(f: dict[str, Path]) -> list[tuple[list[str], list[str]]]:
    """(arguments, what the one line must contain)."""
    t, run, out = str(f["trace"]), str(f["run"]), str(f["root"] / "out")
    sim = ["simulate", "--trace", t, "--result-dir", out]
    plan = ["plan", t, "--slo", "p99_ttft_ms=500", "--result-dir", out, "-j", "1"]
    sweep = ["sweep", "--trace", t, "--result-dir", out, "-j", "1", "--no-plots"]
    return [
        # the parser's own refusals, as one line with the value
        (["simulate", "--max-num-seqs", "abc"], ["--max-num-seqs", "'abc'"]),
        (["bench", "fleet", "--replicas=0"], ["--replicas", "'0'"]),
        (["simulate", "--bogus"], ["--bogus"]),
        # once an OverflowError or a hang
        ([*sim, "--replicas", HUGE], ["--replicas", HUGE]),
        ([*sim, "--routers", HUGE], ["--routers", HUGE]),
        ([*sim, "--replicas", "2", "--sim-workers", "0"], ["--sim-workers", "0"]),
        ([*sim, "--replicas", "2", "--sim-workers", "300"], ["--sim-workers", "300"]),
        (["bench", "fleet", "--sim-workers", "0"], ["--sim-workers", "0"]),
        ([*sim, "--num-gpu-blocks-override", HUGE], ["num_blocks", HUGE]),
        (["trace", "gen", "-o", out, "--random-prefix-len", HUGE], ["--random-prefix-len"]),
        (["bench", "fleet", "--replicas", HUGE], ["--replicas", HUGE]),
        ([*plan, "--max-gpus", HUGE], ["--max-gpus", HUGE]),
        (["fidelity", t, "--repeats", HUGE], ["--repeats", HUGE]),
        (["fleet", "up", "--simulate", "--port", "70000"], ["--port", "70000"]),
        (["route", "--backend", "http://127.0.0.1:9", "--port", "-1"], ["--port", "-1"]),
        (["serve", "--simulate", "--port", "70000"], ["--port", "70000"]),  # once a hang
        # once uvicorn's lines and exit 3 (TEST-NET-1: no DNS, not on this machine)
        (["serve", "--simulate", "--host", "192.0.2.1", "--port", "0"],
         ["--host '192.0.2.1'", "cannot listen"]),
        # once an AttributeError or TypeError on a malformed file
        ([*sim, "--fleet", str(f["fleet"])], ["pool 1", "[[pool]]"]),
        (["report", str(f["listed"]), "--no-plots"], ["run.json", "list"]),
        (["calibrate", "-o", out, "--from-steps", str(f["listed"])], ["run.json"]),
        ([*sweep, "--slo", "p99_ttft_ms=-1", "--find-max-rate"], ["--slo", "p99_ttft_ms=-1"]),
        ([*sweep, "--slo", "p99_ttft_ms=nan", "--find-max-rate"], ["--slo", "nan"]),
        ([*plan, "--max-num-seqs", "0"], ["--max-num-seqs", "'0'"]),
        # once after the start-up lines or the work
        ([*sim, "--replicas", "2", "--autoscale", "kv-threshold", "--autoscale-arg", "x"],
         ["--autoscale-arg", "'x'"]),
        ([*sim, "--replicas", "2", "--routers", "2", "--pd-decider", "always"],
         ["--routers 2"]),
        (["calibrate", "-o", str(f["root"]), "--from-steps", run], ["--output"]),
        # once accepted silently
        ([*sim, "--router", "nope"], ["'nope'"]),
        ([*sim, "--prefill-router", "nope"], ["'nope'"]),
        (["calibrate", "-o", out, "--from-steps", str(f["interrupted"])], ["interrupted"]),
        ([*plan, "--gpu-cost", "nope=1"], ["--gpu-cost", "'nope'"]),
        ([*plan, "--gpu-cost", "h200=-1"], ["--gpu-cost", "h200=-1"]),
        ([*plan, "--gpu-cost", "h200=1e308"], ["--gpu-cost", "h200=1e308", "at most 10000"]),
        ([*plan, "--tensor-parallel-sizes", "0"], ["--tensor-parallel-sizes", "'0'"]),
        (["report", run, "--no-plots", "--goodput", "ttft:nan"], ["--goodput", "ttft:nan"]),
        (["report", run, "--no-plots", "--requests", "0"], ["--requests", "0"]),
        ([*sweep, "--rate-tolerance", "nan"], ["--rate-tolerance", "nan"]),
        ([*sweep, "--jobs", "0"], ["--jobs", "0"]),
        (["fidelity", t, "--fleet", "--endpoint", "http://127.0.0.1:9"],
         ["--fleet", "--endpoint"]),
        # badinput21: once an OverflowError in the simulator (a seed past numpy's 2^32 - 1)
        ([*sim, "--seed", "-1"], ["--seed", "'-1'"]),
        ([*sim, "--seed", HUGE], ["--seed", HUGE]),
        (["serve", "--simulate", "--seed", "4294967296"], ["--seed", "'4294967296'"]),
        # once an IndexError after the run (per-second bins of a 5e307 s span)
        ([*sim, "--time-scale", "1e308"], ["--time-scale", "1e+308", "194 days"]),
        # once a RecursionError
        (["trace", "inspect", str(f["deep"])], ["deep.jsonl:2", "nested too deeply"]),
        # once a numpy error after the report's first lines, a TypeError, a TypeError
        (["report", str(f["nan_run"]), "--no-plots"], ["requests.parquet", "'arrival_s'",
                                                       "nan"]),
        (["compare", run, str(f["str_run"]), "--no-plots"], ["'arrival_s'", "str"]),
        (["calibrate", "-o", out, "--from-steps", str(f["null_steps"])],
         ["steps.parquet", "'start_s'", "None"]),
        # once uvicorn's KeyError, a ValueError from int(nan), after the start-up line
        (["serve", "--simulate", "--port", "0", "--uvicorn-log-level", "nope"],
         ["--uvicorn-log-level", "'nope'"]),
        (["serve", "--simulate", "--port", "0", "--shutdown-timeout", "nan"],
         ["--shutdown-timeout", "nan"]),
        # once the model loaded and the replays run: a NaN gate never failed a run, a NaN
        # limit never cut the grid
        (["fidelity", t, "--max-error", "nan", "--result-dir", out], ["--max-error", "nan"]),
        (["calibrate", "-o", out, "--time-limit", "nan"], ["--time-limit", "nan"]),
        # once 99999 replicas simulated, and 'nope' accepted (one replica: never routed)
        ([*sweep, "--replicas", "1,99999"], ["--replicas", "99999"]),
        ([*sweep, "--router", "nope"], ["'nope'"]),
        # badinput4: a grid of any size was built and run (10^8 configurations for 4 lists
        # of 100)
        ([*sweep, "--max-num-seqs", ",".join(map(str, range(1, 102))), "--request-rate",
          ",".join(map(str, range(1, 101)))],
         ["the sweep is 10,100 runs", "101 --max-num-seqs x 100 --request-rate"]),
        # once named as --num-prompts (its default), a hang before the first line
        (["bench", "serve", "--concurrency", HUGE], ["--concurrency", HUGE]),
        (["bench", "route", "--rounds", HUGE], ["--rounds", HUGE]),
        # badinput23: once simulated, though vLLM refuses a block size its CUDA attention
        # backend does not take (multiples of 16)
        ([*sim, "--block-size", "7"], ["--block-size", "multiple of 16", "7"]),
        ([*sweep, "--block-size", "16,8"], ["--block-size", "8"]),
        (["serve", "--simulate", "--port", "0", "--block-size", "24"], ["--block-size", "24"]),
        (["replay", t, "--block-size", "8", "--result-dir", out], ["--block-size", "8"]),
        # once planned: 4096 `rt serve` processes and their engines on one machine
        (["fleet", "up", "--simulate", "--replicas", "4096", "--port", "0"],
         ["--replicas 4096", "this machine holds at most"]),
        (["fidelity", t, "--fleet", "--replicas", "4096", "--result-dir", out],
         ["--replicas 4096", "this machine holds at most"]),
        # once refused only after the real replay had run (the model loaded, 7 s here)
        (["fidelity", t, "--profile", str(f["run"] / "run.json"), "--result-dir", out],
         ["run.json", "unknown field"]),
        (["fidelity", t, "--profile", str(f["root"] / "none.json"), "--result-dir", out],
         ["none.json", "no such profile file"]),
    ]


@contextlib.contextmanager
def _deadline(seconds: int) -> Iterator[None]:
    """TimeoutError in the test after `seconds`: a case that regresses into a hang fails."""
    def expire(signum: int, frame: object) -> None:
        raise TimeoutError(f"still running after {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def _one_line(args: list[str]) -> str:
    with _deadline(60):  # every case refuses before any work: well under a second
        result = CliRunner().invoke(cli.app, args)
    assert result.exit_code == 2, (result.exception, result.output)
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("rt: error: "), lines
    return lines[0]


@pytest.mark.parametrize("index", range(63))
def test_bad_input_is_one_line_naming_the_field(files: dict[str, Path], index: int) -> None:
    args, named = _cases(files)[index]
    line = _one_line(args)
    assert all(part in line for part in named), line


def test_every_case_is_run() -> None:
    assert len(_cases({k: Path(k) for k in ("trace", "run", "listed", "interrupted",
                                            "fleet", "root", "nan_run", "str_run",
                                            "null_steps", "deep")})) == 63


def test_a_result_dir_holding_other_files_is_never_replaced(files: dict[str, Path],
                                                             tmp_path: Path) -> None:
    """`rt simulate --result-dir DIR` replaced DIR whatever it held (a file, a home
    directory); a sweep or a plan wrote its files into any directory, "/" included."""
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep\n")
    precious = tmp_path / "precious.txt"
    precious.write_text("keep\n")
    t = str(files["trace"])
    for args in (["simulate", "--trace", t, "--result-dir", str(mine)],
                 ["simulate", "--trace", t, "--result-dir", str(precious)],
                 ["sweep", "--trace", t, "--result-dir", str(mine), "--no-plots"],
                 ["plan", t, "--slo", "p99_ttft_ms=500", "--result-dir", str(mine)]):
        assert f"result directory {args[args.index('--result-dir') + 1]}" in _one_line(args)
    assert sorted(p.name for p in mine.iterdir()) == ["notes.txt"]
    assert precious.read_text() == "keep\n"
    again = tmp_path / "again"  # a run directory is still replaced
    shutil.copytree(files["run"], again)
    assert CliRunner().invoke(cli.app, ["simulate", "--trace", t, "--result-dir",
                                        str(again)]).exit_code == 0
    assert json.loads((again / "run.json").read_text())["seed"] == 0


def test_serve_on_a_port_in_use_is_one_line_before_the_engine_starts() -> None:
    """`rt serve --port P` with P taken: uvicorn's log lines and exit 3 once, after the
    engine process had started; now the address is bound first."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        line = _one_line(["serve", "--simulate", "--port", port])
    assert f"--port {port}: cannot listen there" in line, line


def test_no_output_replaces_a_run_directorys_own_files(files: dict[str, Path],
                                                       tmp_path: Path) -> None:
    """badinput23: `rt calibrate -o RUN/run.json --from-steps RUN`, `rt trace convert T
    RUN/run.json`, `rt trace gen -o RUN/run.json`, `rt bench scheduler -o RUN/steps.parquet`
    each replaced a run's file, exit 0; now refused before any work, the run untouched."""
    run = tmp_path / "run"
    shutil.copytree(files["run"], run)
    before = {p.name: p.read_bytes() for p in run.iterdir()}
    for option, args in (
            ("--output", ["calibrate", "-o", str(run / "run.json"), "--from-steps", str(run)]),
            ("DST", ["trace", "convert", str(files["trace"]), str(run / "run.json")]),
            ("--output", ["trace", "gen", "-o", str(run / "requests.parquet")]),
            ("--out", ["bench", "scheduler", "-o", str(run / "steps.parquet")])):
        assert f"{option} {run}/" in _one_line(args)
    assert {p.name: p.read_bytes() for p in run.iterdir()} == before


@pytest.mark.parametrize("key", ["a\nb", "é", " padded "])
@pytest.mark.parametrize(("variable", "args"), [
    ("OPENAI_API_KEY", ["replay", "{t}", "--endpoint", "http://127.0.0.1:9"]),
    ("VLLM_API_KEY", ["serve", "--simulate", "--port", "0"]),
    ("VLLM_API_KEY", ["route", "--backend", "http://127.0.0.1:9", "--port", "0"]),
])
def test_an_api_key_no_header_can_carry_is_refused_unshown(
        files: dict[str, Path], key: str, variable: str, args: list[str]) -> None:
    """badinput23: a key with a newline was sent, and httpx's refusal printed it (the secret
    on stderr); a non-ASCII one was "'ascii' codec can't encode", the key's source unnamed;
    rt serve took either and answered every request 401. Now refused first, the key not
    shown."""
    with _deadline(60):
        result = CliRunner().invoke(cli.app, [a.format(t=files["trace"]) for a in args],
                                    env={variable: key})
    assert result.exit_code == 2, (result.exception, result.output)
    assert result.stderr == (f"rt: error: --api-key (or {variable}) must be printable ASCII "
                             "without surrounding blanks (it goes in an HTTP header); the "
                             "key given is not (not shown)\n")


def test_an_ambient_api_key_is_checked_only_where_it_would_be_sent() -> None:
    """review23: `OPENAI_API_KEY="sk-x " rt replay TRACE` (the local engine, no --endpoint)
    was refused for a key it never sends; with --endpoint the same key is refused."""
    from backends.replay.flags import EndpointFlags

    assert EndpointFlags(api_key="sk-x ").api_key == "sk-x "
    with pytest.raises(ValueError, match=r"^--api-key \(or OPENAI_API_KEY\) must be printable"):
        EndpointFlags(endpoint="http://127.0.0.1:9", api_key="sk-x ")


@pytest.mark.parametrize(("flags", "utilization", "tp"), [
    ([], 0.92, 1), (["--gpu-memory-utilization", "0.5", "-tp", "2"], 0.5, 2)])
def test_serve_simulate_sizes_its_pool_as_rt_simulate(
        monkeypatch: pytest.MonkeyPatch, flags: list[str], utilization: float, tp: int) -> None:
    """badinput23b: `rt serve --simulate --gpu-memory-utilization 0.5` sized the pool at
    0.92 (the flag was the real engine's), and it had no -tp though docs/serve.md says it
    takes `rt simulate`'s engine flags. The server is not started here."""
    from backends.serve import api_server

    started = []
    monkeypatch.setattr(api_server, "run_server", lambda config, sock, *_: (
        sock.close(), started.append(config)))
    with _deadline(60):
        result = CliRunner().invoke(cli.app, ["serve", "--simulate", "--port", "0", *flags])
    assert result.exit_code == 0, (result.exception, result.output)
    args = started[0].factory_kwargs["engine_args"]
    assert (args.gpu_memory_utilization, args.tensor_parallel_size) == (utilization, tp)


@pytest.mark.parametrize(("args", "line"), [
    (["--simulate", "--device", "cuda"], "--device 'cuda' is the real engine's: not with "
     "--simulate"),
    (["--gpu", "a100-80gb"], "--gpu 'a100-80gb' is the simulated engine's: it needs "
     "--simulate"),
    (["-tp", "2"], "--tensor-parallel-size 2 needs --simulate (the real engine runs on one "
     "device)")])
def test_serve_refuses_the_other_engines_flags(args: list[str], line: str) -> None:
    """badinput23b: each was ignored (the engine that ran takes no such flag)."""
    assert _one_line(["serve", "--port", "0", *args]) == f"rt: error: {line}"


@pytest.mark.parametrize(("args", "line"), [
    (["calibrate", "-o", "{o}", "--from-steps", "{run}", "--quick"],
     "--quick does not apply with --from-steps (no model runs here)"),
    (["calibrate", "-o", "{o}", "--from-steps", "{run}", "--time-limit", "5"],
     "--time-limit 5.0 does not apply with --from-steps (no model runs here)"),
    (["calibrate", "-o", "{o}", "--from-steps", "{run}", "--max-num-seqs", "8"],
     "--max-num-seqs 8 does not apply with --from-steps (no model runs here)"),
    (["calibrate", "-o", "{o}", "--from-steps", "{run}", "--device", "cuda"],
     "--device 'cuda' does not apply with --from-steps (no model runs here)"),
    (["fidelity", "{t}", "--fleet", "--device", "cuda", "--result-dir", "{o}"],
     "--device 'cuda' does not apply with --fleet (rt serve --simulate replicas)"),
    (["fidelity", "{t}", "--endpoint", "http://127.0.0.1:9", "--random-weights",
      "--result-dir", "{o}"],
     "--random-weights does not apply with --endpoint (the server runs the model)"),
    (["replay", "{t}", "--endpoint", "http://127.0.0.1:9", "--device", "cuda",
      "--result-dir", "{o}"],
     "--device 'cuda' does not apply with --endpoint (the server runs the model)"),
    (["replay", "{t}", "--endpoint", "http://127.0.0.1:9", "--max-num-seqs", "8",
      "--result-dir", "{o}"],
     "--max-num-seqs 8 does not apply with --endpoint (the server runs the model)"),
    (["replay", "{t}", "--endpoint", "http://127.0.0.1:9", "--check-invariants",
      "--result-dir", "{o}"],
     "--check-invariants does not apply with --endpoint (the server runs the model)")])
def test_a_flag_of_another_mode_is_refused_naming_both(
        files: dict[str, Path], tmp_path: Path, args: list[str], line: str) -> None:
    """badinput23b: each flag was ignored in that mode (the fit, the fleet's replicas or the
    server ran as if it were not given)."""
    out = tmp_path / "out"
    got = _one_line([a.format(o=out, run=files["run"], t=files["trace"]) for a in args])
    assert got == f"rt: error: {line}"
    assert not out.exists()


def test_no_output_replaces_the_commands_own_input(files: dict[str, Path],
                                                   tmp_path: Path) -> None:
    """badinput4: `rt trace convert T T --first-n 1` left T one request (exit 0); `rt trace
    gen -o T --dataset-name resample --dataset-path T` and `rt calibrate -o B --from-run B`
    would replace their input the same way. Refused first, the input untouched (a link to it
    too)."""
    trace = tmp_path / "t.jsonl"
    shutil.copy(files["trace"], trace)
    (tmp_path / "link.jsonl").symlink_to(trace)
    bench = tmp_path / "bench.json"
    bench.write_text("{}\n")
    for option, path, args in (
            ("DST", trace, ["trace", "convert", str(trace), str(trace), "--first-n", "1"]),
            ("DST", trace, ["trace", "convert", str(tmp_path / "link.jsonl"), str(trace)]),
            ("--output", trace, ["trace", "gen", "-o", str(trace), "--dataset-name",
                                 "resample", "--dataset-path", str(trace)]),
            ("--output", bench, ["calibrate", "-o", str(bench), "--from-run", str(bench)])):
        assert f"{option} {path}: it is the input " in _one_line(args)
    assert trace.read_bytes() == files["trace"].read_bytes()
    assert bench.read_text() == "{}\n"


def test_an_output_path_that_cannot_be_made_is_refused_before_the_work(
        files: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """badinput4: `rt simulate --result-dir TRACE/x` (a file where a directory must be),
    `--result-dir /proc/x` or `/sys/x`, `rt calibrate -o /sys/p.json` failed at the write,
    after vLLM's start-up lines, the run or the fit, as "TRACE: File exists" (3-9 lines);
    `rt sweep`'s and `rt report --html`'s the same. Now one line first."""
    t, run = str(files["trace"]), str(files["run"])
    for option, args in (
            ("result directory", ["simulate", "--trace", t, "--result-dir", f"{t}/x"]),
            ("--output", ["calibrate", "-o", f"{t}/p.json", "--from-steps", run]),
            ("result directory", ["sweep", "--trace", t, "--no-plots", "--result-dir",
                                  f"{t}/a/b"]),
            ("--html", ["report", run, "--no-plots", "--html", f"{t}/r.html"])):
        line = _one_line(args)
        assert line.startswith(f"rt: error: {option} {t}/"), line
        assert line.endswith(f": {t} is a file, not a directory (nothing was written)"), line
    from analysis import rundir

    def denied(**kwargs: object) -> None:  # what a read-only directory answers (not root)
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(rundir.tempfile, "TemporaryFile", denied)
    out = tmp_path / "new" / "run"
    assert _one_line(["simulate", "--trace", t, "--result-dir", str(out)]) == (
        f"rt: error: result directory {out}: cannot write in {tmp_path} (Permission denied; "
        "nothing was written)")
    assert not out.parent.exists()


def test_calibrate_refuses_a_simulated_run_and_fits_a_replay(files: dict[str, Path],
                                                             tmp_path: Path) -> None:
    """leftopen: `rt calibrate --from-steps`/`--from-run` took an `rt simulate` run (run.json
    kind "simulate") and fitted the cost model to its own step times, exit 0. Now one line
    naming the flag and the path, nothing written; the same steps as a replay's still fit."""
    run, out = files["run"], tmp_path / "p.json"
    circular = "a profile fitted to a cost model's own times is circular; give"
    for option, path, wanted in (
            ("--from-steps", run, "a real engine's replay (`rt replay`)"),
            ("--from-steps", run / "steps.parquet", "a real engine's replay (`rt replay`)"),
            ("--from-run", run, "a client-timed run (`rt replay --endpoint`, or a vLLM bench "
                                "file)")):
        assert _one_line(["calibrate", "-o", str(out), option, str(path)]) == (
            f"rt: error: {option} {path}: a simulated run (run.json kind 'simulate'): "
            f"{circular} {wanted}")
    replay = tmp_path / "replay"  # the same files, as a replay would have written them
    shutil.copytree(run, replay)
    _as_replay(replay)
    assert _one_line(["calibrate", "-o", str(out), "--from-steps", str(replay),
                      "--from-steps", str(run)]).startswith(f"rt: error: --from-steps {run}: ")
    assert not out.exists()
    result = CliRunner().invoke(cli.app, ["calibrate", "-o", str(out), "--from-steps",
                                          str(replay)])
    assert result.exit_code == 0, result.output
    fit = json.loads(out.read_text())["fit"]
    assert (fit["replay_steps"], fit["sources"]) == (16, [str(replay)])  # the run's 16 steps

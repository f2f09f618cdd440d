"""`rt fleet up`: N `rt serve` processes on loopback and `rt route` in front of them.

The replicas are subprocesses, each in its own session (process group: `rt serve` and its
engine process), told by the kernel to get SIGTERM should this process die
(`PR_SET_PDEATHSIG`, Linux). They start together; the router starts once every one answers
/health. On exit (SIGINT/SIGTERM stops the router, which drains) each replica gets SIGTERM
and drains too; a group still alive after `stop_timeout_s` is killed. So no process of the
fleet outlives the command, whatever ends it short of SIGKILL (and then the death signal).
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import os
import resource
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import httpx

from runtime.flags import FlagGroup, group_specs

_HOST = "127.0.0.1"
_PR_SET_PDEATHSIG = 1
# One `rt serve --simulate` replica on loopback: its server, its engine process and
# multiprocessing's resource tracker, 343 MB resident together (measured 2026-12-03 on the
# project VM, idle after start; a real model's replica holds its weights besides). The most
# replicas one machine can start is what its memory and its process limit hold of these.
REPLICA_PROCESSES = 3
REPLICA_RSS_BYTES = 350 * 2**20


def _die_with_parent() -> None:  # runs in the child between fork and exec
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def flag_argv(flags: Any, group: FlagGroup | None = None) -> list[str]:
    """The options that rebuild `flags` (a flag dataclass) where they differ from the
    defaults: the inverse of parsing, to pass a command's flags on to a subprocess."""
    argv: list[str] = []
    for spec in group_specs(type(flags), group or FlagGroup()):
        value = getattr(flags, spec.field)
        if value == spec.default or value is None:
            continue
        on, _, off = spec.decls[0].partition("/")
        if isinstance(value, bool):
            argv.append(on if value else off)
        elif isinstance(value, list):
            for item in value:
                argv += [on, str(item)]
        else:
            argv += [on, str(value)]
    return argv


class Replica:
    """One `rt serve` subprocess on a port of 127.0.0.1, in environment `env` (None: this
    process's); its output in a log file."""

    def __init__(self, command: Sequence[str], port: int, log_dir: Path,
                 env: Mapping[str, str] | None = None) -> None:
        self.port = port
        self.url = f"http://{_HOST}:{port}"
        self.log_path = log_dir / f"replica-{port}.log"
        with self.log_path.open("wb") as log:
            self.proc = subprocess.Popen(
                [*command, "--host", _HOST, "--port", str(port)], stdin=subprocess.DEVNULL,
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env,
                preexec_fn=_die_with_parent if sys.platform == "linux" else None)

    def log_tail(self, chars: int = 1500) -> str:
        return self.log_path.read_text(errors="replace")[-chars:]

    def healthy(self) -> bool:
        with contextlib.suppress(httpx.HTTPError):
            return httpx.get(f"{self.url}/health", timeout=1.0).status_code == 200
        return False


def wait_healthy(replicas: Sequence[Replica], timeout_s: float) -> None:
    """Until every replica answers /health; RuntimeError if one exits or time runs out."""
    pending = list(replicas)
    deadline = time.monotonic() + timeout_s
    while pending:
        for replica in list(pending):
            if replica.proc.poll() is not None:
                raise RuntimeError(f"replica {replica.url} exited ({replica.proc.returncode}):"
                                   f" {replica.log_tail().strip()}")
            if replica.healthy():
                pending.remove(replica)
        if pending and time.monotonic() > deadline:
            raise RuntimeError(f"{len(pending)} replicas did not answer /health within "
                               f"{timeout_s:g} s")
        if pending:
            time.sleep(0.2)


def stop_all(replicas: Sequence[Replica], timeout_s: float) -> None:
    """SIGTERM every replica (they drain), then SIGKILL the process group of any left."""
    for replica in replicas:
        if replica.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                replica.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    for replica in replicas:
        try:
            replica.proc.wait(max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            pass
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(replica.proc.pid, signal.SIGKILL)  # the engine process too
        with contextlib.suppress(subprocess.TimeoutExpired):
            replica.proc.wait(5)


@contextlib.contextmanager
def _signals_raise() -> Iterator[None]:
    """SIGTERM as KeyboardInterrupt while replicas start, so the cleanup runs."""
    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def check_loopback_replicas(replicas: int, memory_bytes: int | None = None,
                            nproc: int | None = -1) -> None:
    """ValueError (one line) when this machine cannot hold `replicas` loopback replicas: more
    than its physical memory (`memory_bytes`, default the machine's) at `REPLICA_RSS_BYTES`
    each, or than its per-user process limit (`nproc`, default RLIMIT_NPROC's soft limit;
    None: no limit) at `REPLICA_PROCESSES` each."""
    if memory_bytes is None:
        memory_bytes = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if nproc == -1:
        soft = resource.getrlimit(resource.RLIMIT_NPROC)[0]
        nproc = None if soft == resource.RLIM_INFINITY else soft
    most = memory_bytes // REPLICA_RSS_BYTES
    why = (f"{memory_bytes / 2**30:.1f} GiB of memory at ~{REPLICA_RSS_BYTES >> 20} MB per "
           "replica")
    if nproc is not None and nproc // REPLICA_PROCESSES < most:
        most = nproc // REPLICA_PROCESSES
        why = f"process limit {nproc} at {REPLICA_PROCESSES} processes per replica"
    if replicas > most:
        raise ValueError(f"--replicas {replicas}: this machine holds at most {most} loopback "
                         f"replicas ({why})")


@dataclasses.dataclass(frozen=True, slots=True)
class FleetPlan:
    """What `run_fleet` starts.

    Attributes:
        serve_command: `rt serve ...` without --host/--port (appended per replica).
        ports: one per replica, on 127.0.0.1.
        start_timeout_s, stop_timeout_s: bounds of the start and of the drain.
        env: the replicas' environment (None: this process's), e.g. with their API key
            as `VLLM_API_KEY`: a secret goes there, not on a command line, which any user of
            the machine can read.
    """

    serve_command: tuple[str, ...]
    ports: tuple[int, ...]
    start_timeout_s: float = 180.0
    stop_timeout_s: float = 20.0
    env: Mapping[str, str] | None = dataclasses.field(default=None, repr=False)

    @classmethod
    def of(cls, rt: Sequence[str], seed: int, flags: Sequence[tuple[Any, FlagGroup | None]],
           replicas: int, shutdown_timeout_s: float, env: Mapping[str, str] | None = None
           ) -> FleetPlan:
        """`rt serve --seed SEED` (`rt` the command line that starts rt) with each of `flags`
        passed on (`flag_argv`), on `replicas` free ports, in `env`; the drain bounded by
        the router's shutdown timeout plus 10 s. ValueError when this machine cannot hold
        `replicas` (`check_loopback_replicas`)."""
        from backends.bench.serve_load import free_port

        check_loopback_replicas(replicas)  # before any port or process
        command = [*rt, "serve", "--seed", str(seed), *(
            arg for values, group in flags for arg in flag_argv(values, group))]
        return cls(tuple(command), tuple(free_port() for _ in range(replicas)),
                   stop_timeout_s=shutdown_timeout_s + 10, env=env)


def run_fleet(plan: FleetPlan, serve_router: Callable[[list[str]], None],
              log: Callable[[str], None]) -> None:
    """Start the replicas, call `serve_router(backend URLs)` (it returns on SIGINT/SIGTERM),
    then stop the replicas. Raises RuntimeError if a replica does not come up."""
    replicas: list[Replica] = []
    with tempfile.TemporaryDirectory(prefix="rt-fleet-") as log_dir:
        try:
            with _signals_raise():
                for port in plan.ports:
                    replicas.append(Replica(plan.serve_command, port, Path(log_dir),
                                            plan.env))
                wait_healthy(replicas, plan.start_timeout_s)
            log(f"{len(replicas)} replicas up: {', '.join(r.url for r in replicas)}")
            serve_router([r.url for r in replicas])
        except KeyboardInterrupt:
            log("interrupted while starting")
        finally:
            stop_all(replicas, plan.stop_timeout_s)

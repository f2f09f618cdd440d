"""CPU accounting of the processes of a load test (`rt bench serve`): seconds each ran on a
CPU and waited, runnable, for one, read from Linux's /proc/PID/schedstat per process and
summed over its threads, and a process's threads' nice value."""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path


def spent(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """`after - before` of two `cpu_seconds` readings, rounded to ms. A thread that ends
    between them takes its seconds out of the threads' sum (it can even drop): a threads'
    figure is floored at the same process's main-thread figure, which it contains."""
    out = {k: round(v - before[k], 3) for k, v in after.items() if k in before}
    for key in out:
        main = key.replace("_threads", "", 1)
        if "_threads" in key and main in out:
            out[key] = max(out[key], out[main])
    return out


def renice(pid: int, nice: int) -> None:
    """Set every thread of process `pid` to `nice`. Linux keeps a nice value per thread
    and `setpriority(PRIO_PROCESS, pid)` sets only the thread whose id is `pid`; the
    engine's ZeroMQ I/O thread, which does its socket writes, is already running by then.
    RuntimeError naming --engine-nice when the OS refuses."""
    task_dir = f"/proc/{pid}/task"
    try:
        threads = [int(tid) for tid in os.listdir(task_dir)] if os.path.isdir(task_dir) \
            else [pid]
        for tid in threads:
            os.setpriority(os.PRIO_PROCESS, tid, nice)
    except OSError as err:
        raise RuntimeError(f"--engine-nice {nice}: {err.strerror} (a value below 0 needs "
                           "root or CAP_SYS_NICE)") from None


def cpu_seconds(pids: dict[str, int]) -> dict[str, float]:
    """Seconds each process (and this one, "client") ran on a CPU and waited, runnable,
    for one ("<name>_runqueue": the machine was busy) from Linux's /proc/PID/schedstat
    (main threads), the same summed over the threads alive when read ("<name>_threads",
    "<name>_threads_runqueue": ZeroMQ's I/O threads too), and the wall clock ("wall");
    empty where it cannot be read."""
    stats: dict[str, float] = {"wall": time.monotonic()}
    try:
        for name, pid in {**pids, "client": os.getpid()}.items():
            stats[name], stats[f"{name}_runqueue"] = _schedstat(f"/proc/{pid}/schedstat")
            threads = _thread_schedstats(pid)
            stats[f"{name}_threads"] = sum(ran for ran, _ in threads)
            stats[f"{name}_threads_runqueue"] = sum(waited for _, waited in threads)
    except OSError:
        return {}
    return stats


def _thread_schedstats(pid: int) -> list[tuple[float, float]]:
    """`_schedstat` of each thread of `pid` (one that ends as it is read is left out)."""
    stats = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(FileNotFoundError, ProcessLookupError):
            stats.append(_schedstat(f"/proc/{pid}/task/{tid}/schedstat"))
    return stats


def _schedstat(path: str) -> tuple[float, float]:
    """(seconds on a CPU, seconds runnable waiting for one) of a task's schedstat."""
    ran_ns, waited_ns, _ = Path(path).read_text().split()
    return int(ran_ns) / 1e9, int(waited_ns) / 1e9

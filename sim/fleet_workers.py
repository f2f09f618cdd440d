"""Worker processes for a pre-routed fleet (`rt simulate --sim-workers N`, `sim.fleet`); their
start, results and end are shared with the lockstep processes (`sim.fleet_lockstep`).

A pre-routed fleet (`sim.fleet._Fleet.pre_routed`: no router reads the replicas, their
completions or token ids) is routed whole before any step, then each replica runs its share
to the end, one after another, nothing passing between them. So its replicas can run in
parallel: the parent routes the trace, forks the workers (each inherits the routed fleet:
nothing is pickled on the way in), each runs a contiguous range of replicas as the
sequential run does, and sends back what the records need through a pipe, pickled as it is
written and unpickled as it is read (no copy of the whole ~44 MB message on either side: 40
MiB less peak RSS in the parent and in each worker on the Azure excerpt x16); the parent
joins them in replica order (`sim.fleet._Fleet.run_in_workers`).

    worker_ranges   contiguous ranges of replicas, balanced by their shares' request counts
    run_forked      each task in a forked child; results in task order, errors re-raised
    start_child, collect_results, end_children
                    one child forked, the children's results (or first error), their end

A worker's exception reaches the parent as the same exception (type and message, the
worker's traceback as a note; one that would not pickle: a RuntimeError naming its type); a
worker that dies without answering (killed by a signal, out of memory; or a result that
fails to pickle midway, a bug: its traceback on the worker's stderr) is a one-line
ChildProcessError naming it; no worker outlives the call (Ctrl-C included: workers ignore
SIGINT and the parent terminates them), nor its parent: a worker holds no pipe but its own
writer (so a dead parent reads as EPIPE), and on Linux the kernel kills it when the parent
dies (SIGTERM, SIGKILL, a closed terminal; `PR_SET_PDEATHSIG`).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import multiprocessing
import os
import pickle
import signal
import sys
import traceback
from bisect import bisect_left
from collections.abc import Callable, Iterator, Sequence
from io import BufferedReader
from itertools import accumulate
from multiprocessing.connection import wait
from typing import Any, TypeVar

T = TypeVar("T")
# A forked child and the read end of its result pipe (`start_child`).
Child = tuple[multiprocessing.process.BaseProcess, BufferedReader]


def can_fork() -> bool:
    """Whether this platform starts processes by fork (not on Windows; macOS has it)."""
    return "fork" in multiprocessing.get_all_start_methods()


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity mask, where the platform has one; a
    container's or `taskset`'s limit), not the host's count."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def worker_ranges(sizes: Sequence[int], workers: int) -> list[range]:
    """Replicas 0..len(sizes)-1 cut into min(workers, replicas) contiguous, non-empty ranges,
    each cut where the requests before it (`sizes[i]`: replica i's) come closest to their
    share of the total (replicas' own counts when there are no requests)."""
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    n = len(sizes)
    count = min(workers, n)
    if sum(sizes) == 0:
        sizes = [1] * n
    prefix = list(accumulate(sizes, initial=0))  # prefix[i]: requests of replicas < i
    cuts = [0]
    for w in range(1, count):
        lo, hi = cuts[-1] + 1, n - (count - w)  # every range keeps at least one replica
        target = prefix[n] * w / count
        i = min(max(bisect_left(prefix, target, lo, hi + 1), lo), hi)
        if i > lo and target - prefix[i - 1] <= prefix[i] - target:
            i -= 1  # the cut before it is as close or closer
        cuts.append(i)
    cuts.append(n)
    return [range(a, b) for a, b in zip(cuts, cuts[1:], strict=False) if b > a]


def run_forked(tasks: Sequence[Callable[[], T]],
               on_result: Callable[[int, T], None] | None = None,
               names: Sequence[str] | None = None) -> list[T]:
    """`[task() for task in tasks]`, each task in a child forked for it (at once: they run
    in parallel); `on_result(i, result)` as each arrives. The first failure (in arrival
    order) is raised, after every child has been ended; a child that died is named by
    `names[i]` (default: "worker i")."""
    context = multiprocessing.get_context("fork")
    children: list[Child] = []
    answered = False
    try:
        parent = os.getpid()
        with enough_descriptors(len(tasks)):
            for task in tasks:
                children.append(start_child(context, task, children, parent))
        results = collect_results(children, on_result,
                                  names or [f"worker {i}" for i in range(len(children))])
        answered = True
        return results
    finally:
        end_children(children, answered)


def start_child(context: multiprocessing.context.ForkContext, task: Callable[[], Any],
                children: Sequence[Child],
                parent: int) -> Child:
    """Fork a child that runs `task` (`child_task`) beside the `children` started before it;
    the child and the read end of its result pipe. A failure to start leaves no pipe open."""
    reader, writer = os.pipe()
    try:
        inherited = [reader, *(receive.fileno() for _, receive in children)]
        child = context.Process(target=child_task, args=(task, writer, inherited, parent),
                                daemon=True)
        child.start()
    except BaseException:
        os.close(reader)
        raise
    finally:
        os.close(writer)  # the child holds the only writer: its death reads as EOF
    return child, open(reader, "rb")


@contextlib.contextmanager
def enough_descriptors(processes: int) -> Iterator[None]:
    """Starting `processes` processes: running out of file descriptors is a one-line
    ValueError naming the count and the limit. The parent holds 3 per child (its result
    pipe's reader, multiprocessing's 2), in lockstep 2 more (`sim.fleet_lockstep.Peers`: 4
    until every child has started): 1,024 ran out at ~145 lockstep processes."""
    try:
        yield
    except OSError as error:
        if error.errno not in (errno.EMFILE, errno.ENFILE):
            raise
        import resource  # Unix only, as fork: not imported where the fleet runs in one process

        limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        raise ValueError(f"workers {processes}: out of file descriptors starting the "
                         f"simulation processes (this process may open {limit}: ulimit -n); "
                         f"use fewer workers or raise the limit") from None


def end_children(children: Sequence[Child],
                 answered: bool) -> None:
    """Every child answered and exits by itself (`answered`), or is ended here; each is
    waited for and its pipes closed, its `Process` too (its own two pipe ends would stay open
    while anything held it: a traceback through the caller's frame)."""
    for child, receive in children:
        if not answered and child.exitcode is None:
            child.terminate()
        child.join()
        child.close()
        receive.close()


def collect_results(children: Sequence[Child],
                    on_result: Callable[[int, Any], None] | None, names: Sequence[str]
                    ) -> list[Any]:
    """Each child's result, in child order, received as they arrive."""
    results: list[Any] = [None] * len(children)
    # waited on by file descriptor (what `wait` is typed for; on Unix it selects on them)
    index = {receive.fileno(): i for i, (_, receive) in enumerate(children)}
    waiting = list(index)
    while waiting:
        for fd in wait(waiting):
            assert isinstance(fd, int)
            i = index[fd]
            waiting.remove(fd)
            results[i] = _received(names[i], *children[i])
            if on_result is not None:
                on_result(i, results[i])
    return results


def _received(name: str, child: multiprocessing.process.BaseProcess, receive: BufferedReader
              ) -> Any:
    """The child's result, or its error raised here (`name`: the child's, for the user).
    Unpickled as it streams in: no copy of the whole message is held."""
    try:
        ok, value = pickle.load(receive)
    except (EOFError, pickle.UnpicklingError):  # no whole answer: it died
        child.join()
        code = child.exitcode
        how = (f"was killed by {signal.Signals(-code).name}" if code is not None and code < 0
               else f"exited with status {code}")
        raise ChildProcessError(f"simulation {name} {how} before sending its records"
                                ) from None
    if not ok:
        raise value
    return value


def child_task(task: Callable[[], Any], writer: int, inherited: Sequence[int], parent: int
               ) -> None:
    """In the child: run `task`, send (True, its result) or (False, its error), pickled as
    it is written (no copy of the whole message). A result that fails to pickle midway is a
    bug: the child exits with its traceback on stderr, the parent reads a broken stream.
    `inherited`: the read ends it was forked with (its own, its elder siblings'), closed so
    that only the parent reads; `parent`: the parent's pid, whose death ends the child."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C: the parent ends its children
    for fd in inherited:
        with contextlib.suppress(OSError):
            os.close(fd)
    _die_with(parent)
    try:
        outcome: tuple[bool, Any] = (True, task())
    except BaseException as error:  # every failure goes to the parent
        outcome = (False, _portable(error))
    with open(writer, "wb") as out:
        pickle.dump(outcome, out, protocol=pickle.HIGHEST_PROTOCOL)


def _die_with(parent: int) -> None:
    """On Linux, have the kernel SIGKILL this process when `parent` (the process that
    forked it) dies; exit at once if it already has. Elsewhere a dead parent is seen only
    when the result is written (EPIPE)."""
    if not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # it died before the request took effect
        os._exit(1)


_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def _portable(error: BaseException) -> BaseException:
    """`error`, with its traceback text as a note, if it survives pickling as itself; else a
    RuntimeError naming its type and message."""
    text = "".join(traceback.format_exception(error)).rstrip()
    try:
        copy = pickle.loads(pickle.dumps(error))
        portable = copy if type(copy) is type(error) and str(copy) == str(error) else None
    except Exception:  # any failure to pickle or rebuild it
        portable = None
    if portable is None:
        portable = RuntimeError(f"{type(error).__name__}: {error}")
    portable.add_note(f"in a simulation worker:\n{text}")
    return portable

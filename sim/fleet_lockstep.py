"""Processes in lockstep for a fleet behind routers that read completions (`rt simulate
--sim-workers N` behind least-outstanding, power-of-two, sglang-cache-aware; `sim.fleet`).

Such a router reads its own dispatches and the finishes the replicas report, never a
snapshot's metrics or a KV event (`_Fleet.sleeps_through_runs`). The replicas are cut into W
contiguous groups: the parent runs the router and group 0, a forked child each other group.
At each routing decision the processes meet: each child sends the parent the finishes its
replicas reported since the last decision, as trace indices (`Peers.ask`), the parent's
policies hear them (`Peers.gather`), the parent routes and tells every child the replica it
chose (`Peers.announce`), and the child whose group holds it builds the request. Lockstep
is not taken unless every policy hears completions only as `RouterPolicy`'s own in-flight
counts (`hears_counts_only`): counts added in another order are the same counts, so hearing
a child's finishes at the next decision rather than at their step's end changes no choice.
Each process's events are the serial run's events of its own replicas and the router's
arrivals, in the same order, so the records are those of one process.

    Peers        the pipes between the parent and its children: one frame up and one down per
                 decision
    run_lockstep the groups' tasks: the first in this process, the others forked; results in
                 group order; the first failure raised, no child left behind

A frame is a count (4 bytes, little-endian) then that many signed 64-bit codes. A peer gone
(a child that failed: its error comes back through `sim.fleet_workers`' result pipe; a
parent gone: the child's read sees EOF) ends the exchange with `PeerGone`.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import select
import struct
from array import array
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from runtime.router import RouterPolicy
from sim.fleet_workers import (
    Child,
    collect_results,
    end_children,
    enough_descriptors,
    start_child,
)

T = TypeVar("T")

_HEADER = struct.Struct("<I")  # codes in the frame
# Polls of a read end before blocking (~0.4 us each), adapted per process (`_Polls`): up
# to ~2 ms while the peer comes within them, down to ~13 us while it does not (CPUs taken).
_MAX_POLLS = 5_000
_MIN_POLLS = 32


class PeerGone(EOFError):
    """The other end of a lockstep pipe closed: its process ended (failed or killed)."""


def hears_counts_only(policy: RouterPolicy) -> bool:
    """Whether `policy` hears completions only as its in-flight counts (`RouterPolicy`'s own
    `on_finished` and a `on_prefill_done` that does nothing): the precondition of lockstep."""
    kind = type(policy)
    return (kind.on_finished is RouterPolicy.on_finished
            and kind.on_prefill_done is RouterPolicy.on_prefill_done)


class Peers:
    """The lockstep pipes of W processes: process 0 (the parent) talks to each child i, the
    children to it only. Made before the fork; each process then keeps its own ends
    (`keep`)."""

    def __init__(self, workers: int) -> None:
        if workers < 2:
            raise ValueError(f"lockstep needs at least 2 processes, got {workers}")
        self.workers = workers
        self.index = 0  # this process's group (0: the parent)
        # the ends open in this process, each closed once: a number closed twice may name
        # another file by then (the lowest free number is reused by the next open)
        self.held: set[int] = set()
        # [i]: child i's pipes, i >= 1 (index 0 unused): up = child -> parent, down = back
        self.up: list[tuple[int, int]] = [(-1, -1)]
        self.down: list[tuple[int, int]] = [(-1, -1)]
        try:
            for _ in range(1, workers):
                self.up.append(self._pipe())
                self.down.append(self._pipe())
        except BaseException:  # out of descriptors midway: none of them left open
            self.close()
            raise

    def _pipe(self) -> tuple[int, int]:
        ends = os.pipe()
        self.held.update(ends)
        return ends

    def fds(self) -> list[int]:
        """Every end of every pipe, open here or not."""
        return [fd for pair in (*self.up[1:], *self.down[1:]) for fd in pair]

    def keep(self, index: int) -> None:
        """In process `index`, close every end but its own (so a peer's death reads as EOF)."""
        self.index = index
        reads = ({self.up[i][0] for i in range(1, self.workers)} if index == 0
                 else {self.down[index][0]})
        writes = ({self.down[i][1] for i in range(1, self.workers)} if index == 0
                  else {self.up[index][1]})
        for fd in self.fds():
            if fd in reads:
                os.set_blocking(fd, False)  # polled before it blocks (`_Polls`)
            elif fd not in writes:
                self._close(fd)

    def close(self) -> None:
        """Close the ends still open here (`keep` closed the others); again: nothing."""
        for fd in sorted(self.held):
            self._close(fd)

    def _close(self, fd: int) -> None:
        self.held.discard(fd)
        with contextlib.suppress(OSError):
            os.close(fd)

    def ask(self, mine: array[int]) -> int:
        """In a child: send the codes since the last decision, and wait for the parent's
        word on this one (`announce`)."""
        _send(self.up[self.index][1], mine)
        (word,) = _receive(self.down[self.index][0])
        return word

    def gather(self) -> array[int]:
        """In the parent: every child's codes for this decision (each child's `ask`), in
        group order."""
        codes = array("q")
        for i in range(1, self.workers):
            codes += _receive(self.up[i][0])
        return codes

    def announce(self, word: int) -> None:
        """In the parent: tell every child `word` (each is waiting in `ask`)."""
        frame = array("q", [word])
        for i in range(1, self.workers):
            _send(self.down[i][1], frame)


def _send(fd: int, codes: array[int]) -> None:
    data = memoryview(_HEADER.pack(len(codes)) + codes.tobytes())
    try:
        while data:
            data = data[os.write(fd, data):]
    except BrokenPipeError:
        raise PeerGone("a lockstep peer ended") from None


def _receive(fd: int) -> array[int]:
    (count,) = _HEADER.unpack(_POLLS.read(fd, _HEADER.size))
    codes = array("q")
    if count:
        codes.frombytes(_POLLS.read(fd, count * codes.itemsize))
    return codes


class _Polls:
    """Reads of non-blocking pipe ends, polled before they block in `poll` (not `select`: it
    refuses descriptors numbered 1,024 and up, which a parent of ~145 processes has). Polling keeps
    a waiting process on its CPU: one that sleeps in `read` at each decision is woken on the
    CPU of the process that wrote (the kernel's wake-up affinity), so two ran on one CPU,
    ~500 us a decision here. But a process polling while its peer waits for a CPU (more
    processes than free CPUs) burns the time the peer needs: the number of polls halves
    (down to `_MIN_POLLS`) each time they run out, and doubles (up to `_MAX_POLLS`) each
    time the data comes within them. 16 least-outstanding replicas in 2 processes beside
    two other busy programs on this 2-CPU machine: 23 s with a fixed 5,000 polls."""

    def __init__(self) -> None:
        self.limit = _MAX_POLLS

    def read(self, fd: int, size: int) -> bytes:
        """`size` bytes from `fd`; PeerGone at EOF."""
        chunks = []
        polls = 0
        while size:
            try:
                chunk = os.read(fd, size)
            except BlockingIOError:
                polls += 1
                if polls == self.limit:
                    self.limit = max(_MIN_POLLS, self.limit // 2)
                if polls >= self.limit:
                    _wait_readable(fd)
                continue
            if not chunk:
                raise PeerGone("a lockstep peer ended")
            chunks.append(chunk)
            size -= len(chunk)
        if 0 < polls < self.limit:
            self.limit = min(_MAX_POLLS, self.limit * 2)
        return b"".join(chunks)


_POLLS = _Polls()  # this process's (a forked child starts from the parent's, then adapts)


def _wait_readable(fd: int) -> None:
    """Block until `fd` has bytes to read or its writers are gone (EOF)."""
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    poller.poll()


def run_lockstep(tasks: Sequence[Callable[[Peers], T]],
                 on_result: Callable[[int, T], None] | None = None,
                 names: Sequence[str] | None = None) -> list[T]:
    """`[task(peers) for task in tasks]`, task 0 in this process and each other one in a
    child forked for it, all at once, meeting through `peers` (`Peers.ask`, `gather`,
    `announce`).
    `on_result(i, result)` as each child's result arrives (task 0's: when it returns). A
    failure anywhere is raised here (a child's as itself, `sim.fleet_workers`), after every
    child has ended."""
    context = multiprocessing.get_context("fork")
    children: list[Child] = []
    names = names or [f"worker {i}" for i in range(len(tasks))]
    answered = False
    peers: Peers | None = None
    try:
        parent = os.getpid()
        with enough_descriptors(len(tasks)):
            peers = Peers(len(tasks))
            for i, task in enumerate(tasks[1:], start=1):
                children.append(start_child(context, _in_group(task, peers, i), children,
                                            parent))
        peers.keep(0)
        try:
            first = tasks[0](peers)
        except PeerGone:  # a child failed: its own error says why
            collect_results(children, None, names[1:])
            raise
        if on_result is not None:
            on_result(0, first)
        results = [first, *collect_results(children, on_result and _shifted(on_result),
                                           names[1:])]
        answered = True
        return results
    finally:
        if peers is not None:
            peers.close()  # a child still waiting on the parent reads EOF
        end_children(children, answered)


def _in_group(task: Callable[[Peers], T], peers: Peers, index: int) -> Callable[[], T]:
    def run() -> T:
        peers.keep(index)
        return task(peers)
    return run


def _shifted(on_result: Callable[[int, Any], None]) -> Callable[[int, Any], None]:
    return lambda i, result: on_result(i + 1, result)


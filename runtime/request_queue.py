"""The waiting queue: FCFS (a deque) or priority (a heap on priority, arrival, add order)."""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Iterator
from typing import Protocol

from runtime.request import Request


class RequestQueue(Protocol):
    def add(self, request: Request) -> None:
        """Enqueue a new request."""

    def prepend(self, request: Request) -> None:
        """Requeue a preempted request (front under FCFS; by key under priority)."""

    def peek(self) -> Request: ...

    def pop(self) -> Request: ...

    def remove(self, request: Request) -> None: ...

    def __len__(self) -> int: ...

    def __iter__(self) -> Iterator[Request]:
        """Requests in the order they would be admitted."""
        ...

    def __getitem__(self, index: int) -> Request: ...


class FCFSQueue:
    def __init__(self) -> None:
        self._queue: deque[Request] = deque()

    def add(self, request: Request) -> None:
        self._queue.append(request)

    def prepend(self, request: Request) -> None:
        self._queue.appendleft(request)

    def peek(self) -> Request:
        return self._queue[0]

    def pop(self) -> Request:
        return self._queue.popleft()

    def remove(self, request: Request) -> None:
        self._queue.remove(request)

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)

    def __getitem__(self, index: int) -> Request:
        return self._queue[index]


class PriorityQueue:
    """Lower `priority` first, then earlier `arrival_time` (vLLM's order), then the earlier
    added (`Request.arrival_order`: vLLM's server stamps arrivals as it receives them, so
    its times never tie; vLLM's scheduler would compare request ids next). A preempted
    request is not favoured: it re-enters at its original key."""

    def __init__(self) -> None:
        self._heap: list[tuple[int, float, int, Request]] = []

    def add(self, request: Request) -> None:
        key = (request.priority, request.arrival_time, request.arrival_order, request)
        heapq.heappush(self._heap, key)

    def prepend(self, request: Request) -> None:
        self.add(request)

    def peek(self) -> Request:
        return self._heap[0][3]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[3]

    def remove(self, request: Request) -> None:
        self._heap = [entry for entry in self._heap if entry[3] is not request]
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._sorted())

    def __getitem__(self, index: int) -> Request:
        return self._sorted()[index]

    def _sorted(self) -> list[Request]:
        return [entry[3] for entry in sorted(self._heap, key=lambda e: e[:3])]


def make_request_queue(policy: str) -> RequestQueue:
    return PriorityQueue() if policy == "priority" else FCFSQueue()

"""What a router can know, and when (BLIS's three tiers, fleet.md §2c "signal staleness").

1. Router-local state: the requests this router dispatched and has not seen finish, and
   its own prefix index. Always fresh: the router updates it itself (`RouterLocal`).
2. Replica metrics (waiting, running, KV usage): scraped every `refresh_s` seconds
   (`MetricsRefresh`; 0.05 s is llm-d's `RefreshMetricsInterval`, 0.1 s vLLM's DP
   coordinator; 0 = oracle, fresh at every decision).
3. Precise prefix state: the engines' KV events (blocks stored / removed) reach the router
   `delay_s` after they happen (`KvEventQueue`; BLIS's `--cache-signal-delay`, 50 ms).

Nothing here reads a clock: the driver passes `now_s` (seconds) in and decides when to call.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from runtime.block_hash import BlockHash
from runtime.router.snapshot import ReplicaSnapshot, RoutingRequest


class MetricsRefresh:
    """The scrape schedule of replica metrics: ticks at phase_s + k * refresh_s.

    A driver asks `due(now_s)` before routing; when True it reads every replica's metrics
    as of `last_tick(now_s)`, passes them to `store`, and the policy then sees `snapshots`.
    With `refresh_s == 0` every decision is due (oracle). `phase_s` in [0, refresh_s)
    offsets the ticks (router replicas scrape on tickers of their own).
    """

    def __init__(self, refresh_s: float, phase_s: float = 0.0) -> None:
        if not (refresh_s >= 0.0 and math.isfinite(refresh_s)):
            raise ValueError(f"refresh_s must be a finite number >= 0, got {refresh_s}")
        if not (phase_s == 0.0 or 0.0 < phase_s < refresh_s):
            raise ValueError(f"phase_s must be in [0, refresh_s={refresh_s}), got {phase_s}")
        self.refresh_s = refresh_s
        self.phase_s = phase_s
        self.next_due_s = 0.0  # the first decision always scrapes
        self._snapshots: tuple[ReplicaSnapshot, ...] = ()

    def due(self, now_s: float) -> bool:
        return self.refresh_s == 0.0 or not self._snapshots or now_s >= self.next_due_s

    def last_tick(self, now_s: float) -> float:
        """The latest tick at or before `now_s` (`now_s` itself for an oracle; negative
        before the first tick: nothing has happened yet then)."""
        if self.refresh_s == 0.0:
            return now_s
        ticks = math.floor((now_s - self.phase_s) / self.refresh_s)
        return min(now_s, ticks * self.refresh_s + self.phase_s)

    def store(self, snapshots: Sequence[ReplicaSnapshot], now_s: float) -> None:
        """Keep `snapshots` (taken at `now_s`) until the next tick after `now_s`."""
        self._snapshots = tuple(snapshots)
        if self.refresh_s > 0.0:
            ticks = math.floor((now_s - self.phase_s) / self.refresh_s) + 1
            self.next_due_s = ticks * self.refresh_s + self.phase_s

    @property
    def snapshots(self) -> tuple[ReplicaSnapshot, ...]:
        return self._snapshots


KvEventKind = Literal["stored", "removed", "cleared"]


@dataclass(frozen=True, slots=True)
class KvEvent:
    """One engine KV-cache event (vLLM's BlockStored / BlockRemoved / AllBlocksCleared).

    Attributes:
        replica_id: the engine that emitted it.
        kind: "stored" (blocks became cached), "removed" (evicted), "cleared" (all gone).
        block_hashes: the blocks concerned, by the engine's chained hash; empty for "cleared".
        emitted_at_s: when the engine emitted it, seconds.
    """

    replica_id: int
    kind: KvEventKind
    block_hashes: tuple[BlockHash, ...]
    emitted_at_s: float


class KvEventQueue:
    """KV events in flight to the router: each is visible `delay_s` after its emission.

    Engines `publish` their events in emission order (each engine on its own: a simulator
    may run one replica ahead of another); the driver `drain`s at each decision and hands
    the result to `RouterPolicy.on_kv_events`. Events leave in emission order, an engine's
    events of one instant in publication order.
    """

    def __init__(self, delay_s: float) -> None:
        if not (delay_s >= 0.0 and math.isfinite(delay_s)):
            raise ValueError(f"kv_event_delay_s must be a finite number >= 0, got {delay_s}")
        self.delay_s = delay_s
        self._heap: list[tuple[float, int, KvEvent]] = []  # (emitted_at_s, serial, event)
        self._last: dict[int, float] = {}  # replica -> its last emission time, seconds
        self._serial = 0

    def publish(self, event: KvEvent) -> None:
        last = self._last.get(event.replica_id, -math.inf)
        if event.emitted_at_s < last:
            raise ValueError(
                f"replica {event.replica_id}'s KV events must be published in time order: "
                f"{event.emitted_at_s} after {last}")
        self._last[event.replica_id] = event.emitted_at_s
        self._serial += 1
        heapq.heappush(self._heap, (event.emitted_at_s, self._serial, event))

    def drain(self, now_s: float) -> list[KvEvent]:
        """The events due by `now_s` (emitted at or before `now_s - delay_s`), oldest first."""
        due: list[KvEvent] = []
        heap = self._heap
        while heap and heap[0][0] + self.delay_s <= now_s:
            due.append(heapq.heappop(heap)[2])
        return due

    def __len__(self) -> int:
        return len(self._heap)


@dataclass(slots=True)
class _InFlight:
    replica: int
    prompt_len: int


@dataclass(slots=True)
class RouterLocal:
    """This router's own view: requests it dispatched and has not seen finish.

    Invariant: `count[r]` and `tokens[r]` are the number and total prompt tokens of the
    entries of `in_flight` on replica r; `routed_at[r]` holds the dispatch times (seconds,
    nondecreasing) of requests sent to r within the last `qps` window asked for.
    """

    in_flight: dict[str, _InFlight] = field(default_factory=dict)
    count: dict[int, int] = field(default_factory=dict)
    tokens: dict[int, int] = field(default_factory=dict)
    routed_at: dict[int, deque[float]] = field(default_factory=dict)

    def add(self, request: RoutingRequest, replica: int) -> None:
        if request.request_id in self.in_flight:
            raise ValueError(f"request {request.request_id!r} was already routed")
        self.in_flight[request.request_id] = _InFlight(replica, request.prompt_len)
        self.count[replica] = self.count.get(replica, 0) + 1
        self.tokens[replica] = self.tokens.get(replica, 0) + request.prompt_len
        self.routed_at.setdefault(replica, deque()).append(request.now_s)

    def finish(self, request_id: str) -> int | None:
        """Forget a finished request; returns its replica (None if unknown here)."""
        entry = self.in_flight.pop(request_id, None)
        if entry is None:
            return None
        self.count[entry.replica] -= 1
        self.tokens[entry.replica] -= entry.prompt_len
        return entry.replica

    def replica_of(self, request_id: str) -> int | None:
        entry = self.in_flight.get(request_id)
        return None if entry is None else entry.replica

    def qps(self, replica: int, now_s: float, window_s: float) -> float:
        """Requests per second this router sent to `replica` over [now_s - window_s, now_s]
        (production-stack's sliding window drops timestamps < now - window)."""
        times = self.routed_at.get(replica)
        if not times:
            return 0.0
        while times and times[0] < now_s - window_s:
            times.popleft()
        return len(times) / window_s

"""The simulated API server's timing (one FIFO server in front of one engine, costed by
`sim.cost.api_server.ApiServerCost`): when it hands each request over, when a process sleeping
between those hand-overs would wake, and when a step's tokens reach their clients. Seconds."""

from __future__ import annotations

from array import array
from collections import Counter
from collections.abc import Sequence

from runtime.records import RequestRecord
from sim.cost.api_server import ApiServerCost
from workloads import Trace


def handover_times(trace: Trace, cost: ApiServerCost) -> list[float]:
    """When the single FIFO API server hands each request over: Lindley's recursion,
    h_i = max(h_{i-1}, arrival_i) + cost_i (known in advance, so the server is no process)."""
    times, free_at = [], 0.0
    for req in trace:
        free_at = max(free_at, req.arrival_s) + cost.time(req.prompt_len)
        times.append(free_at)
    return times


def server_wakes(handovers: Sequence[float]) -> list[float]:
    """The event-loop times at which an API-server process sleeping from hand-over to
    hand-over (`timeout(h - now)` from its last wake, none when h is not ahead) would hand
    each request over: its hand-over time up to the rounding of now + (h - now). The
    engine's clock when such a hand-over wakes it, and the step boundary by which the
    request enters (the first at or after it)."""
    wakes, now = [], 0.0
    for handover in handovers:
        now = server_wake(now, handover)
        wakes.append(now)
    return wakes


def server_wake(last_s: float, handover_s: float) -> float:
    """When a server process that last woke at `last_s` wakes for a hand-over at `handover_s`
    (`server_wakes`, one step of it): `last_s + (handover_s - last_s)` when the hand-over is
    ahead (a sleep's float rounding: it may differ from `handover_s` in the last bit), else
    at once, `last_s`."""
    return last_s + (handover_s - last_s) if handover_s > last_s else last_s


def deliver_to_clients(records: Sequence[RequestRecord], api_server: ApiServerCost) -> None:
    """Shift every token time (and first_token_s, finish_s) from its step's end to when the
    front end has delivered that step's tokens: + `api_server.delivery_delay(n)`, n = the
    tokens sampled at that step end (all of a step's tokens share its end float). Nothing
    changes when the output cost is 0."""
    if api_server.per_output_token_s <= 0:
        return
    per_step = Counter(t for record in records for t in record.token_times_s)
    for record in records:
        times = [t + api_server.delivery_delay(per_step[t]) for t in record.token_times_s]
        record.token_times_s = array("d", times)
        if times:
            record.first_token_s = times[0]
            if record.finish_s is not None:
                record.finish_s = max(record.finish_s, times[-1])

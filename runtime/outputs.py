"""Boundary objects between the scheduler and its drivers (executor, simulator, metrics)."""

from __future__ import annotations

import enum
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import overload

from runtime.free_block_queue import KVCacheBlock


class WaitReason(enum.Enum):
    """Why the head of the waiting queue was not admitted in a step.

    Requests behind the head wait for the same reason: admission never skips past the head.
    """

    TOKEN_BUDGET = "token_budget"  # the step's token budget was spent (or, with chunked
    #                                prefill off, the head's prompt does not fit in what is left)
    MAX_NUM_SEQS = "max_num_seqs"  # max_num_seqs requests are already running
    KV_CAPACITY = "kv_capacity"  # the head's blocks do not fit in the free KV blocks
    PREEMPTED_THIS_STEP = "preempted_this_step"  # a preemption in this step skips admission


class ReqIdList(list[str]):
    """Request ids in event order. vLLM exposes these fields as sets, so a ReqIdList also
    compares equal to a set (or frozenset) holding the same ids."""

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (set, frozenset)):
            return len(self) == len(other) and set(self) == other
        return list.__eq__(self, other)

    def __ne__(self, other: object) -> bool:
        return not self.__eq__(other)

    __hash__ = None


class BlockIds(Sequence[int]):
    """The ids of `blocks[:stop]` (a block table, or the blocks a step added to one), made
    only when read: a real executor reads them once per step, the simulator never (making
    them was ~4% of a long-prompt run). Valid as long as `blocks` is only appended to,
    as a block table is while held (a freed table is dropped, never cleared), and its
    blocks stay this pool's (a released pool's blocks, reset, keep their ids in the next
    pool: `BlockPool.release_blocks`, `reuse`). Compares equal to a list or tuple of the same
    ids; pickles as the list of ids (not the blocks, which link the free queue)."""

    __slots__ = ("_blocks", "_stop")

    def __init__(self, blocks: list[KVCacheBlock], stop: int | None = None) -> None:
        self._blocks = blocks
        self._stop = len(blocks) if stop is None else stop

    def ids(self) -> list[int]:
        """The ids, as a new list."""
        return [block.block_id for block in self._blocks[: self._stop]]

    def __len__(self) -> int:
        return self._stop

    @overload
    def __getitem__(self, index: int) -> int: ...

    @overload
    def __getitem__(self, index: slice) -> list[int]: ...

    def __getitem__(self, index: int | slice) -> int | list[int]:
        if isinstance(index, slice):
            return self.ids()[index]
        return self._blocks[range(self._stop)[index]].block_id  # IndexError as a list's

    def __iter__(self) -> Iterator[int]:
        return iter(self.ids())

    def __reversed__(self) -> Iterator[int]:
        return reversed(self.ids())

    def __reduce__(self) -> tuple[type[list[int]], tuple[list[int]]]:
        return list, (self.ids(),)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (BlockIds, list, tuple)):
            return self.ids() == list(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # mutable contents: unhashable, as a list

    def __repr__(self) -> str:
        return repr(self.ids())


@dataclass(frozen=True, slots=True)
class NewRequestData:
    """A request admitted this step (new, or resumed after preemption): the executor gets its
    whole block table (a `BlockIds` from the scheduler). `num_computed_tokens` is the
    prefix-cache hit, in tokens. A resumed request recomputes prompt and earlier outputs:
    `prefill_token_ids` holds them all."""

    req_id: str
    prompt_token_ids: Sequence[int]
    block_ids: Sequence[int]
    num_computed_tokens: int
    prefill_token_ids: Sequence[int] | None = None


@dataclass(slots=True)
class CachedRequestData:
    """Running requests scheduled again this step, as parallel lists.

    `new_block_ids[i]` extends the executor's block table of `req_ids[i]` (empty, or a
    `BlockIds` from the scheduler); `num_computed_tokens[i]` is the value before this
    step's tokens.
    """

    req_ids: list[str] = field(default_factory=list)
    new_block_ids: list[Sequence[int]] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)


@dataclass(slots=True)
class SchedulerOutput:
    """What one `schedule()` decided.

    Attributes:
        num_scheduled_tokens: tokens per request this step; running requests first (in
            admission order), then the newly admitted ones.
        total_num_scheduled_tokens: their sum, at most `max_num_batched_tokens`.
        scheduled_new_reqs: admitted this step: new requests, then resumed ones (each group
            in admission order, as vLLM's V2 model runner lists them).
        scheduled_resumed_req_ids: the admitted requests that were PREEMPTED before.
        scheduled_cached_reqs: running requests scheduled again.
        preempted_req_ids: preempted in this step (their blocks are already freed).
        finished_req_ids: finished (stopped, aborted, ignored) since the previous schedule.
        num_waiting: requests left in the waiting queue after this step's admissions.
        wait_reason: why the waiting queue's head was not admitted; None if nothing waits.
    """

    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    scheduled_new_reqs: list[NewRequestData]
    scheduled_resumed_req_ids: ReqIdList
    scheduled_cached_reqs: CachedRequestData
    preempted_req_ids: ReqIdList
    finished_req_ids: ReqIdList
    num_waiting: int
    wait_reason: WaitReason | None


@dataclass(slots=True)
class PrefixCacheStats:
    """Cumulative prefix-cache counters, recorded when a request is admitted.

    `queries` counts the request's whole current length in tokens; `hits` the cached tokens.
    Re-admissions after a preemption are counted apart, as vLLM does.
    """

    requests: int = 0
    queries: int = 0
    hits: int = 0
    preempted_requests: int = 0
    preempted_queries: int = 0
    preempted_hits: int = 0

    def record(self, num_tokens: int, num_hits: int, preempted: bool) -> None:
        if preempted:
            self.preempted_requests += 1
            self.preempted_queries += num_tokens
            self.preempted_hits += num_hits
        else:
            self.requests += 1
            self.queries += num_tokens
            self.hits += num_hits

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0

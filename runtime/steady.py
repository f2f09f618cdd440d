"""Steady decodes: running requests advanced implicitly, so a step costs what changes in it.

A *steady decode* is a running request that decodes one token in every step until its length
stop, with tokens the driver knows in advance (no EOS or stop token can end it early: the
simulator's requests run with `ignore_eos`). In a step where the steady decodes fit in the
token budget and no allocation can fail, each of them only

    takes a new KV block    when its computed tokens c reach a block boundary (c % B == 0)
    registers a full block  when its scheduled token fills one ((c + 1) % B == 0)
    finishes                when its appended token reaches its stop length

(B = block_size). So instead of visiting every running request every step, `SteadyDecodes`
keeps their progress implicit: before step g a member has c = c_minus_g + g computed tokens
and c + 1 tokens. Members sit in B buckets by -c_minus_g mod B (bucket g mod B takes a block
in step g, bucket (g + 1) mod B fills one) and a heap holds their finish steps. Work per step
is O(blocks taken + blocks filled under shared names + requests finishing), not O(running).

Order invariant: the members are exactly the first `len(self)` requests of
`scheduler.running`, in the order they joined. Running order is the order of block pops,
registrations and frees, so the members' events in a step are handled in join order, before
the explicit requests behind them (which `Scheduler.schedule(num_steady)` schedules as usual).
A request joins only at the end of that prefix, after a step in which it was scheduled and
that left it exactly one token to compute, its next decode's (after a decode, or after the
last chunk of its prefill or recompute).

A member is *materialised* (computed tokens, appended tokens and their block hashes, its
registered blocks in the KV manager) when it finishes or leaves; a fill of a block its request
hashes (no `block_key`) appends the tokens first. A block under its request's own name
(`block_key`) is registered only then, with the member's other fills in one call: only its
request looks such a name up, once preempted (materialised); until then the block is in use
(no pop evicts it) and no free precedes the materialising; the order of registrations under
one name is kept. With KV events observed, every fill is registered in its step (its event).
The recorder writes its token times and decode run when it leaves or finishes. Scheduler,
pool and records are then identical to stepping one by one (tested on random traces against
plain `Scheduler.schedule()`).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence

from runtime.batch import BatchFeatures
from runtime.block_hash import own_block_name
from runtime.block_pool import KVCacheBlock
from runtime.kv_cache_manager import cdiv
from runtime.outputs import SchedulerOutput
from runtime.recorder import Recorder
from runtime.request import Request, RequestStatus
from runtime.scheduler import Scheduler
from runtime.steady_bucket import SteadyBucket, SteadyMember

Upcoming = Callable[[Request, int], Sequence[int]]
"""`upcoming(request, n)`: the request's next n sampled tokens (after its current ones)."""


class SteadyDecodes:
    """The steady decodes of one engine core (see the module docstring)."""

    def __init__(self, scheduler: Scheduler, recorder: Recorder, upcoming: Upcoming) -> None:
        self.scheduler = scheduler
        self.recorder = recorder
        self.upcoming = upcoming
        self.block_size = scheduler.block_size
        self._members: dict[str, SteadyMember] = {}
        self._buckets = [SteadyBucket() for _ in range(self.block_size)]
        self._num_deferred = 0  # members whose fills wait for their materialising
        self._finishes: list[tuple[int, int, SteadyMember]] = []  # (finish step, seq, member)
        self._kv_base = 0  # Σ (c_minus_g + 1): decode KV tokens before step g = this + n·g
        self._seq = 0

    def __len__(self) -> int:
        return len(self._members)

    @property
    def _step(self) -> int:
        """Index of the next step to run (the recorder's step count)."""
        return self.recorder.num_steps

    # ---- one step --------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput | None:
        """Schedule the next step with the members advanced implicitly: their blocks taken
        and filled, then `Scheduler.schedule(len(self))` for the rest. None, with nothing
        done, when the step is not steady: the members exceed the budget, or (priority
        policy) the blocks the step may take exceed the free ones, so that a member could
        be a victim. Under FCFS a victim is always the newest running request, so the
        members' own preemptions are made here (`_advance_preempting`) and the explicit
        requests' by `Scheduler.schedule`, as stepping one by one would."""
        scheduler = self.scheduler
        num_steady = len(self._members)
        if not num_steady or num_steady > scheduler.scheduler_config.max_num_batched_tokens:
            return None
        pool = scheduler.kv_cache_manager.block_pool
        g = self._step
        takers = self._buckets[g % self.block_size].members
        if scheduler.scheduler_config.policy == "fcfs":
            if len(takers) <= pool.num_free_blocks:
                self._advance(g)
                return scheduler.schedule(num_steady)
            preempted = self._advance_preempting(g)
            return scheduler.schedule(len(self._members), preempted)
        budget_left = scheduler.scheduler_config.max_num_batched_tokens - num_steady
        demand = len(takers) + scheduler.running_block_demand(num_steady, budget_left)
        if demand > pool.num_free_blocks:
            return None
        self._advance(g)
        return scheduler.schedule(num_steady)

    def _advance_preempting(self, g: int) -> list[str]:
        """`_advance(g)` when the free blocks do not cover the members taking one (FCFS):
        before each such member takes its block, the newest running requests are preempted
        until one is free, as `Scheduler._preempt_until_fits` would: explicit requests
        first (they run behind the members), then members from the newest, which leave
        first; a member that is itself the newest left is preempted and takes nothing.
        Returns the preempted request ids, in order."""
        scheduler = self.scheduler
        kv = scheduler.kv_cache_manager
        queue = kv.block_pool.free_block_queue
        get_new_block = kv.block_pool.get_new_block
        running, members = scheduler.running, self._members
        preempted: list[str] = []
        for member in list(self._buckets[g % self.block_size].members):  # victims leave it
            req_id = member.request.request_id
            while queue.num_free_blocks < 1 and members.get(req_id) is member:
                victim = running[-1]
                left = members.get(victim.request_id)
                if left is not None:
                    self._leave(left, g)
                scheduler.preempt_newest()
                preempted.append(victim.request_id)
            if members.get(req_id) is member:  # not preempted (now or by an earlier taker)
                member.table.append(get_new_block())
        self._fill_steps(g, 1)
        return preempted

    def _advance(self, g: int) -> None:
        """The members' scheduling in step g: the members whose token starts a block take
        one, then those whose token fills one register it, each in running order (a pop and
        a registration commute: registrations touch blocks in use, evictions free ones)."""
        self._take_all(self._buckets[g % self.block_size].tables)
        self._fill_steps(g, 1)

    def _fill_steps(self, g: int, num_steps: int) -> None:
        """The eager members whose token of a step g .. g + num_steps - 1 fills a block
        register it, in step then running order, in one `cache_each` call (a registration
        per block, as one by one)."""
        kv = self.scheduler.kv_cache_manager
        if not kv.enable_caching:
            return
        if self._num_deferred and kv.block_pool.kv_event_log is not None:
            self._make_eager(g)
        # An eager member registered its full blocks at joining (`_can_join`) and each fill
        # since: the new one is block c // B. Its request is brought up to date later
        # (`_materialise`).
        upcoming, block_size, buckets = self.upcoming, self.block_size, self._buckets
        blocks, block_hashes, owns = [], [], []
        for step in range(g, g + num_steps):
            for member in buckets[(step + 1) % block_size].eager:
                computed = member.c_minus_g + step
                index = computed // block_size
                key = member.key
                if key is None:
                    request = member.request
                    missing = computed + 1 - request.num_tokens
                    if missing > 0:
                        request.extend_output_tokens(upcoming(request, missing))  # hashes
                    block_hashes.append(request.block_hashes[index])
                else:  # named without its tokens; they come at `_materialise`
                    block_hashes.append(own_block_name(key, index))
                owns.append(key is not None)
                blocks.append(member.table[index])
        if not blocks:
            return
        num_own = sum(owns)
        if num_own in (0, len(blocks)):
            kv.block_pool.cache_each(blocks, block_hashes, own=num_own > 0)
        else:  # members with and without own names: one call each, in order
            for block, name, own in zip(blocks, block_hashes, owns, strict=True):
                kv.block_pool.cache_full_block(block, name, own=own)

    def _make_eager(self, g: int) -> None:
        """KV events are observed from step g on (`observe_kv_events` mid-run) while members
        defer their fills: register the fills of the steps before g without events (one by
        one they came before the log, which saw nothing of them), then make every member
        eager, as a member joining now would be."""
        kv = self.scheduler.kv_cache_manager
        pool = kv.block_pool
        log, pool.kv_event_log = pool.kv_event_log, None
        for bucket in self._buckets:
            for member in bucket.members:
                if not member.eager:
                    computed = member.c_minus_g + g
                    self._append_upcoming(member.request, computed)
                    kv.cache_full_blocks(member.request, member.table, computed)
                    member.eager = True
            bucket.eager = list(bucket.members)  # in running order
        pool.kv_event_log = log
        self._num_deferred = 0

    def _append_upcoming(self, request: Request, computed: int) -> None:
        """Append the request's missing tokens up to c + 1 (their blocks hashed)."""
        missing = computed + 1 - request.num_tokens
        if missing > 0:
            request.extend_output_tokens(self.upcoming(request, missing))

    # ---- runs of steps without explicit requests -------------------------------------------

    def run_limit(self) -> tuple[int, bool]:
        """How many steps the members can run alone from now, every running request being
        a member, and whether the last of them is a step in which members finish: the steps
        before the next finish and that step, as far as the blocks they take fit in the free
        blocks (no preemption). After a finishing step the run ends (its finishes free a
        place a waiting request may take, and change the batch)."""
        if not self._members or len(self._members) != len(self.scheduler.running):
            return 0, False
        through_finish = self._live_finishes()[0][0] - self._step + 1
        limit = self._steps_with_free_blocks(through_finish)
        return limit, limit == through_finish

    def _steps_with_free_blocks(self, limit: int) -> int:
        """The largest k <= limit such that the blocks the members take in the next k steps
        fit in the free blocks (whole cycles of `block_size` steps at once)."""
        g = self._step
        free = self.scheduler.kv_cache_manager.block_pool.num_free_blocks
        block_size, buckets = self.block_size, self._buckets
        per_cycle = len(self._members)  # every member takes one block per cycle
        cycles = min(free // per_cycle, max(limit, 0) // block_size)
        k, used = cycles * block_size, cycles * per_cycle
        while k < limit:
            used += len(buckets[(g + k) % block_size].members)
            if used > free:
                return k
            k += 1
        return limit

    def run(self, num_steps: int) -> list[int]:
        """Advance `num_steps` steps (at most `run_limit()`) of members alone; returns the
        free blocks after each step's scheduling (the caller records the steps). The run's
        blocks are taken in one pop and filled in one call, each in step then running
        order: pops and registrations commute (a pop evicts a free block, a registration
        names one in use; the pool and its KV events' index end the same), so this is the
        steps' `_advance` one after the other (a run: ~17 steps on Azure, 0-3 blocks each)."""
        g = self._step
        block_size, buckets = self.block_size, self._buckets
        takers: list[list[KVCacheBlock]] = []  # their tables
        free = self.scheduler.kv_cache_manager.block_pool.num_free_blocks
        free_after = []
        for step in range(g, g + num_steps):
            takers += buckets[step % block_size].tables
            free_after.append(free - len(takers))
        self._take_all(takers)
        self._fill_steps(g, num_steps)
        return free_after

    def _take_all(self, tables: list[list[KVCacheBlock]]) -> None:
        """Each of the takers' `tables`, in order, takes a new block (one pop for all)."""
        pool = self.scheduler.kv_cache_manager.block_pool
        if len(tables) > 1:  # the pops of `get_new_block` one by one, in one walk
            for table, block in zip(tables, pool.get_new_blocks(len(tables)), strict=True):
                table.append(block)
        elif tables:
            tables[0].append(pool.get_new_block())

    def decode_kv_tokens(self) -> int:
        """Σ (c + 1) over the members before the next step: the KV its decodes read."""
        return self._kv_base + len(self._members) * self._step

    def add_to_features(self, features: BatchFeatures) -> BatchFeatures:
        """The step's features with the members' decodes added (call before `finish_due`)."""
        n = len(self._members)
        if not n:
            return features
        return BatchFeatures(
            num_prefill_tokens=features.num_prefill_tokens,
            num_decode_tokens=features.num_decode_tokens + n,
            num_seqs=features.num_seqs + n,
            num_prefill_seqs=features.num_prefill_seqs,
            prefill_attention_pairs=features.prefill_attention_pairs,
            prefill_kv_tokens=features.prefill_kv_tokens,
            decode_kv_tokens=features.decode_kv_tokens + self.decode_kv_tokens(),
        )

    def finish_due(self) -> list[Request]:
        """The members whose token of the step being run (the recorder's next step
        number, `num_steps`) stops them, in running order: materialised through the step
        and no longer members. The caller finishes them (`Scheduler.finish_decoded`) before
        the step's other requests."""
        g = self._step
        done = []
        while (finishes := self._live_finishes()) and finishes[0][0] == g:
            member = heapq.heappop(finishes)[2]
            self._remove(member)
            self._materialise(member, g + 1)
            done.append(member.request)
        assert not finishes or finishes[0][0] > g, "a steady decode missed its finish"
        return done

    def _live_finishes(self) -> list[tuple[int, int, SteadyMember]]:
        """`_finishes` with the entries of members that left popped off its top."""
        finishes, members = self._finishes, self._members
        while finishes and members.get(finishes[0][2].request.request_id) is not finishes[0][2]:
            heapq.heappop(finishes)
        return finishes

    # ---- joining and leaving ---------------------------------------------------------------

    def join(self) -> None:
        """After a step: the running requests right behind the members that sampled a token
        in it (a decode or a completed prefill) and can go on decoding become members, in
        running order."""
        running = self.scheduler.running
        while len(self._members) < len(running):
            request = running[len(self._members)]
            if not self._can_join(request):
                return
            self._add(request)

    def _can_join(self, request: Request) -> bool:
        computed = request.num_computed_tokens
        scheduler = self.scheduler
        kv = scheduler.kv_cache_manager
        table = kv.req_to_blocks.get(request.request_id)
        return (request.status == RequestStatus.RUNNING
                and request.num_tokens - computed == 1
                and request.num_tokens > request.num_prompt_tokens
                and request.eos_token_id is None and not request.stop_token_ids
                and table is not None and len(table) == cdiv(computed, self.block_size)
                and (not kv.enable_caching
                     or kv.num_cached_block.get(request.request_id, 0)
                     == computed // self.block_size)
                and self.recorder.scheduled_in_last_step(request.request_id))

    def _add(self, request: Request) -> None:
        g = self._step
        c_minus_g = request.num_computed_tokens - g
        # Its appended token reaches stop_length when c + 2 = stop_length, c = c_minus_g + g.
        finish_step = request.stop_length - 2 - c_minus_g
        kv = self.scheduler.kv_cache_manager
        key = request.block_key
        eager = not kv.enable_caching or key is None or kv.block_pool.kv_event_log is not None
        member = SteadyMember(request, kv.req_to_blocks[request.request_id], c_minus_g,
                         finish_step, self._seq, key, eager)
        self._seq += 1
        self._members[request.request_id] = member
        self._buckets[-c_minus_g % self.block_size].add(member)
        if not eager:
            self._num_deferred += 1
        heapq.heappush(self._finishes, (finish_step, member.seq, member))
        self._kv_base += c_minus_g + 1
        self.recorder.steady_enter(request.request_id)

    def _leave(self, member: SteadyMember, g: int) -> None:
        """One member leaves before step g (a preemption victim): materialised, explicit."""
        self._remove(member)
        self._materialise(member, g)
        self.recorder.steady_leave(member.request.request_id)

    def _remove(self, member: SteadyMember) -> None:
        """Drop a member; its entry in `_finishes` stays until `_live_finishes` discards it."""
        del self._members[member.request.request_id]
        self._buckets[-member.c_minus_g % self.block_size].remove(member)
        if not member.eager:
            self._num_deferred -= 1
        self._kv_base -= member.c_minus_g + 1

    def leave_all(self) -> None:
        """Materialise every member and make it explicit again (before a step the members
        cannot take part in implicitly, or before anything reads their state)."""
        if not self._members:
            return
        g = self._step
        for member in self._members.values():
            self._materialise(member, g)
            self.recorder.steady_leave(member.request.request_id)
        self._members.clear()
        self._buckets = [SteadyBucket() for _ in range(self.block_size)]
        self._num_deferred = 0
        self._finishes.clear()
        self._kv_base = 0

    def next_finish_step(self) -> int | None:
        finishes = self._live_finishes()
        return finishes[0][0] if finishes else None

    def _materialise(self, member: SteadyMember, g: int) -> None:
        """Bring the member's request to its state before step g: c = c_minus_g + g
        computed tokens, c + 1 tokens (the missing ones appended, their blocks hashed)."""
        request = member.request
        computed = member.c_minus_g + g
        self._append_upcoming(request, computed)
        request.num_computed_tokens = computed
        kv = self.scheduler.kv_cache_manager
        if not member.eager:  # its fills registered now, under the names its hasher made
            kv.cache_full_blocks(request, member.table, computed)
        elif kv.enable_caching:  # the blocks its tokens fill, registered by `_fill_steps`
            kv.num_cached_block[request.request_id] = computed // self.block_size

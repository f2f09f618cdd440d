"""The step scheduler: vLLM V1's engine-core policy over the paged KV cache.

A step is `schedule()`, then the driver executes the batch, then `update_from_output()`.
The scheduler is pure: it reads no clock, does no I/O and logs nothing; drivers own time.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from runtime.block_hash import make_block_hasher
from runtime.block_pool import KVCacheBlock
from runtime.config import CacheConfig, SchedulerConfig
from runtime.kv_cache_manager import KVCacheManager, cdiv
from runtime.outputs import (
    BlockIds,
    CachedRequestData,
    NewRequestData,
    PrefixCacheStats,
    ReqIdList,
    SchedulerOutput,
    WaitReason,
)
from runtime.request import Request, RequestStatus
from runtime.request_queue import RequestQueue, make_request_queue


@dataclass(slots=True)
class _Step:
    """Decisions accumulated during one `schedule()` call."""

    token_budget: int
    long_prefill_cap: int  # 0 = no per-request cap this step
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    cached: CachedRequestData = field(default_factory=CachedRequestData)
    new_reqs: list[NewRequestData] = field(default_factory=list)
    resumed_reqs: list[NewRequestData] = field(default_factory=list)
    preempted_req_ids: list[str] = field(default_factory=list)

    def schedule_running(
        self, request: Request, num_new: int, new_blocks: list[KVCacheBlock]
    ) -> None:
        """Give `num_new` tokens to a running request; advance its computed tokens."""
        req_id = request.request_id
        self.num_scheduled_tokens[req_id] = num_new
        self.token_budget -= num_new
        cached = self.cached
        cached.req_ids.append(req_id)
        cached.new_block_ids.append(BlockIds(new_blocks) if new_blocks else [])
        cached.num_computed_tokens.append(request.num_computed_tokens)
        request.num_computed_tokens += num_new

    def add_decodes(self, requests: list[Request],
                    new_blocks: list[list[KVCacheBlock]]) -> None:
        """`schedule_running(request, 1, blocks)` for each request in order, in bulk."""
        req_ids = [request.request_id for request in requests]
        self.num_scheduled_tokens.update(dict.fromkeys(req_ids, 1))
        self.token_budget -= len(requests)
        cached = self.cached
        cached.req_ids += req_ids
        cached.new_block_ids += [BlockIds(blocks) if blocks else [] for blocks in new_blocks]
        cached.num_computed_tokens += [request.num_computed_tokens for request in requests]
        for request in requests:
            request.num_computed_tokens += 1

    def unschedule_running(self, req_id: str) -> None:
        """Take back a running request's tokens (a priority victim scheduled earlier)."""
        num_new = self.num_scheduled_tokens.pop(req_id, None)
        if num_new is None:
            return
        self.token_budget += num_new
        cached = self.cached
        index = cached.req_ids.index(req_id)
        for column in (cached.req_ids, cached.new_block_ids, cached.num_computed_tokens):
            del column[index]


class Scheduler:
    """Decides, each step, how many tokens each request computes.

    NOTE on the algorithm (after vLLM's V1 scheduler): there is no prefill phase and no
    decode phase. Each request has `num_computed_tokens` and `num_tokens` (prompt + outputs),
    and every step tries to let `num_computed_tokens` catch up with `num_tokens` within the
    token budget. Chunked prefill, prefix-cache hits, mixed prefill/decode batches and
    recompute after preemption all fall out of that one rule.

    Order within a step: RUNNING requests first, in admission order, each taking what it
    needs (growing its KV, preempting the newest (FCFS) or worst (priority) running request
    when blocks run out); then, only if nothing was preempted, WAITING requests from the head
    of the queue until one does not fit (no skipping past it).
    """

    def __init__(self, scheduler_config: SchedulerConfig, cache_config: CacheConfig) -> None:
        self.scheduler_config = scheduler_config
        self.cache_config = cache_config
        self.max_model_len = scheduler_config.max_model_len
        self.kv_cache_manager = KVCacheManager(
            cache_config, scheduler_config.max_model_len, scheduler_config.watermark
        )
        self.block_size = cache_config.block_size
        # Tokens whose KV the whole pool can hold. A request that reaches one more token than
        # this stops (FINISHED_LENGTH_CAPPED) like one reaching max_model_len: its next step
        # could never be allocated, even alone, and vLLM would livelock on it.
        self.pool_capacity_tokens = cache_config.num_usable_blocks * cache_config.block_size
        self._block_hasher = (
            make_block_hasher(cache_config.block_size)
            if cache_config.enable_prefix_caching else None
        )
        # Every request added and not yet released; finished ones stay until `release()`.
        self.requests: dict[str, Request] = {}
        self.waiting: RequestQueue = make_request_queue(scheduler_config.policy)
        self.running: list[Request] = []  # in (re)admission order, oldest first
        self.finished_req_ids: list[str] = []  # since the previous schedule()
        self._preempted_outside_step: list[str] = []
        self.prefix_cache_stats = PrefixCacheStats()
        self._num_added = 0  # requests added so far: the next one's `arrival_order`

    # ---- requests in and out ---------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Queue a request. One that could never complete is finished at once as
        FINISHED_IGNORED, with the reason in `stop_reason`, instead of blocking the queue."""
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} was already added")
        self.requests[request.request_id] = request
        request.arrival_order = self._num_added
        self._num_added += 1
        reason = self._why_never_fits(request)
        if reason is not None:
            request.status = RequestStatus.FINISHED_IGNORED
            request.stop_reason = reason
            self.finished_req_ids.append(request.request_id)
            return
        if self._block_hasher is not None:
            request.set_block_hasher(self._block_hasher, self.block_size)
        request.stop_length = min(request.stop_length, self.max_model_len,
                                  self.pool_capacity_tokens + 1)
        self.waiting.add(request)

    def _why_never_fits(self, request: Request) -> str | None:
        prompt_len = request.num_prompt_tokens
        if prompt_len == 0:
            return "the prompt is empty"
        if prompt_len >= self.max_model_len:
            return (f"prompt of {prompt_len} tokens leaves no room for output within "
                    f"max_model_len={self.max_model_len}")
        if prompt_len > self.pool_capacity_tokens:
            return (f"prompt of {prompt_len} tokens needs "
                    f"{cdiv(prompt_len, self.block_size)} KV blocks of {self.block_size} "
                    f"tokens but the pool has {self.cache_config.num_usable_blocks}")
        return None

    def finish_requests(self, request_ids: str | Iterable[str], status: RequestStatus) -> None:
        """Finish requests from outside (aborts). Unknown or finished ids are ignored."""
        assert RequestStatus.is_finished(status), status
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        for req_id in ids:
            request = self.requests.get(req_id)
            if request is None or request.is_finished():
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            request.status = status
            self._free(request)

    def release(self, request_ids: Iterable[str]) -> None:
        """Forget finished requests (drivers call this once they have recorded them)."""
        for req_id in request_ids:
            request = self.requests.get(req_id)
            if request is not None and request.is_finished():
                del self.requests[req_id]

    def has_unfinished_requests(self) -> bool:
        return bool(self.running) or len(self.waiting) > 0

    def get_num_unfinished_requests(self) -> int:
        return len(self.running) + len(self.waiting)

    def get_block_ids(self, request_id: str) -> list[int]:
        return self.kv_cache_manager.get_block_ids(request_id)

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """Drop the prefix cache; fails (False) while any block is in use. With
        `reset_running_requests`, first preempt every running request (tail first, so they
        requeue in their running order)."""
        if reset_running_requests:
            while self.running:
                victim = self.running.pop()
                self._preempt(victim)
                self._preempted_outside_step.append(victim.request_id)
        return self.kv_cache_manager.reset_prefix_cache()

    # ---- schedule ----------------------------------------------------------------------------

    def schedule(self, num_steady: int = 0, preempted: Sequence[str] = ()) -> SchedulerOutput:
        """Choose this step's tokens per request and allocate their KV slots.

        `num_computed_tokens` of every scheduled request is advanced now, before execution.

        `num_steady` > 0 (simulator only, `runtime.steady`): the first `num_steady` running
        requests are steady decodes whose token, block and registration for this step the
        caller has already handled; they only take their share of the budget and are left
        out of the output, which is then partial. The caller has checked that nothing will
        be preempted (`running_block_demand`), or (FCFS) has made the steady decodes' own
        preemptions (`preempt_newest`), whose ids are `preempted`, before the call.
        """
        cfg = self.scheduler_config
        step = _Step(cfg.max_num_batched_tokens - num_steady, self._long_prefill_cap())
        step.preempted_req_ids.extend(preempted)
        self._schedule_running(step, num_steady)
        assert not (num_steady and step.preempted_req_ids and cfg.policy != "fcfs"), \
            "a steady step preempted under the priority policy"
        if step.preempted_req_ids:
            wait_reason = WaitReason.PREEMPTED_THIS_STEP if self.waiting else None
        else:
            wait_reason = self._schedule_waiting(step)
        total = cfg.max_num_batched_tokens - step.token_budget
        assert total <= cfg.max_num_batched_tokens and len(self.running) <= cfg.max_num_seqs
        return self._make_output(step, total, wait_reason)

    def _long_prefill_cap(self) -> int:
        cfg = self.scheduler_config
        num_requests = len(self.running) + len(self.waiting)
        cap = cfg.long_prefill_token_threshold
        if cap == 0 or num_requests <= 1:
            return 0
        if cfg.long_prefill_token_threshold_adaptive:
            cap = max(cap, cfg.max_num_batched_tokens // num_requests)
        return cap

    def _schedule_running(self, step: _Step, start: int = 0) -> None:
        """Phase 1: running requests from index `start` on, in admission order, preempting
        when KV runs out."""
        if self._schedule_decodes(step, start):
            return
        running = self.running
        allocate = self.kv_cache_manager.allocate_slots
        cap = step.long_prefill_cap
        max_model_len = self.max_model_len
        i = start
        while i < len(running) and step.token_budget > 0:
            request = running[i]
            computed = request.num_computed_tokens
            num_new = request.num_tokens - computed
            if 0 < cap < num_new:
                num_new = cap
            num_new = min(num_new, step.token_budget, max_model_len - computed - 1)
            if num_new <= 0:
                i += 1
                continue
            new_blocks = allocate(request, num_new)
            if new_blocks is None:
                new_blocks, i = self._preempt_until_fits(request, num_new, step, i)
                if new_blocks is None:  # `request` preempted itself
                    if self.scheduler_config.policy == "priority":
                        continue  # later (better-priority) requests may still fit
                    break
            step.schedule_running(request, num_new, new_blocks)
            i += 1

    def _schedule_decodes(self, step: _Step, start: int = 0) -> bool:
        """Phase 1 for the common step in which every running request (from index `start`)
        decodes (one token left to compute, room for it under max_model_len, within the
        budget): the general loop's decisions, made in bulk. False, with nothing done, when
        that is not the case or the KV blocks run out (the general loop then preempts)."""
        running = self.running[start:] if start else self.running
        if not running or len(running) > step.token_budget:
            return False
        last_slot = self.max_model_len - 2  # the general loop's `max_model_len - c - 1 >= 1`
        if not all(r.num_tokens - r.num_computed_tokens == 1 and r.num_computed_tokens
                   <= last_slot for r in running):
            return False
        new_blocks = self.kv_cache_manager.allocate_decode_slots(running)
        if new_blocks is None:
            return False
        step.add_decodes(running, new_blocks)
        return True

    def running_block_demand(self, start: int, token_budget: int) -> int:
        """The KV blocks that `running[start:]` take in the next step, given `token_budget`
        tokens left for them, if nothing is preempted: phase 1's token choices (which
        depend on the budget and each request alone), without allocating."""
        kv = self.kv_cache_manager
        block_size, max_model_len = self.block_size, self.max_model_len
        cap = self._long_prefill_cap()
        total = 0
        for request in self.running[start:]:
            if token_budget <= 0:
                break
            computed = request.num_computed_tokens
            num_new = request.num_tokens - computed
            if 0 < cap < num_new:
                num_new = cap
            num_new = min(num_new, token_budget, max_model_len - computed - 1)
            if num_new > 0:
                token_budget -= num_new
                num_slots = min(computed + num_new, max_model_len)
                held = len(kv.req_to_blocks.get(request.request_id, ()))
                total += max(cdiv(num_slots, block_size) - held, 0)
        return total

    def _preempt_until_fits(
        self, request: Request, num_new: int, step: _Step, i: int
    ) -> tuple[list[KVCacheBlock] | None, int]:
        """Preempt victims until `request` (at index `i` of `running`) gets its slots, or
        is the victim itself. Returns the new blocks (None if it was preempted) and its
        index after the removals."""
        while True:
            victim, victim_index = self._preempt_victim(step)
            if victim_index < i:
                i -= 1
            if victim is request:
                return None, i
            new_blocks = self.kv_cache_manager.allocate_slots(request, num_new)
            if new_blocks is not None:
                return new_blocks, i

    def _preempt_victim(self, step: _Step) -> tuple[Request, int]:
        """Preempt one running request; return it and the index it had in `running`.

        FCFS takes the newest; priority the worst (highest priority value, latest arrival),
        undoing any tokens it was given earlier in this step.
        """
        running = self.running
        if self.scheduler_config.policy == "priority":
            # vLLM's key is (priority, arrival_time), its server's arrival stamps never tie.
            # A trace's times can: rt breaks their ties by the order the requests were
            # added, as a server receiving them in that order would stamp them (and as
            # the waiting queue orders them), so two tied requests never preempt each
            # other forever, as they would by running-list order.
            victim = max(running, key=lambda r: (r.priority, r.arrival_time, r.arrival_order))
            index = running.index(victim)
            del running[index]
        else:
            index = len(running) - 1
            victim = running.pop()
        step.unschedule_running(victim.request_id)
        self._preempt(victim)
        step.preempted_req_ids.append(victim.request_id)
        return victim, index

    def preempt_newest(self) -> Request:
        """FCFS preemption of the newest running request before `schedule(num_steady, ...)`
        (steady decodes, `runtime.steady`): what `_preempt_victim` does to a request not
        yet scheduled in the step. The caller passes its id to `schedule`."""
        assert self.scheduler_config.policy == "fcfs"
        victim = self.running.pop()
        self._preempt(victim)
        return victim

    def _preempt(self, request: Request) -> None:
        """Recompute preemption: free all KV, keep the outputs, requeue at the front."""
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.waiting.prepend(request)

    def _schedule_waiting(self, step: _Step) -> WaitReason | None:
        """Phase 2: admit from the head of the waiting queue until one does not fit.

        Returns why the (new) head was not admitted, or None if the queue emptied.
        """
        cfg = self.scheduler_config
        kv = self.kv_cache_manager
        while self.waiting:
            if step.token_budget <= 0:
                return WaitReason.TOKEN_BUDGET
            if len(self.running) >= cfg.max_num_seqs:
                return WaitReason.MAX_NUM_SEQS
            request = self.waiting.peek()
            hit_blocks, num_hit = kv.get_computed_blocks(request)
            num_external = self._external_tokens(request, num_hit)
            num_new = request.num_tokens - num_hit - num_external
            if 0 < step.long_prefill_cap < num_new:
                num_new = step.long_prefill_cap
            if not cfg.enable_chunked_prefill and num_new > step.token_budget:
                return WaitReason.TOKEN_BUDGET
            num_new = min(num_new, step.token_budget)
            new_blocks = kv.allocate_slots(
                request, num_external + num_new, num_hit, hit_blocks,
                full_sequence_must_fit=cfg.scheduler_reserve_full_isl,
                has_scheduled_reqs=bool(self.running),
            )
            if new_blocks is None:
                return WaitReason.KV_CAPACITY
            self.waiting.pop()
            self._admit(request, num_new, num_hit, step, num_external)
        return None

    @staticmethod
    def _external_tokens(request: Request, num_hit: int) -> int:
        """Tokens past the local prefix hit whose KV arrived from elsewhere (at most up to
        the last token, which must run to produce logits)."""
        external = request.num_external_computed_tokens
        if not external:
            return 0
        return max(min(external, request.num_tokens - 1) - num_hit, 0)

    def _admit(self, request: Request, num_new: int, num_hit: int, step: _Step,
               num_external: int = 0) -> None:
        resumed = request.status == RequestStatus.PREEMPTED
        if self.cache_config.enable_prefix_caching:
            self.prefix_cache_stats.record(request.num_tokens, num_hit, preempted=resumed)
        if request.num_cached_tokens is None:
            request.num_cached_tokens = num_hit
        request.status = RequestStatus.RUNNING
        request.num_computed_tokens = num_hit + num_external
        request.num_external_computed_tokens = 0
        self.running.append(request)
        req_id = request.request_id
        (step.resumed_reqs if resumed else step.new_reqs).append(NewRequestData(
            req_id=req_id,
            prompt_token_ids=request.prompt_token_ids,
            block_ids=BlockIds(self.kv_cache_manager.req_to_blocks[req_id]),
            num_computed_tokens=num_hit + num_external,
            prefill_token_ids=request.all_token_ids if resumed else None,
        ))
        step.num_scheduled_tokens[req_id] = num_new
        step.token_budget -= num_new
        request.num_computed_tokens += num_new

    def _make_output(
        self, step: _Step, total: int, wait_reason: WaitReason | None
    ) -> SchedulerOutput:
        preempted = self._preempted_outside_step + step.preempted_req_ids
        output = SchedulerOutput(
            num_scheduled_tokens=step.num_scheduled_tokens,
            total_num_scheduled_tokens=total,
            scheduled_new_reqs=step.new_reqs + step.resumed_reqs,
            scheduled_resumed_req_ids=ReqIdList(r.req_id for r in step.resumed_reqs),
            scheduled_cached_reqs=step.cached,
            preempted_req_ids=ReqIdList(preempted),
            finished_req_ids=ReqIdList(self.finished_req_ids),
            num_waiting=len(self.waiting),
            wait_reason=wait_reason,
        )
        self.finished_req_ids = []
        self._preempted_outside_step = []
        return output

    # ---- update --------------------------------------------------------------------------------

    def update_from_output(
        self, scheduler_output: SchedulerOutput, sampled_token_ids: Mapping[str, Sequence[int]]
    ) -> list[Request]:
        """Append each request's sampled tokens (none for a non-final prefill chunk), apply
        the stop checks, and free the requests that finished. Returns those requests."""
        finished: list[Request] = []
        get_tokens, get_request = sampled_token_ids.get, self.requests.get
        preempted = RequestStatus.PREEMPTED  # statuses above it are finished
        for req_id in scheduler_output.num_scheduled_tokens:
            tokens = get_tokens(req_id)
            if not tokens:
                continue
            request = get_request(req_id)
            if request is None or request.status > preempted:
                continue  # aborted while its step ran
            if len(tokens) == 1:  # the usual case: one sampled token, and no stop
                token = tokens[0]
                request.append_output_token(token)
                if (token != request.eos_token_id and not request.stop_token_ids
                        and request.num_tokens < request.stop_length):
                    continue
                status = self._check_stop(request, token)
                if status is not None:
                    request.status = status
                    finished.append(request)
            elif self._append_tokens(request, tokens):
                finished.append(request)
        if finished:
            for request in finished:  # C-level removals: a step finishes few requests
                self.running.remove(request)
            for request in finished:
                self._free(request)
        return finished

    def finish_decoded(self, requests: Sequence[Request]) -> None:
        """Finish requests whose last appended token reached a stop outside
        `update_from_output` (steady decodes, `runtime.steady`), as it would: status from
        the stop check, out of `running`, then freed, in the given order."""
        for request in requests:
            status = self._check_stop(request, request.last_token_id)
            assert status is not None, request
            request.status = status
            self.running.remove(request)
        for request in requests:
            self._free(request)

    def _append_tokens(self, request: Request, tokens: Sequence[int]) -> bool:
        """Append tokens one at a time; on the first stop drop the rest. True if stopped."""
        for k, token in enumerate(tokens):
            request.append_output_token(token)
            status = self._check_stop(request, token)
            if status is not None:
                request.status = status
                request.num_computed_tokens -= len(tokens) - k - 1
                return True
        return False

    def _check_stop(self, request: Request, token: int) -> RequestStatus | None:
        """vLLM 0.33's order: EOS, stop tokens, length. `min_tokens` comes after them, so it
        only matters to the sampler, which must not produce EOS or stop tokens before it."""
        if token == request.eos_token_id:
            return RequestStatus.FINISHED_STOPPED
        if request.stop_token_ids and token in request.stop_token_ids:
            request.stop_reason = token
            return RequestStatus.FINISHED_STOPPED
        if (request.num_tokens >= self.max_model_len
                or request.num_tokens - request.num_prompt_tokens >= request.max_tokens):
            return RequestStatus.FINISHED_LENGTH_CAPPED
        if request.num_tokens > self.pool_capacity_tokens:
            request.stop_reason = "kv_pool_capacity"
            return RequestStatus.FINISHED_LENGTH_CAPPED
        return None

    def _free(self, request: Request) -> None:
        self.kv_cache_manager.free(request)
        self.finished_req_ids.append(request.request_id)

    # ---- invariants --------------------------------------------------------------------------

    def check_invariants(self) -> None:
        """Raise AssertionError if the scheduler, the block tables or the pool disagree."""
        kv = self.kv_cache_manager
        kv.check_invariants()
        assert len(self.running) <= self.scheduler_config.max_num_seqs
        for request in self.running:
            assert request.status == RequestStatus.RUNNING, request
            assert 0 < request.num_computed_tokens <= request.num_tokens, request
            table = kv.req_to_blocks.get(request.request_id, [])
            assert len(table) == cdiv(request.num_computed_tokens, self.block_size), request
        for request in self.waiting:
            assert request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED), request
            assert request.num_computed_tokens == 0, request
        active = {r.request_id for r in self.running} | {r.request_id for r in self.waiting}
        assert set(kv.req_to_blocks) <= {r.request_id for r in self.running}
        assert active <= set(self.requests), "a queued request is not registered"
        if self._block_hasher is not None:
            for req_id in active:
                request = self.requests[req_id]
                assert len(request.block_hashes) == request.num_tokens // self.block_size

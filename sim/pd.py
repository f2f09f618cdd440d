"""Prefill/decode disaggregation in the fleet simulator (`simulate_pd`).

Each replica has a role, "prefill", "decode" or "both" (a fleet file pool's `role`). Each
request is placed as llm-d's EPP places it (the decode endpoint is the primary target):

    1. the decode router (`policy`) picks a replica among those that decode;
    2. the decider says whether to disaggregate: `never`, `always`, or `prefix-threshold`
       (llm-d's prefix decider: when the part of the prompt not cached on that decode replica
       is at least `threshold` tokens; rt reads the replica's own prefix cache at the
       decision, an oracle where llm-d reads its router-side index);
    3. if so, the prefill router (`prefill_policy`) picks a replica among those that prefill,
       other than the decode replica (none that can hold the prompt: not disaggregated).
    Not disaggregated, the decode replica serves the whole request, as in `sim.fleet`.

A disaggregated request runs as under vLLM's P/D proxy (`toy_proxy_server.py`) with the
NIXL connector:
    prefill    the prefill replica serves it with max_tokens=1 (API server, queue, prefill);
               the proxy discards that token;
    hand-over  at the end of that step the proxy sends the request to the decode replica's
               API server;
    transfer   once handed over, the prompt's KV blocks the decode replica lacks (looked up
               in its prefix cache then) move over the (prefill, decode) link
               (`sim.kv_transfer`: latency + bytes / bandwidth, shared);
    decode     when the last byte arrives the request enters the decode engine with all its
               prompt but the last token computed (`Request.num_external_computed_tokens`);
               the first step that schedules it computes that token and samples the first
               output token.
So the first token the client sees comes from the decode replica, and TTFT (arrival to that
token, as measured at the proxy) = routing + the prefill replica's API server, queue and
prefill + the decode replica's API server + KV transfer + decode queue + its first step (+ its
front end's output delay, with an output cost: `sim.fleet._Fleet.result`).

Simplifications: the proxy sends the request on at the prefill step's end (the prefill front
end's output delay left out); the prefill replica frees its blocks when its request finishes
(vLLM's connector holds them until the decode side has read them); the decode replica
allocates its blocks when it admits the request after the transfer (vLLM does before, in
WAITING_FOR_REMOTE_KVS), so a wait for KV room comes after the transfer. While requests can
be disaggregated, replicas that decode step one by one (no fast-forward): a transfer may end
at any time.
"""

from __future__ import annotations

import dataclasses
import math
import time
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from runtime import Request, SamplingParams
from runtime.block_hash import make_block_hasher
from runtime.kv_startup import check_int
from runtime.records import QUEUE_COLUMNS, REQUEST_FIELDS, RequestRecord
from runtime.request import BlockHasher
from runtime.router import RouterPolicy, RoutingRequest
from runtime.router.snapshot import ReplicaSnapshot
from sim.cost.base import CostModel
from sim.fleet import Replica, _Fleet, can_ever_fit
from sim.fleet_config import ROLES
from sim.fleet_records import FleetResult, PDRequestRecord, fleet_record
from sim.fleet_router import RouterReplica, routing_request
from sim.fleet_tokens import routing_tokens
from sim.kv_transfer import KvTransferConfig, KvTransferLink, transfer_bytes
from sim.model_config import ModelSpec
from sim.run_gc import run_with_gc
from sim.simulator import Progress, SimConfig
from workloads import Trace, TraceRequest
from workloads.tokens import request_token_arrays

__all__ = ["DECIDERS", "PDDecider", "PDSetup", "simulate_pd"]

DECIDERS = ("never", "always", "prefix-threshold")


@dataclass(frozen=True, slots=True)
class PDDecider:
    """Whether a request is prefilled on a replica of its own (see the module docstring)."""

    kind: str = "never"
    threshold: int = 16  # prefix-threshold: uncached prompt tokens (BLIS's default)

    def __post_init__(self) -> None:
        if self.kind not in DECIDERS:
            raise ValueError(f"unknown P/D decider {self.kind!r} "
                             f"(choose from {', '.join(DECIDERS)})")
        check_int("P/D threshold", self.threshold, 0)

    def disaggregate(self, prompt_len: int, cached_tokens: int) -> bool:
        """The choice for a prompt of which `cached_tokens` are cached on the decode side."""
        if self.kind == "prefix-threshold":
            return prompt_len - cached_tokens >= self.threshold
        return self.kind == "always"


class PDSetup(Protocol):
    """What one replica needs (`sim.engine_args.SimSetup` is one; `model`: KV bytes a token)."""

    @property
    def config(self) -> SimConfig: ...

    @property
    def cost_model(self) -> CostModel: ...

    @property
    def model(self) -> ModelSpec: ...


@dataclass(frozen=True, slots=True)
class _Stepped:
    """A replica setup with fast-forward off."""

    config: SimConfig
    cost_model: CostModel


@dataclass(slots=True)
class _Disaggregated:
    """A disaggregated request on its way."""

    req: TraceRequest
    prefill: int  # replica indices
    decode: int
    prompt: array[int]  # the decode replica's token arrays
    output: array[int]
    prefill_record: RequestRecord | None = None
    handover_s: float = math.nan  # handed to the decode engine: the transfer starts
    transfer_end_s: float = math.nan
    transfer_bytes: int = 0


class _PDFleet(_Fleet):
    routes_ahead = False  # its choices read replica state at the arrival
    gives_prefix_keys = False  # `route` below hashes the prompt's token ids
    def __init__(self, trace: Trace, setups: Sequence[PDSetup], roles: Sequence[str],
                 policy: RouterPolicy, prefill_policy: RouterPolicy | None,
                 decider: PDDecider, transfer: KvTransferConfig, refresh_s: float,
                 routing_latency_s: float, progress: Progress | None,
                 kv_event_delay_s: float = 0.0) -> None:
        check_roles(roles, len(setups), decider)
        if prefill_policy is None and decider.kind != "never":
            raise ValueError("a P/D fleet that disaggregates needs a prefill router policy")
        stepped = [s if decider.kind == "never" or role == "prefill" else
                   _Stepped(dataclasses.replace(s.config, fast_forward=False), s.cost_model)
                   for s, role in zip(setups, roles, strict=True)]
        self.prefill_router = (None if prefill_policy is None else
                               RouterReplica(1, prefill_policy, refresh_s, 0.0, kv_event_delay_s))
        super().__init__(trace, stepped, policy, refresh_s, routing_latency_s, progress,
                         kv_event_delay_s, [self.prefill_router] if self.prefill_router else [])
        self.decode_ids = [i for i, role in enumerate(roles) if role != "prefill"]
        self.prefill_ids = [i for i, role in enumerate(roles) if role != "decode"]
        self.prefill_policy = prefill_policy
        self.decider = decider
        self.transfer = transfer
        self.kv_bytes_per_token = [s.model.kv_bytes_per_token for s in setups]
        self.links: dict[tuple[int, int], KvTransferLink] = {}
        self.decoded_on: dict[str, int] = {}  # request id -> replica that serves its response
        self.disaggregated: dict[str, _Disaggregated] = {}
        self._hashers: dict[int, BlockHasher] = {}

    # ---- placing a request -----------------------------------------------------------------

    def route(self, req: TraceRequest) -> int:
        """Place `req` (the module docstring's steps 1-3); returns its decode replica."""
        now = req.arrival_s
        prompt, output, known, _ = routing_tokens(self.replicas[0], req, self.kv_block_size, False)
        self.router_for(req)  # KV events up to now to the decode router
        if self.prefill_router is not None:
            self.prefill_router.deliver_kv_events(now)
        snapshots = self.snapshots(now)
        hashes = routing_request(req, prompt, self.kv_block_size, known).block_hashes
        routing = RoutingRequest(request_id=req.request_id, now_s=now,
                                 prompt_len=req.prompt_len, token_ids=tuple(prompt),
                                 block_hashes=hashes, session_id=req.session_id)
        decode = self.pick(self.policy, routing, snapshots, self.decode_ids)
        assert decode is not None
        self.decoded_on[req.request_id] = decode
        replica = self.replicas[decode]
        reached = now + self.latency_s
        prefill = self.prefill_for(req, routing, snapshots, replica, prompt, output)
        if prefill is None:
            replica.hand_over(req, *self.arrays(req, replica, prompt, output), reached)
            return decode
        self.disaggregated[req.request_id] = _Disaggregated(
            req, prefill.index, decode, *self.arrays(req, replica, prompt, output))
        prefill.hand_over(req, *self.arrays(req, prefill, prompt, output), reached, max_tokens=1)
        return decode

    def prefill_for(self, req: TraceRequest, routing: RoutingRequest,
                    snapshots: Sequence[ReplicaSnapshot], decode: Replica,
                    prompt: array[int], output: array[int]) -> Replica | None:
        """The replica to prefill the request on, or None: not disaggregated."""
        decider = self.decider
        if decider.kind == "never":
            return None
        cached = 0
        if decider.kind == "prefix-threshold":
            cached = self.cached_tokens(decode, req, self.arrays(req, decode, prompt, output)[0])
        if not decider.disaggregate(req.prompt_len, cached):
            return None
        ids = [i for i in self.prefill_ids if i != decode.index
               and can_ever_fit(self.replicas[i].config, req.prompt_len)]
        assert self.prefill_policy is not None
        index = self.pick(self.prefill_policy, routing, snapshots, ids, fallback=False)
        return None if index is None else self.replicas[index]

    def pick(self, policy: RouterPolicy, routing: RoutingRequest,
             snapshots: Sequence[ReplicaSnapshot], ids: list[int],
             fallback: bool = True) -> int | None:
        """`policy`'s choice among replicas `ids` that can hold the prompt (none can: all of
        `ids` with `fallback`, else None), dispatched."""
        candidates = [snapshots[i] for i in ids
                      if can_ever_fit(self.replicas[i].config, routing.prompt_len)]
        if not candidates:
            if not fallback or not ids:
                return None
            candidates = [snapshots[i] for i in ids]
        decision = policy.choose(routing, candidates)
        policy.on_routed(routing, decision.replica)
        return decision.replica

    def arrays(self, req: TraceRequest, replica: Replica, prompt: array[int],
               output: array[int]) -> tuple[array[int], array[int]]:
        """The request's token arrays for `replica` (given unless its vocab or seed differ)."""
        config, first = replica.config, self.replicas[0].config
        if (config.vocab_size, config.seed) == (first.vocab_size, first.seed):
            return prompt, output
        return request_token_arrays(req, config.vocab_size, config.seed)

    def cached_tokens(self, replica: Replica, req: TraceRequest, prompt: array[int]) -> int:
        """Prompt tokens `replica`'s prefix cache would hit now (no side effects)."""
        cache = replica.config.cache
        if not cache.enable_prefix_caching:
            return 0
        hasher = self._hashers.get(cache.block_size)
        if hasher is None:
            hasher = self._hashers[cache.block_size] = make_block_hasher(cache.block_size)
        probe = Request(req.request_id, prompt, SamplingParams(max_tokens=1),
                        cache_salt=req.cache_salt, block_hashes=replica.known_hashes(req),
                        block_pieces=replica.block_ids.given_pieces(req, replica.config))
        probe.set_block_hasher(hasher, cache.block_size)
        return replica.core.scheduler.kv_cache_manager.get_computed_blocks(probe)[1]

    # ---- the router hears back -----------------------------------------------------------

    def _prefilling(self, replica: Replica, request_id: str) -> _Disaggregated | None:
        job = self.disaggregated.get(request_id)
        if job is None or job.prefill_record is not None or replica.index != job.prefill:
            return None
        return job

    def first_token(self, replica: Replica, request_id: str) -> None:
        if self._prefilling(replica, request_id) is not None:
            assert self.prefill_policy is not None
            self.prefill_policy.on_prefill_done(request_id)
        else:
            self.policy.on_prefill_done(request_id)

    def finished(self, replica: Replica, records: list[RequestRecord]) -> None:
        done = 0
        for record in records:
            job = self._prefilling(replica, record.request_id)
            if job is not None:
                job.prefill_record = record
                assert self.prefill_policy is not None
                self.prefill_policy.on_finished(record.request_id)
                if record.output_len:  # prefilled (else refused: it ends there)
                    assert record.finish_s is not None
                    self.start_decode(job, record.finish_s)
                    continue
            self.policy.on_finished(record.request_id)
            done += 1
        if done:
            self.count_done(done)

    # ---- the decode side ---------------------------------------------------------------------

    def start_decode(self, job: _Disaggregated, prefilled_s: float) -> None:
        """The proxy sends the prefilled request to the decode replica's API server."""
        replica, req = self.replicas[job.decode], job.req
        replica.core.recorder.arrived(req.request_id, prefilled_s, req.prompt_len,
                                      req.output_len)
        replica.outputs[req.request_id] = job.output
        # stamped as the decode instance's API server starts on it, not at the trace's arrival
        request = replica.make_request(req, job.prompt, req.output_len,
                                       replica.api_start(prefilled_s))
        request.num_external_computed_tokens = req.prompt_len - 1
        job.handover_s = replica.api_handover(prefilled_s, req.prompt_len)
        wait = self.env.timeout(job.handover_s - self.env.now)
        wait.callbacks.append(lambda _: self.start_transfer(job, request))

    def start_transfer(self, job: _Disaggregated, request: Request) -> None:
        replica, req = self.replicas[job.decode], job.req
        cached = self.cached_tokens(replica, req, job.prompt)
        job.transfer_bytes = transfer_bytes(req.prompt_len, cached,
                                            replica.config.cache.block_size,
                                            self.kv_bytes_per_token[job.prefill])
        link = self.links.get((job.prefill, job.decode))
        if link is None:
            link = self.links[job.prefill, job.decode] = KvTransferLink(self.env, self.transfer)
        link.start(job.transfer_bytes, lambda end_s: self.transferred(job, request, end_s))

    def transferred(self, job: _Disaggregated, request: Request, end_s: float) -> None:
        job.transfer_end_s = end_s
        self.replicas[job.decode].submit(request, end_s)

    # ---- records -----------------------------------------------------------------------------

    def result(self, wall_s: float) -> FleetResult:
        result = super().result(wall_s)
        finished = [{r.request_id: r for r in replica.core.recorder.finished}
                    for replica in self.replicas]
        requests: list[RequestRecord] = []
        for req in self.trace:
            decode = self.decoded_on[req.request_id]
            job = self.disaggregated.get(req.request_id)
            if job is None:
                record = finished[decode][req.request_id]
                requests.append(aggregated_record(record, decode, req.arrival_s))
                continue
            assert job.prefill_record is not None
            decoded = finished[decode].get(req.request_id)
            if decoded is None:  # the prefill replica refused it
                requests.append(aggregated_record(job.prefill_record, job.prefill,
                                                  req.arrival_s))
            else:
                requests.append(disaggregated_record(job, job.prefill_record, decoded))
        result.requests = requests
        return result


def check_roles(roles: Sequence[str], num_replicas: int, decider: PDDecider) -> None:
    """ValueError (one line) on roles a P/D fleet cannot serve under `decider`."""
    if len(roles) != num_replicas:
        raise ValueError(f"{len(roles)} roles for {num_replicas} replicas")
    for role in roles:
        if role not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)}, got {role!r}")
    if all(role == "prefill" for role in roles):
        raise ValueError("a P/D fleet needs a pool that decodes (role decode or both)")
    if all(role == "decode" for role in roles):  # else decode-only replicas prefill it all
        raise ValueError("a P/D fleet needs a pool that prefills (role prefill or both)")
    if decider.kind == "never" and "prefill" in roles:
        raise ValueError("pools with role prefill get no requests under the P/D decider "
                         "'never' (choose always or prefix-threshold)")


def _queue_s(record: RequestRecord) -> float:
    queued: float = sum(getattr(record, column) for column in QUEUE_COLUMNS.values())
    return queued


def aggregated_record(record: RequestRecord, replica: int, arrival_s: float) -> PDRequestRecord:
    """The record of a request one replica served whole."""
    fleet = fleet_record(record, replica, arrival_s)
    values = {name: getattr(fleet, name) for name in REQUEST_FIELDS}
    return PDRequestRecord(**values, replica=replica, routing_s=fleet.routing_s,
                           prefill_replica=replica, prefill_queue_s=_queue_s(record))


def disaggregated_record(job: _Disaggregated, prefill: RequestRecord,
                         decode: RequestRecord) -> PDRequestRecord:
    """One row from the prefill replica's record (its request of one token) and the decode
    replica's (arrived when the prefill finished, queued when the transfer ended)."""
    req = job.req
    both = (prefill, decode)
    summed = {column: getattr(prefill, column) + getattr(decode, column)
              for column in ("step_boundary_s", *QUEUE_COLUMNS.values(), "preempted_s")}
    assert prefill.queued_s is not None and decode.queued_s is not None
    return PDRequestRecord(
        request_id=req.request_id, arrival_s=req.arrival_s, prompt_len=req.prompt_len,
        max_tokens=decode.max_tokens, queued_s=prefill.queued_s,
        engine_queued_s=prefill.engine_queued_s, first_scheduled_s=prefill.first_scheduled_s,
        first_token_s=decode.first_token_s, finish_s=decode.finish_s, status=decode.status,
        finish_reason=decode.finish_reason, stop_reason=decode.stop_reason,
        output_len=decode.output_len, cached_tokens=prefill.cached_tokens,
        num_preemptions=sum(r.num_preemptions for r in both),
        token_times_s=decode.token_times_s,
        api_server_s=prefill.api_server_s + (job.handover_s - decode.arrival_s),
        prefill_s=prefill.prefill_s + prefill.decode_s + decode.prefill_s,
        decode_s=decode.decode_s, **summed,
        replica=job.decode, routing_s=prefill.arrival_s - req.arrival_s,
        prefill_replica=job.prefill, kv_transfer_s=job.transfer_end_s - job.handover_s,
        kv_transfer_bytes=job.transfer_bytes, prefill_queue_s=_queue_s(prefill),
        decode_queue_s=_queue_s(decode))


def simulate_pd(trace: Trace, replicas: Sequence[PDSetup], roles: Sequence[str],
                policy: RouterPolicy, prefill_policy: RouterPolicy | None = None,
                decider: PDDecider | None = None, transfer: KvTransferConfig | None = None,
                refresh_s: float = 0.05, routing_latency_s: float = 0.0,
                progress: Progress | None = None, kv_event_delay_s: float = 0.0) -> FleetResult:
    """`sim.fleet.simulate_fleet` with P/D disaggregation: records are `PDRequestRecord`s.

    Args:
        roles: per replica, "prefill", "decode" or "both".
        policy: routes among the replicas that decode (and every request not
            disaggregated); `prefill_policy` among those that prefill (needed unless the
            decider is `never`). Fresh policies; the run updates their state.
        decider: default `never` (with every role "both": `simulate_fleet`'s run).
        transfer: the links' speed (default 25 GB/s, 0.05 ms).
    """
    decider = decider if decider is not None else PDDecider()
    transfer = transfer if transfer is not None else KvTransferConfig()
    started = time.perf_counter()
    return run_with_gc(lambda: _PDFleet(trace, replicas, roles, policy, prefill_policy, decider,
                                        transfer, refresh_s, routing_latency_s, progress,
                                        kv_event_delay_s).run_to_end(started))

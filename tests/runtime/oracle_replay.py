"""Replay a vLLM-oracle case (a config plus add / step / abort events) through rt's scheduler
and write what the oracle writes, field for field, so that the two compare as JSON. The
oracle is vLLM's own V1 scheduler run on the CPU (a development tool, never run by tests:
tests/fixtures/oracle/ATTRIBUTION.md); `docs/tools/oracle_diff` drives both sides.

The stub executor is the oracle's: one token for each scheduled request whose computed tokens
reach its length (a step's forced token, else the request's planned token, else
1000 + k % 1000); none for a partial prefill. Finished requests are released after each step,
as the engine core does, so they leave `requests` and `block_tables` as they leave vLLM's.
"""

from __future__ import annotations

from typing import Any

from runtime import (
    CacheConfig,
    Request,
    RequestStatus,
    SamplingParams,
    Scheduler,
    SchedulerConfig,
)
from runtime.kv_events import observe_kv_events
from runtime.request import finish_reason

EOS = 2


def make_scheduler(cfg: dict[str, Any]) -> Scheduler:
    return Scheduler(
        SchedulerConfig(
            max_num_batched_tokens=cfg["max_num_batched_tokens"],
            max_num_seqs=cfg["max_num_seqs"],
            max_model_len=cfg["max_model_len"],
            long_prefill_token_threshold=cfg.get("long_prefill_token_threshold", 0),
            long_prefill_token_threshold_adaptive=cfg.get(
                "long_prefill_token_threshold_adaptive", False),
            enable_chunked_prefill=cfg.get("enable_chunked_prefill", True),
            policy=cfg.get("policy", "fcfs"),
            scheduler_reserve_full_isl=cfg.get("scheduler_reserve_full_isl", True),
            watermark=cfg.get("watermark", 0.0),
        ),
        CacheConfig(block_size=cfg["block_size"], num_blocks=cfg["num_blocks"],
                    enable_prefix_caching=cfg.get("enable_prefix_caching", True)),
    )


def make_request(ev: dict[str, Any]) -> Request:
    params = SamplingParams(
        max_tokens=ev.get("max_tokens", 16),
        min_tokens=ev.get("min_tokens", 0),
        ignore_eos=ev.get("ignore_eos", False),
        eos_token_id=EOS,
        stop_token_ids=tuple(ev.get("stop_token_ids") or ()),
    )
    return Request(str(ev["id"]), list(ev["prompt_token_ids"]), params,
                   arrival_time=float(ev.get("arrival_time", 0.0)),
                   priority=int(ev.get("priority", 0)))


def snapshot(s: Scheduler) -> dict[str, Any]:
    pool = s.kv_cache_manager.block_pool
    live = {rid: r for rid, r in s.requests.items() if not r.is_finished()}
    return {
        "running": [r.request_id for r in s.running],
        "waiting": [r.request_id for r in s.waiting],
        "num_free_blocks": pool.num_free_blocks,
        "kv_usage": round(s.kv_cache_manager.usage, 6),
        "free_block_queue": pool.free_block_ids(),
        "block_tables": {rid: ids for rid in live if (ids := s.get_block_ids(rid))},
        "requests": {
            rid: {"status": r.status.name, "num_computed_tokens": r.num_computed_tokens,
                  "num_tokens": r.num_tokens, "num_output_tokens": r.num_output_tokens,
                  "num_preemptions": r.num_preemptions}
            for rid, r in live.items()
        },
    }


def _sample(s: Scheduler, scheduled: list[str], forced: dict[str, int],
            planned: dict[str, list[int]]) -> dict[str, int]:
    chosen: dict[str, int] = {}
    for rid in scheduled:
        r = s.requests.get(rid)
        if r is None or r.num_computed_tokens < r.num_tokens:
            continue
        k = r.num_output_tokens
        plan = planned.get(rid, [])
        chosen[rid] = int(forced[rid]) if rid in forced else (
            plan[k] if k < len(plan) else 1000 + k % 1000)
    return chosen


def _cumulative(s: Scheduler) -> dict[str, int]:
    st = s.prefix_cache_stats
    return {"requests": st.requests, "queries": st.queries, "hits": st.hits}


class KvEvents:
    """A case's KV events as the oracle writes them: [kind, hash numbers] per event, each
    hash numbered by its first appearance in the case (the bytes are rt's own)."""

    def __init__(self, s: Scheduler) -> None:
        self.log = observe_kv_events(s.kv_cache_manager.block_pool)
        self.names: dict[bytes, int] = {}

    def take(self) -> list[list[Any]]:
        names = self.names
        return [[ev.kind, [names.setdefault(h, len(names)) for h in ev.block_hashes]]
                for ev in self.log.take()]


def run_events(cfg: dict[str, Any], events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The oracle's records of the case's events; with `record_kv_events` in the config,
    each scheduled step also lists its KV events."""
    s = make_scheduler(cfg)
    kv_events = KvEvents(s) if cfg.get("record_kv_events") else None
    planned: dict[str, list[int]] = {}
    records: list[dict[str, Any]] = []
    step_no = 0
    for ev in events:
        if ev["op"] == "add":
            if "output_token_ids" in ev:
                planned[str(ev["id"])] = [int(t) for t in ev["output_token_ids"]]
            s.add_request(make_request(ev))
        elif ev["op"] == "abort":
            ids = [str(i) for i in ev["ids"]]
            live = [i for i in ids if i in s.requests and not s.requests[i].is_finished()]
            s.finish_requests(ids, RequestStatus.FINISHED_ABORTED)
            s.release(ids)
            records.append({"event": "abort", "after_step": step_no, "aborted": live,
                            **snapshot(s)})
        else:
            for _ in range(int(ev.get("count", 1))):
                step_no += 1
                rec = _step(s, step_no, ev.get("tokens", {}), planned)
                if kv_events is not None and not rec.get("idle"):
                    rec["kv_events"] = kv_events.take()
                records.append(rec)
    return records


def _step(s: Scheduler, step_no: int, forced: dict[str, int],
          planned: dict[str, list[int]]) -> dict[str, Any]:
    rec: dict[str, Any] = {"event": "step", "step": step_no}
    if not s.has_unfinished_requests() and not s.finished_req_ids:  # vLLM's has_requests()
        rec.update({"idle": True, "num_scheduled_tokens": {}, "total_num_scheduled_tokens": 0,
                    "new": [], "cached": [], "resumed": [], "preempted": [], "finished": [],
                    "finished_req_ids_sent": [], "sampled": {},
                    "prefix_cache_cumulative": _cumulative(s)})
        rec.update(snapshot(s))
        return rec
    preempted_before = {rid for rid, r in s.requests.items()
                        if r.status == RequestStatus.PREEMPTED}
    out = s.schedule()
    chosen = _sample(s, list(out.num_scheduled_tokens), forced, planned)
    finished = s.update_from_output(out, {rid: [t] for rid, t in chosen.items()})
    cached = out.scheduled_cached_reqs
    rec.update({
        "num_scheduled_tokens": dict(out.num_scheduled_tokens),
        "total_num_scheduled_tokens": out.total_num_scheduled_tokens,
        "new": [{"id": n.req_id, "block_ids": list(n.block_ids),
                 "num_computed_tokens": n.num_computed_tokens} for n in out.scheduled_new_reqs],
        "cached": [{"id": rid, "new_block_ids": list(cached.new_block_ids[i]),
                    "num_computed_tokens": cached.num_computed_tokens[i]}
                   for i, rid in enumerate(cached.req_ids)],
        "resumed": [rid for rid in out.num_scheduled_tokens if rid in preempted_before],
        "preempted": sorted(out.preempted_req_ids),
        "finished": [{"id": r.request_id, "reason": finish_reason(r.status)} for r in finished],
        "finished_req_ids_sent": sorted(out.finished_req_ids),
        "sampled": chosen,
        "prefix_cache_cumulative": _cumulative(s),
    })
    s.release([r.request_id for r in finished])
    rec.update(snapshot(s))
    return rec


def trim_idle(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Without the trailing idle steps (a case's last event steps far past its end)."""
    while records and records[-1].get("idle"):
        records.pop()
    return records


def differing_fields(ours: dict[str, Any], theirs: dict[str, Any]) -> list[str]:
    """The fields where two records differ. An abort's ids compare as a set: vLLM frees a
    multi-id abort in the order of a set of strings (hash-seed dependent)."""
    return sorted(k for k in set(ours) | set(theirs) if (
        sorted(ours.get(k, [])) != sorted(theirs.get(k, [])) if k == "aborted"
        else ours.get(k) != theirs.get(k)))


def as_received(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The events with each add's arrival time replaced by its rank by (arrival time, add
    order): the distinct stamps a server receiving the requests in that order gives vLLM.
    rt breaks ties of arrival time by add order (`Request.arrival_order`); vLLM's scheduler,
    handed tied times, would compare request ids instead."""
    adds = [i for i, ev in enumerate(events) if ev["op"] == "add"]
    ranked = sorted(adds, key=lambda i: (float(events[i].get("arrival_time", 0.0)), i))
    rank = {i: float(r) for r, i in enumerate(ranked)}
    return [dict(ev, arrival_time=rank[i]) if i in rank else ev for i, ev in enumerate(events)]

"""Run many oracle cases in one process (vLLM's imports take ~8 s): reads a JSON list of
cases from argv[1], writes a JSON list of step-record lists to argv[2]. Runs under the
oracle's own virtual environment (shared/tools/vllm_oracle/README.md); trailing idle steps
are dropped, as rt_side's are."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

ORACLE = Path(os.environ.get("VLLM_ORACLE", "/work/shared/tools/vllm_oracle"))
sys.path.insert(0, str(ORACLE))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import oracle  # noqa: E402

# vLLM 0.32 -> 0.33, the one scheduler change rt's spec names that the cases reach: under
# the priority policy a running request that preempted itself lets the later running
# requests be scheduled (0.33: `continue`); 0.32 ends the running loop (`break`).
_BREAK = """            if new_blocks is None:
                # Cannot schedule this request.
                break
"""
_AS_033 = """            if new_blocks is None:
                if (self.policy == SchedulingPolicy.PRIORITY and preempted_reqs
                        and preempted_reqs[-1] is request):
                    continue
                break
"""


def patch_to_033() -> None:
    import inspect

    import vllm.v1.core.sched.scheduler as module

    source = inspect.getsource(module)
    assert source.count(_BREAK) == 1, "vLLM's scheduler is not the 0.32 the patch expects"
    exec(compile(source.replace(_BREAK, _AS_033), module.__file__, "exec"), module.__dict__)


if os.environ.get("ORACLE_AS_032") != "1":
    patch_to_033()

_build_scheduler = oracle.build_scheduler


def _build_with_adaptive(user_cfg: dict):  # type: ignore[no-untyped-def]
    """The oracle's scheduler, with `long_prefill_token_threshold_adaptive` (a vLLM
    SchedulerConfig field the oracle's config does not pass) as the case sets it."""
    cfg = dict(user_cfg)
    adaptive = bool(cfg.pop("long_prefill_token_threshold_adaptive", False))
    scheduler, merged, hasher = _build_scheduler(cfg)
    scheduler.adaptive_long_prefill_threshold = adaptive
    return scheduler, merged, hasher


oracle.build_scheduler = _build_with_adaptive


def run_sim_case(config: dict, adds: list[list[dict]]) -> dict:
    """Step k adds `adds[k]`, then schedules; as the engine core, a step with nothing left
    but finished ids to send (vLLM's `has_requests()`) runs first, unrecorded: rt's
    simulator goes idle instead, and that step changes nothing else."""
    from vllm.utils.gc_utils import freeze_gc_heap

    scheduler, cfg, hasher = oracle.build_scheduler(config)
    freeze_gc_heap()
    eos = int(cfg["eos_token_id"])
    planned: dict[str, list[int]] = {}
    live: dict[str, object] = {}
    steps: list[dict] = []
    requests: dict[str, dict] = {}

    def one_step() -> tuple[object, list[str]]:
        so = scheduler.schedule()
        mro, _ = oracle.make_model_output(scheduler, so, {}, planned)
        outs = scheduler.update_from_output(so, mro)
        done = [o.request_id for eco in outs.values() for o in eco.outputs
                if o.finish_reason is not None]
        return so, done

    for k, group in enumerate(adds):
        while not scheduler.has_unfinished_requests() and scheduler.has_finished_requests():
            one_step()
        for ev in group:
            req = oracle.make_request(ev, hasher, eos)
            planned[req.request_id] = [int(t) for t in ev["output_token_ids"]]
            live[req.request_id] = req
            requests[req.request_id] = {"first_step": None}
            scheduler.add_request(req)
        so, done = one_step()
        for rid in so.num_scheduled_tokens:
            if requests[rid]["first_step"] is None:
                requests[rid]["first_step"] = k
        for nr in so.scheduled_new_reqs:  # the prefix hit at the first admission
            requests[nr.req_id].setdefault("cached", nr.num_computed_tokens)
        for rid in done:
            req = live.pop(rid)
            requests[rid].update(finish_step=k, preemptions=req.num_preemptions,
                                 outputs=req.num_output_tokens)
        steps.append({
            "tokens": so.total_num_scheduled_tokens, "seqs": len(so.num_scheduled_tokens),
            "preempted": len(so.preempted_req_ids or ()), "finished": len(done),
            "running": len(scheduler.running),
            "waiting": len(scheduler.waiting) + len(scheduler.kv_holding_waiting),
            "kv_usage": round(scheduler.kv_cache_manager.usage, 6)})
    for rid, req in live.items():  # unfinished when the simulator's steps ran out
        requests[rid].update(finish_step=None, preemptions=req.num_preemptions,
                             outputs=req.num_output_tokens)
    return {"steps": steps, "requests": requests}


class _Capture:
    """Stands for the scheduler's KV-event publisher: keeps each step's events."""

    def __init__(self, per_step: list[list]) -> None:
        self.per_step = per_step

    def publish(self, batch) -> None:  # noqa: ANN001 - vLLM's KVEventBatch
        self.per_step[-1].extend(batch.events)

    def shutdown(self) -> None:
        pass


def _canonical(event, names: dict) -> list:  # noqa: ANN001 - a vLLM KVCacheEvent
    """[kind, hash numbers]: each hash numbered by first appearance in the case (rt's hash
    bytes are its own; the structure must be vLLM's)."""
    from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

    kind = {BlockStored: "stored", BlockRemoved: "removed", AllBlocksCleared: "cleared"}[
        type(event)]
    hashes = getattr(event, "block_hashes", [])
    return [kind, [names.setdefault(h, len(names)) for h in hashes]]


def run_steps(config: dict, events: list[dict]) -> list[dict]:
    """The oracle's step records; with `record_kv_events`, each scheduled step's KV events."""
    if not config.pop("record_kv_events", False):
        return oracle.run_events(config, events)["steps"]
    per_step: list[list] = []
    build = oracle.build_scheduler

    def build_observed(cfg: dict):  # noqa: ANN202
        scheduler, resolved, hasher = build(cfg)
        scheduler.kv_cache_manager.enable_kv_cache_events = True
        scheduler.kv_cache_manager.block_pool.enable_kv_cache_events = True
        scheduler.kv_event_publisher = _Capture(per_step)
        schedule = scheduler.schedule

        def counted(*args, **kwargs):  # noqa: ANN202
            per_step.append([])
            return schedule(*args, **kwargs)

        scheduler.schedule = counted
        return scheduler, resolved, hasher

    oracle.build_scheduler = build_observed
    try:
        steps = oracle.run_events(config, events)["steps"]
    finally:
        oracle.build_scheduler = build
    busy = [rec for rec in steps if rec["event"] == "step" and not rec.get("idle")]
    assert len(busy) == len(per_step), (len(busy), len(per_step))
    names: dict = {}
    for rec, step_events in zip(busy, per_step, strict=True):
        rec["kv_events"] = [_canonical(ev, names) for ev in step_events]
    return steps


def main() -> None:
    cases = json.loads(Path(sys.argv[1]).read_text())
    results = []
    for case in cases:
        config = dict(case["config"], model_dir=str(ORACLE / "model"))
        if "adds" in case:
            try:
                results.append(run_sim_case(config, case["adds"]))
            except Exception as exc:  # noqa: BLE001 - reported per case
                results.append({"error": f"{type(exc).__name__}: {exc}"})
            continue
        try:
            steps = run_steps(config, case["events"])
        except Exception as exc:  # noqa: BLE001 - reported per case
            results.append({"error": f"{type(exc).__name__}: {exc}"})
            continue
        while steps and steps[-1].get("idle"):
            steps.pop()
        for rec in steps:
            rec.pop("prefix_cache", None)
        results.append({"steps": steps})
    Path(sys.argv[2]).write_text(json.dumps(results))
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()

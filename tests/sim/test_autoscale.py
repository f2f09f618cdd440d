"""Autoscaling in the loop: the threshold policy by hand, a scripted policy's timeline
(start-up delay before traffic, drain before stopping) and GPU-hours."""

from __future__ import annotations

import pytest

from runtime.router import ReplicaSnapshot, make_policy
from sim.autoscale import (
    AutoscaleConfig,
    KvThreshold,
    ScalingTimeline,
    model_load_s,
    simulate_autoscaled,
)
from sim.model_presets import resolve_model
from tests.sim.test_fleet import Replica, config
from workloads import Trace, TraceRequest


def snaps(kv: float, waiting: int = 0, n: int = 2) -> list[ReplicaSnapshot]:
    return [ReplicaSnapshot(replica_id=i, taken_at_s=0.0, num_waiting=waiting, kv_usage=kv,
                            num_gpu_blocks=100) for i in range(n)]


def test_kv_threshold_by_hand() -> None:
    policy = KvThreshold(down_window_s=300.0)
    assert policy.desired(0.0, snaps(0.81), 2) == 3  # above 0.8
    assert policy.desired(10.0, snaps(0.8), 2) == 2  # not above
    assert policy.desired(20.0, snaps(0.5, waiting=4), 2) == 3  # queue threshold
    assert policy.desired(30.0, snaps(0.29), 2) == 2  # low from t = 30 ...
    assert policy.desired(329.0, snaps(0.1), 2) == 2
    assert policy.desired(330.0, snaps(0.1), 2) == 1  # ... for the whole window
    assert policy.desired(340.0, snaps(0.1), 1) == 1  # the window starts again
    assert policy.desired(350.0, snaps(0.5), 1) == 1
    assert policy.desired(360.0, snaps(0.1), 1) == 1  # a high reading reset it


def test_model_load_time() -> None:
    model = resolve_model("llama-3.1-8b")
    assert model_load_s(model, 1, 2.0, 20.0) == pytest.approx(model.weight_bytes / 2e9 + 20)
    assert model_load_s(model, 2, 2.0, 0.0) == pytest.approx(model.weight_bytes / 4e9)


class Scripted:
    """Two replicas wanted in [10, 30) s, one otherwise."""

    def desired(self, now_s: float, serving: list[ReplicaSnapshot], current: int) -> int:
        return 2 if 10.0 <= now_s < 30.0 else 1


def test_scripted_scaling_timeline_and_gpu_hours() -> None:
    trace = Trace([TraceRequest(str(i), 0.5 * i, 64, 8) for i in range(120)])  # 0..59.5 s
    replicas = [Replica(config()), Replica(config())]
    result, line = simulate_autoscaled(
        trace, replicas, make_policy("round-robin"), Scripted(),
        AutoscaleConfig(interval_s=10.0, startup_s=5.0), gpus_per_replica=2)
    assert isinstance(line, ScalingTimeline)
    # t=10 starts replica 1 (provisioned), t=15 it serves, t=30 it drains, t=40 it stopped
    assert list(zip(line.times_s, line.serving, line.provisioned, strict=True)) == [
        (0.0, 1, 1), (10.0, 1, 2), (15.0, 2, 2), (30.0, 1, 2), (40.0, 1, 1)]
    on_one = [r for r in result.requests if r.replica == 1]
    assert on_one and all(15.0 <= r.arrival_s < 30.0 for r in on_one)
    assert all(r.status.startswith("FINISHED") for r in result.requests)
    end = max(r.finish_s for r in result.requests)
    last_one = max(r.finish_s for r in on_one)  # its last step's end
    assert line.end_s == end
    assert line.gpu_hours == pytest.approx(2 * (end + (last_one - 10.0)) / 3600, abs=1e-12)


def test_threshold_scaling_follows_a_burst() -> None:
    quiet = [TraceRequest(f"q{i}", 0.5 * i, 256, 32) for i in range(40)]  # 0..19.5 s
    burst = [TraceRequest(f"b{i}", 20.0 + 0.004 * i, 1024, 128) for i in range(400)]
    tail = [TraceRequest(f"t{i}", 40.0 + 0.5 * i, 256, 32) for i in range(240)]  # to 160 s
    trace = Trace(quiet + burst + tail)
    replicas = [Replica(config(num_blocks=800)) for _ in range(4)]
    result, line = simulate_autoscaled(
        trace, replicas, make_policy("least-outstanding"), KvThreshold(down_window_s=20.0),
        AutoscaleConfig(interval_s=5.0, startup_s=10.0))
    assert all(r.status.startswith("FINISHED") for r in result.requests)
    assert max(line.provisioned) > 1 and line.serving[-1] < max(line.serving)
    assert line.gpu_hours < 4 * line.end_s / 3600  # less than the fleet sized for the peak

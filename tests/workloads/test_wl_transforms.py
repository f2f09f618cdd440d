"""Transforms: window, first-N, time scale, target rate, max-model-len clipping (counted)."""

from __future__ import annotations

import pytest

from workloads import (
    TraceError,
    TraceRequest,
    TransformSpec,
    apply_transforms,
    clip_to_max_model_len,
    first_n,
    load_trace,
    scale_time,
    time_window,
    to_mean_rate,
    trace_stats,
)

from .helpers import FIXTURES, simple_trace


def test_window_keeps_half_open_interval_and_rebases() -> None:
    trace = simple_trace([0.0, 1.0, 2.5, 3.0, 4.0])
    window = time_window(trace, 1.0, 2.0)
    assert [(r.request_id, r.arrival_s) for r in window] == [("1", 0.0), ("2", 1.5)]
    assert [r.request_id for r in time_window(trace, 2.5, None)] == ["2", "3", "4"]


def test_empty_window_is_an_error() -> None:
    with pytest.raises(TraceError) as info:
        time_window(simple_trace([0.0, 1.0]), 5.0, 1.0)
    assert info.value.column == "--start"


def test_first_n_and_scale() -> None:
    trace = simple_trace([0.0, 1.0, 3.0])
    assert [r.request_id for r in first_n(trace, 2)] == ["0", "1"]
    assert [r.arrival_s for r in scale_time(trace, 0.5)] == [0.0, 0.5, 1.5]


def test_target_rate_on_a_real_trace() -> None:
    trace = load_trace(FIXTURES / "azure_conv_2023_head.csv").trace
    faster = to_mean_rate(trace, 11.0)
    stats = trace_stats(faster)
    assert stats.time is not None
    assert stats.time.mean_rate == pytest.approx(11.0, rel=1e-12)
    assert stats.time.ia_cv == pytest.approx(trace_stats(trace).time.ia_cv, rel=1e-12)  # type: ignore[union-attr]


def test_target_rate_needs_a_span() -> None:
    with pytest.raises(TraceError) as info:
        to_mean_rate(simple_trace([0.0, 0.0]), 2.0)
    assert info.value.column == "--target-rate"


def test_clip_counts_clipped_and_dropped_and_keeps_structure() -> None:
    reqs = [TraceRequest("a", 0.0, 10, 5), TraceRequest("b", 1.0, 14, 5),
            TraceRequest("c", 2.0, 16, 5, hash_ids=(3,), hash_block_size=16),
            TraceRequest("d", 3.0, 15, 5, hash_ids=(4,), hash_block_size=16)]
    trace, report = clip_to_max_model_len(simple_trace([]).replace_requests(reqs), 16)
    assert [(r.request_id, r.prompt_len, r.output_len) for r in trace] == [
        ("a", 10, 5), ("b", 14, 2), ("d", 15, 1)]
    assert (report.clipped_outputs, report.dropped_prompts) == (2, 1)
    assert trace[2].hash_ids == (4,)


def test_apply_order_window_then_first_n_then_scale_then_clip() -> None:
    trace = simple_trace([0.0, 1.0, 2.0, 3.0, 4.0], prompt_len=10, output_len=8)
    spec = TransformSpec(start_s=1.0, first_n=3, time_scale=2.0, max_model_len=12)
    out, report = apply_transforms(trace, spec)
    assert [(r.request_id, r.arrival_s, r.output_len) for r in out] == [
        ("1", 0.0, 2), ("2", 2.0, 2), ("3", 4.0, 2)]
    assert report.clipped_outputs == 3


@pytest.mark.parametrize(("kwargs", "column"), [
    ({"time_scale": 0.0}, "--time-scale"), ({"target_rate": -1.0}, "--target-rate"),
    ({"start_s": -1.0}, "--start"), ({"duration_s": 0.0}, "--duration"),
    ({"first_n": 0}, "--first-n"), ({"max_model_len": 0}, "--max-model-len"),
    ({"time_scale": 2.0, "target_rate": 1.0}, "--target-rate"),
])
def test_bad_specs_name_the_flag(kwargs: dict[str, float], column: str) -> None:
    with pytest.raises(TraceError) as info:
        TransformSpec(**kwargs)  # type: ignore[arg-type]
    assert info.value.column == column


@pytest.mark.parametrize(("transform", "option", "value"), [
    (lambda t: scale_time(t, 1e308), "--time-scale", 1e308),
    (lambda t: to_mean_rate(t, 1e-300), "--target-rate", 1e-300),
])
def test_a_stretch_past_194_days_names_its_flag(transform: object, option: str,
                                                value: float) -> None:
    """Once an IndexError after the simulation (per-second bins of a 1e308 s span)."""
    with pytest.raises(TraceError) as info:
        transform(simple_trace([0.0, 2.0]))  # type: ignore[operator]
    assert (info.value.column, info.value.value) == (option, value)
    assert "past the 16,777,216 s (194 days)" in str(info.value)


def test_a_stretch_to_194_days_is_kept() -> None:
    assert scale_time(simple_trace([0.0, 2.0]), 2.0 ** 23)[-1].arrival_s == 2.0 ** 24

"""Arrival times match `vllm bench serve`'s `get_request` formula exactly."""

from __future__ import annotations

import math

import numpy as np
import pytest

from workloads import ArrivalProcess, TraceError, vllm_arrival_times


def vllm_reference(n: int, rate: float, burstiness: float, seed: int) -> list[float]:
    """vLLM's documented procedure, step by step: np.random.seed(seed), one
    np.random.gamma(shape=burstiness, scale=1/(rate*burstiness)) per request, cumulative sum,
    then every delay times (n / rate) / last."""
    np.random.seed(seed)  # vLLM seeds the global state; restored below by the fixture
    delays: list[float] = []
    for _ in range(n):
        if rate == math.inf:
            delays.append(0)
        elif burstiness == math.inf:
            delays.append(1.0 / rate)
        else:
            delays.append(np.random.gamma(shape=burstiness, scale=1.0 / (rate * burstiness)))
    for i in range(1, len(delays)):
        delays[i] += delays[i - 1]
    if delays[-1] != 0:
        factor = (n / rate) / delays[-1]
        delays = [d * factor for d in delays]
    return [float(d) for d in delays]


@pytest.fixture(autouse=True)
def _restore_global_numpy_state():  # type: ignore[no-untyped-def]
    state = np.random.get_state()
    yield
    np.random.set_state(state)


@pytest.mark.parametrize(("n", "rate", "burstiness", "seed"), [
    (1, 1.0, 1.0, 0), (50, 2.0, 1.0, 0), (200, 10.0, 0.5, 42), (100, 3.5, 4.0, 7),
    (30, 1.0, math.inf, 1), (10, math.inf, 1.0, 0), (1000, 20.0, 0.1, 123),
])
def test_equals_vllm_procedure_bit_for_bit(n: int, rate: float, burstiness: float,
                                           seed: int) -> None:
    assert vllm_arrival_times(n, rate, burstiness, seed).tolist() == \
        vllm_reference(n, rate, burstiness, seed)


def test_pinned_values_seed_0_poisson() -> None:
    # rate 2 req/s, burstiness 1 (Poisson), seed 0: the last arrival lands at N / rate = 2 s
    assert vllm_arrival_times(4, 2.0, 1.0, 0).tolist() == [
        0.42308662643449835, 1.0907390064119973, 1.581524126676757, 1.9999999999999998]


def test_pinned_values_bursty_gamma() -> None:
    assert vllm_arrival_times(3, 10.0, 0.5, 42).tolist() == [
        0.05109523886926289, 0.2911338163239154, 0.3]


def test_infinite_rate_sends_everything_at_zero() -> None:
    assert vllm_arrival_times(5, math.inf, 1.0, 3).tolist() == [0.0] * 5


def test_infinite_burstiness_is_constant_rate() -> None:
    assert vllm_arrival_times(4, 4.0, math.inf, 0).tolist() == [0.25, 0.5, 0.75, 1.0]


def test_last_arrival_is_n_over_rate_and_times_are_sorted() -> None:
    times = vllm_arrival_times(500, 7.0, 0.7, 5)
    assert times[-1] == pytest.approx(500 / 7.0, rel=1e-12)
    assert np.all(np.diff(times) >= 0) and times[0] > 0


def test_process_uses_its_seed_only() -> None:
    np.random.seed(999)
    before = np.random.get_state()[1].copy()
    a = ArrivalProcess(5.0, 1.0, 11).arrival_times(20)
    assert np.array_equal(np.random.get_state()[1], before)  # global state untouched
    assert np.array_equal(a, ArrivalProcess(5.0, 1.0, 11).arrival_times(20))
    assert not np.array_equal(a, ArrivalProcess(5.0, 1.0, 12).arrival_times(20))


@pytest.mark.parametrize(("rate", "burstiness", "column"), [
    (0.0, 1.0, "--request-rate"), (-1.0, 1.0, "--request-rate"),
    (math.nan, 1.0, "--request-rate"), (1.0, 0.0, "--burstiness"), (1.0, math.nan, "--burstiness"),
])
def test_invalid_parameters_raise(rate: float, burstiness: float, column: str) -> None:
    with pytest.raises(TraceError) as info:
        ArrivalProcess(rate, burstiness, 0)
    assert info.value.column == column


def test_a_rate_spreading_past_194_days_names_the_flag() -> None:
    """5 requests at 1e-300 req/s end at 5e300 s: once an IndexError after the run."""
    with pytest.raises(TraceError) as info:
        ArrivalProcess(1e-300).arrival_times(5)
    assert str(info.value) == ("--request-rate: value 1e-300: 5 requests at this rate span "
                               "5e+300 s, past the 16,777,216 s (194 days) a trace may span")
    assert ArrivalProcess(5 / 2.0 ** 24).arrival_times(5)[-1] == pytest.approx(2.0 ** 24)

"""A small seeded generator for routing draws (SplitMix64, Steele et al. 2014).

`runtime/` may not import `random` (tests/test_layering.py): every draw a policy makes comes
from a `SplitMix64` built from the seed the driver passes in, so a run is reproducible from
its seed alone and two router replicas with different seeds draw independently.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

T = TypeVar("T")

_MASK = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15


class SplitMix64:
    """64-bit SplitMix generator: `next_u64`, `random` in [0, 1), unbiased `randrange`."""

    __slots__ = ("_state",)

    def __init__(self, seed: int) -> None:
        self._state = seed & _MASK

    def next_u64(self) -> int:
        self._state = (self._state + _GOLDEN) & _MASK
        z = self._state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
        return z ^ (z >> 31)

    def random(self) -> float:
        """A float in [0, 1) with 53 random bits."""
        return (self.next_u64() >> 11) * (1.0 / (1 << 53))

    def randrange(self, n: int) -> int:
        """An int in [0, n), uniform (rejection sampling, no modulo bias)."""
        if n < 1:
            raise ValueError(f"randrange needs n >= 1, got {n}")
        limit = (1 << 64) - ((1 << 64) % n)
        while True:
            x = self.next_u64()
            if x < limit:
                return x % n

    def choice(self, items: Sequence[T]) -> T:
        return items[self.randrange(len(items))]

    def sample_two(self, items: Sequence[T]) -> tuple[T, T]:
        """Two distinct elements, in draw order (needs len(items) >= 2)."""
        first = self.randrange(len(items))
        second = self.randrange(len(items) - 1)
        if second >= first:
            second += 1
        return items[first], items[second]

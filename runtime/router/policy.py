"""The router policy interface and the helpers its implementations share.

One call decides, hooks keep the router's own state:

    decision = policy.choose(request, snapshots)   # pure but for seeded draws
    policy.on_routed(request, decision.replica)    # dispatched: update in-flight, indexes
    policy.on_prefill_done(request_id)             # first token seen (Dynamo's prefill load)
    policy.on_finished(request_id)                 # response complete
    policy.on_kv_events(queue.drain(now_s))        # precise prefix state, delayed

`route` does the first two at once. The simulator and a real HTTP router call the same
methods; a policy never reads a clock (times come in `RoutingRequest.now_s`) and draws only
from `self.rng`, seeded by the caller. `snapshots` are the candidates: the driver passes the
replicas this request may go to (e.g. those whose KV pool can ever hold it).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from runtime.router.rng import SplitMix64
from runtime.router.snapshot import (
    PromptBlocking,
    ReplicaSnapshot,
    RoutingDecision,
    RoutingRequest,
)
from runtime.router.state import KvEvent, RouterLocal


@dataclass(frozen=True, slots=True)
class NoArgs:
    """The configuration of a policy that takes no arguments."""


class RouterPolicy:
    """Base of every policy: router-local in-flight bookkeeping and a seeded generator.

    Subclasses set `name` (the CLI name), `config_type` (a frozen dataclass whose fields are
    the `KEY=VALUE` arguments) and implement `choose`.
    """

    name: ClassVar[str]
    config_type: ClassVar[type[Any]] = NoArgs

    def __init__(self, seed: int = 0) -> None:
        self.rng = SplitMix64(seed)
        self.local = RouterLocal()

    def choose(
        self, request: RoutingRequest, replicas: Sequence[ReplicaSnapshot]
    ) -> RoutingDecision:
        """Pick one of `replicas` for `request`; does not record the dispatch."""
        raise NotImplementedError

    def on_routed(self, request: RoutingRequest, replica: int) -> None:
        """The request was sent to `replica`: count it in flight."""
        self.local.add(request, replica)

    def on_prefill_done(self, request_id: str) -> None:
        """The request's first token came back (its prefill is done)."""

    def on_finished(self, request_id: str) -> None:
        """The request's response completed (or it was aborted)."""
        self.local.finish(request_id)

    @property
    def completion_blind(self) -> bool:
        """Whether `choose` never reads what `on_prefill_done`, `on_finished` or
        `on_kv_events` change: its choice for a request depends only on the snapshots, the
        request and the dispatches before it. A driver may then decide it as soon as the
        snapshots it reads are final (before the request's arrival). False unless a policy
        says so."""
        return False

    @property
    def snapshot_blind(self) -> bool:
        """Whether `choose` reads only the snapshots' replica ids, never their metrics
        (waiting, running, KV usage): a driver may pass it any snapshots of the same
        replicas. Being completion-blind too, a driver may decide a request at any time
        after the dispatches before it. False unless a policy says so."""
        return False

    @property
    def reads_token_ids(self) -> bool:
        """Whether `choose` or `on_routed` may read `RoutingRequest.token_ids` (a driver
        may pass placeholders when no policy does). True unless a policy says otherwise."""
        return True

    @property
    def prompt_blocking(self) -> PromptBlocking | None:
        """How this policy cuts prompts into chained block hashes, when that is all it
        reads `RoutingRequest.token_ids` for: given `prefix_keys` of this blocking, it reads
        no token id (a driver may pass placeholders). None (default): it hashes no blocks
        so, or reads the token ids otherwise too."""
        return None

    @property
    def wants_kv_events(self) -> bool:
        """Whether `on_kv_events` feeds a precise index this policy scores with (a driver
        not feeding events, e.g. to save work, may skip it when False)."""
        return False

    def on_kv_events(self, events: Iterable[KvEvent]) -> None:
        """KV events now visible to the router; ignored by policies without a precise index."""

    _last_ids: tuple[tuple[ReplicaSnapshot, ...], list[int]] | None = None

    def candidate_ids(self, replicas: Sequence[ReplicaSnapshot]) -> list[int]:
        """`candidate_ids(replicas)`, kept for the last tuple of candidates: a driver
        passing one fixed tuple (`sim.fleet` does to snapshot-blind routers) sorts and
        checks it once, not per request (O(replicas) each). The list is shared: read it
        only."""
        last = self._last_ids
        if last is not None and last[0] is replicas:
            return last[1]
        ids = candidate_ids(replicas)
        if isinstance(replicas, tuple):  # immutable: the same object has the same ids
            self._last_ids = (replicas, ids)
        return ids

    def route(
        self, request: RoutingRequest, replicas: Sequence[ReplicaSnapshot]
    ) -> RoutingDecision:
        """`choose`, then `on_routed` with the choice."""
        decision = self.choose(request, replicas)
        self.on_routed(request, decision.replica)
        return decision


class SnapshotBlindPolicy(RouterPolicy):
    """A policy whose choice reads only the candidates' replica ids and its own state
    (round-robin, random, session hashing, production-stack's prefix trie): completion-
    and snapshot-blind, so a driver may decide it any time after the dispatches before it."""

    @property
    def completion_blind(self) -> bool:
        return True

    @property
    def snapshot_blind(self) -> bool:
        return True


def candidate_ids(replicas: Sequence[ReplicaSnapshot]) -> list[int]:
    """The candidates' ids in increasing order; ValueError if none or duplicated."""
    ids = sorted(r.replica_id for r in replicas)
    if not ids:
        raise ValueError("no replica to route to")
    if len(set(ids)) != len(ids):
        raise ValueError(f"duplicate replica ids among candidates: {ids}")
    return ids


def by_id(replicas: Sequence[ReplicaSnapshot]) -> dict[int, ReplicaSnapshot]:
    candidate_ids(replicas)
    return {r.replica_id: r for r in replicas}


def pick_max(scores: Mapping[int, float], rng: SplitMix64) -> tuple[int, int]:
    """The replica with the highest score; ties drawn uniformly from `rng` among the tied
    replicas in id order. Returns (replica, number tied)."""
    best = max(scores.values())
    tied = sorted(r for r, s in scores.items() if s == best)
    return (tied[0] if len(tied) == 1 else rng.choice(tied)), len(tied)


def pick_min(scores: Mapping[int, float], rng: SplitMix64) -> tuple[int, int]:
    """As `pick_max`, for the lowest score (a cost)."""
    best = min(scores.values())
    tied = sorted(r for r, s in scores.items() if s == best)
    return (tied[0] if len(tied) == 1 else rng.choice(tied)), len(tied)


def first_min(ids: Sequence[int], key: Mapping[int, float]) -> int:
    """The first of `ids` (in the given order) with the lowest `key`: the reference's
    deterministic tie rule (a strict `<` scan, Rust's `min_by_key`, Python's `min`, which
    scans so: a later id replaces the best only when its key is less)."""
    return min(ids, key=key.__getitem__)


def tie_note(num_tied: int) -> str:
    return f" (tie of {num_tied}, seeded draw)" if num_tied > 1 else ""


def parse_config(policy: str, config_type: type[Any], args: Sequence[str]) -> Any:
    """Build `config_type` from `KEY=VALUE` strings (dashes in KEY read as underscores).

    Raises ValueError with a one-line message naming the argument and value: not KEY=VALUE,
    unknown key, repeated key, a value not of the field's type, or the config's own check.
    """
    fields = {f.name: f for f in dataclasses.fields(config_type)}
    values: dict[str, Any] = {}
    for arg in args:
        key, sep, raw = arg.partition("=")
        name = key.strip().replace("-", "_")
        if not sep or not name:
            raise ValueError(f"router argument {arg!r} must be KEY=VALUE")
        if name not in fields:
            known = ", ".join(sorted(fields)) or "none"
            raise ValueError(f"{policy} has no argument {key!r} (arguments: {known})")
        if name in values:
            raise ValueError(f"router argument {key!r} given twice")
        values[name] = _convert(name, str(fields[name].type), raw.strip())
    return config_type(**values)


def _convert(name: str, type_name: str, raw: str) -> Any:
    base = type_name.replace(" | None", "")
    if base == "bool":
        lowered = raw.lower()
        if lowered in ("true", "1", "yes", "on"):
            return True
        if lowered in ("false", "0", "no", "off"):
            return False
        raise ValueError(f"router argument {name} must be true or false, got {raw!r}")
    if base == "int":
        try:
            return int(raw)
        except ValueError:
            raise ValueError(f"router argument {name} must be an integer, got {raw!r}") from None
    if base == "float":
        try:
            value = float(raw)
        except ValueError:
            raise ValueError(f"router argument {name} must be a number, got {raw!r}") from None
        if not math.isfinite(value):
            raise ValueError(f"router argument {name} must be finite, got {raw!r}")
        return value
    return raw


def require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def require_formula(formula: str, current: str = "current") -> None:
    """A policy's `formula` argument: `current` (its upstream's code as read) or "legacy"
    (the released form before it)."""
    require(formula in (current, "legacy"),
            f"formula must be '{current}' or 'legacy', got {formula!r}")

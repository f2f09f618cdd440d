"""Factories for router tests: snapshots, requests, prompts and fake engine block hashes."""

from __future__ import annotations

from collections.abc import Sequence

from runtime.router import ReplicaSnapshot, RoutingRequest


def snaps(
    n: int = 3,
    waiting: Sequence[int] | None = None,
    running: Sequence[int] | None = None,
    kv: Sequence[float] | None = None,
    taken_at_s: float = 0.0,
) -> list[ReplicaSnapshot]:
    return [
        ReplicaSnapshot(
            replica_id=i,
            taken_at_s=taken_at_s,
            num_waiting=waiting[i] if waiting else 0,
            num_running=running[i] if running else 0,
            kv_usage=kv[i] if kv else 0.0,
        )
        for i in range(n)
    ]


def tokens(start: int, n: int) -> tuple[int, ...]:
    """n distinct token ids from `start` (prompts from different starts share nothing)."""
    return tuple(range(start, start + n))


def bhashes(prefix: str, n: int) -> tuple[bytes, ...]:
    """n fake engine block hashes, e.g. bhashes("x", 2) == (b"x0", b"x1")."""
    return tuple(f"{prefix}{i}".encode() for i in range(n))


_counter = iter(range(10**9))


def req(
    prompt: Sequence[int] | None = None,
    *,
    prompt_len: int | None = None,
    now_s: float = 0.0,
    block_hashes: tuple[bytes, ...] = (),
    session_id: str | None = None,
    request_id: str | None = None,
) -> RoutingRequest:
    token_ids = tuple(prompt) if prompt is not None else None
    length = prompt_len if prompt_len is not None else len(token_ids or ())
    return RoutingRequest(
        request_id=request_id or f"r{next(_counter)}",
        now_s=now_s,
        prompt_len=length,
        token_ids=token_ids,
        block_hashes=block_hashes,
        session_id=session_id,
    )

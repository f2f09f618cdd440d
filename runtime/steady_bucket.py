"""The members of `runtime.steady.SteadyDecodes`, and its buckets of them (a member joined at
step s with c computed tokens is in bucket -(c - s) mod block_size: the bucket g mod B takes a
block in step g, bucket (g + 1) mod B fills one)."""

from __future__ import annotations

from dataclasses import dataclass, field

from runtime.free_block_queue import KVCacheBlock
from runtime.request import Request


@dataclass(slots=True, eq=False)
class SteadyMember:
    """A steady decode (`runtime.steady`): its request, table and implicit progress."""

    request: Request
    table: list[KVCacheBlock]  # its block table (the KV manager's list, shared)
    c_minus_g: int  # computed tokens before step g = c_minus_g + g
    finish_step: int  # the step whose appended token stops it
    seq: int  # join order = running order among members
    key: bytes | None  # its request's `block_key` (names its blocks without their tokens)
    eager: bool  # registers each fill in its step (else when materialised; caching on)


@dataclass(slots=True, eq=False)
class SteadyBucket:
    """The members of one bucket in running order, with their block tables and the eager
    among them kept beside (the step loop reads the tables and the eager members only)."""

    members: list[SteadyMember] = field(default_factory=list)
    tables: list[list[KVCacheBlock]] = field(default_factory=list)
    eager: list[SteadyMember] = field(default_factory=list)

    def add(self, member: SteadyMember) -> None:
        self.members.append(member)
        self.tables.append(member.table)
        if member.eager:
            self.eager.append(member)

    def remove(self, member: SteadyMember) -> None:
        index = self.members.index(member)
        del self.members[index], self.tables[index]
        if member.eager:
            self.eager.remove(member)

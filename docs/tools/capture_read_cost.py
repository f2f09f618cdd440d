"""The capture client's cost per kept read, in a fresh process: N reads of SIZE bytes sent
on a socketpair and taken by `CaptureConnection`'s reader callback, called by hand. Prints
the resident memory and the CPU (system, user; the peer's sends included) per read and the
process's memory mappings. A measuring aid for docs/serve.md ("The capture client"), not
part of rt.

    cd CHECKOUT && PYTHONPATH=$PWD python docs/tools/capture_read_cost.py 300
"""

from __future__ import annotations

import asyncio
import os
import socket
import sys

from backends.bench.capture_client import CaptureConnection

READS = 100_000


def _rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * 4096


async def main(size: int) -> None:
    mine, peer = socket.socketpair()
    conn = CaptureConnection(mine, 0.0)
    conn.done = asyncio.get_running_loop().create_future()
    conn.done.set_result(None)  # reads nobody waits for: kept, nothing else
    payload = b"x" * size
    rss, start = _rss_bytes(), os.times()
    for _ in range(READS):
        peer.send(payload)
        conn._readable()
    end = os.times()
    with open("/proc/self/maps") as maps:
        mappings = sum(1 for _ in maps)
    print(f"{len(conn.captured.reads)} reads of {size} B: RSS "
          f"{(_rss_bytes() - rss) / READS:.0f} B per read; CPU per read: system "
          f"{(end.system - start.system) / READS * 1e6:.1f} us, user "
          f"{(end.user - start.user) / READS * 1e6:.1f} us; {mappings} mappings")


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1])))

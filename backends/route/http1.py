"""HTTP/1.1 framing shared by the router's client (`upstream`) and server (`server`): header
lines, chunked transfer coding, and the limits on what the peer may send.

Header names are lower-cased bytes; values are bytes with surrounding whitespace removed.
"""

from __future__ import annotations

MAX_HEAD = 64 * 1024  # bytes of a message head, or of a chunk-size line, at most
LAST_CHUNK = b"0\r\n\r\n"
# Bytes read from a socket at once at most, into one buffer its reader owns and reuses
# (`ReadBuffer`, with asyncio.BufferedProtocol). asyncio's plain Protocol allocates 256 KiB
# for every read and shrinks it to what came: once glibc's dynamic mmap threshold has risen
# past that size, these allocations come from the heap and fragment it; the router's RSS grew
# by ~480 bytes per streamed request, without bound (+9.6% in a 300 s soak; docs/route.md).
READ_SIZE = 256 * 1024


class ReadBuffer:
    """One reusable read buffer for the connections of one event loop: asyncio calls a
    BufferedProtocol's `get_buffer`, reads into it and calls `buffer_updated` back to back,
    so its connections may share it; `take(n)` copies out the n bytes read."""

    __slots__ = ("view",)

    def __init__(self, size: int = READ_SIZE) -> None:
        self.view = memoryview(bytearray(size))

    def take(self, nbytes: int) -> bytes:
        return self.view[:nbytes].tobytes()


class ProtocolError(ValueError):
    """The peer's bytes are not HTTP/1.1 as it should speak it."""


def split_head(head: bytes) -> tuple[bytes, list[tuple[bytes, bytes]]]:
    """The first line and the header fields of a head (without its blank line)."""
    lines = head.split(b"\r\n")
    return lines[0], [header(line) for line in lines[1:] if line]


def header(line: bytes) -> tuple[bytes, bytes]:
    name, colon, value = line.partition(b":")
    if not colon or not name or name != name.strip():
        raise ProtocolError(f"a malformed header line {line[:80]!r}")
    return name.lower(), value.strip()


def field(headers: list[tuple[bytes, bytes]], name: bytes) -> bytes | None:
    """The last value of header `name` (lower-case), None if absent."""
    found = None
    for key, value in headers:
        if key == name:
            found = value
    return found


def content_length(value: bytes) -> int:
    if not value.isdigit():
        raise ProtocolError(f"bad content-length {value[:40]!r}")
    return int(value)


def body_framing(headers: list[tuple[bytes, bytes]]) -> tuple[str, int]:
    """How a message's body is framed: ("chunked", 0), ("length", bytes) or ("none", 0)
    (a request: no body; a response: until the close)."""
    if b"chunked" in (field(headers, b"transfer-encoding") or b"").lower():
        return "chunked", 0
    length = field(headers, b"content-length")
    return ("none", 0) if length is None else ("length", content_length(length))


def status_line(line: bytes) -> tuple[bytes, int]:
    """The version and status code of a response's first line."""
    version, _, rest = line.partition(b" ")
    code = rest[:3]
    if not (version.startswith(b"HTTP/1.") and code.isdigit() and rest[3:4] in (b"", b" ")):
        raise ProtocolError(f"not an HTTP/1.x response: {line[:80]!r}")
    return version, int(code)


def request_head(method: bytes, target: bytes, host: bytes, length: int,
                 headers: list[tuple[bytes, bytes]], skip: frozenset[bytes]) -> bytes:
    """An HTTP/1.1 request head: `headers` (lower-case names) but those in `skip`, with
    `host` and `content-length` of its own."""
    parts = [b"%s %s HTTP/1.1\r\nhost: %s\r\ncontent-length: %d\r\n"
             % (method, target, host, length)]
    parts += [b"%s: %s\r\n" % (name, value) for name, value in headers if name not in skip]
    parts.append(b"\r\n")
    return b"".join(parts)


def chunk(data: bytes) -> bytes:
    """`data` as one chunk of a chunked body (empty data: nothing, not the last chunk)."""
    return b"%x\r\n%s\r\n" % (len(data), data) if data else b""


class ChunkedDecoder:
    """Decodes a chunked body fed in pieces split anywhere: chunk extensions and trailer
    fields are skipped. `feed` returns the data bytes it completed; `done` is set at the
    end of the body, and `leftover` then holds the bytes fed after it."""

    def __init__(self) -> None:
        self.done = False
        self.leftover = b""
        self._buf = b""  # an unfinished size line or CRLF
        self._left = 0  # data bytes left in the current chunk
        self._crlf = False  # the CRLF after a chunk's data is due
        self._trailers = False  # past the last chunk: trailer lines until a blank one

    def feed(self, data: bytes) -> list[bytes]:
        buf = self._buf + data if self._buf else data
        out: list[bytes] = []
        pos, size = 0, len(buf)
        while pos < size and not self.done:
            if self._left:
                take = min(self._left, size - pos)
                out.append(buf[pos:pos + take])
                pos += take
                self._left -= take
                self._crlf = self._left == 0
            elif self._crlf:
                if size - pos < 2:
                    break
                if buf[pos:pos + 2] != b"\r\n":
                    raise ProtocolError("a chunk's data is not followed by CRLF")
                pos, self._crlf = pos + 2, False
            else:
                end = buf.find(b"\r\n", pos)
                if end < 0:
                    if size - pos > MAX_HEAD:
                        raise ProtocolError("a chunk-size line is too long")
                    break
                self._line(buf[pos:end])
                pos = end + 2
        if self.done:
            self.leftover, self._buf = buf[pos:], b""
        else:
            self._buf = buf[pos:]
        return out

    def _line(self, line: bytes) -> None:
        if self._trailers:
            self.done = not line
            return
        digits = line.split(b";", 1)[0].strip()
        try:
            self._left = int(digits, 16)
        except ValueError:
            raise ProtocolError(f"bad chunk size {line[:40]!r}") from None
        if self._left < 0 or digits[:1] in (b"-", b"+"):
            raise ProtocolError(f"bad chunk size {line[:40]!r}")
        self._trailers = self._left == 0

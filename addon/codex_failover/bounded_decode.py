"""Decoding a body's Content-Encoding in bounded slices, up to a size cap. Pure: no mitmproxy, no I/O.

Why: mitmproxy's `get_content()` decodes a whole body at once, however large it decodes to. A 1 MB
gzip body can hold 1 GiB of zeros: decoded in one call it took the proxy from 95 MiB to 3.1 GiB and
held the event loop for 15 s, and every program using the proxy waited. Here each step produces at
most `slice_size` bytes (zlib's `max_length`, zstd's `max_length`, brotli's `output_buffer_limit`),
so the caller can yield between steps, and decoding stops as soon as the output passes `limit`.

The codings are mitmproxy's own (gzip, deflate, br, zstd, identity), with its leniency: gzip also
takes a zlib stream, deflate also takes raw deflate, data after the end of a gzip stream is ignored;
unlike mitmproxy, every member of a multi-member gzip is decoded (RFC 1952), not only the first. Like `get_content(strict=False)`, a body that does not decode (or an unknown
or stacked coding) is taken as it came: `Outcome.content` is then the raw body and `error` says why.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import brotli  # brotli and zstd come with mitmproxy (it decodes both): no dependency of ours

try:  # mitmproxy's own choice: the standard library's from 3.14, the backport before
    from compression import zstd
except ImportError:  # pragma: no cover - depends on the Python version
    from backports import zstd

SLICE = 256 * 1024  # the most output one step produces (a fraction of a millisecond of inflating)
_GZIP_MAGIC = b"\x1f\x8b"


@dataclass(frozen=True)
class Outcome:
    """What a body decodes to. `over`: it decodes past the cap (`content` is None then, and nothing
    of it is kept). `error`: not valid for its coding, or a coding this module does not know; the
    raw body is the content then (when it is within the cap)."""

    content: bytes | None
    over: bool = False
    error: str | None = None


class _Zlib:
    """gzip (wbits 47: gzip or zlib header, several members) or deflate (zlib, else raw)."""

    def __init__(self, data: bytes, gzip: bool):
        self.gzip, self.rest, self.done, self.produced = gzip, data, False, 0
        self.raw_fallback = not gzip  # deflate without its zlib header, as some servers send it
        self.d = zlib.decompressobj(47 if gzip else 15)

    def take(self, n: int) -> bytes:
        try:
            out = self.d.decompress(self.rest, n)
        except zlib.error:
            if not self.raw_fallback or self.produced:
                raise
            self.raw_fallback, self.d = False, zlib.decompressobj(-15)
            out = self.d.decompress(self.rest, n)
        self.produced += len(out)
        self.rest = self.d.unconsumed_tail
        if self.d.eof:
            following = self.d.unused_data
            if self.gzip and following.startswith(_GZIP_MAGIC):  # another member
                self.d, self.rest = zlib.decompressobj(47), following
            else:
                self.done = True  # anything after the stream is ignored, as mitmproxy does
        elif not self.rest and len(out) < n:
            self.done = True  # all input taken (a truncated stream gives what it had, as zlib does)
        return out


class _Zstd:
    """zstd, one frame after another."""

    def __init__(self, data: bytes):
        self.d, self.rest, self.done = zstd.ZstdDecompressor(), data, False

    def take(self, n: int) -> bytes:
        data, self.rest = self.rest, b""
        out = self.d.decompress(data, n)
        if self.d.eof:
            following = self.d.unused_data
            if following:
                self.d, self.rest = zstd.ZstdDecompressor(), following
            else:
                self.done = True
        elif self.d.needs_input:
            raise ValueError("zstd data ended before the end of its frame")
        return out


class _Brotli:
    def __init__(self, data: bytes):
        self.d, self.rest, self.done = brotli.Decompressor(), data, False

    def take(self, n: int) -> bytes:
        data, self.rest = self.rest, b""  # brotli keeps unread input itself: later calls pass none
        out = self.d.process(data, output_buffer_limit=n)
        if self.d.is_finished():
            self.done = True
        elif not out and self.d.can_accept_more_data():
            raise ValueError("brotli data ended before the end of its stream")
        return out


def _decoder(data: bytes, encoding: str):
    if encoding in ("gzip", "x-gzip"):
        return _Zlib(data, gzip=True)
    if encoding == "deflate":
        return _Zlib(data, gzip=False)
    if encoding == "zstd":
        return _Zstd(data)
    if encoding == "br":
        return _Brotli(data)
    return None


class BoundedDecoder:
    """Decodes `data` (its Content-Encoding `encoding`) one slice per `step()`; `limit`: the most
    decoded bytes taken. Each step is bounded work, so an async caller yields between steps."""

    def __init__(self, data: bytes, encoding: str | None, limit: int, slice_size: int = SLICE):
        self.data, self.limit, self.slice = data, limit, max(1, slice_size)
        self.encoding = (encoding or "").strip().lower()
        self.parts: list[bytes] = []
        self.size = 0
        self.outcome: Outcome | None = None
        self._d = None
        if self.encoding in ("", "identity", "none"):
            self.outcome = self._as_is(None)
        elif not data:
            self.outcome = Outcome(b"")
        else:
            self._d = _decoder(data, self.encoding)
            if self._d is None:
                self.outcome = self._as_is(f"unknown content-encoding {self.encoding[:40]!r}")

    def _as_is(self, error: str | None) -> Outcome:
        if len(self.data) > self.limit:
            return Outcome(None, over=True, error=error)
        return Outcome(self.data, error=error)

    def step(self) -> Outcome | None:
        """One slice of work; the outcome once decoding ended (then on every later call)."""
        if self.outcome is not None:
            return self.outcome
        assert self._d is not None  # (no outcome yet: there is a decoder)
        try:
            out = self._d.take(min(self.slice, self.limit - self.size + 1))
        except (zlib.error, zstd.ZstdError, brotli.error, ValueError, EOFError) as exc:
            self.parts = []
            self.outcome = self._as_is(f"not valid {self.encoding}: {exc}"[:200])
            return self.outcome
        self.size += len(out)
        if self.size > self.limit:
            self.parts = []  # let it go at once: the point is not to hold it
            self.outcome = Outcome(None, over=True)
        else:
            if out:
                self.parts.append(out)
            if self._d.done:
                self.outcome = Outcome(b"".join(self.parts))
                self.parts = []
        return self.outcome


def decode(data: bytes, encoding: str | None, limit: int, slice_size: int = SLICE) -> Outcome:
    """Every step at once: for bodies known to be small, or where nothing else waits."""
    decoder = BoundedDecoder(data, encoding, limit, slice_size)
    while (outcome := decoder.step()) is None:
        pass
    return outcome

"""Incremental framer: upstream bytes (SSE) or WebSocket messages -> `Event`s.

Sans-I/O and mitmproxy-free. The framer only *observes*: every input byte ends up in
exactly one event's `raw`, so concatenating the raws gives the input back byte for byte.

Units it emits (an `Event` each):
- a block: field lines (`data:`, `event:`, ..., comments in between) up to and including the
  blank line that ends it;
- a comment line or a blank line that stands at the start of a block, alone, so heartbeats
  are seen (and counted against budgets) when they arrive, not when a later blank line does;
- at end of input, whatever is left (a final block without its blank line).

Line ends may be LF, CRLF or CR. A chunk boundary may fall anywhere: a trailing CR is only
resolved when the next byte (or the end of input) arrives, so the events never depend on how
the input was chunked. Searching resumes where it stopped, so cost is linear in the input.
"""

from __future__ import annotations

import json
import re

DEFAULT_MAX_LINE_BYTES = 8 * 1024 * 1024
DEFAULT_MAX_BLOCK_BYTES = 32 * 1024 * 1024

_LINE_SPLIT = re.compile(r"\r\n|\r|\n")
_EOL = re.compile(rb"[\r\n]")
_NOT_PARSED = object()
_INVALID = object()


class FramerError(ValueError):
    """The upstream broke a framing bound (a line or block too long)."""


class Event:
    """One framed unit: its exact bytes, its upstream frame count, lazily parsed fields."""

    __slots__ = ("raw", "frames", "_data", "_name", "_payload")

    def __init__(self, raw: bytes, frames: int, data: object = _NOT_PARSED, name: object = _NOT_PARSED):
        self.raw = raw
        self.frames = frames
        self._data = data
        self._name = name
        self._payload = _NOT_PARSED

    @classmethod
    def from_ws_message(cls, content: bytes | str) -> "Event":
        """A WebSocket message is one frame whose whole content is the data payload."""
        if isinstance(content, str):
            return cls(content.encode(), 1, content, None)
        return cls(bytes(content), 1, content.decode("utf-8", "replace"), None)

    def _parse_fields(self) -> None:
        data: list[str] = []
        name = None
        for line in _LINE_SPLIT.split(self.raw.decode("utf-8", "replace")):
            if not line or line[0] == ":":
                continue
            field, _, value = line.partition(":")
            if value[:1] == " ":
                value = value[1:]
            if field == "data":
                data.append(value)
            elif field == "event":
                name = value
        self._data = "\n".join(data) if data else None
        self._name = name

    @property
    def data(self) -> str | None:
        """The joined `data:` lines, or None when the unit carries no data field."""
        if self._data is _NOT_PARSED:
            self._parse_fields()
        return self._data  # type: ignore[return-value]

    @property
    def name(self) -> str | None:
        """The SSE `event:` field (Codex ignores it; kept for diagnostics)."""
        if self._name is _NOT_PARSED:
            self._parse_fields()
        return self._name  # type: ignore[return-value]

    @property
    def is_heartbeat(self) -> bool:
        """No payload at all: comments, blank lines, empty or whitespace-only data."""
        data = self.data
        return data is None or not data.strip()

    @property
    def payload(self) -> object | None:
        """The data payload parsed as JSON; None when absent or not valid JSON."""
        if self._payload is _NOT_PARSED:
            data = self.data
            try:
                self._payload = json.loads(data) if data and data.strip() else _INVALID
            except ValueError:
                self._payload = _INVALID
        return None if self._payload is _INVALID else self._payload

    @property
    def type(self) -> str | None:
        """The JSON `type` of the payload, which is what Codex dispatches on."""
        payload = self.payload
        if isinstance(payload, dict):
            kind = payload.get("type")
            return kind if isinstance(kind, str) else None
        return None

    def __repr__(self) -> str:
        return f"Event(frames={self.frames}, raw={self.raw[:60]!r}{'...' if len(self.raw) > 60 else ''})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Event) and (self.raw, self.frames) == (other.raw, other.frames)

    def __hash__(self) -> int:
        return hash((self.raw, self.frames))


class SSEFramer:
    """Feed bytes with `feed()`, signal the end with `close()`; both return new events."""

    def __init__(self, max_line_bytes: int = DEFAULT_MAX_LINE_BYTES, max_block_bytes: int = DEFAULT_MAX_BLOCK_BYTES):
        self.max_line_bytes = max_line_bytes
        self.max_block_bytes = max(max_block_bytes, max_line_bytes)
        self._buf = bytearray()
        # Within the pending block: where the current (incomplete) line starts, and how far
        # the buffer has been searched already. Both are offsets into `_buf`.
        self._line_start = 0
        self._searched = 0
        self._cr_seen = False
        self._closed = False

    def feed(self, chunk: bytes) -> list[Event]:
        if self._closed:
            raise FramerError("feed() after close()")
        if not chunk:
            return []
        if not self._cr_seen and b"\r" in chunk:
            self._cr_seen = True
        self._buf += chunk
        events = self._drain(False)
        if len(self._buf) > self.max_line_bytes:  # else no bound can be broken: skip the call
            self._check_bounds()
        return events

    def close(self) -> list[Event]:
        """End of input: resolve a trailing CR and emit what is left as a final event."""
        if self._closed:
            return []
        self._closed = True
        events = self._drain(eof=True)
        if self._buf:
            events.extend(_split_glued(bytes(self._buf), self._cr_seen))
            self._buf.clear()
        return events

    @property
    def pending(self) -> int:
        """How many bytes fed are in no event yet (the next event's start)."""
        return len(self._buf)

    def holds(self, needles: tuple[bytes, ...]) -> bool:
        """Do the bytes not framed yet (an event still to come) hold any of `needles`?"""
        return any(needle in self._buf for needle in needles)

    def take_pending(self) -> bytes:
        """Give up framing: return the unframed bytes (so nothing is lost) and stop."""
        pending = bytes(self._buf)
        self._buf.clear()
        self._closed = True
        return pending

    # -- internals -------------------------------------------------------------------------

    def _drain(self, eof: bool) -> list[Event]:
        if not self._cr_seen:
            events = self._drain_plain()
            if events is not None:
                return events
        return self._drain_units(eof)

    def _drain_plain(self) -> list[Event] | None:
        """Fast path for LF-only input: cut all complete blocks at once; None if it does not apply.

        On a stream of small events the per-unit Python work of `_drain_units` dominates. When
        the buffer holds only plain blocks (no lone comment or blank line, nothing glued), the
        complete ones are cut with one C-level split instead: they are exactly the units
        `_drain_units` would find, and the state left behind is the one it would leave.
        """
        buf = self._buf
        if not buf or buf[0] in b":\n":  # nothing, or a lone comment/blank line first
            return None
        first_end = self._plain_block_end(buf, 0)
        if first_end < 0:
            return []  # the first block is still incomplete
        data = bytes(buf)
        if _GLUED.search(data):
            return None
        # The first block is known; split the rest (so a long first block is not rescanned).
        parts = data[first_end:].split(b"\n\n")
        rest = parts.pop()  # after the last blank line, so it holds none
        # Empty parts and parts starting with ":" or LF hold lone comment/blank units; they all
        # sort below b";" (as do parts starting with odd field names, which just go the slow way).
        if (parts and min(parts) < b";") or rest[:1] in (b":", b"\n"):
            return None
        # No CR, so frames are LFs: a part has its own plus the two of its blank line.
        events = [Event(data[:first_end], data.count(b"\n", 0, first_end))]
        events += [Event(part + b"\n\n", part.count(b"\n") + 2) for part in parts]
        del buf[: len(data) - len(rest)]
        # What `_plain_block_end` records for the incomplete rest: its last line start, and
        # that it holds no blank line.
        self._line_start = rest.rfind(b"\n") + 1
        self._searched = len(rest)
        return events

    def _drain_units(self, eof: bool) -> list[Event]:
        """The general path: one unit at a time, any line ends, comments, glued frames."""
        buf = self._buf
        events: list[Event] = []
        start = 0
        n = len(buf)
        while start < n:
            end = self._unit_end(buf, start, eof)
            if end < 0:
                break
            raw = bytes(buf[start:end])
            if buf[start] in b":\r\n":  # a lone comment or blank line
                events.append(Event(raw, 1))
            elif _GLUED.search(raw):
                events.extend(_split_glued(raw, self._cr_seen))
            else:
                events.append(Event(raw, count_lines(raw, self._cr_seen)))
            start = end
            self._line_start = self._searched = end
        if start:
            del buf[:start]
            self._line_start -= start
            self._searched -= start
        return events

    def _unit_end(self, buf: bytearray, start: int, eof: bool) -> int:
        """End offset of the unit starting at `start`, or -1 when more input is needed."""
        first = buf[start]
        if first == 0x3A:  # ':' comment line at block start
            return self._line_end(buf, start, eof)
        if first in (0x0A, 0x0D):  # blank line at block start
            return self._line_end(buf, start, eof)
        if not self._cr_seen:
            return self._plain_block_end(buf, start)
        return self._block_end_general(buf, start, eof)

    def _plain_block_end(self, buf: bytearray, start: int) -> int:
        """LF only: end of the block at `start` (after its blank line), or -1 when incomplete.

        `_searched` is how far this block is known to hold no blank line, so each byte is
        searched about once however the input is chunked.
        """
        i = buf.find(b"\n\n", max(self._searched - 1, start))
        if i >= 0:
            return i + 2
        last = buf.rfind(b"\n", max(self._searched, start))
        if last >= 0:
            self._line_start = last + 1
        self._searched = len(buf)
        return -1

    def _line_end(self, buf: bytearray, start: int, eof: bool) -> int:
        """End of the line starting at `start` (after its terminator), or -1."""
        m = _EOL.search(buf, max(self._searched, start))
        if m is None:
            self._searched = len(buf)
            return -1
        return self._after_eol(buf, m.start(), eof)

    @staticmethod
    def _after_eol(buf: bytearray, i: int, eof: bool) -> int:
        """Offset after the terminator at `i`; -1 when a CR at the end may still become CRLF."""
        if buf[i] == 0x0A:
            return i + 1
        if i + 1 < len(buf):
            return i + 2 if buf[i + 1] == 0x0A else i + 1
        return i + 1 if eof else -1

    def _block_end_general(self, buf: bytearray, start: int, eof: bool) -> int:
        """Block end with any mix of LF, CRLF and CR, scanning one line at a time."""
        pos = max(self._line_start, start)
        n = len(buf)
        while True:
            if pos >= n:
                self._line_start = pos
                return -1
            if buf[pos] in (0x0A, 0x0D):  # a blank line ends the block
                end = self._after_eol(buf, pos, eof)
                if end < 0:
                    self._line_start = pos
                return end
            m = _EOL.search(buf, max(pos, self._searched))
            if m is None:
                self._line_start, self._searched = pos, n
                return -1
            after = self._after_eol(buf, m.start(), eof)
            if after < 0:
                self._line_start, self._searched = pos, m.start()
                return -1
            pos = after

    def _check_bounds(self) -> None:
        pending_line = len(self._buf) - self._line_start
        if pending_line > self.max_line_bytes:
            raise FramerError(
                f"SSE line longer than {self.max_line_bytes} bytes without a line end (max_line_bytes)"
            )
        if len(self._buf) > self.max_block_bytes:
            raise FramerError(
                f"SSE event longer than {self.max_block_bytes} bytes without a blank line (max_block_bytes)"
            )


def count_lines(raw: bytes, cr_seen: bool) -> int:
    """Upstream frames in `raw`: line terminators, plus one for a final unterminated line."""
    if cr_seen:
        ends = raw.count(b"\n") + raw.count(b"\r") - raw.count(b"\r\n")
    else:
        ends = raw.count(b"\n")
    return ends + (0 if raw[-1:] in (b"\n", b"\r") else 1)


_JSON_TOKEN = re.compile(rb'[{}"\r\n]')
_STRING_TOKEN = re.compile(rb'["\\\r\n]')
_DATA_OBJECT = re.compile(rb"data: ?{")
_GLUED = re.compile(rb"\}(?:data|event):")  # one regex pass: faster than two `in` scans


def _split_glued(raw: bytes, cr_seen: bool) -> list[Event]:
    """One event, or several when frames were glued (`data: {...}data: {...}`, `}event:`)."""
    if not _GLUED.search(raw):
        return [Event(raw, count_lines(raw, cr_seen))]
    events = []
    start = line = 0
    while line < len(raw):
        m = _DATA_OBJECT.match(raw, line)
        if m:
            end = _json_object_end(raw, m.end() - 1)
            if end > 0 and (raw.startswith(b"data:", end) or raw.startswith(b"event:", end)):
                piece = raw[start:end]
                events.append(Event(piece, count_lines(piece, cr_seen)))
                start = line = end
                continue
        eol = _EOL.search(raw, line)
        if eol is None:
            break
        line = eol.end()
    piece = raw[start:]
    if piece:
        events.append(Event(piece, count_lines(piece, cr_seen)))
    return events


def _json_object_end(raw: bytes, start: int) -> int:
    """Offset after the one-line `{...}` object at `start`, honouring strings; -1 if unclosed."""
    depth = 0
    pos = start
    while True:
        m = _JSON_TOKEN.search(raw, pos)
        if m is None:
            return -1
        ch = raw[m.start()]
        if ch == 0x22:  # '"'
            pos = _string_end(raw, m.start() + 1)
            if pos < 0:
                return -1
            continue
        if ch in (0x0A, 0x0D):
            return -1
        depth += 1 if ch == 0x7B else -1
        pos = m.start() + 1
        if depth == 0:
            return pos


def _string_end(raw: bytes, pos: int) -> int:
    while True:
        m = _STRING_TOKEN.search(raw, pos)
        if m is None:
            return -1
        ch = raw[m.start()]
        if ch == 0x5C:  # a backslash escapes the next byte
            pos = m.start() + 2
            continue
        return m.start() + 1 if ch == 0x22 else -1

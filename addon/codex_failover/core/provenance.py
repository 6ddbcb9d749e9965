"""Which credential made each account-bound artifact, and so where a request carrying it may go.

The service binds some of what it returns to the account that produced it: a response id (a later
`previous_response_id`), a `compaction` item and a reasoning item's `encrypted_content` (both
encrypted for that account). Codex sends them back on later requests. A session that failed over
once holds artifacts of another account than its own, so "stay on your own credential" is wrong for
it: the request belongs to the credential that made them (docs/pool-file.md#requests-bound-to-an-account).

This module is pure (no mitmproxy, no I/O, clock injected):
- `artifacts_of_event` / `artifacts_of_output` read the artifacts out of what a credential returned
  (an SSE event or WebSocket message, a `/responses/compact` answer);
- `SseArtifacts` frames a relayed SSE stream with the shared framer and parses only the few events
  that can carry artifacts;
- `Provenance` remembers artifact -> credential key, bounded and expiring like session affinity;
- `needs_of` lists what a request body carries, for `replay_safety.assess` to place it.

Keys hold no secret and no content: an item is known by its `id`, and by a digest of its
`encrypted_content` (Codex may send items back without their ids).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable

from .activity import usage_tokens
from .affinity import seen_step
from .framer import Event, FramerError, SSEFramer
from .tracked import SeenBook

RESPONSE = "resp:"  # a response id
ITEM = "item:"  # an output item's id
DIGEST = "enc:"  # a digest of an item's encrypted_content
BOUND_ITEMS = ("compaction", "reasoning")  # item types whose encrypted_content is account-bound
# Events that may carry artifacts; every other event of a stream is never parsed here.
_MARKERS = (b'"response.output_item.done"', b'"response.completed"', b'"response.created"')
_RESPONSE_MARKERS = _MARKERS[1:]  # events that carry a response (its id, and at its end its output)
_BOUND_KINDS = tuple(f'"{kind}"'.encode() for kind in BOUND_ITEMS)  # in an item done that can carry one
_SPAN = max(map(len, _MARKERS)) - 1  # bytes of a marker that may come before a chunk's start


def digest(encrypted: str) -> str:
    return DIGEST + hashlib.sha256(encrypted.encode("utf-8", "surrogatepass")).hexdigest()[:32]


def item_keys(item: object) -> tuple[str, ...]:
    """The keys of an account-bound item (compaction, or reasoning with encrypted_content): its id
    and its content's digest. Empty for any other item."""
    if not isinstance(item, dict) or item.get("type") not in BOUND_ITEMS:
        return ()
    encrypted = item.get("encrypted_content")
    if not isinstance(encrypted, str) or not encrypted:
        return (ITEM + item["id"],) if item.get("type") == "compaction" and isinstance(item.get("id"), str) else ()
    ident = item.get("id")
    return (ITEM + ident, digest(encrypted)) if isinstance(ident, str) and ident else (digest(encrypted),)


def artifacts_of_output(items: object) -> list[str]:
    """Every artifact key in a list of output items."""
    keys: list[str] = []
    for item in items if isinstance(items, list) else ():
        keys += item_keys(item)
    return keys


def artifacts_of_event(payload: object) -> list[str]:
    """The artifacts in one streamed event (SSE `data` or a WebSocket message), parsed JSON."""
    if not isinstance(payload, dict):
        return []
    kind = payload.get("type")
    if kind == "response.output_item.done":
        return list(item_keys(payload.get("item")))
    if isinstance(kind, str) and kind.startswith("response."):
        response = payload.get("response")
        if isinstance(response, dict):
            rid = response.get("id")
            keys = [RESPONSE + rid] if isinstance(rid, str) and rid else []
            if kind == "response.completed":
                keys += artifacts_of_output(response.get("output"))
            return keys
    return []


def artifacts_of_message(content: bytes | str) -> list[str]:
    """A WebSocket message's artifacts; cheap for the messages that cannot carry any."""
    raw = content.encode() if isinstance(content, str) else content
    if not any(marker in raw for marker in _MARKERS):
        return []
    try:
        return artifacts_of_event(json.loads(raw))
    except ValueError:
        return []


def artifacts_of_compact(body: bytes) -> list[str]:
    """A `/responses/compact` answer (`{"id", "object": "response.compaction", "output": [...]}`)."""
    try:
        parsed = json.loads(body)
    except ValueError:
        return []
    if not isinstance(parsed, dict):
        return []
    rid = parsed.get("id")
    return ([RESPONSE + rid] if isinstance(rid, str) and rid else []) + artifacts_of_output(parsed.get("output"))


class SseArtifacts:
    """The artifacts of an SSE stream, fed its bytes in order (any chunking). A stream that breaks
    the framer's bounds stops being looked at: nothing is learnt from it, nothing else changes.

    Cheap where nothing can be found, as a stream relayed all day must be: a chunk is searched for the
    markers (with the few bytes before it, for a marker cut between two chunks) and its events are
    looked at only if one is there, or in the bytes the framer still holds (a marker has no line end,
    so it lies within one event). Only an event that can carry an artifact is parsed: a response's
    start or end, an item done whose text names a bound item type. `frame` lets the hold classify
    the very events framed here (one framing, one parse per event) while their artifacts are kept
    until `take`: a rejected attempt's are never taken."""

    def __init__(self) -> None:
        self._framer: SSEFramer | None = SSEFramer()
        self._tail = b""  # the last bytes fed, up to a marker's length less one
        self._pending = False  # a marker lies in the bytes the framer holds: its event is still to come
        self._found: list[str] = []
        self.tokens: dict[str, int] | None = None  # the token counts of its response.completed (the dashboard's)

    def feed(self, data: bytes | None) -> list[str]:
        """The artifacts of the events `data` completes (None: the end of the stream). A stream that
        breaks the framer's bounds is not looked at further: nothing is learnt from it."""
        with contextlib.suppress(FramerError):
            self.frame(data)
        return self.take()

    def close(self) -> list[str]:
        return self.feed(None)

    @property
    def pending(self) -> int:
        """Bytes fed that are in no event yet (0 once the stream is no longer framed)."""
        return self._framer.pending if self._framer is not None else 0

    def take(self) -> list[str]:
        """The artifacts found since the last take."""
        found, self._found = self._found, []
        return found

    def frame(self, data: bytes | None) -> list[Event]:
        """Frame `data` (None: the end of the stream) and keep its artifacts; the events, for a caller
        that reads them too. FramerError: the framer's bounds broken (then, and on every later call),
        and nothing is kept of the stream."""
        framer = self._framer
        if framer is None:
            raise FramerError("stream no longer framed")
        try:
            events = framer.close() if data is None else framer.feed(data)
        except FramerError:
            self._framer, self._found = None, []
            raise
        if data is None:
            hit = self._pending
        else:
            tail = self._tail
            hit = self._pending or _marked(data) or (bool(tail) and _marked(tail + data[:_SPAN]))
            self._tail = data[-_SPAN:] if len(data) >= _SPAN else (tail + data)[-_SPAN:]
        if hit:
            self._pending = framer.holds(_MARKERS)
            for event in events:
                raw = event.raw
                if _RESPONSE_MARKERS[0] in raw or _RESPONSE_MARKERS[1] in raw or \
                        (_MARKERS[0] in raw and any(kind in raw for kind in _BOUND_KINDS)):
                    self._found += artifacts_of_event(event.payload)
                    if _RESPONSE_MARKERS[0] in raw:
                        self.tokens = usage_tokens(event.payload) or self.tokens
        return events


def _marked(data: bytes) -> bool:
    return _MARKERS[0] in data or _MARKERS[1] in data or _MARKERS[2] in data


@dataclass(frozen=True)
class Needs:
    """What a request carries that some account made."""

    bound: tuple[tuple[str, ...], ...] = ()  # per artifact it cannot be served without, its keys
    reasoning: tuple[tuple[str, ...], ...] = ()  # per input reasoning item with encrypted_content, its keys


def needs_of(body: object) -> Needs:
    """`previous_response_id` and compaction items bind (in request order, the response id last:
    it names the latest state); encrypted reasoning items may be stripped instead."""
    if not isinstance(body, dict):
        return Needs()
    items = raw if isinstance(raw := body.get("input"), list) else []
    bound = [keys for item in items if isinstance(item, dict) and item.get("type") == "compaction"
             and (keys := item_keys(item) or _bare(item))]
    reasoning = [item_keys(item) for item in items
                 if isinstance(item, dict) and item.get("type") == "reasoning" and item.get("encrypted_content")]
    previous = body.get("previous_response_id")
    if isinstance(previous, str) and previous:
        bound.append((RESPONSE + previous,))
    return Needs(tuple(bound), tuple(reasoning))


def _bare(item: dict[str, Any]) -> tuple[str, ...]:
    """A compaction item with neither id nor content still binds: to an owner nobody knows."""
    return ("unknown:compaction",)


class Provenance(SeenBook):
    """artifact key -> the credential key (health key) that made it, least recently used first
    (tracked.SeenBook: bounded by `max_entries`, forgotten `idle` seconds after it was last made or
    asked for, like session affinity: an artifact outlives neither its session nor the proxy's
    memory of it). Clock injected."""

    def __init__(self, idle: float = 3600.0, max_entries: int = 50000, clock: Callable[[], float] = time.monotonic):
        super().__init__(idle, max_entries, clock, seen_step)

    def record(self, keys: Iterable[str], owner: str) -> int:
        """`owner` made these artifacts; how many were new or changed owner."""
        if self.idle <= 0:
            return 0
        return sum(self._use(key, owner) for key in keys)

    def owner(self, keys: Iterable[str]) -> str | None:
        """The credential that made the artifact known by any of `keys` (its id, its digest)."""
        for key in keys:
            entry = self._lookup(key)
            if entry is not None:
                self._use(key, entry[0])  # asked for: still in use
                return entry[0]
        return None

"""Which passed-through bodies stream: a flow the addon does not hold goes on as a plain proxy sends it.

A body that says it is small (a Content-Length up to STREAM_ABOVE) is read whole, as mitmproxy reads
it without `stream_large_bodies`: the user's other addons (map_remote, modify_body, a script) still see
and change it, and mitmweb shows it whole. A large one, one whose size is not said (chunked, or HTTP/2
without a length), and an event stream stream through: the proxy holds a chunk of it, never the whole,
and an event stream reaches its client as it comes. A streamed request is dialled at its head, before
the `request` hook, which is why small ones are not streamed (map_remote could not redirect them).

docs/machine-proxy.md, "What passes through".
"""

from __future__ import annotations

import re

STREAM_ABOVE = 1 << 20  # 1 MiB: mitmproxy reads up to this whole; above it, or unsaid, it streams
ANSWERED_BODY = 64 << 10  # the most a request the addon answers itself (the status page, a refusal) may carry
_DIGITS = re.compile(r"[0-9]{1,19}")  # ASCII digits only ("²".isdigit() is true), and a sane length


def size_of(content_length: str | None) -> int | None:
    """The size a Content-Length says, or None when it says none (absent, empty, not a number)."""
    text = (content_length or "").strip()
    return int(text) if _DIGITS.fullmatch(text) else None


def streams(content_length: str | None, content_type: str | None = None) -> bool:
    """Does a passed-through message with these headers stream (True) or get read whole (False)?"""
    if content_type is not None and "text/event-stream" in content_type.lower():
        return True
    size = size_of(content_length)
    return size is None or size > STREAM_ABOVE  # unsaid: it could be any size


def small_enough(content_length: str | None, transfer_encoding: str | None) -> bool:
    """May a request the addon answers itself be read whole? An HTTP/1 request with neither header has no
    body; a chunked one, or one over ANSWERED_BODY, is closed unread (nothing it could say needs more)."""
    if transfer_encoding:
        return False
    if content_length is None or not content_length.strip():
        return True
    size = size_of(content_length)
    return size is not None and size <= ANSWERED_BODY

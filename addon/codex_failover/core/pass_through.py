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

STREAM_ABOVE = 1 << 20  # 1 MiB: mitmproxy reads up to this whole; above it, or unsaid, it streams


def streams(content_length: str | None, content_type: str | None = None) -> bool:
    """Does a passed-through message with these headers stream (True) or get read whole (False)?"""
    if content_type is not None and "text/event-stream" in content_type.lower():
        return True
    size = (content_length or "").strip()
    if not size.isdigit():
        return True  # its size is not said: it could be any size
    return int(size) > STREAM_ABOVE

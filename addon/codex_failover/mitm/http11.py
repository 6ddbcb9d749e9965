"""An attempt's request, to go out on an HTTP/1.1 connection."""

from __future__ import annotations


def as_http11(request) -> None:
    """An HTTP/2 client's request, to go out as HTTP/1.1 (as mitmproxy's Http1Client converts it,
    but here for good: an HTTP/2.0 request on an HTTP/1 connection would close it after the answer)."""
    if request.is_http2 or request.is_http3:
        request.http_version = "HTTP/1.1"
        if "host" not in request.headers and request.authority:
            request.headers.insert(0, "Host", request.authority)
        request.authority = ""

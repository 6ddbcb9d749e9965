"""Small pieces of the WebSocket gate: upstream targets and the exhaustion frame."""

import json

import pytest

from codex_failover.core.outcomes import Rejection
from codex_failover.ws.dial import as_frames
from codex_failover.ws.upstream import Target


@pytest.mark.parametrize("url, secure, host, port, path, authority", [
    ("https://chatgpt.com/backend-api/codex/responses", True, "chatgpt.com", 443, "/backend-api/codex/responses", "chatgpt.com"),
    ("wss://api.openai.com/v1/responses?x=1", True, "api.openai.com", 443, "/v1/responses?x=1", "api.openai.com"),
    ("http://127.0.0.1:8123/v1/responses", False, "127.0.0.1", 8123, "/v1/responses", "127.0.0.1:8123"),
])
def test_target_from_url(url, secure, host, port, path, authority):
    target = Target.from_url(url)
    assert (target.secure, target.host, target.port, target.path, target.authority) == (secure, host, port, path, authority)


def test_exhaustion_replays_upstreams_own_frames_when_it_sent_some():
    frames = ((b'{"type":"response.created"}', True), (b'{"type":"error","status":503}', True))
    assert as_frames(Rejection("overloaded", 503, {}, frames)) == frames


@pytest.mark.parametrize("reason, status, error, want_status, want_code", [
    ("overloaded", 503, {"type": "service_unavailable_error", "code": "server_is_overloaded", "message": "busy"},
     503, "server_is_overloaded"),
    ("route_down", 502, {"message": "route egress: no endpoint could be used"}, 502, "route_down"),
    ("usage_limit", None, {}, 429, "usage_limit"),
])
def test_exhaustion_without_frames_is_a_status_bearing_error_frame(reason, status, error, want_status, want_code):
    (content, is_text), = as_frames(Rejection(reason, status, error))
    frame = json.loads(content)
    assert is_text
    assert frame["type"] == "error"
    assert frame["status"] == want_status
    assert frame["error"]["code"] == want_code
    assert frame["error"]["message"]


def test_an_upstream_writing_after_close_notify_ends_the_socket_with_one_debug_line(caplog):
    """The shutdown race: the upstream's TLS sends data after its close_notify and the read raises
    ssl.SSLError(APPLICATION_DATA_AFTER_CLOSE_NOTIFY). The socket has ended: no error, no traceback."""
    import asyncio
    import logging
    import ssl

    from wsproto import ConnectionType, WSConnection

    from codex_failover.ws.conn import ABNORMAL, WsConn

    class Reader:
        async def read(self, n):
            error = ssl.SSLError(1, "[SSL: APPLICATION_DATA_AFTER_CLOSE_NOTIFY] application data after close notify")
            error.reason = "APPLICATION_DATA_AFTER_CLOSE_NOTIFY"
            raise error

    class Writer:
        closed = False

        def is_closing(self):
            return self.closed

        def close(self):
            self.closed = True

        def write(self, data):
            pass

    conn = WsConn(Reader(), Writer(), WSConnection(ConnectionType.CLIENT))
    with caplog.at_level(logging.DEBUG, logger="codex_failover"):
        assert asyncio.run(conn.recv()) is None
    assert conn.close_code == ABNORMAL
    assert [(r.levelno, r.exc_info) for r in caplog.records] == [(logging.DEBUG, None)]
    assert "APPLICATION_DATA_AFTER_CLOSE_NOTIFY" in caplog.records[0].getMessage()

"""Rate-limit usage from headers and codex.rate_limits events."""

import json

from conftest import WIRE

from codex_failover.core.usage import UsageBook, Window, from_event, from_headers


def headers_of(name):
    lines = (WIRE / "http" / name).read_text().splitlines()[1:]
    return {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines if ":" in line)}


def test_headers_fixture():
    windows = from_headers(headers_of("200_sse_response_headers_with_rate_limits.http"), now=0)
    assert windows == [Window("primary", 12.5, 1704069000), Window("secondary", 40.0, 1704074400)]


def test_reset_after_seconds_when_no_reset_at():
    assert from_headers({"x-codex-primary-used-percent": "100", "x-codex-primary-reset-after-seconds": "30"}, now=1000) == [
        Window("primary", 100.0, 1030.0)]
    assert from_headers({"x-codex-primary-used-percent": "junk"}, now=0) == []


def test_event_fixture():
    payload = json.loads((WIRE / "ws" / "server_codex_rate_limits.json").read_text())
    assert from_event(payload) == [Window("primary", 42, 1700000000)]
    assert from_event({"type": "codex.rate_limits"}) == []


def test_full_window_reports_until_when():
    book = UsageBook()
    assert book.record("a", [Window("primary", 42, 100)]) is None
    assert book.record("a", [Window("primary", 100, 500), Window("secondary", 100, 900)]) == 900
    assert "primary 100%" in book.describe("a")
    assert book.describe("b") == "usage unknown"


def test_a_window_at_max_usage_percent_counts_as_full():
    from codex_failover.core.usage import UsageBook, Window

    book = UsageBook()
    assert book.record("k", [Window("primary", 80.0, 1000.0)]) is None
    assert book.record("k", [Window("primary", 80.0, 1000.0)], full_at=80) == 1000.0
    assert book.record("k", [Window("secondary", 79.9, 2000.0)], full_at=80) is None


def test_a_messages_own_fields_are_read_in_one_pass_as_a_mapping_reads_them():
    """mitmproxy's Headers are read through `.fields`, never `items()` (which scans every header once
    per name); the windows are those a plain mapping of the same headers gives, repeated names joined."""
    from mitmproxy.http import Headers

    from codex_failover.core.usage import codex_headers

    class FieldsOnly(Headers):
        def items(self):  # the slow path: must not be taken
            raise AssertionError("items() read")

    raw = [(b"X-Codex-Primary-Used-Percent", b"12.5"), (b"content-type", b"text/event-stream"),
           (b"x-codex-primary-reset-at", b"1704069000"), (b"x-codex-secondary-used-percent", b"40"),
           (b"x-codex-secondary-reset-after-seconds", b"60"), (b"x-codex-other", b"a"), (b"X-CODEX-OTHER", b"b")]
    headers = FieldsOnly(raw)
    assert from_headers(headers, now=1000) == from_headers(dict(Headers(raw).items()), now=1000) == [
        Window("primary", 12.5, 1704069000), Window("secondary", 40.0, 1060.0)]
    assert codex_headers(headers)["x-codex-other"] == Headers(raw)["x-codex-other"] == "a, b"
    assert codex_headers(FieldsOnly([(b"content-type", b"x")])) == {}


def test_absurd_numbers_from_outside_are_clamped():
    from codex_failover.core.units import MAX_AHEAD, sane_epoch, sane_until
    from codex_failover.core.usage import from_event, from_headers

    got = from_headers({"x-codex-primary-used-percent": "1e20", "x-codex-primary-reset-at": "1e20",
                        "x-codex-secondary-used-percent": "-5", "x-codex-secondary-reset-after-seconds": "1e20"}, 1000.0)
    assert got == [Window("primary", 100.0, None), Window("secondary", 0.0, 1000.0 + MAX_AHEAD)]
    assert from_headers({"x-codex-primary-used-percent": "nan"}, 0.0) == []
    assert from_headers({"x-codex-primary-used-percent": "5", "x-codex-primary-reset-after-seconds": "inf"}, 0.0) == \
        [Window("primary", 5.0, None)]
    assert from_event({"rate_limits": {"primary": {"used_percent": float("inf"), "reset_at": 1e20}}}) == []
    assert sane_until(float("inf"), 10.0) == 10.0 + MAX_AHEAD and sane_until("x", 0.0) is None
    assert sane_epoch(1_704_069_000_000) == 1_704_069_000.0 and sane_epoch(-1) is None and sane_epoch(True) is None

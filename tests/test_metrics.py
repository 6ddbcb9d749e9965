"""The Prometheus metrics (codex_failover.metrics): counters and histograms move with the events, the
state gauges render from a status report, the listener serves GET /metrics only and stops, a failing
status report still gives a valid scrape, and no label carries a secret. In-process, no mitmproxy."""

import asyncio
import http.client
import socket
import string
import threading

import pytest
from conftest import Clock
from hypothesis import assume, given, settings, strategies as st
from prometheus_client.parser import text_string_to_metric_families

from codex_failover.core.auth import APIKEY, CHATGPT, AuthMaterial
from codex_failover.core.routes import RouteHealth, parse_endpoint
from codex_failover.core.seen_clients import label as client_label
from codex_failover.metrics import (
    FIRST_OUTPUT_BUCKETS,
    HIDDEN,
    HOLD_BUCKETS,
    Metrics,
    label,
    parse_address,
    route_state,
    snapshot_on_loop,
)

SECRET_KEY = "sk-proj-" + "A1b2C3d4" * 6


def report(**overrides) -> dict:
    """A status report shaped like FailoverAddon.status_report(), with usage windows."""
    doc = {
        "pool": "/x/pool.yaml",
        "credentials": [
            {"name": "primary", "kind": "chatgpt", "base_url": "https://chatgpt.com/backend-api/codex", "route": "direct",
             "state": "ready", "reason": None, "usage": "primary 12%",
             "usage_windows": [{"window": "primary", "used_percent": 12.0, "resets_at": 1_800_000_600.0},
                               {"window": "secondary", "used_percent": 3.5, "resets_at": None}]},
            {"name": "spare", "kind": "api_key", "base_url": "https://api.openai.com/v1", "route": "corp",
             "state": "cooling", "reason": "overloaded", "cooling_for_s": 41.5, "usage": "usage unknown"},
            {"name": "old", "kind": "chatgpt", "base_url": "https://chatgpt.com/backend-api/codex", "route": "direct",
             "state": "expired", "reason": "run `codex login` for this account", "usage": "usage unknown"},
        ],
        "clients": [{"label": "key #1a2b3c4d", "kind": "api_key", "seen_s_ago": 3, "state": "cooling",
                     "reason": "overloaded", "cooling_for_s": 9.0}],
        "routes": [{"endpoint": "corp[0] http://proxy-a.corp:3128", "state": "up"},
                   {"endpoint": "corp[1] http://proxy-b.corp:3128",
                    "state": "backing off 25s more (failed 2x: connection refused)"}],
        "held_requests": 4, "attempts_in_flight": 5, "relay_port": 40000, "relay_unclaimed": 1,
        "relay_streaming": 2, "recovery_buffering": 0,
        "websockets": [{"id": "w1", "credential": "primary", "route": "direct", "turns": 3, "moves": 1,
                        "holding": True, "open_s": 12.0},
                       {"id": "w2", "credential": None, "route": None, "turns": 0, "moves": 0,
                        "holding": False, "open_s": 0.1}],
    }
    doc.update(overrides)
    return doc


def samples(text: bytes) -> dict[tuple[str, tuple], float]:
    """Parsed exposition (this also checks the text is valid): {(name, sorted labels): value}."""
    out = {}
    for family in text_string_to_metric_families(text.decode()):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(metrics: Metrics, name: str, **labels) -> float | None:
    return metrics.registry.get_sample_value(name, labels)


# --- events ---------------------------------------------------------------------------------------


def test_attempt_and_exhausted_counters_move_by_their_labels():
    m = Metrics()
    m.attempt("primary", "failover", "overloaded")
    m.attempt("primary", "failover", "overloaded")
    m.attempt("spare", "commit", "output")
    m.attempt("key #1a2b3c4d", "failover", "usage_limit")
    m.exhausted(503)
    m.exhausted(503)
    m.exhausted(429)
    assert value(m, "codex_failover_attempts_total", credential="primary", verdict="failover", reason="overloaded") == 2
    assert value(m, "codex_failover_attempts_total", credential="spare", verdict="commit", reason="output") == 1
    assert value(m, "codex_failover_attempts_total", credential="key #1a2b3c4d", verdict="failover",
                 reason="usage_limit") == 1
    assert value(m, "codex_failover_exhausted_total", status="503") == 2
    assert value(m, "codex_failover_exhausted_total", status="429") == 1
    assert value(m, "codex_failover_exhausted_total", status="502") is None


def test_histograms_observe_into_their_buckets():
    m = Metrics()
    for seconds in (0.0005, 0.2, 45.0, 90.0):
        m.hold_seconds(seconds)
    m.first_output_to_client_seconds(0.00005)
    m.first_output_to_client_seconds(0.003)
    assert HOLD_BUCKETS[0] == 0.001
    assert HOLD_BUCKETS[-1] == 60.0
    assert FIRST_OUTPUT_BUCKETS[0] == 0.0001
    assert FIRST_OUTPUT_BUCKETS[-1] == 1.0
    assert value(m, "codex_failover_hold_seconds_count") == 4
    assert value(m, "codex_failover_hold_seconds_sum") == pytest.approx(135.2005)
    assert value(m, "codex_failover_hold_seconds_bucket", le="0.001") == 1
    assert value(m, "codex_failover_hold_seconds_bucket", le="0.25") == 2
    assert value(m, "codex_failover_hold_seconds_bucket", le="60.0") == 3
    assert value(m, "codex_failover_hold_seconds_bucket", le="+Inf") == 4
    assert value(m, "codex_failover_first_output_to_client_seconds_bucket", le="0.0001") == 1
    assert value(m, "codex_failover_first_output_to_client_seconds_bucket", le="0.0025") == 1
    assert value(m, "codex_failover_first_output_to_client_seconds_bucket", le="0.005") == 2


def test_event_methods_never_raise_on_odd_input():
    m = Metrics()
    m.hold_seconds("soon")
    m.hold_seconds(-1)  # a clock step: counted as 0
    m.first_output_to_client_seconds(None)
    m.exhausted("not a status")
    m.attempt(None, "commit", 7)
    assert value(m, "codex_failover_hold_seconds_count") == 1
    assert value(m, "codex_failover_hold_seconds_bucket", le="0.001") == 1
    assert value(m, "codex_failover_attempts_total", credential="", verdict="commit", reason="7") == 1


def test_each_instance_has_its_own_registry():
    a, b = Metrics(), Metrics()
    a.exhausted(503)
    assert value(a, "codex_failover_exhausted_total", status="503") == 1
    assert value(b, "codex_failover_exhausted_total", status="503") is None


# --- the state gauges -----------------------------------------------------------------------------


def test_state_gauges_render_from_the_status_report():
    got = samples(Metrics(lambda: report()).render())

    def g(name, **labels):
        return got.get((name, tuple(sorted(labels.items()))))

    assert g("codex_failover_snapshot_ok") == 1
    # one-hot over the states, for pooled credentials and the clients' own (by the status page's label)
    for cred, source, state in (("primary", "pool", "ready"), ("spare", "pool", "cooling"), ("old", "pool", "expired"),
                                ("key #1a2b3c4d", "client", "cooling")):
        row = {s: g("codex_failover_credential_state", credential=cred, source=source, state=s)
               for s in ("ready", "cooling", "out", "expired")}
        assert row == {s: (1.0 if s == state else 0.0) for s in row}, cred
    assert g("codex_failover_credential_cooldown_seconds", credential="spare", source="pool") == 41.5
    assert g("codex_failover_credential_cooldown_seconds", credential="key #1a2b3c4d", source="client") == 9.0
    assert g("codex_failover_credential_cooldown_seconds", credential="primary", source="pool") == 0
    assert g("codex_failover_usage_percent", credential="primary", window="primary") == 12.0
    assert g("codex_failover_usage_percent", credential="primary", window="secondary") == 3.5
    assert g("codex_failover_usage_resets_timestamp_seconds", credential="primary", window="primary") == 1_800_000_600.0
    assert g("codex_failover_usage_resets_timestamp_seconds", credential="primary", window="secondary") is None
    assert not [k for k in got if k[0] == "codex_failover_usage_percent" and ("credential", "spare") in k[1]]
    a, b = "corp[0] http://proxy-a.corp:3128", "corp[1] http://proxy-b.corp:3128"
    assert (g("codex_failover_route_endpoint_up", endpoint=a), g("codex_failover_route_endpoint_up", endpoint=b)) == (1, 0)
    assert g("codex_failover_route_endpoint_state", endpoint=b, state="backing_off") == 1
    assert g("codex_failover_route_endpoint_state", endpoint=b, state="up") == 0
    assert (g("codex_failover_route_endpoint_failures", endpoint=a), g("codex_failover_route_endpoint_failures", endpoint=b)) == (0, 2)
    assert g("codex_failover_streams_held") == 4
    assert g("codex_failover_streams_relayed") == 2
    assert g("codex_failover_relay_unclaimed") == 1
    assert g("codex_failover_attempts_in_flight") == 5
    assert g("codex_failover_recovery_buffering") == 0
    assert g("codex_failover_websockets_open") == 2
    assert g("codex_failover_websockets_holding") == 1


def test_the_exposition_text_quotes_the_client_label_as_is():
    text = Metrics(lambda: report()).render().decode()
    assert 'codex_failover_credential_state{credential="key #1a2b3c4d",source="client",state="cooling"} 1.0' in text


def test_route_states_follow_route_health_describe():
    clock = Clock()
    health = RouteHealth(floor=30, cap=300, clock=clock)
    ep = parse_endpoint("corp", 0, "http://user:pw@proxy.corp:3128")
    assert route_state(health.describe(ep)) == "up"
    health.failed(ep, "connection refused")
    health.failed(ep, "connection refused")
    assert route_state(health.describe(ep)) == "backing_off"
    clock.now += 3600
    assert route_state(health.describe(ep)) == "probe_due"
    assert health.claim(ep)
    assert route_state(health.describe(ep)) == "probing"
    got = samples(Metrics(lambda: report(routes=[{"endpoint": ep.label, "state": health.describe(ep)}])).render())
    assert got[("codex_failover_route_endpoint_up", (("endpoint", ep.label),))] == 0
    assert got[("codex_failover_route_endpoint_state", (("endpoint", ep.label), ("state", "probing")))] == 1
    assert got[("codex_failover_route_endpoint_failures", (("endpoint", ep.label),))] == 2
    assert route_state("something new") is None


def test_a_snapshot_that_raises_still_gives_a_valid_scrape():
    def broken():
        raise RuntimeError("dictionary changed size during iteration")

    m = Metrics(broken)
    m.attempt("spare", "commit", "output")
    got = samples(m.render())
    assert got[("codex_failover_snapshot_ok", ())] == 0
    assert got[("codex_failover_attempts_total", (("credential", "spare"), ("reason", "output"), ("verdict", "commit")))] == 1
    assert not [k for k in got if k[0].startswith("codex_failover_credential_")]


def test_entries_that_do_not_fit_are_skipped_and_the_rest_still_count():
    doc = report(credentials=[{"kind": "api_key"}, "nonsense", {"name": "spare", "state": "ready"}],
                 routes=[None, {"endpoint": "corp[0] http://a:1", "state": "up"}], held_requests="many",
                 websockets="?")
    got = samples(Metrics(lambda: doc).render())
    assert got[("codex_failover_snapshot_ok", ())] == 1
    assert got[("codex_failover_credential_state", (("credential", "spare"), ("source", "pool"), ("state", "ready")))] == 1
    assert got[("codex_failover_route_endpoint_up", (("endpoint", "corp[0] http://a:1"),))] == 1
    assert ("codex_failover_streams_held", ()) not in got
    assert ("codex_failover_websockets_open", ()) not in got
    assert samples(Metrics(lambda: ["not", "a", "dict"]).render())[("codex_failover_snapshot_ok", ())] == 0


def test_the_snapshot_can_be_set_after_construction():
    m = Metrics()
    assert samples(m.render())[("codex_failover_snapshot_ok", ())] == 0
    m.snapshot = lambda: report()
    assert samples(m.render())[("codex_failover_streams_held", ())] == 4


# --- no secret in a label -------------------------------------------------------------------------


NAMES = st.text(string.ascii_lowercase + string.digits + "_-", min_size=1, max_size=20)


@settings(max_examples=60, deadline=None)
@given(names=st.lists(NAMES, min_size=1, max_size=4), reasons=st.lists(NAMES, min_size=1, max_size=3),
       key=st.text(string.ascii_letters + string.digits, min_size=20, max_size=60),
       account=st.text(string.ascii_letters + string.digits + "-", min_size=8, max_size=40))
def test_no_label_carries_a_secret_when_fed_names(names, reasons, key, account):
    assume(not any(account in n or key in n for n in names + reasons))  # names, not secrets
    secret, token = "sk-" + key, "eyJ" + key
    clients = [AuthMaterial(APIKEY, secret), AuthMaterial(CHATGPT, token, account_id=account)]
    ep = parse_endpoint("corp", 0, f"http://user:{secret}@proxy.corp:3128")
    doc = report(credentials=[{"name": n, "state": "cooling", "cooling_for_s": 3,
                               "usage_windows": [{"window": "primary", "used_percent": 50}]} for n in names],
                 clients=[{"label": client_label(a), "state": "ready"} for a in clients],
                 routes=[{"endpoint": ep.label, "state": "up"}])
    m = Metrics(lambda: doc)
    for n in names:
        for r in reasons:
            m.attempt(n, "failover", r)
    m.attempt(client_label(clients[0]), "commit", "output")
    text = m.render().decode()
    assert secret not in text
    assert token not in text
    values = {v for family in text_string_to_metric_families(text) for s in family.samples for v in s.labels.values()}
    assert {"key #" + clients[0].fingerprint[:8], "account …" + account[-4:]} <= values
    for v in values:
        assert not v.startswith("sk-"), v
        assert " sk-" not in v, v
        assert account not in v, v
        assert key not in v, v


def test_a_secret_passed_by_mistake_is_not_shown():
    m = Metrics(lambda: report(credentials=[{"name": SECRET_KEY, "state": "ready"}],
                               clients=[{"label": "Bearer " + SECRET_KEY, "state": "ready"}]))
    m.attempt(SECRET_KEY, "failover", "overloaded")
    text = m.render().decode()
    assert "sk-" not in text
    assert f'credential="{HIDDEN}"' in text
    assert label("key #1a2b3c4d") == "key #1a2b3c4d"
    assert label("corp[1] http://proxy-b.corp:3128") == "corp[1] http://proxy-b.corp:3128"


# --- the address ----------------------------------------------------------------------------------


@pytest.mark.parametrize("address, expected", [
    ("127.0.0.1:9464", ("127.0.0.1", 9464)),
    ("  127.0.0.1:9464 ", ("127.0.0.1", 9464)),
    ("[::1]:9464", ("::1", 9464)),
    ("9464", ("127.0.0.1", 9464)),
    ("localhost:0", ("127.0.0.1", 0)),
    ("0.0.0.0:9464", ("0.0.0.0", 9464)),
    ("10.0.0.5:65535", ("10.0.0.5", 65535)),
])
def test_addresses_parse(address, expected):
    assert parse_address(address) == expected


@pytest.mark.parametrize("address, problem", [
    ("", "empty"),
    ("metrics", "HOST:PORT"),
    (":9464", "name the address"),
    ("127.0.0.1:", "port"),
    ("127.0.0.1:x", "port"),
    ("127.0.0.1:70000", "port"),
    ("127.0.0.1:-1", "port"),
    ("::1:9464", "brackets"),
    ("[::1]9464", "[IPV6]:PORT"),
    ("[::1", "[IPV6]:PORT"),
    ("metrics.example:9464", "IP address or localhost"),
    ("999.0.0.1:9464", "IP address or localhost"),
])
def test_bad_addresses_name_the_option(address, problem):
    with pytest.raises(ValueError) as raised:
        parse_address(address)
    assert str(raised.value).startswith("failover_metrics: ")
    assert problem in str(raised.value)


# --- the listener ---------------------------------------------------------------------------------


@pytest.fixture
def served():
    m = Metrics(lambda: report())
    server = m.serve("127.0.0.1:0")
    yield m, server
    server.stop()


def request(server, method="GET", path="/metrics", host=None, headers=None):
    conn = http.client.HTTPConnection(server.host, server.port, timeout=5)
    try:
        if host is not None:
            conn.putrequest(method, path, skip_host=True)
            conn.putheader("Host", host)
            for k, v in (headers or {}).items():
                conn.putheader(k, v)
            conn.endheaders()
        else:
            conn.request(method, path, headers=headers or {})
        resp = conn.getresponse()
        return resp.status, dict(resp.getheaders()), resp.read()
    finally:
        conn.close()


def test_a_scrape_over_http_returns_the_series(served):
    m, server = served
    m.attempt("spare", "failover", "overloaded")
    assert server.port > 0
    assert server.url == f"http://127.0.0.1:{server.port}/metrics"
    status, headers, body = request(server)
    assert status == 200
    assert headers["Content-Type"].startswith("text/plain; version=")
    got = samples(body)
    assert got[("codex_failover_attempts_total", (("credential", "spare"), ("reason", "overloaded"), ("verdict", "failover")))] == 1
    assert got[("codex_failover_credential_state", (("credential", "key #1a2b3c4d"), ("source", "client"), ("state", "cooling")))] == 1
    assert request(server, path="/metrics?name[]=x")[0] == 200


@pytest.mark.parametrize("path", ["/", "/metrics/", "/metricsx", "/status", "/r/token", "/metrics/../x",
                                  "http://127.0.0.1/metrics"])
def test_other_paths_are_404(served, path):
    status, _, body = request(served[1], path=path, host="127.0.0.1")
    assert status == 404
    assert b"codex_failover" not in body


@pytest.mark.parametrize("method", ["POST", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD", "TRACE"])
def test_other_methods_are_405(served, method):
    status, headers, body = request(served[1], method=method)
    assert status == 405
    assert headers["Allow"] == "GET"
    assert b"codex_failover" not in body


def test_an_unknown_method_is_refused(served):
    assert request(served[1], method="BREW")[0] == 501


@pytest.mark.parametrize("host, status", [
    ("attacker.example:9464", 403), ("attacker.example", 403),
    ("localhost:9464", 200), ("127.0.0.1", 200), ("[::1]:9464", 200), ("LOCALHOST", 200),
])
def test_a_loopback_listener_refuses_other_host_names(served, host, status):
    assert request(served[1], host=host)[0] == status


def test_a_scrape_with_a_broken_snapshot_is_200_and_valid():
    m = Metrics(lambda: 1 / 0)
    server = m.serve("127.0.0.1:0")
    try:
        m.exhausted(503)
        status, _, body = request(server)
        assert status == 200
        got = samples(body)
        assert got[("codex_failover_snapshot_ok", ())] == 0
        assert got[("codex_failover_exhausted_total", (("status", "503"),))] == 1
    finally:
        server.stop()


def test_the_server_stops_and_frees_its_port():
    server = Metrics().serve("127.0.0.1:0")
    port = server.port
    assert request(server)[0] == 200
    server.stop()
    server.stop()  # idempotent
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    again = Metrics().serve(f"127.0.0.1:{port}")  # the port can be bound again at once
    try:
        assert again.port == port
    finally:
        again.stop()


def test_binding_a_taken_port_raises_oserror(served):
    with pytest.raises(OSError):
        Metrics().serve(f"127.0.0.1:{served[1].port}")


def test_ipv6_loopback():
    if not socket.has_ipv6:
        pytest.skip("no IPv6")
    try:
        server = Metrics().serve("[::1]:0")
    except OSError:
        pytest.skip("no IPv6 loopback here")
    try:
        assert server.url == f"http://[::1]:{server.port}/metrics"
        assert request(server)[0] == 200
    finally:
        server.stop()


# --- the snapshot on the event loop -----------------------------------------------------------------


def test_snapshot_on_loop_runs_on_the_loop_thread():
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        seen = []
        call = snapshot_on_loop(loop, lambda: seen.append(threading.current_thread()) or report())
        server = Metrics(call).serve("127.0.0.1:0")
        try:
            status, _, body = request(server)
        finally:
            server.stop()
        assert status == 200, body[:300]
        assert samples(body)[("codex_failover_streams_held", ())] == 4
        assert seen == [thread]
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
        loop.close()


def test_snapshot_on_loop_gives_up_when_the_loop_does_not_run_it():
    loop = asyncio.new_event_loop()  # never run
    try:
        m = Metrics(snapshot_on_loop(loop, report, timeout=0.05))
        assert samples(m.render())[("codex_failover_snapshot_ok", ())] == 0
    finally:
        loop.close()
    assert samples(m.render())[("codex_failover_snapshot_ok", ())] == 0  # closed: no wait at all


def test_snapshot_on_loop_called_on_the_loop_itself_does_not_wait():
    async def scrape():
        return Metrics(snapshot_on_loop(asyncio.get_running_loop(), report, timeout=5)).render()

    assert samples(asyncio.run(scrape()))[("codex_failover_snapshot_ok", ())] == 1


def test_the_listener_answers_only_peers_the_pool_rule_allows():
    import urllib.error
    import urllib.request

    from codex_failover.metrics import Metrics

    server = Metrics().serve("127.0.0.1:0", allows=lambda peer: False)
    try:
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=5)
        assert refused.value.code == 403
    finally:
        server.stop()

"""The client boundary's shell (mitm/boundary.py): a connection's owner is looked up once per
connection, not per request, and forgotten when it closes; the rule follows --proxyauth."""

from __future__ import annotations

from mitmproxy import connection
from mitmproxy.test import taddons, tflow

from codex_failover.core.client_boundary import TOKEN, UID, RejectedKeys
from codex_failover.mitm.boundary import ClientBoundary

HEAD = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n"
# 127.0.0.1:50000 -> 127.0.0.1:8080, of uid 1000; 127.0.0.1:50001 -> :8080, of uid 1001.
TCP = (HEAD + "  0: 0100007F:C350 0100007F:1F90 01 00000000:00000000 00:00000000 00000000  1000 0 1 1\n"
       + "  1: 0100007F:C351 0100007F:1F90 01 00000000:00000000 00:00000000 00000000  1001 0 2 1\n")


def client(port: int, host: str = "127.0.0.1") -> connection.Client:
    return connection.Client(peername=(host, port), sockname=("127.0.0.1", 8080), timestamp_start=0)


def boundary() -> tuple[ClientBoundary, list[int]]:
    reads = []

    def listings():
        reads.append(1)
        return [TCP]

    found = ClientBoundary(listings, proxy_uid=1000)
    found.rule = UID
    return found, reads


def test_the_owner_is_read_once_per_connection_and_forgotten_when_it_closes():
    found, reads = boundary()
    mine, theirs = client(50000), client(50001)
    assert [found.is_own(mine) for _ in range(5)] == [True] * 5
    assert found.is_own(theirs) is False and found.is_own(theirs) is False
    assert len(reads) == 2
    found.client_disconnected(mine)
    assert found.is_own(mine) is True and len(reads) == 3


def test_another_machine_is_not_looked_up():
    found, reads = boundary()
    assert found.is_own(client(50000, "10.0.0.5")) is True and reads == []  # failover_clients let it in


def test_a_browser_another_user_and_a_refused_key_are_passed_through():
    found, _ = boundary()
    from codex_failover.core.auth import auth_from_headers

    auth = auth_from_headers({"authorization": "Bearer sk-x"})
    flow = tflow.tflow()
    flow.client_conn = client(50000)
    assert found.passed_by(flow, auth) is None
    flow.request.headers["Sec-Fetch-Mode"] = "cors"
    assert found.passed_by(flow, auth) == "browser"
    del flow.request.headers["Sec-Fetch-Mode"]
    found.rejected.refused(auth.fingerprint)
    assert found.passed_by(flow, auth) == "refused_key"
    flow.client_conn = client(50001)
    assert found.passed_by(flow, auth) == "other_user"


def test_proxyauth_makes_it_the_token_rule():
    found, reads = boundary()
    from mitmproxy.addons.proxyauth import ProxyAuth

    with taddons.context(ProxyAuth(), found) as tctx:
        tctx.options.update(proxyauth="me:token")
        found.apply_options({"proxyauth"})  # (from the addon's own configure: not a hook of its own)
        assert found.rule == TOKEN
        assert found.is_own(client(50001)) is True and reads == []


def test_a_refused_key_the_upstream_serves_again_is_forgotten():
    from mitmproxy.test import tutils

    from codex_failover.core.auth import auth_from_headers

    found, _ = boundary()
    auth = auth_from_headers({"authorization": "Bearer sk-x"})
    found.rejected.refused(auth.fingerprint)
    flow = tflow.tflow()
    flow.client_conn = client(50000)
    flow.request.headers["authorization"] = "Bearer sk-x"
    assert found.passed_by(flow, auth) == "refused_key"
    now = [0.0]
    found.rejected = RejectedKeys(keep=60, clock=lambda: now[0])
    found.rejected.refused(auth.fingerprint)
    now[0] = 50
    flow.response = tutils.tresp(status_code=401)
    found.response(flow)
    now[0] = 100
    assert auth.fingerprint in found.rejected  # refused again at 50: remembered from then
    flow.response = tutils.tresp(status_code=200)
    found.response(flow)
    assert auth.fingerprint not in found.rejected

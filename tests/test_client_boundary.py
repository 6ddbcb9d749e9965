"""Unit tests: whose requests may be lent the pool (core/client_boundary.py, core/pool_reach.py,
affinity keys). Pure, no I/O."""

from __future__ import annotations

import pytest

from codex_failover.config import parse_pool
from codex_failover.core.affinity import Affinity, affinity_key
from codex_failover.core.auth import auth_from_document, auth_from_headers
from codex_failover.core.client_boundary import (
    ANYONE,
    TOKEN,
    UID,
    RejectedKeys,
    SocketEntry,
    browser_sign,
    describe_rule,
    is_own,
    owner_uid,
    parse_proc_net_tcp,
    rule_for,
)
from codex_failover.core.pool_reach import unreachable

HEAD = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n"


def row(n: int, local: str, remote: str, uid: int, state: str = "01") -> str:
    return (f"  {n}: {local} {remote} {state} 00000000:00000000 00:00000000 00000000 {uid:>5}        0 22635 2 "
            "00000000af8c32b4 20 0 0\n")


# As the kernel lists them (captured on x86-64): a client at 127.0.0.1:60988 of the proxy at :36633
# on a dual-stack listener (the proxy's end is IPv4-mapped in tcp6), and one over ::1.
TCP = HEAD + row(0, "0100007F:1F90", "00000000:0000", 0, "0A") + row(1, "0100007F:EE3C", "0100007F:8F19", 1000)
TCP6 = (HEAD
        + row(0, "00000000000000000000000000000000:8F19", "00000000000000000000000000000000:0000", 0, "0A")
        + row(1, "0000000000000000FFFF00000100007F:8F19", "0000000000000000FFFF00000100007F:EE3C", 0)
        + row(2, "00000000000000000000000001000000:BEFD", "00000000000000000000000001000000:C140", 0)
        + row(3, "00000000000000000000000001000000:C140", "00000000000000000000000001000000:BEFD", 65534))


def test_the_parser_reads_addresses_ports_and_owners():
    assert list(parse_proc_net_tcp(TCP)) == [
        SocketEntry(("127.0.0.1", 8080), ("0.0.0.0", 0), 0),
        SocketEntry(("127.0.0.1", 60988), ("127.0.0.1", 36633), 1000),
    ]
    entries = list(parse_proc_net_tcp(TCP6))
    assert entries[1] == SocketEntry(("127.0.0.1", 36633), ("127.0.0.1", 60988), 0)  # mapped comes out as IPv4
    assert entries[3] == SocketEntry(("::1", 49472), ("::1", 48893), 65534)


def test_the_parser_follows_the_kernels_byte_order():
    big = HEAD + row(0, "7F000001:1F90", "7F000001:C140", 7)
    assert list(parse_proc_net_tcp(big, "big")) == [SocketEntry(("127.0.0.1", 8080), ("127.0.0.1", 49472), 7)]


@pytest.mark.parametrize("text", [
    "",
    HEAD,
    HEAD + "garbage\n",
    HEAD + "  0: 0100007F 0100007F:8F19 01 0 0 0 1000\n",  # no port
    HEAD + "  0: 0100007:EE3C 0100007F:8F19 01 0 0 0 1000\n",  # 7 hex digits
    HEAD + "  0: 0100007F:EE3C 0100007F:8F19 01 0 0 0 uid\n",
    HEAD + "  0: 0100007F:ZZZZ 0100007F:8F19 01 0 0 0 1000\n",
])
def test_malformed_lines_are_skipped(text):
    assert list(parse_proc_net_tcp(text)) == []


@pytest.mark.parametrize("client, server, uid", [
    (("127.0.0.1", 60988), ("127.0.0.1", 36633), 1000),  # the client's end, not the proxy's mirror image
    (("::ffff:127.0.0.1", 60988), ("::ffff:127.0.0.1", 36633), 1000),  # as a dual-stack listener sees it
    (("127.0.0.1", 36633), ("127.0.0.1", 60988), 0),  # the proxy's own end (its uid)
    (("::1", 49472), ("::1", 48893), 65534),
    (("::1", 49472), ("::1", 1), None),  # another connection
    (("127.0.0.1", 60989), ("127.0.0.1", 36633), None),  # gone: not found
    (("not-an-ip", 1), ("127.0.0.1", 36633), None),
])
def test_owner_of_a_client_socket(client, server, uid):
    assert owner_uid([TCP, TCP6], client, server) == uid


@pytest.mark.parametrize("rule, loopback, client_uid, own", [
    (UID, True, 1000, True),
    (UID, True, 1001, False),
    (UID, True, None, False),  # not found: not lent the pool
    (UID, False, None, True),  # another machine: failover_clients let it in
    (TOKEN, True, 1001, True),  # it showed the proxy token
    (ANYONE, True, None, True),
])
def test_who_is_the_users_own(rule, loopback, client_uid, own):
    assert is_own(rule, loopback, client_uid, 1000) is own


def test_the_rule_in_force_and_its_line():
    assert rule_for("me:secret", True) == TOKEN
    assert rule_for(None, True) == UID
    assert rule_for("", False) == ANYONE
    assert "uid 1000" in describe_rule(UID, 1000)
    assert "--proxyauth" in describe_rule(TOKEN, 1000) and "--proxyauth" in describe_rule(ANYONE, 1000)
    assert "secret" not in describe_rule(rule_for("me:secret", True), 0)


CODEX = {"authorization": "Bearer sk-x", "content-type": "application/json", "accept": "text/event-stream",
         "session-id": "s", "originator": "codex_cli_rs", "user-agent": "codex_cli_rs/0.50.0"}


@pytest.mark.parametrize("extra, sign", [
    ({}, None),  # what Codex sends
    ({"Origin": "https://evil.example"}, "origin"),
    ({"origin": "null"}, "origin"),  # a sandboxed frame or a file: page
    ({"Sec-Fetch-Mode": "cors"}, "sec-fetch-mode"),
    ({"sec-fetch-site": "cross-site"}, "sec-fetch-site"),
    ({"Sec-Fetch-Dest": "empty"}, "sec-fetch-dest"),
    ({"Sec-Fetch-Storage-Access": "none"}, "sec-fetch-storage-access"),  # any Sec-Fetch-*
    ({"Referer": "https://evil.example/"}, None),  # not a browser's mark on its own
    ({"X-Origin": "a"}, None),
])
def test_a_browser_request_is_known_by_its_headers(extra, sign):
    from mitmproxy.http import Headers  # the headers type the hook hands over (case-insensitive)

    headers = Headers(**{k.replace("-", "_"): v for k, v in {**CODEX, **extra}.items()})
    assert browser_sign(headers) == sign
    assert browser_sign({k.lower(): v for k, v in {**CODEX, **extra}.items()}) == sign


def test_refused_keys_are_remembered_bounded_and_forgotten():
    now = [0.0]
    keys = RejectedKeys(keep=60, max_keys=2, clock=lambda: now[0])
    keys.refused("a")
    assert "a" in keys and "b" not in keys
    now[0] = 30
    keys.refused("b")
    now[0] = 50
    keys.refused("a")  # refused again: kept from now
    now[0] = 70
    assert "a" in keys and "b" in keys
    now[0] = 91
    assert "b" not in keys and "a" in keys
    keys.refused("c")
    keys.refused("d")  # over the bound: the oldest goes
    assert len(keys) == 2 and "a" not in keys
    keys.accepted("c")
    assert "c" not in keys and "d" in keys


def test_affinity_is_filed_under_the_key_and_the_session():
    mine, theirs = auth_from_headers({"authorization": "Bearer sk-mine"}), auth_from_headers({"authorization": "Bearer sk-theirs"})
    affinity = Affinity()
    affinity.set(affinity_key(mine.fingerprint, "thread-1"), "spare")
    assert affinity.get(affinity_key(mine.fingerprint, "thread-1")) == "spare"
    assert affinity.get(affinity_key(theirs.fingerprint, "thread-1")) is None
    assert affinity_key(None, "thread-1") is None and affinity_key(mine.fingerprint, None) is None
    assert "sk-mine" not in affinity_key(mine.fingerprint, "thread-1")


API = auth_from_headers({"authorization": "Bearer sk-client"})
CHATGPT = auth_from_document({"tokens": {"access_token": "a.b.c", "account_id": "acct-1"}}, "test")


@pytest.mark.parametrize("kinds, policy, client, movable, says", [
    ([("work", "chatgpt")], {"use_client_credential": False}, API, True, "no pooled credential serves API-key requests"),
    ([("work", "chatgpt")], {"use_client_credential": False, "cross_kind": True}, API, True, None),
    ([("work", "chatgpt")], {"use_client_credential": True}, API, True, None),  # its own goes
    ([("work", "chatgpt")], {"use_client_credential": False}, API, False, None),  # pinned: its own goes
    ([("work", "chatgpt")], {"use_client_credential": False}, CHATGPT, True, None),
    ([("spare", "key")], {"use_client_credential": False}, CHATGPT, True, "serves ChatGPT-login requests"),
    ([], {"use_client_credential": False}, API, True, None),  # no pool: its own goes
])
def test_a_request_kind_the_pool_has_nothing_for(kinds, policy, client, movable, says, tmp_path):
    creds, env = [], {}
    for name, kind in kinds:
        if kind == "key":
            creds.append({"name": name, "api_key_env": f"K_{name.upper()}"})
            env[f"K_{name.upper()}"] = "sk-pooled-" + name
        else:
            (tmp_path / f"{name}.json").write_text('{"tokens": {"access_token": "x.y.z", "account_id": "acct-9"}}')
            creds.append({"name": name, "auth_file": str(tmp_path / f"{name}.json")})
    pool = parse_pool({"credentials": creds, "policy": policy}, "pool.yaml", env, tmp_path)
    why = unreachable(client, pool, movable)
    assert (why is None) if says is None else (says in why), why


@pytest.mark.parametrize("headers, refused", [
    ({"x-codex-failover": "1"}, False),
    ({"x-codex-failover": "1", "origin": "http://codex-failover.status", "sec-fetch-site": "same-origin"}, False),
    ({"x-codex-failover": "1", "sec-fetch-site": "none"}, False),
    ({}, True),  # a form or a no-cors fetch cannot add the header
    ({"x-codex-failover": "0"}, True),
    ({"x-codex-failover": "1", "origin": "http://evil.example"}, True),
    ({"x-codex-failover": "1", "origin": "null"}, True),
    ({"x-codex-failover": "1", "sec-fetch-site": "cross-site"}, True),
    ({"x-codex-failover": "1", "sec-fetch-site": "same-site"}, True),
])
def test_status_write_refusal(headers, refused):
    from codex_failover.core.client_boundary import status_write_refusal

    assert (status_write_refusal(headers) is not None) is refused

"""End to end: what mitmweb's API serves and what `-w` saves is whole, tells each attempt's verdict,
and never holds a secret, at any moment (issue 13). The browser's view is tests/test_mitmweb_browser.py."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time

import pytest
from harness import (
    MITMDUMP,
    FakeUpstreamProcess,
    MitmwebProcess,
    ProxyProcess,
    pool_yaml,
    post_responses,
    proxy_status,
    read_until,
    start_raw_post,
    wait_until,
)
from mitmproxy import io

pytestmark = pytest.mark.e2e

# Keys the fake does not echo (it names non-`sk-test` keys by a hash): any trace of them is a leak.
CLIENT_KEY = "sk-proj-CLIENTSECRET1-overload"
ACCOUNT = "acct-SECRETACCOUNT9"


def spare_pool(fake, spare_key: str) -> tuple[str, dict]:
    return pool_yaml(fake.base, [("spare", spare_key)], cross_kind=True)  # the client sends an account id too


def assert_no_secret(data: bytes, *secrets: str) -> None:
    for secret in secrets:
        assert secret.encode() not in data, f"{secret} leaked"



def test_mitmweb_api_shows_each_attempt_whole_and_secret_free(tmp_path):
    fake = FakeUpstreamProcess(tmp_path)
    spare_key = "sk-proj-SPARESECRET2-good"
    text, env = spare_pool(fake, spare_key)
    web = MitmwebProcess(tmp_path / "web", text, env)
    try:
        reply = post_responses(web.port, f"{fake.base}/v1/responses", CLIENT_KEY,
                               headers={"chatgpt-account-id": ACCOUNT, "cookie": "session=COOKIESECRET3"})
        assert reply.status == 200, reply.body[:300]
        assert reply.events()[-1]["type"] == "response.completed"
        flows = wait_until(lambda: [f for f in web.api("/flows") if f.get("response")] if len(web.api("/flows")) == 3
                         else None, what="three flows with responses")
        client = next(f for f in flows if not f["is_replay"])
        loser, winner = sorted((f for f in flows if f["is_replay"]), key=lambda f: f["comment"])
        assert client["comment"].splitlines()[0] == "failover: 2 attempts, served by spare after overloaded"
        assert loser["marked"] == "❌"
        assert loser["error"]["msg"] == "codex-failover: rejected: overloaded"
        assert "attempt 1/2: client via direct: failover (overloaded)" in loser["comment"]
        assert winner["marked"] == "✅"
        assert winner.get("error") is None
        assert "attempt 2/2: spare via direct: commit (output)" in winner["comment"]
        for flow in flows:  # every flow's body is served, the rejection included
            body = web.api(f"/flows/{flow['id']}/response/content.data", raw=True)
            assert body, flow["id"]
        rejected = web.api(f"/flows/{loser['id']}/response/content.data", raw=True)
        assert b"server_is_overloaded" in rejected
        assert rejected.rstrip().endswith(b"}")
        dump = web.api("/flows/dump", raw=True)
        assert_no_secret(dump + str(flows).encode(), CLIENT_KEY, spare_key, ACCOUNT, "COOKIESECRET3")
        assert b"<redacted by codex-failover>" in dump
    finally:
        web.stop()
        fake.stop()


def test_w_file_written_at_sigint_mid_stream_is_whole_and_secret_free(tmp_path):
    fake = FakeUpstreamProcess(tmp_path, "--stall", "30")
    spare_key = "sk-proj-SPARESECRET2-stall-after-output"  # streams one delta, then waits
    text, env = spare_pool(fake, spare_key)
    saved = tmp_path / "flows.mitm"
    proxy = ProxyProcess(tmp_path / "proxy", text, env, extra=["-w", str(saved)])
    sock = start_raw_post(proxy.port, f"{fake.base}/v1/responses", CLIENT_KEY)
    try:
        read_until(sock, b"reasoning_summary_text.delta")  # the turn is streaming to the client now
        os.kill(proxy.proc.pid, signal.SIGINT)
        proxy.proc.wait(timeout=15)
    finally:
        sock.close()
        proxy.stop()
        fake.stop()
    log = proxy.log()
    assert "unserializable" not in log, log
    assert "Traceback" not in log, log
    data = saved.read_bytes()
    assert_no_secret(data, CLIENT_KEY, spare_key)
    with open(saved, "rb") as fh:
        flows = list(io.FlowReader(fh).stream())  # readable to the end
    comments = [f.comment for f in flows]
    assert any("attempt 1/2: client via direct: failover (overloaded)" in c for c in comments), comments
    assert any("attempt 2/2: spare via direct: commit (output)" in c for c in comments), comments
    marks = sorted(f.marked for f in flows if f.is_replay)
    assert marks == [":white_check_mark:", ":x:"], marks


def test_w_file_written_while_an_attempt_waits_for_headers_holds_no_secret(tmp_path):
    fake = FakeUpstreamProcess(tmp_path, "--stall", "30")
    spare_key = "sk-proj-SPARESECRET2-stall-headers"  # the response head never comes (within the test)
    text, env = spare_pool(fake, spare_key)
    saved = tmp_path / "flows.mitm"
    proxy = ProxyProcess(tmp_path / "proxy", text, env, extra=["-w", str(saved)])
    sock = start_raw_post(proxy.port, f"{fake.base}/v1/responses", CLIENT_KEY)
    try:
        wait_until(lambda: len(fake.model_requests()) == 2, what="the spare's attempt to reach the fake")
        time.sleep(0.2)  # the attempt now waits for its response head
        os.kill(proxy.proc.pid, signal.SIGTERM)
        proxy.proc.wait(timeout=15)
    finally:
        sock.close()
        proxy.stop()
        fake.stop()
    assert [r["credential"] for r in fake.model_requests()][1].startswith("tok-")  # the real key went out
    assert saved.exists()
    assert_no_secret(saved.read_bytes(), CLIENT_KEY, spare_key)


def test_mitmweb_never_shows_a_secret_while_an_attempt_waits_for_headers(tmp_path):
    fake = FakeUpstreamProcess(tmp_path, "--stall", "30")
    spare_key = "sk-proj-SPARESECRET2-stall-headers"
    text, env = spare_pool(fake, spare_key)
    web = MitmwebProcess(tmp_path / "web", text, env)
    sock = start_raw_post(web.port, f"{fake.base}/v1/responses", CLIENT_KEY)
    try:
        wait_until(lambda: len(fake.model_requests()) == 2, what="the spare's attempt to reach the fake")
        time.sleep(0.2)
        flows = web.api("/flows", raw=True)
        dump = web.api("/flows/dump", raw=True)
        assert b"attempt 1/2: client via direct: failover (overloaded)" in flows  # the loser is shown already
        assert_no_secret(flows + dump, CLIENT_KEY, spare_key)
    finally:
        sock.close()
        web.stop()
        fake.stop()


def test_status_lists_the_clients_own_credential_by_a_non_secret_label(fake, tmp_path):
    import hashlib
    import http.client
    import json

    text, env = spare_pool(fake, "sk-proj-SPARESECRET2-good")
    proxy = ProxyProcess(tmp_path / "proxy", text, env)
    try:
        assert post_responses(proxy.port, f"{fake.base}/v1/responses", CLIENT_KEY).status == 200
        conn = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=10)
        conn.request("GET", "http://codex-failover.status/")
        body = conn.getresponse().read()
        conn.close()
    finally:
        proxy.stop()
    clients = json.loads(body)["clients"]
    label = f"key #{hashlib.sha256(CLIENT_KEY.encode()).hexdigest()[:8]}"
    assert [(c["label"], c["state"], c["reason"]) for c in clients] == [(label, "cooling", "overloaded")]
    assert_no_secret(body, CLIENT_KEY, "SPARESECRET2")


def test_the_next_request_shows_the_clients_own_credential_skipped_while_cooling(tmp_path):
    import re

    fake = FakeUpstreamProcess(tmp_path)
    text, env = spare_pool(fake, "sk-proj-SPARESECRET2-good")
    web = MitmwebProcess(tmp_path / "web", text, env)
    try:
        url = f"{fake.base}/v1/responses"
        assert post_responses(web.port, url, CLIENT_KEY).status == 200
        assert post_responses(web.port, url, CLIENT_KEY).status == 200  # straight to the spare
        clients = wait_until(lambda: [f for f in web.api("/flows") if not f["is_replay"] and f.get("response")]
                           if len([f for f in web.api("/flows") if not f["is_replay"]]) == 2 else None,
                           what="two client flows")
        second = max(clients, key=lambda f: f["request"]["timestamp_start"])["comment"].splitlines()
        assert second[0] == "failover: 1 attempt, served by spare", second
        assert re.fullmatch(r"• client: skipped, cooling until \d\d:\d\d:\d\d \(overloaded\)", second[-1]), second
    finally:
        web.stop()
        fake.stop()


def test_a_silent_proxy_route_shows_no_secret_and_fails_over_before_dispatch(tmp_path):
    """Plain-http upstream behind an HTTP proxy that never answers CONNECT: while the attempt waits,
    mitmweb shows only the placeholder; at connect_timeout it is a pre-dispatch failure, and the
    next credential serves (the proxy's TCP being up is not "connected")."""
    from harness import LocalProxies

    fake = FakeUpstreamProcess(tmp_path)
    local = LocalProxies()
    try:
        silent = local.http_proxy("silent", mode="silent")
        text, env = pool_yaml(fake.base, [("a", "sk-proj-SECRETVIAPROXY-good", "corp"), ("b", "sk-test-b-good")],
                              {"corp": [f"http://127.0.0.1:{silent}"]}, use_client_credential=False,
                              connect_timeout="2s")
        web = MitmwebProcess(tmp_path / "web", text, env)
        try:
            sock = start_raw_post(web.port, f"{fake.base}/v1/responses", "sk-test-client-good", timeout=15)
            wait_until(lambda: local.connections["silent"] == 1, what="the attempt to reach the silent proxy")
            time.sleep(0.5)
            assert_no_secret(web.api("/flows", raw=True) + web.api("/flows/dump", raw=True), "SECRETVIAPROXY")
            sock.settimeout(15)
            head = sock.recv(65536)
            sock.close()
            assert head.startswith(b"HTTP/1.1 200"), head[:200]
            # The winner's log line follows its first output to the client (architecture.md#the-held-stream).
            log = wait_until(lambda: web.log() if "verdict=commit" in web.log() else None, what="the commit's log line")
            assert "credential=a route=corp[0]" in log, log
            assert "reason=pre_dispatch" in log, log
            assert "credential=b" in log, log[-2000:]
        finally:
            web.stop()
    finally:
        local.close()
        fake.stop()


@pytest.mark.parametrize("spare", ["good", "spaced"])
def test_a_winner_whose_client_closes_right_after_the_answer_shows_no_error(tmp_path, spare):
    """Codex over HTTP/2 resets its stream as soon as response.completed arrives, before the
    upstream's last chunk: the winner still delivered its whole answer, so it shows no error.
    `spaced`: the events' JSON has spaces (`"type": "response.completed"`) and the upstream keeps
    the stream open after its last event, so the reset always cancels the winner."""
    import struct

    fake = FakeUpstreamProcess(tmp_path, "--pace", "0.05", "--deltas", "3")
    text, env = spare_pool(fake, f"sk-proj-SPARESECRET2-{spare}")
    web = MitmwebProcess(tmp_path / "web", text, env)
    try:
        sock = start_raw_post(web.port, f"{fake.base}/v1/responses", CLIENT_KEY, timeout=15)
        read_until(sock, b'response.completed"')
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # a reset, at once
        sock.close()
        winner = wait_until(lambda: next((f for f in web.api("/flows") if f.get("marked") == "✅"
                                        and f.get("response", {}).get("timestamp_end")), None),
                          what="the winner to end")
        assert winner.get("error") is None, winner.get("error")
    finally:
        web.stop()
        fake.stop()


SPY = r'''
import json, os

SECRETS = json.loads(os.environ["SPY_SECRETS"])


def _look(hook, flow):
    if "codex_failover.attempt" not in flow.metadata:
        return  # the client's own flow: what the client sent, before the addon's request hook
    seen = [n for n, v in flow.request.headers.items(multi=True) if any(s in v for s in SECRETS)]
    if seen:
        with open(os.environ["SPY_OUT"], "a") as out:
            out.write(json.dumps({"hook": hook, "headers": seen, "url": flow.request.pretty_url}) + "\n")


def requestheaders(flow): _look("requestheaders", flow)
def request(flow): _look("request", flow)
def responseheaders(flow): _look("responseheaders", flow)
def response(flow): _look("response", flow)
def error(flow): _look("error", flow)
'''


def test_no_other_addon_ever_sees_a_secret_on_an_attempt(tmp_path):
    """Another script's hooks (as mitmweb's view, save_stream or a user's own) run for every
    attempt: none of them may see a real secret, the client's or the spare's, at any hook. (The
    attempt's hooks used to run, eagerly, while the values were on the flow for the replay.)"""
    fake = FakeUpstreamProcess(tmp_path)
    spare = "sk-proj-SPARESECRET7-good"
    text, env = spare_pool(fake, spare)
    spy, out = tmp_path / "spy.py", tmp_path / "spy.jsonl"
    spy.write_text(SPY)
    env = {**env, "SPY_SECRETS": '["CLIENTSECRET1", "SPARESECRET7", "SECRETACCOUNT9"]', "SPY_OUT": str(out)}
    proxy = ProxyProcess(tmp_path / "proxy", text, env, extra=["-s", str(spy)])
    try:
        for _ in range(3):  # a failover (client rejected, spare serves), on warm connections after the first
            reply = post_responses(proxy.port, f"{fake.base}/v1/responses", CLIENT_KEY,
                                   headers={"chatgpt-account-id": ACCOUNT})
            assert reply.status == 200, reply.body[:300]
    finally:
        proxy.stop()
        fake.stop()
    sightings = out.read_text() if out.exists() else ""
    assert sightings == "", f"a hook saw a secret:\n{sightings}"
    assert "sk-proj-" not in proxy.log()


def test_a_held_flow_keeps_its_real_url_and_is_answered_in_process(tmp_path):
    """The held client flow's answer comes through a stand-in server connection inside the
    client's own layers (held_stream.py): mid-stream, mitmweb shows the real URL, and no
    connection to the loopback relay is made."""
    fake = FakeUpstreamProcess(tmp_path, "--stall", "30")
    spare_key = "sk-proj-SPARESECRET2-stall-after-output"  # streams one delta, then waits
    text, env = spare_pool(fake, spare_key)
    # verbose: mitmproxy's connection lines are in the log, so a relay connection would show
    web = MitmwebProcess(tmp_path / "web", text, env, extra=["--set", "failover_verbose=true"])
    sock = start_raw_post(web.port, f"{fake.base}/v1/responses", CLIENT_KEY)
    try:
        read_until(sock, b"reasoning_summary_text.delta")  # streaming to the client now
        client = next(f for f in web.api("/flows") if not f["is_replay"])
        assert client["request"]["host"] == "127.0.0.1", client["request"]
        assert client["request"]["port"] == fake.port, client["request"]
        assert client["request"]["path"] == "/v1/responses", client["request"]
        assert client["server_conn"]["address"] == ["127.0.0.1", fake.port], client["server_conn"]
        assert "server connect 127.0.0.1" not in web.log().replace(f"127.0.0.1:{fake.port}", ""), \
            "a connection to the loopback relay"
        status = proxy_status(web.port)
        assert status["relay_streaming"] == 1, status  # the status page counts answers streamed in process
    finally:
        sock.close()
        web.stop()
        fake.stop()


def test_a_saved_held_flow_replays_to_its_url(tmp_path):
    """`-w` saves the client flow in its `response` hook: by then its stand-in server connection has
    lost its `via` (codex-failover.hop, never dialled), so `mitmdump -C` replays it like any flow."""
    fake = FakeUpstreamProcess(tmp_path / "fake")
    text, env = pool_yaml(fake.base, [("spare", "sk-test-spare-good")])
    saved = tmp_path / "flows.mitm"
    proxy = ProxyProcess(tmp_path / "proxy", text, env, extra=["-w", str(saved)])
    try:
        assert post_responses(proxy.port, f"{fake.base}/v1/responses", "sk-test-client-good").status == 200
    finally:
        proxy.stop()
    try:
        with open(saved, "rb") as fh:
            client = [f for f in io.FlowReader(fh).stream() if not f.is_replay]
        assert len(client) == 1
        assert client[0].server_conn.via is None
        before = len(fake.model_requests())
        replay = subprocess.run([MITMDUMP, "-n", "-C", str(saved), "--set", f"confdir={tmp_path / 'replay-conf'}"],
                                capture_output=True, text=True, timeout=60)
        assert "Name or service not known" not in replay.stdout, replay.stdout[-1000:]
        assert len(fake.model_requests()) > before, "the replay reached the upstream"
    finally:
        fake.stop()

"""Model hosts' pass-through flows (what Codex sends to chatgpt.com / api.openai.com besides the
held model requests: the model catalogue, /wham/*, analytics) keep no credential in mitmweb and in
`-w` files once their request has left (mitm/passthrough_redact.py). The upstream got them."""

from __future__ import annotations

import http.client
import json

import pytest
from harness import FakeUpstreamProcess, MitmwebProcess, ProxyProcess, pool_yaml, wait_until
from mitmproxy import io

pytestmark = pytest.mark.e2e

TOKEN = "eyJSECRETTOKEN1.eyJpayload.sig"
ACCOUNT = "acct-SECRETACCOUNT2"
COOKIE = "session=COOKIESECRET3"


def get(port: int, url: str, method: str = "GET", body: bytes | None = None) -> int:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    conn.request(method, url, body=body, headers={"authorization": f"Bearer {TOKEN}", "chatgpt-account-id": ACCOUNT,
                                                 "cookie": COOKIE, "content-type": "application/json"})
    status = conn.getresponse().status
    conn.close()
    return status


def requests_of(fake) -> list[dict]:
    return [r for r in fake.requests() if r.get("method") in ("GET", "POST")]


def test_pass_through_flows_of_model_hosts_are_saved_without_credentials(tmp_path):
    fake = FakeUpstreamProcess(tmp_path)  # 127.0.0.1: a model host, the pool's base_url
    text, env = pool_yaml(fake.base, [("spare", "sk-test-spare-good")])
    saved = tmp_path / "flows.mitm"
    proxy = ProxyProcess(tmp_path, text, env, extra=["-w", str(saved)])
    try:
        get(proxy.port, f"{fake.base}/backend-api/codex/models?client_version=1")
        get(proxy.port, f"{fake.base}/backend-api/wham/usage")
        get(proxy.port, f"{fake.base}/v1/responses", "POST", json.dumps({"stream": False}).encode())  # not held
    finally:
        proxy.stop()
    data = saved.read_bytes()
    for secret in (TOKEN, "COOKIESECRET3"):  # (the fake's answers echo the account id: checked on the headers)
        assert secret.encode() not in data, secret
    with open(saved, "rb") as f:
        flows = list(io.FlowReader(f).stream())
    assert len(flows) == 3
    for flow in flows:
        assert flow.request.headers["authorization"] == "<redacted by codex-failover>"
        assert flow.request.headers["chatgpt-account-id"] == "<redacted by codex-failover>"
        assert flow.request.headers["cookie"] == "<redacted by codex-failover>"


def test_mitmweb_shows_finished_pass_through_flows_without_credentials_and_other_hosts_untouched(tmp_path):
    fake = FakeUpstreamProcess(tmp_path)
    other = FakeUpstreamProcess(tmp_path / "other")
    other_base = other.base.replace("127.0.0.1", "localhost")  # not a model host
    text, env = pool_yaml(fake.base, [("spare", "sk-test-spare-good")])
    web = MitmwebProcess(tmp_path / "web", text, env)
    try:
        get(web.port, f"{fake.base}/backend-api/codex/models")
        get(web.port, f"{other_base}/something")
        flows = wait_until(lambda: (lambda fs: fs if len(fs) == 2 and all(f.get("response") for f in fs) else None)(
            web.api("/flows")), what="two finished flows")
    finally:
        web.stop()
        fake.stop()
        other.stop()
    model = next(f for f in flows if f["request"]["host"] == "127.0.0.1")
    headers = dict(model["request"]["headers"])
    assert TOKEN not in json.dumps(model)
    assert headers["chatgpt-account-id"] == headers["authorization"] == "<redacted by codex-failover>"
    untouched = next(f for f in flows if f["request"]["host"] == "localhost")
    assert TOKEN in json.dumps(untouched)  # mitmproxy's own flow, as plain mitmproxy keeps it

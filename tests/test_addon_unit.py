"""The addon object without a running proxy: status report, option validation."""

from codex_failover.config import Credential, PoolConfig
from codex_failover.core.auth import APIKEY, AuthMaterial
from codex_failover.mitm.addon import FailoverAddon


def make_addon():
    addon = FailoverAddon()
    creds = tuple(Credential(n, AuthMaterial(APIKEY, f"sk-secret-{n}"), "https://api.openai.com/v1", "$X")
                  for n in ("ready-one", "cool-one", "out-one"))
    addon.pool = PoolConfig(creds, source="/etc/pool.yaml")
    return addon


def test_status_shows_each_credentials_state_and_no_secret():
    addon = make_addon()
    addon.health.cool("cool-one", 42, "overloaded")
    addon.health.take_out("out-one", "HTTP 401 from upstream")
    report = addon.status()
    lines = {line.split()[0]: line for line in report.splitlines()[1:] if line.strip() and not line.strip().startswith("held")}
    assert addon.status_report()["credentials"][2]["state"] == "out"
    assert "ready" in lines["ready-one"]
    assert "cooling for 42s more (overloaded" in lines["cool-one"]
    assert "out: HTTP 401 from upstream" in lines["out-one"]
    assert "sk-secret" not in report
    assert "/etc/pool.yaml" in report


def test_status_lists_client_credentials_seen_here_and_those_learnt_from_a_shared_store():
    addon = make_addon()
    own = AuthMaterial(APIKEY, "sk-secret-own")
    addon.seen_clients.saw(own)
    addon.health.cool(f"client:{own.fingerprint}", 30, "overloaded")
    addon.health.cool("client:0123456789abcdef", 60, "usage_limit")  # another proxy's client, via Redis
    clients = {c["label"]: c for c in addon.status_report()["clients"]}
    assert clients[f"key #{own.fingerprint[:8]}"]["seen_s_ago"] == 0
    assert clients["key #01234567"]["seen_s_ago"] is None
    assert clients["key #01234567"]["state"] == "cooling"
    text = addon.status()
    assert "client key #01234567 -        not seen here: cooling for 60s more (usage_limit)" in text
    assert "sk-secret" not in text


def test_status_lists_gated_websockets():
    addon = make_addon()
    addon.ws_gate.report = lambda: [{"id": "w3", "credential": "ready-one", "route": "direct", "turns": 4, "moves": 1,
                                     "holding": True, "open_s": 12.4}]
    line = next(x for x in addon.status().splitlines() if "websocket" in x)
    assert line.split() == ["websocket", "w3", "on", "ready-one", "via", "direct:", "4", "turn(s),", "1", "move(s),",
                            "holding", "a", "turn,", "open", "12s"]


def test_a_bug_while_opening_a_gated_websocket_answers_426_not_an_ungated_upgrade():
    import asyncio

    from mitmproxy.test import taddons, tflow

    addon = make_addon()

    async def broken(flow, ctx):
        raise RuntimeError("boom")

    addon.ws_gate.open = broken
    with taddons.context(addon) as tctx:
        tctx.configure(addon, failover_websocket="gate")
        flow = tflow.tflow()
        flow.request.url = "https://api.openai.com/v1/responses"
        flow.request.method = "GET"
        flow.request.headers["upgrade"] = "websocket"
        flow.request.headers["authorization"] = "Bearer sk-test-client"
        asyncio.run(addon.request(flow))
    assert flow.response.status_code == 426
    assert b"internal error: RuntimeError" in flow.response.content


def test_failover_reset_is_a_mitmproxy_command_and_ends_a_cooldown():
    from mitmproxy.test import taddons

    from codex_failover.config import Credential, PoolConfig
    from codex_failover.core.auth import AuthMaterial

    addon = make_addon()
    addon.pool = PoolConfig(credentials=(Credential("a", AuthMaterial("apikey", "sk-test-a"), "http://x/v1", "env"),))
    addon.health.cool("a", 3600, "usage_limit")
    with taddons.context(addon) as tctx:
        text = tctx.master.commands.execute("failover.reset a")
    assert "credential a: cooldown ended (ended by hand; was usage_limit)" in text
    assert addon.health.ready("a")
    assert addon.status_report()["credentials"][0]["cooldown_ended"]["how"] == "ended by hand"

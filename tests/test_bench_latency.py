"""The latency benchmark's delay link and a smoke run of `scripts/bench --latency` (e2e).

Both need root, /dev/net/tun and iproute2 (network namespaces joined by a user-space packet delay);
elsewhere they are skipped with the reason. The smoke run takes about 20 s."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from delay_link import ETC_NETNS, DelayLink, available

ROOT = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.e2e, pytest.mark.skipif(available() is not None, reason=f"delay link: {available()}")]


def namespaces() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=10).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def test_a_tcp_connect_across_the_link_takes_one_rtt_and_stop_removes_everything():
    with DelayLink(rtt_ms=40) as link:
        names = set(link.names.values())
        link.hosts("a", {"upstream.test": link.addr["b"]})
        assert names <= namespaces()
        assert 38 <= link.check_rtt(samples=3) <= 60
        link.set_rtt(0)
        assert min(link.connect_ms(samples=3)) < 10
        assert link.stats()["syn_to_b"]  # the SYNs towards b were counted
        forwarder = link._forwarder
    assert not names & namespaces()
    assert not any((ETC_NETNS / n).exists() for n in names)
    assert forwarder.poll() is not None


def test_bench_latency_quick_runs_every_cell(tmp_path):
    # --baseline: another checkout's addon beside this one (here the same file), an A/B in one run.
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_latency.py"), "--quick", "--requests", "2",
                           "--rtt", "30", "--json", str(tmp_path / "lat.json"), "--png", str(tmp_path / "lat.png"),
                           "--baseline", str(ROOT / "addon" / "failover.py")],
                          capture_output=True, text=True, timeout=150, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "RTT 30 ms: TCP connect a->b" in proc.stdout, proc.stdout + proc.stderr
    assert "selects ALPN 'h2'" in proc.stdout, proc.stdout + proc.stderr
    rows = json.loads((tmp_path / "lat.json").read_text())["rows"]
    configs = ("plain", "healthy", "failover", "baseline")
    assert {(r["client"], r["config"]) for r in rows} == {(c, k) for c in ("h2", "h1") for k in configs}
    assert all(r["ok"] == r["requests"] == 2 for r in rows)
    assert all(r["first_text_ms"]["median"] > 30 for r in rows)  # at least one round trip
    assert all(r["output_hop_ms"]["n"] == 2 for r in rows)  # the first output's hop, from the fake's log
    # Plain mitmdump mirrors the client's protocol upstream, and so does the addon's first attempt (on the
    # client's own connection, mitm/direct.py); its later attempts go over HTTP/2 (warm_conn.WarmKey).
    expected = {("h1", "plain"): ["HTTP/1.1"], ("h1", "healthy"): ["HTTP/1.1"], ("h1", "baseline"): ["HTTP/1.1"],
                ("h1", "failover"): ["HTTP/1.1", "HTTP/2.0"]}
    assert {(r["client"], r["config"]): r["front_http"] for r in rows} == {
        (c, k): expected.get((c, k), ["HTTP/2.0"]) for c in ("h2", "h1") for k in configs}
    assert "baseline = addon at" in proc.stdout and all("delta_vs_plain" in r["first_text_ms"] for r in rows
                                                        if r["config"] == "baseline"), proc.stdout
    assert (tmp_path / "lat.png").stat().st_size > 1000
    assert not any(n.startswith("cfbench-") for n in namespaces())

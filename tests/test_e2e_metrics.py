"""End to end: `--set failover_metrics=HOST:PORT` serves Prometheus metrics that move with a failover."""

from __future__ import annotations

import re
import time
import urllib.request

import pytest
from harness import ProxyProcess, free_port, pool_yaml, post_responses

pytestmark = pytest.mark.e2e


def scrape(port: int) -> str:
    return urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()


def value(text: str, series: str) -> float:
    match = re.search(rf"^{re.escape(series)} (\S+)$", text, re.M)
    assert match, f"{series} not in:\n{text}"
    return float(match.group(1))


def test_metrics_count_a_failover(fake, tmp_path):
    port = free_port()
    text, env = pool_yaml(fake.base, [("spare", "sk-test-spare-good")])
    proxy = ProxyProcess(tmp_path, text, env, extra=["--set", f"failover_metrics=127.0.0.1:{port}"])
    try:
        deadline = time.monotonic() + 10
        while "Prometheus metrics at" not in proxy.log() and time.monotonic() < deadline:
            time.sleep(0.05)
        before = scrape(port)
        assert "codex_failover_attempts_total" not in before or 'verdict="failover"' not in before
        assert post_responses(proxy.port, f"{fake.base}/v1/responses", "sk-test-client-overload").status == 200
        after = scrape(port)
        own = re.search(r'codex_failover_attempts_total\{credential="(key #[0-9a-f]{8})",reason="overloaded",'
                        r'verdict="failover"\} 1\.0', after)
        assert own, after
        assert value(after, 'codex_failover_attempts_total{credential="spare",reason="output",verdict="commit"}') == 1
        assert value(after, "codex_failover_hold_seconds_count") == 1
        assert value(after, "codex_failover_first_output_to_client_seconds_count") == 1
        assert value(after, f'codex_failover_credential_state{{credential="{own.group(1)}",source="client",'
                            f'state="cooling"}}') == 1
        assert value(after, 'codex_failover_usage_percent{credential="spare",window="primary"}') == 10
        assert "sk-test" not in after
        # A healthy one, served by its first attempt on the client's own connection (mitm/direct.py): timed too.
        assert post_responses(proxy.port, f"{fake.base}/v1/responses", "sk-test-client-good").status == 200
        healthy = scrape(port)
        assert value(healthy, "codex_failover_hold_seconds_count") == 2
        assert value(healthy, "codex_failover_first_output_to_client_seconds_count") == 2
        took = value(healthy, "codex_failover_first_output_to_client_seconds_sum") - \
            value(after, "codex_failover_first_output_to_client_seconds_sum")
        assert 0 < took < 1.0, took  # measured, not a stand-in zero
        with pytest.raises(urllib.error.HTTPError):
            urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=10)
    finally:
        proxy.stop()

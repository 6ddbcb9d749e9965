"""What one credential's HTTP/2 upstream connection does touches no other credential's streams: a
graceful GOAWAY, a hard GOAWAY, a TCP reset and a 16 MiB header block on one connection, with other
credentials' streams in flight on the same upstream host (tests/support/h2_fake.py), and a failover
in flight among them. Each client uses its own key (its own credential), and the fake's log shows
which key came on which connection: never two on one."""

from __future__ import annotations

import json
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from harness import PYTHON, STARTED, ProxyProcess, pool_yaml, post_responses, stop

SUPPORT = Path(__file__).resolve().parent / "support"


class H2FakeProcess:
    def __init__(self, tmp: Path, *args: str):
        tmp.mkdir(parents=True, exist_ok=True)
        self.log_path = tmp / "h2fake.jsonl"
        self.proc = subprocess.Popen([PYTHON, str(SUPPORT / "h2_fake.py"), "--log", str(self.log_path), *args],
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        STARTED.append(self.proc)
        self.port = json.loads(self.proc.stdout.readline())["listening"]
        self.base = f"https://127.0.0.1:{self.port}"

    def log(self) -> list[dict]:
        return [json.loads(x) for x in self.log_path.read_text().splitlines() if x.strip()] if self.log_path.exists() else []

    def keys_by_connection(self) -> dict[int, set[str]]:
        out: dict[int, set[str]] = {}
        for entry in self.log():
            if entry.get("event") == "request":
                out.setdefault(entry["conn"], set()).add(entry["key"])
        return out

    def stop(self) -> None:
        stop(self.proc)


@pytest.fixture
def h2(tmp_path):
    fake = H2FakeProcess(tmp_path / "fake", "--pace", "0.15", "--deltas", "4")
    text, env = pool_yaml(fake.base, [("spare", "sk-spare-good")], use_client_credential=True)
    # The fake's certificate is self-signed: only these tests tell mitmproxy not to verify it.
    # Every attempt over the kept connections (the fake speaks HTTP/2 whatever ALPN says, as no real
    # server does: a first attempt on the client's own connection would talk HTTP/1.1 to it).
    proxy = ProxyProcess(tmp_path / "proxy", text, env, extra=["--set", "ssl_insecure=true", "--set", "failover_direct=false"])
    yield fake, proxy
    proxy.stop()
    fake.stop()


def in_flight(proxy, fake, keys: list[str]):
    """One request per key, all at once (each its own client connection), read to the end."""
    ca = proxy.confdir / "mitmproxy-ca-cert.pem"
    with ThreadPoolExecutor(len(keys)) as pool:
        futures = {key: pool.submit(post_responses, proxy.port, f"{fake.base}/v1/responses", key, None, 30.0, None, ca)
                   for key in keys}
        return {key: f.result() for key, f in futures.items()}


def complete(reply) -> bool:
    return reply.status == 200 and b'"response.completed"' in reply.body and not reply.truncated


@pytest.mark.parametrize("fault", ["goaway-hard", "reset", "bighead"])
def test_one_credentials_connection_failing_leaves_the_others_streams_whole(h2, fault):
    fake, proxy = h2
    others = [f"sk-client{i}-good" for i in range(3)]
    replies = in_flight(proxy, fake, [f"sk-victim-{fault}", *others, "sk-mover-overload"])
    for key in others:
        assert complete(replies[key]), (key, replies[key].status, replies[key].body[-300:], proxy.log()[-3000:])
    # A failover in flight among them still moves: the rejected client's answer is the spare's.
    mover = replies["sk-mover-overload"]
    assert complete(mover) and b"Hello from sk-spare-good" in mover.body, (mover.status, mover.body[-300:])
    by_conn = fake.keys_by_connection()
    assert all(len(keys) == 1 for keys in by_conn.values()), f"two credentials on one connection: {by_conn}"


def test_a_graceful_goaway_lets_the_streams_it_keeps_complete(h2):
    """The server says NO_ERROR with every opened stream kept: those streams are served to their
    end, and the client whose stream it was gets its whole answer."""
    fake, proxy = h2
    replies = in_flight(proxy, fake, ["sk-victim-goaway-graceful", "sk-client0-good"])
    for key, reply in replies.items():
        assert complete(reply), (key, reply.status, reply.body[-300:], proxy.log()[-3000:])
    assert any(e.get("event") == "goaway" for e in fake.log())


def test_a_stream_a_goaway_left_unprocessed_is_sent_again(h2):
    """Above the GOAWAY's last_stream_id the server never saw the request: it is sent again (here on
    the spare), where mitmproxy alone fails it as a closed connection."""
    fake, proxy = h2
    reply = in_flight(proxy, fake, ["sk-victim-goaway-unprocessed"])["sk-victim-goaway-unprocessed"]
    assert complete(reply) and b"Hello from sk-spare-good" in reply.body, (reply.status, reply.body[-300:])
    assert "reason=not_processed" in proxy.log()

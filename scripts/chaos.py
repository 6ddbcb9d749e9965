#!/usr/bin/env python3
"""The chaos suite: every fault of scripts/chaos.yaml, end to end through the real proxy, scored.

    scripts/chaos [--reduced] [--only SUBSTRING] [--catalogue FILE]

Each scenario gets a fresh fake upstream and proxy (temporary confdir), runs, and is checked for
its expected client-visible outcome and for the invariants: no byte of a losing attempt reached
the client (its body is byte-identical to the winner's response as the upstream sent it), no
response duplicated, no request lost, the proxy still serves afterwards, memory back near its
baseline. Prints a scorecard; exits 1 if any scenario fails.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import hashlib
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import yaml
from chaos_adversarial import AdversarialRuns

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "support"))  # harness, fake upstream

from harness import (
    FakeUpstreamProcess,
    LocalProxies,
    ProxyProcess,
    WsClient,
    WsRejected,
    free_port,
    pool_yaml,
    post_responses,
    proxy_status,
    start_raw_post,
)

HERE = Path(__file__).resolve().parent
MEMORY_SLACK_MB = 15.0


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


class Scenario(AdversarialRuns):
    def __init__(self, spec: dict, tmp: Path, proxies: LocalProxies):
        self.spec, self.tmp, self.proxies = spec, tmp, proxies
        self.expect = spec.get("expect", {})
        self.problems: list[str] = []
        self.observed: list[str] = []

    # -- set-up ----------------------------------------------------------------------------

    def start(self) -> None:
        self.fake = FakeUpstreamProcess(self.tmp, "--pace", "0.002", "--deltas", "6", "--stall", "2",
                                        *map(str, self.spec.get("fake_args", [])))
        routes = {name: [self._endpoint(url) for url in urls] for name, urls in self.spec.get("routes", {}).items()}
        creds = []
        for i, spare in enumerate(self.spec.get("spares", [])):
            key, *route = spare if isinstance(spare, list) else [spare]
            creds.append((f"spare{i}", key, *route))
        policy = {"bootstrap_timeout": "10s", **self.spec.get("policy", {})}
        text, env = pool_yaml(self.fake.base, creds, routes or None, **policy)
        self.websocket = self.spec.get("kind", "single").startswith("websocket")
        extra = (["--set", "failover_websocket=gate"] if self.websocket else []) + list(self.spec.get("proxy_args", []))
        self.proxy = ProxyProcess(self.tmp, text, env, extra=extra)
        self.url = f"{self.fake.base}/v1/responses"

    def _endpoint(self, url: str) -> str:
        if url == "DEAD":
            return f"http://127.0.0.1:{free_port()}"
        if url == "SOCKS":
            return f"socks5://alice:s3cret@127.0.0.1:{self.proxies.socks5('chaos-socks', users={'alice': 's3cret'})}"
        if url == "FLAPPY":
            return f"http://127.0.0.1:{self.proxies.http_proxy(f'flappy-{id(self)}', mode='flap')}"
        return url

    def stop(self) -> None:
        for proc in (getattr(self, "proxy", None), getattr(self, "fake", None)):
            if proc is not None:
                proc.stop()

    # -- running ---------------------------------------------------------------------------

    def run(self) -> None:
        self.post("sk-test-warmup-good", warmup=True)
        baseline = rss_mb(self.proxy.proc.pid)
        kind = self.spec.get("kind", "single")
        getattr(self, f"run_{kind}")()
        after = self.post("sk-test-after-good", warmup=True)
        if after is None or after.status != 200:
            self.problems.append("the proxy did not serve a good request afterwards")
        self.check_memory(baseline)

    def check_memory(self, baseline: float) -> None:
        """The addon holds nothing any more, and the process is near its RSS baseline (a scenario
        that moves big frames raises the allocator's high-water mark: `memory_slack_mb`)."""
        deadline = time.monotonic() + 3
        while True:
            state = proxy_status(self.proxy.port)
            busy = {k: state[k] for k in ("held_requests", "attempts_in_flight", "relay_unclaimed", "relay_streaming",
                                          "websockets") if state[k]}
            if not busy or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        if busy:
            self.problems.append(f"still held after the scenario: {busy}")
        grown = rss_mb(self.proxy.proc.pid) - baseline
        self.observed.append(f"RSS +{grown:.1f} MB")
        if grown > self.spec.get("memory_slack_mb", MEMORY_SLACK_MB):
            self.problems.append(f"memory grew {grown:.1f} MB over the scenario")

    def post(self, token: str, warmup: bool = False):
        try:
            return post_responses(self.proxy.port, self.url, token, timeout=30)
        except OSError as exc:
            if not warmup:
                self.problems.append(f"request failed: {exc}")
            return None

    def run_single(self) -> None:
        before = len(self.fake.model_requests())
        reply = self.post(self.spec["client"])
        if reply is None:
            return
        self.check_reply(reply)
        self.check_upstream(len(self.fake.model_requests()) - before)

    def run_flapping(self) -> None:
        for _ in range(4):
            reply = self.post(self.spec["client"])
            if reply is not None:
                self.check_reply(reply)
            time.sleep(0.6)

    def mixed_tokens(self) -> list[str]:
        """`clients` client keys, the `overloaded` share of them overloaded (seeded)."""
        rng = random.Random(7)
        return [f"sk-test-c{i}-{'overload' if rng.random() < self.spec.get('overloaded', 0.3) else 'good'}"
                for i in range(int(self.spec.get("clients", 64)))]

    def run_concurrent(self) -> None:
        tokens = self.mixed_tokens()
        n = len(tokens)
        with concurrent.futures.ThreadPoolExecutor(n) as pool:
            replies = list(pool.map(self.post, tokens))
        ok = sum(1 for r in replies if r is not None and r.status == 200 and self.stream_kind(r) == "complete")
        self.observed.append(f"{ok}/{n} complete")
        if ok != n:
            self.problems.append(f"only {ok} of {n} clients got a complete answer")

    def run_disconnect(self) -> None:
        sock = start_raw_post(self.proxy.port, self.url, self.spec["client"])
        deadline = time.monotonic() + 5
        while not self.fake.model_requests() or len(self.fake.model_requests()) < 2:  # warm-up + this one
            if time.monotonic() > deadline:
                break
            time.sleep(0.02)
        time.sleep(0.2)
        sock.close()
        left = time.monotonic()
        while time.monotonic() - left < 3:
            if any(r.get("event") == "peer_closed" for r in self.fake.requests()):
                self.observed.append(f"upstream cancelled after {(time.monotonic() - left) * 1000:.0f} ms")
                return
            time.sleep(0.02)
        self.problems.append("the upstream attempt kept running after the client left")

    def run_overload_episodes(self) -> None:
        """The same intermittent overloads (seeded episodes per account, and a load each account can
        take) and the same steady client load, once per `compare` variant of the overload policy,
        each on a fresh fake upstream and proxy: client-visible failures, side by side."""
        results = []
        for i, variant in enumerate(self.spec["compare"]):
            failed, total, all_cooling = self._episodes_run(variant, self.tmp / f"variant{i}")
            results.append((variant["name"], failed, total))
            self.observed.append(f"{variant['name']}: {failed}/{total} failed ({all_cooling} answered all cooling)")
        if self.expect.get("fewer_failures") and not results[-1][1] < results[0][1]:
            self.problems.append(f"{results[-1][0]} did not fail fewer requests than {results[0][0]}")

    def _episodes_run(self, variant: dict, tmp: Path) -> tuple[int, int, int]:
        spec = self.spec
        fake = FakeUpstreamProcess(tmp, "--pace", "0.002", "--deltas", "4")
        proxy = None
        try:
            accounts = [f"sk-test-acct{i}-good" for i in range(int(spec.get("accounts", 4)))]
            text, env = pool_yaml(fake.base, [(f"acct{i}", key) for i, key in enumerate(accounts)],
                                  **{"bootstrap_timeout": "10s", **spec.get("policy", {})})
            if variant.get("overload"):
                text += yaml.safe_dump({"overload": variant["overload"]})
            proxy = ProxyProcess(tmp, text, env)
            rng = random.Random(spec.get("seed", 11))
            duration = float(spec.get("seconds", 20))
            for key in accounts:
                windows, t = [], rng.uniform(0, duration / 3)
                while t < duration:
                    length = rng.uniform(*spec.get("episode_s", [2, 4]))
                    windows.append([t, t + length])
                    t += length + rng.uniform(*spec.get("gap_s", [4, 10]))
                fake.control("/_fake/episodes", {"credential": key, "windows": windows,
                                                 "max_per_s": spec.get("max_per_s", 3)})
            rate = float(spec.get("rate", 8))
            n = int(rate * duration)
            started = time.monotonic()

            def one(i: int):
                delay = started + i / rate - time.monotonic()
                if delay > 0:
                    time.sleep(delay)
                try:
                    return post_responses(proxy.port, f"{fake.base}/v1/responses", "sk-test-client-good", timeout=30)
                except OSError:
                    return None

            with concurrent.futures.ThreadPoolExecutor(32) as pool:
                replies = list(pool.map(one, range(n)))
            bad = [r for r in replies if r is None or r.status != 200 or self.stream_kind(r) != "complete"]
            cooling = sum(1 for r in bad if r is not None and b"every credential is cooling" in r.body)
            return len(bad), n, cooling
        finally:
            if proxy is not None:
                proxy.stop()
            fake.stop()

    def ws_turn(self, token: str) -> tuple[int, list[dict]]:
        """One gated WebSocket turn: (101 or the upgrade's status, the turn's messages)."""
        client = WsClient.connect(self.proxy.port, self.url, {"authorization": f"Bearer {token}"}, timeout=30)
        if isinstance(client, WsRejected):
            return client.status, []
        try:
            client.send_json({"type": "response.create", "model": "m", "stream": True, "input": []})
            return 101, client.recv_turn(30)
        finally:
            client.close()

    def run_websocket(self) -> None:
        before = self._ws_turns()
        status, events = self.ws_turn(self.spec["client"])
        self.check_ws(status, events)
        self.check_upstream(self._ws_turns() - before)

    def run_websocket_concurrent(self) -> None:
        """`clients` sockets at once, one turn each; `batches` times (the proxy's RSS after each)."""
        tokens = self.mixed_tokens()
        n, after = len(tokens), []
        base = rss_mb(self.proxy.proc.pid)
        for _ in range(int(self.spec.get("batches", 1))):
            with concurrent.futures.ThreadPoolExecutor(n) as pool:
                outcomes = list(pool.map(self.ws_turn, tokens))
            ok = sum(1 for status, events in outcomes if status == 101 and self.ws_kind(events) == "complete")
            self.observed.append(f"{ok}/{n} complete")
            if ok != n:
                self.problems.append(f"only {ok} of {n} clients got a complete turn")
            time.sleep(0.5)  # the sockets' ends
            after.append(rss_mb(self.proxy.proc.pid) - base)
        if len(after) > 1:
            self.observed.append("RSS after each batch: " + ", ".join(f"+{mb:.1f}" for mb in after) + " MB")

    def _ws_turns(self) -> int:
        return sum(1 for r in self.fake.requests() if r.get("event") == "ws_turn")

    @staticmethod
    def ws_kind(events: list[dict]) -> str:
        types = [e.get("type") for e in events]
        if "__close__" in types:
            return "closed"
        if "error" in types or "response.failed" in types:
            return "error_in_stream"
        if types.count("response.created") == 1 and types[-1:] == ["response.completed"]:
            return "complete"
        return "truncated"

    def check_ws(self, status: int, events: list[dict]) -> None:
        kind = self.ws_kind(events) if status == 101 else "rejected"
        who = next((e["delta"].split("Hello from ", 1)[1].split(".", 1)[0] for e in events
                    if e.get("type") == "response.output_text.delta" and "Hello from " in e.get("delta", "")), None)
        self.observed.append(f"{status} {kind}" + (f" by {who}" if who else ""))
        want = self.expect
        if want.get("upgrade") is not None and status != want["upgrade"]:
            self.problems.append(f"upgrade answered {status}, expected {want['upgrade']}")
        if want.get("stream") is not None and kind != want["stream"]:
            self.problems.append(f"turn {kind}, expected {want['stream']}")
        if want.get("served_by") and who != want["served_by"]:
            self.problems.append(f"served by {who}, expected {want['served_by']}")
        if want.get("close_code") is not None and (events[-1:] or [{}])[0].get("code") != want["close_code"]:
            self.problems.append(f"last frame {events[-1:]}, expected a close with code {want['close_code']}")
        if want.get("error_status") is not None and (events[-1:] or [{}])[0].get("status") != want["error_status"]:
            self.problems.append(f"last frame {events[-1:]}, expected an error with status {want['error_status']}")
        if kind == "complete" and [e.get("sequence_number") for e in events] != list(range(len(events))):
            self.problems.append("the turn's messages are not one response in order (lost, duplicated or mixed)")

    # -- checks ----------------------------------------------------------------------------

    @staticmethod
    def stream_kind(reply) -> str:
        if not reply.headers.get("content-type", "").startswith("text/event-stream"):
            return "json"
        types = [e.get("type") for e in _events(reply.body)]
        if "error" in types or "response.failed" in types:
            return "error_in_stream"
        if types.count("response.created") == 1 and types[-1:] == ["response.completed"] and not reply.truncated:
            return "complete"
        if types.count("response.created") > 1 or types.count("response.completed") > 1:
            return "duplicated"
        return "truncated"

    def check_reply(self, reply) -> None:
        kind = self.stream_kind(reply)
        who = _served_by(reply.body)
        self.observed.append(f"{reply.status} {kind}" + (f" by {who}" if who else ""))
        want_status, want_kind = self.expect.get("status"), self.expect.get("stream")
        if want_status is not None and reply.status != want_status:
            self.problems.append(f"status {reply.status}, expected {want_status}")
        if want_kind is not None and kind != want_kind:
            self.problems.append(f"stream {kind}, expected {want_kind}")
        if self.expect.get("served_by") and who != self.expect["served_by"]:
            self.problems.append(f"served by {who}, expected {self.expect['served_by']}")
        if kind == "complete":
            self.check_exact(reply, who)

    def check_exact(self, reply, who: str | None) -> None:
        """The client's bytes are exactly one response the upstream sent: no losing bytes, no dup."""
        digest = hashlib.sha256(reply.body).hexdigest()
        sent = self.fake.sent_digests(expect=digest, credential=who)
        if digest not in sent:
            self.problems.append(f"the client's bytes differ from every response the winner's upstream sent "
                                 f"({len(sent)} logged, client got {len(reply.body)} bytes)")

    def check_upstream(self, count: int) -> None:
        want = self.expect.get("upstream")
        if want is not None and count != want:
            self.problems.append(f"{count} upstream requests, expected {want}")


def _events(body: bytes) -> list[dict]:
    out = []
    for line in body.split(b"\n"):
        if line.startswith(b"data:"):
            try:
                obj = json.loads(line[5:])
            except ValueError:
                continue
            if isinstance(obj, dict):
                out.append(obj)
    return out


def _served_by(body: bytes) -> str | None:
    marker = b"Hello from "
    if marker not in body:
        return None
    return body.split(marker, 1)[1].split(b".", 1)[0].decode(errors="replace")


def describe(expect: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in expect.items())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reduced", action="store_true", help="only the scenarios marked reduced (the CI run)")
    ap.add_argument("--only", help="only scenarios whose name contains this")
    ap.add_argument("--catalogue", default=str(HERE / "chaos.yaml"))
    ap.add_argument("--markdown", action="store_true", help="print the scorecard as a Markdown table (for docs/measurements.md)")
    args = ap.parse_args(argv)
    catalogue = yaml.safe_load(Path(args.catalogue).read_text())
    chosen = [s for s in catalogue if (not args.reduced or s.get("reduced")) and (not args.only or args.only in s["name"])]
    proxies = LocalProxies()
    rows, failed = [], 0
    started = time.monotonic()
    try:
        for spec in chosen:
            with tempfile.TemporaryDirectory() as tmp:
                scenario = Scenario(spec, Path(tmp), proxies)
                t0 = time.monotonic()
                try:
                    scenario.start()
                    scenario.run()
                except Exception as exc:  # noqa: BLE001 - a scenario that crashes is a failed scenario
                    scenario.problems.append(f"crashed: {type(exc).__name__}: {exc}")
                finally:
                    scenario.stop()
                ok = not scenario.problems
                failed += not ok
                rows.append((spec["name"], describe(scenario.expect), "; ".join(scenario.observed) or "-",
                             "PASS" if ok else "FAIL: " + "; ".join(scenario.problems), time.monotonic() - t0))
    finally:
        proxies.close()
    if args.markdown:
        print("| scenario | expected | observed | result |\n|---|---|---|---|")
        print("\n".join(f"| {name} | {expected} | {observed} | {verdict} |" for name, expected, observed, verdict, _ in rows))
    width = max(len(r[0]) for r in rows) if rows else 10
    print(f"{'scenario':<{width}}  result  time   expected | observed")
    for name, expected, observed, verdict, secs in rows:
        print(f"{name:<{width}}  {verdict[:4]:<6} {secs:5.1f}s  {expected} | {observed}")
        if verdict != "PASS":
            print(f"{'':<{width}}  {verdict}")
    print(f"{len(rows) - failed}/{len(rows)} passed in {time.monotonic() - started:.0f}s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

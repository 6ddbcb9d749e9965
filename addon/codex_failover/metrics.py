"""Prometheus metrics (`--set failover_metrics=127.0.0.1:9464`): what the addon decided, as counters
and histograms the addon feeds at its events, and its current state (credentials, usage windows,
routes, streams, gated WebSockets) as gauges read from the status report at each scrape.

The series and their labels are listed in docs/metrics.md. Labels carry names only: a pooled
credential's configured name (`spare`), a client's own credential by the status page's label
(`key #1a2b3c4d`), a route endpoint's label (no proxy credentials), a reason class, a verdict. A label
value that still looks like a secret is replaced by `(not shown)`.

The listener serves `GET /metrics` and nothing else: any other path is 404, any other method 405.
Bound to loopback, it also refuses (403) a request whose Host is a name other than `localhost`, so a
web page cannot read it through DNS rebinding. It runs in its own daemon thread with its own
`CollectorRegistry` (never the process-wide default), so tests and script reloads do not clash.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import ipaddress
import logging
import re
from typing import Callable, Iterable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from .core.routes import looks_like_secret
from .core.usage import finite_number
from .core.vocabulary import Verdict
from .net.metrics_listener import MetricsServer

log = logging.getLogger("codex_failover")

OPTION = "failover_metrics"
PREFIX = "codex_failover_"

# Verdicts an attempt ends with (the `verdict` label of codex_failover_attempts_total).
VERDICTS = tuple(v.value for v in Verdict if v is not Verdict.HOLD)
CREDENTIAL_STATES = ("ready", "cooling", "out", "expired")
ROUTE_STATES = ("up", "backing_off", "probe_due", "probing")

# How long a request was held before its decision: 1 ms .. 60 s.
HOLD_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0)
# From the winner's first output event upstream to its bytes reaching the client: 0.1 ms .. 1 s.
FIRST_OUTPUT_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)

HIDDEN = "(not shown)"
SNAPSHOT_TIMEOUT = 2.0  # longest a scrape waits for the event loop to build the status report

_FAILED = re.compile(r"failed (\d+)x")


def label(value: object) -> str:
    """A label value: the text, unless it looks like a secret (then `(not shown)`)."""
    text = "" if value is None else str(value)
    return HIDDEN if any(looks_like_secret(word) for word in text.split()) else text


# --- the address --------------------------------------------------------------------------------


def parse_address(address: str) -> tuple[str, int]:
    """`HOST:PORT`, `[IPV6]:PORT` or a bare `PORT` (127.0.0.1) -> (host, port). HOST is an IP
    address or `localhost`; port 0 picks a free port. ValueError names the option and the problem."""
    text = (address or "").strip()
    if not text:
        raise ValueError(f"{OPTION}: empty; expected HOST:PORT, e.g. 127.0.0.1:9464")
    if text.isdigit():
        host, port_text = "127.0.0.1", text
    elif text.startswith("["):
        end = text.find("]")
        if end < 0 or not text[end + 1:].startswith(":"):
            raise ValueError(f"{OPTION}: {text!r}: expected [IPV6]:PORT, e.g. [::1]:9464")
        host, port_text = text[1:end], text[end + 2:]
    else:
        host, sep, port_text = text.rpartition(":")
        if not sep:
            raise ValueError(f"{OPTION}: {text!r}: expected HOST:PORT, e.g. 127.0.0.1:9464")
        if ":" in host:
            raise ValueError(f"{OPTION}: {text!r}: put an IPv6 address in brackets, e.g. [::1]:9464")
    if not host:
        raise ValueError(f"{OPTION}: {text!r}: name the address to listen on, e.g. 127.0.0.1:{port_text} "
                         f"(0.0.0.0:{port_text} for every interface)")
    if host.lower() == "localhost":
        host = "127.0.0.1"
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        raise ValueError(f"{OPTION}: {text!r}: the host must be an IP address or localhost") from None
    if not port_text.isdigit() or int(port_text) > 65535:
        raise ValueError(f"{OPTION}: {text!r}: the port must be a number from 0 to 65535")
    return str(ip), int(port_text)


# --- the scrape-time gauges ---------------------------------------------------------------------


def route_state(text: str) -> str | None:
    """RouteHealth.describe's text -> one of ROUTE_STATES (None for text it does not know)."""
    text = str(text or "")
    if text == "up":
        return "up"
    for prefix, state in (("backing off", "backing_off"), ("due for a probe", "probe_due"), ("being probed", "probing")):
        if text.startswith(prefix):
            return state
    return None


class _Gauges:
    """The gauge families of one scrape."""

    def __init__(self) -> None:
        g = GaugeMetricFamily
        self.ok = g(PREFIX + "snapshot_ok", "1 when the status report was read for this scrape, 0 when it failed "
                                             "(the state gauges are then missing or partial)")
        self.state = g(PREFIX + "credential_state", "1 for the state each credential is in (one-hot over "
                                                     "ready, cooling, out, expired)", labels=["credential", "source", "state"])
        self.cooldown = g(PREFIX + "credential_cooldown_seconds", "Seconds until a cooling credential is ready "
                                                                  "again (0 when not cooling)", labels=["credential", "source"])
        self.usage = g(PREFIX + "usage_percent", "Percent used of a credential's rate-limit window, as upstream "
                                                 "last reported it", labels=["credential", "window"])
        self.resets = g(PREFIX + "usage_resets_timestamp_seconds", "When a credential's rate-limit window "
                                                                   "resets (Unix time)", labels=["credential", "window"])
        self.route_up = g(PREFIX + "route_endpoint_up", "1 when a route endpoint is up, 0 while it is failing "
                                                        "(backing off, due for a probe, or being probed)", labels=["endpoint"])
        self.route_state = g(PREFIX + "route_endpoint_state", "1 for the state each route endpoint is in (one-hot "
                                                              "over up, backing_off, probe_due, probing)", labels=["endpoint", "state"])
        self.route_failures = g(PREFIX + "route_endpoint_failures", "Consecutive failures of a route endpoint "
                                                                    "(0 when up)", labels=["endpoint"])
        self.scalars = {
            "held_requests": g(PREFIX + "streams_held", "Requests held right now, waiting for their decision"),
            "relay_streaming": g(PREFIX + "streams_relayed", "Committed streams being relayed to clients right now"),
            "relay_unclaimed": g(PREFIX + "relay_unclaimed", "Committed streams or gated WebSockets not yet "
                                                             "fetched through the relay"),
            "attempts_in_flight": g(PREFIX + "attempts_in_flight", "Upstream attempts running right now"),
            "recovery_buffering": g(PREFIX + "recovery_buffering", "Requests buffering in recovery right now"),
        }
        self.ws_open = g(PREFIX + "websockets_open", "Gated WebSockets open right now")
        self.ws_holding = g(PREFIX + "websockets_holding", "Gated WebSockets holding a turn for its decision right now")

    def families(self) -> list[Metric]:
        return [self.ok, self.state, self.cooldown, self.usage, self.resets, self.route_up, self.route_state,
                self.route_failures, *self.scalars.values(), self.ws_open, self.ws_holding]

    def credential(self, entry: dict, name_key: str, source: str) -> None:
        name = label(entry[name_key])
        state = str(entry.get("state"))
        for s in CREDENTIAL_STATES:
            self.state.add_metric([name, source, s], 1.0 if s == state else 0.0)
        cooling = finite_number(entry.get("cooling_for_s")) if state == "cooling" else None
        self.cooldown.add_metric([name, source], max(0.0, cooling or 0.0))
        for w in entry.get("usage_windows") or ():
            window = label(w.get("window"))
            if (used := finite_number(w.get("used_percent"))) is not None:
                self.usage.add_metric([name, window], used)
            if (resets := finite_number(w.get("resets_at"))) is not None:
                self.resets.add_metric([name, window], resets)

    def route(self, entry: dict) -> None:
        endpoint, text = label(entry["endpoint"]), str(entry.get("state"))
        state = route_state(text)
        self.route_up.add_metric([endpoint], 1.0 if state == "up" else 0.0)
        for s in ROUTE_STATES:
            self.route_state.add_metric([endpoint, s], 1.0 if s == state else 0.0)
        failed = _FAILED.search(text)
        self.route_failures.add_metric([endpoint], float(failed.group(1)) if failed else 0.0)


def _each(items: Iterable | None, what: str, add: Callable[[dict], None]) -> None:
    """`add` each item; one that does not fit is skipped (debug line), the others still count."""
    for item in items or ():
        try:
            add(item)
        except Exception as exc:  # noqa: BLE001 - a scrape shows what it can
            log.debug("metrics: skipping a %s entry: %r", what, exc)


class SnapshotCollector(Collector):
    """The state gauges, read from `snapshot()` (the addon's status report) at each scrape."""

    def __init__(self, snapshot: Callable[[], dict] | None) -> None:
        self.snapshot = snapshot

    def describe(self) -> list:
        return []  # registering must not call the snapshot

    def collect(self) -> Iterator[Metric]:
        gauges = _Gauges()
        report = None
        if self.snapshot is not None:
            try:
                report = self.snapshot()
                if not isinstance(report, dict):
                    raise TypeError(f"the snapshot is a {type(report).__name__}, not a dict")
            except Exception as exc:  # noqa: BLE001 - the counters and histograms are still served
                log.debug("metrics: no status report for this scrape: %r", exc)
                report = None
        gauges.ok.add_metric([], 1.0 if report is not None else 0.0)
        if report is not None:
            _each(report.get("credentials"), "credential", lambda c: gauges.credential(c, "name", "pool"))
            _each(report.get("clients"), "client", lambda c: gauges.credential(c, "label", "client"))
            _each(report.get("routes"), "route", gauges.route)
            for key, family in gauges.scalars.items():
                if (value := finite_number(report.get(key))) is not None:
                    family.add_metric([], value)
            sockets = report.get("websockets")
            if isinstance(sockets, list):
                gauges.ws_open.add_metric([], float(len(sockets)))
                gauges.ws_holding.add_metric([], float(sum(1 for w in sockets if isinstance(w, dict) and w.get("holding"))))
        return iter([f for f in gauges.families() if f.samples or f is gauges.ok])


def snapshot_on_loop(loop: asyncio.AbstractEventLoop, snapshot: Callable[[], dict],
                     timeout: float = SNAPSHOT_TIMEOUT) -> Callable[[], dict]:
    """`snapshot`, run on `loop` (where the addon's state lives) when called from the scrape thread;
    raises (so the scrape has no state gauges) when the loop does not run it within `timeout`."""

    def call() -> dict:
        try:
            if asyncio.get_running_loop() is loop:
                return snapshot()
        except RuntimeError:
            pass  # no loop in this thread: the scrape thread
        if loop.is_closed():
            raise RuntimeError("the event loop is closed")
        future: concurrent.futures.Future = concurrent.futures.Future()

        def run() -> None:
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(snapshot())
                except BaseException as exc:  # noqa: BLE001 - handed to the scrape thread
                    future.set_exception(exc)

        loop.call_soon_threadsafe(run)
        try:
            return future.result(timeout)
        finally:
            future.cancel()  # a no-op once it ran; else it never will

    return call


# --- what the addon calls -----------------------------------------------------------------------


class Metrics:
    """The addon's metrics: event methods (never raise), `render()`, `serve(address)`."""

    def __init__(self, snapshot: Callable[[], dict] | None = None) -> None:
        self.registry = CollectorRegistry()
        self.collector = SnapshotCollector(snapshot)
        self._attempts = Counter(PREFIX + "attempts_total", "Upstream attempts, by how each ended",
                                 ["credential", "verdict", "reason"], registry=self.registry)
        self._exhausted = Counter(PREFIX + "exhausted_total", "Requests the addon answered itself once no "
                                  "credential was left, by the status it answered", ["status"], registry=self.registry)
        self._hold = Histogram(PREFIX + "hold_seconds", "How long a request was held before its decision",
                               registry=self.registry, buckets=HOLD_BUCKETS)
        self._first_output = Histogram(PREFIX + "first_output_to_client_seconds", "From the winner's first "
                                       "output event to its bytes being sent to the client",
                                       registry=self.registry, buckets=FIRST_OUTPUT_BUCKETS)
        self.registry.register(self.collector)

    @property
    def snapshot(self) -> Callable[[], dict] | None:
        return self.collector.snapshot

    @snapshot.setter
    def snapshot(self, snapshot: Callable[[], dict] | None) -> None:
        self.collector.snapshot = snapshot

    def attempt(self, credential: str, verdict: str, reason: str) -> None:
        """One attempt ended. `verdict`: commit, deliver, failover, failed, cancelled, recover; a
        failover is an attempt with verdict `failover` (whether or not another credential was left)."""
        self._safely(lambda: self._attempts.labels(label(credential), label(verdict), label(reason)).inc())

    def exhausted(self, status: int) -> None:
        """The addon answered the client itself after all attempts (503, 429, 502, 408, …)."""
        self._safely(lambda: self._exhausted.labels(str(int(status))).inc())

    def hold_seconds(self, seconds: float) -> None:
        """A request's decision came `seconds` after it was held."""
        self._safely(lambda: self._hold.observe(max(0.0, float(seconds))))

    def first_output_to_client_seconds(self, seconds: float) -> None:
        """The winner's first output event reached the client `seconds` after it arrived."""
        self._safely(lambda: self._first_output.observe(max(0.0, float(seconds))))

    def render(self) -> bytes:
        """The exposition text a scrape gets."""
        return generate_latest(self.registry)

    def serve(self, address: str, allows: Callable[[str], bool] | None = None,
              owns: Callable[[tuple, tuple], bool] | None = None) -> MetricsServer:
        """Listen on `address` (see parse_address) in a daemon thread, answering only peers that
        `allows` accepts; ValueError for a bad address, OSError when it cannot bind."""
        host, port = parse_address(address)
        return MetricsServer(host, port, self.registry, allows, owns)

    @staticmethod
    def _safely(record: Callable[[], object]) -> None:
        try:
            record()
        except Exception as exc:  # noqa: BLE001 - metrics never break a request
            log.debug("metrics: not recorded: %r", exc)


class MetricsListener:
    """The addon's /metrics listener over option changes: serve on an address, move, or stop."""

    def __init__(self) -> None:
        self.server: MetricsServer | None = None

    def serve(self, metrics: "Metrics | None", address: str, allows: Callable[[str], bool],
              owns: Callable[[tuple, tuple], bool] | None = None) -> None:
        self.stop()
        if not address or metrics is None:
            return
        try:
            self.server = metrics.serve(address, allows, owns)
        except OSError as exc:
            log.warning("codex-failover: cannot serve metrics on %s: %s", address, exc)
            return
        log.info("codex-failover: Prometheus metrics at %s", self.server.url)

    def addresses(self) -> list[tuple[str, int]]:
        """Where it listens now (none when it does not)."""
        server = self.server
        return [(server.host, server.port)] if server is not None else []

    def stop(self) -> None:
        server, self.server = self.server, None
        if server is not None:
            server.stop()

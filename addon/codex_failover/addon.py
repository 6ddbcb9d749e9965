"""The mitmproxy addon: options, hooks and the `failover.status` command. Thin by design."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import logging
import sqlite3
import sys
import time
import traceback
import weakref
from collections.abc import Sequence

import certifi
from mitmproxy import command, ctx, exceptions, http, tls
from mitmproxy.proxy.mode_specs import ProxyMode, ReverseMode
from mitmproxy.utils import human

from . import client_answers, quiet_log
from .affinity import Affinity
from .attempt import ATTEMPT_TAG, Attempt, Capture
from .auth import auth_from_headers
from .auth_watch import AuthWatch
from .client_access import ClientAccess, ClientAccessError, is_loopback_host, parse_networks
from .codex_request import EndpointMatcher, asks_to_stream, is_websocket_upgrade, parse_body
from .config import ConfigError, PoolConfig, load_pool
from .health import Health
from .intercept_scope import ALL, MODES as INTERCEPT_MODES, InterceptScope
from .held_client import RELAY_TAG, point_at_relay
from .request_run import ClientGone, RequestRun
from .shared import Shared
from .recovery import Slots
from .relay import Relay
from .routes import RouteHealth
from .rules import RulesError, load_rules
from .metrics import Metrics, parse_address, snapshot_on_loop
from .seen_clients import SeenClients
from .socks_bridge import SocksBridges
from .state_keeper import StateKeeper
from .state_store import open_store
from .trust import extend_openssl_context
from .usage import UsageBook
from .warm_conn import WarmConnections
from .ws_conn import WsConn
from .ws_gate import WebsocketGate
from .ws_upstream import tls_context

log = logging.getLogger("codex_failover")

WEBSOCKET_MODES = ("downgrade", "gate", "passthrough")
STATUS_HOST = "codex-failover.status"


class FailoverAddon:
    def __init__(self) -> None:
        self.pool = PoolConfig()
        self.rules = load_rules()
        self.health = Health()
        self.affinity = Affinity()
        self.usage = UsageBook()
        self.route_health = RouteHealth()
        self.bridges = SocksBridges()
        self.warm = WarmConnections()  # kept upstream connections, shared by every request
        self.recovery_slots = Slots()
        self.relay = Relay()
        self.matcher = EndpointMatcher()
        self.attempts: dict[str, Attempt] = {}
        self._ids = itertools.count(1)
        self._notices: set = set()
        self._held = 0  # requests held right now
        self.auth_watch = AuthWatch()
        self._auth_checked = 0.0
        self._tasks: set[asyncio.Task] = set()
        self.ws_gate = WebsocketGate()
        self._tls = None  # (options it was built from, upstream TLS context) for gated WebSockets
        self.scope = InterceptScope()
        self.clients = ClientAccess()
        self._running = False  # before `running`, a configuration error ends the process (one line)
        self._trusted: weakref.WeakSet = weakref.WeakSet()  # server TLS contexts given the system store
        self.quiet = quiet_log.QuietLog()
        self.seen_clients = SeenClients()
        self.max_body = 32 * 1024 * 1024  # failover_max_body
        self.keeper: StateKeeper | None = None  # opened when running (unit tests never touch a store)
        self._keeper_task: asyncio.Task | None = None
        self.metrics: Metrics | None = None  # counters exist once failover_metrics was set
        self._metrics_server = None
        self._captures: dict[str, Capture] = {}  # client flow id -> what its relayed stream began with

    # -- lifecycle -------------------------------------------------------------------------

    def load(self, loader) -> None:
        loader.add_option("failover_config", str, "", "codex-failover pool file (YAML): spare credentials and policy.")
        loader.add_option("failover_rules", str, "", "codex-failover rules file (YAML); default: rules/default.yaml.")
        loader.add_option("failover_websocket", str, "downgrade",
                          "Codex WebSocket upgrades on model endpoints: downgrade (answer 426, Codex uses SSE), "
                          "gate (keep the WebSocket; hold and classify every turn, move rejected first turns) "
                          "or passthrough (untouched, unprotected).")
        loader.add_option("failover_intercept", str, "models",
                          "Which HTTPS connections are decrypted: models (only the Codex hosts and the pool's "
                          "base URLs; everything else is tunnelled untouched) or all (mitmproxy's usual behaviour).")
        loader.add_option("failover_clients", Sequence[str], [],
                          "Addresses or CIDRs, besides loopback, that may use the pool and the status page.")
        loader.add_option("failover_max_body", str, "32m",
                          "Largest request body the addon holds for failover (k/m/g suffixes); a larger one is "
                          "passed through untouched, without failover (holding costs a few times its size).")
        loader.add_option("failover_metrics", str, "",
                          "Serve Prometheus metrics at HOST:PORT/metrics (e.g. 127.0.0.1:9464); empty: off.")
        loader.add_option("failover_verbose", bool, False,
                          "Also log mitmproxy's per-connection lines for the addon's own attempts and relay hops.")

    def configure(self, updated: set[str]) -> None:
        try:
            self._configure(updated)
        except exceptions.OptionsError as exc:
            if self._running:
                raise  # a runtime change: rejected, the proxy goes on with what it had
            # At start-up: one clear line and a non-zero exit, before mitmproxy says it is listening.
            print(f"codex-failover: {exc}", file=sys.stderr, flush=True)
            raise SystemExit(2) from None

    def _configure(self, updated: set[str]) -> None:
        if "failover_websocket" in updated and ctx.options.failover_websocket not in WEBSOCKET_MODES:
            raise exceptions.OptionsError(
                f"failover_websocket: {ctx.options.failover_websocket!r} is not one of {', '.join(WEBSOCKET_MODES)}")
        if "failover_intercept" in updated and ctx.options.failover_intercept not in INTERCEPT_MODES:
            raise exceptions.OptionsError(
                f"failover_intercept: {ctx.options.failover_intercept!r} is not one of {', '.join(INTERCEPT_MODES)}")
        if "failover_clients" in updated:
            try:
                self.clients = ClientAccess(parse_networks(ctx.options.failover_clients))
            except ClientAccessError as exc:
                raise exceptions.OptionsError(str(exc)) from None
        if "failover_verbose" in updated:
            self.quiet.configure(ctx.options)
        if "failover_max_body" in updated:
            try:
                self.max_body = human.parse_size(ctx.options.failover_max_body)
                WsConn.max_message = self.max_body  # the gated WebSocket's limit, both directions
            except ValueError:
                raise exceptions.OptionsError(
                    f"failover_max_body: {ctx.options.failover_max_body!r} is not a size (e.g. 32m)") from None
        if "failover_metrics" in updated and ctx.options.failover_metrics:
            try:
                parse_address(ctx.options.failover_metrics)
            except ValueError as exc:
                raise exceptions.OptionsError(str(exc)) from None
        if "failover_metrics" in updated and self._running:
            self._serve_metrics()
        if "failover_config" in updated or "failover_rules" in updated:
            self._load_files()
        if "mode" in updated and any(m.startswith("upstream:") for m in ctx.options.mode):
            # Upstream mode rewrites every replay's `via` and would tunnel the relay hop away from
            # 127.0.0.1: the addon cannot work under it.
            raise exceptions.OptionsError(
                "codex-failover does not work with --mode upstream:… (attempts choose their own upstream and "
                "the committed stream is relayed over 127.0.0.1). Run in regular mode (the default).")
        if "connection_strategy" in updated or not updated or "failover_config" in updated:
            # Eager connects to the real host at CONNECT time, before an attempt can pick its target.
            if ctx.options.connection_strategy != "lazy":
                log.debug("codex-failover: setting connection_strategy=lazy (attempts choose their own upstream)")
                ctx.options.connection_strategy = "lazy"

    def _load_files(self) -> None:
        try:
            pool = load_pool(ctx.options.failover_config or None)
            rules = load_rules(ctx.options.failover_rules or None)
        except (ConfigError, RulesError) as exc:
            raise exceptions.OptionsError(str(exc)) from None
        self.scope = InterceptScope(pool.gated_base_urls)
        self.pool, self.rules = pool, rules  # in-flight requests keep the objects they started with
        self._spawn(self.bridges.close())  # new routes or passwords apply at once (bridges restart on use)
        self.warm.close_all()  # connections through old endpoints or bridges are not used again
        if self._running:
            self._open_state()
        self.auth_watch.remember(pool.credentials)
        self.affinity.idle, self.affinity.max_sessions = pool.policy.session_idle, pool.policy.max_sessions
        self.route_health.floor, self.route_health.cap = pool.policy.route_backoff, pool.policy.route_backoff_max
        self.matcher = EndpointMatcher(pool.gated_base_urls)
        for note in pool.notes:
            log.warning("codex-failover: %s", note)
        names = ", ".join(f"{c.name} ({c.kind})" for c in pool.credentials) or "none (client credential only)"
        log.info("codex-failover: pool %s: credentials: %s", pool.source or "(no file)", names)

    # `running`/`done` stay synchronous: a script hot reload calls them outside the event loop's
    # await chain (docs/architecture.md#hooks-and-tasks). Async work is started as a task.
    def running(self) -> None:
        self._running = True
        self._open_state()
        self._serve_metrics()
        self.quiet.install(lambda: self.relay.port)
        self._spawn(self.relay.start())
        for host in self._listen_hosts():
            if not is_loopback_host(host):
                log.warning("codex-failover: listening on %s; the pool and the status page serve %s",
                            host or "every interface", self.clients.describe())

    @staticmethod
    def _listen_hosts() -> list[str]:
        hosts = []
        for spec in ctx.options.mode:
            try:
                host = ProxyMode.parse(spec).listen_host(ctx.options.listen_host)
            except ValueError:
                continue
            if host not in hosts:
                hosts.append(host)
        return hosts

    def done(self) -> None:
        # Before mitmproxy's Save writes the flows still in flight (it comes after scripts).
        for attempt in self.attempts.values():
            attempt.redact()
        self._close_state()
        self._stop_metrics()
        self.quiet.uninstall()
        self._spawn(self.relay.close())
        self._spawn(self.bridges.close())
        self.warm.close_all()

    def _serve_metrics(self) -> None:
        """(Re)start the /metrics listener for the current failover_metrics (or stop it)."""
        self._stop_metrics()
        address = ctx.options.failover_metrics
        if not address:
            return
        if self.metrics is None:
            self.metrics = Metrics(snapshot_on_loop(asyncio.get_running_loop(), self.status_report))
        try:
            # The same rule as the pool and the status page (read at each scrape: options may change).
            self._metrics_server = self.metrics.serve(address, lambda peer: self.clients.allows(peer))
        except OSError as exc:
            log.warning("codex-failover: cannot serve metrics on %s: %s", address, exc)
            return
        log.info("codex-failover: Prometheus metrics at %s", self._metrics_server.url)

    def _stop_metrics(self) -> None:
        server, self._metrics_server = self._metrics_server, None
        if server is not None:
            server.stop()

    def _open_state(self) -> None:
        """Open the pool's state store (or keep the open one) and restore what is still in force."""
        spec = self.pool.state
        if self.keeper is not None and (self.keeper.spec, self.keeper.namespace) == (spec.store, spec.namespace):
            self.keeper.bind(self.pool)
            return
        self._close_state()
        try:
            store = open_store(spec.store, spec.namespace)
        except (OSError, ValueError, ImportError, sqlite3.Error) as exc:
            log.warning("codex-failover: pool state store unavailable (%s); keeping state in memory only",
                        type(exc).__name__)
            return
        keeper = StateKeeper(store, self.health, self.usage, self.route_health, self.affinity)
        keeper.spec, keeper.namespace = spec.store, spec.namespace
        keeper.bind(self.pool)
        try:
            applied = keeper.start(store.load(time.time()))
        except Exception as exc:  # noqa: BLE001 - sqlite3 or Redis: never keep the proxy from starting
            log.warning("codex-failover: could not read pool state from %s (%s); starting clean, retrying",
                        getattr(store, "path", spec.store), type(exc).__name__)
            applied = 0
        where = getattr(store, "path", spec.store)
        log.info("codex-failover: pool state in %s (namespace %s): %d entr%s restored", where, spec.namespace,
                 applied, "y" if applied == 1 else "ies")
        self.keeper = keeper
        try:
            self._keeper_task = asyncio.get_running_loop().create_task(keeper.run())
        except RuntimeError:
            pass

    def _close_state(self) -> None:
        """Write what changed since the last flush, then close (at exit, or when the store changes)."""
        keeper, self.keeper = self.keeper, None
        if keeper is None:
            return
        if self._keeper_task is not None:
            self._keeper_task.cancel()
            self._keeper_task = None
        try:
            keeper.store.write(*keeper.changes())
        except Exception as exc:  # noqa: BLE001 - never fail a shutdown over state
            log.warning("codex-failover: could not save pool state at exit (%s)", exc)
        keeper.store.close()

    def _spawn(self, coro) -> None:
        try:
            task = asyncio.get_running_loop().create_task(coro)
        except RuntimeError:  # no loop any more (interpreter shutdown)
            coro.close()
            return
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # -- hooks -----------------------------------------------------------------------------

    async def request(self, flow: http.HTTPFlow) -> None:
        if flow.is_replay or ATTEMPT_TAG in flow.metadata or flow.response is not None:
            return
        req = flow.request
        is_status = req.host == STATUS_HOST  # `curl -x 127.0.0.1:8080 http://codex-failover.status/`
        if not is_status and not self.matcher.matches(req.host, req.port, req.path):
            return
        if not self.clients.allows(flow.client_conn.peername[0] if flow.client_conn.peername else None):
            flow.response = client_answers.client_not_allowed()
            return
        if is_status:
            flow.response = http.Response.make(200, json.dumps(self.status_report(), indent=2).encode(),
                                               {"content-type": "application/json"})
            return
        client_auth = auth_from_headers(req.headers)
        if client_auth is None:
            return  # no credential of its own: never served from the pool; passed on as a plain proxy would
        pooled = next((c.name for c in self.pool.credentials if c.auth.fingerprint == client_auth.fingerprint), None)
        self.seen_clients.saw(client_auth, pooled)
        if is_websocket_upgrade(req.method, req.headers):
            if ctx.options.failover_websocket == "downgrade":
                flow.response = client_answers.websocket_downgrade()
            elif ctx.options.failover_websocket == "gate":
                await self._gate_upgrade(flow)
            return
        if req.method != "POST":
            return
        if len(req.raw_content or b"") > self.max_body:
            log.warning("codex-failover: a %d-byte request body is over failover_max_body (%d): passed through "
                        "untouched, without failover", len(req.raw_content), self.max_body)
            return
        body = parse_body(req.get_content(strict=False) or b"")  # decoded (zstd) and parsed once
        if not asks_to_stream(body):
            return
        self._refresh_auth_files()
        await self._hold(flow, body)

    async def _gate_upgrade(self, flow: http.HTTPFlow) -> None:
        """Open the upstream socket now (any credential, any route that works); 426 if none can."""
        self._refresh_auth_files()
        await self.relay.start()
        try:
            session, why = await self.ws_gate.open(flow, self.shared())
        except Exception as exc:  # noqa: BLE001 - a bug must not let the upgrade through ungated
            log.error("codex-failover internal error opening a gated WebSocket: %s\n%s", exc, traceback.format_exc())
            session, why = None, f"codex-failover internal error: {type(exc).__name__}"
        if session is None:
            flow.response = client_answers.websocket_downgrade(f"failover_websocket=gate: {why}")
            return
        point_at_relay(flow, self.relay.port, self.relay.register(session))

    def shared(self) -> Shared:
        """What a request or a gated socket shares with everything else (shared.py)."""
        opts = ctx.options
        key = (opts.ssl_insecure, opts.ssl_verify_upstream_trusted_ca, opts.ssl_verify_upstream_trusted_confdir)
        if self._tls is None or self._tls[0] != key:
            self._tls = (key, tls_context(*key))
        return Shared(self.pool, self.rules, self.health, self.route_health, self.affinity, self.usage, self.bridges,
                      self.relay, self.warm, self.attempts, self._notices, self.recovery_slots, self._tls[1],
                      self.metrics)

    def _refresh_auth_files(self) -> None:
        """At most once a second: reload auth files that changed; a reloaded credential is back in
        rotation (a 401 that took it out was fixed by a new `codex login`)."""
        now = time.monotonic()
        if now - self._auth_checked < 1.0:
            return
        self._auth_checked = now
        creds, reloaded, problems = self.auth_watch.refresh(self.pool.credentials)
        for line in problems:
            log.warning(line)
        if reloaded:
            self.pool = dataclasses.replace(self.pool, credentials=creds)
            for name in reloaded:
                self.health.restore(name)
                log.info("credential %s: auth file changed on disk; reloaded, in rotation", name)

    async def _hold(self, flow: http.HTTPFlow, body: dict) -> None:
        """Start the held request's run and return: the client flow goes to the relay at once,
        which answers when the run decides (docs/architecture.md#the-relay)."""
        n = next(self._ids)
        await self.relay.start()
        run = RequestRun(flow, self.shared(), body, f"r{n}", rotation=n)
        run.hold()
        self._held += 1
        run.task = asyncio.get_running_loop().create_task(self._guarded(run))
        self._tasks.add(run.task)
        run.task.add_done_callback(self._tasks.discard)
        run.task.add_done_callback(lambda _: self._release_hold(run))

    def _release_hold(self, run: RequestRun) -> None:
        self._held -= 1
        if not run.client.answered:  # the client left, or a bug: the relay hop must end too
            run.client.internal_error("the request ended without an answer")

    @staticmethod
    async def _guarded(run: RequestRun) -> str | None:
        """Run one request; a bug must fail with a clear status, never hang the client."""
        try:
            await run.run()
        except (ClientGone, asyncio.CancelledError):  # seen by the run, or the relay's hop closed
            log.info("[%s] client went away while held; attempts cancelled", run.request_id)
            return "client_gone"
        except Exception as exc:  # noqa: BLE001
            log.error("[%s] codex-failover internal error: %s\n%s", run.request_id, exc, traceback.format_exc())
            run.client.internal_error(type(exc).__name__)
            return type(exc).__name__
        return None

    def responseheaders(self, flow: http.HTTPFlow) -> None:
        attempt = self.attempts.get(flow.id)
        if attempt is not None:
            ctype = flow.response.headers.get("content-type", "")
            attempt.on_responseheaders(200 <= flow.response.status_code < 300 and "text/event-stream" in ctype)
        elif RELAY_TAG in flow.metadata and flow.response.status_code != 101:
            flow.response.stream = self._captures[flow.id] = Capture()  # streamed live; the start kept for mitmweb
            # The relay closes its own one-shot hop; the client keeps its connection for the next request.
            flow.response.headers.pop("connection", None)
            self.quiet.relay_client(flow.client_conn.peername)

    async def response(self, flow: http.HTTPFlow) -> None:
        self._restore_client_request(flow)
        attempt = self.attempts.pop(flow.id, None)
        if attempt is not None:
            await attempt.on_response()

    def http_connect_upstream(self, flow: http.HTTPFlow) -> None:
        """Proxy credentials of a route endpoint go to that proxy only, on its CONNECT."""
        endpoint = self.warm.endpoint_of(flow.client_conn)  # the CONNECT of a kept connection's dial
        authorization = self.bridges.proxy_authorization(endpoint) if endpoint is not None else None
        if authorization is not None:  # an HTTP proxy's credentials, or a SOCKS bridge's secret
            flow.request.headers["Proxy-Authorization"] = authorization

    async def error(self, flow: http.HTTPFlow) -> None:
        self._restore_client_request(flow)
        attempt = self.attempts.pop(flow.id, None)
        if attempt is not None:
            await attempt.on_error()

    def _restore_client_request(self, flow: http.HTTPFlow) -> None:
        original = flow.metadata.pop(RELAY_TAG, None)
        if original is not None:  # show the real request in mitmweb, not the relay hop
            flow.request = http.Request.from_state(original)
            self.quiet.relay_client_done(flow.client_conn.peername)
        capture = self._captures.pop(flow.id, None)
        if capture is not None and flow.response is not None and flow.response.raw_content is None:
            capture.keep_on(flow.response)

    def tls_clienthello(self, data: tls.ClientHelloData) -> None:
        """Scoped interception: only the model endpoints are decrypted; every other TLS connection
        is tunnelled as it is. A user's --allow-hosts decides alone; --ignore-hosts acted earlier."""
        if data.ignore_connection or ctx.options.failover_intercept == ALL or ctx.options.allow_hosts:
            return
        if isinstance(data.context.client.proxy_mode, ReverseMode):
            return  # the operator named the one target
        address = data.context.server.address
        if not self.scope.intercepts(data.client_hello.sni, address[0] if address else None):
            data.ignore_connection = True

    def tls_start_server(self, tls_start: tls.TlsData) -> None:
        """Upstream verification trusts certifi and the machine's store, plus mitmproxy's CA options.
        Scripts run before mitmproxy's TlsConfig, which leaves a connection an addon has set up
        alone: so TlsConfig builds it now (its cached context), and each context is extended once."""
        if tls_start.ssl_conn is None and not tls_start.is_dtls:
            tlsconfig = ctx.master.addons.get("tlsconfig")
            if tlsconfig is not None:
                tlsconfig.tls_start_server(tls_start)
        conn = tls_start.ssl_conn
        if conn is None or ctx.options.ssl_insecure:
            return
        context = conn.get_context()
        if context in self._trusted:
            return
        if ctx.options.ssl_verify_upstream_trusted_ca or ctx.options.ssl_verify_upstream_trusted_confdir:
            extend_openssl_context(context, (certifi.where(), None))  # mitmproxy loads certifi only without them
        extend_openssl_context(context)
        self._trusted.add(context)

    # -- commands --------------------------------------------------------------------------

    def status_report(self) -> dict:
        """Pool health and in-flight counters, as data (no secrets)."""
        now = self.health.now()
        creds = []
        for cred in self.pool.credentials:
            state = self.health.state(cred.name)
            entry = {"name": cred.name, "kind": cred.kind, "base_url": cred.base_url, "route": cred.route,
                     "state": state.status, "reason": state.reason, "usage": self.usage.describe(cred.name),
                     "usage_windows": [{"window": w.name, "used_percent": w.used_percent, "resets_at": w.resets_at}
                                       for w in self.usage.windows(cred.name)]}
            if state.status == "cooling":
                entry["cooling_for_s"] = round(state.until - now, 1)
            if cred.auth.expires_at is not None and cred.auth.expires_at <= now:
                entry["state"], entry["reason"] = "expired", "run `codex login` for this account"
            creds.append(entry)
        seen = {key: (name, kind, round(ago)) for key, name, kind, ago in self.seen_clients.recent()}
        # Plus clients' credentials not seen here but cooling or out (learnt from a shared store).
        others = [key for key, *_ in self.health.entries() if key.startswith("client:") and key not in seen]
        clients = []
        for key in [*seen, *others]:
            name, kind, ago = seen.get(key, (f"key #{key[7:15]}", None, None))
            state = self.health.state(key)
            entry = {"label": name, "kind": kind, "seen_s_ago": ago, "state": state.status, "reason": state.reason}
            if state.status == "cooling":
                entry["cooling_for_s"] = round(state.until - now, 1)
            clients.append(entry)
        routes = [{"endpoint": ep.label, "state": self.route_health.describe(ep),
                   **({"bridge_port": port} if (port := self.bridges.port(ep)) else {})}
                  for endpoints in self.pool.routes.values() for ep in endpoints or ()]
        return {"pool": self.pool.source, "credentials": creds, "clients": clients, "routes": routes,
                "held_requests": self._held, "attempts_in_flight": len(self.attempts), "relay_port": self.relay.port,
                "upstream_connections": self.warm.stats(), "upstream_dials": self.warm.dials,
                "relay_unclaimed": self.relay.pending, "relay_streaming": self.relay.streaming,
                "recovery_buffering": self.recovery_slots.used, "websockets": self.ws_gate.report()}

    @command.command("failover.status")
    def status(self) -> str:
        """Each credential's state: ready, cooling until when and why, or out of rotation."""
        report = self.status_report()
        lines = [f"codex-failover pool: {report['pool'] or '(no file: client credential only)'}"]
        for c in report["credentials"]:
            text = c["state"]
            if c["state"] == "cooling":
                text += f" for {c['cooling_for_s']:.0f}s more ({c['reason']})"
            elif c["state"] in ("out", "expired"):
                text += f": {c['reason']}"
            lines.append(f"  {c['name']:<20} {c['kind']:<8} {c['base_url']:<45} {text}; {c['usage']}")
        for c in report["clients"]:
            text = c["state"] + (f" for {c['cooling_for_s']:.0f}s more ({c['reason']})" if c["state"] == "cooling"
                                 else f": {c['reason']}" if c["reason"] else "")
            seen = f"seen {c['seen_s_ago']}s ago" if c["seen_s_ago"] is not None else "not seen here"
            lines.append(f"  client {c['label']:<13} {c['kind'] or '-':<8} {seen}: {text}")
        lines += [f"  route {r['endpoint']:<40} {r['state']}" for r in report["routes"]]
        lines += [f"  websocket {w['id']:<6} on {w['credential']} via {w['route']}: {w['turns']} turn(s), {w['moves']} move(s)"
                  f"{', holding a turn' if w['holding'] else ''}, open {w['open_s']:.0f}s" for w in report["websockets"]]
        lines.append(f"  held requests: {report['held_requests']}, attempts in flight: {report['attempts_in_flight']}, "
                     f"relay: {report['relay_streaming']} streaming, {report['relay_unclaimed']} unclaimed")
        text = "\n".join(lines)
        log.info(text)
        return text

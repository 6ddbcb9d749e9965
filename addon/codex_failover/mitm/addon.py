"""The mitmproxy addon: options, hooks and the `failover.status` command. Thin by design."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import sys

from mitmproxy import command, ctx, exceptions, http

from ..config import ConfigError, PoolConfig, load_pool
from ..core import status
from ..core.activity import Activity
from ..core.affinity import Affinity
from ..core.auth import AuthMaterial, auth_from_headers
from ..core.client_access import ClientAccess, is_loopback_host
from ..core.codex_request import EndpointMatcher, asks_to_stream, is_compact, is_websocket_upgrade, parse_body
from ..core.health import Health
from ..core.intercept_scope import InterceptScope
from ..core.pool_reach import kinds_at_start
from ..core.provenance import Provenance
from ..core.recovery import Slots
from ..core.routes import RouteHealth
from ..core.rules import RulesError
from ..core.run_ids import run_id
from ..core.seen_clients import SeenClients
from ..core.usage import UsageBook
from ..metrics import Metrics, MetricsListener, snapshot_on_loop
from ..net.relay import Relay
from ..net.socks_bridge import SocksBridges
from ..options import add_options, parse_options, unknown_options
from ..rules_file import load_rules
from ..shared import Shared
from ..state_keeper import StateKeeper, close_keeper, open_keeper
from ..ws.conn import WsConn
from ..ws.gate import WebsocketGate
from ..ws.upstream import upstream_tls
from . import (
    bounded_body,
    client_answers,
    fallbacks,
    held_layer,
    held_stream,
    quiet_log,
    secret_guard,
    status_page,
)
from .account_back import AccountBack
from .attempt import ATTEMPT_TAG, Attempt, AttemptHooks
from .boundary import ClientBoundary
from .client_limits import ClientLimits
from .conn_trouble import ConnTrouble
from .engine import WarmConnections
from .file_watch import FileWatch
from .held_client import RelayHops
from .model_view import ModelView
from .pass_stream import PassStream
from .passthrough_redact import PassThroughRedaction
from .proxyauth_notice import ProxyAuthNotice
from .request_run import RequestRun, start_run
from .self_guard import SelfGuard
from .tls_scope import TlsScope
from .token_refresher import TokenRefresher
from .usage_answer import UsageAnswer
from .usage_poll import UsagePoller

log = logging.getLogger("codex_failover")

STATUS_HOST = "codex-failover.status"
DISPATCH_FIRST = 0.5  # seconds the request hook waits for the first attempt to leave (see _hold)

def _say_pool(pool: PoolConfig) -> None:
    """The lines a pool load gives: clamped values, a pool of one kind, the credentials."""
    for note in pool.notes:
        log.warning("codex-failover: %s", note)
    if (kinds := kinds_at_start(pool)) is not None:
        log.info("codex-failover: %s", kinds)
    names = ", ".join([*(f"{c.name} ({c.kind})" for c in pool.credentials),
                       *(f"{s.name} (skipped: its auth file cannot be used)" for s in pool.skipped)]) \
        or "none (client credential only)"
    log.info("codex-failover: pool %s: credentials: %s", pool.source or "(no file)", names)


def _say_start(clients: ClientAccess) -> None:
    """The warnings at start: fallbacks in force, a non-loopback listener, unknown options."""
    for line in fallbacks.in_force():
        log.warning(line)
    for host in held_layer.listen_hosts(ctx.options.mode, ctx.options.listen_host):
        if not is_loopback_host(host):
            log.warning("codex-failover: listening on %s; the pool and the status page serve %s",
                        host or "every interface", clients.describe())
    for line in unknown_options(getattr(ctx.options, "deferred", {}), ctx.options.keys()):
        log.warning("codex-failover: %s", line)


def _parts(addon: "FailoverAddon", usage: UsageAnswer) -> list:
    """The addon's parts, nested as mitmproxy nests addons: each hook reaches the addon first, then
    them in this order."""
    return [addon.guard, addon.limits, addon.tls, AttemptHooks(addon.attempts), addon.hops, addon.boundary,
            addon.back, ProxyAuthNotice(), usage,
            PassThroughRedaction(lambda host: addon.tls.scope.intercepts(host, host)),
            ConnTrouble(), PassStream(addon, usage)]


class FailoverAddon:
    def __init__(self) -> None:
        self.pool = PoolConfig()
        self.rules = load_rules()
        self.health = Health()
        self.affinity = Affinity()
        self.provenance = Provenance()  # which credential made each response id / encrypted item
        self.usage = UsageBook()
        self.route_health = RouteHealth()
        self.bridges = SocksBridges()
        self.warm = WarmConnections()  # kept upstream connections, shared by every request
        self.warm.own_context = lambda: (self.bridges, upstream_tls(ctx.options))  # its fallback's dial
        self.recovery_slots = Slots()
        self.relay = Relay()
        self.matcher = EndpointMatcher()
        self.attempts: dict[str, Attempt] = {}
        self._ids = itertools.count(1)
        self.run = run_id()  # in front of request and WebSocket ids: unique across restarts (run_ids.py)
        self._notices: set = set()
        self._held = 0  # requests held right now
        self.files = FileWatch()  # the pool file, auth files, token ends (file_watch.py)
        self._tasks: set[asyncio.Task] = set()
        self.ws_gate = WebsocketGate(self.run)
        self.quiet = quiet_log.QuietLog()
        self.tls = TlsScope()  # a nested addon: which TLS connections are decrypted, and upstream trust
        self.hops = RelayHops()  # nested addons, each for the flows of one kind
        self.listener = MetricsListener()
        self.guard = SelfGuard(self.listener.addresses)  # never a dial to its own listeners, never its own socket a client
        self.boundary = ClientBoundary(is_self=self.guard.is_own_socket)  # whose requests are the user's own programs'
        self.back, self.limits = AccountBack(self), ClientLimits(self.boundary)  # cooldowns that end early, failover.reset; connections per client
        self.refresher = TokenRefresher(self)  # pooled ChatGPT logins' tokens (token_refresher.py)
        self.activity, self.usage_poller, self.view = Activity(), UsagePoller(self), ModelView()  # dashboard, failover_view
        self.addons = _parts(self, UsageAnswer(self))
        self.clients = ClientAccess()
        self._running = False  # before `running`, a configuration error ends the process (one line)
        self.seen_clients = SeenClients()
        self.max_body = 32 * 1024 * 1024  # failover_max_body
        self.keeper: StateKeeper | None = None  # opened when running (unit tests never touch a store)
        self.metrics: Metrics | None = None  # counters exist once failover_metrics was set

    # -- lifecycle -------------------------------------------------------------------------

    def load(self, loader) -> None:
        secret_guard.install(lambda: self.pool)  # no secret in any log, the pool's among them (secret_guard.py)
        add_options(loader)
        self.quiet.install()  # before the proxy listens: its first connections are chatter too

    def configure(self, updated: set[str]) -> None:
        try:
            self._configure(updated)
            self.limits.apply_options(updated)  # (here, not as their hook: a bad value at start is this one line)
            self.boundary.apply_options(updated)  # the proxy token too
        except exceptions.OptionsError as exc:
            if self._running:
                raise  # a runtime change: rejected, the proxy goes on with what it had
            # At start-up: one clear line and a non-zero exit, before mitmproxy says it is listening.
            print(f"codex-failover: {exc}", file=sys.stderr, flush=True)
            raise SystemExit(2) from None

    def _configure(self, updated: set[str]) -> None:
        try:
            parsed = parse_options(ctx.options, updated)
        except ValueError as exc:
            raise exceptions.OptionsError(str(exc)) from None
        if parsed.clients is not None:  # (failover_clients changed)
            self.clients = parsed.clients
        if "failover_verbose" in updated:
            self.quiet.configure(ctx.options)
        if parsed.max_body is not None:  # (failover_max_body changed)
            self.max_body = WsConn.max_message = bounded_body.limit = parsed.max_body  # the WebSocket's, every decode's
        if "failover_metrics" in updated and self._running:
            self._serve_metrics()
        if updated & {"failover_config", "failover_rules", "failover_token_refresh"}:
            self._load_files()
        self.view.configure(ctx.options, self.pool.gated_base_urls, updated)
        if "connection_strategy" in updated or not updated or "failover_config" in updated:
            # Eager connects to the real host at CONNECT time, before an attempt can pick its target.
            if ctx.options.connection_strategy != "lazy":
                log.debug("codex-failover: setting connection_strategy=lazy (attempts choose their own upstream)")
                ctx.options.connection_strategy = "lazy"

    def _load_files(self) -> None:
        self.files.expiry.auto = bool(ctx.options.failover_token_refresh)  # what the token lines say
        self.files.before_load(ctx.options.failover_config or None)
        try:
            pool = load_pool(ctx.options.failover_config or None)
            rules = load_rules(ctx.options.failover_rules or None)
        except (ConfigError, RulesError) as exc:
            raise exceptions.OptionsError(str(exc)) from None
        self.tls.scope = InterceptScope(pool.gated_base_urls)
        self.pool, self.rules = pool, rules  # in-flight requests keep the objects they started with
        self._spawn(self.bridges.close())  # new routes or passwords apply at once (bridges restart on use)
        self.warm.close_all()  # connections through old endpoints or bridges are not used again
        if self._running:
            self._open_state()
        self.affinity.idle, self.affinity.max_sessions = pool.policy.session_idle, pool.policy.max_sessions
        self.provenance.idle = pool.policy.session_idle  # an artifact lives as long as its session may
        self.route_health.floor, self.route_health.cap = pool.policy.route_backoff, pool.policy.route_backoff_max
        self.matcher = EndpointMatcher(pool.gated_base_urls)
        _say_pool(pool)
        self.files.loaded(pool.credentials, self._notices, pool.skipped)

    # Synchronous: a script reload calls them outside the loop's await chain (architecture.md#hooks-and-tasks).
    def running(self) -> None:
        self._running = True
        self._open_state()
        self._serve_metrics()
        self._spawn(self.relay.start())
        self.back.start()
        self.refresher.start()
        _say_start(self.clients)

    def done(self) -> None:
        # Before mitmproxy's Save writes the flows still in flight (it comes after scripts).
        for attempt in self.attempts.values():
            attempt.redact()
        self._close_state()
        self.back.stop()
        self.usage_poller.stop()
        self.refresher.stop()
        self.listener.stop()
        self.quiet.uninstall()
        self._spawn(self.relay.close())
        self._spawn(self.bridges.close())
        self.warm.close_all()

    def _serve_metrics(self) -> None:
        """(Re)start the /metrics listener for the current failover_metrics (or stop it)."""
        if ctx.options.failover_metrics and self.metrics is None:
            self.metrics = Metrics(snapshot_on_loop(asyncio.get_running_loop(), self.status_report))
        # The same rule as the pool and the status page (read at each scrape: options may change).
        self.listener.serve(self.metrics, ctx.options.failover_metrics, lambda peer: self.clients.allows(peer),
                            self.guard.owns(self.boundary.owns))

    def _open_state(self) -> None:
        """Open the pool's state store (or keep the open one) and restore what is still in force."""
        self.keeper = open_keeper(self.pool, self.keeper, self.health, self.usage, self.route_health, self.affinity,
                                  self.provenance)

    def _close_state(self) -> None:
        keeper, self.keeper = self.keeper, None
        close_keeper(keeper)

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
        if is_status:  # the dashboard, its data, the JSON report; a POST ends a cooldown (status_page.py)
            flow.response = status_page.respond(self, flow)
            return
        client_auth = auth_from_headers(req.headers)
        if client_auth is None or self.boundary.passed_by(flow, client_auth):
            return  # no key of its own, a browser's, another user's, refused lately: untouched, never the pool's
        pooled = next((c.name for c in self.pool.credentials if c.auth.account == client_auth.account), None)
        self.seen_clients.saw(client_auth, pooled)
        self.back.saw_client(client_auth, req.url, pooled)  # its usage is re-checked with it (memory only)
        if is_websocket_upgrade(req.method, req.headers):
            if ctx.options.failover_websocket == "downgrade":
                flow.response = client_answers.websocket_downgrade()
            elif ctx.options.failover_websocket == "gate":
                self._refresh_auth_files()
                await self.ws_gate.upgrade(flow, self.shared(), self.relay)
            return
        if req.method != "POST":
            return
        if (decoded := await bounded_body.request_body(req, self.max_body)) is None:  # over failover_max_body
            return  # passed through untouched, without failover (decoded in slices, parsed once otherwise)
        body = parse_body(decoded)
        if not asks_to_stream(body) and not (is_compact(req.path) and isinstance(body, dict)):
            return
        self._refresh_auth_files()
        await self._hold(flow, body, client_auth)

    def shared(self) -> Shared:
        """What a request or a gated socket shares with everything else (shared.py)."""
        return Shared(self.pool, self.rules, self.health, self.route_health, self.affinity, self.usage, self.bridges,
                      self.relay, self.warm, self.attempts, self._notices, self.recovery_slots,
                      upstream_tls(ctx.options), self.metrics, self.provenance, self.boundary.rejected, self.activity)

    def _refresh_auth_files(self) -> None:
        """At most once a second: the pool file and auth files that changed, reloaded (file_watch.py)."""
        self.pool = self.files.refresh(lambda: self.pool, self._load_files, self.health)
        self.refresher.check()  # starts the token refreshes that are due (at most once a second)

    async def _hold(self, flow: http.HTTPFlow, body: object, client_auth: AuthMaterial) -> None:
        """Start the held request's run and return: the client flow gets its stand-in server
        connection at once, which answers when the run decides (docs/architecture.md#the-held-stream)."""
        n = next(self._ids)
        await self.relay.start()
        self._held += 1
        run = RequestRun(flow, self.shared(), body, f"{self.run}-r{n}", rotation=n, client_auth=client_auth)
        self._tasks.add(start_run(run, self._released))  # (taken out by `_released`: one done callback)
        # Let the first attempt's request leave before the client flow goes on (the other addons'
        # request hooks, the hop): those have until the first output, the upstream is waiting now.
        if not run.dispatched.is_set():  # (a direct attempt's head leaves once this hook returns: set already)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(run.dispatched.wait(), DISPATCH_FIRST)

    def _released(self, run: RequestRun) -> None:
        self._held -= 1
        self._tasks.discard(run.task)
        self.refresher.check(force=True)  # a pooled credential's 401 in this run forces its refresh now

    def http_connect_upstream(self, flow: http.HTTPFlow) -> None:
        """Proxy credentials of a route endpoint go to that proxy only, on its CONNECT."""
        endpoint = self.warm.endpoint_of(flow.client_conn)  # the CONNECT of a kept connection's dial
        authorization = self.bridges.proxy_authorization(endpoint) if endpoint is not None else None
        if authorization is not None:  # an HTTP proxy's credentials, or a SOCKS bridge's secret
            secret_guard.arming([authorization])
            flow.request.headers["Proxy-Authorization"] = authorization

    # -- commands --------------------------------------------------------------------------

    def status_report(self) -> dict:
        """Pool health and in-flight counters, as data (no secrets)."""
        counters = {"held_requests": self._held, "attempts_in_flight": len(self.attempts), "relay_port": self.relay.port,
                    "upstream_connections": self.warm.stats(), "upstream_dials": self.warm.dials,
                    "relay_unclaimed": self.relay.pending, "relay_streaming": self.relay.streaming + held_stream.streaming(),
                    "recovery_buffering": self.recovery_slots.used, "artifacts_known": len(self.provenance), "websockets": self.ws_gate.report(), "counts": self.activity.counts()}
        return status.build(self.pool, self.health, self.usage, self.seen_clients, self.route_health, self.bridges,
                            counters, self.back.report())

    @command.command("failover.reset")
    def reset(self, name: str) -> str:
        """End credential NAME's cooldown or out-of-rotation mark now (`client`: the clients' own)."""
        return self.back.reset_by_name(name)

    @command.command("failover.status")
    def status(self) -> str:
        """Each credential's state: ready, cooling until when and why, or out of rotation."""
        text = status.render(self.status_report())
        log.info(text)
        return text


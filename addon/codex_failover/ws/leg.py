"""Each upstream socket of a gated WebSocket (a leg) as a flow every addon sees, as an HTTP attempt is.

Before the gate dials, the leg's upgrade request (the candidate's credential swapped in) runs
mitmproxy's `requestheaders` and `request` hooks through every addon: mitmweb's view shows it from
then on, and an addon that sends model hosts elsewhere (`map_remote`, a user's script, a test
harness) or changes a header decides where the gate dials and what it sends, as it does for an HTTP
attempt. An addon that answers the request or kills it is obeyed: its answer is the upgrade's.

Then, as mitmproxy runs a WebSocket flow: `responseheaders` and `response` with the upstream's
answer (101, or the rejection and its body), `websocket_start`, the messages both ways on
`flow.websocket`, and `websocket_end` when the socket ends, so `-w` saves the leg. Each turn's
verdict is the flow's mark and comment. Messages are recorded only (no `websocket_message` hook:
the gate, not another addon, decides what each turn delivers).

What the flow holds is what mitmweb shows and `-w` saves: the secret headers are placeholders from
the start, and the real values exist only in the head the gate writes. A text message from the
upstream is masked (a rejection may echo the key it was sent), and a leg keeps at most KEEP bytes of
message content: a message past that is recorded by its size.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque

from mitmproxy import ctx, flow as mitmflow, hooks, http, websocket

from .. import bounded_decode
from ..core import story
from ..mitm.attempt import ATTEMPT_TAG, PLACEHOLDER, copy_request, hide_secrets, secrets_in
from ..mitm.quiet_log import listened
from ..mitm.secret_guard import SECRETS, arming
from ..mitm.warm_conn import server_at

log = logging.getLogger("codex_failover")

KEEP = 1024 * 1024  # message bytes a leg's flow keeps (the client's flow has every message)
LINES = 50  # verdict lines its comment keeps (the last ones)
_OVERHEAD = 64  # what one recorded message counts against KEEP besides its content


class FlowRecord:
    """What a leg's flow shows of its socket: the messages (bounded, an upstream's masked) and the
    verdicts (mark and comment). Also the order its hooks run in (`later`)."""

    def __init__(self, flow: http.HTTPFlow, title: str):
        self.flow = flow
        self._kept = 0
        self._over: websocket.WebSocketMessage | None = None  # the note for the messages past KEEP
        self._skipped = [0, 0]  # messages and bytes past KEEP
        self._lines: deque[str] = deque(maxlen=LINES)
        self._said = 0
        self._title = flow.comment = title
        self._last: asyncio.Task | None = None  # hooks run one after another, in order

    def message(self, content: bytes, is_text: bool, from_client: bool, masked: bool = False) -> None:
        """A whole message on this socket, as it went: recorded on the flow until KEEP bytes are;
        then one closing note counts the rest."""
        ws = self.flow.websocket
        if ws is None:
            return
        if self._over is None and self._kept + len(content) + _OVERHEAD <= KEEP and not from_client and not masked:
            content = mask(content, is_text)  # a key-shaped word may grow
        if self._over is not None or self._kept + len(content) + _OVERHEAD > KEEP:
            self._skipped[0] += 1
            self._skipped[1] += len(content)
            note = (f"(codex-failover: {self._skipped[0]} more message(s), {self._skipped[1]} bytes, not kept here: "
                    f"this flow keeps {KEEP // 1024} KiB of messages; the client's flow has them all)").encode()
            if self._over is None:
                self._over = websocket.WebSocketMessage(websocket.Opcode.TEXT, from_client, note, time.time())
                ws.messages.append(self._over)
            self._over.content = note
            return
        self._kept += len(content) + _OVERHEAD
        kind = websocket.Opcode.TEXT if is_text else websocket.Opcode.BINARY
        ws.messages.append(websocket.WebSocketMessage(kind, from_client, content, time.time()))

    def judge(self, mark: str, line: str, update: bool = True) -> None:
        """A verdict on this socket (a turn's, or its upgrade's), shown in mitmweb and saved. The
        comment is its first line and the last LINES verdicts."""
        self.flow.marked = mark
        self._lines.append(line)
        self._said += 1
        earlier = self._said - len(self._lines)
        # One bulleted line per verdict: mitmweb's Comment tab shows newlines as spaces.
        self.flow.comment = "\n".join([self._title, *([f"({earlier} earlier)"] if earlier else []),
                                       *(f"• {line}" for line in self._lines)])
        if update:  # (else the hooks that follow show it: each is followed by an update)
            self.later(_update(self.flow))

    def later(self, coro) -> None:
        """Run `coro` after this leg's hooks scheduled before it (from synchronous code)."""
        before = self._last

        async def after():
            nonlocal before
            if before is not None:
                await asyncio.wait([before])
                before = None  # no chain of finished tasks on a long socket
            await coro

        self._last = asyncio.get_running_loop().create_task(after())

    async def settled(self) -> None:
        """Return once the hooks scheduled so far (`later`) have run."""
        if self._last is not None:
            await asyncio.wait([self._last])


def hide_added(request: http.Request, wire: dict[str, list[str]]) -> None:
    """After the request hooks: a secret header an addon set (modify_headers, upstream_auth...) goes
    to the wire only (`wire`), as the credential's own: masked in logs, a placeholder on the flow.
    `proxy-authorization` is for a proxy, which the route's own CONNECT carries: never sent to the
    model host."""
    headers = request.headers
    headers.pop("proxy-authorization", None)
    wire.pop("proxy-authorization", None)
    for name in secrets_in(headers):
        values = headers.get_all(name)
        if values != [PLACEHOLDER]:
            wire[name] = [v for v in values if v != PLACEHOLDER] or wire.get(name, [])
            arming(wire[name])
    hide_secrets(request)


def mask(content: bytes, is_text: bool) -> bytes:
    """A message as a flow shows it: any key it echoes masked."""
    encoding = "utf-8" if is_text else "latin-1"
    return SECRETS.mask(content.decode(encoding, "replace" if is_text else "strict")).encode(encoding)


class Leg:
    """One upstream socket's flow, its hooks run by the gate itself (see the module's docstring):
    the fallback to ws/layer_socket.py, where mitmproxy's layers run them."""

    def __init__(self, client_flow: http.HTTPFlow, url: str, headers: http.Headers, label: str, title: str = ""):
        request = copy_request(client_flow.request)
        request.url = url
        request.headers = headers
        self.flow = http.HTTPFlow(client_flow.client_conn, server_at((request.host, request.port)))
        self.flow.request = request
        self.flow.is_replay = "request"
        self.flow.live = True  # until its socket ends: addons such as map_remote act on live flows only
        self.flow.metadata[ATTEMPT_TAG] = label
        self._wire = {name: headers.get_all(name) for name in secrets_in(headers)}
        arming(v for values in self._wire.values() for v in values)  # masked in any log
        hide_secrets(request)
        self.record = FlowRecord(self.flow, title)
        self._later = self.record.later
        self.ended = False

    # -- before the dial ------------------------------------------------------------------

    async def ask(self) -> None:
        """The request's hooks, through every addon: afterwards `flow.request` is where to dial and
        what to send (`wire_headers`), unless an addon answered (`flow.response`) or killed it."""
        await _run(self.flow, "requestheaders")
        if self.flow.response is None and self.flow.error is None:
            await _run(self.flow, "request")
        await self.flow.wait_for_resume()  # an addon intercepted it: sent once resumed
        self._hide_added()

    def _hide_added(self) -> None:
        hide_added(self.flow.request, self._wire)

    def wire_headers(self) -> list[tuple[bytes, bytes]]:
        """The head's headers as the hooks left them, each placeholder replaced by its real value."""
        real = {name: list(values) for name, values in self._wire.items()}
        out = []
        for name, value in self.flow.request.headers.fields:
            key = name.decode("latin-1").lower()
            if value == PLACEHOLDER.encode() and real.get(key):  # one placeholder stands for all of a name's values
                out += [(name, v.encode("utf-8", "surrogateescape")) for v in real.pop(key)]  # as Headers stores str
            else:
                out.append((name, value))
        return out

    # -- the upstream's answer ------------------------------------------------------------

    async def accepted(self, headers: list[tuple[bytes, bytes]]) -> None:
        self.flow.response = _response(101, headers, b"")
        self.flow.websocket = websocket.WebSocketData()
        self._later(_run(self.flow, "responseheaders", "response", "websocket_start"))  # before any end
        await self.record.settled()

    async def rejected(self, status: int, headers: list[tuple[bytes, bytes]], body: bytes, verdict: str) -> None:
        response = self.flow.response = _response(status, headers, b"")
        encoding = response.headers.pop("content-encoding", None)  # shown decoded
        response.content = masked_body(body, encoding)
        self.judge_socket(story.REJECTED, verdict, update=False)
        self.ended, self.flow.live = True, False
        await _run(self.flow, "responseheaders")
        await _run(self.flow, "response")

    def abandoned(self) -> None:
        """The dial was cancelled (the client left): the flow ends as a killed one, its hooks later."""
        if self.ended:
            return
        if self.flow.websocket is not None:
            self.end(1001, "codex-failover: the client left", True)
            return
        self.flow.error = mitmflow.Error(mitmflow.Error.KILLED_MESSAGE)
        self.ended, self.flow.live = True, False
        self._later(_run(self.flow, "error"))

    async def failed(self, message: str, verdict: str) -> None:
        if self.flow.error is None:
            self.flow.error = mitmflow.Error(SECRETS.mask(message))
        self.judge_socket(story.NO_CONNECTION, verdict, update=False)
        self.ended, self.flow.live = True, False
        await _run(self.flow, "error")

    # -- the open socket ------------------------------------------------------------------

    def message(self, content: bytes, is_text: bool, from_client: bool) -> None:
        if not self.ended:
            self.record.message(content, is_text, from_client)

    def judge_socket(self, mark: str, line: str, update: bool = True) -> None:
        """A verdict on this socket (a turn's, or its upgrade's): on its flow (FlowRecord.judge)."""
        self.record.judge(mark, line, update)

    def end(self, code: int, reason: str, by_client: bool) -> None:
        """The socket ended (`by_client`: the gate closed it): `websocket_end`, once."""
        if self.ended or self.flow.websocket is None:
            return
        self.ended, self.flow.live = True, False
        ws = self.flow.websocket
        ws.close_code, ws.close_reason, ws.closed_by_client, ws.timestamp_end = code, reason, by_client, time.time()
        if self.flow.response is not None:  # (the 101's: a socket is open)
            self.flow.response.timestamp_end = time.time()
        self._later(_run(self.flow, "websocket_end"))


def _response(status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> http.Response:
    """A response as the upstream gave it. (Its trailers are given and then taken away: mitmproxy's
    type check of `None` raises and catches a TypeError whose traceback would keep the caller's
    frames, and with them a finished session, until the garbage collector runs.)"""
    now = time.time()
    response = http.Response(b"HTTP/1.1", status, b"", http.Headers(list(headers)), body, http.Headers(), now, now)
    response.data.trailers = None
    return response


def masked_body(body: bytes, encoding: str | None) -> bytes:
    """A rejection's body as mitmweb shows it, decoded (bounded), with a key it echoes masked."""
    decoded = bounded_decode.decode(body, encoding, 4 * len(body) + 65536)
    text = decoded.content if decoded.content is not None else b"(codex-failover: the body decodes past its bound)"
    return SECRETS.mask(text.decode("latin-1")).encode("latin-1")


async def _run(flow: http.HTTPFlow, *names: str) -> None:
    """Hooks `names` on `flow` in turn through every addon, as mitmproxy runs a flow's hooks (and its update)."""
    master = getattr(ctx, "master", None)  # none outside a running mitmproxy (unit tests)
    if master is None:
        return
    for name in names:
        try:
            await master.addons.handle_lifecycle(hooks.all_hooks[name](flow))
        except Exception as exc:  # noqa: BLE001 - an addon's failure is logged by the dispatch; this is ours
            log.error("codex-failover internal error running %s on a WebSocket leg: %r", name, exc)


async def _update(flow: http.HTTPFlow) -> None:
    """mitmweb's view shows the flow as it is now (a verdict): the `update` hook, if any addon listens."""
    master = getattr(ctx, "master", None)
    if master is not None and listened("update"):
        await master.addons.trigger_event(hooks.all_hooks["update"]([flow]))

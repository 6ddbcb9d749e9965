"""
Verified demo (mitmproxy 12.3.1): run replayed "attempts" from inside an async
`request` hook using mitmproxy.addons.clientplayback.ReplayHandler directly.

Run:  timeout 60 /work/main/.venv/bin/python /work/main/.scratch/demo_attempts.py
Everything listens on 127.0.0.1 only. No subprocesses are started.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import tempfile
import time

from mitmproxy import ctx, http
from mitmproxy.addons.clientplayback import ReplayHandler
from mitmproxy.connection import Server
from mitmproxy.options import Options
from mitmproxy.tools.dump import DumpMaster

T0 = time.monotonic()


def ts() -> str:
    return f"{time.monotonic() - T0:7.3f}"


EVENTS: list[str] = []  # fake-server / proxy side observations


def ev(msg: str) -> None:
    EVENTS.append(f"{ts()} {msg}")
    print(f"{ts()} [srv] {msg}", flush=True)


# --------------------------------------------------------------------------
# Fake upstream: HTTP/1.1, chunked text/event-stream, 5 events, 50 ms apart
# --------------------------------------------------------------------------
def make_sse_server(name: str, n_events: int = 5, gap: float = 0.05):
    conn_no = 0

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        nonlocal conn_no
        conn_no += 1
        cid = f"{name}#{conn_no}"
        ev(f"{cid} connection open")
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        except Exception as e:
            ev(f"{cid} no request ({type(e).__name__})")
            writer.close()
            return
        lines = head.decode().split("\r\n")
        hdrs = {
            k.strip().lower(): v.strip()
            for k, _, v in (l.partition(":") for l in lines[1:] if l)
        }
        ev(f"{cid} request {lines[0]!r} x-attempt={hdrs.get('x-attempt')}")
        writer.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
            b"Transfer-Encoding: chunked\r\nCache-Control: no-cache\r\n\r\n"
        )
        closed = asyncio.Event()

        async def watch_eof():
            try:
                while await reader.read(1024):
                    pass
            except Exception:
                pass
            closed.set()

        watcher = asyncio.create_task(watch_eof())
        sent = 0
        try:
            for i in range(n_events):
                data = f"data: {name} event {i}\n\n".encode()
                writer.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
                await writer.drain()
                sent += 1
                try:
                    await asyncio.wait_for(closed.wait(), gap)
                    break  # peer closed
                except asyncio.TimeoutError:
                    pass
            if closed.is_set():
                ev(f"{cid} PEER CLOSED connection after {sent} events")
            else:
                writer.write(b"0\r\n\r\n")
                await writer.drain()
                ev(f"{cid} finished sending all {sent} events")
                try:
                    await asyncio.wait_for(closed.wait(), 5)
                    ev(f"{cid} peer closed (after complete response)")
                except asyncio.TimeoutError:
                    ev(f"{cid} peer kept connection open >5s")
        except (ConnectionError, OSError) as e:
            ev(f"{cid} write failed after {sent} events: {e!r}")
        finally:
            watcher.cancel()
            writer.close()

    return handle


# --------------------------------------------------------------------------
# Fake upstream HTTP proxy (CONNECT only) to verify Server.via
# --------------------------------------------------------------------------
async def proxy_handle(reader, writer):
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    first = head.decode().split("\r\n")[0]
    ev(f"PROXY got {first!r}")
    method, target, _ = first.split(" ", 2)
    if method != "CONNECT":
        writer.write(b"HTTP/1.1 405 only CONNECT\r\nContent-Length: 0\r\n\r\n")
        writer.close()
        return
    host, port = target.rsplit(":", 1)
    ur, uw = await asyncio.open_connection(host, int(port))
    writer.write(b"HTTP/1.1 200 Connection established\r\n\r\n")
    await writer.drain()

    async def pipe(r, w):
        try:
            while d := await r.read(65536):
                w.write(d)
                await w.drain()
        except Exception:
            pass
        finally:
            w.close()

    await asyncio.gather(pipe(reader, uw), pipe(ur, writer))


def free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return p


# --------------------------------------------------------------------------
# The addon
# --------------------------------------------------------------------------
class Attempt:
    """One replayed copy of a client flow, with its body streamed into a queue."""

    def __init__(self, flow: http.HTTPFlow, address, label: str, via=None):
        a = flow.copy()  # new flow id, live=False, is_replay copied (None for a live client flow)
        self.copy_is_replay = a.is_replay
        a.request.scheme = "http"
        a.request.host, a.request.port = address  # also rewrites Host header
        a.request.headers["x-attempt"] = label
        a.server_conn = Server(address=address)  # fresh, CLOSED connection
        if via:
            a.server_conn.via = via  # ("http", ("127.0.0.1", port))
        a.is_replay = "request"  # ReplayHandler does NOT set this itself
        a.metadata["attempt"] = label
        self.flow = a
        self.label = label
        self.queue: asyncio.Queue = asyncio.Queue()
        self.handler = ReplayHandler(a, ctx.options)
        self.task = asyncio.create_task(self.handler.replay(), name=f"attempt {label}")

    # sync stream callable, installed in responseheaders
    def on_chunk(self, data: bytes) -> bytes:
        self.queue.put_nowait(("chunk", data))  # b"" == end of message
        return data

    def on_error(self) -> None:
        self.queue.put_nowait(("error", self.flow.error.msg if self.flow.error else "?"))

    async def next(self, timeout: float = 5.0):
        return await asyncio.wait_for(self.queue.get(), timeout)

    async def cancel(self, timeout: float = 5.0) -> None:
        """Close the attempt's upstream connection(s) and wait for replay() to return."""
        if self.flow.killable and not os.environ.get("DEMO_NO_KILL"):
            # Only takes effect at the next hook boundary (check_killed), e.g. if the
            # attempt is still sitting in requestheaders/request -> error hook -> done.
            self.flow.kill()
        for io in list(self.handler.transports.values()):
            if io.handler:
                io.handler.cancel("attempt cancelled")
        try:
            await asyncio.wait_for(asyncio.shield(self.task), timeout)
        except asyncio.TimeoutError:
            self.task.cancel()

    async def finish(self, timeout: float = 5.0) -> None:
        await asyncio.wait_for(self.task, timeout)


class AttemptAddon:
    def __init__(self, cfg):
        self.cfg = cfg
        self.attempts: dict[str, Attempt] = {}
        self.hooklog: list[str] = []

    def _log(self, hook, f):
        tag = f.metadata.get("attempt", "CLIENT") if hasattr(f, "metadata") else "-"
        line = f"{ts()} hook={hook:<20} flow={tag:<8} is_replay={getattr(f, 'is_replay', None)}"
        if hook == "error":
            line += f" error={f.error.msg!r}"
        self.hooklog.append(line)
        print(line, flush=True)

    # ---- http hooks ----
    def requestheaders(self, flow):
        self._log("requestheaders", flow)

    async def request(self, flow: http.HTTPFlow):
        self._log("request", flow)
        if flow.is_replay == "request" or "attempt" in flow.metadata:
            return  # IMPORTANT: hooks also fire for our own attempts
        scen = flow.request.path.strip("/")
        A, B, P, DEAD = (self.cfg[k] for k in ("A", "B", "P", "DEAD"))
        summary: dict = {"scenario": scen}

        if scen == "cancel":
            at = self._start(flow, ("127.0.0.1", A), "a1")
            kind, data = await at.next()
            summary["first"] = [kind, data.decode()]
            await at.cancel()
            summary["attempt_error"] = at.flow.error and at.flow.error.msg
            summary["task_done"] = at.task.done()
            flow.response = http.Response.make(
                503, json.dumps(summary), {"content-type": "application/json"}
            )

        elif scen == "cancel_early":
            at = self._start(flow, ("127.0.0.1", A), "e1")
            summary["copy_is_replay"] = at.copy_is_replay
            summary["transports_at_cancel"] = len(at.handler.transports)
            t = time.monotonic()
            await at.cancel()
            summary["cancel_secs"] = round(time.monotonic() - t, 3)
            summary["attempt_error"] = at.flow.error and at.flow.error.msg
            summary["task_done"] = at.task.done()
            summary["task_cancelled"] = at.task.cancelled()
            flow.response = http.Response.make(
                503, json.dumps(summary), {"content-type": "application/json"}
            )

        elif scen == "race":
            ats = [self._start(flow, ("127.0.0.1", A), f"x{i}") for i in range(3)]
            getters = {asyncio.ensure_future(at.next()): at for at in ats}
            done, pending = await asyncio.wait(getters, timeout=5,
                                               return_when=asyncio.FIRST_COMPLETED)
            winner = getters[next(iter(done))]
            for g in pending:
                g.cancel()
            await asyncio.gather(*(at.cancel() for at in ats))
            summary["winner"] = winner.label
            summary["errors"] = {at.label: at.flow.error and at.flow.error.msg for at in ats}
            summary["all_done"] = all(at.task.done() for at in ats)
            flow.response = http.Response.make(
                503, json.dumps(summary), {"content-type": "application/json"}
            )

        elif scen == "refused":
            at = self._start(flow, ("127.0.0.1", DEAD), "r1")
            kind, data = await at.next()
            await at.finish()
            summary.update(kind=kind, msg=data, replay_result=repr(at.task.result()),
                           attempt_response=repr(at.flow.response))
            flow.response = http.Response.make(
                502, json.dumps(summary), {"content-type": "application/json"}
            )

        elif scen == "via":
            at = self._start(flow, ("127.0.0.1", A), "v1", via=("http", ("127.0.0.1", P)))
            body = b""
            while True:
                kind, data = await at.next()
                if kind != "chunk" or data == b"":
                    break
                body += data
            await at.finish()
            summary.update(body=body.decode(), end=kind,
                           status=at.flow.response.status_code)
            flow.response = http.Response.make(
                200, json.dumps(summary), {"content-type": "application/json"}
            )

        elif scen == "client_refused":
            # no attempt: point the client flow itself at a dead port
            flow.request.host, flow.request.port = "127.0.0.1", DEAD
            flow.server_conn = Server(address=("127.0.0.1", DEAD))

        elif scen in ("redirect", "redirect_noserver", "redirect_via"):
            at = self._start(flow, ("127.0.0.1", A), "d1")
            kind, data = await at.next()
            await at.cancel()
            # now send the *client* flow to server B and stream it live
            flow.request.scheme = "http"
            flow.request.host = "127.0.0.1"
            flow.request.port = B
            flow.request.headers["x-attempt"] = "client->B"
            if scen != "redirect_noserver":
                flow.server_conn = Server(address=("127.0.0.1", B))
            if scen == "redirect_via":
                flow.server_conn.via = ("http", ("127.0.0.1", P))
            flow.metadata["stream_live"] = True

    def responseheaders(self, flow: http.HTTPFlow):
        self._log("responseheaders", flow)
        at = self.attempts.get(flow.id)
        if at is not None:
            flow.response.stream = at.on_chunk
        elif flow.metadata.get("stream_live"):
            flow.response.stream = True

    def response(self, flow):
        self._log("response", flow)
        self.attempts.pop(flow.id, None)

    def error(self, flow):
        self._log("error", flow)
        at = self.attempts.pop(flow.id, None)
        if at is not None:
            at.on_error()

    # ---- connection hooks (to see what happens on the attempt's upstream) ----
    def server_connect(self, data):
        print(f"{ts()} hook=server_connect         {data.server.address} via={data.server.via}", flush=True)

    def server_connected(self, data):
        print(f"{ts()} hook=server_connected       {data.server.address}", flush=True)

    def server_connect_error(self, data):
        print(f"{ts()} hook=server_connect_error   {data.server.address} err={data.server.error!r}", flush=True)

    def server_disconnected(self, data):
        print(f"{ts()} hook=server_disconnected    {data.server.address}", flush=True)

    def _start(self, flow, address, label, via=None) -> Attempt:
        at = Attempt(flow, address, label, via)
        self.attempts[at.flow.id] = at
        return at


# --------------------------------------------------------------------------
# Client through the proxy (raw asyncio, plain http absolute-form)
# --------------------------------------------------------------------------
async def client(proxy_port: int, url_host: str, path: str):
    r, w = await asyncio.open_connection("127.0.0.1", proxy_port)
    w.write(
        f"GET http://{url_host}/{path} HTTP/1.1\r\nHost: {url_host}\r\n"
        f"Accept: text/event-stream\r\nConnection: close\r\n\r\n".encode()
    )
    await w.drain()
    t = time.monotonic()
    out = []
    while True:
        d = await asyncio.wait_for(r.read(65536), 10)
        if not d:
            break
        out.append((round(time.monotonic() - t, 3), d))
    w.close()
    return out


async def main():
    logging.basicConfig(level=logging.WARNING)
    A, B, P, DEAD = free_port(), free_port(), free_port(), free_port()
    srvA = await asyncio.start_server(make_sse_server("A"), "127.0.0.1", A)
    srvB = await asyncio.start_server(make_sse_server("B"), "127.0.0.1", B)
    srvP = await asyncio.start_server(proxy_handle, "127.0.0.1", P)

    confdir = tempfile.mkdtemp(prefix="mitmconf-")
    # connection_strategy / ssl_insecure / listen_* are addon options (proxyserver,
    # tlsconfig...): they only exist after DumpMaster added the default addons.
    opts = Options(confdir=confdir)
    master = DumpMaster(opts, with_termlog=False, with_dumper=False)
    opts.update(listen_host="127.0.0.1", listen_port=0,
                connection_strategy="lazy", ssl_insecure=True)
    addon = AttemptAddon(dict(A=A, B=B, P=P, DEAD=DEAD))
    master.addons.add(addon)
    run_task = asyncio.create_task(master.run())
    ps = master.addons.get("proxyserver")
    for _ in range(100):
        if ps.listen_addrs():
            break
        await asyncio.sleep(0.05)
    pport = ps.listen_addrs()[0][1]
    print(f"proxy on {pport}; A={A} B={B} P={P} DEAD={DEAD}", flush=True)

    results = {}
    try:
        scens = os.environ.get("DEMO_SCENARIOS")
        for scen in scens.split(",") if scens else ["cancel", "cancel_early", "race", "refused", "via", "redirect", "redirect_noserver", "redirect_via", "client_refused"]:
            print(f"\n===== scenario {scen} =====", flush=True)
            out = await asyncio.wait_for(client(pport, f"127.0.0.1:{A}", scen), 15)
            raw = b"".join(d for _, d in out)
            results[scen] = out
            print(f"CLIENT got {len(out)} reads; times={[t for t, _ in out]}")
            print("CLIENT raw:", raw.decode(errors="replace")[:600])
            await asyncio.sleep(0.3)  # let server-side close observations print
    finally:
        master.shutdown()
        try:
            await asyncio.wait_for(run_task, 10)
        except Exception as e:
            print("master.run ended with", repr(e))
        for s in (srvA, srvB, srvP):
            s.close()
    print("\n===== server-side events =====")
    print("\n".join(EVENTS))


if __name__ == "__main__":
    asyncio.run(main())

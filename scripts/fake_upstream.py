#!/usr/bin/env python3
"""A fake Responses API on 127.0.0.1 for rehearsals, tests, the demo and benchmarks.

Each request's behaviour is chosen by its credential: the first scenario name found in the
bearer token or the ChatGPT-Account-ID header (e.g. a key `sk-test-overload-1` is overloaded).
Without one, it streams a normal answer. Every request is logged as one JSON line.

    scripts/fake_upstream [--port 0] [--tls] [--pace 0.02] [--deltas 20] [--log FILE]

It prints `{"listening": PORT, "tls": bool}` on its first stdout line.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import re
import ssl
import sys
import time

SCENARIOS = {
    "overload-eof": "overload `error` event after response.created, then EOF",
    "overload-503": "synchronous HTTP 503 with server_is_overloaded",
    "overload-529": "synchronous HTTP 529",
    "overload": "response.created, in_progress, nested `error` (server_is_overloaded), response.failed",
    "slow-down": "response.failed with slow_down after response.created",
    "usage-limit": "HTTP 429 usage_limit_reached with resets_in_seconds",
    "capacity": "response.failed: Selected model is at capacity",
    "server-error": "`error` server_error with 'You can retry your request' advice",
    "websearch-overload": "a web_search_call item, then an overload",
    "delta-overload": "a text delta, then an overload",
    "invalid": "HTTP 400 invalid_request_error",
    "unauthorized": "HTTP 401",
    "stall-first": "headers, then nothing for --stall seconds, then a normal answer",
    "stall": "response.created, then nothing for --stall seconds, then a normal answer",
    "cut": "response.created and some text, then the connection drops",
    "overload-once": "the credential's first request is overloaded in-stream, later ones are answered",
    "window-full": "a normal answer whose headers say the primary rate-limit window is 100% used",
    "overload-flat": "a flat `error` event (code/message at top level) after response.created, then EOF",
    "rate-429-bare": "HTTP 429 rate_limit_exceeded without Retry-After",
    "rate-429": "HTTP 429 rate_limit_exceeded with Retry-After: 1",
    "stall-after-output": "a text delta, then nothing for --stall seconds, then the rest of the answer",
    "garbage": "garbage lines, invalid UTF-8 and invalid JSON after response.created, then an answer",
    "huge-line": "a 9 MiB data line (over the framer's line limit) after response.created, then an answer",
    "long-bootstrap": "60 keepalive comments before any output (over the hold budget), then an answer",
    "midstream-server-error": "some output, then response.failed with a generic server_error",
    "burst": "a normal answer written in one piece (one chunk, one read)",
    "http-500": "synchronous HTTP 500",
    "http-502": "synchronous HTTP 502",
    "http-503": "synchronous HTTP 503 that is not an overload (service unavailable, no code)",
    "http-504": "synchronous HTTP 504",
    "good": "a normal streamed answer (reasoning summary + text)",
}
ORDER = sorted(SCENARIOS, key=len, reverse=True)  # longest name first: overload-eof before overload
_REJECTION = (b'"type":"error"', b'"type":"response.failed"')
_OUTPUT = (b'"type":"response.reasoning_summary_text.delta"', b'"type":"response.output_text.delta"')
_SEQ = re.compile(rb'"sequence_number":(\d+)')
_RID = re.compile(rb'"id":"(resp_[0-9a-f]+)"')


def scenario_of(headers: dict[str, str]) -> str:
    ident = (headers.get("authorization", "") + " " + headers.get("chatgpt-account-id", "")).lower()
    return next((name for name in ORDER if name in ident), "good")


def label_of(headers: dict[str, str]) -> str:
    """A short, non-secret name for the credential (what the answer says it was served by)."""
    account = headers.get("chatgpt-account-id")
    token = headers.get("authorization", "")[7:]
    return account or (token[:64] if token.startswith("sk-test") else "tok-" + hashlib.sha256(token.encode()).hexdigest()[:8])


def sse(obj: dict) -> bytes:
    return f"event: {obj['type']}\ndata: {json.dumps(obj, separators=(',', ':'))}\n\n".encode()


class Turn:
    """Builds the events of one response."""

    def __init__(self, label: str, deltas: int):
        self.rid = "resp_" + hashlib.sha256(f"{label}{time.time_ns()}".encode()).hexdigest()[:24]
        self.label = label
        self.deltas = deltas
        self.seq = 0

    def ev(self, kind: str, **fields) -> bytes:
        obj = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return sse(obj)

    def handshake(self) -> list[bytes]:
        resp = {"id": self.rid, "object": "response", "status": "in_progress", "model": "gpt-fake", "output": []}
        return [self.ev("response.created", response=resp), self.ev("response.in_progress", response=resp)]

    def answer(self) -> list[bytes]:
        text = f"Hello from {self.label}."
        words = [f" w{i}" for i in range(self.deltas)]
        out = [
            self.ev("response.output_item.added", output_index=0, item={"id": "rs_1", "type": "reasoning", "summary": []}),
            self.ev("response.reasoning_summary_part.added", item_id="rs_1", output_index=0, summary_index=0,
                    part={"type": "summary_text", "text": ""}),
        ]
        out += [self.ev("response.reasoning_summary_text.delta", item_id="rs_1", output_index=0, summary_index=0,
                        delta=f"thinking {i} ") for i in range(max(1, self.deltas // 4))]
        out.append(self.ev("response.output_item.done", output_index=0,
                           item={"id": "rs_1", "type": "reasoning", "summary": [{"type": "summary_text", "text": "thinking"}]}))
        out.append(self.ev("response.output_item.added", output_index=1,
                           item={"id": "msg_1", "type": "message", "role": "assistant", "status": "in_progress", "content": []}))
        out.append(self.ev("response.content_part.added", item_id="msg_1", output_index=1, content_index=0,
                           part={"type": "output_text", "text": "", "annotations": []}))
        for piece in [text, *words]:
            out.append(self.ev("response.output_text.delta", item_id="msg_1", output_index=1, content_index=0, delta=piece))
        full = text + "".join(words)
        item = {"id": "msg_1", "type": "message", "role": "assistant", "status": "completed",
                "content": [{"type": "output_text", "text": full, "annotations": []}]}
        out.append(self.ev("response.output_item.done", output_index=1, item=item))
        out.append(self.ev("response.completed", response={"id": self.rid, "object": "response", "status": "completed",
                                                            "output": [item], "usage": usage(10, self.deltas)}))
        return out

    def overload_error(self) -> bytes:
        return self.ev("error", error={"type": "service_unavailable_error", "code": "server_is_overloaded",
                                       "message": "Our servers are currently overloaded. Please try again later.", "param": None})

    def failed(self, code: str, message: str) -> bytes:
        return self.ev("response.failed", response={"id": self.rid, "status": "failed", "error": {"code": code, "message": message}})


def usage(input_tokens: int, output_tokens: int) -> dict:
    """A complete Responses `usage` object (Codex 0.169 rejects a response.completed without total_tokens)."""
    return {"input_tokens": input_tokens, "input_tokens_details": {"cached_tokens": 0}, "output_tokens": output_tokens,
            "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": input_tokens + output_tokens}


def other_body(path: str) -> dict:
    """The answer to anything that is not a model request. Codex's model catalog
    (`GET …/codex/models`) needs a `models` list: an empty one makes it use its bundled catalog."""
    body = {"data": [], "path": path}
    if path.split("?")[0].endswith("/codex/models"):
        body["models"] = []
    return body


def json_error(status: int, error: dict, extra: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
    return status, {"content-type": "application/json", **(extra or {})}, json.dumps({"error": error}).encode()


SYNC = {
    "overload-503": lambda: json_error(503, {"type": "service_unavailable_error", "code": "server_is_overloaded",
                                             "message": "Our servers are currently overloaded. Please try again later."}),
    "overload-529": lambda: json_error(529, {"type": "overloaded_error", "message": "Overloaded"}),
    "usage-limit": lambda: json_error(429, {"type": "usage_limit_reached", "message": "The usage limit has been reached",
                                            "plan_type": "plus", "resets_at": int(time.time()) + 3600, "resets_in_seconds": 3600}),
    "rate-429": lambda: json_error(429, {"type": "rate_limit_error", "code": "rate_limit_exceeded",
                                         "message": "Rate limit reached."}, {"retry-after": "1"}),
    "rate-429-bare": lambda: json_error(429, {"type": "rate_limit_error", "code": "rate_limit_exceeded",
                                              "message": "Rate limit reached."}),
    "http-500": lambda: json_error(500, {"type": "server_error", "code": "server_error", "message": "Internal error."}),
    "http-502": lambda: json_error(502, {"type": "server_error", "code": "bad_gateway", "message": "Bad gateway."}),
    "http-503": lambda: json_error(503, {"type": "server_error", "code": "upstream_unavailable", "message": "Try again."}),
    "http-504": lambda: json_error(504, {"type": "server_error", "code": "gateway_timeout", "message": "Gateway timeout."}),
    "invalid": lambda: json_error(400, {"type": "invalid_request_error", "code": "invalid_value",
                                        "message": "Invalid value for 'input'.", "param": "input"}),
    "unauthorized": lambda: json_error(401, {"type": "invalid_request_error", "code": "invalid_api_key",
                                             "message": "Incorrect API key provided."}),
}


class FakeUpstream:
    def __init__(self, pace: float = 0.02, deltas: int = 20, stall: float = 3600.0, log=None, trace: bool = False,
                 trace_events: bool = False):
        self.pace, self.deltas, self.stall = pace, deltas, stall
        self.log = log
        self.trace = trace  # log when the first rejection / output event of a response is written
        self.trace_events = trace_events  # log when every event is written (credential, sequence_number)
        self.seen: dict[str, int] = {}  # requests per credential (for overload-once)
        self.forced: dict[str, list[str]] = {}  # credential label -> scenarios of its next model requests
        self._digests: dict[int, "hashlib._Hash"] = {}  # per open response: sha256 of its body
        self.requests: list[dict] = []  # in-process users read this
        self.server: asyncio.Server | None = None
        self.port = 0

    async def start(self, port: int = 0, tls: ssl.SSLContext | None = None) -> int:
        self.server = await asyncio.start_server(self.handle, "127.0.0.1", port, ssl=tls)
        self.port = self.server.sockets[0].getsockname()[1]
        return self.port

    async def close(self) -> None:
        if self.server:
            self.server.close()

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                method, path, headers = parse_head(head)
                body = await read_body(reader, headers)
                keep = await self.respond(method, path, headers, body, reader, writer)
                if not keep:
                    break
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.LimitOverrunError):
            pass
        finally:
            writer.close()

    async def respond(self, method, path, headers, body, reader, writer) -> bool:
        scenario = scenario_of(headers)
        record = {"ts": time.time(), "method": method, "path": path, "credential": label_of(headers),
                  "scenario": scenario, "turn_state": headers.get("x-codex-turn-state")}
        if path in ("/_fake/overload", "/_fake/next") and method == "POST":
            # Test control: the next `count` model requests of `credential` follow `scenario`
            # (default: overload in-stream).
            order = json.loads(body or b"{}")
            queue = self.forced.setdefault(order["credential"], [])
            queue += [order.get("scenario", "overload")] * int(order.get("count", 1))
            self._log({"ts": time.time(), "event": "control", **order})
            await write_full(writer, 200, {"content-type": "application/json"}, b"{}")
            return True
        if not path.split("?")[0].endswith("/responses") or method != "POST":
            record["scenario"] = "other"
            self._log(record)
            status, hdrs, data = (200, {"content-type": "application/json"}, json.dumps(other_body(path)).encode())
            await write_full(writer, status, hdrs, data)
            return True
        if self.forced.get(record["credential"]):
            scenario = record["scenario"] = self.forced[record["credential"]].pop(0)
        record["body_bytes"] = len(body)
        record["session"] = headers.get("session-id") or headers.get("session_id")
        record["proxy_authorization"] = "proxy-authorization" in headers  # must never arrive here
        record.update(request_facts(body, headers))
        self._log(record)
        if scenario == "overload-once":
            label = label_of(headers)
            self.seen[label] = self.seen.get(label, 0) + 1
            scenario = "overload" if self.seen[label] == 1 else "good"
        if scenario in SYNC:
            await write_full(writer, *SYNC[scenario]())
            return True
        await self.stream(scenario, label_of(headers), reader, writer)
        return False

    def _trace(self, ev: bytes, label: str, traced: set[str]) -> None:
        for kind, markers in (("rejection_sent", _REJECTION), ("first_output_sent", _OUTPUT)):
            if kind not in traced and any(m in ev for m in markers):
                traced.add(kind)
                self._log({"ts": time.time(), "event": kind, "credential": label})

    def _log(self, record: dict) -> None:
        self.requests.append(record)
        if self.log:
            self.log.write(json.dumps(record) + "\n")
            self.log.flush()

    async def _stall(self, reader: asyncio.StreamReader, label: str) -> bool:
        """Wait --stall seconds, noticing (and logging) a peer that closes meanwhile."""
        try:
            data = await asyncio.wait_for(reader.read(1), self.stall)
        except TimeoutError:
            return True
        if not data:
            self._log({"ts": round(time.time(), 3), "event": "peer_closed", "credential": label})
            return False
        return True

    async def stream(self, scenario: str, label: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One streamed response; logs `response_sent` with the sha256 of its body when it ends."""
        digest = hashlib.sha256()
        self._digests[id(writer)] = digest
        try:
            await self._stream(scenario, label, reader, writer)
        finally:
            self._digests.pop(id(writer), None)
            self._log({"ts": time.time(), "event": "response_sent", "credential": label,
                       "sha256": digest.hexdigest()})

    async def _stream(self, scenario: str, label: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        turn = Turn(label, self.deltas)
        used = b"100" if scenario == "window-full" else b"10"
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncache-control: no-cache\r\n"
                     b"x-codex-primary-used-percent: " + used + b"\r\nx-codex-primary-reset-after-seconds: 120\r\n"
                     b"x-codex-turn-state: ts-" + label.encode()[-8:] + b"\r\ntransfer-encoding: chunked\r\n\r\n")
        await writer.drain()
        if scenario == "stall-first" and not await self._stall(reader, label):
            return
        events = turn.handshake()
        ending = b"0\r\n\r\n"
        if scenario == "overload":
            events += [turn.overload_error(), turn.failed("server_is_overloaded", "Our servers are currently overloaded.")]
        elif scenario == "overload-eof":
            events += [turn.overload_error()]
        elif scenario == "burst":
            events = [b"".join(events + turn.answer())]
        elif scenario == "midstream-server-error":
            events += turn.answer()[:8] + [turn.failed("server_error", "An error occurred while processing your request.")]
        elif scenario == "overload-flat":
            events += [turn.ev("error", code="server_is_overloaded", message="Our servers are currently overloaded.")]
        elif scenario == "stall-after-output":
            answer = turn.answer()
            await self._send(writer, events + answer[:7], label)  # through the first text delta
            if not await self._stall(reader, label):
                return
            events = answer[7:]
        elif scenario == "garbage":
            events += [b"this line is not SSE at all\n", b"data: {not json}\n\n", b"data: \xff\xfe\xc3(\n\n"] + turn.answer()
        elif scenario == "huge-line":
            events += [b"data: " + b"x" * (9 * 1024 * 1024) + b"\n\n"] + turn.answer()
        elif scenario == "long-bootstrap":
            events = [b": keepalive\n\n"] * 60 + events + turn.answer()
        elif scenario == "slow-down":
            events += [turn.failed("slow_down", "Please slow down.")]
        elif scenario == "capacity":
            events += [turn.failed("server_error", "Selected model is at capacity. Please try a different model.")]
        elif scenario == "server-error":
            events += [turn.ev("error", error={"type": "server_error", "code": "server_error", "param": None,
                                               "message": "An error occurred while processing your request. You can retry your request."})]
        elif scenario == "websearch-overload":
            events += [turn.ev("response.output_item.added", output_index=0,
                               item={"id": "ws_1", "type": "web_search_call", "status": "in_progress"}),
                       turn.overload_error(), turn.failed("server_is_overloaded", "overloaded")]
        elif scenario == "delta-overload":
            events += [turn.ev("response.output_text.delta", item_id="m", output_index=0, content_index=0, delta="Hi"),
                       turn.overload_error(), turn.failed("server_is_overloaded", "overloaded")]
        elif scenario == "stall":
            await self._send(writer, events, label)
            if not await self._stall(reader, label):
                return
            events = turn.answer()
        elif scenario == "cut":
            events += turn.answer()[:4]
            ending = b""
        else:
            events += turn.answer()
        await self._send(writer, events, label)
        if ending:
            writer.write(ending)
            await writer.drain()

    async def _send(self, writer: asyncio.StreamWriter, events: list[bytes], label: str = "") -> None:
        traced: set[str] = set()
        rid = None  # the response id, for --trace-events
        digest = self._digests.get(id(writer))
        for ev in events:
            if digest is not None:
                digest.update(ev)
            writer.write(b"%x\r\n%b\r\n" % (len(ev), ev))
            try:
                await writer.drain()
            except ConnectionError:
                self._log({"ts": time.time(), "event": "peer_closed", "credential": label})
                raise
            if self.trace:
                self._trace(ev, label, traced)
            if self.trace_events:
                rid = rid or ((m := _RID.search(ev)) and m.group(1).decode())
                m = _SEQ.search(ev)
                self._log({"ts": time.time(), "event": "event_sent", "credential": label, "response": rid,
                           "seq": int(m.group(1)) if m else None})
            if self.pace:
                await asyncio.sleep(self.pace)


def parse_head(head: bytes) -> tuple[str, str, dict[str, str]]:
    lines = head.decode("latin-1").split("\r\n")
    method, path, _ = lines[0].split(" ", 2)
    headers = {}
    for line in lines[1:]:
        if ":" in line:
            k, v = line.split(":", 1)
            headers[k.strip().lower()] = v.strip()
    return method, path, headers


async def read_body(reader: asyncio.StreamReader, headers: dict[str, str]) -> bytes:
    if headers.get("transfer-encoding", "").lower() == "chunked":
        out = bytearray()
        while True:
            size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
            if size == 0:
                await reader.readuntil(b"\r\n")
                return bytes(out)
            out += await reader.readexactly(size + 2)
            del out[-2:]
    return await reader.readexactly(int(headers.get("content-length", "0") or 0))


def request_facts(body: bytes, headers: dict[str, str]) -> dict:
    """What the log records about a model request body (never its content)."""
    try:
        if headers.get("content-encoding"):
            from mitmproxy.net import encoding  # zstd, gzip, br, deflate, as mitmproxy does them

            body = encoding.decode(body, headers["content-encoding"])
        doc = json.loads(body)
    except Exception:  # noqa: BLE001 - a fake logs what it can
        return {"body_json": False}
    items = doc.get("input") if isinstance(doc.get("input"), list) else []
    return {
        "body_json": True,
        "previous_response_id": doc.get("previous_response_id"),
        "encrypted_reasoning": sum(1 for i in items if isinstance(i, dict) and i.get("type") == "reasoning"
                                   and i.get("encrypted_content")),
        "input_items": len(items),
    }


async def write_full(writer: asyncio.StreamWriter, status: int, headers: dict[str, str], body: bytes) -> None:
    head = [f"HTTP/1.1 {status} X"] + [f"{k}: {v}" for k, v in headers.items()] + [f"content-length: {len(body)}", "", ""]
    writer.write("\r\n".join(head).encode() + body)
    await writer.drain()


def self_signed_context() -> ssl.SSLContext:
    """A throwaway certificate for 127.0.0.1 (mitmproxy must run with ssl_insecure for it)."""
    import datetime
    import ipaddress
    import tempfile

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "fake-upstream")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(days=1))
            .not_valid_after(now + datetime.timedelta(days=7))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
                                                        x509.DNSName("localhost")]), critical=False)
            .sign(key, hashes.SHA256()))
    with tempfile.NamedTemporaryFile("wb", suffix=".pem", delete=False) as fh:
        fh.write(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
        fh.write(cert.public_bytes(serialization.Encoding.PEM))
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(fh.name)
    return ctx


async def amain(args) -> None:
    log = open(args.log, "a") if args.log else None
    fake = FakeUpstream(args.pace, args.deltas, args.stall, log, args.trace, args.trace_events)
    port = await fake.start(args.port, self_signed_context() if args.tls else None)
    print(json.dumps({"listening": port, "tls": args.tls}), flush=True)
    await asyncio.Event().wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 epilog="scenarios:\n" + "\n".join(f"  {k:<20} {v}" for k, v in SCENARIOS.items()),
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--tls", action="store_true", help="serve HTTPS with a throwaway self-signed certificate")
    ap.add_argument("--pace", type=float, default=0.02, help="seconds between events (default 0.02)")
    ap.add_argument("--deltas", type=int, default=20, help="text deltas per answer (default 20)")
    ap.add_argument("--stall", type=float, default=3600.0, help="seconds a stall scenario waits (default 3600)")
    ap.add_argument("--trace", action="store_true", help="also log when each response's first rejection/output event is sent")
    ap.add_argument("--trace-events", action="store_true",
                    help="also log when every event is written (credential, sequence_number; for benchmarks)")
    ap.add_argument("--log", help="append one JSON line per request to this file (default: stdout)")
    args = ap.parse_args()
    if not args.log:
        args.log = "/dev/stdout"
    try:
        asyncio.run(amain(args))
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    sys.exit(main())

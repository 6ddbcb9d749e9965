#!/usr/bin/env python3
"""A fake Responses API on 127.0.0.1 for rehearsals, tests, the demo and benchmarks.

Each request's behaviour is chosen by its credential: the first scenario name found in the
bearer token or the ChatGPT-Account-ID header (e.g. a key `sk-test-overload-1` is overloaded).
Without one, it streams a normal answer. Every request is logged as one JSON line. Like api.openai.com,
it answers CORS preflights and lets any web origin read its answers (`access-control-allow-origin: *`).

Model requests come as `POST …/responses` (an SSE answer) or, as Codex prefers, as a WebSocket
(`GET …/responses` + `Upgrade: websocket`, see WsSession): a synchronous scenario rejects the upgrade with
its HTTP status; otherwise each `response.create` text message is a turn, answered with the same events,
one per text message. `POST /_fake/next {"credential", "scenario", "count"}` makes the credential's next
`count` model requests (POSTs or WebSocket turns; a synchronous scenario applies to the next handshake)
follow `scenario`.

    scripts/fake_upstream [--port 0] [--tls | --cert PEM] [--pace 0.02] [--deltas 20] [--log FILE]

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
from contextlib import suppress

from fake_oauth import FakeOAuth
from wsproto import ConnectionType, WSConnection
from wsproto.connection import ConnectionState
from wsproto.events import AcceptConnection, CloseConnection, Ping, Request, TextMessage
from wsproto.extensions import PerMessageDeflate
from wsproto.utilities import RemoteProtocolError

SCENARIOS = {
    "overload-eof": "overload `error` event after response.created, then EOF",
    "overload-503": "synchronous HTTP 503 with server_is_overloaded",
    "overload-529": "synchronous HTTP 529",
    "overload": "response.created, in_progress, nested `error` (server_is_overloaded), response.failed",
    "slow-down": "response.failed with slow_down after response.created",
    "usage-limit": "HTTP 429 usage_limit_reached with resets_in_seconds",
    "window-absurd": "a served stream whose usage headers say a window is full until 1e20 (and another: inf)",
    "capacity": "response.failed: Selected model is at capacity",
    "server-error": "`error` server_error with 'You can retry your request' advice",
    "websearch-overload": "a web_search_call item, then an overload",
    "delta-overload": "a text delta, then an overload",
    "invalid": "HTTP 400 invalid_request_error",
    "unauthorized": "HTTP 401",
    "stall-first": "headers, then nothing for --stall seconds, then a normal answer",
    "stall-headers": "nothing for --stall seconds before the response head, then a normal answer",
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
    "flood": "an answer with --flood-mib MiB of text deltas written as fast as the reader takes them",
    "http-500": "synchronous HTTP 500",
    "http-502": "synchronous HTTP 502",
    "http-503": "synchronous HTTP 503 that is not an overload (service unavailable, no code)",
    "http-504": "synchronous HTTP 504",
    "spaced": "a normal answer in JSON with spaces after ':' and ',' (as Python's json.dumps writes it), then the "
              "stream stays open --stall seconds before it ends",
    "toolcall-again": "as toolcall, also on a request that already carries a tool's output (a session of many calls)",
    "linger": "a normal answer through response.completed, then the stream stays open --stall seconds before it ends",
    "toolcall": "a call to an unknown tool (Codex answers it with a follow-up request); a request or turn that "
                "already carries a tool's output (or a compaction of it) gets a normal answer, and the call reports 500 input tokens "
                "(so a low model_auto_compact_token_limit compacts mid-turn)",
    "held-many": "WebSocket turns: 61 holdable messages, then the deltas, all in one burst",
    "overload-400": "HTTP 400 invalid_request_error whose only sign is the message 'Our servers are currently overloaded'",
    "overload-msg": "an `error` event and a response.failed carrying only the overload message (no type, no code)",
    "capacity-400": "HTTP 400 'Selected model is at capacity' with code null",
    "lb-503": "a load balancer's plain-text (HTML) 503 page",
    "deactivated-402": "HTTP 402 {\"detail\": {\"code\": \"deactivated_workspace\"}} (the account's workspace cannot serve)",
    "not-included-429": "HTTP 429 usage_not_included, plan_type free (the plan has no Codex)",
    "workspace-cap-429": "HTTP 429 usage_limit_reached without resets_at, x-codex-rate-limit-reached-type: "
                         "workspace_member_usage_limit_reached",
    "no-pro-model": "HTTP 400 'The 'gpt-pro-fake' model is not supported when using Codex with a ChatGPT account' for "
                    "model gpt-pro-fake (POST or WebSocket turn); any other model is answered",
    "model-404": "HTTP 404 model_not_found",
    "model-param-404": "HTTP 404 with no code and param: model",
    "cf-challenge-403": "HTTP 403 Cloudflare managed challenge ('Just a moment...', cf-mitigated: challenge)",
    "cf-blocked-403": "HTTP 403 Cloudflare block page ('Sorry, you have been blocked')",
    "region-403": "HTTP 403 unsupported_country_region_territory",
    "empty-403": "HTTP 403 with an empty body (also on the WebSocket upgrade)",
    "capacity-top": "response.failed whose `error` is at the event's top level ('Selected model is at capacity')",
    "status-code-503": "WS: an `error` carrying status_code 503 (not status) and no known code",
    "good": "a normal streamed answer (reasoning summary + text)",
    "bomb-gzip": "synchronous HTTP 503, Content-Encoding gzip: about 1 MB that decodes to 1 GiB of zeros",
    "bomb-zstd": "synchronous HTTP 503, Content-Encoding zstd: about 32 KB that decodes to 1 GiB of zeros",
    "echo-key-401": "synchronous HTTP 401 whose message quotes the key it was sent (a gateway that echoes it)",
    # Any model request (POST or WebSocket turn) whose input ends in {"type":"compaction_trigger"} is answered
    # with a `compaction` item, and `POST …/responses/compact` with a JSON compaction (synchronous scenarios
    # apply to both). Encrypted content the fake made is bound to the credential that got it: a request that
    # carries another credential's compaction item or encrypted reasoning is refused with HTTP 400
    # `invalid_encrypted_content`, as the real service refuses it.
    # WebSocket turns only (a POST with these gets a normal answer); `overload`, `usage-limit`,
    # `delta-overload`, `capacity`, `slow-down`, `stall` and `overload-once` also apply to WebSocket turns,
    # as wrapped `error` messages ({"type":"error","status":503,...}) where the POST has an HTTP status.
    "overload-nostatus": "WS: response.created, an `error` without `status`, response.failed (server_is_overloaded)",
    "overload-close": "WS: response.created, an `error` without `status`, then the server closes with 1011",
    "close-after-created": "WS: response.created, then the server closes with 1011",
    "many": "WS: response.created, then --deltas text deltas `d0 `, `d1 `, … in one write, then completed",
    # As the real backend's SSE may be sent: no Content-Type at all (or a wrong one).
    "noctype-overload": "as overload, with no Content-Type header",
    "noctype-good": "as good, with no Content-Type header",
    "wrongtype-good": "as good, labelled Content-Type: application/octet-stream",
    "late-overload": "response.created, then only keepalive comments (every --stall/5 s) for --stall seconds, then "
                     "an overload (a rejection that takes long to arrive)",
}
UNLABELLED = {"noctype-overload": ("overload", b""), "noctype-good": ("good", b""),
              "wrongtype-good": ("good", b"content-type: application/octet-stream\r\n")}
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


def sse_spaced(obj: dict) -> bytes:
    return f"event: {obj['type']}\ndata: {json.dumps(obj)}\n\n".encode()


def ws_text(obj: dict) -> str:
    """An event as the text of one WebSocket message."""
    return json.dumps(obj, separators=(",", ":"))


OVERLOADED = {"type": "service_unavailable_error", "code": "server_is_overloaded",
              "message": "Our servers are currently overloaded. Please try again later.", "param": None}


class Turn:
    """Builds the events of one response, each encoded by `encode`: SSE bytes (sse) or WebSocket text (ws_text)."""

    def __init__(self, label: str, deltas: int, encode=sse, compact: bool = False, encrypted: bool = False):
        self.rid = "resp_" + hashlib.sha256(f"{label}{time.time_ns()}".encode()).hexdigest()[:24]
        self.label = label
        self.deltas = deltas
        self.encode = encode
        self.seq = 0
        self.compact = compact  # answer a compaction_trigger: one compaction item
        self.encrypted = encrypted  # the request asked for reasoning.encrypted_content

    def ev(self, kind: str, **fields):
        obj = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return self.encode(obj)

    def created(self, kind: str = "response.created"):
        return self.ev(kind, response={"id": self.rid, "object": "response", "status": "in_progress", "model": "gpt-fake",
                                       "output": []})

    def handshake(self) -> list:
        return [self.created(), self.created("response.in_progress")]

    def completed(self, output: list, output_tokens: int = 0):
        return self.ev("response.completed", response={"id": self.rid, "object": "response", "status": "completed",
                                                       "output": output, "usage": usage(10, output_tokens)})

    def answer(self) -> list:
        if self.compact:
            item = compaction_item(self.label)
            return [self.ev("response.output_item.added", output_index=0, item={"id": item["id"], "type": "compaction"}),
                    self.ev("response.output_item.done", output_index=0, item=item), self.completed([item], 5)]
        text = f"Hello from {self.label}."
        words = [f" w{i}" for i in range(self.deltas)]
        out = [
            self.ev("response.output_item.added", output_index=0, item={"id": "rs_1", "type": "reasoning", "summary": []}),
            self.ev("response.reasoning_summary_part.added", item_id="rs_1", output_index=0, summary_index=0,
                    part={"type": "summary_text", "text": ""}),
        ]
        out += [self.ev("response.reasoning_summary_text.delta", item_id="rs_1", output_index=0, summary_index=0,
                        delta=f"thinking {i} ") for i in range(max(1, self.deltas // 4))]
        reasoning = {"id": "rs_" + self.rid[-12:], "type": "reasoning", "summary": [{"type": "summary_text", "text": "thinking"}]}
        if self.encrypted:
            reasoning["encrypted_content"] = sealed(self.label)
        out.append(self.ev("response.output_item.done", output_index=0, item=reasoning))
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
        out.append(self.completed([item], self.deltas))
        return out

    def overload_error(self):
        return self.ev("error", error=OVERLOADED)

    def wrapped(self, status: int, error: dict, **extra):
        """A WebSocket error wrapping an HTTP status: {"type":"error","status":503,"error":{…}} (no sequence_number)."""
        return self.encode({"type": "error", "status": status, "error": error, **extra})

    def failed(self, code: str, message: str):
        return self.ev("response.failed", response={"id": self.rid, "status": "failed", "error": {"code": code, "message": message}})


COMPACT = "/responses/compact"


def owner_tag(label: str) -> str:
    return hashlib.sha256(label.encode()).hexdigest()[:12]


def sealed(label: str) -> str:
    """Encrypted content as this fake makes it: readable only by the credential `label`."""
    return f"enc.{owner_tag(label)}.{hashlib.sha256(str(time.time_ns()).encode()).hexdigest()[:32]}"


def compaction_item(label: str) -> dict:
    return {"type": "compaction", "id": "cmp_" + hashlib.sha256(f"{label}{time.time_ns()}".encode()).hexdigest()[:20],
            "encrypted_content": sealed(label)}


def compact_answer(label: str) -> bytes:
    """`POST …/responses/compact`: the compacted history, one compaction item."""
    rid = "resp_" + hashlib.sha256(f"{label}{time.time_ns()}".encode()).hexdigest()[:24]
    return json.dumps({"id": rid, "object": "response.compaction", "created_at": int(time.time()),
                       "output": [compaction_item(label)], "usage": usage(100, 5)}).encode()


def foreign_encrypted(items: list, label: str) -> int:
    """How many of the input's encrypted items this fake made for another credential than `label`."""
    mine = owner_tag(label)
    return sum(1 for i in items if isinstance(i, dict) and isinstance(i.get("encrypted_content"), str)
               and i["encrypted_content"].startswith("enc.") and i["encrypted_content"].split(".")[1] != mine)


def foreign_content_error() -> tuple[int, dict[str, str], bytes]:
    return json_error(400, {"type": "invalid_request_error", "code": "invalid_encrypted_content",
                            "message": "The encrypted content could not be verified.", "param": "input"})


def usage(input_tokens: int, output_tokens: int) -> dict:
    """A complete Responses `usage` object (Codex 0.169 rejects a response.completed without total_tokens)."""
    return {"input_tokens": input_tokens, "input_tokens_details": {"cached_tokens": 0}, "output_tokens": output_tokens,
            "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": input_tokens + output_tokens}


def other_body(path: str, account: str | None = None) -> dict:
    """The answer to anything that is not a model request. Codex's model catalog
    (`GET …/codex/models`) needs a `models` list: an empty one makes it use its bundled catalog.
    ChatGPT mode's workspace routing discovery (`GET …/wham/accounts/check`) must list the account
    Codex is signed in with, on chatgpt.com."""
    body = {"data": [], "path": path}
    if path.split("?")[0].endswith("/codex/models"):
        body["models"] = []
    if path.split("?")[0].endswith("/wham/accounts/check") and account:
        body = {"accounts": [{"id": account, "plan_type": "plus", "workspace_backend_origin": "https://chatgpt.com",
                              "account_routing_override": "NO_CONSTRAINT", "name": None, "structure": "personal"}],
                "account_ordering": [account], "default_account_id": account}
    return body


def usage_body(used: float) -> dict:
    """`GET …/wham/usage` as Codex reads it: the plan, whether it may send, and both windows."""
    now, used = int(time.time()), int(used)  # whole numbers: Codex reads them as integers
    limited = used >= 100
    window = lambda seconds, pct: {"used_percent": pct, "limit_window_seconds": seconds,  # noqa: E731
                                   "reset_after_seconds": 3600, "reset_at": now + 3600}
    return {"plan_type": "plus", "rate_limit": {"allowed": not limited, "limit_reached": limited,
                                                "primary_window": window(18000, used),
                                                "secondary_window": window(604800, min(used, 50))},
            "credits": {"has_credits": False, "unlimited": False, "balance": "0"},
            # what the real answer also carries, and Codex does not read: the account's identity
            "user_id": "user-fake", "account_id": "account-fake", "email": "someone@example.com"}


BOMB_MIB = 1024
_bombs: dict[str, bytes] = {}


def bomb(encoding: str) -> tuple[int, dict[str, str], bytes]:
    """A 503 whose body decodes to BOMB_MIB MiB of zeros: compressed a MiB at a time (never whole in
    memory), built once per process."""
    if encoding not in _bombs:
        if encoding == "gzip":
            import zlib
            packer = zlib.compressobj(9, zlib.DEFLATED, 31)
        else:
            try:
                from compression import zstd
            except ImportError:
                from backports import zstd
            packer = zstd.ZstdCompressor()
        zeros = bytes(1 << 20)
        _bombs[encoding] = b"".join(packer.compress(zeros) for _ in range(BOMB_MIB)) + packer.flush()
    return 503, {"content-type": "application/json", "content-encoding": encoding}, _bombs[encoding]


def echo_key(headers: dict[str, str]) -> tuple[int, dict[str, str], bytes]:
    key = headers.get("authorization", "")[7:]
    return json_error(401, {"type": "invalid_request_error", "code": "invalid_api_key",
                            "message": f"Incorrect API key provided: {key}. Token was {headers.get('authorization', '')}"})


def json_error(status: int, error: dict, extra: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
    return status, {"content-type": "application/json", **(extra or {})}, json.dumps({"error": error}).encode()


PRO_MODEL = "gpt-pro-fake"  # the model the `no-pro-model` credential's plan lacks


def not_entitled() -> tuple[int, dict[str, str], bytes]:
    return 400, {"content-type": "application/json"}, json.dumps(
        {"detail": f"The '{PRO_MODEL}' model is not supported when using Codex with a ChatGPT account."}).encode()


# Scenarios after which the connection closes anyway: a stall has read from the request side.
KEEP_NOT = {"stall", "stall-first", "stall-headers", "stall-after-output"}

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
    "overload-400": lambda: json_error(400, {"type": "invalid_request_error",
                                             "message": "Our servers are currently overloaded. Please try again later."}),
    "capacity-400": lambda: json_error(400, {"type": "invalid_request_error", "code": None, "param": None,
                                             "message": "Selected model is at capacity. Please try a different model."}),
    "lb-503": lambda: (503, {"content-type": "text/html"},
                       b"<html><head><title>503 Service Temporarily Unavailable</title></head><body>"
                       b"<center><h1>503 Service Temporarily Unavailable</h1></center><hr><center>nginx</center></body></html>"),
    "deactivated-402": lambda: (402, {"content-type": "application/json"}, b'{"detail":{"code":"deactivated_workspace"}}'),
    "not-included-429": lambda: json_error(429, {"type": "usage_not_included", "plan_type": "free", "message":
                                                 "To use Codex with your ChatGPT plan, upgrade to Plus."}),
    "workspace-cap-429": lambda: json_error(429, {"type": "usage_limit_reached", "plan_type": "team",
                                                  "message": "The usage limit has been reached"},
                                            {"x-codex-rate-limit-reached-type": "workspace_member_usage_limit_reached"}),
    "model-404": lambda: json_error(404, {"type": "invalid_request_error", "code": "model_not_found", "param": None,
                                          "message": "The model `gpt-fake` does not exist or you do not have access to it."}),
    "model-param-404": lambda: json_error(404, {"type": "invalid_request_error", "code": None, "param": "model",
                                                "message": "Model not available for this account."}),
    "cf-challenge-403": lambda: (403, {"content-type": "text/html; charset=UTF-8", "cf-mitigated": "challenge"},
                                 b"<!DOCTYPE html><html><head><title>Just a moment...</title></head><body>"
                                 b"<noscript>Enable JavaScript and cookies to continue</noscript></body></html>"),
    "cf-blocked-403": lambda: (403, {"content-type": "text/html"},
                               b"<html><head><title>Attention Required! | Cloudflare</title></head><body>"
                               b"<h1>Sorry, you have been blocked</h1></body></html>"),
    "region-403": lambda: json_error(403, {"type": "request_forbidden", "code": "unsupported_country_region_territory",
                                           "param": None, "message": "Country, region, or territory not supported"}),
    "empty-403": lambda: (403, {}, b""),
    "invalid": lambda: json_error(400, {"type": "invalid_request_error", "code": "invalid_value",
                                        "message": "Invalid value for 'input'.", "param": "input"}),
    "bomb-gzip": lambda: bomb("gzip"),
    "bomb-zstd": lambda: bomb("zstd"),
    "unauthorized": lambda: json_error(401, {"type": "invalid_request_error", "code": "invalid_api_key",
                                             "message": "Incorrect API key provided."}),
}


class FakeUpstream:
    def __init__(self, pace: float = 0.02, deltas: int = 20, stall: float = 3600.0, log=None, trace: bool = False,
                 trace_events: bool = False, flood_mib: int = 200):
        self.pace, self.deltas, self.stall, self.flood_mib = pace, deltas, stall, flood_mib
        self.log = log
        self.trace = trace  # log when the first rejection / output event of a response is written
        self.trace_events = trace_events  # log when every event is written (credential, sequence_number)
        self.seen: dict[str, int] = {}  # requests per credential (for overload-once)
        self.forced: dict[str, list[str]] = {}  # credential label -> scenarios of its next model requests
        self.used: dict[str, float] = {}  # credential label -> used percent its usage endpoint reports
        self.episodes: dict[str, list[tuple[float, float]]] = {}  # credential label -> overloaded windows (monotonic)
        self.max_per_s: dict[str, float] = {}  # credential label -> model requests a second it takes
        self.recent: dict[str, list[float]] = {}  # credential label -> its model requests' times, the last second
        self._digests: dict[int, "hashlib._Hash"] = {}  # per open response: sha256 of its body
        self.requests: list[dict] = []  # in-process users read this
        self.sockets = 0  # WebSocket connections so far (their ids in the log)
        self.connections = 0  # TCP connections accepted so far; each request's log line names its own ("conn")
        self.idle: dict[int, asyncio.StreamWriter] = {}  # connections waiting for their next request
        self.server: asyncio.Server | None = None
        self.port = 0
        self.oauth = FakeOAuth(self._log)  # the token endpoint (fake_oauth.py), at /oauth/token

    async def start(self, port: int = 0, tls: ssl.SSLContext | None = None) -> int:
        self.server = await asyncio.start_server(self.handle, "127.0.0.1", port, ssl=tls)
        self.port = self.server.sockets[0].getsockname()[1]
        return self.port

    async def close(self) -> None:
        if self.server:
            self.server.close()

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One connection: HTTP/1.1 keep-alive, streamed answers included (chunked)."""
        self.connections += 1
        conn = self.connections
        try:
            while True:
                self.idle[conn] = writer
                head = await reader.readuntil(b"\r\n\r\n")
                self.idle.pop(conn, None)
                method, path, headers = parse_head(head)
                body = await read_body(reader, headers)
                keep = await self.respond(method, path, headers, body, reader, writer, head, conn)
                if not keep:
                    break
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.LimitOverrunError):
            pass
        finally:
            self.idle.pop(conn, None)
            writer.close()

    async def respond(self, method, path, headers, body, reader, writer, head: bytes = b"", conn: int = 0) -> bool:
        scenario = scenario_of(headers)
        record = {"ts": time.time(), "method": method, "path": path, "credential": label_of(headers),
                  "scenario": scenario, "turn_state": headers.get("x-codex-turn-state"), "conn": conn}
        record["auth_sha"] = hashlib.sha256(headers.get("authorization", "").encode()).hexdigest()[:12]
        if path.startswith("/_fake/oauth/") and method == "POST":
            order = json.loads(body or b"{}")
            if path == "/_fake/oauth/account":
                self.oauth.seed(order)
            else:
                self.oauth.next.append(order)
            await write_full(writer, 200, {"content-type": "application/json"}, b"{}")
            return True
        if path.split("?")[0] == "/oauth/token" and method == "POST":
            if self.oauth.next and self.oauth.next[0].get("delay"):  # a slow answer: a refresh stays in flight
                self._log({"ts": time.time(), "event": "oauth_waiting"})  # (a test acts while it waits)
                await asyncio.sleep(float(self.oauth.next[0]["delay"]))
            status, answer = self.oauth.token(body, headers)
            await write_full(writer, status, {"content-type": "application/json"}, json.dumps(answer).encode())
            return True
        if headers.get("authorization", "")[7:] in self.oauth.revoked:
            record["scenario"] = "revoked"
            self._log(record)
            await write_full(writer, *json_error(401, {"message": "Your authentication token has expired.",
                                                       "type": "invalid_request_error", "code": "token_expired"}))
            return True
        if path == "/_fake/close-idle" and method == "POST":
            # Test control: close every connection waiting for its next request (a server's idle timeout).
            closed = len(self.idle)
            for idle in list(self.idle.values()):
                idle.close()
            self._log({"ts": time.time(), "event": "control", "closed_idle": closed})
            await write_full(writer, 200, {"content-type": "application/json"}, json.dumps({"closed": closed}).encode())
            return True
        if path in ("/_fake/overload", "/_fake/next") and method == "POST":
            # Test control: the next `count` model requests of `credential` follow `scenario`
            # (default: overload in-stream).
            order = json.loads(body or b"{}")
            queue = self.forced.setdefault(order["credential"], [])
            queue += [order.get("scenario", "overload")] * int(order.get("count", 1))
            self._log({"ts": time.time(), "event": "control", **order})
            await write_full(writer, 200, {"content-type": "application/json"}, b"{}")
            return True
        if path == "/_fake/episodes" and method == "POST":
            # Test control: the credential is overloaded during each [start, end) window (seconds from
            # now), and, with `max_per_s`, whenever it already serves that many model requests this
            # second (load it cannot take: spilled load overloads it).
            order = json.loads(body or b"{}")
            now = time.monotonic()
            self.episodes[order["credential"]] = [(now + a, now + b) for a, b in order.get("windows", [])]
            if order.get("max_per_s"):
                self.max_per_s[order["credential"]] = float(order["max_per_s"])
            self._log({"ts": time.time(), "event": "control", **order})
            await write_full(writer, 200, {"content-type": "application/json"}, b"{}")
            return True
        if path == "/_fake/usage" and method == "POST":
            # Test control: what the credential's usage endpoint reports from now on (used percent).
            order = json.loads(body or b"{}")
            self.used[order["credential"]] = float(order["used_percent"])
            self._log({"ts": time.time(), "event": "control", **order})
            await write_full(writer, 200, {"content-type": "application/json"}, b"{}")
            return True
        if method == "GET" and path.split("?")[0].endswith(("/wham/usage", "/api/codex/usage")):
            record["scenario"] = "usage"
            self._log(record)
            await write_full(writer, 200, {"content-type": "application/json"},
                             json.dumps(usage_body(self.used.get(record["credential"], 10.0))).encode())
        if method == "OPTIONS":  # a CORS preflight: allowed from anywhere, as api.openai.com does
            record["scenario"] = "other"
            self._log(record)
            await write_full(writer, 204, {"access-control-allow-methods": "POST, GET, OPTIONS",
                                           "access-control-allow-headers": headers.get("access-control-request-headers", "*"),
                                           "access-control-max-age": "0"}, b"")
            return True
        if method == "GET" and path.split("?")[0].endswith("/responses") and headers.get("upgrade", "").lower() == "websocket":
            await self.websocket(head, path, headers, reader, writer)
            return False
        if not path.split("?")[0].endswith(("/responses", COMPACT)) or method != "POST":
            record["scenario"] = "other"
            self._log(record)
            status, hdrs, data = (200, {"content-type": "application/json"}, json.dumps(other_body(path, headers.get("chatgpt-account-id"))).encode())
            await write_full(writer, status, hdrs, data)
            return True
        if self.forced.get(record["credential"]):
            scenario = record["scenario"] = self.forced[record["credential"]].pop(0)
        elif self._overloaded_now(record["credential"]):
            scenario = record["scenario"] = "overload"
        record["body_bytes"] = len(body)
        record["session"] = headers.get("session-id") or headers.get("session_id")
        record["proxy_authorization"] = "proxy-authorization" in headers  # must never arrive here
        record["account_headers"] = {k: headers[k] for k in ("openai-organization", "openai-project") if k in headers}
        record["attestation"] = "x-oai-attestation" in headers  # (the Desktop app's; never its value)
        record.update(request_facts(body, headers))
        self._log(record)
        if scenario == "overload-once":
            label = label_of(headers)
            self.seen[label] = self.seen.get(label, 0) + 1
            scenario = "overload" if self.seen[label] == 1 else "good"
        if scenario == "echo-key-401":
            await write_full(writer, *echo_key(headers))
            return True
        if scenario == "no-pro-model":
            if record.get("model") == PRO_MODEL:
                await write_full(writer, *not_entitled())
                return True
            scenario = "good"
        if scenario in SYNC:
            await write_full(writer, *SYNC[scenario]())
            return True
        if record.get("foreign_encrypted"):
            await write_full(writer, *foreign_content_error())
            return True
        if path.split("?")[0].endswith(COMPACT):
            await write_full(writer, 200, {"content-type": "application/json"}, compact_answer(label_of(headers)))
            return True
        if scenario == "toolcall" and (record.get("tool_output") or record.get("compaction")):  # the call was made
            scenario = "good"
        return await self.stream(scenario, label_of(headers), reader, writer, record.get("compaction_trigger", False),
                                 record.get("encrypted_reasoning_requested", False))

    async def websocket(self, head: bytes, path: str, headers: dict[str, str], reader, writer) -> None:
        """A WebSocket handshake: a synchronous scenario (the credential's or the next forced one) rejects
        it with its HTTP status; otherwise a WsSession serves the turns."""
        label, scenario = label_of(headers), scenario_of(headers)
        queue = self.forced.get(label)
        if queue and queue[0] in SYNC:  # other forced scenarios are for the turns
            scenario = queue.pop(0)
        self.sockets += 1
        self._log({"ts": time.time(), "method": "GET", "path": path, "credential": label, "scenario": scenario,
                   "websocket": True, "socket": self.sockets, "turn_state": headers.get("x-codex-turn-state"),
                   "session": headers.get("session-id") or headers.get("session_id"), "headers_seen": sorted(headers)})
        if scenario in SYNC:
            await write_full(writer, *SYNC[scenario]())
            return
        await WsSession(self, self.sockets, label, scenario, reader, writer).run(head)

    def _overloaded_now(self, label: str) -> bool:
        """In one of the credential's overload episodes, or over the load it takes (/_fake/episodes)."""
        now = time.monotonic()
        if any(a <= now < b for a, b in self.episodes.get(label, ())):
            return True
        limit = self.max_per_s.get(label)
        if limit is None:
            return False
        recent = self.recent.setdefault(label, [])
        recent[:] = [t for t in recent if now - t < 1.0]
        if len(recent) >= limit:
            return True  # a rejection costs it nothing: only the requests it serves count
        recent.append(now)
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

    async def stream(self, scenario: str, label: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                     compact: bool = False, encrypted: bool = False) -> bool:
        """One streamed response; logs `response_sent` with the sha256 of its body when it ends.
        True: the connection may carry the next request (the chunked body ended cleanly)."""
        digest = hashlib.sha256()
        self._digests[id(writer)] = digest
        try:
            return await self._stream(scenario, label, reader, writer, compact, encrypted) and scenario not in KEEP_NOT
        finally:
            self._digests.pop(id(writer), None)
            self._log({"ts": time.time(), "event": "response_sent", "credential": label,
                       "sha256": digest.hexdigest()})

    async def _stream(self, scenario: str, label: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                      compact: bool = False, encrypted: bool = False) -> bool:
        if scenario == "stall-headers" and not await self._stall(reader, label):
            return False
        scenario, ctype = UNLABELLED.get(scenario, (scenario, b"content-type: text/event-stream\r\n"))
        turn = Turn(label, self.deltas, sse_spaced if scenario == "spaced" else sse, compact=compact, encrypted=encrypted)
        used = b"100" if scenario == "window-full" else b"10"
        window = (b"x-codex-primary-used-percent: " + used + b"\r\nx-codex-primary-reset-after-seconds: 120\r\n"
                  if scenario != "window-absurd" else
                  b"x-codex-primary-used-percent: 1e20\r\nx-codex-primary-reset-at: 1e20\r\n"
                  b"x-codex-secondary-used-percent: 100\r\nx-codex-secondary-reset-after-seconds: inf\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\n" + ctype + b"cache-control: no-cache\r\n"
                     b"access-control-allow-origin: *\r\n" + window +
                     b"x-codex-turn-state: ts-" + label.encode()[-8:] + b"\r\ntransfer-encoding: chunked\r\n\r\n")
        await writer.drain()
        if scenario == "stall-first" and not await self._stall(reader, label):
            return False
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
        elif scenario == "overload-msg":
            message = "Our servers are currently overloaded. Please try again later."
            events += [turn.ev("error", message=message),
                       turn.ev("response.failed", response={"id": turn.rid, "object": "response", "status": "failed",
                                                            "output": [], "error": {"message": message}})]
        elif scenario == "flood":
            answer = turn.answer()
            await self._send(writer, events + answer[:7], label)  # through the first text delta
            delta = turn.ev("response.output_text.delta", item_id="m", output_index=0, content_index=0,
                            delta="x" * (64 * 1024))
            chunk = b"%x\r\n%b\r\n" % (len(delta), delta)
            for _ in range(self.flood_mib * 16):
                writer.write(chunk)
                await writer.drain()
            events = answer[7:]
        elif scenario == "stall-after-output":
            answer = turn.answer()
            await self._send(writer, events + answer[:7], label)  # through the first text delta
            if not await self._stall(reader, label):
                return False
            events = answer[7:]
        elif scenario in ("linger", "spaced"):  # as a real upstream may: the last event well before the stream's end
            await self._send(writer, events + turn.answer(), label)
            if not await self._stall(reader, label):
                return False
            events = []
        elif scenario == "garbage":
            events += [b"this line is not SSE at all\n", b"data: {not json}\n\n", b"data: \xff\xfe\xc3(\n\n"] + turn.answer()
        elif scenario == "huge-line":
            events += [b"data: " + b"x" * (9 * 1024 * 1024) + b"\n\n"] + turn.answer()
        elif scenario == "long-bootstrap":
            events = [b": keepalive\n\n"] * 60 + events + turn.answer()
        elif scenario == "slow-down":
            events += [turn.failed("slow_down", "Please slow down.")]
        elif scenario == "capacity-top":
            events += [turn.ev("response.failed", error={"type": "server_error", "code": None, "message":
                                                         "Selected model is at capacity. Please try a different model."},
                               response={"id": turn.rid, "object": "response", "status": "failed", "output": [], "error": None})]
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
        elif scenario == "late-overload":
            await self._send(writer, events, label)
            for _ in range(5):
                await asyncio.sleep(self.stall / 5)
                await self._send(writer, [b": keepalive\n\n"], label)
            events = [turn.overload_error(), turn.failed("server_is_overloaded", "Our servers are currently overloaded.")]
        elif scenario == "stall":
            await self._send(writer, events, label)
            if not await self._stall(reader, label):
                return False
            events = turn.answer()
        elif scenario == "cut":
            events += turn.answer()[:4]
            ending = b""
        elif scenario in ("toolcall", "toolcall-again") and not compact:
            call = {"id": "fc_" + turn.rid[-8:], "type": "function_call", "status": "completed",
                    "call_id": f"call_{turn.rid[-8:]}", "name": "fake_unknown_tool", "arguments": "{}"}
            events += [turn.ev("response.output_item.added", output_index=0, item=call),
                       turn.ev("response.output_item.done", output_index=0, item=call),
                       turn.ev("response.completed", response={"id": turn.rid, "object": "response", "status": "completed",
                                                               "output": [call], "usage": usage(500, 20)})]
        else:
            events += turn.answer()
        await self._send(writer, events, label)
        if ending:
            writer.write(ending)
            await writer.drain()
        return bool(ending)

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
                kind = ev.split(b"\n", 1)[0].removeprefix(b"event: ").decode(errors="replace")
                self._log({"ts": time.time(), "event": "event_sent", "credential": label, "response": rid,
                           "seq": int(m.group(1)) if m else None, "type": kind})
            if self.pace:
                await asyncio.sleep(self.pace)


class WsSession:
    """One Responses-over-WebSocket connection. Each `response.create` text message is a turn, whose scenario is
    the credential's next forced one, else the handshake's; its events go out one per text message, paced.
    A `generate: false` create (a warm-up) is answered without output; a `previous_response_id` that this socket
    did not send is answered with previous_response_not_found."""

    def __init__(self, fake: FakeUpstream, socket_id: int, label: str, scenario: str, reader, writer):
        self.fake, self.id, self.label, self.scenario = fake, socket_id, label, scenario
        self.reader, self.writer = reader, writer
        self.ws = WSConnection(ConnectionType.SERVER)
        self.creates: asyncio.Queue[dict | None] = asyncio.Queue()  # None: the client is gone
        self.gone = asyncio.Event()  # closed (or closing) by either side
        self.issued: set[str] = set()  # response ids of this socket: the valid previous_response_id values
        self.turns = 0
        self.traced: set[str] = set()  # for --trace, per turn
        self.ended = False  # ws_closed logged

    async def run(self, head: bytes) -> None:
        try:
            self.ws.receive_data(head)
            next(e for e in self.ws.events() if isinstance(e, Request))
        except (RemoteProtocolError, StopIteration):
            await write_full(self.writer, 400, {"content-type": "text/plain"}, b"bad WebSocket handshake")
            return
        self.writer.write(self.ws.send(AcceptConnection(extensions=[PerMessageDeflate()], extra_headers=[
            (b"x-codex-turn-state", b"ts-" + self.label.encode()[-8:])])))  # no openai-model: Codex would report a reroute
        await self.writer.drain()
        reading = asyncio.create_task(self._read())
        try:
            while not self.gone.is_set() and (create := await self.creates.get()) is not None:
                await self.turn(create)
            with suppress(TimeoutError):  # after a server close: the client's answer, briefly
                await asyncio.wait_for(reading, 2)
        finally:
            reading.cancel()
            self._ended(1006, "client")  # unless a close was logged: the connection just dropped

    async def _read(self) -> None:
        """Answers pings and closes, queues the creates."""
        text = ""
        try:
            while data := await self.reader.read(65536):
                self.ws.receive_data(data)
                for event in self.ws.events():
                    if isinstance(event, Ping) and self.ws.state is ConnectionState.OPEN:
                        self.writer.write(self.ws.send(event.response()))
                    elif isinstance(event, CloseConnection):
                        if self.ws.state is ConnectionState.REMOTE_CLOSING:
                            self.writer.write(self.ws.send(event.response()))
                            self._ended(event.code, "client")
                        return
                    elif isinstance(event, TextMessage):
                        text += event.data
                        if event.message_finished:
                            with suppress(ValueError):
                                msg = json.loads(text)
                                if isinstance(msg, dict) and msg.get("type") == "response.create":
                                    self.creates.put_nowait(msg)
                            text = ""
        except (ConnectionError, RemoteProtocolError):
            pass
        finally:
            self.gone.set()
            self.creates.put_nowait(None)

    def _ended(self, code: int | None, by: str) -> None:
        if not self.ended:
            self.ended = True
            self.fake._log({"ts": time.time(), "event": "ws_closed", "credential": self.label, "socket": self.id,
                            "code": code, "by": by})

    async def turn(self, create: dict) -> None:
        fake, label = self.fake, self.label
        self.turns += 1
        prev, queue = create.get("previous_response_id"), fake.forced.get(label)
        if prev and prev not in self.issued:
            scenario = "previous_response_not_found"
        elif queue:
            scenario = queue.pop(0)
        elif create.get("generate") is False:
            scenario = "warmup"
        else:
            scenario = self.scenario
        if scenario == "overload-once":
            fake.seen[label] = fake.seen.get(label, 0) + 1
            scenario = "overload" if fake.seen[label] == 1 else "good"
        items = create.get("input")
        listed = items if isinstance(items, list) else []
        if scenario not in SYNC and foreign_encrypted(listed, label):
            scenario = "foreign-content"
        if scenario == "toolcall" and any(isinstance(i, dict) and i.get("type") in ("function_call_output", "compaction")
                                          for i in listed):
            scenario = "good"  # the call was made (as on HTTP)
        metadata = create.get("client_metadata") if isinstance(create.get("client_metadata"), dict) else {}
        trigger = bool(listed) and isinstance(listed[-1], dict) and listed[-1].get("type") == "compaction_trigger"
        fake._log({"ts": time.time(), "event": "ws_turn", "compaction_trigger": trigger,
                   "foreign_encrypted": scenario == "foreign-content", "credential": label, "scenario": scenario, "turn": self.turns,
                   "turn_state_in_body": metadata.get("x-codex-turn-state"),
                   "previous_response_id": prev, "input_items": len(items) if isinstance(items, list) else 0,
                   "encrypted_reasoning": sum(1 for i in items or [] if isinstance(i, dict) and i.get("type") == "reasoning"
                                              and i.get("encrypted_content")) if isinstance(items, list) else 0,
                   "compaction": any(isinstance(i, dict) and i.get("type") == "compaction" for i in items or []),
                   "generate": create.get("generate"), "socket": self.id})
        turn = Turn(label, fake.deltas, ws_text, compact=trigger,
                    encrypted="reasoning.encrypted_content" in (create.get("include") or []))
        self.issued.add(turn.rid)
        self.traced = set()
        if scenario == "foreign-content":
            msgs = [turn.wrapped(400, json.loads(foreign_content_error()[2])["error"])]
        elif scenario == "previous_response_not_found":
            msgs = [turn.wrapped(400, {"type": "invalid_request_error", "code": "previous_response_not_found",
                                       "message": f"Previous response with id '{prev}' not found.",
                                       "param": "previous_response_id"})]
        elif scenario == "warmup":
            msgs = [turn.created(), turn.completed([])]
        elif scenario == "overload":
            msgs = [turn.created(), turn.wrapped(503, OVERLOADED)]
        elif scenario == "overload-msg":
            message = "Our servers are currently overloaded. Please try again later."
            msgs = [turn.created(), turn.wrapped(400, {"type": "invalid_request_error", "message": message})]
        elif scenario == "overload-nostatus":
            msgs = [turn.created(), turn.overload_error(), turn.failed("server_is_overloaded", OVERLOADED["message"])]
        elif scenario == "overload-close":
            msgs = [turn.created(), turn.overload_error()]
        elif scenario == "close-after-created":
            msgs = [turn.created()]
        elif scenario == "usage-limit":
            msgs = [turn.wrapped(429, {"type": "usage_limit_reached", "message": "The usage limit has been reached",
                                       "plan_type": "plus", "resets_at": int(time.time()) + 3600, "resets_in_seconds": 3600},
                                 headers={"x-codex-primary-used-percent": "100.0"})]
        elif scenario == "status-code-503":  # the status under another name (pi#4172, codex-lb#789)
            msgs = [turn.created(), turn.encode({"type": "error", "status_code": 503, "error": {
                "type": "server_error", "code": "upstream_unavailable", "message": "Service temporarily unavailable."}})]
        elif scenario == "no-pro-model" and create.get("model") == PRO_MODEL:
            msgs = [turn.wrapped(400, {"type": "invalid_request_error", "code": None,
                                       "message": json.loads(not_entitled()[2])["detail"]})]
        elif scenario == "delta-overload":
            msgs = [turn.created(), turn.ev("response.output_text.delta", item_id="m", output_index=0, content_index=0,
                                            delta="Hi"), turn.wrapped(503, OVERLOADED)]
        elif scenario == "capacity":
            msgs = turn.handshake() + [turn.failed("server_error", "Selected model is at capacity. Please try a different model.")]
        elif scenario == "slow-down":
            msgs = turn.handshake() + [turn.failed("slow_down", "Please slow down.")]
        elif scenario in ("toolcall", "toolcall-again") and not trigger:
            call = {"id": "fc_1", "type": "function_call", "status": "completed", "call_id": f"call_{turn.rid[-8:]}",
                    "name": "fake_unknown_tool", "arguments": "{}"}
            done = turn.ev("response.completed", response={"id": turn.rid, "object": "response", "status": "completed",
                                                           "output": [call], "usage": usage(500, 20)})
            msgs = turn.handshake() + [turn.ev("response.output_item.done", output_index=0, item=call), done]
        elif scenario == "held-many":  # 60 holdable messages (over the 48-message budget), then output: one burst
            item = {"id": "msg_1", "type": "message", "role": "assistant", "status": "completed",
                    "content": [{"type": "output_text", "text": "held", "annotations": []}]}
            held = [turn.created()] + [turn.created("response.in_progress") for _ in range(60)]
            output = [turn.ev("response.output_text.delta", item_id="msg_1", output_index=0, content_index=0,
                              delta=f"d{i} ") for i in range(fake.deltas)]
            await self.send(held + output, burst=True)
            msgs = [turn.ev("response.output_item.done", output_index=0, item=item), turn.completed([item])]
        elif scenario == "many":
            await self.send([turn.created()])
            deltas = [f"d{i} " for i in range(fake.deltas)]
            item = {"id": "msg_1", "type": "message", "role": "assistant", "status": "completed",
                    "content": [{"type": "output_text", "text": "".join(deltas), "annotations": []}]}
            await self.send([turn.ev("response.output_text.delta", item_id="msg_1", output_index=0, content_index=0, delta=d)
                             for d in deltas], burst=True)
            msgs = [turn.ev("response.output_item.done", output_index=0, item=item), turn.completed([item], len(deltas))]
        elif scenario == "stall":
            await self.send(turn.handshake())
            with suppress(TimeoutError):
                await asyncio.wait_for(self.gone.wait(), fake.stall)
                fake._log({"ts": round(time.time(), 3), "event": "peer_closed", "credential": label})
                return
            msgs = turn.answer()
        else:
            msgs = turn.handshake() + turn.answer()
        await self.send(msgs)
        if scenario in ("overload-close", "close-after-created") and self.ws.state is ConnectionState.OPEN:
            self.writer.write(self.ws.send(CloseConnection(code=1011, reason="server closing")))
            await self.writer.drain()
            self._ended(1011, "server")
            self.gone.set()

    async def send(self, msgs: list[str], burst: bool = False) -> None:
        """Each message as one text message, paced by --pace, or all in one write (`burst`)."""
        if burst and self.ws.state is ConnectionState.OPEN:
            self.writer.write(b"".join(self.ws.send(TextMessage(data=m)) for m in msgs))
            await self.writer.drain()
            return
        for m in msgs:
            if self.ws.state is not ConnectionState.OPEN:
                raise ConnectionError("the WebSocket is closing")
            self.writer.write(self.ws.send(TextMessage(data=m)))
            await self.writer.drain()
            if self.fake.trace:
                self.fake._trace(m.encode(), self.label, self.traced)
            if self.fake.pace:
                await asyncio.sleep(self.fake.pace)


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
    metadata = doc.get("client_metadata") if isinstance(doc.get("client_metadata"), dict) else {}
    return {
        "body_json": True,
        "model": doc.get("model"),
        "previous_response_id": doc.get("previous_response_id"),
        "encrypted_reasoning": sum(1 for i in items if isinstance(i, dict) and i.get("type") == "reasoning"
                                   and i.get("encrypted_content")),
        "input_items": len(items),
        "compaction": sum(1 for i in items if isinstance(i, dict) and i.get("type") == "compaction"),
        "compaction_trigger": bool(items) and isinstance(items[-1], dict) and items[-1].get("type") == "compaction_trigger",
        "foreign_encrypted": foreign_encrypted(items, label_of(headers)),
        "encrypted_reasoning_requested": "reasoning.encrypted_content" in (doc.get("include") or []),
        "lite": headers.get("x-openai-internal-codex-responses-lite") == "true",
        "turn_state_in_body": metadata.get("x-codex-turn-state"),
        "body_sha256": hashlib.sha256(body).hexdigest(),
        "tool_output": any(isinstance(i, dict) and i.get("type") == "function_call_output" for i in items),
    }


async def write_full(writer: asyncio.StreamWriter, status: int, headers: dict[str, str], body: bytes) -> None:
    headers = {"access-control-allow-origin": "*", **headers}  # any web origin may read it, as api.openai.com allows
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
    fake = FakeUpstream(args.pace, args.deltas, args.stall, log, args.trace, args.trace_events, args.flood_mib)
    tls = None
    if args.cert:
        tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        tls.load_cert_chain(args.cert)
    elif args.tls:
        tls = self_signed_context()
    port = await fake.start(args.port, tls)
    print(json.dumps({"listening": port, "tls": tls is not None}), flush=True)
    await asyncio.Event().wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 epilog="scenarios:\n" + "\n".join(f"  {k:<20} {v}" for k, v in SCENARIOS.items()),
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--tls", action="store_true", help="serve HTTPS with a throwaway self-signed certificate")
    ap.add_argument("--cert", help="serve HTTPS with this PEM file (private key, certificate and its chain)")
    ap.add_argument("--pace", type=float, default=0.02, help="seconds between events (default 0.02)")
    ap.add_argument("--deltas", type=int, default=20, help="text deltas per answer (default 20)")
    ap.add_argument("--flood-mib", type=int, default=200, help="MiB a flood answer carries (default 200)")
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

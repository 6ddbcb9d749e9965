"""No secret in any log: the one set of secret values in force, and the log records masked by it.

With `proxy_debug` and debug verbosity, mitmproxy logs the bytes of every request head its layers
write, and an attempt's head carries the real credentials (attempt.py arms them for that one step):
pooled API keys, auth.json tokens, account ids, a route proxy's Proxy-Authorization. Masking at
the source is impossible (those are mitmproxy's own lines), so every log record the process
makes reads masked: a log record factory, not a handler filter, so handlers added
later (mitmweb's event log, a user's) and records of every logger are covered alike. The cost is
masking each record's text when a handler formats it (records nobody shows cost nothing more).

`SECRETS` (core/mask.py) holds the values: the pool's (taken again whenever the addon's pool is
another object: a new pool file, a changed auth file) and each value armed on an attempt or a CONNECT (added as it is armed). Key-shaped words are
masked whether known or not. The masked value reads MASK, so a debug log still shows every step.
"""

from __future__ import annotations

import base64
import json
import logging
from urllib.parse import urlsplit

from ..core.mask import MASK, Secrets, header_secrets

SECRETS = Secrets()
_BASE = "_codex_failover_base"  # the factory ours wraps (kept on ours, so a reload never stacks two)

__all__ = ["MASK", "SECRETS", "install", "uninstall", "set_pool", "pool_values", "arming", "forwarded"]


class MaskedRecord(logging.LogRecord):
    """A log record whose text and traceback read masked. Masked when read (a handler formats it),
    not when made: mitmproxy's root logger takes every DEBUG record, and most are never shown."""

    def getMessage(self) -> str:
        return SECRETS.mask(super().getMessage())

    @property
    def exc_text(self) -> str | None:  # set by Formatter.format from the traceback, then read back
        text = self.__dict__.get("_exc_text")
        return SECRETS.mask(text) if text else text

    @exc_text.setter
    def exc_text(self, value: str | None) -> None:
        self.__dict__["_exc_text"] = value


def install(pool_of=None) -> None:
    """Mask every log record made from now on (idempotent, and across a script reload); `pool_of()`:
    the pool in force (config.PoolConfig), whose secrets are taken again whenever it is replaced."""
    if pool_of is not None:
        SECRETS.follow(pool_of, pool_values)
    current = logging.getLogRecordFactory()
    base = getattr(current, _BASE, current)

    def factory(*args, **kwargs):
        record = base(*args, **kwargs)
        if type(record) is logging.LogRecord:  # another factory's own class is left alone
            record.__class__ = MaskedRecord
        return record

    setattr(factory, _BASE, base)
    logging.setLogRecordFactory(factory)


def uninstall() -> None:
    current = logging.getLogRecordFactory()
    base = getattr(current, _BASE, None)
    if base is not None:
        logging.setLogRecordFactory(base)


def arming(values) -> None:
    """Header values about to go on the wire: masked in any log from now on."""
    SECRETS.add(part for value in values for part in header_secrets(value))


def set_pool(pool) -> None:
    SECRETS.set_pool(pool_values(pool))


def pool_values(pool) -> list[str]:
    """The secrets of a loaded pool (config.PoolConfig): every credential's identity headers,
    each route proxy's credentials, a state store URL's password."""
    values: list[str] = []
    for cred in pool.credentials:
        auth = cred.auth
        values += [auth.token, auth.account_id or ""]
        for value in auth.headers().values():
            values += header_secrets(value)
    for endpoints in pool.routes.values():
        for ep in endpoints or ():
            if ep.username is not None:
                basic = base64.b64encode(f"{ep.username}:{ep.password or ''}".encode()).decode()
                values += [ep.password or "", basic, "Basic " + basic]
    try:
        values.append(urlsplit(pool.state.store).password or "")
    except ValueError:
        pass
    return values


def forwarded(resp, body, own: bool):
    """A synchronous answer as the client gets it (`body`: its bounded decoding, bounded_body.py).
    Its own credential's answer, or a success, goes as it came. A pooled credential's error is the
    upstream's text about a secret the client never had (a gateway may echo the key it was sent):
    key-shaped words and known secrets are masked; when its body decodes past the cap it cannot be
    read to mask, so the client gets the status with a short error of ours instead."""
    from mitmproxy import http  # here: the rest of this module is plain logging

    answer = resp.copy()
    if own or resp.status_code < 400:
        return answer
    if body.over or body.content is None:
        message = (f"codex-failover: the upstream's HTTP {resp.status_code} error body decodes past "
                   "failover_max_body; not forwarded")
        error = {"type": "upstream_error", "code": "upstream_body_too_large", "message": message}
        return http.Response.make(resp.status_code, json.dumps({"error": error}).encode(),
                                  {"content-type": "application/json", "x-codex-failover": "1"})
    text = body.content.decode("latin-1")  # byte for byte: only masked spans change
    masked = SECRETS.mask(text)
    if masked != text:
        answer.headers.pop("content-encoding", None)
        answer.content = masked.encode("latin-1")
    return answer

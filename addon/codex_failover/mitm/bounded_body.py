"""A request's or response's decoded body, without decoding past a cap or holding the event loop.

Every body the addon reads decoded goes through here instead of mitmproxy's `get_content()`, which
decodes the whole body in one call however large it decodes to (bounded_decode.py says why).
`limit` is failover_max_body unless a caller needs less; the async form yields to the event loop
every few milliseconds, so other connections go on while a large body decodes.
"""

from __future__ import annotations

import asyncio
import logging
import time

from mitmproxy import http

from ..bounded_decode import BoundedDecoder, Outcome

log = logging.getLogger("codex_failover")

# failover_max_body: set by the addon when the option changes (as WsConn.max_message)
limit = 32 * 1024 * 1024
BUDGET = 0.005  # seconds of decoding between two yields to the event loop


def _decoder(message: http.Message, cap: int | None) -> BoundedDecoder:
    return BoundedDecoder(message.raw_content or b"", message.headers.get("content-encoding"),
                          limit if cap is None else cap)


async def content(message: http.Message, cap: int | None = None) -> Outcome:
    """`message`'s body decoded, in slices with the event loop free between them."""
    decoder = _decoder(message, cap)
    started = time.monotonic()
    while (outcome := decoder.step()) is None:
        if time.monotonic() - started >= BUDGET:
            await asyncio.sleep(0)
            started = time.monotonic()
    return outcome


def content_now(message: http.Message, cap: int) -> Outcome:
    """The same at once, for a small `cap` (a few milliseconds of decoding at most)."""
    decoder = _decoder(message, cap)
    while (outcome := decoder.step()) is None:
        pass
    return outcome


async def request_body(request: http.Request, cap: int) -> bytes | None:
    """A held request's body, decoded; None (and one log line) when it is over `cap` as sent or
    decoded: such a request passes through untouched, without failover (holding costs a few times
    its size)."""
    sent = len(request.raw_content or b"")
    outcome = Outcome(None, over=True) if sent > cap else await content(request, cap)
    if outcome.over:
        how = "is" if sent > cap else "decodes"
        log.warning("codex-failover: a %d-byte request body %s over failover_max_body (%d): passed through "
                    "untouched, without failover", sent, how, cap)
        return None
    return outcome.content or b""


async def answer(response: http.Response, who: str) -> Outcome:
    """An attempt's synchronous answer, decoded up to failover_max_body; past it, one log line:
    the answer is judged by its status alone (request_run)."""
    outcome = await content(response)
    if outcome.over:
        log.warning("%s: the HTTP %d answer's body decodes past failover_max_body (%d bytes); not read, judged "
                    "by its status alone", who, response.status_code, limit)
    return outcome

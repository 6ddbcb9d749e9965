"""Whose requests may be lent the pool: the user's own programs, and not web pages in their browser.
Pure: no I/O, clocks injected.

- A request that carries what browsers send and Codex does not (`Origin`, any `Sec-Fetch-*`) is a
  web page's: it is passed through on its own credential (`browser_sign`).
- A loopback client is this user's when its socket belongs to the proxy's uid. Linux lists every TCP
  socket with its owner in /proc/net/tcp and /proc/net/tcp6 (`parse_proc_net_tcp`, `owner_uid`).
- A client credential the upstream refused (401/403) is remembered by fingerprint for a while
  (`RejectedKeys`), and never served from the pool meanwhile.

docs/machine-proxy.md, "Who may use the pool".
"""

from __future__ import annotations

import ipaddress
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator, Literal, Mapping

_Address = tuple[str, int]  # (IP as text, port)

# -- browsers --------------------------------------------------------------------------------

def browser_sign(headers: Mapping[str, str]) -> str | None:
    """The header that shows a browser sent this request (a web page's fetch, a form, a WebSocket
    opened by a page), or None. Codex sends none of them; a browser sends `Origin` on every
    cross-origin fetch and every WebSocket, and `Sec-Fetch-*` on every request to a secure origin."""
    fields = getattr(headers, "fields", None)  # mitmproxy's Headers: its raw pairs, read in one pass
    # (its get() and keys() convert every name at every call: 33 us a Codex request, 3 us this way)
    names = [k.decode("utf-8", "surrogateescape").lower() for k, _ in fields] if fields is not None \
        else [k.lower() for k in headers.keys()]
    if "origin" in names:
        return "origin"
    return next((name for name in names if name.startswith("sec-fetch-")), None)


# -- the status page's writes -----------------------------------------------------------------

STATUS_ORIGIN = "http://codex-failover.status"
STATUS_HEADER = "X-Codex-Failover"  # `X-Codex-Failover: 1`: a page can send it only after a CORS preflight


def status_write_refusal(headers: Mapping[str, str]) -> str | None:
    """Why a POST to the status page (a reset) is refused, or None. A web page can make a browser send
    a simple cross-origin POST without asking (a form, a `no-cors` fetch), but not one with a custom
    header: that needs a preflight, which nothing here answers. A request that says it comes from
    another page (`Origin`, `Sec-Fetch-Site`) is refused even with the header."""
    origin = headers.get("origin")
    if origin is not None and origin.strip().lower() != STATUS_ORIGIN:
        return f"it comes from another page (Origin: {origin.strip()[:100]})"
    site = headers.get("sec-fetch-site")
    if site is not None and site.strip().lower() not in ("same-origin", "none"):
        return f"it comes from another site (Sec-Fetch-Site: {site.strip()[:40]})"
    if (headers.get(STATUS_HEADER.lower()) or "").strip() != "1":
        return f"it lacks the header `{STATUS_HEADER}: 1`"
    return None


# -- /proc/net/tcp ---------------------------------------------------------------------------

@dataclass(frozen=True)
class SocketEntry:
    local: _Address
    remote: _Address
    uid: int


def parse_proc_net_tcp(text: str, byteorder: Literal["little", "big"] = "little") -> Iterator[SocketEntry]:
    """The sockets of one /proc/net/tcp or /proc/net/tcp6 listing. Addresses are hex: IPv4 one
    32-bit word, IPv6 four, each word in the kernel's byte order (`byteorder`: sys.byteorder); the
    port is big-endian hex. IPv4-mapped IPv6 addresses come out as IPv4. Malformed lines are skipped."""
    return _entries(text.splitlines()[1:], byteorder)  # the first line names the columns


def _entries(lines: Iterable[str], byteorder: Literal["little", "big"]) -> Iterator[SocketEntry]:
    for line in lines:
        fields = line.split()
        if len(fields) < 8:
            continue
        try:
            local, remote = _address(fields[1], byteorder), _address(fields[2], byteorder)
            uid = int(fields[7])
        except ValueError:
            continue
        yield SocketEntry(local, remote, uid)


def _address(text: str, byteorder: Literal["little", "big"]) -> _Address:
    host, _, port = text.partition(":")
    if len(host) not in (8, 32) or not port:
        raise ValueError(text)
    raw = b"".join(int(host[i:i + 8], 16).to_bytes(4, byteorder) for i in range(0, len(host), 8))
    return _normal(str(ipaddress.ip_address(raw))), int(port, 16)


def _normal(ip: str) -> str:
    """One spelling per address: IPv4-mapped IPv6 as IPv4, an IPv6 zone dropped, compressed."""
    parsed = ipaddress.ip_address(ip.split("%", 1)[0])
    mapped = getattr(parsed, "ipv4_mapped", None)
    return str(mapped or parsed)


def owner_uid(listings: Iterable[str], client: _Address, server: _Address, byteorder: Literal["little", "big"] = "little") -> int | None:
    """The uid owning the client's end of a loopback connection: the socket whose local address is the
    client's and whose remote is the server's (the proxy's own end is the mirror image). None when no
    listing has it (the client closed, or it is not on this host)."""
    try:
        want = ((_normal(client[0]), int(client[1])), (_normal(server[0]), int(server[1])))
    except ValueError:
        return None
    # Only lines naming the client's port are parsed: a listing holds every socket of the host
    # (thousands on a busy one, TIME_WAIT included), and parsing each costs some 10 us.
    port = f":{want[0][1]:04X} "
    for text in listings:
        for entry in _entries((line for line in text.splitlines()[1:] if port in line), byteorder):
            if (entry.local, entry.remote) == want:
                return entry.uid
    return None


# -- the rule in force ------------------------------------------------------------------------

UID = "uid"  # loopback clients must be processes of the proxy's uid (Linux)
TOKEN = "token"  # mitmproxy's --proxyauth: every client has shown the token
ANYONE = "anyone"  # neither: any process on this machine


def rule_for(proxyauth: str | None, can_map_sockets: bool) -> str:
    if proxyauth:
        return TOKEN
    return UID if can_map_sockets else ANYONE


def describe_rule(rule: str, uid: int | None) -> str:
    """The start-up log's line on who may use the pool on this machine."""
    if rule == TOKEN:
        return "local clients: holders of the proxy token (--proxyauth) only"
    if rule == UID:
        return (f"local clients: processes of uid {uid} only (each socket's owner, asked of the kernel); "
                "other users' are passed through on their own credential")
    return ("local clients: any process on this machine (no /proc/net/tcp here); "
            "require a token with --proxyauth=USER:TOKEN and HTTPS_PROXY=http://USER:TOKEN@127.0.0.1:8080")


def is_own(rule: str, loopback: bool, client_uid: int | None, proxy_uid: int | None) -> bool:
    """Is this client the user's own program? A non-loopback client was let in by failover_clients;
    under the uid rule, a loopback client whose socket was not found is not."""
    if rule != UID or not loopback:
        return True
    return client_uid is not None and client_uid == proxy_uid


# -- refused client credentials --------------------------------------------------------------

class RejectedKeys:
    """Fingerprints of client credentials the upstream answered 401/403, each remembered for `keep`
    seconds from its last refusal (at most `max_keys`, the oldest forgotten first). Never the secret."""

    def __init__(self, keep: float = 3600.0, max_keys: int = 4096, clock: Callable[[], float] = time.monotonic):
        self.keep, self.max_keys = keep, max_keys
        self._clock = clock
        self._keys: OrderedDict[str, float] = OrderedDict()  # fingerprint -> when refused, oldest first

    def refused(self, fingerprint: str) -> None:
        self._keys[fingerprint] = self._clock()
        self._keys.move_to_end(fingerprint)
        while len(self._keys) > self.max_keys:
            self._keys.popitem(last=False)

    def accepted(self, fingerprint: str) -> None:
        """The upstream served it after all (a key re-enabled): forgotten."""
        self._keys.pop(fingerprint, None)

    def __contains__(self, fingerprint: str) -> bool:
        self._expire()
        return fingerprint in self._keys

    def __len__(self) -> int:
        self._expire()
        return len(self._keys)

    def _expire(self) -> None:
        horizon = self._clock() - self.keep
        while self._keys and next(iter(self._keys.values())) <= horizon:
            self._keys.popitem(last=False)

"""Is a target one of this proxy's own listeners, is a client one of its own sockets? Decided on
addresses, never on how a host was spelled. Pure: the shell resolves names and says which addresses
are this machine's (mitm/self_guard.py).

A proxy that connects to itself turns its own socket into a client of its own uid: mitmproxy's guard
compares spellings (`127.0.0.1`, `localhost`, the listen host), so `127.1`, `0.0.0.0`, `2130706433` or
`[::ffff:127.0.0.1]` went round it. Here every address is brought to one form first: an IPv4-mapped
IPv6 address is its IPv4 address, an unspecified address (`0.0.0.0`, `::`) is where a connection to it
goes (loopback), and a listener on an unspecified address is reached by every address of the machine.

docs/machine-proxy.md, "Who may use the pool".
"""

from __future__ import annotations

import ipaddress
from typing import Collection, Iterable

_Ip = ipaddress.IPv4Address | ipaddress.IPv6Address


def address(text: str) -> _Ip | None:
    """One form per address: a zone dropped, IPv4-mapped as IPv4, unspecified as loopback (where
    Linux sends a connection to it); None for what is not an IP address."""
    try:
        ip = ipaddress.ip_address(str(text).split("%", 1)[0].strip("[]"))
    except ValueError:
        return None
    mapped = getattr(ip, "ipv4_mapped", None)
    if mapped is not None:
        ip = mapped
    if ip.is_unspecified:
        return ipaddress.ip_address("127.0.0.1" if ip.version == 4 else "::1")
    return ip


def _any(host: str) -> bool:
    """A listener bound to every address (`""`, `0.0.0.0`, `::`)."""
    if host in ("", "*"):
        return True
    try:
        return ipaddress.ip_address(host.split("%", 1)[0].strip("[]")).is_unspecified
    except ValueError:
        return False


def is_own_listener(targets: Iterable[str], port: int, listeners: Iterable[tuple[str, int]],
                    local: Collection[str] = ()) -> bool:
    """Does a connection to any of `targets` (the resolved addresses of one host) at `port` reach one
    of `listeners` ((bound host, port) each)? `local`: which of the targets are addresses of this
    machine (the shell asks the kernel); loopback ones always are."""
    wanted = [(host, int(p)) for host, p in listeners if int(p) == int(port)]
    if not wanted:
        return False
    for target in targets:
        ip = address(target)
        if ip is None:
            continue
        here = ip.is_loopback or target in local or str(ip) in local
        for host, _ in wanted:
            if _any(host):
                if here:
                    return True
            elif address(host) == ip:
                return True
    return False


def end(peer: tuple[object, ...] | None) -> tuple[str, int] | None:
    """A socket's (address, port) in the one form above; None for anything else."""
    if not peer or len(peer) < 2:
        return None
    ip = address(str(peer[0]))
    if ip is None:
        return None
    try:
        return str(ip), int(peer[1])  # type: ignore[call-overload]
    except (TypeError, ValueError):
        return None


def is_own_socket(peer: tuple[object, ...] | None, local: tuple[object, ...] | None,
                  own: Collection[tuple[tuple[str, int], tuple[str, int]]]) -> bool:
    """Is a client connection (`peer` its far end, `local` the proxy's end of it) the other end of one
    of the proxy's own outgoing sockets (`own`: each one's (local end, remote end))? Such a client is
    never a client: it is the proxy talking to itself. Both ends must mirror: Linux gives one local
    port to several sockets that go to different places, so a client's port alone can be an outgoing
    socket's by chance (a Codex connection to the proxy and the proxy's to an upstream)."""
    mine, theirs = end(peer), end(local)
    return mine is not None and theirs is not None and (mine, theirs) in own

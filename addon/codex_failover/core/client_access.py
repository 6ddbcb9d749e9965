"""Who may use the pool: loopback clients, and the addresses an operator names. Pure.

Pooled credentials, the status page and its details are given only to allowed clients; anyone else
gets a 403 naming the option (`failover_clients`). See docs/machine-proxy.md.
"""

from __future__ import annotations

import ipaddress
from typing import Iterable

OPTION = "failover_clients"
_Network = ipaddress.IPv4Network | ipaddress.IPv6Network


class ClientAccessError(ValueError):
    pass


def parse_networks(items: Iterable[str]) -> tuple[_Network, ...]:
    """Addresses and CIDRs (`10.0.0.5`, `192.168.1.0/24`, `fd00::/8`); a clear error for anything else."""
    out = []
    for item in items:
        for part in str(item).split(","):
            part = part.strip()
            if not part:
                continue
            try:
                out.append(ipaddress.ip_network(part, strict=False))
            except ValueError:
                raise ClientAccessError(f"{OPTION}: {part!r} is not an IP address or CIDR "
                                        "(e.g. 10.0.0.5 or 192.168.1.0/24)") from None
    return tuple(out)


_REMEMBERED = 256  # addresses whose answer is kept (a machine's clients are a few; a flood starts afresh)


class ClientAccess:
    def __init__(self, extra: Iterable[_Network] = ()):
        self.extra = tuple(extra)
        self._answers: dict[str, bool] = {}  # address -> allowed (each model request asks: parsing it costs 5-10 us)

    def allows(self, address: str | None) -> bool:
        """Is a client at `address` (its peer IP as a string) allowed? Unknown addresses are not."""
        if address is None:
            return False
        answer = self._answers.get(address)
        if answer is None:
            if len(self._answers) >= _REMEMBERED:
                self._answers.clear()
            answer = self._answers[address] = self._allows(address)
        return answer

    def _allows(self, address: str) -> bool:
        ip = ip_of(address)
        if ip is None:
            return False
        if ip.is_loopback:
            return True
        return any(ip.version == net.version and ip in net for net in self.extra)

    def describe(self) -> str:
        """Who may use the pool, for the start-up log."""
        named = ", ".join(str(n) for n in self.extra)
        return f"loopback and {named}" if named else f"loopback only (add others with --set {OPTION}=ADDR/CIDR,...)"


def ip_of(address: str | None) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """The address a peer's host string names (an IPv6 zone dropped, an IPv4-mapped one as IPv4), or None."""
    if not address:
        return None
    try:
        ip = ipaddress.ip_address(address.split("%", 1)[0])  # drop an IPv6 zone
    except ValueError:
        return None
    mapped = getattr(ip, "ipv4_mapped", None)  # ::ffff:127.0.0.1 on a dual-stack listener
    return mapped or ip


def is_loopback_host(host: str) -> bool:
    """Is a listen address loopback-only? `localhost` counts; an empty host (all interfaces) does not."""
    if host == "localhost":
        return True
    ip = ip_of(host)
    return ip is not None and ip.is_loopback

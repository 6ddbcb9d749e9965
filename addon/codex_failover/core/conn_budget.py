"""How many connections each peer may hold open at once. Pure.

Every open client connection costs the proxy a descriptor, and descriptors are shared by everything
the proxy does: another user's program (or a remote client) that opens connections without end would
take the last one, and every program on the machine using the proxy would lose HTTPS. So each peer
(a local uid, or a remote address) may hold `cap` connections at once; the proxy's own user is not
counted (its programs are the ones the proxy serves). docs/machine-proxy.md, "Connections".
"""

from __future__ import annotations

from collections import Counter


class ConnectionBudget:
    def __init__(self, cap: int = 512) -> None:
        self.cap = cap
        self._open: Counter[str] = Counter()

    def admit(self, peer: str) -> bool:
        """One more connection of `peer`, if it is under the cap (then counted until `release`)."""
        if self.cap > 0 and self._open[peer] >= self.cap:
            return False
        self._open[peer] += 1
        return True

    def release(self, peer: str) -> None:
        if self._open[peer] <= 1:
            self._open.pop(peer, None)
        else:
            self._open[peer] -= 1

    def open(self, peer: str) -> int:
        return self._open.get(peer, 0)


def peer_key(uid: int | None, address: str | None) -> str | None:
    """Whose connection this is, for the budget: `uid:N` for a local process found in the socket
    table, `ip:ADDRESS` otherwise; None when neither is known."""
    if uid is not None:
        return f"uid:{uid}"
    return f"ip:{address}" if address else None

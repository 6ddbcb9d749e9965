"""The uid that owns the client's end of a local TCP connection, asked of the kernel for that one
socket (Linux sock_diag over netlink, what `ss` uses): one request and one answer a connection, where
reading /proc/net/tcp parses every socket of the host (thousands under a flood of connections).
None when the kernel does not say (not Linux, no such socket, netlink refused): callers fall back to
the listings (core/client_boundary.owner_uid).
"""

from __future__ import annotations

import socket
import struct

_NETLINK_SOCK_DIAG = 4
_SOCK_DIAG_BY_FAMILY = 20
_NLM_F_REQUEST = 1
_NLMSG_ERROR = 2
_NOCOOKIE = 0xFFFFFFFF
_ALL_STATES = 0xFFFFFFFF
_HEADER = struct.Struct("=IHHII")  # nlmsghdr: len, type, flags, seq, pid
_MSG = struct.Struct("=BBBB48sIIIII")  # inet_diag_msg: family, state, timer, retrans, id, expires, rq, wq, uid, inode


def _v4(ip: str) -> str:
    return ip.removeprefix("::ffff:") if ip.startswith("::ffff:") and "." in ip else ip


def tcp_owner(client: tuple[str, int], server: tuple[str, int]) -> int | None:
    """The uid of the socket whose local end is `client` and remote end `server` (both (ip, port))."""
    if not hasattr(socket, "AF_NETLINK"):
        return None
    src, dst = _v4(str(client[0]).split("%", 1)[0]), _v4(str(server[0]).split("%", 1)[0])
    family = socket.AF_INET6 if ":" in src else socket.AF_INET
    if (":" in dst) != (family == socket.AF_INET6):
        return None
    try:
        sockid = (struct.pack(">HH", int(client[1]), int(server[1])) + socket.inet_pton(family, src).ljust(16, b"\0")
                  + socket.inet_pton(family, dst).ljust(16, b"\0") + struct.pack("=III", 0, _NOCOOKIE, _NOCOOKIE))
        request = struct.pack("=BBBBI", family, socket.IPPROTO_TCP, 0, 0, _ALL_STATES) + sockid
        message = _HEADER.pack(_HEADER.size + len(request), _SOCK_DIAG_BY_FAMILY, _NLM_F_REQUEST, 1, 0) + request
        with socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, _NETLINK_SOCK_DIAG) as nl:
            nl.settimeout(1.0)
            nl.send(message)
            data = nl.recv(8192)
    except (OSError, ValueError, OverflowError):
        return None
    if len(data) < _HEADER.size + _MSG.size:
        return None
    _, kind, _, _, _ = _HEADER.unpack_from(data)
    if kind != _SOCK_DIAG_BY_FAMILY:
        return None  # NLMSG_ERROR: no such socket
    return _MSG.unpack_from(data, _HEADER.size)[8]

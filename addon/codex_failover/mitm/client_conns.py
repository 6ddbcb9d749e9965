"""The proxy servers' client connections, as the addon needs them (part of the seam: mitmproxy's
proxy core, docs/architecture.md#the-seam): whether a client is one of theirs, closing one (as
mitmproxy's inactivity timeout closes one), bounding a passed-through WebSocket's messages in the
layer mitmproxy runs it with (each message is gathered whole there: bounded while it grows, and as
it inflates), and the hosts the proxy servers listen on."""

from __future__ import annotations

import contextlib
from typing import Callable

from mitmproxy import ctx, http
from mitmproxy.proxy.layers.websocket import WebsocketLayer
from mitmproxy.proxy.mode_specs import ProxyMode


def _proxy_connections() -> dict:
    server = ctx.master.addons.get("proxyserver") if getattr(ctx, "master", None) else None
    return getattr(server, "connections", None) or {}


def is_proxy_client(client_id: str) -> bool:
    """A client connection of mitmproxy's own proxy servers (not a kept connection's stand-in client)."""
    return client_id in _proxy_connections()


def drop_client(client_id: str, why: str) -> bool:
    """Close a client connection of the proxy servers, as mitmproxy's inactivity timeout closes one
    (its handler cancelled: its hooks run, `client_disconnected` last). False when it is gone."""
    handler = _proxy_connections().get(client_id)
    io = handler.transports.get(handler.client) if handler is not None else None
    if io is None or io.handler is None or io.handler.done():
        return False
    io.handler.cancel(why)
    return True


def bound_websocket(flow: http.HTTPFlow, cap: int, over: Callable[[], None]) -> bool:
    """A passed-through WebSocket (mitmproxy's own layer between the client and the upstream): a
    message that grows past `cap` bytes while mitmproxy gathers it ends the connection, as if the
    sender had gone (wsproto answers 1006 to both sides), and `over()` is told. False when its layer
    is not found (the layers are not as pinned: it is left as mitmproxy runs it)."""
    layer = _websocket_layer(flow)
    if layer is None:
        return False
    for ws in (layer.client_ws, layer.server_ws):
        _bound_inflate(getattr(getattr(ws, "_proto", None), "extensions", None), cap, over)
        receive = ws.receive_data

        def bounded(data, ws=ws, receive=receive):
            if data is not None and sum(map(len, ws.frame_buf)) + len(data) > cap:
                ws.frame_buf = [b""]
                over()
                return receive(None)
            return receive(data)

        ws.receive_data = bounded  # type: ignore[method-assign]  # this connection's reads only: its own attribute
    return True


def _bound_inflate(extensions, cap: int, over: Callable[[], None]) -> None:
    """permessage-deflate inflating at most `cap` a message (ws/bounded_deflate.py): 64 KiB can hold 64 MiB."""
    from wsproto.extensions import PerMessageDeflate
    from wsproto.frame_protocol import CloseReason

    from ..ws.bounded_deflate import BoundedDeflate

    for i, ext in enumerate(extensions if isinstance(extensions, list) else ()):
        if type(ext) is PerMessageDeflate:
            bounded = BoundedDeflate(cap)
            bounded.__dict__.update({k: v for k, v in vars(ext).items() if k not in ("max_message", "_taken")})
            inflate = bounded.frame_inbound_payload_data

            def told(proto, data, inflate=inflate):
                out = inflate(proto, data)
                if out is CloseReason.MESSAGE_TOO_BIG:
                    over()
                return out

            bounded.frame_inbound_payload_data = told  # type: ignore[method-assign]
            extensions[i] = bounded


def _websocket_layer(flow: http.HTTPFlow) -> WebsocketLayer | None:
    handler = _proxy_connections().get(flow.client_conn.id)
    stack, seen = ([handler.layer] if handler is not None else []), 0
    while stack and seen < 256:
        node, seen = stack.pop(), seen + 1
        if isinstance(node, WebsocketLayer):
            if node.flow is flow:
                return node
            continue
        for name in ("layer", "child_layer"):  # NextLayer's chosen layer, a layer's child
            if (child := getattr(node, name, None)) is not None:
                stack.append(child)
        handler = getattr(node, "__dict__", {}).get("_handle_event")  # a mode layer hands on to its child this way
        if (child := getattr(handler, "__self__", None)) is not None and child is not node:
            stack.append(child)
        streams = getattr(node, "streams", None)
        if isinstance(streams, dict):
            stack.extend(streams.values())
    return None


def listen_hosts(modes, listen_host: str) -> list[str]:
    """The hosts mitmproxy listens on for its `mode` specs (unparseable ones skipped), in order."""
    hosts: dict[str, None] = {}
    for spec in modes:
        with contextlib.suppress(ValueError):
            hosts[ProxyMode.parse(spec).listen_host(listen_host)] = None
    return list(hosts)

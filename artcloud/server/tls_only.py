"""HTTPS only, with a readable answer for plain HTTP.

A plain-HTTP request to a TLS port normally dies in the handshake ("connection reset", "empty reply").
Here each connection's first byte is looked at: a TLS handshake (0x16) goes on into asyncio's TLS
layer and then uvicorn's HTTP protocol, exactly as `create_server(ssl=...)` would; anything else gets
`400 {"error": {"code": "https_required", ...}}` in plain text and the connection is closed. Nothing is
ever served without TLS.
"""

from __future__ import annotations

import asyncio
import json
import ssl
from asyncio import sslproto
from functools import partial
from typing import Any, Callable

from artcloud.server.api_errors import ApiError

FIRST_BYTE_TIMEOUT_S = 30.0
TLS_HANDSHAKE = 0x16


def https_required_response(hint: str) -> bytes:
    body = json.dumps(ApiError(400, "https_required", f"this port speaks HTTPS only: use {hint}").body()).encode()
    head = f"HTTP/1.1 400 Bad Request\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n"
    return (head + "Connection: close\r\n\r\n").encode() + body


class TLSOnlyProtocol(asyncio.Protocol):
    def __init__(self, make_inner: Callable[[], asyncio.BaseProtocol], context: ssl.SSLContext, hint: str):
        self.make_inner = make_inner
        self.context = context
        self.hint = hint
        self.transport: Any = None
        self._timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: Any) -> None:
        self.transport = transport
        self._timer = asyncio.get_running_loop().call_later(FIRST_BYTE_TIMEOUT_S, transport.close)

    def connection_lost(self, exc: Exception | None) -> None:
        if self._timer is not None:
            self._timer.cancel()

    def data_received(self, data: bytes) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if data[0] != TLS_HANDSHAKE:
            self.transport.write(https_required_response(self.hint))
            self.transport.close()
            return
        # Hand the connection to asyncio's TLS protocol (what loop.start_tls does), then replay the
        # bytes we already read: they are the start of the ClientHello.
        loop = asyncio.get_running_loop()
        tls = sslproto.SSLProtocol(loop, self.make_inner(), self.context, None, server_side=True)
        self.transport.set_protocol(tls)
        tls.connection_made(self.transport)
        replay(tls, data)


def replay(protocol: asyncio.BaseProtocol, data: bytes) -> None:
    """Feed `data` to `protocol` as its transport would have.

    asyncio's SSLProtocol is a BufferedProtocol (get_buffer/buffer_updated) since Python 3.11; on 3.10
    it is a plain Protocol that only has data_received. `requires-python` admits 3.10, the python3 of
    Ubuntu 22.04 GPU images, so both kinds are fed."""
    if not isinstance(protocol, asyncio.BufferedProtocol):
        protocol.data_received(data)  # type: ignore[attr-defined]
        return
    view = memoryview(data)
    while view:
        buf = protocol.get_buffer(len(view))
        n = min(len(buf), len(view))
        buf[:n] = view[:n]
        protocol.buffer_updated(n)
        view = view[n:]


def server_context(certfile: str, keyfile: str) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(certfile, keyfile)
    return ctx


def wrap_uvicorn_protocol(config: Any, context: ssl.SSLContext, hint: str) -> None:
    """Make a loaded uvicorn Config serve every connection through TLSOnlyProtocol."""
    inner_cls = config.http_protocol_class

    def factory(config: Any, server_state: Any, app_state: Any, _loop: Any = None) -> asyncio.Protocol:
        inner = partial(inner_cls, config=config, server_state=server_state, app_state=app_state, _loop=_loop)
        return TLSOnlyProtocol(inner, context, hint)

    config.http_protocol_class = factory

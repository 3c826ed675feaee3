"""HTTPS only, with a readable answer for plain HTTP.

A plain-HTTP request to a TLS port normally dies in the handshake ("connection reset", "empty reply").
Here each connection's first byte is looked at: a TLS handshake (0x16) goes on into asyncio's TLS
layer and then uvicorn's HTTP protocol, exactly as `create_server(ssl=...)` would; anything else gets
`400 {"error": {"code": "https_required", ...}}` in plain text and the connection is closed. Nothing is
ever served without TLS.

Nobody without the token may hold the server's connections (security review 1): before a request is
authenticated, a connection has FIRST_BYTE_TIMEOUT_S for its first byte and HANDSHAKE_TIMEOUT_S for TLS,
then HEAD_TIMEOUT_S for its first request head, and a head begun on a kept-alive connection as long (an idle
kept-alive one is uvicorn's to close, after its keep-alive timeout); a request body that stops coming for
BODY_IDLE_S ends the connection. `Connections` caps how many are open in all and per peer network, so that
descriptors stay for the checkpoints, and the accept loop's out-of-descriptors errors are logged once per
minute, not once per retry (`quiet_accept_errors`).

Behind an HTTPS-terminating proxy (`--behind-https-proxy`, Modal's tunnel) the same deadlines hold for the
plain HTTP the proxy forwards (`ProxiedProtocol`), from the connection's start, and the cap in all; not the
cap per address, since every connection comes from the proxy.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import logging
import resource
import ssl
import time
from asyncio import sslproto
from collections import Counter
from functools import partial
from typing import Any, Callable

from artcloud.server.api_errors import ApiError

log = logging.getLogger("artcloud.server")

FIRST_BYTE_TIMEOUT_S = 10.0
HANDSHAKE_TIMEOUT_S = 10.0
HEAD_TIMEOUT_S = 10.0  # from a connection's TLS hand-off, or a kept-alive one's first byte, to a whole request head
BODY_IDLE_S = 30.0  # a request body in progress that sends nothing this long
CHECK_EVERY_S = 1.0
TLS_HANDSHAKE = 0x16
RESERVED_FDS = 256  # kept from connections: checkpoints, S3, logs, the engine (a quarter of a small limit)
REFUSALS_LOGGED_EVERY_S = 60.0
# This machine's own client (a LocalBackend, the loopback forwarder) is not held to the cap per network: a gather of
# over half the cap's rollouts had connections cut before TLS (code review 3, F9); the pre-auth threat is remote.
OWN_MACHINE = frozenset({"127.0.0.1", "::1"})
OPEN_MAX = 10240  # macOS's per-process limit, what setrlimit takes where the hard limit is "unlimited"


def https_required_response(hint: str) -> bytes:
    body = json.dumps(ApiError(400, "https_required", f"this port speaks HTTPS only: use {hint}").body()).encode()
    head = f"HTTP/1.1 400 Bad Request\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n"
    return (head + "Connection: close\r\n\r\n").encode() + body


def peer_network(address: str) -> str:
    """What one party is likely to hold, as connections are counted: an IPv4 /24 or an IPv6 /64 (a cloud machine or
    a home line gets a whole /64; a few addresses of one /24 are cheap), a loopback address as it is, anything
    else (a Unix socket's "?") as it is. An IPv4 address mapped into IPv6 counts as the IPv4 one."""
    try:
        ip = ipaddress.ip_address(address.split("%", 1)[0])
    except ValueError:
        return address
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    if ip.is_loopback:
        return str(ip)
    prefix = 24 if ip.version == 4 else 64
    return str(ipaddress.ip_network(f"{ip}/{prefix}", strict=False))


class Connections:
    """Open connections in all and per peer network (`peer_network`: a /24 or a /64, security review 3, finding 1),
    capped before TLS (nothing else of a peer is known then). From the descriptor limit, raised to the hard limit
    first: what RESERVED_FDS leaves (at most 8,192), half of it per peer; a refused connection is closed at once, and
    logged once per REFUSALS_LOGGED_EVERY_S."""

    def __init__(self, total: int | None = None, per_peer: int | None = None, *, by_peer: bool = True):
        if total is None:
            limit = descriptors()
            total = min(8192, limit - min(RESERVED_FDS, limit // 4))
        self.total, self.per_peer = total, per_peer or (max(1, total // 2) if by_peer else total)
        self.by_peer: Counter[str] = Counter()
        self.open = self.refused = 0
        self._logged_at = -REFUSALS_LOGGED_EVERY_S

    def admit(self, peer: str) -> bool:
        """`peer`: what peer_network made of the peer's address."""
        if self.open >= self.total or self.by_peer[peer] >= self.per_peer and peer not in OWN_MACHINE:
            self.refused += 1
            if time.monotonic() - self._logged_at >= REFUSALS_LOGGED_EVERY_S:
                self._logged_at = time.monotonic()
                log.warning("refusing connections (%d so far): %d open of %d, %d from %s of %d per network",
                            self.refused, self.open, self.total, self.by_peer[peer], peer, self.per_peer)
            return False
        self.by_peer[peer] += 1
        self.open += 1
        return True

    def release(self, peer: str) -> None:
        self.open -= 1
        self.by_peer[peer] -= 1
        if self.by_peer[peer] <= 0:
            del self.by_peer[peer]


def descriptors() -> int:
    """The soft descriptor limit, first raised to the hard one (the default soft limit is often 1,024; where the hard
    limit is unlimited, which macOS refuses as a soft one, to OPEN_MAX)."""
    infinity = resource.RLIM_INFINITY
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    for target in ([hard] if hard != infinity else [infinity, OPEN_MAX]):
        if soft == infinity or target != infinity and target <= soft:
            break
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
            break
        except (ValueError, OSError):  # refused: the next target
            pass
    return soft if soft != infinity else 1 << 20


class TLSOnlyProtocol(asyncio.Protocol):
    """A connection's first byte decides (TLS or a 400), then asyncio's TLS layer and uvicorn take it, under
    the deadlines in the module docstring."""

    def __init__(self, make_inner: Callable[[], asyncio.BaseProtocol], context: ssl.SSLContext, hint: str,
                 connections: Connections | None = None):
        self.make_inner = make_inner
        self.context = context
        self.hint = hint
        self.connections = connections
        self.transport: Any = None
        self.peer: str | None = None  # counted in `connections` until the connection ends
        self.inner: Any = None  # uvicorn's protocol, once TLS has it
        self._timer: asyncio.TimerHandle | None = None
        self._head_from: float | None = None  # when the request head now awaited began (None: none begun)
        self._last_data = 0.0

    def connection_made(self, transport: Any) -> None:
        self.transport = transport
        peer = transport.get_extra_info("peername")
        if self.connections is not None:
            network = peer_network(str(peer[0])) if peer else "?"
            if not self.connections.admit(network):
                transport.abort()
                return
            self.peer = network
        self._timer = asyncio.get_running_loop().call_later(FIRST_BYTE_TIMEOUT_S, transport.abort)

    def connection_lost(self, exc: Exception | None) -> None:  # before the TLS hand-off; after it, _TLS calls it
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self.peer is not None and self.connections is not None:
            self.connections.release(self.peer)
            self.peer = None

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
        self.inner = self.make_inner()
        tls = _TLS(self, loop, _Watched(self), self.context, None, server_side=True,
                   ssl_handshake_timeout=HANDSHAKE_TIMEOUT_S)
        self.transport.set_protocol(tls)
        tls.connection_made(self.transport)
        self._head_from = self._last_data = loop.time()
        self._timer = loop.call_later(CHECK_EVERY_S, self._check)
        replay(tls, data)

    def _waiting(self) -> bool:
        """Between requests: no request head parsed yet, or the last one answered."""
        cycle = getattr(self.inner, "cycle", None)
        return cycle is None or cycle.response_complete

    def _check(self) -> None:
        loop = asyncio.get_running_loop()
        now = loop.time()
        cycle = getattr(self.inner, "cycle", None)
        if self._waiting():
            late = self._head_from is not None and now - self._head_from > HEAD_TIMEOUT_S
        else:
            late = getattr(cycle, "more_body", False) and now - self._last_data > BODY_IDLE_S
        if late:
            self.transport.abort()  # connection_lost follows, through _TLS
            return
        self._timer = loop.call_later(CHECK_EVERY_S, self._check)

    def received(self, data: bytes) -> None:
        """Decrypted bytes for uvicorn: a request head that begins now must end within HEAD_TIMEOUT_S."""
        if self._waiting() and self._head_from is None:
            self._head_from = asyncio.get_running_loop().time()
        self._last_data = asyncio.get_running_loop().time()
        before = getattr(self.inner, "cycle", None)
        self.inner.data_received(data)
        if getattr(self.inner, "cycle", None) is not before:  # a head was parsed: its deadline is met
            self._head_from = None


class ProxiedProtocol(TLSOnlyProtocol):
    """Plain HTTP from an HTTPS-terminating proxy: uvicorn's protocol at once, under the same deadlines (the
    request head's from the connection's start)."""

    def __init__(self, make_inner: Callable[[], asyncio.BaseProtocol], connections: Connections | None = None):
        super().__init__(make_inner, None, "", connections)  # type: ignore[arg-type]

    def connection_made(self, transport: Any) -> None:
        super().connection_made(transport)  # admitted, or aborted
        if self._timer is None:
            return
        self._timer.cancel()
        loop = asyncio.get_running_loop()
        self.inner = self.make_inner()
        transport.set_protocol(_Watched(self))
        self.inner.connection_made(transport)
        self._head_from = self._last_data = loop.time()
        self._timer = loop.call_later(CHECK_EVERY_S, self._check)


class _TLS(sslproto.SSLProtocol):
    """asyncio's TLS protocol, telling the TLSOnlyProtocol that handed it the connection when it ends
    (whether or not its handshake was done: only then would uvicorn hear of it)."""

    def __init__(self, owner: TLSOnlyProtocol, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._owner = owner

    def connection_lost(self, exc: Exception | None) -> None:
        self._owner.connection_lost(exc)
        super().connection_lost(exc)

    def _start_shutdown(self) -> None:
        """Our close_notify is in the socket's send buffer once asyncio's shutdown starts; asyncio would then wait
        for the peer's (30 s on 3.11+, for ever on 3.10). A client's idle pooled connection never reads it, so each
        one held a server's exit for uvicorn's whole graceful timeout, with the final pushes behind it. The socket
        is closed instead once what it holds is sent (close() flushes first), as nginx does: nothing is lost. Not
        while TLS still holds data of ours (`_write_backlog`: a write that waits on a read), on either asyncio."""
        super()._start_shutdown()
        if self._transport is not None and not self._write_backlog:
            self._transport.close()


class _Watched(asyncio.Protocol):
    """uvicorn's protocol as asyncio's TLS layer sees it: every call passed on, the bytes through `received`."""

    def __init__(self, owner: TLSOnlyProtocol):
        self._owner, self._inner = owner, owner.inner

    def connection_made(self, transport: Any) -> None:
        self._inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        self._owner.received(data)

    def eof_received(self) -> bool | None:
        return self._inner.eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        self._owner.connection_lost(exc)  # a second call (through _TLS) does nothing
        self._inner.connection_lost(exc)

    def pause_writing(self) -> None:
        self._inner.pause_writing()

    def resume_writing(self) -> None:
        self._inner.resume_writing()


def quiet_accept_errors(loop: asyncio.AbstractEventLoop) -> None:
    """Out of descriptors, asyncio's accept loop logs a traceback per retry (12,000 a second, a gigabyte in two
    minutes, on the checkpoints' disk): those are logged once per REFUSALS_LOGGED_EVERY_S, with a count."""
    state = {"at": -REFUSALS_LOGGED_EVERY_S, "count": 0}

    def handler(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        if not str(context.get("message", "")).startswith("socket.accept() out of system resource"):
            loop.default_exception_handler(context)
            return
        state["count"] += 1
        if time.monotonic() - state["at"] >= REFUSALS_LOGGED_EVERY_S:
            state["at"] = time.monotonic()
            log.error("out of file descriptors: accepting connections failed %d times so far (%s)",
                      state["count"], context.get("exception"))

    loop.set_exception_handler(handler)


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


def wrap_uvicorn_protocol(config: Any, context: ssl.SSLContext | None, hint: str, connections: Connections | None = None) -> None:
    """Make a loaded uvicorn Config serve every connection through TLSOnlyProtocol, or ProxiedProtocol when
    `context` is None (within `connections`)."""
    inner_cls = config.http_protocol_class

    def factory(config: Any, server_state: Any, app_state: Any, _loop: Any = None) -> asyncio.Protocol:
        inner = partial(inner_cls, config=config, server_state=server_state, app_state=app_state, _loop=_loop)
        if context is None:
            return ProxiedProtocol(inner, connections)
        return TLSOnlyProtocol(inner, context, hint, connections)

    config.http_protocol_class = factory

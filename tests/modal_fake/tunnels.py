"""Tunnels: the proxies from 127.0.0.1 to a sandbox's opened ports.

Every port in `encrypted_ports` (and `h2_ports`) gets a TLS-terminating TCP proxy on
127.0.0.1:<free port>, with a certificate for 127.0.0.1/localhost signed by a fake "Modal edge" CA
(`FakeModal.edge_ca_pem`), forwarding plain TCP to the sandbox's local port; `unencrypted_ports` get a plain
TCP proxy (the ports as the client sends them: `open_ports` PortSpecs, modal/sandbox/_common.py:464, 519).
The client makes `Tunnel.url` "https://host[:port]" of an encrypted tunnel's host and port (modal/_tunnel.py:29-43).
A tunnel exists from creation on, before the server listens: a connection that arrives before the process
listens is accepted and then closed (Modal's docs say the tunnel is there at once; not checkable from the client).

Their connections are the sandbox's activity for `idle_timeout` (see sandboxes.py): a connection open (`open_conns`)
holds the timer, and its traffic in either direction resets it (`_Sandbox.touch`). What counts as activity is
Modal's docs, not checkable from the 1.6.4 client.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from modal_proto import api_pb2

if TYPE_CHECKING:
    from .sandboxes import _Sandbox


@dataclass
class _Tunnel:
    container_port: int
    target_port: int
    encrypted: bool
    server: asyncio.AbstractServer | None = None
    port: int = 0
    writers: set = field(default_factory=set)


class _Tunnels:
    """FakeModal's part that opens tunnels (with its `_edge_ssl`, the fake "Modal edge" certificate)."""

    async def _open_tunnel(self, sb: _Sandbox, tunnel: _Tunnel) -> None:
        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            if sb.result is not None:
                writer.close()
                return
            tunnel.writers.add(writer)
            sb.open_conns += 1
            sb.touch()
            up_writer = None
            try:
                try:
                    up_reader, up_writer = await asyncio.open_connection("127.0.0.1", tunnel.target_port)
                except OSError:
                    return  # the server does not listen yet: the connection is just closed
                tunnel.writers.add(up_writer)
                await asyncio.gather(_pipe(reader, up_writer, sb), _pipe(up_reader, writer, sb))
            except (ConnectionError, OSError, asyncio.CancelledError):
                pass
            finally:
                sb.open_conns -= 1
                sb.touch()
                for w in (writer, up_writer):
                    if w is not None:
                        tunnel.writers.discard(w)
                        w.close()

        tunnel.server = await asyncio.start_server(
            handle, "127.0.0.1", 0, ssl=self._edge_ssl if tunnel.encrypted else None)
        tunnel.port = tunnel.server.sockets[0].getsockname()[1]


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, sb: _Sandbox) -> None:
    try:
        while data := await reader.read(65536):
            sb.touch()
            writer.write(data)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()
    except (ConnectionError, OSError):
        writer.close()


def _close_tunnel(tunnel: _Tunnel) -> None:
    if tunnel.server is not None:
        tunnel.server.close()
    for w in list(tunnel.writers):
        w.transport.abort()
    tunnel.writers.clear()


def _tunnel_protos(sb: "_Sandbox") -> list:
    """TunnelData as the client reads it: container_port -> (host, port, unencrypted_host, unencrypted_port)
    (modal/sandbox/_common.py:365-366)."""
    out = []
    if not sb.started:  # no container yet: no tunnel to report (tunnels() times out: _common.py:836-840)
        return out
    for t in sb.tunnels.values():
        if t.encrypted:
            out.append(api_pb2.TunnelData(host="127.0.0.1", port=t.port, container_port=t.container_port))
        else:
            out.append(api_pb2.TunnelData(host="127.0.0.1", port=t.port, unencrypted_host="127.0.0.1",
                                          unencrypted_port=t.port, container_port=t.container_port))
    return out

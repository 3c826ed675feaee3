"""The server's plumbing, in-process: token checks on every kind of connection, event logs that never
fsync on the event loop, and a listening socket that drops peers which stop acknowledging."""

from __future__ import annotations

import socket
import threading
import time

import pytest
from starlette.applications import Starlette
from starlette.routing import WebSocketRoute
from starlette.testclient import TestClient
from starlette.websockets import WebSocket, WebSocketDisconnect

from artcloud.server import jobs
from artcloud.server.lease import Lease
from artcloud.server.main import TCP_KEEPALIVE, TCP_USER_TIMEOUT_MS, bind
from artcloud.server.middleware import TokenAuth


def _websocket_app() -> Starlette:
    async def echo(ws: WebSocket) -> None:
        await ws.accept()
        await ws.send_text("hello " + await ws.receive_text())
        await ws.close()

    return Starlette(routes=[WebSocketRoute("/ws", echo)])


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}])
def test_a_websocket_without_the_token_is_refused(headers):
    """Before the fix, TokenAuth passed every non-HTTP scope through: a websocket route (one a future
    streaming API may add) would have been open to the internet."""
    lease = Lease(lease_s=60)
    client = TestClient(TokenAuth(_websocket_app(), "secret", lease))
    with pytest.raises(WebSocketDisconnect) as refused:
        with client.websocket_connect("/ws", headers=headers) as ws:
            ws.send_text("x")
            ws.receive_text()
    assert refused.value.code == 1008  # policy violation


def test_a_websocket_with_the_token_gets_through_and_renews_the_lease():
    lease = Lease(lease_s=60)
    lease.last_request_at = 0.0
    client = TestClient(TokenAuth(_websocket_app(), "secret", lease))
    with client.websocket_connect("/ws", headers={"Authorization": "Bearer secret"}) as ws:
        ws.send_text("there")
        assert ws.receive_text() == "hello there"
    assert lease.last_request_at > 0.0


def test_event_logs_are_fsynced_off_the_calling_thread(tmp_path, monkeypatch):
    """Job.emit runs on the event loop: an fsync there stalls every request for as long as the disk
    takes (seconds on a busy cloud volume). emit writes the line; a background thread fsyncs it."""
    synced: list[tuple[str, str]] = []
    real_fsync = jobs.os.fsync

    def fsync(fd: int) -> None:
        synced.append((threading.current_thread().name, jobs.os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    monkeypatch.setattr(jobs.os, "fsync", fsync)
    job = jobs.Job("job-1", "agent", tmp_path, {})
    caller = threading.current_thread().name
    for i in range(20):
        job.emit("step", i=i)
    assert len((tmp_path / "job-1.events.jsonl").read_text().splitlines()) == 20  # written at once
    deadline = time.monotonic() + 10 * jobs.SYNC_EVERY_S + 5
    while not any(path.endswith("job-1.events.jsonl") for _, path in synced) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert any(path.endswith("job-1.events.jsonl") for _, path in synced), "the event log was never fsynced"
    assert caller not in {thread for thread, _ in synced}, synced


def test_the_listening_socket_drops_peers_that_stop_acknowledging():
    """Accepted sockets inherit these on Linux: a peer that vanished mid-response is dropped after
    TCP_USER_TIMEOUT instead of ~15 minutes of retransmissions, and idle ones are probed."""
    sock = bind("127.0.0.1", 0)
    try:
        assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT) == TCP_USER_TIMEOUT_MS
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE) == TCP_KEEPALIVE[0]
        peer = socket.create_connection(sock.getsockname())
        accepted, _ = sock.accept()
        with peer, accepted:
            assert accepted.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT) == TCP_USER_TIMEOUT_MS
    finally:
        sock.close()

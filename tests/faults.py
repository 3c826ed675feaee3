"""Faults injected for real between a client and an HTTP server: an HTTP/1.1-aware proxy on loopback.

`HTTPFaultProxy` sits in front of a plain-HTTP server (SeaweedFS's S3 port) and forwards requests one by
one, so it can act on a chosen request:

- `lose_next_response(match)`: the next request for which `match(request)` is true is forwarded, the
  server's whole answer is read, and then the client's connection is aborted instead of answered: the
  write happened, the answer was lost (a dropped connection at the worst moment);
- `rate_bytes_per_s`: request bodies are forwarded no faster than this (a slow uplink to S3), so an
  upload takes size / rate seconds at least;
- `hold(match)`: every request for which `match(request)` is true waits at the proxy, unsent (a barrier at the
  network: a test knows the upload has begun and that none of it reached the server), until the Hold is
  released: then forwarded, or its connection reset (the machine that sent it is gone).

It understands keep-alive, Content-Length and chunked bodies (both ways), HEAD and 1xx/204/304 answers,
and `Expect: 100-continue` (the proxy answers the 100 itself and forwards the request without it).
Every forwarded request is recorded in `log` as (method, path, status), status None for a lost answer.
"""

from __future__ import annotations

import socket
import threading
import time
from dataclasses import dataclass, field
from typing import BinaryIO, Callable

CHUNK = 16 << 10


@dataclass
class Request:
    method: str
    path: str
    headers: dict[str, str] = field(default_factory=dict)  # names lower-cased


class Hold:
    """Requests held at the proxy (HTTPFaultProxy.hold): `arrived` is set once one is; `release` lets them go."""

    def __init__(self, match: Callable[[Request], bool]):
        self.match = match
        self.held: list[Request] = []
        self.arrived = threading.Event()
        self._released = threading.Event()
        self._forward = False

    def release(self, *, forward: bool) -> None:
        """forward=True: the held requests go on to the server; False: their connections are reset, unsent."""
        self._forward = forward
        self._released.set()


class _Closed(Exception):
    """The peer closed its connection between requests: the normal end of a keep-alive connection."""


def _read_head(rfile: BinaryIO) -> list[bytes]:
    lines = []
    while True:
        line = rfile.readline(65537)
        if not line:
            if lines:
                raise ConnectionError("connection closed inside a message head")
            raise _Closed()
        if line in (b"\r\n", b"\n"):
            if lines:
                return lines
            continue  # stray blank lines between messages are allowed
        lines.append(line)


def _headers(lines: list[bytes]) -> dict[str, str]:
    headers = {}
    for line in lines:
        name, _, value = line.decode("latin-1").partition(":")
        headers[name.strip().lower()] = value.strip()
    return headers


class HTTPFaultProxy:
    """A threaded HTTP/1.1 proxy on 127.0.0.1 in front of `target` (host, port); see the module doc."""

    def __init__(self, target_host: str, target_port: int, *, rate_bytes_per_s: float | None = None):
        self.target = (target_host, target_port)
        self.rate_bytes_per_s = rate_bytes_per_s
        self.log: list[tuple[str, str, int | None]] = []
        self._lose: list[Callable[[Request], bool]] = []
        self._holds: list[Hold] = []
        self._lock = threading.Lock()
        self._sockets: set[socket.socket] = set()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._closed = False
        threading.Thread(target=self._accept, daemon=True, name="fault-proxy").start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def lose_next_response(self, match: Callable[[Request], bool]) -> None:
        """The next request matching `match` reaches the server, but its answer never reaches the client."""
        with self._lock:
            self._lose.append(match)

    def hold(self, match: Callable[[Request], bool]) -> Hold:
        """Hold every request matching `match`, from now until the returned Hold is released."""
        hold = Hold(match)
        with self._lock:
            self._holds.append(hold)
        return hold

    @property
    def holds(self) -> list[Hold]:
        return list(self._holds)

    def requests(self, method: str, path_suffix: str = "") -> list[tuple[str, str, int | None]]:
        return [r for r in self.log if r[0] == method and r[1].split("?")[0].endswith(path_suffix)]

    def close(self) -> None:
        self._closed = True
        self._listener.close()
        with self._lock:
            for s in list(self._sockets):
                self._abort(s)

    # ------------------------------------------------------------------------------------- plumbing

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(client,), daemon=True, name="fault-proxy-conn").start()

    def _abort(self, sock: socket.socket) -> None:
        # A reset, not a polite FIN: the client sees the connection die, as on a real network fault.
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
            sock.close()
        except OSError:
            pass
        self._sockets.discard(sock)

    def _take_fault(self, request: Request) -> bool:
        with self._lock:
            for i, match in enumerate(self._lose):
                if match(request):
                    del self._lose[i]
                    return True
        return False

    def _wait_if_held(self, request: Request) -> bool:
        """Whether `request` may go on: False when a hold that matched it was released without forwarding."""
        with self._lock:
            hold = next((h for h in self._holds if not h._released.is_set() and h.match(request)), None)
            if hold is not None:
                hold.held.append(request)
        if hold is None:
            return True
        hold.arrived.set()
        while not hold._released.wait(0.1):
            if self._closed:
                return False
        return hold._forward

    def _serve(self, client: socket.socket) -> None:
        with self._lock:
            self._sockets.add(client)
        upstream: socket.socket | None = None
        crfile = client.makefile("rb")
        urfile: BinaryIO | None = None
        try:
            while True:
                head = _read_head(crfile)
                method, path, _ = head[0].decode("latin-1").split(" ", 2)
                request = Request(method, path, _headers(head[1:]))
                if not self._wait_if_held(request):
                    return  # the finally below resets the client's connection: never sent
                if upstream is None:
                    upstream = socket.create_connection(self.target)
                    with self._lock:
                        self._sockets.add(upstream)
                    urfile = upstream.makefile("rb")
                # The proxy answers `Expect: 100-continue` itself: the server gets a plain request.
                if request.headers.get("expect", "").lower() == "100-continue":
                    client.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")
                    head = [h for h in head if not h.lower().startswith(b"expect:")]
                upstream.sendall(b"".join(head) + b"\r\n")
                self._forward_body(crfile, upstream, request.headers, rate=self.rate_bytes_per_s)
                lose = self._take_fault(request)

                def record(status: int) -> None:  # before the client sees the answer, so a test reading log never races it
                    self.log.append((request.method, request.path, None if lose else status))

                keep_alive = self._relay_response(urfile, None if lose else client, request.method, record)
                if lose:
                    return  # the finally below resets the client's connection: the answer is lost
                if not keep_alive or request.headers.get("connection", "").lower() == "close":
                    return
        except (_Closed, OSError, ValueError):
            pass
        finally:
            with self._lock:
                self._abort(client)
                if upstream is not None:
                    self._abort(upstream)

    def _forward_body(self, rfile: BinaryIO, out: socket.socket, headers: dict[str, str], *, rate: float | None) -> None:
        started, sent = time.monotonic(), 0

        def send(data: bytes) -> None:
            nonlocal sent
            for i in range(0, len(data), CHUNK):
                piece = data[i:i + CHUNK]
                out.sendall(piece)
                sent += len(piece)
                if rate:  # sleep until the bytes sent so far fit the rate
                    ahead = sent / rate - (time.monotonic() - started)
                    if ahead > 0:
                        time.sleep(ahead)

        if "chunked" in headers.get("transfer-encoding", "").lower():
            while True:
                size_line = rfile.readline(65537)
                send(size_line)
                size = int(size_line.split(b";")[0].strip(), 16)
                if size == 0:
                    while (trailer := rfile.readline(65537)) not in (b"\r\n", b"\n", b""):
                        send(trailer)
                    send(b"\r\n")
                    return
                send(self._read_exactly(rfile, size + 2))
        else:
            remaining = int(headers.get("content-length", "0") or 0)
            while remaining:
                data = rfile.read(min(CHUNK, remaining))
                if not data:
                    raise ConnectionError("body cut short")
                send(data)
                remaining -= len(data)

    @staticmethod
    def _read_exactly(rfile: BinaryIO, n: int) -> bytes:
        data = rfile.read(n)
        if len(data) != n:
            raise ConnectionError("body cut short")
        return data

    def _relay_response(self, rfile: BinaryIO, client: socket.socket | None, method: str,
                        record: Callable[[int], None]) -> bool:
        """Read one whole answer from the server, passing it to `client` (None: swallow it); `record(status)`
        is called with the final status before any of it is passed on. Returns whether to keep the connection."""
        while True:
            head = _read_head(rfile)
            status = int(head[0].split(b" ", 2)[1])
            if status >= 200 or status == 101:
                record(status)
            if client is not None:
                client.sendall(b"".join(head) + b"\r\n")
            if status >= 200 or status == 101:
                break  # 1xx answers other than 101 are interim: the final one follows
        headers = _headers(head[1:])
        keep_alive = headers.get("connection", "").lower() != "close"
        out = client

        class _Sink:
            @staticmethod
            def sendall(data: bytes) -> None:
                if out is not None:
                    out.sendall(data)

        if method == "HEAD" or status in (204, 304):
            return keep_alive
        if "chunked" in headers.get("transfer-encoding", "").lower() or "content-length" in headers:
            self._forward_body(rfile, _Sink(), headers, rate=None)  # type: ignore[arg-type]
            return keep_alive
        while data := rfile.read(CHUNK):  # no length: the body runs to the end of the connection
            _Sink.sendall(data)
        return False

"""A loopback forwarder: a plain-HTTP OpenAI endpoint on 127.0.0.1 in front of a backend's HTTPS server.

Why it exists: ART rollouts build their own client, `AsyncOpenAI(base_url=model.inference_base_url,
api_key=model.inference_api_key)`, with no say over TLS. An artcloud server speaks HTTPS only, with a
certificate from the launch's own CA, which no plain client trusts; nor can this process trust it for
everyone (a cloud server's certificate does not name the machine's IP, so the backend checks it with
`check_hostname=False`, which must not leak to every other HTTPS connection of the process). So each
backend serves its models' OpenAI routes on `http://127.0.0.1:PORT/v1`, reachable from this machine only:

- it takes a fresh random key of its own (`inference_api_key`); the server's token never leaves the
  backend, and a wrong key gets a 401 in the server's own error shape;
- it forwards only OpenAI's routes (GET /v1/models[/ID], POST /v1/chat/completions), to the server's host
  whatever the request target says: its key buys rollouts, not the server's token's other powers;
- it sends each request on to the backend's server *as it is at that moment* (URL, CA, token read per
  request), so after a replaced server (a preempted spot machine, `RemoteBackend.recover`) it follows;
  a request cut off by the loss answers 502 and the client's own retry goes to the new server;
- responses pass through unbuffered: status, headers and error bodies unchanged, SSE and NDJSON streams
  chunk by chunk;
- it runs in a daemon thread with its own event loop, so a sync `openai.OpenAI` called from the thread
  that runs the user's event loop cannot deadlock it;
- it closes with the backend (`await backend.down()`, `close()`, leaving `async with`).

`model.openai_client()` stays the faster direct client (TLS to the server, no hop in between).
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import threading
from typing import Any, Callable

import h11
import httpx

from artcloud.errors import ArtcloudError

log = logging.getLogger("artcloud.client")

MAX_BODY_BYTES = 128 * 1024 * 1024  # the server's own default limit (server/limits.py max_body_mb)
MAX_HEAD_BYTES = 64 * 1024
DRAIN_BYTES = 4 * 1024 * 1024  # of an oversized body, read and dropped so that its 413 arrives
UPSTREAM_TIMEOUT = httpx.Timeout(connect=30.0, read=1800.0, write=120.0, pool=None)
# Headers that describe one hop, never the message (RFC 9110 7.6.1), plus the ones this hop rewrites.
_HOP = {b"connection", b"keep-alive", b"proxy-connection", b"te", b"trailer", b"transfer-encoding", b"upgrade",
        b"host", b"content-length", b"authorization"}

# (base_url, ssl_context, token) of the backend's server right now.
Target = Callable[[], "tuple[str, Any, str]"]


def _allowed(method: bytes, target: str) -> bool:
    """The OpenAI routes a plain client needs: GET /v1/models[/ID], POST /v1/chat/completions (query strings allowed)."""
    path = target.partition("?")[0]
    if method == b"POST":
        return path == "/v1/chat/completions"
    return method == b"GET" and (path == "/v1/models" or (path.startswith("/v1/models/") and ".." not in path))


def _error(status: int, code: str, message: str) -> tuple[int, bytes]:
    kind = {401: "authentication_error", 404: "not_found_error", 413: "invalid_request_error"}.get(status, "api_error")
    return status, json.dumps({"error": {"code": code, "message": message, "type": kind}}).encode()


class LoopbackForwarder:
    """See the module docstring. `target()` is called per request; `start()` returns the base URL."""

    def __init__(self, target: Target, *, max_body_bytes: int = MAX_BODY_BYTES):
        self.target = target
        self.key = "ac-local-" + secrets.token_urlsafe(24)
        self.max_body_bytes = max_body_bytes
        self.port: int | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._server: asyncio.base_events.Server | None = None
        self._clients: dict[tuple[str, int], httpx.AsyncClient] = {}  # per (server URL, context): one pool
        self._tasks: set[asyncio.Task] = set()

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> str:
        if self.running:
            return self.base_url
        ready = threading.Event()
        failure: list[BaseException] = []

        def run() -> None:
            loop = self._loop = asyncio.new_event_loop()
            try:
                self._server = loop.run_until_complete(asyncio.start_server(self._connection, "127.0.0.1", 0))
                self.port = self._server.sockets[0].getsockname()[1]
            except BaseException as e:  # reported to start()'s caller
                failure.append(e)
                ready.set()
                loop.close()
                return
            ready.set()
            try:
                loop.run_forever()
            finally:
                loop.run_until_complete(self._shutdown())
                loop.close()

        self._thread = threading.Thread(target=run, name="artcloud-forwarder", daemon=True)
        self._thread.start()
        ready.wait()
        if failure:
            self._thread = None
            raise ArtcloudError(f"could not open the loopback OpenAI endpoint on 127.0.0.1: {failure[0]}",
                                code="endpoint_failed") from failure[0]
        return self.base_url

    def close(self, timeout: float = 10.0) -> None:
        """Stop listening, drop open connections and end the thread; the port is closed on return."""
        thread, loop = self._thread, self._loop
        if thread is None or loop is None:
            return
        if thread.is_alive():
            loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout)
        self._thread = None

    async def _shutdown(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for client in self._clients.values():
            await client.aclose()
        self._clients.clear()
        if self._server is not None:
            await self._server.wait_closed()

    # ------------------------------------------------------------------------------------- one connection

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        conn = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEAD_BYTES)
        try:
            while True:
                request = await self._next(conn, reader)
                if not isinstance(request, h11.Request):
                    break
                body = await self._body(conn, reader)
                if body is None:  # the rest of the body is not read: this connection ends, and says so
                    await self._answer(conn, writer, *_error(413, "body_too_large",
                                       f"the request body is over {self.max_body_bytes} bytes"), close=True)
                    break
                await self._handle(conn, writer, request, body)
                if conn.our_state is h11.DONE and conn.their_state is h11.DONE:
                    conn.start_next_cycle()
                else:
                    break
        except (h11.RemoteProtocolError, ConnectionError, asyncio.IncompleteReadError):
            pass  # a broken client: nothing to answer
        except asyncio.CancelledError:
            pass  # the forwarder is closing
        finally:
            self._tasks.discard(task)
            writer.close()

    async def _next(self, conn: h11.Connection, reader: asyncio.StreamReader) -> Any:
        while True:
            event = conn.next_event()
            if event is not h11.NEED_DATA:
                return event
            conn.receive_data(await reader.read(65536))

    async def _body(self, conn: h11.Connection, reader: asyncio.StreamReader) -> bytes | None:
        """The request's body, or None when it is over the limit. An oversized body is still read (up to
        a bound) before the 413 goes out: closing a socket with unread data resets the connection, and
        the client would see that instead of the answer."""
        chunks, size = [], 0
        while True:
            event = await self._next(conn, reader)
            if isinstance(event, h11.Data):
                size += len(event.data)
                if size <= self.max_body_bytes:
                    chunks.append(bytes(event.data))
                elif size > self.max_body_bytes + DRAIN_BYTES:
                    return None
            elif isinstance(event, h11.EndOfMessage):
                return b"".join(chunks) if size <= self.max_body_bytes else None
            else:
                raise h11.RemoteProtocolError("request ended early")

    async def _answer(self, conn: h11.Connection, writer: asyncio.StreamWriter, status: int, body: bytes,
                      *, close: bool = False) -> None:
        """A JSON answer; with close, `Connection: close` too, so that a client does not send its next request
        down a connection about to be closed (it would see a disconnect instead of an answer)."""
        if conn.our_state is not h11.SEND_RESPONSE:
            return
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        writer.write(conn.send(h11.Response(status_code=status, headers=headers + ([(b"connection", b"close")] if close else []))))
        writer.write(conn.send(h11.Data(data=body)) + conn.send(h11.EndOfMessage()))
        await writer.drain()

    def _authorized(self, request: h11.Request) -> bool:
        for name, value in request.headers:
            if name == b"authorization":
                scheme, _, given = value.decode("latin-1").partition(" ")
                return scheme.lower() == "bearer" and secrets.compare_digest(given.strip().encode(), self.key.encode())
        return False

    def _client(self, base_url: str, ssl_context: Any) -> httpx.AsyncClient:
        key = (base_url, id(ssl_context))
        client = self._clients.get(key)
        if client is None:
            for old in self._clients.values():  # an earlier server's pool: a replaced server is not coming back
                closing = asyncio.get_running_loop().create_task(old.aclose())
                self._tasks.add(closing)  # a reference until done, or the loop may drop it mid-close
                closing.add_done_callback(self._tasks.discard)
            self._clients = {key: (client := httpx.AsyncClient(verify=ssl_context, timeout=UPSTREAM_TIMEOUT))}
        return client

    async def _handle(self, conn: h11.Connection, writer: asyncio.StreamWriter, request: h11.Request, body: bytes) -> None:
        if not self._authorized(request):
            await self._answer(conn, writer, *_error(401, "unauthorized", "wrong API key: use model.inference_api_key "
                                                     "(this endpoint's own key, not the server's token)"))
            return
        target = request.target.decode("latin-1")
        if not _allowed(request.method, target):  # the server's token must not buy more than OpenAI's routes here
            await self._answer(conn, writer, *_error(404, "not_found", f"this endpoint forwards only GET /v1/models[/ID] and "
                                                     f"POST /v1/chat/completions, not {request.method.decode()} {target[:200]}"))
            return
        try:
            base_url, ssl_context, token = self.target()
        except Exception as e:  # the backend has no server now (closed, down)
            await self._answer(conn, writer, *_error(502, "server_unreachable", f"no artcloud server: {e}"))
            return
        headers = [(n, v) for n, v in request.headers if n not in _HOP]
        headers.append((b"authorization", f"Bearer {token}".encode()))
        upstream = self._client(base_url, ssl_context)
        try:
            base = httpx.URL(base_url)  # only the path and query change: the host is the server's, whatever was sent
            url = base.copy_with(raw_path=base.raw_path.rstrip(b"/") + request.target)
            req = upstream.build_request(request.method.decode(), url, headers=headers, content=body)
            response = await upstream.send(req, stream=True)
        except httpx.HTTPError as e:
            await self._answer(conn, writer, *_error(502, "server_unreachable",
                                                     f"the artcloud server at {base_url} does not answer ({type(e).__name__}: {e})"))
            return
        try:
            out = [(n, v) for n, v in response.headers.raw if n.lower() not in _HOP]
            if "content-length" in response.headers:  # of the bytes as sent: aiter_raw passes them undecoded
                out.append((b"content-length", response.headers["content-length"].encode()))
            writer.write(conn.send(h11.Response(status_code=response.status_code, headers=out)))
            await writer.drain()
            async for chunk in response.aiter_raw():  # as it comes: SSE and NDJSON streams stay streams
                if chunk:
                    writer.write(conn.send(h11.Data(data=chunk)))
                    await writer.drain()
            writer.write(conn.send(h11.EndOfMessage()))
            await writer.drain()
        except httpx.HTTPError as e:  # cut off mid-answer: the message stays unfinished, so the connection closes
            log.info("forwarding %s %s broke off: %s", request.method.decode(), request.target.decode("latin-1"), e)
        finally:
            await response.aclose()

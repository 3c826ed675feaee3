"""The two ASGI layers in front of every route: the bearer token, then the body size limit."""

from __future__ import annotations

import hmac
from typing import Any

from fastapi.responses import JSONResponse

from artcloud.server.api_errors import ApiError
from artcloud.server.lease import Lease

PUBLIC_PATHS = frozenset({"/health"})


def _closing(send: Any) -> Any:
    """`send` with `Connection: close` on the answer: a connection that has not shown the token is not kept alive
    (security review 3, finding 1: one unauthenticated request every < 30 s held a kept-alive connection for good,
    and two addresses held every connection the server would admit)."""
    async def closing(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            message = {**message, "headers": [*message.get("headers", []), (b"connection", b"close")]}
        await send(message)

    return closing


class TokenAuth:
    """`Authorization: Bearer TOKEN` on every path but /health, compared in constant time, for HTTP and
    websocket connections alike (only the lifespan scope passes untouched). Answers without the token (a 401, or
    /health) close their connection. It sits in front of routing,
    so even a 404 is only answered to someone holding the token. Each authenticated request is shown
    to the lease (see lease.py for what renews and what holds it)."""

    def __init__(self, app: Any, token: str, lease: Lease):
        self.app = app
        self.expected = f"Bearer {token}".encode()
        self.lease = lease

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            return await self.app(scope, receive, send)
        if scope["type"] == "http" and scope["path"] in PUBLIC_PATHS:
            return await self.app(scope, receive, _closing(send))
        given = b""
        for name, value in scope.get("headers", []):
            if name == b"authorization":
                given = value
                break
        if not hmac.compare_digest(given, self.expected):
            if scope["type"] != "http":
                # A websocket (or any other) scope: refuse the handshake (the client sees HTTP 403).
                await receive()
                return await send({"type": "websocket.close", "code": 1008})
            error = (ApiError(401, "missing_token", "this server needs 'Authorization: Bearer TOKEN' (the launch's token)")
                     if not given else ApiError(401, "invalid_token", "the bearer token is wrong: use the token of this launch"))
            response = JSONResponse(error.body(), status_code=401, headers={"WWW-Authenticate": "Bearer",
                                                                             "Connection": "close"})
            return await response(scope, receive, send)
        with self.lease.request(scope["path"]):
            return await self.app(scope, receive, send)


class BodyLimit:
    """Refuse request bodies over `max_bytes` with 413 `body_too_large`: at once when Content-Length says
    so, else as soon as the bytes received pass the limit (a chunked upload is never read further)."""

    def __init__(self, app: Any, max_bytes: int, flag: str = "--max-body-mb"):
        self.app = app
        self.max_bytes = max_bytes
        self.flag = flag

    def _error(self, size: str) -> ApiError:
        return ApiError(413, "body_too_large", f"the request body is {size}; this server takes at most "
                        f"{self.max_bytes} bytes (artcloud serve {self.flag}): send fewer groups per request", "body")

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        for name, value in scope.get("headers", []):
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    declared = 0  # uvicorn's parser refuses a malformed length before we get here
                if declared > self.max_bytes:
                    err = self._error(f"{declared} bytes")
                    return await JSONResponse(err.body(), status_code=413, headers={"Connection": "close"})(scope, receive, send)
                break
        received = 0

        async def limited() -> dict[str, Any]:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    # ApiError is an HTTPException: FastAPI's body reader lets it through to our handler.
                    raise self._error(f"over {received} bytes")
            return message

        return await self.app(scope, limited, send)

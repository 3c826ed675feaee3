"""An httpx transport that follows a backend's server across replacements.

The OpenAI client a model hands out (`model.openai_client()`) is built once, with one URL, token and CA. When
a spot machine is preempted, the backend replaces the server: a new URL, a new launch token, a new CA. This
transport sends each request to the backend's current server, with its current token and CA; when a request
fails at the transport (the old machine went away under it), it asks the backend whether the server is lost,
waits while the backend replaces it, and sends the request again. A user's rollout loop sees a pause and one
log line, not an exception. Requests that fail for any other reason fail as before.
"""

from __future__ import annotations

import functools
import logging
from types import ModuleType
from typing import Any, Protocol

from artcloud.tls import client_ssl_context

log = logging.getLogger("artcloud.backends")

MAX_REPLACEMENTS_PER_REQUEST = 2


class Followed(Protocol):
    """What the transport needs of a backend (a RemoteBackend is one; this module does not import it)."""

    endpoint: Any  # the server now: URL, token, CA, generation, as one value
    generation: int
    base_url: str

    async def recover_if_lost(self, error: BaseException, generation: int) -> bool: ...


def following_transport(backend: Followed, hx: ModuleType, limits: Any = None) -> Any:
    """The transport for an HTTP client built on `hx`: httpx, or the httpx2 fork that openai's client uses
    (same API, other classes). `limits`: its connection pool's (a client's own are ignored with a transport)."""
    return _transport_class(hx)(backend, hx, limits)


@functools.lru_cache(maxsize=None)
def _transport_class(hx: ModuleType) -> type:
    class FollowingTransport(hx.AsyncBaseTransport):
        def __init__(self, backend: Followed, hx: ModuleType, limits: Any):
            self.backend, self.hx, self.limits = backend, hx, limits
            self._inner: Any = None
            self._inner_for: Any = None  # the backend's Endpoint the inner transport was made for
            self._retired: list[Any] = []  # earlier servers' transports, closed with this one

        def _transport(self) -> Any:
            ep = self.backend.endpoint  # one value: URL, token and CA of the same server
            if self._inner is None or self._inner_for != ep:
                old, self._inner = self._inner, self.hx.AsyncHTTPTransport(
                    verify=client_ssl_context(ep.ca, check_hostname=ep.check_hostname),
                    **({"limits": self.limits} if self.limits is not None else {}))
                self._inner_for = ep
                self._base = self.hx.URL(ep.url)
                self._auth = f"Bearer {ep.token}"
                if old is not None:
                    self._retired.append(old)
            return self._inner

        async def handle_async_request(self, request: Any) -> Any:
            replaced = 0
            while True:
                generation = self.backend.generation
                transport, base = self._transport(), self._base
                if (request.url.host, request.url.port) != (base.host, base.port):  # made for an earlier server
                    request.url = request.url.copy_with(scheme=base.scheme, host=base.host, port=base.port)
                request.headers["Authorization"] = self._auth
                try:
                    return await transport.handle_async_request(request)
                except self.hx.TransportError as e:
                    if replaced >= MAX_REPLACEMENTS_PER_REQUEST or not await self.backend.recover_if_lost(e, generation):
                        raise
                    replaced += 1
                    log.warning("%s %s: the server was replaced (%s); sending the request again to %s",
                                request.method, request.url.path, type(e).__name__, self.backend.base_url)

        async def aclose(self) -> None:
            for transport in [*self._retired, *([self._inner] if self._inner is not None else [])]:
                await transport.aclose()
            self._retired, self._inner = [], None

    return FollowingTransport

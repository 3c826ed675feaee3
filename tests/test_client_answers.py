"""What the client does with answers that are not artcloud's: something between it and the server (a proxy, a
captive portal) answers in the server's place. A real HTTPS server, with the launch's CA, plays that part."""

from __future__ import annotations

import asyncio
import ssl
import tempfile
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from artcloud.backends.remote import RemoteBackend
from artcloud.errors import ArtcloudError
from artcloud.tls import make_launch_secrets


class Portal:
    """Answers every request with `status` and an HTML page, and counts the heartbeats it saw."""

    def __init__(self, status: int = 200, body: bytes = b"<html>please log in</html>", beats_wanted: int = 3,
                 content_type: str = "text/html"):
        self.secrets = make_launch_secrets()
        self.beats = 0
        self.enough_beats = threading.Event()
        portal = self

        class Handler(BaseHTTPRequestHandler):
            def _answer(self) -> None:
                if self.path == "/artcloud/heartbeat":
                    portal.beats += 1
                    if portal.beats >= beats_wanted:
                        portal.enough_beats.set()
                self.send_response(status)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            do_GET = do_POST = _answer

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        with tempfile.TemporaryDirectory() as d:
            paths = self.secrets.write(Path(d))
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            context.load_cert_chain(paths.server_cert, paths.server_key)
        self.server.socket = context.wrap_socket(self.server.socket, server_side=True)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def backend(self, **kwargs) -> RemoteBackend:
        host, port = self.server.server_address
        return RemoteBackend(f"https://localhost:{port}", token=self.secrets.token, ca_cert=self.secrets.ca_cert,
                             retries=1, **kwargs)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def portal():
    p = Portal()
    yield p
    p.close()


def model_info_error(portal: Portal) -> ArtcloudError:
    """What GET /artcloud/models/agent raises when `portal` answers it."""
    async def main():
        backend = portal.backend()
        try:
            with pytest.raises(ArtcloudError) as caught:
                await backend.model_info("agent")
        finally:
            await backend.close()
        return caught.value

    return asyncio.run(main())


def test_a_non_json_200_is_an_artcloud_error_that_says_what_answered(portal):
    error = model_info_error(portal)
    assert error.code == "not_artcloud" and error.status == 200
    assert "200 from GET /artcloud/models/agent is not an artcloud answer (text/html" in str(error)
    assert "a proxy, a captive portal" in str(error)


def test_a_json_answer_of_another_shape_is_an_artcloud_error_naming_the_field():
    """JSON, but not the protocol's (another service on the port, a changed server): the client reads every answer
    into its wire model, and says which field is wrong instead of failing later on a missing key."""
    other = Portal(body=b'{"step": "three", "name": "agent"}', content_type="application/json")
    try:
        error = model_info_error(other)
    finally:
        other.close()
    assert error.code == "not_artcloud"
    assert str(error).startswith("GET /artcloud/models/agent is not an artcloud answer: ")


def test_the_heartbeat_goes_on_after_an_answer_that_is_not_artcloud(portal):
    """One such answer ended the heartbeat task without a word, and the lease then ended a live client's server."""
    async def main():
        backend = portal.backend(heartbeat_every_s=0.05)
        backend._start_heartbeats()
        try:
            beat_on = await asyncio.to_thread(portal.enough_beats.wait, 30)
            return beat_on, backend._heartbeat.done()
        finally:
            await backend.close()

    beat_on, ended = asyncio.run(main())
    assert beat_on, f"the heartbeat stopped after {portal.beats} beat(s)"
    assert not ended


def test_error_answers_raise_one_class_per_status_with_the_servers_code_and_field(tiny_server):
    """As openai's client does: an except clause per status, every one an ArtcloudError; the code and the field stay
    the server's."""
    import artcloud

    async def main():
        backend = RemoteBackend(tiny_server.url, token=tiny_server.token, ca_cert=tiny_server.ca, retries=1)
        wrong = RemoteBackend(tiny_server.url, token="w" * 32, ca_cert=tiny_server.ca, retries=1)
        caught = []
        for call in (lambda: backend.model_info("nobody"),
                     lambda: backend.register("bad name!", "p", "artcloud/tiny-random", {}),
                     lambda: wrong.model_info("agent")):
            try:
                await call()
            except artcloud.ArtcloudError as e:
                caught.append(e)
        await backend.close()
        await wrong.close()
        return caught

    missing, bad, unauthorized = asyncio.run(main())
    assert isinstance(missing, artcloud.NotFound) and isinstance(missing, LookupError)
    assert (missing.status, missing.code) == (404, "model_not_found")
    assert isinstance(bad, artcloud.BadRequest) and isinstance(bad, ValueError) and bad.status in (400, 422)
    assert bad.field == "name", (bad.code, bad.field, str(bad))
    assert isinstance(unauthorized, artcloud.Unauthorized) and unauthorized.status == 401
    assert all(isinstance(e, artcloud.APIError) for e in (missing, bad, unauthorized))

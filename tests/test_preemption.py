"""The server's watch on its cloud's preemption notice (artcloud/server/preemption.py), against metadata services
on loopback: AWS's IMDSv2 (tests/sky_metadata.py, the same one the SkyPilot stand-in's nodes serve) and GCP's,
found through the clouds' own endpoint overrides."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from artcloud.server import preemption
from tests import sky_metadata


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def aws(monkeypatch):
    state: dict = {}
    port = _free_port()
    server = sky_metadata.serve(port, lambda: state)
    monkeypatch.setenv("AWS_EC2_METADATA_SERVICE_ENDPOINT", f"http://127.0.0.1:{port}")
    yield state
    server.shutdown()


def test_aws_notice_is_seen_only_after_it_is_posted(aws):
    async def main() -> list[str | None]:
        watch = preemption.Watch(every_s=0.05)
        await watch.start()
        assert watch.cloud is not None and watch.cloud.name == "AWS"
        seen = [await watch.notice() for _ in range(3)]  # the first asks (no notice), the next two are within every_s
        await asyncio.sleep(0.06)
        seen.append(await watch.notice())  # asked: no notice yet
        aws["preemption"] = {"at": time.time(), "ends_at": time.time() + 120}
        while seen[-1] is None:
            await asyncio.sleep(0.01)
            seen.append(await watch.notice())
        return seen

    seen = asyncio.run(main())
    assert not any(seen[:-1]) and seen[-1].startswith('AWS spot instance-action {"action": "terminate"')


def test_gcp_notice_through_its_metadata_server(monkeypatch):
    preempted = {"value": "FALSE"}

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_GET(self):  # noqa: N802
            ok = self.path == "/computeMetadata/v1/instance/preempted" and self.headers.get("Metadata-Flavor") == "Google"
            body = preempted["value"].encode() if ok else b""
            self.send_response(200 if ok else 403)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        monkeypatch.setenv("AWS_EC2_METADATA_SERVICE_ENDPOINT", f"http://127.0.0.1:{_free_port()}")  # nothing there
        monkeypatch.setenv("GCE_METADATA_HOST", f"127.0.0.1:{server.server_address[1]}")
        cloud = preemption.find_cloud()
        assert cloud is not None and cloud.name == "GCP" and cloud.notice() is None
        preempted["value"] = "TRUE"
        assert cloud.notice() == "GCP instance/preempted is TRUE"
    finally:
        server.shutdown()


def test_aws_refuses_a_request_without_its_session_token(aws):
    """IMDSv2 only: the watch must fetch a token first (a plain GET is 401 there)."""
    import urllib.error
    import urllib.request

    base = preemption.AWS().base
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(f"{base}/latest/meta-data/spot/instance-action", timeout=2)
    assert e.value.code == 401

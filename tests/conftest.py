"""Shared fixtures: a real `artcloud serve` process over HTTPS on loopback, with artcloud/tiny-random."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import httpx
import pytest

from artcloud.backends.process import ServerProcess

# Never reach a hub or a cloud from a test.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_HUB_DISABLE_TELEMETRY"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

TINY = "artcloud/tiny-random"
SMOLLM2 = "HuggingFaceTB/SmolLM2-135M-Instruct"


class Server(ServerProcess):
    """`artcloud serve` as a child process, with test-friendly timeouts."""

    def client(self, token: str | None = None, **kw) -> httpx.Client:
        return super().client(token, timeout=120, **kw)


@pytest.fixture
def start_server(tmp_path):
    servers: list[Server] = []

    def start(path: Path | None = None, *args: str, **kw) -> Server:
        server = Server(path or tmp_path / f"srv{len(servers)}", *args, **kw)
        servers.append(server)  # before start(): a server that fails to come up is still stopped
        return server.start()

    yield start
    for s in servers:
        s.stop()


@pytest.fixture(scope="module")
def tiny_server(tmp_path_factory):
    """One server per test module, with `agent` registered on artcloud/tiny-random."""
    server = Server(tmp_path_factory.mktemp("tiny") / "data")
    try:
        server.start()
        with server.client() as c:
            r = c.post("/artcloud/models", json={"name": "agent", "project": "tests", "base_model": TINY})
            assert r.status_code == 200, r.text
        yield server
    finally:
        server.stop()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]

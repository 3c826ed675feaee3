"""Shared fixtures: a real `artcloud serve` process over HTTPS on loopback, with artcloud/tiny-random."""

from __future__ import annotations

import os
import re
import signal
import socket
import ssl
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

# Never reach a hub or a cloud from a test.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_HUB_DISABLE_TELEMETRY"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

TINY = "artcloud/tiny-random"
SMOLLM2 = "HuggingFaceTB/SmolLM2-135M-Instruct"


class Server:
    """`artcloud serve` as a child process; its URL is read from what it prints."""

    def __init__(self, path: Path, *args: str, env: dict[str, str] | None = None):
        self.path = path
        self.args = args
        self.env = {**os.environ, **(env or {})}
        self.proc: subprocess.Popen | None = None
        self.url = ""
        self.log = path.parent / f"{path.name}.server.log"

    def start(self, timeout: float = 120.0) -> "Server":
        try:
            return self._start(timeout)
        except BaseException:
            self.kill()
            raise

    def _start(self, timeout: float) -> "Server":
        self.path.mkdir(parents=True, exist_ok=True)
        out = open(self.log, "ab")
        offset = self.log.stat().st_size  # a restart appends to the same log: read only what is new
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "artcloud", "serve", "--path", str(self.path), "--port", "0", *self.args],
            stdout=out, stderr=subprocess.STDOUT, env=self.env,
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            text = self.log.read_bytes()[offset:].decode(errors="replace")
            m = re.findall(r"serving on (https://\S+)", text)
            if m:
                self.url = m[-1]
                break
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{text[-3000:]}")
            time.sleep(0.1)
        else:
            raise TimeoutError(f"server did not start:\n{self.log.read_text()[-3000:]}")
        self.wait_ready(deadline - time.monotonic())
        return self

    @property
    def ca(self) -> Path:
        return self.path / ".tls" / "ca.pem"

    @property
    def token(self) -> str:
        return (self.path / ".tls" / "token").read_text().strip()

    def ssl_context(self) -> ssl.SSLContext:
        from artcloud.tls import client_ssl_context

        return client_ssl_context(self.ca)

    def client(self, token: str | None = None, **kw) -> httpx.Client:
        headers = {"Authorization": f"Bearer {token or self.token}"}
        return httpx.Client(base_url=self.url, verify=self.ssl_context(), headers=headers, timeout=120, **kw)

    def wait_ready(self, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        with httpx.Client(base_url=self.url, verify=self.ssl_context(), timeout=5) as c:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"server exited:\n{self.log.read_text()[-3000:]}")
                try:
                    if c.get("/health").json().get("ready"):
                        return
                except httpx.TransportError:
                    pass
                time.sleep(0.1)
        raise TimeoutError("server never became ready")

    def stop(self, sig: int = signal.SIGTERM) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def kill(self) -> None:
        self.stop(signal.SIGKILL)


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

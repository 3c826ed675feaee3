"""`artcloud serve` as a child process of this one, for tests and benchmarks: started, waited for, measured,
stopped. Not part of the package (users start a server with artcloud.LocalBackend or `artcloud serve`).

The server makes its own CA and token under PATH/.tls (or takes the ones passed through `env`); the URL is
read from the line it prints.
"""

from __future__ import annotations

import os
import signal
import ssl
import subprocess
import time
from pathlib import Path
from typing import Any

import httpx

from artcloud.backends.local import served_url, spawn_serve
from artcloud.errors import ArtcloudError, TimedOut


class ServerProcess:
    def __init__(self, path: Path, *args: str, env: dict[str, str] | None = None, log_level: str = "info"):
        self.path = Path(path)
        self.args = args
        self.env = {**os.environ, **(env or {})}
        self.log_level = log_level
        self.proc: subprocess.Popen | None = None
        self.url = ""
        self.log = self.path.parent / f"{self.path.name}.server.log"

    # ------------------------------------------------------------------------------------- lifecycle

    def start(self, timeout: float = 300.0) -> "ServerProcess":
        """Start and wait until /health says ready. A server that fails to come up is killed."""
        try:
            return self._start(timeout)
        except BaseException:
            self.kill()
            raise

    def _start(self, timeout: float) -> "ServerProcess":
        # LocalBackend's own way to start a server; a restart appends to the same log
        self.proc, offset = spawn_serve(self.path, ["--port", "0", "--log-level", self.log_level, *self.args],
                                        env=self.env, log=self.log)
        deadline = time.monotonic() + timeout
        while not self.url:
            self.url = served_url(self.log, offset) or ""
            if self.url:
                break
            if self.proc.poll() is not None:
                raise ArtcloudError(f"artcloud serve exited with {self.proc.returncode}:\n{self.tail()}", code="server_exited")
            elif time.monotonic() > deadline:
                raise TimedOut(f"artcloud serve did not start in {timeout:.0f} s:\n{self.tail()}")
            else:
                time.sleep(0.1)
        self.wait_ready(deadline - time.monotonic())
        return self

    def wait_ready(self, timeout: float = 300.0) -> None:
        deadline = time.monotonic() + timeout
        with httpx.Client(base_url=self.url, verify=self.ssl_context(), timeout=5) as c:
            while time.monotonic() < deadline:
                if self.proc is None or self.proc.poll() is not None:
                    raise ArtcloudError(f"artcloud serve exited:\n{self.tail()}", code="server_exited")
                try:
                    if c.get("/health").json().get("ready"):
                        return
                except httpx.TransportError:
                    pass
                time.sleep(0.1)
        raise TimedOut(f"artcloud serve never became ready:\n{self.tail()}")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def kill(self) -> None:
        self.stop(signal.SIGKILL)

    def __enter__(self) -> "ServerProcess":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    # ------------------------------------------------------------------------------------- access

    @property
    def ca(self) -> Path:
        return self.path / ".tls" / "ca.pem"

    @property
    def token(self) -> str:
        return (self.path / ".tls" / "token").read_text().strip()

    def ssl_context(self) -> ssl.SSLContext:
        from artcloud.tls import client_ssl_context

        return client_ssl_context(self.ca)

    def client(self, token: str | None = None, timeout: float = 600, **kw: Any) -> httpx.Client:
        headers = {"Authorization": f"Bearer {token or self.token}"}
        return httpx.Client(base_url=self.url, verify=self.ssl_context(), headers=headers, timeout=timeout, **kw)

    def tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def memory(self) -> dict[str, float]:
        """The child's current (VmRSS) and peak (VmHWM) resident memory, in MiB."""
        return proc_memory(self.proc.pid)


def proc_memory(pid: int | str = "self") -> dict[str, float]:
    """VmRSS and VmHWM (peak RSS) of a process from /proc/PID/status, in MiB."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            out[key] = int(value.split()[0]) / 1024  # kB -> MiB
    return out

"""SkyPilot's SDK starts a local API server by itself (a detached process that outlives the command): an
artcloud command that started it stops it again, and says so on stderr; one that was already answering
is left alone. Run on a port of its own (SKYPILOT_API_SERVER_LOCAL_PORT) and in a temporary HOME."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import psutil

from artcloud.backends.sky_server import LocalSkyServer

REPO = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _servers_on(port: int) -> list[psutil.Process]:
    found = []
    for p in psutil.process_iter(attrs=["cmdline"]):
        cmdline = " ".join(p.info["cmdline"] or [])
        if "sky.server.server" in cmdline and f"--port={port}" in cmdline:
            found.append(p)
    return found


def test_a_dry_run_stops_the_api_server_it_started(tmp_path):
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SKYPILOT_", "ARTCLOUD_SKY_API"))}
    env.update({"HOME": str(tmp_path / "home"), "ARTCLOUD_HOME": str(tmp_path / "state"), "PYTHONPATH": str(REPO),
                "SKYPILOT_DISABLE_USAGE_COLLECTION": "1", "SKYPILOT_API_SERVER_LOCAL_PORT": str(port)})
    try:
        result = subprocess.run([sys.executable, "-m", "artcloud", "launch", "--gpu", "L4", "--dry-run"], env=env,
                                cwd=tmp_path, capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stderr
        assert f"stopped the SkyPilot API server this command started (127.0.0.1:{port})" in result.stderr
        psutil.wait_procs(_servers_on(port), timeout=15)
        assert _servers_on(port) == []
    finally:
        for p in _servers_on(port):  # only the server on this test's own port
            p.kill()


def test_a_server_answering_before_is_left_alone(monkeypatch):
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        monkeypatch.setenv("SKYPILOT_API_SERVER_LOCAL_PORT", str(listener.getsockname()[1]))
        guard = LocalSkyServer()
        assert guard.was_answering and guard.after() is None

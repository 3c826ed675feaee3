"""SkyPilot's local API server, which its SDK starts by itself on first use (a detached process on
127.0.0.1:46580, or $SKYPILOT_API_SERVER_LOCAL_PORT) and which outlives the command that started it.

An artcloud command that started it stops it again on the way out, and says so in one line on stderr;
a server that was answering before the command is left alone (the user's, or another tool's).
"""

from __future__ import annotations

import os
import socket
import sys

DEFAULT_PORT = 46580  # sky/server/common.py DEFAULT_SERVER_PORT


def _port() -> int | None:
    try:
        return int(os.environ.get("SKYPILOT_API_SERVER_LOCAL_PORT") or DEFAULT_PORT)
    except ValueError:
        return None


def _answering(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


class LocalSkyServer:
    """`before()` at the start of a command (a TCP probe, no SkyPilot import); `after()` at its end."""

    def __init__(self) -> None:
        self.port = _port()
        self.was_answering = self.port is None or _answering(self.port)

    def after(self) -> str | None:
        """Stop the local API server if this command started it; the line said on stderr, else None."""
        if self.was_answering or "sky" not in sys.modules or getattr(sys.modules["sky"], "__file__", None) is None:
            return None  # not ours, or SkyPilot was never imported (so never asked to start anything)
        try:
            from sky import sky_logging
            from sky.client import sdk
            from sky.server import common

            if not common.is_api_server_local() or common.get_local_api_server_port() != self.port:
                return None  # an endpoint of its own is configured: not started by this command
            # api_stop does not say whether it found a server: ask first (a process still starting counts).
            if not _answering(self.port) and not sdk._local_api_server_running():
                return None
            # `sky api stop` itself (client/sdk.py api_stop): under the API-server creation lock, so no other
            # command starts one meanwhile; it also ends every managed-jobs controller process recorded in
            # ~/.sky/job_controller_pid (artcloud starts none), then the server on this port. Its "stopped" line
            # is ours to say.
            with sky_logging.silent():
                sdk.api_stop()
        except Exception as e:  # never let tidying up hide the command's own outcome
            return (f"artcloud: the SkyPilot API server this command started on 127.0.0.1:{self.port} may still run "
                    f"({type(e).__name__}): `sky api stop` ends it")
        return f"artcloud: stopped the SkyPilot API server this command started (127.0.0.1:{self.port})"

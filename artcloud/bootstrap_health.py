"""Answer GET /health with phase "installing" while a sandbox installs artcloud, before artcloud exists there.

A cold SkyPilot node spends minutes installing the server's environment; without this, the client's ready
poll sees a closed port and cannot tell a slow install from a dead machine. The sky task's setup starts this
script in the background before the install and stops it (SIGTERM) after, so the port is free for
`artcloud serve`. It runs on the image's bare python3 (3.10 or newer) with the standard library alone.

    python3 bootstrap_health.py --record ~/artcloud-install.json

Environment: ARTCLOUD_TLS_CERT and ARTCLOUD_TLS_KEY (the launch's certificate and key, PEM text, as the server
gets them), ARTCLOUD_PORT (8080), ARTCLOUD_HOST (0.0.0.0), ARTCLOUD_VERSION (said in every answer: the client
checks it). Answers {"status": "ok", "version": V, "ready": false, "phase": "installing", "elapsed_s": S}
on GET /health, 404 elsewhere. The record ({"started": T, "ended": T}, wall-clock seconds) is written at
start and at stop; `artcloud serve` reads it (ARTCLOUD_INSTALL_RECORD) and reports the install's duration.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import ssl
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

HANDSHAKE_TIMEOUT_S = 10.0


def _context(cert_pem: str, key_pem: str) -> ssl.SSLContext:
    """A server context from PEM text; the key touches the disk only in a 0600 file, removed at once."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    with tempfile.TemporaryDirectory(prefix="artcloud-boot-") as tmp:
        cert, key = os.path.join(tmp, "cert.pem"), os.path.join(tmp, "key.pem")
        for path, text in ((cert, cert_pem), (key, key_pem)):
            with os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as f:
                f.write(text)
        ctx.load_cert_chain(cert, key)
    return ctx


def _write_record(path: str | None, record: dict) -> None:
    if not path:
        return
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".install-", suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump(record, f)
    os.replace(tmp, path)


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    context: ssl.SSLContext
    started: float
    version: str

    def finish_request(self, request, client_address) -> None:
        # The TLS handshake happens here, on the request's own thread: a client that connects and says
        # nothing holds only its thread, never the accept loop.
        request.settimeout(HANDSHAKE_TIMEOUT_S)
        try:
            request = self.context.wrap_socket(request, server_side=True)
        except (ssl.SSLError, OSError):
            return
        try:
            super().finish_request(request, client_address)
        finally:
            with contextlib.suppress(OSError):
                request.close()


class _Handler(BaseHTTPRequestHandler):
    server: _Server

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        if self.path.split("?", 1)[0] != "/health":
            self._send(404, {"error": {"code": "not_found", "type": "not_found",
                                       "message": "artcloud is still installing: only GET /health answers"}})
            return
        self._send(200, {"status": "ok", "version": self.server.version, "ready": False, "phase": "installing",
                         "elapsed_s": round(time.time() - self.server.started, 3)})

    def _send(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args) -> None:  # noqa: A002 (http.server's signature)
        pass  # the install's own output is what matters in the setup log


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Answer /health (installing) over TLS until stopped.")
    parser.add_argument("--record", default=os.environ.get("ARTCLOUD_INSTALL_RECORD"),
                        help="JSON file for when the install started and ended")
    args = parser.parse_args(argv)
    started = time.time()
    record = {"started": started}
    _write_record(args.record, record)
    cert, key = os.environ.get("ARTCLOUD_TLS_CERT"), os.environ.get("ARTCLOUD_TLS_KEY")
    host, port = os.environ.get("ARTCLOUD_HOST") or "0.0.0.0", int(os.environ.get("ARTCLOUD_PORT") or 8080)
    stop = threading.Event()  # set by SIGTERM (the setup is over) or SIGINT
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    server = None
    if not cert or not key:
        print("bootstrap_health: no ARTCLOUD_TLS_CERT / ARTCLOUD_TLS_KEY: not answering /health", file=sys.stderr)
    else:
        context = _context(cert, key)
        try:
            _Server.address_family = socket.AF_INET6 if ":" in host else socket.AF_INET
            server = _Server((host, port), _Handler)
        except OSError as e:
            print(f"bootstrap_health: cannot listen on {host}:{port} ({e.strerror}): not answering /health",
                  file=sys.stderr)
    if server is not None:
        server.context, server.started = context, started
        server.version = os.environ.get("ARTCLOUD_VERSION") or "unknown"
        threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.2}, daemon=True).start()
        print(f"bootstrap_health: answering https://{host}:{server.server_address[1]}/health (installing)", flush=True)
    while not stop.wait(1.0):  # the record's timing holds even when nothing could be served
        pass
    if server is not None:
        server.shutdown()
        server.server_close()
    record["ended"] = time.time()
    _write_record(args.record, record)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The cloud's instance metadata service on a stand-in node (tests/sky_standin.py): AWS's IMDSv2, as far as a
spot notice goes. The node's supervisor serves it on a loopback port that the node's processes find through
AWS_EC2_METADATA_SERVICE_ENDPOINT (botocore's own override), for as long as the node lives.

    PUT /latest/api/token                        a session token (X-aws-ec2-metadata-token-ttl-seconds required)
    GET /latest/meta-data/spot/instance-action   404 until the cloud reclaims the machine, then 200 with
                                                 {"action": "terminate", "time": "..."} (token required, else 401)

`LocalSky.preempt` sets the notice in the cluster's state; this server reads it on every request.
"""

from __future__ import annotations

import json
import secrets
import threading
from datetime import datetime, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable


def serve(port: int, state: Callable[[], dict[str, Any] | None]) -> ThreadingHTTPServer:
    tokens: set[str] = set()

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:  # quiet
            pass

        def _answer(self, status: int, body: str = "") -> None:
            data = body.encode()
            self.send_response(status)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_PUT(self) -> None:  # noqa: N802
            if self.path != "/latest/api/token" or not self.headers.get("X-aws-ec2-metadata-token-ttl-seconds"):
                return self._answer(400)
            token = secrets.token_urlsafe(24)
            tokens.add(token)
            self._answer(200, token)

        def do_GET(self) -> None:  # noqa: N802
            if self.headers.get("X-aws-ec2-metadata-token") not in tokens:
                return self._answer(401)
            if self.path != "/latest/meta-data/spot/instance-action":
                return self._answer(404)
            notice = (state() or {}).get("preemption")
            if not notice:
                return self._answer(404)
            when = datetime.fromtimestamp(notice["ends_at"], tz=timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
            self._answer(200, json.dumps({"action": "terminate", "time": when}))

    server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
    threading.Thread(target=server.serve_forever, name="standin-imds", daemon=True).start()
    return server

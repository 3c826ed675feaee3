"""The server's lease: teardown layers 2 and 4 (README, "Teardown").

With `--lease`, no authenticated request or heartbeat for that long ends the server; with
`--max-duration`, it ends that long after start, clients or not (lifecycle.py ends it; both are timed on
time.monotonic(), so a clock step on a fresh VM moves neither). A GPU whose client has gone away must
not keep running, so what holds the lease is narrow:

- an authenticated request renews it when it starts and when it ends, and holds it while it runs
  (registering a big model may take longer than the lease);
- an event stream renews it when it starts, and never holds it: a follower that vanished without a
  FIN (a laptop that slept, a cut network) would otherwise keep the server up until TCP gives up,
  about 15 minutes of GPU. A live client sends heartbeats instead;
- reading `GET /artcloud/status` never renews it, so a dashboard that polls keeps no GPU alive.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Any, Iterator

from artcloud.durations import format_duration

# Requests that only watch: they renew the lease when they start but never hold it while they run.
STREAMING_SUFFIX = "/events"
# Requests that do not count as a client's sign of life at all.
NOT_RENEWING = frozenset({"/artcloud/status"})


class Lease:
    def __init__(self, lease_s: float | None = None, max_duration_s: float | None = None,
                 started_at: float | None = None):
        self.lease_s = lease_s
        self.max_duration_s = max_duration_s
        self.started_at = started_at if started_at is not None else time.monotonic()
        self.last_request_at = time.monotonic()
        self.in_flight = 0  # authenticated requests running now that hold the lease

    def touch(self) -> None:
        self.last_request_at = time.monotonic()

    @contextmanager
    def request(self, path: str) -> Iterator[None]:
        """The lease's view of one authenticated request to `path` (see the module docstring)."""
        if path in NOT_RENEWING:
            yield
            return
        self.touch()
        if path.endswith(STREAMING_SUFFIX):
            yield
            return
        self.in_flight += 1
        try:
            yield
        finally:
            self.in_flight -= 1
            self.touch()

    def ended(self, now: float | None = None) -> str | None:
        """Why the server must stop now (a line for the log), or None."""
        now = time.monotonic() if now is None else now
        if self.max_duration_s is not None and now - self.started_at > self.max_duration_s:
            return f"reached --max-duration {format_duration(self.max_duration_s)}"
        if self.lease_s is not None and self.in_flight == 0 and now - self.last_request_at > self.lease_s:
            return f"no client request or heartbeat for {format_duration(self.lease_s)}"
        return None

    def info(self) -> dict[str, Any]:
        now = time.monotonic()
        return {"lease_s": self.lease_s, "idle_s": round(now - self.last_request_at, 1), "in_flight": self.in_flight,
                "max_duration_s": self.max_duration_s, "uptime_s": round(now - self.started_at, 1)}

    def line(self) -> str:
        """What `artcloud serve` prints at start."""
        parts = []
        if self.lease_s is not None:
            parts.append(f"exits after {format_duration(self.lease_s)} without a client request or heartbeat")
        if self.max_duration_s is not None:
            parts.append(f"at most {format_duration(self.max_duration_s)}" if parts
                         else f"exits after {format_duration(self.max_duration_s)}, clients or not")
        return "; ".join(parts)

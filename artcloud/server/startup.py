"""What the server is doing while it comes up, for GET /health: its phase, its progress, and how long each
phase took, so a client waiting on a cold machine can show "fetching weights 3.1/16 GB" instead of silence
and its summary can say where the start-up time went.

    installing        (before the server exists: artcloud/bootstrap_health.py answers /health meanwhile and
                      leaves a record of it, read here)
    starting          the process is up: imports, TLS, restoring models an earlier server left
    fetching_weights  a base model's weights are downloaded (bytes done / total)
    loading_engine    the engine loads them (and a vLLM engine starts its process)
    ready             the server serves; a later registration of a new base model goes through
                      fetching_weights / loading_engine again and back to ready
    (first_rollout    not a phase: how long the first chat completion after ready took, reported with them)

Durations add up over repeats: they are seconds spent in each phase since the process began. Nothing here
names a model or a path: /health is public.
"""

from __future__ import annotations

import json
import logging
import math
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

log = logging.getLogger("artcloud.server")

PHASES = ("starting", "fetching_weights", "loading_engine", "ready")
ENV_INSTALL_RECORD = "ARTCLOUD_INSTALL_RECORD"  # where bootstrap_health.py wrote when the install began and ended
MAX_RECORD_BYTES = 4096


class Startup:
    """The phase tracker. Thread-safe: a weights download reports progress from its own threads."""

    def __init__(self, *, started_at: float | None = None, install_s: float | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self._clock = clock
        self._lock = threading.Lock()
        self.phase = "starting"
        self._since = clock() if started_at is None else started_at
        self._resting = "starting"  # where the server goes back to after loading: ready once it was ready
        self._progress: tuple[int, int] | None = None
        self.durations: dict[str, float] = {}
        if install_s is not None:
            self.durations["installing"] = install_s

    def _enter(self, phase: str) -> None:  # with the lock held
        if phase == self.phase:
            return
        now = self._clock()
        if self.phase != "ready":  # time spent serving is not start-up
            self.durations[self.phase] = self.durations.get(self.phase, 0.0) + max(0.0, now - self._since)
        self.phase, self._since, self._progress = phase, now, None

    def mark_ready(self) -> None:
        with self._lock:
            self._resting = "ready"
            self._enter("ready")

    @contextmanager
    def loading(self) -> Iterator[None]:
        """Around loading a base model: loading_engine (fetching_weights while progress() is told of bytes),
        then back to where the server was (starting, or ready)."""
        with self._lock:
            self._enter("loading_engine")
        try:
            yield
        finally:
            with self._lock:
                self._enter(self._resting)

    def progress(self, done: int, total: int) -> None:
        """A `progress(done_bytes, total_bytes)` callback for a weights download: fetching_weights until the
        last byte, then loading_engine (the engine loads what came)."""
        with self._lock:
            if total > 0 and done >= total:
                self._enter("loading_engine")
                return
            self._enter("fetching_weights")
            self._progress = (max(0, int(done)), max(0, int(total)))

    def rollout_done(self, seconds: float) -> None:
        """The first chat completion answered after ready took `seconds` (the engine's first generation
        pays its warm-up: compiling, caches): the last piece of a cold start."""
        with self._lock:
            if self._resting == "ready" and "first_rollout" not in self.durations:
                self.durations["first_rollout"] = max(0.0, seconds)

    def report(self) -> dict[str, Any]:
        """The /health fields: phase, progress (while fetching), phases (seconds each took so far)."""
        with self._lock:
            phases = {k: round(v, 3) for k, v in self.durations.items()}
            out: dict[str, Any] = {"phase": self.phase, "phase_s": round(max(0.0, self._clock() - self._since), 3),
                                   "phases": phases}
            if self._progress is not None:
                out["progress"] = {"done": self._progress[0], "total": self._progress[1], "unit": "bytes"}
            return out


def read_install_record(path: str | Path | None) -> float | None:
    """Seconds the install took, from bootstrap_health.py's record ({"started": t, "ended": t}, wall-clock
    seconds); None when there is none or it makes no sense (it is only a file on disk: trust nothing in it)."""
    if not path:
        return None
    try:
        with open(path, "rb") as f:
            data = json.loads(f.read(MAX_RECORD_BYTES))
        started, ended = float(data["started"]), float(data["ended"])
    except (OSError, ValueError, TypeError, KeyError):
        return None
    seconds = ended - started
    if not math.isfinite(seconds) or not 0 <= seconds < 7 * 86_400:
        log.warning("ignoring the install record in %s: it says the install took %r s", path, seconds)
        return None
    return seconds

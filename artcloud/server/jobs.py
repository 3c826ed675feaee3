"""Training jobs and their event logs.

Every job's events are appended to `jobs/JOB_ID.events.jsonl` under the model's folder as they happen
and kept in memory; readers follow them with a cursor (`after=seq`), so a dropped connection
reconnects and loses nothing. An event is written to the file (the kernel's page cache: it survives
the server process dying) before any reader can see it; the fsync that makes it survive a machine
crash runs on a background thread within `SYNC_EVERY_S`, never on the event loop. A job whose server
died under it is marked `interrupted` when the model is next loaded; its step was never committed,
and a retried POST with the same idempotency key trains again instead of returning the dead job.
Finished jobs beyond `max_kept` per model are forgotten, oldest first, files included.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import threading
import time
import uuid
from pathlib import Path
from typing import Any, AsyncIterator, Callable

from artcloud.errors import WrongState
from artcloud.wire import Event

log = logging.getLogger("artcloud.server")

FINAL = ("end", "error")
SYNC_EVERY_S = 0.5


class _Syncer:
    """fsyncs the event logs written since its last round, on its own thread."""

    def __init__(self, every_s: float = SYNC_EVERY_S):
        self.every_s = every_s
        self._dirty: set[Path] = set()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def mark(self, path: Path) -> None:
        with self._lock:
            self._dirty.add(path)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="artcloud-event-fsync", daemon=True)
                self._thread.start()

    def _run(self) -> None:
        while True:
            time.sleep(self.every_s)
            self.sync()

    def sync(self) -> None:
        """fsync every file marked so far (the server's exit calls it too)."""
        with self._lock:
            paths, self._dirty = self._dirty, set()
        for path in paths:
            try:
                fd = os.open(path, os.O_RDONLY)
            except FileNotFoundError:  # pruned meanwhile
                continue
            try:
                os.fsync(fd)
            finally:
                os.close(fd)


SYNCER = _Syncer()


class Job:
    def __init__(self, job_id: str, model: str, folder: Path, meta: dict[str, Any]):
        self.id = job_id
        self.model = model
        self.meta = meta  # idempotency key, request hash, created_at
        self.events: list[Event] = []
        self._path = folder / f"{job_id}.events.jsonl"
        self._changed = asyncio.Event()

    @property
    def status(self) -> str:
        if not self.events:
            return "queued"
        last = self.events[-1].type
        return {"queued": "queued", "start": "running", "step": "running", "end": "succeeded", "error": "failed"}[last]

    @property
    def done(self) -> bool:
        return bool(self.events) and self.events[-1].type in FINAL

    def emit(self, type_: str, **data: Any) -> Event:
        if self.done:
            raise WrongState(f"job {self.id} already ended")
        event = Event(seq=len(self.events) + 1, type=type_, job_id=self.id, time=time.time(), data=data)
        with open(self._path, "a") as f:  # in the file before any reader can see it
            f.write(event.model_dump_json() + "\n")
        SYNCER.mark(self._path)
        self.events.append(event)
        self._changed.set()
        self._changed = asyncio.Event()
        return event

    async def follow(self, after: int, *, follow: bool, heartbeat_s: float = 15.0,
                     stop: Callable[[], bool] = lambda: False, poll_s: float = 1.0) -> AsyncIterator[Event | None]:
        """Events with seq > after; with `follow`, waits for more until the job ends, or until `stop()`
        (the server is going away: the follower reconnects and learns it). Yields None as a keep-alive
        when nothing happened for `heartbeat_s` (the route turns it into a blank line)."""
        cursor = after
        quiet_since = time.monotonic()
        while True:
            while cursor < len(self.events):
                cursor += 1
                quiet_since = time.monotonic()
                yield self.events[cursor - 1]
            if self.done or not follow or stop():
                return
            changed = self._changed
            try:
                await asyncio.wait_for(changed.wait(), min(poll_s, heartbeat_s))
            except asyncio.TimeoutError:
                if time.monotonic() - quiet_since >= heartbeat_s:
                    quiet_since = time.monotonic()
                    yield None

    def summary(self) -> dict[str, Any]:
        last = self.events[-1].model_dump() if self.events else None
        return {"job_id": self.id, "model": self.model, "status": self.status, "events": len(self.events),
                "last_event": last, "created_at": self.meta.get("created_at")}


def request_hash(body: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


class JobStore:
    """The jobs of one model: created, looked up by id or idempotency key, reloaded from disk."""

    def __init__(self, model: str, folder: Path, max_kept: int = 100):
        self.model = model
        self.folder = folder
        self.max_kept = max_kept
        self.jobs: dict[str, Job] = {}  # oldest first
        self.by_key: dict[str, str] = {}

    def load(self) -> None:
        """Read jobs left by an earlier server; close the ones it left unfinished."""
        if not self.folder.is_dir():
            return
        for meta_path in sorted(self.folder.glob("*.json"), key=lambda p: p.stat().st_mtime):
            try:
                meta = json.loads(meta_path.read_text())
            except ValueError:
                continue
            job = Job(meta["job_id"], self.model, self.folder, meta)
            events_path = self.folder / f"{job.id}.events.jsonl"
            if events_path.exists():
                for line in events_path.read_text().splitlines():
                    try:
                        job.events.append(Event.model_validate_json(line))
                    except ValueError:
                        break  # a torn last line from a crash: everything before it is intact
                # Rewrite without a torn tail, so new events continue a clean file.
                events_path.write_text("".join(e.model_dump_json() + "\n" for e in job.events))
            if not job.done:
                job.emit("error", code="interrupted", message="the server stopped while this job ran; its step was not "
                         "committed. Post the training request again to retry.")
            self.jobs[job.id] = job
            if meta.get("idempotency_key"):
                self.by_key[meta["idempotency_key"]] = job.id
        self._prune()

    def _prune(self) -> None:
        """Forget the oldest finished jobs beyond `max_kept` (a retry with a forgotten idempotency key
        trains again: keys are meant for retries within minutes, not days)."""
        finished = [j for j in self.jobs.values() if j.done]
        excess = len(self.jobs) - self.max_kept
        for job in finished[:max(excess, 0)]:
            del self.jobs[job.id]
            key = job.meta.get("idempotency_key")
            if key and self.by_key.get(key) == job.id:
                del self.by_key[key]
            for path in (self.folder / f"{job.id}.json", job._path):
                path.unlink(missing_ok=True)

    def find_by_key(self, key: str) -> Job | None:
        job_id = self.by_key.get(key)
        return self.jobs.get(job_id) if job_id else None

    def create(self, *, idempotency_key: str | None, body_hash: str) -> Job:
        self.folder.mkdir(parents=True, exist_ok=True)
        job_id = "job-" + uuid.uuid4().hex[:20]
        meta = {"job_id": job_id, "model": self.model, "idempotency_key": idempotency_key, "request_sha256": body_hash,
                "created_at": time.time()}
        (self.folder / f"{job_id}.json").write_text(json.dumps(meta))
        job = Job(job_id, self.model, self.folder, meta)
        self.jobs[job_id] = job
        if idempotency_key:
            self.by_key[idempotency_key] = job_id
        self._prune()
        return job

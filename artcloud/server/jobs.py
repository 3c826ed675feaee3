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
import contextlib
import errno
import json
import logging
import os
import re
import threading
import time
import uuid
from pathlib import Path
from typing import Any, AsyncIterator, Callable

from artcloud.errors import WrongState
from artcloud.server.api_errors import ApiError
from artcloud.wire import Event

log = logging.getLogger("artcloud.server")

FINAL = ("end", "error")
# What an OSError during a step means, as the code of its `error` event (os_cause).
CAUSES = {"disk_full": "the disk is full", "too_many_open_files": "the server has no file descriptor left",
          "io_error": "a file could not be read or written",
          "rollback_failed": "a failed step could not be undone, so its model is not served until it is reloaded"}
SYNC_EVERY_S = 0.5


def os_cause(e: BaseException) -> str:
    """The code for a failure whose cause (or the cause of that, …) is an OSError: disk_full, too_many_open_files,
    io_error; internal_error for anything else."""
    seen: BaseException | None = e
    while seen is not None:
        # Rust libraries (safetensors, tokenizers) raise their own class, with "(os error 28)" in the message.
        rust = re.search(r"\(os error (\d+)\)", str(seen)) if not isinstance(seen, OSError) else None
        if isinstance(seen, OSError) or rust:
            number = seen.errno if isinstance(seen, OSError) else int(rust.group(1))  # type: ignore[union-attr]
            if number in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
                return "disk_full"
            return "too_many_open_files" if number in (errno.EMFILE, errno.ENFILE) else "io_error"
        seen = seen.__cause__ or seen.__context__
    return "internal_error"


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
            if self._thread is None or not self._thread.is_alive():  # a thread that died is started anew
                self._thread = threading.Thread(target=self._run, name="artcloud-event-fsync", daemon=True)
                self._thread.start()

    def _run(self) -> None:
        while True:
            time.sleep(self.every_s)
            try:
                self.sync()
            except Exception:  # never the end of the thread: the next round tries again
                log.exception("event log fsync failed")

    def sync(self) -> None:
        """fsync every file marked so far (the server's exit calls it too). A file that cannot be opened
        now (pruned meanwhile, no descriptor left) waits for its next write to be marked again."""
        with self._lock:
            paths, self._dirty = self._dirty, set()
        for path in paths:
            try:
                fd = os.open(path, os.O_RDONLY)
            except OSError as e:
                if not isinstance(e, FileNotFoundError):
                    log.warning("could not fsync %s: %s", path.name, e)
                continue
            try:
                os.fsync(fd)
            except OSError as e:
                log.warning("could not fsync %s: %s", path.name, e)
            finally:
                os.close(fd)


SYNCER = _Syncer()


def _append(path: Path, data: bytes) -> None:
    """`data` at the end of `path`, whole or not at all: a write that fails half-way (a full disk) is cut
    back off, so the lines after it are not lost behind a torn one when the file is read back."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        start = os.lseek(fd, 0, os.SEEK_END)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
        except OSError:
            os.ftruncate(fd, start)
            raise
    finally:
        os.close(fd)


class Job:
    def __init__(self, job_id: str, model: str, folder: Path, meta: dict[str, Any]):
        self.id = job_id
        self.model = model
        self.meta = meta  # idempotency key, request hash, created_at
        self.events: list[Event] = []
        self._path = folder / f"{job_id}.events.jsonl"
        self._written = 0  # events in the file: the rest are in memory only (their write failed)
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
        self.events.append(event)
        try:  # in the file before any reader can see it, with any event an earlier write failed to add
            _append(self._path, "".join(e.model_dump_json() + "\n" for e in self.events[self._written:]).encode())
            self._written = len(self.events)
            SYNCER.mark(self._path)
        except OSError as e:  # a full disk, no descriptor left: the event still reaches its readers
            log.warning("job %s: event %r kept in memory only, its log could not be written: %s", self.id, type_, e)
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
                job._written = len(job.events)
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
        job_id = "job-" + uuid.uuid4().hex[:20]
        meta = {"job_id": job_id, "model": self.model, "idempotency_key": idempotency_key, "request_sha256": body_hash,
                "created_at": time.time()}
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            (self.folder / f"{job_id}.json").write_text(json.dumps(meta))
        except OSError as e:
            with contextlib.suppress(OSError):  # a half-written one would be read back as a job
                (self.folder / f"{job_id}.json").unlink(missing_ok=True)
            code = os_cause(e)
            raise ApiError(503, code, f"the server cannot take a training job now: {CAUSES[code]} ({e.strerror or e}); "
                           "retry once it has room") from e
        job = Job(job_id, self.model, self.folder, meta)
        self.jobs[job_id] = job
        if idempotency_key:
            self.by_key[idempotency_key] = job_id
        self._prune()
        return job

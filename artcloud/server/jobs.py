"""Training jobs and their event logs.

Every job's events are appended to `jobs/JOB_ID.events.jsonl` under the model's folder as they happen
and kept in memory; readers follow them with a cursor (`after=seq`), so a dropped connection
reconnects and loses nothing. A job whose server died under it is marked `interrupted` when the model
is next loaded; its step was never committed, and a retried POST with the same idempotency key trains
again instead of returning the dead job.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import time
import uuid
from pathlib import Path
from typing import Any, AsyncIterator

from artcloud.protocol import Event

log = logging.getLogger("artcloud.server")

FINAL = ("end", "error")


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
            raise RuntimeError(f"job {self.id} already ended")
        event = Event(seq=len(self.events) + 1, type=type_, job_id=self.id, time=time.time(), data=data)
        with open(self._path, "a") as f:  # on disk before any reader can see it
            f.write(event.model_dump_json() + "\n")
            f.flush()
            os.fsync(f.fileno())
        self.events.append(event)
        self._changed.set()
        self._changed = asyncio.Event()
        return event

    async def follow(self, after: int, *, follow: bool, heartbeat_s: float = 15.0) -> AsyncIterator[Event | None]:
        """Events with seq > after; with `follow`, waits for more until the job ends. Yields None as a
        keep-alive when nothing happened for `heartbeat_s` (the route turns it into a blank line)."""
        cursor = after
        while True:
            while cursor < len(self.events):
                cursor += 1
                yield self.events[cursor - 1]
            if self.done or not follow:
                return
            changed = self._changed
            try:
                await asyncio.wait_for(changed.wait(), heartbeat_s)
            except asyncio.TimeoutError:
                yield None

    def summary(self) -> dict[str, Any]:
        last = self.events[-1] if self.events else None
        return {
            "job_id": self.id,
            "model": self.model,
            "status": self.status,
            "events": len(self.events),
            "last_event": last.model_dump() if last else None,
            "created_at": self.meta.get("created_at"),
        }


def request_hash(body: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


class JobStore:
    """The jobs of one model: created, looked up by id or idempotency key, reloaded from disk."""

    def __init__(self, model: str, folder: Path):
        self.model = model
        self.folder = folder
        self.jobs: dict[str, Job] = {}
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
                job.emit(
                    "error",
                    code="interrupted",
                    message="the server stopped while this job ran; its step was not committed. "
                    "Post the training request again to retry.",
                )
            self.jobs[job.id] = job
            if meta.get("idempotency_key"):
                self.by_key[meta["idempotency_key"]] = job.id

    def find_by_key(self, key: str) -> Job | None:
        job_id = self.by_key.get(key)
        return self.jobs.get(job_id) if job_id else None

    def create(self, *, idempotency_key: str | None, body_hash: str) -> Job:
        self.folder.mkdir(parents=True, exist_ok=True)
        job_id = "job-" + uuid.uuid4().hex[:20]
        meta = {
            "job_id": job_id,
            "model": self.model,
            "idempotency_key": idempotency_key,
            "request_sha256": body_hash,
            "created_at": time.time(),
        }
        (self.folder / f"{job_id}.json").write_text(json.dumps(meta))
        job = Job(job_id, self.model, self.folder, meta)
        self.jobs[job_id] = job
        if idempotency_key:
            self.by_key[idempotency_key] = job_id
        return job

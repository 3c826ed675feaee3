"""Background pushes of committed checkpoints to S3: training never waits for them.

One pusher per model. Pushes run one at a time on their own thread (never the engine's); a push
requested while one runs waits, and only the newest waiting step is pushed (every step's files are
content-addressed by sha256, so skipping an intermediate step loses nothing a resume needs). The status
(last pushed step, bytes, last error) is shown in /health, the model's info and its training events.
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

from artcloud.storage.s3 import CheckpointStore

log = logging.getLogger("artcloud.server")


class Pusher:
    def __init__(self, store: CheckpointStore, project: str, model: str, owner: str,
                 retention: Callable[[list[int]], list[int]] | None = None):
        self.store = store
        self.owner = owner
        self.retention = retention  # committed steps on S3 -> the ones to delete
        self.project = project
        self.model = model
        self._executor = ThreadPoolExecutor(1, thread_name_prefix=f"s3-push-{model}")
        self._wanted: Path | None = None
        self._task: asyncio.Task | None = None
        self.pushed_step: int | None = None
        self.pushed_bytes = 0
        self.errors = 0
        self.last_error: str | None = None
        self.last_push_at: float | None = None

    def schedule(self, folder: Path) -> None:
        self._wanted = folder
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run(), name=f"s3-push-{self.model}")

    async def _run(self) -> None:
        while self._wanted is not None:
            folder, self._wanted = self._wanted, None
            try:
                result = await asyncio.get_running_loop().run_in_executor(self._executor, self._push, folder)
            except Exception as e:  # retried inside push; what reaches here is reported, and the next push retries
                self.errors += 1
                self.last_error = f"{type(e).__name__}: {e}"
                log.warning("pushing %s to %s failed: %s", folder, self.store.config.uri, self.last_error)
                if self._wanted is None:
                    self._wanted = folder  # try again with the next step (or at flush)
                return
            self.pushed_step = result.step
            self.pushed_bytes += result.uploaded_bytes
            self.last_push_at = time.time()
            self.last_error = None
            log.info("pushed %s step %d to %s: %d bytes in %.1f s", self.model, result.step, self.store.config.uri,
                     result.uploaded_bytes, result.seconds)

    def _push(self, folder: Path):
        # Renew our claim first: if another server took the model over, we must not write over it.
        self.store.claim(self.project, self.model, self.owner)
        result = self.store.push(self.project, self.model, folder)
        if self.retention is not None:
            for step in self.retention(self.store.committed_steps(self.project, self.model)):
                self.store.delete_step(self.project, self.model, step)
        return result

    async def claim(self) -> None:
        await asyncio.get_running_loop().run_in_executor(self._executor, self.store.claim, self.project, self.model, self.owner)

    async def release(self) -> None:
        await asyncio.get_running_loop().run_in_executor(self._executor, self.store.release, self.project, self.model, self.owner)

    async def flush(self, timeout: float = 600.0) -> None:
        """Wait for pending pushes (a final push before the server exits)."""
        if self._task is not None and not self._task.done():
            await asyncio.wait_for(asyncio.shield(self._task), timeout)
        if self._wanted is not None:  # a push that failed: one more try
            self._task = asyncio.get_running_loop().create_task(self._run())
            await asyncio.wait_for(self._task, timeout)

    def status(self) -> dict[str, Any]:
        return {
            "uri": self.store.config.uri,
            "pushed_step": self.pushed_step,
            "pushed_bytes": self.pushed_bytes,
            "pending": self._task is not None and not self._task.done(),
            "errors": self.errors,
            "last_error": self.last_error,
        }

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

"""Background pushes of committed checkpoints to S3: training never waits for them.

One pusher per model. Pushes run one at a time on their own thread (never the engine's); a push
requested while one runs waits, and only the newest waiting step is pushed (every step's files are
content-addressed by sha256, so skipping an intermediate step loses nothing a resume needs). A failed
push is retried with backoff, and a newer step asked for meanwhile goes first (it carries everything).
The model's live files, its history (history.py) and its state (model_state.py), are pushed the same way, after
any waiting step: only each one's newest text, so a fresh machine also gets what was logged or written since the
last commit.

The pusher is also the one writer of the model's S3 location: it holds the single-writer claim
(renewed every third of `claim_timeout_s`, so a slow step never lets a second server take the model
over), applies retention on S3 after each push, and sweeps the objects of uploads that died half-way.
`on_pushed(step)` tells the trainer which local checkpoints are safe on S3 (and so may be deleted
locally under retention). The status (last pushed step, bytes, last error, claim) is shown in the
model's info and its training events.
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any, Callable

from artcloud.errors import TimedOut
from artcloud.server import history
from artcloud.server.api_errors import ApiError
from artcloud.storage.s3 import CheckpointStore, ClaimLost, StorageError
from artcloud.wire import FINAL_PUSH_DEADLINE_S

log = logging.getLogger("artcloud.server")

CLAIM_TIMEOUT_S = 900.0  # a claim not renewed for this long may be taken over by another server
RETRY_MAX_S = 60.0


class Pusher:
    def __init__(self, store: CheckpointStore, project: str, model: str, owner: str, *,
                 retention: Callable[[list[int]], list[int]] | None = None,
                 on_pushed: Callable[[int], None] | None = None,
                 claim_timeout_s: float = CLAIM_TIMEOUT_S):
        self.store = store
        self.project = project
        self.model = model
        self.owner = owner
        self.retention = retention  # committed steps on S3 -> the ones to delete
        self.on_pushed = on_pushed
        self.claim_timeout_s = claim_timeout_s
        self._executor = ThreadPoolExecutor(1, thread_name_prefix=f"s3-push-{model}")
        self._wanted: Path | None = None
        self._live: dict[str, str] = {}  # each live file's newest text not yet on S3 (history.jsonl, state.json)
        self._task: asyncio.Task | None = None
        self._renewer: asyncio.Task | None = None
        self._kick = asyncio.Event()  # cuts a retry's backoff short (a flush is waiting)
        self.pushed_step: int | None = None
        self.pushed_bytes = 0
        self.errors = 0
        self.last_error: str | None = None
        self.lost: str | None = None  # why this server no longer owns the model on S3

    async def _in_thread(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    # ------------------------------------------------------------------------------------- claim

    async def claim(self, take_over: bool = False) -> None:
        """Become the one writer of this model on S3 (ApiError 409 model_locked if another live server is,
        unless `take_over`), and keep renewing the claim while the server lives."""
        try:
            await self._in_thread(self.store.claim, self.project, self.model, self.owner,
                                  0.0 if take_over else self.claim_timeout_s)
        except StorageError as e:
            raise ApiError(409, "model_locked", str(e), "name") from e
        if self._renewer is None:
            self._renewer = asyncio.get_running_loop().create_task(self._renew_forever(), name=f"s3-claim-{self.model}")

    async def _renew_forever(self) -> None:
        every = self.claim_timeout_s / 3
        while self.lost is None:
            await asyncio.sleep(every)
            try:
                await self._in_thread(self.store.renew, self.project, self.model, self.owner)
            except ClaimLost as e:
                self._lose(str(e))
            except Exception as e:  # S3 unreachable for a moment: the next renewal (or push) tries again
                log.warning("renewing the S3 claim on %s failed: %s", self.model, e)

    def _lose(self, why: str) -> None:
        self.lost = why
        self._wanted = None
        self._live.clear()
        log.error("%s: this server no longer owns the model on S3, so it stops pushing: %s", self.model, why)

    async def release(self) -> None:
        """Give the claim up (unless lost) and stop: a failure to release is logged, as the claim then
        times out by itself."""
        if self._renewer is not None:
            self._renewer.cancel()
        if self.lost is None:
            try:
                await self._in_thread(self.store.release, self.project, self.model, self.owner)
            except Exception as e:
                log.warning("could not release the S3 claim on %s: %s", self.model, e)
        self.close()

    # ------------------------------------------------------------------------------------- pushes

    def schedule(self, folder: Path) -> None:
        if self.lost is not None:
            return
        self._wanted = folder
        self._start()

    def schedule_live(self, name: str, text: str) -> None:
        """Push this text of live file `name` (replacing any not yet pushed) after any waiting step."""
        if self.lost is not None:
            return
        self._live[name] = text
        self._start()

    def _start(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run(), name=f"s3-push-{self.model}")

    async def _run(self) -> None:
        delay = 1.0
        while (self._wanted is not None or self._live) and self.lost is None:
            folder, live = self._wanted, None
            if folder is not None:
                self._wanted = None
                work: Callable[[], Any] = partial(self._push, folder)
            else:
                live = next(iter(self._live))
                text = self._live.pop(live)
                work = partial(self._push_live, live, text)
            try:
                done = await self._in_thread(work)
            except ClaimLost as e:
                self.errors += 1
                self.last_error = f"{type(e).__name__}: {e}"
                self._lose(str(e))
                return
            except Exception as e:  # retried inside push; what reaches here is reported and retried here
                self.errors += 1
                self.last_error = f"{type(e).__name__}: {e}"
                log.warning("pushing %s to %s failed: %s", folder or live, self.store.config.uri, self.last_error)
                if live is not None:
                    self._live.setdefault(live, text)  # unless a newer text came meanwhile
                elif self._wanted is not None:
                    continue  # a newer step arrived meanwhile: push that instead, it carries everything
                elif not folder.exists():
                    continue  # nothing left to push of it (set aside by hand); the next commit pushes
                else:
                    self._wanted = folder
                try:
                    await asyncio.wait_for(self._kick.wait(), delay)
                except asyncio.TimeoutError:
                    pass
                self._kick.clear()
                delay = min(delay * 2, RETRY_MAX_S)
                continue
            delay = 1.0
            self.last_error = None
            if folder is None:
                continue
            step, uploaded, seconds = done
            self.pushed_step = step
            self.pushed_bytes += uploaded
            log.info("pushed %s step %d to %s: %d bytes in %.1f s", self.model, step, self.store.config.uri, uploaded, seconds)
            if self.on_pushed is not None:
                self.on_pushed(step)

    def _push(self, folder: Path) -> tuple[int, int, float]:
        # Renew our claim first: if another server took the model over, we must not write over it.
        self.store.renew(self.project, self.model, self.owner)
        result = self.store.push(self.project, self.model, folder)
        if self.retention is not None:
            for step in self.retention(self.store.committed_steps(self.project, self.model)):
                self.store.delete_step(self.project, self.model, step)
        # Objects of an upload that died half-way (a crash, an earlier server) are never committed:
        # nothing else would ever delete them. We are the one writer, and no push runs beside this one.
        self.store.sweep_uncommitted(self.project, self.model)
        return result.step, result.uploaded_bytes, result.seconds

    def _push_live(self, name: str, text: str) -> None:
        self.store.renew(self.project, self.model, self.owner)  # as _push: never write over a new owner
        self.store.put_live(self.project, self.model, name, text)

    async def read_live(self, name: str, limit: int) -> str | None:
        """S3's live copy of file `name` of this model (untrusted text), or None if it has none or it cannot be read
        (a live file is worth a warning, not a failed resume: the checkpoint has its own copy)."""
        try:
            return await self._in_thread(self.store.get_live, self.project, self.model, name, limit)
        except Exception as e:
            log.warning("%s: its %s on %s could not be read, so the checkpoint's is used: %s",
                        self.model, name, self.store.config.uri, e)
            return None

    async def read_history(self) -> list[dict[str, Any]] | None:
        """The well-formed records of S3's live history.jsonl of this model, or None."""
        text = await self.read_live(history.HISTORY_FILE, history.MAX_HISTORY_BYTES)
        if text is None:
            return None
        return await asyncio.to_thread(history.parse_jsonl, text, f"{self.store.config.uri} history")

    @property
    def pending(self) -> bool:
        return (self._wanted is not None or bool(self._live)
                or (self._task is not None and not self._task.done()))

    async def flush(self, timeout: float = FINAL_PUSH_DEADLINE_S, attempts: int = 3) -> None:
        """Wait until the newest committed step is on S3 (the final push before the server exits).
        Gives up after `attempts` more failed tries, or `timeout` seconds, raising the last error."""
        if self.lost is not None:
            raise ClaimLost(self.lost)
        deadline = time.monotonic() + timeout
        errors_before = self.errors
        while self.pending:
            if self._task is None or self._task.done():
                self._task = asyncio.get_running_loop().create_task(self._run(), name=f"s3-push-{self.model}")
            self._kick.set()  # no backoff while someone waits
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimedOut(f"the push of {self.model} did not finish in {timeout:.0f} s (last error: {self.last_error})")
            try:
                await asyncio.wait_for(asyncio.shield(self._task), min(left, 1.0))
            except asyncio.TimeoutError:
                pass
            if self.lost is not None:
                raise ClaimLost(self.lost)
            if self.errors - errors_before >= attempts:
                raise StorageError(f"the push of {self.model} failed {attempts} times: {self.last_error}", code="push_failed")

    async def final_push(self) -> str | None:
        """`flush`, for shutdown: None when done, else why not (and it is logged)."""
        try:
            await self.flush()
        except Exception as e:
            log.error("final push of %s to %s failed: %s", self.model, self.store.config.uri, e)
            return f"{type(e).__name__}: {e}"
        return None

    def status(self) -> dict[str, Any]:
        return {"uri": self.store.config.uri, "pushed_step": self.pushed_step, "pushed_bytes": self.pushed_bytes,
                "pending": self.pending, "errors": self.errors, "last_error": self.last_error, "claim_lost": self.lost}

    def close(self) -> None:
        for task in (self._task, self._renewer):
            if task is not None:
                task.cancel()
        self._executor.shutdown(wait=False, cancel_futures=True)

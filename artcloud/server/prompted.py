"""Prompted models: ART's `art.Model` (an OpenAI-compatible endpoint elsewhere, a baseline to compare
against), registered here for its history alone.

Nothing is loaded or served for it: it has no adapter, no checkpoints and no steps of its own. What it has
is what ART's backend keeps for it: `model.log`'s records, in the same history as a trained model's
(history.py: GET /artcloud/models/{name}, history.jsonl and reward.svg in its folder, and with S3
PREFIX/PROJECT/NAME/history.jsonl, pushed after every record under the model's single-writer claim).
A record may name any step: a baseline is logged at the steps of the model it is compared with.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

from artcloud.server import history
from artcloud.server.model_state import StateKeeper
from artcloud.server.pusher import Pusher
from artcloud.wire import LogRequest, RegisterRequest

log = logging.getLogger("artcloud.server")


class PromptedModel:
    def __init__(self, spec: RegisterRequest, folder: Path, pusher: Pusher | None = None):
        self.spec = spec
        self.name = spec.name
        self.folder = folder
        self.pusher = pusher
        self.history: list[dict[str, Any]] = []
        self._lock = asyncio.Lock()  # one writer of the folder's history files at a time
        self.state = StateKeeper(folder, pusher)  # ART's state.json; a prompted model's is always at step 0

    async def resume(self, take_over: bool = False) -> bool:
        """Take the S3 claim (with S3), then the history this folder or S3 kept: S3's where it continues this
        folder's (a fresh machine has none here). True if there was one."""
        remote = None
        if self.pusher is not None:
            await self.pusher.claim(take_over=take_over)
            remote = await self.pusher.read_history()
        local = await asyncio.to_thread(history.read_jsonl, self.folder / history.HISTORY_FILE)
        records = local or []
        if remote is not None and remote[:len(records)] == records:
            records = remote
        self.history = records
        await self.state.resume(0, None)
        return local is not None or remote is not None

    async def write_state(self, state: dict[str, Any], merge: bool) -> dict[str, Any]:
        return await self.state.write(state, merge_into=merge, step=0)

    async def log(self, req: LogRequest) -> dict[str, Any]:
        history.check_log(req, self.history, self.name)
        record = history.log_record(req, 0 if req.step is None else req.step)  # ART logs a prompted model at step 0
        self.history.append(record)
        async with self._lock:
            try:
                await asyncio.to_thread(history.write_live, self.folder, list(self.history))
            except OSError as e:  # a full disk: the record stays in memory (and goes to S3)
                log.warning("could not write the history files of %s: %s", self.name, e)
        if self.pusher is not None:
            self.pusher.schedule_live(history.HISTORY_FILE, history.to_jsonl(self.history))
        return record

    def info(self) -> dict[str, Any]:
        return {"name": self.name, "project": self.spec.project, "base_model": None, "prompted": True, "step": 0,
                "s3": self.pusher.status() if self.pusher is not None else None, "history": self.history}

    async def final_push(self) -> str | None:
        """Push what S3 does not have yet (shutdown's final push); None when done, else why not (it is logged)."""
        return await self.pusher.final_push() if self.pusher is not None else None

    async def close(self) -> None:
        """The final push, then the claim goes, as a trained model's does: a push that failed is in the shutdown's
        answer ("NOT pushed"), and a claim kept after it only locked the model out of the next server for nothing
        (code review 3, R7)."""
        if self.pusher is None:
            return
        await self.final_push()
        await self.pusher.release()

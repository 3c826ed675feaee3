"""A model's persistent state: OpenPipe ART's `state.json` (`model.read_state()`, `merge_state`, `overwrite_state`),
which scripts use to resume a dataset position.

One JSON object per model, kept with the step it belongs to, so that it always matches the weights it comes back
with. The file, `{"step": S, "state": {...}}`, lies in three places:

    MODEL/state.json                 live: every write, at once (atomic), tagged with the model's step then
    MODEL/checkpoints/S/state.json   with each commit (in its manifest): the state as that step was committed
    PREFIX/PROJECT/NAME/state.json   S3's live copy, pushed after each write (untrusted when read back)

A write waits for a commit under way (the trainer's commit lock), so it is either in the step's checkpoint or
tagged with that step. A model that resumes at step S takes the live copy (this disk's, else S3's) when it is
tagged S, else the checkpoint's: a write made after a step that was lost with its machine never outlives it.
"""

from __future__ import annotations

import asyncio
import json
import logging
from contextlib import AbstractAsyncContextManager, nullcontext
from pathlib import Path
from typing import Any

from artcloud.server.api_errors import ApiError
from artcloud.storage import checkpoints

log = logging.getLogger("artcloud.server")

STATE_FILE = "state.json"
MAX_STATE_BYTES = 1 << 20  # a model's state as JSON; more is a 400 on write and ignored (with a warning) on read


def merge(base: dict[str, Any], update: dict[str, Any]) -> dict[str, Any]:
    """`update` deep-merged into `base` (nested objects key by key, anything else replaced), as ART's merge_state."""
    out = dict(base)
    for key, value in update.items():
        out[key] = merge(out[key], value) if isinstance(out.get(key), dict) and isinstance(value, dict) else value
    return out


def dump(step: int, state: dict[str, Any] | None) -> str:
    return json.dumps({"step": step, "state": state}, sort_keys=True, allow_nan=False)


def parse(text: str | None, where: str) -> tuple[int, dict[str, Any] | None] | None:
    """(step, state) from a state.json's text; None (with a warning) for one that is not such a file."""
    if text is None:
        return None
    problem = f"larger than {MAX_STATE_BYTES} bytes" if len(text) > MAX_STATE_BYTES + 100 else None
    if problem is None:
        try:
            data = json.loads(text)
        except ValueError as e:
            data, problem = None, f"not JSON ({e})"
    if problem is None:
        step, state = (data.get("step"), data.get("state")) if isinstance(data, dict) else (None, None)
        if type(step) is not int or step < 0 or not (state is None or isinstance(state, dict)):
            problem = "not {\"step\": N, \"state\": {...}}"
    if problem is not None:
        log.warning("ignoring the model state at %s: %s", where, problem)
        return None
    return step, state


def read(path: Path) -> tuple[int, dict[str, Any] | None] | None:
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except FileNotFoundError:
        return None
    except OSError as e:
        log.warning("could not read the model state at %s: %s", path, e)
        return None
    return parse(text, str(path))


class StateKeeper:
    """One model's state: `value` at `step`. `pusher`: its S3 live copy (None without S3); `commit_lock`: the
    trainer's (None for a prompted model, which has no commits)."""

    def __init__(self, folder: Path, pusher: Any = None, commit_lock: asyncio.Lock | None = None):
        self.folder = folder
        self.pusher = pusher
        self.commit_lock = commit_lock
        self.value: dict[str, Any] | None = None
        self.step = 0
        self._write_lock = asyncio.Lock()

    async def resume(self, step: int, checkpoint: Path | None) -> None:
        """The state for a model now at `step`, restored from `checkpoint` (its folder) or a live copy."""
        local = await asyncio.to_thread(read, self.folder / STATE_FILE)
        remote = None
        if self.pusher is not None:
            remote = parse(await self.pusher.read_live(STATE_FILE, MAX_STATE_BYTES + 100), f"S3's {STATE_FILE}")
        live = local if local is not None and (remote is None or local[0] >= remote[0]) else remote
        if live is not None and live[0] == step:
            self.value = live[1]
        elif checkpoint is not None:
            saved = await asyncio.to_thread(read, checkpoint / STATE_FILE)
            self.value = saved[1] if saved is not None else None
        else:
            self.value = None
        self.step = step

    async def write(self, state: dict[str, Any], *, merge_into: bool, step: int | Any) -> dict[str, Any]:
        """Overwrite (or deep-merge into) the state; it is on this disk when this returns, and on its way to S3.
        `step`: the model's step, or a callable giving it once any commit under way has ended."""
        lock: AbstractAsyncContextManager[Any] = self.commit_lock if self.commit_lock is not None else nullcontext()
        async with self._write_lock, lock:  # a commit under way ends first: then the step is the new one
            value = merge(self.value or {}, state) if merge_into else state
            at = step() if callable(step) else step
            try:
                text = dump(at, value)
            except ValueError:  # the request's JSON parser takes NaN and Infinity; JSON itself has neither
                raise ApiError(400, "invalid_request", "state: NaN and Infinity are not JSON: store them as strings "
                               "or null", "state") from None
            if len(text) > MAX_STATE_BYTES:
                raise ApiError(400, "state_too_large", f"state: {len(text)} bytes as JSON; a model's state holds at "
                               f"most {MAX_STATE_BYTES}: keep a position or a pointer there, not the data", "state")
            await asyncio.to_thread(checkpoints.write_atomic, self.folder / STATE_FILE, text)
            self.value, self.step = value, at
            if self.pusher is not None:
                self.pusher.schedule_live(STATE_FILE, text)
            return self.answer()

    def checkpoint_text(self, step: int) -> str:
        """What a commit of `step` writes as its state.json."""
        return dump(step, self.value)

    def answer(self) -> dict[str, Any]:
        return {"step": self.step, "state": self.value}

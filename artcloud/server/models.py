"""What the server serves: engines (one per base model, on one thread each) and the adapters on them.

An engine runs on its own single worker thread, so generation, training and checkpoint writes for a
base model never overlap; the asyncio side only queues work and answers HTTP. A model's RWLock makes
inference wait while its adapter updates, then NAME@STEP+1 is what `NAME` means. How a model trains,
commits and keeps its checkpoints is training.py (its ModelTrainer holds the ServedModel; never the reverse).
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from artcloud.errors import ArtcloudError
from artcloud.server.api_errors import ApiError
from artcloud.server.batching import Batcher, RWLock
from artcloud.server.engines.engine import Engine
from artcloud.storage import checkpoints
from artcloud.wire import RegisterRequest

if TYPE_CHECKING:
    from artcloud.server.base_weights import BaseWeights

log = logging.getLogger("artcloud.server")

OLD_STEPS_KEPT = 4  # adapters of older steps kept loaded for NAME@STEP requests


class EngineHost:
    """One engine and the one thread that may touch it."""

    def __init__(self, base_model: str, factory: Callable[..., Engine], engine_args: dict[str, Any] | None = None,
                 weights: BaseWeights | None = None):
        self.base_model = base_model
        self.factory = factory
        self.engine_args = engine_args  # a register request's, applied when the engine loads
        self.weights = weights  # the server's S3 location for base weights (pull, stage), if it has one
        self.executor = ThreadPoolExecutor(1, thread_name_prefix="artcloud-engine")
        self.engine: Engine | None = None
        self.batcher: Batcher | None = None
        self._sampling_pool: ThreadPoolExecutor | None = None

    async def call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self.executor, partial(fn, *args, **kwargs))

    async def generate(self, slot: str | None, requests: list[Any]) -> Any:
        """On the engine thread; or, for a sampler that batches by itself (vLLM), on a thread of its own so
        that batches overlap and vLLM's continuous batching sees every request as it comes."""
        assert self.engine is not None
        if not self.engine.concurrent:
            return await self.call(self.engine.generate, slot, requests)
        if self._sampling_pool is None:
            self._sampling_pool = ThreadPoolExecutor(32, thread_name_prefix="artcloud-sampling")
        return await asyncio.get_running_loop().run_in_executor(self._sampling_pool, self.engine.generate, slot, requests)

    async def load(self) -> None:
        """Load the engine (its weights pulled from S3 first when staged there); a base model that
        cannot be loaded is the request's fault (400 naming `base_model`), and the thread made for it
        goes away with it. Weights loaded from the hub are then staged to S3 in the background."""
        from artcloud.server.engines.choose import EngineArgsError
        from artcloud.server.engines.loading import ModelNotFound
        from artcloud.storage.weights import CorruptWeights

        try:
            loaded_from = await self.call(self.weights.fetch, self.base_model) if self.weights else self.base_model
            args = (self.base_model, self.engine_args) if self.engine_args else (self.base_model,)
            self.engine = await self.call(self.factory, *args)
        except BaseException as e:
            self.close()
            if isinstance(e, EngineArgsError):
                raise ApiError(400, "invalid_engine_args", str(e), e.field or "engine_args") from e
            if isinstance(e, (ModelNotFound, CorruptWeights)):
                code = "corrupt_weights" if isinstance(e, CorruptWeights) else "base_model_not_found"
                raise ApiError(400, code, str(e), "base_model") from e
            if isinstance(e, ArtcloudError) and e.code in ("trainer_failed", "trainer_intruder"):  # the sharded
                # trainer's ranks did not start (a trainer node lost, security review 3 N10; or a rank without the
                # group's key, N2): not a bug, and worth a retry
                raise ApiError(503, e.code, f"{e}: retry the register", "base_model") from e
            if isinstance(e, (OSError, ValueError)):  # e.g. a name too long for the filesystem, a broken config.json
                # Its traceback in the server's log: an OSError that is not the name's fault (a file of the engine's
                # own gone) is otherwise told from one that is only by its message.
                log.warning("loading base model %r failed", self.base_model, exc_info=True)
                raise ApiError(400, "base_model_not_found",
                               f"cannot load base model {self.base_model!r} ({type(e).__name__}: {e})", "base_model") from e
            raise
        if self.weights is not None:
            self.weights.stage_later(self.base_model, loaded_from)

    async def stop(self) -> None:
        """Answer every request still waiting for this engine (503), then `close`."""
        if self.batcher is not None:
            await self.batcher.stop()
        self.close()

    def close(self) -> None:
        # Do not wait for a running generation or training step: whatever it was doing is not committed
        # (checkpoints are renamed into place only when complete), and a server asked to stop must stop.
        self.executor.shutdown(wait=False, cancel_futures=True)
        if self._sampling_pool is not None:
            self._sampling_pool.shutdown(wait=False, cancel_futures=True)
        if self.engine is not None:
            self.engine.close()  # a sampler's own process (vLLM) goes with it

    def health(self) -> str | None:
        """Why this host cannot serve now (its sampler's process died and restarts), or None."""
        if self.engine is None:
            return None
        state = self.engine.sampler.status()
        return None if state.get("state") == "ready" else state.get("detail") or f"sampler {state.get('state')}"


class ServedModel:
    """A registered model: a LoRA adapter on a host's engine, at a step, servable as NAME@STEP.
    A ModelTrainer (training.py) moves it from step to step."""

    def __init__(self, spec: RegisterRequest, folder: Path, host: EngineHost, slot: str):
        self.spec = spec
        self.name = spec.name
        self.folder = folder
        self.host = host
        self.slot = slot
        self.step = 0
        self.temperature = 1.0
        self.history: list[dict[str, Any]] = []
        self.lock = RWLock()
        self._old: OrderedDict[int, str] = OrderedDict()
        # Why the adapter may hold an update its failed step could not undo (training.py reloads it): not served.
        self.unservable: str | None = None

    @property
    def engine(self) -> Engine:
        assert self.host.engine is not None
        return self.host.engine

    @property
    def served_as(self) -> str:
        return f"{self.name}@{self.step}"

    async def slot_for(self, step: int | None) -> tuple[str, int]:
        """The engine slot serving `step` (None: the latest). Older steps load from their checkpoint."""
        if step is None or step == self.step:
            if self.unservable:
                raise ApiError(503, "model_unavailable", f"{self.name} is not served until it is reloaded from step "
                               f"{self.step} ({self.unservable}); the server retries that every few seconds", "model")
            return self.slot, self.step
        if step > self.step:
            raise ApiError(404, "step_not_found", f"{self.name} is at step {self.step}; {self.name}@{step} does not exist yet", "model")
        if step in self._old:
            self._old.move_to_end(step)
            return self._old[step], step
        folder = checkpoints.step_folder(self.folder, step)
        if folder is None:
            raise ApiError(404, "step_not_found", f"no checkpoint of {self.name} at step {step}", "model")
        slot = f"{self.slot}s{step}"
        await self.host.call(self.engine.load_adapter, slot, self.spec.lora, folder, optimizer=False)
        self._old[step] = slot
        while len(self._old) > OLD_STEPS_KEPT:
            _, evicted = self._old.popitem(last=False)
            await self.host.call(self.engine.delete_adapter, evicted)
        return slot, step

    async def forget(self, step: int) -> None:
        """Unload the adapter of a step whose checkpoint was deleted."""
        slot = self._old.pop(step, None)
        if slot is not None:
            await self.host.call(self.engine.delete_adapter, slot)

    def info(self) -> dict[str, Any]:
        return {"name": self.name, "project": self.spec.project, "base_model": self.spec.base_model,
                "lora": self.spec.lora.model_dump(), "step": self.step, "served_as": self.served_as,
                "temperature": self.temperature, "training": self.lock.writing,
                "checkpoints": checkpoints.committed_steps(self.folder), "history": self.history}

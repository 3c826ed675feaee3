"""What a running server holds: engines (one per base model), the models registered on them, their jobs.

Each engine runs on its own single worker thread, so generation, training and checkpoint writes for a
base model never overlap; the asyncio side only queues work and answers HTTP. A model's RWLock makes
inference wait while its adapter updates, then NAME@STEP+1 is what `NAME` means.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Callable

from artcloud.protocol import RegisterRequest
from artcloud.server.batching import Batcher, RWLock
from artcloud.server.engines.base import Completion, Engine, GenerationRequest, TrainSample
from artcloud.server.errors import ApiError
from artcloud.server.jobs import Job, JobStore
from artcloud.server.pusher import Pusher
from artcloud.storage import checkpoints
from artcloud.storage.s3 import CheckpointStore, StorageError
from artcloud.types import TrainConfig

log = logging.getLogger("artcloud.server")

OLD_STEPS_KEPT = 4  # adapters of older steps kept loaded for NAME@STEP requests


def default_engine_factory(kind: str) -> Callable[[str], Engine]:
    """`cpu`: the torch engine on the CPU, float32. `auto`: the same engine on the GPU in bfloat16 when
    torch sees one, else `cpu` (a launcher can always pass `auto`; a laptop without CUDA still works)."""
    if kind not in ("auto", "cpu"):
        raise ValueError(f"unknown engine {kind!r}: this build has 'auto' and 'cpu'")
    from artcloud.server.engines.cpu import CPUEngine

    if kind == "auto":
        import torch

        if torch.cuda.is_available():
            log.info("engine auto: %s, bfloat16", torch.cuda.get_device_name(0))
            return partial(CPUEngine, dtype="bfloat16", device="cuda")
        log.info("engine auto: no CUDA device, so the CPU engine (float32)")
    return CPUEngine


class Abandoned(Exception):
    """A training step finished after shutdown froze its model: it is dropped, not committed."""

    def __init__(self, step: int):
        super().__init__(f"step {step} abandoned at shutdown")
        self.step = step


class EngineHost:
    """One engine and the one thread that may touch it."""

    def __init__(self, base_model: str, factory: Callable[[str], Engine]):
        self.base_model = base_model
        self.factory = factory
        self.executor = ThreadPoolExecutor(1, thread_name_prefix="artcloud-engine")
        self.engine: Engine | None = None
        self.batcher: Batcher | None = None

    async def call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self.executor, partial(fn, *args, **kwargs))

    async def load(self) -> None:
        self.engine = await self.call(self.factory, self.base_model)

    def close(self) -> None:
        # Do not wait for a running generation or training step: whatever it was doing is not committed
        # (checkpoints are renamed into place only when complete), and a server asked to stop must stop.
        self.executor.shutdown(wait=False, cancel_futures=True)


class ServedModel:
    """A registered trainable model: a LoRA adapter on a host's engine, its step, its jobs."""

    def __init__(self, spec: RegisterRequest, folder: Path, host: EngineHost, slot: str,
                 store: CheckpointStore | None = None, owner: str = "", retention: Retention | None = None):
        self.spec = spec
        self.store = store
        self.retention = retention or Retention()
        self.pusher = (Pusher(store, spec.project, spec.name, owner, retention=self._to_delete)
                       if store is not None else None)
        self.name = spec.name
        self.folder = folder
        self.host = host
        self.slot = slot
        self.step = 0
        self.temperature = 1.0
        self.history: list[dict[str, Any]] = []
        self.lock = RWLock()
        self.jobs = JobStore(spec.name, folder / "jobs")
        self.submit_lock = asyncio.Lock()
        self._queue: asyncio.Queue[tuple[Job, list[TrainSample], dict[str, Any], TrainConfig]] = asyncio.Queue()
        self._worker: asyncio.Task | None = None
        self._old: OrderedDict[int, str] = OrderedDict()
        # Shutdown freezes the model: from then on no step commits, so what it answers is what S3 holds.
        self.commit_lock = asyncio.Lock()
        self.frozen = False

    @property
    def engine(self) -> Engine:
        assert self.host.engine is not None
        return self.host.engine

    @property
    def served_as(self) -> str:
        return f"{self.name}@{self.step}"

    # ------------------------------------------------------------------------------------- loading

    async def load(self) -> bool:
        """Resume from the newest complete checkpoint, or start step 0. Returns True if it resumed."""
        checkpoints.clean_partial(self.folder)
        if self.pusher is not None:
            try:
                await self.pusher.claim()  # one writer per model and S3 location
            except StorageError as e:
                raise ApiError(409, "model_locked", str(e), "name") from e
            await self._pull_if_newer()
        found = await self.host.call(checkpoints.latest_valid, self.folder)
        checkpoints.set_aside_after(self.folder, found[0] if found else -1)
        if found is None:
            await self.host.call(self.engine.create_adapter, self.slot, self.spec.lora)
            await self._commit(0)
            resumed = False
        else:
            step, folder = found
            await self.host.call(self.engine.load_adapter, self.slot, self.spec.lora, folder, optimizer=True)
            state = checkpoints.read_trainer_state(folder)
            self.step = step
            self.history = state.get("history", [])
            self.temperature = state.get("temperature", 1.0)
            if "rng" in state:
                self.engine.set_rng_state(state["rng"])
            resumed = True
        self.jobs.load()
        self._worker = asyncio.get_running_loop().create_task(self._train_loop(), name=f"train-{self.name}")
        return resumed

    async def _pull_if_newer(self) -> None:
        """A fresh machine (or one behind) first fetches the newest checkpoint committed on S3."""
        loop = asyncio.get_running_loop()
        remote = await loop.run_in_executor(None, self.store.latest, self.spec.project, self.name)
        local = checkpoints.committed_steps(self.folder)
        if remote is not None and (not local or remote > local[-1]):
            log.info("pulling %s step %d from %s", self.name, remote, self.store.config.uri)
            await loop.run_in_executor(None, self.store.pull, self.spec.project, self.name, remote,
                                       checkpoints.checkpoints_dir(self.folder))

    async def _commit(self, step: int) -> Path:
        state = {
            "history": self.history,
            "rng": self.engine.rng_state(),
            "base_model": self.spec.base_model,
            "lora": self.spec.lora.model_dump(),
            "temperature": self.temperature,
        }
        write = partial(self.engine.save_adapter, self.slot, optimizer=True)
        folder = await self.host.call(checkpoints.commit, self.folder, step, write, state)
        if self.pusher is not None:
            self.pusher.schedule(folder)  # in the background: training goes on
        return folder

    async def slot_for(self, step: int | None) -> tuple[str, int]:
        """The engine slot serving `step` (None: the latest). Older steps load from their checkpoint."""
        if step is None or step == self.step:
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

    # ------------------------------------------------------------------------------------- training

    def submit(self, job: Job, samples: list[TrainSample], stats: dict[str, Any], config: TrainConfig) -> None:
        job.emit("queued", position=self._queue.qsize())
        self._queue.put_nowait((job, samples, stats, config))

    async def _train_loop(self) -> None:
        while True:
            job, samples, stats, config = await self._queue.get()
            try:
                await self._run(job, samples, stats, config)
            except Abandoned as e:
                log.warning("%s: step %d computed during shutdown, not committed", self.name, e.step)
                job.emit("error", code="shutting_down", step=self.step,
                         message=f"the server is shutting down: step {e.step} was not committed, {self.name} stays "
                                 f"at step {self.step} (on S3 too); train it again on a new server")
            except Exception as e:
                log.exception("training job %s failed", job.id)
                if not job.done:
                    job.emit("error", code="internal_error", message=f"training failed: {e}", step=self.step)

    async def _run(self, job: Job, samples: list[TrainSample], stats: dict[str, Any], config: TrainConfig) -> None:
        job.emit("start", step=self.step, **stats)
        if not samples:
            job.emit(
                "end", step=self.step, served_as=self.served_as, trained=False, metrics=stats,
                message="every group had equal rewards, so there was nothing to learn: the adapter and step are unchanged",
            )
            return
        loop = asyncio.get_running_loop()
        next_step = self.step + 1

        def on_step(metrics: dict[str, Any]) -> None:  # called on the engine thread
            loop.call_soon_threadsafe(partial(job.emit, "step", step=next_step, **metrics))

        async with self.lock.write():  # inference waits from here until NAME@next_step is served
            t0 = time.time()
            try:
                steps = await self.host.call(self.engine.train_step, self.slot, samples, config, on_step)
                record = _history_record(next_step, job.id, stats, steps, time.time() - t0)
                async with self.commit_lock:
                    if self.frozen:
                        raise Abandoned(next_step)
                    self.history.append(record)
                    folder = await self._commit(next_step)
            except BaseException:
                # Put the adapter and optimizer back to the last committed step: a half-applied update
                # is never served and never trained on.
                if self.history and self.history[-1].get("step") == next_step:
                    self.history.pop()
                await self._reload_committed()
                raise
            self.step = next_step
        await self._apply_local_retention()
        job.emit("end", step=next_step, served_as=self.served_as, trained=True, metrics=record, checkpoint=str(folder),
                 s3=self.pusher.status() if self.pusher else None)

    def _to_delete(self, steps: list[int]) -> list[int]:
        metric = {r["step"]: r[self.retention.metric] for r in self.history if self.retention.metric in r}
        return checkpoints.plan_retention(steps, keep_last=self.retention.keep_last, metric=metric)

    async def _apply_local_retention(self) -> None:
        for step in self._to_delete(checkpoints.committed_steps(self.folder)):
            await self.host.call(checkpoints.delete, self.folder, step)
            slot = self._old.pop(step, None)
            if slot is not None:
                await self.host.call(self.engine.delete_adapter, slot)

    async def _reload_committed(self) -> None:
        folder = checkpoints.step_folder(self.folder, self.step)
        if folder is not None:
            await self.host.call(self.engine.load_adapter, self.slot, self.spec.lora, folder, optimizer=True)

    @property
    def busy(self) -> bool:
        """A training job is queued or running (a job reloaded from disk is always closed)."""
        return self.lock.writing or not self._queue.empty() or any(not j.done for j in self.jobs.jobs.values())

    def info(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "project": self.spec.project,
            "base_model": self.spec.base_model,
            "lora": self.spec.lora.model_dump(),
            "step": self.step,
            "served_as": self.served_as,
            "temperature": self.temperature,
            "training": self.lock.writing,
            "checkpoints": checkpoints.committed_steps(self.folder),
            "s3": self.pusher.status() if self.pusher else None,
            "history": self.history,
        }

    async def close(self) -> None:
        if self._worker is not None:
            self._worker.cancel()
        if self.pusher is not None:
            try:
                await self.pusher.flush()  # the final push before the server exits
            except Exception as e:
                log.error("final push of %s failed: %s", self.name, e)
            try:
                await self.pusher.release()
            except Exception as e:
                log.warning("could not release the S3 claim on %s: %s", self.name, e)
            self.pusher.close()


def _history_record(step: int, job_id: str, stats: dict[str, Any], steps: list[dict[str, Any]], seconds: float) -> dict[str, Any]:
    record = {k: v for k, v in stats.items() if k != "skipped_groups"}
    record.update(step=step, job_id=job_id, time=time.time(), seconds=seconds, gradient_steps=len(steps))
    for key in ("loss", "grad_norm", "clip_fraction", "mean_ratio", "kl"):
        values = [s[key] for s in steps if key in s]
        if values:
            record[key] = sum(values) / len(values)
    return record


@dataclass(frozen=True)
class Retention:
    """Keep the newest `keep_last` checkpoints and the best by `metric` (a history key); 0 keeps all.
    The latest committed checkpoint is never deleted."""

    keep_last: int = 0
    metric: str = "reward_mean"


@dataclass(frozen=True)
class Target:
    """Where a chat request goes: a host, the batching key, and the model (None for a bare base model)."""

    host: EngineHost
    key: tuple[str, str | None, int | None]  # (base model, model name, step)
    model: ServedModel | None


class Registry:
    def __init__(self, root: Path, engine: str = "cpu", factory: Callable[[str], Engine] | None = None,
                 store: CheckpointStore | None = None, retention: Retention | None = None):
        self.root = root
        self.retention = retention or Retention()
        self.store = store
        self.instance = uuid.uuid4().hex  # this server's identity when it claims a model on S3
        self.engine_kind = engine
        self.factory = factory or default_engine_factory(engine)
        self.hosts: dict[str, EngineHost] = {}
        self.models: dict[str, ServedModel] = {}
        self.ready = False
        self.last_request_at = time.time()  # renewed by every authenticated request: the lease
        self.in_flight = 0  # authenticated requests running now; the lease waits for them
        self.started_at = time.time()
        self.lease_s: float | None = None  # `artcloud serve --lease`; the watcher lives in serve.py
        self.max_duration_s: float | None = None  # `--max-duration`
        self.stopping = False  # POST /artcloud/shutdown: no new training jobs from then on
        # Set by serve.run: asks uvicorn to take its graceful path (None when the app runs in-process).
        self.request_exit: Callable[[], None] | None = None
        self._register_lock = asyncio.Lock()

    async def _host(self, base_model: str) -> EngineHost:
        host = self.hosts.get(base_model)
        if host is None:
            host = EngineHost(base_model, self.factory)
            await host.load()  # raises ModelNotFound
            host.batcher = Batcher(partial(self._run_batch, host))
            self.hosts[base_model] = host
        return host

    async def restore(self) -> None:
        """Register again every model an earlier server kept under `root` (they resume where they were)."""
        try:
            for spec_path in sorted(self.root.glob("*/*/model.json")):
                try:
                    spec = RegisterRequest.model_validate_json(spec_path.read_text())
                    await self.register(spec)
                except Exception:
                    log.exception("could not restore the model in %s", spec_path.parent)
        finally:
            self.ready = True

    async def register(self, spec: RegisterRequest) -> dict[str, Any]:
        from artcloud.server.engines.loading import ModelNotFound

        async with self._register_lock:
            current = self.models.get(spec.name)
            if current is not None:
                if current.spec != spec:
                    raise ApiError(
                        409, "model_conflict",
                        f"a model named {spec.name!r} is already registered with project "
                        f"{current.spec.project!r}, base model {current.spec.base_model!r} and its LoRA "
                        "settings; register it with the same settings, or pick another name",
                        "name",
                    )
                return {**current.info(), "resumed": True}
            folder = self.root / spec.project / spec.name
            spec_path = folder / "model.json"
            if spec_path.exists():
                saved = RegisterRequest.model_validate_json(spec_path.read_text())
                if saved != spec:
                    field = "base_model" if saved.base_model != spec.base_model else "lora"
                    raise ApiError(
                        409, "model_conflict",
                        f"{spec.project}/{spec.name} already exists with base model {saved.base_model!r} "
                        f"and lora {saved.lora.model_dump()}; register it the same way, or pick another name",
                        field,
                    )
            try:
                host = await self._host(spec.base_model)
            except ModelNotFound as e:
                raise ApiError(400, "base_model_not_found", str(e), "base_model") from e
            folder.mkdir(parents=True, exist_ok=True)
            checkpoints.write_json_atomic(spec_path, spec.model_dump(mode="json"))
            model = ServedModel(spec, folder, host, slot=f"adapter{len(self.models) + 1}", store=self.store, owner=self.instance, retention=self.retention)
            resumed = await model.load()
            self.models[spec.name] = model
            log.info("%s %s at step %d", "resumed" if resumed else "registered", spec.name, model.step)
            return {**model.info(), "resumed": resumed}

    def _check_ready(self) -> None:
        if not self.ready:
            raise ApiError(503, "not_ready", "the server is still loading its models; retry in a few seconds (GET /health says ready)")

    def get(self, name: str) -> ServedModel:
        self._check_ready()
        model = self.models.get(name)
        if model is None:
            raise ApiError(404, "model_not_found", f"no model named {name!r} is registered here; registered: {sorted(self.models)}", "name")
        return model

    def resolve(self, requested: str) -> Target:
        """`NAME`, `NAME@STEP` or a loaded base model's id."""
        self._check_ready()
        name, _, step_text = requested.rpartition("@") if "@" in requested else (requested, "", "")
        model = self.models.get(name)
        if model is not None:
            step = None
            if step_text:
                if not step_text.isdigit():
                    raise ApiError(400, "invalid_model", f"{requested!r}: the part after @ must be a step number", "model")
                step = int(step_text)
            return Target(model.host, (model.host.base_model, name, step), model)
        host = self.hosts.get(requested)
        if host is not None:
            return Target(host, (requested, None, None), None)
        served = sorted(self.models) + sorted(self.hosts)
        raise ApiError(404, "model_not_found", f"no model {requested!r} is served here; served: {served}", "model")

    async def _run_batch(self, host: EngineHost, key: tuple[str, str | None, int | None], requests: list[GenerationRequest]) -> tuple[list[list[Completion]], str]:
        _, name, step = key
        if name is None:
            return await host.call(host.engine.generate, None, requests), host.base_model
        model = self.models[name]
        async with model.lock.read():
            slot, served_step = await model.slot_for(step)
            results = await host.call(host.engine.generate, slot, requests)
        return results, f"{name}@{served_step}"

    def health(self) -> dict[str, Any]:
        return {
            "models": [
                {"name": m.name, "project": m.spec.project, "base_model": m.spec.base_model, "step": m.step, "training": m.lock.writing,
                 "s3": m.pusher.status() if m.pusher else None}
                for m in self.models.values()
            ],
            "engines": [{"base_model": h.base_model, "kind": self.engine_kind, "batches": h.batcher.batches if h.batcher else 0} for h in self.hosts.values()],
        }

    def lease(self) -> dict[str, float | None]:
        now = time.time()
        return {"lease_s": self.lease_s, "idle_s": round(now - self.last_request_at, 1),
                "max_duration_s": self.max_duration_s, "uptime_s": round(now - self.started_at, 1)}

    async def shutdown(self, wait_for_training_s: float = 0.0, every_s: float = 0.1) -> list[dict[str, Any]]:
        """Stop taking training jobs, wait up to `wait_for_training_s` for queued and running ones, then
        push every model's newest committed checkpoint to S3. Returns each model's info (as
        GET /artcloud/models/NAME: step, history, checkpoints, S3 status) after the push. The models are
        frozen first: a job still at work (`training` true) finishes with the error `shutting_down` and
        commits nothing, so each model's answered step is the newest on disk and on S3.
        Safe to call again. Exiting the process is the caller's part (`request_exit`)."""
        self.stopping = True
        deadline = time.monotonic() + wait_for_training_s
        while any(m.busy for m in self.models.values()) and time.monotonic() < deadline:
            await asyncio.sleep(every_s)
        for model in list(self.models.values()):
            async with model.commit_lock:  # a commit under way ends first; none starts after
                model.frozen = True
        out = []
        for model in list(self.models.values()):
            error = None
            if model.pusher is not None:
                try:
                    await model.pusher.flush()
                except Exception as e:  # a timeout: reported, and the lifespan exit tries once more
                    log.error("push of %s before shutdown failed: %s", model.name, e)
                    error = f"{type(e).__name__}: {e}"
            # The model as it is now (history, checkpoints, S3 status): the launcher's last look at it.
            entry: dict[str, Any] = {**model.info(), "training": model.busy}
            if error is not None:
                entry["error"] = error
            out.append(entry)
        return out

    async def close(self) -> None:
        for model in self.models.values():
            await model.close()
        for host in self.hosts.values():
            if host.batcher is not None:
                await host.batcher.stop()
            host.close()

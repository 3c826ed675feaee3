"""What a running server holds: engines (one per base model) and the models registered on them.

The Registry registers models (within the server's limits), routes chat requests to an engine and an
adapter, and reports its state. The pieces it wires together each live in their own module: the
engines and adapters (models.py), how a model trains, commits and keeps checkpoints (training.py),
the lease (lease.py), and how the server ends (lifecycle.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import tempfile
import uuid
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Callable

from artcloud._version import __version__
from artcloud.errors import ArtcloudError
from artcloud.server.api_errors import ApiError
from artcloud.server.base_weights import BaseWeights
from artcloud.server.batching import Batcher
from artcloud.server.engines.base import Completion, GenerationRequest, RequestRefused, SamplerUnavailable
from artcloud.server.engines.children import Rendezvous
from artcloud.server.engines.choose import ReplicaLinks, engine_factory
from artcloud.server.engines.engine import Engine
from artcloud.server.lease import Lease
from artcloud.server.lifecycle import Lifecycle
from artcloud.server.limits import Limits
from artcloud.server.models import EngineHost, ServedModel
from artcloud.server.prompted import PromptedModel
from artcloud.server.pusher import CLAIM_TIMEOUT_S, Pusher
from artcloud.server.sft import Feed
from artcloud.server.startup import Startup
from artcloud.server.training import ModelTrainer, Retention
from artcloud.storage import checkpoints
from artcloud.storage.s3 import CheckpointStore, StorageError
from artcloud.wire import ForkRequest, LogRequest, RegisterRequest, StateRequest

log = logging.getLogger("artcloud.server")


@dataclass(frozen=True)
class Target:
    """Where a chat request goes: a host, the batching key, and the model (None for a bare base model)."""

    host: EngineHost
    key: tuple[str, str | None, int | None]  # (base model, model name, step)
    model: ServedModel | None


class Registry:
    def __init__(self, root: Path, engine: str = "cpu", factory: Callable[[str], Engine] | None = None,
                 store: CheckpointStore | None = None, retention: Retention | None = None,
                 limits: Limits | None = None, lease: Lease | None = None,
                 claim_timeout_s: float = CLAIM_TIMEOUT_S, engine_args: dict[str, Any] | None = None,
                 vllm_python: str | None = None, startup: Startup | None = None, preload: str | None = None,
                 replicas: ReplicaLinks | None = None, rendezvous: Rendezvous | None = None):
        self.root = root
        self.retention = retention or Retention()
        self.limits = limits or Limits()
        self.store = store
        self.claim_timeout_s = claim_timeout_s
        self.instance = uuid.uuid4().hex  # this server's identity when it claims a model on S3
        self.engine_kind = engine
        # `engine` is checked here, before the server binds (an unknown kind is a ValueError).
        self.factory = factory or engine_factory(engine, workdir=root / ".engines", engine_args=engine_args,
                                                 vllm_python=vllm_python, replicas=replicas, rendezvous=rendezvous)
        # Base weights: pulled from the S3 location when staged there, staged to it after a hub download.
        self.weights = BaseWeights(store.config) if store is not None else None
        self.hosts: dict[str, EngineHost] = {}
        self.models: dict[str, ServedModel] = {}
        self.trainers: dict[str, ModelTrainer] = {}  # by model name, as `models`
        self.prompted: dict[str, PromptedModel] = {}  # served elsewhere: their histories only (prompted.py)
        self.ready = False
        self.startup = startup or Startup()  # what /health says the server is doing while it comes up
        if self.weights is not None:  # a pull from S3 says "fetching weights N/M GB" on /health
            self.weights.progress = self.startup.progress
        self.preload = preload  # a base model to load before saying ready (artcloud serve --preload)
        self.lease = lease or Lease()
        self.lifecycle = Lifecycle(lambda: self.trainers.values(), lambda: self.prompted.values(), self.lease)
        self._register_lock = asyncio.Lock()
        self._slots = itertools.count(1)

    # ------------------------------------------------------------------------------------- engines

    async def _host(self, base_model: str, engine_args: dict[str, Any] | None = None) -> EngineHost:
        if engine_args:
            from artcloud.server.engines.choose import check_engine_args

            try:
                check_engine_args(engine_args, from_client=True)
            except ValueError as e:
                raise ApiError(400, "invalid_engine_args", str(e), "engine_args") from e
        host = self.hosts.get(base_model)
        if host is not None:
            if engine_args and engine_args != host.engine_args:
                raise ApiError(409, "engine_args_conflict",
                               f"{base_model} is already loaded with engine_args {host.engine_args or {}}; a model on it "
                               f"cannot change them (register without engine_args, or the same ones)", "engine_args")
            return host
        if base_model.startswith(("/", "~")) and not Path(base_model).expanduser().is_dir():
            # Said before any limit: a typo in a path should read as a typo.
            raise ApiError(400, "base_model_not_found", f"no model folder at {base_model}: give an existing local "
                           "folder (with config.json) or a hub id", "base_model")
        if len(self.hosts) >= self.limits.max_base_models:
            idle = [h for h in self.hosts.values() if not self._models_on(h)]
            if not idle:
                raise ApiError(409, "too_many_base_models",
                               f"this server already holds {len(self.hosts)} base model(s) ({', '.join(self.hosts)}), its "
                               f"limit (artcloud serve --max-base-models): register on one of them, or start another server",
                               "base_model")
            await self._unload(idle[0])
        host = EngineHost(base_model, self.factory, engine_args, self.weights)
        with self.startup.loading():
            await host.load()  # ApiError 400 when it cannot be loaded
        host.batcher = Batcher(partial(self._run_batch, host), concurrent=host.engine.concurrent,
                               max_queued_samples=self.limits.max_queued_samples)
        self.hosts[base_model] = host
        return host

    def _models_on(self, host: EngineHost) -> list[ServedModel]:
        return [m for m in self.models.values() if m.host is host]

    async def _unload(self, host: EngineHost) -> None:
        log.info("unloading base model %s (no model registered on it)", host.base_model)
        self.hosts.pop(host.base_model, None)
        await host.stop()

    # ------------------------------------------------------------------------------------- models

    async def restore(self) -> None:
        """Register again every model an earlier server kept under `root` (they resume where they were)."""
        try:
            for spec_path in sorted(self.root.glob("*/*/model.json")):
                try:
                    spec = RegisterRequest.model_validate_json(spec_path.read_text())
                    await self.register(spec)
                except Exception:
                    log.exception("could not restore the model in %s", spec_path.parent)
            if self.preload and self.preload not in self.hosts:
                try:
                    async with self._register_lock:
                        await self._host(self.preload)
                    log.info("preloaded base model %s", self.preload)
                except ApiError as e:  # a register naming it gets the same error, and the server still serves
                    log.error("could not preload %s: %s", self.preload, e.message)
                except Exception:
                    log.exception("could not preload %s", self.preload)
        finally:
            self.ready = True
            self.startup.mark_ready()
            # Loading the models an earlier server left may take minutes: the lease starts again when clients
            # can use the server. It still counts while loading, so a stuck load ends too.
            self.lease.touch()

    async def register(self, spec: RegisterRequest) -> dict[str, Any]:
        """Register (or find again) a model. Its spec is saved only once it works, so a register that
        fails (a bad LoRA, a model locked by another server) leaves nothing that a restart would retry."""
        take_over, spec = spec.take_over, spec.model_copy(update={"take_over": False})  # not part of the model's spec
        async with self._register_lock:
            current = self.models.get(spec.name) or self.prompted.get(spec.name)
            if current is not None:
                if current.spec != spec:
                    raise ApiError(409, "model_conflict", f"a model named {spec.name!r} is already registered with "
                                   f"project {current.spec.project!r}, base model {current.spec.base_model!r} and its "
                                   "LoRA settings; register it with the same settings, or pick another name", "name")
                return {**(self.trainers.get(spec.name) or current).info(), "resumed": True}
            # Prompted models (a history each, no adapter) count apart: many baselines never crowd out a LoRA.
            kind = "prompted " if spec.base_model is None else ""
            held = len(self.prompted if kind else self.models)
            if held >= self.limits.max_models:
                raise ApiError(409, "too_many_models", f"this server already holds {held} {kind}models, its limit "
                               "(artcloud serve --max-models): train on one of them, or start another server", "name")
            folder = self.root / spec.project / spec.name
            spec_path = folder / "model.json"
            if spec_path.exists():
                saved = RegisterRequest.model_validate_json(spec_path.read_text())
                if saved != spec:
                    field = "base_model" if saved.base_model != spec.base_model else "lora"
                    raise ApiError(409, "model_conflict", f"{spec.project}/{spec.name} already exists with base model "
                                   f"{saved.base_model!r} and lora {saved.lora.model_dump()}; register it the same way, "
                                   "or pick another name", field)
            if spec.base_model is None:
                return await self._register_prompted(spec, folder, take_over)
            host = await self._host(spec.base_model, spec.engine_args)
            folder.mkdir(parents=True, exist_ok=True)
            model = ServedModel(spec, folder, host, slot=f"adapter{next(self._slots)}")
            trainer = ModelTrainer(model, store=self.store, owner=self.instance, retention=self.retention,
                                   limits=self.limits, claim_timeout_s=self.claim_timeout_s)
            try:
                resumed = await trainer.resume(take_over=take_over)
            except BaseException:
                await trainer.abandon()
                if not self._models_on(host):
                    await self._unload(host)
                raise
            checkpoints.write_json_atomic(spec_path, spec.model_dump(mode="json"))
            self.models[spec.name], self.trainers[spec.name] = model, trainer
            log.info("%s %s at step %d", "resumed" if resumed else "registered", spec.name, model.step)
            return {**trainer.info(), "resumed": resumed, **({"warnings": host.engine.notes} if host.engine.notes else {})}

    async def _register_prompted(self, spec: RegisterRequest, folder: Path, take_over: bool) -> dict[str, Any]:
        """A model served elsewhere, for its history alone (prompted.py). Under `_register_lock`."""
        pusher = (Pusher(self.store, spec.project, spec.name, self.instance, claim_timeout_s=self.claim_timeout_s)
                  if self.store is not None else None)
        model = PromptedModel(spec, folder, pusher)
        try:
            resumed = await model.resume(take_over=take_over)
        except BaseException:
            if pusher is not None:
                pusher.close()
            raise
        folder.mkdir(parents=True, exist_ok=True)
        checkpoints.write_json_atomic(folder / "model.json", spec.model_dump(mode="json"))
        self.prompted[spec.name] = model
        log.info("registered prompted model %s (its history only)", spec.name)
        return {**model.info(), "resumed": resumed}

    def _check_ready(self) -> None:
        if not self.ready:
            raise ApiError(503, "not_ready", "the server is still loading its models; retry in a few seconds (GET /health says ready)")

    def get(self, name: str) -> ServedModel:
        self._check_ready()
        model = self.models.get(name)
        if model is None and name in self.prompted:
            raise ApiError(400, "prompted_model", f"{name} is a prompted model (registered without base_model): it is "
                           "served at its own endpoint and only keeps a history here (model.log); give it a base_model "
                           "to serve or train it here", "name")
        if model is None:
            raise ApiError(404, "model_not_found", f"no model named {name!r} is registered here; registered: "
                           f"{sorted([*self.models, *self.prompted])}", "name")
        return model

    def trainer(self, name: str) -> ModelTrainer:
        return self.trainers[self.get(name).name]

    def with_history(self, name: str) -> ModelTrainer | PromptedModel:
        """A model whose history GET /artcloud/models/NAME answers and model.log adds to: trained or prompted."""
        self._check_ready()
        return self.prompted.get(name) or self.trainer(name)

    async def log(self, name: str, req: LogRequest) -> dict[str, Any]:
        return await self.with_history(name).log(req)

    async def fork(self, name: str, req: ForkRequest) -> dict[str, Any]:
        """OpenPipe ART's _experimental_fork_checkpoint onto `name`: the newest committed checkpoint (at or before
        `not_after_step`) of another model, from this server's disk, else from S3 (`from_s3_bucket`, or this
        server's own --s3), pulled and verified as any checkpoint from S3 is."""
        trainer = self.trainer(name)
        project = req.from_project or trainer.model.spec.project
        label = f"{project}/{req.from_model}"
        if (project, req.from_model) == (trainer.model.spec.project, name):
            raise ApiError(400, "invalid_request", "from_model: a model cannot be forked from itself", "from_model")
        bound = req.not_after_step if req.not_after_step is not None else 2**63
        if req.from_s3_bucket is None:
            source_dir = self.root / project / req.from_model
            local = [s for s in checkpoints.committed_steps(source_dir) if s <= bound]
            if local:
                return await trainer.fork(checkpoints.checkpoints_dir(source_dir) / str(local[-1]), local[-1], label)
        store = self.store
        if req.from_s3_bucket is not None:
            if store is None:
                raise ApiError(400, "invalid_request", "from_s3_bucket: this server has no S3 endpoint or credentials: "
                               "start it with --s3 s3://BUCKET/PREFIX", "from_s3_bucket")
            store = CheckpointStore(dataclasses.replace(store.config, bucket=req.from_s3_bucket,
                                                        prefix=(req.prefix or "").strip("/")))
        if store is None:
            raise ApiError(404, "checkpoint_not_found", f"no committed checkpoint of {label} at or before step "
                           f"{req.not_after_step} on this server (and it has no S3)", "from_model")
        loop = asyncio.get_running_loop()
        try:
            steps = [s for s in await loop.run_in_executor(None, store.committed_steps, project, req.from_model)
                     if s <= bound]
            if not steps:
                raise ApiError(404, "checkpoint_not_found", f"no committed checkpoint of {label} at or before step "
                               f"{req.not_after_step} here or on {store.config.uri}", "from_model")
            with tempfile.TemporaryDirectory(prefix=".fork-", dir=trainer.model.folder) as tmp:
                pulled = await loop.run_in_executor(None, store.pull, project, req.from_model, steps[-1], Path(tmp))
                return await trainer.fork(pulled, steps[-1], f"{label} on {store.config.uri}")
        except StorageError as e:
            raise ApiError(409, "checkpoint_invalid", f"cannot fork {label} from {store.config.uri}: {e}",
                           "from_model") from e

    def state(self, name: str) -> dict[str, Any]:
        return self.with_history(name).state.answer()

    async def write_state(self, name: str, req: StateRequest) -> dict[str, Any]:
        return await self.with_history(name).write_state(req.state, req.merge)

    def resolve(self, requested: str) -> Target:
        """`NAME`, `NAME@STEP` or a loaded base model's id."""
        self._check_ready()
        name, _, step_text = requested.rpartition("@") if "@" in requested else (requested, "", "")
        model = self.models.get(name)
        if model is not None:
            step = None
            if step_text:
                if not step_text.isdigit() or len(step_text) > 12:
                    raise ApiError(400, "invalid_model", f"{requested!r}: the part after @ must be a step number", "model")
                step = int(step_text)
            return Target(model.host, (model.host.base_model, name, step), model)
        host = self.hosts.get(requested)
        if host is not None:
            return Target(host, (requested, None, None), None)
        served = sorted(self.models) + sorted(self.hosts)
        if requested in self.prompted:
            raise ApiError(404, "model_not_found", f"{requested} is a prompted model: it is served at its own "
                           f"inference_base_url, not here; served here: {served}", "model")
        raise ApiError(404, "model_not_found", f"no model {requested!r} is served here; served: {served}", "model")

    def find_feed(self, job_id: str) -> Feed:
        """The chunk feed of SFT job `job_id` (ApiError 404 for no such job, 409 for one that takes no chunks)."""
        feed = self.find_trainer(job_id).feeds.get(job_id)
        if feed is None:
            raise ApiError(409, "job_ended", f"job {job_id} takes no batches: it is not a supervised fine-tuning job, or "
                           "it has ended", "job_id")
        return feed

    def find_trainer(self, job_id: str) -> ModelTrainer:
        for trainer in self.trainers.values():
            if job_id in trainer.jobs.jobs:
                return trainer
        raise ApiError(404, "job_not_found", f"no job {job_id!r} on this server", "job_id")

    def find_job(self, job_id: str):
        for trainer in self.trainers.values():
            job = trainer.jobs.jobs.get(job_id)
            if job is not None:
                return job
        raise ApiError(404, "job_not_found", f"no job {job_id!r} on this server", "job_id")

    async def _run_batch(self, host: EngineHost, key: tuple[str, str | None, int | None], requests: list[GenerationRequest]) -> tuple[list[list[Completion]], str]:
        _, name, step = key
        try:
            if name is None:
                _started(requests, host.base_model)
                results = await host.generate(None, requests)
                return [_answered(r) if isinstance(r, ArtcloudError) else r for r in results], host.base_model
            model = self.models[name]
            async with model.lock.read():
                slot, served_step = await model.slot_for(step)
                _started(requests, f"{name}@{served_step}")
                results = await host.generate(slot, requests)
        except SamplerUnavailable as e:
            raise ApiError(503, "sampler_unavailable", str(e)) from e
        except RequestRefused as e:
            raise ApiError(400, "request_refused", str(e)) from e
        return [_answered(r) if isinstance(r, ArtcloudError) else r for r in results], f"{name}@{served_step}"

    # ------------------------------------------------------------------------------------- reports

    def status(self) -> dict[str, Any]:
        """GET /artcloud/status: what /health used to tell anyone, now for the token holder only."""
        return {
            "version": __version__, "ready": self.ready,
            "models": [
                {"name": m.name, "project": m.spec.project, "base_model": m.spec.base_model, "step": m.step,
                 "training": m.lock.writing, "s3": self.trainers[m.name].s3_status(),
                 "fault": self.trainers[m.name].fault}
                for m in self.models.values()
            ],
            "engines": [{"base_model": h.base_model, "kind": self.engine_kind, "batches": h.batcher.batches if h.batcher else 0,
                         "abandoned": h.batcher.abandoned if h.batcher else 0,
                         **(h.engine.status() if h.engine is not None else {})}
                        for h in self.hosts.values()],
            "lease": self.lease.info(),
            "limits": dataclasses.asdict(self.limits),
        }

    def health(self) -> dict[str, Any]:
        """GET /health: "degraded" while a sampler process is down (it restarts by itself), or while training
        fails for a cause that lasts (a full disk, a model whose failed step could not be undone). Nothing
        private: no model names, no paths."""
        from artcloud.server.jobs import CAUSES

        problems = [p for p in (h.health() for h in self.hosts.values()) if p]
        problems += sorted({f"training: {CAUSES[t.fault]}" for t in self.trainers.values() if t.fault})
        out: dict[str, Any] = {"status": "degraded" if problems else "ok", "version": __version__, "ready": self.ready,
                               **self.startup.report()}
        if problems:
            out["detail"] = "; ".join(problems)
        return out

    async def close(self) -> None:
        from artcloud.server.jobs import SYNCER

        await self.lifecycle.push_all(close=True)  # every model at once, within FINAL_PUSH_DEADLINE_S
        for host in list(self.hosts.values()):
            await host.stop()
        await asyncio.to_thread(SYNCER.sync)


def _started(requests: list[GenerationRequest], served_as: str) -> None:
    """Tell streamed requests what serves them (NAME@STEP, fixed from here on): their first chunk says it."""
    for r in requests:
        if r.sink is not None:
            r.sink.started(served_as)


def _answered(e: ArtcloudError) -> Exception:
    """A sampler's error about a request, as its answer: 503 for a sampler that cannot answer now, 400 for a request
    an engine refused; anything else as it is (an engine's failure: 500)."""
    if isinstance(e, SamplerUnavailable):
        return ApiError(503, "sampler_unavailable", str(e))
    if isinstance(e, RequestRefused):
        return ApiError(400, "request_refused", str(e))
    return e

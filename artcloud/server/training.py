"""How one model moves from step to step: its job queue, the training step, the commit, and retention.

    resume      newest valid local checkpoint (S3's first, when newer), else a fresh adapter at step 0
    submit      a job joins the model's queue (at most --max-queued-jobs wait)
    _step       one step, RL (_run) or SFT (_run_sft, its batches streamed in: sft.py): inference waits
                (write lock), the engine trains, the step is committed to disk, NAME@STEP+1 is served; on any
                failure the adapter and optimizer go back to the last committed step, so a half-applied or
                non-finite update is never served or trained on (a rollback that fails too leaves the model
                unserved, 503, until a reload works)
    fork        a model not trained yet starts from another's committed checkpoint (ART's fork_checkpoint)
    state       ART's state.json, kept with the step it belongs to (model_state.py)
    _loop       the worker: whatever a step raises, its job ends with an `error` event naming the cause
                (disk_full, io_error, ...) and the next job runs; a worker that dies is started again
    _commit     checkpoints.commit (manifest last, renamed into place), then a background S3 push
    log         model.log's metrics join the history (history.py: records, files, what a resume keeps)
    _retain     --keep-last on disk; with S3, only steps already on S3 may go (a push still reading a
                folder never loses it); S3's own retention runs in the pusher
    freeze      shutdown: no step commits after this, so what the server answers is what S3 holds
"""

from __future__ import annotations

import asyncio
import json
import logging
import shutil
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Awaitable, Callable

from artcloud.errors import ArtcloudError, first_line
from artcloud.server import history, step_config
from artcloud.server.api_errors import ApiError
from artcloud.server.engines.base import StepCallback, TrainSample
from artcloud.server.jobs import CAUSES, Job, JobStore, os_cause
from artcloud.server.limits import Limits
from artcloud.server.model_state import STATE_FILE, StateKeeper
from artcloud.server.models import ServedModel
from artcloud.server.pusher import CLAIM_TIMEOUT_S, Pusher
from artcloud.server.sft import Feed
from artcloud.storage import checkpoints
from artcloud.storage.s3 import CheckpointStore, StorageError
from artcloud.types import TrainConfig
from artcloud.wire import LogRequest

log = logging.getLogger("artcloud.server")

RELOAD_EVERY_S = 5.0  # how often a model whose rollback failed is reloaded, jobs or not


@dataclass(frozen=True)
class Retention:
    """Keep the newest `keep_last` checkpoints and the best by `metric` (a history key); 0 keeps all.
    The latest committed checkpoint is never deleted."""

    keep_last: int = 0
    metric: str = "reward_mean"  # a training record's key, or SPLIT/KEY (e.g. val/reward): history.metric_by_step


class Abandoned(ArtcloudError):
    """A training step finished after shutdown froze its model: it is dropped, not committed."""

    code = "shutting_down"

    def __init__(self, step: int):
        super().__init__(f"step {step} abandoned at shutdown")
        self.step = step


class ModelTrainer:
    """Moves one ServedModel from step to step (see the module docstring), and says where it is (`info`)."""

    def __init__(self, model: ServedModel, *, store: CheckpointStore | None = None, owner: str = "",
                 retention: Retention | None = None, limits: Limits | None = None,
                 claim_timeout_s: float = CLAIM_TIMEOUT_S):
        self.model = model
        self.retention = retention or Retention()
        self.limits = limits or Limits()
        self.pusher = (Pusher(store, model.spec.project, model.name, owner, retention=self._to_delete,
                              on_pushed=self._pushed, claim_timeout_s=claim_timeout_s)
                       if store is not None else None)
        self.jobs = JobStore(model.name, model.folder / "jobs", max_kept=self.limits.max_kept_jobs)
        self.submit_lock = asyncio.Lock()  # a concurrent retry with the same key must not start a second job
        # Each job and what runs it (_run: an RL step; _run_sft: a train_sft call), in order.
        self._queue: asyncio.Queue[tuple[Job, Callable[[], Awaitable[None]]]] = asyncio.Queue()
        self.feeds: dict[str, Feed] = {}  # an SFT job's chunks, by job id (sft.py), while it takes them
        self._worker: asyncio.Task | None = None
        self._closing = False
        self._current: tuple[Job, Callable[[], Awaitable[None]]] | None = None  # the job the worker runs
        self.fault: str | None = None  # why training is degraded (disk_full, rollback_failed, ...) until a step commits
        # Shutdown freezes the model: from then on no step commits, so what it answers is what S3 holds.
        self.commit_lock = asyncio.Lock()
        self.frozen = False
        self._history_lock = asyncio.Lock()  # one writer of the model folder's history files at a time
        self.state = StateKeeper(model.folder, self.pusher, self.commit_lock)  # ART's state.json (model_state.py)
        self._deleting = asyncio.Lock()  # retention (_retain) and prune (delete_checkpoints): one at a time
        self._tasks: set[asyncio.Task] = set()  # retention runs a push started (the loop holds tasks weakly)

    @property
    def name(self) -> str:
        return self.model.name

    # ------------------------------------------------------------------------------------- resume

    async def resume(self, take_over: bool = False) -> bool:
        """Resume from the newest complete checkpoint, or start at step 0. Returns True if it resumed.
        `take_over`: the S3 claim too, however fresh (the client tore its last holder down)."""
        model = self.model
        checkpoints.clean_partial(model.folder)
        remote = None
        if self.pusher is not None:
            await self.pusher.claim(take_over=take_over)  # one writer per model and S3 location
            remote = await self._pull_if_newer()
        found = await model.host.call(checkpoints.latest_valid, model.folder)
        checkpoints.set_aside_after(model.folder, found[0] if found else -1)
        if found is None:
            try:
                await model.host.call(model.engine.create_adapter, model.slot, model.spec.lora)
            except ValueError as e:  # peft: "Target modules {...} not found in the base model", a bad rank
                raise ApiError(400, "invalid_lora", f"this LoRA cannot be made on {model.spec.base_model}: {e}", "lora") from e
            await self.state.resume(0, None)
            await self._commit(0)
            resumed = False
        else:
            step, folder = found
            await model.host.call(model.engine.load_adapter, model.slot, model.spec.lora, folder, optimizer=True)
            await self.state.resume(step, folder)
            state = checkpoints.read_trainer_state(folder)
            model.step = step
            remote_history = None
            if self.pusher is not None and remote is not None:  # S3's live copy, in case this disk has none
                remote_history = await self.pusher.read_history()
            model.history = await asyncio.to_thread(history.restore, folder, model.folder, step, state, remote_history)
            model.temperature = state.get("temperature", 1.0)
            if "rng" in state:  # on the engine's thread: the sharded trainer asks its ranks (code review 3, R5)
                await model.host.call(model.engine.set_rng_state, state["rng"])
            if self.pusher is not None and (remote is None or step > remote):
                self.pusher.schedule(folder)  # this machine got further than S3 (its last push failed)
            elif self.pusher is not None and self.pusher.pushed_step is None:
                self.pusher.pushed_step = remote  # resumed from S3: that step is there already
            resumed = True
        await self._save_history()
        self.jobs.load()
        self._start_worker()
        return resumed

    async def _pull_if_newer(self) -> int | None:
        """A fresh machine (or one behind) first fetches the newest checkpoint committed on S3. Returns
        S3's newest step. What S3 holds is untrusted: an invalid checkpoint there refuses the register."""
        assert self.pusher is not None
        store, model = self.pusher.store, self.model
        loop = asyncio.get_running_loop()
        try:
            remote = await loop.run_in_executor(None, store.newest, model.spec.project, self.name)
            local = checkpoints.committed_steps(model.folder)
            if remote is not None and (not local or remote > local[-1]):
                log.info("pulling %s step %d from %s", self.name, remote, store.config.uri)
                await loop.run_in_executor(None, store.pull, model.spec.project, self.name, remote,
                                           checkpoints.checkpoints_dir(model.folder))
        except (StorageError, checkpoints.CorruptCheckpoint) as e:
            raise ApiError(409, "checkpoint_invalid", f"cannot resume {model.spec.project}/{self.name} from "
                           f"{store.config.uri}: {e}. Delete that checkpoint from S3, or use another --s3 prefix",
                           "name") from e
        return remote

    # ------------------------------------------------------------------------------------- jobs

    def check_can_train(self) -> None:
        if self.pusher is not None and self.pusher.lost is not None:
            raise ApiError(409, "model_locked", f"{self.name} is now trained by another server on "
                           f"{self.pusher.store.config.uri}; this server stopped training it: {self.pusher.lost}", "name")
        waiting = self._queue.qsize()
        if waiting >= self.limits.max_queued_jobs:
            raise ApiError(429, "too_many_jobs", f"{self.name} already has {waiting} training jobs waiting (the limit, "
                           "artcloud serve --max-queued-jobs): wait for one to end before posting more")

    def submit(self, job: Job, samples: list[TrainSample], stats: dict[str, Any], config: TrainConfig) -> None:
        job.emit("queued", position=self._queue.qsize())
        self._queue.put_nowait((job, partial(self._run, job, samples, stats, config)))

    def submit_sft(self, job: Job, feed: Feed) -> None:
        """An SFT job (sft.py): it waits in the queue as a training job does, taking chunks meanwhile."""
        job.emit("queued", position=self._queue.qsize(), kind="sft")
        self.feeds[job.id] = feed
        self._queue.put_nowait((job, partial(self._run_sft, job, feed)))

    def _start_worker(self) -> None:
        """The model's training worker; one that ends on anything but a cancel (a bug) is started anew."""
        def ended(task: asyncio.Task) -> None:
            if task.cancelled() or self._closing:
                return
            log.error("the training worker of %s ended (%r): starting it again", self.name, task.exception())
            current, self._current = self._current, None
            job = current[0] if current is not None else None
            if job is not None and not job.done:  # its job ends, with the cause, not silently
                job.emit("error", code="internal_error", step=self.model.step,
                         message=f"training failed: {task.exception()!r}; {self.name} stays at step {self.model.step}")
            self._start_worker()

        self._worker = asyncio.get_running_loop().create_task(self._loop(), name=f"train-{self.name}")
        self._worker.add_done_callback(ended)

    async def _loop(self) -> None:
        while True:
            if self.model.unservable:  # its last rollback failed: try to reload it now and then, jobs or not
                try:
                    item = await asyncio.wait_for(self._queue.get(), RELOAD_EVERY_S)
                except asyncio.TimeoutError:
                    await self._reload(quiet=True)
                    continue
            else:
                item = await self._queue.get()
            job, run = self._current = item
            try:
                await self._reload()
                await run()
            except Exception as e:  # whatever failed, the job ends with its cause and the next one runs
                self._failed(job, e)
            finally:
                feed = self.feeds.pop(job.id, None)
                if feed is not None:
                    feed.close(f"the job ended ({job.status})")
            self._current = None

    def _failed(self, job: Job, e: Exception) -> None:
        from artcloud.train.loop import NonFiniteError

        step, name = self.model.step, self.name
        if isinstance(e, Abandoned):
            log.warning("%s: step %d computed during shutdown, not committed", name, e.step)
            event = dict(code="shutting_down", message=f"the server is shutting down: step {e.step} was not committed, "
                         f"{name} stays at step {step} (on S3 too); train it again on a new server")
        elif isinstance(e, NonFiniteError):
            log.error("%s: %s", name, e)
            event = dict(code="non_finite", cause=e.cause, gradient_step=e.gradient_step,
                         message=f"{e}; {name} stays at step {step}")
        elif type(e) is ArtcloudError and e.code in ("client_gone", "checkpoint_not_found"):
            # The job's own circumstances, no fault of the server: an SFT job whose batches stopped coming, a KL
            # reference deleted while the job waited.
            log.warning("%s: %s", name, e)
            event = dict(code=e.code, message=f"{e}; nothing of this job was committed, {name} stays at step {step}")
        else:
            log.error("training job %s failed", job.id, exc_info=e)
            code = os_cause(e)
            if code != "internal_error" and not self.model.unservable:
                self.fault = code  # /health says degraded until a step commits again
            what = f"{CAUSES[code]} ({first_line(e)})" if code in CAUSES else str(e)
            event = dict(code=code, message=f"training failed: {what}; {name} stays at step {step}"
                         + (f", and is not served until it is reloaded from that step ({self.model.unservable})"
                            if self.model.unservable else ""))
        if not job.done:
            job.emit("error", step=step, **event)

    async def _run(self, job: Job, samples: list[TrainSample], stats: dict[str, Any], config: TrainConfig) -> None:
        """An RL step. Every group with equal rewards: nothing to learn, and the step still advances on the same
        adapter, as OpenPipe ART's does (a script resuming at `await model.get_step()` counts its batches by it)."""
        job.emit("start", step=self.model.step, **stats)
        if config.scale_learning_rate_by_reward_std_dev:
            config = config.model_copy(update={"learning_rate": config.learning_rate * step_config.reward_spread_trend(
                self.model.history, self.model.step + 1, stats["reward_std_dev"])})

        async def work(on_step: StepCallback) -> tuple[list[dict[str, Any]], dict[str, Any]]:
            model = self.model
            reference = config.kl_ref_adapter_path if config.kl_reference else None
            if samples and reference is not None and not (Path(reference) / checkpoints.MANIFEST).is_file():
                # Resolved when the job was posted; retention or a prune may have deleted it while the job waited.
                raise ArtcloudError(f"the KL reference checkpoint {Path(reference).name} of this job was deleted "
                                    "while it waited (retention or delete_checkpoints): keep that step, or name "
                                    "another", code="checkpoint_not_found")
            steps = await model.host.call(model.engine.train_step, model.slot, samples, config, on_step) if samples else []
            return steps, stats

        note = {} if samples else {"message": "every group had equal rewards, so there was nothing to learn: the step "
                                   "advanced with the adapter unchanged"}
        await self._step(job, work, trained=bool(samples), **note)

    async def _step(self, job: Job, work: Callable[[StepCallback], Awaitable[tuple[list[dict[str, Any]], dict[str, Any]]]],
                    *, trained: bool, **end: Any) -> None:
        """One training step, RL or SFT: `work(on_step)` runs it on the engine (inference for the model waits meanwhile)
        and gives its gradient steps' metrics and its stats; then it is committed, and NAME@STEP+1 is served. On any
        failure the adapter and optimizer go back to the last committed step: a half-applied update is never served
        or trained on."""
        model = self.model
        loop = asyncio.get_running_loop()
        next_step = model.step + 1

        def on_step(metrics: dict[str, Any]) -> None:  # called on the engine thread
            loop.call_soon_threadsafe(partial(job.emit, "step", step=next_step, **metrics))

        async with model.lock.write():  # inference waits from here until NAME@next_step is served
            t0 = time.time()
            record: dict[str, Any] | None = None
            try:
                steps, stats = await work(on_step)
                record = history.training_record(next_step, job.id, stats, steps, time.time() - t0)
                async with self.commit_lock:
                    if self.frozen:
                        raise Abandoned(next_step)
                    model.history.append(record)
                    folder = await self._commit(next_step)
            except BaseException:
                model.history = [r for r in model.history if r is not record]  # a log may have come after it
                await self._reload(failed_step=True)
                raise
            model.step = next_step
            self.fault = None
        await self._save_history()
        try:
            await self._retain()
        except Exception as e:  # the step is committed: an old one left on disk is no reason to fail it
            log.warning("%s: retention after step %d failed: %s", self.name, next_step, e)
        job.emit("end", step=next_step, served_as=model.served_as, trained=trained, metrics=record,
                 checkpoint=str(folder), s3=self.s3_status(), **end)

    async def _run_sft(self, job: Job, feed: Feed) -> None:
        """One train_sft call (sft.py): each batch that comes is an optimizer step; after the last, one commit. The
        model is held (inference waits) only from its first chunk on: a client that never sends one holds nothing."""
        from artcloud.train.loop import SFTStep

        job.emit("start", step=self.model.step, kind="sft", batches=feed.total)
        done, chunk = 0, None

        async def work(on_step: StepCallback) -> tuple[list[dict[str, Any]], dict[str, Any]]:
            nonlocal done, chunk
            model, steps = self.model, []
            while True:
                for samples, learning_rate in chunk.batches:
                    feed.check_wanted()
                    done += 1
                    sft = SFTStep(learning_rate, max_grad_norm=feed.max_grad_norm, batch=done, batches=feed.total)
                    steps += await model.host.call(model.engine.train_step, model.slot, samples, sft, on_step)
                if chunk.last:
                    feed.check_wanted()
                    feed.committing = True  # from here an abort is refused (409): the step commits
                    return steps, {"kind": "sft", "batches": done, "trajectories": sum(s["samples"] for s in steps),
                                   "trajectories_dropped": feed.dropped}
                chunk = await feed.next()

        try:
            chunk = await feed.next()
            await self._step(job, work, trained=True)
        except BaseException:
            feed.close("it failed: nothing of it was committed")
            raise

    def resolve(self, config: TrainConfig) -> TrainConfig:
        """`config` with its KL reference as a committed checkpoint folder on this server (step_config.py)."""
        return step_config.resolve_reference(config, self.model.folder, self.name)

    # ------------------------------------------------------------------------------------- fork

    async def fork(self, source: Path, step: int, label: str) -> dict[str, Any]:
        """Start this model from a committed checkpoint of another model (`source`, its folder at `step`), as
        OpenPipe ART's _experimental_fork_checkpoint: its adapter and optimizer become this model's step `step`
        (committed, served, pushed). Its history and state stay this model's own (ART copies checkpoint files
        only). A model that has trained past `step` already is left as it is (a script run again); one that has
        trained less far is refused (fork onto a new name)."""
        model = self.model
        try:
            saved = await asyncio.to_thread(checkpoints.verify, source)  # what another model's folder holds is checked
            adapter = json.loads((source / "adapter_config.json").read_text())
        except (OSError, ValueError, checkpoints.CorruptCheckpoint) as e:
            raise ApiError(409, "checkpoint_invalid", f"{label} cannot be forked: {e}", "from_model") from e
        if adapter.get("base_model_name_or_path") != model.spec.base_model:
            raise ApiError(400, "invalid_request", f"from_model: {label} is an adapter of "
                           f"{adapter.get('base_model_name_or_path')!r}, not of {model.spec.base_model!r}", "from_model")
        self.check_can_train()  # not on a model another server now trains (S3's claim was lost)
        async with self.submit_lock, model.lock.write(), self.commit_lock:
            if self.frozen:  # shutdown froze it and pushed its last step: a fork now would never reach S3
                raise ApiError(409, "shutting_down", f"{self.name} is frozen: the server is shutting down")
            if model.step >= step and model.step > 0 and not self.busy_with_jobs:
                # A script run again (it resumes): ART's fork copies the checkpoint in under its step, older than the
                # model's latest, which the model stays at. So does this one, with nothing copied.
                log.warning("%s is at step %d already, past %s's step %d: not forked again", self.name, model.step,
                            label, step)
                return self.info()
            if self.busy_with_jobs or model.step != 0 or checkpoints.committed_steps(model.folder) != [0]:
                raise ApiError(409, "model_trained", f"{self.name} is at step {model.step} with checkpoints "
                               f"{checkpoints.committed_steps(model.folder)}: a fork starts a model that has not trained "
                               "yet; fork onto a new model name", "name")
            try:
                await model.host.call(model.engine.load_adapter, model.slot, model.spec.lora, source,
                                      optimizer="optimizer.pt" in saved["files"])
            except Exception as e:  # another LoRA shape: the model goes back to its own step 0
                await self._reload(failed_step=True)
                raise ApiError(400, "invalid_request", f"from_model: {label} does not fit this model's LoRA "
                               f"({model.spec.lora.model_dump()}): {first_line(e)}", "from_model") from e
            # A fork at step 0 replaces this model's own step 0, which stays aside until the new one is committed.
            aside = await model.host.call(checkpoints.set_aside, model.folder, 0) if step == 0 else None
            try:
                await self._commit(step)
            except BaseException:
                if aside is not None:
                    await model.host.call(checkpoints.restore_aside, model.folder, 0, aside)
                await self._reload(failed_step=True)
                raise
            if aside is not None:
                await model.host.call(shutil.rmtree, aside, True)
            model.step = step
        log.info("%s starts at step %d, forked from %s", self.name, step, label)
        return self.info()

    @property
    def busy_with_jobs(self) -> bool:
        return not self._queue.empty() or self._current is not None

    # ------------------------------------------------------------------------------------- state

    async def write_state(self, state: dict[str, Any], merge: bool) -> dict[str, Any]:
        """ART's overwrite_state / merge_state: on this disk (and on its way to S3) when it returns; tagged with
        the step it belongs to (after any commit under way)."""
        def step() -> int:  # under the commit lock: no commit under way, and the model not frozen since
            if self.frozen:
                raise ApiError(409, "shutting_down", f"{self.name} is frozen: the server is shutting down and pushed "
                               "its last state")
            return self.model.step

        return await self.state.write(state, merge_into=merge, step=step)

    # ------------------------------------------------------------------------------------- history

    async def log(self, req: LogRequest) -> dict[str, Any]:
        """Record model.log's metrics for a step (default: the model's step); the history files follow."""
        model = self.model
        history.check_log(req, model.history, self.name)
        step = model.step if req.step is None else req.step
        if step > model.step:
            raise ApiError(400, "invalid_request", f"step: {self.name} is at step {model.step}; metrics for step {step} "
                           "cannot be logged before that step exists", "step")
        record = history.log_record(req, step)
        model.history.append(record)
        await self._save_history()
        if self.pusher is not None:  # the next commit carries it too; until then S3's live copy does
            self.pusher.schedule_live(history.HISTORY_FILE, history.to_jsonl(model.history))
        return record

    async def _save_history(self) -> None:
        """The model folder's history.jsonl and reward.svg, as the history is now (history.py)."""
        async with self._history_lock:
            try:
                await asyncio.to_thread(history.write_live, self.model.folder, list(self.model.history))
            except OSError as e:  # a full disk: the history stays in memory and in the next checkpoint
                log.warning("could not write the history files of %s: %s", self.name, e)

    # ------------------------------------------------------------------------------------- commits

    async def _commit(self, step: int) -> Any:
        model = self.model
        records = list(model.history)  # as of this commit: a log may append while the files are written
        state = {"rng": await model.host.call(model.engine.rng_state), "base_model": model.spec.base_model,
                 "lora": model.spec.lora.model_dump(), "temperature": model.temperature}
        save = partial(model.engine.save_adapter, model.slot, optimizer=True)

        state_text = self.state.checkpoint_text(step)

        def write(folder: Any) -> list[str]:
            (folder / STATE_FILE).write_text(state_text)
            return [*save(folder), *history.write_files(folder, records), STATE_FILE]

        folder = await model.host.call(checkpoints.commit, model.folder, step, write, state)
        # The sampler serves what was committed (vLLM loads the adapter; the CPU engine already has it). A
        # step the sampler cannot serve is not kept: the disk must not get ahead of what the model is at.
        try:
            await model.host.call(model.engine.publish, model.slot, model.spec.lora, folder)
        except BaseException:
            await model.host.call(checkpoints.delete, model.folder, step)
            raise
        if self.pusher is not None:
            self.pusher.schedule(folder)  # in the background: training goes on
        return folder

    async def _reload(self, *, failed_step: bool = False, quiet: bool = False) -> None:
        """The adapter and optimizer back to the last committed step, after a failed step (`failed_step`), or
        for a model whose rollback failed (`unservable`). A rollback that fails itself leaves the model unserved
        (503) until a reload works: the update it could not undo is never served. Raises unless `quiet`
        or after a failed step (whose own error is the one to raise)."""
        model = self.model
        if not failed_step and not model.unservable:
            return
        folder = checkpoints.step_folder(model.folder, model.step)
        try:
            if folder is not None:
                await model.host.call(model.engine.load_adapter, model.slot, model.spec.lora, folder, optimizer=True)
        except Exception as e:
            if not model.unservable:
                log.error("%s: could not roll back to step %d, not serving it until it is reloaded: %s",
                          self.name, model.step, e)
            model.unservable = f"{CAUSES.get(os_cause(e), 'reloading it failed')}: {first_line(e)}"
            self.fault = "rollback_failed"
            if not (failed_step or quiet):
                raise
            return
        if model.unservable:
            log.warning("%s: reloaded from step %d, served again", self.name, model.step)
            model.unservable, self.fault = None, None

    # ------------------------------------------------------------------------------------- retention

    def _to_delete(self, steps: list[int]) -> list[int]:
        metric = history.metric_by_step(self.model.history, self.retention.metric)
        return checkpoints.plan_retention(steps, keep_last=self.retention.keep_last, metric=metric)

    async def _retain(self) -> None:
        """Local retention. With S3, a step may go only once it (or a newer step) is on S3: the pusher
        may still be reading an unpushed folder, and deleting it would lose the step."""
        async with self._deleting:
            await self._delete(self._to_delete(checkpoints.committed_steps(self.model.folder)))

    async def _delete(self, steps: list[int]) -> list[int]:
        """Delete these committed steps, but, with S3, none not yet pushed; the steps deleted. Under `_deleting`."""
        model = self.model
        if self.pusher is not None:
            pushed = self.pusher.pushed_step
            steps = [s for s in steps if pushed is not None and s <= pushed]
        for step in steps:
            await model.host.call(checkpoints.delete, model.folder, step)
            await model.forget(step)
        return steps

    async def prune(self, metric: str) -> dict[str, Any]:
        """Delete every committed checkpoint but the latest and the best by `metric` (history.metric_by_step:
        a training record's key, or SPLIT/KEY such as ART's default val/reward; highest best; ART's
        delete_checkpoints). A metric no step has keeps the latest step alone, as ART does. With S3, a step
        not yet pushed stays (as in _retain); S3's copies stay too."""
        model = self.model
        by_step = history.metric_by_step(model.history, metric)
        note = None
        if not by_step:  # as ART: the latest step alone is kept, and the answer says why
            known = sorted({(f"{r['split']}/" if r.get("split", "train") != "train" else "") + k
                            for r in model.history for k, v in r.items()
                            if history._number(v) and k not in ("step", "time")})
            note = (f"no step of {self.name} has {metric!r} in its history (its metrics: {', '.join(known) or 'none yet'}): "
                    "kept the latest step only")
        async with self._deleting:  # not at once with retention (_retain): both would delete the same step
            steps = checkpoints.committed_steps(model.folder)
            scored = [s for s in steps if s in by_step]
            best = max(scored, key=lambda s: (by_step[s], s)) if scored else None
            keep = {steps[-1]} if steps else set()
            if best is not None:
                keep.add(best)
            doomed = await self._delete([s for s in steps if s not in keep])
        return {"name": self.name, "metric": metric, "best_step": best,
                "kept": [s for s in steps if s not in doomed], "deleted": doomed, "note": note}

    def _pushed(self, step: int) -> None:
        task = asyncio.get_running_loop().create_task(self._retain(), name=f"retain-{self.name}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # ------------------------------------------------------------------------------------- state

    @property
    def busy(self) -> bool:
        """A training job is queued or running (a job reloaded from disk is always closed)."""
        return self.model.lock.writing or not self._queue.empty() or any(not j.done for j in self.jobs.jobs.values())

    def s3_status(self) -> dict[str, Any] | None:
        return self.pusher.status() if self.pusher is not None else None

    def info(self) -> dict[str, Any]:
        """GET /artcloud/models/NAME: the model's state and its S3 pushes."""
        return {**self.model.info(), "s3": self.s3_status()}

    async def freeze(self) -> None:
        async with self.commit_lock:  # a commit under way ends first; none starts after
            self.frozen = True

    async def final_push(self) -> str | None:
        """Push the newest committed step now; None when done (or nothing to push), else why not (the
        lifespan exit tries once more)."""
        return await self.pusher.final_push() if self.pusher is not None else None

    async def abandon(self) -> None:
        """Undo a resume that failed half-way: the adapter leaves the engine, the S3 claim is released
        (nothing was pushed for it), so a corrected register starts clean."""
        self._closing = True
        if self._worker is not None:
            self._worker.cancel()
        try:
            await self.model.host.call(self.model.engine.delete_adapter, self.model.slot)
        except Exception as e:  # the engine may be what failed
            log.debug("could not delete the adapter of %s: %s", self.name, e)
        if self.pusher is not None:
            await self.pusher.release()

    async def close(self) -> None:
        """The final push before the server exits (a failure is logged), then the claim goes."""
        self._closing = True
        if self._worker is not None:
            self._worker.cancel()
        if self.pusher is not None:
            await self.final_push()
            await self.pusher.release()


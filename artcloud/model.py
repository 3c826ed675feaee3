"""Models as a user holds them: register on a backend, sample through OpenAI's client, train.

    model = artcloud.TrainableModel(name="agent-1", project="mail", base_model="Qwen/Qwen2.5-7B-Instruct")
    await model.register(backend)
    client = model.openai_client()
    result = await model.train(groups, config=artcloud.TrainConfig(learning_rate=5e-5))
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterable

from artcloud.types import LoraConfig, TrainConfig, TrajectoryGroup

if TYPE_CHECKING:
    from artcloud.backends.remote import RemoteBackend

log = logging.getLogger("artcloud")


@dataclass
class LinearTemperatureAnnealer:
    """Sampling temperature from `start` to `end` over `steps` training steps, then `end`."""

    start: float
    end: float
    steps: int

    def __post_init__(self) -> None:
        if self.steps < 1 or self.start < 0 or self.end < 0:
            raise ValueError("LinearTemperatureAnnealer needs steps >= 1 and temperatures >= 0")

    def temperature(self, step: int) -> float:
        frac = min(max(step, 0), self.steps) / self.steps
        return self.start + (self.end - self.start) * frac


@dataclass
class TrainResult:
    step: int  # the model's step after this call (NAME@step is served now)
    trained: bool  # False when every group had equal rewards (nothing to learn)
    metrics: dict[str, Any] = field(default_factory=dict)
    events: list[dict[str, Any]] = field(default_factory=list, repr=False)


class Model:
    """A model served by a backend, for inference only (no `train`). Registered as an adapter that is
    never trained, so it answers exactly as its base model does, under its own name."""

    def __init__(self, *, name: str, project: str, base_model: str, engine_args: dict[str, Any] | None = None,
                 report_metrics: list[str] | None = None):
        from artcloud import report

        self.report_metrics = report.check_reporting(report_metrics)  # ["wandb"]; None: W&B if WANDB_API_KEY
        self._wandb: report.WandbReporter | None = None
        self.name = name
        self.project = project
        self.base_model = base_model
        # vLLM settings for base_model on a GPU server (max_model_len, gpu_memory_utilization, load_in_4bit...),
        # used when the server first loads it; the backend's engine_args are the defaults under them.
        self.engine_args = dict(engine_args) if engine_args else None
        self._backend: RemoteBackend | None = None
        self.step = 0

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, project={self.project!r}, base_model={self.base_model!r}, step={self.step})"

    @property
    def backend(self) -> "RemoteBackend":
        if self._backend is None:
            raise RuntimeError(f"{self.name} is not registered: call `await model.register(backend)` first")
        return self._backend

    async def register(self, backend: "RemoteBackend") -> None:
        info = await backend.register(self.name, self.project, self.base_model, self._lora().model_dump(),
                                      engine_args=self.engine_args)
        self._backend = backend
        self.step = info["step"]

    def _lora(self) -> LoraConfig:
        return LoraConfig()

    def openai_client(self, **kwargs: Any):
        """`openai.AsyncOpenAI` bound to the backend's server (its CA and token; nothing else trusted).
        Ask it for `model=model.name` (the latest step) and `logprobs=True` when the turns are for training."""
        return self.backend.openai_client(**kwargs)

    def inference_name(self, step: int | None = None) -> str:
        """`NAME@STEP` for `step`, or for the latest step this object knows of."""
        return f"{self.name}@{self.step if step is None else step}"

    async def get_step(self) -> int:
        self.step = (await self.backend.model_info(self.name))["step"]
        return self.step

    async def log(self, trajectories: Iterable[Any] | None = None, split: str = "val", *,
                  metrics: dict[str, float] | None = None, step: int | None = None) -> dict[str, Any]:
        """ART's `model.log`: record `split`'s metrics at `step` (default: the model's step) in the server's
        history, and on W&B when reporting is on (artcloud/report.py). `trajectories`: Trajectory objects
        (exceptions count as failed rollouts) or TrajectoryGroups, summarized as ART does; `metrics` are
        merged in and win. Returns the history record."""
        from artcloud import report

        batch = report.summarize(trajectories)
        body = {"split": split, "step": step, "metrics": {**batch.metrics, **report.check_metrics(metrics)}}
        record = await self.backend.log(self.name, body)
        self._report(record, batch)
        return record

    def _report(self, record: dict[str, Any], batch: Any = None) -> None:
        from artcloud import report

        if report.wandb_enabled(self.report_metrics):
            if self._wandb is None:
                self._wandb = report.WandbReporter(self.project, self.name)
            self._wandb.report(record, batch)


class TrainableModel(Model):
    """A LoRA adapter on `base_model` that `train` updates with GRPO, one step per call."""

    def __init__(self, *, name: str, project: str, base_model: str, config: LoraConfig | None = None,
                 engine_args: dict[str, Any] | None = None, report_metrics: list[str] | None = None):
        super().__init__(name=name, project=project, base_model=base_model, engine_args=engine_args,
                         report_metrics=report_metrics)
        self.config = config or LoraConfig()
        self._annealer: LinearTemperatureAnnealer | None = None
        self._pending: asyncio.Task | None = None

    def _lora(self) -> LoraConfig:
        return self.config

    async def register(self, backend: "RemoteBackend") -> None:
        await super().register(backend)
        await self._push_temperature()

    def set_temperature_annealer(self, annealer: LinearTemperatureAnnealer | None) -> None:
        """Each `train` advances the schedule and sets the server's default sampling temperature
        (a request's own `temperature` still wins)."""
        self._annealer = annealer
        if self._backend is not None:
            try:
                self._pending = asyncio.get_running_loop().create_task(self._push_temperature())
            except RuntimeError:
                pass  # no loop: pushed at the next register/train

    async def _push_temperature(self) -> None:
        if self._annealer is not None:
            await self.backend.set_temperature(self.name, self._annealer.temperature(self.step))

    async def train(
        self,
        groups: Iterable[TrajectoryGroup],
        config: TrainConfig | None = None,
        *,
        progress: bool = True,
    ) -> TrainResult:
        """One GRPO step on `groups`; follows the job's events (with a progress bar) to its end."""
        backend = self.backend
        groups = list(groups)
        _check_groups(groups)
        config = config or TrainConfig()
        body = {
            "groups": [g.to_wire() for g in groups],
            "config": config.model_dump(),
            "idempotency_key": uuid.uuid4().hex,  # a retried POST returns this job instead of training twice
        }
        if self._pending is not None:
            await self._pending
            self._pending = None
        from artcloud.backends.remote import ServerGone

        before = self.step
        while True:
            generation = backend.generation
            try:
                job = await backend.start_train(self.name, body)
                with _Progress(self.name, config.gradient_steps, enabled=progress) as bar:
                    events = await backend.follow_job(job["job_id"], on_event=bar.update)
                break
            except ServerGone as e:
                # A preempted spot machine: the backend brings up a new one, which resumes from S3 at the last
                # committed step. The step was either committed and pushed before the machine went (then it is
                # not trained again) or lost with it (then the same groups train on the new machine).
                if not await backend.recover(e, generation):
                    raise
                info = await backend.model_info(self.name)
                if info["step"] > before:
                    self.step = info["step"]
                    log.warning("%s: step %d was pushed before the machine went; not training it again",
                                self.name, self.step)
                    await self._push_temperature()
                    history = {h.get("step"): h for h in info.get("history", [])}
                    return TrainResult(step=self.step, trained=True, metrics=history.get(self.step, {}), events=[])
                log.warning("%s: training step %d again on the new machine", self.name, before + 1)
                body["idempotency_key"] = uuid.uuid4().hex
        last = events[-1]
        if last["type"] == "error":
            from artcloud.backends.remote import ArtcloudError

            raise ArtcloudError(f"training {self.name} failed: {last['data'].get('message')}", code=last["data"].get("code", "error"))
        self.step = last["data"]["step"]
        await self._push_temperature()
        result = TrainResult(step=self.step, trained=last["data"].get("trained", False),
                             metrics=last["data"].get("metrics", {}), events=events)
        self._report_train(groups, result)
        return result

    def _report_train(self, groups: list[TrajectoryGroup], result: TrainResult) -> None:
        """A training step's history record (its metrics) to W&B, with the batch's rewards and samples."""
        from artcloud import report

        record = {"step": result.step, "split": "train", **result.metrics}
        try:
            self._report(record, report.summarize(groups))
        except Exception as e:  # the step is committed: raising now would have a retrying loop train it twice
            log.warning("%s: step %d trained, but reporting it to W&B failed: %s", self.name, result.step, e)


def _check_groups(groups: list[TrajectoryGroup]) -> None:
    if not groups:
        raise ValueError("train() got no trajectory groups: gather some first (artcloud.gather_trajectory_groups)")
    for g, group in enumerate(groups):
        if not isinstance(group, TrajectoryGroup):
            raise TypeError(f"groups[{g}] is a {type(group).__name__}, not an artcloud.TrajectoryGroup")
        if len(group.trajectories) < 2:
            raise ValueError(
                f"groups[{g}] has {len(group.trajectories)} trajectory: GRPO compares trajectories of the same "
                "prompt with each other, so a group needs at least 2"
            )
        for t, traj in enumerate(group.trajectories):
            choices = [m for m in traj.messages_and_choices if _is_choice(m)]
            if not choices:
                raise ValueError(f"groups[{g}].trajectories[{t}] has no turn sampled by the model: append the "
                                 "Choice objects returned by model.openai_client() to messages_and_choices")
            for c in choices:
                logprobs = c.get("logprobs") if isinstance(c, dict) else getattr(c, "logprobs", None)
                content = logprobs.get("content") if isinstance(logprobs, dict) else getattr(logprobs, "content", None)
                if not content:
                    raise ValueError(f"groups[{g}].trajectories[{t}] has a choice without logprobs: request "
                                     "completions with logprobs=True so training can use the sampling policy's logprobs")


def _is_choice(item: Any) -> bool:
    return ("message" in item) if isinstance(item, dict) else hasattr(item, "message")


class _Progress:
    """A rich progress bar over a job's gradient steps, with the latest loss."""

    def __init__(self, name: str, total: int, enabled: bool):
        self.enabled = enabled
        self.name = name
        self.total = total
        self._progress = None
        self._task = None

    def __enter__(self) -> "_Progress":
        if self.enabled:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self._progress = Progress(TextColumn("[bold]train {task.fields[name]}"), BarColumn(), MofNCompleteColumn(),
                                      TextColumn("{task.fields[status]}"), TimeElapsedColumn(), transient=True)
            self._progress.start()
            self._task = self._progress.add_task("train", total=self.total, name=self.name, status="queued")
        return self

    def update(self, event: dict[str, Any]) -> None:
        if self._progress is None:
            return
        data = event["data"]
        if event["type"] == "start":
            self._progress.update(self._task, status=f"{data.get('samples', 0)} samples, reward {data.get('reward_mean', 0):.3f}")
        elif event["type"] == "step":
            self._progress.update(self._task, completed=data["gradient_step"], total=data["gradient_steps"],
                                  status=f"loss {data['loss']:.4f}, grad norm {data['grad_norm']:.3f}")

    def __exit__(self, *exc: Any) -> None:
        if self._progress is not None:
            self._progress.stop()

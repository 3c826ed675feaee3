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
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Generic, Iterable, Mapping, TypeVar

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator

from artcloud.art_options import apply_art_options, internal_config
from artcloud.errors import ArtcloudError, InvalidArgument, NotInArtcloud, NotSupported, WrongState, WrongType
from artcloud.progress import JobProgress, record_numbers
from artcloud.types import LoraConfig, TrainConfig, TrainResult, TrainSFTConfig, TrajectoryGroup, is_choice

if TYPE_CHECKING:
    from artcloud.backends.remote import RemoteBackend

log = logging.getLogger("artcloud")


class NotRegistered(WrongState):
    """A model used before `await model.register(backend)` (or without an endpoint)."""

    code = "not_registered"


@dataclass
class LinearTemperatureAnnealer:
    """Sampling temperature from `start` to `end` over `steps` training steps, then `end`."""

    start: float
    end: float
    steps: int

    def __post_init__(self) -> None:
        if self.steps < 1 or self.start < 0 or self.end < 0:
            raise InvalidArgument("LinearTemperatureAnnealer needs steps >= 1 and temperatures >= 0")

    def temperature(self, step: int) -> float:
        frac = min(max(step, 0), self.steps) / self.steps
        return self.start + (self.end - self.start) * frac


# The user's own config type: `Model[MyConfig]` types and validates `config` as one; a bare `Model` takes any object.
ModelConfig = TypeVar("ModelConfig")

# What binds a model object to a server: a copy never shares it (it registers on its own).
_BOUND = ("_backend", "_external_client", "_wandb", "_pending")


class Model(BaseModel, Generic[ModelConfig]):
    """A model to sample from: served by a backend (for inference only, no `train`), or a prompted model
    at any OpenAI-compatible endpoint, as ART allows (a baseline to compare against):

        artcloud.Model(name="gpt-4.1", project="p", inference_base_url="https://api.openai.com/v1",
                       inference_api_key=os.environ["OPENAI_API_KEY"])

    With `base_model`, `register(backend)` serves it as an adapter that is never trained, so it answers
    exactly as its base model does, under its own name. Without, `register` gives it a history on the server
    (as ART's backend keeps one), which `log` adds to. `config` is the user's own object, kept as
    `model.config` and never sent to a server.

    As in ART, a pydantic model generic in its config: `Model[MyConfig]` types (and validates) `config`,
    `model_copy(deep=True)` makes a variant to change (a copy is not registered: register it too), and
    `model_dump()` gives the fields. The inference key and the backend are no fields: never in a dump or a repr.
    """

    model_config = ConfigDict(arbitrary_types_allowed=True, extra="forbid")
    trainable: ClassVar[bool] = False

    name: str
    project: str
    config: ModelConfig | None = None
    base_model: str | None = None
    # The name a plain OpenAI client asks for (a served model's: its own name, the newest step).
    inference_model_name: str | None = None
    # vLLM settings for base_model on a GPU server (max_model_len, gpu_memory_utilization, load_in_4bit...),
    # used when the server first loads it; the backend's engine_args are the defaults under them. The CPU
    # engine takes those it can honour (server/engines/choose.py).
    engine_args: dict[str, Any] | None = None
    entity: str | None = None
    id: str | None = None
    report_metrics: list[str] | None = None  # ["wandb"]; None: W&B if WANDB_API_KEY
    step: int = 0  # the newest step this object knows of
    # OpenPipe ART's: kept, not used. Checkpoints, history and state live where the backend's server keeps them
    # (LocalBackend(path=...)); a W&B run is named after the model.
    base_path: str = ".art"
    run_id: str | None = None

    # A prompted model's endpoint (ART's fields; properties here, since a served model's are the backend's).
    _inference_base_url: str | None = PrivateAttr(None)
    _inference_api_key: str | None = PrivateAttr(None)
    _backend: Any = PrivateAttr(None)  # RemoteBackend
    _external_client: Any = PrivateAttr(None)
    _wandb: Any = PrivateAttr(None)  # report.WandbReporter
    _wandb_config: dict[str, Any] = PrivateAttr(default_factory=dict)  # update_wandb_config's, for the W&B run

    def __init__(self, *, name: str, project: str, base_model: str | None = None, config: ModelConfig | None = None,
                 inference_model_name: str | None = None, inference_base_url: str | None = None,
                 inference_api_key: str | None = None, engine_args: dict[str, Any] | None = None,
                 entity: str | None = None, id: str | None = None, report_metrics: list[str] | None = None,
                 **fields: Any):
        from artcloud import report

        # Checked here, not by a validator: pydantic would wrap artcloud's one-line error in a ValidationError.
        report_metrics = report.check_reporting(report_metrics)
        # `fields`: the rest of a dump (pydantic's model_validate calls this __init__); unknown names are refused.
        super().__init__(name=name, project=project, base_model=base_model, config=config,
                         inference_model_name=inference_model_name, engine_args=engine_args, entity=entity, id=id,
                         report_metrics=report_metrics, **fields)
        self._inference_base_url = inference_base_url
        self._inference_api_key = inference_api_key

    @field_validator("engine_args")
    @classmethod
    def _no_empty_engine_args(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        return value or None

    def __copy__(self) -> "Model":
        copy = super().__copy__()
        for name in _BOUND:
            if name in copy.__pydantic_private__:
                copy.__pydantic_private__[name] = None
        return copy

    def __deepcopy__(self, memo: dict[int, Any] | None = None) -> "Model":
        # deepcopy returns what its memo holds for an object already seen: None for these, so the copy is
        # unbound (and a backend's sockets, locks and SSL contexts are never copied).
        memo = {} if memo is None else memo
        for name in _BOUND:
            value = (self.__pydantic_private__ or {}).get(name)
            if value is not None:
                memo[id(value)] = None
        return super().__deepcopy__(memo)

    @property
    def backend(self) -> "RemoteBackend":
        if self._backend is None:
            raise NotRegistered(f"{self.name} is not registered: call `await model.register(backend)` first")
        return self._backend

    @property
    def _served(self) -> bool:
        return self._backend is not None and self.base_model is not None

    @property
    def litellm_completion_params(self) -> dict[str, Any]:
        """ART's LiteLLM settings for this model: artcloud does not use LiteLLM. (An AttributeError, so
        `hasattr` says False and `inspect.getmembers` passes over it.)"""
        raise NotInArtcloud("model.litellm_completion_params is OpenPipe ART's (LiteLLM settings): use "
                           "model.openai_client(), or AsyncOpenAI(base_url=model.inference_base_url, "
                           "api_key=model.inference_api_key)")

    @property
    def inference_base_url(self) -> str | None:
        """The URL a plain OpenAI client takes (ART's rollouts build their own). For a served model, reading
        it starts the backend's loopback endpoint (one per backend, closed by `backend.close()`/`down()`)."""
        return self.backend.inference_endpoint()[0] if self._served else self._inference_base_url

    @inference_base_url.setter
    def inference_base_url(self, value: str | None) -> None:
        self._inference_base_url = value
        self._external_client = None  # made again for the new endpoint

    @property
    def inference_api_key(self) -> str | None:
        """The key for `inference_base_url`: for a served model, the loopback endpoint's own (never the
        server's token)."""
        return self.backend.inference_endpoint()[1] if self._served else self._inference_api_key

    @inference_api_key.setter
    def inference_api_key(self, value: str | None) -> None:
        self._inference_api_key = value
        self._external_client = None

    async def register(self, backend: "RemoteBackend", _openai_client_config: Mapping[str, Any] | None = None) -> None:
        """Serve this model on `backend` (with `base_model`). A prompted model (no `base_model`) gets a
        history there, for `log`, as ART's backend keeps one; it is still sampled at its own endpoint.
        `_openai_client_config` (ART's art.dev.OpenAIServerConfig: its vLLM server's settings) is accepted empty:
        artcloud's server is its own."""
        if _openai_client_config:
            # Its keys only: its server_args may hold an api_key.
            raise NotSupported(f"register(_openai_client_config with {', '.join(map(str, _openai_client_config))}) "
                               "configures OpenPipe "
                               "ART's vLLM server; artcloud serves through its own: give vLLM's settings as "
                               "engine_args= on the model", field="_openai_client_config")
        lora = self._lora().model_dump() if self.base_model is not None else {}
        info = await backend.register(self.name, self.project, self.base_model, lora, engine_args=self.engine_args)
        for note in (info.model_extra or {}).get("warnings") or []:  # e.g. GPU settings a CPU engine goes without
            warnings.warn(f"{self.name}: {note}", UserWarning, stacklevel=2)
        self.step = info.step
        if self.base_model is not None:
            self.inference_model_name = self.name  # the bare name is always the newest step
        self._backend = backend

    def _lora(self) -> LoraConfig:
        return LoraConfig()

    def openai_client(self, **kwargs: Any):
        """`openai.AsyncOpenAI` for this model. A served model's talks to the backend's server directly
        (its CA and token; nothing else trusted) and follows a replaced server; ask it for
        `model=model.name` (the latest step). Every choice comes with the logprobs training needs (unless
        a request says `logprobs=False`). A prompted model's talks to `inference_base_url` with
        `inference_api_key`. (A client of your own, `AsyncOpenAI(base_url=model.inference_base_url,
        api_key=model.inference_api_key)`, works too, through the backend's loopback forwarder.)"""
        if self._served:
            return self.backend.openai_client(**kwargs)
        if self.inference_base_url is None:
            raise NotRegistered(f"{self.name} has no endpoint: give it base_model= and `await model.register(backend)`, "
                                "or inference_base_url= (and inference_api_key=) for a model served elsewhere")
        import openai

        if kwargs:
            return openai.AsyncOpenAI(base_url=self.inference_base_url, api_key=self.inference_api_key or "none", **kwargs)
        if self._external_client is None:
            self._external_client = openai.AsyncOpenAI(base_url=self.inference_base_url,
                                                       api_key=self.inference_api_key or "none")
        return self._external_client

    def inference_name(self, step: int | None = None) -> str:
        """`NAME@STEP` for `step`, or for the latest step this object knows of."""
        return f"{self.name}@{self.step if step is None else step}"

    def get_inference_name(self, step: int | None = None) -> str:
        """ART's name for a request's `model`: `NAME@STEP` for `step`, else the bare name, which the
        server resolves to the newest step (so it never goes stale between steps)."""
        base = self.inference_model_name or self.name
        return base if step is None else f"{base}@{step}"

    async def get_step(self) -> int:
        if not self._served:
            return self.step
        self.step = (await self.backend.model_info(self.name)).step
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
        record = (await self.backend.log(self.name, body)).model_dump()
        self._report(record, batch)
        return record

    def _report(self, record: dict[str, Any], batch: Any = None) -> None:
        from artcloud import report

        if report.wandb_enabled(self.report_metrics):
            if self._wandb is None:
                self._wandb = report.WandbReporter(self.project, self.name, self._wandb_config)
            self._wandb.report(record, batch)

    def update_wandb_config(self, config: dict[str, Any]) -> None:
        """ART's: merge `config` into this model's W&B run config, given to the run when it starts (the first
        report) or at once if it runs. A key already set to another value is an InvalidArgument (W&B keeps a run's
        config), naming it."""
        from artcloud import report

        if not isinstance(config, dict):
            raise WrongType(f"update_wandb_config takes a dict, not {type(config).__name__}", field="config")
        merged = report.merge_config(self._wandb_config, config)
        self._wandb_config.clear()
        self._wandb_config.update(merged)  # the same dict the reporter holds
        if self._wandb is not None:
            self._wandb.update_config(config)

    # ------------------------------------------------------------------------------------- state

    def read_state(self) -> dict[str, Any] | None:
        """ART's persistent state of this model (a dataset position, say), or None if none was written. It lives
        on the server beside the checkpoints: committed with each step, pushed to S3 with it, and back on a new
        server (a spot replacement too) with the step it belongs to. A blocking call (as ART's file read is)."""
        return self.backend.model_state(self.name).state

    def overwrite_state(self, state: dict[str, Any]) -> None:
        """Replace the model's state (a JSON object) with `state`; it is on the server when this returns."""
        self.backend.model_state(self.name, {"state": _json_object(state)})

    def merge_state(self, state: dict[str, Any]) -> dict[str, Any]:
        """Deep-merge `state` into the model's state (nested dicts key by key, anything else replaced) on the
        server, and return the merged state."""
        return self.backend.model_state(self.name, {"state": _json_object(state), "merge": True}).state or {}

    def write_state(self, state: dict[str, Any]) -> None:
        """Deprecated in ART: use overwrite_state() or merge_state()."""
        warnings.warn("write_state() is deprecated. Use overwrite_state() or merge_state() instead.",
                      DeprecationWarning, stacklevel=2)
        self.overwrite_state(state)


class TrainableModel(Model[ModelConfig], Generic[ModelConfig]):
    """A LoRA adapter on `base_model` that `train` updates with GRPO, one step per call.

    `lora` is the adapter's shape (fixed at registration). `config` is the user's own object, as in ART:
    kept as `model.config`, never sent. (A LoraConfig given as `config` is still taken as `lora`, with a
    DeprecationWarning.)
    """

    trainable: ClassVar[bool] = True

    base_model: str
    lora: LoraConfig = Field(default_factory=LoraConfig)

    _annealer: LinearTemperatureAnnealer | None = PrivateAttr(None)
    _pending: asyncio.Task | None = PrivateAttr(None)
    # TrainConfig fields for every step, from _internal_config's trainer_args: a step's own settings win.
    _train_defaults: dict[str, Any] = PrivateAttr(default_factory=dict)

    def __init__(self, *, name: str, project: str, base_model: str, config: ModelConfig | None = None,
                 lora: LoraConfig | None = None, engine_args: dict[str, Any] | None = None,
                 entity: str | None = None, id: str | None = None, report_metrics: list[str] | None = None,
                 _internal_config: Any = None, **fields: Any):
        internal = internal_config(_internal_config) if _internal_config is not None else None
        if internal is not None:  # ART's art.dev.InternalModelConfig: artcloud's engine_args, lora, step defaults
            clash = sorted(set(internal.engine_args) & set(engine_args or {}))
            if clash or (internal.lora and lora is not None):
                raise InvalidArgument(f"TrainableModel got {'engine_args ' + ', '.join(clash) if clash else 'a LoRA'} both "
                                      "in _internal_config and as its own argument: pass it once", field="_internal_config")
            engine_args = {**internal.engine_args, **(engine_args or {})} or None
            if internal.lora:
                lora = LoraConfig(**internal.lora)
        if isinstance(config, LoraConfig):
            if lora is not None:
                raise InvalidArgument("TrainableModel got a LoraConfig both as config= and lora=: pass it as lora= only",
                                      field="config")
            warnings.warn("TrainableModel(config=LoraConfig(...)) is deprecated: pass lora=LoraConfig(...); "
                          "config= is your own object, as in ART", DeprecationWarning, stacklevel=2)
            lora = config
        if lora is not None and not isinstance(lora, (LoraConfig, Mapping)):  # a dict: a dump's, validated
            raise WrongType(f"lora must be an artcloud.LoraConfig, not {type(lora).__name__}", field="lora")
        super().__init__(name=name, project=project, base_model=base_model, config=config, engine_args=engine_args,
                         entity=entity, id=id, report_metrics=report_metrics, lora=lora or LoraConfig(), **fields)
        self._train_defaults = internal.train_defaults if internal is not None else {}

    def _lora(self) -> LoraConfig:
        return self.lora

    async def register(self, backend: "RemoteBackend", _openai_client_config: Mapping[str, Any] | None = None) -> None:
        await super().register(backend, _openai_client_config)
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

    async def delete_checkpoints(self, best_checkpoint_metric: str = "val/reward") -> dict[str, Any]:
        """Delete every checkpoint on the server but the latest and the best by `best_checkpoint_metric`
        (a key of the model's history, averaged per step; highest is best), as ART does. Returns the
        steps kept and deleted. A metric that no step has keeps the latest step alone, with a warning (as ART).
        Copies already on S3 stay (S3's own retention: `--keep-last`)."""
        answer = await self.backend.delete_checkpoints(self.name, best_checkpoint_metric)
        if answer.note:  # a metric nothing logged (ART's default val/reward without model.log(..., "val"))
            log.warning("%s", answer.note)
        return answer.model_dump()

    async def _train_on(self, backend: RemoteBackend, groups: Iterable[TrajectoryGroup], config: TrainConfig | None,
                        options: Mapping[str, Any], *, verbose: bool, progress: bool) -> TrainResult:
        """ART's `backend.train(model, groups, **options)` (RemoteBackend.train hands it here)."""
        if self._backend is not backend:
            raise InvalidArgument(f"{self.name} is not registered on this backend: `await model.register(backend)` first",
                                  field="model")
        config, save_checkpoint = apply_art_options(self._defaults(config), options, where="backend.train")
        return await self._train(groups, config, save_checkpoint, verbose=verbose, progress=progress)

    async def train(
        self,
        groups: Iterable[TrajectoryGroup],
        config: TrainConfig | None = None,
        _config: Mapping[str, Any] | None = None,
        verbose: bool = False,
        *,
        progress: bool = True,
    ) -> TrainResult:
        """One GRPO step on `groups`; follows the job's events (with a progress bar) to its end.

        `_config`: ART's experimental `art.dev.TrainConfig` keys (and LocalBackend.train's keywords): TrainConfig
        takes them under ART's names; the few it has no counterpart for only at ART's defaults (else one line
        says so). `verbose` prints each training event as a line besides the bar."""
        config, save_checkpoint = apply_art_options(self._defaults(config), _config or {}, where="_config")
        return await self._train(groups, config, save_checkpoint, verbose=verbose, progress=progress)

    async def train_sft(self, trajectories: Iterable[Any], config: TrainSFTConfig | None = None,
                        _config: Mapping[str, Any] | None = None, verbose: bool = False, *,
                        progress: bool = True) -> TrainResult:
        """Supervised fine-tuning, as OpenPipe ART's `model.train_sft`: cross-entropy on the assistant's tokens of
        each trajectory (tool calls included; system, user and tool messages are context), `config.batch_size`
        trajectories per optimizer step, each batch at its learning rate (one, or a list with one per batch). One
        call is one training step (NAME@STEP -> NAME@STEP+1), committed, pushed and resumed as an RL step is. The
        trajectories are read as they are sent: a generator over a file of any size is never held whole
        (artcloud.utils.sft.train_sft_from_file). `_config`: ART's art.dev.TrainSFTConfig, which has no keys."""
        from artcloud.supervised import train_sft

        if _config:
            raise InvalidArgument(f"train_sft(_config=...): art.dev.TrainSFTConfig has no keys artcloud takes, not "
                                  f"{sorted(_config)}", field="_config")
        if config is not None and not isinstance(config, TrainSFTConfig):
            raise WrongType(f"train_sft's config is an artcloud.TrainSFTConfig, not {type(config).__name__}",
                            field="config")
        if self._pending is not None:
            await self._pending
            self._pending = None
        result = await train_sft(self, trajectories, config or TrainSFTConfig(), verbose=verbose, progress=progress)
        await self._push_temperature()
        self._report_train([], result)
        return result

    def _defaults(self, config: TrainConfig | None) -> TrainConfig:
        """`config` (or the defaults), with _internal_config's trainer_args where it did not set the field itself."""
        config = config or TrainConfig()
        unset = {k: v for k, v in self._train_defaults.items() if k not in config.model_fields_set}
        return config.model_copy(update=unset) if unset else config

    async def _train(self, groups: Iterable[TrajectoryGroup], config: TrainConfig, save_checkpoint: bool, *,
                     verbose: bool, progress: bool) -> TrainResult:
        backend = self.backend
        groups = list(groups)
        _check_groups(groups)
        body = {
            "groups": [g.to_wire() for g in groups],
            "config": config.model_dump(),
            "idempotency_key": uuid.uuid4().hex,  # a retried POST returns this job instead of training twice
        }
        if self._pending is not None:
            await self._pending
            self._pending = None
        from artcloud.backends.client import ServerGone

        before = self.step
        while True:
            generation = backend.generation
            try:
                job = await backend.start_train(self.name, body)
                with JobProgress(self.name, config.gradient_steps, enabled=progress, verbose=verbose) as bar:
                    events = await backend.follow_job(job.job_id, on_event=bar.update)
                break
            except ServerGone as e:
                # A preempted spot machine: the backend brings up a new one, which resumes from S3 at the last
                # pushed step and trains again the earlier steps S3 did not get (RemoteBackend.note_trained). This
                # step was either committed and pushed before the machine went (then it is not trained again) or
                # lost with it (then the same groups train on the new machine).
                if not await backend.recover(e, generation):
                    raise
                info = await backend.model_info(self.name)
                if info.step > before:
                    self.step = info.step
                    log.warning("%s: step %d was pushed before the machine went; not training it again",
                                self.name, self.step)
                    await self._push_temperature()
                    history = {h.get("step"): h for h in info.history if h.get("source") == "train"}
                    result = TrainResult(step=self.step, trained=True, metrics=record_numbers(history.get(self.step, {})),
                                         events=[])
                    self._report_train(groups, result)  # the step's record, as if it had been followed to its end
                    return result
                log.warning("%s: training step %d again on the new machine", self.name, before + 1)
                body["idempotency_key"] = uuid.uuid4().hex
        last = events[-1].data
        if events[-1].type == "error":
            raise ArtcloudError(f"training {self.name} failed: {last.get('message')}", code=last.get("code", "error"))
        self.step = last["step"]
        result = TrainResult(step=self.step, trained=last.get("trained", False), metrics=record_numbers(last.get("metrics", {})),
                             events=[e.model_dump() for e in events],
                             checkpoint_path=last.get("checkpoint") if save_checkpoint else None)
        if result.trained:  # kept until S3 has it: a machine lost before its push trains it again on the next
            backend.note_trained(self.name, self.step, body, last.get("s3"))
        await self._push_temperature()
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


# ------------------------------------------------------------------------------------- helpers


def _json_object(state: Any) -> dict[str, Any]:
    """`state` checked to be what ART's state.json holds: a JSON object (WrongType naming what is not)."""
    import json

    if not isinstance(state, dict):
        raise WrongType(f"a model's state is a dict (a JSON object), not {type(state).__name__}", field="state")
    try:
        json.dumps(state, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise WrongType(f"a model's state must be JSON: {e}", field="state") from None
    return state


def _check_groups(groups: list[TrajectoryGroup]) -> None:
    if not groups:
        raise InvalidArgument("train() got no trajectory groups: gather some first (artcloud.gather_trajectory_groups)")
    for g, group in enumerate(groups):
        if not isinstance(group, TrajectoryGroup):
            raise WrongType(f"groups[{g}] is a {type(group).__name__}, not an artcloud.TrajectoryGroup")
        if len(group.trajectories) < 2:
            raise InvalidArgument(
                f"groups[{g}] has {len(group.trajectories)} trajectory: GRPO compares trajectories of the same "
                "prompt with each other, so a group needs at least 2"
            )
        for t, traj in enumerate(group.trajectories):
            histories = [traj.messages_and_choices, *(h.messages_and_choices for h in traj.additional_histories)]
            choices = [m for history in histories for m in history if is_choice(m)]
            if not choices:
                raise InvalidArgument(f"groups[{g}].trajectories[{t}] has no turn sampled by the model: append the "
                                      "Choice objects returned by the model's OpenAI client to messages_and_choices")
            for c in choices:
                logprobs = c.get("logprobs") if isinstance(c, dict) else getattr(c, "logprobs", None)
                content = logprobs.get("content") if isinstance(logprobs, dict) else getattr(logprobs, "content", None)
                if not content:
                    raise InvalidArgument(f"groups[{g}].trajectories[{t}] has a choice without logprobs (sampled with "
                                          "logprobs=False?): leave logprobs out or set it True, so training can use "
                                          "the sampling policy's logprobs")

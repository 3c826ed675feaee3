"""The types a user touches: trajectories, groups, and the knobs of training.

These are plain pydantic models, shared by the laptop SDK and the server; nothing heavy is imported here.
OpenPipe ART's names work here too (`beta`, `Trajectory.messages()`, `additional_histories`, iterating a
group, `await TrajectoryGroup(rollouts)`), so an ART script runs with only its import changed.
A group runs its own rollouts (resolve_group, at the end); gather.py, which runs many groups, imports this
module and counts what they do through `current_tally`.
"""

from __future__ import annotations

import asyncio
import inspect
import math
import time
import traceback
import typing
from contextlib import asynccontextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from datetime import datetime
from typing import Annotated, Any, AsyncIterator, Generator, Iterable, Iterator, Literal, Protocol

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, PrivateAttr

from artcloud.errors import InvalidArgument, NotSupported, WrongState, WrongType

DEFAULT_LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _finite(v: float) -> float:
    if not math.isfinite(v):
        raise InvalidArgument("must be a finite number, not NaN or infinity")
    return v


# JSON from Python may carry NaN and Infinity; a reward never may.
FiniteFloat = Annotated[float, AfterValidator(_finite)]
# A random seed: torch takes 64 bits (a larger one raises inside the engine, failing the whole batch).
# lt, not le=2**63 - 1: the OpenAPI schema holds its bounds as floats, and only 2**63 is one exactly.
Seed = Annotated[int, Field(ge=-(2**63), lt=2**63)]
# What ART allows in metadata: anything JSON can hold.
MetadataValue = Any
MetricValue = float | int | bool
# ART's aliases for annotations (`messages: art.Messages`): OpenAI message dicts, those and Choices, tool specs.
Message = dict[str, Any]
Messages = list[Message]
MessagesAndChoices = list[Any]
Tools = list[dict[str, Any]]


class LoraConfig(BaseModel):
    """The LoRA adapter that training updates. Fixed at registration: a model keeps its adapter shape."""

    model_config = ConfigDict(extra="forbid")

    rank: int = Field(8, ge=1, le=512)
    alpha: float = Field(16.0, gt=0)
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    target_modules: list[str] = Field(default_factory=lambda: list(DEFAULT_LORA_TARGETS), min_length=1)
    # Seed of the adapter's random init (LoRA A; B starts at 0): the same settings give the same adapter.
    init_seed: Seed = 0


# OpenPipe ART's names for TrainConfig's fields (art.TrainConfig, LocalBackend.train's keywords, art.dev.TrainConfig).
_ART_ALIASES = {"beta": "kl_coef", "epsilon": "clip_epsilon", "epsilon_high": "clip_epsilon_high", "loss_fn": "loss"}
# ART knobs artcloud has no counterpart for: ART's default (accepted, as None is: artcloud trains as ART does
# at it), and what to write instead of any other value.
_ART_UNSUPPORTED: dict[str, tuple[Any, str]] = {
    "kl_penalty_source": ("current_learner", "the KL reference is the base model, or kl_penalty_reference_step / "
                                             "kl_ref_adapter_path"),
    "kl_penalty_step_lag": (None, "name the reference step itself with kl_penalty_reference_step"),
    "grad_accumulation_sequences": (None, "artcloud sizes its micro-batches itself; for several optimizer steps per "
                                          "train() call set gradient_steps"),
    "final_training_step": (None, "stop calling train() instead"),
    "allow_training_without_logprobs": (False, "leave logprobs out of completion requests (they come by default)"),
    "precalculate_logprobs": (False, "artcloud always trains on the logprobs the choices were sampled with"),
    "plot_tensors": (False, "leave it out (the step's metrics are in the history and on W&B)"),
    "loss_fn_config": (None, "the losses take no config here: set epsilon / epsilon_high and the other keywords"),
    "moe_routing_replay_bundle": (None, "artcloud trains dense models only"),
    "moe_routing_replay_path": (None, "artcloud trains dense models only"),
}
# ART knobs that change only speed or memory on ART's engine: accepted, no effect (artcloud saves the optimizer
# with every checkpoint, and sizes and packs its batches itself).
_ART_MET = {"optimizer_save_interval", "logprob_calculation_chunk_size", "packed_sequence_length",
            "moe_routing_replay_strict"}  # (how strictly a MoE routing replay is followed: there is none here)
ImportanceSamplingLevel = Literal["token", "sequence", "average", "geometric_average"]


class TrainConfig(BaseModel):
    """How one training step turns trajectory groups into an adapter update.

    One `train` call is one step (the served name moves from NAME@STEP to NAME@STEP+1); it may take
    several gradient steps (`gradient_steps` minibatches over the groups), each reported as an event.
    The defaults are OpenPipe ART 0.5.18's (`LocalBackend.train`): CISPO, clipped at 1 - 1.0 and 1 + 4.0, learning
    rate 5e-6. ART's names are accepted in the constructor (`beta` for `kl_coef`, `epsilon`, `loss_fn`,
    `normalize_advantages`...); what goes over the wire (`model_dump()`) is always artcloud's names. The loss and
    every knob are in artcloud/train/grpo.py, the learning-rate scalings in artcloud/train/loop.py.
    """

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)  # NaN or inf anywhere: a 4xx naming the field

    # ART's default: larger rates quickly wreck a LoRA on an instruct model under RL.
    learning_rate: float = Field(5e-6, gt=0.0, le=1.0)
    loss: Literal["ppo", "cispo"] = "cispo"
    # The importance ratio's clip range [1 - clip_epsilon, 1 + clip_epsilon_high]. None: ART's default for the
    # loss (CISPO 1.0 and 4.0; PPO 0.2 and clip_epsilon): see clip_bounds().
    clip_epsilon: float | None = Field(None, gt=0.0, le=10.0)
    clip_epsilon_high: float | None = Field(None, gt=0.0, le=10.0)
    # "token": a ratio per token; "sequence": one per trajectory (the mean log-ratio of its sampled tokens, as
    # GSPO); "average" / "geometric_average": the arithmetic / geometric mean of the two.
    importance_sampling_level: ImportanceSamplingLevel = "token"
    # ART's per-token KL penalty folded into the advantages: tokens that diverge more from the reference than
    # the step's average lose advantage, those that diverge less gain (art/loss.py).
    kl_penalty_coef: float = Field(0.0, ge=0.0)
    # The KL reference (kl_penalty_coef and kl_coef): None, the base model; else this model's checkpoint at this
    # step, or a checkpoint folder on the server (a TrainResult.checkpoint_path of a model on the same base).
    kl_penalty_reference_step: int | None = Field(None, ge=0)
    kl_ref_adapter_path: str | None = Field(None, min_length=1, max_length=4096)
    # k3 estimator of KL(policy || reference) added to the loss (ART's older `beta`); 0 skips it.
    kl_coef: float = Field(0.0, ge=0.0)
    # > 0 scales negative advantages by 1 - b (at 1 only positive ones train), < 0 positive ones by 1 + b; the
    # step's mean |advantage| per token is kept.
    advantage_balance: float = Field(0.0, ge=-1.0, le=1.0)
    # Ratios outside the clip range count 0 (no gradient, no weight) instead of being clipped.
    mask_prob_ratio: bool = False
    # An upper bound on the importance ratio, applied before the loss (ART applies it to every token).
    max_negative_advantage_importance_sampling_weight: float | None = Field(None, gt=0.0)
    # Each token's loss times min(ratio, this) (no gradient through the factor): truncated importance sampling.
    truncated_importance_sampling: float | None = Field(None, gt=0.0)
    # Kimi K2's term: each token's advantage minus tau x its log-ratio (no gradient through it).
    kimi_k2_tau: float | None = None
    # The step's learning rate times (the fitted trend of the history's within-group reward std at this step)
    # / (its value at the first step): the rate falls as the groups' rewards converge.
    scale_learning_rate_by_reward_std_dev: bool = False
    # The learning rate times (trajectories in the gradient step) ** this power.
    num_trajectories_learning_rate_multiplier_power: float = Field(0.0, ge=-4.0, le=4.0)
    # ART's LocalBackend RL step: gradients clipped at 0.1 (art/dev/get_model_config.py's trainer_args) and AdamW's
    # weight decay 0.1 (art/unsloth/train.py sets it on every RL step). None: no clipping.
    max_grad_norm: float | None = Field(0.1, gt=0.0)
    gradient_steps: int = Field(1, ge=1, le=64)
    weight_decay: float = Field(0.1, ge=0.0)
    # AdamW's betas and epsilon (ART's adam_params, Tinker's AdamParams, set them too).
    adam_beta1: float = Field(0.9, ge=0.0, lt=1.0)
    adam_beta2: float = Field(0.99, ge=0.0, lt=1.0)
    adam_epsilon: float = Field(1e-8, gt=0.0, le=1.0)
    # Divide advantages by the group's reward std (GRPO); False keeps only the mean baseline (Dr. GRPO).
    scale_rewards: bool = True

    def __init__(self, **data: Any):
        super().__init__(**_from_art_names(data))

    @property
    def beta(self) -> float:
        """ART's older name for `kl_coef`."""
        return self.kl_coef

    @beta.setter
    def beta(self, value: float) -> None:
        self.kl_coef = value

    def clip_bounds(self) -> tuple[float, float]:
        """(epsilon, epsilon_high): the ratio is clipped to [1 - epsilon, 1 + epsilon_high]. ART's defaults for
        what is unset: CISPO 1.0 and 4.0, PPO 0.2 and epsilon (art/loss.py)."""
        ppo = self.loss == "ppo"
        low = self.clip_epsilon if self.clip_epsilon is not None else (0.2 if ppo else 1.0)
        high = self.clip_epsilon_high if self.clip_epsilon_high is not None else (low if ppo else 4.0)
        return low, high

    @property
    def kl_reference(self) -> bool:
        """The step needs the reference policy's logprobs."""
        return self.kl_coef > 0 or self.kl_penalty_coef > 0


def _adam_params(value: Any) -> dict[str, Any]:
    """ART's adam_params (Tinker's AdamParams, or a dict with its keys) as TrainConfig fields."""
    if value is None:
        return {}
    get = value.get if isinstance(value, dict) else (lambda k, d=None: getattr(value, k, d))
    names = {"learning_rate": "learning_rate", "beta1": "adam_beta1", "beta2": "adam_beta2", "eps": "adam_epsilon",
             "weight_decay": "weight_decay"}
    unknown = set(value) - set(names) if isinstance(value, dict) else set()
    if unknown:
        raise InvalidArgument(f"adam_params has no key {sorted(unknown)[0]!r}: it takes {', '.join(names)}",
                              field="adam_params")
    return {ours: get(theirs) for theirs, ours in names.items() if get(theirs) is not None}


def _admits_none(field: Any) -> bool:
    return type(None) in typing.get_args(field.annotation)


def _from_art_names(data: dict[str, Any]) -> dict[str, Any]:
    """`data` with ART's names turned into artcloud's; one line naming the fix for any other name."""
    out: dict[str, Any] = {}
    for key, value in data.items():
        if key in TrainConfig.model_fields:
            # ART's None is "the default" for a field that has no None of its own; where None is a value
            # (max_grad_norm=None: no clipping) it is kept.
            if value is not None or _admits_none(TrainConfig.model_fields[key]):
                out[key] = value
        elif key in _ART_ALIASES:
            if value is not None:  # ART passes None for "the default"
                out[_ART_ALIASES[key]] = value
        elif key == "ppo":  # ART's dev config: ppo=True is loss_fn="ppo", False its default, CISPO
            if value is not None:
                out.setdefault("loss", "ppo" if value else "cispo")
        elif key == "normalize_advantages":  # ART: False centres the rewards without dividing by their std
            if value is False:
                out["scale_rewards"] = False
        elif key == "adam_params":
            out.update(_adam_params(value))
        elif key in _ART_UNSUPPORTED:
            neutral, instead = _ART_UNSUPPORTED[key]
            if value is not None and value != neutral:
                raise NotSupported(f"TrainConfig({key}={value!r}) is OpenPipe ART's and artcloud has no counterpart: "
                                   f"{instead}", field=key)
        elif key not in _ART_MET:
            raise _no_field(TrainConfig, key, also=_ART_ALIASES)
    for alias, name in _ART_ALIASES.items():
        if alias in data and name in data and data[alias] is not None:
            raise InvalidArgument(f"TrainConfig got both {alias!r} and {name!r}, which are the same setting: pass one",
                                  field=alias)
    return out


@dataclass
class TrainResult:
    """What one training step did (`model.train`, `backend.train`). Unpacks like ART's result: `step, metrics,
    checkpoint_path = result`. It is ART's LocalTrainResult too (its checkpoint_path)."""

    # ART's fields first, in its order: LocalTrainResult(step, metrics, checkpoint_path) builds the same result.
    step: int  # the model's step after this call (NAME@step is served now)
    metrics: dict[str, Any] = field(default_factory=dict)
    # The step's checkpoint folder on the SERVER's disk (for LocalBackend a folder on this machine; for
    # SkyBackend and ModalBackend one on the sandbox). With S3 the same step is pushed under the model's
    # prefix: `artcloud.pull_checkpoint` fetches it. None when the server did not say (a resumed step).
    checkpoint_path: str | None = None
    trained: bool = True  # False when every group had equal rewards (nothing to learn)
    events: list[dict[str, Any]] = field(default_factory=list, repr=False)

    def __iter__(self) -> Iterator[Any]:
        return iter((self.step, self.metrics, self.checkpoint_path))


# OpenPipe ART's name for what LocalBackend.train returns: artcloud's every backend returns a TrainResult.
LocalTrainResult = TrainResult


_Rate = Annotated[float, Field(ge=0.0, le=1.0)]


class TrainSFTConfig(BaseModel):
    """One supervised fine-tuning call (`model.train_sft`), as OpenPipe ART's art.TrainSFTConfig: the learning rate
    (one for every batch, or a list with one per batch: `artcloud.utils.sft.create_lr_schedule`) and the
    trajectories per batch ("auto": 2, ART's LocalBackend default). Each batch is one optimizer step; the call is
    one training step (NAME@STEP -> NAME@STEP+1)."""

    model_config = ConfigDict(extra="forbid")

    learning_rate: _Rate | Annotated[list[_Rate], Field(min_length=1)] = 5e-5
    batch_size: Annotated[int, Field(ge=1)] | Literal["auto"] = "auto"

    def __init__(self, **data: Any):
        _check_fields(type(self), data)
        super().__init__(**data)

    @property
    def batch(self) -> int:
        return 2 if self.batch_size == "auto" else self.batch_size


class PydanticException(BaseModel):
    """A rollout's exception, kept in its group (as ART keeps it) so the run's logs can show it."""

    type: str
    message: str
    traceback: str

    @classmethod
    def of(cls, e: BaseException) -> "PydanticException":
        return cls(type=str(type(e)), message=str(e),
                   traceback="".join(traceback.format_exception(type(e), e, e.__traceback__)))


def is_choice(item: Any) -> bool:
    """A sampled choice (an OpenAI Choice or its dict), not a plain message."""
    return ("message" in item) if isinstance(item, dict) else hasattr(item, "message")


def get_messages(messages_and_choices: Iterable[Any]) -> list[dict[str, Any]]:
    """The conversation as plain OpenAI message dicts: each sampled choice becomes its assistant message
    (content and tool calls); other messages pass as they are."""
    messages = []
    for item in messages_and_choices:
        if not is_choice(item):
            messages.append(item if isinstance(item, dict) else item.model_dump(exclude_none=True))
            continue
        message = item["message"] if isinstance(item, dict) else item.message
        if not isinstance(message, dict):
            message = message.model_dump(exclude_none=True)
        out: dict[str, Any] = {"role": "assistant", "content": message.get("content") or ""}
        tool_calls = message.get("tool_calls")
        if tool_calls:
            out["tool_calls"] = [{"id": c["id"], "type": c.get("type", "function"),
                                  "function": {"name": c["function"]["name"], "arguments": c["function"]["arguments"]}}
                                 for c in tool_calls]
        messages.append(out)
    return messages


# Fields of OpenPipe ART's trajectory types that artcloud does not read, and what to write instead.
_ART_ONLY_FIELDS = {
    "exchanges": "it is OpenPipe ART's newest form of a trajectory (requests recorded by patching the client), which "
                 "artcloud does not read: append the messages and the Choice objects your model's client returned "
                 "to messages_and_choices",
}


def _no_field(cls: type[BaseModel], key: str, also: Iterable[str] = ()) -> InvalidArgument:
    """The error for a keyword `cls` does not have, with a "did you mean" (among its fields and `also`) for a
    typo: pydantic's own error would name the field, but not the fix."""
    import difflib

    close = difflib.get_close_matches(key, [*cls.model_fields, *also], n=1)
    hint = f"did you mean {close[0]!r}? " if close else ""
    return InvalidArgument(f"{cls.__name__} has no field {key!r}: {hint}its fields are {', '.join(cls.model_fields)}",
                           field=key)


def _check_fields(cls: type[BaseModel], data: dict[str, Any]) -> None:
    """One line for a keyword `cls` does not have: what to write instead for an ART-only one, else _no_field's."""
    for key in data:
        if key in _ART_ONLY_FIELDS:
            raise NotSupported(f"{cls.__name__}({key}=...): {_ART_ONLY_FIELDS[key]}", field=key)
        if key not in cls.model_fields:
            raise _no_field(cls, key)


def _wire_items(messages_and_choices: Iterable[Any]) -> list[Any]:
    return [item.model_dump(mode="json", exclude_none=True) if hasattr(item, "model_dump") else item
            for item in messages_and_choices]


class _Conversation(BaseModel):
    """What History and Trajectory share: OpenAI objects among the messages, one line naming the fix for a
    keyword they do not have."""

    model_config = ConfigDict(extra="forbid", arbitrary_types_allowed=True)

    def __init__(self, **data: Any):
        _check_fields(type(self), data)
        super().__init__(**data)

    def messages(self) -> list[dict[str, Any]]:
        """The conversation as plain message dicts (choices become assistant messages), e.g. for a judge."""
        return get_messages(self.messages_and_choices)  # type: ignore[attr-defined]


class History(_Conversation):
    """A further conversation inside one trajectory (a sub-agent's, a second player's): its choices are
    trained on too, with the trajectory's reward. ART's `art.trajectories.History`."""

    messages_and_choices: list[Any] = Field(min_length=1)
    tools: list[dict[str, Any]] | None = None

    def to_wire(self) -> dict[str, Any]:
        return {"messages_and_choices": _wire_items(self.messages_and_choices), "tools": self.tools}


class Trajectory(_Conversation):
    """One rollout: the conversation, with the policy's own turns kept as OpenAI `Choice`s (token ids, logprobs).

    `messages_and_choices` mixes plain message dicts (context: system, user, tool results) with the
    `Choice` objects (or their dicts) that the server returned; only the choices are trained on, those of
    `additional_histories` too. `reward` defaults to 0, as in ART's newer releases.
    """

    messages_and_choices: list[Any] = Field(default_factory=list)
    tools: list[dict[str, Any]] | None = None
    additional_histories: list[History] = Field(default_factory=list)
    reward: FiniteFloat = 0.0
    # The model's training step when the rollout began and ended (ART's names; its pipeline trainer fills
    # them in). Kept with the trajectory and logged; training does not read them.
    initial_policy_version: int | None = Field(None, ge=0)
    final_policy_version: int | None = Field(None, ge=0)
    metrics: dict[str, MetricValue] = Field(default_factory=dict)
    metadata: dict[str, MetadataValue] = Field(default_factory=dict)
    logs: list[str] = Field(default_factory=list)
    # When the rollout began: `finish()` turns it into the `duration` metric.
    start_time: datetime = Field(default_factory=datetime.now, exclude=True, repr=False)

    def __str__(self) -> str:
        return f"Trajectory(reward={self.reward}, metrics={self.metrics}, metadata={self.metadata})"

    def log(self, message: str) -> None:
        self.logs.append(message)

    def finish(self) -> "Trajectory":
        """Records the seconds since the trajectory was made as the `duration` metric; returns self."""
        self.metrics["duration"] = (datetime.now() - self.start_time).total_seconds()
        return self

    @asynccontextmanager
    async def track_duration(self, metric_name: str) -> AsyncIterator[None]:
        """Adds the seconds spent inside the block to the `{metric_name}_duration` metric."""
        start = time.monotonic()
        try:
            yield
        finally:
            key = f"{metric_name}_duration"
            self.metrics[key] = self.metrics.get(key, 0.0) + time.monotonic() - start

    def for_logging(self) -> dict[str, Any]:
        """reward, policy versions, metrics, metadata, logs, tools and the messages, each marked `trainable` or not."""
        messages = [{**m, "trainable": is_choice(item)}
                    for item, m in zip(self.messages_and_choices, get_messages(self.messages_and_choices))]
        return {"reward": self.reward, "initial_policy_version": self.initial_policy_version,
                "final_policy_version": self.final_policy_version, "metrics": self.metrics, "metadata": self.metadata,
                "messages": messages, "tools": self.tools, "logs": self.logs}

    def to_wire(self) -> dict[str, Any]:
        """The JSON the server's training route takes (Choice objects become plain dicts)."""
        wire: dict[str, Any] = {"messages_and_choices": _wire_items(self.messages_and_choices), "tools": self.tools,
                                "reward": self.reward}
        if self.additional_histories:
            wire["additional_histories"] = [h.to_wire() for h in self.additional_histories]
        return wire


class TrajectoryGroup(BaseModel):
    """Trajectories that answer the same prompt; GRPO compares them with each other.

    Built from trajectories, or from awaitables that produce them (`TrajectoryGroup(rollout(s) for _ in
    range(8))`), which `gather_trajectory_groups` (or `await group`, as in ART) runs concurrently.
    Exceptions among the items, or passed as `exceptions=`, are kept in `exceptions`, as ART keeps them.
    Iterating a group yields its trajectories; `len(group)` counts them.
    """

    model_config = ConfigDict(extra="forbid")

    trajectories: list[Trajectory] = Field(default_factory=list)
    exceptions: list[PydanticException] = Field(default_factory=list)
    metadata: dict[str, MetadataValue] = Field(default_factory=dict)
    # Numbers about the group as a whole (e.g. a judge's tokens and cost); not sent to the server.
    metrics: dict[str, MetricValue] = Field(default_factory=dict)
    logs: list[str] = Field(default_factory=list)
    _pending: list[Any] = PrivateAttr(default_factory=list)

    def __init__(self, trajectories: Iterable[Any] | None = None, /, *,
                 exceptions: Iterable[BaseException | PydanticException | dict[str, Any]] = (), **data: Any):
        if trajectories is None:
            trajectories = data.pop("trajectories", None)
        items: dict[str, list[Any]] = {"ready": [], "pending": [], "failed": []}
        for item in trajectories or ():
            kind = "failed" if isinstance(item, BaseException) else "pending" if inspect.isawaitable(item) else "ready"
            items[kind].append(item)
        failed = [*items["failed"], *exceptions]
        failed = [PydanticException.of(e) if isinstance(e, BaseException) else e for e in failed]
        _check_fields(type(self), data)
        super().__init__(trajectories=items["ready"], exceptions=failed, **data)
        self._pending = items["pending"]

    def __iter__(self) -> Iterator[Trajectory]:  # type: ignore[override]  # ART's groups iterate their trajectories
        return iter(self.trajectories)

    def __len__(self) -> int:
        return len(self.trajectories)

    def __await__(self) -> Generator[Any, None, "TrajectoryGroup"]:
        """`await TrajectoryGroup(rollouts)` runs them (ART's style); the group is its own result."""
        return self.resolve().__await__()

    @property
    def pending(self) -> int:
        return len(self._pending)

    def log(self, message: str) -> None:
        self.logs.append(message)

    async def resolve(self) -> "TrajectoryGroup":
        """Await the pending rollouts (concurrently). Alone, the first exception ends the others and is raised;
        inside gather_trajectory_groups, failures count against its `max_exceptions`."""
        return await resolve_group(self)

    def to_wire(self) -> dict[str, Any]:
        if self._pending:
            raise WrongState("this group still has rollouts to run: use gather_trajectory_groups or await "
                             "group.resolve()")
        return {"trajectories": [t.to_wire() for t in self.trajectories]}


class Tally(Protocol):
    """What a gather counts (gather_trajectory_groups' state, shown on its bar): the rollouts it expects, those
    that ended, those that failed."""

    def expect(self, n: int) -> None: ...
    def record(self, traj: Trajectory) -> None: ...
    def failed(self, e: BaseException) -> bool: ...  # True: one failure too many (the caller raises)
    def over_limit(self) -> bool: ...


# The gather in progress, if any: rollouts started inside it (`await group` within a group coroutine, too)
# report to its tally. gather.py sets it; a group awaited on its own finds None.
current_tally: ContextVar[Tally | None] = ContextVar("artcloud_gather", default=None)


def check_trajectory(traj: Any) -> Trajectory:
    if not isinstance(traj, Trajectory):
        raise WrongType(f"a rollout returned {type(traj).__name__}, not an artcloud.Trajectory")
    return traj


async def resolve_group(group: TrajectoryGroup, counted: bool = False) -> TrajectoryGroup:
    """Run a group's pending rollouts concurrently (TrajectoryGroup.resolve, `await group`).

    Inside a gather, a failed rollout is left out, kept in `group.exceptions` and counted against the
    gather's `max_exceptions`; alone, the first failure is raised. Either way, raising first cancels the
    group's other rollouts and waits for them to end. `counted`: the gather has counted them already."""
    pending, group._pending = group._pending, []
    if not pending:
        return group
    tally = current_tally.get()
    if tally is not None and not counted:
        tally.expect(len(pending))
    tasks = [asyncio.ensure_future(p) for p in pending]

    async def one(task: asyncio.Future) -> Trajectory | None:
        try:
            traj = await task
        except Exception as e:
            if tally is None:
                raise
            group.exceptions.append(PydanticException.of(e))
            if tally.over_limit() or tally.failed(e):
                raise
            return None
        check_trajectory(traj)
        if tally is not None:
            tally.record(traj)
        return traj

    try:
        results = await asyncio.gather(*(one(t) for t in tasks))
    except BaseException:
        await cancel_and_wait(tasks)
        raise
    group.trajectories.extend(t for t in results if t is not None)
    return group


async def cancel_and_wait(tasks: list[asyncio.Future]) -> None:
    """Cancel every task and wait until each has ended (Python 3.10 has no TaskGroup to do it)."""
    for task in tasks:
        task.cancel()
    pending = {t for t in tasks if not t.done()}
    cancelled_again = False
    while pending:
        try:
            _, pending = await asyncio.wait(pending)
        except asyncio.CancelledError:  # cancelled while cleaning up: finish the clean-up first
            cancelled_again = True
    for task in tasks:
        if not task.cancelled():
            task.exception()  # retrieved: no "exception was never retrieved" warnings for the siblings
    if cancelled_again:
        raise asyncio.CancelledError

"""The HTTP protocol between a client and `artcloud serve`, one module for both sides: request bodies, the
answers' shapes, events and errors. It imports pydantic, the standard library and artcloud's own error and
type modules only: the laptop client imports it (never fastapi, torch or artcloud.server).

Chat completions follow OpenAI's shape. Additions carry what training needs: vLLM-style, the
response's `prompt_token_ids` and each choice's `token_ids` (the exact sampled ids); and on each choice
`prompt_sha256` (sha256 of the prompt's token ids, each as 4 bytes unsigned little-endian:
artcloud.server.chat.prompt_sha256) and `temperature` (the one it was sampled at; 0 = greedy). The
standard `logprobs.content[i].logprob` is the logprob of each sampled token under the distribution it
was drawn from: log_softmax(logits / T) before top-p (at T = 1 for greedy), as training computes it.
A trajectory sent for training keeps its choices as returned: the server re-renders the conversation
before each one and rejects it (400 `context_mismatch`) if its hash differs from `prompt_sha256`.
Logprobs come unless a request says `logprobs: false`. A streamed response (`stream: true`) carries the
same in its `chat.completion.chunk`s: each chunk's choice has the `token_ids` of its delta and their
`logprobs.content`; the first chunk has `prompt_token_ids`, each choice's first chunk its `prompt_sha256`
and `temperature` (artcloud.streaming.collect puts them back together into a choice to train on).

Answers: the routes build plain dicts; FastAPI checks each against its model here (response_model), and
the schema promises it, so a client (or a fuzzer: tests/test_fuzz.py) can hold the server to it, and a
client reads an answer back with `parse`. Every answer model allows extra keys (`_Open`): the protocol may
grow (OpenAI objects, metrics), and a key the model does not name is passed through, never dropped.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, TypeVar, Union

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Discriminator,
    Field,
    StringConstraints,
    Tag,
    ValidationError,
    WithJsonSchema,
    field_validator,
)

from artcloud.errors import ArtcloudError, InvalidArgument
from artcloud.types import FiniteFloat, LoraConfig, Seed, TrainConfig


class _Open(BaseModel):
    """An answer, an event or a sampled turn: keys it does not name pass through."""

    model_config = ConfigDict(extra="allow")


class _Strict(BaseModel):
    """A request body of artcloud's own: a key it does not name is refused (a typo must not pass unseen)."""

    model_config = ConfigDict(extra="forbid")


M = TypeVar("M", bound=BaseModel)

# The server's engines (artcloud serve --engine); a client checks a name against these before it launches anything.
ENGINES = ("auto", "cpu", "vllm", "vllm+unsloth", "vllm+peft")

# ---------------------------------------------------------------------------------------------- models


# Model and project names become folder names and S3 key parts: one plain path component.
NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"
# A hub id (`org/name` or `name`, each part at most 96 characters, as the Hugging Face hub allows) or a
# local folder (an absolute or ~ path). Anything else never reaches the loader.
BASE_MODEL_PATTERN = (
    r"^(?:[A-Za-z0-9][A-Za-z0-9._-]{0,95}(?:/[A-Za-z0-9][A-Za-z0-9._-]{0,95})?"
    r"|~?/[A-Za-z0-9._/ +-]{0,254})$"
)


class RegisterRequest(_Strict):
    name: str = Field(min_length=1, max_length=128, pattern=NAME_PATTERN)
    project: str = Field(min_length=1, max_length=128, pattern=NAME_PATTERN)
    base_model: str | None = Field(
        min_length=1, max_length=256, pattern=BASE_MODEL_PATTERN,
        description="A Hugging Face hub id (ORG/NAME), artcloud/tiny-random, or an absolute path to a local model "
                    "folder; null: a prompted model (ART's art.Model served elsewhere), registered for its history only",
    )
    lora: LoraConfig = Field(default_factory=LoraConfig)
    engine_args: dict[str, str | int | float | bool] | None = Field(
        None, max_length=32,
        description="vLLM engine settings for this model's base model (e.g. max_model_len, gpu_memory_utilization, "
                    "load_in_4bit), used when the base model is first loaded; see artcloud serve --engine-args",
    )
    take_over: bool = Field(
        False,
        description="Take over the model's S3 claim even if its last holder renewed it recently: the caller has "
                    "torn that server's machine down (a preempted spot machine dies without releasing it). Should "
                    "the old server live on, its next renewal finds the claim taken and it stops writing.",
    )

    @field_validator("lora", "engine_args")
    @classmethod
    def _served_only(cls, value: Any, info: Any) -> Any:
        # A prompted model is sampled elsewhere: an adapter or engine settings here would be silently unused.
        if "base_model" in info.data and info.data["base_model"] is None and value not in (None, LoraConfig()):
            raise InvalidArgument("a prompted model (base_model null) is served elsewhere: it has no LoRA or engine here")
        return value


class TemperatureRequest(_Strict):
    temperature: float = Field(ge=0.0, le=5.0)


class StateRequest(_Strict):
    """PUT /artcloud/models/{name}/state: OpenPipe ART's overwrite_state (merge false) or merge_state (true)."""

    state: dict[str, Any] = Field(description="a JSON object: the new state, or what to deep-merge into it")
    merge: bool = Field(False, description="deep-merge into the state (nested objects key by key) instead of replacing it")


class ForkRequest(_Strict):
    """POST /artcloud/models/{name}/fork: start a model (not trained yet) from another model's committed checkpoint,
    as OpenPipe ART's backend._experimental_fork_checkpoint (the SFT-then-RL recipe)."""

    from_model: str = Field(min_length=1, max_length=128, pattern=NAME_PATTERN)
    from_project: str | None = Field(None, min_length=1, max_length=128, pattern=NAME_PATTERN,
                                     description="default: the model's own project")
    from_s3_bucket: str | None = Field(None, min_length=3, max_length=63, pattern=r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$",
                                       description="look for the checkpoint in this bucket (the server's S3 endpoint "
                                                   "and credentials); default: this server's disk, then its --s3")
    prefix: str | None = Field(None, max_length=512, pattern=r"^[A-Za-z0-9._/-]*$", description="the bucket's prefix")
    not_after_step: int | None = Field(None, ge=0, lt=2**53, description="the newest checkpoint at or before this step")


class PruneRequest(_Strict):
    """Delete a model's checkpoints but the latest and the best by `best_metric` (ART's delete_checkpoints)."""

    best_metric: str = Field("val/reward", min_length=1, max_length=200,
                             description="a key of the model's history, averaged per step; the highest step is kept")


# ---------------------------------------------------------------------------------------------- chat


class Message(_Open):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    name: str | None = None


MAX_STOP = 8
MAX_MESSAGES = 4096  # a chat request's messages (security review 3, finding 3)
MAX_TOOLS = 128  # and its tools: OpenAI's own limit
# What `_stop_list` checks, for the schema: as pydantic constraints on the union, a bad list would be
# told "stop.constrained-str: Input should be a valid string".
_STOP_SCHEMA = {"anyOf": [
    {"type": "string", "minLength": 1},
    {"type": "array", "items": {"type": "string", "minLength": 1}, "maxItems": MAX_STOP},
    {"type": "null"},
]}


class StreamOptions(BaseModel):
    # Newer OpenAI options (include_obfuscation, ...) are accepted and ignored, as the request's are.
    model_config = ConfigDict(extra="ignore")

    include_usage: bool = False  # one more chunk before [DONE], with `usage` and no choices


class ChatCompletionRequest(BaseModel):
    # OpenAI clients send fields we do not use (user, metadata, ...): accept and ignore them.
    model_config = ConfigDict(extra="ignore")

    model: str = Field(min_length=1, max_length=300)  # NAME, NAME@STEP or a base model id (at most 256)
    messages: list[Message] = Field(min_length=1, max_length=MAX_MESSAGES)
    tools: list[dict[str, Any]] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: Any = None
    n: int = Field(1, ge=1, le=128)
    temperature: float | None = Field(None, ge=0.0, le=5.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    stop: Annotated[str | list[str] | None, WithJsonSchema(_STOP_SCHEMA)] = Field(None, validate_default=True)
    # Unset means yes (as ART's server does: training needs them, and ART scripts never ask); false means no.
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    seed: Seed | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    return_token_ids: bool = True

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, v: str | list[str] | None) -> list[str]:
        if v is None:
            return []
        stops = [v] if isinstance(v, str) else v
        if len(stops) > MAX_STOP or any(not s for s in stops):
            raise InvalidArgument(f"stop takes at most {MAX_STOP} non-empty strings")
        return stops


# ---------------------------------------------------------------------------------------------- training


# What one training request may hold. Each list stops validating at its first bad entry (fail_fast), so
# that an invalid body costs one error, not one per entry. The caps are checked after a list is parsed, not
# by pydantic's max_length: its too_long error carries the whole input list, which it converts to Python
# objects (for 6 M logprob entries: 3.5 GB and seconds holding the GIL).
MAX_TURN_TOKENS = 262_144  # a sampled turn: token_ids and logprobs.content
MAX_ITEMS = 4_096  # messages and choices of a conversation
MAX_GROUPS = 1_024  # groups of a request, trajectories of a group


def _at_most(cap: int) -> Any:
    def check(value: list[Any] | None) -> list[Any] | None:
        if value is not None and len(value) > cap:
            raise InvalidArgument(f"takes at most {cap} entries, not {len(value)}")
        return value

    return AfterValidator(check)


NOT_AN_ENTRY = "each entry is an object with the sampled token's logprob, as the server returned it"


def _logprob_of(entry: Any) -> Any:
    if not isinstance(entry, dict) or "logprob" not in entry:
        raise InvalidArgument(NOT_AN_ENTRY)
    return entry["logprob"]


# An entry of `logprobs.content` ({"token": ..., "logprob": ..., "top_logprobs": ...}) parses to its logprob
# alone: the only part training reads, and a float costs a tenth of a model per sampled token.
# JSON from Python may carry NaN: a NaN logprob would train a NaN adapter.
TokenLogprob = Annotated[
    FiniteFloat, BeforeValidator(_logprob_of),
    WithJsonSchema({"type": "object", "required": ["logprob"], "additionalProperties": True,
                    "properties": {"token": {"type": "string"}, "logprob": {"type": "number"}}}),
]


class ChoiceLogprobs(_Open):
    content: Annotated[list[TokenLogprob] | None, _at_most(MAX_TURN_TOKENS)] = Field(
        None, fail_fast=True, json_schema_extra={"maxItems": MAX_TURN_TOKENS})


class Choice(_Open):
    """A turn the policy sampled, as the server returned it (an OpenAI `Choice` plus `token_ids`,
    `prompt_sha256` and `temperature`)."""

    index: int = 0
    finish_reason: str | None = None
    message: Message
    logprobs: ChoiceLogprobs | None = None
    token_ids: Annotated[list[int] | None, _at_most(MAX_TURN_TOKENS)] = Field(
        None, fail_fast=True, json_schema_extra={"maxItems": MAX_TURN_TOKENS})
    # Optional here so that a choice without them gets the training route's own message (what to keep),
    # not a bare "field required".
    prompt_sha256: str | None = Field(None, pattern=r"^[0-9a-f]{64}$")
    # allow_inf_nan, not FiniteFloat: bounds after FiniteFloat's validator reach the OpenAPI schema as
    # unknown `ge` and `le` keys, not as minimum and maximum.
    temperature: float | None = Field(None, ge=0.0, le=5.0, allow_inf_nan=False)


def _item_kind(v: Any) -> str:
    if isinstance(v, dict):
        return "choice" if "message" in v else "message"
    return "choice" if hasattr(v, "message") else "message"


Item = Annotated[
    Union[Annotated[Choice, Tag("choice")], Annotated[Message, Tag("message")]],
    Discriminator(_item_kind),
]


class WireHistory(BaseModel):
    """A further conversation of a trajectory (ART's `additional_histories`): its choices train with the
    trajectory's reward, each rendered in its own context with its own tools."""

    model_config = ConfigDict(extra="ignore")

    messages_and_choices: Annotated[list[Item], _at_most(MAX_ITEMS)] = Field(
        min_length=1, fail_fast=True, json_schema_extra={"maxItems": MAX_ITEMS})
    tools: list[dict[str, Any]] | None = None


class WireTrajectory(WireHistory):
    reward: FiniteFloat
    additional_histories: list[WireHistory] = Field(default_factory=list, max_length=256)


class WireGroup(BaseModel):
    model_config = ConfigDict(extra="ignore")

    trajectories: Annotated[list[WireTrajectory], _at_most(MAX_GROUPS)] = Field(
        min_length=1, fail_fast=True, json_schema_extra={"maxItems": MAX_GROUPS})


class TrainRequest(_Strict):
    groups: Annotated[list[WireGroup], _at_most(MAX_GROUPS)] = Field(
        min_length=1, fail_fast=True, json_schema_extra={"maxItems": MAX_GROUPS})
    config: TrainConfig = Field(default_factory=TrainConfig)
    # A retried POST with the same key returns the first job instead of training twice.
    idempotency_key: str | None = Field(None, min_length=1, max_length=200)


# ---------------------------------------------------------------------------------------------- SFT

MAX_SFT_BATCHES = 64  # the batches of one chunk
MAX_SFT_ROWS = 1_024  # the rows of one batch


class SFTRow(BaseModel):
    """One conversation to learn from (a row of OpenPipe ART's SFT JSONL): its assistant turns, tool calls
    included, are trained on; system, user and tool messages are context only."""

    model_config = ConfigDict(extra="ignore")  # ART's rows may carry response_format and the like

    messages: Annotated[list[Message], _at_most(MAX_ITEMS)] = Field(min_length=1, fail_fast=True,
                                                                    json_schema_extra={"maxItems": MAX_ITEMS})
    tools: list[dict[str, Any]] | None = None


class SFTBatch(_Strict):
    """One optimizer step of supervised fine-tuning, at its own learning rate."""

    rows: Annotated[list[SFTRow], _at_most(MAX_SFT_ROWS)] = Field(min_length=1, fail_fast=True,
                                                                  json_schema_extra={"maxItems": MAX_SFT_ROWS})
    learning_rate: float = Field(ge=0.0, le=1.0, allow_inf_nan=False)  # a decay ends at 0 (create_lr_schedule)


class SFTStart(_Strict):
    """POST /artcloud/models/{name}/sft: one `train_sft` call, a job that trains the batches the client then sends
    (POST /artcloud/jobs/{job_id}/sft) and commits one step after the last (OpenPipe ART's model.train_sft)."""

    batches: int | None = Field(None, ge=1, lt=2**53, description="how many batches will come, where known (the "
                                "progress's total)")
    max_grad_norm: float | None = Field(1.0, gt=0.0, description="as ART's SFT: 1.0")
    idempotency_key: str | None = Field(None, min_length=1, max_length=200)


class SFTChunk(_Strict):
    """The next batches of an SFT job, in order: `seq` counts chunks from 0 (a chunk sent again is answered, not
    trained again); `last` ends the job, which then commits its step."""

    seq: int = Field(ge=0, lt=2**53)
    batches: Annotated[list[SFTBatch], _at_most(MAX_SFT_BATCHES)] = Field(
        default_factory=list, fail_fast=True, json_schema_extra={"maxItems": MAX_SFT_BATCHES})
    last: bool = False
    abort: bool = Field(False, description="end the job now: nothing of it is committed (the client gave up)")


class SFTAccepted(_Open):
    job_id: str
    seq: int = Field(description="the chunk taken")
    batches: int = Field(description="batches taken so far, this chunk's included")
    dropped_rows: int = Field(description="rows left out so far: longer than the model's context (as ART drops them)")


# ---------------------------------------------------------------------------------------------- metrics

SPLIT_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$"
METRIC_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_./-]{0,127}$"
RESERVED = ("step", "split", "time", "source", "job_id")
MAX_METRICS = 64  # per logged record

MetricName = Annotated[str, StringConstraints(pattern=METRIC_PATTERN)]


class LogRequest(_Strict):
    """POST /artcloud/models/{name}/log: one split's metrics at a step (what `model.log` sends)."""

    split: str = Field("val", pattern=SPLIT_PATTERN, description="e.g. val, train, test")
    step: int | None = Field(None, ge=0, lt=2**53, description="the step the metrics describe; default: the model's step")
    metrics: dict[MetricName, Annotated[float, Field(strict=True, allow_inf_nan=False)]] = Field(
        default_factory=dict, max_length=MAX_METRICS,
        description=f"finite numbers by name; not {', '.join(RESERVED)}")


# ---------------------------------------------------------------------------------------------- events

EventType = Literal["queued", "start", "step", "end", "error"]


class Event(_Open):
    """One line of a job's NDJSON event stream. `seq` is the cursor: read on with `?after=seq`."""

    seq: int
    type: EventType
    job_id: str
    time: float
    data: dict[str, Any] = Field(default_factory=dict)


# ---------------------------------------------------------------------------------------------- shutdown

FINAL_PUSH_DEADLINE_S = 600.0
"""The longest the server's final pushes take, all models together (they run at once): POST /artcloud/shutdown
answers within it (after any wait_for_training_s), and so does the lifespan exit's push. A client waiting for
that answer derives its own wait from this (plus a margin for the answer to travel), never less."""


class ShutdownRequest(_Strict):
    wait_for_training_s: float = Field(0.0, ge=0.0, le=86_400.0, allow_inf_nan=False)


# ---------------------------------------------------------------------------------------------- answers


class ErrorDetail(_Open):
    code: str = Field(description="stable machine-readable code, e.g. invalid_request, model_not_found")
    message: str = Field(description="what went wrong and what to do")
    type: str
    field: str | None = Field(None, description="the part of the request at fault, e.g. groups[0].trajectories[1].reward")
    param: str | None = None


class ErrorBody(_Open):
    error: ErrorDetail


class Progress(_Open):
    done: int = Field(ge=0)
    total: int = Field(ge=0)
    unit: Literal["bytes"]


class Health(_Open):
    status: Literal["ok", "degraded"] = Field(description="degraded while a sampler process (vLLM) restarts")
    version: str
    ready: bool = Field(description="true once the models an earlier server left (and a --preload base model) are loaded")
    detail: str | None = Field(None, description="what is degraded, and that it restarts by itself")
    phase: Literal["installing", "starting", "fetching_weights", "loading_engine", "ready"] | None = Field(
        None, description="what the server is doing: installing (before it exists), starting, fetching_weights, "
        "loading_engine, ready (and back through fetching_weights / loading_engine when a new base model loads)")
    phase_s: float | None = Field(None, ge=0, description="seconds in the current phase")
    progress: Progress | None = Field(None, description="while fetching_weights: bytes done of total")
    phases: dict[str, float] | None = Field(None, description="seconds spent so far in each phase before this one "
                                            "(installing: from the install's own record), and first_rollout: how long "
                                            "the first chat completion after ready took")
    elapsed_s: float | None = Field(None, ge=0, description="installing: seconds since the install began")


class S3Status(_Open):
    uri: str
    pushed_step: int | None
    pushed_bytes: int
    pending: bool
    errors: int
    last_error: str | None
    claim_lost: str | None = Field(None, description="set when another server took the model over on S3")


class ModelSummary(_Open):
    name: str
    project: str
    base_model: str
    step: int
    training: bool
    s3: S3Status | None
    fault: str | None = None  # disk_full, too_many_open_files, io_error, rollback_failed: until a step commits


class EngineSummary(_Open):
    base_model: str
    kind: str
    batches: int = Field(description="engine calls made for chat completions (each may serve many requests)")
    engine: str | None = Field(None, description="the sampler and trainer, e.g. 'vllm + unsloth'")
    colocated: bool | None = Field(None, description="sampler and trainer take turns on one GPU")
    turn: str | None = None
    switches: int | None = None
    sampler: dict[str, Any] | None = None
    trainer: dict[str, Any] | None = Field(None, description="a trainer in processes of its own: its ranks and restarts")


class LeaseInfo(_Open):
    lease_s: float | None
    idle_s: float
    in_flight: int
    max_duration_s: float | None
    uptime_s: float


class Status(_Open):
    version: str
    ready: bool
    models: list[ModelSummary]
    engines: list[EngineSummary]
    lease: LeaseInfo
    limits: dict[str, float | int]


class Heartbeat(_Open):
    ok: bool
    version: str
    last_request_at: float


class ModelInfo(_Open):
    name: str
    project: str
    base_model: str
    lora: LoraConfig
    step: int
    served_as: str = Field(description="NAME@STEP: what a chat request for NAME is answered by")
    temperature: float
    training: bool
    checkpoints: list[int]
    s3: S3Status | None
    history: list[dict[str, Any]]


class Registered(ModelInfo):
    resumed: bool = Field(description="true when the model came back from a checkpoint (on disk or S3)")


class PromptedInfo(_Open):
    """A prompted model (registered with base_model null): served at its own endpoint, with a history here."""

    name: str
    project: str
    base_model: None
    prompted: Literal[True]
    step: int = Field(description="always 0: a prompted model has no steps (its records may name any)")
    s3: S3Status | None
    history: list[dict[str, Any]]


class PromptedRegistered(PromptedInfo):
    resumed: bool = Field(description="true when its history came back (from this disk or S3)")


class HistoryRecord(_Open):
    """One record of a model's history (artcloud/server/history.py says which keys): what POST .../log answers."""

    step: int
    split: str
    time: float
    source: str


class ModelState(_Open):
    """A model's persistent state (OpenPipe ART's state.json) and the step it belongs to."""

    step: int = Field(ge=0, description="the model's step when the state was written (or the checkpoint it came with)")
    state: dict[str, Any] | None = Field(description="null until a state is written")


class Temperature(_Open):
    name: str
    temperature: float


class Pruned(_Open):
    name: str
    metric: str
    best_step: int | None = Field(description="the best committed step by `metric` (kept); None when no "
                                            "committed step has it")
    kept: list[int]
    deleted: list[int]
    note: str | None = Field(None, description="why only the latest step was kept (no committed step has `metric`)")


class JobSummary(_Open):
    job_id: str
    model: str
    status: Literal["queued", "running", "succeeded", "failed"]
    events: int
    last_event: Event | None
    created_at: float | None
    events_url: str | None = None


class ShutdownModel(ModelInfo):
    error: str | None = Field(None, description="why the final push did not finish")


class ShutdownPrompted(PromptedInfo):
    training: bool = False  # a prompted model never trains
    error: str | None = Field(None, description="why the final push of its history did not finish")


class ShutdownAnswer(_Open):
    ok: bool
    models: list[ShutdownModel | ShutdownPrompted]


# ---------------------------------------------------------------------------------------------- OpenAI


class ModelCard(_Open):
    id: str
    object: Literal["model"]
    owned_by: str
    root: str
    step: int | None = Field(None, description="a registered model's current step (absent for a base model)")


class ModelList(_Open):
    object: Literal["list"]
    data: list[ModelCard]


class ChatMessage(_Open):
    role: Literal["assistant"]
    content: str | None


class ChatChoice(_Open):
    index: int
    message: ChatMessage
    finish_reason: Literal["stop", "length", "tool_calls"]
    logprobs: dict[str, Any] | None
    token_ids: list[int] | None = Field(None, description="the sampled token ids (what training needs)")


class Usage(_Open):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class ChatCompletion(_Open):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str = Field(description="NAME@STEP that answered")
    choices: list[ChatChoice]
    usage: Usage
    prompt_token_ids: list[int] | None = None


def parse(model_cls: type[M], body: Any, what: str) -> M:
    """`body` (a decoded JSON answer) as `model_cls`; an answer of another shape is no artcloud server's:
    ArtcloudError code not_artcloud, one line naming `what` and the first field at fault."""
    try:
        return model_cls.model_validate(body)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(part) for part in first["loc"]) or "the body"
        raise ArtcloudError(f"{what} is not an artcloud answer: {where}: {first['msg']}", code="not_artcloud") from None

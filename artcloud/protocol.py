"""The HTTP protocol between a client and `artcloud serve`: request bodies, events and errors.

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
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, WithJsonSchema, field_validator

from artcloud.errors import InvalidArgument
from artcloud.types import FiniteFloat, LoraConfig, Seed, TrainConfig

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


class RegisterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

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


class TemperatureRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    temperature: float = Field(ge=0.0, le=5.0)


class PruneRequest(BaseModel):
    """Delete a model's checkpoints but the latest and the best by `best_metric` (ART's delete_checkpoints)."""

    model_config = ConfigDict(extra="forbid")

    best_metric: str = Field("val/reward", min_length=1, max_length=200,
                             description="a key of the model's history, averaged per step; the highest step is kept")


# ---------------------------------------------------------------------------------------------- chat


class Message(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    name: str | None = None


MAX_STOP = 8
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
    messages: list[Message] = Field(min_length=1)
    tools: list[dict[str, Any]] | None = None
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


class TokenLogprob(BaseModel):
    model_config = ConfigDict(extra="allow")

    token: str = ""
    # JSON from Python may carry NaN: a NaN logprob would train a NaN adapter.
    logprob: FiniteFloat


class ChoiceLogprobs(BaseModel):
    model_config = ConfigDict(extra="allow")

    content: list[TokenLogprob] | None = None


class Choice(BaseModel):
    """A turn the policy sampled, as the server returned it (an OpenAI `Choice` plus `token_ids`,
    `prompt_sha256` and `temperature`)."""

    model_config = ConfigDict(extra="allow")

    index: int = 0
    finish_reason: str | None = None
    message: Message
    logprobs: ChoiceLogprobs | None = None
    token_ids: list[int] | None = None
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

    messages_and_choices: list[Item] = Field(min_length=1)
    tools: list[dict[str, Any]] | None = None


class WireTrajectory(WireHistory):
    reward: FiniteFloat
    additional_histories: list[WireHistory] = Field(default_factory=list, max_length=256)


class WireGroup(BaseModel):
    model_config = ConfigDict(extra="ignore")

    trajectories: list[WireTrajectory] = Field(min_length=1)


class TrainRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    groups: list[WireGroup] = Field(min_length=1)
    config: TrainConfig = Field(default_factory=TrainConfig)
    # A retried POST with the same key returns the first job instead of training twice.
    idempotency_key: str | None = Field(None, min_length=1, max_length=200)


# ---------------------------------------------------------------------------------------------- events

EventType = Literal["queued", "start", "step", "end", "error"]


class Event(BaseModel):
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

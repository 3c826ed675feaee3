"""The HTTP protocol between a client and `artcloud serve`: request bodies, events and errors.

Chat completions follow OpenAI's shape. Two vLLM-style additions carry what training needs:
the response's `prompt_token_ids` and each choice's `token_ids` (the exact sampled ids), next to the
standard `logprobs.content[i].logprob` (the sampling policy's logprob of each sampled token).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, field_validator

from artcloud.types import FiniteFloat, LoraConfig, TrainConfig

# ---------------------------------------------------------------------------------------------- models


class RegisterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
    project: str = Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
    base_model: str = Field(min_length=1, max_length=512)
    lora: LoraConfig = Field(default_factory=LoraConfig)


class TemperatureRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    temperature: float = Field(ge=0.0, le=5.0)


# ---------------------------------------------------------------------------------------------- chat


class Message(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    name: str | None = None


class ChatCompletionRequest(BaseModel):
    # OpenAI clients send fields we do not use (user, metadata, ...): accept and ignore them.
    model_config = ConfigDict(extra="ignore")

    model: str = Field(min_length=1)
    messages: list[Message] = Field(min_length=1)
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    n: int = Field(1, ge=1, le=128)
    temperature: float | None = Field(None, ge=0.0, le=5.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    stop: str | list[str] | None = Field(None, validate_default=True)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    seed: int | None = None
    stream: bool = False
    return_token_ids: bool = True

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, v: str | list[str] | None) -> list[str]:
        if v is None:
            return []
        stops = [v] if isinstance(v, str) else v
        if len(stops) > 8 or any(not s for s in stops):
            raise ValueError("stop takes at most 8 non-empty strings")
        return stops


# ---------------------------------------------------------------------------------------------- training


class TokenLogprob(BaseModel):
    model_config = ConfigDict(extra="allow")

    token: str = ""
    logprob: float


class ChoiceLogprobs(BaseModel):
    model_config = ConfigDict(extra="allow")

    content: list[TokenLogprob] | None = None


class Choice(BaseModel):
    """A turn the policy sampled, as the server returned it (an OpenAI `Choice` plus `token_ids`)."""

    model_config = ConfigDict(extra="allow")

    index: int = 0
    finish_reason: str | None = None
    message: Message
    logprobs: ChoiceLogprobs | None = None
    token_ids: list[int] | None = None


def _item_kind(v: Any) -> str:
    if isinstance(v, dict):
        return "choice" if "message" in v else "message"
    return "choice" if hasattr(v, "message") else "message"


Item = Annotated[
    Union[Annotated[Choice, Tag("choice")], Annotated[Message, Tag("message")]],
    Discriminator(_item_kind),
]


class WireTrajectory(BaseModel):
    model_config = ConfigDict(extra="ignore")

    messages_and_choices: list[Item] = Field(min_length=1)
    tools: list[dict[str, Any]] | None = None
    reward: FiniteFloat


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

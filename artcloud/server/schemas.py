"""The shapes of the server's answers, for its OpenAPI schema.

The routes build plain dicts; FastAPI checks each against its model here (response_model), and the
schema promises it, so a client (or a fuzzer: tests/test_fuzz.py) can hold the server to it. Every
model allows extra keys: the protocol may grow (OpenAI objects, metrics), and a key the model does not
name is passed through, never silently dropped.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from artcloud.protocol import Event
from artcloud.types import LoraConfig


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")


class ErrorDetail(_Open):
    code: str = Field(description="stable machine-readable code, e.g. invalid_request, model_not_found")
    message: str = Field(description="what went wrong and what to do")
    type: str
    field: str | None = Field(None, description="the part of the request at fault, e.g. groups[0].trajectories[1].reward")
    param: str | None = None


class ErrorBody(_Open):
    error: ErrorDetail


_ERRORS = {
    400: "the request is invalid: `field` names the part at fault",
    401: "no bearer token, or the wrong one",
    404: "no such model, step, job or route",
    409: "conflicts with the server's state (a model registered differently, a server shutting down, a limit)",
    413: "the request body is over artcloud serve --max-body-mb",
    429: "too many training jobs waiting for this model (artcloud serve --max-queued-jobs)",
    503: "the server is still loading its models (GET /health says ready), or its sampler process restarts",
}


def errors(*codes: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI `responses` entries for these error statuses, all shaped as ErrorBody."""
    return {code: {"model": ErrorBody, "description": _ERRORS[code]} for code in codes}


# ---------------------------------------------------------------------------------------------- server


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


class EngineSummary(_Open):
    base_model: str
    kind: str
    batches: int = Field(description="engine calls made for chat completions (each may serve many requests)")
    engine: str | None = Field(None, description="the sampler and trainer, e.g. 'vllm + unsloth'")
    colocated: bool | None = Field(None, description="sampler and trainer take turns on one GPU")
    turn: str | None = None
    switches: int | None = None
    sampler: dict[str, Any] | None = None


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


class ShutdownAnswer(_Open):
    ok: bool
    models: list[ShutdownModel]


# ---------------------------------------------------------------------------------------------- OpenAI


class ModelCard(_Open):
    id: str
    object: Literal["model"]
    owned_by: str
    root: str


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


# The 200 of a streamed request (stream=true), beside the JSON ChatCompletion: its chunks are described
# in artcloud/server/chat_stream.py.
CHAT_STREAM: dict[str, Any] = {
    "description": "a ChatCompletion; with stream=true, Server-Sent Events: `data: {chat.completion.chunk}` "
                   "lines (each choice with the token_ids and logprobs of its delta), then `data: [DONE]`",
    "content": {"text/event-stream": {"schema": {"type": "string"}}},
}


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

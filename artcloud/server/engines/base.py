"""The engine's two halves: a sampler and a trainer, joined by adapter checkpoints.

A **trainer** owns one base model's trainable copy and the LoRA adapters on it: it creates, trains
(through the one GRPO loop in artcloud.train.loop), saves and loads adapters with their optimizer.
A **sampler** generates from the base model with an adapter, and makes an adapter servable from a
folder the trainer saved (PEFT layout). engine.py joins one of each into the `Engine` the server uses:

    CPU engine     TorchSampler + PeftTrainer, sharing one model in memory (cpu.py)
    vllm+unsloth   VLLMSampler (vLLM's own process) + UnslothTrainer         (vllm_sampler.py, unsloth_trainer.py)
    vllm+peft      VLLMSampler + PeftTrainer, where Unsloth cannot load a model

Everything that is not model math (batching requests, pausing inference while an adapter updates,
adapter names and steps, checkpoint folders, HTTP) lives in `artcloud.server` and works the same for
every pair. Adapters are addressed by *slot*, an opaque string the server picks ("adapter3",
"adapter3s7"); samplers and trainers never parse it.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from artcloud.errors import ArtcloudError
from artcloud.types import LoraConfig, TrainConfig


@dataclass
class SamplingParams:
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    max_tokens: int = 256
    stop: list[str] = field(default_factory=list)  # stop strings (token-level stops: the tokenizer's EOS)
    seed: int | None = None
    top_logprobs: int = 0  # how many alternatives to report per sampled token


class TokenSink:
    """Where a streamed request's tokens go as they are sampled. A sampler calls `tokens` from its own
    thread, at least once per sample that has new tokens (the torch sampler: every decoding step; vLLM:
    every chunk it streams), in order; the returned `Completion`s hold the same tokens again, whole.
    `cancelled` turns true when the client went away: the sampler stops this request's samples at its
    next step (what it returns for them then is thrown away)."""

    cancelled: bool = False

    def tokens(self, sample: int, token_ids: list[int], logprobs: list[float],
               top_logprobs: list[list[tuple[int, float]]] | None) -> None:
        """New tokens of sample `sample` (0 .. n-1), with their logprobs (see `Completion`)."""

    def started(self, served_as: str) -> None:
        """The server's, not a sampler's: what serves the request (NAME@STEP), just before it is generated."""


@dataclass
class GenerationRequest:
    prompt_ids: list[int]
    n: int
    params: SamplingParams
    sink: TokenSink | None = None  # a streamed request: hear its tokens as they come
    # The client went away (a non-streamed one; a streamed one's sink says `cancelled`): the torch sampler
    # drops its rows at the next decoding step, the batcher before its batch.
    abandoned: bool = False

    @property
    def gone(self) -> bool:
        return self.abandoned or (self.sink is not None and self.sink.cancelled)


@dataclass
class Completion:
    token_ids: list[int]
    # The logprob of each sampled token under the distribution it was drawn from: log_softmax(logits / T)
    # before top-p, T = `temperature` (T = 1 for greedy; see advantages.logprob_temperature). Training
    # divides its logits by the same T, so the importance ratio of an unchanged policy is 1.
    # top_logprobs are of the same distribution.
    logprobs: list[float]
    top_logprobs: list[list[tuple[int, float]]] | None
    finish_reason: str  # "stop" | "length"
    text: str  # decoded, stop string removed (as OpenAI does)
    temperature: float  # the sampling temperature (0 = greedy), returned with the choice for training


@dataclass
class TrainSample:
    """One policy turn to learn from: the context, the sampled tokens and their sampling logprobs. (Supervised
    fine-tuning uses it too: a conversation from its first assistant token on, `trained` marking the assistant's
    tokens; no logprobs or advantage.)"""

    prompt_ids: list[int]
    completion_ids: list[int]
    old_logprobs: list[float]
    advantage: float
    group: int  # index of the trajectory group, for shared-prompt packing and stats
    temperature: float = 1.0  # the T old_logprobs are at; training's logprobs take the same (never 0)
    sequence: int | None = None  # the trajectory (conversation) it is a turn of, where the loss looks across turns
    trained: list[bool] | None = None  # which completion tokens carry loss (None: all)

    @property
    def loss_tokens(self) -> int:
        return len(self.completion_ids) if self.trained is None else sum(self.trained)


StepCallback = Callable[[dict[str, Any]], None]


class Trainer(abc.ABC):
    """One base model's trainable weights and the LoRA adapters (with optimizers) on it."""

    base_model: str
    tokenizer: Any  # a transformers tokenizer with a chat template: the server renders chats with it
    vocab_size: int
    max_context: int  # prompt + completion tokens the model takes

    @abc.abstractmethod
    def create_adapter(self, slot: str, lora: LoraConfig) -> None:
        """A fresh adapter (LoRA B = 0, so it starts equal to the base model) with a fresh optimizer."""

    @abc.abstractmethod
    def delete_adapter(self, slot: str) -> None:
        """Forget `slot` (a slot it does not hold is not an error)."""

    @abc.abstractmethod
    def train_step(
        self, slot: str, samples: list[TrainSample], config: TrainConfig, on_step: StepCallback
    ) -> list[dict[str, Any]]:
        """`config.gradient_steps` optimizer steps over `samples` (artcloud.train.loop);
        `on_step(metrics)` after each one."""

    @abc.abstractmethod
    def save_adapter(self, slot: str, folder: Path, *, optimizer: bool) -> list[str]:
        """Write the adapter (PEFT layout: adapter_config.json + adapter_model.safetensors, loadable with
        `PeftModel.from_pretrained` and by vLLM) and, if asked, the optimizer state into `folder`.
        Returns the file names."""

    @abc.abstractmethod
    def load_adapter(self, slot: str, lora: LoraConfig, folder: Path, *, optimizer: bool) -> None:
        """Create or overwrite `slot` from a folder written by any trainer's `save_adapter`."""

    @abc.abstractmethod
    def rng_state(self) -> dict[str, Any]: ...

    @abc.abstractmethod
    def set_rng_state(self, state: dict[str, Any]) -> None: ...

    def to_device(self) -> None:
        """Bring weights and optimizer state to the accelerator (before training on a shared GPU)."""

    def offload(self) -> None:
        """Move what can move off the accelerator (while the sampler serves on a shared GPU)."""

    def status(self) -> dict[str, Any] | None:
        """What GET /artcloud/status shows of a trainer that runs in processes of its own (None: it does not)."""
        return None

    def close(self) -> None: ...


class Sampler(abc.ABC):
    """Generates from the base model, bare or with a servable adapter."""

    max_context: int  # prompt + completion tokens it takes
    shares_trainer_weights: bool = False  # True: the trainer's own adapters are servable as they change
    concurrent: bool = False  # True: generate may run in several threads at once (it batches by itself)
    # True where sleep() really frees the accelerator for the trainer (vLLM's sleep mode on CUDA).
    can_sleep: bool = False

    @abc.abstractmethod
    def generate(self, slot: str | None, requests: list[GenerationRequest]) -> list[list[Completion]]:
        """Sample `n` completions for each request. `slot=None` is the bare base model. Each completion
        carries its token ids and their logprobs (see `Completion`). A sampler that answers several requests
        independently (ReplicaSet) may put an ArtcloudError in a request's place: that request's own failure."""

    @abc.abstractmethod
    def serve_adapter(self, slot: str, lora: LoraConfig, folder: Path) -> None:
        """Make `slot` servable from a folder a trainer saved; a slot served before now serves this."""

    @abc.abstractmethod
    def drop_adapter(self, slot: str) -> None:
        """Stop serving `slot` (a slot it does not serve is not an error)."""

    def sleep(self) -> None:
        """Free the accelerator for the trainer (only called where `can_sleep`)."""

    def wake(self) -> None:
        """Undo `sleep`."""

    def status(self) -> dict[str, Any]:
        """For /artcloud/status and /health: at least {"kind": ..., "state": "ready" | ...}."""
        return {"kind": type(self).__name__, "state": "ready"}

    def close(self) -> None: ...


class SamplerUnavailable(ArtcloudError):
    """The sampler cannot answer now (its process died and is restarting); the message says when to
    retry. The server answers 503 with it."""

    code = "sampler_unavailable"


class RequestRefused(ArtcloudError):
    """An engine refused a request as invalid (a 4xx of vLLM's, or of an inference replica's): the request fails,
    answered as a 400 with the engine's words; the engine is fine, and nothing takes it out of service."""

    code = "request_refused"


class EngineError(ArtcloudError, RuntimeError):
    """An engine failed (vLLM exited, answered an error or contradicted itself); a bug or a broken machine,
    answered as a 500."""

    code = "engine_failed"


class StopStrings:
    """Finds the first stop string in a growing completion, incrementally.

    Only the tail of the text can newly contain a stop string, so each check decodes a short window.
    """

    def __init__(self, tokenizer: Any, stops: list[str]):
        self.tokenizer = tokenizer
        self.stops = stops
        self.window = max((len(s) for s in stops), default=0)

    def check(self, token_ids: list[int]) -> bool:
        if not self.stops:
            return False
        # A token decodes to at least one character, so window+2 tokens hold any stop string that ends
        # in the newest token.
        tail = self.tokenizer.decode(token_ids[-(self.window + 2):], skip_special_tokens=False)
        return any(s in tail for s in self.stops)

    def cut(self, text: str) -> str:
        """The text before the first stop string."""
        cut = len(text)
        for s in self.stops:
            i = text.find(s)
            if i != -1:
                cut = min(cut, i)
        return text[:cut]

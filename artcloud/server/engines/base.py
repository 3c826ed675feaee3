"""The engine interface: the model math, and nothing else.

An engine owns one base model, its tokenizer and the LoRA adapters on it. It generates and it trains.
Everything that is not model math (batching requests, pausing inference while an adapter updates,
adapter names and steps, checkpoint folders, HTTP) lives in `artcloud.server` and works the same for
every engine. The CPU engine (torch + transformers + peft) implements this; the GPU engine
(vLLM + Unsloth) implements the same methods.

Adapters are addressed by *slot*, an opaque string the server picks ("m3", "m3@7"); engines never
parse it.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from artcloud.types import LoraConfig, TrainConfig


@dataclass
class SamplingParams:
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    max_tokens: int = 256
    stop: list[str] = field(default_factory=list)  # stop strings (token-level stops: the tokenizer's EOS)
    seed: int | None = None
    top_logprobs: int = 0  # how many alternatives to report per sampled token


@dataclass
class GenerationRequest:
    prompt_ids: list[int]
    n: int
    params: SamplingParams


@dataclass
class Completion:
    token_ids: list[int]
    # The logprob of each sampled token under the distribution it was drawn from: log_softmax(logits / T)
    # before top-p, T = `temperature` (T = 1 for greedy; see grpo.logprob_temperature). Training
    # divides its logits by the same T, so the importance ratio of an unchanged policy is 1.
    # top_logprobs are of the same distribution.
    logprobs: list[float]
    top_logprobs: list[list[tuple[int, float]]] | None
    finish_reason: str  # "stop" | "length"
    text: str  # decoded, stop string removed (as OpenAI does)
    temperature: float  # the sampling temperature (0 = greedy), returned with the choice for training


@dataclass
class TrainSample:
    """One policy turn to learn from: the context, the sampled tokens and their sampling logprobs."""

    prompt_ids: list[int]
    completion_ids: list[int]
    old_logprobs: list[float]
    advantage: float
    group: int  # index of the trajectory group, for shared-prompt packing and stats
    temperature: float = 1.0  # the T old_logprobs are at; training's logprobs take the same (never 0)


StepCallback = Callable[[dict[str, Any]], None]


class Engine(abc.ABC):
    """One base model plus its LoRA adapters."""

    base_model: str
    tokenizer: Any  # a transformers tokenizer with a chat template
    vocab_size: int
    max_context: int  # prompt + completion tokens the model takes

    @abc.abstractmethod
    def create_adapter(self, slot: str, lora: LoraConfig) -> None:
        """A fresh adapter (LoRA B = 0, so it starts equal to the base model) with a fresh optimizer."""

    @abc.abstractmethod
    def delete_adapter(self, slot: str) -> None: ...

    @abc.abstractmethod
    def generate(self, slot: str | None, requests: list[GenerationRequest]) -> list[list[Completion]]:
        """Sample `n` completions for each request, in one batch. `slot=None` is the bare base model."""

    @abc.abstractmethod
    def train_step(
        self, slot: str, samples: list[TrainSample], config: TrainConfig, on_step: StepCallback
    ) -> list[dict[str, Any]]:
        """`config.gradient_steps` optimizer steps over `samples`; `on_step(metrics)` after each one."""

    @abc.abstractmethod
    def save_adapter(self, slot: str, folder: Path, *, optimizer: bool) -> list[str]:
        """Write the adapter (PEFT layout: adapter_config.json + adapter_model.safetensors, loadable with
        `PeftModel.from_pretrained`) and, if asked, the optimizer state into `folder`. Returns file names."""

    @abc.abstractmethod
    def load_adapter(self, slot: str, lora: LoraConfig, folder: Path, *, optimizer: bool) -> None:
        """Create or overwrite `slot` from a folder written by `save_adapter`."""

    @abc.abstractmethod
    def rng_state(self) -> dict[str, Any]: ...

    @abc.abstractmethod
    def set_rng_state(self, state: dict[str, Any]) -> None: ...


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

"""The types a user touches: trajectories, groups, and the knobs of training.

These are plain pydantic models, shared by the laptop SDK and the server; nothing heavy is imported here.
"""

from __future__ import annotations

import inspect
import math
from typing import Annotated, Any, Awaitable, Iterable, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, PrivateAttr

from artcloud.errors import InvalidArgument, WrongState

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


class LoraConfig(BaseModel):
    """The LoRA adapter that training updates. Fixed at registration: a model keeps its adapter shape."""

    model_config = ConfigDict(extra="forbid")

    rank: int = Field(8, ge=1, le=512)
    alpha: float = Field(16.0, gt=0)
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    target_modules: list[str] = Field(default_factory=lambda: list(DEFAULT_LORA_TARGETS), min_length=1)
    # Seed of the adapter's random init (LoRA A; B starts at 0): the same settings give the same adapter.
    init_seed: Seed = 0


class TrainConfig(BaseModel):
    """How one training step turns trajectory groups into an adapter update.

    One `train` call is one step (the served name moves from NAME@STEP to NAME@STEP+1); it may take
    several gradient steps (`gradient_steps` minibatches over the groups), each reported as an event.
    """

    model_config = ConfigDict(extra="forbid")

    learning_rate: float = Field(5e-5, gt=0.0, le=1.0)
    loss: Literal["ppo", "cispo"] = "ppo"
    clip_epsilon: float = Field(0.2, gt=0.0, le=10.0)
    # Upper clip bound (DAPO's "clip higher"); None means the same as clip_epsilon.
    clip_epsilon_high: float | None = Field(None, gt=0.0, le=10.0)
    # k3 estimator of KL(policy || base model); 0 skips the reference forward pass entirely.
    kl_coef: float = Field(0.0, ge=0.0)
    max_grad_norm: float | None = Field(1.0, gt=0.0)
    gradient_steps: int = Field(1, ge=1, le=64)
    weight_decay: float = Field(0.0, ge=0.0)
    # Divide advantages by the group's reward std (GRPO); False keeps only the mean baseline (Dr. GRPO).
    scale_rewards: bool = True


class Trajectory(BaseModel):
    """One rollout: the conversation, with the policy's own turns kept as OpenAI `Choice`s (token ids, logprobs).

    `messages_and_choices` mixes plain message dicts (context: system, user, tool results) with the
    `Choice` objects (or their dicts) that the server returned; only the choices are trained on.
    """

    model_config = ConfigDict(extra="forbid", arbitrary_types_allowed=True)

    messages_and_choices: list[Any] = Field(min_length=1)
    tools: list[dict[str, Any]] | None = None
    reward: FiniteFloat = 0.0
    metrics: dict[str, float] = Field(default_factory=dict)
    metadata: dict[str, Any] = Field(default_factory=dict)
    logs: list[str] = Field(default_factory=list)

    def to_wire(self) -> dict[str, Any]:
        """The JSON the server's training route takes (Choice objects become plain dicts)."""
        items = []
        for item in self.messages_and_choices:
            if hasattr(item, "model_dump"):
                item = item.model_dump(mode="json", exclude_none=True)
            items.append(item)
        return {"messages_and_choices": items, "tools": self.tools, "reward": self.reward}


class TrajectoryGroup(BaseModel):
    """Trajectories that answer the same prompt; GRPO compares them with each other.

    Built from trajectories, or from awaitables that produce them (`TrajectoryGroup(rollout(s) for _ in
    range(8))`), which `gather_trajectory_groups` (or `await group.resolve()`) runs concurrently.
    """

    model_config = ConfigDict(extra="forbid")

    trajectories: list[Trajectory] = Field(default_factory=list)
    # Numbers about the group as a whole (e.g. a judge's tokens and cost); not sent to the server.
    metrics: dict[str, float] = Field(default_factory=dict)
    _pending: list[Any] = PrivateAttr(default_factory=list)

    def __init__(self, trajectories: Iterable[Trajectory | Awaitable[Trajectory]] | None = None, /, **data: Any):
        pending: list[Any] = []
        if trajectories is not None:
            ready = []
            for item in trajectories:
                (pending if inspect.isawaitable(item) else ready).append(item)
            data["trajectories"] = ready
        super().__init__(**data)
        self._pending = pending

    @property
    def pending(self) -> int:
        return len(self._pending)

    async def resolve(self) -> "TrajectoryGroup":
        """Await the pending rollouts (concurrently); an exception in one is raised."""
        if self._pending:
            import asyncio  # here, not at the top: asyncio is a third of `import artcloud` otherwise

            pending, self._pending = self._pending, []
            self.trajectories.extend(await asyncio.gather(*pending))
        return self

    def to_wire(self) -> dict[str, Any]:
        if self._pending:
            raise WrongState("this group still has rollouts to run: use gather_trajectory_groups or await group.resolve()")
        return {"trajectories": [t.to_wire() for t in self.trajectories]}

"""From trajectory groups (JSON) to training samples (token ids, sampling logprobs, advantages).

Each policy turn (a Choice) becomes one sample: its context is the conversation before it, rendered
through the chat template exactly as the inference route rendered it; its tokens are the ones that were
sampled (`token_ids`), never a re-tokenisation of the text. The choice's `prompt_sha256` proves the
rendered context is the one it was sampled from (else the gradient would be taken on a context the
policy never saw); its `temperature` is the one its logprobs, and so training's, are at. Bad input is
rejected here, before a job exists, with the field at fault.
"""

from __future__ import annotations

import math
import statistics
from typing import Any, NamedTuple

from artcloud.server import chat
from artcloud.server.api_errors import ApiError
from artcloud.server.engines.base import TrainSample
from artcloud.train.advantages import group_advantages, logprob_temperature
from artcloud.wire import Choice, TrainRequest, WireHistory, WireTrajectory

# Advantages become float32 tensors: beyond this they are infinite there.
_FLOAT32_MAX = 3.4028234663852886e38


def _bad(field: str, message: str) -> ApiError:
    return ApiError(400, "invalid_trajectory", message, field)


class Turn(NamedTuple):
    """One policy turn of a trajectory, ready to become a TrainSample."""

    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    temperature: float  # the T its logprobs are at (advantages.logprob_temperature: never 0)
    history: int = 0  # 0: the trajectory's own conversation; h: its additional_histories[h - 1]


def trajectory_turns(engine: Any, traj: WireTrajectory, where: str) -> list[Turn]:
    """The policy turns of one trajectory and of its additional histories, each checked against what was
    sampled (`engine`: its tokenizer, vocab_size and max_context)."""
    turns = history_turns(engine, traj, where)
    for h, history in enumerate(traj.additional_histories):
        turns += [t._replace(history=h + 1)
                  for t in history_turns(engine, history, f"{where}.additional_histories[{h}]")]
    if not turns:
        raise _bad(f"{where}.messages_and_choices", "has no assistant turn sampled by the policy: include the Choice "
                   "objects returned by the server (with token_ids and logprobs) among the messages")
    return turns


def history_turns(engine: Any, traj: WireHistory, where: str) -> list[Turn]:
    """The policy turns of one conversation, each checked against what was sampled."""
    tokenizer, vocab_size = engine.tokenizer, engine.vocab_size
    turns = []
    context: list[dict[str, Any]] = []
    for i, item in enumerate(traj.messages_and_choices):
        here = f"{where}.messages_and_choices[{i}]"
        if not isinstance(item, Choice):
            context.append(item.model_dump(exclude_none=True))
            continue
        if item.message.role != "assistant":
            raise _bad(f"{here}.message.role", "a sampled choice must be an assistant message")
        ids = item.token_ids
        if not ids:
            raise _bad(f"{here}.token_ids", "missing: the token ids the policy sampled. Keep the Choice objects the "
                       "artcloud server returned (they carry token_ids) instead of rebuilding the message.")
        if any(t < 0 or t >= vocab_size for t in ids):
            raise _bad(f"{here}.token_ids", f"token ids must lie in [0, {vocab_size}) for this model")
        content = item.logprobs.content if item.logprobs else None
        if not content:
            raise _bad(f"{here}.logprobs", "missing: training needs the sampling policy's logprobs. Leave logprobs out "
                       "of the completion request (they come by default) or set it true.")
        if len(content) != len(ids):
            raise _bad(f"{here}.logprobs.content",
                       f"has {len(content)} entries for {len(ids)} sampled tokens: it must have one per token")
        for name in ("prompt_sha256", "temperature"):
            if getattr(item, name) is None:
                raise _bad(f"{here}.{name}", "missing: keep the Choice objects the artcloud server returned (they carry "
                           "prompt_sha256 and temperature, which training checks) instead of rebuilding them.")
        try:
            prompt = chat.render_prompt(tokenizer, context, traj.tools)
        except Exception as e:  # a template error is the messages' fault
            raise _bad(f"{where}.messages_and_choices", f"the chat template cannot render these messages: {e}")
        if chat.prompt_sha256(prompt) != item.prompt_sha256:
            raise ApiError(
                400, "context_mismatch",
                f"{where}, turn messages_and_choices[{i}]: the conversation before this turn differs from the "
                "one it was sampled from, so its logprobs do not belong to this context. Usual causes: a "
                "message edited, added, removed or reordered after sampling; other `tools` on the trajectory "
                "than in the request; a system prompt added afterwards. Send the messages exactly as they "
                "were sent to the chat route.",
                here,
            )
        if len(prompt) + len(ids) > engine.max_context:  # never trained on positions the model does not have
            raise ApiError(400, "context_too_long", f"{where}, turn messages_and_choices[{i}]: {len(prompt)} prompt and "
                           f"{len(ids)} sampled tokens make {len(prompt) + len(ids)}, over the {engine.max_context} "
                           "positions this model takes: drop or shorten this turn", f"{here}.token_ids")
        turns.append(Turn(prompt, list(ids), list(content), logprob_temperature(item.temperature)))
        context.append(item.message.model_dump(exclude_none=True))
    return turns


def build_samples(engine: Any, request: TrainRequest) -> tuple[list[TrainSample], dict[str, Any]]:
    samples: list[TrainSample] = []
    skipped: list[int] = []
    rewards_all: list[float] = []
    group_stds: list[float] = []
    sequences = 0  # each conversation (a trajectory's main history, each additional one) numbered apart
    for g, group in enumerate(request.groups):
        turns = [trajectory_turns(engine, t, f"groups[{g}].trajectories[{i}]")
                 for i, t in enumerate(group.trajectories)]
        rewards = [t.reward for t in group.trajectories]
        rewards_all.extend(rewards)
        group_stds.append(statistics.pstdev(rewards))
        advantages = group_advantages(rewards, scale=request.config.scale_rewards)
        if advantages is None:  # equal rewards: no signal, and said so in the stats
            skipped.append(g)
            continue
        if not all(math.isfinite(a) and abs(a) < _FLOAT32_MAX for a in advantages):
            raise _bad(f"groups[{g}].trajectories",
                       "the rewards of this group are so large that their advantages overflow: rescale them")
        for traj_turns, adv in zip(turns, advantages):
            for t in traj_turns:
                samples.append(TrainSample(t.prompt_ids, t.completion_ids, t.logprobs, adv, g, t.temperature,
                                           sequence=sequences + t.history))
            sequences += 1 + max(t.history for t in traj_turns)
    balance(samples, request.config.advantage_balance)
    stats = {
        "groups": len(request.groups), "groups_skipped_equal_rewards": len(skipped), "skipped_groups": skipped,
        "trajectories": len(rewards_all), "samples": len(samples), "reward_mean": statistics.fmean(rewards_all),
        "reward_std": statistics.pstdev(rewards_all) if len(rewards_all) > 1 else 0.0,
        # OpenPipe ART's reward_std_dev: the mean of the groups' own reward std (TrainConfig's
        # scale_learning_rate_by_reward_std_dev follows its trend)
        "reward_std_dev": statistics.fmean(group_stds),
        "reward_min": min(rewards_all), "reward_max": max(rewards_all),
    }
    return samples, stats


def balance(samples: list[TrainSample], b: float) -> None:
    """OpenPipe ART's advantage_balance (in place): b > 0 scales the negative advantages by 1 - b, b < 0 the positive
    ones by 1 + b; then all are scaled so that the mean |advantage| per sampled token is what it was (ART divides
    by that mean always; artcloud only here, so that balancing shifts weight without changing the step's size)."""
    if not b or not samples:
        return
    before = sum(abs(s.advantage) * len(s.completion_ids) for s in samples)
    for s in samples:
        if (b > 0 and s.advantage < 0) or (b < 0 and s.advantage > 0):
            s.advantage *= 1 - abs(b)
    after = sum(abs(s.advantage) * len(s.completion_ids) for s in samples)
    if after > 0:
        for s in samples:
            s.advantage *= before / after

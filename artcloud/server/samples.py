"""From trajectory groups (JSON) to training samples (token ids, sampling logprobs, advantages).

Each policy turn (a Choice) becomes one sample: its context is the conversation before it, rendered
through the chat template exactly as the inference route rendered it; its tokens are the ones that were
sampled (`token_ids`), never a re-tokenisation of the text. Bad input is rejected here, before a job
exists, with the field at fault.
"""

from __future__ import annotations

import statistics
from typing import Any

from artcloud.protocol import Choice, TrainRequest, WireTrajectory
from artcloud.server import chat
from artcloud.server.engines.base import TrainSample
from artcloud.server.errors import ApiError
from artcloud.train.grpo import group_advantages


def _bad(field: str, message: str) -> ApiError:
    return ApiError(400, "invalid_trajectory", message, field)


def trajectory_turns(
    tokenizer: Any, vocab_size: int, traj: WireTrajectory, where: str
) -> list[tuple[list[int], list[int], list[float]]]:
    """(prompt_ids, completion_ids, sampling_logprobs) for each policy turn of one trajectory."""
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
            raise _bad(
                f"{here}.token_ids",
                "missing: the token ids the policy sampled. Keep the Choice objects the artcloud "
                "server returned (they carry token_ids) instead of rebuilding the message.",
            )
        if any(t < 0 or t >= vocab_size for t in ids):
            raise _bad(f"{here}.token_ids", f"token ids must lie in [0, {vocab_size}) for this model")
        content = item.logprobs.content if item.logprobs else None
        if not content:
            raise _bad(
                f"{here}.logprobs",
                "missing: training needs the sampling policy's logprobs. Request completions with "
                "logprobs=True.",
            )
        if len(content) != len(ids):
            raise _bad(
                f"{here}.logprobs.content",
                f"has {len(content)} entries for {len(ids)} sampled tokens: it must have one per token",
            )
        try:
            prompt = chat.render_prompt(tokenizer, context, traj.tools)
        except Exception as e:  # a template error is the messages' fault
            raise _bad(f"{where}.messages_and_choices", f"the chat template cannot render these messages: {e}")
        turns.append((prompt, list(ids), [float(c.logprob) for c in content]))
        context.append(item.message.model_dump(exclude_none=True))
    if not turns:
        raise _bad(
            f"{where}.messages_and_choices",
            "has no assistant turn sampled by the policy: include the Choice objects returned by the "
            "server (with token_ids and logprobs) among the messages",
        )
    return turns


def build_samples(tokenizer: Any, vocab_size: int, request: TrainRequest) -> tuple[list[TrainSample], dict[str, Any]]:
    samples: list[TrainSample] = []
    skipped: list[int] = []
    rewards_all: list[float] = []
    for g, group in enumerate(request.groups):
        turns = [
            trajectory_turns(tokenizer, vocab_size, t, f"groups[{g}].trajectories[{i}]")
            for i, t in enumerate(group.trajectories)
        ]
        rewards = [t.reward for t in group.trajectories]
        rewards_all.extend(rewards)
        advantages = group_advantages(rewards, scale=request.config.scale_rewards)
        if advantages is None:  # equal rewards: no signal, and said so in the stats
            skipped.append(g)
            continue
        for traj_turns, adv in zip(turns, advantages):
            for prompt, ids, lps in traj_turns:
                samples.append(TrainSample(prompt, ids, lps, adv, g))
    stats = {
        "groups": len(request.groups),
        "groups_skipped_equal_rewards": len(skipped),
        "skipped_groups": skipped,
        "trajectories": len(rewards_all),
        "samples": len(samples),
        "reward_mean": statistics.fmean(rewards_all),
        "reward_std": statistics.pstdev(rewards_all) if len(rewards_all) > 1 else 0.0,
        "reward_min": min(rewards_all),
        "reward_max": max(rewards_all),
    }
    return samples, stats

"""GRPO's arithmetic that needs no torch: a group's advantages, and the temperature a token's logprob is taken at.

The server turns a train request into samples with these before any engine runs, so `artcloud serve` starts
without importing torch (about 2 s of CPU): torch comes with the first model. The loss is in grpo.py.
"""

from __future__ import annotations

import math


def group_advantages(rewards: list[float], *, scale: bool = True, eps: float = 1e-6) -> list[float] | None:
    """(r - mean) / std within one group; None when every reward is equal (nothing to learn from)."""
    n = len(rewards)
    if n < 2 or max(rewards) - min(rewards) <= eps:
        return None
    mean = sum(rewards) / n
    if not scale:
        return [r - mean for r in rewards]
    std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / (n - 1))  # unbiased, like torch.std
    return [(r - mean) / (std + eps) for r in rewards]


def logprob_temperature(sampling_temperature: float) -> float:
    """The temperature a sampled token's logprob is taken at (by the sampler and by training): the
    sampling temperature itself, or 1 for greedy decoding (T = 0). grpo.py's docstring says why."""
    return sampling_temperature if sampling_temperature > 0.0 else 1.0

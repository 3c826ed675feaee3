"""GRPO on one page: group-relative advantages and the clipped policy-gradient loss.

Shapes: B sequences in a batch, C completion tokens (right-padded), V vocabulary.
Only the tokens the policy sampled carry loss (`mask`); prompts, tool results and padding do not.

Sampling temperature and the importance ratio. A token sampled at temperature T > 0 was drawn from
pi_T = softmax(logits / T), so that is the distribution the ratio pi_theta / pi_old is taken against, as
TRL and verl do: the sampler reports log pi_T(token) (and its top_logprobs) and training divides each
row's logits by the T its tokens were sampled at. An unchanged policy then has a ratio of 1 at any T,
where logprobs at T = 1 against tokens drawn at T would start every step off-policy. Greedy (T = 0) has no
distribution to compare against: its logprobs and its training are at T = 1 (`logprob_temperature`).
Top-p truncation is ignored in the ratio (as TRL ignores it): the logprobs are of the whole
temperature-scaled distribution, before the nucleus is cut, so a token kept by top-p carries its
untruncated probability and the ratio is not inflated by the renormalisation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from artcloud.errors import InvalidArgument


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
    sampling temperature itself, or 1 for greedy decoding (T = 0)."""
    return sampling_temperature if sampling_temperature > 0.0 else 1.0


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor,
                   temperature: torch.Tensor | None = None) -> torch.Tensor:
    """log softmax(logits / T)[target] for each position. logits (B, C, V), targets (B, C),
    temperature (B,) or None for T = 1 -> (B, C).

    logsumexp + gather instead of a full log_softmax: one (B, C, V) tensor less in memory.
    """
    logits = logits.float()
    if temperature is not None and bool((temperature != 1.0).any()):  # at T = 1, no (B, C, V) copy
        logits = logits / temperature.to(logits.device, torch.float32).view(-1, 1, 1)
    picked = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)


@dataclass
class LossOutput:
    loss: torch.Tensor  # scalar; divided by `denominator` tokens
    clip_fraction: float
    mean_ratio: float
    kl: float | None


def policy_loss(
    new_lp: torch.Tensor,  # (B, C) log pi_theta(token), with grad
    old_lp: torch.Tensor,  # (B, C) log pi_sampling(token), from the inference server
    advantages: torch.Tensor,  # (B,)
    mask: torch.Tensor,  # (B, C) 1.0 on sampled tokens, 0.0 on padding
    *,
    kind: str = "ppo",
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    kl_coef: float = 0.0,
    ref_lp: torch.Tensor | None = None,  # (B, C) log pi_base(token), only when kl_coef > 0
    denominator: float | None = None,  # tokens in the whole optimizer step (for gradient accumulation)
) -> LossOutput:
    adv = advantages.unsqueeze(1)  # (B, 1)
    log_ratio = (new_lp - old_lp).clamp(-20.0, 20.0)
    ratio = torch.exp(log_ratio)  # (B, C)
    low, high = 1.0 - eps_low, 1.0 + eps_high
    if kind == "ppo":
        # PPO-clip: pessimistic between the raw and the clipped surrogate.
        per_token = -torch.minimum(ratio * adv, ratio.clamp(low, high) * adv)
        clipped = ((ratio < low) & (adv < 0)) | ((ratio > high) & (adv > 0))
    elif kind == "cispo":
        # CISPO: clip the importance weight itself (no gradient through it), keep every token's gradient.
        weight = ratio.clamp(low, high).detach()
        per_token = -weight * adv * new_lp
        clipped = (ratio < low) | (ratio > high)
    else:
        raise InvalidArgument(f"unknown loss {kind!r}: use 'ppo' or 'cispo'")

    kl_value = None
    if kl_coef > 0.0:
        assert ref_lp is not None, "kl_coef > 0 needs the reference logprobs"
        # k3 estimator of KL(pi_theta || pi_ref): unbiased, always >= 0.
        d = ref_lp - new_lp
        kl = torch.exp(d) - d - 1.0
        per_token = per_token + kl_coef * kl
        kl_value = float(torch.where(mask > 0, kl.detach(), 0.0).sum() / mask.sum().clamp(min=1.0))

    tokens = mask.sum().clamp(min=1.0)
    denom = denominator if denominator is not None else tokens
    # where(), not a product: padding positions may hold inf (exp overflow) and inf * 0 is NaN.
    loss = torch.where(mask > 0, per_token, 0.0).sum() / denom
    with torch.no_grad():
        clip_fraction = float((clipped.float() * mask).sum() / tokens)
        mean_ratio = float((ratio * mask).sum() / tokens)
    return LossOutput(loss=loss, clip_fraction=clip_fraction, mean_ratio=mean_ratio, kl=kl_value)

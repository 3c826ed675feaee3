"""GRPO on one page: the clipped policy-gradient loss (a group's advantages: advantages.py).

Shapes: B sequences in a batch, C completion tokens (right-padded), V vocabulary.
Only the tokens the policy sampled carry loss (`mask`); prompts, tool results and padding do not.

Sampling temperature and the importance ratio. A token sampled at temperature T > 0 was drawn from
pi_T = softmax(logits / T), so that is the distribution the ratio pi_theta / pi_old is taken against, as
TRL and verl do: the sampler reports log pi_T(token) (and its top_logprobs) and training divides each
row's logits by the T its tokens were sampled at. An unchanged policy then has a ratio of 1 at any T,
where logprobs at T = 1 against tokens drawn at T would start every step off-policy. Greedy (T = 0) has no
distribution to compare against: its logprobs and its training are at T = 1 (advantages.logprob_temperature).
Top-p truncation is ignored in the ratio (as TRL ignores it): the logprobs are of the whole
temperature-scaled distribution, before the nucleus is cut, so a token kept by top-p carries its
untruncated probability and the ratio is not inflated by the renormalisation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from artcloud.errors import InvalidArgument


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
    kl: float | None  # the k3 term's mean (kl_coef > 0)
    kl_policy_ref: float | None = None  # mean log pi_theta - log pi_ref over the tokens (kl_penalty_coef > 0)


@dataclass(frozen=True)
class Knobs:
    """What shapes the loss, from a TrainConfig (`of`). The defaults are OpenPipe ART 0.5.18's: CISPO clipped at
    [1 - 1.0, 1 + 4.0], a ratio per token, no KL."""

    kind: str = "cispo"
    eps_low: float = 1.0
    eps_high: float = 4.0
    importance_sampling_level: str = "token"  # token | sequence | average | geometric_average
    max_ratio: float | None = None  # ART's max_negative_advantage_importance_sampling_weight
    mask_ratio: bool = False  # ART's mask_prob_ratio
    kimi_k2_tau: float | None = None
    kl_penalty_coef: float = 0.0  # ART's KL penalty on the advantages
    kl_coef: float = 0.0  # the k3 KL term in the loss
    truncated_is: float | None = None  # ART's truncated_importance_sampling

    @classmethod
    def of(cls, config: Any) -> "Knobs":
        low, high = config.clip_bounds()
        return cls(kind=config.loss, eps_low=low, eps_high=high,
                   importance_sampling_level=config.importance_sampling_level,
                   max_ratio=config.max_negative_advantage_importance_sampling_weight,
                   mask_ratio=config.mask_prob_ratio, kimi_k2_tau=config.kimi_k2_tau,
                   kl_penalty_coef=config.kl_penalty_coef, kl_coef=config.kl_coef,
                   truncated_is=config.truncated_importance_sampling)

    @property
    def per_sequence(self) -> bool:
        """The ratio of a token depends on the other tokens of its trajectory."""
        return self.importance_sampling_level != "token"


def sequence_log_ratio(log_ratio: torch.Tensor, mask: torch.Tensor, sequence: torch.Tensor) -> torch.Tensor:
    """Each row's trajectory's mean log-ratio over its sampled tokens, broadcast to (B, 1). log_ratio, mask (B, C);
    sequence (B,): the trajectory of each row, 0..S-1 (a trajectory's turns are several rows). With grad."""
    S = int(sequence.max()) + 1
    sums = torch.zeros(S, dtype=log_ratio.dtype, device=log_ratio.device).index_add(
        0, sequence, torch.where(mask > 0, log_ratio, 0.0).sum(1))
    counts = torch.zeros(S, dtype=log_ratio.dtype, device=log_ratio.device).index_add(0, sequence, mask.sum(1))
    return (sums / (counts + 1e-8))[sequence].unsqueeze(1)  # ART's group_aggregate mean, eps included


def policy_loss(
    new_lp: torch.Tensor,  # (B, C) log pi_theta(token), with grad
    old_lp: torch.Tensor,  # (B, C) log pi_sampling(token), from the inference server
    advantages: torch.Tensor,  # (B,)
    mask: torch.Tensor,  # (B, C) 1.0 on sampled tokens, 0.0 on padding
    knobs: Knobs = Knobs(),
    *,
    ref_lp: torch.Tensor | None = None,  # (B, C) log pi_ref(token), when a KL knob is on
    sequence: torch.Tensor | None = None,  # (B,) each row's trajectory (importance_sampling_level != token)
    kl_mean: float | None = None,  # the whole step's mean log pi_theta - log pi_ref (None: this batch's)
    denominator: float | None = None,  # tokens in the whole optimizer step (for gradient accumulation)
) -> LossOutput:
    """The policy-gradient loss of OpenPipe ART 0.5.18 (art/loss.py), knob for knob and in its order (checked on
    the same tensors by tests/test_art_loss.py); one difference: the log-ratio is clamped to [-20, 20] so that an
    extreme token cannot overflow exp()."""
    log_ratio = (new_lp - old_lp).clamp(-20.0, 20.0)
    ratio = torch.exp(log_ratio)  # (B, C)
    if knobs.per_sequence:
        rows = sequence if sequence is not None else torch.arange(new_lp.shape[0], device=new_lp.device)
        seq_ratio = torch.exp(sequence_log_ratio(log_ratio, mask, rows))  # (B, 1)
        if knobs.importance_sampling_level == "sequence":
            ratio = seq_ratio.expand_as(ratio)
        elif knobs.importance_sampling_level == "average":
            ratio = (ratio + seq_ratio) / 2
        elif knobs.importance_sampling_level == "geometric_average":
            ratio = ratio ** 0.5 * seq_ratio ** 0.5
        else:
            raise InvalidArgument(f"unknown importance_sampling_level {knobs.importance_sampling_level!r}: use token, "
                                  "sequence, average or geometric_average")
    low, high = 1.0 - knobs.eps_low, 1.0 + knobs.eps_high
    # A cap beyond the dtype's range caps nothing (and clamp refuses a bound it cannot represent).
    largest = torch.finfo(ratio.dtype).max
    if knobs.max_ratio:
        ratio = ratio.clamp(max=min(knobs.max_ratio, largest))
    if knobs.mask_ratio:
        ratio = torch.where((ratio > low) & (ratio < high), ratio, 0.0)
    adv = advantages.unsqueeze(1).expand_as(new_lp)  # (B, C): a token's own from here on
    if knobs.kimi_k2_tau:
        adv = adv - knobs.kimi_k2_tau * log_ratio.detach()
    kl_policy_ref = None
    if knobs.kl_penalty_coef > 0:
        assert ref_lp is not None, "kl_penalty_coef > 0 needs the reference logprobs"
        kl_t = torch.where(mask > 0, (new_lp - ref_lp).detach(), 0.0)
        kl_policy_ref = float(kl_t.sum() / (mask.sum() + 1e-6)) if kl_mean is None else kl_mean
        adv = adv + knobs.kl_penalty_coef * (kl_policy_ref - kl_t) * mask
    if knobs.kind == "ppo":
        # PPO-clip: pessimistic between the raw and the clipped surrogate.
        per_token = -torch.minimum(ratio * adv, ratio.clamp(low, high) * adv)
        clipped = ((ratio < low) & (adv < 0)) | ((ratio > high) & (adv > 0))
    elif knobs.kind == "cispo":
        # CISPO: clip the importance weight itself (no gradient through it), keep every token's gradient.
        per_token = -ratio.detach().clamp(low, high) * adv * new_lp
        clipped = (ratio < low) | (ratio > high)
    else:
        raise InvalidArgument(f"unknown loss {knobs.kind!r}: use 'ppo' or 'cispo'")
    if knobs.truncated_is:
        per_token = per_token * ratio.clamp(max=min(knobs.truncated_is, largest)).detach()

    kl_value = None
    if knobs.kl_coef > 0.0:
        assert ref_lp is not None, "kl_coef > 0 needs the reference logprobs"
        # k3 estimator of KL(pi_theta || pi_ref): unbiased, always >= 0.
        d = ref_lp - new_lp
        kl = torch.exp(d) - d - 1.0
        per_token = per_token + knobs.kl_coef * kl
        kl_value = float(torch.where(mask > 0, kl.detach(), 0.0).sum() / mask.sum().clamp(min=1.0))

    tokens = mask.sum().clamp(min=1.0)
    denom = denominator if denominator is not None else tokens
    # where(), not a product: padding positions may hold inf (exp overflow) and inf * 0 is NaN.
    loss = torch.where(mask > 0, per_token, 0.0).sum() / denom
    with torch.no_grad():
        clip_fraction = float((clipped.float() * mask).sum() / tokens)
        mean_ratio = float((ratio * mask).sum() / tokens)
    return LossOutput(loss=loss, clip_fraction=clip_fraction, mean_ratio=mean_ratio, kl=kl_value,
                      kl_policy_ref=kl_policy_ref)

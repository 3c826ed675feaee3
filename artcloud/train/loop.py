"""The GRPO step loop, written once for every trainer.

One call is one training step of a model (NAME@STEP -> NAME@STEP+1): `config.gradient_steps` optimizer
steps, each over a minibatch of whole trajectory groups. A minibatch is cut into micro-batches whose
logits fit in memory (packing.micro_batches); their gradients accumulate, each loss divided by the
minibatch's token count, so the update does not depend on how the samples were cut.

What differs between trainers (torch + peft on the CPU, Unsloth on a GPU) comes in as a `TrainablePolicy`: the
LoRA parameters and their optimizer, how to compute logprobs with and without the adapter, and where
tensors live. The GRPO math (artcloud.train.grpo), batching and metrics are the same for all.

Logprobs on both sides are at the sampling temperature: see the module docstring of artcloud.train.grpo.

Nothing non-finite is ever applied: a non-finite loss or gradient norm raises `NonFiniteError` before
the optimizer steps, and a non-finite LoRA parameter after a step raises it too. The caller then throws
the whole training step away (the server reloads the last committed adapter and optimizer).

Sharded (a `World` of several ranks, each with every sample: the sharded trainer): each rank takes a
slice of every minibatch's groups, and every rank runs as many forward and backward passes as the busiest
one (the others' extra passes count nothing), since FSDP's collectives must match. The loss is still
divided by the whole minibatch's tokens and FSDP averages gradients over ranks, so each rank's loss is
scaled by the world's size: the update equals the single-process one. Metrics and the finiteness checks
are summed over ranks, so every rank raises, or none.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch

from artcloud.errors import ArtcloudError
from artcloud.train import grpo, packing
from artcloud.train.packing import PackedBatch

if TYPE_CHECKING:
    from artcloud.types import TrainConfig


class NonFiniteError(ArtcloudError):
    """The loss, the gradient norm or (after an optimizer step) a LoRA parameter is NaN or infinite."""

    code = "non_finite"

    _WHAT = {"loss": "the loss", "grad_norm": "the gradient norm",
             "parameters": "a LoRA parameter (after the optimizer step)"}

    def __init__(self, cause: str, gradient_step: int, value: float | None = None):
        self.cause = cause  # "loss" | "grad_norm" | "parameters"
        self.gradient_step = gradient_step  # 1-based
        shown = f" ({value})" if value is not None else ""
        super().__init__(f"{self._WHAT[cause]} is not finite{shown} at gradient step {gradient_step} (check the "
                         "rewards and logprobs sent, the learning rate and the weight decay): this training step is "
                         "skipped and nothing is committed")


@dataclass(frozen=True)
class World:
    """The ranks that train one step together, and how to sum numbers across them (an all-reduce)."""

    rank: int
    size: int
    sum: Callable[[list[float]], list[float]]

    def share(self, minibatch: Sequence[Any]) -> list[Any]:
        return share(minibatch, self.rank, self.size)


def share(minibatch: Sequence[Any], rank: int, size: int) -> list[Any]:
    """Rank `rank`'s slice of `minibatch`: every size-th group (whole groups keep their shared prompt)."""
    groups: dict[int, list[Any]] = {}
    for s in minibatch:
        groups.setdefault(s.group, []).append(s)
    return sum(list(groups.values())[rank::size], [])


@dataclass
class TrainablePolicy:
    """The policy being trained, as the loop needs it from a trainer."""

    params: list[torch.nn.Parameter]  # the LoRA parameters of the adapter being trained
    optimizer: torch.optim.Optimizer  # over `params`, learning rate and weight decay already set
    # (B, C) log pi_theta(completion token) at each row's temperature, with grad.
    policy_logprobs: Callable[[PackedBatch], torch.Tensor]
    # (B, C) the same with the adapter disabled (the base model), for the KL terms.
    reference_logprobs: Callable[[PackedBatch], torch.Tensor]
    set_training: Callable[[bool], None]  # train mode (dropout) on or off
    pad_id: int
    vocab_size: int
    device: torch.device
    world: World | None = None  # None: one process
    # The KL reference is another adapter (TrainConfig.kl_penalty_reference_step / kl_ref_adapter_path): its
    # weights, laid out as `params` (sharded alike); its logprobs are the policy's with these swapped in.
    reference_weights: list[torch.Tensor] | None = None
    # The most tokens one forward pass may hold (the activations the backward pass keeps grow with them): the
    # trainer's memory budget; None: only the logits' budget cuts micro-batches.
    max_micro_tokens: int | None = None


@dataclass(frozen=True)
class SFTStep:
    """One optimizer step of supervised fine-tuning: cross-entropy on the samples' trained tokens, divided by
    their count (OpenPipe ART's SFT: one step per batch, each with its own learning rate)."""

    learning_rate: float
    max_grad_norm: float | None = 1.0
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.99
    adam_epsilon: float = 1e-8
    batch: int = 1  # which batch of the SFT job (1-based), for its event
    batches: int | None = None  # how many the job has, where known


StepCallback = Callable[[dict[str, Any]], None]


def minibatches(samples: Sequence[Any], gradient_steps: int) -> list[list[Any]]:
    """`gradient_steps` minibatches (fewer if there are fewer groups), each holding whole groups."""
    groups: dict[int, list[Any]] = {}
    for s in samples:
        groups.setdefault(s.group, []).append(s)
    ordered = list(groups.values())
    n_steps = min(gradient_steps, len(ordered))
    return [sum(ordered[i::n_steps], []) for i in range(n_steps)]


def _passes(minibatch: Sequence[Any], policy: TrainablePolicy, whole_sequences: bool) -> list[list[Any] | None]:
    """This rank's micro-batches of `minibatch`, then a None for each pass the busiest rank makes beyond them."""
    world = policy.world

    def cut(part: Sequence[Any]) -> list[list[Any]]:
        return packing.micro_batches(part, policy.vocab_size, whole_sequences=whole_sequences,
                                     max_tokens=policy.max_micro_tokens)

    if world is None:
        return cut(minibatch)
    counts = [len(cut(share(minibatch, r, world.size))) for r in range(world.size)]
    mine = cut(world.share(minibatch))
    return [*mine, *[None] * (max(counts) - len(mine))]


def _local(p: torch.Tensor) -> torch.Tensor:
    """A parameter's part on this rank (a sharded one is a DTensor)."""
    return p.to_local() if hasattr(p, "to_local") else p


def _reference(policy: TrainablePolicy, batch: PackedBatch) -> torch.Tensor:
    """(B, C) the KL reference's logprobs, without grad: the base model's, or the reference adapter's (its weights
    swapped in for the pass and back out after it; before the policy's own pass, whose graph must not see it)."""
    with torch.no_grad():
        if policy.reference_weights is None:
            return policy.reference_logprobs(batch)
        own = [p.detach().clone() for p in policy.params]
        for p, ref in zip(policy.params, policy.reference_weights, strict=True):
            p.copy_(ref)
        try:
            return policy.policy_logprobs(batch)
        finally:
            for p, mine in zip(policy.params, own):
                p.copy_(mine)


def _set_optimizer(policy: TrainablePolicy, config: Any, learning_rate: float) -> None:
    for g in policy.optimizer.param_groups:
        g.update(lr=learning_rate, weight_decay=config.weight_decay, betas=(config.adam_beta1, config.adam_beta2),
                 eps=config.adam_epsilon)


Losses = Callable[[PackedBatch, int, float], tuple[torch.Tensor, list[float]]]


def _optimizer_step(policy: TrainablePolicy, minibatch: Sequence[Any], step: int, max_grad_norm: float | None,
                    losses: Losses, n_sums: int, *, whole_sequences: bool = False) -> tuple[list[float], float]:
    """One optimizer step over `minibatch`: each micro-batch's loss (`losses(batch, pass index, tokens)`: the loss
    tensor and its share of `n_sums` metrics, summed over passes and ranks) backward, the gradient clipped, AdamW.
    Returns (the metric sums, the gradient norm); NonFiniteError where anything is not finite."""
    world = policy.world
    tokens = float(sum(s.loss_tokens for s in minibatch))
    policy.optimizer.zero_grad(set_to_none=True)
    sums = [0.0] * n_sums
    for j, micro in enumerate(_passes(minibatch, policy, whole_sequences)):
        counted = micro is not None  # None: a pass that only keeps this rank in step with the others
        batch = packing.pack(micro if counted else minibatch[:1], policy.pad_id).to(policy.device)
        loss, parts = losses(batch, j, tokens)
        value = loss.item()
        if world is None and not math.isfinite(value):
            raise NonFiniteError("loss", step, value)
        (loss * (world.size if world else 1) * (1.0 if counted else 0.0)).backward()
        if counted:
            sums = [a + b for a, b in zip(sums, parts)]
    if world is not None:
        sums = world.sum(sums)
        if not math.isfinite(sums[0]):
            raise NonFiniteError("loss", step, sums[0])
    norm = torch.nn.utils.clip_grad_norm_(policy.params, max_grad_norm if max_grad_norm is not None else float("inf"))
    grad_norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)  # sharded: a DTensor
    if not math.isfinite(grad_norm):
        raise NonFiniteError("grad_norm", step, grad_norm)
    policy.optimizer.step()
    # Finite gradients can still step into inf (a huge weight decay, Adam on an overflowing moment): the adapter is
    # now broken, and the caller must reload it.
    broken = float(not all(bool(torch.isfinite(_local(p)).all()) for p in policy.params))
    if (world.sum([broken])[0] if world is not None else broken) > 0:
        raise NonFiniteError("parameters", step)
    return sums, grad_norm


def train_step(policy: TrainablePolicy, samples: Sequence[Any], config: TrainConfig | SFTStep,
               on_step: StepCallback) -> list[dict[str, Any]]:
    """Run the optimizer steps of one training step over `samples` (engines.base.TrainSample);
    `on_step(metrics)` after each. Returns the metrics of every gradient step. An SFTStep is one step of SFT."""
    policy.set_training(True)
    try:
        if isinstance(config, SFTStep):
            return [_sft_step(policy, samples, config, on_step)]
        return _rl_step(policy, samples, config, on_step)
    finally:
        policy.set_training(False)
        policy.optimizer.zero_grad(set_to_none=True)


def _rl_step(policy: TrainablePolicy, samples: Sequence[Any], config: TrainConfig,
             on_step: StepCallback) -> list[dict[str, Any]]:
    knobs = grpo.Knobs.of(config)
    batches = minibatches(samples, config.gradient_steps)
    all_metrics = []
    for i, minibatch in enumerate(batches):
        step = i + 1
        t0 = time.perf_counter()
        trajectories = len({(s.group, s.sequence) for s in minibatch})
        learning_rate = config.learning_rate * trajectories ** config.num_trajectories_learning_rate_multiplier_power
        _set_optimizer(policy, config, learning_rate)
        refs, kl_mean = _references(policy, minibatch, knobs)

        def losses(batch: PackedBatch, j: int, tokens: float) -> tuple[torch.Tensor, list[float]]:
            ref_lp = refs[j] if refs is not None else (_reference(policy, batch) if config.kl_reference else None)
            new_lp = policy.policy_logprobs(batch)  # (B, C)
            out = grpo.policy_loss(new_lp, batch.old_logprobs, batch.advantages, batch.loss_mask, knobs, ref_lp=ref_lp,
                                   sequence=batch.sequences, kl_mean=kl_mean, denominator=tokens)
            w = float(batch.loss_mask.sum()) / tokens
            return out.loss, [out.loss.item(), out.clip_fraction * w, out.mean_ratio * w, (out.kl or 0.0) * w,
                              (out.kl_policy_ref or 0.0) * w]

        (loss, clip, ratio, kl, kl_ref), grad_norm = _optimizer_step(
            policy, minibatch, step, config.max_grad_norm, losses, 5, whole_sequences=knobs.per_sequence)
        metrics = {"gradient_step": step, "gradient_steps": len(batches), "loss": loss, "grad_norm": grad_norm,
                   "clip_fraction": clip, "mean_ratio": ratio, "learning_rate": learning_rate,
                   "tokens": sum(s.loss_tokens for s in minibatch), "samples": len(minibatch),
                   "seconds": time.perf_counter() - t0}
        if config.kl_coef > 0:
            metrics["kl"] = kl
        if config.kl_penalty_coef > 0:
            metrics["kl_policy_ref"] = kl_mean if kl_mean is not None else kl_ref
        all_metrics.append(metrics)
        on_step(metrics)
    return all_metrics


def _references(policy: TrainablePolicy, minibatch: Sequence[Any],
                knobs: grpo.Knobs) -> tuple[list[torch.Tensor] | None, float | None]:
    """For ART's KL penalty over several micro-batches or ranks: each pass's reference logprobs, and the mean
    log pi_theta - log pi_ref over the whole minibatch (ART's is over what one loss call sees: here the update
    does not depend on how the samples are cut). (None, None) where one pass sees it all, or no penalty."""
    if knobs.kl_penalty_coef <= 0:
        return None, None
    passes = _passes(minibatch, policy, knobs.per_sequence)
    if policy.world is None and len(passes) == 1:
        return None, None
    refs, total, count = [], 0.0, 0.0
    for micro in passes:
        batch = packing.pack(micro if micro is not None else minibatch[:1], policy.pad_id).to(policy.device)
        ref = _reference(policy, batch)
        with torch.no_grad():
            new = policy.policy_logprobs(batch)
        refs.append(ref)
        if micro is not None:
            total += float(torch.where(batch.loss_mask > 0, new - ref, 0.0).sum())
            count += float(batch.loss_mask.sum())
    if policy.world is not None:
        total, count = policy.world.sum([total, count])
    return refs, total / (count + 1e-6)


def _sft_step(policy: TrainablePolicy, samples: Sequence[Any], config: SFTStep,
              on_step: StepCallback) -> dict[str, Any]:
    t0 = time.perf_counter()
    _set_optimizer(policy, config, config.learning_rate)

    def losses(batch: PackedBatch, j: int, tokens: float) -> tuple[torch.Tensor, list[float]]:
        lp = policy.policy_logprobs(batch)  # (B, C), at T = 1
        loss = -torch.where(batch.loss_mask > 0, lp, 0.0).sum() / max(tokens, 1.0)  # mean token cross-entropy
        return loss, [loss.item()]

    (loss,), grad_norm = _optimizer_step(policy, samples, config.batch, config.max_grad_norm, losses, 1)
    tokens = sum(s.loss_tokens for s in samples)
    seconds = time.perf_counter() - t0
    metrics = {"gradient_step": config.batch, "gradient_steps": config.batches, "loss": loss, "grad_norm": grad_norm,
               "learning_rate": config.learning_rate, "tokens": tokens,
               "tokens_total": sum(len(s.prompt_ids) + len(s.completion_ids) for s in samples),
               "samples": len({s.group for s in samples}), "seconds": seconds}
    on_step(metrics)
    return metrics

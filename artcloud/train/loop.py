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
    # (B, C) the same with the adapter disabled (the base model), for the KL term.
    reference_logprobs: Callable[[PackedBatch], torch.Tensor]
    set_training: Callable[[bool], None]  # train mode (dropout) on or off
    pad_id: int
    vocab_size: int
    device: torch.device
    world: World | None = None  # None: one process


StepCallback = Callable[[dict[str, Any]], None]


def minibatches(samples: Sequence[Any], gradient_steps: int) -> list[list[Any]]:
    """`gradient_steps` minibatches (fewer if there are fewer groups), each holding whole groups."""
    groups: dict[int, list[Any]] = {}
    for s in samples:
        groups.setdefault(s.group, []).append(s)
    ordered = list(groups.values())
    n_steps = min(gradient_steps, len(ordered))
    return [sum(ordered[i::n_steps], []) for i in range(n_steps)]


def _passes(minibatch: Sequence[Any], policy: TrainablePolicy) -> list[list[Any] | None]:
    """This rank's micro-batches of `minibatch`, then a None for each pass the busiest rank makes beyond them."""
    world = policy.world
    if world is None:
        return packing.micro_batches(minibatch, policy.vocab_size)
    counts = [len(packing.micro_batches(share(minibatch, r, world.size), policy.vocab_size)) for r in range(world.size)]
    mine = packing.micro_batches(world.share(minibatch), policy.vocab_size)
    return [*mine, *[None] * (max(counts) - len(mine))]


def _local(p: torch.Tensor) -> torch.Tensor:
    """A parameter's part on this rank (a sharded one is a DTensor)."""
    return p.to_local() if hasattr(p, "to_local") else p


def train_step(policy: TrainablePolicy, samples: Sequence[Any], config: TrainConfig,
               on_step: StepCallback) -> list[dict[str, Any]]:
    """Run the optimizer steps of one training step over `samples` (engines.base.TrainSample);
    `on_step(metrics)` after each. Returns the metrics of every gradient step."""
    opt = policy.optimizer
    eps_high = config.clip_epsilon_high if config.clip_epsilon_high is not None else config.clip_epsilon
    max_norm = config.max_grad_norm if config.max_grad_norm is not None else float("inf")
    batches = minibatches(samples, config.gradient_steps)

    world = policy.world
    all_metrics = []
    policy.set_training(True)
    try:
        for i, minibatch in enumerate(batches):
            step = i + 1
            t0 = time.perf_counter()
            tokens = float(sum(len(s.completion_ids) for s in minibatch))
            opt.zero_grad(set_to_none=True)
            sums = [0.0, 0.0, 0.0, 0.0]  # loss, clip fraction, mean ratio, KL (the last three token-weighted)
            for micro in _passes(minibatch, policy):
                counted = micro is not None  # None: a pass that only keeps this rank in step with the others
                batch = packing.pack(micro if counted else minibatch[:1], policy.pad_id).to(policy.device)
                new_lp = policy.policy_logprobs(batch)  # (B, C)
                ref_lp = None
                if config.kl_coef > 0:
                    with torch.no_grad():
                        ref_lp = policy.reference_logprobs(batch)  # (B, C)
                out = grpo.policy_loss(new_lp, batch.old_logprobs, batch.advantages, batch.completion_mask,
                                       kind=config.loss, eps_low=config.clip_epsilon, eps_high=eps_high,
                                       kl_coef=config.kl_coef, ref_lp=ref_lp, denominator=tokens)
                loss = out.loss.item()
                if world is None and not math.isfinite(loss):
                    raise NonFiniteError("loss", step, loss)
                (out.loss * (world.size if world else 1) * (1.0 if counted else 0.0)).backward()
                if counted:
                    weight = float(batch.completion_mask.sum()) / tokens
                    sums = [sums[0] + loss, sums[1] + out.clip_fraction * weight, sums[2] + out.mean_ratio * weight,
                            sums[3] + (out.kl or 0.0) * weight]
            if world is not None:
                sums = world.sum(sums)
                if not math.isfinite(sums[0]):
                    raise NonFiniteError("loss", step, sums[0])
            loss_sum, clip_sum, ratio_sum, kl_sum = sums
            norm = torch.nn.utils.clip_grad_norm_(policy.params, max_norm)
            grad_norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)  # sharded: a DTensor
            if not math.isfinite(grad_norm):
                raise NonFiniteError("grad_norm", step, grad_norm)
            opt.step()
            # Finite gradients can still step into inf (a huge weight decay, Adam on an overflowing
            # moment): the adapter is now broken, and the caller must reload it.
            broken = float(not all(bool(torch.isfinite(_local(p)).all()) for p in policy.params))
            if (world.sum([broken])[0] if world is not None else broken) > 0:
                raise NonFiniteError("parameters", step)
            metrics = {"gradient_step": step, "gradient_steps": len(batches), "loss": loss_sum, "grad_norm": grad_norm,
                       "clip_fraction": clip_sum, "mean_ratio": ratio_sum, "tokens": int(tokens),
                       "samples": len(minibatch), "seconds": time.perf_counter() - t0}
            if config.kl_coef > 0:
                metrics["kl"] = kl_sum
            all_metrics.append(metrics)
            on_step(metrics)
    finally:
        policy.set_training(False)
        opt.zero_grad(set_to_none=True)
    return all_metrics

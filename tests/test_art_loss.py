"""artcloud's loss against OpenPipe ART 0.5.18's own `art/loss.py`, on the same tensors, knob by knob.

ART's wheel lies beside the test venv, installed without its dependencies (Makefile: `$(VENV)/art-0.5.18`). Its
`art/__init__.py` imports all of ART (LiteLLM, W&B, ...), so `art` and `art.utils` are registered here as bare
packages over the wheel's folders, and Python then runs ART's unmodified `art/loss.py`, `art/dev/` and
`art/utils/group_aggregate.py` from them.

The layouts differ: ART packs each trajectory into one row of tokens, where `inputs[:, t]` describes token t and
`new_logprobs[:, t]` is the logprob of token t + 1 (loss.py shifts its inputs by one); artcloud has a row per
sampled turn, a trajectory's turns sharing a `sequence` id. Each case here lays the same numbers out both ways,
in float64, and compares the loss and its gradient with respect to every sampled token's logprob. The only
difference in the formulas is the denominator (ART's has + 1e-6), which is passed to artcloud's as ART has it;
what is left is float64 rounding, so the bound is a few hundred float64 epsilons of the magnitude.
"""

from __future__ import annotations

import importlib
import sys
import types
from pathlib import Path

import pytest
import torch

import artcloud
from artcloud.train import grpo

pytestmark = pytest.mark.numeric

ART_SITE = Path(sys.prefix) / "art-0.5.18"
F64_BOUND = 512 * torch.finfo(torch.float64).eps  # relative; rounding of sums of ~100 terms, with room


@pytest.fixture(scope="module")
def art_loss():
    if not (ART_SITE / "art" / "loss.py").is_file():
        pytest.fail(f"OpenPipe ART 0.5.18 is not at {ART_SITE}: `make test` installs it (the Makefile's .venv stamp)")
    saved = {name: sys.modules.pop(name) for name in list(sys.modules) if name == "art" or name.startswith("art.")}
    for name, folder in (("art", ART_SITE / "art"), ("art.utils", ART_SITE / "art" / "utils")):
        package = types.ModuleType(name)
        package.__path__ = [str(folder)]
        sys.modules[name] = package
    try:
        yield importlib.import_module("art.loss")
    finally:
        for name in [n for n in sys.modules if n == "art" or n.startswith("art.")]:
            del sys.modules[name]
        sys.modules.update(saved)


def _case(seed: int):
    """Three trajectories (the first has two turns) of a group, as artcloud's rows: (B=4, C=6) tensors."""
    g = torch.Generator().manual_seed(seed)
    lengths = [4, 6, 3, 5]
    sequence = torch.tensor([0, 0, 1, 2])
    mask = torch.zeros(4, 6, dtype=torch.float64)
    for b, n in enumerate(lengths):
        mask[b, :n] = 1
    old = -torch.rand(4, 6, generator=g, dtype=torch.float64) * 3 - 0.05
    new = old + 0.4 * torch.randn(4, 6, generator=g, dtype=torch.float64)  # ratios from ~0.3 to ~3
    ref = old + 0.3 * torch.randn(4, 6, generator=g, dtype=torch.float64)
    advantages = torch.tensor([1.2, 1.2, -0.7, -0.5], dtype=torch.float64)  # one per trajectory
    return new, old, ref, advantages, mask, sequence


def _art_layout(new, old, ref, advantages, mask, sequence):
    """The same numbers as ART's rows: one per trajectory, its turns' tokens one after another, a leading token
    the loss never sees (ART's inputs describe token t, its new logprobs token t + 1)."""
    S = int(sequence.max()) + 1
    rows = [[b for b in range(len(sequence)) if sequence[b] == s] for s in range(S)]
    width = 1 + max(int(sum(mask[b].sum() for b in r)) for r in rows)
    shape = (S, width)
    art = {"logprobs": torch.full(shape, float("nan"), dtype=torch.float64),
           "advantages": torch.zeros(shape, dtype=torch.float64), "assistant_mask": torch.zeros(shape, dtype=torch.bool),
           "weights": torch.zeros(shape, dtype=torch.float64), "group_ids": torch.zeros(shape, dtype=torch.long)}
    new_art, ref_art = torch.zeros(shape, dtype=torch.float64), torch.zeros(shape, dtype=torch.float64)
    where = []  # (artcloud row, column) of each of ART's token positions, for the gradients
    for s, r in enumerate(rows):
        t = 1
        for b in r:
            for c in range(int(mask[b].sum())):
                art["logprobs"][s, t], art["advantages"][s, t] = old[b, c], advantages[b]
                art["assistant_mask"][s, t], art["weights"][s, t], art["group_ids"][s, t] = True, 1.0, s + 1
                new_art[s, t - 1], ref_art[s, t - 1] = new[b, c], ref[b, c]
                where.append(((s, t - 1), (b, c)))
                t += 1
    return art, new_art, ref_art, where


def _art_dev_config(config: artcloud.TrainConfig) -> dict:
    """What ART's LocalBackend.train hands its loss for these keywords (art/_backend_training.py): unset ones left out."""
    dev = {"ppo": config.loss == "ppo", "importance_sampling_level": config.importance_sampling_level,
           "mask_prob_ratio": config.mask_prob_ratio, "kl_penalty_coef": config.kl_penalty_coef}
    for ours, theirs in (("clip_epsilon", "epsilon"), ("clip_epsilon_high", "epsilon_high"),
                         ("max_negative_advantage_importance_sampling_weight",) * 2, ("kimi_k2_tau",) * 2,
                         ("truncated_importance_sampling",) * 2):
        if getattr(config, ours) is not None:
            dev[theirs] = getattr(config, ours)
    return dev


KNOBS = [
    {},  # ART's defaults: CISPO, epsilon 1.0, epsilon_high 4.0
    {"loss_fn": "ppo"},
    {"epsilon": 0.2, "epsilon_high": 0.28},
    {"loss_fn": "ppo", "epsilon": 0.1, "epsilon_high": 0.3},
    {"importance_sampling_level": "sequence"},
    {"importance_sampling_level": "sequence", "loss_fn": "ppo", "epsilon": 0.1},
    {"importance_sampling_level": "average"},
    {"importance_sampling_level": "geometric_average", "loss_fn": "ppo"},
    {"max_negative_advantage_importance_sampling_weight": 1.3},
    {"mask_prob_ratio": True, "epsilon": 0.2},
    {"mask_prob_ratio": True, "loss_fn": "ppo"},
    {"kimi_k2_tau": 0.3},
    {"kimi_k2_tau": 0.3, "loss_fn": "ppo"},
    {"kl_penalty_coef": 0.5},
    {"kl_penalty_coef": 0.5, "loss_fn": "ppo"},
    {"truncated_importance_sampling": 1.2},
    {"truncated_importance_sampling": 1.2, "loss_fn": "ppo", "importance_sampling_level": "sequence"},
    {"loss_fn": "ppo", "epsilon": 0.2, "importance_sampling_level": "average", "mask_prob_ratio": True,
     "kimi_k2_tau": 0.1, "kl_penalty_coef": 0.2, "truncated_importance_sampling": 1.5,
     "max_negative_advantage_importance_sampling_weight": 2.0},
]


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("knobs", KNOBS, ids=lambda k: ",".join(f"{a}={b}" for a, b in k.items()) or "defaults")
def test_the_loss_and_its_gradient_equal_arts(art_loss, knobs, seed):
    config = artcloud.TrainConfig(**knobs)
    new, old, ref, advantages, mask, sequence = _case(seed)
    art_inputs, new_art, ref_art, where = _art_layout(new, old, ref, advantages, mask, sequence)

    new_art.requires_grad_(True)
    theirs = art_loss.loss_fn(art_inputs, new_art, ref_art, None, _art_dev_config(config))
    theirs.policy_loss.backward()

    new.requires_grad_(True)
    ours = grpo.policy_loss(new, old, advantages, mask, grpo.Knobs.of(config), ref_lp=ref, sequence=sequence,
                            denominator=float(mask.sum()) + 1e-6)  # ART's denominator (reduction "mean")
    ours.loss.backward()

    scale = float(theirs.policy_loss.detach().abs()) + 1.0
    assert abs(float(ours.loss) - float(theirs.policy_loss)) <= F64_BOUND * scale, (float(ours.loss),
                                                                                     float(theirs.policy_loss))
    grads = [(float(new_art.grad[a]), float(new.grad[b])) for a, b in where]
    top = max(abs(t) for t, _ in grads) + 1e-30
    assert all(abs(t - o) <= F64_BOUND * top for t, o in grads), grads
    assert float(new.grad[mask == 0].abs().sum()) == 0.0
    if config.kl_penalty_coef:
        assert ours.kl_policy_ref == pytest.approx(float(theirs.kl_policy_ref), rel=F64_BOUND)


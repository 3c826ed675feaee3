"""How far apart two float computations of one value may be, from the dtype and the magnitudes involved, not
tuned on one machine's kernels (issue 38: a bound tuned where torch picked AVX2 kernels failed where it picked
AVX-512 ones). The tests marked `numeric` compare such pairs; `make test-kernels` runs them again under another
ATEN_CPU_CAPABILITY.

float32: a sum of n terms carries at most ~n x eps/2 of the terms' size in rounding (the classic bound on a recursive
sum), so two computations that sum in different orders (another kernel, batch shape, KV cache, number of ranks)
differ by at most n x eps x that size: `f32_bound`. A logit, and what comes from it (logprobs, the loss, LoRA
gradients), is a dot product over the model's hidden size: n = hidden_size.

Adam: its first updates are lr x m / sqrt(v) ~ lr x sign(gradient), so an element whose gradient is at the level of
that noise may move either way: `assert_same_adam_steps`.
"""

from __future__ import annotations

from typing import Iterable, Mapping

import torch

F32_EPS = torch.finfo(torch.float32).eps  # 1.19e-7
BF16_EPS = torch.finfo(torch.bfloat16).eps  # 7.8e-3

TINY_HIDDEN = 128  # artcloud/tiny-random (artcloud/server/engines/tiny.py; test_engine.py checks it)
SMOLLM2_HIDDEN = 576  # SmolLM2-135M-Instruct

# Adam's sign noise: weights agree to 1 % of one step (float32 rounding of |w| < 1 is under 1.2e-7, far below), but
# for under 1 % of their elements (those whose gradient is within summation noise of 0), and those by at most the
# 2 x lr per gradient step of a flipped sign.
ADAM_AGREE = 0.01
SIGN_NOISE_SHARE = 0.01


def f32_bound(scale: float, terms: int) -> float:
    """The most two float32 sums of `terms` terms of size `scale` can differ when they add in different orders."""
    return terms * F32_EPS * scale


def logprob_bound(logprobs: Iterable[float] | torch.Tensor, hidden_size: int) -> float:
    """Two float32 forward passes' logprobs of the same tokens: each logit is a dot product over `hidden_size`, and a
    logprob (logit - logsumexp) is as large as the logits' spread, which the largest |logprob| measures (at least 1:
    a likely token's logprob is ~0 while its logit is not)."""
    values = torch.as_tensor(logprobs if isinstance(logprobs, torch.Tensor) else list(logprobs), dtype=torch.float64)
    return f32_bound(max(1.0, float(values.abs().max())), hidden_size)


def ratio_bound(logprobs: Iterable[float] | torch.Tensor, hidden_size: int) -> float:
    """How far from 1 an unchanged policy's mean ratio exp(new - old) may be when the two sides' logprobs are two
    float32 forward passes: exp(d) - 1 <= 2 d for d = logprob_bound (< 1)."""
    return 2 * logprob_bound(logprobs, hidden_size)


def assert_same_step_metrics(metrics_a: list[dict], metrics_b: list[dict], samples: list, hidden_size: int) -> None:
    """A training step's metrics computed two ways (samples: engines.base.TrainSample with their old logprobs).
    A token's ratio r moves by r x (exp(d) - 1) <= r x `ratio_bound` when its logprob moves by d, with r < 2 in steps
    that start on policy (their mean ratio is 1 to a few %); the mean ratio moves by as much, a token's loss
    (A x r) by |A| times that; the gradient norm by float32's bound for dot products over the hidden size, at its
    own size; the clip fraction by one token, whose ratio may sit within that noise of a clip edge."""
    ratio = ratio_bound([x for s in samples for x in s.old_logprobs], hidden_size)
    advantage = max(abs(s.advantage) for s in samples)
    assert [m["gradient_step"] for m in metrics_a] == [m["gradient_step"] for m in metrics_b]
    for ma, mb in zip(metrics_a, metrics_b, strict=True):
        assert (ma["tokens"], ma["samples"]) == (mb["tokens"], mb["samples"])
        bounds = {"loss": advantage * 2 * ratio, "mean_ratio": 2 * ratio,
                  "grad_norm": f32_bound(mb["grad_norm"], hidden_size), "clip_fraction": 1 / mb["tokens"]}
        for key, bound in bounds.items():
            assert abs(ma[key] - mb[key]) <= bound, (key, ma[key], mb[key], bound)


def assert_close_f32(actual: torch.Tensor, expected: torch.Tensor, *, scale: float, terms: int) -> None:
    """torch.testing.assert_close with the float32 bound of sums of `terms` terms of size `scale`."""
    torch.testing.assert_close(actual, expected, atol=f32_bound(scale, terms), rtol=0)


def assert_same_adam_steps(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor], lr: float,
                           gradient_steps: int) -> None:
    """Weights after the same AdamW steps computed two ways (another kernel, batch split or number of ranks)."""
    assert sorted(a) == sorted(b) and a
    diff = torch.cat([(a[k].detach() - b[k].detach()).abs().flatten() for k in sorted(a)])
    noisy = float((diff > ADAM_AGREE * lr).float().mean())
    assert noisy < SIGN_NOISE_SHARE and float(diff.max()) <= 2 * lr * gradient_steps, (noisy, float(diff.max()))

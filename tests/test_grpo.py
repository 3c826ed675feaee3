"""GRPO math (advantages, policy loss, token logprobs) and shared-prompt packing on the tiny model."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import tiny_engine_with_adapter
from tolerances import TINY_HIDDEN, assert_close_f32, logprob_bound

from artcloud.server.engines.base import TrainSample
from artcloud.train import grpo, packing
from artcloud.train.advantages import group_advantages
from artcloud.train.grpo import Knobs, policy_loss, token_logprobs

TINY = "artcloud/tiny-random"


# ------------------------------------------------------------------------------------------ advantages


@pytest.mark.numeric
def test_advantages_unbiased_std():
    rewards = [1.0, 2.0, 3.0, 4.0]
    adv = group_advantages(rewards)
    mean = 2.5
    std = math.sqrt(((1.5**2) * 2 + (0.5**2) * 2) / 3)  # unbiased: divide by n - 1
    assert adv == pytest.approx([(r - mean) / std for r in rewards], rel=1e-5)
    t = torch.tensor(rewards)
    assert adv == pytest.approx(((t - t.mean()) / t.std()).tolist(), rel=1e-5)
    assert sum(adv) == pytest.approx(0.0, abs=1e-9)


def test_advantages_two_trajectories():
    adv = group_advantages([0.0, 1.0])
    # mean .5, unbiased std sqrt(.5) -> +-0.5/0.7071
    assert adv == pytest.approx([-1 / math.sqrt(2), 1 / math.sqrt(2)], rel=1e-5)


def test_advantages_equal_rewards_is_none():
    assert group_advantages([0.5, 0.5, 0.5]) is None
    assert group_advantages([1.0, 1.0], scale=False) is None


def test_advantages_single_trajectory_is_none():
    assert group_advantages([3.0]) is None
    assert group_advantages([3.0], scale=False) is None


def test_advantages_unscaled_is_mean_only():
    rewards = [0.0, 1.0, 5.0]
    adv = group_advantages(rewards, scale=False)
    assert adv == pytest.approx([-2.0, -1.0, 3.0])


# ------------------------------------------------------------------------------------------ policy loss


def _setup():
    # B=2, C=3; row 0 has 3 sampled tokens, row 1 has 1 (then padding).
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    adv = torch.tensor([1.5, -0.5])
    old = torch.tensor([[-1.0, -2.0, -0.5], [-3.0, 0.0, 0.0]])
    return mask, adv, old


@pytest.mark.numeric
def test_loss_on_policy_is_minus_mean_advantage():
    mask, adv, old = _setup()
    new = old.clone().requires_grad_(True)
    for kind in ("ppo", "cispo"):
        out = policy_loss(new, old, adv, mask, Knobs(kind=kind))
        if kind == "ppo":
            # ratio 1: per-token loss -A; mean over the 4 masked tokens = -(3*1.5 - 0.5) / 4 = -1.0
            assert out.loss.item() == pytest.approx(-1.0, abs=1e-6)
        assert out.mean_ratio == pytest.approx(1.0, abs=1e-6)
        assert out.clip_fraction == 0.0
        assert out.kl is None
        new.grad = None
        out.loss.backward()
        # d loss / d new_lp = -A * ratio / tokens on masked tokens, 0 on padding.
        expected = -(adv.unsqueeze(1) * mask) / 4.0
        torch.testing.assert_close(new.grad, expected, atol=1e-6, rtol=0)


@pytest.mark.numeric
def test_padding_changes_neither_loss_nor_gradient():
    mask, adv, old = _setup()
    torch.manual_seed(0)
    base = old + 0.1 * torch.randn_like(old)
    noise = 3.0 * torch.randn_like(old) * (1 - mask)  # only at padding
    for kind in ("ppo", "cispo"):
        for kl_coef in (0.0, 0.3):
            results = []
            for new_values in (base, base + noise):
                new = new_values.clone().requires_grad_(True)
                ref = old - 0.2  # a reference that differs from the policy
                out = policy_loss(new, old, adv, mask, Knobs(kind=kind, kl_coef=kl_coef), ref_lp=ref)
                out.loss.backward()
                results.append((out.loss.detach(), new.grad.clone(), out.clip_fraction, out.mean_ratio, out.kl))
            (l0, g0, c0, r0, k0), (l1, g1, c1, r1, k1) = results
            assert not torch.equal(base, base + noise)
            torch.testing.assert_close(l0, l1, atol=1e-6, rtol=0)
            torch.testing.assert_close(g0, g1, atol=1e-7, rtol=0)
            assert torch.all(g0[mask == 0] == 0)
            assert (c0, r0) == pytest.approx((c1, r1))
            if kl_coef:
                assert k0 == pytest.approx(k1)


@pytest.mark.numeric
def test_ppo_clip_high_positive_advantage_has_zero_gradient():
    mask = torch.ones(1, 4)
    adv = torch.tensor([2.0])
    old = torch.full((1, 4), -1.0)
    # ratios 1.5 and 2.0 are beyond 1 + 0.2; 1.1 and 0.9 are inside.
    ratios = torch.tensor([[1.5, 2.0, 1.1, 0.9]])
    new = (old + ratios.log()).requires_grad_(True)
    out = policy_loss(new, old, adv, mask, Knobs(kind="ppo", eps_low=0.2, eps_high=0.2))
    out.loss.backward()
    assert new.grad[0, 0].item() == 0.0 and new.grad[0, 1].item() == 0.0
    # unclipped tokens: d(-ratio*A/4)/d new_lp = -ratio * A / 4
    assert new.grad[0, 2].item() == pytest.approx(-1.1 * 2.0 / 4, rel=1e-5)
    assert new.grad[0, 3].item() == pytest.approx(-0.9 * 2.0 / 4, rel=1e-5)
    assert out.clip_fraction == pytest.approx(0.5)
    # loss: clipped tokens contribute -1.2*A
    expected = -(1.2 * 2 + 1.2 * 2 + 1.1 * 2 + 0.9 * 2) / 4
    assert out.loss.item() == pytest.approx(expected, rel=1e-5)
    assert out.mean_ratio == pytest.approx((1.5 + 2.0 + 1.1 + 0.9) / 4, rel=1e-5)


@pytest.mark.numeric
def test_ppo_clip_low_negative_advantage_and_asymmetric_bounds():
    mask = torch.ones(1, 3)
    old = torch.zeros(1, 3)
    ratios = torch.tensor([[0.5, 1.3, 1.5]])
    new = ratios.log().requires_grad_(True)
    # Negative advantage: ratio 0.5 < 0.8 is clipped (flat); ratios above 1 are NOT clipped (pessimistic side).
    out = policy_loss(new, old, torch.tensor([-1.0]), mask, Knobs(kind="ppo", eps_low=0.2, eps_high=0.4))
    out.loss.backward()
    assert new.grad[0, 0].item() == 0.0
    assert new.grad[0, 1].item() == pytest.approx(1.3 / 3, rel=1e-5)
    assert new.grad[0, 2].item() == pytest.approx(1.5 / 3, rel=1e-5)
    assert out.clip_fraction == pytest.approx(1 / 3)

    # Positive advantage with eps_high=0.4: 1.3 is inside, 1.5 is clipped.
    new2 = ratios.log().requires_grad_(True)
    out2 = policy_loss(new2, old, torch.tensor([1.0]), mask, Knobs(kind="ppo", eps_low=0.2, eps_high=0.4))
    out2.loss.backward()
    assert new2.grad[0, 1].item() != 0.0
    assert new2.grad[0, 2].item() == 0.0
    assert out2.clip_fraction == pytest.approx(1 / 3)


@pytest.mark.numeric
def test_cispo_keeps_gradient_at_clipped_tokens():
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0, 0.0]])
    old = torch.full((1, 5), -2.0)
    ratios = torch.tensor([[1.5, 0.5, 1.1, 3.0, 1.0]])
    adv = torch.tensor([0.7])
    new = (old + ratios.log()).requires_grad_(True)
    D = 10.0
    out = policy_loss(new, old, adv, mask, Knobs(kind="cispo", eps_low=0.2, eps_high=0.2), denominator=D)
    out.loss.backward()
    clipped_w = ratios.clamp(0.8, 1.2)
    expected = -clipped_w * adv * mask / D
    torch.testing.assert_close(new.grad, expected, atol=1e-6, rtol=1e-5)
    assert torch.all(new.grad[0, :4] != 0)
    # 1.5, 0.5 and 3.0 are outside [0.8, 1.2]: 3 of 4 masked tokens
    assert out.clip_fraction == pytest.approx(0.75)
    expected_loss = float((-clipped_w * adv * new.detach() * mask).sum() / D)
    assert out.loss.item() == pytest.approx(expected_loss, rel=1e-5)


@pytest.mark.numeric
def test_kl_term():
    mask, adv, old = _setup()
    new = old.clone()
    base = policy_loss(new, old, adv, mask).loss.item()
    same = policy_loss(new, old, adv, mask, Knobs(kl_coef=0.5), ref_lp=new.clone())
    assert same.loss.item() == pytest.approx(base, abs=1e-7)
    assert same.kl == pytest.approx(0.0, abs=1e-7)

    ref = old + torch.tensor([[0.3, -0.4, 0.1], [0.5, 9.0, 9.0]])  # padding differences must not count
    d = ref - new
    k3 = torch.exp(d) - d - 1
    k3_mean = float((k3 * mask).sum() / mask.sum())
    out = policy_loss(new, old, adv, mask, Knobs(kl_coef=0.5), ref_lp=ref)
    assert k3_mean > 0
    assert out.kl == pytest.approx(k3_mean, rel=1e-5)
    assert out.loss.item() == pytest.approx(base + 0.5 * k3_mean, rel=1e-5)
    assert out.loss.item() > base


@pytest.mark.numeric
def test_denominator_divides():
    mask, adv, old = _setup()
    new = old + 0.05
    plain = policy_loss(new, old, adv, mask).loss.item()  # divided by the 4 masked tokens
    for D in (1.0, 4.0, 17.0):
        out = policy_loss(new, old, adv, mask, denominator=D)
        assert out.loss.item() == pytest.approx(plain * 4.0 / D, rel=1e-6)
        # clip fraction and ratio stay per-token means of this batch
        assert out.mean_ratio == pytest.approx(policy_loss(new, old, adv, mask).mean_ratio)


def test_a_ratio_cap_beyond_float32_caps_nothing():
    """max_negative_advantage_importance_sampling_weight and truncated_importance_sampling of 1e300 (valid: they are
    only > 0) are no cap at all in float32, not a failed step (the fuzzer sent one: clamp refuses a bound float32
    cannot hold)."""
    mask, adv, old = _setup()
    new = (old + torch.tensor([[0.3, -0.4, 0.1], [0.5, 2.0, 9.0]])).requires_grad_(True)
    largest = float(torch.finfo(torch.float32).max)
    for field in ("max_ratio", "truncated_is"):
        huge = policy_loss(new, old, adv, mask, Knobs(**{field: 1e300})).loss.item()
        assert huge == policy_loss(new, old, adv, mask, Knobs(**{field: largest})).loss.item()
    # A ratio is at most e^20 (the log-ratio's clamp): the largest cap leaves the loss as no cap does.
    assert (policy_loss(new, old, adv, mask, Knobs(max_ratio=1e300)).loss.item()
            == policy_loss(new, old, adv, mask).loss.item())


def test_unknown_loss_kind():
    mask, adv, old = _setup()
    with pytest.raises(ValueError):
        policy_loss(old, old, adv, mask, Knobs(kind="reinforce"))


@pytest.mark.numeric
def test_token_logprobs_equals_log_softmax_gather():
    torch.manual_seed(1)
    logits = torch.randn(3, 5, 37) * 4
    targets = torch.randint(0, 37, (3, 5))
    expected = torch.log_softmax(logits, -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    got = token_logprobs(logits, targets)
    assert got.shape == (3, 5)
    # logsumexp and log_softmax: sums over the vocabulary of logits of size |logits|, in float32
    assert_close_f32(got, expected, scale=float(logits.abs().max()), terms=logits.shape[-1])
    # half-precision logits are computed in float32
    got16 = token_logprobs(logits.to(torch.bfloat16), targets)
    assert got16.dtype == torch.float32
    ref16 = torch.log_softmax(logits.to(torch.bfloat16).float(), -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    assert_close_f32(got16, ref16, scale=float(logits.abs().max()), terms=logits.shape[-1])


@pytest.mark.numeric
def test_token_logprobs_at_each_rows_temperature():
    torch.manual_seed(2)
    logits = torch.randn(3, 4, 11) * 3
    targets = torch.randint(0, 11, (3, 4))
    temps = torch.tensor([0.7, 1.0, 2.0])
    got = token_logprobs(logits, targets, temps)
    for b, t in enumerate(temps.tolist()):
        expected = torch.log_softmax(logits[b] / t, -1).gather(-1, targets[b].unsqueeze(-1)).squeeze(-1)
        assert_close_f32(got[b], expected, scale=float(logits[b].abs().max()) / t, terms=logits.shape[-1])
    assert not torch.allclose(got[0], token_logprobs(logits, targets)[0], atol=1e-2)
    # all rows at 1: the same as no temperature
    torch.testing.assert_close(token_logprobs(logits, targets, torch.ones(3)), token_logprobs(logits, targets))


# ------------------------------------------------------------------------------------------ packing


@pytest.fixture(scope="module")
def lora_model(one_torch_thread):
    engine = tiny_engine_with_adapter("pk", scale=0.05)
    model = engine.trainer.peft
    model.set_adapter("pk")
    return engine, model


def _samples(vocab: int) -> list[TrainSample]:
    g = torch.Generator().manual_seed(3)

    def ids(n):
        return torch.randint(3, vocab, (n,), generator=g).tolist()

    samples = []
    for group, plen in enumerate((7, 4)):  # different prompt lengths: left padding matters
        prompt = ids(plen)
        for clen in (5, 2, 3):  # different completion lengths: right padding matters
            samples.append(
                TrainSample(prompt_ids=prompt, completion_ids=ids(clen), old_logprobs=[-1.0] * clen,
                            advantage=float(clen - 3), group=group)
            )
    return samples


def test_pack_layout():
    samples = _samples(100)
    batch = packing.pack(samples, pad_id=0)
    assert batch.prompts.shape == (2, 7)
    assert batch.completions.shape == (6, 5)
    assert batch.prompt_of.tolist() == [0, 0, 0, 1, 1, 1]
    assert batch.shares_prompts
    assert batch.prompt_mask[1].tolist() == [0, 0, 0, 1, 1, 1, 1]  # left-padded
    assert batch.prompts[1, 3:].tolist() == samples[3].prompt_ids
    assert batch.completion_mask[1].tolist() == [1, 1, 0, 0, 0]  # right-padded
    assert batch.completions[1, :2].tolist() == samples[1].completion_ids
    assert batch.old_logprobs[1].tolist() == [-1.0, -1.0, 0.0, 0.0, 0.0]
    assert batch.advantages.tolist() == [2.0, -1.0, 0.0, 2.0, -1.0, 0.0]


@pytest.mark.numeric
def test_shared_prefix_equals_full_sequences(lora_model):
    engine, model = lora_model
    samples = _samples(engine.vocab_size)
    batch = packing.pack(samples, engine.trainer.pad_id)
    assert batch.shares_prompts
    params = [p for _, p in engine.trainer._params("pk")]
    assert params and all(p.requires_grad for p in params)
    weights = torch.randn(batch.completions.shape, generator=torch.Generator().manual_seed(5))

    results = {}
    for shared in (True, False):
        for p in params:
            p.grad = None
        lp = packing.completion_logprobs(model, batch, shared=shared)
        assert lp.shape == batch.completions.shape
        loss = (lp * weights * batch.completion_mask).sum()
        loss.backward()
        results[shared] = (lp.detach(), [p.grad.detach().clone() for p in params])

    m = batch.completion_mask.bool()
    lp_s, g_s = results[True]
    lp_f, g_f = results[False]
    assert torch.all(lp_f[m] <= 0)
    # A shared prompt's KV cache and full sequences sum in other orders (tolerances.logprob_bound).
    torch.testing.assert_close(lp_s[m], lp_f[m], atol=logprob_bound(lp_f[m], TINY_HIDDEN), rtol=0)

    # Gradients through the shared KV cache into the prompt's LoRA activations equal the unpacked ones.
    scale = max(float(g.abs().max()) for g in g_f)
    assert scale > 0
    for a, b in zip(g_s, g_f):
        assert a.abs().sum() > 0
        assert_close_f32(a, b, scale=scale, terms=TINY_HIDDEN)  # LoRA gradients: dot products over the hidden size


@pytest.mark.numeric
def test_full_sequences_match_one_at_a_time(lora_model):
    """Padding in a batch does not change a sample's logprobs: compare with each sample alone."""
    engine, model = lora_model
    samples = _samples(engine.vocab_size)
    with torch.no_grad():
        lp = packing.completion_logprobs(model, packing.pack(samples, engine.trainer.pad_id), shared=False)
        for b, s in enumerate(samples):
            alone = packing.completion_logprobs(model, packing.pack([s], engine.trainer.pad_id), shared=False)
            n = len(s.completion_ids)
            torch.testing.assert_close(lp[b, :n], alone[0, :n], atol=logprob_bound(alone[0, :n], TINY_HIDDEN), rtol=0)


def test_micro_batches_keep_groups_and_budget():
    def sample(prompt, clen):
        return TrainSample(prompt_ids=prompt, completion_ids=[1] * clen, old_logprobs=[0.0] * clen,
                           advantage=1.0, group=prompt[0])

    V = 10
    # Interleaved on purpose: samples of one prompt must end up together.
    samples = [sample([1], 4), sample([2], 3), sample([1], 2), sample([3], 5), sample([2], 3), sample([3], 1),
               sample([4], 2)]
    # 2 samples * C=4 * V=10 = 80 per group-of-two; budget allows 4 samples of length <= 5 (200)
    budget = 200
    batches = packing.micro_batches(samples, V, max_logit_elems=budget)
    flat = [s for b in batches for s in b]
    assert sorted(map(id, flat)) == sorted(map(id, samples))  # nothing lost or duplicated
    for b in batches:
        prompts = {tuple(s.prompt_ids) for s in b}
        C = max(len(s.completion_ids) for s in b)
        if len(prompts) > 1:
            assert len(b) * C * V <= budget
    # every prompt lives in exactly one micro-batch
    where = {}
    for i, b in enumerate(batches):
        for s in b:
            assert where.setdefault(tuple(s.prompt_ids), i) == i
    assert len(batches) > 1

    # A big budget: one micro-batch; a budget below any sample: every sample alone.
    assert len(packing.micro_batches(samples, V, max_logit_elems=10**9)) == 1
    tiny = packing.micro_batches(samples, V, max_logit_elems=1)
    assert [len(b) for b in tiny] == [1] * len(samples)


def test_micro_batches_cut_a_group_too_long_for_the_budget():
    """One long group (8 completions of up to 2048 tokens at a 150 k vocabulary is ~10 GB of logits) is cut
    into chunks that fit, each still one prompt (so packing shares it); only a sample over the budget on
    its own gets a micro-batch over the budget."""
    def sample(prompt, clen):
        return TrainSample(prompt_ids=prompt, completion_ids=[1] * clen, old_logprobs=[0.0] * clen,
                           advantage=1.0, group=prompt[0])

    V = 100
    budget = 2000  # 20 tokens x 1 row, 10 x 2, 5 x 4
    long_group = [sample([7, 7], c) for c in (5, 5, 5, 5, 10, 10, 3, 30)]
    other = [sample([8], 4), sample([8], 4)]
    samples = long_group[:3] + other + long_group[3:]
    batches = packing.micro_batches(samples, V, max_logit_elems=budget)
    flat = [s for b in batches for s in b]
    assert sorted(map(id, flat)) == sorted(map(id, samples))  # nothing lost or duplicated
    for b in batches:
        C = max(len(s.completion_ids) for s in b)
        assert len(b) * C * V <= budget or len(b) == 1
    # In order: 4 x 5 tokens fit; 10 + 10 fit; 3 then 30 (over the budget alone); the other group whole.
    shapes = [[(tuple(s.prompt_ids), len(s.completion_ids)) for s in b] for b in batches]
    assert shapes == [
        [((7, 7), 5)] * 4,
        [((7, 7), 10)] * 2,
        [((7, 7), 3)],
        [((7, 7), 30)],
        [((8,), 4)] * 2,
    ]
    # The chunks of a long group still pack their shared prompt once.
    assert packing.pack(batches[0], pad_id=0).shares_prompts


@pytest.mark.numeric
def test_loss_through_packed_batch_backpropagates(lora_model):
    """End to end on a packed batch: policy_loss over completion_logprobs gives finite grads."""
    engine, model = lora_model
    samples = _samples(engine.vocab_size)
    batch = packing.pack(samples, engine.trainer.pad_id)
    params = [p for _, p in engine.trainer._params("pk")]
    for p in params:
        p.grad = None
    new_lp = packing.completion_logprobs(model, batch)
    out = grpo.policy_loss(new_lp, new_lp.detach(), batch.advantages, batch.completion_mask)
    out.loss.backward()
    assert out.mean_ratio == pytest.approx(1.0, abs=1e-6)
    assert all(torch.isfinite(p.grad).all() for p in params)
    assert sum(float(p.grad.abs().sum()) for p in params) > 0

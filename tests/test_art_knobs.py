"""OpenPipe ART's training knobs where they meet the trainer: whatever the micro-batches, the same update; the KL
reference as another adapter's weights; the learning-rate scalings; advantage_balance; the server's checks of a
KL reference. (The loss itself is checked against ART's art/loss.py in tests/test_art_loss.py.)"""

from __future__ import annotations

import math
import statistics

import pytest
import torch
from conftest import tiny_engine_with_adapter
from tolerances import TINY_HIDDEN, assert_close_f32, assert_same_step_metrics, logprob_bound

from artcloud.server.engines.base import GenerationRequest, SamplingParams, TrainSample
from artcloud.server.samples import balance
from artcloud.train import packing
from artcloud.types import LoraConfig, TrainConfig

LORA = LoraConfig(rank=4, alpha=8.0)
pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def engine():
    return tiny_engine_with_adapter("gen", scale=0.1)


def _multi_turn_samples(engine, seed: int) -> list[TrainSample]:
    """Two groups of three trajectories, each trajectory two turns (two prompts, the second continuing the
    first): a `sequence` id per trajectory, sampled by the engine with its own logprobs."""
    from artcloud.server.chat import render_prompt

    samples = []
    for g, question in enumerate(["What is the capital of France?", "Say a number."]):
        first = render_prompt(engine.tokenizer, [{"role": "user", "content": question}], None)
        out = engine.generate("gen", [GenerationRequest(first, 3, SamplingParams(max_tokens=5, seed=seed + g))])[0]
        for i, c in enumerate(out):
            second = first + c.token_ids + render_prompt(engine.tokenizer, [{"role": "user", "content": "More."}], None)
            (again,) = engine.generate("gen", [GenerationRequest(second, 1, SamplingParams(max_tokens=4, seed=i))])[0]
            advantage = (i - 1.0) or 0.5
            sequence = 3 * g + i
            samples.append(TrainSample(first, c.token_ids, c.logprobs, advantage, g, sequence=sequence))
            samples.append(TrainSample(second, again.token_ids, again.logprobs, advantage, g, sequence=sequence))
    return samples


def _fresh(engine, slot: str, like: str = "gen") -> None:
    engine.create_adapter(slot, LORA)
    with torch.no_grad():
        for (_, mine), (_, theirs) in zip(engine.trainer._params(slot), engine.trainer._params(like)):
            mine.copy_(theirs)


def _step_gradients(engine, slot: str, samples, config, budget: int | None, monkeypatch):
    """The accumulated gradients just before the optimizer steps, and the step's metrics; `budget` caps the
    logits of a micro-batch (None: one micro-batch)."""
    params = [p for _, p in engine.trainer._params(slot)]
    seen = []
    handle = engine.trainer._optimizer(slot).register_step_pre_hook(
        lambda opt, args, kwargs: seen.append([p.grad.detach().clone() for p in params]))
    real = packing.micro_batches
    cuts = []

    def capped(part, vocab_size, max_logit_elems=150_000_000, **kw):
        out = real(part, vocab_size, max_logit_elems=budget if budget is not None else max_logit_elems, **kw)
        cuts.append(out)
        return out

    monkeypatch.setattr(packing, "micro_batches", capped)
    try:
        (metrics,) = engine.train_step(slot, samples, config, lambda m: None)
    finally:
        handle.remove()
        monkeypatch.setattr(packing, "micro_batches", real)
    return seen[0], metrics, cuts


@pytest.mark.numeric
@pytest.mark.parametrize("knobs", [
    {"importance_sampling_level": "sequence"},
    {"importance_sampling_level": "geometric_average", "loss_fn": "ppo", "epsilon": 0.1},
    {"kl_penalty_coef": 0.5},
    {"kl_penalty_coef": 0.3, "importance_sampling_level": "average", "kimi_k2_tau": 0.2},
], ids=lambda k: ",".join(k))
def test_a_knob_gives_the_same_update_however_the_step_is_cut_into_micro_batches(engine, knobs, monkeypatch):
    samples = _multi_turn_samples(engine, seed=11)
    config = TrainConfig(learning_rate=1e-3, max_grad_norm=None, **knobs)
    _fresh(engine, "whole")
    _fresh(engine, "cut")
    whole, m_whole, cuts_whole = _step_gradients(engine, "whole", samples, config, None, monkeypatch)
    cut, m_cut, cuts = _step_gradients(engine, "cut", samples, config, 1, monkeypatch)
    assert len(cuts_whole[-1]) == 1 and len(cuts[-1]) > 1  # one micro-batch, and several
    if config.importance_sampling_level != "token":  # a trajectory's two turns are never cut apart
        assert all(len({s.sequence for s in micro}) == 1 and len(micro) == 2 for micro in cuts[-1])
    # Float32 sums in another order (tolerances.py): gradients and logits are dot products over the hidden size.
    scale = max(float(g.abs().max()) for g in whole)
    assert scale > 0
    for a, b in zip(whole, cut):
        assert_close_f32(a, b, scale=scale, terms=TINY_HIDDEN)
    assert_same_step_metrics([m_cut], [m_whole], samples, TINY_HIDDEN)
    if config.kl_penalty_coef:  # a mean of logprob differences: each within logprob_bound
        assert abs(m_cut["kl_policy_ref"] - m_whole["kl_policy_ref"]) <= 2 * logprob_bound(
            [x for s in samples for x in s.old_logprobs], TINY_HIDDEN)


@pytest.mark.numeric
def test_the_kl_reference_adapter_is_swapped_in_for_its_pass_and_out_after(engine, tmp_path):
    """kl_penalty_reference_step / kl_ref_adapter_path: the reference's logprobs are the saved adapter's. Against
    a reference saved from the policy itself, the KL is 0 and the update is the one without a KL term; against
    a zero adapter (the base model's function) the KL equals the base model's."""
    samples = _multi_turn_samples(engine, seed=5)
    itself, zero = tmp_path / "itself", tmp_path / "zero"
    itself.mkdir(), zero.mkdir()
    engine.save_adapter("gen", itself, optimizer=False)
    engine.create_adapter("zero", LORA)  # LoRA B = 0: the base model
    engine.save_adapter("zero", zero, optimizer=False)

    results = {}
    for name, ref in (("none", None), ("itself", itself), ("base", None), ("zero", zero)):
        _fresh(engine, name)
        knobs = {} if name == "none" else {"kl_penalty_coef": 0.5, "kl_ref_adapter_path": str(ref) if ref else None}
        before = [p.detach().clone() for _, p in engine.trainer._params(name)]
        (m,) = engine.train_step(name, samples, TrainConfig(learning_rate=1e-3, **knobs), lambda m: None)
        after = [p.detach().clone() for _, p in engine.trainer._params(name)]
        results[name] = (m, [a - b for a, b in zip(after, before)])
    # The same weights, kernels and shapes: the same logprobs bit for bit, so no KL, and the step without a KL term.
    assert results["itself"][0]["kl_policy_ref"] == 0.0
    assert results["itself"][0]["loss"] == results["none"][0]["loss"]
    for a, b in zip(results["itself"][1], results["none"][1]):
        assert torch.equal(a, b)  # the swap left the policy's own weights exactly as they were
    assert results["base"][0]["kl_policy_ref"] > 0.01
    # a zero adapter computes what the disabled adapter does, through LoRA's extra (zero) terms
    bound = 2 * logprob_bound([x for s in samples for x in s.old_logprobs], TINY_HIDDEN)
    assert abs(results["zero"][0]["kl_policy_ref"] - results["base"][0]["kl_policy_ref"]) <= bound


def test_the_learning_rate_follows_the_number_of_trajectories(engine):
    samples = _multi_turn_samples(engine, seed=3)  # 6 trajectories over 2 groups
    _fresh(engine, "power")
    steps = engine.train_step("power", samples, TrainConfig(learning_rate=1e-4, gradient_steps=2,
                                                            num_trajectories_learning_rate_multiplier_power=0.5),
                              lambda m: None)
    assert [m["learning_rate"] for m in steps] == pytest.approx([1e-4 * math.sqrt(3)] * 2)  # 3 trajectories a step
    assert engine.trainer._optimizer("power").param_groups[0]["lr"] == pytest.approx(1e-4 * math.sqrt(3))


def test_advantage_balance_shifts_weight_between_signs_and_keeps_the_mean_size():
    def sample(advantage: float, tokens: int) -> TrainSample:
        return TrainSample([1], [2] * tokens, [0.0] * tokens, advantage, 0)

    def size(samples):
        return sum(abs(s.advantage) * len(s.completion_ids) for s in samples)

    for b in (0.5, -0.5, 1.0, -1.0):
        samples = [sample(1.0, 4), sample(-0.5, 2), sample(-1.5, 3), sample(2.0, 1)]
        before = size(samples)
        balance(samples, b)
        pos, neg = [s.advantage for s in samples if s.advantage > 0], [s.advantage for s in samples if s.advantage < 0]
        assert size(samples) == pytest.approx(before)
        if b > 0:  # the negative ones shrink by (1 - b) against the positive ones
            assert neg[0] / pos[0] == pytest.approx(-0.5 / 1.0 * (1 - b)) if b < 1 else not neg
        else:
            assert pos[0] / neg[0] == pytest.approx(1.0 / -0.5 * (1 + b)) if b > -1 else not pos
    untouched = [sample(1.0, 4), sample(-1.0, 2)]
    balance(untouched, 0.0)
    assert [s.advantage for s in untouched] == [1.0, -1.0]


# ------------------------------------------------------------------------------------- through the server


def test_the_server_resolves_or_refuses_a_kl_reference(tiny_server, tmp_path):
    from helpers import rollout_groups, train

    with tiny_server.client() as c:
        groups = rollout_groups(c, "agent", ["ref"], n=3)
        info = c.get("/artcloud/models/agent").json()
        step = info["step"]
        end = train(c, "agent", groups, learning_rate=1e-3, kl_penalty_coef=0.5, kl_penalty_reference_step=step)[-1]
        assert end["data"]["trained"] and end["data"]["metrics"]["kl_policy_ref"] == pytest.approx(0.0, abs=1e-6)
        checkpoint = end["data"]["checkpoint"]  # a TrainResult.checkpoint_path
        groups = rollout_groups(c, "agent", ["ref"], n=3)
        end = train(c, "agent", groups, learning_rate=1e-3, kl_penalty_coef=0.5, kl_ref_adapter_path=checkpoint)[-1]
        assert end["data"]["trained"]

        outside = tmp_path / "1"
        outside.mkdir()
        for config, field in (({"kl_penalty_reference_step": 999}, "config.kl_penalty_reference_step"),
                              ({"kl_ref_adapter_path": str(outside)}, "config.kl_ref_adapter_path"),
                              ({"kl_ref_adapter_path": checkpoint + "/.."}, "config.kl_ref_adapter_path"),
                              ({"kl_ref_adapter_path": "/etc"}, "config.kl_ref_adapter_path")):
            r = c.post("/artcloud/models/agent/train", json={"groups": groups, "config": {"kl_penalty_coef": 0.1,
                                                                                         **config}})
            assert r.status_code == 400 and r.json()["error"]["field"] == field, r.text


def test_the_learning_rate_follows_the_trend_of_the_groups_reward_spread(tiny_server):
    """scale_learning_rate_by_reward_std_dev: a line through (step, mean within-group reward std) of the training
    records and this step; the rate times its value now over its value at step 0."""
    from helpers import chat, group_from, train

    with tiny_server.client() as c:
        r = c.post("/artcloud/models", json={"name": "spread", "project": "tests", "base_model": "artcloud/tiny-random"})
        assert r.status_code == 200, r.text
        spreads = []
        for spread in (1.0, 0.5, 0.25):
            resp = chat(c, "spread", "spread", n=2)
            evs = train(c, "spread", [group_from(resp, "spread", [0.0, spread])], learning_rate=1e-3,
                        scale_learning_rate_by_reward_std_dev=True)
            end = evs[-1]["data"]
            spreads.append((end["step"], spread / 2))  # the population std of two rewards
        history = [r for r in c.get("/artcloud/models/spread").json()["history"] if r.get("source") == "train"]
    points = {r["step"]: r["reward_std_dev"] for r in history}
    xs = list(points)
    mx, my = statistics.fmean(xs), statistics.fmean(points.values())
    slope = sum((x - mx) * (y - my) for x, y in points.items()) / sum((x - mx) ** 2 for x in xs)
    intercept = my - slope * mx
    last = history[-1]
    assert [points[s] for s, _ in spreads] == pytest.approx([v for _, v in spreads])
    assert last["learning_rate"] == pytest.approx(1e-3 * (slope * last["step"] + intercept) / intercept, rel=1e-9)
    assert last["learning_rate"] < 1e-3  # the spread fell: so did the rate


def test_the_reward_spread_factor_stays_within_0_and_1():
    """A fitted line that crosses 0 by this step would give a negative rate (gradient ascent), one that rises a rate
    past the client's: the factor is held to [0, 1], and taken at this step even when the records have it."""
    from artcloud.server.step_config import reward_spread_trend

    def records(spreads: dict[int, float]) -> list[dict]:
        return [{"source": "train", "step": s, "reward_std_dev": v} for s, v in spreads.items()]

    # (1, .5) (2, .5) (3, .02) (4, .02): slope -0.192, intercept 0.74, the line at 4 is -0.028
    assert reward_spread_trend(records({1: 0.5, 2: 0.5, 3: 0.02}), 4, 0.02) == 0.0
    assert reward_spread_trend(records({s: 0.01 + 0.02 * s for s in range(1, 20)}), 20, 0.41) == 1.0
    falling = reward_spread_trend(records({1: 0.5, 2: 0.4}), 3, 0.3)  # y = 0.6 - 0.1 x: 0.3 / 0.6
    assert falling == pytest.approx(0.5, rel=1e-12)
    # (1, .9) (2, .5) (3, .4): y = 1.1 - 0.25 x, at step 2 0.6 / 1.1, whether the records hold step 2 or not
    assert reward_spread_trend(records({1: 0.9, 2: 0.5, 3: 0.4}), 2, 0.5) == pytest.approx(0.6 / 1.1, rel=1e-12)
    assert reward_spread_trend(records({1: 0.9, 3: 0.4}), 2, 0.5) == pytest.approx(0.6 / 1.1, rel=1e-12)


def test_a_kl_reference_deleted_while_its_job_waits_fails_that_job_naming_why(tiny_server):
    """The reference is resolved when the job is posted and read when it runs: a prune in between (ART's template
    calls delete_checkpoints every step) fails the job with checkpoint_not_found, not an I/O error. The job waits
    behind an SFT job that holds the model's queue until its chunks come (the barrier)."""
    from helpers import events, rollout_groups, train

    with tiny_server.client() as c:
        r = c.post("/artcloud/models", json={"name": "kldel", "project": "tests", "base_model": "artcloud/tiny-random"})
        assert r.status_code == 200, r.text
        train(c, "kldel", rollout_groups(c, "kldel", ["a"], n=3), learning_rate=1e-3)  # checkpoints 0 and 1
        holder = c.post("/artcloud/models/kldel/sft", json={"idempotency_key": "hold"}).json()["job_id"]
        r = c.post("/artcloud/models/kldel/train", json={"groups": rollout_groups(c, "kldel", ["b"], n=3),
                                                         "config": {"kl_penalty_coef": 0.1, "kl_penalty_reference_step": 0}})
        assert r.status_code == 202, r.text
        pruned = c.post("/artcloud/models/kldel/checkpoints/prune", json={"best_metric": "val/reward"}).json()
        assert pruned["deleted"] == [0], pruned
        assert c.post(f"/artcloud/jobs/{holder}/sft", json={"seq": 0, "abort": True}).status_code == 200
        end = events(c, r.json()["job_id"])[-1]
        assert end["type"] == "error" and end["data"]["code"] == "checkpoint_not_found", end
        assert "delete" in end["data"]["message"] and c.get("/artcloud/models/kldel").json()["step"] == 1

"""Training integrity: the ratio is taken against the distribution sampled from, nothing non-finite is
ever applied, and a trajectory is trained on the context its turns were sampled from (or refused).

Engine-level tests run the real CPU engine on artcloud/tiny-random; the protocol tests go through a real
`artcloud serve` over HTTPS.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
from conftest import tiny_engine_with_adapter
from helpers import chat, group_from, train
from tolerances import TINY_HIDDEN, logprob_bound, ratio_bound

from artcloud.server.chat import render_prompt
from artcloud.server.engines.base import GenerationRequest, SamplingParams, TrainSample
from artcloud.train.advantages import group_advantages, logprob_temperature
from artcloud.train.loop import NonFiniteError
from artcloud.types import LoraConfig, TrainConfig

LORA = LoraConfig(rank=4, alpha=8.0)


@pytest.fixture(scope="module")
def engine(one_torch_thread):
    return tiny_engine_with_adapter("base", scale=0.1)


def _prompt(engine, text: str) -> list[int]:
    return render_prompt(engine.tokenizer, [{"role": "user", "content": text}], None)


def _copy_adapter(engine, src: str, dst: str) -> None:
    """`dst`: a fresh adapter (fresh optimizer) with the weights of `src`."""
    engine.create_adapter(dst, LORA)
    with torch.no_grad():
        for (_, p), (_, q) in zip(engine.trainer._params(src), engine.trainer._params(dst)):
            q.copy_(p)


def _weights(engine, slot):
    return {n: p.detach().clone() for n, p in engine.trainer._params(slot)}


def _samples(engine, slot, requests, *, temperature_of=lambda c: logprob_temperature(c.temperature)):
    """Training samples from a real rollout, one group per request; each sample's temperature as the
    training route sets it (unless `temperature_of` says otherwise)."""
    out = engine.generate(slot, requests)
    samples = []
    for g, (r, comps) in enumerate(zip(requests, out)):
        rewards = [float(len(c.token_ids)) + 0.1 * i for i, c in enumerate(comps)]
        for c, a in zip(comps, group_advantages(rewards)):
            samples.append(TrainSample(r.prompt_ids, c.token_ids, c.logprobs, a, g, temperature_of(c)))
    return out, samples


# ------------------------------------------------------------------------------------------ temperature


@pytest.mark.numeric
def test_sampled_logprobs_are_at_the_sampling_temperature_and_the_ratio_is_one(engine):
    _copy_adapter(engine, "base", "t_new")
    _copy_adapter(engine, "base", "t_old")
    hot = GenerationRequest(_prompt(engine, "Say a number."), 3, SamplingParams(temperature=0.7, max_tokens=8, seed=5))
    greedy = GenerationRequest(_prompt(engine, "Hello"), 2, SamplingParams(temperature=0.0, max_tokens=8))
    out, samples = _samples(engine, "t_new", [hot, greedy])

    # Independently of packing: one plain forward pass per sample.
    model = engine.trainer.activate("t_new")
    for r, comps in zip([hot, greedy], out):
        for c in comps:
            assert c.temperature == r.params.temperature
            ids = torch.tensor([r.prompt_ids + c.token_ids])
            P, C = len(r.prompt_ids), len(c.token_ids)
            with torch.no_grad():
                logits = model(input_ids=ids).logits[0, P - 1: P + C - 1].float()  # (C, V)
            target = torch.tensor(c.token_ids).unsqueeze(1)
            at_1 = torch.log_softmax(logits, -1).gather(1, target).squeeze(1)
            at_t = torch.log_softmax(logits / logprob_temperature(c.temperature), -1).gather(1, target).squeeze(1)
            # The sampler's cached steps and a full forward sum in other orders.
            torch.testing.assert_close(torch.tensor(c.logprobs), at_t, atol=logprob_bound(at_t, TINY_HIDDEN), rtol=0)
            if c.temperature == 0.7:  # the sampled distribution, not the temperature-1 one
                assert float((torch.tensor(c.logprobs) - at_1).abs().max()) > 1e-2

    # Training divides each row's logits by its temperature (rows at 0.7 and at 1 share one batch):
    # the unchanged policy's ratio is 1.
    cfg = TrainConfig(learning_rate=1e-3)
    first = engine.train_step("t_new", samples, cfg, lambda m: None)[0]
    assert first["mean_ratio"] == pytest.approx(1.0, abs=ratio_bound([x for s in samples for x in s.old_logprobs],
                                                                      TINY_HIDDEN))
    assert first["clip_fraction"] == 0.0

    # Training at T = 1 against logprobs sampled at 0.7 (the old behaviour) is off-policy from the start.
    at_one = [TrainSample(s.prompt_ids, s.completion_ids, s.old_logprobs, s.advantage, s.group, 1.0) for s in samples]
    wrong = engine.train_step("t_old", at_one, cfg, lambda m: None)[0]
    assert abs(wrong["mean_ratio"] - 1.0) > 1e-3


# ------------------------------------------------------------------------------------------ non-finite


def _rollout(engine, slot, seed=0):
    reqs = [GenerationRequest(_prompt(engine, "What is the capital of France?"), 3, SamplingParams(max_tokens=6, seed=seed)),
            GenerationRequest(_prompt(engine, "Name a colour."), 3, SamplingParams(max_tokens=6, seed=seed + 1))]
    return _samples(engine, slot, reqs)[1]


def _assert_not_stepped(engine, slot, before, steps_before, skip=()):
    after = _weights(engine, slot)
    for n, w in before.items():
        if n not in skip:
            assert torch.equal(after[n], w), n
    opt = engine.trainer._optimizer(slot)
    assert [float(s["step"]) for s in opt.state.values()] == steps_before
    assert all(p.grad is None for _, p in engine.trainer._params(slot))  # gradients cleared
    assert not engine.trainer.peft.training  # back in eval mode


def test_non_finite_loss_raises_before_the_optimizer_steps(engine):
    _copy_adapter(engine, "base", "nan_loss")
    samples = _rollout(engine, "nan_loss")
    engine.train_step("nan_loss", samples, TrainConfig(learning_rate=1e-3), lambda m: None)  # a good step first
    steps_before = [float(s["step"]) for s in engine.trainer._optimizer("nan_loss").state.values()]
    assert steps_before and set(steps_before) == {1.0}
    poisoned, param = engine.trainer._params("nan_loss")[0]
    with torch.no_grad():
        param.view(-1)[0] = float("nan")  # one NaN weight makes every logit, and so the loss, NaN
    before = _weights(engine, "nan_loss")
    seen = []
    with pytest.raises(NonFiniteError) as info:
        engine.train_step("nan_loss", samples, TrainConfig(learning_rate=1e-3), seen.append)
    err = info.value
    assert (err.cause, err.gradient_step) == ("loss", 1)
    assert "the loss is not finite" in str(err) and "gradient step 1" in str(err) and "nothing is committed" in str(err)
    assert seen == []
    _assert_not_stepped(engine, "nan_loss", before, steps_before, skip={poisoned})


@pytest.mark.numeric
def test_non_finite_grad_norm_raises_at_its_gradient_step(engine):
    """Rewards far apart with scale_rewards=False give finite advantages of +-1e30: a finite loss whose
    gradient norm overflows. The first gradient step (a sane group) goes through; the second does not."""
    _copy_adapter(engine, "base", "inf_grad")
    samples = _rollout(engine, "inf_grad", seed=10)
    huge = [TrainSample(s.prompt_ids, s.completion_ids, s.old_logprobs, 1e30 if i % 2 else -1e30, s.group, s.temperature)
            for i, s in enumerate(samples) if s.group == 1]
    samples = [s for s in samples if s.group == 0] + huge
    seen = []
    cfg = TrainConfig(learning_rate=1e-3, gradient_steps=2)

    # What the first gradient step leaves, measured on a copy that trains on the sane group alone.
    _copy_adapter(engine, "base", "inf_grad_ref")
    engine.train_step("inf_grad_ref", [s for s in samples if s.group == 0], cfg, lambda m: None)
    after_step_1 = _weights(engine, "inf_grad_ref")

    with pytest.raises(NonFiniteError) as info:
        engine.train_step("inf_grad", samples, cfg, seen.append)
    assert (info.value.cause, info.value.gradient_step) == ("grad_norm", 2)
    assert "gradient norm is not finite (inf) at gradient step 2" in str(info.value)
    assert [m["gradient_step"] for m in seen] == [1]
    after = _weights(engine, "inf_grad")
    for (n, w), w_ref in zip(after.items(), after_step_1.values()):
        assert torch.equal(w, w_ref), n  # step 2 never reached the weights
    assert [float(s["step"]) for s in engine.trainer._optimizer("inf_grad").state.values()] == [1.0] * len(after)


def test_non_finite_parameters_after_the_step_raise(engine):
    """A finite loss and gradient, but a weight decay of 1e40 steps the weights into infinity."""
    _copy_adapter(engine, "base", "inf_param")
    samples = _rollout(engine, "inf_param", seed=20)
    with pytest.raises(NonFiniteError) as info:
        engine.train_step("inf_param", samples, TrainConfig(learning_rate=1.0, weight_decay=1e40), lambda m: None)
    assert (info.value.cause, info.value.gradient_step) == ("parameters", 1)
    assert "LoRA parameter" in str(info.value) and "nothing is committed" in str(info.value)


# ------------------------------------------------------------------------------------------ the protocol


def _post(c, groups, **config):
    # json.dumps, not httpx's json=: it refuses NaN, and a client may well send it.
    body = json.dumps({"groups": groups, "config": config}, allow_nan=True)
    return c.post("/artcloud/models/agent/train", content=body, headers={"content-type": "application/json"})


def test_choices_carry_their_prompt_hash_and_temperature(tiny_server):
    from artcloud.server.chat import prompt_sha256

    with tiny_server.client() as c:
        resp = chat(c, "agent", "Hash me.", n=2, temperature=0.7)
        greedy = chat(c, "agent", "Hash me.", temperature=0)
    expected = prompt_sha256(resp["prompt_token_ids"])
    assert [ch["prompt_sha256"] for ch in resp["choices"]] == [expected, expected]
    assert [ch["temperature"] for ch in resp["choices"]] == [0.7, 0.7]
    assert greedy["choices"][0]["temperature"] == 0.0


def test_nan_logprob_gets_400_naming_the_field(tiny_server):
    with tiny_server.client() as c:
        step0 = c.get("/artcloud/models/agent").json()["step"]
        group = group_from(chat(c, "agent", "nan", n=2), "nan", [0.0, 1.0])
        content = group["trajectories"][1]["messages_and_choices"][1]["logprobs"]["content"]
        k = min(3, len(content) - 1)
        content[k]["logprob"] = float("nan")
        r = _post(c, [group])
        assert r.status_code == 400, r.text
        assert r.json()["error"]["field"] == f"groups[0].trajectories[1].messages_and_choices[1].logprobs.content[{k}].logprob"
        assert "finite" in r.json()["error"]["message"]
        assert c.get("/artcloud/models/agent").json()["step"] == step0


def test_a_turn_longer_than_the_models_context_gets_400_naming_it(tiny_server):
    """The prompt hash covers the prompt only: a completion padded past the model's positions (2,048 for
    tiny-random) must be refused at the boundary, not trained on (3.9 GiB for 8,192 tokens, security review 4)."""
    with tiny_server.client() as c:
        step0 = c.get("/artcloud/models/agent").json()["step"]
        max_context = c.get("/artcloud/status").json()["engines"][0]["max_context"]
        group = group_from(chat(c, "agent", "long", n=2), "long", [0.0, 1.0])
        choice = group["trajectories"][1]["messages_and_choices"][1]
        pad = max_context - len(choice["token_ids"])  # with the prompt, one turn past the context
        choice["token_ids"] += choice["token_ids"][-1:] * pad
        choice["logprobs"]["content"] += choice["logprobs"]["content"][-1:] * pad
        r = _post(c, [group])
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["code"] == "context_too_long"
        assert error["field"] == "groups[0].trajectories[1].messages_and_choices[1].token_ids"
        assert f"over the {max_context} positions this model takes" in error["message"]
        assert c.get("/artcloud/models/agent").json()["step"] == step0


@pytest.mark.parametrize("field", ["prompt_sha256", "temperature"])
def test_choice_without_its_sampling_record_gets_400(tiny_server, field):
    with tiny_server.client() as c:
        group = group_from(chat(c, "agent", "strip", n=2), "strip", [0.0, 1.0])
        del group["trajectories"][1]["messages_and_choices"][1][field]
        r = _post(c, [group])
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["code"] == "invalid_trajectory"
    assert error["field"] == f"groups[0].trajectories[1].messages_and_choices[1].{field}"
    assert "keep the Choice objects" in error["message"]


TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]


@pytest.mark.parametrize("change", ["edited_user_message", "system_prompt_added", "tools_dropped"])
def test_context_that_differs_from_the_sampled_one_gets_400(tiny_server, change):
    with tiny_server.client() as c:
        step0 = c.get("/artcloud/models/agent").json()["step"]
        resp = chat(c, "agent", "Weather in Berlin?", n=2, tools=TOOLS)
        group = group_from(resp, "Weather in Berlin?", [0.0, 1.0])
        for t in group["trajectories"]:
            t["tools"] = TOOLS
        train(c, "agent", [copy.deepcopy(group)])  # as sampled: it trains
        step1 = c.get("/artcloud/models/agent").json()["step"]
        assert step1 == step0 + 1
        traj = group["trajectories"][1]
        if change == "edited_user_message":
            traj["messages_and_choices"][0]["content"] = "Weather in Paris?"
        elif change == "system_prompt_added":
            traj["messages_and_choices"].insert(0, {"role": "system", "content": "Be brief."})
        else:
            traj["tools"] = None
        r = _post(c, [group])
        turn = 2 if change == "system_prompt_added" else 1
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["code"] == "context_mismatch"
        assert error["field"] == f"groups[0].trajectories[1].messages_and_choices[{turn}]"
        assert "differs from the one it was sampled from" in error["message"]
        assert f"groups[0].trajectories[1], turn messages_and_choices[{turn}]" in error["message"]
        assert c.get("/artcloud/models/agent").json()["step"] == step1  # refused before any job


def _two_turns(c, first: str, second: str):
    """A real two-turn conversation: sample, append the reply and a new user message, sample again."""
    messages = [{"role": "user", "content": first}]
    one = chat(c, "agent", messages=messages, n=1, temperature=1.0, seed=1)["choices"][0]
    messages = [*messages, one["message"], {"role": "user", "content": second}]
    two = chat(c, "agent", messages=messages, n=1, temperature=0.8, seed=2)["choices"][0]
    return [messages[0], one, messages[2], two]


@pytest.mark.numeric
def test_multi_turn_trajectories_train_and_an_edit_names_the_turn(tiny_server):
    with tiny_server.client() as c:
        trajectories = [
            {"messages_and_choices": _two_turns(c, "Say a number.", f"And another, {i}?"), "reward": float(i)}
            for i in range(2)
        ]
        evs = train(c, "agent", [{"trajectories": copy.deepcopy(trajectories)}], learning_rate=1e-4)
        assert evs[-1]["data"]["trained"] is True
        step = next(e for e in evs if e["type"] == "step")
        # Two turns per trajectory, each at its own temperature: the ratio of the sampling policy is 1.
        assert step["data"]["samples"] == 4
        sampled = [t["logprob"] for traj in trajectories for turn in traj["messages_and_choices"]
                   if "logprobs" in turn for t in turn["logprobs"]["content"]]
        assert sampled
        assert step["data"]["mean_ratio"] == pytest.approx(1.0, abs=ratio_bound(sampled, TINY_HIDDEN))

        trajectories[1]["messages_and_choices"][2]["content"] = "Something else entirely?"
        r = _post(c, [{"trajectories": trajectories}])
        assert r.status_code == 400, r.text
        assert r.json()["error"]["code"] == "context_mismatch"
        assert r.json()["error"]["field"] == "groups[0].trajectories[1].messages_and_choices[3]"  # the second turn


def test_rewards_whose_advantages_overflow_get_400(tiny_server):
    with tiny_server.client() as c:
        group = group_from(chat(c, "agent", "huge", n=2), "huge", [1e39, 0.0])
        r = _post(c, [group], scale_rewards=False)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["field"] == "groups[0].trajectories"
    assert "overflow" in r.json()["error"]["message"]


def test_a_non_finite_step_is_an_error_event_and_the_model_stays_usable(tiny_server):
    """Rewards 1e30 apart (finite, and accepted) overflow the gradient: the job ends with a `non_finite`
    error naming the cause, nothing is committed, and the model serves and trains as before."""
    from helpers import events

    with tiny_server.client() as c:
        step0 = c.get("/artcloud/models/agent").json()["step"]
        group = group_from(chat(c, "agent", "overflow", n=2), "overflow", [1e30, 0.0])
        r = _post(c, [group], scale_rewards=False)
        assert r.status_code == 202, r.text
        last = events(c, r.json()["job_id"])[-1]
        assert last["type"] == "error" and last["data"]["code"] == "non_finite", last
        assert (last["data"]["cause"], last["data"]["gradient_step"]) == ("grad_norm", 1)
        assert "nothing is committed" in last["data"]["message"]
        assert c.get("/artcloud/models/agent").json()["step"] == step0
        resp = chat(c, "agent", "still fine?", n=2)
        assert all(-1e4 < t["logprob"] <= 0 for ch in resp["choices"] for t in ch["logprobs"]["content"])
        evs = train(c, "agent", [group_from(resp, "still fine?", [0.0, 1.0])])
        assert evs[-1]["data"]["step"] == step0 + 1

"""The CPU engine on artcloud/tiny-random: sampling, logprobs, stop strings, training, save and resume."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_engine_with_adapter
from tolerances import (
    TINY_HIDDEN,
    assert_close_f32,
    assert_same_adam_steps,
    assert_same_step_metrics,
    logprob_bound,
    ratio_bound,
)

from artcloud.server.engines.base import GenerationRequest, SamplingParams, StopStrings, TrainSample
from artcloud.train import packing
from artcloud.train.advantages import group_advantages
from artcloud.types import LoraConfig, TrainConfig

TINY = "artcloud/tiny-random"
LORA = LoraConfig(rank=4, alpha=8.0)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def engine():
    return tiny_engine_with_adapter("gen", scale=0.1)  # non-zero: generation differs from the base model


def _prompt(engine, text: str) -> list[int]:
    from artcloud.server.chat import render_prompt

    return render_prompt(engine.tokenizer, [{"role": "user", "content": text}], None)


def _req(ids, n=1, **params):
    return GenerationRequest(prompt_ids=ids, n=n, params=SamplingParams(**params))


def _recompute(engine, slot, prompt_ids, completions, temperature=1.0):
    """Logprobs of the completions under a fresh full forward pass of `slot`, at `temperature`."""
    samples = [
        TrainSample(prompt_ids=prompt_ids, completion_ids=c.token_ids, old_logprobs=c.logprobs, advantage=0.0, group=0,
                    temperature=temperature)
        for c in completions
    ]
    batch = packing.pack(samples, engine.trainer.pad_id)
    model = engine.trainer.activate(slot) if slot else engine.trainer.peft
    with torch.no_grad():
        if slot is None:
            with engine.trainer.peft.disable_adapter():
                lp = packing.completion_logprobs(engine.trainer.peft, batch, shared=False)
        else:
            lp = packing.completion_logprobs(model, batch, shared=False)
    return [lp[b, : len(c.token_ids)] for b, c in enumerate(completions)]


# ------------------------------------------------------------------------------------------ generation


def test_generate_shapes(engine):
    p1, p2 = _prompt(engine, "What is the capital of France?"), _prompt(engine, "Hi")
    out = engine.generate("gen", [_req(p1, 3, max_tokens=6), _req(p2, 2, max_tokens=6)])
    assert [len(x) for x in out] == [3, 2]
    for comps in out:
        for c in comps:
            assert 1 <= len(c.token_ids) <= 6
            assert len(c.logprobs) == len(c.token_ids)
            assert all(lp <= 0.0 for lp in c.logprobs)
            assert c.top_logprobs is None
            assert c.finish_reason in ("stop", "length")
            if c.finish_reason == "length":
                assert len(c.token_ids) == 6
            else:
                assert c.token_ids[-1] in engine.sampler.eos_ids.tolist()
    assert engine.generate("gen", []) == []


@pytest.mark.numeric
@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.6, 0.9)])
def test_logprobs_equal_a_fresh_forward_pass(engine, temperature, top_p):
    """Sampling logprobs are of the distribution sampled from: log_softmax(logits / T) before top-p, what
    training computes at the same T, so the ratio of an unchanged policy is 1.

    Prompts of different lengths (left padding) and rows that finish early (the cache shrinks mid-batch)."""
    assert engine.trainer.peft.config.hidden_size == TINY_HIDDEN  # the n of the bounds (tolerances.py)
    p1 = _prompt(engine, "The quick brown fox jumps over the lazy dog.")
    p2 = _prompt(engine, "Numbers")
    reqs = [_req(p1, 2, max_tokens=3, temperature=temperature, top_p=top_p, seed=1),
            _req(p2, 3, max_tokens=12, temperature=temperature, top_p=top_p, seed=2)]
    out = engine.generate("gen", reqs)
    for r, comps in zip(reqs, out):
        at_t = _recompute(engine, "gen", r.prompt_ids, comps, temperature=temperature)
        at_1 = _recompute(engine, "gen", r.prompt_ids, comps, temperature=1.0)
        for c, lp, lp1 in zip(comps, at_t, at_1):
            assert c.temperature == temperature
            # The sampler's cached steps and a full forward sum in other orders.
            torch.testing.assert_close(torch.tensor(c.logprobs), lp, atol=logprob_bound(lp, TINY_HIDDEN), rtol=0)
            if temperature != 1.0:  # the temperature matters: these are not the T = 1 logprobs
                assert float((torch.tensor(c.logprobs) - lp1).abs().max()) > 1e-2


@pytest.mark.numeric
def test_base_model_generation_is_not_the_adapter(engine):
    p = _prompt(engine, "Write a sentence of exactly five words.")
    base = engine.generate(None, [_req(p, 1, max_tokens=8, temperature=0.0)])[0][0]
    lp = _recompute(engine, None, p, [base])[0]
    torch.testing.assert_close(torch.tensor(base.logprobs), lp, atol=logprob_bound(lp, TINY_HIDDEN), rtol=0)
    adapted = engine.generate("gen", [_req(p, 1, max_tokens=8, temperature=0.0)])[0][0]
    assert adapted.logprobs != pytest.approx(base.logprobs[: len(adapted.logprobs)], abs=1e-3)


@pytest.mark.numeric
def test_greedy_is_deterministic(engine):
    p = _prompt(engine, "Call the weather tool for Berlin.")
    a = engine.generate("gen", [_req(p, 3, max_tokens=10, temperature=0.0, top_logprobs=1)])[0]
    b = engine.generate("gen", [_req(p, 1, max_tokens=10, temperature=0.0)])[0]
    assert a[0].token_ids == a[1].token_ids == a[2].token_ids == b[0].token_ids
    # greedy picks the most likely token each step
    for c in a:
        for tok, lp, top in zip(c.token_ids, c.logprobs, c.top_logprobs):
            assert top[0][0] == tok
            assert top[0][1] == pytest.approx(lp, abs=1e-6)


@pytest.mark.numeric
def test_same_seed_same_tokens_even_batched(engine):
    p = _prompt(engine, "Reinforcement learning trains agents from rewards.")
    other = _prompt(engine, "Group relative policy optimisation compares several answers to the same prompt.")
    alone = engine.generate("gen", [_req(p, 2, max_tokens=10, seed=1234)])[0]
    batched = engine.generate(
        "gen",
        [_req(other, 3, max_tokens=14), _req(p, 2, max_tokens=10, seed=1234), _req(other, 1, max_tokens=2, seed=9)],
    )[1]
    assert [c.token_ids for c in batched] == [c.token_ids for c in alone]
    assert alone[0].token_ids != alone[1].token_ids  # the n samples of a seeded request still differ
    # and two requests with the same seed in one batch give the same samples
    twins = engine.generate("gen", [_req(p, 1, max_tokens=10, seed=7), _req(p, 1, max_tokens=10, seed=7)])
    assert twins[0][0].token_ids == twins[1][0].token_ids
    different = engine.generate("gen", [_req(p, 2, max_tokens=10, seed=1235)])[0]
    assert [c.token_ids for c in different] != [c.token_ids for c in alone]


@pytest.mark.numeric
def test_tiny_top_p_equals_greedy(engine):
    p = _prompt(engine, "What is the capital of France?")
    greedy = engine.generate("gen", [_req(p, 1, max_tokens=10, temperature=0.0)])[0][0]
    nucleus = engine.generate("gen", [_req(p, 3, max_tokens=10, temperature=1.0, top_p=1e-6)])[0]
    for c in nucleus:
        assert c.token_ids == greedy.token_ids
        # 3 rows against 1: other shapes, other sums
        assert c.logprobs == pytest.approx(greedy.logprobs, abs=logprob_bound(greedy.logprobs, TINY_HIDDEN))


def test_max_tokens_and_length_finish(engine):
    p = _prompt(engine, "Hello")
    full = engine.generate("gen", [_req(p, 1, max_tokens=12, temperature=0.0)])[0][0]
    eos = set(engine.sampler.eos_ids.tolist())
    assert not eos & set(full.token_ids[:4])  # precondition: no EOS in the first four greedy tokens
    c = engine.generate("gen", [_req(p, 1, max_tokens=4, temperature=0.0)])[0][0]
    assert c.token_ids == full.token_ids[:4]
    assert c.finish_reason == "length"
    short = engine.generate("gen", [_req(p, 2, max_tokens=1)])[0]
    assert all(len(x.token_ids) == 1 for x in short)


def _pick_stop(engine, tokens: list[int]) -> tuple[str, int]:
    """An ASCII stop string that first appears when token k is decoded (k >= 2)."""
    tok = engine.tokenizer
    for k in range(2, len(tokens)):
        piece = tok.decode([tokens[k]])
        stripped = piece.strip()
        if len(stripped) >= 2 and stripped.isascii() and stripped.isprintable():
            before = tok.decode(tokens[:k])
            if stripped not in before and stripped in tok.decode(tokens[: k + 1]):
                return stripped, k
    raise AssertionError("no usable stop string in the greedy continuation")


@pytest.mark.numeric
def test_stop_string_cuts_text(engine):
    p = _prompt(engine, "The capital of France is")
    sampling = dict(max_tokens=24, temperature=1.0, seed=3)  # seeded: the same tokens with and without a stop
    full = engine.generate("gen", [_req(p, 1, **sampling)])[0][0]
    stop, k = _pick_stop(engine, full.token_ids)
    c = engine.generate("gen", [_req(p, 1, stop=[stop, "never-in-here"], **sampling)])[0][0]
    assert c.finish_reason == "stop"
    assert c.token_ids == full.token_ids[: k + 1]  # generation stopped at the token completing the stop
    assert len(c.logprobs) == len(c.token_ids)
    assert c.logprobs == pytest.approx(full.logprobs[: k + 1], abs=logprob_bound(full.logprobs, TINY_HIDDEN))
    full_text = full.text
    assert stop not in c.text
    assert c.text == full_text[: full_text.index(stop)]
    # an unrelated request in the same batch is not stopped by it
    both = engine.generate("gen", [_req(p, 1, stop=[stop], **sampling), _req(p, 1, **sampling)])
    assert both[0][0].token_ids == c.token_ids
    assert both[1][0].token_ids == full.token_ids
    assert both[1][0].finish_reason == full.finish_reason


@pytest.mark.numeric
def test_top_logprobs(engine):
    p = _prompt(engine, "Numbers: 0 1 2")
    out = engine.generate("gen", [_req(p, 2, max_tokens=5, top_logprobs=3), _req(p, 1, max_tokens=5)])
    for c in out[0]:
        assert len(c.top_logprobs) == len(c.token_ids)
        for tok, lp, top in zip(c.token_ids, c.logprobs, c.top_logprobs):
            assert len(top) == 3
            values = [v for _, v in top]
            assert values == sorted(values, reverse=True)
            assert all(v <= 0 for v in values)
            assert len({t for t, _ in top}) == 3
            assert lp <= values[0] + 1e-6
            if tok in [t for t, _ in top]:
                assert dict(top)[tok] == pytest.approx(lp, abs=1e-6)
            else:
                assert lp <= values[-1] + 1e-6
    assert out[1][0].top_logprobs is None


def test_stop_strings_unit(engine):
    tok = engine.tokenizer
    ids = tok("The capital of France is Paris.", add_special_tokens=False)["input_ids"]
    s = StopStrings(tok, ["Paris", "zzz"])
    assert s.window == 5
    hits = [s.check(ids[: i + 1]) for i in range(len(ids))]
    first = hits.index(True)
    assert "Paris" in tok.decode(ids[: first + 1]) and "Paris" not in tok.decode(ids[:first])
    assert all(hits[first:])
    assert s.cut("The capital of France is Paris. Paris!") == "The capital of France is "
    assert s.cut("no stop here") == "no stop here"
    # the earliest of several stop strings wins
    assert StopStrings(tok, ["B", "A"]).cut("xxAyyB") == "xx"
    empty = StopStrings(tok, [])
    assert not empty.check(ids) and empty.cut("abc") == "abc"
    # only the tail is decoded: a stop string far back in a long completion is not found again
    long_ids = tok("Paris" + " 1 2 3 4 5 6 7 8 9 10" * 5, add_special_tokens=False)["input_ids"]
    assert not StopStrings(tok, ["Paris"]).check(long_ids)
    assert StopStrings(tok, ["9 10"]).check(long_ids)


# ------------------------------------------------------------------------------------------ training


def _rollout_samples(engine, slot, seed=0):
    prompts = [_prompt(engine, "What is the capital of France?"), _prompt(engine, "Say a number.")]
    reqs = [_req(p, 3, max_tokens=6, seed=seed + i) for i, p in enumerate(prompts)]
    out = engine.generate(slot, reqs)
    samples = []
    for g, (r, comps) in enumerate(zip(reqs, out)):
        rewards = [float(len(c.token_ids) % 3) + 0.1 * i for i, c in enumerate(comps)]
        for c, a in zip(comps, group_advantages(rewards)):
            samples.append(TrainSample(prompt_ids=r.prompt_ids, completion_ids=c.token_ids,
                                       old_logprobs=c.logprobs, advantage=a, group=g))
    return samples


def _weights(engine, slot):
    return {n: p.detach().clone() for n, p in engine.trainer._params(slot)}


@pytest.mark.numeric
def test_train_step_changes_adapter(engine):
    engine.create_adapter("trn", LORA)
    samples = _rollout_samples(engine, "trn")
    before = _weights(engine, "trn")
    assert all(float(v.abs().sum()) == 0 for n, v in before.items() if "lora_B" in n)
    seen = []
    cfg = TrainConfig(learning_rate=1e-3, gradient_steps=2)
    metrics = engine.train_step("trn", samples, cfg, seen.append)
    assert len(metrics) == 2 and seen == metrics
    for i, m in enumerate(metrics):
        assert m["gradient_step"] == i + 1 and m["gradient_steps"] == 2
        assert {"loss", "grad_norm", "clip_fraction", "mean_ratio", "tokens", "samples"} <= set(m)
        assert m["grad_norm"] > 0 and torch.isfinite(torch.tensor(m["loss"]))
        assert m["samples"] == 3  # one group per gradient step
    # first gradient step: the policy is the sampling policy, so the ratio is 1 and nothing is clipped
    assert metrics[0]["mean_ratio"] == pytest.approx(1.0, abs=ratio_bound([x for s in samples for x in s.old_logprobs],
                                                                          TINY_HIDDEN))
    assert metrics[0]["clip_fraction"] == 0.0
    after = _weights(engine, "trn")
    # lora_B starts at zero and moves first; after the second step lora_A has a gradient too
    assert all(not torch.equal(before[n], after[n]) for n in before if "lora_B" in n)
    assert any(not torch.equal(before[n], after[n]) for n in before if "lora_A" in n)
    # the other adapter was not touched
    assert all(p.grad is None for _, p in engine.trainer._params("gen"))
    # the model is back in eval mode
    assert not engine.trainer.peft.training


@pytest.mark.numeric
def test_train_step_kl_reports_kl(engine):
    engine.create_adapter("kl", LORA)
    samples = _rollout_samples(engine, "kl", seed=10)
    cfg = TrainConfig(learning_rate=1e-2, kl_coef=0.1, loss="cispo")
    m1 = engine.train_step("kl", samples, cfg, lambda m: None)[0]
    assert m1["kl"] == pytest.approx(0.0, abs=1e-6)  # adapter starts equal to the base model
    m2 = engine.train_step("kl", samples, cfg, lambda m: None)[0]
    assert m2["kl"] > 0


@pytest.mark.numeric
def test_save_load_resume_is_exact(engine, tmp_path):
    from artcloud.server.engines.cpu import OPTIMIZER_FILE, CPUEngine

    slot = "sav"
    engine.create_adapter(slot, LORA)
    samples = _rollout_samples(engine, slot, seed=20)
    cfg = TrainConfig(learning_rate=1e-3)
    engine.train_step(slot, samples, cfg, lambda m: None)
    engine.train_step(slot, samples, cfg, lambda m: None)

    folder = tmp_path / "ckpt"
    folder.mkdir()
    files = engine.save_adapter(slot, folder, optimizer=True)
    assert sorted(files) == sorted(["adapter_config.json", "adapter_model.safetensors", OPTIMIZER_FILE])
    assert all((folder / f).is_file() for f in files)

    other = CPUEngine(TINY)
    other.load_adapter(slot, LORA, folder, optimizer=True)

    w1, w2 = _weights(engine, slot), _weights(other, slot)
    assert w1.keys() == w2.keys() and w1
    for n in w1:
        assert torch.equal(w1[n], w2[n]), n

    s1, s2 = engine.trainer.optimizers[slot].state_dict(), other.trainer.optimizers[slot].state_dict()
    assert s1["state"].keys() == s2["state"].keys() and len(s1["state"]) == len(w1)
    for i in s1["state"]:
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(torch.as_tensor(s1["state"][i][key]), torch.as_tensor(s2["state"][i][key])), (i, key)
    assert float(s1["state"][0]["step"]) == 2.0
    assert s1["param_groups"][0]["lr"] == s2["param_groups"][0]["lr"]

    # One more identical step on both: identical weights (resume is exact).
    _weights_before = _weights(engine, slot)
    engine.train_step(slot, samples, cfg, lambda m: None)
    other.train_step(slot, samples, cfg, lambda m: None)
    w1, w2 = _weights(engine, slot), _weights(other, slot)
    for n in w1:
        assert torch.equal(w1[n], w2[n]), (n, float((w1[n] - w2[n]).abs().max()))
    assert any(not torch.equal(w1[n], w0) for n, w0 in _weights_before.items())


def test_saved_adapter_config_is_plain_json(engine, tmp_path):
    """adapter_config.json must keep target_modules a JSON list (peft reads a string as a regex)."""
    import json

    folder = tmp_path / "adapter"
    folder.mkdir()
    engine.save_adapter("gen", folder, optimizer=False)
    cfg = json.loads((folder / "adapter_config.json").read_text())
    assert cfg["base_model_name_or_path"] == TINY
    assert cfg["r"] == LORA.rank and cfg["lora_alpha"] == LORA.alpha
    assert isinstance(cfg["target_modules"], list), cfg["target_modules"]
    assert sorted(cfg["target_modules"]) == sorted(LORA.target_modules)


@pytest.mark.numeric
def test_saved_adapter_loads_with_peft(engine, tmp_path):
    from peft import PeftModel

    from artcloud.server.engines import loading

    slot = "gen"
    folder = tmp_path / "adapter"
    folder.mkdir()
    engine.save_adapter(slot, folder, optimizer=False)
    assert not (folder / "optimizer.pt").exists()

    base, _ = loading.load(TINY)
    peft_model = PeftModel.from_pretrained(base, folder)
    peft_model.eval()
    ids = torch.tensor([_prompt(engine, "What is the capital of France?")])
    with torch.no_grad():
        expected = engine.trainer.activate(slot)(input_ids=ids).logits
        got = peft_model(input_ids=ids).logits
        with engine.trainer.peft.disable_adapter():
            plain = engine.trainer.peft(input_ids=ids).logits
    assert (expected - plain).abs().max() > 1e-3  # the adapter matters
    assert_close_f32(got, expected, scale=float(expected.abs().max()), terms=TINY_HIDDEN)  # logits: dot products over H


@pytest.mark.numeric
@pytest.mark.parametrize("cut", ["groups", "split_groups", "samples"])
def test_micro_batching_gives_the_same_update(engine, monkeypatch, cut):
    """Gradient accumulation over micro-batches (each divided by the step's token count) equals one batch,
    whether the micro-batches hold whole groups, chunks of a group too long for the budget (still
    sharing their prompt), or single samples."""
    samples = _rollout_samples(engine, "gen", seed=30)
    one, two = f"mb1{cut}", f"mb2{cut}"
    engine.create_adapter(one, LORA)
    engine.create_adapter(two, LORA)
    g = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for (n1, p1), (n2, p2) in zip(engine.trainer._params(one), engine.trainer._params(two)):
            assert n1.replace(f".{one}.", ".") == n2.replace(f".{two}.", ".")
            p1.copy_(torch.randn(p1.shape, generator=g) * 0.05)
            p2.copy_(p1)
    cfg = TrainConfig(learning_rate=1e-3, max_grad_norm=None)

    def grads_at_step(slot):
        """The accumulated gradients, recorded just before the optimizer steps."""
        seen = []
        params = [p for _, p in engine.trainer._params(slot)]
        handle = engine.trainer._optimizer(slot).register_step_pre_hook(
            lambda opt, args, kwargs: seen.append([p.grad.detach().clone() for p in params])
        )
        return seen, handle

    grads1, h1 = grads_at_step(one)
    whole = engine.train_step(one, samples, cfg, lambda m: None)[0]
    h1.remove()

    # Budgets in logit floats: a group of 3 samples fits in 3 * C * V but two groups do not; a group is
    # too long for 2 * C * V and is cut into chunks of at most 2; nothing fits in 1.
    C, V = max(len(s.completion_ids) for s in samples), engine.vocab_size
    budget = {"groups": 3 * C * V, "split_groups": 2 * C * V, "samples": 1}[cut]
    real = packing.micro_batches
    cuts = []

    def small_budget(samples, vocab_size, max_logit_elems=0, **kw):
        out = real(samples, vocab_size, max_logit_elems=budget, **kw)
        cuts.append(out)
        return out

    monkeypatch.setattr(packing, "micro_batches", small_budget)
    grads2, h2 = grads_at_step(two)
    split = engine.train_step(two, samples, cfg, lambda m: None)[0]
    h2.remove()
    assert len(cuts) == 1
    per_prompt = [[len({tuple(s.prompt_ids) for s in b}), len(b)] for b in cuts[0]]
    if cut == "groups":
        assert per_prompt == [[1, 3], [1, 3]]
    elif cut == "split_groups":  # each group of 3 is cut in two; the chunk of 2 still shares its prompt
        assert per_prompt == [[1, 2], [1, 1], [1, 2], [1, 1]]
    else:
        assert per_prompt == [[1, 1]] * 6
    # Smaller batches are other shapes, summed by other kernels: float32's bounds (tolerances.py).
    assert_same_step_metrics([split], [whole], samples, TINY_HIDDEN)
    assert len(grads1) == len(grads2) == 1
    scale = max(float(x.abs().max()) for x in grads1[0])
    assert scale > 0
    for a, b in zip(grads1[0], grads2[0]):
        assert_close_f32(a, b, scale=scale, terms=TINY_HIDDEN)
    # Adam's first step is ~lr * sign(g): a gradient that is ~0 may flip sign from summation order.
    assert_same_adam_steps(dict(enumerate(p for _, p in engine.trainer._params(one))),
                           dict(enumerate(p for _, p in engine.trainer._params(two))), cfg.learning_rate, 1)


def test_rng_state_roundtrip(engine):
    import json

    p = _prompt(engine, "Say a number.")
    state = json.loads(json.dumps(engine.rng_state()))  # it goes into trainer_state.json
    first = engine.generate("gen", [_req(p, 2, max_tokens=8)])[0]
    engine.set_rng_state(state)
    again = engine.generate("gen", [_req(p, 2, max_tokens=8)])[0]
    assert [c.token_ids for c in again] == [c.token_ids for c in first]


def test_delete_adapter(engine):
    engine.create_adapter("tmp", LORA)
    assert engine.trainer._params("tmp")
    engine.delete_adapter("tmp")
    assert "tmp" not in engine.trainer.names
    assert "tmp" not in engine.trainer.peft.peft_config
    out = engine.generate("gen", [_req(_prompt(engine, "Hi"), 1, max_tokens=3)])
    assert len(out[0][0].token_ids) >= 1


def test_the_vllm_child_gets_the_servers_environment_without_its_secrets():
    """D13: vLLM runs as our child; it needs the machine's settings (PATH, HOME, CUDA, the hub, torch), never the
    server's token, TLS key, S3 or cloud credentials, or a secret the user passed to the sandbox."""
    from artcloud.server.engines.children import child_env

    kept = {"PATH": "/usr/bin", "HOME": "/root", "CUDA_VISIBLE_DEVICES": "0", "VLLM_CPU_KVCACHE_SPACE": "1",
            "HF_HOME": "/hf", "HF_TOKEN": "hf_x", "HF_HUB_OFFLINE": "1", "TORCH_CUDA_ARCH_LIST": "9.0",
            "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True", "TOKENIZERS_PARALLELISM": "false", "LANG": "C.UTF-8",
            "ARTCLOUD_CACHE": "/models"}  # where the models are: a child fetching its own would be a second download
    dropped = {"ARTCLOUD_TOKEN": "t" * 32, "ARTCLOUD_TLS_KEY": "-----BEGIN PRIVATE KEY-----", "ARTCLOUD_TLS_CERT": "c",
               "ARTCLOUD_S3": "s3://b/p", "ARTCLOUD_S3_ACCESS_KEY_ID": "a", "ARTCLOUD_S3_SECRET_ACCESS_KEY": "s",
               "ARTCLOUD_S3_ENDPOINT_URL": "http://s3", "AWS_ACCESS_KEY_ID": "a", "AWS_SECRET_ACCESS_KEY": "s",
               "AWS_SESSION_TOKEN": "t", "WANDB_API_KEY": "w", "OPENAI_API_KEY": "o", "GITHUB_TOKEN": "g",
               "DB_PASSWORD": "p", "GOOGLE_APPLICATION_CREDENTIALS": "/key.json"}
    assert child_env({**kept, **dropped}) == kept


def test_a_converted_model_is_cached_per_transformers_version(tmp_path, monkeypatch):
    """Two venvs with two transformers versions share ~/.cache/artcloud: neither reads the other's copy."""
    import transformers

    from artcloud.server.engines import loading

    monkeypatch.setenv("ARTCLOUD_CACHE", str(tmp_path))
    built = []

    def build(folder):
        built.append(transformers.__version__)
        (folder / "config.json").write_text("{}")

    first = loading._cached("org/model", build)
    assert first == loading._cached("org/model", build) and len(built) == 1  # built once, then read
    monkeypatch.setattr(transformers, "__version__", "0.0.1")
    other = loading._cached("org/model", build)
    assert other != first and other.parent == first.parent and len(built) == 2
    assert first.name.endswith(f"@transformers-{built[0]}") and other.name.endswith("@transformers-0.0.1")

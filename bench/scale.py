"""Scale-out, as far as it is built: rollouts over 1 and 2 inference replicas, and one GRPO training step with the
peft trainer in one process against the sharded trainer (FSDP2 under torchrun, gloo) on 1 and 2 ranks, same
samples, side by side with ratios.

A step is `--groups` groups of `--completions` sampled completions of `--tokens` tokens (random ids with the
base policy's own logprobs, as in tests/test_sharded.py), `--gradient-steps` optimizer steps. Each side runs
a warm-up step, then `--iters` timed ones (median). The sharded trainer is timed as the server uses it
(ShardedTrainer: the call to rank 0 over its socket included); its start-up (torchrun, each rank loading the
model) is reported apart.

On this machine's 2 cores no speed-up is expected: two ranks share the cores one process already uses, and
gloo all-gathers each layer's weights over loopback. On GPUs a step is bound by each rank's forward and
backward over its slice, plus NCCL's all-gather of weights and reduce-scatter of LoRA gradients (small): K
ranks approach K times one GPU's samples per second when the step has enough groups for all of them.

Rollouts (`--rollouts N`, 0 skips them): N requests of `--completions` samples of `--tokens` tokens, in batches of 8
as the server's batcher hands them over, through a ReplicaSet (engines/replicas.py) of one torch sampler in this process, and
of that sampler plus an `artcloud replica` process (HTTPS, the launch's token) beside it. On 2 cores the second
replica only shares the cores the first already uses, plus the HTTPS hop: no speed-up is expected. On a cluster each
replica is another node's vLLM, and rollouts/s grows with the replicas while the head's router (a hash per 16
prompt tokens) and the network are far from the bound.

    .venv/bin/python bench/scale.py                    # SmolLM2, 8 groups x 4 completions x 32 tokens
    .venv/bin/python bench/scale.py --model artcloud/tiny-random --iters 2
    .venv/bin/python bench/scale.py --iters 0 --rollouts 32      # the rollouts only
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import argparse
import statistics
import time
from typing import Any, Callable


def samples_for(trainer: Any, groups: int, completions: int, tokens: int) -> list[Any]:
    import torch

    from artcloud.server import chat
    from artcloud.server.engines.base import TrainSample
    from artcloud.train import packing

    g = torch.Generator().manual_seed(0)
    out = []
    for group in range(groups):
        prompt = chat.render_prompt(trainer.tokenizer, [{"role": "user", "content": f"Question {group}: say a word."}], None)
        for j in range(completions):
            ids = torch.randint(0, trainer.vocab_size, (tokens,), generator=g).tolist()
            out.append(TrainSample(prompt, ids, [0.0] * tokens, float(j - (completions - 1) / 2) or 0.5, group))
    with torch.no_grad():
        lp = packing.completion_logprobs(trainer.model, packing.pack(out, trainer.pad_id))
    for i, s in enumerate(out):
        s.old_logprobs = lp[i, :tokens].tolist()
    return out


def timed(step: Callable[[], Any], iters: int) -> float:
    step()  # warm-up
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        step()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def rollouts(model: str, requests: int, completions: int, tokens: int) -> dict[str, float]:
    """Seconds for `requests` requests through one replica (a torch sampler here), then two (plus a replica process)."""
    import re
    import subprocess
    import sys
    import tempfile
    from pathlib import Path

    from artcloud.server.engines.base import GenerationRequest, SamplingParams
    from artcloud.server.engines.replicas import RemoteSampler, ReplicaSet
    from artcloud.server.replica import make_sampler
    from artcloud.tls import make_launch_secrets

    def run(replicas: ReplicaSet, label: str) -> float:
        prompt_ids = [replicas.replicas[0].sampler.tokenizer.encode(f"{label} question {i}: say a word.")
                      for i in range(requests)]
        params = SamplingParams(temperature=1.0, max_tokens=tokens)

        def batch(ids: list[list[int]]) -> None:  # as the server's batcher hands them over: 8 requests a call
            replicas.generate(None, [GenerationRequest(prompt_ids=i, n=completions, params=params) for i in ids])

        batch(prompt_ids[:8])  # warm-up
        t = time.perf_counter()
        for start in range(0, requests, 8):
            batch(prompt_ids[start:start + 8])
        return time.perf_counter() - t

    local = make_sampler("cpu", model, {}, workdir=Path(tempfile.mkdtemp()))
    out = {"1 replica (this process)": run(ReplicaSet([local], names=["head"]), "one")}
    with tempfile.TemporaryDirectory() as tmp:
        paths = make_launch_secrets(hosts=["127.0.0.1"]).write(Path(tmp) / "launch")
        log = Path(tmp) / "replica.log"
        with open(log, "wb") as f:
            proc = subprocess.Popen([sys.executable, "-m", "artcloud", "replica", "--port", "0", "--path", f"{tmp}/r",
                                     "--tls-cert", str(paths.server_cert), "--tls-key", str(paths.server_key),
                                     "--token-file", str(paths.token), "--log-level", "warning"],
                                    stdout=f, stderr=subprocess.STDOUT)
        try:
            while not (found := re.findall(r"serving on (https://\S+)", log.read_text())):
                if proc.poll() is not None:
                    raise SystemExit(f"artcloud replica exited:\n{log.read_text()}")
                time.sleep(0.2)
            remote = RemoteSampler(found[0], paths.token.read_text().strip(), paths.ca_cert, model,
                                   max_context=local.max_context)
            both = ReplicaSet([local, remote], names=["head", "replica1"])
            out["2 replicas (+ a replica process)"] = run(both, "two")
            served = [r["served"] for r in both.status()["replicas"]]
            print(f"  requests served by the two: {served}")
        finally:
            proc.terminate()
            proc.wait(30)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="HuggingFaceTB/SmolLM2-135M-Instruct")
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--completions", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--gradient-steps", type=int, default=1)
    parser.add_argument("--iters", type=int, default=3, help="timed training steps per side (0: no training)")
    parser.add_argument("--rollouts", type=int, default=32, help="requests per side for rollouts (0: no rollouts)")
    args = parser.parse_args()
    if args.rollouts:
        timings = rollouts(args.model, args.rollouts, args.completions, args.tokens)
        first = next(iter(timings.values()))
        print(f"\nrollouts, {args.model}: {args.rollouts} requests x {args.completions} samples x {args.tokens} tokens, "
              f"batches of 8; {os.cpu_count()} cores")
        print(f"{'':32} {'seconds':>9} {'samples/s':>10} {'vs 1 replica':>13}")
        for name, seconds in timings.items():
            n = args.rollouts * args.completions
            print(f"{name:32} {seconds:9.2f} {n / seconds:10.1f} {first / seconds:12.2f}x")
    if not args.iters:
        return

    from artcloud.server.engines.peft_trainer import PeftTrainer
    from artcloud.server.engines.sharded import ShardedTrainer
    from artcloud.types import LoraConfig, TrainConfig

    lora, config = LoraConfig(rank=8, alpha=16.0), TrainConfig(learning_rate=1e-5, gradient_steps=args.gradient_steps)

    def one_process() -> tuple[list[Any], float]:  # its model freed on return, before the ranks load theirs
        single = PeftTrainer(args.model)
        samples = samples_for(single, args.groups, args.completions, args.tokens)
        single.create_adapter("a", lora)
        return samples, timed(lambda: single.train_step("a", samples, config, lambda m: None), args.iters)

    samples, one = one_process()
    rows: dict[str, tuple[float, float | None]] = {"peft trainer, one process": (one, None)}
    for ranks in (1, 2):
        t = time.perf_counter()
        sharded = ShardedTrainer(args.model, ranks)
        sharded.create_adapter("a", lora)
        start = time.perf_counter() - t
        try:
            rows[f"sharded trainer, {ranks} rank{'s' if ranks > 1 else ''}"] = (
                timed(lambda: sharded.train_step("a", samples, config, lambda m: None), args.iters), start)
        finally:
            sharded.close()

    base = rows["peft trainer, one process"][0]
    n = len(samples)
    print(f"\n{args.model}: {args.groups} groups x {args.completions} completions x {args.tokens} tokens, "
          f"{args.gradient_steps} gradient step(s); median of {args.iters} after a warm-up; {os.cpu_count()} cores")
    print(f"{'':32} {'s / step':>9} {'samples/s':>10} {'vs one process':>15} {'start-up s':>11}")
    for name, (seconds, start) in rows.items():
        print(f"{name:32} {seconds:9.2f} {n / seconds:10.1f} {base / seconds:14.2f}x {'' if start is None else f'{start:11.1f}'}")


if __name__ == "__main__":
    main()

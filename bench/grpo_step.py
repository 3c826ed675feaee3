"""One full GRPO iteration: artcloud (server over HTTPS) vs TRL's GRPOTrainer, same model, same work.

An iteration is G completions for each of P prompts, rewards, then one optimizer step on a LoRA adapter
(rank 8, alpha 16, on q,k,v,o,gate,up,down), learning rate 1e-5, no KL term, fp32 on the CPU:

  artcloud: one chat request per prompt with n=G, logprobs=True, max_tokens=L (the P requests sent
            concurrently, so the server batches them), rewards computed here, then one train job
            (POST /artcloud/models/NAME/train) whose NDJSON events are followed to the `end` event.
            The server's peak RSS is VmHWM of the server process.
  TRL:      GRPOTrainer (no vLLM, use_cpu, bf16 off, per_device_train_batch_size=P*G,
            gradient_accumulation_steps=1, num_generations=G, max_completion_length=L, beta=0),
            run alone in a subprocess (`--trl-worker`); iterations are timed from on_step_end to
            on_step_end by a TrainerCallback; its peak RSS is that process's VmHWM.

Both sides: one warm-up iteration, then N timed iterations (median reported). The reward is the same
deterministic function of the completion text: 1 - |words - 5| / 5 floored at 0, plus a small
tie-break (shorter is slightly better) so that a group rarely has equal rewards (artcloud skips such
groups, which would make its step cheaper than TRL's).

Target: artcloud seconds per iteration / TRL seconds per iteration <= 0.8.
The two sides never run at the same time (2 cores). Results go to bench/out/grpo_step.json.

    .venv/bin/python bench/grpo_step.py                                   # SmolLM2, P=4, G=4, L=32
    .venv/bin/python bench/grpo_step.py --model artcloud/tiny-random --tokens 16 --iters 2
    .venv-vllm/bin/python bench/grpo_step.py --engine cpu vllm+peft vllm+unsloth --trl-python .venv/bin/python
"""

from __future__ import annotations

import os

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_HUB_DISABLE_TELEMETRY"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("PYTHONUNBUFFERED", "1")

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout: tests.server_process

from tests.server_process import ServerProcess as Server  # noqa: E402
from tests.server_process import proc_memory  # noqa: E402

SMOLLM2 = "HuggingFaceTB/SmolLM2-135M-Instruct"
OUT = Path(__file__).resolve().parent / "out"
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PROMPTS = [
    "Write a sentence of exactly five words about the sea.",
    "Write a sentence of exactly five words about a cat.",
    "Write a sentence of exactly five words about rain.",
    "Write a sentence of exactly five words about coffee.",
    "Write a sentence of exactly five words about the moon.",
    "Write a sentence of exactly five words about trains.",
    "Write a sentence of exactly five words about winter.",
    "Write a sentence of exactly five words about music.",
]


def reward(text: str) -> float:
    """1 - |words - 5| / 5, floored at 0; minus a tiny length tie-break so groups rarely tie."""
    words = len(text.split())
    return max(0.0, 1.0 - abs(words - 5) / 5) + 0.01 * (1 - min(len(text), 500) / 500)


def prompts(p: int) -> list[str]:
    return [PROMPTS[i % len(PROMPTS)] + ("" if i < len(PROMPTS) else f" ({i})") for i in range(p)]


# ----------------------------------------------------------------------------------------- artcloud


async def artcloud_iteration(http, texts: list[str], args: argparse.Namespace) -> dict:
    """Rollouts (P concurrent requests, n=G), rewards, one train job followed to its end."""
    t0 = time.perf_counter()

    async def rollout(text: str) -> dict:
        body = {"model": "bench", "messages": [{"role": "user", "content": text}], "n": args.G,
                "max_tokens": args.tokens, "temperature": 1.0, "logprobs": True}
        r = await http.post("/v1/chat/completions", json=body)
        r.raise_for_status()
        return r.json()

    responses = await asyncio.gather(*(rollout(t) for t in texts))
    groups, rewards, tokens = [], [], 0
    for text, resp in zip(texts, responses):
        trajectories = []
        for choice in resp["choices"]:
            rw = reward(choice["message"]["content"] or "")
            rewards.append(rw)
            trajectories.append({"messages_and_choices": [{"role": "user", "content": text}, choice], "reward": rw})
        groups.append({"trajectories": trajectories})
        tokens += resp["usage"]["completion_tokens"]
    t1 = time.perf_counter()

    r = await http.post("/artcloud/models/bench/train", json={"groups": groups, "config": {"learning_rate": args.lr}})
    r.raise_for_status()
    events = []
    async with http.stream("GET", f"/artcloud/jobs/{r.json()['job_id']}/events", params={"follow": "true"}) as s:
        async for line in s.aiter_lines():
            if line.strip():
                events.append(json.loads(line))
    t2 = time.perf_counter()
    end = events[-1]
    if end["type"] != "end":
        raise RuntimeError(f"train job failed: {end}")
    start = next(e for e in events if e["type"] == "start")
    steps = [e for e in events if e["type"] == "step"]
    return {
        "seconds": t2 - t0, "rollout_seconds": t1 - t0, "train_seconds": t2 - t1,
        "engine_train_seconds": sum(e["data"].get("seconds", 0.0) for e in steps),
        "completion_tokens": tokens, "reward_mean": statistics.mean(rewards),
        "trained": end["data"].get("trained", False),
        "groups_skipped_equal_rewards": start["data"].get("groups_skipped_equal_rewards", 0),
    }


def run_artcloud(args: argparse.Namespace, engine: str = "cpu") -> dict:
    import httpx

    texts = prompts(args.P)
    extra = ["--engine", engine] + (["--vllm-python", args.vllm_python] if args.vllm_python and engine != "cpu" else [])
    with tempfile.TemporaryDirectory(prefix="artcloud-bench-") as tmp:
        server = Server(Path(tmp) / "data", *extra, log_level="warning").start(timeout=1800)
        try:
            with server.client(timeout=1800) as c:  # a vLLM engine starts its process at register
                r = c.post("/artcloud/models", json={"name": "bench", "project": "bench", "base_model": args.model})
                r.raise_for_status()
            loaded = server.memory()  # after the model is loaded, before any rollout or training

            async def go() -> list[dict]:
                headers = {"Authorization": f"Bearer {server.token}"}
                async with httpx.AsyncClient(base_url=server.url, verify=server.ssl_context(), headers=headers, timeout=1800) as http:
                    return [await artcloud_iteration(http, texts, args) for _ in range(args.warmup + args.iters)]

            its = asyncio.run(go())
            memory = server.memory()
            with server.client() as c:
                sampler = c.get("/artcloud/status").json()["engines"][0].get("sampler") or {}
            if "pid" in sampler:  # vLLM's own processes count too: "both parts loaded"
                from rollouts import tree_memory

                memory = {**memory, "VmHWM": memory["VmHWM"] + tree_memory(sampler["pid"]), "vllm_VmHWM": tree_memory(sampler["pid"])}
        finally:
            server.stop()
    return {"iterations": its, "timed": its[args.warmup:], "memory_mib": memory, "memory_after_register_mib": loaded}


# ----------------------------------------------------------------------------------------- TRL


def trl_worker(args: argparse.Namespace) -> None:
    """Runs in its own process: warm-up + N GRPOTrainer steps; prints one JSON line starting with RESULT."""
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from artcloud.server.engines import loading

    class Clock(TrainerCallback):
        def __init__(self):
            self.begin, self.end = [], []

        def on_step_begin(self, *a, **kw):
            self.begin.append(time.perf_counter())

        def on_step_end(self, *a, **kw):
            self.end.append(time.perf_counter())

    rewards: list[float] = []
    tokens: list[int] = []  # completion tokens per iteration

    def reward_func(completions, completion_ids=None, **kw) -> list[float]:
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        out = [reward(t) for t in texts]
        rewards.extend(out)
        tokens.append(sum(len(ids) for ids in completion_ids or []))
        return out

    dataset = Dataset.from_list([{"prompt": [{"role": "user", "content": t}]} for t in prompts(args.P)])
    with tempfile.TemporaryDirectory(prefix="trl-bench-") as tmp:
        config = GRPOConfig(
            output_dir=tmp, use_cpu=True, bf16=False, fp16=False,
            per_device_train_batch_size=args.P * args.G, gradient_accumulation_steps=1, num_generations=args.G,
            max_completion_length=args.tokens, temperature=1.0, learning_rate=args.lr, lr_scheduler_type="constant",
            beta=0.0, use_vllm=False, max_steps=args.warmup + args.iters,
            gradient_checkpointing=args.trl_gradient_checkpointing == "on",
            logging_strategy="no", save_strategy="no", report_to="none", disable_tqdm=True, seed=0,
            dataloader_num_workers=0,
        )
        peft_config = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=TARGETS, task_type="CAUSAL_LM")
        clock = Clock()
        t0 = time.perf_counter()
        trainer = GRPOTrainer(
            model=str(loading.resolve(args.model)), reward_funcs=reward_func, args=config,
            train_dataset=dataset, peft_config=peft_config, callbacks=[clock],
        )
        setup = time.perf_counter() - t0
        trainer.train()
    ends = clock.end
    per_iter = [b - a for a, b in zip(ends[args.warmup - 1:], ends[args.warmup:])] if args.warmup else \
        [ends[0] - clock.begin[0]] + [b - a for a, b in zip(ends, ends[1:])]
    print("RESULT " + json.dumps({
        "setup_seconds": setup, "timed": per_iter,
        "step_begin_to_end": [e - b for b, e in zip(clock.begin, clock.end)],
        "reward_mean": statistics.mean(rewards) if rewards else None, "completion_tokens": tokens,
        "memory_mib": proc_memory(), "torch_threads": torch.get_num_threads(),
    }), flush=True)


def run_trl(args: argparse.Namespace) -> dict:
    cmd = [args.trl_python or sys.executable, str(Path(__file__).resolve()), "--trl-worker", "--model", args.model, "--P", str(args.P), "--G", str(args.G),
           "--tokens", str(args.tokens), "--iters", str(args.iters), "--warmup", str(args.warmup), "--lr", str(args.lr),
           "--trl-gradient-checkpointing", args.trl_gradient_checkpointing]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"TRL worker failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return json.loads(lines[-1].removeprefix("RESULT "))


# ----------------------------------------------------------------------------------------- report


def _key(engine: str) -> str:
    return "artcloud" if engine == "cpu" else f"artcloud_{engine}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=SMOLLM2)
    p.add_argument("--P", type=int, default=4, help="prompts per iteration")
    p.add_argument("--G", type=int, default=4, help="completions per prompt (group size)")
    p.add_argument("--tokens", type=int, default=32, help="max completion tokens")
    p.add_argument("--iters", type=int, default=3, help="timed iterations (after --warmup)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--trl-gradient-checkpointing", choices=["on", "off"], default="on",
                   help="TRL's GRPOConfig turns it on by default; artcloud does not checkpoint")
    p.add_argument("--only", choices=["artcloud", "trl"], help="run one side only")
    p.add_argument("--trl-worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--engine", nargs="+", default=["cpu"], choices=["cpu", "vllm+peft", "vllm+unsloth", "auto"],
                   help="artcloud serve --engine for each artcloud run (one row each); vLLM's peak RSS is added to the server's")
    p.add_argument("--vllm-python", default=os.environ.get("ARTCLOUD_VLLM_PYTHON"), help="the python that runs vLLM")
    p.add_argument("--trl-python", help="the python that runs TRL's side (default: this one). Run from .venv-vllm "
                   "(for Unsloth), TRL 1.15 there picks Triton kernels that fail without a GPU: pass .venv/bin/python")
    args = p.parse_args()
    if args.trl_worker:
        return trl_worker(args)

    from rich.console import Console
    from rich.table import Table

    console = Console(width=max(Console().width, 120))
    result: dict = {"settings": vars(args), "time": time.time()}
    if args.only != "trl":
        for engine in args.engine:
            console.print(f"artcloud --engine {engine}: {args.warmup} warm-up + {args.iters} iterations of {args.P} x {args.G} x {args.tokens} tokens on {args.model}")
            result[_key(engine)] = run_artcloud(args, engine)
    if args.only != "artcloud":
        console.print(f"TRL GRPOTrainer: the same, in a subprocess (gradient checkpointing {args.trl_gradient_checkpointing})")
        result["trl"] = run_trl(args)

    table = Table(title=f"One GRPO iteration: {args.model}, P={args.P} prompts x G={args.G}, {args.tokens} tokens, median of {args.iters}")
    for col in ["", "s / iteration", "timed iterations (s)", "completion tokens / iteration", "peak RSS (MiB)", "reward mean"]:
        table.add_column(col, justify="left" if not col else "right")
    for engine in args.engine if args.only != "trl" else []:
        a = result[_key(engine)]
        a["median_seconds"] = statistics.median(i["seconds"] for i in a["timed"])
        table.add_row(f"artcloud --engine {engine}", f"{a['median_seconds']:.2f}", ", ".join(f"{i['seconds']:.2f}" for i in a["timed"]),
                      ", ".join(str(i["completion_tokens"]) for i in a["timed"]),
                      f"{a['memory_mib']['VmHWM']:.0f}", f"{statistics.mean(i['reward_mean'] for i in a['iterations']):.3f}")
    if "trl" in result:
        t = result["trl"]
        t["median_seconds"] = statistics.median(t["timed"])
        table.add_row("TRL GRPOTrainer", f"{t['median_seconds']:.2f}", ", ".join(f"{s:.2f}" for s in t["timed"]),
                      ", ".join(str(n) for n in t["completion_tokens"][args.warmup:]),
                      f"{t['memory_mib']['VmHWM']:.0f}", f"{t['reward_mean']:.3f}" if t["reward_mean"] is not None else "-")
    console.print(table)
    for engine in args.engine if "trl" in result and args.only != "trl" else []:
        a = result[_key(engine)]
        ratio = a["median_seconds"] / result["trl"]["median_seconds"]
        mem = a["memory_mib"]["VmHWM"] / result["trl"]["memory_mib"]["VmHWM"]
        a["ratio_over_trl"], a["memory_ratio_over_trl"] = ratio, mem
        colour = "green" if ratio <= 0.8 else "red"
        console.print(f"artcloud --engine {engine} / TRL seconds per iteration: [{colour}]{ratio:.2f}[/] (target <= 0.8); peak RSS ratio {mem:.2f}")
    if "artcloud" in result and "trl" in result:
        result["ratio_artcloud_over_trl"] = result["artcloud"]["ratio_over_trl"]
        result["memory_ratio_artcloud_over_trl"] = result["artcloud"]["memory_ratio_over_trl"]
    if "artcloud" in result:
        a = result["artcloud"]
        med = lambda k: statistics.median(i[k] for i in a["timed"])
        console.print(f"artcloud server RSS after registering the model: {a['memory_after_register_mib']['VmRSS']:.0f} MiB")
        console.print(
            f"artcloud split (medians): rollouts {med('rollout_seconds'):.2f} s, train {med('train_seconds'):.2f} s "
            f"(of which the engine's optimizer step {med('engine_train_seconds'):.2f} s; the rest is sample building, "
            f"checkpoint commit and HTTP)"
        )
        skipped = sum(i["groups_skipped_equal_rewards"] for i in a["iterations"])
        untrained = sum(not i["trained"] for i in a["iterations"])
        if skipped or untrained:
            console.print(f"[yellow]note: {skipped} group(s) had equal rewards and were skipped; {untrained} iteration(s) did not train[/]")
    if "trl" in result:
        console.print(f"TRL: trainer set-up {result['trl']['setup_seconds']:.1f} s (not timed); torch threads {result['trl']['torch_threads']}")
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "grpo_step.json").write_text(json.dumps(result, indent=2))
    console.print(f"wrote {OUT / 'grpo_step.json'}")


if __name__ == "__main__":
    main()

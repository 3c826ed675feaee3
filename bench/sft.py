"""Supervised fine-tuning, one epoch: artcloud (model.train_sft against a server over HTTPS) vs TRL's SFTTrainer.

The same rows (single-turn conversations: a system message, a question, an answer), the same model, LoRA (rank 16,
alpha 32, on q,k,v,o,gate,up,down), batch size, learning rate (2e-4, constant) and loss (cross-entropy on the
answer's tokens only), fp32 on the CPU:

  artcloud: `artcloud serve` in its own process; `model.train_sft(rows, TrainSFTConfig(...))` from this one, one
            call per epoch (one step each), timed from the call to its return: rendering, HTTP, every optimizer
            step and the checkpoint commit included. Peak RSS: VmHWM of the server process.
  TRL:      SFTTrainer on a prompt-completion dataset (completion_only_loss), no packing, in its own process,
            epochs timed by a TrainerCallback (on_epoch_begin to on_epoch_end); gradient checkpointing as
            TRL's SFTConfig defaults (on; --trl-gradient-checkpointing off for the other case). Peak RSS: its
            VmHWM.

Each side runs a warm-up epoch, then --epochs timed ones (the median is reported: runs on 2 shared cores vary by
tens of percent); they never run at the same time.
Targets: artcloud's seconds per epoch <= 0.7 x TRL's; artcloud's peak RSS <= TRL's.

    .venv/bin/python bench/sft.py                        # SmolLM2, 64 rows, batch 8
    .venv/bin/python bench/sft.py --model artcloud/tiny-random --rows 16
"""

from __future__ import annotations

import os

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_HUB_DISABLE_TELEMETRY"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import argparse
import asyncio
import json
import random
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
SYSTEM = "You are a concise assistant. Answer in one or two sentences."
TOPICS = ["the sea", "a cat", "rain", "coffee", "the moon", "trains", "winter", "music", "bread", "a bicycle",
          "clouds", "a library", "tea", "snow", "a garden", "the wind"]


def rows(n: int) -> list[dict]:
    """n conversations (system, user, assistant), the same on both sides."""
    rng = random.Random(0)
    out = []
    for i in range(n):
        topic = TOPICS[i % len(TOPICS)]
        facts = rng.sample(["it is calm", "people like it", "it changes with the seasons", "it is often grey",
                            "it has a long history", "children draw it", "it can be loud", "it smells good"], 2)
        out.append([{"role": "system", "content": SYSTEM},
                    {"role": "user", "content": f"Tell me about {topic} ({i})."},
                    {"role": "assistant", "content": f"About {topic}: {facts[0]}, and {facts[1]}."}])
    return out


# ----------------------------------------------------------------------------------------- artcloud


def run_artcloud(args: argparse.Namespace) -> dict:
    import artcloud
    from artcloud.backends.remote import RemoteBackend

    data = [artcloud.Trajectory(messages_and_choices=r) for r in rows(args.rows)]
    with tempfile.TemporaryDirectory(prefix="artcloud-bench-") as tmp:
        server = Server(Path(tmp) / "data", log_level="warning").start(timeout=1800)
        try:
            async def go() -> list[dict]:
                backend = RemoteBackend(server.url, token=server.token, ca_cert=server.ca, heartbeat_every_s=0)
                model = artcloud.TrainableModel(name="bench", project="bench", base_model=args.model,
                                                lora=artcloud.LoraConfig(rank=16, alpha=32, target_modules=TARGETS))
                await model.register(backend)
                epochs = []
                for _ in range(1 + args.epochs):
                    t0 = time.perf_counter()
                    result = await model.train_sft(data, artcloud.TrainSFTConfig(learning_rate=args.lr,
                                                                                 batch_size=args.batch), progress=False)
                    steps = [e["data"] for e in result.events if e["type"] == "step"]
                    epochs.append({"seconds": time.perf_counter() - t0, "steps": len(steps),
                                   "trained_tokens": sum(s["tokens"] for s in steps),
                                   "tokens": sum(s["tokens_total"] for s in steps),
                                   "engine_seconds": sum(s["seconds"] for s in steps),
                                   "loss_first": steps[0]["loss"], "loss_last": steps[-1]["loss"]})
                await backend.close()
                return epochs

            epochs = asyncio.run(go())
            memory = server.memory()
        finally:
            server.stop()
    timed = sorted(epochs[1:], key=lambda e: e["seconds"])
    return {"warmup": epochs[0], "epochs": epochs[1:], "timed": timed[len(timed) // 2], "memory_mib": memory}


# ----------------------------------------------------------------------------------------- TRL


def trl_worker(args: argparse.Namespace) -> None:
    """Runs in its own process: SFTTrainer over 2 epochs; prints one JSON line starting with RESULT."""
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoTokenizer, TrainerCallback
    from trl import SFTConfig, SFTTrainer

    from artcloud.server.engines import loading

    class Clock(TrainerCallback):
        def __init__(self):
            self.epochs: list[list[float]] = []

        def on_epoch_begin(self, *a, **kw):
            self.epochs.append([time.perf_counter()])

        def on_epoch_end(self, *a, **kw):
            self.epochs[-1].append(time.perf_counter())

    folder = str(loading.resolve(args.model))
    tokenizer = AutoTokenizer.from_pretrained(folder)
    loading.prepare_tokenizer(tokenizer, args.model)
    dataset = Dataset.from_list([{"prompt": r[:2], "completion": r[2:]} for r in rows(args.rows)])
    with tempfile.TemporaryDirectory(prefix="trl-bench-") as tmp:
        config = SFTConfig(output_dir=tmp, use_cpu=True, bf16=False, fp16=False, num_train_epochs=1 + args.epochs,
                           per_device_train_batch_size=args.batch, gradient_accumulation_steps=1,
                           learning_rate=args.lr, lr_scheduler_type="constant", completion_only_loss=True,
                           packing=False, gradient_checkpointing=args.trl_gradient_checkpointing == "on",
                           logging_strategy="no", save_strategy="no", report_to="none", disable_tqdm=True,
                           seed=0, dataloader_num_workers=0)
        peft = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=TARGETS, task_type="CAUSAL_LM")
        clock = Clock()
        trainer = SFTTrainer(model=folder, args=config, train_dataset=dataset, processing_class=tokenizer,
                             peft_config=peft, callbacks=[clock])
        tokens = sum(len(ids) for ids in trainer.train_dataset["input_ids"])
        trained = sum(sum(label != -100 for label in labels) for labels in trainer.train_dataset["labels"])
        trainer.train()
    seconds = [end - begin for begin, end in clock.epochs]
    timed = sorted(seconds[1:])
    print("RESULT " + json.dumps({"warmup": {"seconds": seconds[0]}, "epochs": seconds[1:],
                                  "timed": {"seconds": timed[len(timed) // 2], "tokens": tokens,
                                            "trained_tokens": trained},
                                  "memory_mib": proc_memory()}), flush=True)


def run_trl(args: argparse.Namespace) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--trl-worker", "--model", args.model, "--rows",
           str(args.rows), "--batch", str(args.batch), "--lr", str(args.lr), "--epochs", str(args.epochs),
           "--trl-gradient-checkpointing", args.trl_gradient_checkpointing]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"TRL worker failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return json.loads(lines[-1].removeprefix("RESULT "))


# ----------------------------------------------------------------------------------------- report


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=SMOLLM2)
    p.add_argument("--rows", type=int, default=64, help="conversations per epoch")
    p.add_argument("--batch", type=int, default=8, help="conversations per optimizer step")
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--epochs", type=int, default=3, help="timed epochs after the warm-up one (the median is reported)")
    p.add_argument("--trl-gradient-checkpointing", choices=["on", "off"], default="on",
                   help="TRL's SFTConfig turns it on by default; artcloud's CPU engine does not checkpoint")
    p.add_argument("--trl-worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.trl_worker:
        return trl_worker(args)

    from rich.console import Console
    from rich.table import Table

    console = Console(width=max(Console().width, 120))
    console.print(f"artcloud train_sft: a warm-up epoch, then {args.epochs} timed: {args.rows} rows, batch {args.batch}, "
                  f"{args.model}")
    a = run_artcloud(args)
    console.print(f"TRL SFTTrainer: the same, in a subprocess (gradient checkpointing {args.trl_gradient_checkpointing})")
    t = run_trl(args)
    table = Table(title=f"One SFT epoch: {args.model}, {args.rows} rows, batch {args.batch}, LoRA r16 (median of "
                        f"{args.epochs})")
    for col in ["", "s / epoch", "timed epochs (s)", "tokens / s", "trained tokens", "peak RSS (MiB)"]:
        table.add_column(col, justify="left" if not col else "right")
    for name, side in (("artcloud train_sft", a), ("TRL SFTTrainer", t)):
        timed = side["timed"]
        epochs = [e["seconds"] if isinstance(e, dict) else e for e in side["epochs"]]
        table.add_row(name, f"{timed['seconds']:.2f}", ", ".join(f"{e:.1f}" for e in epochs),
                      f"{timed['tokens'] / timed['seconds']:.0f}",
                      str(timed["trained_tokens"]), f"{side['memory_mib']['VmHWM']:.0f}")
    console.print(table)
    ratio = a["timed"]["seconds"] / t["timed"]["seconds"]
    memory = a["memory_mib"]["VmHWM"] / t["memory_mib"]["VmHWM"]
    console.print(f"artcloud / TRL seconds per epoch: [{'green' if ratio <= 0.7 else 'red'}]{ratio:.2f}[/] "
                  f"(target <= 0.7); peak RSS ratio [{'green' if memory <= 1 else 'red'}]{memory:.2f}[/] (target <= 1)")
    console.print(f"artcloud: {a['timed']['engine_seconds']:.2f} s of the epoch in the optimizer steps, the rest "
                  f"rendering, HTTP and the commit; loss {a['timed']['loss_first']:.3f} -> {a['timed']['loss_last']:.3f}")
    OUT.mkdir(parents=True, exist_ok=True)
    result = {"settings": vars(args), "time": time.time(), "artcloud": a, "trl": t, "ratio_artcloud_over_trl": ratio,
              "memory_ratio_artcloud_over_trl": memory}
    (OUT / "sft.json").write_text(json.dumps(result, indent=2))
    console.print(f"wrote {OUT / 'sft.json'}")


if __name__ == "__main__":
    main()

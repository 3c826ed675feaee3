"""GRPO against `artcloud serve` with nothing but HTTP: the protocol, spelled out.

Starts a server on this machine (CPU, SmolLM2-135M-Instruct), then loops: sample G answers per prompt
through the OpenAI-compatible route (with logprobs), score them, post them as a training job, follow its
events. The task: answer in exactly five words (reward 1 - |words - 5| / 5, floored at 0).

    python examples/http_grpo.py [--steps 16] [--seed 0] [--model artcloud/tiny-random]

The client SDK (artcloud.TrainableModel + LocalBackend) wraps exactly these calls.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from five_words import TOPICS, reward  # the same task as the SDK version, in examples/

from artcloud.backends.process import ServerProcess


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="HuggingFaceTB/SmolLM2-135M-Instruct")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--prompts", type=int, default=2, help="prompts per step")
    ap.add_argument("--group", type=int, default=8, help="answers per prompt (GRPO group size)")
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    rng = random.Random(args.seed)

    # SIGTERM unwinds like Ctrl-C, so leaving the `with` below always stops the server.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    server = ServerProcess(Path(tempfile.mkdtemp(prefix="artcloud-http-grpo-")) / "data", log_level="warning")
    print("starting artcloud serve on this machine ...")
    with server:
        url = server.url
        client = server.client()
        lora = {"rank": 16, "alpha": 32, "init_seed": args.seed}
        r = client.post("/artcloud/models", json={"name": "five-words", "project": "demo", "base_model": args.model, "lora": lora})
        r.raise_for_status()
        print(f"server {url}, model five-words@{r.json()['step']} on {args.model}")

        curve = []
        for step in range(args.steps):
            t0 = time.time()
            groups = []
            for topic in rng.sample(TOPICS, args.prompts):
                messages = [{"role": "user", "content": f"Describe {topic} in exactly five words."}]
                resp = client.post("/v1/chat/completions", json={
                    "model": "five-words", "messages": messages, "n": args.group, "max_tokens": args.max_tokens,
                    "temperature": 1.0, "logprobs": True, "seed": rng.randrange(1 << 30),
                }).json()
                groups.append({"trajectories": [
                    {"messages_and_choices": [*messages, choice], "reward": reward(choice["message"]["content"] or "")}
                    for choice in resp["choices"]
                ]})
            rewards = [t["reward"] for g in groups for t in g["trajectories"]]
            mean = sum(rewards) / len(rewards)
            curve.append(mean)
            job = client.post("/artcloud/models/five-words/train", json={"groups": groups, "config": {"learning_rate": args.lr}}).json()
            with client.stream("GET", f"/artcloud/jobs/{job['job_id']}/events") as events:
                for line in events.iter_lines():
                    if line.strip():
                        last = json.loads(line)
            sample = groups[0]["trajectories"][0]["messages_and_choices"][-1]["message"]["content"]
            print(f"step {step + 1:2d}  mean reward {mean:.2f}  ({last['type']}, {time.time() - t0:4.1f} s)  e.g. {sample!r}")
        first, last3 = sum(curve[:3]) / 3, sum(curve[-3:]) / 3
        print(f"mean reward, first 3 steps {first:.2f} -> last 3 steps {last3:.2f} ({last3 - first:+.2f})")


if __name__ == "__main__":
    main()

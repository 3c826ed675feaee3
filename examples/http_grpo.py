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
import socket
import ssl
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from five_words import TOPICS, reward  # noqa: E402  (the same task as the SDK version, in examples/)


def start_server(folder: Path) -> tuple[subprocess.Popen, httpx.Client]:
    """`artcloud serve` as a child process, and a client for it once /health says ready. The server makes a CA
    and a bearer token under FOLDER/.tls; the client trusts that CA alone and sends that token."""
    with socket.socket() as s:  # a free port
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen([sys.executable, "-m", "artcloud", "serve", "--path", str(folder), "--port", str(port),
                               "--log-level", "warning", "--parent-pid", str(os.getpid())])  # it exits with us
    tls, url = folder / ".tls", f"https://localhost:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline and server.poll() is None:
        if (tls / "token").exists():
            ca = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
            ca.load_verify_locations(tls / "ca.pem")
            client = httpx.Client(base_url=url, verify=ca, timeout=600,
                                  headers={"Authorization": f"Bearer {(tls / 'token').read_text().strip()}"})
            try:
                if client.get("/health").json().get("ready"):
                    return server, client
            except httpx.TransportError:  # not listening yet
                pass
            client.close()
        time.sleep(0.2)
    server.kill()
    raise SystemExit(f"artcloud serve did not become ready (exit status {server.poll()})")


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

    # SIGTERM unwinds like Ctrl-C, so the `finally` below always stops the server.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    print("starting artcloud serve on this machine ...")
    server, client = start_server(Path(tempfile.mkdtemp(prefix="artcloud-http-grpo-")) / "data")
    try:
        lora = {"rank": 16, "alpha": 32, "init_seed": args.seed}
        r = client.post("/artcloud/models", json={"name": "five-words", "project": "demo", "base_model": args.model, "lora": lora})
        r.raise_for_status()
        print(f"server {str(client.base_url).rstrip('/')}, model five-words@{r.json()['step']} on {args.model}")

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
    finally:
        client.close()
        server.terminate()  # SIGTERM: the server stops cleanly
        server.wait(60)


if __name__ == "__main__":
    main()

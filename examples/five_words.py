"""The main job: teach SmolLM2-135M-Instruct to answer in exactly five words, with GRPO, on this machine.

Each step: for 2 topics, 8 answers each to "Describe TOPIC in exactly five words." (sampled through the
server's OpenAI-compatible route, at a temperature annealed from 1.0 to 0.5), a reward of
1 - |words - 5| / 5 (floored at 0) for each answer, then one GRPO step on a LoRA adapter. Prints each step's mean reward, saves the reward curve as a PNG, and
stops the server at the end.

    python examples/five_words.py [--steps 24] [--seed 0] [--out five_words.png]

The same script trains on a cloud GPU unchanged: `artcloud run examples/five_words.py --backend sky
--gpu L4 --s3 s3://BUCKET/runs` starts the sandbox, and `artcloud.backend_from_env()` below connects to
it; everything after `register` is the same protocol.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import re
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import artcloud

TOPICS = ["the sea", "a cat", "winter", "coffee", "the moon", "a library", "rain", "music", "a forest",
          "bread", "trains", "the desert", "a city at night", "friendship", "mountains", "a garden"]


def reward(text: str) -> float:
    words = len(re.findall(r"[A-Za-z0-9']+", text))
    return max(0.0, 1.0 - abs(words - 5) / 5)


async def rollout(client, model: artcloud.TrainableModel, topic: str, seed: int, max_tokens: int) -> artcloud.Trajectory:
    messages = [{"role": "user", "content": f"Describe {topic} in exactly five words."}]
    response = await client.chat.completions.create(
        model=model.name, messages=messages, max_tokens=max_tokens, logprobs=True, seed=seed,
    )
    choice = response.choices[0]
    return artcloud.Trajectory(messages_and_choices=[*messages, choice], reward=reward(choice.message.content or ""))


def plot(curve: list[float], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=120)
    steps = range(1, len(curve) + 1)
    ax.plot(steps, curve, marker="o", lw=1.5)
    window = [sum(curve[max(0, i - 2):i + 1]) / len(curve[max(0, i - 2):i + 1]) for i in range(len(curve))]
    ax.plot(steps, window, lw=2.5, alpha=0.6, label="mean of last 3")
    ax.set(xlabel="training step", ylabel="mean reward", ylim=(0, 1), title=title)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path)


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="HuggingFaceTB/SmolLM2-135M-Instruct")
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--prompts", type=int, default=2, help="topics per step")
    ap.add_argument("--group", type=int, default=8, help="answers per topic (the GRPO group)")
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--temperature", type=float, nargs=2, default=(1.0, 0.5), metavar=("START", "END"),
                    help="sampling temperature, annealed linearly over the steps: explore early, exploit late")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="five_words.png", help="where to save the reward curve")
    ap.add_argument("--path", default=None, help="server folder (default: a fresh temporary one)")
    args = ap.parse_args()
    rng = random.Random(args.seed)
    started = time.time()

    # Under `artcloud run` the runner's server; otherwise a server on this machine (CPU).
    backend = artcloud.backend_from_env(
        default=lambda: artcloud.LocalBackend(path=args.path or tempfile.mkdtemp(prefix="artcloud-demo-")))
    print(f"starting the training server ({args.model}) ...")
    async with backend:
        model = artcloud.TrainableModel(
            name="five-words", project="demo", base_model=args.model,
            lora=artcloud.LoraConfig(rank=16, alpha=32, init_seed=args.seed),
        )
        model.set_temperature_annealer(artcloud.LinearTemperatureAnnealer(*args.temperature, steps=args.steps))
        await model.register(backend)
        client = model.openai_client()
        print(f"server up at {backend.base_url} in {time.time() - started:.0f} s; training {model.inference_name()}")

        curve = []
        for step in range(args.steps):
            t0 = time.time()
            topics = rng.sample(TOPICS, args.prompts)
            groups = await artcloud.gather_trajectory_groups(
                artcloud.TrajectoryGroup(
                    rollout(client, model, topic, rng.randrange(1 << 30), args.max_tokens) for _ in range(args.group)
                )
                for topic in topics
            )
            rewards = [t.reward for g in groups for t in g.trajectories]
            curve.append(sum(rewards) / len(rewards))
            result = await model.train(groups, config=artcloud.TrainConfig(learning_rate=args.lr))
            best = max((t for g in groups for t in g.trajectories), key=lambda t: t.reward)
            answer = best.messages_and_choices[-1].message.content
            print(f"step {step + 1:2d}/{args.steps}  mean reward {curve[-1]:.2f}  -> {model.inference_name(result.step)}"
                  f"  ({time.time() - t0:4.1f} s)  best: {answer!r}")

    first, last = sum(curve[:3]) / len(curve[:3]), sum(curve[-3:]) / len(curve[-3:])
    plot(curve, args.out, f"five words, SmolLM2-135M, seed {args.seed}: {first:.2f} -> {last:.2f}")
    print(f"mean reward: first 3 steps {first:.2f}, last 3 steps {last:.2f} ({last - first:+.2f}); "
          f"curve saved to {args.out}; {time.time() - started:.0f} s in all; the server is stopped")


if __name__ == "__main__":
    asyncio.run(main())

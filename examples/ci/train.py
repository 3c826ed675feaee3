"""A nightly training job, as `artcloud run` runs it: GRPO on "answer in exactly five words".

    artcloud run examples/ci/train.py -- --steps 3                         # here, on the CPU
    artcloud run examples/ci/train.py --backend sky --gpu L4 --s3 s3://my-bucket/runs -- --steps 50

The backend is not named here: `artcloud.backend_from_env()` connects to the server the runner started
(and the runner tears it down); run with plain `python`, it starts a LocalBackend. Each step resumes
where the last checkpoint on S3 stopped, so a nightly job continues the previous night's model. The file
is self-contained: with `--detach` it is the one file shipped to the sandbox.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import re

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


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="HuggingFaceTB/SmolLM2-135M-Instruct")
    ap.add_argument("--name", default="five-words")
    ap.add_argument("--project", default="nightly")
    ap.add_argument("--steps", type=int, default=10, help="training steps this run (on top of the resumed ones)")
    ap.add_argument("--prompts", type=int, default=2, help="topics per step")
    ap.add_argument("--group", type=int, default=8, help="answers per topic (the GRPO group)")
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    rng = random.Random(args.seed)

    async with artcloud.backend_from_env() as backend:
        model = artcloud.TrainableModel(name=args.name, project=args.project, base_model=args.model,
                                        lora=artcloud.LoraConfig(rank=16, alpha=32, init_seed=args.seed))
        await model.register(backend)
        client = model.openai_client()
        print(f"training {model.inference_name()} on {backend.base_url}", flush=True)
        for _ in range(args.steps):
            groups = await artcloud.gather_trajectory_groups(
                artcloud.TrajectoryGroup(
                    rollout(client, model, topic, rng.randrange(1 << 30), args.max_tokens) for _ in range(args.group)
                )
                for topic in rng.sample(TOPICS, args.prompts)
            )
            rewards = [t.reward for g in groups for t in g.trajectories]
            result = await model.train(groups, config=artcloud.TrainConfig(learning_rate=args.lr), progress=False)
            print(f"step {result.step}: mean reward {sum(rewards) / len(rewards):.2f}", flush=True)


if __name__ == "__main__":
    asyncio.run(main())

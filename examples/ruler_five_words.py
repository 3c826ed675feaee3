"""The five-words demo with rewards from RULER, an LLM judge, instead of a hand-written reward function.

Each step: for 2 topics, 8 answers each to "Describe TOPIC in exactly five words.", sampled through the
training server; a judge model sees each group's 8 answers together and scores them from 0 to 1 against
each other; one GRPO step on a LoRA adapter. The word-count reward of examples/five_words.py is still
computed, only as a yardstick (kept as metrics["independent_reward"]); training never sees it.

The judge is any OpenAI-compatible endpoint, taken from the environment:

    ARTCLOUD_JUDGE_BASE_URL   e.g. https://api.openai.com/v1, https://openrouter.ai/api/v1, http://localhost:8000/v1
    ARTCLOUD_JUDGE_MODEL      e.g. gpt-4.1-mini, or a model that vLLM (or another artcloud server) serves
    ARTCLOUD_JUDGE_API_KEY    the endpoint's key (optional for a local server)
    ARTCLOUD_JUDGE_CA         optional: a CA certificate (PEM path) to trust, e.g. another artcloud server's

    python examples/ruler_five_words.py [--steps 24] [--seed 0] [--cache .ruler-cache]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys
import tempfile
import time
from functools import partial

os.environ.setdefault("HF_HUB_OFFLINE", "1")

# The task, the rollout and its word-count reward are the demo's own (examples/five_words.py). Here the
# word-count reward is only the yardstick: RULER replaces it and keeps it as metrics["independent_reward"].
from five_words import TOPICS, rollout  # noqa: E402  (this folder is on sys.path when the script runs)

import artcloud
from artcloud.rewards import DEFAULT_RUBRIC, ruler_score_group


def judge_from_env():
    """(openai.AsyncOpenAI, model name) for the judge, or exit with one line saying what is missing."""
    base_url, judge_model = os.environ.get("ARTCLOUD_JUDGE_BASE_URL"), os.environ.get("ARTCLOUD_JUDGE_MODEL")
    missing = [name for name, value in (("ARTCLOUD_JUDGE_BASE_URL", base_url), ("ARTCLOUD_JUDGE_MODEL", judge_model)) if not value]
    if missing:
        sys.exit(f"ruler_five_words: set {' and '.join(missing)} (the judge's OpenAI-compatible endpoint); see --help")
    import openai

    kwargs = {}
    if os.environ.get("ARTCLOUD_JUDGE_CA"):
        from artcloud.tls import client_ssl_context

        kwargs["http_client"] = openai.DefaultAsyncHttpxClient(verify=client_ssl_context(os.environ["ARTCLOUD_JUDGE_CA"]))
    client = openai.AsyncOpenAI(base_url=base_url, api_key=os.environ.get("ARTCLOUD_JUDGE_API_KEY") or "none", **kwargs)
    return client, judge_model


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="HuggingFaceTB/SmolLM2-135M-Instruct")
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--prompts", type=int, default=2, help="topics per step")
    ap.add_argument("--group", type=int, default=8, help="answers per topic (the GRPO group the judge compares)")
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--temperature", type=float, nargs=2, default=(1.0, 0.5), metavar=("START", "END"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rubric", default=None, help="a file with your own rubric (default: RULER's own)")
    ap.add_argument("--cache", default=None, help="a folder to keep the judge's answers in (re-runs cost nothing)")
    ap.add_argument("--price", type=float, nargs=2, default=None, metavar=("IN", "OUT"),
                    help="the judge's USD per million prompt / completion tokens, to report the cost")
    ap.add_argument("--path", default=None, help="server folder (default: a fresh temporary one)")
    args = ap.parse_args()
    judge, judge_model = judge_from_env()
    rubric = open(args.rubric).read() if args.rubric else DEFAULT_RUBRIC
    rng = random.Random(args.seed)
    started = time.time()

    score = partial(ruler_score_group, judge_model=judge_model, client=judge, rubric=rubric, cache_dir=args.cache,
                    price=tuple(args.price) if args.price else None, swallow_exceptions=True)

    backend = artcloud.LocalBackend(path=args.path or tempfile.mkdtemp(prefix="artcloud-ruler-demo-"))
    print(f"starting the training server on this machine ({args.model}, CPU); judge: {judge_model} at {judge.base_url}")
    async with backend:
        model = artcloud.TrainableModel(
            name="five-words-ruler", project="demo", base_model=args.model,
            lora=artcloud.LoraConfig(rank=16, alpha=32, init_seed=args.seed),
        )
        model.set_temperature_annealer(artcloud.LinearTemperatureAnnealer(*args.temperature, steps=args.steps))
        await model.register(backend)
        client = model.openai_client()

        tokens = cost = 0.0
        for step in range(args.steps):
            t0 = time.time()
            groups = await artcloud.gather_trajectory_groups(
                (artcloud.TrajectoryGroup(
                    rollout(client, model, topic, rng.randrange(1 << 30), args.max_tokens) for _ in range(args.group))
                 for topic in rng.sample(TOPICS, args.prompts)),
                after_each=score,  # the judge scores each group as soon as its rollouts finish; a failure drops it
            )
            if not groups:
                print(f"step {step + 1:2d}: the judge failed on every group; skipping the step")
                continue
            trajs = [t for g in groups for t in g.trajectories]
            judged = sum(t.reward for t in trajs) / len(trajs)
            words = sum(t.metrics["independent_reward"] for t in trajs) / len(trajs)
            tokens += sum(g.metrics["ruler_prompt_tokens"] + g.metrics["ruler_completion_tokens"] for g in groups)
            cost += sum(g.metrics.get("ruler_cost_usd", 0.0) for g in groups)
            result = await model.train(groups, config=artcloud.TrainConfig(learning_rate=args.lr))
            best = max(trajs, key=lambda t: t.reward)
            print(f"step {step + 1:2d}/{args.steps}  judge {judged:.2f}  word-count {words:.2f}  "
                  f"-> {model.inference_name(result.step)}  ({time.time() - t0:4.1f} s)  "
                  f"best: {best.messages_and_choices[-1].message.content!r}")

    spent = f", ${cost:.4f}" if args.price else ""
    print(f"done in {time.time() - started:.0f} s; the judge read and wrote {tokens:.0f} tokens{spent}; the server is stopped")


if __name__ == "__main__":
    asyncio.run(main())

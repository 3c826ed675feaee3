"""ART 0.5.18's `train-sft` skill's distillation pattern (a teacher model answers, `create_sft_dataset_iterator`
cuts the answers into `model.train_sft` calls), then the SFT-then-RL recipe: a second model forked from the
distilled one (`backend._experimental_fork_checkpoint`, ART PR #325) trains on with RL and a programmatic reward.

An ART user's script, run on artcloud. The teacher is any OpenAI-compatible endpoint (TEACHER_BASE_URL,
TEACHER_API_KEY). Only its imports are artcloud's, each marked with the line an ART script has.

    TEACHER_BASE_URL=https://openrouter.ai/api/v1 TEACHER_API_KEY=... python examples/art/distill_then_rl.py
"""

import asyncio
import os

from openai import AsyncOpenAI

import artcloud as art  # ART: import art
from artcloud.local import LocalBackend  # ART: from art.local import LocalBackend
from artcloud.utils.sft import create_sft_dataset_iterator  # ART: from art.utils.sft import create_sft_dataset_iterator

BASE_MODEL = "Qwen/Qwen3-30B-A3B-Instruct-2507"
PROJECT = "distill"
TEACHER_MODEL = "moonshotai/kimi-k2"
EPOCHS = 2
BATCH_SIZE = 2
PEAK_LR = 2e-4
RL_STEPS = 3
ROLLOUTS_PER_GROUP = 4
MAX_COMPLETION_TOKENS = 48
PROMPTS = ["Say hello in French.", "Name a prime number.", "Give a synonym of fast.", "Spell cat backwards."]


async def main():
    teacher_client = AsyncOpenAI(api_key=os.environ["TEACHER_API_KEY"], base_url=os.environ["TEACHER_BASE_URL"])
    trajectories = []
    for prompt in PROMPTS:
        completion = await teacher_client.chat.completions.create(
            model=TEACHER_MODEL,
            messages=[{"role": "user", "content": prompt}],
        )
        trajectories.append(
            art.Trajectory(
                messages_and_choices=[
                    {"role": "user", "content": prompt},
                    {"role": "assistant", "content": completion.choices[0].message.content},
                ],
                tools=None,
            )
        )

    backend = LocalBackend()
    student = art.TrainableModel(name="student-001", project=PROJECT, base_model=BASE_MODEL)
    await student.register(backend)
    for chunk in create_sft_dataset_iterator(
        trajectories,
        epochs=EPOCHS,
        batch_size=BATCH_SIZE,
        peak_lr=PEAK_LR,
        schedule_type="linear",
        warmup_ratio=0.1,
    ):
        await student.train_sft(chunk.trajectories, chunk.config, verbose=True)
    print(f"distilled {student.name} to step {await student.get_step()}")

    # RL from the distilled adapter: forked before it registers, as ART's scripts do.
    agent = art.TrainableModel(name="agent-001", project=PROJECT, base_model=BASE_MODEL)
    await backend._experimental_fork_checkpoint(agent, from_model=student.name, verbose=True)
    await agent.register(backend)
    print(f"{agent.name} starts at step {await agent.get_step()}")

    async def rollout(prompt: str) -> art.Trajectory:
        messages = [{"role": "user", "content": prompt}]
        response = await agent.openai_client().chat.completions.create(
            model=agent.get_inference_name(), messages=messages, max_completion_tokens=MAX_COMPLETION_TOKENS)
        answer = response.choices[0].message.content or ""
        return art.Trajectory(messages_and_choices=[*messages, response.choices[0]],
                              reward=-abs(len(answer.split()) - 3))  # brief answers: three words

    for _ in range(RL_STEPS):
        groups = await art.gather_trajectory_groups(
            art.TrajectoryGroup(rollout(p) for _ in range(ROLLOUTS_PER_GROUP)) for p in PROMPTS[:2])
        result = await backend.train(agent, groups, learning_rate=1e-5)
        await agent.log(groups, metrics=result.metrics, step=result.step, split="train")
    print(f"{agent.name} trained to step {await agent.get_step()}")
    await backend.close()


if __name__ == "__main__":
    asyncio.run(main())

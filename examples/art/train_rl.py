"""ART 0.5.18's `train-rl` skill template (art/skills/train-rl/SKILL.md, "Minimal Training Pattern" and "Final
Script Requirements"), filled in for a small task: answer a capital-city question in one word, scored by RULER.

An ART user's script, run on artcloud: what the skill's wizard writes for a fixed dataset, LocalBackend, RULER
rewards and ART's default hyperparameters (`backend.train(model, groups, learning_rate=...)`: ART's CISPO loss),
a validation split logged as `val/reward`, and `delete_checkpoints()` after it. Only its imports are artcloud's,
each marked with the line an ART script has.

    OPENAI_API_KEY=... python examples/art/train_rl.py
"""

import asyncio
import os
import random

import artcloud as art  # ART: import art
from artcloud.local import LocalBackend  # ART: from art.local import LocalBackend
from artcloud.rewards import ruler_score_group  # ART: from art.rewards import ruler_score_group
from artcloud.utils.iterate_dataset import iterate_dataset  # ART: from art.utils.iterate_dataset import iterate_dataset

BASE_MODEL = "Qwen/Qwen3-14B-Instruct"
PROJECT = "capitals"
RUN_NAME = "capitals-001"
JUDGE_MODEL = "openai/gpt-5.4"
LEARNING_RATE = 1e-5
ROLLOUTS_PER_GROUP = 4
GROUPS_PER_STEP = 2
NUM_EPOCHS = 2
VALIDATE_EVERY = 1
MAX_COMPLETION_TOKENS = 32

TRAIN = [("France", "Paris"), ("Japan", "Tokyo"), ("Kenya", "Nairobi"), ("Peru", "Lima")]
VALIDATION = [("Italy", "Rome")]


async def rollout(model: art.TrainableModel, country: str) -> art.Trajectory:
    client = model.openai_client()
    trajectory = art.Trajectory(
        messages_and_choices=[
            {"role": "system", "content": "Answer with the city's name only."},
            {"role": "user", "content": f"What is the capital of {country}?"},
        ],
        metadata={"country": country},
    )
    try:
        response = await client.chat.completions.create(
            model=model.get_inference_name(),
            messages=trajectory.messages(),
            max_completion_tokens=MAX_COMPLETION_TOKENS,
        )
    except Exception as e:  # a recoverable inference error: a partial trajectory, with a metric saying so
        trajectory.log(f"inference failed: {e}")
        trajectory.metrics["inference_error"] = True
        return trajectory
    trajectory.messages_and_choices.append(response.choices[0])
    trajectory.metrics["answer_words"] = len((response.choices[0].message.content or "").split())
    return trajectory.finish()


def groups_for(model: art.TrainableModel, pairs: list[tuple[str, str]]) -> list[art.TrajectoryGroup]:
    return [
        art.TrajectoryGroup(
            (rollout(model, country) for _ in range(ROLLOUTS_PER_GROUP)),
            metadata={"scenario_id": country},
        )
        for country, _ in pairs
    ]


async def main() -> None:
    if not os.environ.get("OPENAI_API_KEY"):  # RULER's judge
        raise SystemExit("set OPENAI_API_KEY: RULER's judge model needs it")
    random.seed(42)
    backend = LocalBackend()
    model = art.TrainableModel(name=RUN_NAME, project=PROJECT, base_model=BASE_MODEL)
    await model.register(backend)

    for batch in iterate_dataset(
        TRAIN,
        groups_per_step=GROUPS_PER_STEP,
        num_epochs=NUM_EPOCHS,
        initial_step=await model.get_step(),
    ):
        train_groups = await art.gather_trajectory_groups(
            groups_for(model, batch.items),
            after_each=lambda group: ruler_score_group(group, judge_model=JUDGE_MODEL),
            max_exceptions=ROLLOUTS_PER_GROUP * len(batch.items),
        )
        train_result = await backend.train(model, train_groups, learning_rate=LEARNING_RATE)
        await model.log(train_groups, metrics=train_result.metrics, step=train_result.step, split="train")

        if train_result.step % VALIDATE_EVERY == 0:
            val_groups = await art.gather_trajectory_groups(
                groups_for(model, VALIDATION),
                after_each=lambda group: ruler_score_group(group, judge_model=JUDGE_MODEL),
                max_exceptions=ROLLOUTS_PER_GROUP * len(VALIDATION),
            )
            rewards = [t.reward for group in val_groups for t in group]
            await model.log(val_groups, metrics={"reward": sum(rewards) / max(len(rewards), 1)},
                            step=train_result.step, split="val")
            await model.delete_checkpoints()

    step = await model.get_step()
    print(f"{RUN_NAME} trained to step {step}; serve it as {model.get_inference_name()}, e.g.:")
    print(f'  client.chat.completions.create(model="{model.get_inference_name()}", messages=[...])')
    await backend.close()


if __name__ == "__main__":
    asyncio.run(main())

"""Tic-tac-toe against a random opponent, written for OpenPipe ART's API, in its newer training style:
`result = await backend.train(model, groups, learning_rate=...)`, then `model.log(...)` of the result.

An ART user's script, run on artcloud. It follows the flow of ART's own tic-tac-toe example
(github.com/OpenPipe/ART, examples/tic_tac_toe, as of its backend.train version; Apache-2.0), written
anew here: the same ART calls, and a rollout that builds its own OpenAI client from the model's
inference_base_url / inference_api_key, as many ART rollouts do. The game code is this file's own. Only
two lines are artcloud's, each marked with the line an ART script has.

    python examples/art/tic_tac_toe.py
"""

import asyncio
import math
import random
import re

import openai
from openai import AsyncOpenAI
from pydantic import BaseModel

import artcloud as art  # ART: import art
from artcloud.local.backend import LocalBackend  # ART: from art.local.backend import LocalBackend

BASE_MODEL = "Qwen/Qwen2.5-3B-Instruct"
STEPS = 50
ROLLOUTS_PER_STEP = 96
MAX_COMPLETION_TOKENS = 128
LINES = [[(r, c) for c in range(3)] for r in range(3)] + [[(r, c) for r in range(3)] for c in range(3)] + [
    [(i, i) for i in range(3)], [(i, 2 - i) for i in range(3)]]


class TicTacToeScenario(BaseModel):
    step: int


def render(board: list[list[str]]) -> str:
    rows = [f"{'ABC'[r]} " + " ".join(cell or "_" for cell in board[r]) for r in range(3)]
    return "  1 2 3\n" + "\n".join(rows)


def winner(board: list[list[str]]) -> str | None:
    for line in LINES:
        marks = {board[r][c] for r, c in line}
        if len(marks) == 1 and "" not in marks:
            return marks.pop()
    return "draw" if all(all(row) for row in board) else None


def opponent_move(board: list[list[str]], symbol: str) -> None:
    r, c = random.choice([(r, c) for r in range(3) for c in range(3) if not board[r][c]])
    board[r][c] = symbol


def agent_move(board: list[list[str]], text: str, symbol: str) -> None:
    found = re.fullmatch(r"\s*<move>\s*([ABC])([123])\s*</move>\s*", text)
    if not found:
        raise ValueError("no <move>XY</move>")
    r, c = "ABC".index(found.group(1)), int(found.group(2)) - 1
    if board[r][c]:
        raise ValueError(f"{found.group(1)}{found.group(2)} is taken")
    board[r][c] = symbol


@art.retry(exceptions=(openai.LengthFinishReasonError,))
async def rollout(model: art.Model, scenario: TicTacToeScenario) -> art.Trajectory:
    board = [["", "", ""] for _ in range(3)]
    me, them = random.choice([("x", "o"), ("o", "x")])
    trajectory = art.Trajectory(
        messages_and_choices=[{
            "role": "system",
            "content": "You are a tic-tac-toe player. Always choose the move most likely to lead to a win. "
                       "Return your move as an XML object with a single property 'move', like so: <move>A1</move>. "
                       f"You are the {me} symbol.",
        }],
        metadata={"step": scenario.step},
        reward=0,
    )
    client = AsyncOpenAI(base_url=model.inference_base_url, api_key=model.inference_api_key)
    if me == "o":
        opponent_move(board, them)
    move_number = 0
    while winner(board) is None:
        trajectory.messages_and_choices.append({"role": "user", "content": render(board)})
        chat_completion = await client.chat.completions.create(
            model=model.get_inference_name(),
            messages=trajectory.messages(),
            max_completion_tokens=MAX_COMPLETION_TOKENS,
        )
        choice = chat_completion.choices[0]
        content = choice.message.content or ""
        trajectory.messages_and_choices.append(choice)
        try:
            agent_move(board, content, me)
        except ValueError:
            # ART's example: an invalid move loses, less so the later it comes; here a long invalid
            # answer also costs a little more than a short one.
            trajectory.reward = -1 + math.log(move_number + 1) / math.log(100) - min(len(content), 1000) / 1000
            break
        move_number += 1
        if winner(board) is None:
            opponent_move(board, them)
    result = winner(board)
    if result is not None:
        trajectory.reward = {me: 1.0, them: 0.0, "draw": 0.5}[result]
        trajectory.metrics["win"] = {me: 1.0, them: 0.0, "draw": 0.5}[result]
    trajectory.metrics["num_moves"] = move_number
    return trajectory


async def main() -> None:
    random.seed(42)
    backend = LocalBackend()
    model = art.TrainableModel(name="tic-tac-toe-001", project="tic-tac-toe", base_model=BASE_MODEL)
    await model.register(backend)

    for i in range(await model.get_step(), STEPS):
        train_groups = await art.gather_trajectory_groups(
            (
                art.TrajectoryGroup(rollout(model, TicTacToeScenario(step=i)) for _ in range(ROLLOUTS_PER_STEP))
                for _ in range(1)
            ),
            pbar_desc="gather",
        )
        await model.delete_checkpoints()
        result = await backend.train(model, train_groups, learning_rate=5e-5)
        await model.log(train_groups, metrics=result.metrics, step=result.step, split="train")
        print(f"step {result.step}: checkpoint {result.checkpoint_path}")


if __name__ == "__main__":
    asyncio.run(main())

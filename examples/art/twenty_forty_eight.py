"""2048, written for OpenPipe ART's API: the agent picks a move per turn until the game ends.

An ART user's script, run on artcloud. It follows the flow of ART's own 2048 example
(github.com/OpenPipe/ART, examples/2048/2048.ipynb, as of commit 013803c4; Apache-2.0), written anew
here: the same ART calls, in the older `model.train(groups, config=art.TrainConfig(...))` style. The game
code is this file's own. Only two lines are artcloud's, each marked with the line an ART script has;
with those two lines put back, the script runs on ART unchanged.

    python examples/art/twenty_forty_eight.py
"""

import asyncio
import math
import random
import string
import xml.etree.ElementTree as ET

import openai
from pydantic import BaseModel

import artcloud as art  # ART: import art
from artcloud.local import LocalBackend  # ART: from art.local import LocalBackend

BASE_MODEL = "Qwen/Qwen2.5-3B-Instruct"
TRAIN_STEPS = 10
ROLLOUTS_PER_GROUP = 18
MAX_COMPLETION_TOKENS = 128
WINNING_VALUE = 128
MOVES = ("left", "right", "up", "down")

SYSTEM_PROMPT = (
    "You are an excellent 2048 player. Always choose the move most likely to combine cells and reach "
    f"{WINNING_VALUE}. Optional moves are 'left', 'right', 'up', 'down'. Return your move as an XML "
    "object with a single property 'move', like so: <move>left</move>"
)

Board = list[list[int | None]]


def new_game(size: int = 4) -> dict:
    game = {"id": "".join(random.choices(string.ascii_letters, k=6)), "board": [[None] * size for _ in range(size)]}
    add_tile(game["board"])
    add_tile(game["board"])
    return game


def add_tile(board: Board) -> None:
    empty = [(r, c) for r, row in enumerate(board) for c, cell in enumerate(row) if cell is None]
    r, c = random.choice(empty)
    board[r][c] = 2 if random.random() < 0.9 else 4


def render(board: Board) -> str:
    return "\n".join("|".join(f"{cell or '_':>4}" for cell in row) for row in board)


def slide_left(row: list[int | None]) -> list[int | None]:
    tiles, merged, i = [v for v in row if v is not None], [], 0
    while i < len(tiles):
        if i + 1 < len(tiles) and tiles[i] == tiles[i + 1]:
            merged.append(tiles[i] * 2)
            i += 2
        else:
            merged.append(tiles[i])
            i += 1
    return merged + [None] * (len(row) - len(merged))


def move(board: Board, direction: str) -> Board:
    if direction in ("up", "down"):
        columns = [list(col) for col in zip(*board)]
        moved = move(columns, "left" if direction == "up" else "right")
        return [list(row) for row in zip(*moved)]
    if direction == "right":
        return [slide_left(row[::-1])[::-1] for row in board]
    return [slide_left(row) for row in board]


def parse_move(text: str) -> str:
    try:
        direction = (ET.fromstring(text.strip()).text or "").strip()
    except ET.ParseError:
        raise ValueError("not an XML <move> element")
    if direction not in MOVES:
        raise ValueError(f"{direction!r} is not a move")
    return direction


def finished(board: Board) -> bool:
    cells = [cell for row in board for cell in row]
    return max(c or 0 for c in cells) >= WINNING_VALUE or None not in cells


class Scenario2048(BaseModel):
    step: int


@art.retry(exceptions=(openai.APITimeoutError,))
async def rollout(model: art.Model, scenario: Scenario2048) -> art.Trajectory:
    client = model.openai_client()
    game = new_game()
    trajectory = art.Trajectory(
        messages_and_choices=[{"role": "system", "content": SYSTEM_PROMPT}],
        metadata={"game_id": game["id"], "step": scenario.step},
        reward=0,
    )
    moves = 0
    while True:
        trajectory.messages_and_choices.append({"role": "user", "content": render(game["board"])})
        chat_completion = await client.chat.completions.create(
            max_completion_tokens=MAX_COMPLETION_TOKENS,
            messages=trajectory.messages(),
            model=model.name,
        )
        choice = chat_completion.choices[0]
        content = choice.message.content or ""
        trajectory.messages_and_choices.append(choice)
        try:
            game["board"] = move(game["board"], parse_move(content))
        except ValueError:
            # An invalid move ends the game; a long invalid answer costs a little more than a short one.
            trajectory.reward = -1 - min(len(content), 1000) / 1000
            break
        moves += 1
        if finished(game["board"]):
            cells = [c for row in game["board"] for c in row if c is not None]
            trajectory.metrics["max_value"] = max(cells)
            trajectory.metrics["board_value"] = sum(cells)
            trajectory.metrics["num_moves"] = moves
            # log-scaled progress towards WINNING_VALUE; a win earns 2
            trajectory.reward = 2 if max(cells) >= WINNING_VALUE else (
                (math.log2(max(cells)) - 1) / (math.log2(WINNING_VALUE) - 1) + 0.2 * math.log2(sum(cells)) / math.log2(WINNING_VALUE * 16)
            )
            break
        add_tile(game["board"])
    return trajectory


async def main() -> None:
    random.seed(42)
    model = art.TrainableModel(name="agent-001", project="2048-multi-turn", base_model=BASE_MODEL)
    backend = LocalBackend(in_process=True, path="./.art")
    await model.register(backend)

    for i in range(await model.get_step(), TRAIN_STEPS):
        train_groups = await art.gather_trajectory_groups(
            (
                art.TrajectoryGroup(rollout(model, Scenario2048(step=i)) for _ in range(ROLLOUTS_PER_GROUP))
                for _ in range(1)
            ),
            pbar_desc="gather",
            max_exceptions=ROLLOUTS_PER_GROUP,
        )
        await model.delete_checkpoints()
        await model.train(
            train_groups,
            config=art.TrainConfig(learning_rate=1e-5),
            _config={"logprob_calculation_chunk_size": 8},
        )
    print(f"{model.name} trained to step {await model.get_step()}")


if __name__ == "__main__":
    asyncio.run(main())

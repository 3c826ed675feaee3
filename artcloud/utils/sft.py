"""OpenPipe ART's `art.utils.sft`: supervised fine-tuning from a JSONL file, learning-rate schedules, and a dataset
cut into `train_sft` calls. ART's behaviour is the specification (its schedules, shuffles and seeds give the same
numbers and order here); what differs: a file is read as it is trained on, never whole (ART builds every batch in
memory first), and a bad row is an error naming its line before anything trains.

A JSONL row is one conversation: `{"messages": [...], "tools": [...]}` (ART's format; other keys, such as
`response_format`, are ignored). Its assistant messages are trained on, tool calls included.
"""

from __future__ import annotations

import itertools
import json
import math
import random
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Literal, NamedTuple

from artcloud.errors import ArtcloudError, InvalidArgument
from artcloud.types import TrainResult, TrainSFTConfig, Trajectory

if TYPE_CHECKING:
    from artcloud.model import TrainableModel

Schedule = Literal["cosine", "linear", "constant"]
ROLES = {"system", "developer", "user", "assistant", "tool", "function"}


class SFTChunk(NamedTuple):
    """One `train_sft` call's share of a dataset (create_sft_dataset_iterator): its trajectories, the config with
    their batches' learning rates, and where it lies (`step`: its first batch, counted over all epochs)."""

    trajectories: list[Trajectory]
    config: TrainSFTConfig
    step: int
    epoch: int
    epoch_step: int


def create_lr_schedule(total_steps: int, peak_lr: float, method: Schedule = "linear", warmup_steps: int = 0,
                       min_lr: float = 0.0) -> list[float]:
    """A learning rate per step: a linear warmup from min_lr to peak_lr over `warmup_steps` (the first step already
    above min_lr), then `method` from peak_lr down to min_lr at the last step (cosine, linear), or peak_lr held
    (constant). As ART's create_lr_schedule."""
    if method not in ("cosine", "linear", "constant"):
        raise InvalidArgument(f"unknown schedule {method!r}: use cosine, linear or constant", field="method")
    rates = []
    decay = total_steps - warmup_steps
    for step in range(max(total_steps, 0)):
        if step < warmup_steps:
            rates.append(min_lr + (peak_lr - min_lr) * (step + 1) / warmup_steps)
            continue
        done = (step - warmup_steps) / (decay - 1) if decay > 1 else 0.0
        if method == "cosine":
            rates.append(min_lr + (peak_lr - min_lr) * 0.5 * (1 + math.cos(math.pi * done)))
        elif method == "linear":
            rates.append(peak_lr - (peak_lr - min_lr) * done)
        else:
            rates.append(peak_lr)
    return rates


def create_sft_dataset_iterator(trajectories: list[Trajectory], chunk_size: int = 10, epochs: int = 1,
                                batch_size: int = 2, peak_lr: float = 2e-4, schedule_type: Schedule = "linear",
                                warmup_ratio: float = 0.1, shuffle: bool = True, seed: int = 42, initial_step: int = 0,
                                show_progress: bool = True) -> Iterator[SFTChunk]:
    """`trajectories` over `epochs` (each shuffled with seed + epoch) as SFTChunks of `chunk_size` batches, for one
    `model.train_sft(chunk.trajectories, chunk.config)` each; the schedule spans all of them, so warmup and decay
    run across calls. Chunks before the one holding batch `initial_step` are skipped (resuming). As ART's."""
    if chunk_size < 1:
        raise InvalidArgument(f"chunk_size must be >= 1, not {chunk_size}", field="chunk_size")
    size = len(trajectories)
    if size == 0:
        return
    per_epoch = math.ceil(size / batch_size)
    total = per_epoch * epochs
    schedule = create_lr_schedule(total, peak_lr, schedule_type, int(total * warmup_ratio))
    per_chunk = batch_size * chunk_size
    chunks_per_epoch = math.ceil(size / per_chunk)
    from tqdm.auto import tqdm

    with tqdm(initial=initial_step, total=total, desc="SFT Training", unit="step", disable=not show_progress) as bar:
        for epoch in range(epochs):
            order = list(trajectories)
            if shuffle:
                random.Random(seed + epoch).shuffle(order)
            for c in range(chunks_per_epoch):
                if epoch * chunks_per_epoch + c < initial_step // chunk_size:
                    continue
                part = order[c * per_chunk:(c + 1) * per_chunk]
                first = epoch * per_epoch + c * per_chunk // batch_size
                count = math.ceil(len(part) / batch_size)
                config = TrainSFTConfig(learning_rate=schedule[first:first + count], batch_size=batch_size)
                yield SFTChunk(part, config, first, epoch, c * per_chunk // batch_size)
                bar.update(count)


def _check_jsonl(file_path: str | Path) -> Path:
    path = Path(file_path)
    if path.suffix != ".jsonl":
        raise InvalidArgument(f"only JSONL files are supported, not {str(file_path)!r}", field="file_path")
    if not path.is_file():
        raise InvalidArgument(f"no file at {str(file_path)!r}", field="file_path")
    return path


def _row(line: str, where: str) -> dict[str, Any]:
    """A JSONL line as a row {"messages", "tools"}: InvalidArgument naming `where` for one that is not."""
    try:
        data = json.loads(line)
    except ValueError as e:
        raise InvalidArgument(f"{where}: not JSON ({e})", field=where) from None
    messages = data.get("messages") if isinstance(data, dict) else None
    if not isinstance(messages, list) or not messages:
        raise InvalidArgument(f"{where}: a row is an object with a non-empty \"messages\" list", field=where)
    for j, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise InvalidArgument(f"{where}: messages[{j}] has no role among {', '.join(sorted(ROLES))}", field=where)
    if not any(m["role"] == "assistant" for m in messages):
        raise InvalidArgument(f"{where}: no assistant message to learn from", field=where)
    tools = data.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise InvalidArgument(f"{where}: \"tools\" must be a list", field=where)
    return {"messages": messages, "tools": tools}


def get_file_row_count(file_path: str) -> int:
    """The non-empty lines of a JSONL file (read as it goes)."""
    with _check_jsonl(file_path).open() as f:
        return sum(1 for line in f if line.strip())


def _checked_row_count(path: Path) -> int:
    """The rows of `path`, each one checked (one pass, line by line): a bad one is told by its line number before
    anything trains."""
    count = 0
    with path.open(encoding="utf-8", errors="replace") as f:
        for number, line in enumerate(f, 1):
            if line.strip():
                _row(line, f"{path.name} line {number}")
                count += 1
    return count


def _rows(path: Path, epochs: int, shuffle_buffer_size: int, seed: int, initial_skip: int) -> Iterator[Any]:
    """The file's rows over `epochs`, shuffled through a buffer of `shuffle_buffer_size` (a buffer this size, not
    the file, is ever held), each epoch with seed + epoch, the first `initial_skip` left out: as ART's iterate_file.
    Each is a supervised.Row naming its line."""
    from artcloud.supervised import Row

    if shuffle_buffer_size < 1:
        raise InvalidArgument("shuffle_buffer_size must be >= 1", field="shuffle_buffer_size")

    def ordered() -> Iterator[tuple[int, str]]:
        for epoch in range(epochs):
            rng = random.Random(seed + epoch)
            buffer: list[tuple[int, str]] = []
            with path.open(encoding="utf-8", errors="replace") as f:
                for number, line in enumerate(f, 1):
                    if not line.strip():
                        continue
                    buffer.append((number, line))
                    if len(buffer) >= shuffle_buffer_size:  # full: one leaves at random
                        yield buffer.pop(rng.randint(0, len(buffer) - 1))
            rng.shuffle(buffer)
            yield from buffer

    for number, line in itertools.islice(ordered(), initial_skip, None):
        label = f"{path.name} line {number}"
        yield Row(_row(line, label), label)


def iterate_file(file_path: str, epochs: int = 1, shuffle_buffer_size: int = 10000, seed: int = 42,
                 initial_skip: int = 0) -> Iterator[Trajectory]:
    """The file's rows as Trajectories, over `epochs`, shuffled through a buffer (see train_sft_from_file)."""
    for row in _rows(_check_jsonl(file_path), epochs, shuffle_buffer_size, seed, initial_skip):
        yield Trajectory(messages_and_choices=row.data["messages"], tools=row.data["tools"])


async def train_sft_from_file(model: TrainableModel, file_path: str, epochs: int = 1, batch_size: int = 2,
                              peak_lr: float = 2e-4, schedule_type: Schedule = "linear", warmup_ratio: float = 0.1,
                              initial_step: int = 0, final_step: int | None = None, _config: Any = None,
                              verbose: bool = False, shuffle_buffer_size: int = 10000) -> TrainResult | None:
    """Fine-tune `model` on a JSONL file in one `train_sft` call (one step), as ART's: `epochs` passes, shuffled
    through a buffer of `shuffle_buffer_size` rows, `batch_size` rows per optimizer step, the learning rate of
    `create_lr_schedule` over all batches (warmup_ratio of them warming up), from batch `initial_step` to
    `final_step` (exclusive; None: the end). The file is read as it is trained on. Every row is checked first, in
    one pass: a bad one is an InvalidArgument naming its line. If the machine is lost (a spot preemption) and the
    backend brings up another, the call starts again there, from the file (nothing of it had been committed)."""
    path = _check_jsonl(file_path)
    rows = _checked_row_count(path)
    if verbose:
        print(f"File has {rows} rows")
    total_rows = rows * epochs
    if rows == 0 or initial_step * batch_size >= total_rows:
        return None
    total = math.ceil(total_rows / batch_size)
    schedule = create_lr_schedule(total, peak_lr, schedule_type, int(total * warmup_ratio))
    rates = schedule[initial_step:min(final_step, total) if final_step is not None else None]
    if not rates:
        return None
    if verbose:
        print(f"Training {len(rates) * batch_size} trajectories in {len(rates)} batches of {batch_size}; "
              f"schedule {schedule_type}, peak learning rate {peak_lr}")
    config = TrainSFTConfig(learning_rate=rates, batch_size=batch_size)
    for attempt in (1, 2):
        source = itertools.islice(_rows(path, epochs, shuffle_buffer_size, 42, initial_step * batch_size),
                                  len(rates) * batch_size)
        try:
            return await model.train_sft(source, config, _config, verbose=verbose)
        except ArtcloudError as e:
            if e.code != "sft_lost" or attempt == 2:
                raise
            if verbose:
                print(f"{e}: training the file again on the new machine")
    return None

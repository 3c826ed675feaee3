"""`model.train_sft`: supervised fine-tuning, one call one step, as OpenPipe ART's, streamed to the server.

The trajectories (a list, or a generator reading a file of any size) are cut into batches of `batch_size`, each
with its learning rate (one for all, or TrainSFTConfig's list: one per batch), and sent in chunks of at most
CHUNK_BATCHES batches, CHUNK_ROWS rows and CHUNK_BYTES bytes (a batch whole, whatever its size: server/sft.py);
the server answers a chunk once it has room for it, so
at most a few chunks are ever held on either side. The job's events are followed meanwhile (a progress bar, one
step per batch). A row the server refuses names its source (`trajectories[17]`, or `data.jsonl line 17`), and
whatever ends the call early ends the job too: nothing of it is committed, the model stays at its step.
"""

from __future__ import annotations

import asyncio
import json
import re
import uuid
from dataclasses import dataclass
from typing import Any, Iterable, Iterator

from artcloud.errors import ArtcloudError, InvalidArgument, WrongType
from artcloud.progress import JobProgress, record_numbers
from artcloud.types import TrainResult, TrainSFTConfig, Trajectory, get_messages

CHUNK_BATCHES = 16
CHUNK_ROWS = 2048
CHUNK_BYTES = 4 << 20


@dataclass
class Row:
    """One conversation to learn from, as the server takes it, and where it came from (for errors)."""

    data: dict[str, Any]  # {"messages": [...], "tools": [...] | None}
    label: str


def row_of(traj: Any, label: str) -> Row:
    if isinstance(traj, Row):
        return traj
    if not isinstance(traj, Trajectory):
        raise WrongType(f"{label} is a {type(traj).__name__}, not an artcloud.Trajectory")
    messages = get_messages(traj.messages_and_choices)
    if not any(m.get("role") == "assistant" for m in messages):
        raise InvalidArgument(f"{label} has no assistant message to learn from")
    return Row({"messages": messages, "tools": traj.tools}, label)


def batches(trajectories: Iterable[Any], config: TrainSFTConfig) -> Iterator[tuple[list[Row], float]]:
    """(rows, learning rate) per batch, reading `trajectories` as it goes."""
    rates = config.learning_rate
    size = config.batch
    batch: list[Row] = []
    index = 0

    def rate(b: int) -> float:
        if not isinstance(rates, list):
            return rates
        if b >= len(rates):
            raise InvalidArgument(f"TrainSFTConfig.learning_rate has {len(rates)} rates, one per batch, but the "
                                  f"trajectories make more batches (batch_size {size}): give one rate per batch "
                                  "(artcloud.utils.sft.create_lr_schedule)", field="learning_rate")
        return rates[b]

    for i, traj in enumerate(trajectories):
        batch.append(row_of(traj, f"trajectories[{i}]"))
        if len(batch) == size:
            yield batch, rate(index)
            batch, index = [], index + 1
    if batch:
        yield batch, rate(index)


async def train_sft(model: Any, trajectories: Iterable[Any], config: TrainSFTConfig, *,
                    verbose: bool = False, progress: bool = True) -> TrainResult:
    """One supervised fine-tuning step of `model` on `trajectories` (see the module docstring). A machine lost
    meanwhile (and replaced by the backend) is an ArtcloudError with code "sft_lost": the trajectories were read
    already, so only the caller can send them again (train_sft_from_file does, from its file)."""
    from artcloud.backends.client import ServerGone

    backend = model.backend
    generation = backend.generation
    try:
        return await _train_sft(model, backend, trajectories, config, verbose=verbose, progress=progress)
    except ServerGone as e:  # a preempted spot machine: nothing of this call was committed
        if not await backend.recover(e, generation):
            raise
        info = await backend.model_info(model.name)
        model.step = info.step
        raise ArtcloudError(f"the machine was lost during train_sft; a new one resumed {model.name} at step "
                            f"{info.step}, and nothing of this call was committed: call it again", code="sft_lost") from e


async def _train_sft(model: Any, backend: Any, trajectories: Iterable[Any], config: TrainSFTConfig, *,
                     verbose: bool, progress: bool) -> TrainResult:
    total = None
    if isinstance(config.learning_rate, list):
        total = len(config.learning_rate)
    elif hasattr(trajectories, "__len__"):
        total = -(-len(trajectories) // config.batch) or None  # type: ignore[arg-type]
    job = await backend.client.start_sft(model.name, {"batches": total, "idempotency_key": uuid.uuid4().hex})
    with JobProgress(model.name, total or 0, enabled=progress, verbose=verbose) as bar:
        following = asyncio.ensure_future(backend.follow_job(job.job_id, on_event=bar.update))
        try:
            await _send(backend.client, job.job_id, batches(trajectories, config), following)
            events = await following
        except BaseException:
            following.cancel()
            await asyncio.gather(following, return_exceptions=True)
            raise
    last = events[-1]
    if last.type == "error":
        raise ArtcloudError(f"supervised fine-tuning of {model.name} failed: {last.data.get('message')}",
                            code=last.data.get("code", "error"))
    model.step = last.data["step"]
    return TrainResult(step=model.step, trained=bool(last.data.get("trained")),
                       metrics=record_numbers(last.data.get("metrics") or {}), events=[e.model_dump() for e in events],
                       checkpoint_path=last.data.get("checkpoint"))


async def _send(client: Any, job_id: str, source: Iterator[tuple[list[Row], float]], following: asyncio.Future) -> None:
    """Every batch of `source`, in chunks; a refused row is an InvalidArgument naming it. Anything that ends this
    early (an error here, in the caller's generator, a cancellation) abandons the job on the server."""
    seq, chunk, labels, size, count = 0, [], [], 0, 0
    try:
        for rows, rate in source:
            if following.done():  # the job ended already (the server failed it): its events say why
                return
            body = {"rows": [r.data for r in rows], "learning_rate": rate}
            chunk.append(body)
            labels.append([r.label for r in rows])
            size, count = size + len(json.dumps(body)), count + len(rows)
            if len(chunk) >= CHUNK_BATCHES or count >= CHUNK_ROWS or size >= CHUNK_BYTES:
                if not await _post(client, job_id, seq, chunk, labels, last=False):
                    return
                seq, chunk, labels, size, count = seq + 1, [], [], 0, 0
        await _post(client, job_id, seq, chunk, labels, last=True)
    except BaseException:
        if not following.done():
            try:  # the job would otherwise hold the model until the server's idle limit
                await asyncio.shield(client.send_sft_chunk(job_id, {"seq": seq, "abort": True}))
            except Exception:
                pass
        raise


async def _post(client: Any, job_id: str, seq: int, chunk: list[dict[str, Any]], labels: list[list[str]], *,
                last: bool) -> bool:
    """Send one chunk; False when the job takes no more (it failed on the server: its events say why)."""
    from artcloud.errors import BadRequest, Conflict

    try:
        await client.send_sft_chunk(job_id, {"seq": seq, "batches": chunk, "last": last})
        return True
    except Conflict as e:
        if e.code != "job_ended":
            raise
        return False
    except BadRequest as e:
        where = re.match(r"batches\[(\d+)\]\.rows\[(\d+)\](.*)", e.field or "")
        if where is None:
            raise
        b, r, rest = int(where.group(1)), int(where.group(2)), where.group(3)
        message = str(e).split(": ", 2)[-1] if ": " in str(e) else str(e)
        message = re.sub(r"^batches\[\d+\]\.rows\[\d+\]:? ?", "", message)
        raise InvalidArgument(f"{labels[b][r]}{rest}: {message}; nothing of this train_sft call was committed",
                              field=labels[b][r]) from None

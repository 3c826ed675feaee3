"""Supervised fine-tuning as a job: OpenPipe ART's `model.train_sft` (one call, one step) over HTTP, streamed.

    POST /artcloud/models/{name}/sft        the job: it waits in the model's queue as a training job does
    POST /artcloud/jobs/{job_id}/sft        the next chunk of batches (seq 0, 1, ...); the last says `last`

A chunk is checked and tokenised when it is posted (a bad row is a 400 naming it, before anything of it trains),
then waits in the job's `Feed` (two chunks at most: a post waits for room, so neither side ever holds more). The
job trains each batch as one optimizer step (artcloud.train.loop.SFTStep: cross-entropy on the assistant's tokens,
its own learning rate) as it arrives, and commits one step after the last chunk: until then nothing is served or
committed, and a job that fails (a client gone for IDLE_S, the server shutting down) is rolled back whole.
"""

from __future__ import annotations

import asyncio
import hashlib
from dataclasses import dataclass, field
from typing import Any

from artcloud.errors import ArtcloudError
from artcloud.server import chat
from artcloud.server.api_errors import ApiError
from artcloud.server.engines.base import TrainSample
from artcloud.types import get_messages
from artcloud.wire import SFTBatch, SFTChunk

IDLE_S = 600.0  # a job that gets no chunk for this long fails: its client is gone (a crash, a lost laptop)
CHUNKS_WAITING = 2  # chunks a job holds ahead of its trainer


@dataclass
class Prepared:
    """A chunk, tokenised: each batch's samples and learning rate."""

    seq: int
    batches: list[tuple[list[TrainSample], float]]
    last: bool
    rows: int  # rows that will train
    dropped: int  # rows longer than the model takes, left out (ART drops them too)


def conversation_samples(engine: Any, batch: SFTBatch, where: str) -> tuple[list[TrainSample], int]:
    """One batch's rows as samples (the tokens before a row's first assistant token are its prompt, the rest its
    completion, `trained` on the assistant's tokens), and how many rows were too long to keep. ApiError 400 naming
    the row for one that cannot be learned from.

    Rows that open alike (a system prompt) share it: their common prefix becomes every row's prompt, which
    packing then runs once (train/packing.py), where it saves more of the model's work than computing the
    logits of what follows it up to each row's first trained token costs (`_shared`)."""
    rows: list[tuple[int, list[int], list[bool], int]] = []  # (row, ids, trained, first trained)
    dropped = 0
    for r, row in enumerate(batch.rows):
        here = f"{where}.rows[{r}]"
        messages = get_messages([m.model_dump(exclude_none=True) for m in row.messages])
        if not any(m["role"] == "assistant" for m in messages):
            raise ApiError(400, "invalid_row", f"{here}: no assistant message to learn from", f"{here}.messages")
        try:
            ids, trained = chat.render_conversation(engine.tokenizer, messages, row.tools)
        except Exception as e:  # a template error is the row's fault
            raise ApiError(400, "invalid_row", f"{here}: the chat template cannot render this conversation: {e}",
                           f"{here}.messages") from e
        if len(ids) > engine.max_context:
            dropped += 1
            continue
        first = max(1, trained.index(True)) if any(trained) else len(ids)
        if first >= len(ids) or not any(trained[first:]):
            raise ApiError(400, "invalid_row", f"{here}: its assistant messages render to no token to learn",
                           f"{here}.messages")
        rows.append((r, ids, trained, first))
    shared = _shared(rows)
    return [TrainSample(ids[:cut], ids[cut:], [], 0.0, r, trained=trained[cut:])
            for r, ids, trained, first in rows for cut in [shared or first]], dropped


def _shared(rows: list[tuple[int, list[int], list[bool], int]]) -> int | None:
    """The length of the prefix the rows share (never a trained token), where running it once saves more than the
    logits it adds: each of the n - 1 rows after the first skips it through the whole model, and each row then
    computes logits from it to its first trained token. A row's pass through the model outweighs its logits (the
    hidden layers have most of the weights), so taking the prefix when it is at least as long as what it adds is
    on the safe side. None: each row keeps its own prompt."""
    if len(rows) < 2:
        return None
    shortest = min(first for *_, first in rows)
    common = 0
    while common < shortest and len({ids[common] for _, ids, _, _ in rows}) == 1:
        common += 1
    added = sum(first - common for *_, first in rows)
    return common if common and (len(rows) - 1) * common >= added else None


def prepare(engine: Any, chunk: SFTChunk) -> Prepared:
    """Tokenise a chunk (on a worker thread: it renders every row's chat template)."""
    out, rows, dropped = [], 0, 0
    for b, batch in enumerate(chunk.batches):
        samples, lost = conversation_samples(engine, batch, f"batches[{b}]")
        out.append((samples, batch.learning_rate))
        rows, dropped = rows + len(samples), dropped + lost
    return Prepared(chunk.seq, out, chunk.last, rows, dropped)


def chunk_hash(chunk: SFTChunk) -> str:
    return hashlib.sha256(chunk.model_dump_json().encode()).hexdigest()


@dataclass
class Feed:
    """One SFT job's chunks, from the route that takes them to the trainer that trains them, in order."""

    total: int | None  # batches announced, where known
    max_grad_norm: float | None
    queue: asyncio.Queue = field(default_factory=lambda: asyncio.Queue(CHUNKS_WAITING))
    hashes: list[str] = field(default_factory=list)  # of each chunk taken, by seq
    batches: int = 0  # taken so far
    dropped: int = 0
    complete: bool = False  # its last chunk was taken
    closed: str | None = None  # why the job takes no more chunks: it ended, failed or was abandoned
    committing: bool = False  # its last batch trained: the step commits, an abort comes too late
    _taking: asyncio.Lock = field(default_factory=asyncio.Lock)

    async def put(self, chunk: SFTChunk, digest: str, prepare_it: Any) -> dict[str, int]:
        """Take `chunk` (prepared by `prepare_it()` on a thread) once there is room; a chunk taken before is
        answered again, not taken twice. ApiError 409 for one out of order, or for a job that takes no more. A
        chunk that says `abort`, or whose rows are refused (400), ends the job: nothing of it is committed."""
        if chunk.abort:
            if self.committing:
                raise ApiError(409, "job_ended", "this SFT job trained its last batch and is committing its step: "
                               "follow the job for its end", "abort")
            self.close("the client abandoned the call")
            return self._answer(chunk.seq)
        async with self._taking:
            if chunk.seq < len(self.hashes):
                if self.hashes[chunk.seq] != digest:
                    raise ApiError(409, "idempotency_conflict", f"seq: chunk {chunk.seq} of this job was taken with "
                                   "other batches; send each chunk once, with the next seq", "seq")
                return self._answer(chunk.seq)
            self._check_open()
            if chunk.seq != len(self.hashes):
                raise ApiError(409, "invalid_request", f"seq: this job expects chunk {len(self.hashes)} next, not "
                               f"{chunk.seq}", "seq")
            try:
                prepared = await asyncio.to_thread(prepare_it)
            except ApiError as e:
                self.close(f"chunk {chunk.seq} was refused: {e.message}")
                raise
            self._check_open()
            await self.queue.put(prepared)  # waits for room: the trainer is at most CHUNKS_WAITING chunks behind
            self._check_open()  # the job failed while this waited: nothing of the chunk will train
            self.hashes.append(digest)
            self.batches += len(prepared.batches)
            self.dropped += prepared.dropped
            self.complete = chunk.last
            return self._answer(chunk.seq)

    def _check_open(self) -> None:
        if self.complete:
            raise ApiError(409, "job_ended", "this SFT job took its last chunk already", "seq")
        if self.closed is not None:
            raise ApiError(409, "job_ended", f"this SFT job takes no more batches: {self.closed}", "job_id")

    def _answer(self, seq: int) -> dict[str, int]:
        return {"seq": seq, "batches": self.batches, "dropped_rows": self.dropped}

    async def next(self) -> Prepared:
        """The next chunk. ArtcloudError when none comes for IDLE_S (the client is gone), or when the feed was
        closed meanwhile (the client abandoned the call, or a chunk was refused)."""
        try:
            chunk = await asyncio.wait_for(self.queue.get(), IDLE_S)
        except asyncio.TimeoutError:
            raise ArtcloudError(f"no batches came for {IDLE_S:.0f} s: the client is gone", code="client_gone") from None
        if chunk is None:
            self.check_wanted()  # closed: that is what the None says
        return chunk

    def check_wanted(self) -> None:
        """ArtcloudError when the job was abandoned (or a chunk refused) while it trained: between its batches and
        before its commit, so that an abort is never followed by a commit."""
        if self.closed is not None:
            raise ArtcloudError(f"the job was ended before its last chunk: {self.closed}", code="client_gone")

    def close(self, why: str) -> None:
        """Take no more chunks (the job ended, failed or was abandoned): a post waiting for room is freed (and
        refused), and a trainer waiting for a chunk wakes to fail the job."""
        self.closed = self.closed or why
        while not self.queue.empty():
            self.queue.get_nowait()
        self.queue.put_nowait(None)

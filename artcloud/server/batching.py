"""Dynamic batching of chat requests into the engine, and the lock that pauses inference during training.

Requests queue up while the engine is busy; when it frees up, the batcher takes everything waiting
(after a short gather window for stragglers, a few milliseconds against seconds of generation) and runs
it as one engine call per adapter. Concurrent rollouts therefore share forward passes instead of
queueing one at a time.
"""

from __future__ import annotations

import asyncio
import logging
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

from artcloud.server.api_errors import ApiError
from artcloud.server.engines.base import Completion, GenerationRequest

log = logging.getLogger("artcloud.server")


class RWLock:
    """Many readers (generation) or one writer (an adapter update). A waiting writer blocks new readers,
    so training is never starved by a steady stream of rollouts."""

    def __init__(self) -> None:
        self._cond = asyncio.Condition()
        self._readers = 0
        self._writer = False
        self._writers_waiting = 0

    @asynccontextmanager
    async def read(self):
        async with self._cond:
            await self._cond.wait_for(lambda: not self._writer and self._writers_waiting == 0)
            self._readers += 1
        try:
            yield
        finally:
            async with self._cond:
                self._readers -= 1
                self._cond.notify_all()

    @asynccontextmanager
    async def write(self):
        async with self._cond:
            self._writers_waiting += 1
            try:
                await self._cond.wait_for(lambda: not self._writer and self._readers == 0)
            finally:
                self._writers_waiting -= 1
            self._writer = True
        try:
            yield
        finally:
            async with self._cond:
                self._writer = False
                self._cond.notify_all()

    @property
    def writing(self) -> bool:
        return self._writer


@dataclass
class Pending:
    key: Any  # what must match to share an engine call (the model and requested step)
    request: GenerationRequest
    future: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())


# run(key, requests) -> (completions per request, what was served, e.g. "NAME@STEP")
RunBatch = Callable[[Any, list[GenerationRequest]], Awaitable[tuple[list[list[Completion]], str]]]


class Batcher:
    """Gathers queued requests into engine calls.

    The gather window scales with how long a batch takes: waiting 20 ms for stragglers costs nothing
    against a 5 s CPU generation, while a 30 ms one (a tiny model) should wait about 1 ms. Concurrent
    clients whose requests trickle in over new TLS connections then still land in one batch.
    """

    def __init__(self, run: RunBatch, *, max_rows: int = 64, gap_bounds: tuple[float, float] = (0.001, 0.02),
                 wait_bounds: tuple[float, float] = (0.005, 0.25), concurrent: bool = False,
                 max_queued_samples: int | None = None):
        self.run = run
        # concurrent: hand each batch over and go on gathering (a sampler with continuous batching of its
        # own, vLLM, takes new requests while others run); else wait for each batch (the torch sampler).
        self.concurrent = concurrent
        self._inflight: set[asyncio.Task] = set()
        self.max_rows = max_rows
        self.gap_bounds = gap_bounds
        self.wait_bounds = wait_bounds
        self.last_batch_s = 1.0  # until measured, assume a slow engine
        self.queue: asyncio.Queue[Pending] = asyncio.Queue()
        self._task: asyncio.Task | None = None
        self._waiting: set[asyncio.Future] = set()  # every submitted request's answer not yet given
        self.batches = 0  # engine calls made (GET /artcloud/status)
        self.abandoned = 0  # requests whose client went away before their answer (GET /artcloud/status)
        self.max_queued_samples = max_queued_samples
        self._samples = 0  # of the requests not yet answered

    def _window(self) -> tuple[float, float]:
        """(gap: stop after this long without a new request, max_wait: stop after this long in all)."""
        gap = min(max(0.02 * self.last_batch_s, self.gap_bounds[0]), self.gap_bounds[1])
        wait = min(max(0.05 * self.last_batch_s, self.wait_bounds[0]), self.wait_bounds[1])
        return gap, wait

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._loop(), name="artcloud-batcher")

    async def stop(self) -> None:
        """Cancel every engine call, and answer every request still waiting (queued, gathered or in flight)."""
        for task in list(self._inflight):
            task.cancel()
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
        for future in list(self._waiting):
            if not future.done():
                future.set_exception(ApiError(503, "shutting_down", "the server stopped generating: it is shutting down"))

    async def submit(self, key: Any, request: GenerationRequest) -> tuple[list[Completion], str]:
        """The request's completions once generated. A caller that is cancelled (its client went away) takes
        the request out: not generated if its batch has not begun, its rows dropped at the next step if it has."""
        if self.max_queued_samples is not None and self._samples + request.n > self.max_queued_samples:
            raise ApiError(429, "too_many_requests", f"{self._samples} samples are waiting for this model's engine "
                           f"(the limit, artcloud serve --max-queued-samples, is {self.max_queued_samples}): retry "
                           "once some are answered, or send fewer at once")
        self.start()
        item = Pending(key, request)
        self._waiting.add(item.future)
        self._samples += request.n

        def answered(future: asyncio.Future) -> None:
            self._waiting.discard(future)
            self._samples -= request.n
            if future.cancelled():
                request.abandoned = True
                self.abandoned += 1

        item.future.add_done_callback(answered)
        await self.queue.put(item)
        return await item.future

    async def _gather(self) -> list[Pending]:
        items = [await self.queue.get()]
        rows = items[0].request.n
        gap, max_wait = self._window()
        deadline = time.monotonic() + max_wait
        while rows < self.max_rows:
            timeout = min(gap, deadline - time.monotonic())
            if timeout <= 0:
                break
            try:
                item = await asyncio.wait_for(self.queue.get(), timeout)
            except asyncio.TimeoutError:
                break
            items.append(item)
            rows += item.request.n
        while not self.queue.empty() and rows < self.max_rows:  # whatever else is already here
            item = self.queue.get_nowait()
            items.append(item)
            rows += item.request.n
        return items

    async def _loop(self) -> None:
        while True:
            items = await self._gather()
            groups: dict[Any, list[Pending]] = {}
            for item in items:
                groups.setdefault(item.key, []).append(item)
            for key, group in groups.items():
                for p in group:  # a request whose client went away before its turn
                    if p.request.gone:
                        p.future.cancel()
                live = [p for p in group if not p.future.done()]  # a client may have gone away
                if not live:
                    continue
                if self.concurrent:
                    task = asyncio.get_running_loop().create_task(self._dispatch(key, live))
                    self._inflight.add(task)
                    task.add_done_callback(self._inflight.discard)
                else:
                    await self._dispatch(key, live)

    async def _dispatch(self, key: Any, live: list[Pending]) -> None:
        started = time.monotonic()
        try:
            results, served = await self.run(key, [p.request for p in live])
            self.batches += 1
            self.last_batch_s = time.monotonic() - started
        except Exception as e:  # the error belongs to these requests, not to the loop
            for p in live:
                if not p.future.done():
                    p.future.set_exception(e)
            return
        for p, completions in zip(live, results):
            if p.future.done():
                continue
            if isinstance(completions, BaseException):  # this request's own failure (ReplicaSet's)
                p.future.set_exception(completions)
            else:
                p.future.set_result((completions, served))

"""The batcher's two modes and the engine's gate between generations and training.

- serial (the torch sampler): one engine call at a time; requests that come meanwhile wait and are
  gathered into the next call.
- concurrent (vLLM): each gathered batch is handed over at once, so a request that comes while another
  batch runs starts right away (vLLM's continuous batching takes it in).
- stop() answers every request it leaves waiting (503 shutting_down).
- the Engine's gate, on the real CPU engine called from several threads: a training step never overlaps
  a generation, in either order; and a waiting step holds new generations back (barriers, no timing).
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from conftest import TINY
from helpers import wait_for

from artcloud.server.batching import Batcher
from artcloud.server.engines.base import GenerationRequest, SamplingParams


def _request() -> GenerationRequest:
    return GenerationRequest([1, 2, 3], 1, SamplingParams(max_tokens=4))


@pytest.mark.parametrize("concurrent", [False, True])
def test_a_request_during_a_batch_waits_for_it_only_when_serial(concurrent):
    spans: list[tuple[float, float]] = []

    async def run(key, requests):
        start = time.monotonic()
        await asyncio.sleep(0.3)
        spans.append((start, time.monotonic()))
        return [[] for _ in requests], "m"

    async def main():
        batcher = Batcher(run, concurrent=concurrent)
        first = asyncio.create_task(batcher.submit("k", _request()))
        await asyncio.sleep(0.1)  # the first batch is running
        second = asyncio.create_task(batcher.submit("k", _request()))
        await asyncio.gather(first, second)
        await batcher.stop()

    asyncio.run(main())
    (a_start, a_end), (b_start, b_end) = sorted(spans)
    if concurrent:
        assert b_start < a_end, spans  # the second batch started while the first ran
    else:
        assert b_start >= a_end, spans
    assert len(spans) == 2


def test_the_engine_gate_keeps_training_and_generation_apart(tmp_path):
    from artcloud.server.engines.base import TrainSample
    from artcloud.server.engines.cpu import CPUEngine
    from artcloud.types import LoraConfig, TrainConfig

    engine = CPUEngine(TINY)
    engine.create_adapter("a", LoraConfig(rank=4))
    spans: dict[str, list[tuple[float, float]]] = {"gen": [], "train": []}
    real_generate, real_train = engine.sampler.generate, engine.trainer.train_step

    def timed(kind, fn):
        def wrapper(*a, **kw):
            start = time.monotonic()
            try:
                return fn(*a, **kw)
            finally:
                spans[kind].append((start, time.monotonic()))
        return wrapper

    engine.sampler.generate = timed("gen", real_generate)
    engine.trainer.train_step = timed("train", real_train)
    (c,) = engine.generate("a", [_request()])[0]
    samples = [TrainSample([1, 2, 3], c.token_ids, c.logprobs, 1.0, 0), TrainSample([1, 2, 3], c.token_ids, c.logprobs, -1.0, 0)]
    errors: list[BaseException] = []

    def work(fn):
        try:
            for _ in range(5):
                fn()
        except BaseException as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(lambda: engine.generate("a", [_request()] * 4),)) for _ in range(2)]
    threads.append(threading.Thread(target=work, args=(lambda: engine.train_step("a", samples, TrainConfig(), lambda m: None),)))
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    assert len(spans["train"]) == 5 and len(spans["gen"]) == 11
    for ts, te in spans["train"]:
        for gs, ge in spans["gen"]:
            assert ge <= ts or gs >= te, ("a generation overlapped a training step", (gs, ge), (ts, te))


@pytest.mark.parametrize("concurrent", [False, True])
def test_stop_answers_every_request_it_leaves_waiting(concurrent):
    """D14: a request in flight (its engine call cancelled) or still queued gets 503 shutting_down, not a
    future nobody ever resolves."""
    from artcloud.server.api_errors import ApiError

    async def main():
        running = asyncio.Event()

        async def run(key, requests):
            running.set()
            await asyncio.Event().wait()  # an engine call that never ends by itself

        batcher = Batcher(run, concurrent=concurrent)
        in_flight = asyncio.create_task(batcher.submit("k", _request()))
        await running.wait()
        queued = asyncio.create_task(batcher.submit("other", _request()))
        await asyncio.sleep(0)
        await batcher.stop()
        for task in (in_flight, queued):
            with pytest.raises(ApiError) as e:
                await asyncio.wait_for(task, 5)
            assert e.value.status == 503 and e.value.code == "shutting_down"

    asyncio.run(main())


def test_a_request_whose_caller_goes_is_not_generated_and_a_full_queue_is_429():
    """Security review 5: the chat route cancels its submit when the client disconnects. A request still
    queued then never reaches the engine (counted in `abandoned`), and past --max-queued-samples a request is
    refused at once instead of waiting behind minutes of work."""
    from artcloud.server.api_errors import ApiError

    async def main():
        running, release, seen = asyncio.Event(), asyncio.Event(), []

        async def run(key, requests):
            seen.append(list(requests))
            running.set()
            await release.wait()
            return [[] for _ in requests], "m"

        batcher = Batcher(run, max_queued_samples=3)
        first = asyncio.create_task(batcher.submit("k", _request()))
        await running.wait()  # the first batch runs; the next two wait behind it
        gone, stays = (GenerationRequest([1], 1, SamplingParams(max_tokens=4)) for _ in range(2))
        left = asyncio.create_task(batcher.submit("k", gone))
        kept = asyncio.create_task(batcher.submit("k", stays))
        await asyncio.sleep(0)
        with pytest.raises(ApiError) as e:  # 3 samples wait or run: the limit
            await batcher.submit("k", _request())
        assert (e.value.status, e.value.code) == (429, "too_many_requests") and "--max-queued-samples" in e.value.message
        left.cancel()  # its client went away
        await asyncio.gather(left, return_exceptions=True)
        assert gone.abandoned and batcher.abandoned == 1
        release.set()
        await asyncio.gather(first, kept)
        assert [len(batch) for batch in seen] == [1, 1] and seen[1][0] is stays  # `gone` never generated
        await batcher.submit("k", _request())  # room again
        await batcher.stop()

    asyncio.run(main())


def test_the_cpu_sampler_drops_an_abandoned_requests_rows_at_the_next_step(one_torch_thread):
    from conftest import tiny_engine_with_adapter

    engine = tiny_engine_with_adapter("a", 0.1)
    slot = "a"
    params = SamplingParams(max_tokens=40, temperature=1.0, seed=3)
    kept, gone = GenerationRequest([1, 2, 3], 2, params), GenerationRequest([1, 2, 3], 2, params, abandoned=True)
    out = engine.generate(slot, [kept, gone])
    assert [len(c.token_ids) for c in out[1]] == [1, 1]  # out after the first step
    assert max(len(c.token_ids) for c in out[0]) > 1


class _HeldSampler:
    """A sampler whose generations wait on `release` (set per call); it records what started."""

    max_context = 64
    shares_trainer_weights = True
    concurrent = True
    can_sleep = False

    def __init__(self, log: list[str]):
        self.log, self.started, self.release = log, threading.Semaphore(0), {}

    def generate(self, slot, requests):
        self.log.append(f"generate {slot}")
        self.started.release()
        assert self.release[slot].wait(30)
        return [[] for _ in requests]

    def status(self):
        return {"kind": "held", "state": "ready"}


class _Trainer:
    base_model, tokenizer, vocab_size, max_context = "m", None, 8, 64

    def __init__(self, log: list[str]):
        self.log = log

    def train_step(self, slot, samples, config, on_step):
        self.log.append(f"train {slot}")
        return []


def test_a_waiting_training_step_holds_new_generations_back():
    """D8: a train_step waiting for a generation in flight blocks new generations (another model's traffic on
    the same base model), so steady sampling cannot starve training."""
    from artcloud.server.engines.engine import Engine

    log: list[str] = []
    sampler = _HeldSampler(log)
    engine = Engine(sampler, _Trainer(log))  # duck-typed halves: only the gate is under test
    sampler.release = {"old": threading.Event(), "new": threading.Event()}
    sampler.release["new"].set()
    old = threading.Thread(target=engine.generate, args=("old", [_request()]))
    old.start()
    assert sampler.started.acquire(timeout=30)  # a generation in flight
    train = threading.Thread(target=engine.train_step, args=("a", [], None, lambda m: None))
    train.start()
    wait_for("the step to wait for the generation in flight", lambda: engine._training_waits == 1, 30, every=0.01)
    new = threading.Thread(target=engine.generate, args=("new", [_request()]))
    new.start()
    assert not sampler.started.acquire(timeout=0.2)  # the new generation does not start meanwhile
    sampler.release["old"].set()
    for t in (old, train, new):
        t.join(30)
    assert log == ["generate old", "train a", "generate new"]

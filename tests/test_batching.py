"""The batcher's two modes and the engine's gate between generations and training.

- serial (the torch sampler): one engine call at a time; requests that come meanwhile wait and are
  gathered into the next call.
- concurrent (vLLM): each gathered batch is handed over at once, so a request that comes while another
  batch runs starts right away (vLLM's continuous batching takes it in).
- the Engine's gate, on the real CPU engine called from several threads: a training step never overlaps
  a generation, in either order.
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from conftest import TINY

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

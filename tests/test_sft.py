"""Supervised fine-tuning (OpenPipe ART's model.train_sft and art.utils.sft): which tokens train, the loss against
transformers' own cross-entropy, the schedules against ART's, one step per call, streaming in chunks, a bad row
named by its line, and nothing committed by a call that does not finish."""

from __future__ import annotations

import asyncio
import json
import random

import httpx
import pytest
import torch
from conftest import tiny_engine_with_adapter
from helpers import chat, events
from tolerances import TINY_HIDDEN, logprob_bound

import artcloud
from artcloud.backends.remote import RemoteBackend
from artcloud.errors import InvalidArgument
from artcloud.server import chat as chat_render
from artcloud.server.sft import conversation_samples
from artcloud.supervised import Row
from artcloud.train.loop import SFTStep
from artcloud.utils import sft
from artcloud.wire import SFTBatch

TINY = "artcloud/tiny-random"
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def backend_for(server) -> RemoteBackend:
    return RemoteBackend(server.url, token=server.token, ca_cert=server.ca, heartbeat_every_s=0)


def conversation(i: int) -> list[dict]:
    return [{"role": "system", "content": "Answer with a number."}, {"role": "user", "content": f"{i} + 1?"},
            {"role": "assistant", "content": f"{i + 1}"}, {"role": "user", "content": "And plus two?"},
            {"role": "assistant", "content": f"{i + 2}"}]


# ------------------------------------------------------------------------------------- which tokens, what loss


def test_only_the_assistants_tokens_train_tool_calls_included():
    engine = tiny_engine_with_adapter("m", scale=0.0)
    messages = [{"role": "user", "content": "Weather in Oslo?"},
                {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function", "function": {
                    "name": "weather", "arguments": "{\"city\": \"Oslo\"}"}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "rain, 4 C"},
                {"role": "assistant", "content": "Rain and 4 degrees."}]
    tools = [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}]
    ids, trained = chat_render.render_conversation(engine.tokenizer, messages, tools)
    text = engine.tokenizer.decode([t for t, keep in zip(ids, trained) if keep])
    assert "<tool_call>" in text and '"city": "Oslo"' in text and "Rain and 4 degrees." in text  # the assistant's
    assert "Weather in Oslo?" not in text and "rain, 4 C" not in text and "weather" not in text.split("<tool_call>")[0]
    # The context of each assistant turn is the prompt the server renders for sampling it (render_prompt).
    first = trained.index(True)
    assert ids[:first] == chat_render.render_prompt(engine.tokenizer, messages[:1], tools)


@pytest.mark.numeric
def test_the_loss_is_transformers_cross_entropy_on_the_assistant_tokens():
    """One SFT step's reported loss equals the mean token cross-entropy that transformers computes itself with
    labels -100 on every token but the assistant's, before the step."""
    engine = tiny_engine_with_adapter("m", scale=0.1)
    batch = SFTBatch(rows=[{"messages": conversation(i)} for i in range(3)], learning_rate=1e-3)
    samples, dropped = conversation_samples(engine, batch, "batches[0]")
    assert dropped == 0 and len(samples) == 3
    model = engine.trainer.activate("m")
    total, tokens = 0.0, 0
    with torch.no_grad():
        for s in samples:
            ids = torch.tensor([s.prompt_ids + s.completion_ids])
            labels = torch.tensor([[-100] * len(s.prompt_ids) + [t if k else -100 for t, k in zip(s.completion_ids, s.trained)]])
            n = int((labels[:, 1:] != -100).sum())
            total += float(model(input_ids=ids, labels=labels).loss) * n
            tokens += n
    (metrics,) = engine.train_step("m", samples, SFTStep(learning_rate=1e-3), lambda m: None)
    assert metrics["tokens"] == tokens
    # The same forward on other shapes (a batch, the prompt apart): logits within float32's bound for dot products
    # over the hidden size (tolerances.py), and so each token's cross-entropy, and their mean
    assert abs(metrics["loss"] - total / tokens) <= logprob_bound([total / tokens], TINY_HIDDEN)


def test_a_row_longer_than_the_model_takes_is_dropped_as_in_art():
    engine = tiny_engine_with_adapter("m", scale=0.0)
    long = [{"role": "user", "content": "x " * engine.max_context}, {"role": "assistant", "content": "y"}]
    samples, dropped = conversation_samples(engine, SFTBatch(rows=[{"messages": long}, {"messages": conversation(1)}],
                                                             learning_rate=1e-3), "batches[0]")
    assert (len(samples), dropped) == (1, 1)


# ------------------------------------------------------------------------------------- ART's helpers


def test_the_schedules_are_arts():
    # ART's create_lr_schedule: warmup (step + 1) / warmup_steps, then decay over the steps left, ending at min_lr
    assert sft.create_lr_schedule(5, 1.0, "linear", warmup_steps=2) == pytest.approx([0.5, 1.0, 1.0, 0.5, 0.0])
    assert sft.create_lr_schedule(4, 2.0, "constant", warmup_steps=1) == [2.0] * 4
    cosine = sft.create_lr_schedule(5, 1.0, "cosine", min_lr=0.1)
    assert cosine[0] == 1.0 and cosine[-1] == pytest.approx(0.1) and cosine[2] == pytest.approx(0.55)
    assert sft.create_lr_schedule(0, 1.0) == [] and sft.create_lr_schedule(1, 3.0) == [3.0]
    with pytest.raises(InvalidArgument, match="unknown schedule"):
        sft.create_lr_schedule(3, 1.0, "step")  # type: ignore[arg-type]

    trajectories = [artcloud.Trajectory(messages_and_choices=conversation(i)) for i in range(7)]
    chunks = list(sft.create_sft_dataset_iterator(trajectories, chunk_size=2, epochs=2, batch_size=2, peak_lr=1.0,
                                                  warmup_ratio=0.25, show_progress=False))
    schedule = sft.create_lr_schedule(8, 1.0, "linear", warmup_steps=2)
    assert [(c.step, c.epoch, c.epoch_step, len(c.trajectories)) for c in chunks] == [
        (0, 0, 0, 4), (2, 0, 2, 3), (4, 1, 0, 4), (6, 1, 2, 3)]
    assert [r for c in chunks for r in c.config.learning_rate] == pytest.approx(schedule)
    order = list(trajectories)
    random.Random(42).shuffle(order)  # ART's shuffle: seed + epoch
    assert chunks[0].trajectories + chunks[1].trajectories == order
    resumed = list(sft.create_sft_dataset_iterator(trajectories, chunk_size=2, epochs=2, batch_size=2, initial_step=4,
                                                   show_progress=False))
    assert [c.step for c in resumed] == [4, 6]


def test_a_file_is_shuffled_through_a_buffer_as_arts_iterate_file(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps({"messages": conversation(i)}) + "\n" + ("\n" if i == 3 else "")
                            for i in range(10)))
    assert sft.get_file_row_count(str(path)) == 10
    got = [t.messages()[1]["content"] for t in sft.iterate_file(str(path), epochs=2, shuffle_buffer_size=4, seed=3)]
    expected = []
    for epoch in range(2):  # ART's buffer: once full, a random one leaves; the rest shuffled at the end
        rng, buffer = random.Random(3 + epoch), []
        for i in range(10):
            buffer.append(i)
            if len(buffer) >= 4:
                expected.append(buffer.pop(rng.randint(0, len(buffer) - 1)))
        rng.shuffle(buffer)
        expected += buffer
    assert got == [f"{i} + 1?" for i in expected]
    skipped = [t.messages()[1]["content"] for t in sft.iterate_file(str(path), shuffle_buffer_size=4, seed=3,
                                                                    initial_skip=6)]
    assert skipped == got[6:10]
    with pytest.raises(InvalidArgument, match="only JSONL"):
        sft.get_file_row_count(str(tmp_path / "data.json"))


# ------------------------------------------------------------------------------------- through the server


def test_each_train_sft_call_is_one_step_that_learns(tiny_server):
    async def main():
        backend = backend_for(tiny_server)
        model = artcloud.TrainableModel(name="sft", project="sft", base_model=TINY)
        await model.register(backend)
        trajectories = [artcloud.Trajectory(messages_and_choices=conversation(i)) for i in range(6)]
        first = await model.train_sft(trajectories * 4, artcloud.TrainSFTConfig(learning_rate=2e-2, batch_size=3),
                                      progress=False)
        steps = [e for e in first.events if e["type"] == "step"]
        assert (first.step, first.trained, len(steps)) == (1, True, 8)  # 24 rows in batches of 3: 8 optimizer steps
        assert [s["data"]["gradient_step"] for s in steps] == list(range(1, 9))
        losses = [s["data"]["loss"] for s in steps]  # the same 6 conversations, 4 times over: they are learned
        assert sum(losses[-2:]) / 2 < sum(losses[:2]) / 2 - 0.3, losses
        assert first.metrics["batches"] == 8 and first.metrics["trajectories"] == 24
        info = await backend.model_info("sft")
        assert info.step == 1 and info.checkpoints == [0, 1] and info.history[-1]["kind"] == "sft"
        # A list of rates: one per batch; ART's default batch_size ("auto") is 2
        rates = [1e-3, 2e-3, 3e-3]
        second = await model.train_sft(trajectories, artcloud.TrainSFTConfig(learning_rate=rates), progress=False)
        assert second.step == 2 and [e["data"]["learning_rate"] for e in second.events if e["type"] == "step"] == rates
        with pytest.raises(InvalidArgument, match="3 rates, one per batch"):
            await model.train_sft(trajectories * 2, artcloud.TrainSFTConfig(learning_rate=rates), progress=False)
        assert (await backend.model_info("sft")).step == 2  # nothing of the refused call was committed
        await backend.close()

    asyncio.run(main())


def test_a_bad_row_is_named_by_its_line_and_nothing_is_committed(tiny_server, tmp_path):
    path = tmp_path / "data.jsonl"
    lines = [json.dumps({"messages": conversation(i)}) for i in range(5)]
    path.write_text("\n".join([*lines[:2], '{"messages": [{"role": "user", "content": "no answer"}]}', *lines[2:]]))

    async def main():
        backend = backend_for(tiny_server)
        model = artcloud.TrainableModel(name="badrow", project="sft", base_model=TINY)
        await model.register(backend)
        with pytest.raises(InvalidArgument, match=r"data.jsonl line 3: no assistant message") as e:
            await sft.train_sft_from_file(model, str(path), batch_size=2)
        assert "\n" not in str(e.value)
        # A row the server refuses (here one the client did not check) is named too, and the job ends with it.
        rows = [Row({"messages": conversation(i)}, f"data.jsonl line {i + 1}") for i in range(4)]
        rows.append(Row({"messages": [{"role": "user", "content": "?"}]}, "data.jsonl line 9"))
        with pytest.raises(InvalidArgument, match=r"^data.jsonl line 9\.messages: no assistant message.*nothing of"):
            await model.train_sft(rows, artcloud.TrainSFTConfig(batch_size=2), progress=False)
        assert (await backend.model_info("badrow")).step == 0
        await backend.close()

    asyncio.run(main())
    with tiny_server.client() as c:
        assert chat(c, "badrow")["model"] == "badrow@0"  # served again: the failed job let the model go


def test_a_chunk_sent_twice_trains_once_and_an_abandoned_job_commits_nothing(tiny_server):
    with tiny_server.client() as c:
        assert c.post("/artcloud/models", json={"name": "chunks", "project": "sft", "base_model": TINY}).status_code == 200
        before = chat(c, "chunks", "x", temperature=0)["choices"][0]["token_ids"]
        batch = {"rows": [{"messages": conversation(1)}, {"messages": conversation(2)}], "learning_rate": 5e-2}
        job = c.post("/artcloud/models/chunks/sft", json={"idempotency_key": "k1", "batches": 3}).json()["job_id"]
        first = c.post(f"/artcloud/jobs/{job}/sft", json={"seq": 0, "batches": [batch, batch]})
        again = c.post(f"/artcloud/jobs/{job}/sft", json={"seq": 0, "batches": [batch, batch]})
        assert first.status_code == again.status_code == 200 and first.json() == again.json()
        assert first.json()["batches"] == 2
        other = c.post(f"/artcloud/jobs/{job}/sft", json={"seq": 0, "batches": [batch]})
        assert other.status_code == 409 and other.json()["error"]["field"] == "seq"
        skip = c.post(f"/artcloud/jobs/{job}/sft", json={"seq": 5, "batches": [batch]})
        assert skip.status_code == 409
        assert c.post(f"/artcloud/jobs/{job}/sft", json={"seq": 1, "batches": [batch], "last": True}).status_code == 200
        evs = events(c, job)
        assert evs[-1]["type"] == "end" and evs[-1]["data"]["step"] == 1
        assert [e["data"]["gradient_step"] for e in evs if e["type"] == "step"] == [1, 2, 3]  # not 5: seq 0 once
        late = c.post(f"/artcloud/jobs/{job}/sft", json={"seq": 2, "batches": [batch]})
        assert late.status_code == 409

        # Abandoned half-way: an error event, the model where it was (same greedy answer), no new checkpoint.
        at_one = chat(c, "chunks", "x", temperature=0)["choices"][0]["token_ids"]
        assert at_one != before
        job = c.post("/artcloud/models/chunks/sft", json={"idempotency_key": "k2"}).json()["job_id"]
        assert c.post(f"/artcloud/jobs/{job}/sft", json={"seq": 0, "batches": [batch, batch]}).status_code == 200
        assert c.post(f"/artcloud/jobs/{job}/sft", json={"seq": 1, "abort": True}).status_code == 200
        evs = events(c, job)
        assert evs[-1]["type"] == "error" and evs[-1]["data"]["code"] == "client_gone", evs[-1]
        info = c.get("/artcloud/models/chunks").json()
        assert info["step"] == 1 and info["checkpoints"] == [0, 1]
        assert chat(c, "chunks", "x", temperature=0)["choices"][0]["token_ids"] == at_one
        bad = c.post(f"/artcloud/jobs/{job}/sft", json={"seq": 0, "batches": [{"rows": [], "learning_rate": 1}]})
        assert bad.status_code in (400, 409)
        r = c.post("/artcloud/jobs/job-00000000000000000000/sft", json={"seq": 0})
        assert r.status_code == 404


def test_an_abort_is_honoured_until_the_last_batch_has_trained_and_refused_once_the_step_commits():
    """The job checks for an abort before each batch and before its commit; once it commits, an abort is a 409 (the
    client then follows the job to its end) rather than a 200 followed by a commit nobody expects."""
    from artcloud.errors import ArtcloudError
    from artcloud.server.api_errors import ApiError
    from artcloud.server.sft import Feed
    from artcloud.wire import SFTChunk

    async def main() -> None:
        feed = Feed(total=2, max_grad_norm=None)
        feed.check_wanted()  # open: nothing raised
        assert (await feed.put(SFTChunk(seq=0, abort=True), "", None))["seq"] == 0
        with pytest.raises(ArtcloudError) as gone:
            feed.check_wanted()
        assert gone.value.code == "client_gone" and "abandoned" in str(gone.value)

        committing = Feed(total=2, max_grad_norm=None)
        committing.committing = True
        with pytest.raises(ApiError) as late:
            await committing.put(SFTChunk(seq=1, abort=True), "", None)
        assert late.value.status == 409 and committing.closed is None
        committing.check_wanted()

    asyncio.run(main())


@pytest.mark.slow
def test_a_100000_row_file_trains_with_bounded_memory(start_server, tmp_path):
    """Streamed end to end: neither the client nor the server ever holds the file. Its rows would take hundreds of
    MB as Python objects; the client's peak memory may grow by far less, and the server's too."""
    import subprocess
    import sys
    import textwrap

    rows = 100_000
    path = tmp_path / "big.jsonl"
    with path.open("w") as f:
        for i in range(rows):
            f.write(json.dumps({"messages": [{"role": "system", "content": "."}, {"role": "user", "content": f"{i}?"},
                                             {"role": "assistant", "content": f"{i % 10}"}]}) + "\n")
    # tiny-random's tokenizer and chat template on a model 40x smaller (2.7 M tokens to train, on 2 cores)
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from artcloud.server.engines import tiny

    micro = tiny.build(tmp_path / "micro")
    like = json.loads((micro / "config.json").read_text())
    Qwen2ForCausalLM(Qwen2Config(**{k: like[k] for k in ("vocab_size", "max_position_embeddings", "eos_token_id",
                                                         "pad_token_id")},
                                 hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                                 num_key_value_heads=1, tie_word_embeddings=True)).save_pretrained(micro)
    # Tensors of 1 MiB and more mapped and unmapped as they come and go, not kept in the heap's free lists, where
    # freed activations of all sizes would leave the resident size to drift with the allocator's fragmentation.
    server = start_server(tmp_path / "srv", env={"MALLOC_MMAP_THRESHOLD_": str(1 << 20)})

    script = textwrap.dedent(f"""
        import asyncio, json, resource, sys
        import artcloud
        from artcloud.backends.remote import RemoteBackend
        from artcloud.utils.sft import train_sft_from_file

        async def main():
            backend = RemoteBackend({server.url!r}, token={server.token!r}, ca_cert={str(server.ca)!r},
                                    heartbeat_every_s=0)
            model = artcloud.TrainableModel(name="big", project="sft", base_model={str(micro)!r})
            await model.register(backend)
            before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            result = await train_sft_from_file(model, {str(path)!r}, batch_size=1000, peak_lr=1e-3,
                                               shuffle_buffer_size=1000)
            after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            print(json.dumps({{"step": result.step, "metrics": result.metrics, "grew_kb": after - before}}))
            await backend.close()

        asyncio.run(main())
    """)
    with server.client() as c:
        assert c.post("/artcloud/models", json={"name": "big", "project": "sft",
                                                "base_model": str(micro)}).status_code == 200
    # The server's memory, sampled while the file streams through it: bounded, it stops growing once training runs
    # (the model, one batch's activations, a few chunks); holding the rows, it would grow all along.
    import threading

    samples_kb: list[int] = []
    done = threading.Event()

    def sample() -> None:
        while not done.wait(0.25):
            status = open(f"/proc/{server.proc.pid}/status").read()
            samples_kb.append(int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmRSS:"))))

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=900)
    done.set()
    sampler.join()
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["step"] == 1 and result["metrics"]["trajectories"] == rows and result["metrics"]["batches"] == 100
    # What the whole file takes as the rows a reader would hold (Python objects), from a sample of 1000 of them:
    import tracemalloc

    with path.open() as f:
        sample = [next(f) for _ in range(1000)]
    tracemalloc.start()
    held = [json.loads(line) for line in sample]
    whole_kb = tracemalloc.get_traced_memory()[0] * rows // 1000 // 1024
    tracemalloc.stop()
    del held
    assert whole_kb > 50_000  # ~100 MB: what holding it whole would cost
    assert result["grew_kb"] < whole_kb / 4, (result["grew_kb"], whole_kb)
    # What stays resident between batches (each window's least: activations come and go above it), in the second
    # quarter and the last, both inside training: a server holding the rows would keep half the file more by then
    # (the two windows' middles are half the run apart), as tokens (~40% of the size of the rows as JSON objects):
    # 0.5 x 0.4 = whole / 5 (a server made to keep its chunks grew by 46 MB here, whole / 2.5). A streaming server's
    # allocator moves too: 16 MB once on a clean clone (2026-12-07), over the whole / 8 this bound was before.
    quarter = len(samples_kb) // 4
    second, last = min(samples_kb[quarter:2 * quarter]), min(samples_kb[3 * quarter:])
    assert quarter >= 20 and last - second < whole_kb / 5, (second, last, whole_kb, samples_kb[::10])
    with server.client() as c:
        assert c.get("/artcloud/models/big").json()["step"] == 1


def test_the_sft_routes_need_the_token(tiny_server):
    with httpx.Client(base_url=tiny_server.url, verify=tiny_server.ssl_context()) as c:
        assert c.post("/artcloud/models/agent/sft", json={}).status_code == 401
        assert c.post("/artcloud/jobs/job-00000000000000000000/sft", json={"seq": 0}).status_code == 401

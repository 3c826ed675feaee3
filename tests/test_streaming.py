"""Streamed chat completions (stream=true): OpenAI's chunks with token ids and logprobs, read by the real
`openai` client; artcloud.collect_stream; logprobs by default; and a streamed rollout trains exactly as
an unstreamed one."""

from __future__ import annotations

import asyncio
import json
import re

import openai
import pytest
from helpers import wait_for
from openai.types.chat import ChatCompletion
from safetensors.torch import load_file

import artcloud
from artcloud.backends.remote import RemoteBackend
from artcloud.server import chat, chat_stream
from artcloud.server.engines.base import Completion, GenerationRequest, SamplingParams
from artcloud.streaming import StreamCollector

TINY = "artcloud/tiny-random"
HI = [{"role": "user", "content": "hi"}]


def client_for(server) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=server.token, max_retries=0,
                              http_client=openai.DefaultAsyncHttpxClient(verify=server.ssl_context()))


async def chunks_and_plain(server, **kw):
    """The chunks of a streamed request, and the same request (same seed) unstreamed."""
    async with client_for(server) as client:
        stream = await client.chat.completions.create(model="agent", messages=HI, stream=True, **kw)
        chunks = [c async for c in stream]
        kw.pop("stream_options", None)  # only with stream=true
        plain = await client.chat.completions.create(model="agent", messages=HI, **kw)
    return chunks, plain


@pytest.mark.numeric
def test_the_openai_client_reads_tokens_ids_and_logprobs_chunk_by_chunk(tiny_server):
    chunks, plain = asyncio.run(chunks_and_plain(tiny_server, n=2, max_tokens=12, seed=5, temperature=1.0,
                                                 top_logprobs=2, stream_options={"include_usage": True}))
    assert {c.object for c in chunks} == {"chat.completion.chunk"} and len({c.id for c in chunks}) == 1
    assert {c.model for c in chunks} == {"agent@0"}
    first, usage = chunks[0], chunks[-1]
    assert first.prompt_token_ids == plain.prompt_token_ids
    assert [c.delta.role for c in first.choices] == ["assistant", "assistant"]
    assert [c.prompt_sha256 for c in first.choices] == [c.prompt_sha256 for c in plain.choices]
    assert [c.temperature for c in first.choices] == [1.0, 1.0]
    assert usage.choices == [] and usage.usage.completion_tokens == sum(len(c.token_ids) for c in plain.choices)
    assert usage.usage.prompt_tokens == len(plain.prompt_token_ids)
    assert all(c.usage is None for c in chunks[:-1])

    for want in plain.choices:
        mine = [c.choices[0] for c in chunks[1:-1] if c.choices[0].index == want.index]
        with_tokens = [c for c in mine if getattr(c, "token_ids", None)]
        # Streamed as generated: the tokens come over many chunks, each with its ids' logprobs.
        assert len(with_tokens) >= min(3, len(want.token_ids))
        for c in with_tokens:
            assert len(c.logprobs.content) == len(c.token_ids)
            assert all(len(e.top_logprobs) == 2 and e.logprob <= 0 for e in c.logprobs.content)
        assert [t for c in with_tokens for t in c.token_ids] == want.token_ids
        assert [e.model_dump() for c in with_tokens for e in c.logprobs.content] == [e.model_dump() for e in want.logprobs.content]
        assert "".join(c.delta.content or "" for c in mine) == want.message.content
        assert [c.finish_reason for c in mine if c.finish_reason] == [want.finish_reason]
        assert mine[-1].finish_reason is not None


@pytest.mark.numeric
def test_collect_stream_gives_the_unstreamed_completion(tiny_server):
    async def main():
        async with client_for(tiny_server) as client:
            stream = await client.chat.completions.create(model="agent", messages=HI, n=3, max_tokens=10, seed=9,
                                                          stream=True, stream_options={"include_usage": True})
            collected = await artcloud.collect_stream(stream)
            plain = await client.chat.completions.create(model="agent", messages=HI, n=3, max_tokens=10, seed=9)
        return collected, plain

    collected, plain = asyncio.run(main())
    assert type(collected) is type(plain)
    skip = {"id", "created"}
    assert collected.model_dump(exclude=skip) == plain.model_dump(exclude=skip)
    assert collected.choices[0].token_ids and collected.choices[0].logprobs.content


def test_logprobs_come_unless_asked_not_to(tiny_server):
    with tiny_server.client() as c:
        body = {"model": "agent", "messages": HI, "max_tokens": 4}
        r = c.post("/v1/chat/completions", json=body).json()["choices"][0]
        assert len(r["logprobs"]["content"]) == len(r["token_ids"]) > 0
        r = c.post("/v1/chat/completions", json={**body, "logprobs": False}).json()["choices"][0]
        assert r["logprobs"] is None and r["token_ids"]
        r = c.post("/v1/chat/completions", json={**body, "top_logprobs": 3}).json()["choices"][0]
        assert all(len(e["top_logprobs"]) == 3 for e in r["logprobs"]["content"])
        with c.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as s:
            events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
        token_choices = [ch for e in events for ch in e["choices"] if ch.get("token_ids")]
        assert token_choices and all(len(ch["logprobs"]["content"]) == len(ch["token_ids"]) for ch in token_choices)
        with c.stream("POST", "/v1/chat/completions", json={**body, "stream": True, "logprobs": False}) as s:
            events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
        assert all(ch.get("logprobs") is None for e in events for ch in e["choices"])


@pytest.mark.parametrize("patch, field", [
    ({"stream": "maybe"}, "stream"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),  # without stream=true
    ({"stream": True, "stream_options": {"include_usage": "often"}}, "stream_options.include_usage"),
    ({"stream": True, "stream_options": "usage"}, "stream_options"),
    ({"stream": True, "logprobs": False, "top_logprobs": 2}, "top_logprobs"),
])
def test_bad_stream_requests_name_the_field(tiny_server, patch, field):
    with tiny_server.client() as c:
        r = c.post("/v1/chat/completions", json={"model": "agent", "messages": HI, "max_tokens": 2, **patch})
        assert r.status_code == 400 and r.headers["content-type"] == "application/json", r.text
        assert r.json()["error"]["field"] == field and field.split(".")[0] in r.json()["error"]["message"]


def test_errors_before_the_first_chunk_are_plain_http_errors(tiny_server):
    with tiny_server.client() as c:
        r = c.post("/v1/chat/completions", json={"model": "agent@999", "messages": HI, "stream": True})
        assert r.status_code == 404 and r.json()["error"]["code"] == "step_not_found"


def test_a_client_gone_mid_stream_stops_its_generation_and_the_server_serves_on(tiny_server):
    body = {"model": "agent", "messages": HI, "max_tokens": 400, "temperature": 0, "stream": True}
    with tiny_server.client() as c:
        with c.stream("POST", "/v1/chat/completions", json=body) as s:
            assert s.status_code == 200 and s.headers["content-type"].startswith("text/event-stream")
            seen, stream_id = 0, None
            for line in s.iter_lines():
                if line.startswith("data: {"):
                    event = json.loads(line[6:])
                    stream_id = event["id"]
                    seen += bool(event["choices"][0].get("token_ids"))
                if seen == 2:
                    break  # and hang up: leaving the block closes the connection
    # Greedy on tiny-random never reaches EOS within 400 tokens "hi" (checked below): only the hang-up stops it.
    pattern = re.compile(rf"chat stream {stream_id}: the client went away; generation stopped after (\d+) tokens \(max_tokens 400\)")
    found = wait_for("the server to log that it stopped", lambda: pattern.search(tiny_server.log.read_text()), timeout=120)
    assert int(found.group(1)) < 400
    with tiny_server.client() as c:
        r = c.post("/v1/chat/completions", json={**body, "stream": False, "max_tokens": 30})
        assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"
        with c.stream("POST", "/v1/chat/completions", json={**body, "max_tokens": 3}) as s:
            lines = [line for line in s.iter_lines() if line.startswith("data:")]
        assert lines[-1] == "data: [DONE]"


# ------------------------------------------------------------------------------------------ what a choice says


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    from artcloud.server.engines import loading

    return AutoTokenizer.from_pretrained(loading.resolve(TINY))


CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Berlin"}}\n</tool_call>'


@pytest.mark.parametrize("text, stop, tools", [
    ("Sure, looking. " + CALL, [], True),
    (CALL, [], True),
    ("  " + CALL + " then", [], True),
    ("  no call after all  ", [], True),
    ("Half <tool_call> broken </tool_call>", [], True),
    ("Café 42 and 日本 Paris", [], False),
    ("The capital is Paris. Then more", ["Paris", "zzz"], False),
    ("", [], False),
])
def test_a_streamed_choice_is_the_unstreamed_one(tok, text, stop, tools):
    """Text held back (tool calls, stop strings, split characters, whitespace) and sent at the end: the
    chunks, put together, are the unstreamed choice whatever the text."""
    ids = tok.encode(text, add_special_tokens=False) + [tok.convert_tokens_to_ids("<|im_end|>")]
    final = text[: text.find(stop[0])] if stop and stop[0] in text else text
    completion = Completion(token_ids=ids, logprobs=[-0.25] * len(ids), top_logprobs=None, finish_reason="stop",
                            text=final, temperature=0.5)
    prompt = [1, 2, 3]

    async def run() -> list[str]:
        sink = chat_stream.ChatStream()
        request = GenerationRequest(prompt, 1, SamplingParams(temperature=0.5, stop=stop))

        async def generate():
            for t in ids:  # one token a step, as the torch sampler hands them over
                sink.tokens(0, [t], [-0.25], None)
                await asyncio.sleep(0)
            return [completion], "m@0"

        task = asyncio.ensure_future(generate())
        task.add_done_callback(lambda _: sink.queue.put_nowait(("done",)))
        events = chat_stream._chunks(sink, task, lambda: None, "chatcmpl-x", "m@0", request, prompt, tok,
                                     want_logprobs=True, want_token_ids=True, parse_tools=tools, include_usage=False)
        return [e async for e in events]

    events = asyncio.run(run())
    assert events[-1] == "data: [DONE]\n\n"
    collector = StreamCollector()
    for e in events[:-1]:
        collector.add(json.loads(e.removeprefix("data: ")))
    got = collector.completion().model_dump(mode="json")["choices"][0]
    plain = chat.completion_response(served_as="m@0", prompt_ids=prompt, completions=[completion], tokenizer=tok,
                                     want_logprobs=True, want_token_ids=True, parse_tools=tools)
    want = ChatCompletion.construct(**plain).model_dump(mode="json")["choices"][0]  # as the openai client reads it
    for call in got["message"]["tool_calls"] or []:
        call["id"] = "call"
    for call in want["message"]["tool_calls"] or []:
        call["id"] = "call"
    assert got == want
    if tools and "get_weather" in text and "broken" not in text:
        assert want["message"]["tool_calls"] and want["finish_reason"] == "tool_calls"


# ------------------------------------------------------------------------------------------ training


@pytest.mark.numeric
def test_a_streamed_and_an_unstreamed_rollout_of_the_same_seed_train_to_the_same_adapter(tiny_server):
    """Two models on one base, the same prompts and seeds, through the SDK: one samples unstreamed, the
    other streams (and never asks for logprobs); one training step each gives byte-equal adapters."""

    async def main():
        backend = RemoteBackend(tiny_server.url, token=tiny_server.token, ca_cert=tiny_server.ca, heartbeat_every_s=0)
        models, clients = {}, {}
        one_at_a_time = asyncio.Lock()  # a request alone in its batch: the same shapes, the same float sums
        for name in ("plain", "streamed"):
            model = artcloud.TrainableModel(name=name, project="tests", base_model=TINY,
                                            config=artcloud.LoraConfig(rank=4))
            await model.register(backend)
            models[name], clients[name] = model, model.openai_client()

        async def rollout(model, prompt: str, seed: int) -> artcloud.Trajectory:
            client = clients[model.name]
            messages = [{"role": "user", "content": prompt}]
            kw = {"model": model.name, "messages": messages, "max_tokens": 6, "seed": seed}
            async with one_at_a_time:
                if model.name == "streamed":
                    completion = await artcloud.collect_stream(await client.chat.completions.create(stream=True, **kw))
                else:
                    completion = await client.chat.completions.create(**kw)
            choice = completion.choices[0]
            return artcloud.Trajectory(messages_and_choices=[*messages, choice],
                                       reward=len(choice.message.content or "") / 10 + seed / 100)

        groups = {}
        for name, model in models.items():
            groups[name] = await artcloud.gather_trajectory_groups(
                [artcloud.TrajectoryGroup(rollout(model, p, seed) for seed in (1, 2, 3)) for p in ("a", "b")],
                progress=False)
        for name, model in models.items():
            result = await model.train(groups[name], config=artcloud.TrainConfig(learning_rate=1e-2), progress=False)
            assert result.step == 1 and result.trained
        for client in clients.values():
            await client.close()
        await backend.close()
        return groups

    groups = asyncio.run(main())
    # The same turns were sampled either way...
    plain, streamed = ([[t.messages_and_choices[-1].model_dump() for t in g.trajectories] for g in groups[k]]
                       for k in ("plain", "streamed"))
    assert plain == streamed and plain[0][0]["token_ids"] and plain[0][0]["logprobs"]["content"]
    # ... and trained to the same adapter, one that moved away from where it started.
    root = tiny_server.path / "tests"
    adapters = {name: load_file(root / name / "checkpoints" / "1" / "adapter_model.safetensors") for name in ("plain", "streamed")}
    start = load_file(root / "plain" / "checkpoints" / "0" / "adapter_model.safetensors")
    assert adapters["plain"].keys() == adapters["streamed"].keys() == start.keys()
    assert all(adapters["plain"][k].equal(adapters["streamed"][k]) for k in start)
    assert not all(adapters["plain"][k].equal(start[k]) for k in start)

"""The server end to end over HTTPS on loopback, with artcloud/tiny-random."""

from __future__ import annotations

import asyncio
import json
import threading

import httpx
import openai
import pytest
from helpers import chat, events, group_from, rollout_groups, train

TINY = "artcloud/tiny-random"


def test_health_is_public_and_says_nothing_private(tiny_server):
    import artcloud

    with httpx.Client(verify=tiny_server.ssl_context()) as c:
        body = c.get(tiny_server.url + "/health").json()
        # Models, base models, steps, S3 locations and errors, the lease: all behind the token now.
        # And what it is doing: the phase, and seconds per start-up phase (no names, no paths).
        phases = body.pop("phases")
        assert set(phases) <= {"starting", "fetching_weights", "loading_engine", "first_rollout"} and "starting" in phases
        assert body.pop("phase_s") >= 0
        assert body == {"status": "ok", "version": artcloud.__version__, "ready": True, "phase": "ready"}
        assert c.get(tiny_server.url + "/artcloud/status").status_code == 401
    with tiny_server.client() as c:
        status = c.get("/artcloud/status").json()
    assert [m["name"] for m in status["models"]] == ["agent"]
    assert status["engines"][0]["base_model"] == "artcloud/tiny-random" and status["lease"]["in_flight"] == 0


@pytest.mark.parametrize("path", ["/v1/models", "/artcloud/models/agent", "/no/such/route"])
def test_every_other_route_needs_the_token(tiny_server, path):
    with httpx.Client(base_url=tiny_server.url, verify=tiny_server.ssl_context()) as c:
        missing = c.get(path)
        wrong = c.get(path, headers={"Authorization": "Bearer " + "x" * 43})
    assert missing.status_code == 401 and missing.json()["error"]["code"] == "missing_token"
    assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_token"
    assert missing.headers["www-authenticate"] == "Bearer"


def test_plain_http_gets_a_readable_400(tiny_server):
    plain = tiny_server.url.replace("https://", "http://")
    r = httpx.get(plain + "/v1/models", timeout=5)
    assert r.status_code == 400
    assert r.json()["error"]["code"] == "https_required"
    assert tiny_server.url in r.json()["error"]["message"]


def test_only_the_launch_ca_is_trusted(tiny_server):
    with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
        httpx.get(tiny_server.url + "/health")  # system CAs only: the launch CA is not among them


def test_register_is_idempotent_and_conflicts_name_the_field(tiny_server):
    with tiny_server.client() as c:
        again = c.post("/artcloud/models", json={"name": "agent", "project": "tests", "base_model": TINY})
        assert again.status_code == 200 and again.json()["resumed"] is True
        other = c.post("/artcloud/models", json={"name": "agent", "project": "tests", "base_model": TINY, "lora": {"rank": 4}})
        assert other.status_code == 409
        assert other.json()["error"]["field"] == "name"
        missing = c.post("/artcloud/models", json={"name": "x1", "project": "tests", "base_model": "/no/such/model"})
        assert missing.status_code == 400 and missing.json()["error"]["field"] == "base_model"
        bad = c.post("/artcloud/models", json={"name": "bad name!", "project": "tests", "base_model": TINY})
        assert bad.status_code == 400 and bad.json()["error"]["field"] == "name"


def test_openai_client_gets_logprobs_token_ids_and_step_names(tiny_server):
    async def main():
        http = openai.DefaultAsyncHttpxClient(verify=tiny_server.ssl_context())
        client = openai.AsyncOpenAI(base_url=tiny_server.url + "/v1", api_key=tiny_server.token, http_client=http)
        models = await client.models.list()
        assert "agent" in [m.id for m in models.data]
        resp = await client.chat.completions.create(
            model="agent", messages=[{"role": "user", "content": "Hello"}], n=3, max_tokens=6,
            logprobs=True, top_logprobs=2, temperature=1.0,
        )
        await client.close()
        return resp

    resp = asyncio.run(main())
    assert resp.model.startswith("agent@")
    assert len(resp.choices) == 3
    extra = resp.model_extra
    assert extra["prompt_token_ids"] and resp.usage.prompt_tokens == len(extra["prompt_token_ids"])
    for choice in resp.choices:
        ids = choice.model_extra["token_ids"]
        assert 1 <= len(ids) <= 6
        assert len(choice.logprobs.content) == len(ids)
        assert all(lp.logprob <= 0 for lp in choice.logprobs.content)
        assert all(len(lp.top_logprobs) == 2 for lp in choice.logprobs.content)
    assert resp.usage.completion_tokens == sum(len(c.model_extra["token_ids"]) for c in resp.choices)


def test_seed_makes_sampling_repeatable_and_greedy_is_deterministic(tiny_server):
    with tiny_server.client() as c:
        a = chat(c, "agent", "Repeat", seed=7, n=2, temperature=1.0)
        b = chat(c, "agent", "Repeat", seed=7, n=2, temperature=1.0)
        g1 = chat(c, "agent", "Repeat", temperature=0)
        g2 = chat(c, "agent", "Repeat", temperature=0)
    assert [x["token_ids"] for x in a["choices"]] == [x["token_ids"] for x in b["choices"]]
    assert g1["choices"][0]["token_ids"] == g2["choices"][0]["token_ids"]


def test_stop_strings_end_the_completion_and_are_cut(tiny_server):
    with tiny_server.client() as c:
        free = chat(c, "agent", "Go", temperature=0, max_tokens=12)
        text = free["choices"][0]["message"]["content"]
        assert len(text) > 2
        stop = text[1:3]
        cut = chat(c, "agent", "Go", temperature=0, max_tokens=12, stop=[stop])
    choice = cut["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert stop not in choice["message"]["content"]
    assert text.startswith(choice["message"]["content"])


def test_tools_are_rendered_through_the_template(tiny_server):
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
    with tiny_server.client() as c:
        with_tools = chat(c, "agent", "Weather in Berlin?", tools=tools, max_tokens=2)
        without = chat(c, "agent", "Weather in Berlin?", max_tokens=2)
    assert len(with_tools["prompt_token_ids"]) > len(without["prompt_token_ids"]) + 20


def test_concurrent_requests_are_batched(tiny_server):
    n = 16

    async def main():
        async with httpx.AsyncClient(base_url=tiny_server.url, verify=tiny_server.ssl_context(),
                                     headers={"Authorization": f"Bearer {tiny_server.token}"}, timeout=60) as c:
            before = (await c.get("/artcloud/status")).json()["engines"][0]["batches"]
            body = {"model": "agent", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 16}
            rs = await asyncio.gather(*[c.post("/v1/chat/completions", json=body) for _ in range(n)])
            after = (await c.get("/artcloud/status")).json()["engines"][0]["batches"]
            return rs, after - before

    responses, batches = asyncio.run(main())
    assert all(r.status_code == 200 for r in responses)
    assert batches < n / 2, f"{n} concurrent requests took {batches} engine calls"


def test_default_temperature_is_settable_and_explicit_wins(tiny_server):
    with tiny_server.client() as c:
        assert c.put("/artcloud/models/agent/temperature", json={"temperature": 0.0}).status_code == 200
        a = chat(c, "agent", "Same?", max_tokens=10)
        b = chat(c, "agent", "Same?", max_tokens=10)
        assert a["choices"][0]["token_ids"] == b["choices"][0]["token_ids"]  # greedy by default now
        hot = [chat(c, "agent", "Same?", max_tokens=10, temperature=1.5, seed=s)["choices"][0]["token_ids"] for s in range(3)]
        assert any(h != a["choices"][0]["token_ids"] for h in hot)  # an explicit temperature wins
        bad = c.put("/artcloud/models/agent/temperature", json={"temperature": -1})
        assert bad.status_code == 400 and bad.json()["error"]["field"] == "temperature"
        c.put("/artcloud/models/agent/temperature", json={"temperature": 1.0})


def test_train_job_advances_the_step_and_streams_events(tiny_server):
    with tiny_server.client() as c:
        step0 = c.get("/artcloud/models/agent").json()["step"]
        groups = rollout_groups(c, "agent", ["one", "two"], n=4)
        evs = train(c, "agent", groups, learning_rate=1e-3, gradient_steps=2)
        types = [e["type"] for e in evs]
        assert types == ["queued", "start", "step", "step", "end"]
        assert [e["seq"] for e in evs] == list(range(1, 6))
        for e in evs[2:4]:
            assert e["data"]["loss"] == e["data"]["loss"] and e["data"]["grad_norm"] >= 0
        end = evs[-1]["data"]
        assert end["step"] == step0 + 1 and end["served_as"] == f"agent@{step0 + 1}"
        assert chat(c, "agent")["model"] == f"agent@{step0 + 1}"
        assert chat(c, f"agent@{step0}")["model"] == f"agent@{step0}"  # older steps still served
        info = c.get("/artcloud/models/agent").json()
        assert info["step"] == step0 + 1 and step0 + 1 in info["checkpoints"]
        assert info["history"][-1]["reward_mean"] == pytest.approx(evs[1]["data"]["reward_mean"])
        # The cursor: a reader that saw 2 events gets exactly the rest.
        assert [e["seq"] for e in events(c, evs[0]["job_id"], after=2)] == [3, 4, 5]


def test_equal_reward_groups_are_reported_not_trained_and_the_step_advances_as_in_art(tiny_server):
    with tiny_server.client() as c:
        step0 = c.get("/artcloud/models/agent").json()["step"]
        resp = chat(c, "agent", "x", n=3)
        flat = group_from(resp, "x", [0.5, 0.5, 0.5])
        evs = train(c, "agent", [flat])
        assert evs[1]["data"]["groups_skipped_equal_rewards"] == 1
        assert evs[-1]["data"]["trained"] is False and "equal rewards" in evs[-1]["data"]["message"]
        assert [e["type"] for e in evs] == ["queued", "start", "end"]  # no gradient step
        # OpenPipe ART advances the step on the same adapter: a script resuming at get_step() counts batches by it
        info = c.get("/artcloud/models/agent").json()
        assert info["step"] == evs[-1]["data"]["step"] == step0 + 1 and step0 + 1 in info["checkpoints"]
        same = chat(c, f"agent@{step0 + 1}", "x", temperature=0.0)["choices"][0]["logprobs"]
        before = chat(c, f"agent@{step0}", "x", temperature=0.0)["choices"][0]["logprobs"]
        assert same == before  # the adapter is unchanged


def test_idempotency_key_returns_the_same_job(tiny_server):
    with tiny_server.client() as c:
        groups = rollout_groups(c, "agent", ["idem"], n=3)
        body = {"groups": groups, "idempotency_key": "k-123"}
        first = c.post("/artcloud/models/agent/train", json=body)
        second = c.post("/artcloud/models/agent/train", json=body)
        assert first.status_code == 202 and second.status_code == 200
        assert first.json()["job_id"] == second.json()["job_id"]
        evs = events(c, first.json()["job_id"])
        assert [e["type"] for e in evs].count("end") == 1
        reused = c.post("/artcloud/models/agent/train", json={**body, "config": {"learning_rate": 0.5}})
        assert reused.status_code == 409 and reused.json()["error"]["field"] == "idempotency_key"


def test_inference_waits_while_the_adapter_updates(tiny_server):
    """A request made while a job trains is answered by the new step, never by a half-updated adapter."""
    with tiny_server.client() as c:
        step0 = c.get("/artcloud/models/agent").json()["step"]
        groups = rollout_groups(c, "agent", [f"p{i}" for i in range(8)], n=4, max_tokens=24)
        job = c.post("/artcloud/models/agent/train", json={"groups": groups, "config": {"gradient_steps": 8}}).json()
        served = {}
        with c.stream("GET", f"/artcloud/jobs/{job['job_id']}/events") as r:
            for line in r.iter_lines():
                if not line.strip():
                    continue
                e = json.loads(line)
                if e["type"] == "step" and not served:
                    # Training holds the adapter now: this request must wait for the end of the job.
                    t = threading.Thread(target=lambda: served.update(chat(tiny_server.client(), "agent")))
                    t.start()
            t.join(60)
        assert served["model"] == f"agent@{step0 + 1}"


@pytest.mark.parametrize(
    "mutate, field",
    [
        (lambda g: g["trajectories"][0].update(reward=float("nan")), "groups[0].trajectories[0].reward"),
        (lambda g: g["trajectories"][1]["messages_and_choices"].pop(), "groups[0].trajectories[1].messages_and_choices"),
        (lambda g: g["trajectories"][0]["messages_and_choices"][1].update(logprobs=None), "groups[0].trajectories[0].messages_and_choices[1].logprobs"),
        (lambda g: g["trajectories"][0]["messages_and_choices"][1].pop("token_ids"), "groups[0].trajectories[0].messages_and_choices[1].token_ids"),
        (lambda g: g["trajectories"][0]["messages_and_choices"][1]["logprobs"]["content"].pop(), "groups[0].trajectories[0].messages_and_choices[1].logprobs.content"),
        (lambda g: g["trajectories"][0]["messages_and_choices"][1].update(token_ids=[10**9]), "groups[0].trajectories[0].messages_and_choices[1].token_ids"),
        (lambda g: g["trajectories"].clear(), "groups[0].trajectories"),
    ],
)
def test_malformed_trajectories_get_400_naming_the_field(tiny_server, mutate, field):
    with tiny_server.client() as c:
        step0 = c.get("/artcloud/models/agent").json()["step"]
        group = group_from(chat(c, "agent", "bad", n=2), "bad", [0.0, 1.0])
        mutate(group)
        r = c.post("/artcloud/models/agent/train", content=json.dumps({"groups": [group]}), headers={"content-type": "application/json"})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["field"] == field
        assert c.get("/artcloud/models/agent").json()["step"] == step0


def test_bad_requests_get_clear_errors(tiny_server):
    with tiny_server.client() as c:
        r = c.post("/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
        r = c.post("/v1/chat/completions", json={"model": "nobody", "messages": [{"role": "user", "content": "x"}]})
        assert r.status_code == 404 and r.json()["error"]["field"] == "model"
        r = c.post("/v1/chat/completions", json={"model": "agent@999", "messages": [{"role": "user", "content": "x"}]})
        assert r.status_code == 404 and r.json()["error"]["code"] == "step_not_found"
        r = c.post("/v1/chat/completions", json={"model": "agent", "messages": []})
        assert r.status_code == 400 and r.json()["error"]["field"] == "messages"
        r = c.post("/v1/chat/completions", json={"model": "agent", "messages": [{"role": "user", "content": "x"}], "n": 0})
        assert r.status_code == 400 and r.json()["error"]["field"] == "n"
        r = c.post("/v1/chat/completions", json={"model": "agent", "messages": [{"role": "user", "content": "x"}], "stream": "maybe"})
        assert r.status_code == 400 and r.json()["error"]["field"] == "stream"
        r = c.post("/artcloud/models/nobody/train", json={"groups": []})
        assert r.status_code in (400, 404)
        r = c.get("/artcloud/jobs/job-nope/events")  # not a job id at all: the pattern says so
        assert r.status_code == 400 and r.json()["error"]["field"] == "job_id"
        r = c.get("/artcloud/jobs/job-0123456789abcdef0123/events")
        assert r.status_code == 404 and r.json()["error"]["code"] == "job_not_found"


# Regressions found by tests/test_fuzz.py -----------------------------------------------------------


def test_a_top_p_that_float32_rounds_to_zero_keeps_the_most_likely_token(tiny_server):
    # 5e-324 is > 0 as JSON says, and 0 in float32: the top-p filter dropped every token, and sampling
    # from nothing was a 500.
    with tiny_server.client() as c:
        tiny = chat(c, "agent", "Go", temperature=1.0, top_p=5e-324, max_tokens=6)
        greedy = chat(c, "agent", "Go", temperature=0, max_tokens=6)
    assert tiny["choices"][0]["token_ids"] == greedy["choices"][0]["token_ids"]


def test_seeds_are_64_bit_and_a_larger_one_is_a_400_naming_the_field(tiny_server):
    # torch takes 64-bit seeds: a larger one raised inside the engine (a 500 for the whole batch).
    body = {"model": "agent", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
    with tiny_server.client() as c:
        assert c.post("/v1/chat/completions", json={**body, "seed": 2**63 - 1}).status_code == 200
        for seed in (2**64, -(2**63) - 1):
            r = c.post("/v1/chat/completions", json={**body, "seed": seed})
            assert r.status_code == 400 and r.json()["error"]["field"] == "seed", r.text
        r = c.post("/artcloud/models", json={"name": "seeded", "project": "tests", "base_model": "artcloud/tiny-random",
                                             "lora": {"init_seed": 2**64}})
        assert r.status_code == 400 and r.json()["error"]["field"] == "lora.init_seed", r.text
        schema = c.get("/openapi.json").json()["components"]["schemas"]
    assert schema["LoraConfig"]["properties"]["init_seed"]["exclusiveMaximum"] == 2**63
    assert schema["ChatCompletionRequest"]["properties"]["seed"]["anyOf"][0]["minimum"] == -(2**63)


def test_the_events_route_declares_its_errors_as_json(tiny_server):
    # Its 200 is NDJSON; FastAPI declared its 400, 401, 404 and 413 (JSON error bodies) as NDJSON too.
    with tiny_server.client() as c:
        responses = c.get("/openapi.json").json()["paths"]["/artcloud/jobs/{job_id}/events"]["get"]["responses"]
        r = c.get("/artcloud/jobs/job-0123456789abcdef0123/events")
    assert list(responses["200"]["content"]) == ["application/x-ndjson"]
    for status in ("400", "401", "404", "413"):
        assert list(responses[status]["content"]) == ["application/json"], status
    assert r.status_code == 404 and r.headers["content-type"] == "application/json"


def test_the_schema_states_the_bounds_the_server_checks(tiny_server):
    with tiny_server.client() as c:
        schema = c.get("/openapi.json").json()
        body = {"model": "agent", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
        r = c.post("/v1/chat/completions", json={**body, "stop": ["s"] * 9})
        assert r.status_code == 400 and r.json()["error"]["field"] == "stop", r.text
        r = c.post("/v1/chat/completions", json={**body, "model": "m" * 301})
        assert r.status_code == 400 and r.json()["error"]["field"] == "model", r.text

    # pydantic's own names (a choice's temperature had `ge` and `le`) are no JSON Schema: clients and
    # fuzzers read no bound from them.
    def keys(node):
        if isinstance(node, dict):
            yield from node
            for value in node.values():
                yield from keys(value)
        elif isinstance(node, list):
            for value in node:
                yield from keys(value)

    assert not {"ge", "le", "gt", "lt"} & set(keys(schema["components"]["schemas"]))
    temperature = schema["components"]["schemas"]["Choice"]["properties"]["temperature"]["anyOf"][0]
    assert (temperature["minimum"], temperature["maximum"]) == (0.0, 5.0)
    # What the stop validator checks, the schema says.
    text, strings, _ = schema["components"]["schemas"]["ChatCompletionRequest"]["properties"]["stop"]["anyOf"]
    assert text["minLength"] == 1 and strings["maxItems"] == 8 and strings["items"]["minLength"] == 1
    assert schema["components"]["schemas"]["ChatCompletionRequest"]["properties"]["model"]["maxLength"] == 300


@pytest.mark.parametrize("stream", [False, True])
def test_decoding_a_completions_logprobs_leaves_the_event_loop_free(tmp_path, monkeypatch, one_torch_thread, stream):
    """D7: every sampled token and alternative is decoded for its logprobs; that runs on a worker thread, so
    /health (and heartbeats) are answered meanwhile. In-process: the decode waits until /health has answered."""
    from artcloud.server import chat as server_chat
    from artcloud.server.app import create_app
    from artcloud.server.registry import Registry

    decoding, answered = threading.Event(), threading.Event()
    real = server_chat.logprobs_content

    def held(*args, **kwargs):
        decoding.set()
        assert answered.wait(30), "/health was not answered while the logprobs were decoded"
        return real(*args, **kwargs)

    async def main() -> tuple[int, int, str]:
        registry = Registry(tmp_path / "data", engine="cpu")
        await registry.restore()  # what the lifespan does first: ready
        transport = httpx.ASGITransport(app=create_app(registry, "t" * 32))
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=60,
                                     headers={"Authorization": "Bearer " + "t" * 32}) as c:
            r = await c.post("/artcloud/models", json={"name": "agent", "project": "p", "base_model": TINY})
            assert r.status_code == 200, r.text
            monkeypatch.setattr(server_chat, "logprobs_content", held)
            body = {"model": "agent", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                    "logprobs": True, "top_logprobs": 2, "stream": stream}
            request = asyncio.create_task(c.post("/v1/chat/completions", json=body))
            assert await asyncio.to_thread(decoding.wait, 60)
            health = await asyncio.wait_for(c.get("/health"), 10)
            answered.set()
            r = await request
            await registry.close()
            return health.status_code, r.status_code, r.text

    health, status, text = asyncio.run(main())
    assert health == 200 and status == 200, text
    assert '"top_logprobs"' in text and "internal_error" not in text

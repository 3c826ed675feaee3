"""OpenPipe ART's model and backend surface on artcloud: `config=` as the user's own object, models as pydantic
models generic in their config (`Model[MyConfig]`, `model_copy`, `model_dump`), a prompted model's history on the
server, the plain-client endpoint (`inference_base_url` / `inference_api_key`, a loopback forwarder) against the
real tiny-random server, `delete_checkpoints`, `backend.train`, ART's training options, LocalBackend(in_process=),
LiteLLM judge ids."""

from __future__ import annotations

import asyncio
import json
import socket
import ssl
import threading
import uuid
import warnings
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from pydantic import BaseModel, ValidationError
from test_ruler import FAST, answer, group  # the `judge` fixture (tests/conftest.py) serves their answers
from test_s3_server import s3_env

import artcloud
from artcloud.backends.forwarder import LoopbackForwarder
from artcloud.backends.remote import RemoteBackend
from artcloud.errors import ArtcloudError, InvalidArgument, NotSupported, WrongState, WrongType
from artcloud.model import apply_art_options

TINY = "artcloud/tiny-random"
MESSAGES = [{"role": "user", "content": "Tell me something."}]


class RunConfig(BaseModel):  # a user's own config object, as ART scripts pass it
    groups_per_step: int = 2
    difficulty: str = "easy"


def backend_for(server: Any) -> RemoteBackend:
    return RemoteBackend(server.url, token=server.token, ca_cert=server.ca, heartbeat_every_s=0)


async def trajectories(model: Any, client: Any, rewards: list[float]) -> artcloud.TrajectoryGroup:
    async def one(reward: float) -> artcloud.Trajectory:
        r = await client.chat.completions.create(model=model.name, messages=MESSAGES, max_tokens=4, logprobs=True)
        return artcloud.Trajectory(messages_and_choices=[*MESSAGES, r.choices[0]], reward=reward)

    return await artcloud.TrajectoryGroup(one(r) for r in rewards).resolve()


# ------------------------------------------------------------------------------------- without a server


def test_config_is_the_users_object_and_lora_has_its_own_keyword(tmp_path):
    own = RunConfig(groups_per_step=4)
    model = artcloud.TrainableModel(name="m", project="p", base_model=TINY, config=own)
    assert model.config is own and model.lora == artcloud.LoraConfig()
    model = artcloud.TrainableModel(name="m", project="p", base_model=TINY, config=own, lora=artcloud.LoraConfig(rank=4))
    assert model.config is own and model.lora.rank == 4

    with pytest.warns(DeprecationWarning, match=r"pass lora=LoraConfig"):
        old = artcloud.TrainableModel(name="m", project="p", base_model=TINY, config=artcloud.LoraConfig(rank=2))
    assert old.lora.rank == 2
    with pytest.raises(InvalidArgument, match="as lora= only"):
        artcloud.TrainableModel(name="m", project="p", base_model=TINY, config=artcloud.LoraConfig(), lora=artcloud.LoraConfig())
    with pytest.raises(WrongType, match="lora must be an artcloud.LoraConfig, not list"):
        artcloud.TrainableModel(name="m", project="p", base_model=TINY, lora=[("rank", 4)])
    assert artcloud.TrainableModel(name="m", project="p", base_model=TINY, lora={"rank": 4}).lora.rank == 4  # a dump's

    assert model.get_inference_name() == "m" and model.get_inference_name(3) == "m@3"
    assert model.inference_base_url is None and model.trainable and not artcloud.Model.trainable

    # ART's prompted model: an OpenAI-compatible endpoint elsewhere, as a baseline.
    baseline = artcloud.Model(name="gpt", project="p", inference_base_url="http://127.0.0.1:9/v1",
                              inference_api_key="sk-x", inference_model_name="openai/gpt-4.1")
    client = baseline.openai_client()
    assert str(client.base_url) == "http://127.0.0.1:9/v1/" and client.api_key == "sk-x"
    assert baseline.get_inference_name() == "openai/gpt-4.1"
    with pytest.raises(ArtcloudError, match="inference_base_url="):
        artcloud.Model(name="x", project="p").openai_client()


def test_models_are_pydantic_models_generic_in_their_config_as_in_art():
    def rollout(model: artcloud.Model[RunConfig]) -> int:  # ART's annotation
        return model.config.groups_per_step

    agent = artcloud.TrainableModel[RunConfig](name="agent-1", project="p", base_model=TINY, config={"groups_per_step": 4})
    assert isinstance(agent.config, RunConfig) and rollout(agent) == 4  # validated as the type it names
    assert isinstance(agent, artcloud.TrainableModel) and isinstance(agent, artcloud.Model) and agent.trainable
    with pytest.raises(ValidationError) as e:
        artcloud.Model[RunConfig](name="m", project="p", config={"groups_per_step": "many"})
    assert e.value.errors()[0]["loc"] == ("config", "groups_per_step")
    anything = object()  # unparametrized, config is any object of the user's, as before
    assert artcloud.Model(name="m", project="p", config=anything).config is anything

    # ART's way to make variants: a deep copy, then change the copy.
    variant = agent.model_copy(deep=True)
    variant.name, variant.config.difficulty = "agent-2", "hard"
    assert (agent.name, agent.config.difficulty, variant.config.groups_per_step) == ("agent-1", "easy", 4)
    assert variant.lora == agent.lora and variant.lora is not agent.lora and type(variant) is type(agent)
    renamed = agent.model_copy(update={"name": "agent-3"})
    assert (renamed.name, renamed.config) == ("agent-3", agent.config)

    dump = agent.model_dump()
    assert {k: dump[k] for k in ("name", "project", "base_model", "step")} == {
        "name": "agent-1", "project": "p", "base_model": TINY, "step": 0}
    assert dump["config"] == {"groups_per_step": 4, "difficulty": "easy"} and dump["lora"] == agent.lora.model_dump()
    assert artcloud.TrainableModel[RunConfig].model_validate(dump).model_dump() == dump  # and back
    # ART's _internal_config (art.dev.InternalModelConfig): onto engine_args, the LoRA and the step defaults
    internal = artcloud.TrainableModel(name="m", project="p", base_model=TINY, _internal_config=artcloud.dev.InternalModelConfig(
        engine_args={"max_model_len": 8}, init_args={"max_seq_length": 64, "fast_inference": True},
        peft_args={"r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]}, trainer_args={"max_grad_norm": 0.1}))
    assert internal.engine_args == {"max_model_len": 8, "max_seq_length": 64}
    assert (internal.lora.rank, internal.lora.alpha, internal.lora.target_modules) == (4, 8.0, ["q_proj"])
    assert internal._defaults(None).max_grad_norm == 0.1
    assert internal._defaults(artcloud.TrainConfig(max_grad_norm=0.5)).max_grad_norm == 0.5  # a step's own wins
    for bad, words in [({"trainer_gpu_ids": [0]}, "places the trainer and vLLM itself"),
                       ({"init_args": {"load_in_8bit": True}}, "16 bits, or 4 with load_in_4bit"),
                       ({"peft_args": {"use_rslora": True}}, "set alpha= for the scale"),
                       ({"tinker_args": {"renderer_name": "x"}}, "not through Tinker")]:
        with pytest.raises(NotSupported, match=words) as e:
            artcloud.TrainableModel(name="m", project="p", base_model=TINY, _internal_config=bad)
        assert "\n" not in str(e.value)
    with pytest.raises(InvalidArgument, match="engine_args max_model_len both"):
        artcloud.TrainableModel(name="m", project="p", base_model=TINY, engine_args={"max_model_len": 9},
                                _internal_config={"engine_args": {"max_model_len": 8}})


def test_art_training_options_are_honoured_or_refused_in_one_line():
    kl = "beta" if "beta" in artcloud.TrainConfig.model_fields else "kl_coef"
    config, save = apply_art_options(artcloud.TrainConfig(), {"learning_rate": 1e-4, "beta": 0.05, "epsilon": 0.1,
                                                              "epsilon_high": 0.3, "scale_rewards": False, "ppo": True,
                                                              "plot_tensors": False, "save_checkpoint": False,
                                                              "logprob_calculation_chunk_size": 512}, where="_config")
    assert (config.learning_rate, getattr(config, kl), config.clip_epsilon, config.clip_epsilon_high, config.scale_rewards,
            config.loss, save) == (1e-4, 0.05, 0.1, 0.3, False, "ppo", False)
    assert apply_art_options(artcloud.TrainConfig(), {"kl_penalty_coef": 0.2}, where="_config")[0].kl_penalty_coef == 0.2

    model = artcloud.TrainableModel(name="m", project="p", base_model=TINY)
    for options, error, words in [({"plot_tensors": True}, NotSupported, "plot_tensors=True.* is OpenPipe ART's"),
                                  ({"save_checkpoint": "no"}, WrongType, "save_checkpoint must be True or False"),
                                  ({"frobnicate": 1}, InvalidArgument, "_config: TrainConfig has no field 'frobnicate'")]:
        with pytest.raises(error, match=words) as e:
            asyncio.run(model.train([], _config=options))  # refused before anything is sent
        assert "\n" not in str(e.value)


def test_local_backend_takes_arts_arguments(tmp_path):
    with pytest.warns(UserWarning, match="always runs the server as a child process"):
        backend = artcloud.LocalBackend(in_process=True, path=str(tmp_path / "art"))
    assert backend.path == tmp_path / "art"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with artcloud.LocalBackend(in_process=False, path=tmp_path / "art") as same:  # ART's sync `with`
            assert same.path == tmp_path / "art" and not same.running


# ------------------------------------------------------------------------------------- a prompted model's history


def test_a_prompted_model_logs_to_a_history_of_its_own_on_the_server(tiny_server):
    """ART's `art.Model` at an endpoint elsewhere (a baseline): register gives it a history on the server, as
    ART's backend keeps one, and `log` records its metrics there. Its key and the backend stay out of dumps."""
    secret = "sk-prompted-" + uuid.uuid4().hex

    async def main() -> None:
        backend = backend_for(tiny_server)
        baseline = artcloud.Model[RunConfig](name="gpt-baseline", project="art", config=RunConfig(),
                                             inference_base_url="http://127.0.0.1:9/v1", inference_api_key=secret,
                                             inference_model_name="openai/gpt-4.1")
        await baseline.register(backend)
        assert baseline.backend is backend and baseline.step == 0
        assert (baseline.inference_base_url, baseline.inference_api_key) == ("http://127.0.0.1:9/v1", secret)
        turns = [*MESSAGES, {"role": "assistant", "content": "Water is wet."}]
        trajectories = [artcloud.Trajectory(messages_and_choices=turns, reward=r) for r in (0.2, 0.6)]
        val = await baseline.log(trajectories, split="val")  # ART's call
        later = await baseline.log(trajectories[:1], split="val", step=3)  # at a trained model's step, to compare
        assert (val["step"], val["split"], val["reward_mean"], later["step"]) == (0, "val", pytest.approx(0.4), 3)
        info = await backend.model_info("gpt-baseline")
        assert info.prompted and info.base_model is None and info.history == [val, later]
        on_disk = (tiny_server.path / "art" / "gpt-baseline" / "history.jsonl").read_text().splitlines()
        assert [json.loads(line) for line in on_disk] == [val, later]

        # Neither its key nor the server's token is in its repr or its dump.
        for text in (repr(baseline), str(baseline), baseline.model_dump_json(), str(baseline.model_dump())):
            assert secret not in text and tiny_server.token not in text
        # A copy is unbound; registered again (a new object, as after a restart), it finds the same history.
        again = baseline.model_copy(deep=True)
        for copy in (again, baseline.model_copy()):
            with pytest.raises(WrongState, match="not registered"):
                copy.backend
        assert baseline.backend is backend and again.inference_api_key == secret  # its endpoint is copied
        await again.register(backend)
        assert (await again.log(metrics={"accuracy": 0.5}))["step"] == 0
        assert len((await backend.model_info("gpt-baseline")).history) == 3

        # It is served elsewhere: nothing here samples or trains it, and the answers say why.
        with pytest.raises(ArtcloudError) as e:
            await artcloud.TrainableModel(name="gpt-baseline", project="art", base_model=TINY).register(backend)
        assert (e.value.status, e.value.code) == (409, "model_conflict")
        with pytest.raises(ArtcloudError) as e:
            await artcloud.Model(name="with-args", project="art", engine_args={"max_model_len": 64}).register(backend)
        assert (e.value.status, e.value.field) == (400, "engine_args")
        await backend.close()

    asyncio.run(main())
    with tiny_server.client() as c:
        r = c.post("/v1/chat/completions", json={"model": "gpt-baseline", "messages": MESSAGES})
        assert r.status_code == 404 and "prompted model" in r.json()["error"]["message"], r.text
        r = c.put("/artcloud/models/gpt-baseline/temperature", json={"temperature": 0.5})
        assert r.status_code == 400 and r.json()["error"]["code"] == "prompted_model", r.text
        r = c.post("/artcloud/models", json={"name": "p2", "project": "art", "base_model": None, "lora": {"rank": 4}})
        assert r.status_code == 400 and r.json()["error"]["field"] == "lora", r.text


def test_prompted_models_count_apart_from_the_served_ones(tmp_path):
    """--max-models bounds each kind: baselines (a history each) never take a LoRA's place."""
    from fastapi.testclient import TestClient

    from artcloud.server.app import create_app
    from artcloud.server.limits import Limits
    from artcloud.server.registry import Registry

    token = "t" * 32
    registry = Registry(tmp_path / "d", engine="cpu", limits=Limits(max_models=1))
    with TestClient(create_app(registry, token), headers={"Authorization": f"Bearer {token}"}) as c:
        def register(name, base_model):
            return c.post("/artcloud/models", json={"name": name, "project": "p", "base_model": base_model})

        assert register("baseline", None).status_code == 200
        assert register("agent", TINY).status_code == 200, "a prompted model took the only LoRA's place"
        for name, base_model, kind in (("baseline-2", None, "prompted models"), ("agent-2", TINY, "models")):
            r = register(name, base_model)
            assert r.status_code == 409 and f"already holds 1 {kind}, its limit" in r.json()["error"]["message"], r.text


def test_a_prompted_models_history_reaches_s3_and_a_fresh_server(seaweed, start_server, tmp_path):
    bucket = f"prompted-{uuid.uuid4().hex[:10]}"
    seaweed.client().create_bucket(Bucket=bucket)
    uri, env = f"s3://{bucket}/team", s3_env(seaweed)

    def on_s3() -> list[dict]:
        live = seaweed.client().get_object(Bucket=bucket, Key="team/art/baseline/history.jsonl")["Body"].read()
        return [json.loads(line) for line in live.decode().splitlines()]

    async def on(server, *rewards: float, shut_down: bool = False) -> Any:
        backend = backend_for(server)
        baseline = artcloud.Model(name="baseline", project="art", inference_base_url="http://127.0.0.1:9/v1")
        await baseline.register(backend)
        for r in rewards:
            await baseline.log(metrics={"reward_mean": r})
        info = await backend.model_info("baseline")
        if shut_down:  # as backend.down() does before the machine goes: S3 has the history once it answers
            await backend.shutdown()
            assert on_s3() == info.history
        await backend.close()
        return info

    a = start_server(tmp_path / "a", "--s3", uri, env=env)
    before = asyncio.run(on(a, 0.1, 0.2, shut_down=True)).history
    a.stop()
    assert on_s3() == before and len(before) == 2
    b = start_server(tmp_path / "b", "--s3", uri, env=env)  # a fresh machine: its history comes from S3
    after = asyncio.run(on(b, 0.3)).history
    assert after[:2] == before and after[2]["reward_mean"] == 0.3


# ------------------------------------------------------------------------------------- the plain-client endpoint


def test_plain_openai_clients_reach_the_model_through_the_loopback_endpoint(tiny_server):
    async def main() -> None:
        backend = backend_for(tiny_server)
        model = artcloud.TrainableModel(name="plain", project="art", base_model=TINY, config=RunConfig())
        await model.register(backend)
        assert backend._forwarder is None  # started when first asked for: most scripts never do
        url, key = model.inference_base_url, model.inference_api_key
        assert backend._forwarder.running and (url, key) == backend.inference_endpoint()  # one per backend
        assert url.startswith("http://127.0.0.1:") and url.endswith("/v1") and model.inference_model_name == "plain"
        assert key != tiny_server.token and tiny_server.token not in url

        # ART's rollout: its own AsyncOpenAI, no TLS settings. The same seed answers as the direct client does.
        plain = openai.AsyncOpenAI(base_url=url, api_key=key)
        ask = dict(model=model.get_inference_name(), messages=MESSAGES, max_tokens=300, seed=7, logprobs=True)
        via = await plain.chat.completions.create(**ask)
        direct = await model.openai_client().chat.completions.create(**ask)
        assert via.choices[0].message.content == direct.choices[0].message.content
        assert via.usage.completion_tokens == direct.usage.completion_tokens > 50  # a long answer, whole
        assert via.choices[0].logprobs.content and via.model == "plain@0"

        # The sync client, called from the thread that runs this event loop: the endpoint has its own thread.
        sync = openai.OpenAI(base_url=url, api_key=key).chat.completions.create(**{**ask, "max_tokens": 4})
        assert sync.choices[0].message.content == (await plain.chat.completions.create(**{**ask, "max_tokens": 4})).choices[0].message.content

        # A wrong key: 401 in the server's error shape, nothing forwarded. An error of the server passes unchanged.
        async with httpx.AsyncClient(base_url=url) as h:
            wrong = await h.get("/models", headers={"Authorization": "Bearer " + tiny_server.token})
            assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "unauthorized"
            assert "inference_api_key" in wrong.json()["error"]["message"]
            missing = await h.post("/chat/completions", headers={"Authorization": f"Bearer {key}"},
                                   json={"model": "nobody", "messages": MESSAGES})
            with httpx.Client(verify=tiny_server.ssl_context(), base_url=tiny_server.url) as d:
                same = d.post("/v1/chat/completions", headers={"Authorization": f"Bearer {tiny_server.token}"},
                              json={"model": "nobody", "messages": MESSAGES})
            assert (missing.status_code, missing.json()) == (same.status_code, same.json()) and missing.status_code == 404

        # backend.train beside it; then a streamed answer of the new step through the endpoint (SSE, chunked),
        # while the job's own route stays the backend's: the endpoint's key buys rollouts only.
        groups = [await trajectories(model, plain, [0.0, 1.0, 0.5])]
        result = await backend.train(model, groups, learning_rate=1e-3, progress=False)
        async with httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {key}"}) as h:
            async with h.stream("POST", "/chat/completions", json={**ask, "max_tokens": 8, "stream": True}) as r:
                assert r.headers.get("transfer-encoding") == "chunked" and "content-length" not in r.headers
                lines = [line async for line in r.aiter_lines() if line.startswith("data: ")]
            job = (await backend.model_info(model.name)).history[-1]["job_id"]
            assert (await h.get(url.removesuffix("/v1") + f"/artcloud/jobs/{job}/events")).status_code == 404
        assert result.step == 1 and lines[-1] == "data: [DONE]" and json.loads(lines[0][6:])["model"] == "plain@1"

        port = int(url.rsplit(":", 1)[1].split("/")[0])
        await backend.down()
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", port), timeout=2).close()

    asyncio.run(main())


def test_the_endpoint_passes_a_stream_through_as_it_comes():
    """Chunk one reaches the client while the upstream still holds chunk two back: nothing is buffered."""
    release = threading.Event()

    class Streaming(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *a: Any) -> None:
            pass

        def do_POST(self) -> None:
            self.rfile.read(int(self.headers["Content-Length"]))
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            for data, wait in ((b'data: {"n": 1}\n\n', True), (b"data: [DONE]\n\n", False)):
                self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
                self.wfile.flush()
                if wait:
                    release.wait(30)
            self.wfile.write(b"0\r\n\r\n")

    upstream = ThreadingHTTPServer(("127.0.0.1", 0), Streaming)
    threading.Thread(target=upstream.serve_forever, args=(0.05,), daemon=True).start()
    forwarder = LoopbackForwarder(lambda: (f"http://127.0.0.1:{upstream.server_address[1]}", ssl.create_default_context(), "t"))
    try:
        url = forwarder.start()
        with httpx.Client(timeout=10) as c, c.stream("POST", url + "/chat/completions", json={"stream": True},
                                                     headers={"Authorization": f"Bearer {forwarder.key}"}) as r:
            chunks = r.iter_bytes()
            first = next(chunks)
            assert first == b'data: {"n": 1}\n\n' and not release.is_set()
            release.set()
            assert b"".join(chunks) == b"data: [DONE]\n\n"
            assert r.headers["content-type"] == "text/event-stream"
    finally:
        release.set()
        forwarder.close()
        upstream.shutdown()
        upstream.server_close()


def test_the_endpoint_refuses_a_body_over_its_limit_and_follows_the_backends_server():
    seen: list[str] = []

    class Echo(BaseHTTPRequestHandler):
        def log_message(self, *a: Any) -> None:
            pass

        def do_POST(self) -> None:
            self.rfile.read(int(self.headers["Content-Length"]))
            seen.append(f"{self.server.server_address[1]} {self.headers['Authorization']}")
            body = b'{"ok": true}'
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    servers = [ThreadingHTTPServer(("127.0.0.1", 0), Echo) for _ in range(2)]
    for s in servers:
        threading.Thread(target=s.serve_forever, args=(0.05,), daemon=True).start()
    target = {"url": f"http://127.0.0.1:{servers[0].server_address[1]}", "token": "first"}
    context = ssl.create_default_context()
    forwarder = LoopbackForwarder(lambda: (target["url"], context, target["token"]), max_body_bytes=1000)
    try:
        url = forwarder.start()
        auth = {"Authorization": f"Bearer {forwarder.key}"}
        with httpx.Client(timeout=10) as c:
            r = c.post(url + "/chat/completions", content=b"y" * 1001, headers=auth)
            # the rest of that body is not read, so the connection ends: the answer says so, or the client would
            # send its next request down it and see a disconnect (a clean make test did)
            assert r.status_code == 413 and r.headers["connection"] == "close"
            assert c.post(url + "/chat/completions", content=b"y" * 1000, headers=auth).json() == {"ok": True}
            target.update(url=f"http://127.0.0.1:{servers[1].server_address[1]}", token="second")  # a replaced server
            assert c.post(url + "/chat/completions", content=b"{}", headers=auth).json() == {"ok": True}
        assert seen == [f"{servers[0].server_address[1]} Bearer first", f"{servers[1].server_address[1]} Bearer second"]
    finally:
        forwarder.close()
        for s in servers:
            s.shutdown()
            s.server_close()


def test_the_endpoint_forwards_only_openais_routes_and_only_to_the_servers_host():
    """Its key is for rollouts: shutdown, status or any other route of the server is refused here, and a request
    target without a leading slash (h11 takes it) cannot move the request, and the token, to another host."""
    seen: list[str] = []

    class Recorder(BaseHTTPRequestHandler):
        def log_message(self, *a: Any) -> None:
            pass

        def _ok(self) -> None:
            if self.command == "POST":
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
            seen.append(f"{self.command} {self.path}")
            self.send_response(200)
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"{}")

        do_GET = do_POST = _ok

    upstream = ThreadingHTTPServer(("127.0.0.1", 0), Recorder)
    threading.Thread(target=upstream.serve_forever, args=(0.05,), daemon=True).start()
    forwarder = LoopbackForwarder(lambda: (f"http://127.0.0.1:{upstream.server_address[1]}", ssl.create_default_context(), "t"))
    try:
        url = forwarder.start()
        root = url.removesuffix("/v1")
        auth = {"Authorization": f"Bearer {forwarder.key}"}
        with httpx.Client(timeout=10, headers=auth) as c:
            for method, path in (("POST", "/artcloud/shutdown"), ("GET", "/artcloud/status"), ("GET", "/openapi.json"),
                                 ("POST", "/v1/models"), ("GET", "/v1/chat/completions"), ("POST", "/artcloud/models/a/train")):
                r = c.request(method, root + path, json={} if method == "POST" else None)
                assert r.status_code == 404 and r.json()["error"]["code"] == "not_found", (method, path, r.text)
                assert "forwards only GET /v1/models[/ID] and POST /v1/chat/completions" in r.json()["error"]["message"]
            assert c.get(url + "/models").status_code == 200 and c.get(url + "/models/agent@2?x=1").status_code == 200
            assert c.post(url + "/chat/completions", json={}).status_code == 200
        port = int(root.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port), timeout=10) as raw:  # what httpx would never send
            raw.sendall(f"GET .attacker.example/v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {forwarder.key}\r\n"
                        "Connection: close\r\n\r\n".encode())
            answer = b"".join(iter(lambda: raw.recv(65536), b""))
        assert answer.startswith(b"HTTP/1.1 404"), answer[:200]
        assert seen == ["GET /v1/models", "GET /v1/models/agent@2?x=1", "POST /v1/chat/completions"]
    finally:
        forwarder.close()
        upstream.shutdown()
        upstream.server_close()


# ------------------------------------------------------------------------------------- training and checkpoints


def test_backend_train_and_delete_checkpoints(tiny_server):
    async def main() -> None:
        backend = backend_for(tiny_server)
        model = artcloud.TrainableModel(name="prune", project="art", base_model=TINY)
        with pytest.raises(InvalidArgument, match="not registered on this backend"):
            await backend.train(model, [])
        await model.register(backend)
        assert model.backend() is backend  # ART calls it as a method
        client = model.openai_client()
        # reward_mean per step: 0.95, 0.15, 0.25 -> step 1 is the best, step 3 the latest.
        for rewards in ([1.0, 0.9], [0.1, 0.2], [0.3, 0.2]):
            step, metrics, path = await backend.train(model, [await trajectories(model, client, rewards)],
                                                      learning_rate=1e-3, beta=0.0, progress=False)
            assert path is not None and Path(path).name == str(step) and (Path(path) / "manifest.json").exists()
            assert metrics["reward_mean"] == pytest.approx(sum(rewards) / 2)
        # ART's save_checkpoint=False: the result names no checkpoint (the step commits all the same, as in ART)
        result = await backend.train(model, [await trajectories(model, client, [0.0, 1.0])], save_checkpoint=False,
                                     learning_rate=1e-3, progress=False)
        assert (result.step, result.checkpoint_path) == (4, None)
        assert step == 3 and model.step == 4
        assert (await backend.model_info("prune")).checkpoints == [0, 1, 2, 3, 4]

        answer_ = await model.delete_checkpoints(best_checkpoint_metric="reward_mean")
        assert (answer_["best_step"], answer_["kept"], answer_["deleted"]) == (1, [1, 4], [0, 2, 3])
        assert (await backend.model_info("prune")).checkpoints == [1, 4]
        served = await client.chat.completions.create(model="prune@1", messages=MESSAGES, max_tokens=2)
        assert served.model == "prune@1"  # the best step, kept, still serves
        # ART's default metric, which nothing logged here: as ART, the latest step alone stays, with a warning
        answer_ = await model.delete_checkpoints()
        assert (answer_["best_step"], answer_["kept"], answer_["deleted"]) == (None, [4], [1])
        assert answer_["note"].startswith("no step of prune has 'val/reward' in its history (its metrics: ")
        assert "reward_mean" in answer_["note"]
        served = await client.chat.completions.create(model="prune@4", messages=MESSAGES, max_tokens=2)
        assert served.model == "prune@4"
        await backend.down()

    asyncio.run(main())


# ------------------------------------------------------------------------------------- RULER's judge ids




def test_litellm_judge_ids_reach_the_right_endpoint_with_the_bare_model_id(judge, monkeypatch):
    from artcloud import rewards

    two = answer([("1", 0.2), ("2", 0.8)])
    fast = {k: v for k, v in FAST.items() if k != "api_key"}

    j = judge(two)
    monkeypatch.setenv("OPENAI_BASE_URL", j.base_url)
    monkeypatch.setenv("OPENAI_API_KEY", "sk-openai")
    out = asyncio.run(rewards.ruler_score_group(group("a", "b"), "openai/o4-mini", **fast))
    assert [t.reward for t in out.trajectories] == [0.2, 0.8]
    assert (j.requests[0]["body"]["model"], j.requests[0]["auth"]) == ("o4-mini", "Bearer sk-openai")

    j = judge(two)
    monkeypatch.setitem(rewards.JUDGE_PROVIDERS, "openrouter", (j.base_url, "OPENROUTER_API_KEY"))
    monkeypatch.setenv("OPENROUTER_API_KEY", "sk-or")
    asyncio.run(rewards.ruler_score_group(group("a", "b"), "openrouter/qwen/qwen3-32b", **fast))
    assert (j.requests[0]["body"]["model"], j.requests[0]["auth"]) == ("qwen/qwen3-32b", "Bearer sk-or")
    monkeypatch.delenv("OPENROUTER_API_KEY")
    with pytest.raises(InvalidArgument, match="needs OPENROUTER_API_KEY set"):
        asyncio.run(rewards.ruler_score_group(group("a", "b"), "openrouter/qwen/qwen3-32b", swallow_exceptions=True, **fast))

    # ART's extra_litellm_params, passed positionally as ART's signature allows.
    j = judge(two)
    params = {"api_base": j.base_url, "api_key": "k2", "temperature": 0.3, "reasoning_effort": "low"}
    asyncio.run(rewards.ruler_score_group(group("a", "b"), "hosted_vllm/my-judge", params, **fast))
    body = j.requests[0]["body"]
    assert (body["model"], body["temperature"], body["reasoning_effort"], j.requests[0]["auth"]) == ("my-judge", 0.3, "low", "Bearer k2")

    j = judge(two)  # a bare id with a slash (a Hugging Face name) is not a provider: sent as it is
    asyncio.run(rewards.ruler([t.messages_and_choices for t in group("a", "b").trajectories], "Qwen/Qwen3-8B",
                              base_url=j.base_url, api_key="k", retry_wait_s=0.01))
    assert j.requests[0]["body"]["model"] == "Qwen/Qwen3-8B"

    with pytest.raises(InvalidArgument, match="'azure/gpt' is a LiteLLM id for azure.*pass base_url=") as e:
        asyncio.run(rewards.ruler_score_group(group("a", "b"), "azure/gpt", swallow_exceptions=True))
    assert "\n" not in str(e.value)

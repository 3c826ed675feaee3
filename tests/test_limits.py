"""The server's limits (artcloud serve --max-*): each refusal is a 4xx that names the flag, and nothing
grows without bound. A real server process over HTTPS, tiny-random."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import ssl
import threading
from pathlib import Path

import httpx
import pytest
from conftest import TINY, serving_agent
from helpers import chat, events, rollout_groups, wait_for

from artcloud import wire
from artcloud.server import train_body
from artcloud.server.api_errors import ApiError

# --max-train-bodies 8: the eight posts that fill the job queue at once are all read.
LIMITED = ("--max-body-mb", "0.2", "--max-request-tokens", "64", "--max-queued-jobs", "1", "--max-kept-jobs", "2",
           "--max-models", "2", "--max-train-bodies", "8")


@pytest.fixture(scope="module")
def limited(tmp_path_factory):
    with serving_agent(tmp_path_factory.mktemp("limits") / "data", *LIMITED, project="limits") as server:
        yield server


def _error(r: httpx.Response, status: int, code: str) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["code"] == code, err
    return err


def test_status_reports_the_limits(limited):
    with limited.client() as c:
        limits = c.get("/artcloud/status").json()["limits"]
    assert limits["max_body_mb"] == 0.2 and limits["max_request_tokens"] == 64 and limits["max_queued_jobs"] == 1


def test_a_body_over_the_limit_is_refused_whether_its_length_is_declared_or_not(limited):
    big = {"model": "agent", "messages": [{"role": "user", "content": "x" * 300_000}], "max_tokens": 2}
    with limited.client() as c:
        err = _error(c.post("/v1/chat/completions", json=big), 413, "body_too_large")
        assert "--max-body-mb" in err["message"] and err["field"] == "body"

        def chunks():  # no Content-Length: the server must count what it reads, and stop
            yield b'{"model": "agent", "messages": [{"role": "user", "content": "'
            for _ in range(300):
                yield b"y" * 1000
            yield b'"}]}'

        r = c.post("/v1/chat/completions", content=chunks(), headers={"Content-Type": "application/json"})
        err = _error(r, 413, "body_too_large")
        assert "--max-body-mb" in err["message"]
        # Under the limit, the same route answers.
        assert chat(c, "agent", "hi", max_tokens=2)["choices"]


def test_a_body_is_never_read_before_the_token_is_checked(limited):
    big = {"model": "agent", "messages": [{"role": "user", "content": "x" * 300_000}]}
    with httpx.Client(base_url=limited.url, verify=limited.ssl_context()) as c:
        _error(c.post("/v1/chat/completions", json=big), 401, "missing_token")


def test_n_times_max_tokens_is_bounded(limited):
    with limited.client() as c:
        body = {"model": "agent", "messages": [{"role": "user", "content": "hi"}], "n": 8, "max_tokens": 16}
        err = _error(c.post("/v1/chat/completions", json=body), 400, "too_many_tokens")
        assert err["field"] == "max_tokens" and "--max-request-tokens" in err["message"] and "128" in err["message"]
        # n alone with the default max_tokens (256) is over it too
        err = _error(c.post("/v1/chat/completions", json={**body, "n": 1, "max_tokens": None}), 400, "too_many_tokens")
        assert chat(c, "agent", "hi", n=4, max_tokens=16)["choices"]


def test_training_jobs_beyond_the_queue_limit_get_429(limited):
    with limited.client() as c:
        groups = rollout_groups(c, "agent", [f"prompt {i}" for i in range(8)], n=4, max_tokens=16)

    async def post_many(k: int) -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=limited.url, verify=limited.ssl_context(), timeout=120,
                                     headers={"Authorization": f"Bearer {limited.token}"}) as c:
            body = {"groups": groups, "config": {"gradient_steps": 8}}
            return await asyncio.gather(*(c.post("/artcloud/models/agent/train", json=body) for _ in range(k)))

    responses = asyncio.run(post_many(8))
    codes = sorted(r.status_code for r in responses)
    # One job runs, one waits (--max-queued-jobs 1): at most two of eight that arrive together get in.
    assert 1 <= codes.count(202) <= 2 and codes.count(429) >= 6, codes
    err = next(r for r in responses if r.status_code == 429).json()["error"]
    assert err["code"] == "too_many_jobs" and "--max-queued-jobs" in err["message"]
    with limited.client() as c:  # the accepted ones all finish
        for r in responses:
            if r.status_code == 202:
                from helpers import events

                assert events(c, r.json()["job_id"])[-1]["type"] == "end"


def test_finished_jobs_beyond_the_kept_limit_are_forgotten_with_their_files(limited):
    jobs_dir = Path(limited.path) / "limits" / "agent" / "jobs"
    with limited.client() as c:
        ids = []
        for i in range(4):
            groups = rollout_groups(c, "agent", [f"q{i}"], n=4)
            r = c.post("/artcloud/models/agent/train", json={"groups": groups})
            assert r.status_code == 202, r.text
            ids.append(r.json()["job_id"])
            from helpers import events

            assert events(c, ids[-1])[-1]["type"] == "end"
        assert c.get(f"/artcloud/jobs/{ids[0]}").status_code == 404
        assert c.get(f"/artcloud/jobs/{ids[-1]}").json()["status"] == "succeeded"
    kept = sorted(p.name.split(".")[0] for p in jobs_dir.glob("job-*.json"))
    assert len(kept) <= 2 + 1 and ids[-1] in kept and ids[0] not in kept  # + the job being created
    assert not (jobs_dir / f"{ids[0]}.events.jsonl").exists()


def test_models_and_base_models_are_bounded(limited):
    with limited.client() as c:
        r = c.post("/artcloud/models", json={"name": "second", "project": "limits", "base_model": TINY})
        assert r.status_code == 200, r.text
        err = _error(c.post("/artcloud/models", json={"name": "third", "project": "limits", "base_model": TINY}),
                     409, "too_many_models")
        assert "--max-models" in err["message"] and err["field"] == "name"


def test_a_second_base_model_is_refused_and_failed_loads_leak_no_thread(start_server, tmp_path):
    s = start_server(None)
    with s.client() as c:
        assert c.post("/artcloud/models", json={"name": "a", "project": "p", "base_model": TINY}).status_code == 200
        err = _error(c.post("/artcloud/models", json={"name": "b", "project": "p", "base_model": "org/other-model"}),
                     409, "too_many_base_models")
        assert err["field"] == "base_model" and "--max-base-models" in err["message"]

    s2 = start_server(tmp_path / "two", "--max-base-models", "2")
    with s2.client() as c:
        assert c.post("/artcloud/models", json={"name": "a", "project": "p", "base_model": TINY}).status_code == 200
        threads = _threads(s2.proc.pid)
        for i in range(5):
            # A hub id that cannot be fetched here (offline), and one too long for the file system's names
            for base in (f"nobody-{i}/no-such-model", f"{'a' * 95}/{'b' * 95}"):
                err = _error(c.post("/artcloud/models", json={"name": f"x{i}", "project": "p", "base_model": base}),
                             400, "base_model_not_found")
                assert err["field"] == "base_model"
        assert _threads(s2.proc.pid) <= threads + 3, "each failed load left its engine thread behind"
        # and the failures did not count against --max-base-models
        assert c.post("/artcloud/models", json={"name": "b", "project": "p", "base_model": TINY}).status_code == 200


def test_a_base_model_name_that_breaks_the_file_system_is_a_400(tiny_server):
    with tiny_server.client() as c:
        for base in ("a" * 500, "/" + "d" * 300, "org/" + "n" * 120, "../../etc", "org/name/extra", "with space"):
            r = c.post("/artcloud/models", json={"name": "x", "project": "p", "base_model": base})
            err = _error(r, 400, "invalid_request")
            assert err["field"] == "base_model", (base, err)


def _threads(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Threads:"):
            return int(line.split()[1])
    raise AssertionError("no Threads line")


@pytest.mark.parametrize("failure", [OSError(36, "File name too long"), ValueError("broken config.json")])
def test_a_failed_load_ends_its_engine_thread_at_once(failure):
    """In-process, with the cyclic garbage collector off: the failed load's exception (kept here, as a
    log handler or an error page may keep it) holds the host, so only an explicit shutdown ends its
    thread. Without it, each failed register left a thread until the next full collection."""
    import gc
    import threading
    import time

    from artcloud.server.api_errors import ApiError
    from artcloud.server.models import EngineHost

    def factory(base_model: str):
        raise failure

    async def fail_five() -> list[ApiError]:
        errors = []
        for i in range(5):
            with pytest.raises(ApiError) as caught:
                await EngineHost(f"org/model-{i}", factory).load()
            errors.append(caught.value)
        return errors

    before = threading.active_count()
    gc.disable()
    try:
        errors = asyncio.run(fail_five())
        assert all(e.status_code == 400 and e.code == "base_model_not_found" and e.field == "base_model" for e in errors)
        deadline = time.monotonic() + 10
        while threading.active_count() > before and time.monotonic() < deadline:
            time.sleep(0.05)
        assert threading.active_count() <= before, [t.name for t in threading.enumerate()]
    finally:
        gc.enable()


# ------------------------------------------------------------------------------- training bodies

PARSE_BARRIER = """
import os, pathlib, time
from artcloud.server import train_body

_parse, _where = train_body.parse, pathlib.Path(os.environ["ARTCLOUD_TEST_BARRIER"])

def parse(raw):
    (_where / f"parsing-{len(list(_where.glob('parsing-*')))}").touch()
    while not (_where / "go").exists():
        time.sleep(0.05)
    return _parse(raw)

train_body.parse = parse
train_body.BODY_DEADLINE_S = 2.0

from artcloud import wire

_chat_parse = wire.ChatCompletionRequest.model_validate_json

def chat_parse(raw):  # only a big body comes here off the event loop; hold it
    if len(raw) > 65536:
        (_where / "chat-parsing").touch()
        while not (_where / "chat-go").exists():
            time.sleep(0.05)
    return _chat_parse(raw)

wire.ChatCompletionRequest.model_validate_json = chat_parse
"""


def test_training_and_chat_bodies_are_parsed_off_the_event_loop_and_beyond_the_limit_get_429(start_server, tmp_path):
    """Two training bodies are held in their parse (a barrier in the worker thread, where a big body spends
    seconds): meanwhile /health and a chat request answer, a third training POST gets 429 naming
    --max-train-bodies, and once the two are parsed every POST is taken again. A big chat body is parsed off the
    loop too (security review 3, finding 3: a 48 MiB one held it for 11 s): held in its parse, /health and a small
    chat request answer; more messages than a request may hold, or more bytes than the model's context could take,
    are a 400 before any prompt is rendered."""
    hook, barrier = tmp_path / "hook", tmp_path / "barrier"
    hook.mkdir(), barrier.mkdir()
    (hook / "sitecustomize.py").write_text(PARSE_BARRIER)
    env = {"ARTCLOUD_TEST_BARRIER": str(barrier),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(hook), os.environ.get("PYTHONPATH")]))}
    s = start_server(tmp_path / "srv", "--max-train-bodies", "2", env=env)
    with s.client() as c:
        assert c.post("/artcloud/models", json={"name": "agent", "project": "p", "base_model": TINY}).status_code == 200
        groups = rollout_groups(c, "agent", ["x", "y"], n=4)
    answers: list[httpx.Response] = []

    def post() -> None:
        with s.client() as pc:
            answers.append(pc.post("/artcloud/models/agent/train", json={"groups": groups}))

    held = [threading.Thread(target=post) for _ in range(2)]
    for i, t in enumerate(held):
        t.start()
        wait_for(f"body {i + 1} in its parse", (barrier / f"parsing-{i}").exists, 30)
    with s.client() as c:
        assert c.get("/health").json()["status"] == "ok"
        assert chat(c, "agent")["model"] == "agent@0"
        err = _error(c.post("/artcloud/models/agent/train", json={"groups": groups}), 429, "too_many_requests")
        assert "2 training requests are being read" in err["message"] and "--max-train-bodies" in err["message"]
        # The SDK's model.train asks again until a body may be read: its first POST gets the same 429.
        sdk_step: list[int] = []
        sdk = threading.Thread(target=lambda: sdk_step.append(asyncio.run(_sdk_train(s))))
        sdk.start()
        refused = '/train HTTP/1.1" 429'  # uvicorn's access log
        wait_for("the SDK's POST refused", lambda: s.log.read_text().count(refused) == 2, 60)
        (barrier / "go").touch()
        for t in [*held, sdk]:
            t.join(60)
        assert sdk_step == [1]  # its model trained a step once the two held bodies were read
        assert sorted(r.status_code for r in answers) == [202, 202], [r.text for r in answers]
        third = c.post("/artcloud/models/agent/train", json={"groups": groups})
        assert third.status_code == 202, third.text
        for r in [*answers, third]:
            assert events(c, r.json()["job_id"])[-1]["type"] == "end"

        big: list[httpx.Response] = []
        body = {"model": "agent", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                "padding": "x" * 100_000}  # an unknown field, ignored: a body past the inline size, within the context

        def post_big() -> None:
            with s.client() as bc:
                big.append(bc.post("/v1/chat/completions", json=body))

        waiting = threading.Thread(target=post_big)
        waiting.start()
        wait_for("the big chat body in its parse", (barrier / "chat-parsing").exists, 30)
        assert c.get("/health").json()["status"] == "ok"
        assert chat(c, "agent")["model"] == "agent@3"
        (barrier / "chat-go").touch()
        waiting.join(60)
        assert big[0].status_code == 200, big[0].text
        many = [{"role": "user", "content": "x"}] * (wire.MAX_MESSAGES + 1)
        err = _error(c.post("/v1/chat/completions", json={"model": "agent", "messages": many}), 400, "invalid_request")
        assert err["field"] == "messages" and f"at most {wire.MAX_MESSAGES}" in err["message"], err
        long = [{"role": "user", "content": "x" * 64 * 2048}]
        err = _error(c.post("/v1/chat/completions", json={"model": "agent", "messages": long}), 400, "context_too_long")
        assert "more than 64 per token of this model's context (2048 tokens)" in err["message"], err

    # A training body that trickles in takes its slot for BODY_DEADLINE_S at most (2 s here; security review 3, N9).
    host, port = s.url.removeprefix("https://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=30) as raw, \
            ssl.create_default_context(cafile=str(s.ca)).wrap_socket(raw, server_hostname=host) as conn:
        conn.sendall(f"POST /artcloud/models/agent/train HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {s.token}"
                     "\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n{\"groups\": [".encode())
        answer = ""
        while "\r\n\r\n" not in answer or len(answer.partition("\r\n\r\n")[2]) < 100:  # the head, and the body
            chunk = conn.recv(65536).decode()
            if not chunk:
                break
            answer += chunk
    assert answer.startswith("HTTP/1.1 408") and '"request_timeout"' in answer and "over 2 s" in answer, answer


async def _sdk_train(s) -> int:
    """model.train through RemoteBackend: the step the job ended at."""
    from helpers import gather_groups

    import artcloud
    from artcloud.backends.remote import RemoteBackend

    backend = RemoteBackend(s.url, token=s.token, ca_cert=s.ca, heartbeat_every_s=0)
    model = artcloud.TrainableModel(name="sdk", project="p", base_model=TINY)
    await model.register(backend)
    try:
        await model.train(await gather_groups(model))
        return await model.get_step()
    finally:
        await backend.close()


def _body(choice: dict, padding: str = "") -> bytes:
    traj = {"messages_and_choices": [{"role": "user", "content": "hi"}, choice], "reward": 1.0}
    return json.dumps({"groups": [{"trajectories": [traj], "padding": padding}]}).encode()  # a group ignores it


def _choice(k: int, logprob: object = -0.5) -> dict:
    return {"message": {"role": "assistant", "content": "x"}, "token_ids": [1] * k,
            "logprobs": {"content": [{"token": "a", "logprob": logprob, "top_logprobs": []}] * k},
            "prompt_sha256": "0" * 64, "temperature": 1.0}


def test_an_invalid_body_costs_one_error_not_one_per_entry():
    """100,000 bad logprobs: pydantic stops at the first (fail_fast), and the error names it."""
    with pytest.raises(Exception) as caught:
        wire.TrainRequest.model_validate_json(_body(_choice(100_000, "x")))
    assert caught.value.error_count() == 1
    invalid = train_body.parse(_body(_choice(100_000, "x")))
    assert invalid["loc"] == ("body", "groups", 0, "trajectories", 0, "messages_and_choices", 1, "choice", "logprobs",
                              "content", 0, "logprob")


def test_a_sampled_turn_longer_than_any_context_is_refused_by_the_schema():
    for field in ("token_ids", "logprobs"):
        choice = {**_choice(3), field: _choice(wire.MAX_TURN_TOKENS + 1)[field]}
        invalid = train_body.parse(_body(choice))
        assert f"takes at most {wire.MAX_TURN_TOKENS} entries, not {wire.MAX_TURN_TOKENS + 1}" in invalid["msg"], invalid
        assert field in invalid["loc"], invalid
    req, _ = train_body.parse(_body(_choice(3)))  # an entry parses to its logprob: all training reads
    assert req.groups[0].trajectories[0].messages_and_choices[1].logprobs.content == [-0.5] * 3


def test_a_logprob_entry_that_is_not_an_object_is_named_as_the_entry():
    choice = _choice(3)
    choice["logprobs"]["content"] = [{"logprob": -1.0}, 0.5, {"logprob": -1.0}]
    invalid = train_body.parse(_body(choice))
    assert invalid["loc"][-3:] == ("logprobs", "content", 1) and wire.NOT_AN_ENTRY in invalid["msg"]


def test_a_big_body_is_parsed_in_a_child_process_with_the_same_answers(tiny_server):
    """A body over IN_THREAD_MAX_BYTES (here padded by a key a group ignores) is parsed by
    `python -m artcloud.server.train_body`: the same job for a valid one, the same 400 for an invalid one."""
    pad = "x" * (train_body.IN_THREAD_MAX_BYTES + 1)
    with tiny_server.client() as c:
        groups = [{**g, "padding": pad} for g in rollout_groups(c, "agent", ["x", "y"], n=2)]
        r = c.post("/artcloud/models/agent/train", json={"groups": groups})
        assert r.status_code == 202, r.text
        assert events(c, r.json()["job_id"])[-1]["type"] == "end"
        bad = [groups[0], {**groups[1], "trajectories": [{**groups[1]["trajectories"][0], "reward": "high"}]}]
        err = _error(c.post("/artcloud/models/agent/train", json={"groups": bad}), 400, "invalid_request")
        assert err["field"] == "groups[1].trajectories[0].reward", err


def test_a_big_body_goes_to_a_child_process_and_a_small_one_does_not(monkeypatch):
    spawned = []
    real = asyncio.create_subprocess_exec

    async def spy(*args, **kw):
        spawned.append(args)
        return await real(*args, **kw)

    monkeypatch.setattr(asyncio, "create_subprocess_exec", spy)
    small, big = _body(_choice(3)), _body(_choice(3), "x" * train_body.IN_THREAD_MAX_BYTES)
    for raw in (small, big, _body(_choice(3, "x"), "x" * train_body.IN_THREAD_MAX_BYTES)):
        assert asyncio.run(train_body.parse_off_loop(raw)) == train_body.parse(raw)
    root = str(Path(train_body.__file__).resolve().parents[2])
    assert [args[1:] for args in spawned] == [("-I", "-c", train_body.CHILD_CODE, root)] * 2


def test_the_parser_child_is_bounded_in_memory_and_time(monkeypatch):
    """Security review 3, N9: the child had no memory or time limit, and the kernel's OOM killer could pick the server
    over it. Its address space is capped (too small a cap: it cannot run, and the request is a 503, the server
    unharmed), it is the OOM killer's first pick, and a parse that takes too long is stopped."""
    import resource

    seen = []
    real = asyncio.create_subprocess_exec

    async def spy(*args, **kw):
        child = await real(*args, **kw)
        seen.append((Path(f"/proc/{child.pid}/oom_score_adj").read_text().strip(),
                     resource.prlimit(child.pid, resource.RLIMIT_AS)[0]))
        return child

    monkeypatch.setattr(asyncio, "create_subprocess_exec", spy)
    big = _body(_choice(3), "x" * train_body.IN_THREAD_MAX_BYTES)
    assert asyncio.run(train_body.parse_off_loop(big)) == train_body.parse(big)
    assert seen == [("1000", train_body.CHILD_MEMORY_BASE + train_body.CHILD_MEMORY_PER_BODY_BYTE * len(big))]

    monkeypatch.setattr(train_body, "CHILD_MEMORY_BASE", 32 << 20)
    monkeypatch.setattr(train_body, "CHILD_MEMORY_PER_BODY_BYTE", 1)
    with pytest.raises(ApiError) as failed:
        asyncio.run(train_body.parse_off_loop(big))
    assert (failed.value.status, failed.value.code) == (503, "parse_failed")

    monkeypatch.setattr(train_body, "CHILD_TIMEOUT_S", 0.001)
    with pytest.raises(ApiError, match="took over") as slow:
        asyncio.run(train_body.parse_off_loop(big))
    assert slow.value.status == 503

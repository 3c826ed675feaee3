"""POST /artcloud/shutdown: a launcher's graceful end. The server refuses new training, waits (if asked)
for its jobs, pushes the final checkpoints to S3, answers, then exits with status 0. Real server
processes over HTTPS; S3 is a real SeaweedFS."""

from __future__ import annotations

import asyncio
import http.client
import json
import signal
import threading
import time
import uuid
from typing import Any

import httpx
import pytest
from helpers import rollout_groups, train, wait_for
from test_s3_server import s3_env

from artcloud.backends.client import ServerGone, push_verdicts
from artcloud.backends.remote import RemoteBackend
from artcloud.storage.s3 import OWNER, CheckpointStore, S3Config
from tests.seaweed import ACCESS_KEY, SECRET_KEY

TINY = "artcloud/tiny-random"


def test_shutdown_pushes_the_last_checkpoint_answers_and_exits_0(seaweed, start_server):
    bucket = f"shutdown-{uuid.uuid4().hex[:10]}"
    seaweed.client().create_bucket(Bucket=bucket)
    s = start_server(None, "--s3", f"s3://{bucket}/runs", env=s3_env(seaweed))
    with s.client() as c:
        assert c.post("/artcloud/models", json={"name": "agent", "project": "bye", "base_model": TINY}).status_code == 200
        train(c, "agent", rollout_groups(c, "agent", ["x", "y"], n=4), learning_rate=1e-3)
        # A prompted model (served elsewhere, its history kept here): its final push is in the answer too.
        assert c.post("/artcloud/models", json={"name": "judge", "project": "bye", "base_model": None}).status_code == 200
        r = c.post("/artcloud/models/judge/log", json={"split": "val", "metrics": {"accuracy": 0.5}})
        assert r.status_code == 200, r.text

    async def shut() -> tuple[Any, float]:
        remote = RemoteBackend(s.url, token=s.token, ca_cert=s.ca, heartbeat_every_s=0)
        try:
            t0 = time.monotonic()
            answer = await remote.shutdown(timeout=60)
            return answer, time.monotonic() - t0
        finally:
            await remote.close()

    answer, took = asyncio.run(shut())
    assert answer.ok is True and took < 30
    model, judge = answer.models
    assert (judge.name, judge.prompted, judge.error) == ("judge", True, None) and judge.s3.last_error is None
    assert [v.line() for v in push_verdicts(answer)] == ["last checkpoint pushed (agent@1)", "history pushed (judge)"]
    assert (model.name, model.project, model.step, model.training) == ("agent", "bye", 1, False)
    assert model.s3.pushed_step == 1 and not model.s3.pending and model.s3.last_error is None
    assert model.s3.uri == f"s3://{bucket}/runs"

    deadline = time.monotonic() + 10
    while s.proc.poll() is None:
        assert time.monotonic() < deadline, f"the server is still up 10 s after answering:\n{s.tail()}"
        time.sleep(0.1)
    assert s.proc.returncode == 0, s.tail()
    assert "shutting down at a client's request" in s.log.read_text()

    store = CheckpointStore(S3Config(bucket=bucket, prefix="runs", endpoint_url=seaweed.endpoint,
                                     access_key_id=ACCESS_KEY, secret_access_key=SECRET_KEY))
    assert store.committed_steps("bye", "agent") == [0, 1] and store.latest("bye", "agent") == 1
    owner = seaweed.client().list_objects_v2(Bucket=bucket, Prefix=f"runs/bye/agent/{OWNER}")
    assert owner.get("KeyCount", 0) == 0  # the lifespan exit released the claim

    async def again() -> None:  # the server is gone: a transport error, as ServerGone
        remote = RemoteBackend(s.url, token=s.token, ca_cert=s.ca, heartbeat_every_s=0)
        try:
            await remote.shutdown(timeout=10)
        finally:
            await remote.close()

    with pytest.raises(ServerGone):
        asyncio.run(again())


def test_shutdown_needs_the_token_and_a_valid_body(tiny_server):
    s = tiny_server
    with s.client(token="x" * 32) as wrong, s.client() as c:
        r = wrong.post("/artcloud/shutdown")
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_token"
        with s.client() as anonymous:
            anonymous.headers.pop("Authorization")
            r = anonymous.post("/artcloud/shutdown", json={"wait_for_training_s": 0})
            assert r.status_code == 401 and r.json()["error"]["code"] == "missing_token"
        for body in ({"wait_for_training_s": -1}, {"wait_for_training_s": "soon"}):
            r = c.post("/artcloud/shutdown", json=body)
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert err["code"] == "invalid_request" and err["field"] == "wait_for_training_s"
            assert "wait_for_training_s" in err["message"]
        r = c.post("/artcloud/shutdown", json={"wait_for_training_s": 1, "force": True})
        assert r.status_code == 400 and r.json()["error"]["field"] == "force"
        # None of these shut anything down: the server still trains.
        r = c.get("/health")
        assert r.status_code == 200 and s.proc.poll() is None
        train(c, "agent", rollout_groups(c, "agent", ["x"], n=4))


def test_shutdown_waits_for_training_then_refuses_new_jobs(tmp_path, one_torch_thread):
    """In-process (no uvicorn, so no exit): the route waits for a running job, then answers 409
    shutting_down to new training; an idempotent retry of an earlier POST still gets its job."""
    from fastapi.testclient import TestClient

    from artcloud.server.app import create_app
    from artcloud.server.registry import Registry

    token = "t" * 32
    registry = Registry(tmp_path / "data", engine="cpu")
    exits: list[float] = []
    end = registry.lifecycle.end
    registry.lifecycle.end = lambda why: (exits.append(time.monotonic()), end(why))
    with TestClient(create_app(registry, token), headers={"Authorization": f"Bearer {token}"}) as c:
        assert c.post("/artcloud/models", json={"name": "agent", "project": "p", "base_model": TINY}).status_code == 200
        groups = rollout_groups(c, "agent", ["x", "y"], n=4)
        r = c.post("/artcloud/models/agent/train", json={"groups": groups, "idempotency_key": "first"})
        assert r.status_code == 202, r.text
        job_id = r.json()["job_id"]

        answered = time.monotonic()
        r = c.post("/artcloud/shutdown", json={"wait_for_training_s": 60})
        assert r.status_code == 200, r.text
        (model,) = r.json()["models"]
        assert (model["name"], model["project"], model["step"], model["training"], model["s3"]) == ("agent", "p", 1, False, None)
        assert [h["step"] for h in model["history"]] == [1]
        assert c.get(f"/artcloud/jobs/{job_id}").json()["status"] == "succeeded"

        r = c.post("/artcloud/models/agent/train", json={"groups": groups, "idempotency_key": "second"})
        assert r.status_code == 409, r.text
        err = r.json()["error"]
        assert err["code"] == "shutting_down" and "shutting down" in err["message"]
        r = c.post("/artcloud/models/agent/train", json={"groups": groups, "idempotency_key": "first"})
        assert r.status_code == 200 and r.json()["job_id"] == job_id

        r = c.post("/artcloud/shutdown")  # again, with no body: the same answer
        assert r.status_code == 200 and r.json()["models"][0]["step"] == 1
        # Inference still works until the process leaves; the exit was asked for after the answers.
        assert c.post("/v1/chat/completions", json={"model": "agent", "messages": [{"role": "user", "content": "hi"}],
                                                    "max_tokens": 2}).status_code == 200
        wait_for("both exits asked for", lambda: len(exits) == 2, 5, every=0.05)
        assert exits[0] > answered and registry.lifecycle.draining


def test_a_step_in_flight_at_shutdown_is_dropped_not_committed(tmp_path, one_torch_thread):
    """Without a wait, shutdown freezes the models: a step still computing ends with the error
    shutting_down and commits nothing, so the answered step is the newest on disk (and on S3)."""
    from fastapi.testclient import TestClient

    from artcloud.server.app import create_app
    from artcloud.server.engines.cpu import CPUEngine
    from artcloud.server.registry import Registry
    from artcloud.storage import checkpoints

    in_step, go_on = threading.Event(), threading.Event()

    class SlowTrainer(CPUEngine):  # the real engine; its step waits for the shutdown's answer
        def train_step(self, *args, **kwargs):
            in_step.set()
            assert go_on.wait(30)
            return super().train_step(*args, **kwargs)

    token = "t" * 32
    registry = Registry(tmp_path / "data", engine="cpu", factory=SlowTrainer)
    with TestClient(create_app(registry, token), headers={"Authorization": f"Bearer {token}"}) as c:
        assert c.post("/artcloud/models", json={"name": "agent", "project": "p", "base_model": TINY}).status_code == 200
        r = c.post("/artcloud/models/agent/train", json={"groups": rollout_groups(c, "agent", ["x", "y"], n=4)})
        assert r.status_code == 202, r.text
        job_id = r.json()["job_id"]
        assert in_step.wait(30)

        r = c.post("/artcloud/shutdown", json={"wait_for_training_s": 0})
        go_on.set()
        assert r.status_code == 200, r.text
        (model,) = r.json()["models"]
        assert model["step"] == 0 and model["training"] is True

        wait_for("the step to end", lambda: c.get(f"/artcloud/jobs/{job_id}").json()["status"] != "running", 30,
                 every=0.05)
        events = [e for e in c.get(f"/artcloud/jobs/{job_id}/events", params={"follow": False}).text.splitlines() if e]
        last = json.loads(events[-1])
        assert last["type"] == "error" and last["data"]["code"] == "shutting_down", last
        assert "step 1 was not committed" in last["data"]["message"]
        info = c.get("/artcloud/models/agent").json()
        assert info["step"] == 0 and info["history"] == []
    assert checkpoints.committed_steps(tmp_path / "data" / "p" / "agent") == [0]


def test_an_idle_kept_alive_connection_does_not_hold_the_exit(start_server):
    """A client's pooled connection reads nothing while idle, so it never answers the server's TLS close_notify.
    asyncio would wait for that answer and uvicorn's graceful exit for the connection (10 s, the final pushes
    behind it); the server closes the socket once its close_notify is sent instead."""
    s = start_server()
    url = httpx.URL(s.url)
    conn = http.client.HTTPSConnection(url.host, url.port, context=s.ssl_context(), timeout=60)
    conn.request("GET", "/artcloud/status", headers={"Authorization": f"Bearer {s.token}"})  # /health's closes
    answer = conn.getresponse()
    assert answer.status == 200 and not answer.will_close  # kept alive, read to the end, then idle
    answer.read()
    s.proc.send_signal(signal.SIGTERM)  # uvicorn's graceful path, then the signal raised again (-15)
    s.proc.wait(60)
    # The server's close_notify, then the end of the stream: it did not wait for an answer that never came.
    assert conn.sock.recv(1) == b""
    conn.close()
    log = s.log.read_text()
    assert "Application shutdown complete" in log and "timeout graceful shutdown exceeded" not in log

"""Teardown layers 2 and 4: `artcloud serve --lease` and `--max-duration` end the server by themselves,
after the final checkpoint push, with exit status 0. Real server processes; S3 is a real SeaweedFS."""

from __future__ import annotations

import os
import signal
import threading
import time
import uuid

import httpx
import pytest
from helpers import rollout_groups, train, wait_for
from test_cli import one_line_error, serve
from test_s3_server import s3_env

from artcloud.storage.s3 import OWNER, CheckpointStore, S3Config
from tests.seaweed import ACCESS_KEY, SECRET_KEY

TINY = "artcloud/tiny-random"


class Heartbeats:
    """What a client does while it holds a server: POST /artcloud/heartbeat every `every_s`."""

    def __init__(self, server, every_s: float = 1.0):
        self.server = server
        self.every_s = every_s
        self.sent = 0
        self.last_ok = 0.0  # time.monotonic() of the last heartbeat the server answered
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        s = self.server
        with httpx.Client(base_url=s.url, verify=s.ssl_context(), headers={"Authorization": f"Bearer {s.token}"}, timeout=5) as c:
            while not self._stop.is_set():
                try:
                    if c.post("/artcloud/heartbeat").status_code == 200:
                        self.sent += 1
                        self.last_ok = time.monotonic()
                except httpx.TransportError:
                    pass  # the server is going away: that is what some tests wait for
                self._stop.wait(self.every_s)

    def __enter__(self) -> "Heartbeats":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(10)


def wait_exit(server, timeout: float, every_s: float = 0.5) -> tuple[int, list[dict]]:
    """Poll GET /artcloud/status (with the token: it never renews the lease) until the process exits;
    returns its status and the lease sections it reported on the way."""
    seen = []
    deadline = time.monotonic() + timeout
    with server.client(timeout=2) as c:
        while server.proc.poll() is None:
            assert time.monotonic() < deadline, f"the server is still up after {timeout:.0f} s:\n{server.tail()}"
            try:
                seen.append(c.get("/artcloud/status").json()["lease"])
            except (httpx.TransportError, ValueError, KeyError):
                pass
            time.sleep(every_s)
    return server.proc.wait(), seen


@pytest.mark.slow
def test_heartbeats_hold_the_lease_and_status_does_not(start_server):
    s = start_server(None, "--lease", "4s")
    with s.client() as c:
        lease = c.get("/artcloud/status").json()["lease"]
        assert lease["lease_s"] == 4 and lease["max_duration_s"] is None and lease["uptime_s"] >= 0
    with Heartbeats(s, every_s=0.5) as beats:
        wait_for("5 s of heartbeats, past the 4 s lease", lambda: beats.sent > 10, 60)
        assert s.proc.poll() is None, s.tail()
    # The client has gone; only /artcloud/status is polled now, and it must not keep the server alive.
    status, seen = wait_exit(s, timeout=4 + 10)
    gone_for = time.monotonic() - beats.last_ok
    assert status == 0, s.tail()
    assert 4 - 0.5 <= gone_for <= 4 + 10
    assert max(h["idle_s"] for h in seen) >= 3  # status calls did not renew it
    log = s.log.read_text()
    assert "lease: exits after 4s without a client request or heartbeat" in log
    assert "no client request or heartbeat for 4s: pushing checkpoints and shutting down" in log


@pytest.mark.slow
def test_max_duration_ends_the_server_even_while_a_client_holds_it(start_server):
    t0 = time.monotonic()
    s = start_server(None, "--max-duration", "10s", "--lease", "1h")
    with Heartbeats(s, every_s=0.5) as beats:
        status, seen = wait_exit(s, timeout=10 + 15)
    assert status == 0, s.tail()
    assert time.monotonic() - t0 >= 10
    assert beats.sent >= 4 and max(h["idle_s"] for h in seen) < 3  # held all along
    assert seen[-1]["max_duration_s"] == 10 and seen[-1]["lease_s"] == 3600 and seen[-1]["uptime_s"] > 5
    assert "reached --max-duration 10s: pushing checkpoints and shutting down" in s.log.read_text()


@pytest.mark.slow
def test_the_lease_pushes_the_last_checkpoint_to_s3_and_exits_0(seaweed, start_server, tmp_path):
    bucket = f"lease-{uuid.uuid4().hex[:10]}"
    seaweed.client().create_bucket(Bucket=bucket)
    uri = f"s3://{bucket}/runs"
    s = start_server(tmp_path / "a", "--s3", uri, "--lease", "5s", "--engine", "auto", env=s3_env(seaweed))
    warning = "no client request or heartbeat for 5s: pushing checkpoints and shutting down"
    pushed = "pushed agent step 1 to"
    with Heartbeats(s), s.client() as c:  # a client at work: it heartbeats while it waits on training
        assert c.post("/artcloud/models", json={"name": "agent", "project": "lease", "base_model": TINY}).status_code == 200
        groups = rollout_groups(c, "agent", ["x", "y"], n=4)
        assert c.get("/artcloud/status").json()["engines"][0]["kind"] == "auto"
        # S3 hangs (the process is stopped, its connections stay open): step 1's background push cannot
        # finish before the lease ends, so only the final push on the way out can bring it to S3.
        os.killpg(seaweed.proc.pid, signal.SIGSTOP)
    try:
        with Heartbeats(s), s.client() as c:
            train(c, "agent", groups, learning_rate=1e-3)
        # The client is gone without a word (no `down`): the lease must end the server.
        deadline = time.monotonic() + 5 + 10
        while warning not in s.log.read_text():
            assert time.monotonic() < deadline and s.proc.poll() is None, s.tail()
            time.sleep(0.2)
        assert pushed not in s.log.read_text() and s.proc.poll() is None  # waiting on the final push
    finally:
        os.killpg(seaweed.proc.pid, signal.SIGCONT)
    status, _ = wait_exit(s, timeout=60)
    assert status == 0, s.tail()
    log = s.log.read_text()
    assert log.index(warning) < log.index(pushed)
    store = CheckpointStore(S3Config(bucket=bucket, prefix="runs", endpoint_url=seaweed.endpoint,
                                     access_key_id=ACCESS_KEY, secret_access_key=SECRET_KEY))
    assert store.committed_steps("lease", "agent") == [0, 1] and store.latest("lease", "agent") == 1
    pulled = store.pull("lease", "agent", None, tmp_path / "pulled")  # verified against its manifest
    local = s.path / "lease" / "agent" / "checkpoints" / "1" / "manifest.json"
    assert (pulled / "manifest.json").read_text() == local.read_text()
    # The claim was released: the lifespan exit (final push, then release) ran to its end.
    owner = seaweed.client().list_objects_v2(Bucket=bucket, Prefix=f"runs/lease/agent/{OWNER}")
    assert owner.get("KeyCount", 0) == 0


def test_bad_durations_and_engines_are_one_line_errors(tmp_path):
    base = ("--path", str(tmp_path / "d"), "--port", "0")
    one_line_error(serve(*base, "--lease", "0s"), "--lease", "must be a positive")
    one_line_error(serve(*base, "--lease", "30"), "--lease '30' needs a unit: write 30m for minutes or 30s for seconds")
    one_line_error(serve(*base, "--lease", "abc"), "--lease", "'abc' is not a duration")
    one_line_error(serve(*base, "--max-duration", "-5m"), "--max-duration", "is not a duration")
    one_line_error(serve(*base, "--engine", "gpu"), "unknown engine 'gpu'", "choose one of auto, cpu, vllm")


def test_auto_engine_is_cpu_without_cuda_and_vllm_with_cuda_when_vllm_and_unsloth_import(monkeypatch, tmp_path, caplog):
    """--engine auto: one log line says which engine and why; on CUDA without vLLM it falls back to the
    torch engine in bfloat16 (and says why), with vLLM (importable under the given python) it picks vllm."""
    import logging
    import sys

    import torch

    from artcloud.server.engines import choose
    caplog.set_level(logging.INFO, "artcloud.engine")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert choose.engine_factory("auto", workdir=tmp_path) is choose.cpu_engine is choose.engine_factory("cpu", workdir=tmp_path)
    assert "engine auto: cpu, because torch sees no CUDA device" in caplog.text
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "a test GPU")
    # This interpreter has no vllm: the CPU engine's code on the GPU, and the line names the reason.
    gpu = choose.engine_factory("auto", workdir=tmp_path, vllm_python=sys.executable)
    assert gpu.func is choose.cpu_engine and gpu.keywords == {"dtype": "bfloat16", "device": "cuda"}
    assert "`import vllm` fails under" in caplog.text and "No module named 'vllm'" in caplog.text
    with pytest.raises(ValueError, match="choose one of auto, cpu, vllm, vllm\\+unsloth, vllm\\+peft"):
        choose.engine_factory("unsloth", workdir=tmp_path)

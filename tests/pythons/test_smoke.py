"""A server's whole life on the Python that runs this file: start over TLS, a rollout, a training step
committed as a checkpoint, plain HTTP refused, shutdown with status 0; and `import artcloud` stays light.

The normal suite runs it on .venv's Python; `make test-pythons` runs it again under every other Python
that requires-python admits (.ci/python_venvs.py builds their venvs). 3.10 once lost TLS this way:
asyncio's TLS protocol changed shape in 3.11 and only 3.11 was ever run.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import subprocess
import sys
import time

import httpx
from helpers import chat, group_from, train

from artcloud.storage import checkpoints
from tests.server_process import ServerProcess

TINY = "artcloud/tiny-random"


def test_import_artcloud_stays_light():
    code = ("import sys, artcloud; "
            "print(json.dumps(sorted(m for m in ('torch', 'transformers', 'fastapi', 'uvicorn', 'boto3', 'peft') "
            "if m in sys.modules)))")
    out = subprocess.run([sys.executable, "-c", "import json; " + code], capture_output=True, text=True, cwd="/")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == []


def test_serve_tls_rollout_train_shutdown(tmp_path):
    server = ServerProcess(tmp_path / "data")
    try:
        server.start(timeout=120)
        serve_rollout_train_shutdown(server)
    finally:
        server.stop()


def serve_rollout_train_shutdown(server: ServerProcess) -> None:
    # The child really is this interpreter, so what follows tests this Python, not .venv's.
    assert os.path.realpath(f"/proc/{server.proc.pid}/exe") == os.path.realpath(sys.executable)

    with httpx.Client(base_url=server.url, verify=server.ssl_context(), timeout=60) as anonymous:
        with anonymous.stream("GET", "/health") as r:  # its connection closes once the answer is read
            tls = r.extensions["network_stream"].get_extra_info("ssl_object")
            assert tls.version() in ("TLSv1.2", "TLSv1.3")
            r.read()
        assert r.status_code == 200 and r.json()["ready"] is True

    plain = httpx.get(server.url.replace("https://", "http://") + "/v1/chat/completions", timeout=10)
    assert plain.status_code == 400 and plain.json()["error"]["code"] == "https_required"

    with server.client() as c:
        r = c.post("/artcloud/models", json={"name": "agent", "project": "pythons", "base_model": TINY,
                                             "lora": {"rank": 4}})
        assert r.status_code == 200, r.text

        # A rollout: 4 samples of one prompt, with the logprobs training will use.
        prompt = "Count to three."
        response = chat(c, "agent", prompt, n=4, max_tokens=6, temperature=1.0)
        assert response["model"] == "agent@0"
        for choice in response["choices"]:
            logprobs = [t["logprob"] for t in choice["logprobs"]["content"]]
            assert len(logprobs) == len(choice["token_ids"]) > 0
            assert all(math.isfinite(lp) and lp <= 0 for lp in logprobs)

        # A training step on the server's own choices, followed through the NDJSON events to the end.
        group = group_from(response, prompt, rewards=[0.0, 0.25, 0.5, 1.0])
        evs = train(c, "agent", [group], learning_rate=1e-3)
        assert [e["type"] for e in evs] == ["queued", "start", "step", "end"]
        assert math.isfinite(evs[2]["data"]["loss"])
        assert evs[-1]["data"]["trained"] is True and evs[-1]["data"]["served_as"] == "agent@1"
        assert chat(c, "agent")["model"] == "agent@1"
        # The step is committed: checkpoint 1 beside the registration's 0, every file as its manifest says.
        info = c.get("/artcloud/models/agent").json()
        assert info["step"] == 1 and info["checkpoints"] == [0, 1], info

        r = c.post("/artcloud/shutdown", json={"wait_for_training_s": 0})
        assert r.status_code == 200, r.text

    deadline = time.monotonic() + 30
    while server.proc.poll() is None:
        assert time.monotonic() < deadline, f"still up 30 s after /artcloud/shutdown answered:\n{server.tail()}"
        time.sleep(0.1)
    assert server.proc.returncode == 0, server.tail()
    model_dir = server.path / "pythons" / "agent"
    step, folder = checkpoints.latest_valid(model_dir)
    assert step == 1 and checkpoints.verify(folder)["step"] == 1
    assert "adapter_model.safetensors" in checkpoints.read_manifest(folder)["files"]


def test_replayed_bytes_reach_either_kind_of_protocol():
    """tls_only hands the bytes it peeked at to asyncio's TLS protocol: a BufferedProtocol since 3.11,
    a plain Protocol on 3.10. Both get every byte, in order, whatever buffer size they offer."""
    from artcloud.server.tls_only import replay

    class Plain(asyncio.Protocol):
        def __init__(self):
            self.got = b""

        def data_received(self, data: bytes) -> None:
            self.got += data

    class SmallBuffers(asyncio.BufferedProtocol):
        def __init__(self):
            self.buf = bytearray(5)
            self.got = b""

        def get_buffer(self, sizehint: int) -> bytearray:
            return self.buf

        def buffer_updated(self, nbytes: int) -> None:
            self.got += bytes(self.buf[:nbytes])

    hello = bytes(range(0x16, 0x16 + 23))
    for protocol in (Plain(), SmallBuffers()):
        replay(protocol, hello)
        assert protocol.got == hello, type(protocol).__name__


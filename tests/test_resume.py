"""Checkpoints across server restarts: a killed server resumes exactly where it committed."""

from __future__ import annotations

import json
import shutil

from helpers import chat, rollout_groups, train

TINY = "artcloud/tiny-random"
SPEC = {"name": "agent", "project": "resume", "base_model": TINY}


def manifest(server, step: int) -> dict:
    return json.loads((server.path / "resume" / "agent" / "checkpoints" / str(step) / "manifest.json").read_text())


def test_killed_server_resumes_with_the_same_adapter_and_optimizer(start_server, tmp_path):
    # Server A trains two steps without interruption.
    a = start_server(tmp_path / "a")
    with a.client() as c:
        assert c.post("/artcloud/models", json=SPEC).status_code == 200
        g1 = rollout_groups(c, "agent", ["alpha", "beta"], n=4)
        g2 = rollout_groups(c, "agent", ["gamma", "delta"], n=4)
        train(c, "agent", g1, learning_rate=5e-3)
        train(c, "agent", g2, learning_rate=5e-3)
    # Server B trains the first step, is killed (SIGKILL), restarts on the same path, trains the second.
    b = start_server(tmp_path / "b")
    with b.client() as c:
        assert c.post("/artcloud/models", json=SPEC).status_code == 200
        train(c, "agent", g1, learning_rate=5e-3)
        greedy_before = chat(c, "agent", "resume?", temperature=0, max_tokens=12)["choices"][0]
    b.kill()
    b2 = start_server(b.path)
    with b2.client() as c:
        info = c.get("/artcloud/models/agent").json()  # restored at start-up, before any client asked
        assert info["step"] == 1 and len(info["history"]) == 1
        again = c.post("/artcloud/models", json=SPEC).json()
        assert again["resumed"] is True and again["step"] == 1
        greedy_after = chat(c, "agent", "resume?", temperature=0, max_tokens=12)["choices"][0]
        assert greedy_after["token_ids"] == greedy_before["token_ids"]
        assert [x["logprob"] for x in greedy_after["logprobs"]["content"]] == [x["logprob"] for x in greedy_before["logprobs"]["content"]]
        train(c, "agent", g2, learning_rate=5e-3)
    # Adam's moments came back too: the second step lands on the very same weights as A's.
    for name in ("adapter_model.safetensors", "optimizer.pt"):
        assert manifest(a, 2)["files"][name]["sha256"] == manifest(b2, 2)["files"][name]["sha256"], name
    assert manifest(a, 1)["files"]["adapter_model.safetensors"] == manifest(b2, 1)["files"]["adapter_model.safetensors"]


def test_incomplete_and_corrupt_checkpoints_are_never_loaded(start_server, tmp_path):
    s = start_server(tmp_path / "s")
    with s.client() as c:
        c.post("/artcloud/models", json=SPEC)
        train(c, "agent", rollout_groups(c, "agent", ["one"], n=4))
        before = chat(c, "agent", "same", temperature=0, max_tokens=8)["choices"][0]["token_ids"]
    s.stop()
    ckpts = s.path / "resume" / "agent" / "checkpoints"
    # A crash mid-write leaves a temporary folder; a step folder without a manifest; a corrupted step.
    shutil.copytree(ckpts / "1", ckpts / ".tmp-2-deadbeef")
    shutil.copytree(ckpts / "1", ckpts / "3")
    (ckpts / "3" / "manifest.json").unlink()
    shutil.copytree(ckpts / "1", ckpts / "2")
    blob = ckpts / "2" / "adapter_model.safetensors"
    data = bytearray(blob.read_bytes())
    data[-1] ^= 0xFF
    blob.write_bytes(bytes(data))

    s2 = start_server(s.path)
    with s2.client() as c:
        info = c.get("/artcloud/models/agent").json()
        assert info["step"] == 1
        assert chat(c, "agent", "same", temperature=0, max_tokens=8)["choices"][0]["token_ids"] == before
        # Training goes on from step 1 and can commit step 2 (the broken one was set aside, not deleted).
        end = train(c, "agent", rollout_groups(c, "agent", ["two"], n=4))[-1]
        assert end["data"]["step"] == 2
    names = sorted(p.name for p in ckpts.iterdir())
    assert not any(n.startswith(".tmp-") for n in names)
    assert sum(n.startswith(".invalid-") for n in names) == 2
    assert {"0", "1", "2"} <= set(names)

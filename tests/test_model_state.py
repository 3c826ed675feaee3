"""OpenPipe ART's model state (`read_state`, `merge_state`, `overwrite_state`, `write_state`): kept on the server
with the step it belongs to, in every checkpoint, on S3, and back on a new server with the weights it matches."""

from __future__ import annotations

import asyncio
import json
import uuid

import pytest
from helpers import rollout_groups, train
from test_s3_server import s3_env

import artcloud
from artcloud.backends.remote import RemoteBackend
from artcloud.errors import BadRequest, WrongType
from artcloud.server.model_state import StateKeeper, dump

TINY = "artcloud/tiny-random"


def backend_for(server) -> RemoteBackend:
    return RemoteBackend(server.url, token=server.token, ca_cert=server.ca, heartbeat_every_s=0)


def test_state_is_read_merged_and_overwritten_as_in_art(tiny_server):
    async def main() -> None:
        backend = backend_for(tiny_server)
        model = artcloud.TrainableModel(name="stateful", project="state", base_model=TINY)
        with pytest.raises(artcloud.WrongState, match="register"):
            model.read_state()
        await model.register(backend)
        assert model.read_state() is None
        model.overwrite_state({"offset": 3, "nested": {"a": 1, "b": [1, 2]}})
        assert model.merge_state({"nested": {"b": [3], "c": "x"}, "epoch": 1}) == {
            "offset": 3, "nested": {"a": 1, "b": [3], "c": "x"}, "epoch": 1}
        with pytest.warns(DeprecationWarning, match="overwrite_state"):
            model.write_state({"offset": 4})
        assert model.read_state() == {"offset": 4}
        with pytest.raises(WrongType, match="JSON"):
            model.merge_state({"when": object()})
        with pytest.raises(WrongType, match="dict"):
            model.overwrite_state([1, 2])  # type: ignore[arg-type]
        with pytest.raises(BadRequest, match="state_too_large") as e:
            model.overwrite_state({"blob": "x" * (2 << 20)})
        assert e.value.field == "state" and model.read_state() == {"offset": 4}  # nothing of it was kept
        with pytest.raises(WrongType, match="JSON"):
            model.merge_state({"loss": float("nan")})
        with tiny_server.client() as c:  # past the client's check: the server's parser takes NaN, JSON has none
            r = c.put("/artcloud/models/stateful/state", content='{"state": {"loss": NaN}}',
                      headers={"content-type": "application/json"})
            assert r.status_code == 400 and r.json()["error"]["field"] == "state", r.text
        assert model.read_state() == {"offset": 4}
        # A prompted model (ART's art.Model) keeps a state too.
        baseline = artcloud.Model(name="baseline-state", project="state", inference_base_url="http://127.0.0.1:9/v1")
        await baseline.register(backend)
        baseline.merge_state({"seen": 10})
        assert baseline.read_state() == {"seen": 10}
        await backend.close()

    asyncio.run(main())


def test_each_checkpoint_holds_the_state_it_was_committed_with_and_a_restart_keeps_the_live_one(start_server, tmp_path):
    spec = {"name": "agent", "project": "state", "base_model": TINY}
    a = start_server(tmp_path / "a")
    with a.client() as c:
        assert c.post("/artcloud/models", json=spec).status_code == 200
        assert c.put("/artcloud/models/agent/state", json={"state": {"offset": 0}}).json() == {
            "step": 0, "state": {"offset": 0}}
        train(c, "agent", rollout_groups(c, "agent", ["one"], n=3))
        after = c.put("/artcloud/models/agent/state", json={"state": {"offset": 1}, "merge": True}).json()
        assert after == {"step": 1, "state": {"offset": 1}}  # written at step 1
        train(c, "agent", rollout_groups(c, "agent", ["two"], n=3))
        r = c.put("/artcloud/models/agent/state", json={"state": "not an object"})
        assert r.status_code == 400 and r.json()["error"]["field"] == "state"
    a.stop()
    ckpts = a.path / "state" / "agent" / "checkpoints"
    committed = {s: json.loads((ckpts / str(s) / "state.json").read_text()) for s in (0, 1, 2)}
    assert [committed[s]["state"] for s in (0, 1, 2)] == [None, {"offset": 0}, {"offset": 1}]
    for s in (0, 1, 2):  # in the manifest: verified like the adapter
        assert "state.json" in json.loads((ckpts / str(s) / "manifest.json").read_text())["files"]
    b = start_server(a.path)
    with b.client() as c:
        assert c.get("/artcloud/models/agent/state").json() == {"step": 2, "state": {"offset": 1}}


def test_a_state_written_after_a_step_that_was_lost_does_not_outlive_it(tmp_path):
    """The live copy is tagged with the step it was written at: a model that resumes at another step (its newer
    checkpoint lost, say) takes the state its checkpoint was committed with."""
    async def main() -> None:
        folder, checkpoint = tmp_path / "model", tmp_path / "model" / "checkpoints" / "1"
        checkpoint.mkdir(parents=True)
        (checkpoint / "state.json").write_text(dump(1, {"offset": 10}))
        (folder / "state.json").write_text(dump(2, {"offset": 20}))  # written at step 2, whose checkpoint is gone
        keeper = StateKeeper(folder)
        await keeper.resume(1, checkpoint)
        assert (keeper.step, keeper.value) == (1, {"offset": 10})
        (folder / "state.json").write_text(dump(1, {"offset": 11}))  # written at step 1: newer than its checkpoint
        await keeper.resume(1, checkpoint)
        assert keeper.value == {"offset": 11}
        (folder / "state.json").write_text('{"step": "one", "state": 7}')  # not a state file: the checkpoint's
        await keeper.resume(1, checkpoint)
        assert keeper.value == {"offset": 10}

    asyncio.run(main())


@pytest.mark.slow
def test_the_state_comes_back_from_s3_on_a_new_machine(seaweed, start_server, tmp_path):
    bucket = f"state-{uuid.uuid4().hex[:10]}"
    seaweed.client().create_bucket(Bucket=bucket)
    uri, env = f"s3://{bucket}/runs", s3_env(seaweed)
    spec = {"name": "agent", "project": "state", "base_model": TINY}
    a = start_server(tmp_path / "a", "--s3", uri, env=env)
    with a.client() as c:
        assert c.post("/artcloud/models", json=spec).status_code == 200
        train(c, "agent", rollout_groups(c, "agent", ["one"], n=3))
        c.put("/artcloud/models/agent/state", json={"state": {"offset": 1, "seed": 7}})
        assert c.post("/artcloud/shutdown", json={}).status_code == 200  # the final push: S3 has it all
    a.stop()  # it exits by itself after the shutdown; stop waits for that
    live = json.loads(seaweed.client().get_object(Bucket=bucket, Key="runs/state/agent/state.json")["Body"].read())
    assert live == {"step": 1, "state": {"offset": 1, "seed": 7}}
    b = start_server(tmp_path / "b", "--s3", uri, env=env)  # a fresh machine: nothing on its disk
    with b.client() as c:
        assert c.post("/artcloud/models", json=spec).json()["step"] == 1
        assert c.get("/artcloud/models/agent/state").json() == {"step": 1, "state": {"offset": 1, "seed": 7}}

"""OpenPipe ART's backend._experimental_fork_checkpoint: a model starts from another model's committed checkpoint
(the SFT-then-RL recipe), from the server's disk or from S3."""

from __future__ import annotations

import asyncio
import uuid

import pytest
from helpers import chat, rollout_groups, train
from test_s3_server import s3_env

import artcloud
from artcloud.backends.remote import RemoteBackend
from artcloud.errors import BadRequest, Conflict, NotFound

TINY = "artcloud/tiny-random"


def backend_for(server) -> RemoteBackend:
    return RemoteBackend(server.url, token=server.token, ca_cert=server.ca, heartbeat_every_s=0)


def greedy(c, model: str) -> list:
    """The greedy answer's tokens and their logprobs: an adapter's fingerprint (two steps may pick the same tokens,
    never with the same logprobs)."""
    choice = chat(c, model, "Fork?", temperature=0, max_tokens=10)["choices"][0]
    return list(zip(choice["token_ids"], (x["logprob"] for x in choice["logprobs"]["content"])))


def test_a_model_starts_from_anothers_checkpoint_and_trains_on(start_server, tmp_path, caplog):
    server = start_server(tmp_path / "srv")
    with server.client() as c:
        assert c.post("/artcloud/models", json={"name": "sft", "project": "p", "base_model": TINY}).status_code == 200
        for prompt in ("one", "two"):
            train(c, "sft", rollout_groups(c, "sft", [prompt], n=3), learning_rate=5e-2)
        at_one, at_two = greedy(c, "sft@1"), greedy(c, "sft@2")
        assert at_one != at_two  # the steps differ: the fork below must take the one asked for

    async def main() -> None:
        backend = backend_for(server)
        rl = artcloud.TrainableModel(name="rl", project="p", base_model=TINY)
        # As ART's scripts do: fork first, register after (the fork registers it)
        await backend._experimental_fork_checkpoint(rl, from_model="sft", not_after_step=1)
        assert rl.step == 1 and (await backend.model_info("rl")).checkpoints == [0, 1]
        await rl.register(backend)
        assert await rl.get_step() == 1
        with pytest.raises(Conflict, match="has not trained yet"):
            await backend._experimental_fork_checkpoint(rl, from_model="sft")
        other = artcloud.TrainableModel(name="other-lora", project="p", base_model=TINY,
                                        lora=artcloud.LoraConfig(rank=2))
        with pytest.raises(BadRequest, match="does not fit this model's LoRA") as e:
            await backend._experimental_fork_checkpoint(other, from_model="sft")
        assert e.value.field == "from_model"
        assert (await backend.model_info("other-lora")).step == 0  # left as it was, and still served
        with pytest.raises(NotFound, match="no committed checkpoint of p/nobody"):
            await backend._experimental_fork_checkpoint(other, from_model="nobody")
        with pytest.raises(BadRequest, match="itself"):
            await backend._experimental_fork_checkpoint(other, from_model="other-lora")
        await backend.close()

    asyncio.run(main())
    with server.client() as c:
        assert greedy(c, "rl") == at_one  # the adapter of sft@1, exactly
        end = train(c, "rl", rollout_groups(c, "rl", ["three"], n=3), learning_rate=5e-2)[-1]
        assert end["data"]["step"] == 2 and end["data"]["trained"]
        assert c.get("/artcloud/models/sft").json()["step"] == 2  # the source is untouched
        assert greedy(c, "sft@2") == at_two
        trained = greedy(c, "rl")

    async def run_again() -> None:  # the script once more: as ART's, the model stays at its latest step
        backend = backend_for(server)
        rl = artcloud.TrainableModel(name="rl", project="p", base_model=TINY)
        await backend._experimental_fork_checkpoint(rl, from_model="sft", not_after_step=1)
        assert rl.step == 2 and (await backend.model_info("rl")).checkpoints == [0, 1, 2]
        await backend.close()

    with caplog.at_level("WARNING"):
        asyncio.run(run_again())
    assert "rl is at step 2 already" in caplog.text
    with server.client() as c:
        assert greedy(c, "rl") == trained


@pytest.mark.slow
def test_a_fork_finds_the_checkpoint_on_s3_when_the_disk_has_none(seaweed, start_server, tmp_path):
    bucket = f"fork-{uuid.uuid4().hex[:10]}"
    seaweed.client().create_bucket(Bucket=bucket)
    uri, env = f"s3://{bucket}/runs", s3_env(seaweed)
    a = start_server(tmp_path / "a", "--s3", uri, env=env)
    with a.client() as c:
        assert c.post("/artcloud/models", json={"name": "sft", "project": "p", "base_model": TINY}).status_code == 200
        train(c, "sft", rollout_groups(c, "sft", ["one"], n=3), learning_rate=5e-2)
        trained = greedy(c, "sft")
        assert c.post("/artcloud/shutdown", json={}).status_code == 200
    a.stop()
    b = start_server(tmp_path / "b", env=env)  # another machine, no --s3 of its own: the bucket is named
    with b.client() as c:
        assert c.post("/artcloud/models", json={"name": "rl", "project": "p", "base_model": TINY}).status_code == 200
        r = c.post("/artcloud/models/rl/fork", json={"from_model": "sft", "from_s3_bucket": bucket, "prefix": "runs"})
        assert r.status_code == 400 and r.json()["error"]["field"] == "from_s3_bucket"  # no S3 credentials here
    b.stop()
    c_server = start_server(tmp_path / "c", "--s3", f"s3://{bucket}/other", env=env)
    with c_server.client() as c:
        assert c.post("/artcloud/models", json={"name": "rl", "project": "p", "base_model": TINY}).status_code == 200
        r = c.post("/artcloud/models/rl/fork", json={"from_model": "sft", "from_s3_bucket": bucket, "prefix": "runs"})
        assert r.status_code == 200 and r.json()["step"] == 1, r.text
        assert greedy(c, "rl") == trained
        assert not list((c_server.path / "p" / "rl").glob(".fork-*"))  # the pulled copy is gone

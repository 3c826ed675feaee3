"""The server with --s3: every checkpoint pushed in the background, and a new machine resumes from S3."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
import uuid

import pytest
from helpers import rollout_groups, train
from test_cli import one_line_error, serve

from artcloud.storage.s3 import CheckpointStore, S3Config
from tests.seaweed import ACCESS_KEY, SECRET_KEY

TINY = "artcloud/tiny-random"
SPEC = {"name": "agent", "project": "s3", "base_model": TINY}


def s3_env(seaweed, secret: str = SECRET_KEY) -> dict[str, str]:
    return {"ARTCLOUD_S3_ENDPOINT_URL": seaweed.endpoint, "AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": secret,
            "AWS_REGION": "us-east-1"}


def wait_pushed(client, step: int, timeout: float = 60) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        s3 = client.get("/artcloud/models/agent").json()["s3"]
        if s3["pushed_step"] == step and not s3["pending"]:
            return s3
        time.sleep(0.2)
    raise AssertionError(f"step {step} was not pushed: {s3}")


def test_checkpoints_reach_s3_and_a_new_server_resumes_from_them(seaweed, start_server, tmp_path):
    bucket = f"srv-{uuid.uuid4().hex[:10]}"
    seaweed.client().create_bucket(Bucket=bucket)
    uri = f"s3://{bucket}/team"
    a = start_server(tmp_path / "a", "--s3", uri, env=s3_env(seaweed))
    with a.client() as c:
        assert c.post("/artcloud/models", json=SPEC).status_code == 200
        end = train(c, "agent", rollout_groups(c, "agent", ["x", "y"], n=4), learning_rate=1e-3)[-1]
        assert end["data"]["s3"]["uri"] == uri
        status = wait_pushed(c, 1)
        assert status["errors"] == 0 and status["pushed_bytes"] > 0
        status_all = c.get("/artcloud/status").json()  # /health without details since issue 14
        assert status_all["models"][0]["s3"]["pushed_step"] == 1
    store = CheckpointStore(S3Config(bucket=bucket, prefix="team", endpoint_url=seaweed.endpoint,
                                     access_key_id=ACCESS_KEY, secret_access_key=SECRET_KEY))
    assert store.committed_steps("s3", "agent") == [0, 1] and store.latest("s3", "agent") == 1
    a.stop()

    # Another machine: an empty path, the same S3 location.
    b = start_server(tmp_path / "b", "--s3", uri, env=s3_env(seaweed))
    with b.client() as c:
        info = c.post("/artcloud/models", json=SPEC).json()
        assert info["resumed"] is True and info["step"] == 1
    local_a = (a.path / "s3" / "agent" / "checkpoints" / "1" / "manifest.json").read_text()
    local_b = (b.path / "s3" / "agent" / "checkpoints" / "1" / "manifest.json").read_text()
    assert local_a == local_b  # the same adapter, optimizer and trainer state, byte for byte

    # `artcloud pull`: the committed step, verified, in a folder peft loads as it is.
    pulled = serve_pull("s3/agent", uri, seaweed, "--to", str(tmp_path / "pulled"))
    assert pulled.returncode == 0, pulled.stderr
    folder = tmp_path / "pulled" / "1"
    assert (folder / "manifest.json").read_text() == local_a
    from peft import PeftModel

    from artcloud.server.engines import loading

    base, _ = loading.load(TINY)
    PeftModel.from_pretrained(base, str(folder))  # loads as it is
    nothing = serve_pull("s3/nobody", uri, seaweed)
    one_line_error(nothing, "no committed checkpoint")


def serve_pull(target: str, uri: str, seaweed, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "artcloud", "pull", target, "--s3", uri, *args], capture_output=True, text=True,
                          env={**os.environ, **s3_env(seaweed)}, timeout=120)


def test_wrong_s3_credentials_fail_at_start(seaweed, tmp_path):
    bucket = f"bad-{uuid.uuid4().hex[:10]}"
    seaweed.client().create_bucket(Bucket=bucket)
    result = serve("--path", str(tmp_path / "d"), "--port", "0", "--s3", f"s3://{bucket}/x", env=s3_env(seaweed, secret="wrong-secret"))
    one_line_error(result, "refused")
    assert "wrong-secret" not in result.stderr
    missing = serve("--path", str(tmp_path / "d"), "--port", "0", "--s3", "s3://no-such-bucket-xyz/x", env=s3_env(seaweed))
    one_line_error(missing, "does not exist")


def test_a_second_server_on_the_same_model_and_prefix_is_refused(seaweed, start_server, tmp_path):
    bucket = f"two-{uuid.uuid4().hex[:10]}"
    seaweed.client().create_bucket(Bucket=bucket)
    uri = f"s3://{bucket}/shared"
    a = start_server(tmp_path / "a", "--s3", uri, env=s3_env(seaweed))
    b = start_server(tmp_path / "b", "--s3", uri, env=s3_env(seaweed))
    with a.client() as ca, b.client() as cb:
        assert ca.post("/artcloud/models", json=SPEC).status_code == 200
        refused = cb.post("/artcloud/models", json=SPEC)
        assert refused.status_code == 409
        error = refused.json()["error"]
        assert error["code"] == "model_locked" and error["field"] == "name" and "another server" in error["message"]
        # The SDK raises it as its own class: a 409 Conflict, ModelLocked by its code.
        from artcloud.backends.remote import RemoteBackend
        from artcloud.errors import Conflict, ModelLocked

        async def register_on_b():
            client = RemoteBackend(b.url, token=b.token, ca_cert=b.ca, retries=1)
            try:
                await client.register(SPEC["name"], SPEC["project"], SPEC["base_model"], {})
            finally:
                await client.close()

        with pytest.raises(ModelLocked) as locked:
            asyncio.run(register_on_b())
        assert isinstance(locked.value, Conflict) and locked.value.status == 409 and locked.value.field == "name"
        # Another model on the same prefix is fine: the claim is per model.
        assert cb.post("/artcloud/models", json={**SPEC, "name": "other"}).status_code == 200
    a.stop()  # A lets go of its claim on the way out: now B may take the model over
    with b.client() as cb:
        assert cb.post("/artcloud/models", json=SPEC).status_code == 200


def test_retention_keeps_the_latest_k_and_the_best_here_and_on_s3(seaweed, start_server, tmp_path):
    bucket = f"ret-{uuid.uuid4().hex[:10]}"
    seaweed.client().create_bucket(Bucket=bucket)
    s = start_server(tmp_path / "r", "--s3", f"s3://{bucket}/r", "--keep-last", "2", env=s3_env(seaweed))
    with s.client() as c:
        c.post("/artcloud/models", json=SPEC)
        for i in range(4):
            train(c, "agent", rollout_groups(c, "agent", [f"q{i}"], n=3), learning_rate=1e-3)
            wait_pushed(c, i + 1)
        info = c.get("/artcloud/models/agent").json()
        history = {r["step"]: r["reward_mean"] for r in info["history"]}
    best = max(history, key=lambda k: (history[k], k))
    expected = sorted({3, 4, best})
    assert info["checkpoints"] == expected
    store = CheckpointStore(S3Config(bucket=bucket, prefix="r", endpoint_url=seaweed.endpoint,
                                     access_key_id=ACCESS_KEY, secret_access_key=SECRET_KEY))
    assert store.committed_steps("s3", "agent") == expected and store.latest("s3", "agent") == 4
    assert "retention: deleted" in s.log.read_text()


def _push_hostile_manifest(seaweed, tmp_path, bucket: str, project: str, model: str) -> None:
    """Step 1 of PROJECT/MODEL committed on S3 with a manifest naming a file two folders up."""
    from test_s3 import commit

    store = CheckpointStore(S3Config(bucket=bucket, prefix="team", endpoint_url=seaweed.endpoint,
                                     access_key_id=ACCESS_KEY, secret_access_key=SECRET_KEY))
    store.push(project, model, commit(tmp_path / "seed", 1, {"adapter_model.safetensors": 100}))
    key = f"team/{project}/{model}/checkpoints/1/manifest.json"
    manifest = json.loads(seaweed.client().get_object(Bucket=bucket, Key=key)["Body"].read())
    manifest["files"]["../../planted"] = {"size": 1, "sha256": "0" * 64}
    seaweed.client().put_object(Bucket=bucket, Key=key, Body=json.dumps(manifest).encode())


def test_artcloud_pull_refuses_a_hostile_manifest_in_one_line(seaweed, tmp_path):
    bucket = f"hostile-{uuid.uuid4().hex[:10]}"
    seaweed.client().create_bucket(Bucket=bucket)
    _push_hostile_manifest(seaweed, tmp_path, bucket, "p", "m")
    dest = tmp_path / "a" / "b" / "pulled"
    result = serve_pull("p/m", f"s3://{bucket}/team", seaweed, "--to", str(dest))
    one_line_error(result, "'../../planted'", f"s3://{bucket}/team/p/m/checkpoints/1/manifest.json", "(step 1)")
    assert not dest.exists() and not (tmp_path / "a").exists()  # not a byte written, not even the folder


def test_server_resume_refuses_a_hostile_manifest(seaweed, start_server, tmp_path):
    bucket = f"hostile-{uuid.uuid4().hex[:10]}"
    seaweed.client().create_bucket(Bucket=bucket)
    _push_hostile_manifest(seaweed, tmp_path, bucket, SPEC["project"], SPEC["name"])
    s = start_server(tmp_path / "srv" / "data", "--s3", f"s3://{bucket}/team", env=s3_env(seaweed))
    with s.client() as c:
        refused = c.post("/artcloud/models", json=SPEC)
    assert 400 <= refused.status_code < 500, refused.text
    assert "'../../planted'" in refused.json()["error"]["message"]
    assert not list(tmp_path.rglob("planted")) and not list(tmp_path.rglob(".pull-*"))
    assert not list((s.path / "s3" / "agent").rglob("manifest.json"))  # nothing pulled, nothing to resume from

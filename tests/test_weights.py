"""Base weights on S3 (issue 18): staged with the manifest last, pulled in parallel ranged GETs and verified,
refused when tampered with or described by a hostile manifest; a server with an S3 location and an empty
Hugging Face cache loads a staged model, and a model it loaded from the cache is staged back by itself.
All against the real SeaweedFS server, with the real weights of artcloud/tiny-random."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest
from test_s3_server import s3_env

from artcloud.storage.s3 import S3Config
from artcloud.storage.weights import CorruptWeights, WeightsError, WeightsStore
from tests.seaweed import ACCESS_KEY, SECRET_KEY

COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory) -> Path:
    """tiny-random's real files (config, tokenizer, model.safetensors of ~4 MB), plus a nested and an empty file."""
    from artcloud.server.engines import tiny

    folder = tiny.build(tmp_path_factory.mktemp("tiny") / "model")
    (folder / "extra").mkdir()
    (folder / "extra" / "notes.txt").write_text("nested file\n")
    (folder / "empty.txt").write_bytes(b"")
    (folder / ".gitattributes").write_text("hidden: not staged\n")
    return folder


@pytest.fixture
def bucket(seaweed) -> str:
    name = f"w-{uuid.uuid4().hex[:10]}"
    seaweed.client().create_bucket(Bucket=name)
    return name


def config(seaweed, bucket: str) -> S3Config:
    return S3Config(bucket=bucket, prefix="team", endpoint_url=seaweed.endpoint, access_key_id=ACCESS_KEY,
                    secret_access_key=SECRET_KEY)


def files_of(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file() and not p.name.startswith(".")}


def hf_cache(home: Path, model: str, src: Path) -> Path:
    """`model` in a Hugging Face cache under `home`, laid out as huggingface_hub writes it: blobs, a
    snapshot of symlinks into them, refs/main naming the commit. Returns the snapshot folder."""
    repo = home / "hub" / f"models--{model.replace('/', '--')}"
    snapshot = repo / "snapshots" / COMMIT
    for rel, data in files_of(src).items():
        blob = repo / "blobs" / f"{uuid.uuid4().hex}"
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        (snapshot / rel).parent.mkdir(parents=True, exist_ok=True)
        (snapshot / rel).symlink_to(os.path.relpath(blob, (snapshot / rel).parent))
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / "main").write_text(COMMIT)
    return snapshot


# ----------------------------------------------------------------------------------------- stage and pull


def test_stage_then_pull_is_byte_exact_and_skips_what_is_there(seaweed, bucket, tiny_folder, tmp_path):
    store = WeightsStore(config(seaweed, bucket), workers=4, chunk_mb=1)  # model.safetensors: several chunks
    manifest = store.stage("org/tiny", tiny_folder)
    assert {f["path"] for f in manifest["files"]} == set(files_of(tiny_folder))  # hidden files left out
    keys = {o["Key"] for o in seaweed.client().list_objects_v2(Bucket=bucket)["Contents"]}
    assert "team/models/org--tiny/main/manifest.json" in keys
    assert "team/models/org--tiny/main/files/model.safetensors" in keys

    seen: list[tuple[int, int]] = []
    dest = tmp_path / "pulled" / "tiny"
    result = store.pull("org/tiny", dest, progress=lambda done, total: seen.append((done, total)))
    assert files_of(dest) == files_of(tiny_folder)
    total = sum(len(b) for b in files_of(tiny_folder).values())
    assert result.fetched_bytes == total and seen[-1] == (total, total)
    assert [d for d, _ in seen] == sorted(d for d, _ in seen)  # monotonic
    assert sorted(os.listdir(dest.parent)) == ["tiny"]  # no temporary folder left

    again = store.pull("org/tiny", dest)  # the same manifest: nothing fetched
    assert again.fetched_bytes == 0 and again.reused_bytes == total

    # Re-stage with one file changed: only the changed file is uploaded, and only it is fetched.
    changed = tmp_path / "changed"
    shutil.copytree(tiny_folder, changed)
    (changed / "extra" / "notes.txt").write_text("changed\n")
    store.stage("org/tiny", changed)
    third = store.pull("org/tiny", dest)
    assert third.fetched_bytes == len(b"changed\n") and third.reused_bytes == total - len(b"nested file\n")
    assert files_of(dest) == files_of(changed)


def test_the_manifest_is_written_last_and_a_model_without_one_is_not_staged(seaweed, bucket, tiny_folder, tmp_path,
                                                                             monkeypatch):
    store = WeightsStore(config(seaweed, bucket), workers=2)
    calls: list[tuple[str, str]] = []
    client = store.s3
    for name in ("upload_file", "put_object"):
        real = getattr(client, name)

        def record(*args, _name=name, _real=real, **kw):
            key = kw.get("Key") or args[2]
            calls.append(("begin", key))
            try:
                return _real(*args, **kw)  # (upload_file puts the object with put_object: recorded too)
            finally:
                calls.append(("end", key))

        monkeypatch.setattr(client, name, record)
    store.stage("org/tiny", tiny_folder)
    manifest_key = "team/models/org--tiny/main/manifest.json"
    first = calls.index(("begin", manifest_key))
    assert calls[first:] == [("begin", manifest_key), ("end", manifest_key)]  # after every file's upload ended
    assert {k for _, k in calls[:first]} == {f"team/models/org--tiny/main/files/{f}" for f in files_of(tiny_folder)}

    # A stage that dies half-way leaves files but no manifest: not staged, and a pull says so.
    import artcloud.storage.weights as weights

    real_sha = weights.sha256_file

    def dies_on_config(path):
        if path.name == "tokenizer.json":
            raise OSError("disk read error")
        return real_sha(path)

    monkeypatch.setattr(weights, "sha256_file", dies_on_config)
    with pytest.raises(OSError, match="disk read error"):
        store.stage("org/half", tiny_folder)
    listed = seaweed.client().list_objects_v2(Bucket=bucket, Prefix="team/models/org--half/")
    assert listed.get("KeyCount", 0) >= 1 and not any(o["Key"].endswith("manifest.json") for o in listed["Contents"])
    assert store.manifest("org/half") is None
    with pytest.raises(WeightsError, match="not staged"):
        store.pull("org/half", tmp_path / "half")
    assert not (tmp_path / "half").exists()

    # The server's resolution: no manifest means the hub id, as before.
    from artcloud.server.base_weights import resolve_weights

    assert resolve_weights("org/half", store.config) == "org/half"


@pytest.mark.parametrize("damage", ["same size", "shorter", "longer", "deleted"])
def test_a_tampered_file_fails_verification_and_leaves_no_folder(seaweed, bucket, tiny_folder, tmp_path, damage):
    store = WeightsStore(config(seaweed, bucket), workers=4, chunk_mb=1)
    store.stage("org/tiny", tiny_folder)
    key = "team/models/org--tiny/main/files/model.safetensors"
    s3 = seaweed.client()
    data = bytearray(s3.get_object(Bucket=bucket, Key=key)["Body"].read())
    if damage == "deleted":
        s3.delete_object(Bucket=bucket, Key=key)
    else:
        data[len(data) // 2] ^= 0xFF
        body = {"same size": bytes(data), "shorter": bytes(data[:-100]), "longer": bytes(data) + b"x" * 100}[damage]
        s3.put_object(Bucket=bucket, Key=key, Body=body)
    expected = {"same size": "does not match its manifest", "shorter": "is .* bytes, its manifest says",
                "longer": "is .* bytes, its manifest says", "deleted": "is missing"}[damage]
    with pytest.raises(CorruptWeights, match=expected) as caught:
        store.pull("org/tiny", tmp_path / "pulled" / "tiny")
    assert "model.safetensors" in str(caught.value) and "\n" not in str(caught.value)
    assert os.listdir(tmp_path / "pulled") == []  # neither the model folder nor a temporary one

    # An earlier copy in place (of an older version: its model.safetensors differs, so it must be fetched)
    # stays exactly as it was.
    good = tmp_path / "good"
    shutil.copytree(tiny_folder, good / "tiny")
    (good / "tiny" / "model.safetensors").write_bytes(b"an older version")
    before = files_of(good / "tiny")
    with pytest.raises(CorruptWeights):
        store.pull("org/tiny", good / "tiny")
    assert files_of(good / "tiny") == before and os.listdir(good) == ["tiny"]


def _good_manifest(store: WeightsStore, tiny_folder: Path) -> dict:
    return store.stage("org/tiny", tiny_folder)


@pytest.mark.parametrize("hostile, message", [
    ({"path": "../../outside.txt"}, "is not a plain name"),
    ({"path": "/etc/passwd"}, "not a relative path"),
    ({"path": "a/../../b"}, "is not a plain name"),
    ({"path": ".ssh/authorized_keys"}, "is not a plain name"),
    ({"path": "a\\..\\b"}, "not a relative path"),
    ({"size": -1}, "'size' must be an integer"),
    ({"size": 1 << 50}, "'size' must be an integer"),
    ({"size": "12"}, "'size' must be an integer"),
    ({"sha256": "abc"}, "'sha256' must be 64"),
    ({"link": "/etc/passwd"}, "unknown field"),
])
def test_a_hostile_manifest_is_refused_before_anything_is_written(seaweed, bucket, tiny_folder, tmp_path, hostile, message):
    store = WeightsStore(config(seaweed, bucket))
    manifest = _good_manifest(store, tiny_folder)
    manifest["files"][0].update(hostile)
    seaweed.client().put_object(Bucket=bucket, Key="team/models/org--tiny/main/manifest.json",
                                Body=json.dumps(manifest).encode())
    with pytest.raises(CorruptWeights, match=message) as caught:
        store.pull("org/tiny", tmp_path / "pulled" / "tiny")
    assert "team/models/org--tiny/main/manifest.json" in str(caught.value) and "\n" not in str(caught.value)
    assert not (tmp_path / "pulled").exists()


@pytest.mark.parametrize("change, message", [
    (lambda m: m.update(extra=1), "unknown field"),
    (lambda m: m.update(model="other/model"), "not 'org/tiny'"),
    (lambda m: m.update(files=m["files"] + [dict(m["files"][0], path=m["files"][0]["path"].upper())]), "listed twice"),
    (lambda m: m.update(files=m["files"] + [dict(m["files"][0], path="extra")]), "as a file and as a folder"),
    (lambda m: m.update(files=[]), "non-empty list"),
    (lambda m: m.update(format=2), "unknown format"),
])
def test_a_manifest_that_is_not_one_is_refused(seaweed, bucket, tiny_folder, tmp_path, change, message):
    store = WeightsStore(config(seaweed, bucket))
    manifest = _good_manifest(store, tiny_folder)
    change(manifest)
    seaweed.client().put_object(Bucket=bucket, Key="team/models/org--tiny/main/manifest.json",
                                Body=json.dumps(manifest).encode())
    with pytest.raises(CorruptWeights, match=message):
        store.manifest("org/tiny")
    seaweed.client().put_object(Bucket=bucket, Key="team/models/org--tiny/main/manifest.json", Body=b"{not json")
    with pytest.raises(CorruptWeights, match="not valid JSON"):
        store.pull("org/tiny", tmp_path / "x")
    assert not (tmp_path / "x").exists()


# ----------------------------------------------------------------------------------------- the server


def _chat(c, model: str) -> dict:
    r = c.post("/v1/chat/completions", json={"model": model, "messages": [{"role": "user", "content": "hi"}],
                                              "max_tokens": 4, "temperature": 1.0})
    assert r.status_code == 200, r.text
    return r.json()


def test_a_server_with_an_empty_hf_cache_loads_a_model_staged_on_s3(seaweed, bucket, tiny_folder, start_server, tmp_path):
    store = WeightsStore(config(seaweed, bucket))
    store.stage("testorg/tiny", tiny_folder)
    store.stage("testorg/bad", tiny_folder)
    seaweed.client().put_object(Bucket=bucket, Key="team/models/testorg--bad/main/files/config.json", Body=b"{}")
    empty_hf, cache = tmp_path / "hf-empty", tmp_path / "artcloud-cache"
    env = {**s3_env(seaweed), "HF_HOME": str(empty_hf), "HF_HUB_OFFLINE": "1", "ARTCLOUD_CACHE": str(cache)}
    server = start_server(tmp_path / "srv", "--s3", f"s3://{bucket}/team", "--max-base-models", "2", env=env)
    with server.client() as c:
        r = c.post("/artcloud/models", json={"name": "agent", "project": "w", "base_model": "testorg/tiny"})
        assert r.status_code == 200, r.text + server.tail()
        assert r.json()["base_model"] == "testorg/tiny"  # the registered name stays the model id
        phases = c.get("/health").json()["phases"]  # the pull was /health's fetching_weights, then the engine loaded
        assert phases["fetching_weights"] > 0 and phases["loading_engine"] > 0, phases
        answer = _chat(c, "agent")
        assert answer["choices"][0]["message"]["content"] is not None
        pulled = cache / "models" / "s3" / "testorg--tiny" / "main"
        assert files_of(pulled) == files_of(tiny_folder)

        r = c.post("/artcloud/models", json={"name": "bad", "project": "w", "base_model": "testorg/bad"})
        error = r.json()["error"]
        assert r.status_code == 400 and error["code"] == "corrupt_weights", r.text
        assert "config.json" in error["message"] and error["field"] == "base_model"
        assert list((cache / "models" / "s3" / "testorg--bad").iterdir()) == []  # no model folder, no temporary one
    assert not list(empty_hf.rglob("*.safetensors"))  # nothing came through the Hugging Face cache


def test_a_model_loaded_from_the_hf_cache_is_staged_in_the_background(seaweed, bucket, tiny_folder, start_server,
                                                                      tmp_path):
    hf_home = tmp_path / "hf"
    snapshot = hf_cache(hf_home, "cacheorg/tiny", tiny_folder)
    env = {**s3_env(seaweed), "HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1", "ARTCLOUD_CACHE": str(tmp_path / "c")}
    server = start_server(tmp_path / "srv", "--s3", f"s3://{bucket}/team", env=env)
    store = WeightsStore(config(seaweed, bucket))
    with server.client() as c:
        r = c.post("/artcloud/models", json={"name": "agent", "project": "w", "base_model": "cacheorg/tiny"})
        assert r.status_code == 200, r.text + server.tail()
        deadline = time.monotonic() + 120
        while (manifest := store.manifest("cacheorg/tiny")) is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert manifest is not None, server.tail()
        assert manifest["commit"] == COMMIT
        _chat(c, "agent")  # the server serves while (and after) it stages
    pulled = store.pull("cacheorg/tiny", tmp_path / "pulled")
    assert files_of(pulled.folder) == files_of(snapshot) == files_of(tiny_folder)


def test_a_model_is_never_staged_twice_at_once(seaweed, bucket, tiny_folder, tmp_path, monkeypatch):
    import artcloud.server.base_weights as server_weights

    release = threading.Event()
    calls = []

    def slow_snapshot(model, revision):
        calls.append(model)
        release.wait(30)
        return tiny_folder

    monkeypatch.setattr(server_weights, "local_snapshot", slow_snapshot)
    weights = server_weights.BaseWeights(config(seaweed, bucket))
    first = weights.stage_later("org/twice", "org/twice")
    assert first is not None
    assert weights.stage_later("org/twice", "org/twice") is None  # the first is still at work
    assert weights.stage_later("org/tiny-random-ish", Path("/pulled/from/s3")) is None  # loaded from S3: staged already
    assert weights.stage_later("artcloud/tiny-random", "artcloud/tiny-random") is None  # built here, never downloaded
    release.set()
    first.join(60)
    assert calls == ["org/twice"]
    assert WeightsStore(weights.s3).manifest("org/twice") is not None
    again = weights.stage_later("org/twice", "org/twice")  # done: a later call may run (and finds it staged)
    assert again is not None
    again.join(60)


# ----------------------------------------------------------------------------------------- the CLI


def stage_cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "artcloud", "stage-model", *args], capture_output=True, text=True,
                          timeout=120, env={**os.environ, **(env or {})})


def one_line(r: subprocess.CompletedProcess, *needles: str) -> str:
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("artcloud: error: "), r.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def test_stage_model_cli_stages_from_the_hf_cache_and_says_what_is_wrong(seaweed, bucket, tiny_folder, tmp_path):
    hf_home = tmp_path / "hf"
    hf_cache(hf_home, "cliorg/tiny", tiny_folder)
    uri = f"s3://{bucket}/team"
    env = {**s3_env(seaweed), "HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1"}
    env.pop("ARTCLOUD_S3_ENDPOINT_URL")  # given with --endpoint-url instead
    r = stage_cli("cliorg/tiny", "--s3", uri, "--endpoint-url", seaweed.endpoint, env=env)
    assert r.returncode == 0, r.stderr
    assert "staged cliorg/tiny (main)" in r.stdout and "models/cliorg--tiny/main" in r.stdout
    store = WeightsStore(config(seaweed, bucket))
    assert store.manifest("cliorg/tiny")["commit"] == COMMIT
    assert files_of(store.pull("cliorg/tiny", tmp_path / "pulled").folder) == files_of(tiny_folder)

    env_ok = {**env, "ARTCLOUD_S3_ENDPOINT_URL": seaweed.endpoint}
    one_line(stage_cli("cliorg/tiny", env={**env_ok, "ARTCLOUD_S3": ""}), "--s3 s3://BUCKET/PREFIX")
    one_line(stage_cli("nobody/here", "--s3", uri, env=env_ok), "nobody/here (main) is not in the Hugging Face cache",
             "HF_HUB_OFFLINE")
    one_line(stage_cli("bad id!", "--s3", uri, env=env_ok), "is not a hub id")
    one_line(stage_cli("cliorg/tiny", "--s3", uri, "--from", str(tmp_path / "nowhere"), env=env_ok), "--from", "no such folder")
    one_line(stage_cli("cliorg/tiny", "--s3", uri, env={**env_ok, "AWS_SECRET_ACCESS_KEY": "wrong-secret-0123456789"}),
             "refused these credentials")
    one_line(stage_cli("cliorg/tiny", "--s3", "s3://no-such-bucket-here/x", env=env_ok), "does not exist")

"""Checkpoints on a real S3 server (SeaweedFS on loopback): push, pull, skip, commit order, faults."""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time
import uuid

import pytest
from botocore.exceptions import ClientError, EndpointConnectionError, ParamValidationError

from artcloud.storage import checkpoints
from artcloud.storage.s3 import CheckpointStore, S3Config, StorageError
from tests.seaweed import ACCESS_KEY, SECRET_KEY, SeaweedS3


def store_for(server, bucket: str | None = None, **kw) -> CheckpointStore:
    bucket = bucket or f"ckpt-{uuid.uuid4().hex[:10]}"
    server.client().create_bucket(Bucket=bucket)
    config = S3Config(bucket=bucket, prefix="runs", endpoint_url=server.endpoint, access_key_id=ACCESS_KEY, secret_access_key=SECRET_KEY)
    return CheckpointStore(config, **kw)


def commit(model_dir, step: int, sizes: dict[str, int]):
    def write(folder):
        for name, size in sizes.items():
            (folder / name).write_bytes(os.urandom(size))
        return list(sizes)

    return checkpoints.commit(model_dir, step, write, {"history": []})


def test_push_pull_roundtrip_skips_what_is_there(seaweed, tmp_path):
    store = store_for(seaweed, multipart_mb=5)
    store.check()
    folder = commit(tmp_path / "m", 1, {"adapter_model.safetensors": 12 << 20, "optimizer.pt": 3 << 20})
    first = store.push("proj", "agent", folder)
    assert first.uploaded_files == 3 and first.uploaded_bytes > 15 << 20  # + trainer_state.json
    again = store.push("proj", "agent", folder)
    assert again.uploaded_bytes == 0 and again.skipped_files == 3
    assert store.latest("proj", "agent") == 1 and store.committed_steps("proj", "agent") == [1]
    pulled = store.pull("proj", "agent", None, tmp_path / "pulled")
    for name in ("adapter_model.safetensors", "optimizer.pt", "trainer_state.json", "manifest.json"):
        assert (pulled / name).read_bytes() == (folder / name).read_bytes()


def test_latest_only_moves_forward_and_uncommitted_steps_are_invisible(seaweed, tmp_path):
    store = store_for(seaweed)
    two = commit(tmp_path / "m", 2, {"a.bin": 1000})
    one = commit(tmp_path / "m", 1, {"a.bin": 1000})
    store.push("p", "m", two)
    store.push("p", "m", one)
    assert store.latest("p", "m") == 2
    # Files of step 3 without a manifest: an upload that never finished.
    seaweed.client().put_object(Bucket=store.config.bucket, Key="runs/p/m/checkpoints/3/a.bin", Body=b"partial")
    assert store.committed_steps("p", "m") == [1, 2]
    with pytest.raises(StorageError, match="not committed"):
        store.pull("p", "m", 3, tmp_path / "out")


def test_a_step_whose_manifest_went_up_before_latest_did_is_the_newest(seaweed, tmp_path):
    """A machine lost between a step's manifest and LATEST: the step is committed (its manifest is there), so it is
    what a resume or `artcloud pull` takes, not the older step LATEST still names."""
    store = store_for(seaweed)
    store.push("p", "m", commit(tmp_path / "m", 1, {"a.bin": 1000}))
    two = commit(tmp_path / "m", 2, {"a.bin": 1000})
    store.push("p", "m", two)
    seaweed.client().put_object(Bucket=store.config.bucket, Key="runs/p/m/LATEST", Body=b'{"step": 1}')  # as it was
    seaweed.client().put_object(Bucket=store.config.bucket, Key="runs/p/m/checkpoints/3/a.bin", Body=b"partial")
    assert store.latest("p", "m") == 1 and store.committed_steps("p", "m") == [1, 2]
    assert store.newest("p", "m") == 2  # step 3 has no manifest: not committed
    pulled = store.pull("p", "m", None, tmp_path / "out")
    assert pulled.name == "2" and (pulled / "a.bin").read_bytes() == (two / "a.bin").read_bytes()
    assert store.newest("p", "nobody") is None


def test_a_corrupted_object_is_refused_on_pull(seaweed, tmp_path):
    store = store_for(seaweed)
    folder = commit(tmp_path / "m", 1, {"a.bin": 5000})
    store.push("p", "m", folder)
    seaweed.client().put_object(Bucket=store.config.bucket, Key="runs/p/m/checkpoints/1/a.bin", Body=os.urandom(5000))
    with pytest.raises(checkpoints.CorruptCheckpoint, match="sha256"):
        store.pull("p", "m", 1, tmp_path / "out")
    assert not (tmp_path / "out" / "1").exists() and not list((tmp_path / "out").glob(".pull-*"))


def test_wrong_credentials_or_bucket_fail_at_once(seaweed):
    good = store_for(seaweed)
    wrong = CheckpointStore(S3Config(bucket=good.config.bucket, endpoint_url=seaweed.endpoint,
                                     access_key_id=ACCESS_KEY, secret_access_key="not-the-secret"), attempts=1)
    with pytest.raises(StorageError, match="refused"):
        wrong.check()
    missing = CheckpointStore(S3Config(bucket="no-such-bucket-here", endpoint_url=seaweed.endpoint,
                                       access_key_id=ACCESS_KEY, secret_access_key=SECRET_KEY), attempts=1)
    with pytest.raises(StorageError, match="does not exist"):
        missing.check()
    assert "not-the-secret" not in repr(wrong) and "not-the-secret" not in repr(wrong.config)


def test_s3_killed_mid_upload_commits_nothing_and_the_push_resumes(tmp_path):
    server = SeaweedS3(tmp_path / "s3").start()
    try:
        store = store_for(server, multipart_mb=5, attempts=2, workers=2)
        folder = commit(tmp_path / "m", 1, {"big.bin": 60 << 20})
        failure: list[BaseException] = []

        def push():
            try:
                store.push("p", "m", folder)
            except BaseException as e:
                failure.append(e)

        # S3 goes away mid-upload: the first part goes through, the next ones are held back until the server
        # is stopped. (A fixed sleep raced the upload: on an idle machine 60 MB reach S3 in a fraction of a second.)
        parts, lock = [], threading.Lock()
        first_part_sent, stopped = threading.Event(), threading.Event()

        def hold(**kw) -> None:
            with lock:
                parts.append(kw["request"].url)
                first = len(parts) == 1
            if first:
                first_part_sent.set()
            else:
                stopped.wait(60)

        store.s3.meta.events.register("before-send.s3.UploadPart", hold)
        t = threading.Thread(target=push)
        t.start()
        assert first_part_sent.wait(60), "the upload never started"
        time.sleep(0.2)  # the first part on its way
        server.stop()
        stopped.set()
        t.join(120)
        store.s3.meta.events.unregister("before-send.s3.UploadPart", hold)
        assert failure, "the push should have failed with the server gone"
        assert len(parts) >= 2  # a part went out before S3 went, and one after
        server.start()
        assert store.committed_steps("p", "m") == [] and store.latest("p", "m") is None
        result = store.push("p", "m", folder)
        assert result.uploaded_files >= 1
        assert store.latest("p", "m") == 1
        pulled = store.pull("p", "m", 1, tmp_path / "out")
        assert (pulled / "big.bin").read_bytes() == (folder / "big.bin").read_bytes()
    finally:
        server.stop()


# ------------------------------------------------------------------------------------- untrusted input from the bucket

def _files_under(root) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


PAYLOAD = b"written by whoever holds the bucket's keys"
SHA = hashlib.sha256(PAYLOAD).hexdigest()


def _hostile_name(name: str):
    """A manifest entry `name` whose object exists too, so a reader that trusted it would write it."""
    def edit(manifest: dict, tmp_path) -> list[str]:
        manifest["files"][name.format(tmp=tmp_path)] = {"size": len(PAYLOAD), "sha256": SHA}
        return [name.format(tmp=tmp_path)]
    return edit


def _edit(fn):
    def edit(manifest: dict, tmp_path) -> list[str]:
        fn(manifest)
        return []
    return edit


HOSTILE_MANIFESTS = {
    "parent-escape": (_hostile_name("../../x"), "'../../x'"),
    "absolute-path": (_hostile_name("{tmp}/outside/abs.bin"), "file name '/"),  # long paths are cut short
    "subfolder": (_hostile_name("a/b"), "'a/b'"),
    "dot-dot": (_hostile_name(".."), "'..'"),
    "dot-file": (_hostile_name(".bashrc"), "'.bashrc'"),
    "empty-name": (_hostile_name(""), "''"),
    "nul": (_hostile_name("a\x00b"), "'a\\x00b'"),
    "manifest-itself": (_hostile_name("manifest.json"), "'manifest.json'"),
    "str-size": (_edit(lambda m: m["files"]["a.bin"].update(size="5000")), "'size'"),
    "huge-size": (_edit(lambda m: m["files"]["a.bin"].update(size=1 << 50)), "'size'"),
    "no-sha256": (_edit(lambda m: m["files"]["a.bin"].pop("sha256")), "'sha256'"),
    "upper-sha256": (_edit(lambda m: m["files"]["a.bin"].update(sha256=m["files"]["a.bin"]["sha256"].upper())), "'sha256'"),
    "huge-count": (_edit(lambda m: m["files"].update({f"f{i}": {"size": 0, "sha256": "0" * 64} for i in range(1001)})), "1003 files"),
    "other-step": (_edit(lambda m: m.update(step=2)), "says step 2"),
    "bool-step": (_edit(lambda m: m.update(step=True)), "'step'"),
    "files-list": (_edit(lambda m: m.update(files=[])), "'files'"),
    "not-an-object": (lambda m, t: (m.clear(), m.update(list=True))[0] or [], "format"),
}


@pytest.mark.parametrize("case", list(HOSTILE_MANIFESTS))
@pytest.mark.parametrize("entry", ["store.pull", "pull_checkpoint"])
def test_a_hostile_manifest_is_refused_before_anything_is_written(seaweed, tmp_path, monkeypatch, case, entry):
    from artcloud.storage.s3 import CorruptRemoteCheckpoint, pull_checkpoint

    store = store_for(seaweed)
    s3, bucket = seaweed.client(), store.config.bucket
    store.push("p", "m", commit(tmp_path / "m", 1, {"a.bin": 5000}))
    (tmp_path / "outside").mkdir()
    key = "runs/p/m/checkpoints/1/manifest.json"
    manifest = json.loads(s3.get_object(Bucket=bucket, Key=key)["Body"].read())
    edit, named = HOSTILE_MANIFESTS[case]
    for name in edit(manifest, tmp_path):
        try:  # the object a trusting reader would fetch and write (AWS takes any key; SeaweedFS refuses "..")
            s3.put_object(Bucket=bucket, Key=f"runs/p/m/checkpoints/1/{name}", Body=PAYLOAD)
        except (ClientError, ParamValidationError, ValueError):
            pass
    s3.put_object(Bucket=bucket, Key=key, Body=json.dumps(manifest).encode())

    before = _files_under(tmp_path)
    dest = tmp_path / "a" / "b" / "dest"
    with pytest.raises(StorageError) as info:
        if entry == "store.pull":  # what server resume calls
            store.pull("p", "m", 1, dest)
        else:  # what `artcloud pull` calls
            monkeypatch.setenv("ARTCLOUD_S3_ENDPOINT_URL", seaweed.endpoint)
            monkeypatch.setenv("ARTCLOUD_S3_ACCESS_KEY_ID", ACCESS_KEY)
            monkeypatch.setenv("ARTCLOUD_S3_SECRET_ACCESS_KEY", SECRET_KEY)
            pull_checkpoint("p/m", s3=f"s3://{bucket}/runs", to=dest, progress=False)
    message = str(info.value)
    assert isinstance(info.value, CorruptRemoteCheckpoint) and isinstance(info.value, checkpoints.CorruptCheckpoint)
    assert f"s3://{bucket}/{key}" in message and "(step 1)" in message and named in message, message
    assert "\n" not in message
    assert _files_under(tmp_path) == before  # nothing written anywhere, outside or in
    assert not dest.exists() and not (tmp_path / "a" / "b" / "x").exists()


@pytest.mark.parametrize("garbage", [b"not json", b"[1]", b'{"step": "1"}', b'{"step": -1}', b'{"step": true}', b"{}",
                                     b"\xff\xfe", b'{"step": 1, "pad": "' + b"x" * (100 << 10) + b'"}'],
                         ids=["text", "list", "str", "negative", "bool", "empty", "binary", "huge"])
def test_a_garbage_latest_pointer_is_a_clear_storage_error(seaweed, tmp_path, garbage):
    store = store_for(seaweed)
    store.push("p", "m", commit(tmp_path / "m", 1, {"a.bin": 100}))
    key = "runs/p/m/LATEST"
    seaweed.client().put_object(Bucket=store.config.bucket, Key=key, Body=garbage)
    with pytest.raises(StorageError, match=f"s3://{store.config.bucket}/{key}") as info:
        store.pull("p", "m", None, tmp_path / "out")
    assert "\n" not in str(info.value)
    assert not (tmp_path / "out").exists()
    with pytest.raises(StorageError, match="LATEST"):
        store.latest("p", "m")


def test_an_object_larger_than_its_manifest_says_stops_downloading(seaweed, tmp_path):
    store = store_for(seaweed)
    store.push("p", "m", commit(tmp_path / "m", 1, {"a.bin": 100}))
    # Swapped for a big one after the commit: the download stops at the manifest's size, not at 20 MB.
    seaweed.client().put_object(Bucket=store.config.bucket, Key="runs/p/m/checkpoints/1/a.bin", Body=os.urandom(20 << 20))
    with pytest.raises(checkpoints.CorruptCheckpoint, match="larger than the 100 bytes"):
        store.pull("p", "m", 1, tmp_path / "out")
    assert list((tmp_path / "out").iterdir()) == []


def test_the_test_s3_server_takes_a_bucket_per_test_for_a_whole_session(seaweed):
    """One volume per bucket, capped by default at free disk / 1 GB (~70 here): past that every write is
    an InternalError, and a session of S3 tests (one bucket each) ran into it."""
    import urllib.request

    master = next(a.split("=", 1)[1] for a in seaweed._args if a.startswith("-master.port="))
    with urllib.request.urlopen(f"http://127.0.0.1:{master}/dir/status", timeout=10) as r:
        topology = json.load(r)["Topology"]
    assert topology["Max"] >= 1000, topology


def test_s3_attempts_come_from_the_environment_and_each_is_a_real_request(monkeypatch):
    """ARTCLOUD_S3_ATTEMPTS: how many times a request goes out before its failure stands (each a real send,
    counted at botocore's wire), forwarded to a sandbox by SkyBackend (here) and ModalBackend (test_modal)."""
    import socket

    from artcloud.storage.s3 import DEFAULT_ATTEMPTS

    with socket.socket() as s:  # a port nothing listens on: every try is refused at once
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    config = S3Config(bucket="b", prefix="p", endpoint_url=f"http://127.0.0.1:{port}", access_key_id="k", secret_access_key="s")
    monkeypatch.delenv("ARTCLOUD_S3_ATTEMPTS", raising=False)
    assert CheckpointStore(config).attempts == DEFAULT_ATTEMPTS == 6
    monkeypatch.setenv("ARTCLOUD_S3_ATTEMPTS", "3")
    store = CheckpointStore(config)
    sent = []
    store.s3.meta.events.register("before-send.s3.*", lambda **kw: sent.append(kw["request"].url))
    with pytest.raises(EndpointConnectionError):
        store.latest("proj", "model")
    assert len(sent) == 3 and store.attempts == 3
    from artcloud.backends.sky import SkyBackend
    from artcloud.tls import make_launch_secrets

    made = make_launch_secrets()
    secrets = {"ARTCLOUD_TOKEN": made.token, "ARTCLOUD_TLS_CERT": made.server_cert, "ARTCLOUD_TLS_KEY": made.server_key}
    backend = SkyBackend(gpu="L4", cluster_name="tries", api=object(), s3="s3://b/p")
    task = backend.provisioner.task(launch_secrets=secrets, wheel=None)
    assert task.config["envs"]["ARTCLOUD_S3_ATTEMPTS"] == "3"  # the sandbox's server tries as often
    assert CheckpointStore(config, attempts=1).attempts == 1  # an explicit argument wins
    for bad in ("0", "21", "three", "-1"):
        monkeypatch.setenv("ARTCLOUD_S3_ATTEMPTS", bad)
        with pytest.raises(StorageError) as err:
            CheckpointStore(config)
        assert "ARTCLOUD_S3_ATTEMPTS" in str(err.value) and "1 to 20" in str(err.value) and "\n" not in str(err.value)

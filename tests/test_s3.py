"""Checkpoints on a real S3 server (SeaweedFS on loopback): push, pull, skip, commit order, faults."""

from __future__ import annotations

import os
import threading
import time
import uuid

import pytest

from artcloud.storage import checkpoints
from artcloud.storage.s3 import CheckpointStore, S3Config, StorageError
from artcloud.storage.seaweed import ACCESS_KEY, SECRET_KEY, SeaweedS3


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

        t = threading.Thread(target=push)
        t.start()
        time.sleep(0.5)
        server.stop()  # S3 goes away mid-upload
        t.join(120)
        assert failure, "the push should have failed with the server gone"
        server.start()
        assert store.committed_steps("p", "m") == [] and store.latest("p", "m") is None
        result = store.push("p", "m", folder)
        assert result.uploaded_files >= 1
        assert store.latest("p", "m") == 1
        pulled = store.pull("p", "m", 1, tmp_path / "out")
        assert (pulled / "big.bin").read_bytes() == (folder / "big.bin").read_bytes()
    finally:
        server.stop()

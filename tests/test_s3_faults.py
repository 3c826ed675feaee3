"""Faults between the store and a real S3 server (SeaweedFS), injected by tests/faults.py's HTTP proxy:
answers lost after the write happened, a slow uplink, a checkpoint folder deleted mid-push; and the
single-writer claim (renew, take-over, garbage records)."""

from __future__ import annotations

import json
import os
import shutil
import threading
import time

import pytest
from botocore.exceptions import ConnectionClosedError
from faults import HTTPFaultProxy, Request
from test_s3 import commit, store_for

from artcloud.storage.s3 import OWNER, CheckpointStore, ClaimLost, S3Config, StorageError
from tests.seaweed import ACCESS_KEY, SECRET_KEY


@pytest.fixture
def proxy(seaweed):
    p = HTTPFaultProxy("127.0.0.1", seaweed.port)
    yield p
    p.close()


def through(proxy: HTTPFaultProxy, direct: CheckpointStore, **kw) -> CheckpointStore:
    """The same bucket as `direct`, reached through the proxy."""
    config = S3Config(bucket=direct.config.bucket, prefix=direct.config.prefix, endpoint_url=proxy.endpoint,
                      access_key_id=ACCESS_KEY, secret_access_key=SECRET_KEY)
    return CheckpointStore(config, **kw)


def owner_record(seaweed, store: CheckpointStore, project: str = "p", model: str = "m") -> dict:
    body = seaweed.client().get_object(Bucket=store.config.bucket, Key=f"{store.config.prefix}/{project}/{model}/{OWNER}")["Body"]
    return json.loads(body.read())


def owner_put(conditional: str):
    """Matches a PUT of an OWNER object carrying the conditional header `conditional`."""
    def match(r: Request) -> bool:
        return r.method == "PUT" and r.path.split("?")[0].endswith("/" + OWNER) and conditional in r.headers
    return match


# ------------------------------------------------------------------------------------- the proxy itself

def test_the_proxy_slows_uploads_to_its_rate(seaweed):
    direct = store_for(seaweed)
    slow = HTTPFaultProxy("127.0.0.1", seaweed.port, rate_bytes_per_s=1 << 20)  # 1 MiB/s
    try:
        client = through(slow, direct).s3
        data = os.urandom(2 << 20)
        t0 = time.monotonic()
        client.put_object(Bucket=direct.config.bucket, Key="slow/two-mb", Body=data)
        elapsed = time.monotonic() - t0
        assert elapsed >= 1.9, f"2 MiB at 1 MiB/s took only {elapsed:.2f} s"
        # Keep-alive: more requests on the same connections, answers relayed whole.
        assert client.get_object(Bucket=direct.config.bucket, Key="slow/two-mb")["Body"].read() == data
        assert client.head_object(Bucket=direct.config.bucket, Key="slow/two-mb")["ContentLength"] == len(data)
        assert [s for _, _, s in slow.log] == [200, 200, 200]
    finally:
        slow.close()


def test_a_lost_answer_reaches_the_server_but_not_the_client(seaweed, proxy):
    direct = store_for(seaweed)
    client = through(proxy, direct).s3  # total_max_attempts=1: botocore itself must not retry
    proxy.lose_next_response(lambda r: r.method == "PUT")
    with pytest.raises(ConnectionClosedError):
        client.put_object(Bucket=direct.config.bucket, Key="lost/answer", Body=b"written")
    assert proxy.requests("PUT", "/lost/answer") == [("PUT", f"/{direct.config.bucket}/lost/answer", None)]
    assert seaweed.client().get_object(Bucket=direct.config.bucket, Key="lost/answer")["Body"].read() == b"written"


# ------------------------------------------------------------------------------------- the claim

def test_a_renewal_whose_answer_was_lost_is_still_ours(seaweed, proxy):
    direct = store_for(seaweed)
    store = through(proxy, direct)
    store.claim("p", "m", "me")
    # The If-Match write lands, its answer is lost; the retry then gets 412 (the ETag moved: our own write).
    proxy.lose_next_response(owner_put("if-match"))
    store.claim("p", "m", "me")
    statuses = [s for _, _, s in proxy.requests("PUT", "/" + OWNER)]
    assert statuses == [200, 412, None, 412], statuses  # create; create refused, renew lost, renew retried
    assert owner_record(seaweed, direct)["owner"] == "me"
    proxy.lose_next_response(owner_put("if-match"))
    store.renew("p", "m", "me")  # the same for renew
    assert [s for _, _, s in proxy.requests("PUT", "/" + OWNER)][-2:] == [None, 412]
    assert owner_record(seaweed, direct)["owner"] == "me"


def test_a_first_claim_whose_answer_was_lost_is_still_ours(seaweed, proxy):
    direct = store_for(seaweed)
    store = through(proxy, direct)
    proxy.lose_next_response(owner_put("if-none-match"))
    store.claim("p", "m", "me")
    assert [s for _, _, s in proxy.requests("PUT", "/" + OWNER)][:2] == [None, 412]
    assert owner_record(seaweed, direct)["owner"] == "me"


def test_renew_keeps_our_claim_fresh(seaweed):
    store = store_for(seaweed)
    store.claim("p", "m", "me")
    before = owner_record(seaweed, store)
    time.sleep(0.01)
    store.renew("p", "m", "me")
    after = owner_record(seaweed, store)
    assert after["owner"] == "me" and after["renewed_at"] > before["renewed_at"] and after["nonce"] != before["nonce"]


def test_renew_raises_claim_lost_when_another_owner_took_over(seaweed):
    store = store_for(seaweed)
    store.claim("p", "m", "me")
    # Another server, after our silence, takes the model over (stale_after_s=0: we count as silent).
    store.claim("p", "m", "other", stale_after_s=0)
    with pytest.raises(ClaimLost, match="taken over by another server"):
        store.renew("p", "m", "me")
    assert owner_record(seaweed, store)["owner"] == "other"  # and renew wrote nothing
    store.release("p", "m", "other")
    with pytest.raises(ClaimLost, match="is gone"):
        store.renew("p", "m", "me")


def test_claim_refuses_a_fresh_owner_and_takes_over_a_stale_one(seaweed):
    store = store_for(seaweed)
    store.claim("p", "m", "other")
    with pytest.raises(StorageError, match="being trained by another server"):
        store.claim("p", "m", "me", stale_after_s=900)
    key = f"{store.config.prefix}/p/m/{OWNER}"
    old = {**owner_record(seaweed, store), "renewed_at": time.time() - 1000}
    seaweed.client().put_object(Bucket=store.config.bucket, Key=key, Body=json.dumps(old).encode())
    store.claim("p", "m", "me", stale_after_s=900)
    assert owner_record(seaweed, store)["owner"] == "me"


@pytest.mark.parametrize("garbage", [b"not json at all", b"[]", b'{"owner": 3, "renewed_at": 1}', b'{"owner": "x"}',
                                     b'{"owner": "x", "renewed_at": "yesterday"}', b"\xff\xfe\x00",
                                     b'{"owner": "x", "renewed_at": 1, "pad": "' + b"x" * (100 << 10) + b'"}'],
                         ids=["text", "list", "int-owner", "no-time", "str-time", "binary", "huge"])
def test_a_garbage_owner_record_is_a_clear_storage_error(seaweed, garbage):
    store = store_for(seaweed)
    key = f"{store.config.prefix}/p/m/{OWNER}"
    seaweed.client().put_object(Bucket=store.config.bucket, Key=key, Body=garbage)
    for call in (lambda: store.claim("p", "m", "me"), lambda: store.renew("p", "m", "me"), lambda: store.release("p", "m", "me")):
        with pytest.raises(StorageError, match=key) as info:
            call()
        assert type(info.value) in (StorageError, ClaimLost) and "\n" not in str(info.value)
    assert seaweed.client().get_object(Bucket=store.config.bucket, Key=key)["Body"].read() == garbage  # left alone


# ------------------------------------------------------------------------------------- push and sweep

def test_a_folder_deleted_mid_push_fails_fast_and_commits_nothing(seaweed, tmp_path):
    direct = store_for(seaweed)
    slow = HTTPFaultProxy("127.0.0.1", seaweed.port, rate_bytes_per_s=1 << 20)
    try:
        store = through(slow, direct, workers=1)
        folder = commit(tmp_path / "m", 1, {"a.bin": 1 << 20, "b.bin": 1 << 20, "c.bin": 1 << 20})
        deleter = threading.Timer(0.4, shutil.rmtree, (folder,))  # retention, while a.bin is uploading
        deleter.start()
        t0 = time.monotonic()
        with pytest.raises(StorageError, match="vanished") as info:
            store.push("p", "m", folder)
        elapsed = time.monotonic() - t0
        deleter.join()
        assert str(folder) in str(info.value) and "step 1" in str(info.value)
        assert elapsed < 5, f"the push should stop at the first missing file, not after {elapsed:.1f} s"
        assert slow.requests("PUT", "/manifest.json") == []  # the commit point was never written
        assert direct.committed_steps("p", "m") == [] and direct.latest("p", "m") is None
        with pytest.raises(StorageError, match="vanished"):  # gone before the push starts: the same error
            store.push("p", "m", folder)
    finally:
        slow.close()


def test_sweep_removes_only_uncommitted_steps_below_latest(seaweed, tmp_path):
    store = store_for(seaweed)
    for step in (1, 2, 4):
        store.push("p", "m", commit(tmp_path / "m", step, {"a.bin": 1000}))
    s3, bucket = seaweed.client(), store.config.bucket
    for step in (0, 3, 5):  # partial uploads: a push that died (3), one in flight (0, kept), the next one (5)
        s3.put_object(Bucket=bucket, Key=f"runs/p/m/checkpoints/{step}/a.bin", Body=b"partial")
        s3.put_object(Bucket=bucket, Key=f"runs/p/m/checkpoints/{step}/optimizer.pt", Body=b"partial")
    s3.put_object(Bucket=bucket, Key="runs/p/m/checkpoints/notastep/x", Body=b"?")  # not ours to judge: left alone

    assert store.sweep_uncommitted("p", "m", keep={0}) == [3]
    left = sorted(o["Key"] for o in s3.list_objects_v2(Bucket=bucket, Prefix="runs/p/m/checkpoints/")["Contents"])
    assert not [k for k in left if k.startswith("runs/p/m/checkpoints/3/")]
    for step in (0, 5):
        assert f"runs/p/m/checkpoints/{step}/a.bin" in left and f"runs/p/m/checkpoints/{step}/optimizer.pt" in left
    assert "runs/p/m/checkpoints/notastep/x" in left
    assert store.committed_steps("p", "m") == [1, 2, 4] and store.latest("p", "m") == 4
    assert (store.pull("p", "m", 2, tmp_path / "out") / "a.bin").stat().st_size == 1000  # committed ones intact
    assert store.sweep_uncommitted("p", "m") == [0]  # no longer kept: swept
    assert store.sweep_uncommitted("p", "m") == []


def test_sweep_without_latest_sweeps_nothing(seaweed):
    store = store_for(seaweed)
    seaweed.client().put_object(Bucket=store.config.bucket, Key="runs/p/m/checkpoints/1/a.bin", Body=b"partial")
    assert store.sweep_uncommitted("p", "m") == []
    assert seaweed.client().list_objects_v2(Bucket=store.config.bucket, Prefix="runs/p/m/")["KeyCount"] == 1

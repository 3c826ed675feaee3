"""Checkpoints on S3 (or R2, MinIO, SeaweedFS, GCS interop): s3://BUCKET/PREFIX/PROJECT/MODEL/checkpoints/STEP/.

The same layout as on disk. A step is committed on S3 by writing its `manifest.json` (size and sha256 of
every file) after all its files; the model's `LATEST` pointer goes up after it (a step with a manifest above
LATEST is committed all the same: `newest`). A reader trusts only committed manifests and checks every
hash, so a half-finished upload is never read. A push uploads only the files that are not already there
with the same sha256 (kept in the object's metadata), in parallel, multipart for large ones, with retries
and backoff on throttling, 5xx and connection errors.

Everything read from the bucket is untrusted: anyone holding its keys (every sandbox does) can write
there. Manifests, LATEST and OWNER are parsed with a size cap and validated completely before anything
acts on them (checkpoints.validate_manifest); a bad one is a StorageError naming the key, never a path
written outside the destination.

boto3 is imported inside the functions: the laptop SDK does not need it.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import socket
import tempfile
import threading
import time
import uuid
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

from tenacity import Retrying, retry_if_exception, stop_after_attempt, wait_exponential_jitter

from artcloud.errors import ArtcloudError
from artcloud.storage import checkpoints

log = logging.getLogger("artcloud.storage")

LATEST = "LATEST"
OWNER = "OWNER"
# The model's live files beside LATEST: its history (artcloud/server/history.py) and its state (model_state.py).
LIVE_FILES = {"history.jsonl": "application/x-ndjson", "state.json": "application/json"}
MAX_POINTER_BYTES = 64 << 10  # LATEST and OWNER are a few dozen bytes


class StorageError(ArtcloudError):
    """S3 cannot be used as configured; the message says what to fix."""

    code = "storage_failed"


class ClaimLost(StorageError):
    """Another server holds (or took over) this model's claim: stop training and pushing it here."""

    code = "claim_lost"


class CorruptRemoteCheckpoint(StorageError, checkpoints.CorruptCheckpoint):
    """A checkpoint on S3 is invalid or does not match its manifest (both a StorageError and a CorruptCheckpoint)."""

    code = "corrupt_remote_checkpoint"


@dataclass(frozen=True)
class S3Config:
    bucket: str
    prefix: str = ""
    endpoint_url: str | None = None
    region: str | None = None
    # None: boto3's own chain (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, profiles, instance roles).
    access_key_id: str | None = field(default=None, repr=False)
    secret_access_key: str | None = field(default=None, repr=False)

    @classmethod
    def from_uri(cls, uri: str, **kwargs: Any) -> "S3Config":
        """`s3://bucket/prefix`, the rest from arguments or ARTCLOUD_S3_ENDPOINT_URL / ARTCLOUD_S3_REGION."""
        if not uri.startswith("s3://") or len(uri) <= 5:
            raise StorageError(f"an S3 location looks like s3://BUCKET/PREFIX, not {uri!r}")
        bucket, _, prefix = uri[5:].partition("/")
        env = os.environ
        kwargs.setdefault("endpoint_url", env.get("ARTCLOUD_S3_ENDPOINT_URL") or env.get("AWS_ENDPOINT_URL"))
        kwargs.setdefault("region", env.get("ARTCLOUD_S3_REGION") or env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION"))
        kwargs.setdefault("access_key_id", env.get("ARTCLOUD_S3_ACCESS_KEY_ID"))
        kwargs.setdefault("secret_access_key", env.get("ARTCLOUD_S3_SECRET_ACCESS_KEY"))
        return cls(bucket=bucket, prefix=prefix.strip("/"), **kwargs)

    @property
    def uri(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}".rstrip("/")


@dataclass
class PushResult:
    step: int
    uploaded_files: int = 0
    uploaded_bytes: int = 0
    skipped_files: int = 0
    seconds: float = 0.0


def _retryable(exc: BaseException) -> bool:
    from botocore.exceptions import ClientError, ConnectionError, HTTPClientError

    # HTTPClientError: a connection closed or reset mid-request, a read timeout (not a ConnectionError).
    if isinstance(exc, (ConnectionError, HTTPClientError)):
        return True
    if isinstance(exc, ClientError):
        status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
        code = exc.response.get("Error", {}).get("Code", "")
        return status >= 500 or status == 429 or code in ("SlowDown", "Throttling", "RequestTimeout")
    return False


ATTEMPTS_ENV = "ARTCLOUD_S3_ATTEMPTS"
DEFAULT_ATTEMPTS = 6  # with the backoff below: about 16 s of waiting before a request's failure stands


def attempts_from_env() -> int:
    """How many times each S3 request is tried: ARTCLOUD_S3_ATTEMPTS (1-20), else DEFAULT_ATTEMPTS."""
    raw = os.environ.get(ATTEMPTS_ENV, "").strip()
    if not raw:
        return DEFAULT_ATTEMPTS
    if not raw.isdigit() or not 1 <= int(raw) <= 20:
        raise StorageError(f"{ATTEMPTS_ENV}={raw!r}: give a whole number of tries from 1 to 20 "
                           f"(the default is {DEFAULT_ATTEMPTS}), or unset it", code="bad_s3_attempts")
    return int(raw)


def _not_found(e: Any) -> bool:  # a botocore ClientError
    return e.response.get("Error", {}).get("Code") in ("NoSuchKey", "404", "NotFound")


class Bucket:
    """One S3 location: its client (made on first use), retries with backoff, bounded reads, a thread pool.
    CheckpointStore and weights.WeightsStore are built on it."""

    def __init__(self, config: S3Config, *, workers: int = 8, attempts: int | None = None):
        self.config = config
        self.workers = workers
        self.attempts = attempts_from_env() if attempts is None else attempts
        self._s3: Any = None

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.config.uri!r})"

    @property
    def s3(self) -> Any:
        if self._s3 is None:
            try:
                import boto3
                from botocore.config import Config
            except ImportError as e:  # a laptop install without the extra: one line, not a traceback
                raise StorageError("S3 needs boto3, which is not installed here: pip install 'artcloud[s3]'") from e

            self._s3 = boto3.client(
                "s3",
                endpoint_url=self.config.endpoint_url,
                region_name=self.config.region or "us-east-1",
                aws_access_key_id=self.config.access_key_id,
                aws_secret_access_key=self.config.secret_access_key,
                # total_max_attempts 1: every retry is ours (_retry, with backoff). botocore's "max_attempts"
                # counts retries, so max_attempts=1 meant a second, hidden try of every request.
                config=Config(s3={"addressing_style": "path"}, retries={"total_max_attempts": 1, "mode": "standard"},
                              max_pool_connections=max(10, self.workers * 2), connect_timeout=10, read_timeout=60),
            )
        return self._s3

    def _retry(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        for attempt in Retrying(stop=stop_after_attempt(self.attempts), wait=wait_exponential_jitter(initial=0.5, max=20),
                                retry=retry_if_exception(_retryable), reraise=True):
            with attempt:
                return fn(*args, **kwargs)

    def _key(self, *parts: str | int) -> str:
        return "/".join(p for p in (self.config.prefix, *map(str, parts)) if p)

    def _url(self, key: str) -> str:
        return f"s3://{self.config.bucket}/{key}"

    def _put(self, key: str, body: bytes, **kwargs: Any) -> None:
        self._retry(self.s3.put_object, Bucket=self.config.bucket, Key=key, Body=body, **kwargs)

    def _delete(self, key: str) -> None:
        self._retry(self.s3.delete_object, Bucket=self.config.bucket, Key=key)

    def _keys(self, prefix: str) -> Iterator[str]:
        for page in self.s3.get_paginator("list_objects_v2").paginate(Bucket=self.config.bucket, Prefix=prefix):
            yield from (obj["Key"] for obj in page.get("Contents", []))

    def _head(self, key: str) -> dict[str, Any] | None:
        from botocore.exceptions import ClientError

        try:
            return self._retry(self.s3.head_object, Bucket=self.config.bucket, Key=key)
        except ClientError as e:
            if e.response.get("ResponseMetadata", {}).get("HTTPStatusCode") == 404:
                return None
            raise

    def _get_object(self, key: str, limit: int) -> tuple[bytes, str] | None:
        """The object's bytes (at most `limit`: a bigger one is refused, not read) and ETag; None if absent."""
        from botocore.exceptions import ClientError

        try:
            obj = self._retry(self.s3.get_object, Bucket=self.config.bucket, Key=key)
        except ClientError as e:
            if _not_found(e):
                return None
            raise
        if int(obj.get("ContentLength") or 0) > limit:
            obj["Body"].close()
            raise StorageError(f"{self._url(key)} is {obj['ContentLength']} bytes, more than {limit}: not reading it")
        body = obj["Body"].read(limit + 1)
        if len(body) > limit:
            raise StorageError(f"{self._url(key)} is more than {limit} bytes: not reading it")
        return body, obj.get("ETag", "")

    def _get_json(self, key: str, limit: int = checkpoints.MAX_MANIFEST_BYTES) -> tuple[Any, str] | None:
        """Parsed JSON (untrusted: the caller validates it) and its ETag, or None if the key is absent."""
        found = self._get_object(key, limit)
        if found is None:
            return None
        try:
            return json.loads(found[0]), found[1]
        except ValueError as e:  # UnicodeDecodeError included
            raise StorageError(f"{self._url(key)} is not valid JSON ({e}): delete or rewrite it") from e

    def check(self) -> None:
        """Fail now, with what to fix, if the bucket cannot be reached, read and written."""
        from botocore.exceptions import ClientError, NoCredentialsError

        where = self.config.uri
        try:
            self._retry(self.s3.head_bucket, Bucket=self.config.bucket)
            self._put(self._key(".artcloud-write-check"), b"ok")
            self._delete(self._key(".artcloud-write-check"))
        except NoCredentialsError as e:
            raise StorageError(f"no S3 credentials for {where}: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY "
                               "(or ARTCLOUD_S3_ACCESS_KEY_ID / ARTCLOUD_S3_SECRET_ACCESS_KEY)") from e
        except ClientError as e:
            status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if status == 404:
                raise StorageError(f"the bucket {self.config.bucket!r} does not exist at "
                                   f"{self.config.endpoint_url or 'AWS'}: create it, or fix the S3 location") from e
            if status in (401, 403):
                raise StorageError(f"S3 refused these credentials for {where} ({e.response['Error'].get('Code')}): "
                                   "check the access key, the secret and the bucket policy") from e
            raise StorageError(f"S3 error on {where}: {e}") from e
        except Exception as e:
            if _retryable(e) or type(e).__name__.endswith("ConnectionError"):
                raise StorageError(f"cannot reach S3 at {self.config.endpoint_url or 'AWS'} for {where}: {e}") from e
            raise

    def _run_all(self, fn: Callable[..., Any], items: list[tuple[Any, ...]], name: str) -> list[Any]:
        """fn(*item) for each item on `self.workers` threads; the first failure cancels what has not
        started and is raised once the running ones end (fail fast, no half-hearted carrying on)."""
        with ThreadPoolExecutor(self.workers, thread_name_prefix=name) as pool:
            futures = [pool.submit(fn, *item) for item in items]
            done, _ = wait(futures, return_when=FIRST_EXCEPTION)
            failed = next((f for f in futures if f in done and f.exception() is not None), None)
            if failed is not None:
                pool.shutdown(wait=True, cancel_futures=True)
                raise failed.exception()  # type: ignore[misc]
        return [f.result() for f in futures]



class CheckpointStore(Bucket):
    """One S3 location holding the checkpoints of any number of models."""

    def __init__(self, config: S3Config, *, workers: int = 8, multipart_mb: int = 16, attempts: int | None = None):
        super().__init__(config, workers=workers, attempts=attempts)
        self.multipart_mb = multipart_mb

    def _step_key(self, project: str, model: str, step: int, name: str = "") -> str:
        return self._key(project, model, "checkpoints", step, name)

    # ------------------------------------------------------------------------------------- ownership

    @staticmethod
    def _owner_record(owner: str) -> dict[str, Any]:
        # A fresh nonce per write: after a lost answer, reading OWNER back says whether this write landed.
        return {"owner": owner, "host": socket.gethostname(), "pid": os.getpid(), "renewed_at": time.time(),
                "nonce": uuid.uuid4().hex}

    def _read_owner(self, key: str) -> tuple[dict[str, Any], str] | None:
        """The OWNER record (validated: it is untrusted JSON) and its ETag, or None if there is none."""
        found = self._get_json(key, MAX_POINTER_BYTES)
        if found is None:
            return None
        record, etag = found
        problem = None
        if not isinstance(record, dict):
            problem = "not a JSON object"
        elif not isinstance(record.get("owner"), str) or not record["owner"]:
            problem = "no 'owner' string"
        elif type(record.get("renewed_at")) not in (int, float) or not math.isfinite(record["renewed_at"]):
            problem = "no numeric 'renewed_at'"
        if problem:
            raise StorageError(f"the claim record {self._url(key)} is not valid ({problem}): if no server is training "
                               "this model, delete it; otherwise stop that server first")
        return record, etag

    def _put_owner(self, key: str, record: dict[str, Any], **condition: str) -> bool:
        """Write OWNER if `condition` (IfNoneMatch / IfMatch) holds; False if another write got there first.

        A conditional put whose answer was lost is retried, and the retry gets 412 for our own write; so
        on 412/409 the record is read back, and a record with our owner and this write's nonce is ours."""
        from botocore.exceptions import ClientError

        try:
            self._put(key, json.dumps(record).encode(), **condition)
            return True
        except ClientError as e:
            if e.response.get("ResponseMetadata", {}).get("HTTPStatusCode") not in (409, 412):
                raise
        found = self._read_owner(key)
        return found is not None and found[0].get("owner") == record["owner"] and found[0].get("nonce") == record["nonce"]

    def claim(self, project: str, model: str, owner: str, stale_after_s: float = 900.0) -> None:
        """Make this server the one writer of PROJECT/MODEL here, or refuse with a StorageError.

        Two servers training the same model would write different step N's over each other. The OWNER
        object is created only if absent (If-None-Match: *) and renewed or taken over only if unchanged
        since read (If-Match: ETag), so of two racing servers exactly one wins; an owner that stopped
        renewing for `stale_after_s` (a dead server) is taken over. Each write carries a fresh nonce, so a
        write whose answer was lost (retried, then 412) is recognised as ours by reading OWNER back. A
        garbage OWNER is a StorageError saying what to do, never taken over silently."""
        key = self._key(project, model, OWNER)
        if self._put_owner(key, self._owner_record(owner), IfNoneMatch="*"):
            return
        found = self._read_owner(key)
        if found is None:  # released between our put and our read: one more try to create it
            if self._put_owner(key, self._owner_record(owner), IfNoneMatch="*"):
                return
            raise StorageError(f"another server claimed {project}/{model} under {self.config.uri} at the same moment")
        record, etag = found
        age = time.time() - float(record["renewed_at"])
        if record["owner"] != owner and age < stale_after_s:
            raise StorageError(
                f"{project}/{model} under {self.config.uri} is being trained by another server "
                f"({record.get('host')}, pid {record.get('pid')}, seen {age:.0f} s ago): stop it, use another S3 "
                f"prefix, or wait until it has been silent for {stale_after_s:.0f} s"
            )
        if not self._put_owner(key, self._owner_record(owner), IfMatch=etag):
            raise StorageError(f"another server claimed {project}/{model} under {self.config.uri} at the same moment")

    def renew(self, project: str, model: str, owner: str) -> None:
        """Renew this server's claim on PROJECT/MODEL (If-Match on the record read), or raise ClaimLost.

        ClaimLost means another owner holds the claim (it took the model over after `stale_after_s` of
        silence from us), or the record is gone: this server must stop training and pushing the model,
        since its steps would overwrite the other writer's. Unlike `claim`, renew never takes over."""
        key = self._key(project, model, OWNER)
        where = f"{project}/{model} under {self.config.uri}"
        found = self._read_owner(key)
        if found is None:
            raise ClaimLost(f"the claim on {where} is gone (released or deleted): this server stops writing it; "
                            "register the model again to resume from S3")
        record, etag = found
        if record["owner"] != owner:
            raise ClaimLost(f"{where} was taken over by another server ({record.get('host')}, pid {record.get('pid')}): "
                            "this server stops training and pushing it")
        if not self._put_owner(key, self._owner_record(owner), IfMatch=etag):
            raise ClaimLost(f"another server took {where} over while this one renewed its claim: "
                            "this server stops training and pushing it")

    def release(self, project: str, model: str, owner: str) -> None:
        """Delete OWNER if it is ours (a garbage record is a StorageError and is left alone)."""
        key = self._key(project, model, OWNER)
        found = self._read_owner(key)
        if found is not None and found[0]["owner"] == owner:
            self._delete(key)

    # ------------------------------------------------------------------------------------- push

    def push(self, project: str, model: str, folder: Path) -> PushResult:
        """Upload a committed local checkpoint folder, manifest last, then move LATEST forward.

        If the folder vanishes while it uploads (retention deleted it locally), the push stops at the
        first missing file with a StorageError saying so, and the manifest is never uploaded: the step
        stays uncommitted on S3 (`sweep_uncommitted` removes what was uploaded)."""
        t0 = time.monotonic()

        def vanished(step: int | str, e: OSError) -> StorageError:
            return StorageError(f"the checkpoint folder {folder} vanished while step {step} of {project}/{model} was "
                                f"being pushed ({e.strerror or e}): step {step} is not committed on S3")

        try:
            manifest = checkpoints.verify(folder, hashes=False)  # hashes were checked when it was written
            body = (folder / checkpoints.MANIFEST).read_bytes()  # the commit point, read while the folder is there
        except (checkpoints.CorruptCheckpoint, OSError) as e:
            if not folder.is_dir():
                raise vanished(folder.name, FileNotFoundError(2, "No such file or directory")) from e
            raise
        step = int(manifest["step"])
        result = PushResult(step=step)
        manifest_key = self._step_key(project, model, step, checkpoints.MANIFEST)
        remote = self._get_json(manifest_key)
        try:  # the files of this step's manifest already on S3, if any: the same files need no push
            remote = remote and checkpoints.validate_manifest(remote[0], self._url(manifest_key), step)["files"]
        except checkpoints.CorruptCheckpoint as e:
            log.warning("%s; pushing over it", e)
            remote = None
        if remote == manifest["files"]:
            result.skipped_files = len(manifest["files"])
        else:
            from boto3.s3.transfer import TransferConfig

            transfer = TransferConfig(multipart_threshold=self.multipart_mb << 20, multipart_chunksize=self.multipart_mb << 20,
                                      max_concurrency=4)

            def upload(name: str, meta: dict[str, Any]) -> int:
                key = self._step_key(project, model, step, name)
                if (self._head(key) or {}).get("Metadata", {}).get("sha256") == meta["sha256"]:
                    return 0
                try:
                    self._retry(self.s3.upload_file, str(folder / name), self.config.bucket, key,
                                ExtraArgs={"Metadata": {"sha256": meta["sha256"]}}, Config=transfer)
                except FileNotFoundError as e:
                    raise vanished(step, e) from e
                return meta["size"]

            sizes = self._run_all(upload, list(manifest["files"].items()), "s3-push")
            if not folder.is_dir():  # deleted after its last file went up: retention wants it gone
                raise vanished(step, FileNotFoundError(2, "No such file or directory"))
            result.uploaded_files = sum(1 for s in sizes if s)
            result.uploaded_bytes = sum(sizes)
            result.skipped_files = len(sizes) - result.uploaded_files
            self._put(manifest_key, body)
        latest = self.latest(project, model)
        if latest is None or latest < step:
            self._put(self._key(project, model, LATEST), json.dumps({"step": step}).encode())
        result.seconds = time.monotonic() - t0
        return result

    def _step_objects(self, project: str, model: str) -> dict[int, list[str]]:
        """Every object key under checkpoints/, by step (keys that are not STEP/NAME are left out)."""
        prefix = self._key(project, model, "checkpoints") + "/"
        steps: dict[int, list[str]] = {}
        for key in self._keys(prefix):
            step, _, name = key[len(prefix):].partition("/")
            if name and checkpoints.STEP_NAME.fullmatch(step):
                steps.setdefault(int(step), []).append(key)
        return steps

    def delete_step(self, project: str, model: str, step: int) -> None:
        """Uncommit a step (its manifest goes first), then delete its files. Never the LATEST step."""
        if step == self.latest(project, model):
            raise StorageError(f"refusing to delete step {step} of {project}/{model}: it is the latest committed one")
        prefix = self._step_key(project, model, step) + "/"
        self._delete(prefix + checkpoints.MANIFEST)
        for key in self._keys(prefix):
            self._delete(key)
        log.info("retention: deleted %s%s", f"s3://{self.config.bucket}/", prefix)

    def sweep_uncommitted(self, project: str, model: str, keep: set[int] | frozenset[int] = frozenset()) -> list[int]:
        """Delete the objects of every step that has no manifest, is below LATEST and is not in `keep`:
        the partial upload of a push that died (or stopped because retention deleted its folder).
        Returns the steps swept, ascending. A step being pushed right now must be in `keep`; a step above
        LATEST is never swept (it may be the next commit, still uploading). No LATEST: nothing is swept."""
        latest = self.latest(project, model)
        if latest is None:
            return []
        objects = self._step_objects(project, model)
        swept = []
        for step in sorted(objects):
            if step >= latest or step in keep:
                continue
            keys = objects[step]
            manifest_key = self._step_key(project, model, step, checkpoints.MANIFEST)
            if manifest_key in keys or self._head(manifest_key) is not None:
                continue  # committed (the second look catches a manifest written since the listing)
            for key in keys:
                self._delete(key)
            swept.append(step)
        if swept:
            log.info("swept uncommitted steps %s of %s/%s from %s", swept, project, model, self.config.uri)
        return swept

    def put_live(self, project: str, model: str, name: str, text: str) -> None:
        """One of the model's live files (LIVE_FILES; the caller holds the claim: one writer)."""
        self._put(self._key(project, model, name), text.encode(), ContentType=LIVE_FILES[name])

    def get_live(self, project: str, model: str, name: str, limit: int) -> str | None:
        """One of the model's live files as text (untrusted: the caller validates it), at most `limit` bytes (a
        bigger one is a StorageError); None if there is none."""
        assert name in LIVE_FILES, name
        found = self._get_object(self._key(project, model, name), limit)
        return None if found is None else found[0].decode(errors="replace")

    # ------------------------------------------------------------------------------------- read

    def latest(self, project: str, model: str) -> int | None:
        """The step LATEST points to (None if there is no LATEST). A garbage pointer is a StorageError."""
        key = self._key(project, model, LATEST)
        found = self._get_json(key, MAX_POINTER_BYTES)
        if found is None:
            return None
        pointer = found[0]
        step = pointer.get("step") if isinstance(pointer, dict) else None
        if type(step) is not int or step < 0:
            raise StorageError(f"the LATEST pointer {self._url(key)} is not valid (expected {{\"step\": N}} with N >= 0, "
                               f"got {checkpoints.short_repr(pointer)}): rewrite it to name a committed step, or delete it")
        return step

    def committed_steps(self, project: str, model: str) -> list[int]:
        return sorted(step for step, keys in self._step_objects(project, model).items()
                      if self._step_key(project, model, step, checkpoints.MANIFEST) in keys)

    def newest(self, project: str, model: str) -> int | None:
        """The newest committed step (None if there is none): LATEST, or a step above it whose manifest is there.
        A step is committed by its manifest; LATEST goes up just after it, so a machine lost between the two
        leaves LATEST one step behind, and a resume that trusted LATEST alone would lose that step."""
        latest = self.latest(project, model)
        above = [step for step in self.committed_steps(project, model) if latest is None or step > latest]
        return above[-1] if above else latest

    def read_manifest(self, project: str, model: str, step: int) -> dict[str, Any] | None:
        """The committed manifest of `step`, validated (checkpoints.validate_manifest: names, sizes,
        hashes, and that it is step `step`'s); None if the step is not committed. A bad manifest raises
        CorruptRemoteCheckpoint naming its key and the bad entry."""
        key = self._step_key(project, model, step, checkpoints.MANIFEST)
        try:
            found = self._get_json(key)
            if found is None:
                return None
            return checkpoints.validate_manifest(found[0], self._url(key), step)
        except (StorageError, checkpoints.CorruptCheckpoint) as e:
            if isinstance(e, CorruptRemoteCheckpoint):
                raise
            raise CorruptRemoteCheckpoint(str(e)) from e

    def pull(self, project: str, model: str, step: int | None, dest: Path,
             on_manifest: Callable[[dict[str, Any]], None] | None = None,
             on_bytes: Callable[[int], None] | None = None) -> Path:
        """Download step (None: the newest committed one) into dest/STEP, every file checked against the committed manifest.

        The manifest is untrusted: it is validated completely (read_manifest) before anything is written,
        so a hostile one (a name like "../../x", an absolute path, a huge count...) raises
        CorruptRemoteCheckpoint and leaves `dest` as it was, not even created. Each file is written only
        inside a fresh temporary folder (its resolved path is checked), stops downloading once it exceeds
        its manifest size, and is checked against its sha256; the folder is then renamed to dest/STEP. A
        failed or corrupt pull leaves nothing behind. A garbage LATEST is a StorageError."""
        if step is None:
            step = self.newest(project, model)
            if step is None:
                raise StorageError(f"no committed checkpoint of {project}/{model} under {self.config.uri}")
        if type(step) is not int or step < 0:
            raise StorageError(f"a step is an integer >= 0, not {step!r}")
        manifest = self.read_manifest(project, model, step)
        if manifest is None:
            raise StorageError(f"step {step} of {project}/{model} is not committed under {self.config.uri}")
        if on_manifest is not None:
            on_manifest(manifest)
        _check_free_space(dest, sum(meta["size"] for meta in manifest["files"].values()), f"step {step} of {project}/{model}")
        dest.mkdir(parents=True, exist_ok=True)
        final = dest / str(step)
        tmp = Path(tempfile.mkdtemp(prefix=f".pull-{step}-", dir=dest))
        try:
            inside = tmp.resolve()

            def download(name: str, meta: dict[str, Any]) -> None:
                target = tmp / name
                if target.resolve().parent != inside:  # belt and braces: names are validated already
                    raise CorruptRemoteCheckpoint(f"step {step} of {project}/{model}: {name!r} would land outside {tmp}")
                key = self._step_key(project, model, step, name)
                self._retry(self.s3.download_file, self.config.bucket, key, str(target),
                            Callback=_SizeGuard(meta["size"], self._url(key), on_bytes))

            self._run_all(download, list(manifest["files"].items()), "s3-pull")
            (tmp / checkpoints.MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True))
            try:
                checkpoints.verify(tmp, step=step)  # sizes and sha256: a corrupted object is refused here
            except checkpoints.CorruptCheckpoint as e:
                raise CorruptRemoteCheckpoint(f"step {step} of {project}/{model} under {self.config.uri}: {e}") from e
            _swap_into_place(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return final


class _SizeGuard:
    """A download progress callback that stops a file once it exceeds its manifest size: an object
    swapped for a huge one must not fill the disk before the sha256 check refuses it."""

    def __init__(self, size: int, url: str, on_bytes: Callable[[int], None] | None):
        self.size, self.url, self.on_bytes = size, url, on_bytes
        self.seen = 0
        self._lock = threading.Lock()  # parts of one file download on several threads

    def __call__(self, n: int) -> None:
        with self._lock:
            self.seen += n
            if self.seen > self.size:
                raise CorruptRemoteCheckpoint(f"{self.url} is larger than the {self.size} bytes its manifest says: "
                                              "not downloading the rest")
        if self.on_bytes is not None:
            self.on_bytes(n)


def _check_free_space(dest: Path, needed: int, what: str) -> None:
    existing = dest
    while not existing.exists() and existing != existing.parent:  # dest itself may not exist yet
        existing = existing.parent
    free = shutil.disk_usage(existing).free
    if needed > free:
        raise StorageError(f"{what} needs {needed / 1e9:.1f} GB but {dest} has {free / 1e9:.1f} GB free: "
                           "free some space or pull elsewhere (--to)")


def _swap_into_place(tmp: Path, dest: Path) -> None:
    """Rename the complete `tmp` to `dest`; an older `dest` is moved aside first, then removed."""
    old = None
    if dest.exists():
        old = dest.with_name(f".{dest.name}.old-{os.getpid()}-{threading.get_ident()}")
        os.rename(dest, old)
    try:
        os.rename(tmp, dest)
    except OSError:
        if old is not None and not dest.exists():
            os.rename(old, dest)
            old = None
        if not dest.is_dir():
            raise
        shutil.rmtree(tmp, ignore_errors=True)  # another process put a complete copy there first: use theirs
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def pull_checkpoint(target: str, *, s3: str | None = None, step: int | None = None, to: Path | None = None,
                    progress: bool = True) -> Path:
    """Download PROJECT/MODEL's checkpoint (the latest committed one unless `step`) from `s3`
    (default $ARTCLOUD_S3) into `to`/STEP (default ./checkpoints/PROJECT/MODEL), verified. The folder
    loads with `peft.PeftModel.from_pretrained(base_model, folder)` as it is."""
    project, _, model = target.partition("/")
    if not project or not model or "/" in model:
        raise StorageError(f"name a model as PROJECT/MODEL, not {target!r}")
    uri = s3 or os.environ.get("ARTCLOUD_S3")
    if not uri:
        raise StorageError("say where the checkpoints are: --s3 s3://BUCKET/PREFIX (or set ARTCLOUD_S3)")
    store = CheckpointStore(S3Config.from_uri(uri))
    dest = to or Path("checkpoints") / project / model
    if not progress:
        return store.pull(project, model, step, dest)
    with transfer_bar(f"pull {target}") as update:
        return store.pull(project, model, step, dest, on_bytes=lambda n: update(advance=n),
                          on_manifest=lambda m: update(total=sum(f["size"] for f in m["files"].values())))


@contextmanager
def transfer_bar(title: str) -> Iterator[Callable[..., None]]:
    """A transient rich progress bar of bytes (rich is imported here); yields its task's update(**fields)."""
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TransferSpeedColumn

    with Progress(TextColumn(f"[bold]{title}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(), transient=True) as bar:
        task = bar.add_task(title, total=None)
        yield lambda **fields: bar.update(task, **fields)

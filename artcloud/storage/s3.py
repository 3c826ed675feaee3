"""Checkpoints on S3 (or R2, MinIO, SeaweedFS, GCS interop): s3://BUCKET/PREFIX/PROJECT/MODEL/checkpoints/STEP/.

The same layout as on disk. A step is committed on S3 by writing its `manifest.json` (size and sha256 of
every file) after all its files, then the model's `LATEST` pointer; a reader trusts only committed
manifests and checks every hash, so a half-finished upload is never read. A push uploads only the files
that are not already there with the same sha256 (kept in the object's metadata), in parallel, multipart
for large ones, with retries and backoff on throttling, 5xx and connection errors.

boto3 is imported inside the functions: the laptop SDK does not need it.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from tenacity import Retrying, retry_if_exception, stop_after_attempt, wait_exponential_jitter

from artcloud.storage import checkpoints

log = logging.getLogger("artcloud.storage")

LATEST = "LATEST"
OWNER = "OWNER"


class StorageError(Exception):
    """S3 cannot be used as configured; the message says what to fix."""


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
    from botocore.exceptions import ClientError, ConnectionError, EndpointConnectionError, ReadTimeoutError

    if isinstance(exc, (ConnectionError, EndpointConnectionError, ReadTimeoutError)):
        return True
    if isinstance(exc, ClientError):
        status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
        code = exc.response.get("Error", {}).get("Code", "")
        return status >= 500 or status == 429 or code in ("SlowDown", "Throttling", "RequestTimeout")
    return False


class CheckpointStore:
    """One S3 location holding the checkpoints of any number of models."""

    def __init__(self, config: S3Config, *, workers: int = 8, multipart_mb: int = 16, attempts: int = 6):
        self.config = config
        self.workers = workers
        self.multipart_mb = multipart_mb
        self.attempts = attempts
        self._s3: Any = None

    def __repr__(self) -> str:
        return f"CheckpointStore({self.config.uri!r})"

    # ------------------------------------------------------------------------------------- plumbing

    @property
    def s3(self) -> Any:
        if self._s3 is None:
            import boto3
            from botocore.config import Config

            self._s3 = boto3.client(
                "s3",
                endpoint_url=self.config.endpoint_url,
                region_name=self.config.region or "us-east-1",
                aws_access_key_id=self.config.access_key_id,
                aws_secret_access_key=self.config.secret_access_key,
                config=Config(s3={"addressing_style": "path"}, retries={"max_attempts": 1},
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

    def _step_key(self, project: str, model: str, step: int, name: str = "") -> str:
        return self._key(project, model, "checkpoints", step, name)

    def _get_json(self, key: str) -> dict[str, Any] | None:
        from botocore.exceptions import ClientError

        try:
            body = self._retry(self.s3.get_object, Bucket=self.config.bucket, Key=key)["Body"].read()
        except ClientError as e:
            if e.response.get("Error", {}).get("Code") in ("NoSuchKey", "404", "NotFound"):
                return None
            raise
        return json.loads(body)

    def check(self) -> None:
        """Fail now, with what to fix, if the bucket cannot be reached, read and written."""
        from botocore.exceptions import ClientError, NoCredentialsError

        where = self.config.uri
        try:
            self._retry(self.s3.head_bucket, Bucket=self.config.bucket)
            probe = self._key(".artcloud-write-check")
            self._retry(self.s3.put_object, Bucket=self.config.bucket, Key=probe, Body=b"ok")
            self._retry(self.s3.delete_object, Bucket=self.config.bucket, Key=probe)
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

    # ------------------------------------------------------------------------------------- ownership

    def claim(self, project: str, model: str, owner: str, stale_after_s: float = 900.0) -> None:
        """Make this server the one writer of PROJECT/MODEL here, or refuse.

        Two servers training the same model would write different step N's over each other. The OWNER
        object is created only if absent (If-None-Match: *) and renewed or taken over only if unchanged
        since read (If-Match: ETag), so of two racing servers exactly one wins; an owner that stopped
        renewing for `stale_after_s` (a dead server) is taken over."""
        from botocore.exceptions import ClientError

        key = self._key(project, model, OWNER)
        now = time.time()
        mine = {"owner": owner, "host": socket.gethostname(), "pid": os.getpid(), "renewed_at": now}
        try:
            self._retry(self.s3.put_object, Bucket=self.config.bucket, Key=key, Body=json.dumps(mine).encode(), IfNoneMatch="*")
            return
        except ClientError as e:
            if e.response.get("ResponseMetadata", {}).get("HTTPStatusCode") not in (409, 412):
                raise
        current = self._retry(self.s3.get_object, Bucket=self.config.bucket, Key=key)
        record = json.loads(current["Body"].read())
        age = now - float(record.get("renewed_at", 0))
        if record.get("owner") != owner and age < stale_after_s:
            raise StorageError(
                f"{project}/{model} under {self.config.uri} is being trained by another server "
                f"({record.get('host')}, pid {record.get('pid')}, seen {age:.0f} s ago): stop it, use another S3 "
                f"prefix, or wait until it has been silent for {stale_after_s:.0f} s"
            )
        try:
            self._retry(self.s3.put_object, Bucket=self.config.bucket, Key=key, Body=json.dumps(mine).encode(),
                        IfMatch=current["ETag"])
        except ClientError as e:
            if e.response.get("ResponseMetadata", {}).get("HTTPStatusCode") in (409, 412):
                raise StorageError(f"another server claimed {project}/{model} under {self.config.uri} at the same moment") from e
            raise

    def release(self, project: str, model: str, owner: str) -> None:
        record = self._get_json(self._key(project, model, OWNER))
        if record is not None and record.get("owner") == owner:
            self._retry(self.s3.delete_object, Bucket=self.config.bucket, Key=self._key(project, model, OWNER))

    # ------------------------------------------------------------------------------------- push

    def push(self, project: str, model: str, folder: Path) -> PushResult:
        """Upload a committed local checkpoint folder, manifest last, then move LATEST forward."""
        t0 = time.monotonic()
        manifest = checkpoints.verify(folder, hashes=False)  # hashes were checked when it was written
        step = int(manifest["step"])
        result = PushResult(step=step)
        remote = self._get_json(self._step_key(project, model, step, checkpoints.MANIFEST))
        if remote is not None and remote.get("files") == manifest["files"]:
            result.skipped_files = len(manifest["files"])
        else:
            from boto3.s3.transfer import TransferConfig

            transfer = TransferConfig(multipart_threshold=self.multipart_mb << 20, multipart_chunksize=self.multipart_mb << 20,
                                      max_concurrency=4)

            def upload(name: str, meta: dict[str, Any]) -> int:
                key = self._step_key(project, model, step, name)
                if self._remote_sha(key) == meta["sha256"]:
                    return 0
                self._retry(self.s3.upload_file, str(folder / name), self.config.bucket, key,
                            ExtraArgs={"Metadata": {"sha256": meta["sha256"]}}, Config=transfer)
                return meta["size"]

            with ThreadPoolExecutor(self.workers, thread_name_prefix="s3-push") as pool:
                sizes = list(pool.map(lambda item: upload(*item), manifest["files"].items()))
            result.uploaded_files = sum(1 for s in sizes if s)
            result.uploaded_bytes = sum(sizes)
            result.skipped_files = len(sizes) - result.uploaded_files
            body = (folder / checkpoints.MANIFEST).read_bytes()  # the commit point
            self._retry(self.s3.put_object, Bucket=self.config.bucket, Key=self._step_key(project, model, step, checkpoints.MANIFEST), Body=body)
        latest = self.latest(project, model)
        if latest is None or latest < step:
            self._retry(self.s3.put_object, Bucket=self.config.bucket, Key=self._key(project, model, LATEST),
                        Body=json.dumps({"step": step}).encode())
        result.seconds = time.monotonic() - t0
        return result

    def _remote_sha(self, key: str) -> str | None:
        from botocore.exceptions import ClientError

        try:
            head = self._retry(self.s3.head_object, Bucket=self.config.bucket, Key=key)
        except ClientError as e:
            if e.response.get("ResponseMetadata", {}).get("HTTPStatusCode") == 404:
                return None
            raise
        return head.get("Metadata", {}).get("sha256")

    def delete_step(self, project: str, model: str, step: int) -> None:
        """Uncommit a step (its manifest goes first), then delete its files. Never the LATEST step."""
        if step == self.latest(project, model):
            raise StorageError(f"refusing to delete step {step} of {project}/{model}: it is the latest committed one")
        prefix = self._step_key(project, model, step) + "/"
        self._retry(self.s3.delete_object, Bucket=self.config.bucket, Key=prefix + checkpoints.MANIFEST)
        paginator = self.s3.get_paginator("list_objects_v2")
        for page in paginator.paginate(Bucket=self.config.bucket, Prefix=prefix):
            for obj in page.get("Contents", []):
                self._retry(self.s3.delete_object, Bucket=self.config.bucket, Key=obj["Key"])
        log.info("retention: deleted %s%s", f"s3://{self.config.bucket}/", prefix)

    # ------------------------------------------------------------------------------------- read

    def latest(self, project: str, model: str) -> int | None:
        pointer = self._get_json(self._key(project, model, LATEST))
        return int(pointer["step"]) if pointer else None

    def committed_steps(self, project: str, model: str) -> list[int]:
        prefix = self._key(project, model, "checkpoints") + "/"
        steps = []
        paginator = self.s3.get_paginator("list_objects_v2")
        for page in paginator.paginate(Bucket=self.config.bucket, Prefix=prefix):
            for obj in page.get("Contents", []):
                rest = obj["Key"][len(prefix):]
                step, _, name = rest.partition("/")
                if name == checkpoints.MANIFEST and step.isdigit():
                    steps.append(int(step))
        return sorted(steps)

    def pull(self, project: str, model: str, step: int | None, dest: Path,
             on_manifest: Callable[[dict[str, Any]], None] | None = None,
             on_bytes: Callable[[int], None] | None = None) -> Path:
        """Download step (None: LATEST) into dest/STEP, every file checked against the committed manifest.
        Written to a temporary folder and renamed: a failed or corrupt pull leaves nothing behind."""
        if step is None:
            step = self.latest(project, model)
            if step is None:
                raise StorageError(f"no committed checkpoint of {project}/{model} under {self.config.uri}")
        manifest = self._get_json(self._step_key(project, model, step, checkpoints.MANIFEST))
        if manifest is None:
            raise StorageError(f"step {step} of {project}/{model} is not committed under {self.config.uri}")
        if on_manifest is not None:
            on_manifest(manifest)
        dest.mkdir(parents=True, exist_ok=True)
        final = dest / str(step)
        tmp = Path(tempfile.mkdtemp(prefix=f".pull-{step}-", dir=dest))
        try:
            def download(name: str) -> None:
                self._retry(self.s3.download_file, self.config.bucket, self._step_key(project, model, step, name), str(tmp / name),
                            Callback=on_bytes)

            with ThreadPoolExecutor(self.workers, thread_name_prefix="s3-pull") as pool:
                list(pool.map(download, manifest["files"]))
            (tmp / checkpoints.MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True))
            checkpoints.verify(tmp)  # sizes and sha256: a corrupted object is refused here
            if final.exists():
                shutil.rmtree(final)
            os.rename(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return final


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
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TransferSpeedColumn

    with Progress(TextColumn(f"[bold]pull {target}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(), transient=True) as bar:
        task = bar.add_task("pull", total=None)
        return store.pull(
            project, model, step, dest,
            on_manifest=lambda m: bar.update(task, total=sum(f["size"] for f in m["files"].values())),
            on_bytes=lambda n: bar.advance(task, n),
        )

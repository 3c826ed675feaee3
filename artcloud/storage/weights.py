"""A base model's weights on the user's own S3: staged once, pulled by every sandbox (cold start).

Layout under the S3 location's prefix (the same bucket as the checkpoints):

    PREFIX/models/ORG--NAME/REVISION/files/PATH      the model's files, as in its hub repository
    PREFIX/models/ORG--NAME/REVISION/manifest.json   {format, model, revision, commit, files: [{path, size, sha256}]}

The manifest is written last: a model without one is not staged (a half-finished upload is never
seen). Staging uploads only what S3 lacks (the sha256 rides in each object's metadata), so staging
again costs a few HEADs.

A pull reads the manifest as untrusted input (anyone holding the bucket's keys, every sandbox does, can
write it) and validates it completely before anything is written: no absolute paths, no `..`, no
hidden or odd names, no unknown fields, sizes in range. Then every file is fetched as ranged GETs of
`chunk_mb` across one pool of `workers` threads (a 5 GB shard is many requests at once, and small files
do not wait behind big ones), written with pwrite into a temporary folder next to the destination,
hashed in order while later chunks still arrive, checked against its size and sha256, and only then is
the folder renamed into place. A corrupt or missing part raises CorruptWeights and removes the
temporary folder: there is never a half-written model folder. A previous pull's folder is reused as it
is when its manifest is the same; otherwise its files whose sha256 still matches are linked, not fetched.

Why our own ranged GETs and not boto3's download_file: as fast (bench/cold_start_weights.py, README's
"What it costs, measured"), and they do what it cannot: hash while downloading (no second sha256 pass, ~10 s
for a 16 GB model), refuse an object whose size differs from the manifest before writing it (the
Content-Range total is checked on every chunk), and share one pool across all files (download_file
parallelises within one file: a folder would need a second pool, up to workers x workers connections).
Why S3 and not a Modal Volume on Modal: README, "Cold start", Weights (one mechanism on every provider).

boto3 and huggingface_hub are imported inside the functions: the laptop SDK needs neither to import this.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from artcloud.storage.checkpoints import check_file, check_header, sha256_file
from artcloud.storage.s3 import Bucket, S3Config, StorageError, _check_free_space, _not_found, _swap_into_place

log = logging.getLogger("artcloud.storage")

Progress = Callable[[int, int], None]  # (done_bytes, total_bytes), from any thread

MODELS = "models"
MANIFEST = "manifest.json"
LOCAL_MANIFEST = ".artcloud-weights.json"  # a pulled folder's copy of its manifest (hidden: loaders skip it)
FORMAT = 1
MAX_FILES = 4096
MAX_TOTAL_SIZE = 8 << 40  # 8 TiB: a 2T-parameter model in bf16 fits
MAX_MANIFEST_BYTES = 4 << 20
MAX_PATH_PARTS = 8
MiB = 1 << 20

# A hub id (ORG/NAME or NAME) and a revision (a branch, tag or commit without "/"): each becomes an S3 key
# part and a local folder name.
_ID_PART = r"[A-Za-z0-9][A-Za-z0-9._-]{0,95}"
MODEL_ID = re.compile(rf"{_ID_PART}(/{_ID_PART})?")
REVISION = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")
# One part of a file's path: no leading dot (so no "." or ".." and no hidden files), no separators.
PATH_PART = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._+=-]{0,199}")
MANIFEST_KEYS = {"format", "model", "revision", "commit", "created_at", "files"}
FILE_KEYS = {"path", "size", "sha256"}


class WeightsError(StorageError):
    """Weights cannot be staged or pulled as asked; the message says what to fix."""

    code = "weights_failed"


class CorruptWeights(WeightsError):
    """Staged weights on S3 are invalid or do not match their manifest: never loaded."""

    code = "corrupt_weights"


def check_model_id(model: str, revision: str = "main") -> None:
    if not isinstance(model, str) or not MODEL_ID.fullmatch(model) or ".." in model or "--" in model:
        raise WeightsError(f"model {model!r} is not a hub id like ORG/NAME (letters, digits, '.', '_', '-')")
    if not isinstance(revision, str) or not REVISION.fullmatch(revision):
        raise WeightsError(f"revision {revision!r} is not a branch, tag or commit name (letters, digits, '.', '_', '-')")


def check_path(path: Any) -> str | None:
    """None if `path` is a safe relative file path (PATH_PART/...), else what is wrong with it."""
    if not isinstance(path, str) or not path:
        return "not a non-empty string"
    if path.startswith("/") or "\\" in path or "\x00" in path:
        return "not a relative path with '/' between its parts"
    parts = path.split("/")
    if len(parts) > MAX_PATH_PARTS:
        return f"more than {MAX_PATH_PARTS} levels deep"
    for part in parts:
        if not PATH_PART.fullmatch(part):
            return (f"part {part!r} is not a plain name (letters, digits, '.', '_', '+', '=', '-'; no leading dot, "
                    "no '..')")
    return None


def validate_manifest(raw: Any, where: str, model: str, revision: str) -> dict[str, Any]:
    """`raw` (parsed JSON from S3 or disk: untrusted) if it is a well-formed weights manifest of
    `model` at `revision`; else CorruptWeights with one line naming `where` and the bad entry."""

    def bad(what: str) -> CorruptWeights:
        return CorruptWeights(f"the weights manifest {where} is invalid: {what}; re-stage the model "
                              f"(artcloud stage-model {model}) or delete that prefix")

    check_header(raw, bad, FORMAT)
    unknown = sorted(set(raw) - MANIFEST_KEYS)
    if unknown:
        raise bad(f"unknown field(s) {unknown[:5]} (this artcloud reads {sorted(MANIFEST_KEYS)})")
    if raw.get("model") != model or raw.get("revision") != revision:
        raise bad(f"it is for {str(raw.get('model'))[:100]!r} at {str(raw.get('revision'))[:100]!r}, not {model!r} at {revision!r}")
    commit = raw.get("commit")
    if commit is not None and (not isinstance(commit, str) or not REVISION.fullmatch(commit)):
        raise bad("'commit' must be a commit name or null")
    files = raw.get("files")
    if not isinstance(files, list) or not files:
        raise bad("'files' must be a non-empty list")
    if len(files) > MAX_FILES:
        raise bad(f"it lists {len(files)} files (at most {MAX_FILES})")
    seen: set[str] = set()
    total = 0
    for i, entry in enumerate(files):
        if not isinstance(entry, dict):
            raise bad(f"files[{i}] must be an object with path, size and sha256")
        unknown = sorted(set(entry) - FILE_KEYS)
        if unknown:
            raise bad(f"files[{i}] has unknown field(s) {unknown[:5]} (a file is {sorted(FILE_KEYS)}; links are not allowed)")
        path = entry.get("path")
        problem = check_path(path)
        if problem:
            raise bad(f"files[{i}] path {str(path)[:80]!r} is {problem}")
        total += check_file(bad, f"files[{i}] ({path})", path, entry, seen)
    folders = {f.rsplit("/", k)[0] for f in seen for k in range(1, f.count("/") + 1)}
    if seen & folders:
        raise bad(f"{sorted(seen & folders)[0]!r} is listed as a file and as a folder")
    if total > MAX_TOTAL_SIZE:
        raise bad(f"its files add up to {total} bytes (at most {MAX_TOTAL_SIZE})")
    return raw


def local_files(folder: Path) -> list[tuple[str, Path]]:
    """(relative path, file) of every file under `folder` that staging takes, sorted. Hidden files and
    folders (.git, .cache, .gitattributes) are left out; symlinks are followed (a Hugging Face cache
    snapshot is symlinks into its blobs). A name a reader would refuse raises WeightsError now."""
    found = []
    for root, dirs, names in os.walk(folder, followlinks=True):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for name in names:
            if name.startswith("."):
                continue
            path = Path(root) / name
            rel = path.relative_to(folder).as_posix()
            problem = check_path(rel)
            if problem:
                raise WeightsError(f"cannot stage {path}: its path {rel!r} is {problem}; rename or remove it")
            if path.is_file():
                found.append((rel, path))
    if not found:
        raise WeightsError(f"{folder} holds no files to stage")
    return sorted(found)


def local_snapshot(model: str, revision: str = "main", *, download: bool = False) -> Path | None:
    """The Hugging Face cache's snapshot folder of `model` at `revision` (HF_HOME / HF_HUB_CACHE), or
    None if it is not cached. With `download`, a missing snapshot is downloaded from the hub first
    (weights in safetensors when the repository has them; not its duplicate formats)."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return Path(snapshot_download(model, revision=revision, local_files_only=True))
    except LocalEntryNotFoundError:
        if not download:
            return None
    from huggingface_hub import HfApi

    names = [s.rfilename for s in HfApi().model_info(model, revision=revision).siblings or []]
    ignore = ["original/*", "*.pth", "*.gguf", "*.onnx", "onnx/*", "*.msgpack", "*.h5", "*.ot", "*.tflite", "coreml/*"]
    if any(n.endswith(".safetensors") for n in names):
        ignore += ["*.bin", "*.pt"]
    return Path(snapshot_download(model, revision=revision, ignore_patterns=ignore))


def _commit_of(folder: Path) -> str | None:
    """The commit a Hugging Face cache snapshot folder is (its name), else None."""
    name = folder.name
    return name if folder.parent.name == "snapshots" and re.fullmatch(r"[0-9a-f]{40}", name) else None


@dataclass
class PullResult:
    folder: Path
    fetched_bytes: int = 0
    reused_bytes: int = 0
    seconds: float = 0.0


class _Reporter:
    """Sums bytes from many threads and calls `progress(done, total)` with a running total."""

    def __init__(self, progress: Progress | None, total: int, done: int = 0):
        self.progress, self.total, self.done = progress, total, done
        self._lock = threading.Lock()
        self(0)

    def __call__(self, n: int) -> None:
        if self.progress is None:
            return
        with self._lock:
            self.done = min(self.total, self.done + n)
            self.progress(self.done, self.total)


class _FileWrite:
    """One file being pulled: chunks land out of order (pwrite), the sha256 advances over the prefix
    that is complete, on whichever thread finished the chunk that extends it."""

    def __init__(self, path: Path, size: int):
        self.path, self.size = path, size
        path.parent.mkdir(parents=True, exist_ok=True)
        # O_EXCL | O_NOFOLLOW: a fresh file in our own temporary folder, never through a link.
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o644)
        os.ftruncate(self.fd, size)
        self.hasher = hashlib.sha256()
        self.hashed = 0
        self.landed: dict[int, int] = {}  # offset -> length of chunks written, not yet hashed
        self._lock = threading.Lock()
        self._hashing = False

    def landed_chunk(self, offset: int, length: int) -> bool:
        """Record a written chunk; hash what is now contiguous. True once the whole file is hashed."""
        with self._lock:
            self.landed[offset] = length
            if self._hashing:
                return False
            self._hashing = True
        with open(self.path, "rb") as f:
            while True:
                with self._lock:
                    length = self.landed.pop(self.hashed, None)
                    if length is None:
                        self._hashing = False
                        return self.hashed == self.size
                f.seek(self.hashed)
                left = length
                while left:
                    block = f.read(min(left, 4 * MiB))
                    if not block:
                        raise CorruptWeights(f"{self.path} is shorter than its chunks said")
                    self.hasher.update(block)
                    left -= len(block)
                self.hashed += length

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class WeightsStore(Bucket):
    """Staged base models under one S3 location (its prefix's `models/`)."""

    def __init__(self, config: S3Config, *, workers: int = 16, chunk_mb: int = 16, attempts: int | None = None):
        if workers < 1 or chunk_mb < 1:
            raise WeightsError("workers and chunk_mb must be at least 1")
        super().__init__(config, workers=workers, attempts=attempts)
        self.chunk = chunk_mb * MiB

    def key_prefix(self, model: str, revision: str = "main") -> str:
        """PREFIX/models/ORG--NAME/REVISION: the manifest is there, the files under files/."""
        check_model_id(model, revision)
        return self._key(MODELS, model.replace("/", "--"), revision)

    def url(self, model: str, revision: str = "main") -> str:
        return self._url(self.key_prefix(model, revision))

    # ------------------------------------------------------------------------------------- read

    def manifest(self, model: str, revision: str = "main") -> dict[str, Any] | None:
        """The validated manifest of `model` at `revision`, or None if it is not (completely) staged."""
        key = f"{self.key_prefix(model, revision)}/{MANIFEST}"
        try:
            found = self._get_json(key, MAX_MANIFEST_BYTES)
        except StorageError as e:  # too big, or not JSON
            raise CorruptWeights(f"{e}; re-stage the model (artcloud stage-model {model}) or delete that prefix") from e
        if found is None:
            return None
        return validate_manifest(found[0], self._url(key), model, revision)

    def pull(self, model: str, dest: Path, revision: str = "main", progress: Progress | None = None,
             manifest: dict[str, Any] | None = None) -> PullResult:
        """Download the staged `model` into `dest` (a folder that then holds exactly its files), verified.

        `manifest`: one already read with `manifest()` (saves a GET). Raises WeightsError if it is not
        staged, CorruptWeights if the manifest or any file is bad; either way `dest` is as it was."""
        t0 = time.monotonic()
        manifest = manifest or self.manifest(model, revision)
        if manifest is None:
            raise WeightsError(f"{model} ({revision}) is not staged under {self.config.uri}: run "
                               f"`artcloud stage-model {model} --s3 {self.config.uri}`")
        files = manifest["files"]
        total = sum(f["size"] for f in files)
        if _same_folder(dest, manifest):
            _Reporter(progress, total, total)
            return PullResult(dest, reused_bytes=total, seconds=time.monotonic() - t0)
        _check_free_space(dest.parent, total, f"{model} ({revision})")
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.pull-", dir=dest.parent))
        result = PullResult(dest)
        try:
            todo = []
            for entry in files:
                target = tmp / entry["path"]
                if not target.resolve().is_relative_to(tmp.resolve()):  # validated already; belt and braces
                    raise CorruptWeights(f"{model}: {entry['path']!r} would land outside {tmp}")
                if _reuse(dest / entry["path"], target, entry):
                    result.reused_bytes += entry["size"]
                else:
                    todo.append(entry)
            result.fetched_bytes = total - result.reused_bytes
            self._fetch(model, revision, tmp, todo, _Reporter(progress, total, result.reused_bytes))
            (tmp / LOCAL_MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True))
            _swap_into_place(tmp, dest)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        result.seconds = time.monotonic() - t0
        log.info("pulled %s (%s) from %s: %.2f GB fetched, %.2f GB reused, %.1f s", model, revision,
                 self.config.uri, result.fetched_bytes / 1e9, result.reused_bytes / 1e9, result.seconds)
        return result

    def _fetch(self, model: str, revision: str, tmp: Path, entries: list[dict[str, Any]], report: _Reporter) -> None:
        """Every entry's chunks as ranged GETs on one pool; each file checked as its last chunk lands."""
        prefix = f"{self.key_prefix(model, revision)}/files/"
        writes: dict[str, _FileWrite] = {}
        jobs: list[tuple[dict[str, Any], int, int]] = []
        try:
            for entry in entries:
                writes[entry["path"]] = _FileWrite(tmp / entry["path"], entry["size"])
                offsets = range(0, entry["size"], self.chunk) if entry["size"] else [0]
                jobs += [(entry, off, min(self.chunk, entry["size"] - off)) for off in offsets]
            # Biggest files first, chunks in order within each: the long pole starts at once.
            jobs.sort(key=lambda j: (-j[0]["size"], j[0]["path"], j[1]))

            def fetch(entry: dict[str, Any], offset: int, length: int) -> None:
                key = prefix + entry["path"]
                write = writes[entry["path"]]
                self._retry(self._get_range, key, write, entry["size"], offset, length)
                report(length)
                if write.landed_chunk(offset, length):
                    digest = write.hasher.hexdigest()
                    if digest != entry["sha256"]:
                        raise CorruptWeights(f"{self._url(key)} does not match its manifest (sha256 "
                                             f"{digest[:12]}..., expected {entry['sha256'][:12]}...): re-stage {model}")

            self._run_all(fetch, jobs, "weights-pull")
        finally:
            for write in writes.values():
                write.close()

    def _get_range(self, key: str, write: _FileWrite, size: int, offset: int, length: int) -> None:
        from botocore.exceptions import ClientError

        url = self._url(key)
        try:
            if size == 0:  # a Range on an empty object is a 416: fetch it whole (it must be empty)
                obj = self.s3.get_object(Bucket=self.config.bucket, Key=key)
            else:
                obj = self.s3.get_object(Bucket=self.config.bucket, Key=key, Range=f"bytes={offset}-{offset + length - 1}")
        except ClientError as e:
            if _not_found(e):
                raise CorruptWeights(f"{url} is missing, though the manifest lists it: re-stage the model") from e
            if e.response.get("ResponseMetadata", {}).get("HTTPStatusCode") == 416:
                raise CorruptWeights(f"{url} is shorter than the {size} bytes its manifest says: re-stage the model") from e
            raise
        body = obj["Body"]
        try:
            whole = int(str(obj.get("ContentRange", "")).rpartition("/")[2] or obj.get("ContentLength", -1))
            if whole != size:
                raise CorruptWeights(f"{url} is {whole} bytes, its manifest says {size}: re-stage the model")
            pos, left = offset, length
            while left:
                block = body.read(min(left, MiB))
                if not block:
                    raise CorruptWeights(f"{url} ended early at byte {pos} (expected {size})")
                os.pwrite(write.fd, block, pos)
                pos += len(block)
                left -= len(block)
            if body.read(1):
                raise CorruptWeights(f"{url} sent more than the range asked for: not trusting it")
        finally:
            body.close()

    # ------------------------------------------------------------------------------------- write

    def stage(self, model: str, folder: Path, revision: str = "main", progress: Progress | None = None,
              commit: str | None = None) -> dict[str, Any]:
        """Upload `folder`'s files (see local_files) as `model` at `revision`, the manifest last; returns it.
        Files already on S3 with the same sha256 are not uploaded again."""
        from boto3.s3.transfer import TransferConfig

        check_model_id(model, revision)
        entries = local_files(folder)
        sizes = {rel: path.stat().st_size for rel, path in entries}
        report = _Reporter(progress, sum(sizes.values()))
        transfer = TransferConfig(multipart_threshold=64 * MiB, multipart_chunksize=64 * MiB, max_concurrency=4)
        prefix = f"{self.key_prefix(model, revision)}/files/"

        def upload(rel: str, path: Path) -> dict[str, Any]:
            digest = sha256_file(path)
            key = prefix + rel
            head = self._head(key)
            if head is not None and head.get("Metadata", {}).get("sha256") == digest and head.get("ContentLength") == sizes[rel]:
                report(sizes[rel])
            else:
                self._retry(self.s3.upload_file, str(path), self.config.bucket, key,
                            ExtraArgs={"Metadata": {"sha256": digest}}, Config=transfer, Callback=report)
            return {"path": rel, "size": sizes[rel], "sha256": digest}

        files = self._run_all(upload, entries, "weights-stage")
        manifest = {"format": FORMAT, "model": model, "revision": revision, "commit": commit or _commit_of(folder),
                    "created_at": time.time(), "files": files}
        validate_manifest(manifest, "(being written)", model, revision)  # what a reader would refuse is never written
        self._put(f"{self.key_prefix(model, revision)}/{MANIFEST}", json.dumps(manifest, indent=1).encode())
        log.info("staged %s (%s) to %s: %d files, %.2f GB", model, revision, self.url(model, revision), len(files),
                 sum(sizes.values()) / 1e9)
        return manifest


def _same_folder(dest: Path, manifest: dict[str, Any]) -> bool:
    """`dest` is a complete earlier pull of this very manifest (its files were verified when written)."""
    try:
        local = json.loads((dest / LOCAL_MANIFEST).read_text())
    except (OSError, ValueError):
        return False
    if not isinstance(local, dict) or local.get("files") != manifest["files"]:
        return False
    for entry in manifest["files"]:
        path = dest / entry["path"]
        if path.is_symlink() or not path.is_file() or path.stat().st_size != entry["size"]:
            return False
    return True


def _reuse(old: Path, target: Path, entry: dict[str, Any]) -> bool:
    """Link (else copy) `old` to `target` if it is a plain file with the entry's size and sha256."""
    try:
        if old.is_symlink() or not old.is_file() or old.stat().st_size != entry["size"] or sha256_file(old) != entry["sha256"]:
            return False
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(old, target)
        except OSError:
            shutil.copyfile(old, target)
        return True
    except OSError:
        return False


"""Checkpoints on disk: ROOT/PROJECT/MODEL/checkpoints/STEP/.

A checkpoint folder holds the adapter (PEFT layout), the optimizer state, `trainer_state.json` (step,
RNG, history) and `manifest.json` (size and sha256 of every other file). It is written under a
temporary name, the manifest last, fsynced, then renamed into place: a folder named STEP always has a
manifest, and a folder without a valid manifest is not a checkpoint (it is ignored, never loaded).
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import math
import os
import re
import shutil
import time
import uuid
from pathlib import Path
from typing import Any, Callable

from artcloud.errors import ArtcloudError, InvalidArgument

log = logging.getLogger("artcloud.checkpoints")

MANIFEST = "manifest.json"
TRAINER_STATE = "trainer_state.json"
FORMAT = 1

# What a manifest may name. A manifest can come from S3, where anyone holding the bucket's keys (every
# sandbox does) can write one: each name becomes a file path on the reader's machine, so it must be one
# plain file name, never a path (no "/", "..", absolute paths, NUL, or names that start with a dot).
FILE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,199}")
SHA256_HEX = re.compile(r"[0-9a-f]{64}")
STEP_NAME = re.compile(r"[0-9]{1,12}")  # a step's folder (or S3 key part); str.isdigit() would take "²"
MAX_FILES = 1000
MAX_FILE_SIZE = 1 << 40  # 1 TiB: far above any adapter or optimizer state
RESERVE_BYTES = 64 << 20  # left free by a commit (_check_room)
MAX_MANIFEST_BYTES = 1 << 20  # MAX_FILES entries of ~300 bytes each fit three times over


class CorruptCheckpoint(ArtcloudError):
    """A checkpoint (or its manifest) is damaged or not what it claims: never load it."""

    code = "corrupt_checkpoint"


class DiskFull(ArtcloudError, OSError):
    """No room for a checkpoint, found before anything was written (errno ENOSPC, as the disk would say)."""

    code = "disk_full"

    def __init__(self, message: str):
        super().__init__(message)
        self.errno, self.strerror = errno.ENOSPC, message


class CheckpointExists(ArtcloudError, FileExistsError):
    """A checkpoint is written once: this step's folder is already there."""

    code = "checkpoint_exists"


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: Path) -> None:
    try:
        _fsync_file(path)
    except OSError:  # some filesystems do not fsync directories; the rename is still atomic
        pass


def write_atomic(path: Path, text: str) -> None:
    """`text` at `path` all at once (a private temporary file beside it, fsynced, then renamed over it): a
    reader never sees half of it, even if this process is killed mid-write."""
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_json_atomic(path: Path, data: Any) -> None:
    write_atomic(path, json.dumps(data, indent=2, sort_keys=True))


def checkpoints_dir(model_dir: Path) -> Path:
    return model_dir / "checkpoints"


def _check_room(root: Path, step: int) -> None:
    """DiskFull before anything is written when the disk cannot take a checkpoint as big as the newest one and
    still keep RESERVE_BYTES free (for the logs and event files a failure writes)."""
    steps = committed_steps(root.parent)
    size = sum(f.stat().st_size for f in (root / str(steps[-1])).iterdir()) if steps else 0
    free = shutil.disk_usage(root).free
    if free < size + RESERVE_BYTES:
        raise DiskFull(f"checkpoint {step} needs about {size / 2**20:.1f} MiB (as big as step "
                       f"{steps[-1] if steps else 0}) and {RESERVE_BYTES >> 20} MiB to spare; the disk has "
                       f"{free / 2**20:.1f} MiB free")


def commit(
    model_dir: Path, step: int, write_files: Callable[[Path], list[str]], trainer_state: dict[str, Any]
) -> Path:
    """Write checkpoint `step`: `write_files(folder)` writes the engine's files and returns their names
    (each one plain file name, see FILE_NAME: a manifest that validate_manifest would refuse is never
    committed; CorruptCheckpoint then, and nothing is left behind)."""
    root = checkpoints_dir(model_dir)
    root.mkdir(parents=True, exist_ok=True)
    final = root / str(step)
    if final.exists():
        raise CheckpointExists(f"checkpoint {final} already exists")
    _check_room(root, step)
    tmp = root / f".tmp-{step}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        names = list(write_files(tmp))
        (tmp / TRAINER_STATE).write_text(json.dumps({**trainer_state, "step": step}, sort_keys=True))
        names.append(TRAINER_STATE)
        files = {}
        for name in sorted(names):
            path = tmp / name
            _fsync_file(path)
            files[name] = {"size": path.stat().st_size, "sha256": sha256_file(path)}
        manifest = {"format": FORMAT, "step": step, "created_at": time.time(), "files": files}
        validate_manifest(manifest, str(final / MANIFEST), step)  # what a reader would refuse is never written
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True))
        _fsync_file(tmp / MANIFEST)
        _fsync_dir(tmp)
        os.rename(tmp, final)
        _fsync_dir(root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def short_repr(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def check_header(manifest: Any, bad: Callable[[str], ArtcloudError], fmt: int = FORMAT) -> None:
    """What a checkpoint's manifest and staged weights' share: a JSON object of format `fmt` whose
    `created_at`, if any, is a number; else bad(what is wrong)."""
    if not isinstance(manifest, dict):
        raise bad(f"expected a JSON object, got {type(manifest).__name__}")
    if manifest.get("format") != fmt:
        raise bad(f"unknown format {short_repr(manifest.get('format'))} (this artcloud reads format {fmt})")
    created = manifest.get("created_at")
    if created is not None and (type(created) not in (int, float) or not math.isfinite(created)):
        raise bad(f"'created_at' must be a number, not {short_repr(created)}")


def check_file(bad: Callable[[str], ArtcloudError], label: str, name: str, meta: Any, seen: set[str]) -> int:
    """One manifest entry (`label` names it in errors): `name` not listed before in `seen` ignoring case (a
    case-insensitive disk, macOS, would merge the two), `meta` an object with an int `size` in
    [0, MAX_FILE_SIZE) and a `sha256` of 64 lowercase hex digits. Returns the size."""
    if name.casefold() in seen:
        raise bad(f"{label} is listed twice (ignoring case)")
    seen.add(name.casefold())
    if not isinstance(meta, dict):
        raise bad(f"{label} must be an object with size and sha256")
    size, digest = meta.get("size"), meta.get("sha256")
    if type(size) is not int or not 0 <= size < MAX_FILE_SIZE:  # type(), not isinstance: True is an int too
        raise bad(f"{label}: 'size' must be an integer in [0, {MAX_FILE_SIZE}), not {short_repr(size)}")
    if not isinstance(digest, str) or not SHA256_HEX.fullmatch(digest):
        raise bad(f"{label}: 'sha256' must be 64 lowercase hex digits, not {short_repr(digest)}")
    return size


def validate_manifest(manifest: Any, where: str, step: int | None = None) -> dict[str, Any]:
    """`manifest` (parsed JSON from disk or S3: untrusted) if it is a well-formed manifest of `step`.

    Checked completely before anything acts on it: the format; `step` an int >= 0 (equal to `step` when
    the caller knows it); `files` a dict of at most MAX_FILES entries, each named by one plain file name
    (FILE_NAME, not the manifest itself), see check_file. Anything else raises CorruptCheckpoint with one
    line naming `where` (the file or S3 key), the step and the bad entry."""
    label = f"manifest {where}" + (f" (step {step})" if step is not None else "")

    def bad(what: str) -> CorruptCheckpoint:
        return CorruptCheckpoint(f"{label} is invalid: {what}; not loading it")

    check_header(manifest, bad)
    found = manifest.get("step")
    if type(found) is not int or found < 0:
        raise bad(f"'step' must be an integer >= 0, not {short_repr(found)}")
    if step is not None and found != step:
        raise bad(f"it says step {found}")
    files = manifest.get("files")
    if not isinstance(files, dict):
        raise bad(f"'files' must be an object, not {type(files).__name__}")
    if len(files) > MAX_FILES:
        raise bad(f"it lists {len(files)} files (at most {MAX_FILES})")
    seen: set[str] = set()
    for name, meta in files.items():
        if not FILE_NAME.fullmatch(name) or name == MANIFEST:
            raise bad(f"file name {short_repr(name)} is not one plain file name (letters, digits, '.', '_', '-'; "
                      "no folders, no leading dot)")
        check_file(bad, f"entry {name!r}", name, meta, seen)
    return manifest


def read_manifest(folder: Path, step: int | None = None) -> dict[str, Any]:
    """The validated manifest of `folder` (see validate_manifest); `step` defaults to the folder's name
    when that is a step number. Raises CorruptCheckpoint."""
    path = folder / MANIFEST
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_MANIFEST_BYTES + 1)
        if len(raw) > MAX_MANIFEST_BYTES:
            raise InvalidArgument(f"larger than {MAX_MANIFEST_BYTES} bytes")
        manifest = json.loads(raw)
    except (OSError, ValueError) as e:
        raise CorruptCheckpoint(f"{folder}: no readable {MANIFEST} ({e})") from e
    if step is None and STEP_NAME.fullmatch(folder.name):
        step = int(folder.name)
    return validate_manifest(manifest, str(path), step)


def verify(folder: Path, *, hashes: bool = True, step: int | None = None) -> dict[str, Any]:
    """The manifest (validated, see read_manifest), after checking every file's size (and sha256 when
    `hashes`)."""
    manifest = read_manifest(folder, step)
    for name, meta in manifest["files"].items():
        path = folder / name
        if not path.is_file() or path.stat().st_size != meta["size"]:
            raise CorruptCheckpoint(f"{folder}: {name} is missing or has the wrong size")
        if hashes and sha256_file(path) != meta["sha256"]:
            raise CorruptCheckpoint(f"{folder}: {name} does not match its sha256 in the manifest")
    return manifest


def committed_steps(model_dir: Path) -> list[int]:
    """Steps whose folder has a manifest, ascending (cheap: no hashing)."""
    root = checkpoints_dir(model_dir)
    if not root.is_dir():
        return []
    steps = []
    for entry in root.iterdir():
        if STEP_NAME.fullmatch(entry.name) and (entry / MANIFEST).is_file():
            steps.append(int(entry.name))
    return sorted(steps)


def latest_valid(model_dir: Path) -> tuple[int, Path] | None:
    """The newest checkpoint that verifies completely; broken newer ones are logged and skipped."""
    for step in reversed(committed_steps(model_dir)):
        folder = checkpoints_dir(model_dir) / str(step)
        try:
            verify(folder)
        except CorruptCheckpoint as e:
            log.warning("skipping checkpoint: %s", e)
            continue
        return step, folder
    return None


def clean_partial(model_dir: Path) -> list[str]:
    """Remove temporary folders left by a crash mid-write; returns their names."""
    root = checkpoints_dir(model_dir)
    removed = []
    if root.is_dir():
        for entry in root.iterdir():
            if entry.name.startswith(".tmp-"):
                shutil.rmtree(entry, ignore_errors=True)
                removed.append(entry.name)
    if removed:
        log.info("removed partial checkpoint folders in %s: %s", root, ", ".join(removed))
    return removed


def set_aside_after(model_dir: Path, step: int) -> list[str]:
    """Move every STEP folder newer than `step` (a broken or unverifiable checkpoint) out of the way,
    to `.invalid-STEP-xxxx`, so the next commit can use its number; nothing is deleted."""
    root = checkpoints_dir(model_dir)
    moved = []
    if root.is_dir():
        for entry in root.iterdir():
            if STEP_NAME.fullmatch(entry.name) and int(entry.name) > step:
                target = root / f".invalid-{entry.name}-{uuid.uuid4().hex[:8]}"
                os.rename(entry, target)
                moved.append(target.name)
    if moved:
        log.warning("set aside checkpoints newer than step %d that did not verify: %s", step, ", ".join(moved))
    return moved


def step_folder(model_dir: Path, step: int) -> Path | None:
    folder = checkpoints_dir(model_dir) / str(step)
    return folder if (folder / MANIFEST).is_file() else None


def read_trainer_state(folder: Path) -> dict[str, Any]:
    return json.loads((folder / TRAINER_STATE).read_text())


def plan_retention(steps: list[int], *, keep_last: int, metric: dict[int, float] | None = None) -> list[int]:
    """The steps to delete: all but the newest `keep_last` and the best step by `metric` (highest value).
    The latest step is never deleted; keep_last <= 0 keeps everything."""
    if keep_last <= 0 or not steps:
        return []
    steps = sorted(steps)
    keep = set(steps[-keep_last:]) | {steps[-1]}
    scored = [s for s in steps if metric and s in metric]
    if scored:
        keep.add(max(scored, key=lambda s: (metric[s], s)))
    return [s for s in steps if s not in keep]


def set_aside(model_dir: Path, step: int) -> Path:
    """A committed checkpoint moved out of the committed namespace (one rename), to be restored or removed."""
    aside = checkpoints_dir(model_dir) / f".tmp-aside-{step}-{uuid.uuid4().hex[:8]}"
    os.rename(checkpoints_dir(model_dir) / str(step), aside)
    return aside


def restore_aside(model_dir: Path, step: int, aside: Path) -> None:
    """Undo set_aside: whatever a failed commit left at `step` goes, the checkpoint set aside comes back."""
    folder = checkpoints_dir(model_dir) / str(step)
    if folder.exists():
        delete(model_dir, step)
    os.rename(aside, folder)


def delete(model_dir: Path, step: int) -> None:
    """Remove a checkpoint: renamed out of the committed namespace first, so no reader sees half of it."""
    folder = checkpoints_dir(model_dir) / str(step)
    doomed = checkpoints_dir(model_dir) / f".tmp-delete-{step}-{uuid.uuid4().hex[:8]}"
    os.rename(folder, doomed)
    shutil.rmtree(doomed, ignore_errors=True)
    log.info("retention: deleted local checkpoint %s", folder)

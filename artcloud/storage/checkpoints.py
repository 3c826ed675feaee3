"""Checkpoints on disk: ROOT/PROJECT/MODEL/checkpoints/STEP/.

A checkpoint folder holds the adapter (PEFT layout), the optimizer state, `trainer_state.json` (step,
RNG, history) and `manifest.json` (size and sha256 of every other file). It is written under a
temporary name, the manifest last, fsynced, then renamed into place: a folder named STEP always has a
manifest, and a folder without a valid manifest is not a checkpoint (it is ignored, never loaded).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import time
import uuid
from pathlib import Path
from typing import Any, Callable

log = logging.getLogger("artcloud.checkpoints")

MANIFEST = "manifest.json"
TRAINER_STATE = "trainer_state.json"
FORMAT = 1


class CorruptCheckpoint(Exception):
    pass


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


def write_json_atomic(path: Path, data: Any) -> None:
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True))
    _fsync_file(tmp)
    os.replace(tmp, path)


def checkpoints_dir(model_dir: Path) -> Path:
    return model_dir / "checkpoints"


def commit(
    model_dir: Path, step: int, write_files: Callable[[Path], list[str]], trainer_state: dict[str, Any]
) -> Path:
    """Write checkpoint `step`: `write_files(folder)` writes the engine's files and returns their names."""
    root = checkpoints_dir(model_dir)
    root.mkdir(parents=True, exist_ok=True)
    final = root / str(step)
    if final.exists():
        raise FileExistsError(f"checkpoint {final} already exists")
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
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True))
        _fsync_file(tmp / MANIFEST)
        _fsync_dir(tmp)
        os.rename(tmp, final)
        _fsync_dir(root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def read_manifest(folder: Path) -> dict[str, Any]:
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError) as e:
        raise CorruptCheckpoint(f"{folder}: no readable {MANIFEST} ({e})") from e
    if manifest.get("format") != FORMAT or not isinstance(manifest.get("files"), dict):
        raise CorruptCheckpoint(f"{folder}: unknown manifest format")
    return manifest


def verify(folder: Path, *, hashes: bool = True) -> dict[str, Any]:
    """The manifest, after checking every file's size (and sha256 when `hashes`)."""
    manifest = read_manifest(folder)
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
        if entry.name.isdigit() and (entry / MANIFEST).is_file():
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
            if entry.name.isdigit() and int(entry.name) > step:
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


def delete(model_dir: Path, step: int) -> None:
    """Remove a checkpoint: renamed out of the committed namespace first, so no reader sees half of it."""
    folder = checkpoints_dir(model_dir) / str(step)
    doomed = checkpoints_dir(model_dir) / f".tmp-delete-{step}-{uuid.uuid4().hex[:8]}"
    os.rename(folder, doomed)
    shutil.rmtree(doomed, ignore_errors=True)
    log.info("retention: deleted local checkpoint %s", folder)

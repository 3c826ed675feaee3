"""Checkpoint folders: atomic commit, manifest verification, skipping broken checkpoints, cleanup."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from artcloud.storage import checkpoints as ck


def _writer(payload: dict[str, bytes]):
    def write_files(folder: Path) -> list[str]:
        for name, data in payload.items():
            (folder / name).write_bytes(data)
        return list(payload)

    return write_files


FILES = {
    "adapter_model.safetensors": bytes(range(256)) * 40,
    "adapter_config.json": b'{"r": 8}',
    "optimizer.pt": b"\x00\x01optimizer-state" * 100,
}


def _commit(model_dir: Path, step: int, files: dict[str, bytes] = FILES, state: dict | None = None) -> Path:
    return ck.commit(model_dir, step, _writer(files), state or {"history": [step]})


def _leftovers(model_dir: Path) -> list[str]:
    return sorted(p.name for p in ck.checkpoints_dir(model_dir).iterdir())


def test_commit_writes_files_state_and_manifest(tmp_path):
    folder = _commit(tmp_path, 3, state={"rng": [1, 2, 3], "step": 999})
    assert folder == tmp_path / "checkpoints" / "3"
    assert folder.is_dir()
    assert sorted(p.name for p in folder.iterdir()) == sorted([*FILES, ck.TRAINER_STATE, ck.MANIFEST])

    state = ck.read_trainer_state(folder)
    assert state == {"rng": [1, 2, 3], "step": 3}  # the committed step wins

    manifest = json.loads((folder / ck.MANIFEST).read_text())
    assert manifest["format"] == ck.FORMAT
    assert manifest["step"] == 3
    assert set(manifest["files"]) == {*FILES, ck.TRAINER_STATE}  # everything but the manifest itself
    for name, meta in manifest["files"].items():
        data = (folder / name).read_bytes()
        assert meta["size"] == len(data)
        assert meta["sha256"] == hashlib.sha256(data).hexdigest()
    for name, data in FILES.items():
        assert (folder / name).read_bytes() == data

    assert ck.verify(folder)["step"] == 3
    assert ck.committed_steps(tmp_path) == [3]
    assert ck.step_folder(tmp_path, 3) == folder
    assert ck.step_folder(tmp_path, 4) is None
    assert ck.latest_valid(tmp_path) == (3, folder)
    assert _leftovers(tmp_path) == ["3"]  # no temporary folder left behind


def test_folder_appears_only_after_commit(tmp_path):
    seen = {}

    def write_files(folder: Path) -> list[str]:
        # While the engine writes, the step folder does not exist yet; only a temporary one does.
        seen["during"] = _leftovers(tmp_path)
        seen["tmp_name"] = folder.name
        (folder / "a.bin").write_bytes(b"x")
        return ["a.bin"]

    ck.commit(tmp_path, 1, write_files, {})
    assert "1" not in seen["during"]
    assert seen["tmp_name"].startswith(".tmp-")
    assert seen["during"] == [seen["tmp_name"]]
    assert _leftovers(tmp_path) == ["1"]


@pytest.mark.parametrize("exc", [RuntimeError("disk full"), KeyboardInterrupt()])
def test_crash_while_writing_leaves_nothing(tmp_path, exc):
    def write_files(folder: Path) -> list[str]:
        (folder / "adapter_model.safetensors").write_bytes(b"half")
        raise exc

    with pytest.raises(type(exc)):
        ck.commit(tmp_path, 5, write_files, {})
    assert not (tmp_path / "checkpoints" / "5").exists()
    assert _leftovers(tmp_path) == []
    assert ck.committed_steps(tmp_path) == []
    assert ck.latest_valid(tmp_path) is None


def test_listed_file_missing_fails_commit_cleanly(tmp_path):
    def write_files(folder: Path) -> list[str]:
        (folder / "a.bin").write_bytes(b"x")
        return ["a.bin", "never-written.bin"]

    with pytest.raises(OSError):
        ck.commit(tmp_path, 2, write_files, {})
    assert _leftovers(tmp_path) == []


def test_commit_existing_step_raises(tmp_path):
    folder = _commit(tmp_path, 4)
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    called = []

    def write_files(f: Path) -> list[str]:
        called.append(f)
        return []

    with pytest.raises(FileExistsError):
        ck.commit(tmp_path, 4, write_files, {})
    assert not called
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before
    assert _leftovers(tmp_path) == ["4"]


def test_a_step_set_aside_comes_back_whole_over_a_failed_replacement(tmp_path):
    """A fork at step 0 sets the model's own step 0 aside, commits the forked one, and on a failure restores it."""
    _commit(tmp_path, 0)
    original = {p.name: p.read_bytes() for p in (ck.checkpoints_dir(tmp_path) / "0").iterdir()}
    aside = ck.set_aside(tmp_path, 0)
    assert ck.committed_steps(tmp_path) == [] and ck.step_folder(tmp_path, 0) is None
    _commit(tmp_path, 0, {"adapter_model.safetensors": b"forked", "adapter_config.json": b"{}"})  # then it fails
    ck.restore_aside(tmp_path, 0, aside)
    assert ck.committed_steps(tmp_path) == [0] and ck.verify(ck.checkpoints_dir(tmp_path) / "0")
    assert {p.name: p.read_bytes() for p in (ck.checkpoints_dir(tmp_path) / "0").iterdir()} == original
    assert _leftovers(tmp_path) == ["0"]
    aside = ck.set_aside(tmp_path, 0)  # nothing was committed over it this time
    ck.restore_aside(tmp_path, 0, aside)
    assert {p.name: p.read_bytes() for p in (ck.checkpoints_dir(tmp_path) / "0").iterdir()} == original


def _flip_byte(path: Path, at: int = 10) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0xFF
    path.write_bytes(bytes(data))


def test_verify_detects_corruption(tmp_path):
    folder = _commit(tmp_path, 1)
    _flip_byte(folder / "adapter_model.safetensors")
    with pytest.raises(ck.CorruptCheckpoint, match="sha256"):
        ck.verify(folder)
    # same size: only the hash catches it
    assert ck.verify(folder, hashes=False)["step"] == 1

    folder2 = _commit(tmp_path, 2)
    p = folder2 / "optimizer.pt"
    p.write_bytes(p.read_bytes()[:-7])
    with pytest.raises(ck.CorruptCheckpoint, match="size"):
        ck.verify(folder2, hashes=False)

    folder3 = _commit(tmp_path, 3)
    (folder3 / "adapter_config.json").unlink()
    with pytest.raises(ck.CorruptCheckpoint, match="missing"):
        ck.verify(folder3)

    folder4 = _commit(tmp_path, 4)
    (folder4 / ck.MANIFEST).write_text("{not json")
    with pytest.raises(ck.CorruptCheckpoint):
        ck.verify(folder4)

    folder5 = _commit(tmp_path, 5)
    m = json.loads((folder5 / ck.MANIFEST).read_text())
    m["format"] = 99
    (folder5 / ck.MANIFEST).write_text(json.dumps(m))
    with pytest.raises(ck.CorruptCheckpoint, match="format"):
        ck.verify(folder5)


def test_latest_valid_skips_broken_newer_checkpoints(tmp_path):
    good = _commit(tmp_path, 1)
    _commit(tmp_path, 2)
    bad_hash = _commit(tmp_path, 3)
    truncated = _commit(tmp_path, 4)
    _flip_byte(bad_hash / "adapter_model.safetensors", at=100)
    p = truncated / "adapter_model.safetensors"
    p.write_bytes(p.read_bytes()[:1000])
    # a newer folder without manifest (a copy that never finished): not a checkpoint at all
    no_manifest = tmp_path / "checkpoints" / "5"
    no_manifest.mkdir()
    for name, data in FILES.items():
        (no_manifest / name).write_bytes(data)

    assert ck.committed_steps(tmp_path) == [1, 2, 3, 4]
    assert ck.step_folder(tmp_path, 5) is None
    assert ck.latest_valid(tmp_path) == (2, tmp_path / "checkpoints" / "2")

    (tmp_path / "checkpoints" / "2" / ck.TRAINER_STATE).write_text('{"step": 2, "evil": true}')
    assert ck.latest_valid(tmp_path) == (1, good)


def test_clean_partial_removes_tmp_folders_only(tmp_path):
    _commit(tmp_path, 1)
    root = ck.checkpoints_dir(tmp_path)
    for name in (".tmp-2-deadbeef", ".tmp-3-cafebabe"):
        (root / name).mkdir()
        (root / name / "adapter_model.safetensors").write_bytes(b"partial")
    (root / "notes.txt").write_text("keep me")

    removed = ck.clean_partial(tmp_path)
    assert sorted(removed) == [".tmp-2-deadbeef", ".tmp-3-cafebabe"]
    assert _leftovers(tmp_path) == ["1", "notes.txt"]
    assert ck.clean_partial(tmp_path) == []
    assert ck.latest_valid(tmp_path)[0] == 1


def test_empty_model_dir(tmp_path):
    assert ck.committed_steps(tmp_path) == []
    assert ck.latest_valid(tmp_path) is None
    assert ck.clean_partial(tmp_path) == []


def test_write_json_atomic(tmp_path):
    path = tmp_path / "state.json"
    ck.write_json_atomic(path, {"a": 1})
    ck.write_json_atomic(path, {"a": 2, "b": [1]})
    assert json.loads(path.read_text()) == {"a": 2, "b": [1]}
    assert [p.name for p in tmp_path.iterdir()] == ["state.json"]


def test_retention_plan_keeps_the_newest_the_best_and_always_the_latest():
    steps = [0, 1, 2, 3, 4, 5]
    assert ck.plan_retention(steps, keep_last=0) == []
    assert ck.plan_retention(steps, keep_last=2) == [0, 1, 2, 3]
    assert ck.plan_retention(steps, keep_last=2, metric={1: 0.9, 2: 0.1, 5: 0.3}) == [0, 2, 3]
    assert ck.plan_retention([7], keep_last=1, metric={7: 0.0}) == []


def _rewrite_manifest(folder: Path, edit) -> None:
    manifest = json.loads((folder / ck.MANIFEST).read_text())
    edit(manifest)
    (folder / ck.MANIFEST).write_text(json.dumps(manifest))


@pytest.mark.parametrize("edit, named", [
    (lambda m: m["files"].update({"../../escape": {"size": 1, "sha256": "0" * 64}}), "'../../escape'"),
    (lambda m: m["files"].update({"/etc/passwd": {"size": 1, "sha256": "0" * 64}}), "'/etc/passwd'"),
    (lambda m: m["files"]["optimizer.pt"].update(size=-1), "'size'"),
    (lambda m: m["files"]["optimizer.pt"].update(sha256="xyz"), "'sha256'"),
    (lambda m: m.update(step=4), "says step 4"),
    (lambda m: m.update(step="3"), "'step'"),
], ids=["parent", "absolute", "negative-size", "bad-sha", "other-step", "str-step"])
def test_a_local_manifest_is_validated_like_a_remote_one(tmp_path, edit, named):
    folder = _commit(tmp_path, 3)
    _rewrite_manifest(folder, edit)
    with pytest.raises(ck.CorruptCheckpoint) as info:
        ck.verify(folder, hashes=False)
    assert str(folder / ck.MANIFEST) in str(info.value) and "(step 3)" in str(info.value) and named in str(info.value)
    assert ck.latest_valid(tmp_path) is None  # skipped, never loaded


def test_commit_refuses_a_file_name_a_reader_would_refuse(tmp_path):
    with pytest.raises(ck.CorruptCheckpoint, match="'.hidden'"):
        ck.commit(tmp_path, 1, _writer({".hidden": b"x"}), {})
    assert _leftovers(tmp_path) == []


def test_step_folders_are_ascii_digits_only(tmp_path):
    _commit(tmp_path, 2)
    odd = ck.checkpoints_dir(tmp_path) / "²"  # "²".isdigit() is True, int("²") raises
    odd.mkdir()
    (odd / ck.MANIFEST).write_text("{}")
    assert ck.committed_steps(tmp_path) == [2]
    assert ck.set_aside_after(tmp_path, 2) == []


def test_commit_refuses_a_step_the_disk_has_no_room_for_before_writing_anything(tmp_path, monkeypatch):
    """A full disk is found before the first byte of a step: ENOSPC naming the sizes, and nothing left behind
    (the step as big as the newest one, plus RESERVE_BYTES for the logs and events that follow)."""
    import errno
    import shutil

    _commit(tmp_path, 0)
    size = sum(f.stat().st_size for f in (tmp_path / "checkpoints" / "0").iterdir())
    free = {"bytes": size + ck.RESERVE_BYTES - 1}
    monkeypatch.setattr(ck.shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(1 << 40, 0, free["bytes"]))
    called = []
    with pytest.raises(ck.DiskFull) as e:
        ck.commit(tmp_path, 1, lambda folder: called.append(folder) or [], {})
    assert e.value.errno == errno.ENOSPC and isinstance(e.value, OSError) and not called
    assert f"checkpoint 1 needs about {size / 2**20:.1f} MiB (as big as step 0) and 64 MiB to spare; the disk has " \
           f"{free['bytes'] / 2**20:.1f} MiB free" in str(e.value)
    assert _leftovers(tmp_path) == ["0"]
    free["bytes"] += 1
    assert _commit(tmp_path, 1).name == "1"

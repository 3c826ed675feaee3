"""Job event logs (NDJSON on disk, reload after a crash, cursors) and per-launch TLS."""

from __future__ import annotations

import asyncio
import errno
import json
import os
import socket
import ssl
import stat
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from artcloud import tls
from artcloud.server import train_body
from artcloud.server.jobs import JobStore
from artcloud.wire import Event

# ------------------------------------------------------------------------------------------ jobs


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_events_are_on_disk_as_ndjson(tmp_path):
    store = JobStore("m", tmp_path)
    job = store.create(idempotency_key="k1", body_hash="ab" * 32)
    assert job.status == "queued" and not job.done
    job.emit("queued")
    job.emit("start", step=1)
    assert job.status == "running"
    job.emit("step", loss=0.5)
    path = tmp_path / f"{job.id}.events.jsonl"
    on_disk = _lines(path)
    assert [e["seq"] for e in on_disk] == [1, 2, 3]
    assert [e["type"] for e in on_disk] == ["queued", "start", "step"]
    assert on_disk[2]["data"] == {"loss": 0.5}
    assert all(e["job_id"] == job.id for e in on_disk)
    assert [Event.model_validate(e) for e in on_disk] == job.events
    job.emit("end", step=1)
    assert job.done and job.status == "succeeded"
    with pytest.raises(RuntimeError):
        job.emit("step")
    assert len(_lines(path)) == 4
    meta = json.loads((tmp_path / f"{job.id}.json").read_text())
    assert meta["idempotency_key"] == "k1" and meta["request_sha256"] == "ab" * 32


def test_request_hash_ignores_key_order_and_the_idempotency_key():
    def hashed(body: dict) -> str:
        return train_body.parse(json.dumps(body).encode())[1]

    turn = {"role": "user", "content": "hi"}
    body = {"groups": [{"trajectories": [{"messages_and_choices": [turn], "reward": 1.0}]}], "config": {"learning_rate": 1e-5}}
    reordered = {"config": {"learning_rate": 1e-5}, "groups": [{"trajectories": [{"reward": 1.0, "messages_and_choices": [turn]}]}]}
    assert hashed(body) == hashed(reordered) == hashed({**body, "idempotency_key": "k"})
    assert hashed(body) != hashed({**body, "config": {"learning_rate": 2e-5}})


def test_reload_marks_unfinished_jobs_interrupted(tmp_path):
    store = JobStore("m", tmp_path)
    finished = store.create(idempotency_key="done-key", body_hash="h1")
    finished.emit("start")
    finished.emit("end", step=1)
    running = store.create(idempotency_key="run-key", body_hash="h2")
    running.emit("start")
    running.emit("step", loss=1.0)
    queued = store.create(idempotency_key=None, body_hash="h3")  # no events at all

    again = JobStore("m", tmp_path)
    again.load()
    assert set(again.jobs) == {finished.id, running.id, queued.id}

    f = again.jobs[finished.id]
    assert f.status == "succeeded"
    assert [e.model_dump() for e in f.events] == [e.model_dump() for e in finished.events]

    r = again.jobs[running.id]
    assert r.status == "failed" and r.done
    assert [e.type for e in r.events] == ["start", "step", "error"]
    assert r.events[-1].seq == 3
    assert r.events[-1].data["code"] == "interrupted"
    assert _lines(tmp_path / f"{running.id}.events.jsonl")[-1]["data"]["code"] == "interrupted"

    q = again.jobs[queued.id]
    assert [e.type for e in q.events] == ["error"] and q.events[0].data["code"] == "interrupted"

    assert again.find_by_key("done-key").id == finished.id
    assert again.find_by_key("run-key").id == running.id
    assert again.find_by_key("nope") is None

    # Loading a third time changes nothing: the interrupted job is finished now.
    third = JobStore("m", tmp_path)
    third.load()
    assert [e.type for e in third.jobs[running.id].events] == ["start", "step", "error"]


def test_reload_tolerates_torn_last_line(tmp_path):
    store = JobStore("m", tmp_path)
    job = store.create(idempotency_key="k", body_hash="h")
    job.emit("start")
    job.emit("step", loss=0.25)
    path = tmp_path / f"{job.id}.events.jsonl"
    with open(path, "a") as f:
        f.write('{"seq": 3, "type": "step", "job_id": "' + job.id + '", "ti')  # crash mid-write

    again = JobStore("m", tmp_path)
    again.load()
    j = again.jobs[job.id]
    assert [e.type for e in j.events] == ["start", "step", "error"]
    assert [e.seq for e in j.events] == [1, 2, 3]
    assert j.events[1].data == {"loss": 0.25}
    # the file is clean NDJSON again, continuing where the intact events ended
    on_disk = _lines(path)
    assert [e["seq"] for e in on_disk] == [1, 2, 3]
    assert on_disk[-1]["data"]["code"] == "interrupted"
    assert again.find_by_key("k") is j


def test_reload_skips_unreadable_meta_and_missing_folder(tmp_path):
    JobStore("m", tmp_path / "absent").load()  # no folder: nothing to do, no error
    store = JobStore("m", tmp_path)
    job = store.create(idempotency_key=None, body_hash="h")
    job.emit("end")
    (tmp_path / "broken.json").write_text("{half")
    again = JobStore("m", tmp_path)
    again.load()
    assert list(again.jobs) == [job.id]


def test_follow_after_cursor(tmp_path):
    job = JobStore("m", tmp_path).create(idempotency_key=None, body_hash="h")
    job.emit("queued")
    job.emit("start")
    job.emit("step", n=1)

    async def collect(after, follow=False):
        return [e async for e in job.follow(after, follow=follow)]

    assert [e.seq for e in asyncio.run(collect(0))] == [1, 2, 3]
    assert [e.seq for e in asyncio.run(collect(2))] == [3]
    assert asyncio.run(collect(3)) == []
    assert asyncio.run(collect(10)) == []


def test_follow_waits_for_new_events_until_the_end(tmp_path):
    job = JobStore("m", tmp_path).create(idempotency_key=None, body_hash="h")
    job.emit("start")

    async def main():
        got = []

        async def reader():
            async for e in job.follow(1, follow=True, heartbeat_s=0.05):
                got.append(e)

        task = asyncio.create_task(reader())
        await asyncio.sleep(0.12)  # nothing new: heartbeats (None)
        job.emit("step", n=1)
        await asyncio.sleep(0.01)
        job.emit("step", n=2)
        job.emit("end")
        await asyncio.wait_for(task, 5)
        return got

    got = asyncio.run(main())
    events = [e for e in got if e is not None]
    assert [e.seq for e in events] == [2, 3, 4]
    assert events[-1].type == "end"
    assert got[0] is None  # at least one keep-alive while nothing happened


def test_an_event_whose_log_cannot_be_written_still_reaches_readers_and_the_file_catches_up(tmp_path):
    """A full disk or no descriptor left must not lose an event, nor end the job's error handling: the event
    stays in memory, and the next write that works adds every event the file misses, in order."""
    store = JobStore("m", tmp_path)
    job = store.create(idempotency_key=None, body_hash="h")
    job.emit("queued")
    path = tmp_path / f"{job.id}.events.jsonl"
    path.rename(tmp_path / "aside")
    path.mkdir()  # opening it to append now fails (IsADirectoryError), even as root
    job.emit("start", step=0)
    job.emit("step", loss=0.5)
    assert [e.type for e in job.events] == ["queued", "start", "step"] and job.status == "running"
    assert [e["type"] for e in _lines(tmp_path / "aside")] == ["queued"]
    path.rmdir()
    (tmp_path / "aside").rename(path)
    job.emit("end", step=1)
    assert [(e["seq"], e["type"]) for e in _lines(path)] == [(1, "queued"), (2, "start"), (3, "step"), (4, "end")]


def test_an_event_cut_off_by_a_full_disk_leaves_no_torn_line(tmp_path):
    """RLIMIT_FSIZE a few bytes past the file's end (in a child process): the next event's write stops half-way.
    It is cut back off, and once there is room the file gets it whole, then the next: nothing lost on reload."""
    script = textwrap.dedent(f"""
        import resource
        from artcloud.server.jobs import JobStore
        job = JobStore("m", __import__("pathlib").Path({str(tmp_path)!r})).create(idempotency_key=None, body_hash="h")
        job.emit("queued")
        size = job._path.stat().st_size
        resource.setrlimit(resource.RLIMIT_FSIZE, (size + 10, resource.RLIM_INFINITY))
        job.emit("start", step=0)
        assert job._path.stat().st_size == size, "a torn line was left"
        resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
        job.emit("end", step=1)
    """)
    subprocess.run([sys.executable, "-c", script], check=True, timeout=60)
    (events_file,) = tmp_path.glob("*.events.jsonl")
    assert [(e["seq"], e["type"]) for e in _lines(events_file)] == [(1, "queued"), (2, "start"), (3, "end")]
    store = JobStore("m", tmp_path)
    store.load()
    assert [e.type for e in next(iter(store.jobs.values())).events] == ["queued", "start", "end"]


def test_a_job_that_cannot_be_recorded_is_refused_with_its_cause(tmp_path):
    from artcloud.server.api_errors import ApiError

    store = JobStore("m", tmp_path / "jobs")
    (tmp_path / "jobs").write_text("not a folder")
    with pytest.raises(ApiError) as e:
        store.create(idempotency_key=None, body_hash="h")
    assert e.value.status == 503 and e.value.code == "io_error" and "retry once it has room" in e.value.message


@pytest.mark.parametrize("error, code", [
    (OSError(errno.ENOSPC, "No space left on device"), "disk_full"),
    (OSError(errno.EFBIG, "File too large"), "disk_full"),
    (OSError(errno.EMFILE, "Too many open files"), "too_many_open_files"),
    (OSError(errno.EIO, "Input/output error"), "io_error"),
    (type("SafetensorError", (Exception,), {})("Error while serializing: I/O error: File too large (os error 27)"), "disk_full"),
    (RuntimeError("the step failed"), "internal_error"),
])
def test_a_failure_is_named_by_the_os_error_behind_it(error, code):
    from artcloud.server.jobs import os_cause

    assert os_cause(error) == code
    try:  # the cause of a wrapping exception counts too
        raise RuntimeError("save_pretrained failed") from error
    except RuntimeError as wrapped:
        assert os_cause(wrapped) == code


def test_the_fsync_thread_outlives_a_failing_fsync_and_a_dead_one_is_started_again(tmp_path, monkeypatch):
    from artcloud.server import jobs

    syncer = jobs._Syncer(every_s=0.05)
    path = tmp_path / "events.jsonl"
    path.write_text("{}\n")
    failed, synced = threading.Event(), threading.Event()

    def fsync(fd: int) -> None:
        if not failed.is_set():
            failed.set()
            raise OSError(errno.EIO, "Input/output error")
        synced.set()

    monkeypatch.setattr(jobs.os, "fsync", fsync)
    syncer.mark(path)
    assert failed.wait(10)
    syncer.mark(path)  # written again: fsynced by the same thread, which went on
    assert synced.wait(10) and syncer._thread.is_alive()
    dead = threading.Thread(target=lambda: None)
    dead.start()
    dead.join()
    syncer._thread = dead
    syncer.mark(path)
    assert syncer._thread is not dead and syncer._thread.is_alive()


# ------------------------------------------------------------------------------------------ tls


@pytest.fixture(scope="module")
def secrets_():
    return tls.make_launch_secrets(hosts=["artcloud.example", "10.9.8.7"])


class _TLSServer:
    """A loopback TLS server that completes handshakes and echoes one line."""

    def __init__(self, cert: Path, key: Path):
        self.ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self.ctx.load_cert_chain(cert, key)
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.sock.settimeout(0.2)
        self.port = self.sock.getsockname()[1]
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self):
        while not self.stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            conn.settimeout(5)
            try:
                with self.ctx.wrap_socket(conn, server_side=True) as s:
                    s.sendall(s.recv(64))
            except (ssl.SSLError, OSError):
                pass  # the client refused us: that is what some tests want
            finally:
                conn.close()

    def close(self):
        self.stop.set()
        self.thread.join(5)
        self.sock.close()


@pytest.fixture(scope="module")
def tls_server(secrets_, tmp_path_factory):
    paths = secrets_.write(tmp_path_factory.mktemp("tls") / "secrets")
    server = _TLSServer(paths.server_cert, paths.server_key)
    yield server, paths
    server.close()


def _talk(ctx: ssl.SSLContext, port: int, server_hostname: str) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as raw:
        with ctx.wrap_socket(raw, server_hostname=server_hostname) as s:
            s.sendall(b"ping\n")
            return s.recv(64)


@pytest.mark.parametrize("hostname", ["localhost", "127.0.0.1", "artcloud.example", "10.9.8.7"])
def test_launch_ca_verifies_server(secrets_, tls_server, hostname):
    server, paths = tls_server
    assert _talk(tls.client_ssl_context(secrets_.ca_cert), server.port, hostname) == b"ping\n"


def test_client_context_from_ca_file(tls_server):
    server, paths = tls_server
    assert _talk(tls.client_ssl_context(paths.ca_cert), server.port, "localhost") == b"ping\n"
    assert _talk(tls.client_ssl_context(str(paths.ca_cert)), server.port, "127.0.0.1") == b"ping\n"


def test_other_ca_is_refused(tls_server):
    server, _ = tls_server
    stranger = tls.make_launch_secrets()
    with pytest.raises(ssl.SSLCertVerificationError):
        _talk(tls.client_ssl_context(stranger.ca_cert), server.port, "localhost")


def test_wrong_hostname_is_refused(secrets_, tls_server):
    server, _ = tls_server
    with pytest.raises(ssl.SSLCertVerificationError):
        _talk(tls.client_ssl_context(secrets_.ca_cert), server.port, "evil.example")


def test_system_cas_are_not_trusted(secrets_):
    ctx = tls.client_ssl_context(secrets_.ca_cert)
    assert len(ctx.get_ca_certs()) == 1
    assert ctx.verify_mode == ssl.CERT_REQUIRED and ctx.check_hostname


def test_repr_hides_key_and_token(secrets_):
    text = repr(secrets_) + str(secrets_)
    key_body = "".join(secrets_.server_key.strip().splitlines()[1:-1])
    assert secrets_.token not in text
    assert "PRIVATE KEY" not in text
    assert key_body[:40] not in text.replace("\\n", "")
    assert len(secrets_.token) >= 32


def test_write_modes(secrets_, tmp_path):
    folder = tmp_path / "s"
    paths = secrets_.write(folder)
    mode = lambda p: stat.S_IMODE(os.stat(p).st_mode)  # noqa: E731
    assert mode(paths.server_key) == 0o600
    assert mode(paths.token) == 0o600
    assert mode(paths.ca_cert) == 0o644 and mode(paths.server_cert) == 0o644
    assert mode(folder) & 0o077 == 0
    assert paths.token.read_text() == secrets_.token
    assert paths.server_key.read_text() == secrets_.server_key
    assert paths.ca_cert.read_text() == secrets_.ca_cert
    # rewriting over looser files tightens them again, and leaves no temporary files
    os.chmod(paths.server_key, 0o644)
    secrets_.write(folder)
    assert mode(paths.server_key) == 0o600
    assert sorted(p.name for p in folder.iterdir()) == ["ca.pem", "server.key", "server.pem", "token"]


def test_keys_go_only_into_a_private_folder_and_never_through_a_link(secrets_, tmp_path):
    """Security review 9: a folder others may read or write, or one that is a link, is refused in one line; a
    link where a key goes is replaced, never followed (nothing is written where it points)."""
    loose = tmp_path / "loose"
    loose.mkdir(mode=0o755)
    os.chmod(loose, 0o755)
    with pytest.raises(tls.UnsafeFolder, match=r"is open to others \(mode 755, owner uid \d+\): `chmod 700 "):
        secrets_.write(loose)
    assert list(loose.iterdir()) == []
    (tmp_path / "elsewhere").mkdir(mode=0o700)
    (tmp_path / "linked").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(tls.UnsafeFolder, match="is a link or not a folder"):
        secrets_.write(tmp_path / "linked")
    (tmp_path / "a-file").write_text("")
    with pytest.raises(tls.UnsafeFolder, match="is a link or not a folder"):
        secrets_.write(tmp_path / "a-file")
    folder = tmp_path / "own"
    folder.mkdir(mode=0o700)
    bait = tmp_path / "bait"
    bait.write_text("not a key")
    (folder / "server.key").symlink_to(bait)
    paths = secrets_.write(folder)
    assert bait.read_text() == "not a key" and not paths.server_key.is_symlink()
    assert paths.server_key.read_text() == secrets_.server_key and stat.S_IMODE(paths.server_key.stat().st_mode) == 0o600


def test_serve_refuses_to_write_a_launchers_key_into_a_folder_open_to_others(tmp_path):
    from test_cli import one_line_error, serve

    made = tls.make_launch_secrets()
    (tmp_path / "d" / ".tls").mkdir(parents=True)
    os.chmod(tmp_path / "d" / ".tls", 0o755)
    result = serve("--path", str(tmp_path / "d"), "--port", "0",
                   env={"ARTCLOUD_TLS_CERT": made.server_cert, "ARTCLOUD_TLS_KEY": made.server_key, "ARTCLOUD_TOKEN": made.token})
    one_line_error(result, ".tls is open to others (mode 755", "chmod 700")
    assert not (tmp_path / "d" / ".tls" / "server.key").exists()


def test_each_launch_is_new():
    a, b = tls.make_launch_secrets(), tls.make_launch_secrets()
    assert a.token != b.token and a.ca_cert != b.ca_cert and a.server_key != b.server_key

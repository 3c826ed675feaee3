"""The fake Modal control plane (tests/modal_fake/) against the REAL `modal` client (1.6.4).

Reuse: `from modal_fake import FakeModal` (tests/ is on sys.path, as for `helpers`), then a fixture like
`modal_fake` below: `FakeModal(tmp).start()`, `fake.install(monkeypatch)` (sets `fake.env()` and forgets the
`modal` client this process cached for another server), `fake.stop()` and `FakeModal.forget_env_client()` at
the end. One fake per module is cheapest; a client in a subprocess gets `{**os.environ, **fake.env()}`.
"""

from __future__ import annotations

import asyncio
import hashlib
import http.client
import json
import math
import os
import signal
import socket
import ssl
import subprocess
import sys
import textwrap
import time
import urllib.error
import urllib.request
from pathlib import Path

import modal  # a dev dependency (pinned): a missing install fails here, it is never skipped
import pytest
from modal.exception import (
    AuthError,
    InvalidError,
    NotFoundError,
    ResourceExhaustedError,
    SandboxTimeoutError,
    UnimplementedError,
)
from modal_fake import FakeModal

HTTP_SERVER = ('echo started; echo to-stderr >&2; sleep 1; '
               'exec python -m http.server --bind 127.0.0.1 "${ARTCLOUD_PORT:-8443}"')


@pytest.fixture(scope="module")
def modal_fake(tmp_path_factory):
    """One fake control plane for the module, the client pointed at it through the environment."""
    fake = FakeModal(tmp_path_factory.mktemp("modal")).start()
    with pytest.MonkeyPatch.context() as mp:
        fake.install(mp)  # MODAL_SERVER_URL, tokens, config path; forgets a cached modal client
        try:
            yield fake
        finally:
            fake.stop()
            FakeModal.forget_env_client()
    assert fake.live_pids() == []


@pytest.fixture(scope="module")
def app(modal_fake):
    return modal.App.lookup("artcloud", create_if_missing=True)


def _get(url: str, ca_pem: str, timeout: float = 20.0) -> int:
    """GET through the tunnel until it answers (it is open before the server listens)."""
    ctx = ssl.create_default_context(cadata=ca_pem)
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(url, context=ctx, timeout=5) as r:
                return r.status
        except (OSError, http.client.HTTPException) as e:
            if time.monotonic() > deadline:
                raise AssertionError(f"{url} did not answer in {timeout} s: {e!r}") from e
            time.sleep(0.1)


def _client_env(fake: FakeModal) -> dict[str, str]:
    return {**os.environ, **fake.env()}


def test_unimplemented_call_fails_loudly(modal_fake):
    with pytest.raises(UnimplementedError, match="FakeModal does not implement VolumeGetOrCreate"):
        modal.Volume.from_name("data", create_if_missing=True).hydrate()
    assert modal_fake.calls("VolumeGetOrCreate")[-1]["unimplemented"] is True


def test_app_lookup_without_create_is_not_found(modal_fake):
    with pytest.raises(NotFoundError, match="App 'nope' not found"):
        modal.App.lookup("nope")


def test_gpu_strings(modal_fake, app):
    # 1.6.4's client only parses ":COUNT" and upper-cases the type (_utils/function_utils.py:655-667); which
    # types and counts exist is Modal's server's (its docs): the fake does not pretend to know, and accepts them
    with pytest.raises(InvalidError, match="Invalid GPU count"):
        modal.Sandbox.create("true", app=app, gpu="H100:two")
    assert modal_fake.calls("SandboxCreate") == []  # refused before anything was sent
    sb = modal.Sandbox.create("true", app=app, gpu="a10g:2", timeout=30)
    sb.wait(raise_on_termination=False)
    assert modal_fake.calls("SandboxCreate")[-1]["request"]["definition"]["resources"]["gpu_config"] == {
        "gpu_type": "A10G", "count": 2}


def test_no_token_configured(modal_fake, tmp_path):
    env = {k: v for k, v in _client_env(modal_fake).items() if k not in ("MODAL_TOKEN_ID", "MODAL_TOKEN_SECRET")}
    code = "import modal\ntry:\n    modal.App.lookup('artcloud', create_if_missing=True)\n" \
           "except Exception as e:\n    print(type(e).__module__, type(e).__name__, e)\n"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.stdout.startswith("modal.exception AuthError Token missing. Could not authenticate client."), out
    # and a wrong token is refused by the (fake) server
    env.update(MODAL_TOKEN_ID="ak-wrong", MODAL_TOKEN_SECRET="as-wrong")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.stdout.startswith("modal.exception AuthError Token ID or secret is invalid"), out
    assert AuthError  # the class a ModalBackend catches


@pytest.mark.slow
def test_create_tunnel_logs_terminate(modal_fake, app):
    fake = modal_fake
    image = modal.Image.debian_slim(python_version="3.11").pip_install("artcloud[gpu]==0.1.0")
    secret = modal.Secret.from_dict({"ARTCLOUD_TOKEN": "tok-s3cr3t-value", "AWS_ACCESS_KEY_ID": "AKIAFAKE"})
    n = len(fake.calls())
    sb = modal.Sandbox.create("sh", "-c", HTTP_SERVER, app=app, image=image, secrets=[secret], gpu="H100",
                              timeout=60, idle_timeout=600, encrypted_ports=[8443], cpu=2.0, memory=4096,
                              name="srv", tags={"artcloud": "0.1.0"})
    assert sb.object_id.startswith("sb-")
    tunnel = sb.tunnels()[8443]
    state = fake.sandboxes()[sb.object_id]
    assert tunnel.url == f"https://127.0.0.1:{state['tunnel_ports'][8443]}"
    # the tunnel is open before the server listens: TLS from the edge, then the connection is closed
    ctx = ssl.create_default_context(cadata=fake.edge_ca_pem)
    with pytest.raises((http.client.RemoteDisconnected, ConnectionResetError, ssl.SSLError)):
        urllib.request.urlopen(tunnel.url, context=ctx, timeout=5)
    assert _get(tunnel.url + "/", fake.edge_ca_pem) == 200
    # what ModalBackend does from another process when it lost the id: V2 lookup (not found), then V1
    assert modal.Sandbox.from_name("artcloud", "srv").object_id == sb.object_id
    assert sb.get_tags() == {"artcloud": "0.1.0"}
    assert sb.poll() is None and sb.returncode is None

    methods = fake.methods()[n:]
    create = methods.index("SandboxCreate")
    # the image's two layers and the secret load concurrently (EnvironmentGetOrCreate once per client)
    assert sorted(set(methods[:create])) == ["ImageGetOrCreate", "ImageJoinStreaming", "SecretGetOrCreate"]
    assert methods[:create].count("ImageGetOrCreate") == 2  # debian_slim, then pip_install
    assert methods[create:create + 3] == ["SandboxCreate", "SandboxGetTaskId", "SandboxGetTunnels"]
    d = fake.calls("SandboxCreate")[-1]["request"]["definition"]
    assert d["entrypoint_args"] == ["sh", "-c", HTTP_SERVER]
    assert d["resources"]["gpu_config"] == {"gpu_type": "H100", "count": 1}
    assert d["resources"]["milli_cpu"] == 2000 and d["resources"]["memory_mb"] == 4096
    assert d["timeout_secs"] == 60 and d["idle_timeout_secs"] == 600
    assert d["open_ports"] == {"ports": [{"port": 8443}]}
    secret_id = fake.calls("SecretGetOrCreate")[-1]
    assert secret_id["request"]["env_dict"] == {"ARTCLOUD_TOKEN": "<secret>", "AWS_ACCESS_KEY_ID": "<secret>"}
    assert d["secret_ids"] == list(fake._secrets)[-1:]
    assert any("artcloud[gpu]==0.1.0" in c for c in fake.image(d["image_id"])["dockerfile_commands"])

    # the secret reached the process, never the record
    environ = open(f"/proc/{state['pid']}/environ", "rb").read().split(b"\0")
    assert b"ARTCLOUD_TOKEN=tok-s3cr3t-value" in environ and b"AWS_ACCESS_KEY_ID=AKIAFAKE" in environ
    assert "ARTCLOUD_PORT" in state["env_names"] and "MODAL_TOKEN_SECRET" not in state["env_names"]
    assert "tok-s3cr3t-value" not in (fake.root / "calls.jsonl").read_text()
    assert "AKIAFAKE" not in json.dumps(fake.calls())

    sb.terminate()
    assert fake.sandboxes()[sb.object_id]["running"] is False
    assert state["pid"] not in fake.live_pids()
    sb.wait(raise_on_termination=False)
    assert sb.returncode == 137
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", state["tunnel_ports"][8443]), timeout=2).close()
    assert list(sb.stdout)[0] == "started\n"
    assert sb.stderr.read().startswith("to-stderr\n")
    assert fake.methods()[-3:].count("SandboxGetLogs") >= 1


@pytest.mark.slow
def test_from_id_terminates_after_the_creator_died(modal_fake, app):
    fake = modal_fake
    creator = textwrap.dedent("""
        import sys, time, modal
        app = modal.App.lookup("artcloud", create_if_missing=True)
        sb = modal.Sandbox.create("sleep", "600", app=app, gpu="L4", timeout=300)
        print(sb.object_id, flush=True)
        time.sleep(600)
    """)
    proc = subprocess.Popen([sys.executable, "-c", creator], env=_client_env(fake), stdout=subprocess.PIPE, text=True)
    try:
        sandbox_id = proc.stdout.readline().strip()
        assert sandbox_id.startswith("sb-"), sandbox_id
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert fake.sandboxes()[sandbox_id]["running"]
    killer = (f"import modal\nsb = modal.Sandbox.from_id({sandbox_id!r})\nprint(sb.poll())\nsb.terminate()\n"
              "sb.wait(raise_on_termination=False)\nprint(sb.returncode)\n")
    out = subprocess.run([sys.executable, "-c", killer], env=_client_env(fake), capture_output=True, text=True,
                         timeout=60)
    assert out.stdout.split() == ["None", "137"], out
    state = fake.sandboxes()[sandbox_id]
    assert not state["running"] and state["status"] == "GENERIC_STATUS_TERMINATED"
    assert state["pid"] not in fake.live_pids()


@pytest.mark.slow
def test_timeout_kills_the_sandbox(modal_fake, app):
    sb = modal.Sandbox.create("sleep", "600", app=app, gpu="H100", timeout=2)
    t0 = time.monotonic()
    with pytest.raises(SandboxTimeoutError):
        sb.wait(raise_on_termination=False)  # a timeout raises even so
    assert 1.5 < time.monotonic() - t0 < 10
    assert sb.returncode == 124
    assert modal_fake.sandboxes()[sb.object_id]["running"] is False


@pytest.mark.slow
def test_idle_timeout_counts_open_tunnel_connections(modal_fake, app):
    fake = modal_fake
    sb = modal.Sandbox.create("sh", "-c", HTTP_SERVER, app=app, gpu="H100", timeout=60, idle_timeout=1,
                              encrypted_ports=[8443])
    url = sb.tunnels()[8443].url
    assert _get(url, fake.edge_ca_pem) == 200
    ctx = ssl.create_default_context(cadata=fake.edge_ca_pem)
    with socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1]))) as raw:
        with ctx.wrap_socket(raw, server_hostname="127.0.0.1"):
            time.sleep(2)  # an open connection, no bytes: active, as Modal counts it
            assert sb.poll() is None
    t0 = time.monotonic()
    sb.wait(raise_on_termination=False)
    assert 0.5 < time.monotonic() - t0 < 5
    assert sb.returncode == 137
    assert "idle" in fake.sandboxes()[sb.object_id]["exception"]


@pytest.mark.slow
def test_idle_timeout_counts_stdin_writes_but_not_the_sandboxs_own_work(modal_fake, app):
    # Modal's activity is exec, stdin writes and tunnel connections: a busy process printing away is idle
    busy = modal.Sandbox.create("sh", "-c", "while :; do echo busy; i=0; while [ $i -lt 2000 ]; do i=$((i+1)); done; "
                                "done", app=app, gpu="H100", timeout=60, idle_timeout=1)
    fed = modal.Sandbox.create("sh", "-c", "cat > fed.txt; exec sleep 600", app=app, gpu="H100", timeout=60,
                               idle_timeout=1)
    t0 = time.monotonic()
    while time.monotonic() - t0 < 3:  # stdin writes every 0.3 s keep `fed` alive past its idle_timeout
        fed.stdin.write(b"x")
        fed.stdin.drain()
        time.sleep(0.3)
    assert fed.poll() is None
    busy.wait(raise_on_termination=False)
    assert busy.returncode == 137 and "idle" in modal_fake.sandboxes()[busy.object_id]["exception"]
    assert "busy" in busy.stdout.read()  # it was working, and writing, all along
    t1 = time.monotonic()
    fed.wait(raise_on_termination=False)  # no more writes: idle
    assert fed.returncode == 137 and time.monotonic() - t1 < 5
    assert (Path(modal_fake.sandboxes()[fed.object_id]["dir"]) / "fed.txt").read_text().startswith("xxxxx")


def test_a_gpu_sandboxs_create_returns_only_once_it_is_scheduled(modal_fake, app, monkeypatch):
    # 1.6.4 creates it through V1, which polls SandboxGetTaskId until a task id comes (_impl_v1.py:158-161)
    fake = modal_fake
    fake.schedule_delay_s = 2.0
    try:
        sb = modal.Sandbox.create("sleep", "600", app=app, gpu="H100", timeout=60)
    finally:
        fake.schedule_delay_s = 0.0
    try:
        assert fake.sandboxes()[sb.object_id]["pid"] is not None  # scheduled, and running, when create returned
        polls = [c for c in fake.calls("SandboxGetTaskId") if c["request"]["sandbox_id"] == sb.object_id]
        assert len(polls) >= 3  # every 0.5 s for 2 s
    finally:
        sb.terminate()

    # never scheduled: after _SANDBOX_SCHEDULING_TIMEOUT (21 min: shortened here) create terminates the sandbox
    # itself and raises ResourceExhaustedError (_impl_v1.py:164-171)
    from modal.sandbox import _impl_v1

    monkeypatch.setattr(_impl_v1, "_SANDBOX_SCHEDULING_TIMEOUT", 1.5)
    before = set(fake.sandboxes())
    fake.schedule_delay_s = math.inf
    try:
        with pytest.raises(ResourceExhaustedError, match="Insufficient capacity to create sandbox"):
            modal.Sandbox.create("sleep", "600", app=app, gpu="H100", timeout=60)
    finally:
        fake.schedule_delay_s = 0.0
    (never,) = [v for k, v in fake.sandboxes().items() if k not in before]
    assert never["pid"] is None and never["status"] == "GENERIC_STATUS_TERMINATED"


@pytest.mark.slow
def test_tunnels_time_out_while_a_cpu_sandbox_is_being_scheduled(modal_fake, app):
    # V2 (no GPU): create returns with the task id at once (_impl_v2.py:201-221), tunnels() waits for the container
    modal_fake.schedule_delay_s = 3.0
    try:
        sb = modal.Sandbox.create("sh", "-c", HTTP_SERVER, app=app, timeout=60, encrypted_ports=[8443])
    finally:
        modal_fake.schedule_delay_s = 0.0
    try:
        assert sb.object_id and not modal_fake.sandboxes()[sb.object_id]["started"]
        with pytest.raises(SandboxTimeoutError):  # what the client raises for GENERIC_STATUS_TIMEOUT
            sb.tunnels(timeout=1)
        assert sb.poll() is None and modal_fake.sandboxes()[sb.object_id]["pid"] is None
        modal_fake.tunnels_wait_cap_s = 0.5  # one call waits at most this long, whatever timeout it asks
        try:
            t0 = time.monotonic()
            with pytest.raises(SandboxTimeoutError):
                sb.tunnels(timeout=30)
            assert time.monotonic() - t0 < 5
        finally:
            modal_fake.tunnels_wait_cap_s = 50.0
        url = sb.tunnels(timeout=10)[8443].url  # scheduled: the tunnel, then the server behind it
        assert modal_fake.sandboxes()[sb.object_id]["started"]
        assert _get(url + "/", modal_fake.edge_ca_pem) == 200
    finally:
        sb.terminate()


@pytest.mark.slow
def test_exit_code_and_aio(modal_fake, app):
    async def main():
        sb = await modal.Sandbox.create.aio("sh", "-c", "echo out; exit 3", app=app, gpu="A100-80GB:2", timeout=30)
        await sb.wait.aio(raise_on_termination=False)
        lines = [line async for line in sb.stdout]
        return sb.returncode, lines, sb.object_id

    code, lines, sandbox_id = asyncio.run(main())
    assert code == 3 and lines == ["out\n"]
    assert modal_fake.sandboxes()[sandbox_id]["status"] == "GENERIC_STATUS_FAILURE"
    d = [c for c in modal_fake.calls("SandboxCreate") if c["request"]["definition"]["entrypoint_args"][-1:]
         == ["echo out; exit 3"]][-1]["request"]["definition"]
    assert d["resources"]["gpu_config"] == {"gpu_type": "A100-80GB", "count": 2}


@pytest.mark.slow
def test_cpu_only_sandbox_takes_the_v2_path(modal_fake, app):
    fake = modal_fake
    n = len(fake.calls())
    sb = modal.Sandbox.create("sh", "-c", 'echo "token=$TOK"; echo oops >&2; exit 4', app=app, timeout=30,
                              secrets=[modal.Secret.from_dict({"TOK": "v2-s3cr3t"})], env={"EXTRA": "1"},
                              encrypted_ports=[8443], name="cpu")
    assert fake.sandboxes()[sb.object_id]["v2"] is True
    assert sb.tunnels()[8443].url.startswith("https://127.0.0.1:")
    assert list(sb.stdout) == ["token=v2-s3cr3t\n"] and sb.stderr.read() == "oops\n"
    sb.wait(raise_on_termination=False)
    assert sb.returncode == 4 and modal.Sandbox.from_id(sb.object_id).poll() == 4
    methods = fake.methods()[n:]
    assert "SandboxCreateV2" in methods and "SandboxCreate" not in methods and "SandboxStdioReadV2" in methods
    sources = fake.calls("SandboxCreateV2")[-1]["request"]["secret_sources"]
    assert sources == [{"env": {"contents": {"TOK": "<secret>"}}}, {"env": {"contents": {"EXTRA": "<secret>"}}}]
    assert "v2-s3cr3t" not in (fake.root / "calls.jsonl").read_text()


@pytest.mark.slow
def test_local_files_are_uploaded_and_build_steps_recorded(modal_fake, app, tmp_path):
    small, big = tmp_path / "artcloud-0.1.0-py3-none-any.whl", tmp_path / "big.bin"
    small.write_bytes(b"PK" + os.urandom(1000))
    big.write_bytes(os.urandom(5 << 20))  # >= 4 MiB: the blob path
    image = (modal.Image.debian_slim(python_version="3.11")
             .add_local_file(small, f"/root/{small.name}", copy=True)
             .run_commands(f"pip install /root/{small.name}")
             .add_local_file(big, "/root/big.bin"))
    sb = modal.Sandbox.create("true", app=app, image=image, gpu="T4", timeout=30)
    sb.wait()
    assert sb.returncode == 0
    blobs = modal_fake.root / "blobs"
    for f in (small, big):
        assert (blobs / hashlib.sha256(f.read_bytes()).hexdigest()).read_bytes() == f.read_bytes()
    assert modal_fake.calls("BlobCreate")
    d = modal_fake.calls("SandboxCreate")[-1]["request"]["definition"]
    assert len(d["mount_ids"]) == 1  # the non-copied file: a mount layer of the sandbox
    layers = [c["request"]["image"]["dockerfile_commands"] for c in modal_fake.calls("ImageGetOrCreate")]
    assert ["FROM base", f"RUN pip install /root/{small.name}"] in layers


@pytest.mark.slow
def test_stop_leaves_nothing_running(tmp_path):
    fake = FakeModal(tmp_path).start()
    try:
        code = textwrap.dedent("""
            import modal
            app = modal.App.lookup("artcloud", create_if_missing=True)
            done = modal.Sandbox.create("sh", "-c", "sleep 600 & exit 0", app=app, gpu="H100", timeout=60)
            done.wait()
            live = modal.Sandbox.create("sh", "-c", "sleep 600 & exec sleep 601", app=app, gpu="H100", timeout=60)
            print(done.object_id, live.object_id)
        """)  # the creator exits without terminating: the sandbox lives on, as on Modal
        out = subprocess.run([sys.executable, "-c", code], env=_client_env(fake), capture_output=True, text=True,
                             timeout=60)
        done, live = out.stdout.split()
        state = fake.sandboxes()
        assert state[done]["returncode"] == 0 and state[live]["running"]
        assert len(fake.live_pids()) == 2  # the leader and its background child; none left of `done`
    finally:
        fake.stop()
    assert fake.live_pids() == []
    assert fake.sandboxes()[live]["status"] == "GENERIC_STATUS_TERMINATED"

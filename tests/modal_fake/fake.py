"""`FakeModal`: the fake control plane a test holds. It runs the grpclib server (servicer.py) and the blob
upload server on a loop in its own thread, holds all the state (apps, images, secrets, mounts, sandboxes), and
records every request (in memory and in `ROOT/calls.jsonl`) before it checks its token.

Its parts: `_Sandboxes` (sandboxes.py), `_Tunnels` (tunnels.py), `_BlobServer` (images.py).
"""

from __future__ import annotations

import asyncio
import json
import signal
import ssl
import threading
import time
from pathlib import Path

from google.protobuf.json_format import MessageToDict
from grpclib import GRPCError, Status
from grpclib.server import Server
from modal_proto import api_pb2

from .common import _G, KILL_GRACE_S, TOKEN_ID, TOKEN_SECRET, _scrub
from .images import _BlobServer
from .sandboxes import _group_members, _kill_group, _returncode, _Sandbox, _Sandboxes
from .servicer import _RouterServicer, _Servicer
from .tunnels import _Tunnels


class FakeModal(_Sandboxes, _Tunnels, _BlobServer):
    """The fake control plane: `FakeModal(root).start()`, then `.env()` for a client; `.stop()` at the end."""

    def __init__(self, root: Path, *, token_id: str = TOKEN_ID, token_secret: str = TOKEN_SECRET,
                 schedule_delay_s: float = 0.0):
        self.root = Path(root)
        # The controls a test drives timing with (see sandboxes.py and images.py for what each follows):
        self.schedule_delay_s = schedule_delay_s  # a new sandbox's container is scheduled after this (inf: never)
        self.tunnels_wait_cap_s = 50.0  # the longest one SandboxGetTunnels call waits for a container
        self.build_delay_s = 0.0  # a new image layer is built after this (inf: never)
        self.create_answers = threading.Event()  # cleared: SandboxCreate creates the sandbox, then holds its answer
        self.create_answers.set()
        self.root.mkdir(parents=True, exist_ok=True)
        self.token_id, self.token_secret = token_id, token_secret
        self.port = 0
        self._calls: list[dict] = []
        self._calls_lock = threading.Lock()
        self._apps: dict[tuple[str, str], str] = {}
        self._environments: dict[str, str] = {}
        self._images: dict[str, api_pb2.Image] = {}
        self._image_by_digest: dict[str, str] = {}
        self._image_since: dict[str, float] = {}  # image id -> when its build began (time.monotonic())
        self._secrets: dict[str, dict[str, str]] = {}
        self._named_secrets: dict[tuple[str, str], str] = {}
        self._mounts: dict[str, list[tuple[str, str]]] = {}
        self._sandboxes: dict[str, _Sandbox] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._server: Server | None = None
        self._edge_ssl: ssl.SSLContext | None = None
        self._blob_runner = None
        self.blob_port = 0
        self.edge_ca_pem = ""
        self.edge_ca_path = self.root / "edge" / "ca.pem"

    # --- lifecycle --------------------------------------------------------------------------------

    def start(self) -> "FakeModal":
        from artcloud.tls import make_launch_secrets

        edge = make_launch_secrets()
        self.edge_ca_pem = edge.ca_cert
        (self.root / "edge").mkdir(parents=True, exist_ok=True)
        self.edge_ca_path.write_text(edge.ca_cert)
        cert, key = self.root / "edge" / "cert.pem", self.root / "edge" / "key.pem"
        cert.write_text(edge.server_cert)
        key.write_text(edge.server_key)
        key.chmod(0o600)
        self._edge_ssl = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        self._edge_ssl.load_cert_chain(cert, key)
        (self.root / "calls.jsonl").touch()

        ready = threading.Event()
        failure: list[BaseException] = []

        def run() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            asyncio.set_event_loop(loop)
            try:
                self._server = Server([_Servicer(self), _RouterServicer(self)])
                loop.run_until_complete(self._server.start("127.0.0.1", 0))
                self.port = self._server._server.sockets[0].getsockname()[1]
                loop.run_until_complete(self._start_blob_server())
            except BaseException as e:  # noqa: BLE001 - reported to start()
                failure.append(e)
                ready.set()
                return
            ready.set()
            loop.run_forever()
            loop.close()

        self._thread = threading.Thread(target=run, name="fake-modal", daemon=True)
        self._thread.start()
        ready.wait(30)
        if failure:
            raise RuntimeError(f"the fake Modal server did not start: {failure[0]!r}") from failure[0]
        if not self.port:
            raise RuntimeError("the fake Modal server did not start within 30 s")
        return self

    def stop(self) -> None:
        """Terminate every sandbox (its process group killed), close the tunnels, stop the server."""
        loop, self._loop = self._loop, None
        if loop is None:
            return
        self.create_answers.set()  # a held answer goes (to a client that is gone by now)
        self.build_delay_s = 0.0
        try:
            asyncio.run_coroutine_threadsafe(self._shutdown(), loop).result(timeout=3 * KILL_GRACE_S + 10)
        finally:
            loop.call_soon_threadsafe(loop.stop)
            if self._thread is not None:
                self._thread.join(10)
            for sb in self._sandboxes.values():  # in case the loop could not do it
                _kill_group(sb.proc, signal.SIGKILL)

    def __enter__(self) -> "FakeModal":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    async def _shutdown(self) -> None:
        await asyncio.gather(*(self._finish(sb, _G(status=_G.GENERIC_STATUS_TERMINATED,
                                                   exception="Sandbox terminated (fake Modal stopped)"))
                               for sb in list(self._sandboxes.values())), return_exceptions=True)
        for sb in self._sandboxes.values():
            if sb.monitor is not None:
                sb.monitor.cancel()
        if self._blob_runner is not None:
            await self._blob_runner.cleanup()
        if self._server is not None:
            self._server.close()
            try:
                await asyncio.wait_for(self._server.wait_closed(), 5)
            except asyncio.TimeoutError:
                pass

    # --- what a client and a test use -----------------------------------------------------------------

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def env(self) -> dict[str, str]:
        """What a client process needs in its environment to talk to this fake (and only to it)."""
        return {  # modal/config.py's settings, read from MODAL_<NAME> (config.py:380-382, 403)
            "MODAL_SERVER_URL": self.url,
            "MODAL_TOKEN_ID": self.token_id,
            "MODAL_TOKEN_SECRET": self.token_secret,
            # read when `modal` is imported (config.py:123): a file that does not exist, so no profile is used
            "MODAL_CONFIG_PATH": str(self.root / "modal.toml"),
            "MODAL_DISABLE_API_PROXY": "1",  # never through an HTTP(S)_PROXY (_utils/proxy_support.py:30-31)
        }

    def install(self, monkeypatch) -> "FakeModal":
        """Point this process's `modal` client here (a pytest monkeypatch undoes the environment)."""
        for k, v in self.env().items():
            monkeypatch.setenv(k, v)
        self.forget_env_client()
        return self

    @staticmethod
    def forget_env_client() -> None:
        """Drop this process's cached `modal.Client.from_env()` (it keeps the first server URL it saw:
        modal/client.py:113, 341-342, 421)."""
        from modal.client import _Client

        _Client._client_from_env = None

    def calls(self, method: str | None = None) -> list[dict]:
        """Recorded requests, oldest first: {"method", "request" (dict, secrets scrubbed), "t", ...}."""
        with self._calls_lock:
            return [c for c in self._calls if method is None or c["method"] == method]

    def methods(self) -> list[str]:
        """The method names called, in order."""
        return [c["method"] for c in self.calls()]

    def sandboxes(self) -> dict[str, dict]:
        out = {}
        for sb in list(self._sandboxes.values()):
            r = sb.result
            out[sb.id] = {
                "id": sb.id, "task_id": sb.task_id, "app_id": sb.app_id, "name": sb.name, "dir": str(sb.dir),
                "args": list(sb.definition.entrypoint_args), "pid": sb.proc.pid if sb.proc else None,
                "running": sb.proc is not None and sb.proc.poll() is None, "started": sb.started,
                "status": _G.GenericStatus.Name(r.status) if r is not None else None,
                "returncode": _returncode(r), "exception": r.exception if r is not None else None,
                "tunnel_ports": {p: t.port for p, t in sb.tunnels.items()},
                "local_ports": {p: t.target_port for p, t in sb.tunnels.items()},
                "env_names": list(sb.env_names), "v2": sb.v2, "image_id": sb.definition.image_id, "gpu": sb.definition.resources.gpu_config.gpu_type or None,
                "timeout_secs": sb.definition.timeout_secs,
                "idle_timeout_secs": (sb.definition.idle_timeout_secs
                                      if sb.definition.HasField("idle_timeout_secs") else None),
                "stdout": str(sb.stdout_path), "stderr": str(sb.stderr_path),
            }
        return out

    def live_pids(self) -> list[int]:
        """Processes of sandboxes still running (leaders, and anything left in their process groups)."""
        pids = []
        for sb in list(self._sandboxes.values()):
            if sb.proc is None:
                continue
            if sb.proc.poll() is None:
                pids.append(sb.proc.pid)
            pids += [p for p in _group_members(sb.proc.pid) if p != sb.proc.pid]
        return pids

    def secret_env(self, secret_id: str) -> dict[str, str]:
        return dict(self._secrets[secret_id])

    def image(self, image_id: str) -> dict:
        return MessageToDict(self._images[image_id], preserving_proto_field_name=True)

    def run(self, coro, timeout: float = 30):
        """Run a coroutine on the fake's loop (e.g. to inspect state consistently)."""
        assert self._loop is not None
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    # --- internals, on the fake's loop ----------------------------------------------------------------

    def _record(self, method: str, req, metadata, *, implemented: bool = True, router: bool = False) -> None:
        """Record a request; refuse it without this fake's token: UNAUTHENTICATED, which the client raises as
        AuthError (modal/exception.py:33). The token travels as x-modal-token-id/-secret (client.py:70-71), the
        router's as a bearer JWT. ClientHello, the client's first call (client.py:294), is answered without
        one here; real Modal may refuse it already: either way the client raises AuthError."""
        entry = {"t": time.time(), "method": method, "service": "TaskCommandRouter" if router else "ModalClient",
                 "request": _scrub(MessageToDict(req, preserving_proto_field_name=True)),
                 "token_id": (metadata or {}).get("x-modal-token-id")}
        if not implemented:
            entry["unimplemented"] = True
        with self._calls_lock:
            self._calls.append(entry)
            with open(self.root / "calls.jsonl", "a") as fh:
                fh.write(json.dumps(entry) + "\n")
        md = metadata or {}
        if router:
            if not str(md.get("authorization", "")).startswith("Bearer "):
                raise GRPCError(Status.UNAUTHENTICATED, "missing command router JWT (fake Modal)")
        elif method != "ClientHello" and (md.get("x-modal-token-id") != self.token_id
                                        or md.get("x-modal-token-secret") != self.token_secret):
            raise GRPCError(Status.UNAUTHENTICATED, "Token ID or secret is invalid (fake Modal)")

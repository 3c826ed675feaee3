"""A fake Modal control plane on loopback, for the REAL `modal` client (1.6.4).

The client speaks gRPC (grpclib) to `MODAL_SERVER_URL`; this module serves `modal_proto.api_grpc.ModalClientBase`
on 127.0.0.1 over plain HTTP/2 (the client accepts `http://`: TLS only when the scheme is `https`). What is
behind each call is real where it can be:

- `Sandbox.create` starts the sandbox's entrypoint args as a local process (`subprocess.Popen`, its own
  session/process group), in `ROOT/sandboxes/SB_ID/` (also its HOME), stdout/stderr to files there. Its
  environment: this machine's `os.environ` minus `AWS_*`, `ARTCLOUD_*` and `MODAL_*`, then the secrets' env
  dicts, then the "edge" overrides: `ARTCLOUD_PORT` = a free local port (the first opened port is remapped
  there: the command must listen on `${ARTCLOUD_PORT:-8443}`), `FAKE_MODAL_PORT_<P>` for every opened port P,
  `MODAL_SANDBOX_ID` and `MODAL_TASK_ID`. PATH starts with this interpreter's bin folder, so `artcloud` and
  `python` are this venv's.
- IMAGES ARE RECORDED, NOT BUILT: `ImageGetOrCreate` stores each layer's definition (dockerfile commands,
  base images, context mount) and a new layer is "built" at once by `ImageJoinStreaming`; no build step
  (`pip_install`, `run_commands`, ...) is executed. Local files (`add_local_file`, `copy=True` or not) go
  through the Mount calls and are stored by sha256 under `ROOT/blobs/`; files of 4 MiB and more take the blob
  path (`BlobCreate`, then an HTTP PUT to this fake's small upload server, then `MountPutFile(data_blob_id)`).
- Tunnels: every port in `encrypted_ports` (and `h2_ports`) gets a TLS-terminating TCP proxy on
  127.0.0.1:<free port>, with a certificate for 127.0.0.1/localhost signed by a fake "Modal edge" CA
  (`FakeModal.edge_ca_pem`), forwarding plain TCP to the sandbox's local port; `unencrypted_ports` get a plain
  TCP proxy. A tunnel exists from creation on, before the server listens (as on Modal): a connection that
  arrives before the process listens is accepted and then closed.
- Scheduling: `FakeModal(root, schedule_delay_s=S)` (or the attribute, before a create) makes each new
  sandbox wait S seconds for its container, as a GPU being scheduled does: the task id is there at once (1.6.4's
  `Sandbox.create` waits for it), but the process starts only after S, and until then `SandboxGetTunnels`
  waits up to its request's `timeout` and answers GENERIC_STATUS_TIMEOUT, which the client raises as
  `SandboxTimeoutError` (as real Modal does while the container is not yet scheduled). One call waits at most
  `tunnels_wait_cap_s` (50 s) whatever timeout it asks: how long Modal's server holds this long poll is not
  documented, so a client must ask again rather than count on one call's timeout.
- Timers as on Modal: `timeout` kills the process (result TIMEOUT: `returncode` 124, and `wait()` raises
  `SandboxTimeoutError` even with `raise_on_termination=False`). `idle_timeout`: the 1.6.4 proto only says
  "If set, the sandbox will be terminated after being idle for this duration"; Modal's guide counts as
  activity ONLY an open TCP connection through a tunnel, a running `exec` and stdin writes. So does this
  fake: an open tunnel connection (and its traffic) and `SandboxStdinWrite` reset the timer; the sandbox's
  own CPU work and output do not (a busy process with no tunnel connection is killed). `exec` is not
  implemented (it answers UNIMPLEMENTED). Idle for `idle_timeout` seconds -> terminated (result
  TERMINATED, `returncode` 137; what real Modal reports here is not verified).
- `SandboxTerminate` marks the result TERMINATED (returncode 137), closes the tunnels, and kills the whole
  process group (SIGTERM, then SIGKILL after 5 s) before it answers. A process that exits by itself ends
  the sandbox with its exit code (result SUCCESS for 0, FAILURE otherwise); what it left in its process
  group is killed, as a container's end would.
- GPU types and counts are checked as the server would (the 1.6.4 client only upper-cases the string and
  parses the count): an unknown type, or more than Modal's per-sandbox cap (8; A10 4: Modal's GPU guide), is
  answered INVALID_ARGUMENT, which the client raises as `modal.exception.InvalidError`.

Sandbox implementations: 1.6.4 creates a sandbox WITH a GPU through the V1 calls (`SandboxCreate`,
`SandboxGetTaskId`, `SandboxGetTunnels`, `SandboxWait`, `SandboxTerminate`, stdout/stderr by the
`SandboxGetLogs` stream) and one WITHOUT a GPU through the V2 calls (`AuthTokenGet`, `SandboxCreateV2`,
`SandboxWaitV2`, ...; ephemeral secrets inline; stdout/stderr by `SandboxStdioReadV2` on the "task command
router", which this same server also serves: the client accepts a plain-http router URL when the server URL
is localhost). The client routes on the id's shape: a V1 id is 'sb-' + 22 alphanumerics, a V2 id anything
else ('sb-' + 24 here). Only the calls these flows need are implemented; every other RPC answers
UNIMPLEMENTED with its name (`modal.exception.UnimplementedError: FakeModal does not implement X`).

Every request is recorded (method + `MessageToDict(preserving_proto_field_name=True)`, with secret values
replaced by "<secret>" and file contents by a size) in memory (`.calls()`) and in `ROOT/calls.jsonl`.

State lives in the server object, so a second client process (e.g. `Sandbox.from_id(...).terminate()` after
the creator died) sees the same sandboxes: give it `fake.env()`.

Use: `fake = FakeModal(tmp_path).start()`; point the client at it with `fake.env()` (MODAL_SERVER_URL,
MODAL_TOKEN_ID/SECRET, MODAL_CONFIG_PATH, MODAL_DISABLE_API_PROXY); `fake.stop()` leaves nothing running.
The `modal` client caches one client per process (`Client.from_env`): call `FakeModal.forget_env_client()`
when a process talks to a second fake.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import inspect
import json
import os
import secrets as _secrets
import signal
import socket
import ssl
import string
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from google.protobuf import empty_pb2
from google.protobuf.json_format import MessageToDict
from grpclib import GRPCError, Status
from grpclib.server import Server
from modal_proto import api_pb2
from modal_proto import task_command_router_pb2 as sr_pb2
from modal_proto.api_grpc import ModalClientBase
from modal_proto.task_command_router_grpc import TaskCommandRouterBase

TOKEN_ID = "ak-fakemodaltest"
TOKEN_SECRET = "as-fakemodaltest"
IMAGE_BUILDER_VERSION = "2025.06"
# Modal's GPU types (https://modal.com/docs/guide/gpu), upper-cased as the client sends them.
GPU_TYPES = ("T4", "L4", "A10", "A10G", "L40S", "A100", "A100-40GB", "A100-80GB", "H100", "H100!", "H200",
             "B200", "B200+", "RTX-PRO-6000")
GPU_MAX_COUNT = {"A10": 4, "A10G": 4}  # per sandbox; every other type: 8
KILL_GRACE_S = 5.0
_ALNUM = string.digits + string.ascii_letters
_G = api_pb2.GenericResult


def new_id(prefix: str) -> str:
    """An object id shaped like Modal's (a V1 sandbox id is 'sb-' + 22 alphanumerics: the client checks)."""
    return f"{prefix}-" + "".join(_secrets.choice(_ALNUM) for _ in range(22))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _fake_jwt(lifetime_s: float = 3600) -> str:
    def b64(d: dict) -> str:
        return base64.urlsafe_b64encode(json.dumps(d).encode()).decode().rstrip("=")

    return f"{b64({'alg': 'none', 'typ': 'JWT'})}.{b64({'exp': int(time.time() + lifetime_s), 'sub': 'fake'})}.sig"


_SECRET_KEYS = ("env_dict", "env", "ephemeral_secrets")  # SecretGetOrCreate; SecretSource.env; SandboxCreateV2


def _scrub(obj: Any, key: str = "", masked: bool = False) -> Any:
    """A recorded request without secret values and without file contents."""
    masked = masked or key in _SECRET_KEYS
    if isinstance(obj, dict):
        return {k: _scrub(v, k, masked) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_scrub(v, key, masked) for v in obj]
    if masked and isinstance(obj, str):
        return "<secret>"
    if isinstance(obj, str) and key == "data" and len(obj) > 64:
        return f"<{len(obj)} base64 chars>"
    return obj


@dataclass
class _Tunnel:
    container_port: int
    target_port: int
    encrypted: bool
    server: asyncio.AbstractServer | None = None
    port: int = 0
    writers: set = field(default_factory=set)


@dataclass
class _Sandbox:
    id: str
    task_id: str
    app_id: str
    name: str
    definition: api_pb2.Sandbox
    tags: dict[str, str]
    dir: Path
    env_names: list[str]
    created_at: float
    v2: bool = False
    proc: subprocess.Popen | None = None
    tunnels: dict[int, _Tunnel] = field(default_factory=dict)
    result: api_pb2.GenericResult | None = None
    finished_at: float | None = None
    done: asyncio.Event = field(default_factory=asyncio.Event)
    last_activity: float = field(default_factory=time.monotonic)
    open_conns: int = 0
    monitor: asyncio.Task | None = None
    killing: asyncio.Task | None = None
    scheduled_at: float = 0.0  # time.monotonic() at which its container "starts" (schedule_delay_s)
    launch: tuple[list[str], dict[str, str]] | None = None  # (args, env) until the process is started

    @property
    def started(self) -> bool:
        """Its container runs (or ran): the process was started, or the sandbox ended."""
        return self.proc is not None or self.result is not None

    @property
    def stdout_path(self) -> Path:
        return self.dir / "stdout.log"

    @property
    def stderr_path(self) -> Path:
        return self.dir / "stderr.log"

    def touch(self) -> None:
        self.last_activity = time.monotonic()


class _Servicer(ModalClientBase):
    """The implemented RPCs: `rpc_X(req, metadata)` returns the response (a unary call) or is an async
    generator of responses (a server-streaming call). Everything else: UNIMPLEMENTED, by name."""

    def __init__(self, fake: "FakeModal"):
        self.fake = fake

    # --- session, apps, environments ---------------------------------------------------------------

    async def rpc_ClientHello(self, req, md):
        return api_pb2.ClientHelloResponse(image_builder_version=IMAGE_BUILDER_VERSION)

    async def rpc_AuthTokenGet(self, req, md):
        return api_pb2.AuthTokenGetResponse(token=_fake_jwt())

    async def rpc_AppGetOrCreate(self, req, md):
        f = self.fake
        key = (req.environment_name or "main", req.app_name)
        if key not in f._apps:
            if req.object_creation_type != api_pb2.OBJECT_CREATION_TYPE_CREATE_IF_MISSING:
                raise GRPCError(Status.NOT_FOUND, f"App '{req.app_name}' not found")
            f._apps[key] = new_id("ap")
        return api_pb2.AppGetOrCreateResponse(app_id=f._apps[key])

    async def rpc_EnvironmentGetOrCreate(self, req, md):
        name = req.deployment_name or "main"
        env_id = self.fake._environments.setdefault(name, new_id("en"))
        meta = api_pb2.EnvironmentMetadata(
            name=name, settings=api_pb2.EnvironmentSettings(image_builder_version=IMAGE_BUILDER_VERSION))
        return api_pb2.EnvironmentGetOrCreateResponse(environment_id=env_id, metadata=meta)

    # --- images (recorded, not built) --------------------------------------------------------------

    async def rpc_ImageGetOrCreate(self, req, md):
        f = self.fake
        digest = hashlib.sha256(req.image.SerializeToString(deterministic=True)).hexdigest()
        image_id = f._image_by_digest.get(digest)
        meta = api_pb2.ImageMetadata(python_version_info="Python 3.11 (fake: not built)",
                                     image_builder_version=req.builder_version or IMAGE_BUILDER_VERSION)
        if image_id is None:  # a new layer: "built" by ImageJoinStreaming, as a first build would be
            image_id = f._image_by_digest[digest] = new_id("im")
            f._images[image_id] = req.image
            return api_pb2.ImageGetOrCreateResponse(image_id=image_id)
        return api_pb2.ImageGetOrCreateResponse(image_id=image_id, result=_G(status=_G.GENERIC_STATUS_SUCCESS),
                                                metadata=meta)

    async def rpc_ImageJoinStreaming(self, req, md):
        if req.image_id not in self.fake._images:
            raise GRPCError(Status.NOT_FOUND, f"Image {req.image_id} not found")
        image = self.fake._images[req.image_id]
        lines = [f"[fake modal] image {req.image_id}: build steps recorded, not executed\n"]
        lines += [f"[fake modal]   {c}\n" for c in image.dockerfile_commands]
        logs = [api_pb2.TaskLogs(data=line, file_descriptor=api_pb2.FILE_DESCRIPTOR_STDOUT,
                                 timestamp=time.time()) for line in lines]
        yield api_pb2.ImageJoinStreamingResponse(task_logs=logs, entry_id="1")
        yield api_pb2.ImageJoinStreamingResponse(
            result=_G(status=_G.GENERIC_STATUS_SUCCESS), entry_id="2", eof=True,
            metadata=api_pb2.ImageMetadata(python_version_info="Python 3.11 (fake: not built)",
                                           image_builder_version=IMAGE_BUILDER_VERSION))

    # --- secrets -----------------------------------------------------------------------------------

    async def rpc_SecretGetOrCreate(self, req, md):
        f = self.fake
        if req.deployment_name and not req.env_dict:
            key = (req.environment_name or "main", req.deployment_name)
            if key not in f._named_secrets:
                raise GRPCError(Status.NOT_FOUND, f"Secret '{req.deployment_name}' not found")
            return api_pb2.SecretGetOrCreateResponse(secret_id=f._named_secrets[key])
        secret_id = new_id("st")
        f._secrets[secret_id] = dict(req.env_dict)
        if req.deployment_name:
            f._named_secrets[(req.environment_name or "main", req.deployment_name)] = secret_id
        return api_pb2.SecretGetOrCreateResponse(secret_id=secret_id)

    # --- mounts (local files), stored by sha256 ----------------------------------------------------

    async def rpc_MountBatchedCheckExistence(self, req, md):
        missing = [h for h in req.sha256_hex_hashes if not (self.fake.root / "blobs" / h).exists()]
        return api_pb2.MountBatchedCheckExistenceResponse(missing_sha256_hex_hashes=missing)

    async def rpc_MountPutFile(self, req, md):
        path = self.fake.root / "blobs" / req.sha256_hex
        kind = req.WhichOneof("data_oneof")
        data = None
        if kind == "data":
            data = req.data
        elif kind == "data_blob_id":
            blob = self.fake.root / "blobs" / "uploads" / req.data_blob_id
            if not blob.exists():
                raise GRPCError(Status.NOT_FOUND, f"Blob {req.data_blob_id} not found (not uploaded)")
            data = blob.read_bytes()
        if data is not None:
            if hashlib.sha256(data).hexdigest() != req.sha256_hex:
                raise GRPCError(Status.INVALID_ARGUMENT, "sha256 does not match the data")
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)
        return api_pb2.MountPutFileResponse(exists=path.exists())

    async def rpc_BlobCreate(self, req, md):
        """Files of 4 MiB and more: one single-part upload URL on this fake's small HTTP server."""
        blob_id = new_id("bl")
        url = f"http://127.0.0.1:{self.fake.blob_port}/upload/{blob_id}"
        return api_pb2.BlobCreateResponse(blob_ids=[blob_id], upload_urls=api_pb2.UploadUrlList(items=[url]))

    async def rpc_MountGetOrCreate(self, req, md):
        mount_id = new_id("mo")
        self.fake._mounts[mount_id] = [(mf.filename, mf.sha256_hex) for mf in req.files]
        return api_pb2.MountGetOrCreateResponse(mount_id=mount_id, handle_metadata=api_pb2.MountHandleMetadata())

    # --- sandboxes (V1: the path of every sandbox with a GPU) --------------------------------------

    async def rpc_SandboxCreate(self, req, md):
        f = self.fake
        for sid in req.definition.secret_ids:
            if sid not in f._secrets:
                raise GRPCError(Status.NOT_FOUND, f"Secret {sid} not found")
        envs = [f._secrets[sid] for sid in req.definition.secret_ids]
        sb = await f._create_sandbox(req.app_id, req.definition, req.tags, envs, v2=False)
        return api_pb2.SandboxCreateResponse(sandbox_id=sb.id, metadata=f._handle_metadata(sb))

    # --- sandboxes V2 (1.6.4's default for a sandbox without a GPU): the same calls, `*V2`; stdio through
    # the task command router, which this same server also serves (plain http is accepted on localhost) ---

    async def rpc_SandboxCreateV2(self, req, md):
        f = self.fake
        envs = []
        for source in list(req.secret_sources):
            if source.WhichOneof("source") == "secret_id":
                if source.secret_id not in f._secrets:
                    raise GRPCError(Status.NOT_FOUND, f"Secret {source.secret_id} not found")
                envs.append(f._secrets[source.secret_id])
            else:
                envs.append(dict(source.env.contents))
        sb = await f._create_sandbox(req.app_id, req.definition, req.tags, envs, v2=True)
        return api_pb2.SandboxCreateV2Response(
            sandbox_id=sb.id, task_id=sb.task_id, metadata=f._handle_metadata(sb), sandbox_token=_fake_jwt(),
            command_router_access=api_pb2.CommandRouterAccess(url=f.url, jwt=_fake_jwt()),
            tunnels=_tunnel_protos(sb))

    async def rpc_SandboxGetCommandRouterAccess(self, req, md):
        f = self.fake
        if req.sandbox_id:
            f._get(req.sandbox_id)
        elif not any(sb.task_id == req.task_id for sb in f._sandboxes.values()):
            raise GRPCError(Status.NOT_FOUND, f"Task {req.task_id} not found")
        return api_pb2.SandboxGetCommandRouterAccessResponse(url=f.url, jwt=_fake_jwt())

    async def rpc_SandboxGetTaskId(self, req, md):
        sb = self.fake._get(req.sandbox_id)
        resp = api_pb2.SandboxGetTaskIdResponse(task_id=sb.task_id)
        if sb.result is not None:
            resp.task_result.CopyFrom(sb.result)
        return resp

    async def rpc_SandboxGetTunnels(self, req, md):
        sb = self.fake._get(req.sandbox_id)
        deadline = time.monotonic() + max(min(req.timeout, self.fake.tunnels_wait_cap_s), 0)
        while not sb.started and time.monotonic() < deadline:  # a container still being scheduled
            await asyncio.sleep(0.05)
        if not sb.started:
            return api_pb2.SandboxGetTunnelsResponse(result=_G(status=_G.GENERIC_STATUS_TIMEOUT))
        return api_pb2.SandboxGetTunnelsResponse(result=_G(status=_G.GENERIC_STATUS_SUCCESS),
                                                 tunnels=_tunnel_protos(sb))

    async def rpc_SandboxStdinWrite(self, req, md):
        """Stdin writes count as activity for idle_timeout (as on Modal); the bytes go to the process."""
        sb = self.fake._get(req.sandbox_id)
        if sb.result is not None:
            raise GRPCError(Status.FAILED_PRECONDITION, "Sandbox has already finished")
        sb.touch()
        stdin = sb.proc.stdin if sb.proc is not None else None
        if stdin is not None and not stdin.closed:
            try:
                if req.input:
                    stdin.write(req.input)
                    stdin.flush()
                if req.eof:
                    stdin.close()
            except (BrokenPipeError, OSError):
                pass
        return api_pb2.SandboxStdinWriteResponse()

    async def rpc_SandboxWait(self, req, md):
        sb = self.fake._get(req.sandbox_id)
        if sb.result is None and req.timeout > 0:
            try:
                await asyncio.wait_for(sb.done.wait(), timeout=req.timeout)
            except asyncio.TimeoutError:
                pass
        resp = api_pb2.SandboxWaitResponse(metadata=self.fake._handle_metadata(sb))
        if sb.result is not None:
            resp.result.CopyFrom(sb.result)
        return resp

    async def rpc_SandboxTerminate(self, req, md):
        sb = self.fake._get(req.sandbox_id)
        existing = sb.result
        await self.fake._finish(sb, _G(status=_G.GENERIC_STATUS_TERMINATED, exception="Sandbox terminated"))
        resp = api_pb2.SandboxTerminateResponse()
        if existing is not None:
            resp.existing_result.CopyFrom(existing)
        return resp

    async def rpc_SandboxGetLogs(self, req, md):
        sb = self.fake._get(req.sandbox_id)
        if req.file_descriptor not in (api_pb2.FILE_DESCRIPTOR_STDOUT, api_pb2.FILE_DESCRIPTOR_STDERR):
            raise GRPCError(Status.INVALID_ARGUMENT, f"file_descriptor {req.file_descriptor} has no log")
        stderr = req.file_descriptor == api_pb2.FILE_DESCRIPTOR_STDERR
        offset = int(req.last_entry_id or 0)
        async for start, data in _read_output(sb, stderr, offset, req.timeout or 55):
            if data is None:
                yield api_pb2.TaskLogsBatch(task_id=sb.task_id, sandbox_id=sb.id, entry_id=str(start), eof=True)
                return
            yield api_pb2.TaskLogsBatch(
                task_id=sb.task_id, sandbox_id=sb.id, entry_id=str(start + len(data)),
                items=[api_pb2.TaskLogs(data=data.decode("utf-8", "replace"), timestamp=time.time(),
                                        file_descriptor=req.file_descriptor)])

    async def rpc_SandboxGetFromName(self, req, md, v2=False):
        f = self.fake
        app_id = f._apps.get((req.environment_name or "main", req.app_name))
        found = [sb for sb in f._sandboxes.values()
                 if sb.app_id == app_id and sb.name == req.sandbox_name and sb.v2 == v2
                 and (sb.result is None or req.include_terminated)]
        if app_id is None or not found:
            raise GRPCError(Status.NOT_FOUND, f"Sandbox '{req.sandbox_name}' not found in app '{req.app_name}'")
        sb = max(found, key=lambda s: s.created_at)
        return api_pb2.SandboxGetFromNameResponse(sandbox_id=sb.id, metadata=f._handle_metadata(sb))

    async def rpc_SandboxList(self, req, md):
        f = self.fake
        want = {t.tag_name: t.tag_value for t in req.tags}
        out = []
        for sb in sorted(f._sandboxes.values(), key=lambda s: -s.created_at):
            if req.app_id and sb.app_id != req.app_id:
                continue
            if sb.result is not None and not req.include_finished:
                continue
            if req.before_timestamp and sb.created_at >= req.before_timestamp:
                continue
            if any(sb.tags.get(k) != v for k, v in want.items()):
                continue
            info = api_pb2.SandboxInfo(id=sb.id, created_at=sb.created_at, app_id=sb.app_id, name=sb.name,
                                       image_id=sb.definition.image_id, timeout_secs=sb.definition.timeout_secs,
                                       tags=[api_pb2.SandboxTag(tag_name=k, tag_value=v) for k, v in sb.tags.items()],
                                       metadata=f._handle_metadata(sb))
            info.task_info.id = sb.task_id
            info.task_info.started_at = sb.created_at
            info.task_info.sandbox_id = sb.id
            if sb.result is not None:
                info.task_info.result.CopyFrom(sb.result)
                info.task_info.finished_at = sb.finished_at or 0.0
            out.append(info)
        return api_pb2.SandboxListResponse(sandboxes=out)

    async def rpc_SandboxTagsGet(self, req, md):
        sb = self.fake._get(req.sandbox_id)
        return api_pb2.SandboxTagsGetResponse(
            tags=[api_pb2.SandboxTag(tag_name=k, tag_value=v) for k, v in sb.tags.items()])

    async def rpc_SandboxTagsSet(self, req, md):
        sb = self.fake._get(req.sandbox_id)
        sb.tags = {t.tag_name: t.tag_value for t in req.tags}
        return empty_pb2.Empty()


    async def rpc_SandboxGetFromNameV2(self, req, md):
        return await self.rpc_SandboxGetFromName(req, md, v2=True)

    # the V2 calls take and give the V1 messages
    rpc_SandboxGetTaskIdV2 = rpc_SandboxGetTaskId
    rpc_SandboxGetTunnelsV2 = rpc_SandboxGetTunnels
    rpc_SandboxWaitV2 = rpc_SandboxWait
    rpc_SandboxTerminateV2 = rpc_SandboxTerminate
    rpc_SandboxListV2 = rpc_SandboxList
    rpc_SandboxTagsGetV2 = rpc_SandboxTagsGet
    rpc_SandboxTagsSetV2 = rpc_SandboxTagsSet


class _RouterServicer(TaskCommandRouterBase):
    """The task command router of V2 sandboxes (same server, same loop): their stdout/stderr."""

    def __init__(self, fake: "FakeModal"):
        self.fake = fake

    async def rpc_SandboxStdioReadV2(self, req, md):
        sb = next((s for s in self.fake._sandboxes.values() if s.task_id == req.task_id), None)
        if sb is None:
            raise GRPCError(Status.NOT_FOUND, f"Task {req.task_id} not found")
        stderr = req.file_descriptor == sr_pb2.SANDBOX_STDIO_FILE_DESCRIPTOR_STDERR
        async for start, data in _read_output(sb, stderr, req.offset, None):
            if data is None:
                return  # the end of the stream is the end of the output
            yield sr_pb2.SandboxStdioReadV2Response(data=data, starting_offset=start)


def _tunnel_protos(sb: "_Sandbox") -> list:
    out = []
    if not sb.started:  # no container yet: no tunnel to report
        return out
    for t in sb.tunnels.values():
        if t.encrypted:
            out.append(api_pb2.TunnelData(host="127.0.0.1", port=t.port, container_port=t.container_port))
        else:
            out.append(api_pb2.TunnelData(host="127.0.0.1", port=t.port, unencrypted_host="127.0.0.1",
                                          unencrypted_port=t.port, container_port=t.container_port))
    return out


async def _read_output(sb: "_Sandbox", stderr: bool, offset: int, timeout: float | None):
    """(offset, bytes) chunks of a sandbox's stdout or stderr from `offset`, following the file while the
    sandbox runs; (offset, None) once it has ended and everything was read. Stops after `timeout` s."""
    path = sb.stderr_path if stderr else sb.stdout_path
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        finished = sb.result is not None and (sb.proc is None or sb.proc.poll() is not None)
        data = b""
        if path.exists():
            with open(path, "rb") as fh:
                fh.seek(offset)
                data = fh.read(1 << 20)
        if data and not finished:
            data = data[: _utf8_complete(data)]
        if data:
            yield offset, data
            offset += len(data)
            continue
        if finished:
            yield offset, None
            return
        if deadline is not None and time.monotonic() > deadline:
            return  # the client asks again from where it is
        try:
            await asyncio.wait_for(sb.done.wait(), timeout=0.1)
        except asyncio.TimeoutError:
            pass


def _utf8_complete(data: bytes) -> int:
    """The length of the longest prefix of `data` that does not end inside a UTF-8 sequence."""
    i = len(data)
    back = 0
    while i > 0 and back < 4 and (data[i - 1] & 0xC0) == 0x80:
        i -= 1
        back += 1
    if i == 0:
        return len(data)
    lead = data[i - 1]
    need = 2 if lead >> 5 == 0b110 else 3 if lead >> 4 == 0b1110 else 4 if lead >> 3 == 0b11110 else 1
    return len(data) if back + 1 >= need else i - 1


def _make_handler(fake_name: str, impl, router: bool):
    if inspect.isasyncgenfunction(impl):
        async def handler(self, stream):
            req = await stream.recv_message()
            self.fake._record(fake_name, req, stream.metadata, router=router)
            async for resp in impl(self, req, stream.metadata):
                await stream.send_message(resp)
    else:
        async def handler(self, stream):
            req = await stream.recv_message()
            self.fake._record(fake_name, req, stream.metadata, router=router)
            await stream.send_message(await impl(self, req, stream.metadata))
    handler.__name__ = fake_name
    return handler


def _make_unimplemented(fake_name: str, router: bool):
    async def handler(self, stream):
        req = await stream.recv_message()
        self.fake._record(fake_name, req, stream.metadata, implemented=False, router=router)
        raise GRPCError(Status.UNIMPLEMENTED, f"FakeModal does not implement {fake_name}")

    handler.__name__ = fake_name
    return handler


def _complete(cls, *, router: bool) -> None:
    for name in sorted(cls.__abstractmethods__):
        impl = getattr(cls, f"rpc_{name}", None)
        setattr(cls, name, _make_handler(name, impl, router) if impl else _make_unimplemented(name, router))
    cls.__abstractmethods__ = frozenset()


_complete(_Servicer, router=False)
_complete(_RouterServicer, router=True)
IMPLEMENTED = sorted(n[4:] for n in dir(_Servicer) if n.startswith("rpc_"))
IMPLEMENTED_ROUTER = sorted(n[4:] for n in dir(_RouterServicer) if n.startswith("rpc_"))


class FakeModal:
    """The fake control plane: `FakeModal(root).start()`, then `.env()` for a client; `.stop()` at the end."""

    def __init__(self, root: Path, *, token_id: str = TOKEN_ID, token_secret: str = TOKEN_SECRET,
                 schedule_delay_s: float = 0.0):
        self.root = Path(root)
        self.schedule_delay_s = schedule_delay_s  # how long a new sandbox's container takes to be scheduled
        self.tunnels_wait_cap_s = 50.0  # the longest one SandboxGetTunnels call waits for a container
        self.root.mkdir(parents=True, exist_ok=True)
        self.token_id, self.token_secret = token_id, token_secret
        self.port = 0
        self._calls: list[dict] = []
        self._calls_lock = threading.Lock()
        self._apps: dict[tuple[str, str], str] = {}
        self._environments: dict[str, str] = {}
        self._images: dict[str, api_pb2.Image] = {}
        self._image_by_digest: dict[str, str] = {}
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

    async def _start_blob_server(self) -> None:
        """The PUT target of BlobCreate (S3's part): stores the body, answers its md5 as the ETag."""
        from aiohttp import web

        async def put(request: web.Request) -> web.Response:
            body = await request.read()
            folder = self.root / "blobs" / "uploads"
            folder.mkdir(parents=True, exist_ok=True)
            (folder / request.match_info["blob_id"]).write_bytes(body)
            return web.Response(status=200, headers={"ETag": f'"{hashlib.md5(body).hexdigest()}"'})

        app = web.Application(client_max_size=1 << 34)
        app.router.add_put("/upload/{blob_id}", put)
        self._blob_runner = web.AppRunner(app)
        await self._blob_runner.setup()
        site = web.TCPSite(self._blob_runner, "127.0.0.1", 0)
        await site.start()
        self.blob_port = site._server.sockets[0].getsockname()[1]

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
        return {
            "MODAL_SERVER_URL": self.url,
            "MODAL_TOKEN_ID": self.token_id,
            "MODAL_TOKEN_SECRET": self.token_secret,
            # read when `modal` is imported: a file that does not exist, so no ~/.modal.toml profile is used
            "MODAL_CONFIG_PATH": str(self.root / "modal.toml"),
            "MODAL_DISABLE_API_PROXY": "1",  # never through an HTTP(S)_PROXY of the machine
        }

    def install(self, monkeypatch) -> "FakeModal":
        """Point this process's `modal` client here (a pytest monkeypatch undoes the environment)."""
        for k, v in self.env().items():
            monkeypatch.setenv(k, v)
        self.forget_env_client()
        return self

    @staticmethod
    def forget_env_client() -> None:
        """Drop this process's cached `modal.Client.from_env()` (it keeps the first server URL it saw)."""
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
        """Record a request; refuse it (UNAUTHENTICATED) without this fake's token (the router: a JWT)."""
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

    def _get(self, sandbox_id: str) -> _Sandbox:
        sb = self._sandboxes.get(sandbox_id)
        if sb is None:
            raise GRPCError(Status.NOT_FOUND, f"Sandbox {sandbox_id} not found")
        return sb

    def _handle_metadata(self, sb: _Sandbox) -> api_pb2.SandboxHandleMetadata:
        md = api_pb2.SandboxHandleMetadata(app_id=sb.app_id)
        if sb.result is not None:
            md.result.CopyFrom(sb.result)
        return md

    async def _create_sandbox(self, app_id: str, d: api_pb2.Sandbox, tags, envs: list[dict[str, str]], *,
                              v2: bool) -> _Sandbox:
        if app_id not in self._apps.values():
            raise GRPCError(Status.NOT_FOUND, f"App {app_id} not found")
        gpu = d.resources.gpu_config.gpu_type
        if gpu and gpu not in GPU_TYPES:
            raise GRPCError(Status.INVALID_ARGUMENT,
                            f"Unknown GPU type {gpu!r} (fake Modal); known types: {', '.join(GPU_TYPES)}")
        count, cap = d.resources.gpu_config.count, GPU_MAX_COUNT.get(gpu, 8)
        if gpu and not 1 <= count <= cap:
            raise GRPCError(Status.INVALID_ARGUMENT, f"{gpu} supports 1 to {cap} GPUs per container, not {count} "
                                                     "(fake Modal)")
        if d.image_id and d.image_id not in self._images:
            raise GRPCError(Status.NOT_FOUND, f"Image {d.image_id} not found")
        if d.name and any(s.app_id == app_id and s.name == d.name and s.result is None
                          for s in self._sandboxes.values()):
            raise GRPCError(Status.ALREADY_EXISTS, f"Sandbox with name '{d.name}' already exists in the app")
        if d.timeout_secs <= 0:
            raise GRPCError(Status.INVALID_ARGUMENT, "timeout must be positive")

        # a V1 id is 'sb-' + 22 alphanumerics (the client routes on that shape); a V2 id is anything else
        sb_id = new_id("sb") if not v2 else new_id("sb") + "v2"
        folder = self.root / "sandboxes" / sb_id
        (folder / "home").mkdir(parents=True)
        env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "ARTCLOUD_", "MODAL_"))}
        env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
        env["HOME"] = str(folder / "home")
        for extra in envs:
            env.update(extra)
        sb = _Sandbox(id=sb_id, task_id=new_id("ta") + ("V" if v2 else ""), app_id=app_id, name=d.name,
                      definition=d, tags={t.tag_name: t.tag_value for t in tags}, dir=folder, env_names=[],
                      created_at=time.time(), v2=v2)
        for i, spec in enumerate(d.open_ports.ports):
            local = free_port()
            tunnel = _Tunnel(container_port=spec.port, target_port=local, encrypted=not spec.unencrypted)
            env[f"FAKE_MODAL_PORT_{spec.port}"] = str(local)
            if i == 0:
                env["ARTCLOUD_PORT"] = str(local)
            await self._open_tunnel(sb, tunnel)
            sb.tunnels[spec.port] = tunnel
        env["MODAL_SANDBOX_ID"], env["MODAL_TASK_ID"] = sb.id, sb.task_id
        sb.env_names = sorted(env)
        sb.launch = (list(d.entrypoint_args) or ["sleep", "infinity"], env)
        sb.scheduled_at = time.monotonic() + self.schedule_delay_s
        self._sandboxes[sb.id] = sb
        if self.schedule_delay_s <= 0 and not await self._start_process(sb):
            return sb
        sb.monitor = asyncio.get_running_loop().create_task(self._watch(sb))
        return sb

    async def _start_process(self, sb: _Sandbox) -> bool:
        """The container's entrypoint as a local process; False when it could not start (the sandbox ended)."""
        args, env = sb.launch
        sb.launch = None
        with open(sb.stdout_path, "wb") as out, open(sb.stderr_path, "wb") as err:
            try:
                sb.proc = subprocess.Popen(args, cwd=sb.dir, env=env, stdin=subprocess.PIPE, stdout=out,
                                           stderr=err, start_new_session=True)
            except OSError as e:  # no such executable: the container's entrypoint fails
                err.write(f"{e}\n".encode())
                await self._finish(sb, _G(status=_G.GENERIC_STATUS_FAILURE, exitcode=127, exception=str(e)))
                return False
        sb.touch()
        return True

    async def _watch(self, sb: _Sandbox) -> None:
        d = sb.definition
        while sb.proc is None:  # the container is being scheduled
            if sb.result is not None:
                return
            if time.monotonic() >= sb.scheduled_at:
                if not await self._start_process(sb):
                    return
                break
            await asyncio.sleep(0.05)
        deadline = time.monotonic() + d.timeout_secs
        idle = d.idle_timeout_secs if d.HasField("idle_timeout_secs") and d.idle_timeout_secs > 0 else None
        while sb.result is None:
            code = sb.proc.poll()
            if code is not None:
                status = _G.GENERIC_STATUS_SUCCESS if code == 0 else _G.GENERIC_STATUS_FAILURE
                await self._finish(sb, _G(status=status, exitcode=code,
                                          exception="" if code == 0 else f"Sandbox exited with code {code}"))
                return
            now = time.monotonic()
            if now >= deadline:
                await self._finish(sb, _G(status=_G.GENERIC_STATUS_TIMEOUT,
                                          exception=f"Sandbox timed out after {d.timeout_secs} s"))
                return
            if idle is not None and sb.open_conns == 0 and now - sb.last_activity >= idle:
                await self._finish(sb, _G(status=_G.GENERIC_STATUS_TERMINATED,
                                          exception=f"Sandbox idle for {idle} s (idle_timeout)"))
                return
            await asyncio.sleep(0.1)

    async def _finish(self, sb: _Sandbox, result: api_pb2.GenericResult) -> None:
        """End a sandbox (the first result wins): tunnels closed, process group killed, waiters woken."""
        if sb.result is None:
            sb.result = result
            sb.finished_at = time.time()
            for t in sb.tunnels.values():
                _close_tunnel(t)
            if sb.proc is not None and sb.proc.stdin is not None:
                try:
                    sb.proc.stdin.close()
                except OSError:
                    pass
            sb.killing = asyncio.get_running_loop().create_task(_terminate_group(sb.proc))
        if sb.killing is not None:
            await asyncio.shield(sb.killing)
        sb.done.set()

    async def _open_tunnel(self, sb: _Sandbox, tunnel: _Tunnel) -> None:
        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            if sb.result is not None:
                writer.close()
                return
            tunnel.writers.add(writer)
            sb.open_conns += 1
            sb.touch()
            up_writer = None
            try:
                try:
                    up_reader, up_writer = await asyncio.open_connection("127.0.0.1", tunnel.target_port)
                except OSError:
                    return  # the server does not listen yet: the connection is just closed
                tunnel.writers.add(up_writer)
                await asyncio.gather(_pipe(reader, up_writer, sb), _pipe(up_reader, writer, sb))
            except (ConnectionError, OSError, asyncio.CancelledError):
                pass
            finally:
                sb.open_conns -= 1
                sb.touch()
                for w in (writer, up_writer):
                    if w is not None:
                        tunnel.writers.discard(w)
                        w.close()

        tunnel.server = await asyncio.start_server(
            handle, "127.0.0.1", 0, ssl=self._edge_ssl if tunnel.encrypted else None)
        tunnel.port = tunnel.server.sockets[0].getsockname()[1]


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, sb: _Sandbox) -> None:
    try:
        while data := await reader.read(65536):
            sb.touch()
            writer.write(data)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()
    except (ConnectionError, OSError):
        writer.close()


def _close_tunnel(tunnel: _Tunnel) -> None:
    if tunnel.server is not None:
        tunnel.server.close()
    for w in list(tunnel.writers):
        w.transport.abort()
    tunnel.writers.clear()


def _returncode(result: api_pb2.GenericResult | None) -> int | None:
    """As `Sandbox.returncode` reads a result (modal/sandbox/_common.py `_result_returncode`)."""
    if result is None or result.status == _G.GENERIC_STATUS_UNSPECIFIED:
        return None
    if result.status == _G.GENERIC_STATUS_TIMEOUT:
        return 124
    if result.status == _G.GENERIC_STATUS_TERMINATED:
        return 137
    return result.exitcode


def _group_members(pgid: int) -> list[int]:
    """The live processes of a process group (Linux /proc)."""
    out = []
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as fh:
                stat = fh.read()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[-1].split()
        if len(fields) > 3 and fields[0] != "Z" and int(fields[2]) == pgid:
            out.append(int(entry))
    return out


def _kill_group(proc: subprocess.Popen | None, sig: int) -> None:
    if proc is None:
        return
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


async def _terminate_group(proc: subprocess.Popen | None) -> None:
    """SIGTERM to the whole process group, SIGKILL after KILL_GRACE_S; returns once the leader is reaped."""
    if proc is None:
        return
    if proc.poll() is None:
        _kill_group(proc, signal.SIGTERM)
        deadline = time.monotonic() + KILL_GRACE_S
        while proc.poll() is None and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
    _kill_group(proc, signal.SIGKILL)  # the leader's leftovers too, as a container's end would
    while proc.poll() is None:
        await asyncio.sleep(0.05)

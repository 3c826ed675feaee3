"""The sandbox calls of the servicer, and a sandbox's stdout/stderr as the log streams read them.

Sandbox implementations: 1.6.4 creates a sandbox WITH a GPU through the V1 calls (`SandboxCreate`,
`SandboxGetTaskId`, `SandboxGetTunnels`, `SandboxWait`, `SandboxTerminate`, stdout/stderr by the
`SandboxGetLogs` stream) and one WITHOUT a GPU through the V2 calls (`AuthTokenGet`, `SandboxCreateV2`,
`SandboxWaitV2`, ...; ephemeral secrets inline; stdout/stderr by `SandboxStdioReadV2` on the "task command
router", which this same server also serves: the client accepts a plain-http router URL when the server URL
is localhost). The client routes on the id's shape: a V1 id is 'sb-' + 22 alphanumerics, a V2 id anything
else ('sb-' + 24 here).
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING

from google.protobuf import empty_pb2
from grpclib import GRPCError, Status
from modal_proto import api_pb2

from .common import _G, _fake_jwt
from .tunnels import _tunnel_protos

if TYPE_CHECKING:
    from .sandboxes import _Sandbox


class _SandboxRpcs:
    """The servicer's sandbox calls (`self.fake`: the FakeModal, whose `_Sandboxes` part does the work)."""

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

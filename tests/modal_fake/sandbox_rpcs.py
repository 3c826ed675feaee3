"""The sandbox calls of the servicer, and a sandbox's stdout/stderr as the log streams read them.

Sandbox implementations (paths in modal 1.6.4): a sandbox WITH a GPU is created through the V1 calls
(sandbox/_sandbox.py:72-81: `SandboxCreate`, then `SandboxGetTaskId` until scheduled, `SandboxGetTunnels`,
`SandboxWait`, `SandboxTerminate`, stdout/stderr by the `SandboxGetLogs` stream: sandbox/_impl_v1.py,
io_streams.py:34-50)
and one WITHOUT a GPU through the V2 calls (config "sandbox_v2" defaults to True: config.py:392; `AuthTokenGet`,
`SandboxCreateV2`, `SandboxWaitV2`, ...; ephemeral secrets inline; stdout/stderr by `SandboxStdioReadV2` on
the "task command router", which this same server also serves: the client accepts a plain-http router URL when
the server URL is localhost, sandbox/_task_command_router_client.py:346-351). The client routes on the id's
shape: a V1 id is 'sb-' + 22 alphanumerics (sandbox/_common.py:196-212), a V2 id anything else ('sb-' + 24 here).
Server semantics come from the field comments of api.proto as modal_proto ships them (api_pb2.pyi:N).
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
        """V1 create: the sandbox exists once this answers its id (_impl_v1.py:154-156); secrets by id
        (V1 turns `env` into one too: _impl_v1.py:137-140)."""
        f = self.fake
        for sid in req.definition.secret_ids:
            if sid not in f._secrets:
                raise GRPCError(Status.NOT_FOUND, f"Secret {sid} not found")
        envs = [f._secrets[sid] for sid in req.definition.secret_ids]
        sb = await f._create_sandbox(req.app_id, req.definition, req.tags, envs, v2=False)
        # `create_answers` cleared: the sandbox exists, its answer is held (a slow or lost answer). The client
        # waits for it with no deadline of its own (no attempt_timeout: modal/_utils/grpc_utils.py:506), and
        # a create cancelled meanwhile never learns the id (modal/sandbox/_impl_v1.py:154-156).
        while not f.create_answers.is_set():
            await asyncio.sleep(0.05)
        return api_pb2.SandboxCreateResponse(sandbox_id=sb.id, metadata=f._handle_metadata(sb))

    # --- sandboxes V2 (1.6.4's default for a sandbox without a GPU): the same calls, `*V2`; stdio through
    # the task command router, which this same server also serves (plain http is accepted on localhost) ---

    async def rpc_SandboxCreateV2(self, req, md):
        """V2 create: secrets by id or inline (`secret_sources`), and the answer carries the task id, the router's
        access and the tunnels known so far (a complete set is cached, else tunnels() asks: _impl_v2.py:191-221)."""
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

    async def rpc_SandboxGetCommandRouterAccess(self, req, md):  # V2's router, by sandbox or task (_impl_v2.py:103-113)
        f = self.fake
        if req.sandbox_id:
            f._get(req.sandbox_id)
        elif not any(sb.task_id == req.task_id for sb in f._sandboxes.values()):
            raise GRPCError(Status.NOT_FOUND, f"Task {req.task_id} not found")
        return api_pb2.SandboxGetCommandRouterAccessResponse(url=f.url, jwt=_fake_jwt())

    async def rpc_SandboxGetTaskId(self, req, md):
        """No task id until the container is scheduled: "an empty string if it is not scheduled yet"
        (modal/sandbox/_common.py:846), None "if the sandbox was terminated before a task could be scheduled",
        and `task_result` "if the task has already exited" (modal_proto/api_pb2.pyi:14723, 14726). Answered at
        once: 1.6.4 sends no `timeout` (api_pb2.pyi:14701; _impl_v1.py:368) and polls every 0.5 s itself
        (_impl_v1.py:369-380; _common.py:327). V1's create blocks on this (_impl_v1.py:158-161)."""
        sb = self.fake._get(req.sandbox_id)
        resp = api_pb2.SandboxGetTaskIdResponse()
        if sb.scheduled or sb.v2:  # V2: as SandboxCreateV2 answers (below); not checkable when unscheduled
            resp.task_id = sb.task_id
        if sb.result is not None:
            resp.task_result.CopyFrom(sb.result)
        return resp

    async def rpc_SandboxGetTunnels(self, req, md):
        """A long poll of up to `timeout` s (_impl_v1.py:356-362) for a running container's tunnels;
        GENERIC_STATUS_TIMEOUT when there is none yet, which the client raises as SandboxTimeoutError
        (_common.py:836-840). TunnelData as the client reads it (_common.py:365-366; _tunnel.py:29-43)."""
        sb = self.fake._get(req.sandbox_id)
        deadline = time.monotonic() + max(min(req.timeout, self.fake.tunnels_wait_cap_s), 0)
        while not sb.started and time.monotonic() < deadline:  # a container still being scheduled
            await asyncio.sleep(0.05)
        if not sb.started:
            return api_pb2.SandboxGetTunnelsResponse(result=_G(status=_G.GENERIC_STATUS_TIMEOUT))
        return api_pb2.SandboxGetTunnelsResponse(result=_G(status=_G.GENERIC_STATUS_SUCCESS),
                                                 tunnels=_tunnel_protos(sb))

    async def rpc_SandboxStdinWrite(self, req, md):
        """The bytes go to the process, `eof` closes its stdin (io_streams.py:724-727). That a write counts as
        activity for idle_timeout is Modal's docs, not checkable from the 1.6.4 client."""
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
        """A long poll of up to `timeout` s (10 from wait(), 0 from poll() and from_id: _common.py:819-825;
        _impl_v1.py:340-354, 186-187); the result once there is one."""
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
        """A no-op on a finished sandbox (_sandbox.py:1083), whose result comes back as `existing_result`
        (api_pb2.pyi:15551)."""
        sb = self.fake._get(req.sandbox_id)
        existing = sb.result
        await self.fake._finish(sb, _G(status=_G.GENERIC_STATUS_TERMINATED, exception="Sandbox terminated"))
        resp = api_pb2.SandboxTerminateResponse()
        if existing is not None:
            resp.existing_result.CopyFrom(existing)
        return resp

    async def rpc_SandboxGetLogs(self, req, md):
        """Batches from `last_entry_id` on, each with the entry id to go on from, for up to `timeout` s (55 from
        the client), then `eof` once the sandbox has ended and all was read (io_streams.py:34-50, 136-158)."""
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
        """The running sandbox of that name in the app, or with `include_terminated` the most recent one
        (_sandbox.py:554-555); NOT_FOUND -> NotFoundError. from_name asks V2 first, then V1 (_sandbox.py:568-581);
        whether Modal's V2 lookup also finds V1 sandboxes is not checkable: here each finds its own."""
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
        """Newest first, pages by `before_timestamp` until an empty one, only running ones unless
        `include_finished`, and those with at least the given tags (sandbox/_sandbox.py:1378-1379, 1436-1464).
        A sandbox not yet scheduled is listed (it is not finished); Modal's own answer there is not checkable."""
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

    async def rpc_SandboxTagsGet(self, req, md):  # _impl_v1.py:270-271; tags as set at create (_common.py:369-374)
        sb = self.fake._get(req.sandbox_id)
        return api_pb2.SandboxTagsGetResponse(
            tags=[api_pb2.SandboxTag(tag_name=k, tag_value=v) for k, v in sb.tags.items()])

    async def rpc_SandboxTagsSet(self, req, md):  # "replaces the Sandbox's entire tag set" (_sandbox.py:733)
        sb = self.fake._get(req.sandbox_id)
        sb.tags = {t.tag_name: t.tag_value for t in req.tags}
        return empty_pb2.Empty()


    async def rpc_SandboxGetFromNameV2(self, req, md):
        return await self.rpc_SandboxGetFromName(req, md, v2=True)

    # the V2 calls take and give the V1 messages (modal_proto/api_grpc.py's V2 methods use the same types)
    rpc_SandboxGetTaskIdV2 = rpc_SandboxGetTaskId
    rpc_SandboxGetTunnelsV2 = rpc_SandboxGetTunnels
    rpc_SandboxWaitV2 = rpc_SandboxWait
    rpc_SandboxTerminateV2 = rpc_SandboxTerminate
    rpc_SandboxListV2 = rpc_SandboxList
    rpc_SandboxTagsGetV2 = rpc_SandboxTagsGet
    rpc_SandboxTagsSetV2 = rpc_SandboxTagsSet


async def _read_output(sb: "_Sandbox", stderr: bool, offset: int, timeout: float | None):
    """(offset, bytes) chunks of a sandbox's stdout or stderr from `offset` (the entry id the client sends back:
    io_streams.py:41-44), following the file while the sandbox runs; (offset, None) once it has ended and
    everything was read. Stops after `timeout` s. Chunks end on whole UTF-8 characters: TaskLogs.data is a
    string (api_pb2.pyi:17285)."""
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

"""The gRPC servicers: Modal's API (`ModalClientBase`) and the V2 sandboxes' task command router, both served
by FakeModal's one grpclib server. Each request is recorded (and its token checked) before it is answered.

Only the calls the sandbox flows need are implemented (in images.py, sandbox_rpcs.py and here); every other RPC
answers UNIMPLEMENTED with its name, which the client raises as `modal.exception.UnimplementedError` (exception.py:29).
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING

from grpclib import GRPCError, Status
from modal_proto import api_pb2
from modal_proto import task_command_router_pb2 as sr_pb2
from modal_proto.api_grpc import ModalClientBase
from modal_proto.task_command_router_grpc import TaskCommandRouterBase

from .common import IMAGE_BUILDER_VERSION, _fake_jwt, new_id
from .images import _ImageRpcs
from .sandbox_rpcs import _read_output, _SandboxRpcs

if TYPE_CHECKING:
    from .fake import FakeModal


class _Servicer(_ImageRpcs, _SandboxRpcs, ModalClientBase):
    """The implemented RPCs: `rpc_X(req, metadata)` returns the response (a unary call) or is an async
    generator of responses (a server-streaming call). Everything else: UNIMPLEMENTED, by name."""

    def __init__(self, fake: "FakeModal"):
        self.fake = fake

    # --- session, apps, environments ---------------------------------------------------------------

    async def rpc_ClientHello(self, req, md):  # modal/client.py:294
        return api_pb2.ClientHelloResponse(image_builder_version=IMAGE_BUILDER_VERSION)

    async def rpc_AuthTokenGet(self, req, md):  # V2's input-plane token (_utils/auth_token_manager.py:136-159)
        return api_pb2.AuthTokenGetResponse(token=_fake_jwt())

    async def rpc_AppGetOrCreate(self, req, md):
        """App.lookup: created only with OBJECT_CREATION_TYPE_CREATE_IF_MISSING, else NOT_FOUND (app.py:471-477)."""
        f = self.fake
        key = (req.environment_name or "main", req.app_name)
        if key not in f._apps:
            if req.object_creation_type != api_pb2.OBJECT_CREATION_TYPE_CREATE_IF_MISSING:
                raise GRPCError(Status.NOT_FOUND, f"App '{req.app_name}' not found")
            f._apps[key] = new_id("ap")
        return api_pb2.AppGetOrCreateResponse(app_id=f._apps[key])

    async def rpc_EnvironmentGetOrCreate(self, req, md):  # gives the image builder version (_image.py:380-384)
        name = req.deployment_name or "main"
        env_id = self.fake._environments.setdefault(name, new_id("en"))
        meta = api_pb2.EnvironmentMetadata(
            name=name, settings=api_pb2.EnvironmentSettings(image_builder_version=IMAGE_BUILDER_VERSION))
        return api_pb2.EnvironmentGetOrCreateResponse(environment_id=env_id, metadata=meta)


class _RouterServicer(TaskCommandRouterBase):
    """The task command router of V2 sandboxes (same server, same loop): their stdout/stderr."""

    def __init__(self, fake: "FakeModal"):
        self.fake = fake

    async def rpc_SandboxStdioReadV2(self, req, md):
        """A V2 sandbox's stdout/stderr from `offset`, to the end of the output (the task command router's
        stream, read by sandbox/_task_command_router_client.py:627-666)."""
        sb = next((s for s in self.fake._sandboxes.values() if s.task_id == req.task_id), None)
        if sb is None:
            raise GRPCError(Status.NOT_FOUND, f"Task {req.task_id} not found")
        stderr = req.file_descriptor == sr_pb2.SANDBOX_STDIO_FILE_DESCRIPTOR_STDERR
        async for start, data in _read_output(sb, stderr, req.offset, None):
            if data is None:
                return  # the end of the stream is the end of the output
            yield sr_pb2.SandboxStdioReadV2Response(data=data, starting_offset=start)


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

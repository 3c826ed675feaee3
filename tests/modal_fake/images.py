"""What a sandbox is made from: images (recorded, not built), mounts and blobs (local files), secrets.

Paths are in modal 1.6.4 (site-packages/modal/).

- IMAGES ARE RECORDED, NOT BUILT: `ImageGetOrCreate` stores each layer's definition (dockerfile commands,
  base images, context mount). A layer seen before answers with its result (a cache hit); a new one answers
  without, and the client joins its build with `ImageJoinStreaming` until a result comes (_image.py:849-866,
  535-567). No build step (`pip_install`, `run_commands`, ...) is executed: a new layer is "built"
  `build_delay_s` after it was first asked for (default 0; inf: never), the fake's control for a slow build.
- Local files (`add_local_file`, `copy=True` or not) go through the Mount calls (mount.py:529-536, 630-655,
  693-715) and are stored by sha256 under `ROOT/blobs/`; files of 4 MiB and more (LARGE_FILE_LIMIT,
  _utils/blob_utils.py:44) take the blob path (`BlobCreate`, then an HTTP PUT to this fake's small upload
  server, then `MountPutFile(data_blob_id)`: _utils/blob_utils.py:283-320).
- Secrets: `SecretGetOrCreate` stores an env dict under a new id (and under its name when it has one; from_dict:
  secret.py:216-229, from_name: secret.py:471-477); a sandbox's environment gets the env dicts of its secrets
  (see sandboxes.py). Recorded requests show "<secret>" instead of the values.
"""

from __future__ import annotations

import asyncio
import hashlib
import time

from grpclib import GRPCError, Status
from modal_proto import api_pb2

from .common import _G, IMAGE_BUILDER_VERSION, new_id


class _ImageRpcs:
    """The servicer's image, secret and mount calls (`self.fake`: the FakeModal)."""

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
            f._image_since[image_id] = time.monotonic()
            return api_pb2.ImageGetOrCreateResponse(image_id=image_id)
        if not self._built(image_id):  # still building: no result, the client joins it (_image.py:855-863)
            return api_pb2.ImageGetOrCreateResponse(image_id=image_id)
        return api_pb2.ImageGetOrCreateResponse(image_id=image_id, result=_G(status=_G.GENERIC_STATUS_SUCCESS),
                                                metadata=meta)

    def _built(self, image_id: str) -> bool:
        """A layer is built `build_delay_s` after it was first asked for (FakeModal's control; inf: never)."""
        return time.monotonic() >= self.fake._image_since[image_id] + self.fake.build_delay_s

    async def rpc_ImageJoinStreaming(self, req, md):
        if req.image_id not in self.fake._images:
            raise GRPCError(Status.NOT_FOUND, f"Image {req.image_id} not found")
        # A long poll of up to the request's `timeout` (1.6.4 asks 55 s: _image.py:542); a build not done by
        # then ends the stream without a result, and the client joins again (_image.py:559-566).
        deadline = time.monotonic() + req.timeout
        while not self._built(req.image_id):
            if time.monotonic() >= deadline:
                return
            await asyncio.sleep(0.05)
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
        """from_dict sends `env_dict` (secret.py:216-229); from_name a `deployment_name` alone (secret.py:471-477):
        NOT_FOUND -> NotFoundError when no such secret exists."""
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

    async def rpc_MountBatchedCheckExistence(self, req, md):  # the hashes not stored yet (mount.py:529-536)
        missing = [h for h in req.sha256_hex_hashes if not (self.fake.root / "blobs" / h).exists()]
        return api_pb2.MountBatchedCheckExistenceResponse(missing_sha256_hex_hashes=missing)

    async def rpc_MountPutFile(self, req, md):  # data or an uploaded blob; `exists` once stored (mount.py:637-655)
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

    async def rpc_MountGetOrCreate(self, req, md):  # the files by name and sha256 (mount.py:693-715)
        mount_id = new_id("mo")
        self.fake._mounts[mount_id] = [(mf.filename, mf.sha256_hex) for mf in req.files]
        return api_pb2.MountGetOrCreateResponse(mount_id=mount_id, handle_metadata=api_pb2.MountHandleMetadata())


class _BlobServer:
    """FakeModal's part that serves blob uploads (its `root`; sets `_blob_runner` and `blob_port`)."""

    async def _start_blob_server(self) -> None:
        """The PUT target of BlobCreate (S3's part): stores the body, answers its md5 as the ETag, which the
        client checks (_utils/blob_utils.py:151-155)."""
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

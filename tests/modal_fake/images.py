"""What a sandbox is made from: images (recorded, not built), mounts and blobs (local files), secrets.

- IMAGES ARE RECORDED, NOT BUILT: `ImageGetOrCreate` stores each layer's definition (dockerfile commands,
  base images, context mount) and a new layer is "built" at once by `ImageJoinStreaming`; no build step
  (`pip_install`, `run_commands`, ...) is executed. Local files (`add_local_file`, `copy=True` or not) go
  through the Mount calls and are stored by sha256 under `ROOT/blobs/`; files of 4 MiB and more take the blob
  path (`BlobCreate`, then an HTTP PUT to this fake's small upload server, then `MountPutFile(data_blob_id)`).
- Secrets: `SecretGetOrCreate` stores an env dict under a new id (and under its name when it has one); a
  sandbox's environment gets the env dicts of its secrets (see sandboxes.py). Recorded requests show
  "<secret>" instead of the values.
"""

from __future__ import annotations

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


class _BlobServer:
    """FakeModal's part that serves blob uploads (its `root`; sets `_blob_runner` and `blob_port`)."""

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

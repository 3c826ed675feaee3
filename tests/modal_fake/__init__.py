"""A fake Modal control plane on loopback, for the REAL `modal` client (1.6.4).

The client speaks gRPC (grpclib) to `MODAL_SERVER_URL`; this package serves `modal_proto.api_grpc.ModalClientBase`
on 127.0.0.1 over plain HTTP/2 (the client accepts `http://`: TLS only when the scheme is `https`,
modal/_utils/grpc_utils.py:384-392). What is behind each call is real where it can be; each module's docstring
says how, for its part, and every behaviour cites the modal 1.6.4 file:line it follows (client source, or a field's
comment from api.proto as modal_proto/api_pb2.pyi carries it). A rule found only in Modal's docs says so; such
rules are kept to what a test needs (the idle-timeout activity), so the fake and artcloud do not agree by
construction (GPU types and counts, the 24 h cap: not enforced here).

Timing is driven by the fake's controls, never by sleeps: `schedule_delay_s` (inf: never scheduled),
`tunnels_wait_cap_s`, `build_delay_s` (inf: a build that never ends) and `create_answers` (a threading.Event:
cleared, SandboxCreate's answer is held).

- `fake.py`: `FakeModal`, the object a test holds: start/stop, `env()`, what a test inspects, the recording
  and token check of every request.
- `sandboxes.py`: a sandbox as a local process: its environment, scheduling delay, timers (`timeout`,
  `idle_timeout`), termination of its process group, the GPU checks.
- `tunnels.py`: the TLS-terminating (or plain) TCP proxies to a sandbox's ports, and what counts as their activity.
- `images.py`: images (recorded, not built), mounts and blobs (local files, by sha256), secrets.
- `sandbox_rpcs.py`: the sandbox calls, V1 (with a GPU) and V2 (without), and their stdout/stderr streams.
- `servicer.py`: the gRPC servicers (Modal's API and the task command router) and their wiring: every RPC
  not implemented answers UNIMPLEMENTED with its name.
- `common.py`: ids, tokens, constants.

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

from .common import (
    IMAGE_BUILDER_VERSION,
    KILL_GRACE_S,
    TOKEN_ID,
    TOKEN_SECRET,
    free_port,
    new_id,
)
from .fake import FakeModal
from .servicer import IMPLEMENTED, IMPLEMENTED_ROUTER

__all__ = [
    "FakeModal",
    "IMAGE_BUILDER_VERSION",
    "IMPLEMENTED",
    "IMPLEMENTED_ROUTER",
    "KILL_GRACE_S",
    "TOKEN_ID",
    "TOKEN_SECRET",
    "free_port",
    "new_id",
]

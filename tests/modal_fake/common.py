"""Constants, object ids, tokens, and the scrubbing of recorded requests (secret values, file contents)."""

from __future__ import annotations

import base64
import json
import secrets as _secrets
import socket
import string
import time
from typing import Any

from modal_proto import api_pb2

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

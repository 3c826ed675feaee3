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

TOKEN_ID = "ak-fakemodaltest"  # sent as x-modal-token-id / -secret metadata (modal/client.py:70-71)
TOKEN_SECRET = "as-fakemodaltest"
# the environment's image builder version (EnvironmentSettings), which the client builds for (modal/_image.py:380-384)
IMAGE_BUILDER_VERSION = "2025.06"
KILL_GRACE_S = 5.0  # SIGTERM, then SIGKILL: this fake's choice (Modal's own grace is not in the client)
_ALNUM = string.digits + string.ascii_letters
_G = api_pb2.GenericResult


def new_id(prefix: str) -> str:
    """An object id shaped like Modal's: PREFIX-, then 22 alphanumerics. The client checks the prefix on
    hydration (modal/_object.py:182-188) and routes a sandbox as V1 on exactly this shape
    (sandbox/_common.py:196-212)."""
    return f"{prefix}-" + "".join(_secrets.choice(_ALNUM) for _ in range(22))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _fake_jwt(lifetime_s: float = 3600) -> str:
    """AuthTokenGet's token and the router's: the client reads only the payload's `exp`
    (modal/_utils/auth_token_manager.py:155-159); nothing checks the signature here."""
    def b64(d: dict) -> str:
        return base64.urlsafe_b64encode(json.dumps(d).encode()).decode().rstrip("=")

    return f"{b64({'alg': 'none', 'typ': 'JWT'})}.{b64({'exp': int(time.time() + lifetime_s), 'sub': 'fake'})}.sig"


# where secret values travel: SecretGetOrCreate.env_dict (modal/secret.py:216-229), V2's inline SecretSource.env
_SECRET_KEYS = ("env_dict", "env", "ephemeral_secrets")


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

"""What the server's child processes (vLLM, the sharded trainer's ranks) share: they never outlive the server,
they are stopped with their whole process group, and they get the server's environment less its secrets."""

from __future__ import annotations

import os
import signal
from typing import Mapping


def die_with_parent() -> None:
    """Run in the child before exec (Linux): SIGTERM when the server dies, and a process group of its own, so
    that its workers are stopped with it."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except Exception:
        pass
    os.setsid()


def kill_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def child_env(env: Mapping[str, str]) -> dict[str, str]:
    """The server's environment less its secrets: none of artcloud's (the token, the TLS key, S3), no AWS
    credentials, nothing named like a secret but the hub's token (a child may fetch a model or tokenizer)."""
    def secret(name: str) -> bool:
        upper = name.upper()
        words = upper.split("_")
        return upper.startswith(("ARTCLOUD_", "AWS_")) or not upper.startswith(("HF_", "HUGGING_FACE_")) and (
            words[-1] == "KEY" or not {"TOKEN", "SECRET", "PASSWORD", "CREDENTIALS"}.isdisjoint(words))

    return {k: v for k, v in env.items() if not secret(k)}

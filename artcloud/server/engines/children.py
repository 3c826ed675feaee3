"""What the server's child processes (vLLM, the sharded trainer's ranks) share: they never outlive the server,
they are stopped with their whole process group, and they get the server's environment less its secrets; and
where the sharded trainer's ranks on several nodes meet (`Rendezvous`)."""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass, field
from typing import Mapping

from artcloud.errors import InvalidArgument

KEY_ENV = "ARTCLOUD_TRAINER_KEY"  # the secret the trainer nodes share (not the client's token): sharded.Sealed
MIN_KEY_CHARS = 32


@dataclass(frozen=True)
class Rendezvous:
    """The sharded trainer over `nodes` nodes: torchrun's static rendezvous at `master` (HEAD_IP:PORT, the head, node
    0, where global rank 0 runs under the server's control); `artcloud trainer-node` runs the other nodes' ranks. `key`:
    the trainer nodes' shared secret, which every rank proves before the group trains (torchrun's store has none)."""

    nodes: int
    master: str
    key: str = field(repr=False)

    def __post_init__(self) -> None:
        host, _, port = self.master.rpartition(":")
        if self.nodes < 1 or not host or not port.isdigit():
            raise InvalidArgument(f"a rendezvous is N nodes (1 or more) at HOST:PORT, not {self.nodes} at {self.master!r}")
        if len(self.key) < MIN_KEY_CHARS:
            raise InvalidArgument(f"{KEY_ENV} must be set to the trainer nodes' shared secret, {MIN_KEY_CHARS} characters "
                                  "or more, the same on every trainer node (SkyBackend sets it; by hand: "
                                  "python -c 'import secrets; print(secrets.token_hex(32))')", field=KEY_ENV)

    def torchrun(self, procs: int, node_rank: int) -> list[str]:
        """torchrun's arguments for this node's `procs` ranks."""
        host, _, port = self.master.rpartition(":")
        return ["--nnodes", str(self.nodes), "--node-rank", str(node_rank), "--master-addr", host,
                "--master-port", port, "--nproc-per-node", str(procs)]


def die_with_parent(own_group: bool = True) -> None:
    """Run in the child before exec (Linux): SIGTERM when its parent dies, and (`own_group`) a process group of its
    own, so that its workers are stopped with it."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except Exception:
        pass
    if own_group:
        os.setsid()


def kill_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


KEPT = {"ARTCLOUD_CACHE"}  # artcloud's settings a child needs: where the models are (else each child fetches its own)


def child_env(env: Mapping[str, str]) -> dict[str, str]:
    """The server's environment less its secrets: none of artcloud's (the token, the TLS key, S3) but KEPT, no AWS
    credentials, nothing named like a secret but the hub's token (a child may fetch a model or tokenizer)."""
    def secret(name: str) -> bool:
        upper = name.upper()
        if upper in KEPT:
            return False
        words = upper.split("_")
        return upper.startswith(("ARTCLOUD_", "AWS_")) or not upper.startswith(("HF_", "HUGGING_FACE_")) and (
            words[-1] == "KEY" or not {"TOKEN", "SECRET", "PASSWORD", "CREDENTIALS"}.isdisjoint(words))

    return {k: v for k, v in env.items() if not secret(k)}

"""K ranks on this machine with nothing on the network: what runs the sharded trainer's ranks on one node.

torchrun's own rendezvous (`--standalone`, or static) is a TCPStore that listens on every interface with no
secret, and its agent unpickles what it reads from it: anyone who reached the port ran code as the server
(security review 3, N1). Here there is no store on the network: the ranks meet in a FileStore, a file in the
server's mode-0700 folder, and gloo (or NCCL's bootstrap) listens on the loopback interface only. What torchrun
did besides is kept: each rank gets RANK, LOCAL_RANK, WORLD_SIZE and LOCAL_WORLD_SIZE; the first rank that fails
stops the others, and the group exits with its code; a group that is told to stop (SIGTERM, or its parent dying)
stops its ranks first.

    python -m artcloud.server.engines.local_group K FOLDER -- COMMAND...   # COMMAND run K times, rank 0 .. K-1

`join_world` (sharded.py) reads STORE_ENV to meet the others."""

from __future__ import annotations

import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from functools import partial
from pathlib import Path

from artcloud.errors import ArtcloudError, InvalidArgument, NotSupported
from artcloud.server.engines.children import KEY_ENV, die_with_parent

STORE_ENV = "ARTCLOUD_RANK_STORE"  # the FileStore's path, in a folder only this user can open


def loopback_interface() -> str:
    """The loopback interface's name (Linux: lo, macOS: lo0), for gloo's and NCCL's *_SOCKET_IFNAME."""
    names = [name for _, name in socket.if_nameindex()]
    for name in ("lo", "lo0"):
        if name in names:
            return name
    raise NotSupported(f"no loopback interface among {names}: the ranks would listen on the network")


def rank_env(env: dict[str, str], rank: int, size: int, store: Path, lo: str) -> dict[str, str]:
    return {**env, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(size), "LOCAL_WORLD_SIZE": str(size),
            STORE_ENV: str(store), "GLOO_SOCKET_IFNAME": lo, "NCCL_SOCKET_IFNAME": lo}


def check_folder(folder: Path) -> None:
    """The store's folder: this user's, mode 0700 (tempfile.mkdtemp makes it so), not a link."""
    st = os.lstat(folder)
    if not os.path.isdir(folder) or os.path.islink(folder) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise InvalidArgument(f"{folder} must be a folder of this user's, mode 0700: the ranks' store would be open to "
                              "others")


def run(procs: int, folder: Path, command: list[str], *, poll_s: float = 0.2) -> int:
    """Run `command` as ranks 0..procs-1 and wait: 0 when every rank exits 0; else the first failed rank's code
    (a signal: 128 + its number), once the others are stopped."""
    check_folder(folder)
    store = folder / "store"
    if store.exists():
        store.unlink()  # a FileStore left by an earlier group would hand this one its keys
    lo = loopback_interface()
    env = {KEY_ENV: secrets.token_hex(32), **os.environ}  # the group's key (sharded.Sealed): the caller's, or its own
    ranks = [subprocess.Popen(command, env=rank_env(env, r, procs, store, lo), stdin=subprocess.DEVNULL,
                              preexec_fn=partial(die_with_parent, own_group=False)) for r in range(procs)]
    stopping = False

    def stop(signum: int, frame: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    failed: int | None = None
    while failed is None and not stopping:
        codes = [p.poll() for p in ranks]
        bad = [c for c in codes if c not in (None, 0)]
        if bad:
            failed = 128 - bad[0] if bad[0] < 0 else bad[0]
        elif all(c == 0 for c in codes):
            return 0
        else:
            time.sleep(poll_s)
    for p in ranks:  # the failed rank's peers wait in a collective for its answer: stop them
        if p.poll() is None:
            p.terminate()
    deadline = time.monotonic() + 10.0
    for p in ranks:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    return failed if failed is not None else 128 + signal.SIGTERM


def main(argv: list[str]) -> int:
    if len(argv) < 4 or argv[2] != "--" or not argv[0].isdigit() or int(argv[0]) < 1:
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    try:
        return run(int(argv[0]), Path(argv[1]), argv[3:])
    except (OSError, ArtcloudError) as e:
        print(f"local_group: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""A training POST's body, parsed where it cannot freeze the server (security review 3).

pydantic-core parses JSON into a tree of its own before it validates, and holds the GIL while it does: 100 MB
of tiny logprob entries took 11 s and 4 GB, with the event loop stalled for 6 s of it. So a body up to
IN_THREAD_MAX_BYTES (a few tens of milliseconds of parsing) is parsed in a worker thread; a bigger one in a
child process (`python -m artcloud.server.train_body`: ~0.2 s to start), which frees its memory when it exits
and shares no GIL with the loop. Either way the answer is (the request, its hash) or the first error, as
FastAPI reports a body's errors. How many bodies are parsed at once is the app's --max-train-bodies.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import pickle
import resource
import sys
from functools import partial
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from artcloud import wire
from artcloud.server.api_errors import ApiError
from artcloud.server.engines.children import child_env

IN_THREAD_MAX_BYTES = 4 << 20
# The child's bounds (security review 3, N9): its address space (a 108.7 MiB body took ~3.6 GB to parse: ~33 x), a
# wall-clock limit, and first in line for the kernel's OOM killer, so that under memory pressure a parse dies, not
# the server.
CHILD_MEMORY_PER_BODY_BYTE = 48
CHILD_MEMORY_BASE = 1 << 30  # the interpreter, pydantic and artcloud's wire module
CHILD_TIMEOUT_S = 300.0
BODY_DEADLINE_S = 600.0  # a training body arrives whole within this, from its first bytes (128 MiB at ~220 KB/s)
# How the child starts: isolated (-I: no PYTHON* variables, no user site, not the working folder on sys.path), with
# this artcloud first on its path.
CHILD_CODE = "import sys; sys.path.insert(0, sys.argv[1]); from artcloud.server.train_body import main; main()"

Parsed = tuple[wire.TrainRequest, str]  # the request and its hash
Invalid = dict[str, Any]  # its first error: loc (from "body"), msg, type


def parse(raw: bytes) -> Parsed | Invalid:
    try:
        req = wire.TrainRequest.model_validate_json(raw)
    except ValidationError as e:
        first = e.errors(include_url=False, include_input=False, include_context=False)[0]  # fail_fast lists: few
        loc = first["loc"]
        if loc[-3:-1] == ("logprobs", "content") and wire.NOT_AN_ENTRY not in first["msg"]:
            loc = (*loc, "logprob")  # an entry parses to its logprob (wire.TokenLogprob): that is what was wrong
        return {"loc": ("body", *loc), "msg": first["msg"], "type": first["type"]}
    return req, request_hash(req)


def request_hash(request: wire.TrainRequest) -> str:
    """What a retried POST must repeat: the request as parsed (fields in the model's order, whatever order
    the JSON had), less its idempotency key. Dumped by pydantic-core straight to bytes: no dict tree."""
    return hashlib.sha256(request.model_dump_json(exclude={"idempotency_key"}).encode()).hexdigest()


async def parse_off_loop(raw: bytes) -> Parsed | Invalid:
    if len(raw) <= IN_THREAD_MAX_BYTES:
        return await asyncio.to_thread(parse, raw)
    package_root = str(Path(__file__).resolve().parents[2])
    memory = CHILD_MEMORY_BASE + CHILD_MEMORY_PER_BODY_BYTE * len(raw)
    child = await asyncio.create_subprocess_exec(
        sys.executable, "-I", "-c", CHILD_CODE, package_root,
        env=child_env(os.environ),  # not the server's token or keys: the parser needs none
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL,
        preexec_fn=partial(_bounded, memory))
    timed_out = False
    try:
        out, _ = await asyncio.wait_for(child.communicate(raw), CHILD_TIMEOUT_S)
    except asyncio.TimeoutError:
        timed_out, out = True, b""
    finally:
        if child.returncode is None:  # cancelled (the client went away), or too slow: no parser outlives its request
            child.kill()
            await child.wait()
    if timed_out:
        raise ApiError(503, "parse_failed", f"parsing the request body took over {CHILD_TIMEOUT_S:.0f} s: send fewer "
                       "groups per request")
    if child.returncode != 0 or not out:  # killed, out of memory
        raise ApiError(503, "parse_failed", f"parsing the request body failed (its parser process exited with code "
                       f"{child.returncode}; it may use {memory >> 20} MiB): retry, and if it fails again send fewer "
                       "groups per request")
    # The child is this module, run by this server on bytes it validated: its pickle is ours, not the client's.
    return pickle.loads(out)


def _bounded(memory: int) -> None:
    """Run in the parser child before exec: at most `memory` bytes of address space, and the OOM killer's first pick.
    (Nothing is imported here: after a fork of a server with threads, an import could wait on a lock for ever.)"""
    try:
        resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    except (ValueError, OSError):  # a platform without it (macOS refuses RLIMIT_AS)
        pass
    try:
        with open("/proc/self/oom_score_adj", "w") as f:
            f.write("1000")
    except OSError:  # not Linux
        pass


def main() -> None:
    result = parse(sys.stdin.buffer.read())
    sys.stdout.buffer.write(pickle.dumps(result, protocol=pickle.HIGHEST_PROTOCOL))


if __name__ == "__main__":
    main()

"""Sandboxes: each one a local process, with Modal's scheduling, timers and end.

Paths below without a package are in modal 1.6.4 (site-packages/modal/); "api_pb2.pyi:N" is a field's comment
from api.proto, as modal_proto 1.6.4 ships it. Where a rule is only in Modal's docs, it says so.

- The process (this fake's own stand-in for a container): the entrypoint args (`definition.entrypoint_args`,
  sandbox/_common.py:506) as a local process (`subprocess.Popen`, its own session/process group) in
  `ROOT/sandboxes/SB_ID/` (also its HOME), stdout/stderr to files there. Its environment: this machine's
  `os.environ` minus `AWS_*`, `ARTCLOUD_*` and `MODAL_*`, then the secrets' env dicts (`secret_ids`), then the
  "edge" overrides: `ARTCLOUD_PORT` = a free local port (the first opened port is remapped there: the command
  must listen on `${ARTCLOUD_PORT:-8443}`), `FAKE_MODAL_PORT_<P>` for every opened port P, `MODAL_SANDBOX_ID`
  and `MODAL_TASK_ID` (the client reads the latter inside a container: experimental/flash.py:47). PATH starts
  with this interpreter's bin folder, so `artcloud` and `python` are this venv's.
- Scheduling (`schedule_delay_s`, `math.inf`: never): a new sandbox's container is scheduled that long after its
  create. Until then a V1 sandbox (every one with a GPU: sandbox/_sandbox.py:72-81) has no task id:
  `SandboxGetTaskId` answers an empty one (sandbox/_common.py:843-852; api_pb2.pyi:14723), so the real
  client's `Sandbox.create` keeps polling inside (sandbox/_impl_v1.py:158-161, every 0.5 s: _common.py:327)
  and, after `_SANDBOX_SCHEDULING_TIMEOUT` (21 min: _impl_v1.py:88), terminates the sandbox and raises
  ResourceExhaustedError (_impl_v1.py:164-171). A V2 sandbox (no GPU) gets its task id in SandboxCreateV2's
  answer, and create returns at once (_impl_v2.py:201-221); what real Modal answers there before scheduling is
  not checkable from the client. For both, `SandboxGetTunnels` waits up to its request's `timeout` while the
  container is not running and then answers GENERIC_STATUS_TIMEOUT, which the client raises as
  `SandboxTimeoutError` (sandbox/_common.py:836-840). One call waits at most `tunnels_wait_cap_s` (50 s)
  whatever it asks: how long Modal's server holds this long poll is not in the client, so a caller must ask again.
- Timers. `timeout` ("The max lifetime of a sandbox in seconds", api_pb2.pyi:13873) ends it with result TIMEOUT:
  `returncode` 124 (sandbox/_common.py:215-222), and `wait()` raises `SandboxTimeoutError` even with
  `raise_on_termination=False` (_common.py:828-833). `idle_timeout`: the proto says only "If set, the sandbox
  will be terminated after being idle for this duration" (api_pb2.pyi:13932); WHAT COUNTS AS ACTIVITY IS
  MODAL'S DOCS, NOT CHECKABLE FROM THE 1.6.4 CLIENT (its guide: an open TCP connection through a tunnel, a
  running `exec`, stdin writes). This fake takes that reading and no more: an open tunnel connection (and its
  traffic) and `SandboxStdinWrite` reset the timer; the process's own work and output do not. `exec` is not
  implemented. Idle -> result TERMINATED (`returncode` 137; what real Modal reports here is not checkable).
  The 24 h cap on `timeout` is also Modal's docs only: the fake does not enforce it.
- `SandboxTerminate` marks the result TERMINATED (returncode 137: _common.py:220-221), closes the tunnels, and
  kills the whole process group (SIGTERM, then SIGKILL after KILL_GRACE_S, this fake's choice) before it
  answers; on a sandbox that has ended it changes nothing ("a no-op if the Sandbox has already finished
  running": sandbox/_sandbox.py:1083). A process that exits by itself ends the sandbox with its exit code
  (result SUCCESS for 0, FAILURE otherwise: the code is `exitcode`, _common.py:222); what it left in its
  process group is killed, as a container's end would.
- GPU types and counts: the 1.6.4 client only upper-cases the type and parses ":COUNT" into an int
  (_utils/function_utils.py:655-667); which types and counts exist is MODAL'S DOCS, NOT CHECKABLE FROM THE
  CLIENT, so this fake accepts any (artcloud's own list, `check_gpu`, is tested on its own).

A sandbox's state is a `_Sandbox`; FakeModal's `_Sandboxes` part creates, watches and ends them on the fake's loop.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from grpclib import GRPCError, Status
from modal_proto import api_pb2

from .common import _G, KILL_GRACE_S, free_port, new_id
from .tunnels import _close_tunnel, _Tunnel


@dataclass
class _Sandbox:
    id: str
    task_id: str
    app_id: str
    name: str
    definition: api_pb2.Sandbox
    tags: dict[str, str]
    dir: Path
    env_names: list[str]
    created_at: float
    v2: bool = False
    proc: subprocess.Popen | None = None
    tunnels: dict[int, _Tunnel] = field(default_factory=dict)
    result: api_pb2.GenericResult | None = None
    finished_at: float | None = None
    done: asyncio.Event = field(default_factory=asyncio.Event)
    last_activity: float = field(default_factory=time.monotonic)
    open_conns: int = 0
    monitor: asyncio.Task | None = None
    killing: asyncio.Task | None = None
    scheduled_at: float = 0.0  # time.monotonic() at which its container "starts" (schedule_delay_s)
    scheduled: bool = False  # its container was scheduled (its task id exists), whether or not the process started
    launch: tuple[list[str], dict[str, str]] | None = None  # (args, env) until the process is started

    @property
    def started(self) -> bool:
        """Its container runs (or ran): the process was started, or the sandbox ended."""
        return self.proc is not None or self.result is not None

    @property
    def stdout_path(self) -> Path:
        return self.dir / "stdout.log"

    @property
    def stderr_path(self) -> Path:
        return self.dir / "stderr.log"

    def touch(self) -> None:
        self.last_activity = time.monotonic()


class _Sandboxes:
    """FakeModal's part that runs sandboxes (with its `_apps`, `_images`, `_sandboxes`, `root`,
    `schedule_delay_s`, and `_open_tunnel` from `_Tunnels`)."""

    def _get(self, sandbox_id: str) -> _Sandbox:
        sb = self._sandboxes.get(sandbox_id)
        if sb is None:
            raise GRPCError(Status.NOT_FOUND, f"Sandbox {sandbox_id} not found")
        return sb

    def _handle_metadata(self, sb: _Sandbox) -> api_pb2.SandboxHandleMetadata:
        md = api_pb2.SandboxHandleMetadata(app_id=sb.app_id)
        if sb.result is not None:
            md.result.CopyFrom(sb.result)
        return md

    async def _create_sandbox(self, app_id: str, d: api_pb2.Sandbox, tags, envs: list[dict[str, str]], *,
                              v2: bool) -> _Sandbox:
        if app_id not in self._apps.values():
            raise GRPCError(Status.NOT_FOUND, f"App {app_id} not found")
        # GPU types and counts are not checked: Modal's docs, not checkable from the 1.6.4 client (see above)
        if d.image_id and d.image_id not in self._images:
            raise GRPCError(Status.NOT_FOUND, f"Image {d.image_id} not found")
        # "Unique within an app" (sandbox/_sandbox.py:230), AlreadyExistsError otherwise (:288); a finished
        # sandbox's name is free again (from_name finds "the most recent terminated" one: _sandbox.py:554-555)
        if d.name and any(s.app_id == app_id and s.name == d.name and s.result is None
                          for s in self._sandboxes.values()):
            raise GRPCError(Status.ALREADY_EXISTS, f"Sandbox with name '{d.name}' already exists in the app")
        if d.timeout_secs <= 0:  # the client sends what it is given (_common.py:458, 510): the server's check
            raise GRPCError(Status.INVALID_ARGUMENT, "timeout must be positive")

        # a V1 id is 'sb-' + 22 alphanumerics, which the client routes on (sandbox/_common.py:196-212); V2: any other
        sb_id = new_id("sb") if not v2 else new_id("sb") + "v2"
        folder = self.root / "sandboxes" / sb_id
        (folder / "home").mkdir(parents=True)
        env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "ARTCLOUD_", "MODAL_"))}
        env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
        env["HOME"] = str(folder / "home")
        for extra in envs:
            env.update(extra)
        sb = _Sandbox(id=sb_id, task_id=new_id("ta") + ("V" if v2 else ""), app_id=app_id, name=d.name,
                      definition=d, tags={t.tag_name: t.tag_value for t in tags}, dir=folder, env_names=[],
                      created_at=time.time(), v2=v2)
        for i, spec in enumerate(d.open_ports.ports):
            local = free_port()
            tunnel = _Tunnel(container_port=spec.port, target_port=local, encrypted=not spec.unencrypted)
            env[f"FAKE_MODAL_PORT_{spec.port}"] = str(local)
            if i == 0:
                env["ARTCLOUD_PORT"] = str(local)
            await self._open_tunnel(sb, tunnel)
            sb.tunnels[spec.port] = tunnel
        env["MODAL_SANDBOX_ID"], env["MODAL_TASK_ID"] = sb.id, sb.task_id
        sb.env_names = sorted(env)
        sb.launch = (list(d.entrypoint_args) or ["sleep", "infinity"], env)  # no args: the image's CMD (not built)
        sb.scheduled_at = time.monotonic() + self.schedule_delay_s
        self._sandboxes[sb.id] = sb
        if self.schedule_delay_s <= 0 and not await self._start_process(sb):
            return sb
        sb.monitor = asyncio.get_running_loop().create_task(self._watch(sb))
        return sb

    async def _start_process(self, sb: _Sandbox) -> bool:
        """The container's entrypoint as a local process; False when it could not start (the sandbox ended)."""
        args, env = sb.launch
        sb.launch, sb.scheduled = None, True
        with open(sb.stdout_path, "wb") as out, open(sb.stderr_path, "wb") as err:
            try:
                sb.proc = subprocess.Popen(args, cwd=sb.dir, env=env, stdin=subprocess.PIPE, stdout=out,
                                           stderr=err, start_new_session=True)
            except OSError as e:  # no such executable: the container's entrypoint fails
                err.write(f"{e}\n".encode())
                await self._finish(sb, _G(status=_G.GENERIC_STATUS_FAILURE, exitcode=127, exception=str(e)))
                return False
        sb.touch()
        return True

    async def _watch(self, sb: _Sandbox) -> None:
        d = sb.definition
        while sb.proc is None:  # the container is being scheduled
            if sb.result is not None:
                return
            if time.monotonic() >= sb.scheduled_at:
                if not await self._start_process(sb):
                    return
                break
            await asyncio.sleep(0.05)
        deadline = time.monotonic() + d.timeout_secs  # counted from the container's start (not checkable)
        idle = d.idle_timeout_secs if d.HasField("idle_timeout_secs") and d.idle_timeout_secs > 0 else None
        while sb.result is None:
            code = sb.proc.poll()
            if code is not None:  # the client reads `exitcode` for anything but TIMEOUT/TERMINATED (_common.py:215-222)
                status = _G.GENERIC_STATUS_SUCCESS if code == 0 else _G.GENERIC_STATUS_FAILURE
                await self._finish(sb, _G(status=status, exitcode=code,
                                          exception="" if code == 0 else f"Sandbox exited with code {code}"))
                return
            now = time.monotonic()
            if now >= deadline:
                await self._finish(sb, _G(status=_G.GENERIC_STATUS_TIMEOUT,
                                          exception=f"Sandbox timed out after {d.timeout_secs} s"))
                return
            # what resets `last_activity` is Modal's docs, not checkable from the 1.6.4 client (see above)
            if idle is not None and sb.open_conns == 0 and now - sb.last_activity >= idle:
                await self._finish(sb, _G(status=_G.GENERIC_STATUS_TERMINATED,
                                          exception=f"Sandbox idle for {idle} s (idle_timeout)"))
                return
            await asyncio.sleep(0.1)

    async def _finish(self, sb: _Sandbox, result: api_pb2.GenericResult) -> None:
        """End a sandbox (the first result wins): tunnels closed, process group killed, waiters woken."""
        if sb.result is None:
            sb.result = result
            sb.finished_at = time.time()
            for t in sb.tunnels.values():
                _close_tunnel(t)
            if sb.proc is not None and sb.proc.stdin is not None:
                try:
                    sb.proc.stdin.close()
                except OSError:
                    pass
            sb.killing = asyncio.get_running_loop().create_task(_terminate_group(sb.proc))
        if sb.killing is not None:
            await asyncio.shield(sb.killing)
        sb.done.set()


def _returncode(result: api_pb2.GenericResult | None) -> int | None:
    """As `Sandbox.returncode` reads a result (modal/sandbox/_common.py:215-222 `_result_returncode`)."""
    if result is None or result.status == _G.GENERIC_STATUS_UNSPECIFIED:
        return None
    if result.status == _G.GENERIC_STATUS_TIMEOUT:
        return 124
    if result.status == _G.GENERIC_STATUS_TERMINATED:
        return 137
    return result.exitcode


def _group_members(pgid: int) -> list[int]:
    """The live processes of a process group (Linux /proc)."""
    out = []
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as fh:
                stat = fh.read()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[-1].split()
        if len(fields) > 3 and fields[0] != "Z" and int(fields[2]) == pgid:
            out.append(int(entry))
    return out


def _kill_group(proc: subprocess.Popen | None, sig: int) -> None:
    if proc is None:
        return
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


async def _terminate_group(proc: subprocess.Popen | None) -> None:
    """SIGTERM to the whole process group, SIGKILL after KILL_GRACE_S; returns once the leader is reaped."""
    if proc is None:
        return
    if proc.poll() is None:
        _kill_group(proc, signal.SIGTERM)
        deadline = time.monotonic() + KILL_GRACE_S
        while proc.poll() is None and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
    _kill_group(proc, signal.SIGKILL)  # the leader's leftovers too, as a container's end would
    while proc.poll() is None:
        await asyncio.sleep(0.05)

"""Sandboxes: each one a local process, with Modal's scheduling, timers and end.

- `Sandbox.create` starts the sandbox's entrypoint args as a local process (`subprocess.Popen`, its own
  session/process group), in `ROOT/sandboxes/SB_ID/` (also its HOME), stdout/stderr to files there. Its
  environment: this machine's `os.environ` minus `AWS_*`, `ARTCLOUD_*` and `MODAL_*`, then the secrets' env
  dicts, then the "edge" overrides: `ARTCLOUD_PORT` = a free local port (the first opened port is remapped
  there: the command must listen on `${ARTCLOUD_PORT:-8443}`), `FAKE_MODAL_PORT_<P>` for every opened port P,
  `MODAL_SANDBOX_ID` and `MODAL_TASK_ID`. PATH starts with this interpreter's bin folder, so `artcloud` and
  `python` are this venv's.
- Scheduling: `FakeModal(root, schedule_delay_s=S)` (or the attribute, before a create) makes each new
  sandbox wait S seconds for its container, as a GPU being scheduled does: the task id is there at once (1.6.4's
  `Sandbox.create` waits for it), but the process starts only after S, and until then `SandboxGetTunnels`
  waits up to its request's `timeout` and answers GENERIC_STATUS_TIMEOUT, which the client raises as
  `SandboxTimeoutError` (as real Modal does while the container is not yet scheduled). One call waits at most
  `tunnels_wait_cap_s` (50 s) whatever timeout it asks: how long Modal's server holds this long poll is not
  documented, so a client must ask again rather than count on one call's timeout.
- Timers as on Modal: `timeout` kills the process (result TIMEOUT: `returncode` 124, and `wait()` raises
  `SandboxTimeoutError` even with `raise_on_termination=False`). `idle_timeout`: the 1.6.4 proto only says
  "If set, the sandbox will be terminated after being idle for this duration"; Modal's guide counts as
  activity ONLY an open TCP connection through a tunnel, a running `exec` and stdin writes. So does this
  fake: an open tunnel connection (and its traffic) and `SandboxStdinWrite` reset the timer; the sandbox's
  own CPU work and output do not (a busy process with no tunnel connection is killed). `exec` is not
  implemented (it answers UNIMPLEMENTED). Idle for `idle_timeout` seconds -> terminated (result
  TERMINATED, `returncode` 137; what real Modal reports here is not verified).
- `SandboxTerminate` marks the result TERMINATED (returncode 137), closes the tunnels, and kills the whole
  process group (SIGTERM, then SIGKILL after 5 s) before it answers. A process that exits by itself ends
  the sandbox with its exit code (result SUCCESS for 0, FAILURE otherwise); what it left in its process
  group is killed, as a container's end would.
- GPU types and counts are checked as the server would (the 1.6.4 client only upper-cases the string and
  parses the count): an unknown type, or more than Modal's per-sandbox cap (8; A10 4: Modal's GPU guide), is
  answered INVALID_ARGUMENT, which the client raises as `modal.exception.InvalidError`.

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

from .common import _G, GPU_MAX_COUNT, GPU_TYPES, KILL_GRACE_S, free_port, new_id
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
        gpu = d.resources.gpu_config.gpu_type
        if gpu and gpu not in GPU_TYPES:
            raise GRPCError(Status.INVALID_ARGUMENT,
                            f"Unknown GPU type {gpu!r} (fake Modal); known types: {', '.join(GPU_TYPES)}")
        count, cap = d.resources.gpu_config.count, GPU_MAX_COUNT.get(gpu, 8)
        if gpu and not 1 <= count <= cap:
            raise GRPCError(Status.INVALID_ARGUMENT, f"{gpu} supports 1 to {cap} GPUs per container, not {count} "
                                                     "(fake Modal)")
        if d.image_id and d.image_id not in self._images:
            raise GRPCError(Status.NOT_FOUND, f"Image {d.image_id} not found")
        if d.name and any(s.app_id == app_id and s.name == d.name and s.result is None
                          for s in self._sandboxes.values()):
            raise GRPCError(Status.ALREADY_EXISTS, f"Sandbox with name '{d.name}' already exists in the app")
        if d.timeout_secs <= 0:
            raise GRPCError(Status.INVALID_ARGUMENT, "timeout must be positive")

        # a V1 id is 'sb-' + 22 alphanumerics (the client routes on that shape); a V2 id is anything else
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
        sb.launch = (list(d.entrypoint_args) or ["sleep", "infinity"], env)
        sb.scheduled_at = time.monotonic() + self.schedule_delay_s
        self._sandboxes[sb.id] = sb
        if self.schedule_delay_s <= 0 and not await self._start_process(sb):
            return sb
        sb.monitor = asyncio.get_running_loop().create_task(self._watch(sb))
        return sb

    async def _start_process(self, sb: _Sandbox) -> bool:
        """The container's entrypoint as a local process; False when it could not start (the sandbox ended)."""
        args, env = sb.launch
        sb.launch = None
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
        deadline = time.monotonic() + d.timeout_secs
        idle = d.idle_timeout_secs if d.HasField("idle_timeout_secs") and d.idle_timeout_secs > 0 else None
        while sb.result is None:
            code = sb.proc.poll()
            if code is not None:
                status = _G.GENERIC_STATUS_SUCCESS if code == 0 else _G.GENERIC_STATUS_FAILURE
                await self._finish(sb, _G(status=status, exitcode=code,
                                          exception="" if code == 0 else f"Sandbox exited with code {code}"))
                return
            now = time.monotonic()
            if now >= deadline:
                await self._finish(sb, _G(status=_G.GENERIC_STATUS_TIMEOUT,
                                          exception=f"Sandbox timed out after {d.timeout_secs} s"))
                return
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
    """As `Sandbox.returncode` reads a result (modal/sandbox/_common.py `_result_returncode`)."""
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

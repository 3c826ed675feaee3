"""LocalBackend: `artcloud serve` as a child process of this one, on this machine.

A fresh CA, certificate and token per backend (made when it is constructed, and kept by a server it starts
again), handed to the child through its environment (never a file the client leaves behind, never a log line).
The server goes away with `await backend.down()`, on leaving `async with` or `with`, at interpreter exit (after
its final push), and, because the child watches its parent (and on Linux also asks the kernel for
PR_SET_PDEATHSIG), even when this process is killed outright: no orphan server, ever.
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import warnings
from pathlib import Path
from typing import Any

from artcloud.backends.client import FINAL_PUSH_WAIT_S, ServerGone
from artcloud.backends.providers import Credentials, Provisioner
from artcloud.backends.sandbox import SandboxBackend, heartbeat_every
from artcloud.backends.spec import SandboxSpec
from artcloud.durations import format_duration
from artcloud.errors import ArtcloudError, InvalidArgument
from artcloud.tls import LaunchSecrets, make_launch_secrets

log = logging.getLogger("artcloud.client")

DEFAULT_PATH = Path(".artcloud") / "local"


def _die_with_parent() -> None:  # runs in the child between fork and exec
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass  # not Linux: --parent-pid polling still ends the server


def spawn_serve(path: Path, args: list[str], *, env: dict[str, str], log: Path) -> tuple[subprocess.Popen, int]:
    """`artcloud serve --path PATH ARGS` as a child of this process, which it never outlives (--parent-pid, and on
    Linux PR_SET_PDEATHSIG): its output appended to `log`. Returns the process and where its lines begin in the
    log (served_url reads its URL from there). LocalBackend starts its server so, and so do the tests."""
    path.mkdir(parents=True, exist_ok=True)
    offset = log.stat().st_size if log.exists() else 0
    cmd = [sys.executable, "-m", "artcloud", "serve", "--path", str(path), "--parent-pid", str(os.getpid()), *args]
    with open(log, "ab") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env={**env, "PYTHONUNBUFFERED": "1"},
                                preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None)
    return proc, offset


def served_url(log: Path, offset: int = 0) -> str | None:
    """The URL a server started by spawn_serve printed (it picks a free port when asked for port 0), once it has."""
    try:
        text = log.read_bytes()[offset:].decode(errors="replace")
    except OSError:
        return None
    found = re.findall(r"serving on (https://\S+)", text)
    return found[-1] if found else None


class LocalProvisioner(Provisioner):
    """`artcloud serve` as a child of this process: its start, its URL (read from its log), its death, its end."""

    poll_s = (0.1, 0.5)

    def __init__(self, path: Path, serve_args: list[str], env: dict[str, str], secrets: LaunchSecrets):
        self.name = f"the local server under {path}"
        self.path, self.log_file = path, path / "server.log"
        self.serve_args, self.env, self.secrets = serve_args, env, secrets
        self.proc: subprocess.Popen | None = None
        self._offset = 0  # where this start's lines begin in the (appended) log

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def holds(self) -> bool:
        return self.running  # a child that exited is not ours to attach to: start a new one

    def tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_file.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    async def launch(self, job: Any, *, preload: str | None, deadline: float, claim: Any) -> Credentials:
        env = {**os.environ, "ARTCLOUD_TLS_CERT": self.secrets.server_cert, "ARTCLOUD_TLS_KEY": self.secrets.server_key,
               "ARTCLOUD_TOKEN": self.secrets.token, **self.env}
        args = [*self.serve_args, *(["--preload", preload] if preload else [])]
        self.proc, self._offset = spawn_serve(self.path, args, env=env, log=self.log_file)
        atexit.register(self._at_exit)
        claim(None, None, self.secrets.token)
        return Credentials(self.secrets.token)

    async def endpoint(self, deadline: float) -> str | None:
        return served_url(self.log_file, self._offset)

    def not_ready(self, url: str | None, startup_timeout: str) -> ArtcloudError:
        what = "did not start" if url is None else "was not ready"
        return ArtcloudError(f"the local server {what} in {startup_timeout}; its log:\n{self.tail()}",
                             code="startup_timeout")

    async def teardown(self, *, exiting: bool) -> None:
        # After a final push was answered the server exits by itself: give it that time before a SIGTERM.
        await asyncio.get_running_loop().run_in_executor(None, self.stop_now, 30.0, 30.0 if exiting else 0.0)

    def _died_message(self, text: str) -> str:
        lines = [line for line in text.splitlines() if line.strip()]
        errors = [line for line in lines if line.startswith("artcloud: error:")]
        if errors:  # the CLI's own one-line reason (port in use, path not writable, ...)
            return errors[-1].removeprefix("artcloud: error: ")
        return f"the local server exited with status {self.proc.returncode}; its last lines:\n" + "\n".join(lines[-20:])

    async def alive(self, *, answered: bool) -> None:
        if self.proc is None or self.proc.poll() is None:
            return
        if not answered:  # it never answered: say why it would not start
            raise ServerGone(self._died_message(self.tail(40)), code="server_exited")
        raise ServerGone(
            f"the local server exited (status {self.proc.returncode}) while we were talking to it; "
            f"its checkpoints under {self.path} are intact. Its last lines:\n{self.tail()}",
            code="server_exited",
        )

    async def gone(self, *, ours: bool) -> bool:
        return not self.running

    def stop_now(self, timeout: float = 30.0, exiting_for: float = 0.0) -> bool:
        """End the child: SIGTERM (its graceful exit: final push, S3 claims released), SIGKILL `timeout` later.
        `exiting_for`: it was asked to exit already; wait that long for it first. False if it had to be killed."""
        proc, self.proc = self.proc, None
        if proc is None:
            return True
        atexit.unregister(self._at_exit)
        if exiting_for:
            try:
                proc.wait(exiting_for)
            except subprocess.TimeoutExpired:
                pass
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
                return False
        return True

    def _at_exit(self) -> None:
        """The interpreter exits with the server up (neither `down()` nor `with`). SIGTERM makes it push its last
        checkpoints to S3 before it exits, within FINAL_PUSH_DEADLINE_S: it gets that long, not the 30 s of a plain
        stop that cut a slow push short without a word (code review 3, F8). (No event loop here: at exit, asyncio
        cannot start the threads its connections need.)"""
        if self.proc is None or self.proc.poll() is not None:
            return
        pushing = "--s3" in self.serve_args
        if pushing:
            log.warning("exiting with the local server up: it pushes its last checkpoints to S3 first (at most %s; "
                        "`await backend.down()` or `with LocalBackend(...)` does this before the end of a script)",
                        format_duration(FINAL_PUSH_WAIT_S))
        if not self.stop_now(FINAL_PUSH_WAIT_S if pushing else 30.0) and pushing:
            log.error("the local server did not finish its final push in %s and was killed: S3 may lack its newest "
                      "steps, which are under %s (a LocalBackend on that path with the same s3 pushes them)",
                      format_duration(FINAL_PUSH_WAIT_S), self.path)


class LocalBackend(SandboxBackend):
    """Runs the training server here. Checkpoints live under `path` (default ./.artcloud/local), so a new
    LocalBackend on the same path resumes the models.

    `in_process` is OpenPipe ART's; artcloud always runs the server as a child process (a crash or an out of
    memory there never takes this script down, and the child dies with it), which trains the same:
    in_process=True is accepted with a warning that says so. `gpu_cost_per_hour_usd` (ART's) prices this machine
    for the cost figures (`cold_start()`, the run summary).

    engine: cpu, vllm, vllm+unsloth, vllm+peft or auto (see `artcloud serve --help`); engine_args: the engine's
    settings (artcloud serve --engine-args), the defaults under each model's own: the CPU engine takes
    max_model_len, max_seq_length, dtype and seed, goes without vLLM's and Unsloth's per-model settings (memory,
    batch sizes, 4-bit) with a warning naming them, and refuses any other key by name. s3: push checkpoints to
    s3://BUCKET/PREFIX too (credentials from this environment). lease, max_duration: as `artcloud serve`.
    trainer_procs: train with the sharded trainer (FSDP2 over that many processes, gloo) while the server's own
    model samples (the CPU engine's engine_args trainer_procs).
    """

    # This machine's descriptor limit may be small (macOS: 256): the server's connections, the rollouts' and the
    # checkpoints' share it.
    openai_connections = 64

    def __init__(
        self,
        path: str | Path | None = None,
        *,
        port: int | None = None,
        host: str = "127.0.0.1",
        startup_timeout: str | float = "10m",
        log_level: str = "warning",
        engine: str = "cpu",
        engine_args: dict[str, Any] | None = None,
        s3: str | None = None,
        lease: str | float | None = None,
        max_duration: str | float | None = None,
        trainer_procs: int = 1,
        in_process: bool = False,
        gpu_cost_per_hour_usd: float | None = None,
        **kwargs: Any,
    ):
        if gpu_cost_per_hour_usd is not None and (
                isinstance(gpu_cost_per_hour_usd, bool) or not isinstance(gpu_cost_per_hour_usd, (int, float))
                or not 0 <= gpu_cost_per_hour_usd < 1e6):
            raise InvalidArgument(f"gpu_cost_per_hour_usd must be dollars per hour (a number >= 0), not "
                                  f"{gpu_cost_per_hour_usd!r}", field="gpu_cost_per_hour_usd")
        if type(trainer_procs) is not int or trainer_procs < 1:
            raise InvalidArgument(f"trainer_procs must be a whole number >= 1, not {trainer_procs!r}")
        if trainer_procs > 1:
            engine_args = {**(engine_args or {}), "trainer_procs": trainer_procs}
        if in_process:
            warnings.warn("LocalBackend(in_process=True): artcloud always runs the server as a child process "
                          "(it trains the same); in_process is ignored", UserWarning, stacklevel=2)
        self.spec = spec = SandboxSpec(gpu=None, engine=engine, engine_args=engine_args, s3=s3, lease=lease,
                                       max_duration=max_duration, startup_timeout=startup_timeout)
        self.path = Path(path) if path is not None else DEFAULT_PATH
        self.startup_timeout_s = spec.startup_timeout
        self.engine, self.s3, self.engine_env = spec.engine, spec.s3, spec.engine_env()
        self.lease_s, self.max_duration_s = spec.lease, spec.max_duration
        args = ["--host", host, "--port", str(port or 0), "--log-level", log_level, "--engine", spec.engine]
        if spec.s3:
            args += ["--s3", spec.s3]
        if spec.lease is not None:
            args += ["--lease", f"{round(spec.lease)}s"]
        if spec.max_duration is not None:
            args += ["--max-duration", f"{round(spec.max_duration)}s"]
        secrets = make_launch_secrets()
        self.provisioner = LocalProvisioner(self.path, args, self.engine_env, secrets)
        if gpu_cost_per_hour_usd is not None:  # what cold_start() and the run summary price this machine with
            self.provisioner.price_per_hour = float(gpu_cost_per_hour_usd)
        self.log_file = self.provisioner.log_file
        kwargs.setdefault("heartbeat_every_s", heartbeat_every(self.lease_s))
        super().__init__("https://localhost", token=secrets.token, ca_cert=secrets.ca_cert, **kwargs)

    def __repr__(self) -> str:
        state = f"{self.base_url}, pid {self._proc.pid}" if self.running else "stopped"
        return f"LocalBackend(path={str(self.path)!r}, {state})"

    @property
    def _proc(self) -> subprocess.Popen | None:
        """The server's process while it runs."""
        return self.provisioner.proc

    @property
    def running(self) -> bool:
        return self.provisioner.running

    def tail(self, lines: int = 20) -> str:
        """The server log's last lines."""
        return self.provisioner.tail(lines)

    def __enter__(self) -> "LocalBackend":
        """ART's `with LocalBackend() as backend:`; the server starts at the first register."""
        return self

    def __exit__(self, *exc: Any) -> None:
        """What `await backend.down()` does (code review 3, F8: this sent SIGTERM and SIGKILL 30 s later, which cut a
        slow final push short, and said nothing of what S3 holds): in an event loop of its own, here, or in a thread
        when this thread runs one."""
        if self._heartbeat is not None and not self._heartbeat.done():
            try:
                self._heartbeat.cancel()
            except RuntimeError:  # its loop is closed: the task went with it
                pass
        self._heartbeat = None
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            asyncio.run(self.down())
            return
        failed: list[BaseException] = []

        def down() -> None:
            try:
                asyncio.run(self.down())
            except BaseException as e:  # noqa: BLE001 - raised below, in the caller's thread
                failed.append(e)

        thread = threading.Thread(target=down, name="artcloud-local-down")
        thread.start()
        thread.join()
        if failed:
            raise failed[0]

"""ModalBackend: `artcloud serve` in a Modal Sandbox on a GPU, reached through Modal's HTTPS tunnel.

    backend = artcloud.ModalBackend(gpu="H100", s3="s3://my-bucket/runs")
    async with backend:                      # create the sandbox, wait for /health; terminate on exit
        await model.register(backend)

Like SkyBackend, this adds only how the server comes to life and goes away. Differences that matter:
Modal's `encrypted_ports` tunnel ends TLS at Modal's edge (a certificate for *.modal.run from a public
CA) and forwards plain TCP into the sandbox, so the server runs `--behind-https-proxy` and the client
trusts the public CAs; the per-launch bearer token still guards every route but /health. The token and S3
credentials travel as a `modal.Secret`, never in the image. The sandbox id goes into the state registry
(~/.artcloud) before anything else can go wrong, so `artcloud status/logs/down` reach it after a crash.

Teardown in layers: `down()` / `async with` (terminate); the server's lease; its max duration, set a
little under the sandbox's `timeout`, Modal's hard cap (24 h at most), so the last checkpoint is pushed
before Modal kills it; `idle_timeout` when given. Modal's idle timer counts only exec calls, stdin
writes and open TCP connections through a tunnel as activity, not the sandbox's own work: so it must
outlast the lease plus the push margin (the lease pushes the last checkpoint first), and a detached run
(no tunnel, nobody connected) cannot have one at all.
"""

from __future__ import annotations

import asyncio
import logging
import os
import queue
import secrets as _secrets
import shlex
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping

from artcloud._version import __version__
from artcloud.backends.client import ServerGone
from artcloud.backends.deps import require
from artcloud.backends.launch import check_s3, user_secrets
from artcloud.backends.providers import Claim, Credentials, Provisioner
from artcloud.backends.sandbox import SandboxBackend, heartbeat_every
from artcloud.backends.spec import SandboxSpec, renamed
from artcloud.backends.state import SandboxRecord, StateDir
from artcloud.durations import format_duration, parse_duration
from artcloud.errors import ArtcloudError, InvalidArgument, first_line
from artcloud.tls import new_token

log = logging.getLogger("artcloud.modal")

PROVIDER = "modal"
SERVER_PORT = 8443
MAX_TIMEOUT_S = 24 * 3600.0  # Modal's cap on a sandbox's lifetime
PUSH_MARGIN_S = 300.0  # the server stops this long before Modal's timeout, to push its last checkpoint
TUNNEL_WAIT_S = 50.0  # how long one `tunnels()` call waits for a container still being scheduled (Modal's default)
LAUNCH_TAG = "artcloud-launch"  # a tag unique to one launch: finds its sandbox when `create` gave no handle
# Modal's GPU types (modal.gpu docs); "NAME:COUNT" asks for several: up to 8 in one sandbox, A10 up to 4
# (https://modal.com/docs/guide/gpu, "Specifying GPU count"; A10G is A10's older name).
GPU_TYPES = ("T4", "L4", "A10", "A10G", "L40S", "A100", "A100-40GB", "A100-80GB", "RTX-PRO-6000", "H100", "H100!",
             "H200", "B200", "B200+")
GPU_MAX_COUNT = {"A10": 4, "A10G": 4}
DEFAULT_GPU_MAX_COUNT = 8


class ModalError(ArtcloudError):
    """Creating, reaching or terminating a Modal sandbox failed; the message says what to do."""

    code = "modal_failed"


def check_gpu(gpu: str | None) -> None:
    if gpu is None:
        return
    name, colon, count = gpu.partition(":")
    if name.upper() not in GPU_TYPES or (colon and not (count.isdigit() and int(count) >= 1)):
        raise InvalidArgument(f"Modal has no GPU {gpu!r}: use one of {', '.join(GPU_TYPES)}, optionally with :COUNT "
                         f"(1-{DEFAULT_GPU_MAX_COUNT}, A10 1-4), e.g. 'H100' or 'A100-80GB:2'")
    cap = GPU_MAX_COUNT.get(name.upper(), DEFAULT_GPU_MAX_COUNT)
    if colon and int(count) > cap:
        other = f", or a type that allows up to {DEFAULT_GPU_MAX_COUNT} (e.g. L40S)" if cap < DEFAULT_GPU_MAX_COUNT else ""
        raise InvalidArgument(f"Modal puts at most {cap} {name.upper()} GPUs in one sandbox, not {count}: ask for "
                         f"'{name}:{cap}' or fewer{other}")


def server_command(*, lease_s: float, max_duration_s: float, s3: str | None, engine: str) -> list[str]:
    """The sandbox's command. The port comes from ARTCLOUD_PORT when set (a test's stand-in remaps it)."""
    args = ["artcloud", "serve", "--host", "0.0.0.0", "--behind-https-proxy",
            "--engine", engine, "--lease", f"{int(lease_s)}s", "--max-duration", f"{int(max_duration_s)}s"]
    if s3:
        args += ["--s3", s3]
    line = " ".join(shlex.quote(a) for a in args)
    return ["sh", "-c", f'exec {line} --path "$HOME/artcloud-data" --port "${{ARTCLOUD_PORT:-{SERVER_PORT}}}"']


def job_command(script_name: str, run_args: list[str]) -> list[str]:
    """A detached run's command: the script (base64 in $ARTCLOUD_RUN_SCRIPT) written to a file, then
    `artcloud run` on it, whose own server runs in the same sandbox."""
    name = shlex.quote(script_name)
    line = " ".join(shlex.quote(a) for a in ["artcloud", "run", script_name, *run_args])
    return ["sh", "-c", f'set -e; mkdir -p "$HOME/artcloud-run"; cd "$HOME/artcloud-run"; '
                        f'printf %s "$ARTCLOUD_RUN_SCRIPT" | base64 -d > {name}; exec {line}']


MAX_SCRIPT_BYTES = 64 * 1024  # it travels in an environment variable (Linux caps one at 128 kB)


def server_image(wheel: Path | None, *, extras: str = "gpu", python: str | None = None):
    """The image recipe: Debian slim, and artcloud[gpu] from this client's own wheel (same version,
    local changes included) or, with no wheel, from PyPI at this client's version.

    Two layers: the dependencies at the versions of the lock this artcloud ships (torch, vLLM: minutes to
    install; the lock's text is the layer's only input, so Modal keeps it cached until the lock changes),
    then artcloud alone (`--no-deps`): a code change rebuilds only that one. The lock comes from the wheel
    itself (written beside it for the upload), or from this package for the PyPI release of its version."""
    import modal

    from artcloud import locks
    from artcloud.backends.wheel import wheel_requirements

    # the sandbox's Python need not be the laptop's (they speak HTTP): the laptop's if the lock serves it, else the
    # nearest one it does (gpu: 3.11-3.12; a 3.13 laptop got a 3.13 image, where vLLM's cuda-python has no wheel)
    name = locks.lock_name(extras)
    python = python or locks.python_near(name, sys.version_info[:2])
    if wheel is None:
        lock = locks.lock_path(name)
    else:
        lock = wheel.parent / f"{name}.txt"  # its name shows in the layer's command: the same at every launch
        lock.write_text(locks.lock_from_wheel(wheel, name))
        # a working copy whose extras changed since `make lock`: said here, not after minutes of building
        locks.check_covers(lock.read_text(), wheel_requirements(wheel, extras=name.split(","), python=python), python=python,
                           where=f"the lock of {wheel.name}[{name}]")
    image = modal.Image.debian_slim(python_version=python).uv_pip_install(requirements=[str(lock)])
    if wheel is None:
        return image.pip_install(f"artcloud=={__version__}", extra_options="--no-deps")
    remote = f"/opt/artcloud/{wheel.name}"
    return image.add_local_file(wheel, remote, copy=True).run_commands(f"pip install --no-deps '{remote}'")


class ModalBackend(SandboxBackend):
    """The training server in a Modal Sandbox, reached over Modal's HTTPS tunnel with this launch's token.

    gpu: Modal's GPU type ('H100', 'A100-80GB:2', 'L4'); None for CPU only.
    name: the sandbox's name in the app (default artcloud-XXXXXX); a running one of that name that this
        machine launched is attached to.
    max_duration: Modal's hard cap on the sandbox's life (its `timeout`, at most 24 h); the server stops 5 minutes
        before it (`timeout=` still works, with a DeprecationWarning).
    idle_timeout: Modal's idle timer, if wanted; Modal counts only requests through the tunnel (and exec,
        stdin) as activity, so it must be over lease + 5 min, and a detached run cannot have one.
    lease: the server pushes its last checkpoint and exits when no request or heartbeat came for this long.
    s3, env, secrets: as for SkyBackend (secrets travel as a modal.Secret).
    image: a modal.Image to run instead of the default recipe (`server_image`).
    startup_timeout: bounds, from the launch, the image build and Modal's search for the GPU together (no
        capacity: a ModalError, and nothing left running), then the server's own start.
    tunnel_ca: the CA bundle that signs the tunnel's certificate; default: the public CAs.
    """

    error = ModalError
    RENAMED = {"timeout": "max_duration"}

    def __init__(
        self,
        gpu: str | None = "H100",
        *,
        name: str | None = None,
        app_name: str = "artcloud",
        max_duration: str | float = "8h",
        idle_timeout: str | float | None = None,
        lease: str | float = "15m",
        s3: str | None = None,
        env: Mapping[str, str] | None = None,
        secrets: Mapping[str, str] | Iterable[str] | None = None,
        image: Any = None,
        cpu: float | None = None,
        memory: int | None = None,
        region: str | None = None,
        engine: str = "auto",
        engine_args: Mapping[str, Any] | None = None,
        keep: bool = False,
        startup_timeout: str | float = "30m",
        tunnel_ca: str | Path | None = None,
        state_dir: str | Path | None = None,
        **kwargs: Any,
    ):
        given = dict(gpu=gpu, name=name, max_duration=max_duration, lease=lease, s3=s3, env=env, secrets=secrets,
                     image=image, region=region, engine=engine, engine_args=engine_args, keep=keep,
                     startup_timeout=startup_timeout)
        given.update(renamed({k: kwargs.pop(k) for k in list(kwargs) if k in self.RENAMED}, self.RENAMED, "ModalBackend"))
        for sky_only in ("cloud", "spot", "disk"):
            if kwargs.get(sky_only):
                raise InvalidArgument(f"{sky_only}= is SkyBackend's: ModalBackend does not pass one to Modal",
                                      field=sky_only)
            kwargs.pop(sky_only, None)
        if kwargs.get("num_nodes", 1) != 1:  # modal/_partial_function.py:808 _clustered; SandboxCreateArgs has no size
            raise InvalidArgument("Modal runs a cluster of several machines for a Function (modal.clustered), not for a "
                                  "Sandbox: one sandbox has up to 8 GPUs (gpu='H100:8'); for several machines use "
                                  "SkyBackend(num_nodes=N)", field="num_nodes")
        kwargs.pop("num_nodes", None)
        self.spec = spec = SandboxSpec(**given)
        check_gpu(spec.gpu)
        if spec.lease is None or spec.max_duration is None:
            raise InvalidArgument("a Modal sandbox needs a lease and a max_duration: they are what ends it when no one "
                                  "does", field="lease" if spec.lease is None else "max_duration")
        self.timeout_s = spec.max_duration
        if self.timeout_s > MAX_TIMEOUT_S:
            raise InvalidArgument(f"max_duration {given['max_duration']!r} is over Modal's 24 h cap: use at most 24h (resume "
                                  "on a new sandbox from S3)", field="max_duration")
        self.idle_timeout_s = parse_duration(idle_timeout, what="idle_timeout") if idle_timeout is not None else None
        self.lease_s = spec.lease
        if self.idle_timeout_s is not None and self.idle_timeout_s <= self.lease_s + PUSH_MARGIN_S:
            least = f"{int((self.lease_s + PUSH_MARGIN_S) // 60) + 1}m"
            raise InvalidArgument(
                f"idle_timeout {idle_timeout!r} must be over lease + {format_duration(PUSH_MARGIN_S)} "
                f"({format_duration(self.lease_s)} + {format_duration(PUSH_MARGIN_S)}): Modal's idle timer sees only "
                "requests through the tunnel, so it would kill a paused client's server before the lease pushes "
                f"its last checkpoint. Use idle_timeout={least!r} or more, or leave it unset (the lease ends an "
                "idle server)", field="idle_timeout")
        self.startup_timeout_s = spec.startup_timeout
        self.gpu, self.app_name, self.s3, self.image, self.engine = spec.gpu, app_name, spec.s3, spec.image, spec.engine
        self.name = spec.name or f"artcloud-{_secrets.token_hex(3)}"
        self.cpu, self.memory, self.region, self.keep = cpu, memory, spec.region, spec.keep
        self.state = StateDir(Path(state_dir) if state_dir is not None else None)
        self.provisioner = ModalProvisioner(name=self.name, spec=spec, state=self.state, app_name=app_name,
                                            timeout_s=self.timeout_s, idle_timeout_s=self.idle_timeout_s,
                                            max_duration_s=self.max_duration_s, cpu=cpu, memory=memory)
        self.env = self.provisioner.env
        kwargs.setdefault("heartbeat_every_s", heartbeat_every(self.lease_s))
        super().__init__("https://pending.invalid", token="", ca_cert=tunnel_ca, **kwargs)

    def __repr__(self) -> str:
        return f"ModalBackend(name={self.name!r}, gpu={self.gpu!r}, {self.sandbox_id or 'not started'})"

    @property
    def max_duration_s(self) -> float:
        return max(60.0, self.timeout_s - PUSH_MARGIN_S) if self.timeout_s > 2 * PUSH_MARGIN_S else self.timeout_s

    @property
    def sandbox_id(self) -> str | None:
        """Modal's id of the sandbox, once created."""
        return self.provisioner.sandbox_id

    async def launch_job(self, script: Path, run_args: Callable[[float | None], list[str]]) -> None:
        """`artcloud run --detach`: the sandbox runs the training loop itself (`artcloud run SCRIPT
        --backend local ...`, its own server in the same sandbox) and ends when the loop does.
        `run_args(None)` gives that command's arguments (Modal's client has no price list)."""
        script = Path(script)
        if script.stat().st_size > MAX_SCRIPT_BYTES:
            raise ModalError(f"{script} is over {MAX_SCRIPT_BYTES // 1024} kB: a detached run ships one script; put the "
                             "rest in a package the image installs (image=)", code="script_too_big", field="script")
        if self.idle_timeout_s is not None:
            raise ModalError("a detached run cannot have an idle_timeout: Modal counts only exec calls, stdin writes "
                             "and connections through a tunnel as activity, and a detached run has none, so Modal "
                             "would kill it idle_timeout after it starts. Leave idle_timeout unset (the sandbox ends "
                             "with the loop; timeout caps it)", code="idle_timeout_detached", field="idle_timeout")
        record = self.state.load(self.name)
        if record is not None and record.state != "down":
            raise ModalError(f"{self.name} is a live sandbox of this machine: choose another name for the run",
                             code="name_taken", field="name")
        self.client.shut_down = True  # no server of ours to ask for a final push: the loop pushes its own
        await self._launch(job=(script, run_args(None)))


class ModalProvisioner(Provisioner):
    """What artcloud asks Modal (its blocking API for the registry face, its async one for a launch): any sandbox of
    the registry (status, terminate, output), and, made for one sandbox's name and settings, its creation, tunnel
    and liveness."""

    error = ModalError
    teardown_word = "terminated"

    def __init__(self, *, name: str = "", spec: SandboxSpec | None = None, state: StateDir | None = None,
                 app_name: str = "artcloud", timeout_s: float = 0.0, idle_timeout_s: float | None = None,
                 max_duration_s: float = 0.0, cpu: float | None = None, memory: int | None = None):
        require("modal", "a Modal sandbox")  # modal itself is imported lazily, where it is used
        self.name, self.spec, self.state, self.app_name = name, spec, state, app_name
        self.env = {**spec.env, **spec.engine_env()} if spec is not None else {}  # the server's plain environment
        self.timeout_s, self.idle_timeout_s, self.max_duration_s = timeout_s, idle_timeout_s, max_duration_s
        self.cpu, self.memory = cpu, memory
        self.sandbox_id: str | None = None
        self._sandbox: Any = None
        self._tunnel: str | None = None  # the tunnel's URL, once Modal gives it

    # ------------------------------------------------------------------------------------- any sandbox of the registry

    def status(self, record: SandboxRecord) -> str | None:
        sandbox = _lookup(record)
        if sandbox is None or sandbox.poll() is not None:
            return None
        return "RUNNING"

    def destroy(self, record: SandboxRecord) -> bool:
        sandbox = _lookup(record)
        if sandbox is None or sandbox.poll() is not None:
            return False
        sandbox.terminate()
        return True

    def logs(self, record: SandboxRecord, *, follow: bool = False, tail: int = 0) -> Iterator[str]:
        sandbox = _lookup(record)
        if sandbox is None:
            return iter(())
        if not follow and sandbox.poll() is None:
            raise ModalError("a running sandbox's output can only be followed: use `artcloud logs NAME -f`",
                             code="logs_follow_only")
        return _lines(sandbox)

    # ------------------------------------------------------------------------------------- this sandbox

    async def existing(self, record: SandboxRecord | None) -> bool:
        if record is not None and record.provider != PROVIDER and record.state != "down":
            raise ModalError(f"{self.name} is a live {record.provider} sandbox of this machine: choose another name",
                             code="name_taken", field="name")
        if record is not None and record.provider == PROVIDER and record.state != "down":
            sandbox = await asyncio.to_thread(_lookup, record)
            if sandbox is not None and await sandbox.poll.aio() is None:
                self._sandbox = sandbox
                return True
        return False

    async def adopt(self, record: SandboxRecord, creds: tuple[str, str]) -> Credentials:
        self.sandbox_id, self._tunnel = self._sandbox.object_id, None
        return Credentials(token=creds[1])  # the CA stays the tunnel's: Modal's edge ends TLS

    def launch_secrets(self, token: str) -> dict[str, str]:
        """The bearer token, the user's secrets and, for S3, this machine's AWS credentials: one modal.Secret."""
        found = user_secrets(self.spec.secrets, reserved=["ARTCLOUD_TOKEN"], s3=self.spec.s3, error=ModalError,
                             valid_for_s=self.timeout_s)
        return {"ARTCLOUD_TOKEN": token, **found}

    async def launch(self, job: tuple[Path, list[str]] | None, *, preload: str | None, deadline: float,
                     claim: Claim) -> Credentials:
        import base64

        import modal

        from artcloud.backends.wheel import build_wheel

        spec, token = self.spec, new_token()
        secret_env = self.launch_secrets(token)
        if spec.s3:
            await asyncio.to_thread(check_s3, spec.s3, error=ModalError)
        env = dict(self.env)
        for key in ("ARTCLOUD_S3_ENDPOINT_URL", "ARTCLOUD_S3_REGION", "ARTCLOUD_S3_ATTEMPTS"):
            if os.environ.get(key):
                env.setdefault(key, os.environ[key])
        if preload and job is None:  # model.register started it: the base model loads while we wait for /health
            env["ARTCLOUD_PRELOAD"] = preload
        try:
            app = await modal.App.lookup.aio(self.app_name, create_if_missing=True)
        except Exception as e:
            raise ModalError(_modal_hint(e), code="modal_unavailable") from e
        record = SandboxRecord(name=self.name, provider=PROVIDER, gpu=spec.gpu, max_duration_s=self.timeout_s,
                               s3=spec.s3, extra={"app": self.app_name})
        if job is not None:
            command = job_command(job[0].name, job[1])
            env["ARTCLOUD_RUN_SCRIPT"] = base64.b64encode(job[0].read_bytes()).decode()
            record.extra["run"] = job[0].name
        else:
            command = server_command(lease_s=spec.lease, max_duration_s=self.max_duration_s, s3=spec.s3,
                                     engine=spec.engine)
        claim(record, "", token)  # before the sandbox exists: see the module docstring
        self._tunnel = None
        launch = _secrets.token_hex(8)
        with tempfile.TemporaryDirectory(prefix="artcloud-wheel-") as tmp:
            image = spec.image if spec.image is not None else server_image(build_wheel(Path(tmp)))
            await self._build(image, app, deadline)
            create = modal.Sandbox.create.aio(
                *command,
                app=app, name=self.name, tags={"artcloud": __version__, LAUNCH_TAG: launch}, image=image,
                env=env or None, secrets=[modal.Secret.from_dict(secret_env)], gpu=spec.gpu, cpu=self.cpu,
                memory=self.memory, region=spec.region, timeout=int(self.timeout_s),
                idle_timeout=int(self.idle_timeout_s) if self.idle_timeout_s else None,
                encrypted_ports=[SERVER_PORT] if job is None else [],
            )
            self._sandbox = await self._scheduled(create, app, launch, deadline)
        self.sandbox_id = self._sandbox.object_id
        record.extra["sandbox_id"] = self.sandbox_id
        self.state.save(record)
        log.info("created Modal sandbox %s (%s) for %s", self.sandbox_id, spec.gpu, self.name)
        return Credentials(token=token)

    async def _build(self, image: Any, app: Any, deadline: float) -> None:
        """Build the image (or find it cached) before `create`, which would otherwise build it inside: so a
        slow first build (torch, vLLM: minutes) is told apart from a GPU Modal cannot find."""
        try:
            await asyncio.wait_for(image.build.aio(app), max(0.0, deadline - time.monotonic()))
        except asyncio.TimeoutError:
            raise ModalError(f"Modal did not finish building the image of {self.name} within startup_timeout "
                             f"{format_duration(self.spec.startup_timeout)}: a first build takes minutes (the default "
                             "image installs torch and vLLM) and later launches reuse it: give a longer "
                             "startup_timeout", code="image_build_timeout") from None

    async def _scheduled(self, create: Any, app: Any, launch: str, deadline: float) -> Any:
        """Await `Sandbox.create`, bounded by the start's deadline. With a GPU, modal 1.6.4's create waits
        inside until Modal schedules the container, up to 21 minutes, then raises ResourceExhaustedError
        (modal/sandbox/_impl_v1.py:157-172). Whatever way it fails, no sandbox of this launch may be left."""
        import modal

        try:
            return await asyncio.wait_for(create, max(0.0, deadline - time.monotonic()))
        except BaseException as e:
            await self._terminate_launch(app, launch)
            if isinstance(e, asyncio.TimeoutError):
                raise self._no_capacity(f"within startup_timeout {format_duration(self.spec.startup_timeout)}",
                                        longer=True) from None
            if isinstance(e, modal.exception.ResourceExhaustedError):
                raise self._no_capacity(f"within Modal's own scheduling wait ({_modal_hint(e)})", longer=False) from e
            raise

    async def _terminate_launch(self, app: Any, launch: str) -> None:
        """Terminate the sandboxes tagged with this launch (at most one). A create cancelled while it waited
        for scheduling terminates its sandbox itself (_impl_v1.py:164-169), but not one whose SandboxCreate
        answer was cut off (_impl_v1.py:154), nor one that came up just as it was cancelled (synchronicity
        raises the cancel even then): those exist and we hold no handle, so look them up by the tag."""
        import modal

        try:
            async for sandbox in modal.Sandbox.list.aio(app_id=app.app_id, tags={LAUNCH_TAG: launch}):
                await sandbox.terminate.aio()
                log.info("terminated %s, the Modal sandbox of a failed create for %s", sandbox.object_id, self.name)
        except Exception as e:  # noqa: BLE001 - the start's own error matters more
            log.warning("could not check whether Modal left a sandbox of %s (%s): run `artcloud down %s`",
                        self.name, _modal_hint(e), self.name)

    def _no_capacity(self, when: str, *, longer: bool) -> ModalError:
        also = ", or a longer startup_timeout" if longer else ""
        return ModalError(f"Modal found no {self.spec.gpu or 'CPU'} capacity for {self.name} {when}: try another gpu "
                          f"or region, or again later{also}", code="no_capacity", field="gpu")

    async def endpoint(self, deadline: float) -> str | None:
        """The tunnel's URL. It exists before the server listens, but `tunnels()` raises SandboxTimeoutError
        while the container is not running yet: then None, and the ready poll asks again until the startup
        deadline. A GPU sandbox is scheduled by then (`create` waited for it); one without a GPU (modal's V2
        path) may not be."""
        import modal

        if self._tunnel is None:
            try:
                wait = int(max(1.0, min(TUNNEL_WAIT_S, deadline - time.monotonic())))
                tunnels = await self._sandbox.tunnels.aio(timeout=wait)
            except modal.exception.SandboxTimeoutError:
                return None
            if SERVER_PORT in tunnels:
                self._tunnel = tunnels[SERVER_PORT].url.rstrip("/")
        return self._tunnel

    def not_ready(self, url: str | None, startup_timeout: str) -> ArtcloudError:
        if url is None:
            return ModalError(f"Modal did not open the tunnel of {self.name} within startup_timeout (its container "
                              "was not running yet): try again later, or a longer startup_timeout",
                              code="startup_timeout")
        return ModalError(f"the server in {self.name} was not ready in time (startup_timeout): raise it for a big "
                          f"model, or see `artcloud logs {self.name}`", code="startup_timeout")

    def failure(self, cause: BaseException, launching: bool) -> tuple[str, str]:
        return f"the Modal sandbox {self.name} did not come up: {_modal_hint(cause)}", "startup_failed"

    async def last_lines(self, lines: int) -> list[str]:
        return await self.log_tail(lines)

    async def log_tail(self, lines: int = 40) -> list[str]:
        """The last lines of the sandbox's output (stdout, then stderr); only once it has exited, since
        reading a live stream waits for its end."""
        sandbox = self._sandbox
        if sandbox is None or await sandbox.poll.aio() is None:
            return []
        try:
            streams = [await sandbox.stdout.read.aio(), await sandbox.stderr.read.aio()]
        except Exception as e:
            log.debug("no logs for %s: %s", self.name, e)
            return []
        # each stream on its own: stdout's last line may lack its newline
        return [line for text in streams for line in text.splitlines() if line.strip()][-lines:]

    # ------------------------------------------------------------------------------------- liveness, down

    async def alive(self, *, answered: bool = True) -> None:
        if self._sandbox is None:
            return
        code = await self._sandbox.poll.aio()
        if code is not None:
            tail = "\n".join("  " + line for line in await self.last_lines(20))
            raise ServerGone(f"the Modal sandbox {self.name} ended (exit code {code}); training resumes from the last "
                             f"checkpoint on S3 in a new one. Its last lines:\n{tail}", code="server_exited")

    async def teardown(self, *, exiting: bool) -> None:
        if self._sandbox is not None:
            await self._sandbox.terminate.aio()

    async def gone(self, *, ours: bool = True) -> bool:
        sandbox = self._sandbox
        if sandbox is None:
            record = self.state.load(self.name)
            sandbox = (await asyncio.to_thread(_lookup, record) if record is not None and record.extra.get("sandbox_id")
                       else None)
        return sandbox is None or await sandbox.poll.aio() is not None


def _lookup(record: SandboxRecord):
    """The sandbox of a registry record: by id, or by name in its app when the id was never saved (modal's
    blocking API: async code calls it in a thread)."""
    import modal

    try:
        if record.extra.get("sandbox_id"):
            return modal.Sandbox.from_id(record.extra["sandbox_id"])
        return modal.Sandbox.from_name(record.extra.get("app", "artcloud"), record.name)
    except modal.exception.NotFoundError:
        return None


_DONE = object()


def _lines(sandbox) -> Iterator[str]:
    """stdout and stderr followed at once, lines in the order they arrive (the server logs to stderr, and a
    stream is read to its end only when the sandbox ends)."""
    lines: queue.Queue = queue.Queue()

    def pump(stream) -> None:
        try:
            for line in stream:
                lines.put(line.rstrip("\n"))
        except Exception as e:  # noqa: BLE001 - handed to the reader
            lines.put(e)
        finally:
            lines.put(_DONE)

    for stream in (sandbox.stdout, sandbox.stderr):
        threading.Thread(target=pump, args=(stream,), name="artcloud-modal-logs", daemon=True).start()
    open_streams = 2
    while open_streams:
        item = lines.get()
        if item is _DONE:
            open_streams -= 1
        elif isinstance(item, Exception):
            raise item
        else:
            yield item


def _modal_hint(e: BaseException) -> str:
    """Modal's error, with what to do about the common ones."""
    text = first_line(e) or type(e).__name__
    name = type(e).__name__
    if name == "AuthError" or "token" in text.lower():
        return f"{text}: run `modal token new` (or set MODAL_TOKEN_ID and MODAL_TOKEN_SECRET)"
    return f"{name}: {text}"

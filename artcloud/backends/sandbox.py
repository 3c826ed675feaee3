"""SandboxBackend: the lifecycle of a server on a machine artcloud starts and ends, written once.

LocalBackend (a child process), SkyBackend (a SkyPilot cluster) and ModalBackend (a Modal Sandbox) differ only
in how a machine comes to life, where its server answers, how it is known dead, and how it goes away: their
provisioner answers that (providers.Provisioner, the same face `artcloud status / logs / down` use). What they
share lives here:

    start()   attach to a live sandbox of this name that this machine launched (the registry holds its CA and
              token), or launch one: provider checks → the registry record, saved BEFORE the provider is asked
              (a laptop that dies mid-launch still leaves a name `artcloud down` finds) → provision → ready;
              then heartbeats hold the server's lease.
    ready     poll the endpoint, then /health, with backoff, until ready; between polls ask whether the machine
              or its server died (fail fast, with its last lines) and give up at startup_timeout.
    failure   a start that fails is torn down (unless keep=True), and the error says why, what to do, and
              what the server printed last.
    down()    the server pushes its last checkpoint and exits, the machine is destroyed, the record marked down.
    lost      a machine the provisioner says is lost (a preempted spot VM) is replaced by a new one of the same
              name; RemoteBackend.recover registers the models again and they resume from S3.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from typing import Any

from artcloud.backends.client import ServerGone, check_version, push_verdicts
from artcloud.backends.providers import Provisioner
from artcloud.backends.remote import RemoteBackend
from artcloud.backends.state import SandboxRecord, StateDir, launcher, launching_now
from artcloud.durations import format_duration
from artcloud.errors import ArtcloudError, first_line

log = logging.getLogger("artcloud.client")  # what the client says about its sandbox

ATTACH_TIMEOUT_S = 300.0  # an attached server was ready once: it should answer within this
GOING_WAIT_S = 180.0  # a server that had its preemption notice: its final push, then it exits (AWS gives 2 min)


def heartbeat_every(lease_s: float | None) -> float:
    """How often a client heartbeats a server with this lease: three beats per lease, at most a minute apart."""
    return 60.0 if lease_s is None else min(60.0, lease_s / 3)


class SandboxBackend(RemoteBackend):
    """A RemoteBackend that owns the machine its server runs on, through its provisioner. See the module docstring."""

    provisioner: Provisioner  # the provider's answers about this sandbox
    error: type[ArtcloudError] = ArtcloudError  # the error class its failures are raised as (its provisioner's)
    keep: bool = False  # leave it up on a failed start and on leaving `async with` (lease and timers still apply)
    lease_s: float
    startup_timeout_s: float
    state: StateDir | None = None  # the registry (None: this sandbox is not registered, e.g. a local child)
    progress = True  # a progress bar (phase, N/M GB) while the server comes up, on a terminal only
    progress_console: Any = None  # where the bar draws (None: stderr, if a terminal)
    _bar: "StartBar | None" = None  # the bar of the launch in progress
    preload: str | None = None  # a base model the server loads before it says ready (set when register starts it)
    _launch_began: float | None = None  # when this backend asked the provider for the machine (monotonic)

    _owns = False  # this object started it or attached to it: down() may destroy it
    _start_lock: tuple[Any, asyncio.Lock] | None = None  # (its loop, the lock start() holds): one launch however many callers
    _record: SandboxRecord | None = None
    # A lost machine (a preempted spot VM) is replaced by a new one, at most this many times per backend;
    # the models resume from S3. SkyBackend(use_spot=True, s3=...) turns it on.
    relaunch_on_loss = False
    max_relaunches = 5
    _said_node_lost = False  # a lost node that is not replaced is said once
    _node_recovery: asyncio.Task | None = None  # the replacement a lost node started (from a heartbeat)

    @property
    def sandbox_name(self) -> str:
        """The name `artcloud status / logs / down` know it by."""
        return self.provisioner.name

    @property
    def price_per_hour(self) -> float | None:  # type: ignore[override]
        return self.provisioner.price_per_hour

    # ------------------------------------------------------------------------------------- start

    async def start(self) -> None:
        """Attach or launch, once: concurrent calls (two models registering at once) wait for the first's start
        instead of launching a second machine."""
        loop = asyncio.get_running_loop()
        if self._start_lock is None or self._start_lock[0] is not loop:  # a lock serves the loop it was made in
            self._start_lock = (loop, asyncio.Lock())
        async with self._start_lock[1]:
            if not self._up():
                await self._start()

    def _up(self) -> bool:
        """This object holds a started (or attached) sandbox that is not known to have ended."""
        if self._owns and not self.provisioner.holds():
            self._owns = False  # ended (a local child that exited, a dead cluster torn down): start anew
        return self._owns

    async def _start(self) -> None:
        self.client.shut_down = False
        record = self.state.load(self.sandbox_name) if self.state is not None else None
        if record is not None and launching_now(record) and record.launcher.get("pid") != os.getpid():
            raise self.error(f"{self.sandbox_name} is being launched by process {record.launcher['pid']} of this machine: "
                             "wait for that launch, or choose another name", code="name_taken", field="name")
        if await self.provisioner.existing(record):
            await self._attach(record)
        else:
            if record is not None and record.state != "down":  # gone since (autodown, lease, by hand)
                self.state.mark_down(self.sandbox_name)
            await self._launch()
        # Hold the lease from now on, not only once a model is registered: a client that spends a while
        # preparing data keeps its GPU; a client that dies lets it go within the lease.
        self._start_heartbeats()

    async def _attach(self, record: SandboxRecord) -> None:
        creds = self.state.credentials(self.sandbox_name) if self.state is not None else None
        if creds is None:
            raise self.error(f"the token of {self.sandbox_name} is not in {self.state.root}: `artcloud down "
                             f"{self.sandbox_name}` and launch again", code="no_credentials")
        self._stage(**(await self.provisioner.adopt(record, creds))._asdict())
        self._owns, self._record = True, record
        log.info("attaching to the running artcloud sandbox %s", self.sandbox_name)
        await self._wait_ready(record, deadline=time.monotonic() + min(self.startup_timeout_s, ATTACH_TIMEOUT_S))

    async def _launch(self, job: Any = None, *, show_bar: bool = True) -> None:
        """Provision, then (for a server, not a detached job) wait until it is ready. A failure after anything
        was asked of the provider tears it down; one before (bad input, a preflight check) only raises."""
        self.cold_start_s, self._launch_began = {}, time.monotonic()
        # One bar from the launch call to ready ("provisioning", then the server's phases: installing, fetching
        # weights, ...). None for a job, nor for a replacement (model.train's own bar may be on the terminal then;
        # the replacement is said in the log).
        shown = self.progress and show_bar and job is None
        with StartBar(self.sandbox_name, enabled=shown, console=self.progress_console) as bar:
            self._bar = bar
            try:
                await self._launch_with(job)
            finally:
                self._bar = None

    async def _launch_with(self, job: Any) -> None:
        # One budget from the launch call: provisioning (or scheduling), the install, the server's start.
        deadline = (self._launch_began or time.monotonic()) + self.startup_timeout_s
        try:
            creds = await self.provisioner.launch(job, preload=self.preload, deadline=deadline, claim=self._record_launch)
        except BaseException as e:
            if not self._owns:
                raise
            await self._fail_start(e, launching=True)
        self._stage(**creds._asdict())  # published with the URL once the server is ready
        record = self._record
        try:
            if job is not None:  # a detached job is launched once its install is done and it runs
                await self.provisioner.job_started(deadline=deadline)
                self._publish()  # its token (no URL: a job serves none)
            else:
                await self._wait_ready(record, deadline=deadline)
        except BaseException as e:
            await self._fail_start(e, launching=False)
        if job is not None and record is not None:
            record.state = "up"
            self.state.save(record)

    def _record_launch(self, record: SandboxRecord | None, ca_cert: str | None, token: str) -> None:
        """The provisioner's launch calls this just before the provider is asked: from here on the sandbox is
        ours to tear down, and the registry knows its name and credentials."""
        if self.state is not None and record is not None:
            record.launcher = launcher()  # `artcloud status` meanwhile sees a launch in progress, not a dead sandbox
            self.state.save(record, ca_cert=ca_cert, token=token)
        self._record, self._owns = record, True

    async def _wait_ready(self, record: SandboxRecord | None, *, deadline: float) -> None:
        """Poll until /health says ready, showing its phase; note where the time went (cold_start_s).
        Provision is from the launch call to the first answer, less what the server says it spent before that
        answer (the install, its own phases): the first poll may come late."""
        if self._bar is not None:  # launching: the launch's bar goes on
            await self._poll_ready(record, deadline, self._bar)
            return
        with StartBar(self.sandbox_name, enabled=self.progress, console=self.progress_console) as bar:
            await self._poll_ready(record, deadline, bar)

    def _first_answer(self, body: dict[str, Any]) -> None:
        if self._launch_began is not None and "provision" not in self.cold_start_s:
            waited = time.monotonic() - self._launch_began
            self.cold_start_s["provision"] = max(0.0, waited - _server_seconds(body))

    async def _poll_ready(self, record: SandboxRecord | None, deadline: float, bar: "StartBar") -> None:
        """The new machine's /health is polled with a client of its own: `base_url` moves to it only once it is
        ready. Until then, requests of a spot replacement in flight keep failing over to the recovery
        (ServerGone) and never reach the install's responder (bootstrap_health.py answers 404 but on /health)."""
        import httpx

        from artcloud.tls import client_ssl_context

        delay, longest = self.provisioner.poll_s
        probe: httpx.AsyncClient | None = None
        try:
            while True:
                url = await self.provisioner.endpoint(deadline)
                if url:
                    if record is not None and self.state is not None and (record.url != url or record.state != "up"):
                        record.url, record.state = url, "up"
                        self.state.save(record)
                    if probe is None or str(probe.base_url).rstrip("/") != url.rstrip("/"):
                        if probe is not None:
                            await probe.aclose()
                        probe = httpx.AsyncClient(base_url=url, timeout=10.0, verify=client_ssl_context(
                            self._staged.get("ca", self.ca_cert), check_hostname=self.check_hostname))
                    body = await _health_of(probe)  # one try: this loop is the retry, and asks _check_alive between
                    if body is not None:
                        check_version(body.get("version"))
                        self._first_answer(body)
                        bar.show(body)
                        if body.get("ready"):
                            if url != self.base_url or self._staged:
                                await self._close_http()  # the HTTP client is bound to the old endpoint
                                self._publish(url)
                            self.client.version_checked = True
                            self._note_phases(body.get("phases"))
                            self._launch_began = None
                            return
                await self._check_alive()
                if time.monotonic() > deadline:
                    raise self.provisioner.not_ready(url, format_duration(self.startup_timeout_s))
                await asyncio.sleep(delay)
                delay = min(delay * 1.5, longest)
        finally:
            if probe is not None:
                await probe.aclose()

    async def _fail_start(self, cause: BaseException, *, launching: bool) -> None:
        if isinstance(cause, ArtcloudError):
            message, code = str(cause), cause.code
        else:
            message, code = self.provisioner.failure(cause, launching)
        # ServerGone already carries the last lines; an interrupt has no time for them.
        quick = isinstance(cause, (ServerGone, KeyboardInterrupt, asyncio.CancelledError))
        lines = [] if quick else await self.provisioner.last_lines(40)
        if not self.keep:
            await self._teardown()
            if self.state is not None:
                message += f" ({self.provisioner.teardown_word}; keep=True leaves it up to debug)"
        else:
            message += f" (kept up: `artcloud logs {self.sandbox_name}`, then `artcloud down {self.sandbox_name}`)"
        if lines:
            message += "\nthe server's last lines:\n" + "\n".join("  " + line for line in lines)
        if isinstance(cause, (KeyboardInterrupt, asyncio.CancelledError)):
            raise cause
        raise self.error(message, code=code) from cause

    async def register(self, name: str, project: str, base_model: str | None, lora: dict[str, Any],
                       engine_args: dict[str, Any] | None = None, *, take_over: bool = False) -> dict[str, Any]:
        """A register that starts the sandbox (no `async with backend` before it) has the server load the base
        model while it comes up (artcloud serve --preload), instead of after: the wait is one."""
        if not self._up():
            self.preload = None if engine_args else base_model  # engine_args are the register's to apply
            await self.start()
        return await super().register(name, project, base_model, lora, engine_args, take_over=take_over)

    # ------------------------------------------------------------------------------------- down

    async def _teardown(self) -> None:
        """Close, destroy the machine (only one artcloud launched: this object, or this machine's registry
        says so), mark it down. The loopback endpoint stays: a replaced machine's server is forwarded to."""
        await self._close_http()
        name = self.sandbox_name
        registered = self.state is not None and self.state.load(name) is not None
        if self._owns or registered:
            await self.provisioner.teardown(exiting=self.client.shut_down)
            if self.state is not None:
                self.state.mark_down(name)
        self._owns = False

    async def down(self) -> None:
        """Have the server push its last checkpoint and exit (best effort: a server already gone has
        nothing left to push), then tear the machine down (idempotent) and mark it down."""
        try:
            answer = await self.final_push()
        except ArtcloudError as e:
            log.warning("%s: no final push (the server at %s did not answer: %s); tearing down anyway",
                        self.sandbox_name, self.base_url, e)
        else:
            for verdict in push_verdicts(answer) if answer is not None else []:
                (log.info if verdict.confirmed else log.warning)("%s: %s", self.sandbox_name, verdict.line(on_sandbox=True))
        await self._teardown()
        await self.close()  # and the loopback endpoint

    async def __aexit__(self, *exc: Any) -> None:
        if self.keep:
            await self.close()
            log.warning("keep=True: %s stays up until its lease (%s without a client) or `artcloud down %s`",
                        self.sandbox_name, format_duration(self.lease_s), self.sandbox_name)
        else:
            await self.down()

    # ------------------------------------------------------------------------------------- replacing a lost machine

    async def _replace_server(self, cause: BaseException) -> dict[str, Any] | None:
        """A machine that was lost (not a server that merely failed) is torn down for good and a new one
        launched under the same name; RemoteBackend.recover then registers the models again."""
        if not self.relaunch_on_loss or not await self.provisioner.lost(cause):
            return None
        if len(self.replacements) >= self.max_relaunches:
            log.error("%s was lost again, after %d relaunches: giving up (max_relaunches)", self.sandbox_name,
                      len(self.replacements))
            return None
        record, now = self._record, time.time()
        price = self.price_per_hour
        lost = {"at": now, "sandbox": self.sandbox_name, "reason": first_line(cause) or type(cause).__name__,
                "machine": (record.extra.get("resources") if record is not None else None), "price_per_hour": price,
                "up_s": round(now - record.launched_at, 1) if record is not None else None}
        lost["cost_usd"] = (round(price * lost["up_s"] / 3600.0, 4) if price is not None and lost["up_s"] is not None
                            else None)
        log.warning("%s was lost (%s): launching a new machine; training resumes from the last checkpoint on S3",
                    self.sandbox_name, lost["reason"])
        self.client.shut_down = True  # nothing left to ask for a final push
        await self._teardown()
        self.client.shut_down = False
        await self._launch(show_bar=False)
        self._start_heartbeats()
        log.warning("%s is back at %s", self.sandbox_name, self.base_url)
        return lost

    async def _after_beat(self) -> None:
        """A node of several lost while the head serves on: its replica's rollouts, or the trainer group, are gone
        for good and the cluster bills until downed. Replaced as a lost machine where this backend replaces them;
        otherwise said once."""
        if self._node_recovery is not None and not self._node_recovery.done():
            return
        reason = await self.provisioner.node_lost()
        if reason is None:
            return
        if self.relaunch_on_loss:  # a task of its own: the replacement drops this heartbeat task and starts another
            self._node_recovery = asyncio.get_running_loop().create_task(
                self._recover_node(ServerGone(reason, code="node_lost"), self.generation), name="artcloud-node-lost")
        elif not self._said_node_lost:
            self._said_node_lost = True
            log.warning("%s: the head serves on without it; `artcloud down %s` ends the cluster (spot=True with s3= "
                        "replaces it)", reason, self.sandbox_name)

    async def _recover_node(self, cause: ServerGone, generation: int) -> None:
        try:
            await self.recover(cause, generation)
        except Exception as e:  # noqa: BLE001 - the next request meets the lost cluster and says so
            log.error("replacing %s after %s failed: %s", self.sandbox_name, first_line(cause), e)

    async def _check_alive(self) -> None:
        await self.provisioner.alive(answered=self.client.version_checked)
        if not await self.provisioner.going():
            return
        # Its port is closed (or about to be) while the process pushes its last checkpoints: wait for it to exit,
        # so that a request that found it closed goes to the machine that replaces it, after the push.
        deadline = time.monotonic() + GOING_WAIT_S
        while time.monotonic() < deadline:
            await asyncio.sleep(1.0)
            await self.provisioner.alive(answered=self.client.version_checked)  # ServerGone once it has exited
        raise ServerGone(f"{self.sandbox_name} announced its end (a preemption notice) and has not exited within "
                         f"{GOING_WAIT_S:.0f} s: treating it as gone", code="server_exiting")

    async def gone(self) -> bool:
        """True once nothing of the sandbox is left; a dead one of ours (it may still bill) is torn down first."""
        ours = self._owns or (self.state is not None and self.state.load(self.sandbox_name) is not None)
        return await self.provisioner.gone(ours=ours)


class StartBar:
    """While a sandbox comes up: a rich progress bar on stderr with the server's phase ("fetching weights
    3.1/16.0 GB"), like model.train's bar; shown on a terminal only (nothing when output is piped)."""

    def __init__(self, name: str, *, enabled: bool = True, console: Any = None):
        self.name, self.enabled, self.console = name, enabled, console
        self._progress: Any = None
        self._task: Any = None

    def __enter__(self) -> "StartBar":
        if not self.enabled:
            return self
        from rich.console import Console
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

        console = self.console or Console(stderr=True)
        if not console.is_terminal:
            return self
        self._progress = Progress(TextColumn("[bold]{task.description}"), TextColumn("{task.fields[phase]}"), BarColumn(),
                                  TextColumn("{task.fields[amount]}"), TimeElapsedColumn(), console=console, transient=True)
        self._progress.start()
        self._task = self._progress.add_task(self.name, total=None, phase="provisioning", amount="")
        return self

    def show(self, body: dict[str, Any]) -> None:
        if self._progress is None:
            return
        phase, done, total = describe_phase(body)
        amount = f"{done / 1e9:.1f}/{total / 1e9:.1f} GB" if total else ""
        self._progress.update(self._task, phase=phase, amount=amount, completed=done or 0, total=total or None)

    def __exit__(self, *exc: Any) -> None:
        if self._progress is not None:
            self._progress.stop()


async def _health_of(client: Any) -> dict[str, Any] | None:
    """GET /health once: its JSON object, or None when nothing (or not JSON, or not 200) answers yet."""
    import httpx

    try:
        response = await client.get("/health")
        body = response.json() if response.status_code == 200 else None
    except (httpx.TransportError, ValueError):
        return None
    return body if isinstance(body, dict) else None


def _server_seconds(body: dict[str, Any]) -> float:
    """Seconds a /health answer says the machine spent on artcloud so far: the phases done, and the current
    one's (installing: elapsed_s). Numbers only; anything else counts as 0 (the answer is the network's)."""
    def seconds(x: Any) -> float:
        return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) and 0 <= x < 1e7 else 0.0

    phases = body.get("phases")
    done = sum(seconds(v) for v in phases.values()) if isinstance(phases, dict) else 0.0
    return done + seconds(body.get("phase_s")) + seconds(body.get("elapsed_s"))


def describe_phase(body: dict[str, Any]) -> tuple[str, int | None, int | None]:
    """(what the server is doing, bytes done, bytes total) from a /health answer (untrusted: checked)."""
    phase = body.get("phase")
    words = {"installing": "installing", "starting": "starting the server", "fetching_weights": "fetching weights",
             "loading_engine": "starting the engine", "ready": "ready"}
    text = words.get(phase, "starting the server") if isinstance(phase, str) else "starting the server"
    progress = body.get("progress")
    if isinstance(progress, dict):
        done, total = progress.get("done"), progress.get("total")
        if all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in (done, total)) and total:
            return text, min(done, total), total
    return text, None, None

"""RemoteBackend: a server reached through a `Client`, and what a backend adds around it.

The Client (client.py) speaks the protocol. The backend holds what outlives one connection: the models registered
(to register them again on a replacement), the steps not yet on S3 (to train them again there), the lease's
heartbeats, the loopback endpoint for plain OpenAI clients, and OpenPipe ART's backend face. A RemoteBackend is
a bare URL: it cannot replace its server. LocalBackend, SkyBackend and ModalBackend (sandbox.py) own a machine
and can.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from contextvars import ContextVar
from dataclasses import replace
from pathlib import Path
from typing import Any, Mapping

from artcloud.backends.client import (
    EVENT_READ_TIMEOUT_S,
    FINAL_PUSH_WAIT_S,
    HEALTH_PROBE_TIMEOUT_S,
    Client,
    Endpoint,
    EventCallback,
    ServerGone,
)
from artcloud.errors import ArtcloudError, InvalidArgument, NotSupported
from artcloud.tls import client_ssl_context
from artcloud.wire import (
    Event,
    Health,
    HistoryRecord,
    JobSummary,
    ModelInfo,
    ModelState,
    PromptedInfo,
    Pruned,
    ShutdownAnswer,
)

log = logging.getLogger("artcloud.client")

# A cold start's pieces, in order: the client's name for each and the server's (GET /health "phases"), if any.
COLD_START_PHASES = (("provision", None), ("install", "installing"), ("start", "starting"),
                     ("weights", "fetching_weights"), ("engine", "loading_engine"), ("first rollout", "first_rollout"))


def cold_start_rows(seconds: Mapping[str, float], price_per_hour: float | None) -> list[dict[str, Any]]:
    """[{phase, seconds, cost_usd}] in the order they happen, for the phases that were measured; the cost is
    the machine's price over that time (None where the price is unknown, e.g. a local server)."""
    rows = []
    for phase, _ in COLD_START_PHASES:
        if phase in seconds:
            s = round(float(seconds[phase]), 3)
            cost = round(price_per_hour * s / 3600.0, 6) if price_per_hour is not None else None
            rows.append({"phase": phase, "seconds": s, "cost_usd": cost})
    return rows


# Inside a replacement: (the backend, the client the replacement talks to its new server with). A context variable, so
# that only the replacing task (and what it starts) sees it.
_REPLACING: ContextVar[tuple["RemoteBackend", Client] | None] = ContextVar("artcloud_replacing", default=None)


class RemoteBackend:
    """A running `artcloud serve`, reached at `base_url` over HTTPS with the launch's token and CA."""

    # The connections `openai_client()` opens to the server at most; more rollouts at once wait for one. openai's own
    # default (1,000) is more than a server with a small descriptor limit admits (code review 3, F9), and an engine
    # batches what comes over fewer as well.
    openai_connections = 256

    price_per_hour: float | None = None  # dollars, where the provider's catalog says (SkyBackend)

    def __init__(
        self,
        base_url: str,
        *,
        token: str,
        ca_cert: str | Path | None,
        timeout: float = 120.0,
        retries: int = 6,
        heartbeat_every_s: float = 60.0,
        check_hostname: bool = True,
        event_read_timeout_s: float = EVENT_READ_TIMEOUT_S,
        health_probe_timeout_s: float = HEALTH_PROBE_TIMEOUT_S,
    ):
        if not base_url.startswith("https://"):
            raise InvalidArgument(f"artcloud servers speak HTTPS only: use https://..., not {base_url!r}")
        self._public = Client(Endpoint(base_url.rstrip("/"), token, ca_cert, check_hostname), timeout=timeout,
                              retries=retries, event_read_timeout_s=event_read_timeout_s,
                              health_probe_timeout_s=health_probe_timeout_s, check_alive=self._alive_or_replaced,
                              on_new_loop=self._resume_heartbeats)
        self._staged: dict[str, Any] = {}  # a launch's token and CA, published with its URL once the server is ready
        self.heartbeat_every_s = heartbeat_every_s
        self._heartbeat: asyncio.Task | None = None
        # Replacing a lost server (a preempted spot machine): each replacement bumps the generation, so
        # requests that failed on the old server know to go again; what was registered is registered again.
        self._replacing: tuple[asyncio.AbstractEventLoop, asyncio.Lock] | None = None
        self._found_alive: tuple[int, float] | None = None  # (generation, when a liveness check that said so began)
        self._registrations: dict[str, dict[str, Any]] = {}
        # Per model: the steps committed on the server that S3 does not hold yet, with the train request that
        # made each. The server pushes a step after it commits it (and model.train returns): a machine lost in
        # between takes the step with it, and its replacement trains it again from these (_replay).
        self._unpushed: dict[str, list[tuple[int, dict[str, Any]]]] = {}
        self._temperatures: dict[str, float] = {}
        self._states: dict[str, dict[str, Any] | None] = {}  # each model's state as last written through this backend
        self.replacements: list[dict[str, Any]] = []  # each lost server that was replaced: when, why, its cost
        self.cold_start_s: dict[str, float] = {}  # seconds per cold-start phase of this server (COLD_START_PHASES)
        self._forwarder: Any = None  # the loopback endpoint for plain OpenAI clients, started when first asked for
        self._forwarder_lock = threading.Lock()  # model.inference_base_url may be read from several threads
        self._forward_ssl: tuple[Any, Any] | None = None  # ((ca_cert, check_hostname), its SSLContext)

    def __repr__(self) -> str:  # never the token
        return f"{type(self).__name__}({self.base_url!r})"

    @property
    def client(self) -> Client:
        """The protocol client: everyone's, or, inside a replacement (_replace_and_register), the replacement's own,
        whose endpoint is the new server while everyone else's stays the lost one until the models are back."""
        private = _REPLACING.get()
        return private[1] if private is not None and private[0] is self else self._public

    # The endpoint and its parts, read-only: it changes only whole (_publish).
    endpoint = property(lambda self: self.client.endpoint, doc="The server now: URL, token, CA, generation.")
    base_url = property(lambda self: self.endpoint.url, doc="The server's https:// URL.")
    ca_cert = property(lambda self: self.endpoint.ca, doc="The CA this client trusts for the server.")
    check_hostname = property(lambda self: self.endpoint.check_hostname)
    _token = property(lambda self: self.endpoint.token)

    @property
    def generation(self) -> int:
        """How many times the server was replaced; read it before a request, pass it to `recover`."""
        return self.endpoint.generation

    def _stage(self, *, token: str | None = None, ca: str | Path | None = None) -> None:
        """A launch's (or an attach's) credentials, kept aside until its server is ready (_publish)."""
        self._staged.update({k: v for k, v in (("token", token), ("ca", ca)) if v is not None})

    def _publish(self, url: str | None = None, **changes: Any) -> None:
        """The one way the endpoint changes: a new value, whole, with what was staged. A new URL or new
        credentials need a new connection: call `_close_http` first."""
        changes = {**self._staged, **changes, **({"url": url.rstrip("/")} if url else {})}
        self._staged = {}
        self.client.endpoint = replace(self.endpoint, **changes)

    def __call__(self) -> "RemoteBackend":
        """ART's `model.backend()` is a method, artcloud's `model.backend` a property: calling it gives the same."""
        return self

    # ------------------------------------------------------------------------------------- lifecycle

    async def start(self) -> None:
        """Check the server: its version must equal this client's."""
        await self.health()

    async def health(self, *, retry: bool = True) -> Health:
        return await self.client.health(retry=retry)

    def _note_phases(self, phases: Any) -> None:
        """Take the server's own phase durations from a /health answer's `phases` (numbers only: it is the
        network's)."""
        if not isinstance(phases, Mapping):
            return
        for ours, theirs in COLD_START_PHASES:
            value = phases.get(theirs) if theirs else None
            if isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value < 1e7:
                self.cold_start_s[ours] = float(value)

    async def cold_start(self) -> list[dict[str, Any]]:
        """Where this server's start-up went: [{phase, seconds, cost_usd}] for provision (a sandbox this backend
        launched), install, start, weights, engine and the first rollout, as measured so far (the server's
        figures are read again from GET /health when it answers)."""
        if not self.client.shut_down:
            try:
                self._note_phases((await self.health(retry=False)).phases)
            except ArtcloudError:
                pass  # gone, or never up: what was measured stays
        return cold_start_rows(self.cold_start_s, self.price_per_hour)

    async def wait_ready(self, timeout: float = 600.0) -> Health:
        return await self.client.wait_ready(timeout)

    async def close(self) -> None:
        """Close the connection and the loopback endpoint (`inference_base_url`). The server stays up:
        `down()` ends one this backend owns."""
        await self._close_http()
        if self._forwarder is not None:
            forwarder, self._forwarder = self._forwarder, None
            await asyncio.get_running_loop().run_in_executor(None, forwarder.close)

    async def _close_http(self) -> None:
        """Drop the HTTP connection (bound to one URL) and the heartbeats, as before talking to another server."""
        if self._heartbeat is not None:
            self._heartbeat.cancel()
            self._heartbeat = None
        await self.client.drop_connection()

    async def down(self) -> None:
        """A RemoteBackend does not own its server: this only closes the connection."""
        await self.close()

    async def shutdown(self, wait_for_training_s: float = 0.0, timeout: float | None = None) -> ShutdownAnswer:
        """The server pushes its last checkpoints and exits: Client.shutdown."""
        return await self.client.shutdown(wait_for_training_s, timeout)

    async def final_push(self, timeout: float = FINAL_PUSH_WAIT_S) -> ShutdownAnswer | None:
        """`shutdown()` once, for a server that has answered: its answer, or None when there was nothing to
        ask (never reached, or already asked). Launchers call it before a machine is torn down."""
        if self.client.shut_down or not self.client.version_checked:
            return None
        return await self.shutdown(timeout=timeout)

    async def gone(self) -> bool:
        """True once the server is gone. A bare URL can only ask it; a backend that owns its machine
        asks the machine's provider."""
        try:
            await self.client.call("GET", "/health", retry=False)
        except ServerGone:
            return True
        return False

    async def __aenter__(self) -> "RemoteBackend":
        await self.start()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.down()

    async def _alive_or_replaced(self) -> None:
        """The client's liveness check: a replacement in flight is waited out first (asked meanwhile, the provider
        would call the new machine alive, or the old one dead); then _check_alive."""
        mine = _REPLACING.get()
        if not (mine is not None and mine[0] is self) and self._replacing is not None \
                and self._replacing[0] is asyncio.get_running_loop() and self._replacing[1].locked():
            async with self._replacing[1]:
                pass
        await self._check_alive()

    async def _check_alive(self) -> None:
        """Raise ServerGone if the server is known to be dead. A bare URL cannot tell: the event stream
        keeps reconnecting for a while instead. LocalBackend knows its child, SkyBackend its cluster."""

    # ------------------------------------------------------------------------------------- replacing a lost server

    async def recover(self, cause: BaseException, generation: int) -> bool:
        """After `cause` (a ServerGone): True when the server has been replaced, by this call or by another
        since `generation`, and every model registered through this backend registered again on the new one
        (each resumes from its last committed checkpoint on S3); False when this backend cannot replace its
        server, and the error stands."""
        async with self._replacing_lock():
            if self.generation != generation:
                return True
            return await self._replace_and_register(cause)

    async def recover_if_lost(self, error: BaseException, generation: int) -> bool:
        """A request failed at the transport: True if it should go again, because the server was replaced
        (since `generation`, or now, when it turns out to be lost). The liveness check waits for a
        replacement in flight: checked meanwhile, the new machine (still starting) would look dead."""
        if self.generation != generation:
            return True
        failed_at = time.monotonic()
        async with self._replacing_lock():
            if self.generation != generation:
                return True
            last = self._found_alive
            if last is not None and last[0] == generation and last[1] >= failed_at:
                return False  # a check begun after this failure found the server alive: one answers for all (R6)
            began = time.monotonic()
            try:
                await self._check_alive()
            except ServerGone as gone:
                return await self._replace_and_register(gone)
            self._found_alive = (generation, began)
            return False

    def _replacing_lock(self) -> asyncio.Lock:
        loop = asyncio.get_running_loop()
        if self._replacing is None or self._replacing[0] is not loop:  # a lock serves the loop it was made in
            self._replacing = (loop, asyncio.Lock())
        return self._replacing[1]

    async def _replace_and_register(self, cause: BaseException) -> bool:
        """recover's work, under its lock: a new server, every model registered on it again (each resumes from
        its last step on S3), then the steps S3 did not get trained again, in order. A machine lost meanwhile is
        replaced in turn (up to the provider's limit).

        All of it on a client of its own (`client` in this task): everyone else's requests keep going to the lost
        server, fail, and wait for this lock (recover_if_lost), so none reaches the new one before its models are
        back at their steps (code review 3, F2, R1). The new endpoint is published whole, with the next generation,
        at the end; a replacement that fails (a replay, say) publishes nothing, and its error stands (R2)."""
        while True:
            own = Client(self._public.endpoint, timeout=self._public.timeout, retries=self._public.retries,
                         event_read_timeout_s=self._public.event_read_timeout_s,
                         health_probe_timeout_s=self._public.health_probe_timeout_s,
                         check_alive=self._public.check_alive)
            scope = _REPLACING.set((self, own))
            try:
                replaced = await self._replace_server(cause)
                if replaced is None:
                    return False
                self.replacements.append(replaced)
                for kwargs in self._registrations.values():  # the lost server never released its S3 claims
                    info = await RemoteBackend.register(self, **kwargs, take_over=True)
                    await self._replay(kwargs["name"], info.step)
                for name, temperature in self._temperatures.items():
                    await RemoteBackend.set_temperature(self, name, temperature)
                for name, state in self._states.items():  # a write after the last step S3 got must not be lost
                    await self.client.call("PUT", f"/artcloud/models/{name}/state", json_body={"state": state or {}})
            except ServerGone as gone:
                cause = gone
                continue
            finally:
                _REPLACING.reset(scope)
                await own.drop_connection()
            await self._public.drop_connection()  # bound to the lost server
            self._public.endpoint = replace(own.endpoint, generation=self._public.endpoint.generation + 1)
            self._public.version_checked, self._public.shut_down = own.version_checked, own.shut_down
            return True

    def note_trained(self, name: str, step: int, body: dict[str, Any], s3: Any) -> None:
        """model.train's step `step` of `name` is committed: keep its request until the server says S3 holds it
        (`s3`: the server's S3 status at the step's end; None: no S3, so no replacement could resume anyway)."""
        if not isinstance(s3, dict):
            self._unpushed.pop(name, None)
            return
        pushed = s3.get("pushed_step")
        on_s3 = pushed if isinstance(pushed, int) else -1
        kept = [(s, b) for s, b in self._unpushed.get(name, []) if s > on_s3 and s != step]  # (a replayed step anew)
        if step > on_s3:
            kept.append((step, body))
        self._unpushed[name] = sorted(kept, key=lambda item: item[0])

    async def _replay(self, name: str, resumed: int) -> None:
        """Train again, on a new server that resumed `name` at step `resumed`, the steps the lost one committed
        but never pushed: the same groups and config, so that no step is lost and none is trained twice."""
        kept = [(s, b) for s, b in self._unpushed.get(name, []) if s > resumed]
        self._unpushed[name] = kept
        if kept and kept[0][0] != resumed + 1:
            raise ArtcloudError(f"{name} resumed from S3 at step {resumed}, but steps {resumed + 1}..{kept[0][0] - 1} "
                                "were neither on S3 nor kept here to train again: they are lost", code="steps_lost")
        for step, body in kept:
            log.warning("%s: step %d was committed on the lost machine but never reached S3: training it again on "
                        "the new one, from the same groups", name, step)
            job = await self.start_train(name, {**body, "idempotency_key": uuid.uuid4().hex})
            last = (await self.follow_job(job.job_id))[-1]
            data = last.data
            if last.type != "end" or data.get("step") != step:
                raise ArtcloudError(f"training step {step} of {name} again on the new machine failed: "
                                    f"{data.get('message') or last.type}", code=data.get("code", "replay_failed"))
            self.note_trained(name, step, body, data.get("s3"))

    async def _replace_server(self, cause: BaseException) -> dict[str, Any] | None:
        """Bring up a new server in place of the lost one; what was lost (for the run's summary), or None
        when this backend cannot. A bare URL cannot."""
        return None

    def _start_heartbeats(self) -> None:
        """Beats while the loop that registered runs; a later loop (a second asyncio.run) starts them again, since
        the first loop's task ended with it."""
        loop = asyncio.get_running_loop()
        if self.heartbeat_every_s > 0 and (self._heartbeat is None or self._heartbeat.done()
                                           or self._heartbeat.get_loop() is not loop):
            self._heartbeat = loop.create_task(self._beat(), name="artcloud-heartbeat")

    def _resume_heartbeats(self) -> None:
        """The client is used from another event loop than before: beats that had started go on in this one."""
        if self._heartbeat is not None:
            self._start_heartbeats()

    async def _beat(self) -> None:
        while True:
            await asyncio.sleep(self.heartbeat_every_s)
            try:
                await self._public.heartbeat()  # everyone's server (a task started in a replacement would see its own)
            except Exception as e:  # noqa: BLE001 - any failure: the next beat tries again, the lease needs it
                log.warning("heartbeat to %s failed: %s", self.base_url, e)
            try:
                await self._after_beat()
            except Exception as e:  # noqa: BLE001 - the next beat looks again
                log.warning("checking %s's machines failed: %s", self.base_url, e)

    async def _after_beat(self) -> None:
        """What a backend that owns its machines looks at on each beat (a bare URL: nothing)."""

    # ------------------------------------------------------------------------------------- models

    async def register(self, name: str, project: str, base_model: str | None, lora: dict[str, Any],
                       engine_args: dict[str, Any] | None = None, *,
                       take_over: bool = False) -> ModelInfo | PromptedInfo:
        info = await self.client.register(name, project, base_model, lora, engine_args, take_over=take_over)
        self._registrations[name] = dict(name=name, project=project, base_model=base_model, lora=lora,
                                         engine_args=engine_args)
        self._start_heartbeats()
        return info

    async def model_info(self, name: str) -> ModelInfo | PromptedInfo:
        return await self.client.model_info(name)

    async def log(self, name: str, body: dict[str, Any]) -> HistoryRecord:
        return await self.client.log(name, body)

    async def set_temperature(self, name: str, temperature: float) -> None:
        await self.client.set_temperature(name, temperature)
        self._temperatures[name] = temperature

    def model_state(self, name: str, body: dict[str, Any] | None = None) -> ModelState:
        """A model's persistent state (OpenPipe ART's state methods, which are synchronous): read, or written with
        `body` ({"state": ..., "merge": bool}); blocking, on a connection of its own. What is written is kept here
        too: a replacement server (a preempted spot machine) gets it again once its steps are back."""
        answer = self.client.model_state(name, body)
        if body is not None:
            self._states[name] = answer.state
        return answer

    async def delete_checkpoints(self, name: str, best_metric: str) -> Pruned:
        return await self.client.delete_checkpoints(name, best_metric)

    async def _experimental_fork_checkpoint(self, model: Any, from_model: str, from_project: str | None = None,
                                            from_s3_bucket: str | None = None, not_after_step: int | None = None,
                                            verbose: bool = False, prefix: str | None = None) -> None:
        """OpenPipe ART's: start `model` (not trained yet) from `from_model`'s newest committed checkpoint at or
        before `not_after_step`, found on the server's disk, else on S3 (`from_s3_bucket`/`prefix`, or the server's
        own --s3); the model is then at that step, its adapter and optimizer the other's (its history and state
        its own). The SFT-then-RL recipe: fork an SFT model, then train it with RL. Called before `register`, as
        ART's scripts do, it registers the model first."""
        if getattr(model, "_backend", None) is not self:
            await model.register(self)
        body = {"from_model": from_model, "from_project": from_project, "from_s3_bucket": from_s3_bucket,
                "prefix": prefix, "not_after_step": not_after_step}
        before = (await self.client.model_info(model.name)).step
        info = await self.client.fork(model.name, {k: v for k, v in body.items() if v is not None})
        model.step = info.step
        if before > 0 and info.step == before:
            log.warning("%s is at step %d already (this script ran before): it stays there, not forked from %s again",
                        model.name, before, from_model)
        elif verbose:
            log.warning("%s: forked from %s at step %d", model.name, from_model, info.step)

    async def _experimental_push_to_s3(self, *args: Any, **kwargs: Any) -> None:
        """OpenPipe ART's explicit push: artcloud pushes every checkpoint itself."""
        raise NotSupported("backend._experimental_push_to_s3() is OpenPipe ART's: give the backend s3=\"s3://BUCKET/PREFIX\" "
                           "(e.g. LocalBackend(s3=...)) and every checkpoint is pushed as it commits")

    async def _experimental_pull_from_s3(self, *args: Any, **kwargs: Any) -> None:
        """OpenPipe ART's explicit pull: an artcloud server resumes from S3 itself."""
        raise NotSupported("backend._experimental_pull_from_s3() is OpenPipe ART's: a server given the same "
                           "s3=\"s3://BUCKET/PREFIX\" (e.g. LocalBackend(s3=...)) resumes from its latest checkpoint at "
                           "register; artcloud.pull_checkpoint(...) fetches one to this machine")

    def inference_endpoint(self) -> tuple[str, str]:
        """(base_url, api_key) for a plain OpenAI client (ART's `model.inference_base_url` and
        `inference_api_key`): a loopback forwarder to this backend's server, see artcloud.backends.forwarder."""
        from artcloud.backends.forwarder import LoopbackForwarder

        with self._forwarder_lock:
            if self._forwarder is None:
                self._forwarder = LoopbackForwarder(self._forward_target)
            return self._forwarder.start(), self._forwarder.key

    def _forward_target(self) -> tuple[str, Any, str]:
        """The server as it is now (read per forwarded request, from the forwarder's thread)."""
        ep = self.endpoint
        key = (ep.ca, ep.check_hostname)
        if self._forward_ssl is None or self._forward_ssl[0] != key:
            self._forward_ssl = (key, client_ssl_context(ep.ca, check_hostname=ep.check_hostname))
        return ep.url, self._forward_ssl[1], ep.token

    def openai_client(self, **kwargs: Any):
        """An `openai.AsyncOpenAI` bound to this backend's server: the launch's CA alone is trusted. It follows
        the backend: when a lost server is replaced (a preempted spot machine), its requests go to the new
        one, with the new token and CA, and a request cut off by the loss is sent again."""
        import sys

        import openai

        from artcloud.backends.following import following_transport

        client_class = openai.DefaultAsyncHttpxClient  # httpx's AsyncClient, or httpx2's in newer openai releases
        hx = sys.modules[client_class.__mro__[1].__module__.partition(".")[0]]
        return openai.AsyncOpenAI(
            base_url=self.base_url + "/v1",
            api_key=self._token,
            http_client=client_class(transport=following_transport(self, hx, hx.Limits(
                max_connections=self.openai_connections, max_keepalive_connections=self.openai_connections))),
            **kwargs,
        )


    # ------------------------------------------------------------------------------------- training

    async def train(self, model: Any, trajectory_groups: Any, *, config: Any = None, verbose: bool = False,
                    progress: bool = True, **options: Any) -> Any:
        """ART's `await backend.train(model, groups, learning_rate=..., beta=..., ...)`: one step, like
        `model.train`. Options are ART's LocalBackend.train keywords (those artcloud has are honoured, the
        rest only at ART's defaults) or artcloud.TrainConfig's fields, over `config`. Returns a TrainResult
        (`step`, `metrics`, `checkpoint_path`: a folder on the server's disk; unpacks as that triple)."""
        train_on = getattr(model, "_train_on", None)  # TrainableModel's (artcloud.model imports this module, not back)
        if train_on is None:
            raise InvalidArgument(f"backend.train needs an artcloud.TrainableModel, not {type(model).__name__}", field="model")
        return await train_on(self, trajectory_groups, config, options, verbose=verbose, progress=progress)


    async def start_train(self, name: str, body: dict[str, Any]) -> JobSummary:
        return await self.client.start_train(name, body)

    async def follow_job(self, job_id: str, on_event: EventCallback | None = None,
                         reconnect_for_s: float = 300.0) -> list[Event]:
        return await self.client.follow_job(job_id, on_event, reconnect_for_s)


# OpenPipe ART's name for the class every backend is (artcloud's backends are a provisioner plus this protocol).
Backend = RemoteBackend

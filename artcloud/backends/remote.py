"""RemoteBackend: the one HTTP client of the artcloud protocol.

Every backend ends here: LocalBackend, SkyBackend and ModalBackend only add how a server comes to life
and goes away, then hand over a URL, the launch's CA and its token. The client trusts that CA alone,
refuses a server of another artcloud version, retries idempotent calls (and training posts, which carry
an idempotency key) on connection errors and 5xx, follows training events by cursor so that a dropped
connection loses nothing, and sends heartbeats for the server's lease.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import uuid
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Mapping

import httpx
from tenacity import AsyncRetrying, retry_if_exception, stop_after_attempt, wait_exponential_jitter

from artcloud._version import __version__
from artcloud.errors import ArtcloudError, InvalidArgument, NotSupported, api_error
from artcloud.protocol import FINAL_PUSH_DEADLINE_S
from artcloud.tls import client_ssl_context

log = logging.getLogger("artcloud.client")

EventCallback = Callable[[dict[str, Any]], None]

KEEPALIVE_S = 15.0  # the server writes a blank line on a quiet event stream this often (server/jobs.py heartbeat_s)
EVENT_READ_TIMEOUT_S = 3 * KEEPALIVE_S  # three missed keep-alives: ask /health whether the server is still there
HEALTH_PROBE_TIMEOUT_S = 10.0

# The server answers POST /artcloud/shutdown within FINAL_PUSH_DEADLINE_S (all models' pushes at once, after
# any wait for training); a client waits a minute more, so that it hears the verdict instead of giving up just before.
FINAL_PUSH_WAIT_S = FINAL_PUSH_DEADLINE_S + 60.0


REGISTER_TIMEOUT_S = 1800.0


class VersionMismatch(ArtcloudError):
    """The server runs another artcloud version than this client; the message says which to install."""

    code = "version_mismatch"


class ServerGone(ArtcloudError):
    """The server stopped answering (it died, or its machine went away)."""

    code = "server_gone"


def check_version(health: Mapping[str, Any]) -> None:
    """VersionMismatch unless a /health answer says this client's artcloud version."""
    server_version = health.get("version")
    if server_version != __version__:
        raise VersionMismatch(
            f"the server runs artcloud {server_version} and this client artcloud {__version__}: "
            "launch the server from this client's version (or install the server's version here)",
            code="version_mismatch",
        )


def _retryable(exc: BaseException) -> bool:
    if isinstance(exc, httpx.TransportError):
        return True
    return isinstance(exc, ArtcloudError) and exc.status is not None and exc.status >= 500


def _answer(response: httpx.Response) -> dict[str, Any]:
    """A 2xx answer's JSON object. Anything else (a proxy's HTML, a captive portal, a truncated body) is an
    ArtcloudError that says what answered, never a bare JSONDecodeError."""
    try:
        body = response.json()
    except ValueError:
        body = None
    if not isinstance(body, dict):
        kind = response.headers.get("content-type", "no content type")
        raise ArtcloudError(f"{response.status_code} from {response.request.method} {response.request.url.path} is not an "
                            f"artcloud answer ({kind}: {response.text[:80]!r}): something between here and the server "
                            "(a proxy, a captive portal) answered in its place", code="not_artcloud",
                            status=response.status_code)
    return body


def _event(line: str) -> dict[str, Any]:
    """One line of a job's event stream: a JSON object with an int `seq` and a str `type`, or an ArtcloudError."""
    try:
        event = json.loads(line)
    except ValueError:
        event = None
    if not (isinstance(event, dict) and isinstance(event.get("seq"), int) and isinstance(event.get("type"), str)):
        raise ArtcloudError(f"the event stream sent {line[:80]!r}, which is not an artcloud event: something between "
                            "here and the server answered in its place", code="not_artcloud")
    return event


def _raise_for(response: httpx.Response) -> None:
    if response.status_code < 400:
        return
    try:
        err = response.json()["error"]
        message, code, field = str(err["message"]), str(err.get("code", "error")), err.get("field")
    except (ValueError, KeyError, TypeError):
        message, code, field = response.text[:500] or response.reason_phrase, "http_error", None
    raise api_error(response.status_code, f"{response.status_code} {code}: {message}", code=code,
                    field=field if isinstance(field, str) else None)


@dataclass(frozen=True)
class Endpoint:
    """Where the server is and how it is trusted, as one value: a replacement publishes a new Endpoint whole,
    so a reader on another thread (the loopback forwarder, the OpenAI transport) never sees a new token with an
    old URL. `generation` counts the replacements."""

    url: str
    token: str = field(repr=False)
    ca: str | Path | None = field(default=None, repr=False)  # PEM, a file, or None: the public CAs
    # False only for a launch CA: it signed this one server certificate and its key is gone, so the CA alone
    # identifies the server, whatever address the provider gave it.
    check_hostname: bool = True
    generation: int = 0


@dataclass(frozen=True)
class PushVerdict:
    """What a shutdown answer says about one model's final push to S3 (see `push_verdicts`)."""

    name: str
    step: int  # the newest committed step, on the server's disk
    status: str  # "pushed" (S3 has `step`), "not_pushed", or "no_s3" (the server had no S3 to push to)
    on_s3: int | None = None  # the newest step that IS on S3 (None: none yet, or no S3)
    reason: str | None = None  # why a push is not confirmed
    dropped_training: bool = False  # a step still computing at shutdown was dropped (never committed)

    @property
    def confirmed(self) -> bool:
        return self.status == "pushed"

    def line(self, on_sandbox: bool = False) -> str:
        """One line for a person: what is safe where."""
        label = f"{self.name}@{self.step}"
        if self.status == "pushed":
            text = f"last checkpoint pushed ({label})"
        elif self.status == "no_s3":
            text = f"no S3 for {label}: its checkpoints stayed on the server's disk" + (
                " and go with the sandbox" if on_sandbox else "")
        else:
            newest = f"the newest step on S3 is {self.on_s3}" if self.on_s3 is not None else "nothing of it is on S3"
            text = f"last checkpoint NOT pushed ({label}): {self.reason}; {newest}"
        return text + ("; a training step in flight was dropped" if self.dropped_training else "")


def push_verdicts(answer: dict[str, Any]) -> list[PushVerdict]:
    """Judge each model of a POST /artcloud/shutdown answer. A push is confirmed only when S3 holds the
    newest committed step (`pushed_step == step`), no push is pending and neither the pusher
    (`last_error`) nor the shutdown (`error`) reported a failure. Anything else is not confirmed, with
    the reason and the newest step that is on S3."""
    verdicts = []
    for model in answer.get("models", []):
        name, step, s3 = model["name"], model["step"], model.get("s3")
        dropped = bool(model.get("training"))
        if s3 is None:
            verdicts.append(PushVerdict(name, step, "no_s3", dropped_training=dropped))
            continue
        pushed = s3.get("pushed_step")
        # The first reason that applies, most telling first (a failed push also leaves it pending).
        if model.get("error"):
            reason = f"the final push failed: {_first_line(model['error'])}"
        elif s3.get("last_error"):
            reason = f"S3 error: {_first_line(s3['last_error'])}"
        elif s3.get("pending"):
            reason = "a push was still running"
        elif pushed != step:
            reason = f"S3 has step {pushed}, not {step}" if pushed is not None else "no step of it reached S3"
        else:
            reason = None
        verdicts.append(PushVerdict(name, step, "pushed" if reason is None else "not_pushed", on_s3=pushed,
                                    reason=reason, dropped_training=dropped))
    return verdicts


def _first_line(text: str, limit: int = 200) -> str:
    line = str(text).strip().splitlines()[0] if str(text).strip() else ""
    return line if len(line) <= limit else line[:limit - 3] + "..."


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


class RemoteBackend:
    """A running `artcloud serve`, reached at `base_url` over HTTPS with the launch's token and CA."""

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
        self.endpoint = Endpoint(base_url.rstrip("/"), token, ca_cert, check_hostname)
        self._staged: dict[str, Any] = {}  # a launch's token and CA, published with its URL once the server is ready
        self.timeout = timeout
        self.retries = retries
        self.heartbeat_every_s = heartbeat_every_s
        # A followed job's stream carries an event or a keep-alive at least every KEEPALIVE_S: silence
        # for longer means the server or the path to it is gone (a half-open connection never errors).
        self.event_read_timeout_s = event_read_timeout_s
        self.health_probe_timeout_s = health_probe_timeout_s
        self._http: httpx.AsyncClient | None = None
        self._heartbeat: asyncio.Task | None = None
        self._version_checked = False
        self._shut_down = False  # the server was asked to push its last checkpoint and exit
        # Replacing a lost server (a preempted spot machine): each replacement bumps the generation, so
        # requests that failed on the old server know to go again; what was registered is registered again.
        self._replacing: asyncio.Lock | None = None
        self._registrations: dict[str, dict[str, Any]] = {}
        # Per model: the steps committed on the server that S3 does not hold yet, with the train request that
        # made each. The server pushes a step after it commits it (and model.train returns): a machine lost in
        # between takes the step with it, and its replacement trains it again from these (_replay).
        self._unpushed: dict[str, list[tuple[int, dict[str, Any]]]] = {}
        self._temperatures: dict[str, float] = {}
        self.replacements: list[dict[str, Any]] = []  # each lost server that was replaced: when, why, its cost
        self.cold_start_s: dict[str, float] = {}  # seconds per cold-start phase of this server (COLD_START_PHASES)
        self._forwarder: Any = None  # the loopback endpoint for plain OpenAI clients, started when first asked for
        self._forwarder_lock = threading.Lock()  # model.inference_base_url may be read from several threads
        self._forward_ssl: tuple[Any, Any] | None = None  # ((ca_cert, check_hostname), its SSLContext)

    def __repr__(self) -> str:  # never the token
        return f"{type(self).__name__}({self.base_url!r})"

    # The endpoint's parts, read-only: it changes only whole (_publish).
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
        """The one way the endpoint changes: a new value, whole, with what was staged."""
        changes = {**self._staged, **changes, **({"url": url.rstrip("/")} if url else {})}
        self._staged = {}
        self.endpoint = replace(self.endpoint, **changes)

    def __call__(self) -> "RemoteBackend":
        """ART's `model.backend()` is a method, artcloud's `model.backend` a property: calling it gives the same."""
        return self

    # ------------------------------------------------------------------------------------- plumbing

    def _client(self) -> httpx.AsyncClient:
        if self._http is None:
            ep = self.endpoint
            self._http = httpx.AsyncClient(
                base_url=ep.url,
                verify=client_ssl_context(ep.ca, check_hostname=ep.check_hostname),
                headers={"Authorization": f"Bearer {ep.token}", "User-Agent": f"artcloud/{__version__}"},
                timeout=httpx.Timeout(self.timeout, connect=30.0),
            )
        return self._http

    async def _call(self, method: str, path: str, *, json_body: Any = None, retry: bool = True,
                    params: dict[str, Any] | None = None, headers: dict[str, str] | None = None,
                    timeout: float | None = None) -> dict[str, Any]:
        attempts = AsyncRetrying(
            stop=stop_after_attempt(self.retries if retry else 1),
            wait=wait_exponential_jitter(initial=0.5, max=15.0),
            retry=retry_if_exception(_retryable),
            reraise=True,
        )
        try:
            async for attempt in attempts:
                with attempt:
                    response = await self._client().request(method, path, json=json_body, params=params, headers=headers,
                                                            **({"timeout": httpx.Timeout(timeout, connect=30.0)} if timeout else {}))
                    _raise_for(response)
                    return _answer(response)
        except httpx.TransportError as e:
            raise ServerGone(f"the artcloud server at {self.base_url} does not answer ({type(e).__name__}: {e})",
                             code="server_unreachable") from e
        raise AssertionError("unreachable")

    # ------------------------------------------------------------------------------------- lifecycle

    async def start(self) -> None:
        """Check the server: its version must equal this client's."""
        await self.health()

    async def health(self, *, retry: bool = True) -> dict[str, Any]:
        body = await self._call("GET", "/health", retry=retry)
        check_version(body)
        self._version_checked = True
        return body

    def _note_phases(self, body: Mapping[str, Any]) -> None:
        """Take the server's own phase durations from a /health answer (numbers only: it is the network's)."""
        phases = body.get("phases")
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
        if not self._shut_down:
            try:
                self._note_phases(await self.health(retry=False))
            except ArtcloudError:
                pass  # gone, or never up: what was measured stays
        return cold_start_rows(self.cold_start_s, self.price_per_hour)

    async def wait_ready(self, timeout: float = 600.0) -> dict[str, Any]:
        deadline = asyncio.get_running_loop().time() + timeout
        while True:
            body = await self.health()
            if body.get("ready"):
                return body
            if asyncio.get_running_loop().time() > deadline:
                raise ArtcloudError(f"the server at {self.base_url} was not ready after {timeout:.0f} s", code="not_ready")
            await asyncio.sleep(0.5)

    async def close(self) -> None:
        """Close the connection and the loopback endpoint (`inference_base_url`). The server stays up:
        `down()` ends one this backend owns."""
        await self._close_http()
        if self._forwarder is not None:
            forwarder, self._forwarder = self._forwarder, None
            await asyncio.get_running_loop().run_in_executor(None, forwarder.close)

    async def _close_http(self) -> None:
        """Drop the HTTP client (bound to one URL) and the heartbeats, as before talking to another server."""
        if self._heartbeat is not None:
            self._heartbeat.cancel()
            self._heartbeat = None
        if self._http is not None:
            await self._http.aclose()
            self._http = None

    async def down(self) -> None:
        """A RemoteBackend does not own its server: this only closes the connection."""
        await self.close()

    async def shutdown(self, wait_for_training_s: float = 0.0, timeout: float | None = None) -> dict[str, Any]:
        """Ask the server to end itself gracefully: POST /artcloud/shutdown.

        Once this returns, the server takes no new training jobs (409 shutting_down), has waited up to
        `wait_for_training_s` for queued and running ones, and has pushed every model's newest committed
        checkpoint to S3 (or tried to): each entry of the answer's `models` gives its `step`, its `s3`
        status (None without S3; the push is safe when `pushed_step == step`, `pending` is false and
        `last_error` is None; `error` says why a push did not finish), and `training: true` where a job
        was still at work (its step is not committed and is lost); `push_verdicts(answer)` judges them.
        The process then exits with status 0 shortly after answering, so the machine may be torn down
        once this returns. Sent once, never retried (a lost answer may mean the server already left); a
        server that does not answer raises ServerGone. `timeout` bounds the whole call, waiting and
        pushes included: the default covers the server's own bounds, its wait for training and its final push.
        """
        timeout = timeout if timeout is not None else wait_for_training_s + FINAL_PUSH_WAIT_S
        async def post() -> dict[str, Any]:
            # Its own timeout: the server may wait for training and pushes far longer than self.timeout.
            response = await self._client().post("/artcloud/shutdown", json={"wait_for_training_s": wait_for_training_s},
                                                  timeout=httpx.Timeout(timeout, connect=30.0))
            _raise_for(response)
            return _answer(response)

        try:
            answer = await asyncio.wait_for(post(), timeout)
            self._shut_down = True
            return answer
        except (httpx.TransportError, asyncio.TimeoutError) as e:
            if isinstance(e, (httpx.TimeoutException, asyncio.TimeoutError)):
                self._shut_down = True  # a server silent for the whole wait: final_push asks it no second time
            raise ServerGone(f"the artcloud server at {self.base_url} did not answer the shutdown request "
                             f"({type(e).__name__}: {e})", code="server_unreachable") from e

    async def final_push(self, timeout: float = FINAL_PUSH_WAIT_S) -> dict[str, Any] | None:
        """`shutdown()` once, for a server that has answered: its answer, or None when there was nothing to
        ask (never reached, or already asked). Launchers call it before a machine is torn down."""
        if self._shut_down or not self._version_checked:
            return None
        return await self.shutdown(timeout=timeout)

    async def gone(self) -> bool:
        """True once the server is gone. A bare URL can only ask it; a backend that owns its machine
        asks the machine's provider."""
        try:
            await self._call("GET", "/health", retry=False)
        except ServerGone:
            return True
        return False

    async def __aenter__(self) -> "RemoteBackend":
        await self.start()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.down()

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
        async with self._replacing_lock():
            if self.generation != generation:
                return True
            try:
                await self._check_alive()
            except ServerGone as gone:
                return await self._replace_and_register(gone)
            return False

    def _replacing_lock(self) -> asyncio.Lock:
        if self._replacing is None:
            self._replacing = asyncio.Lock()
        return self._replacing

    async def _replace_and_register(self, cause: BaseException) -> bool:
        """recover's work, under its lock: a new server, every model registered on it again (each resumes from
        its last step on S3), then the steps S3 did not get trained again, in order. A machine lost meanwhile is
        replaced in turn (up to the provider's limit)."""
        while True:
            replaced = await self._replace_server(cause)
            if replaced is None:
                return False
            self.replacements.append(replaced)
            try:
                for kwargs in self._registrations.values():  # the lost server never released its S3 claims
                    info = await RemoteBackend.register(self, **kwargs, take_over=True)
                    await self._replay(kwargs["name"], int(info["step"]))
                for name, temperature in self._temperatures.items():
                    await RemoteBackend.set_temperature(self, name, temperature)
            except ServerGone as gone:
                cause = gone
                continue
            self._publish(generation=self.generation + 1)
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
            last = (await self.follow_job(job["job_id"]))[-1]
            data = last.get("data", {})
            if last["type"] != "end" or data.get("step") != step:
                raise ArtcloudError(f"training step {step} of {name} again on the new machine failed: "
                                    f"{data.get('message') or last['type']}", code=data.get("code", "replay_failed"))
            self.note_trained(name, step, body, data.get("s3"))

    async def _replace_server(self, cause: BaseException) -> dict[str, Any] | None:
        """Bring up a new server in place of the lost one; what was lost (for the run's summary), or None
        when this backend cannot. A bare URL cannot."""
        return None

    def _start_heartbeats(self) -> None:
        if self._heartbeat is None and self.heartbeat_every_s > 0:
            self._heartbeat = asyncio.get_running_loop().create_task(self._beat(), name="artcloud-heartbeat")

    async def _beat(self) -> None:
        while True:
            await asyncio.sleep(self.heartbeat_every_s)
            try:
                await self._call("POST", "/artcloud/heartbeat", retry=False)
            except Exception as e:  # noqa: BLE001 - any failure: the next beat tries again, the lease needs it
                log.warning("heartbeat to %s failed: %s", self.base_url, e)

    # ------------------------------------------------------------------------------------- models

    async def register(self, name: str, project: str, base_model: str | None, lora: dict[str, Any],
                       engine_args: dict[str, Any] | None = None, *, take_over: bool = False) -> dict[str, Any]:
        if not self._version_checked:
            await self.health()
        # The first model on a base model loads it, and a vLLM engine starts its process: minutes for a 14B model.
        info = await self._call("POST", "/artcloud/models", timeout=REGISTER_TIMEOUT_S,
                                json_body={"name": name, "project": project, "base_model": base_model, "lora": lora,
                                           **({"engine_args": engine_args} if engine_args else {}),
                                           **({"take_over": True} if take_over else {})})
        self._registrations[name] = dict(name=name, project=project, base_model=base_model, lora=lora,
                                         engine_args=engine_args)
        self._start_heartbeats()
        return info

    async def model_info(self, name: str) -> dict[str, Any]:
        return await self._call("GET", f"/artcloud/models/{name}")

    async def log(self, name: str, body: dict[str, Any]) -> dict[str, Any]:
        """Record a split's metrics in the model's history (model.log). Not retried: a retry could record twice."""
        return await self._call("POST", f"/artcloud/models/{name}/log", json_body=body, retry=False)

    async def set_temperature(self, name: str, temperature: float) -> None:
        await self._call("PUT", f"/artcloud/models/{name}/temperature", json_body={"temperature": temperature})
        self._temperatures[name] = temperature

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
            http_client=client_class(transport=following_transport(self, hx, getattr(openai, "DEFAULT_CONNECTION_LIMITS", None))),
            **kwargs,
        )

    async def delete_checkpoints(self, name: str, best_metric: str) -> dict[str, Any]:
        """Delete `name`'s checkpoints on the server but the latest and the best by `best_metric`."""
        return await self._call("POST", f"/artcloud/models/{name}/checkpoints/prune", json_body={"best_metric": best_metric})

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

    async def start_train(self, name: str, body: dict[str, Any]) -> dict[str, Any]:
        """POST a training job. The body's idempotency_key makes a retried POST return the same job."""
        assert body.get("idempotency_key"), "training posts must carry an idempotency key"
        return await self._call("POST", f"/artcloud/models/{name}/train", json_body=body)

    async def follow_job(self, job_id: str, on_event: EventCallback | None = None,
                         reconnect_for_s: float = 300.0) -> list[dict[str, Any]]:
        """Every event of a job, in order, until it ends. A dropped stream reconnects from its cursor.

        A stream silent for `event_read_timeout_s` (no event, no keep-alive) asks GET /health once: a
        server that does not answer within `health_probe_timeout_s` is gone (a preempted VM, a partition,
        a stopped process) and raises ServerGone at once; one that answers gets the stream reopened."""
        events: list[dict[str, Any]] = []
        loop = asyncio.get_running_loop()
        failing_since: float | None = None
        delay = 0.5
        while True:
            try:
                async with self._client().stream("GET", f"/artcloud/jobs/{job_id}/events",
                                                 params={"after": len(events), "follow": "true"},
                                                 timeout=httpx.Timeout(self.timeout, connect=30.0,
                                                                       read=self.event_read_timeout_s)) as response:
                    if response.status_code >= 400:
                        await response.aread()
                        _raise_for(response)
                    async for line in response.aiter_lines():
                        if not line.strip():
                            continue  # keep-alive
                        event = _event(line)
                        if event["seq"] != len(events) + 1:
                            continue  # never count an event twice
                        events.append(event)
                        failing_since, delay = None, 0.5
                        if on_event is not None:
                            on_event(event)
                        if event["type"] in ("end", "error"):
                            return events
            except (httpx.TransportError, ArtcloudError) as e:
                if isinstance(e, ArtcloudError) and not _retryable(e):
                    raise
                await self._check_alive()
                if isinstance(e, httpx.TimeoutException):
                    await self._probe_after_silence(job_id, e)
                now = loop.time()
                failing_since = failing_since or now
                if now - failing_since > reconnect_for_s:
                    raise ServerGone(f"lost the event stream of {job_id} for {reconnect_for_s:.0f} s: the server at "
                                     f"{self.base_url} is gone ({e})", code="server_unreachable") from e
                log.info("event stream of %s dropped (%s); reconnecting after seq %d", job_id, e, len(events))
                await asyncio.sleep(delay)
                delay = min(delay * 2, 10.0)

    async def _probe_after_silence(self, job_id: str, cause: Exception) -> None:
        """One quick GET /health, no retries: return if the server answers, else raise ServerGone."""
        probe = self.health_probe_timeout_s
        try:
            # wait_for as well: a stopped peer may accept TCP and then never finish the TLS handshake.
            response = await asyncio.wait_for(self._client().get("/health", timeout=httpx.Timeout(probe)), probe + 1.0)
        except (httpx.TransportError, asyncio.TimeoutError) as e:
            raise ServerGone(
                f"the artcloud server at {self.base_url} went silent while training job {job_id}: no event nor "
                f"keep-alive for {self.event_read_timeout_s:.0f} s, and GET /health did not answer within {probe:.0f} s "
                f"({type(e).__name__}). It was stopped, preempted or cut off; the model's last committed checkpoint "
                "is what a new server resumes from", code="server_unreachable") from cause
        log.info("event stream of %s silent for %.0f s (%s) but /health answers %d: reconnecting",
                 job_id, self.event_read_timeout_s, type(cause).__name__, response.status_code)


# OpenPipe ART's name for the class every backend is (artcloud's backends are a provisioner plus this protocol).
Backend = RemoteBackend

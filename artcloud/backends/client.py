"""Client: the artcloud protocol over HTTPS, and nothing else.

One `Endpoint` (URL, token, CA) at a time. The client trusts that CA alone, refuses a server of another artcloud
version, retries idempotent calls (and training posts, which carry an idempotency key) on connection errors and
5xx, follows a job's events by cursor so that a dropped connection loses nothing, and turns every answer that is
not the protocol's (an error body, a proxy's HTML, a truncated stream) into an ArtcloudError. What a server runs on,
and what happens when it is lost, are the backend's (remote.py, sandbox.py).
"""

from __future__ import annotations

import asyncio
import json
import logging
from contextvars import ContextVar
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Awaitable, Callable

import httpx
from tenacity import AsyncRetrying, retry_if_exception, stop_after_attempt, wait_exponential_jitter

from artcloud._version import __version__
from artcloud.errors import ArtcloudError, api_error, first_line
from artcloud.tls import client_ssl_context
from artcloud.wire import (
    FINAL_PUSH_DEADLINE_S,
    Event,
    Health,
    HistoryRecord,
    JobSummary,
    ModelInfo,
    ModelState,
    PromptedInfo,
    Pruned,
    SFTAccepted,
    ShutdownAnswer,
    ShutdownPrompted,
    Status,
    parse,
)

log = logging.getLogger("artcloud.client")

EventCallback = Callable[[Event], None]

KEEPALIVE_S = 15.0  # the server writes a blank line on a quiet event stream this often (server/jobs.py heartbeat_s)
EVENT_READ_TIMEOUT_S = 3 * KEEPALIVE_S  # three missed keep-alives: ask /health whether the server is still there
HEALTH_PROBE_TIMEOUT_S = 10.0

# The server answers POST /artcloud/shutdown within FINAL_PUSH_DEADLINE_S (all models' pushes at once, after
# any wait for training); a client waits a minute more, so that it hears the verdict instead of giving up just before.
FINAL_PUSH_WAIT_S = FINAL_PUSH_DEADLINE_S + 60.0

# A read follows at most this many replacements of its server (each one waited out by the backend's liveness check).
MAX_FOLLOWED_REPLACEMENTS = 2
# Set while a call asks the backend's liveness check, which may itself ask the server (RunnerBackend._check_alive):
# a read that fails inside it does not ask again.
_CHECKING_ALIVE: ContextVar[bool] = ContextVar("artcloud_checking_alive", default=False)


REGISTER_TIMEOUT_S = 1800.0
# An SFT chunk is answered once the job has room for it: two chunks of training at most (a 14B model's batches take
# minutes on a GPU).
SFT_CHUNK_WAIT_S = 3600.0


class VersionMismatch(ArtcloudError):
    """The server runs another artcloud version than this client; the message says which to install."""

    code = "version_mismatch"


class ServerGone(ArtcloudError):
    """The server stopped answering (it died, or its machine went away)."""

    code = "server_gone"


def check_version(server_version: Any) -> None:
    """VersionMismatch unless a /health answer's `version` is this client's artcloud version."""
    if server_version != __version__:
        raise VersionMismatch(
            f"the server runs artcloud {server_version} and this client artcloud {__version__}: "
            "launch the server from this client's version (or install the server's version here)",
            code="version_mismatch",
        )


def _retryable(exc: BaseException, busy: bool = False) -> bool:
    """A lost connection or a 5xx; with `busy`, also a 429 `too_many_requests` (the server is reading as many
    training bodies as it takes at once: seconds)."""
    if isinstance(exc, httpx.TransportError):
        return True
    if not isinstance(exc, ArtcloudError) or exc.status is None:
        return False
    return exc.status >= 500 or busy and exc.status == 429 and exc.code == "too_many_requests"


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


def _event(line: str) -> Event:
    """One line of a job's event stream as an Event, or an ArtcloudError."""
    try:
        event = json.loads(line)
    except ValueError:
        event = None
    if not (isinstance(event, dict) and isinstance(event.get("seq"), int) and isinstance(event.get("type"), str)):
        raise ArtcloudError(f"the event stream sent {line[:80]!r}, which is not an artcloud event: something between "
                            "here and the server answered in its place", code="not_artcloud")
    return parse(Event, event, "an event of the job stream")


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
    prompted: bool = False  # a prompted model: no checkpoints, its history is what is pushed

    @property
    def confirmed(self) -> bool:
        return self.status == "pushed"

    def line(self, on_sandbox: bool = False) -> str:
        """One line for a person: what is safe where."""
        label = f"{self.name}@{self.step}"
        if self.prompted:
            return {"pushed": f"history pushed ({self.name})",
                    "no_s3": f"no S3 for {self.name}: its history stayed on the server's disk"}.get(
                self.status, f"history NOT pushed ({self.name}): {self.reason}")
        if self.status == "pushed":
            text = f"last checkpoint pushed ({label})"
        elif self.status == "no_s3":
            text = f"no S3 for {label}: its checkpoints stayed on the server's disk" + (
                " and go with the sandbox" if on_sandbox else "")
        else:
            newest = f"the newest step on S3 is {self.on_s3}" if self.on_s3 is not None else "nothing of it is on S3"
            text = f"last checkpoint NOT pushed ({label}): {self.reason}; {newest}"
        return text + ("; a training step in flight was dropped" if self.dropped_training else "")


def push_verdicts(answer: ShutdownAnswer) -> list[PushVerdict]:
    """Judge each model of a POST /artcloud/shutdown answer. A push is confirmed only when S3 holds the
    newest committed step (`pushed_step == step`), no push is pending and neither the pusher
    (`last_error`) nor the shutdown (`error`) reported a failure. Anything else is not confirmed, with
    the reason and the newest step that is on S3."""
    verdicts = []
    for model in answer.models:
        name, step, s3, dropped = model.name, model.step, model.s3, model.training
        prompted = isinstance(model, ShutdownPrompted)  # no steps: its history is what it pushes
        if s3 is None:
            verdicts.append(PushVerdict(name, step, "no_s3", dropped_training=dropped, prompted=prompted))
            continue
        pushed = s3.pushed_step
        if prompted:
            failed = model.error or s3.last_error or ("a push was still running" if s3.pending else None)
            verdicts.append(PushVerdict(name, step, "not_pushed" if failed else "pushed", on_s3=pushed,
                                        reason=first_line(failed) if failed else None, prompted=True))
            continue
        # The first reason that applies, most telling first (a failed push also leaves it pending).
        if model.error:
            reason = f"the final push failed: {first_line(model.error)}"
        elif s3.last_error:
            reason = f"S3 error: {first_line(s3.last_error)}"
        elif s3.pending:
            reason = "a push was still running"
        elif pushed != step:
            reason = f"S3 has step {pushed}, not {step}" if pushed is not None else "no step of it reached S3"
        else:
            reason = None
        verdicts.append(PushVerdict(name, step, "pushed" if reason is None else "not_pushed", on_s3=pushed,
                                    reason=reason, dropped_training=dropped))
    return verdicts


def _model(body: dict[str, Any], what: str) -> ModelInfo | PromptedInfo:
    return parse(PromptedInfo if body.get("prompted") else ModelInfo, body, what)


class Client:
    """The HTTP side of one server: `endpoint` says where it is and how it is trusted. A backend swaps the
    endpoint whole (after `drop_connection`) when its server is replaced; nothing else here changes it."""

    def __init__(self, endpoint: Endpoint, *, timeout: float = 120.0, retries: int = 6,
                 event_read_timeout_s: float = EVENT_READ_TIMEOUT_S,
                 health_probe_timeout_s: float = HEALTH_PROBE_TIMEOUT_S,
                 check_alive: Callable[[], Awaitable[None]] | None = None,
                 on_new_loop: Callable[[], None] | None = None):
        self.endpoint = endpoint
        self.timeout = timeout
        self.retries = retries
        # A followed job's stream carries an event or a keep-alive at least every KEEPALIVE_S: silence
        # for longer means the server or the path to it is gone (a half-open connection never errors).
        self.event_read_timeout_s = event_read_timeout_s
        self.health_probe_timeout_s = health_probe_timeout_s
        self.check_alive = check_alive  # the backend's: raise ServerGone when the server is known dead
        self.on_new_loop = on_new_loop  # the backend's: called when a call comes from another event loop than before
        self.version_checked = False  # the server answered /health with this client's version
        self.shut_down = False  # the server was asked to push its last checkpoint and exit
        self._http: httpx.AsyncClient | None = None
        self._http_loop: asyncio.AbstractEventLoop | None = None  # the loop _http's connections are bound to

    def __repr__(self) -> str:  # never the token
        return f"Client({self.endpoint.url!r})"

    def _client(self) -> httpx.AsyncClient:
        loop = asyncio.get_running_loop()
        if self._http is not None and self._http_loop is not loop:
            # A second asyncio.run() (register in one, train in the next; a notebook): the first loop's connections
            # cannot be used, nor closed, from this one (code review 3, F10). Dropped, and a client made here.
            self._http = None
            if self.on_new_loop is not None:
                self.on_new_loop()
        if self._http is None:
            self._http_loop = loop
            ep = self.endpoint
            self._http = httpx.AsyncClient(
                base_url=ep.url,
                verify=client_ssl_context(ep.ca, check_hostname=ep.check_hostname),
                headers={"Authorization": f"Bearer {ep.token}", "User-Agent": f"artcloud/{__version__}"},
                timeout=httpx.Timeout(self.timeout, connect=30.0),
            )
        return self._http

    async def drop_connection(self) -> None:
        """Close the HTTP connection (bound to one endpoint); the next call opens one to the endpoint then."""
        if self._http is not None:
            http, self._http = self._http, None
            if self._http_loop is asyncio.get_running_loop():  # another loop's cannot be closed from this one
                await http.aclose()

    def forget_connection(self) -> None:
        """Drop the connection without closing it: the event loop it was bound to is gone."""
        self._http = None

    async def call(self, method: str, path: str, *, json_body: Any = None, retry: bool = True, busy: bool = False,
                   params: dict[str, Any] | None = None, timeout: float | None = None) -> dict[str, Any]:
        """One request and its answer's JSON object, raw (the typed calls below parse it); retried, unless
        retry=False, on a lost connection or a 5xx (and a busy 429 with `busy`). A server that does not answer
        at all is ServerGone.

        A read (a retried GET) that the server stopped answering asks the backend's liveness check, which waits out
        a replacement in flight (a lost spot machine, RemoteBackend.recover): once the new server is published,
        the read goes there. Without that, a read sent while a replacement brings up a machine (minutes) failed
        when its retries (seconds) ran out."""
        followed = 0
        while True:
            generation = self.endpoint.generation
            try:
                return await self._call(method, path, json_body=json_body, retry=retry, busy=busy, params=params,
                                        timeout=timeout)
            except ServerGone as gone:
                if not (method == "GET" and retry and gone.code == "server_unreachable" and self.check_alive
                        is not None and not _CHECKING_ALIVE.get() and followed < MAX_FOLLOWED_REPLACEMENTS):
                    raise
                scope = _CHECKING_ALIVE.set(True)  # a check that asks the server itself (RunnerBackend) asks it once
                try:
                    await self.check_alive()  # ServerGone when the server is known dead
                finally:
                    _CHECKING_ALIVE.reset(scope)
                if self.endpoint.generation == generation:
                    raise  # alive as far as its provider knows, and not replaced: the transport error stands
                followed += 1
                log.warning("%s %s: the server was replaced meanwhile; asking the new one at %s", method, path,
                            self.endpoint.url)

    async def _call(self, method: str, path: str, *, json_body: Any, retry: bool, busy: bool,
                    params: dict[str, Any] | None, timeout: float | None) -> dict[str, Any]:
        """call's request on the server as it is, retried; a server that does not answer is ServerGone."""
        attempts = AsyncRetrying(
            stop=stop_after_attempt(self.retries if retry else 1),
            wait=wait_exponential_jitter(initial=0.5, max=15.0),
            retry=retry_if_exception(partial(_retryable, busy=busy)),
            reraise=True,
        )
        generation = self.endpoint.generation
        try:
            async for attempt in attempts:
                with attempt:
                    if method == "GET":  # a read: whichever server answers it, the one it was sent to or the next
                        generation = self.endpoint.generation
                    self._same_server(generation, f"{method} {path}")
                    response = await self._client().request(method, path, json=json_body, params=params,
                                                            **({"timeout": httpx.Timeout(timeout, connect=30.0)} if timeout else {}))
                    _raise_for(response)
                    return _answer(response)
        except httpx.TransportError as e:
            raise ServerGone(f"the artcloud server at {self.endpoint.url} does not answer ({type(e).__name__}: {e})",
                             code="server_unreachable") from e
        raise AssertionError("unreachable")

    def _same_server(self, generation: int, what: str) -> None:
        """A request is retried on the server it was first sent to, never on the one that replaced it: a training
        POST the lost server may have committed (and pushed) must go through the caller's recovery, which knows
        (code review 3, R1)."""
        if self.endpoint.generation != generation:
            raise ServerGone(f"the server was replaced while {what} was being retried: the caller's recovery decides "
                             "whether to send it again", code="server_replaced")

    def call_sync(self, method: str, path: str, *, json_body: Any = None, attempts: int = 3) -> dict[str, Any]:
        """`call`, blocking, on a connection of its own: for OpenPipe ART's synchronous model methods
        (read_state, merge_state), which scripts call from inside their event loop. Retried on a lost connection
        and on a 5xx; a server that does not answer is ServerGone."""
        import time

        ep = self.endpoint
        with httpx.Client(base_url=ep.url, verify=client_ssl_context(ep.ca, check_hostname=ep.check_hostname),
                          headers={"Authorization": f"Bearer {ep.token}", "User-Agent": f"artcloud/{__version__}"},
                          timeout=httpx.Timeout(self.timeout, connect=30.0)) as http:
            for attempt in range(1, attempts + 1):
                try:
                    response = http.request(method, path, json=json_body)
                    _raise_for(response)
                    return _answer(response)
                except Exception as e:
                    if attempt == attempts or not _retryable(e):
                        if isinstance(e, httpx.TransportError):
                            raise ServerGone(f"the artcloud server at {ep.url} does not answer ({type(e).__name__}: "
                                             f"{e})", code="server_unreachable") from e
                        raise
                    time.sleep(0.5 * 2 ** (attempt - 1))
        raise AssertionError("unreachable")

    def model_state(self, name: str, body: dict[str, Any] | None = None) -> ModelState:
        """GET (body None) or PUT a model's state (OpenPipe ART's read_state / overwrite_state / merge_state), blocking.
        A PUT is retried: writing the same state (or merging the same object) twice gives the same state."""
        path = f"/artcloud/models/{name}/state"
        answer = self.call_sync("GET" if body is None else "PUT", path, json_body=body)
        return parse(ModelState, answer, f"{'GET' if body is None else 'PUT'} {path}")

    async def health(self, *, retry: bool = True) -> Health:
        body = await self.call("GET", "/health", retry=retry)
        check_version(body.get("version"))  # first: another version's answer may have another shape
        self.version_checked = True
        return parse(Health, body, "GET /health")

    async def wait_ready(self, timeout: float = 600.0) -> Health:
        deadline = asyncio.get_running_loop().time() + timeout
        while True:
            body = await self.health()
            if body.ready:
                return body
            if asyncio.get_running_loop().time() > deadline:
                raise ArtcloudError(f"the server at {self.endpoint.url} was not ready after {timeout:.0f} s",
                                    code="not_ready")
            await asyncio.sleep(0.5)

    async def register(self, name: str, project: str, base_model: str | None, lora: dict[str, Any],
                       engine_args: dict[str, Any] | None = None, *,
                       take_over: bool = False) -> ModelInfo | PromptedInfo:
        if not self.version_checked:
            await self.health()
        # The first model on a base model loads it, and a vLLM engine starts its process: minutes for a 14B model.
        return _model(await self.call("POST", "/artcloud/models", timeout=REGISTER_TIMEOUT_S,
                                      json_body={"name": name, "project": project, "base_model": base_model,
                                                 "lora": lora, **({"engine_args": engine_args} if engine_args else {}),
                                                 **({"take_over": True} if take_over else {})}), "POST /artcloud/models")

    async def model_info(self, name: str, *, retry: bool = True) -> ModelInfo | PromptedInfo:
        return _model(await self.call("GET", f"/artcloud/models/{name}", retry=retry), f"GET /artcloud/models/{name}")

    async def status(self) -> Status:
        """The server's models, engines, lease and limits (authenticated; it never renews the lease). One try."""
        return parse(Status, await self.call("GET", "/artcloud/status", retry=False), "GET /artcloud/status")

    async def log(self, name: str, body: dict[str, Any]) -> HistoryRecord:
        """Record a split's metrics in the model's history (model.log). Not retried: a retry could record twice."""
        return parse(HistoryRecord, await self.call("POST", f"/artcloud/models/{name}/log", json_body=body, retry=False),
                     f"POST /artcloud/models/{name}/log")

    async def set_temperature(self, name: str, temperature: float) -> None:
        await self.call("PUT", f"/artcloud/models/{name}/temperature", json_body={"temperature": temperature})

    async def delete_checkpoints(self, name: str, best_metric: str) -> Pruned:
        """Delete `name`'s checkpoints on the server but the latest and the best by `best_metric`."""
        path = f"/artcloud/models/{name}/checkpoints/prune"
        return parse(Pruned, await self.call("POST", path, json_body={"best_metric": best_metric}), f"POST {path}")

    async def fork(self, name: str, body: dict[str, Any]) -> ModelInfo:
        """Start `name` from another model's checkpoint (POST .../fork); not retried: a retry after a fork that
        went through would be refused (the model is no longer at step 0)."""
        path = f"/artcloud/models/{name}/fork"
        return parse(ModelInfo, await self.call("POST", path, json_body=body, retry=False, timeout=REGISTER_TIMEOUT_S),
                     f"POST {path}")

    async def heartbeat(self) -> None:
        await self.call("POST", "/artcloud/heartbeat", retry=False)

    async def start_train(self, name: str, body: dict[str, Any]) -> JobSummary:
        """POST a training job. The body's idempotency_key makes a retried POST return the same job; a server
        busy reading other training bodies (--max-train-bodies) is asked again."""
        assert body.get("idempotency_key"), "training posts must carry an idempotency key"
        path = f"/artcloud/models/{name}/train"
        return parse(JobSummary, await self.call("POST", path, json_body=body, busy=True), f"POST {path}")

    async def start_sft(self, name: str, body: dict[str, Any]) -> JobSummary:
        """POST a supervised fine-tuning job (its idempotency key makes a retried POST return the same job)."""
        assert body.get("idempotency_key"), "SFT posts must carry an idempotency key"
        path = f"/artcloud/models/{name}/sft"
        return parse(JobSummary, await self.call("POST", path, json_body=body), f"POST {path}")

    async def send_sft_chunk(self, job_id: str, body: dict[str, Any]) -> SFTAccepted:
        """POST an SFT job's next chunk; the server answers once it has room for it (training's pace, so no timeout
        of a request's own), and a chunk sent again is not trained twice (its seq), so it is retried."""
        path = f"/artcloud/jobs/{job_id}/sft"
        return parse(SFTAccepted, await self.call("POST", path, json_body=body, timeout=SFT_CHUNK_WAIT_S), f"POST {path}")

    async def follow_job(self, job_id: str, on_event: EventCallback | None = None,
                         reconnect_for_s: float = 300.0) -> list[Event]:
        """Every event of a job, in order, until it ends. A dropped stream reconnects from its cursor.

        A stream silent for `event_read_timeout_s` (no event, no keep-alive) asks GET /health once: a
        server that does not answer within `health_probe_timeout_s` is gone (a preempted VM, a partition,
        a stopped process) and raises ServerGone at once; one that answers gets the stream reopened."""
        events: list[Event] = []
        loop = asyncio.get_running_loop()
        failing_since: float | None = None
        delay = 0.5
        generation = self.endpoint.generation
        while True:
            try:
                self._same_server(generation, f"following {job_id}")  # a new server knows nothing of the job
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
                        if event.seq != len(events) + 1:
                            continue  # never count an event twice
                        events.append(event)
                        failing_since, delay = None, 0.5
                        if on_event is not None:
                            on_event(event)
                        if event.type in ("end", "error"):
                            return events
            except (httpx.TransportError, ArtcloudError) as e:
                if isinstance(e, ArtcloudError) and not _retryable(e):
                    raise
                if self.check_alive is not None:
                    await self.check_alive()
                if isinstance(e, httpx.TimeoutException):
                    await self._probe_after_silence(job_id, e)
                now = loop.time()
                failing_since = failing_since or now
                if now - failing_since > reconnect_for_s:
                    raise ServerGone(f"lost the event stream of {job_id} for {reconnect_for_s:.0f} s: the server at "
                                     f"{self.endpoint.url} is gone ({e})", code="server_unreachable") from e
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
                f"the artcloud server at {self.endpoint.url} went silent while training job {job_id}: no event nor "
                f"keep-alive for {self.event_read_timeout_s:.0f} s, and GET /health did not answer within {probe:.0f} s "
                f"({type(e).__name__}). It was stopped, preempted or cut off; the model's last committed checkpoint "
                "is what a new server resumes from", code="server_unreachable") from cause
        log.info("event stream of %s silent for %.0f s (%s) but /health answers %d: reconnecting",
                 job_id, self.event_read_timeout_s, type(cause).__name__, response.status_code)

    async def shutdown(self, wait_for_training_s: float = 0.0, timeout: float | None = None) -> ShutdownAnswer:
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
        async def post() -> ShutdownAnswer:
            # Its own timeout: the server may wait for training and pushes far longer than self.timeout.
            response = await self._client().post("/artcloud/shutdown", json={"wait_for_training_s": wait_for_training_s},
                                                  timeout=httpx.Timeout(timeout, connect=30.0))
            _raise_for(response)
            return parse(ShutdownAnswer, _answer(response), "POST /artcloud/shutdown")

        try:
            answer = await asyncio.wait_for(post(), timeout)
            self.shut_down = True
            return answer
        except (httpx.TransportError, asyncio.TimeoutError) as e:
            if isinstance(e, (httpx.TimeoutException, asyncio.TimeoutError)):
                self.shut_down = True  # a server silent for the whole wait: final_push asks it no second time
            raise ServerGone(f"the artcloud server at {self.endpoint.url} did not answer the shutdown request "
                             f"({type(e).__name__}: {e})", code="server_unreachable") from e

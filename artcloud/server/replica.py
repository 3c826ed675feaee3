"""An inference replica on another node of the cluster (the head's side of it: engines/replicas.py RemoteSampler).

`artcloud replica` serves one sampler of the head's base model over HTTPS, with the launch's certificate and
token (every route but /health). The head's ReplicaSet (engines/replicas.py) uses it as one more sampler:

    GET    /health                    {"ok": true} and nothing else
    POST   /replica/models            {"base_model", "engine_args"}: load it (once; another one is a 409)
    GET    /replica/status            {"epoch", "base_model", "max_context", "sampler", "adapters", "served"}
    POST   /replica/generate          {"slot", "requests": [{"prompt_ids", "n", "params", "stream"}]} -> NDJSON:
                                      {"tokens": [request, sample, ids, logprobs, top]} as streamed requests
                                      sample, then {"done": [[completion, ...], ...]} or {"error": {...}}
    PUT    /replica/adapters/{slot}   a tar of exactly adapter_config.json + adapter_model.safetensors, with
                                      the LoraConfig as JSON in X-Artcloud-Lora
    DELETE /replica/adapters/{slot}

Its port is for the cluster's own network: the head reaches it at the node's private IP, and nothing outside
the cluster needs it (the task opens only the head's server port to the world).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import secrets
import shutil
import tarfile
import tempfile
import threading
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from artcloud.errors import InvalidArgument
from artcloud.server.api_errors import ApiError
from artcloud.server.engines.base import (
    GenerationRequest,
    RequestRefused,
    Sampler,
    SamplingParams,
    TokenSink,
)
from artcloud.server.engines.choose import check_engine_args
from artcloud.server.engines.engine import EngineArgsError
from artcloud.server.engines.replicas import ADAPTER_FILES, LORA_HEADER, Replica, ca_context
from artcloud.server.limits import Limits
from artcloud.server.middleware import BodyLimit
from artcloud.types import LoraConfig

log = logging.getLogger("artcloud.replica")

SLOT = re.compile(r"[A-Za-z0-9_.-]{1,64}")
MAX_ADAPTER_BYTES = 8 << 30
MAX_PROMPT_TOKENS = 1 << 20
# The head's own limits (artcloud serve's defaults: server/limits.py), here too (security review 3, N7): a request
# body (an adapter's upload aside, streamed to disk under MAX_ADAPTER_BYTES), and n x max_tokens of one request.
LIMITS = Limits()
# The head is gone (watch_head) once nothing listens on its port for 3 polls in a row, 10 s apart; or, where its
# machine went without a word, once it has not answered for 10 min; or if it never answered in 30 min.
HEAD_POLL_S, HEAD_MISSES = 10.0, 3
HEAD_UNREACHABLE_S, HEAD_NEVER_SEEN_S = 600.0, 1800.0
TICK_S = 1.0  # an empty line this often while a generation runs, so that the head can stop it (RemoteSampler)


# ----------------------------------------------------------------------------------------- the replica


class _LineSink(TokenSink):
    """A streamed request's tokens, from the sampler's thread to the response's queue."""

    def __init__(self, index: int, put: Callable[[Any], None]):
        self.index = index
        self.put = put
        self.cancelled = False

    def tokens(self, sample, token_ids, logprobs, top_logprobs) -> None:
        self.put({"tokens": [self.index, sample, token_ids, logprobs, top_logprobs]})


def _requests(body: Any) -> tuple[str | None, list[GenerationRequest], list[bool]]:
    """The generate body, checked (a 400 naming the field otherwise)."""
    def bad(field: str, what: str) -> ApiError:
        return ApiError(400, "invalid_request", f"{field}: {what}", field)

    if not isinstance(body, dict) or not isinstance(body.get("requests"), list) or not body["requests"]:
        raise bad("requests", "a non-empty list of requests")
    slot = body.get("slot")
    if slot is not None and (not isinstance(slot, str) or not SLOT.fullmatch(slot)):
        raise bad("slot", "null or an adapter slot name")
    fields = set(SamplingParams.__dataclass_fields__)
    out, stream = [], []
    for i, r in enumerate(body["requests"]):
        where = f"requests[{i}]"
        if not isinstance(r, dict):
            raise bad(where, "an object")
        ids = r.get("prompt_ids")
        if (not isinstance(ids, list) or not ids or len(ids) > MAX_PROMPT_TOKENS
                or not all(type(t) is int and t >= 0 for t in ids)):
            raise bad(f"{where}.prompt_ids", "a non-empty list of token ids")
        n = r.get("n")
        if type(n) is not int or not 1 <= n <= 1024:
            raise bad(f"{where}.n", "a whole number from 1 to 1024")
        params = r.get("params") or {}
        if not isinstance(params, dict) or set(params) - fields:
            raise bad(f"{where}.params", f"an object with some of {', '.join(sorted(fields))}")
        p = SamplingParams(**params)
        if not (isinstance(p.temperature, (int, float)) and isinstance(p.top_p, (int, float))
                and type(p.max_tokens) is int and p.max_tokens >= 1 and type(p.top_logprobs) is int
                and isinstance(p.stop, list) and all(isinstance(s, str) for s in p.stop)
                and (p.seed is None or type(p.seed) is int)):
            raise bad(f"{where}.params", "numbers and stop strings as a chat completion takes them")
        if n * p.max_tokens > LIMITS.max_request_tokens:
            raise bad(f"{where}.params.max_tokens", f"n x max_tokens at most {LIMITS.max_request_tokens}")
        out.append(GenerationRequest(prompt_ids=ids, n=n, params=p))
        stream.append(bool(r.get("stream")))
    return slot, out, stream


def create_replica_app(load: Callable[[str, dict[str, Any]], Sampler], token: str, folder: Path,
                       contacted: threading.Event | None = None):
    """The replica's app; `load(base_model, engine_args)` makes its sampler on the first POST /replica/models.
    `contacted` is set once the head has asked for this replica's status (its check, every few seconds)."""
    from artcloud.server.lease import Lease
    from artcloud.server.middleware import TokenAuth

    app = FastAPI(title="artcloud replica", docs_url=None, redoc_url=None, openapi_url=None)
    state: dict[str, Any] = {"sampler": None, "base_model": None, "adapters": {}, "epoch": secrets.token_hex(8),
                             "served": 0}
    loading = asyncio.Lock()

    def held() -> Replica:
        """The sampler, as the head's set holds one (its calls one at a time where it does not batch by itself)."""
        if state["sampler"] is None:
            raise ApiError(409, "no_model", "this replica has no model yet: POST /replica/models first")
        return state["sampler"]

    @app.exception_handler(ApiError)
    async def api_error(request: Request, e: ApiError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status)

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"ok": True}

    @app.post("/replica/models")
    async def models(request: Request) -> dict[str, Any]:
        body = await _json(request)
        base = body.get("base_model") if isinstance(body, dict) else None
        args = body.get("engine_args") or {} if isinstance(body, dict) else None
        if not isinstance(base, str) or not base or not isinstance(args, dict):
            raise ApiError(400, "invalid_request", "base_model: the head's base model name (engine_args: an object)",
                           "base_model")
        try:  # a model's engine_args as the head takes them from a client: nothing that names a path, a port or code
            check_engine_args(args, from_client=True)
        except EngineArgsError as e:
            raise ApiError(400, e.code, str(e), e.field or "engine_args") from None
        async with loading:
            if state["base_model"] not in (None, base):
                raise ApiError(409, "other_model", f"this replica serves {state['base_model']}, not {base}: start "
                               "one replica per base model", "base_model")
            if state["sampler"] is None:
                state["sampler"] = Replica.of("this", await asyncio.to_thread(load, base, args))
                state["base_model"] = base
        return status()

    @app.get("/replica/status")
    def status() -> dict[str, Any]:
        if contacted is not None:
            contacted.set()
        s = state["sampler"] and state["sampler"].sampler
        return {"epoch": state["epoch"], "base_model": state["base_model"],
                "max_context": s.max_context if s is not None else None,
                "sampler": s.status() if s is not None else None, "adapters": sorted(state["adapters"]),
                "served": state["served"]}

    @app.post("/replica/generate")
    async def generate(request: Request) -> StreamingResponse:
        slot, requests, stream = _requests(await _json(request))
        s = held()
        if slot is not None and slot not in state["adapters"]:
            raise ApiError(404, "unknown_adapter", f"this replica does not serve {slot}", "slot")
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[Any] = asyncio.Queue()

        def put(item: Any) -> None:
            loop.call_soon_threadsafe(queue.put_nowait, item)

        for i, (r, streamed) in enumerate(zip(requests, stream)):
            if streamed:
                r.sink = _LineSink(i, put)

        def work() -> None:
            try:
                out = s.call(s.sampler.generate, slot, requests)
                state["served"] += len(requests)
                put({"done": [[asdict(c) for c in cs] for cs in out]})
            except Exception as e:  # noqa: BLE001 - said to the head (a refusal fails the requests, else the replica goes)
                refused = isinstance(e, RequestRefused)
                (log.warning if refused else log.exception)("generation failed: %s", e)
                put({"error": {"code": getattr(e, "code", "engine_failed"), "message": str(e)[:500],
                               "refused": refused}})
            put(None)

        async def lines():
            task = loop.run_in_executor(None, work)
            try:
                while True:
                    try:
                        item = await asyncio.wait_for(queue.get(), TICK_S)
                    except asyncio.TimeoutError:
                        yield b"\n"  # an empty line: the head checks whether anyone still waits for these samples
                        continue
                    if item is None:
                        break
                    yield (json.dumps(item) + "\n").encode()
                await task
            finally:  # the head went away: stop the samples at their next step
                for r in requests:
                    r.abandoned = True
                    if r.sink is not None:
                        r.sink.cancelled = True

        return StreamingResponse(lines(), media_type="application/x-ndjson")

    @app.put("/replica/adapters/{slot}")
    async def put_adapter(slot: str, request: Request) -> dict[str, Any]:
        if not SLOT.fullmatch(slot):
            raise ApiError(400, "invalid_request", "slot: letters, digits and _.- (at most 64)", "slot")
        try:
            lora = LoraConfig.model_validate_json(request.headers.get(LORA_HEADER, ""))
        except ValueError as e:
            raise ApiError(400, "invalid_request", f"{LORA_HEADER}: the adapter's LoraConfig as JSON ({e})".splitlines()[0],
                           LORA_HEADER) from None
        s = held()
        target = Path(tempfile.mkdtemp(prefix=f"{slot}-", dir=folder))
        try:
            with tempfile.TemporaryFile(dir=folder) as raw:
                size = 0
                async for chunk in request.stream():
                    size += len(chunk)
                    if size > MAX_ADAPTER_BYTES:
                        raise ApiError(413, "body_too_large", f"an adapter is at most {MAX_ADAPTER_BYTES} bytes", "body")
                    raw.write(chunk)
                raw.seek(0)
                await asyncio.to_thread(_untar_adapter, raw, target, size)
            await asyncio.to_thread(s.call, s.sampler.serve_adapter, slot, lora, target)
        except BaseException:
            shutil.rmtree(target, ignore_errors=True)
            raise
        old = state["adapters"].get(slot)
        state["adapters"][slot] = target
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        return {"slot": slot}

    @app.delete("/replica/adapters/{slot}")
    async def delete_adapter(slot: str) -> dict[str, Any]:
        old = state["adapters"].pop(slot, None)
        if old is not None:
            s = held()
            await asyncio.to_thread(s.call, s.sampler.drop_adapter, slot)
            shutil.rmtree(old, ignore_errors=True)
        return {"slot": slot, "dropped": old is not None}

    app.add_middleware(_BodyLimitButAdapters, max_bytes=LIMITS.max_body_bytes)
    app.add_middleware(TokenAuth, token=token, lease=Lease(None, None))
    return app


class _BodyLimitButAdapters(BodyLimit):
    """The head's body limit on every route but an adapter's upload (PUT /replica/adapters/SLOT: streamed to disk,
    under MAX_ADAPTER_BYTES)."""

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope.get("path", "").startswith("/replica/adapters/"):
            return await self.app(scope, receive, send)
        return await super().__call__(scope, receive, send)


async def _json(request: Request) -> Any:
    """The request's JSON body; anything else is a 400, not a 500."""
    try:
        return await request.json()
    except ValueError:
        raise ApiError(400, "invalid_json", "the body is not JSON", "body") from None


def _untar_adapter(raw: Any, target: Path, received: int) -> None:
    """Exactly the two adapter files, as plain regular files (not GNU sparse ones, whose holes a few bytes can declare
    as terabytes: security review 3, N4), written under `target` by their fixed names only, together no more bytes
    than the body that carried them (`received`)."""
    def bad(what: str) -> ApiError:
        return ApiError(400, "invalid_adapter", f"the body must be a tar of exactly {' and '.join(ADAPTER_FILES)}: {what}",
                        "body")

    try:
        with tarfile.open(fileobj=raw, mode="r:") as tar:
            members = tar.getmembers()
            names = sorted(m.name for m in members)
            plain = all(m.type in (tarfile.REGTYPE, tarfile.AREGTYPE) for m in members)
            if names != sorted(ADAPTER_FILES) or not plain:
                raise bad(f"it holds {[(m.name, m.type.decode(errors='replace')) for m in members][:4]}")
            if sum(m.size for m in members) > received:
                raise bad(f"its files declare {sum(m.size for m in members)} bytes, more than the {received} received")
            for m in members:
                source = tar.extractfile(m)
                assert source is not None  # a regular file
                with open(target / ADAPTER_FILES[ADAPTER_FILES.index(m.name)], "wb") as out:
                    shutil.copyfileobj(source, out)
    except tarfile.TarError as e:
        raise bad(str(e)) from None
    try:  # files that are not an adapter: a 400 here, not the sampler's error (a 500) when it loads them
        from safetensors import safe_open

        if not isinstance(json.loads((target / "adapter_config.json").read_text()), dict):
            raise InvalidArgument("adapter_config.json is not a JSON object")
        with safe_open(str(target / "adapter_model.safetensors"), "pt") as weights:
            weights.keys()
    except Exception as e:  # noqa: BLE001 - json's, safetensors' (SafetensorError) and decoding errors alike
        raise bad(f"they are not a PEFT adapter ({type(e).__name__}: {str(e)[:200]})") from None


class HeadWatch(threading.Thread):
    """Polls the head's GET /health and calls `stop` once the head is gone; counts what each poll met (`answered`,
    `refused`: nothing listens, `unanswered`: anything else)."""

    def __init__(self, url: str, ca: str | None, stop: Callable[[], None], *, every_s: float, misses: int,
                 unreachable_s: float, never_seen_s: float, timeout_s: float,
                 contacted: threading.Event | None = None):
        super().__init__(daemon=True, name="watch-head")
        self.url, self.ca, self.stop = url.rstrip("/"), ca, stop
        self.contacted = contacted or threading.Event()  # the head reached this node: it has been seen too
        self.every_s, self.misses, self.timeout_s = every_s, misses, timeout_s
        self.unreachable_s, self.never_seen_s = unreachable_s, never_seen_s
        self.answered = self.refused = self.unanswered = 0

    def run(self) -> None:
        import httpx

        started = last_answer = time.monotonic()
        refused_in_a_row, heard = 0, False
        with httpx.Client(verify=ca_context(self.ca) if self.ca else True, timeout=self.timeout_s) as http:
            while True:
                try:
                    http.get(f"{self.url}/health")  # any answer, even a 5xx of a busy head, is a head
                    self.answered += 1
                    refused_in_a_row, last_answer = 0, time.monotonic()
                except httpx.HTTPError as e:
                    refused = _refused(e)
                    self.refused += refused
                    self.unanswered += not refused
                    refused_in_a_row = refused_in_a_row + 1 if refused else 0
                    if self.contacted.is_set():  # the head reached this node since the last poll: an answer too
                        self.contacted.clear()
                        heard, last_answer = True, time.monotonic()
                    why, seen = None, self.answered or heard
                    if not seen and time.monotonic() - started >= self.never_seen_s:
                        why = f"it has not answered in {self.never_seen_s:.0f} s"
                    elif seen and refused_in_a_row >= self.misses:
                        why = f"nothing listens on its port ({refused_in_a_row} polls in a row)"
                    elif seen and time.monotonic() - last_answer >= self.unreachable_s:
                        why = f"it has not answered for {self.unreachable_s:.0f} s"
                    if why:
                        log.warning("the head's server at %s is gone (%s): this node stops", self.url, why)
                        self.stop()
                        return
                time.sleep(self.every_s)


def _refused(e: BaseException) -> bool:
    """Whether the connection was refused: the head's machine is up and nothing listens on the port."""
    seen: BaseException | None = e
    while seen is not None:
        if isinstance(seen, ConnectionRefusedError):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def watch_head(url: str, ca: str | None, stop: Callable[[], None], *, every_s: float = HEAD_POLL_S,
               misses: int = HEAD_MISSES, unreachable_s: float = HEAD_UNREACHABLE_S,
               never_seen_s: float = HEAD_NEVER_SEEN_S, timeout_s: float = 10.0,
               contacted: threading.Event | None = None) -> HeadWatch:
    """Call `stop` once the head's server is gone: it ended (its lease, max_duration, a `down`) and nothing listens
    on its port for `misses` polls in a row; or its machine went (no answer of any kind for `unreachable_s`); or it
    never answered in `never_seen_s`. A head that answers slowly or with an error is busy, not gone (security review
    3, N8: a head blocked for 30 s stopped its replicas and trainer nodes for good)."""
    watch = HeadWatch(url, ca, stop, every_s=every_s, misses=misses, unreachable_s=unreachable_s,
                      never_seen_s=never_seen_s, timeout_s=timeout_s, contacted=contacted)
    watch.start()
    return watch


def serve(*, host: str, port: int, path: Path, tls_cert: str | None, tls_key: str | None, token: str | None,
          token_file: str | None, engine: str = "cpu", vllm_python: str | None = None, log_level: str = "info",
          head: str | None = None, ca: str | None = None, engine_args: dict[str, Any] | None = None,
          announce=print) -> None:
    """`artcloud replica`: serve until a signal, or until the head (`head`: its URL) is gone. The sampler is made
    on the head's first POST /replica/models, with `engine_args` (the operator's) under the model's."""
    import uvicorn

    from artcloud.server.main import ENV_CERT, ServeError, bind, check_path, tls_setup
    from artcloud.server.tls_only import Connections, server_context, wrap_uvicorn_protocol

    path = check_path(path)
    if not (tls_cert or os.environ.get(ENV_CERT)):
        raise ServeError("a replica serves with the launch's certificate, which the head trusts: pass --tls-cert, "
                         "--tls-key and --token-file (or set ARTCLOUD_TLS_CERT, ARTCLOUD_TLS_KEY, ARTCLOUD_TOKEN)")
    tls = tls_setup(path, host, tls_cert, tls_key, token, token_file)
    folder = path / "replica-adapters"
    shutil.rmtree(folder, ignore_errors=True)  # what a replica served before a restart is served again by the head
    folder.mkdir(parents=True)

    operator = dict(engine_args or {})
    check_engine_args(operator, from_client=False)

    def load(base_model: str, model_args: dict[str, Any]) -> Sampler:
        """The operator's engine_args (this node's --engine-args, as the head's: code review 3, F4), then the
        model's."""
        return make_sampler(engine, base_model, {**operator, **model_args}, workdir=path / "replica-engine",
                            python=vllm_python)

    sock = bind(host, port)
    announce(f"artcloud replica serving on https://{host}:{sock.getsockname()[1]} (HTTPS only, the launch's token)")
    contacted = threading.Event()
    app = create_replica_app(load, tls.token, folder, contacted)
    config = uvicorn.Config(app, loop="asyncio", log_level=log_level, timeout_keep_alive=30)
    config.load()
    wrap_uvicorn_protocol(config, server_context(str(tls.cert), str(tls.key)), hint="", connections=Connections(by_peer=True))
    server = uvicorn.Server(config)
    if head:
        watch_head(head, ca, lambda: setattr(server, "should_exit", True), contacted=contacted)
    server.run(sockets=[sock])


def make_sampler(engine: str, base_model: str, engine_args: dict[str, Any], *, workdir: Path,
                 python: str | None = None) -> Sampler:
    """A sampler only: the torch sampler on its own model (engine cpu), or vLLM in its own process (vllm; the
    server's engine names vllm+peft, vllm+unsloth say the same here: nothing trains). auto: vllm with CUDA."""
    if engine == "auto":
        import torch

        engine = "vllm" if torch.cuda.is_available() else "cpu"
    if engine.startswith("vllm"):
        engine = "vllm"
    if engine == "cpu":
        from artcloud.server.engines.choose import cpu_engine_args
        from artcloud.server.engines.peft_trainer import PeftTrainer
        from artcloud.server.engines.torch_sampler import TorchSampler

        kw = cpu_engine_args(engine_args)
        model = PeftTrainer(base_model, **{k: v for k, v in kw.items() if k == "dtype"})
        if "max_model_len" in kw:
            model.max_context = min(model.max_context, kw["max_model_len"])
        sampler = TorchSampler(model, seed=kw.get("seed"))
        sampler.shares_trainer_weights = False
        return sampler
    if engine == "vllm":
        from artcloud.server.engines.choose import vllm_sampler_only

        return vllm_sampler_only(base_model, engine_args, workdir=workdir, python=python)
    raise InvalidArgument(f"unknown replica engine {engine!r}: cpu, vllm or auto", field="engine")

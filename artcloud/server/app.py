"""The HTTP routes of `artcloud serve` (FastAPI). Every route but `GET /health` needs the bearer token.

    GET  /health                                   version, readiness, models, lease (no token)
    GET  /v1/models, /v1/models/{id}               OpenAI-compatible listing
    POST /v1/chat/completions                      OpenAI-compatible; + prompt_token_ids, choices[].token_ids
    POST /artcloud/models                          register (idempotent; resumes from the latest checkpoint)
    GET  /artcloud/models/{name}                   step, temperature, checkpoints, history
    PUT  /artcloud/models/{name}/temperature       default sampling temperature (a request's own wins)
    POST /artcloud/models/{name}/train             start a training job -> 202 {job_id}
    GET  /artcloud/jobs/{job_id}                   job status
    GET  /artcloud/jobs/{job_id}/events?after=N    NDJSON events after cursor N (&follow=true to wait)
    POST /artcloud/shutdown                        refuse new training, wait for jobs (optional), push
                                                   the final checkpoints to S3, answer, then exit
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Header, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException

from artcloud._version import __version__
from artcloud.protocol import ChatCompletionRequest, RegisterRequest, TemperatureRequest, TrainRequest
from artcloud.server import chat
from artcloud.server.engines.base import GenerationRequest, SamplingParams
from artcloud.server.errors import ApiError, field_path
from artcloud.server.jobs import Job, request_hash
from artcloud.server.samples import build_samples
from artcloud.server.state import Registry

log = logging.getLogger("artcloud.server")

DEFAULT_MAX_TOKENS = 256
PUBLIC_PATHS = {"/health"}
EXIT_DELAY_S = 0.2  # after the shutdown answer is sent, before uvicorn is asked to stop


class ShutdownRequest(BaseModel):
    # Here rather than in artcloud.protocol: only the server and RemoteBackend.shutdown use it.
    model_config = ConfigDict(extra="forbid")

    wait_for_training_s: float = Field(0.0, ge=0.0, allow_inf_nan=False)


class TokenAuth:
    """ASGI middleware: `Authorization: Bearer TOKEN` on every path but /health, compared in constant time.
    It sits in front of routing, so even a 404 is only answered to someone holding the token.
    Each authenticated request holds the server's lease while it runs and renews it when it ends. A dead
    client's event stream ends at the next keep-alive write, so it holds nothing for long."""

    def __init__(self, app: Any, token: str, registry: Registry):
        self.app = app
        self.expected = f"Bearer {token}".encode()
        self.registry = registry

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"] in PUBLIC_PATHS:
            return await self.app(scope, receive, send)
        given = b""
        for name, value in scope.get("headers", []):
            if name == b"authorization":
                given = value
                break
        if not hmac.compare_digest(given, self.expected):
            code, message = (
                ("missing_token", "this server needs 'Authorization: Bearer TOKEN' (the launch's token)")
                if not given
                else ("invalid_token", "the bearer token is wrong: use the token of this launch")
            )
            response = JSONResponse(
                ApiError(401, code, message).body(), status_code=401, headers={"WWW-Authenticate": "Bearer"}
            )
            return await response(scope, receive, send)
        self.registry.last_request_at = time.time()
        self.registry.in_flight += 1  # the lease does not run out under a request (registering a big model)
        try:
            return await self.app(scope, receive, send)
        finally:
            self.registry.in_flight -= 1
            self.registry.last_request_at = time.time()


def create_app(registry: Registry, token: str) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        restore = asyncio.create_task(registry.restore())
        yield
        restore.cancel()
        await registry.close()

    app = FastAPI(
        title="artcloud",
        version=__version__,
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
        openapi_url=None,  # served below, behind the token
    )
    app.add_middleware(TokenAuth, token=token, registry=registry)
    _error_handlers(app)

    @app.get("/health")
    async def health() -> dict[str, Any]:
        # Unauthenticated, so it never renews the lease: a dashboard polling it keeps no GPU alive.
        return {"status": "ok", "version": __version__, "ready": registry.ready, **registry.health(), "lease": registry.lease()}

    @app.get("/openapi.json", include_in_schema=False)
    async def openapi() -> dict[str, Any]:
        return app.openapi()

    # ------------------------------------------------------------------------------------- OpenAI

    @app.get("/v1/models")
    async def list_models() -> dict[str, Any]:
        data = []
        for m in registry.models.values():
            data.append({"id": m.name, "object": "model", "owned_by": m.spec.project, "root": m.spec.base_model, "step": m.step})
        for base in registry.hosts:
            data.append({"id": base, "object": "model", "owned_by": "artcloud", "root": base})
        return {"object": "list", "data": data}

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str) -> dict[str, Any]:
        target = registry.resolve(model_id)
        if target.model is None:
            return {"id": model_id, "object": "model", "owned_by": "artcloud", "root": model_id}
        m = target.model
        return {"id": model_id, "object": "model", "owned_by": m.spec.project, "root": m.spec.base_model, "step": m.step}

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest) -> dict[str, Any]:
        if req.stream:
            raise ApiError(400, "unsupported", "streaming responses are not supported: set stream=false", "stream")
        if req.top_logprobs and not req.logprobs:
            raise ApiError(400, "invalid_request", "top_logprobs needs logprobs=true", "top_logprobs")
        target = registry.resolve(req.model)
        engine = target.host.engine
        messages = [m.model_dump(exclude_none=True) for m in req.messages]
        try:
            prompt = await asyncio.to_thread(chat.render_prompt, engine.tokenizer, messages, req.tools)
        except Exception as e:
            raise ApiError(400, "invalid_messages", f"the chat template cannot render these messages: {e}", "messages") from e
        limit = engine.max_context
        max_tokens = req.max_completion_tokens or req.max_tokens or DEFAULT_MAX_TOKENS
        if len(prompt) >= limit:
            raise ApiError(400, "context_too_long", f"the prompt has {len(prompt)} tokens; this model takes at most {limit}", "messages")
        max_tokens = min(max_tokens, limit - len(prompt))
        temperature = req.temperature
        if temperature is None:
            temperature = target.model.temperature if target.model is not None else 1.0
        params = SamplingParams(
            temperature=temperature,
            top_p=req.top_p if req.top_p is not None else 1.0,
            max_tokens=max_tokens,
            stop=req.stop,
            seed=req.seed,
            top_logprobs=(req.top_logprobs or 0) if req.logprobs else 0,
        )
        completions, served = await target.host.batcher.submit(target.key, GenerationRequest(prompt, req.n, params))
        return chat.completion_response(
            served_as=served,
            prompt_ids=prompt,
            completions=completions,
            tokenizer=engine.tokenizer,
            want_logprobs=req.logprobs,
            want_token_ids=req.return_token_ids,
            parse_tools=bool(req.tools),
        )

    @app.post("/artcloud/heartbeat")
    async def heartbeat() -> dict[str, Any]:
        """A client's sign of life (any authenticated request counts too): the server's lease."""
        return {"ok": True, "version": __version__, "last_request_at": registry.last_request_at}

    # ------------------------------------------------------------------------------------- models

    @app.post("/artcloud/models")
    async def register(spec: RegisterRequest) -> dict[str, Any]:
        return await registry.register(spec)

    @app.get("/artcloud/models/{name}")
    async def model_info(name: str) -> dict[str, Any]:
        return registry.get(name).info()

    @app.put("/artcloud/models/{name}/temperature")
    async def set_temperature(name: str, body: TemperatureRequest) -> dict[str, Any]:
        model = registry.get(name)
        model.temperature = body.temperature
        return {"name": name, "temperature": model.temperature}

    # ------------------------------------------------------------------------------------- training

    @app.post("/artcloud/models/{name}/train", status_code=202)
    async def train(
        name: str, req: TrainRequest, idempotency_key: str | None = Header(None, alias="Idempotency-Key")
    ) -> JSONResponse:
        model = registry.get(name)
        key = req.idempotency_key or idempotency_key
        body_hash = request_hash(req.model_dump(mode="json", exclude={"idempotency_key"}))
        if key:
            existing = model.jobs.find_by_key(key)
            if existing is not None and existing.status != "failed":
                return _job_response(_check_same(existing, body_hash), 200)
        _check_not_stopping(registry)  # a retried POST above still gets its job; nothing new starts
        engine = model.engine
        samples, stats = await asyncio.to_thread(build_samples, engine.tokenizer, engine.vocab_size, req)
        async with model.submit_lock:  # a concurrent retry with the same key must not start a second job
            if key:
                existing = model.jobs.find_by_key(key)
                if existing is not None and existing.status != "failed":
                    return _job_response(_check_same(existing, body_hash), 200)
            _check_not_stopping(registry)  # shutdown may have begun while the samples were built
            job = model.jobs.create(idempotency_key=key, body_hash=body_hash)
            model.submit(job, samples, stats, req.config)
        return _job_response(job, 202)

    @app.get("/artcloud/jobs/{job_id}")
    async def job_status(job_id: str) -> dict[str, Any]:
        return _find_job(registry, job_id).summary()

    @app.get("/artcloud/jobs/{job_id}/events")
    async def job_events(
        job_id: str, after: int = Query(0, ge=0), follow: bool = Query(True)
    ) -> StreamingResponse:
        job = _find_job(registry, job_id)
        if after > len(job.events) and job.done:
            raise ApiError(400, "invalid_cursor", f"job {job_id} has {len(job.events)} events; after={after} is past its end", "after")

        async def lines():
            async for event in job.follow(after, follow=follow):
                yield "\n" if event is None else event.model_dump_json() + "\n"

        return StreamingResponse(lines(), media_type="application/x-ndjson")

    # ------------------------------------------------------------------------------------- shutdown

    @app.post("/artcloud/shutdown")
    async def shutdown(body: ShutdownRequest | None = None) -> JSONResponse:
        """From now on training POSTs get 409 shutting_down. Waits up to wait_for_training_s for queued and
        running jobs, pushes every model's newest committed checkpoint to S3, answers, and only then asks
        the process to exit (the lifespan exit releases the S3 claims). Calling it again is harmless."""
        wait = body.wait_for_training_s if body is not None else 0.0
        log.warning("shutdown requested (waiting up to %.0f s for training): pushing checkpoints, then exiting", wait)
        models = await registry.shutdown(wait)
        exit_after = BackgroundTask(_exit_soon, registry) if registry.request_exit is not None else None
        return JSONResponse({"ok": True, "models": models}, background=exit_after)

    return app


async def _exit_soon(registry: Registry) -> None:
    # Runs once the answer is sent; the short delay lets it leave the socket before uvicorn stops.
    if registry.request_exit is not None:
        asyncio.get_running_loop().call_later(EXIT_DELAY_S, registry.request_exit)


def _check_not_stopping(registry: Registry) -> None:
    if registry.stopping:
        raise ApiError(409, "shutting_down", "the server is shutting down (POST /artcloud/shutdown): it takes no new "
                       "training jobs; start a new server to train more")


def _check_same(job: Job, body_hash: str) -> Job:
    if job.meta.get("request_sha256") != body_hash:
        raise ApiError(
            409, "idempotency_conflict",
            f"idempotency key already used for job {job.id} with a different request; use a new key for new data",
            "idempotency_key",
        )
    return job


def _job_response(job: Job, status: int) -> JSONResponse:
    body = {**job.summary(), "events_url": f"/artcloud/jobs/{job.id}/events"}
    return JSONResponse(body, status_code=status)


def _find_job(registry: Registry, job_id: str) -> Job:
    for model in registry.models.values():
        job = model.jobs.jobs.get(job_id)
        if job is not None:
            return job
    raise ApiError(404, "job_not_found", f"no job {job_id!r} on this server", "job_id")


def _error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid request", "type": ""}
        if first.get("type") == "json_invalid":
            err = ApiError(400, "invalid_json", f"the request body is not valid JSON: {first.get('ctx', {}).get('error', first['msg'])}")
        else:
            field = field_path(first.get("loc", ()))
            msg = first["msg"].removeprefix("Value error, ")
            err = ApiError(400, "invalid_request", f"{field or 'request'}: {msg}", field or None)
        return JSONResponse(err.body(), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        codes = {404: "not_found", 405: "method_not_allowed"}
        err = ApiError(exc.status_code, codes.get(exc.status_code, "http_error"), str(exc.detail))
        return JSONResponse(err.body(), status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def crash(request: Request, exc: Exception) -> JSONResponse:
        log.exception("internal error on %s %s", request.method, request.url.path)
        err = ApiError(500, "internal_error", f"internal server error ({type(exc).__name__}); this is a bug in artcloud")
        return JSONResponse(err.body(), status_code=500)

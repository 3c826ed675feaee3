"""The HTTP routes of `artcloud serve` (FastAPI). Every route but `GET /health` needs the bearer token.

    GET  /health                                   status, version, readiness, start-up phase (no token; nothing private)
    GET  /artcloud/status                          models, engines, lease, limits (never renews the lease)
    GET  /openapi.json                             this API's schema, with its limits and links
    GET  /v1/models, /v1/models/{id}               OpenAI-compatible listing
    POST /v1/chat/completions                      OpenAI-compatible; + prompt_token_ids, choices[].token_ids;
                                                   stream=true: Server-Sent Events (server/chat_stream.py)
    POST /artcloud/heartbeat                       a client's sign of life (the lease)
    POST /artcloud/models                          register (idempotent; resumes from the latest checkpoint);
                                                   base_model null: a prompted model, for its history only
    GET  /artcloud/models/{name}                   step, temperature, checkpoints, history
    PUT  /artcloud/models/{name}/temperature       default sampling temperature (a request's own wins)
    POST /artcloud/models/{name}/checkpoints/prune delete all checkpoints but the latest and the best by a metric
    POST /artcloud/models/{name}/train             start a training job -> 202 {job_id}
    POST /artcloud/models/{name}/sft               start a supervised fine-tuning job (ART's train_sft) -> 202
    POST /artcloud/jobs/{job_id}/sft               its next chunk of batches (server/sft.py)
    POST /artcloud/models/{name}/log               model.log: a split's metrics at a step join the history
    POST /artcloud/models/{name}/fork              start from another model's checkpoint (ART's fork_checkpoint)
    GET  /artcloud/models/{name}/state             ART's read_state: the model's state.json, and its step
    PUT  /artcloud/models/{name}/state             ART's overwrite_state / merge_state (kept with the checkpoints)
    GET  /artcloud/jobs/{job_id}                   job status
    GET  /artcloud/jobs/{job_id}/events?after=N    NDJSON events after cursor N (&follow=true to wait)
    POST /artcloud/shutdown                        refuse new training, wait for jobs (optional), push
                                                   the final checkpoints to S3, answer, then exit
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from contextlib import asynccontextmanager
from functools import partial
from typing import Any, TypeVar

from fastapi import FastAPI, Header, Path, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException

from artcloud import wire
from artcloud._version import __version__
from artcloud.server import chat, chat_stream, train_body
from artcloud.server.api_errors import ApiError, errors, field_path
from artcloud.server.engines.base import GenerationRequest, SamplingParams
from artcloud.server.jobs import Job
from artcloud.server.middleware import BodyLimit, TokenAuth
from artcloud.server.models import ServedModel
from artcloud.server.registry import Registry
from artcloud.server.samples import build_samples
from artcloud.server.sft import Feed, chunk_hash, prepare
from artcloud.server.tls_only import quiet_accept_errors

log = logging.getLogger("artcloud.server")

DEFAULT_MAX_TOKENS = 256
SFT_CHUNK_MAX_BYTES = 8 << 20  # parsed on a thread, holding the GIL: a bound on how long that stalls the loop
JOB_ID_PATTERN = r"^job-[0-9a-f]{20}$"

# Path parameters, with the same rules as the bodies that create them (so the schema says what exists).
ModelName = Path(pattern=wire.NAME_PATTERN, max_length=128, description="the model's name, as registered")
JobId = Path(pattern=JOB_ID_PATTERN, description="a job id, as POST /artcloud/models/{name}/train answered")

# OpenAPI links: what a register or a training POST answers feeds the routes that take its name or job.
# (Not prune: a fuzzer following the links would mostly delete checkpoints and reach the jobs more rarely.)
_MODEL_LINKS = {
    op: {"operationId": op, "parameters": {"name": "$response.body#/name"}}
    for op in ("get_model_info", "set_temperature", "train", "log_metrics", "get_state", "put_state")
}
_JOB_LINKS = {
    op: {"operationId": op, "parameters": {"job_id": "$response.body#/job_id"}}
    for op in ("get_job", "get_job_events")
}


# The 200 of a streamed request (stream=true), beside the JSON ChatCompletion: its chunks are described
# in artcloud/server/chat_stream.py.
CHAT_STREAM: dict[str, Any] = {
    "description": "a ChatCompletion; with stream=true, Server-Sent Events: `data: {chat.completion.chunk}` "
                   "lines (each choice with the token_ids and logprobs of its delta), then `data: [DONE]`",
    "content": {"text/event-stream": {"schema": {"type": "string"}}},
}


class NDJSONResponse(StreamingResponse):
    media_type = "application/x-ndjson"


def create_app(registry: Registry, token: str) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        quiet_accept_errors(asyncio.get_running_loop())  # out of descriptors: one line a minute, not a traceback a retry
        tasks = [asyncio.create_task(registry.restore()), asyncio.create_task(registry.lifecycle.run())]
        yield
        for task in tasks:
            task.cancel()
        await registry.close()

    app = FastAPI(
        title="artcloud",
        version=__version__,
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
        openapi_url=None,  # served below, behind the token
        responses=errors(401, 413),
    )
    # The last added runs first: the token is checked before a byte of the body is read.
    app.add_middleware(BodyLimit, max_bytes=registry.limits.max_body_bytes)
    app.add_middleware(TokenAuth, token=token, lease=registry.lease)
    _error_handlers(app)

    @app.get("/health", operation_id="health", response_model=wire.Health, response_model_exclude_none=True)
    async def health() -> dict[str, Any]:
        """Anyone may ask (load balancers, launchers waiting for the port): it says nothing private, and
        never renews the lease."""
        return registry.health()

    @app.get("/artcloud/status", operation_id="status", response_model=wire.Status)
    async def status() -> dict[str, Any]:
        """Models, engines, the lease and the limits. Reading it does not renew the lease: a dashboard
        that polls keeps no GPU alive."""
        return registry.status()

    @app.get("/openapi.json", include_in_schema=False)
    async def openapi() -> dict[str, Any]:
        return _with_models(app.openapi(), wire.TrainRequest, wire.SFTChunk, wire.ChatCompletionRequest)

    # ------------------------------------------------------------------------------------- OpenAI

    @app.get("/v1/models", operation_id="list_models", response_model=wire.ModelList)
    async def list_models() -> dict[str, Any]:
        data = [_card(m.name, m) for m in registry.models.values()] + [_card(base, None) for base in registry.hosts]
        return {"object": "list", "data": data}

    @app.get("/v1/models/{model_id:path}", operation_id="get_model", response_model=wire.ModelCard,
             responses=errors(400, 404, 503))
    async def get_model(model_id: str) -> dict[str, Any]:
        return _card(model_id, registry.resolve(model_id).model)

    @app.post("/v1/chat/completions", operation_id="chat_completions", response_model=wire.ChatCompletion,
              responses={200: CHAT_STREAM, **errors(400, 404, 429, 503)}, openapi_extra=_body("ChatCompletionRequest"))
    async def chat_completions(http: Request) -> Any:
        began = time.monotonic()
        raw = await http.body()
        req = await _parse(raw, wire.ChatCompletionRequest)
        if req.stream_options is not None and not req.stream:
            raise ApiError(400, "invalid_request", "stream_options is only allowed with stream=true", "stream_options")
        want_logprobs = req.logprobs is not False  # unset: yes (training needs them; ART scripts never ask)
        if req.top_logprobs and not want_logprobs:
            raise ApiError(400, "invalid_request", "top_logprobs needs logprobs=true", "top_logprobs")
        target = registry.resolve(req.model)
        engine = target.host.engine
        limit = engine.max_context
        if len(raw) > BYTES_PER_TOKEN * limit:  # before the prompt is rendered and tokenised whole (finding 3)
            raise ApiError(400, "context_too_long", f"the request has {len(raw)} bytes, more than {BYTES_PER_TOKEN} per "
                           f"token of this model's context ({limit} tokens): shorten the messages", "messages")
        try:
            prompt = await asyncio.to_thread(_render, engine.tokenizer, req)
        except Exception as e:
            raise ApiError(400, "invalid_messages", f"the chat template cannot render these messages: {e}", "messages") from e
        max_tokens = req.max_completion_tokens or req.max_tokens or DEFAULT_MAX_TOKENS
        if len(prompt) >= limit:
            raise ApiError(400, "context_too_long", f"the prompt has {len(prompt)} tokens; this model takes at most {limit}", "messages")
        max_tokens = min(max_tokens, limit - len(prompt))
        budget = registry.limits.max_request_tokens
        if req.n * max_tokens > budget:
            raise ApiError(400, "too_many_tokens",
                           f"n={req.n} x max_tokens={max_tokens} asks for {req.n * max_tokens} tokens; this server "
                           f"generates at most {budget} per request (artcloud serve --max-request-tokens): "
                           "lower n or max_tokens, or send several requests", "max_tokens")
        temperature = req.temperature
        if temperature is None:
            temperature = target.model.temperature if target.model is not None else 1.0
        params = SamplingParams(temperature=temperature, top_p=req.top_p if req.top_p is not None else 1.0,
                                max_tokens=max_tokens, stop=req.stop, seed=req.seed,
                                top_logprobs=(req.top_logprobs or 0) if want_logprobs else 0)
        if req.stream:
            return await chat_stream.stream(
                batcher=target.host.batcher, key=target.key, request=GenerationRequest(prompt, req.n, params),
                prompt_ids=prompt, tokenizer=engine.tokenizer, want_logprobs=want_logprobs,
                want_token_ids=req.return_token_ids, parse_tools=bool(req.tools),
                include_usage=bool(req.stream_options and req.stream_options.include_usage),
            )
        completions, served = await _unless_gone(http, target.host.batcher.submit(target.key, GenerationRequest(prompt, req.n, params)))
        registry.startup.rollout_done(time.monotonic() - began)  # kept for the first one only (GET /health)
        # On a thread, as the prompt's render: logprobs decode every sampled token and alternative one by one.
        return await asyncio.to_thread(
            chat.completion_response, served_as=served, prompt_ids=prompt, completions=completions,
            tokenizer=engine.tokenizer, want_logprobs=want_logprobs, want_token_ids=req.return_token_ids,
            parse_tools=bool(req.tools))

    @app.post("/artcloud/heartbeat", operation_id="heartbeat", response_model=wire.Heartbeat)
    async def heartbeat() -> dict[str, Any]:
        """A client's sign of life (any authenticated request counts too): the server's lease."""
        return {"ok": True, "version": __version__, "last_request_at": time.time()}  # this request renewed it

    # ------------------------------------------------------------------------------------- models

    @app.post("/artcloud/models", operation_id="register_model",
              response_model=wire.Registered | wire.PromptedRegistered,
              responses={200: {"links": _MODEL_LINKS}, **errors(400, 409, 503)})
    async def register(spec: wire.RegisterRequest) -> dict[str, Any]:
        return await registry.register(spec)

    @app.get("/artcloud/models/{name}", operation_id="get_model_info",
             response_model=wire.ModelInfo | wire.PromptedInfo, responses=errors(400, 404, 503))
    async def model_info(name: str = ModelName) -> dict[str, Any]:
        return registry.with_history(name).info()

    @app.put("/artcloud/models/{name}/temperature", operation_id="set_temperature", response_model=wire.Temperature,
             responses=errors(400, 404, 503))
    async def set_temperature(body: wire.TemperatureRequest, name: str = ModelName) -> dict[str, Any]:
        model = registry.get(name)
        model.temperature = body.temperature
        return {"name": name, "temperature": model.temperature}

    @app.post("/artcloud/models/{name}/checkpoints/prune", operation_id="prune_checkpoints",
              response_model=wire.Pruned, responses=errors(400, 404, 503))
    async def prune_checkpoints(body: wire.PruneRequest, name: str = ModelName) -> dict[str, Any]:
        return await registry.trainer(name).prune(body.best_metric)

    @app.post("/artcloud/models/{name}/fork", operation_id="fork_checkpoint", response_model=wire.ModelInfo,
              responses=errors(400, 404, 409, 503))
    async def fork_checkpoint(body: wire.ForkRequest, name: str = ModelName) -> dict[str, Any]:
        """Start a model that has not trained yet from another model's newest committed checkpoint (at or before
        not_after_step): OpenPipe ART's _experimental_fork_checkpoint. It is then at that checkpoint's step."""
        return await registry.fork(name, body)

    @app.get("/artcloud/models/{name}/state", operation_id="get_state", response_model=wire.ModelState,
             responses=errors(400, 404, 503))
    async def get_state(name: str = ModelName) -> dict[str, Any]:
        """The model's persistent state (OpenPipe ART's read_state) and the step it belongs to."""
        return registry.state(name)

    @app.put("/artcloud/models/{name}/state", operation_id="put_state", response_model=wire.ModelState,
             responses=errors(400, 404, 503))
    async def put_state(body: wire.StateRequest, name: str = ModelName) -> dict[str, Any]:
        """Replace the state, or deep-merge into it (`merge`): ART's overwrite_state and merge_state. It is on the
        server's disk when this answers, on S3 soon after, and in the next checkpoint; a model that resumes at step
        S gets the state written at S (model_state.py)."""
        return await registry.write_state(name, body)

    @app.post("/artcloud/models/{name}/log", operation_id="log_metrics", response_model=wire.HistoryRecord,
              responses=errors(400, 404, 409, 503))
    async def log_metrics(body: wire.LogRequest, name: str = ModelName) -> dict[str, Any]:
        """Record a split's metrics (model.log's aggregates of its trajectories, and the user's own) for a step,
        by default the model's current one (a prompted model's: 0; its records may name any step). The record
        joins the history that GET /artcloud/models/{name} answers and the history.jsonl and reward.svg beside the
        checkpoints (server/history.py)."""
        return await registry.log(name, body)

    # ------------------------------------------------------------------------------------- training

    reading = 0  # training bodies being read and parsed now

    async def read_train_body(request: Request) -> tuple[wire.TrainRequest, str]:
        """The body, read and parsed under --max-train-bodies, off the event loop (server/train_body.py). A body
        takes its slot from its first bytes and must have arrived within BODY_DEADLINE_S (security review 3, N9: one
        byte every 29 s held a slot for good)."""
        nonlocal reading
        chunks = request.stream()
        first = await anext(chunks, b"")
        if reading >= registry.limits.max_train_bodies:
            raise ApiError(429, "too_many_requests", f"{reading} training requests are being read (the limit, artcloud "
                           "serve --max-train-bodies): wait for their answers, then retry")
        reading += 1
        try:
            try:
                raw = first + await asyncio.wait_for(_rest(chunks), train_body.BODY_DEADLINE_S)
            except asyncio.TimeoutError:
                raise ApiError(408, "request_timeout", f"the request body took over {train_body.BODY_DEADLINE_S:.0f} s "
                               "to arrive: send fewer groups per request") from None
            parsed = await train_body.parse_off_loop(raw)
        finally:
            reading -= 1
        if isinstance(parsed, dict):
            raise RequestValidationError([parsed])
        return parsed

    # The body is read by the route, not by FastAPI (which parses on the event loop): its schema is declared here.
    @app.post("/artcloud/models/{name}/train", status_code=202, operation_id="train", response_model=wire.JobSummary,
              responses={202: {"links": _JOB_LINKS}, 200: {"model": wire.JobSummary, "links": _JOB_LINKS,
                                                            "description": "a retried POST: the job its key started"},
                         **errors(400, 404, 408, 409, 429, 503)},
              openapi_extra=_body("TrainRequest"))
    async def train(
        request: Request, name: str = ModelName,
        idempotency_key: str | None = Header(None, alias="Idempotency-Key", min_length=1, max_length=200),
    ) -> JSONResponse:
        trainer = registry.trainer(name)
        req, body_hash = await read_train_body(request)
        key = req.idempotency_key or idempotency_key
        if key:
            existing = trainer.jobs.find_by_key(key)
            if existing is not None and existing.status != "failed":
                return _job_response(_check_same(existing, body_hash), 200)
        registry.lifecycle.check_open()  # a retried POST above still gets its job; nothing new starts
        trainer.check_can_train()
        config = trainer.resolve(req.config)  # the KL reference as a checkpoint folder here (400 if it is none)
        engine = trainer.model.engine
        samples, stats = await asyncio.to_thread(build_samples, engine, req)
        async with trainer.submit_lock:  # a concurrent retry with the same key must not start a second job
            if key:
                existing = trainer.jobs.find_by_key(key)
                if existing is not None and existing.status != "failed":
                    return _job_response(_check_same(existing, body_hash), 200)
            registry.lifecycle.check_open()  # shutdown may have begun while the samples were built
            trainer.check_can_train()
            job = trainer.jobs.create(idempotency_key=key, body_hash=body_hash)
            trainer.submit(job, samples, stats, config)
        return _job_response(job, 202)

    @app.post("/artcloud/models/{name}/sft", status_code=202, operation_id="sft", response_model=wire.JobSummary,
              responses={202: {"links": _JOB_LINKS}, 200: {"model": wire.JobSummary, "links": _JOB_LINKS,
                                                            "description": "a retried POST: the job its key started"},
                         **errors(400, 404, 409, 429, 503)})
    async def sft(body: wire.SFTStart, name: str = ModelName) -> JSONResponse:
        """One supervised fine-tuning call (OpenPipe ART's train_sft): a job that trains the batches then posted to
        POST /artcloud/jobs/{job_id}/sft, one optimizer step each, and commits one step after the last
        (server/sft.py). It waits in the model's queue as a training job does."""
        trainer = registry.trainer(name)
        body_hash = hashlib.sha256(body.model_dump_json(exclude={"idempotency_key"}).encode()).hexdigest()
        async with trainer.submit_lock:
            if body.idempotency_key:
                existing = trainer.jobs.find_by_key(body.idempotency_key)
                if existing is not None and existing.status != "failed":
                    return _job_response(_check_same(existing, body_hash), 200)
            registry.lifecycle.check_open()
            trainer.check_can_train()
            job = trainer.jobs.create(idempotency_key=body.idempotency_key, body_hash=body_hash)
            trainer.submit_sft(job, Feed(total=body.batches, max_grad_norm=body.max_grad_norm))
        return _job_response(job, 202)

    @app.post("/artcloud/jobs/{job_id}/sft", operation_id="sft_batches", response_model=wire.SFTAccepted,
              responses=errors(400, 404, 409, 413),
              openapi_extra=_body("SFTChunk"))
    async def sft_batches(request: Request, job_id: str = JobId) -> dict[str, Any]:
        """The next chunk of an SFT job's batches (`seq` from 0; `last` ends the job). Its rows are checked and
        tokenised now: a bad one is a 400 naming it, and nothing of the chunk trains. It answers once the job has
        room for the chunk (two wait at most), so a client never runs ahead of training; a chunk sent again is
        answered again, not trained twice."""
        feed = registry.find_feed(job_id)
        raw = await request.body()
        if len(raw) > SFT_CHUNK_MAX_BYTES:
            raise ApiError(413, "payload_too_large", f"an SFT chunk holds at most {SFT_CHUNK_MAX_BYTES} bytes, not "
                           f"{len(raw)}: send fewer batches per chunk")
        chunk = await _parse(raw, wire.SFTChunk)
        engine = registry.find_trainer(job_id).model.engine
        answer = await feed.put(chunk, chunk_hash(chunk), partial(prepare, engine, chunk))
        return {"job_id": job_id, **answer}

    @app.get("/artcloud/jobs/{job_id}", operation_id="get_job", response_model=wire.JobSummary,
             responses=errors(400, 404))
    async def job_status(job_id: str = JobId) -> dict[str, Any]:
        return registry.find_job(job_id).summary()

    # response_class=Response (no media type of its own), not NDJSONResponse: FastAPI would declare
    # every response of the route, its JSON errors included, as application/x-ndjson.
    @app.get("/artcloud/jobs/{job_id}/events", operation_id="get_job_events", response_class=Response,
             responses={200: {"description": "one JSON event per line (Event); a blank line is a keep-alive",
                              "content": {"application/x-ndjson": {"schema": {"type": "string"}}}},
                        **errors(400, 404)})
    async def job_events(
        job_id: str = JobId, after: int = Query(0, ge=0), follow: bool = Query(True)
    ) -> NDJSONResponse:
        job = registry.find_job(job_id)
        if after > len(job.events) and job.done:
            raise ApiError(400, "invalid_cursor", f"job {job_id} has {len(job.events)} events; after={after} is past its end", "after")

        async def lines():
            async for event in job.follow(after, follow=follow, stop=lambda: registry.lifecycle.draining):
                yield "\n" if event is None else event.model_dump_json() + "\n"

        return NDJSONResponse(lines())

    # ------------------------------------------------------------------------------------- shutdown

    @app.post("/artcloud/shutdown", operation_id="shutdown", response_model=wire.ShutdownAnswer,
              responses=errors(400))
    async def shutdown(body: wire.ShutdownRequest | None = None) -> JSONResponse:
        """From now on training POSTs get 409 shutting_down. Waits up to wait_for_training_s for queued and
        running jobs, pushes every model's newest committed checkpoint to S3, answers, and only then asks
        the process to exit (the lifespan exit releases the S3 claims). Calling it again is harmless."""
        wait = body.wait_for_training_s if body is not None else 0.0
        log.warning("shutdown requested (waiting up to %.0f s for training): pushing checkpoints, then exiting", wait)
        models = await registry.lifecycle.shutdown(wait)
        return JSONResponse({"ok": True, "models": models}, background=BackgroundTask(registry.lifecycle.exit_soon))

    return app


async def _unless_gone(request: Request, work: Any) -> Any:
    """`work`'s result, or, if the client disconnects first, `work` cancelled (the batcher then drops the
    request: never generated, or its rows out of the batch at the next step) and a 499 nobody reads. The body
    was read already: the next ASGI message is the disconnect (or nothing, until the answer is sent)."""
    task = asyncio.ensure_future(work)

    async def gone() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(gone())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if not task.done():
        task.cancel()
        raise ApiError(499, "client_closed_request", "the client went away before its answer")
    return task.result()


def _card(model_id: str, model: ServedModel | None) -> dict[str, Any]:
    """An OpenAI model card: a registered model's (`model`), else a loaded base model's."""
    if model is None:
        return {"id": model_id, "object": "model", "owned_by": "artcloud", "root": model_id}
    return {"id": model_id, "object": "model", "owned_by": model.spec.project, "root": model.spec.base_model,
            "step": model.step}


M = TypeVar("M", bound=BaseModel)
INLINE_PARSE_BYTES = 64 * 1024  # a body up to this is parsed on the event loop; a bigger one in a thread
BYTES_PER_TOKEN = 64  # a chat request over this many bytes per token of the model's context cannot fit it


def _body(model: str) -> dict[str, Any]:
    """The schema of a JSON body that a route reads itself (see _parse): `model`, added by _with_models."""
    return {"requestBody": {"required": True, "content": {"application/json": {
        "schema": {"$ref": f"#/components/schemas/{model}"}}}}}


async def _parse(raw: bytes, model: type[M]) -> M:
    """A route's JSON body as `model`, parsed and validated off the event loop when it is big (security review 3,
    finding 3: a 48 MiB chat body held the loop for 11 s), with FastAPI's error for the first fault; the error holds
    no copy of the input (pydantic would convert a whole over-long list to Python objects for it)."""
    try:
        if len(raw) <= INLINE_PARSE_BYTES:
            return model.model_validate_json(raw)
        return await asyncio.to_thread(model.model_validate_json, raw)
    except ValidationError as e:
        first = e.errors(include_url=False, include_input=False)[0]
        raise RequestValidationError([{**first, "loc": ("body", *first["loc"])}]) from None


async def _rest(chunks: Any) -> bytes:
    return b"".join([chunk async for chunk in chunks])


def _render(tokenizer: Any, req: wire.ChatCompletionRequest) -> list[int]:
    return chat.render_prompt(tokenizer, [m.model_dump(exclude_none=True) for m in req.messages], req.tools)


def _with_models(schema: dict[str, Any], *models: type[BaseModel]) -> dict[str, Any]:
    """Add to the schema's components the models a route reads itself (so FastAPI never saw them)."""
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    for model in models:
        if model.__name__ not in components:
            own = model.model_json_schema(ref_template="#/components/schemas/{model}")
            for name, sub in own.pop("$defs", {}).items():
                components.setdefault(name, sub)
            components[model.__name__] = own
    return schema


def _check_same(job: Job, body_hash: str) -> Job:
    if job.meta.get("request_sha256") != body_hash:
        raise ApiError(409, "idempotency_conflict", f"idempotency key already used for job {job.id} with a different "
                       "request; use a new key for new data", "idempotency_key")
    return job


def _job_response(job: Job, status: int) -> JSONResponse:
    body = {**job.summary(), "events_url": f"/artcloud/jobs/{job.id}/events"}
    return JSONResponse(body, status_code=status)


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
